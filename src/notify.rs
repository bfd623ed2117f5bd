//! The systemd notify protocol (`sd_notify(3)`): readiness, watchdog pings and stopping, sent as
//! datagrams to the `AF_UNIX` socket that the service manager names in `$NOTIFY_SOCKET`.
//!
//! Written against `std` alone. The `sd-notify` crate (0.5) would do the sending, but it connects
//! to `$NOTIFY_SOCKET` as a file-system path and so cannot reach an abstract socket (written with
//! a leading `@`, as systemd's user managers and container managers hand out); this module
//! handles both in a few lines.
//!
//! [`Notifier`] turns the daemon's [`Lifecycle`] events into messages
//! (<https://www.freedesktop.org/software/systemd/man/latest/sd_notify.html>):
//!
//! | event | message | when |
//! | --- | --- | --- |
//! | `Ready` | `READY=1`, `STATUS=…` | topology declared and the first lease round done (again after a reconnect; a repeated `READY=1` is harmless) |
//! | `Alive` | `WATCHDOG=1` | only after `READY=1`, at most every half of `WatchdogSec` (`$WATCHDOG_USEC / 2`, the rate `sd_watchdog_enabled(3)` recommends) |
//! | `Stopping` | `STOPPING=1`, `STATUS=…` | the drain starts |
//!
//! `Alive` comes from the session loop of [`prefix_batcher::app`] once a second while the AMQP
//! connection is up ([`ALIVE_PERIOD`]). So the pings stop when the main loop hangs *or* the broker
//! connection stays down, and after `WatchdogSec` systemd restarts the service
//! (`Restart=on-failure`). Without `$NOTIFY_SOCKET` every call is a no-op.

use std::ffi::OsString;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::{Duration, Instant};

use prefix_batcher::app::Lifecycle;

/// Names the notification socket: a path, or an abstract name when it starts with `@`.
pub const ENV_NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";
/// The watchdog timeout in microseconds (systemd sets it from `WatchdogSec=`).
pub const ENV_WATCHDOG_USEC: &str = "WATCHDOG_USEC";
/// When set, the watchdog applies only to the process with this pid.
pub const ENV_WATCHDOG_PID: &str = "WATCHDOG_PID";

pub use prefix_batcher::app::ALIVE_PERIOD;

/// Why the environment does not describe a usable notify socket.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// `$NOTIFY_SOCKET` is neither an absolute path nor an `@` abstract name.
    #[error("{ENV_NOTIFY_SOCKET}={0:?} is neither an absolute path nor an abstract name starting with '@'")]
    BadSocket(String),
    /// `$WATCHDOG_USEC` is not a positive integer.
    #[error("{ENV_WATCHDOG_USEC}={0:?} is not a positive number of microseconds")]
    BadWatchdog(String),
    /// The socket could not be created or addressed.
    #[error("notify socket: {0}")]
    Io(#[source] io::Error),
}

/// Sends lifecycle notifications to the service manager; see the module docs.
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
    /// Ping period: half the watchdog timeout; `None` when the watchdog is off.
    ping_every: Option<Duration>,
    ready: bool,
    last_ping: Option<Instant>,
    /// A failed send is logged once, not once a second.
    send_failed: bool,
}

impl Notifier {
    /// A notifier that sends nothing.
    pub fn disabled() -> Notifier {
        Notifier { target: None, ping_every: None, ready: false, last_ping: None, send_failed: false }
    }

    /// Reads `$NOTIFY_SOCKET`, `$WATCHDOG_USEC` and `$WATCHDOG_PID`. A malformed value is logged
    /// and turns the notifier (or its watchdog) off; the daemon runs on.
    pub fn from_env() -> Notifier {
        let var = |k: &str| std::env::var_os(k);
        let str_var = |k: &str| std::env::var(k).ok();
        match Notifier::from_vars(var(ENV_NOTIFY_SOCKET), str_var(ENV_WATCHDOG_USEC), str_var(ENV_WATCHDOG_PID), std::process::id()) {
            Ok(n) => {
                if n.is_enabled() {
                    tracing::info!(watchdog_ping_every = ?n.ping_every(), "systemd notifications on");
                }
                if let Some(every) = n.ping_every {
                    if every < ALIVE_PERIOD {
                        tracing::warn!(
                            watchdog = ?every * 2,
                            "WatchdogSec is below 2s: the main loop reports every 1s, so pings may come late"
                        );
                    }
                }
                n
            }
            Err(e) => {
                tracing::warn!(error = %e, "systemd notifications disabled");
                Notifier::disabled()
            }
        }
    }

