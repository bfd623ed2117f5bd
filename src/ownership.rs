//! Membership, partition assignment and the lifecycle of owned partitions.
//!
//! Every tick (at most 500 ms, at most a third of `renew_interval`, and at once when a partition
//! worker ends) an instance:
//! 1. heartbeats its member key `{prefix}:member:{name}` = nonce with TTL `member_ttl`, and reads
//!    the live members;
//! 2. computes the desired owner of each partition by rendezvous hashing with bounded loads over
//!    the member names ([`crate::keying::assignment`]): every instance agrees without a coordinator, each member
//!    gets ⌊P/M⌋ or ⌈P/M⌉ partitions, few partitions move when a member joins or leaves, and a
//!    restarted instance with the same name gets the same partitions back;
//! 3. renews its leases every `renew_interval` ([`crate::lease`]); a partition whose lease is gone
//!    (compare failed) or whose renew deadline passed (Redis unreachable) is aborted at once (the
//!    worker also stops by itself at that deadline, see [`crate::lease::LeaseClock`]);
//! 4. hands over partitions it should no longer own — only once the membership view has been
//!    stable for `settle_time`, so a rolling restart does not thrash — by draining them (flush,
//!    finish, ack) and then releasing the lease (revoke before assign);
//! 5. acquires free leases of partitions it is the desired owner of, and starts their workers.
//!    Acquiring a *free* lease does not wait for the view to settle: nobody is working on that
//!    partition, so waiting would only add latency to a takeover. The exception is an instance
//!    that was blind (just started, or Redis unreachable for longer than `member_ttl`): it waits
//!    `settle_time` after its first successful heartbeat, so that after a Redis outage (member
//!    keys expired or lost) the first instance back does not take every partition.
//!
//! On shutdown it first deletes its member key (so the others compute the new assignment while
//! it drains), stops acquiring, drains every partition (still renewing meanwhile) and releases
//! each lease the moment its partition is drained, so successors take over at once instead of
//! waiting out the TTL.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use lapin::Connection;
use redis::aio::ConnectionManager;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Settings;
use crate::keying::desired_partitions;
use crate::lease::{Acquire, LeaseClock, Leases};
use crate::llm::LlmClient;
use crate::metrics;
use crate::partition::{self, PartitionContext, StopSignals};

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

/// Redis key of a member's heartbeat.
pub fn member_key(prefix: &str, name: &str) -> String {
    format!("{prefix}:member:{name}")
}

/// Live member names (sorted), from the heartbeat keys.
pub async fn read_members(conn: &mut ConnectionManager, prefix: &str) -> Result<Vec<String>, redis::RedisError> {
    let pattern = format!("{prefix}:member:*");
    let strip = format!("{prefix}:member:");
    let mut cursor: u64 = 0;
    let mut names = BTreeSet::new();
    loop {
        let (next, keys): (u64, Vec<String>) =
            redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(1000).query_async(conn).await?;
        names.extend(keys.into_iter().filter_map(|k| k.strip_prefix(&strip).map(str::to_owned)));
        if next == 0 {
            return Ok(names.into_iter().collect());
        }
        cursor = next;
    }
}

/// The ownership manager of one session (one AMQP connection).
pub struct Ownership {
    settings: Arc<Settings>,
    redis: ConnectionManager,
    leases: Leases,
    nonce: String,
    llm: LlmClient,
    owned: BTreeMap<u32, Owned>,
    view: Vec<String>,
    view_since: Instant,
    last_renew_round: Option<Instant>,
    /// Signalled by every partition worker when it ends, so a drained partition's lease is
    /// released at once instead of at the next tick (this is most of a SIGTERM handoff's speed).
    worker_done: Arc<Notify>,
    /// The member key was deleted at the start of the shutdown.
    left: bool,
    /// When the last heartbeat succeeded.
    last_heartbeat: Option<Instant>,
    /// Set when a heartbeat succeeds after a blind period (start, Redis outage); acquisitions
    /// wait until `settle_time` after it.
    rejoined_at: Option<Instant>,
}

impl Ownership {
    /// `nonce` is this process's boot nonce.
    pub fn new(settings: Arc<Settings>, redis: ConnectionManager, nonce: String, llm: LlmClient) -> Self {
        let holder = format!("{}:{}", settings.instance_name, nonce);
        let leases = Leases::new(
            redis.clone(),
            &settings.redis.key_prefix,
            holder,
            settings.ownership.lease_ttl,
            settings.redis.command_timeout,
        );
        Ownership {
            settings,
            redis,
            leases,
            nonce,
            llm,
            owned: BTreeMap::new(),
            view: Vec::new(),
            view_since: Instant::now(),
            last_renew_round: None,
            worker_done: Arc::new(Notify::new()),
            left: false,
            last_heartbeat: None,
            rejoined_at: None,
        }
    }

