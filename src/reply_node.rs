//! Whether RabbitMQ can decode the node of a direct reply-to name, checked before a request is
//! routed.
//!
//! A direct reply-to name (`amq.rabbitmq.reply-to.{pid}.{key}`,
//! [`crate::request::DIRECT_REPLY_TO_PREFIX`]) carries the requester's Erlang pid, whose node is
//! written `{name}@{decimal hash}`. RabbitMQ 3.10 looks that hash up among the cluster's nodes when
//! a message is published to the name or the name is declared passively, and a hash of no node
//! crashes the channel (observed on 3.10.8: `{case_clause,error}` in
//! `rabbit_channel:deliver_reply/2`); RabbitMQ then closes the whole connection with
//! `INTERNAL_ERROR` (541). A request carrying such a name, which passes every check of its form
//! ([`crate::request`]), would close the daemon's publishing connection at each delivery of its
//! result: every partition of the instance restarts its session, the requests in flight are
//! answered again or charged, until `amqp.delivery_limit` dead-letters it.
//!
//! So the router asks the broker first, on a connection of its own that nothing else uses: a
//! passive `queue.declare` of the name ([`NodeCheck::check`]). An answer, `declare-ok` or 404
//! `NOT_FOUND` (the requester has gone), shows that the node decodes; the connection closed with
//! `INTERNAL_ERROR` shows that it does not, and the request is dead-lettered with
//! `invalid_field`. The crash depends on the node alone (a pid of a process that does not exist
//! on a known node is answered 404), so a verdict holds for every name of that node: checks run
//! once per node and process, one at a time so that a crash is the check's own, and cost nothing
//! once the nodes of the cluster are known. A node found undecodable is asked again after
//! [`UNDECODABLE_FOR`] (a node may join the cluster). When the broker does not answer, the
//! request is routed as before: the check protects the sessions, it does not hold up intake; the
//! requests of that node's names in the next [`UNCHECKED_FOR`] go on without a check.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::Connection;
use tokio::time::Instant;

use crate::amqp::{connect_link, Link};
use crate::config::Settings;
use crate::publisher::{direct_reply_to_present, PublishError};
use crate::request::ParseError;

/// Bounds the lines of [`NodeCheck::refusal`].
static CHECK_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// How long a node found undecodable stays so before it is asked again.
pub const UNDECODABLE_FOR: Duration = Duration::from_secs(60);

/// How long a check that got no verdict (no connection, no answer in time) stands for its node:
/// the deliveries that waited behind it, and those of the next seconds, go on at once instead
/// of each waiting as long again (a stalled broker would otherwise hold the k-th of them k
/// times `amqp.confirm_timeout`).
pub const UNCHECKED_FOR: Duration = Duration::from_secs(5);

/// Nodes remembered at most (a cluster has a few; forged names may name many more): when full, the
/// verdicts are forgotten and asked again.
const MAX_NODES: usize = 256;

/// What the broker made of a direct reply-to name's node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The broker answered a passive declare of a name of this node.
    Decodable,
    /// The broker closed the checking connection with `INTERNAL_ERROR`: the name must not reach
    /// the publishing connection.
    Undecodable,
    /// No verdict (no connection, no answer in time, another error): the request goes on.
    Unchecked(String),
}

/// The verdicts of this process, by node name (`{name}@{hash}`): `Some(true)` decodable;
/// `Some(false)` undecodable, until the instant given; `None` no verdict, until the instant given.
static VERDICTS: Mutex<Option<HashMap<String, Remembered>>> = Mutex::new(None);

/// A remembered verdict ([`VERDICTS`]) and until when it stands.
type Remembered = (Option<bool>, Instant);

fn remembered(node: &str) -> Option<Verdict> {
    let v = VERDICTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    match v.as_ref()?.get(node)? {
        (Some(true), _) => Some(Verdict::Decodable),
        (_, until) if Instant::now() >= *until => None,
        (Some(false), _) => Some(Verdict::Undecodable),
        (None, _) => Some(Verdict::Unchecked(format!("a check of this node got no verdict in the last {} s", UNCHECKED_FOR.as_secs()))),
    }
}

/// Remembers `verdict` for `node`: `Some(decodable)`, or `None` for no verdict.
fn remember(node: &str, verdict: Option<bool>) {
    let mut v = VERDICTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let map = v.get_or_insert_with(HashMap::new);
    if map.len() >= MAX_NODES && !map.contains_key(node) {
        map.clear();
    }
    let stands = if verdict.is_some() { UNDECODABLE_FOR } else { UNCHECKED_FOR };
    map.insert(node.to_owned(), (verdict, Instant::now() + stands));
}

