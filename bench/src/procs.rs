//! Processes the benchmarks run: daemon instances, LLM simulators (`llm-fakes simulate`), real
//! llama-servers (through `scripts/llm-server`), the pass-through consumer; plus /proc readings
//! and cleanup of a run's queues and Redis keys.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Paths and names shared by every run of one benchmark invocation.
#[derive(Debug, Clone)]
pub struct Env {
    pub root: PathBuf,
    pub daemon_bin: PathBuf,
    /// The `llm-fakes` binary (its `simulate` subcommand is the LLM simulator).
    pub fakes_bin: PathBuf,
    pub bench_bin: PathBuf,
    /// Logs and temp files of this invocation.
    pub work: PathBuf,
    /// Unique per invocation: `pbb-{pid}-{random}`.
    pub tag: String,
}

impl Env {
    /// A unique name for one run: used as prefix of every queue and exchange and as Redis key prefix.
    pub fn run_name(&self, what: &str) -> String {
        format!("{}-{what}-{:04x}", self.tag, fastrand::u16(..))
    }
}

/// A child process that is stopped (SIGTERM, then SIGKILL) when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process as one a drive watches, with the log it writes.
    pub fn watched(&self, log: &Path) -> Watched {
        Watched::new(&format!("{} (pid {})", self.name, self.pid()), self.pid(), log)
    }

    /// SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit code when it exited by itself.
    pub fn stop(&mut self, grace: Duration) -> Option<i32> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return st.code();
        }
        // SAFETY: kill(2) on the pid of our own child, which has not been reaped yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("bench: {} ignored SIGTERM for {grace:?}; killing it", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

/// CPU seconds and peak RSS (kB) of a process, from /proc. CPU is the sum of its threads'
/// on-CPU nanoseconds (`/proc/PID/task/TID/schedstat`, first field; proc(5)), which has the
/// scheduler's precision, unlike utime + stime in `/proc/PID/stat` (10 ms ticks: ±3 % of a
/// 4,000-request burst). The process's threads live as long as it does (tokio workers, lapin's I/O
/// threads), so no exited thread's time is lost; without schedstat, utime + stime.
pub fn proc_usage(pid: u32) -> Option<(f64, u64)> {
    let cpu = match thread_cpu_ns(pid) {
        Some(ns) => ns as f64 / 1e9,
        None => {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
            let rest = &stat[stat.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks = 100.0; // sysconf(_SC_CLK_TCK) is 100 on Linux
            (f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / ticks
        }
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())?;
    Some((cpu, hwm))
}

/// Sum of the on-CPU nanoseconds of a process's threads, from their `schedstat`.
fn thread_cpu_ns(pid: u32) -> Option<u64> {
    let mut total = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let s = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += s.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Spawns `cmd`, reads the first stdout line (a URL) within `timeout`.
fn spawn_with_url(name: &str, cmd: Command, log: &Path, timeout: Duration) -> anyhow::Result<(Proc, String)> {
    spawn_until_line(name, cmd, log, timeout, "http://")
}

/// Spawns `cmd` and waits for its first stdout line, which must start with `expect`.
pub fn spawn_until_line(name: &str, mut cmd: Command, log: &Path, timeout: Duration, expect: &str) -> anyhow::Result<(Proc, String)> {
    let log_file = std::fs::File::create(log)?;
    cmd.stdout(Stdio::piped()).stderr(log_file).stdin(Stdio::null());
    let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line.trim().to_owned());
    });
    let proc = Proc { name: name.to_owned(), child };
    match rx.recv_timeout(timeout) {
        Ok(url) if url.starts_with(expect) => Ok((proc, url)),
        other => bail!("{name} did not print its URL ({other:?}); see {}", log.display()),
    }
}

/// LLM simulator options (see `llm_fakes::simulator`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SimOpts {
    pub chars_per_token: usize,
    pub capacity_blocks: usize,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
    pub max_concurrency: usize,
    pub speedup: f64,
}

pub fn start_simulator(env: &Env, name: &str, o: &SimOpts) -> anyhow::Result<(Proc, String)> {
    let mut cmd = Command::new(&env.fakes_bin);
    cmd.arg("simulate")
        .args(["--chars-per-token", &o.chars_per_token.to_string()])
        .args(["--capacity-blocks", &o.capacity_blocks.to_string()])
        .args(["--prefill-ms-per-token", &o.prefill_ms_per_token.to_string()])
        .args(["--decode-ms-per-token", &o.decode_ms_per_token.to_string()])
        .args(["--max-concurrency", &o.max_concurrency.to_string()])
        .args(["--speedup", &o.speedup.to_string()]);
    spawn_with_url(name, cmd, &env.work.join(format!("{name}.log")), Duration::from_secs(20))
}

