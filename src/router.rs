//! The router: consumes the input queue (competing consumers: every instance runs one), keys each
//! request and forwards it to its partition queue.
//!
//! Per delivery: parse ([`publisher::parse_or_dead_letter`]) → key ([`route`]: in the default
//! adaptive mode the shortest key level that is not split) → pick shard → partition → publish to the shard exchange with
//! routing key = partition, wait for the confirm → ack the input. Bad input is published to the
//! dead-letter exchange with its reason, confirmed, then acked: never dropped, never requeued in a
//! loop. Deliveries are handled concurrently; `amqp.input_prefetch` bounds how many.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Consumer};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use crate::log_limit::LogLimit;

use crate::amqp::{answered, close_after_acks, ConfirmChannel, Connections, RefusalTurns, SharedConfirmChannel};
use crate::config::{AmqpSettings, KeyingMode, Settings};
use crate::affinity::{self, RoutedKey};
use crate::intake_reports::{Elsewhere, IntakeReports};
use crate::keying::{derive_key, level_count, level_key, partition_of, pick_shard, shards_for, static_shards, KeySource};
use crate::metrics::{self, outcome, stage};
use crate::publisher::{self, Intake, HEADER_ROUTED_AT_MS, HEADER_ROUTED_KEY, HEADER_SHARD};
use crate::redelivery;
use crate::request::{short_string, ParseError, MAX_ID_BYTES};
use crate::splits::Affinity;
use crate::task::catch_panic;

/// Where one valid request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub request_id: String,
    /// Hex of the key the request routes by (its routed level's key).
    pub key_hex: String,
    /// The key it routes by, with its level; sent as header `x-routed-key`.
    pub routed: RoutedKey,
    /// The first characters of the level-0 key material, for logs (at debug, quoted and escaped).
    pub key_preview: String,
    pub shard: u32,
    pub partition: u32,
}

/// Decides the route of a parsed request with the split view of its deployment
/// ([`Affinity::for_prefix`]); see [`route_in`].
pub fn route(req: &crate::request::Request, settings: &Settings) -> Route {
    route_in(req, settings, &Affinity::for_prefix(&settings.redis.key_prefix))
}

/// Decides the route of a parsed request (no I/O: it reads the local split view; the shard is
/// random):
/// - `adaptive`: a key with a static entry (`sharding.keys`, `sharding.rules`) uses it at level
///   0; any other routes by the shortest level whose key is not split ([`affinity::choose`]),
///   over the shards of a spread key. The arrival and key hygiene are recorded in `affinity`.
/// - `prefix` (static): the level-0 key over `shards_for` shards.
/// - `off`: a random partition.
pub fn route_in(req: &crate::request::Request, settings: &Settings, affinity: &Affinity) -> Route {
    let keyed = derive_key(req, &settings.keying);
    let level0 = RoutedKey { level: 0, levels: 1, key: keyed.key };
    let p = settings.amqp.partitions;
    let (routed, shard, partition) = match settings.keying.mode {
        KeyingMode::Adaptive => {
            let fixed = static_shards(&keyed, &settings.sharding);
            let choice = match fixed {
                Some(n) => affinity::Choice { routed: level0, shards: n, through: Vec::new(), deeper: Vec::new() },
                None => affinity::choose(&affinity.view(), level_count(req, &settings.keying), |l| match l {
                    0 => keyed.key,
                    l => level_key(req, &settings.keying, l).expect("choose asks only for levels below level_count"),
                }),
            };
            let unsplittable = fixed.is_some() || (choice.routed.is_finest() && choice.shards >= settings.sharding.max_shards);
            // Explicit keys are names, not prompt text: their length says nothing about caching.
            let material_chars = if keyed.source == KeySource::Explicit { usize::MAX } else { keyed.material.chars().count() };
            affinity.routed(&choice, keyed.key, material_chars, unsplittable);
            let shard = pick_shard(choice.shards);
            (choice.routed, shard, partition_of(choice.routed.key, shard, p))
        }
        KeyingMode::Prefix => {
            let shard = pick_shard(shards_for(&keyed, &settings.sharding));
            (level0, shard, partition_of(keyed.key, shard, p))
        }
        KeyingMode::Off => (level0, 0, fastrand::u32(0..p.get())),
    };
    Route {
        request_id: req.id.clone(),
        key_hex: routed.key.to_string(),
        routed,
        key_preview: keyed.preview().to_owned(),
        shard,
        partition,
    }
}

/// Runs the router until `stop` fires or the session's connections fail. On stop it cancels its
/// consumer and finishes the deliveries it has (publish, confirm, ack) before returning.
///
/// The router consumes on the session's intake connection ([`Connections`]). A channel the
/// broker closes under it (e.g. 406 `PRECONDITION_FAILED` for one bad message) or a failed intake
/// connection (e.g. a message the AMQP client cannot parse) does not end it: after
/// `amqp.reconnect_backoff_initial`, doubling with each failure in a row up to
/// `amqp.reconnect_backoff_max`, it opens the connection again if needed and consumes again,
/// taking **one delivery at a time** (prefetch 1) until a message that was never delivered
/// before arrives, then `amqp.input_prefetch` again. The broker returns the failed consumer's
/// unacked deliveries to the head of the queue, each charged one delivery; taking them one at a
/// time means that a message that fails the consumer again is alone in flight, so only it is
/// charged again, until the input queue's `x-delivery-limit` dead-letters it, and the requests
/// around it are charged once. The publishing channel is reopened by the next delivery that
/// needs it. Only a failed consuming or publishing connection (or an intake channel that cannot
/// be opened on a live connection) ends the router, and with it the session.
pub async fn run(
    conns: &Connections,
    settings: Arc<Settings>,
    stop: CancellationToken,
    reply_nodes: Arc<crate::reply_node::NodeCheck>,
    reports: IntakeReports,
) -> Result<(), lapin::Error> {
    let shared = SharedConfirmChannel::new(conns.publish.clone(), settings.amqp.confirm_timeout * 2, "router".to_owned());
    shared.get().await?;
    let partitions = (0..settings.amqp.partitions.get()).map(|_| RefusalTurns::default()).collect();
    let publish = Arc::new(PublishChannel { conns: conns.clone(), shared, lost: CancellationToken::new(), reply_nodes, partitions, held: AtomicUsize::new(0), put_back_next: std::sync::Mutex::new(None), reports });
    let a = &settings.amqp;
    let mut inflight = JoinSet::new();
    // One delivery at a time, after a failure (see above).
    let mut careful = false;
    // Failures of the intake channel or connection in a row, for the backoff.
    let mut failures = 0u32;
    let result = loop {
        let intake = conns.intake();
        // `Ok` when `stop` fired and the consumer finished, else the error it ended with.
        let ended: Result<(), Option<lapin::Error>> = match subscribe(&intake, settings.as_ref(), careful).await {
            Ok((ch, mut consumer)) => {
                info!(queue = %a.input_queue, one_at_a_time = careful, "router consuming");
                loop {
                    let open = || intake.status().connected() && ch.status().connected();
                    match pump(&mut consumer, &open, &publish, &settings, &stop, &mut inflight, careful).await {
                        Ended::Fresh => match widen(&ch, &mut consumer, settings.as_ref(), |d| {
                            inflight.spawn(guarded(publish.clone(), settings.clone(), d, stop.clone()));
                        })
                        .await
                        {
                            Ok(wide) => {
                                info!(queue = %a.input_queue, prefetch = a.input_prefetch, "the input queue delivered a new message; router consuming at the full prefetch again");
                                consumer = wide;
                                careful = false;
                                failures = 0;
                            }
                            Err(e) => break Err(Some(e)),
                        },
                        Ended::Stopped => {
                            // Before the deliveries not taken go back to the queue (below).
                            report_intake_end(&publish.reports, false).await;
                            let prefetch = if careful { 1 } else { a.input_prefetch };
                            stop_consuming(&ch, &mut consumer, &mut inflight, &publish, &settings, &stop, prefetch).await;
                            let _ = close_after_acks(&ch, "router stopped").await;
                            break Ok(());
                        }
                        Ended::Closed(e) => break Err(e),
                    }
                }
            }
            // A refusal on a live connection (the input queue deleted or declared otherwise):
            // the session declares the topology again.
            Err(e) if intake.status().connected() => break Err(e),
            Err(e) => Err(Some(e)),
        };
        if ended.is_err() {
            // The acks sent just before may be lost with the channel ([`redelivery::earlier_input_ack`]).
            redelivery::note_intake_lost(&settings.instance_name);
        }
        report_intake_end(&publish.reports, ended.is_err()).await;
        let e = match ended {
            Ok(()) => break Ok(()),
            Err(_) if !stop.is_cancelled() && !conns.publish.status().connected() => break Err(publishing_connection_closed()),
            Err(e) if stop.is_cancelled() || !conns.connected() => break e.map_or(Ok(()), Err),
            Err(e) => e,
        };
        careful = true;
        let wait = intake_retry_wait(a, e.as_ref(), &mut failures);
        let lost = !intake.status().connected();
        report_intake_failure(e.as_ref(), lost, wait);
        tokio::select! {
            _ = stop.cancelled() => break Ok(()),
            _ = tokio::time::sleep(wait) => {}
        }
        if lost {
            if let Err(e) = conns.reopen_intake(a).await {
                warn!(error = %e, "cannot open the router's intake connection again; retrying");
            }
        }
    };
    finish_inflight(&mut inflight).await;
    publish.shared.close("router stopped").await;
    info!("router stopped");
    result
}

/// Records in Redis which input messages this router may have forwarded, now that its consumer
/// of the input queue ended (`lost`: with an error; else a stop): the broker gives the deliveries
/// it did not ack to any router ([`crate::intake_reports`]). A failure is logged.
pub async fn report_intake_end(reports: &IntakeReports, lost: bool) {
    if let Err(e) = reports.report(&redelivery::maybe_forwarded(lost)).await {
        warn!(error = %e, "cannot record in Redis which input messages this router may have forwarded; another router forwards their redeliveries marked as copies");
    }
}

/// What the router's deliveries in flight wait for, counted while they wait ([`staged`]), so that
/// a stop that waits for them says for what ([`finish_inflight`]).
static STAGES: [std::sync::atomic::AtomicI64; 8] = [const { std::sync::atomic::AtomicI64::new(0) }; 8];

