//! The one error type of the core. The binding maps each variant to a stable JS error code.

use thiserror::Error;

/// Everything the cache can refuse, with a message that names the offending value.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KvError {
    /// An argument is malformed (wrong length, wrong type, invalid combination).
    #[error("{0}")]
    InvalidArg(String),
    /// An index or id is outside its valid range.
    #[error("{0}")]
    OutOfRange(String),
    /// The operation is not possible for this cache (e.g. shifting a recurrent cache).
    #[error("{0}")]
    Unsupported(String),
    /// A state blob or file does not parse or does not fit this cache.
    #[error("{0}")]
    InvalidState(String),
    /// A GGUF model file does not parse, or lacks what its architecture needs.
    #[error("{0}")]
    InvalidModel(String),
    /// A file could not be read or written.
    #[error("{0}")]
    Io(String),
    /// A storage backend could not be used (e.g. no CUDA driver).
    #[error("{0}")]
    Backend(String),
    /// There is no room in the cache for what was asked (e.g. a sequence restore).
    #[error("{0}")]
    NoSpace(String),
    /// The operation was cancelled by its caller.
    #[error("{0}")]
    Aborted(String),
}

/// Result with [`KvError`].
pub type Result<T, E = KvError> = std::result::Result<T, E>;
