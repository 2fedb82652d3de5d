//! The llama.cpp versions this crate keeps the formats and rules of, named once. Everything
//! the docs call "the seed's" or "0.1.161's" belongs to one of these eras.

use std::fmt;

use crate::state::codec::Layout;

/// A llama.cpp era: the versions whose state payloads share one layout. Ordered oldest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Era {
    /// llama.cpp b4944, the seed this crate rebuilt (llama.node 0.3.16; llama-cpp-sys-2
    /// 0.1.103 builds it for the differential suite): one unified cache, payloads without a
    /// stream prefix.
    Seed,
    /// llama.cpp from mid-2025 on (llama.node 1.x, node-llama-cpp 3.x): a stream prefix and
    /// one block per stream.
    Streams,
    /// llama.cpp as llama-cpp-sys-2 0.1.161 builds it, the newest this crate is checked
    /// against: the rotation of quantized K/V recorded in each stream, and the iSWA, hybrid
    /// and per-sequence-stream memories as live caches.
    Today,
}

impl Era {
    /// Every era, oldest first.
    pub const ALL: [Era; 3] = [Era::Seed, Era::Streams, Era::Today];

    /// The llama.cpp version that stands for the era, as the docs name it.
    pub fn llama_cpp(self) -> &'static str {
        match self {
            Era::Seed => "llama.cpp b4944",
            Era::Streams => "llama.cpp of mid-2025",
            Era::Today => "llama.cpp 0.1.161",
        }
    }

    /// The payload layout of the era.
    pub fn layout(self) -> Layout {
        match self {
            Era::Seed => Layout::Seed,
            Era::Streams => Layout::Streams,
            Era::Today => Layout::StreamsRot,
        }
    }
}

impl Layout {
    /// The era that writes this layout.
    pub fn era(self) -> Era {
        match self {
            Layout::Seed => Era::Seed,
            Layout::Streams => Era::Streams,
            Layout::StreamsRot => Era::Today,
        }
    }
}

impl fmt::Display for Era {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.llama_cpp())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_era_has_its_own_layout_and_back() {
        for era in Era::ALL {
            assert_eq!(era.layout().era(), era);
        }
        assert_eq!(Era::Today.to_string(), "llama.cpp 0.1.161");
    }
}
