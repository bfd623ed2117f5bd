//! Shared helpers of the integration tests (real RabbitMQ on 127.0.0.1:5672 and Redis on
//! 127.0.0.1:6379, `scripts/services` starts them; the fake LLM runs in the test process).
//!
//! - [`TestEnv`]: one unique name per test (`pbt-{test}-{random}`) used for EVERY queue, exchange
//!   and the Redis key prefix, so tests run in parallel without interfering; a temp directory for
//!   config files and daemon logs; cleanup of everything at the end (also on panic, best effort).
//! - [`TestEnv::raw_config`]: a small, fast configuration (8 partitions, short lease timings).
//! - [`Daemon`] (in process, `app::run` with a oneshot as shutdown) and [`DaemonProcess`] (the
//!   real binary, `run` subcommand, config in a temp TOML file, stderr in a temp log file).
//! - [`Amqp`]: publishing with publisher confirms; [`Collector`]: consumes results until a
//!   condition holds, with a deadline.
//! - [`RedisProbe`]: reads leases and member keys; [`RedisServer`]: a private, disruptable
//!   redis-server on a Unix socket (never the shared one).
//! - [`broker`]: `rabbitmqctl` views of the broker (queue depths, unacked counts, deletes).
//!
//! Cleanup is certain: [`TestEnv`]'s `Drop` deletes the namespace's queues, exchanges and Redis
//! keys when a test panics before [`TestEnv::cleanup`]; a [`Daemon`] dropped on a multi-thread
//! runtime first waits for its shutdown (so it cannot re-declare a queue after the cleanup), and a
//! [`DaemonProcess`] or [`RedisServer`] dropped while running is killed. Locals drop in reverse
//! order, so a `TestEnv` created first is cleaned up last.
//!
//! Nothing here sleeps for a fixed time to "let things settle": every wait is on a condition with
//! a deadline, and fails with a message saying what did not happen.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer, PublisherConfirm};
use prefix_batcher::app::{self, AppError};
use prefix_batcher::config::{RawConfig, Settings};
use prefix_batcher::lease::LeaseValue;
use prefix_batcher::request::RequestResult;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
pub mod tls;

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const REDIS_URL: &str = "redis://127.0.0.1:6379/";
/// Default deadline of every wait.
pub const DEADLINE: Duration = Duration::from_secs(60);
/// Partitions of the test deployments.
pub const PARTITIONS: u32 = 8;
/// Characters of a completions prompt that form its key (`keying.prefix_chars`).
pub const PREFIX_CHARS: usize = 32;

// ---------------------------------------------------------------------------------------------
// Test environment: names, config, cleanup.
// ---------------------------------------------------------------------------------------------

/// `pub fn $name(&self) -> String` returning `{self.name}.{suffix}` for each `$name => suffix`:
/// the queue and exchange names of a test's deployment.
macro_rules! namespaced_names {
    ($($name:ident => $suffix:literal),* $(,)?) => {
        $(
            pub fn $name(&self) -> String {
                format!("{}.{}", self.name, $suffix)
            }
        )*
    };
}

/// One test's private namespace.
pub struct TestEnv {
    /// `pbt-{test}-{random}`: prefix of every queue and exchange, and the Redis key prefix.
    pub name: String,
    /// Config files and daemon logs.
    pub dir: PathBuf,
    cleaned: bool,
}

impl TestEnv {
    pub fn new(test: &str) -> TestEnv {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("pbt-{test}-{}", &id[..10]);
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).expect("create the test's temp dir");
        TestEnv { name, dir, cleaned: false }
    }

    /// An instance name inside this test's namespace.
    pub fn instance(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.name)
    }

    namespaced_names! {
        input_queue => "input",
        shard_exchange => "shards",
        partition_queue_prefix => "partition",
        results_queue => "results",
        dead_letter_exchange => "dlx",
        dead_letter_queue => "dead-letter",
    }

    pub fn partition_queue(&self, p: u32) -> String {
        format!("{}.{:03}", self.partition_queue_prefix(), p)
    }
    /// Redis key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.name
    }

    /// A valid configuration for this test: every name in the namespace, [`PARTITIONS`]
    /// partitions, 4 shards per key, batches of ≤ 8 flushed after 150 ms, lease 3 s / renew
    /// deadline 2 s / renew every 500 ms, member TTL 2 s, settle 200 ms, drain 10 s, LLM retries
    /// with a 10 ms backoff, HTTP on an OS-chosen port.
    pub fn raw_config(&self, llm_url: &str) -> RawConfig {
        let mut r = RawConfig::default();
        r.instance.name = self.instance("a");
        let a = &mut r.amqp;
        a.url = AMQP_URL.into();
        a.input_queue = self.input_queue();
        a.shard_exchange = self.shard_exchange();
        a.partition_queue_prefix = self.partition_queue_prefix();
        a.results_queue = self.results_queue();
        a.dead_letter_exchange = self.dead_letter_exchange();
        a.dead_letter_queue = self.dead_letter_queue();
        a.partitions = PARTITIONS;
        a.input_prefetch = 64;
        a.partition_prefetch = 16;
        a.confirm_timeout = "10s".into();
        a.reconnect_backoff_initial = "100ms".into();
        a.reconnect_backoff_max = "1s".into();
        a.backlog_poll_interval = "1s".into();
        // Results go to the tests' named reply queues (`pbt-…`) and to server-named ones.
        r.requests.reply_to_pattern = r"(amq\.gen-|pbt-).*".into();
        r.redis.url = REDIS_URL.into();
        r.redis.key_prefix = self.name.clone();
        r.redis.command_timeout = "2s".into();
        let o = &mut r.ownership;
        o.lease_ttl = "3s".into();
        o.renew_deadline = "2s".into();
        o.renew_interval = "500ms".into();
        o.member_ttl = "2s".into();
        o.settle_time = "200ms".into();
        r.keying.prefix_chars = PREFIX_CHARS;
        r.sharding.default_shards = 4;
        r.batching.max_batch_size = 8;
        r.batching.max_batch_wait = "150ms".into();
        r.batching.channel_capacity = 64;
        let l = &mut r.llm;
        l.endpoints = vec![llm_url.trim_end_matches('/').to_owned()];
        l.model = "test-model".into();
        l.max_concurrency = 4;
        l.request_timeout = "20s".into();
        l.connect_timeout = "2s".into();
        l.max_attempts = 3;
        l.backoff_initial = "10ms".into();
        l.backoff_max = "100ms".into();
        r.http.listen = "127.0.0.1:0".into();
        r.shutdown.drain_timeout = "10s".into();
        r.log.level = "info".into();
        r
    }

    /// Deletes every queue and exchange of this test and every Redis key under its prefix.
    pub async fn cleanup(mut self) {
        cleanup_resources(&self.name, (Vec::new(), Vec::new())).await;
        let _ = std::fs::remove_dir_all(&self.dir);
        self.cleaned = true;
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        // The test failed before its cleanup: clean up from a thread with its own runtime (this
        // may run inside the test's runtime), and keep the logs for the post-mortem.
        eprintln!("test namespace {}: logs and configs kept in {}", self.name, self.dir.display());
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
                rt.block_on(async {
                    // Also whatever else the namespace holds (names this file does not know).
                    let listed = broker::names_with_prefix(&format!("{name}."));
                    let _ = tokio::time::timeout(Duration::from_secs(30), cleanup_resources(&name, listed)).await;
                });
            }
        })
        .join();
    }
}

/// Deletes the namespace's queues and exchanges (the known names plus `listed` = `(queues,
/// exchanges)`) and its Redis keys.
async fn cleanup_resources(name: &str, listed: (Vec<String>, Vec<String>)) {
    // Queues: everything a deployment of up to 64 partitions declares (tests use fewer; deleting
    // a queue that does not exist is a no-op in RabbitMQ).
    let mut queues = vec![
        format!("{name}.input"),
        format!("{name}.results"),
        format!("{name}.dead-letter"),
    ];
    queues.extend((0..=64).map(|p| format!("{name}.partition.{p:03}")));
    queues.extend(listed.0);
    let mut exchanges = vec![format!("{name}.shards"), format!("{name}.dlx")];
    exchanges.extend(listed.1);
    if let Ok(conn) = Connection::connect(AMQP_URL, ConnectionProperties::default()).await {
        let mut ch = conn.create_channel().await.ok();
        for q in &queues {
            if ch.is_none() {
                ch = conn.create_channel().await.ok();
            }
            if let Some(c) = &ch {
                if c.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await.is_err() {
                    ch = None;
                }
            }
        }
        for x in exchanges {
            if ch.is_none() {
                ch = conn.create_channel().await.ok();
            }
            if let Some(c) = &ch {
                if c.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default()).await.is_err() {
                    ch = None;
                }
            }
        }
        let _ = conn.close(200, "test cleanup".into()).await;
    }
    if let Ok(mut r) = RedisProbe::connect().await {
        let keys = r.keys(&format!("{name}:*")).await;
        if !keys.is_empty() {
            let _: Result<i64, _> = redis::cmd("DEL").arg(&keys).query_async(&mut r.conn).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Workloads.
// ---------------------------------------------------------------------------------------------

/// A request the test publishes: `id` is also its correlation id and message id.
#[derive(Debug, Clone)]
pub struct TestRequest {
    pub id: String,
    pub body: Vec<u8>,
    /// The workload group (prefix) it belongs to.
    pub group: usize,
}

/// The shared prefix of group `g`: exactly [`PREFIX_CHARS`] characters, so it is the whole key
/// material of a completions prompt that starts with it; its first 8 characters are
/// `prefix-{g}` for one-digit groups.
pub fn group_prefix(g: usize) -> String {
    let p = format!("{:-<width$}", format!("prefix-{g}:"), width = PREFIX_CHARS);
    assert_eq!(p.chars().count(), PREFIX_CHARS);
    p
}

/// A completions request of group `g`.
pub fn completion(id: &str, g: usize, question: &str) -> TestRequest {
    let prompt = format!("{}{question}", group_prefix(g));
    let body = serde_json::json!({"id": id, "prompt": prompt, "params": {"max_tokens": 8}});
    TestRequest { id: id.to_owned(), body: serde_json::to_vec(&body).unwrap(), group: g }
}

/// `n` completions requests spread round-robin over `groups` prefixes, ids `{tag}-{i}`.
pub fn completions_workload(tag: &str, n: usize, groups: usize) -> Vec<TestRequest> {
    (0..n).map(|i| completion(&format!("{tag}-{i}"), i % groups, &format!(" question {i}?"))).collect()
}

pub fn ids(reqs: &[TestRequest]) -> HashSet<String> {
    reqs.iter().map(|r| r.id.clone()).collect()
}

// ---------------------------------------------------------------------------------------------
// The daemon, in process and as a process.
// ---------------------------------------------------------------------------------------------

/// A daemon running in this process (`app::run`) with a oneshot as its shutdown signal. Dropping
/// it starts a graceful shutdown (the sender is dropped).
pub struct Daemon {
    pub instance: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), AppError>>>,
}

/// With `PREFIX_BATCHER_TEST_LOG` set to a tracing filter (e.g. `prefix_batcher=info`), the
/// in-process daemons log through the test harness's captured output: a failing test prints its
/// daemon's log with its own output, a passing one prints nothing (`--nocapture` shows all).
fn init_test_log() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("PREFIX_BATCHER_TEST_LOG") {
            let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| panic!("PREFIX_BATCHER_TEST_LOG={filter:?}: {e}"));
            let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
        }
    });
}

