//! Membership: which instances are alive, from their heartbeats in Redis.
//!
//! # Data layout
//!
//! Keys (with `P` = `redis.key_prefix`):
//! - `P:members` — a sorted set of member names, each scored with the time its heartbeat expires:
//!   the Redis clock (`TIME`) of its last heartbeat plus that member's own `member_ttl`, in
//!   milliseconds. A member is live while its score is in `[now, +inf]`, read with
//!   `ZRANGEBYSCORE`; every heartbeat removes the expired entries (`ZREMRANGEBYSCORE -inf (now`).
//!   That is the rule Redis applies to a key's own expiry (expired once the clock is past it), so
//!   an entry and its nonce key below end at the same millisecond.
//!   Scoring by expiry rather than by heartbeat time keeps each member's own TTL, as a per-member
//!   key with a TTL would: a reader configured with another `member_ttl` (a rolling config
//!   change, or `status` run with a different config) sees the same members. The set itself
//!   expires when the last heartbeat of anyone does, so a cluster that is gone leaves nothing
//!   behind. Listing the members reads this one key, whatever the size of the keyspace (a `SCAN`
//!   over a shared Redis with millions of keys takes seconds).
//! - `P:member:{name}` = the boot nonce of the process heartbeating under `name`, expiring at the
//!   same absolute time as its entry in `P:members` (`SET … PXAT`, Redis ≥ 6.2). It tells two processes with the same name apart: a process that leaves removes
//!   the name only while the nonce is still its own, so a stopping process never removes its
//!   already-restarted successor; `status` shows the nonce.
//! - `P:member_llm_down:{name}` and `P:member_name_conflict:{name}`: flags set by a member's
//!   heartbeats ([`member_llm_down_key`], [`member_name_conflict_key`]).
//! - `P:member_routing:{name}`: the member's routing settings
//!   ([`crate::config::Settings::routing_fingerprint`]), expiring with its heartbeat; each
//!   heartbeat returns the live members whose line differs from its own ([`member_routing_key`]).
//! - `P:member_health:{name}`: the member's health line (readiness, LLM endpoints whose circuit
//!   is not closed), expiring with its heartbeat ([`member_health_key`]).
//!
//! Operations, each one atomic Lua script (one round trip, no interleaving,
//! <https://redis.io/docs/latest/develop/interact/programmability/eval-intro/>):
//! - heartbeat: set the nonce key, `ZADD` the name with its expiry (Redis time + `member_ttl`),
//!   drop expired names, and return the live names (sorted by bytes once read), and whether the name was listed
//!   before (a heartbeat that finds its own entry gone within `member_ttl` of the last one sees
//!   that Redis lost its data); it also records the partition count `P:partitions` where Redis
//!   holds none (see [`crate::topology::declare`]);
//! - leave: if the nonce key is ours (or gone), delete it and `ZREM` the name;
//! - list (for `status`): the live names, their nonces and flags, read only.

use std::sync::Arc;
use std::time::Duration;

use redis::Script;

use crate::lease::RedisConn;

/// Heartbeat: KEYS = [members, member, member's LLM-down flag, member's name-conflict flag,
/// member's routing settings, the deployment's partition count
/// ([`crate::topology::partition_count_key`]), the deployment's route
/// ([`crate::topology::partition_route_key`]), member's health ([`member_health_key`]), member's
/// LLM-unavailable flag ([`member_llm_unavailable_key`])],
/// ARGV = [name, nonce, member_ttl_ms, llm_down
/// ("1" or "0"), key prefix, name_conflict ("1" or "0"), name-conflict flag TTL ms, routing
/// settings ('' for none: neither stored nor compared), partition count ('' for none: not
/// recorded), route ('' for none: not recorded), health ('' for none: deleted), llm_unavailable ("1"
/// or "0")]. A name-conflict "1" sets that flag for
/// [`NAME_CONFLICT_FLAG_TTL`]; "0" leaves it to expire. The partition count and the route are
/// written only where none is recorded (`SET … NX`).
/// Returns `{names, previous, down, differs, listed, recorded, other_route, unavailable}`: the
/// live member names, in the member set's order (sorted by bytes once read: [`sorted`]);
/// the nonce the name's key held before when it was another process's (else `false`, read as
/// nil); the live members whose LLM-down flag is set; `name, settings` pairs (flat) of
/// the other live members whose routing settings differ; 1 when the member set held this name
/// before this heartbeat (`ZADD` added no new member), else 0; 1 when this heartbeat recorded the partition count, else 0;
/// the recorded route when it differs from this member's (else `false`); the live members whose
/// LLM-unavailable flag is set.
/// The flags and settings expire with the heartbeat.
const HEARTBEAT: &str = r#"
local prev = redis.call('GET', KEYS[2])
if prev == ARGV[2] then prev = false end
local recorded = 0
if ARGV[9] ~= '' and redis.call('SET', KEYS[6], ARGV[9], 'NX') then recorded = 1 end
local other_route = false
if ARGV[10] ~= '' then
  redis.call('SET', KEYS[7], ARGV[10], 'NX')
  local r = redis.call('GET', KEYS[7])
  if r and r ~= ARGV[10] then other_route = r end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local expiry = string.format('%d', now + ttl)
