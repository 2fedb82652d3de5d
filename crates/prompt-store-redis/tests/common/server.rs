//! A real `redis-server` for tests: started on a free loopback port in its own temporary
//! directory with persistence off, stopped (and its directory removed) when dropped, with
//! kill / restart helpers for fault tests. A missing `redis-server` fails the test with the
//! command that installs it; tests never skip.

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The command that provides `redis-server` on Debian and Ubuntu (what `npm test`'s set-up runs).
pub const INSTALL_HINT: &str = "apt-get install -y redis-server";

/// An ACL user created at start-up: full access to every key and command.
#[derive(Clone, Debug)]
pub struct AclUser {
    pub name: String,
    pub password: String,
}

/// How to configure the server.
#[derive(Clone, Debug, Default)]
pub struct ServerOptions {
    /// `requirepass`: the password of the `default` user.
    pub requirepass: Option<String>,
    /// Extra ACL users.
    pub users: Vec<AclUser>,
    /// `maxmemory` in bytes (with `maxmemory-policy`, default `allkeys-lru` when set).
    pub maxmemory: Option<u64>,
    pub maxmemory_policy: Option<String>,
    /// A TLS port beside the plain one (which only the harness uses, to see the server is up).
    pub tls: Option<ServerTls>,
    /// `replicaof 127.0.0.1 PORT`.
    pub replica_of: Option<u16>,
    /// `cluster-enabled yes` (see [`start_cluster`]).
    pub cluster: bool,
    /// Run as a Sentinel monitoring the primary `(name, port)` (quorum 1, down after 500 ms).
    pub sentinel_of: Option<(String, u16)>,
}

/// The server's side of TLS: PEM files.
#[derive(Clone, Debug)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA that client certificates must chain to.
    pub ca: PathBuf,
    /// `tls-auth-clients`: whether a client must show a certificate.
    pub auth_clients: bool,
}

/// One running `redis-server`.
pub struct RedisServer {
    port: u16,
    tls_port: u16,
    dir: PathBuf,
    options: ServerOptions,
    child: Option<Child>,
}

fn redis_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("REDIS_SERVER") {
        return PathBuf::from(path);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("redis-server"))
            .find(|candidate| candidate.is_file())
    });
    on_path.unwrap_or_else(|| {
        panic!("redis-server is not installed; the Redis tests need it: run `{INSTALL_HINT}` (as root)")
    })
}

fn fresh_dir() -> PathBuf {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kv-redis-test-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the server's temporary directory");
    dir
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("local address").port()
}

impl RedisServer {
    /// A server with no password, no memory limit.
    pub fn start() -> Self {
        Self::start_with(ServerOptions::default())
    }

    pub fn start_with(options: ServerOptions) -> Self {
        let mut server = RedisServer {
            port: 0,
            tls_port: 0,
            dir: fresh_dir(),
            options,
            child: None,
        };
        // a port picked this way can be taken by someone else before redis binds it: retry
        for _ in 0..5 {
            server.port = free_port();
            server.tls_port = free_port();
            if server.spawn().is_ok() {
                return server;
            }
            server.kill();
        }
        panic!(
            "redis-server did not start; its log: {}",
            std::fs::read_to_string(server.dir.join("redis.log")).unwrap_or_default()
        );
    }

