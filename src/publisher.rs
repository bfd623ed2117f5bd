//! The publisher stage: result shaping, publishing with publisher confirms (results, dead
//! letters, forwarded requests) and the ack that follows.
//!
//! Every publish here waits for the broker's confirm (<https://www.rabbitmq.com/docs/confirms>)
//! before the message that caused it is acked: at-least-once end to end. Publishes are
//! `mandatory`, so a message that no queue takes is returned instead of silently dropped — with
//! one exception the broker imposes: a result for a direct reply-to requester
//! (`amq.rabbitmq.reply-to.…`) is returned even when it was delivered, so such a return is
//! settled by asking the broker whether the requester is still there ([`publish_result`]).
//!
//! - [`parse_or_dead_letter`]: the one intake check of the router and the partition consumers —
//!   parse a delivery, or dead-letter it (confirmed) and ack it.
//! - [`shape_result`] + [`publish_result`]: a request's result goes to its `reply_to` queue, or to
//!   `amqp.results_queue` when it has none or `reply_to` refuses it (then with the headers
//!   `x-reply-to-refused` and `x-reply-to`; for a direct reply-to requester, see
//!   [`publish_result`]); the lease is checked before each publish, so a worker whose lease may
//!   have expired publishes no result (see [`crate::lease`]); a result already confirmed is acked
//!   all the same. Every delivery ends acked or nacked with requeue ([`Settlement`]).
//!
//! Every header name the daemon reads or writes is a constant here (`x-…` and `timestamp_in_ms`).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::Acker;
use lapin::message::{BasicReturnMessage, Delivery};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection};
use serde_json::Value;
use tracing::{debug, info, warn};
use crate::log_limit::LogLimit;

use crate::amqp::{ConfirmChannel, Earlier, SharedConfirmChannel};
use crate::config::AmqpSettings;
use crate::lease::LeaseClock;
use crate::llm::{Completion, ErrorKind, LlmError};
use crate::metrics::{self, outcome, stage};
use crate::policy::RequestPolicy;
use crate::redelivery::{self, HEADER_DELIVERY_COUNT};
use crate::request::{parse, Envelope, ParseError, Request, RequestResult, ResultError, TimingsMs, REASON_DELIVERY_LIMIT};

/// Header carrying the dead-letter reason (a stable kind, see [`crate::request::DEAD_LETTER_REASONS`]).
pub const HEADER_DEATH_REASON: &str = "x-death-reason";
/// Header carrying the human-readable dead-letter detail.
pub const HEADER_DEATH_DETAIL: &str = "x-death-detail";
/// Header carrying the request id on results.
pub const HEADER_REQUEST_ID: &str = "x-request-id";
/// Header carrying the partition lease epoch (fencing token) on results.
pub const HEADER_PARTITION_EPOCH: &str = "x-partition-epoch";
/// Header carrying the partition on results.
pub const HEADER_PARTITION: &str = "x-partition";
/// Header naming the instance that produced a result.
pub const HEADER_INSTANCE: &str = "x-instance";
/// Header of an explicit prefix key on requests.
pub const HEADER_PREFIX_KEY: &str = "x-prefix-key";
/// Header set by the router on forwarded requests: the chosen shard.
pub const HEADER_SHARD: &str = "x-shard";
/// Header set by the router on forwarded requests: the key it routed by, `"{level}/{levels}:{key hex}"` ([`crate::affinity::RoutedKey`]); partitions batch by it.
pub const HEADER_ROUTED_KEY: &str = "x-routed-key";
/// Header set by the router on forwarded requests: when it forwarded them, in Unix milliseconds.
/// The split rule measures a partition's queueing delay from it ([`crate::affinity::LoadTracker`]):
/// the time since the publish also holds the wait in the input queue, which every partition shares
/// (a router backlog, such as the requests waiting at the first start, is not one key's load).
pub const HEADER_ROUTED_AT_MS: &str = "x-routed-at-ms";
/// Header keeping the `user_id` property of a forwarded or dead-lettered message (the property
/// itself is not copied, see [`carried_props`]).
pub const HEADER_ORIGINAL_USER_ID: &str = "x-original-user-id";
/// Header keeping the `expiration` property of a forwarded or dead-lettered message (the
/// property itself is not copied, see [`carried_props`]).
pub const HEADER_ORIGINAL_EXPIRATION: &str = "x-original-expiration";

/// Header with the publish time in Unix milliseconds, the name RabbitMQ's message-timestamp plugin
/// uses (<https://github.com/rabbitmq/rabbitmq-message-timestamp>); preferred over the AMQP
/// `timestamp` property, which has whole-second resolution.
pub const HEADER_TIMESTAMP_MS: &str = "timestamp_in_ms";

/// AMQP delivery mode 2: persistent.
pub const PERSISTENT: u8 = 2;

/// Publish errors.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Channel or connection failure.
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker refused the message (`basic.nack`).
    #[error("broker nacked the publish")]
    Nacked,
    /// No queue took the message (`basic.return` of a mandatory publish).
    #[error("unroutable: no queue is bound for exchange `{exchange}` routing key `{routing_key}`")]
    Unroutable { exchange: String, routing_key: String },
    /// No confirm within `amqp.confirm_timeout`.
    #[error("no publisher confirm within {0:?}")]
    Timeout(Duration),
    /// Confirmed, but an earlier publish to the same destination on the same channel failed (or
    /// an earlier publish did not settle in time), after which a RabbitMQ 3.10 quorum queue may
    /// drop the channel's later publishes to it while confirming them (rabbitmq-server #14589);
    /// see [`crate::amqp::ConfirmChannel`]. Publish again on a new channel, or requeue.
    #[error("an earlier publish to the same destination on the channel failed, so the broker may have dropped this one")]
    AfterFailed,
    /// Not published: the partition's local lease deadline had passed ([`LeaseClock`]), so the
    /// partition's next owner may be answering the request already. Checked before every
    /// publish of a partition's results and dead letters, also the second one of a result
    /// that its `reply_to` refused.
    #[error("not published: the partition's lease deadline passed (its next owner answers the request)")]
    LeaseExpired,
}

/// Whether `e` is the broker's 403 `ACCESS_REFUSED` to a publish: the daemon's user has no
/// write access to the exchange (AMQP 0-9-1 `basic.publish` needs it,
/// <https://www.rabbitmq.com/docs/access-control>). Only an operator ends that, so the
/// publishes held for it are logged at `ERROR`, not `WARN`.
pub fn access_refused(e: &PublishError) -> bool {
    matches!(e, PublishError::Amqp(e) if crate::amqp::reply_code(e) == Some(crate::amqp::ACCESS_REFUSED))
}

/// How long a publish's task ([`publish_confirmed`]) waits for a confirm after its caller gave
/// up, as a multiple of `amqp.confirm_timeout`, and at least [`LATE_CONFIRM_MIN_WAIT`].
const LATE_CONFIRM_WAIT_FACTOR: u32 = 10;
/// See [`LATE_CONFIRM_WAIT_FACTOR`].
const LATE_CONFIRM_MIN_WAIT: Duration = Duration::from_secs(60);

/// The message a publish sent, to tell its own return from another's ([`is_own_return`]).
struct OwnPublish {
    exchange: String,
    routing_key: String,
    message_id: Option<ShortString>,
    body: Arc<[u8]>,
}

impl OwnPublish {
    /// What a publish of `body` to `exchange` with `routing_key` and `props` sends.
    fn new(exchange: &str, routing_key: &str, body: &[u8], props: &BasicProperties) -> Self {
        OwnPublish { exchange: exchange.to_owned(), routing_key: routing_key.to_owned(), message_id: props.message_id().clone(), body: Arc::from(body) }
    }
}

