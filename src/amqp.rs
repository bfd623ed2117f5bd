//! AMQP plumbing shared by every stage: the session's connections ([`Connections`]), the
//! reply codes used across the crate and the classification of a broker refusal by its reply code
//! (never by its text), and header readers ([`header_str`], [`header_u64`]).
//!
//! Source of every code: the AMQP 0-9-1 specification, section "Constants"
//! (<https://www.rabbitmq.com/resources/specs/amqp0-9-1.pdf>), as generated into
//! `amq_protocol::protocol::constants` and `AMQPSoftError`.

use std::sync::Arc;
use std::time::Duration;

use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions, ConfirmSelectOptions};
use lapin::protocol::AMQPErrorKind;
use lapin::types::{AMQPValue, FieldTable};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::{Channel, Connect, Connection, ConnectionProperties};


use crate::config::AmqpSettings;

/// `reply-success` (200): the code of a normal `channel.close` / `connection.close`.
pub const REPLY_SUCCESS: u16 = lapin::protocol::constants::REPLY_SUCCESS;
/// `not-found` (404, soft error): a passive declare of a queue that does not exist.
pub const NOT_FOUND: u16 = 404;
/// `precondition-failed` (406, soft error): a redeclare with other arguments.
pub const PRECONDITION_FAILED: u16 = 406;
/// AMQP 0-9-1 reply code 403 `ACCESS_REFUSED`: a login refused at `connection.open` (wrong user or
/// password), or an operation the user has no permission for.
pub const ACCESS_REFUSED: u16 = 403;
/// AMQP 0-9-1 reply code 541 `INTERNAL_ERROR`: RabbitMQ's `connection.close` after a channel
/// process crashed (e.g. on a direct reply-to name it cannot decode, [`crate::reply_node`]).
pub const INTERNAL_ERROR: u16 = 541;
/// AMQP 0-9-1 reply code 530 `NOT_ALLOWED`: RabbitMQ's answer to a `connection.open` for a vhost
/// that does not exist or that the user may not use.
pub const NOT_ALLOWED: u16 = 530;

/// Opens one AMQP connection to node `node` of [`AmqpSettings::nodes`] (`amqp.urls`, or
/// `amqp.url`) with `props`, asking for the `amqp.heartbeat` timeout
/// ([`AmqpSettings::connect_uri`]). Over `amqps://` it uses the link's TLS files ([`crate::tls`]): the
/// CA bundle is trusted in addition to the system roots (lapin adds it to them), and the client
/// certificate and key, when set, authenticate the daemon (mutual TLS; RabbitMQ's
/// `ssl_options.verify = verify_peer`).
///
/// The whole opening (TCP, TLS, the AMQP handshake up to `connection.open-ok`) must finish
/// within the URL's `connection_timeout` query parameter (milliseconds, as in RabbitMQ's URI
/// query parameters, <https://www.rabbitmq.com/docs/uri-query-parameters>), or
/// [`DEFAULT_CONNECT_TIMEOUT`] without one. lapin reads that parameter but does not apply it, so
/// a server that accepts TCP and never answers (a wrong port, a hung broker, a firewall that
/// swallows packets) would otherwise hold the caller forever.
///
/// Errors: as [`Connection::connect`]; a server certificate that does not verify fails the TLS
/// handshake (an I/O error naming the certificate problem); an opening that takes longer than
/// the timeout is an I/O error of kind `TimedOut` naming the limit. Panics when `node` is out of
/// range.
pub async fn connect_node(amqp: &AmqpSettings, node: usize, props: ConnectionProperties) -> lapin::Result<Connection> {
    crate::tls::install_crypto_provider();
    let uri = amqp.connect_uri(node);
    let limit = connect_timeout(&uri);
    let open = async move {
        if !amqp.tls.is_set() {
            return uri.connect(props).await;
        }
        let config = OwnedTLSConfig {
            identity: amqp.tls.client.as_ref().map(|c| OwnedIdentity::PKCS8 { pem: c.cert_pem.clone(), key: c.key_pem.clone() }),
            cert_chain: amqp.tls.ca_pem.as_ref().map(|p| String::from_utf8_lossy(p).into_owned()),
        };
        uri.connect_with_config(props, config, lapin::runtime::default_runtime()?).await
    };
    match tokio::time::timeout(limit, open).await {
        Ok(r) => r.inspect(note_frame_max),
        Err(_) => Err(timed_out(format!("the broker did not complete the AMQP handshake within {limit:?} (connection_timeout)"))),
    }
}

/// The smallest `frame_max` negotiated on this process's AMQP connections; 0 until one opened.
static FRAME_MAX: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Records the `frame_max` that `conn` negotiated (the lower of the broker's and the URL's).
fn note_frame_max(conn: &Connection) {
    let f = conn.configuration().frame_max();
    if f > 0 {
        let _ = FRAME_MAX.fetch_update(std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed, |old| Some(if old == 0 { f } else { old.min(f) }));
    }
}

/// The largest AMQP frame, in bytes, that every connection of this process may send: the smallest
/// `frame_max` negotiated so far (`connection.tune`; RabbitMQ's default is 131072, its
/// `frame_max` setting). `None` before a connection opened. A message's properties travel in one
/// content header frame, which RabbitMQ refuses whole (`FRAME_ERROR`, closing the connection)
/// when it is larger (AMQP 0-9-1 §4.2.3, §4.2.6).
pub fn frame_max() -> Option<u32> {
    Some(FRAME_MAX.load(std::sync::atomic::Ordering::Relaxed)).filter(|f| *f > 0)
}

/// An I/O error of kind `TimedOut` saying `what` waited too long (see [`is_timeout`]).
fn timed_out(what: String) -> lapin::Error {
    lapin::Error::from(std::io::Error::new(std::io::ErrorKind::TimedOut, what))
}

/// Whether `e` is an I/O error of kind `TimedOut`, as [`connect_node`] and [`answered`] make when
/// the broker does not answer in time.
pub fn is_timeout(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::IOError(io) if io.kind() == std::io::ErrorKind::TimedOut)
}

