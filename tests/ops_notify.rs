//! The systemd notify protocol of the real binary, through a `NOTIFY_SOCKET` this test creates
//! (as systemd would for `Type=notify` with `WatchdogSec=2s`): `READY=1` once the daemon is ready
//! (member key written, `/readyz` 200), then `WATCHDOG=1` about every second (half the watchdog
//! timeout), then `STOPPING=1` after SIGTERM, in that order, and exit 0.

mod common;

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use common::*;
use llm_fakes::fake::FakeLlm;

/// One notification with its arrival time.
#[derive(Debug)]
struct Note {
    at: Instant,
    text: String,
}

/// Receives notifications until `done(all so far)` holds or `within` passes (then panics with
/// what arrived and the daemon's log).
fn recv_until(sock: &UnixDatagram, notes: &mut Vec<Note>, within: Duration, daemon: &DaemonProcess, what: &str, done: impl Fn(&[Note]) -> bool) {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    while !done(notes) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "timed out waiting for {what}; got {notes:?}; daemon log:\n{}", daemon.log_tail(30));
        sock.set_read_timeout(Some(left.min(Duration::from_millis(500)))).unwrap();
        match sock.recv(&mut buf) {
            Ok(n) => notes.push(Note { at: Instant::now(), text: String::from_utf8_lossy(&buf[..n]).into_owned() }),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => panic!("recv on the notify socket: {e}"),
        }
    }
}

fn count(notes: &[Note], line: &str) -> usize {
    notes.iter().filter(|n| n.text.lines().any(|l| l == line)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_then_watchdog_pings_then_stopping() {
    let env = TestEnv::new("notify");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let mut redis = RedisProbe::connect().await.unwrap();
    let sock_path = env.dir.join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).expect("bind the notify socket");
    let cfg = write_config(&env, "notify", &raw);
    let mut cmd = bin_command();
    cmd.arg("--config").arg(&cfg).arg("run").env("NOTIFY_SOCKET", &sock_path).env("WATCHDOG_USEC", "2000000");
    let mut daemon = DaemonProcess::spawn(&env, "notify", cmd);

    let mut notes = Vec::new();
    recv_until(&sock, &mut notes, DEADLINE, &daemon, "READY=1", |n| count(n, "READY=1") > 0);
    assert!(notes[0].text.lines().any(|l| l == "READY=1"), "the first notification must be READY=1: {notes:?}");
    assert!(notes[0].text.contains("STATUS="), "READY comes with a STATUS= line: {:?}", notes[0].text);
    // Ready means ready: the member key is written and /readyz answers 200.
    let members = redis.keys(&format!("{}:member:*", env.key_prefix())).await;
    assert_eq!(members, vec![format!("{}:member:{}", env.key_prefix(), raw.instance.name)], "member key at READY");
    assert_eq!(http_get(&daemon.http_addr().await, "/readyz").await.0, 200, "/readyz at READY");

    // WATCHDOG_USEC = 2 s: a ping every second (half of it), from the main loop.
    recv_until(&sock, &mut notes, Duration::from_secs(10), &daemon, "three WATCHDOG=1", |n| count(n, "WATCHDOG=1") >= 3);
    let pings: Vec<Instant> = notes.iter().filter(|n| n.text == "WATCHDOG=1\n").map(|n| n.at).collect();
    for w in pings.windows(2) {
        let gap = w[1] - w[0];
        // About 1 s; a stall of the loaded machine delays one and brings the next closer, but
        // 2 s apart would have systemd kill the service.
        assert!(gap >= Duration::from_millis(250) && gap < Duration::from_millis(1900), "pings {gap:?} apart; want about 1 s (half of WatchdogSec=2s)");
    }

    daemon.sigterm();
    recv_until(&sock, &mut notes, Duration::from_secs(20), &daemon, "STOPPING=1", |n| count(n, "STOPPING=1") > 0);
    let status = daemon.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(0), "SIGTERM must exit 0; log:\n{}", daemon.log_tail(30));

    // The order: READY, then only pings, then STOPPING last.
    let kinds: Vec<&str> = notes
        .iter()
        .map(|n| n.text.lines().next().unwrap_or_default())
        .map(|l| l.split('=').next().unwrap())
        .collect();
    let stop_at = kinds.iter().position(|k| *k == "STOPPING").unwrap();
    assert_eq!(kinds[0], "READY", "{kinds:?}");
    assert!(kinds[1..stop_at].iter().all(|k| *k == "WATCHDOG"), "between READY and STOPPING only pings: {kinds:?}");
    assert!(stop_at >= 4, "at least three pings before STOPPING: {kinds:?}");
    // Anything after STOPPING (there should be nothing) would come within this short wait.
    sock.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let mut buf = [0u8; 512];
    assert!(sock.recv(&mut buf).is_err(), "nothing may follow STOPPING=1");
    // The pretty format (the default) is human text, not JSON.
    let log = daemon.log();
    assert!(log.contains(" INFO ") && log.contains("ready") && !log.trim_start().starts_with('{'), "pretty log:\n{log}");
    println!("notify: {kinds:?}");
    env.cleanup().await;
}

/// An abstract `NOTIFY_SOCKET` (`@name`, as systemd's user and container managers hand out) works
/// too; without `WATCHDOG_USEC` there are no pings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abstract_notify_socket_without_watchdog() {
    use std::os::linux::net::SocketAddrExt;
    let env = TestEnv::new("notifyabs");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let name = format!("pbt-notify-{}", uuid::Uuid::new_v4().simple());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let sock = UnixDatagram::bind_addr(&addr).expect("bind the abstract notify socket");
    let cfg = write_config(&env, "notifyabs", &raw);
    let mut cmd = bin_command();
    cmd.arg("--config").arg(&cfg).arg("run").env("NOTIFY_SOCKET", format!("@{name}")).env_remove("WATCHDOG_USEC");
    let mut daemon = DaemonProcess::spawn(&env, "notifyabs", cmd);
    let mut notes = Vec::new();
    recv_until(&sock, &mut notes, DEADLINE, &daemon, "READY=1", |n| count(n, "READY=1") > 0);
    // Two seconds of a healthy main loop: no pings without a watchdog.
    let t = Instant::now();
    recv_until(&sock, &mut notes, Duration::from_secs(3), &daemon, "two quiet seconds", |_| t.elapsed() >= Duration::from_secs(2));
    assert_eq!(count(&notes, "WATCHDOG=1"), 0, "{notes:?}");
    daemon.sigterm();
    recv_until(&sock, &mut notes, Duration::from_secs(20), &daemon, "STOPPING=1", |n| count(n, "STOPPING=1") > 0);
    assert_eq!(daemon.wait_exit(DEADLINE).await.code(), Some(0));
    env.cleanup().await;
}
