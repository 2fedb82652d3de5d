//! Layer 3, state: llama.cpp's state format, without a cache.
//!
//! Names the llama.cpp eras ([`era`]). Owns the one codec of the payload format ([`codec`]: header checks, stream and layer
//! headers, payload parsing; [`cells`]: cell metadata; [`rows`]: K/V rows and transposed V),
//! payloads of several memories ([`parts`]), where bytes come from and go to ([`source`],
//! `sink`), the file containers ([`files`]), atomic writes and the fit of a state to a model
//! ([`fit`]).
//!
//! May import: the base modules, `cells` (sequence sets), `tensors` (the buffers rows are
//! read from and written to) and `model` (architectures). Never the cache: the cache's own
//! state I/O lives in `cache` and calls this layer.

pub(crate) mod atomic_write;
pub mod cells;
pub mod codec;
pub mod dsv4;
pub mod era;
pub mod files;
pub mod fit;
pub mod parts;
pub(crate) mod rows;
pub(crate) mod sink;
pub mod source;

pub use codec::*;
pub use era::Era;
