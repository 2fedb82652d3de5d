//! Sequence operations, slot search and placement (`findSlot`, `prepareBatch` and their
//! packed forms), and the slot restorer that rolls placements back.

use llama_kv_cache as core;
use llama_kv_cache::{PrepareOptions, UBatch};
use napi::bindgen_prelude::*;
use napi_derive::napi;

use super::restorer::SlotRestorer;
use super::KvCache;
use crate::args::{i32_named, i32v, opt_i32, u32v, I32Copy, I32s, Num, Obj};
use crate::error::{err, from_core, Code, JsResult};
use crate::options;
use crate::types::{PlacedCells, PrepareBatchOptions, Slot, UBatchInput};

/// Options of `prepareBatchPacked`.
#[napi(object, object_to_js = false)]
pub struct PrepareBatchPackedOptions {
    /// Move `head` past the slot afterwards, as llama.cpp's decode of the seed's era did. Default true.
    pub advance_head: Option<bool>,
    /// The cells' extensions of a cache with a `cellExt`: three numbers (x, y, tok) per token.
    #[napi(ts_type = "Int32Array | null")]
    pub ext: Option<I32s>,
}

crate::args::option_names!(PrepareBatchPackedOptions: "advanceHead", "ext");

#[napi]
impl KvCache {
    /// Removes `seqId` (-1: every sequence) from cells with positions in `[p0, p1)`; negative
    /// bounds are open. Returns false when a recurrent cache refuses a partial removal.
    #[napi]
    pub fn seq_rm(
        &self,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "number")] p0: Option<Num>,
        #[napi(ts_arg_type = "number")] p1: Option<Num>,
    ) -> Result<bool, Code> {
        let (s, p0, p1) = (
            i32v("seqId", seq_id)?,
            opt_i32("p0", p0, -1)?,
            opt_i32("p1", p1, -1)?,
        );
        self.with_memory(|c| c.seq_rm(s, p0, p1).map_err(from_core))
    }

    /// Adds `dst` to the cells of `src` with positions in `[p0, p1)`.
    #[napi]
    pub fn seq_cp(
        &self,
        #[napi(ts_arg_type = "number")] src: Num,
        #[napi(ts_arg_type = "number")] dst: Num,
        #[napi(ts_arg_type = "number")] p0: Option<Num>,
        #[napi(ts_arg_type = "number")] p1: Option<Num>,
    ) -> Result<(), Code> {
        let (s, d) = (i32v("src", src)?, i32v("dst", dst)?);
        let (p0, p1) = (opt_i32("p0", p0, -1)?, opt_i32("p1", p1, -1)?);
        self.with_memory(|c| c.seq_cp(s, d, p0, p1).map_err(from_core))
    }

    /// Frees every cell not owned by `seqId` and drops other sequences from the rest.
    #[napi]
    pub fn seq_keep(&self, #[napi(ts_arg_type = "number")] seq_id: Num) -> Result<(), Code> {
        let s = i32v("seqId", seq_id)?;
        self.with_memory(|c| c.seq_keep(s).map_err(from_core))
    }

    /// Adds `delta` to positions of `seqId` in `[p0, p1)`; the K-shift is applied by `update`.
    /// `seqId` -1 matches no cell but still moves the search head to 0, as in llama.cpp.
    #[napi]
    pub fn seq_add(
        &self,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "number")] p0: Num,
        #[napi(ts_arg_type = "number")] p1: Num,
        #[napi(ts_arg_type = "number")] delta: Num,
    ) -> Result<(), Code> {
        let (s, p0, p1, d) = range_args(seq_id, p0, p1, ("delta", delta))?;
        self.with_memory(|c| c.seq_add(s, p0, p1, d).map_err(from_core))
    }

    /// Divides positions of `seqId` in `[p0, p1)` by `d` (> 0). `seqId` -1 matches no cell and
    /// changes nothing, as in llama.cpp.
    #[napi]
    pub fn seq_div(
        &self,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "number")] p0: Num,
        #[napi(ts_arg_type = "number")] p1: Num,
        #[napi(ts_arg_type = "number")] d: Num,
    ) -> Result<(), Code> {
        let (s, p0, p1, d) = range_args(seq_id, p0, p1, ("d", d))?;
        self.with_memory(|c| c.seq_div(s, p0, p1, d).map_err(from_core))
    }

    /// Largest position of `seqId`. For an empty sequence: 0 in a `kv` cache, as llama.cpp of
    /// the seed's era; -1 in today's memories (`iswa`), as llama.cpp 0.1.161.
    #[napi]
    pub fn seq_pos_max(&self, #[napi(ts_arg_type = "number")] seq_id: Num) -> Result<i32, Code> {
        let s = i32v("seqId", seq_id)?;
        self.with_memory(|c| c.seq_pos_max(s).map_err(from_core))
    }

    /// Smallest position of `seqId`, -1 for an empty sequence.
    #[napi]
    pub fn seq_pos_min(&self, #[napi(ts_arg_type = "number")] seq_id: Num) -> Result<i32, Code> {
        let s = i32v("seqId", seq_id)?;
        self.with_memory(|c| c.seq_pos_min(s).map_err(from_core))
    }

    /// Number of cells owned by `seqId`.
    #[napi]
    pub fn seq_cell_count(&self, #[napi(ts_arg_type = "number")] seq_id: Num) -> Result<u32, Code> {
        let s = i32v("seqId", seq_id)?;
        self.with("seqCellCount", |c| c.seq_cell_count(s).map_err(from_core))
    }

    /// Frees every cell and zeroes the tensors.
    #[napi]
    pub fn clear(&self) -> Result<(), Code> {
        self.with_memory(|c| {
            let cleared = c.clear().map_err(from_core);
            self.shared.handle.account(c);
            cleared
        })
    }

    /// Places a ubatch (llama.cpp's `find_slot`). Returns null when it does not fit.
    #[napi]
    pub fn find_slot(
        &self,
        #[napi(ts_arg_type = "UBatchInput")] ubatch: Obj<UBatchInput>,
    ) -> Result<Option<Slot>, Code> {
        let ub = to_ubatch(ubatch.0)?;
        self.with("findSlot", |c| {
            Ok(c.find_slot(&ub).map_err(from_core)?.map(slot))
        })
    }

    /// `findSlot` for a ubatch in llama_batch's packed form, without building a JS object: the
    /// fast path for decoding a token at a time. `pos` holds each token's position; `seqIds`
    /// holds one seq id per group, or, with `nSeqIds` (llama_batch's `n_seq_id`), `nSeqIds[g]`
    /// ids for group `g`, all groups' ids one after another. `nSeqTokens` is the tokens per group
    /// (default 1, llama.cpp's simple split). `ext` is the cells' extensions of a cache with a
    /// `cellExt`, three numbers (x, y, tok) per token. Returns the slot's first cell (`head`; the
    /// slot holds one cell per token, or per group in a recurrent cache, and `n` is the `n`
    /// getter), or null when the ubatch does not fit.
    #[napi]
    pub fn find_slot_packed(
        &self,
        #[napi(ts_arg_type = "Int32Array")] pos: I32s,
        #[napi(ts_arg_type = "Int32Array")] seq_ids: I32s,
        #[napi(ts_arg_type = "Int32Array | null")] n_seq_ids: Option<I32s>,
        #[napi(ts_arg_type = "number")] n_seq_tokens: Option<Num>,
        #[napi(ts_arg_type = "Int32Array | null")] ext: Option<I32s>,
    ) -> Result<Option<u32>, Code> {
        let ub = packed(&pos, &seq_ids, n_seq_ids, n_seq_tokens, ext)?;
        self.with("findSlotPacked", |c| {
            Ok(c.find_slot(&ub).map_err(from_core)?.map(|s| s.head))
        })
    }

    /// The cache-side steps of llama.cpp's decode for one ubatch: head reset heuristic,
    /// `findSlot`, `n` update, head advance. Returns null when it does not fit.
    #[napi]
    pub fn prepare_batch(
        &self,
        #[napi(ts_arg_type = "UBatchInput")] ubatch: Obj<UBatchInput>,
        #[napi(ts_arg_type = "PrepareBatchOptions")] options: Option<Obj<PrepareBatchOptions>>,
    ) -> Result<Option<Slot>, Code> {
        let ub = to_ubatch(ubatch.0)?;
        let opts = PrepareOptions {
            advance_head: options.and_then(|o| o.0.advance_head).unwrap_or(true),
        };
        self.with("prepareBatch", |c| {
            Ok(c.prepare_batch(&ub, opts).map_err(from_core)?.map(slot))
        })
    }

    /// `prepareBatch` for a ubatch in llama_batch's packed form (the arrays of `findSlotPacked`;
    /// the cells' extensions, of a cache with a `cellExt`, are `options.ext`), for a decode loop
    /// that refills the same `Int32Array`s. Returns the slot's first cell, or null when the
    /// ubatch does not fit; the slot's `n` is then the `n` getter and its `len` the tokens
    /// (groups, in a recurrent cache) passed, for `SlotRestorer.save`. The trailing `ext`
    /// argument is deprecated (use `options.ext`; it goes in the next minor version), and
    /// giving both is `ERR_KV_INVALID_ARG`.
    #[napi]
    pub fn prepare_batch_packed(
        &self,
        #[napi(ts_arg_type = "Int32Array")] pos: I32s,
        #[napi(ts_arg_type = "Int32Array")] seq_ids: I32s,
        #[napi(ts_arg_type = "Int32Array | null")] n_seq_ids: Option<I32s>,
        #[napi(ts_arg_type = "number")] n_seq_tokens: Option<Num>,
        #[napi(ts_arg_type = "PrepareBatchPackedOptions")] options: Option<
            Obj<PrepareBatchPackedOptions>,
        >,
        #[napi(ts_arg_type = "Int32Array | null")] ext: Option<I32s>,
    ) -> Result<Option<u32>, Code> {
        // `options` is converted (its getters have run): only now are the arrays read
        let (advance_head, option_ext) =
            options.map_or((None, None), |o| (o.0.advance_head, o.0.ext));
        let ext = match (option_ext, ext) {
            (Some(_), Some(_)) => {
                return Err(err(
                    Code::InvalidArg,
                    "ext is given twice: as options.ext and as the deprecated last argument",
                ))
            }
            (e, None) | (None, e) => e,
        };
        let opts = PrepareOptions {
            advance_head: advance_head.unwrap_or(true),
        };
        let ub = packed(&pos, &seq_ids, n_seq_ids, n_seq_tokens, ext)?;
        self.with("prepareBatchPacked", |c| {
            Ok(c.prepare_batch(&ub, opts)
                .map_err(from_core)?
                .map(|s| s.head))
        })
    }

    /// Places the ubatches of one decode, all or none, on every kind. In a memory of today's
    /// llama.cpp (kinds 'iswa' and 'hybrid') as llama.cpp 0.1.161's `prepare` and `apply` do
    /// in each part: cell by cell from the head, reusing the cells a sequence's window no
    /// longer sees (and purging its older positions); a recurrent part takes each group's
    /// sequence into its state cell (give it each sequence's tokens as one group,
    /// `nSeqTokens`). A 'kv' or 'recurrent' cache places each ubatch with the seed's
    /// `findSlot` (part 'whole'). Returns, per ubatch, where its tokens went in each part and
    /// stream (for a recurrent state: each group's state cell, and the group's first token);
    /// or null, with the memory unchanged, when some ubatch does not fit.
    #[napi]
    pub fn place(
        &self,
        #[napi(ts_arg_type = "UBatchInput[]")] ubatches: Vec<Obj<UBatchInput>>,
    ) -> Result<Option<Vec<Vec<PlacedCells>>>, Code> {
        let ubs = ubatches
            .into_iter()
            .map(|u| to_ubatch(u.0))
            .collect::<JsResult<Vec<UBatch>>>()?;
        self.with_memory(|m| {
            let placed = m.place(&ubs).map_err(from_core)?;
            Ok(placed.map(|all| {
                (all.into_iter())
                    .map(|ub| ub.into_iter().map(PlacedCells::from).collect())
                    .collect()
            }))
        })
    }

    /// Takes llama.cpp's slot restorer (`llama_kv_slot_restorer`) at the start of a decode: it
    /// keeps `head` and `n`; `save` every slot `prepareBatch` / `findSlot` returns, and `restore`
    /// on a failed ubatch to roll them all back as the seed does.
    #[napi]
    pub fn slot_restorer(&self) -> Result<SlotRestorer, Code> {
        let inner = self.with("slotRestorer", |c| Ok(c.slot_restorer()))?;
        Ok(SlotRestorer::new(self.shared.clone(), inner))
    }
}

