//! Which storage a `PromptStore` uses, from its options: in-process memory, a directory, a
//! Redis server, or several of them as tiers (nearest first). Only option checking and
//! construction live here, with the options themselves; the backends are in `prompt-store` and
//! `prompt-store-redis`.

use std::sync::Arc;
use std::time::Duration;

use napi::bindgen_prelude::Uint8Array;
use napi::Either;
use napi_derive::napi;
use prompt_store::seal::Sealer;
use prompt_store::{
    Backend, Compressed, Compression, DirBackend, EvictionPolicy, MemoryBackend, TieredBackend,
};
use prompt_store_redis::{
    ConnectOptions, Credentials, HostPort, RedisBackend, RedisOptions, Servers, TlsOptions,
    DEFAULT_PREFIX, DEFAULT_TIMEOUT,
};

use crate::args::{int, text_or_bytes, Obj};
use crate::error::{err, from_store, Code, JsErr, JsResult};

/// Options of `new PromptStore(options)`.
#[napi(object, object_to_js = false)]
pub struct PromptStoreOptions {
    /// Identity of the model weights: part of every block key, so stores of different models
    /// never mix. A path to the GGUF file (`*.gguf`, or any file with the GGUF magic) is replaced
    /// by the BLAKE3 hash of the whole file (`modelInfo(path, { hashFile: true }).fingerprint`),
    /// so two fine-tunes of one base model share no key. It is computed once per file version
    /// and remembered by path, size and modification time in the user's cache directory
    /// (`LLAMA_KV_CACHE_DIR` chooses another). Any other string (e.g. the file's sha256) is used
    /// as it is; name LoRA adapters and control vectors in it too, since they change K/V.
    pub model: String,
    /// A directory for the embedded `dir` backend (created if missing), shared safely by several
    /// processes. Without `path` (and `url`), blocks live in this process's memory.
    pub path: Option<String>,
    /// A Redis or Valkey server shared by several processes and machines:
    /// `redis://[user[:password]@]host[:port][/db]`, or `rediss://` for TLS (see `tls`).
    /// Created without connecting: calls fail with `ERR_KV_STORE_UNAVAILABLE` while the server
    /// is unreachable and work once it is back.
    pub url: Option<String>,
    /// Redis through Sentinel (instead of `url`): the Sentinels to ask for the primary named
    /// `name`. After a failover the next call reaches the new primary, with no new store.
    #[napi(ts_type = "Array<RedisNode>")]
    pub sentinels: Option<Vec<Obj<RedisNode>>>,
    /// With `sentinels`: the name the Sentinels monitor the primary under.
    pub name: Option<String>,
    /// With `sentinels`: the database number. Default 0. (A `url` names its own.)
    pub db: Option<f64>,
    /// A Redis Cluster (instead of `url`): any of its nodes; the rest are discovered. Blocks
    /// spread over the primaries by key; each call sends one batch per primary, all at once.
    #[napi(ts_type = "Array<RedisNode>")]
    pub cluster: Option<Vec<Obj<RedisNode>>>,
    /// With `sentinels` or `cluster`: the ACL user of the data servers. (A `url` carries its
    /// own.)
    pub username: Option<String>,
    /// With `sentinels` or `cluster`: the password of the data servers. Never part of an
    /// error message.
    pub password: Option<String>,
    /// With `sentinels`: the password of the Sentinels themselves, when they require one.
    pub sentinel_password: Option<String>,
    /// TLS, shaped like Node's `tls.connect` options: with a `rediss://` URL, and for every
    /// connection of `sentinels` or `cluster`. A failed handshake (an untrusted certificate, a
    /// name it does not carry, a client certificate the server refused) is
    /// `ERR_KV_STORE_TLS`.
    #[napi(ts_type = "RedisTls")]
    pub tls: Option<Obj<RedisTls>>,
    /// Redis key namespace, so several apps or models can share one server. Default 'llama-kv:'.
    pub prefix: Option<String>,
    /// Redis: blocks expire this many seconds after their last put or restore. Default: kept
    /// until Redis evicts them (`maxmemory`).
    pub ttl_seconds: Option<f64>,
    /// Redis: the longest one call may take, connecting included, in milliseconds. Default 5000.
    pub timeout_ms: Option<f64>,
    /// Several backends, nearest first, e.g. `['memory', 'dir', 'redis']` (with `path` and
    /// `url`): reads ask the nearest tier first and copy hits into the nearer tiers; puts write
    /// through to every tier. Default: the one backend that `path` / `url` select.
    pub tiers: Option<Vec<String>>,
    /// Tokens per block, 16 to 4096. Default 256.
    pub block_tokens: Option<f64>,
    /// Byte budget of the memory and dir tiers: blocks are evicted beyond it (see `policy`).
    /// Default: unbounded. (Redis has its own: `maxmemory`.)
    pub max_bytes: Option<f64>,
    /// How the memory tier chooses what to evict beyond `maxBytes`. 'lru' (the default): least
    /// recently used first. 's3fifo': S3-FIFO, which keeps the blocks that are read again (the
    /// system prompts and documents every request shares) through a burst of prompts used once;
    /// in a store with `tiers`, it also admits a block into the memory tier only at its second
    /// use (a put writes the farther tiers; a read that finds the block there copies it into
    /// memory). The dir tier evicts least recently used files whatever the policy (its order
    /// is the files' modification times, shared by every process), so 's3fifo' needs the
    /// memory tier.
    #[napi(ts_type = "'lru' | 's3fifo'")]
    pub policy: Option<String>,
    /// A tenant: mixed into the root of every key, so two namespaces on one directory or
    /// server share no block, and nothing done in one (lookups, put counts) shows in the
    /// other. Default '' (one namespace shared by every store that names none).
    pub namespace: Option<String>,
    /// A secret (string or bytes, at least 16 bytes) that every value this store writes is
    /// tagged with (keyed BLAKE3): a value without the tag, written without the secret, with
    /// another one, or altered, is rejected (counted in `stats().rejected`), never loaded, and
    /// replaced by the next put. Without it, anyone who can write to the storage can store rows
    /// under any prompt's keys.
    #[napi(ts_type = "string | Uint8Array")]
    pub secret: Option<napi::Either<String, napi::bindgen_prelude::Uint8Array>>,
    /// How tiers keep their blocks: one mode for every tier, or one per tier
    /// (`{ redis: 'q8_0' }`; a tier not named keeps its blocks as they are). 'none' (the
    /// default): as the cache's rows. 'lossless': byte planes and zstd, the same bytes back.
    /// 'q8_0': f16 and f32 rows as q8_0 (1.9x smaller for f16), dequantized on restore: each
    /// value within half a q8_0 step (`max |x| / 254` of its 32) of the cache's, plus its
    /// rounding to f16. Every store
    /// reads every mode, whatever its own, so processes sharing a directory or a Redis may
    /// choose differently. Model records, checkpoints and indexes are kept as they are.
    #[napi(ts_type = "'none' | 'lossless' | 'q8_0' | TierCompression")]
    pub compress: Option<CompressOption>,
}

