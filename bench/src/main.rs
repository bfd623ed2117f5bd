//! `prefix-batcher-bench`: the benchmark runner (see `bench/README.md`).
//!
//! `run` measures, writes `results.json` and regenerates `REPORT.md` and the plots; `report` only
//! regenerates them from `results.json`; `passthrough` is the minimal consumer that part 3
//! compares the daemon with (started by `run` as a separate process).

mod chat;
mod data;
mod driver;
mod parts;
mod passthrough;
mod peers;
mod plots;
mod procs;
mod report;

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "prefix-batcher-bench", about = "Benchmarks of prefix-batcher: cache effect, scale, overhead, hot prefix.")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run benchmarks, write results.json, REPORT.md and the plots.
    Run {
        /// Quick mode (the default): every part, small samples (CI-sized).
        #[arg(long, conflicts_with_all = ["medium", "full"])]
        quick: bool,
        /// Medium mode: only the real llama-server parts (cache, peers-llama) with 48 prompts per
        /// dataset and 3 repetitions (≤ 30 minutes); the other parts are kept from results.json.
        #[arg(long, conflicts_with = "full")]
        medium: bool,
        /// Full mode (larger samples, whole Mooncake trace; about 1.5 hours).
        #[arg(long)]
        full: bool,
        /// Parts to run, comma separated: cache, scale, overhead, hot, chat, shift, peers, peers-llama
        /// (default: all; with --medium: cache,peers-llama).
        #[arg(long)]
        parts: Option<String>,
        /// Keep the other parts' results from an existing results.json (to re-run one part).
        #[arg(long)]
        merge: bool,
        /// Data directory (default ../shared/data next to the repository; env PREFIX_BATCHER_DATA).
        #[arg(long, env = "PREFIX_BATCHER_DATA")]
        data: Option<PathBuf>,
        /// Output directory (default bench/).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value_t = 7)]
        seed: u64,
    },
    /// Regenerate REPORT.md and the plots from results.json.
    Report {
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// The minimal pass-through consumer (internal, started by `run`).
    #[command(hide = true)]
    Passthrough {
        #[arg(long)]
        name: String,
        #[arg(long, default_value_t = 256)]
        input_prefetch: u16,
        #[arg(long, default_value_t = 64)]
        mid_prefetch: u16,
        /// 1: one connection; 2: publishes on a second connection, as the daemon's.
        #[arg(long, default_value_t = 1)]
        connections: u8,
        /// Base URL of an OpenAI-compatible server hop 2 calls per message.
        #[arg(long)]
        llm: Option<String>,
    },
}

/// Every part, in the order they run.
const DEFAULT_PARTS: &str = "cache,scale,overhead,hot,chat,shift,peers,peers-llama";
/// The parts of medium mode: the ones on real llama-servers.
const MEDIUM_PARTS: &str = "cache,peers-llama";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("bench/ has a parent").to_path_buf()
}

fn sh(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd).args(args).output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // reqwest has the daemon's `rustls-no-provider` feature in a workspace build: a client needs
    // a default crypto provider.
    llm_fakes::install_crypto_provider();
    let cli = Cli::parse();
    // An interrupt drops `run`: its processes stop and its queues and Redis keys are deleted by
    // their guards ([`procs::Proc`], [`procs::Teardown`]) before the process exits.
    tokio::select! {
        r = run(cli) => r,
        signal = interrupted() => anyhow::bail!("bench: interrupted by {signal}; stopped its processes and deleted its queues and Redis keys"),
    }
}

/// Completes on SIGINT or SIGTERM, with the signal's name.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