redis.call('SET', KEYS[2], ARGV[2], 'PXAT', expiry)
if ARGV[4] == '1' then
  redis.call('SET', KEYS[3], '1', 'PXAT', expiry)
else
  redis.call('DEL', KEYS[3])
end
if ARGV[12] == '1' then
  redis.call('SET', KEYS[9], '1', 'PXAT', expiry)
else
  redis.call('DEL', KEYS[9])
end
if ARGV[6] == '1' then
  redis.call('SET', KEYS[4], '1', 'PX', ARGV[7])
end
if ARGV[8] ~= '' then
  redis.call('SET', KEYS[5], ARGV[8], 'PXAT', expiry)
end
if ARGV[11] ~= '' then
  redis.call('SET', KEYS[8], ARGV[11], 'PXAT', expiry)
else
  redis.call('DEL', KEYS[8])
end
local listed = 1 - redis.call('ZADD', KEYS[1], expiry, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('(%d', now))
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
local names = redis.call('ZRANGEBYSCORE', KEYS[1], string.format('%d', now), '+inf')
local down = {}
local unavailable = {}
for _, n in ipairs(names) do
  if redis.call('EXISTS', ARGV[5] .. ':member_llm_down:' .. n) == 1 then
    table.insert(down, n)
  end
  if redis.call('EXISTS', ARGV[5] .. ':member_llm_unavailable:' .. n) == 1 then
    table.insert(unavailable, n)
  end
end
local differs = {}
if ARGV[8] ~= '' then
  for _, n in ipairs(names) do
    local r = redis.call('GET', ARGV[5] .. ':member_routing:' .. n)
    if n ~= ARGV[1] and r and r ~= ARGV[8] then
      table.insert(differs, n)
      table.insert(differs, r)
    end
  end
end
return {names, prev, down, differs, listed, recorded, other_route, unavailable}
"#;

/// Leave: KEYS = [members, member, member's LLM-down flag, member's name-conflict flag, member's
/// routing settings, member's draining mark, member's health, member's LLM-unavailable flag], ARGV = [name, nonce, draining ms ('0': none)].
/// With a draining time, sets the draining mark for that long; else deletes it. Returns 1 when
/// removed, 0 when the name belongs to another process now.
const LEAVE: &str = r#"
local cur = redis.call('GET', KEYS[2])
if cur and cur ~= ARGV[2] then
  return 0
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7], KEYS[8])
redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[3] ~= '0' then
  redis.call('SET', KEYS[6], ARGV[2], 'PX', ARGV[3])
else
  redis.call('DEL', KEYS[6])
end
return 1
"#;

/// List: KEYS = [members], ARGV = [prefix]. Returns `{names, nonces, down, conflicts, health,
/// unavailable}`, names in the member set's order, a missing nonce as nil, `down[i]` 1 when that member's LLM-down
/// flag is set, `unavailable[i]` 1 when its LLM-unavailable flag is,
/// `conflicts[i]` 1 when its name-conflict flag is, `health[i]` its health text ('' when it
/// published none). The nonce
/// and flag keys are built from the names inside the script, as the names are not known before
/// it runs.
const LIST: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local names = redis.call('ZRANGEBYSCORE', KEYS[1], string.format('%d', now), '+inf')
local nonces = {}
local down = {}
local conflicts = {}
local health = {}
local unavailable = {}
for i, n in ipairs(names) do
  nonces[i] = redis.call('GET', ARGV[1] .. ':member:' .. n)
  down[i] = redis.call('EXISTS', ARGV[1] .. ':member_llm_down:' .. n)
  conflicts[i] = redis.call('EXISTS', ARGV[1] .. ':member_name_conflict:' .. n)
  health[i] = redis.call('GET', ARGV[1] .. ':member_health:' .. n) or ''
  unavailable[i] = redis.call('EXISTS', ARGV[1] .. ':member_llm_unavailable:' .. n)
