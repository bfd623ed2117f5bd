//! `bench/REPORT.md` from the results of one invocation (`bench/results.json`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::parts::{cache_stat, CacheResults, HotResults, OverheadResults, Plan, ScaleResults};
use crate::procs::{median, Machine};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub plan: Plan,
    pub command: String,
    pub started_utc: String,
    pub duration_s: f64,
    pub machine: Machine,
    pub daemon_version: String,
    pub cache: Option<CacheResults>,
    pub scale: Option<ScaleResults>,
    pub overhead: Option<OverheadResults>,
    pub hot: Option<HotResults>,
    #[serde(default)]
    pub chat: Option<crate::chat::ChatResults>,
    #[serde(default)]
    pub shift: Option<crate::chat::ShiftResults>,
    #[serde(default)]
    pub peers: Option<crate::peers::PeersResults>,
    #[serde(default)]
    pub peers_llama: Option<crate::peers::LlamaPeers>,
    /// Seconds of the last invocation alone (`duration_s` sums the merged ones).
    #[serde(default)]
    pub this_run_s: f64,
    /// Parts kept from earlier invocations, with the mode they were measured in.
    #[serde(default)]
    pub kept: Vec<(String, String)>,
    /// The plan each part was measured with, by part name (`plan` is the last command's): a
    /// merge can keep parts measured in another mode than the one it runs.
    #[serde(default)]
    pub part_plans: BTreeMap<String, Plan>,
}

impl Results {
    /// The plan `part` was measured with: its own entry, else the run's (results written before
    /// parts kept their plans, whose merges never mixed the sizes of a part's plan).
    pub fn plan_of(&self, part: &str) -> &Plan {
        self.part_plans.get(part).unwrap_or(&self.plan)
    }
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1} %", x * 100.0)
    } else {
        "–".into()
    }
}

fn num(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "–".into()
    }
}

/// The systems of an overhead run.
fn overhead_systems(o: &OverheadResults) -> usize {
    o.reps.iter().map(|r| r.system.as_str()).collect::<std::collections::BTreeSet<_>>().len().max(1)
}

/// The latency windows' rate, for the summary table: the whole rate, or each system's share when
/// the systems ran at the same time.
fn latency_rate(o: &OverheadResults, rate: f64) -> String {
    if o.latency_simultaneous {
        format!("{} req/s each, all systems at once", num(rate / overhead_systems(o) as f64, 0))
    } else {
        format!("{} req/s", num(rate, 0))
    }
}

/// How the overhead part measured latency, and why (since the run of 6 December 2026 every
/// system at the same time).
fn latency_method(o: &OverheadResults, rate: f64, secs: f64) -> String {
    if !o.latency_simultaneous {
        return format!("Latency: {} req/s for {} s, one system after the other, each after its burst", num(rate, 0), secs);
    }
    let n = overhead_systems(o);
    format!(
        "Latency: after a repetition's bursts, all {n} systems at the same time, each at {} req/s for {} s ({} req/s in all: the \
         broker's load and each system's number of requests are those of one {} s window per system). The quorum queues commit by \
         fsync, and this machine's disk stalls an fsync for tens of milliseconds every few seconds (idle, 10 s of 4 kB writes: fsync \
         p50 0.4 ms, p99.9 46 ms); a stall holds up every request in flight. When each system had a window of its own, its p99 \
         depended on whether a stall fell into that window (in 6 windows each, the bare pass-through's p99 ranged 2.7–137 ms, the \
         two daemon deployments' 6.4–265 ms). Run together, the systems meet the same stalls",
        num(rate / n as f64, 0),
        num(secs * n as f64, 0),
        num(rate, 0),
        secs
    )
}

/// Median over the repetitions of `f(system a) − f(system b)` in the same repetition (the
/// latency windows of one repetition run at the same time, so each difference compares requests
/// that met the same broker stalls); NaN when no repetition has both.
fn paired_median(o: &OverheadResults, a: &str, b: &str, f: fn(&crate::parts::OverheadRep) -> f64) -> f64 {
    let diffs: Vec<f64> = o
        .reps
        .iter()
        .filter(|x| x.system == a)
        .filter_map(|x| o.reps.iter().find(|y| y.system == b && y.rep == x.rep).map(|y| f(x) - f(y)))
        .collect();
    if diffs.is_empty() {
        f64::NAN
    } else {
        median(&diffs)
    }
}

/// Overhead medians: (throughput, p50, p99, cpu/1000) of one system.
pub fn overhead_medians(o: &OverheadResults, system: &str) -> (f64, f64, f64, f64) {
    let reps: Vec<_> = o.reps.iter().filter(|r| r.system == system).collect();
    let m = |f: &dyn Fn(&&crate::parts::OverheadRep) -> f64| median(&reps.iter().map(f).collect::<Vec<_>>());
    (m(&|r| r.throughput_rps), m(&|r| r.p50_s), m(&|r| r.p99_s), m(&|r| r.cpu_s_per_1000))
}