/// How long opening a connection may take when the broker URL sets no `connection_timeout`:
/// 30 s, three times RabbitMQ's own `handshake_timeout` (10 s,
/// <https://www.rabbitmq.com/docs/networking#tuning-handshake-timeout>), after which a live
/// broker has already closed a handshake it could not finish.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the daemon waits for the broker's answer to a method outside a publish: opening a
/// channel, `confirm.select`, `basic.qos`, `basic.consume`, `queue.declare`, `exchange.declare`,
/// `queue.bind`, `basic.cancel`: 30 s (closes wait [`CLOSE_TIMEOUT`]).
///
/// A live broker answers these in milliseconds. lapin notices a dead connection by its
/// heartbeats (nothing read for 2 × `amqp.heartbeat`) or by a socket error, but not every way a
/// connection can stop answering, and a method it waits on has no deadline of its own. Without
/// one, a partition worker waiting on a close would hold its lease (so its partition) for ever,
/// and a session waiting on one would never reconnect. 30 s is three heartbeat intervals at the
/// default `amqp.heartbeat` (10 s), longer than lapin's own detection of a silent broker.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(30);

/// `rpc`, or, when the broker has not answered within [`RPC_TIMEOUT`], an I/O error of kind
/// `TimedOut` naming `what` (for example `"channel.close"`). A connection whose broker does not
/// answer is broken: callers treat the error like any other connection failure.
pub async fn answered<T>(what: &str, rpc: impl std::future::Future<Output = lapin::Result<T>>) -> lapin::Result<T> {
    within(RPC_TIMEOUT, what, rpc).await
}

/// [`answered`] with the limit `limit`.
pub async fn within<T>(limit: Duration, what: &str, rpc: impl std::future::Future<Output = lapin::Result<T>>) -> lapin::Result<T> {
    match tokio::time::timeout(limit, rpc).await {
        Ok(r) => r,
        Err(_) => Err(timed_out(format!("the broker did not answer {what} within {limit:?}"))),
    }
}

/// The outcome of an ack or nack (`Acker::ack`, `Acker::nack`): lapin 4 answers `Ok(false)`
/// without sending anything when the delivery's channel is closed or the acker was used before
/// (`Acker::rpc`); that is an error here (`NotConnected`), since the broker returns such a
/// delivery with the channel instead of taking the settlement.
pub fn settled(r: lapin::Result<bool>) -> lapin::Result<()> {
    match r {
        Ok(true) => Ok(()),
        Ok(false) => Err(lapin::Error::from(std::io::Error::new(
            std::io::ErrorKind::NotConnected,
            "not sent: the delivery's channel is closed (or it was settled before); the broker returns it",
        ))),
        Err(e) => Err(e),
    }
}

/// Acks the delivery of `acker`, waiting at most [`CLOSE_TIMEOUT`]. The broker does not answer
/// an ack; lapin's future ends once the frame is written, and an ack on a connection that
/// stopped moving (a full socket to a stalled broker, a connection closing) may never end.
/// Errors: as [`settled`], or the timeout ([`within`]). Either way the delivery then has a
/// definite outcome: taken by the broker (a frame written late still arrives), or returned
/// when its channel closes.
pub async fn ack(acker: &Acker) -> lapin::Result<()> {
    settle_within("basic.ack", acker.ack(BasicAckOptions::default())).await
}

/// Nacks the delivery of `acker` with requeue (the broker puts it back and charges it a
/// delivery), waiting at most [`CLOSE_TIMEOUT`], as [`ack`] does. Errors: as [`ack`].
pub async fn nack_requeue(acker: &Acker) -> lapin::Result<()> {
    settle_within("basic.nack", acker.nack(BasicNackOptions { requeue: true, ..BasicNackOptions::default() })).await
}

/// An ack or nack (`what`) with the deadline of [`ack`], read by [`settled`].
async fn settle_within(what: &str, settlement: impl std::future::Future<Output = lapin::Result<bool>>) -> lapin::Result<()> {
    settled(within(CLOSE_TIMEOUT, what, settlement).await)
}

/// How long closing a channel or a connection waits for the broker's close-ok: 5 s. A live
/// broker answers a close at once (it requeues the channel's unacked deliveries as it does); a
/// close is often sent because the connection is already in doubt, and the work after it
/// (reconnecting, releasing the partition's lease) should not wait the whole [`RPC_TIMEOUT`].
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Closes `ch` with `reply-success` and the reason `why`, waiting at most [`CLOSE_TIMEOUT`] for
/// the broker's close-ok. Errors: as [`Channel::close`], or the timeout ([`within`]).
pub async fn close_channel(ch: &Channel, why: &str) -> lapin::Result<()> {
    within(CLOSE_TIMEOUT, "channel.close", ch.close(REPLY_SUCCESS, why.into())).await
}

/// How long a consuming channel stays open after its last acknowledgements on a graceful end
/// (the router's stop, a partition's drain or handover), before it is closed. A quorum queue may
/// apply the close of a channel before acknowledgements that channel sent just before it
/// (rabbitmq-server issue #10327, "Quorum queue ignores some received acknowledgments when
/// channel is closed"): the close returns those deliveries to the queue, and they are handled a
/// second time. Measured on RabbitMQ 3.10: a partition drain during an LLM outage that put 256
/// deliveries back (each copied, then acked) and closed at once left 47 acked originals in the
/// queue, answered twice; with this wait, none.
pub const SETTLE_BEFORE_CLOSE: Duration = Duration::from_millis(500);

/// Closes a consuming channel whose deliveries are all settled, after [`SETTLE_BEFORE_CLOSE`],
/// so that its last acknowledgements reach the queue before the close does. Errors: as
/// [`close_channel`].
pub async fn close_after_acks(ch: &Channel, why: &str) -> lapin::Result<()> {
    tokio::time::sleep(SETTLE_BEFORE_CLOSE).await;
    close_channel(ch, why).await
}

/// How long [`cancel_when_full`] waits for the deliveries it collects to fill the prefetch.
pub const PREFETCH_FILL_WAIT: Duration = Duration::from_millis(500);

