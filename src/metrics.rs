//! Every metric the daemon exports: names, help texts, buckets and the typed functions that
//! record them.
//!
//! Names follow the Prometheus naming conventions (<https://prometheus.io/docs/practices/naming/>):
//! prefix `prefix_batcher_`, `_total` on counters, base units (`_seconds`, ratios in 0..1).
//! Labels are bounded: `stage`, `outcome`, `reason`, `op`, `queue`, `order` come from closed sets and
//! `partition` is bounded by `amqp.partitions`. Never a label per key, request or URL.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use prometheus::{
    exponential_buckets, linear_buckets, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Metric name prefix.
pub const NAMESPACE: &str = "prefix_batcher";

/// The registry served on `/metrics`.
pub static REGISTRY: LazyLock<Registry> = LazyLock::new(|| {
    Registry::new_custom(Some(NAMESPACE.to_string()), None).expect("valid registry prefix")
});

fn reg<T: prometheus::core::Collector + Clone + 'static>(c: T) -> T {
    REGISTRY.register(Box::new(c.clone())).expect("metric registered once");
    c
}

macro_rules! counter_vec {
    ($name:expr, $help:expr, $labels:expr) => {
        LazyLock::new(|| reg(IntCounterVec::new(Opts::new($name, $help), $labels).unwrap()))
    };
}

static BATCHES: LazyLock<IntCounterVec> =
    counter_vec!("batches_total", "Batches flushed, by flush reason (size, timeout, prefetch, byte_budget, shutdown, revoke).", &["reason"]);
static BATCH_SIZE: LazyLock<Histogram> = LazyLock::new(|| {
    reg(Histogram::with_opts(
        HistogramOpts::new("batch_size", "Requests per flushed batch.").buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
    )
    .unwrap())
});
static BATCH_PURITY: LazyLock<Histogram> = LazyLock::new(|| {
    reg(Histogram::with_opts(
        HistogramOpts::new(
            "batch_purity",
            "Share of a batch held by its most common derived prefix key (1 = every request shares one key).",
        )
        .buckets(vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0]),
    )
    .unwrap())
});
static BATCH_SHARED_PREFIX: LazyLock<Histogram> = LazyLock::new(|| {
    reg(Histogram::with_opts(
        HistogramOpts::new(
            "batch_shared_prefix_ratio",
            "Longest common prefix of a batch's prompts divided by their mean length, in characters.",
        )
        .buckets(linear_buckets(0.1, 0.1, 10).unwrap()),
    )
    .unwrap())
});
static REQUESTS: LazyLock<IntCounterVec> = counter_vec!(
    "requests_total",
    "Requests by pipeline stage (router, batcher, publisher) and outcome.",
    &["stage", "outcome"]
);
static DEAD_LETTERS: LazyLock<IntCounterVec> =
    counter_vec!("dead_letters_total", "Messages sent to the dead-letter queue, by x-death-reason.", &["reason"]);
static LLM_DURATION: LazyLock<HistogramVec> = LazyLock::new(|| {
    reg(HistogramVec::new(
        HistogramOpts::new("llm_request_duration_seconds", "Duration of one HTTP call to the LLM server.")
            .buckets(exponential_buckets(0.005, 2.0, 16).unwrap()),
        &["outcome"],
    )
    .unwrap())
});
static LLM_REQUESTS: LazyLock<IntCounterVec> =
    counter_vec!(
        "llm_requests_total",
        "HTTP calls to the LLM servers, by endpoint (its index in llm.endpoints) and outcome.",
        &["endpoint", "outcome"]
    );