/// Names of the [`STAGES`], by index.
const STAGE_NAMES: [&str; 8] = ["turn", "publishing channel", "reply-to check or dead letter", "forward", "ack", "requeue", "requeue backoff", "intake-loss reports"];
const TURN: usize = 0;
const CHANNEL: usize = 1;
const CHECK: usize = 2;
const FORWARD: usize = 3;
const ACK: usize = 4;
const REQUEUE: usize = 5;
const BACKOFF: usize = 6;
const REPORTS: usize = 7;

/// Runs `f`, counted in [`STAGES`]`[stage]` from now until it ends or is dropped. A combinator,
/// not an `async fn`, which would hold `f` twice (see [`crate::task::catch_panic`]).
fn staged<F: std::future::Future>(stage: usize, f: F) -> impl std::future::Future<Output = F::Output> {
    struct Counted(usize);
    impl Drop for Counted {
        fn drop(&mut self) {
            STAGES[self.0].fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    STAGES[stage].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let counted = Counted(stage);
    futures_util::FutureExt::map(f, move |out| {
        drop(counted);
        out
    })
}

/// The [`STAGES`] with deliveries in them: `forward: 2, ack: 1`.
fn stages_now() -> String {
    let counts = STAGES.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed));
    let busy: Vec<String> = STAGE_NAMES.iter().zip(counts).filter(|(_, n)| *n > 0).map(|(name, n)| format!("{name}: {n}")).collect();
    if busy.is_empty() { "none".to_owned() } else { busy.join(", ") }
}

/// How long the router waits for its deliveries in flight at a stop before it says so in the log.
const INFLIGHT_NOTE_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

/// How long the router waits for its deliveries in flight at a stop before it abandons them: 15 s,
/// half the default `shutdown.drain_timeout`. Every wait of theirs is bounded (a confirm by
/// `amqp.confirm_timeout`, a backoff cut short by the stop), so this bounds what should not happen.
const INFLIGHT_GIVE_UP_AFTER: std::time::Duration = std::time::Duration::from_secs(15);

/// Waits until every delivery task of `inflight` has ended (each ends soon after `stop`: a held
/// forward or a requeue backoff is cut short; a publish or a dead letter waits at most for its
/// confirm). Says so at WARN, with what they wait for ([`stages_now`]), if that takes longer than
/// [`INFLIGHT_NOTE_AFTER`], and abandons those left after [`INFLIGHT_GIVE_UP_AFTER`] (at ERROR):
/// their deliveries are unacked, so the close of their channel returns them.
async fn finish_inflight(inflight: &mut JoinSet<()>) {
    let waited = async {
        if tokio::time::timeout(INFLIGHT_NOTE_AFTER, all_joined(inflight)).await.is_ok() {
            return true;
        }
        warn!(waited = ?INFLIGHT_NOTE_AFTER, deliveries = inflight.len(), waiting_for = %stages_now(), "the router is stopping and still waits for input deliveries in flight (forwards or dead letters waiting for the broker's confirm)");
        tokio::time::timeout(INFLIGHT_GIVE_UP_AFTER - INFLIGHT_NOTE_AFTER, all_joined(inflight)).await.is_ok()
    };
    if !waited.await {
        error!(waited = ?INFLIGHT_GIVE_UP_AFTER, deliveries = inflight.len(), waiting_for = %stages_now(), "the router abandons input deliveries still in flight at its stop; the broker returns them to the input queue when their channel closes (one whose forward the broker took may be answered twice)");
        inflight.abort_all();
        while inflight.join_next().await.is_some() {}
    }
}

/// The router's graceful stop of `consumer` on `ch`; returns once every delivery it handed on
/// is settled (or given up, [`finish_inflight`]). The deliveries in flight are finished, and the
/// consumer is cancelled once the broker has nothing in flight to it
/// ([`crate::amqp::cancel_when_full`]); what it delivered meanwhile is handled like the others.
/// Before, the deliveries buffered in the consumer and those a quorum queue sends after the
/// cancel-ok were returned by the channel's close charged a delivery: 27 of 5,183 requests left
/// in the input queue in `a_stop_under_a_backlog_charges_no_input_delivery`.
async fn stop_consuming(
    ch: &Channel,
    consumer: &mut Consumer,
    inflight: &mut JoinSet<()>,
    publish: &Arc<PublishChannel>,
    settings: &Arc<Settings>,
    stop: &CancellationToken,
    prefetch: u16,
) {
    let held = crate::amqp::cancel_when_full(ch, consumer, finish_inflight(inflight), prefetch).await;
    if !held.is_empty() {
        debug!(deliveries = held.len(), "router stopping: handing on the deliveries received while the ones in flight finished");
    }
    for delivery in held {
        inflight.spawn(guarded(publish.clone(), settings.clone(), delivery, stop.clone()));
    }
    finish_inflight(inflight).await;
}

/// Waits until every task of `inflight` ended.
async fn all_joined(inflight: &mut JoinSet<()>) {
    while inflight.join_next().await.is_some() {}
}

/// How long the router waits before it consumes again after its consumer ended with `e`, the
/// `failures`-th time in a row (counted here): [`redelivery::requeue_backoff`], doubling. A
/// message the AMQP client cannot read is that message's fault, not the broker's: then the
/// first backoff each time, not doubled and not counted, so the requests behind it wait for its
/// own few deliveries only (it comes back first, alone).
fn intake_retry_wait(a: &AmqpSettings, e: Option<&lapin::Error>, failures: &mut u32) -> std::time::Duration {
    if unreadable(e) {
        return a.reconnect_backoff_initial;
    }
    let wait = redelivery::requeue_backoff(a, u64::from(*failures));
    *failures = failures.saturating_add(1);
    wait
}

/// Whether the consumer ended on a message the AMQP client cannot parse (lapin fails the
/// connection with a parsing error).
fn unreadable(e: Option<&lapin::Error>) -> bool {
    e.is_some_and(|e| matches!(e.kind(), lapin::ErrorKind::ParsingError(_)))
}

/// Counts and logs the end of the router's consumer (`e`, none when the consumer just ended;
/// `lost`: its intake connection closed) before it consumes again in `wait`: at ERROR for a
/// message the AMQP client cannot parse, else at WARN.
fn report_intake_failure(e: Option<&lapin::Error>, lost: bool, wait: std::time::Duration) {
    let why = match (e, lost) {
        (e, _) if unreadable(e) => metrics::intake_failure::UNREADABLE_MESSAGE,
        (_, true) => metrics::intake_failure::CONNECTION_LOST,
        (_, false) => metrics::intake_failure::CHANNEL_CLOSED,
    };
    metrics::intake_failed(why);
    let e = e.map_or_else(|| "the consumer ended".to_owned(), ToString::to_string);
    if why == metrics::intake_failure::UNREADABLE_MESSAGE {
        error!(
            error = %e,
            retry_in = ?wait,
            "the input queue delivered a message the AMQP client cannot parse (a property such as message_id, correlation_id or reply_to, or a header name, that is not UTF-8); it closed the router's intake connection. The router consumes again one delivery at a time, so that only that message is charged a delivery each time, until the input queue's x-delivery-limit dead-letters it (x-death reason delivery_limit, no x-death-reason); the partitions go on meanwhile"
        );
    } else {
        warn!(error = %e, intake_connection_lost = lost, retry_in = ?wait, "the router's consumer of the input queue ended; consuming again, one delivery at a time until a new message arrives");
    }
}

/// Opens a consuming channel on the input queue on `intake`, with prefetch 1 when `careful`,
/// else `amqp.input_prefetch`.
async fn subscribe(intake: &lapin::Connection, settings: &Settings, careful: bool) -> Result<(Channel, Consumer), lapin::Error> {
    let ch = answered("channel.open", intake.create_channel()).await?;
    let consumer = consume(&ch, settings, if careful { 1 } else { settings.amqp.input_prefetch }).await?;
    Ok((ch, consumer))
}

/// Starts the router's consumer of the input queue on `ch` with `prefetch` (per consumer: a
/// quorum queue has no per-channel prefetch, and a consumer keeps the prefetch it started with).
async fn consume(ch: &Channel, settings: &Settings, prefetch: u16) -> Result<Consumer, lapin::Error> {
    answered("basic.qos", ch.basic_qos(prefetch, BasicQosOptions::default())).await?;
    let queue = settings.amqp.input_queue.as_str().into();
    let tag = consumer_tag(&settings.instance_name);
    answered("basic.consume", ch.basic_consume(queue, tag.as_str().into(), BasicConsumeOptions::default(), FieldTable::default())).await
}