/// Stops `consumer` (on `ch`, with `prefetch`) at a graceful stop without a delivery lost to the
/// cancel. Returns what it delivered meanwhile, unacked, in order, for the caller to handle or
/// put back.
///
/// A quorum queue may still deliver to a consumer after its cancel-ok (the queue ends a consumer
/// once its deliveries in flight are through; rabbitmq-server #3729), and lapin drops a delivery
/// for a consumer it no longer knows: left unacked, the channel's close returned it charged a
/// delivery, at every stop under a backlog. So `work` (settling what is in flight) runs first
/// while what the consumer delivers is only collected; collecting goes on until the collected
/// deliveries fill `prefetch` (with a backlog, within milliseconds: the broker can send nothing
/// more) or [`PREFETCH_FILL_WAIT`] passed (without a backlog, a message published in the
/// moments of the cancel can still be dropped so); then the cancel, bounded by
/// [`CLOSE_TIMEOUT`] like a close (the channel's close ends the consumer anyway), and what lapin
/// still holds (it ends the stream after those once the cancel-ok arrived).
pub async fn cancel_when_full(ch: &Channel, consumer: &mut lapin::Consumer, work: impl std::future::Future<Output = ()>, prefetch: u16) -> Vec<lapin::message::Delivery> {
    use futures_util::StreamExt;
    let mut held = Vec::new();
    {
        let collect = async {
            while let Some(Ok(delivery)) = consumer.next().await {
                held.push(delivery);
            }
            std::future::pending::<()>().await;
        };
        tokio::select! {
            () = work => {}
            () = collect => {}
        }
    }
    let fill = async {
        while held.len() < usize::from(prefetch) {
            match consumer.next().await {
                Some(Ok(delivery)) => held.push(delivery),
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(PREFETCH_FILL_WAIT, fill).await;
    let cancel = ch.basic_cancel(consumer.tag(), lapin::options::BasicCancelOptions::default());
    if within(CLOSE_TIMEOUT, "basic.cancel", cancel).await.is_ok() {
        let buffered = async {
            while let Some(Ok(delivery)) = consumer.next().await {
                held.push(delivery);
            }
        };
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, buffered).await;
    }
    held
}

/// Closes `conn` with `reply-success` and the reason `why`, waiting at most [`CLOSE_TIMEOUT`]
/// for the broker's close-ok; after that the daemon stops waiting and drops its handle. Errors:
/// as [`Connection::close`] (a connection already closed is an error), or the timeout.
pub async fn close_connection(conn: &Connection, why: &str) -> lapin::Result<()> {
    within(CLOSE_TIMEOUT, "connection.close", conn.close(REPLY_SUCCESS, why.into())).await
}

/// The opening limit of `uri`: its `connection_timeout` (milliseconds), or
/// [`DEFAULT_CONNECT_TIMEOUT`].
pub fn connect_timeout(uri: &lapin::uri::AMQPUri) -> Duration {
    uri.query.connection_timeout.map_or(DEFAULT_CONNECT_TIMEOUT, Duration::from_millis)
}

/// Opens one AMQP connection to the first node of [`AmqpSettings::nodes`] that accepts it, in
/// their order; returns it with that node's index. For one-off connections (the `submit` and
/// `status` subcommands); the daemon's sessions pick their node themselves (see
/// [`next_node`]).
///
/// Errors: the last node's error when none accepts the connection.
pub async fn connect(amqp: &AmqpSettings, props: ConnectionProperties) -> lapin::Result<(Connection, usize)> {
    let mut last = None;
    for node in 0..amqp.nodes.len() {
        match connect_node(amqp, node, props.clone()).await {
            Ok(c) => return Ok((c, node)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("amqp.nodes is never empty"))
}

/// The node a new session tries after a session on node `failed` ended: the next one in
/// [`AmqpSettings::nodes`] order, wrapping around, so a failed node is tried again only after
/// every other node (`nodes` = their count, ≥ 1).
pub fn next_node(failed: usize, nodes: usize) -> usize {
    (failed + 1) % nodes.max(1)
}

/// The reply code of the `channel.close` or `connection.close` the broker sent, when `e` is
/// such a refusal; `None` for I/O and client-side errors.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => Some(match p.kind() {
            AMQPErrorKind::Soft(s) => s.get_id(),
            AMQPErrorKind::Hard(h) => h.get_id(),
        }),
        _ => None,
    }
}

/// The AMQP connections of a session: consumers (and therefore acks and nacks) use `consume`,
/// every publish (forwarded requests, results, dead letters) uses `publish`, and the router's
/// consumer of the input queue (with its acks) has a connection of its own, `intake`.
///
/// RabbitMQ blocks *publishing* connections under a memory or disk alarm
/// (<https://www.rabbitmq.com/docs/connection-blocked>); a connection that only consumes and acks
/// is not blocked, so an alarm stalls publishes but never the acks of work already published
/// (acks free broker memory) nor the consumption of deliveries already on their way.
///
/// The input queue gets its own connection because anyone may publish to it: a message the AMQP
/// client cannot parse (RabbitMQ passes any bytes in a short string, such as a `message_id` that
/// is not UTF-8, which the client refuses) fails the connection it arrives on. On the intake
/// connection that ends only the router's consumer, which opens the connection again
/// ([`Self::reopen_intake`]); the partitions, their leases and their publishes go on.
#[derive(Clone)]
pub struct Connections {
    /// Partition consumers and their acks; also topology declarations and backlog polls.
    pub consume: Arc<Connection>,
    /// Publishes with publisher confirms.
    pub publish: Arc<Connection>,
    /// The router's input consumer and its acks (see above), replaced when it fails.
    intake: Arc<std::sync::Mutex<Arc<Connection>>>,
    /// The dead letters of the router and of every partition, on a channel of the publishing
    /// connection of their own: a dead letter the broker refuses (403 on the dead-letter
    /// exchange) closes its channel, and the forwards or results in flight on a channel shared
    /// with it would fail with it although the broker may have taken them, and be published
    /// again (an operator's run: 369 extra copies of 600 requests while only the dead-letter
    /// exchange refused writes). They go one at a time
    /// ([`SharedConfirmChannel::one_at_a_time`]), so that a refused one has no other behind it on
    /// the channel.
    pub dead_letters: Arc<SharedConfirmChannel>,
    /// Index in [`AmqpSettings::nodes`] of the broker node the connections are open to.
    pub node: usize,
    /// The instance name, for the name of a reopened intake connection.
    instance: Arc<str>,
}

/// Which of a session's three connections ([`Connections`]) a connection is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// Partition consumers, acks, topology.
    Consume,
    /// Publishes with confirms.
    Publish,
    /// The router's input consumer.
    Intake,
    /// The router's checks of direct reply-to names ([`crate::reply_node`]), which a forged name
    /// can make the broker close.
    ReplyToCheck,
}