static LLM_CIRCUIT_OPEN: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    reg(IntGaugeVec::new(
        Opts::new(
            "llm_circuit_open",
            "1 while the circuit breaker of LLM endpoint `endpoint` (its index in llm.endpoints) is open or half-open: calls fail fast and the partitions on it pause intake.",
        ),
        &["endpoint"],
    )
    .unwrap())
});
static LLM_CIRCUIT_OPENED: LazyLock<IntCounterVec> = counter_vec!(
    "llm_circuit_opened_total",
    "Times the circuit breaker of LLM endpoint `endpoint` (its index in llm.endpoints) opened after server faults: once per opening from the closed state (a failed probe that reopens it is not counted again, but an opening after a passing probe closed it is: a count that keeps rising means a breaker that flaps, as for a server whose real calls keep failing while it answers the one-token probe).",
    &["endpoint"]
);
static LLM_PROMPT_TOKENS: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new("llm_prompt_tokens_total", "Prompt tokens reported by the LLM server (usage.prompt_tokens).").unwrap())
});
static LLM_PERMIT_HANDOFFS: LazyLock<IntCounterVec> = counter_vec!(
    "llm_permit_handoffs_total",
    "LLM calls that waited for an endpoint permit (llm.max_concurrency), by the order they got it in: \
     continuation (the prefix key of the call that ended, ahead of older calls) or arrival.",
    &["order"]
);
static LLM_CACHED_TOKENS: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new(
        "llm_cached_prompt_tokens_total",
        "Prompt tokens the LLM server served from its prefix cache (usage.prompt_tokens_details.cached_tokens).",
    )
    .unwrap())
});
static QUEUE_MESSAGES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    reg(IntGaugeVec::new(
        Opts::new("queue_messages", "Ready messages in a queue (the backlog): the input queue, or partition queue `partition` (every instance reports every partition; aggregate with max)."),
        &["queue", "partition"],
    )
    .unwrap())
});
static BUFFERED: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    reg(IntGaugeVec::new(Opts::new("buffered_requests", "Requests waiting in batch buffers, per owned partition (requests in flight to the LLM or held while no endpoint is available are not; see unsettled_deliveries)."), &["partition"])
        .unwrap())
});
static OLDEST_BUFFERED: LazyLock<GaugeVec> = LazyLock::new(|| {
    reg(GaugeVec::new(
        Opts::new("oldest_buffered_age_seconds", "Age of the oldest buffered request at scrape time, per owned partition (0 when empty)."),
        &["partition"],
    )
    .unwrap())
});
/// Since when the oldest buffered request of each owned partition waits (`None`: empty buffers).
/// The batcher reports only on changes, so the age gauge is computed from this at every
/// [`render`]: a stuck partition shows a growing age instead of a frozen one.
static OLDEST_SINCE: LazyLock<Mutex<HashMap<u32, Option<Instant>>>> = LazyLock::new(|| Mutex::new(HashMap::new()));
static E2E_LATENCY: LazyLock<Histogram> = LazyLock::new(|| {
    reg(Histogram::with_opts(
        HistogramOpts::new(
            "end_to_end_latency_seconds",
            "From the request's AMQP timestamp to its result being confirmed (whole-second timestamp resolution).",
        )
        .buckets(exponential_buckets(0.05, 2.0, 16).unwrap()),
    )
    .unwrap())
});
static PARTITIONS_OWNED: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new("partitions_owned", "Partitions whose lease this instance holds and whose queue it has a consumer on (a standby while a frozen previous owner's consumer is still the active one).").unwrap())
});
static LEASE_OPS: LazyLock<IntCounterVec> = counter_vec!(
    "lease_operations_total",
    "Redis lease operations by op and outcome: acquire (ok, busy, error), renew (ok, lost, error, expired: the renew deadline passed), release (ok, lost, error).",
    &["op", "outcome"]
);
static REBALANCES: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new("rebalances_total", "Changes of the desired partition assignment seen by this instance.").unwrap())
});
static NAME_CONFLICTS: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new(
        "instance_name_conflicts_total",
        "Heartbeats that found this instance's name taken over by another live process (instance.name must be unique).",
    )
    .unwrap())
});
static REDIS_DATA_LOST: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new(
        "redis_data_lost_total",
        "Heartbeats that found this instance's membership entry gone although it heartbeated within member_ttl: Redis lost its data (FLUSHALL, a restart without persistence, a failover to a replica that lacked it).",
    )
    .unwrap())
});
static MEMBERS: LazyLock<IntGauge> =
    LazyLock::new(|| reg(IntGauge::new("members", "Live instances seen in the membership set.").unwrap()));
static MEMBERS_LLM_DOWN: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new(
        "members_llm_down",
        "Live instances flagged as having every LLM endpoint down for ownership.llm_down_hand_over_after; their partitions go to the others.",
    )
    .unwrap())
});
static MEMBERS_ROUTING_DIFFERS: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new(
        "members_routing_differs",
        "Live instances whose routing settings (keying.mode, prefix_chars, chat_key, sharding) or request rules ([requests], amqp.max_message_bytes, amqp.delivery_limit) differ from this instance's: their routers send a key to other partitions, or they refuse requests this instance answers.",
    )
    .unwrap())
});
static PARTITIONS: LazyLock<IntGauge> = LazyLock::new(|| {
    reg(IntGauge::new("partitions", "Configured partition count P (amqp.partitions); the same on every instance of a deployment.").unwrap())
});
static BUILD_INFO: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    reg(IntGaugeVec::new(Opts::new("build_info", "Always 1; the version label is the daemon's version, with the commit it was built from as build metadata (0.1.0+1a2b3c4d5e6f)."), &["version"]).unwrap())
});
static AMQP_BLOCKED_TOTAL: LazyLock<IntCounterVec> = counter_vec!(
    "amqp_connection_blocked_total",
    "Times the broker blocked an AMQP connection (connection.blocked: a memory or disk alarm), by connection.",
    &["connection"]
);
static AMQP_BLOCKED: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    reg(IntGaugeVec::new(
        Opts::new("amqp_connection_blocked", "1 while the broker blocks the AMQP connection (connection.blocked), else 0."),
        &["connection"],
    )
    .unwrap())
});
static HELD: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    reg(IntGaugeVec::new(
        Opts::new(
            "held_publishes",
            "Results (kind=result) and forwards (kind=forward) held now because the broker does not take them: each is published again after a backoff, its delivery unacked and not charged.",
        ),
        &["kind"],
    )
    .unwrap())
});
static TLS_CLIENT_CERT_EXPIRY: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    reg(IntGaugeVec::new(
        Opts::new(
            "tls_client_certificate_expiry_timestamp_seconds",
            "When the client certificate this process uses on a link expires (the earliest notAfter of its chain, Unix seconds), by link (amqp, redis, llm). Read at startup: a certificate renewed on disk counts after a restart.",
        ),
        &["link"],
    )
    .unwrap())
});
static AMQP_CONNECTED_NODE: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    reg(IntGaugeVec::new(
        Opts::new(
            "amqp_connected_node",
            "1 for the broker node (its index in amqp.urls; 0 for amqp.url) the session's AMQP connections are open to, 0 for the others; all 0 between sessions.",
        ),
        &["node"],
    )
    .unwrap())
});
static INTAKE_FAILURES: LazyLock<IntCounterVec> = counter_vec!(
    "input_consumer_failures_total",
    "Times the router's consumer of the input queue ended under it and consumed again (one delivery at a time until a new message arrived), by reason: unreadable_message = the broker delivered a message the AMQP client cannot parse, which closed the intake connection; connection_lost = the intake connection closed otherwise; channel_closed = the broker closed the consuming channel.",
    &["reason"]
);
// Settlement of partition deliveries: panics, unsettled deliveries, refused results, paused intake.
static TASK_PANICS: LazyLock<IntCounterVec> =
    counter_vec!("task_panics_total", "Panics caught at a task boundary, by stage: router (its request was requeued), batcher (its batch was requeued; or the batcher or executor of a partition's session panicked: the session was closed, which returned its unacked requests), partition (the worker ended, its lease was released, its unacked requests returned to the queue), llm_probe (taken as a failed half-open probe, or as no verdict for a verification), split_refresh (the split-set refresher restarted; routing kept its last view).", &["stage"]);
