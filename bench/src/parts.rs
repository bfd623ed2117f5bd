//! The four benchmarks. Each returns a serialisable result that `report` turns into tables and plots.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use prefix_batcher::keying::{partition_of, prefix_chars, PrefixKey};
use prefix_batcher::keying::assignment;
use llm_fakes::simulator::CacheModel;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::data::{self, SampleInfo, SampleSize};
use crate::driver::{drive, Req};
use crate::chat::{run_on_sims, SimDeployment};
use crate::procs::{self, cleanup, metric_sum, scrape, start_daemon, wait_ready, Daemon, DaemonOpts, Env, Keying, LlamaServer, SimOpts, SplitCounts};

/// Everything that differs between quick, medium and full mode.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    pub mode: String,
    pub seed: u64,
    pub datasets: Vec<String>,
    pub cache_groups: usize,
    /// Groups of bfcl-multiturn (its prompts are the longest).
    pub cache_small_groups: usize,
    pub cache_per_group: usize,
    pub cache_max_tokens: u64,
    pub bfcl_system_chars: usize,
    pub cache_timeout_s: u64,
    pub scale_keep_one_in: u64,
    pub scale_speedup: f64,
    pub scale_ms: Vec<usize>,
    pub scale_key_blocks: usize,
    pub scale_key_sweep: Vec<usize>,
    pub scale_sweep_m: usize,
    pub scale_partitions: u32,
    pub scale_sim: SimOpts,
    pub overhead_burst: usize,
    pub overhead_rate: f64,
    pub overhead_secs: f64,
    pub overhead_reps: usize,
    pub hot_unit_rps: f64,
    pub hot_period_s: f64,
    pub hot_cycles: usize,
    pub hot_instances: usize,
    pub hot_shards: Vec<u32>,
    pub hot_share: f64,
    pub hot_cold_groups: usize,
    pub hot_sim: SimOpts,
    pub hot_max_tokens: u64,
    /// Part 5: simulated servers (and daemons) of the chat comparison.
    #[serde(default)]
    pub chat_m: usize,
    /// Part 5: bfcl-multiturn conversations.
    #[serde(default)]
    pub chat_bfcl_conversations: usize,
    /// Part 6: constant request rate and length of the hot-key shift load.
    #[serde(default)]
    pub shift_rate_rps: f64,
    #[serde(default)]
    pub shift_load_s: f64,
    /// Part 7: the M of the peer comparison.
    #[serde(default)]
    pub peers_ms: Vec<usize>,
    /// Part 7: (peer router, policy) routes besides prefix-batcher.
    #[serde(default)]
    pub peers_routes: Vec<(String, String)>,
    /// Part 1: repetitions of every (dataset, cache, mode) run, the order of the modes rotated.
    #[serde(default = "one")]
    pub cache_reps: usize,
    /// Part 1: also the host cache (`--cache-ram 8192`), besides the small one.
    #[serde(default = "yes")]
    pub cache_host: bool,
    /// Part 7's real llama-server comparison: repetitions (each with the routes' order rotated).
    #[serde(default = "three")]
    pub llama_reps: usize,
    /// Part 7's real llama-server comparison: also the daemon with `keying.mode = "off"`, a third
    /// route.
    #[serde(default)]
    pub llama_off_route: bool,
}

fn three() -> usize {
    3
}

fn one() -> usize {
    1
}

fn yes() -> bool {
    true
}

/// The size of a benchmark invocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// CI-sized: every part, small samples.
    Quick,
    /// The real-server parts (1 and 7's llama-server comparison) with samples large enough to
    /// trust: 48 prompts per dataset, 3 repetitions, within 30 minutes on 2 cores.
    Medium,
    /// Larger samples everywhere, the whole Mooncake trace.
    Full,
}

impl Plan {
    /// The sample of part 1 (real llama-server): the same for the peers' llama-server comparison.
    pub fn cache_sample_size(&self) -> SampleSize {
        SampleSize {
            groups: self.cache_groups,
            per_group: self.cache_per_group,
            max_tokens: self.cache_max_tokens,
            bfcl_system_chars: self.bfcl_system_chars,
            orca_max_chars: 1500,
            mmlu_max_chars: 8000,
        }
    }

    pub fn new(mode: Mode, seed: u64) -> Plan {
        let mut p = Plan::sized(mode, seed);
        if std::env::var_os("BENCH_SMOKE").is_some() {
            // Development smoke test: every part, tiny.
            p.mode = "smoke".into();
            p.cache_groups = 2;
            p.cache_small_groups = 2;
            p.cache_per_group = 2;
            p.bfcl_system_chars = 2000;
            p.scale_keep_one_in = 40;
            p.scale_ms = vec![1, 2];
            p.scale_key_sweep = vec![1];
            p.scale_sweep_m = 2;
            p.overhead_burst = 500;
            p.overhead_secs = 2.0;
            p.overhead_reps = 1;
            p.hot_period_s = 10.0;
            p.hot_shards = vec![1, 8];
            p.chat_bfcl_conversations = 20;
            p.shift_load_s = 20.0;
            p.peers_ms = vec![2];
        }
        if let Ok(ds) = std::env::var("BENCH_DATASETS") {
            p.datasets = ds.split(',').map(String::from).collect();
        }
        if let Ok(ms) = std::env::var("BENCH_PEERS_MS") {
            p.peers_ms = ms.split(',').filter_map(|m| m.trim().parse().ok()).collect();
        }
        if let Ok(routes) = std::env::var("BENCH_PEERS_ROUTES") {
            p.peers_routes = routes.split(',').filter_map(|r| r.trim().split_once(':')).map(|(a, b)| (a.to_owned(), b.to_owned())).collect();
        }
        if let Ok(ms) = std::env::var("BENCH_SCALE_MS") {
            p.scale_ms = ms.split(',').filter_map(|m| m.trim().parse().ok()).collect();
        }
        p
    }

    fn sized(mode: Mode, seed: u64) -> Plan {
        let full = mode == Mode::Full;
        let plan = Plan {
            mode: if full { "full" } else { "quick" }.into(),
            seed,
            datasets: ["bbh-cot", "mmlu-5shot", "bfcl-multiturn", "orca-dpo-sample"].map(String::from).to_vec(),
            cache_groups: if full { 6 } else { 4 },
            cache_small_groups: if full { 4 } else { 2 },
            cache_per_group: if full { 8 } else { 3 },
            cache_max_tokens: 4,
            bfcl_system_chars: if full { 9000 } else { 4000 },
            cache_timeout_s: if full { 1800 } else { 300 },
            scale_keep_one_in: if full { 1 } else { 4 },
            scale_speedup: if full { 50.0 } else { 200.0 },
            scale_ms: vec![1, 2, 4, 8],
            scale_key_blocks: 2,
            scale_key_sweep: if full { vec![1, 4] } else { vec![1] },
            scale_sweep_m: 4,
            scale_partitions: 32,
            scale_sim: SimOpts {
                chars_per_token: 4,
                // Per server: 4096 trace blocks of 512 tokens (2 Mi tokens of KV) for the full trace;
                // the thinned trace carries 1/keep_one_in of the conversations, so the cache and the
                // slots shrink by the same factor to keep the same pressure.
                capacity_blocks: if full { 131_072 } else { 32_768 },
                prefill_ms_per_token: 0.1,
                decode_ms_per_token: 2.0,
                max_concurrency: if full { 8 } else { 2 },
                speedup: if full { 50.0 } else { 200.0 },
            },
            overhead_burst: if full { 20_000 } else { 10_000 },
            overhead_rate: 200.0,
            overhead_secs: if full { 30.0 } else { 5.0 },
            overhead_reps: if full { 5 } else { 3 },
            hot_unit_rps: 1.0,
            hot_period_s: if full { 120.0 } else { 40.0 },
            hot_cycles: if full { 2 } else { 1 },
            hot_instances: 4,
            hot_shards: vec![1, 4, 8],
            hot_share: 0.8,
            hot_cold_groups: 8,
            hot_sim: SimOpts {
                chars_per_token: 4,
                capacity_blocks: 4096,
                prefill_ms_per_token: 0.5,
                decode_ms_per_token: 25.0,
                max_concurrency: 4,
                speedup: 1.0,
            },
            hot_max_tokens: 8,
            chat_m: 4,
            chat_bfcl_conversations: if full { 400 } else { 120 },
            shift_rate_rps: 12.0,
            shift_load_s: if full { 120.0 } else { 90.0 },
            peers_ms: vec![2, 4, 8],
            peers_routes: {
                let sglang: &[&str] = if full { &["cache_aware", "power_of_two", "round_robin", "random"] } else { &["cache_aware", "power_of_two", "round_robin"] };
                let vllm: &[&str] = if full { &["cache_aware", "consistent_hash", "power_of_two", "round_robin"] } else { &["cache_aware", "consistent_hash"] };
                sglang.iter().map(|p| ("sglang-router".to_owned(), (*p).to_owned()))
                    .chain(vllm.iter().map(|p| ("vllm-router".to_owned(), (*p).to_owned())))
                    .collect()
            },
            cache_reps: 1,
            cache_host: true,
            llama_reps: 3,
            llama_off_route: false,
        };
        if mode == Mode::Medium {
            Plan::medium_over(plan)
        } else {
            plan
        }
    }