/// The client-provided name of an instance's connection (RabbitMQ shows it in its management
/// UI and `rabbitmqctl list_connections`): `prefix-batcher {instance}` for [`Link::Consume`],
/// `prefix-batcher {instance} publish`, `prefix-batcher {instance} intake` and
/// `prefix-batcher {instance} reply-to check` for the others.
pub fn connection_name(instance: &str, link: Link) -> String {
    match link {
        Link::Consume => format!("prefix-batcher {instance}"),
        Link::Publish => format!("prefix-batcher {instance} publish"),
        Link::Intake => format!("prefix-batcher {instance} intake"),
        Link::ReplyToCheck => format!("prefix-batcher {instance} reply-to check"),
    }
}

impl Connections {
    /// The session's connections to node `node`, of instance `instance`; a replaced
    /// dead-letter channel ([`Self::dead_letters`]) closes at most `grace` later.
    pub fn new(consume: Connection, publish: Connection, intake: Connection, node: usize, instance: &str, grace: Duration) -> Self {
        let publish = Arc::new(publish);
        Self {
            consume: Arc::new(consume),
            dead_letters: Arc::new(SharedConfirmChannel::one_at_a_time(publish.clone(), grace, "dead letters".to_owned())),
            publish,
            intake: Arc::new(std::sync::Mutex::new(Arc::new(intake))),
            node,
            instance: instance.into(),
        }
    }

    /// Both the consuming and the publishing connection are open. The intake connection is not
    /// counted: the router opens it again itself.
    pub fn connected(&self) -> bool {
        self.consume.status().connected() && self.publish.status().connected()
    }

    /// The current intake connection.
    pub fn intake(&self) -> Arc<Connection> {
        self.intake.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Opens a new intake connection to the session's node and puts it in place of the current
    /// one, which is closed (it has normally failed already).
    ///
    /// Errors: as [`connect_node`]; the current connection then stays in place.
    pub async fn reopen_intake(&self, amqp: &AmqpSettings) -> lapin::Result<Arc<Connection>> {
        let fresh = Arc::new(connect_link(amqp, self.node, &self.instance, Link::Intake).await?);
        let old = std::mem::replace(&mut *self.intake.lock().unwrap_or_else(std::sync::PoisonError::into_inner), fresh.clone());
        if old.status().connected() {
            let _ = close_connection(&old, "intake connection replaced").await;
        }
        Ok(fresh)
    }

    /// Closes the three connections with `reply-success`, at once, each waiting at most
    /// [`CLOSE_TIMEOUT`] for its close-ok ([`close_connection`]); errors are returned from the
    /// first that fails (a closed intake connection is not an error: the router reopens it).
    pub async fn close(&self, why: &str) -> Result<(), lapin::Error> {
        let intake = self.intake();
        let (a, b, _) = tokio::join!(close_connection(&self.consume, why), close_connection(&self.publish, why), async {
            if intake.status().connected() {
                let _ = close_connection(&intake, why).await;
            }
        });
        a.and(b)
    }
}

/// Opens the connection `link` of instance `instance` to node `node` ([`connect_node`]), named
/// by [`connection_name`].
pub async fn connect_link(amqp: &AmqpSettings, node: usize, instance: &str, link: Link) -> lapin::Result<Connection> {
    let name = connection_name(instance, link);
    connect_node(amqp, node, ConnectionProperties::default().with_connection_name(name.into())).await
}

/// A new channel on `conn`, in confirm mode (<https://www.rabbitmq.com/docs/confirms>).
/// Each step waits at most [`RPC_TIMEOUT`] for the broker's answer.
pub async fn confirm_channel(conn: &Connection) -> Result<Channel, lapin::Error> {
    let ch = answered("channel.open", conn.create_channel()).await?;
    answered("confirm.select", ch.confirm_select(ConfirmSelectOptions::default())).await?;
    Ok(ch)
}

/// A confirm-mode channel shared by concurrent publishes, with **ordered settlement**: a publish
/// counts as delivered only when its own confirm is an ack *and* every publish sent before it on
/// the channel has settled, none of those to the same destination (exchange and routing key)
/// with a failure. The router forwards through one; each partition session publishes its results
/// and dead letters through one ([`crate::partition`]). Cloning gives another handle to the same
/// channel and the same order.
///
/// Why the order matters:
/// - After the broker nacks a publish, a RabbitMQ 3.10 quorum queue can drop the channel's later
///   publishes to it while confirming them (rabbitmq-server #14589). So a publish that was sent
///   after a failed one to the same destination (nacked, or no confirm within
///   `amqp.confirm_timeout`, or the channel failed) is reported as
///   [`crate::publisher::PublishError::AfterFailed`], whatever its own confirm said, and its
///   caller publishes it again or requeues the request: a possible duplicate, never a loss.
///   Confirms can come out of order (several queues; lapin completes the confirms of one
///   `multiple` ack in hash-map order), so each publish waits until all earlier ones have settled.
/// - The rule is per destination because the defect is per queue: a channel keeps one enqueue
///   sequence per quorum queue it publishes to. A destination is the exchange and routing key,
///   which name one set of queues in this daemon's topology (the default exchange: the queue of
///   that name; the shard exchange: one partition queue; the dead-letter exchange: its queue).
///   So a reply queue that refuses results (`x-overflow = reject-publish`) does not make the
///   results and dead letters published behind them on the same channel go again (which would
///   duplicate them).
/// - lapin numbers a publish (its delivery tag, for the confirm) and queues its frames under two
///   different locks (lapin 4.12, `Channel::basic_publish`: `before_basic_publish`, then
///   `send_method_frame_with_body`). Two tasks publishing at once on two threads can interleave
///   there, and each would then receive the other's confirm. [`ConfirmChannel::send`] does both
///   under one lock of its own, in the first poll of `basic_publish`, before its first await.
///
/// A `basic.return` carries no delivery tag (AMQP 0-9-1,
/// <https://www.rabbitmq.com/docs/confirms#when-publishes-are-confirmed>): lapin hands a returned
/// message to the next confirm it completes on the channel, which can be another publish's. One
/// task per channel takes every confirm and hands such a return to its own publish before it
/// reports any outcome ([`crate::publisher::publish_confirmed`]).
///
/// One shared channel instead of one channel per publish in flight: the broker acks a busy
/// channel's publishes with one `multiple` ack for many, and fewer frames and wake-ups cost less
/// CPU per request (`bench/PROFILE.md`).
#[derive(Clone)]
pub struct ConfirmChannel {
    ch: Channel,
    order: Arc<PublishOrder>,
    /// The inbox of the channel's confirm collector, started by its first publish
    /// ([`crate::publisher::publish_confirmed`]); the collector ends when every handle is gone.
    confirms: Arc<std::sync::OnceLock<tokio::sync::mpsc::UnboundedSender<crate::publisher::Watch>>>,
}

/// The numbering and settlement state of a [`ConfirmChannel`]'s publishes.
#[derive(Default)]
struct PublishOrder {
    /// The next publish's number; locked while a publish is numbered and its frames queued.
    next: std::sync::Mutex<u64>,
    settled: std::sync::Mutex<Settled>,
}

#[derive(Default)]
struct Settled {
    /// Every publish numbered below this has settled.
    below: u64,
    /// Publishes at or above `below` that have settled (out of order).
    ahead: std::collections::BTreeSet<u64>,
    /// For each destination ([`destination`]) with a failed publish, the lowest number of one.
    failed: std::collections::HashMap<u64, u64>,
    /// Publishes waiting for all publishes before them to settle, by number.
    waiting: std::collections::BTreeMap<u64, tokio::sync::oneshot::Sender<()>>,
}

impl ConfirmChannel {
    /// Wraps `ch`, which must be in confirm mode ([`confirm_channel`]) and must not be published
    /// on except through this wrapper.
    pub fn new(ch: Channel) -> ConfirmChannel {
        ConfirmChannel { ch, order: Arc::new(PublishOrder::default()), confirms: Arc::default() }
    }