crate::args::option_names!(
    PromptStoreOptions:
    "model", "path", "url", "sentinels", "name", "db", "cluster", "username", "password",
    "sentinelPassword", "tls", "prefix", "ttlSeconds", "timeoutMs", "tiers", "blockTokens",
    "maxBytes", "policy", "namespace", "secret", "compress",
);

/// The modes of `compress` per tier.
#[napi(object, object_to_js = false)]
pub struct TierCompression {
    #[napi(ts_type = "'none' | 'lossless' | 'q8_0'")]
    pub memory: Option<String>,
    #[napi(ts_type = "'none' | 'lossless' | 'q8_0'")]
    pub dir: Option<String>,
    #[napi(ts_type = "'none' | 'lossless' | 'q8_0'")]
    pub redis: Option<String>,
}

crate::args::option_names!(TierCompression: "memory", "dir", "redis");

/// `compress`: a mode for every tier, or an object of modes by tier.
pub enum CompressOption {
    Every(String),
    ByTier(TierCompression),
}

impl napi::bindgen_prelude::FromNapiValue for CompressOption {
    unsafe fn from_napi_value(
        env: napi::sys::napi_env,
        value: napi::sys::napi_value,
    ) -> napi::Result<Self> {
        if crate::args::type_of(env, value) == "string" {
            return String::from_napi_value(env, value).map(CompressOption::Every);
        }
        Obj::<TierCompression>::from_napi_value(env, value).map(|o| CompressOption::ByTier(o.0))
    }
}

