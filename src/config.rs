//! Configuration: the raw file/environment form and the validated [`Settings`].
//!
//! Sources, later wins: built-in defaults, the TOML file, then environment variables
//! `PREFIX_BATCHER__SECTION__KEY` (e.g. `PREFIX_BATCHER__BATCHING__MAX_BATCH_SIZE=16`; lists are
//! comma separated, e.g. `PREFIX_BATCHER__LLM__ENDPOINTS=http://a:8000,http://b:8000`).
//! Unknown keys are errors. Durations are human strings (`"250ms"`, `"1s"`, `"2m"`, parsed by
//! `humantime`). Every validation error names the key, the value and the rule.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::num::{NonZeroU32, NonZeroUsize};
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use url::Url;

use crate::tls::{TlsFiles, TlsKeys};

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "PREFIX_BATCHER";
/// Default config path.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/prefix-batcher/config.toml";

/// A configuration error. Exit code 78 (`EX_CONFIG`, sysexits.h).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file is missing, unreadable, not TOML, has unknown keys or values of the wrong type.
    #[error("cannot load configuration: {}", redact_text(&.0.to_string()))]
    Load(#[source] config::ConfigError),
    /// The file is not valid TOML: the parser's message, with the line and column (credentials
    /// in URLs on that line redacted).
    #[error("cannot parse configuration file {path}: {message}")]
    Parse { path: String, message: String },
    /// The file exists but cannot be read (permissions, an I/O error): the operating system's
    /// message.
    #[error("cannot read configuration file {path}: {message}")]
    Read { path: String, message: String },
    /// A value breaks a rule.
    #[error("invalid configuration: `{key}` = {value}: {rule}")]
    Invalid { key: String, value: String, rule: String },
}

fn invalid(key: &str, value: impl fmt::Display, rule: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.to_owned(), value: value.to_string(), rule: rule.into() }
}

/// A secret string. `Debug` and `Display` print `***`, so it cannot reach logs by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The secret itself; only for the place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"***\"")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// A URL whose password is redacted when displayed.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(Url);

impl SecretUrl {
    /// The URL with its password, for the place that connects.
    pub fn expose(&self) -> &str {
        self.0.as_str()
    }
    /// The URL with its password and query parameter `key` set to `value` (replacing any
    /// earlier `key`; `None` leaves the URL as it is), for the place that connects.
    pub fn with_query_pair(&self, key: &str, value: Option<String>) -> String {
        let Some(value) = value else { return self.0.to_string() };
        let mut u = self.0.clone();
        let kept: Vec<(String, String)> = u.query_pairs().filter(|(k, _)| k != key).map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
        u.query_pairs_mut().clear().extend_pairs(kept).append_pair(key, &value);
        u.to_string()
    }
    /// The URL with the password, and the value of every query parameter that may hold a secret
    /// (`?password=`, `?token=`, …), replaced by `***`.
    pub fn redacted(&self) -> String {
        let mut u = self.0.clone();
        if u.password().is_some() {
            let _ = u.set_password(Some("***"));
        }
        if u.fragment().is_some() {
            u.set_fragment(Some("***"));
        }
        if u.query_pairs().any(|(k, _)| is_secret_param(&k)) {
            let pairs: Vec<(String, String)> = u
                .query_pairs()
                .map(|(k, v)| {
                    let v = if is_secret_param(&k) { "***".to_owned() } else { v.into_owned() };
                    (k.into_owned(), v)
                })
                .collect();
            u.query_pairs_mut().clear().extend_pairs(pairs);
        }
        u.to_string()
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

// ---------------------------------------------------------------------------------------------
// Raw form: exactly what the file and environment may contain.
// ---------------------------------------------------------------------------------------------

/// The raw configuration, as written in TOML. See `config/example.toml` for every key.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    pub instance: RawInstance,
    pub amqp: RawAmqp,
    pub redis: RawRedis,
    pub ownership: RawOwnership,
    pub keying: RawKeying,
    pub sharding: RawSharding,
    pub batching: RawBatching,
    pub llm: RawLlm,
    pub requests: crate::policy::RawRequests,
    pub http: RawHttp,
    pub shutdown: RawShutdown,
    pub log: RawLog,
}

/// `[instance]`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawInstance {
    /// Stable instance name; empty means the hostname (plus `INSTANCE` env, set by the systemd
    /// template unit as `%i`).
    pub name: String,
}

/// `[amqp]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawAmqp {
    pub url: String,
    /// The nodes of a RabbitMQ cluster; when not empty it replaces `url`.
    pub urls: Vec<String>,
    pub input_queue: String,
    pub shard_exchange: String,
    pub partition_queue_prefix: String,
    pub results_queue: String,
    pub dead_letter_exchange: String,
    pub dead_letter_queue: String,
    pub partitions: u32,
    pub input_prefetch: u32,
    pub partition_prefetch: u32,
    pub max_message_bytes: usize,
    pub confirm_timeout: String,
    pub reconnect_backoff_initial: String,
    pub reconnect_backoff_max: String,
    pub backlog_poll_interval: String,
    pub consumer_timeout: String,
    pub delivery_limit: u32,
    pub quorum_initial_group_size: u32,
    pub heartbeat: String,
    pub tls_ca_file: String,
    pub tls_cert_file: String,
    pub tls_key_file: String,
}

impl Default for RawAmqp {
    fn default() -> Self {
        RawAmqp {
            url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            urls: Vec::new(),
            input_queue: "prefix-batcher.input".into(),
            shard_exchange: "prefix-batcher.shards".into(),
            partition_queue_prefix: "prefix-batcher.partition".into(),
            results_queue: "prefix-batcher.results".into(),
            dead_letter_exchange: "prefix-batcher.dlx".into(),
            dead_letter_queue: "prefix-batcher.dead-letter".into(),
            partitions: 64,
            input_prefetch: 256,
            partition_prefetch: 64,
            max_message_bytes: 4 << 20,
            confirm_timeout: "30s".into(),
            reconnect_backoff_initial: "500ms".into(),
            reconnect_backoff_max: "30s".into(),
            backlog_poll_interval: "5s".into(),
            consumer_timeout: "30m".into(),
            delivery_limit: 5,
            quorum_initial_group_size: DEFAULT_QUORUM_INITIAL_GROUP_SIZE,
            heartbeat: "10s".into(),
            tls_ca_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
        }
    }
}

/// `[redis]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRedis {
    pub url: String,
    pub key_prefix: String,
    pub command_timeout: String,
    pub tls_ca_file: String,
    pub tls_cert_file: String,
    pub tls_key_file: String,
    /// Redis Sentinel addresses (`host:port`, `redis://[user:pass@]host:port`, or `rediss://…`).
    pub sentinels: Vec<String>,
    /// The master name the sentinels monitor.
    pub sentinel_master: String,
}

impl Default for RawRedis {
    fn default() -> Self {
        RawRedis {
            url: "redis://127.0.0.1:6379/".into(),
            key_prefix: "prefix-batcher".into(),
            command_timeout: "2s".into(),
            tls_ca_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            sentinels: Vec::new(),
            sentinel_master: String::new(),
        }
    }
}

/// `[ownership]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawOwnership {
    pub lease_ttl: String,
    pub renew_deadline: String,
    pub renew_interval: String,
    pub member_ttl: String,
    pub settle_time: String,
    pub llm_down_hand_over_after: String,
}

impl Default for RawOwnership {
    fn default() -> Self {
        RawOwnership {
            lease_ttl: "15s".into(),
            renew_deadline: "10s".into(),
            renew_interval: "3s".into(),
            member_ttl: "10s".into(),
            settle_time: "2s".into(),
            llm_down_hand_over_after: "60s".into(),
        }
    }
}

/// `[keying]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawKeying {
    pub mode: String,
    pub prefix_chars: usize,
    pub chat_key: String,
}

impl Default for RawKeying {
    fn default() -> Self {
        RawKeying { mode: "adaptive".into(), prefix_chars: 256, chat_key: "opening".into() }
    }
}

/// `[sharding]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSharding {
    /// Shards per key in the static `keying.mode = "prefix"` only.
    pub default_shards: u32,
    /// Adaptive mode: the most shards a hot key at its finest level is spread over.
    pub max_shards: u32,
    /// Explicit key or key hex → shards.
    /// A `BTreeMap`, so `check-config` prints the keys in a stable order (diffable across hosts).
    pub keys: BTreeMap<String, u32>,
    pub rules: Vec<RawShardRule>,
}

impl Default for RawSharding {
    fn default() -> Self {
        RawSharding { default_shards: 8, max_shards: 8, keys: BTreeMap::new(), rules: Vec::new() }
    }
}

/// `[[sharding.rules]]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawShardRule {
    /// Regular expression (Rust `regex` syntax) matched against the explicit key or key material.
    pub pattern: String,
    pub shards: u32,
}

/// `[batching]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawBatching {
    pub max_batch_size: usize,
    pub max_batch_wait: String,
    pub channel_capacity: usize,
    pub max_buffered_bytes: usize,
}

impl Default for RawBatching {
    fn default() -> Self {
        RawBatching { max_batch_size: 8, max_batch_wait: "1s".into(), channel_capacity: 64, max_buffered_bytes: 256 << 20 }
    }
}

/// `[llm]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLlm {
    pub endpoints: Vec<String>,
    pub model: String,
    pub api_key: String,
    pub max_concurrency: usize,
    pub request_timeout: String,
    pub connect_timeout: String,
    pub max_attempts: u32,
    pub backoff_initial: String,
    pub backoff_max: String,
    pub list_prompts: bool,
    pub max_response_bytes: usize,
    pub liveness_check_after: String,
    pub tls_ca_file: String,
    pub tls_cert_file: String,
    pub tls_key_file: String,
}

impl Default for RawLlm {
    fn default() -> Self {
        RawLlm {
            endpoints: vec!["http://127.0.0.1:8000".into()],
            model: "default".into(),
            api_key: String::new(),
            max_concurrency: 4,
            request_timeout: "300s".into(),
            connect_timeout: "5s".into(),
            max_attempts: 4,
            backoff_initial: "500ms".into(),
            backoff_max: "30s".into(),
            list_prompts: true,
            max_response_bytes: 64 << 20,
            liveness_check_after: "30s".into(),
            tls_ca_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
        }
    }
}

/// `[http]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawHttp {
    pub listen: String,
}

impl Default for RawHttp {
    fn default() -> Self {
        RawHttp { listen: "127.0.0.1:9464".into() }
    }
}

/// `[shutdown]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawShutdown {
    pub drain_timeout: String,
}

impl Default for RawShutdown {
    fn default() -> Self {
        RawShutdown { drain_timeout: "30s".into() }
    }
}

/// `[log]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLog {
    pub format: String,
    pub level: String,
}

impl Default for RawLog {
    fn default() -> Self {
        RawLog { format: "pretty".into(), level: "info".into() }
    }
}

// ---------------------------------------------------------------------------------------------
// Validated form.
// ---------------------------------------------------------------------------------------------

/// Validated settings. Built only by [`Settings::from_raw`].
#[derive(Debug, Clone)]
pub struct Settings {
    /// Stable instance name (membership, leases, logs).
    pub instance_name: String,
    pub amqp: AmqpSettings,
    pub redis: RedisSettings,
    pub ownership: OwnershipSettings,
    pub keying: KeyingSettings,
    pub sharding: ShardingSettings,
    pub batching: BatchingSettings,
    pub llm: LlmSettings,
    /// `[requests]`: what a requester may ask.
    pub requests: crate::policy::RequestPolicy,
    /// Address of `/metrics`, `/healthz`, `/readyz`; port 0 picks a free port.
    pub http_listen: std::net::SocketAddr,
    /// The whole shutdown (flush, in-flight work, release) must end within this; else exit 70.
    /// LLM calls still running at [`crate::partition::drain_call_cutoff`] of it are abandoned and
    /// their requests put back uncharged.
    pub drain_timeout: Duration,
    pub log: LogSettings,
}

/// Default of `amqp.quorum_initial_group_size`: 3 replicas, the size of the smallest cluster that
/// survives the loss of one node (a quorum queue needs a majority of its replicas,
/// <https://www.rabbitmq.com/docs/quorum-queues#quorum-requirements>).
pub const DEFAULT_QUORUM_INITIAL_GROUP_SIZE: u32 = 3;

/// Most nodes `amqp.urls` may list (it bounds the `node` label of `amqp_connected_node`).
pub const MAX_AMQP_NODES: usize = 16;

/// `[amqp]`, validated.
#[derive(Debug, Clone)]
pub struct AmqpSettings {
    /// The first node of [`AmqpSettings::nodes`] (`amqp.url`, or the first of `amqp.urls`).
    pub url: SecretUrl,
    /// The broker nodes to connect to, in the order they are tried: `amqp.urls` when set, else
    /// `[amqp.url]`. Never empty; all of one scheme (`amqp` or `amqps`); at most
    /// [`MAX_AMQP_NODES`].
    pub nodes: Vec<SecretUrl>,
    pub input_queue: String,
    pub shard_exchange: String,
    pub partition_queue_prefix: String,
    pub results_queue: String,
    pub dead_letter_exchange: String,
    pub dead_letter_queue: String,
    /// `P`: fixed for the life of a deployment.
    pub partitions: NonZeroU32,
    /// Unacked deliveries on the input consumer (AMQP `basic.qos` prefetch count).
    pub input_prefetch: u16,
    /// Unacked deliveries per partition consumer; ≥ `max_batch_size`.
    pub partition_prefetch: u16,
    /// Larger bodies are dead-lettered as `too_large`.
    pub max_message_bytes: usize,
    /// Longest wait for a publisher confirm.
    pub confirm_timeout: Duration,
    pub reconnect_backoff_initial: Duration,
    pub reconnect_backoff_max: Duration,
    /// How often queue depths (backlog) are read.
    pub backlog_poll_interval: Duration,
    /// The broker's acknowledgement timeout (RabbitMQ `consumer_timeout`, 30 min by default:
    /// <https://www.rabbitmq.com/docs/consumers#acknowledgement-timeout>). A delivery held longer
    /// makes the broker close the channel. [`Settings::longest_hold`] stays within
    /// [`CONSUMER_TIMEOUT_MARGIN`] of it (checked at load).
    pub consumer_timeout: Duration,
    /// Deliveries of one request (the first one included) after which the daemon dead-letters it
    /// with reason `delivery_limit` instead of processing it again. ≥ 1.
    pub delivery_limit: NonZeroU32,
    /// `x-quorum-initial-group-size` of the queues the daemon declares (replicas of a new quorum
    /// queue; RabbitMQ caps it at the cluster's node count). `None` (`0` in the configuration):
    /// the argument is left out and the broker's default applies (every cluster node).
    pub quorum_initial_group_size: Option<NonZeroU32>,
    /// The AMQP heartbeat timeout the daemon asks for, in whole seconds (`amqp.heartbeat`;
    /// 0: the broker's own, 60 s on RabbitMQ). The connection uses the lower of this and the
    /// broker's value (lapin's negotiation). RabbitMQ closes a connection that sent nothing for
    /// about two such intervals (<https://www.rabbitmq.com/docs/heartbeats>), which is what ends
    /// the single-active-consumer hold of a frozen instance (SIGSTOP, a stalled VM) on its
    /// partition queues.
    pub heartbeat: u16,
    /// TLS files for `amqps://` ([`crate::tls`]).
    pub tls: TlsFiles,
}

impl AmqpSettings {
    /// The URL of node `node` to connect with: [`AmqpSettings::nodes`]`[node]` with the
    /// `heartbeat` query parameter (seconds) that lapin reads from the URL, unless
    /// [`AmqpSettings::heartbeat`] is 0. Contains the password: only for the place that connects.
    /// Panics when `node` is out of range.
    pub fn connect_url(&self, node: usize) -> String {
        self.nodes[node].with_query_pair("heartbeat", (self.heartbeat > 0).then(|| self.heartbeat.to_string()))
    }

    /// [`AmqpSettings::connect_url`] as the AMQP client reads it. An IPv6 literal host
    /// (`amqp://u:p@[2001:db8::5]:5672/%2f`) is kept: lapin's own URL parser takes only domain
    /// names and would connect to `localhost` instead. Contains the password.
    /// Panics when `node` is out of range (the URL was checked at load).
    pub fn connect_uri(&self, node: usize) -> lapin::uri::AMQPUri {
        let mut uri: lapin::uri::AMQPUri = self.connect_url(node).parse().expect("broker URL checked at load");
        if let Some(url::Host::Ipv6(ip)) = self.nodes[node].0.host() {
            uri.authority.host = ip.to_string();
        }
        uri
    }

    /// Name of partition queue `p`: `{prefix}.{p:03}` (zero padded to at least 3 digits).
    pub fn partition_queue(&self, p: u32) -> String {
        format!("{}.{:03}", self.partition_queue_prefix, p)
    }
    /// Routing key of partition `p` on the shard exchange (the partition number in decimal).
    pub fn partition_routing_key(p: u32) -> String {
        p.to_string()
    }
}

/// `[redis]`, validated.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    pub url: SecretUrl,
    /// Prefix of every Redis key, e.g. `prefix-batcher:lease:7`.
    pub key_prefix: String,
    pub command_timeout: Duration,
    /// TLS files for `rediss://` ([`crate::tls`]).
    pub tls: TlsFiles,
    /// `redis.sentinels` + `redis.sentinel_master`: when set, the primary's address comes from
    /// the sentinels and only the credentials, database and scheme of `url` apply to it.
    pub sentinel: Option<SentinelSettings>,
}

/// Redis Sentinel discovery (`redis.sentinels`, `redis.sentinel_master`), validated.
#[derive(Debug, Clone)]
pub struct SentinelSettings {
    /// At least one sentinel, as `redis://` or `rediss://` URLs (a bare `host:port` becomes
    /// `redis://host:port`). Credentials, when given, must be the same in every entry (the
    /// redis crate authenticates to all sentinels alike).
    pub addrs: Vec<SecretUrl>,
    /// The master name the sentinels monitor (`sentinel monitor <name> …`).
    pub master: String,
}

