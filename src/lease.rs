//! The Redis lease protocol: who may consume a partition, and since which epoch.
//!
//! # Protocol
//!
//! Keys (with `P` = `redis.key_prefix`):
//! - `P:lease:{p}` = `"{name}:{nonce}:{epoch}"` with a TTL of `lease_ttl` — the lease of partition
//!   `p`. `name` is the instance's stable name, `nonce` is random per process start.
//! - `P:epoch:{p}` — the epoch counter. Every acquisition sets it to
//!   `epoch = max(INCR, Redis TIME in ms)` and writes that back, so epochs of one partition are
//!   strictly increasing and serve as fencing tokens — also across a Redis failover or data loss
//!   that rolled the counter back (see "Failover" below).
//!
//! Operations, each one atomic Lua script (Redis runs a script without interleaving other
//! commands, <https://redis.io/docs/latest/develop/interact/programmability/eval-intro/>):
//! - acquire: if the lease is absent, or this very process (same `name:nonce`) holds it (a
//!   previous worker of this process was aborted at its renew deadline while Redis was slow), take
//!   the next epoch (`INCR`, raised to `TIME` in ms when that is larger, and written back) and
//!   `SET … PX lease_ttl` with it — every worker incarnation gets its own epoch; else report the
//!   holder. (A script that calls `TIME` before writing is replicated by its effects, the only
//!   mode since Redis 7: the replica stores the resulting values, it does not re-run the script.)
//! - renew: compare the whole value `name:nonce:epoch` and `PEXPIRE` only on a match.
//! - release: compare and `DEL` only on a match.
//! - release at any epoch: `DEL` when the value begins with this process's `name:nonce:`; only
//!   after an acquire that failed here and may still have run in Redis.
//!
//! # Safety argument
//!
//! A holder consumes partition `p` only while `now < t_sent + renew_deadline`, where `t_sent` is
//! the monotonic time at which it *sent* its last successful acquire/renew (taken before the
//! whole concurrent round of commands is sent, so never later than the real send); [`LeaseClock`]
//! is that local deadline, checked before every publish and ack. The lease in Redis
//! lives until at least `t_sent + lease_ttl` measured by Redis (the expiry was set after the send),
//! so as long as clocks advance at similar rates and `lease_ttl - renew_deadline` covers the drift
//! and the time between the last local check and a publish, the old holder stops before anyone
//! else can acquire. Redis expires keys by its wall clock (a key's expiry is an absolute Unix
//! time), so a step forward of the Redis host's clock ends leases early: another instance may
//! then acquire while the old holder still runs. RabbitMQ's single active consumer still
//! delivers the partition to one consumer at a time, and the epoch in `x-partition-epoch` tells
//! the two holders' results apart; keep the Redis host's clock slewed (NTP), not stepped. The
//! defaults (15 s vs 10 s) leave 5 s. Renewals compare the full value including the epoch, so a holder whose lease expired and
//! was taken by another can never extend the successor's lease. A paused process (SIGSTOP, GC,
//! swap) that wakes after its deadline finds its local deadline passed before doing anything and
//! stops; anything it still publishes carries its old epoch in `x-partition-epoch`, which makes it
//! detectable downstream.
//!
//! The broker adds a last fence: every partition queue is a single-active-consumer queue
//! (`x-single-active-consumer`), and RabbitMQ delivers a SAC queue's messages to one consumer at a
//! time; the next registered consumer becomes active only when the active one is cancelled or its
//! channel or connection closes (<https://www.rabbitmq.com/docs/consumers#single-active-consumer>).
//! So in any window where two instances both believe they hold partition `p` — at most
//! `lease_ttl`, e.g. after a Redis failover lost the last lease write — only one of them receives
//! the partition's messages: the other's consumer waits as standby and processes nothing, and it
//! cannot ack what it never received. Messages are never processed by both at once; the worst case
//! is a message processed again after the active consumer stopped without acking (a duplicate,
//! never a loss). Every result carries `x-partition-epoch` (and `x-instance`), so a consumer of
//! results can drop anything older than the newest epoch it has seen for that partition.
//!
//! # Failover (Redis Sentinel)
//!
//! Redis replication is asynchronous
//! (<https://redis.io/docs/latest/operate/oss_and_stack/management/replication/>): a promoted
//! replica may lack the last writes of the old primary — the last `INCR` of an epoch counter, the
//! last lease `SET` or renewal. The daemon follows the new primary ([`RedisConn`]); what the lost
//! writes mean:
//! - A lost renewal or a lost lease: the lease on the new primary expires earlier, or is absent,
//!   and another instance may acquire it while the old holder still works: until its next renewal
//!   on the new primary fails the compare (usually within `renew_interval`) and at most until its
//!   local deadline (`renew_deadline` < `lease_ttl`). In that window the broker's
//!   single-active-consumer fence above keeps their deliveries apart.
//! - A lost epoch `INCR`: a plain counter would hand out the same epoch number again, to another
//!   holder, which would make two tenures indistinguishable by `x-partition-epoch`. With
//!   `epoch = max(INCR, TIME in ms)` the new primary's next epoch is at least its clock reading,
//!   and every epoch the old primary issued was at most its clock reading at issue time plus the
//!   number of acquisitions of that partition that came faster than one per ms. So epochs of one
//!   partition strictly increase across the failover if (1) the primary's and the replica's clocks
//!   agree to better than the failover takes (Sentinel's `down-after-milliseconds`, seconds; on
//!   one machine, or hosts synchronised by NTP to milliseconds, this holds by a wide margin), and
//!   (2) a partition is acquired less than once per ms on average (an instance acquires a
//!   partition at most once per ownership round, ≥ 50 ms). A clock that jumps back by more than
//!   the failover time voids the guarantee for that failover only.
//! - Membership heartbeats are rewritten within a tick; a member that looks absent for a moment
//!   only delays an acquisition by `settle_time`.
//!
//! Cost, measured (`tests/cluster_redis.rs`, `d_epoch_rule_cost`: 3,000 sequential acquisitions
//! on one connection to a primary with one replica, all on 127.0.0.1, 2 shared cores, Redis
//! 7.0.15): the counter alone 70 µs mean / 59 µs p50 / 328 µs p99 per acquire and 8.7 µs of Redis
//! CPU per script call; `max(INCR, TIME)` 71 / 62 / 240 µs and 10.1 µs — the same latency, +1.3 µs
//! CPU; the alternative of `INCR` then `WAIT 1 100` (return only once the replica has the write)
//! 167 / 110 / 865 µs, 2.4× the latency on loopback and more with a real network round trip
//! between the nodes, and `WAIT` does not stop a promotion of a replica that lacks the write
//! either (the Redis docs: `WAIT` does not make Redis strongly consistent). Acquisitions are rare
//! (a handful per rebalance), so either cost is negligible; the clock rule needs no replica to
//! answer and never blocks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::Script;
use tokio::time::Instant;
use tracing::info;

