//! Intake-loss reports: which input messages a router may have forwarded when it lost its
//! consumer of the input queue, shared through Redis with the routers of the other instances.
//!
//! When a router's intake channel or connection closes, or the router stops, the broker delivers
//! every message that router took and did not ack again, to any router. For a message whose
//! forward the broker confirmed and whose ack was lost, that redelivery is a copy: the request is
//! in a partition queue already, and the router forwards it marked
//! ([`crate::redelivery::HEADER_INPUT_REDELIVERED`]) so that the partition's owner answers it
//! once. For a message that only waited in the router's prefetch window, the redelivery is the
//! one delivery to answer. Only the router that lost its intake knows which is which. When the
//! message is alike to one the partition took within [`crate::redelivery::SECOND_COPY_WINDOW`]
//! (a publisher that sent the same message again: the same id, body and properties), a marked
//! forward of it is dropped, and the request gets no answer.
//!
//! So a router that loses its intake, or stops, records at once ([`IntakeReports::report`]) the
//! input keys ([`crate::redelivery::input_key`]) of the messages it may have forwarded
//! ([`crate::redelivery::maybe_forwarded`]), and the time of its report. A router that gets a
//! redelivered message it knows nothing of asks ([`IntakeReports::lookup`]):
//! - its key was reported: [`Elsewhere::Forwarded`], forwarded marked, as before;
//! - a report came in the last [`REPORT_RECENT`] without its key: [`Elsewhere::NotForwarded`],
//!   the router that reported did not forward it, and it goes unmarked, as a new message;
//! - no recent report within [`REPORT_WAIT`] (the router that had it crashed, or could not reach
//!   Redis), or Redis did not answer: [`Elsewhere::Unknown`], forwarded marked, as before. After
//!   such a wait, or a Redis that did not answer, the instance's look-ups ask without waiting
//!   for [`REPORT_RECENT`].
//!
//! A router that forwarded a message alike to the redelivered one itself, and saw that ack reach
//! the broker, asks too: the redelivery is then a message published again, forwarded unmarked,
//! unless another router reported it (the copy of that router's forward, forwarded marked).
//!
//! A wrong answer costs at most a duplicate, never a request: `NotForwarded` for a message that a
//! crashed router had forwarded while another router reported a loss of its own. Reports are
//! written and read on a path that only intake losses, stops and redeliveries take; routing never
//! waits on Redis for a first delivery.
//!
//! # Data layout
//!
//! Keys (with `P` = `redis.key_prefix`):
//! - `P:intake_losses`: a sorted set of instance names, each scored with the Redis clock (`TIME`,
//!   milliseconds) of its last report; entries older than [`REPORT_TTL`] are removed by every
//!   report, and the set expires [`REPORT_TTL`] after the last one;
//! - `P:maybe_forwarded:{key}`: `1`, for [`REPORT_TTL`], per reported input key (32 hex digits).
//!
//! Both operations are one Lua script each (one round trip, atomic).

use std::sync::Arc;
use std::time::Duration;

use redis::Script;

use crate::lease::RedisConn;

/// How long a report is kept: 30 s, [`crate::redelivery::REDELIVERY_WINDOW`].
pub const REPORT_TTL: Duration = crate::redelivery::REDELIVERY_WINDOW;

/// How recent a report must be to tell about a redelivery: 10 s,
/// [`crate::redelivery::SECOND_COPY_WINDOW`]. The broker gives a router's unacked messages back
/// when its channel closes, and another router takes them within milliseconds, or as soon as its
/// prefetch window has room. A marked forward reaching the partition later than that window after
/// the message alike to it is answered anyway.
pub const REPORT_RECENT: Duration = crate::redelivery::SECOND_COPY_WINDOW;

/// How long [`IntakeReports::lookup`] waits for a recent report: 2 s. The router that lost its
/// intake reports when its consumer ends, which can be a moment after the broker gave its
/// messages to another router (lapin notices a closed connection within about 1 s).
pub const REPORT_WAIT: Duration = Duration::from_secs(2);

/// How long a look-up that does not wait (see [`IntakeReports::lookup`]) waits for Redis's
/// answer: 250 ms.
const QUIET_LOOKUP_TIMEOUT: Duration = Duration::from_millis(250);

/// How often [`IntakeReports::lookup`] asks again while it waits: every 100 ms.
const LOOKUP_INTERVAL: Duration = Duration::from_millis(100);

/// Report: KEYS = [the losses set, then one `maybe_forwarded` key per input key],
/// ARGV = [instance name, [`REPORT_TTL`] in ms]. Returns the report's time (Redis clock, ms).
const REPORT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], '1', 'PX', ttl)
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - ttl))
redis.call('PEXPIRE', KEYS[1], ttl)
return now
"#;

/// Look-up: KEYS = [the losses set, the message's `maybe_forwarded` key], ARGV = [[`REPORT_RECENT`]
/// in ms]. Returns 2 when the key was reported, else 1 when a report is that recent, else 0.
const LOOKUP: &str = r#"
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local recent = redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf', 'LIMIT', 0, 1)
if #recent > 0 then return 1 end
return 0
"#;