/// Publishes one message (`mandatory`) on `ch` and waits for its confirm, at most
/// `amqp.confirm_timeout`, then for the publishes sent before it on `ch` to settle (at most as
/// long again): it is delivered only when they were too ([`ConfirmChannel`]; otherwise
/// [`PublishError::AfterFailed`]). While the broker blocks `conn` (`connection.blocked`), it
/// waits before it sends anything, and the confirm wait does not run out (`await_unless_blocked`).
///
/// **Returns on a shared channel.** A `basic.return` names no delivery tag (AMQP 0-9-1
/// §1.8.3.9). lapin 4 queues returns in arrival order and gives the oldest to the next confirm
/// it completes (`Acknowledgements::complete_pending`), and completes the confirms of one
/// `multiple` ack in hash-map order: a return can reach another publish's confirm, completed
/// before or after the returned publish's own in the same ack frame. RabbitMQ sends a returned
/// publish's `basic.return` before its ack, and acks returned publishes in ascending order (an
/// unroutable publish is confirmed at once, and each flush of confirms is sorted:
/// `coalesce_and_send` in `rabbit_channel`); so once lapin has processed the ack frame that
/// completed a publish's confirm, the returns of that publish and of every publish before it
/// have reached some confirm. Every confirm of a channel therefore goes to one task, the
/// channel's collector (`collect_confirms`): when one completes, it waits until lapin has
/// finished that ack frame, takes every confirm completed by then, and compares each return
/// they carry with what the publishes still waiting sent ([`is_own_return`]: exchange, routing
/// key, `message_id`, body), before it sends any outcome:
/// - a return of a waiting publish (this one or another) makes that publish
///   [`PublishError::Unroutable`], whatever its own confirm says;
/// - a return that matches no waiting publish is placed again ([`place_returned`]). A publish
///   waits in the collector until its confirm comes or the collector's wait ends (below), also
///   after its caller gave up; a return of a publish whose caller gave up is dropped, since that
///   caller publishes it again or requeues it. So only a return that comes after the
///   collector's wait, or one whose publish's frames lapin had not yet handed to the collector,
///   is placed again: at worst a duplicate.
///
/// The collector keeps waiting for a confirm after its caller gave up (`amqp.confirm_timeout`,
/// or the caller was dropped): a confirm that comes later may still carry another publish's
/// return. It waits at most `LATE_CONFIRM_WAIT_FACTOR` × `amqp.confirm_timeout` (at least
/// `LATE_CONFIRM_MIN_WAIT`); a closed channel ends the wait at once. `conn` opens the channel
/// of a placement, and declares a missing destination again.
pub async fn publish_confirmed(
    ch: &ConfirmChannel,
    conn: &Arc<Connection>,
    amqp: &AmqpSettings,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<(), PublishError> {
    send_confirmed(ch, conn, amqp, OwnPublish::new(exchange, routing_key, body, &props), props, None).await
}

/// [`publish_confirmed`] of `own`, with `lease` checked last before the message's frames are
/// queued: after the wait for an unblocked connection, with no await between the check and the
/// queuing. An invalid lease publishes nothing ([`PublishError::LeaseExpired`]).
async fn send_confirmed(
    ch: &ConfirmChannel,
    conn: &Arc<Connection>,
    amqp: &AmqpSettings,
    own: OwnPublish,
    props: BasicProperties,
    lease: Option<&LeaseClock>,
) -> Result<(), PublishError> {
    // Nothing is written into a connection the broker blocks: a publish written there goes out
    // when the alarm ends whatever happens meanwhile, so a delivery returned during the alarm
    // (by `consumer_timeout`) would get a second outcome. Waiting here, an aborted publish was
    // never sent (`crate::redelivery::OutcomeInFlight`).
    wait_unblocked(conn).await;
    // The lease may have ended during that wait (Redis was unreachable for its renewals, or
    // another instance took the partition) or while the process was stopped: checked here, with
    // no await before the frames are queued, a stale owner's publish is never queued. Frames
    // queued before a stop still go out after it, as any publish in flight.
    if lease.is_some_and(|l| !l.is_valid()) {
        return Err(PublishError::LeaseExpired);
    }
    let timeout = amqp.confirm_timeout;
    let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
    let (ticket, sent) = ch.send(&own.exchange, &own.routing_key, options, own.body.clone(), props).await;
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    let inbox = ch.confirms(|| {
        let (inbox, watches) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(collect_confirms(watches, ch.channel().clone(), conn.clone(), amqp.clone()));
        inbox
    });
    // Sent right after the publish's frames were queued, long before the broker's answer can
    // normally come back, and the collector takes its inbox before any confirm: so a return of
    // this publish finds it waiting. (A thread preempted for longer than a round trip just here
    // leaves it to the placement in `hand_over`: a duplicate at worst.)
    if inbox.send(Watch { own, sent, outcome: tx }).is_err() {
        // The collector is gone (it panicked): the publish's fate is unknown.
        drop(ticket);
        return Err(PublishError::Timeout(timeout));
    }
    let outcome = match await_unless_blocked(timeout, || is_blocked(conn), &mut rx).await {
        Some(Ok(outcome)) => outcome,
        // The collector ended without an outcome: it panicked.
        Some(Err(_)) => Err(PublishError::Timeout(timeout)),
        None => {
            // Closed first, so that an outcome sent just now is read here, not lost.
            rx.close();
            rx.try_recv().unwrap_or(Err(PublishError::Timeout(timeout)))
        }
    };
    // A return is no failure of the channel: the message reached no queue.
    let failed = matches!(outcome, Err(PublishError::Nacked | PublishError::Timeout(_) | PublishError::Amqp(_) | PublishError::AfterFailed));
    match ticket.settle(failed, timeout).await {
        Earlier::AllDelivered => outcome,
        Earlier::OneFailed | Earlier::Unsettled => outcome.and(Err(PublishError::AfterFailed)),
    }
}

/// One publish waiting for its confirm in its channel's collector ([`publish_confirmed`]).
pub struct Watch {
    own: OwnPublish,
    /// The rest of `basic_publish`, resolving to the confirm ([`ConfirmChannel::send`]).
    sent: futures_util::future::BoxFuture<'static, Result<lapin::PublisherConfirm, lapin::Error>>,
    outcome: tokio::sync::oneshot::Sender<Result<(), PublishError>>,
}

/// The publishes a confirm collector waits for, by its own number: what each sent, and where its
/// outcome goes.
type Waiting = std::collections::HashMap<u64, (OwnPublish, tokio::sync::oneshot::Sender<Result<(), PublishError>>)>;

/// A channel's confirm collector: takes each [`Watch`] from `watches`, awaits its confirm, and
/// sends each publish its outcome ([`publish_confirmed`] says how returns are matched). When a
/// confirm completes, it takes the new watches, waits until lapin has finished the ack frame on
/// `ch` ([`ack_frame_barrier`]), takes every other confirm completed by then ([`take_ready`]:
/// lapin wakes a confirm's future as it completes it), hands over the returns they all carry,
/// and only then sends their outcomes. Ends when every handle of the channel is gone and no
/// confirm is awaited (it holds a handle of `ch` until then, so the channel stays open while
/// confirms are awaited).
async fn collect_confirms(mut watches: tokio::sync::mpsc::UnboundedReceiver<Watch>, ch: lapin::Channel, conn: Arc<Connection>, amqp: AmqpSettings) {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    use std::collections::{HashMap, HashSet};
    let wait = (amqp.confirm_timeout * LATE_CONFIRM_WAIT_FACTOR).max(LATE_CONFIRM_MIN_WAIT);
    let mut confirms = FuturesUnordered::new();
    let mut waiting: Waiting = HashMap::new();
    // Waiting publishes whose return reached another publish's confirm.
    let mut returned: HashSet<u64> = HashSet::new();
    let (mut next, mut open) = (0u64, true);
    macro_rules! register {
        ($w:expr) => {{
            let Watch { own, sent, outcome } = $w;
            waiting.insert(next, (own, outcome));
            // Unconstrained: a confirm that completed must poll ready when the collector
            // takes every completed one, whatever tokio's cooperative budget has left.
            confirms.push(tokio::task::unconstrained(confirm_of(next, sent, wait, conn.clone())));
            next += 1;
        }};
    }
    loop {
        tokio::select! {
            biased;
            w = watches.recv(), if open => match w {
                Some(w) => register!(w),
                None => open = false,
            },
            Some(first) = confirms.next(), if !confirms.is_empty() => {
                // A publish sent just before this confirm completed may not be in yet.
                while let Ok(w) = watches.try_recv() {
                    register!(w);
                }
                // Every confirm completed by now, after lapin finished the ack frame it is
                // processing (see `publish_confirmed`): none is decided before the returns
                // they all carry were handed over.
                let dropped = ack_frame_barrier(&ch);
                let mut done = vec![first];
                take_ready(&mut confirms, &mut done);
                for m in dropped {
                    hand_over(m, u64::MAX, &waiting, &mut returned, &conn, &amqp);
                }
                let mut outcomes = Vec::with_capacity(done.len());
                for (n, confirm) in done {
                    let outcome = match confirm {
                        None => Err(PublishError::Timeout(wait)),
                        Some(Err(e)) => Err(PublishError::Amqp(e)),
                        Some(Ok(confirm)) => {
                            let nacked = confirm.is_nack();
                            if let Some(m) = confirm.take_message() {
                                hand_over(m, n, &waiting, &mut returned, &conn, &amqp);
                            }
                            if nacked { Err(PublishError::Nacked) } else { Ok(()) }
                        }
                    };
                    outcomes.push((n, outcome));
                }
                for (n, outcome) in outcomes {
                    let Some((own, tx)) = waiting.remove(&n) else { continue };
                    let outcome = match (outcome, returned.remove(&n)) {
                        (Ok(()), true) => Err(PublishError::Unroutable { exchange: own.exchange, routing_key: own.routing_key }),
                        (other, _) => other,
                    };
                    let _ = tx.send(outcome);
                }
            }
            else => break,
        }
    }
}

/// Waits until lapin has finished processing the ack frame it may be processing on `ch`: lapin
/// completes all the confirms of one (`multiple`) ack under one lock of the channel's
/// acknowledgements (`Acknowledgements::complete_pending_before`), which
/// `Channel::wait_for_confirms` takes in its first poll (`get_last_pending`) — polled once here,
/// never awaited (the daemon does not use it otherwise). When no publish is pending it also
/// gives the returns that reached confirms lapin holds for dropped futures
/// (`ReturnedMessages::drain`), which nothing else would read: returned.
fn ack_frame_barrier(ch: &lapin::Channel) -> Vec<BasicReturnMessage> {
    use futures_util::FutureExt;
    match ch.wait_for_confirms().now_or_never() {
        Some(Ok(dropped)) => dropped,
        _ => Vec::new(),
    }
}

/// Takes every future of `confirms` that is ready now into `done`. `FuturesUnordered` may answer
/// `Pending` with futures still ready (it yields after polling all of them once, or when two
/// woke during their own poll, or while a waker is enqueuing one), and then wakes its task: so
/// this polls with a waker that records that, and polls again while it was called.
fn take_ready<F: std::future::Future>(confirms: &mut futures_util::stream::FuturesUnordered<F>, done: &mut Vec<F::Output>) {
    use futures_util::Stream;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{Context, Poll};
    struct Woken(AtomicBool);
    impl futures_util::task::ArcWake for Woken {
        fn wake_by_ref(this: &Arc<Self>) {
            this.0.store(true, Ordering::SeqCst);
        }
    }
    let woken = Arc::new(Woken(AtomicBool::new(false)));
    let waker = futures_util::task::waker(woken.clone());
    let mut cx = Context::from_waker(&waker);
    loop {
        woken.0.store(false, Ordering::SeqCst);
        match std::pin::Pin::new(&mut *confirms).poll_next(&mut cx) {
            Poll::Ready(Some(c)) => done.push(c),
            Poll::Ready(None) => return,
            Poll::Pending if woken.0.load(Ordering::SeqCst) => {}
            Poll::Pending => return,
        }
    }
}

/// Hands returned message `m`, which reached the confirm of publish `n`, to the waiting publish
/// that sent it (`n` itself first; marked in `returned`), or places it again
/// ([`place_returned`], in a task of its own on `conn`) when no waiting publish sent it: the
/// collector stopped waiting for its publish's confirm, or had not yet taken that publish in.
fn hand_over(
    m: BasicReturnMessage,
    n: u64,
    waiting: &Waiting,
    returned: &mut std::collections::HashSet<u64>,
    conn: &Arc<Connection>,
    amqp: &AmqpSettings,
) {
    let sent = |k: &u64| waiting.get(k).is_some_and(|(o, _)| is_own_return(&m, &o.exchange, &o.routing_key, o.message_id.as_ref(), &o.body));
    let owner = if !returned.contains(&n) && sent(&n) {
        Some(n)
    } else {
        waiting.keys().find(|k| !returned.contains(*k) && sent(k)).copied()
    };
    match owner {
        Some(k) => {
            returned.insert(k);
        }
        None => {
            tokio::spawn(place_returned_in_task(conn.clone(), amqp.clone(), m));
        }
    }
}

/// The confirm of publish `n` (the rest of its `basic_publish`, `sent`), waited for at most
/// `wait` while `conn` is not blocked ([`await_unless_blocked`]; `None` when that ran out).
async fn confirm_of(
    n: u64,
    sent: futures_util::future::BoxFuture<'static, Result<lapin::PublisherConfirm, lapin::Error>>,
    wait: Duration,
    conn: Arc<Connection>,
) -> (u64, Option<Result<lapin::Confirmation, lapin::Error>>) {
    let publish = async { sent.await?.await };
    (n, await_unless_blocked(wait, || is_blocked(&conn), publish).await)
}

/// Whether the broker blocks `conn` (`connection.blocked`) while it is open.
fn is_blocked(conn: &Connection) -> bool {
    let status = conn.status();
    status.blocked() && status.connected()
}

/// Awaits `fut` for at most `limit` of time during which `blocked()` is false. While the broker
/// blocks the publishing connection (`connection.blocked`: a memory or disk alarm,
/// <https://www.rabbitmq.com/docs/connection-blocked>) it reads nothing from it, so a publish
/// written to it is still on its way, and giving up on it would make the next attempt a second
/// copy once the alarm clears (an operator's run: 321 duplicate results of 1,200 requests for a
/// 50 s alarm with a 30 s `confirm_timeout`). So when `limit` runs out while blocked, this waits
/// until the connection is unblocked ([`wait_while`]), then `limit` again.
/// `None` when `limit` ran out while not blocked.
async fn await_unless_blocked<F: std::future::Future>(limit: Duration, blocked: impl Fn() -> bool, fut: F) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Ok(v) = tokio::time::timeout(limit, &mut fut).await {
            return Some(v);
        }
        if !blocked() {
            return None;
        }
        tokio::select! {
            v = &mut fut => return Some(v),
            () = wait_while(&blocked) => {}
        }
    }
}

/// [`place_returned`] with owned arguments, for a publish's own task. Boxed as a `Send` future: a
/// placement publishes through [`publish_confirmed`], whose task may place again, and the compiler
/// cannot prove that cycle `Send` otherwise.
fn place_returned_in_task(conn: Arc<Connection>, amqp: AmqpSettings, m: BasicReturnMessage) -> futures_util::future::BoxFuture<'static, ()> {
    Box::pin(async move { place_returned(&conn, &amqp, m).await })
}

/// Whether `returned` is the message published to `exchange` with `routing_key`, `message_id`
/// and `body` (a message returned to the confirm of another publish is not, see
/// [`publish_confirmed`]). Two publishes of the very same message are the same for this
/// purpose: either may take the return.
pub fn is_own_return(
    returned: &BasicReturnMessage,
    exchange: &str,
    routing_key: &str,
    message_id: Option<&ShortString>,
    body: &[u8],
) -> bool {
    let d = &returned.delivery;
    d.exchange.as_str() == exchange
        && d.routing_key.as_str() == routing_key
        && d.properties.message_id().as_ref() == message_id
        && d.data == body
}

/// Per-request warnings of this module, each kind within its own [`LogLimit`] (at most
/// [`crate::log_limit::BURST`] lines per minute at `WARN`, the rest at `DEBUG`).
static RETURN_PLACED_LOG: LogLimit = LogLimit::new();
static RETURN_PLACE_FAILED_LOG: LogLimit = LogLimit::new();
/// Dead letters of malformed input (a client's fault, possibly a flood of it).
static DEAD_LETTER_LOG: LogLimit = LogLimit::new();
/// Dead letters of valid requests given up after `amqp.delivery_limit` deliveries: within their
/// own limit, so a flood of malformed input never hides them.
static GIVEN_UP_LOG: LogLimit = LogLimit::new();
static DEAD_LETTER_FAILED_LOG: LogLimit = LogLimit::new();
static RESULT_FAILED_LOG: LogLimit = LogLimit::new();
static REPLY_REFUSED_LOG: LogLimit = LogLimit::new();
/// Failed acks and nacks (the channel closed: every delivery it held fails the same way).
static ACK_FAILED_LOG: LogLimit = LogLimit::new();
/// A missing destination that cannot be declared again: a held forward tries it on every attempt.
static DECLARE_FAILED_LOG: LogLimit = LogLimit::new();
/// Held results given up at a stop ([`released`]).
static RELEASED_LOG: LogLimit = LogLimit::new();

/// How many times [`place_returned`] publishes one returned message before it gives up on it.
const PLACE_RETURNED_ATTEMPTS: u32 = 3;
/// The shortest confirm wait of a [`place_returned`] publish: `amqp.confirm_timeout`, but at
/// least this. The message exists only in this process by then, so a very short configured
/// timeout must not give it up.
const PLACE_RETURNED_MIN_TIMEOUT: Duration = Duration::from_secs(1);

/// Places a message that came back on another publish's confirm ([`publish_confirmed`]) where
/// its own publisher would have put it after the return:
/// - a forward (to `amqp.shard_exchange`): back to `amqp.input_queue`, where the router routes it
///   again and declares a deleted partition route again;
/// - a dead letter (to `amqp.dead_letter_exchange`): to the dead-letter exchange again, after
///   declaring its queue again when that is missing;
/// - a result (default exchange): to `amqp.results_queue` with `x-reply-to-refused: unroutable`
///   and `x-reply-to` (as [`publish_result`] does), or, when it was already for the results
///   queue, there again. A result for a direct reply-to requester that is still there was
///   delivered (RabbitMQ returns those anyway) and is left alone.
///
/// Published with a confirm (waiting `amqp.confirm_timeout`, at least
/// `PLACE_RETURNED_MIN_TIMEOUT`) on a new channel of `conn`, closed afterwards, up to
/// `PLACE_RETURNED_ATTEMPTS` times with the reconnect backoff between them. Not on the channel
/// the return came on: the publish that received it settles only after this placement, and a
/// placement on the same channel would wait for that publish to settle ([`ConfirmChannel`]).
/// A message that still cannot be placed is logged as an error with its `message_id`: it is
/// lost, since its own publisher has taken it as delivered.
pub async fn place_returned(conn: &Arc<Connection>, amqp: &AmqpSettings, m: BasicReturnMessage) {
    let mut settings = amqp.clone();
    settings.confirm_timeout = settings.confirm_timeout.max(PLACE_RETURNED_MIN_TIMEOUT);
    let amqp = &settings;
    let d = &m.delivery;
    let message_id = d.properties.message_id().as_ref().map(|s| log_id(s.as_str())).unwrap_or_default();
    crate::warn_limited!(RETURN_PLACED_LOG, message_id, exchange = %d.exchange, routing_key = %d.routing_key, "a message returned to another publish's confirm; placing it again");
    let Some((exchange, routing_key, props, redeclare)) = returned_destination(conn, amqp, d).await else {
        return;
    };
    let mut wait = amqp.reconnect_backoff_initial;
    for attempt in 1..=PLACE_RETURNED_ATTEMPTS {
        let own = match ConfirmChannel::open(conn).await {
            Ok(fresh) => {
                let out = publish_confirmed(&fresh, conn, amqp, &exchange, &routing_key, &d.data, props.clone()).await;
                let _ = crate::amqp::close_channel(&fresh, "returned message placed").await;
                out
            }
            Err(e) => Err(PublishError::Amqp(e)),
        };
        match own {
            Ok(()) => return,
            Err(e) => {
                crate::warn_limited!(RETURN_PLACE_FAILED_LOG, message_id, attempt, error = %e, "placing a returned message failed");
                if let (true, Some(dest)) = (says_missing(&e), redeclare) {
                    declare_again(conn, amqp, dest).await;
                }
                if attempt < PLACE_RETURNED_ATTEMPTS {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(amqp.reconnect_backoff_max);
                }
            }
        }
    }
    tracing::error!(message_id, exchange = %d.exchange, routing_key = %d.routing_key, "a message returned to another publish's confirm could not be placed again: lost");
}