use crate::config::RedisSettings;

/// Acquire: KEYS = [lease, epoch], ARGV = [holder ("name:nonce"), ttl_ms]. (`SET` without `NX`:
/// the key is absent or ours, checked just before, and a script runs atomically.)
/// Returns `[epoch, ""]` on success, `[0, current_value]` when held by someone else.
const ACQUIRE: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur then
  local mine = ARGV[1] .. ':'
  if string.sub(cur, 1, string.len(mine)) ~= mine then
    return {0, cur}
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local e = redis.call('INCR', KEYS[2])
if e < now then
  e = now
  redis.call('SET', KEYS[2], string.format('%d', e))
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. string.format('%d', e), 'PX', ARGV[2])
return {e, ''}
"#;

/// Renew: KEYS = [lease], ARGV = [value, ttl_ms]. Returns 1 when renewed, 0 when not ours.
const RENEW: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#;

/// Release: KEYS = [lease], ARGV = [value]. Returns 1 when deleted, 0 when not ours.
const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

/// Release of any epoch: KEYS = [lease], ARGV = [holder ("name:nonce")]. Deletes the lease when
/// this process holds it, whatever the epoch. Returns 1 when deleted, 0 when not ours.
const RELEASE_ANY_EPOCH: &str = r#"
local cur = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ':'
if cur and string.sub(cur, 1, string.len(mine)) == mine then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

/// The local view of a lease's validity: consuming and publishing are allowed only before the
/// deadline (monotonic, [`tokio::time::Instant`], so tests drive it with paused time), which the
/// owner moves forward to `renew_sent + renew_deadline` after every successful renewal (see the
/// safety argument above). Once invalidated (lease lost) it stays invalid.
#[derive(Debug)]
pub struct LeaseClock {
    /// `None` once invalidated.
    valid_until: Mutex<Option<Instant>>,
}

impl LeaseClock {
    /// A clock valid until `deadline`.
    pub fn new(deadline: Instant) -> Self {
        LeaseClock { valid_until: Mutex::new(Some(deadline)) }
    }