/// The llama-server binary and the model file `scripts/llm-server` serves (its `path` command,
/// which installs both on first use; its progress goes to stderr).
pub fn llama_paths(root: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let out = Command::new(root.join("scripts/llm-server"))
        .arg("path")
        .stderr(Stdio::inherit())
        .output()
        .context("running scripts/llm-server path")?;
    anyhow::ensure!(out.status.success(), "scripts/llm-server path failed (it installs llama-server and the model): see its messages above");
    let s = String::from_utf8_lossy(&out.stdout);
    let mut l = s.lines().map(str::trim);
    match (l.next(), l.next()) {
        (Some(bin), Some(model)) if !bin.is_empty() && !model.is_empty() => Ok((PathBuf::from(bin), PathBuf::from(model))),
        _ => bail!("scripts/llm-server path printed {s:?}, not the server binary and the model (two lines)"),
    }
}

/// A model's name for the report, from its file: `SmolLM2-135M-Instruct.Q4_1.gguf` →
/// `SmolLM2-135M-Instruct Q4_1`.
pub fn model_name(model: &Path) -> String {
    let file = model.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = file.strip_suffix(".gguf").unwrap_or(&file);
    match stem.rsplit_once('.') {
        Some((name, quant)) => format!("{name} {quant}"),
        None => stem.to_owned(),
    }
}

/// A real llama-server through `scripts/llm-server` (fresh: stopped first if running).
pub struct LlamaServer {
    root: PathBuf,
    pub name: String,
    pub url: String,
    /// The server's pid (`scripts/llm-server` starts it in its own session and writes
    /// `.cache/llm/NAME.pid`; it is not this process's child, so it is watched through /proc).
    pub pid: u32,
}

impl LlamaServer {
    pub fn start(env: &Env, name: &str, extra: &[&str]) -> anyhow::Result<Self> {
        let script = env.root.join("scripts/llm-server");
        let _ = Command::new(&script).args(["stop", "--name", name]).stderr(Stdio::null()).status();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(env.work.join("llm-server.log"))?;
        let out = Command::new(&script)
            .args(["start", "--name", name, "--"])
            .args(extra)
            .stderr(log)
            .output()
            .context("running scripts/llm-server")?;
        if !out.status.success() {
            bail!("scripts/llm-server start --name {name} failed");
        }
        let url = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let pid_file = env.root.join(format!(".cache/llm/{name}.pid"));
        let pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("scripts/llm-server started {name} at {url} but {} holds no pid", pid_file.display()))?;
        Ok(LlamaServer { root: env.root.clone(), name: name.to_owned(), url, pid })
    }

    /// The server as a process a drive watches (its log is `.cache/llm/NAME.log`).
    pub fn watched(&self) -> Watched {
        Watched::new(&format!("llama-server {} ({}, pid {})", self.name, self.url, self.pid), self.pid, &self.root.join(format!(".cache/llm/{}.log", self.name)))
    }
}

/// An error that another attempt would not cure: a process the run depends on is gone, or results
/// stopped arriving. [`crate::parts::attempt`] does not retry it; the invocation stops.
#[derive(Debug)]
pub struct Fatal(pub String);

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Fatal {}

/// Whether `e` or one of its causes is [`Fatal`].
pub fn is_fatal(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<Fatal>())
}

/// A process a run depends on, known by pid and start time (so that a reused pid is not taken
/// for it), with the log to look at when it is gone.
#[derive(Debug, Clone)]
pub struct Watched {
    /// Names it in errors, e.g. `llama-server NAME (URL, pid N)`.
    pub what: String,
    pub pid: u32,
    /// Field 22 of /proc/PID/stat (clock ticks after boot); `None` when it was already gone.
    started: Option<u64>,
    pub log: PathBuf,
}

/// (state, start time) from /proc/PID/stat (fields 3 and 22; proc(5)).
fn stat_state(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: split after it.
    let rest: Vec<&str> = stat[stat.rfind(')')? + 2..].split_whitespace().collect();
    Some((rest.first()?.chars().next()?, rest.get(19)?.parse().ok()?))
}

impl Watched {
    pub fn new(what: &str, pid: u32, log: &Path) -> Watched {
        Watched { what: what.to_owned(), pid, started: stat_state(pid).map(|(_, t)| t), log: log.to_path_buf() }
    }

