//! Layer 5, memories: one interface for every live memory ([`interface`]:
//! [`Memory`](interface::Memory), as llama.cpp's `llama_memory_i`) and its implementations:
//! the seed's cache ([`seed`]), llama.cpp 0.1.161's attention cache (`llama_kv_cache`,
//! [`attention`], where it puts a ubatch in [`placement`]) as a cache of a stream per sequence
//! ([`streams`]), the sliding-window memory built of two of them (`llama_kv_cache_iswa`,
//! [`iswa`]), the recurrent memory ([`recurrent`]) and the hybrid memory of an attention part
//! and a recurrent one ([`hybrid`]); the parts of a memory ([`part`]), the payloads and files of
//! memories of several parts ([`parts_payload`]), and what a model's memory is before it is
//! built ([`plan`]).
//!
//! Each stream of an attention cache is a [`SeedCache`](crate::SeedCache) of the layer below,
//! which owns its cells, tensors, K-shift and state codec; this layer adds what 0.1.161 does
//! differently from the seed: placement token by token with the window's masking rule and
//! the purge that keeps every sequence's positions contiguous, one stream per sequence when
//! the context is not unified, and the head rules of its sequence operations.
//!
//! May import every layer below.

pub mod attention;
pub mod hybrid;
pub mod interface;
pub mod iswa;
pub mod part;
pub mod parts_payload;
pub mod placement;
pub mod plan;
pub mod recurrent;
pub mod seed;
pub mod streams;

/// The window rule of a sliding-window cache (`llama_swa_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SwaType {
    /// No window: every earlier position is visible (full attention).
    #[default]
    None,
    /// A token sees the `n_swa - 1` positions before its own (gemma2/3, Cohere2, gpt-oss).
    Standard,
    /// A token sees the positions of its own chunk of `n_swa` (Llama 4).
    Chunked,
    /// A token sees the positions within `n_swa / 2` on either side.
    Symmetric,
}

impl SwaType {
    /// `"none"`, `"standard"`, `"chunked"` or `"symmetric"`.
    pub fn name(self) -> &'static str {
        match self {
            SwaType::None => "none",
            SwaType::Standard => "standard",
            SwaType::Chunked => "chunked",
            SwaType::Symmetric => "symmetric",
        }
    }

    /// The rule named by [`SwaType::name`].
    pub fn from_name(name: &str) -> Option<SwaType> {
        [
            SwaType::None,
            SwaType::Standard,
            SwaType::Chunked,
            SwaType::Symmetric,
        ]
        .into_iter()
        .find(|t| t.name() == name)
    }

    /// Whether a token at position `query` cannot see a cell at position `cell` through a
    /// window of `n_swa` tokens (`llama_hparams::is_masked_swa`). Both positions are >= 0.
    pub fn is_masked(self, n_swa: u32, cell: i32, query: i32) -> bool {
        let n_swa = n_swa as i64;
        let (cell, query) = (cell as i64, query as i64);
        match self {
            SwaType::None => false,
            SwaType::Standard => query - cell >= n_swa,
            // a window of 0 would divide by zero in llama.cpp; no model has one
            SwaType::Chunked => n_swa > 0 && cell < (query / n_swa) * n_swa,
            SwaType::Symmetric => (query - cell).abs() > n_swa / 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SwaType;

    #[test]
    fn each_window_rule_masks_as_llama_cpp_does() {
        // standard: a window of 4 sees the query and the 3 before it
        assert!(!SwaType::Standard.is_masked(4, 5, 8));
        assert!(SwaType::Standard.is_masked(4, 4, 8));
        // chunked: chunks of 4 are [0, 4), [4, 8), ...
        assert!(!SwaType::Chunked.is_masked(4, 4, 7));
        assert!(SwaType::Chunked.is_masked(4, 3, 7));
        assert!(!SwaType::Chunked.is_masked(4, 8, 8));
        // symmetric: half of 4 on either side
        assert!(!SwaType::Symmetric.is_masked(4, 10, 8));
        assert!(SwaType::Symmetric.is_masked(4, 11, 8));
        assert!(SwaType::Symmetric.is_masked(4, 5, 8));
        assert!(!SwaType::None.is_masked(1, 0, 1_000_000));
        for t in [
            SwaType::None,
            SwaType::Standard,
            SwaType::Chunked,
            SwaType::Symmetric,
        ] {
            assert_eq!(SwaType::from_name(t.name()), Some(t));
        }
    }
}