/// A consumer tag of the router no earlier consumer of this process had:
/// `router-{instance}-{n}`. A tag used again on a channel that still holds the cancelled
/// consumer's unacked deliveries crashed RabbitMQ 3.10.8's channel at the next delivery
/// (`function_clause` in `rabbit_channel:handle_deliver0`, the connection closed with 541
/// `INTERNAL_ERROR`), returning every delivery in flight: each return to full prefetch after
/// an unreadable message did that.
fn consumer_tag(instance: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    format!("router-{instance}-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// Replaces the one-at-a-time consumer `careful` on `ch` by one with `amqp.input_prefetch`.
/// Deliveries the broker sent to `careful` before its cancel took effect go to `handle`; all of
/// its deliveries stay on `ch` and are acked there as usual.
async fn widen(ch: &Channel, careful: &mut Consumer, settings: &Settings, mut handle: impl FnMut(Delivery)) -> Result<Consumer, lapin::Error> {
    answered("basic.cancel", ch.basic_cancel(careful.tag(), BasicCancelOptions::default())).await?;
    // lapin ends the stream after the deliveries it holds once the broker's cancel-ok arrives.
    while let Some(Ok(delivery)) = careful.next().await {
        handle(delivery);
    }
    // Under a new tag: see [`consumer_tag`].
    consume(ch, settings, settings.amqp.input_prefetch).await
}

/// How [`pump`] ended.
enum Ended {
    /// `stop` fired.
    Stopped,
    /// A careful consumer got a message never delivered before: the ones returned by a failed
    /// consumer are through (the broker delivers returned messages first).
    Fresh,
    /// The consumer ended (its channel or connection closed, or the broker cancelled it).
    Closed(Option<lapin::Error>),
}

/// How long [`pump`], finding the consumer's channel or connection closed, waits for the
/// consumer's stream to give the reason.
const CLOSE_REASON_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// How often [`pump`] checks that the consumer's channel and connection are open.
const OPEN_CHECK_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// Hands every delivery of `consumer` to its own task until `stop` fires or the consumer ends;
/// when `careful`, also ends after handing on the first delivery not marked redelivered.
///
/// `open` tells whether the consumer's channel and connection are open; it is checked every
/// [`OPEN_CHECK_PERIOD`], and `Closed` is returned when it is not, whether or not the consumer's
/// stream ended: the intake connection has no other watcher (the session watches the consuming
/// and publishing connections), and the AMQP client has not always ended a consumer's stream
/// when its connection was reset (amqp-rs/lapin #222, #283).
async fn pump(
    consumer: &mut Consumer,
    open: &impl Fn() -> bool,
    publish: &Arc<PublishChannel>,
    settings: &Arc<Settings>,
    stop: &CancellationToken,
    inflight: &mut JoinSet<()>,
    careful: bool,
) -> Ended {
    let mut check = tokio::time::interval(OPEN_CHECK_PERIOD);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ended::Stopped,
            _ = check.tick() => if !open() {
                // The stream normally ends with the reason a moment later (an unreadable message,
                // the broker's close): take it if it comes, for the log and the failure's count.
                return match tokio::time::timeout(CLOSE_REASON_WAIT, consumer.next()).await {
                    Ok(Some(Err(e))) => Ended::Closed(Some(e)),
                    _ => Ended::Closed(None),
                };
            },
            // A delivery found the publishing connection closed: end at once, so the session
            // reconnects, instead of every delivery finding it closed in turn.
            _ = publish.lost.cancelled() => return Ended::Closed(None),
            Some(_) = inflight.join_next(), if !inflight.is_empty() => {}
            next = consumer.next() => match next {
                Some(Ok(delivery)) => {
                    let fresh = !delivery.redelivered;
                    inflight.spawn(guarded(publish.clone(), settings.clone(), delivery, stop.clone()));
                    if careful && fresh {
                        return Ended::Fresh;
                    }
                }
                Some(Err(e)) => return Ended::Closed(Some(e)),
                None => return Ended::Closed(None),
            },
        }
    }
}