    /// True while the process runs: /proc/PID exists with the same start time and is not a
    /// zombie (a child of this process that died stays a zombie until it is reaped).
    pub fn alive(&self) -> bool {
        match stat_state(self.pid) {
            Some((state, started)) => Some(started) == self.started && state != 'Z' && state != 'X',
            None => false,
        }
    }
}

/// `e` unchanged when every process of `watch` runs; otherwise a [`Fatal`] error that names the
/// first one that is gone (the likely cause of `e`, which stays in the message).
pub fn blame(e: anyhow::Error, watch: &[Watched]) -> anyhow::Error {
    match watch.iter().find(|w| !w.alive()) {
        Some(w) => anyhow::Error::new(Fatal(format!("{} is gone (killed or crashed; its log: {}); the error was: {e:#}", w.what, w.log.display()))),
        None => e,
    }
}

impl LlamaServer {
    /// Stops several servers in parallel.
    pub fn stop_all(servers: Vec<LlamaServer>) {
        let stops: Vec<_> = servers
            .iter()
            .filter_map(|s| {
                Command::new(s.root.join("scripts/llm-server")).args(["stop", "--name", &s.name]).stderr(Stdio::null()).spawn().ok()
            })
            .collect();
        for mut c in stops {
            let _ = c.wait();
        }
        drop(servers);
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = Command::new(self.root.join("scripts/llm-server"))
            .args(["stop", "--name", &self.name])
            .stderr(Stdio::null())
            .status();
    }
}

/// How a benchmark daemon keys requests (`keying.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keying {
    /// The default: adaptive key levels, with the default `prefix_chars` and `max_shards`.
    Adaptive,
    /// The static comparison: `keying.mode = "prefix"` with this key length and shard count.
    Static { prefix_chars: usize, shards: u32 },
    /// `keying.mode = "off"`: random partitions, mixed batches.
    Off,
}

/// One daemon instance's settings (environment overrides; everything else is the default).
#[derive(Debug, Clone)]
pub struct DaemonOpts {
    pub run: String,
    pub instance: String,
    pub partitions: u32,
    pub keying: Keying,
    pub max_batch_size: usize,
    pub max_batch_wait: String,
    pub endpoint: String,
    pub llm_max_concurrency: usize,
    pub extra: Vec<(String, String)>,
}

pub struct Daemon {
    pub proc: Proc,
    pub metrics_url: String,
    /// Its stderr (the daemon logs there).
    pub log: PathBuf,
}

impl Daemon {
    /// The daemon as a process a drive watches.
    pub fn watched(&self) -> Watched {
        self.proc.watched(&self.log)
    }
}

/// Sends SIGTERM to every daemon at once, then waits up to 3 s for each and kills what is left:
/// the quick stop after a failed drive (their queues are deleted afterwards, so nothing they
/// leave unacknowledged matters).
pub fn abort_daemons(daemons: Vec<Daemon>) {
    for d in &daemons {
        // SAFETY: kill(2) on our own, not yet reaped, child.
        unsafe { libc::kill(d.proc.pid() as i32, libc::SIGTERM) };
    }
    for mut d in daemons {
        d.proc.stop(Duration::from_secs(3));
    }
}

pub fn start_daemon(env: &Env, o: &DaemonOpts) -> anyhow::Result<Daemon> {
    start_daemon_bin(env, o, &env.daemon_bin)
}