/// `[ownership]`, validated: `lease_ttl > renew_deadline > 1.2 × renew_interval` (the Kubernetes
/// leader-election rule: client-go `leaderelection` requires LeaseDuration > RenewDeadline >
/// JitterFactor(1.2) × RetryPeriod).
#[derive(Debug, Clone)]
pub struct OwnershipSettings {
    pub lease_ttl: Duration,
    pub renew_deadline: Duration,
    pub renew_interval: Duration,
    pub member_ttl: Duration,
    pub settle_time: Duration,
    /// When every LLM endpoint of this instance has been down (circuit breakers open) for this
    /// long, the instance flags itself in the member set and its partitions move to the members
    /// whose LLM is up, until an endpoint answers its probe again
    /// ([`crate::membership::assignable`]). Zero: never; the partitions wait for the endpoint.
    pub llm_down_hand_over_after: Duration,
}

/// `keying.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyingMode {
    /// The default: route by the shortest key level that is not split, splitting hot keys and
    /// merging them back by measured load ([`crate::affinity`]); batch by the routed key.
    Adaptive,
    /// Static: route and batch by the level-0 prefix key, spread over a fixed number of shards
    /// (`sharding.keys`, `sharding.rules`, `sharding.default_shards`).
    Prefix,
    /// A/B baseline: random partition, one mixed batch per partition.
    Off,
}

/// `keying.chat_key`: what key material a chat request yields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatKey {
    /// The default: the first `prefix_chars` characters of the conversation's opening, i.e. the
    /// role-tagged rendering of its messages through the first user message (constant over all
    /// turns of a conversation). In adaptive mode its deeper levels are 4×, 16× and 64× longer
    /// cuts of the opening, like a completions prompt's, then the second user turn.
    Opening,
    /// All leading system/developer messages; without any, the first `prefix_chars` of the first
    /// user message.
    System,
    /// Leading system/developer messages plus the first user message.
    SystemAndFirstUser,
    /// The first `prefix_chars` characters of the role-tagged conversation.
    Rendered,
}

/// `[keying]`, validated.
#[derive(Debug, Clone)]
pub struct KeyingSettings {
    pub mode: KeyingMode,
    /// Characters (Unicode scalar values) of a completions prompt that form its level-0 key
    /// (deeper levels are 4×, 16× and 64× longer, see [`crate::keying::level_key`]).
    pub prefix_chars: NonZeroUsize,
    pub chat_key: ChatKey,
}

/// One pattern rule of `[[sharding.rules]]`.
#[derive(Debug, Clone)]
pub struct ShardRule {
    pub pattern: regex::Regex,
    pub shards: NonZeroU32,
}

/// `[sharding]`, validated.
#[derive(Debug, Clone)]
pub struct ShardingSettings {
    /// Shards per key in the static `prefix` mode (keys without a table entry or rule).
    pub default_shards: NonZeroU32,
    /// Adaptive mode: shards a hot finest-level key (or hot explicit key) is spread over; at most
    /// `amqp.partitions` (a larger configured value is capped).
    pub max_shards: NonZeroU32,
    pub keys: HashMap<String, NonZeroU32>,
    pub rules: Vec<ShardRule>,
}

/// `[batching]`, validated.
#[derive(Debug, Clone)]
pub struct BatchingSettings {
    pub max_batch_size: NonZeroUsize,
    /// Never zero.
    pub max_batch_wait: Duration,
    /// Capacity of the bounded channels between stages.
    pub channel_capacity: NonZeroUsize,
    /// Byte budget for request bodies held by this instance (buffered in batches and in flight
    /// to the LLM), in bytes; ≥ `amqp.max_message_bytes`, so any accepted request fits.
    pub max_buffered_bytes: NonZeroUsize,
}

/// `[llm]`, validated.
#[derive(Debug, Clone)]
pub struct LlmSettings {
    /// Base URLs (without `/v1`).
    pub endpoints: Vec<Url>,
    /// Model sent when a request names none.
    pub model: String,
    /// Bearer token.
    pub api_key: Option<Secret>,
    /// HTTP calls in flight per endpoint.
    pub max_concurrency: NonZeroUsize,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub max_attempts: NonZeroU32,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Send a completions batch as one call with a list `prompt` (vLLM, SGLang). `false`: one call
    /// per prompt, back to back under one concurrency permit — for servers with per-slot caches
    /// that report usage for the first prompt of a list only (llama.cpp's llama-server).
    pub list_prompts: bool,
    /// Longest LLM response body read, in bytes; a longer one fails the call as an invalid response.
    pub max_response_bytes: NonZeroUsize,
    /// How long a call may wait without any answer from its endpoint before the endpoint's HTTP
    /// server is checked ([`crate::llm`], "Liveness"); `None` (`"0s"`): never checked.
    pub liveness_check_after: Option<Duration>,
    /// TLS files for `https://` endpoints ([`crate::tls`]).
    pub tls: TlsFiles,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Pretty,
    Json,
}

/// `[log]`, validated.
#[derive(Debug, Clone)]
pub struct LogSettings {
    pub format: LogFormat,
    /// A `tracing_subscriber::EnvFilter` directive; `RUST_LOG` wins when set.
    pub level: String,
}

/// Loads the raw configuration: defaults, then the file (when `path` is given), then the
/// environment.
pub fn load_raw(path: Option<&Path>) -> Result<RawConfig, ConfigError> {
    check_env_names(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()))?;
    let mut b = config::Config::builder();
    if let Some(p) = path.filter(|p| p.is_dir()) {
        // The config crate would say "not found" for a directory.
        return Err(invalid("--config", format!("{:?}", p.display().to_string()), "is a directory; give the path of a TOML file"));
    }
    // The text of a configuration file that is not a regular file (read once, used twice).
    let mut read: Option<String> = None;
    if let Some(p) = path {
        // The `config` crate drops the line of a TOML error (e.g. an integer beyond 64 bits);
        // the `toml` crate's message shows it. A missing file is the crate's to say; one that
        // exists but cannot be read is named here with the system's reason.
        match std::fs::read_to_string(p) {
            Ok(text) => match text.parse::<toml::Table>() {
                Ok(table) => {
                    check_file_names(&table)?;
                    if !p.is_file() {
                        // /dev/null, a named pipe or a process substitution (`<(…)`): the config
                        // crate reads only regular files and would say "not found", and a pipe
                        // can be read once, so the text already read is the source.
                        read = Some(text);
                    }
                }
                Err(e) => {
                    return Err(ConfigError::Parse { path: p.display().to_string(), message: redact_text(&redact_key_material(&e.to_string())) });
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                let message = "the file is not UTF-8 text: TOML files must be UTF-8 (https://toml.io/en/v1.0.0#spec); \
                               convert one saved as UTF-16, e.g. `iconv -f UTF-16 -t UTF-8`";
                return Err(ConfigError::Parse { path: p.display().to_string(), message: message.into() });
            }
            // Missing: the config crate's "configuration file … not found".
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ConfigError::Read { path: p.display().to_string(), message: e.to_string() }),
        }
        b = b.add_source(file_source(p, read.as_deref()));
    }
    b = b.add_source(
        config::Environment::with_prefix(ENV_PREFIX)
            .prefix_separator("__")
            .separator("__")
            .try_parsing(true)
            .list_separator(",")
            .with_list_parse_key("amqp.urls")
            .with_list_parse_key("llm.endpoints")
            .with_list_parse_key("redis.sentinels")
            .with_list_parse_key("requests.allowed_params")
            .with_list_parse_key("requests.models"),
    );
    let cfg = b.build().map_err(ConfigError::Load)?;
    if let Some(p) = path {
        // The file alone: there a quoted number or boolean is a mistake, not an environment string.
        let file = config::Config::builder().add_source(file_source(p, read.as_deref())).build();
        let file: serde_json::Value = file.and_then(|f| f.try_deserialize()).map_err(ConfigError::Load)?;
        check_value_types(&file, false)?;
    }
    let merged: serde_json::Value = cfg.clone().try_deserialize().map_err(ConfigError::Load)?;
    check_value_types(&merged, true)?;
    let raw = cfg.try_deserialize::<RawConfig>().map_err(ConfigError::Load)?;
    let vars = std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
    let mut raw = keep_env_strings(raw, vars)?;
    // A list from the environment is split at commas as written (`a, b` gives " b"): trim each
    // item, so that what `check-config` prints is what is used.
    for list in [&mut raw.amqp.urls, &mut raw.llm.endpoints, &mut raw.redis.sentinels, &mut raw.requests.allowed_params, &mut raw.requests.models] {
        for item in list.iter_mut() {
            if item.trim().len() != item.len() {
                *item = item.trim().to_owned();
            }
        }
    }
    Ok(raw)
}

/// Puts back verbatim the environment's values of string keys. The `config` crate reads an
/// environment value that looks like a number or a boolean as one (`try_parsing`, which integer,
/// boolean and list keys need) and gives a string key its text again: `007` came back as `7`,
/// and a 26-digit `llm.api_key` as the text of a float (`1234567890123456800000000`), so every
/// call was refused with 401. `vars`: the environment, as `(name, value)`.
/// Errors: none in practice (the configuration read before deserializes again).
fn keep_env_strings(raw: RawConfig, vars: impl Iterator<Item = (String, String)>) -> Result<RawConfig, ConfigError> {
    let prefix = format!("{ENV_PREFIX}__");
    let mut tree = serde_json::to_value(&raw).expect("the configuration serializes");
    let mut changed = false;
    for (var, value) in vars {
        let Some(rest) = var.strip_prefix(&prefix) else { continue };
        let mut node = Some(&mut tree);
        for part in rest.split("__").map(str::to_lowercase) {
            node = node.and_then(|n| n.get_mut(&part));
        }
        if let Some(serde_json::Value::String(s)) = node {
            if *s != value {
                *s = value;
                changed = true;
            }
        }
    }
    if !changed {
        return Ok(raw);
    }
    serde_json::from_value(tree).map_err(|e| ConfigError::Load(config::ConfigError::Message(e.to_string())))
}

/// The configuration file as a source of the `config` crate: the file at `p`, or `text` when it
/// was read already because `p` is not a regular file.
fn file_source(p: &Path, text: Option<&str>) -> Vec<Box<dyn config::Source + Send + Sync>> {
    match text {
        Some(text) => vec![Box::new(config::File::from_str(text, config::FileFormat::Toml))],
        None => vec![Box::new(config::File::from(p).format(config::FileFormat::Toml).required(true))],
    }
}

/// Refuses a key of the configuration file that names no configuration key, naming it (as
/// `section.key`), its value (numbers and booleans as written; a string only by its length: a
/// misspelt `pasword` holds a secret) and the keys its section has. The deserializer's own
/// message names only the field, not its section or value. A key under a section that has no
/// fixed keys in the defaults (an optional table, `sharding.keys`, the `sharding.rules` list) is
/// left to the deserializer.
fn check_file_names(file: &toml::Table) -> Result<(), ConfigError> {
    fn walk(table: &toml::Table, defaults: &serde_json::Map<String, serde_json::Value>, path: &str) -> Result<(), ConfigError> {
        for (name, value) in table {
            let dotted = if path.is_empty() { name.clone() } else { format!("{path}.{name}") };
            let Some(default) = defaults.get(name) else {
                let known: Vec<&str> = defaults.keys().map(String::as_str).collect();
                let rule = if path.is_empty() {
                    format!("not a configuration key: there is no section `{name}` (sections: {})", known.join(", "))
                } else {
                    format!("not a configuration key: [{path}] has no key `{name}` (keys: {})", known.join(", "))
                };
                // Numbers, booleans and dates as written; what may hold a secret only by its shape.
                let shown = match value {
                    toml::Value::String(s) => format!("a string of {} characters (not shown: it may be a secret)", s.chars().count()),
                    toml::Value::Array(a) => format!("an array of {} value{} (not shown: it may hold secrets)", a.len(), if a.len() == 1 { "" } else { "s" }),
                    toml::Value::Table(_) => "a table".to_owned(),
                    other => other.to_string(),
                };
                return Err(invalid(&dotted, shown, rule));
            };
            if let (toml::Value::Table(inner), serde_json::Value::Object(fields)) = (value, default) {
                if !fields.is_empty() {
                    walk(inner, fields, &dotted)?;
                }
            }
        }
        Ok(())
    }
    let defaults = serde_json::to_value(RawConfig::default()).expect("the defaults serialize");
    let serde_json::Value::Object(sections) = defaults else { unreachable!("the configuration is a table") };
    walk(file, &sections, "")
}

/// Refuses an environment variable `PREFIX_BATCHER__…` that names no configuration key, naming
/// the variable (its value is not shown: it may be a secret). The `config` crate's own error
/// names only the first unknown field, not where it came from, and a stale line in a service's
/// environment file is hard to find from that. A key under a section that has no fixed keys in
/// the defaults (an optional table) is left to the deserializer; `sharding.keys` and
/// `sharding.rules` are refused as file-only.
fn check_env_names(vars: impl Iterator<Item = String>) -> Result<(), ConfigError> {
    let defaults = serde_json::to_value(RawConfig::default()).expect("the defaults serialize");
    let prefix = format!("{ENV_PREFIX}__");
    let one_underscore = format!("{ENV_PREFIX}_");
    for var in vars {
        let Some(rest) = var.strip_prefix(&prefix) else {
            // `PREFIX_BATCHER_AMQP__PARTITIONS`: an override with one underscore too few after the
            // prefix would be ignored without a word.
            if let Some(rest) = var.strip_prefix(&one_underscore).filter(|r| r.contains("__") && !r.starts_with('_')) {
                let dotted = rest.split("__").map(str::to_lowercase).collect::<Vec<_>>().join(".");
                return Err(invalid(&dotted, format!("set by {var}"), format!("not read: configuration variables start with {prefix} (two underscores)")));
            }
            // `PREFIX_BATCHER_AMQP_PARTITIONS`: single underscores throughout, where a section and
            // one of its keys are meant. Only such names: other `PREFIX_BATCHER_…` variables
            // (the scripts' `PREFIX_BATCHER_DATA`, …) are not the daemon's.
            if let Some(dotted) = var.strip_prefix(&one_underscore).and_then(|r| single_underscore_key(&defaults, &r.to_lowercase())) {
                let meant = format!("{prefix}{}", dotted.replace('.', "__").to_uppercase());
                return Err(invalid(&dotted, format!("set by {var}"), format!("not read: configuration variables separate the prefix, the section and the key with two underscores: {meant}")));
            }
            continue;
        };
        let path: Vec<String> = rest.split("__").map(str::to_lowercase).collect();
        let dotted = path.join(".");
        let set_by = format!("set by {var}");
        if dotted.starts_with("sharding.keys") || dotted.starts_with("sharding.rules") {
            return Err(invalid(&dotted, set_by, "sharding.keys and sharding.rules can only be set in the configuration file"));
        }
        let mut node = &defaults;
        for (i, part) in path.iter().enumerate() {
            let serde_json::Value::Object(fields) = node else { break };
            match fields.get(part) {
                Some(next) => node = next,
                None => {
                    let known: Vec<&str> = fields.keys().map(String::as_str).collect();
                    let rule = if i == 0 {
                        format!("not a configuration key: there is no section `{part}` (sections: {})", known.join(", "))
                    } else {
                        format!("not a configuration key: [{}] has no key `{part}` (keys: {})", path[..i].join("."), known.join(", "))
                    };
                    return Err(invalid(&dotted, set_by, rule));
                }
            }
        }
        if matches!(node, serde_json::Value::Object(f) if !f.is_empty()) {
            return Err(invalid(&dotted, set_by, "names a section, not a key: write PREFIX_BATCHER__SECTION__KEY"));
        }
    }
    Ok(())
}

/// The configuration key (`section.key`) that `rest` (lower case) names when its section and key
/// are joined by one underscore instead of two (`amqp_partitions` → `amqp.partitions`), if any.
fn single_underscore_key(defaults: &serde_json::Value, rest: &str) -> Option<String> {
    let serde_json::Value::Object(sections) = defaults else { return None };
    sections.iter().find_map(|(section, keys)| {
        let key = rest.strip_prefix(section.as_str())?.strip_prefix('_')?;
        let serde_json::Value::Object(keys) = keys else { return None };
        keys.contains_key(key).then(|| format!("{section}.{key}"))
    })
}

/// The kind of value a key takes, where the `config` crate would otherwise convert silently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueKind {
    /// A whole number: `config` rounds a float (`partitions = 8.5` became 9) and reads `true` as 1.
    Integer,
    /// `true` or `false`: `config` reads `1`, `"1"`, `"yes"` or `"on"` as `true`.
    Boolean,
}

/// Refuses a value of the wrong kind for an integer or boolean key, instead of letting the
/// `config` crate round or convert it. `merged` is the file and the environment merged, as JSON;
/// each key's kind is that of its default ([`RawConfig::default`]), and `sharding.keys.*` and
/// `sharding.rules[].shards` are integers, and no integer key takes a negative value. With
/// `strings` (the environment, whose values are all strings), a string is accepted where it is
/// exactly an integer (`"8"`) or `"true"`/`"false"`; without (the TOML file), it is refused.
/// Errors: the first wrong value, as [`ConfigError::Invalid`] naming the key
/// (`sharding.rules[0].shards`) and the value.
fn check_value_types(merged: &serde_json::Value, strings: bool) -> Result<(), ConfigError> {
    let defaults = serde_json::to_value(RawConfig::default()).expect("the defaults serialize");
    check_kinds(merged, Some(&defaults), "", strings)
}