/// The error the router ends with when its publishing connection has closed (the session then
/// reconnects).
fn publishing_connection_closed() -> lapin::Error {
    lapin::Error::from(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the publishing connection closed"))
}

/// The router's confirm-mode publishing channel, shared by its delivery tasks, reopened when
/// the broker closed it (a closed channel stays closed in AMQP 0-9-1) and replaced after a
/// failed publish ([`SharedConfirmChannel`]).
struct PublishChannel {
    conns: Connections,
    shared: SharedConfirmChannel,
    /// Cancelled when a delivery found the publishing connection itself closed.
    lost: CancellationToken,
    /// Whether the broker can decode the node of a direct reply-to name ([`crate::reply_node`]).
    reply_nodes: Arc<crate::reply_node::NodeCheck>,
    /// The turns of the forwards to each partition queue (indexed by partition) while that queue
    /// refuses them ([`Refusal::Partition`]).
    partitions: Vec<RefusalTurns>,
    /// Input deliveries held now for partition queues that refuse forwards ([`HeldSlot`]), at
    /// most [`held_cap`].
    held: AtomicUsize,
    /// The earliest time the next copy beyond [`held_cap`] may go back into the input queue
    /// ([`PublishChannel::pace_put_back`]).
    put_back_next: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// This instance's intake-loss reports, and the look-up of the others'.
    reports: IntakeReports,
}

impl PublishChannel {
    /// When a copy beyond [`held_cap`] that may go back at `earliest` goes back: copies go back
    /// at most [`put_back_budget`] a second from this router, each at its own time. A copy waits
    /// holding its prefetch slot, and the slots bound how many wait, so no copy waits much longer
    /// than [`PUT_BACK_PAUSE`].
    fn pace_put_back(&self, a: &AmqpSettings, earliest: tokio::time::Instant) -> tokio::time::Instant {
        pace(&self.put_back_next, a, earliest)
    }

    /// The channel to publish on ([`SharedConfirmChannel::get`]).
    async fn get(&self) -> Result<ConfirmChannel, lapin::Error> {
        if !self.conns.publish.status().connected() {
            self.lost.cancel();
            return Err(publishing_connection_closed());
        }
        self.shared.get().await
    }

    /// Replaces `ch` by [`Self::get`]'s channel when the broker closed it or a publish on it
    /// failed (a quorum queue may drop later publishes on such a channel: `ConfirmChannel`);
    /// keeps it otherwise. Errors: as [`Self::get`], with `ch` left as it was.
    async fn renew(&self, ch: &mut ConfirmChannel) -> Result<(), lapin::Error> {
        if !ch.status().connected() || ch.has_failed() {
            *ch = self.get().await?;
        }
        Ok(())
    }
}

/// Per-delivery warnings of the router, each kind within its own [`LogLimit`] (at most
/// [`crate::log_limit::BURST`] lines per minute at `WARN`, the rest at `DEBUG`).
static NO_CHANNEL_LOG: LogLimit = LogLimit::new();
static FORWARD_FAILED_LOG: LogLimit = LogLimit::new();
static ACK_FAILED_LOG: LogLimit = LogLimit::new();

/// Runs [`handle`] for one delivery. A panic does not leave the delivery unacked: it is
/// requeued (nack), and its request id remembered with the panic ([`redelivery::note_failure`])
/// so the delivery limit dead-letters a message that keeps failing, with that error.
async fn guarded(publish: Arc<PublishChannel>, settings: Arc<Settings>, delivery: Delivery, stop: CancellationToken) {
    let acker = delivery.acker.clone();
    let message_id = delivery.properties.message_id().as_ref().map(|m| m.as_str().to_owned());
    let request_id = OnceLock::new();
    if let Err(panic) = catch_panic(handle(&publish, &settings, delivery, &request_id, &stop)).await {
        let id = request_id.get().cloned().or(message_id).unwrap_or_default();
        error!(request_id = %id, panic = %panic, "handling an input delivery panicked; requeueing it");
        metrics::task_panicked(stage::ROUTER);
        redelivery::note_failure(&id, &format!("panic: {panic}"));
        let _ = crate::amqp::nack_requeue(&acker).await;
    }
}

/// Handles one input delivery: parse (or dead-letter), route, forward with a confirm, ack.
/// A delivery whose dead letter is not confirmed is requeued after
/// [`redelivery::requeue_backoff`] (or at `stop`); one whose forward is not confirmed is held,
/// uncharged, and forwarded again after [`publisher::hold_backoff`] until the broker takes it,
/// the session's publishing connection is lost or `stop` fires (then requeued). A held delivery
/// is put back into the input queue uncharged instead ([`put_back`]) when its hold nears
/// `amqp.consumer_timeout` ([`hold_limit`]); one held because its partition queue refuses
/// forwards also when `stop` fires and when [`held_cap`] deliveries are held so already. The
/// request id goes to `request_id` once known.
async fn handle(publish: &PublishChannel, settings: &Settings, delivery: Delivery, request_id: &OnceLock<String>, stop: &CancellationToken) {
    let received = tokio::time::Instant::now();
    let a = &settings.amqp;
    // Whether the input queue delivered this message before for a reason of its own: a copy of
    // none of this process's forwards, so its forward is not marked as one.
    let mut not_a_copy = false;
    if delivery.redelivered {
        if let Some((id, key)) = input_key(settings, &delivery) {
            let earlier = tokio::select! {
                e = staged(FORWARD, redelivery::earlier_outcome(key)) => e,
                _ = stop.cancelled() => return requeue(delivery).await,
            };
            // What this router knows of an earlier forward of the message: `Some(true)` that
            // its ack reached the broker, `Some(false)` nothing, `None` the rest (handled here).
            let known = match earlier {
                redelivery::Earlier::Confirmed => match redelivery::earlier_input_ack(key, &settings.instance_name) {
                    // The forward of an earlier delivery was confirmed, and its ack may have been lost.
                    redelivery::EarlierAck::MaybeLost => return ack_forwarded_before(delivery, &id).await,
                    // That ack reached the broker: this is the same message published again, and
                    // delivered again for a fault of its own delivery (an intake connection closed
                    // under it before its forward) or of another router's ack.
                    redelivery::EarlierAck::Reached => Some(true),
                    // Long ago: as a message this router knows nothing of.
                    redelivery::EarlierAck::Unknown => Some(false),
                },
                // Forwarded again below, marked: its owner answers it once. Its return was not
                // its fault, and a dead letter at `amqp.delivery_limit` could meet a result.
                redelivery::Earlier::Maybe => {
                    redelivery::note_uncharged_return(key);
                    None
                }
                redelivery::Earlier::Nothing => Some(false),
            };
            if let Some(reached) = known {
                // Another router may have forwarded it and lost its ack
                // ([`crate::intake_reports`]): forwarded marked when that router reported it, or
                // when this router knows nothing and no router reported; else unmarked, as a new
                // message (dropped as a copy, it would get no answer).
                let elsewhere = tokio::select! {
                    e = staged(REPORTS, publish.reports.lookup(key)) => e,
                    _ = stop.cancelled() => return requeue(delivery).await,
                };
                not_a_copy = match elsewhere {
                    Elsewhere::Forwarded => false,
                    Elsewhere::NotForwarded => true,
                    Elsewhere::Unknown => reached,
                };
                if not_a_copy {
                    debug!(request_id = %id, answered_here_before = reached, "a redelivered input message that no router reported as maybe forwarded; forwarded unmarked");
                }
            }
        }
    }
    // While the broker refuses forwards, deliveries take turns ([`crate::amqp::RefusalTurns::turn`]).
    // Counted in `held_publishes{kind="forward"}` while it waits for its turn because the broker
    // refuses forwards, and from its own first refusal until this returns.
    let mut holding = publish.shared.turns().refusing().then(|| metrics::HeldPublish::new("forward"));
    let give_back_at = received + hold_limit(a);
    let turn = match staged(TURN, take_turn(&publish.shared, stop, give_back_at)).await {
        Ok(turn) => turn,
        Err(TurnEnd::Stopped) => return requeue(delivery).await,
        // Waited for the turn until its hold neared `amqp.consumer_timeout`, unparsed.
        Err(TurnEnd::GiveBack) => {
            drop(holding);
            let id = delivery.properties.message_id().as_ref().map(|m| m.as_str().to_owned());
            return staged(REQUEUE, put_back(publish, a, delivery, id.as_deref(), PutBack { pause: false, own_channel: true }, false, stop)).await;
        }
    };
    let mut attempts = 0;
    let ch = loop {
        match staged(CHANNEL, publish.get()).await {
            Ok(ch) => break ch,
            // A live connection on which no channel opens: most often one the broker blocked (a
            // memory or disk alarm: it reads nothing from the connection, so `channel.open`
            // goes unanswered). The deployment's fault, not the request's: held, uncharged,
            // and tried again once the connection is unblocked.
            Err(e) if !stop.is_cancelled() && publish.conns.publish.status().connected() => {
                let wait = publisher::hold_backoff(&settings.amqp, attempts);
                attempts += 1;
                crate::warn_limited!(NO_CHANNEL_LOG, error = %e, retry_in = ?wait, "no publishing channel on a live connection (blocked by the broker?); holding input, uncharged");
                tokio::select! {
                    _ = stop.cancelled() => return requeue(delivery).await,
                    () = staged(BACKOFF, publisher::wait_to_publish_again(&publish.conns.publish, wait)) => {}
                }
                // Its channel closed meanwhile (the broker's `consumer_timeout`): the broker
                // delivers it again, charged for a fault that is not its own.
                if delivery.acker.poisoned() {
                    note_returned_while_blocked(publish, settings, &delivery, received);
                    return metrics::requests(stage::ROUTER, outcome::REQUEUED, 1);
                }
            }
            Err(e) => {
                // Held for the requeue backoff: requeued at once, a delivery comes straight back,
                // and every request would use up its deliveries (`amqp.delivery_limit`) in
                // milliseconds while the publishing connection is down; the session ends meanwhile.
                crate::warn_limited!(NO_CHANNEL_LOG, error = %e, "no publishing channel; requeueing input after a backoff");
                return requeue_after_backoff(&settings.amqp, delivery, stop).await;
            }
        }
    };
    let (req, delivery) = match staged(CHECK, publisher::parse_or_dead_letter(&publish.conns.dead_letters, a, &settings.requests, delivery, redelivery::Source::Input, None)).await {
        Intake::Valid(req, delivery) => (req, delivery),
        Intake::DeadLettered => return,
        Intake::Unacked(delivery) => return requeue_after_backoff(a, delivery, stop).await,
    };
    let _ = request_id.set(req.id.clone());
    if let Some(e) = staged(CHECK, publish.reply_nodes.refusal(delivery.properties.reply_to().as_ref().map(|r| r.as_str()), &req.id)).await {
        if let Intake::Unacked(delivery) = staged(CHECK, publisher::dead_letter_and_ack(&publish.conns.dead_letters, a, delivery, Some(&req.id), e.reason(), &e.to_string(), None)).await {
            requeue_after_backoff(a, delivery, stop).await;
        }
        return;
    }
    let r = route(&req, settings);
    // The material is the request's own text: logged quoted and escaped (`?`), so a line break or
    // a control character in a prompt cannot start what looks like another log line.
    debug!(request_id = %r.request_id, key = %r.key_hex, material = ?r.key_preview, shard = r.shard, partition = r.partition, "routing");
    let fwd = match forward_props(&delivery.properties, &r, delivery.redelivered && !not_a_copy) {
        Ok(p) => p,
        Err(e) => {
            if let Intake::Unacked(delivery) = staged(CHECK, publisher::dead_letter_and_ack(&publish.conns.dead_letters, a, delivery, Some(&r.request_id), e.reason(), &e.to_string(), None)).await {
                requeue_after_backoff(a, delivery, stop).await;
            }
            return;
        }
    };
    // Whether an attempt's outcome is unknown: the broker may have taken that forward.
    let mut forwarded_maybe = false;
    let key = publisher::input_message_key(&req.id, &delivery);
    let in_flight = redelivery::OutcomeInFlight::begin(key);
    let end = staged(FORWARD, forward(publish, a, ch, turn, &delivery, fwd, &r, key, stop, &mut holding, give_back_at, &mut forwarded_maybe)).await;
    match &end {
        ForwardEnd::Forwarded => in_flight.confirmed(),
        _ if !forwarded_maybe => in_flight.refused(),
        _ => drop(in_flight),
    }
    match end {
        ForwardEnd::Forwarded => {}
        ForwardEnd::Requeue => return requeue(delivery).await,
        ForwardEnd::PutBack(how) => {
            drop(holding);
            return staged(REQUEUE, put_back(publish, a, delivery, Some(&r.request_id), how, forwarded_maybe, stop)).await;
        }
        ForwardEnd::RequeueAfterBackoff => return requeue_after_backoff(a, delivery, stop).await,
        ForwardEnd::InputGone => {
            note_returned_while_blocked(publish, settings, &delivery, received);
            debug!(request_id = %r.request_id, "the input channel closed before the forward; the broker delivers the request again");
            return metrics::requests(stage::ROUTER, outcome::REQUEUED, 1);
        }
    }
    // Bounded: an ack on a channel whose connection closed may never be answered (lapin), and the
    // broker returns the delivery anyway then.
    let acked = staged(ACK, crate::amqp::ack(&delivery.acker)).await;
    redelivery::note_input_ack(key, acked.is_ok());
    if let Err(e) = acked {
        crate::warn_limited!(ACK_FAILED_LOG, error = %e, "input ack failed; the broker will redeliver");
        return;
    }
    metrics::requests(stage::ROUTER, outcome::ROUTED, 1);
}

/// The request id and the key of an input delivery for [`redelivery::earlier_outcome`]
/// ([`redelivery::input_key`]), when it has a request id. Parses the delivery: for redeliveries
/// only, before their handling parses them again.
fn input_key(settings: &Settings, delivery: &Delivery) -> Option<(String, u128)> {
    let id = match publisher::check_delivery(&settings.amqp, &settings.requests, delivery, redelivery::Source::Input) {
        Ok(req) => req.id,
        Err(r) => r.request_id?,
    };
    let key = publisher::input_message_key(&id, delivery);
    Some((id, key))
}

/// Notes the return of `delivery` (received at `received`) uncharged
/// ([`redelivery::note_uncharged_return`]) when its channel closed after the broker blocked the
/// publishing connection during its hold (a memory or disk alarm): nothing could be forwarded or
/// put back, and the broker's `consumer_timeout` returned it.
fn note_returned_while_blocked(publish: &PublishChannel, settings: &Settings, delivery: &Delivery, received: tokio::time::Instant) {
    if publisher::blocked_since(&publish.conns.publish, received) {
        if let Some((_, key)) = input_key(settings, delivery) {
            redelivery::note_uncharged_return(key);
        }
    }
}

static FORWARDED_BEFORE_LOG: LogLimit = LogLimit::new();

/// Acks, without forwarding it again, a redelivered input message (request id `id`) whose
/// forward from an earlier delivery this process published and the broker confirmed, and whose
/// ack may have been lost with its channel ([`redelivery::earlier_input_ack`]: the broker's
/// `consumer_timeout` while the publishing connection was blocked, a fault of the intake
/// connection). Counted in `requests_total{stage="router",outcome="duplicate"}`. When this ack
/// fails too, the broker delivers it again, and it comes here again.
async fn ack_forwarded_before(delivery: Delivery, id: &str) {
    match crate::amqp::ack(&delivery.acker).await {
        Ok(()) => {
            metrics::requests(stage::ROUTER, outcome::DUPLICATE, 1);
            crate::info_limited!(FORWARDED_BEFORE_LOG, request_id = %id, "an input message forwarded before, delivered again (its ack was lost with its channel): acked without forwarding it again");
        }
        Err(e) => crate::warn_limited!(ACK_FAILED_LOG, request_id = %id, error = %e, "input ack failed; the broker will redeliver"),
    }
}

/// How [`forward`] ended.
enum ForwardEnd {
    /// The broker confirmed the forward: ack the input delivery.
    Forwarded,
    /// `stop` fired while the forward was held: requeue the input delivery now.
    Requeue,
    /// No publishing channel, or the connection is lost: requeue after
    /// [`redelivery::requeue_backoff`].
    RequeueAfterBackoff,
    /// The input delivery's channel closed before the forward was sent: the broker has returned
    /// the message to the input queue already, so it was not forwarded (that would only make a
    /// copy that no ack can settle).
    InputGone,
    /// The broker refuses the forward, and the delivery is not held (any longer): put it back
    /// into the input queue uncharged ([`put_back`]).
    PutBack(PutBack),
}

/// How a delivery held for a refused forward goes back into the input queue ([`put_back`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PutBack {
    /// Too many are held already ([`held_cap`]): a copy that comes back within
    /// [`PUT_BACK_PAUSE`] of its last put-back ([`redelivery::HEADER_PUT_BACK_AT_MS`]) waits out
    /// the rest of it first. Else at once (`stop`, or [`hold_limit`]).
    pause: bool,
    /// On a channel of its own: the broker refused the channel ([`Refusal::Channel`]), and a
    /// refused put-back would close the shared one with other publishes queued on it.
    own_channel: bool,
}

impl PutBack {
    /// Put back at once on the shared channel (a partition queue's refusal, `stop`).
    const NOW: ForwardEnd = ForwardEnd::PutBack(PutBack { pause: false, own_channel: false });
    /// Put back after a pause on the shared channel ([`held_cap`]).
    const AFTER_PAUSE: ForwardEnd = ForwardEnd::PutBack(PutBack { pause: true, own_channel: false });
}

/// Why [`take_turn`] returned without the turn.
enum TurnEnd {
    /// `stop` fired.
    Stopped,
    /// The delivery's hold neared `amqp.consumer_timeout` ([`hold_limit`]).
    GiveBack,
}

