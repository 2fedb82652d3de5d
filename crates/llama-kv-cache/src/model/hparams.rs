//! The header's hyperparameters as llama.cpp's `load_hparams` reads them: metadata under the
//! architecture's prefix with its defaults and type rules ([`Keys`]), and the sizes every
//! architecture states (layers, heads, head widths) that the rest of a model's reading builds on.

use crate::error::{KvError, Result};
use crate::model::gguf::{GgufHeader, GgufValue};

/// llama.cpp's `LLAMA_MAX_LAYERS`.
pub const MAX_LAYERS: u32 = 512;

/// Reads metadata under the architecture's prefix with llama.cpp's defaults and type rules.
pub(super) struct Keys<'a> {
    pub(super) h: &'a GgufHeader,
    pub(super) arch: &'a str,
}

impl Keys<'_> {
    pub(super) fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    pub(super) fn raw(&self, suffix: &str) -> Option<(String, &GgufValue)> {
        let k = self.key(suffix);
        self.h.get(&k).map(|v| (k, v))
    }

    pub(super) fn u32_opt(&self, suffix: &str) -> Result<Option<u32>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        let n = v.as_int().ok_or_else(|| wrong_type(&k, "an integer", v))?;
        u32::try_from(n)
            .map(Some)
            .map_err(|_| KvError::InvalidModel(format!("{k} = {n} is not a uint32")))
    }

    pub(super) fn u32_req(&self, suffix: &str) -> Result<u32> {
        self.u32_opt(suffix)?.ok_or_else(|| self.missing(suffix))
    }

    pub(super) fn f32_opt(&self, suffix: &str) -> Result<Option<f32>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        v.as_float()
            .map(|f| Some(f as f32))
            .ok_or_else(|| wrong_type(&k, "a float", v))
    }

    pub(super) fn bool_opt(&self, suffix: &str) -> Result<Option<bool>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| wrong_type(&k, "a bool", v))
    }

    pub(super) fn str_opt(&self, suffix: &str) -> Result<Option<String>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        v.as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| wrong_type(&k, "a string", v))
    }

    /// `get_key_or_arr`: one value for every layer, or an array of exactly `n_layer` integers.
    pub(super) fn per_layer(&self, suffix: &str, n_layer: u32) -> Result<Option<Vec<u32>>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        if let GgufValue::Array { len, values, .. } = v {
            if *len != n_layer as u64 {
                return Err(KvError::InvalidModel(format!(
                    "{k} has {len} values, expected one per layer ({n_layer})"
                )));
            }
            let values = values
                .as_ref()
                .ok_or_else(|| KvError::InvalidModel(format!("{k} is too long ({len} values)")))?;
            return values
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    x.as_int()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| wrong_type(&format!("{k}[{i}]"), "a uint32", x))
                })
                .collect::<Result<Vec<u32>>>()
                .map(Some);
        }
        Ok(Some(vec![self.u32_req(suffix)?; n_layer as usize]))
    }

    /// One flag per layer: an array of exactly `n_layer` bools or integers (non-zero: set), or
    /// one value for every layer.
    pub(super) fn flags_per_layer(&self, suffix: &str, n_layer: u32) -> Result<Option<Vec<bool>>> {
        let Some((key, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        let flag = |key: &str, v: &GgufValue| {
            v.as_bool()
                .or_else(|| v.as_int().map(|n| n != 0))
                .ok_or_else(|| wrong_type(key, "bools or integers", v))
        };
        match v {
            GgufValue::Array { len, values, .. } => {
                if *len != n_layer as u64 {
                    return Err(KvError::InvalidModel(format!(
                        "{key} has {len} values, expected one per layer ({n_layer})"
                    )));
                }
                let values = values.as_ref().ok_or_else(|| {
                    KvError::InvalidModel(format!("{key} is too long ({len} values)"))
                })?;
                values
                    .iter()
                    .map(|v| flag(&key, v))
                    .collect::<Result<_>>()
                    .map(Some)
            }
            v => Ok(Some(vec![flag(&key, v)?; n_layer as usize])),
        }
    }

    pub(super) fn missing(&self, suffix: &str) -> KvError {
        KvError::InvalidModel(format!(
            "the model lacks {} (needed for architecture {:?})",
            self.key(suffix),
            self.arch
        ))
    }
}

/// A product of two header values that must fit a `u32`, as llama.cpp's widths do.
pub(super) fn mul(a: u32, b: u32, what: &str) -> Result<u32> {
    a.checked_mul(b)
        .ok_or_else(|| KvError::InvalidModel(format!("{what} {a} x {b} overflows a uint32")))
}

fn wrong_type(key: &str, want: &str, got: &GgufValue) -> KvError {
    KvError::InvalidModel(format!(
        "{key} must be {want}, got a {} value",
        got.ty().name()
    ))
}

impl<'a> Keys<'a> {
    /// The reader of `h`'s metadata, under its `general.architecture`.
    pub(super) fn of(h: &'a GgufHeader) -> Result<Keys<'a>> {
        let arch = h
            .get("general.architecture")
            .ok_or_else(|| KvError::InvalidModel("the model lacks general.architecture".into()))?
            .as_str()
            .ok_or_else(|| KvError::InvalidModel("general.architecture must be a string".into()))?;
        Ok(Keys { h, arch })
    }
}

/// The sizes every architecture states: context, embedding, layers and the heads of each.
pub(super) struct Hparams {
    /// Trained context length.
    pub(super) n_ctx_train: u32,
    /// Embedding width.
    pub(super) n_embd: u32,
    /// Layers (`block_count`).
    pub(super) n_layer: u32,
    /// Query heads per layer (0 where the model states none).
    pub(super) n_head: Vec<u32>,
    /// K/V heads per layer (as many as the query heads where the model states none).
    pub(super) n_head_kv: Vec<u32>,
}

impl Hparams {
    pub(super) fn read(k: &Keys) -> Result<Hparams> {
        let n_ctx_train = k.u32_req("context_length")?;
        let n_embd = k.u32_req("embedding_length")?;
        let n_layer = k.u32_req("block_count")?;
        if n_layer == 0 || n_layer > MAX_LAYERS {
            return Err(KvError::InvalidModel(format!(
                "{}.block_count = {n_layer}, expected 1..={MAX_LAYERS}",
                k.arch
            )));
        }
        let zeros = vec![0; n_layer as usize];
        let n_head = k
            .per_layer("attention.head_count", n_layer)?
            .unwrap_or(zeros);
        let n_head_kv = k
            .per_layer("attention.head_count_kv", n_layer)?
            .unwrap_or_else(|| n_head.clone());
        Ok(Hparams {
            n_ctx_train,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
        })
    }
}

/// The widths of one attention head, and how many of its dimensions RoPE rotates.
pub(super) struct HeadDims {
    /// Dimensions per K head.
    pub(super) n_embd_head_k: u32,
    /// Dimensions per V head.
    pub(super) n_embd_head_v: u32,
    /// Rotated dimensions per head (`n_rot`).
    pub(super) n_rot: u32,
}

impl HeadDims {
    /// The head widths, by default the embedding split over the first layer's query heads.
    pub(super) fn read(k: &Keys, hp: &Hparams) -> Result<HeadDims> {
        // models without attention heads (Mamba, RWKV) have no head sizes and no RoPE dims
        let Some(head) = hp.n_embd.checked_div(hp.n_head[0]) else {
            return Ok(HeadDims {
                n_embd_head_k: 0,
                n_embd_head_v: 0,
                n_rot: 0,
            });
        };
        let n_embd_head_k = k.u32_opt("attention.key_length")?.unwrap_or(head);
        let n_embd_head_v = k.u32_opt("attention.value_length")?.unwrap_or(head);
        let n_rot = k.u32_opt("rope.dimension_count")?.unwrap_or(n_embd_head_k);
        let arch = k.arch;
        if matches!(arch, "llama" | "deci" | "falcon") && n_rot != n_embd_head_k {
            return Err(KvError::InvalidModel(format!(
                "invalid n_rot: {arch}.rope.dimension_count = {n_rot}, expected the head size {n_embd_head_k}"
            )));
        }
        Ok(HeadDims {
            n_embd_head_k,
            n_embd_head_v,
            n_rot,
        })
    }
}
