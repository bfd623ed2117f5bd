//! 5. Multi-turn chat and 6. hot-key shift, both on simulated servers: the daemon's defaults
//!    (adaptive key levels) against static configurations.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

use prefix_batcher::keying::{prefix_chars, PrefixKey};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::data::{self, TraceReq};
use crate::driver::{drive, Drive, Req};
use crate::parts::{attempt, hot_or_cold_request, stop_daemons, Plan};
use crate::procs::{self, cleanup, metric_sum, scrape, start_daemon, wait_ready, DaemonOpts, Env, Keying, SimOpts, SplitCounts};

/// One deployment of M daemons, each with one simulator.
pub(crate) struct SimDeployment<'a> {
    pub m: usize,
    pub sim: &'a SimOpts,
    pub partitions: u32,
    pub keying: Keying,
    pub max_batch_wait: &'a str,
    pub llm_max_concurrency: usize,
    pub extra: Vec<(String, String)>,
}

/// What one run on simulators measured.
pub(crate) struct SimRun {
    pub drive: Drive,
    sim_pages: Vec<String>,
    pub splits: SplitCounts,
    /// Wall clock at the start of the drive (log lines are compared with it).
    started: SystemTime,
    /// CPU seconds (user + system) the daemons spent during the drive, summed over instances.
    pub daemon_cpu_s: f64,
    /// Peak RSS (VmHWM, kB) of the daemons, summed over instances.
    pub daemon_rss_kb: u64,
}

impl SimRun {
    /// A metric summed over the simulators.
    pub fn sim_sum(&self, name: &str) -> f64 {
        self.sim_pages.iter().map(|p| metric_sum(p, name)).sum()
    }
    /// A metric of each simulator, in start order.
    pub fn per_sim(&self, name: &str) -> Vec<f64> {
        self.sim_pages.iter().map(|p| metric_sum(p, name)).collect()
    }
    pub fn token_hit_ratio(&self) -> f64 {
        self.sim_sum("vllm:prefix_cache_hits_total") / self.sim_sum("vllm:prefix_cache_queries_total").max(1.0)
    }
}

/// Starts the deployment, drives `reqs` through it, scrapes, stops and cleans up; fails when
/// not every request got a result.
pub(crate) async fn run_on_sims(env: &Env, http: &reqwest::Client, dep: &SimDeployment<'_>, reqs: &[Req], run: String) -> anyhow::Result<SimRun> {
    let mut sims = Vec::new();
    for i in 0..dep.m {
        sims.push(procs::start_simulator(env, &format!("{run}-sim{i}"), dep.sim)?);
    }
    let mut daemons = Vec::new();
    for (i, (_, url)) in sims.iter().enumerate() {
        daemons.push(start_daemon(
            env,
            &DaemonOpts {
                run: run.clone(),
                instance: format!("bench-{i}"),
                partitions: dep.partitions,
                keying: dep.keying,
                max_batch_size: 8,
                max_batch_wait: dep.max_batch_wait.into(),
                endpoint: url.clone(),
                llm_max_concurrency: dep.llm_max_concurrency,
                extra: dep.extra.clone(),
            },
        )?);
    }
    wait_ready(http, &mut daemons, dep.partitions, Duration::from_secs(90)).await?;
    let usage = |daemons: &[procs::Daemon]| -> (f64, u64) {
        daemons.iter().filter_map(|d| procs::proc_usage(d.proc.pid())).fold((0.0, 0), |(c, r), (c1, r1)| (c + c1, r + r1))
    };
    let (cpu0, _) = usage(&daemons);
    let started = SystemTime::now();
    let watch: Vec<procs::Watched> = sims
        .iter()
        .enumerate()
        .map(|(i, (p, _))| p.watched(&env.work.join(format!("{run}-sim{i}.log"))))
        .chain(daemons.iter().map(procs::Daemon::watched))
        .collect();
    let d = match drive(&format!("{run}.input"), reqs.to_vec(), Duration::from_secs(600), Duration::from_millis(250), &watch).await {
        Ok(d) => d,
        Err(e) => {
            procs::abort_daemons(daemons);
            return Err(e);
        }
    };
    let (cpu1, daemon_rss_kb) = usage(&daemons);
    let mut sim_pages = Vec::new();
    for (_, url) in &sims {
        sim_pages.push(scrape(http, url).await.unwrap_or_default());
    }
    let splits = SplitCounts::of(&stop_daemons(http, daemons).await);
    drop(sims);
    cleanup(&run, dep.partitions, &[]).await;
    anyhow::ensure!(d.results == d.sent, "{} of {} results arrived", d.results, d.sent);
    Ok(SimRun { drive: d, sim_pages, splits, started, daemon_cpu_s: cpu1 - cpu0, daemon_rss_kb })
}

