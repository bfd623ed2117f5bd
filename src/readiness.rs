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
        let state = ReadyState { reasons: BTreeSet::from([NotReady::Starting]) };
        metrics::set_ready(false);
        Readiness { tx: Arc::new(watch::Sender::new(state)) }
    }

    /// Sets (`holds = true`) or clears a reason; the `ready` gauge follows.
    pub fn set(&self, reason: NotReady, holds: bool) {
        self.tx.send_if_modified(|s| if holds { s.reasons.insert(reason) } else { s.reasons.remove(&reason) });
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
}