    /// Medium mode over `base` (quick mode's sizes, or those of the results the simulator parts
    /// are kept from). For the real servers: bbh-cot and mmlu-5shot with 4 groups × 12 prompts
    /// each; part 1 keyed vs off with the small cache only (the host cache and the other two
    /// datasets are what does not fit in 30 minutes on 2 cores), 3 repetitions; part 7's
    /// real-server comparison adds the daemon with keying off as a third route, 3 repetitions.
    pub fn medium_over(base: Plan) -> Plan {
        Plan {
            mode: "medium".into(),
            datasets: ["bbh-cot", "mmlu-5shot"].map(String::from).to_vec(),
            cache_groups: 4,
            cache_per_group: 12,
            cache_timeout_s: 1200,
            cache_reps: 3,
            cache_host: false,
            llama_reps: 3,
            llama_off_route: true,
            ..base
        }
    }
}

pub(crate) fn purity(pages: &[String]) -> (f64, u64) {
    let sum: f64 = pages.iter().map(|p| metric_sum(p, "prefix_batcher_batch_purity_sum")).sum();
    let count: f64 = pages.iter().map(|p| metric_sum(p, "prefix_batcher_batch_purity_count")).sum();
    (if count > 0.0 { sum / count } else { f64::NAN }, count as u64)
}

pub(crate) async fn stop_daemons(http: &reqwest::Client, daemons: Vec<Daemon>) -> Vec<String> {
    let mut pages = Vec::new();
    for d in &daemons {
        pages.push(scrape(http, &d.metrics_url).await.unwrap_or_default());
    }
    // SIGTERM to all first, so they drain in parallel.
    for d in &daemons {
        // SAFETY: kill(2) on our own, not yet reaped, child.
        unsafe { libc::kill(d.proc.pid() as i32, libc::SIGTERM) };
    }
    for mut d in daemons {
        let code = d.proc.stop(Duration::from_secs(40));
        if code != Some(0) {
            eprintln!("bench: {} exited with {code:?}", d.proc.name);
        }
    }
    pages
}

/// Runs `f` with a fresh run name; when it fails (e.g. another user of the shared broker restarted
/// it), cleans up, waits for RabbitMQ and Redis, and tries again, at most 3 times in all. A
/// [`procs::Fatal`] error (a server gone, results stopped) is returned at once, after the cleanup.
pub(crate) async fn attempt<T, Fut>(env: &Env, what: &str, partitions: u32, mut f: impl FnMut(String) -> Fut) -> anyhow::Result<T>
where
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut last = None;
    for i in 1..=3 {
        let run = env.run_name(what);
        match f(run.clone()).await {
            Ok(t) => return Ok(t),
            Err(e) if procs::is_fatal(&e) => {
                // Another attempt would not cure it (a server is gone, results stopped): stop here.
                cleanup(&run, partitions, &[]).await;
                return Err(e);
            }
            Err(e) => {
                eprintln!("bench: {what} run failed (attempt {i} of 3): {e:#}");
                procs::wait_services(Duration::from_secs(180));
                cleanup(&run, partitions, &[]).await;
                last = Some(e);
            }
        }
    }
    Err(last.expect("at least one attempt"))
}