/// [`start_daemon`] with another build of the daemon (`bin`).
pub fn start_daemon_bin(env: &Env, o: &DaemonOpts, bin: &std::path::Path) -> anyhow::Result<Daemon> {
    let port = free_port()?;
    let empty = env.work.join("empty.toml");
    if !empty.exists() {
        std::fs::write(&empty, "")?;
    }
    let log_path = env.work.join(format!("{}-{}.log", o.run, o.instance));
    let log = std::fs::File::create(&log_path)?;
    let r = &o.run;
    let mut cmd = Command::new(bin);
    cmd.arg("--config").arg(&empty).arg("run");
    let mut vars: Vec<(String, String)> = vec![
        ("INSTANCE__NAME".into(), o.instance.clone()),
        ("AMQP__INPUT_QUEUE".into(), format!("{r}.input")),
        ("AMQP__SHARD_EXCHANGE".into(), format!("{r}.shards")),
        ("AMQP__PARTITION_QUEUE_PREFIX".into(), format!("{r}.partition")),
        ("AMQP__RESULTS_QUEUE".into(), format!("{r}.results")),
        ("AMQP__DEAD_LETTER_EXCHANGE".into(), format!("{r}.dlx")),
        ("AMQP__DEAD_LETTER_QUEUE".into(), format!("{r}.dead-letter")),
        ("AMQP__PARTITIONS".into(), o.partitions.to_string()),
        ("AMQP__BACKLOG_POLL_INTERVAL".into(), "1s".into()),
        ("REDIS__KEY_PREFIX".into(), r.clone()),
        ("BATCHING__MAX_BATCH_SIZE".into(), o.max_batch_size.to_string()),
        ("BATCHING__MAX_BATCH_WAIT".into(), o.max_batch_wait.clone()),
        ("LLM__ENDPOINTS".into(), o.endpoint.clone()),
        ("LLM__MAX_CONCURRENCY".into(), o.llm_max_concurrency.to_string()),
        ("OWNERSHIP__SETTLE_TIME".into(), "500ms".into()),
        ("HTTP__LISTEN".into(), format!("127.0.0.1:{port}")),
        // Split and merge decisions are logged at info.
        ("LOG__LEVEL".into(), "warn,prefix_batcher::splits=info".into()),
    ];
    match o.keying {
        Keying::Adaptive => vars.push(("KEYING__MODE".into(), "adaptive".into())),
        Keying::Static { prefix_chars, shards } => vars.extend([
            ("KEYING__MODE".into(), "prefix".into()),
            ("KEYING__PREFIX_CHARS".into(), prefix_chars.to_string()),
            ("SHARDING__DEFAULT_SHARDS".into(), shards.to_string()),
        ]),
        Keying::Off => vars.push(("KEYING__MODE".into(), "off".into())),
    }
    for (k, v) in vars.iter().chain(o.extra.iter()) {
        cmd.env(format!("PREFIX_BATCHER__{k}"), v);
    }
    cmd.stdout(Stdio::null()).stderr(log).stdin(Stdio::null());
    let child = cmd.spawn().context("starting the daemon")?;
    Ok(Daemon { proc: Proc { name: format!("daemon {}", o.instance), child }, metrics_url: format!("http://127.0.0.1:{port}"), log: log_path })
}