    fn valid_until(&self) -> Option<Instant> {
        *self.valid_until.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Moves the deadline (only forward; no effect once invalidated).
    pub fn extend_to(&self, deadline: Instant) {
        let mut v = self.valid_until.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(d) = v.as_mut() {
            *d = (*d).max(deadline);
        }
    }

    /// Ends validity now, for good: a later [`extend_to`](Self::extend_to) does not revive it.
    pub fn invalidate(&self) {
        *self.valid_until.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    /// Whether the lease is still valid: not invalidated and strictly before the deadline.
    pub fn is_valid(&self) -> bool {
        self.valid_until().is_some_and(|d| Instant::now() < d)
    }

    /// The current deadline; `None` once invalidated.
    pub fn deadline(&self) -> Option<Instant> {
        self.valid_until()
    }

    /// Completes when the lease is no longer valid (deadline passed or invalidated). It wakes at
    /// the current deadline and re-checks, since renewals move the deadline forward meanwhile.
    pub async fn expired(&self) {
        // Wake at the deadline, and at least every second: an invalidation does not move the
        // deadline, and the extra wake-ups cost nothing.
        while let Some(d) = self.valid_until().filter(|d| Instant::now() < *d) {
            tokio::time::sleep_until(d.min(Instant::now() + Duration::from_secs(1))).await;
        }
    }
}

/// Lease errors.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Redis unreachable, timed out or answered with an error. The lease state is unknown.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The command did not answer within `redis.command_timeout`.
    #[error("redis command timed out after {0:?}")]
    Timeout(Duration),
}

impl LeaseError {
    /// Whether Redis answered `READONLY` ([`is_failover`]).
    pub fn is_failover(&self) -> bool {
        matches!(self, LeaseError::Redis(e) if is_failover(e))
    }
}

/// Whether `e` is Redis's `READONLY` answer: the connection reaches a node that a failover
/// demoted to replica. redis 1.x's `ConnectionManager` reconnects only on connection errors
/// (`RedisError::is_unrecoverable_error`), not on this one; [`RedisConn`] then opens a new
/// connection to the current primary.
pub fn is_failover(e: &redis::RedisError) -> bool {
    matches!(e.kind(), redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly))
}

/// Whether Redis refused the daemon's credentials (`WRONGPASS`, `NOAUTH`; the redis crate's
/// `AuthenticationFailed`). redis 1.x's `ConnectionManager` keeps a reconnect that failed so (it
/// reconnects again only after an I/O error), so every later command would fail the same way, for
/// good, even once the credentials are right again: [`RedisConn`] opens a new connection instead,
/// retried until Redis takes the credentials.
pub fn refused_credentials(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
}

/// A re-resolution ([`RedisConn`]) that keeps failing logs at most this often per kind of failure
/// ([`crate::log_limit`]).
static RESOLVE_FAILED_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();
static RESOLVE_REFUSED_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// Whether `e` says the node may be gone (I/O error, refused or dropped connection, timeout): in
/// Sentinel mode a reason to ask the sentinels for the primary again.
fn is_link_error(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() || e.is_timeout() || e.is_unrecoverable_error()
}

/// The daemon's one Redis connection, shared (cheap [`Clone`]) by leases, membership, split state
/// and `status`; it implements [`redis::aio::ConnectionLike`], so commands and scripts run on it
/// as on a `ConnectionManager`.
///
/// Underneath is a `ConnectionManager` to the current primary: from `redis.url`, or, with
/// `redis.sentinels`, the address the sentinels report for `redis.sentinel_master` (the redis
/// crate connects to it and checks that its `ROLE` is master before handing it out). It follows a
/// failover by itself: a `READONLY` answer (a demoted primary), refused credentials
/// ([`refused_credentials`]: a password rotated, or an ACL user switched off and on again, which
/// the `ConnectionManager` would not get over) or, in Sentinel mode, a connection
/// error or timeout, or a sentinel naming another primary (asked every [`PRIMARY_CHECK_INTERVAL`]:
/// after a failover the old primary, when still up, accepts writes until the sentinels demote it,
/// which takes up to ~10 s, their `INFO` period) starts one background re-resolution — ask the sentinels (or reopen
/// `redis.url`), connect, swap the connection in — retried with a backoff from 100 ms doubling to
/// 1 s until it succeeds. The command that failed still fails (the callers retry on their next
/// round; an acquire is not replayed blindly). Errors of connections already replaced do not start
/// another one. Each new primary is logged (`Redis primary`, address only, never credentials).
#[derive(Clone)]
pub struct RedisConn {
    shared: Arc<Shared>,
}

/// Clears its flag when dropped.
struct ClearOnDrop<'a>(&'a AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

struct Shared {
    /// The current connection and its generation (incremented by every swap).
    current: RwLock<(u64, ConnectionManager)>,
    /// `None` for a connection made from a bare `ConnectionManager` (tests): no re-resolution.
    resolver: Option<Resolver>,
    /// `host:port` of the current primary (no credentials).
    primary: RwLock<String>,
    /// A re-resolution is running.
    resolving: AtomicBool,
}

struct Resolver {
    settings: RedisSettings,
    sentinel: Option<tokio::sync::Mutex<SentinelClient>>,
    /// The sentinels (with their credentials), for [`PRIMARY_CHECK_INTERVAL`] checks.
    sentinel_nodes: Vec<redis::Client>,
}

/// How often, in Sentinel mode, the connection asks a sentinel which node is the primary
/// (`SENTINEL GET-MASTER-ADDR-BY-NAME`, answered by the sentinel from memory: no load on Redis).
pub const PRIMARY_CHECK_INTERVAL: Duration = Duration::from_secs(1);