    /// The inbox of this channel's confirm collector; `start` starts the collector and gives its
    /// inbox, on the first call only.
    pub(crate) fn confirms(
        &self,
        start: impl FnOnce() -> tokio::sync::mpsc::UnboundedSender<crate::publisher::Watch>,
    ) -> &tokio::sync::mpsc::UnboundedSender<crate::publisher::Watch> {
        self.confirms.get_or_init(start)
    }

    /// A new confirm-mode channel on `conn` ([`confirm_channel`]), wrapped.
    pub async fn open(conn: &Connection) -> Result<ConfirmChannel, lapin::Error> {
        Ok(ConfirmChannel::new(confirm_channel(conn).await?))
    }

    /// The underlying channel.
    pub fn channel(&self) -> &Channel {
        &self.ch
    }

    /// Sends one publish: numbers it and queues its frames in the same order (see the type's
    /// doc). Returns its [`PublishTicket`], to settle it with once its outcome is known, and the
    /// rest of `basic_publish` (waiting until the frames are written), which resolves to the
    /// publisher confirm to wait for.
    pub async fn send(
        &self,
        exchange: &str,
        routing_key: &str,
        options: lapin::options::BasicPublishOptions,
        body: Arc<[u8]>,
        properties: lapin::BasicProperties,
    ) -> (PublishTicket, futures_util::future::BoxFuture<'static, Result<lapin::PublisherConfirm, lapin::Error>>) {
        use std::task::Poll;
        let ch = self.ch.clone();
        let dest = destination(exchange, routing_key);
        let (exchange, routing_key) = (lapin::types::ShortString::from(exchange), lapin::types::ShortString::from(routing_key));
        let mut publish: futures_util::future::BoxFuture<'static, _> =
            Box::pin(async move { ch.basic_publish(exchange, routing_key, options, &body[..], properties).await });
        let mut first = None;
        let seq = std::future::poll_fn(|cx| {
            let mut next = lock(&self.order.next);
            let seq = *next;
            *next += 1;
            if let Poll::Ready(r) = publish.as_mut().poll(cx) {
                first = Some(r);
            }
            Poll::Ready(seq)
        })
        .await;
        let ticket = PublishTicket { order: self.order.clone(), seq, dest, settled: false };
        match first {
            Some(r) => (ticket, Box::pin(std::future::ready(r))),
            None => (ticket, publish),
        }
    }

    /// Whether a publish on this channel failed: every later one to its destination is then
    /// [`crate::publisher::PublishError::AfterFailed`], so the channel must be replaced
    /// ([`SharedConfirmChannel::get`] does).
    pub fn has_failed(&self) -> bool {
        !lock(&self.order.settled).failed.is_empty()
    }

    /// Whether every publish sent on this channel has settled.
    pub fn drained(&self) -> bool {
        let next = *lock(&self.order.next);
        lock(&self.order.settled).below >= next
    }
}

impl std::ops::Deref for ConfirmChannel {
    type Target = Channel;
    fn deref(&self) -> &Channel {
        &self.ch
    }
}

/// Turns of the publishes on one channel while the broker refuses them.
///
/// While the broker takes them, publishes go concurrently ([`Self::turn`] returns `None` at
/// once). From [`Self::refused`] until [`Self::accepted`], they go one at a time: the others wait,
/// first come first served, until the holder of the turn drops it. A publisher holds its turn
/// through the attempt and the wait before its next one, so a refusing broker sees one attempt
/// per wait instead of one per held message.
///
/// Why: a publish the broker refuses with a channel error (403 `ACCESS_REFUSED`, 404
/// `NOT_FOUND`) closes the channel, and lapin 4 queues its `channel.close-ok` ahead of the frames
/// of other publishes still waiting to be written on that channel; RabbitMQ answers a frame on a
/// channel it has closed by closing the whole connection (504 `CHANNEL_ERROR` "expected
/// 'channel.open'"), which ends the session and charges every request in flight one delivery.
/// A refused publish that has the channel to itself closes it with nothing else queued on it.
/// On a channel whose every publish may be refused that way, publishes go one at a time from the
/// start ([`Self::always`]). The router also keeps one per partition queue, for the forwards to a
/// queue that refuses them while the others take theirs (`crate::router`).
#[derive(Debug, Default)]
pub struct RefusalTurns {
    /// Publishes go one at a time whether or not the broker refuses them ([`Self::always`]).
    always: bool,
    refusing: std::sync::atomic::AtomicBool,
    turn: tokio::sync::Mutex<()>,
    /// Refusals in a row of publishes that had the turn ([`Self::refused`]).
    in_turn: std::sync::atomic::AtomicU32,
}

impl RefusalTurns {
    /// Turns that every publish takes, refused or not.
    pub fn always() -> RefusalTurns {
        RefusalTurns { always: true, ..RefusalTurns::default() }
    }