/// Where [`place_returned`] publishes returned delivery `d`: exchange, routing key, properties,
/// and what to declare again when that is missing; `None` for a direct reply-to result whose
/// requester is still there (delivered).
async fn returned_destination(
    conn: &Connection,
    amqp: &AmqpSettings,
    d: &Delivery,
) -> Option<(String, String, BasicProperties, Option<OwnDestination>)> {
    let (exchange, routing_key) = (d.exchange.as_str(), d.routing_key.as_str());
    if exchange == amqp.shard_exchange {
        return Some((String::new(), amqp.input_queue.clone(), d.properties.clone(), None));
    }
    if exchange == amqp.dead_letter_exchange {
        return Some((exchange.to_owned(), routing_key.to_owned(), d.properties.clone(), Some(OwnDestination::DeadLetter)));
    }
    let results = || (String::new(), amqp.results_queue.clone());
    if routing_key == amqp.results_queue {
        let (e, rk) = results();
        return Some((e, rk, d.properties.clone(), Some(OwnDestination::Results)));
    }
    // A direct reply-to result is returned whether or not it was delivered: present requester,
    // delivered; gone, `gone` as in `publish_result`; no answer from the check, `unroutable`.
    let mut refused = REFUSED_UNROUTABLE;
    if is_direct_reply_to(routing_key) {
        match direct_reply_to_present(conn, routing_key, amqp.confirm_timeout).await {
            Ok(true) => return None,
            Ok(false) => refused = REFUSED_GONE,
            Err(_) => {}
        }
    }
    // A result whose reply queue refused it, as in `publish_result`: counted the same way.
    metrics::reply_to_refused(refused);
    let headers = headers_with(
        d.properties.headers().as_ref(),
        &[(HEADER_REPLY_TO_REFUSED, refused.to_owned()), (HEADER_REPLY_TO, routing_key.to_owned())],
    );
    let (e, rk) = results();
    Some((e, rk, d.properties.clone().with_headers(headers), Some(OwnDestination::Results)))
}

/// Copies `headers` and adds `extra` (string values).
pub fn headers_with(base: Option<&FieldTable>, extra: &[(&str, String)]) -> FieldTable {
    let mut t = base.cloned().unwrap_or_default();
    for (k, v) in extra {
        t.insert(ShortString::from(*k), AMQPValue::LongString(v.as_str().into()));
    }
    t
}

pub use crate::amqp::{header_str, header_u64};

/// The properties a message the daemon republishes (a forwarded request, a dead letter) carries
/// over from the original: an allowlist, never a blind copy. Copied: `content_type`,
/// `content_encoding`, `correlation_id`, `reply_to`, `message_id`, `timestamp`, `type`, `app_id`,
/// `priority`, `delivery_mode` and the headers (without `x-delivery-count`: the next queue counts
/// its own deliveries; without `x-earlier-deliveries`, `x-input-redelivered`, `x-forward-id`,
/// `x-request-id`, `x-forwarded-before` and `x-put-back-at-ms`, which the daemon sets:
/// [`OWN_HEADERS`]), with `extra` added.
///
/// Never copied: `user_id`, which RabbitMQ checks against the publishing connection's user (a
/// mismatch closes the channel with 406 `PRECONDITION_FAILED`,
/// <https://www.rabbitmq.com/docs/validated-user-id>), and `expiration`, a per-message TTL that
/// would expire the copy, dead letters included. Their values are kept in the headers
/// [`HEADER_ORIGINAL_USER_ID`] and [`HEADER_ORIGINAL_EXPIRATION`]. `cluster_id` is dropped.
pub fn carried_props(props: &BasicProperties, extra: &[(&str, String)]) -> BasicProperties {
    let mut p = BasicProperties::default();
    macro_rules! copy {
        ($($get:ident => $with:ident),* $(,)?) => {
            $( if let Some(v) = props.$get() { p = p.$with(v.clone()); } )*
        };
    }
    copy!(content_type => with_content_type, content_encoding => with_content_encoding, correlation_id => with_correlation_id,
          reply_to => with_reply_to, message_id => with_message_id, timestamp => with_timestamp, kind => with_type,
          app_id => with_app_id, priority => with_priority, delivery_mode => with_delivery_mode);
    let mut headers = FieldTable::default();
    let carried = |k: &str| !OWN_HEADERS.contains(&k) && !SENDER_ROUTING_HEADERS.contains(&k);
    for (k, v) in props.headers().iter().flat_map(|h| h.inner()).filter(|(k, _)| carried(k.as_str())) {
        headers.insert(k.clone(), v.clone());
    }
    let originals = [(HEADER_ORIGINAL_USER_ID, props.user_id()), (HEADER_ORIGINAL_EXPIRATION, props.expiration())];
    let mut added: Vec<(&str, String)> =
        originals.iter().filter_map(|(k, v)| v.as_ref().map(|v| (*k, v.as_str().to_owned()))).collect();
    added.extend(extra.iter().cloned());
    p.with_headers(headers_with(Some(&headers), &added))
}

/// Headers RabbitMQ routes by ("sender-selected distribution",
/// <https://www.rabbitmq.com/docs/sender-selected>): a message is routed with each routing key
/// they list as well as its own. [`carried_props`] never copies them: a request whose publisher
/// set `CC` to other partitions' routing keys was forwarded to each of them (answered once per
/// instance that owned one), and each copy put back uncharged went to all of them again.
pub const SENDER_ROUTING_HEADERS: [&str; 2] = ["CC", "BCC"];

/// Headers only the daemon (or the queue) sets: [`carried_props`] never copies them from the
/// original, so a publisher cannot set them.
pub const OWN_HEADERS: [&str; 7] = [
    HEADER_DELIVERY_COUNT,
    redelivery::HEADER_EARLIER_DELIVERIES,
    redelivery::HEADER_INPUT_REDELIVERED,
    redelivery::HEADER_FORWARD_ID,
    HEADER_REQUEST_ID,
    redelivery::HEADER_FORWARDED_BEFORE,
    redelivery::HEADER_PUT_BACK_AT_MS,
];

/// Headers the router sets on each forward (a publisher's own are replaced).
pub const ROUTING_HEADERS: [&str; 3] = [HEADER_SHARD, HEADER_ROUTED_KEY, HEADER_ROUTED_AT_MS];

/// Whether request header `name` is one the daemon sets ([`OWN_HEADERS`], [`ROUTING_HEADERS`]):
/// the copies of one request differ in them, so [`request_fingerprint`] leaves them out.
fn daemon_header(name: &str) -> bool {
    OWN_HEADERS.contains(&name) || ROUTING_HEADERS.contains(&name)
}

/// 128-bit xxh3 hash of what a request's publisher set: its id, body, `reply_to`,
/// `correlation_id`, `timestamp`, `content_type`, `content_encoding`, `type`, `app_id`,
/// `priority` and its headers, without those the daemon sets ([`OWN_HEADERS`],
/// [`ROUTING_HEADERS`]). Two forwards
/// of one input message have the same; two messages a publisher sent differ unless they are the
/// same in all of these. For [`redelivery::is_second_copy`].
pub fn request_fingerprint(id: &str, body: &[u8], props: &BasicProperties) -> u128 {
    use std::fmt::Write as _;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut text = String::new();
    let mut field = |name: &str, value: Option<&str>| {
        text.clear();
        let _ = writeln!(text, "{name}={}:{}", value.map_or(0, str::len), value.unwrap_or(""));
        h.update(text.as_bytes());
    };
    field("id", Some(id));
    field("reply_to", props.reply_to().as_ref().map(|v| v.as_str()));
    field("correlation_id", props.correlation_id().as_ref().map(|v| v.as_str()));
    field("timestamp", props.timestamp().map(|t| t.to_string()).as_deref());
    field("content_type", props.content_type().as_ref().map(|v| v.as_str()));
    field("content_encoding", props.content_encoding().as_ref().map(|v| v.as_str()));
    field("type", props.kind().as_ref().map(|v| v.as_str()));
    field("app_id", props.app_id().as_ref().map(|v| v.as_str()));
    field("priority", props.priority().map(|p| p.to_string()).as_deref());
    // A field table is ordered by name (`BTreeMap`), so equal tables hash alike.
    for (k, v) in props.headers().iter().flat_map(|t| t.inner()).filter(|(k, _)| !daemon_header(k.as_str())) {
        field(k.as_str(), Some(&format!("{v:?}")));
    }
    field("body", None);
    h.update(body);
    h.digest128()
}

/// Publishes a dead letter: the original body, the properties of [`carried_props`] plus
/// `x-death-reason` and `x-death-detail` headers and, when the request was parsed far enough to
/// have one, its id in `x-request-id` (as on results; a publisher's own `x-request-id` header is
/// not passed on), persistent, to the dead-letter exchange ([`publish_own`]: declared again on
/// `conn` when it or its queue was deleted), in its turn on `out`
/// ([`crate::amqp::RefusalTurns::turn`]); with a partition's `lease`, not once it is invalid
/// ([`PublishError::LeaseExpired`]).
#[allow(clippy::too_many_arguments)] // the parts of one dead letter, all borrowed
pub async fn dead_letter(
    out: &SharedConfirmChannel,
    amqp: &AmqpSettings,
    body: &[u8],
    props: &BasicProperties,
    request_id: Option<&str>,
    reason: &str,
    detail: &str,
    lease: Option<&LeaseClock>,
) -> Result<(), PublishError> {
    let mut added = vec![(HEADER_DEATH_REASON, reason.to_owned()), (HEADER_DEATH_DETAIL, detail.chars().take(1000).collect())];
    added.extend(request_id.map(|id| (HEADER_REQUEST_ID, id.to_owned())));
    let mut out_props = carried_props(props, &added).with_delivery_mode(PERSISTENT);
    // Properties too large for one frame would make RabbitMQ close the connection: the request's
    // own headers are left out (the detail says so), so that the dead letter itself goes through.
    let size = content_header_frame_size(&out_props);
    if crate::amqp::frame_max().is_some_and(|f| size > f as usize) {
        let bare = props.clone().with_headers(FieldTable::default());
        let detail = format!("{}; its headers are left out of this dead letter: with the daemon's they took {size} bytes, more than one frame", added[1].1);
        added[1].1 = detail.chars().take(1200).collect();
        out_props = carried_props(&bare, &added).with_delivery_mode(PERSISTENT);
    }
    let props = out_props;
    let _turn = out.turns().turn().await;
    publish_own(out, amqp, OwnDestination::DeadLetter, body, props, lease).await
}

/// Where the daemon itself sends messages, and declares at startup: a publish may find them
/// deleted at run time ([`publish_own`], [`declare_again`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnDestination {
    /// `amqp.dead_letter_exchange`, and `amqp.dead_letter_queue` bound to it.
    DeadLetter,
    /// `amqp.results_queue`, through the default exchange.
    Results,
    /// The shard exchange, and partition queue `p` bound to it (a forward's route).
    Partition(u32),
}

impl OwnDestination {
    /// Every label value of `prefix_batcher_queues_redeclared_total{queue}`.
    pub const LABELS: [&'static str; 3] = ["dead_letter", "results", "partition"];

    /// The `queue` label of `prefix_batcher_queues_redeclared_total`.
    pub fn label(self) -> &'static str {
        match self {
            OwnDestination::DeadLetter => Self::LABELS[0],
            OwnDestination::Results => Self::LABELS[1],
            OwnDestination::Partition(_) => Self::LABELS[2],
        }
    }
}

/// Whether a failed publish says its destination is missing: it came back unroutable (no queue
/// is bound for it), or the broker closed the channel with 404 `NOT_FOUND` (the exchange is gone).
pub fn says_missing(e: &PublishError) -> bool {
    match e {
        PublishError::Unroutable { .. } => true,
        PublishError::Amqp(e) => crate::amqp::reply_code(e) == Some(crate::amqp::NOT_FOUND),
        _ => false,
    }
}

