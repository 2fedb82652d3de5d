//! How to reach Redis as it is deployed: one server by URL (`redis://`, `rediss://`,
//! `redis+unix://`), a primary found through Sentinel, or a Cluster; TLS for any of them. This
//! module only turns those options into the `redis` crate's clients and opens connections;
//! keeping a connection alive is [`crate::link`]'s job.

use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::SingleNodeRoutingInfo;
use redis::io::AsyncDNSResolver;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, ConnectionAddr, RedisFuture, RedisResult,
    TlsCertificates, TlsMode,
};

/// A server's address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl HostPort {
    /// The cluster route to this node.
    pub(crate) fn route(&self) -> SingleNodeRoutingInfo {
        SingleNodeRoutingInfo::ByAddress {
            host: self.host.clone(),
            port: self.port,
        }
    }
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Which servers hold the store.
#[derive(Clone, Debug)]
pub enum Servers {
    /// One server: `redis://[user[:password]@]host[:port][/db]`, `rediss://` (TLS) or
    /// `redis+unix:///path`.
    Url(String),
    /// The primary that these Sentinels name `name`, found again after every failover.
    Sentinel {
        sentinels: Vec<HostPort>,
        name: String,
        db: i64,
    },
    /// A Redis Cluster, discovered from any of these nodes.
    Cluster { nodes: Vec<HostPort> },
}

/// Credentials of the data servers of a Sentinel or Cluster deployment (a URL carries its own),
/// and of the Sentinels themselves.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    pub username: Option<String>,
    pub password: Option<String>,
    pub sentinel_password: Option<String>,
}

/// TLS settings, shaped like Node's `tls.connect` options. PEM text or bytes.
#[derive(Clone, Debug, Default)]
pub struct TlsOptions {
    /// Certificate authorities to trust instead of the built-in (Mozilla) roots.
    pub ca: Option<Vec<u8>>,
    /// A client certificate chain and its key, for servers that ask for one (`tls-auth-clients`).
    pub cert: Option<Vec<u8>>,
    pub key: Option<Vec<u8>>,
    /// The name the server's certificate must carry when it is not the URL's host (a server
    /// reached by IP address, or through a tunnel).
    pub servername: Option<String>,
    /// `false` accepts any certificate: encrypted but not authenticated.
    pub reject_unauthorized: bool,
}

/// Everything needed to open a connection.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub servers: Servers,
    pub credentials: Credentials,
    pub tls: Option<TlsOptions>,
    /// Bound on connecting and on each round trip.
    pub timeout: Duration,
}

impl ConnectOptions {
    /// One server by URL, no TLS options.
    pub fn url(url: impl Into<String>, timeout: Duration) -> ConnectOptions {
        ConnectOptions {
            servers: Servers::Url(url.into()),
            credentials: Credentials::default(),
            tls: None,
            timeout,
        }
    }
}

/// A URL with any password replaced by `***`, so an error message never leaks it.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.rsplit_once('@') {
        Some((credentials, host)) => {
            let user = credentials.split_once(':').map_or(credentials, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_string(),
    }
}

/// An open connection: to one server, or to a cluster (which routes each key to its node).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// What opens connections: built once from the options, without connecting.
pub(crate) enum Connector {
    Single(Client, AsyncConnectionConfig),
    /// `SentinelClient` asks the Sentinels for the primary on every connect, so a reconnect
    /// after a failover reaches the new primary. Its queries take `&mut self`.
    Sentinel(tokio::sync::Mutex<SentinelClient>, AsyncConnectionConfig),
    Cluster(redis::cluster::ClusterClient),
}

/// Why the options cannot work, in words that never contain a password.
pub(crate) type Invalid = String;

impl Connector {
    /// Builds the client(s) for `options`, and the address that error messages name.
    pub(crate) fn new(options: &ConnectOptions) -> Result<(Connector, String), Invalid> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(options.timeout))
            .set_response_timeout(Some(options.timeout));
        // with TLS: how strictly to check the servers, and the certificates to check them with
        let secured = options.tls.as_ref().map(|tls| {
            install_crypto_provider();
            let mode = match tls.reject_unauthorized {
                true => TlsMode::Secure,
                false => TlsMode::Insecure,
            };
            (mode, certificates(tls))
        });
        let Credentials {
            username,
            password,
            sentinel_password,
        } = &options.credentials;
        match &options.servers {
            Servers::Url(url) => single(url, options.tls.as_ref(), config),
            Servers::Sentinel {
                sentinels,
                name,
                db,
            } => {
                let addresses = sentinels.iter().map(|node| match &secured {
                    None => ConnectionAddr::Tcp(node.host.clone(), node.port),
                    Some((mode, _)) => ConnectionAddr::TcpTls {
                        host: node.host.clone(),
                        port: node.port,
                        insecure: *mode == TlsMode::Insecure,
                        tls_params: None,
                    },
                });
                let mut builder =
                    SentinelClientBuilder::new(addresses, name, SentinelServerType::Master)
                        .map_err(|err| err.to_string())?
                        .set_client_to_redis_db(*db);
                if let Some(user) = username {
                    builder = builder.set_client_to_redis_username(user);
                }
                if let Some(password) = password {
                    builder = builder.set_client_to_redis_password(password);
                }
                if let Some(password) = sentinel_password {
                    builder = builder.set_client_to_sentinel_password(password);
                }
                if let Some((mode, certificates)) = secured.clone() {
                    builder = builder
                        .set_client_to_redis_tls_mode(mode)
                        .set_client_to_redis_certificates(certificates.clone())
                        .set_client_to_sentinel_tls_mode(mode)
                        .set_client_to_sentinel_certificates(certificates);
                }
                let client = builder.build().map_err(|err| err.to_string())?;
                let address = format!("sentinel {name:?} via {}", listed(sentinels));
                Ok((
                    Connector::Sentinel(tokio::sync::Mutex::new(client), config),
                    address,
                ))
            }
            Servers::Cluster { nodes } => {
                let urls: Vec<String> = nodes
                    .iter()
                    .map(|node| format!("redis://{}:{}", node.host, node.port))
                    .collect();
                let mut builder = ClusterClientBuilder::new(urls)
                    .connection_timeout(options.timeout)
                    .response_timeout(options.timeout)
                    // one call, one attempt: a store call fails fast and its tier backs off
                    .retries(0);
                if let Some(user) = username {
                    builder = builder.username(user);
                }
                if let Some(password) = password {
                    builder = builder.password(password);
                }
                if let Some((mode, certificates)) = secured {
                    builder = builder.tls(mode).certs(certificates);
                }
                let client = builder.build().map_err(|err| err.to_string())?;
                let address = format!("cluster via {}", listed(nodes));
                Ok((Connector::Cluster(client), address))
            }
        }
    }

    /// Opens a new connection (for Sentinel: to the primary the Sentinels name now).
    pub(crate) async fn connect(&self) -> RedisResult<Conn> {
        match self {
            Connector::Single(client, config) => Ok(Conn::Single(
                client
                    .get_multiplexed_async_connection_with_config(config)
                    .await?,
            )),
            Connector::Sentinel(sentinel, config) => {
                let primary = sentinel.lock().await.async_get_client().await?;
                Ok(Conn::Single(
                    primary
                        .get_multiplexed_async_connection_with_config(config)
                        .await?,
                ))
            }
            Connector::Cluster(client) => Ok(Conn::Cluster(client.get_async_connection().await?)),
        }
    }
}