/// What the reports in Redis say of a redelivered input message ([`IntakeReports::lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elsewhere {
    /// A router that lost its intake reported that it may have forwarded it: the redelivery may
    /// be a copy.
    Forwarded,
    /// A router reported a loss in the last [`REPORT_RECENT`] without it: not forwarded.
    NotForwarded,
    /// No recent report, or Redis did not answer.
    Unknown,
}

/// The intake-loss reports of one instance (see the module documentation). Cheap to clone.
#[derive(Clone)]
pub struct IntakeReports {
    conn: RedisConn,
    prefix: String,
    instance: String,
    /// Bounds every command (`redis.command_timeout`).
    timeout: Duration,
    report: Arc<Script>,
    lookup: Arc<Script>,
    /// When a look-up last waited [`REPORT_WAIT`] in vain, if it did within [`REPORT_RECENT`]:
    /// the look-ups until then ask once, without waiting (see [`IntakeReports::lookup`]).
    waited_in_vain: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
}

/// The sorted set of reports under `prefix`.
pub fn losses_key(prefix: &str) -> String {
    format!("{prefix}:intake_losses")
}

/// The key recording that input key `key` was reported under `prefix`.
pub fn maybe_forwarded_key(prefix: &str, key: u128) -> String {
    format!("{prefix}:maybe_forwarded:{key:032x}")
}

impl IntakeReports {
    /// Reports of `instance` under `prefix` (`redis.key_prefix`), each command bounded by `timeout`.
    pub fn new(conn: impl Into<RedisConn>, prefix: &str, instance: &str, timeout: Duration) -> Self {
        IntakeReports {
            conn: conn.into(),
            prefix: prefix.to_owned(),
            instance: instance.to_owned(),
            timeout,
            report: Arc::new(Script::new(REPORT)),
            lookup: Arc::new(Script::new(LOOKUP)),
            waited_in_vain: Arc::default(),
        }
    }

    /// Records that this instance lost its intake (or stopped) and may have forwarded the input
    /// messages with `keys`. Errors: Redis's, or a timeout after `redis.command_timeout`.
    pub async fn report(&self, keys: &[u128]) -> redis::RedisResult<()> {
        let mut call = self.report.prepare_invoke();
        call.key(losses_key(&self.prefix));
        for &k in keys {
            call.key(maybe_forwarded_key(&self.prefix, k));
        }
        call.arg(&self.instance).arg(REPORT_TTL.as_millis() as u64);
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.timeout, call.invoke_async::<i64>(&mut conn)).await {
            Ok(r) => r.map(|_| ()),
            Err(_) => Err(timeout_error()),
        }
    }

    /// What the reports say of the redelivered input message with `key`, waiting up to
    /// [`REPORT_WAIT`] for a recent report. Redis's errors and timeouts give
    /// [`Elsewhere::Unknown`]. Once a look-up of this instance waited in vain (redeliveries
    /// that no router reports: a crash, a requeue), the look-ups of the next [`REPORT_RECENT`]
    /// ask once without waiting, so that a backlog of such redeliveries, taken one at a time
    /// after an intake loss, does not wait [`REPORT_WAIT`] each.
    pub async fn lookup(&self, key: u128) -> Elsewhere {
        let start = tokio::time::Instant::now();
        let quiet = self.waited_in_vain.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_some_and(|at| start < at + REPORT_RECENT);
        let deadline = if quiet { start } else { start + REPORT_WAIT };
        loop {
            let mut call = self.lookup.prepare_invoke();
            call.key(losses_key(&self.prefix)).key(maybe_forwarded_key(&self.prefix, key)).arg(REPORT_RECENT.as_millis() as u64);
            let mut conn = self.conn.clone();
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let answer = tokio::time::timeout(self.timeout.min(left.max(QUIET_LOOKUP_TIMEOUT)), call.invoke_async::<i64>(&mut conn)).await;
            // A wait in vain, or a Redis that does not answer: the next look-ups do not wait.
            let in_vain = || {
                if !quiet {
                    *self.waited_in_vain.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(tokio::time::Instant::now());
                }
                Elsewhere::Unknown
            };
            match answer {
                Ok(Ok(found @ (1 | 2))) => {
                    *self.waited_in_vain.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
                    return if found == 2 { Elsewhere::Forwarded } else { Elsewhere::NotForwarded };
                }
                Ok(Ok(_)) if tokio::time::Instant::now() + LOOKUP_INTERVAL < deadline => tokio::time::sleep(LOOKUP_INTERVAL).await,
                Ok(Ok(_)) => return in_vain(),
                Ok(Err(e)) => {
                    self.conn.report(&e);
                    return in_vain();
                }
                Err(_) => return in_vain(),
            }
        }
    }
}

fn timeout_error() -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer within redis.command_timeout"))
}
