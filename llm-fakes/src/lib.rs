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
