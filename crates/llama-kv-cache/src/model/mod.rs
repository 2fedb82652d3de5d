//! Layer 2, models: the GGUF reader, the weights' fingerprint ([`fingerprint`]), what a model's hyperparameters say about its memory
//! ([`ModelInfo`], read one concern a file: `hparams`, `rope`, `layers`, `recurrent`; its cache
//! and K-shift parameters in `cache_params` and `shift`), and the one list of architectures and
//! their memory kinds ([`arch`]).
//!
//! May import: the base modules and `tensors` (RoPE parameters). Knows nothing of cells or
//! state payloads.

pub mod arch;
mod cache_params;
pub mod fingerprint;
pub mod gguf;
mod hparams;
mod info;
mod layers;
mod recurrent;
mod rope;
mod shift;

pub use arch::MemoryKind;
pub use hparams::MAX_LAYERS;
pub use info::ModelInfo;
pub use layers::{LayerGeometry, LayerMemory, SwaInfo};
pub use recurrent::RecurrentInfo;
pub use rope::{rope_kind, RopeInfo, RopeKind};
