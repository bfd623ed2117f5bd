//! `prefix-batcher`: config (exit 78 on a bad one) → tracing → dispatch; `run` runs the daemon
//! until a signal, then drains with one deadline (exit 70 when exceeded). Every exit code is in
//! `prefix_batcher::exit`. Under systemd (`Type=notify`) the run reports
//! READY / WATCHDOG / STOPPING through [`notify`].

mod notify;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use prefix_batcher::{app, client, exit, tls};
use prefix_batcher::config::{self, LogFormat, Settings, DEFAULT_CONFIG_PATH};

/// jemalloc instead of the system allocator: every request body (a few kB) is allocated, copied
/// and freed several times on its way through both hops, and glibc's malloc serves blocks of that
/// size outside its per-thread caches. Measured side by side in `bench/PROFILE.md`. Built with
/// its background threads on (crate feature `background_threads`): they return freed memory to
/// the system after a burst also while the daemon is idle, which jemalloc otherwise does only on
/// later allocations (measured after 300 requests of 4 MB: 53 MB resident 15 s later, against
/// 0.9–1.1 GB two minutes later without; `docs/operations.md`, Memory).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(name = "prefix-batcher", version = prefix_batcher::VERSION, about = "Keeps LLM servers' prefix (KV) caches warm by batching RabbitMQ prompt requests per prefix key.")]
struct Cli {
    /// Configuration file (TOML). Environment variables PREFIX_BATCHER__SECTION__KEY override it.
    /// When not given and the default path does not exist, built-in defaults are used.
    #[arg(long, global = true, env = "PREFIX_BATCHER_CONFIG")]
    config: Option<PathBuf>,
    /// Log format; overrides `log.format`.
    #[arg(long, global = true, value_parser = ["pretty", "json"])]
    log_format: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon until SIGTERM or SIGINT.
    Run,
    /// Validate a configuration and print the effective configuration with secrets redacted.
    CheckConfig {
        /// File to check (defaults to --config).
        path: Option<PathBuf>,
    },
    /// Publish JSONL requests (one JSON object per line) and optionally wait for their results.
    Submit {
        /// JSONL file; `-` or absent reads stdin.
        #[arg(long, short)]
        file: Option<PathBuf>,
        /// Queue to publish to (default: amqp.input_queue).
        #[arg(long)]
        queue: Option<String>,
        /// Wait for one result per request.
        #[arg(long)]
        wait: bool,
        /// Write results (JSONL) here instead of stdout.
        #[arg(long, short)]
        out: Option<PathBuf>,
        /// Longest total wait for results, e.g. "10m".
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// Show members, partition owners and epochs, backlog per partition and unowned partitions.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// The configuration file: `check-config PATH`, else `--config`, else the default path when it
/// exists, else none (defaults and environment only).
fn config_path(cli: &Cli) -> Option<PathBuf> {
    let given = match &cli.command {
        Command::CheckConfig { path: Some(p) } => Some(p),
        _ => cli.config.as_ref(),
    };
    match given {
        Some(p) => Some(p.clone()),
        None if Path::new(DEFAULT_CONFIG_PATH).exists() => Some(PathBuf::from(DEFAULT_CONFIG_PATH)),
        None => None,
    }
}

/// Logs go to stderr (the journal, under systemd). `json`: one object per line with `timestamp`,
/// `level`, `target`, `fields` (the message and its fields), `span` (the innermost span) and
/// `spans` (every enclosing span with its fields, outermost first — e.g.
/// `batch{partition, batch_id, key}`), so a line logged inside a batch carries its partition,
/// batch id and key hex. `pretty`: human text, with ANSI colours only on a
/// terminal (`NO_COLOR` also turns them off). Secrets never reach either: the config types
/// redact them in `Debug`/`Display` (see `config::Secret`, `config::SecretUrl`).
fn init_tracing(format: LogFormat, level: &str) {
    use std::io::IsTerminal;
    // lapin logs expected broker refusals (e.g. the passive declares of the topology check) at
    // ERROR; the daemon reports every failure that matters itself, so lapin is silenced unless
    // log.level names it. RUST_LOG, when set and not empty, replaces log.level and is used as
    // given (RUST_LOG=trace shows the AMQP client too). An empty RUST_LOG counts as unset
    // (docs/configuration.md): `EnvFilter` would read it as a filter without directives, which
    // lets nothing through, not even the error that stops the daemon.
    let directive = match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => v,
        _ if level.contains("lapin") => level.to_owned(),
        _ => format!("{level},lapin=off"),
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&directive).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(true).finish().with(no_amqp_frames()).init(),
        LogFormat::Pretty => builder.with_ansi(ansi).finish().with(no_amqp_frames()).init(),
    }
}