impl From<ConnectionManager> for RedisConn {
    /// A connection without failover handling (its `ConnectionManager` reconnects to the same
    /// address on connection errors).
    fn from(conn: ConnectionManager) -> Self {
        RedisConn {
            shared: Arc::new(Shared {
                current: RwLock::new((0, conn)),
                resolver: None,
                primary: RwLock::new(String::new()),
                resolving: AtomicBool::new(false),
            }),
        }
    }
}

/// Initial and longest wait between two failed re-resolutions.
const RESOLVE_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(1));

impl RedisConn {
    /// `host:port` of the primary the connection currently reaches (no credentials; empty for a
    /// connection made from a bare `ConnectionManager`).
    pub fn primary(&self) -> String {
        self.shared.primary.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The current `ConnectionManager` (for code that needs the concrete type). Errors met on it
    /// should be passed to [`report`](Self::report).
    pub fn manager(&self) -> ConnectionManager {
        self.current().1
    }

    fn current(&self) -> (u64, ConnectionManager) {
        self.shared.current.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Tells the connection about an error met on it outside [`redis::aio::ConnectionLike`]:
    /// starts a re-resolution when the error calls for one (see [`RedisConn`]).
    pub fn report(&self, e: &redis::RedisError) {
        let generation = self.current().0;
        self.on_error(generation, e);
    }

    fn on_error(&self, generation: u64, e: &redis::RedisError) {
        let Some(resolver) = &self.shared.resolver else { return };
        let follow = is_failover(e) || refused_credentials(e) || (resolver.sentinel.is_some() && is_link_error(e));
        if follow && self.current().0 == generation {
            self.follow();
        }
    }

    /// Starts a background re-resolution unless one is running.
    fn follow(&self) {
        if self.shared.resolving.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            // Cleared however the task ends, a panic included: a flag left set would stop every
            // later reconnection for good.
            let _resolving = ClearOnDrop(&this.shared.resolving);
            let mut backoff = RESOLVE_BACKOFF.0;
            while let Err(e) = this.resolve_once().await {
                if refused_credentials(&e) {
                    crate::error_limited!(
                        RESOLVE_REFUSED_LOG,
                        error = %e,
                        retry_in = ?backoff,
                        "Redis refused the daemon's credentials: check the user and password in redis.url (or the user's ACL); reconnecting"
                    );
                } else {
                    crate::warn_limited!(RESOLVE_FAILED_LOG, error = %e, retry_in = ?backoff, "Redis primary not reachable; asking again");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RESOLVE_BACKOFF.1);
            }
        });
    }

    /// Resolves the primary and connects to it, bounded by twice `redis.command_timeout`; swaps
    /// the new connection in.
    async fn resolve_once(&self) -> Result<(), redis::RedisError> {
        let Some(resolver) = &self.shared.resolver else { return Ok(()) };
        let limit = resolver.settings.command_timeout * 2;
        let (addr, conn) = match tokio::time::timeout(limit, resolver.open()).await {
            Ok(r) => r?,
            Err(_) => return Err(redis::RedisError::from(std::io::Error::new(std::io::ErrorKind::TimedOut, "primary lookup timed out"))),
        };
        {
            let mut cur = self.shared.current.write().unwrap_or_else(PoisonError::into_inner);
            *cur = (cur.0 + 1, conn);
        }
        let previous = std::mem::replace(&mut *self.shared.primary.write().unwrap_or_else(PoisonError::into_inner), addr.clone());
        if previous != addr {
            info!(primary = %addr, previous = %previous, sentinel = resolver.sentinel.is_some(), "Redis primary changed; reconnected");
        } else {
            info!(primary = %addr, "reconnected to the Redis primary");
        }
        Ok(())
    }
}

impl Resolver {
    /// Finds the primary (sentinels, or `redis.url`) and opens a `ConnectionManager` to it.
    async fn open(&self) -> Result<(String, ConnectionManager), redis::RedisError> {
        let s = &self.settings;
        let client = match &self.sentinel {
            Some(sc) => sc.lock().await.async_get_client().await?,
            None => client(s)?,
        };
        let addr = client.get_connection_info().addr().to_string();
        let cfg = ConnectionManagerConfig::new()
            .set_response_timeout(Some(s.command_timeout))
            .set_connection_timeout(Some(s.command_timeout))
            .set_number_of_retries(2);
        Ok((addr, client.get_connection_manager_with_config(cfg).await?))
    }
}

impl redis::aio::ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.current();
            let r = conn.req_packed_command(cmd).await;
            if let Err(e) = &r {
                self.on_error(generation, e);
            }
            r
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let (generation, mut conn) = self.current();
            let r = conn.req_packed_commands(pipeline, offset, count).await;
            if let Err(e) = &r {
                self.on_error(generation, e);
            }
            r
        })
    }

    fn get_db(&self) -> i64 {
        self.current().1.get_db()
    }
}