/// Declares `dest` again on `conn` after a publish found it missing ([`says_missing`]): someone
/// deleted it while the daemon ran ([`crate::topology::declare_dead_letter`],
/// [`crate::topology::declare_results`], [`crate::topology::declare_route`]). Waits at most
/// `amqp.confirm_timeout`. Logs the outcome and counts a success in
/// `prefix_batcher_queues_redeclared_total{queue}`. Returns whether it was declared.
pub async fn declare_again(conn: &Connection, amqp: &AmqpSettings, dest: OwnDestination) -> bool {
    let declare = async {
        match dest {
            OwnDestination::DeadLetter => crate::topology::declare_dead_letter(conn, amqp).await,
            OwnDestination::Results => crate::topology::declare_results(conn, amqp).await,
            OwnDestination::Partition(p) => crate::topology::declare_route(conn, amqp, p).await,
        }
    };
    match tokio::time::timeout(amqp.confirm_timeout, declare).await {
        Ok(Ok(())) => {
            warn!(queue = dest.label(), ?dest, "a destination of the daemon was missing (deleted while it ran); declared it again");
            metrics::queue_redeclared(dest.label());
            true
        }
        // Someone declared it again with other settings (a classic queue, not bound): it does
        // not go away by itself, so ERROR.
        Ok(Err(e)) if e.is_config_error() => {
            crate::error_limited!(
                DECLARE_FAILED_LOG,
                queue = dest.label(),
                ?dest,
                error = %e,
                "a destination of the daemon exists with other settings than configured (deleted and declared again by someone else?); \
                 what goes there waits: delete it and the daemon declares it again"
            );
            false
        }
        Ok(Err(e)) => {
            crate::warn_limited!(DECLARE_FAILED_LOG, queue = dest.label(), ?dest, error = %e, "a destination of the daemon is missing and cannot be declared again");
            false
        }
        Err(_) => {
            crate::warn_limited!(DECLARE_FAILED_LOG, queue = dest.label(), ?dest, timeout = ?amqp.confirm_timeout, "a destination of the daemon is missing; declaring it again got no answer");
            false
        }
    }
}

/// Publishes to the dead-letter exchange or the results queue and waits for the confirm
/// ([`publish_confirmed`], `amqp.confirm_timeout`). When the broker says the destination is
/// missing ([`says_missing`]), someone deleted it while the daemon ran: it is declared again on
/// `conn` ([`declare_again`]) and, while `ch` is still open, the message is published once more.
/// Without this, the daemon would requeue the message it could not place until the broker's own
/// delivery limit dead-lettered it into an exchange with no queue, which drops it.
///
/// Errors: the last publish's error; the first one's when the declaration failed, or `ch` was
/// closed by the failed publish (the caller requeues; its next attempt, on a new channel, finds
/// the destination declared). Panics on [`OwnDestination::Partition`] (forwards have their own
/// loop, in the router).
pub async fn publish_own(
    out: &SharedConfirmChannel,
    amqp: &AmqpSettings,
    dest: OwnDestination,
    body: &[u8],
    props: BasicProperties,
    lease: Option<&LeaseClock>,
) -> Result<(), PublishError> {
    let (exchange, routing_key) = match dest {
        OwnDestination::DeadLetter => (amqp.dead_letter_exchange.as_str(), ""),
        OwnDestination::Results => ("", amqp.results_queue.as_str()),
        OwnDestination::Partition(_) => unreachable!("forwards are published by the router"),
    };
    let first = publish_on(out, amqp, exchange, routing_key, body, props.clone(), lease).await;
    match &first {
        Err(e) if says_missing(e) => {}
        _ => return first,
    }
    if !declare_again(out.connection(), amqp, dest).await {
        return first;
    }
    publish_on(out, amqp, exchange, routing_key, body, props, lease).await
}

/// [`publish_on`]'s line for each message it publishes again.
static AFTER_FAILED_LOG: LogLimit = LogLimit::new();

/// How many times [`publish_on`] publishes a message again that was
/// [`PublishError::AfterFailed`].
const AFTER_FAILED_ATTEMPTS: u32 = 3;

/// [`publish_confirmed`] on the current channel of `out` ([`SharedConfirmChannel::get`]); a
/// publish that was [`PublishError::AfterFailed`] goes again on the channel that replaced it, up
/// to `AFTER_FAILED_ATTEMPTS` times (the broker may then hold it twice: a duplicate, never a
/// loss). With `lease` (a partition's), nothing is published once it is invalid
/// ([`PublishError::LeaseExpired`]), checked before each attempt and again right before its
/// frames are queued, after any wait for the broker to unblock the connection (a memory or disk
/// alarm can outlast the lease). Errors: as
/// [`publish_confirmed`], or no channel could be opened.
pub async fn publish_on(
    out: &SharedConfirmChannel,
    amqp: &AmqpSettings,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
    lease: Option<&LeaseClock>,
) -> Result<(), PublishError> {
    let mut again = 0;
    loop {
        if lease.is_some_and(|l| !l.is_valid()) {
            return Err(PublishError::LeaseExpired);
        }
        let ch = out.get().await?;
        let own = OwnPublish::new(exchange, routing_key, body, &props);
        match send_confirmed(&ch, out.connection(), amqp, own, props.clone(), lease).await {
            Err(PublishError::AfterFailed) if again < AFTER_FAILED_ATTEMPTS => {
                again += 1;
                crate::warn_limited!(
                    AFTER_FAILED_LOG,
                    exchange,
                    routing_key,
                    attempt = again,
                    "publishing a message again: an earlier publish to the same destination on its channel failed, so the broker may have dropped this one although it confirmed it (rabbitmq-server #14589); if it did not, the destination gets it twice"
                );
            }
            outcome => return outcome,
        }
    }
}

/// Now as Unix milliseconds (0 if the system clock is before 1970).
pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// What [`parse_or_dead_letter`] did with a delivery.
#[derive(Debug)]
pub enum Intake {
    /// A valid request, with its delivery still to be acked.
    Valid(Request, Delivery),
    /// Invalid: dead-lettered (confirmed) and acked; nothing more to do.
    DeadLettered,
    /// Invalid, but the dead letter was not confirmed (or the lease was no longer valid, so
    /// nothing was published): the delivery is returned unacked for the caller to requeue or drop.
    Unacked(Delivery),
}

/// Parses a delivery against the message contract ([`crate::request::parse`], with the
/// `message_id`, `correlation_id` and `reply_to` properties and the `x-prefix-key` header). A
/// request that breaks the contract, or the requests policy ([`RequestPolicy::check`]), is
/// dead-lettered with its reason ([`dead_letter_and_ack`]).
/// So is a valid one delivered `amqp.delivery_limit` times or more before (the quorum queue's
/// `x-delivery-count`, see [`crate::redelivery`]), with reason `delivery_limit` and the last error
/// this instance saw for it. With `lease`, a dead letter is published only while the lease is
/// valid.
pub async fn parse_or_dead_letter(
    out: &SharedConfirmChannel,
    amqp: &AmqpSettings,
    policy: &RequestPolicy,
    delivery: Delivery,
    source: redelivery::Source,
    lease: Option<&LeaseClock>,
) -> Intake {
    match check_delivery(amqp, policy, &delivery, source) {
        Ok(req) => Intake::Valid(req, delivery),
        Err(r) => dead_letter_and_ack(out, amqp, delivery, r.request_id.as_deref(), r.reason, &r.detail, lease).await,
    }
}

/// The key of input message `delivery`, of request `id`, for the in-flight and uncharged-return
/// tables ([`redelivery::input_key`] of its [`request_fingerprint`]).
pub fn input_message_key(id: &str, delivery: &Delivery) -> u128 {
    redelivery::input_key(request_fingerprint(id, &delivery.data, &delivery.properties))
}

/// The returns of `delivery` (of request `id`, from `source`) that were not its request's fault
/// ([`redelivery::note_uncharged_return`]): keyed by the request's fingerprint for an input
/// message, by its forward id for a partition queue's.
fn uncharged_returns(source: redelivery::Source, id: &str, delivery: &Delivery) -> u64 {
    let key = match source {
        redelivery::Source::Input => Some(input_message_key(id, delivery)),
        redelivery::Source::Partition => redelivery::forward_key(delivery.properties.headers().as_ref()),
    };
    key.map_or(0, redelivery::uncharged_returns)
}

/// Returns allowed beyond `amqp.delivery_limit` during a broker resource alarm and for
/// `amqp.consumer_timeout` after it ([`alarm_within`]): as many as the broker's own
/// `x-delivery-limit` allows beyond it ([`crate::topology::BROKER_DELIVERY_LIMIT_MARGIN`], 2), so
/// at such a time the broker's limit decides; else none. Nothing can be published during an alarm, so every delivery
/// held past `consumer_timeout` goes back charged (the partitions' guard, or the broker), and
/// the instance that made the return may not be the one that sees the redelivery: a partition
/// that changed owner, an instance stopped, killed or started during the alarm. Measured before,
/// with `amqp.delivery_limit = 1`, two instances and an 80 s alarm: 44–73 of 300 requests
/// dead-lettered when a partition changed owner during it; a partition returned twice meanwhile
/// needs two. A poison request gets two deliveries more at such a time; the broker's own
/// `x-delivery-limit` still bounds it.
fn alarm_allowance(amqp: &AmqpSettings) -> u64 {
    if alarm_within(amqp.consumer_timeout) {
        u64::from(crate::topology::BROKER_DELIVERY_LIMIT_MARGIN)
    } else {
        0
    }
}

/// Why [`check_delivery`] refused a delivery: the dead-letter reason (one of
/// [`crate::request::DEAD_LETTER_REASONS`]), its detail, and the request id when the request was
/// parsed far enough to have one.
#[derive(Debug)]
pub struct Refusal {
    pub reason: &'static str,
    pub detail: String,
    pub request_id: Option<String>,
}

/// Bytes the daemon may add to a request's properties on its way: the forward's headers and ids
/// (`x-shard`, `x-routed-key`, `x-routed-at-ms`, `message_id`, `correlation_id`, the original
/// `user_id` and `expiration`: at most about 1.5 kB) and a dead letter's (`x-death-reason`,
/// `x-death-detail` of up to 1,000 characters, `x-request-id`: at most about 4.3 kB), with room
/// to spare.
pub const ADDED_PROPERTIES_RESERVE: usize = 8192;

/// Bytes of the content header frame that carries `props` (AMQP 0-9-1 §4.2.6.1: frame header 7,
/// class id 2, weight 2, body size 8, the property flags and list, frame end 1), measured with
/// the AMQP client's own encoder.
pub fn content_header_frame_size(props: &BasicProperties) -> usize {
    let list = cookie_factory::gen_simple(lapin::protocol::basic::gen_properties(props), Vec::new()).map_or(usize::MAX, |v| v.len());
    list.saturating_add(20)
}

/// Refuses (reason `too_large`) a request whose properties, with what the daemon adds
/// ([`ADDED_PROPERTIES_RESERVE`]), would not fit one frame of the connections' `frame_max`
/// ([`crate::amqp::frame_max`]): its forward or dead letter would make RabbitMQ close the
/// daemon's connection (`FRAME_ERROR`), at every delivery of the request. Observed with a
/// 130,920-byte header against a frame_max of 131,072: 6 session restarts, and the requests
/// published behind it answered 2–3 times each. `None` when they fit, or before any connection
/// negotiated a frame_max.
fn oversized_properties(props: &BasicProperties) -> Option<Refusal> {
    let frame_max = crate::amqp::frame_max()? as usize;
    let size = content_header_frame_size(props);
    let room = frame_max.saturating_sub(ADDED_PROPERTIES_RESERVE);
    (size > room).then(|| Refusal {
        reason: "too_large",
        detail: format!(
            "its AMQP properties (headers and the rest) take {size} bytes; with the up to {ADDED_PROPERTIES_RESERVE} bytes the daemon adds they would not fit one frame \
             of the connection's frame_max ({frame_max} bytes), and RabbitMQ takes a message's properties only in one frame: keep them under {room} bytes"
        ),
        request_id: props.message_id().as_ref().map(|m| m.as_str()).filter(|m| !m.is_empty() && m.len() <= crate::request::MAX_ID_BYTES).map(str::to_owned),
    })
}

/// The checks of [`parse_or_dead_letter`] without the dead letter: the request, or why it must
/// be dead-lettered. Publishes nothing, so a caller can take a channel only when it needs one.
pub fn check_delivery(amqp: &AmqpSettings, policy: &RequestPolicy, delivery: &Delivery, source: redelivery::Source) -> Result<Request, Refusal> {
    let props = &delivery.properties;
    // At intake only: a forward carries the router's headers too, which the reserve allows for.
    if let Some(refusal) = (source == redelivery::Source::Input).then(|| oversized_properties(props)).flatten() {
        return Err(refusal);
    }
    let prefix_header = prefix_key_header(props.headers().as_ref());
    let env = Envelope {
        message_id: props.message_id().as_ref().map(|m| m.as_str()),
        prefix_key_header: prefix_header.as_ref().ok().and_then(|h| h.as_deref()),
        prefix_key_header_refused: prefix_header.as_ref().err().copied(),
        correlation_id: props.correlation_id().as_ref().map(|c| c.as_str()),
        reply_to: props.reply_to().as_ref().map(|r| r.as_str()),
    };
    let parsed = parse(&delivery.data, &env, amqp.max_message_bytes);
    let count = redelivery::delivery_count(source, delivery.redelivered, props.headers().as_ref());
    let (reason, detail, request_id) = match parsed.map(|req| (policy.check(&req, env.reply_to), req)) {
        Ok((Err((reason, detail)), req)) => (reason, detail, Some(req.id)),
        Ok((Ok(()), req)) if count < u64::from(amqp.delivery_limit.get()) => return Ok(req),
        // Returns noted as not the request's fault come off the count (rare: computed only here).
        Ok((Ok(()), req)) if count.saturating_sub(uncharged_returns(source, &req.id, delivery)).saturating_sub(alarm_allowance(amqp)) < u64::from(amqp.delivery_limit.get()) => {
            return Ok(req)
        }
        Ok((Ok(()), req)) => {
            let last = redelivery::last_failure(&req.id).unwrap_or_else(|| {
                "unknown on this instance (its earlier deliveries ended on another instance, before a restart of this one, or with the close of a channel)".to_owned()
            });
            (REASON_DELIVERY_LIMIT, format!("delivered {count} times; last error: {last}"), Some(req.id))
        }
        Err(err) => {
            let mut detail = err.to_string();
            let encoding = props.content_encoding().as_ref().map(|e| e.as_str()).filter(|e| !e.is_empty() && !e.eq_ignore_ascii_case("identity") && !e.to_ascii_lowercase().starts_with("utf"));
            if let (Some(enc), ParseError::InvalidUtf8(_) | ParseError::InvalidJson(_)) = (encoding, &err) {
                detail.push_str(&format!(" (the message says content-encoding {:?}: bodies are read as plain UTF-8 JSON, so publish it uncompressed)", log_id(enc)));
            }
            (err.reason(), detail, crate::request::refused_request_id(&delivery.data, &err, env.message_id))
        }
    };
    Err(Refusal { reason, detail, request_id })
}

