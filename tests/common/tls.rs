//! TLS counterparts of the shared services, for tests that run the daemon over `rediss://` and
//! `amqps://` links. Nothing here touches the shared broker (127.0.0.1:5672) or Redis (6379).
//!
//! - [`TlsFiles`]: a throwaway CA, a server certificate for `localhost` and a client certificate
//!   signed by it, and a second, unrelated CA (for "unknown CA" cases), made with the `openssl`
//!   command line in a fresh temp dir.
//! - [`TlsRedis`]: a private `redis-server` listening only on a TLS port, with or without
//!   `--tls-auth-clients`.
//! - [`TlsBroker`]: a second, private RabbitMQ node (its own node name, ports, directories and
//!   config file) with a plain AMQP listener and an amqps listener.
//!
//! Everything goes away on drop, also when a test panics: servers are stopped (killed when they
//! do not stop) and their directories deleted. When the test process is killed before its
//! destructors run, an [`ExitGuard`] per server and directory (a `sh` watching a pipe of the test
//! process) kills the server and deletes the directory. Ports are chosen by the OS; every wait is
//! on a condition with a deadline.

use std::fs::File;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Output, Stdio};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};
use tokio::time::Instant;

use super::DEADLINE;

/// The `openssl` command line tool that makes the certificates.
const OPENSSL: &str = "/usr/bin/openssl";
/// The RabbitMQ start script itself (`/usr/sbin/rabbitmq-server` is a wrapper that insists on
/// the system node's log files).
const RABBITMQ_SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";
/// Home of the `rabbitmq` user: holds the Erlang cookie that the node and `rabbitmqctl` share.
const RABBITMQ_HOME: &str = "/var/lib/rabbitmq";
/// Deadline of a RabbitMQ node's boot (about 10 s on 2 busy cores).
pub const BROKER_START_DEADLINE: Duration = Duration::from_secs(60);
/// Deadline of a RabbitMQ node's stop (`rabbitmqctl stop`, then end-of-file on its stdin).
const BROKER_STOP_DEADLINE: Duration = Duration::from_secs(30);
/// Days the test certificates are valid.
const CERT_DAYS: &str = "7";

/// Extensions of the test certificates (RFC 5280 §4.2.1): CAs sign certificates and CRLs only; the
/// server certificate names `localhost` and 127.0.0.1 in its subjectAltName, which is what
/// clients check (RFC 6125), and both leaves are limited to their role by extendedKeyUsage.
const OPENSSL_CNF: &str = "\
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
";

// ---------------------------------------------------------------------------------------------
// Small helpers.
// ---------------------------------------------------------------------------------------------

/// A new directory `{temp}/{label}-{random}`, mode 0755 (the `rabbitmq` user must be able to
/// enter it).
fn fresh_dir(label: &str) -> PathBuf {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let dir = std::env::temp_dir().join(format!("{label}-{}", &id[..10]));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    set_mode(&dir, 0o755);
    dir
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {mode:o} {}: {e}", path.display()));
}

/// `n` distinct ports that were free on 127.0.0.1 a moment ago (the OS chose them; they are
/// released before returning, so a server started right after can bind them).
fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> =
        (0..N).map(|_| TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0")).collect();
    std::array::from_fn(|i| listeners[i].local_addr().expect("local addr").port())
}

/// The last `n` lines of the file at `path` (empty when it cannot be read).
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Why a server did not become ready.
enum NotReady {
    /// The process exited first (e.g. its port was taken in the meantime).
    Exited(ExitStatus),
    TimedOut,
}