end
return {names, nonces, down, conflicts, health, unavailable}
"#;

/// Membership errors.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    /// Redis unreachable or answered with an error.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// No answer within `redis.command_timeout`.
    #[error("redis command timed out after {0:?}")]
    Timeout(Duration),
}

impl MembershipError {
    /// Whether Redis answered `READONLY` (a failover, [`crate::lease::is_failover`]).
    pub fn is_failover(&self) -> bool {
        matches!(self, MembershipError::Redis(e) if crate::lease::is_failover(e))
    }
}

/// Redis key of the member set (sorted set: name → heartbeat expiry, Redis time in ms).
pub fn members_key(prefix: &str) -> String {
    format!("{prefix}:members")
}

/// Redis key holding the boot nonce of the process heartbeating as `name`.
pub fn member_key(prefix: &str, name: &str) -> String {
    format!("{prefix}:member:{name}")
}

/// The Redis key of a member's LLM-down flag: set by its heartbeats while every LLM endpoint of
/// that instance has been down for `ownership.llm_down_hand_over_after`, with the heartbeat's
/// expiry. Built from the names inside the scripts too (`HEARTBEAT`, `LIST`).
pub fn member_llm_down_key(prefix: &str, name: &str) -> String {
    format!("{prefix}:member_llm_down:{name}")
}

/// The Redis key of a member's LLM-unavailable flag: set by its heartbeats while every LLM
/// endpoint of that instance is down now (however briefly), with the heartbeat's expiry. It
/// moves no partition by itself; it tells the others that this member could not serve the
/// partitions of a member flagged LLM-down either ([`assignable`]). Built from the names inside
/// the scripts too (`HEARTBEAT`, `LIST`).
pub fn member_llm_unavailable_key(prefix: &str, name: &str) -> String {
    format!("{prefix}:member_llm_unavailable:{name}")
}

/// The Redis key of a member's name-conflict flag: set by the heartbeats of a process that found
/// another live process heartbeating under its `instance.name`, for [`NAME_CONFLICT_FLAG_TTL`]
/// each time, so `status` can show it. Built from the names inside `LIST` too.
pub fn member_name_conflict_key(prefix: &str, name: &str) -> String {
    format!("{prefix}:member_name_conflict:{name}")
}

/// The Redis key of a member's routing settings
/// ([`crate::config::Settings::routing_fingerprint`]), set by its heartbeats with their expiry.
/// Built from the names inside `HEARTBEAT` too.
pub fn member_routing_key(prefix: &str, name: &str) -> String {
    format!("{prefix}:member_routing:{name}")
}

/// The Redis key of a member's health: one line of text its heartbeats set with their expiry
/// ([`Membership::set_health`]): its readiness (`ready`, or `not ready:` with the reasons of
/// `/readyz`) and the LLM endpoints whose circuit breaker is not closed, so `status` shows an
/// LLM outage or a broker's resource alarm per instance. Built from the names inside `LIST` too.
pub fn member_health_key(prefix: &str, name: &str) -> String {
    format!("{prefix}:member_health:{name}")
}

/// The Redis key of a member's draining mark: set when a stopping instance leaves the member
/// set while it still drains its partitions (the others take them over as it releases them),
/// for at most `shutdown.drain_timeout`, and deleted when it is done; `status` shows the leases
/// of such an instance as draining rather than as a crashed owner's.
pub fn member_draining_key(prefix: &str, name: &str) -> String {
    format!("{prefix}:member_draining:{name}")
}

/// How long a name conflict shows in `status` after the heartbeat that last found it: the
/// heartbeats flag it for the rest of this time ([`Membership::heartbeat_flagging`]).
pub const NAME_CONFLICT_FLAG_TTL: Duration = Duration::from_secs(60);

/// Longest health line a member publishes ([`Membership::set_health`]), in bytes.
pub const MAX_HEALTH_BYTES: usize = 1024;

