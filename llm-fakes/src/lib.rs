//! Test and benchmark doubles of an OpenAI-compatible LLM server, kept out of the daemon's crate.
//!
//! # Layout
//!
//! - [`fake`]: a scriptable fake server for tests and demos (builder [`fake::FakeLlm`]: latency,
//!   failures, bad JSON, answer shapes of vLLM and llama.cpp; records every call).
//! - [`simulator`]: a simulator of vLLM's automatic prefix caching and GPU time for benchmarks
//!   (chained block hashes, LRU, concurrency slots); its cache model also works offline.
//! - [`openai`]: the HTTP surface both share (routes, request parsing, answer and error shapes,
//!   vLLM's prefix cache counters).
//!
//! The binary `llm-fakes` serves either one: `llm-fakes fake` and `llm-fakes simulate`
//! (build with `cargo build --release -p llm-fakes`).

pub mod fake;
pub mod openai;
pub mod simulator;

/// Installs rustls' ring provider as the process default, once. In a workspace build reqwest
/// (a dev-dependency here) has the daemon's `rustls-no-provider` feature, so a `reqwest::Client`
/// needs a default provider; the fakes' own tests and the benchmarks call this first.
pub fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A `reqwest::Client` for tests, after [`install_crypto_provider`].
#[cfg(test)]
pub(crate) fn test_client() -> reqwest::Client {
    install_crypto_provider();
    reqwest::Client::new()
}