/// The checks of one session: its own connection to the session's broker node, opened at the
/// first name of a node not known yet and opened again after a check closed it.
pub struct NodeCheck {
    settings: Arc<Settings>,
    node: usize,
    /// The checking connection; held for the whole of a check, so checks run one at a time.
    conn: tokio::sync::Mutex<Option<Connection>>,
    /// Set by [`Self::close`]: no connection is opened any more.
    closed: std::sync::atomic::AtomicBool,
}

impl NodeCheck {
    /// Checks for the session connected to node `node` (index in
    /// [`crate::config::AmqpSettings::nodes`]); connects only when a check needs it.
    pub fn new(settings: Arc<Settings>, node: usize) -> Self {
        NodeCheck { settings, node, conn: tokio::sync::Mutex::new(None), closed: Default::default() }
    }

    /// The verdict on `reply_to`'s node `node` (from [`crate::request::direct_reply_to_node`]):
    /// remembered, or asked of the broker with a passive declare of `reply_to` within
    /// `amqp.confirm_timeout`.
    pub async fn check(&self, reply_to: &str, node: &str) -> Verdict {
        if let Some(v) = remembered(node) {
            return v;
        }
        let mut conn = self.conn.lock().await;
        // Another delivery's check may have answered meanwhile.
        if let Some(v) = remembered(node) {
            return v;
        }
        let verdict = self.ask(&mut conn, reply_to).await;
        match &verdict {
            Verdict::Decodable => remember(node, Some(true)),
            Verdict::Undecodable => remember(node, Some(false)),
            // Not for a check refused because this session ended: other sessions check.
            Verdict::Unchecked(_) if self.closed.load(std::sync::atomic::Ordering::Relaxed) => {}
            Verdict::Unchecked(_) => remember(node, None),
        }
        if conn.as_ref().is_some_and(|c| !c.status().connected()) {
            *conn = None;
        }
        verdict
    }

    /// One passive declare of `name` on a disposable channel of the checking connection
    /// ([`direct_reply_to_present`], within `amqp.confirm_timeout`), which is opened first when
    /// needed (within the URL's `connection_timeout`, [`crate::amqp::connect_node`]).
    async fn ask(&self, conn: &mut Option<Connection>, name: &str) -> Verdict {
        if conn.as_ref().is_none_or(|c| !c.status().connected()) {
            if self.closed.load(std::sync::atomic::Ordering::Relaxed) {
                return Verdict::Unchecked("the session has ended".to_owned());
            }
            match connect_link(&self.settings.amqp, self.node, &self.settings.instance_name, Link::ReplyToCheck).await {
                Ok(c) => *conn = Some(c),
                Err(e) => return Verdict::Unchecked(format!("cannot connect: {e}")),
            }
        }
        let Some(c) = conn.as_ref() else { return Verdict::Unchecked("no connection".to_owned()) };
        // The requester's presence check: present or gone (404), the node decoded.
        match direct_reply_to_present(c, name, self.settings.amqp.confirm_timeout).await {
            Ok(_) => Verdict::Decodable,
            Err(PublishError::Amqp(e)) if crate::amqp::reply_code(&e) == Some(crate::amqp::INTERNAL_ERROR) => Verdict::Undecodable,
            Err(e) => Verdict::Unchecked(e.to_string()),
        }
    }

    /// Why a request whose `reply_to` is `reply_to` must be dead-lettered (`invalid_field`): its
    /// direct reply-to node is one the broker cannot decode ([`Self::check`]). `None` for any
    /// other `reply_to`, and when the check gets no verdict (logged: the request goes on).
    pub async fn refusal(&self, reply_to: Option<&str>, request_id: &str) -> Option<ParseError> {
        let reply_to = reply_to?;
        let node = crate::request::direct_reply_to_node(reply_to)?;
        match self.check(reply_to, &node).await {
            Verdict::Decodable => None,
            Verdict::Unchecked(why) => {
                crate::warn_limited!(CHECK_LOG, request_id = %request_id, node = %node, error = %why, "could not check the node of a direct reply-to name; going on with the request");
                None
            }
            Verdict::Undecodable => {
                crate::warn_limited!(CHECK_LOG, request_id = %request_id, node = %node, "a direct reply-to name names a node this cluster cannot decode; dead-lettering the request");
                Some(ParseError::InvalidField {
                    field: "reply_to",
                    detail: format!(
                        "names node {node:?}, which this RabbitMQ cluster cannot decode (it closed a connection with INTERNAL_ERROR when asked for the name): \
                         a direct reply-to name must be taken unchanged from the reply_to RabbitMQ sets on a request published with reply_to \"amq.rabbitmq.reply-to\""
                    ),
                })
            }
        }
    }