/// Starts `app::run` on the current runtime.
pub fn start_daemon(raw: &RawConfig) -> Daemon {
    init_test_log();
    let settings = Settings::from_raw(raw).unwrap_or_else(|e| panic!("test configuration is invalid: {e}"));
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(app::run(settings, async move {
        let _ = rx.await;
    }));
    Daemon { instance: raw.instance.name.clone(), stop: Some(tx), task: Some(task) }
}

/// Stops the daemon of `started` (it must still run and stop cleanly), checks that the input
/// queue is empty, and deletes what the test created.
pub async fn stop_with_input_empty(started: Started, env: TestEnv) {
    assert!(!started.daemon.is_finished(), "the daemon stopped");
    started.daemon.stop().await.expect("daemon stops cleanly");
    assert_eq!(started.amqp.queue_depth(&env.input_queue()).await.0, 0, "input queue not empty");
    started.results.close().await;
    started.amqp.close().await;
    env.cleanup().await;
}

/// The value of counter `prefix_batcher_{metric}` with `label = "value"` in this process (0
/// before its first increment).
pub fn counter(metric: &str, label: &str, value: &str) -> f64 {
    let (start, label) = (format!("prefix_batcher_{metric}{{"), format!(r#"{label}="{value}""#));
    prefix_batcher::metrics::render()
        .lines()
        .find(|l| l.starts_with(&start) && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A daemon started in process, holding every partition's lease, with the test's reply queue.
pub struct Started {
    pub amqp: Amqp,
    pub daemon: Daemon,
    pub results: Collector,
    /// Name of the reply queue (`{env.name}.reply`).
    pub reply: String,
}

/// Starts `app::run` with `raw`, waits until it holds every partition's lease (so its topology is
/// declared before anything is published), and opens the reply queue `{env.name}.reply`.
pub async fn start_with_replies(env: &TestEnv, raw: &RawConfig) -> Started {
    let amqp = Amqp::connect().await;
    let mut redis = RedisProbe::connect().await.unwrap();
    let daemon = start_daemon(raw);
    redis.wait_all_held_by(env.key_prefix(), raw.amqp.partitions, &raw.instance.name).await;
    let reply = format!("{}.reply", env.name);
    let results = amqp.reply_queue(&reply).await;
    Started { amqp, daemon, results, reply }
}

impl Started {
    /// Publishes `reqs` to the input queue with replies to the reply queue, waits (≤
    /// [`DEADLINE`]) until each has a result, stops the daemon (it must stop cleanly) and waits
    /// on a [`Collector::barrier`], so the returned collector holds every result the daemon
    /// published. Returns the connection and that collector.
    pub async fn publish_and_drain(self, env: &TestEnv, reqs: &[TestRequest]) -> (Amqp, Collector) {
        let Started { amqp, daemon, mut results, reply } = self;
        amqp.publish_requests(&env.input_queue(), reqs, &reply).await;
        results.until_all(&ids(reqs), DEADLINE).await;
        daemon.stop().await.expect("daemon stops cleanly");
        results.barrier(&amqp).await;
        (amqp, results)
    }
}

impl Drop for Daemon {
    /// Starts the graceful shutdown and, on a multi-thread runtime, waits (≤ [`DEADLINE`]) for
    /// `app::run` to return, so the daemon cannot re-declare a queue or rewrite a Redis key after
    /// the test's cleanup (a test that panics drops its daemon before its [`TestEnv`]). On a
    /// current-thread runtime the daemon's tasks cannot run again before the runtime is dropped,
    /// and blocking would deadlock, so it does not wait.
    fn drop(&mut self) {
        let Some(task) = self.task.take() else { return };
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        if task.is_finished() || handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return;
        }
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        handle.spawn(async move {
            let _ = task.await;
            let _ = done_tx.send(());
        });
        let _ = done_rx.recv_timeout(DEADLINE);
    }
}

impl Daemon {
    /// Signals shutdown and waits (≤ [`DEADLINE`]) for `app::run` to return.
    pub async fn stop(mut self) -> Result<(), AppError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let task = self.task.take().expect("stopped once");
        match tokio::time::timeout(DEADLINE, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => panic!("daemon {} panicked: {e}", self.instance),
            Err(_) => panic!("daemon {} did not stop within {DEADLINE:?}", self.instance),
        }
    }

    /// Whether `app::run` returned already (it should not, while the test runs).
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(|t| t.is_finished())
    }
}

/// The binary under test, with a clean environment: no `PREFIX_BATCHER*` overrides or `RUST_LOG`
/// from the caller, no colours in logs.
pub fn bin_command() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_prefix-batcher"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PREFIX_BATCHER") {
            c.env_remove(k);
        }
    }
    c.env_remove("RUST_LOG").env("NO_COLOR", "1").stdin(Stdio::null());
    c
}