/// Renders REPORT.md. Longer than 80 lines on purpose: it writes the report's Markdown in
/// reading order, so the code and the document it produces follow the same sequence.
pub fn render(r: &Results, plots: &[(&str, &str)]) -> String {
    let mut s = String::new();
    let p = r.plan_of("overhead");
    let _ = writeln!(s, "# prefix-batcher benchmarks\n");
    let _ = writeln!(s, "{} Raw numbers: [`results.json`](results.json). How to run and what each part does: [`README.md`](README.md).\n", header(r));
    let m = &r.machine;
    let _ = writeln!(s, "**Machine**: {} cores (`nproc`), {} ({} RAM), RabbitMQ {}, daemon {}.  ", m.nproc, m.cpu_model, m.mem_total, m.rabbitmq, r.daemon_version);
    let _ = writeln!(s, "**Load** (`uptime`) at start: `{}`; at end: `{}`.  ", m.load_start, m.load_end);
    let _ = writeln!(
        s,
        "The machine was shared with other engineers' builds and tests during the run, so wall times and latencies are noisy; \
         hit ratios and purity are not timing-sensitive.\n"
    );

    // ------------------------------------------------------------------ headline
    let _ = writeln!(s, "## Headline\n");
    let _ = writeln!(s, "| measurement | keyed | off (unkeyed) | oracle | keyed ÷ oracle |");
    let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: |");
    if let Some(c) = &r.cache {
        let reps = cache_reps(c);
        for d in &c.datasets {
            let get = |mode: &str| cache_stat(&c.rows, &d.sample.dataset, "small", mode, |x| x.cached_ratio).map(|(m, _, _)| m);
            if let (Some(k), Some(o)) = (get("keyed"), get("off")) {
                let _ = writeln!(
                    s,
                    "| {} on llama-server, small cache: cached prompt tokens{} | {} | {} | {} | {} |",
                    d.sample.dataset,
                    if reps > 1 { format!(" (median of {reps})") } else { String::new() },
                    pct(k),
                    pct(o),
                    pct(d.oracle),
                    pct(k / d.oracle)
                );
            }
        }
    }
    if let Some(sc) = &r.scale {
        let max_m = sc.rows.iter().map(|x| x.m).max().unwrap_or(0);
        let k = sc.rows.iter().find(|x| x.m == max_m && x.mode == "keyed");
        let o = sc.rows.iter().find(|x| x.m == max_m && x.mode == "off");
        if let (Some(k), Some(o)) = (k, o) {
            let _ = writeln!(
                s,
                "| Mooncake on {max_m} simulated vLLM servers: block hit ratio | {} | {} | {} | {} |",
                pct(k.block_hit_ratio),
                pct(o.block_hit_ratio),
                pct(sc.oracle_sample_16),
                pct(k.block_hit_ratio / sc.oracle_sample_16)
            );
            let _ = writeln!(
                s,
                "| same: simulated GPU-seconds (prefill) | {} ({}) | {} ({}) | | |",
                num(k.gpu_s, 0),
                num(k.prefill_s, 0),
                num(o.gpu_s, 0),
                num(o.prefill_s, 0)
            );
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "| measurement | result |");
    let _ = writeln!(s, "| --- | --- |");
    if let Some(o) = &r.overhead {
        let (dt, dp50, dp99, dcpu) = overhead_medians(o, "daemon");
        let (pt, pp50, pp99, pcpu) = overhead_medians(o, "pass-through");
        let _ = writeln!(
            s,
            "| overhead, instant LLM: max throughput (median of {}) | daemon {} req/s vs pass-through {} req/s: ratio **{}** |",
            p.overhead_reps,
            num(dt, 0),
            num(pt, 0),
            num(dt / pt, 2)
        );
        let _ = writeln!(
            s,
            "| overhead: end-to-end latency p50 / p99 at {} | daemon {} / {} ms (`max_batch_wait` 10 ms), {} / {} ms (1 ms) vs pass-through {} / {} ms |",
            latency_rate(o, p.overhead_rate),
            num(dp50 * 1e3, 1),
            num(dp99 * 1e3, 1),
            num(overhead_medians(o, crate::parts::DAEMON_1MS).1 * 1e3, 1),
            num(overhead_medians(o, crate::parts::DAEMON_1MS).2 * 1e3, 1),
            num(pp50 * 1e3, 1),
            num(pp99 * 1e3, 1)
        );
        let _ = writeln!(
            s,
            "| overhead: CPU per 1,000 requests, peak RSS | daemon {} s, {} MiB vs pass-through {} s, {} MiB |",
            num(dcpu, 2),
            num(o.rss_kb.get("daemon").copied().unwrap_or(0) as f64 / 1024.0, 0),
            num(pcpu, 2),
            num(o.rss_kb.get("pass-through").copied().unwrap_or(0) as f64 / 1024.0, 0)
        );
    }
    if let Some(h) = &r.hot {
        let cell = |x: &crate::parts::HotRow| format!("{}: peak {} / at load end {} / hits {}", x.label(), x.peak_backlog, x.end_backlog, pct(x.hit_ratio));
        let _ = writeln!(s, "| hot prefix (sine load, slow servers): backlog | {} |", h.rows.iter().map(cell).collect::<Vec<_>>().join("; "));
    }
    let _ = writeln!(s);

    // ------------------------------------------------------------------ 1
    let p = r.plan_of("cache");
    if let Some(c) = r.cache.as_ref().filter(|c| cache_reps(c) > 1) {
        render_cache_reps(&mut s, c, p, plots);
    } else if let Some(c) = &r.cache {
        let _ = writeln!(s, "## 1. Cache effect on a real llama-server\n");
        let _ = writeln!(
            s,
            "Two daemon instances, each with its own llama-server (llama.cpp, {} on CPU, `-np 2 --threads 1`), \
             16 partitions, 1 shard per key, `prefix_chars = 256`, `max_batch_size = 8`, `max_batch_wait = 1s`, `llm.max_concurrency = 1`, \
             `max_tokens = {}`, temperature 0. All requests of a sample are published at once in a random order. \
             Fresh llama-servers for every run, so no run inherits a cache. {}.\n",
            model(c), p.cache_max_tokens, c.list_prompts
        );
        let _ = writeln!(
            s,
            "- **small cache**: `--cache-ram 0` (the `scripts/llm-server` default): only the 2 slots' own KV, like a busy GPU server.\n\
             - **host cache**: `--cache-ram 8192`, which is this llama-server build's default (`{}`): prompts are also kept in an 8 GiB host-RAM cache.\n\
             - **oracle**: token-level, from llama-server's own tokenizer and chat template: each prompt reuses its longest common token prefix with \
             any earlier prompt of the sample (at most all but its last token).\n",
            c.cache_ram_help.split_whitespace().collect::<Vec<_>>().join(" ")
        );
        oracle_table(&mut s, c);
        let _ = writeln!(s, "| dataset | cache | mode | cached tokens | ÷ oracle | wall s | p50 s | p99 s | mean batch purity | batches | ok / requests |");
        let _ = writeln!(s, "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for row in &c.rows {
            let oracle = c.datasets.iter().find(|d| d.sample.dataset == row.dataset).map(|d| d.oracle).unwrap_or(f64::NAN);
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {}{} |",
                row.dataset,
                row.cache,
                row.mode,
                pct(row.cached_ratio),
                pct(row.cached_ratio / oracle),
                num(row.wall_s, 1),
                num(row.p50_s, 1),
                num(row.p99_s, 1),
                num(row.purity, 2),
                row.batches,
                row.ok,
                row.requests,
                if row.usage_missing > 0 { format!(" ({} without usage)", row.usage_missing) } else { String::new() }
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "Speed-up of keyed over off (wall time off ÷ keyed):\n");
        let _ = writeln!(s, "| dataset | small cache | host cache |");
        let _ = writeln!(s, "| --- | ---: | ---: |");
        for d in &c.datasets {
            let sp = |cache: &str| {
                let k = c.rows.iter().find(|x| x.dataset == d.sample.dataset && x.cache == cache && x.mode == "keyed");
                let o = c.rows.iter().find(|x| x.dataset == d.sample.dataset && x.cache == cache && x.mode == "off");
                match (k, o) {
                    (Some(k), Some(o)) => format!("{:.2}×", o.wall_s / k.wall_s),
                    _ => "–".into(),
                }
            };
            let _ = writeln!(s, "| {} | {} | {} |", d.sample.dataset, sp("small"), sp("host"));
        }
        let _ = writeln!(s);
        if let Some((_, f)) = plots.iter().find(|(k, _)| *k == "cache") {
            let _ = writeln!(s, "![cached ratio per dataset]({f})\n");
        }
    }

    // ------------------------------------------------------------------ 2
    let p = r.plan_of("scale");
    if let Some(sc) = &r.scale {
        let sim = &p.scale_sim;
        let _ = writeln!(s, "## 2. Cache effect at scale: Mooncake replay on the LLM simulator\n");
        let _ = writeln!(
            s,
            "The Mooncake conversation trace ({} requests, oracle block hit ratio **{}** over 512-token blocks, as published) is replayed \
             through M daemon instances, each with one simulator (`llm-fakes simulate`: vLLM automatic prefix caching model: 16-token blocks hashed in a chain, \
             {} characters per token, LRU at {} blocks = {} tokens per server, prefill {} ms per uncached token, decode {} ms per output token, \
             {} concurrent request(s) per server). Each hash id is rendered as a deterministic text block of 512 tokens ({} characters); \
             `max_tokens` is the trace's output length. Timestamps are honoured with a speed-up of {}× (the simulator divides its service times \
             by the same factor, so queueing is as in real time; times below are trace seconds).\n",
            sc.trace_requests,
            pct(sc.oracle_trace_512),
            sim.chars_per_token,
            sim.capacity_blocks,
            sim.capacity_blocks * 16,
            sim.prefill_ms_per_token,
            sim.decode_ms_per_token,
            sim.max_concurrency,
            512 * sim.chars_per_token,
            p.scale_speedup
        );
        if p.scale_keep_one_in > 1 {
            let _ = writeln!(
                s,
                "Quick mode replays whole conversations only: the {} requests (1 in {} conversations, by the conversation's second block id) \
                 spanning {:.0} s. Cache and slots per server are scaled down by the same factor. Its oracle is {} over 512-token blocks and \
                 **{}** over 16-token blocks (the simulator's unit, the yardstick below).\n",
                sc.sample_requests,
                p.scale_keep_one_in,
                sc.sample_span_s,
                pct(sc.oracle_sample_512),
                pct(sc.oracle_sample_16)
            );
        } else {
            let _ = writeln!(s, "Oracle over the simulator's 16-token blocks: **{}**.\n", pct(sc.oracle_sample_16));
        }
        let _ = writeln!(
            s,
            "Daemons: {} partitions, `max_batch_size = 8`, `max_batch_wait = 5ms` (= {:.1} trace seconds at this speed-up), \
             `llm.max_concurrency = 8`. Mode `keyed`: the defaults (adaptive key levels, `prefix_chars = 256`). Mode `static` (the \
             key-length comparison): `keying.mode = \"prefix\"`, 1 shard per key, key = the first N blocks' worth of characters \
             (the report's reference is {} blocks = {} chars).\n",
            p.scale_partitions,
            0.005 * p.scale_speedup,
            p.scale_key_blocks,
            p.scale_key_blocks * 512 * sim.chars_per_token
        );
        let _ = writeln!(s, "| M | mode | key blocks | block hits | ÷ oracle | token hits | GPU-s | prefill GPU-s | span s | p50 s | p99 s | peak backlog | splits | ok / requests |");
        let _ = writeln!(s, "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |");
        for row in &sc.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
                row.m,
                row.mode,
                match row.mode.as_str() {
                    "static" => row.key_blocks.to_string(),
                    "keyed" => "adaptive".into(),
                    _ => "–".into(),
                },
                pct(row.block_hit_ratio),
                pct(row.block_hit_ratio / sc.oracle_sample_16),
                pct(row.token_hit_ratio),
                num(row.gpu_s, 0),
                num(row.prefill_s, 0),
                num(row.span_s, 0),
                num(row.p50_s, 1),
                num(row.p99_s, 1),
                row.peak_backlog,
                splits_cell(&row.splits),
                row.ok,
                row.requests
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "Reading it: each server has a fixed cache, so M servers have M times the cache. Keyed routing sends every turn of a \
             conversation to the same server, so the servers hold disjoint working sets and together behave like one cache M times \
             larger: the hit ratio climbs towards the oracle as M grows. Off (random partitions) makes every server cache a random \
             slice of every conversation, so adding servers adds no useful cache, and a conversation's next turn usually lands on a \
             server that never saw its history. Hits turn into prefill GPU-seconds saved, and so into less queueing when servers are busy.\n"
        );
        let _ = writeln!(
            s,
            "**Routing model** (same replay without broker or clock: the daemon's own key, partition and rendezvous functions and one \
             simulator cache model per instance, requests in trace order), block hit ratio. The last three columns put every \
             request through one cache as large as the M servers' caches together: with the servers' LRU eviction (the capacity \
             ceiling of routing over LRU servers), with that LRU admitting only the blocks that a later request looks up, and with \
             optimal eviction (Belady's rule: drop the block used again furthest in the future; every cached block a look-up finds \
             counts, so this bounds every eviction policy and every routing over that much cache). Routing only decides which \
             of the M caches a request meets; M caches split by routing could beat one shared LRU only by keeping blocks that are \
             never used again out of the caches that hold the reused ones, which a router cannot know when the request arrives, and \
             no routing tried here gets more than a few tenths of a point above the LRU column (partitions that happen to hold \
             fewer one-off blocks). The oracle (an unbounded cache) is above it whenever the servers' LRU \
             evicts blocks that are used again:\n"
        );
        let kbs: Vec<usize> = {
            let mut v: Vec<usize> = sc.offline.iter().filter(|x| x.mode == "keyed").map(|x| x.key_blocks).collect();
            v.sort();
            v.dedup();
            v
        };
        let _ = write!(s, "| M | off |");
        for kb in &kbs {
            let _ = write!(s, " keyed, {kb}-block key |");
        }
        let _ = writeln!(s, " one cache of M × capacity, LRU | same, LRU admitting only reused blocks | same, optimal eviction |");
        let _ = writeln!(s, "| ---: | ---: |{} ---: | ---: | ---: |", " ---: |".repeat(kbs.len()));
        let mut ms: Vec<usize> = sc.offline.iter().map(|x| x.m).collect();
        ms.sort();
        ms.dedup();
        for m in &ms {
            let get = |mode: &str, kb: usize| sc.offline.iter().find(|x| x.m == *m && x.mode == mode && x.key_blocks == kb).map(|x| pct(x.block_hit_ratio)).unwrap_or_default();
            let _ = write!(s, "| {m} | {} |", get("off", 0));
            for kb in &kbs {
                let _ = write!(s, " {} |", get("keyed", *kb));
            }
            let _ = writeln!(s, " {} | {} | {} |", get("pooled", 0), get("pooled-admit-reused", 0), get("pooled-optimal", 0));
        }
        let _ = writeln!(s);
        if sc.never_reused_blocks > 0 {
            let _ = writeln!(
                s,
                "Where the LRU's loss comes from: {} of the sample's {} distinct blocks are cached once and never looked up again, and {} of \
                 those belong to conversations of a single request ({} of the {} conversations). Such a request looks like the first \
                 turn of any conversation when it arrives, so no router can tell which blocks to keep out; a server that did not \
                 cache them would reach the \"admitting only reused blocks\" column.\n",
                sc.never_reused_blocks,
                sc.distinct_blocks,
                pct(sc.never_reused_single_request as f64 / sc.never_reused_blocks as f64),
                sc.single_request_conversations,
                sc.conversations
            );
        }
        // Which key length is best, from the measured sweep and the model.
        let sweep: Vec<_> = sc.rows.iter().filter(|x| x.mode == "static" && x.m == p.scale_sweep_m).collect();
        if let Some(best) = sweep.iter().max_by(|a, b| a.block_hit_ratio.total_cmp(&b.block_hit_ratio)) {
            let mut sweep = sweep.clone();
            sweep.sort_by_key(|x| x.key_blocks);
            let list = sweep.iter().map(|x| format!("{} block(s) {}", x.key_blocks, pct(x.block_hit_ratio))).collect::<Vec<_>>().join(", ");
            let max_m = ms.iter().copied().max().unwrap_or(1);
            let model: Vec<_> = sc.offline.iter().filter(|x| x.m == max_m && x.mode == "keyed").collect();
            let model_list = model.iter().map(|x| format!("{} {}", x.key_blocks, pct(x.block_hit_ratio))).collect::<Vec<_>>().join(", ");
            let model_best = model.iter().max_by(|a, b| a.block_hit_ratio.total_cmp(&b.block_hit_ratio)).map(|x| x.key_blocks).unwrap_or(0);
            let _ = writeln!(
                s,
                "**Prefix-key length.** Measured at M = {}: {list}. Routing model at M = {max_m}, by key blocks: {model_list}. \
                 Best measured: **{} block(s)**; best in the model: {model_best}. Why: every conversation of this trace starts with the \
                 same block 0 (a shared system prompt), so a 1-block key puts all traffic on one key — one partition, one server (with \
                 1 shard per key): the other servers idle, that one is overloaded and its cache thrashed, no better than M = 1. Two \
                 blocks reach the first block that is specific to a conversation, so each conversation sticks to one server and its \
                 later turns hit its cached history. Longer keys gain nothing for long prompts and cost a little on short ones: when a \
                 first turn is shorter than the key, its unique tail becomes part of the key, so the next turn of that conversation \
                 (which extends the prompt) gets another key and usually another server. The right length is the shortest one that \
                 reaches past the prefix every request shares.\n",
                p.scale_sweep_m,
                best.key_blocks
            );
        }
        render_scale_adaptive(&mut s, sc, p);
        for (k, alt) in [("scale_hits", "hit ratio vs M"), ("scale_backlog", "Mooncake backlog over time")] {
            if let Some((_, f)) = plots.iter().find(|(n, _)| *n == k) {
                let _ = writeln!(s, "![{alt}]({f})\n");
            }
        }
    }

    // ------------------------------------------------------------------ 3
    let p = r.plan_of("overhead");
    if let Some(o) = &r.overhead {
        let (dt, dp50, dp99, dcpu) = overhead_medians(o, "daemon");
        let (pt, pp50, pp99, pcpu) = overhead_medians(o, "pass-through");
        let _ = writeln!(s, "## 3. Overhead\n");
        let _ = writeln!(
            s,
            "Instant LLM: the simulator (`llm-fakes simulate`) with zero prefill and decode cost (answers as soon as it has hashed the prompt). \
             The fake LLM (`llm-fakes fake`) is not used because its cache model compares each prompt with every earlier one: it gets \
             slower as a run goes on (a first quick run measured the daemon behind it at 1862, 615, then 387 req/s in three \
             consecutive bursts). **daemon**: one instance, 16 partitions, adaptive keying (the default), \
             `max_batch_size = 8`, `max_batch_wait = 10ms`, `llm.max_concurrency = 4`; a second deployment with `max_batch_wait = 1ms` \
             (the smallest valid wait) separates the pipeline's own latency from the batching wait (the default 1 s wait adds up to \
             1 s at low per-key rates). **pass-through**: the minimal consumer in \
             `bench/src/passthrough.rs`: input queue → confirmed publish through a direct exchange to one quorum single-active-consumer \
             queue → ack; that queue → confirmed publish of a small result to `reply_to` → ack; no parsing, keying, batching or LLM call; \
             one connection. **pass-through, 2 connections**: the same, with its publishes on a second connection as the daemon's are \
             (RabbitMQ blocks publishing connections under an alarm, so consumers and acks get their own; each lapin connection \
             has its own I/O thread). **pass-through, 2 connections, LLM call**: the same, and hop 2 calls the instant LLM once per \
             message (`POST /v1/completions`, no batching) and publishes its text: a competing consumer that does the daemon's job \
             without keying, batching or leases. \
             Same broker, same quorum queues, same prefetch (256 / 64), publisher confirms on every hop. Requests are BIG-Bench-Hard \
             prompts of all tasks (mean {:.0} bytes). Throughput: {} requests published at once, results counted until the last one \
             (requests/s = results ÷ time from first publish to last result). {}; latency is end to end (publish → result \
             received). CPU: the on-CPU time of the process's threads (`/proc/PID/task/*/schedstat`, nanoseconds) during the \
             throughput run ÷ requests × 1000. {} repetitions, rotating which system goes first; medians. Where the daemon's CPU \
             goes, from a profile of this part: [`PROFILE.md`](PROFILE.md).\n",
            o.body_bytes_mean,
            p.overhead_burst,
            latency_method(o, p.overhead_rate, p.overhead_secs),
            p.overhead_reps
        );
        let _ = writeln!(s, "| system | throughput req/s | p50 ms | p99 ms | CPU s / 1000 req | peak RSS MiB |");
        let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: | ---: |");
        for name in [crate::parts::DAEMON, crate::parts::DAEMON_1MS, crate::parts::PASS, crate::parts::PASS_2CONN, crate::parts::PASS_LLM] {
            if !o.reps.iter().any(|x| x.system == name) {
                continue;
            }
            let (t, p50, p99, cpu) = overhead_medians(o, name);
            let label = match name {
                crate::parts::DAEMON => "daemon (`max_batch_wait = 10ms`)".to_owned(),
                crate::parts::DAEMON_1MS => "daemon (`max_batch_wait = 1ms`)".to_owned(),
                other => other.to_owned(),
            };
            let _ = writeln!(
                s,
                "| {label} | {} | {} | {} | {} | {} |",
                num(t, 0),
                num(p50 * 1e3, 1),
                num(p99 * 1e3, 1),
                num(cpu, 3),
                num(o.rss_kb.get(name).copied().unwrap_or(0) as f64 / 1024.0, 1)
            );
        }
        let _ = writeln!(
            s,
            "\n**Ratio** daemon ÷ pass-through: throughput **{}**, CPU per request {}, added latency p50 {} ms, p99 {} ms.\n",
            num(dt / pt, 2),
            num(dcpu / pcpu, 2),
            num((dp50 - pp50) * 1e3, 1),
            num((dp99 - pp99) * 1e3, 1)
        );
        let _ = writeln!(
            s,
            "Against each baseline (throughput and CPU: the 10 ms deployment, ratio of the medians; added latency: the 1 ms deployment, \
             less its 1 ms wait, the median over the repetitions of its difference to the baseline in the same repetition):\n"
        );
        let _ = writeln!(s, "| baseline | throughput ratio | CPU per request ratio | added p50 ms | added p99 ms |");
        let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: |");
        for name in [crate::parts::PASS, crate::parts::PASS_2CONN, crate::parts::PASS_LLM] {
            if !o.reps.iter().any(|x| x.system == name) {
                continue;
            }
            let (bt, _, _, bcpu) = overhead_medians(o, name);
            let _ = writeln!(
                s,
                "| {name} | {} | {} | {} | {} |",
                num(dt / bt, 2),
                num(dcpu / bcpu, 2),
                num(paired_median(o, crate::parts::DAEMON_1MS, name, |x| x.p50_s) * 1e3 - 1.0, 1),
                num(paired_median(o, crate::parts::DAEMON_1MS, name, |x| x.p99_s) * 1e3 - 1.0, 1)
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "Every repetition (LLM CPU: the instant LLM's own CPU during the burst):\n\n| rep | system | throughput req/s | CPU s / 1000 | LLM CPU s / 1000 | p50 ms | p99 ms | ok / requests |");
        let _ = writeln!(s, "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
        for x in &o.reps {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} / {} |",
                x.rep,
                x.system,
                num(x.throughput_rps, 0),
                num(x.cpu_s_per_1000, 3),
                num(x.llm_cpu_s_per_1000, 3),
                num(x.p50_s * 1e3, 1),
                num(x.p99_s * 1e3, 1),
                x.ok,
                x.requests
            );
        }
        let _ = writeln!(s);
    }

    // ------------------------------------------------------------------ 4
    let p = r.plan_of("hot");
    if let Some(h) = &r.hot {
        let sim = &p.hot_sim;
        let _ = writeln!(s, "## 4. Hot prefix\n");
        let _ = writeln!(
            s,
            "A sine-shaped load: rate = {} × (5 + 35 × (1 − cos 2πt/T) / 2) requests/s with T = {} s, {} cycle(s) ({} requests, 1 unit = {} req/s \
             on this machine); {:.0} % of the requests ({}) carry one BIG-Bench-Hard few-shot header (the hot prefix), the rest one of {} other \
             headers; questions are the tasks' real ones. {} daemon instances, 32 partitions, keyed (`prefix_chars = 256`), \
             `max_batch_size = 8`, `max_batch_wait = 50ms`, each with one slow simulated server: {} concurrent requests, prefill {} ms per \
             uncached token, decode {} ms per token, `max_tokens = {}` (≈ {:.0} req/s per server when the header is cached), real time. \
             Backlog = requests published but not yet answered (queued, buffered in the daemon, or at the server).\n",
            p.hot_unit_rps,
            p.hot_period_s,
            p.hot_cycles,
            h.requests,
            p.hot_unit_rps,
            p.hot_share * 100.0,
            h.hot_requests,
            p.hot_cold_groups,
            p.hot_instances,
            sim.max_concurrency,
            sim.prefill_ms_per_token,
            sim.decode_ms_per_token,
            p.hot_max_tokens,
            sim.max_concurrency as f64 / (p.hot_max_tokens as f64 * sim.decode_ms_per_token / 1000.0 + 60.0 * sim.prefill_ms_per_token / 1000.0)
        );
        let _ = writeln!(s, "| keying | peak backlog | at s | backlog at load end | drained after s | token hit ratio | p50 s | p99 s | splits | ok / requests |");
        let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |");
        for x in &h.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
                x.label(),
                x.peak_backlog,
                num(x.peak_at_s, 0),
                x.end_backlog,
                num(x.drained_after_s, 1),
                pct(x.hit_ratio),
                num(x.p50_s, 2),
                num(x.p99_s, 2),
                splits_cell(&x.splits),
                x.ok,
                x.requests
            );
        }
        let _ = writeln!(s);
        render_hot_reading(&mut s, h);
        if let Some((_, f)) = plots.iter().find(|(k, _)| *k == "hot") {
            let _ = writeln!(s, "![hot prefix backlog]({f})\n");
        }
    }
    if let Some(c) = &r.chat {
        render_chat(&mut s, c, r.plan_of("chat"));
    }
    if let Some(sh) = &r.shift {
        render_shift(&mut s, sh, r.plan_of("shift"));
    }
    if let Some(pe) = &r.peers {
        render_peers(&mut s, pe, r.plan_of("peers"), plots);
    }
    if let Some(pl) = &r.peers_llama {
        render_peers_llama(&mut s, pl);
    }
    let _ = writeln!(s, "## Caveats\n");
    // Part 1 in medium mode: run by this command, or kept from an earlier medium one.
    let medium_cache = r.cache.as_ref().filter(|_| r.plan_of("cache").mode == "medium" || r.kept.iter().any(|(part, mode)| part == "cache" && mode == "medium"));
    if let Some(c) = medium_cache {
        let _ = writeln!(
            s,
            "- Medium mode: part 1 and the real llama-server comparison use {} prompts per dataset and {} repetitions (medians, spread in \
             brackets); the simulator parts carry the sample sizes of the mode that ran them (header). \
             Keyed routing sends each prefix to the same server every run (same keys, same partitions, same instance names), so its \
             cached ratio moves only by a few points (which requests share a batch depends on timing); `off` picks partitions at random \
             and the router's choices depend on timing, so their spreads are wider.",
            c.rows.first().map_or(0, |x| x.requests),
            cache_reps(c)
        );
    } else {
        let _ = writeln!(
            s,
            "- Quick mode uses small samples on the real server (it prefills roughly 100–250 tokens/s per core here), so part 1's ratios are from \
             tens of prompts and one run each, not medians; medium mode (`bench/run --medium`) and full mode (`bench/run --full`) use larger \
             samples. Keyed routing is the same every run (same keys, same partitions, same instance names; which requests share a batch \
             depends on timing), but `off` picks partitions at random, so its cached ratio and wall time change from run to run by tens of points on such small samples; read \
             part 1's `off` column as one draw."
        );
    }
    let _ = writeln!(
        s,
        "- The simulator is a model, not vLLM: slots do not slow each other down, running requests' blocks can be evicted, and its \
         GPU-seconds are slot-seconds. It is calibrated to nothing; compare keyed and off with each other, not with a real GPU.\n\
         - Latencies in part 2 are wall time × speed-up, so the daemon's own few milliseconds are magnified by the speed-up.\n"
    );
    s
}