/// Sums every series of `metric` (exact name, with or without labels) in a Prometheus text page.
pub fn metric_sum(page: &str, metric: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            let base = name.split('{').next()?;
            (base == metric).then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// The value of one exact series (`name{labels}` as the page prints it), summed over `pages`.
pub fn series_sum(pages: &[String], series: &str) -> f64 {
    pages
        .iter()
        .flat_map(|p| p.lines())
        .filter_map(|l| l.rsplit_once(' ').filter(|(name, _)| *name == series).and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// Split decisions (split, spread, merge: each made by one instance) and the most decision
/// changes any one instance saw (`key_moves_total`), from the daemons' metric pages.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct SplitCounts {
    pub splits: u64,
    pub spreads: u64,
    pub merges: u64,
    pub moves: u64,
}

impl SplitCounts {
    pub fn of(pages: &[String]) -> SplitCounts {
        let d = |k: &str| series_sum(pages, &format!("prefix_batcher_key_split_decisions_total{{decision=\"{k}\"}}")) as u64;
        let moves = pages.iter().map(|p| metric_sum(p, "prefix_batcher_key_moves_total") as u64).max().unwrap_or(0);
        SplitCounts { splits: d("split"), spreads: d("spread"), merges: d("merge"), moves }
    }
}

pub async fn scrape(http: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    Ok(http.get(format!("{base}/metrics")).send().await?.error_for_status()?.text().await?)
}

/// Waits until every daemon answers /readyz and together they own all partitions.
pub async fn wait_ready(http: &reqwest::Client, daemons: &mut [Daemon], partitions: u32, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut owned = 0.0;
        let mut ready = 0;
        for d in daemons.iter_mut() {
            if let Ok(Some(st)) = d.proc.child.try_wait() {
                bail!("{} exited with {st} while starting", d.proc.name);
            }
            if http.get(format!("{}/readyz", d.metrics_url)).send().await.map(|r| r.status().is_success()).unwrap_or(false) {
                ready += 1;
                if let Ok(page) = scrape(http, &d.metrics_url).await {
                    owned += metric_sum(&page, "prefix_batcher_partitions_owned");
                }
            }
        }
        // Every instance must own at least one partition (when there are enough), so none is idle.
        let min_each = daemons.len() <= partitions as usize;
        let mut each_ok = true;
        if min_each {
            for d in daemons.iter() {
                let o = match scrape(http, &d.metrics_url).await {
                    Ok(p) => metric_sum(&p, "prefix_batcher_partitions_owned"),
                    Err(_) => 0.0,
                };
                each_ok &= o >= 1.0;
            }
        }
        if ready == daemons.len() && owned as u32 == partitions && each_ok {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("daemons not ready in {timeout:?}: {ready}/{} ready, {owned}/{partitions} partitions owned", daemons.len());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Deletes a run's queues and exchanges, and its Redis keys.
pub async fn cleanup(run: &str, partitions: u32, extra_queues: &[String]) {
    let mut queues = vec![format!("{run}.input"), format!("{run}.results"), format!("{run}.dead-letter")];
    queues.extend((0..=partitions).map(|p| format!("{run}.partition.{p:03}")));
    queues.extend(extra_queues.iter().cloned());
    let exchanges = [format!("{run}.shards"), format!("{run}.dlx"), format!("{run}.pt")];
    delete_amqp(&queues, &exchanges).await;
    delete_redis_keys(&format!("{run}:*"));
}

/// Deletes queues and exchanges (best effort: a missing one is no error; a failed delete closes
/// its channel, so the next one opens a new channel).
async fn delete_amqp(queues: &[String], exchanges: &[String]) {
    let Ok(conn) = Connection::connect(AMQP_URL, ConnectionProperties::default()).await else { return };
    let mut ch = None;
    for (name, is_queue) in queues.iter().map(|q| (q, true)).chain(exchanges.iter().map(|x| (x, false))) {
        if ch.is_none() {
            ch = conn.create_channel().await.ok();
        }
        let Some(c) = &ch else { continue };
        let deleted = if is_queue {
            c.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await.map(drop)
        } else {
            c.exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default()).await
        };
        if deleted.is_err() {
            ch = None;
        }
    }
    let _ = conn.close(200, "bench cleanup".into()).await;
}

fn delete_redis_keys(pattern: &str) {
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!("redis-cli -h 127.0.0.1 --scan --pattern '{pattern}' | xargs -r redis-cli -h 127.0.0.1 del >/dev/null"))
        .status();
}

/// Names starting with `prefix` that `rabbitmqctl list_{what}` shows (`what` = `queues` or
/// `exchanges`); empty when rabbitmqctl is missing or fails.
fn broker_names(what: &str, prefix: &str) -> Vec<String> {
    let out = Command::new("rabbitmqctl").args(["-q", &format!("list_{what}"), "--no-table-headers", "name"]).output();
    let Some(out) = out.ok().filter(|o| o.status.success()) else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout).lines().map(str::trim).filter(|n| n.starts_with(prefix)).map(str::to_owned).collect()
}

/// Deletes everything one benchmark invocation created when dropped (at the end of `main`, on
/// an error return and on a panic alike): every queue and exchange whose name starts with the
/// invocation's tag (listed with `rabbitmqctl`), and every Redis key under it. Create it before
/// the first run and keep it for the whole invocation; the processes of a run are stopped by
/// their own guards ([`Proc`]) before it drops.
pub struct Teardown {
    tag: String,
}

impl Teardown {
    pub fn new(tag: &str) -> Teardown {
        Teardown { tag: tag.to_owned() }
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        let tag = self.tag.clone();
        // A thread with its own runtime: this may run inside (or after) the main runtime.
        let _ = std::thread::spawn(move || {
            let (queues, exchanges) = (broker_names("queues", &tag), broker_names("exchanges", &tag));
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
                rt.block_on(async {
                    let _ = tokio::time::timeout(Duration::from_secs(60), delete_amqp(&queues, &exchanges)).await;
                });
            }
            delete_redis_keys(&format!("{tag}*"));
        })
        .join();
    }
}

/// Machine facts for the report.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Machine {
    pub nproc: usize,
    pub cpu_model: String,
    pub mem_total: String,
    pub load_start: String,
    pub load_end: String,
    pub rabbitmq: String,
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub fn uptime() -> String {
    Command::new("uptime").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_else(|_| loadavg())
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_default();
    let mem_total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" ")))
        .unwrap_or_default();
    let rabbitmq = Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", "rabbitmq-server"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    Machine {
        nproc: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        cpu_model,
        mem_total,
        load_start: uptime(),
        load_end: String::new(),
        rabbitmq,
    }
}

/// Medians and percentiles.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return f64::NAN;
    }
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Waits (up to `timeout`) until `scripts/services status` says RabbitMQ and Redis both answer.
pub fn wait_services(timeout: Duration) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default();
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let ok = Command::new(root.join("scripts/services")).arg("status").stdout(Stdio::null()).stderr(Stdio::null()).status().map(|s| s.success()).unwrap_or(false);
        if ok {
            std::thread::sleep(Duration::from_secs(2));
            return;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}