/// The ubatch of `findSlotPacked` / `prepareBatchPacked`, read from its arrays. Called once
/// every argument is converted, so no getter can detach an array while it is read.
fn packed(
    pos: &I32s,
    seq_ids: &I32s,
    n_seq_ids: Option<I32s>,
    n_seq_tokens: Option<Num>,
    ext: Option<I32s>,
) -> JsResult<UBatch> {
    // SAFETY: every argument of the call is converted; the values are copied into the ubatch
    // before any JS can run
    unsafe {
        let ext = match ext {
            Some(e) => options::cell_exts(e.borrow("ext")?)?,
            None => Vec::new(),
        };
        let n_seq_ids = n_seq_ids
            .as_ref()
            .map(|n| n.borrow("nSeqIds"))
            .transpose()?;
        let pos = pos.borrow("pos")?;
        if pos.is_empty() {
            return Err(err(
                Code::InvalidArg,
                "ubatch has no tokens: pos is empty (an empty Int32Array, or one whose buffer \
                 was detached)",
            ));
        }
        let mut ub =
            options::packed_ubatch(pos, seq_ids.borrow("seqIds")?, n_seq_ids, n_seq_tokens)?;
        ub.ext = ext;
        Ok(ub)
    }
}

/// `(seqId, p0, p1, <named value>)` of `seqAdd` / `seqDiv`.
fn range_args(
    seq_id: Num,
    p0: Num,
    p1: Num,
    (name, v): (&str, Num),
) -> JsResult<(i32, i32, i32, i32)> {
    Ok((
        i32v("seqId", seq_id)?,
        i32v("p0", p0)?,
        i32v("p1", p1)?,
        i32v(name, v)?,
    ))
}

