//! AMQP plumbing shared by every stage: the session's two connections ([`Connections`]), the
//! reply codes used across the crate and the classification of a broker refusal by its reply code
//! (never by its text), and header readers ([`header_str`], [`header_u64`]).
//!
//! Source of every code: the AMQP 0-9-1 specification, section "Constants"
//! (<https://www.rabbitmq.com/resources/specs/amqp0-9-1.pdf>), as generated into
//! `amq_protocol::protocol::constants` and `AMQPSoftError`.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
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
        Ok(r) => r,
        Err(_) => Err(timed_out(format!("the broker did not complete the AMQP handshake within {limit:?} (connection_timeout)"))),
    }
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

/// The two AMQP connections of a session: consumers (and therefore acks and nacks) use
/// `consume`, every publish (forwarded requests, results, dead letters) uses `publish`.
///
/// RabbitMQ blocks *publishing* connections under a memory or disk alarm
/// (<https://www.rabbitmq.com/docs/connection-blocked>); a connection that only consumes and acks
/// is not blocked, so an alarm stalls publishes but never the acks of work already published
/// (acks free broker memory) nor the consumption of deliveries already on their way.
#[derive(Clone)]
pub struct Connections {
    /// Consumers and their acks.
    pub consume: Arc<Connection>,
    /// Publishes with publisher confirms.
    pub publish: Arc<Connection>,
}

impl Connections {
    /// Both connections are open.
    pub fn connected(&self) -> bool {
        self.consume.status().connected() && self.publish.status().connected()
    }

    /// A new channel on the publishing connection, in confirm mode
    /// (<https://www.rabbitmq.com/docs/confirms>).
    pub async fn publish_channel(&self) -> Result<Channel, lapin::Error> {
        confirm_channel(&self.publish).await
    }

    /// Closes both connections with `reply-success`, at once, each waiting at most
    /// [`CLOSE_TIMEOUT`] for its close-ok ([`close_connection`]); errors are returned from the
    /// first that fails.
    pub async fn close(&self, why: &str) -> Result<(), lapin::Error> {
        let (a, b) = tokio::join!(close_connection(&self.consume, why), close_connection(&self.publish, why));
        a.and(b)
    }
}

/// A new channel on `conn`, in confirm mode (<https://www.rabbitmq.com/docs/confirms>).
/// Each step waits at most [`RPC_TIMEOUT`] for the broker's answer.
pub async fn confirm_channel(conn: &Connection) -> Result<Channel, lapin::Error> {
    let ch = answered("channel.open", conn.create_channel()).await?;
    answered("confirm.select", ch.confirm_select(ConfirmSelectOptions::default())).await?;
    Ok(ch)
}

/// Confirm-mode channels on a publishing connection, each lent to one publish at a time and
/// given back when its confirm is in; opened as needed, up to `max` at once. Each partition
/// session publishes its results and dead letters through one ([`crate::partition`]).
///
/// One publish per channel at a time, for two reasons:
/// - A `basic.return` carries no delivery tag (AMQP 0-9-1,
///   <https://www.rabbitmq.com/docs/confirms#when-publishes-are-confirmed>): lapin gives a
///   returned message to whichever publisher confirm on the channel it completes next, and
///   under a `multiple` ack that can be another publish's (8 of 3,000 results went astray in a
///   test). [`crate::publisher::publish_confirmed`] now recognises such a return and places it
///   again, but with one publish in flight a return always meets its own confirm.
/// - After the broker nacks a publish, a RabbitMQ 3.10 quorum queue can drop the channel's
///   later publishes while confirming them (rabbitmq-server #14589). With one publish in flight
///   no later publish is already on the way, and the holder closes the nacked channel.
///
/// `max` channels still carry `max` publishes at once. The price: a channel with one publish in
/// flight gets one confirm frame per publish, where a busy shared channel gets one `multiple`
/// ack for many (a pool of 32 for the router's forwards cost a third of the daemon's throughput
/// on the overhead bench, so the router keeps one shared channel, replaced after a nack).
///
/// A channel found closed (the broker closed it, or the holder closed it after a nack) is
/// dropped from the pool, and [`PublishPool::lost_a_channel`] says so; the next [`take`]
/// that finds no free channel opens a new one.
///
/// [`take`]: PublishPool::take
pub struct PublishPool {
    conn: Arc<Connection>,
    free: std::sync::Mutex<Vec<Channel>>,
    /// Every channel opened and not yet found closed (for [`PublishPool::close`]).
    opened: std::sync::Mutex<Vec<Channel>>,
    /// One permit per publish that may hold a channel.
    permits: tokio::sync::Semaphore,
    lost: std::sync::atomic::AtomicBool,
}