    /// Closes the checking connection, if open; later checks open none (the session has ended).
    pub async fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(c) = self.conn.lock().await.take() {
            if c.status().connected() {
                let _ = crate::amqp::close_connection(&c, "router stopped").await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decodable node is remembered for good; an undecodable one for [`UNDECODABLE_FOR`], then
    /// asked again; a check without a verdict stands for [`UNCHECKED_FOR`]. Past [`MAX_NODES`]
    /// nodes the verdicts are forgotten.
    #[tokio::test(start_paused = true)]
    async fn verdicts_are_kept_per_node_and_a_refusal_expires() {
        remember("good-unit@1", Some(true));
        remember("bad-unit@2", Some(false));
        remember("unanswered-unit@4", None);
        assert!(matches!(remembered("unanswered-unit@4"), Some(Verdict::Unchecked(_))), "the deliveries behind it go on at once");
        assert_eq!(remembered("good-unit@1"), Some(Verdict::Decodable));
        assert_eq!(remembered("bad-unit@2"), Some(Verdict::Undecodable));
        assert_eq!(remembered("unseen-unit@3"), None);
        tokio::time::advance(UNCHECKED_FOR + Duration::from_millis(1)).await;
        assert_eq!(remembered("unanswered-unit@4"), None, "asked again after UNCHECKED_FOR");
        assert_eq!(remembered("bad-unit@2"), Some(Verdict::Undecodable));
        tokio::time::advance(UNDECODABLE_FOR).await;
        assert_eq!(remembered("good-unit@1"), Some(Verdict::Decodable));
        assert_eq!(remembered("bad-unit@2"), None, "asked again after UNDECODABLE_FOR");
        for i in 0..MAX_NODES {
            remember(&format!("many-unit@{i}"), Some(false));
        }
        assert_eq!(remembered("good-unit@1"), None, "forgotten once the table was full");
    }

    /// A broker that takes the checking connection and answers nothing (a stalled node, a paused
    /// VM): the check ends without a verdict within the URL's `connection_timeout`, the request
    /// goes on, and the next requests naming that node within [`UNCHECKED_FOR`] go on without a
    /// check of their own instead of each waiting as long again.
    #[tokio::test]
    async fn a_check_without_an_answer_lets_the_requests_go_on_and_is_not_repeated() {
        use base64::Engine as _;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        // Takes connections and keeps them open, reading and writing nothing.
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                held.push(socket);
            }
        });
        let mut raw = crate::config::RawConfig::default();
        raw.amqp.url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f?connection_timeout=400");
        let check = NodeCheck::new(Arc::new(Settings::from_raw(&raw).unwrap()), 0);
        // A name of the form RabbitMQ issues, of a node no other test names.
        let node = "silent-check@4242";
        let mut pid = vec![131, 88, 119, u8::try_from(node.len()).unwrap()];
        pid.extend_from_slice(node.as_bytes());
        pid.extend_from_slice(&[0; 12]);
        let name = format!("{}{}.key", crate::request::DIRECT_REPLY_TO_PREFIX, base64::engine::general_purpose::STANDARD.encode(&pid));
        assert_eq!(crate::request::direct_reply_to_node(&name).as_deref(), Some(node));

        let started = Instant::now();
        let verdict = check.check(&name, node).await;
        let waited = started.elapsed();
        let Verdict::Unchecked(why) = &verdict else { panic!("no answer gave a verdict: {verdict:?}") };
        assert!(why.contains("connection_timeout"), "{why}");
        assert!(waited >= Duration::from_millis(400), "ended before connection_timeout: {waited:?}");
        assert!(waited < crate::amqp::DEFAULT_CONNECT_TIMEOUT, "the URL's connection_timeout was not applied: {waited:?}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);

        for i in 0..10 {
            assert!(check.refusal(Some(&name), &format!("next-{i}")).await.is_none(), "a request without a verdict was refused");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "the requests after it checked again");
        silent.abort();
    }
}
