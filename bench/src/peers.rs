//! 7. Peers: prefix-batcher against SGLang's and vLLM's cache-aware HTTP routers, on the same
//!    simulated servers and the same request stream, side by side in one run.
//!
//! One load generator, many routes. Every route gets fresh simulators (no inherited cache) and
//! the same requests at the same arrival times with the same `max_tokens`:
//! - **prefix-batcher**: M daemon instances on the defaults (adaptive keying), one simulator
//!   each, requests published to RabbitMQ and results read from the reply queue (part 5's driver);
//! - **a peer router and policy**: the router (installed pinned by `bench/peers-install`) over
//!   the same M simulators, requests sent over HTTP open loop at the arrival times, at most
//!   `llm.max_concurrency` × M in flight (the daemons' bound);
//! - **round-robin**: SGLang's `round_robin` policy is the plain baseline.
//!
//! Hit ratios come only from the servers' own counters (`vllm:prefix_cache_*`); the router's
//! CPU seconds (during the drive) and peak RSS come from /proc of its process (the daemons'
//! summed over instances).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::chat::{bfcl_chat, chat_requests, mooncake_chat, rendered, run_on_sims, SimDeployment};
use crate::data;
use crate::parts::{attempt, Plan};
use crate::procs::{self, metric_sum, scrape, Env, Keying, Proc, SimOpts};

/// The daemons' `llm.max_concurrency` in this part (as in parts 2 and 5); the routers get the same
/// bound per server.
const LLM_MAX_CONCURRENCY: usize = 8;

/// A peer router: its label, the Python module whose `launch_router` starts it, the value of
/// `--log-level` that keeps per-request logging off (the daemons log at `warn`).
#[derive(Debug, Clone, Copy)]
struct Peer {
    name: &'static str,
    module: &'static str,
    quiet: &'static str,
}

const PEERS: [Peer; 2] = [
    Peer { name: "sglang-router", module: "sglang_router", quiet: "warn" },
    Peer { name: "vllm-router", module: "vllm_router", quiet: "warning" },
];

/// One route of one workload at one M.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerRow {
    pub workload: String,
    pub m: usize,
    /// `prefix-batcher`, `sglang-router` or `vllm-router`.
    pub system: String,
    /// `defaults` for prefix-batcher, else the router's `--policy`.
    pub policy: String,
    pub requests: usize,
    pub ok: usize,
    /// Prompts the servers served (every request reaches exactly one server when equal to `requests`).
    pub served: u64,
    /// Prompts served by each server (how the route spread the load).
    #[serde(default)]
    pub served_per_server: Vec<u64>,
    /// Render calls the servers answered (vLLM's router renders a chat request before routing it).
    #[serde(default)]
    pub renders: u64,
    pub token_hit_ratio: f64,
    /// Simulated GPU-seconds of prefill (model time).
    pub prefill_s: f64,
    /// End-to-end latency, wall-clock milliseconds (arrival → answer).
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// First arrival → last answer, wall seconds.
    pub wall_s: f64,
    /// Router CPU seconds during the drive per 1,000 requests (daemons: summed over instances).
    pub cpu_s_per_1000: f64,
    /// Router peak RSS, MiB (daemons: summed over instances).
    pub rss_mib: f64,
    /// Why the route failed, when it did.
    #[serde(default)]
    pub error: Option<String>,
}

impl PeerRow {
    /// Answers per wall second (first arrival → last answer): throughput at saturation when
    /// every request arrives at once.
    pub fn throughput(&self) -> f64 {
        self.ok as f64 / self.wall_s.max(1e-9)
    }