/// The header's first paragraph: the command(s) that made the results, the mode, seed, start and
/// own time of the last one, and, when results were merged, the commands' summed time and which
/// parts were kept from which mode.
fn header(r: &Results) -> String {
    let p = &r.plan;
    let commands = r.command.split(", then ").count();
    if commands <= 1 && r.kept.is_empty() {
        return format!(
            "Generated by `{}` ({} mode, seed {}), started {} UTC, in {:.1} minutes. Every comparison below was measured in this one run, side by side.",
            r.command,
            p.mode,
            p.seed,
            r.started_utc,
            r.duration_s / 60.0
        );
    }
    let mut by_mode: Vec<(String, Vec<String>)> = Vec::new();
    for (part, mode) in &r.kept {
        match by_mode.iter_mut().find(|(m, _)| m == mode) {
            Some((_, ps)) => ps.push(part.clone()),
            None => by_mode.push((mode.clone(), vec![part.clone()])),
        }
    }
    let kept = if by_mode.is_empty() {
        String::new()
    } else {
        format!(" Kept from the earlier commands: {}.", by_mode.iter().map(|(m, ps)| format!("{} in {m} mode", ps.join(", "))).collect::<Vec<_>>().join("; "))
    };
    // Results from before `this_run_s` was recorded give only the sum.
    let last = if r.this_run_s > 0.0 { format!(" and took {:.1} minutes on its own", r.this_run_s / 60.0) } else { String::new() };
    format!(
        "Generated by {commands} commands, each merging its parts into the results of the ones before: `{}`. \
         The last of them ran in {} mode (seed {}), started {} UTC{last}; the {commands} commands' own times add up to {:.1} minutes.{kept} \
         Every comparison below was measured side by side within one of these commands.",
        r.command,
        p.mode,
        p.seed,
        r.started_utc,
        r.duration_s / 60.0
    )
}