/// The compression of `tier` that `o` asks for.
fn compression(o: &PromptStoreOptions, tier: Tier) -> JsResult<Compression> {
    let name = match &o.compress {
        None => return Ok(Compression::None),
        Some(CompressOption::Every(name)) => Some(name),
        Some(CompressOption::ByTier(t)) => match tier {
            Tier::Memory => t.memory.as_ref(),
            Tier::Dir => t.dir.as_ref(),
            Tier::Redis => t.redis.as_ref(),
        },
    };
    name.map_or(Ok(Compression::None), |name| {
        Compression::parse(name).ok_or_else(|| {
            invalid(format!(
                "compress: unknown mode {name:?} (expected 'none', 'lossless' or 'q8_0')"
            ))
        })
    })
}

/// A Redis server's address.
#[napi(object, object_to_js = false)]
pub struct RedisNode {
    pub host: String,
    pub port: u32,
}

crate::args::option_names!(RedisNode: "host", "port");

/// TLS options of a Redis store (as Node's `tls.connect`).
#[napi(object, object_to_js = false)]
pub struct RedisTls {
    /// PEM certificate(s) of the authorities to trust instead of the built-in Mozilla roots
    /// (several may be concatenated).
    #[napi(ts_type = "string | Uint8Array")]
    pub ca: Option<Either<String, Uint8Array>>,
    /// A PEM client certificate chain, for servers that ask for one (`tls-auth-clients`).
    #[napi(ts_type = "string | Uint8Array")]
    pub cert: Option<Either<String, Uint8Array>>,
    /// The PEM private key of `cert`.
    #[napi(ts_type = "string | Uint8Array")]
    pub key: Option<Either<String, Uint8Array>>,
    /// The name the server's certificate must carry when the URL dials another (an IP
    /// address, a tunnel). With `url` only.
    pub servername: Option<String>,
    /// `false` accepts any certificate: encrypted but not authenticated. Default true.
    pub reject_unauthorized: Option<bool>,
}

crate::args::option_names!(
    RedisTls: "ca", "cert", "key", "servername", "rejectUnauthorized",
);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tier {
    Memory,
    Dir,
    Redis,
}

impl Tier {
    fn parse(name: &str) -> JsResult<Tier> {
        match name {
            "memory" => Ok(Tier::Memory),
            "dir" => Ok(Tier::Dir),
            "redis" => Ok(Tier::Redis),
            other => Err(err(
                Code::InvalidArg,
                format!("tiers: unknown tier {other:?} (expected 'memory', 'dir' or 'redis')"),
            )),
        }
    }
}

/// Whether the options name Redis servers (`url`, `sentinels` or `cluster`).
fn redis_given(o: &PromptStoreOptions) -> bool {
    o.url.is_some() || o.sentinels.is_some() || o.cluster.is_some()
}

/// The tiers named by `tiers`, or the one implied by `path` / `url`.
fn tiers(o: &PromptStoreOptions) -> JsResult<Vec<Tier>> {
    let redis = redis_given(o).then_some(());
    let Some(names) = &o.tiers else {
        return match (&o.path, &redis) {
            (Some(_), Some(_)) => Err(err(
                Code::InvalidArg,
                "give either path or url, or both with tiers: ['dir', 'redis']",
            )),
            (Some(_), None) => Ok(vec![Tier::Dir]),
            (None, Some(_)) => Ok(vec![Tier::Redis]),
            (None, None) => Ok(vec![Tier::Memory]),
        };
    };
    if names.is_empty() {
        return Err(err(Code::InvalidArg, "tiers must name at least one tier"));
    }
    let mut tiers = Vec::with_capacity(names.len());
    for name in names {
        let tier = Tier::parse(name)?;
        if tiers.contains(&tier) {
            return Err(err(
                Code::InvalidArg,
                format!("tiers: {name:?} is listed twice"),
            ));
        }
        tiers.push(tier);
    }
    let listed = |tier| tiers.contains(&tier);
    let check = |given: bool, tier: Tier, option: &str, name: &str| match (given, listed(tier)) {
        (true, false) => Err(err(
            Code::InvalidArg,
            format!("{option} is given but tiers does not list '{name}'"),
        )),
        (false, true) => Err(err(
            Code::InvalidArg,
            format!("tiers lists '{name}', which needs the {option} option"),
        )),
        _ => Ok(()),
    };
    check(o.path.is_some(), Tier::Dir, "path", "dir")?;
    check(
        redis_given(o),
        Tier::Redis,
        "url (or sentinels, or cluster)",
        "redis",
    )?;
    Ok(tiers)
}