/// Polls `ready` every 50 ms until it holds; returns the time it took. Fails as soon as `child`
/// exits, or after `within`.
async fn wait_ready(child: &mut Child, within: Duration, mut ready: impl AsyncFnMut() -> bool) -> Result<Duration, NotReady> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Err(NotReady::Exited(status));
        }
        if ready().await {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= within {
            return Err(NotReady::TimedOut);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A server process started by this module.
trait Server {
    fn child(&mut self) -> &mut Child;
    /// A readiness check owning everything it needs (it runs while the child is borrowed).
    fn probe(&self) -> impl AsyncFnMut() -> bool + 'static;
    /// What messages call it (e.g. `TLS redis-server on port 4321`).
    fn describe(&self) -> String;
    fn log_tail(&self, n: usize) -> String;
}

/// Starts a server with `spawn` and waits (≤ `within`) until its probe holds; returns it with
/// the time that took. A server that exits before is started again, up to 3 times in all: a port
/// the OS chose may be taken by someone else before the server binds it. Panics with the
/// server's log when it does not become ready.
async fn start_server<S: Server>(within: Duration, mut spawn: impl FnMut() -> S) -> (S, Duration) {
    for attempt in 1..=3 {
        let mut server = spawn();
        let probe = server.probe();
        match wait_ready(server.child(), within, probe).await {
            Ok(took) => return (server, took),
            Err(NotReady::Exited(status)) if attempt < 3 => {
                eprintln!("{} exited ({status}), starting it again:\n{}", server.describe(), server.log_tail(10));
            }
            Err(NotReady::Exited(status)) => panic!("{} exited ({status}):\n{}", server.describe(), server.log_tail(30)),
            Err(NotReady::TimedOut) => panic!("{} was not ready within {within:?}:\n{}", server.describe(), server.log_tail(30)),
        }
    }
    unreachable!("the last attempt returns or panics")
}

/// Waits (blocking, polling every 50 ms) at most `within` for `child` to exit, then kills it.
fn reap(child: &mut Child, within: Duration) {
    let deadline = std::time::Instant::now() + within;
    while let Ok(None) = child.try_wait() {
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Cleanup for a test process that dies without running destructors (e.g. SIGKILLed by a
/// timeout): a `sh` in a process group of its own (a signal to the test's group does not reach
/// it) that blocks reading a pipe from this process and, at end-of-file, SIGKILLs `pid` and
/// deletes `dir`. Dropping the guard disarms it (SIGKILL to the `sh`); its owner cleans up itself.
struct ExitGuard(Child);

impl ExitGuard {
    fn new(pid: Option<u32>, dir: &Path) -> ExitGuard {
        let pid = pid.map(|p| p.to_string()).unwrap_or_default();
        let script = r#"read -r _; [ -n "$1" ] && kill -9 "$1" 2>/dev/null; rm -rf -- "$2""#;
        let child = Command::new("sh")
            .args(["-c", script, "exit-guard", &pid])
            .arg(dir)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sh");
        ExitGuard(child)
    }
}

impl Drop for ExitGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `(uid, gid)` of the `rabbitmq` system user.
fn rabbitmq_user() -> (u32, u32) {
    let id = |flag: &str| -> u32 {
        let out = Command::new("id").args([flag, "rabbitmq"]).output().expect("run id");
        assert!(out.status.success(), "no rabbitmq user (is rabbitmq-server installed?)");
        String::from_utf8_lossy(&out.stdout).trim().parse().expect("numeric id")
    };
    (id("-u"), id("-g"))
}

// ---------------------------------------------------------------------------------------------
// Certificates.
// ---------------------------------------------------------------------------------------------

/// Throwaway PEM files in a temp dir of their own, deleted on drop. All keys are ECDSA P-256 in
/// PKCS#8 (`BEGIN PRIVATE KEY`); all certificates are X.509 v3, valid for 7 days from now.
/// The directory is mode 0755 and the files 0644, so the `rabbitmq` user (which a
/// [`TlsBroker`] runs as) can read them; these keys protect nothing.
pub struct TlsFiles {
    pub dir: PathBuf,
    /// Self-signed CA (`CN=pbt-test-ca`) that signed the server and client certificates.
    pub ca_cert: PathBuf,
    /// `CN=localhost`, subjectAltName `DNS:localhost, IP:127.0.0.1`, extendedKeyUsage
    /// serverAuth; signed by [`TlsFiles::ca_cert`].
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// `CN=pbt-client`, extendedKeyUsage clientAuth; signed by [`TlsFiles::ca_cert`].
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A second self-signed CA (`CN=pbt-other-ca`) that signed nothing here: trusting it alone
    /// must make every handshake with the servers fail.
    pub other_ca_cert: PathBuf,
    guard: ExitGuard,
}

impl TlsFiles {
    /// Generates every file with `openssl` (a few milliseconds). Panics with openssl's stderr
    /// when a step fails.
    pub fn generate() -> TlsFiles {
        let dir = fresh_dir("pbt-tls-certs");
        std::fs::write(dir.join("openssl.cnf"), OPENSSL_CNF).expect("write openssl.cnf");
        let files = TlsFiles {
            ca_cert: dir.join("ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
            other_ca_cert: dir.join("other-ca.crt"),
            guard: ExitGuard::new(None, &dir),
            dir,
        };
        files.self_signed("ca", "pbt-test-ca");
        files.self_signed("other-ca", "pbt-other-ca");
        files.signed_by_ca("server", "localhost");
        files.signed_by_ca("client", "pbt-client");
        for entry in std::fs::read_dir(&files.dir).expect("list the certificate dir") {
            set_mode(&entry.expect("dir entry").path(), 0o644);
        }
        files
    }

    /// Runs `openssl args…` in the directory; panics with its stderr on failure.
    fn openssl(&self, args: &[&str]) {
        let out = Command::new(OPENSSL).args(args).current_dir(&self.dir).output().expect("run openssl");
        assert!(out.status.success(), "openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }

    /// `{name}.key`, a new P-256 key in PKCS#8 PEM.
    fn key(&self, name: &str) {
        let key = format!("{name}.key");
        self.openssl(&["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", &key]);
    }

    /// `{name}.key` and the self-signed CA certificate `{name}.crt` with subject `CN={cn}`.
    fn self_signed(&self, name: &str, cn: &str) {
        self.key(name);
        let (key, crt, subj) = (format!("{name}.key"), format!("{name}.crt"), format!("/CN={cn}"));
        let args = ["req", "-x509", "-new", "-config", "openssl.cnf", "-extensions", "ca"];
        self.openssl(&[&args[..], &["-key", &key, "-subj", &subj, "-days", CERT_DAYS, "-out", &crt]].concat());
    }

    /// `{name}.key` and `{name}.crt` with subject `CN={cn}` and the extensions of section
    /// `[{name}]` of [`OPENSSL_CNF`], signed by `ca.key` (random serial number).
    fn signed_by_ca(&self, name: &str, cn: &str) {
        self.key(name);
        let (key, csr, crt, subj) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.crt"), format!("/CN={cn}"));
        self.openssl(&["req", "-new", "-config", "openssl.cnf", "-key", &key, "-subj", &subj, "-out", &csr]);
        let sign = ["x509", "-req", "-CA", "ca.crt", "-CAkey", "ca.key", "-extfile", "openssl.cnf", "-extensions", name];
        self.openssl(&[&sign[..], &["-in", &csr, "-days", CERT_DAYS, "-out", &crt]].concat());
    }
}

impl Drop for TlsFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ---------------------------------------------------------------------------------------------
// Redis over TLS.
// ---------------------------------------------------------------------------------------------

/// A private `redis-server` (TLS built in, Redis ≥ 6) that listens only on a TLS port of
/// 127.0.0.1 (`--port 0` disables the plain one), presents [`TlsFiles::server_cert`], and has no
/// persistence. Killed and its directory deleted on drop.
pub struct TlsRedis {
    child: Child,
    /// Working directory and `redis.log`.
    pub dir: PathBuf,
    /// The TLS port (chosen by the OS).
    pub port: u16,
    /// `--tls-auth-clients yes`: clients must present a certificate signed by
    /// [`TlsFiles::ca_cert`]; otherwise a client certificate is not asked for.
    pub auth_clients: bool,
    ca_cert: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    guard: ExitGuard,
}

impl TlsRedis {
    /// Starts the server and waits (≤ [`DEADLINE`]) until `redis-cli --tls … PING` (with the
    /// client certificate) answers `PONG`. A server that exits first (its port was taken) is
    /// started again on another port (3 attempts). Panics with the server's log otherwise.
    pub async fn start(files: &TlsFiles, auth_clients: bool) -> TlsRedis {
        start_server(DEADLINE, || TlsRedis::spawn(files, auth_clients)).await.0
    }

    fn spawn(files: &TlsFiles, auth_clients: bool) -> TlsRedis {
        let dir = fresh_dir("pbt-tls-redis");
        let [port] = free_ports::<1>();
        let log = dir.join("redis.log");
        let child = Command::new("redis-server")
            .args(["--port", "0", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--tls-port", &port.to_string()])
            .args(["--tls-auth-clients", if auth_clients { "yes" } else { "no" }])
            .arg("--tls-cert-file")
            .arg(&files.server_cert)
            .arg("--tls-key-file")
            .arg(&files.server_key)
            .arg("--tls-ca-cert-file")
            .arg(&files.ca_cert)
            .arg("--dir")
            .arg(&dir)
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed? scripts/services installs it)");
        TlsRedis {
            guard: ExitGuard::new(Some(child.id()), &dir),
            child,
            dir,
            port,
            auth_clients,
            ca_cert: files.ca_cert.clone(),
            client_cert: files.client_cert.clone(),
            client_key: files.client_key.clone(),
        }
    }

    /// `rediss://localhost:{port}/`: the host name the server certificate names.
    pub fn url(&self) -> String {
        format!("rediss://localhost:{}/", self.port)
    }

    /// Runs `redis-cli --tls --cacert ca.crt [--cert client.crt --key client.key] args…` against
    /// this server (at most 10 s); its output.
    pub fn cli(&self, with_client_cert: bool, args: &[&str]) -> Output {
        let cert = with_client_cert.then_some((self.client_cert.as_path(), self.client_key.as_path()));
        redis_cli_tls(self.port, &self.ca_cert, cert, args)
    }

    /// The last `n` lines of the server's log.
    pub fn log_tail(&self, n: usize) -> String {
        tail(&self.dir.join("redis.log"), n)
    }
}

impl Server for TlsRedis {
    fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    fn probe(&self) -> impl AsyncFnMut() -> bool + 'static {
        let (port, ca, cert, key) = (self.port, self.ca_cert.clone(), self.client_cert.clone(), self.client_key.clone());
        async move || redis_cli_tls(port, &ca, Some((&cert, &key)), &["PING"]).stdout.starts_with(b"PONG")
    }

    fn describe(&self) -> String {
        format!("TLS redis-server on port {}", self.port)
    }

    fn log_tail(&self, n: usize) -> String {
        TlsRedis::log_tail(self, n)
    }
}

/// `redis-cli --tls` on `localhost:port`, trusting `ca`, with `(cert, key)` as client
/// certificate when given; killed after 10 s.
fn redis_cli_tls(port: u16, ca: &Path, client: Option<(&Path, &Path)>, args: &[&str]) -> Output {
    let mut cmd = Command::new("timeout");
    cmd.args(["10", "redis-cli", "--tls", "-h", "localhost", "-p", &port.to_string(), "--cacert"]).arg(ca);
    if let Some((cert, key)) = client {
        cmd.arg("--cert").arg(cert).arg("--key").arg(key);
    }
    cmd.args(args).stdin(Stdio::null()).output().expect("run redis-cli")
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("TLS redis-server log ({}):\n{}", self.url(), self.log_tail(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ---------------------------------------------------------------------------------------------
// RabbitMQ over TLS.
// ---------------------------------------------------------------------------------------------

/// A second, private RabbitMQ node for one test, with a plain AMQP listener and an amqps
/// listener on 127.0.0.1. It has its own node name (`pbt-tls-{random}@localhost`), Erlang
/// distribution port, mnesia/log directories and `rabbitmq.conf` under [`TlsBroker::dir`], and no
/// plugins; it runs as the `rabbitmq` user with that user's Erlang cookie (so `rabbitmqctl -n
/// {node}` reaches it). The shared broker is not touched.
///
/// TLS (`ssl_options`): presents [`TlsFiles::server_cert`], asks clients for a certificate and
/// verifies one when given (`verify_peer`) against [`TlsFiles::ca_cert`], but admits clients
/// without one (`fail_if_no_peer_cert = false`); login is guest/guest on both listeners.
///
/// Dropping it stops the node (`rabbitmqctl stop`, then end-of-file on its stdin, then SIGKILL)
/// and deletes its directory. Boot takes about 10 s on 2 busy cores (see [`TlsBroker::startup`]).
pub struct TlsBroker {
    /// The node's VM (`rabbitmq-server` with `RABBITMQ_ALLOW_INPUT` execs `erl` in place).
    child: Child,
    /// The node's stdin (an Erlang shell): it halts at end-of-file, i.e. when this is dropped or
    /// the test process dies.
    stdin: Option<ChildStdin>,
    /// Config, mnesia (`mnesia/`), logs (`log/{node}.log`), `out.log`/`err.log` of the VM.
    pub dir: PathBuf,
    /// `pbt-tls-{random}@localhost`.
    pub node: String,
    /// Plain AMQP 0-9-1 port.
    pub amqp_port: u16,
    /// AMQP 0-9-1 over TLS.
    pub amqps_port: u16,
    /// Erlang distribution port (`RABBITMQ_DIST_PORT`), on 127.0.0.1 only.
    pub dist_port: u16,
    /// Time from the start of the node until both listeners answered.
    pub startup: Duration,
    guard: ExitGuard,
}

impl TlsBroker {
    /// Starts the node and waits (≤ [`BROKER_START_DEADLINE`]) until an AMQP connection to the
    /// plain port succeeds and the TLS port accepts TCP connections (RabbitMQ opens its listeners
    /// last in its boot). A node that exits first (e.g. a port was taken) is started again with
    /// other ports and another name (3 attempts). Panics with the node's log otherwise.
    pub async fn start(files: &TlsFiles) -> TlsBroker {
        let (mut broker, took) = start_server(BROKER_START_DEADLINE, || TlsBroker::spawn(files, false)).await;
        broker.startup = took;
        broker
    }

    /// [`TlsBroker::start`] with certificate login: the `rabbitmq_auth_mechanism_ssl` plugin, the
    /// SASL mechanisms PLAIN, AMQPLAIN and EXTERNAL, and `ssl_cert_login_from = common_name`, so a
    /// client that chooses EXTERNAL over TLS logs in as the user named by its certificate's CN
    /// (<https://www.rabbitmq.com/docs/ssl#peer-verification>, the plugin's README). guest/guest
    /// still logs in with PLAIN.
    pub async fn start_with_certificate_login(files: &TlsFiles) -> TlsBroker {
        let (mut broker, took) = start_server(BROKER_START_DEADLINE, || TlsBroker::spawn(files, true)).await;
        broker.startup = took;
        broker
    }

    /// `rabbitmqctl -q -n {node} args…` (killed after 30 s); panics with its output on failure.
    pub fn ctl(&self, args: &[&str]) {
        let out = Command::new("timeout")
            .args(["30", "rabbitmqctl", "-q", "-n", &self.node])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run rabbitmqctl");
        assert!(out.status.success(), "rabbitmqctl -n {} {}: {}{}", self.node, args.join(" "), String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }

    /// Writes the node's files and starts it; see [`TlsBroker::start`] and
    /// [`TlsBroker::start_with_certificate_login`].
    fn spawn(files: &TlsFiles, certificate_login: bool) -> TlsBroker {
        let dir = fresh_dir("pbt-tls-node");
        let (uid, gid) = rabbitmq_user();
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown the node dir to rabbitmq");
        let id = uuid::Uuid::new_v4().simple().to_string();
        let node = format!("pbt-tls-{}@localhost", &id[..10]);
        let [amqp_port, amqps_port, dist_port] = free_ports::<3>();
        let config = dir.join("rabbitmq.conf");
        let mut conf = broker_config(files, amqp_port, amqps_port);
        if certificate_login {
            conf.push_str("auth_mechanisms.1 = PLAIN\nauth_mechanisms.2 = AMQPLAIN\nauth_mechanisms.3 = EXTERNAL\nssl_cert_login_from = common_name\n");
        }
        std::fs::write(&config, conf).expect("write rabbitmq.conf");
        // No plugins but certificate login's (the management plugin would take a fixed port).
        let plugins = if certificate_login { "[rabbitmq_auth_mechanism_ssl].\n" } else { "[].\n" };
        std::fs::write(dir.join("enabled_plugins"), plugins).expect("write enabled_plugins");
        let mut child = Command::new(RABBITMQ_SERVER)
            .uid(uid)
            .gid(gid)
            .current_dir(&dir)
            .env_clear()
            .env("PATH", "/usr/bin:/bin:/usr/sbin:/sbin")
            .env("LANG", "C.UTF-8")
            .env("HOME", RABBITMQ_HOME)
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", "-kernel inet_dist_use_interface {127,0,0,1}")
            .env("RABBITMQ_CONFIG_FILE", &config)
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
            .env("RABBITMQ_CONF_ENV_FILE", "/dev/null")
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", dir.join("plugins-expand"))
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_PID_FILE", dir.join("node.pid"))
            // Run the VM in place of the script with an Erlang shell on stdin: it halts when
            // stdin reaches end-of-file.
            .env("RABBITMQ_ALLOW_INPUT", "1")
            .stdin(Stdio::piped())
            .stdout(File::create(dir.join("out.log")).expect("create out.log"))
            .stderr(File::create(dir.join("err.log")).expect("create err.log"))
            .spawn()
            .expect("start rabbitmq-server (is it installed? scripts/services installs it)");
        let stdin = child.stdin.take();
        let guard = ExitGuard::new(Some(child.id()), &dir);
        TlsBroker { child, stdin, dir, node, amqp_port, amqps_port, dist_port, startup: Duration::ZERO, guard }
    }

    /// `amqps://guest:guest@localhost:{amqps_port}/%2f`: the host name the server certificate
    /// names.
    pub fn amqps_url(&self) -> String {
        format!("amqps://guest:guest@localhost:{}/%2f", self.amqps_port)
    }

    /// `amqp://guest:guest@localhost:{amqp_port}/%2f` (plain), for the test's own publishing
    /// and consuming.
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@localhost:{}/%2f", self.amqp_port)
    }

    /// The last `n` lines of the node's log (`log/{node}.log`), or of its stdout and stderr when
    /// it wrote no log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = tail(&self.dir.join("log").join(format!("{}.log", self.node)), n);
        if !log.is_empty() {
            return log;
        }
        format!("{}\n{}", tail(&self.dir.join("out.log"), n), tail(&self.dir.join("err.log"), n))
    }
}

impl Server for TlsBroker {
    fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    fn probe(&self) -> impl AsyncFnMut() -> bool + 'static {
        let (amqp_url, amqps_addr) = (self.amqp_url(), format!("127.0.0.1:{}", self.amqps_port));
        async move || amqp_handshake(&amqp_url).await && tokio::net::TcpStream::connect(&amqps_addr).await.is_ok()
    }

    fn describe(&self) -> String {
        format!("RabbitMQ node {} (amqp {}, amqps {})", self.node, self.amqp_port, self.amqps_port)
    }

    fn log_tail(&self, n: usize) -> String {
        TlsBroker::log_tail(self, n)
    }
}

/// The node's `rabbitmq.conf` (new-style format; keys from https://www.rabbitmq.com/ssl.html).
fn broker_config(files: &TlsFiles, amqp_port: u16, amqps_port: u16) -> String {
    format!(
        "listeners.tcp.1 = 127.0.0.1:{amqp_port}\n\
         listeners.ssl.1 = 127.0.0.1:{amqps_port}\n\
         ssl_options.cacertfile = {}\n\
         ssl_options.certfile = {}\n\
         ssl_options.keyfile = {}\n\
         ssl_options.verify = verify_peer\n\
         ssl_options.fail_if_no_peer_cert = false\n",
        files.ca_cert.display(),
        files.server_cert.display(),
        files.server_key.display(),
    )
}

/// Whether an AMQP connection to `url` opens (within 5 s); it is closed again.
async fn amqp_handshake(url: &str) -> bool {
    match tokio::time::timeout(Duration::from_secs(5), Connection::connect(url, ConnectionProperties::default())).await {
        Ok(Ok(conn)) => {
            let _ = conn.close(200, "ready".into()).await;
            true
        }
        _ => false,
    }
}

impl Drop for TlsBroker {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("RabbitMQ node {} log:\n{}", self.node, self.log_tail(30));
        }
        if let Ok(None) = self.child.try_wait() {
            // A graceful stop first (under a second); its outcome shows in how the VM exits.
            let _ = Command::new("timeout")
                .args([&BROKER_STOP_DEADLINE.as_secs().to_string(), "rabbitmqctl", "-q", "-n", &self.node, "stop"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        // End-of-file on its stdin halts a node that is still running.
        drop(self.stdin.take());
        reap(&mut self.child, BROKER_STOP_DEADLINE);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