/// Why the broker did not take a forward, which decides whose forwards take turns
/// ([`RefusalTurns`]) until it takes one again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Of the channel: a channel or connection error (403 `ACCESS_REFUSED` or 404 `NOT_FOUND` on
    /// the shard exchange, which close the channel; no channel opened). It concerns every
    /// partition, and the channel it closes is shared: all forwards take turns.
    Channel,
    /// Of one partition queue: a nack (a queue full with `overflow = reject-publish`, a quorum
    /// queue without a leader), no confirm within `amqp.confirm_timeout`, unroutable. The
    /// channel stays open and the other partition queues take their forwards: only the forwards
    /// to that partition take turns, each attempt on a channel of its own, so that a confirm it
    /// never gets does not hold up the confirms of the shared channel's later publishes (ordered
    /// settlement, [`ConfirmChannel`]).
    Partition,
}

impl Refusal {
    fn of(e: &publisher::PublishError) -> Refusal {
        if matches!(e, publisher::PublishError::Amqp(_)) { Refusal::Channel } else { Refusal::Partition }
    }
}

/// How many input deliveries the router holds at most for partition queues that refuse forwards
/// ([`Refusal::Partition`]): half of `amqp.input_prefetch`, at least 1. Held deliveries fill the
/// prefetch: without a cap, one partition queue refusing for long (a quorum queue without a
/// majority, a policy's `max-length` with `reject-publish`) came to hold every delivery, and the
/// router forwarded nothing to the other partitions. Beyond the cap a delivery for such a queue is
/// put back into the input queue uncharged ([`put_back`]) after [`PUT_BACK_PAUSE`].
fn held_cap(a: &AmqpSettings) -> usize {
    usize::from(a.input_prefetch / 2).max(1)
}

/// How often at most a delivery beyond [`held_cap`] goes back into the input queue: a copy that
/// comes back sooner (the input queue holds little else) waits out the rest of this pause first,
/// or it would go round at the broker's speed. A delivery taken for the first time goes back at
/// once, and so does a copy that spent longer in the queue (others wait ahead of it) while the
/// router stays within [`put_back_budget`]: a pause holds a prefetch slot, and with many such
/// requests the pauses came to hold the prefetch the others need (measured by an outside test
/// with 1 s pauses for all: 20 requests/s, half for the refusing queue, prefetch 16, got 5/s of
/// the others through, and a backlog grew).
const PUT_BACK_PAUSE: Duration = Duration::from_secs(1);

/// How many times [`put_back`] publishes a copy before it gives up and requeues the delivery.
const PUT_BACK_ATTEMPTS: usize = 3;

/// How many copies beyond [`held_cap`] a router puts back into the input queue a second at most
/// ([`PublishChannel::pace_put_back`]): `amqp.input_prefetch`. Without a bound, the copies went
/// round as fast as the router took them once each had spent [`PUT_BACK_PAUSE`] in the queue,
/// each a publish and an ack that the input queue writes to disk: an outside test with every
/// partition queue refusing measured 3,600–3,700 copies a second for a backlog of about 5,000,
/// with both cores of the machine busy. A higher bound keeps the other partitions' requests
/// moving behind the copies (they wait in the queue behind them, about 1 s in the same test
/// without a bound); a lower one spends less of the broker.
fn put_back_budget(a: &AmqpSettings) -> usize {
    usize::from(a.input_prefetch).max(1)
}

/// [`PublishChannel::pace_put_back`] on `next`, the earliest time of the next copy.
fn pace(next: &std::sync::Mutex<Option<tokio::time::Instant>>, a: &AmqpSettings, earliest: tokio::time::Instant) -> tokio::time::Instant {
    let interval = PUT_BACK_PAUSE / u32::try_from(put_back_budget(a)).unwrap_or(u32::MAX);
    let mut next = next.lock().unwrap_or_else(|p| p.into_inner());
    let at = next.map_or(earliest, |n| n.max(earliest));
    *next = Some(at + interval);
    at
}

/// The longest wait between the attempts of the forwards to a partition queue that refuses them
/// ([`Refusal::Partition`]), below `amqp.reconnect_backoff_max` when that is longer: one publish
/// per partition per wait, on a channel of its own, costs the broker little, and the held
/// forwards go within this long after the queue takes them again (with the 30 s default of
/// `amqp.reconnect_backoff_max`, an outside test saw them go up to 26 s after the fault ended).
const PARTITION_RETRY_MAX: Duration = Duration::from_secs(5);

/// How long after its receipt an input delivery held for a refused forward (or waiting for its
/// turn) is put back uncharged ([`put_back`]): before RabbitMQ's `consumer_timeout` closes the
/// channel and charges every delivery on it. [`crate::config::CONSUMER_TIMEOUT_MARGIN`] ×
/// `amqp.consumer_timeout` − 2 × `amqp.confirm_timeout` (the put-back's publish and the forward in
/// flight), as a partition's batches ([`crate::config::Settings::longest_hold`]); at least
/// [`PUT_BACK_PAUSE`].
fn hold_limit(a: &AmqpSettings) -> Duration {
    let allowed = a.consumer_timeout.mul_f64(crate::config::CONSUMER_TIMEOUT_MARGIN);
    // At least PUT_BACK_PAUSE, so that a copy cannot go round at the broker's speed.
    allowed.saturating_sub(a.confirm_timeout * 2).max(PUT_BACK_PAUSE.min(allowed))
}

/// One input delivery held for a refusing partition queue, counted in [`PublishChannel::held`]
/// until dropped.
struct HeldSlot<'a>(&'a AtomicUsize);

impl<'a> HeldSlot<'a> {
    /// A slot when fewer than `cap` are held, else `None`.
    fn take(held: &'a AtomicUsize, cap: usize) -> Option<HeldSlot<'a>> {
        held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1)).ok().map(|_| HeldSlot(held))
    }
}

impl Drop for HeldSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Forwards the request (the body of `input` with properties `fwd`, input key `key`) to its
/// partition queue on `ch` with a confirm, unless the channel of `input` closed first
/// ([`ForwardEnd::InputGone`], checked before each attempt; each attempt handed to the broker is
/// noted, [`redelivery::note_sending`]): a missing route is declared again once per attempt, and a
/// forward the broker does not take (a nack included) is held (uncharged,
/// `holding` counts it) and sent again after [`publisher::hold_backoff`], taking turns with the
/// other held forwards ([`Refusal`] says which). `turn` is the turn of the forwards held for a
/// [`Refusal::Channel`], taken before the delivery was parsed. A held delivery is handed back
/// ([`ForwardEnd::PutBack`]) at `give_back_at`; one held for its partition queue
/// ([`Refusal::Partition`]) also when [`held_cap`] are held already or when `stop` fires.
#[allow(clippy::too_many_arguments)] // the parts of one delivery's forward, all borrowed
async fn forward<'p>(
    publish: &'p PublishChannel,
    a: &AmqpSettings,
    mut ch: ConfirmChannel,
    mut turn: Option<tokio::sync::MutexGuard<'p, ()>>,
    input: &Delivery,
    fwd: BasicProperties,
    r: &Route,
    key: u128,
    stop: &CancellationToken,
    holding: &mut Option<metrics::HeldPublish>,
    give_back_at: tokio::time::Instant,
    forwarded_maybe: &mut bool,
) -> ForwardEnd {
    let rk = AmqpSettings::partition_routing_key(r.partition);
    let dest = publish.partitions.get(r.partition as usize);
    let mut slot: Option<HeldSlot<'p>> = None;
    // The turn of the forwards to this partition while its queue refuses them.
    let mut dest_turn = None;
    if dest.is_some_and(RefusalTurns::refusing) {
        match take_partition_turn(publish, a, dest, &mut slot, holding, stop, give_back_at).await {
            Ok(t) => dest_turn = t,
            Err(end) => return end,
        }
    }
    let mut declared_again = false;
    // Failed attempts of a forward the broker does not take (see below).
    let mut held = 0u32;
    let conn = &publish.conns.publish;
    loop {
        // Its channel closed (poisoned ackers, lapin): the broker has put the message back.
        if input.acker.poisoned() {
            return ForwardEnd::InputGone;
        }
        let sent_at = tokio::time::Instant::now();
        // After a hold, the forward is routed now: the time it waited here is not the partition
        // queue's delay, which the owner's split rule reads from `x-routed-at-ms`.
        let props = if held == 0 { fwd.clone() } else { routed_now(&fwd) };
        let outcome = if dest_turn.is_some() {
            // Its partition queue refuses forwards: the attempt goes on a channel of its own.
            redelivery::note_sending(key);
            publish_on_own_channel(conn, a, &a.shard_exchange, &rk, &input.data, props).await
        } else {
            // A channel that was closed or had a publish fail since it was taken is replaced.
            if let Err(err) = publish.renew(&mut ch).await {
                crate::warn_limited!(NO_CHANNEL_LOG, error = %err, "no publishing channel; requeueing input after a backoff");
                return ForwardEnd::RequeueAfterBackoff;
            }
            redelivery::note_sending(key);
            publisher::publish_confirmed(&ch, conn, a, &a.shard_exchange, &rk, &input.data, props).await
        };
        let Err(e) = outcome else {
            publish.shared.turns().accepted();
            if let Some(dest) = dest {
                dest.accepted();
            }
            drop((turn, dest_turn));
            crate::partition::forwarded_to(&a.partition_queue(r.partition), sent_at);
            return ForwardEnd::Forwarded;
        };
        // No confirm, or behind a failed publish: the broker may have enqueued it all the same.
        if matches!(e, publisher::PublishError::Timeout(_) | publisher::PublishError::AfterFailed) {
            *forwarded_maybe = true;
        }
        if repair_route(publish, a, r.partition, &e, &mut ch, &mut declared_again).await {
            continue;
        }
        redelivery::note_failure(&r.request_id, &format!("forwarding failed: {e}"));
        if stop.is_cancelled() && slot.is_some() {
            return PutBack::NOW;
        }
        if stop.is_cancelled() || !conn.status().connected() {
            crate::warn_limited!(FORWARD_FAILED_LOG, error = %e, "forwarding failed; requeueing input after a backoff");
            return ForwardEnd::RequeueAfterBackoff;
        }
        // The broker does not take forwards (write access to the shard exchange revoked, no
        // confirm in time, a nack: a partition queue without a leader, or full with
        // `reject-publish`): the deployment's fault, not the request's. Requeueing would charge
        // the request a delivery per attempt; hold it unacked instead, uncharged, and forward it
        // again. A nack during a quorum queue's leader election (a few seconds after the node of
        // its leader is lost, <https://www.rabbitmq.com/docs/quorum-queues#leader-election>) is
        // ridden out so too. A publish after a failed one on its channel
        // ([`publisher::PublishError::AfterFailed`]) may or may not have been taken: held and
        // sent again, it may add a copy, which the owner answers once
        // ([`redelivery::is_second_copy`]).
        let refusal = Refusal::of(&e);
        let step = match (refusal, dest) {
            (Refusal::Partition, Some(dest)) => {
                if let Err(end) = hold(publish, a, &mut slot) {
                    return end;
                }
                dest.refused(dest_turn.is_some())
            }
            _ => publish.shared.turns().refused(turn.is_some()),
        };
        let wait = match refusal {
            // One attempt per backoff for the partition, on a channel of its own: cheap, so the
            // wait stays short and the forwards go soon after the queue takes them again.
            Refusal::Partition => publisher::hold_backoff(a, held.max(step)).min(PARTITION_RETRY_MAX),
            Refusal::Channel => publisher::hold_backoff(a, held.max(step)),
        };
        held += 1;
        holding.get_or_insert_with(|| metrics::HeldPublish::new("forward"));
        metrics::requests(stage::ROUTER, outcome::FORWARD_HELD, 1);
        log_forward_held(&e, held, wait);
        tokio::select! {
            _ = stop.cancelled() => return if slot.is_some() { PutBack::NOW } else { ForwardEnd::Requeue },
            () = tokio::time::sleep_until(give_back_at) => {
                return ForwardEnd::PutBack(PutBack { pause: false, own_channel: refusal == Refusal::Channel });
            }
            _ = publisher::wait_to_publish_again(conn, wait) => {}
        }
        drop((turn, dest_turn));
        turn = match take_turn(&publish.shared, stop, give_back_at).await {
            Ok(next) => next,
            Err(TurnEnd::Stopped) => return if slot.is_some() { PutBack::NOW } else { ForwardEnd::Requeue },
            Err(TurnEnd::GiveBack) => return ForwardEnd::PutBack(PutBack { pause: false, own_channel: true }),
        };
        dest_turn = None;
        if dest.is_some_and(RefusalTurns::refusing) {
            match take_partition_turn(publish, a, dest, &mut slot, holding, stop, give_back_at).await {
                Ok(t) => dest_turn = t,
                Err(end) => return end,
            }
        }
        // The route may have been deleted again, or its declaration failed (no answer in time, no
        // permission yet): each held attempt may declare it once more.
        declared_again = false;
    }
}

