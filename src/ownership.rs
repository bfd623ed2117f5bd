//! Partition assignment and the lifecycle of owned partitions.
//!
//! Every tick (at most 500 ms, at most a third of `renew_interval`, and at once when a partition
//! worker ends) an instance runs one round of named steps:
//! 1. membership refresh: heartbeats and reads the live members ([`crate::membership`]); after
//!    a failed heartbeat, only once Redis answers a `PING` within `redis.command_timeout`;
//! 2. assignment: the desired owner of each partition by rendezvous hashing with bounded loads
//!    over the member names ([`crate::keying::assignment`]); over those whose LLM is up when
//!    some are flagged down ([`crate::membership::assignable`]; an instance flags itself when
//!    every LLM endpoint of its own has been down for `ownership.llm_down_hand_over_after`, so
//!    a dead or misconfigured server does not hold its share of the keys): every instance agrees without a
//!    coordinator, each member gets ⌊P/M⌋ or ⌈P/M⌉ partitions, few partitions move when a member joins or leaves, and a
//!    restarted instance with the same name gets the same partitions back;
//! 3. renewals: renews its leases every `renew_interval` ([`crate::lease`]), all in one concurrent
//!    round of commands (pipelined on the one multiplexed Redis connection); a partition whose lease is gone
//!    (compare failed) or whose renew deadline passed (Redis unreachable) is aborted at once (the
//!    worker also stops by itself at that deadline, see [`crate::lease::LeaseClock`]);
//! 4. releases and handovers: releases the leases of partitions whose worker ended, and hands over
//!    partitions it should no longer own — only once the membership view has been
//!    stable for `settle_time`, so a rolling restart does not thrash — by draining them (flush,
//!    finish, ack) and then releasing the lease (revoke before assign);
//! 5. acquisitions: acquires (concurrently) the free leases of partitions it is the desired owner
//!    of, and starts their workers.
//!    Acquiring a *free* lease does not wait for the view to settle: nobody is working on that
//!    partition, so waiting would only add latency to a takeover. The exception is an instance
//!    that was blind (just started, or Redis unreachable for longer than `member_ttl`): it waits
//!    `settle_time` after its first successful heartbeat, so that after a Redis outage (member
//!    keys expired or lost) the first instance back does not take every partition.
//!
//! A Redis failover (a `READONLY` answer from a demoted primary or, with Redis Sentinel, a lost
//! primary) is followed by the shared connection itself ([`crate::lease::RedisConn`]): the
//! commands that failed are retried by the next round on the new primary.
//!
//! Every partition's drain token is a child of the shutdown token [`Ownership::run`] receives,
//! so cancelling it drains every partition. Its revoke and abort tokens are per partition: they
//! must not fire on a graceful shutdown (an abort drops in-flight work).
//!
//! On shutdown it first leaves the member set (so the others compute the new assignment while
//! it drains), stops acquiring, drains every partition (still renewing meanwhile) and releases
//! each lease the moment its partition is drained, so successors take over at once instead of
//! waiting out the TTL.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::amqp::Connections;
use crate::breaker::BreakerState;
use crate::config::Settings;
use crate::keying::desired_partitions;
use crate::lease::{Acquire, LeaseClock, LeaseValue, Leases, RedisConn};
use crate::llm::LlmClient;
use crate::membership::Membership;
use crate::metrics;
use crate::partition::{self, PartitionContext, StopSignals};
use crate::readiness::{ReadyState, Readiness};

/// The heartbeat's finding that Redis records other queue names than this instance's: an
/// operator must act, and each heartbeat finds it again.
static OTHER_ROUTE_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// How often a continuing instance-name conflict is logged ([`Ownership::note_name_conflict`]).
const NAME_CONFLICT_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Ownership errors that end a session.
#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    /// The AMQP connection failed; the session must reconnect.
    #[error("amqp connection lost")]
    ConnectionLost,
}

struct Owned {
    epoch: u64,
    clock: Arc<LeaseClock>,
    stop: StopSignals,
    task: JoinHandle<Result<(), lapin::Error>>,
    /// Send time of the last successful acquire/renew.
    renewed_at: Instant,
    handing_over: bool,
}

/// Least time between two `WARN` lines of one lasting condition (failing heartbeats, members
/// with other routing settings).
const REPEAT_WARNING_EVERY: Duration = Duration::from_secs(60);