/// The `x-prefix-key` header as a string: a long or short string, or a byte array holding UTF-8
/// (some clients send strings that way); `Ok(None)` when absent, `Err(what it is)` for a header
/// of another AMQP type, which the request contract refuses
/// ([`crate::request::Envelope::prefix_key_header_refused`]).
fn prefix_key_header(headers: Option<&FieldTable>) -> Result<Option<Cow<'_, str>>, &'static str> {
    let Some(v) = headers.and_then(|h| h.inner().get(HEADER_PREFIX_KEY)) else { return Ok(None) };
    match v {
        AMQPValue::ShortString(_) => Ok(header_str(headers, HEADER_PREFIX_KEY)),
        // A long string is bytes in AMQP 0-9-1: read as UTF-8 strictly, or distinct keys would
        // become one key through U+FFFD.
        AMQPValue::LongString(b) => std::str::from_utf8(b.as_bytes()).map(|s| Some(Cow::Borrowed(s))).map_err(|_| "a long string that is not UTF-8"),
        AMQPValue::ByteArray(b) => std::str::from_utf8(b.as_slice()).map(|s| Some(Cow::Borrowed(s))).map_err(|_| "a byte array that is not UTF-8"),
        AMQPValue::Boolean(_) => Err("a boolean"),
        AMQPValue::Float(_) | AMQPValue::Double(_) | AMQPValue::DecimalValue(_) => Err("a number"),
        AMQPValue::FieldArray(_) => Err("an array"),
        AMQPValue::FieldTable(_) => Err("a table"),
        AMQPValue::Timestamp(_) => Err("a timestamp"),
        AMQPValue::Void => Err("void"),
        _ => Err("an integer"),
    }
}

/// The longest id (request id, `correlation_id`, `message_id`) a log line carries, in bytes;
/// longer ones are cut ([`log_id`]).
pub const MAX_LOGGED_ID_BYTES: usize = 128;

/// `id` for a log field: at most [`MAX_LOGGED_ID_BYTES`] bytes of it, cut on a character boundary
/// and then marked with `…`, with control characters escaped (an id comes from the requester and
/// must not break a log line).
pub fn log_id(id: &str) -> String {
    let mut keep = id.len().min(MAX_LOGGED_ID_BYTES);
    while !id.is_char_boundary(keep) {
        keep -= 1;
    }
    let mut out = String::with_capacity(keep + 3);
    for c in id[..keep].chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if keep < id.len() {
        out.push('…');
    }
    out
}

/// Publishes `delivery` to `amqp.dead_letter_exchange` with `reason` and `detail`
/// ([`dead_letter`]) and acks it once that publish is confirmed; with `lease`, only while the
/// lease is valid. [`Intake::Unacked`] when nothing was confirmed (the caller requeues).
/// `request_id` (when the request was parsed far enough to have one) and the delivery's
/// `correlation_id`, `message_id` and `app_id` are logged with it, each cut by [`log_id`], and
/// the body's size in bytes.
///
/// Boxed: a dead letter is rare, and its future inline would make the future of every delivery
/// that may take this path (a router's task, a partition's intake) larger, copied at each spawn.
#[allow(clippy::too_many_arguments)]
pub fn dead_letter_and_ack<'a>(
    out: &'a SharedConfirmChannel,
    amqp: &'a AmqpSettings,
    delivery: Delivery,
    request_id: Option<&'a str>,
    reason: &'static str,
    detail: &'a str,
    lease: Option<&'a LeaseClock>,
) -> futures_util::future::BoxFuture<'a, Intake> {
    Box::pin(dead_letter_and_ack_inline(out, amqp, delivery, request_id, reason, detail, lease))
}

/// [`dead_letter_and_ack`], not boxed.
#[allow(clippy::too_many_arguments)]
async fn dead_letter_and_ack_inline(
    out: &SharedConfirmChannel,
    amqp: &AmqpSettings,
    delivery: Delivery,
    request_id: Option<&str>,
    reason: &'static str,
    detail: &str,
    lease: Option<&LeaseClock>,
) -> Intake {
    let props = &delivery.properties;
    let full_request_id = request_id;
    let request_id = request_id.map(log_id);
    let correlation_id = props.correlation_id().as_ref().map(|c| log_id(c.as_str()));
    let message_id = props.message_id().as_ref().map(|m| log_id(m.as_str()));
    // For a message with no id at all: who published it (when it says) and its size.
    let app_id = props.app_id().as_ref().map(|a| log_id(a.as_str()));
    let bytes = delivery.data.len();
    if reason == crate::request::REASON_DELIVERY_LIMIT {
        crate::warn_limited!(GIVEN_UP_LOG, request_id, correlation_id, message_id, app_id, bytes, reason, detail, "dead-lettering request");
    } else {
        crate::warn_limited!(DEAD_LETTER_LOG, request_id, correlation_id, message_id, app_id, bytes, reason, detail, "dead-lettering request");
    }
    if lease.is_some_and(|l| !l.is_valid()) {
        return Intake::Unacked(delivery);
    }
    let (body, props) = (&delivery.data, &delivery.properties);
    // A partition's outcome: a redelivery meanwhile waits for it (`crate::partition`).
    let _in_flight = lease.and(redelivery::forward_key(props.headers().as_ref())).map(redelivery::OutcomeInFlight::begin);
    if let Err(e) = dead_letter(out, amqp, body, props, full_request_id, reason, detail, lease).await {
        if access_refused(&e) {
            crate::error_limited!(DEAD_LETTER_FAILED_LOG, error = %e, "dead letter refused: the broker denies the daemon's user write access to the dead-letter exchange (403 ACCESS_REFUSED; check its write permission on the vhost, rabbitmqctl list_user_permissions); the message is not acked");
        } else {
            crate::warn_limited!(DEAD_LETTER_FAILED_LOG, error = %e, "dead-letter publish not confirmed; the message is not acked");
        }
        return Intake::Unacked(delivery);
    }
    if lease.is_some() {
        redelivery::note_answered(props.headers().as_ref());
    }
    match crate::amqp::ack(&delivery.acker).await {
        Ok(_) => metrics::dead_lettered(reason, if lease.is_some() { stage::BATCHER } else { stage::ROUTER }),
        Err(e) => crate::warn_limited!(ACK_FAILED_LOG, error = %e, "ack of a dead-lettered message failed; the broker will redeliver it"),
    }
    Intake::DeadLettered
}

/// What the results of one batch share.
#[derive(Debug, Clone, Copy)]
pub struct BatchInfo<'a> {
    pub partition: u32,
    /// `{partition}-{epoch}-{sequence}`.
    pub batch_id: &'a str,
    /// Requests in the batch.
    pub batch_size: usize,
}

/// Builds the result of request `id` (prefix key as 16 hex digits, `shard`) from its LLM
/// answer. `None` when the call was cancelled (lease lost): such a request gets no result, it
/// returns to its queue.
pub fn shape_result(
    batch: BatchInfo<'_>,
    id: String,
    prefix_key: String,
    shard: u32,
    timings_ms: TimingsMs,
    answer: Result<Completion, LlmError>,
) -> Option<RequestResult> {
    let base = RequestResult {
        id,
        ok: false,
        output: Value::Null,
        finish_reason: None,
        usage: None,
        model: None,
        logprobs: None,
        choices: None,
        prefix_key,
        shard,
        partition: batch.partition,
        batch_id: batch.batch_id.to_owned(),
        batch_size: batch.batch_size,
        timings_ms,
        error: None,
    };
    Some(match answer {
        Ok(c) => RequestResult {
            ok: true,
            output: c.output,
            finish_reason: c.finish_reason,
            usage: c.usage,
            model: c.model,
            logprobs: c.logprobs,
            choices: c.choices,
            ..base
        },
        Err(e) if e.kind == ErrorKind::Cancelled => return None,
        Err(e) => RequestResult { error: Some(ResultError { kind: e.kind.as_str().to_owned(), message: e.message }), ..base },
    })
}

/// The partition tenure a result is published under.
#[derive(Debug, Clone, Copy)]
pub struct Tenure<'a> {
    pub partition: u32,
    /// Lease epoch (fencing token), sent as `x-partition-epoch`.
    pub epoch: u64,
    /// `instance.name`, sent as `x-instance`.
    pub instance: &'a str,
    /// The local lease deadline; no result is published once it is invalid.
    pub lease: &'a LeaseClock,
}

/// Header on a result that went to `amqp.results_queue` because its `reply_to` refused it: why
/// (`nacked`, `unroutable` or `timeout`, see [`refusal_reason`]; [`REFUSED_GONE`] for a direct
/// reply-to requester that has gone away).
pub const HEADER_REPLY_TO_REFUSED: &str = "x-reply-to-refused";
/// Header on such a result: the request's original `reply_to`.
pub const HEADER_REPLY_TO: &str = "x-reply-to";

/// The `x-reply-to-refused` value of a result whose direct reply-to requester had gone away
/// (its channel closed or its reply consumer cancelled) when the result was published.
pub const REFUSED_GONE: &str = "gone";

/// `x-reply-to-refused` of a result the broker nacked ([`refusal_reason`]).
pub const REFUSED_NACKED: &str = "nacked";

/// `x-reply-to-refused` of a result the broker returned: no queue took it ([`refusal_reason`]).
pub const REFUSED_UNROUTABLE: &str = "unroutable";

/// `x-reply-to-refused` of a result the broker did not confirm within `amqp.confirm_timeout`
/// ([`refusal_reason`]).
pub const REFUSED_TIMEOUT: &str = "timeout";

/// Every `x-reply-to-refused` value: [`refusal_reason`]'s and [`REFUSED_GONE`].
pub const REPLY_REFUSALS: &[&str] = &[REFUSED_NACKED, REFUSED_UNROUTABLE, REFUSED_TIMEOUT, REFUSED_GONE];

pub use crate::request::DIRECT_REPLY_TO_PREFIX;

/// Whether `reply_to` names a direct reply-to requester rather than a queue.
pub fn is_direct_reply_to(reply_to: &str) -> bool {
    reply_to.starts_with(DIRECT_REPLY_TO_PREFIX)
}

/// How many direct reply-to checks ([`direct_reply_to_present`]) run at once in this process:
/// each holds a channel of the publishing connection, whose channels are limited (`channel_max`).
static DIRECT_REPLY_TO_CHECKS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(32);

/// Whether the direct reply-to requester `name` (`amq.rabbitmq.reply-to.<token>`) is still
/// there: a passive `queue.declare` of the name, which RabbitMQ answers for such names by checking
/// that the requester's channel and reply consumer still exist
/// (<https://www.rabbitmq.com/docs/direct-reply-to>). A failed declare closes its channel, so it
/// runs on a disposable channel of `conn`, closed afterwards. `Ok(false)` when the broker answers
/// 404 `NOT_FOUND`; an error (`Amqp`, or `Timeout` after `timeout`) when there is no answer.
pub async fn direct_reply_to_present(conn: &Connection, name: &str, timeout: Duration) -> Result<bool, PublishError> {
    let _permit = DIRECT_REPLY_TO_CHECKS.acquire().await.expect("the semaphore is never closed");
    let check = async {
        let ch = conn.create_channel().await?;
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        match ch.queue_declare(name.into(), passive, FieldTable::default()).await {
            Ok(_) => {
                let _ = ch.close(crate::amqp::REPLY_SUCCESS, "direct reply-to check".into()).await;
                Ok(true)
            }
            // The broker closed the channel with the 404.
            Err(e) if crate::amqp::reply_code(&e) == Some(crate::amqp::NOT_FOUND) => Ok(false),
            Err(e) => Err(PublishError::Amqp(e)),
        }
    };
    // On a timeout the dropped channel is closed by lapin (its last handle).
    tokio::time::timeout(timeout, check).await.map_err(|_| PublishError::Timeout(timeout))?
}

/// How [`publish_result`] settled a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Result confirmed, request acked.
    Acked,
    /// Request nacked with requeue (the result could not be confirmed anywhere, or the lease is
    /// no longer valid).
    Requeued,
    /// The ack or nack itself failed: the consuming channel is closed, which returns the request
    /// to its queue.
    ChannelLost,
    /// Left unsettled because the session is ending (its publishing connection closed, or one of
    /// [`HoldEnds::requeue`] fired): the close of the consuming channel returns the request, one
    /// delivery charged. A nack now would charge it once, and the broker could deliver it again
    /// to the same consumer before that close, which would return and charge it a second time.
    Left,
}