/// The members that partitions are assigned to ([`crate::keying::assignment`]): the live
/// members whose LLM is not flagged down (`llm_down`), or all live members when no member's LLM
/// is up: every one is flagged down or unavailable now (`llm_unavailable`: every endpoint down,
/// not yet for `ownership.llm_down_hand_over_after`). Then no instance can serve, and moving
/// partitions would only return held requests to their queues; without the second list, the
/// first member flagged in an outage of every server handed its partitions to one flagged a
/// heartbeat later, which handed them back. `members`, `llm_down` and `llm_unavailable` are
/// sorted; so is the result.
pub fn assignable(members: &[String], llm_down: &[String], llm_unavailable: &[String]) -> Vec<String> {
    let up: Vec<String> = members.iter().filter(|m| llm_down.binary_search(m).is_err()).cloned().collect();
    if up.is_empty() || nobody_serves(members, llm_down, llm_unavailable) {
        members.to_vec()
    } else {
        up
    }
}

/// Whether no live member's LLM is up: each is flagged LLM-down or has every endpoint down now
/// (sorted lists, as for [`assignable`]). Then no partition moves between live members
/// (`ownership` holds its handovers), whatever the assignment says. False without members.
pub fn nobody_serves(members: &[String], llm_down: &[String], llm_unavailable: &[String]) -> bool {
    !members.is_empty() && members.iter().all(|m| llm_down.binary_search(m).is_ok() || llm_unavailable.binary_search(m).is_ok())
}

/// One live member, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Stable instance name.
    pub name: String,
    /// Boot nonce of the process heartbeating under that name; `None` if its key expired between
    /// the heartbeat and this read.
    pub nonce: Option<String>,
    /// Its LLM-down flag is set ([`member_llm_down_key`]).
    pub llm_down: bool,
    /// Its LLM-unavailable flag is set ([`member_llm_unavailable_key`]).
    pub llm_unavailable: bool,
    /// Another live process heartbeats under the same name ([`member_name_conflict_key`]).
    pub name_conflict: bool,
    /// Its health line ([`member_health_key`]); `None` when it published none (an instance of
    /// an older version).
    pub health: Option<String>,
}

/// What a heartbeat says of this member's LLM: `down`, every endpoint has been down for
/// `ownership.llm_down_hand_over_after` (its partitions move to members whose LLM is up);
/// `unavailable`, every endpoint is down now (implied by `down`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LlmFlags {
    pub down: bool,
    pub unavailable: bool,
}

/// What one heartbeat read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    /// The live member names, sorted by bytes.
    pub members: Vec<String>,
    /// The boot nonce that the name's key held before this heartbeat when it was not this
    /// process's: a previous process under the same name (restarted within `member_ttl`), or,
    /// when it comes back on later heartbeats, another live process using the same
    /// `instance.name`.
    pub previous_nonce: Option<String>,
    /// The live members whose LLM-down flag is set ([`member_llm_down_key`]), sorted by bytes.
    pub llm_down: Vec<String>,
    /// The live members whose LLM-unavailable flag is set ([`member_llm_unavailable_key`]),
    /// sorted by bytes.
    pub llm_unavailable: Vec<String>,
    /// The other live members whose routing settings differ from this process's, with theirs
    /// (empty when this process publishes none: [`Membership::with_routing`]).
    pub routing_differs: Vec<(String, String)>,
    /// Whether the member set held this name before this heartbeat (expired or not). `false`
    /// on a process's first heartbeat, and after Redis lost its data (`FLUSHALL`, a restart
    /// without persistence, a failover to a replica that lacked the entry) or dropped the entry
    /// of a member silent for longer than its `member_ttl`.
    pub was_listed: bool,
    /// Whether this heartbeat wrote the partition count because none was recorded (Redis lost
    /// it; [`Membership::with_partition_count`]).
    pub recorded_partition_count: bool,
    /// The route recorded in Redis when it differs from this member's
    /// ([`Membership::with_route`]): another instance runs, or ran, with other queue names.
    pub other_route: Option<String>,
}