/// `ttlSeconds` as a duration: positive, at least a millisecond (Redis's resolution).
fn ttl(seconds: Option<f64>) -> JsResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if (0.001..=1e12).contains(&s) => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(err(
            Code::InvalidArg,
            format!("ttlSeconds must be a number of seconds of at least 0.001, got {s}"),
        )),
    }
}

fn invalid(message: String) -> JsErr {
    err(Code::InvalidArg, message)
}

/// Which servers: exactly one of `url`, `sentinels` (with `name`) and `cluster`, with only
/// the options that apply to it.
fn servers(o: &PromptStoreOptions) -> JsResult<Servers> {
    let nodes = |option: &str, list: &[Obj<RedisNode>]| -> JsResult<Vec<HostPort>> {
        if list.is_empty() {
            return Err(invalid(format!("{option} must list at least one server")));
        }
        list.iter()
            .map(|Obj(node)| {
                let port = int(
                    format!("{option}: the port of {:?}", node.host),
                    node.port.into(),
                    1,
                    65_535,
                )?;
                Ok(HostPort {
                    host: node.host.clone(),
                    port: port as u16,
                })
            })
            .collect()
    };
    let only_with = |given: bool, option: &str, with: &str| match given {
        true => Err(invalid(format!("{option} applies with {with} only"))),
        false => Ok(()),
    };
    let servers = match (&o.url, &o.sentinels, &o.cluster) {
        (Some(url), None, None) => Servers::Url(url.clone()),
        (None, Some(list), None) => Servers::Sentinel {
            sentinels: nodes("sentinels", list)?,
            name: o.name.clone().ok_or_else(|| {
                invalid(
                    "sentinels needs name: the name the Sentinels monitor the primary under".into(),
                )
            })?,
            db: o
                .db
                .map_or(Ok(0), |db| int("db", db, 0, i64::from(i32::MAX)))?,
        },
        (None, None, Some(list)) => Servers::Cluster {
            nodes: nodes("cluster", list)?,
        },
        _ => {
            return Err(invalid(
                "give one of url, sentinels and cluster, not several".into(),
            ))
        }
    };
    let sentinel = matches!(servers, Servers::Sentinel { .. });
    only_with(o.name.is_some() && !sentinel, "name", "sentinels")?;
    only_with(
        o.db.is_some() && !sentinel,
        "db",
        "sentinels (a url names its database)",
    )?;
    only_with(
        o.sentinel_password.is_some() && !sentinel,
        "sentinelPassword",
        "sentinels",
    )?;
    let by_url = matches!(servers, Servers::Url(_));
    for (given, option) in [
        (o.username.is_some(), "username"),
        (o.password.is_some(), "password"),
    ] {
        only_with(
            given && by_url,
            option,
            "sentinels or cluster (a url carries its credentials)",
        )?;
    }
    let servername = o
        .tls
        .as_ref()
        .is_some_and(|Obj(tls)| tls.servername.is_some());
    only_with(servername && !by_url, "tls.servername", "url")?;
    Ok(servers)
}

/// PEM text or bytes.
fn pem(value: &Option<Either<String, Uint8Array>>) -> Option<Vec<u8>> {
    value.as_ref().map(|value| text_or_bytes(value).to_vec())
}

fn tls_options(tls: &RedisTls) -> JsResult<TlsOptions> {
    if tls.cert.is_some() != tls.key.is_some() {
        return Err(invalid("tls: cert and key go together".into()));
    }
    Ok(TlsOptions {
        ca: pem(&tls.ca),
        cert: pem(&tls.cert),
        key: pem(&tls.key),
        servername: tls.servername.clone(),
        reject_unauthorized: tls.reject_unauthorized.unwrap_or(true),
    })
}

fn redis_options(o: &PromptStoreOptions) -> JsResult<RedisOptions> {
    let timeout = match o.timeout_ms {
        None => DEFAULT_TIMEOUT,
        Some(ms) => Duration::from_millis(int("timeoutMs", ms, 1, 86_400_000)? as u64),
    };
    Ok(RedisOptions {
        connect: ConnectOptions {
            servers: servers(o)?,
            credentials: Credentials {
                username: o.username.clone(),
                password: o.password.clone(),
                sentinel_password: o.sentinel_password.clone(),
            },
            tls: o
                .tls
                .as_ref()
                .map(|Obj(tls)| tls_options(tls))
                .transpose()?,
            timeout,
        },
        prefix: o.prefix.clone().unwrap_or_else(|| DEFAULT_PREFIX.into()),
        ttl: ttl(o.ttl_seconds)?,
    })
}