/// How [`publish_result`] ended: the delivery settled, or handed back unsettled.
#[derive(Debug)]
pub enum ResultEnd {
    /// The delivery is settled (acked, nacked, or its channel is gone).
    Settled(Settlement),
    /// The result was held (the broker did not take it) when one of [`HoldEnds::release`] fired,
    /// or was not published because the partition's lease deadline had passed: the delivery is
    /// returned unsettled, for the caller to put back without charging it (the partition's
    /// `return_uncharged`), so a graceful stop does not wait for the broker, and an aborted
    /// partition's request is not charged.
    Released(Box<Delivery>),
}

/// What ends the hold of a result the broker does not take ([`publish_result`]).
#[derive(Debug, Clone, Copy)]
pub struct HoldEnds<'a> {
    /// Any of these cancelled (the session's end, a lost lease): the request is requeued, charged
    /// one delivery.
    pub requeue: &'a [&'a tokio_util::sync::CancellationToken],
    /// Any of these cancelled (a graceful stop: shutdown or handoff): the delivery is handed back
    /// unsettled ([`ResultEnd::Released`]), for the caller to put back uncharged.
    pub release: &'a [&'a tokio_util::sync::CancellationToken],
}

/// The `x-reply-to-refused` value of a refused publish: `nacked` (`basic.nack`, e.g. a full
/// queue with `x-overflow = reject-publish`), `unroutable` (the queue does not exist), `timeout`
/// (no confirm within `amqp.confirm_timeout`); `None` for a channel or connection failure, which
/// another queue would meet too.
pub fn refusal_reason(e: &PublishError) -> Option<&'static str> {
    match e {
        PublishError::Nacked => Some(REFUSED_NACKED),
        PublishError::Unroutable { .. } => Some(REFUSED_UNROUTABLE),
        PublishError::Timeout(_) => Some(REFUSED_TIMEOUT),
        PublishError::Amqp(_) | PublishError::AfterFailed | PublishError::LeaseExpired => None,
    }
}

/// Publishes `result` for the request of `delivery` and settles the delivery: acked once the
/// result is confirmed, else nacked with requeue; never left unsettled.
///
/// The result goes to the request's `reply_to` queue, or to `amqp.results_queue` when it has
/// none. When `reply_to` refuses it (see [`refusal_reason`]) it goes to `amqp.results_queue`
/// with headers [`HEADER_REPLY_TO_REFUSED`] and [`HEADER_REPLY_TO`]. It carries `x-request-id`,
/// `x-partition`, `x-partition-epoch` and `x-instance`. Nothing is published once
/// `tenure.lease` is invalid: the delivery is handed back ([`ResultEnd::Released`]) to be put
/// back uncharged. A result confirmed is acked, lease or not.
/// `enqueued_unix_ms` (the request's publish time) feeds the end-to-end latency.
///
/// **A result the broker does not take is held, not charged.** When the results queue fails too
/// (a permission revoked on the default exchange, the results queue full with `reject-publish`,
/// deleted and not declarable under a vhost queue limit, a publishing channel closed by the
/// broker, no confirm in time), the fault is the deployment's, not the request's: requeueing would
/// charge the request a delivery per attempt, and a broker fault would dead-letter every answered
/// request with `delivery_limit` within seconds. So the delivery stays unacked (uncharged) and the
/// result is published again after [`hold_backoff`] (`amqp.reconnect_backoff_initial`
/// doubling up to `amqp.reconnect_backoff_max`, and never while the publishing connection is
/// blocked: [`wait_unblocked`]), on a new channel when the broker closed the old one, until it is
/// confirmed, counted in `requests_total{stage="publisher",outcome="result_held"}`
/// per failed attempt. The partition's prefetch bounds the requests held so. The holding ends
/// when the lease deadline passes, one of `hold.requeue` is cancelled or the publishing
/// connection is closed: then the session is ending (a lease past its deadline is aborted), and
/// the delivery is left unsettled ([`Settlement::Left`]) for the close of its consuming channel
/// to return, charged once, as at any lease loss or session end.
/// When one of `hold.release` fires (a graceful stop: shutdown or handoff) a held result is given
/// up and its delivery handed back unsettled ([`ResultEnd::Released`]): a stop does not wait
/// `shutdown.drain_timeout` for a broker that refuses results, and the request is not charged.
/// Only a result larger than the broker's `max_message_size` ([`says_too_large`]) is the request's
/// own fault: it is requeued at once, so `amqp.delivery_limit` bounds it.
///
/// **Direct reply-to.** A `reply_to` of `amq.rabbitmq.reply-to.<token>` ([`is_direct_reply_to`])
/// names a requester's channel, not a queue. RabbitMQ delivers a result published to it straight
/// to that channel, but answers a `mandatory` publish with `basic.return` (`NO_ROUTE`) whether or
/// not it delivered it: no queue took the message (rabbitmq-server #6124; RabbitMQ 3.x). So a
/// return for such a name says nothing by itself; it is settled by
/// [`direct_reply_to_present`] (a passive `queue.declare` of the name on a disposable channel of
/// `conn`, the check RabbitMQ documents for a requester that may have gone away): requester
/// present — the result was delivered (it was present when the result was published), done, no
/// refusal; requester gone — the result went nowhere, so it goes to `amqp.results_queue` with
/// `x-reply-to-refused` = [`REFUSED_GONE`]. When the check gets no answer on a live connection,
/// the result goes to the results queue with `x-reply-to-refused` = [`REFUSED_UNROUTABLE`] (the
/// requester may have it as well: a duplicate, not one copy per attempt as when it was held and
/// published to `reply_to` again). A requester that takes the result and leaves
/// before the check also finds a copy in the results queue: a duplicate, never a loss.
pub async fn publish_result(
    out: &SharedConfirmChannel,
    amqp: &AmqpSettings,
    tenure: Tenure<'_>,
    delivery: Delivery,
    result: RequestResult,
    enqueued_unix_ms: Option<u64>,
    hold: HoldEnds<'_>,
) -> ResultEnd {
    let (hold_until, release_on) = (hold.requeue, hold.release);
    // Until this returns: a redelivery meanwhile waits for it (`crate::partition`).
    let _in_flight = redelivery::forward_key(delivery.properties.headers().as_ref()).map(redelivery::OutcomeInFlight::begin);
    let mut failures = 0u32;
    // Counted in `held_publishes{kind="result"}` while it waits for its turn because the broker
    // refuses the partition's results, and from its own first refusal until this returns.
    let mut holding = out.turns().refusing().then(|| metrics::HeldPublish::new("result"));
    // While the broker refuses the partition's results, they take turns
    // ([`crate::amqp::RefusalTurns::turn`]).
    let mut turn = match result_turn(out, hold).await {
        Ok(turn) => turn,
        Err(TurnEnd::Requeue) => return ResultEnd::Settled(left(&result.id, "the session ended while results were refused")),
        Err(TurnEnd::Release) => return released(delivery, &result.id, &"stopping while results are refused"),
    };
    // Whether a refusal by `reply_to` was counted already: once per result, not per attempt.
    let mut refusal_counted = false;
    loop {
        let Err(e) = publish_with_fallback(out, amqp, tenure, &delivery.properties, &result, &mut refusal_counted).await else {
            out.turns().accepted();
            break;
        };
        // Each publish checks the lease first ([`publish_on`]), this loop's first one too.
        // Not published anywhere (the fallback's publish checks it too): the request goes back
        // uncharged, as every other request of the aborted partition.
        if matches!(e, PublishError::LeaseExpired) {
            warn!(partition = tenure.partition, epoch = tenure.epoch, request_id = %result.id, "lease deadline passed; not publishing, the request goes back to its partition queue uncharged");
            crate::redelivery::note_failure(&result.id, "lease deadline passed before the result was published");
            return ResultEnd::Released(Box::new(delivery));
        }
        // After a failed publish the partition's next one goes on a new channel
        // ([`crate::amqp::SharedConfirmChannel`]): a quorum queue that rejected a publish can
        // drop later publishes of the same channel while confirming them (RabbitMQ 3.10;
        // rabbitmq-server #14589).
        let why = format!("result not published: {e}");
        if !out.connection().status().connected() || hold_until.iter().any(|t| t.is_cancelled()) {
            crate::warn_limited!(RESULT_FAILED_LOG, request_id = %result.id, error = %e, "result not confirmed and the session is ending; its end returns the request");
            return ResultEnd::Settled(left(&result.id, &why));
        }
        if says_too_large(&e) {
            crate::warn_limited!(RESULT_FAILED_LOG, request_id = %result.id, error = %e, "result not confirmed; requeueing the request");
            return ResultEnd::Settled(requeue(&delivery.acker, &result.id, &why).await);
        }
        if release_on.iter().any(|t| t.is_cancelled()) {
            return released(delivery, &result.id, &e);
        }
        let step = out.turns().refused(turn.is_some());
        let wait = hold_backoff(amqp, failures.max(step));
        failures += 1;
        holding.get_or_insert_with(|| metrics::HeldPublish::new("result"));
        crate::redelivery::note_failure(&result.id, &why);
        metrics::requests(stage::PUBLISHER, outcome::RESULT_HELD, 1);
        log_result_held(&result.id, &e, failures, wait);
        tokio::select! {
            _ = wait_to_publish_again(out.connection(), wait) => {}
            _ = any_cancelled(hold_until) => return ResultEnd::Settled(left(&result.id, &why)),
            _ = any_cancelled(release_on) => return released(delivery, &result.id, &e),
        }
        drop(turn);
        turn = match result_turn(out, hold).await {
            Ok(turn) => turn,
            Err(TurnEnd::Requeue) => return ResultEnd::Settled(left(&result.id, &why)),
            Err(TurnEnd::Release) => return released(delivery, &result.id, &e),
        };
    }
    drop(turn);
    ack_published(delivery, &result, failures, enqueued_unix_ms).await
}

/// Logs a result the broker did not take (`e`, after `failures` attempts, the next in `wait`):
/// at ERROR when the broker denies write access (an operator must act), else at WARN; both
/// rate-limited.
fn log_result_held(id: &str, e: &PublishError, failures: u32, wait: Duration) {
    if access_refused(e) {
        crate::error_limited!(
            RESULT_FAILED_LOG,
            request_id = %id,
            error = %e,
            attempts = failures,
            retry_in = ?wait,
            "result refused: the broker denies the daemon's user write access (403 ACCESS_REFUSED; check its write permission on the vhost, rabbitmqctl list_user_permissions); holding the request unacked, not charged a delivery, and publishing the result again"
        );
    } else {
        crate::warn_limited!(
            RESULT_FAILED_LOG,
            request_id = %id,
            error = %e,
            attempts = failures,
            retry_in = ?wait,
            "result not confirmed: the broker does not take results now (a full, missing or just re-declared results queue, revoked write access, no leader; not the request's fault, which only a result over max_message_size would be); holding the request unacked, not charged a delivery, and publishing the result again"
        );
    }
}

/// Acks the delivery whose result the broker confirmed (after `failures` refused attempts);
/// counts the outcome and the end-to-end latency from `enqueued_unix_ms`.
///
/// Even when the lease deadline passed since the publish: the lease fences results, and this
/// one is out. Left unacked, the request was returned by the channel's close charged a delivery,
/// and its next owner answered it a second time, or dead-lettered it as `delivery_limit` though
/// it had been answered. The delivery is this consumer's alone (a single active consumer) until
/// its channel closes, so the ack cannot take it from another owner.
async fn ack_published(delivery: Delivery, result: &RequestResult, failures: u32, enqueued_unix_ms: Option<u64>) -> ResultEnd {
    redelivery::note_answered(delivery.properties.headers().as_ref());
    if let Err(e) = crate::amqp::ack(&delivery.acker).await {
        crate::warn_limited!(ACK_FAILED_LOG, request_id = %result.id, error = %e, "ack failed; the closed channel returns the request (duplicate result)");
        return ResultEnd::Settled(Settlement::ChannelLost);
    }
    if failures > 0 {
        info!(request_id = %result.id, attempts = failures + 1, "a held result was published");
    }
    metrics::requests(stage::PUBLISHER, if result.ok { outcome::PROCESSED } else { outcome::FAILED }, 1);
    debug!(ok = result.ok, "result published and request acked");
    if let Some(t0) = enqueued_unix_ms {
        metrics::end_to_end_latency(unix_ms().saturating_sub(t0) as f64 / 1000.0);
    }
    ResultEnd::Settled(Settlement::Acked)
}

/// Why a held result stopped waiting for its turn ([`result_turn`]).
enum TurnEnd {
    /// One of [`HoldEnds::requeue`] was cancelled.
    Requeue,
    /// One of [`HoldEnds::release`] was cancelled.
    Release,
}

/// Waits for a result's turn on `out` ([`crate::amqp::RefusalTurns::turn`]), or until one of `hold`'s
/// tokens is cancelled.
async fn result_turn<'a>(out: &'a SharedConfirmChannel, hold: HoldEnds<'_>) -> Result<Option<tokio::sync::MutexGuard<'a, ()>>, TurnEnd> {
    tokio::select! {
        biased;
        turn = out.turns().turn() => Ok(turn),
        _ = any_cancelled(hold.requeue) => Err(TurnEnd::Requeue),
        _ = any_cancelled(hold.release) => Err(TurnEnd::Release),
    }
}

