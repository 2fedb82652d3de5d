//! Layer 2, models: the GGUF reader, the weights' fingerprint ([`fingerprint`]), what a model's hyperparameters say about its memory
//! ([`ModelInfo`]), and the one list of architectures and their memory kinds ([`arch`]).
//!
//! May import: the base modules and `tensors` (RoPE parameters). Knows nothing of cells or
//! state payloads.

pub mod arch;
pub mod fingerprint;
pub mod gguf;
mod info;

pub use arch::MemoryKind;
pub use info::*;