/// Drops the AMQP client's TRACE events whatever `RUST_LOG` says: they print whole frames, and
/// the `connection.start-ok` frame holds the SASL response, i.e. the broker user and password
/// (as a byte array, so a search for the password's text does not find it). Drops its
/// `lapin::returned_messages` events too: one WARN per message the broker returns, holding the
/// whole message (a result's body, with the LLM's output, and its headers), without a bound;
/// the daemon logs each return itself, bounded (docs/operations.md, "Logs").
fn no_amqp_frames<S: tracing::Subscriber>() -> impl tracing_subscriber::Layer<S> {
    tracing_subscriber::filter::filter_fn(|meta| !(*meta.level() == tracing::Level::TRACE && is_amqp_client(meta.target())) && meta.target() != "lapin::returned_messages")
}

/// Whether `target` is a module of the AMQP client (lapin, amq-protocol).
fn is_amqp_client(target: &str) -> bool {
    ["lapin", "amq_protocol"].iter().any(|c| target == *c || target.strip_prefix(c).is_some_and(|rest| rest.starts_with("::")))
}

/// The configuration as read (for `check-config`) and as validated.
struct Loaded {
    raw: config::RawConfig,
    settings: Settings,
}

/// Loads and validates the configuration at `path` (`None`: defaults and environment only);
/// `--log-format` overrides `log.format`. On error prints it and returns exit code 78.
fn load(path: Option<&Path>, log_format: Option<&str>) -> Result<Loaded, ExitCode> {
    let loaded = config::load_raw(path).and_then(|raw| Ok(Loaded { settings: Settings::from_raw(&raw)?, raw }));
    let mut loaded = loaded.map_err(|e| {
        prefix_batcher::report!("prefix-batcher: {e}");
        ExitCode::from(exit::EX_CONFIG)
    })?;
    if let Some(f) = log_format {
        loaded.settings.log.format = if f == "json" { LogFormat::Json } else { LogFormat::Pretty };
    }
    Ok(loaded)
}

/// Completes at the first SIGTERM or SIGINT. Later ones are logged and change nothing: a drain
/// is bounded by `shutdown.drain_timeout`, and only SIGKILL stops the process sooner.
///
/// SIGHUP, SIGUSR1 and SIGUSR2 are logged and ignored from the first poll on. The daemon does
/// not reload its configuration and writes its log to standard output and error (no log file to
/// reopen), and these signals' default action (ending the process at once, without a drain,
/// every delivery in flight charged; POSIX `signal.h`) is what an operator sending one to
/// "reload" or "rotate the log" (logrotate scripts often send SIGHUP or SIGUSR1), or a closed
/// terminal, least expects.
async fn signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let ignored = [
        (SignalKind::hangup(), "SIGHUP", "prefix-batcher does not reload its configuration; restart it to apply a new one"),
        (SignalKind::user_defined1(), "SIGUSR1", "prefix-batcher has no action for it (it logs to standard output and error: no log file to reopen)"),
        (SignalKind::user_defined2(), "SIGUSR2", "prefix-batcher has no action for it (it logs to standard output and error: no log file to reopen)"),
    ];
    for (kind, name, why) in ignored {
        let mut stream = signal(kind).unwrap_or_else(|e| panic!("{name} handler: {e}"));
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                tracing::warn!(signal = name, "ignored: {why} (SIGTERM or `systemctl restart` drains first)");
            }
        });
    }
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
    tokio::spawn(async move {
        loop {
            let name = tokio::select! {
                Some(()) = term.recv() => "SIGTERM",
                Some(()) = int.recv() => "SIGINT",
                else => break, // the runtime's signal driver is gone
            };
            tracing::warn!(
                signal = name,
                "already stopping: a further signal does not shorten the drain (shutdown.drain_timeout \
                 bounds it; SIGKILL stops at once and the deliveries in flight go back to their queues, \
                 each charged one delivery)"
            );
        }
    });
}