/// `host:port,host:port` for messages.
fn listed(nodes: &[HostPort]) -> String {
    let names: Vec<String> = nodes.iter().map(HostPort::to_string).collect();
    names.join(",")
}

fn certificates(tls: &TlsOptions) -> TlsCertificates {
    TlsCertificates {
        client_tls: match (&tls.cert, &tls.key) {
            (Some(cert), Some(key)) => Some(ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
            _ => None,
        },
        root_cert: tls.ca.clone(),
    }
}

/// The client of one server by URL. With `servername`, the client connects to the name (the
/// name is what TLS sends and checks) and a resolver maps it to the URL's host.
fn single(
    url: &str,
    tls: Option<&TlsOptions>,
    config: AsyncConnectionConfig,
) -> Result<(Connector, String), Invalid> {
    let client = Client::open(url).map_err(|err| err.to_string())?;
    let info = client.get_connection_info().clone();
    let address = format!("{}/{}", info.addr(), info.redis_settings().db());
    if matches!(info.addr(), ConnectionAddr::TcpTls { .. }) {
        install_crypto_provider();
    }
    let Some(tls) = tls else {
        return Ok((Connector::Single(client, config), address));
    };
    let ConnectionAddr::TcpTls { host, port, .. } = info.addr().clone() else {
        return Err("tls options need a rediss:// URL".into());
    };
    let (name, config) = match &tls.servername {
        Some(name) if *name != host => (
            name.clone(),
            config.set_dns_resolver(NameToHost {
                name: name.clone(),
                host: host.clone(),
            }),
        ),
        _ => (host, config),
    };
    let info = info.set_addr(ConnectionAddr::TcpTls {
        host: name,
        port,
        insecure: !tls.reject_unauthorized,
        tls_params: None,
    });
    let client = Client::build_with_tls(info, certificates(tls)).map_err(|err| err.to_string())?;
    Ok((Connector::Single(client, config), address))
}

/// Resolves the certificate name a user gave (`servername`) to the host they connect to.
struct NameToHost {
    name: String,
    host: String,
}

impl AsyncDNSResolver for NameToHost {
    fn resolve<'a, 'b: 'a>(
        &'a self,
        host: &'b str,
        port: u16,
    ) -> RedisFuture<'a, Box<dyn Iterator<Item = SocketAddr> + Send + 'a>> {
        let target = if host == self.name {
            self.host.clone()
        } else {
            host.to_string()
        };
        Box::pin(async move {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((target, port)).await?.collect();
            Ok(Box::new(found.into_iter()) as Box<dyn Iterator<Item = SocketAddr> + Send>)
        })
    }
}

/// Installs the process's TLS crypto provider (ring) once, when a client that speaks TLS is
/// built: a process that never uses TLS keeps the choice of provider to itself.
fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // an application that installed its own provider first keeps it
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Whether `err` (or what caused it) is a TLS failure: an untrusted certificate, a name
/// mismatch, a handshake the server refused.
pub(crate) fn is_tls_error(err: &(dyn Error + 'static)) -> bool {
    let mut cause: Option<&(dyn Error + 'static)> = Some(err);
    while let Some(mut current) = cause {
        // the redis crate keeps an I/O failure as `Arc<dyn Error>`, whose own `source()`
        // skips the I/O error's payload: look through the `Arc` first
        if let Some(shared) = current.downcast_ref::<Arc<dyn Error + Send + Sync>>() {
            current = shared.as_ref();
        }
        if current.is::<rustls::Error>() {
            return true;
        }
        let payload = current
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref);
        if payload.is_some_and(|inner| inner.is::<rustls::Error>()) {
            return true;
        }
        cause = current.source();
    }
    false
}
