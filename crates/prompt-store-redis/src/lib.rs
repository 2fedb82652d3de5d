//! The prompt store's Redis (and Valkey) backend: one prefix cache shared by a fleet of
//! machines. Pure Rust, no Node.

mod backend;
mod bulk;
mod client;
mod connect;
mod link;
mod notify;
mod resp;
mod runtime;

pub use backend::{RedisBackend, RedisOptions, DEFAULT_PREFIX, DEFAULT_TIMEOUT};
pub use client::{ClientError, RedisClient};
pub use connect::{redact_url, ConnectOptions, Credentials, HostPort, Servers, TlsOptions};