// ---------------------------------------------------------------------------------------------
// 1. Cache effect on the real llama-server
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheRow {
    pub dataset: String,
    /// Repetition (medium mode; quick and full mode run each configuration once).
    #[serde(default)]
    pub rep: usize,
    pub cache: String,
    pub mode: String,
    pub requests: usize,
    pub ok: usize,
    pub wall_s: f64,
    pub p50_s: f64,
    pub p99_s: f64,
    pub cached_ratio: f64,
    pub prompt_tokens: u64,
    pub usage_missing: usize,
    pub purity: f64,
    pub batches: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheDataset {
    pub sample: SampleInfo,
    /// Token-level oracle of the sample in submission order (llama-server's own tokenizer and
    /// chat template; each prompt reuses its longest common token prefix with any earlier one, at
    /// most all but its last token).
    pub oracle: f64,
    pub tokens: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheResults {
    pub rows: Vec<CacheRow>,
    pub datasets: Vec<CacheDataset>,
    pub cache_ram_help: String,
    pub list_prompts: String,
    /// The model the llama-servers served ([`procs::model_name`] of `scripts/llm-server path`'s
    /// file); `None` in results measured before it was recorded.
    #[serde(default)]
    pub model: Option<String>,
}

async fn token_ids(http: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<Vec<u64>> {
    let text = match body["prompt"].as_str() {
        Some(p) => p.to_owned(),
        None => {
            let v: Value = http.post(format!("{url}/apply-template")).json(&json!({"messages": body["messages"]})).send().await?.json().await?;
            v["prompt"].as_str().context("/apply-template gave no prompt")?.to_owned()
        }
    };
    let v: Value = http.post(format!("{url}/tokenize")).json(&json!({"content": text, "add_special": true})).send().await?.json().await?;
    Ok(v["tokens"].as_array().context("/tokenize gave no tokens")?.iter().filter_map(Value::as_u64).collect())
}

/// Token-level oracle: (hit ratio, total tokens).
pub(crate) async fn token_oracle(http: &reqwest::Client, url: &str, items: &[data::Item]) -> anyhow::Result<(f64, u64)> {
    let mut seqs: Vec<Vec<u64>> = Vec::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for it in items {
        let t = token_ids(http, url, &it.body).await?;
        let best = seqs.iter().map(|s| s.iter().zip(&t).take_while(|(a, b)| a == b).count()).max().unwrap_or(0);
        hit += best.min(t.len().saturating_sub(1)) as u64;
        total += t.len() as u64;
        seqs.push(t);
    }
    Ok((hit as f64 / total.max(1) as f64, total))
}

/// `llm.list_prompts = false` when this daemon build has the key (one prompt per call, so
/// llama-server reports usage for every prompt); otherwise the client's own detection is used.
fn list_prompts_env(env: &Env) -> Vec<(String, String)> {
    let ok = Command::new(&env.daemon_bin)
        .arg("--config")
        .arg(env.work.join("empty.toml"))
        .arg("check-config")
        .env("PREFIX_BATCHER__LLM__LIST_PROMPTS", "false")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if ok {
        vec![("LLM__LIST_PROMPTS".into(), "false".into())]
    } else {
        Vec::new()
    }
}

pub async fn part_cache(env: &Env, plan: &Plan, data_dir: &Path) -> anyhow::Result<CacheResults> {
    // Tokenize, readiness and metrics calls: none takes a minute unless the server hangs.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    std::fs::write(env.work.join("empty.toml"), "")?;
    let list_env = list_prompts_env(env);
    let list_prompts = if list_env.is_empty() {
        "llm.list_prompts not in this build: the client sends list prompts until it detects llama.cpp's merged usage, then one prompt per call".to_owned()
    } else {
        "llm.list_prompts = false (one prompt per call)".to_owned()
    };
    let (bin, model) = procs::llama_paths(&env.root)?;
    let help = Command::new(&bin).arg("--help").output().map(|o| String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr)).unwrap_or_default();
    let cache_ram_help = {
        let line = help.lines().find(|l| l.contains("--cache-ram")).unwrap_or("").trim().to_owned()
            + " "
            + help.lines().skip_while(|l| !l.contains("--cache-ram")).nth(1).unwrap_or("").trim();
        line.split("[(more").next().unwrap_or("").split_whitespace().collect::<Vec<_>>().join(" ")
    };

    let size = plan.cache_sample_size();
    let caches: &[(&str, &str)] = if plan.cache_host { &[("small", "0"), ("host", "8192")] } else { &[("small", "0")] };
    let mut rows = Vec::new();
    let mut datasets = Vec::new();
    for ds in &plan.datasets {
        let groups = if ds == "bfcl-multiturn" { plan.cache_small_groups } else { plan.cache_groups };
        let (items, info) = data::sample(data_dir, ds, SampleSize { groups, ..size }, plan.seed)?;
        eprintln!("bench: cache effect: {ds}: {} requests, {} groups, {} repetitions", info.requests, info.groups, plan.cache_reps.max(1));
        let mut oracle = None;
        for rep in 0..plan.cache_reps.max(1) {
            for (ci, (cache, ram)) in caches.iter().enumerate() {
                // Rotate the order so neither mode always runs first (across caches and repetitions).
                let modes = if (ci + rep) % 2 == 0 { [true, false] } else { [false, true] };
                for keyed in modes {
                    let want_oracle = oracle.is_none();
                    let (mut row, o) = attempt(env, "cache", 16, |run| {
                        cache_run(env, &http, plan, ds, &items, keyed, cache, ram, &list_env, want_oracle, run)
                    })
                    .await?;
                    if o.is_some() {
                        oracle = o;
                    }
                    row.rep = rep;
                    rows.push(row);
                }
            }
        }
        let (o, tokens) = oracle.unwrap_or((f64::NAN, 0));
        datasets.push(CacheDataset { sample: info, oracle: o, tokens });
    }
    Ok(CacheResults { rows, datasets, cache_ram_help, list_prompts, model: Some(procs::model_name(&model)) })
}

/// The median of `f` over the rows of one (dataset, cache, mode), with its minimum and maximum;
/// `None` when there are none.
pub fn cache_stat(rows: &[CacheRow], dataset: &str, cache: &str, mode: &str, f: impl Fn(&CacheRow) -> f64) -> Option<(f64, f64, f64)> {
    let v: Vec<f64> = rows.iter().filter(|x| x.dataset == dataset && x.cache == cache && x.mode == mode).map(f).collect();
    if v.is_empty() {
        return None;
    }
    Some((procs::median(&v), v.iter().copied().fold(f64::INFINITY, f64::min), v.iter().copied().fold(f64::NEG_INFINITY, f64::max)))
}

/// One cache run: fresh llama-servers and daemons, publish the sample, collect, read the servers'
/// counters, tear down. Longer than 80 lines on purpose: the steps share a dozen locals and read
/// in the order they happen; split, each piece would need most of them as arguments.
#[allow(clippy::too_many_arguments)]
async fn cache_run(
    env: &Env,
    http: &reqwest::Client,
    plan: &Plan,
    ds: &str,
    items: &[data::Item],
    keyed: bool,
    cache: &str,
    ram: &str,
    list_env: &[(String, String)],
    want_oracle: bool,
    run: String,
) -> anyhow::Result<(CacheRow, Option<(f64, u64)>)> {
    let t0 = std::time::Instant::now();
    let srv_args = ["--threads", "1", "--cache-ram", ram];
    // Both servers start in parallel (each takes a second or two), named after the invocation so
    // that no one else's servers are touched.
    let (na, nb) = (format!("{}-a", env.tag), format!("{}-b", env.tag));
    let (a, b) = std::thread::scope(|sc| {
        let ha = sc.spawn(|| LlamaServer::start(env, &na, &srv_args));
        let hb = sc.spawn(|| LlamaServer::start(env, &nb, &srv_args));
        (ha.join().expect("llm-server start thread"), hb.join().expect("llm-server start thread"))
    });
    let (a, b) = (a?, b?);
    let oracle = if want_oracle {
        let o = token_oracle(http, &a.url, items).await.map_err(|e| procs::blame(e, &[a.watched()]));
        Some(o.with_context(|| format!("part cache, {ds}: tokenizing the sample on {} for the oracle", a.name))?)
    } else {
        None
    };
    let mut daemons = Vec::new();
    for (i, url) in [&a.url, &b.url].into_iter().enumerate() {
        daemons.push(start_daemon(
            env,
            &DaemonOpts {
                run: run.clone(),
                instance: format!("bench-{i}"),
                partitions: 16,
                keying: if keyed { Keying::Adaptive } else { Keying::Off },
                max_batch_size: 8,
                max_batch_wait: "1s".into(),
                endpoint: url.clone(),
                llm_max_concurrency: 1,
                extra: list_env.to_vec(),
            },
        )?);
    }
    wait_ready(http, &mut daemons, 16, Duration::from_secs(60)).await?;
    let t_ready = t0.elapsed().as_secs_f64();
    let reqs: Vec<Req> = items
        .iter()
        .map(|it| {
            let mut body = it.body.clone();
            body["id"] = Value::String(it.id.clone());
            Req { id: it.id.clone(), body: serde_json::to_vec(&body).unwrap(), at: Duration::ZERO }
        })
        .collect();
    let watch: Vec<procs::Watched> = [a.watched(), b.watched()].into_iter().chain(daemons.iter().map(Daemon::watched)).collect();
    let d = match drive(&format!("{run}.input"), reqs, Duration::from_secs(plan.cache_timeout_s), Duration::from_secs(1), &watch).await {
        Ok(d) => d,
        Err(e) => {
            procs::abort_daemons(daemons);
            LlamaServer::stop_all(vec![a, b]);
            return Err(e.context(format!("part cache, run {run} ({ds}, {}, {cache} cache): the daemons were answering the sample's requests", if keyed { "keyed" } else { "keying off" })));
        }
    };
    let t_drive = t0.elapsed().as_secs_f64();
    let pages = stop_daemons(http, daemons).await;
    LlamaServer::stop_all(vec![a, b]);
    cleanup(&run, 16, &[]).await;
    eprintln!("bench:   (setup {t_ready:.1}s, drive {:.1}s, teardown {:.1}s)", t_drive - t_ready, t0.elapsed().as_secs_f64() - t_drive);
    anyhow::ensure!(d.results == d.sent, "{} of {} results arrived", d.results, d.sent);
    let (purity, batches) = purity(&pages);
    let row = CacheRow {
        dataset: ds.to_owned(),
        rep: 0,
        cache: cache.to_owned(),
        mode: if keyed { "keyed" } else { "off" }.into(),
        requests: d.sent,
        ok: d.ok,
        wall_s: d.wall_s,
        p50_s: d.p50_s,
        p99_s: d.p99_s,
        cached_ratio: d.cached_tokens as f64 / (d.prompt_tokens.max(1)) as f64,
        prompt_tokens: d.prompt_tokens,
        usage_missing: d.usage_missing,
        purity,
        batches,
    };
    eprintln!(
        "bench:   {ds} cache={cache} {}: wall {:.1}s cached {:.1}% purity {:.2} ok {}/{}",
        row.mode,
        row.wall_s,
        row.cached_ratio * 100.0,
        row.purity,
        row.ok,
        row.requests
    );
    Ok((row, oracle))
}

// ---------------------------------------------------------------------------------------------
// 2. Scale with the simulator: Mooncake replay
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScaleRow {
    pub m: usize,
    pub mode: String,
    pub key_blocks: usize,
    pub requests: usize,
    pub ok: usize,
    pub block_hit_ratio: f64,
    pub token_hit_ratio: f64,
    pub gpu_s: f64,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Model seconds (wall × speedup).
    pub span_s: f64,
    pub p50_s: f64,
    pub p99_s: f64,
    pub peak_backlog: u64,
    /// (model seconds, outstanding requests).
    pub backlog: Vec<(f64, u64)>,
    /// Adaptive mode's split decisions during the run.
    #[serde(default)]
    pub splits: SplitCounts,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelRow {
    pub m: usize,
    pub mode: String,
    pub key_blocks: usize,
    pub block_hit_ratio: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScaleResults {
    pub rows: Vec<ScaleRow>,
    pub offline: Vec<ModelRow>,
    pub trace_requests: usize,
    pub sample_requests: usize,
    pub sample_span_s: f64,
    pub oracle_trace_512: f64,
    pub oracle_sample_512: f64,
    pub oracle_sample_16: f64,
    pub mean_prompt_chars: f64,
    /// Distinct blocks of the sample (16-token blocks, by chained hash).
    #[serde(default)]
    pub distinct_blocks: u64,
    /// Of those, the blocks that are cached once and never looked up again.
    #[serde(default)]
    pub never_reused_blocks: u64,
    /// Of those, the blocks of conversations that have only one request.
    #[serde(default)]
    pub never_reused_single_request: u64,
    /// Conversations of the sample (by their second block id, as sampled), and how many have
    /// only one request.
    #[serde(default)]
    pub conversations: usize,
    #[serde(default)]
    pub single_request_conversations: usize,
}

fn key_chars(blocks: usize, cpt: usize) -> usize {
    blocks * data::TRACE_BLOCK_TOKENS as usize * cpt
}

/// The routing model without broker or time: the daemon's key, partition and rendezvous functions
/// and one cache model per instance, requests in trace order.
fn offline_model(prompts: &[String], m: usize, keyed: Option<usize>, sim: &SimOpts, partitions: u32, seed: u64) -> f64 {
    let members: Vec<String> = (0..m).map(|i| format!("model-{i}")).collect();
    let owners = assignment(partitions, &members);
    let p = std::num::NonZeroU32::new(partitions).unwrap();
    let mut caches: Vec<CacheModel> = (0..m).map(|_| CacheModel::new(sim.chars_per_token, 16, sim.capacity_blocks)).collect();
    let mut rng = fastrand::Rng::with_seed(seed);
    let (mut hit, mut total) = (0u64, 0u64);
    for text in prompts {
        let part = match keyed {
            Some(blocks) => partition_of(PrefixKey::of(prefix_chars(text, key_chars(blocks, sim.chars_per_token))), 0, p),
            None => rng.u32(0..partitions),
        };
        let owner = owners[part as usize].unwrap_or(0);
        let a = caches[owner].admit(text);
        hit += a.hit_blocks;
        total += a.blocks;
    }
    hit as f64 / total.max(1) as f64
}

/// Block hit ratio of `prompts`, in order, through one simulator cache of `capacity_blocks`
/// 16-token blocks (`usize::MAX`: the oracle, an unbounded cache).
pub fn one_cache_hit_ratio<S: AsRef<str>>(prompts: impl IntoIterator<Item = S>, chars_per_token: usize, capacity_blocks: usize) -> f64 {
    let mut cache = CacheModel::new(chars_per_token, 16, capacity_blocks);
    let (mut hit, mut total) = (0u64, 0u64);
    for text in prompts {
        let a = cache.admit(text.as_ref());
        hit += a.hit_blocks;
        total += a.blocks;
    }
    hit as f64 / total.max(1) as f64
}

/// The capacity ceiling of the routing model: every request through one cache of `m` × the
/// per-server capacity, with the servers' own LRU eviction. Routing splits that cache into `m`
/// caches and only chooses which one a request meets, so it does not get above this (a
/// conversation-affine split comes close); only a better eviction policy than LRU would.
fn pooled_model(prompts: &[String], m: usize, sim: &SimOpts) -> f64 {
    one_cache_hit_ratio(prompts, sim.chars_per_token, sim.capacity_blocks.saturating_mul(m))
}

/// Every block look-up and insert of a replay through one simulator cache, in order, with each
/// access's next use: the input of the eviction bounds ([`BlockTrace::optimal_eviction`],
/// [`BlockTrace::lru_admitting_reused`]), which show what the servers' eviction, not routing,
/// leaves on the table.
struct BlockTrace {
    /// Block ids (dense, one per distinct chained block hash), request after request.
    blocks: Vec<u32>,
    /// Whether the access is a look-up that can hit (a block that ends before the prompt's last
    /// token, as in [`CacheModel::admit`]); the others are only inserted.
    lookup: Vec<bool>,
    /// Index of the next access to the same block that is a look-up (`usize::MAX`: none).
    next_lookup: Vec<usize>,
    /// Where each request's accesses start in `blocks`, and the end.
    starts: Vec<usize>,
    /// Distinct blocks (the ids in `blocks` are `0..distinct`).
    distinct: usize,
}

impl BlockTrace {
    fn new(prompts: &[String], chars_per_token: usize) -> Self {
        let block_tokens = 16usize;
        let (mut blocks, mut lookup, mut starts) = (Vec::new(), Vec::new(), Vec::with_capacity(prompts.len() + 1));
        let mut ids: HashMap<u64, u32> = HashMap::new();
        for text in prompts {
            starts.push(blocks.len());
            let hashes = llm_fakes::simulator::block_hashes(text, chars_per_token * block_tokens);
            let tokens = llm_fakes::openai::tokens(text, chars_per_token);
            let limit = ((tokens - 1) / block_tokens as u64) as usize;
            for (j, h) in hashes.iter().enumerate() {
                let next = ids.len() as u32;
                blocks.push(*ids.entry(*h).or_insert(next));
                lookup.push(j < limit);
            }
        }
        starts.push(blocks.len());
        let mut next_lookup = vec![usize::MAX; blocks.len()];
        let mut seen = vec![usize::MAX; ids.len()];
        for i in (0..blocks.len()).rev() {
            let b = blocks[i] as usize;
            next_lookup[i] = seen[b];
            if lookup[i] {
                seen[b] = i;
            }
        }
        BlockTrace { blocks, lookup, next_lookup, starts, distinct: ids.len() }
    }

    /// Per request: the blocks it is the first to bring and that no later look-up uses.
    fn never_reused_per_request(&self) -> Vec<u64> {
        let mut seen = vec![false; self.distinct];
        self.starts
            .windows(2)
            .map(|w| {
                (w[0]..w[1])
                    .filter(|&i| {
                        let first = !std::mem::replace(&mut seen[self.blocks[i] as usize], true);
                        first && self.next_lookup[i] == usize::MAX
                    })
                    .count() as u64
            })
            .collect()
    }

    fn distinct_blocks(&self) -> u64 {
        self.distinct as u64
    }

    fn total(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// Block hit ratio with optimal eviction (Belady's rule: on a miss, drop the cached block
    /// whose next look-up is furthest away, or do not cache the new one if its own is) in one
    /// cache of `capacity` blocks. A hit is counted for every cached block a look-up finds, not
    /// only for the leading run of a chain, so this is an upper bound on every eviction and
    /// admission policy and on every routing over caches of `capacity` blocks in all.
    fn optimal_eviction(&self, capacity: usize) -> f64 {
        use std::collections::BinaryHeap;
        let mut cached: HashMap<u32, usize> = HashMap::new();
        let mut heap: BinaryHeap<(usize, u32)> = BinaryHeap::new();
        let mut hits = 0u64;
        for (i, &b) in self.blocks.iter().enumerate() {
            let next = self.next_lookup[i];
            if let Some(at) = cached.get_mut(&b) {
                hits += u64::from(self.lookup[i]);
                *at = next;
                heap.push((next, b));
                continue;
            }
            if next == usize::MAX || capacity == 0 {
                continue;
            }
            if cached.len() >= capacity {
                // The furthest next use among the cached blocks (stale heap entries skipped).
                let furthest = loop {
                    let &(at, v) = heap.peek().expect("a full cache has heap entries");
                    if cached.get(&v) == Some(&at) {
                        break (at, v);
                    }
                    heap.pop();
                };
                if furthest.0 <= next {
                    continue;
                }
                heap.pop();
                cached.remove(&furthest.1);
            }
            cached.insert(b, next);
            heap.push((next, b));
        }
        hits as f64 / self.total().max(1) as f64
    }

    /// Block hit ratio of the simulator's LRU cache of `capacity` blocks (leading runs only, as
    /// the server counts them) if it admitted only the blocks that a later look-up uses: what
    /// the cache loses to blocks that are never used again.
    fn lru_admitting_reused(&self, capacity: usize) -> f64 {
        // The simulator's `PrefixCache` order: look up the leading run, then touch or insert
        // the prompt's blocks last one first, then evict the least recently used.
        let mut last_use: HashMap<u32, u64> = HashMap::new();
        let mut lru: BTreeMap<u64, u32> = BTreeMap::new();
        let (mut tick, mut hits) = (0u64, 0u64);
        for w in self.starts.windows(2) {
            let range = w[0]..w[1];
            hits += range.clone().take_while(|&i| self.lookup[i] && last_use.contains_key(&self.blocks[i])).count() as u64;
            for i in range.rev() {
                let b = self.blocks[i];
                if !last_use.contains_key(&b) && self.next_lookup[i] == usize::MAX {
                    continue;
                }
                tick += 1;
                if let Some(old) = last_use.insert(b, tick) {
                    lru.remove(&old);
                }
                lru.insert(tick, b);
            }
            while last_use.len() > capacity {
                let Some((_, b)) = lru.pop_first() else { break };
                last_use.remove(&b);
            }
        }
        hits as f64 / self.total().max(1) as f64
    }
}

/// Part 2 (Mooncake replay by M). Longer than 80 lines on purpose: one loop over M and modes
/// whose body is the run's sequence (start, replay, collect, record), read top to bottom.
pub async fn part_scale(env: &Env, plan: &Plan, data_dir: &Path) -> anyhow::Result<ScaleResults> {
    let http = reqwest::Client::new();
    std::fs::write(env.work.join("empty.toml"), "")?;
    let trace = data::read_mooncake(data_dir)?;
    let oracle_trace_512 = data::trace_oracle(&trace);
    let sample = data::thin_conversations(&trace, plan.scale_keep_one_in);
    let oracle_sample_512 = data::trace_oracle(&sample);
    let sim = &plan.scale_sim;
    let mut blocks = HashMap::new();
    let prompts: Vec<String> = sample.iter().map(|r| data::render_trace(r, sim.chars_per_token, &mut blocks)).collect();
    drop(blocks);
    let mean_prompt_chars = prompts.iter().map(|p| p.len() as f64).sum::<f64>() / prompts.len().max(1) as f64;
    let oracle_sample_16 = one_cache_hit_ratio(&prompts, sim.chars_per_token, usize::MAX);
    let t0 = sample.first().map(|r| r.timestamp_ms).unwrap_or(0);
    let sample_span_s = sample.last().map(|r| (r.timestamp_ms - t0) as f64 / 1000.0).unwrap_or(0.0);
    eprintln!(
        "bench: scale: {} of {} trace requests over {:.0} s, oracle 512-block {:.1}% (full trace {:.1}%), 16-token-block {:.1}%",
        sample.len(),
        trace.len(),
        sample_span_s,
        oracle_sample_512 * 100.0,
        oracle_trace_512 * 100.0,
        oracle_sample_16 * 100.0
    );

    // What eviction, not routing, leaves on the table: optimal eviction and an LRU that admits
    // only reused blocks, each with the M servers' capacity in one cache; and where the blocks
    // that are never used again come from.
    let block_trace = BlockTrace::new(&prompts, sim.chars_per_token);
    let never_reused = block_trace.never_reused_per_request();
    let conversation_of = |r: &data::TraceReq| r.hash_ids.get(1).or(r.hash_ids.first()).copied().unwrap_or(0);
    let mut requests_per_conversation: HashMap<u64, usize> = HashMap::new();
    for r in &sample {
        *requests_per_conversation.entry(conversation_of(r)).or_default() += 1;
    }
    let never_reused_blocks: u64 = never_reused.iter().sum();
    let distinct_blocks = block_trace.distinct_blocks();
    let never_reused_single_request: u64 =
        sample.iter().zip(&never_reused).filter(|(r, _)| requests_per_conversation[&conversation_of(r)] == 1).map(|(_, n)| n).sum();
    let conversations = requests_per_conversation.len();
    let single_request_conversations = requests_per_conversation.values().filter(|&&n| n == 1).count();
    let mut offline = Vec::new();
    for &m in &[1usize, 2, 4, 8] {
        offline.push(ModelRow { m, mode: "off".into(), key_blocks: 0, block_hit_ratio: offline_model(&prompts, m, None, sim, plan.scale_partitions, plan.seed) });
        offline.push(ModelRow { m, mode: "pooled".into(), key_blocks: 0, block_hit_ratio: pooled_model(&prompts, m, sim) });
        let capacity = sim.capacity_blocks.saturating_mul(m);
        offline.push(ModelRow { m, mode: "pooled-admit-reused".into(), key_blocks: 0, block_hit_ratio: block_trace.lru_admitting_reused(capacity) });
        offline.push(ModelRow { m, mode: "pooled-optimal".into(), key_blocks: 0, block_hit_ratio: block_trace.optimal_eviction(capacity) });
        for kb in [1usize, 2, 3, 4, 8] {
            offline.push(ModelRow {
                m,
                mode: "keyed".into(),
                key_blocks: kb,
                block_hit_ratio: offline_model(&prompts, m, Some(kb), sim, plan.scale_partitions, plan.seed),
            });
        }
    }
    drop(block_trace);

    let reqs: Vec<Req> = sample
        .iter()
        .zip(&prompts)
        .enumerate()
        .map(|(i, (r, p))| {
            let id = format!("mc-{i}");
            let body = json!({"id": id, "prompt": p, "params": {"max_tokens": r.output_length.max(1), "temperature": 0}});
            Req { id, body: serde_json::to_vec(&body).unwrap(), at: Duration::from_secs_f64((r.timestamp_ms - t0) as f64 / 1000.0 / plan.scale_speedup) }
        })
        .collect();
    drop(prompts);

    // The daemon's defaults (adaptive keys) and off at every M; the static key-length comparison
    // (1 shard per key, the key = the first blocks' worth of characters) at the sweep's M.
    let mut configs: Vec<(usize, ScaleKeying)> = Vec::new();
    for &m in &plan.scale_ms {
        configs.push((m, ScaleKeying::Adaptive));
        configs.push((m, ScaleKeying::Off));
    }
    let mut sweep = plan.scale_key_sweep.clone();
    sweep.push(plan.scale_key_blocks);
    sweep.sort_unstable();
    sweep.dedup();
    for kb in sweep {
        configs.push((plan.scale_sweep_m, ScaleKeying::Static(kb)));
    }
    let mut rows = Vec::new();
    for (m, keyed) in configs {
        let row = attempt(env, "scale", plan.scale_partitions, |run| scale_run(env, &http, plan, &reqs, m, keyed, run)).await?;
        rows.push(row);
    }
    Ok(ScaleResults {
        rows,
        offline,
        trace_requests: trace.len(),
        sample_requests: sample.len(),
        sample_span_s,
        oracle_trace_512,
        oracle_sample_512,
        oracle_sample_16,
        mean_prompt_chars,
        distinct_blocks,
        never_reused_blocks,
        never_reused_single_request,
        conversations,
        single_request_conversations,
    })
}

/// Keying of one Mooncake replay run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScaleKeying {
    /// The daemon's defaults: adaptive key levels (row mode `keyed`).
    Adaptive,
    /// Static comparison: 1 shard per key, key = the first this many trace blocks' worth of
    /// characters (row mode `static`).
    Static(usize),
    /// Random partitions (row mode `off`).
    Off,
}

async fn scale_run(env: &Env, http: &reqwest::Client, plan: &Plan, reqs: &[Req], m: usize, keyed: ScaleKeying, run: String) -> anyhow::Result<ScaleRow> {
    let sim = &plan.scale_sim;
    let dep = SimDeployment {
        m,
        sim,
        partitions: plan.scale_partitions,
        keying: match keyed {
            ScaleKeying::Adaptive => Keying::Adaptive,
            ScaleKeying::Static(blocks) => Keying::Static { prefix_chars: key_chars(blocks, sim.chars_per_token), shards: 1 },
            ScaleKeying::Off => Keying::Off,
        },
        max_batch_wait: "5ms",
        llm_max_concurrency: 8,
        extra: vec![("AMQP__MAX_MESSAGE_BYTES".into(), (8 << 20).to_string())],
    };
    let r = run_on_sims(env, http, &dep, reqs, run).await?;
    let (d, splits) = (&r.drive, r.splits);
    let s = |name: &str| r.sim_sum(name);
    let sp = plan.scale_speedup;
    let row = ScaleRow {
        m,
        mode: match keyed {
            ScaleKeying::Adaptive => "keyed",
            ScaleKeying::Static(_) => "static",
            ScaleKeying::Off => "off",
        }
        .into(),
        key_blocks: if let ScaleKeying::Static(kb) = keyed { kb } else { 0 },
        requests: d.sent,
        ok: d.ok,
        block_hit_ratio: s("simulator_prefix_cache_block_hits_total") / s("simulator_prefix_cache_block_queries_total").max(1.0),
        token_hit_ratio: s("vllm:prefix_cache_hits_total") / s("vllm:prefix_cache_queries_total").max(1.0),
        gpu_s: s("simulator_busy_seconds_total"),
        prefill_s: s("simulator_prefill_seconds_total"),
        decode_s: s("simulator_decode_seconds_total"),
        span_s: d.wall_s * sp,
        p50_s: d.p50_s * sp,
        p99_s: d.p99_s * sp,
        peak_backlog: d.backlog.iter().map(|b| b.1).max().unwrap_or(0),
        backlog: d.backlog.iter().map(|&(t, b)| (t * sp, b)).collect(),
        splits,
    };
    eprintln!(
        "bench:   M={m} {}{}: block hits {:.1}% GPU {:.0}s (prefill {:.0}s) peak backlog {} ok {}/{} {:?}",
        row.mode,
        if row.key_blocks > 0 { format!(" ({} blocks)", row.key_blocks) } else { String::new() },
        row.block_hit_ratio * 100.0,
        row.gpu_s,
        row.prefill_s,
        row.peak_backlog,
        row.ok,
        row.requests,
        row.splits
    );
    anyhow::ensure!(d.results == d.sent, "{} of {} results arrived", d.results, d.sent);
    Ok(row)
}

// ---------------------------------------------------------------------------------------------
// 3. Overhead: daemon vs minimal pass-through, instant fake LLM
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OverheadRep {
    pub system: String,
    pub rep: usize,
    pub throughput_rps: f64,
    pub cpu_s_per_1000: f64,
    /// CPU of the instant LLM during the burst (zero for the pass-through, which calls none).
    #[serde(default)]
    pub llm_cpu_s_per_1000: f64,
    pub p50_s: f64,
    pub p99_s: f64,
    pub ok: usize,
    pub requests: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OverheadResults {
    pub reps: Vec<OverheadRep>,
    /// Peak RSS (VmHWM), kB.
    pub rss_kb: BTreeMap<String, u64>,
    pub body_bytes_mean: f64,
    /// Whether the latency windows of all systems ran at the same time (false in results of
    /// earlier runs, which measured one system after the other, each after its burst).
    #[serde(default)]
    pub latency_simultaneous: bool,
}

fn overhead_requests(prompts: &[String], tag: &str, n: usize, rate: Option<f64>) -> Vec<Req> {
    (0..n)
        .map(|i| {
            let id = format!("{tag}-{i}");
            let body = json!({"id": id, "prompt": prompts[i % prompts.len()], "params": {"max_tokens": 1}});
            let at = rate.map(|r| Duration::from_secs_f64(i as f64 / r)).unwrap_or(Duration::ZERO);
            Req { id, body: serde_json::to_vec(&body).unwrap(), at }
        })
        .collect()
}

pub async fn part_overhead(env: &Env, plan: &Plan, data_dir: &Path) -> anyhow::Result<OverheadResults> {
    let http = reqwest::Client::new();
    std::fs::write(env.work.join("empty.toml"), "")?;
    // Realistic bodies: BIG-Bench-Hard prompts of every task, mixed.
    let size = SampleSize { groups: 27, per_group: 40, max_tokens: 1, bfcl_system_chars: 0, orca_max_chars: 0, mmlu_max_chars: 0 };
    let (items, _) = data::sample(data_dir, "bbh-cot", size, plan.seed)?;
    let prompts: Vec<String> = items.iter().map(|i| i.body["prompt"].as_str().unwrap_or("").to_owned()).collect();
    let body_bytes_mean = prompts.iter().map(|p| p.len() as f64).sum::<f64>() / prompts.len() as f64;

    let mut last = None;
    for i in 1..=3 {
        let (run_d, run_p) = (env.run_name("ovh-daemon"), env.run_name("ovh-pass"));
        let r = overhead_run(env, &http, plan, &prompts, &run_d, &run_p).await;
        if r.is_err() {
            procs::wait_services(Duration::from_secs(180));
        }
        cleanup(&run_d, 16, &[]).await;
        cleanup(&format!("{run_d}w1"), 16, &[]).await;
        for (suffix, _, _) in PASS_VARIANTS {
            let name = format!("{run_p}{suffix}");
            cleanup(&name, 0, &[format!("{name}.pt-mid")]).await;
        }
        match r {
            Ok((reps, rss_kb)) => return Ok(OverheadResults { reps, rss_kb, body_bytes_mean, latency_simultaneous: true }),
            Err(e) => {
                eprintln!("bench: overhead run failed (attempt {i} of 3): {e:#}");
                last = Some(e);
            }
        }
    }
    Err(last.expect("at least one attempt"))
}

/// The systems of the overhead comparison.
pub const DAEMON: &str = "daemon";
pub const DAEMON_1MS: &str = "daemon, 1 ms wait";
pub const PASS: &str = "pass-through";
pub const PASS_2CONN: &str = "pass-through, 2 connections";
pub const PASS_LLM: &str = "pass-through, 2 connections, LLM call";
/// A second build of the daemon (`BENCH_DAEMON_BIN_B`), deployed like [`DAEMON`] and measured in
/// the same rotation, to compare two builds side by side in one run.
pub const DAEMON_B: &str = "daemon B (BENCH_DAEMON_BIN_B)";
/// The pass-through variants: (queue-name suffix, system, calls the LLM), each one step closer to
/// the daemon (`bench/src/passthrough.rs`).
const PASS_VARIANTS: [(&str, &str, bool); 3] = [("", PASS, false), ("c2", PASS_2CONN, false), ("llm", PASS_LLM, true)];

/// One overhead repetition (daemon or pass-through). Longer than 80 lines on purpose: burst,
/// fixed-rate latency and the /proc CPU and RSS readings are one measurement of one process set.
async fn overhead_run(
    env: &Env,
    http: &reqwest::Client,
    plan: &Plan,
    prompts: &[String],
    run_d: &str,
    run_p: &str,
) -> anyhow::Result<(Vec<OverheadRep>, BTreeMap<String, u64>)> {
    // The instant LLM: the simulator with zero prefill and decode cost (its cache model hashes each
    // prompt once). The fake LLM (`llm-fakes fake`) is not used here: its cache model compares every prompt
    // with every earlier one, so it slows down as a run goes on (quadratic) and would be measured
    // instead of the daemon.
    let instant = SimOpts { chars_per_token: 4, capacity_blocks: 65_536, prefill_ms_per_token: 0.0, decode_ms_per_token: 0.0, max_concurrency: 1024, speedup: 1.0 };
    let (llm, fake_url) = procs::start_simulator(env, &format!("{run_d}-instant-llm"), &instant)?;
    // Two daemon deployments: the 10 ms batch wait of the comparison, and 1 ms (the smallest valid
    // wait) to show the pipeline's own latency apart from the batching wait.
    let mut daemons = Vec::new();
    for (run, wait) in [(run_d.to_owned(), "10ms"), (format!("{run_d}w1"), "1ms")] {
        daemons.push(start_daemon(
            env,
            &DaemonOpts {
                instance: "bench-0".into(),
                run,
                partitions: 16,
                keying: Keying::Adaptive,
                max_batch_size: 8,
                max_batch_wait: wait.into(),
                endpoint: fake_url.clone(),
                llm_max_concurrency: 4,
                extra: vec![],
            },
        )?);
    }
    // BENCH_DAEMON_BIN_B: another build, deployed like the 10 ms daemon, measured in the same
    // rotation (its rows are in results.json; the report's tables leave it out).
    let bin_b = std::env::var_os("BENCH_DAEMON_BIN_B").map(std::path::PathBuf::from);
    if let Some(bin) = &bin_b {
        let o = DaemonOpts {
            instance: "bench-0".into(),
            run: format!("{run_d}b"),
            partitions: 16,
            keying: Keying::Adaptive,
            max_batch_size: 8,
            max_batch_wait: "10ms".into(),
            endpoint: fake_url.clone(),
            llm_max_concurrency: 4,
            extra: vec![],
        };
        daemons.push(procs::start_daemon_bin(env, &o, bin)?);
    }
    for i in 0..daemons.len() {
        wait_ready(http, &mut daemons[i..=i], 16, Duration::from_secs(60)).await?;
    }
    let mut passes = Vec::new();
    for (suffix, system, calls_llm) in PASS_VARIANTS {
        let name = format!("{run_p}{suffix}");
        let mut cmd = Command::new(&env.bench_bin);
        cmd.args(["passthrough", "--name", &name, "--input-prefetch", "256", "--mid-prefetch", "64"]);
        if system != PASS {
            cmd.args(["--connections", "2"]);
        }
        if calls_llm {
            cmd.args(["--llm", &fake_url]);
        }
        let log = env.work.join(format!("passthrough{suffix}.log"));
        let (proc, _) = procs::spawn_until_line("pass-through", cmd, &log, Duration::from_secs(30), "ready")?;
        passes.push((system, name, proc));
    }

    let mut reps = Vec::new();
    for rep in 0..plan.overhead_reps {
        let mut order = vec![DAEMON, DAEMON_1MS, PASS, PASS_2CONN, PASS_LLM];
        if bin_b.is_some() {
            order.insert(1, DAEMON_B);
        }
        let systems = order.len();
        order.rotate_left(rep % systems);
        let targets: Vec<(&str, String, u32)> = order
            .into_iter()
            .map(|system| match system {
                DAEMON => (system, format!("{run_d}.input"), daemons[0].proc.pid()),
                DAEMON_1MS => (system, format!("{run_d}w1.input"), daemons[1].proc.pid()),
                DAEMON_B => (system, format!("{run_d}b.input"), daemons[2].proc.pid()),
                _ => {
                    let (_, name, proc) = passes.iter().find(|p| p.0 == system).expect("every pass-through variant runs");
                    (system, format!("{name}.input"), proc.pid())
                }
            })
            .collect();
        // Throughput and CPU: one burst per system, one system at a time.
        let mut bursts = Vec::new();
        for (si, (_, queue, pid)) in targets.iter().enumerate() {
            let tag = format!("s{si}-{rep}");
            let (cpu0, _) = procs::proc_usage(*pid).unwrap_or((0.0, 0));
            let (llm0, _) = procs::proc_usage(llm.pid()).unwrap_or((0.0, 0));
            let burst = drive(queue, overhead_requests(prompts, &format!("{tag}-b"), plan.overhead_burst, None), Duration::from_secs(300), Duration::from_millis(500), &[]).await?;
            let (cpu1, _) = procs::proc_usage(*pid).unwrap_or((0.0, 0));
            let (llm1, _) = procs::proc_usage(llm.pid()).unwrap_or((0.0, 0));
            bursts.push((burst, cpu1 - cpu0, llm1 - llm0));
        }
        // Latency: every system at the same time, each at its share of the rate for as many windows
        // as there are systems (the broker's load and each system's number of requests are those of
        // one system after the other), so that a stall of the broker (its quorum queues commit by
        // fsync, and this machine's disk stalls an fsync for tens of milliseconds every few seconds)
        // delays every system's requests at the same moments, not whichever system's window it
        // falls into.
        let n_lat = (plan.overhead_rate * plan.overhead_secs) as usize;
        let each = plan.overhead_rate / targets.len() as f64;
        let lats = futures_util::future::join_all(targets.iter().enumerate().map(|(si, (_, queue, _))| {
            let reqs = overhead_requests(prompts, &format!("s{si}-{rep}-l"), n_lat, Some(each));
            drive(queue, reqs, Duration::from_secs(120), Duration::from_millis(500), &[])
        }))
        .await;
        for ((system, _, _), ((burst, cpu, llm_cpu), lat)) in targets.iter().zip(bursts.into_iter().zip(lats)) {
            let lat = lat?;
            let r = OverheadRep {
                system: (*system).into(),
                rep,
                throughput_rps: burst.ok as f64 / burst.wall_s,
                cpu_s_per_1000: cpu / burst.sent.max(1) as f64 * 1000.0,
                llm_cpu_s_per_1000: llm_cpu / burst.sent.max(1) as f64 * 1000.0,
                p50_s: lat.p50_s,
                p99_s: lat.p99_s,
                ok: burst.ok + lat.ok,
                requests: burst.sent + lat.sent,
            };
            eprintln!(
                "bench:   overhead rep {rep} {system}: {:.0} req/s, CPU {:.2}s/1000, latency at {:.0} req/s each p50 {:.1}ms p99 {:.1}ms",
                r.throughput_rps,
                r.cpu_s_per_1000,
                each,
                r.p50_s * 1000.0,
                r.p99_s * 1000.0
            );
            reps.push(r);
        }
    }
    let mut rss_kb = BTreeMap::new();
    rss_kb.insert(DAEMON.to_owned(), procs::proc_usage(daemons[0].proc.pid()).map(|u| u.1).unwrap_or(0));
    rss_kb.insert(DAEMON_1MS.to_owned(), procs::proc_usage(daemons[1].proc.pid()).map(|u| u.1).unwrap_or(0));
    if let Some(d) = daemons.get(2) {
        rss_kb.insert(DAEMON_B.to_owned(), procs::proc_usage(d.proc.pid()).map(|u| u.1).unwrap_or(0));
    }
    for (system, _, proc) in &passes {
        rss_kb.insert((*system).to_owned(), procs::proc_usage(proc.pid()).map(|u| u.1).unwrap_or(0));
    }
    stop_daemons(http, daemons).await;
    for (_, _, mut proc) in passes {
        proc.stop(Duration::from_secs(10));
    }
    Ok((reps, rss_kb))

}

// ---------------------------------------------------------------------------------------------
// 4. Hot prefix under a sine load
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HotRow {
    /// Static shards per key; 0: the adaptive mode (the default).
    pub shards: u32,
    pub requests: usize,
    pub ok: usize,
    pub peak_backlog: u64,
    pub peak_at_s: f64,
    pub end_backlog: u64,
    /// Seconds after the load ended until nothing was outstanding (NaN: not within the run).
    pub drained_after_s: f64,
    pub hit_ratio: f64,
    pub p50_s: f64,
    pub p99_s: f64,
    pub backlog: Vec<(f64, u64)>,
    /// Adaptive mode's split decisions during the run.
    #[serde(default)]
    pub splits: SplitCounts,
}

impl HotRow {
    /// `adaptive`, or `static, shards = N`.
    pub fn label(&self) -> String {
        if self.shards == 0 {
            "adaptive".to_owned()
        } else {
            format!("static, shards = {}", self.shards)
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HotResults {
    pub rows: Vec<HotRow>,
    pub load_s: f64,
    pub requests: usize,
    pub hot_requests: usize,
}

/// Arrival times of a rate `unit × (5 + 35 × (1 − cos 2πt/T) / 2)` per second: one request each
/// time the integral of the rate passes a whole number (deterministic, no Poisson noise).
pub fn sine_schedule(unit: f64, period: f64, cycles: usize) -> Vec<f64> {
    let end = period * cycles as f64;
    let dt = 0.001;
    let mut out = Vec::new();
    let (mut t, mut acc) = (0.0, 0.0);
    while t < end {
        let rate = unit * (5.0 + 35.0 * (1.0 - (2.0 * std::f64::consts::PI * t / period).cos()) / 2.0);
        acc += rate * dt;
        while acc >= 1.0 {
            acc -= 1.0;
            out.push(t);
        }
        t += dt;
    }
    out
}

/// One request of the hot-prefix workloads, `t` seconds into the load: with probability
/// `plan.hot_share` a prompt of the `hot` task (then `true`), else one of a random `cold` task.
pub(crate) fn hot_or_cold_request(rng: &mut fastrand::Rng, plan: &Plan, hot: &[String], cold: &[Vec<String>], id: &str, t: f64) -> (Req, bool) {
    let (prompt, on_hot) = hot_or_cold_prompt(rng, plan, hot, cold);
    let body = json!({"id": id, "prompt": prompt, "params": {"max_tokens": plan.hot_max_tokens, "temperature": 0}});
    (Req { id: id.to_owned(), body: serde_json::to_vec(&body).unwrap(), at: Duration::from_secs_f64(t) }, on_hot)
}

/// The prompt of one hot-prefix request: with probability `plan.hot_share` one of the `hot`
/// task's (then `true`), else one of a random `cold` task's.
pub(crate) fn hot_or_cold_prompt<'a>(rng: &mut fastrand::Rng, plan: &Plan, hot: &'a [String], cold: &'a [Vec<String>]) -> (&'a str, bool) {
    if rng.f64() < plan.hot_share {
        (&hot[rng.usize(..hot.len())], true)
    } else {
        let g = &cold[rng.usize(..cold.len())];
        (&g[rng.usize(..g.len())], false)
    }
}

pub async fn part_hot(env: &Env, plan: &Plan, data_dir: &Path) -> anyhow::Result<HotResults> {
    let http = reqwest::Client::new();
    std::fs::write(env.work.join("empty.toml"), "")?;
    let (hot, cold) = data::hot_prefix_prompts(data_dir, plan.hot_cold_groups, plan.seed)?;
    let times = sine_schedule(plan.hot_unit_rps, plan.hot_period_s, plan.hot_cycles);
    let load_s = plan.hot_period_s * plan.hot_cycles as f64;
    let mut rng = fastrand::Rng::with_seed(plan.seed);
    let mut hot_requests = 0;
    let reqs: Vec<Req> = times
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let (req, on_hot) = hot_or_cold_request(&mut rng, plan, &hot, &cold, &format!("hot-{i}"), t);
            hot_requests += usize::from(on_hot);
            req
        })
        .collect();
    eprintln!("bench: hot prefix: {} requests over {load_s:.0} s, {hot_requests} on the hot prefix", reqs.len());
    // shards = 0: the daemon's default (adaptive keys); then the static comparison runs.
    let mut rows = Vec::new();
    for shards in std::iter::once(0).chain(plan.hot_shards.iter().copied()) {
        let row = attempt(env, "hot", 32, |run| hot_run(env, &http, plan, &reqs, load_s, shards, run)).await?;
        rows.push(row);
    }
    Ok(HotResults { rows, load_s, requests: reqs.len(), hot_requests })
}

async fn hot_run(env: &Env, http: &reqwest::Client, plan: &Plan, reqs: &[Req], load_s: f64, shards: u32, run: String) -> anyhow::Result<HotRow> {
    let dep = SimDeployment {
        m: plan.hot_instances,
        sim: &plan.hot_sim,
        partitions: 32,
        keying: if shards == 0 { Keying::Adaptive } else { Keying::Static { prefix_chars: 256, shards } },
        max_batch_wait: "50ms",
        llm_max_concurrency: plan.hot_sim.max_concurrency,
        extra: vec![],
    };
    let r = run_on_sims(env, http, &dep, reqs, run).await?;
    let (d, splits) = (&r.drive, r.splits);
    let s = |name: &str| r.sim_sum(name);
    let (peak_at_s, peak_backlog) = d.backlog.iter().fold((0.0, 0u64), |acc, &(t, b)| if b > acc.1 { (t, b) } else { acc });
    let end_backlog = d.backlog.iter().rfind(|(t, _)| *t <= load_s).map(|b| b.1).unwrap_or(0);
    let drained_after_s = d.backlog.iter().find(|(t, b)| *t >= load_s && *b == 0).map(|(t, _)| t - load_s).unwrap_or(f64::NAN);
    let row = HotRow {
        shards,
        requests: d.sent,
        ok: d.ok,
        peak_backlog,
        peak_at_s,
        end_backlog,
        drained_after_s,
        hit_ratio: s("vllm:prefix_cache_hits_total") / s("vllm:prefix_cache_queries_total").max(1.0),
        p50_s: d.p50_s,
        p99_s: d.p99_s,
        backlog: d.backlog.clone(),
        splits,
    };
    eprintln!(
        "bench:   {}: peak backlog {} at {:.0}s, at end {}, hit {:.1}%, p99 {:.1}s {:?}",
        row.label(),
        row.peak_backlog,
        row.peak_at_s,
        row.end_backlog,
        row.hit_ratio * 100.0,
        row.p99_s,
        row.splits
    );
    anyhow::ensure!(d.results == d.sent, "{} of {} results arrived", d.results, d.sent);
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One character per token, so a block is 16 characters.
    fn prompt(c: char, blocks: usize) -> String {
        // One character more than the blocks, so every full block can be looked up.
        std::iter::repeat_n(c, blocks * 16 + 1).collect()
    }

    #[test]
    fn the_eviction_bounds_keep_out_what_is_never_used_again() {
        // X, then Y (never used again), then X: a 2-block LRU loses X to Y; optimal eviction
        // and an LRU that admits only reused blocks keep X and hit both of its blocks.
        let prompts = vec![prompt('x', 2), prompt('y', 2), prompt('x', 2)];
        let trace = BlockTrace::new(&prompts, 1);
        assert_eq!(trace.total(), 6);
        assert_eq!(trace.distinct_blocks(), 4);
        assert_eq!(trace.never_reused_per_request(), vec![0, 2, 0], "only Y's blocks are never looked up again");
        assert_eq!(one_cache_hit_ratio(&prompts, 1, 2), 0.0);
        assert_eq!(trace.lru_admitting_reused(2), 2.0 / 6.0);
        assert_eq!(trace.optimal_eviction(2), 2.0 / 6.0);
        assert_eq!(trace.optimal_eviction(0), 0.0);
    }

    #[test]
    fn optimal_eviction_lies_between_lru_and_the_unbounded_cache() {
        // Conversations that extend their own prompts, interleaved, through small caches.
        let mut rng = fastrand::Rng::with_seed(3);
        let mut histories: Vec<String> = (0..12).map(|i| format!("{:>16}", format!("conversation {i}"))).collect();
        let mut prompts = Vec::new();
        for _ in 0..300 {
            let h = &mut histories[rng.usize(0..12)];
            h.extend(std::iter::repeat_n(char::from(b'a' + rng.u8(0..26)), rng.usize(8..40)));
            prompts.push(h.clone());
        }
        let trace = BlockTrace::new(&prompts, 1);
        let unbounded = one_cache_hit_ratio(&prompts, 1, usize::MAX);
        assert_eq!(trace.optimal_eviction(usize::MAX), unbounded, "an unbounded cache evicts nothing");
        for capacity in [4, 16, 64, 256] {
            let lru = one_cache_hit_ratio(&prompts, 1, capacity);
            let optimal = trace.optimal_eviction(capacity);
            assert!(lru <= optimal && optimal <= unbounded, "capacity {capacity}: LRU {lru}, optimal {optimal}, unbounded {unbounded}");
        }
        assert!(one_cache_hit_ratio(&prompts, 1, 16) < trace.optimal_eviction(16), "this load leaves LRU room to lose");
    }
}