macro_rules! gauge_vec {
    ($name:expr, $help:expr, $labels:expr) => {
        LazyLock::new(|| reg(IntGaugeVec::new(Opts::new($name, $help), $labels).unwrap()))
    };
}
static UNSETTLED: LazyLock<IntGaugeVec> =
    gauge_vec!("unsettled_deliveries", "Deliveries of a partition held by this instance, neither acked nor nacked yet.", &["partition"]);
/// Results refused by their `reply_to` queue, by refusal (see `publisher::refusal_reason`).
static QUEUES_REDECLARED: LazyLock<IntCounterVec> = counter_vec!(
    "queues_redeclared_total",
    "Destinations of the daemon (dead_letter: the dead-letter exchange and queue; results: the results queue; partition: the shard exchange and a partition queue) found deleted at run time by a publish, and declared again: one per publish that found it missing (several in flight may find one deletion).",
    &["queue"]
);
static PUBLISH_CHANNELS_REPLACED: LazyLock<IntCounterVec> = counter_vec!(
    "publish_channels_replaced_total",
    "Publishing channels (the router's, each partition's) replaced, by reason: publish_failed (a publish was nacked or got no confirm; rabbitmq-server #14589), closed (the channel was found closed).",
    &["reason"]
);
static REPLY_TO_REFUSED: LazyLock<IntCounterVec> =
    counter_vec!("reply_to_refused_total", "Results refused by their reply_to queue and published to the results queue instead.", &["reason"]);
/// 1 while a partition's intake is paused because no LLM endpoint is available.
static INTAKE_PAUSED: LazyLock<IntGaugeVec> =
    gauge_vec!("intake_paused", "1 while a partition's intake is paused because no LLM endpoint is available, else 0.", &["partition"]);
/// Partition consumers closed and reopened, by [`restart`] reason.
static CONSUMER_RESTARTS: LazyLock<IntCounterVec> =
    counter_vec!("consumer_restarts_total", "Partition consumers closed (their deliveries requeued) and reopened, by reason.", &["reason"]);

static PARTITION_OTHER_CONSUMER: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new(
        "partition_other_consumer_total",
        "Another consumer is active on an owned partition's queue (another deployment on the same queue names, or a stray client): a stall that persisted after the consumer was restarted (the queue held ready requests for the stall window and this instance received nothing), or a request this instance's router forwarded to the queue that never reached this idle owner within the stall window.",
    )
    .unwrap())
});

/// Label values of `consumer_restarts_total{reason}`.
pub mod restart {
    /// The oldest unsettled delivery neared `amqp.consumer_timeout`.
    pub const CONSUMER_TIMEOUT: &str = "consumer_timeout";
    /// A channel under the partition closed (e.g. a publish refused with 406).
    pub const CHANNEL_CLOSED: &str = "channel_closed";
    /// The broker cancelled the consumer or the queue was missing (re-declared).
    pub const QUEUE_MISSING: &str = "queue_missing";
    /// The consumer received nothing for the stall window while its queue held ready requests
    /// ([`crate::partition::stall_window`]).
    pub const STALLED: &str = "stalled";
    /// The session's batcher or executor task panicked; the close returns what they held.
    pub const TASK_PANICKED: &str = "task_panicked";
    /// Every label value, for [`super::init`].
    pub const ALL: &[&str] = &[CONSUMER_TIMEOUT, CHANNEL_CLOSED, QUEUE_MISSING, STALLED, TASK_PANICKED];
}

static READY: LazyLock<Gauge> =
    LazyLock::new(|| reg(Gauge::new("ready", "1 when connected to RabbitMQ and Redis and the first lease round is done.").unwrap()));

// Adaptive key granularity ([`crate::affinity`], [`crate::splits`]). Labels: `level` (a key
// level, at most 4 values), `rank` (1..5), `kind` (closed sets below). Never the key itself.
static KEY_SPLITS: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    reg(IntGaugeVec::new(
        Opts::new("key_splits", "Keys split (or spread over shards) in this instance's view of the split set, by key level."),
        &["level"],
    )
    .unwrap())
});
static KEY_SPLIT_DECISIONS: LazyLock<IntCounterVec> = counter_vec!(
    "key_split_decisions_total",
    "Split-set changes this instance made: split (route by the next level), spread (finest level over max_shards), merge, restore (put back after the set in Redis was lost).",
    &["decision"]
);
static KEY_MOVES: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new("key_moves_total", "Decision changes (entries added, removed or changed) seen in the split set; each moves a key's traffic. The first view a process reads counts none.").unwrap())
});
static HOT_KEY_SHARE: LazyLock<GaugeVec> = LazyLock::new(|| {
    reg(GaugeVec::new(
        Opts::new("hot_key_share", "Share of routed requests carried by the rank-th most frequent routed key, over the last window (200 routed requests, 60 s, or up to 10 s without requests, whichever ended first; 0 within 70 s after requests stop)."),
        &["rank"],
    )
    .unwrap())
});
static UNSPLITTABLE_KEY_SHARE: LazyLock<Gauge> = LazyLock::new(|| {
    reg(Gauge::new(
        "unsplittable_key_share",
        "Share of routed requests carried by the most frequent routed key when it cannot be split further (a finest-level or explicit key spread over max_shards already, or a static key), over the window of hot_key_share; 0 otherwise (also for a finest-level or explicit key whose partition keeps up unspread), and in a window of fewer than 20 requests.",
    )
    .unwrap())
});
static KEY_HYGIENE: LazyLock<IntCounterVec> = counter_vec!(
    "key_hygiene_warnings_total",
    "Windows (200 routed requests, 60 s, or up to 10 s without requests; at least 20 requests) with a key problem: volatile (>= 95 % distinct keys), short (most material under 64 characters), unsplittable (one key that cannot be split carries >= 50 %).",
    &["kind"]
);
static SPLIT_SYNC_FAILURES: LazyLock<IntCounter> = LazyLock::new(|| {
    reg(IntCounter::new("split_sync_failures_total", "Failed refreshes of the split set from Redis (the last view stays in force).").unwrap())
});
static SPLIT_VIEW_AGE: LazyLock<Gauge> = LazyLock::new(|| {
    reg(Gauge::new("split_view_age_seconds", "Time since the split-set view was last refreshed from Redis, at scrape time.").unwrap())
});
/// When the split view was last refreshed (for [`SPLIT_VIEW_AGE`] at scrape time).
static SPLIT_VIEW_SINCE: LazyLock<Mutex<Option<Instant>>> = LazyLock::new(|| Mutex::new(None));