/// Waits for the turn of the forwards to a partition whose queue refuses them (`dest`,
/// [`Refusal::Partition`]), holding the delivery in a [`HeldSlot`] (`slot`, taken here unless it
/// is already). `Ok` with the turn (`None` inside once the queue takes forwards again), or the
/// delivery's end: put back after a pause when [`held_cap`] are held already, at once when `stop`
/// fires or at `give_back_at`.
#[allow(clippy::too_many_arguments)] // the parts of one delivery's forward, all borrowed
async fn take_partition_turn<'p>(
    publish: &'p PublishChannel,
    a: &AmqpSettings,
    dest: Option<&'p RefusalTurns>,
    slot: &mut Option<HeldSlot<'p>>,
    holding: &mut Option<metrics::HeldPublish>,
    stop: &CancellationToken,
    give_back_at: tokio::time::Instant,
) -> Result<Option<tokio::sync::MutexGuard<'p, ()>>, ForwardEnd> {
    let Some(dest) = dest else { return Ok(None) };
    hold(publish, a, slot)?;
    holding.get_or_insert_with(|| metrics::HeldPublish::new("forward"));
    tokio::select! {
        biased;
        turn = dest.turn() => Ok(turn),
        _ = stop.cancelled() => Err(PutBack::NOW),
        _ = tokio::time::sleep_until(give_back_at) => Err(PutBack::NOW),
    }
}

/// Holds the delivery for a refusing partition queue in a [`HeldSlot`] (`slot`, unless it holds
/// one already), or hands it back ([`PutBack::AFTER_PAUSE`]) when [`held_cap`] are held already.
fn hold<'p>(publish: &'p PublishChannel, a: &AmqpSettings, slot: &mut Option<HeldSlot<'p>>) -> Result<(), ForwardEnd> {
    if slot.is_none() {
        *slot = Some(HeldSlot::take(&publish.held, held_cap(a)).ok_or(PutBack::AFTER_PAUSE)?);
    }
    Ok(())
}

/// Publishes one message with a confirm ([`publisher::publish_confirmed`]) on a confirm-mode
/// channel opened for it and closed after it (in the background): an attempt of a forward to a
/// partition queue that refuses forwards ([`Refusal::Partition`]), or a put-back after the broker
/// refused the shared channel ([`Refusal::Channel`]), so that a refusal closes or holds up no
/// other publish. The channel's opening is bounded by `amqp.confirm_timeout` (a connection the
/// broker blocked answers no `channel.open`); a failed opening is a
/// [`publisher::PublishError::Amqp`].
async fn publish_on_own_channel(
    conn: &Arc<lapin::Connection>,
    a: &AmqpSettings,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<(), publisher::PublishError> {
    let own = match tokio::time::timeout(a.confirm_timeout, ConfirmChannel::open(conn)).await {
        Ok(opened) => opened?,
        Err(_) => return Err(lapin::Error::from(std::io::Error::new(std::io::ErrorKind::TimedOut, "channel.open not answered within amqp.confirm_timeout")).into()),
    };
    let outcome = publisher::publish_confirmed(&own, conn, a, exchange, routing_key, body, props).await;
    tokio::spawn(async move {
        let _ = crate::amqp::close_channel(&own, "a publish on a channel of its own").await;
    });
    outcome
}

/// Puts an input delivery held for a refused forward back into the input queue without charging
/// it a delivery ([`ForwardEnd::PutBack`]): after the rest of [`PUT_BACK_PAUSE`] when `how.pause`
/// (cut short by `stop`), a copy (the same body and properties, [`publisher::carried_props`],
/// with `message_id` = `request_id` when it had none, [`redelivery::HEADER_PUT_BACK_AT_MS`], and
/// [`redelivery::HEADER_FORWARDED_BEFORE`] when a forward of it may have reached its partition
/// queue: `forwarded_maybe`, or the delivery was marked or redelivered) is published to the
/// input queue with a confirm, on a channel of its own when `how.own_channel`, then the delivery
/// is acked. Quorum queues
/// charge every return of a delivery (nack, the channel's close, `consumer_timeout`) towards
/// `amqp.delivery_limit`. The copy goes to the back of the queue, and any instance's router may
/// take it. A copy is published again, on a new channel, up to [`PUT_BACK_ATTEMPTS`] times in
/// all (an outside test saw a put-back meet the shared channel closing, and the delivery
/// requeued, charged, and dead-lettered with `amqp.delivery_limit = 1`); then the delivery is
/// left to [`requeue_after_backoff`] (charged, never lost). A copy confirmed whose ack then
/// fails, or a crash between the two, makes a duplicate (the original comes back charged).
async fn put_back(publish: &PublishChannel, a: &AmqpSettings, delivery: Delivery, request_id: Option<&str>, how: PutBack, forwarded_maybe: bool, stop: &CancellationToken) {
    let headers = delivery.properties.headers().as_ref();
    // A copy put back before waits out the rest of its pause, within the budget; one taken for
    // the first time goes back at once (the publishers' own rate bounds those).
    if how.pause && publisher::header_u64(headers, redelivery::HEADER_PUT_BACK_AT_MS).is_some() {
        let at = publish.pace_put_back(a, tokio::time::Instant::now() + rest_of_pause(headers, publisher::unix_ms()));
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep_until(at) => {}
        }
    }
    let mut marked = forwarded_maybe
        || delivery.redelivered
        || publisher::header_u64(headers, redelivery::HEADER_FORWARDED_BEFORE).is_some_and(|v| v > 0);
    let conn = &publish.conns.publish;
    let mut copied = Err(String::new());
    // A channel closing under the copy (replaced after another publish failed, or closed by the
    // broker) is no reason to charge the delivery: the copy goes again on a new channel. A copy
    // whose outcome is unknown (no confirm) may be in the queue already: the next one is marked,
    // so the two are answered once.
    for _ in 0..PUT_BACK_ATTEMPTS {
        let mut extra = vec![(redelivery::HEADER_PUT_BACK_AT_MS, publisher::unix_ms().to_string())];
        if marked {
            extra.push((redelivery::HEADER_FORWARDED_BEFORE, "1".to_owned()));
        }
        let mut props = publisher::carried_props(&delivery.properties, &extra);
        if let (None, Some(Ok(id))) = (props.message_id(), request_id.map(|id| short_string("id", id, MAX_ID_BYTES))) {
            props = props.with_message_id(id);
        }
        let outcome = if how.own_channel {
            publish_on_own_channel(conn, a, "", &a.input_queue, &delivery.data, props).await
        } else {
            match publish.get().await {
                Ok(ch) => publisher::publish_confirmed(&ch, conn, a, "", &a.input_queue, &delivery.data, props).await,
                Err(e) => Err(publisher::PublishError::Amqp(e)),
            }
        };
        match outcome {
            Ok(()) => {
                copied = Ok(());
                break;
            }
            Err(e) => {
                marked |= matches!(e, publisher::PublishError::Timeout(_) | publisher::PublishError::AfterFailed);
                copied = Err(e.to_string());
                if !conn.status().connected() || delivery.acker.poisoned() {
                    break;
                }
            }
        }
    }
    let id = request_id.unwrap_or_default();
    if let Err(e) = copied {
        // Blocked (a memory or disk alarm): no copy can be published, and the hold must end
        // before `amqp.consumer_timeout`; the requeue is charged for a fault that is not its own.
        if conn.status().blocked() {
            if let Some(id) = request_id {
                redelivery::note_uncharged_return(publisher::input_message_key(id, &delivery));
            }
        }
        crate::warn_limited!(FORWARD_FAILED_LOG, error = %e, request_id = %id, "could not put an input delivery held for a refused forward back uncharged; requeueing it after a backoff");
        return requeue_after_backoff(a, delivery, stop).await;
    }
    match crate::amqp::ack(&delivery.acker).await {
        Ok(()) => {
            debug!(request_id = %id, "put an input delivery held for a refused forward back into the input queue, uncharged");
            metrics::requests(stage::ROUTER, outcome::RETURNED_UNCHARGED, 1);
        }
        Err(e) => warn!(request_id = %id, error = %e, "an input delivery put back uncharged could not be acked: it returns as well and will be answered twice"),
    }
}