// ---------------------------------------------------------------------------------------------
// 5. Multi-turn chat
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatRow {
    pub workload: String,
    /// `adaptive` (the defaults) or `prefix` (static).
    pub mode: String,
    /// `keying.chat_key` of a static row (the default, `opening`, for adaptive).
    pub chat_key: String,
    /// Static shards per key (0 for adaptive).
    pub shards: u32,
    pub requests: usize,
    pub ok: usize,
    pub token_hit_ratio: f64,
    pub prefill_s: f64,
    pub p50_s: f64,
    pub p99_s: f64,
    pub splits: SplitCounts,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatWorkload {
    pub name: String,
    pub requests: usize,
    pub conversations: usize,
    /// Token-level oracle (one infinite cache, 16-token blocks, the simulator's chat rendering).
    pub oracle: f64,
    pub note: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatResults {
    pub m: usize,
    pub speedup: f64,
    pub workloads: Vec<ChatWorkload>,
    pub rows: Vec<ChatRow>,
}

/// The Mooncake conversations as chat: block 0 (shared by every request) is the system message,
/// and each request of a conversation adds one user turn holding the text of the blocks it has
/// that the conversation's previous request had not; a request's messages are the conversation
/// so far. A conversation is the requests sharing the second block id.
pub(crate) fn mooncake_chat(sample: &[TraceReq], chars_per_token: usize) -> (Vec<Value>, usize) {
    let block_chars = data::TRACE_BLOCK_TOKENS as usize * chars_per_token;
    let mut texts: HashMap<u64, String> = HashMap::new();
    let mut convs: HashMap<u64, (Vec<Value>, Vec<u64>)> = HashMap::new();
    let mut out = Vec::with_capacity(sample.len());
    for r in sample {
        let Some(&first) = r.hash_ids.first() else { continue };
        let conv = r.hash_ids.get(1).copied().unwrap_or(first);
        let (msgs, prev) = convs.entry(conv).or_insert_with(|| {
            let system = texts.entry(first).or_insert_with(|| data::block_text(first, block_chars)).clone();
            (vec![json!({"role": "system", "content": system})], vec![first])
        });
        let mut turn = String::new();
        for h in r.hash_ids.iter().filter(|h| !prev.contains(h)) {
            turn.push_str(texts.entry(*h).or_insert_with(|| data::block_text(*h, block_chars)));
        }
        msgs.push(json!({"role": "user", "content": turn}));
        prev.clone_from(&r.hash_ids);
        out.push(Value::Array(msgs.clone()));
    }
    (out, convs.len())
}

/// bfcl-multiturn conversations: `conversations` entries drawn at random, each sent turn by turn
/// (its first request, then each later user turn after an assistant turn), conversations
/// starting `start_gap_s` apart, turns `turn_gap_s` apart. Returns (messages, seconds) in time order.
pub(crate) fn bfcl_chat(data_dir: &Path, conversations: usize, start_gap_s: f64, turn_gap_s: f64, seed: u64) -> anyhow::Result<Vec<(Value, f64)>> {
    let mut rows = data::read_jsonl(&data_dir.join(data::BFCL_FIRST_REQUESTS))?;
    let mut rng = fastrand::Rng::with_seed(seed);
    rng.shuffle(&mut rows);
    let mut out = Vec::new();
    for (c, r) in rows.iter().take(conversations).enumerate() {
        let mut msgs = r["first_turn_messages"].as_array().cloned().unwrap_or_default();
        let start = c as f64 * start_gap_s;
        out.push((Value::Array(msgs.clone()), start));
        for (t, later) in r["later_user_turns"].as_array().into_iter().flatten().enumerate() {
            msgs.push(json!({"role": "assistant", "content": "Done."}));
            msgs.extend(later.as_array().cloned().unwrap_or_default());
            out.push((Value::Array(msgs.clone()), start + (t + 1) as f64 * turn_gap_s));
        }
    }
    out.sort_by(|a, b| a.1.total_cmp(&b.1));
    Ok(out)
}

/// The simulator's chat rendering (role-tagged), for the oracle.
pub(crate) fn rendered(messages: &Value) -> String {
    let mut s = String::new();
    for m in messages.as_array().into_iter().flatten() {
        s.push_str(&format!("<|{}|>\n{}\n", m["role"].as_str().unwrap_or(""), m["content"].as_str().unwrap_or("")));
    }
    s
}

pub(crate) fn chat_requests(tag: &str, convs: &[(Value, f64, u64)], speedup: f64) -> Vec<Req> {
    convs
        .iter()
        .enumerate()
        .map(|(i, (messages, at, max_tokens))| {
            let id = format!("{tag}-{i}");
            let body = json!({"id": id, "messages": messages, "params": {"max_tokens": max_tokens, "temperature": 0}});
            Req { id, body: serde_json::to_vec(&body).unwrap(), at: Duration::from_secs_f64(at / speedup) }
        })
        .collect()
}

pub async fn part_chat(env: &Env, plan: &Plan, data_dir: &Path) -> anyhow::Result<ChatResults> {
    let http = reqwest::Client::new();
    std::fs::write(env.work.join("empty.toml"), "")?;
    let sim = &plan.scale_sim;
    let trace = data::read_mooncake(data_dir)?;
    let sample = data::thin_conversations(&trace, plan.scale_keep_one_in);
    drop(trace);
    let t0 = sample.first().map(|r| r.timestamp_ms).unwrap_or(0);
    let (mc_msgs, mc_convs) = mooncake_chat(&sample, sim.chars_per_token);
    let mooncake: Vec<(Value, f64, u64)> =
        mc_msgs.into_iter().zip(&sample).map(|(m, r)| (m, (r.timestamp_ms - t0) as f64 / 1000.0, r.output_length.max(1))).collect();
    let bfcl: Vec<(Value, f64, u64)> =
        bfcl_chat(data_dir, plan.chat_bfcl_conversations, 20.0, 60.0, plan.seed)?.into_iter().map(|(m, t)| (m, t, 32)).collect();
    let mut workloads = Vec::new();
    let mut rows = Vec::new();
    let statics: Vec<(&str, u32)> =
        ["system", "system_and_first_user", "rendered"].into_iter().flat_map(|k| [(k, 1), (k, 8)]).collect();
    for (name, convs, note) in [
        ("mooncake-chat", &mooncake, format!("the {} requests of part 2's sample in {} mode as chat (block 0 = system message, one user turn per request)", sample.len(), plan.mode)),
        ("bfcl-chat", &bfcl, format!("{} random bfcl-multiturn entries, every user turn (assistant turns \"Done.\"), conversations 20 s apart, turns 60 s apart", plan.chat_bfcl_conversations)),
    ] {
        let oracle = crate::parts::one_cache_hit_ratio(convs.iter().map(|(msgs, _, _)| rendered(msgs)), sim.chars_per_token, usize::MAX);
        let conversations = if name == "bfcl-chat" { plan.chat_bfcl_conversations } else { mc_convs };
        eprintln!("bench: chat: {name}: {} requests, {conversations} conversations, oracle {:.1}%", convs.len(), oracle * 100.0);
        workloads.push(ChatWorkload { name: name.into(), requests: convs.len(), conversations, oracle, note });
        let reqs = chat_requests(name, convs, plan.scale_speedup);
        for (chat_key, shards) in std::iter::once(("opening", 0)).chain(statics.iter().copied()) {
            let dep = SimDeployment {
                m: plan.chat_m,
                sim,
                partitions: plan.scale_partitions,
                keying: if shards == 0 { Keying::Adaptive } else { Keying::Static { prefix_chars: 256, shards } },
                max_batch_wait: "5ms",
                llm_max_concurrency: 8,
                extra: vec![("KEYING__CHAT_KEY".into(), chat_key.into()), ("AMQP__MAX_MESSAGE_BYTES".into(), (8 << 20).to_string())],
            };
            let r = attempt(env, "chat", plan.scale_partitions, |run| run_on_sims(env, &http, &dep, &reqs, run)).await?;
            let row = ChatRow {
                workload: name.into(),
                mode: if shards == 0 { "adaptive" } else { "prefix" }.into(),
                chat_key: chat_key.into(),
                shards,
                requests: r.drive.sent,
                ok: r.drive.ok,
                token_hit_ratio: r.token_hit_ratio(),
                prefill_s: r.sim_sum("simulator_prefill_seconds_total"),
                p50_s: r.drive.p50_s * plan.scale_speedup,
                p99_s: r.drive.p99_s * plan.scale_speedup,
                splits: r.splits,
            };
            eprintln!(
                "bench:   {name} {} chat_key={chat_key} shards={shards}: token hits {:.1}% ({:.1}% of oracle) {:?}",
                row.mode,
                row.token_hit_ratio * 100.0,
                row.token_hit_ratio / oracle * 100.0,
                row.splits
            );
            rows.push(row);
        }
    }
    Ok(ChatResults { m: plan.chat_m, speedup: plan.scale_speedup, workloads, rows })
}

// ---------------------------------------------------------------------------------------------
// 6. Hot-key shift
// ---------------------------------------------------------------------------------------------

/// One split-set change of a watched key, from the daemons' logs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeyEvent {
    /// Seconds since the start of the load.
    pub at_s: f64,
    /// `old` or `new` (which hot prefix).
    pub prefix: String,
    /// The split member as logged (`{level}:{key hex}`).
    pub member: String,
    /// The log message (`hot key: splitting`, `dominant key: splitting`, `cool key: merging back`).
    pub what: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShiftResults {
    pub rate_rps: f64,
    pub load_s: f64,
    pub shift_at_s: f64,
    pub requests: usize,
    pub ok: usize,
    pub results: usize,
    pub duplicates: usize,
    pub token_hit_ratio: f64,
    pub p50_s: f64,
    pub p99_s: f64,
    pub peak_backlog: u64,
    pub splits: SplitCounts,
    pub events: Vec<KeyEvent>,
    pub backlog: Vec<(f64, u64)>,
}

/// Seconds of an RFC 3339 UTC timestamp (`2026-11-30T14:50:01.123456Z`) since the Unix epoch.
fn rfc3339_secs(ts: &str) -> Option<f64> {
    let (date, time) = ts.trim_end_matches('Z').split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, mo, da) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (h, mi, s) = (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    // Days from the civil date (Howard Hinnant's days_from_civil).
    let y2 = if mo <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + da - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    Some(days as f64 * 86_400.0 + h * 3600.0 + mi * 60.0 + s)
}

/// Split and merge lines of the daemons' logs that name one of `watched` (level-0 key hex → label).
fn key_events(work: &Path, run: &str, watched: &[(String, &str)], started: SystemTime) -> Vec<KeyEvent> {
    let t0 = started.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir(work) else { return out };
    for f in dir.flatten().filter(|f| f.file_name().to_string_lossy().starts_with(run)) {
        for line in std::fs::read_to_string(f.path()).unwrap_or_default().lines() {
            let Some(what) = ["hot key: splitting", "dominant key: splitting", "cool key: merging back"].into_iter().find(|w| line.contains(w)) else { continue };
            let Some(member) = line.split_whitespace().find_map(|w| w.strip_prefix("key=")) else { continue };
            let Some((_, label)) = watched.iter().find(|(hex, _)| member.starts_with(&format!("0:{hex}"))) else { continue };
            let Some(at) = line.split_whitespace().next().and_then(rfc3339_secs) else { continue };
            out.push(KeyEvent { at_s: at - t0, prefix: (*label).into(), member: member.into(), what: what.into() });
        }
    }
    out.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    out
}

pub async fn part_shift(env: &Env, plan: &Plan, data_dir: &Path) -> anyhow::Result<ShiftResults> {
    let http = reqwest::Client::new();
    std::fs::write(env.work.join("empty.toml"), "")?;
    let (old, mut cold) = data::hot_prefix_prompts(data_dir, plan.hot_cold_groups + 1, plan.seed)?;
    let new = cold.remove(0);
    let (rate, load_s, shift_at) = (plan.shift_rate_rps, plan.shift_load_s, plan.shift_load_s / 2.0);
    let mut rng = fastrand::Rng::with_seed(plan.seed);
    let n = (rate * load_s) as usize;
    let reqs: Vec<Req> = (0..n)
        .map(|i| {
            let t = i as f64 / rate;
            let hot = if t < shift_at { &old } else { &new };
            hot_or_cold_request(&mut rng, plan, hot, &cold, &format!("shift-{i}"), t).0
        })
        .collect();
    let watched = [(PrefixKey::of(prefix_chars(&old[0], 256)).to_string(), "old"), (PrefixKey::of(prefix_chars(&new[0], 256)).to_string(), "new")];
    eprintln!("bench: hot-key shift: {n} requests at {rate} req/s over {load_s} s, the hot prefix changes at {shift_at} s");
    let dep = SimDeployment { m: plan.hot_instances, sim: &plan.hot_sim, partitions: 32, keying: Keying::Adaptive, max_batch_wait: "50ms", llm_max_concurrency: plan.hot_sim.max_concurrency, extra: Vec::new() };
    let mut run_name = String::new();
    let r = attempt(env, "shift", 32, |run| {
        run_name.clone_from(&run);
        run_on_sims(env, &http, &dep, &reqs, run)
    })
    .await?;
    let events = key_events(&env.work, &run_name, &watched, r.started);
    let res = ShiftResults {
        rate_rps: rate,
        load_s,
        shift_at_s: shift_at,
        requests: r.drive.sent,
        ok: r.drive.ok,
        results: r.drive.results,
        duplicates: r.drive.duplicates,
        token_hit_ratio: r.token_hit_ratio(),
        p50_s: r.drive.p50_s,
        p99_s: r.drive.p99_s,
        peak_backlog: r.drive.backlog.iter().map(|b| b.1).max().unwrap_or(0),
        splits: r.splits,
        events,
        backlog: r.drive.backlog.clone(),
    };
    eprintln!("bench:   shift: ok {}/{} duplicates {} hits {:.1}% {:?} events {:?}", res.ok, res.requests, res.duplicates, res.token_hit_ratio * 100.0, res.splits, res.events);
    Ok(res)
}