/// The model of results measured before results.json recorded it ([`CacheResults::model`]): the
/// file `scripts/llm-server` served on the machine they were measured on (a CPU with AVX-VNNI,
/// so the packaged Q4_1 file rather than its F16 conversion).
const MODEL_UNRECORDED: &str = "SmolLM2-135M-Instruct Q4_1";

/// The llama-servers' model for the report.
fn model(c: &CacheResults) -> &str {
    c.model.as_deref().unwrap_or(MODEL_UNRECORDED)
}

/// Part 1's table of samples and their token-level oracles, then a blank line.
fn oracle_table(s: &mut String, c: &CacheResults) {
    let _ = writeln!(s, "| dataset | sample | prompt tokens | oracle |");
    let _ = writeln!(s, "| --- | --- | ---: | ---: |");
    for d in &c.datasets {
        let _ = writeln!(s, "| {} | {} | {} | {} |", d.sample.dataset, d.sample.note, d.tokens, pct(d.oracle));
    }
    let _ = writeln!(s);
}

/// Repetitions of part 1 (1 in quick and full mode).
fn cache_reps(c: &CacheResults) -> usize {
    c.rows.iter().map(|x| x.rep).max().map_or(0, |r| r + 1)
}

/// "median (min–max)" of a measure, formatted by `f`.
fn spread(v: &[f64], f: impl Fn(f64) -> String) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if v.len() < 2 {
        return f(median(v));
    }
    format!("{} ({}–{})", f(median(v)), f(lo), f(hi))
}