/// How long a delivery beyond [`held_cap`] waits before it goes back into the input queue, at
/// `now_ms` (Unix milliseconds): the rest of [`PUT_BACK_PAUSE`] since its last put-back
/// ([`redelivery::HEADER_PUT_BACK_AT_MS`] in `headers`), zero for a delivery never put back.
fn rest_of_pause(headers: Option<&FieldTable>, now_ms: u64) -> Duration {
    let since = publisher::header_u64(headers, redelivery::HEADER_PUT_BACK_AT_MS).map(|at| now_ms.saturating_sub(at));
    since.map_or(Duration::ZERO, |ms| PUT_BACK_PAUSE.saturating_sub(Duration::from_millis(ms)))
}

/// After a failed forward on `ch`: when the route is missing (`e` says so), declares it again
/// once per held attempt (`declared_again`) and returns `true` (publish again at once, on a new
/// channel); replaces a channel that had a publish fail. `false`: the failure stands.
async fn repair_route(publish: &PublishChannel, a: &AmqpSettings, partition: u32, e: &publisher::PublishError, ch: &mut ConfirmChannel, declared_again: &mut bool) -> bool {
    // The shard exchange or the partition queue was deleted while the daemon ran: declare the
    // route again (once per attempt: the hold in [`forward`] paces the attempts) instead of charging
    // the request a delivery per attempt until `amqp.delivery_limit` dead-letters it. When
    // the failed publish closed the channel (404 for the exchange), the next attempt goes on
    // a new one.
    if !*declared_again && publisher::says_missing(e) {
        *declared_again = true;
        if publisher::declare_again(&publish.conns.publish, a, publisher::OwnDestination::Partition(partition)).await {
            match publish.renew(ch).await {
                Ok(()) => return true,
                Err(err) => warn!(error = %err, "cannot replace the publishing channel"),
            }
        }
    }
    // After a nack (or a publish after a failed one) the channel is replaced: a quorum
    // queue may drop its later publishes (see `ConfirmChannel`).
    if ch.has_failed() {
        if let Err(err) = publish.renew(ch).await {
            warn!(error = %err, "cannot replace the publishing channel");
        }
    }
    false
}

/// Logs a held forward: at ERROR when the broker denies write access (an operator must act),
/// else at WARN; both rate-limited.
fn log_forward_held(e: &publisher::PublishError, held: u32, wait: std::time::Duration) {
    if publisher::access_refused(e) {
        crate::error_limited!(
            FORWARD_FAILED_LOG,
            error = %e,
            attempts = held,
            retry_in = ?wait,
            "forward refused: the broker denies the daemon's user write access to the shard exchange (403 ACCESS_REFUSED; check its write permission on the vhost, rabbitmqctl list_user_permissions); holding the input delivery unacked, not charged a delivery, and forwarding it again"
        );
    } else {
        crate::warn_limited!(
            FORWARD_FAILED_LOG,
            error = %e,
            attempts = held,
            retry_in = ?wait,
            "forwarding failed: the broker does not take forwards; holding the input delivery unacked, not charged a delivery, and forwarding it again"
        );
    }
}

/// Waits for the turn of the forwards held for a [`Refusal::Channel`]
/// ([`crate::amqp::RefusalTurns::turn`]): `Ok` with the turn (`None` inside when forwards go
/// concurrently), or why not: `stop` fired, or `give_back_at` came first.
async fn take_turn<'a>(shared: &'a SharedConfirmChannel, stop: &CancellationToken, give_back_at: tokio::time::Instant) -> Result<Option<tokio::sync::MutexGuard<'a, ()>>, TurnEnd> {
    tokio::select! {
        biased;
        turn = shared.turns().turn() => Ok(turn),
        _ = stop.cancelled() => Err(TurnEnd::Stopped),
        () = tokio::time::sleep_until(give_back_at) => Err(TurnEnd::GiveBack),
    }
}

/// A delivery whose forward or dead letter the broker did not confirm (channel closed,
/// unroutable, nacked, no confirm): held for [`redelivery::requeue_backoff`], then requeued (at
/// once when `stop` fires), so that a broker fault does not use up the request's deliveries in
/// milliseconds.
async fn requeue_after_backoff(a: &AmqpSettings, delivery: Delivery, stop: &CancellationToken) {
    let wait = redelivery::requeue_backoff(a, redelivery::delivery_count(redelivery::Source::Input, delivery.redelivered, delivery.properties.headers().as_ref()));
    debug!(retry_in = ?wait, "holding an input delivery before requeueing it");
    staged(BACKOFF, async {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    })
    .await;
    requeue(delivery).await
}

/// Not acked: requeue so another attempt (here or on another instance) can succeed.
async fn requeue(delivery: Delivery) {
    let _ = staged(REQUEUE, crate::amqp::nack_requeue(&delivery.acker)).await;
    metrics::requests(stage::ROUTER, outcome::REQUEUED, 1);
}

/// Properties of a forwarded request: those of [`publisher::carried_props`] (an allowlist; no
/// `user_id`, no `expiration`), with `message_id` = request id (so every stage agrees on a
/// generated id), `correlation_id` defaulting to the request id, the shard, the routed key and the
/// time of forwarding in headers (`x-shard`, `x-routed-key`, `x-routed-at-ms`), a fresh
/// [`redelivery::HEADER_FORWARD_ID`], header
/// [`redelivery::HEADER_INPUT_REDELIVERED`]: [`redelivery::MARK_FORWARDED_MAYBE`] on a copy put back
/// after a forward whose outcome was unknown ([`redelivery::HEADER_FORWARDED_BEFORE`]), else `1`
/// when `redelivered` (the input queue had delivered the message before, and it may be a copy of
/// another router's forward), and persistent delivery. Errors when the request id is not a valid short
/// string (longer than [`MAX_ID_BYTES`]; [`crate::request::parse`] already refuses those).
fn forward_props(props: &BasicProperties, r: &Route, redelivered: bool) -> Result<BasicProperties, ParseError> {
    let id = short_string("id", &r.request_id, MAX_ID_BYTES)?;
    let mut headers = vec![
        (HEADER_SHARD, r.shard.to_string()),
        (HEADER_ROUTED_KEY, r.routed.to_string()),
        (HEADER_ROUTED_AT_MS, publisher::unix_ms().to_string()),
        (redelivery::HEADER_FORWARD_ID, uuid::Uuid::new_v4().simple().to_string()),
    ];
    if publisher::header_u64(props.headers().as_ref(), redelivery::HEADER_FORWARDED_BEFORE).is_some_and(|v| v > 0) {
        headers.push((redelivery::HEADER_INPUT_REDELIVERED, redelivery::MARK_FORWARDED_MAYBE.to_string()));
    } else if redelivered {
        headers.push((redelivery::HEADER_INPUT_REDELIVERED, "1".to_owned()));
    }
    let p = publisher::carried_props(props, &headers)
        .with_message_id(id.clone())
        .with_delivery_mode(publisher::PERSISTENT);
    // An empty `correlation_id` counts as none: a requester cannot match a result by it.
    Ok(if props.correlation_id().as_ref().is_none_or(|c| c.as_str().is_empty()) { p.with_correlation_id(id) } else { p })
}

