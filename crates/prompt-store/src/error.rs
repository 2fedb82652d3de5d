//! The store's error type. Backends return the transport variants (`Unavailable`, `Auth`,
//! `Io`, `NoSpace`); the store adds the ones about the caller's input.

use llama_kv_cache::KvError;
use thiserror::Error;

/// Everything a store operation can refuse. A corrupt or foreign block is never an error: it
/// is a counted miss (see [`crate::StoreStats::corrupt`]).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The backend cannot be reached (a network store that is down, timed out, or dropped the
    /// connection mid-call). Nothing was changed by the failed call.
    #[error("{0}")]
    Unavailable(String),
    /// The backend refused the credentials.
    #[error("{0}")]
    Auth(String),
    /// A TLS handshake failed: the server's certificate is not trusted or not for its name,
    /// or the server refused the client's.
    #[error("{0}")]
    Tls(String),
    /// A file or directory of the store could not be read or written (e.g. a missing directory).
    #[error("{0}")]
    Io(String),
    /// The backend has no room left (a full disk, a server out of memory without eviction).
    #[error("{0}")]
    NoSpace(String),
    /// The cache's geometry (layers, K/V types, row sizes) is not the one this store's
    /// fingerprint was made for.
    #[error("{0}")]
    Geometry(String),
    /// The sequence to store does not hold positions `0..n` of one prompt without a pending
    /// shift, so its rows are not the prompt's prefix blocks.
    #[error("{0}")]
    NotPrefix(String),
    /// A malformed argument (block size, options).
    #[error("{0}")]
    InvalidArg(String),
    /// The cache refused the operation (the core's error, with its own kind).
    #[error(transparent)]
    Cache(#[from] KvError),
}

/// Result with [`StoreError`].
pub type StoreResult<T> = Result<T, StoreError>;

/// Maps an I/O error to the store error a caller can act on: a full disk is `NoSpace`.
pub(crate) fn io_error(what: String, e: &std::io::Error) -> StoreError {
    // ENOSPC (28 on Linux and macOS) and EDQUOT (122 on Linux, 69 on macOS); Windows:
    // ERROR_DISK_FULL (112), ERROR_HANDLE_DISK_FULL (39)
    let full = matches!(e.kind(), std::io::ErrorKind::StorageFull)
        || matches!(e.raw_os_error(), Some(28) | Some(122))
        || (cfg!(windows) && matches!(e.raw_os_error(), Some(112) | Some(39)));
    if full {
        StoreError::NoSpace(format!("{what}: {e}"))
    } else {
        StoreError::Io(format!("{what}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn a_full_disk_is_no_space_not_io() {
        use std::io::Write;
        // /dev/full fails every write with ENOSPC, as a full disk does
        let e = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .and_then(|mut f| f.write_all(&[0; 4096]).and_then(|_| f.flush()))
            .unwrap_err();
        assert!(matches!(
            io_error("write".into(), &e),
            StoreError::NoSpace(_)
        ));
        let missing = std::fs::read("/nonexistent/x").unwrap_err();
        assert!(matches!(
            io_error("read".into(), &missing),
            StoreError::Io(_)
        ));
    }
}