/// A child process of the binary; killed with SIGKILL when dropped while still running.
pub struct DaemonProcess {
    pub label: String,
    child: Child,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl DaemonProcess {
    /// Starts `cmd` with stdout and stderr in `{dir}/{label}.out` / `{label}.log`.
    pub fn spawn(env: &TestEnv, label: &str, mut cmd: Command) -> DaemonProcess {
        let stdout = env.dir.join(format!("{label}.out"));
        let stderr = env.dir.join(format!("{label}.log"));
        let child = cmd
            .stdout(File::create(&stdout).expect("create stdout file"))
            .stderr(File::create(&stderr).expect("create log file"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {label}: {e}"));
        DaemonProcess { label: label.to_owned(), child, stdout, stderr }
    }

    /// Writes `raw` as `{dir}/{label}.toml` and starts `prefix-batcher --config … run`.
    pub fn run(env: &TestEnv, label: &str, raw: &RawConfig) -> DaemonProcess {
        let cfg = write_config(env, label, raw);
        let mut cmd = bin_command();
        cmd.arg("--config").arg(&cfg).arg("run");
        DaemonProcess::spawn(env, label, cmd)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        self.child.kill().expect("SIGKILL the daemon");
        self.child.wait().expect("reap the daemon");
    }

    /// SIGTERM (graceful stop).
    pub fn sigterm(&self) {
        self.signal("TERM");
    }

    /// Sends the signal named `name` (`kill -{name}`, e.g. `HUP`).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .unwrap_or_else(|e| panic!("run kill -{name}: {e}"))
            .success();
        assert!(ok, "kill -{name} {} ({}) failed", self.pid(), self.label);
    }

    /// Waits for the process to exit, polling every 20 ms, at most `within`.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s;
            }
            if Instant::now() >= deadline {
                panic!("{} did not exit within {within:?}; its log:\n{}", self.label, self.log_tail(40));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Everything written to stderr so far, without ANSI escape sequences.
    pub fn log(&self) -> String {
        strip_ansi(&std::fs::read_to_string(&self.stderr).unwrap_or_default())
    }

    pub fn out(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The first log line containing `needle`, waiting ≤ `within` for it; panics with the log's
    /// tail when it does not come in time or the process exits first (`what` says which event
    /// the line reports).
    pub async fn wait_log_line(&mut self, needle: &str, within: Duration, what: &str) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(line) = self.log().lines().find(|l| l.contains(needle)) {
                return line.to_owned();
            }
            assert!(self.is_running(), "{} exited before logging {what} ({needle:?}):\n{}", self.label, self.log_tail(30));
            assert!(Instant::now() < deadline, "{} logged no {what} ({needle:?}) within {within:?}:\n{}", self.label, self.log_tail(30));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The HTTP address the daemon logged (`http listening addr=…`), waiting ≤ [`DEADLINE`].
    pub async fn http_addr(&self) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let log = self.log();
            if let Some(line) = log.lines().find(|l| l.contains("http listening")) {
                let addr = line.split("addr=").nth(1).and_then(|s| s.split_whitespace().next());
                return addr.unwrap_or_else(|| panic!("no addr= in {line}")).to_owned();
            }
            assert!(Instant::now() < deadline, "{} logged no 'http listening' line:\n{}", self.label, self.log_tail(20));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// `GET path` on `addr` (HTTP/1.0): `(status, body)`; status 0 when nothing answers.
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else { return (0, String::new()) };
    let mut resp = String::new();
    let request = format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n");
    if s.write_all(request.as_bytes()).await.is_err() || s.read_to_string(&mut resp).await.is_err() {
        return (0, String::new());
    }
    let status = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Writes `raw` as TOML to `{dir}/{label}.toml` and returns the path.
pub fn write_config(env: &TestEnv, label: &str, raw: &RawConfig) -> PathBuf {
    let path = env.dir.join(format!("{label}.toml"));
    std::fs::write(&path, to_toml(raw)).expect("write config");
    path
}

/// Renders a `RawConfig` as TOML (one table per section; JSON scalars and arrays are valid TOML
/// values; empty tables and lists are left out so their defaults apply).
pub fn to_toml(raw: &RawConfig) -> String {
    fn value(v: &serde_json::Value) -> String {
        match v {
            serde_json::Value::Object(m) => {
                let fields: Vec<String> = m.iter().map(|(k, v)| format!("{} = {}", serde_json::Value::String(k.clone()), value(v))).collect();
                format!("{{ {} }}", fields.join(", "))
            }
            serde_json::Value::Array(a) => format!("[{}]", a.iter().map(value).collect::<Vec<_>>().join(", ")),
            other => other.to_string(),
        }
    }
    let v = serde_json::to_value(raw).expect("RawConfig serializes");
    let mut out = String::new();
    for (section, body) in v.as_object().expect("sections") {
        out.push_str(&format!("[{section}]\n"));
        for (k, v) in body.as_object().expect("section body") {
            let empty = matches!(v, serde_json::Value::Object(m) if m.is_empty()) || matches!(v, serde_json::Value::Array(a) if a.is_empty());
            if !empty {
                out.push_str(&format!("{k} = {}\n", value(v)));
            }
        }
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------------------------------------
// AMQP: publishing and collecting.
// ---------------------------------------------------------------------------------------------

/// A test's AMQP connection with a channel in confirm mode.
pub struct Amqp {
    pub conn: Connection,
    pub ch: Channel,
}

impl Amqp {
    pub async fn connect() -> Amqp {
        Amqp::connect_to(AMQP_URL).await
    }

    /// Connects to the broker at `url` (e.g. a private node of [`tls::TlsBroker`]).
    pub async fn connect_to(url: &str) -> Amqp {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("connect to RabbitMQ at {url} (run scripts/services): {e}"));
        let ch = conn.create_channel().await.expect("channel");
        ch.confirm_select(ConfirmSelectOptions::default()).await.expect("confirm.select");
        Amqp { conn, ch }
    }

    /// Declares an exclusive reply queue `name` (it goes away with this connection) and consumes
    /// it (auto-ack) on its own channel.
    pub async fn reply_queue(&self, name: &str) -> Collector {
        let ch = self.conn.create_channel().await.expect("channel");
        let opts = QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() };
        ch.queue_declare(name.into(), opts, FieldTable::default()).await.expect("declare reply queue");
        Collector::consume(ch, name).await
    }

    /// Consumes an existing queue (auto-ack) on a new channel.
    pub async fn consume(&self, queue: &str) -> Collector {
        let ch = self.conn.create_channel().await.expect("channel");
        Collector::consume(ch, queue).await
    }

    /// Publishes one message to the default exchange with routing key `queue`, mandatory, and
    /// waits for the broker's confirm.
    pub async fn publish(&self, queue: &str, body: &[u8], props: BasicProperties) {
        let confirm = self
            .ch
            .basic_publish("".into(), queue.into(), BasicPublishOptions { mandatory: true, ..Default::default() }, body, props)
            .await
            .expect("publish")
            .await
            .expect("publisher confirm");
        assert!(!confirm.is_nack(), "broker nacked a publish to {queue}");
        assert!(confirm.take_message().is_none(), "publish to {queue} was returned: the queue does not exist");
    }

    /// Publishes `reqs` to `queue` (pipelined) with `reply_to`, then waits for every confirm.
    pub async fn publish_requests(&self, queue: &str, reqs: &[TestRequest], reply_to: &str) {
        let mut confirms = Vec::with_capacity(reqs.len());
        for r in reqs {
            let confirm = self
                .ch
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions { mandatory: true, ..Default::default() },
                    &r.body,
                    request_props(&r.id, reply_to),
                )
                .await
                .expect("publish request");
            confirms.push(confirm);
        }
        assert_requests_confirmed(confirms, queue).await;
    }

    /// `(ready messages, consumers)` of a queue (passive declare on a throwaway channel).
    pub async fn queue_depth(&self, queue: &str) -> (u32, u32) {
        let ch = self.conn.create_channel().await.expect("channel");
        let q = ch
            .queue_declare(queue.into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
            .await
            .unwrap_or_else(|e| panic!("queue {queue} should exist: {e}"));
        let _ = ch.close(200, "ok".into()).await;
        (q.message_count(), q.consumer_count())
    }

    /// Waits until `queue` has exactly `want` consumers (a partition worker holds its lease a
    /// moment before its consumer is registered); panics naming the queue after `within`.
    /// Waits (≤ [`DEADLINE`]) until `queue` exists on this broker and has a consumer (the daemon
    /// declared its topology and holds the partition).
    pub async fn wait_consumed(&self, queue: &str) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let ch = self.conn.create_channel().await.expect("channel");
            let passive = QueueDeclareOptions { passive: true, ..Default::default() };
            let consumers = ch.queue_declare(queue.into(), passive, FieldTable::default()).await.map(|q| q.consumer_count()).unwrap_or(0);
            let _ = ch.close(200, "ok".into()).await;
            if consumers > 0 {
                return;
            }
            assert!(Instant::now() < deadline, "{queue} is not consumed after {DEADLINE:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The main job against a daemon on this broker: waits until every partition queue of `env`
    /// is consumed, opens the reply queue `{env.name}.reply`, publishes `n` completions requests
    /// over `groups` prefix groups (ids `{tag}-{i}`), waits (≤ [`DEADLINE`]) for all their results
    /// and asserts each is `ok`. Returns the reply collector (to close).
    pub async fn run_main_job(&self, env: &TestEnv, tag: &str, n: usize, groups: usize) -> Collector {
        for p in 0..PARTITIONS {
            self.wait_consumed(&env.partition_queue(p)).await;
        }
        let reply = format!("{}.reply", env.name);
        let mut results = self.reply_queue(&reply).await;
        let reqs = completions_workload(tag, n, groups);
        self.publish_requests(&env.input_queue(), &reqs, &reply).await;
        results.until_all(&ids(&reqs), DEADLINE).await;
        let failed: Vec<&Received> = results.received.iter().filter(|m| !m.result().ok).collect();
        assert!(failed.is_empty(), "{} of {n} requests failed, e.g. {:?}", failed.len(), failed.first().map(|m| m.result()));
        results
    }

    pub async fn wait_consumers(&self, queue: &str, want: u32, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let (_, consumers) = self.queue_depth(queue).await;
            if consumers == want {
                return;
            }
            assert!(Instant::now() < deadline, "{queue} has {consumers} consumers after {within:?}, want {want}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn close(self) {
        let _ = self.conn.close(200, "test done".into()).await;
    }
}

/// Waits for the confirms of requests published (mandatory) to `queue`: each must be an ack
/// without a returned message (a returned one means the queue does not exist).
async fn assert_requests_confirmed(confirms: Vec<PublisherConfirm>, queue: &str) {
    for c in confirms {
        let c = c.await.expect("publisher confirm");
        assert!(!c.is_nack(), "broker nacked a request");
        assert!(c.take_message().is_none(), "a request to {queue} was returned: the queue does not exist");
    }
}

/// Properties of a test request: JSON, persistent, `message_id` = `correlation_id` = `id`,
/// `reply_to`, `timestamp` = now.
pub fn request_props(id: &str, reply_to: &str) -> BasicProperties {
    cluster::request_props_to_results(id).with_reply_to(reply_to.into())
}

/// One message the test received.
#[derive(Debug, Clone)]
pub struct Received {
    pub correlation_id: String,
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
    /// Order of arrival (0-based) on this collector.
    pub seq: usize,
}

impl Received {
    /// The body as a result; panics with the body when it is not one.
    pub fn result(&self) -> RequestResult {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not a result ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The `x-partition-epoch` header as a number; panics when absent.
    pub fn epoch(&self) -> u64 {
        self.header("x-partition-epoch")
            .unwrap_or_else(|| panic!("result {} has no x-partition-epoch header: {:?}", self.correlation_id, self.headers))
            .parse()
            .expect("numeric x-partition-epoch")
    }
}

fn header_string(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

/// Consumes one queue and keeps everything that arrived, in order.
pub struct Collector {
    pub queue: String,
    ch: Channel,
    consumer: Consumer,
    pub received: Vec<Received>,
}

const SENTINEL: &str = "__test_barrier__";

impl Collector {
    async fn consume(ch: Channel, queue: &str) -> Collector {
        let tag = format!("test-{}", uuid::Uuid::new_v4().simple());
        let consumer = ch
            .basic_consume(queue.into(), tag.as_str().into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default())
            .await
            .unwrap_or_else(|e| panic!("consume {queue}: {e}"));
        Collector { queue: queue.to_owned(), ch, consumer, received: Vec::new() }
    }

    /// Waits for the next message until `deadline`; `false` when the deadline passed.
    pub async fn next_until(&mut self, deadline: Instant) -> bool {
        match tokio::time::timeout_at(deadline, self.consumer.next()).await {
            Err(_) => false,
            Ok(None) => panic!("consumer of {} ended", self.queue),
            Ok(Some(Err(e))) => panic!("consumer of {} failed: {e}", self.queue),
            Ok(Some(Ok(d))) => {
                let headers = d
                    .properties
                    .headers()
                    .as_ref()
                    .map(|h| h.inner().iter().map(|(k, v)| (k.as_str().to_owned(), header_string(v))).collect())
                    .unwrap_or_default();
                let correlation_id = d.properties.correlation_id().as_ref().map(|c| c.as_str().to_owned()).unwrap_or_default();
                let seq = self.received.len();
                self.received.push(Received { correlation_id, headers, body: d.data, seq });
                true
            }
        }
    }

    /// Collects until `done(received)` holds; panics after `within` saying `what` did not happen.
    pub async fn until(&mut self, what: &str, within: Duration, mut done: impl FnMut(&[Received]) -> bool) {
        let deadline = Instant::now() + within;
        while !done(&self.received) {
            if !self.next_until(deadline).await {
                panic!(
                    "timed out after {within:?} waiting for {what} on {} ({} messages received)",
                    self.queue,
                    self.received.len()
                );
            }
        }
    }

    /// Collects whatever arrives during `window` (an observation period, for asserting that
    /// nothing arrives); returns how many messages arrived in it.
    pub async fn collect_for(&mut self, window: Duration) -> usize {
        let before = self.received.len();
        let deadline = Instant::now() + window;
        while self.next_until(deadline).await {}
        self.received.len() - before
    }

    /// Collects until every id in `ids` has at least one message.
    pub async fn until_all(&mut self, ids: &HashSet<String>, within: Duration) {
        let deadline = Instant::now() + within;
        let mut seen: HashSet<String> = self.received.iter().map(|r| r.correlation_id.clone()).filter(|c| ids.contains(c)).collect();
        while seen.len() < ids.len() {
            if !self.next_until(deadline).await {
                let mut missing: Vec<&String> = ids.iter().filter(|i| !seen.contains(*i)).collect();
                missing.sort();
                panic!(
                    "timed out after {within:?}: {} of {} requests got no result on {} (first missing: {:?})",
                    missing.len(),
                    ids.len(),
                    self.queue,
                    &missing[..missing.len().min(10)]
                );
            }
            let last = &self.received[self.received.len() - 1];
            if ids.contains(&last.correlation_id) {
                seen.insert(last.correlation_id.clone());
            }
        }
    }

    /// Number of distinct ids of `ids` that have a message.
    pub fn distinct_of(&self, ids: &HashSet<String>) -> usize {
        self.received.iter().filter(|r| ids.contains(&r.correlation_id)).map(|r| &r.correlation_id).collect::<HashSet<_>>().len()
    }

    /// Messages grouped by correlation id.
    pub fn by_correlation(&self) -> HashMap<String, Vec<&Received>> {
        let mut m: HashMap<String, Vec<&Received>> = HashMap::new();
        for r in &self.received {
            m.entry(r.correlation_id.clone()).or_default().push(r);
        }
        m
    }

    /// Asserts that every request of `reqs` has exactly one message and that it is an `ok`
    /// result; a failed one is reported as "request {id} {failure}: {error}".
    pub fn assert_one_ok_result_each(&self, reqs: &[TestRequest], failure: &str) {
        let by_id = self.by_correlation();
        for r in reqs {
            let got = &by_id[&r.id];
            assert_eq!(got.len(), 1, "request {} got {} results", r.id, got.len());
            let res = got[0].result();
            assert!(res.ok, "request {} {failure}: {:?}", r.id, res.error);
        }
    }

    /// A FIFO barrier: publishes a sentinel to this queue and collects until it arrives, so
    /// everything published to the queue before this call has been received. The sentinel is
    /// not kept.
    pub async fn barrier(&mut self, amqp: &Amqp) {
        let tag = format!("{SENTINEL}{}", uuid::Uuid::new_v4().simple());
        amqp.publish(&self.queue, b"barrier", BasicProperties::default().with_correlation_id(tag.as_str().into())).await;
        self.until("the barrier message", DEADLINE, |r| r.last().is_some_and(|m| m.correlation_id == tag)).await;
        self.received.retain(|m| !m.correlation_id.starts_with(SENTINEL));
    }

    pub async fn close(self) {
        let _ = self.ch.close(200, "done".into()).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Redis.
// ---------------------------------------------------------------------------------------------

/// Reads the daemon's Redis state.
pub struct RedisProbe {
    pub conn: redis::aio::MultiplexedConnection,
}

impl RedisProbe {
    pub async fn connect() -> Result<RedisProbe, redis::RedisError> {
        let client = redis::Client::open(REDIS_URL)?;
        Ok(RedisProbe { conn: client.get_multiplexed_async_connection().await? })
    }

    pub async fn keys(&mut self, pattern: &str) -> Vec<String> {
        let mut keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query_async(&mut self.conn).await.expect("redis KEYS");
        keys.sort();
        keys
    }

    pub async fn get(&mut self, key: &str) -> Option<String> {
        redis::cmd("GET").arg(key).query_async(&mut self.conn).await.expect("redis GET")
    }

    pub async fn set(&mut self, key: &str, value: &str) {
        let _: () = redis::cmd("SET").arg(key).arg(value).query_async(&mut self.conn).await.expect("redis SET");
    }

    pub async fn del(&mut self, key: &str) {
        let _: i64 = redis::cmd("DEL").arg(key).query_async(&mut self.conn).await.expect("redis DEL");
    }

    /// The lease values of partitions `0..partitions` (`{prefix}:lease:{p}`), parsed.
    pub async fn leases(&mut self, prefix: &str, partitions: u32) -> Vec<Option<LeaseValue>> {
        let keys: Vec<String> = (0..partitions).map(|p| format!("{prefix}:lease:{p}")).collect();
        let vals: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(&mut self.conn).await.expect("redis MGET");
        vals.into_iter()
            .map(|v| v.map(|s| LeaseValue::parse(&s).unwrap_or_else(|| panic!("unparseable lease value {s:?}"))))
            .collect()
    }

    /// Polls the leases every 50 ms until `done(leases)` holds; panics after `within`.
    pub async fn wait_leases(
        &mut self,
        prefix: &str,
        partitions: u32,
        what: &str,
        within: Duration,
        mut done: impl FnMut(&[Option<LeaseValue>]) -> bool,
    ) -> Vec<Option<LeaseValue>> {
        let deadline = Instant::now() + within;
        loop {
            let leases = self.leases(prefix, partitions).await;
            if done(&leases) {
                return leases;
            }
            if Instant::now() >= deadline {
                panic!("timed out after {within:?} waiting for {what}; leases: {leases:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until instance `name` holds the lease of every partition.
    pub async fn wait_all_held_by(&mut self, prefix: &str, partitions: u32, name: &str) -> Vec<Option<LeaseValue>> {
        self.wait_leases(prefix, partitions, &format!("{name} to hold every lease"), DEADLINE, |ls| {
            ls.iter().all(|l| l.as_ref().is_some_and(|l| l.name == name))
        })
        .await
    }
}

/// A private redis-server for one test, on a Unix socket in the test's directory (no port to
/// pick), without persistence, with `DEBUG` enabled (`DEBUG SLEEP` pauses it, `DEBUG POPULATE`
/// fills it). Killed when dropped.
pub struct RedisServer {
    child: Child,
    pub socket: PathBuf,
    /// `unix://…` URL for `redis.url`.
    pub url: String,
}

impl RedisServer {
    /// Starts `redis-server` and waits (≤ [`DEADLINE`]) until it answers `PING`.
    pub async fn start(env: &TestEnv, label: &str) -> RedisServer {
        let socket = env.dir.join(format!("{label}.sock"));
        let child = Command::new("redis-server")
            .args(["--port", "0", "--save", "", "--appendonly", "no", "--enable-debug-command", "yes"])
            .arg("--unixsocket")
            .arg(&socket)
            .stdout(File::create(env.dir.join(format!("{label}.log"))).expect("create redis log"))
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed? scripts/services installs it)");
        let url = format!("unix://{}", socket.display());
        let server = RedisServer { child, socket, url };
        let deadline = Instant::now() + DEADLINE;
        while server.ping().await.is_err() {
            assert!(Instant::now() < deadline, "redis-server on {} did not answer PING", server.url);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server
    }

    /// A connection without response timeout (`DEBUG SLEEP` and `DEBUG POPULATE` take seconds).
    pub async fn connect(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        redis::Client::open(self.url.as_str())?.get_multiplexed_async_connection_with_config(&config).await
    }

    async fn ping(&self) -> redis::RedisResult<String> {
        redis::cmd("PING").query_async(&mut self.connect().await?).await
    }

    /// Pauses the server for `secs` seconds (`DEBUG SLEEP` on a connection of its own) in the
    /// background; the returned task ends when the server answers again.
    pub async fn pause(&self, secs: f64) -> JoinHandle<()> {
        let mut c = self.connect().await.expect("connect to the private redis-server");
        tokio::spawn(async move {
            let _: redis::RedisResult<String> = redis::cmd("DEBUG").arg("SLEEP").arg(secs).query_async(&mut c).await;
        })
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// A minimal AMQP 0-9-1 publisher that writes its frames by hand, for messages no client library
/// sends: property values that are not UTF-8. RabbitMQ takes any bytes in a short string (AMQP
/// 0-9-1 §4.2.5.3 gives them no encoding), and lapin's parser refuses such a frame.
pub mod raw_amqp {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Properties of [`publish`], each as the exact bytes to send (at most 255).
    #[derive(Default)]
    pub struct RawProps<'a> {
        pub correlation_id: Option<&'a [u8]>,
        pub reply_to: Option<&'a [u8]>,
        pub message_id: Option<&'a [u8]>,
        /// The `headers` property as an encoded field table (its 4-byte length, then its
        /// entries), sent as is.
        pub headers: Option<&'a [u8]>,
    }

    /// An encoded field table holding one table in one table … `depth` levels deep (7 bytes a
    /// level: a 1-byte name, the type `F`, a 4-byte length), for the `headers` of [`publish`].
    pub fn nested_table(depth: usize) -> Vec<u8> {
        let mut table = 0u32.to_be_bytes().to_vec();
        for _ in 0..depth {
            let mut entry = vec![1u8, b'n', b'F'];
            entry.extend_from_slice(&table);
            table = u32::try_from(entry.len()).unwrap().to_be_bytes().to_vec();
            table.extend_from_slice(&entry);
        }
        table
    }

    fn short(out: &mut Vec<u8>, s: &[u8]) {
        out.push(u8::try_from(s.len()).expect("a short string holds at most 255 bytes"));
        out.extend_from_slice(s);
    }

    async fn send(stream: &mut TcpStream, kind: u8, channel: u16, payload: &[u8]) {
        let mut frame = vec![kind];
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
        frame.extend_from_slice(payload);
        frame.push(0xCE);
        stream.write_all(&frame).await.expect("raw AMQP write");
    }

    async fn send_method(stream: &mut TcpStream, channel: u16, class: u16, method: u16, args: &[u8]) {
        let mut payload = class.to_be_bytes().to_vec();
        payload.extend_from_slice(&method.to_be_bytes());
        payload.extend_from_slice(args);
        send(stream, 1, channel, &payload).await;
    }

    /// Reads frames until method `class`.`method` arrives (heartbeats skipped); returns its
    /// arguments. Panics on a `connection.close` or `channel.close` from the broker.
    async fn expect_method(stream: &mut TcpStream, class: u16, method: u16) -> Vec<u8> {
        loop {
            let mut head = [0u8; 7];
            stream.read_exact(&mut head).await.expect("raw AMQP read");
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let mut payload = vec![0u8; size + 1];
            stream.read_exact(&mut payload).await.expect("raw AMQP read");
            if head[0] != 1 {
                continue;
            }
            let (c, m) = (u16::from_be_bytes([payload[0], payload[1]]), u16::from_be_bytes([payload[2], payload[3]]));
            assert!(!matches!((c, m), (10, 50) | (20, 40)), "the broker closed the raw connection: {}", String::from_utf8_lossy(&payload[4..size]));
            if (c, m) == (class, method) {
                return payload[4..size].to_vec();
            }
        }
    }

    /// Publishes `body` (persistent) to `queue` through the default exchange of the local broker
    /// (`common::AMQP_URL`: guest/guest, vhost `/`) with `props`, and waits for the broker's
    /// confirm.
    pub async fn publish(queue: &str, body: &[u8], props: RawProps<'_>) {
        let mut stream = TcpStream::connect("127.0.0.1:5672").await.expect("connect to RabbitMQ");
        stream.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
        expect_method(&mut stream, 10, 10).await; // connection.start
        let mut start_ok = 0u32.to_be_bytes().to_vec(); // client properties: an empty table
        short(&mut start_ok, b"PLAIN");
        let response = b"\x00guest\x00guest";
        start_ok.extend_from_slice(&u32::try_from(response.len()).unwrap().to_be_bytes());
        start_ok.extend_from_slice(response);
        short(&mut start_ok, b"en_US");
        send_method(&mut stream, 0, 10, 11, &start_ok).await;
        let tune = expect_method(&mut stream, 10, 30).await; // channel-max, frame-max, heartbeat
        let mut tune_ok = tune[..6].to_vec();
        tune_ok.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        send_method(&mut stream, 0, 10, 31, &tune_ok).await;
        let mut open = Vec::new();
        short(&mut open, b"/");
        short(&mut open, b"");
        open.push(0);
        send_method(&mut stream, 0, 10, 40, &open).await;
        expect_method(&mut stream, 10, 41).await;
        send_method(&mut stream, 1, 20, 10, &[0]).await; // channel.open
        expect_method(&mut stream, 20, 11).await;
        send_method(&mut stream, 1, 85, 10, &[0]).await; // confirm.select
        expect_method(&mut stream, 85, 11).await;
        let mut publish = 0u16.to_be_bytes().to_vec();
        short(&mut publish, b"");
        short(&mut publish, queue.as_bytes());
        publish.push(0);
        send_method(&mut stream, 1, 60, 40, &publish).await;
        // Content header: class, weight, body size, property flags (bit 15 = the first
        // property), then the properties present, in their order (AMQP 0-9-1 §4.2.6.1).
        let mut header = 60u16.to_be_bytes().to_vec();
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        let mut flags = 1u16 << 12; // delivery-mode
        let mut list = Vec::new();
        if let Some(h) = props.headers {
            flags |= 1 << 13;
            list.extend_from_slice(h);
        }
        list.push(2);
        for (bit, value) in [(10, props.correlation_id), (9, props.reply_to), (7, props.message_id)] {
            if let Some(v) = value {
                flags |= 1 << bit;
                short(&mut list, v);
            }
        }
        header.extend_from_slice(&flags.to_be_bytes());
        header.extend_from_slice(&list);
        send(&mut stream, 2, 1, &header).await;
        send(&mut stream, 3, 1, body).await;
        expect_method(&mut stream, 60, 80).await; // basic.ack: the broker took it
        let mut close = 200u16.to_be_bytes().to_vec();
        short(&mut close, b"");
        close.extend_from_slice(&[0, 0, 0, 0]);
        send_method(&mut stream, 0, 10, 50, &close).await;
        expect_method(&mut stream, 10, 51).await;
    }
}

/// Views and changes of the broker through `rabbitmqctl` (same host as the tests).
pub mod broker {
    use std::process::Command;

    /// Erlang pid of the broker connection whose client-provided name is `name` (RabbitMQ keeps it
    /// in the `connection_name` client property), from `rabbitmqctl list_connections` (one line per
    /// connection: the pid, a tab, the client properties as an Erlang term).
    pub fn connection_pid(name: &str) -> Option<String> {
        let out = Command::new("rabbitmqctl")
            .args(["list_connections", "pid", "client_properties", "-q", "--no-table-headers"])
            .output()
            .expect("rabbitmqctl runs");
        let quoted = format!("\"{name}\"");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|line| line.contains("connection_name") && line.contains(&quoted))
            .and_then(|line| line.split('\t').next())
            .map(str::to_owned)
    }

    /// The Erlang pid of instance `instance`'s connection `suffix` (`""`, `" publish"`,
    /// `" intake"`: the names the daemon gives its connections); panics when there is none.
    pub fn daemon_connection_pid(instance: &str, suffix: &str) -> String {
        let name = format!("prefix-batcher {instance}{suffix}");
        connection_pid(&name).unwrap_or_else(|| panic!("no broker connection {name:?}"))
    }

    /// Closes a daemon's AMQP connection (found by its client-provided name, waiting up to 30 s
    /// for it to appear) through the broker, as a network failure or an operator would.
    pub async fn close_connection_named(name: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let pid = loop {
            if let Some(pid) = connection_pid(name) {
                break pid;
            }
            assert!(std::time::Instant::now() < deadline, "no broker connection named {name:?}");
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        };
        let status = Command::new("rabbitmqctl").args(["close_connection", &pid, "test: connection failure"]).status().unwrap();
        assert!(status.success(), "rabbitmqctl close_connection {pid} failed");
    }

    /// Runs `rabbitmqctl -q args…`; its stdout, or `None` when it is missing or fails.
    pub fn rabbitmqctl(args: &[&str]) -> Option<String> {
        let out = Command::new("rabbitmqctl").arg("-q").args(args).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// One queue's counts: `(name, messages_ready, messages_unacknowledged)`.
    pub type QueueCounts = (String, u64, u64);

    /// Queues whose name starts with `prefix`, with their ready and unacked message counts.
    pub fn queues(prefix: &str) -> Vec<QueueCounts> {
        let out = rabbitmqctl(&["list_queues", "--no-table-headers", "name", "messages_ready", "messages_unacknowledged"]).unwrap_or_default();
        out.lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let (name, ready, unacked) = (f.next()?, f.next()?.parse().ok()?, f.next()?.parse().ok()?);
                name.starts_with(prefix).then(|| (name.to_owned(), ready, unacked))
            })
            .collect()
    }

    /// `(queues, exchanges)` whose name starts with `prefix` (empty without rabbitmqctl).
    pub fn names_with_prefix(prefix: &str) -> (Vec<String>, Vec<String>) {
        let names = |what: &str| -> Vec<String> {
            let out = rabbitmqctl(&[what, "--no-table-headers", "name"]).unwrap_or_default();
            out.lines().map(str::trim).filter(|n| n.starts_with(prefix)).map(str::to_owned).collect()
        };
        (names("list_queues"), names("list_exchanges"))
    }

    /// Deletes queue `name` (with its messages) through `rabbitmqctl delete_queue`.
    pub fn delete_queue(name: &str) -> bool {
        rabbitmqctl(&["delete_queue", name]).is_some()
    }
}

// ---------------------------------------------------------------------------------------------
// Multi-process clusters (tests/scale.rs).
// ---------------------------------------------------------------------------------------------

/// Helpers of the multi-process scale tests: a [`cluster::Cluster`] of daemon processes (start,
/// SIGTERM, SIGKILL, SIGSTOP/SIGCONT by instance), a [`cluster::PacedPublisher`] that keeps a
/// stream of requests flowing in the background, a [`cluster::ResultLog`] that collects every
/// result from the durable results queue in the background (surviving a RabbitMQ restart), and
/// the ownership log built from the results' `x-partition` / `x-partition-epoch` / `x-instance`
/// headers, with its overlap check.
pub mod cluster {
    use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
    use std::path::PathBuf;
    use std::process::{Command, ExitStatus};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use futures_util::StreamExt;
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions};
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    use prefix_batcher::config::RawConfig;
    use prefix_batcher::lease::LeaseValue;
    use prefix_batcher::request::RequestResult;
    use tokio::task::JoinHandle;
    use tokio::time::Instant;
    use tokio_util::sync::CancellationToken;

    use super::{
        assert_requests_confirmed, bin_command, completions_workload, header_string, write_config, DaemonProcess, RedisProbe, TestEnv, TestRequest, AMQP_URL,
        DEADLINE,
    };

    /// Properties of a request whose result goes to the deployment's durable results queue (no
    /// `reply_to`): it survives a RabbitMQ restart, unlike an exclusive reply queue.
    pub fn request_props_to_results(id: &str) -> BasicProperties {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
        BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_message_id(id.into())
            .with_correlation_id(id.into())
            .with_timestamp(now)
    }

    /// The desired owner name of every partition among `members` (the daemon's own assignment).
    pub fn desired_owners(partitions: u32, members: &[String]) -> Vec<String> {
        prefix_batcher::keying::assignment(partitions, members)
            .into_iter()
            .map(|o| members[o.expect("members is not empty")].clone())
            .collect()
    }

    /// Partitions per lease holder name.
    pub fn held_by(leases: &[Option<LeaseValue>]) -> BTreeMap<String, BTreeSet<u32>> {
        let mut m: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
        for (p, l) in leases.iter().enumerate() {
            if let Some(l) = l {
                m.entry(l.name.clone()).or_default().insert(p as u32);
            }
        }
        m
    }

    /// Lease epoch per partition held by instance `name`.
    pub fn epochs_held_by(leases: &[Option<LeaseValue>], name: &str) -> BTreeMap<u32, u64> {
        leases.iter().enumerate().filter_map(|(p, l)| l.as_ref().filter(|l| l.name == name).map(|l| (p as u32, l.epoch))).collect()
    }

    // -----------------------------------------------------------------------------------------
    // Processes.
    // -----------------------------------------------------------------------------------------

    /// Sends `signal` (e.g. `STOP`, `CONT`, `TERM`) to a process.
    pub fn send_signal(pid: u32, signal: &str) {
        let ok = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().expect("run kill").success();
        assert!(ok, "kill -{signal} {pid} failed");
    }

    /// The daemon processes of one deployment, by instance suffix (instance name =
    /// `env.instance(suffix)`). Each start of an instance is a new process with its own log,
    /// `{suffix}-{n}.log` in the test's directory.
    pub struct Cluster {
        pub base: RawConfig,
        pub procs: BTreeMap<String, DaemonProcess>,
        starts: HashMap<String, usize>,
        /// Instance name per suffix.
        names: BTreeMap<String, String>,
        /// A config file of this deployment (for `prefix-batcher status`).
        pub config: PathBuf,
    }

    impl Cluster {
        pub fn new(env: &TestEnv, base: RawConfig) -> Cluster {
            let config = write_config(env, "status", &base);
            Cluster { base, procs: BTreeMap::new(), starts: HashMap::new(), names: BTreeMap::new(), config }
        }

        /// A deployment of `base` (`base.amqp.partitions` partitions, Redis keys under
        /// `env.key_prefix()`) with the instances `suffixes` started; returns once every
        /// partition's lease is held by its desired owner (≤ [`DEADLINE`]), with the leases and
        /// the time that took.
        pub async fn start_settled(
            env: &TestEnv,
            base: RawConfig,
            suffixes: &[&str],
            redis: &mut RedisProbe,
        ) -> (Cluster, Vec<Option<LeaseValue>>, Duration) {
            let partitions = base.amqp.partitions;
            let mut cluster = Cluster::new(env, base);
            for s in suffixes {
                cluster.start(env, s);
            }
            let (leases, took) = cluster.wait_settled(redis, env.key_prefix(), partitions, DEADLINE).await;
            (cluster, leases, took)
        }

        /// Starts (or restarts) instance `suffix`; its name stays the same across restarts.
        pub fn start(&mut self, env: &TestEnv, suffix: &str) {
            let raw = self.base.clone();
            self.start_with(env, suffix, raw);
        }

        /// [`Cluster::start`] with a configuration of its own (`raw`, its instance name set
        /// here), e.g. another LLM endpoint.
        pub fn start_with(&mut self, env: &TestEnv, suffix: &str, mut raw: RawConfig) {
            let n = self.starts.entry(suffix.to_owned()).or_default();
            *n += 1;
            raw.instance.name = env.instance(suffix);
            self.names.insert(suffix.to_owned(), raw.instance.name.clone());
            let label = format!("{suffix}-{n}");
            let p = DaemonProcess::run(env, &label, &raw);
            if let Some(mut old) = self.procs.insert(suffix.to_owned(), p) {
                assert!(!old.is_running(), "instance {suffix} started twice");
            }
        }

        /// Instance name of `suffix`.
        pub fn name(&self, suffix: &str) -> String {
            self.names.get(suffix).cloned().unwrap_or_else(|| panic!("instance {suffix} was never started"))
        }

        pub fn proc(&mut self, suffix: &str) -> &mut DaemonProcess {
            self.procs.get_mut(suffix).unwrap_or_else(|| panic!("instance {suffix} was never started"))
        }

        pub fn sigterm(&mut self, suffix: &str) {
            self.proc(suffix).sigterm();
        }

        pub fn kill9(&mut self, suffix: &str) {
            self.proc(suffix).kill9();
        }

        pub fn sigstop(&mut self, suffix: &str) {
            let pid = self.proc(suffix).pid();
            send_signal(pid, "STOP");
        }

        pub fn sigcont(&mut self, suffix: &str) {
            let pid = self.proc(suffix).pid();
            send_signal(pid, "CONT");
        }

        pub async fn wait_exit(&mut self, suffix: &str, within: Duration) -> ExitStatus {
            self.proc(suffix).wait_exit(within).await
        }

        /// Suffixes of the processes still running.
        pub fn running(&mut self) -> Vec<String> {
            self.procs.iter_mut().filter_map(|(s, p)| p.is_running().then(|| s.clone())).collect()
        }

        /// Names of the running instances, sorted (the member set the daemons should see).
        pub fn running_names(&mut self) -> Vec<String> {
            let mut v: Vec<String> = self.running().iter().map(|s| self.name(s)).collect();
            v.sort();
            v
        }

        /// Panics (with the log tail) when an instance that should run has exited.
        pub fn assert_running(&mut self, suffixes: &[&str]) {
            for s in suffixes {
                let p = self.proc(s);
                assert!(p.is_running(), "instance {s} exited unexpectedly; its log:\n{}", p.log_tail(40));
            }
        }

        /// SIGTERM to every running instance, then each must exit 0 within `within`.
        pub async fn stop_all(&mut self, within: Duration) {
            let running = self.running();
            for s in &running {
                self.sigterm(s);
            }
            for s in &running {
                let st = self.wait_exit(s, within).await;
                assert_eq!(st.code(), Some(0), "instance {s} must exit 0 after SIGTERM, got {st}; log:\n{}", self.proc(s).log_tail(40));
            }
        }

        /// Waits until every partition's lease is held by its desired owner among the running
        /// instances (polling every `poll`); returns the leases and the time it took. Fails early
        /// when an instance exits.
        pub async fn wait_settled(
            &mut self,
            redis: &mut RedisProbe,
            prefix: &str,
            partitions: u32,
            within: Duration,
        ) -> (Vec<Option<LeaseValue>>, Duration) {
            let members = self.running_names();
            let want = desired_owners(partitions, &members);
            let started = Instant::now();
            loop {
                let leases = redis.leases(prefix, partitions).await;
                if leases.iter().zip(&want).all(|(l, w)| l.as_ref().is_some_and(|l| &l.name == w)) {
                    return (leases, started.elapsed());
                }
                if started.elapsed() >= within {
                    let logs: Vec<String> =
                        self.procs.iter().map(|(s, p)| format!("--- {s}:\n{}", p.log_tail(15))).collect();
                    panic!(
                        "leases not settled on their desired owners within {within:?}\nwant: {want:?}\nhave: {:?}\n{}",
                        leases.iter().map(|l| l.as_ref().map(|l| (l.name.clone(), l.epoch))).collect::<Vec<_>>(),
                        logs.join("\n")
                    );
                }
                let running = self.running().len();
                assert_eq!(running, members.len(), "an instance exited while waiting for the leases to settle");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }

        /// Runs `prefix-batcher --config … status [--json]` and returns its stdout.
        pub async fn status(&self, json: bool) -> String {
            let cfg = self.config.clone();
            tokio::task::spawn_blocking(move || {
                let mut cmd = bin_command();
                cmd.arg("--config").arg(&cfg).arg("status");
                if json {
                    cmd.arg("--json");
                }
                let out = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).output().expect("run status");
                assert!(out.status.success(), "status failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
                String::from_utf8(out.stdout).expect("utf-8 status")
            })
            .await
            .unwrap()
        }
    }

    /// Polls the leases every `poll` until `done(leases)` holds; returns the leases and when it
    /// held. Panics after `within`.
    pub async fn poll_leases(
        redis: &mut RedisProbe,
        prefix: &str,
        partitions: u32,
        what: &str,
        within: Duration,
        poll: Duration,
        mut done: impl FnMut(&[Option<LeaseValue>]) -> bool,
    ) -> (Vec<Option<LeaseValue>>, Instant) {
        let deadline = Instant::now() + within;
        loop {
            let leases = redis.leases(prefix, partitions).await;
            let at = Instant::now();
            if done(&leases) {
                return (leases, at);
            }
            assert!(at < deadline, "timed out after {within:?} waiting for {what}; leases: {leases:?}");
            tokio::time::sleep(poll).await;
        }
    }

    // -----------------------------------------------------------------------------------------
    // Load.
    // -----------------------------------------------------------------------------------------

    /// A completions workload published at a steady rate to the input queue, and the log of the
    /// results queue.
    pub struct Load {
        /// Taken just before the log and the publisher start.
        pub t0: Instant,
        pub log: ResultLog,
        /// Every request of the workload, in publishing order.
        pub reqs: Vec<TestRequest>,
        pub publisher: PacedPublisher,
    }

    impl Load {
        /// Starts a [`ResultLog`] on `env`'s results queue and a [`PacedPublisher`] of `n`
        /// requests spread over `groups` prefixes (ids `{tag}-{i}`) at `per_second` to its input
        /// queue.
        pub fn start(env: &TestEnv, tag: &str, n: usize, groups: usize, per_second: u32) -> Load {
            let t0 = Instant::now();
            let log = ResultLog::start(&env.results_queue());
            let reqs = completions_workload(tag, n, groups);
            let publisher = PacedPublisher::start(env.input_queue(), reqs.clone(), per_second);
            Load { t0, log, reqs, publisher }
        }
    }

    /// Waits for the publisher's last publish, then for a result of every request in `reqs`
    /// (≤ 120 s each).
    pub async fn wait_all_done(publisher: PacedPublisher, log: &ResultLog, reqs: &[TestRequest]) {
        publisher.finish(Duration::from_secs(120)).await;
        log.wait_all(&super::ids(reqs), Duration::from_secs(120)).await;
    }

    /// Publishes requests to a queue at a steady rate in the background (own connection,
    /// publisher confirms per slice of 20 ms, results to the results queue).
    pub struct PacedPublisher {
        published: Arc<AtomicUsize>,
        task: JoinHandle<()>,
        pub total: usize,
    }

    impl PacedPublisher {
        pub fn start(queue: String, reqs: Vec<TestRequest>, per_second: u32) -> PacedPublisher {
            PacedPublisher::start_replying(queue, reqs, per_second, None)
        }

        /// Like [`PacedPublisher::start`], with `reply_to` on every request when given.
        pub fn start_replying(queue: String, reqs: Vec<TestRequest>, per_second: u32, reply_to: Option<String>) -> PacedPublisher {
            PacedPublisher::start_at(AMQP_URL.to_owned(), queue, reqs, per_second, reply_to)
        }

        /// Like [`PacedPublisher::start_replying`], on the broker at `url` (e.g. one node of a
        /// cluster).
        pub fn start_at(url: String, queue: String, reqs: Vec<TestRequest>, per_second: u32, reply_to: Option<String>) -> PacedPublisher {
            let published = Arc::new(AtomicUsize::new(0));
            let total = reqs.len();
            let counter = published.clone();
            let task = tokio::spawn(async move {
                let conn = Connection::connect(&url, ConnectionProperties::default()).await.expect("publisher connects");
                let ch = conn.create_channel().await.expect("channel");
                ch.confirm_select(ConfirmSelectOptions::default()).await.expect("confirm.select");
                let slice = Duration::from_millis(20);
                let started = Instant::now();
                let mut next = 0usize;
                let mut tick = tokio::time::interval(slice);
                while next < reqs.len() {
                    tick.tick().await;
                    // Catch up to the schedule (a slow confirm does not lower the rate).
                    let due = (started.elapsed().as_secs_f64() * f64::from(per_second)) as usize + 1;
                    let until = due.min(reqs.len()).max(next);
                    let mut confirms = Vec::new();
                    for r in &reqs[next..until] {
                        let c = ch
                            .basic_publish(
                                "".into(),
                                queue.as_str().into(),
                                BasicPublishOptions { mandatory: true, ..Default::default() },
                                &r.body,
                                match &reply_to {
                                    Some(q) => request_props_to_results(&r.id).with_reply_to(q.as_str().into()),
                                    None => request_props_to_results(&r.id),
                                },
                            )
                            .await
                            .expect("publish request");
                        confirms.push(c);
                    }
                    assert_requests_confirmed(confirms, &queue).await;
                    next = until;
                    counter.store(next, Ordering::SeqCst);
                }
                let _ = conn.close(200, "published".into()).await;
            });
            PacedPublisher { published, task, total }
        }

        /// Requests published and confirmed so far.
        pub fn published(&self) -> usize {
            self.published.load(Ordering::SeqCst)
        }

        /// Waits until at least `n` requests are published.
        pub async fn wait_published(&self, n: usize, within: Duration) {
            let deadline = Instant::now() + within;
            while self.published() < n {
                assert!(!self.task.is_finished() || self.published() >= n, "the publisher stopped at {}", self.published());
                assert!(Instant::now() < deadline, "only {} of {n} requests published within {within:?}", self.published());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }

        /// Waits for the last publish.
        pub async fn finish(self, within: Duration) {
            tokio::time::timeout(within, self.task).await.expect("publisher finished in time").expect("publisher did not panic");
        }
    }

    // -----------------------------------------------------------------------------------------
    // Results.
    // -----------------------------------------------------------------------------------------

    /// One result as received by the test.
    #[derive(Debug, Clone)]
    pub struct Observed {
        /// Request id (the correlation id).
        pub id: String,
        pub partition: u32,
        /// `x-partition-epoch`.
        pub epoch: u64,
        /// `x-instance`.
        pub instance: String,
        pub batch_id: String,
        pub ok: bool,
        /// Arrival at the test (monotonic).
        pub at: Instant,
        /// Order of arrival among distinct results (0-based). Results reach the single results
        /// queue in the order the broker confirmed them, so this order respects causality: a
        /// result an owner confirmed before releasing its lease comes before any result of the
        /// next owner.
        pub seq: usize,
    }

    #[derive(Default)]
    struct LogShared {
        results: Vec<Observed>,
        /// `(request id, batch id)` of every result kept: a redelivery to the test (after a
        /// reconnect) repeats both; a duplicate from the daemons has another batch id.
        keys: HashSet<(String, String)>,
        barriers: HashSet<String>,
        sessions: usize,
    }

    const BARRIER: &str = "__scale_barrier__";

    /// Collects every result from a durable queue in the background, acking each after
    /// recording it, and reconnecting (every 200 ms) when the connection fails.
    pub struct ResultLog {
        pub queue: String,
        /// The broker it consumes from.
        pub url: String,
        shared: Arc<Mutex<LogShared>>,
        stop: CancellationToken,
        task: JoinHandle<()>,
    }

    impl ResultLog {
        pub fn start(queue: &str) -> ResultLog {
            ResultLog::start_at(AMQP_URL, queue)
        }

        /// Like [`ResultLog::start`], on the broker at `url` (e.g. one node of a cluster).
        pub fn start_at(url: &str, queue: &str) -> ResultLog {
            let shared = Arc::new(Mutex::new(LogShared::default()));
            let stop = CancellationToken::new();
            let task = tokio::spawn(collect(url.to_owned(), queue.to_owned(), shared.clone(), stop.clone()));
            ResultLog { queue: queue.to_owned(), url: url.to_owned(), shared, stop, task }
        }

        pub fn snapshot(&self) -> Vec<Observed> {
            self.shared.lock().unwrap().results.clone()
        }

        pub fn len(&self) -> usize {
            self.shared.lock().unwrap().results.len()
        }

        /// Connections the log had to open (1 without broker trouble).
        pub fn sessions(&self) -> usize {
            self.shared.lock().unwrap().sessions
        }

        /// Distinct request ids with a result.
        pub fn distinct(&self) -> HashSet<String> {
            self.shared.lock().unwrap().results.iter().map(|o| o.id.clone()).collect()
        }

        /// Waits until at least `n` results arrived.
        pub async fn wait_len(&self, n: usize, within: Duration) {
            let deadline = Instant::now() + within;
            while self.len() < n {
                assert!(Instant::now() < deadline, "only {} of {n} results within {within:?}", self.len());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }

        /// Waits until every id in `ids` has a result.
        pub async fn wait_all(&self, ids: &HashSet<String>, within: Duration) {
            let deadline = Instant::now() + within;
            loop {
                let have = self.distinct();
                let missing: Vec<&String> = ids.iter().filter(|i| !have.contains(*i)).collect();
                if missing.is_empty() {
                    return;
                }
                if Instant::now() >= deadline {
                    // Where the missing requests are: still queued (the daemons stalled) or in
                    // the results queue (this log stalled).
                    let prefix = self.queue.rsplit_once('.').map_or(self.queue.as_str(), |(p, _)| p);
                    panic!(
                        "{} of {} requests have no result after {within:?} (e.g. {:?}); {} connections of this log; \
                         queues (name, ready, unacked): {:?}",
                        missing.len(),
                        ids.len(),
                        &missing[..missing.len().min(10)],
                        self.sessions(),
                        super::broker::queues(prefix)
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }

        /// FIFO barrier: publishes a marker to the queue and waits until it comes back, so every
        /// result enqueued before this call has been collected.
        pub async fn barrier(&self) {
            let tag = format!("{BARRIER}{}", uuid::Uuid::new_v4().simple());
            let conn = Connection::connect(&self.url, ConnectionProperties::default()).await.expect("connect");
            let ch = conn.create_channel().await.expect("channel");
            ch.confirm_select(ConfirmSelectOptions::default()).await.expect("confirm.select");
            ch.basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions { mandatory: true, ..Default::default() },
                b"barrier",
                BasicProperties::default().with_correlation_id(tag.as_str().into()),
            )
            .await
            .expect("publish barrier")
            .await
            .expect("barrier confirm");
            let _ = conn.close(200, "barrier".into()).await;
            let deadline = Instant::now() + super::DEADLINE;
            while !self.shared.lock().unwrap().barriers.contains(&tag) {
                assert!(Instant::now() < deadline, "the barrier did not come back from {}", self.queue);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }

        /// Stops every running instance of `cluster` (each must exit 0 within [`DEADLINE`]), waits
        /// on a [`barrier`](Self::barrier) so every result they published is collected, then
        /// stops collecting and returns every result.
        pub async fn stop_after(self, cluster: &mut Cluster) -> Vec<Observed> {
            cluster.stop_all(DEADLINE).await;
            self.barrier().await;
            self.stop().await
        }

        /// Stops collecting and returns every result.
        pub async fn stop(self) -> Vec<Observed> {
            self.stop.cancel();
            let _ = self.task.await;
            let g = self.shared.lock().unwrap();
            g.results.clone()
        }
    }

    async fn collect(url: String, queue: String, shared: Arc<Mutex<LogShared>>, stop: CancellationToken) {
        while !stop.is_cancelled() {
            let session = async {
                let conn = Connection::connect(&url, ConnectionProperties::default()).await.ok()?;
                let ch = conn.create_channel().await.ok()?;
                ch.basic_qos(500, BasicQosOptions::default()).await.ok()?;
                let tag = format!("scale-log-{}", uuid::Uuid::new_v4().simple());
                let consumer =
                    ch.basic_consume(queue.as_str().into(), tag.as_str().into(), BasicConsumeOptions::default(), FieldTable::default()).await.ok()?;
                Some((conn, consumer))
            };
            // A broker that accepts the socket but never answers (it is still booting) must not
            // hold the log forever: the attempt is given up and made again.
            let session = tokio::time::timeout(Duration::from_secs(10), session).await.ok().flatten();
            let Some((conn, mut consumer)) = session else {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => continue,
                }
            };
            shared.lock().unwrap().sessions += 1;
            // A consumer's stream is not relied on to end when its connection is reset: the
            // connection's state is checked as well (once, across a broker restart, this log
            // never opened another connection, and 1,395 results were never collected).
            let mut check = tokio::time::interval(Duration::from_millis(200));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => {
                        let _ = conn.close(200, "done".into()).await;
                        return;
                    }
                    _ = check.tick() => if !conn.status().connected() {
                        break;
                    },
                    next = consumer.next() => match next {
                        Some(Ok(d)) => {
                            record(&shared, &d);
                            let _ = d.acker.ack(BasicAckOptions::default()).await;
                        }
                        _ => break,
                    },
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    fn record(shared: &Mutex<LogShared>, d: &lapin::message::Delivery) {
        let at = Instant::now();
        let correlation = d.properties.correlation_id().as_ref().map(|c| c.as_str().to_owned()).unwrap_or_default();
        let mut g = shared.lock().unwrap();
        if correlation.starts_with(BARRIER) {
            g.barriers.insert(correlation);
            return;
        }
        let headers: HashMap<String, String> = d
            .properties
            .headers()
            .as_ref()
            .map(|h| h.inner().iter().map(|(k, v)| (k.as_str().to_owned(), header_string(v))).collect())
            .unwrap_or_default();
        let r: RequestResult = serde_json::from_slice(&d.data)
            .unwrap_or_else(|e| panic!("not a result ({e}): {}", String::from_utf8_lossy(&d.data)));
        if !g.keys.insert((r.id.clone(), r.batch_id.clone())) {
            return; // redelivered to the test after a reconnect: already recorded
        }
        let epoch = headers
            .get("x-partition-epoch")
            .and_then(|e| e.parse().ok())
            .unwrap_or_else(|| panic!("result {} has no numeric x-partition-epoch: {headers:?}", r.id));
        assert_eq!(headers.get("x-partition").map(String::as_str), Some(r.partition.to_string().as_str()), "x-partition of {}", r.id);
        let instance = headers.get("x-instance").cloned().unwrap_or_else(|| panic!("result {} has no x-instance header", r.id));
        let seq = g.results.len();
        g.results.push(Observed { id: r.id, partition: r.partition, epoch, instance, batch_id: r.batch_id, ok: r.ok, at, seq });
    }

    // -----------------------------------------------------------------------------------------
    // Analysis.
    // -----------------------------------------------------------------------------------------

    /// One tenure of the ownership log: partition `partition` under lease epoch `epoch`.
    #[derive(Debug, Clone)]
    pub struct Tenure {
        pub partition: u32,
        pub epoch: u64,
        /// Instances that published under this epoch (exactly one, or the lease was broken).
        pub instances: BTreeSet<String>,
        pub first_seq: usize,
        pub last_seq: usize,
        pub first_at: Instant,
        pub last_at: Instant,
        pub results: usize,
    }

    /// The ownership log: one [`Tenure`] per (partition, epoch), sorted by partition, then epoch.
    pub fn ownership_log(results: &[Observed]) -> Vec<Tenure> {
        let mut m: BTreeMap<(u32, u64), Tenure> = BTreeMap::new();
        for o in results {
            let t = m.entry((o.partition, o.epoch)).or_insert_with(|| Tenure {
                partition: o.partition,
                epoch: o.epoch,
                instances: BTreeSet::new(),
                first_seq: o.seq,
                last_seq: o.seq,
                first_at: o.at,
                last_at: o.at,
                results: 0,
            });
            t.instances.insert(o.instance.clone());
            t.first_seq = t.first_seq.min(o.seq);
            t.last_seq = t.last_seq.max(o.seq);
            t.first_at = t.first_at.min(o.at);
            t.last_at = t.last_at.max(o.at);
            t.results += 1;
        }
        m.into_values().collect()
    }

    /// Overlaps in the ownership log: two tenures of one partition with different epochs where
    /// the older epoch published after the newer one's first result (their intervals in arrival
    /// order intersect, or the older one comes entirely after the newer one).
    pub fn ownership_overlaps(log: &[Tenure]) -> Vec<(Tenure, Tenure)> {
        let mut out = Vec::new();
        for (i, a) in log.iter().enumerate() {
            for b in &log[i + 1..] {
                if b.partition != a.partition {
                    break;
                }
                // a.epoch < b.epoch (sorted).
                if a.last_seq > b.first_seq {
                    out.push((a.clone(), b.clone()));
                }
            }
        }
        out
    }

    /// The log as text, times in seconds since `t0`.
    pub fn render_ownership_log(log: &[Tenure], t0: Instant) -> String {
        let secs = |t: Instant| t.saturating_duration_since(t0).as_secs_f64();
        let mut out = format!("{:>9} {:>14} {:<34} {:>9} {:>9} {:>7}\n", "partition", "epoch", "instance", "first_s", "last_s", "results");
        for t in log {
            let inst: Vec<&str> = t.instances.iter().map(String::as_str).collect();
            out.push_str(&format!(
                "{:>9} {:>14} {:<34} {:>9.3} {:>9.3} {:>7}\n",
                t.partition,
                t.epoch,
                inst.join(","),
                secs(t.first_at),
                secs(t.last_at),
                t.results
            ));
        }
        out
    }

    /// Results per request id: lost ids, failed results, and requests with more than one.
    pub struct Tally {
        pub requests: usize,
        pub results: usize,
        pub lost: Vec<String>,
        pub failed: usize,
        /// Requests with more than one result, with all their results in arrival order.
        pub duplicated: Vec<(String, Vec<Observed>)>,
    }

    impl Tally {
        /// Extra results (beyond one per request).
        pub fn duplicates(&self) -> usize {
            self.duplicated.iter().map(|(_, v)| v.len() - 1).sum()
        }
    }

    pub fn tally(reqs: &[TestRequest], results: &[Observed]) -> Tally {
        let mut by: HashMap<&str, Vec<Observed>> = HashMap::new();
        for o in results {
            by.entry(o.id.as_str()).or_default().push(o.clone());
        }
        let mut lost = Vec::new();
        let mut duplicated = Vec::new();
        for r in reqs {
            match by.get(r.id.as_str()) {
                None => lost.push(r.id.clone()),
                Some(v) if v.len() > 1 => duplicated.push((r.id.clone(), v.clone())),
                _ => {}
            }
        }
        Tally { requests: reqs.len(), results: results.len(), lost, failed: results.iter().filter(|o| !o.ok).count(), duplicated }
    }
}