/// Label values of `key_split_decisions_total{decision}` and `key_hygiene_warnings_total{kind}`.
pub mod keys {
    pub const SPLIT: &str = "split";
    pub const SPREAD: &str = "spread";
    pub const MERGE: &str = "merge";
    pub const RESTORE: &str = "restore";
    pub const VOLATILE: &str = "volatile";
    pub const SHORT: &str = "short";
    pub const UNSPLITTABLE: &str = "unsplittable";
}

/// The split set was refreshed: entries per level (index = level), and decision changes seen.
pub fn split_view(per_level: &[usize], moves: usize) {
    // Every level a key can have: chat keyed by its opening has the most.
    for level in 0..crate::keying::COMPLETION_LEVELS.max(crate::keying::OPENING_LEVELS).max(crate::keying::CHAT_LEVELS) as usize {
        KEY_SPLITS.with_label_values(&[&level.to_string()]).set(per_level.get(level).copied().unwrap_or(0) as i64);
    }
    KEY_MOVES.inc_by(moves as u64);
    *SPLIT_VIEW_SINCE.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
}

/// This instance changed the split set (`decision` from [`keys`]).
pub fn split_decision(decision: &'static str) {
    KEY_SPLIT_DECISIONS.with_label_values(&[decision]).inc();
}

/// This instance put back `n` entries of its view into a split set that Redis had lost.
pub fn split_restored(n: u64) {
    KEY_SPLIT_DECISIONS.with_label_values(&[keys::RESTORE]).inc_by(n);
}

/// A refresh of the split set failed.
pub fn split_sync_failed() {
    SPLIT_SYNC_FAILURES.inc();
}

/// Shares of the 5 hottest routed keys (largest first) and of the hottest one if unsplittable.
pub fn hot_keys(top_shares: &[f64], unsplittable_share: f64) {
    for rank in 0..5 {
        HOT_KEY_SHARE.with_label_values(&[&(rank + 1).to_string()]).set(top_shares.get(rank).copied().unwrap_or(0.0));
    }
    UNSPLITTABLE_KEY_SHARE.set(unsplittable_share);
}

/// A window of routed requests showed key problem `kind` (from [`keys`]).
pub fn key_hygiene(kind: &'static str) {
    KEY_HYGIENE.with_label_values(&[kind]).inc();
}

fn init_keys() {
    split_view(&[], 0);
    *SPLIT_VIEW_SINCE.lock().unwrap_or_else(|e| e.into_inner()) = None;
    for d in [keys::SPLIT, keys::SPREAD, keys::MERGE, keys::RESTORE] {
        KEY_SPLIT_DECISIONS.with_label_values(&[d]);
    }
    for k in [keys::VOLATILE, keys::SHORT, keys::UNSPLITTABLE] {
        KEY_HYGIENE.with_label_values(&[k]);
    }
    hot_keys(&[], 0.0);
    LazyLock::force(&SPLIT_SYNC_FAILURES);
    LazyLock::force(&SPLIT_VIEW_AGE);
}

fn refresh_split_view_age(now: Instant) {
    let since = *SPLIT_VIEW_SINCE.lock().unwrap_or_else(|e| e.into_inner());
    SPLIT_VIEW_AGE.set(since.map_or(0.0, |s| now.saturating_duration_since(s).as_secs_f64()));
}

/// Label values of `requests_total{stage}`.
pub mod stage {
    pub const ROUTER: &str = "router";
    pub const BATCHER: &str = "batcher";
    pub const PUBLISHER: &str = "publisher";
    /// A probe of an LLM endpoint run by its own task ([`crate::llm`]); only in
    /// `task_panics_total`.
    pub const LLM_PROBE: &str = "llm_probe";
    /// A partition's worker as a whole ([`crate::ownership`]); only in `task_panics_total`.
    pub const PARTITION: &str = "partition";
    /// The split-set refresher ([`crate::splits::run_restarting`]); only in `task_panics_total`.
    pub const SPLIT_REFRESH: &str = "split_refresh";
}

