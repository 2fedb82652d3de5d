//! llama.cpp's unified KV cache (`llama_kv_cache_unified`, b4944) in pure Rust.
//!
//! The cache keeps the cell metadata (positions, deltas, sequence sets, recurrent tails) with
//! the seed's exact semantics, places micro-batches (`find_slot`), runs the sequence operations,
//! and owns the per-layer K/V tensors: it moves their data on defrag, rotates K on a K-shift,
//! and reads and writes llama.cpp's state formats.
//!
//! ```
//! use llama_kv_cache::{CacheParams, KvCache, UBatch};
//! let mut cache = KvCache::new(CacheParams::new(64, 2, 32, 32)).unwrap();
//! let slot = cache.find_slot(&UBatch::sequence(0, 0, 8)).unwrap().unwrap();
//! assert_eq!((slot.head, cache.used_cells()), (0, 8));
//! cache.seq_rm(0, 4, -1).unwrap();
//! assert_eq!(cache.seq_pos_max(0).unwrap(), 3);
//! ```

pub mod alloc;
mod atomic_write;
mod cache;
mod cell_set;
pub mod cells;
pub mod convert;
#[cfg(feature = "cuda")]
pub mod cuda;
mod defrag;
mod error;
mod f16_simd;
pub mod files;
pub mod fit;
mod ggml_type;
pub mod gguf;
pub mod hadamard;
mod kshift;
pub mod model;
mod params;
pub mod parts;
pub mod payload_cells;
pub mod quant;
mod restorer;
mod rollback;
pub mod rope;
mod seq_ops;
mod sink;
mod slot;
pub mod source;
pub mod state;
mod state_stream;
pub mod storage;
pub mod transpose;
mod ubatch;
mod view;

pub use cache::KvCache;
pub use cells::{Cell, SeqSet, MAX_SEQ};
pub use defrag::{CellMove, DefragReport, DEFAULT_MAX_NODES};
pub use error::{KvError, Result};
pub use files::{ConvertOptions, FileKind, LoadedFile, Outputs, WriteOptions};
pub use fit::{check_state, Fit, Mismatch};
pub use ggml_type::GgmlType;
pub use kshift::{ShiftParams, UpdateReport};
pub use model::{MemoryKind, ModelInfo, RopeKind};
pub use params::CacheParams;
pub use parts::{PartKind, PartRole};
pub use restorer::SlotRestorer;
pub use rope::{RopeParams, RopeTable, RopeType};
pub use slot::{PrepareOptions, Slot};
pub use state::{Layout, ReadOptions, ReadSummary};
pub use state_stream::{StateIn, StateOut};
pub use storage::{Device, Tensor};
pub use ubatch::UBatch;
pub use view::{CacheView, CellColumns};
