//! Readiness: the state behind `/readyz`, owned by [`crate::app`].
//!
//! The daemon is ready when no not-ready reason holds. [`Readiness`] is a cheap handle
//! (`tokio::sync::watch` underneath): the app sets and clears [`NotReady`] reasons, `/readyz`
//! reads them, and the `ready` gauge mirrors the answer (it is never read back).

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use tokio::sync::watch;

use crate::metrics;

/// Why the daemon is not ready. The `Display` text is what `/readyz` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NotReady {
    /// Started, but the topology is not declared or the first lease round is not done yet.
    Starting,
    /// No working AMQP connection (connecting, or reconnecting after a failure).
    AmqpDown,
    /// Redis unreachable, or the membership heartbeat does not reach it.
    RedisDown,
    /// No LLM endpoint is available.
    LlmUnavailable,
    /// The broker blocked the connection (`connection.blocked`: a memory or disk alarm).
    ConnectionBlocked,
    /// Shutdown requested: draining.
    Draining,
}

impl NotReady {
    /// Short, stable label (also usable as a bounded metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            NotReady::Starting => "starting",
            NotReady::AmqpDown => "amqp down",
            NotReady::RedisDown => "redis down",
            NotReady::LlmUnavailable => "llm endpoints unavailable",
            NotReady::ConnectionBlocked => "amqp connection blocked",
            NotReady::Draining => "draining",
        }
    }
}

impl fmt::Display for NotReady {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The reasons that currently hold; empty means ready.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadyState {
    reasons: BTreeSet<NotReady>,
    /// Labels of the AMQP connections the broker currently blocks; [`NotReady::ConnectionBlocked`]
    /// holds while this is not empty.
    blocked_connections: BTreeSet<&'static str>,
}

impl ReadyState {
    /// Ready: no reason holds.
    pub fn is_ready(&self) -> bool {
        self.reasons.is_empty()
    }
    /// The reasons that hold, in a stable order.
    pub fn reasons(&self) -> impl Iterator<Item = NotReady> + '_ {
        self.reasons.iter().copied()
    }
}

impl fmt::Display for ReadyState {
    /// `ready`, or `not ready: amqp down, starting`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_ready() {
            return f.write_str("ready");
        }
        f.write_str("not ready: ")?;
        for (i, r) in self.reasons().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(r.as_str())?;
        }
        Ok(())
    }
}

/// Shared readiness handle; clones see the same state.
#[derive(Debug, Clone)]
pub struct Readiness {
    tx: Arc<watch::Sender<ReadyState>>,
}

impl Default for Readiness {
    fn default() -> Self {
        Readiness::new()
    }
}

impl Readiness {
    /// A new state with [`NotReady::Starting`] set.
    pub fn new() -> Readiness {
        let state = ReadyState { reasons: BTreeSet::from([NotReady::Starting]), blocked_connections: BTreeSet::new() };
        metrics::set_ready(false);
        Readiness { tx: Arc::new(watch::Sender::new(state)) }
    }

    /// Sets (`holds = true`) or clears a reason; the `ready` gauge follows.
    pub fn set(&self, reason: NotReady, holds: bool) {
        self.tx.send_if_modified(|s| if holds { s.reasons.insert(reason) } else { s.reasons.remove(&reason) });
        metrics::set_ready(self.tx.borrow().is_ready());
    }

    /// Records that the broker blocked (`true`) or unblocked (`false`) the AMQP connection
    /// labelled `connection` (a bounded label such as `"publish"`). [`NotReady::ConnectionBlocked`]
    /// holds while at least one connection is blocked, so one connection's unblock does not hide
    /// another's block.
    pub fn set_connection_blocked(&self, connection: &'static str, blocked: bool) {
        self.tx.send_if_modified(|s| {
            let changed = if blocked { s.blocked_connections.insert(connection) } else { s.blocked_connections.remove(connection) };
            if s.blocked_connections.is_empty() {
                s.reasons.remove(&NotReady::ConnectionBlocked);
            } else {
                s.reasons.insert(NotReady::ConnectionBlocked);
            }
            changed
        });
        metrics::set_ready(self.tx.borrow().is_ready());
    }

    /// The current state.
    pub fn state(&self) -> ReadyState {
        self.tx.borrow().clone()
    }

    /// Whether no reason holds.
    pub fn is_ready(&self) -> bool {
        self.tx.borrow().is_ready()
    }

    /// A receiver that sees every change (e.g. to wait for readiness).
    pub fn subscribe(&self) -> watch::Receiver<ReadyState> {
        self.tx.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_no_reason_holds_and_body_names_the_reasons() {
        let r = Readiness::new();
        assert!(!r.is_ready());
        assert_eq!(r.state().to_string(), "not ready: starting");
        r.set(NotReady::AmqpDown, true);
        assert_eq!(r.state().to_string(), "not ready: starting, amqp down");
        r.set(NotReady::Starting, false);
        r.set(NotReady::AmqpDown, false);
        assert!(r.clone().is_ready());
        assert_eq!(r.state().to_string(), "ready");
        r.set(NotReady::Draining, true);
        assert_eq!(r.state().reasons().collect::<Vec<_>>(), vec![NotReady::Draining]);
    }

    #[test]
    fn connection_blocked_holds_while_any_connection_is_blocked() {
        let r = Readiness::new();
        r.set(NotReady::Starting, false);
        r.set_connection_blocked("session", true);
        r.set_connection_blocked("publish", true);
        assert_eq!(r.state().to_string(), "not ready: amqp connection blocked");
        r.set_connection_blocked("session", false);
        assert!(!r.is_ready(), "the publish connection is still blocked");
        r.set_connection_blocked("publish", false);
        assert!(r.is_ready());
        r.set_connection_blocked("publish", false);
        assert!(r.is_ready(), "an unblock without a block changes nothing");
    }
}