/// Label values of `requests_total{outcome}`.
pub mod outcome {
    /// Router: published to a partition queue and acked.
    pub const ROUTED: &str = "routed";
    /// Router or batcher (a partition): sent to the dead-letter queue.
    pub const DEAD_LETTERED: &str = "dead_lettered";
    /// Batcher: received from a partition queue.
    pub const RECEIVED: &str = "received";
    /// Publisher: `ok: true` result confirmed and request acked.
    pub const PROCESSED: &str = "processed";
    /// Publisher: `ok: false` result confirmed and request acked.
    pub const FAILED: &str = "failed";
    /// Dropped unacked because the partition lease was lost (the broker redelivers it).
    pub const REQUEUED: &str = "requeued";
    /// Batcher: put back in its partition queue without a delivery charged, after a drain,
    /// handoff or abort ([`crate::partition`]); this includes deliveries the broker had sent
    /// that the partition had not taken yet, which were never counted [`RECEIVED`] (so `received`
    /// is not `processed` + `failed` + this). Router: put back in the input queue without a
    /// delivery charged, when its partition queue refused forwards and too many were held for
    /// such queues already, its hold neared `amqp.consumer_timeout`, or the router stopped
    /// ([`crate::router`]).
    pub const RETURNED_UNCHARGED: &str = "returned_uncharged";
    /// Batcher: a second copy of a request this process had taken from a partition queue before
    /// (the router forwarded it again from a redelivered input message), acked without processing
    /// ([`crate::redelivery::is_second_copy`]), or a redelivery of a forward whose outcome this
    /// process published ([`crate::redelivery::answered_before`]). Router: a redelivered input
    /// message whose forward from an earlier delivery this process had published, confirmed
    /// ([`crate::redelivery::earlier_outcome`]), acked without forwarding it again.
    pub const DUPLICATE: &str = "duplicate";
    /// Publisher: an attempt to publish a result failed for a reason of the broker (permission,
    /// full or missing results queue, closed channel, no confirm); the request stays unacked,
    /// not charged a delivery, and the result goes again after a backoff
    /// ([`crate::publisher::publish_result`]). Counted per failed attempt.
    pub const RESULT_HELD: &str = "result_held";
    /// Router: an attempt to forward a request failed for a reason of the broker; the input
    /// delivery stays unacked, not charged a delivery, and is forwarded again after a backoff.
    /// Counted per failed attempt.
    pub const FORWARD_HELD: &str = "forward_held";
}

/// Label values of `amqp_connection_blocked{connection}`: which of the daemon's AMQP connections.
pub mod connection {
    /// The session's consuming connection (router and partition consumers, their acks).
    pub const CONSUME: &str = "consume";
    /// The session's publishing connection (forwarded requests, results, dead letters).
    pub const PUBLISH: &str = "publish";
    /// Every label value, for [`super::init`].
    pub const ALL: &[&str] = &[CONSUME, PUBLISH];
}

/// Creates every metric with its label sets at zero, so dashboards and `promtool` see them from
/// the first scrape.
///
/// `llm_outcomes`: every `outcome` label of the LLM call metrics (`crate::llm::CALL_OUTCOME_LABELS`,
/// passed in so that this module does not depend on the LLM client); `llm_endpoints`: how many
/// endpoints `llm.endpoints` has; `destinations`: the daemon's own destinations
/// (`crate::publisher::OwnDestination::LABELS`); `reply_refusals`: every `x-reply-to-refused`
/// value (`crate::publisher::REPLY_REFUSALS`).
pub fn init(llm_outcomes: &[&str], llm_endpoints: usize, destinations: &[&str], reply_refusals: &[&str]) {
    for r in crate::batcher::FlushReason::ALL {
        BATCHES.with_label_values(&[r.as_str()]);
    }
    LazyLock::force(&BATCH_SIZE);
    LazyLock::force(&BATCH_PURITY);
    LazyLock::force(&BATCH_SHARED_PREFIX);
    for order in ["continuation", "arrival"] {
        LLM_PERMIT_HANDOFFS.with_label_values(&[order]);
    }
    for (s, o) in [
        (stage::ROUTER, outcome::ROUTED),
        (stage::ROUTER, outcome::DEAD_LETTERED),
        (stage::BATCHER, outcome::RECEIVED),
        (stage::BATCHER, outcome::DEAD_LETTERED),
        (stage::PUBLISHER, outcome::PROCESSED),
        (stage::PUBLISHER, outcome::FAILED),
        (stage::PUBLISHER, outcome::REQUEUED),
        (stage::PUBLISHER, outcome::RESULT_HELD),
        (stage::ROUTER, outcome::FORWARD_HELD),
        (stage::ROUTER, outcome::REQUEUED),
        (stage::ROUTER, outcome::RETURNED_UNCHARGED),
        (stage::BATCHER, outcome::RETURNED_UNCHARGED),
        (stage::BATCHER, outcome::DUPLICATE),
        (stage::ROUTER, outcome::DUPLICATE),
    ] {
        REQUESTS.with_label_values(&[s, o]);
    }
    for r in crate::request::DEAD_LETTER_REASONS {
        DEAD_LETTERS.with_label_values(&[r]);
    }
    init_llm(llm_outcomes, llm_endpoints);
    QUEUE_MESSAGES.with_label_values(&["input", ""]);
    LazyLock::force(&BUFFERED);
    LazyLock::force(&OLDEST_BUFFERED);
    LazyLock::force(&E2E_LATENCY);
    LazyLock::force(&PARTITIONS_OWNED);
    // Every pair `ownership` counts, so that a rate over any of them starts from 0.
    for (op, outcomes) in [("acquire", &["ok", "busy", "error"][..]), ("renew", &["ok", "lost", "error", "expired"]), ("release", &["ok", "lost", "error"])] {
        for o in outcomes {
            LEASE_OPS.with_label_values(&[op, o]);
        }
    }
    LazyLock::force(&REBALANCES);
    LazyLock::force(&NAME_CONFLICTS);
    LazyLock::force(&REDIS_DATA_LOST);
    LazyLock::force(&PARTITION_OTHER_CONSUMER);
    LazyLock::force(&MEMBERS);
    LazyLock::force(&MEMBERS_LLM_DOWN);
    LazyLock::force(&MEMBERS_ROUTING_DIFFERS);
    LazyLock::force(&PARTITIONS);
    BUILD_INFO.with_label_values(&[crate::VERSION]).set(1);
    LazyLock::force(&READY);
    init_faults(destinations, reply_refusals);
    init_keys();
}

