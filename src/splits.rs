//! The shared split set: the adaptive-granularity decisions of [`crate::affinity`], kept in
//! Redis so that every instance routes alike, and each instance's local view of it.
//!
//! # Data layout
//!
//! Keys (with `P` = `redis.key_prefix`):
//! - `P:splits` — a sorted set of [`SplitMember`]s (`"{level}:{key hex}"` split,
//!   `"{level}:{key hex}:{shards}"` spread), each scored with its expiry: Redis time in ms plus
//!   [`SPLIT_TTL`]. Every live instance pushes the expiry of every entry it does not merge back
//!   at each refresh, so an entry lives while any instance runs, and the whole set (the key has
//!   the same TTL) disappears [`SPLIT_TTL`] after the last instance stops.
//! - `P:split-drain` — a hash member → the drain rate (requests/s) of the partition when the key
//!   was split; the merge rule compares arrivals against half of it.
//! - `P:split-arrivals:{unix second}` — a hash member → requests routed through that split entry
//!   (counted by the routers, added by each instance at its refresh under the second, by the
//!   clock of Redis, in which they were counted), expiring after 60 s. The arrival rate of an
//!   entry is the sum over the last [`RATE_WINDOWS`] complete seconds, all instances together.
//! - `P:split-arrivals-seq:{source}` — the highest [`ArrivalBatch::seq`] of one process (its
//!   random `source`) that Redis has added, expiring after 60 s. A refresh whose call timed out
//!   may still have run (a Redis that stalled runs the calls queued on its socket when it
//!   resumes), so its arrival batches are sent again; Redis adds each batch once.
//! - `P:split-generation` — the Redis time (`seconds.microseconds`) at which the current split
//!   set was started, with the same TTL as the set. A refresh whose instance knew another
//!   generation (or saw it vanish) has found the set lost as a whole: Redis restarted empty, was
//!   flushed, or no instance reached it for [`SPLIT_TTL`]. That refresh puts back the entries the
//!   instance still holds in its view (`ZADD NX`, with their drain rates) instead of letting the
//!   loss merge every key at once; merges then follow the usual rule and hold time.
//!
//! # Protocol
//!
//! One Lua script per refresh and instance ([`SYNC`], one round trip, atomic), every
//! [`REFRESH_INTERVAL`]: add the keys this instance found hot (`ZADD NX`: the first instance's
//! decision and drain rate win), push the expiry of the entries it keeps (`ZADD XX GT`), remove
//! the entries it merges back, add its arrival counts, drop expired entries, and read the live set
//! with drain rates and arrival sums (one `ZRANGEBYSCORE`). The answer replaces the local view.
//!
//! Routing reads only the local view ([`Affinity::view`]): it never waits on Redis. When Redis is
//! unreachable the last view stays in force (nothing is dropped because Redis cannot be asked;
//! entries expire only in Redis, by the clock of Redis) and the arrival batches are kept for the
//! next successful refresh, which files each under the second it was counted in, so an outage's
//! arrivals do not reach Redis as one burst (that burst would raise the peak rate of the merge
//! rule, and a key whose traffic never changed would be merged back once the burst left the rate
//! window). Batches older than the rate window are dropped: no rate would count them.
//!
//! # Wiring
//!
//! The router and the partition consumers of a process reach the handle of their deployment
//! with [`Affinity::for_prefix`] (one per `redis.key_prefix`, process wide), so neither needs a
//! new parameter; [`run`] refreshes it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::affinity::{Choice, HotKey, KeyHygiene, LoadTracker, TrafficShares, RoutedKey, SplitLedger, SplitMember, SplitRules, SplitState, SplitView, Verdict};
use lapin::types::FieldTable;

use crate::config::{KeyingMode, Settings};
use crate::lease::RedisConn;
use crate::keying::{derive_key, level_count, static_shards, PrefixKey};
use crate::publisher::{header_str, HEADER_ROUTED_KEY};
use crate::request::Request;
use crate::metrics::{self, keys as kind};

/// How often the local view is refreshed (and decisions are published): a quarter of the 1 s
/// measurement window, so a decision reaches every instance within 250 ms.
pub const REFRESH_INTERVAL: Duration = Duration::from_millis(250);
/// Lifetime of a split entry that no instance refreshes.
pub const SPLIT_TTL: Duration = Duration::from_secs(10);
/// Complete seconds the arrival rate is averaged over.
pub const RATE_WINDOWS: u32 = 5;
/// Least time between two log warnings of the same kind (hygiene, refresh failures).
const WARN_EVERY: Duration = Duration::from_secs(60);
/// How long an arrival batch that could not be delivered is kept: past the rate window (plus the
/// second being counted) no arrival rate would count it.
const ARRIVALS_KEPT: Duration = Duration::from_secs(RATE_WINDOWS as u64 + 1);
/// Longest round trip of a refresh whose answer sets the estimate of the clock of Redis
/// ([`RefreshState::redis_clock`]); a slower answer says less about when Redis read its clock.
const CLOCK_RTT: Duration = Duration::from_millis(200);

/// Refresh script. KEYS = [splits, drain, generation]; ARGV = [arrivals key prefix, ttl ms,
/// rate windows, read only (0|1), the generation the instance knows ('' if none), the source
/// of the arrival batches, then four lists, each its length followed by its items: adds
/// (member, drain), keeps (member, drain), merges (member), arrival batches (seq, Redis time in
/// ms when counted or 0 for now, then a list of (member, count))].
/// Returns `{members, expires in ms, drains, arrival sums, added members, removed members,
/// generation, restored count, Redis time in ms}`.
pub const SYNC: &str = r#"
local t = redis.call('TIME')
local sec = tonumber(t[1])
local now = sec * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local expiry = string.format('%d', now + ttl)
local gen = redis.call('GET', KEYS[3])
local restore = false
if ARGV[4] == '0' then
  if not gen then
    gen = t[1] .. '.' .. t[2]
    redis.call('SET', KEYS[3], gen)
  end
  restore = ARGV[5] ~= '' and ARGV[5] ~= gen
  redis.call('PEXPIRE', KEYS[3], ttl)
