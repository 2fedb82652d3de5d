//! What a backend holds under a key, told without reading the value, and the removal of
//! values a store must not use (another writer's, or corrupt ones).

use super::PromptStore;
use crate::error::StoreResult;
use crate::key::Key;
use crate::seal::{Broken, TRAILER};

/// What a backend holds under a key, as far as a store can tell without reading the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Presence {
    Absent,
    /// Present (with a secret: tagged by this store's secret).
    Ours,
    /// Present, but tagged by another writer.
    Foreign,
}

impl PromptStore {
    /// What the backend holds under each key: with a secret, a present value's tag is checked
    /// (its last 64 bytes, one round trip), so a value of another writer neither counts as
    /// stored nor stops a put.
    pub(super) fn presence(&self, keys: &[Key]) -> StoreResult<Vec<Presence>> {
        if !self.sealer.authenticated() {
            let present = self.backend.contains_many(keys)?;
            return Ok(present
                .into_iter()
                .map(|p| if p { Presence::Ours } else { Presence::Absent })
                .collect());
        }
        let tails = self.backend.get_tails(keys, TRAILER)?;
        Ok(tails
            .iter()
            .zip(keys)
            .map(|(tail, key)| match tail {
                None => Presence::Absent,
                Some(t) if self.sealer.tail_is_ours(key, t) => Presence::Ours,
                Some(_) => Presence::Foreign,
            })
            .collect())
    }

    /// How many leading `keys` hold this store's values.
    pub(super) fn present_prefix(&self, keys: &[Key]) -> StoreResult<usize> {
        if !self.sealer.authenticated() {
            return self.backend.present_prefix(keys);
        }
        let present = self.presence(keys)?;
        Ok(present.iter().take_while(|&&p| p == Presence::Ours).count())
    }

    /// Removes a value another writer left under `key`, so that ours can be stored there.
    pub(super) fn replace_foreign(&self, key: &Key, presence: Presence) -> StoreResult<()> {
        if presence == Presence::Foreign {
            self.count_broken(Broken::Rejected);
            self.backend.remove(key)?;
        }
        Ok(())
    }

    pub(super) fn corrupt(&self, key: &Key, broken: Broken) {
        self.count_broken(broken);
        // best effort: a later put stores a good value under this key
        let _ = self.backend.remove(key);
    }

    /// Tells the event hub that `keys` are a chain from a prompt's first block.
    pub(super) fn note_chain(&self, keys: &[Key]) {
        if let Some(hub) = &self.events {
            hub.note_chain(keys);
        }
    }
}