fn check_kinds(value: &serde_json::Value, default: Option<&serde_json::Value>, path: &str, strings: bool) -> Result<(), ConfigError> {
    use serde_json::Value as J;
    let integer = J::from(1u32);
    let rule = serde_json::json!({ "pattern": "", "shards": 1u32 });
    match value {
        J::Object(fields) => {
            // Every rule needs both fields; the deserializer's own message would name
            // `sharding.rules[0]pattern`.
            if path.starts_with("sharding.rules[") {
                if let Some(missing) = ["pattern", "shards"].into_iter().find(|f| !fields.contains_key(*f)) {
                    return Err(invalid(&format!("{path}.{missing}"), "(missing)", "every [[sharding.rules]] entry needs `pattern` and `shards`"));
                }
                // The deserializer would read `pattern = 5` as the text "5".
                if let Some(p) = fields.get("pattern").filter(|p| !p.is_string()) {
                    return Err(invalid(&format!("{path}.pattern"), p, "must be a regular expression in quotes"));
                }
            }
            for (k, v) in fields {
                // Table keys as TOML writes them when they need quotes (`sharding.keys."tenant-42"`).
                let child = match path {
                    "" => k.clone(),
                    "sharding.keys" => format!("{path}.{k:?}"),
                    _ => format!("{path}.{k}"),
                };
                let d = if path == "sharding.keys" { Some(&integer) } else { default.and_then(|d| d.get(k)) };
                check_kinds(v, d, &child, strings)?;
            }
            Ok(())
        }
        J::Array(items) => {
            let template = if path == "sharding.rules" { Some(&rule) } else { default.and_then(|d| d.get(0)) };
            for (i, v) in items.iter().enumerate() {
                check_kinds(v, template, &format!("{path}[{i}]"), strings)?;
            }
            Ok(())
        }
        leaf => match default.and_then(kind_of) {
            Some(kind) if leaf.is_string() && !strings => {
                let unquoted = leaf.as_str().unwrap_or_default();
                let what = if kind == ValueKind::Integer { "a whole number" } else { "true or false" };
                Err(invalid(path, leaf, format!("must be {what} without quotes ({path} = {unquoted})")))
            }
            // The environment's `inf` and `NaN` parse as floats that JSON holds as null.
            Some(ValueKind::Integer) if leaf.is_null() => Err(invalid(path, "inf or NaN", "must be a whole number")),
            // An environment value of digits beyond 64 bits, which `config` parses as a float.
            Some(ValueKind::Integer) if leaf.is_f64() && leaf.as_f64().is_some_and(|f| f.fract() == 0.0 && f.abs() >= i64::MAX as f64) => {
                Err(invalid(path, format!("{:.0}", leaf.as_f64().unwrap_or_default()), format!("is too large: must be a whole number of at most {} (each key's own limit is lower, see docs/configuration.md)", i64::MAX)))
            }
            Some(ValueKind::Integer) if !is_integer(leaf) => {
                Err(invalid(path, leaf, "must be a whole number (a fraction would be rounded, true/false read as 1/0)"))
            }
            Some(ValueKind::Integer) if is_negative(leaf) => Err(invalid(path, leaf, "must not be negative")),
            Some(ValueKind::Boolean) if !is_boolean(leaf) => Err(invalid(path, leaf, "must be true or false")),
            _ => Ok(()),
        },
    }
}

fn kind_of(default: &serde_json::Value) -> Option<ValueKind> {
    match default {
        serde_json::Value::Number(n) if n.is_u64() || n.is_i64() => Some(ValueKind::Integer),
        serde_json::Value::Bool(_) => Some(ValueKind::Boolean),
        _ => None,
    }
}

fn is_integer(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Number(n) => n.is_u64() || n.is_i64(),
        serde_json::Value::String(s) => s.parse::<i128>().is_ok(),
        _ => false,
    }
}

fn is_negative(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Number(n) => n.as_i64().is_some_and(|i| i < 0),
        serde_json::Value::String(s) => s.parse::<i128>().is_ok_and(|i| i < 0),
        _ => false,
    }
}

fn is_boolean(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Bool(_) => true,
        serde_json::Value::String(s) => s == "true" || s == "false",
        _ => false,
    }
}

/// The longest duration any key takes (365 days): longer ones would overflow where they are used
/// (Redis `PX` takes a signed 64-bit count of milliseconds; a deadline is now + the duration), and
/// none of the daemon's durations means anything at that length.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

fn duration(key: &'static str, v: &str) -> Result<Duration, ConfigError> {
    if v.trim().starts_with('-') {
        return Err(invalid(key, format!("{v:?}"), "must not be negative: a duration such as \"250ms\" or \"1s\""));
    }
    let d = humantime::parse_duration(v.trim())
        .map_err(|e| invalid(key, format!("{v:?}"), format!("must be a duration such as \"250ms\" or \"1s\" ({e})")))?;
    if d > MAX_DURATION {
        return Err(invalid(key, format!("{v:?}"), "must be at most 365 days"));
    }
    Ok(d)
}

fn positive_duration(key: &'static str, v: &str) -> Result<Duration, ConfigError> {
    let d = duration(key, v)?;
    if d.is_zero() {
        return Err(invalid(key, format!("{v:?}"), "must be greater than zero"));
    }
    Ok(d)
}

fn nonzero_u32(key: &'static str, v: u32) -> Result<NonZeroU32, ConfigError> {
    NonZeroU32::new(v).ok_or_else(|| invalid(key, v, "must be at least 1"))
}

/// Largest `batching.channel_capacity`.
pub const MAX_CHANNEL_CAPACITY: usize = 1_000_000;

fn nonzero_usize(key: &'static str, v: usize) -> Result<NonZeroUsize, ConfigError> {
    NonZeroUsize::new(v).ok_or_else(|| invalid(key, v, "must be at least 1"))
}

fn name(key: &'static str, v: &str) -> Result<String, ConfigError> {
    // Invisible characters too (`is_control_like` refuses them, and here the zero-width
    // joiners as well): a name that looks like another in the log and in `status` is not a
    // different name to a reader.
    let joiner = |c: char| matches!(c, '\u{200C}' | '\u{200D}');
    if v.is_empty() || v.len() > 200 || v.chars().any(|c| c.is_whitespace() || crate::request::is_control_like(c) || joiner(c)) {
        return Err(invalid(key, format!("{v:?}"), "must be 1 to 200 characters without spaces, control, invisible or bidirectional formatting characters"));
    }
    Ok(v.to_owned())
}

/// `redis.key_prefix`: a [`name`] without Redis glob characters (`*`, `?`, `[`, `]`, `\`). The
/// documented way to find or delete a deployment's keys is a `SCAN` with the pattern
/// `<prefix>:*` (<https://redis.io/docs/latest/commands/keys/>), and in a prefix these characters
/// would match other deployments' keys.
fn key_prefix(v: &str) -> Result<String, ConfigError> {
    let v = name("redis.key_prefix", v)?;
    if v.contains(['*', '?', '[', ']', '\\']) {
        return Err(invalid(
            "redis.key_prefix",
            format!("{v:?}"),
            "must not contain the Redis glob characters * ? [ ] \\ (the pattern <prefix>:* that finds a deployment's keys would match other deployments' keys)",
        ));
    }
    Ok(v)
}

fn secret_url(key: &'static str, v: &str, schemes: &[&str]) -> Result<SecretUrl, ConfigError> {
    let u = Url::parse(v).map_err(|e| {
        invalid(key, redact_str(v), format!("must be a URL such as {}://host:port (scheme one of {}; percent-encode '/', '#', '@' (and ',' in a list set by an environment variable) in passwords; {e})", schemes[0], schemes.join(", ")))
    })?;
    if !schemes.contains(&u.scheme()) {
        return Err(invalid(key, redact_str(v), format!("scheme must be one of {schemes:?}")));
    }
    if u.host_str().is_none_or(str::is_empty) && u.scheme() != "unix" && u.scheme() != "redis+unix" {
        return Err(invalid(key, redact_str(v), "must name a host (percent-encode '/', '#', '@' (and ',' in a list set by an environment variable) in passwords)"));
    }
    let u = SecretUrl(u);
    for (part, text) in [("user", u.0.username()), ("password", u.0.password().unwrap_or_default())] {
        if !percent_escapes_are_whole(text) {
            return Err(invalid(key, u.redacted(), format!("its {part} has a '%' that does not start a percent-escape of two hex digits (write '%' itself as %25)")));
        }
    }
    Ok(u)
}

/// Whether every `%` in `text` starts a percent-escape (`%` and two hex digits, RFC 3986 §2.1).
/// Clients decode the user and password of a URL; a stray `%` is left as is by some and refused
/// by others, so the login would fail with a password that looks right in the file.
fn percent_escapes_are_whole(text: &str) -> bool {
    let b = text.as_bytes();
    b.iter().enumerate().filter(|(_, c)| **c == b'%').all(|(i, _)| b.len() > i + 2 && b[i + 1].is_ascii_hexdigit() && b[i + 2].is_ascii_hexdigit())
}

/// Redacts the password of something that may be a URL but failed to parse as one, and leaves
/// out its query and fragment (`?token=…`), quoted for an error message. Anything before the
/// last `@` may be credentials, whatever the rest looks like.
fn redact_str(v: &str) -> String {
    match redact_unparsed(v) {
        (shown, true) => format!("{shown:?} (query not shown)"),
        (shown, false) => format!("{shown:?}"),
    }
}

/// [`redact_str`] unquoted: the text shown, and whether a query or fragment was left out.
fn redact_unparsed(v: &str) -> (String, bool) {
    let s = match (v.find("://"), v.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}***{}", &v[..s + 3], &v[at..]),
        (_, Some(at)) => format!("***{}", &v[at..]),
        // No '@': a list item from the environment may be the first half of a URL whose password
        // holds a comma (`amqp://u:pa,ss@h` splits into `amqp://u:pa` and `ss@h`). After a colon
        // in the authority, only a port (digits) is shown.
        (Some(s), None) => {
            let end = v[s + 3..].find(['/', '?', '#']).map_or(v.len(), |e| s + 3 + e);
            let authority = &v[s + 3..end];
            match authority.rfind(':') {
                Some(c) if !authority.ends_with(']') && !authority[c + 1..].bytes().all(|b| b.is_ascii_digit()) => {
                    format!("{}{}:***{}", &v[..s + 3], &authority[..c], &v[end..])
                }
                _ => v.to_owned(),
            }
        }
        _ => v.to_owned(),
    };
    let authority = s.rfind('@').or_else(|| s.find("://").map(|i| i + 3)).unwrap_or(0);
    match s[authority..].find(['?', '#']) {
        Some(q) => (s[..authority + q].to_owned(), true),
        None => (s, false),
    }
}

/// Whether a URL query parameter may hold a secret (`password`, `token`, `api_key`, `auth`, …):
/// its value is shown as `***`. Not `auth_mechanism` (lapin's `plain`, `amqplain`, `external` or
/// `anonymous`: a name an operator checking the configuration wants to see).
fn is_secret_param(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n != "auth_mechanism" && SECRET_PARAM_WORDS.iter().any(|s| n.contains(s))
}

/// Parts of a URL query parameter's name that mark it as holding a secret (lowercase).
const SECRET_PARAM_WORDS: [&str; 8] = ["pass", "pwd", "secret", "token", "key", "auth", "cred", "sig"];

/// Redacts credentials from free text (errors of the TOML parser and the `config` crate quote
/// source lines): `scheme://user:password@`, URL query parameters that may hold a secret
/// (`?password=…`, as [`SecretUrl::redacted`]) and `api_key = …`.
pub fn redact_text(text: &str) -> String {
    static URL_CREDS: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(r"([A-Za-z0-9+.-]*:?/*[^\s:/@\x22']*:)[^\s@\x22']*@").expect("valid regex"));
    // Matched on the ASCII-lowercased text, whose byte offsets are the same (the crate is built
    // without Unicode case folding, so no `(?i)`).
    static QUERY_SECRET: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        let words = SECRET_PARAM_WORDS.join("|");
        regex::Regex::new(&format!(r"[?&][^\s=&#\x22']*(?:{words})[^\s=&#\x22']*=([^\s&#\x22']*)")).expect("valid regex")
    });
    static API_KEY: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(r#"(api_key["']?\s*=\s*).*"#).expect("valid regex"));
    let t = URL_CREDS.replace_all(text, "${1}***@");
    let lower = t.to_ascii_lowercase();
    let (mut shown, mut from) = (String::with_capacity(t.len()), 0);
    for value in QUERY_SECRET.captures_iter(&lower).filter_map(|c| c.get(1)) {
        shown.push_str(&t[from..value.start()]);
        shown.push_str("***");
        from = value.end();
    }
    shown.push_str(&t[from..]);
    API_KEY.replace_all(&shown, "${1}***").into_owned()
}

/// A TOML parse error's excerpt of the file with what may be a private key taken out: the value
/// of a `tls_key_file` line, and every run of 40 or more characters of the base64 alphabet (a
/// line of a PEM key pasted into a `"""` string, or a key without its PEM lines).
fn redact_key_material(text: &str) -> String {
    static KEY_FILE: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(r#"(tls_key_file["']?\s*=\s*).*"#).expect("valid regex"));
    static BASE64_RUN: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(r"[A-Za-z0-9+/=]{40,}").expect("valid regex"));
    let t = KEY_FILE.replace_all(text, "${1}***");
    BASE64_RUN.replace_all(&t, "***").into_owned()
}

/// Default instance name: the hostname, plus `-{INSTANCE}` when the systemd template sets it.
pub fn default_instance_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into());
    match std::env::var("INSTANCE") {
        Ok(i) if !i.is_empty() => format!("{host}-{i}"),
        _ => host,
    }
}