impl PublishPool {
    /// A pool of at most `max` (≥ 1) channels on `conn`; none is opened yet.
    pub fn new(conn: Arc<Connection>, max: usize) -> PublishPool {
        PublishPool {
            conn,
            free: std::sync::Mutex::new(Vec::new()),
            opened: std::sync::Mutex::new(Vec::new()),
            permits: tokio::sync::Semaphore::new(max.max(1)),
            lost: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The publishing connection.
    pub fn connection(&self) -> &Arc<Connection> {
        &self.conn
    }

    /// A channel for one publish and its confirm: a free open one, else a new one. Waits while
    /// `max` channels are lent.
    ///
    /// Errors: opening a channel failed (the connection is closed, or `channel_max` reached).
    pub async fn take(&self) -> Result<PooledChannel<'_>, lapin::Error> {
        let permit = self.permits.acquire().await.expect("the pool's semaphore is never closed");
        loop {
            let found = lock(&self.free).pop();
            match found {
                Some(ch) if ch.status().connected() => return Ok(PooledChannel { pool: self, ch: Some(ch), _permit: permit }),
                Some(ch) => self.forget(&ch),
                None => break,
            }
        }
        let ch = confirm_channel(&self.conn).await?;
        lock(&self.opened).push(ch.clone());
        Ok(PooledChannel { pool: self, ch: Some(ch), _permit: permit })
    }

    /// Whether a channel of the pool was found closed since the pool was made.
    pub fn lost_a_channel(&self) -> bool {
        self.lost.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Closes every open channel of the pool with `reply-success`, at once, each waiting at most
    /// [`CLOSE_TIMEOUT`] for its close-ok.
    pub async fn close(&self, why: &str) {
        let channels = std::mem::take(&mut *lock(&self.opened));
        lock(&self.free).clear();
        futures_util::future::join_all(channels.iter().map(|ch| close_channel(ch, why))).await;
    }

    fn forget(&self, ch: &Channel) {
        self.lost.store(true, std::sync::atomic::Ordering::Relaxed);
        lock(&self.opened).retain(|c| c.id() != ch.id());
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A channel lent by a [`PublishPool`] (dereferences to it); given back when dropped, or
/// dropped from the pool when it is closed by then.
pub struct PooledChannel<'a> {
    pool: &'a PublishPool,
    ch: Option<Channel>,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl std::ops::Deref for PooledChannel<'_> {
    type Target = Channel;
    fn deref(&self) -> &Channel {
        self.ch.as_ref().expect("present until dropped")
    }
}

impl Drop for PooledChannel<'_> {
    fn drop(&mut self) {
        // Runs before the permit is released (fields drop after this), so a permit that finds
        // no free channel may open one.
        let Some(ch) = self.ch.take() else { return };
        if ch.status().connected() {
            lock(&self.pool.free).push(ch);
        } else {
            self.pool.forget(&ch);
        }
    }
}

/// Reads a string header (long or short string).
pub fn header_str<'a>(headers: Option<&'a FieldTable>, name: &str) -> Option<std::borrow::Cow<'a, str>> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) => Some(std::borrow::Cow::Borrowed(s.as_str())),
        _ => None,
    }
}

/// Reads an integer header.
pub fn header_u64(headers: Option<&FieldTable>, name: &str) -> Option<u64> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok(),
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

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};

    use super::*;

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

    #[test]
    fn the_next_node_follows_the_failed_one_and_wraps_around() {
        assert_eq!(next_node(0, 3), 1);
        assert_eq!(next_node(1, 3), 2);
        assert_eq!(next_node(2, 3), 0);
        assert_eq!(next_node(0, 1), 0);
    }
}