    pub fn route(&self) -> String {
        if self.system == "prefix-batcher" {
            "prefix-batcher (defaults)".into()
        } else {
            format!("{} {}", self.system, self.policy)
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerWorkload {
    pub name: String,
    pub requests: usize,
    /// Token-level oracle (one infinite cache, 16-token blocks, the simulator's chat rendering).
    pub oracle: f64,
    pub note: String,
    /// Every request arrives at once: the table reports throughput at saturation.
    #[serde(default)]
    pub burst: bool,
}

/// One workload of the part as run: its requests (messages, arrival s, `max_tokens`), the
/// replay speed-up of the arrival times, the servers, and the M it runs at.
struct WorkloadRun {
    name: &'static str,
    convs: Vec<(Value, f64, u64)>,
    note: String,
    speedup: f64,
    sim: SimOpts,
    ms: Vec<usize>,
    burst: bool,
}

/// Part 4's hot-prefix requests as chat (one user message each: a BIG-Bench-Hard few-shot
/// prompt, `plan.hot_share` of them on one task's header), at the sine schedule's arrival times
/// in seconds.
fn hot_prefix_chat(data_dir: &Path, plan: &Plan) -> anyhow::Result<Vec<(Value, f64, u64)>> {
    let (hot, cold) = data::hot_prefix_prompts(data_dir, plan.hot_cold_groups, plan.seed)?;
    let mut rng = fastrand::Rng::with_seed(plan.seed);
    let times = crate::parts::sine_schedule(plan.hot_unit_rps, plan.hot_period_s, plan.hot_cycles);
    Ok(times
        .into_iter()
        .map(|t| {
            let (prompt, _) = crate::parts::hot_or_cold_prompt(&mut rng, plan, &hot, &cold);
            (json!([{"role": "user", "content": prompt}]), t, plan.hot_max_tokens)
        })
        .collect())
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeersResults {
    pub speedup: f64,
    pub sim: SimOpts,
    pub llm_max_concurrency: usize,
    /// `pip` pins of the peers.
    pub versions: Vec<String>,
    /// What the routers asked the simulators for that it does not serve (from the simulators' logs).
    pub unknown_probes: Vec<String>,
    pub workloads: Vec<PeerWorkload>,
    pub rows: Vec<PeerRow>,
}

impl PeersResults {
    /// The M values `workload` ran at, ascending.
    pub fn ms(&self, workload: &str) -> Vec<usize> {
        let mut ms: Vec<usize> = self.rows.iter().filter(|x| x.workload == workload).map(|x| x.m).collect();
        ms.sort_unstable();
        ms.dedup();
        ms
    }
}

/// Runs `bench/peers-install` (installs the pinned wheels into `.cache/peers-venv` once) and
/// returns the venv's python.
fn install(env: &Env) -> anyhow::Result<PathBuf> {
    let out = Command::new(env.root.join("bench/peers-install")).stderr(Stdio::inherit()).output().context("running bench/peers-install")?;
    anyhow::ensure!(out.status.success(), "bench/peers-install failed");
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts a peer router over `workers` and waits until it answers `/health` and routes (its
/// `/v1/models` answers 200 once it has a healthy worker).
async fn start_router(env: &Env, python: &Path, peer: Peer, policy: &str, workers: &[String], name: &str) -> anyhow::Result<(Proc, String)> {
    let (port, prom) = (free_port()?, free_port()?);
    let log = std::fs::File::create(env.work.join(format!("{name}.log")))?;
    let mut cmd = Command::new(python);
    cmd.args(["-m", &format!("{}.launch_router", peer.module), "--host", "127.0.0.1", "--port", &port.to_string(), "--policy", policy])
        .args(["--prometheus-port", &prom.to_string(), "--prometheus-host", "127.0.0.1", "--log-level", peer.quiet])
        .arg("--worker-urls")
        .args(workers)
        .stdout(log.try_clone()?)
        .stderr(log)
        .stdin(Stdio::null());
    let child = cmd.spawn().with_context(|| format!("starting {}", peer.name))?;
    let mut proc = Proc { name: format!("{} {policy}", peer.name), child };
    let url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Ok(Some(st)) = proc.child.try_wait() {
            bail!("{} exited with {st} while starting; see {}", proc.name, env.work.join(format!("{name}.log")).display());
        }
        let ok = |p: &str| {
            let req = http.get(format!("{url}{p}"));
            async move { req.send().await.map(|r| r.status().is_success()).unwrap_or(false) }
        };
        if ok("/health").await && ok("/v1/models").await {
            return Ok((proc, url));
        }
        if Instant::now() > deadline {
            bail!("{} not ready in 90 s; see {}", proc.name, env.work.join(format!("{name}.log")).display());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One HTTP request of the open-loop driver.
#[derive(Debug, Clone)]
struct HttpReq {
    /// Names the request in [`HttpDrive::answers`] (may be empty).
    id: String,
    /// `/v1/chat/completions` or `/v1/completions`.
    path: &'static str,
    body: Value,
    at: Duration,
}

/// What one HTTP drive measured.
struct HttpDrive {
    sent: usize,
    ok: usize,
    p50_s: f64,
    p99_s: f64,
    wall_s: f64,
    first_error: Option<String>,
    /// Sums of the answers' usage (`prompt_tokens`, `prompt_tokens_details.cached_tokens` or
    /// llama-server's `timings.cache_n`).
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Every answer, in request order (failed requests count 0 tokens).
    answers: Vec<crate::driver::Answer>,
}

/// (prompt tokens, cached tokens) of an answer, as the daemon reads them.
fn usage_tokens(v: &Value) -> (u64, u64) {
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().or_else(|| v["timings"]["cache_n"].as_u64()).unwrap_or(0);
    (prompt, cached)
}

/// Sends every request to `url` + its `path` at its arrival time (open loop), at most `limit` in
/// flight (later arrivals wait for a slot; their latency counts from the arrival). Fails early
/// with a [`procs::Fatal`] error when a process of `watch` is gone or no answer came for
/// [`crate::driver::STALL`] while requests were outstanding.
async fn http_drive(url: &str, reqs: &[HttpReq], limit: usize, watch: &[procs::Watched]) -> anyhow::Result<HttpDrive> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let http = reqwest::Client::builder().timeout(Duration::from_secs(300)).pool_max_idle_per_host(limit).build()?;
    let sem = Arc::new(tokio::sync::Semaphore::new(limit.max(1)));
    // (requests arrived, requests answered or failed), for the watchdog.
    let (sent, answered) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let progress = || (sent.load(Ordering::Relaxed), answered.load(Ordering::Relaxed));
    let start = Instant::now();
    // The requests' tasks are aborted when this ends early (the guard drops with the future).
    let send_all = async {
        let mut tasks = Vec::with_capacity(reqs.len());
        let mut guard = crate::driver::AbortOnDrop(Vec::with_capacity(reqs.len()));
        for r in reqs {
            let arrival = start + r.at;
            tokio::time::sleep_until(arrival).await;
            sent.fetch_add(1, Ordering::Relaxed);
            let answered = answered.clone();
            let (http, sem, body, target, id) = (http.clone(), sem.clone(), r.body.clone(), format!("{url}{}", r.path), r.id.clone());
            let task = tokio::spawn(async move {
                let _permit = sem.acquire_owned().await.expect("never closed");
                let res = http.post(target).json(&body).send().await;
                let outcome = match res {
                    Ok(resp) if resp.status().is_success() => match resp.json::<Value>().await {
                        Ok(v) if v.get("choices").is_some() => Ok(usage_tokens(&v)),
                        Ok(v) => Err(format!("answer without choices: {}", v.to_string().chars().take(200).collect::<String>())),
                        Err(e) => Err(format!("unreadable answer: {e}")),
                    },
                    Ok(resp) => {
                        let status = resp.status();
                        Err(format!("HTTP {status}: {}", resp.text().await.unwrap_or_default().chars().take(200).collect::<String>()))
                    }
                    Err(e) => Err(format!("{e}")),
                };
                answered.fetch_add(1, Ordering::Relaxed);
                (id, Instant::now(), (Instant::now() - arrival).as_secs_f64(), outcome)
            });
            guard.0.push(task.abort_handle());
            tasks.push(task);
        }
        let mut done = Vec::with_capacity(tasks.len());
        for t in tasks {
            done.push(t.await?);
        }
        anyhow::Ok(done)
    };
    let done = tokio::select! {
        r = send_all => r?,
        e = crate::driver::watchdog(watch, crate::driver::STALL, reqs.len(), progress) => return Err(e),
    };
    let mut lat = Vec::with_capacity(done.len());
    let mut answers = Vec::with_capacity(done.len());
    let (mut ok, mut last, mut first_error, mut prompt_tokens, mut cached_tokens) = (0, start, None, 0, 0);
    for (id, done, l, outcome) in done {
        last = last.max(done);
        lat.push(l);
        let (p, c) = match outcome {
            Ok((p, c)) => {
                ok += 1;
                prompt_tokens += p;
                cached_tokens += c;
                (p, c)
            }
            Err(e) => {
                first_error.get_or_insert(e);
                (0, 0)
            }
        };
        answers.push(crate::driver::Answer { id, done_s: (done - start).as_secs_f64(), latency_s: l, prompt_tokens: p, cached_tokens: c });
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok(HttpDrive {
        sent: reqs.len(),
        ok,
        p50_s: procs::percentile(&lat, 0.5),
        p99_s: procs::percentile(&lat, 0.99),
        wall_s: (last - start).as_secs_f64(),
        first_error,
        prompt_tokens,
        cached_tokens,
        answers,
    })
}

/// A peer route: fresh simulators, the router, the drive, the servers' counters.
#[allow(clippy::too_many_arguments)]
async fn router_run(
    env: &Env,
    python: &Path,
    peer: Peer,
    policy: &str,
    sim: &SimOpts,
    m: usize,
    workload: &str,
    reqs: &[HttpReq],
) -> anyhow::Result<PeerRow> {
    let run = env.run_name(&format!("peers-{}-{policy}", peer.name));
    let mut sims = Vec::new();
    for i in 0..m {
        sims.push(procs::start_simulator(env, &format!("{run}-sim{i}"), sim)?);
    }
    let workers: Vec<String> = sims.iter().map(|(_, u)| u.clone()).collect();
    let (mut router, url) = start_router(env, python, peer, policy, &workers, &run).await?;
    let (cpu0, _) = procs::proc_usage(router.pid()).unwrap_or((0.0, 0));
    let watch: Vec<procs::Watched> = sims
        .iter()
        .enumerate()
        .map(|(i, (p, _))| p.watched(&env.work.join(format!("{run}-sim{i}.log"))))
        .chain([router.watched(&env.work.join(format!("{run}.log")))])
        .collect();
    let d = http_drive(&url, reqs, LLM_MAX_CONCURRENCY * m, &watch).await?;
    let (cpu1, rss_kb) = procs::proc_usage(router.pid()).unwrap_or((0.0, 0));
    router.stop(Duration::from_secs(10));
    let http = reqwest::Client::new();
    let mut pages = Vec::new();
    for w in &workers {
        pages.push(scrape(&http, w).await.unwrap_or_default());
    }
    drop(sims);
    let sum = |n: &str| pages.iter().map(|p| metric_sum(p, n)).sum::<f64>();
    Ok(PeerRow {
        workload: workload.into(),
        m,
        system: peer.name.into(),
        policy: policy.into(),
        requests: d.sent,
        ok: d.ok,
        served: sum("simulator_requests_total") as u64,
        served_per_server: pages.iter().map(|p| metric_sum(p, "simulator_requests_total") as u64).collect(),
        renders: sum("simulator_render_requests_total") as u64,
        token_hit_ratio: sum("vllm:prefix_cache_hits_total") / sum("vllm:prefix_cache_queries_total").max(1.0),
        prefill_s: sum("simulator_prefill_seconds_total"),
        p50_ms: d.p50_s * 1000.0,
        p99_ms: d.p99_s * 1000.0,
        wall_s: d.wall_s,
        cpu_s_per_1000: (cpu1 - cpu0) / d.sent.max(1) as f64 * 1000.0,
        rss_mib: rss_kb as f64 / 1024.0,
        error: d.first_error.map(|e| format!("{} of {} failed, first: {e}", d.sent - d.ok, d.sent)),
    })
}

/// The prefix-batcher route: M daemons on the defaults, one fresh simulator each.
async fn daemon_run(env: &Env, plan: &Plan, sim: &SimOpts, m: usize, workload: &str, reqs: &[crate::driver::Req]) -> anyhow::Result<PeerRow> {
    let http = reqwest::Client::new();
    let dep = SimDeployment {
        m,
        sim,
        partitions: plan.scale_partitions,
        keying: Keying::Adaptive,
        max_batch_wait: "5ms",
        llm_max_concurrency: LLM_MAX_CONCURRENCY,
        extra: vec![("AMQP__MAX_MESSAGE_BYTES".into(), (8 << 20).to_string())],
    };
    let r = attempt(env, "peers-pb", plan.scale_partitions, |run| run_on_sims(env, &http, &dep, reqs, run)).await?;
    Ok(PeerRow {
        workload: workload.into(),
        m,
        system: "prefix-batcher".into(),
        policy: "defaults".into(),
        requests: r.drive.sent,
        ok: r.drive.ok,
        served: r.sim_sum("simulator_requests_total") as u64,
        served_per_server: r.per_sim("simulator_requests_total").into_iter().map(|x| x as u64).collect(),
        renders: r.sim_sum("simulator_render_requests_total") as u64,
        token_hit_ratio: r.token_hit_ratio(),
        prefill_s: r.sim_sum("simulator_prefill_seconds_total"),
        p50_ms: r.drive.p50_s * 1000.0,
        p99_ms: r.drive.p99_s * 1000.0,
        wall_s: r.drive.wall_s,
        cpu_s_per_1000: r.daemon_cpu_s / r.drive.sent.max(1) as f64 * 1000.0,
        rss_mib: r.daemon_rss_kb as f64 / 1024.0,
        error: None,
    })
}

/// Requests of the simulators' logs that no route serves (`404 METHOD PATH` lines), deduplicated.
fn unknown_probes(work: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(work)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().contains("-sim"))
        .flat_map(|f| std::fs::read_to_string(f.path()).unwrap_or_default().lines().map(str::to_owned).collect::<Vec<_>>())
        .filter_map(|l| l.split_once("simulate: 404 ").map(|(_, r)| r.split('?').next().unwrap_or(r).to_owned()))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Part 7. Longer than 80 lines on purpose: one loop over workloads, M and routes whose body is
/// the run sequence, read top to bottom.
pub async fn part_peers(env: &Env, plan: &Plan, data_dir: &Path) -> anyhow::Result<PeersResults> {
    let python = install(env)?;
    std::fs::write(env.work.join("empty.toml"), "")?;
    let sim = plan.scale_sim.clone();
    let speedup = plan.scale_speedup;
    let trace = data::read_mooncake(data_dir)?;
    let sample = data::thin_conversations(&trace, plan.scale_keep_one_in);
    drop(trace);
    let t0 = sample.first().map(|r| r.timestamp_ms).unwrap_or(0);
    let (mut mc_msgs, _) = mooncake_chat(&sample, sim.chars_per_token);
    // A request that adds no new blocks renders as an empty user turn, which SGLang's router
    // rejects (HTTP 400: "message content cannot be empty"); every route gets "continue" instead.
    let empty_turns = mc_msgs.iter().filter(|v| v.as_array().and_then(|a| a.last()).is_some_and(|m| m["content"].as_str() == Some(""))).count();
    for m in mc_msgs.iter_mut().flat_map(|v| v.as_array_mut()).flat_map(|a| a.iter_mut()) {
        if m["content"].as_str() == Some("") {
            m["content"] = Value::String("continue".into());
        }
    }
    let mooncake: Vec<(Value, f64, u64)> =
        mc_msgs.into_iter().zip(&sample).map(|(m, r)| (m, (r.timestamp_ms - t0) as f64 / 1000.0, r.output_length.max(1))).collect();
    let bfcl: Vec<(Value, f64, u64)> =
        bfcl_chat(data_dir, plan.chat_bfcl_conversations, 20.0, 60.0, plan.seed)?.into_iter().map(|(m, t)| (m, t, 32)).collect();
    let hot_servers = format!(
        "part 4's slow simulated servers ({} slots, prefill {} ms per uncached token, decode {} ms per token, {} blocks of cache), M = {} as in part 4, real time",
        plan.hot_sim.max_concurrency, plan.hot_sim.prefill_ms_per_token, plan.hot_sim.decode_ms_per_token, plan.hot_sim.capacity_blocks, plan.hot_instances
    );
    let hot_share = plan.hot_share * 100.0;
    let hot_sine = hot_prefix_chat(data_dir, plan)?;
    let hot_burst = hot_sine.iter().map(|(msgs, _, max_tokens)| (msgs.clone(), 0.0, *max_tokens)).collect();
    let runs = [
        WorkloadRun {
            name: "mooncake-chat",
            convs: mooncake,
            note: format!(
                "part 2's Mooncake sample in {} mode ({} requests) as chat, rendered as part 5 renders it, except that the {} empty user turns (a request that adds no block to its conversation) read \"continue\": SGLang's router rejects empty message content",
                plan.mode,
                sample.len(),
                empty_turns
            ),
            speedup,
            sim: sim.clone(),
            ms: plan.peers_ms.clone(),
            burst: false,
        },
        WorkloadRun {
            name: "bfcl-chat",
            convs: bfcl,
            note: format!("part 5's {} bfcl-multiturn conversations, turn by turn", plan.chat_bfcl_conversations),
            speedup,
            sim: sim.clone(),
            ms: plan.peers_ms.clone(),
            burst: false,
        },
        WorkloadRun {
            name: "hot-prefix",
            convs: hot_sine,
            note: format!(
                "part 4's hot-prefix sine load as chat (one user message per request, {hot_share:.0} % on one BIG-Bench-Hard few-shot header, the rest on 8 others; {} s, {} cycle(s)), on {hot_servers}",
                plan.hot_period_s * plan.hot_cycles as f64,
                plan.hot_cycles
            ),
            speedup: 1.0,
            sim: plan.hot_sim.clone(),
            ms: vec![plan.hot_instances],
            burst: false,
        },
        WorkloadRun {
            name: "hot-prefix-burst",
            convs: hot_burst,
            note: format!(
                "the same requests all at once, on {hot_servers}: throughput at saturation = requests ÷ (first arrival → last answer)"
            ),
            speedup: 1.0,
            sim: plan.hot_sim.clone(),
            ms: vec![plan.hot_instances],
            burst: true,
        },
    ];
    let mut workloads = Vec::new();
    let mut rows = Vec::new();
    for WorkloadRun { name, convs, note, speedup, sim, ms, burst } in &runs {
        let (name, convs, speedup, sim) = (*name, convs, *speedup, sim);
        let oracle = crate::parts::one_cache_hit_ratio(convs.iter().map(|(msgs, _, _)| rendered(msgs)), sim.chars_per_token, usize::MAX);
        eprintln!("bench: peers: {name}: {} requests, oracle {:.1}%", convs.len(), oracle * 100.0);
        workloads.push(PeerWorkload { name: name.into(), requests: convs.len(), oracle, note: note.clone(), burst: *burst });
        let queued = chat_requests(name, convs, speedup);
        let http_reqs: Vec<HttpReq> = convs
            .iter()
            .map(|(messages, at, max_tokens)| HttpReq {
                id: String::new(),
                path: "/v1/chat/completions",
                body: json!({"model": "simulated", "messages": messages, "max_tokens": max_tokens, "temperature": 0}),
                at: Duration::from_secs_f64(at / speedup),
            })
            .collect();
        for &m in ms {
            let row = daemon_run(env, plan, sim, m, name, &queued).await?;
            report_row(&row, oracle);
            rows.push(row);
            for (peer, policy) in &plan.peers_routes {
                let Some(p) = PEERS.iter().find(|p| p.name == peer) else { bail!("unknown peer {peer}") };
                let row = match router_run(env, &python, *p, policy, sim, m, name, &http_reqs).await {
                    Ok(row) => row,
                    Err(e) => {
                        eprintln!("bench:   {peer} {policy} M={m} failed: {e:#}");
                        PeerRow {
                            workload: name.into(),
                            m,
                            system: peer.clone(),
                            policy: policy.clone(),
                            requests: http_reqs.len(),
                            ok: 0,
                            served: 0,
                            served_per_server: Vec::new(),
                            renders: 0,
                            token_hit_ratio: 0.0,
                            prefill_s: 0.0,
                            p50_ms: 0.0,
                            p99_ms: 0.0,
                            wall_s: 0.0,
                            cpu_s_per_1000: 0.0,
                            rss_mib: 0.0,
                            // Zeros, not NaN (JSON has no NaN): the report shows `error` instead.
                            error: Some(format!("{e:#}")),
                        }
                    }
                };
                report_row(&row, oracle);
                rows.push(row);
            }
        }
    }
    Ok(PeersResults {
        speedup,
        sim,
        llm_max_concurrency: LLM_MAX_CONCURRENCY,
        versions: vec!["sglang-router==0.3.2".into(), "vllm-router==0.1.17".into()],
        unknown_probes: unknown_probes(&env.work),
        workloads,
        rows,
    })
}

fn report_row(r: &PeerRow, oracle: f64) {
    eprintln!(
        "bench:   {} M={} {}: token hits {:.1}% ({:.1}% of oracle) prefill {:.0} GPU-s p50 {:.0} ms p99 {:.0} ms cpu {:.2} s/1000 rss {:.0} MiB ok {}/{} served {} {:?} renders {}{}",
        r.workload,
        r.m,
        r.route(),
        r.token_hit_ratio * 100.0,
        r.token_hit_ratio / oracle * 100.0,
        r.prefill_s,
        r.p50_ms,
        r.p99_ms,
        r.cpu_s_per_1000,
        r.rss_mib,
        r.ok,
        r.requests,
        r.served,
        r.served_per_server,
        r.renders,
        r.error.as_deref().map(|e| format!(" ERROR {e}")).unwrap_or_default()
    );
}

// ---------------------------------------------------------------------------------------------
// Real llama-servers: prefix-batcher's defaults vs SGLang's cache_aware
// ---------------------------------------------------------------------------------------------

/// One run on 2 real llama-servers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaRow {
    /// One of [`LLAMA_DAEMON`], [`LLAMA_DAEMON_OFF`], [`LLAMA_SGLANG`].
    pub route: String,
    pub rep: usize,
    /// Position of this route in its repetition's order (0 = ran first).
    #[serde(default)]
    pub position: usize,
    pub requests: usize,
    pub ok: usize,
    /// Cached prompt tokens ÷ prompt tokens, from the servers' answers (llama-server's own count).
    pub cached_ratio: f64,
    pub prompt_tokens: u64,
    /// First request sent → last answer, seconds.
    pub wall_s: f64,
    /// Latency (publish or arrival → answer) percentiles over all requests, seconds.
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub p50_s: f64,
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub p99_s: f64,
    /// Mean batch purity of the daemons (NaN for the router).
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub purity: f64,
    /// The same measures restricted to each dataset's requests of the mixed run.
    #[serde(default)]
    pub by_dataset: Vec<LlamaShare>,
}

/// One dataset's requests within a mixed run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaShare {
    pub dataset: String,
    pub requests: usize,
    pub cached_ratio: f64,
    pub prompt_tokens: u64,
    /// First request sent → this dataset's last answer, seconds.
    #[serde(deserialize_with = "nan_if_null")]
    pub wall_s: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub p50_s: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub p99_s: f64,
}

fn nan() -> f64 {
    f64::NAN
}

/// Reads a measure that may be NaN: serde_json writes NaN as `null`.
pub(crate) fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// The datasets of the real-server comparison, mixed (the first two of part 1).
pub const LLAMA_DATASETS: &[&str] = &["bbh-cot", "mmlu-5shot"];

/// The routes of the real-server comparison, as they appear in [`LlamaRow::route`].
pub const LLAMA_DAEMON: &str = "prefix-batcher (defaults)";
pub const LLAMA_DAEMON_OFF: &str = "prefix-batcher (keying off)";
pub const LLAMA_SGLANG: &str = "sglang-router cache_aware";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaPeers {
    pub datasets: Vec<String>,
    pub requests: usize,
    pub server_args: String,
    pub rows: Vec<LlamaRow>,
    /// Token-level oracle per dataset (its requests in submission order) and of the whole mix
    /// (`"mixed"`): (name, hit ratio, prompt tokens). Empty when not measured (quick mode).
    #[serde(default)]
    pub oracle: Vec<(String, f64, u64)>,
    /// Per dataset: how its sample was drawn.
    #[serde(default)]
    pub samples: Vec<data::SampleInfo>,
    /// The model the llama-servers served ([`procs::model_name`]); `None` in results measured
    /// before it was recorded.
    #[serde(default)]
    pub model: Option<String>,
}

/// The two real servers of one run, fresh (named after the invocation so that no one else's
/// servers are touched).
fn llama_pair(env: &Env) -> anyhow::Result<(procs::LlamaServer, procs::LlamaServer)> {
    let args = ["--threads", "1", "--cache-ram", "0"];
    let (na, nb) = (format!("{}-pa", env.tag), format!("{}-pb", env.tag));
    let (a, b) = std::thread::scope(|sc| {
        let ha = sc.spawn(|| procs::LlamaServer::start(env, &na, &args));
        let hb = sc.spawn(|| procs::LlamaServer::start(env, &nb, &args));
        (ha.join().expect("llm-server start thread"), hb.join().expect("llm-server start thread"))
    });
    Ok((a?, b?))
}

/// Splits a run's answers by dataset (`dataset_of`: request id → dataset).
fn shares(answers: &[crate::driver::Answer], dataset_of: &HashMap<String, String>, datasets: &[String]) -> Vec<LlamaShare> {
    datasets
        .iter()
        .map(|ds| {
            let mine: Vec<_> = answers.iter().filter(|a| dataset_of.get(&a.id) == Some(ds)).collect();
            let mut lat: Vec<f64> = mine.iter().map(|a| a.latency_s).collect();
            lat.sort_by(|a, b| a.total_cmp(b));
            let prompt: u64 = mine.iter().map(|a| a.prompt_tokens).sum();
            let cached: u64 = mine.iter().map(|a| a.cached_tokens).sum();
            LlamaShare {
                dataset: ds.clone(),
                requests: mine.len(),
                cached_ratio: cached as f64 / prompt.max(1) as f64,
                prompt_tokens: prompt,
                wall_s: mine.iter().map(|a| a.done_s).fold(f64::NAN, f64::max),
                p50_s: procs::percentile(&lat, 0.5),
                p99_s: procs::percentile(&lat, 0.99),
            }
        })
        .collect()
}

/// Part 7b: bbh-cot and mmlu-5shot mixed, on 2 real llama-servers (SmolLM2-135M, `-np 2`, one
/// thread, `--cache-ram 0`), prefix-batcher's defaults (2 instances, `llm.max_concurrency = 1`,
/// `max_batch_wait = 1s`, as part 1) vs SGLang's `cache_aware` (at most 1 × 2 requests in
/// flight), everything sent at once; `plan.llama_reps` repetitions, repetition r starting with
/// route r mod (number of routes). With `plan.llama_off_route` the daemon with
/// `keying.mode = "off"` is a third route (medium mode: part 1's keyed-vs-off comparison comes
/// from these runs) and the token-level oracle is measured.
///
/// Longer than 80 lines on purpose: the three routes share the sample, the request bodies and
/// the servers' set-up, and read in the order a repetition runs them.
pub async fn part_peers_llama(env: &Env, plan: &Plan, data_dir: &Path) -> anyhow::Result<LlamaPeers> {
    let python = install(env)?;
    let (_, model) = procs::llama_paths(&env.root)?;
    // Tokenize, readiness and metrics calls: none takes a minute unless the server hangs.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    std::fs::write(env.work.join("empty.toml"), "")?;
    let size = plan.cache_sample_size();
    let datasets: Vec<String> = LLAMA_DATASETS.iter().map(|d| (*d).to_owned()).collect();
    let mut items = Vec::new();
    let mut samples = Vec::new();
    for ds in &datasets {
        let (its, info) = data::sample(data_dir, ds, size, plan.seed)?;
        items.extend(its);
        samples.push(info);
    }
    fastrand::Rng::with_seed(plan.seed).shuffle(&mut items);
    let dataset_of: HashMap<String, String> =
        items.iter().map(|it| (it.id.clone(), if it.id.starts_with("bbh-") { datasets[0].clone() } else { datasets[1].clone() })).collect();
    let reps = plan.llama_reps.max(1);
    let mut routes = vec![LLAMA_DAEMON];
    if plan.llama_off_route {
        routes.push(LLAMA_DAEMON_OFF);
    }
    routes.push(LLAMA_SGLANG);
    eprintln!("bench: peers on llama-server: {} requests ({}), {} routes, {reps} repetitions", items.len(), datasets.join(" + "), routes.len());
    let oracle = if plan.llama_off_route {
        // One server's tokenizer and chat template (they are identical across servers).
        let (a, b) = llama_pair(env)?;
        let mut o = Vec::new();
        for ds in &datasets {
            let mine: Vec<data::Item> = items.iter().filter(|it| dataset_of.get(&it.id) == Some(ds)).cloned().collect();
            let (r, t) = crate::parts::token_oracle(&http, &a.url, &mine).await.map_err(|e| procs::blame(e, &[a.watched()])).with_context(|| format!("part peers-llama: tokenizing {ds} on {} for the oracle", a.name))?;
            o.push((ds.clone(), r, t));
        }
        let (r, t) = crate::parts::token_oracle(&http, &a.url, &items).await.map_err(|e| procs::blame(e, &[a.watched()])).context("part peers-llama: tokenizing the mix for the oracle")?;
        o.push(("mixed".to_owned(), r, t));
        procs::LlamaServer::stop_all(vec![a, b]);
        eprintln!("bench:   oracle: {}", o.iter().map(|(n, r, _)| format!("{n} {:.1}%", r * 100.0)).collect::<Vec<_>>().join(", "));
        o
    } else {
        Vec::new()
    };
    let queued: Vec<crate::driver::Req> = items
        .iter()
        .map(|it| {
            let mut body = it.body.clone();
            body["id"] = Value::String(it.id.clone());
            crate::driver::Req { id: it.id.clone(), body: serde_json::to_vec(&body).unwrap(), at: Duration::ZERO }
        })
        .collect();
    let http_reqs: Vec<HttpReq> = items
        .iter()
        .map(|it| {
            let mut body = it.body.clone();
            let params = body.as_object_mut().and_then(|o| o.remove("params")).unwrap_or(json!({}));
            for (k, v) in params.as_object().into_iter().flatten() {
                body[k] = v.clone();
            }
            let path = if body.get("messages").is_some() { "/v1/chat/completions" } else { "/v1/completions" };
            HttpReq { id: it.id.clone(), path, body, at: Duration::ZERO }
        })
        .collect();
    let list_env = vec![("LLM__LIST_PROMPTS".to_owned(), "false".to_owned())];
    let mut rows = Vec::new();
    for rep in 0..reps {
        for position in 0..routes.len() {
            let route = routes[(rep + position) % routes.len()];
            let row = if route != LLAMA_SGLANG {
                let keying = if route == LLAMA_DAEMON { Keying::Adaptive } else { Keying::Off };
                let (http, queued, list_env, dataset_of, datasets) = (&http, &queued, &list_env, &dataset_of, &datasets);
                attempt(env, "peers-llama", 16, move |run| async move {
                    let (a, b) = llama_pair(env)?;
                    let mut daemons = Vec::new();
                    for (i, url) in [&a.url, &b.url].into_iter().enumerate() {
                        daemons.push(procs::start_daemon(
                            env,
                            &procs::DaemonOpts {
                                run: run.clone(),
                                instance: format!("bench-{i}"),
                                partitions: 16,
                                keying,
                                max_batch_size: 8,
                                max_batch_wait: "1s".into(),
                                endpoint: url.clone(),
                                llm_max_concurrency: 1,
                                extra: list_env.clone(),
                            },
                        )?);
                    }
                    procs::wait_ready(http, &mut daemons, 16, Duration::from_secs(60)).await?;
                    let watch: Vec<procs::Watched> = [a.watched(), b.watched()].into_iter().chain(daemons.iter().map(procs::Daemon::watched)).collect();
                    let d = match crate::driver::drive(&format!("{run}.input"), queued.clone(), Duration::from_secs(plan.cache_timeout_s), Duration::from_secs(1), &watch).await {
                        Ok(d) => d,
                        Err(e) => {
                            procs::abort_daemons(daemons);
                            procs::LlamaServer::stop_all(vec![a, b]);
                            return Err(e.context(format!("part peers-llama, run {run} ({route}, repetition {rep}): the daemons were answering the mixed sample's requests")));
                        }
                    };
                    let pages = crate::parts::stop_daemons(http, daemons).await;
                    procs::LlamaServer::stop_all(vec![a, b]);
                    procs::cleanup(&run, 16, &[]).await;
                    anyhow::ensure!(d.results == d.sent, "{} of {} results arrived", d.results, d.sent);
                    Ok(LlamaRow {
                        route: route.into(),
                        rep,
                        position,
                        requests: d.sent,
                        ok: d.ok,
                        cached_ratio: d.cached_tokens as f64 / d.prompt_tokens.max(1) as f64,
                        prompt_tokens: d.prompt_tokens,
                        wall_s: d.wall_s,
                        p50_s: d.p50_s,
                        p99_s: d.p99_s,
                        purity: crate::parts::purity(&pages).0,
                        by_dataset: shares(&d.answers, dataset_of, datasets),
                    })
                })
                .await?
            } else {
                let (a, b) = llama_pair(env)?;
                // The model id the servers report (the router matches a request's `model` to its workers').
                let models: Value = http.get(format!("{}/v1/models", a.url)).send().await?.json().await?;
                let model = models["data"][0]["id"].clone();
                let http_reqs: Vec<HttpReq> = http_reqs.iter().map(|r| HttpReq { body: { let mut b = r.body.clone(); b["model"] = model.clone(); b }, ..r.clone() }).collect();
                let router_name = env.run_name("peers-llama-sglang");
                let (mut router, url) = start_router(env, &python, PEERS[0], "cache_aware", &[a.url.clone(), b.url.clone()], &router_name).await?;
                let watch = [a.watched(), b.watched(), router.watched(&env.work.join(format!("{router_name}.log")))];
                let d = http_drive(&url, &http_reqs, 2, &watch)
                    .await
                    .with_context(|| format!("part peers-llama ({route}, repetition {rep}): the router was sending the mixed sample's requests"))?;
                router.stop(Duration::from_secs(10));
                procs::LlamaServer::stop_all(vec![a, b]);
                if let Some(e) = &d.first_error {
                    eprintln!("bench:   sglang-router on llama-server: {} of {} failed, first: {e}", d.sent - d.ok, d.sent);
                }
                LlamaRow {
                    route: route.into(),
                    rep,
                    position,
                    requests: d.sent,
                    ok: d.ok,
                    cached_ratio: d.cached_tokens as f64 / d.prompt_tokens.max(1) as f64,
                    prompt_tokens: d.prompt_tokens,
                    wall_s: d.wall_s,
                    p50_s: d.p50_s,
                    p99_s: d.p99_s,
                    purity: f64::NAN,
                    by_dataset: shares(&d.answers, &dataset_of, &datasets),
                }
            };
            eprintln!(
                "bench:   llama rep {rep} {}: cached {:.1}% wall {:.1}s p50 {:.1}s p99 {:.1}s ok {}/{}",
                row.route,
                row.cached_ratio * 100.0,
                row.wall_s,
                row.p50_s,
                row.p99_s,
                row.ok,
                row.requests
            );
            rows.push(row);
        }
    }
    Ok(LlamaPeers { datasets, requests: items.len(), server_args: "-np 2 --threads 1 --cache-ram 0 (SmolLM2-135M)".into(), rows, oracle, samples, model: Some(procs::model_name(&model)) })
}
