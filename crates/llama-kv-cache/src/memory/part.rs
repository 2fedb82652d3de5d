//! One part of a memory: what it is ([`PartInfo`], for a live part and a planned one alike),
//! and an attention part before it is built ([`PartPlan`]), which the iSWA and hybrid
//! memories are built from.

use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::memory::attention::{stream_count, AttentionCache};
use crate::memory::placement::Window;
use crate::params::CacheParams;
use crate::state::parts::PartRole;

/// What one part of a memory is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartInfo {
    /// Its role: `whole` for a memory of one part, `base` / `swa` for iSWA.
    pub role: PartRole,
    /// The model layers it holds, ascending.
    pub layers: Vec<u32>,
    /// Cells per stream.
    pub size: u32,
    /// Streams (1 when unified).
    pub n_stream: u32,
    /// Cells with a position, over all streams.
    pub used_cells: u32,
    /// The sliding window (none for a full-attention part).
    pub window: Window,
    /// K type.
    pub type_k: GgmlType,
    /// V type; `None` for a cache that keeps no V (multi-head latent attention).
    pub type_v: Option<GgmlType>,
    /// Hadamard rotation of K and V (0: none).
    pub n_rot: (u32, u32),
    /// Bytes of its K and V tensors, over all streams.
    pub bytes: u64,
}

impl PartInfo {
    /// A part of `n_stream` streams of `params` holding model layers `layers`; `used_cells`
    /// and `bytes` are the caller's (a live part's own, or 0 and the planned bytes).
    pub(crate) fn of(
        role: PartRole,
        layers: Vec<u32>,
        params: &CacheParams,
        n_stream: u32,
        window: Window,
        used_cells: u32,
        bytes: u64,
    ) -> PartInfo {
        PartInfo {
            role,
            layers,
            size: params.size,
            n_stream,
            used_cells,
            window,
            type_k: params.type_k,
            type_v: (!params.no_v).then_some(params.type_v),
            n_rot: (params.n_rot_k, params.n_rot_v),
            bytes,
        }
    }
}

/// One attention part before it is built: the parameters of each stream, and its layers
/// (the indices of the memory it belongs to: model layers, or a hybrid's attention layers).
#[derive(Clone, Debug)]
pub(crate) struct PartPlan {
    pub role: PartRole,
    pub layers: Vec<u32>,
    pub params: CacheParams,
    pub unified: bool,
    pub window: Window,
}

impl PartPlan {
    /// Builds the part.
    pub(crate) fn build(&self) -> Result<AttentionCache> {
        AttentionCache::new(self.params.clone(), self.unified, self.window)
    }

    /// What the part will be, empty, its layers named by `layer` (own index to the one the
    /// memory's users see); refused as building it would be.
    pub(crate) fn info(&self, layer: impl Fn(u32) -> u32) -> Result<PartInfo> {
        self.params.validate_part()?;
        let n_stream = stream_count(&self.params, self.unified);
        planned(
            self.role,
            self.layers.iter().map(|&k| layer(k)).collect(),
            &self.params,
            n_stream,
            self.window,
        )
    }
}

/// A part of `n_stream` streams of `params` with no cell used, and its tensor bytes.
pub(crate) fn planned(
    role: PartRole,
    layers: Vec<u32>,
    params: &CacheParams,
    n_stream: u32,
    window: Window,
) -> Result<PartInfo> {
    let bytes = params
        .tensor_bytes()?
        .checked_mul(u64::from(n_stream))
        .ok_or_else(|| {
            KvError::OutOfRange(format!("{n_stream} streams: the tensors' size overflows"))
        })?;
    Ok(PartInfo::of(
        role, layers, params, n_stream, window, 0, bytes,
    ))
}