    /// Builds a notifier from the variables' values (`pid` is this process's id).
    ///
    /// Errors: [`NotifyError`] when a value is malformed or the socket cannot be created.
    pub fn from_vars(
        socket: Option<OsString>,
        watchdog_usec: Option<String>,
        watchdog_pid: Option<String>,
        pid: u32,
    ) -> Result<Notifier, NotifyError> {
        let Some(socket) = socket.filter(|s| !s.is_empty()) else {
            return Ok(Notifier::disabled());
        };
        let addr = socket_addr(&socket)?;
        let sock = UnixDatagram::unbound().map_err(NotifyError::Io)?;
        let watchdog_for_us = watchdog_pid.as_deref().is_none_or(|p| p.trim().parse::<u32>().ok() == Some(pid));
        let ping_every = match watchdog_usec {
            Some(u) if watchdog_for_us => match u.trim().parse::<u64>() {
                Ok(us) if us > 0 => Some(Duration::from_micros(us) / 2),
                _ => return Err(NotifyError::BadWatchdog(u)),
            },
            _ => None,
        };
        Ok(Notifier { target: Some((sock, addr)), ping_every, ready: false, last_ping: None, send_failed: false })
    }

    /// Whether `$NOTIFY_SOCKET` was set (and valid).
    pub fn is_enabled(&self) -> bool {
        self.target.is_some()
    }

    /// The watchdog ping period (half of `WatchdogSec`), when the watchdog is on.
    pub fn ping_every(&self) -> Option<Duration> {
        self.ping_every
    }

    /// Handles one lifecycle event (called from the daemon's session loop).
    pub fn event(&mut self, e: Lifecycle) {
        self.event_at(e, Instant::now());
    }

    fn event_at(&mut self, e: Lifecycle, now: Instant) {
        if self.target.is_none() {
            return;
        }
        match e {
            Lifecycle::Ready => {
                self.ready = true;
                self.send("READY=1\nSTATUS=ready: consuming owned partitions\n");
            }
            Lifecycle::Alive => {
                if self.ping_due(now) {
                    self.last_ping = Some(now);
                    self.send("WATCHDOG=1\n");
                }
            }
            Lifecycle::Stopping => {
                self.ready = false;
                self.send("STOPPING=1\nSTATUS=draining: flushing batches and releasing leases\n");
            }
        }
    }

    /// A ping is due after READY once `ping_every` has (almost) passed since the last one: half
    /// an [`ALIVE_PERIOD`] of slack absorbs the jitter of the 1 s tick, so a 15 s period pings
    /// every 15 ticks rather than every 16.
    fn ping_due(&self, now: Instant) -> bool {
        let Some(every) = self.ping_every else { return false };
        if !self.ready {
            return false;
        }
        match self.last_ping {
            None => true,
            Some(last) => now.saturating_duration_since(last) + ALIVE_PERIOD / 2 >= every,
        }
    }

    fn send(&mut self, msg: &str) {
        let Some((sock, addr)) = &self.target else { return };
        match sock.send_to_addr(msg.as_bytes(), addr) {
            Ok(_) => self.send_failed = false,
            Err(e) => {
                if !self.send_failed {
                    tracing::warn!(error = %e, "cannot send a notification to the service manager");
                }
                self.send_failed = true;
            }
        }
    }
}

