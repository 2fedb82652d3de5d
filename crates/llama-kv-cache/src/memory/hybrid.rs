//! llama.cpp 0.1.161's hybrid memory (`llama_memory_hybrid`): an attention cache for the
//! attention layers and a recurrent memory for the others (Jamba, Granite 4, PLaMo 2, LFM2),
//! fed the same ubatches, with 0.1.161's rules for what each accepts.

use crate::cache::io::ReadSummary;
use crate::cache::kshift::UpdateReport;
use crate::cache::KvCache;
use crate::cells::ubatch::UBatch;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::memory::attention::{AttentionCache, Snapshot, StreamSlot, Window};
use crate::memory::iswa::ContextParams;
use crate::memory::recurrent::RecurrentMemory;
use crate::model::{MemoryKind, ModelInfo, RopeKind};
use crate::params::CacheParams;
use crate::state::Layout;
use crate::tensors::rope::ShiftParams;

/// The attention part of a hybrid memory.
pub struct HybridAttention {
    /// The model layers it holds, ascending.
    pub layers: Vec<u32>,
    /// The cache.
    pub cache: AttentionCache,
}

/// The recurrent part of a hybrid memory.
pub struct HybridRecurrent {
    /// The model layers it holds, ascending.
    pub layers: Vec<u32>,
    /// The memory.
    pub memory: RecurrentMemory,
}

/// llama.cpp 0.1.161's `llama_memory_hybrid`.
pub struct HybridCache {
    attn: HybridAttention,
    recr: HybridRecurrent,
    /// Whether the model rotates K by position (Jamba does not).
    rope: bool,
}

impl HybridCache {
    /// The memory 0.1.161 builds for a hybrid `model` in `ctx`: an attention cache of
    /// `n_ctx_seq` cells per stream, and one state cell per sequence.
    pub fn for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<HybridCache> {
        if model.memory != MemoryKind::Hybrid {
            return Err(KvError::Unsupported(format!(
                "the model ({}) is not a hybrid model: its memory is {}",
                model.arch,
                model.memory.name()
            )));
        }
        model.check_live()?;
        let r = model.recurrent.clone().unwrap_or_default();
        let recurrent: Vec<bool> = model.layers.iter().map(|l| l.n_head_kv == 0).collect();
        let pick = |want: bool| -> Vec<u32> {
            (0..model.n_layer)
                .filter(|&il| recurrent[il as usize] == want)
                .collect()
        };
        let (attn_layers, recr_layers) = (pick(false), pick(true));
        let size = ctx.cells_per_stream(model.n_ctx_train)?;
        // a template of every layer, not a cache of its own: each part is checked when built
        // (LFM2's convolution layers have no K/V and no S rows, which no one cache could hold)
        let mut all =
            model.params_of_layers(size, ctx.n_seq_max, ctx.type_k, ctx.type_v, ctx.flash_attn);
        (all.n_rot_k, all.n_rot_v) = model.rotation(ctx.type_k, ctx.type_v);
        // the model's widths without the recurrent state, which only the recurrent part keeps
        let attn = part_params(&all, &attn_layers, size, |il| {
            (all.n_embd_k_gqa[il], all.n_embd_v_gqa[il])
        });
        // recurrent layers keep R (conv) and S (ssm) rows, in f32, one cell per sequence
        let mut recr = part_params(&all, &recr_layers, ctx.n_seq_max.max(1), |_| {
            (r.n_embd_k_s, r.n_embd_v_s)
        });
        recr.type_k = GgmlType::F32;
        recr.type_v = GgmlType::F32;
        (recr.n_rot_k, recr.n_rot_v) = (0, 0);
        Ok(HybridCache {
            attn: HybridAttention {
                layers: attn_layers,
                cache: AttentionCache::new(attn, ctx.unified, Window::FULL)?,
            },
            recr: HybridRecurrent {
                layers: recr_layers,
                memory: RecurrentMemory::new(recr, model.n_layer)?,
            },
            rope: model.rope.kind != RopeKind::None,
        })
    }

    /// The attention part.
    pub fn attention(&self) -> &HybridAttention {
        &self.attn
    }

    /// The recurrent part.
    pub fn recurrent(&self) -> &HybridRecurrent {
        &self.recr
    }

    /// The cache holding model layer `il` (stream `stream` of the attention part, or the
    /// recurrent memory, whose one stream is 0) and its layer index there.
    pub fn route(&self, il: u32, stream: u32) -> Result<(&KvCache, u32)> {
        if let Ok(k) = self.attn.layers.binary_search(&il) {
            return Ok((self.attn.cache.stream(stream)?, k as u32));
        }
        match self.recr.layers.binary_search(&il) {
            Ok(k) if stream == 0 => Ok((self.recr.memory.cache(), k as u32)),
            Ok(_) => Err(KvError::OutOfRange(format!(
                "stream {stream} is out of range [0, 1) for recurrent layer {il}"
            ))),
            Err(_) => Err(self.no_layer(il)),
        }
    }

    /// [`HybridCache::route`], to write rows.
    pub fn route_mut(&mut self, il: u32, stream: u32) -> Result<(&mut KvCache, u32)> {
        let err = self.no_layer(il);
        if let Ok(k) = self.attn.layers.binary_search(&il) {
            return Ok((self.attn.cache.stream_mut(stream)?, k as u32));
        }
        match self.recr.layers.binary_search(&il) {
            Ok(k) if stream == 0 => Ok((self.recr.memory.cache_mut(), k as u32)),
            Ok(_) => Err(KvError::OutOfRange(format!(
                "stream {stream} is out of range [0, 1) for recurrent layer {il}"
            ))),
            Err(_) => Err(err),
        }
    }