/// Part 1 with repetitions (medium mode): the keyed and off runs of part 7's real-server
/// comparison, per dataset, medians and spreads, then every repetition.
fn render_cache_reps(s: &mut String, c: &CacheResults, p: &Plan, plots: &[(&str, &str)]) {
    let reps = cache_reps(c);
    let _ = writeln!(s, "## 1. Cache effect on a real llama-server\n");
    let _ = writeln!(
        s,
        "Two daemon instances, each with its own llama-server (llama.cpp, {} on CPU, `-np 2 --threads 1 --cache-ram 0`), \
         16 partitions, 1 shard per key, `prefix_chars = 256`, `max_batch_size = 8`, `max_batch_wait = 1s`, `llm.max_concurrency = 1`, \
         `max_tokens = {}`, temperature 0; keyed = the daemon's defaults (adaptive keying), off = `keying.mode = \"off\"`. All requests of a \
         sample are published at once in a random order (the same order in every repetition). Fresh llama-servers for every run, so no run \
         inherits a cache. {}. {reps} repetitions of every (dataset, mode) run; the order of the modes rotates (keyed first in even \
         repetitions, off first in odd ones). Medians of the {reps} repetitions with the spread (min–max) in brackets; every repetition below. \
         Medium mode measures only the small cache (`--cache-ram 0`, the `scripts/llm-server` default: the 2 slots' own KV, like a busy \
         GPU server) and only bbh-cot and mmlu-5shot, to fit in 30 minutes; quick and full mode also run the host cache (`--cache-ram 8192`) \
         and bfcl-multiturn and orca-dpo-sample.\n",
        model(c),
        p.cache_max_tokens,
        c.list_prompts
    );
    let _ = writeln!(
        s,
        "Oracle: token-level, from llama-server's own tokenizer and chat template: each prompt reuses its longest common token prefix with \
         any earlier prompt of the sample (at most all but its last token).\n"
    );
    oracle_table(s, c);
    let _ = writeln!(s, "| dataset | mode | cached tokens | ÷ oracle | wall s | p50 s | p99 s | ok / requests |");
    let _ = writeln!(s, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for d in &c.datasets {
        let oracle = d.oracle;
        for mode in ["keyed", "off"] {
            let rows: Vec<_> = c.rows.iter().filter(|x| x.dataset == d.sample.dataset && x.cache == "small" && x.mode == mode).collect();
            if rows.is_empty() {
                continue;
            }
            let v = |f: fn(&crate::parts::CacheRow) -> f64| rows.iter().map(|x| f(x)).collect::<Vec<_>>();
            let _ = writeln!(
                s,
                "| {} | {mode} | {} | {} | {} | {} | {} | {} / {} |",
                d.sample.dataset,
                spread(&v(|x| x.cached_ratio), pct),
                spread(&v(|x| x.cached_ratio).iter().map(|x| x / oracle).collect::<Vec<_>>(), pct),
                spread(&v(|x| x.wall_s), |x| num(x, 1)),
                spread(&v(|x| x.p50_s), |x| num(x, 1)),
                spread(&v(|x| x.p99_s), |x| num(x, 1)),
                rows.iter().map(|x| x.ok).sum::<usize>(),
                rows.iter().map(|x| x.requests).sum::<usize>()
            );
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "Speed-up of keyed over off (median wall time off ÷ median keyed):\n");
    let _ = writeln!(s, "| dataset | small cache |");
    let _ = writeln!(s, "| --- | ---: |");
    for d in &c.datasets {
        let w = |mode: &str| cache_stat(&c.rows, &d.sample.dataset, "small", mode, |x| x.wall_s).map(|(m, _, _)| m);
        let cell = match (w("keyed"), w("off")) {
            (Some(k), Some(o)) => format!("{:.2}×", o / k),
            _ => "–".into(),
        };
        let _ = writeln!(s, "| {} | {cell} |", d.sample.dataset);
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "Every repetition:\n");
    let _ = writeln!(s, "| rep | dataset | mode | cached tokens | wall s | p50 s | p99 s | mean batch purity | batches | ok / requests |");
    let _ = writeln!(s, "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut rows: Vec<_> = c.rows.iter().collect();
    rows.sort_by(|a, b| (a.rep, &a.dataset, &a.mode).cmp(&(b.rep, &b.dataset, &b.mode)));
    for x in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
            x.rep,
            x.dataset,
            x.mode,
            pct(x.cached_ratio),
            num(x.wall_s, 1),
            num(x.p50_s, 1),
            num(x.p99_s, 1),
            num(x.purity, 2),
            x.batches,
            x.ok,
            x.requests
        );
    }
    let _ = writeln!(s);
    if let Some((_, f)) = plots.iter().find(|(k, _)| *k == "cache") {
        let _ = writeln!(s, "![cached ratio per dataset]({f})\n");
    }
}

/// What the defaults (adaptive) did on the Mooncake replay, against the static 2-block key and
/// the routing model's best key.
fn render_scale_adaptive(s: &mut String, sc: &ScaleResults, p: &Plan) {
    let mut lines = Vec::new();
    for row in sc.rows.iter().filter(|x| x.mode == "keyed") {
        let model_best = sc.offline.iter().filter(|x| x.m == row.m && x.mode == "keyed").map(|x| x.block_hit_ratio).fold(f64::NAN, f64::max);
        let stat = sc.rows.iter().find(|x| x.m == row.m && x.mode == "static" && x.key_blocks == p.scale_key_blocks);
        let optimal = sc
            .offline
            .iter()
            .find(|x| x.m == row.m && x.mode == "pooled-optimal")
            .map(|x| format!(", and with optimal eviction {} of the oracle", pct(x.block_hit_ratio / sc.oracle_sample_16)))
            .unwrap_or_default();
        let ceiling = sc.offline.iter().find(|x| x.m == row.m && x.mode == "pooled").map(|x| {
            format!(
                "; one LRU cache of M × capacity, the capacity ceiling of routing over LRU servers, reaches {} ({} of the oracle){optimal}",
                pct(x.block_hit_ratio),
                pct(x.block_hit_ratio / sc.oracle_sample_16)
            )
        });
        lines.push(format!(
            "M = {}: adaptive {} = **{}** of the oracle{}; the routing model's best static key reaches {} ({} of the oracle){}",
            row.m,
            pct(row.block_hit_ratio),
            pct(row.block_hit_ratio / sc.oracle_sample_16),
            stat.map(|x| format!(", {} of the measured static {}-block key ({})", pct(row.block_hit_ratio / x.block_hit_ratio), x.key_blocks, pct(x.block_hit_ratio))).unwrap_or_default(),
            pct(model_best),
            pct(model_best / sc.oracle_sample_16),
            ceiling.unwrap_or_default()
        ));
    }
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "**The defaults (adaptive key levels).** {}. Every request of this trace starts with block 0, so its level-0 key (256 \
         characters) and level-1 key (1,024) are the same for all traffic, and only level 2 (4,096 characters = 2 blocks) tells \
         conversations apart. The queueing-delay rule does not fire here: its threshold is 2 s of wall time, {:.0} trace seconds at \
         this speed-up, and no partition queues that long. The dominance rule does: at the refresh that a router's 5th request triggers (5 of 5 requests \
         on one key put the one-sided 95 % lower bound of its share at 0.65, above half), \
         the level-0 key (100 % of the traffic) is split, together with level 1 (one key for all its \
         requests), so requests route by level 2 — the static 2-block key's routing — from well under a second of wall time into \
         the replay (splits column: split decisions / spreads / merges, key moves). Those first requests (5 or more per router: \
         up to the 5th, or until another instance's decision reaches it at its next 250 ms refresh) all went to one server, and their conversations continue \
         on other servers: the speed-up magnifies this warm-up, which in real time is well under a second. The rest of the gap to the oracle is what the servers' LRU eviction \
         loses at this capacity (each server holds {} blocks): the routing model, which has no warm-up, tops out at the ratios quoted, and even one cache as large as \
         all M together, with the same LRU eviction, stays below the oracle at small M, because the trace's one-off blocks push \
         out blocks that a later turn needs. Only the servers' eviction or admission policy could close that part of the gap, not \
         routing: the same total capacity holds what later turns need when the blocks used again furthest ahead go first.\n",
        lines.join("; "),
        2.0 * p.scale_speedup,
        p.scale_sim.capacity_blocks
    );
}

/// What wins in the hot-prefix comparison and why.
fn render_hot_reading(s: &mut String, h: &HotResults) {
    let Some(a) = h.rows.iter().find(|x| x.shards == 0) else { return };
    let statics: Vec<_> = h.rows.iter().filter(|x| x.shards > 0).collect();
    let Some(best) = statics.iter().min_by(|x, y| (x.end_backlog, x.p99_s.to_bits()).cmp(&(y.end_backlog, y.p99_s.to_bits()))) else { return };
    let best_hits = statics.iter().map(|x| x.hit_ratio).fold(f64::NAN, f64::max);
    let _ = writeln!(
        s,
        "Reading it: one shard (static) keeps the hot header on one server: best hit ratio ({}), but that server is the \
         bottleneck and the backlog grows through the peak. More static shards spread the header over more partitions, \
         trading a few hit-ratio points (each server prefills the header once per batch it gets cold) for parallelism. The \
         defaults start like one shard; when the hot key carries more than half of a router's requests beyond chance (dominance) or its partition \
         queues them for more than 2 s (delay), it splits, with its deeper levels that are the same header, and its requests \
         route by the level that holds the question: they scatter over all partitions while every server keeps the header \
         cached. Adaptive vs the static configuration with the smallest backlog at load end ({}): backlog at load end {} vs {}, \
         hit ratio {} vs {} (best static {}), p99 {} s vs {} s ({}×).\n",
        pct(best_hits),
        best.label(),
        a.end_backlog,
        best.end_backlog,
        pct(a.hit_ratio),
        pct(best.hit_ratio),
        pct(best_hits),
        num(a.p99_s, 2),
        num(best.p99_s, 2),
        num(a.p99_s / best.p99_s, 2)
    );
}

/// `split / spread / merge (moves)` of a run's split decisions; `–` when none were made.
fn splits_cell(x: &crate::procs::SplitCounts) -> String {
    if x.splits + x.spreads + x.merges == 0 {
        "–".into()
    } else {
        format!("{} / {} / {} ({})", x.splits, x.spreads, x.merges, x.moves)
    }
}

fn render_chat(s: &mut String, c: &crate::chat::ChatResults, p: &Plan) {
    let _ = writeln!(s, "## 5. Multi-turn chat\n");
    let _ = writeln!(
        s,
        "Chat requests (`/v1/chat/completions`) through M = {} daemons with one simulator each (part 2's simulator settings in {} mode: {} blocks of \
         cache, {} slots; the simulator renders messages role-tagged and caches them like a completions prompt), speed-up {}×, \
         times in model seconds. \
         `adaptive`: the defaults (`keying.mode = \"adaptive\"`, `chat_key = \"opening\"`). `prefix`: static, with the given \
         `chat_key` and `sharding.default_shards`. Oracle: one infinite cache over the same rendering, 16-token blocks. \
         Splits: split / spread / merge decisions (key moves seen by one instance).\n",
        c.m, p.mode, p.scale_sim.capacity_blocks, p.scale_sim.max_concurrency, c.speedup
    );
    for w in &c.workloads {
        let _ = writeln!(s, "**{}**: {} requests, {} conversations, oracle **{}**; {}.\n", w.name, w.requests, w.conversations, pct(w.oracle), w.note);
        let _ = writeln!(s, "| mode | chat_key | shards | token hits | ÷ oracle | ÷ best static | prefill GPU-s | p50 s | p99 s | splits | ok / requests |");
        let _ = writeln!(s, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |");
        let rows: Vec<_> = c.rows.iter().filter(|x| x.workload == w.name).collect();
        let best = rows.iter().filter(|x| x.mode != "adaptive").map(|x| x.token_hit_ratio).fold(f64::NAN, f64::max);
        for x in rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
                x.mode,
                x.chat_key,
                if x.shards == 0 { "–".to_string() } else { x.shards.to_string() },
                pct(x.token_hit_ratio),
                pct(x.token_hit_ratio / w.oracle),
                pct(x.token_hit_ratio / best),
                num(x.prefill_s, 0),
                num(x.p50_s, 1),
                num(x.p99_s, 1),
                splits_cell(&x.splits),
                x.ok,
                x.requests
            );
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(
        s,
        "Reading it: a static key must be chosen for the workload. `chat_key = \"system\"` (and `\"rendered\"`, whose first 256 \
         characters are the start of the system prompt) groups by the system prompt: right for bfcl, whose long tool schemas are \
         each shared by a few conversations, and wrong for the Mooncake chats, whose one system message is in every request — one \
         key for all traffic, i.e. one server with 1 shard, or conversations scattered over 8 partitions with 8 shards. \
         `\"system_and_first_user\"` keys each conversation by its opening, which keeps a conversation on one server in both \
         workloads but splits the conversations that share a system prompt over servers (each server prefills that prompt once). \
         The defaults (`chat_key = \"opening\"`) cut each conversation's opening (system prompt and first user message) by \
         length like a prompt, 256 → 1,024 → 4,096 → 16,384 characters, and split a cut only when it dominates (more than half \
         of a router's requests, beyond chance: a one-sided 95 % bound on its share) or its partition queues. In the Mooncake chats the 256- and 1,024-character cuts lie inside the one \
         system message, so they carry all traffic and split within the first second, and conversations route by the \
         4,096-character cut, which reaches into their own first turn. In bfcl the short cuts lie inside the instructions that \
         every tool-use prompt starts with and split as well; the longer cuts group the conversations whose tool schemas begin \
         alike, so those share one server and its cached schema text, where keying by the whole system prompt would place each \
         distinct schema set on its own server and prefill their common text on several.\n"
    );
}

fn render_shift(s: &mut String, sh: &crate::chat::ShiftResults, p: &Plan) {
    let _ = writeln!(s, "## 6. Hot-key shift\n");
    let _ = writeln!(
        s,
        "Part 4's deployment (4 instances, slow simulated servers, the defaults) under a constant {} req/s for {} s: until {} s, {:.0} % of \
         the requests carry one BIG-Bench-Hard header (the old hot prefix), after it {:.0} % carry another one (the new hot prefix) and the \
         old one gets none; the rest are spread over {} other headers. Times below are seconds since the start of the load, from the \
         daemons' split and merge log lines of the two prefixes' key levels.\n",
        sh.rate_rps, sh.load_s, sh.shift_at_s, p.hot_share * 100.0, p.hot_share * 100.0, p.hot_cold_groups
    );
    let first = |prefix: &str, merge: bool| {
        sh.events.iter().find(|e| e.prefix == prefix && e.what.contains("merging") == merge).map(|e| e.at_s).unwrap_or(f64::NAN)
    };
    let _ = writeln!(s, "| measurement | value |");
    let _ = writeln!(s, "| --- | ---: |");
    let _ = writeln!(s, "| old prefix: first split at s | {} |", num(first("old", false), 1));
    let _ = writeln!(s, "| new prefix: first split at s (after the shift) | {} ({}) |", num(first("new", false), 1), num(first("new", false) - sh.shift_at_s, 1));
    let _ = writeln!(s, "| old prefix: first merge at s (after the shift) | {} ({}) |", num(first("old", true), 1), num(first("old", true) - sh.shift_at_s, 1));
    let _ = writeln!(s, "| split / spread / merge decisions, key moves (`key_moves_total`, one instance) | {} / {} / {}, {} |", sh.splits.splits, sh.splits.spreads, sh.splits.merges, sh.splits.moves);
    let _ = writeln!(s, "| results / requests, ok, duplicates | {} / {}, {}, {} |", sh.results, sh.requests, sh.ok, sh.duplicates);
    let _ = writeln!(s, "| token hit ratio, p50 / p99 s, peak backlog | {}, {} / {}, {} |", pct(sh.token_hit_ratio), num(sh.p50_s, 2), num(sh.p99_s, 2), sh.peak_backlog);
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "Reading it: the split is by dominance (the hot header carries ~80 % of each router's requests); a router decides once its share \
         is above half beyond chance (a one-sided 95 % bound: 8 of 10 requests, 14 of 20) in its last 3 windows, and at {} req/s over {} routers that takes a few seconds. The old key merges \
         back once it has been split for ≥ 30 s and its arrivals stayed at or below half their peak for 10 s. Each split also \
         splits the header's deeper level(s) (not listed: the table follows the level-0 keys).\n",
        sh.rate_rps, p.hot_instances
    );
    let _ = writeln!(s, "Every split and merge of the two prefixes' level-0 keys:\n");
    let _ = writeln!(s, "| at s | prefix | entry | decision |");
    let _ = writeln!(s, "| ---: | --- | --- | --- |");
    // Every instance logs the merges it decided; the first line of each decision counts.
    let mut seen = std::collections::HashSet::new();
    for e in sh.events.iter().filter(|e| seen.insert((e.member.clone(), e.what.clone()))) {
        let _ = writeln!(s, "| {} | {} | `{}` | {} |", num(e.at_s, 1), e.prefix, e.member, e.what);
    }
    let _ = writeln!(s);
}