/// Completes when one of `tokens` is cancelled; never when there is none (`select_all` would
/// panic on an empty list).
async fn any_cancelled(tokens: &[&tokio_util::sync::CancellationToken]) {
    if tokens.is_empty() {
        return std::future::pending().await;
    }
    futures_util::future::select_all(tokens.iter().map(|t| Box::pin(t.cancelled()))).await;
}

/// Gives up a held result at a graceful stop ([`HoldEnds::release`]): its request goes
/// back to its queue through the caller, and its answer is dropped (the next owner calls the LLM
/// again).
fn released(delivery: Delivery, request_id: &str, e: &dyn std::fmt::Display) -> ResultEnd {
    // Bounded: a stop gives up every held result at once (up to the partitions' prefetch).
    crate::info_limited!(RELEASED_LOG, request_id, error = %e, "stopping while the broker refuses this result: the request goes back to its partition queue uncharged");
    ResultEnd::Released(Box::new(delivery))
}

/// How often [`wait_unblocked`] looks at the connection.
const UNBLOCKED_POLL: Duration = Duration::from_millis(100);

/// Returns once `conn` is not blocked by the broker (`connection.blocked`: a memory or disk alarm,
/// <https://www.rabbitmq.com/docs/connection-blocked>). A held publish waits for it before it goes
/// again: while blocked, the broker reads nothing from the connection, so a publish that timed out
/// is still on its way, and each attempt more would reach the queue as one more copy once the
/// alarm clears.
pub async fn wait_unblocked(conn: &Connection) {
    wait_while(|| is_blocked(conn)).await;
}

/// When the broker last unblocked a publishing connection of this process
/// ([`note_publishing_unblocked`]).
static PUBLISHING_UNBLOCKED_AT: std::sync::Mutex<Option<tokio::time::Instant>> = std::sync::Mutex::new(None);