/// The heartbeat of one process (`name` + boot `nonce`).
#[derive(Clone)]
pub struct Membership {
    conn: RedisConn,
    prefix: String,
    name: String,
    nonce: String,
    ttl: Duration,
    timeout: Duration,
    /// Routing settings published and compared by each heartbeat ('' = none).
    routing: String,
    /// Partition count recorded by each heartbeat where none is ('' = none).
    partitions: String,
    /// Route recorded by each heartbeat where none is ('' = none).
    route: String,
    /// Health line sent with each heartbeat ([`Self::set_health`]).
    health: Arc<std::sync::Mutex<String>>,
    heartbeat: Arc<Script>,
    leave: Arc<Script>,
}

impl Membership {
    /// `ttl` is `ownership.member_ttl`; `timeout` bounds every command (`redis.command_timeout`).
    pub fn new(conn: impl Into<RedisConn>, prefix: &str, name: &str, nonce: &str, ttl: Duration, timeout: Duration) -> Self {
        Membership {
            conn: conn.into(),
            prefix: prefix.to_owned(),
            name: name.to_owned(),
            nonce: nonce.to_owned(),
            ttl,
            timeout,
            routing: String::new(),
            partitions: String::new(),
            route: String::new(),
            health: Arc::new(std::sync::Mutex::new(String::new())),
            heartbeat: Arc::new(Script::new(HEARTBEAT)),
            leave: Arc::new(Script::new(LEAVE)),
        }
    }

    /// Publishes `routing` (this process's
    /// [`crate::config::Settings::routing_fingerprint`]) with each heartbeat and compares it
    /// with the other members' ([`Heartbeat::routing_differs`]).
    pub fn with_routing(mut self, routing: String) -> Self {
        self.routing = routing;
        self
    }

    /// Records `partitions` as the deployment's partition count with each heartbeat where Redis
    /// holds none ([`crate::topology::partition_count_key`], `SET … NX`), so that the startup
    /// check of a later instance ([`crate::topology::declare`]) still finds it after Redis lost
    /// its data. A recorded count is never overwritten.
    pub fn with_partition_count(mut self, partitions: u32) -> Self {
        self.partitions = partitions.to_string();
        self
    }

    /// Records `route` ([`crate::topology::partition_route`]) as the deployment's route with each
    /// heartbeat where Redis holds none ([`crate::topology::partition_route_key`], `SET … NX`),
    /// as [`Self::with_partition_count`] does for the count: after Redis lost its data, an
    /// instance started with other queue names would otherwise record its own and bind its
    /// queues next to the deployment's.
    pub fn with_route(mut self, route: String) -> Self {
        self.route = route;
        self
    }

    /// The health line the next heartbeats publish ([`member_health_key`]); an empty one
    /// deletes it. At most [`MAX_HEALTH_BYTES`] are kept (cut at a character boundary).
    pub fn set_health(&self, health: &str) {
        let mut end = health.len().min(MAX_HEALTH_BYTES);
        while !health.is_char_boundary(end) {
            end -= 1;
        }
        *self.health.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = health[..end].to_owned();
    }