/// Stack size of every thread of the daemon, its runtime's and its AMQP client's I/O threads
/// included (through `RUST_MIN_STACK`, which `std::thread` reads for threads spawned without a
/// size, as lapin's are): 256 MiB of address space, of which only what a thread touches becomes
/// memory. lapin parses an AMQP field table recursively, so a header of nested tables costs stack
/// in proportion to its depth, and a thread whose stack overflows aborts the whole process:
/// measured, the 2 MiB default overflowed at 200 to 400 levels (a 1.4 kB header, which any
/// publisher may send), while 256 MiB parses 19,000 levels, more than a header fits in
/// RabbitMQ's default `frame_max` of 128 KiB (about 18,700 levels of 7 bytes each).
const THREAD_STACK_BYTES: usize = 256 << 20;

fn main() -> ExitCode {
    // Before any thread exists: `std::thread` reads RUST_MIN_STACK once, at the first spawn
    // without a size. An operator's own setting wins.
    if std::env::var_os("RUST_MIN_STACK").is_none() {
        std::env::set_var("RUST_MIN_STACK", THREAD_STACK_BYTES.to_string());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().thread_stack_size(THREAD_STACK_BYTES).build();
    match runtime {
        Ok(rt) => rt.block_on(async_main()),
        Err(e) => {
            prefix_batcher::report!("prefix-batcher: cannot start the async runtime: {e}");
            ExitCode::from(exit::EX_SOFTWARE)
        }
    }
}

async fn async_main() -> ExitCode {
    let cli = Cli::parse();
    match load(config_path(&cli).as_deref(), cli.log_format.as_deref()) {
        Ok(loaded) => {
            // RUST_LOG overrides log.level, so it is held to the same rule: a misspelt level there
            // would otherwise silence the daemon.
            if let Some(v) = std::env::var("RUST_LOG").ok().filter(|v| !v.is_empty()) {
                if let Err(rule) = config::check_log_filter(&v) {
                    prefix_batcher::report!("prefix-batcher: RUST_LOG = {v:?}: {rule}");
                    return ExitCode::from(exit::EX_CONFIG);
                }
            }
            // Tracing starts after the configuration: `log.format` and `log.level` come from it.
            init_tracing(loaded.settings.log.format, &loaded.settings.log.level);
            dispatch(&cli.command, loaded).await
        }
        Err(code) => code,
    }
}

/// Runs a command that needs the configuration.
async fn dispatch(command: &Command, loaded: Loaded) -> ExitCode {
    match command {
        Command::Run => run(loaded.settings).await,
        Command::CheckConfig { .. } => {
            let s = &loaded.settings;
            let mut text = format!("# configuration is valid (instance {}, {} partitions)\n", s.instance_name, s.amqp.partitions);
            for line in tls_summary(s, tls::unix_now()) {
                text.push_str(&format!("# {line}\n"));
            }
            // What `run` would log at WARN at startup for the same configuration.
            for advice in prefix_batcher::app::advisories(s) {
                text.push_str(&format!("# warning: {advice}\n"));
            }
            text.push_str(&config::redacted_toml(&loaded.raw));
            write_stdout(&text).unwrap_or(ExitCode::from(exit::EX_OK))
        }
        Command::Submit { file, queue, wait, out, timeout } => {
            let opts = client::SubmitOptions {
                input: file.clone().filter(|f| f.as_os_str() != "-"),
                queue: queue.clone(),
                wait: *wait,
                out: out.clone(),
                timeout: *timeout,
            };
            submit(&loaded.settings, &opts).await
        }
        Command::Status { json } => status(&loaded.settings, *json).await,
    }
}

/// For `check-config`: the subject and validity of each client certificate, and for each CA
/// bundle its size and the certificate that expires first, e.g.
/// `redis.tls_cert_file: CN=batcher, valid until 2027-03-01T00:00:00Z (in 86 days)`.
fn tls_summary(s: &Settings, now: i64) -> Vec<String> {
    let until = |at: i64| {
        let when = if at >= now { format!("in {}", tls::span_text(at - now)) } else { format!("expired {} ago", tls::span_text(now - at)) };
        format!("valid until {} ({when})", tls::rfc3339(at))
    };
    let mut lines = Vec::new();
    for (link, files) in s.tls_links() {
        if let Some(c) = &files.client {
            for d in tls::certificate_dates(&c.cert_pem) {
                lines.push(format!("{link}.tls_cert_file: {}, {}", d.subject, until(d.not_after)));
            }
        }
        if let Some(pem) = &files.ca_pem {
            let dates = tls::certificate_dates(pem);
            if let Some(first) = dates.iter().min_by_key(|d| d.not_after) {
                let n = dates.len();
                lines.push(format!(
                    "{link}.tls_ca_file: {n} certificate{}; the first to expire: {}, {}",
                    if n == 1 { "" } else { "s" },
                    first.subject,
                    until(first.not_after)
                ));
            }
        }
    }
    lines
}

/// `run`: the daemon until SIGTERM/SIGINT; exit code from [`app::AppError::exit_code`].
async fn run(settings: Settings) -> ExitCode {
    prefix_batcher::metrics::deployment(settings.amqp.partitions.get());
    let mut notifier = notify::Notifier::from_env();
    match app::run_with_events(settings, signal(), move |e| notifier.event(e)).await {
        Ok(()) => ExitCode::from(exit::EX_OK),
        Err(e) => {
            tracing::error!(error = %e, "stopping");
            ExitCode::from(e.exit_code())
        }
    }
}

/// `submit`: exit 3 when some requests got no result; on an error, its
/// [`client::ClientError::exit_code`].
async fn submit(settings: &Settings, opts: &client::SubmitOptions) -> ExitCode {
    match client::submit(settings, opts).await {
        Ok(summary) => {
            prefix_batcher::report!("{}", serde_json::to_string(&summary).expect("summary serializes"));
            ExitCode::from(if summary.missing > 0 { exit::EX_MISSING_RESULTS } else { exit::EX_OK })
        }
        Err(e) => {
            prefix_batcher::report!("prefix-batcher submit: {}", client::error_text(&e));
            ExitCode::from(e.exit_code())
        }
    }
}

/// Writes a command's output to stdout. A reader that stopped reading (`status | head -1`: the
/// pipe is closed, `EPIPE`) is not an error: the rest has nowhere to go, and `println!` would
/// panic (exit 101, with a backtrace under `RUST_BACKTRACE`). Any other write error is reported,
/// and its exit code ([`exit::EX_IOERR`]) returned.
fn write_stdout(text: &str) -> Option<ExitCode> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => None,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => None,
        Err(e) => {
            prefix_batcher::report!("prefix-batcher: cannot write to stdout: {e}");
            Some(ExitCode::from(exit::EX_IOERR))
        }
    }
}

/// `status`: a table, or JSON with `--json`.
async fn status(settings: &Settings, json: bool) -> ExitCode {
    let s = match client::status(settings).await {
        Ok(s) => s,
        Err(e) => {
            prefix_batcher::report!("prefix-batcher status: {}", client::error_text(e.as_ref()));
            return ExitCode::from(exit::EX_FAILURE);
        }
    };
    let text = if json { format!("{}\n", serde_json::to_string_pretty(&s).expect("status serializes")) } else { client::render_status(&s) };
    if let Some(code) = write_stdout(&text) {
        return code;
    }
    if s.amqp_error.is_some() {
        // The table came from Redis alone: a script must not read it as healthy.
        return ExitCode::from(if s.amqp_login_refused() { exit::EX_NOPERM } else { exit::EX_UNAVAILABLE });
    }
    if !s.deployment_found {
        return ExitCode::from(exit::EX_NO_DEPLOYMENT);
    }
    ExitCode::from(exit::EX_OK)
}