/// Why [`connect`] failed: in Sentinel mode, at the sentinels or at the primary they named. Its
/// text holds the Redis error's, which is therefore not given as its `source()` as well (an
/// error chain would print it twice).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// No sentinel of `redis.sentinels` named a primary for `redis.sentinel_master`: none was
    /// reachable, they refused the credentials of `redis.sentinels`, or none monitors a master
    /// of that name. `sentinels`: their addresses, passwords redacted.
    #[error("no sentinel of redis.sentinels ({sentinels}) named a primary for `{master}`: {source}")]
    Sentinels { sentinels: String, master: String, source: redis::RedisError },
    /// Redis itself failed: the server of `redis.url`, or in Sentinel mode the primary the
    /// sentinels named (`primary`, `host:port`; reached with the credentials, database and TLS
    /// mode of `redis.url`).
    #[error("{}{source}", primary.as_ref().map(|p| format!("the primary {p} that redis.sentinels named: ")).unwrap_or_default())]
    Redis { primary: Option<String>, source: redis::RedisError },
}

impl ConnectError {
    fn sentinels(settings: &RedisSettings, source: redis::RedisError) -> ConnectError {
        let s = settings.sentinel.as_ref();
        ConnectError::Sentinels {
            sentinels: s.map(|s| s.addrs.iter().map(|a| a.redacted()).collect::<Vec<_>>().join(", ")).unwrap_or_default(),
            master: s.map(|s| s.master.clone()).unwrap_or_default(),
            source,
        }
    }

    /// The Redis error underneath.
    pub fn redis_error(&self) -> &redis::RedisError {
        match self {
            ConnectError::Sentinels { source, .. } | ConnectError::Redis { source, .. } => source,
        }
    }
}

impl From<redis::RedisError> for ConnectError {
    fn from(source: redis::RedisError) -> Self {
        ConnectError::Redis { primary: None, source }
    }
}

impl Resolver {
    /// Says where a failed [`Resolver::open`] failed. Without sentinels: Redis. With them, the
    /// redis crate's one call both asks the sentinels and checks the primary's role with the
    /// credentials of `redis.url`, so its error names neither: the sentinels are asked again,
    /// one by one. One that names a primary puts the fault there; none that does puts it at the
    /// sentinels, with the last sentinel's own error.
    async fn diagnose(&self, e: redis::RedisError) -> ConnectError {
        let Some(sentinel) = &self.settings.sentinel else { return ConnectError::from(e) };
        let mut last = e;
        for node in &self.sentinel_nodes {
            match ask_sentinel(node, &sentinel.master, self.settings.command_timeout).await {
                Ok(Some((host, port))) => return ConnectError::Redis { primary: Some(format!("{host}:{port}")), source: last },
                Ok(None) => {
                    last = redis::RedisError::from((
                        redis::ErrorKind::MasterNameNotFoundBySentinel,
                        "the sentinel monitors no master of the name in redis.sentinel_master",
                    ))
                }
                Err(err) => last = err,
            }
        }
        ConnectError::sentinels(&self.settings, last)
    }
}

/// The error of a sentinel that did not answer within `redis.command_timeout`.
fn sentinel_timed_out() -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Io, "the sentinel did not answer within redis.command_timeout"))
}

/// Asks the sentinel `node` for the address of `master` on a new connection, within `limit`
/// for connecting and again for the answer ([`master_addr`]).
async fn ask_sentinel(node: &redis::Client, master: &str, limit: Duration) -> Result<Option<(String, u16)>, redis::RedisError> {
    let mut c = tokio::time::timeout(limit, node.get_multiplexed_async_connection()).await.map_err(|_| sentinel_timed_out())??;
    master_addr(&mut c, master, limit).await
}

/// Asks the sentinel on `c` for the address of `master` (`SENTINEL GET-MASTER-ADDR-BY-NAME`,
/// answered from the sentinel's memory), within `limit`; `None`: it monitors no such master.
async fn master_addr(c: &mut redis::aio::MultiplexedConnection, master: &str, limit: Duration) -> Result<Option<(String, u16)>, redis::RedisError> {
    let mut cmd = redis::cmd("SENTINEL");
    cmd.arg("GET-MASTER-ADDR-BY-NAME").arg(master);
    tokio::time::timeout(limit, cmd.query_async(c)).await.map_err(|_| sentinel_timed_out())?
}

/// Every [`PRIMARY_CHECK_INTERVAL`] while `shared` lives: asks the sentinels (the first that
/// answers) for the primary and starts a re-resolution when it is not the one connected to.
async fn watch_primary(shared: std::sync::Weak<Shared>) {
    let mut tick = tokio::time::interval(PRIMARY_CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut cached: Option<(usize, redis::aio::MultiplexedConnection)> = None;
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else { return };
        let conn = RedisConn { shared };
        let Some(resolver) = &conn.shared.resolver else { return };
        let Some(master) = resolver.settings.sentinel.as_ref().map(|s| s.master.clone()) else { return };
        let limit = resolver.settings.command_timeout;
        let nodes = resolver.sentinel_nodes.len();
        let start = cached.as_ref().map_or(0, |(i, _)| *i);
        let mut reported = None;
        for k in 0..nodes {
            let i = (start + k) % nodes;
            let mut c = match cached.take() {
                Some((j, c)) if j == i => c,
                _ => match tokio::time::timeout(limit, resolver.sentinel_nodes[i].get_multiplexed_async_connection()).await {
                    Ok(Ok(c)) => c,
                    _ => continue,
                },
            };
            if let Ok(addr) = master_addr(&mut c, &master, limit).await {
                cached = Some((i, c));
                reported = addr;
                break;
            }
        }
        if let Some((host, port)) = reported {
            if format!("{host}:{port}") != conn.primary() {
                conn.follow();
            }
        }
    }
}