    async fn timed<T>(&self, f: impl std::future::Future<Output = redis::RedisResult<T>>) -> Result<T, MembershipError> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(MembershipError::Timeout(self.timeout)),
        }
    }

    /// `PING`: whether Redis answers within the command timeout, without writing anything.
    pub async fn ping(&self) -> Result<(), MembershipError> {
        let mut conn = self.conn.clone();
        let _: String = self.timed(redis::cmd("PING").query_async(&mut conn)).await?;
        Ok(())
    }

    /// Announces this process for another `member_ttl`, with its LLM-down flag set or cleared
    /// (`llm_down`), and returns the live member names, sorted, with the nonce of another process
    /// that held the name until this heartbeat and the members whose LLM is down (one round trip).
    pub async fn heartbeat(&self, llm_down: bool) -> Result<Heartbeat, MembershipError> {
        self.heartbeat_flagging(LlmFlags { down: llm_down, unavailable: llm_down }, None).await
    }

    /// [`Self::heartbeat`], also setting this name's conflict flag ([`member_name_conflict_key`])
    /// for the given time when `name_conflict` is `Some` (the rest of
    /// [`NAME_CONFLICT_FLAG_TTL`] since the conflict was last found; at least 1 ms).
    pub async fn heartbeat_flagging(&self, llm: LlmFlags, name_conflict: Option<Duration>) -> Result<Heartbeat, MembershipError> {
        let mut conn = self.conn.clone();
        let mut call = self.heartbeat.prepare_invoke();
        call.key(members_key(&self.prefix))
            .key(member_key(&self.prefix, &self.name))
            .key(member_llm_down_key(&self.prefix, &self.name))
            .key(member_name_conflict_key(&self.prefix, &self.name))
            .key(member_routing_key(&self.prefix, &self.name))
            .key(crate::topology::partition_count_key(&self.prefix))
            .key(crate::topology::partition_route_key(&crate::topology::partition_count_key(&self.prefix)))
            .key(member_health_key(&self.prefix, &self.name))
            .key(member_llm_unavailable_key(&self.prefix, &self.name))
            .arg(&self.name)
            .arg(&self.nonce)
            .arg(self.ttl.as_millis() as u64)
            .arg(if llm.down { "1" } else { "0" })
            .arg(&self.prefix)
            .arg(if name_conflict.is_some() { "1" } else { "0" })
            .arg(name_conflict.map_or(1, |d| (d.as_millis() as u64).max(1)))
            .arg(&self.routing)
            .arg(&self.partitions)
            .arg(&self.route)
            .arg(self.health.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_str())
            .arg(if llm.unavailable || llm.down { "1" } else { "0" });
        let reply: HeartbeatReply = self.timed(call.invoke_async(&mut conn)).await?;
        Ok(Heartbeat::from_reply(reply))
    }

    /// Removes this process from the member set (and its draining mark). `Ok(false)`: the name
    /// now belongs to another process (a restarted instance), which stays.
    pub async fn leave(&self) -> Result<bool, MembershipError> {
        self.leave_marking(None).await
    }

    /// [`Self::leave`] at the start of a drain: also sets this name's draining mark
    /// ([`member_draining_key`]) for `drain` (at least 1 ms), until a later [`Self::leave`].
    pub async fn leave_draining(&self, drain: Duration) -> Result<bool, MembershipError> {
        self.leave_marking(Some(drain)).await
    }

    async fn leave_marking(&self, drain: Option<Duration>) -> Result<bool, MembershipError> {
        let mut conn = self.conn.clone();
        let mut call = self.leave.prepare_invoke();
        call.key(members_key(&self.prefix))
            .key(member_key(&self.prefix, &self.name))
            .key(member_llm_down_key(&self.prefix, &self.name))
            .key(member_name_conflict_key(&self.prefix, &self.name))
            .key(member_routing_key(&self.prefix, &self.name))
            .key(member_draining_key(&self.prefix, &self.name))
            .key(member_health_key(&self.prefix, &self.name))
            .key(member_llm_unavailable_key(&self.prefix, &self.name))
            .arg(&self.name)
            .arg(&self.nonce)
            .arg(drain.map_or(0, |d| (d.as_millis() as u64).max(1)));
        let n: i64 = self.timed(call.invoke_async(&mut conn)).await?;
        Ok(n == 1)
    }
}

/// What the `HEARTBEAT` script returns, in its order: names, previous nonce, LLM-down names,
/// differing `name, settings` pairs (flat), listed, recorded, other route, LLM-unavailable names.
type HeartbeatReply = (Vec<String>, Option<String>, Vec<String>, Vec<String>, i64, i64, Option<String>, Vec<String>);

impl Heartbeat {
    /// The heartbeat read from the script's reply, its name lists sorted by bytes ([`sorted`]).
    fn from_reply(reply: HeartbeatReply) -> Self {
        let (members, previous_nonce, llm_down, differs, listed, recorded, other_route, llm_unavailable) = reply;
        let mut routing_differs: Vec<(String, String)> = differs.chunks_exact(2).map(|p| (p[0].clone(), p[1].clone())).collect();
        routing_differs.sort_unstable();
        Heartbeat {
            members: sorted(members),
            previous_nonce,
            llm_down: sorted(llm_down),
            llm_unavailable: sorted(llm_unavailable),
            routing_differs,
            was_listed: listed == 1,
            recorded_partition_count: recorded == 1,
            other_route,
        }
    }
}

/// `names` sorted by their bytes. The scripts return names in the member set's order and leave
/// the sorting here: a Lua `table.sort` in Redis compares strings with `strcoll`, so in the
/// collation of the Redis server's locale (`LANG=en_US.UTF-8` puts `api-1` before `Web-1`), and
/// the binary searches of [`assignable`] need byte order.
fn sorted(mut names: Vec<String>) -> Vec<String> {
    names.sort_unstable();
    names
}

