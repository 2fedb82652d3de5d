//! How a cache hands the memory of freed cells back to the OS ([`Release`]), and the freed
//! cells awaiting release by decay ([`Pending`]); the release itself is `release`'s.

use std::ops::Range;
use std::time::{Duration, Instant};

/// How a cache hands the memory of the cells it frees back to the OS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Never: freed cells keep their pages, and `clear` zeroes the tensors in place.
    Off,
    /// Inside the operation that frees the cells.
    Now,
    /// Once the freed cells stayed free for `delay`, or at once while more than `watermark`
    /// freed bytes await release.
    Decay { delay: Duration, watermark: usize },
}

impl Release {
    /// The default decay: the delay and watermark the benchmarks chose (docs/benchmarks.md,
    /// "Memory handed back by decay").
    pub const DECAY: Release = Release::Decay {
        delay: Duration::from_millis(1000),
        watermark: 256 << 20,
    };
}

impl Default for Release {
    fn default() -> Self {
        Release::DECAY
    }
}

/// A span of freed cells awaiting release: the cells, when they were freed, and the tensor
/// bytes the operation freed there (cells reused since still count, so this bounds what the
/// span hands back from above).
#[derive(Debug)]
pub(crate) struct Span {
    pub(crate) cells: Range<usize>,
    pub(crate) at: Instant,
    pub(crate) bytes: usize,
}

/// The spans of freed cells awaiting release.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    pub(crate) spans: Vec<Span>,
    /// Their bytes, together.
    pub(crate) bytes: usize,
}
