//! Bounds per-request warnings, so that a fault that hits every request (a flood of malformed
//! requests, a full reply queue, a broker refusing publishes) does not flood the log.
//!
//! Each kind of per-request warning has its own [`LogLimit`]: at most [`BURST`] lines per
//! [`WINDOW`] are logged at `WARN`; the others go to `DEBUG`. The next `WARN` line of the same
//! kind carries `suppressed = N`, how many went to `DEBUG` since the one before it. The counters
//! of the events (`prefix_batcher_requests_total`, `prefix_batcher_dead_letters_total`, …) count
//! every one of them either way.
//!
//! Why bound them: journald drops whole lines of a service that logs more than its
//! `RateLimitBurst` (10,000 by default) per `RateLimitIntervalSec` (30 s), the important ones
//! included (`journald.conf(5)`), and a human reads ten lines of a kind, not thousands.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Lines of one kind logged at `WARN` per [`WINDOW`].
pub const BURST: u32 = 10;
/// The window of [`BURST`].
pub const WINDOW: Duration = Duration::from_secs(60);

/// The state of one kind of warning (see the module docs). Shared by every task; a `static`.
#[derive(Debug)]
pub struct LogLimit {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Start of the current window; `None` before the first event.
    window_start: Option<Instant>,
    /// Lines logged at `WARN` in the current window.
    logged: u32,
    /// Events sent to `DEBUG` since the last `WARN` line.
    suppressed: u64,
}

impl LogLimit {
    /// A limit of [`BURST`] lines per [`WINDOW`].
    pub const fn new() -> LogLimit {
        LogLimit { state: Mutex::new(State { window_start: None, logged: 0, suppressed: 0 }) }
    }

    /// Whether this event is logged at `WARN`: `Some(n)`, with `n` the events of this kind sent
    /// to `DEBUG` since the previous `WARN` line; `None` when it goes to `DEBUG`.
    pub fn admit(&self) -> Option<u64> {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if s.window_start.is_none_or(|start| now.duration_since(start) >= WINDOW) {
            s.window_start = Some(now);
            s.logged = 0;
        }
        if s.logged < BURST {
            s.logged += 1;
            Some(std::mem::take(&mut s.suppressed))
        } else {
            s.suppressed += 1;
            None
        }
    }
}

impl Default for LogLimit {
    fn default() -> Self {
        LogLimit::new()
    }
}

/// A `tracing` event at `$level` within a [`LogLimit`]: `log_limited!(warn, LIMIT, fields…,
/// "message")` logs at that level (with `suppressed = N` when earlier events of the kind went to
/// `DEBUG`) or at `DEBUG`. [`crate::warn_limited!`], [`crate::error_limited!`] and [`crate::info_limited!`] name the level.
#[macro_export]
macro_rules! log_limited {
    ($level:ident, $limit:expr, $($arg:tt)+) => {
        match $limit.admit() {
            Some(0) => ::tracing::$level!($($arg)+),
            Some(suppressed) => ::tracing::$level!(suppressed, $($arg)+),
            None => ::tracing::debug!($($arg)+),
        }
    };
}

/// `tracing::warn!` within a [`LogLimit`] ([`log_limited!`]): per-request warnings.
#[macro_export]
macro_rules! warn_limited {
    ($limit:expr, $($arg:tt)+) => { $crate::log_limited!(warn, $limit, $($arg)+) };
}

/// `tracing::error!` within a [`LogLimit`] ([`log_limited!`]): a fault an operator must fix,
/// retried every second (refused credentials), logs at `ERROR` at most [`BURST`] times per
/// [`WINDOW`].
#[macro_export]
macro_rules! error_limited {
    ($limit:expr, $($arg:tt)+) => { $crate::log_limited!(error, $limit, $($arg)+) };
}

/// `tracing::info!` within a [`LogLimit`] ([`log_limited!`]): news that one fault repeats for
/// every batch or request.
#[macro_export]
macro_rules! info_limited {
    ($limit:expr, $($arg:tt)+) => { $crate::log_limited!(info, $limit, $($arg)+) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_per_window_then_debug_and_the_count_on_the_next_warning() {
        let limit = LogLimit::new();
        for _ in 0..BURST {
            assert_eq!(limit.admit(), Some(0));
        }
        for _ in 0..25 {
            assert_eq!(limit.admit(), None, "over the burst: DEBUG");
        }
        tokio::time::advance(WINDOW - Duration::from_millis(1)).await;
        assert_eq!(limit.admit(), None, "the window has not ended");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(limit.admit(), Some(26), "the first WARN of the next window says how many went to DEBUG");
        assert_eq!(limit.admit(), Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn kinds_are_limited_apart() {
        let (a, b) = (LogLimit::new(), LogLimit::new());
        for _ in 0..BURST {
            a.admit();
        }
        assert_eq!(a.admit(), None);
        assert_eq!(b.admit(), Some(0), "another kind still logs");
    }

    #[test]
    fn the_macro_picks_warn_or_debug() {
        static LIMIT: LogLimit = LogLimit::new();
        for i in 0..(BURST + 3) {
            crate::warn_limited!(LIMIT, attempt = i, "a per-request warning");
        }
        assert_eq!(LIMIT.admit(), None);
    }
}