pub fn write(r: &Results, dir: &Path) -> anyhow::Result<()> {
    crate::plots::register_font()?;
    let mut plots: Vec<(&str, &str)> = Vec::new();
    if let Some(c) = &r.cache {
        crate::plots::cache_ratio(c, &dir.join("cache_ratio.png"))?;
        plots.push(("cache", "cache_ratio.png"));
    }
    if let Some(sc) = &r.scale {
        crate::plots::scale_hits(sc, r.plan.scale_key_blocks, &dir.join("scale_hit_ratio.png"))?;
        crate::plots::scale_backlog(sc, &dir.join("scale_backlog.png"))?;
        plots.push(("scale_hits", "scale_hit_ratio.png"));
        plots.push(("scale_backlog", "scale_backlog.png"));
    }
    if let Some(h) = &r.hot {
        crate::plots::hot_backlog(h, &dir.join("hot_backlog.png"))?;
        plots.push(("hot", "hot_backlog.png"));
    }
    if let Some(pe) = &r.peers {
        crate::plots::peers_hits(pe, &dir.join("peers_hit_ratio.png"))?;
        plots.push(("peers", "peers_hit_ratio.png"));
    }
    std::fs::write(dir.join("REPORT.md"), render(r, &plots))?;
    Ok(())
}

/// Part 7: prefix-batcher against the peer routers, one table per workload, and its reading.
fn render_peers(s: &mut String, pe: &crate::peers::PeersResults, p: &Plan, plots: &[(&str, &str)]) {
    let _ = writeln!(s, "## 7. Peers: SGLang's and vLLM's routers on the same servers and traffic\n");
    let _ = writeln!(
        s,
        "One load generator, many routes. Each route gets M fresh simulators (part 2's settings in {} mode: {} blocks of cache, {} slots, {}× \
         speed-up; the hot-prefix workloads: part 4's slow servers in real time, as their notes say) and the same chat requests at the same arrival times with the same `max_tokens`. **prefix-batcher (defaults)**: M \
         daemons (adaptive keying, `llm.max_concurrency = {}`, `max_batch_wait = 5ms`), requests published to RabbitMQ, results \
         from the reply queue. **Peer routers** ({}, installed by `bench/peers-install` into `.cache/peers-venv`): \
         `python -m <package>.launch_router --worker-urls … --policy P`, requests sent over HTTP open loop at the arrival times, \
         at most {} × M in flight (the daemons' bound). `sglang-router round_robin` is the plain baseline. Hit ratios are the \
         servers' own counters (`vllm:prefix_cache_hits_total ÷ queries_total`, tokens); the oracle is one infinite cache over \
         the same rendering. Latency: wall-clock milliseconds from arrival to answer (the servers run {}× faster than real time, \
         so these are mostly the route's own delays and queueing). CPU: the router process's user + system seconds during the \
         drive per 1,000 requests, and peak RSS (VmHWM), from /proc (prefix-batcher: summed over its M instances; the \
         peers run one router process). \
         What the routers ask the servers besides the OpenAI endpoints (observed against the simulator): SGLang's router \
         `GET /health`, and `GET /server_info` and `/model_info` when it registers a worker (it also tries to fetch a \
         tokenizer for the model id from Hugging Face, which fails here and is ignored); vLLM's router `GET /health` at \
         start and every 60 s, and under `cache_aware` `POST /v1/chat/completions/render` (`/v1/completions/render` for \
         completions) on every server for every request. The simulator answers all of them (render: the prompt's token ids \
         in its own tokenization, no cache effect).\n",
        p.mode,
        pe.sim.capacity_blocks,
        pe.sim.max_concurrency,
        pe.speedup,
        pe.llm_max_concurrency,
        pe.versions.join(", "),
        pe.llm_max_concurrency,
        pe.speedup
    );
    for w in &pe.workloads {
        let _ = writeln!(s, "### {} — {} requests, oracle {}\n\n{}.\n", w.name, w.requests, pct(w.oracle), w.note);
        // A burst workload measures throughput at saturation: one more column.
        let (thr_head, thr_rule) = if w.burst { (" throughput req/s |", " ---: |") } else { ("", "") };
        let _ = writeln!(s, "| M | route | token hits | ÷ oracle | prefill GPU-s | p50 ms | p99 ms |{thr_head} router CPU s / 1,000 req | router peak RSS MiB | busiest server's share | ok / requests (served) |");
        let _ = writeln!(s, "| ---: | --- | ---: | ---: | ---: | ---: | ---: |{thr_rule} ---: | ---: | ---: | ---: |");
        for x in pe.rows.iter().filter(|x| x.workload == w.name) {
            if x.error.is_some() && x.ok == 0 {
                let _ = writeln!(s, "| {} | {} | failed | | | | |{} | | | 0 / {} |", x.m, x.route(), if w.burst { " |" } else { "" }, x.requests);
                continue;
            }
            let thr = if w.burst { format!(" {} |", num(x.throughput(), 1)) } else { String::new() };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |{thr} {} | {} | {} | {} / {} ({}) |",
                x.m,
                if x.system == "prefix-batcher" { format!("**{}**", x.route()) } else { x.route() },
                pct(x.token_hit_ratio),
                pct(x.token_hit_ratio / w.oracle),
                num(x.prefill_s, 0),
                num(x.p50_ms, 0),
                num(x.p99_ms, 0),
                num(x.cpu_s_per_1000, 2),
                num(x.rss_mib, 0),
                pct(x.served_per_server.iter().copied().max().unwrap_or(0) as f64 / x.served.max(1) as f64),
                x.ok,
                x.requests,
                x.served
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "{}", peers_facts(pe, &w.name, w.burst));
    }
    let failed: Vec<String> = pe
        .rows
        .iter()
        .filter_map(|x| x.error.as_ref().map(|e| format!("- {} M={} {}: {}", x.workload, x.m, x.route(), e.chars().take(300).collect::<String>())))
        .collect();
    if !failed.is_empty() {
        let _ = writeln!(s, "Routes with failures:\n\n{}\n", failed.join("\n"));
    }
    if !pe.unknown_probes.is_empty() {
        let _ = writeln!(s, "Requests the routers sent that the simulator does not serve (404): `{}`.\n", pe.unknown_probes.join("`, `"));
    }
    let _ = writeln!(s, "{}", peers_reading(pe));
    if let Some((_, f)) = plots.iter().find(|(k, _)| *k == "peers") {
        let _ = writeln!(s, "![hit ratio vs M per route]({f})\n");
    }
}