impl Settings {
    /// Each link's configuration section (`amqp`, `redis`, `llm`) and its TLS files.
    pub fn tls_links(&self) -> [(&'static str, &TlsFiles); 3] {
        [("amqp", &self.amqp.tls), ("redis", &self.redis.tls), ("llm", &self.llm.tls)]
    }

    /// The settings every instance of a deployment must share: for a key to land on one
    /// partition, `keying.mode`, `keying.prefix_chars`, `keying.chat_key`,
    /// `sharding.default_shards`, `sharding.max_shards`, and a hash of `sharding.keys` and
    /// `sharding.rules` (their text can be long); for a request to get the same outcome whichever
    /// instance takes it, a hash of the request rules (`[requests]`, `amqp.max_message_bytes`,
    /// `amqp.delivery_limit`).
    /// `amqp.partitions` is checked apart, against the broker's queues. One line, e.g.
    /// `mode=Adaptive prefix_chars=256 chat_key=Opening default_shards=8 max_shards=8
    /// static=0000000000000000 requests=…`; the membership heartbeat compares the members' lines.
    pub fn routing_fingerprint(&self) -> String {
        let (k, s) = (&self.keying, &self.sharding);
        let mut statics: Vec<String> = s.keys.iter().map(|(key, n)| format!("key {key:?} {n}")).collect();
        statics.sort();
        statics.extend(s.rules.iter().map(|r| format!("rule {:?} {}", r.pattern.as_str(), r.shards)));
        let statics = if statics.is_empty() { 0 } else { xxhash_rust::xxh3::xxh3_64(statics.join("\n").as_bytes()) };
        let requests = xxhash_rust::xxh3::xxh3_64(format!("{:016x} {} {}", self.requests.fingerprint(), self.amqp.max_message_bytes, self.amqp.delivery_limit).as_bytes());
        format!(
            "mode={:?} prefix_chars={} chat_key={:?} default_shards={} max_shards={} static={statics:016x} requests={requests:016x}",
            k.mode, k.prefix_chars, k.chat_key, s.default_shards, s.max_shards
        )
    }

    /// Validates a raw configuration, one section after the other (so the first broken rule is
    /// reported, in file order).
    ///
    /// Errors: the first broken rule, as [`ConfigError::Invalid`].
    pub fn from_raw(r: &RawConfig) -> Result<Settings, ConfigError> {
        let instance_name = instance_name(&r.instance)?;
        let amqp = amqp(&r.amqp)?;
        let redis = redis(&r.redis)?;
        let ownership = ownership(&r.ownership)?;
        let keying = keying(&r.keying, amqp.max_message_bytes)?;
        let sharding = sharding(&r.sharding, amqp.partitions, keying.mode)?;
        let batching = batching(&r.batching, &amqp)?;
        let llm = llm(&r.llm)?;
        let own_queues = [amqp.input_queue.as_str(), &amqp.results_queue, &amqp.dead_letter_queue];
        let requests = crate::policy::RequestPolicy::from_raw(&r.requests, &own_queues, &amqp.partition_queue_prefix)
            .map_err(|e| invalid(e.key, e.value, e.rule))?;
        let http_listen = r
            .http
            .listen
            .parse()
            .map_err(|_| invalid("http.listen", format!("{:?}", r.http.listen), "must be an address such as \"127.0.0.1:9464\""))?;
        let drain_timeout = positive_duration("shutdown.drain_timeout", &r.shutdown.drain_timeout)?;
        let log = log(&r.log)?;
        let settings = Settings {
            instance_name,
            amqp,
            redis,
            ownership,
            keying,
            sharding,
            batching,
            llm,
            requests,
            http_listen,
            drain_timeout,
            log,
        };
        check_consumer_timeout(&settings, &r.amqp.consumer_timeout)?;
        Ok(settings)
    }

    /// The longest time one delivery can be held before it is acked or nacked, in the worst case the
    /// configuration allows:
    ///
    /// `batching.max_batch_wait`
    /// \+ [`Settings::llm_call_budget`] (the LLM calls of its batch)
    /// \+ 2 × `amqp.confirm_timeout` (the result's publish, then a dead letter or a retry publish).
    ///
    /// At run time a batch's calls end by its requests' receipt + `CONSUMER_TIMEOUT_MARGIN` ×
    /// `amqp.consumer_timeout` − 2 × `amqp.confirm_timeout`, waits for an LLM concurrency permit
    /// and for an endpoint through an outage included: a call that could not end by then is not
    /// sent and its request goes back uncharged ([`crate::llm::LlmClient::infer_within`]). This
    /// check makes sure a batch flushed without waiting has the time for all its attempts.
    pub fn longest_hold(&self) -> Duration {
        self.batching.max_batch_wait.saturating_add(self.llm_call_budget()).saturating_add(self.amqp.confirm_timeout.saturating_mul(2))
    }

    /// The time a batch's LLM calls may take, permit waits aside: what one call takes at worst,
    /// `llm.max_attempts` × `llm.request_timeout` (reqwest's timeout covers the whole call,
    /// connecting included, so `llm.connect_timeout` is part of it) plus the backoffs between
    /// attempts (`llm.backoff_initial` doubling, each capped at `llm.backoff_max`; a `Retry-After`
    /// is capped at `llm.backoff_max` too), `max_attempts − 1` times.
    pub fn llm_call_budget(&self) -> Duration {
        let llm = &self.llm;
        let attempts = llm.max_attempts.get();
        let mut backoffs = Duration::ZERO;
        let mut step = llm.backoff_initial;
        for _ in 1..attempts {
            backoffs = backoffs.saturating_add(step.min(llm.backoff_max));
            step = step.saturating_mul(2);
        }
        llm.request_timeout.saturating_mul(attempts).saturating_add(backoffs)
    }
}

/// Share of `amqp.consumer_timeout` that [`Settings::longest_hold`] may use: the rest is margin for
/// scheduling, channel backpressure and clock differences with the broker.
pub const CONSUMER_TIMEOUT_MARGIN: f64 = 0.8;

/// `longest_hold ≤ CONSUMER_TIMEOUT_MARGIN × amqp.consumer_timeout`, or the broker would close the
/// channel of a consumer that holds a delivery too long (RabbitMQ `consumer_timeout`).
fn check_consumer_timeout(s: &Settings, raw: &str) -> Result<(), ConfigError> {
    let hold = s.longest_hold();
    let allowed = s.amqp.consumer_timeout.mul_f64(CONSUMER_TIMEOUT_MARGIN);
    if hold <= allowed {
        return Ok(());
    }
    let secs = |d: Duration| format!("{}s", d.as_secs_f64());
    let (b, l, a) = (&s.batching, &s.llm, &s.amqp);
    Err(invalid(
        "amqp.consumer_timeout",
        format!("{raw:?}"),
        format!(
            "the longest hold of a delivery ({}: batching.max_batch_wait {} + llm.max_attempts {} × llm.request_timeout {} \
             + backoffs from llm.backoff_initial {} capped at llm.backoff_max {} + 2 × amqp.confirm_timeout {}) must be at most \
             {CONSUMER_TIMEOUT_MARGIN} × amqp.consumer_timeout ({}); raise amqp.consumer_timeout (and the broker's \
             consumer_timeout) or lower those",
            secs(hold),
            secs(b.max_batch_wait),
            l.max_attempts,
            secs(l.request_timeout),
            secs(l.backoff_initial),
            secs(l.backoff_max),
            secs(a.confirm_timeout),
            secs(allowed),
        ),
    ))
}

/// `[instance]`: the name, or the default one (hostname) when empty; never with `:`.
fn instance_name(i: &RawInstance) -> Result<String, ConfigError> {
    let instance_name = if i.name.is_empty() { default_instance_name() } else { name("instance.name", &i.name)? };
    if instance_name.contains(':') {
        return Err(invalid("instance.name", format!("{instance_name:?}"), "must not contain ':'"));
    }
    Ok(instance_name)
}

/// `[amqp]`.
fn amqp(a: &RawAmqp) -> Result<AmqpSettings, ConfigError> {
    let partition_prefetch = u16::try_from(a.partition_prefetch)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| invalid("amqp.partition_prefetch", a.partition_prefetch, "must be 1 to 65535"))?;
    let input_prefetch = u16::try_from(a.input_prefetch)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| invalid("amqp.input_prefetch", a.input_prefetch, "must be 1 to 65535"))?;
    let partitions = nonzero_u32("amqp.partitions", a.partitions)?;
    if partitions.get() > 1024 {
        return Err(invalid("amqp.partitions", a.partitions, "must be at most 1024"));
    }
    if a.max_message_bytes < 64 {
        return Err(invalid("amqp.max_message_bytes", a.max_message_bytes, "must be at least 64"));
    }
    let nodes = amqp_nodes(a)?;
    for (i, node) in nodes.iter().enumerate() {
        let channel_max = node.expose().parse::<lapin::uri::AMQPUri>().ok().and_then(|uri| uri.query.channel_max);
        let needed = channels_needed(partitions.get());
        if channel_max.is_some_and(|c| c != 0 && u32::from(c) < needed) {
            let key = if a.urls.is_empty() { "amqp.url" } else { "amqp.urls" };
            return Err(invalid(
                key,
                node.redacted(),
                format!("channel_max must be 0 (the broker's) or at least {needed}: one connection holds up to {} channels per partition it owns, and amqp.partitions = {partitions} (node {i})", PUBLISH_CHANNELS),
            ));
        }
    }
    let amqp = AmqpSettings {
        url: nodes[0].clone(),
        nodes,
        input_queue: name("amqp.input_queue", &a.input_queue)?,
        shard_exchange: name("amqp.shard_exchange", &a.shard_exchange)?,
        partition_queue_prefix: name("amqp.partition_queue_prefix", &a.partition_queue_prefix)?,
        results_queue: name("amqp.results_queue", &a.results_queue)?,
        dead_letter_exchange: name("amqp.dead_letter_exchange", &a.dead_letter_exchange)?,
        dead_letter_queue: name("amqp.dead_letter_queue", &a.dead_letter_queue)?,
        partitions,
        input_prefetch,
        partition_prefetch,
        max_message_bytes: a.max_message_bytes,
        confirm_timeout: positive_duration("amqp.confirm_timeout", &a.confirm_timeout)?,
        reconnect_backoff_initial: positive_duration("amqp.reconnect_backoff_initial", &a.reconnect_backoff_initial)?,
        reconnect_backoff_max: positive_duration("amqp.reconnect_backoff_max", &a.reconnect_backoff_max)?,
        backlog_poll_interval: positive_duration("amqp.backlog_poll_interval", &a.backlog_poll_interval)?,
        consumer_timeout: positive_duration("amqp.consumer_timeout", &a.consumer_timeout)?,
        delivery_limit: nonzero_u32("amqp.delivery_limit", a.delivery_limit)?,
        quorum_initial_group_size: match a.quorum_initial_group_size {
            n if n > 1000 => return Err(invalid("amqp.quorum_initial_group_size", n, "must be 0 (leave the argument out) to 1000")),
            n => NonZeroU32::new(n),
        },
        heartbeat: amqp_heartbeat(&a.heartbeat)?,
        tls: tls_files(AMQP_TLS, [&a.tls_ca_file, &a.tls_cert_file, &a.tls_key_file])?,
    };
    if amqp.reconnect_backoff_max < amqp.reconnect_backoff_initial {
        return Err(invalid(
            "amqp.reconnect_backoff_max",
            &a.reconnect_backoff_max,
            format!("must be at least amqp.reconnect_backoff_initial ({})", a.reconnect_backoff_initial),
        ));
    }
    amqp_names_distinct(&amqp)?;
    let tls_rule = if a.urls.is_empty() { "amqp.url is not amqps://" } else { "amqp.urls are not amqps://" };
    only_with_tls(AMQP_TLS, [&a.tls_ca_file, &a.tls_cert_file, &a.tls_key_file], amqp.url.0.scheme() == "amqps", tls_rule)?;
    Ok(amqp)
}