/// [`init`]'s LLM call metrics: per outcome, and per endpoint index.
fn init_llm(llm_outcomes: &[&str], llm_endpoints: usize) {
    for o in llm_outcomes {
        LLM_DURATION.with_label_values(&[o]);
        for e in 0..llm_endpoints {
            LLM_REQUESTS.with_label_values(&[e.to_string().as_str(), o]);
        }
    }
    for e in 0..llm_endpoints {
        LLM_CIRCUIT_OPEN.with_label_values(&[e.to_string().as_str()]);
        LLM_CIRCUIT_OPENED.with_label_values(&[e.to_string().as_str()]);
    }
    LazyLock::force(&LLM_PROMPT_TOKENS);
    LazyLock::force(&LLM_CACHED_TOKENS);
}

/// [`init`]'s fault counters: blocked connections, panics, intake failures, held publishes,
/// refused replies, declarations made again, replaced channels, paused intakes, restarts.
fn init_faults(destinations: &[&str], reply_refusals: &[&str]) {
    for c in connection::ALL {
        AMQP_BLOCKED_TOTAL.with_label_values(&[c]);
        AMQP_BLOCKED.with_label_values(&[c]);
    }
    for s in [stage::ROUTER, stage::BATCHER, stage::PARTITION, stage::LLM_PROBE, stage::SPLIT_REFRESH] {
        TASK_PANICS.with_label_values(&[s]);
    }
    for r in intake_failure::ALL {
        INTAKE_FAILURES.with_label_values(&[r]);
    }
    LazyLock::force(&UNSETTLED);
    for k in HELD_KINDS {
        HELD.with_label_values(&[k]);
    }
    for r in reply_refusals {
        REPLY_TO_REFUSED.with_label_values(&[r]);
    }
    for d in destinations {
        QUEUES_REDECLARED.with_label_values(&[d]);
    }
    for r in ["publish_failed", "closed"] {
        PUBLISH_CHANNELS_REPLACED.with_label_values(&[r]);
    }
    LazyLock::force(&INTAKE_PAUSED);
    for r in restart::ALL {
        CONSUMER_RESTARTS.with_label_values(&[r]);
    }
}

/// The deployment's configured partition count `P` (for "partitions without an owner":
/// `max(prefix_batcher_partitions) - sum(prefix_batcher_partitions_owned)`).
pub fn deployment(partitions: u32) {
    PARTITIONS.set(i64::from(partitions));
}

/// Label values of `held_publishes{kind}`.
pub const HELD_KINDS: [&str; 2] = ["result", "forward"];

/// One result or forward (`kind`, one of [`HELD_KINDS`]) that the broker does not take, held
/// until it is dropped: counted in `held_publishes{kind}` meanwhile.
pub struct HeldPublish(IntGauge);

impl HeldPublish {
    pub fn new(kind: &'static str) -> Self {
        debug_assert!(HELD_KINDS.contains(&kind), "{kind}");
        let g = HELD.with_label_values(&[kind]);
        g.inc();
        HeldPublish(g)
    }
}