    /// `None` at once while publishes go concurrently; else waits for the turn and returns it
    /// (or `None`, when [`Self::accepted`] was called meanwhile and the turns are not
    /// [always](Self::always) taken).
    pub async fn turn(&self) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        let taken = || self.always || self.refusing.load(std::sync::atomic::Ordering::Acquire);
        if !taken() {
            return None;
        }
        let guard = self.turn.lock().await;
        taken().then_some(guard)
    }

    /// The broker refused a publish (its publisher holds it to try again): from now on
    /// publishes take turns. Returns how many publishes that had the turn (`had_turn`) the broker
    /// refused in a row before this one (0 for one without the turn): the step of the backoff
    /// the turn is held for, so that the attempts slow down while the refusal lasts, whichever
    /// held message makes them.
    pub fn refused(&self, had_turn: bool) -> u32 {
        self.refusing.store(true, std::sync::atomic::Ordering::Release);
        if had_turn { self.in_turn.fetch_add(1, std::sync::atomic::Ordering::AcqRel) } else { 0 }
    }

    /// Whether the broker refused the last publish (publishes take turns until one is taken).
    pub fn refusing(&self) -> bool {
        self.refusing.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The broker took a publish: publishes go concurrently again.
    pub fn accepted(&self) {
        self.refusing.store(false, std::sync::atomic::Ordering::Release);
        self.in_turn.store(0, std::sync::atomic::Ordering::Release);
    }
}

/// A publishing connection's current [`ConfirmChannel`], shared by every task that publishes on
/// it, and replaced by a new one when it was closed or a publish on it failed (nack, no confirm:
/// later publishes on it would all be [`crate::publisher::PublishError::AfterFailed`]). A
/// replaced channel that is still open is closed once the publishes in flight on it have
/// settled, or after `grace` at the latest. The router forwards through one, each partition session
/// publishes its results through one, and the dead letters of both go through one of their own
/// ([`Connections::dead_letters`]).
pub struct SharedConfirmChannel {
    conn: Arc<Connection>,
    /// The channel in use; read without waiting by every publish.
    current: std::sync::Mutex<Option<ConfirmChannel>>,
    /// Held while the channel is replaced, so that one task replaces it.
    replacing: tokio::sync::Mutex<()>,
    grace: Duration,
    /// Who publishes here, for the log (`router`, `partition 3`).
    owner: String,
    /// Whether publishes take turns ([`Self::turns`]).
    turns: RefusalTurns,
}

/// Bounds the log line of a channel replaced after a failed publish: a reply queue that refuses
/// every result fails one publish per request ([`crate::log_limit`]).
static REPLACED_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();
/// Bounds the log line of a publishing channel found closed: a permission revoked on a
/// destination closes the channel of every publish to it.
static CLOSED_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// How often a replaced [`SharedConfirmChannel`] channel is checked for publishes in flight.
const DRAIN_POLL: Duration = Duration::from_millis(20);

impl SharedConfirmChannel {
    /// No channel is opened yet; `owner` names the publisher in the log.
    pub fn new(conn: Arc<Connection>, grace: Duration, owner: String) -> SharedConfirmChannel {
        SharedConfirmChannel {
            conn,
            current: std::sync::Mutex::new(None),
            replacing: tokio::sync::Mutex::new(()),
            grace,
            owner,
            turns: RefusalTurns::default(),
        }
    }

    /// As [`Self::new`], for publishes that take turns from the start ([`RefusalTurns::always`]):
    /// each holds its turn from its send to its outcome. For a channel whose first refused
    /// publish would close it with others queued behind ([`RefusalTurns`] says what that costs).
    pub fn one_at_a_time(conn: Arc<Connection>, grace: Duration, owner: String) -> SharedConfirmChannel {
        SharedConfirmChannel { turns: RefusalTurns::always(), ..SharedConfirmChannel::new(conn, grace, owner) }
    }

    /// The turns of the publishes made here while the broker refuses them ([`RefusalTurns`]).
    pub fn turns(&self) -> &RefusalTurns {
        &self.turns
    }

    /// The publishing connection.
    pub fn connection(&self) -> &Arc<Connection> {
        &self.conn
    }

    /// The channel to publish on: the current one while it is open and no publish on it failed,
    /// else a new one. Errors: opening a channel failed (the connection is closed, or
    /// `channel_max` reached).
    pub async fn get(&self) -> Result<ConfirmChannel, lapin::Error> {
        if let Some(ch) = self.usable() {
            return Ok(ch);
        }
        let _replacing = self.replacing.lock().await;
        // Another task may have replaced it meanwhile.
        if let Some(ch) = self.usable() {
            return Ok(ch);
        }
        let old = lock(&self.current).take();
        match old {
            Some(old) if old.status().connected() => {
                crate::warn_limited!(REPLACED_LOG, owner = %self.owner, "a publish on the publishing channel failed; replacing the channel");
                crate::metrics::publish_channel_replaced(true);
                let grace = self.grace;
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(grace, async {
                        while !old.drained() {
                            tokio::time::sleep(DRAIN_POLL).await;
                        }
                    })
                    .await;
                    let _ = close_channel(&old, "a publish failed; replaced").await;
                });
            }
            Some(_) => {
                crate::warn_limited!(CLOSED_LOG, owner = %self.owner, "the publishing channel was closed (by the broker: the publish's error, logged with it, says why; or with its connection); reopening it");
                crate::metrics::publish_channel_replaced(false);
            }
            None => {}
        }
        let ch = ConfirmChannel::open(&self.conn).await?;
        *lock(&self.current) = Some(ch.clone());
        Ok(ch)
    }

    /// The current channel while it is open and no publish on it failed.
    fn usable(&self) -> Option<ConfirmChannel> {
        lock(&self.current).as_ref().filter(|ch| ch.status().connected() && !ch.has_failed()).cloned()
    }

    /// Closes the current channel with `reply-success` ([`close_channel`]).
    pub async fn close(&self, why: &str) {
        let _replacing = self.replacing.lock().await;
        let ch = lock(&self.current).take();
        if let Some(ch) = ch {
            let _ = close_channel(&ch, why).await;
        }
    }
}

/// One publish's place in its [`ConfirmChannel`]'s order. Settle it with
/// [`PublishTicket::settle`]; dropped unsettled, it counts as failed.
pub struct PublishTicket {
    order: Arc<PublishOrder>,
    seq: u64,
    /// Its destination ([`destination`]).
    dest: u64,
    settled: bool,
}

