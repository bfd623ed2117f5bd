//! The pipeline of one owned partition: consumer → batcher → LLM → publisher → ack.
//!
//! One instance of this runs per partition whose lease the instance holds. Stages are tasks
//! joined by bounded channels (`batching.channel_capacity`); the AMQP prefetch
//! (`amqp.partition_prefetch`) bounds the unacked deliveries, and one byte budget per instance
//! (`batching.max_buffered_bytes`, [`PartitionContext::buffer_budget`]) bounds the request bodies
//! held: intake waits while it is spent, and every batcher of the instance then flushes what it
//! holds (`reason="byte_budget"`), since no buffer can grow until bytes are given back.
//!
//! Three ways to stop, chosen by the owner ([`crate::ownership`]):
//! - `drain` (SIGTERM): stop consuming, flush every buffer (`reason="shutdown"`), finish the
//!   in-flight batches, publish and ack, close the channel.
//! - `revoke` (cooperative handoff to another instance): the same, but buffers flush with
//!   `reason="revoke"`.
//! - `abort` (lease lost, or its renew deadline passed): abort in-flight LLM calls and publish
//!   no more results at once; put the requests held back in the partition queue uncharged (those
//!   of the calls cut first, then, once the consumer is cancelled, those buffered and not taken),
//!   then close the channel. Not when the consuming channel is closed already or the instance is
//!   closing its connections ([`StopSignals::closing`]): the channel's close returns them then,
//!   charged a delivery, as it does a request whose copy the broker did not confirm and one whose
//!   result the broker was refusing (held) at the abort.
//!
//! **LLM outages pause intake.** While no LLM endpoint of the partition is available (the circuit
//! breakers are open, [`crate::llm`]), the worker takes no new delivery: the requests wait in
//! their queue (the prefetch is spent), and those already held wait in memory, unacked, for an
//! endpoint. A batch that meets a server fault asks the endpoint whose fault it was
//! ([`LlmClient::confirm_server_fault`]); when the endpoint is down its requests wait and go again,
//! so an outage neither burns requests into `ok: false` results nor charges them deliveries
//! (quorum queues count every return, a channel's close included). The breaker's own probe, never
//! a request, decides when to resume.
//!
//! **Consuming sessions.** Within its tenure the worker runs one *consuming session* after
//! another (a consume channel, a publish channel, a batcher, an executor). A session ends without
//! ending the partition — its channel is closed, so the broker requeues everything unacked in
//! order, and a new session starts — when:
//! - the oldest unsettled delivery nears RabbitMQ's `consumer_timeout` (0.9 × it): the broker
//!   would close the channel anyway;
//! - a channel under the partition closed (e.g. a publish refused with 406), or the queue is gone
//!   (consume refused with 404, consumer cancelled by the broker): the queue is re-declared
//!   ([`crate::topology::declare_partition`]).
//!
//! **Every delivery is settled.** After the LLM call: a result (or a request fault's `ok: false`
//! result) is published and the request acked ([`publisher::publish_result`], which requeues when
//! nothing could be published); a server fault of an endpoint that still answers nacks the
//! request with requeue and notes why
//! ([`crate::redelivery::note_failure`]); a panic in a batch task is caught at the task boundary
//! and its requests are nacked with requeue, so the delivery limit bounds a poison message.
//! Everything else ends with the channel's close.
//!
//! Before publishing any result ([`publisher::publish_result`]), the worker checks its local
//! lease deadline ([`LeaseClock`]); a worker whose lease may have expired (e.g. after a SIGSTOP)
//! publishes no result (one already confirmed is acked). The worker also stops by itself at that
//! deadline, like an `abort`, without waiting for the owner to notice (the owner's loop may be
//! stuck on an unreachable Redis): consumption stops within the renew deadline whatever happens
//! to the rest.
//!
//! Every result carries `x-partition`, `x-partition-epoch` (the lease epoch, a fencing token: a
//! result with a lower epoch than one already seen for its partition is stale) and `x-instance`
//! (the instance name), so consumers and tests can build an ownership log from results alone.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Consumer};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::amqp::{answered, close_after_acks, close_channel, reply_code, Connections, SharedConfirmChannel, NOT_FOUND};
use crate::batcher::{self, Batch, BatchConfig};
use crate::config::{AmqpSettings, KeyingMode, Settings};
use crate::keying::PrefixKey;
use crate::lease::LeaseClock;
use crate::llm::{EarlyAnswers, ErrorKind, Fault, InferenceItem, LlmClient, LlmError};
use crate::metrics::{self, outcome, restart, stage};
use crate::publisher::{self, header_u64, unix_ms, BatchInfo, HoldEnds, Intake, ResultEnd, Settlement, Tenure, HEADER_ROUTED_AT_MS, HEADER_SHARD, HEADER_TIMESTAMP_MS};
use crate::redelivery::{self, Source, HEADER_EARLIER_DELIVERIES};
use crate::request::{Request, TimingsMs};

/// How far (milliseconds) a request's publish time (`timestamp_in_ms` header or AMQP `timestamp`)
/// may lie ahead of this host's clock and still be taken as its publish time (a publisher's clock
/// slightly ahead; the whole-second AMQP `timestamp` is rounded). Later ones are ignored: no
/// queueing delay, no end-to-end latency is measured from them.
pub const MAX_CLOCK_SKEW_MS: u64 = 1_000;

/// A request's publish time in Unix milliseconds: header `timestamp_in_ms` (`header_ms`), else the
/// AMQP `timestamp` (`amqp_s`, whole seconds). A value is no publish time (nothing is measured
/// from it) when it lies more than [`MAX_CLOCK_SKEW_MS`] after `now_ms` or before
/// [`MIN_PUBLISH_TIME_MS`] (0, or seconds sent where milliseconds belong); `None` when neither
/// is one.
pub fn publish_time_ms(header_ms: Option<u64>, amqp_s: Option<u64>, now_ms: u64) -> Option<u64> {
    let plausible = |t: &u64| (MIN_PUBLISH_TIME_MS..=now_ms.saturating_add(MAX_CLOCK_SKEW_MS)).contains(t);
    header_ms.filter(plausible).or_else(|| amqp_s.map(|t| t.saturating_mul(1000)).filter(plausible))
}

/// The earliest publish time taken as one: 2000-01-01T00:00:00Z in Unix milliseconds. Earlier
/// values are a timestamp of 0, or one in seconds in a milliseconds header (about 1.8 × 10⁹
/// "milliseconds" is January 1970), and would add decades to the latency histogram.
pub const MIN_PUBLISH_TIME_MS: u64 = 946_684_800_000;

/// Share of `amqp.consumer_timeout` after which the oldest unsettled delivery makes the worker
/// requeue everything and start a new consuming session (before the broker closes the channel).
pub const CONSUMER_TIMEOUT_GUARD: f64 = 0.9;

/// Pause between two consuming sessions that ended on a channel or queue failure, so a broker
/// that keeps refusing is not hammered.
const RESTART_PAUSE: Duration = Duration::from_millis(200);

/// Everything one partition worker needs.
#[derive(Clone)]
pub struct PartitionContext {
    pub partition: u32,
    /// Lease epoch (fencing token), sent as `x-partition-epoch` on every result.
    pub epoch: u64,
    pub settings: Arc<Settings>,
    pub llm: LlmClient,
    pub lease: Arc<LeaseClock>,
    /// The instance's budget of buffered request bytes, shared by all its partitions.
    pub buffer_budget: BufferBudget,
    /// The session's checks of direct reply-to nodes ([`crate::reply_node`]): a request published
    /// straight to the partition queue did not pass the router's.
    pub reply_nodes: Arc<crate::reply_node::NodeCheck>,
}

/// The instance's budget of buffered request bytes (`batching.max_buffered_bytes`), shared by all
/// its partition workers, and the signal that it is spent.
#[derive(Clone)]
pub struct BufferBudget {
    /// One permit per body byte (capped at what a tokio semaphore holds), taken when a delivery
    /// is accepted and given back when it is settled.
    bytes: Arc<Semaphore>,
    /// Bumped each time an intake finds the budget spent and has to wait. Every batcher of the
    /// instance watches it and flushes all it holds ([`batcher::FlushReason::ByteBudget`]): while
    /// the budget is spent no delivery is accepted, so a buffer could only wait out
    /// `max_batch_wait`, holding bytes that a batch in flight would give back sooner.
    spent: Arc<tokio::sync::watch::Sender<u64>>,
}

impl BufferBudget {
    /// A full budget of `batching.max_buffered_bytes`.
    pub fn new(settings: &Settings) -> Self {
        BufferBudget {
            bytes: Arc::new(Semaphore::new(settings.batching.max_buffered_bytes.get().min(Semaphore::MAX_PERMITS))),
            spent: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// Takes `bytes` (1 ..= the budget) of the budget, waiting while it is spent; before such a
    /// wait, signals every batcher to flush. `None` when the semaphore was closed (never done).
    async fn take(&self, bytes: u32) -> Option<OwnedSemaphorePermit> {
        match self.bytes.clone().try_acquire_many_owned(bytes) {
            Ok(permit) => Some(permit),
            Err(tokio::sync::TryAcquireError::Closed) => None,
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                self.spent.send_modify(|n| *n = n.wrapping_add(1));
                self.bytes.clone().acquire_many_owned(bytes).await.ok()
            }
        }
    }

    /// The "budget spent" signal for a batcher ([`batcher::run`]).
    pub fn spent_signal(&self) -> tokio::sync::watch::Receiver<u64> {
        self.spent.subscribe()
    }
}

/// Stop signals of a worker.
#[derive(Clone, Default)]
pub struct StopSignals {
    /// Graceful stop for shutdown: flush with `reason="shutdown"`.
    pub drain: CancellationToken,
    /// Graceful stop for a handoff: flush with `reason="revoke"`.
    pub revoke: CancellationToken,
    /// Hard stop: lease lost, or its renew deadline passed. The requests held go back to the
    /// partition queue uncharged where they can (see the module documentation).
    pub abort: CancellationToken,
    /// Fired when the instance is about to close its connections (a hard stop) or lost one:
    /// before `abort`, and also for workers aborted earlier that are still putting their requests
    /// back. Nothing more is put back then, the channel's close returns the requests (a copy
    /// confirmed whose original's ack the close cut would be a duplicate).
    pub closing: CancellationToken,
}

impl StopSignals {
    fn any(&self) -> bool {
        self.drain.is_cancelled() || self.revoke.is_cancelled() || self.abort.is_cancelled()
    }

    /// Completes when any stop signal fires.
    async fn stopped(&self) {
        tokio::select! {
            _ = self.drain.cancelled() => {}
            _ = self.revoke.cancelled() => {}
            _ = self.abort.cancelled() => {}
        }
    }
}

/// A request waiting in a batch.
struct Pending {
    req: Request,
    seat: Seat,
}

/// What settling one request of a flushed batch needs: the [`Pending`] without the request's
/// prompt and parameters, which the batch's calls borrow while its answered requests are settled
/// ([`process_batch`]).
struct Seat {
    delivery: Delivery,
    /// The request id (a copy of the request's).
    id: String,
    key: PrefixKey,
    shard: u32,
    received: Instant,
    queued_ms: u64,
    enqueued_unix_ms: Option<u64>,
    /// Counts the delivery as unsettled and holds its bytes of the budget until dropped.
    _held: Held,
}

impl Pending {
    /// The request, and the rest as a [`Seat`].
    fn split(self) -> (Request, Seat) {
        (self.req, self.seat)
    }
}

/// One held delivery: when it was received and, once parsed, its request id and its key for
/// uncharged returns ([`redelivery::forward_key`]).
type HeldEntry = (Instant, Option<(Arc<str>, Option<u128>)>);

/// The deliveries of one partition held in memory, by receive order: for the
/// `unsettled_deliveries` gauge and the `consumer_timeout` guard.
struct HeldDeliveries {
    partition: u32,
    /// The last sequence number given, and per held delivery: when it was received and, once
    /// parsed, its request id (for the detail of a later `delivery_limit` dead letter).
    state: Mutex<(u64, BTreeMap<u64, HeldEntry>)>,
    /// Stall restarts in a row ([`check_stall`]); a delivery sets it back to 0.
    stalls: std::sync::atomic::AtomicU32,
    /// Unix milliseconds since which the partition consumes: when its worker started, or its
    /// intake last resumed after an LLM outage ([`HeldDeliveries::consuming_from_now`]). The split
    /// rule counts a request's queueing delay from here at the earliest ([`accept`]).
    consuming_since_ms: std::sync::atomic::AtomicU64,
}

impl HeldDeliveries {
    fn new(partition: u32) -> Arc<Self> {
        Arc::new(HeldDeliveries {
            partition,
            state: Mutex::new((0, BTreeMap::new())),
            stalls: Default::default(),
            consuming_since_ms: unix_ms().into(),
        })
    }

    /// Marks the intake as consuming from now: it resumed after waiting for an LLM endpoint.
    fn consuming_from_now(&self) {
        self.consuming_since_ms.store(unix_ms(), std::sync::atomic::Ordering::Relaxed);
    }

    /// The queueing delay the split rule counts for a request in the partition queue since
    /// `enqueued_ms` (its forward by a router), dequeued at `now_ms`: from the later of that and
    /// the moment the partition began consuming (see [`split_queued_ms`]).
    fn split_queued_ms(&self, enqueued_ms: Option<u64>, now_ms: u64) -> u64 {
        split_queued_ms(enqueued_ms, self.consuming_since_ms.load(std::sync::atomic::Ordering::Relaxed), now_ms)
    }

    /// Holds a delivery received at `received`, with its `bytes` of the byte budget.
    fn hold(self: &Arc<Self>, bytes: OwnedSemaphorePermit, received: Instant) -> Held {
        let mut s = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        s.0 += 1;
        let seq = s.0;
        s.1.insert(seq, (received, None));
        metrics::unsettled_deliveries(self.partition, s.1.len());
        Held { owner: self.clone(), seq, received, _bytes: bytes }
    }

    /// When the oldest delivery still held was received.
    fn oldest(&self) -> Option<Instant> {
        let s = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        s.1.first_key_value().map(|(_, (t, _))| *t)
    }

