//! `llm-fakes`: serves one of the OpenAI-compatible LLM server doubles until SIGTERM or SIGINT.
//!
//! - `llm-fakes fake`: the scriptable fake of [`llm_fakes::fake`] (for tests and demos without a
//!   real server).
//! - `llm-fakes simulate`: the vLLM prefix caching and GPU time simulator of
//!   [`llm_fakes::simulator`] (for benchmarks only: it generates no text).
//!
//! Both print their base URL (`http://127.0.0.1:PORT`) as the first line on stdout. Exit codes:
//! 0 after a signal, 1 when the address cannot be bound or serving fails, 78 for invalid
//! simulator settings.

use std::future::Future;
use std::io;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use llm_fakes::fake::FakeLlm;
use llm_fakes::simulator::{SimConfig, Simulator, DEFAULT_BLOCK_TOKENS, DEFAULT_CHARS_PER_TOKEN};
use tokio::net::TcpListener;

/// Exit code of invalid settings (sysexits `EX_CONFIG`).
const EXIT_CONFIG: u8 = 78;

#[derive(Parser)]
#[command(name = "llm-fakes", version, about = "OpenAI-compatible LLM server doubles for tests, demos and benchmarks.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a fake OpenAI-compatible LLM server (for tests and demos without a real server).
    Fake {
        /// Address to listen on; port 0 picks a free port.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        /// Latency per call.
        #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
        latency: Duration,
        /// Extra latency per prompt of a call.
        #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
        per_prompt_latency: Duration,
    },
    /// Run an OpenAI-compatible LLM server simulator (vLLM automatic prefix caching model; no
    /// text generation).
    Simulate(SimArgs),
}

#[derive(clap::Args)]
struct SimArgs {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Model id reported in answers.
    #[arg(long, default_value = "simulated")]
    model: String,
    /// Characters per token of the token approximation.
    #[arg(long, default_value_t = DEFAULT_CHARS_PER_TOKEN)]
    chars_per_token: usize,
    /// Tokens per KV block (vLLM --block-size).
    #[arg(long, default_value_t = DEFAULT_BLOCK_TOKENS)]
    block_tokens: usize,
    /// Prefix cache capacity in KV blocks (LRU eviction beyond it; 0 disables caching).
    #[arg(long, default_value_t = 65_536)]
    capacity_blocks: usize,
    /// Model milliseconds of prefill per uncached prompt token.
    #[arg(long, default_value_t = 0.1)]
    prefill_ms_per_token: f64,
    /// Model milliseconds of decode per output token.
    #[arg(long, default_value_t = 2.0)]
    decode_ms_per_token: f64,
    /// Requests served at once; others wait (FIFO).
    #[arg(long, default_value_t = 16)]
    max_concurrency: usize,
    /// Wall time = model time / speedup (for replaying traces faster than real time).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Output tokens of a request without max_tokens.
    #[arg(long, default_value_t = 16)]
    default_max_tokens: u64,
}

impl SimArgs {
    /// The validated simulator settings, or `None` when a count or the speedup is not positive.
    fn config(self) -> Option<SimConfig> {
        if self.chars_per_token == 0 || self.block_tokens == 0 || self.max_concurrency == 0 || self.speedup.is_nan() || self.speedup <= 0.0 {
            return None;
        }
        Some(SimConfig {
            model: self.model,
            chars_per_token: self.chars_per_token,
            block_tokens: self.block_tokens,
            capacity_blocks: self.capacity_blocks,
            prefill_seconds_per_token: self.prefill_ms_per_token / 1000.0,
            decode_seconds_per_token: self.decode_ms_per_token / 1000.0,
            max_concurrency: self.max_concurrency,
            speedup: self.speedup,
            default_max_tokens: self.default_max_tokens,
        })
    }
}

async fn signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Binds `listen`, prints `http://{addr}` on stdout, then runs `serve` on the listener.
async fn bind_and_serve<F, Fut>(what: &str, listen: &str, serve: F) -> ExitCode
where
    F: FnOnce(TcpListener) -> Fut,
    Fut: Future<Output = io::Result<()>>,
{
    let listener = match TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("llm-fakes {what}: cannot listen on {listen}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let addr = listener.local_addr().expect("bound");
    println!("http://{addr}");
    match serve(listener).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llm-fakes {what}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Fake { listen, latency, per_prompt_latency } => {
            let fake = FakeLlm::new().latency(latency).per_prompt_latency(per_prompt_latency);
            bind_and_serve("fake", &listen, |l| fake.serve(l, signal())).await
        }
        Command::Simulate(args) => {
            let listen = args.listen.clone();
            let Some(cfg) = args.config() else {
                eprintln!("llm-fakes simulate: --chars-per-token, --block-tokens, --max-concurrency and --speedup must be positive");
                return ExitCode::from(EXIT_CONFIG);
            };
            bind_and_serve("simulate", &listen, |l| Simulator::new(cfg).serve(l, signal())).await
        }
    }
}
