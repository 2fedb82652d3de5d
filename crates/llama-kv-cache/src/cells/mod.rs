//! Layer 1, cells: the cell table of a cache (positions, deltas, sequence sets, recurrent
//! tails), the bitmaps that index it, and the micro-batches placed into it.
//!
//! Owns: [`Cells`], [`SeqSet`], the set bitmaps ([`set`]) and [`ubatch::UBatch`].
//! May import: the base modules (`error`, `alloc`, `cell_ext`, `params`). Knows nothing of tensors, state
//! payloads or models.

mod seqs;
pub mod set;
mod table;
pub mod ubatch;

pub use seqs::{SeqColumn, SeqSet};
pub use table::*;