    /// Remembers, for each held request, that the `amqp.consumer_timeout` guard returns it
    /// ([`crate::redelivery::note_failure`]): the detail of its `delivery_limit` dead letter,
    /// should this return be its last, then says why instead of "unknown". When the broker
    /// blocked the publishing connection during its hold (`blocked_since(received)`: a memory or
    /// disk alarm), nothing could be published or put back as a copy, so the return is noted
    /// uncharged too ([`crate::redelivery::note_uncharged_return`]).
    fn note_guard_return(&self, limit: Duration, blocked_since: impl Fn(Instant) -> bool) {
        let s = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (received, id) in s.1.values() {
            if let Some((id, key)) = id {
                if let Some(key) = key.filter(|_| blocked_since(*received)) {
                    crate::redelivery::note_uncharged_return(key);
                }
                let why = format!(
                    "held {:.1} s without an outcome, returned to its partition queue by the amqp.consumer_timeout guard \
                     (it returns a partition's held requests when one was held {:.0} s)",
                    received.elapsed().as_secs_f64(),
                    limit.as_secs_f64()
                );
                crate::redelivery::note_failure(id, &why);
            }
        }
    }
}

/// One held delivery (see [`HeldDeliveries`]); dropped once the delivery is settled or its
/// channel closed.
struct Held {
    owner: Arc<HeldDeliveries>,
    seq: u64,
    /// When the delivery was received, before it waited for the byte budget.
    received: Instant,
    _bytes: OwnedSemaphorePermit,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut s = self.owner.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        s.1.remove(&self.seq);
        metrics::unsettled_deliveries(self.owner.partition, s.1.len());
    }
}

impl Held {
    /// Names the held delivery by its request id, once parsed.
    fn identify(&self, id: &str, key: Option<u128>) {
        let mut s = self.owner.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(entry) = s.1.get_mut(&self.seq) {
            entry.1 = Some((Arc::from(id), key));
        }
    }
}

/// Why a consuming session must end early; the first reason raised wins. Cancelling `token` also
/// cancels the session's in-flight LLM calls (it is a child of the abort token).
struct SessionEnd {
    token: CancellationToken,
    reason: Mutex<Option<&'static str>>,
    /// The session's consuming channel (`None` in unit tests).
    consume: Option<Channel>,
}

impl SessionEnd {
    fn new(abort: &CancellationToken, consume: Option<Channel>) -> Arc<Self> {
        Arc::new(SessionEnd { token: abort.child_token(), reason: Mutex::new(None), consume })
    }

    /// Whether the requests held when [`StopSignals::abort`] fired go back to the partition
    /// queue uncharged ([`return_uncharged`]) rather than with the channel's close, which charges
    /// each of them a delivery: the abort (lease lost, or its renew deadline passed during a Redis outage) ended
    /// the session, not a restart reason, and the consuming channel is still open, so that each
    /// original can be acked once its copy is confirmed (a copy of a delivery on a closed
    /// channel would be a duplicate: the broker returns the original too). An abort is no
    /// request's fault: without this, every Redis outage longer than `ownership.renew_deadline`
    /// used up one of `amqp.delivery_limit` deliveries of every request the instance held.
    /// Not when the instance is closing its connections ([`StopSignals::closing`]).
    fn puts_back_at_abort(&self, stop: &StopSignals) -> bool {
        stop.abort.is_cancelled()
            && !stop.closing.is_cancelled()
            && self.reason().is_none()
            && self.consuming()
    }

    /// Whether the session's consuming channel is open: a delivery put back uncharged can then be
    /// acked once its copy is confirmed.
    fn consuming(&self) -> bool {
        self.consume.as_ref().is_some_and(|c| c.status().connected())
    }

    /// Ends the session for `reason` (one of [`restart`]).
    fn raise(&self, reason: &'static str) {
        self.reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(reason);
        self.token.cancel();
    }