impl Drop for HeldPublish {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Results and forwards held now ([`HeldPublish`]): `(results, forwards)`.
pub fn held_publishes() -> (u64, u64) {
    let get = |k: &str| u64::try_from(HELD.with_label_values(&[k]).get()).unwrap_or(0);
    (get("result"), get("forward"))
}

/// Label values of `tls_client_certificate_expiry_timestamp_seconds{link}`.
pub const TLS_LINKS: [&str; 3] = ["amqp", "redis", "llm"];

/// The client certificate of `link` (one of [`TLS_LINKS`]) expires at `unix_seconds`. Set once at
/// startup, for each link with mutual TLS; links without a client certificate have no series.
pub fn tls_client_certificate_expiry(link: &'static str, unix_seconds: i64) {
    debug_assert!(TLS_LINKS.contains(&link), "{link}");
    TLS_CLIENT_CERT_EXPIRY.with_label_values(&[link]).set(unix_seconds);
}

/// Renders the registry in the Prometheus text exposition format 0.0.4.
pub fn render() -> String {
    refresh_oldest_ages(Instant::now());
    refresh_split_view_age(Instant::now());
    let mut buf = Vec::new();
    TextEncoder::new().encode(&REGISTRY.gather(), &mut buf).expect("text encoding cannot fail");
    String::from_utf8(buf).expect("text format is UTF-8")
}

/// A batch was flushed: counts it and records its size, purity and shared-prefix ratio.
pub fn batch_flushed(reason: crate::batcher::FlushReason, size: usize, purity: f64, shared_prefix_ratio: f64) {
    BATCHES.with_label_values(&[reason.as_str()]).inc();
    BATCH_SIZE.observe(size as f64);
    BATCH_PURITY.observe(purity);
    BATCH_SHARED_PREFIX.observe(shared_prefix_ratio);
}

/// `n` requests reached `outcome` at `stage`.
pub fn requests(stage: &'static str, outcome: &'static str, n: u64) {
    REQUESTS.with_label_values(&[stage, outcome]).inc_by(n);
}

/// A message was dead-lettered with `reason` (one of [`crate::request::DEAD_LETTER_REASONS`]) by
/// `stage` ([`stage::ROUTER`] for the input queue's, [`stage::BATCHER`] for a partition's:
/// `delivery_limit`, or a message published straight to a partition queue).
pub fn dead_lettered(reason: &'static str, stage: &'static str) {
    DEAD_LETTERS.with_label_values(&[reason]).inc();
    REQUESTS.with_label_values(&[stage, outcome::DEAD_LETTERED]).inc();
}

/// One HTTP call to LLM endpoint `endpoint` (its index in `llm.endpoints`) ended with `outcome`
/// (`ok` or an error kind) after `seconds`.
pub fn llm_call(endpoint: usize, outcome: &'static str, seconds: f64) {
    LLM_REQUESTS.with_label_values(&[endpoint.to_string().as_str(), outcome]).inc();
    LLM_DURATION.with_label_values(&[outcome]).observe(seconds);
}

/// The circuit breaker of LLM endpoint `endpoint` (index in `llm.endpoints`) entered `state`
/// (`closed`, `open` or `half_open`); `reopened`: it opened again without having closed (a failed
/// probe), which `llm_circuit_opened_total` does not count again.
pub fn llm_circuit(endpoint: usize, state: &'static str, reopened: bool) {
    let e = endpoint.to_string();
    LLM_CIRCUIT_OPEN.with_label_values(&[e.as_str()]).set(i64::from(state != "closed"));
    if state == "open" && !reopened {
        LLM_CIRCUIT_OPENED.with_label_values(&[e.as_str()]).inc();
    }
}

/// A waiting LLM call got an endpoint permit: ahead of older calls as the continuation of the
/// call that ended (`continuation = true`), or in arrival order. See [`crate::permits`].
pub fn llm_permit_handoff(continuation: bool) {
    LLM_PERMIT_HANDOFFS.with_label_values(&[if continuation { "continuation" } else { "arrival" }]).inc();
}

/// Token usage reported by one LLM response.
pub fn llm_tokens(prompt_tokens: u64, cached_tokens: u64) {
    LLM_PROMPT_TOKENS.inc_by(prompt_tokens);
    LLM_CACHED_TOKENS.inc_by(cached_tokens);
}

/// Ready messages of the input queue.
pub fn input_backlog(ready: u32) {
    QUEUE_MESSAGES.with_label_values(&["input", ""]).set(i64::from(ready));
}

/// Ready messages of partition queue `partition`.
pub fn partition_backlog(partition: u32, ready: u32) {
    QUEUE_MESSAGES.with_label_values(&["partition", &partition.to_string()]).set(i64::from(ready));
}

/// Buffer state of one partition's batcher: `buffered` requests, the oldest waiting for
/// `oldest_age_seconds` (called on every change of the buffers).
pub fn buffer_state(partition: u32, buffered: usize, oldest_age_seconds: f64) {
    let p = partition.to_string();
    BUFFERED.with_label_values(&[&p]).set(buffered as i64);
    let now = Instant::now();
    let since = (buffered > 0).then(|| now.checked_sub(Duration::from_secs_f64(oldest_age_seconds.max(0.0))).unwrap_or(now));
    OLDEST_SINCE.lock().unwrap_or_else(|e| e.into_inner()).insert(partition, since);
    OLDEST_BUFFERED.with_label_values(&[&p]).set(if buffered > 0 { oldest_age_seconds } else { 0.0 });
}

fn refresh_oldest_ages(now: Instant) {
    let since = OLDEST_SINCE.lock().unwrap_or_else(|e| e.into_inner());
    for (p, s) in since.iter() {
        let age = s.map_or(0.0, |s| now.saturating_duration_since(s).as_secs_f64());
        OLDEST_BUFFERED.with_label_values(&[&p.to_string()]).set(age);
    }
}

/// Removes the per-partition series of a partition this instance no longer owns.
pub fn partition_released(partition: u32) {
    let p = partition.to_string();
    OLDEST_SINCE.lock().unwrap_or_else(|e| e.into_inner()).remove(&partition);
    let _ = BUFFERED.remove_label_values(&[&p]);
    let _ = OLDEST_BUFFERED.remove_label_values(&[&p]);
}

/// End-to-end latency of one request, in seconds.
pub fn end_to_end_latency(seconds: f64) {
    E2E_LATENCY.observe(seconds);
}

/// Number of partitions this instance owns now.
pub fn partitions_owned(n: usize) {
    PARTITIONS_OWNED.set(n as i64);
}

/// A lease operation (`acquire`, `renew`, `release`) ended with `outcome` (`ok`, `lost`, `busy`,
/// `error`).
pub fn lease_op(op: &'static str, outcome: &'static str) {
    LEASE_OPS.with_label_values(&[op, outcome]).inc();
}

/// The desired assignment changed.
pub fn rebalanced() {
    REBALANCES.inc();
}

/// A heartbeat found this instance's membership entry gone within `member_ttl` of its last one
/// ([`crate::ownership`]): Redis lost its data.
pub fn redis_data_lost() {
    REDIS_DATA_LOST.inc();
}

/// A heartbeat found this instance's name held by another live process
/// ([`crate::ownership`]).
pub fn instance_name_conflict() {
    NAME_CONFLICTS.inc();
}

/// Live members seen.
pub fn members(n: usize) {
    MEMBERS.set(n as i64);
}

/// Live members flagged LLM-down ([`crate::membership::member_llm_down_key`]).
pub fn members_llm_down(n: usize) {
    MEMBERS_LLM_DOWN.set(n as i64);
}

/// Live members whose routing settings differ from this instance's
/// ([`crate::membership::member_routing_key`]).
pub fn members_routing_differs(n: usize) {
    MEMBERS_ROUTING_DIFFERS.set(n as i64);
}

/// Mirrors readiness into the `ready` gauge. The state itself lives in
/// [`crate::readiness::Readiness`]; this gauge is only written, never read back.
pub fn set_ready(ready: bool) {
    READY.set(if ready { 1.0 } else { 0.0 });
}

/// The broker blocked (`true`) or unblocked (`false`) the AMQP connection labelled `connection`
/// (one of [`connection`]): sets the 0/1 gauge, and counts each block.
pub fn amqp_connection_blocked(connection: &'static str, blocked: bool) {
    if blocked {
        AMQP_BLOCKED_TOTAL.with_label_values(&[connection]).inc();
    }
    AMQP_BLOCKED.with_label_values(&[connection]).set(i64::from(blocked));
}

/// The session's AMQP connections are open to node `connected` (index in `amqp.urls`) of
/// `nodes`, or to none (`None`, between sessions): sets `amqp_connected_node{node}` to 1 for that
/// node and 0 for every other (the label values are `0..nodes`, bounded by
/// `config::MAX_AMQP_NODES`; never a URL).
pub fn amqp_connected_node(connected: Option<usize>, nodes: usize) {
    for n in 0..nodes {
        AMQP_CONNECTED_NODE.with_label_values(&[n.to_string().as_str()]).set(i64::from(connected == Some(n)));
    }
}

/// Label values of `input_consumer_failures_total`.
pub mod intake_failure {
    /// A message the AMQP client cannot parse closed the intake connection.
    pub const UNREADABLE_MESSAGE: &str = "unreadable_message";
    /// The intake connection closed for another reason.
    pub const CONNECTION_LOST: &str = "connection_lost";
    /// The broker closed the consuming channel.
    pub const CHANNEL_CLOSED: &str = "channel_closed";
    /// Every label value, for [`super::init`].
    pub const ALL: &[&str] = &[UNREADABLE_MESSAGE, CONNECTION_LOST, CHANNEL_CLOSED];
}

/// The router's consumer of the input queue ended under it, for `reason` ([`intake_failure`]).
pub fn intake_failed(reason: &'static str) {
    INTAKE_FAILURES.with_label_values(&[reason]).inc();
}

/// A task of `stage` panicked; its requests were requeued.
pub fn task_panicked(stage: &'static str) {
    TASK_PANICS.with_label_values(&[stage]).inc();
}

/// Deliveries of `partition` held now, neither acked nor nacked.
pub fn unsettled_deliveries(partition: u32, n: usize) {
    UNSETTLED.with_label_values(&[&partition.to_string()]).set(i64::try_from(n).unwrap_or(i64::MAX));
}

/// A result was refused by its `reply_to` queue (`reason`: `nacked`, `unroutable`, `timeout`,
/// `gone`: `crate::publisher::REPLY_REFUSALS`).
pub fn reply_to_refused(reason: &'static str) {
    REPLY_TO_REFUSED.with_label_values(&[reason]).inc();
}

/// A publishing channel was replaced because a publish on it failed (`failed`: true) or it was
/// found closed (false).
pub fn publish_channel_replaced(failed: bool) {
    PUBLISH_CHANNELS_REPLACED.with_label_values(&[if failed { "publish_failed" } else { "closed" }]).inc();
}

/// A destination of the daemon (`queue`: [`crate::publisher::OwnDestination::label`]) was found
/// deleted by a publish and declared again.
pub fn queue_redeclared(queue: &'static str) {
    QUEUES_REDECLARED.with_label_values(&[queue]).inc();
}

/// A partition's intake paused (`true`) or resumed (`false`) on LLM availability.
pub fn intake_paused(partition: u32, paused: bool) {
    INTAKE_PAUSED.with_label_values(&[&partition.to_string()]).set(i64::from(paused));
}

/// A partition's consumer was closed and reopened, for `reason` (one of [`restart`]).
/// A partition's consumer starved for the stall window again after a stall restart: most likely
/// another consumer is active on its queue ([`crate::partition`]).
pub fn partition_other_consumer() {
    PARTITION_OTHER_CONSUMER.inc();
}

pub fn consumer_restarted(reason: &'static str) {
    CONSUMER_RESTARTS.with_label_values(&[reason]).inc();
}

#[cfg(test)]
mod tests {
    /// Observed: a chat key spread at its finest level (4, chat keyed by its opening) never
    /// showed in `key_splits`, which had series for levels 0–3 only.
    #[test]
    fn key_splits_has_every_key_level() {
        super::split_view(&[1, 0, 0, 0, 1], 0);
        let text = super::render();
        for level in 0..crate::keying::OPENING_LEVELS {
            assert!(text.contains(&format!("prefix_batcher_key_splits{{level=\"{level}\"}}")), "no series for level {level}");
        }
        assert!(text.contains("prefix_batcher_key_splits{level=\"4\"} 1"), "{text}");
    }

