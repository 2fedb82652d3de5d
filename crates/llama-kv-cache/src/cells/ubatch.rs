//! The micro-batch that `find_slot` places: the seed's `llama_ubatch`, without token data.

use crate::cell_ext::CellExtValue;
use crate::error::{KvError, Result};

/// A micro-batch: `n_seqs` groups of `n_seq_tokens` tokens each, every group owned by one or
/// more sequences.
///
/// Transformer decodes (llama.cpp's `split_simple`) use groups of one token, so each token
/// carries its own sequence ids; recurrent models need equal-length groups, one per sequence
/// (`split_equal`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UBatch {
    /// Position of every token, group after group (`n_seqs * n_seq_tokens` values).
    pub pos: Vec<i32>,
    /// Tokens per group.
    pub n_seq_tokens: u32,
    /// Sequence ids of each group, in the order given (the first id is the group's own).
    pub seq_ids: Vec<Vec<i32>>,
    /// Each token's cell extension (its 2D position and token id), for a cache that keeps
    /// them; empty: M-RoPE text tokens (`x = y = pos`) with no token id recorded (-1), as
    /// llama.cpp records embeddings. A cache without extensions refuses a non-empty one.
    pub ext: Vec<CellExtValue>,
}

impl UBatch {
    /// One group per token (`split_simple`).
    pub fn per_token(pos: Vec<i32>, seq_ids: Vec<Vec<i32>>) -> UBatch {
        UBatch {
            pos,
            n_seq_tokens: 1,
            seq_ids,
            ext: Vec::new(),
        }
    }

    /// Tokens of the same sequence `seq` at positions `p0..p0+n`.
    pub fn sequence(seq: i32, p0: i32, n: u32) -> UBatch {
        UBatch::per_token(
            (0..n as i32).map(|k| p0 + k).collect(),
            vec![vec![seq]; n as usize],
        )
    }

    /// Number of tokens.
    pub fn n_tokens(&self) -> u32 {
        self.pos.len() as u32
    }

    /// Number of groups.
    pub fn n_seqs(&self) -> u32 {
        self.seq_ids.len() as u32
    }

    /// Checks the shape and every id and position; `n_seq_max` bounds the ids.
    pub fn validate(&self, n_seq_max: u32) -> Result<()> {
        let bad = |m: String| Err(KvError::InvalidArg(m));
        if self.pos.is_empty() {
            return bad("ubatch has no tokens".into());
        }
        if self.n_seq_tokens == 0 {
            return bad("ubatch nSeqTokens must be at least 1".into());
        }
        let expected = self.seq_ids.len() as u64 * u64::from(self.n_seq_tokens);
        if expected != self.pos.len() as u64 {
            return bad(format!(
                "ubatch has {} positions but {} groups of {} tokens ({} expected)",
                self.pos.len(),
                self.seq_ids.len(),
                self.n_seq_tokens,
                expected
            ));
        }
        if !self.ext.is_empty() && self.ext.len() != self.pos.len() {
            return bad(format!(
                "ubatch has {} cell extensions for {} tokens (give one per token, or none)",
                self.ext.len(),
                self.pos.len()
            ));
        }
        for (k, &p) in self.pos.iter().enumerate() {
            if p < 0 {
                return bad(format!("ubatch position {p} of token {k} is negative"));
            }
        }
        for (g, ids) in self.seq_ids.iter().enumerate() {
            if ids.is_empty() {
                return bad(format!("ubatch group {g} has no sequence id"));
            }
            for &id in ids {
                if id < 0 || id as u32 >= n_seq_max {
                    return Err(KvError::OutOfRange(format!(
                        "ubatch group {g}: seq id {id} is out of range [0, {n_seq_max})"
                    )));
                }
            }
        }
        Ok(())
    }
}