end
local i = 7
local added = {}
local restored = 0
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  if redis.call('ZADD', KEYS[1], 'NX', expiry, ARGV[i]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    added[#added + 1] = ARGV[i]
  end
  i = i + 2
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  if not restore then
    redis.call('ZADD', KEYS[1], 'XX', 'GT', expiry, ARGV[i])
  elseif redis.call('ZADD', KEYS[1], 'NX', expiry, ARGV[i]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    restored = restored + 1
  end
  i = i + 2
end
local removed = {}
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then removed[#removed + 1] = ARGV[i] end
  redis.call('HDEL', KEYS[2], ARGV[i])
  i = i + 1
end
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then
  local skey = ARGV[1] .. '-seq:' .. ARGV[6]
  local done = tonumber(redis.call('GET', skey) or '0')
  local top = done
  for _ = 1, n do
    local seq, at, c = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    i = i + 3
    if at <= 0 or at > now then at = now end
    local apply = seq > done and at > now - 60000
    local akey = ARGV[1] .. ':' .. string.format('%d', math.floor(at / 1000))
    for _ = 1, c do
      if apply then redis.call('HINCRBY', akey, ARGV[i], ARGV[i + 1]) end
      i = i + 2
    end
    if apply and c > 0 then redis.call('EXPIRE', akey, 60) end
    if seq > top then top = seq end
  end
  if top > done then redis.call('SET', skey, string.format('%d', top), 'EX', 60) end
end
if ARGV[4] == '0' then
  local nows = string.format('%d', now)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', nows)) do
    redis.call('HDEL', KEYS[2], m)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', nows)
  if redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('PEXPIRE', KEYS[1], ttl)
    redis.call('PEXPIRE', KEYS[2], ttl)
  end
end
local live = redis.call('ZRANGEBYSCORE', KEYS[1], string.format('(%d', now), '+inf', 'WITHSCORES')
local members, expires, drains, arrivals = {}, {}, {}, {}
for j = 1, #live, 2 do
  local m = live[j]
  members[#members + 1] = m
  expires[#expires + 1] = tonumber(live[j + 1]) - now
  drains[#drains + 1] = redis.call('HGET', KEYS[2], m) or ''
  local sum = 0
  for w = 1, tonumber(ARGV[3]) do
    sum = sum + tonumber(redis.call('HGET', ARGV[1] .. ':' .. string.format('%d', sec - w), m) or '0')
  end
  arrivals[#arrivals + 1] = sum
end
return {members, expires, drains, arrivals, added, removed, gen or '', restored, now}
"#;

/// Errors of the split store.
#[derive(Debug, thiserror::Error)]
pub enum SplitsError {
    /// Redis unreachable or answered with an error.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// No answer within `redis.command_timeout`.
    #[error("redis command timed out after {0:?}")]
    Timeout(Duration),
}

/// Redis key of the split set.
pub fn splits_key(prefix: &str) -> String {
    format!("{prefix}:splits")
}

/// Redis key of the split set's generation (see the module doc).
pub fn generation_key(prefix: &str) -> String {
    format!("{prefix}:split-generation")
}

/// Redis key of the drain rates.
pub fn drain_key(prefix: &str) -> String {
    format!("{prefix}:split-drain")
}

/// Prefix of the per-second arrival hashes (`{this}:{unix second}`).
pub fn arrivals_key_prefix(prefix: &str) -> String {
    format!("{prefix}:split-arrivals")
}

/// One live entry of the split set, as Redis reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitRecord {
    pub member: SplitMember,
    /// Time until it expires unless refreshed, in milliseconds.
    pub expires_in_ms: u64,
    /// Requests/s its partition drained when it was split; `None` if unknown.
    pub drain_rps: Option<f64>,
    /// Requests/s routed through it, all instances, over the last [`RATE_WINDOWS`] seconds.
    pub arrivals_rps: f64,
}

/// What one refresh publishes.
#[derive(Debug, Clone, Default)]
pub struct SyncRequest {
    /// New entries with their drain rate.
    pub adds: Vec<(SplitMember, f64)>,
    /// Entries whose expiry is pushed, with their drain rate (put back with it if the set was
    /// lost).
    pub keeps: Vec<(SplitMember, f64)>,
    /// Entries merged back.
    pub merges: Vec<SplitMember>,
    /// This process's arrival batches that no refresh has delivered yet, oldest first.
    pub arrivals: Vec<ArrivalBatch>,
    /// Who counted `arrivals`: random, one per process and deployment, so that Redis adds each
    /// batch once however often it is sent.
    pub source: String,
    /// The generation of the split set this instance last read (`None`: none yet). When the
    /// set's generation is another, the set was lost and `keeps` are put back.
    pub generation: Option<String>,
}

/// The arrivals of split entries that the routers counted between two refreshes.
#[derive(Debug, Clone, PartialEq)]
pub struct ArrivalBatch {
    /// Sequence number among the batches of its source, from 1.
    pub seq: u64,
    /// When they were counted (the refresh that took them), by the clock of Redis, in ms since
    /// the Unix epoch; 0 when unknown (no refresh has read that clock yet): filed as counted
    /// when Redis adds them.
    pub counted_at_ms: u64,
    /// Requests routed through each entry.
    pub counts: Vec<(SplitMember, u64)>,
}

/// The answer of one refresh.
#[derive(Debug, Clone, Default)]
pub struct SyncAnswer {
    /// The live split set.
    pub records: Vec<SplitRecord>,
    /// Entries this call added (others may have added the same ones first).
    pub added: Vec<SplitMember>,
    /// Entries this call removed (others may have removed the same ones first).
    pub removed: Vec<SplitMember>,
    /// The split set's generation (empty from a read-only call on a set that has none).
    pub generation: String,
    /// Entries of `keeps` this call put back because the set had been lost.
    pub restored: u64,
    /// The clock of Redis when it ran the call, in ms since the Unix epoch.
    pub redis_time_ms: u64,
}

/// Where a refresh publishes and reads the split set: [`SplitStore`] (Redis); tests use their own.
pub trait SplitSync {
    /// One refresh (see the module doc).
    fn sync(&self, req: &SyncRequest) -> impl std::future::Future<Output = Result<SyncAnswer, SplitsError>> + Send;
}

impl SplitSync for SplitStore {
    fn sync(&self, req: &SyncRequest) -> impl std::future::Future<Output = Result<SyncAnswer, SplitsError>> + Send {
        self.call(req, false)
    }
}

/// The split set in Redis.
#[derive(Clone)]
pub struct SplitStore {
    conn: RedisConn,
    prefix: String,
    timeout: Duration,
    script: Arc<Script>,
}

impl SplitStore {
    /// `timeout` bounds every call (`redis.command_timeout`).
    pub fn new(conn: impl Into<RedisConn>, prefix: &str, timeout: Duration) -> Self {
        SplitStore { conn: conn.into(), prefix: prefix.to_owned(), timeout, script: Arc::new(Script::new(SYNC)) }
    }

    /// Reads the live split set without changing anything (for `status`).
    pub async fn read(&self) -> Result<Vec<SplitRecord>, SplitsError> {
        Ok(self.call(&SyncRequest::default(), true).await?.records)
    }

    async fn call(&self, req: &SyncRequest, read_only: bool) -> Result<SyncAnswer, SplitsError> {
        let mut call = self.script.prepare_invoke();
        call.key(splits_key(&self.prefix)).key(drain_key(&self.prefix)).key(generation_key(&self.prefix));
        call.arg(arrivals_key_prefix(&self.prefix)).arg(SPLIT_TTL.as_millis() as u64).arg(RATE_WINDOWS).arg(u8::from(read_only));
        call.arg(req.generation.as_deref().unwrap_or("")).arg(&req.source);
        for list in [&req.adds, &req.keeps] {
            call.arg(list.len());
            for (m, drain) in list {
                call.arg(m.to_string()).arg(format!("{drain:.3}"));
            }
        }
        call.arg(req.merges.len());
        for m in &req.merges {
            call.arg(m.to_string());
        }
        call.arg(req.arrivals.len());
        for batch in &req.arrivals {
            call.arg(batch.seq).arg(batch.counted_at_ms).arg(batch.counts.len());
            for (m, n) in &batch.counts {
                call.arg(m.to_string()).arg(*n);
            }
        }
        let mut conn = self.conn.clone();
        type Raw = (Vec<String>, Vec<i64>, Vec<String>, Vec<u64>, Vec<String>, Vec<String>, String, u64, u64);
        let (members, expires, drains, arrivals, added, removed, generation, restored, redis_time_ms): Raw =
            match tokio::time::timeout(self.timeout, call.invoke_async(&mut conn)).await {
                Ok(r) => r?,
                Err(_) => return Err(SplitsError::Timeout(self.timeout)),
            };
        let records = members
            .iter()
            .zip(expires)
            .zip(drains)
            .zip(arrivals)
            .filter_map(|(((m, e), d), a)| {
                Some(SplitRecord {
                    member: m.parse().ok()?,
                    expires_in_ms: e.max(0) as u64,
                    drain_rps: d.parse().ok(),
                    arrivals_rps: a as f64 / f64::from(RATE_WINDOWS),
                })
            })
            .collect();
        let members = |v: Vec<String>| v.iter().filter_map(|m| m.parse().ok()).collect();
        Ok(SyncAnswer { records, added: members(added), removed: members(removed), generation, restored, redis_time_ms })
    }
}

/// The router's side of a handle: arrivals of split entries and key hygiene.
#[derive(Default)]
struct RouterSide {
    arrivals: HashMap<SplitMember, u64>,
    shares: TrafficShares,
    hygiene: KeyHygiene,
    warned: HashMap<&'static str, Instant>,
}

impl RouterSide {
    /// Publishes a closed hygiene window: the gauges, and a warning (at most once a minute per
    /// kind) with a count for each problem it shows.
    fn report_hygiene(&mut self, report: &crate::affinity::HygieneReport, now: Instant) {
        let dominant = report.dominant_unsplittable();
        metrics::hot_keys(&report.top_shares, report.unsplittable.map_or(0.0, |(_, s)| s));
        if report.volatile() {
            metrics::key_hygiene(kind::VOLATILE);
            if self.may_warn(kind::VOLATILE, now) {
                warn!(distinct = report.distinct, "key material looks volatile: nearly every request has its own level-0 prefix key, so requests are not batched together by key: their first keying.prefix_chars characters differ (an id or a timestamp near the start, or a shared prefix shorter than keying.prefix_chars, which servers cache anyway); lower keying.prefix_chars to the shared part, or send prefix_key");
            }
        }
        if report.short_material() {
            metrics::key_hygiene(kind::SHORT);
            if self.may_warn(kind::SHORT, now) {
                warn!(share = report.short, chars = crate::affinity::SHORT_MATERIAL_CHARS, "most key material is shorter than one server cache block (16 tokens): keys group requests that share less than the server can reuse");
            }
        }
        if let Some((key, share)) = dominant {
            metrics::key_hygiene(kind::UNSPLITTABLE);
            if self.may_warn(kind::UNSPLITTABLE, now) {
                warn!(key = %key, share, "one key carries most of the traffic and cannot be split further");
            }
        }
    }

    /// Whether a warning of `kind` may be logged now (at most once per [`WARN_EVERY`]).
    fn may_warn(&mut self, kind: &'static str, now: Instant) -> bool {
        match self.warned.get(kind) {
            Some(t) if now.saturating_duration_since(*t) < WARN_EVERY => false,
            _ => {
                self.warned.insert(kind, now);
                true
            }
        }
    }
}

/// Why a refresh adds a split entry (logged once the store has taken it).
#[derive(Clone)]
enum SplitReason {
    /// Its partition queues ([`crate::affinity::LoadTracker`]).
    Hot(HotKey),
    /// It carries most of the routers' traffic ([`TrafficShares`]).
    Dominant { share: f64, requests: u64 },
}

/// An arrival batch waiting for delivery, and when it was taken (for its age).
struct PendingBatch {
    taken_at: Instant,
    batch: ArrivalBatch,
}

/// The refresh's memory: the decision ledger, the records and generation last read, and the
/// arrival batches not delivered yet.
struct RefreshState {
    ledger: SplitLedger,
    records: Vec<SplitRecord>,
    generation: Option<String>,
    /// See [`SyncRequest::source`].
    source: String,
    /// The last batch sequence number given.
    seq: u64,
    /// Taken from the routers, not yet delivered, oldest first; none older than [`ARRIVALS_KEPT`].
    pending: Vec<PendingBatch>,
    /// The clock of Redis at a local instant, from the last answer that came within
    /// [`CLOCK_RTT`] (taken as read halfway through the round trip): dates the batches.
    redis_clock: Option<(Instant, u64)>,
    /// The view and records are older than the set in Redis may be: this process did not run
    /// for [`SPLIT_TTL`] between two refreshes ([`Affinity::mark_stale`]), while other
    /// instances may have merged and split keys. Until a refresh succeeds, it neither puts back
    /// a lost set from its view nor keeps or merges entries by its records.
    stale: bool,
    /// The adds (with why) and merges of refreshes that got no answer since the last one that
    /// did (at most [`MAX_UNANSWERED`]): a Redis that stalled runs the calls queued on its socket
    /// when it resumes, so they may have taken effect; the next answer tells ([`log_late`]).
    unanswered: Vec<(SplitMember, Option<SplitReason>)>,
    /// The merge rule ([`SplitLedger::review`]) has seen `records` since the answer that brought
    /// them. The refreshes after it, until an answer brings new records (refreshes that fail, as
    /// every one does while Redis is unreachable), keep every entry without reviewing it again.
    /// Reported: the rates of the last answer before an outage were reviewed again at every
    /// failed refresh, as if measured again, so a key whose last rate was low counted as cool for
    /// the whole outage, and the first refresh that reached Redis merged it back, minutes after
    /// that rate was measured, while the other instances' current rates kept it.
    reviewed: bool,
}

/// Bound of [`RefreshState::unanswered`].
const MAX_UNANSWERED: usize = 64;

impl Default for RefreshState {
    fn default() -> Self {
        RefreshState {
            ledger: SplitLedger::default(),
            records: Vec::new(),
            generation: None,
            source: uuid::Uuid::new_v4().simple().to_string(),
            seq: 0,
            pending: Vec::new(),
            redis_clock: None,
            stale: false,
            unanswered: Vec::new(),
            reviewed: false,
        }
    }
}

impl RefreshState {
    /// The time of Redis at `at`, in ms since the Unix epoch, as far as known (0: not known).
    fn redis_ms(&self, at: Instant) -> u64 {
        let Some((then, ms)) = self.redis_clock else { return 0 };
        if at >= then {
            ms + at.duration_since(then).as_millis() as u64
        } else {
            ms.saturating_sub(then.duration_since(at).as_millis() as u64)
        }
    }
}

struct Inner {
    view: RwLock<Arc<SplitView>>,
    router: Mutex<RouterSide>,
    load: Mutex<LoadTracker>,
    /// What the refresh keeps between calls (used by the refresh only).
    refresh: Mutex<RefreshState>,
    /// Woken when the routers' traffic shares want a refresh before the next interval
    /// ([`TrafficShares::observe`]).
    early: tokio::sync::Notify,
    /// LLM servers the deployment routes to, as far as this instance knows (0: not known yet).
    servers: AtomicUsize,
}

/// The split state of one deployment in this process: the local view routing reads, the
/// routers' arrival counts and key hygiene, and the partition owners' load. Cheap to clone (one
/// `Arc`). See the module doc for how it is shared.
#[derive(Clone)]
pub struct Affinity {
    inner: Arc<Inner>,
}

impl Default for Affinity {
    fn default() -> Self {
        Affinity {
            inner: Arc::new(Inner {
                view: RwLock::new(Arc::new(SplitView::default())),
                router: Mutex::new(RouterSide::default()),
                load: Mutex::new(LoadTracker::default()),
                refresh: Mutex::new(RefreshState::default()),
                early: tokio::sync::Notify::new(),
                servers: AtomicUsize::new(0),
            }),
        }
    }
}

static HANDLES: LazyLock<Mutex<HashMap<String, Affinity>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Affinity {
    /// The handle of the deployment whose Redis keys start with `prefix` (created on first use).
    pub fn for_prefix(prefix: &str) -> Affinity {
        let mut handles = lock(&HANDLES);
        match handles.get(prefix) {
            Some(a) => a.clone(),
            None => handles.entry(prefix.to_owned()).or_default().clone(),
        }
    }

    /// Records how many LLM servers the deployment routes to: the live members times this
    /// instance's `llm.endpoints` (the ownership loop calls it after each heartbeat). With one
    /// server a dominant key is not split ([`TrafficShares`]): every partition ends on that
    /// server, so a split would spread no load and no cache, and would only break the key's
    /// batches into one request each. A key that queues is still split (its partition's
    /// pipeline is the bottleneck, not the server's cache).
    pub fn set_servers(&self, servers: usize) {
        self.inner.servers.store(servers, Ordering::Relaxed);
    }

    /// The current local view (never waits on Redis).
    pub fn view(&self) -> Arc<SplitView> {
        self.inner.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the local view; returns the number of decision changes.
    pub fn set_view(&self, view: SplitView) -> usize {
        let mut cur = self.inner.view.write().unwrap_or_else(|e| e.into_inner());
        let moves = cur.moves_to(&view);
        *cur = Arc::new(view);
        moves
    }

    /// Records a routed request: counts its arrival at every split entry it passed, and feeds
    /// key hygiene (its level-0 key and material length, and whether its routed key can be
    /// split no further). Logs a hygiene warning at most once a minute per kind.
    pub fn routed(&self, choice: &Choice, level0: PrefixKey, material_chars: usize, unsplittable: bool) {
        let mut r = lock(&self.inner.router);
        for m in &choice.through {
            *r.arrivals.entry(*m).or_default() += 1;
        }
        if r.shares.observe(choice) {
            self.inner.early.notify_one();
        }
        let now = Instant::now();
        if let Some(report) = r.hygiene.observe(now, level0, material_chars, choice.routed, unsplittable) {
            r.report_hygiene(&report, now);
        }
    }

    /// Completes when a refresh is wanted before the next [`REFRESH_INTERVAL`]: the routers
    /// have routed the [`SplitRules::dominant_min_requests`] requests the last refresh lacked for
    /// a decision (at start: the first 5), or as many requests again as the last refresh saw
    /// while a key was dominant as observed but not beyond chance
    /// ([`crate::affinity::TrafficShares::observe`]). A wake-up given while nobody waits is kept
    /// for the next call.
    pub async fn early_refresh(&self) {
        self.inner.early.notified().await
    }

    /// Records a request dequeued by the owner of `partition`, routed by `routed`, after waiting
    /// `queued` in the queues.
    pub fn dequeued(&self, partition: u32, routed: RoutedKey, queued: Duration) {
        lock(&self.inner.load).observe(partition, routed, queued);
    }

    /// Ticks the router's side at a refresh: closes an idle hygiene window, takes the arrival
    /// counts of split keys, and rolls the traffic shares, giving the dominant key if any (none
    /// with one LLM server known: see `set_servers`).
    fn tick_router(&self, now: Instant, rules: &SplitRules, view: &SplitView) -> (Vec<(SplitMember, u64)>, Option<crate::affinity::DominantKey>) {
        let mut r = lock(&self.inner.router);
        // A hygiene window that light traffic did not fill closes here (see `KeyHygiene::tick`).
        if let Some(report) = r.hygiene.tick(now) {
            r.report_hygiene(&report, now);
        }
        let counts: Vec<(SplitMember, u64)> = r.arrivals.drain().collect();
        // The shares tick in any case (their windows keep rolling); with one server known,
        // a dominant key stays whole (see `set_servers`).
        let dominant = r.shares.tick(now, rules, view).filter(|_| self.inner.servers.load(Ordering::Relaxed) != 1);
        (counts, dominant)
    }

    /// Marks the view as older than the set in Redis may be: this process did not run for
    /// [`SPLIT_TTL`] (stopped with SIGSTOP, a paused VM; [`run`] measures the gap between its
    /// refreshes on the clock). Reported: an instance stopped while a key merged, and Redis
    /// then lost its data; when it resumed, it put the merged key back from its old view. Until
    /// a refresh succeeds, none keeps, merges or puts back entries by this view.
    pub fn mark_stale(&self) {
        lock(&self.inner.refresh).stale = true;
    }

    /// One refresh at `now`: decides splits and merges, publishes them with the arrival batches
    /// not delivered yet, and replaces the view with the answer. On an error the view stays as
    /// it was and the arrival batches are kept for the next refresh (for `ARRIVALS_KEPT`).
    pub async fn refresh(&self, store: &impl SplitSync, rules: &SplitRules, now: Instant) -> Result<SyncAnswer, SplitsError> {
        let view = self.view();
        let hot = lock(&self.inner.load).tick(now, rules, &view);
        let (counts, dominant) = self.tick_router(now, rules, &view);
        let mut req = SyncRequest::default();
        // Why each add was decided, logged once the store has taken it (a refresh that fails,
        // as every one does while Redis is unreachable, decides the same again next time).
        let mut reasons: Vec<(SplitMember, SplitReason)> = Vec::new();
        {
            let st = &mut *lock(&self.inner.refresh);
            if !st.stale {
                req.generation.clone_from(&st.generation);
            }
            st.pending.retain(|p| now.saturating_duration_since(p.taken_at) < ARRIVALS_KEPT);
            if !counts.is_empty() {
                st.seq += 1;
                let batch = ArrivalBatch { seq: st.seq, counted_at_ms: st.redis_ms(now), counts };
                st.pending.push(PendingBatch { taken_at: now, batch });
            }
            req.arrivals = st.pending.iter().map(|p| p.batch.clone()).collect();
            req.source.clone_from(&st.source);
            for h in &hot {
                let (l, k) = (h.member.level, h.member.key);
                if view.get(l, k) != Some(h.member.state) && !st.ledger.holding(now, rules.hold, l, k) {
                    reasons.push((h.member, SplitReason::Hot(h.clone())));
                    req.adds.push((h.member, h.drain_rps));
                }
            }
            // A dominant key has no drain rate: 0 makes the merge rule use its sustained peak arrival rate.
            if let Some(d) = dominant.filter(|d| !st.ledger.holding(now, rules.hold, d.members[0].level, d.members[0].key)) {
                for m in d.members {
                    let new = !req.adds.iter().any(|(a, _)| (a.level, a.key) == (m.level, m.key)) && view.get(m.level, m.key).is_none();
                    if new && !st.ledger.holding(now, rules.hold, m.level, m.key) {
                        reasons.push((m, SplitReason::Dominant { share: d.share, requests: d.requests }));
                        req.adds.push((m, 0.0));
                    }
                }
            }
            let review = !st.reviewed;
            for r in st.records.iter().filter(|_| !st.stale) {
                let drain = r.drain_rps.unwrap_or(0.0);
                if review && st.ledger.review(now, rules, &r.member, drain, r.arrivals_rps) == Verdict::Merge {
                    req.merges.push(r.member);
                } else {
                    req.keeps.push((r.member, drain));
                }
            }
            st.reviewed = true;
        }
        let sent = Instant::now();
        let answer = match store.sync(&req).await {
            Ok(a) => a,
            Err(e) => {
                metrics::split_sync_failed();
                let st = &mut *lock(&self.inner.refresh);
                let sent = reasons.into_iter().map(|(m, why)| (m, Some(why))).chain(req.merges.iter().map(|m| (*m, None)));
                for (m, why) in sent {
                    if st.unanswered.len() < MAX_UNANSWERED && !st.unanswered.iter().any(|(u, _)| *u == m) {
                        st.unanswered.push((m, why));
                    }
                }
                return Err(e);
            }
        };
        {
            let st = &mut *lock(&self.inner.refresh);
            let delivered = req.arrivals.last().map_or(0, |b| b.seq);
            st.pending.retain(|p| p.batch.seq > delivered);
            let rtt = sent.elapsed();
            if rtt <= CLOCK_RTT && answer.redis_time_ms > 0 {
                st.redis_clock = Some((sent + rtt / 2, answer.redis_time_ms));
            }
        }
        log_answer(&answer, &reasons);
        let next = SplitView::new(answer.records.iter().map(|r| r.member));
        log_late(&std::mem::take(&mut lock(&self.inner.refresh).unanswered), &view, &next, &answer);
        let per_level = next.per_level();
        let first = {
            let st = &mut *lock(&self.inner.refresh);
            st.ledger.update(now, &next);
            st.records.clone_from(&answer.records);
            st.reviewed = false;
            st.stale = false;
            st.generation.replace(answer.generation.clone()).is_none()
        };
        // The first view this process reads moves no traffic: its routers had none to go by.
        let moves = self.set_view(next) * usize::from(!first);
        metrics::split_view(&per_level, moves);
        Ok(answer)
    }
}

/// The `kind` label of [`metrics::split_decision`] for an added member in state `state`.
fn added_kind(state: SplitState) -> &'static str {
    match state {
        SplitState::Split => kind::SPLIT,
        SplitState::Spread(_) => kind::SPREAD,
    }
}

/// Logs and counts what a refresh's answer says changed: the adds it made (with the reason this
/// instance decided each), a split set put back after a loss, and the merges it made.
fn log_answer(answer: &SyncAnswer, reasons: &[(SplitMember, SplitReason)]) {
    for m in &answer.added {
        metrics::split_decision(added_kind(m.state));
        match reasons.iter().find(|(r, _)| r == m).map(|(_, why)| why) {
            Some(SplitReason::Hot(h)) => info!(partition = h.partition, key = %m, share = h.share, median_delay_ms = h.median_delay.as_millis() as u64, drain_rps = h.drain_rps, "hot key: splitting"),
            Some(SplitReason::Dominant { share, requests }) => info!(key = %m, share, requests, "dominant key: splitting"),
            None => {}
        }
    }
    if answer.restored > 0 {
        metrics::split_restored(answer.restored);
        warn!(restored = answer.restored, "the split set in Redis was lost (Redis restarted empty or was flushed, or the set expired because no instance refreshed it for 10 s): put back the splits this instance holds");
    }
    // Logged and counted by the instance whose call removed it (every instance may decide
    // the same merge; the first one's call removes it).
    for m in &answer.removed {
        metrics::split_decision(kind::MERGE);
        info!(key = %m, "cool key: merging back");
    }
}

/// Logs and counts the adds and merges of refreshes that got no answer (`unanswered`, with why
/// each add was decided; a merge has none) that the set shows done since the `before` view
/// (`after`), unless this answer made them: their calls ran when a stalled Redis resumed.
/// Reported: a split stored that way was neither logged nor counted. Returns how many.
fn log_late(unanswered: &[(SplitMember, Option<SplitReason>)], before: &SplitView, after: &SplitView, answer: &SyncAnswer) -> usize {
    let mut late = 0;
    for (m, why) in unanswered {
        let (was, is) = (before.get(m.level, m.key), after.get(m.level, m.key));
        match why {
            Some(why) if is == Some(m.state) && was != Some(m.state) && !answer.added.contains(m) => {
                metrics::split_decision(added_kind(m.state));
                let why = match why {
                    SplitReason::Hot(_) => "hot key",
                    SplitReason::Dominant { .. } => "dominant key",
                };
                info!(key = %m, why, "split stored by a refresh whose answer did not come (Redis stalled, then ran it): splitting");
                late += 1;
            }
            None if was.is_some() && is.is_none() && !answer.removed.contains(m) => {
                metrics::split_decision(kind::MERGE);
                info!(key = %m, "merge stored by a refresh whose answer did not come (Redis stalled, then ran it): merging back");
                late += 1;
            }
            _ => {}
        }
    }
    late
}

/// The rule numbers of a deployment ([`SplitRules::new`]).
pub fn rules(settings: &Settings) -> SplitRules {
    SplitRules::new(settings.batching.max_batch_wait, settings.sharding.max_shards)
}

/// [`run`] until `stop` fires, started again [`RESTART_AFTER_PANIC`] after a panic
/// ([`crate::task::restart_after_panic`], counted in `task_panics_total{stage="split_refresh"}`).
/// Meanwhile routing keeps its last view, as it does while Redis is unreachable;
/// `split_view_age_seconds` shows the gap.
pub async fn run_restarting(settings: Arc<Settings>, conn: RedisConn, stop: CancellationToken) {
    let what = "the split-set refresher (routing keeps its last view)";
    let panicked = || metrics::task_panicked(metrics::stage::SPLIT_REFRESH);
    crate::task::restart_after_panic(what, RESTART_AFTER_PANIC, &stop, panicked, || run(settings.clone(), conn.clone(), stop.clone())).await;
}

/// How long [`run_restarting`] waits before it starts a panicked refresher again.
pub const RESTART_AFTER_PANIC: Duration = Duration::from_secs(1);

/// Refreshes the deployment's [`Affinity`] every [`REFRESH_INTERVAL`], and at once when
/// [`Affinity::early_refresh`] asks for it (the first requests of a deployment: a key that
/// carries all of them splits after 5 requests), until `stop` fires.
/// Redis errors are logged (at most once a minute) and counted; the view stays in force.
pub async fn run(settings: Arc<Settings>, conn: impl Into<RedisConn>, stop: CancellationToken) {
    let affinity = Affinity::for_prefix(&settings.redis.key_prefix);
    let store = SplitStore::new(conn, &settings.redis.key_prefix, settings.redis.command_timeout);
    let rules = rules(&settings);
    let mut tick = tokio::time::interval(REFRESH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_warning: Option<Instant> = None;
    let mut last_refresh: Option<Instant> = None;
    loop {
        let now = tokio::select! {
            _ = stop.cancelled() => return,
            now = tick.tick() => now,
            _ = affinity.early_refresh() => {
                tick.reset();
                Instant::now()
            }
        };
        // Refreshes come every REFRESH_INTERVAL, failed ones too (a Redis outage): a gap of
        // SPLIT_TTL on the clock means this process did not run. (Not `now`: after a stop, the
        // timer hands out the tick it missed.)
        let woke = Instant::now();
        if let Some(gap) = last_refresh.map(|t| woke.saturating_duration_since(t)).filter(|gap| *gap >= SPLIT_TTL) {
            warn!(gap_s = gap.as_secs_f64(), "the split view was not refreshed for longer than the split TTL (this process did not run): it is read again from Redis before this instance keeps, merges or puts back any entry");
            affinity.mark_stale();
        }
        last_refresh = Some(woke);
        if let Err(e) = affinity.refresh(&store, &rules, now).await {
            if last_warning.is_none_or(|t| now.saturating_duration_since(t) >= WARN_EVERY) {
                last_warning = Some(now);
                warn!(error = %e, "cannot refresh the split set; routing keeps the last view");
            }
        }
    }
}

/// The key a partition batches a request by: the routed key of header `x-routed-key`, else (a
/// request published straight to a partition queue, or forwarded by an older router) its
/// level-0 key. In adaptive mode the dequeue (routed key, `queued_ms` in the queues) is recorded
/// for the split rule.
pub fn batch_key(settings: &Settings, partition: u32, req: &Request, headers: Option<&FieldTable>, queued_ms: u64) -> PrefixKey {
    let routed = header_str(headers, HEADER_ROUTED_KEY).and_then(|h| h.parse::<RoutedKey>().ok()).unwrap_or_else(|| {
        RoutedKey { level: 0, levels: level_count(req, &settings.keying), key: derive_key(req, &settings.keying).key }
    });
    // A key with a static entry (routed with one level, like an explicit key) keeps its static
    // shards: its load is not the split rule's business.
    let fixed = || routed.levels == 1 && static_shards(&derive_key(req, &settings.keying), &settings.sharding).is_some();
    if settings.keying.mode == KeyingMode::Adaptive && !fixed() {
        Affinity::for_prefix(&settings.redis.key_prefix).dequeued(partition, routed, Duration::from_millis(queued_ms));
    }
    routed.key
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;

    static START: LazyLock<Instant> = LazyLock::new(Instant::now);

    /// A split set that answers from memory, or fails like an unreachable Redis.
    #[derive(Default)]
    struct Memory {
        set: Mutex<HashMap<SplitMember, f64>>,
        down: std::sync::atomic::AtomicBool,
        arrivals: Mutex<u64>,
        /// The arrival batches of every successful call.
        sent: Mutex<Vec<Vec<ArrivalBatch>>>,
        /// The set's generation; [`Memory::lose`] starts a new one.
        generation: Mutex<u64>,
        /// Every entry's arrival rate in the answers, requests/s (`None`: 100).
        rps: Mutex<Option<f64>>,
    }

    impl Memory {
        /// Loses the whole set, as a Redis restarted empty or flushed.
        fn lose(&self) {
            lock(&self.set).clear();
            *lock(&self.generation) += 1;
        }
    }

    impl SplitSync for Memory {
        async fn sync(&self, req: &SyncRequest) -> Result<SyncAnswer, SplitsError> {
            if self.down.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(SplitsError::Timeout(Duration::from_secs(2)));
            }
            let mut set = lock(&self.set);
            let generation = lock(&self.generation).to_string();
            let mut added = Vec::new();
            for (m, d) in &req.adds {
                if set.insert(*m, *d).is_none() {
                    added.push(*m);
                }
            }
            let mut restored = 0;
            if req.generation.as_ref().is_some_and(|g| *g != generation) {
                for (m, d) in &req.keeps {
                    restored += u64::from(set.insert(*m, *d).is_none());
                }
            }
            let removed = req.merges.iter().filter(|m| set.remove(m).is_some()).copied().collect();
            *lock(&self.arrivals) += req.arrivals.iter().flat_map(|b| &b.counts).map(|(_, n)| n).sum::<u64>();
            lock(&self.sent).push(req.arrivals.clone());
            let records = set
                .iter()
                .map(|(m, d)| SplitRecord { member: *m, expires_in_ms: 10_000, drain_rps: Some(*d), arrivals_rps: lock(&self.rps).unwrap_or(100.0) })
                .collect();
            // The clock of this Redis reads 1,000,000 s at the start of a paused-time test.
            let redis_time_ms = 1_000_000_000 + Instant::now().duration_since(*START).as_millis() as u64;
            Ok(SyncAnswer { records, added, removed, generation, restored, redis_time_ms })
        }
    }

    fn hot_load(a: &Affinity, key: RoutedKey) {
        for _ in 0..20 {
            a.dequeued(3, key, Duration::from_secs(5));
        }
    }

    /// An instance whose partition queued level-0 key 42 (20 dequeues of 5 s a second) for 4
    /// refreshes, one a second from `t0`: the key is split in its view and in the store.
    async fn split_key_42() -> (Affinity, Memory, SplitRules, Instant) {
        let a = Affinity::default();
        let store = Memory::default();
        let rules = SplitRules::new(Duration::from_secs(1), NonZeroU32::new(8).unwrap());
        let hot = RoutedKey { level: 0, levels: 4, key: PrefixKey(42) };
        let t0 = Instant::now();
        for s in 0..=3 {
            hot_load(&a, hot);
            a.refresh(&store, &rules, t0 + Duration::from_secs(s)).await.unwrap();
        }
        (a, store, rules, t0)
    }

    #[tokio::test(start_paused = true)]
    async fn a_hot_key_is_published_and_a_redis_outage_freezes_the_view() {
        let (a, store, rules, t0) = split_key_42().await;
        let split = SplitMember { level: 0, key: PrefixKey(42), state: SplitState::Split };
        assert_eq!(a.view().get(0, PrefixKey(42)), Some(SplitState::Split));
        assert!(lock(&store.set).contains_key(&split));

        // Redis down: the refresh fails, the view stays, arrivals are kept for later.
        store.down.store(true, std::sync::atomic::Ordering::SeqCst);
        let choice = crate::affinity::choose(&a.view(), 4, |l| PrefixKey(42 + u64::from(l)));
        assert_eq!(choice.routed.level, 1);
        a.routed(&choice, PrefixKey(42), 300, false);
        for s in 4..60 {
            assert!(a.refresh(&store, &rules, t0 + Duration::from_secs(s)).await.is_err());
            assert_eq!(a.view().get(0, PrefixKey(42)), Some(SplitState::Split), "frozen at {s}s");
        }
        store.down.store(false, std::sync::atomic::Ordering::SeqCst);
        a.refresh(&store, &rules, t0 + Duration::from_secs(60)).await.unwrap();
        assert_eq!(*lock(&store.arrivals), 0, "an arrival older than the rate window is not sent: no rate would count it");
        assert_eq!(a.view().len(), 1, "still hot (100 rps > half of 20 rps): kept");
    }

    /// Reported: the rates of the last answer before an outage were reviewed again at every
    /// failed refresh, as if measured again: a key whose last rate was low counted as cool for
    /// the whole outage, and the first refresh that reached Redis merged it back, while the other
    /// instances' current rates kept it. Each answer's rates are reviewed once.
    #[tokio::test(start_paused = true)]
    async fn a_redis_outage_does_not_make_the_last_rates_count_as_cool() {
        let (a, store, rules, t0) = split_key_42().await;
        let split = SplitMember { level: 0, key: PrefixKey(42), state: SplitState::Split };
        let at = |s| t0 + Duration::from_secs(s);
        let set_rps = |rps| *lock(&store.rps) = Some(rps);
        // The last answer before the outage: 1 request/s, far below half the drain rate.
        set_rps(1.0);
        a.refresh(&store, &rules, at(4)).await.unwrap();
        store.down.store(true, std::sync::atomic::Ordering::SeqCst);
        for s in (5..60).step_by(2) {
            assert!(a.refresh(&store, &rules, at(s)).await.is_err());
        }
        // Meanwhile the key's traffic came back: the set's current rate is 100/s.
        set_rps(100.0);
        store.down.store(false, std::sync::atomic::Ordering::SeqCst);
        a.refresh(&store, &rules, at(60)).await.unwrap();
        assert!(lock(&store.set).contains_key(&split), "merged back by a rate measured before the outage");
        // Rates measured after it decide: cool for the cool time (10 s), then merged.
        set_rps(1.0);
        for s in 61..72 {
            a.refresh(&store, &rules, at(s)).await.unwrap();
            assert!(lock(&store.set).contains_key(&split), "merged at {s} s");
        }
        a.refresh(&store, &rules, at(72)).await.unwrap();
        assert!(!lock(&store.set).contains_key(&split), "cool for 10 s of fresh rates: merged");
    }

    /// Arrivals counted while Redis is unreachable reach it with the second they were counted
    /// in, by the clock of Redis, each batch with its own sequence number, and are sent until a
    /// refresh delivers them; before, they came as one burst at the first refresh after the
    /// outage, which raised the peak rate of the merge rule, so a key whose traffic never
    /// changed was merged back once the burst left the rate window.
    #[tokio::test(start_paused = true)]
    async fn arrivals_of_an_outage_reach_redis_dated_and_numbered() {
        let (a, store, rules, t0) = split_key_42().await;
        let sent_before = lock(&store.sent).len();
        let redis_at = |t: Instant| 1_000_000_000 + t.duration_since(*START).as_millis() as u64;
        store.down.store(true, std::sync::atomic::Ordering::SeqCst);
        let route_one = || {
            let choice = crate::affinity::choose(&a.view(), 4, |l| PrefixKey(42 + u64::from(l)));
            a.routed(&choice, PrefixKey(42), 300, false);
        };
        // Seconds 4, 5 and 6: one request each, then a failed refresh.
        for s in 4..=6 {
            route_one();
            assert!(a.refresh(&store, &rules, t0 + Duration::from_secs(s)).await.is_err());
        }
        store.down.store(false, std::sync::atomic::Ordering::SeqCst);
        route_one();
        let at7 = t0 + Duration::from_secs(7);
        a.refresh(&store, &rules, at7).await.unwrap();
        let sent = lock(&store.sent)[sent_before..].to_vec();
        assert_eq!(sent.len(), 1);
        let got: Vec<(u64, u64, u64)> = sent[0].iter().map(|b| (b.seq, b.counted_at_ms, b.counts.iter().map(|(_, n)| n).sum())).collect();
        let want: Vec<(u64, u64, u64)> = (4..=7).zip(1..).map(|(s, seq)| (seq, redis_at(t0 + Duration::from_secs(s)), 1)).collect();
        assert_eq!(got, want, "one batch per refresh, numbered, each dated when it was taken");
        // Delivered: not sent again.
        a.refresh(&store, &rules, t0 + Duration::from_secs(8)).await.unwrap();
        assert!(lock(&store.sent).last().unwrap().is_empty());
    }

    /// A split set lost as a whole (Redis restarted empty, flushed) is put back from the view at
    /// the next refresh: the key stays split, with no merge and no move; a set that only lost
    /// entries another instance merged is not.
    #[tokio::test(start_paused = true)]
    async fn a_lost_split_set_is_put_back_from_the_view() {
        let (a, store, rules, t0) = split_key_42().await;
        let split = SplitMember { level: 0, key: PrefixKey(42), state: SplitState::Split };
        let drain = *lock(&store.set).get(&split).unwrap();

        store.lose();
        let answer = a.refresh(&store, &rules, t0 + Duration::from_secs(4)).await.unwrap();
        assert_eq!(answer.restored, 1);
        assert_eq!(lock(&store.set).get(&split), Some(&drain), "put back with its drain rate");
        assert_eq!(a.view().get(0, PrefixKey(42)), Some(SplitState::Split), "never dropped from the view");

        // Another instance merged it (same generation): not put back.
        lock(&store.set).clear();
        let answer = a.refresh(&store, &rules, t0 + Duration::from_secs(5)).await.unwrap();
        assert_eq!(answer.restored, 0);
        assert!(a.view().is_empty());
    }

    /// Reported: an instance stopped (SIGSTOP) while the others merged a key, and Redis then lost
    /// its data; when the instance resumed, it put the merged key back from its old view. A
    /// process that did not refresh for the split TTL reads the set first: it puts nothing back
    /// and keeps nothing, and the refresh after that is as usual.
    #[tokio::test(start_paused = true)]
    async fn an_instance_that_did_not_run_puts_back_nothing_from_its_old_view() {
        let (a, store, rules, t0) = split_key_42().await;
        let split = SplitMember { level: 0, key: PrefixKey(42), state: SplitState::Split };
        // Stopped for 30 s (`run` marks the view stale): meanwhile the key merged and the set was
        // lost.
        store.lose();
        a.mark_stale();
        let answer = a.refresh(&store, &rules, t0 + Duration::from_secs(33)).await.unwrap();
        assert_eq!(answer.restored, 0, "put back from a view older than the split TTL");
        assert!(lock(&store.set).get(&split).is_none());
        assert!(a.view().is_empty(), "the view follows the set in Redis");
        // The next refresh knows the set again: a loss now is put back as usual.
        lock(&store.set).insert(split, 20.0);
        a.refresh(&store, &rules, t0 + Duration::from_secs(34)).await.unwrap();
        assert_eq!(a.view().get(0, PrefixKey(42)), Some(SplitState::Split));
        store.lose();
        let answer = a.refresh(&store, &rules, t0 + Duration::from_secs(35)).await.unwrap();
        assert_eq!(answer.restored, 1);
    }

    /// Reported: a refresh whose call timed out while Redis stalled, and ran when it resumed,
    /// split a key that no instance logged or counted. The next answer shows it: logged and
    /// counted then, unless that answer's own call made the change.
    #[test]
    fn a_change_stored_by_a_refresh_without_an_answer_is_logged_once_seen() {
        let split = SplitMember { level: 0, key: PrefixKey(42), state: SplitState::Split };
        let other = SplitMember { level: 0, key: PrefixKey(7), state: SplitState::Split };
        let why = SplitReason::Dominant { share: 0.9, requests: 20 };
        let unanswered = vec![(split, Some(why)), (other, None)];
        let (empty, both) = (SplitView::new([]), SplitView::new([split]));
        let with_other = SplitView::new([other]);
        let answer = SyncAnswer::default();
        assert_eq!(log_late(&unanswered, &with_other, &both, &answer), 2, "the split and the merge, both stored late");
        assert_eq!(log_late(&unanswered, &both, &both, &answer), 0, "split before: nothing new");
        assert_eq!(log_late(&unanswered, &empty, &empty, &answer), 0, "never stored");
        let made_now = SyncAnswer { added: vec![split], ..SyncAnswer::default() };
        assert_eq!(log_late(&unanswered[..1], &empty, &both, &made_now), 0, "this answer made it, and logged it");
    }

    /// Routes one request of a 3-level key (level keys 7, 8, 9) through `a`; returns its level.
    fn route(a: &Affinity) -> u8 {
        let choice = crate::affinity::choose(&a.view(), 3, |l| PrefixKey(7 + u64::from(l)));
        a.routed(&choice, PrefixKey(7), 3000, false);
        choice.routed.level
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_requests_of_a_dominant_key_ask_for_an_early_refresh_that_splits_it() {
        let a = Affinity::default();
        let store = Memory::default();
        let rules = SplitRules::new(Duration::from_secs(1), NonZeroU32::new(8).unwrap());
        let asked = |a: &Affinity| {
            let a = a.clone();
            async move { tokio::time::timeout(Duration::from_millis(1), a.early_refresh()).await.is_ok() }
        };
        for _ in 0..4 {
            assert_eq!(route(&a), 0);
        }
        assert!(!asked(&a).await, "4 requests: no early refresh");
        route(&a);
        assert!(asked(&a).await, "the 5th request asks for one");
        a.refresh(&store, &rules, Instant::now()).await.unwrap();
        assert_eq!(route(&a), 2, "split at that refresh, with level 1 (one key for all 5): they route by level 2");
        assert!(!asked(&a).await, "asked once");
    }

    #[tokio::test(start_paused = true)]
    async fn with_one_llm_server_a_dominant_key_stays_whole() {
        let store = Memory::default();
        let rules = SplitRules::new(Duration::from_secs(1), NonZeroU32::new(8).unwrap());
        for (servers, level) in [(1, 0), (2, 2), (0, 2)] {
            let a = Affinity::default();
            a.set_servers(servers);
            for _ in 0..20 {
                route(&a);
            }
            a.refresh(&store, &rules, Instant::now()).await.unwrap();
            assert_eq!(route(&a), level, "{servers} servers known (0: not yet)");
            store.set.lock().unwrap().clear();
        }
    }
}
