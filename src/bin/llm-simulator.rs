//! `llm-simulator`: an OpenAI-compatible LLM server *simulator* modelling vLLM's automatic prefix
//! caching and GPU time (see `prefix_batcher::simulator` for the model). For benchmarks only: it
//! generates no text.
//!
//! Prints its base URL (`http://127.0.0.1:PORT`) as the first line on stdout, then serves until
//! SIGTERM or SIGINT.

use std::process::ExitCode;

use clap::Parser;
use prefix_batcher::simulator::{SimConfig, Simulator, DEFAULT_BLOCK_TOKENS, DEFAULT_CHARS_PER_TOKEN};

#[derive(Parser)]
#[command(name = "llm-simulator", version, about = "OpenAI-compatible LLM server simulator (vLLM automatic prefix caching model; no text generation).")]
struct Args {
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

async fn signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let a = Args::parse();
    if a.chars_per_token == 0 || a.block_tokens == 0 || a.max_concurrency == 0 || !(a.speedup > 0.0) {
        eprintln!("llm-simulator: --chars-per-token, --block-tokens, --max-concurrency and --speedup must be positive");
        return ExitCode::from(78);
    }
    let cfg = SimConfig {
        model: a.model,
        chars_per_token: a.chars_per_token,
        block_tokens: a.block_tokens,
        capacity_blocks: a.capacity_blocks,
        prefill_seconds_per_token: a.prefill_ms_per_token / 1000.0,
        decode_seconds_per_token: a.decode_ms_per_token / 1000.0,
        max_concurrency: a.max_concurrency,
        speedup: a.speedup,
        default_max_tokens: a.default_max_tokens,
    };
    let listener = match tokio::net::TcpListener::bind(&a.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("llm-simulator: cannot listen on {}: {e}", a.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = listener.local_addr().expect("bound");
    println!("http://{addr}");
    match Simulator::new(cfg).serve(listener, signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llm-simulator: {e}");
            ExitCode::FAILURE
        }
    }
}
