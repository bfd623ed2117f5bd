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

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "prefix-batcher-bench", about = "Benchmarks of prefix-batcher: cache effect, scale, overhead, hot prefix.")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run benchmarks, write results.json, REPORT.md and the plots.
    Run(RunArgs),
    /// Regenerate REPORT.md and the plots from results.json.
    Report {
        /// Directory of results.json, and where REPORT.md and the plots go (default bench/).
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

/// The arguments of `run`.
#[derive(Args, Debug)]
struct RunArgs {
    /// Quick mode (the default): every part, small samples (CI-sized; about 35 minutes on 2 cores).
    #[arg(long, conflicts_with_all = ["medium", "full"])]
    quick: bool,
    /// Medium mode: only the real llama-server parts (cache, peers-llama) with 48 prompts per
    /// dataset and 3 repetitions (about 18 minutes on 2 cores); the other parts are kept from
    /// results.json. Reads only bbh-cot and mmlu-5shot.
    #[arg(long, conflicts_with = "full")]
    medium: bool,
    /// Full mode (larger samples, whole Mooncake trace; about 1.5 hours).
    #[arg(long)]
    full: bool,
    /// Parts to run, comma separated (default: all; with --medium: cache,peers-llama).
    #[arg(long, value_delimiter = ',', value_parser = PARTS)]
    parts: Vec<String>,
    /// Keep the other parts' results from an existing results.json (to re-run one part).
    #[arg(long)]
    merge: bool,
    /// Data directory with the shared datasets (default: ../shared/data relative to the
    /// repository root, i.e. next to the checkout). Each part checks only the datasets it reads.
    #[arg(long, env = "PREFIX_BATCHER_DATA")]
    data: Option<PathBuf>,
    /// Output directory: results.json, REPORT.md and the plots (default bench/; created if missing).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seed of the samples and of the random request orders: the same seed draws the same requests
    /// in the same order.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Only check the arguments and that the data the chosen parts read are present, say what
    /// would run, and exit (bench/run does this before it builds or installs anything).
    #[arg(long)]
    check: bool,
}

/// Every part, in the order they run.
const PARTS: [&str; 8] = ["cache", "scale", "overhead", "hot", "chat", "shift", "peers", "peers-llama"];
/// The parts of medium mode: the ones on real llama-servers.
const MEDIUM_PARTS: [&str; 2] = ["cache", "peers-llama"];

/// A `run` invocation checked before anything is built, installed or started: the mode, the
/// parts, the plan, the directories and the results it merges with.
struct Checked {
    mode: parts::Mode,
    /// The parts to run, in [`PARTS`] order.
    parts: Vec<&'static str>,
    /// `--parts` as given (empty: the mode's default).
    parts_arg: Vec<String>,
    medium: bool,
    merge: bool,
    data: PathBuf,
    out: PathBuf,
    plan: parts::Plan,
    previous: Option<report::Results>,
}

/// Checks `run`'s arguments against each other and against the data directory (only the
/// datasets the chosen parts read), and reads the results to merge with. `root` is the repository.
/// Errors: parts not in medium mode with `--medium`; a missing data directory or data file (named
/// with its dataset); an unreadable results.json with `--merge`/`--medium`; an output path that is
/// not a directory.
fn check_run(a: &RunArgs, root: &Path) -> anyhow::Result<Checked> {
    let mode = if a.full {
        parts::Mode::Full
    } else if a.medium {
        parts::Mode::Medium
    } else {
        parts::Mode::Quick
    };
    let default: &[&str] = if a.medium { &MEDIUM_PARTS } else { &PARTS };
    let parts: Vec<&'static str> =
        PARTS.iter().copied().filter(|p| if a.parts.is_empty() { default.contains(p) } else { a.parts.iter().any(|w| w == p) }).collect();
    if a.medium {
        if let Some(other) = parts.iter().find(|p| !MEDIUM_PARTS.contains(p)) {
            anyhow::bail!("--medium runs only the real llama-server parts ({}), not {other}: run it in quick or full mode", MEDIUM_PARTS.join(", "));
        }
    }
    // Medium mode measures only the real-server parts: the others are kept from results.json.
    let merge = a.merge || a.medium;
    let out = a.out.clone().unwrap_or_else(|| root.join("bench"));
    anyhow::ensure!(!out.exists() || out.is_dir(), "--out {} is not a directory", out.display());
    // Created now, so an --out that cannot be written fails before anything is built or run.
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create --out {}", out.display()))?;
    let results = out.join("results.json");
    let previous: Option<report::Results> = if merge && results.exists() {
        let bytes = std::fs::read(&results).with_context(|| format!("reading {} (to keep the other parts' results)", results.display()))?;
        Some(serde_json::from_slice(&bytes).with_context(|| format!("{} is not a results file of this runner (to keep the other parts' results)", results.display()))?)
    } else {
        if merge {
            // Nothing to keep: the report holds only the parts run now. Said before the run, not
            // after it, so a mistyped --out is noticed in time.
            eprintln!("bench: no {} to merge with; the report will hold only the parts run now", results.display());
        }
        None
    };
    let plan = match &previous {
        // Medium mode's sizes over those the real-server parts were last measured with (each kept
        // part is described by its own plan, `Results::plan_of`).
        Some(prev) if a.medium => parts::Plan { seed: a.seed, ..parts::Plan::medium_over(prev.plan_of("cache").clone()) },
        _ => parts::Plan::new(mode, a.seed),
    };
    let data = a.data.clone().unwrap_or_else(|| root.join("../shared/data"));
    data::check_data(&data, &parts, &plan.datasets)?;
    Ok(Checked { mode, parts, parts_arg: a.parts.clone(), medium: a.medium, merge, data, out, plan, previous })
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("bench/ has a parent").to_path_buf()
}

fn sh(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd).args(args).output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()
}