/// `fwd` with [`HEADER_ROUTED_AT_MS`] set to now, for a forward sent again after a hold. The
/// owner's split rule measures a request's delay in the partition queue from that header
/// ([`crate::splits::batch_key`]); a forward held here for the broker (refused, unconfirmed)
/// kept its first routing time, so the hold counted as queueing, and with many held forwards of
/// one key the owner split it when the broker took them again. The dedup fingerprint leaves
/// that header out ([`publisher::ROUTING_HEADERS`]), so the copies still match.
fn routed_now(fwd: &BasicProperties) -> BasicProperties {
    let headers = publisher::headers_with(fwd.headers().as_ref(), &[(HEADER_ROUTED_AT_MS, publisher::unix_ms().to_string())]);
    fwd.clone().with_headers(headers)
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use lapin::types::{AMQPValue, ShortString};

    use super::*;
    use crate::affinity::{SplitMember, SplitState, SplitView};
    use crate::config::RawConfig;
    use crate::keying::{level_key, PrefixKey};
    use crate::request::{parse, Envelope};

    fn settings(edit: impl FnOnce(&mut RawConfig)) -> Settings {
        let mut raw = RawConfig::default();
        raw.keying.prefix_chars = 8;
        edit(&mut raw);
        Settings::from_raw(&raw).unwrap()
    }

    fn req(json: &str) -> crate::request::Request {
        parse(json.as_bytes(), &Envelope::default(), 1 << 20).unwrap()
    }

    #[test]
    fn adaptive_routes_by_the_shortest_unsplit_level_and_static_entries_win() {
        let s = settings(|r| {
            r.sharding.keys.insert("tenant-1".into(), 3);
        });
        let a = Affinity::default();
        let r = req(r#"{"prompt":"shared prefix, then the rest of a long prompt"}"#);
        let first = route_in(&r, &s, &a);
        assert_eq!((first.routed.level, first.routed.levels, first.shard), (0, 4, 0));
        assert_eq!(first.routed.key, PrefixKey::of("shared p"));

        a.set_view(SplitView::new([SplitMember { level: 0, key: first.routed.key, state: SplitState::Split }]));
        let split = route_in(&r, &s, &a);
        assert_eq!(split.routed.level, 1);
        assert_eq!(Some(split.routed.key), level_key(&r, &s.keying, 1));
        assert_eq!(split.key_hex, split.routed.key.to_string());
        assert_eq!(split.partition, partition_of(split.routed.key, 0, s.amqp.partitions));

        // An explicit key with a static entry keeps its static shards, whatever the view says.
        let t = req(r#"{"prompt":"x","prefix_key":"tenant-1"}"#);
        a.set_view(SplitView::new([SplitMember { level: 0, key: PrefixKey::of("tenant-1"), state: SplitState::Spread(NonZeroU32::new(8).unwrap()) }]));
        for _ in 0..50 {
            let rt = route_in(&t, &s, &a);
            assert!(rt.shard < 3 && rt.routed.level == 0, "{rt:?}");
        }
    }

    #[test]
    fn static_and_off_modes_ignore_the_split_view() {
        let r = req(r#"{"prompt":"shared prefix, then more"}"#);
        let a = Affinity::default();
        a.set_view(SplitView::new([SplitMember { level: 0, key: PrefixKey::of("shared p"), state: SplitState::Split }]));
        let s = settings(|r| {
            r.keying.mode = "prefix".into();
            r.sharding.default_shards = 2;
        });
        for _ in 0..20 {
            let rt = route_in(&r, &s, &a);
            assert_eq!((rt.routed.level, rt.routed.key), (0, PrefixKey::of("shared p")));
            assert!(rt.shard < 2);
        }
        let off = settings(|r| r.keying.mode = "off".into());
        assert_eq!(route_in(&r, &off, &a).shard, 0);
    }

    fn route_of(id: &str) -> Route {
        let routed = RoutedKey { level: 0, levels: 1, key: PrefixKey(0) };
        Route { request_id: id.to_owned(), key_hex: "0".repeat(16), routed, key_preview: String::new(), shard: 1, partition: 5 }
    }

    #[test]
    fn forwarded_requests_drop_user_id_and_expiration() {
        // A publisher's own `x-input-redelivered` is not passed on: only the router sets it.
        let mut own = FieldTable::default();
        own.insert(ShortString::from(redelivery::HEADER_INPUT_REDELIVERED), AMQPValue::LongString("1".into()));
        let props = BasicProperties::default().with_user_id("other".into()).with_expiration("5000".into()).with_headers(own);
        let p = forward_props(&props, &route_of("r1"), false).unwrap();
        assert!(p.user_id().is_none() && p.expiration().is_none());
        assert_eq!(p.message_id().as_ref().map(|m| m.as_str()), Some("r1"));
        assert_eq!(p.correlation_id().as_ref().map(|m| m.as_str()), Some("r1"));
        assert_eq!(*p.delivery_mode(), Some(publisher::PERSISTENT));
        let empty = BasicProperties::default().with_correlation_id("".into());
        let p_empty = forward_props(&empty, &route_of("r2"), true).unwrap();
        assert_eq!(p_empty.correlation_id().as_ref().map(|m| m.as_str()), Some("r2"), "an empty correlation_id counts as none");
        let h = p.headers().as_ref();
        assert_eq!(publisher::header_str(h, publisher::HEADER_ORIGINAL_USER_ID).as_deref(), Some("other"));
        assert_eq!(publisher::header_str(h, HEADER_SHARD).as_deref(), Some("1"));
        assert_eq!(publisher::header_str(h, redelivery::HEADER_INPUT_REDELIVERED), None, "set by a publisher, first delivery");
        let marked = p_empty.headers().as_ref();
        assert_eq!(publisher::header_str(marked, redelivery::HEADER_INPUT_REDELIVERED).as_deref(), Some("1"), "a redelivered input message");
        let forward_id = |h| publisher::header_str(h, redelivery::HEADER_FORWARD_ID).map(|f| f.into_owned());
        assert!(forward_id(h).is_some_and(|f| f.len() == 32) && forward_id(h) != forward_id(marked), "one forward id per forward");
    }

    #[test]
    fn a_forward_sent_again_after_a_hold_is_routed_at_its_new_send() {
        let p = forward_props(&BasicProperties::default().with_app_id("app".into()), &route_of("r1"), false).unwrap();
        let routed_at = |p: &BasicProperties| publisher::header_u64(p.headers().as_ref(), HEADER_ROUTED_AT_MS).unwrap();
        // As if routed 30 s ago and held since.
        let old = publisher::headers_with(p.headers().as_ref(), &[(HEADER_ROUTED_AT_MS, (publisher::unix_ms() - 30_000).to_string())]);
        let held = p.clone().with_headers(old);
        let again = routed_now(&held);
        assert!(routed_at(&again) >= routed_at(&held) + 30_000, "{} against {}", routed_at(&again), routed_at(&held));
        let h = |p: &BasicProperties, k| publisher::header_str(p.headers().as_ref(), k).map(|v| v.into_owned());
        for k in [HEADER_SHARD, HEADER_ROUTED_KEY, redelivery::HEADER_FORWARD_ID] {
            assert_eq!(h(&again, k), h(&held, k), "{k} kept");
        }
        assert_eq!(again.app_id(), held.app_id());
        assert_eq!(
            publisher::request_fingerprint("r1", b"{}", &again),
            publisher::request_fingerprint("r1", b"{}", &held),
            "still the same forward for the dedup"
        );
    }

    #[test]
    fn a_long_request_id_is_an_error_not_a_panic() {
        let err = forward_props(&BasicProperties::default(), &route_of(&"a".repeat(300)), false).unwrap_err();
        assert_eq!(err.reason(), "invalid_field");
        assert!(forward_props(&BasicProperties::default(), &route_of(&"a".repeat(MAX_ID_BYTES)), false).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_abandons_deliveries_in_flight_that_never_end_and_names_what_they_wait_for() {
        let mut inflight = JoinSet::new();
        inflight.spawn(staged(ACK, std::future::pending::<()>()));
        inflight.spawn(async {});
        tokio::task::yield_now().await;
        assert!(stages_now().contains("ack: 1"), "{}", stages_now());
        let started = tokio::time::Instant::now();
        finish_inflight(&mut inflight).await;
        assert!(inflight.is_empty());
        assert_eq!(started.elapsed(), INFLIGHT_GIVE_UP_AFTER);
        assert!(!stages_now().contains("ack"), "an abandoned delivery leaves its stage: {}", stages_now());
    }

    #[test]
    fn requeue_backoff_doubles_up_to_the_maximum() {
        let mut raw = crate::config::RawConfig::default();
        raw.amqp.reconnect_backoff_initial = "100ms".into();
        raw.amqp.reconnect_backoff_max = "1s".into();
        let a = Settings::from_raw(&raw).unwrap().amqp;
        let got: Vec<u128> = [0, 1, 3, 4, 99].iter().map(|n| redelivery::requeue_backoff(&a, *n).as_millis()).collect();
        assert_eq!(got, [100, 200, 800, 1000, 1000]);
    }

    #[test]
    fn a_refusal_of_the_channel_concerns_every_partition_and_one_of_a_queue_only_that_queue() {
        use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};
        let soft = |kind: AMQPSoftError| lapin::Error::from(lapin::ErrorKind::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(kind), "refused".into())));
        let denied = publisher::PublishError::Amqp(soft(AMQPSoftError::ACCESSREFUSED));
        assert_eq!(Refusal::of(&denied), Refusal::Channel, "403 on the shard exchange closes the shared channel");
        assert_eq!(Refusal::of(&publisher::PublishError::Amqp(soft(AMQPSoftError::NOTFOUND))), Refusal::Channel, "404 closes it too");
        for e in [
            publisher::PublishError::Nacked,
            publisher::PublishError::Timeout(Duration::from_secs(1)),
            publisher::PublishError::AfterFailed,
            publisher::PublishError::Unroutable { exchange: "x".into(), routing_key: "3".into() },
        ] {
            assert_eq!(Refusal::of(&e), Refusal::Partition, "{e}");
        }
    }

    #[test]
    fn at_most_half_the_input_prefetch_is_held_for_refusing_partition_queues() {
        let mut raw = crate::config::RawConfig::default();
        raw.amqp.input_prefetch = 16;
        let a = Settings::from_raw(&raw).unwrap().amqp;
        assert_eq!(held_cap(&a), 8);
        let held = AtomicUsize::new(0);
        let slots: Vec<HeldSlot> = (0..8).map(|_| HeldSlot::take(&held, held_cap(&a)).expect("below the cap")).collect();
        assert!(HeldSlot::take(&held, held_cap(&a)).is_none(), "the ninth is put back");
        drop(slots);
        assert_eq!(held.load(Ordering::Acquire), 0, "a slot is freed when its delivery ends");
        raw.amqp.input_prefetch = 1;
        assert_eq!(held_cap(&Settings::from_raw(&raw).unwrap().amqp), 1, "at least one is held, to find out when the queue takes forwards again");
    }

    #[test]
    fn a_copy_back_within_the_pause_waits_out_its_rest_and_others_go_at_once() {
        let at = |ms: u64| publisher::headers_with(None, &[(redelivery::HEADER_PUT_BACK_AT_MS, ms.to_string())]);
        assert_eq!(rest_of_pause(None, 10_000), Duration::ZERO, "taken for the first time: at once");
        assert_eq!(rest_of_pause(Some(&at(9_700)), 10_000), Duration::from_millis(700), "back after 300 ms");
        assert_eq!(rest_of_pause(Some(&at(8_000)), 10_000), Duration::ZERO, "back after 2 s: others waited ahead of it");
        assert_eq!(rest_of_pause(Some(&at(20_000)), 10_000), PUT_BACK_PAUSE, "a time ahead of the clock waits one pause, no more");
    }

    #[tokio::test(start_paused = true)]
    async fn copies_go_back_at_most_the_input_prefetch_a_second() {
        let mut raw = crate::config::RawConfig::default();
        raw.amqp.input_prefetch = 8;
        let a = Settings::from_raw(&raw).unwrap().amqp;
        assert_eq!(put_back_budget(&a), 8);
        let next = std::sync::Mutex::new(None);
        let now = tokio::time::Instant::now();
        let times: Vec<Duration> = (0..10).map(|_| pace(&next, &a, now) - now).collect();
        let step = Duration::from_millis(125);
        assert_eq!(times, (0..10).map(|i| step * i).collect::<Vec<_>>(), "8 a second, each at its own time");
        let later = now + Duration::from_secs(5);
        assert_eq!(pace(&next, &a, later), later, "a copy due after the budget's last slot goes at once");
    }
}
