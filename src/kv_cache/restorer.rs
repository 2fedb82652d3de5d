//! `SlotRestorer`: the seed's `llama_kv_slot_restorer` for JS, bound to the cache it was taken
//! from. Conversion only; the rollback itself is the core's `restore_slots`.

use std::sync::Arc;

use llama_kv_cache as core;
use napi::bindgen_prelude::*;
use napi_derive::napi;

use crate::args::{u32v, Obj};
use crate::error::{from_core, Code};
use crate::queue::Shared;
use crate::types::SlotInput;

/// llama.cpp's slot restorer (the seed's `llama_kv_slot_restorer`), from
/// `cache.slotRestorer()`. Exact to the seed: `restore()` puts back `head` and `n` as they were
/// when it was taken, then removes every sequence from the cells whose positions lie in each
/// saved slot's cell range (the seed's `seq_rm(-1, c0, c1)` passes cell indices as positions);
/// a recurrent cache is cleared. Nothing happens unless a found slot was saved.
#[napi]
pub struct SlotRestorer {
    shared: Arc<Shared>,
    inner: core::SlotRestorer,
}

impl SlotRestorer {
    pub(crate) fn new(shared: Arc<Shared>, inner: core::SlotRestorer) -> Self {
        SlotRestorer { shared, inner }
    }
}

#[napi]
impl SlotRestorer {
    /// Records a slot returned by `prepareBatch` / `findSlot`; `null` (no slot found) is ignored.
    #[napi]
    pub fn save(
        &mut self,
        #[napi(ts_arg_type = "Slot | null")] slot: Option<Obj<SlotInput>>,
    ) -> Result<(), Code> {
        let slot = match slot {
            None => None,
            Some(Obj(s)) => Some(core::Slot {
                head: u32v("slot.head", s.head)?,
                len: u32v("slot.len", s.len)?,
                n: s.n.map_or(Ok(0), |n| u32v("slot.n", n))?,
            }),
        };
        self.inner.save(slot.as_ref());
        Ok(())
    }

    /// Rolls back every saved slot on the cache this restorer was taken from (a synchronous
    /// call: `ERR_KV_BUSY` while async work is pending).
    #[napi]
    pub fn restore(&self) -> Result<(), Code> {
        self.shared.with(|m| {
            m.kv("SlotRestorer.restore")
                .and_then(|c| c.restore_slots(&self.inner))
                .map_err(from_core)
        })
    }

    /// `head` when the restorer was taken.
    #[napi(getter)]
    pub fn head(&self) -> u32 {
        self.inner.head()
    }

    /// `n` when the restorer was taken.
    #[napi(getter)]
    pub fn n(&self) -> u32 {
        self.inner.n()
    }

    /// The saved slots as cell ranges `[c0, c1)`.
    #[napi(getter, ts_return_type = "Array<[number, number]>")]
    pub fn boundaries(&self) -> Vec<Vec<u32>> {
        self.inner
            .boundaries()
            .iter()
            .map(|&(a, b)| vec![a, b])
            .collect()
    }

    /// Whether `restore()` will change anything (a found slot was saved).
    #[napi(getter)]
    pub fn armed(&self) -> bool {
        self.inner.armed()
    }
}