    fn no_layer(&self, il: u32) -> KvError {
        KvError::OutOfRange(format!(
            "layer {il} is out of range [0, {})",
            self.attn.layers.len() + self.recr.layers.len()
        ))
    }

    /// Places the ubatches of one decode in both parts (recurrent first, as 0.1.161
    /// prepares it), or (`None`) in neither.
    pub fn place(&mut self, ubatches: &[UBatch]) -> Result<Option<Vec<Vec<StreamSlot>>>> {
        let kept = (
            self.recr.memory.cache().cells.clone(),
            self.recr.memory.cache().head,
            self.recr.memory.cache().n,
        );
        if !self.recr.memory.place(ubatches)? {
            return Ok(None);
        }
        let mut undo = Snapshot::default();
        match self.attn.cache.place_each(ubatches, &mut undo) {
            Ok(Some(slots)) => Ok(Some(slots)),
            other => {
                self.attn.cache.restore(undo);
                let c = self.recr.memory.cache_mut();
                (c.cells, c.head, c.n) = kept;
                other
            }
        }
    }

    /// `seq_rm`: the recurrent part first, which may refuse (then nothing changes).
    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        if seq != -1 {
            self.attn.cache.stream_of("seqRm", seq)?;
        }
        if !self.recr.memory.seq_rm(seq, p0, p1)? {
            return Ok(false);
        }
        self.attn.cache.seq_rm(seq, p0, p1)
    }

    /// `seq_cp` in both parts (the recurrent part shares the source's state cell).
    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        self.attn.cache.stream_of("seqCp source", src)?;
        self.attn.cache.stream_of("seqCp destination", dst)?;
        self.attn.cache.seq_cp(src, dst, p0, p1)?;
        self.recr.memory.seq_cp(src, dst, p0, p1)
    }

    /// `seq_keep` in both parts.
    pub fn seq_keep(&mut self, seq: i32) -> Result<()> {
        self.attn.cache.stream_of("seqKeep", seq)?;
        self.attn.cache.seq_keep(seq)?;
        self.recr.memory.seq_keep(seq)
    }

    /// `seq_add` in both parts.
    pub fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        self.attn.cache.stream_of("seqAdd", seq)?;
        self.attn.cache.seq_add(seq, p0, p1, delta)?;
        self.recr.memory.seq_add(seq, p0, p1, delta)
    }

    /// `seq_div` in both parts.
    pub fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        self.attn.cache.stream_of("seqDiv", seq)?;
        self.attn.cache.seq_div(seq, p0, p1, d)?;
        self.recr.memory.seq_div(seq, p0, p1, d)
    }

    /// Smallest position both parts hold of `seq` (0.1.161: the larger of their minima).
    pub fn seq_pos_min(&self, seq: i32) -> Result<i32> {
        Ok(self
            .attn
            .cache
            .seq_pos_min(seq)?
            .max(self.recr.memory.seq_pos_min(seq)?))
    }

    /// Largest position both parts hold of `seq` (0.1.161: the smaller of their maxima).
    pub fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        Ok(self
            .attn
            .cache
            .seq_pos_max(seq)?
            .min(self.recr.memory.seq_pos_max(seq)?))
    }

    /// Applies a pending K-shift of the attention part (the recurrent part keeps no
    /// rotated rows); `shift` gives the rotation per model layer. A model without RoPE needs
    /// none: its pending shift is done at once.
    pub fn update(&mut self, shift: Option<&ShiftParams>) -> Result<UpdateReport> {
        if !self.rope {
            self.attn.cache.drop_shift();
            return Ok(UpdateReport::default());
        }
        let params = shift.map(|s| s.for_layers(&self.attn.layers));
        self.attn.cache.update(params.as_ref())
    }

    /// Frees every cell of both parts.
    pub fn clear(&mut self) -> Result<()> {
        self.attn.cache.clear()?;
        self.recr.memory.clear()
    }

    /// The state of `seq` (-1: everything) as 0.1.161 writes it: the attention part in
    /// `layout`, then the recurrent part.
    pub fn state_write(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        let mut out = self.attn.cache.state_write(seq, layout)?;
        out.extend(self.recr.memory.state_write(seq)?);
        Ok(out)
    }

    /// Bytes of [`HybridCache::state_write`]`(seq, layout)`.
    pub fn state_size(&self, seq: i32, layout: Layout) -> Result<usize> {
        let recr = self.recr.memory.cache().state_size(seq, Layout::Seed, 1)?;
        Ok(self.attn.cache.state_size(seq, layout)? + recr)
    }

    /// Reads a payload of both parts into `seq` (-1: everything); both are parsed and
    /// checked before either changes.
    pub fn state_read(
        &mut self,
        data: &[u8],
        seq: i32,
        layout: Layout,
    ) -> Result<[ReadSummary; 2]> {
        let attn = self.attn.cache.check_read(data, seq, layout, false)?;
        let (first, second) = data.split_at(attn.len());
        self.recr.memory.check_read(second, seq)?;
        let a = self.attn.cache.apply_read(first, attn, seq)?;
        let r = self.recr.memory.state_read(second, seq)?;
        Ok([a, r])
    }
}

/// The parameters of a part holding `layers` of a model whose every layer `all` describes,
/// with `size` cells and the K/V widths `widths(il)` per model layer.
fn part_params(
    all: &CacheParams,
    layers: &[u32],
    size: u32,
    widths: impl Fn(usize) -> (u32, u32),
) -> CacheParams {
    let mut p = all.clone();
    p.size = size;
    p.n_layer = layers.len() as u32;
    (p.n_embd_k_gqa, p.n_embd_v_gqa) = layers.iter().map(|&il| widths(il as usize)).unzip();
    (p.n_embd_k_s, p.n_embd_v_s) = (0, 0);
    p.recurrent = false;
    p
}