/// Runs one subcommand. Longer than 80 lines: the `run` arm is one straight story of a benchmark
/// invocation (check the data, set up, run the chosen parts, merge, write the report).
async fn run(cli: Cli) -> anyhow::Result<()> {
    let root = root();
    match cli.command {
        Cmd::Passthrough { name, input_prefetch, mid_prefetch, connections, llm } => {
            passthrough::run(&name, input_prefetch, mid_prefetch, connections, llm).await
        }
        Cmd::Report { out } => {
            let out = out.unwrap_or_else(|| root.join("bench"));
            let r: report::Results = serde_json::from_slice(&std::fs::read(out.join("results.json")).context("reading results.json")?)?;
            report::write(&r, &out)?;
            eprintln!("bench: wrote {}", out.join("REPORT.md").display());
            Ok(())
        }
        Cmd::Run { quick: _, medium, full, parts, merge, data, out, seed } => {
            let mode = if full {
                parts::Mode::Full
            } else if medium {
                parts::Mode::Medium
            } else {
                parts::Mode::Quick
            };
            let default_parts = if medium { MEDIUM_PARTS } else { DEFAULT_PARTS };
            let parts = parts.unwrap_or_else(|| default_parts.to_owned());
            let want: Vec<&str> = parts.split(',').map(str::trim).collect();
            if medium {
                if let Some(other) = want.iter().find(|p| !MEDIUM_PARTS.split(',').any(|m| m == **p)) {
                    anyhow::bail!("--medium runs only the real llama-server parts ({MEDIUM_PARTS}), not {other}: run it in quick or full mode");
                }
            }
            // Medium mode measures only the real-server parts: the others are kept from results.json.
            let merge = merge || medium;
            let out = out.unwrap_or_else(|| root.join("bench"));
            let data = data.unwrap_or_else(|| root.join("../shared/data"));
            if !data.join("mooncake").exists() || !data.join("bbh-cot").exists() {
                anyhow::bail!(
                    "data directory {} does not hold the shared datasets (bbh-cot/, mmlu-5shot/, bfcl-multiturn/, orca-dpo-sample/, mooncake/); pass --data DIR",
                    data.display()
                );
            }
            let tag = format!("pbb-{}-{:04x}", std::process::id(), fastrand::u16(..));
            let work = std::env::temp_dir().join(&tag);
            std::fs::create_dir_all(&work)?;
            // Cargo's rule: `CARGO_TARGET_DIR` when set, else `target/` at the workspace root.
            let release_dir = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target")).join("release");
            let env = procs::Env {
                root: root.clone(),
                // BENCH_DAEMON_BIN: another build of the daemon, to compare two builds part by part.
                daemon_bin: std::env::var_os("BENCH_DAEMON_BIN").map(PathBuf::from).unwrap_or_else(|| release_dir.join("prefix-batcher")),
                fakes_bin: release_dir.join("llm-fakes"),
                bench_bin: std::env::current_exe()?,
                work: work.clone(),
                tag,
            };
            for b in [&env.daemon_bin, &env.fakes_bin] {
                anyhow::ensure!(
                    b.exists(),
                    "{} is missing: build with `cargo build --release -p prefix-batcher -p llm-fakes` (bench/run does)",
                    b.display()
                );
            }
            // Deletes the invocation's queues, exchanges and Redis keys however this ends (an
            // error, a panic, or an interrupt that drops this future in `main`).
            let _teardown = procs::Teardown::new(&env.tag);
            eprintln!("bench: logs in {}", work.display());
            let previous: Option<report::Results> =
                if merge { std::fs::read(out.join("results.json")).ok().and_then(|b| serde_json::from_slice(&b).ok()) } else { None };
            let plan = match &previous {
                // The kept parts are described by the sizes they were measured with.
                Some(prev) if medium => parts::Plan { seed, ..parts::Plan::medium_over(prev.plan.clone()) },
                _ => parts::Plan::new(mode, seed),
            };
            let started = Instant::now();
            let mut results = report::Results {
                plan: plan.clone(),
                command: format!(
                    "{}bench/run{}{}{} (daemon git {})",
                    ["BENCH_SCALE_MS", "BENCH_DATASETS"]
                        .iter()
                        .filter_map(|k| std::env::var(k).ok().map(|v| format!("{k}={v} ")))
                        .collect::<String>(),
                    match mode {
                        parts::Mode::Full => " --full",
                        parts::Mode::Medium => " --medium",
                        parts::Mode::Quick => "",
                    },
                    if parts == default_parts { String::new() } else { format!(" --parts {parts}") },
                    if merge && !medium { " --merge" } else { "" },
                    sh("git", &["-C", root.to_str().unwrap_or("."), "rev-parse", "--short", "HEAD"])
                ),
                started_utc: sh("date", &["-u", "+%Y-%m-%d %H:%M"]),
                duration_s: 0.0,
                machine: procs::machine(),
                daemon_version: format!("{} (git {})", sh(env.daemon_bin.to_str().unwrap_or_default(), &["--version"]), sh("git", &["-C", root.to_str().unwrap_or("."), "rev-parse", "--short", "HEAD"])),
                cache: None,
                scale: None,
                overhead: None,
                hot: None,
                chat: None,
                shift: None,
                peers: None,
                peers_llama: None,
                this_run_s: 0.0,
                kept: Vec::new(),
            };
            if want.contains(&"cache") {
                results.cache = Some(parts::part_cache(&env, &plan, &data).await?);
            }
            if want.contains(&"scale") {
                results.scale = Some(parts::part_scale(&env, &plan, &data).await?);
            }
            if want.contains(&"overhead") {
                results.overhead = Some(parts::part_overhead(&env, &plan, &data).await?);
            }
            if want.contains(&"hot") {
                results.hot = Some(parts::part_hot(&env, &plan, &data).await?);
            }
            if want.contains(&"chat") {
                results.chat = Some(chat::part_chat(&env, &plan, &data).await?);
            }
            if want.contains(&"shift") {
                results.shift = Some(chat::part_shift(&env, &plan, &data).await?);
            }
            if want.contains(&"peers") {
                results.peers = Some(peers::part_peers(&env, &plan, &data).await?);
            }
            if want.contains(&"peers-llama") {
                results.peers_llama = Some(peers::part_peers_llama(&env, &plan, &data).await?);
            }
            results.duration_s = started.elapsed().as_secs_f64();
            results.this_run_s = results.duration_s;
            results.machine.load_end = procs::uptime();
            if let Some(prev) = previous {
                let kept = |name: &str, now: bool, before: bool| if !now && before { Some(name.to_owned()) } else { None };
                results.kept = [
                    kept("cache", results.cache.is_some(), prev.cache.is_some()),
                    kept("scale", results.scale.is_some(), prev.scale.is_some()),
                    kept("overhead", results.overhead.is_some(), prev.overhead.is_some()),
                    kept("hot", results.hot.is_some(), prev.hot.is_some()),
                    kept("chat", results.chat.is_some(), prev.chat.is_some()),
                    kept("shift", results.shift.is_some(), prev.shift.is_some()),
                    kept("peers", results.peers.is_some(), prev.peers.is_some()),
                    kept("peers-llama", results.peers_llama.is_some(), prev.peers_llama.is_some()),
                ]
                .into_iter()
                .flatten()
                .map(|p| {
                    let mode = prev.kept.iter().find(|(k, _)| *k == p).map(|(_, m)| m.clone()).unwrap_or_else(|| prev.plan.mode.clone());
                    (p, mode)
                })
                .collect();
                results.cache = results.cache.or(prev.cache);
                results.scale = results.scale.or(prev.scale);
                results.overhead = results.overhead.or(prev.overhead);
                results.hot = results.hot.or(prev.hot);
                results.chat = results.chat.or(prev.chat);
                results.shift = results.shift.or(prev.shift);
                results.peers = results.peers.or(prev.peers);
                results.peers_llama = results.peers_llama.or(prev.peers_llama);
                results.duration_s += prev.duration_s;
                // The kept parts came from the earlier command(s).
                results.command = format!("{}, then {}", prev.command, results.command);
            }
            std::fs::write(out.join("results.json"), serde_json::to_vec_pretty(&results)?)?;
            report::write(&results, &out)?;
            eprintln!("bench: done in {:.1} min; wrote {}", started.elapsed().as_secs_f64() / 60.0, out.join("REPORT.md").display());
            Ok(())
        }
    }
}