    #[test]
    fn exposition_has_prefixed_names() {
        super::init(&["ok"], 1, &["results"], &["gone"]);
        super::batch_flushed(crate::batcher::FlushReason::Size, 4, 1.0, 0.9);
        let text = super::render();
        for name in [
            "prefix_batcher_batches_total{reason=\"size\"} 1",
            "prefix_batcher_batch_purity_bucket",
            "prefix_batcher_llm_cached_prompt_tokens_total",
            "prefix_batcher_queue_messages{partition=\"\",queue=\"input\"}",
            "prefix_batcher_partitions_owned",
            "prefix_batcher_build_info{version=",
        ] {
            assert!(text.contains(name), "missing {name}");
        }
    }

    #[test]
    fn oldest_buffered_age_grows_between_buffer_changes() {
        super::init(&["ok"], 1, &["results"], &["gone"]);
        super::buffer_state(1001, 3, 0.25);
        let later = std::time::Instant::now() + std::time::Duration::from_secs(2);
        super::refresh_oldest_ages(later);
        let age = super::OLDEST_BUFFERED.with_label_values(&["1001"]).get();
        assert!((2.2..2.4).contains(&age), "age {age}");
        super::buffer_state(1001, 0, 0.0);
        super::refresh_oldest_ages(later);
        assert_eq!(super::OLDEST_BUFFERED.with_label_values(&["1001"]).get(), 0.0);
        super::partition_released(1001);
        assert!(!super::render().contains("partition=\"1001\""));
    }
}