/// `policy`, checked against the tiers it applies to.
fn policy(o: &PromptStoreOptions, tiers: &[Tier]) -> JsResult<EvictionPolicy> {
    let Some(name) = &o.policy else {
        return Ok(EvictionPolicy::Lru);
    };
    let policy = EvictionPolicy::parse(name).ok_or_else(|| {
        invalid(format!(
            "policy: unknown policy {name:?} (expected 'lru' or 's3fifo')"
        ))
    })?;
    if policy != EvictionPolicy::Lru && !tiers.contains(&Tier::Memory) {
        return Err(invalid(format!(
            "policy {name:?} applies to the memory tier, which this store has not (the dir tier \
             evicts least recently used files)"
        )));
    }
    Ok(policy)
}

/// The backend for `o`: one tier as itself, several as a `TieredBackend`.
pub fn open(o: &PromptStoreOptions) -> JsResult<Arc<dyn Backend>> {
    let max_bytes = match o.max_bytes {
        Some(m) if !(m.is_finite() && m >= 0.0 && m.fract() == 0.0) => {
            return Err(err(
                Code::InvalidArg,
                format!("maxBytes must be a non-negative integer, got {m}"),
            ))
        }
        m => m.map(|m| m as u64),
    };
    let tiers = tiers(o)?;
    let policy = policy(o, &tiers)?;
    if !tiers.contains(&Tier::Redis) {
        for (given, name) in [
            (o.prefix.is_some(), "prefix"),
            (o.ttl_seconds.is_some(), "ttlSeconds"),
            (o.timeout_ms.is_some(), "timeoutMs"),
            (o.tls.is_some(), "tls"),
            (o.name.is_some(), "name"),
            (o.db.is_some(), "db"),
            (o.username.is_some(), "username"),
            (o.password.is_some(), "password"),
            (o.sentinel_password.is_some(), "sentinelPassword"),
        ] {
            if given {
                return Err(err(
                    Code::InvalidArg,
                    format!("{name} applies to a Redis store: give url, sentinels or cluster"),
                ));
            }
        }
    }
    if let Some(CompressOption::ByTier(t)) = &o.compress {
        for (named, tier, name) in [
            (t.memory.is_some(), Tier::Memory, "memory"),
            (t.dir.is_some(), Tier::Dir, "dir"),
            (t.redis.is_some(), Tier::Redis, "redis"),
        ] {
            if named && !tiers.contains(&tier) {
                return Err(invalid(format!(
                    "compress.{name}: this store has no {name} tier"
                )));
            }
        }
    }
    // q8_0 values are sealed with the store's secret, as its blocks are
    let sealer = Sealer::new(o.secret.as_ref().map(text_or_bytes));
    let mut backends: Vec<Arc<dyn Backend>> = Vec::with_capacity(tiers.len());
    for tier in &tiers {
        let backend: Arc<dyn Backend> = match (tier, &o.path, redis_given(o)) {
            (Tier::Memory, _, _) => Arc::new(MemoryBackend::with_policy(max_bytes, policy)),
            (Tier::Dir, Some(path), _) => {
                Arc::new(DirBackend::open(path, max_bytes).map_err(from_store)?)
            }
            (Tier::Redis, _, true) => {
                Arc::new(RedisBackend::new(redis_options(o)?).map_err(from_store)?)
            }
            (tier, _, _) => {
                return Err(err(
                    Code::Internal,
                    format!("tier {tier:?} has no option (a bug: tiers() checks this)"),
                ))
            }
        };
        // every tier decodes compact values, whatever its own mode
        let mode = compression(o, *tier)?;
        backends.push(Arc::new(Compressed::new(backend, mode, sealer.clone())));
    }
    if backends.len() == 1 {
        return Ok(backends.pop().expect("one backend"));
    }
    let tiered = TieredBackend::new(backends).map_err(from_store)?;
    // admission goes with the frequency-aware policy: a block used once stays out of memory
    let near_is_memory = tiers[0] == Tier::Memory;
    Ok(Arc::new(match policy {
        EvictionPolicy::S3Fifo if near_is_memory => tiered.admit_on_reuse(),
        _ => tiered,
    }))
}