fn slot(s: core::Slot) -> Slot {
    Slot {
        head: s.head,
        len: s.len,
        n: s.n,
    }
}

/// A JS ubatch (its typed array `pos` was copied at conversion: see [`crate::args::I32Copy`]).
fn to_ubatch(u: UBatchInput) -> JsResult<UBatch> {
    let pos = I32Copy::of("pos", u.pos)?;
    let seq_ids = u
        .seq_ids
        .iter()
        .enumerate()
        .map(|(g, ids)| match ids {
            Either::A(id) => Ok(vec![i32_named(|| format!("seqIds[{g}]"), *id)?]),
            Either::B(list) => list
                .iter()
                .enumerate()
                .map(|(j, &id)| i32_named(|| format!("seqIds[{g}][{j}]"), id))
                .collect(),
        })
        .collect::<JsResult<Vec<Vec<i32>>>>()?;
    let n_seq_tokens = match u.n_seq_tokens {
        Some(n) => u32v("nSeqTokens", n)?,
        None => 1,
    };
    let ext = match u.ext {
        None => Vec::new(),
        Some(ext) => options::cell_exts(&I32Copy::of("ext", ext)?)?,
    };
    Ok(UBatch {
        pos,
        n_seq_tokens,
        seq_ids,
        ext,
    })
}

/// Where a recurrent ubatch went: each group's sequence has its state cell (where its R and S
/// rows go), written from the group's first token.
impl From<core::Placement> for PlacedCells {
    fn from(p: core::Placement) -> Self {
        PlacedCells {
            part: p.role.name().into(),
            stream: p.stream,
            tokens: Uint32Array::new(p.tokens),
            cells: Uint32Array::new(p.cells),
        }
    }
}