/// A publish's destination for ordered settlement: `xxh3_64` of the exchange and routing key
/// (see [`ConfirmChannel`]). Two destinations that collide only make a publish go again.
fn destination(exchange: &str, routing_key: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&(exchange.len() as u64).to_le_bytes());
    h.update(exchange.as_bytes());
    h.update(routing_key.as_bytes());
    h.digest()
}

/// What [`PublishTicket::settle`] found about the publishes before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Earlier {
    /// Every earlier publish on the channel settled without a failure.
    AllDelivered,
    /// An earlier publish to the same destination failed: this one may have been dropped
    /// although confirmed.
    OneFailed,
    /// The earlier publishes did not all settle within the wait.
    Unsettled,
}

impl PublishTicket {
    /// Records this publish's outcome (`failed`: nacked, unconfirmed, or the channel failed;
    /// a `basic.return` is not a failure), then waits, at most `wait`, until every earlier
    /// publish on the channel has settled, and says how those to its destination went.
    pub async fn settle(mut self, failed: bool, wait: Duration) -> Earlier {
        self.settled = true;
        let rx = mark(&self.order, self.seq, self.dest, failed);
        if let Some(rx) = rx {
            if tokio::time::timeout(wait, rx).await.is_err() {
                return Earlier::Unsettled;
            }
        }
        match lock(&self.order.settled).failed.get(&self.dest) {
            Some(&f) if f < self.seq => Earlier::OneFailed,
            _ => Earlier::AllDelivered,
        }
    }
}

impl Drop for PublishTicket {
    fn drop(&mut self) {
        if !self.settled {
            mark(&self.order, self.seq, self.dest, true);
        }
    }
}

/// Marks publish `seq` to `dest` settled; returns a receiver to wait on while earlier ones are
/// not.
fn mark(order: &PublishOrder, seq: u64, dest: u64, failed: bool) -> Option<tokio::sync::oneshot::Receiver<()>> {
    let mut s = lock(&order.settled);
    if failed {
        let first = s.failed.entry(dest).or_insert(seq);
        *first = (*first).min(seq);
    }
    if seq == s.below {
        s.below += 1;
        loop {
            let below = s.below;
            if !s.ahead.remove(&below) {
                break;
            }
            s.below += 1;
        }
        let below = s.below;
        let still = s.waiting.split_off(&below);
        for (_, tx) in std::mem::replace(&mut s.waiting, still) {
            let _ = tx.send(());
        }
    } else if seq > s.below {
        s.ahead.insert(seq);
    }
    if s.below > seq {
        return None;
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    s.waiting.insert(seq, tx);
    Some(rx)
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads a string header (long or short string).
pub fn header_str<'a>(headers: Option<&'a FieldTable>, name: &str) -> Option<std::borrow::Cow<'a, str>> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) => Some(std::borrow::Cow::Borrowed(s.as_str())),
        _ => None,
    }
}

/// Reads an integer header: an AMQP integer type, or a string of decimal digits.
pub fn header_u64(headers: Option<&FieldTable>, name: &str) -> Option<u64> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => decimal(std::str::from_utf8(s.as_bytes()).ok()?),
        AMQPValue::ShortString(s) => decimal(s.as_str()),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        _ => None,
    }
}