    /// `redis://127.0.0.1:PORT` (no credentials).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis://user:password@127.0.0.1:PORT`.
    pub fn url_with(&self, user: &str, password: &str) -> String {
        format!("redis://{user}:{password}@127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `rediss://NAME:TLS_PORT` for a server started with `tls` (NAME: the host to dial).
    pub fn tls_url(&self, host: &str) -> String {
        format!("rediss://{host}:{}", self.tls_port)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn args(&self) -> Vec<String> {
        if let Some((name, primary)) = &self.options.sentinel_of {
            return self.sentinel_args(name, *primary);
        }
        let mut args: Vec<String> = [
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--dir",
            &self.dir.to_string_lossy(),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            "redis.log",
        ]
        .iter()
        .map(|arg| arg.to_string())
        .collect();
        if let Some(password) = &self.options.requirepass {
            args.extend(["--requirepass".into(), password.clone()]);
        }
        for user in &self.options.users {
            args.extend([
                "--user".into(),
                user.name.clone(),
                "on".into(),
                format!(">{}", user.password),
                "~*".into(),
                "&*".into(),
                "+@all".into(),
            ]);
        }
        if let Some(bytes) = self.options.maxmemory {
            let policy = self
                .options
                .maxmemory_policy
                .clone()
                .unwrap_or_else(|| "allkeys-lru".into());
            args.extend([
                "--maxmemory".into(),
                bytes.to_string(),
                "--maxmemory-policy".into(),
                policy,
                // sample every key: a tiny test server evicts in true LRU order
                "--maxmemory-samples".into(),
                "64".into(),
            ]);
        }
        if let Some(tls) = &self.options.tls {
            let path = |p: &PathBuf| p.to_string_lossy().into_owned();
            args.extend([
                "--tls-port".into(),
                self.tls_port.to_string(),
                "--tls-cert-file".into(),
                path(&tls.cert),
                "--tls-key-file".into(),
                path(&tls.key),
                "--tls-ca-cert-file".into(),
                path(&tls.ca),
                "--tls-auth-clients".into(),
                if tls.auth_clients { "yes" } else { "no" }.into(),
            ]);
        }
        if let Some(primary) = self.options.replica_of {
            args.extend([
                "--replicaof".into(),
                "127.0.0.1".into(),
                primary.to_string(),
            ]);
        }
        if self.options.cluster {
            args.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ]
                .map(String::from),
            );
        }
        args
    }

    /// A Sentinel reads and rewrites a configuration file: it is written into the server's
    /// directory at each start.
    fn sentinel_args(&self, name: &str, primary: u16) -> Vec<String> {
        let conf = self.dir.join("sentinel.conf");
        let text = format!(
            "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile sentinel.log\n\
             sentinel monitor {name} 127.0.0.1 {primary} 1\n\
             sentinel down-after-milliseconds {name} 500\n\
             sentinel failover-timeout {name} 3000\n\
             sentinel parallel-syncs {name} 1\n",
            port = self.port,
            dir = self.dir.display(),
        );
        std::fs::write(&conf, text).expect("write sentinel.conf");
        vec![conf.to_string_lossy().into_owned(), "--sentinel".into()]
    }

    fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new(redis_server_binary())
            .args(self.args())
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|err| format!("spawn redis-server: {err}"))?;
        self.child = Some(child);
        self.wait_ready()
    }

    /// Waits until the server answers PING (or NOAUTH when a password is required).
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(format!("redis-server exited with {status}"));
                }
            }
            if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) {
                let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                let mut reply = [0u8; 64];
                if stream.write_all(b"PING\r\n").is_ok() {
                    if let Ok(n) = stream.read(&mut reply) {
                        if reply[..n].starts_with(b"+PONG") || reply[..n].starts_with(b"-NOAUTH") {
                            return Ok(());
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err("redis-server did not answer within 10 s".into())
    }

    /// SIGKILL: the server vanishes mid-call, as a crashed machine would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (empty: persistence is off).
    pub fn restart(&mut self) {
        self.kill();
        if let Err(err) = self.spawn() {
            panic!("redis-server did not restart on port {}: {err}", self.port);
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// A plain synchronous connection for tests to inspect or tamper with the data, logged in
    /// with the given URL.
    pub fn connection_for(&self, url: &str) -> redis::Connection {
        redis::Client::open(url)
            .and_then(|client| client.get_connection())
            .unwrap_or_else(|err| panic!("connect to the test server: {err}"))
    }

    /// A connection as the `default` user (with `requirepass` when set).
    pub fn connection(&self) -> redis::Connection {
        match &self.options.requirepass {
            Some(password) => self.connection_for(&self.url_with("default", password)),
            None => self.connection_for(&self.url()),
        }
    }
}

/// Closes every client connection except `admin`'s: calls in flight see the connection drop
/// while the server and its data stay.
pub fn cut_client_connections(admin: &mut redis::Connection) {
    let _: redis::Value = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query(admin)
        .expect("CLIENT KILL");
}

/// `CLIENT PAUSE ms ALL`: the server reads requests but holds every answer, so a call started
/// now is surely in flight when the test kills the server.
pub fn pause_clients(admin: &mut redis::Connection, ms: u64) {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("ALL")
        .query(admin)
        .expect("CLIENT PAUSE");
}

/// `CLIENT PAUSE ms WRITE`: the server reads requests but holds the answers to writes, while
/// other commands (an admin's `CLIENT KILL`) still run; `CLIENT UNPAUSE` ends it.
pub fn pause_writes(admin: &mut redis::Connection, ms: u64) {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("WRITE")
        .query(admin)
        .expect("CLIENT PAUSE WRITE");
}

/// `CLIENT UNPAUSE`.
pub fn unpause(admin: &mut redis::Connection) {
    let _: () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query(admin)
        .expect("CLIENT UNPAUSE");
}

/// Starts `n` cluster-enabled servers and joins them into one cluster of `n` primaries with
/// `redis-cli --cluster create` (from Debian's redis-tools, which redis-server depends on),
/// returning once every node reports `cluster_state:ok`.
pub fn start_cluster(n: usize) -> Vec<RedisServer> {
    let nodes: Vec<RedisServer> = (0..n)
        .map(|_| {
            RedisServer::start_with(ServerOptions {
                cluster: true,
                ..ServerOptions::default()
            })
        })
        .collect();
    let cli = redis_server_binary().with_file_name("redis-cli");
    let mut command = Command::new(&cli);
    command.args(["--cluster", "create"]);
    for node in &nodes {
        command.arg(format!("127.0.0.1:{}", node.port));
    }
    let out = command
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap_or_else(|err| {
            panic!(
                "run {}: {err} (apt-get install -y redis-tools)",
                cli.display()
            )
        });
    assert!(
        out.status.success(),
        "redis-cli --cluster create failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    for node in &nodes {
        loop {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut node.connection())
                .expect("CLUSTER INFO");
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not form: {info}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    nodes
}

/// Test certificates made with the `openssl` command: a CA, a server certificate for
/// `redis.test` and 127.0.0.1 signed by it, a client certificate signed by it, and a second,
/// unrelated CA.
pub struct TestCerts {
    pub dir: PathBuf,
}

impl TestCerts {
    pub fn make() -> TestCerts {
        let dir = fresh_dir();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .unwrap_or_else(|err| {
                    panic!("run openssl: {err}; the TLS tests need it: apt-get install -y openssl")
                });
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        // the extensions make version 3 certificates, the only version webpki accepts
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=DNS:redis.test,IP:127.0.0.1\n",
        )
        .unwrap();
        std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for ca in ["ca", "other-ca"] {
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
                "-subj",
                &format!("/CN=kv test {ca}"),
            ]);
        }
        for name in ["server", "client"] {
            openssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
                "-subj",
                &format!("/CN=kv test {name}"),
            ]);
            openssl(&[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &format!("{name}.pem"),
                "-extfile",
                &format!("{name}.ext"),
            ]);
        }
        TestCerts { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).expect("read a test certificate")
    }

    /// The server side: `server.pem` / `server.key`, clients checked against `ca.pem`.
    pub fn server(&self, auth_clients: bool) -> ServerTls {
        ServerTls {
            cert: self.path("server.pem"),
            key: self.path("server.key"),
            ca: self.path("ca.pem"),
            auth_clients,
        }
    }
}

impl Drop for TestCerts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