/// The daemon's queue and exchange names must not collide: one queue used as two (the input
/// queue as the dead-letter queue, say) would loop or mix requests with results, a partition
/// queue named like another queue would be consumed by the wrong stage, and RabbitMQ reserves
/// the `amq.` prefix for its own exchanges and queues (declaring one is refused with 403
/// ACCESS_REFUSED; AMQP 0-9-1 `exchange.declare`, `queue.declare`).
fn amqp_names_distinct(a: &AmqpSettings) -> Result<(), ConfigError> {
    let queues: [(&'static str, &str); 3] =
        [("amqp.input_queue", &a.input_queue), ("amqp.results_queue", &a.results_queue), ("amqp.dead_letter_queue", &a.dead_letter_queue)];
    let exchanges: [(&'static str, &str); 2] = [("amqp.shard_exchange", &a.shard_exchange), ("amqp.dead_letter_exchange", &a.dead_letter_exchange)];
    for (key, v) in queues.iter().chain(&exchanges).chain([&("amqp.partition_queue_prefix", a.partition_queue_prefix.as_str())]) {
        if v.starts_with("amq.") {
            return Err(invalid(key, format!("{v:?}"), "must not start with \"amq.\" (reserved by RabbitMQ)"));
        }
    }
    for group in [&queues[..], &exchanges[..]] {
        for (i, (key, v)) in group.iter().enumerate() {
            if let Some((other, _)) = group[..i].iter().find(|(_, w)| w == v) {
                return Err(invalid(key, format!("{v:?}"), format!("must differ from {other}")));
            }
        }
    }
    let prefix = format!("{}.", a.partition_queue_prefix);
    for (key, v) in queues {
        if v == a.partition_queue_prefix || v.starts_with(&prefix) {
            return Err(invalid(
                "amqp.partition_queue_prefix",
                format!("{:?}", a.partition_queue_prefix),
                format!("must not name {key} ({v:?}) or a queue under it: partition queues are named {{prefix}}.000, {{prefix}}.001, …"),
            ));
        }
    }
    Ok(())
}

/// `amqp.heartbeat`: whole seconds, 0 to 65535 (the AMQP 0-9-1 `connection.tune` field is a
/// short, in seconds).
fn amqp_heartbeat(v: &str) -> Result<u16, ConfigError> {
    const KEY: &str = "amqp.heartbeat";
    let d = duration(KEY, v)?;
    if d.subsec_nanos() != 0 {
        return Err(invalid(KEY, format!("{v:?}"), "must be whole seconds (the AMQP heartbeat's unit), such as \"10s\", or \"0s\" for the broker's own"));
    }
    u16::try_from(d.as_secs()).map_err(|_| invalid(KEY, format!("{v:?}"), "must be at most 65535s"))
}

/// The broker nodes: `amqp.urls` when set (each validated like `amqp.url`, at most
/// [`MAX_AMQP_NODES`], one scheme for all), else `amqp.url`. `amqp.url` is validated even when
/// `amqp.urls` replaces it, so a typo in it fails at startup, not on the day `amqp.urls` is
/// emptied.
fn amqp_nodes(a: &RawAmqp) -> Result<Vec<SecretUrl>, ConfigError> {
    const SCHEMES: &[&str] = &["amqp", "amqps"];
    let url = broker_url("amqp.url", secret_url("amqp.url", &a.url, SCHEMES)?)?;
    if a.urls.is_empty() {
        return Ok(vec![url]);
    }
    if a.urls.len() > MAX_AMQP_NODES {
        return Err(invalid("amqp.urls", format!("{} URLs", a.urls.len()), format!("must list at most {MAX_AMQP_NODES} nodes")));
    }
    let nodes = a
        .urls
        .iter()
        .map(|u| broker_url("amqp.urls", secret_url("amqp.urls", u.trim(), SCHEMES)?))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(odd) = nodes.iter().find(|u| u.0.scheme() != nodes[0].0.scheme()) {
        return Err(invalid("amqp.urls", odd.redacted(), format!("every URL must have the same scheme as the first ({}://)", nodes[0].0.scheme())));
    }
    Ok(nodes)
}

/// The query parameters the AMQP client (lapin's `AMQPUri`) reads from a broker URL, less
/// `heartbeat`, which [`AmqpSettings::heartbeat`] sets. It ignores any other parameter, so
/// another one is a typo, and is refused.
pub const AMQP_URL_QUERY_PARAMETERS: [&str; 4] = ["frame_max", "channel_max", "connection_timeout", "auth_mechanism"];

/// AMQP 0-9-1 `frame-min-size`: the smallest `frame_max` a peer may propose, in bytes.
pub const AMQP_FRAME_MIN_SIZE: u32 = 4096;

/// How many channels of the publishing connection a partition may hold at once, for the
/// `channel_max` check: its shared publishing channel, a replaced one until it closes (at most
/// 2 × `amqp.confirm_timeout` later) and short-lived ones for placing returned messages and
/// checking direct reply-to requesters.
pub const PUBLISH_CHANNELS: usize = 4;

/// Channels one AMQP connection of a session may hold at once, for `partitions` partitions all
/// owned by the instance: the publishing connection carries up to
/// [`PUBLISH_CHANNELS`] per partition, plus 16 for the router, topology
/// declarations and backlog polls. A `channel_max` below this fails partitions at runtime.
pub fn channels_needed(partitions: u32) -> u32 {
    partitions.saturating_mul(PUBLISH_CHANNELS as u32).saturating_add(16)
}

/// Checks a broker URL as the AMQP client will read it, so that a bad one stops startup instead
/// of every connection attempt:
/// - no `heartbeat` query parameter: `amqp.heartbeat` sets it, and two places for one value would
///   leave an operator guessing which applies;
/// - no query parameter outside [`AMQP_URL_QUERY_PARAMETERS`] (the client would ignore it);
/// - the values parse as the client parses them (integers; a SASL mechanism name);
/// - `frame_max` is 0 (the broker's) or at least 4096, AMQP 0-9-1's `frame-min-size` (RabbitMQ
///   closes a connection that proposes less);
/// - the vhost is one path segment: a `/` inside it is written `%2f` (the AMQP URI
///   specification, <https://www.rabbitmq.com/docs/uri-spec>).
fn broker_url(key: &'static str, u: SecretUrl) -> Result<SecretUrl, ConfigError> {
    let vhost = u.0.path().strip_prefix('/');
    if vhost.is_some_and(|v| v.contains('/')) {
        return Err(invalid(key, u.redacted(), "the vhost is one path segment: write a '/' inside it as %2f (vhost / is amqp://host/%2f)"));
    }
    if vhost == Some("") {
        return Err(invalid(key, u.redacted(), "the vhost is empty (a path of only '/'); vhost / is amqp://host/%2f, or leave the path out"));
    }
    if u.0.fragment().is_some() {
        return Err(invalid(key, u.redacted(), "must not have a #fragment (the AMQP client ignores it; percent-encode '#' in a password as %23)"));
    }
    for (k, _) in u.0.query_pairs() {
        if k == "heartbeat" {
            return Err(invalid(key, u.redacted(), "must not set heartbeat in its query: set amqp.heartbeat instead"));
        }
        if !AMQP_URL_QUERY_PARAMETERS.contains(&k.as_ref()) {
            // Without the query: the value of an unknown parameter may be a secret.
            let mut shown = u.0.clone();
            shown.set_query(None);
            return Err(invalid(
                key,
                format!("{} (query not shown)", SecretUrl(shown).redacted()),
                format!("query parameter {k:?} is not one the AMQP client reads ({})", AMQP_URL_QUERY_PARAMETERS.join(", ")),
            ));
        }
    }
    match u.0.as_str().parse::<lapin::uri::AMQPUri>() {
        Err(e) => {
            let e = redact_text(&e);
            return Err(invalid(key, u.redacted(), format!("the AMQP client cannot read it: {e}")));
        }
        Ok(uri) if uri.query.connection_timeout == Some(0) => {
            return Err(invalid(key, u.redacted(), "connection_timeout must be at least 1 (milliseconds allowed for opening a connection)"));
        }
        Ok(uri) if uri.query.frame_max.is_some_and(|f| f != 0 && f < AMQP_FRAME_MIN_SIZE) => {
            return Err(invalid(key, u.redacted(), format!("frame_max must be 0 (the broker's) or at least {AMQP_FRAME_MIN_SIZE} (AMQP 0-9-1 frame-min-size)")));
        }
        Ok(_) => {}
    }
    Ok(u)
}

/// `[redis]`.
/// Schemes `redis.url` accepts (`rediss`: TLS).
const REDIS_SCHEMES: &[&str] = &["redis", "rediss", "unix", "redis+unix"];

const AMQP_TLS: TlsKeys = TlsKeys { ca_file: "amqp.tls_ca_file", cert_file: "amqp.tls_cert_file", key_file: "amqp.tls_key_file" };
const REDIS_TLS: TlsKeys = TlsKeys { ca_file: "redis.tls_ca_file", cert_file: "redis.tls_cert_file", key_file: "redis.tls_key_file" };
const LLM_TLS: TlsKeys = TlsKeys { ca_file: "llm.tls_ca_file", cert_file: "llm.tls_cert_file", key_file: "llm.tls_key_file" };

/// A link's TLS files ([`crate::tls::load`]), as a configuration error naming the key.
fn tls_files(keys: TlsKeys, [ca, cert, key]: [&str; 3]) -> Result<TlsFiles, ConfigError> {
    crate::tls::load(keys, ca, cert, key).map_err(|e| invalid(e.key, e.value, e.rule))
}

/// TLS files set for a link that does not use TLS are a mistake: refused, naming the first key
/// set and its path.
fn only_with_tls(keys: TlsKeys, [ca, cert, key]: [&str; 3], uses_tls: bool, why: &str) -> Result<(), ConfigError> {
    if uses_tls {
        return Ok(());
    }
    let set = [(keys.ca_file, ca), (keys.cert_file, cert), (keys.key_file, key)].into_iter().find(|(_, v)| !v.is_empty());
    match set {
        None => Ok(()),
        Some((k, v)) => Err(invalid(k, crate::tls::shown_value(k, v), format!("is only used over TLS, but {why}"))),
    }
}

fn redis(r: &RawRedis) -> Result<RedisSettings, ConfigError> {
    Ok(RedisSettings {
        url: secret_url("redis.url", &r.url, REDIS_SCHEMES)?,
        key_prefix: key_prefix(&r.key_prefix)?,
        command_timeout: positive_duration("redis.command_timeout", &r.command_timeout)?,
        tls: tls_files(REDIS_TLS, [&r.tls_ca_file, &r.tls_cert_file, &r.tls_key_file])?,
        sentinel: sentinel(r)?,
    })
    .and_then(|s| {
        only_with_tls(REDIS_TLS, [&r.tls_ca_file, &r.tls_cert_file, &r.tls_key_file], s.url.0.scheme() == "rediss", "redis.url is not rediss://")?;
        // The redis crate reads `#insecure` in a rediss:// URL as "skip verification"; this
        // daemon always verifies.
        if s.url.0.fragment().is_some() {
            return Err(invalid("redis.url", s.url.redacted(), "must not have a #fragment (the Redis client reads #insecure as \"do not verify the server certificate\", and this daemon always verifies; write a '#' in a password as %23)"));
        }
        redis_database(&s.url)?;
        redis_user_has_password("redis.url", &s.url)?;
        redis_client_reads("redis.url", &s.url)?;
        Ok(s)
    })
}

/// A Redis URL that names a user must give a password: the redis crate authenticates (`AUTH`)
/// only when a password is set, so `redis://name@host` connects unauthenticated, and a password
/// written without its leading colon (`redis://secret@host`, `secret@host:26379`) would be taken
/// for a user name and silently dropped. The message shows neither.
fn redis_user_has_password(key: &str, url: &SecretUrl) -> Result<(), ConfigError> {
    let u = &url.0;
    // The redis crate reads a redis:// URL's password from its user info only: a `?password=`
    // query is ignored, and the connection goes unauthenticated.
    let query_password = matches!(u.scheme(), "redis" | "rediss") && u.query_pairs().any(|(k, _)| k == "password" || k == "pass");
    if u.password().is_some() || (u.username().is_empty() && !query_password) {
        return Ok(());
    }
    let port = u.port().map(|p| format!(":{p}")).unwrap_or_default();
    let at = format!("{}://***@{}{port}{}", u.scheme(), u.host_str().unwrap_or_default(), u.path());
    let why = if query_password {
        "gives the password in the query, which the Redis client does not read, so Redis would not be authenticated: write `:password@` or `user:password@`"
    } else {
        "names a user but no password, so Redis would not be authenticated (a password written without its leading `:` reads as a user name): write `:password@` for a password alone (requirepass) or `user:password@` for an ACL user"
    };
    Err(invalid(key, at, why))
}

/// The URL as the Redis client reads it when it connects (`redis::IntoConnectionInfo`): one it
/// refuses (`?protocol=4`, the wildcard host `0.0.0.0`, a Unix socket's `?db=x`) would pass
/// every other check here, and the daemon would then retry the connection forever instead of
/// stopping. The client's messages do not show the URL.
fn redis_client_reads(key: &str, url: &SecretUrl) -> Result<(), ConfigError> {
    match redis::IntoConnectionInfo::into_connection_info(url.expose()) {
        Ok(_) => Ok(()),
        Err(e) => Err(invalid(key, url.redacted(), format!("is refused by the Redis client: {e}"))),
    }
}

/// The database number of a `redis://` or `rediss://` URL is its path (`/0`, `/3`; empty: 0),
/// which the redis crate parses as a number when it connects; anything else (`/abc`, `/-1`) is
/// refused here instead of failing every connection attempt. Whether the number exists (below
/// the server's `databases` setting, 16 by default) only the server knows: the first `SELECT`
/// stops startup ([`crate::app::SessionError::access_refused`]).
fn redis_database(url: &SecretUrl) -> Result<(), ConfigError> {
    if !matches!(url.0.scheme(), "redis" | "rediss") {
        return Ok(());
    }
    let path = url.0.path().trim_matches('/');
    if path.is_empty() || path.parse::<u32>().is_ok() {
        return Ok(());
    }
    Err(invalid("redis.url", url.redacted(), format!("the path must be a database number such as /0 (found {path:?})")))
}

/// `redis.sentinels` and `redis.sentinel_master`: both or neither; each sentinel a `redis://` or
/// `rediss://` URL or a bare `host:port`, all with the same credentials; `redis.url` must not be
/// a Unix socket then (the primary is reached over TCP at the address the sentinels report).
fn sentinel(r: &RawRedis) -> Result<Option<SentinelSettings>, ConfigError> {
    let listed: Vec<&str> = r.sentinels.iter().map(|s| s.trim()).filter(|s| !s.is_empty()).collect();
    match (listed.is_empty(), r.sentinel_master.trim().is_empty()) {
        (true, true) => return Ok(None),
        (false, true) => {
            return Err(invalid("redis.sentinel_master", "\"\"", "must name the monitored master when redis.sentinels is set"));
        }
        (true, false) => {
            return Err(invalid("redis.sentinels", "[]", "must list at least one sentinel when redis.sentinel_master is set"));
        }
        (false, false) => {}
    }
    let master = name("redis.sentinel_master", r.sentinel_master.trim())?;
    let mut addrs: Vec<SecretUrl> = Vec::new();
    for s in listed {
        let full = if s.contains("://") { s.to_owned() } else { format!("redis://{s}") };
        let u = secret_url("redis.sentinels", &full, &["redis", "rediss"])?;
        redis_user_has_password("redis.sentinels", &u)?;
        redis_client_reads("redis.sentinels", &u)?;
        if u.0.port().is_none() {
            return Err(invalid("redis.sentinels", u.redacted(), "must give the sentinel's port (usually 26379)"));
        }
        if let Some(first) = addrs.first() {
            if (first.0.username(), first.0.password()) != (u.0.username(), u.0.password()) {
                return Err(invalid("redis.sentinels", u.redacted(), "every sentinel must have the same credentials"));
            }
        }
        addrs.push(u);
    }
    let scheme = r.url.split("://").next().unwrap_or_default();
    if scheme == "unix" || scheme == "redis+unix" {
        return Err(invalid("redis.url", redact_str(&r.url), "must be redis:// or rediss:// when redis.sentinels is set"));
    }
    Ok(Some(SentinelSettings { addrs, master }))
}

/// `[ownership]`: the lease timing rule (see [`OwnershipSettings`]) and member TTL > renew interval.
fn ownership(o: &RawOwnership) -> Result<OwnershipSettings, ConfigError> {
    let ownership = OwnershipSettings {
        lease_ttl: positive_duration("ownership.lease_ttl", &o.lease_ttl)?,
        renew_deadline: positive_duration("ownership.renew_deadline", &o.renew_deadline)?,
        renew_interval: positive_duration("ownership.renew_interval", &o.renew_interval)?,
        member_ttl: positive_duration("ownership.member_ttl", &o.member_ttl)?,
        settle_time: duration("ownership.settle_time", &o.settle_time)?,
        llm_down_hand_over_after: duration("ownership.llm_down_hand_over_after", &o.llm_down_hand_over_after)?,
    };
    if ownership.lease_ttl <= ownership.renew_deadline {
        return Err(invalid(
            "ownership.renew_deadline",
            &o.renew_deadline,
            format!("must be less than ownership.lease_ttl ({})", o.lease_ttl),
        ));
    }
    if ownership.renew_deadline.as_secs_f64() <= 1.2 * ownership.renew_interval.as_secs_f64() {
        return Err(invalid(
            "ownership.renew_interval",
            &o.renew_interval,
            format!("1.2 × renew_interval must be less than ownership.renew_deadline ({})", o.renew_deadline),
        ));
    }
    if ownership.member_ttl <= ownership.renew_interval {
        return Err(invalid(
            "ownership.member_ttl",
            &o.member_ttl,
            format!("must be greater than ownership.renew_interval ({})", o.renew_interval),
        ));
    }
    Ok(ownership)
}

/// `[keying]`: `prefix_chars` at most `amqp.max_message_bytes` (no prompt holds more
/// characters than its message has bytes).
fn keying(k: &RawKeying, max_message_bytes: usize) -> Result<KeyingSettings, ConfigError> {
    if k.prefix_chars > max_message_bytes {
        return Err(invalid(
            "keying.prefix_chars",
            k.prefix_chars,
            format!("must be at most amqp.max_message_bytes ({max_message_bytes}): no prompt is longer, so every key would be the whole prompt"),
        ));
    }
    Ok(KeyingSettings {
        mode: match k.mode.as_str() {
            "adaptive" => KeyingMode::Adaptive,
            "prefix" => KeyingMode::Prefix,
            "off" => KeyingMode::Off,
            other => return Err(invalid("keying.mode", format!("{other:?}"), "must be \"adaptive\", \"prefix\" or \"off\"")),
        },
        prefix_chars: nonzero_usize("keying.prefix_chars", k.prefix_chars)?,
        chat_key: match k.chat_key.as_str() {
            "opening" => ChatKey::Opening,
            "system" => ChatKey::System,
            "system_and_first_user" => ChatKey::SystemAndFirstUser,
            "rendered" => ChatKey::Rendered,
            other => {
                return Err(invalid(
                    "keying.chat_key",
                    format!("{other:?}"),
                    "must be \"opening\", \"system\", \"system_and_first_user\" or \"rendered\"",
                ))
            }
        },
    })
}

/// `[sharding]`: every shard count at least 1 and at most `amqp.partitions`, except the two that
/// a mode does not use as a table entry: `max_shards`, and `default_shards` outside the static
/// `prefix` mode (which ignore it). Those are capped at `amqp.partitions`, so lowering
/// `amqp.partitions` below their defaults (8) needs no other change.
fn sharding(s: &RawSharding, partitions: NonZeroU32, mode: KeyingMode) -> Result<ShardingSettings, ConfigError> {
    let mut keys = HashMap::new();
    // Errors name the entry (`sharding.keys."tenant-a"`), as TOML would write its key.
    let entry = |k: &str| format!("sharding.keys.{k:?}");
    for (k, v) in &s.keys {
        if k.is_empty() {
            return Err(invalid(&entry(k), v, "must not be empty: an explicit key is never empty (such a request is dead-lettered) and key material never is"));
        }
        let n = NonZeroU32::new(*v).ok_or_else(|| invalid(&entry(k), v, "must be at least 1"))?;
        keys.insert(k.clone(), n);
        // A level-0 key in capitals (copied from elsewhere than `status`, which writes it in
        // lower case, as the results' `prefix_key` does) matches too.
        if k.len() == 16 && k.bytes().all(|b| b.is_ascii_hexdigit()) && k.bytes().any(|b| b.is_ascii_uppercase()) {
            let lower = k.to_ascii_lowercase();
            if s.keys.contains_key(&lower) {
                return Err(invalid(&entry(k), v, format!("names the same level-0 key as {} (hex digits in any case)", entry(&lower))));
            }
            keys.insert(lower, n);
        }
    }
    let mut rules = Vec::new();
    for (i, rule) in s.rules.iter().enumerate() {
        let pattern = regex::Regex::new(&rule.pattern).map_err(|e| {
            invalid(&format!("sharding.rules[{i}].pattern"), format!("{:?}", rule.pattern), format!("must be a regular expression ({e})"))
        })?;
        let shards = NonZeroU32::new(rule.shards).ok_or_else(|| invalid(&format!("sharding.rules[{i}].shards"), rule.shards, "must be at least 1"))?;
        rules.push(ShardRule { pattern, shards });
    }
    let default_shards = nonzero_u32("sharding.default_shards", s.default_shards)?;
    let sharding = ShardingSettings {
        default_shards: if mode == KeyingMode::Prefix { default_shards } else { default_shards.min(partitions) },
        // More shards than partitions spread no further: capped, so lowering `amqp.partitions`
        // needs no change here.
        max_shards: nonzero_u32("sharding.max_shards", s.max_shards)?.min(partitions),
        keys,
        rules,
    };
    for (key, n) in std::iter::once(("sharding.default_shards".to_owned(), sharding.default_shards))
        .chain(s.keys.keys().map(|k| (entry(k), sharding.keys[k])))
        .chain(sharding.rules.iter().enumerate().map(|(i, r)| (format!("sharding.rules[{i}].shards"), r.shards)))
    {
        if n > partitions {
            return Err(invalid(&key, n, format!("must be at most amqp.partitions ({partitions})")));
        }
    }
    Ok(sharding)
}

/// `[batching]`, `amqp.partition_prefetch` ≥ `max_batch_size` (or batches could never fill) and
/// `max_buffered_bytes` ≥ `amqp.max_message_bytes`.
fn batching(b: &RawBatching, amqp: &AmqpSettings) -> Result<BatchingSettings, ConfigError> {
    let max_batch_wait = duration("batching.max_batch_wait", &b.max_batch_wait)?;
    if max_batch_wait.is_zero() {
        return Err(invalid(
            "batching.max_batch_wait",
            format!("{:?}", b.max_batch_wait),
            "must be greater than zero (zero means \"never flush\" in some systems and \"always\" in others)",
        ));
    }
    let batching = BatchingSettings {
        max_batch_size: nonzero_usize("batching.max_batch_size", b.max_batch_size)?,
        max_batch_wait,
        channel_capacity: match b.channel_capacity {
            // tokio's bounded channel panics above `usize::MAX >> 3`; no pipeline needs more
            // than a million items between two stages.
            c if c > MAX_CHANNEL_CAPACITY => {
                return Err(invalid("batching.channel_capacity", c, format!("must be at most {MAX_CHANNEL_CAPACITY}")));
            }
            c => nonzero_usize("batching.channel_capacity", c)?,
        },
        max_buffered_bytes: nonzero_usize("batching.max_buffered_bytes", b.max_buffered_bytes)?,
    };
    if batching.max_buffered_bytes.get() < amqp.max_message_bytes {
        return Err(invalid(
            "batching.max_buffered_bytes",
            batching.max_buffered_bytes,
            format!("must be at least amqp.max_message_bytes ({}), or a request of the largest accepted size could never be buffered", amqp.max_message_bytes),
        ));
    }
    if usize::from(amqp.partition_prefetch) < batching.max_batch_size.get() {
        return Err(invalid(
            "amqp.partition_prefetch",
            amqp.partition_prefetch,
            format!(
                "must be at least batching.max_batch_size ({}), or batches could never fill",
                batching.max_batch_size
            ),
        ));
    }
    Ok(batching)
}

/// `[llm]`: http:// endpoints without credentials, backoff_max ≥ backoff_initial.
fn llm(l: &RawLlm) -> Result<LlmSettings, ConfigError> {
    if l.endpoints.is_empty() {
        return Err(invalid("llm.endpoints", "[]", "must list at least one base URL"));
    }
    if l.endpoints.iter().any(|e| e.trim().is_empty()) {
        // `PREFIX_BATCHER__LLM__ENDPOINTS=` set but empty, or a list with a trailing or doubled
        // comma.
        return Err(invalid(
            "llm.endpoints",
            format!("{:?}", l.endpoints.iter().map(|e| redact_unparsed(e).0).collect::<Vec<_>>().join(",")),
            "has an empty item (an empty value, or a trailing or doubled comma): list at least one base URL, separated by commas",
        ));
    }
    let mut endpoints = Vec::new();
    for e in &l.endpoints {
        let u = Url::parse(e).map_err(|err| invalid("llm.endpoints", redact_str(e), format!("must be an http:// or https:// URL ({err})")))?;
        // Shown without credentials and query, which may hold a token.
        let port = u.port().map(|p| format!(":{p}")).unwrap_or_default();
        // Without what may hold a token; the query and fragment shown as `?***` and `#***`, so the
        // value named in an error about them has them.
        let query = if u.query().is_some() { "?***" } else { "" };
        let fragment = if u.fragment().is_some() { "#***" } else { "" };
        let shown = format!("{:?}", format!("{}://{}{port}{}{query}{fragment}", u.scheme(), u.host_str().unwrap_or_default(), u.path()));
        if u.scheme() != "http" && u.scheme() != "https" {
            return Err(invalid("llm.endpoints", shown, "must be an http:// or https:// URL"));
        }
        if u.password().is_some() || !u.username().is_empty() {
            return Err(invalid("llm.endpoints", shown, "must not carry credentials; use llm.api_key"));
        }
        if u.query().is_some() || u.fragment().is_some() {
            return Err(invalid(
                "llm.endpoints",
                shown,
                "must not have a ?query or #fragment: it is a base URL the daemon appends v1/completions to; a token goes in llm.api_key",
            ));
        }
        let path = u.path().trim_end_matches('/').to_ascii_lowercase();
        if ["/v1", "/v1/completions", "/v1/chat/completions"].iter().any(|end| path.ends_with(end)) {
            return Err(invalid(
                "llm.endpoints",
                shown,
                "must be the server's base URL without /v1: the daemon appends v1/completions and v1/chat/completions itself",
            ));
        }
        if endpoints.contains(&u) {
            // Two entries for one server would double its share of the calls and split its
            // circuit breaker in two.
            return Err(invalid("llm.endpoints", format!("{e:?}"), "must not list one URL twice"));
        }
        endpoints.push(u);
    }
    let llm = LlmSettings {
        endpoints,
        model: name("llm.model", &l.model)?,
        api_key: match l.api_key.as_str() {
            "" => None,
            // Not shown: it is a secret. A trailing blank from an environment file would be sent
            // in the Authorization header, which a server comparing tokens refuses (401).
            k if k.trim() != k => return Err(invalid("llm.api_key", "***", "must not start or end with whitespace (a blank after the value in an environment file?)")),
            // The daemon sends `Authorization: Bearer <api_key>` (RFC 6750 §2.1): the scheme
            // again would be sent twice, and a server refuses it (401).
            k if k.get(..6).is_some_and(|p| p.eq_ignore_ascii_case("bearer")) && k[6..].starts_with([' ', '\t']) => {
                return Err(invalid("llm.api_key", "***", "must be the token alone, without `Bearer `: the daemon sends `Authorization: Bearer <llm.api_key>`"))
            }
            // What the HTTP client would refuse when building the header (RFC 9110 §5.5: no
            // control characters but tab); checked here so that `check-config` finds it and `run`
            // stops with 78, not 1.
            k if reqwest::header::HeaderValue::from_str(&format!("Bearer {k}")).is_err() => {
                return Err(invalid("llm.api_key", "***", "must not hold a line break or another control character (it is sent in an HTTP header)"))
            }
            k => Some(Secret(k.to_owned())),
        },
        max_concurrency: nonzero_usize("llm.max_concurrency", l.max_concurrency)?,
        request_timeout: positive_duration("llm.request_timeout", &l.request_timeout)?,
        connect_timeout: positive_duration("llm.connect_timeout", &l.connect_timeout)?,
        max_attempts: nonzero_u32("llm.max_attempts", l.max_attempts)?,
        backoff_initial: positive_duration("llm.backoff_initial", &l.backoff_initial)?,
        backoff_max: positive_duration("llm.backoff_max", &l.backoff_max)?,
        list_prompts: l.list_prompts,
        max_response_bytes: nonzero_usize("llm.max_response_bytes", l.max_response_bytes)?,
        liveness_check_after: Some(duration("llm.liveness_check_after", &l.liveness_check_after)?).filter(|d| !d.is_zero()),
        tls: tls_files(LLM_TLS, [&l.tls_ca_file, &l.tls_cert_file, &l.tls_key_file])?,
    };
    let https = llm.endpoints.iter().any(|u| u.scheme() == "https");
    only_with_tls(LLM_TLS, [&l.tls_ca_file, &l.tls_cert_file, &l.tls_key_file], https, "no llm.endpoints URL is https://")?;
    if llm.request_timeout < Duration::from_millis(1) {
        return Err(invalid("llm.request_timeout", &l.request_timeout, "must be at least 1ms"));
    }
    // Each liveness check waits at most min(this, 10 s) for an answer
    // (`llm::LIVENESS_TIMEOUT_MAX`): a shorter wait would take a remote server's slow answer for a frozen server and abandon
    // its calls.
    if llm.liveness_check_after.is_some_and(|d| d < Duration::from_secs(1)) {
        return Err(invalid(
            "llm.liveness_check_after",
            &l.liveness_check_after,
            "must be \"0s\" (never checked) or at least 1s: each check waits at most this long for the server's answer",
        ));
    }
    if llm.backoff_max < llm.backoff_initial {
        return Err(invalid("llm.backoff_max", &l.backoff_max, format!("must be at least llm.backoff_initial ({})", l.backoff_initial)));
    }
    Ok(llm)
}

/// `[log]`.
fn log(l: &RawLog) -> Result<LogSettings, ConfigError> {
    Ok(LogSettings {
        format: match l.format.as_str() {
            "pretty" => LogFormat::Pretty,
            "json" => LogFormat::Json,
            other => return Err(invalid("log.format", format!("{other:?}"), "must be \"pretty\" or \"json\"")),
        },
        level: {
            check_log_filter(&l.level).map_err(|rule| invalid("log.level", format!("{:?}", l.level), rule))?;
            l.level.clone()
        },
    })
}

/// Checks a log filter (`log.level`, `RUST_LOG`): comma-separated directives in
/// `tracing_subscriber::EnvFilter` syntax, each either a level (`trace`, `debug`, `info`,
/// `warn`, `error`, `off`) or `target[span{field}]=level`. The syntax itself accepts a bare word
/// as a target enabled at every level, so a misspelt level such as `"inof"` would silence every
/// other line; that, an empty directive and anything `EnvFilter` cannot parse are refused.
/// Errors: the rule broken, naming the directive.
pub fn check_log_filter(filter: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    let rule = "comma-separated levels (trace, debug, info, warn, error, off) or target=level directives";
    if filter.trim().is_empty() {
        return Err(format!("must not be empty: {rule}"));
    }
    for d in filter.split(',').map(str::trim) {
        if d.is_empty() {
            return Err(format!("has an empty directive: {rule}"));
        }
        if !d.contains('=') && !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(d)) {
            return Err(format!("directive {d:?} is neither a level nor target=level: {rule}"));
        }
        if let Err(e) = d.parse::<tracing_subscriber::filter::Directive>() {
            return Err(format!("directive {d:?} does not parse ({e}): {rule}"));
        }
    }
    Ok(())
}

/// The raw configuration as TOML with every secret replaced by `***` (for `check-config`).
pub fn redacted_toml(raw: &RawConfig) -> String {
    let redact_str = |v: &str| redact_unparsed(v).0;
    let mut r = raw.clone();
    r.amqp.url = secret_url("amqp.url", &r.amqp.url, &["amqp", "amqps"]).map(|u| u.redacted()).unwrap_or_else(|_| redact_str(&r.amqp.url));
    for u in &mut r.amqp.urls {
        *u = secret_url("amqp.urls", u, &["amqp", "amqps"]).map(|s| s.redacted()).unwrap_or_else(|_| redact_str(u));
    }
    r.redis.url = secret_url("redis.url", &r.redis.url, REDIS_SCHEMES)
        .map(|u| u.redacted())
        .unwrap_or_else(|_| redact_str(&r.redis.url));
    for s in r.redis.sentinels.iter_mut().filter(|s| s.contains('@')) {
        *s = secret_url("redis.sentinels", s, &["redis", "rediss"]).map(|u| u.redacted()).unwrap_or_else(|_| redact_str(s));
    }
    if !r.llm.api_key.is_empty() {
        r.llm.api_key = "***".into();
    }
    toml_string(&r)
}

fn toml_string(r: &RawConfig) -> String {
    toml::to_string(r).unwrap_or_else(|e| format!("# cannot render the configuration: {e}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A change to a raw configuration, for the table-driven tests.
    type Edit = fn(&mut RawConfig);

    fn ok(r: &RawConfig) -> Settings {
        Settings::from_raw(r).unwrap()
    }

    fn err(r: &RawConfig) -> String {
        Settings::from_raw(r).unwrap_err().to_string()
    }

    #[test]
    fn the_routing_fingerprint_changes_with_every_routing_setting_only() {
        let base = ok(&RawConfig::default()).routing_fingerprint();
        assert!(base.starts_with("mode=Adaptive prefix_chars=256 chat_key=Opening default_shards=8 max_shards=8 static=0000000000000000 requests="), "{base}");
        let mut other = RawConfig::default();
        other.batching.max_batch_size = 3;
        other.instance.name = "elsewhere".into();
        assert_eq!(ok(&other).routing_fingerprint(), base, "not a routing setting");
        // The request rules: another instance must not dead-letter what this one answers.
        let mut reordered = RawConfig::default();
        reordered.requests.allowed_params.reverse();
        assert_eq!(ok(&reordered).routing_fingerprint(), base, "the order of a list is not a setting");
        let changes: [fn(&mut RawConfig); 10] = [
            |r| r.amqp.delivery_limit = 2,
            |r| r.requests.reply_to_pattern = "replies\\..*".into(),
            |r| _ = r.requests.allowed_params.pop(),
            |r| r.requests.max_tokens += 1,
            |r| r.amqp.max_message_bytes += 1,
            |r| r.keying.mode = "off".into(),
            |r| r.keying.prefix_chars = 512,
            |r| r.keying.chat_key = "system".into(),
            |r| r.sharding.max_shards = 4,
            |r| _ = r.sharding.keys.insert("k".into(), 2),
        ];
        for change in changes {
            let mut r = RawConfig::default();
            change(&mut r);
            assert_ne!(ok(&r).routing_fingerprint(), base);
        }
    }

    /// A key prefix with a Redis glob character is refused, naming the key and the value: the
    /// documented `<prefix>:*` scan would match other deployments' keys. A `:` stays allowed.
    #[test]
    fn a_key_prefix_with_glob_characters_is_refused() {
        for bad in ["pb*", "pb?", "pb[1]", "p\\b"] {
            let mut r = RawConfig::default();
            r.redis.key_prefix = bad.into();
            let e = err(&r);
            assert!(e.contains("redis.key_prefix") && e.contains("glob characters"), "{bad}: {e}");
        }
        let mut r = RawConfig::default();
        r.redis.key_prefix = "team-a:prefix-batcher".into();
        assert_eq!(ok(&r).redis.key_prefix, "team-a:prefix-batcher");
    }

    #[test]
    fn defaults_are_valid() {
        let s = ok(&RawConfig::default());
        assert_eq!(s.amqp.partitions.get(), 64);
        assert_eq!(s.batching.max_batch_wait, Duration::from_secs(1));
        assert_eq!(s.sharding.default_shards.get(), 8);
        assert_eq!(s.sharding.max_shards.get(), 8);
        let mut few = RawConfig::default();
        (few.amqp.partitions, few.sharding.default_shards) = (4, 4);
        assert_eq!(ok(&few).sharding.max_shards.get(), 4, "max_shards is capped at amqp.partitions");
        // Fewer partitions than the shard defaults (8), nothing else set: the adaptive and `off`
        // modes ignore `default_shards`, so it is capped; the static mode uses it, so it is refused.
        let mut one = RawConfig::default();
        one.amqp.partitions = 1;
        let s1 = ok(&one);
        assert_eq!((s1.sharding.default_shards.get(), s1.sharding.max_shards.get()), (1, 1));
        one.keying.mode = "off".into();
        assert_eq!(ok(&one).sharding.default_shards.get(), 1);
        one.keying.mode = "prefix".into();
        let e = Settings::from_raw(&one).unwrap_err().to_string();
        assert!(e.contains("sharding.default_shards") && e.contains("amqp.partitions (1)"), "{e}");
        assert_eq!(s.keying.mode, KeyingMode::Adaptive, "adaptive keying is the default");
        assert_eq!(s.ownership.lease_ttl, Duration::from_secs(15));
        assert_eq!(s.amqp.partition_queue(7), "prefix-batcher.partition.007");
    }

    #[test]
    fn log_filters_must_name_levels_or_target_levels() {
        for good in ["info", "warn,prefix_batcher=debug", "prefix_batcher=debug", "INFO", "debug, lapin=warn", "off"] {
            assert_eq!(check_log_filter(good), Ok(()), "{good}");
        }
        for (bad, says) in [("nonsense!!", "neither a level"), ("inof", "neither a level"), ("info,,=[", "empty directive"), ("", "empty"), ("info,x=[", "does not parse")] {
            let e = check_log_filter(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let mut r = RawConfig::default();
        r.log.level = "nonsense!!".into();
        let e = err(&r);
        assert!(e.contains("log.level") && e.contains("nonsense!!") && e.contains("neither a level"), "{e}");
    }

    /// Observed: `PREFIX_BATCHER__LLM__API_KEY=0123…` (26 digits) reached the server as
    /// `1234567890123456800000000`, and `PREFIX_BATCHER__INSTANCE__NAME=007` became `7`.
    #[test]
    fn string_keys_from_the_environment_are_taken_verbatim() {
        let mut raw = RawConfig::default();
        // What the `config` crate made of them.
        raw.llm.api_key = "1234567890123456800000000".into();
        raw.instance.name = "7".into();
        raw.llm.model = "1000".into();
        raw.amqp.partitions = 8;
        let vars = [
            ("PREFIX_BATCHER__LLM__API_KEY", "01234567890123456789012345"),
            ("PREFIX_BATCHER__INSTANCE__NAME", "007"),
            ("PREFIX_BATCHER__LLM__MODEL", "1e3"),
            ("PREFIX_BATCHER__AMQP__PARTITIONS", "08"),
            ("PREFIX_BATCHER__NO__SUCH", "x"),
            ("OTHER__LLM__MODEL", "y"),
        ];
        let kept = keep_env_strings(raw, vars.iter().map(|(k, v)| (k.to_string(), v.to_string()))).unwrap();
        assert_eq!(kept.llm.api_key, "01234567890123456789012345");
        assert_eq!(kept.instance.name, "007");
        assert_eq!(kept.llm.model, "1e3");
        assert_eq!(kept.amqp.partitions, 8, "an integer key is the crate's to read");
    }

    /// An endpoint with `/v1` (the daemon would call `/v1/v1/completions`, a 404 that opens the
    /// breaker for ever) or with a query (often a token, which the error must not print) is
    /// refused with the rule.
    #[test]
    fn llm_endpoints_are_base_urls_without_v1_or_query() {
        let mut r = RawConfig::default();
        for (bad, rule) in [
            ("http://h:8000/v1", "without /v1"),
            ("http://h:8000/v1/", "without /v1"),
            ("https://gw/openai/v1", "without /v1"),
            ("http://h:8000/V1", "without /v1"),
            ("http://h:8000/v1/completions", "without /v1"),
            ("http://h:8000/v1/chat/completions/", "without /v1"),
            ("http://h:8000/?key=hunter2", "must not have a ?query"),
            ("http://h:8000/#x", "must not have a ?query"),
        ] {
            r.llm.endpoints = vec![bad.into()];
            let e = err(&r);
            assert!(e.contains("llm.endpoints") && e.contains(rule) && !e.contains("hunter2"), "{bad}: {e}");
        }
        // Observed: the value shown had neither (`"http://h:8000/"`), next to "must not have a ?query".
        for (bad, shown) in [("http://h:8000/?key=hunter2", "\"http://h:8000/?***\""), ("http://h:8000/#x", "\"http://h:8000/#***\"")] {
            r.llm.endpoints = vec![bad.into()];
            let e = err(&r);
            assert!(e.contains(shown), "{bad}: {e}");
        }
        r.llm.endpoints = vec!["http://h:8000/openai".into(), "http://h:8001/".into(), "http://gw/v1/llama/".into()];
        ok(&r);
        // Observed: `PREFIX_BATCHER__LLM__ENDPOINTS=` (set but empty) or a trailing comma gave
        // "must be an http:// or https:// URL (relative URL without a base)".
        for items in [vec![""], vec!["http://h:8000", ""], vec!["http://u:hunter2@h:8000", " ", "http://h:8001"]] {
            r.llm.endpoints = items.iter().map(|&e| e.into()).collect();
            let e = err(&r);
            assert!(e.contains("llm.endpoints") && e.contains("empty item") && !e.contains("hunter2"), "{items:?}: {e}");
        }
    }

    #[test]
    fn queue_and_exchange_names_must_not_collide_or_use_amq() {
        let cases: [(&str, Edit, &str); 7] = [
            ("dlq = input", |r| r.amqp.dead_letter_queue = r.amqp.input_queue.clone(), "must differ from amqp.input_queue"),
            ("results = input", |r| r.amqp.results_queue = r.amqp.input_queue.clone(), "must differ from amqp.input_queue"),
            ("exchanges", |r| r.amqp.dead_letter_exchange = r.amqp.shard_exchange.clone(), "must differ from amqp.shard_exchange"),
            ("amq.direct", |r| r.amqp.shard_exchange = "amq.direct".into(), "reserved by RabbitMQ"),
            ("prefix = input", |r| r.amqp.partition_queue_prefix = r.amqp.input_queue.clone(), "must not name amqp.input_queue"),
            ("input under prefix", |r| r.amqp.input_queue = "prefix-batcher.partition.001".into(), "must not name amqp.input_queue"),
            ("reconnect backoff", |r| r.amqp.reconnect_backoff_max = "1ms".into(), "at least amqp.reconnect_backoff_initial"),
        ];
        for (name, set, says) in cases {
            let mut r = RawConfig::default();
            set(&mut r);
            let e = err(&r);
            assert!(e.contains(says), "{name}: {e}");
        }
        let mut r = RawConfig::default();
        r.llm.endpoints = vec!["http://127.0.0.1:8000".into(), "http://127.0.0.1:8000/".into()];
        assert!(err(&r).contains("must not list one URL twice"));
        let mut r = RawConfig::default();
        r.llm.request_timeout = "1ns".into();
        assert!(err(&r).contains("llm.request_timeout") && err(&r).contains("at least 1ms"));
        let mut r = RawConfig::default();
        r.llm.liveness_check_after = "50ms".into();
        let e = err(&r);
        assert!(e.contains("llm.liveness_check_after") && e.contains("= 50ms") && e.contains("at least 1s"), "{e}");
        r.llm.liveness_check_after = "0s".into();
        assert!(Settings::from_raw(&r).is_ok(), "0s: never checked");
    }

    #[test]
    fn zero_batch_wait_is_rejected_naming_the_key() {
        let mut r = RawConfig::default();
        r.batching.max_batch_wait = "0s".into();
        let e = err(&r);
        assert!(e.contains("batching.max_batch_wait") && e.contains("\"0s\"") && e.contains("greater than zero"), "{e}");
    }

    /// Before, a huge capacity was accepted, then every partition session panicked in tokio's
    /// channel constructor (above `usize::MAX >> 3`).
    #[test]
    fn channel_capacity_is_bounded_naming_the_key() {
        let mut r = RawConfig::default();
        for (bad, says) in [(0, "at least 1"), (MAX_CHANNEL_CAPACITY + 1, "at most 1000000"), (usize::MAX, "at most 1000000")] {
            r.batching.channel_capacity = bad;
            let e = err(&r);
            assert!(e.contains("batching.channel_capacity") && e.contains(&bad.to_string()) && e.contains(says), "{e}");
        }
        r.batching.channel_capacity = MAX_CHANNEL_CAPACITY;
        ok(&r);
    }

    #[test]
    fn prefetch_must_cover_batch_size() {
        let mut r = RawConfig::default();
        r.batching.max_batch_size = 100;
        let e = err(&r);
        assert!(e.contains("amqp.partition_prefetch") && e.contains("64") && e.contains("max_batch_size (100)"), "{e}");
    }

    #[test]
    fn longest_hold_adds_wait_attempts_backoffs_and_confirms() {
        let s = ok(&RawConfig::default());
        // 1 s wait + 4 × 300 s calls + (0.5 + 1 + 2) s backoffs + 2 × 30 s confirms.
        assert_eq!(s.longest_hold(), Duration::from_millis(1_264_500));
        assert_eq!(s.amqp.consumer_timeout, Duration::from_secs(30 * 60));
        let mut r = RawConfig::default();
        r.llm.max_attempts = 7;
        r.llm.backoff_max = "3s".into();
        // Backoffs 0.5, 1, 2, then capped: 3, 3, 3.
        r.amqp.consumer_timeout = "1h".into();
        let s = ok(&r);
        assert_eq!(s.longest_hold(), Duration::from_millis(1_000 + 7 * 300_000 + 12_500 + 60_000));
    }

    #[test]
    fn a_hold_past_the_consumer_timeout_margin_is_rejected_naming_the_keys() {
        let mut r = RawConfig::default();
        r.amqp.consumer_timeout = "25m".into(); // 0.8 × 1500 s = 1200 s < 1264.5 s
        let e = err(&r);
        for part in ["amqp.consumer_timeout", "\"25m\"", "1264.5s", "1200s", "llm.max_attempts 4", "llm.request_timeout 300s", "amqp.confirm_timeout 30s"] {
            assert!(e.contains(part), "{part} missing: {e}");
        }
        r.amqp.consumer_timeout = "27m".into(); // 1296 s ≥ 1264.5 s
        ok(&r);
    }

    #[test]
    fn buffer_budget_must_hold_the_largest_message() {
        let mut r = RawConfig { batching: RawBatching { max_buffered_bytes: 1000, ..RawBatching::default() }, ..RawConfig::default() };
        let e = err(&r);
        for part in ["batching.max_buffered_bytes", "= 1000", "amqp.max_message_bytes (4194304)"] {
            assert!(e.contains(part), "{part} missing: {e}");
        }
        r.amqp.max_message_bytes = 1000;
        assert_eq!(ok(&r).batching.max_buffered_bytes.get(), 1000);
    }

    #[test]
    fn lease_timing_rule() {
        let mut r = RawConfig::default();
        r.ownership.renew_deadline = "20s".into();
        assert!(err(&r).contains("ownership.renew_deadline"));
        let mut r = RawConfig::default();
        r.ownership.renew_interval = "9s".into();
        assert!(err(&r).contains("ownership.renew_interval"));
    }

    #[test]
    fn a_negative_duration_is_refused_as_negative() {
        let mut r = RawConfig::default();
        r.ownership.llm_down_hand_over_after = "-5s".into();
        let e = err(&r);
        assert!(e.contains("ownership.llm_down_hand_over_after") && e.contains("\"-5s\"") && e.contains("must not be negative"), "{e}");
    }

    /// Operators write `(?i)` and `\p{…}` in patterns; the build once lacked the regex crate's
    /// Unicode case folding and refused them.
    #[test]
    fn sharding_rule_patterns_take_case_insensitive_and_unicode_classes() {
        let mut r = RawConfig::default();
        r.sharding.rules = vec![
            RawShardRule { pattern: "(?i)^evaluate".into(), shards: 2 },
            RawShardRule { pattern: r"^\p{Greek}+".into(), shards: 2 },
        ];
        let s = ok(&r);
        assert!(s.sharding.rules[0].pattern.is_match("EVALUATE the following"));
        r.sharding.rules.push(RawShardRule { pattern: "(".into(), shards: 2 });
        let e = err(&r);
        assert!(e.contains("`sharding.rules[2].pattern` = \"(\": must be a regular expression"), "{e}");
        r.sharding.rules[2] = RawShardRule { pattern: "x".into(), shards: 0 };
        assert!(err(&r).contains("`sharding.rules[2].shards` = 0: must be at least 1"));
    }

    /// Observed: `PREFIX_BATCHER__FOO__BAR=1` gave "unknown field `foo`" without the variable;
    /// `PREFIX_BATCHER__AMQP=1` named an internal type.
    #[test]
    fn an_environment_variable_that_names_no_key_is_named() {
        let e = |v: &str| check_env_names(std::iter::once(v.to_owned())).map_err(|e| e.to_string());
        assert!(e("PREFIX_BATCHER__AMQP__PARTITIONS").is_ok());
        // Observed: one underscore throughout was ignored without a word (and `check-config` passed).
        let got = e("PREFIX_BATCHER_AMQP_PARTITIONS").unwrap_err().to_string();
        assert!(got.contains("amqp.partitions") && got.contains("PREFIX_BATCHER__AMQP__PARTITIONS"), "{got}");
        let got = e("PREFIX_BATCHER_LLM_REQUEST_TIMEOUT").unwrap_err().to_string();
        assert!(got.contains("PREFIX_BATCHER__LLM__REQUEST_TIMEOUT"), "{got}");
        for other in ["PREFIX_BATCHER_DATA", "PREFIX_BATCHER_TEST_LOG", "PREFIX_BATCHER_AMQP_NO_SUCH_KEY"] {
            assert!(e(other).is_ok(), "{other} is not a configuration key");
        }
        assert!(e("PREFIX_BATCHER__AMQP__TLS_CA_FILE").is_ok(), "a key with underscores");
        assert!(e("PREFIX_BATCHER_DATA").is_ok(), "not an override");
        let got = e("PREFIX_BATCHER_AMQP__PARTITIONS").unwrap_err();
        assert!(got.contains("`amqp.partitions` = set by PREFIX_BATCHER_AMQP__PARTITIONS") && got.contains("two underscores"), "{got}");
        let got = e("PREFIX_BATCHER__FOO__BAR").unwrap_err();
        assert!(got.contains("`foo.bar` = set by PREFIX_BATCHER__FOO__BAR") && got.contains("no section `foo`") && got.contains("amqp"), "{got}");
        let got = e("PREFIX_BATCHER__AMQP__PARTITONS").unwrap_err();
        assert!(got.contains("[amqp] has no key `partitons`") && got.contains("partitions"), "{got}");
        let got = e("PREFIX_BATCHER__AMQP").unwrap_err();
        assert!(got.contains("names a section"), "{got}");
        let got = e("PREFIX_BATCHER__SHARDING__KEYS__TENANT").unwrap_err();
        assert!(got.contains("only be set in the configuration file"), "{got}");
    }

    /// Observed: `"tenant" = 0` gave `` `sharding.keys` = 0: must be at least 1 ``: which key?
    #[test]
    fn a_bad_sharding_key_entry_is_named() {
        let mut r = RawConfig::default();
        r.sharding.keys.insert("tenant-a".into(), 0);
        let e = err(&r);
        assert!(e.contains("`sharding.keys.\"tenant-a\"` = 0: must be at least 1"), "{e}");
        r.sharding.keys.insert("tenant-a".into(), 100_000);
        let e = err(&r);
        assert!(e.contains("`sharding.keys.\"tenant-a\"` = 100000: must be at most amqp.partitions"), "{e}");
    }

    /// Observed: a rule's shard count above `amqp.partitions` was named `sharding.rules.shards`
    /// (which rule?), and an empty key was accepted although no request can have one.
    #[test]
    fn sharding_entries_are_named_and_an_empty_key_is_refused() {
        let mut r = RawConfig::default();
        r.sharding.rules = vec![RawShardRule { pattern: "a".into(), shards: 2 }, RawShardRule { pattern: "b".into(), shards: 5000 }];
        let e = err(&r);
        assert!(e.contains("`sharding.rules[1].shards` = 5000: must be at most amqp.partitions (64)"), "{e}");
        let mut r = RawConfig::default();
        r.sharding.keys.insert(String::new(), 2);
        let e = err(&r);
        assert!(e.contains("`sharding.keys.\"\"` = 2: must not be empty"), "{e}");
    }

    /// A level-0 key written in capitals (status and results write it in lower case) matches
    /// the level-0 key, and still an explicit key of that text; both spellings of one key are
    /// refused.
    #[test]
    fn a_level_0_key_matches_in_any_case() {
        let mut r = RawConfig::default();
        r.sharding.keys.insert("0123456789ABCDEF".into(), 3);
        let s = ok(&r);
        assert_eq!(s.sharding.keys.get("0123456789abcdef").map(|n| n.get()), Some(3));
        assert_eq!(s.sharding.keys.get("0123456789ABCDEF").map(|n| n.get()), Some(3));
        r.sharding.keys.insert("0123456789abcdef".into(), 4);
        let e = err(&r);
        assert!(e.contains("names the same level-0 key as `sharding.keys.\"0123456789abcdef\"`") || e.contains("names the same level-0 key as sharding.keys.\"0123456789abcdef\""), "{e}");
    }

    #[test]
    fn bad_values_name_key_value_and_rule() {
        let cases: Vec<(Edit, &str)> = vec![
            (|r| r.keying.mode = "fast".into(), "keying.mode"),
            (|r| r.keying.chat_key = "x".into(), "keying.chat_key"),
            (|r| r.batching.max_batch_wait = "soon".into(), "batching.max_batch_wait"),
            (|r| r.amqp.partitions = 0, "amqp.partitions"),
            (|r| r.amqp.partition_prefetch = 70000, "amqp.partition_prefetch"),
            (|r| r.sharding.default_shards = 0, "sharding.default_shards"),
            (|r| (r.keying.mode, r.sharding.default_shards) = ("prefix".into(), 65), "sharding.default_shards"),
            (|r| r.sharding.max_shards = 0, "sharding.max_shards"),
            (|r| r.llm.endpoints = vec![], "llm.endpoints"),
            (|r| r.llm.endpoints = vec!["ftp://x".into()], "llm.endpoints"),
            (|r| r.llm.max_attempts = 0, "llm.max_attempts"),
            (|r| r.http.listen = "nowhere".into(), "http.listen"),
            (|r| r.log.format = "xml".into(), "log.format"),
            (|r| r.amqp.url = "http://x".into(), "amqp.url"),
            (|r| r.sharding.rules = vec![RawShardRule { pattern: "(".into(), shards: 2 }], "sharding.rules[0].pattern"),
            (|r| r.instance.name = "a b".into(), "instance.name"),
            (|r| r.instance.name = "a\u{202e}b".into(), "instance.name"),
            (|r| r.instance.name = "a\u{200b}b".into(), "instance.name"),
            (|r| r.instance.name = "\u{feff}ab".into(), "instance.name"),
            (|r| r.amqp.delivery_limit = 0, "amqp.delivery_limit"),
            (|r| r.amqp.consumer_timeout = "0s".into(), "amqp.consumer_timeout"),
            (|r| r.ownership.llm_down_hand_over_after = "later".into(), "ownership.llm_down_hand_over_after"),
            (|r| r.batching.max_buffered_bytes = 0, "batching.max_buffered_bytes"),
            (|r| r.llm.max_response_bytes = 0, "llm.max_response_bytes"),
            (|r| r.redis.sentinels = vec!["127.0.0.1:26379".into()], "redis.sentinel_master"),
            (|r| r.redis.sentinel_master = "mymaster".into(), "redis.sentinels"),
            (|r| {
                r.redis.sentinels = vec!["127.0.0.1".into()];
                r.redis.sentinel_master = "mymaster".into();
            }, "redis.sentinels"),
            (|r| {
                r.redis.sentinels = vec!["redis://:a@h:1".into(), "redis://:b@h:2".into()];
                r.redis.sentinel_master = "mymaster".into();
            }, "redis.sentinels"),
        ];
        for (f, key) in cases {
            let mut r = RawConfig::default();
            f(&mut r);
            let e = err(&r);
            assert!(e.contains(key) && e.contains("must"), "{key}: {e}");
        }
    }

    /// Observed: `PREFIX_BATCHER__LLM__API_KEY="sk-… "` (a blank left in an environment file)
    /// was sent in the Authorization header as is; other keys refuse such blanks.
    #[test]
    fn an_api_key_with_a_blank_around_it_is_refused_without_showing_it() {
        for key in ["sk-secret123 ", " sk-secret123", "sk-secret123\n"] {
            let mut r = RawConfig::default();
            r.llm.api_key = key.into();
            let e = err(&r);
            assert!(e.contains("llm.api_key") && e.contains("whitespace") && !e.contains("secret123"), "{e}");
        }
        let mut r = RawConfig::default();
        r.llm.api_key = "sk-secret123".into();
        assert!(ok(&r).llm.api_key.is_some());
    }

    /// Observed: the sentinel entry `SentPw-Kk29@127.0.0.1:26447` (a password without its colon)
    /// passed `check-config`; the password was read as a user name and never sent, and the
    /// startup then failed with a refusal blamed on `redis.url`. A Redis URL that names a user
    /// without a password is refused, naming the key and showing neither.
    #[test]
    fn a_redis_user_without_a_password_is_refused() {
        for (set, key) in [
            ((|r: &mut RawConfig| r.redis.url = "redis://hunter2@127.0.0.1:6379/0".into()) as fn(&mut RawConfig), "redis.url"),
            (|r: &mut RawConfig| {
                r.redis.sentinels = vec!["hunter2@127.0.0.1:26379".into()];
                r.redis.sentinel_master = "mymaster".into();
            }, "redis.sentinels"),
            (|r: &mut RawConfig| {
                r.redis.sentinels = vec!["rediss://hunter2@s1:26379".into()];
                r.redis.sentinel_master = "mymaster".into();
                r.redis.url = "rediss://:pw@placeholder:6379/0".into();
            }, "redis.sentinels"),
        ] {
            let mut r = RawConfig::default();
            set(&mut r);
            let e = err(&r);
            assert!(e.contains(key) && e.contains("no password") && !e.contains("hunter2"), "{e}");
        }
        for url in ["redis://:hunter2@h:6379/0", "redis://user:hunter2@h:6379/0", "redis://h:6379/0"] {
            let mut r = RawConfig::default();
            r.redis.url = url.into();
            ok(&r);
        }
        // Reported: the redis crate reads no password from a redis:// URL's query; this one
        // connected unauthenticated (NOAUTH from a server with ACL users).
        for url in ["redis://user@h:6379/0?password=hunter2", "redis://h:6379/0?password=hunter2"] {
            let mut r = RawConfig::default();
            r.redis.url = url.into();
            let e = err(&r);
            assert!(e.contains("redis.url") && e.contains("in the query") && !e.contains("hunter2"), "{e}");
        }
    }

    /// Reported: URLs the Redis client refuses when it connects passed `check-config`, and `run`
    /// then retried the connection forever ("Invalid protocol version", "Cannot connect to a
    /// wildcard address") instead of stopping with 78.
    #[test]
    fn a_redis_url_the_client_refuses_stops_startup() {
        for (url, says) in [
            ("redis://:hunter2@127.0.0.1:6379/0?protocol=4", "protocol"),
            ("redis://:hunter2@0.0.0.0:6379/0", "wildcard"),
        ] {
            let mut r = RawConfig::default();
            r.redis.url = url.into();
            let e = err(&r);
            assert!(e.contains("redis.url") && e.contains("refused by the Redis client") && e.contains(says) && !e.contains("hunter2"), "{url}: {e}");
        }
        let mut r = RawConfig::default();
        r.redis.sentinels = vec!["0.0.0.0:26379".into()];
        r.redis.sentinel_master = "mymaster".into();
        assert!(err(&r).contains("redis.sentinels"), "{}", err(&r));
        for url in ["redis://127.0.0.1:6379/0?protocol=resp3", "rediss://h:6380/2", "redis+unix:///run/redis.sock?db=3"] {
            let mut r = RawConfig::default();
            r.redis.url = url.into();
            ok(&r);
        }
    }

    /// Observed: an API key holding a line break passed `check-config`, and `run` then stopped
    /// with exit 1 (restarted in a loop under systemd) when the HTTP client refused the header;
    /// `Bearer sk-…` was sent as `Authorization: Bearer Bearer sk-…`. Both stop the startup
    /// with 78 now, naming the key but not showing it.
    #[test]
    fn an_api_key_that_cannot_be_sent_as_a_bearer_token_is_refused_without_showing_it() {
        for (key, rule) in [
            ("sk-secret123\nX", "control character"),
            ("sk-secret123\u{7}", "control character"),
            ("Bearer sk-secret123", "without `Bearer `"),
            ("bearer sk-secret123", "without `Bearer `"),
            ("Bearer\tsk-secret123", "without `Bearer `"),
        ] {
            let mut r = RawConfig::default();
            r.llm.api_key = key.into();
            let e = err(&r);
            assert!(e.contains("llm.api_key") && e.contains(rule) && !e.contains("secret123"), "{key:?}: {e}");
        }
        let mut r = RawConfig::default();
        r.llm.api_key = "BearerToken-secret123 with space".into();
        assert!(ok(&r).llm.api_key.is_some(), "a token may start with the word and hold spaces");
    }

    #[test]
    fn secrets_do_not_print() {
        let mut r = RawConfig::default();
        r.amqp.url = "amqp://user:hunter2@host:5672/%2f".into();
        r.redis.url = "redis://:s3cret@host:6379/".into();
        r.llm.api_key = "tok-123".into();
        let s = ok(&r);
        let dbg = format!("{s:?}");
        for secret in ["hunter2", "s3cret", "tok-123"] {
            assert!(!dbg.contains(secret), "{dbg}");
            assert!(!redacted_toml(&r).contains(secret));
        }
        assert_eq!(s.amqp.url.expose(), "amqp://user:hunter2@host:5672/%2f");
        r.amqp.partitions = 0;
        assert!(!err(&r).contains("hunter2"));
        r.amqp.partitions = 64;
        r.amqp.url = "amqp://user:hunter2@ho st".into();
        assert!(!err(&r).contains("hunter2"));
        for bad in ["amqp//user:hunter2@host:5672/%2f", "user:hunter2@host:5672"] {
            r.amqp.url = bad.into();
            let e = err(&r);
            assert!(!e.contains("hunter2") && e.contains("amqp.url"), "{e}");
        }
        assert_eq!(redact_text("2 | url = \"amqp://u:hunter2@h:5672/%2f"), "2 | url = \"amqp://u:***@h:5672/%2f");
        assert!(!redact_text("3 | \"api_key\" = \"hunter2SECRET\" x").contains("hunter2"), "a quoted key is redacted too");
        assert_eq!(redact_text("3 | api_key = sk-hunter2"), "3 | api_key = ***");
        assert!(!redact_text("redis://:hunter2@h:6379/").contains("hunter2"));
        assert_eq!(redact_text("4 | url = \"redis://h/0?Password=hunter2&db=1"), "4 | url = \"redis://h/0?Password=***&db=1");
        // Observed: a TOML syntax error on a line holding a pasted key showed the key.
        assert_eq!(redact_key_material("2 | tls_key_file = \"MIIEvQIBADAN\" x"), "2 | tls_key_file = ***");
        assert_eq!(redact_key_material("5 | MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQDG"), "5 | ***");
        assert_eq!(redact_key_material("2 | partitions = \"8\""), "2 | partitions = \"8\"");
        let dir = std::env::temp_dir().join(format!("pb-config-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pasted.toml");
        std::fs::write(&file, "[redis]\ntls_key_file = \"\"\"-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQDGrLcbSECRET\n").unwrap();
        let e = load_raw(Some(&file)).unwrap_err().to_string();
        assert!(e.contains("cannot parse configuration file") && !e.contains("MIIEvQ") && !e.contains("SECRET"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
        // URLs that do not parse, or parse but carry a secret in the query or the user part.
        r.amqp.url = "amqp://h:5672/%2f".into();
        for (key, bad) in [
            ("llm.endpoints", "http://127.0.0.1:99999/?k=hunter2"),
            ("llm.endpoints", "ftp://hunter2@x"),
            ("llm.endpoints", "ftp://u:hunter2@x/"),
            ("llm.endpoints", "http://h:1/#hunter2"),
            ("amqp.url", "amqp://h:99999/?password=hunter2"),
            ("redis.url", "redis://h:99999/0?password=hunter2"),
            ("redis.url", "redis://h:6379/abc?password=hunter2"),
        ] {
            let mut r = r.clone();
            match key {
                "llm.endpoints" => r.llm.endpoints = vec![bad.into()],
                "amqp.url" => r.amqp.url = bad.into(),
                _ => r.redis.url = bad.into(),
            }
            let e = err(&r);
            assert!(e.contains(key) && !e.contains("hunter2"), "{bad}: {e}");
        }
        r.amqp.url = "amqp://u:p@h:5672/%2f#hunter2".into();
        let e = err(&r);
        assert!(e.contains("amqp.url") && e.contains("#fragment") && !e.contains("hunter2"), "{e}");
        r.amqp.url = "amqp://h:5672/%2f".into();
        r.redis.sentinels = vec!["u:hunter2@s2:26379".into()];
        let t = redacted_toml(&r);
        assert!(t.contains("\"***@s2:26379\"") && !t.contains("hunter2"), "one level of quotes, no secret: {t}");
        r.redis.sentinels.clear();
        let u = secret_url("redis.url", "redis://h:6379/0?password=hunter2&timeout=3&Auth_Token=x9", &["redis"]).unwrap();
        assert_eq!(u.redacted(), "redis://h:6379/0?password=***&timeout=3&Auth_Token=***");
        assert_eq!(redact_str("http://h:99999/x?k=hunter2#f"), "\"http://h:99999/x\" (query not shown)");
        assert_eq!(redact_str("a://u:p?w@h:0/?q=1"), "\"a://***@h:0/\" (query not shown)", "a '?' in the password");
        // The first half of `amqp://u:Pa55,word@h` split at its comma (an environment list).
        assert_eq!(redact_str("amqp://u:Pa55"), "\"amqp://u:***\"");
        assert_eq!(redact_str("amqp://h:99999/x"), "\"amqp://h:99999/x\"", "a port is shown");
        assert_eq!(redact_str("amqp://[::1]/x"), "\"amqp://[::1]/x\"");
    }

    /// `redis://host/abc` used to pass `check-config` and fail every connection attempt.
    #[test]
    fn redis_url_path_must_be_a_database_number() {
        let mut r = RawConfig::default();
        for good in ["redis://h:6379", "redis://h:6379/", "redis://:pw@h:6379/3", "rediss://h:6380/15", "unix:///run/redis.sock"] {
            r.redis.url = good.into();
            ok(&r);
        }
        for bad in ["redis://:hunter2@h:6379/abc", "redis://h:6379/-1", "redis://h:6379/1/2"] {
            r.redis.url = bad.into();
            let e = err(&r);
            assert!(e.contains("redis.url") && e.contains("database number") && !e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn amqp_urls_replace_amqp_url_and_are_validated_like_it() {
        let mut r = RawConfig::default();
        let s = ok(&r);
        assert_eq!(s.amqp.nodes.len(), 1);
        assert_eq!(s.amqp.nodes[0], s.amqp.url);
        r.amqp.urls = vec!["amqp://u:hunter2@a:5672/%2f".into(), " amqp://u:hunter2@b:5673/%2f".into()];
        let s = ok(&r);
        assert_eq!(s.amqp.nodes.len(), 2);
        assert_eq!(s.amqp.url.expose(), "amqp://u:hunter2@a:5672/%2f", "the first node replaces amqp.url");
        assert_eq!(s.amqp.nodes[1].expose(), "amqp://u:hunter2@b:5673/%2f");
        assert!(!redacted_toml(&r).contains("hunter2"), "{}", redacted_toml(&r));
        for (bad, rule) in [
            (vec!["http://a:1".to_owned()], "scheme"),
            (vec!["amqp://u:hunter2@a:1".to_owned(), "amqps://u:hunter2@b:2".to_owned()], "same scheme"),
            (vec!["amqp://u:hunter2@ho st".to_owned()], "must be a URL"),
            (vec!["amqp://a:1".to_owned(); MAX_AMQP_NODES + 1], "at most"),
        ] {
            r.amqp.urls = bad;
            let e = err(&r);
            assert!(e.contains("amqp.urls") && e.contains(rule) && !e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn amqp_heartbeat_goes_into_the_connect_url_in_whole_seconds() {
        let mut r = RawConfig::default();
        let s = ok(&r);
        assert_eq!(s.amqp.heartbeat, 10);
        assert_eq!(s.amqp.connect_url(0), "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10");
        r.amqp.url = "amqps://u:p@h:5671/v?frame_max=131072".into();
        r.amqp.heartbeat = "1m".into();
        let s = ok(&r);
        assert_eq!(s.amqp.heartbeat, 60);
        assert_eq!(s.amqp.connect_url(0), "amqps://u:p@h:5671/v?frame_max=131072&heartbeat=60");
        assert_eq!(s.amqp.url.redacted(), "amqps://u:***@h:5671/v?frame_max=131072", "logs show the URL as configured");
        r.amqp.heartbeat = "0s".into();
        assert_eq!(ok(&r).amqp.connect_url(0), "amqps://u:p@h:5671/v?frame_max=131072", "0: the broker's value");
        r.amqp.url = "amqp://u:p@h/%2f".into();
        for (bad, rule) in [("1500ms", "whole seconds"), ("65536s", "at most 65535s"), ("soon", "duration")] {
            r.amqp.heartbeat = bad.into();
            let e = err(&r);
            assert!(e.contains("amqp.heartbeat") && e.contains(bad) && e.contains(rule), "{e}");
        }
        r.amqp.heartbeat = "10s".into();
        r.amqp.url = "amqp://u:hunter2@h/%2f?heartbeat=5".into();
        let e = err(&r);
        assert!(e.contains("amqp.url") && e.contains("amqp.heartbeat instead") && !e.contains("hunter2"), "{e}");
        r.amqp.url = "amqp://u:hunter2@h/%2f".into();
        r.amqp.urls = vec!["amqp://u:hunter2@a/%2f".into(), "amqp://u:hunter2@b/%2f?heartbeat=5".into()];
        let e = err(&r);
        assert!(e.contains("amqp.urls") && e.contains("amqp.heartbeat instead") && !e.contains("hunter2"), "{e}");
    }

    #[test]
    fn broker_urls_are_checked_as_the_amqp_client_reads_them() {
        let mut r = RawConfig::default();
        r.amqp.url = "amqp://u:hunter2@h/%2f?frame_max=131072&channel_max=272&connection_timeout=5000&auth_mechanism=plain".into();
        let shown = ok(&r).amqp.url.to_string();
        assert!(shown.contains("auth_mechanism=plain") && !shown.contains("hunter2"), "the mechanism is shown, the password not: {shown}");
        r.amqp.url = "amqp://u:hunter2@h/%2f?frame_max=0&channel_max=0".into();
        ok(&r);
        r.amqp.url = "amqp://u:hunter2@h/a%2fb?frame_max=4096".into();
        ok(&r);
        for (bad, rule) in [
            ("amqp://u:hunter2@h/%2f?frame_max=abc", "cannot read it: invalid digit"),
            ("amqp://u:hunter2@h/%2f?channel_max=70000", "cannot read it"),
            ("amqp://u:hunter2@h/%2f?auth_mechanism=kerberos", "Invalid SASL mechanism"),
            ("amqp://u:hunter2@h/%2f?heartbeats=5", "\"heartbeats\" is not one the AMQP client reads"),
            ("amqp://u:hunter2@h/%2f?connection_timout=5000", "frame_max, channel_max, connection_timeout, auth_mechanism"),
            ("amqp://u:hunter2@h/%2f?connection_timeout=0", "connection_timeout must be at least 1"),
            ("amqp://u:hunter2@h/%2f?frame_max=1", "frame_max must be 0 (the broker's) or at least 4096"),
            ("amqp://u:hunter2@h/%2f?channel_max=1", "channel_max must be 0 (the broker's) or at least 272"),
            ("amqp://u:hunter2@h/%2f?channel_max=271", "at least 272"),
            ("amqp://u:hunter2@h/a/b", "write a '/' inside it as %2f"),
            ("amqp://u:hunter2@h//", "write a '/' inside it as %2f"),
            ("amqp://u:hunter2@h/", "the vhost is empty"),
            ("amqp://u:hunter2@h/%2f?password=hunter2", "query parameter \"password\" is not one the AMQP client reads"),
            ("amqp://u:hunter2%ZZ@h/%2f", "its password has a '%' that does not start a percent-escape"),
            ("amqp://u:hunter2%2@h/%2f", "its password has a '%' that does not start a percent-escape"),
            ("amqp://u%G1:hunter2@h/%2f", "its user has a '%'"),
        ] {
            r.amqp.url = bad.into();
            let e = err(&r);
            assert!(e.contains("amqp.url") && e.contains(rule) && !e.contains("hunter2"), "{bad}: {e}");
            r.amqp.url = "amqp://u:hunter2@h/%2f".into();
            r.amqp.urls = vec!["amqp://u:hunter2@a/%2f".into(), bad.into()];
            let e = err(&r);
            assert!(e.contains("amqp.urls") && e.contains(rule) && !e.contains("hunter2"), "{bad}: {e}");
            r.amqp.urls.clear();
        }
        // amqp.url is checked even while amqp.urls replaces it.
        r.amqp.urls = vec!["amqp://u:hunter2@a/%2f".into()];
        r.amqp.url = "amqp://u:hunter2@ho st".into();
        assert!(err(&r).contains("amqp.url"));
    }

    #[test]
    fn an_ipv6_broker_host_is_kept_for_the_amqp_client() {
        let mut r = RawConfig::default();
        r.amqp.url = "amqp://u:p@[2001:db8::5]:5673/%2f".into();
        let uri = ok(&r).amqp.connect_uri(0);
        // lapin's own parser gives "localhost" here (it reads only domain names).
        assert_eq!(uri.authority.host, "2001:db8::5");
        assert_eq!((uri.authority.port, uri.query.heartbeat), (5673, Some(10)));
        r.amqp.url = "amqp://u:p@10.1.2.3/%2f".into();
        let uri = ok(&r).amqp.connect_uri(0);
        assert_eq!((uri.authority.host.as_str(), uri.authority.port), ("10.1.2.3", 5672));
        r.amqp.url = "amqps://u:p@rabbit.example/v?frame_max=131072".into();
        let uri = ok(&r).amqp.connect_uri(0);
        assert_eq!((uri.authority.host.as_str(), uri.authority.port, uri.vhost.as_str()), ("rabbit.example", 5671, "v"));
        assert_eq!((uri.query.frame_max, uri.authority.userinfo.password.as_str()), (Some(131072), "p"));
    }

    #[test]
    fn quorum_initial_group_size_zero_leaves_the_argument_out() {
        let mut r = RawConfig::default();
        assert_eq!(ok(&r).amqp.quorum_initial_group_size.map(NonZeroU32::get), Some(DEFAULT_QUORUM_INITIAL_GROUP_SIZE));
        r.amqp.quorum_initial_group_size = 0;
        assert_eq!(ok(&r).amqp.quorum_initial_group_size, None);
        r.amqp.quorum_initial_group_size = 1001;
        assert!(err(&r).contains("amqp.quorum_initial_group_size"));
    }

    fn load(path: Option<&Path>) -> Result<Settings, ConfigError> {
        Settings::from_raw(&load_raw(path)?)
    }

    #[test]
    fn file_and_env_layers_and_unknown_keys() {
        let dir = std::env::temp_dir().join(format!("pb-cfg-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        std::fs::write(&path, "[batching]\nmax_batch_size = 4\nmax_batch_wait = \"250ms\"\n[llm]\nendpoints = [\"http://a:1\", \"http://b:2\"]\n").unwrap();
        let s = load(Some(&path)).unwrap();
        assert_eq!(s.batching.max_batch_size.get(), 4);
        assert_eq!(s.batching.max_batch_wait, Duration::from_millis(250));
        assert_eq!(s.llm.endpoints.len(), 2);
        std::fs::write(&path, "[batching]\nmax_batch_sise = 4\n").unwrap();
        let e = load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("`batching.max_batch_sise` = 4") && e.contains("[batching] has no key `max_batch_sise`") && e.contains("max_batch_size"), "{e}");
        std::fs::write(&path, "[redis]\npasword = \"hunter2\"\n").unwrap();
        let e = load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("`redis.pasword` = a string of 7 characters") && !e.contains("hunter2"), "{e}");
        std::fs::write(&path, "[redis]\npasword = [\"hunter2\"]\n").unwrap();
        let e = load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("`redis.pasword` = an array of 1 value (not shown") && !e.contains("hunter2"), "{e}");
        std::fs::write(&path, "[batchin]\n").unwrap();
        let e = load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("there is no section `batchin`"), "{e}");
        // Sections without fixed keys are the deserializer's: a static shard table loads.
        std::fs::write(&path, "[sharding.keys]\nabc = 2\n[[sharding.rules]]\npattern = \"^x\"\nshards = 2\n").unwrap();
        load(Some(&path)).unwrap();
        let e = load(Some(&dir)).unwrap_err().to_string();
        assert!(e.contains("is a directory") && e.contains("--config"), "{e}");
        // A file that is not a regular file (the config crate would say "not found"): /dev/null
        // is an empty configuration, a named pipe is read once and used.
        load(Some(Path::new("/dev/null"))).unwrap();
        let fifo = dir.join("config.fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::write(fifo, "[amqp]\npartitions = 12\n").unwrap())
        };
        assert_eq!(load(Some(&fifo)).unwrap().amqp.partitions.get(), 12);
        writer.join().unwrap();
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::write(fifo, "[amqp]\npartitions = \"12\"\n").unwrap())
        };
        let e = load(Some(&fifo)).unwrap_err().to_string();
        assert!(e.contains("amqp.partitions") && e.contains("without quotes"), "{e}");
        writer.join().unwrap();
        // A file that exists but cannot be read is named with the system's reason.
        let e = load(Some(Path::new("/proc/self/mem"))).unwrap_err().to_string();
        assert!(e.starts_with("cannot read configuration file /proc/self/mem: "), "{e}");
        // Not TOML, or a number TOML cannot hold: the line is named, credentials are not shown.
        std::fs::write(&path, "[amqp]\nurl = \"amqp://u:hunter2@h:5672/v\" x\nmax_message_bytes = 1\n").unwrap();
        let e = load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("line 2") && !e.contains("hunter2"), "{e}");
        std::fs::write(&path, "[amqp]\nmax_message_bytes = 99999999999999999999\n").unwrap();
        let e = load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("max_message_bytes"), "{e}");
        // Durations beyond what the daemon can use (a lease TTL past Redis' 64-bit milliseconds).
        // A UTF-16 file (with its byte order mark, as some editors save) is named as not UTF-8.
        std::fs::write(&path, b"\xff\xfe[\x00a\x00]\x00").unwrap();
        let e = load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("c.toml") && e.contains("not UTF-8"), "{e}");
        std::fs::write(&path, "[ownership]\nlease_ttl = \"1000000000000d\"\n").unwrap();
        let e = load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("ownership.lease_ttl") && e.contains("at most 365 days"), "{e}");
        std::fs::write(&path, "[llm]\nrequest_timeout = \"366days\"\n").unwrap();
        let e = load(Some(&path)).unwrap_err().to_string();
        assert!(e.contains("llm.request_timeout") && e.contains("at most 365 days"), "{e}");
    }

    /// Values the `config` crate used to convert silently (`partitions = 8.5` ran with 9
    /// partitions, `max_batch_size = true` with 1) stop startup naming the key and the value.
    #[test]
    fn integer_and_boolean_keys_refuse_values_of_another_kind() {
        let dir = std::env::temp_dir().join(format!("pb-cfg-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        let refused = [
            ("[amqp]\npartitions = 8.5\n", "`amqp.partitions` = 8.5: must be a whole number"),
            ("[batching]\nmax_batch_size = true\n", "`batching.max_batch_size` = true: must be a whole number"),
            ("[keying]\nprefix_chars = 1e3\n", "`keying.prefix_chars` = 1000.0: must be a whole number"),
            ("[keying]\nprefix_chars = 9223372036854775807\n", "`keying.prefix_chars` = 9223372036854775807: must be at most amqp.max_message_bytes (4194304)"),
            ("[llm]\nlist_prompts = 1\n", "`llm.list_prompts` = 1: must be true or false"),
            ("[sharding.keys]\nabc = 2.5\n", "`sharding.keys.\"abc\"` = 2.5: must be a whole number"),
            ("[[sharding.rules]]\nshards = 2\n", "`sharding.rules[0].pattern` = (missing): every [[sharding.rules]] entry needs `pattern` and `shards`"),
            ("[[sharding.rules]]\npattern = 5\nshards = 2\n", "`sharding.rules[0].pattern` = 5: must be a regular expression in quotes"),
            ("[[sharding.rules]]\npattern = \"a\"\nshards = 2\n[[sharding.rules]]\npattern = \"b\"\n", "`sharding.rules[1].shards` = (missing)"),
            ("[[sharding.rules]]\npattern = \"x\"\nshards = 1.5\n", "`sharding.rules[0].shards` = 1.5: must be a whole number"),
            ("[amqp]\npartitions = \"12\"\n", "`amqp.partitions` = \"12\": must be a whole number without quotes (amqp.partitions = 12)"),
            ("[llm]\nlist_prompts = \"false\"\n", "`llm.list_prompts` = \"false\": must be true or false without quotes"),
            ("[batching]\nmax_batch_size = -1\n", "`batching.max_batch_size` = -1: must not be negative"),
            ("[sharding.keys]\n\"tenant-42\" = -2\n", "`sharding.keys.\"tenant-42\"` = -2: must not be negative"),
        ];
        for (toml, want) in refused {
            std::fs::write(&path, toml).unwrap();
            let e = load(Some(&path)).unwrap_err().to_string();
            assert!(e.contains(want), "{toml:?}: {e}");
        }
        std::fs::write(&path, "[amqp]\npartitions = 12\n[llm]\nlist_prompts = false\n[sharding.keys]\nabc = 2\n").unwrap();
        let s = load(Some(&path)).unwrap();
        assert_eq!(s.amqp.partitions.get(), 12);
        assert!(!s.llm.list_prompts);
        std::fs::remove_dir_all(&dir).unwrap();
        // Environment variables are strings: an exact integer or true/false is accepted there.
        let env = serde_json::json!({ "amqp": { "partitions": "12" }, "llm": { "list_prompts": "false" } });
        check_value_types(&env, true).unwrap();
        let e = check_value_types(&serde_json::json!({ "amqp": { "delivery_limit": null } }), true).unwrap_err().to_string();
        assert!(e.contains("`amqp.delivery_limit` = inf or NaN: must be a whole number"), "{e}");
        let e = check_value_types(&serde_json::json!({ "amqp": { "input_prefetch": "-1" } }), true).unwrap_err().to_string();
        assert!(e.contains("`amqp.input_prefetch` = \"-1\": must not be negative"), "{e}");
        // Digits beyond 64 bits in an environment variable arrive as a float.
        let e = check_value_types(&serde_json::json!({ "amqp": { "partitions": 1e20 } }), true).unwrap_err().to_string();
        assert!(e.contains("`amqp.partitions` = 100000000000000000000: is too large"), "{e}");
        // The largest integer itself is an integer, not a float beyond 64 bits (its own limit
        // refuses it later, with its value as written).
        check_value_types(&serde_json::json!({ "keying": { "prefix_chars": i64::MAX } }), false).unwrap();
    }
}