/// Opens the daemon's Redis connection ([`RedisConn`]): to `redis.url`, or with
/// `redis.sentinels` to the primary the sentinels report for `redis.sentinel_master`. Every
/// command and connection attempt is bounded by `redis.command_timeout`, two reconnect retries.
/// Over `rediss://` it uses the link's TLS files ([`crate::tls`]): the CA bundle replaces the
/// system roots, and the client certificate and key, when set, authenticate the daemon (Redis'
/// `tls-auth-clients yes`); with sentinels the same files serve the `rediss://` sentinels too.
///
/// In Sentinel mode `redis.url`'s host and port are not used; its username, password, database
/// and scheme (`rediss://`: TLS to the primary) are.
///
/// Errors ([`ConnectError`]): a URL is invalid, or Redis is unreachable or refuses the
/// credentials of `redis.url`; in Sentinel mode, no sentinel answers (unreachable, refusing the
/// credentials of `redis.sentinels`, or monitoring no master of that name), or the primary they
/// name does. A server certificate that does not verify fails the TLS handshake.
pub async fn connect(settings: &RedisSettings) -> Result<RedisConn, ConnectError> {
    let sentinel_nodes = match &settings.sentinel {
        None => Vec::new(),
        Some(s) => s.addrs.iter().map(|a| client_of(settings, a.expose())).collect::<Result<_, _>>().map_err(|e| ConnectError::sentinels(settings, e))?,
    };
    let sentinel = sentinel_client(settings).map_err(|e| ConnectError::sentinels(settings, e))?.map(tokio::sync::Mutex::new);
    let resolver = Resolver { settings: settings.clone(), sentinel, sentinel_nodes };
    let (addr, conn) = match resolver.open().await {
        Ok(opened) => opened,
        Err(e) => return Err(resolver.diagnose(e).await),
    };
    let shared = Arc::new(Shared {
        current: RwLock::new((0, conn)),
        resolver: Some(resolver),
        primary: RwLock::new(addr.clone()),
        resolving: AtomicBool::new(false),
    });
    if let Some(s) = &settings.sentinel {
        info!(primary = %addr, master = %s.master, sentinels = s.addrs.len(), "Redis primary (from Sentinel)");
        tokio::spawn(watch_primary(Arc::downgrade(&shared)));
    }
    Ok(RedisConn { shared })
}

/// The redis crate's Sentinel client of `redis.sentinels`, or `None` without sentinels: the
/// primary gets `redis.url`'s credentials, database, TLS mode and TLS files.
fn sentinel_client(settings: &RedisSettings) -> Result<Option<SentinelClient>, redis::RedisError> {
    let Some(sentinel) = &settings.sentinel else { return Ok(None) };
    crate::tls::install_crypto_provider();
    let url = redis::IntoConnectionInfo::into_connection_info(settings.url.expose())?;
    let mut addrs = Vec::new();
    for a in &sentinel.addrs {
        addrs.push(redis::IntoConnectionInfo::into_connection_info(a.expose())?);
    }
    let mut b = SentinelClientBuilder::new(addrs.iter().map(|a| a.addr().clone()), &sentinel.master, SentinelServerType::Master)?
        .set_client_to_redis_db(url.redis_settings().db());
    if let Some(u) = url.redis_settings().username() {
        b = b.set_client_to_redis_username(u);
    }
    if let Some(p) = url.redis_settings().password() {
        b = b.set_client_to_redis_password(p);
    }
    if let Some(first) = addrs.first() {
        if let Some(u) = first.redis_settings().username() {
            b = b.set_client_to_sentinel_username(u);
        }
        if let Some(p) = first.redis_settings().password() {
            b = b.set_client_to_sentinel_password(p);
        }
    }
    let tls = settings.url.expose().starts_with("rediss://");
    if tls {
        b = b.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
    }
    if settings.tls.is_set() {
        let certs = || redis::TlsCertificates {
            client_tls: settings.tls.client.as_ref().map(|c| redis::ClientTlsConfig { client_cert: c.cert_pem.clone(), client_key: c.key_pem.clone() }),
            root_cert: settings.tls.ca_pem.clone(),
        };
        if tls {
            b = b.set_client_to_redis_certificates(certs());
        }
        if sentinel.addrs.iter().any(|a| a.expose().starts_with("rediss://")) {
            b = b.set_client_to_sentinel_certificates(certs());
        }
    }
    b.build().map(Some)
}

