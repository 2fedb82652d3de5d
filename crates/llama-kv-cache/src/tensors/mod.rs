//! Layer 1, tensors: where K/V rows live and the arithmetic on them: host and device storage,
//! allocation, quantized types, f16 kernels, transposition, the Hadamard rotation, RoPE (and the
//! parameters of a K-shift), and CUDA.
//!
//! May import: the base modules (`error`, `alloc`, `ggml_type`). Knows nothing of cells, state
//! payloads or models.

pub mod bulk_copy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod f16_simd;
pub mod hadamard;
pub mod quant;
pub mod rope;
pub mod storage;
pub mod transpose;
