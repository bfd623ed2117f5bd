//! prefix-batcher keeps LLM servers' prefix (KV) caches warm.
//!
//! It consumes prompt requests from RabbitMQ, gives each a prefix key at the coarsest level that
//! is not split (a hot key splits by what follows its prefix, so conversations keep their
//! server), routes every key to a partition queue that exactly one instance owns (Redis leases
//! with epochs, fenced by RabbitMQ single-active-consumer), batches per key with a flush timeout,
//! calls an OpenAI-compatible LLM server and publishes the results, acking each request only
//! after its result is confirmed by the broker. A server-wide LLM failure pauses intake; only a
//! request's own fault fails it.
//!
//! # Layout
//!
//! Data flows one way: input queue → [`router`] → partition queues → [`partition`] (consumer →
//! [`batcher`] → [`llm`] → [`publisher`]) → reply queues.
//!
//! - [`config`]: raw TOML/env configuration and the validated `Settings`.
//! - [`request`]: the message contract — parsing requests, dead-letter reasons, result shape.
//! - [`keying`]: prefix keys, shards, partitions, rendezvous hashing and the partition assignment (pure).
//! - [`affinity`]: adaptive key granularity — which key level a request routes by, and when a
//!   hot key splits or a cool one merges back (pure); [`splits`]: the split set shared through
//!   Redis and each instance's local view of it.
//! - [`batcher`]: per-key batching with size and age flushes (pure), plus batch statistics.
//! - [`tls`]: TLS files of the three links (one rustls stack, ring provider).
//! - [`topology`]: declares and checks exchanges and queues; [`amqp`]: the session's consuming and
//!   publishing connections, AMQP reply codes and the classification of broker refusals by them.
//! - [`router`]: consumes the input queue and forwards each request to its partition queue;
//!   [`intake_reports`]: what a router that lost its intake may have forwarded, in Redis.
//! - [`lease`]: the Redis lease protocol (acquire, renew, release with epochs) and the local lease deadline.
//! - [`membership`]: heartbeats and the live member set (a Redis sorted set).
//! - [`ownership`]: the ownership round (membership refresh, assignment, renewals, releases,
//!   acquisitions) and the lifecycle of owned partitions.
//! - [`partition`]: the pipeline of one owned partition.
//! - [`llm`]: the OpenAI-compatible client (batching, retries, concurrency limits, fault classes).
//! - [`breaker`]: the per-endpoint circuit breaker of the LLM client (pure); [`permits`]: its
//!   per-endpoint concurrency permits, handed out continuation first (same prefix key next).
//! - [`publisher`]: the publisher stage — parse-or-dead-letter, result shaping, confirmed publishes,
//!   the ack after the effect, and every header name.
//! - [`metrics`]: every Prometheus metric; [`http`]: `/metrics`, `/healthz`, `/readyz`.
//! - [`policy`]: what a requester may ask (`reply_to`, parameters, models, message counts).
//! - [`reply_node`]: whether the broker can decode the node of a direct reply-to name (asked once
//!   per node, on a connection of its own).
//! - [`redelivery`]: delivery counts and the last error per request (for `delivery_limit`).
//! - [`readiness`]: the readiness state (not-ready reasons) behind `/readyz`.
//! - [`app`]: wiring, reconnects and graceful shutdown; [`exit`]: the process exit codes;
//!   [`task`]: task boundaries (a panic caught as a value, a panicked task started again).
//! - [`client`]: the `submit` and `status` commands.
//!
//! The binary (`src/main.rs`) reads the configuration once, starts tracing and runs a command;
//! `notify` (binary only) speaks systemd's `sd_notify` protocol. The test and benchmark doubles
//! (a fake OpenAI-compatible server and a vLLM prefix-cache simulator) live in the separate
//! workspace member `llm-fakes`, a dev-dependency only.

/// The daemon's version: the crate's, with the commit it was built from as build metadata
/// (`0.1.0+1a2b3c4d5e6f`) when it was built in a git checkout (`build.rs`). Shown by
/// `--version`, the `build_info` metric and each member's line in `status`.
pub const VERSION: &str = env!("PREFIX_BATCHER_VERSION");

pub mod affinity;
pub mod amqp;
pub mod app;
pub mod batcher;
pub mod breaker;
pub mod client;
pub mod config;
pub mod exit;
#[cfg(test)]
mod fuzz_json;
pub mod http;
pub mod intake_reports;
pub mod keying;
pub mod log_limit;
pub mod lease;
pub mod llm;
pub mod membership;
pub mod metrics;
pub mod ownership;
pub mod partition;
pub mod permits;
pub mod policy;
pub mod publisher;
pub mod readiness;
pub mod redelivery;
pub mod reply_node;
pub mod request;
pub mod router;
pub mod splits;
pub mod task;
pub mod tls;
pub mod topology;