/// Publishing connections of this process the broker blocks now ([`note_publishing_blocked`]).
static PUBLISHING_BLOCKED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Notes that the broker blocked a publishing connection of this process
/// (`connection.blocked`), for [`alarm_within`].
pub fn note_publishing_blocked() {
    PUBLISHING_BLOCKED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Notes that the broker unblocked a publishing connection of this process
/// (`connection.unblocked`, or the blocked connection closed), for [`blocked_since`] and
/// [`alarm_within`]. Follows a [`note_publishing_blocked`].
pub fn note_publishing_unblocked() {
    let _ = PUBLISHING_BLOCKED.fetch_update(std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed, |n| n.checked_sub(1));
    *PUBLISHING_UNBLOCKED_AT.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(tokio::time::Instant::now());
}

/// Whether the broker blocks a publishing connection of this process now (a memory or disk
/// alarm), or unblocked one within `window`.
pub fn alarm_within(window: Duration) -> bool {
    PUBLISHING_BLOCKED.load(std::sync::atomic::Ordering::Relaxed) > 0
        || PUBLISHING_UNBLOCKED_AT.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_some_and(|t| t.elapsed() <= window)
}

/// Whether the broker blocks `conn` now, or unblocked a publishing connection of this process
/// after `since`: a delivery received at `since` was held, at least in part, while nothing could
/// be published. (A return made just after an alarm ended, before the results held by it were
/// confirmed, is the alarm's too.)
pub fn blocked_since(conn: &Connection, since: tokio::time::Instant) -> bool {
    is_blocked(conn) || PUBLISHING_UNBLOCKED_AT.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_some_and(|t| t > since)
}

/// Returns once `blocked()` is false, looking every [`UNBLOCKED_POLL`].
async fn wait_while(blocked: impl Fn() -> bool) {
    while blocked() {
        tokio::time::sleep(UNBLOCKED_POLL).await;
    }
}

/// How long a held result ([`publish_result`]) or forward (the router) waits before it is
/// published again after its `failures`-th failed attempt (0-based):
/// `amqp.reconnect_backoff_initial` × 2^`failures`, at most `amqp.reconnect_backoff_max` (the
/// schedule of [`redelivery::requeue_backoff`], counted in attempts instead of deliveries).
pub fn hold_backoff(a: &AmqpSettings, failures: u32) -> Duration {
    redelivery::requeue_backoff(a, u64::from(failures))
}

/// Waits before a held publish goes again: `wait` (its [`hold_backoff`]), then until `conn` is
/// not blocked ([`wait_unblocked`]).
pub async fn wait_to_publish_again(conn: &Connection, wait: Duration) {
    tokio::time::sleep(wait).await;
    wait_unblocked(conn).await;
}

/// Whether a failed publish says the message itself is too large for the broker: the channel
/// closed with 406 `PRECONDITION_FAILED` "message size N is larger than \[configured\] max size M"
/// (RabbitMQ's `max_message_size`, 128 MiB by default since 3.8; `rabbit_channel`).
pub fn says_too_large(e: &PublishError) -> bool {
    match e {
        PublishError::Amqp(e) => {
            let text = e.to_string();
            crate::amqp::reply_code(e) == Some(crate::amqp::PRECONDITION_FAILED) && text.contains("message size") && text.contains("max size")
        }
        _ => false,
    }
}

/// Publishes a result to `reply_to` (or the results queue), then, when `reply_to` refused it, to
/// the results queue with the refusal headers. A return for a direct reply-to name is settled by
/// [`direct_reply_to_present`] (see [`publish_result`]). The refusal is counted in
/// `reply_to_refused_total` unless `refusal_counted` says it was already, by an earlier attempt
/// at the same result (the results queue refused that one too), and sets it.
async fn publish_with_fallback(
    out: &SharedConfirmChannel,
    amqp: &AmqpSettings,
    tenure: Tenure<'_>,
    request: &BasicProperties,
    result: &RequestResult,
    refusal_counted: &mut bool,
) -> Result<(), PublishError> {
    let body = serde_json::to_vec(result).expect("result serializes");
    let out_props = result_props(request, &result.id, tenure);
    let t = amqp.confirm_timeout;
    let reply_to = request.reply_to().as_ref().map(|r| r.as_str().to_owned()).filter(|r| !r.is_empty());
    let Some(rt) = reply_to else {
        return publish_own(out, amqp, OwnDestination::Results, &body, out_props, Some(tenure.lease)).await;
    };
    let (reason, why) = match publish_on(out, amqp, "", &rt, &body, out_props.clone(), Some(tenure.lease)).await {
        Ok(()) => return Ok(()),
        Err(PublishError::Unroutable { .. }) if is_direct_reply_to(&rt) => match direct_reply_to_present(out.connection(), &rt, t).await {
            Ok(true) => {
                debug!(request_id = %result.id, "result delivered to its direct reply-to requester");
                return Ok(());
            }
            Ok(false) => (REFUSED_GONE, "the direct reply-to requester has gone away (its channel or reply consumer no longer exists)".to_owned()),
            // No answer to the check on a live connection: the requester may have the result.
            // Held and published to `reply_to` again, it would get one more copy per attempt,
            // and the partition's other results would wait behind it; it goes to the results
            // queue as the broker answered (`unroutable`), as a returned result placed again
            // does: a duplicate at worst.
            Err(e) if out.connection().status().connected() => (REFUSED_UNROUTABLE, format!("returned, and the check of the direct reply-to requester got no answer ({e}); it may have the result as well")),
            Err(e) => return Err(e),
        },
        Err(e) => match refusal_reason(&e) {
            Some(reason) => (reason, e.to_string()),
            None => return Err(e),
        },
    };
    crate::warn_limited!(REPLY_REFUSED_LOG, request_id = %result.id, reply_to = %rt, reason, error = %why, "reply queue refused the result; publishing it to the results queue");
    if !std::mem::replace(refusal_counted, true) {
        metrics::reply_to_refused(reason);
    }
    let headers = headers_with(out_props.headers().as_ref(), &[(HEADER_REPLY_TO_REFUSED, reason.to_owned()), (HEADER_REPLY_TO, rt)]);
    publish_own(out, amqp, OwnDestination::Results, &body, out_props.with_headers(headers), Some(tenure.lease)).await
}

/// Nacks the delivery of `acker` with requeue and notes `why` for request `id`
/// ([`crate::redelivery::note_failure`]).
pub async fn requeue(acker: &Acker, id: &str, why: &str) -> Settlement {
    crate::redelivery::note_failure(id, why);
    metrics::requests(stage::PUBLISHER, outcome::REQUEUED, 1);
    match crate::amqp::nack_requeue(acker).await {
        Ok(()) => Settlement::Requeued,
        Err(e) => {
            crate::warn_limited!(ACK_FAILED_LOG, request_id = %id, error = %e, "nack failed; the closed channel returns the request");
            Settlement::ChannelLost
        }
    }
}

/// Leaves a delivery unsettled for the session's end to return ([`Settlement::Left`]),
/// remembering `why` for its dead-letter detail.
fn left(id: &str, why: &str) -> Settlement {
    crate::redelivery::note_failure(id, why);
    metrics::requests(stage::PUBLISHER, outcome::REQUEUED, 1);
    Settlement::Left
}

/// The longest AMQP short string (message ids, correlation ids), in bytes (AMQP 0-9-1 §4.2.5.3).
pub const MAX_SHORT_STRING: usize = 255;

/// `text` if it fits an AMQP short string together with `suffix`, else its longest prefix on a
/// character boundary followed by `~`, the 16-hex-digit xxh3 of the whole text, and `suffix`:
/// unique per text, never longer than [`MAX_SHORT_STRING`] bytes (suffix ≤ 200 bytes).
pub fn short_string_id(text: &str, suffix: &str) -> String {
    if text.len() + suffix.len() <= MAX_SHORT_STRING {
        return format!("{text}{suffix}");
    }
    let hash = format!("~{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()));
    let mut keep = MAX_SHORT_STRING.saturating_sub(hash.len() + suffix.len());
    while !text.is_char_boundary(keep) {
        keep -= 1;
    }
    format!("{}{hash}{suffix}", &text[..keep])
}

/// Properties of a result: JSON, persistent, the request's correlation id (default: its id), and
/// the tenure headers.
fn result_props(request: &BasicProperties, id: &str, tenure: Tenure<'_>) -> BasicProperties {
    let correlation = request.correlation_id().clone().filter(|c| !c.as_str().is_empty()).unwrap_or_else(|| short_string_id(id, "").into());
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(PERSISTENT)
        .with_correlation_id(correlation)
        .with_message_id(short_string_id(id, ":result").into())
        .with_timestamp(unix_ms() / 1000)
        .with_headers(headers_with(
            None,
            &[
                (HEADER_REQUEST_ID, id.to_owned()),
                (HEADER_PARTITION_EPOCH, tenure.epoch.to_string()),
                (HEADER_PARTITION, tenure.partition.to_string()),
                (HEADER_INSTANCE, tenure.instance.to_owned()),
            ],
        ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every choice and the logprobs of an answer reach the published result; one choice gives
    /// no `choices` list.
    #[test]
    fn a_result_carries_every_choice_and_the_logprobs() {
        use crate::request::ResultChoice;
        let info = BatchInfo { partition: 3, batch_id: "3-1-1", batch_size: 1 };
        let choice = |t: &str| ResultChoice { output: serde_json::json!(t), finish_reason: Some("stop".into()), logprobs: Some(serde_json::json!({"t": t})) };
        let answer = Completion {
            output: serde_json::json!("a"),
            logprobs: Some(serde_json::json!({"t": "a"})),
            choices: Some(vec![choice("a"), choice("b")]),
            finish_reason: Some("stop".into()),
            usage: None,
            model: None,
            attempts: 1,
            permit_wait: Duration::ZERO,
        };
        let r = shape_result(info, "r1".into(), "00".into(), 0, TimingsMs::default(), Ok(answer.clone())).unwrap();
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["logprobs"], serde_json::json!({"t": "a"}));
        assert_eq!(v["choices"][1], serde_json::json!({"output": "b", "finish_reason": "stop", "logprobs": {"t": "b"}}));
        let one = Completion { choices: None, logprobs: None, ..answer };
        let v = serde_json::to_value(shape_result(info, "r2".into(), "00".into(), 0, TimingsMs::default(), Ok(one)).unwrap()).unwrap();
        assert!(v.get("choices").is_none() && v.get("logprobs").is_none(), "{v}");
    }

    /// Only a result over the broker's `max_message_size` is the request's own publish fault;
    /// held publishes wait `reconnect_backoff_initial` doubling up to `reconnect_backoff_max`.
    #[test]
    fn a_result_is_held_unless_it_is_too_large() {
        use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError, AMQPSoftError};
        let closed = |kind, text: &str| PublishError::Amqp(lapin::ErrorKind::ProtocolError(AMQPError::new(kind, text.into())).into());
        let too_large = closed(AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED), "PRECONDITION_FAILED - message size 134217729 is larger than configured max size 134217728");
        assert!(says_too_large(&too_large));
        assert!(says_too_large(&closed(AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED), "PRECONDITION_FAILED - message size 536870913 is larger than max size 536870912")));
        let refused = closed(AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED), "ACCESS_REFUSED - access to exchange 'amq.default' in vhost '/' refused for user 'u'");
        assert!(access_refused(&refused));
        for other in [&too_large, &PublishError::Nacked, &closed(AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED), "CONNECTION_FORCED")] {
            assert!(!access_refused(other), "{other}");
        }
        for held in [refused, PublishError::Nacked, PublishError::Timeout(Duration::from_secs(1)), PublishError::AfterFailed, closed(AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED), "CONNECTION_FORCED")] {
            assert!(!says_too_large(&held), "{held}");
        }
        let mut raw = crate::config::RawConfig::default();
        (raw.amqp.reconnect_backoff_initial, raw.amqp.reconnect_backoff_max) = ("500ms".into(), "3s".into());
        let a = crate::config::Settings::from_raw(&raw).unwrap().amqp;
        let waits: Vec<u64> = (0..6).map(|n| hold_backoff(&a, n).as_millis() as u64).collect();
        assert_eq!(waits, [500, 1000, 2000, 3000, 3000, 3000]);
        assert_eq!(hold_backoff(&a, u32::MAX), Duration::from_secs(3));
    }

    /// A confirm wait does not run out while the connection is blocked: it waits for the
    /// unblock, then the whole limit again; unblocked, it ends at the limit.
    #[tokio::test(start_paused = true)]
    async fn a_confirm_wait_does_not_run_out_while_the_connection_is_blocked() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let blocked = std::sync::Arc::new(AtomicBool::new(true));
        let start = tokio::time::Instant::now();
        let unblock = blocked.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(50)).await;
            unblock.store(false, Ordering::SeqCst);
        });
        // Confirmed 5 s after a 50 s alarm, with a 30 s limit.
        let confirm = tokio::time::sleep(Duration::from_secs(55));
        assert_eq!(await_unless_blocked(Duration::from_secs(30), || blocked.load(Ordering::SeqCst), confirm).await, Some(()));
        assert_eq!(start.elapsed().as_secs(), 55);
        // Not confirmed within the limit after the unblock: gives up then.
        let start = tokio::time::Instant::now();
        blocked.store(true, Ordering::SeqCst);
        let unblock = blocked.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(40)).await;
            unblock.store(false, Ordering::SeqCst);
        });
        assert_eq!(await_unless_blocked(Duration::from_secs(30), || blocked.load(Ordering::SeqCst), std::future::pending::<()>()).await, None);
        let waited = start.elapsed().as_millis();
        assert!((70_000..=70_100).contains(&waited), "{waited} ms");
        // Never blocked: the plain limit.
        let start = tokio::time::Instant::now();
        assert_eq!(await_unless_blocked(Duration::from_secs(30), || false, std::future::pending::<()>()).await, None);
        assert_eq!(start.elapsed().as_secs(), 30);
    }

    #[test]
    fn short_string_ids_fit_amqp_and_stay_unique() {
        assert_eq!(short_string_id("req-1", ":result"), "req-1:result");
        let exact = "a".repeat(MAX_SHORT_STRING - 7);
        assert_eq!(short_string_id(&exact, ":result"), format!("{exact}:result"));
        let (long_a, long_b) = (format!("{}a", "é".repeat(200)), format!("{}b", "é".repeat(200)));
        let (a, b) = (short_string_id(&long_a, ":result"), short_string_id(&long_b, ":result"));
        for id in [&a, &b] {
            assert!(id.len() <= MAX_SHORT_STRING, "{} bytes", id.len());
            assert!(id.ends_with(":result") && id.starts_with("éé"));
            assert!(ShortString::try_new(id.clone()).is_ok());
        }
        assert_ne!(a, b, "the hash keeps ids that share a long prefix apart");
        assert!(short_string_id(&"x".repeat(10_000), "").len() <= MAX_SHORT_STRING);
    }

    #[test]
    fn direct_reply_to_names_are_recognised() {
        assert!(is_direct_reply_to("amq.rabbitmq.reply-to.g1h2AA1yZXBseUA5NT.PkR2jaa6"));
        assert!(!is_direct_reply_to("amq.rabbitmq.reply-to"), "the pseudo-queue itself is never a result's destination");
        assert!(!is_direct_reply_to("amq.gen-abc"));
        assert!(!is_direct_reply_to("pbt-x.reply"));
    }

    #[test]
    fn refusals_are_named_and_channel_failures_are_not() {
        assert_eq!(refusal_reason(&PublishError::Nacked), Some("nacked"));
        let unroutable = PublishError::Unroutable { exchange: String::new(), routing_key: "q".into() };
        assert_eq!(refusal_reason(&unroutable), Some("unroutable"));
        assert_eq!(refusal_reason(&PublishError::Timeout(Duration::from_secs(1))), Some("timeout"));
        let closed = PublishError::Amqp(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(lapin::ChannelState::Closed, "test")));
        assert_eq!(refusal_reason(&closed), None);
    }

    /// Every property an allowed copy keeps.
    fn allowed() -> BasicProperties {
        BasicProperties::default()
            .with_content_type("application/json".into())
            .with_content_encoding("identity".into())
            .with_correlation_id("c".into())
            .with_reply_to("r".into())
            .with_message_id("m".into())
            .with_timestamp(7)
            .with_type("t".into())
            .with_app_id("a".into())
            .with_priority(3)
            .with_delivery_mode(1)
    }

    /// [`allowed`], the properties never copied, and headers.
    fn original() -> BasicProperties {
        let mut h = FieldTable::default();
        h.insert(ShortString::from(HEADER_DELIVERY_COUNT), AMQPValue::LongLongInt(4));
        h.insert(ShortString::from(HEADER_PREFIX_KEY), AMQPValue::LongString("k".into()));
        h.insert(ShortString::from(redelivery::HEADER_INPUT_REDELIVERED), AMQPValue::LongString("1".into()));
        h.insert(ShortString::from(redelivery::HEADER_FORWARD_ID), AMQPValue::LongString("f".into()));
        allowed().with_user_id("someone".into()).with_expiration("5000".into()).with_cluster_id("x".into()).with_headers(h)
    }

    #[test]
    fn carried_props_are_an_allowlist() {
        let p = carried_props(&original(), &[(HEADER_SHARD, "2".to_owned())]);
        assert_eq!(p.clone().with_headers(FieldTable::default()), allowed().with_headers(FieldTable::default()));
        let h = p.headers().as_ref();
        assert_eq!(header_str(h, HEADER_ORIGINAL_USER_ID).as_deref(), Some("someone"));
        assert_eq!(header_str(h, HEADER_ORIGINAL_EXPIRATION).as_deref(), Some("5000"));
        assert_eq!(header_str(h, HEADER_PREFIX_KEY).as_deref(), Some("k"));
        assert_eq!(header_str(h, HEADER_SHARD).as_deref(), Some("2"));
        assert_eq!(header_u64(h, HEADER_DELIVERY_COUNT), None, "the next queue counts its own deliveries");
        assert_eq!(header_u64(h, redelivery::HEADER_INPUT_REDELIVERED), None, "set by the router only: a copy put back is processed");
        assert_eq!(header_str(h, redelivery::HEADER_FORWARD_ID), None, "set by the router only, one per forward");
    }

    /// Reported: a request with `CC: ["0", "1", …]` was forwarded to every partition it listed
    /// (RabbitMQ routes by `CC` and `BCC` too), and so were its copies put back uncharged.
    #[test]
    fn carried_props_drop_the_headers_the_broker_routes_by() {
        let mut h = FieldTable::default();
        let keys = AMQPValue::FieldArray(vec![AMQPValue::LongString("0".into()), AMQPValue::LongString("1".into())].into());
        h.insert(ShortString::from("CC"), keys.clone());
        h.insert(ShortString::from("BCC"), keys);
        h.insert(ShortString::from("cc-like"), AMQPValue::LongString("kept".into()));
        let p = carried_props(&allowed().with_headers(h), &[]);
        let h = p.headers().as_ref().expect("headers");
        assert!(!h.contains_key("CC") && !h.contains_key("BCC"), "{h:?}");
        assert_eq!(header_str(Some(h), "cc-like").as_deref(), Some("kept"));
    }

    #[test]
    fn the_request_fingerprint_covers_what_the_publisher_set_and_not_what_the_daemon_adds() {
        let fp = |p: &BasicProperties| request_fingerprint("r1", b"{}", p);
        let base = allowed();
        let routed = carried_props(&base, &[(HEADER_SHARD, "3".to_owned()), (HEADER_ROUTED_AT_MS, "1".to_owned())]);
        let mut daemon_only = FieldTable::default();
        for k in OWN_HEADERS.into_iter().chain(ROUTING_HEADERS) {
            daemon_only.insert(ShortString::from(k), AMQPValue::LongString("x".into()));
        }
        assert_eq!(fp(&base.clone().with_headers(FieldTable::default())), fp(&routed.with_headers(daemon_only)), "the daemon's headers do not count");
        let mut own = FieldTable::default();
        own.insert(ShortString::from("tenant"), AMQPValue::LongString("a".into()));
        for (what, other) in [
            ("correlation_id", base.clone().with_correlation_id("c2".into())),
            ("reply_to", base.clone().with_reply_to("r2".into())),
            ("timestamp", base.clone().with_timestamp(8)),
            ("a header", base.clone().with_headers(own)),
        ] {
            assert_ne!(fp(&base), fp(&other), "{what}");
        }
        assert_ne!(fp(&base), request_fingerprint("r2", b"{}", &base), "id");
        assert_ne!(fp(&base), request_fingerprint("r1", b"{ }", &base), "body");
        // A value cannot pass for the next field.
        let a = BasicProperties::default().with_reply_to("x\ncorrelation_id=1:y".into());
        let b = BasicProperties::default().with_reply_to("x".into()).with_correlation_id("y".into());
        assert_ne!(fp(&a), fp(&b));
    }

    #[test]
    fn carried_props_of_a_bare_message_add_no_originals() {
        let p = carried_props(&BasicProperties::default(), &[]);
        assert_eq!(p.headers().as_ref().map(|h| h.inner().len()), Some(0));
        assert!(p.user_id().is_none() && p.expiration().is_none());
    }

    #[test]
    fn logged_ids_are_bounded_on_a_char_boundary_and_escaped() {
        assert_eq!(log_id("req-1"), "req-1");
        let exact = "a".repeat(MAX_LOGGED_ID_BYTES);
        assert_eq!(log_id(&exact), exact);
        // "x" then 2-byte characters: byte 128 falls inside one, so the cut is at 127.
        let long = format!("x{}", "é".repeat(200));
        let cut = log_id(&long);
        assert!(cut.ends_with('…'), "{cut}");
        assert!(cut.len() <= MAX_LOGGED_ID_BYTES + '…'.len_utf8(), "{} bytes", cut.len());
        assert!(long.starts_with(cut.trim_end_matches('…')));
        assert_eq!(log_id(&"🦀".repeat(100)).chars().filter(|c| *c == '🦀').count(), MAX_LOGGED_ID_BYTES / 4);
        assert_eq!(log_id("a\nb\u{7}"), "a\\nb\\u{7}");
    }

    /// Observed: the long strings `ab\xff\xfe` and `ab\xfe\xff` and the string `ab\u{FFFD}\u{FFFD}`
    /// as `x-prefix-key` were all read as one key (U+FFFD replacement).
    #[test]
    fn a_prefix_key_header_that_is_not_utf8_is_refused_in_every_byte_type() {
        let header = |v: AMQPValue| {
            let mut t = FieldTable::default();
            t.insert(HEADER_PREFIX_KEY.into(), v);
            t
        };
        for bytes in [&b"ab\xff\xfe"[..], &b"ab\xfe\xff"[..]] {
            assert_eq!(prefix_key_header(Some(&header(AMQPValue::LongString(bytes.to_vec().into())))), Err("a long string that is not UTF-8"));
            assert_eq!(prefix_key_header(Some(&header(AMQPValue::ByteArray(bytes.to_vec().into())))), Err("a byte array that is not UTF-8"));
        }
        let good = "ab\u{e9}";
        assert_eq!(prefix_key_header(Some(&header(AMQPValue::LongString(good.into())))).unwrap().as_deref(), Some(good));
        assert_eq!(prefix_key_header(Some(&header(AMQPValue::ByteArray(good.as_bytes().to_vec().into())))).unwrap().as_deref(), Some(good));
    }

    /// A request at `amqp.delivery_limit` is dead-lettered, unless some of its returns were
    /// noted as not its fault; then those come off the count.
    #[test]
    fn returns_noted_uncharged_come_off_the_delivery_count() {
        let mut raw = crate::config::RawConfig::default();
        raw.amqp.delivery_limit = 2;
        let settings = crate::config::Settings::from_raw(&raw).unwrap();
        let delivery = |id: &str, count: i64| {
            let body = format!(r#"{{"id":"{id}","prompt":"p"}}"#).into_bytes();
            let mut headers = FieldTable::default();
            headers.insert(ShortString::from(redelivery::HEADER_DELIVERY_COUNT), AMQPValue::LongLongInt(count));
            let mut d = Delivery::mock(1, "".into(), "q".into(), true, body);
            d.properties = BasicProperties::default().with_headers(headers);
            d
        };
        let check = |d: &Delivery| check_delivery(&settings.amqp, &settings.requests, d, redelivery::Source::Input);
        let charged = delivery("uncharged-unit-1", 2);
        let refused = check(&charged).unwrap_err();
        assert_eq!(refused.reason, crate::request::REASON_DELIVERY_LIMIT);
        assert!(refused.detail.starts_with("delivered 2 times"), "{}", refused.detail);
        assert!(check(&delivery("uncharged-unit-1", 1)).is_ok(), "below the limit");

        redelivery::note_uncharged_return(input_message_key("uncharged-unit-1", &charged));
        assert_eq!(check(&charged).unwrap().id, "uncharged-unit-1", "one of its two returns was not its fault");
        assert!(check(&delivery("uncharged-unit-1", 3)).is_err(), "the limit still holds");
        assert!(check(&delivery("uncharged-unit-2", 2)).is_err(), "another request");
    }
}