/// The ownership manager of one session (one AMQP connection).
pub struct Ownership {
    settings: Arc<Settings>,
    /// The session's checks of direct reply-to nodes, for its partitions ([`crate::reply_node`]).
    reply_nodes: Arc<crate::reply_node::NodeCheck>,
    membership: Membership,
    leases: Leases,
    llm: LlmClient,
    owned: BTreeMap<u32, Owned>,
    /// Workers aborted and still putting their requests back ([`crate::partition`], `abort`):
    /// their `closing` tokens and tasks. A stop waits for them, so that closing the connections
    /// cuts no copy between its confirm and its original's ack; a hard stop fires `closing`.
    aborting: Vec<(CancellationToken, JoinHandle<Result<(), lapin::Error>>)>,
    view: Vec<String>,
    view_since: Instant,
    /// At the last heartbeat, no member's LLM was up (each flagged LLM-down or with every
    /// endpoint down now): partitions stay where they are ([`Self::hand_over`]).
    nobody_serves: bool,
    last_renew_round: Option<Instant>,
    /// Signalled by every partition worker when it ends, so a drained partition's lease is
    /// released at once instead of at the next tick (this is most of a SIGTERM handoff's speed).
    worker_done: Arc<Notify>,
    /// This instance left the member set at the start of the shutdown.
    left: bool,
    /// When the last heartbeat succeeded.
    last_heartbeat: Option<Instant>,
    /// While heartbeats fail: when that was last logged at `WARN` (once a minute, not at every
    /// attempt of the outage).
    heartbeat_failure_logged: Option<Instant>,
    /// When a name conflict was last logged ([`Ownership::note_name_conflict`]).
    name_conflict_logged: Option<Instant>,
    /// When a heartbeat last found another live process under this instance's name.
    name_conflict_seen: Option<Instant>,
    /// When members with other routing settings were last logged (see `note_routing_differs`),
    /// and which (name, settings) that was.
    routing_differs_logged: Option<(Instant, Vec<(String, String)>)>,
    /// Set when a heartbeat succeeds after a blind period (start, Redis outage); acquisitions
    /// wait until `settle_time` after it.
    rejoined_at: Option<Instant>,
    /// `batching.max_buffered_bytes`, shared by every partition worker of this instance.
    buffer_budget: partition::BufferBudget,
    /// This process's boot nonce.
    nonce: String,
    /// Partitions whose lease was found held by this instance's previous process, logged once
    /// each ([`Ownership::note_previous_holder`]).
    waiting_on_previous: std::collections::BTreeSet<u32>,
    /// The LLM-down flag of the last heartbeat ([`Ownership::llm_down`]).
    flagged_llm_down: bool,
    /// This process's readiness, published in the member's health line ([`health_line`]).
    readiness: Readiness,
    /// Each link's client certificate expiry (Unix seconds), read once: the files are read only
    /// at startup. Noted in the health line from 14 days before.
    client_certificates: Vec<(&'static str, i64)>,
}

/// A member's health line ([`crate::membership::member_health_key`]), as `status` shows it:
/// its readiness as `/readyz` says it (`ready`, or `not ready: ` and the reasons), then, when
/// any LLM endpoint's circuit breaker is not closed, how many of its endpoints are down and
/// which (credential-free URL and breaker state), e.g.
/// `ready; 1 of 2 LLM endpoints down: http://10.0.0.7:8000/v1 (open)`; then, for each link
/// whose client certificate (`(link, expiry in Unix seconds)` in `client_certificates`) expires
/// within 14 days of `now`, a note ([`crate::tls::expiry_note`]), e.g.
/// `ready; redis client certificate expires in 6 days`. Between the two, when the broker does
/// not take its results or forwards (`held`: `(results, forwards)` held now,
/// [`metrics::held_publishes`]): `3 results held: the broker does not take them`.
pub fn health_line(readiness: &ReadyState, endpoints: &[(&str, BreakerState)], held: (u64, u64), other_consumer: &[u32], client_certificates: &[(&str, i64)], now: i64) -> String {
    let mut line = readiness.to_string();
    let down: Vec<String> =
        endpoints.iter().filter(|(_, s)| *s != BreakerState::Closed).map(|(name, s)| format!("{name} ({})", s.as_str())).collect();
    if !down.is_empty() {
        line.push_str(&format!("; {} of {} LLM endpoints down: {}", down.len(), endpoints.len(), down.join(", ")));
    }
    let counted = |n: u64, what: &str| (n > 0).then(|| format!("{n} {what}{}", if n == 1 { "" } else { "s" }));
    let held: Vec<String> = [counted(held.0, "result"), counted(held.1, "forward")].into_iter().flatten().collect();
    if !held.is_empty() {
        line.push_str(&format!("; {} held: the broker does not take them", held.join(" and ")));
    }
    if !other_consumer.is_empty() {
        let list: Vec<String> = other_consumer.iter().map(u32::to_string).collect();
        line.push_str(&format!(
            "; another consumer is active on the queue of partition {}: another deployment with the same queue names or a stray client (rabbitmqctl list_consumers)",
            list.join(", ")
        ));
    }
    for note in client_certificates.iter().filter_map(|(link, at)| crate::tls::expiry_note(link, *at, now)) {
        line.push_str("; ");
        line.push_str(&note);
    }
    line
}

/// Start of a health line as published ([`with_version`]).
const VERSION_LEAD: &str = "version ";

/// `line` as a member publishes it ([`crate::membership::member_health_key`]): led by the
/// process's version (`version 0.1.0+<commit>; ready…`), so that `status` shows which instance
/// runs which build during a rolling upgrade ([`split_version`]).
pub fn with_version(line: &str) -> String {
    format!("{VERSION_LEAD}{}; {line}", crate::VERSION)
}

/// A published health line split into the version it leads with ([`with_version`]; `None` from
/// an instance that publishes none) and the rest.
pub fn split_version(published: &str) -> (Option<&str>, &str) {
    match published.strip_prefix(VERSION_LEAD).and_then(|rest| rest.split_once("; ")) {
        Some((version, rest)) if !version.contains(' ') => (Some(version), rest),
        _ => (None, published),
    }
}

impl Ownership {
    /// `nonce` is this process's boot nonce.
    pub fn new(settings: Arc<Settings>, redis: RedisConn, nonce: String, llm: LlmClient, readiness: Readiness, reply_nodes: Arc<crate::reply_node::NodeCheck>) -> Self {
        let holder = format!("{}:{}", settings.instance_name, nonce);
        let (prefix, timeout) = (&settings.redis.key_prefix, settings.redis.command_timeout);
        let leases = Leases::new(redis.clone(), prefix, holder, settings.ownership.lease_ttl, timeout);
        let membership = Membership::new(redis, prefix, &settings.instance_name, &nonce, settings.ownership.member_ttl, timeout).with_routing(settings.routing_fingerprint())
            .with_partition_count(settings.amqp.partitions.get())
            .with_route(crate::topology::partition_route(&settings.amqp));
        let client_certificates =
            settings.tls_links().into_iter().filter_map(|(link, f)| Some((link, f.client.as_ref()?.expires_at?))).collect();
        Ownership {
            reply_nodes,
            client_certificates,
            buffer_budget: partition::BufferBudget::new(&settings),
            settings,
            membership,
            leases,
            llm,
            owned: BTreeMap::new(),
            aborting: Vec::new(),
            view: Vec::new(),
            view_since: Instant::now(),
            nobody_serves: false,
            last_renew_round: None,
            worker_done: Arc::new(Notify::new()),
            left: false,
            last_heartbeat: None,
            heartbeat_failure_logged: None,
            name_conflict_logged: None,
            name_conflict_seen: None,
            routing_differs_logged: None,
            rejoined_at: None,
            nonce,
            waiting_on_previous: Default::default(),
            flagged_llm_down: false,
            readiness,
        }
    }