    fn tick_interval(&self) -> Duration {
        (self.settings.ownership.renew_interval / 3).min(Duration::from_millis(500)).max(Duration::from_millis(50))
    }

    /// Runs until `shutdown` fires and every partition is drained and released, or until the
    /// connection fails. `on_first_round` is called once, after the first acquisition round.
    pub async fn run(
        &mut self,
        conn: Arc<Connection>,
        shutdown: CancellationToken,
        mut on_first_round: impl FnMut(),
    ) -> Result<(), OwnershipError> {
        let mut first = true;
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
            if !conn.status().connected() {
                self.abort_all();
                return Err(OwnershipError::ConnectionLost);
            }
            let redis_ok = self.round(&conn, stopping).await;
            // Ready only with a working Redis: the first round reports it through the callback,
            // later rounds keep `/readyz` in step with the heartbeat (503 during a Redis outage).
            if first && redis_ok {
                first = false;
                on_first_round();
            } else if !first && !stopping {
                metrics::set_ready(redis_ok);
            }
            if stopping && self.owned.is_empty() {
                self.leave().await;
                return Ok(());
            }
        }
    }

    /// One ownership round; returns whether the membership heartbeat reached Redis.
    async fn round(&mut self, conn: &Arc<Connection>, stopping: bool) -> bool {
        let s = self.settings.clone();
        let me = s.instance_name.as_str();
        let prefix = s.redis.key_prefix.as_str();

        // 0. Shutdown: leave the member set first, so the others compute the new assignment (and
        // start polling for the leases) while this instance drains.
        if stopping && !self.left {
            self.left = true;
            self.leave().await;
        }

        // 1. Heartbeat and membership.
        let members = if stopping {
            None
        } else {
            let mut r = self.redis.clone();
            let hb = tokio::time::timeout(s.redis.command_timeout, async {
                redis::cmd("SET")
                    .arg(member_key(prefix, me))
                    .arg(&self.nonce)
                    .arg("PX")
                    .arg(s.ownership.member_ttl.as_millis() as u64)
                    .query_async::<()>(&mut r)
                    .await?;
                read_members(&mut r, prefix).await
            })
            .await;
            match hb {
                Ok(Ok(m)) => Some(m),
                Ok(Err(e)) => {
                    warn!(error = %e, "membership heartbeat failed");
                    None
                }
                Err(_) => {
                    warn!("membership heartbeat timed out");
                    None
                }
            }
        };
        if let Some(m) = &members {
            // Blind until now (first heartbeat of this session, or Redis was unreachable for
            // longer than member_ttl, so every member key may have expired or been lost with
            // Redis's data): the others may not have re-announced themselves yet. Wait for the
            // view to settle before acquiring, or the first instance back takes every partition
            // and then hands most of them over again.
            if self.last_heartbeat.is_none_or(|t| t.elapsed() >= s.ownership.member_ttl) {
                self.rejoined_at = Some(Instant::now());
            }
            self.last_heartbeat = Some(Instant::now());
            if *m != self.view {
                info!(members = ?m, "membership changed");
                metrics::rebalanced();
                self.view = m.clone();
                self.view_since = Instant::now();
            }
            metrics::members(m.len());
        }

        // 2. Renew.
        let renew_due = self.last_renew_round.is_none_or(|t| t.elapsed() >= s.ownership.renew_interval);
        if renew_due && !self.owned.is_empty() {
            self.last_renew_round = Some(Instant::now());
            let sent = Instant::now();
            let checks = self.owned.iter().map(|(p, o)| {
                let leases = self.leases.clone();
                let (p, epoch) = (*p, o.epoch);
                async move { (p, leases.renew(p, epoch).await) }
            });
            for (p, res) in futures_util::future::join_all(checks).await {
                let Some(o) = self.owned.get_mut(&p) else { continue };
                match res {
                    Ok(true) => {
                        metrics::lease_op("renew", "ok");
                        o.renewed_at = sent;
                        o.clock.extend_to(sent + s.ownership.renew_deadline);
                    }
                    Ok(false) => {
                        metrics::lease_op("renew", "lost");
                        warn!(partition = p, epoch = o.epoch, "lease lost (held by another instance); aborting partition");
                        self.abort(p);
                    }
                    Err(e) => {
                        metrics::lease_op("renew", "error");
                        warn!(partition = p, error = %e, "lease renewal failed; retrying until the renew deadline");
                    }
                }
            }
        }
        // Renew deadline, on the monotonic clock from the send time of the last success.
        let expired: Vec<u32> = self
            .owned
            .iter()
            .filter(|(_, o)| o.renewed_at.elapsed() >= s.ownership.renew_deadline)
            .map(|(p, _)| *p)
            .collect();
        for p in expired {
            warn!(partition = p, "renew deadline passed without a successful renewal; aborting partition");
            metrics::lease_op("renew", "expired");
            self.abort(p);
        }

        // 3. Reap workers that ended: drained (handoff, shutdown) or failed (channel closed under
        // them). Their leases are still valid (expired ones were aborted just above), so release
        // them — concurrently: one slow Redis command must not hold up the others.
        let finished: Vec<u32> = self.owned.iter().filter(|(_, o)| o.task.is_finished()).map(|(p, _)| *p).collect();
        let mut releases = Vec::with_capacity(finished.len());
        for p in finished {
            let o = self.owned.remove(&p).expect("present");
            match o.task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(partition = p, error = %e, "partition worker failed"),
                Err(e) => warn!(partition = p, error = %e, "partition worker panicked"),
            }
            releases.push((p, o.epoch));
        }
        if !releases.is_empty() {
            let this = &*self;
            futures_util::future::join_all(releases.into_iter().map(|(p, epoch)| this.release(p, epoch))).await;
        }

        // 4. Hand over / drain.
        let settled = self.view_since.elapsed() >= s.ownership.settle_time;
        let desired = if stopping || self.view.is_empty() {
            BTreeSet::new()
        } else {
            desired_partitions(s.amqp.partitions.get(), &self.view, me)
        };
        for (p, o) in self.owned.iter_mut() {
            if stopping {
                if !o.stop.drain.is_cancelled() {
                    o.stop.drain.cancel();
                }
            } else if settled && !desired.contains(p) && !o.handing_over && members.is_some() {
                info!(partition = p, "handing partition over to its desired owner");
                o.handing_over = true;
                o.stop.revoke.cancel();
            }
        }

        // 5. Acquire free leases of desired partitions. Acquiring a free lease is always safe and
        // nobody works on that partition meanwhile, so this does not wait for the view to settle
        // (that would add settle_time to every takeover) — except right after this instance was
        // blind (see step 1).
        if self.rejoined_at.is_some_and(|t| t.elapsed() >= s.ownership.settle_time) {
            self.rejoined_at = None;
        }
        if !stopping && members.is_some() && self.rejoined_at.is_none() {
            let wanted: Vec<u32> = desired.iter().copied().filter(|p| !self.owned.contains_key(p)).collect();
            for p in wanted {
                let sent = Instant::now();
                match self.leases.acquire(p).await {
                    Ok(Acquire::Acquired(epoch)) => {
                        metrics::lease_op("acquire", "ok");
                        self.start(conn, p, epoch, sent);
                    }
                    Ok(Acquire::Busy(_)) => metrics::lease_op("acquire", "busy"),
                    Err(e) => {
                        metrics::lease_op("acquire", "error");
                        warn!(partition = p, error = %e, "lease acquisition failed");
                        break;
                    }
                }
            }
        }
        metrics::partitions_owned(self.owned.len());
        members.is_some()
    }

    fn start(&mut self, conn: &Arc<Connection>, p: u32, epoch: u64, sent: Instant) {
        let clock = Arc::new(LeaseClock::new(sent + self.settings.ownership.renew_deadline));
        let stop = StopSignals::default();
        let ctx = PartitionContext { partition: p, epoch, settings: self.settings.clone(), llm: self.llm.clone(), lease: clock.clone() };
        let conn = conn.clone();
        let worker_stop = stop.clone();
        let done = self.worker_done.clone();
        let task = tokio::spawn(async move {
            let r = partition::run(&conn, ctx, worker_stop).await;
            done.notify_one();
            r
        });
        info!(partition = p, epoch, "lease acquired");
        self.owned.insert(p, Owned { epoch, clock, stop, task, renewed_at: sent, handing_over: false });
    }

    /// Lease lost: stop at once; nothing more is published or acked for this partition.
    fn abort(&mut self, p: u32) {
        if let Some(o) = self.owned.remove(&p) {
            o.clock.invalidate();
            o.stop.abort.cancel();
            // The worker closes its channel; we do not wait for it here.
            tokio::spawn(async move {
                let _ = o.task.await;
            });
            metrics::partition_released(p);
        }
    }

    fn abort_all(&mut self) {
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
        self.leave().await;
        metrics::partitions_owned(0);
    }

    /// Deletes this process's member key (only if it is still ours).
    async fn leave(&self) {
        let key = member_key(&self.settings.redis.key_prefix, &self.settings.instance_name);
        let script = redis::Script::new("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0");
        let mut r = self.redis.clone();
        let res: Result<Result<i64, redis::RedisError>, _> =
            tokio::time::timeout(self.settings.redis.command_timeout, script.key(key).arg(&self.nonce).invoke_async(&mut r)).await;
        if !matches!(res, Ok(Ok(_))) {
            warn!("could not delete the member key; it expires after member_ttl");
        }
    }
}