/// The socket address `$NOTIFY_SOCKET` names: `/path` or `@abstract-name`.
fn socket_addr(v: &std::ffi::OsStr) -> Result<SocketAddr, NotifyError> {
    let bytes = v.as_bytes();
    match bytes.first() {
        Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..]).map_err(NotifyError::Io),
        Some(b'/') => SocketAddr::from_pathname(v).map_err(NotifyError::Io),
        _ => Err(NotifyError::BadSocket(v.to_string_lossy().into_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv_all(sock: &UnixDatagram) -> Vec<String> {
        sock.set_nonblocking(true).unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = sock.recv(&mut buf) {
            out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        out
    }

    fn abstract_pair(usec: Option<&str>) -> (UnixDatagram, Notifier) {
        let name = format!("pb-notify-test-{}", uuid::Uuid::new_v4().simple());
        let server = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        let n = Notifier::from_vars(Some(format!("@{name}").into()), usec.map(str::to_owned), None, 1).unwrap();
        (server, n)
    }

    #[test]
    fn no_socket_means_no_op() {
        let mut n = Notifier::from_vars(None, Some("2000000".into()), None, 1).unwrap();
        assert!(!n.is_enabled());
        n.event(Lifecycle::Ready); // must not panic or block
        assert!(!Notifier::from_vars(Some("".into()), None, None, 1).unwrap().is_enabled());
    }

    #[test]
    fn malformed_values_are_errors() {
        assert!(matches!(Notifier::from_vars(Some("relative/path".into()), None, None, 1), Err(NotifyError::BadSocket(_))));
        assert!(matches!(Notifier::from_vars(Some("@x".into()), Some("soon".into()), None, 1), Err(NotifyError::BadWatchdog(_))));
        assert!(matches!(Notifier::from_vars(Some("@x".into()), Some("0".into()), None, 1), Err(NotifyError::BadWatchdog(_))));
    }

    #[test]
    fn watchdog_is_half_the_timeout_and_only_for_our_pid() {
        let n = Notifier::from_vars(Some("@x".into()), Some("30000000".into()), None, 7).unwrap();
        assert_eq!(n.ping_every(), Some(Duration::from_secs(15)));
        let n = Notifier::from_vars(Some("@x".into()), Some("30000000".into()), Some("7".into()), 7).unwrap();
        assert_eq!(n.ping_every(), Some(Duration::from_secs(15)));
        let n = Notifier::from_vars(Some("@x".into()), Some("30000000".into()), Some("8".into()), 7).unwrap();
        assert_eq!(n.ping_every(), None, "WATCHDOG_PID names another process");
        let n = Notifier::from_vars(Some("@x".into()), None, None, 7).unwrap();
        assert_eq!(n.ping_every(), None);
    }

    #[test]
    fn abstract_socket_gets_ready_pings_and_stopping_in_order() {
        let (server, mut n) = abstract_pair(Some("2000000"));
        let t0 = Instant::now();
        n.event_at(Lifecycle::Alive, t0); // before READY: no ping
        n.event_at(Lifecycle::Ready, t0);
        for i in 0..4 {
            n.event_at(Lifecycle::Alive, t0 + ALIVE_PERIOD * i);
        }
        n.event_at(Lifecycle::Stopping, t0 + ALIVE_PERIOD * 4);
        let got = recv_all(&server);
        assert!(got[0].starts_with("READY=1\n"), "{got:?}");
        assert_eq!(got[1..5], ["WATCHDOG=1\n"; 4], "a 2 s watchdog is pinged on every 1 s tick: {got:?}");
        assert!(got[5].starts_with("STOPPING=1\n"), "{got:?}");
        assert_eq!(got.len(), 6);
    }

    #[test]
    fn pings_follow_half_the_watchdog_despite_tick_jitter() {
        let (server, mut n) = abstract_pair(Some("30000000"));
        let t0 = Instant::now();
        n.event_at(Lifecycle::Ready, t0);
        // 61 ticks, each a little early (the jitter of a 1 s interval).
        for i in 0..=60u32 {
            n.event_at(Lifecycle::Alive, t0 + ALIVE_PERIOD * i - Duration::from_millis(if i > 0 { 3 } else { 0 }));
        }
        let pings = recv_all(&server).iter().filter(|m| m.as_str() == "WATCHDOG=1\n").count();
        assert_eq!(pings, 5, "ticks 0, 15, 30, 45, 60 ping");
    }

    #[test]
    fn path_socket_works_and_a_vanished_socket_is_not_fatal() {
        let dir = std::env::temp_dir().join(format!("pb-notify-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        let mut n = Notifier::from_vars(Some(path.clone().into_os_string()), None, None, 1).unwrap();
        n.event(Lifecycle::Ready);
        n.event(Lifecycle::Alive); // no watchdog configured: no ping
        assert_eq!(recv_all(&server).len(), 1);
        drop(server);
        std::fs::remove_dir_all(&dir).unwrap();
        n.event(Lifecycle::Stopping); // logged once, not a panic
        assert!(n.send_failed);
    }
}