/// `s` as a number when it is decimal digits only (no sign, no spaces), as the headers' contract
/// says; `u64::from_str` alone would take a leading `+`.
fn decimal(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};

    use super::*;

    /// lapin answers `Ok(false)` to an ack or nack it did not send (the delivery's channel is
    /// closed): that delivery comes back, so it must not count as settled.
    #[test]
    fn an_ack_lapin_did_not_send_is_an_error() {
        assert!(settled(Ok(true)).is_ok());
        let e = settled(Ok(false)).expect_err("not sent");
        assert!(e.to_string().contains("channel is closed"), "{e}");
        assert!(settled(Err(timed_out("x".into()))).is_err());
    }

    /// An ack that lapin never finishes sending (a connection that stopped moving) ends in an
    /// error after [`CLOSE_TIMEOUT`], so its delivery is handled as one whose channel closes.
    #[tokio::test(start_paused = true)]
    async fn an_ack_that_never_finishes_ends_after_the_close_timeout() {
        let t0 = tokio::time::Instant::now();
        let e = settle_within("basic.ack", std::future::pending()).await.expect_err("never sent");
        assert_eq!(t0.elapsed(), CLOSE_TIMEOUT);
        assert!(e.to_string().contains("basic.ack"), "{e}");
        assert!(settle_within("basic.nack", async { Ok(true) }).await.is_ok());
    }

    /// Observed: a `timestamp_in_ms` of "+1764000000000" was taken, though the contract says
    /// decimal digits.
    #[test]
    fn integer_headers_are_numbers_or_decimal_digits() {
        let mut t = FieldTable::default();
        for (k, v) in [("a", "1764000000000"), ("b", "+1764000000000"), ("c", " 12"), ("d", ""), ("e", "-3")] {
            t.insert(k.into(), AMQPValue::LongString(v.into()));
        }
        t.insert("f".into(), AMQPValue::ShortString("42".into()));
        t.insert("g".into(), AMQPValue::LongLongInt(7));
        let h = Some(&t);
        assert_eq!(header_u64(h, "a"), Some(1_764_000_000_000));
        for k in ["b", "c", "d", "e", "missing"] {
            assert_eq!(header_u64(h, k), None, "{k}");
        }
        assert_eq!((header_u64(h, "f"), header_u64(h, "g")), (Some(42), Some(7)));
    }

    #[test]
    fn reply_code_of_a_broker_refusal() {
        let refusal = AMQPError::new(AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED), "inequivalent arg".into());
        let e: lapin::Error = lapin::ErrorKind::ProtocolError(refusal).into();
        assert_eq!(reply_code(&e), Some(PRECONDITION_FAILED));
        let e: lapin::Error = lapin::ErrorKind::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND), "no queue".into())).into();
        assert_eq!(reply_code(&e), Some(NOT_FOUND));
        let io: lapin::Error = std::io::Error::other("reset").into();
        assert_eq!(reply_code(&io), None);
        assert_eq!(REPLY_SUCCESS, 200);
    }

    #[tokio::test]
    async fn publishes_take_turns_only_while_the_broker_refuses_them() {
        use futures_util::FutureExt;
        let turns = RefusalTurns::default();
        // Taken: publishes go concurrently, none waits.
        let (a, b) = (turns.turn().now_or_never(), turns.turn().now_or_never());
        assert!(matches!((&a, &b), (Some(None), Some(None))), "publishes waited while the broker takes them");

        // Refused: one turn at a time, handed on when its holder drops it.
        assert_eq!(turns.refused(false), 0, "a refusal without the turn is no step");
        let first = turns.turn().now_or_never().expect("the first publish waits for nobody").expect("a turn while refused");
        let mut second = Box::pin(turns.turn());
        assert!((&mut second).now_or_never().is_none(), "a second publish went while the first held the turn");
        assert_eq!(turns.refused(true), 0, "the first refusal in turn is step 0");
        drop(first);
        let second = second.now_or_never().expect("the turn passed on").expect("still refused: a turn");
        assert_eq!(turns.refused(true), 1, "refusals in turn count up, whoever holds the turn");

        // Taken again: the waiting publish goes without a turn, and so do the next ones.
        let mut third = Box::pin(turns.turn());
        assert!((&mut third).now_or_never().is_none());
        turns.accepted();
        assert!(turns.turn().now_or_never().is_some_and(|t| t.is_none()), "a new publish waited after the broker took one");
        drop(second);
        assert!(matches!(third.now_or_never(), Some(None)), "the waiting publish kept a turn after the broker took one");
        assert_eq!(turns.refused(true), 0, "a publish taken starts the count again");
    }

    /// `n` publishes numbered 0.., all to one destination.
    fn tickets(n: u64) -> Vec<PublishTicket> {
        tickets_to(&vec![destination("", "q"); n as usize])
    }

    /// One publish per entry of `dests`, numbered 0.., to that destination.
    fn tickets_to(dests: &[u64]) -> Vec<PublishTicket> {
        let order = Arc::new(PublishOrder::default());
        *lock(&order.next) = dests.len() as u64;
        dests.iter().enumerate().map(|(seq, &dest)| PublishTicket { order: order.clone(), seq: seq as u64, dest, settled: false }).collect()
    }

    const WAIT: Duration = Duration::from_secs(5);

    #[tokio::test(start_paused = true)]
    async fn publishes_settled_in_order_are_delivered_without_waiting() {
        let mut t = tickets(3).into_iter();
        for _ in 0..3 {
            let ticket = t.next().unwrap();
            assert_eq!(futures_util::FutureExt::now_or_never(ticket.settle(false, WAIT)), Some(Earlier::AllDelivered));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_confirm_that_comes_first_waits_for_the_publishes_before_it() {
        let mut t = tickets(3);
        let (t2, t1, t0) = (t.pop().unwrap(), t.pop().unwrap(), t.pop().unwrap());
        let later = tokio::spawn(t2.settle(false, WAIT));
        let middle = tokio::spawn(t1.settle(false, WAIT));
        tokio::task::yield_now().await;
        assert!(!later.is_finished() && !middle.is_finished(), "publish 0 has not settled yet");
        assert_eq!(t0.settle(false, WAIT).await, Earlier::AllDelivered);
        assert_eq!(later.await.unwrap(), Earlier::AllDelivered);
        assert_eq!(middle.await.unwrap(), Earlier::AllDelivered);
    }

    #[tokio::test(start_paused = true)]
    async fn a_publish_after_a_failed_one_is_not_delivered_even_when_acked_first() {
        let mut t = tickets(3);
        let (t2, t1, t0) = (t.pop().unwrap(), t.pop().unwrap(), t.pop().unwrap());
        let after = tokio::spawn(t1.settle(false, WAIT));
        tokio::task::yield_now().await;
        // Publish 0 is nacked after publish 1's ack arrived.
        assert_eq!(t0.settle(true, WAIT).await, Earlier::AllDelivered, "nothing before publish 0 failed");
        assert_eq!(after.await.unwrap(), Earlier::OneFailed);
        assert_eq!(t2.settle(false, WAIT).await, Earlier::OneFailed);
    }

    /// A reply queue that refuses results (`x-overflow = reject-publish`) nacks them; the
    /// results queue and dead-letter publishes behind them on the channel are delivered, not
    /// published again (which duplicated them), while a later publish to the refusing queue
    /// still goes again.
    #[tokio::test(start_paused = true)]
    async fn a_failed_publish_taints_only_later_publishes_to_its_own_destination() {
        let (reply, results, dlx) = (destination("", "reply-a"), destination("", "results"), destination("dlx", ""));
        let mut t = tickets_to(&[reply, results, dlx, reply, results]).into_iter();
        let (t0, t1, t2, t3, t4) = (t.next().unwrap(), t.next().unwrap(), t.next().unwrap(), t.next().unwrap(), t.next().unwrap());
        assert_eq!(t0.settle(true, WAIT).await, Earlier::AllDelivered);
        assert_eq!(t1.settle(false, WAIT).await, Earlier::AllDelivered);
        assert_eq!(t2.settle(false, WAIT).await, Earlier::AllDelivered);
        assert_eq!(t3.settle(false, WAIT).await, Earlier::OneFailed, "behind a failed publish to the same queue");
        assert_eq!(t4.settle(false, WAIT).await, Earlier::AllDelivered);
    }

    #[test]
    fn destinations_differ_by_exchange_and_routing_key() {
        assert_ne!(destination("", "ab"), destination("a", "b"));
        assert_ne!(destination("", "a"), destination("", "b"));
        assert_eq!(destination("x", "k"), destination("x", "k"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_ticket_dropped_unsettled_counts_as_failed() {
        let mut t = tickets(2);
        let (t1, t0) = (t.pop().unwrap(), t.pop().unwrap());
        drop(t0);
        assert_eq!(t1.settle(false, WAIT).await, Earlier::OneFailed);
    }

    #[tokio::test(start_paused = true)]
    async fn earlier_publishes_that_never_settle_end_the_wait() {
        let mut t = tickets(2);
        let (t1, _t0) = (t.pop().unwrap(), t.pop().unwrap());
        let started = tokio::time::Instant::now();
        assert_eq!(t1.settle(false, WAIT).await, Earlier::Unsettled);
        assert_eq!(started.elapsed(), WAIT);
    }

    #[test]
    fn the_next_node_follows_the_failed_one_and_wraps_around() {
        assert_eq!(next_node(0, 3), 1);
        assert_eq!(next_node(1, 3), 2);
        assert_eq!(next_node(2, 3), 0);
        assert_eq!(next_node(0, 1), 0);
    }
}