/// Measured facts of one workload's table: per M, the best route by hit ratio and where
/// prefix-batcher stands.
fn peers_facts(pe: &crate::peers::PeersResults, workload: &str, burst: bool) -> String {
    let mut out = Vec::new();
    for m in pe.ms(workload) {
        let rows: Vec<_> = pe.rows.iter().filter(|x| x.workload == workload && x.m == m && x.error.is_none()).collect();
        let Some(pb) = rows.iter().find(|x| x.system == "prefix-batcher") else { continue };
        let Some(best_peer) = rows.iter().filter(|x| x.system != "prefix-batcher").max_by(|a, b| a.token_hit_ratio.total_cmp(&b.token_hit_ratio)) else { continue };
        let rr = rows.iter().find(|x| x.system == "sglang-router" && x.policy == "round_robin");
        let saturation = if burst {
            let fastest = rows.iter().filter(|x| x.system != "prefix-batcher").max_by(|a, b| a.throughput().total_cmp(&b.throughput()));
            fastest
                .map(|f| format!("; throughput {} req/s vs the fastest peer, {}, {} req/s", num(pb.throughput(), 1), f.route(), num(f.throughput(), 1)))
                .unwrap_or_default()
        } else {
            String::new()
        };
        out.push(format!(
            "M = {m}: prefix-batcher {} vs the best peer, {} ({}){}; prefill GPU-s {} vs {}; p99 {} ms vs {} ms{saturation}.",
            pct(pb.token_hit_ratio),
            best_peer.route(),
            pct(best_peer.token_hit_ratio),
            rr.map(|r| format!(", round-robin {}", pct(r.token_hit_ratio))).unwrap_or_default(),
            num(pb.prefill_s, 0),
            num(best_peer.prefill_s, 0),
            num(pb.p99_ms, 0),
            num(best_peer.p99_ms, 0),
        ));
    }
    if out.is_empty() {
        String::new()
    } else {
        format!("Measured: {}\n", out.join(" "))
    }
}

/// The written reading of part 7: the measured behaviour of each route (single-server routes,
/// render calls per request) and why each wins where it does.
fn peers_reading(pe: &crate::peers::PeersResults) -> String {
    let mut facts = Vec::new();
    let mut routes: Vec<String> = Vec::new();
    for x in &pe.rows {
        if !routes.contains(&x.route()) {
            routes.push(x.route());
        }
    }
    for route in &routes {
        let rows: Vec<_> = pe.rows.iter().filter(|x| &x.route() == route && x.error.is_none() && x.served > 0).collect();
        if !rows.is_empty() && rows.iter().all(|x| x.served_per_server.iter().copied().max().unwrap_or(0) == x.served) {
            facts.push(format!("`{route}` sent every request of every run to one server"));
        }
        let mut renders: Vec<(usize, String)> =
            rows.iter().filter(|x| x.renders > 0).map(|x| (x.m, format!("{:.1} at M = {}", x.renders as f64 / x.requests.max(1) as f64, x.m))).collect();
        renders.sort();
        renders.dedup();
        if !renders.is_empty() {
            facts.push(format!("`{route}` made render calls per request: {}", renders.into_iter().map(|r| r.1).collect::<Vec<_>>().join(", ")));
        }
    }
    let facts = if facts.is_empty() { String::new() } else { format!("Measured behaviour: {}.\n\n", facts.join("; ")) };
    format!("{facts}{PEERS_READING}")
}

/// The mechanisms behind part 7's tables.
const PEERS_READING: &str = "Reading it:\n\n\
- **Load-only policies** (`round_robin`, `power_of_two`) ignore prefixes: their hit ratios fall as M grows (each server sees \
  1/M of every conversation and of every shared system prompt), which is the cost every cache-aware route is measured against.\n\
- **bfcl-chat: where SGLang's and vLLM's `cache_aware` still win.** Their approximate radix tree matches a request's whole \
  text against what each server was sent, so each next turn goes back to the server that holds its conversation, and a \
  request goes to the server that holds the longest beginning of its text; at this load their balance thresholds rarely \
  trip, so they seldom spread. bfcl's 146 tool-schema system prompts (18–49 KB) share long beginnings: a 1 KB preamble in \
  all of them, and up to 36 KB between prompts that list the same first tool classes. prefix-batcher's default chat key \
  cuts each conversation's opening by length (256 → 1,024 → 4,096 → 16,384 characters): the two short cuts lie in the \
  common preamble and split at once by dominance, and conversations then route by the 4,096-character cut, which groups \
  the prompts that begin alike (17 groups over the whole dataset, the largest with 22 % of its requests), so prompts that \
  share most of their text share a server. With unbounded caches that grouping alone reaches the one-cache oracle (an \
  offline replay of a 120-conversation sample at M = 4 and 8: 93.8 % against an oracle of 93.8 %; keyed by the whole system \
  prompt, the previous default: 92.2 % and 91.4 %). What it still gives up is the start: until the first split, the first \
  requests (5 per router, about 20 in all at M = 4) route by the preamble to one server, and the split then moves their \
  conversations, whose next turns prefill their system prompt again (the same replay: 93.0 % when the first 20 requests \
  go to one server, 92.2 % when 40 do). `consistent_hash` put everything on one server (no session header), and one \
  server's cache holds all of bfcl at this light load.\n\
- **Mooncake at larger M: prefix-batcher against SGLang's `cache_aware`.** Mooncake's working set is larger than one \
  server's cache, so total cache capacity matters. SGLang's `cache_aware` concentrates traffic (its busiest server takes about \
  40 % at M = 8 and some servers get little or nothing: a request whose text matches a server's tree above the match \
  threshold goes to that server, only a miss goes to the server with the smallest tree, and with a shared first message \
  most requests match some server) so its busy servers evict more; prefix-batcher spreads conversations over every instance \
  by key, so its hit ratio climbs with M towards the oracle. At M = 2 and 4 the cache-aware routes are within about a point \
  of each other. **vLLM's `cache_aware` spreads as well and, while its router keeps up, is within about a point of \
  prefix-batcher on either side** (the table above): it places each request on the server with the longest cached match, \
  where prefix-batcher places a conversation by the hash of its level-2 key, without looking at what each server holds. Its \
  price is latency and CPU (next point); when the router falls behind, its hit ratio falls too (an earlier run of this part \
  on a busier machine measured 19.8 % at M = 8).\n\
- **Hot prefix: the cache-aware peers trade latency and throughput for half a point of hits.** Their radix trees send \
  every request of the hot header to the server that holds it, as long as their balance thresholds do not trip: one \
  server took 81–100 % of the requests, its 4 slots queued, and p99 reached seconds (tens of seconds in the burst), \
  while its cache saw the hot header once. prefix-batcher splits the hot key when it dominates, so each of the 4 \
  servers prefills the header once and shares the load (busiest server about 30 %): about half a point fewer hits, \
  a p99 under half a second on the sine load, and in the burst 2.6 × the cache-aware peers' throughput, close to the \
  load-only policies', whose hit ratio is 6 points lower.\n\
- **vLLM's router renders every chat request on every server** before it routes (`POST /v1/chat/completions/render`, \
  M calls per request under `cache_aware`, none under `consistent_hash`) and routes on the returned token ids. Its CPU per \
  request grows with M and on this 2-core machine at Mooncake's ≈ 170 requests/s it saturated: seconds of latency, all in \
  the router (the simulator answers render at once). On a real deployment each render is a tokenizer run on a GPU server.\n\
- **vLLM's `consistent_hash`** routes on a session key (`X-Session-ID`, `user`, … headers or fields); this traffic carries \
  none, and it pinned everything to one server. Its bfcl hit ratio equals the single-cache oracle because one server's cache \
  holds bfcl's whole working set at this light load; on Mooncake the one cache thrashes and its 2 slots queue. It is a \
  session-affinity policy, not a prefix one; with session headers it would behave like sticky routing per conversation.\n\
- **Latency**: prefix-batcher pays two RabbitMQ hops, the 5 ms batch wait and the partition handoff: tens of wall \
  milliseconds, about twice SGLang's HTTP proxying or more; with real GPUs, whose service times are seconds, both are \
  small next to the prefill they save or lose. Its M = 8 rows also carry 8 daemons on 2 shared cores.\n\
- **Router CPU and RSS**: prefix-batcher's numbers are summed over its M processes and include their background work \
  while idle (lease renewals, backlog polls, metrics); RabbitMQ's and Redis's CPU is not included (a shared broker, not \
  attributable to one run). The peers are one process each; SGLang's costs well under a CPU-second per 1,000 requests.\n";

/// Part 7b: medians over the repetitions on the real llama-servers.
fn render_peers_llama(s: &mut String, pl: &crate::peers::LlamaPeers) {
    if pl.rows.iter().any(|x| x.route == crate::peers::LLAMA_DAEMON_OFF) {
        return render_peers_llama_reps(s, pl);
    }
    let _ = writeln!(s, "### Real llama-servers: prefix-batcher's defaults vs SGLang's cache_aware\n");
    let reps = pl.rows.iter().map(|x| x.rep).max().map(|r| r + 1).unwrap_or(0);
    let _ = writeln!(
        s,
        "{} and {} mixed in random order ({} requests, part 1's sample), all sent at once to 2 fresh llama-servers ({}) per run: \
         prefix-batcher as in part 1 (2 instances, `llm.max_concurrency = 1`, `max_batch_wait = 1s`, adaptive keying) vs \
         `sglang-router cache_aware` with at most 1 × 2 requests in flight. Cached ratio: the servers' own cached prompt tokens \
         ÷ prompt tokens (from their answers). Medians of {reps} runs in alternating order; every run in brackets.\n",
        pl.datasets.first().map(String::as_str).unwrap_or(""),
        pl.datasets.get(1).map(String::as_str).unwrap_or(""),
        pl.requests,
        pl.server_args
    );
    let _ = writeln!(s, "| route | cached ratio | wall s | ok / requests |");
    let _ = writeln!(s, "| --- | ---: | ---: | ---: |");
    for route in ["prefix-batcher (defaults)", "sglang-router cache_aware"] {
        let rows: Vec<_> = pl.rows.iter().filter(|x| x.route == route).collect();
        if rows.is_empty() {
            continue;
        }
        let each = |f: &dyn Fn(&&crate::peers::LlamaRow) -> String| rows.iter().map(f).collect::<Vec<_>>().join(", ");
        let _ = writeln!(
            s,
            "| {route} | {} ({}) | {} ({}) | {} / {} |",
            pct(median(&rows.iter().map(|x| x.cached_ratio).collect::<Vec<_>>())),
            each(&|x| pct(x.cached_ratio)),
            num(median(&rows.iter().map(|x| x.wall_s).collect::<Vec<_>>()), 1),
            each(&|x| num(x.wall_s, 1)),
            rows.iter().map(|x| x.ok).sum::<usize>(),
            rows.iter().map(|x| x.requests).sum::<usize>()
        );
    }
    let _ = writeln!(
        s,
        "\nReading it: with `--cache-ram 0` a llama-server's cache is what its 2 slots last held, so the order of requests \
         on a server matters as much as the choice of server. prefix-batcher's batches gather the backlog's requests of one \
         prefix key and send them to one server back to back, and a server's next batch is one of the key it just ran whenever one waits \
         (its LLM permits go continuation first), so a few-shot header is computed about once per group and server; the router \
         can only pick a server for each request in arrival order, and interleaved bbh-cot tasks and mmlu subjects overwrite \
         each other's slots. The router's ratio also moves from run to run (which server gets a group's first request depends on \
         timing and tree sizes); the daemon's keyed routing gives the same assignment every run. Fewer cached tokens mean \
         more prefill, hence the longer wall time.\n"
    );
}

