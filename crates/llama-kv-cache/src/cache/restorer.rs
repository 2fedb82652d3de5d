//! The seed's `llama_kv_slot_restorer`: the seed-era decode takes one when it starts, saves
//! every slot `find_slot` returned, and on a failed ubatch rolls them all back.
//!
//! Exact to the seed, quirks included: `restore` puts back `head` and `n` as they were when the
//! restorer was taken, then removes every sequence from the cells whose *positions* lie in each
//! saved slot's cell range (`seq_rm(-1, c0, c1)`, cell indices passed as positions, which may
//! lower `head` again). A recurrent cache cannot lose part of a state, so it is cleared
//! (`seq_rm(-1, -1, -1)`). Nothing happens unless a found slot was saved.

use crate::cache::slot::Slot;
use crate::cache::SeedCache;
use crate::error::Result;

/// The cache's `head` and `n` at a decode's start plus the slots placed since
/// (`llama_kv_slot_restorer`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotRestorer {
    head: u32,
    n: u32,
    boundaries: Vec<(u32, u32)>,
    do_restore: bool,
    recurrent: bool,
}

impl SlotRestorer {
    /// Records a slot `find_slot` / `prepare_batch` returned; `None` (no slot found) is ignored,
    /// as the seed ignores a failed slot info. Recurrent slots carry no boundaries (the seed's
    /// recurrent slot info is `(0, 0)`), but arm the restore all the same.
    pub fn save(&mut self, slot: Option<&Slot>) {
        let Some(slot) = slot else {
            return;
        };
        self.do_restore = true;
        let (c0, c1) = if self.recurrent {
            (0, 0)
        } else {
            (slot.head, slot.head.saturating_add(slot.len))
        };
        if c0 != c1 {
            self.boundaries.push((c0, c1));
        }
    }

    /// `head` when the restorer was taken.
    pub fn head(&self) -> u32 {
        self.head
    }

    /// `n` when the restorer was taken.
    pub fn n(&self) -> u32 {
        self.n
    }

    /// The saved slots as cell ranges `[c0, c1)`.
    pub fn boundaries(&self) -> &[(u32, u32)] {
        &self.boundaries
    }

    /// Whether `restore` will change anything (a found slot was saved).
    pub fn armed(&self) -> bool {
        self.do_restore
    }
}

impl SeedCache {
    /// A restorer holding the current `head` and `n`, to take when a decode starts.
    pub fn slot_restorer(&self) -> SlotRestorer {
        SlotRestorer {
            head: self.head,
            n: self.n,
            boundaries: Vec::new(),
            do_restore: false,
            recurrent: self.params.recurrent,
        }
    }

    /// Rolls back every slot saved in `restorer` (see the module documentation).
    pub fn restore_slots(&mut self, restorer: &SlotRestorer) -> Result<()> {
        if !restorer.do_restore {
            return Ok(());
        }
        // as the seed: the head as it was, which a failed slot search can leave at `size`
        // (clamped only against a restorer taken from a smaller cache)
        self.head = restorer.head.min(self.params.size);
        self.n = restorer.n.min(self.params.size);
        if self.params.recurrent {
            self.seq_rm(-1, -1, -1)?;
            return Ok(());
        }
        for &(c0, c1) in &restorer.boundaries {
            // the seed passes cell indices where seq_rm expects positions; an index beyond
            // i32::MAX cannot name a position, and a negative bound would mean "open"
            let p0 = i32::try_from(c0).unwrap_or(i32::MAX);
            let p1 = i32::try_from(c1).unwrap_or(i32::MAX);
            self.seq_rm(-1, p0, p1)?;
        }
        Ok(())
    }
}