/// The Redis client of `redis.url` (see [`connect`] for TLS).
fn client(settings: &RedisSettings) -> Result<redis::Client, redis::RedisError> {
    client_of(settings, settings.url.expose())
}

/// A Redis client of `url` with the TLS files of `[redis]` (used for `rediss://` only).
fn client_of(settings: &RedisSettings, url: &str) -> Result<redis::Client, redis::RedisError> {
    crate::tls::install_crypto_provider();
    if !settings.tls.is_set() || !url.starts_with("rediss://") {
        return redis::Client::open(url);
    }
    let certs = redis::TlsCertificates {
        client_tls: settings.tls.client.as_ref().map(|c| redis::ClientTlsConfig { client_cert: c.cert_pem.clone(), client_key: c.key_pem.clone() }),
        root_cert: settings.tls.ca_pem.clone(),
    };
    redis::Client::build_with_tls(url, certs)
}

/// Result of an acquire attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// Acquired (or already ours) with this epoch.
    Acquired(u64),
    /// Held by another process; the value is `name:nonce:epoch`.
    Busy(String),
}

/// A parsed lease value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseValue {
    pub name: String,
    pub nonce: String,
    pub epoch: u64,
}

impl LeaseValue {
    /// Parses `name:nonce:epoch` (names contain no `:`, enforced at config load).
    pub fn parse(s: &str) -> Option<LeaseValue> {
        let mut it = s.rsplitn(3, ':');
        let epoch = it.next()?.parse().ok()?;
        let nonce = it.next()?.to_owned();
        let name = it.next()?.to_owned();
        Some(LeaseValue { name, nonce, epoch })
    }
}

/// Lease operations for one process (`name:nonce`).
#[derive(Clone)]
pub struct Leases {
    conn: RedisConn,
    prefix: String,
    holder: String,
    ttl: Duration,
    timeout: Duration,
    acquire: std::sync::Arc<Script>,
    renew: std::sync::Arc<Script>,
    release: std::sync::Arc<Script>,
    release_any_epoch: std::sync::Arc<Script>,
}

impl Leases {
    /// `holder` is `name:nonce`.
    pub fn new(conn: impl Into<RedisConn>, prefix: &str, holder: String, ttl: Duration, timeout: Duration) -> Self {
        Leases {
            conn: conn.into(),
            prefix: prefix.to_owned(),
            holder,
            ttl,
            timeout,
            acquire: std::sync::Arc::new(Script::new(ACQUIRE)),
            renew: std::sync::Arc::new(Script::new(RENEW)),
            release: std::sync::Arc::new(Script::new(RELEASE)),
            release_any_epoch: std::sync::Arc::new(Script::new(RELEASE_ANY_EPOCH)),
        }
    }

    /// Redis key of partition `p`'s lease.
    pub fn lease_key(prefix: &str, p: u32) -> String {
        format!("{prefix}:lease:{p}")
    }

    /// Redis key of partition `p`'s epoch counter.
    pub fn epoch_key(prefix: &str, p: u32) -> String {
        format!("{prefix}:epoch:{p}")
    }

    /// The full lease value this process writes for `epoch`.
    pub fn value(&self, epoch: u64) -> String {
        format!("{}:{epoch}", self.holder)
    }

    async fn timed<T>(&self, f: impl std::future::Future<Output = redis::RedisResult<T>>) -> Result<T, LeaseError> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(LeaseError::Timeout(self.timeout)),
        }
    }

    /// Tries to acquire partition `p`.
    pub async fn acquire(&self, p: u32) -> Result<Acquire, LeaseError> {
        let mut conn = self.conn.clone();
        let (epoch, cur): (u64, String) = self
            .timed(
                self.acquire
                    .key(Self::lease_key(&self.prefix, p))
                    .key(Self::epoch_key(&self.prefix, p))
                    .arg(&self.holder)
                    .arg(self.ttl.as_millis() as u64)
                    .invoke_async(&mut conn),
            )
            .await?;
        Ok(if epoch > 0 { Acquire::Acquired(epoch) } else { Acquire::Busy(cur) })
    }

    /// Renews partition `p`'s lease at `epoch`. `Ok(false)`: the lease is no longer ours.
    pub async fn renew(&self, p: u32, epoch: u64) -> Result<bool, LeaseError> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .timed(
                self.renew
                    .key(Self::lease_key(&self.prefix, p))
                    .arg(self.value(epoch))
                    .arg(self.ttl.as_millis() as u64)
                    .invoke_async(&mut conn),
            )
            .await?;
        Ok(n == 1)
    }

    /// Releases partition `p`'s lease at `epoch`. `Ok(false)`: it was not ours any more.
    pub async fn release(&self, p: u32, epoch: u64) -> Result<bool, LeaseError> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .timed(self.release.key(Self::lease_key(&self.prefix, p)).arg(self.value(epoch)).invoke_async(&mut conn))
            .await?;
        Ok(n == 1)
    }

    /// Releases partition `p`'s lease if this process holds it at any epoch. For an acquire that
    /// failed (timeout, connection error) and may still have run in Redis: this process then
    /// holds a lease it does not know the epoch of, and no worker uses it. Without the release,
    /// the partition's next desired owner would wait for its TTL. Only for a partition without
    /// a running worker of this process. `Ok(false)`: not held by this process.
    pub async fn release_any_epoch(&self, p: u32) -> Result<bool, LeaseError> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .timed(self.release_any_epoch.key(Self::lease_key(&self.prefix, p)).arg(&self.holder).invoke_async(&mut conn))
            .await?;
        Ok(n == 1)
    }

    /// Reads the lease values of partitions `0..partitions` (for `status`).
    pub async fn read_all(&self, partitions: u32) -> Result<Vec<Option<LeaseValue>>, LeaseError> {
        read_all(&mut self.conn.clone(), &self.prefix, partitions, self.timeout).await
    }
}