    fn tick_interval(&self) -> Duration {
        (self.settings.ownership.renew_interval / 3).min(Duration::from_millis(500)).max(Duration::from_millis(50))
    }

    /// Runs until `shutdown` fires and every partition is drained and released, or until the
    /// connection fails. `on_redis` reports whether the membership heartbeat reaches Redis:
    /// first `true` after the first round that reached it (the instance can be ready), then each
    /// change (`false` during a Redis outage, `true` when it is back). Not called while stopping.
    /// Every partition's drain token is a child of `shutdown`.
    pub async fn run(
        &mut self,
        conns: Connections,
        shutdown: CancellationToken,
        mut on_redis: impl FnMut(bool),
    ) -> Result<(), OwnershipError> {
        let mut reported: Option<bool> = None;
        let mut tick = tokio::time::interval(self.tick_interval());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let worker_done = self.worker_done.clone();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = worker_done.notified() => {}
                _ = shutdown.cancelled(), if !self.left || !self.owned.values().all(|o| o.stop.drain.is_cancelled()) => {}
            }
            let stopping = shutdown.is_cancelled();
            if !conns.connected() {
                self.abort_all();
                return Err(OwnershipError::ConnectionLost);
            }
            let redis_ok = self.round(&conns, &shutdown).await;
            // Ready only with a working Redis: the first round that reaches it is reported, then
            // every change, so `/readyz` follows the heartbeat (503 during a Redis outage).
            if !stopping && reported != Some(redis_ok) && (reported.is_some() || redis_ok) {
                reported = Some(redis_ok);
                on_redis(redis_ok);
            }
            self.aborting.retain(|(_, task)| !task.is_finished());
            if stopping && self.owned.is_empty() && self.aborting.is_empty() {
                self.leave(None).await;
                return Ok(());
            }
        }
    }

    /// One ownership round; returns whether the membership heartbeat reached Redis.
    async fn round(&mut self, conns: &Connections, shutdown: &CancellationToken) -> bool {
        let stopping = shutdown.is_cancelled();
        // Shutdown: leave the member set first, so the others compute the new assignment (and
        // start polling for the leases) while this instance drains.
        if stopping && !self.left {
            self.left = true;
            self.leave(Some(self.settings.drain_timeout)).await;
        }
        let members = if stopping { None } else { self.refresh_membership().await };
        self.renew_leases().await;
        self.abort_expired();
        self.release_finished().await;
        let desired = self.desired(stopping);
        self.hand_over(&desired, stopping, members.is_some());
        if !stopping && members.is_some() && self.settled_after_rejoin() {
            self.acquire_desired(conns, &desired, shutdown).await;
        }
        metrics::partitions_owned(self.owned.len());
        members.is_some()
    }

    /// Members whose routing settings differ from this instance's route a key to other
    /// partitions than this instance's router does: its requests are batched apart and prefilled
    /// on several servers. Normal for the minutes of a rolling configuration change; a warning
    /// when the set of differing members changes and once a minute while it lasts, a line when
    /// it ends, and `members_routing_differs`.
    fn note_routing_differs(&mut self, differs: &[(String, String)]) {
        metrics::members_routing_differs(differs.len());
        if differs.is_empty() {
            if self.routing_differs_logged.take().is_some() {
                info!("every live member runs with this instance's keying, sharding and request settings again");
            }
            return;
        }
        let due = match &self.routing_differs_logged {
            Some((at, seen)) => seen.as_slice() != differs || at.elapsed() >= REPEAT_WARNING_EVERY,
            None => true,
        };
        if due {
            let others: Vec<String> = differs.iter().map(|(n, r)| format!("{n}: {r}")).collect();
            warn!(this_instance = %self.settings.routing_fingerprint(), others = ?others, "live members run with other keying, sharding or request settings: a key goes to other partitions, or a request is refused by some instances and answered by others, depending on which instance takes it (expected only during a rolling configuration change)");
            self.routing_differs_logged = Some((Instant::now(), differs.to_vec()));
        }
    }

    /// Step 1, membership refresh: heartbeat and read the live members (`None` when Redis did not
    /// answer). Updates the view and the blind/rejoin state.
    async fn refresh_membership(&mut self) -> Option<Vec<String>> {
        let llm_down = self.llm_down();
        // Flagged until NAME_CONFLICT_FLAG_TTL after the conflict was last found, not after each
        // heartbeat that flags it.
        let conflict = self
            .name_conflict_seen
            .and_then(|t| crate::membership::NAME_CONFLICT_FLAG_TTL.checked_sub(t.elapsed()))
            .filter(|left| !left.is_zero());
        let endpoints: Vec<(&str, BreakerState)> = (0..self.llm.endpoint_count())
            .filter_map(|i| Some((self.llm.endpoint_name(i)?, self.llm.breaker_state(i)?)))
            .collect();
        let held = metrics::held_publishes();
        let others = crate::partition::other_consumer_partitions(2 * crate::partition::stall_window(&self.settings));
        self.membership.set_health(&with_version(&health_line(&self.readiness.state(), &endpoints, held, &others, &self.client_certificates, crate::tls::unix_now())));
        let flags = crate::membership::LlmFlags { down: llm_down, unavailable: self.llm.all_down_for().is_some() };
        // After a failed heartbeat, the next one goes only once a `PING` is answered within
        // `redis.command_timeout`. A heartbeat that timed out here may still have reached Redis
        // and renewed this instance's membership: over a link slower than the timeout, each one
        // would keep it a live member, and the desired owner of its partitions, while none of
        // its lease commands is answered in time, so nobody would serve those partitions
        // (observed: 2 of 6 partitions unserved for the whole 46 s of a link with 1.1 s round
        // trips, `command_timeout` 1 s). Without heartbeats its entry expires after
        // `member_ttl` and the other members take its share.
        if self.heartbeat_failure_logged.is_some() {
            if let Err(e) = self.membership.ping().await {
                debug!(error = %e, "Redis did not answer a PING in time; no heartbeat this round");
                return None;
            }
        }
        let beat = match self.membership.heartbeat_flagging(flags, conflict).await {
            Ok(b) => b,
            Err(e) => {
                let failing_s = self.last_heartbeat.map(|t| t.elapsed().as_secs());
                if self.heartbeat_failure_logged.is_none_or(|t| t.elapsed() >= REPEAT_WARNING_EVERY) {
                    self.heartbeat_failure_logged = Some(Instant::now());
                    warn!(error = %e, since_last_success_s = failing_s, "membership heartbeat failed (Redis); retrying every renew_interval, logged once a minute");
                } else {
                    debug!(error = %e, since_last_success_s = failing_s, "membership heartbeat failed (Redis)");
                }
                return None;
            }
        };
        if self.heartbeat_failure_logged.take().is_some() {
            info!(since_last_success_s = self.last_heartbeat.map(|t| t.elapsed().as_secs()), "membership heartbeat succeeded again");
        }
        self.note_name_conflict(beat.previous_nonce.as_deref());
        let members = crate::membership::assignable(&beat.members, &beat.llm_down, &beat.llm_unavailable);
        self.nobody_serves = crate::membership::nobody_serves(&beat.members, &beat.llm_down, &beat.llm_unavailable);
        self.note_llm_down(llm_down, members.contains(&self.settings.instance_name));
        let s = &self.settings.ownership;
        // Blind until now (first heartbeat of this session, or Redis was unreachable for longer
        // than member_ttl, so every heartbeat may have expired or been lost with Redis's data):
        // the others may not have re-announced themselves yet. Wait for the view to settle
        // before acquiring, or the first instance back takes every partition and then hands most
        // of them over again.
        if self.last_heartbeat.is_none_or(|t| t.elapsed() >= s.member_ttl) {
            self.rejoined_at = Some(Instant::now());
        } else if !beat.was_listed {
            // Heartbeating all along, yet the entry is gone: Redis lost its data (FLUSHALL, a
            // restart without persistence, a failover to a replica that lacked it). Every
            // member's entry and lease went with it, so this view holds only the members that
            // heartbeated since; acquiring now would take their partitions for a moment.
            warn!(settle_time = ?s.settle_time, "Redis no longer held this instance's membership entry (flushed, restarted without its data, or failed over to a replica that lacked it): waiting settle_time for the other members to re-announce before acquiring partitions");
            metrics::redis_data_lost();
            self.rejoined_at = Some(Instant::now());
        }
        if beat.recorded_partition_count {
            info!(partitions = self.settings.amqp.partitions.get(), "recorded the partition count in Redis again (it had none)");
        }
        if let Some(recorded) = &beat.other_route {
            crate::error_limited!(
                OTHER_ROUTE_LOG,
                recorded = %recorded,
                this_instance = %crate::topology::partition_route(&self.settings.amqp),
                "Redis records other queue names for this deployment than this instance uses: an instance with other amqp.partition_queue_prefix, shard_exchange or dead-letter names started (or Redis was restored from older data). Two sets of queues bound to one exchange copy every request into both, or strand requests in queues nobody consumes: find the instance with the other names (rabbitmqctl list_bindings) and stop it"
            );
        }
        self.last_heartbeat = Some(Instant::now());
        crate::splits::Affinity::for_prefix(&self.settings.redis.key_prefix).set_servers(members.len().max(1) * self.settings.llm.endpoints.len());
        if members != self.view {
            info!(members = ?members, llm_down = ?beat.llm_down, "membership changed");
            metrics::rebalanced();
            self.view = members.clone();
            self.view_since = Instant::now();
        }
        metrics::members(beat.members.len());
        metrics::members_llm_down(beat.llm_down.len());
        self.note_routing_differs(&beat.routing_differs);
        Some(members)
    }

    /// Whether this instance's heartbeat flags its LLM as down: every endpoint has been down
    /// for `ownership.llm_down_hand_over_after` (never when that is zero). The flag goes with
    /// the first heartbeat after an endpoint's breaker closes again.
    fn llm_down(&self) -> bool {
        let after = self.settings.ownership.llm_down_hand_over_after;
        !after.is_zero() && self.llm.all_down_for().is_some_and(|d| d >= after)
    }

    /// Logs a change of this instance's LLM-down flag (`assigned`: the assignment still counts
    /// this instance, because no other member's LLM is up).
    fn note_llm_down(&mut self, down: bool, assigned: bool) {
        if down == self.flagged_llm_down {
            return;
        }
        self.flagged_llm_down = down;
        let after_s = self.settings.ownership.llm_down_hand_over_after.as_secs_f64();
        if down && assigned {
            warn!(
                after_s,
                "every LLM endpoint of this instance has been down for llm_down_hand_over_after: flagged in the member set; no other member's LLM is up, so it keeps its partitions (they move once another member's LLM is up)"
            );
        } else if down {
            warn!(
                after_s,
                "every LLM endpoint of this instance has been down for llm_down_hand_over_after: flagged in the member set, so its partitions move to the instances whose LLM is up until an endpoint answers its probe"
            );
        } else {
            info!("an LLM endpoint of this instance answers again: flag cleared; the assignment takes this instance back");
        }
    }

    /// Reports another process heartbeating under this instance's name (`previous`: its boot
    /// nonce, found in the name's key by this heartbeat). On the first heartbeat of a session it
    /// is the previous process of a restart, which is expected; on a later one, the name's key
    /// was overwritten since the last heartbeat, so another live process uses the same
    /// `instance.name`. The two then share one place in the assignment: each tries to hold the
    /// same partitions, leases let only one of them, and the other does no partition work.
    /// Logged at most once a minute, counted in `prefix_batcher_instance_name_conflicts_total`,
    /// and flagged in Redis by the next heartbeats for `status`
    /// ([`crate::membership::member_name_conflict_key`]).
    fn note_name_conflict(&mut self, previous: Option<&str>) {
        let Some(other) = previous else { return };
        if self.last_heartbeat.is_none() {
            info!(instance = %self.settings.instance_name, previous_nonce = %other, "took over the instance name from a previous process (a restart; if that process still runs, the next heartbeats report a name conflict)");
            return;
        }
        metrics::instance_name_conflict();
        self.name_conflict_seen = Some(Instant::now());
        if self.name_conflict_logged.is_none_or(|t| t.elapsed() >= NAME_CONFLICT_LOG_INTERVAL) {
            self.name_conflict_logged = Some(Instant::now());
            warn!(
                instance = %self.settings.instance_name,
                other_nonce = %other,
                "another process is heartbeating with this instance.name: names must be unique per deployment; while both run, one of them does no partition work"
            );
        }
    }

    /// Step 2, assignment: the partitions this instance should own (none while stopping).
    fn desired(&self, stopping: bool) -> BTreeSet<u32> {
        if stopping || self.view.is_empty() {
            return BTreeSet::new();
        }
        desired_partitions(self.settings.amqp.partitions.get(), &self.view, &self.settings.instance_name)
    }

    /// Step 3, renewals: every `renew_interval`, renew every owned lease, all concurrently (one
    /// round trip in all on the multiplexed connection, so a slow Redis delays every renewal by
    /// one command's latency, not by one per partition). A lease found taken is aborted.
    async fn renew_leases(&mut self) {
        let s = self.settings.clone();
        let due = self.last_renew_round.is_none_or(|t| t.elapsed() >= s.ownership.renew_interval);
        if !due || self.owned.is_empty() {
            return;
        }
        self.last_renew_round = Some(Instant::now());
        let sent = Instant::now();
        let leases = &self.leases;
        let renewals = self.owned.iter().map(|(p, o)| {
            let (p, epoch) = (*p, o.epoch);
            async move { (p, leases.renew(p, epoch).await) }
        });
        for (p, res) in futures_util::future::join_all(renewals).await {
            let Some(o) = self.owned.get_mut(&p) else { continue };
            match res {
                Ok(true) => {
                    metrics::lease_op("renew", "ok");
                    o.renewed_at = sent;
                    o.clock.extend_to(sent + s.ownership.renew_deadline);
                }
                Ok(false) => {
                    metrics::lease_op("renew", "lost");
                    warn!(partition = p, epoch = o.epoch, "lease lost (taken by another instance, or gone from Redis); aborting partition");
                    self.abort(p);
                }
                Err(e) => {
                    metrics::lease_op("renew", "error");
                    warn!(partition = p, error = %e, "lease renewal failed; retrying until the renew deadline");
                }
            }
        }
    }

    /// Aborts every partition whose renew deadline (on the monotonic clock, from the send time of
    /// the last successful acquire/renew) has passed.
    fn abort_expired(&mut self) {
        let deadline = self.settings.ownership.renew_deadline;
        let expired: Vec<u32> = self.owned.iter().filter(|(_, o)| o.renewed_at.elapsed() >= deadline).map(|(p, _)| *p).collect();
        for p in expired {
            warn!(partition = p, "renew deadline passed without a successful renewal; aborting partition");
            metrics::lease_op("renew", "expired");
            self.abort(p);
        }
    }

    /// Step 4a, releases: reaps workers that ended — drained (handoff, shutdown) or failed
    /// (channel closed under them). Their leases are still valid (expired ones were aborted just
    /// before), so release them, concurrently: one slow Redis command must not hold up the others.
    async fn release_finished(&mut self) {
        let finished: Vec<u32> = self.owned.iter().filter(|(_, o)| o.task.is_finished()).map(|(p, _)| *p).collect();
        let mut releases = Vec::with_capacity(finished.len());
        for p in finished {
            let o = self.owned.remove(&p).expect("present");
            match o.task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(partition = p, error = %e, "partition worker failed"),
                Err(e) => {
                    error!(partition = p, error = %e, "partition worker panicked; its lease is released and the partition taken again by the next round's assignment (its unacked requests return to the queue)");
                    if e.is_panic() {
                        metrics::task_panicked(metrics::stage::PARTITION);
                    }
                }
            }
            releases.push((p, o.epoch));
        }
        if !releases.is_empty() {
            let this = &*self;
            futures_util::future::join_all(releases.into_iter().map(|(p, epoch)| this.release(p, epoch))).await;
        }
    }

    /// Step 4b, handovers: drains every partition while stopping; otherwise revokes the partitions
    /// this instance should no longer own, once the view has been stable for `settle_time`, and
    /// not while no member's LLM is up: a partition moved then would only go to another member
    /// that cannot serve it either (its held requests returned for nothing).
    fn hand_over(&mut self, desired: &BTreeSet<u32>, stopping: bool, heartbeat_ok: bool) {
        let settled = self.view_since.elapsed() >= self.settings.ownership.settle_time && !self.nobody_serves;
        for (p, o) in self.owned.iter_mut() {
            if stopping {
                if !o.stop.drain.is_cancelled() {
                    o.stop.drain.cancel();
                }
            } else if settled && heartbeat_ok && !desired.contains(p) && !o.handing_over {
                info!(partition = p, "handing partition over to its desired owner");
                o.handing_over = true;
                o.stop.revoke.cancel();
            }
        }
    }

    /// Whether acquisitions may run: always, except within `settle_time` of a rejoin after a
    /// blind period (see [`Self::refresh_membership`]). Acquiring a free lease is always safe and
    /// nobody works on that partition meanwhile, so this does not otherwise wait for the view to
    /// settle (that would add settle_time to every takeover).
    fn settled_after_rejoin(&mut self) -> bool {
        if self.rejoined_at.is_some_and(|t| t.elapsed() >= self.settings.ownership.settle_time) {
            self.rejoined_at = None;
        }
        self.rejoined_at.is_none()
    }

    /// Step 5, acquisitions: tries every desired partition not owned yet, all concurrently, and
    /// starts a worker for each lease acquired.
    async fn acquire_desired(&mut self, conns: &Connections, desired: &BTreeSet<u32>, shutdown: &CancellationToken) {
        let wanted: Vec<u32> = desired.iter().copied().filter(|p| !self.owned.contains_key(p)).collect();
        if wanted.is_empty() {
            return;
        }
        let sent = Instant::now();
        let leases = &self.leases;
        let attempts = futures_util::future::join_all(wanted.into_iter().map(|p| async move { (p, leases.acquire(p).await) })).await;
        let mut failed = Vec::new();
        for (p, res) in attempts {
            match res {
                Ok(Acquire::Acquired(epoch)) => {
                    metrics::lease_op("acquire", "ok");
                    self.start(conns, p, epoch, sent, shutdown);
                }
                Ok(Acquire::Busy(holder)) => {
                    metrics::lease_op("acquire", "busy");
                    self.note_previous_holder(p, &holder);
                }
                Err(e) => {
                    metrics::lease_op("acquire", "error");
                    if failed.is_empty() {
                        warn!(partition = p, error = %e, "lease acquisition failed");
                    }
                    failed.push(p);
                }
            }
        }
        if failed.len() > 1 {
            warn!(partitions = failed.len(), "lease acquisitions failed this round");
        }
        // A failed acquire may still have run in Redis (a timeout after the script was sent):
        // the lease is then this process's at an epoch it never learnt. Release it at once, so
        // that if the assignment moves, the new owner need not wait for its TTL. Sent on the
        // same connection after the acquire, so it runs after it.
        if !failed.is_empty() {
            let leases = &self.leases;
            futures_util::future::join_all(failed.into_iter().map(|p| async move {
                if let Ok(true) = leases.release_any_epoch(p).await {
                    info!(partition = p, "lease taken by an acquire that failed here released");
                }
            }))
            .await;
        }
    }

    /// Logs once per partition (and session) that the lease of partition `p`, which this instance
    /// should own, is held by a previous process under this instance's name (`holder`: the lease
    /// value `name:nonce:epoch`): after a restart within `ownership.lease_ttl` of a crash, nobody
    /// consumes the partition until that lease expires, and without this line the wait is silent.
    fn note_previous_holder(&mut self, p: u32, holder: &str) {
        let Some(v) = LeaseValue::parse(holder) else { return };
        if v.name != self.settings.instance_name || v.nonce == self.nonce || !self.waiting_on_previous.insert(p) {
            return;
        }
        info!(
            partition = p,
            previous_nonce = %v.nonce,
            lease_ttl = ?self.settings.ownership.lease_ttl,
            "the partition's lease is still held by a previous process of this instance; waiting for it to expire (at most lease_ttl)"
        );
    }

    fn start(&mut self, conns: &Connections, p: u32, epoch: u64, sent: Instant, shutdown: &CancellationToken) {
        let clock = Arc::new(LeaseClock::new(sent + self.settings.ownership.renew_deadline));
        let stop = StopSignals { drain: shutdown.child_token(), ..StopSignals::default() };
        let ctx = PartitionContext {
            partition: p,
            epoch,
            settings: self.settings.clone(),
            llm: self.llm.clone(),
            lease: clock.clone(),
            buffer_budget: self.buffer_budget.clone(),
            reply_nodes: self.reply_nodes.clone(),
        };
        let conns = conns.clone();
        let worker_stop = stop.clone();
        let done = self.worker_done.clone();
        let task = tokio::spawn(async move {
            let r = partition::run(&conns, ctx, worker_stop).await;
            done.notify_one();
            r
        });
        info!(partition = p, epoch, "lease acquired");
        self.owned.insert(p, Owned { epoch, clock, stop, task, renewed_at: sent, handing_over: false });
    }

    /// Lease lost, or its renew deadline passed: stop at once; nothing more is published for this
    /// partition, and the requests it held go back to its queue ([`crate::partition`], `abort`).
    fn abort(&mut self, p: u32) {
        if let Some(o) = self.owned.remove(&p) {
            o.clock.invalidate();
            o.stop.abort.cancel();
            // The worker puts its requests back and closes its channel; not waited for here.
            self.aborting.push((o.stop.closing.clone(), o.task));
            metrics::partition_released(p);
        }
    }

    /// Aborts every partition, when the instance is about to close its connections or lost one:
    /// their held requests return with their channels' close ([`StopSignals::closing`]).
    fn abort_all(&mut self) {
        // Before the aborts: a worker that sees its abort must see `closing` already.
        let closing = self.owned.values().map(|o| &o.stop.closing).chain(self.aborting.iter().map(|(c, _)| c));
        closing.for_each(CancellationToken::cancel);
        let ps: Vec<u32> = self.owned.keys().copied().collect();
        for p in ps {
            self.abort(p);
        }
    }

    async fn release(&self, p: u32, epoch: u64) {
        metrics::partition_released(p);
        match self.leases.release(p, epoch).await {
            Ok(true) => {
                metrics::lease_op("release", "ok");
                info!(partition = p, epoch, "lease released");
            }
            Ok(false) => metrics::lease_op("release", "lost"),
            Err(e) => {
                metrics::lease_op("release", "error");
                warn!(partition = p, error = %e, "lease release failed; it expires after its TTL");
            }
        }
    }

    /// Hard stop of everything (drain deadline exceeded or session failure): abort every
    /// partition and release every lease, best effort.
    pub async fn abort_and_release(&mut self) {
        let owned: Vec<(u32, u64)> = self.owned.iter().map(|(p, o)| (*p, o.epoch)).collect();
        self.abort_all();
        let this = &*self;
        futures_util::future::join_all(owned.into_iter().map(|(p, epoch)| this.release(p, epoch))).await;
        self.leave(None).await;
        metrics::partitions_owned(0);
    }

    /// Leaves the member set ([`Membership::leave`]); with `draining`, marks this instance as
    /// draining for that long ([`Membership::leave_draining`]). On failure the entry expires
    /// after `member_ttl`.
    async fn leave(&mut self, draining: Option<Duration>) {
        let left = match draining {
            Some(d) => self.membership.leave_draining(d).await,
            None => self.membership.leave().await,
        };
        if let Err(e) = left {
            warn!(error = %e, "could not leave the member set; this member expires after member_ttl");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readiness::NotReady;

    #[test]
    fn the_health_line_gives_readiness_and_the_endpoints_that_are_down() {
        let readiness = Readiness::new();
        readiness.set(NotReady::Starting, false);
        let all_up = [("http://a:8000/v1", BreakerState::Closed), ("http://b:8000/v1", BreakerState::Closed)];
        assert_eq!(health_line(&readiness.state(), &all_up, (0, 0), &[], &[], 0), "ready");
        let published = with_version("ready; 1 of 2 LLM endpoints down: x (open)");
        assert_eq!(split_version(&published), (Some(crate::VERSION), "ready; 1 of 2 LLM endpoints down: x (open)"));
        assert_eq!(split_version("ready"), (None, "ready"), "an instance that publishes no version");
        assert_eq!(split_version("version of what; ready"), (None, "version of what; ready"));
        let one_down = [("http://a:8000/v1", BreakerState::Closed), ("http://b:8000/v1", BreakerState::Open)];
        assert_eq!(health_line(&readiness.state(), &one_down, (0, 0), &[], &[], 0), "ready; 1 of 2 LLM endpoints down: http://b:8000/v1 (open)");
        readiness.set(NotReady::LlmUnavailable, true);
        readiness.set_connection_blocked("publish", true);
        let all_down = [("http://a:8000/v1", BreakerState::HalfOpen), ("http://b:8000/v1", BreakerState::Open)];
        assert_eq!(
            health_line(&readiness.state(), &all_down, (0, 0), &[], &[], 0),
            "not ready: llm endpoints unavailable, amqp connection blocked; 2 of 2 LLM endpoints down: http://a:8000/v1 (half_open), http://b:8000/v1 (open)"
        );
        // Client certificates: a note for each one within 14 days of its expiry, none for others.
        let now = 1_800_000_000;
        let certificates = [("amqp", now + 6 * 86_400 + 60), ("redis", now + 30 * 86_400), ("llm", now - 3_600)];
        assert_eq!(
            health_line(&readiness.state(), &all_up, (0, 0), &[], &certificates, now),
            "not ready: llm endpoints unavailable, amqp connection blocked; amqp client certificate expires in 6 days; llm client certificate expired 1 hour ago"
        );
        // Results and forwards the broker does not take.
        readiness.set(NotReady::LlmUnavailable, false);
        readiness.set_connection_blocked("publish", false);
        assert_eq!(health_line(&readiness.state(), &all_up, (3, 0), &[], &[], now), "ready; 3 results held: the broker does not take them");
        assert_eq!(
            health_line(&readiness.state(), &one_down, (1, 2), &[], &[], now),
            "ready; 1 of 2 LLM endpoints down: http://b:8000/v1 (open); 1 result and 2 forwards held: the broker does not take them"
        );
        // Observed: a stray consumer active on an owned partition's queue; `status` counted it as
        // the owner's consumer and nothing said otherwise. The owner's finding is in its line.
        assert_eq!(
            health_line(&readiness.state(), &all_up, (0, 0), &[3, 5], &[], now),
            "ready; another consumer is active on the queue of partition 3, 5: another deployment with the same queue names or a stray client (rabbitmqctl list_consumers)"
        );
    }
}