#[tokio::main]
async fn main() -> ExitCode {
    // reqwest has the daemon's `rustls-no-provider` feature in a workspace build: a client needs
    // a default crypto provider.
    llm_fakes::install_crypto_provider();
    let cli = Cli::parse();
    // An interrupt drops `run`: its processes stop and its queues and Redis keys are deleted by
    // their guards ([`procs::Proc`], [`procs::Teardown`]) before the process exits.
    let result = tokio::select! {
        r = run(cli) => r,
        signal = interrupted() => Err(anyhow::anyhow!("interrupted by {signal}; stopped its processes and deleted its queues and Redis keys")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The cause chain on one line ("what failed: why"), without a backtrace.
            eprintln!("bench: error: {e:#}");
            ExitCode::FAILURE
        }
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
        Cmd::Run(args) => {
            let Checked { mode, parts: want, parts_arg, medium, merge, data, out, plan, previous } = check_run(&args, &root)?;
            eprintln!(
                "bench: {} mode, parts {}{}; data {}; results to {}",
                plan.mode,
                want.join(","),
                if previous.is_some() { " (the others kept from results.json)" } else { "" },
                data.display(),
                out.display()
            );
            if args.check {
                eprintln!("bench: arguments and data checked");
                return Ok(());
            }
            std::fs::create_dir_all(&out).with_context(|| format!("creating --out {}", out.display()))?;
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
            if want.iter().any(|p| MEDIUM_PARTS.contains(p)) {
                // llama-server and the model (installed once by scripts/llm-server): before any part
                // runs, so a failed install stops the run before
                // it measures anything.
                procs::llama_paths(&root)?;
            }
            // Deletes the invocation's queues, exchanges and Redis keys however this ends (an
            // error, a panic, or an interrupt that drops this future in `main`).
            let _teardown = procs::Teardown::new(&env.tag);
            eprintln!("bench: logs in {}", work.display());
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
                    if parts_arg.is_empty() { String::new() } else { format!(" --parts {}", parts_arg.join(",")) },
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
                // Every part run now is measured with this command's plan.
                part_plans: want.iter().map(|part| ((*part).to_owned(), plan.clone())).collect(),
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
                    let mode = prev.kept.iter().find(|(k, _)| *k == p).map(|(_, m)| m.clone()).unwrap_or_else(|| prev.plan_of(&p).mode.clone());
                    (p, mode)
                })
                .collect();
                for (part, _) in &results.kept {
                    results.part_plans.insert(part.clone(), prev.plan_of(part).clone());
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    /// A fresh directory under the system temp dir, deleted when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(what: &str) -> TempDir {
            let d = std::env::temp_dir().join(format!("pbb-test-{what}-{}-{:04x}", std::process::id(), fastrand::u16(..)));
            std::fs::create_dir_all(&d).unwrap();
            TempDir(d)
        }

        /// Creates the files of `datasets` (empty: only their presence is checked).
        fn with(self, datasets: &[&str]) -> TempDir {
            for (ds, files) in data::DATASET_FILES {
                if datasets.contains(ds) {
                    for f in *files {
                        let p = self.0.join(f);
                        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                        std::fs::write(p, "").unwrap();
                    }
                }
            }
            self
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn parse(args: &[&str]) -> Result<RunArgs, clap::Error> {
        let cli = Cli::try_parse_from(["prefix-batcher-bench", "run"].iter().chain(args))?;
        match cli.command {
            Cmd::Run(a) => Ok(a),
            _ => unreachable!("parsed as run"),
        }
    }

    /// `check_run` of `args` with `--data data --out out` added.
    fn check(args: &[&str], data: &Path, out: &Path) -> anyhow::Result<Checked> {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--data", data.to_str().unwrap(), "--out", out.to_str().unwrap()]);
        check_run(&parse(&all).expect("valid arguments"), &root())
    }

    #[test]
    fn clap_refuses_unknown_parts_conflicting_modes_and_bad_seeds() {
        assert_eq!(parse(&["--parts", "cache,foo"]).err().map(|e| e.kind()), Some(ErrorKind::InvalidValue));
        assert_eq!(parse(&["--medium", "--full"]).err().map(|e| e.kind()), Some(ErrorKind::ArgumentConflict));
        assert_eq!(parse(&["--quick", "--medium"]).err().map(|e| e.kind()), Some(ErrorKind::ArgumentConflict));
        assert_eq!(parse(&["--seed", "x"]).err().map(|e| e.kind()), Some(ErrorKind::ValueValidation));
        assert_eq!(parse(&["--seed", "-1"]).err().map(|e| e.kind()), Some(ErrorKind::UnknownArgument));
        assert!(parse(&["--parts", "peers-llama,cache", "--seed", "9"]).is_ok());
    }

    #[test]
    fn medium_mode_refuses_the_simulator_parts() {
        let (data, out) = (TempDir::new("data").with(&["bbh-cot", "mmlu-5shot", "mooncake"]), TempDir::new("out"));
        let e = check(&["--medium", "--parts", "cache,scale"], &data.0, &out.0).err().expect("refused");
        assert!(e.to_string().contains("not scale"), "{e}");
        assert!(check(&["--medium", "--parts", "peers-llama"], &data.0, &out.0).is_ok());
    }

    #[test]
    fn parts_run_in_their_fixed_order_and_medium_defaults_to_the_llama_parts() {
        let (data, out) = (TempDir::new("data").with(&["bbh-cot", "mmlu-5shot", "mooncake"]), TempDir::new("out"));
        assert_eq!(check(&["--parts", "hot,scale"], &data.0, &out.0).unwrap().parts, ["scale", "hot"]);
        let c = check(&["--medium"], &data.0, &out.0).unwrap();
        assert_eq!(c.parts, MEDIUM_PARTS);
        assert!(c.merge, "medium mode keeps the other parts");
    }

    #[test]
    fn a_missing_data_directory_is_named() {
        let out = TempDir::new("out");
        let missing = out.0.join("no-such-data");
        let e = check(&["--parts", "scale"], &missing, &out.0).err().expect("refused");
        assert!(e.to_string().contains(&missing.display().to_string()) && e.to_string().contains("does not exist"), "{e}");
    }

    #[test]
    fn each_mode_and_part_needs_only_the_data_it_reads() {
        let out = TempDir::new("out");
        // Medium mode reads bbh-cot and mmlu-5shot only.
        let two = TempDir::new("data").with(&["bbh-cot", "mmlu-5shot"]);
        assert!(check(&["--medium"], &two.0, &out.0).is_ok());
        assert!(check(&["--parts", "overhead,hot,shift,peers-llama"], &two.0, &out.0).is_ok());
        // The scale part reads the Mooncake trace: the error names the file and the dataset.
        let e = check(&["--parts", "scale"], &two.0, &out.0).err().expect("refused").to_string();
        assert!(e.contains("mooncake/conversation_trace.jsonl") && e.contains("dataset mooncake") && e.contains("read by scale"), "{e}");
        // Quick mode's cache part reads all four text datasets.
        let e = check(&["--parts", "cache"], &two.0, &out.0).err().expect("refused").to_string();
        assert!(e.contains("dataset bfcl-multiturn") && e.contains("dataset orca-dpo-sample") && !e.contains("mooncake"), "{e}");
    }

    #[test]
    fn an_output_path_that_is_a_file_is_refused() {
        let data = TempDir::new("data").with(&["mooncake"]);
        let file = data.0.join("mooncake/conversation_trace.jsonl");
        let e = check(&["--parts", "scale"], &data.0, &file).err().expect("refused");
        assert!(e.to_string().contains("is not a directory"), "{e}");
    }
}