/// What the `LIST` script returns: one column per field of [`Member`] (names, nonces, LLM-down
/// flags, conflict flags, health, LLM-unavailable flags), each in the same order.
type MemberColumns = (Vec<String>, Vec<Option<String>>, Vec<i64>, Vec<i64>, Vec<String>, Vec<i64>);

/// The live members (sorted by name) with their nonces, read only (for `status`).
///
/// Errors: Redis unreachable or answering with an error.
pub async fn read_members(conn: &mut (impl redis::aio::ConnectionLike + Send), prefix: &str) -> Result<Vec<Member>, redis::RedisError> {
    let (names, nonces, down, conflicts, health, unavailable): MemberColumns = Script::new(LIST).key(members_key(prefix)).arg(prefix).invoke_async(conn).await?;
    let mut nonces = nonces.into_iter();
    let mut down = down.into_iter();
    let mut conflicts = conflicts.into_iter();
    let mut health = health.into_iter();
    let mut unavailable = unavailable.into_iter();
    let mut members: Vec<Member> = names
        .into_iter()
        .map(|name| Member {
            name,
            nonce: nonces.next().flatten(),
            llm_down: down.next() == Some(1),
            llm_unavailable: unavailable.next() == Some(1),
            name_conflict: conflicts.next() == Some(1),
            health: health.next().filter(|h| !h.is_empty()),
        })
        .collect();
    // By bytes, as `sorted`: `status` computes the assignment from these lists.
    members.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn partitions_go_to_the_members_whose_llm_is_up_unless_none_is() {
        let members = names(&["a", "b", "c"]);
        assert_eq!(assignable(&members, &[], &[]), members);
        assert_eq!(assignable(&members, &names(&["b"]), &names(&["b"])), names(&["a", "c"]));
        assert_eq!(assignable(&members, &names(&["a", "c"]), &names(&["a", "c"])), names(&["b"]));
        assert_eq!(assignable(&members, &members, &members), members, "all down: nobody could serve, nothing moves");
        // A flag of a name that is no longer a member changes nothing.
        assert_eq!(assignable(&names(&["a"]), &names(&["z"]), &[]), names(&["a"]));
        assert!(assignable(&[], &[], &[]).is_empty());
        // Observed: every server down, `a` flagged first; `b` and `c` not yet flagged but down
        // too: nobody could serve a's partitions, so nothing moves.
        assert_eq!(assignable(&members, &names(&["a"]), &names(&["a", "b", "c"])), members);
        // One member still up: a flagged member's partitions go to the unflagged ones (a member
        // down for a moment keeps its own, as ever).
        assert_eq!(assignable(&members, &names(&["a"]), &names(&["a", "b"])), names(&["b", "c"]));
        // An unavailable member alone moves nothing.
        assert_eq!(assignable(&members, &[], &names(&["b"])), members);
    }

    /// Reported: a Redis server in an `en_US.UTF-8` locale sorts with `strcoll` inside Lua, so
    /// `api-1` came before `Web-1`; the binary searches then missed `api-1`, and with every
    /// server down `Web-1`'s partitions were handed to `api-1`, which could not serve them
    /// either. The heartbeat's lists are sorted by bytes once read, whatever order Redis used.
    #[test]
    fn a_heartbeat_sorts_its_names_by_bytes_whatever_the_redis_locale() {
        let locale_order = names(&["api-1", "Web-1"]);
        let reply = (locale_order.clone(), None, names(&["Web-1"]), vec![], 1, 0, None, locale_order.clone());
        let beat = Heartbeat::from_reply(reply);
        assert_eq!(beat.members, names(&["Web-1", "api-1"]));
        assert_eq!(beat.llm_unavailable, names(&["Web-1", "api-1"]));
        assert!(nobody_serves(&beat.members, &beat.llm_down, &beat.llm_unavailable), "every member is down or unavailable");
        assert_eq!(assignable(&beat.members, &beat.llm_down, &beat.llm_unavailable), beat.members, "nothing moves");
        // The lists as Redis sent them: the search misses `api-1`, and Web-1's partitions move.
        assert!(!nobody_serves(&beat.members, &beat.llm_down, &locale_order));
    }
}
