//! llama.cpp's KV cache and today's memories in pure Rust, with the state formats of every
//! llama.cpp era ([`Era`]): the seed (b4944), the streams layout of mid-2025, and llama.cpp
//! 0.1.161.
//!
//! The seed's cache ([`SeedCache`], b4944's `llama_kv_cache_unified`, also in its recurrent
//! mode) keeps the cell metadata (positions, deltas, sequence sets, recurrent tails) with the
//! seed's exact semantics, places micro-batches (`find_slot`), runs the sequence operations,
//! and owns the per-layer K/V tensors: it moves their data on defrag, rotates K on a K-shift,
//! and reads and writes llama.cpp's state formats. Today's memories (a cache of a stream per
//! sequence, iSWA, hybrid) are built from the same caches by 0.1.161's rules, and every
//! memory is used through one interface, [`Memory`] (llama.cpp's `llama_memory_i`).
//!
//! ```
//! use llama_kv_cache::{CacheParams, SeedCache, UBatch};
//! let mut cache = SeedCache::new(CacheParams::new(64, 2, 32, 32)).unwrap();
//! let slot = cache.find_slot(&UBatch::sequence(0, 0, 8)).unwrap().unwrap();
//! assert_eq!((slot.head, cache.used_cells()), (0, 8));
//! cache.seq_rm(0, 4, -1).unwrap();
//! assert_eq!(cache.seq_pos_max(0).unwrap(), 3);
//! ```

// The layers, from the bottom: each module may import only those above it in this list (the
// module-graph test in tests/module_graph.rs holds the code to it).
//   base:    error, alloc, ggml_type, cell_ext, staging (on alloc), params
//   layer 1: cells, tensors
//   layer 2: model
//   layer 3: state (the codec and the file containers, without a cache)
//   layer 4: cache (the seed's cache and its state I/O)
//   layer 5: memory (the Memory interface, and today's memories as live caches: attention
//            streams, iSWA, hybrid)
pub mod alloc;
mod cell_ext;
mod error;
mod ggml_type;
mod params;
pub mod staging;

pub mod cells;
pub mod tensors;

pub mod model;

pub mod state;

pub mod cache;

pub mod memory;

pub use cache::convert::{convert_bytes, convert_file, ConvertOptions};
pub use cache::defrag::{CellMove, DefragReport, DEFAULT_MAX_NODES};
pub use cache::io::{Progress, ReadOptions, ReadSummary};
pub use cache::kshift::UpdateReport;
pub use cache::release_policy::Release;
pub use cache::restorer::SlotRestorer;
pub use cache::save_load::LoadedFile;
pub use cache::sequence_load::SequenceLoad;
pub use cache::slot::{PrepareOptions, Slot};
pub use cache::stream::{StateIn, StateOut};
pub use cache::view::{CacheView, CellColumns};
pub use cache::SeedCache;
pub use cell_ext::{CellExt, CellExtValue};
pub use cells::ubatch::UBatch;
pub use cells::{Cell, SeqSet};
pub use error::{KvError, Result};
pub use ggml_type::GgmlType;
pub use memory::attention::AttentionCache;
pub use memory::hybrid::{HybridAttention, HybridCache, HybridRecurrent};
pub use memory::interface::{LayerRows, Memory, Placement, Placements};
pub use memory::iswa::{ContextParams, IswaCache, IswaParams, IswaPart};
pub use memory::part::PartInfo;
pub use memory::placement::{StreamSlot, Window};
pub use memory::plan::{memory_for_model, MemoryBlueprint, MemoryPlan};
pub use memory::recurrent::RecurrentMemory;
pub use memory::SwaType;
pub use model::{MemoryKind, ModelInfo, RopeKind};
pub use params::{CacheParams, RecurrentRules, MAX_SEQ};
pub use state::files::{FileKind, Outputs, WriteOptions};
pub use state::fit::{check_memory, check_state, Fit, LayerWidths, Mismatch};
pub use state::parts::{PartKind, PartRole};
pub use state::{Era, Layout};
pub use tensors::rope::{RopeParams, RopeTable, RopeType, ShiftParams};
pub use tensors::storage::{Device, Tensor};