/// Part 7's real-server comparison in medium mode: three routes (the daemon keyed and off, SGLang's
/// `cache_aware`), medians with spreads, the acceptance ratios, then every repetition.
fn render_peers_llama_reps(s: &mut String, pl: &crate::peers::LlamaPeers) {
    use crate::peers::{LlamaRow, LLAMA_DAEMON, LLAMA_DAEMON_OFF, LLAMA_SGLANG};
    let _ = writeln!(s, "### Real llama-servers: prefix-batcher's defaults vs SGLang's cache_aware\n");
    let reps = pl.rows.iter().map(|x| x.rep).max().map_or(0, |r| r + 1);
    let routes = [LLAMA_DAEMON, LLAMA_DAEMON_OFF, LLAMA_SGLANG];
    let _ = writeln!(
        s,
        "{} ({}) mixed in one random order, {} requests, all sent at once to 2 fresh llama-servers ({}) per run: \
         prefix-batcher as in part 1 (2 instances, `llm.max_concurrency = 1`, `max_batch_wait = 1s`), with its defaults (adaptive keying) \
         and, for reference, with `keying.mode = \"off\"`, vs `sglang-router cache_aware` with at most \
         1 × 2 requests in flight. Cached ratio: the servers' own cached prompt tokens ÷ prompt tokens (from their answers); \
         p50/p99: latency from publish (daemon) or arrival (router) to the answer. {reps} repetitions; repetition r starts with route \
         r mod 3 of the order below, so every route runs once in each position; the request order is the same in every repetition. \
         Medians, the spread (min–max) in brackets; token-level oracle of the mix: {}.\n",
        pl.datasets.join(" and "),
        pl.samples.iter().map(|i| format!("{}: {}", i.dataset, i.note)).collect::<Vec<_>>().join("; "),
        pl.requests,
        pl.server_args,
        pl.oracle.iter().find(|(n, _, _)| n == "mixed").map_or("–".into(), |(_, o, _)| pct(*o))
    );
    let _ = writeln!(s, "| route | cached ratio | {} | wall s | p50 s | p99 s | ok / requests |", pl.datasets.iter().map(|d| format!("{d} cached")).collect::<Vec<_>>().join(" | "));
    let _ = writeln!(s, "| --- | ---: | {}---: | ---: | ---: | ---: |", "---: | ".repeat(pl.datasets.len()));
    let of = |route: &str| pl.rows.iter().filter(|x| x.route == route).collect::<Vec<_>>();
    let med = |route: &str, f: fn(&LlamaRow) -> f64| median(&of(route).iter().map(|x| f(x)).collect::<Vec<_>>());
    for route in routes {
        let rows = of(route);
        if rows.is_empty() {
            continue;
        }
        let v = |f: &dyn Fn(&LlamaRow) -> f64| rows.iter().map(|x| f(x)).collect::<Vec<_>>();
        let per_ds = pl
            .datasets
            .iter()
            .map(|d| spread(&v(&|x| x.by_dataset.iter().find(|b| &b.dataset == d).map_or(f64::NAN, |b| b.cached_ratio)), pct))
            .collect::<Vec<_>>()
            .join(" | ");
        let _ = writeln!(
            s,
            "| {route} | {} | {per_ds} | {} | {} | {} | {} / {} |",
            spread(&v(&|x| x.cached_ratio), pct),
            spread(&v(&|x| x.wall_s), |x| num(x, 1)),
            spread(&v(&|x| x.p50_s), |x| num(x, 1)),
            spread(&v(&|x| x.p99_s), |x| num(x, 1)),
            rows.iter().map(|x| x.ok).sum::<usize>(),
            rows.iter().map(|x| x.requests).sum::<usize>()
        );
    }
    let (dc, sc) = (med(LLAMA_DAEMON, |x| x.cached_ratio), med(LLAMA_SGLANG, |x| x.cached_ratio));
    let (dw, sw) = (med(LLAMA_DAEMON, |x| x.wall_s), med(LLAMA_SGLANG, |x| x.wall_s));
    let _ = writeln!(
        s,
        "\nprefix-batcher (defaults) vs `sglang-router cache_aware`, medians of {reps}: cached ratio {} vs {} ({}), wall time {} s vs {} s \
         (prefix-batcher ÷ router = **{}**; ≤ 1.2 means within 1.2× of the router or better).\n",
        pct(dc),
        pct(sc),
        if dc >= sc { "prefix-batcher's is higher or equal" } else { "prefix-batcher's is lower" },
        num(dw, 1),
        num(sw, 1),
        num(dw / sw, 2)
    );
    let _ = writeln!(s, "Every repetition (position: 1 = ran first in its repetition):\n");
    let _ = writeln!(s, "| rep | position | route | cached ratio | {} | wall s | p50 s | p99 s | mean batch purity | ok / requests |", pl.datasets.iter().map(|d| format!("{d} cached")).collect::<Vec<_>>().join(" | "));
    let _ = writeln!(s, "| ---: | ---: | --- | ---: | {}---: | ---: | ---: | ---: | ---: |", "---: | ".repeat(pl.datasets.len()));
    for x in &pl.rows {
        let per_ds = pl
            .datasets
            .iter()
            .map(|d| x.by_dataset.iter().find(|b| &b.dataset == d).map_or("–".into(), |b| pct(b.cached_ratio)))
            .collect::<Vec<_>>()
            .join(" | ");
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {per_ds} | {} | {} | {} | {} | {} / {} |",
            x.rep,
            x.position + 1,
            x.route,
            pct(x.cached_ratio),
            num(x.wall_s, 1),
            num(x.p50_s, 1),
            num(x.p99_s, 1),
            num(x.purity, 2),
            x.ok,
            x.requests
        );
    }
    let _ = writeln!(
        s,
        "\nReading it: with `--cache-ram 0` a llama-server's cache is what its 2 slots last held, so the order of requests \
         on a server matters as much as the choice of server. prefix-batcher's batches gather the backlog's requests of one \
         prefix key and send them to one server back to back, and a server's next batch is one of the key it just ran whenever one waits \
         (its LLM permits go continuation first), so a few-shot header is computed about once per group and server; with keying off \
         the daemon still batches, but a batch mixes whatever prefixes its random partition got, so consecutive prompts on a server \
         rarely share a header. The router can only pick a server for each request in arrival order, and interleaved bbh-cot tasks \
         and mmlu subjects overwrite each other's slots. The router's ratio and the `off` ratio move from run to run (timing and \
         random partitions); the daemon's keyed routing sends each prefix to the same server every run, and only the composition of \
         its batches depends on timing. Fewer cached tokens mean more prefill, hence the longer wall time.\n"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed results, with the fields the header reads set by the test.
    fn results(command: &str, duration_s: f64, this_run_s: f64, kept: &[(&str, &str)]) -> Results {
        let mut r: Results = serde_json::from_str(include_str!("../results.json")).expect("bench/results.json parses");
        r.command = command.into();
        r.duration_s = duration_s;
        r.this_run_s = this_run_s;
        r.kept = kept.iter().map(|(p, m)| ((*p).to_owned(), (*m).to_owned())).collect();
        r.plan.mode = "medium".into();
        r.started_utc = "2026-12-01 00:00".into();
        r
    }

    #[test]
    fn header_of_merged_results_gives_the_last_commands_own_time_and_the_sum() {
        let h = header(&results("bench/run --parts hot, then bench/run --medium", 1800.0, 1200.0, &[("hot", "quick")]));
        assert!(h.starts_with("Generated by 2 commands"), "{h}");
        assert!(h.contains("The last of them ran in medium mode (seed 7), started 2026-12-01 00:00 UTC and took 20.0 minutes on its own"), "{h}");
        assert!(h.contains("the 2 commands' own times add up to 30.0 minutes. Kept from the earlier commands: hot in quick mode."), "{h}");
    }

    #[test]
    fn header_of_one_command_gives_its_time() {
        let h = header(&results("bench/run", 600.0, 600.0, &[]));
        assert!(h.starts_with("Generated by `bench/run` (medium mode, seed 7), started 2026-12-01 00:00 UTC, in 10.0 minutes."), "{h}");
    }

    #[test]
    fn each_part_is_described_by_the_plan_it_was_measured_with() {
        let mut r = results("bench/run --parts hot, then bench/run --full --parts scale --merge", 1800.0, 600.0, &[("hot", "quick")]);
        let quick = crate::parts::Plan::new(crate::parts::Mode::Quick, 7);
        let full = crate::parts::Plan::new(crate::parts::Mode::Full, 7);
        assert_ne!((quick.hot_period_s, quick.hot_cycles), (full.hot_period_s, full.hot_cycles), "the modes differ in part 4");
        let sine = |p: &Plan| format!("T = {} s, {} cycle(s)", p.hot_period_s, p.hot_cycles);
        // The last command's plan is full mode; part 4 kept its quick plan.
        r.plan = full.clone();
        r.part_plans = [("hot".to_owned(), quick.clone()), ("scale".to_owned(), full.clone())].into();
        let text = render(&r, &[]);
        assert!(text.contains(&sine(&quick)) && !text.contains(&sine(&full)), "part 4 is described by its own plan");
        // Results written before parts kept their plans: every part has the run's plan.
        r.part_plans.clear();
        assert!(render(&r, &[]).contains(&sine(&full)));
    }

    #[test]
    fn the_model_comes_from_the_results_when_recorded() {
        let mut c = results("bench/run", 1.0, 1.0, &[]).cache.expect("the committed results have part 1");
        c.model = None;
        assert_eq!(model(&c), "SmolLM2-135M-Instruct Q4_1");
        c.model = Some(crate::procs::model_name(Path::new("/x/SmolLM2-135M-Instruct.F16.gguf")));
        assert_eq!(model(&c), "SmolLM2-135M-Instruct F16");
    }
}