    fn reason(&self) -> Option<&'static str> {
        *self.reason.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// How a consuming session ended.
enum Ended {
    /// A stop signal ended it (after a drain, or at once for an abort); the partition ends.
    Stopped,
    /// Start a new session, for this reason (one of [`restart`]).
    Restart(&'static str),
}

/// Runs the partition until stopped, one consuming session after another (see the module
/// documentation). Returns an error when the AMQP connection fails.
pub async fn run(conns: &Connections, ctx: PartitionContext, stop: StopSignals) -> Result<(), lapin::Error> {
    let p = ctx.partition;
    let held = HeldDeliveries::new(p);
    let result = loop {
        if !endpoint_available(&ctx) {
            if !pause(&ctx, &stop).await {
                break Ok(());
            }
            held.consuming_from_now();
        }
        let reason = match session(conns, &ctx, &stop, &held).await {
            Ok(Ended::Stopped) => break Ok(()),
            // A lost connection (most often the publishing one: the consuming connection may still
            // be open) ends the worker instead of consuming again: the session closed its channel,
            // which returned the requests it held and charged them one delivery; consumed again,
            // they would be returned and charged a second time when the instance's session ends
            // for the lost connection a moment later.
            Ok(Ended::Restart(_)) if !conns.connected() => break Err(connection_lost(conns)),
            Ok(Ended::Restart(reason)) => reason,
            Err(e) if !conns.connected() => break Err(e),
            Err(e) if reply_code(&e) == Some(NOT_FOUND) => {
                warn!(partition = p, error = %e, "partition queue not found; declaring it again");
                restart::QUEUE_MISSING
            }
            Err(e) => {
                warn!(partition = p, error = %e, "partition channel failed; opening a new one");
                restart::CHANNEL_CLOSED
            }
        };
        metrics::consumer_restarted(reason);
        if reason == restart::QUEUE_MISSING && !declare_again(conns, &ctx, &stop).await {
            break Ok(());
        }
        if !stop.any() {
            tokio::select! {
                _ = stop.stopped() => {}
                _ = tokio::time::sleep(RESTART_PAUSE) => {}
            }
        }
        if stop.any() {
            break Ok(());
        }
    };
    metrics::buffer_state(p, 0, 0.0);
    metrics::unsettled_deliveries(p, 0);
    metrics::intake_paused(p, false);
    result
}

/// The error a partition worker ends with when one of the session's connections closed under it
/// ([`run`]; the session then reconnects).
fn connection_lost(conns: &Connections) -> lapin::Error {
    let which = if conns.consume.status().connected() { "publishing" } else { "consuming" };
    lapin::Error::from(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, format!("the {which} connection closed")))
}

/// The queueing delay, in milliseconds, the split rule ([`crate::affinity::LoadTracker`]) counts
/// for a request in the partition queue since `enqueued_ms` (unix ms: its forward by a router, else
/// its publish; `None`: unknown, 0) and dequeued at `now_ms`,
/// by a partition consuming since `consuming_since_ms`: the time since the later of the two.
/// The time a request waited while nobody consumed its partition (no owner yet, after a crash
/// before the takeover; the intake paused through an LLM outage) says nothing about whether one
/// partition drains its key fast enough; counted, the backlog of an outage split every key that
/// had one when the server came back.
fn split_queued_ms(enqueued_ms: Option<u64>, consuming_since_ms: u64, now_ms: u64) -> u64 {
    enqueued_ms.map_or(0, |t| now_ms.saturating_sub(t.max(consuming_since_ms)))
}

/// When the split rule's queueing delay of a request starts ([`split_queued_ms`]'s
/// `enqueued_ms`), dequeued at `now_ms`: its forward by a router (header `x-routed-at-ms`,
/// `routed_at_ms`, by the router's clock), else its publish time (`published_ms`: a request
/// published straight to the partition queue). A forward time that is no time by
/// [`publish_time_ms`] (more than [`MAX_CLOCK_SKEW_MS`] ahead of this host's clock: the router's
/// clock is ahead; or before 2000) gives `None`, no delay, and not the publish time: that would
/// count the request's wait in the input queue and the router, which says nothing about how
/// fast this partition drains its key. (It was taken before: with a
/// router's clock more than 1 s ahead, an input backlog of 2 s counted as queueing in every
/// partition and split each key that carried half of its partition's traffic.)
fn split_enqueued_ms(routed_at_ms: Option<u64>, published_ms: Option<u64>, now_ms: u64) -> Option<u64> {
    match routed_at_ms {
        Some(t) => publish_time_ms(Some(t), None, now_ms),
        None => published_ms,
    }
}

/// Bounds the lines of partition queues found with other settings than configured.
static QUEUE_MISMATCH_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// Declares the partition queue again after it was found missing. A queue found with other
/// settings than configured (someone deleted it and declared it otherwise, e.g. as a classic
/// queue: no single active consumer, no dead-lettering, not bound to the shard exchange) is not
/// consumed: the declare is retried (ERROR line, every [`RESTART_PAUSE`] doubled up to 5 s)
/// until the queue is deleted or set right, while the partition keeps its lease and its requests
/// wait (the router holds the forwards it cannot place). Other failures are left to the next
/// consuming session, as before. `false` when a stop signal came first.
async fn declare_again(conns: &Connections, ctx: &PartitionContext, stop: &StopSignals) -> bool {
    let p = ctx.partition;
    let mut wait = RESTART_PAUSE;
    loop {
        match crate::topology::declare_partition(&conns.consume, &ctx.settings.amqp, p).await {
            Ok(()) => return true,
            Err(e) if e.is_config_error() => crate::error_limited!(
                QUEUE_MISMATCH_LOG,
                partition = p,
                error = %e,
                "the partition queue exists with other settings than configured (deleted and declared again by someone else?); \
                 not consuming it: move any messages it holds to the input queue, then delete it, and the daemon declares it again"
            ),
            Err(e) => {
                warn!(partition = p, error = %e, "could not declare the partition queue; retrying");
                return true;
            }
        }
        tokio::select! {
            _ = stop.stopped() => return false,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}

/// Whether the endpoint serving the partition now ([`LlmClient::endpoint_for`]) is available.
fn endpoint_available(ctx: &PartitionContext) -> bool {
    ctx.llm.available(ctx.llm.endpoint_for(ctx.partition))
}

/// Intake paused: waits until an endpoint of the partition is available (true), or a stop
/// signal or the lease deadline comes first (false). Nothing is held meanwhile.
async fn pause(ctx: &PartitionContext, stop: &StopSignals) -> bool {
    let p = ctx.partition;
    warn!(partition = p, epoch = ctx.epoch, "no LLM endpoint available; intake paused, requests wait in the queue");
    metrics::intake_paused(p, true);
    let resumed = tokio::select! {
        endpoint = wait_for_endpoint(ctx, stop, &stop.abort) => endpoint.is_some(),
        _ = ctx.lease.expired() => {
            warn!(partition = p, epoch = ctx.epoch, "lease deadline passed while paused; stopping the partition");
            ctx.lease.invalidate();
            stop.abort.cancel();
            false
        }
    };
    metrics::intake_paused(p, false);
    if resumed {
        info!(partition = p, epoch = ctx.epoch, "LLM endpoint available again; intake resumed");
    }
    resumed
}

/// The tasks and channels of one consuming session.
struct Session {
    ch: Channel,
    publish: PublishOn,
    batcher: JoinHandle<()>,
    executor: JoinHandle<()>,
}

/// One consuming session: opens the channels, consumes until a stop signal or a restart reason,
/// then ends gracefully (drain, revoke) or at once (abort, restart).
async fn session(conns: &Connections, ctx: &PartitionContext, stop: &StopSignals, held: &Arc<HeldDeliveries>) -> Result<Ended, lapin::Error> {
    let s = &ctx.settings;
    let p = ctx.partition;
    let queue = s.amqp.partition_queue(p);
    let ch = answered("channel.open", conns.consume.create_channel()).await?;
    // One channel at once, so that a session on a broken connection fails here.
    let publish = Arc::new(SharedConfirmChannel::new(conns.publish.clone(), s.amqp.confirm_timeout * 2, format!("partition {p}")));
    if let Err(e) = publish.get().await {
        let _ = close_channel(&ch, "partition publish channel failed").await;
        return Err(e);
    }
    answered("basic.qos", ch.basic_qos(s.amqp.partition_prefetch, BasicQosOptions::default())).await?;
    let tag = format!("{}:p{}:e{}:{}", s.instance_name, p, ctx.epoch, uuid::Uuid::new_v4().simple());
    let consume = ch.basic_consume(queue.as_str().into(), tag.as_str().into(), BasicConsumeOptions::default(), FieldTable::default());
    let mut consumer = match answered("basic.consume", consume).await {
        Ok(c) => c,
        Err(e) => {
            let _ = close_channel(&ch, "partition consume failed").await;
            publish.close("partition consume failed").await;
            return Err(e);
        }
    };
    info!(partition = p, epoch = ctx.epoch, queue = %queue, "partition consuming");
    // Its per-partition series from the start, so that an idle partition shows 0, not no data.
    metrics::buffer_state(p, 0, 0.0);
    metrics::unsettled_deliveries(p, 0);

    let end = SessionEnd::new(&stop.abort, Some(ch.clone()));
    let cap = s.batching.channel_capacity.get();
    let (item_tx, item_rx) = mpsc::channel::<(PrefixKey, Pending)>(cap);
    let (batch_tx, batch_rx) = mpsc::channel::<Batch<PrefixKey, Pending>>(cap);
    let cfg = BatchConfig {
        max_batch_size: s.batching.max_batch_size,
        max_batch_wait: s.batching.max_batch_wait,
        max_buffered: usize::from(s.amqp.partition_prefetch),
    };
    let spent = ctx.buffer_budget.spent_signal();
    // Partial batches wait in their buffers, not in line for a call slot ([`batcher::CallSlots`]).
    let under_way = UnderWay::default();
    let (llm, llm_too, keys) = (ctx.llm.clone(), ctx.llm.clone(), under_way.clone());
    let slots = batcher::CallSlots {
        free: Box::new(move || llm.call_slot_free(llm.endpoint_for(p))),
        in_line: Box::new(move || llm_too.call_waiting(llm_too.endpoint_for(p), |key| keys.contains(key))),
        changed: ctx.llm.call_slots_changed(),
        ended: under_way.ended.subscribe(),
    };
    let batching = batcher::run(cfg, item_rx, batch_tx, stop.revoke.clone(), spent, Some(slots), move |n, age| {
        metrics::buffer_state(p, n, age.map_or(0.0, |d| d.as_secs_f64()))
    });
    let batcher = tokio::spawn(session_task("batcher", p, batching, end.clone()));
    let executing = execute(ctx.clone(), publish.clone(), batch_rx, under_way, stop.clone(), end.clone());
    let executor = tokio::spawn(session_task("executor", p, executing, end.clone()));
    let session = Session { ch, publish, batcher, executor };

    let mut untaken = Vec::new();
    // Exported from the session's start (0), not only from the first pause: an alert or panel on
    // the series sees an owned partition whose intake runs.
    metrics::intake_paused(p, false);
    let ending = intake(ctx, stop, &end, &mut consumer, &conns.dead_letters, &session.publish, &item_tx, held, &mut untaken).await;
    metrics::intake_paused(p, false);
    match ending {
        // A drain or handoff, or an abort whose requests go back uncharged: the batcher drains
        // with reason "shutdown" (or "revoke" if that token fired); after an abort the executor
        // puts back what it is handed.
        Ok(Ended::Stopped) if !stop.abort.is_cancelled() || end.puts_back_at_abort(stop) => {
            drop(item_tx);
            finish(ctx, session, stop, &mut consumer, untaken).await;
            Ok(Ended::Stopped)
        }
        other => {
            // The intake's own restart reason (a cancel by the broker returns `queue_missing`
            // without raising it; a 404 is the queue gone too, as `run` reads it), else the one
            // raised elsewhere.
            let reason = match &other {
                Ok(Ended::Restart(r)) => Some(*r),
                Err(e) if reply_code(e) == Some(NOT_FOUND) => Some(restart::QUEUE_MISSING),
                _ => None,
            };
            close_at_once(ctx, session, &end, stop.abort.is_cancelled(), reason.or(end.reason())).await;
            other
        }
    }
}

/// Runs `task`, the batcher or the executor (`what`) of a session of `partition`, with its panics
/// caught. A panic ends the session (restart `task_panicked`, [`restart::TASK_PANICKED`]): the
/// requests the task held are gone from memory but still unacked, and the channel's close returns
/// them with every other unacked delivery of the session, charged one delivery each (so
/// `amqp.delivery_limit` bounds a request that panics the task every time). Counted in
/// `task_panics_total{stage="batcher"}` and logged at ERROR. Without this, the intake would go on
/// feeding a dead task, and the requests it held would stay unacked until the broker's own
/// `consumer_timeout` closed the channel. A panic in a batch's own task is handled there
/// ([`guarded_batch`]).
async fn session_task(what: &'static str, partition: u32, task: impl std::future::Future<Output = ()>, end: Arc<SessionEnd>) {
    if let Err(panic) = crate::task::catch_panic(task).await {
        error!(partition, panic = %panic, "the partition's {what} panicked; closing its consumer, which returns the requests it held to the queue");
        metrics::task_panicked(stage::BATCHER);
        end.raise(restart::TASK_PANICKED);
    }
}

/// End of a session stopped by a drain or handoff, or by an abort whose requests go back
/// uncharged ([`SessionEnd::puts_back_at_abort`]): no new deliveries taken, everything buffered
/// and in flight finished, then the consumer cancelled ([`wind_down`]). The deliveries the broker
/// sent that the intake had not taken (`untaken`, and those buffered in the consumer: all of
/// them while the intake was paused for an LLM outage) go back to the queue uncharged
/// ([`return_uncharged`]), then the channel is closed once the acks are through.
///
/// After an abort the session's LLM calls were cancelled with it (its token is a child of the
/// abort token) and no result is published any more (the lease is invalid): the batches whose
/// calls were cut put their requests back, and so do those the batcher hands on. Nothing is put
/// back once the instance is closing its connections ([`StopSignals::closing`]). Not bounded as
/// a whole, so that no copy is cut between its confirm and its original's ack (both would come
/// back: a duplicate); each step is (a copy's publish by `amqp.confirm_timeout`, an ack by
/// [`crate::amqp::CLOSE_TIMEOUT`]).
async fn finish(ctx: &PartitionContext, mut s: Session, stop: &StopSignals, consumer: &mut Consumer, untaken: Vec<Delivery>) {
    let aborted = stop.abort.is_cancelled();
    let untaken = wind_down(&mut s, consumer, untaken, ctx.settings.amqp.partition_prefetch).await;
    let put_back = !(aborted && stop.closing.is_cancelled());
    if put_back && !untaken.is_empty() {
        let n = untaken.len();
        let returned = return_uncharged(ctx, &s.publish, untaken).await;
        info!(partition = ctx.partition, epoch = ctx.epoch, returned, deliveries = n, "deliveries not yet taken are back in the partition queue, not charged a delivery");
    }
    let why = if aborted { "partition aborted" } else { "partition released" };
    let _ = close_after_acks(&s.ch, why).await;
    s.publish.close(why).await;
    if aborted {
        metrics::buffer_state(ctx.partition, 0, 0.0);
        info!(partition = ctx.partition, epoch = ctx.epoch, "partition aborted; the requests it held are back in the partition queue, not charged a delivery");
    } else {
        info!(partition = ctx.partition, epoch = ctx.epoch, "partition drained");
    }
}

/// Waits for the session's batcher and executor to end, then cancels its consumer once the
/// broker has nothing in flight to it ([`crate::amqp::cancel_when_full`] with
/// `amqp.partition_prefetch`: 1 or 2 requests per partition queue were charged at a stop under a
/// backlog in `a_stop_under_a_backlog_charges_no_input_delivery` before). Returns the deliveries
/// the intake did not take: `untaken`, and those the broker sent meanwhile. A single active
/// consumer keeps the queue's other messages from the partition's next owner until the cancel
/// anyway.
async fn wind_down(s: &mut Session, consumer: &mut Consumer, mut untaken: Vec<Delivery>, prefetch: u16) -> Vec<Delivery> {
    let (batcher, executor) = (&mut s.batcher, &mut s.executor);
    let tasks = async move {
        let _ = batcher.await;
        let _ = executor.await;
    };
    untaken.extend(crate::amqp::cancel_when_full(&s.ch, consumer, tasks, prefetch).await);
    untaken
}

/// Hard end (lease lost, channel broken, restart for `reason`, one of [`restart`]): stop
/// publishing first, so no result goes out after the requeue, then close the channel so the
/// broker requeues everything unacked, in order.
async fn close_at_once(ctx: &PartitionContext, s: Session, end: &SessionEnd, aborted: bool, reason: Option<&'static str>) {
    end.token.cancel(); // aborts in-flight LLM calls
    s.executor.abort();
    s.batcher.abort();
    let _ = s.executor.await;
    let _ = s.batcher.await;
    let _ = close_channel(&s.ch, "partition consumer closed").await;
    s.publish.close("partition consumer closed").await;
    metrics::buffer_state(ctx.partition, 0, 0.0);
    if aborted {
        info!(partition = ctx.partition, epoch = ctx.epoch, "partition aborted; unacked requests return to the queue");
    } else if reason == Some(restart::QUEUE_MISSING) {
        // The broker deleted the queue's messages with it, the ones this worker held unacked
        // included: nothing returns.
        warn!(partition = ctx.partition, epoch = ctx.epoch, "partition queue was deleted; the requests it held, unacked ones included, were deleted with it");
    } else {
        info!(partition = ctx.partition, epoch = ctx.epoch, reason, "partition consumer closed; unacked requests return to the queue");
    }
}

/// The intake loop of a session: accepts deliveries into the batcher (those that fail the checks
/// go to `dead_letters`) until a stop signal, the lease deadline, a restart reason, or a consumer
/// failure. A delivery received but not taken
/// when a stop came (it waited for the byte budget) goes to `untaken`, still unacked.
// Each argument is a different part of the session's state (see the caller); a struct for
// them would only be built for this call.
#[allow(clippy::too_many_arguments)]
async fn intake(
    ctx: &PartitionContext,
    stop: &StopSignals,
    end: &SessionEnd,
    consumer: &mut Consumer,
    dead_letters: &SharedConfirmChannel,
    results: &SharedConfirmChannel,
    item_tx: &mpsc::Sender<(PrefixKey, Pending)>,
    held: &Arc<HeldDeliveries>,
    untaken: &mut Vec<Delivery>,
) -> Result<Ended, lapin::Error> {
    let s = &ctx.settings;
    let keyed = s.keying.mode != KeyingMode::Off;
    let expired = ctx.lease.expired();
    tokio::pin!(expired);
    let guard_limit = s.amqp.consumer_timeout.mul_f64(CONSUMER_TIMEOUT_GUARD);
    let mut guard = tokio::time::interval((guard_limit / 20).clamp(Duration::from_millis(10), Duration::from_secs(1)));
    let mut paused = false;
    // Since when the intake has been paused without returning what the consumer buffered.
    let mut paused_since: Option<Instant> = None;
    // Last time the consumer received or held a delivery, or was paused (see `check_stall`).
    let mut idle_since = Instant::now();
    let queue = s.amqp.partition_queue(ctx.partition);
    forwards_received(&queue);
    loop {
        let endpoint = pause_while_unavailable(ctx, held, &mut paused);
        if paused {
            paused_since.get_or_insert_with(Instant::now);
        } else {
            paused_since = None;
        }
        tokio::select! {
            biased;
            _ = stop.abort.cancelled() => return Ok(Ended::Stopped),
            _ = &mut expired => {
                // Renew deadline passed and the owner has not aborted us yet: stop on our own, as
                // an abort (in-flight LLM calls are cancelled through the same token).
                warn!(partition = ctx.partition, epoch = ctx.epoch, "lease deadline passed; stopping the partition");
                ctx.lease.invalidate(); // a late renewal must not revive it for in-flight work
                stop.abort.cancel();
                return Ok(Ended::Stopped);
            }
            _ = stop.drain.cancelled() => return Ok(Ended::Stopped),
            _ = stop.revoke.cancelled() => return Ok(Ended::Stopped),
            _ = end.token.cancelled() => return Ok(Ended::Restart(end.reason().unwrap_or(restart::CHANNEL_CLOSED))),
            _ = guard.tick() => {
                check_consumer_timeout(ctx, held, guard_limit, end, |t| publisher::blocked_since(results.connection(), t));
                if paused {
                    idle_since = Instant::now();
                    if paused_since.is_some_and(|t| t.elapsed() >= guard_limit) {
                        if let Some(ended) = return_buffered(ctx, end, consumer, results).await {
                            return ended;
                        }
                        paused_since = Some(Instant::now());
                    }
                } else {
                    check_stall(ctx, held, &mut idle_since, end);
                }
            }
            _ = ctx.llm.wait_available(endpoint, &end.token), if paused => {}
            // Another endpoint of the ranking may come back first.
            _ = tokio::time::sleep(Duration::from_secs(1)), if paused => {}
            next = consumer.next(), if !paused => match next {
                Some(Ok(delivery)) => {
                    idle_since = Instant::now();
                    forwards_received(&queue);
                    held.stalls.store(0, std::sync::atomic::Ordering::Relaxed);
                    let pending = match admit(ctx, stop, end, dead_letters, delivery, held).await {
                        Admission::Admitted(pending) => pending,
                        Admission::Settled => continue,
                        Admission::Untaken(delivery) => {
                            untaken.push(delivery);
                            continue;
                        }
                    };
                    let bkey = if keyed { pending.seat.key } else { PrefixKey(0) };
                    if let Err(mpsc::error::SendError((_, pending))) = item_tx.send((bkey, pending)).await {
                        // The batcher stopped taking: a revoke that came while this delivery was
                        // admitted (it flushed what it held and closed its input), or its end.
                        if stop.revoke.is_cancelled() && !end.token.is_cancelled() {
                            // A graceful end: the delivery goes back uncharged with the other
                            // untaken ones, and the batches in flight finish.
                            untaken.push(pending.seat.delivery);
                            return Ok(Ended::Stopped);
                        }
                        return Ok(Ended::Restart(end.reason().unwrap_or(restart::CHANNEL_CLOSED)));
                    }
                }
                Some(Err(e)) => return consumer_ended(ctx, Some(e)),
                None => return consumer_ended(ctx, None),
            },
        }
    }
}

/// While the intake is paused, the deliveries the broker sent before the prefetch window was
/// spent wait in the consumer's buffer, unseen by the `amqp.consumer_timeout` guard (which sees
/// only held deliveries). After a pause as long as the guard's limit, they go back to the
/// partition queue uncharged ([`return_uncharged`], on the session's publishing channel
/// `out`), before the broker's `consumer_timeout` would close the channel and charge each one a
/// delivery; the broker then sends the next ones, which wait as long again. Called at most once
/// per guard limit while paused. A delivery whose copy the broker did not take stays unacked:
/// the session then ends (restart `consumer_timeout`) so that the channel's close returns it,
/// charged, rather than leaving it unsettled on an open channel. An end of the consumer found
/// in the buffer (a channel error, the broker's cancel) ends the intake as it would have:
/// `Some` is the intake's end.
async fn return_buffered(ctx: &PartitionContext, end: &SessionEnd, consumer: &mut Consumer, out: &SharedConfirmChannel) -> Option<Result<Ended, lapin::Error>> {
    let mut buffered = Vec::new();
    let mut ended = None;
    loop {
        match consumer.next().now_or_never() {
            Some(Some(Ok(delivery))) => buffered.push(delivery),
            Some(Some(Err(e))) => {
                ended = Some(consumer_ended(ctx, Some(e)));
                break;
            }
            Some(None) => {
                ended = Some(consumer_ended(ctx, None));
                break;
            }
            None => break,
        }
    }
    if !buffered.is_empty() {
        let n = buffered.len();
        let returned = return_uncharged(ctx, out, buffered).await;
        warn!(
            partition = ctx.partition,
            epoch = ctx.epoch,
            returned,
            deliveries = n,
            "the LLM outage outlasts the consumer_timeout guard: the deliveries waiting for the intake are back in the partition queue, not charged a delivery"
        );
        if returned < n && ended.is_none() {
            end.raise(restart::CONSUMER_TIMEOUT);
            ended = Some(Ok(Ended::Restart(restart::CONSUMER_TIMEOUT)));
        }
    }
    ended
}

/// The intake's end when its consumer yields error `e`, or ends (`None`: the broker cancelled
/// it, which it does when the queue is deleted).
fn consumer_ended(ctx: &PartitionContext, e: Option<lapin::Error>) -> Result<Ended, lapin::Error> {
    match e {
        Some(e) => Err(e),
        None => {
            warn!(partition = ctx.partition, "the broker cancelled the partition consumer (queue deleted?)");
            Ok(Ended::Restart(restart::QUEUE_MISSING))
        }
    }
}

/// Intake pauses while no endpoint of the partition is available: what is held waits for it
/// (see `infer_through_outages`), the rest waits in the queue (the prefetch is spent). Updates
/// `paused` (gauge and log on each change) and returns the partition's endpoint.
fn pause_while_unavailable(ctx: &PartitionContext, held: &HeldDeliveries, paused: &mut bool) -> usize {
    let endpoint = ctx.llm.endpoint_for(ctx.partition);
    let unavailable = !ctx.llm.available(endpoint);
    if unavailable != *paused {
        *paused = unavailable;
        metrics::intake_paused(ctx.partition, unavailable);
        if unavailable {
            warn!(partition = ctx.partition, epoch = ctx.epoch, "no LLM endpoint available; intake paused, requests wait in the queue");
        } else {
            info!(partition = ctx.partition, epoch = ctx.epoch, "LLM endpoint available again; intake resumed");
            held.consuming_from_now();
        }
    }
    endpoint
}

/// What the backlog poller last saw of one partition queue ([`observe_queue`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueObservation {
    /// Ready messages (passive `queue.declare`: `message-count`).
    pub ready: u32,
    /// When it was seen.
    pub at: Instant,
    /// Since when the queue has held ready messages at every poll; `None` when it had none.
    pub ready_since: Option<Instant>,
}

/// The last [`QueueObservation`] of every partition queue this process polled, by queue name
/// (at most the partitions of the deployments this process serves).
static QUEUE_OBSERVATIONS: std::sync::LazyLock<Mutex<std::collections::HashMap<String, QueueObservation>>> =
    std::sync::LazyLock::new(Default::default);

/// Records what a poll of partition queue `queue` saw (called by the backlog poller every
/// `amqp.backlog_poll_interval`, for every partition queue).
pub fn observe_queue(queue: &str, ready: u32) {
    let now = Instant::now();
    let mut all = QUEUE_OBSERVATIONS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let ready_since = match all.get(queue) {
        _ if ready == 0 => None,
        Some(QueueObservation { ready_since: Some(t), .. }) => Some(*t),
        _ => Some(now),
    };
    all.insert(queue.to_owned(), QueueObservation { ready, at: now, ready_since });
}

fn observation(queue: &str) -> Option<QueueObservation> {
    QUEUE_OBSERVATIONS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(queue).copied()
}

/// Per partition queue, what this process knows of the requests its router forwarded to it.
#[derive(Debug, Default, Clone, Copy)]
struct ForwardWatch {
    /// When the first forward (confirmed by the broker) was sent that this process's consumer of
    /// the queue has not received since: set by [`forwarded_to`], cleared by [`forwards_received`].
    unreceived_since: Option<Instant>,
    /// When the consumer last received a delivery or started.
    last_received: Option<Instant>,
}

/// Per partition queue: [`ForwardWatch`]. An owner that stays idle long after a forward it did
/// not receive has had it taken by another consumer of its queue ([`check_stall`]).
static FORWARD_WATCH: std::sync::LazyLock<Mutex<std::collections::HashMap<String, ForwardWatch>>> =
    std::sync::LazyLock::new(Default::default);

/// Records a forward to partition queue `queue`, sent at `sent_at`, that the broker confirmed
/// (called by the router). A forward sent before the consumer's last receipt is not recorded: on
/// one broker the delivery can reach the consumer before the confirm reaches the router, and
/// recording it then would leave a forward that looks never received after the last request of a
/// burst, and a false alarm once the partition stayed idle for the stall window.
pub fn forwarded_to(queue: &str, sent_at: Instant) {
    let mut all = FORWARD_WATCH.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let w = all.entry(queue.to_owned()).or_default();
    if w.last_received.is_some_and(|r| r >= sent_at) {
        return;
    }
    w.unreceived_since.get_or_insert(sent_at);
}

/// The consumer of `queue` received a delivery or started: earlier forwards are accounted for.
fn forwards_received(queue: &str) {
    let mut all = FORWARD_WATCH.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let w = all.entry(queue.to_owned()).or_default();
    w.unreceived_since = None;
    w.last_received = Some(Instant::now());
}

fn oldest_unreceived_forward(queue: &str) -> Option<Instant> {
    FORWARD_WATCH.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(queue).and_then(|w| w.unreceived_since)
}

/// How long a partition owner may receive nothing while its queue holds ready requests before
/// `check_stall` acts: 2 × `amqp.heartbeat` + 10 s, at least 30 s. A frozen previous owner's
/// consumer stays the single active consumer until the broker's heartbeat check closes its
/// connection (about two heartbeat intervals; 60 s when `amqp.heartbeat` = 0 leaves it to
/// RabbitMQ's default), and a releasing owner cancels its consumer before it drains.
pub fn stall_window(settings: &Settings) -> Duration {
    let heartbeat = match settings.amqp.heartbeat {
        0 => 60,
        h => u64::from(h),
    };
    Duration::from_secs(2 * heartbeat + 10).max(Duration::from_secs(30))
}

/// Partitions of this process whose queue another consumer was found active on, with when it
/// was last found ([`other_consumer_partitions`]).
static OTHER_CONSUMER: Mutex<BTreeMap<u32, std::time::Instant>> = Mutex::new(BTreeMap::new());

/// Records that another consumer is active on partition `p`'s queue (counted in
/// `prefix_batcher_partition_other_consumer_total` too).
fn note_other_consumer(p: u32) {
    metrics::partition_other_consumer();
    OTHER_CONSUMER.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(p, std::time::Instant::now());
}

/// The partitions, sorted, whose queue this process found another consumer active on within
/// the last `within` (2 × [`stall_window`] in the member's health line, so a finding that is
/// not repeated, because the other consumer left or the partition moved, ages out). Its
/// owner receives nothing from such a queue while `status` counts the other consumer as its.
pub fn other_consumer_partitions(within: Duration) -> Vec<u32> {
    let now = std::time::Instant::now();
    let mut found = OTHER_CONSUMER.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    found.retain(|_, at| now.duration_since(*at) <= within);
    found.keys().copied().collect()
}

/// What [`stall_verdict`] concludes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stall {
    /// Nothing to do.
    No,
    /// The queue held ready requests for the whole window and this consumer received nothing.
    /// Either the consumer is stuck (the broker may count deliveries as unacked on it that this
    /// process never got), or another consumer is the queue's single active consumer (a
    /// passive declare counts only the active one, so the two look alike). Restarting the
    /// session cures the first (closing the channel returns what it held) and is harmless in the
    /// second; a stall that persists after a restart is most likely the second.
    Starved { ready: u32 },
}

/// The stall decision (pure): at `now`, a consumer that has received nothing and held nothing
/// since `idle_since`, and the queue's last observation `obs`. A stall needs a fresh
/// observation (within `fresh`) of ready messages, held by the queue since `window` ago or
/// earlier while the consumer was idle all that time.
fn stall_verdict(now: Instant, idle_since: Instant, obs: Option<QueueObservation>, window: Duration, fresh: Duration) -> Stall {
    let Some(o) = obs else { return Stall::No };
    let Some(ready_since) = o.ready_since else { return Stall::No };
    if o.ready == 0 || now.saturating_duration_since(o.at) > fresh {
        return Stall::No;
    }
    if now.saturating_duration_since(ready_since.max(idle_since)) < window {
        return Stall::No;
    }
    Stall::Starved { ready: o.ready }
}

/// The stall check of an intake loop, once per guard tick: restarts the session when its
/// consumer starved for the window (see [`Stall`]); a stall that persists after such a restart
/// is also counted in `prefix_batcher_partition_other_consumer_total` and its warning says what
/// most likely holds the queue. `idle_since` is when the consumer last received a delivery or
/// held one.
fn check_stall(ctx: &PartitionContext, held: &HeldDeliveries, idle_since: &mut Instant, end: &SessionEnd) {
    let now = Instant::now();
    if held.oldest().is_some() {
        *idle_since = now;
        return;
    }
    let s = &ctx.settings;
    let queue = s.amqp.partition_queue(ctx.partition);
    let window = stall_window(s);
    match stall_verdict(now, *idle_since, observation(&queue), window, 3 * s.amqp.backlog_poll_interval) {
        Stall::No => {
            // Nothing waits in the queue, yet a request this process forwarded to it never
            // reached this idle owner: another consumer took it. Its queue's ready count stays at
            // 0, so the stall above never sees this; restarting would not help (the other stays
            // the single active consumer), so it is reported, once per window.
            if let Some(at) = oldest_unreceived_forward(&queue).filter(|at| now.saturating_duration_since((*at).max(*idle_since)) >= window) {
                forwards_received(&queue);
                warn!(partition = ctx.partition, epoch = ctx.epoch, queue = %queue, waited_s = now.duration_since(at).as_secs_f64(), "this instance owns the partition, but a request routed to its queue went to another consumer: another deployment with the same queue names (another redis.url or redis.key_prefix), or a stray client, is the queue's active consumer (rabbitmqctl list_consumers shows it), unless the queue was purged");
                note_other_consumer(ctx.partition);
            }
        }
        Stall::Starved { ready } => {
            let idle_s = now.duration_since(*idle_since).as_secs_f64();
            let in_a_row = held.stalls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if in_a_row == 1 {
                warn!(partition = ctx.partition, epoch = ctx.epoch, queue = %queue, ready, idle_s, "the partition consumer received nothing while its queue held ready requests; restarting it (the broker returns whatever it counted as delivered to it)");
            } else {
                warn!(partition = ctx.partition, epoch = ctx.epoch, queue = %queue, ready, idle_s, restarts = in_a_row - 1, "this instance owns the partition but still receives nothing after restarting its consumer: most likely another consumer is active on its queue (another deployment with the same queue names, or a stray client; rabbitmqctl list_consumers shows it); restarting again");
                note_other_consumer(ctx.partition);
            }
            end.raise(restart::STALLED);
        }
    }
}

/// Ends the session when the oldest unsettled delivery is older than `limit` (0.9 ×
/// `amqp.consumer_timeout`): the broker would otherwise close the channel itself.
fn check_consumer_timeout(ctx: &PartitionContext, held: &HeldDeliveries, limit: Duration, end: &SessionEnd, blocked_since: impl Fn(Instant) -> bool) {
    if let Some(age) = held.oldest().map(|t| t.elapsed()).filter(|age| *age >= limit) {
        warn!(
            partition = ctx.partition,
            age_s = age.as_secs_f64(),
            consumer_timeout_s = ctx.settings.amqp.consumer_timeout.as_secs_f64(),
            "a delivery is held close to the broker's consumer_timeout; requeueing and consuming again"
        );
        held.note_guard_return(limit, blocked_since);
        end.raise(restart::CONSUMER_TIMEOUT);
    }
}

/// What [`admit`] made of a delivery.
// Short-lived (one per delivery, matched at once): boxing the request would cost an allocation
// per delivery for nothing.
#[allow(clippy::large_enum_variant)]
enum Admission {
    /// Parsed and holding its bytes of the budget: for the batcher.
    Admitted(Pending),
    /// Dead-lettered, requeued, or dropped unacked (the channel's close returns it).
    Settled,
    /// A stop, a restart or the lease's deadline came while it waited for the byte budget: not
    /// taken, still unacked.
    Untaken(Delivery),
}

/// Takes the delivery's bytes from the budget (waiting while it is spent), then parses it
/// ([`accept`]).
async fn admit(ctx: &PartitionContext, stop: &StopSignals, end: &SessionEnd, dead_letters: &SharedConfirmChannel, delivery: Delivery, held: &Arc<HeldDeliveries>) -> Admission {
    // The broker counts `consumer_timeout` from its delivery, so a wait for the byte budget counts.
    let received = Instant::now();
    let budget = ctx.settings.batching.max_buffered_bytes.get().min(Semaphore::MAX_PERMITS);
    let bytes = u32::try_from(delivery.data.len().clamp(1, budget)).unwrap_or(u32::MAX);
    let permit = tokio::select! {
        biased;
        _ = stop.stopped() => return Admission::Untaken(delivery),
        _ = end.token.cancelled() => return Admission::Untaken(delivery),
        p = ctx.buffer_budget.take(bytes) => match p {
            Some(p) => p,
            None => return Admission::Settled,
        },
        // The lease's deadline ends the wait for the budget too: back in its loop, the intake
        // finds the deadline passed first and stops.
        () = ctx.lease.expired() => return Admission::Untaken(delivery),
    };
    match accept(ctx, dead_letters, delivery, held.hold(permit, received)).await {
        Some(pending) => Admission::Admitted(pending),
        None => Admission::Settled,
    }
}


/// A partition session's publishing channel (shared by its publishes, replaced after a failed
/// one: [`SharedConfirmChannel`]) and its connection, which also serves the direct reply-to
/// checks and declares a deleted destination again.
type PublishOn = Arc<SharedConfirmChannel>;

/// The last `<seq>` of a `batch_id` (`<partition>-<epoch>-<seq>`): one counter for the process,
/// so a batch id never repeats while the process runs, not even after a partition's consumer
/// restarted within its epoch (a deleted queue, a closed channel), which began its count again.
static BATCH_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The prefix keys of a partition's batches under way (each key once per batch), for the
/// batcher's question whether one of them waits for a call slot ([`batcher::CallSlots`]), and a
/// signal at the end of each. Cloning gives another handle to the same set.
#[derive(Clone)]
struct UnderWay {
    keys: Arc<Mutex<HashMap<u64, usize>>>,
    ended: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for UnderWay {
    fn default() -> Self {
        UnderWay { keys: Arc::default(), ended: Arc::new(tokio::sync::watch::Sender::new(0)) }
    }
}

impl UnderWay {
    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<u64, usize>> {
        self.keys.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a batch of prefix key `key` is under way.
    fn contains(&self, key: u64) -> bool {
        self.keys().contains_key(&key)
    }

    /// Counts a batch of prefix key `key` under way until the returned guard is dropped.
    fn begin(&self, key: u64) -> BatchUnderWay {
        *self.keys().entry(key).or_default() += 1;
        BatchUnderWay { set: self.clone(), key }
    }
}

/// One batch of [`UnderWay`]; its drop counts it out and signals the end.
struct BatchUnderWay {
    set: UnderWay,
    key: u64,
}

impl Drop for BatchUnderWay {
    fn drop(&mut self) {
        let mut keys = self.set.keys();
        if let Some(n) = keys.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                keys.remove(&self.key);
            }
        }
        drop(keys);
        self.set.ended.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// The executor: one task per batch until the batcher's output closes, then waits for them all.
/// Results are published on the channel of `out` ([`SharedConfirmChannel`]); its connection serves the
/// direct reply-to checks ([`publisher::direct_reply_to_present`]).
/// The LLM client's per-endpoint semaphore bounds the concurrent calls.
async fn execute(
    ctx: PartitionContext,
    out: PublishOn,
    mut batch_rx: mpsc::Receiver<Batch<PrefixKey, Pending>>,
    under_way: UnderWay,
    stop: StopSignals,
    end: Arc<SessionEnd>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            batch = batch_rx.recv() => match batch {
                Some(batch) => {
                    let seq = BATCH_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                    let batch_id = format!("{}-{}-{}", ctx.partition, ctx.epoch, seq);
                    let span = info_span!("batch", partition = ctx.partition, batch_id = %batch_id, key = %batch.key);
                    // Counted out of `under_way` when the task ends, however it ends.
                    let finishing = under_way.begin(batch.key.0);
                    let run = guarded_batch(ctx.clone(), out.clone(), batch, batch_id, stop.clone(), end.clone()).instrument(span);
                    tasks.spawn(futures_util::FutureExt::map(run, move |()| drop(finishing)));
                }
                None => break,
            },
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// Runs [`process_batch`] with its panics caught: the requests of a batch whose task panicked are
/// nacked with requeue (the delivery limit then bounds a poison message), counted in
/// `task_panics_total{stage="batcher"}`, and logged.
async fn guarded_batch(
    ctx: PartitionContext,
    out: PublishOn,
    batch: Batch<PrefixKey, Pending>,
    batch_id: String,
    stop: StopSignals,
    end: Arc<SessionEnd>,
) {
    let ackers: Vec<(String, Acker)> = batch.items.iter().map(|p| (p.req.id.clone(), p.seat.delivery.acker.clone())).collect();
    let Err(message) = crate::task::catch_panic(process_batch(ctx, out, batch, batch_id, stop, end)).await else { return };
    error!(panic = %message, requests = ackers.len(), "a batch task panicked; requeueing its requests");
    metrics::task_panicked(stage::BATCHER);
    let why = format!("panic: {message}");
    for (id, acker) in ackers.iter().filter(|(_, a)| a.usable()) {
        publisher::requeue(acker, id, &why).await;
    }
}

/// Parses a delivery from a partition queue. The router validated it already; a message that
/// still fails (e.g. published straight to a partition queue) is dead-lettered and acked
/// ([`publisher::parse_or_dead_letter`]), or requeued when that was not possible.
async fn accept(ctx: &PartitionContext, dead_letters: &SharedConfirmChannel, delivery: Delivery, held: Held) -> Option<Pending> {
    let s = &ctx.settings;
    // Its outcome from an earlier delivery is still being published (its channel closed under
    // it, or the guard returned it while the publishing connection was blocked): settled by that
    // outcome, apart from the intake.
    let forward = redelivery::forward_key(delivery.properties.headers().as_ref());
    if let Some(key) = forward.filter(|k| delivery.redelivered && redelivery::outcome_in_flight(*k)) {
        tokio::spawn(settle_after_earlier_outcome(ctx.partition, delivery, key));
        return None;
    }
    if redelivery::answered_before(delivery.redelivered, delivery.properties.headers().as_ref()) {
        let id = delivery.properties.message_id().as_ref().map_or_else(String::new, |m| m.to_string());
        drop_copy(ctx.partition, delivery, &id, "a request answered before, delivered again (its ack was lost with a channel)").await;
        return None;
    }
    let mut reason = "";
    let checked = match publisher::check_delivery(&s.amqp, &s.requests, &delivery, Source::Partition) {
        Ok(req) => match ctx.reply_nodes.refusal(delivery.properties.reply_to().as_ref().map(|r| r.as_str()), &req.id).await {
            None => Ok(req),
            Some(e) => Err(publisher::Refusal { reason: e.reason(), detail: e.to_string(), request_id: Some(req.id) }),
        },
        Err(r) => Err(r),
    };
    let intake = match checked {
        Ok(req) => Intake::Valid(req, delivery),
        Err(r) => {
            reason = r.reason;
            publisher::dead_letter_and_ack(dead_letters, &s.amqp, delivery, r.request_id.as_deref(), r.reason, &r.detail, Some(&ctx.lease)).await
        }
    };
    let (req, delivery) = match intake {
        Intake::Valid(req, delivery) => (req, delivery),
        Intake::DeadLettered => return None,
        Intake::Unacked(delivery) => {
            // The dead letter was not confirmed (or the lease is gone): back to the queue, not
            // held until the channel closes. While the lease holds, after a backoff
            // (`redelivery::requeue_backoff`), so that a broker fault does not use up the
            // request's deliveries in milliseconds; the intake goes on meanwhile.
            let id = delivery.properties.message_id().as_ref().map_or_else(String::new, |m| m.to_string());
            let earlier = redelivery::delivery_count(Source::Partition, delivery.redelivered, delivery.properties.headers().as_ref());
            let wait = if ctx.lease.is_valid() { redelivery::requeue_backoff(&s.amqp, earlier) } else { Duration::ZERO };
            tokio::spawn(async move {
                tokio::time::sleep(wait).await;
                publisher::requeue(&delivery.acker, &id, &format!("its dead letter (reason {reason}) was not confirmed")).await;
            });
            return None;
        }
    };
    let fingerprint = publisher::request_fingerprint(&req.id, &delivery.data, &delivery.properties);
    if redelivery::is_second_copy(fingerprint, delivery.redelivered, delivery.properties.headers().as_ref()) {
        drop_copy(ctx.partition, delivery, &req.id, "a second copy of a request taken before (forwarded again from a redelivered input message, or a forward published again)").await;
        return None;
    }
    metrics::requests(stage::BATCHER, outcome::RECEIVED, 1);
    held.identify(&req.id, forward);
    let headers = delivery.properties.headers().as_ref();
    let shard = header_u64(headers, HEADER_SHARD).unwrap_or(0) as u32;
    // Millisecond publish time when the publisher (or RabbitMQ's message-timestamp plugin) set
    // header `timestamp_in_ms`; else the AMQP `timestamp`, whole seconds only.
    let now = unix_ms();
    let enqueued_unix_ms = publish_time_ms(header_u64(headers, HEADER_TIMESTAMP_MS), *delivery.properties.timestamp(), now);
    let queued_ms = enqueued_unix_ms.map_or(0, |t| now.saturating_sub(t));
    // The split rule's delay: in the partition queue only (from the router's forward; a request
    // published straight to the partition queue, from its publish), while the partition consumed.
    let forwarded = split_enqueued_ms(header_u64(headers, HEADER_ROUTED_AT_MS), enqueued_unix_ms, now);
    let key = crate::splits::batch_key(s, ctx.partition, &req, headers, held.owner.split_queued_ms(forwarded, now));
    let seat = Seat { delivery, id: req.id.clone(), key, shard, received: held.received, queued_ms, enqueued_unix_ms, _held: held };
    Some(Pending { req, seat })
}

static COPY_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// Settles a redelivered forward whose outcome (a result or a dead letter) from an earlier
/// delivery this process is still publishing ([`redelivery::OutcomeInFlight`]), once that
/// publish ends: acked without processing when the broker confirmed it (counted as a
/// duplicate), else requeued, that return noted uncharged
/// ([`redelivery::note_uncharged_return`]): the earlier outcome's fate, not the request, kept
/// it. Without this, a redelivery at `amqp.delivery_limit` was dead-lettered while its result
/// was still on its way, and one below it answered twice.
async fn settle_after_earlier_outcome(partition: u32, delivery: Delivery, key: u128) {
    let id = delivery.properties.message_id().as_ref().map_or_else(String::new, |m| m.to_string());
    if redelivery::earlier_outcome(key).await == redelivery::Earlier::Confirmed {
        drop_copy(partition, delivery, &id, "a request whose answer was still being published, delivered again").await;
    } else {
        redelivery::note_uncharged_return(key);
        publisher::requeue(&delivery.acker, &id, "delivered again while the outcome of an earlier delivery was being published; that publish was not confirmed").await;
    }
}

/// Acks, without processing, a delivery whose request this process answered or took before
/// ([`redelivery::answered_before`], [`redelivery::is_second_copy`]; `what` says which, for the
/// log) and counts it in `requests_total{stage="batcher",outcome="duplicate"}`. When the ack
/// fails (the channel closed), the broker returns the delivery as redelivered and it is
/// processed unless answered before: at worst answered twice, never lost.
async fn drop_copy(partition: u32, delivery: Delivery, id: &str, what: &str) {
    match crate::amqp::ack(&delivery.acker).await {
        Ok(()) => {
            metrics::requests(stage::BATCHER, outcome::DUPLICATE, 1);
            crate::info_limited!(COPY_LOG, partition, request_id = %id, "{what}: acked without processing");
        }
        Err(e) => debug!(partition, request_id = %id, error = %e, "a copy could not be acked; the broker returns it"),
    }
}

/// Runs one batch: LLM call, then per request: a confirmed result and its ack, or (server fault)
/// a nack with requeue. A request answered while other calls of the batch still run is settled
/// at once ([`crate::llm::EarlyAnswers`]). Ends the session when a channel was lost.
///
/// **A server-wide failure is not a request's failure.** The call waits for an available endpoint
/// ([`wait_for_endpoint`]). When items come back with a server fault,
/// [`LlmClient::confirm_server_fault`] asks the endpoint (a probe) whose fault it was: if the
/// endpoint is down, the items wait in memory, unacked, for an endpoint and go again (an outage
/// costs them no delivery, however long it lasts); if it answers, the fault may be the requests'
/// own and they are nacked with requeue, so `amqp.delivery_limit` bounds a poison request. This
/// holds for a 5xx and for an invalid 2xx answer alike (both are server faults to the partition;
/// only a 4xx refusal of the request itself gives an `ok: false` result), and such answers of a
/// healthy server never open the endpoint's breaker (see [`crate::breaker`]): a poison request
/// is charged, not the other partitions on the endpoint.
async fn process_batch(
    ctx: PartitionContext,
    out: PublishOn,
    batch: Batch<PrefixKey, Pending>,
    batch_id: String,
    stop: StopSignals,
    end: Arc<SessionEnd>,
) {
    let n = batch.items.len();
    // Flushed after the session's end (an abort, or the batcher's last flush during a hard
    // stop): no call; the requests go back uncharged if the abort allows it, else with the
    // channel's close.
    if end.token.is_cancelled() {
        let seats = batch.items.into_iter().map(|p| p.split().1).collect();
        put_back_unanswered(&ctx, &out, seats, CallsEnded::Stopped, &stop, &end).await;
        return;
    }
    record_flush(&batch);
    let flushed = Instant::now();
    // Requests charged a delivery before go after the others (stable: arrival order otherwise).
    // Prompts sent one after the other wait for those before them, and the sequence is cut once
    // timeouts used its time ([`LlmClient::infer_within`]): a request that timed out before and
    // came back must not keep the fresh ones of its key behind it, delivery after delivery.
    let mut batch = batch;
    batch.items.sort_by_key(|p| redelivery::delivery_count(Source::Partition, p.seat.delivery.redelivered, p.seat.delivery.properties.headers().as_ref()));
    let (reqs, seats): (Vec<Request>, Vec<Seat>) = batch.items.into_iter().map(Pending::split).unzip();
    let oldest = seats.iter().map(|s| s.received).min().unwrap_or(flushed);
    let mut seats: Vec<Option<Seat>> = seats.into_iter().map(Some).collect();

    let tenure = Tenure { partition: ctx.partition, epoch: ctx.epoch, instance: &ctx.settings.instance_name, lease: &ctx.lease };
    let info = BatchInfo { partition: ctx.partition, batch_id: &batch_id, batch_size: n };
    let (requeue, release) = ([&end.token, &stop.abort], [&stop.drain, &stop.revoke]);
    let settle = Settle { ctx: &ctx, out: &out, tenure, info, hold: HoldEnds { requeue: &requeue, release: &release }, end: &end, flushed };
    let settle_one = |seat: Seat, answer: Answer, llm_ms: u64| {
        let span = info_span!("request", request_id = %seat.id, shard = seat.shard);
        settle.one(seat, answer, llm_ms).instrument(span)
    };
    // Requests answered while other calls of the batch still run (a slow prompt's retries, the
    // slowest chat call) are settled at once, not held until the batch's calls end: with the
    // defaults a prompt that keeps timing out would hold its batch-mates' results for up to
    // `llm.max_attempts` × `llm.request_timeout`.
    let (early_tx, mut early_rx) = mpsc::unbounded_channel::<(usize, Result<crate::llm::Completion, LlmError>)>();
    let early = move |i: usize, answer: &Result<crate::llm::Completion, LlmError>| {
        let _ = early_tx.send((i, answer.clone()));
    };
    let mut early_settles = futures_util::stream::FuturesUnordered::new();
    let mut settlements = Vec::with_capacity(n);
    let answers = {
        let items: Vec<InferenceItem<'_>> = reqs
            .iter()
            .map(|r| InferenceItem { body: &r.body, model: r.model.as_deref(), params: &r.params, prefix_key: Some(batch.key.0) })
            .collect();
        let ids: Vec<&str> = reqs.iter().map(|r| r.id.as_str()).collect();
        // `None`: stopping, lease lost or session ending. Nothing is settled here; the channel's
        // close returns these requests — except after a drain or handoff that found them waiting
        // for an endpoint, or a drain whose time ran out before the calls answered, which put
        // them back uncharged.
        let cutoff = drain_call_cutoff(ctx.settings.drain_timeout);
        let calls = async {
            tokio::select! {
                answers = infer_through_outages(&ctx, &items, &ids, release_at(&ctx.settings, oldest), &stop, &end, &early) => answers.ok_or(CallsEnded::Stopped),
                () = calls_cut(&stop.drain, cutoff) => Err(CallsEnded::DrainTimeRanOut),
            }
        };
        tokio::pin!(calls);
        loop {
            tokio::select! {
                biased;
                answers = &mut calls => break answers,
                Some((i, answer)) = early_rx.recv() => {
                    if let Some(seat) = seats.get_mut(i).and_then(Option::take) {
                        early_settles.push(settle_one(seat, Some(answer), flushed.elapsed().as_millis() as u64));
                    }
                }
                Some(settled) = early_settles.next(), if !early_settles.is_empty() => settlements.push(settled),
            }
        }
    };
    let Outcomes { results, put_back_first } = match answers {
        Ok(outcomes) => outcomes,
        Err(why) => {
            // The requests settled meanwhile end their publishes first.
            while early_settles.next().await.is_some() {}
            put_back_unanswered(&ctx, &out, seats.into_iter().flatten().collect(), why, &stop, &end).await;
            return;
        }
    };
    // From the flush to the answers: the calls, their retries and any wait for an endpoint
    // through an outage (`timings_ms.llm`, less each request's permit wait).
    let llm_ms = flushed.elapsed().as_millis() as u64;
    let settles = settle_order(seats, results, &put_back_first).into_iter().map(|(seat, answer)| settle_one(seat, answer, llm_ms));
    let (rest, earlier) = futures_util::future::join(futures_util::future::join_all(settles), early_settles.collect::<Vec<_>>()).await;
    settlements.extend(earlier.into_iter().chain(rest));
    // A consuming channel found closed (an ack or nack failed), or a closed publishing connection:
    // end the session, which consumes again (or reconnects). A publishing channel the broker
    // closed does not end it: the held results go again on a new one
    // ([`publisher::publish_result`]), and ending the session would charge every delivery in
    // flight on the partition a delivery. Not after an abort: the session ends anyway, and a
    // reason raised would keep the other batches from putting their requests back uncharged
    // ([`SessionEnd::puts_back_at_abort`]).
    let lost = settlements.iter().any(|s| matches!(s, Settlement::ChannelLost | Settlement::Left)) || !out.connection().status().connected();
    if lost && !stop.abort.is_cancelled() {
        end.raise(restart::CHANNEL_CLOSED);
    }
}

/// Counts a flushed batch: its size, flush reason, batch purity and shared-prefix ratio.
fn record_flush(batch: &Batch<PrefixKey, Pending>) {
    let n = batch.items.len();
    let purity = batcher::purity(batch.items.iter().map(|p| p.seat.key));
    let texts: Vec<std::borrow::Cow<'_, str>> = batch.items.iter().map(|p| p.req.body.text_for_stats()).collect();
    let shared = batcher::shared_prefix_ratio(&texts);
    metrics::batch_flushed(batch.reason, n, purity, shared);
    debug!(size = n, reason = batch.reason.as_str(), purity, "batch flushed");
}

/// The batch's requests not settled yet (`None`: settled as answered while the calls ran)
/// paired with their answers, in the order they are settled (and so put back): the answered
/// ones, then those going back uncharged in the order [`infer_through_outages`] gives
/// (`put_back_first`), then any other.
fn settle_order(items: Vec<Option<Seat>>, results: Vec<Answer>, put_back_first: &[usize]) -> Vec<(Seat, Answer)> {
    let mut paired: Vec<Option<(Seat, Answer)>> = items.into_iter().zip(results).map(|(seat, answer)| seat.map(|s| (s, answer))).collect();
    let mut ordered = Vec::with_capacity(paired.len());
    ordered.extend(paired.iter_mut().filter(|p| p.as_ref().is_some_and(|(_, a)| a.is_some())).filter_map(Option::take));
    ordered.extend(put_back_first.iter().filter_map(|&i| paired.get_mut(i).and_then(Option::take)));
    ordered.extend(paired.into_iter().flatten());
    ordered
}

/// What settling one request of an answered batch needs ([`Settle::one`]).
struct Settle<'a> {
    ctx: &'a PartitionContext,
    out: &'a PublishOn,
    tenure: Tenure<'a>,
    info: BatchInfo<'a>,
    hold: HoldEnds<'a>,
    /// The session's end.
    end: &'a SessionEnd,
    /// When the batch was flushed.
    flushed: Instant,
}

impl Settle<'_> {
    /// Settles one request: its result published and the delivery acked, or the delivery
    /// requeued (a server fault: charged) or put back uncharged (`None`: still waiting for an
    /// endpoint while the rest of its batch was answered, [`infer_through_outages`]). `llm_ms`:
    /// from the flush to its answer (`timings_ms.llm` before its permit wait).
    async fn one(&self, pending: Seat, answer: Answer, llm_ms: u64) -> Settlement {
        // `pending` whole until the delivery is settled: its `Held` counts for the byte budget,
        // the `unsettled_deliveries` gauge, the consumer_timeout guard and the stall check (a
        // result held while the broker refuses results looked like an idle consumer, whose
        // restart charged every held request a delivery).
        let (ctx, pool) = (self.ctx, &**self.out);
        let Some(answer) = answer else {
            return if return_uncharged(ctx, pool, vec![pending.delivery]).await == 1 { Settlement::Requeued } else { Settlement::ChannelLost };
        };
        let answer = match answer {
            Err(e) if e.fault() != Fault::Request => {
                return publisher::requeue(&pending.delivery.acker, &pending.id, &e.to_string()).await;
            }
            answer => answer,
        };
        let batch_wait = self.flushed.saturating_duration_since(pending.received).as_millis() as u64;
        let llm_wait = answer.as_ref().map_or(0, |c| c.permit_wait.as_millis() as u64);
        let timings = TimingsMs { queued: pending.queued_ms, batch_wait, llm: llm_ms.saturating_sub(llm_wait), llm_wait };
        let (id, key) = (pending.id.clone(), pending.key.to_string());
        let Some(result) = publisher::shape_result(self.info, id, key, pending.shard, timings, answer) else {
            return publisher::requeue(&pending.delivery.acker, &pending.id, "cancelled").await;
        };
        match publisher::publish_result(pool, &ctx.settings.amqp, self.tenure, pending.delivery, result, pending.enqueued_unix_ms, self.hold).await {
            ResultEnd::Settled(settlement) => settlement,
            // A graceful stop while the broker refused this result, or the lease deadline passed
            // before it was published: put the request back uncharged; if its copy is not
            // confirmed either, or the consuming channel is closed already (the broker returns
            // the original: a copy would be a duplicate), the channel's close returns it
            // (charged, as before).
            ResultEnd::Released(delivery) => {
                if !self.end.consuming() {
                    return Settlement::ChannelLost;
                }
                if return_uncharged(ctx, pool, vec![*delivery]).await == 1 {
                    Settlement::Requeued
                } else {
                    Settlement::ChannelLost
                }
            }
        }
    }
}

/// A batch whose calls ended without answers ([`CallsEnded`]): on a graceful stop (drain or
/// handoff, not an abort or the session's end) and on an abort that allows it
/// ([`SessionEnd::puts_back_at_abort`]) its requests go back to the partition queue uncharged;
/// otherwise (a restart, a hard stop) nothing is settled here and the channel's close returns
/// them.
async fn put_back_unanswered(ctx: &PartitionContext, out: &PublishOn, items: Vec<Seat>, why: CallsEnded, stop: &StopSignals, end: &SessionEnd) {
    let aborted = end.puts_back_at_abort(stop);
    let graceful = (stop.drain.is_cancelled() || stop.revoke.is_cancelled()) && !end.token.is_cancelled();
    if aborted || graceful {
        let n = items.len();
        let returned = return_uncharged(ctx, out, items.into_iter().map(|p| p.delivery).collect()).await;
        match why {
            _ if aborted => debug!(
                partition = ctx.partition,
                epoch = ctx.epoch,
                returned,
                requests = n,
                "partition aborted: a batch's requests are back in the partition queue, not charged a delivery"
            ),
            CallsEnded::Stopped => info!(
                partition = ctx.partition,
                epoch = ctx.epoch,
                returned,
                requests = n,
                "stopped while the LLM endpoint was down: its waiting requests are back in the partition queue, not charged a delivery"
            ),
            CallsEnded::DrainTimeRanOut => crate::warn_limited!(
                DRAIN_CUT_LOG,
                partition = ctx.partition,
                epoch = ctx.epoch,
                returned,
                requests = n,
                drain_timeout = ?ctx.settings.drain_timeout,
                waited = ?drain_call_cutoff(ctx.settings.drain_timeout),
                "the drain's time ran out before the LLM answered these requests: they are back in the partition queue, not charged a delivery, and the server's work on them is lost; raise shutdown.drain_timeout above the longest generation to let such calls finish"
            ),
        }
    }
}

/// Why [`process_batch`] got no answers.
enum CallsEnded {
    /// A stop signal or the session's end came first ([`infer_through_outages`] gave `None`).
    Stopped,
    /// The drain's time for LLM calls ([`drain_call_cutoff`]) ran out first.
    DrainTimeRanOut,
}

/// Bounds the lines of drains whose time ran out before the LLM answered (one per batch).
static DRAIN_CUT_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// How long a drain waits for the LLM calls in flight: `shutdown.drain_timeout` less a reserve
/// of a quarter of it, at most 5 s, for what must follow before the drain's deadline (putting the
/// unanswered requests back, releasing the leases, closing the connection).
///
/// A call still running then is abandoned, and its requests go back to their partition queue
/// uncharged (`return_uncharged`). Left to the deadline instead, the hard stop would close the
/// channel, which returns them *charged* one delivery each (a quorum queue counts every return,
/// <https://www.rabbitmq.com/docs/quorum-queues#poison-message-handling>): a rolling restart
/// during generations longer than the drain would then dead-letter valid requests after
/// `amqp.delivery_limit` restarts, and the stop would exit 70.
pub fn drain_call_cutoff(drain_timeout: Duration) -> Duration {
    drain_timeout - (drain_timeout / 4).min(DRAIN_RESERVE)
}

/// The most [`drain_call_cutoff`] keeps back from `shutdown.drain_timeout`.
pub const DRAIN_RESERVE: Duration = Duration::from_secs(5);

/// Completes `cutoff` after `drain` fires (never when it does not). The drain token fires for
/// every partition at the start of the shutdown, so a batch flushed by the drain itself starts
/// its wait within milliseconds of the drain's start.
async fn calls_cut(drain: &CancellationToken, cutoff: Duration) {
    drain.cancelled().await;
    tokio::time::sleep(cutoff).await;
}

/// Bounds the per-batch lines of [`infer_through_outages`]: an outage reaches every batch
/// ([`crate::log_limit`]); the breaker's own lines say when the endpoint goes down and comes back.
static WAITING_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// The LLM answers of `items`, one per item in order. Items
/// that meet a server fault while their endpoint is down ([`LlmClient::confirm_server_fault`])
/// wait for an available endpoint and go again; but once part of the batch is answered, an
/// outage ends the wait: the answered items get their answers and the waiting ones `None` (the
/// caller puts them back in the partition queue uncharged). When the endpoint answers the probe instead, the
/// fault may be one request's own (a prompt that crashes the server fails the list call it
/// shares with others): several items that failed together go again once, one call each, so only
/// the offender keeps its server fault (not for request timeouts: a list call that timed out
/// already went again prompt by prompt). Every call ends by `release_at` ([`release_at`]:
/// before the `amqp.consumer_timeout` guard would return the requests charged): prompts not sent
/// because the prompts before them, or the wait for an endpoint permit, used the time
/// ([`LlmClient::infer_within`]) get `None` too, and so do the items still waiting when waiting
/// for an endpoint (in any round) or another round of calls would keep them past `release_at`.
/// A request that was in flight when its endpoint went down twice goes alone, one call at a time
/// per endpoint, and an outage during that call charges it ([`charge_crash_suspects`]): a prompt
/// that crashes the server is still down at the probe, so it would wait uncharged for ever.
/// `None` when a stop signal or the session's end comes first. Answers that are final while
/// other calls of a round still run also go to `early`, by item index ([`EarlyAnswers`]).
async fn infer_through_outages(
    ctx: &PartitionContext,
    items: &[InferenceItem<'_>],
    ids: &[&str],
    release_at: Instant,
    stop: &StopSignals,
    end: &SessionEnd,
    early: EarlyAnswers<'_>,
) -> Option<Outcomes> {
    let mut results: Vec<Answer> = items.iter().map(|_| None).collect();
    let mut todo: Vec<usize> = (0..items.len()).collect();
    // Prompts a sequence did not send because the batch's time for LLM calls ran out: they go
    // back first, whatever happens to the rest.
    let mut not_sent: Vec<usize> = Vec::new();
    let mut one_by_one = false;
    let mut first = true;
    loop {
        // A wait for the endpoint that would keep the requests past `release_at` ends here, in
        // every round: they go back uncharged, the ones not sent yet first (the next delivery
        // sends them first, so a batch whose slow requests keep the endpoint down cannot keep
        // the others from being sent, delivery after delivery). Also in the first round: a batch
        // that flushed while every endpoint was down (its requests taken before the breaker
        // opened) waited without a bound, until the `amqp.consumer_timeout` guard returned
        // them charged. An endpoint available now is taken, even past `release_at`.
        let endpoint = tokio::select! {
            biased;
            endpoint = wait_for_endpoint(ctx, stop, &end.token) => endpoint?,
            () = tokio::time::sleep_until(release_at) => return Some(Outcomes::released(results, not_sent, todo, ctx.partition)),
        };
        // A later round only with time for one whole call left; in the first, the calls check
        // their own time ([`LlmClient::infer_within`]).
        if !first && release_at.saturating_duration_since(Instant::now()) < ctx.settings.llm.request_timeout {
            return Some(Outcomes::released(results, not_sent, todo, ctx.partition));
        }
        first = false;
        let call: Vec<InferenceItem<'_>> = todo.iter().map(|&i| items[i]).collect();
        // Requests that were in flight when an endpoint went down, twice, go alone, one at a
        // time per endpoint ([`isolated_calls`]).
        let outages: Vec<u32> = todo.iter().map(|&i| redelivery::outages_during_calls(ids[i])).collect();
        let isolated: Vec<bool> = outages.iter().map(|&n| n >= redelivery::OUTAGES_BEFORE_ISOLATION).collect();
        // `lane`: the isolation lane, held from a call sent alone that met a server fault until
        // its verdict, so the next request sent alone does not meet the same outage.
        let round_early = |j: usize, answer: &Result<crate::llm::Completion, LlmError>| early(todo[j], answer);
        let (answers, lane) = call_round(ctx, endpoint, &call, &isolated, one_by_one, release_at, &end.token, &round_early).await;
        if end.token.is_cancelled() {
            return None;
        }
        for ((&i, answer), _) in todo.iter().zip(&answers).zip(&outages).filter(|(_, n)| **n > 0) {
            if answer.is_ok() {
                redelivery::forget_outages_during_calls(ids[i]);
            }
        }
        let server_faults = answers.iter().filter(|a| a.as_ref().is_err_and(|e| e.fault() == Fault::Server)).count();
        // The verdict (a probe, and maybe a replay of a real call) may take as long as a call or
        // two: not past `release_at`, nor past the session's end.
        let outage = server_faults > 0
            && match verdict_by(release_at, &end.token, ctx.llm.confirm_server_fault(endpoint)).await {
                Verdict::Given(outage) => outage,
                Verdict::Ended => return None,
                Verdict::Late => {
                    // No verdict in time: the items that met a server fault go back uncharged,
                    // as in an outage near `amqp.consumer_timeout`; the answers go out.
                    let again = sort_answers(todo, answers, &mut results, &mut not_sent, true);
                    return Some(Outcomes::released(results, not_sent, again, ctx.partition));
                }
            };
        let (round, answers) = if outage { charge_crash_suspects(ctx, ids, todo, answers, &isolated, &mut results) } else { (todo, answers) };
        drop(lane);
        // Isolate a possible offender once; an outage resets nothing (the items wait and go again).
        // Not for request timeouts: a list call that timed out went again prompt by prompt
        // already ([`LlmClient::infer_within`]), so each of them is a prompt's own call.
        let to_isolate = answers
            .iter()
            .filter(|a| a.as_ref().is_err_and(|e| e.fault() == Fault::Server && !matches!(e.kind, ErrorKind::Timeout | ErrorKind::Unavailable)))
            .count();
        let isolate = !outage && !one_by_one && to_isolate > 1;
        one_by_one |= isolate;
        let again = sort_answers(round, answers, &mut results, &mut not_sent, outage || isolate);
        if again.is_empty() {
            return Some(Outcomes { results, put_back_first: not_sent });
        }
        // An outage with some of the batch answered already: their results go out now, and the
        // items still waiting go back to the partition queue uncharged (`None`), instead of
        // holding the answered ones until the endpoint answers the rest, which a request that
        // outlasts `llm.request_timeout` on its own may never let happen.
        if outage && results.iter().any(Option::is_some) {
            crate::warn_limited!(
                WAITING_LOG,
                partition = ctx.partition,
                endpoint,
                answered = results.iter().filter(|r| r.is_some()).count(),
                waiting = again.len(),
                "LLM endpoint down with part of a batch settled (answered, or charged as a request that may crash the server): its answers go out now, the rest goes back to the partition queue, not charged a delivery"
            );
            not_sent.extend(again);
            return Some(Outcomes { results, put_back_first: not_sent });
        }
        log_going_again(ctx, endpoint, again.len(), outage);
        todo = again;
    }
}

/// What [`verdict_by`] got.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Whether the endpoint is down ([`LlmClient::confirm_server_fault`]).
    Given(bool),
    /// `release_at` came first.
    Late,
    /// The session ended first.
    Ended,
}

/// Waits for `verdict` (whether a batch's server faults were an outage, which may take a probe
/// and a replay of a real call: as long as a call or two) until `release_at` or the session's
/// `end`, whichever comes first.
async fn verdict_by(release_at: Instant, end: &CancellationToken, verdict: impl std::future::Future<Output = bool>) -> Verdict {
    tokio::select! {
        biased;
        _ = end.cancelled() => Verdict::Ended,
        outage = verdict => Verdict::Given(outage),
        () = tokio::time::sleep_until(release_at) => Verdict::Late,
    }
}

/// Files a round's `answers` (one per item of `todo`): an answer goes to `results`; an item not
/// sent (the batch's time ran out) to `not_sent`; an item that failed fast (breaker open, no
/// call made) is returned to go again; with `go_again` (an outage, or an offender to isolate),
/// so is an item that met another server fault: those that failed fast first, then those whose
/// own call failed (suspects).
fn sort_answers(
    todo: Vec<usize>,
    answers: Vec<Result<crate::llm::Completion, crate::llm::LlmError>>,
    results: &mut [Answer],
    not_sent: &mut Vec<usize>,
    go_again: bool,
) -> Vec<usize> {
    let mut again = Vec::new();
    // Items whose own call met a fault that may be theirs (a request timeout, a 5xx, an
    // invalid answer), kept apart to go after the others.
    let mut suspects = Vec::new();
    for (i, answer) in todo.into_iter().zip(answers) {
        match answer {
            // Not sent, or its refusal not judged: the batch's time for LLM calls ran out behind
            // slower prompts (the session goes on: the caller checked). Back to the partition
            // queue, uncharged.
            Err(e) if e.kind == ErrorKind::Cancelled => not_sent.push(i),
            // Failed fast, no call made (the breaker opened before its call went), or refused
            // while the breaker opened (its refusal not judged): it goes again whatever the
            // verdict. Filed as an answer, it was charged a delivery when the
            // breaker had closed again by the verdict, for an outage its request never reached.
            Err(e) if e.kind == ErrorKind::Unavailable => again.push(i),
            Err(e) if go_again && e.fault() == Fault::Server => {
                if e.kind.is_verified_fault() { suspects.push(i) } else { again.push(i) }
            }
            answer => results[i] = Some(answer),
        }
    }
    // The items that failed fast (the breaker opened before their call went) go first next
    // time. Observed: a request with a huge `max_tokens` ahead of another in a batch, calls
    // one after the other (`llm.max_concurrency = 1`, `llm.list_prompts = false`): after each
    // opening the slow one went first again, timed out, reopened the breaker on the trial
    // close, and the one behind it was never sent.
    again.extend(suspects);
    again
}

/// One round of calls for `call` on `endpoint`, each ending by `deadline`
/// ([`LlmClient::infer_within`]): one call per item when a possible offender is being isolated
/// (`one_by_one`), else the batch's calls; the items marked in `isolated` go alone meanwhile
/// ([`isolated_calls`]). One answer per item, in order, and the isolation lane when a call sent
/// alone met a server fault (held until the verdict on it). Answers final while other calls of
/// the round still run also go to `early`, by index in `call`.
#[allow(clippy::too_many_arguments)]
async fn call_round<'c>(
    ctx: &'c PartitionContext,
    endpoint: usize,
    call: &[InferenceItem<'_>],
    isolated: &[bool],
    one_by_one: bool,
    deadline: Instant,
    cancel: &CancellationToken,
    early: EarlyAnswers<'_>,
) -> (Vec<Result<crate::llm::Completion, crate::llm::LlmError>>, Option<tokio::sync::SemaphorePermit<'c>>) {
    let (alone, together): (Vec<usize>, Vec<usize>) = (0..call.len()).partition(|&i| isolated[i]);
    let together_items: Vec<InferenceItem<'_>> = together.iter().map(|&i| call[i]).collect();
    let alone_items: Vec<InferenceItem<'_>> = alone.iter().map(|&i| call[i]).collect();
    let together_early = |j: usize, answer: &Result<crate::llm::Completion, LlmError>| early(together[j], answer);
    let alone_early = |j: usize, answer: &Result<crate::llm::Completion, LlmError>| early(alone[j], answer);
    let together_calls = async {
        if together_items.is_empty() {
            Vec::new()
        } else if one_by_one {
            // One call per item: each answer goes out as it comes.
            let calls = together_items.iter().enumerate().map(|(j, item)| async move {
                let answers = ctx.llm.infer_within(endpoint, std::slice::from_ref(item), cancel, Some(deadline)).await;
                if let Some(answer) = answers.first().filter(|a| crate::llm::is_final(a)) {
                    together_early(j, answer);
                }
                answers
            });
            futures_util::future::join_all(calls).await.into_iter().flatten().collect()
        } else {
            ctx.llm.infer_answering_early(endpoint, &together_items, cancel, Some(deadline), Some(&together_early)).await
        }
    };
    let (together_answers, (alone_answers, lane)) =
        futures_util::future::join(together_calls, isolated_calls(ctx, endpoint, &alone_items, deadline, cancel, &alone_early)).await;
    let mut answers: Vec<Option<Result<crate::llm::Completion, crate::llm::LlmError>>> = call.iter().map(|_| None).collect();
    for (i, answer) in together.into_iter().zip(together_answers).chain(alone.into_iter().zip(alone_answers)) {
        answers[i] = Some(answer);
    }
    let answers = answers.into_iter().map(|a| a.unwrap_or_else(|| Err(LlmError::new(ErrorKind::Unavailable, "internal: no answer for this request", None)))).collect();
    (answers, lane)
}

/// The calls of requests that were in flight when an LLM endpoint went down, at least
/// [`redelivery::OUTAGES_BEFORE_ISOLATION`] times ([`redelivery::note_outage_during_call`]): one
/// call each, one after the other, each under the endpoint's isolation lane
/// ([`LlmClient::isolated_call_permit`]) and only while the endpoint is available, so that among
/// this instance's suspects only one is in flight when the server goes down again. After a server
/// fault the rest are not sent ([`ErrorKind::Unavailable`]: they go again whatever the verdict),
/// and the lane is returned, still held, for the caller to keep until the verdict on that fault;
/// a request whose turn did not come while a whole call could still end by `deadline` is not
/// sent ([`ErrorKind::Cancelled`]: back to its partition queue uncharged). One answer per item,
/// in order; each final answer also goes to `early` as it comes.
async fn isolated_calls<'c>(
    ctx: &'c PartitionContext,
    endpoint: usize,
    items: &[InferenceItem<'_>],
    deadline: Instant,
    cancel: &CancellationToken,
    early: EarlyAnswers<'_>,
) -> (Vec<Result<crate::llm::Completion, crate::llm::LlmError>>, Option<tokio::sync::SemaphorePermit<'c>>) {
    let mut answers = Vec::with_capacity(items.len());
    let mut held = None;
    let last_start = deadline.checked_sub(ctx.settings.llm.request_timeout).unwrap_or(deadline);
    for (j, item) in items.iter().enumerate() {
        if held.is_some() {
            answers.push(Err(LlmError::new(ErrorKind::Unavailable, "not sent: the request sent alone before it met a server fault", None)));
            continue;
        }
        let permit = tokio::select! {
            biased;
            _ = cancel.cancelled() => None,
            () = tokio::time::sleep_until(last_start) => None,
            permit = ctx.llm.isolated_call_permit(endpoint) => permit,
        };
        let Some(permit) = permit else {
            answers.push(Err(LlmError::new(ErrorKind::Cancelled, "not sent: its turn to go alone did not come within its batch's time", None)));
            continue;
        };
        // The lane's previous holder may have left a verdict of "down": not sent into it.
        if !ctx.llm.available(endpoint) {
            answers.push(Err(LlmError::new(ErrorKind::Unavailable, "not sent: the endpoint is down", None)));
            held = Some(permit);
            continue;
        }
        let answer = ctx.llm.infer_within(endpoint, std::slice::from_ref(item), cancel, Some(deadline)).await.pop();
        let answer = answer.unwrap_or_else(|| Err(LlmError::new(ErrorKind::Unavailable, "internal: no answer for this request", None)));
        if crate::llm::is_final(&answer) {
            early(j, &answer);
        } else if answer.as_ref().is_err_and(|e| e.fault() == Fault::Server) {
            held = Some(permit);
        }
        answers.push(answer);
    }
    (answers, held)
}

/// After a round whose server faults were an outage (the endpoint is down): notes, for each
/// request whose own call lost the server during the call (a connection closed or reset before
/// the answer, or a gateway's 502 or 504: [`crate::llm::LlmError::connection_lost`]), that the
/// endpoint went down during its call ([`redelivery::note_outage_during_call`]). A request sent
/// alone ([`isolated_calls`]) that reaches [`redelivery::LONE_OUTAGES_BEFORE_CHARGE`] outages while alone is
/// charged: its answer goes to `results` (requeued, counted towards `amqp.delivery_limit`)
/// instead of waiting for the endpoint. Returns the other items and their answers.
fn charge_crash_suspects(
    ctx: &PartitionContext,
    ids: &[&str],
    todo: Vec<usize>,
    answers: Vec<Result<crate::llm::Completion, crate::llm::LlmError>>,
    isolated: &[bool],
    results: &mut [Answer],
) -> (Vec<usize>, Vec<Result<crate::llm::Completion, crate::llm::LlmError>>) {
    let mut kept = (Vec::with_capacity(todo.len()), Vec::with_capacity(todo.len()));
    for ((i, answer), alone) in todo.into_iter().zip(answers).zip(isolated) {
        let during_call = answer.as_ref().err().filter(|e| e.connection_lost);
        let Some(e) = during_call else {
            kept.0.push(i);
            kept.1.push(answer);
            continue;
        };
        let outages = redelivery::note_outage_during_call(ids[i], *alone);
        if !*alone || outages.alone < redelivery::LONE_OUTAGES_BEFORE_CHARGE {
            kept.0.push(i);
            kept.1.push(answer);
            continue;
        }
        let message = format!(
            "the LLM server went down during this request's calls {} times, {} of them while it was sent alone (a prompt that may crash the server): charged a delivery; last error: {}",
            outages.all, outages.alone, e.message
        );
        crate::warn_limited!(CRASH_SUSPECT_LOG, partition = ctx.partition, request_id = %ids[i], outages = outages.all, alone = outages.alone, "{message}");
        results[i] = Some(Err(LlmError { message, ..e.clone() }));
    }
    kept
}

/// Bounds the lines of [`charge_crash_suspects`].
static CRASH_SUSPECT_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// Logs the `requests` of a batch that go again: waiting for an endpoint (`outage`) or, while
/// the endpoint answers probes, one call each.
fn log_going_again(ctx: &PartitionContext, endpoint: usize, requests: usize, outage: bool) {
    if outage {
        crate::warn_limited!(
            WAITING_LOG,
            partition = ctx.partition,
            endpoint,
            requests,
            another_endpoint_available = ctx.llm.any_available(),
            "LLM endpoint down; these requests go to another endpoint of this instance if one is available, else wait for one in memory, unacked; not charged a delivery"
        );
    } else {
        crate::warn_limited!(WAITING_LOG, partition = ctx.partition, endpoint, requests, "server fault while the endpoint answers probes; retrying the requests one call each");
    }
}

/// The answers of a batch's items ([`infer_through_outages`]): one per item, `None` for an item
/// that goes back to its partition queue uncharged; `put_back_first` lists such items in the order
/// they go back in (the ones never sent first).
struct Outcomes {
    results: Vec<Answer>,
    put_back_first: Vec<usize>,
}

/// One item's answer: `None` when it goes back to its partition queue uncharged.
type Answer = Option<Result<crate::llm::Completion, crate::llm::LlmError>>;

impl Outcomes {
    /// The items still to be sent (`todo`, in sending order: the ones that failed fast before the
    /// ones whose own calls failed) go back uncharged: their requests are about to be held
    /// longer than `amqp.consumer_timeout` allows ([`release_at`]).
    /// `not_sent` (prompts a sequence never sent, [`LlmClient::infer_within`]) go back before them.
    fn released(results: Vec<Answer>, mut not_sent: Vec<usize>, todo: Vec<usize>, partition: u32) -> Self {
        crate::warn_limited!(
            RELEASE_LOG,
            partition,
            requests = todo.len() + not_sent.len(),
            "requests waiting for an LLM endpoint near amqp.consumer_timeout: back to the partition queue, not charged a delivery"
        );
        not_sent.extend(todo);
        Outcomes { results, put_back_first: not_sent }
    }
}

/// Bounds the lines of [`Outcomes::released`].
static RELEASE_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// When a batch whose oldest request the partition received at `oldest` must stop waiting for an
/// LLM endpoint or starting calls, so that its requests are settled before the
/// `amqp.consumer_timeout` guard would return them charged: `oldest` + 0.8 ×
/// `amqp.consumer_timeout` ([`crate::config::CONSUMER_TIMEOUT_MARGIN`], the share the load-time
/// check gives a batch) − 2 × `amqp.confirm_timeout` (their publishes).
fn release_at(s: &Settings, oldest: Instant) -> Instant {
    let margin = s.amqp.consumer_timeout.mul_f64(crate::config::CONSUMER_TIMEOUT_MARGIN);
    oldest + margin.saturating_sub(s.amqp.confirm_timeout * 2)
}

/// Puts deliveries back into the partition queue without charging them a delivery: the requests
/// of a batch that was waiting for an LLM endpoint when the partition stopped gracefully (drain,
/// handoff), and the deliveries the broker had sent that the intake had not taken yet (a paused
/// intake takes none). Returns how many were put back.
///
/// Quorum queues count every return of a delivery (nack, reject, the channel's close) towards
/// the delivery limit, so returning them as usual would charge each of them once per stop: a
/// rolling deploy or a restart loop during an outage would dead-letter the whole backlog with
/// reason `delivery_limit` after `amqp.delivery_limit` restarts. Instead each one is published
/// again to its partition as a new message (the same body and properties,
/// [`publisher::carried_props`], with header [`HEADER_EARLIER_DELIVERIES`] = the deliveries
/// charged to it so far, which the next owner adds to its count), and acked once the broker
/// confirmed the copy. One whose copy was not confirmed stays unacked and the channel's close
/// returns it, charged, as before: never lost. A copy confirmed whose ack then fails (the channel
/// closed meanwhile) is a duplicate. The copies go to the back of the queue.
async fn return_uncharged(ctx: &PartitionContext, out: &SharedConfirmChannel, deliveries: Vec<Delivery>) -> usize {
    let amqp = &ctx.settings.amqp;
    let rk = AmqpSettings::partition_routing_key(ctx.partition);
    let returns = deliveries.into_iter().map(|d| {
        let rk = rk.as_str();
        async move {
            let earlier = redelivery::delivery_count(Source::Partition, d.redelivered, d.properties.headers().as_ref());
            let props = publisher::carried_props(&d.properties, &[(HEADER_EARLIER_DELIVERIES, earlier.to_string())]);
            if let Err(e) = publisher::publish_on(out, amqp, &amqp.shard_exchange, rk, &d.data, props, None).await {
                debug!(message_id = ?d.properties.message_id(), error = %e, "could not put a delivery back uncharged; the channel's close returns it");
                return false;
            }
            // Not sent (the acker was already used or its channel is gone, or the ack timed out):
            // the channel's close returns the original as well (a duplicate of the copy).
            match crate::amqp::ack(&d.acker).await {
                Ok(()) => true,
                Err(e) => {
                    warn!(partition = ctx.partition, message_id = ?d.properties.message_id(), error = %e, "a delivery put back uncharged could not be acked: it returns as well and will be answered twice");
                    false
                }
            }
        }
    });
    let returned = futures_util::future::join_all(returns).await.into_iter().filter(|ok| *ok).count();
    metrics::requests(stage::BATCHER, outcome::RETURNED_UNCHARGED, returned as u64);
    returned
}

/// The endpoint to call for the partition: the first available one ([`LlmClient::endpoint_for`]),
/// once there is one. `None` when a stop signal or `cancel` (the session's end: lease lost,
/// restart) comes first.
async fn wait_for_endpoint(ctx: &PartitionContext, stop: &StopSignals, cancel: &CancellationToken) -> Option<usize> {
    loop {
        let endpoint = ctx.llm.endpoint_for(ctx.partition);
        if ctx.llm.available(endpoint) {
            return Some(endpoint);
        }
        tokio::select! {
            biased;
            _ = stop.stopped() => return None,
            _ = cancel.cancelled() => return None,
            _ = ctx.llm.wait_available(endpoint, cancel) => {}
            // Another endpoint of the ranking may come back first.
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(30);
    const FRESH: Duration = Duration::from_secs(3);

    /// Reported: a request that failed fast (the breaker opened before its call went, no call
    /// made) was filed as an answer when the verdict found no outage (the breaker had closed
    /// again), and so charged a delivery. It goes again, whatever the verdict.
    #[test]
    fn a_request_never_sent_goes_again_whatever_the_verdict() {
        let error = |kind| Err(LlmError::new(kind, "", None));
        for go_again in [false, true] {
            let answers = vec![error(ErrorKind::Unavailable), error(ErrorKind::Server), error(ErrorKind::Cancelled), error(ErrorKind::Rejected)];
            let mut results: Vec<Answer> = (0..4).map(|_| None).collect();
            let mut not_sent = Vec::new();
            let again = sort_answers(vec![0, 1, 2, 3], answers, &mut results, &mut not_sent, go_again);
            assert_eq!(again, if go_again { vec![0, 1] } else { vec![0] }, "go_again {go_again}");
            assert_eq!(not_sent, vec![2]);
            assert!(results[0].is_none() && results[2].is_none() && results[3].is_some());
            assert_eq!(results[1].is_some(), !go_again, "a server fault of its own call is an answer without go_again");
        }
    }

    /// The verdict on a batch's server faults is waited for until `release_at` (later, the
    /// `amqp.consumer_timeout` guard would return the requests charged) or the session's end.
    /// Before, a slow server's probe and replay could run past the guard.
    #[tokio::test(start_paused = true)]
    async fn the_verdict_on_server_faults_is_waited_for_until_the_release_time() {
        let end = CancellationToken::new();
        let t0 = Instant::now();
        let release_at = t0 + Duration::from_secs(60);
        let slow = async {
            tokio::time::sleep(Duration::from_secs(600)).await;
            true
        };
        assert_eq!(verdict_by(release_at, &end, slow).await, Verdict::Late);
        assert_eq!(t0.elapsed(), Duration::from_secs(60));
        let quick = async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            false
        };
        assert_eq!(verdict_by(Instant::now() + Duration::from_secs(60), &end, quick).await, Verdict::Given(false));
        end.cancel();
        assert_eq!(verdict_by(Instant::now() + Duration::from_secs(60), &end, std::future::pending()).await, Verdict::Ended);
    }

    /// A panic in a session's batcher or executor ends the session (its close returns what the
    /// task held); a task that returns does not.
    #[tokio::test]
    async fn a_panicked_session_task_ends_the_session_and_a_finished_one_does_not() {
        let abort = CancellationToken::new();
        let end = SessionEnd::new(&abort, None);
        tokio::spawn(session_task("executor", 3, async {}, end.clone())).await.unwrap();
        assert!(!end.token.is_cancelled());
        assert_eq!(end.reason(), None);
        let before = batcher_panics();
        let task = async {
            tokio::task::yield_now().await;
            panic!("the batcher's state is inconsistent");
        };
        tokio::spawn(session_task("batcher", 3, task, end.clone())).await.expect("the panic is caught, not the task's end");
        assert!(end.token.is_cancelled(), "the intake sees the session's end");
        assert_eq!(end.reason(), Some(restart::TASK_PANICKED));
        assert!(!abort.is_cancelled(), "the partition itself goes on: a new session starts");
        let after = batcher_panics();
        assert!(after > before, "counted: {before} then {after}");
    }

    /// `task_panics_total{stage="batcher"}` now.
    fn batcher_panics() -> f64 {
        let text = crate::metrics::render();
        let line = text.lines().find(|l| l.starts_with("prefix_batcher_task_panics_total{stage=\"batcher\"}"));
        line.and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok()).unwrap_or(0.0)
    }

    /// The guard counts a delivery's hold from its receipt, a wait for the byte budget included
    /// (the broker's `consumer_timeout` counts from its delivery), and the requests it returns
    /// remember why: the detail of a later `delivery_limit` dead letter names the guard.
    #[tokio::test(start_paused = true)]
    async fn the_consumer_timeout_guard_counts_from_receipt_and_names_itself() {
        let held = HeldDeliveries::new(0);
        let budget = Arc::new(Semaphore::new(8));
        let received = Instant::now();
        tokio::time::advance(Duration::from_secs(5)).await; // waiting for the byte budget
        let h = held.hold(budget.clone().try_acquire_owned().unwrap(), received);
        h.identify("guard-unit-1", None);
        assert_eq!(held.oldest(), Some(received));
        tokio::time::advance(Duration::from_secs(4)).await;
        held.note_guard_return(Duration::from_secs(9), |_| false);
        let why = crate::redelivery::last_failure("guard-unit-1").unwrap_or_default();
        assert!(why.contains("held 9.0 s") && why.contains("amqp.consumer_timeout guard"), "{why}");
        drop(h);
        assert_eq!(held.oldest(), None);
        assert_eq!(budget.available_permits(), 8, "its bytes went back to the budget");
    }

    fn seen(at: Instant, ready: u32, ready_since: Option<Instant>) -> Option<QueueObservation> {
        Some(QueueObservation { ready, at, ready_since })
    }

    #[test]
    fn a_publish_time_in_the_future_is_no_publish_time() {
        let now = 1_700_000_000_000;
        assert_eq!(publish_time_ms(Some(now - 250), Some(1), now), Some(now - 250), "the millisecond header first");
        assert_eq!(publish_time_ms(None, Some(now / 1000), now), Some(now / 1000 * 1000));
        assert_eq!(publish_time_ms(Some(now + MAX_CLOCK_SKEW_MS), None, now), Some(now + MAX_CLOCK_SKEW_MS), "skew");
        assert_eq!(publish_time_ms(Some(now + MAX_CLOCK_SKEW_MS + 1), None, now), None);
        // The split rule's start: the forward, else the publish; never the publish for a forward
        // time that is no time (the router's clock too far ahead).
        let published = Some(now - 5_000);
        assert_eq!(split_enqueued_ms(Some(now - 10), published, now), Some(now - 10));
        assert_eq!(split_enqueued_ms(None, published, now), published);
        assert_eq!(split_enqueued_ms(Some(now + MAX_CLOCK_SKEW_MS + 500), published, now), None);
        assert_eq!(publish_time_ms(None, Some(4_102_444_800), now), None, "the year 2100");
        assert_eq!(publish_time_ms(Some(u64::MAX), None, now), None);
        assert_eq!(publish_time_ms(None, None, now), None);
        // Too early: 0, 1, seconds where milliseconds belong; the AMQP timestamp is used instead.
        for early in [0, 1, now / 1000] {
            assert_eq!(publish_time_ms(Some(early), None, now), None, "{early}");
            assert_eq!(publish_time_ms(Some(early), Some(now / 1000 - 2), now), Some((now / 1000 - 2) * 1000), "{early}");
        }
        assert_eq!(publish_time_ms(None, Some(0), now), None);
        assert_eq!(publish_time_ms(Some(now + 60_000), Some(now / 1000), now), Some(now / 1000 * 1000), "a future header");
    }

    #[test]
    fn a_forward_received_before_its_confirm_is_not_left_unreceived() {
        let queue = "unit-forward-watch.000";
        forwards_received(queue); // the consumer starts
        let sent = Instant::now();
        forwards_received(queue); // the delivery arrives before the router saw the confirm
        forwarded_to(queue, sent);
        assert_eq!(oldest_unreceived_forward(queue), None, "the last forward of a burst raised a false alarm");
        // A forward sent after the last receipt is recorded, at its send time, until a receipt.
        std::thread::sleep(Duration::from_millis(2));
        let later = Instant::now();
        forwarded_to(queue, later);
        forwarded_to(queue, Instant::now());
        assert_eq!(oldest_unreceived_forward(queue), Some(later));
        forwards_received(queue);
        assert_eq!(oldest_unreceived_forward(queue), None);
    }

    #[test]
    fn a_consumer_that_gets_nothing_from_a_queue_with_ready_requests_is_restarted_after_the_window() {
        let t0 = Instant::now();
        let now = t0 + WINDOW;
        let obs = seen(now - Duration::from_secs(1), 7, Some(t0));
        assert_eq!(stall_verdict(now, t0, obs, WINDOW, FRESH), Stall::Starved { ready: 7 });
        assert_eq!(stall_verdict(now - Duration::from_millis(1), t0, obs, WINDOW, FRESH), Stall::No, "not before the window");
        // Idle for longer, but the requests have been ready for less than the window.
        let recent = seen(now - Duration::from_secs(1), 7, Some(t0 + Duration::from_secs(5)));
        assert_eq!(stall_verdict(now, t0 - Duration::from_secs(100), recent, WINDOW, FRESH), Stall::No);
        // Ready for long, but the consumer received something 5 s ago.
        assert_eq!(stall_verdict(now, t0 + Duration::from_secs(5), obs, WINDOW, FRESH), Stall::No);
        // An observation taken at this very instant counts too.
        assert_eq!(stall_verdict(now, t0, seen(now, 7, Some(t0)), WINDOW, FRESH), Stall::Starved { ready: 7 });
    }

    #[test]
    fn an_empty_queue_a_stale_poll_or_no_poll_is_no_stall() {
        let t0 = Instant::now();
        let now = t0 + 10 * WINDOW;
        assert_eq!(stall_verdict(now, t0, None, WINDOW, FRESH), Stall::No, "never polled");
        assert_eq!(stall_verdict(now, t0, seen(now, 0, None), WINDOW, FRESH), Stall::No, "nothing ready");
        let stale = seen(now - FRESH - Duration::from_millis(1), 5, Some(t0));
        assert_eq!(stall_verdict(now, t0, stale, WINDOW, FRESH), Stall::No, "the poller has not seen the queue lately");
    }

    #[test]
    fn observations_keep_when_the_queue_started_holding_ready_requests() {
        let q = format!("stall-test-{}", uuid::Uuid::new_v4().simple());
        observe_queue(&q, 4);
        let first = observation(&q).unwrap();
        assert_eq!(first.ready_since, Some(first.at));
        observe_queue(&q, 9);
        assert_eq!(observation(&q).unwrap().ready_since, first.ready_since, "still ready since the first poll");
        observe_queue(&q, 0);
        assert_eq!(observation(&q).unwrap().ready_since, None);
        observe_queue(&q, 1);
        assert!(observation(&q).unwrap().ready_since.is_some_and(|t| t >= first.at));
    }

    /// The split rule counts queueing delay only while the partition consumes: a backlog left by
    /// a takeover or an LLM outage is not load.
    #[test]
    fn the_split_rule_counts_no_wait_from_before_the_partition_consumed() {
        // Published 30 s before the takeover, dequeued 1 s after it: 1 s of delay, not 31 s.
        assert_eq!(split_queued_ms(Some(1_000), 31_000, 32_000), 1_000);
        // Published after the partition began consuming: the whole wait counts.
        assert_eq!(split_queued_ms(Some(40_000), 31_000, 45_000), 5_000);
        assert_eq!(split_queued_ms(None, 31_000, 45_000), 0);
        // A clock step back never gives a negative delay.
        assert_eq!(split_queued_ms(Some(50_000), 31_000, 45_000), 0);
    }

    /// The drain keeps min(a quarter, 5 s) of its time for putting requests back and releasing.
    #[test]
    fn the_drain_keeps_time_after_abandoning_its_calls() {
        let s = Duration::from_secs;
        assert_eq!(drain_call_cutoff(s(30)), s(25));
        assert_eq!(drain_call_cutoff(s(6)), Duration::from_millis(4500));
        assert_eq!(drain_call_cutoff(s(1)), Duration::from_millis(750));
        assert_eq!(drain_call_cutoff(s(600)), s(595));
    }

    #[test]
    fn the_window_outlasts_a_frozen_owner() {
        let mut raw = crate::config::RawConfig::default();
        raw.amqp.heartbeat = "10s".into();
        assert_eq!(stall_window(&Settings::from_raw(&raw).unwrap()), Duration::from_secs(30));
        raw.amqp.heartbeat = "20s".into();
        assert_eq!(stall_window(&Settings::from_raw(&raw).unwrap()), Duration::from_secs(50));
        raw.amqp.heartbeat = "0s".into();
        assert_eq!(stall_window(&Settings::from_raw(&raw).unwrap()), Duration::from_secs(130));
    }
}