/// Reads the lease values of partitions `0..partitions`.
pub async fn read_all(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    prefix: &str,
    partitions: u32,
    timeout: Duration,
) -> Result<Vec<Option<LeaseValue>>, LeaseError> {
    let keys: Vec<String> = (0..partitions).map(|p| Leases::lease_key(prefix, p)).collect();
    let vals: Vec<Option<String>> = match tokio::time::timeout(timeout, redis::cmd("MGET").arg(&keys).query_async(conn)).await {
        Ok(r) => r?,
        Err(_) => return Err(LeaseError::Timeout(timeout)),
    };
    Ok(vals.into_iter().map(|v| v.as_deref().and_then(LeaseValue::parse)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_value_parses() {
        assert_eq!(
            LeaseValue::parse("host-1:ab12:7"),
            Some(LeaseValue { name: "host-1".into(), nonce: "ab12".into(), epoch: 7 })
        );
        assert_eq!(LeaseValue::parse("garbage"), None);
        assert_eq!(LeaseValue::parse("a:b:notanumber"), None);
    }

    const DEADLINE: Duration = Duration::from_secs(10);

    #[tokio::test(start_paused = true)]
    async fn clock_is_valid_until_the_deadline_only() {
        let clock = LeaseClock::new(Instant::now() + DEADLINE);
        assert!(clock.is_valid());
        tokio::time::advance(DEADLINE - Duration::from_millis(1)).await;
        assert!(clock.is_valid(), "valid 1 ms before the deadline");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!clock.is_valid(), "invalid at the deadline");
        tokio::time::advance(DEADLINE).await;
        assert!(!clock.is_valid(), "invalid after the deadline");
    }

    #[tokio::test(start_paused = true)]
    async fn renewal_moves_the_deadline_forward_only() {
        let start = Instant::now();
        let clock = LeaseClock::new(start + DEADLINE);
        tokio::time::advance(Duration::from_secs(6)).await;
        clock.extend_to(Instant::now() + DEADLINE); // a renewal sent at t = 6 s
        clock.extend_to(start + Duration::from_secs(1)); // a late answer to an older renewal
        assert_eq!(clock.deadline(), Some(start + Duration::from_secs(16)));
        tokio::time::advance(Duration::from_secs(9)).await; // t = 15 s: past the first deadline
        assert!(clock.is_valid());
        tokio::time::advance(Duration::from_secs(1)).await; // t = 16 s
        assert!(!clock.is_valid());
    }

    #[tokio::test(start_paused = true)]
    async fn invalidation_is_final() {
        let clock = LeaseClock::new(Instant::now() + DEADLINE);
        clock.invalidate();
        assert!(!clock.is_valid());
        clock.extend_to(Instant::now() + DEADLINE * 2);
        assert!(!clock.is_valid(), "a renewal must not revive an invalidated lease");
        assert_eq!(clock.deadline(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_completes_at_the_deadline_and_follows_renewals() {
        let start = Instant::now();
        let clock = std::sync::Arc::new(LeaseClock::new(start + DEADLINE));
        let renewer = clock.clone();
        let renewal = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(4)).await;
            renewer.extend_to(Instant::now() + DEADLINE); // deadline now t = 14 s
        });
        clock.expired().await;
        assert_eq!(Instant::now(), start + Duration::from_secs(14), "expired() completes exactly at the renewed deadline");
        renewal.await.unwrap();

        let clock = std::sync::Arc::new(LeaseClock::new(Instant::now() + DEADLINE));
        let t0 = Instant::now();
        let invalidator = clock.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            invalidator.invalidate();
        });
        clock.expired().await;
        let waited = Instant::now() - t0;
        assert!(waited >= Duration::from_millis(2500), "expired() before the invalidation: {waited:?}");
        assert!(waited <= Duration::from_millis(3500), "expired() notices an invalidation within a second: {waited:?}");
    }
}
