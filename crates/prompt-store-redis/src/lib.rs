//! The prompt store's Redis (and Valkey) backend: one prefix cache shared by a fleet of
//! machines. Pure Rust, no Node.

mod client;
mod runtime;

pub use client::{redact_url, ClientError, RedisClient};
