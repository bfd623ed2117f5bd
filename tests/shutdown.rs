//! Shutdown outcomes of the in-process daemon (`app::run_with_events`): a drain cut short by a
//! connection failure is an error (exit 1), never a clean stop (exit 0).

mod common;

use std::time::Duration;

use common::*;
use prefix_batcher::app::{self, AppError, Lifecycle};
use prefix_batcher::config::Settings;
use prefix_batcher::exit;
use llm_fakes::fake::FakeLlm;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// Waits (≤ [`DEADLINE`]) until `/readyz` at `addr` answers `want`; returns its body. Panics
/// with the last answer, naming `what` was awaited.
async fn readyz_answers(addr: String, want: u16, what: &'static str) -> String {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (status, body) = http_get(&addr, "/readyz").await;
        if status == want {
            return body;
        }
        assert!(Instant::now() < deadline, "/readyz never answered {want} ({what}); last {status} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The drain starts with LLM calls in flight (5 s each); the broker then closes the daemon's
/// connection. The daemon must report the cut-short drain as an error with exit code 1, not
/// stop with `Ok` (exit 0) as if every request had been finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_failure_during_the_drain_is_an_error() {
    let env = TestEnv::new("drainfail");
    let fake = FakeLlm::new().latency(Duration::from_secs(5)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.shutdown.drain_timeout = "30s".into();
    let instance = raw.instance.name.clone();
    let settings = Settings::from_raw(&raw).unwrap();

    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (events_tx, mut events) = mpsc::unbounded_channel::<Lifecycle>();
    let daemon = tokio::spawn(app::run_with_events(
        settings,
        async move {
            let _ = stop_rx.await;
        },
        move |e| {
            let _ = events_tx.send(e);
        },
    ));
    let mut redis = RedisProbe::connect().await.unwrap();
    redis.wait_all_held_by(env.key_prefix(), PARTITIONS, &instance).await;

    let amqp = Amqp::connect().await;
    let reply = format!("{}.reply", env.name);
    let results = amqp.reply_queue(&reply).await;
    let reqs = completions_workload("drainfail", 16, 4);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    tokio::time::timeout(DEADLINE, fake.wait_for_calls(1)).await.expect("an LLM call starts");

    stop_tx.send(()).unwrap();
    let stopping = tokio::time::timeout(DEADLINE, async {
        while let Some(e) = events.recv().await {
            if e == Lifecycle::Stopping {
                return true;
            }
        }
        false
    });
    assert!(stopping.await.expect("the drain starts"), "the daemon ended without draining");
    assert!(!daemon.is_finished(), "the drain finished before the connection could be broken; the test proves nothing");
    broker::close_connection_named(&format!("prefix-batcher {instance}")).await;

    let outcome = tokio::time::timeout(DEADLINE, daemon).await.expect("the daemon stops").expect("no panic");
    match outcome {
        Err(e @ AppError::DrainFailed(_)) => assert_eq!(e.exit_code(), exit::EX_FAILURE, "{e}"),
        other => panic!("a drain cut short by a connection failure must be AppError::DrainFailed, got {other:?}"),
    }

    results.close().await;
    amqp.close().await;
    fake.shutdown();
    env.cleanup().await;
}

/// A TCP server that accepts connections and never sends a byte (a wrong port, a hung broker):
/// its address, and the number of connections it has accepted so far.
async fn silent_server() -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(socket);
        }
    });
    (addr, accepted)
}

/// A broker that accepts TCP and never speaks AMQP: each opening gives up after the URL's
/// `connection_timeout` and the daemon tries again (before, the first opening waited forever,
/// without a log line); and a SIGTERM while an opening waits (here with the 30 s default) stops
/// the daemon at once instead of being ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_never_answers_times_out_and_a_shutdown_still_stops_the_daemon() {
    use std::sync::atomic::Ordering;
    let env = TestEnv::new("silentbroker");
    let (addr, accepted) = silent_server().await;

    let mut raw = env.raw_config("http://127.0.0.1:9");
    raw.amqp.url = format!("amqp://guest:guest@{addr}/%2f?connection_timeout=300");
    raw.amqp.reconnect_backoff_initial = "50ms".into();
    raw.amqp.reconnect_backoff_max = "100ms".into();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let daemon = tokio::spawn(app::run(Settings::from_raw(&raw).unwrap(), async move {
        let _ = stop_rx.await;
    }));
    let deadline = Instant::now() + DEADLINE;
    while accepted.load(Ordering::SeqCst) < 3 {
        assert!(Instant::now() < deadline, "the daemon never gave up an opening: {} connections", accepted.load(Ordering::SeqCst));
        assert!(!daemon.is_finished(), "the daemon stopped by itself");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(()).unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(5), daemon).await.expect("stops within 5 s of the shutdown").expect("no panic");
    assert!(outcome.is_ok(), "a shutdown while no session runs is a clean stop: {outcome:?}");

    // The default limit (30 s): the shutdown arrives while the opening waits.
    let (addr, accepted) = silent_server().await;
    raw.amqp.url = format!("amqp://guest:guest@{addr}/%2f");
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let daemon = tokio::spawn(app::run(Settings::from_raw(&raw).unwrap(), async move {
        let _ = stop_rx.await;
    }));
    let deadline = Instant::now() + DEADLINE;
    while accepted.load(Ordering::SeqCst) < 1 {
        assert!(Instant::now() < deadline, "the daemon never connected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopped_at = Instant::now();
    stop_tx.send(()).unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(5), daemon).await.expect("stops within 5 s of the shutdown, not after the 30 s opening limit").expect("no panic");
    assert!(outcome.is_ok(), "{outcome:?}");
    assert!(stopped_at.elapsed() < Duration::from_secs(5));
    env.cleanup().await;
}

/// After the broker closes the daemon's connection, the daemon reconnects and `/readyz` says
/// ready again. It used to stay at 503 `not ready: amqp down` for good: only the first start
/// cleared that reason, so a load balancer or a readiness probe took a working instance out of
/// service after any reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_comes_back_after_a_reconnect() {
    let env = TestEnv::new("readyagain");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let mut daemon = DaemonProcess::run(&env, "ready", &raw);
    let addr = daemon.http_addr().await;
    let wait_for = |want: u16, what: &'static str| readyz_answers(addr.clone(), want, what);
    wait_for(200, "after the start").await;
    broker::close_connection_named(&format!("prefix-batcher {}", raw.instance.name)).await;
    let ended = daemon.wait_log_line("session ended; reconnecting", DEADLINE, "the end of the session whose connection was closed").await;
    wait_for(200, "after the reconnect").await;
    assert!(daemon.log().contains("ready again"), "{}", daemon.log_tail(30));
    // The line says what the broker said: its reply code and text.
    assert!(ended.contains("CONNECTION_FORCED"), "the session-ended line does not say why: {ended}");
    daemon.sigterm();
    let status = daemon.wait_exit(DEADLINE).await;
    assert!(status.success(), "SIGTERM must exit 0, got {status}; log:\n{}", daemon.log_tail(40));
    fake.shutdown();
    env.cleanup().await;
}

/// Someone deletes a queue of the running daemon and declares it again with other arguments (the
/// dead-letter queue, as a classic queue), and the next reconnect meets the broker's refusal.
/// Every instance of a deployment meets it at its next reconnect, and it used to end each one
/// with exit 78, which the service manager does not restart: the whole deployment stayed down
/// until someone restarted it. Now the running daemon retries (not ready, an ERROR line naming
/// the queue) and serves again, without a restart, once the queue is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_changed_under_the_running_daemon_is_retried_not_an_exit() {
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    let env = TestEnv::new("qchanged");
    let fake = FakeLlm::new().start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.reconnect_backoff_max = "1s".into();
    let mut daemon = DaemonProcess::run(&env, "qchanged", &raw);
    let addr = daemon.http_addr().await;
    let wait_for = |want: u16, what: &'static str| readyz_answers(addr.clone(), want, what);
    wait_for(200, "after the start").await;

    let amqp = Amqp::connect().await;
    let dlq = env.dead_letter_queue();
    amqp.ch.queue_delete(dlq.as_str().into(), QueueDeleteOptions::default()).await.expect("delete the dead-letter queue");
    let classic = QueueDeclareOptions { durable: true, ..Default::default() };
    amqp.ch.queue_declare(dlq.as_str().into(), classic, lapin::types::FieldTable::default()).await.expect("declare it as a classic queue");
    broker::close_connection_named(&format!("prefix-batcher {}", raw.instance.name)).await;
    let deadline = Instant::now() + DEADLINE;
    while daemon.log().matches("no longer match the configuration").count() < 2 {
        assert!(daemon.is_running(), "the daemon exited on a queue changed under it:\n{}", daemon.log_tail(30));
        assert!(Instant::now() < deadline, "the changed queue was not reported twice:\n{}", daemon.log_tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(daemon.log().contains(&dlq), "the ERROR line names the queue:\n{}", daemon.log_tail(10));
    wait_for(503, "while the queue does not match").await;

    amqp.ch.queue_delete(dlq.as_str().into(), QueueDeleteOptions::default()).await.expect("delete the classic queue");
    wait_for(200, "once the queue is gone and declared again by the daemon").await;
    let mut results = amqp.consume(&env.results_queue()).await;
    let reqs = completions_workload("qchanged", 5, 1);
    amqp.publish_requests(&env.input_queue(), &reqs, "").await;
    results.until_all(&ids(&reqs), DEADLINE).await;
    daemon.sigterm();
    let status = daemon.wait_exit(DEADLINE).await;
    assert!(status.success(), "SIGTERM must exit 0, got {status}; log:\n{}", daemon.log_tail(40));
    results.close().await;
    amqp.close().await;
    fake.shutdown();
    env.cleanup().await;
}

/// The broker closes the daemon's publishing connection under load, with requests still
/// arriving: the session ends and reconnects, and every request still gets an ok result, none
/// dead-lettered (with `amqp.delivery_limit = 3`, a requeue loop would show at once; a request
/// whose result was in flight at the close is charged one delivery).
///
/// What it guards: under load, the router was seen to keep consuming after its publishing
/// connection had failed with a hard error (`INTERNAL_ERROR`, from a partition queue deleted
/// under a publish), requeue each input delivery at once (489 requeues in 222 ms), and so
/// dead-letter valid requests with `delivery_limit`. Now a delivery that finds no publishing
/// channel is held for the requeue backoff, and the session checks both connections every
/// second. This test closes the connection with `rabbitmqctl close_connection`, which the old
/// code also survived here (2 runs of 2): the hard-error race itself is not reproduced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_publishing_connection_ends_the_session_and_loses_nothing() {
    let env = TestEnv::new("pubclosed");
    let fake = FakeLlm::new().latency(Duration::from_millis(50)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    // Two deliveries per request: a requeue loop (a charge at every requeue) shows at once,
    // while a request whose result was in flight when the connection closed is charged its one
    // delivery (its result was not confirmed; it is requeued once) and still gets its result.
    // (Each partition used to consume again on the still-open consuming connection after the
    // publishing one closed, so the session's end a moment later returned the same requests a
    // second time: with 2, a request was dead-lettered in 1 of 3 runs.)
    raw.amqp.delivery_limit = 2;
    let Started { amqp, daemon, mut results, reply } = start_with_replies(&env, &raw).await;
    let reqs = completions_workload("pubclosed", 600, 8);
    amqp.publish_requests(&env.input_queue(), &reqs[..100], &reply).await;
    results.until("50 results before the close", DEADLINE, |r| r.len() >= 50).await;
    // The rest arrive while the connection is closed and the session comes back: the router
    // has input deliveries to handle then.
    let (input, rest, to) = (env.input_queue(), reqs[100..].to_vec(), reply.clone());
    let feeder = tokio::spawn(async move {
        let feed = Amqp::connect().await;
        for chunk in rest.chunks(20) {
            feed.publish_requests(&input, chunk, &to).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        feed.close().await;
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    broker::close_connection_named(&format!("prefix-batcher {} publish", raw.instance.name)).await;
    feeder.await.expect("the feeder publishes");
    let dead_letters = amqp.consume(&env.dead_letter_queue()).await;
    results.until_all(&ids(&reqs), DEADLINE).await;
    results.barrier(&amqp).await;
    let by_id = results.by_correlation();
    let failed: Vec<&str> = reqs.iter().filter(|r| !by_id[&r.id].iter().any(|m| m.result().ok)).map(|r| r.id.as_str()).collect();
    assert!(failed.is_empty(), "requests without an ok result: {failed:?}");
    let mut dead_letters = dead_letters;
    dead_letters.collect_for(Duration::from_millis(300)).await;
    assert!(dead_letters.received.is_empty(), "{} requests were dead-lettered (their deliveries used up while the publishing connection was down), e.g. {:?}", dead_letters.received.len(), dead_letters.received[0].headers);
    let duplicates: usize = by_id.values().map(|v| v.len() - 1).sum();
    println!("publishing connection closed under load: {} requests, {duplicates} duplicate results", reqs.len());
    daemon.stop().await.expect("daemon stops cleanly");
    dead_letters.close().await;
    results.close().await;
    amqp.close().await;
    fake.shutdown();
    env.cleanup().await;
}

/// The intake connection closed from the broker's side (an operator's `close_connection`, a
/// load balancer's idle cut, a network fault on that one socket): the router opens it again and
/// consumes again, the consuming and publishing connections (and so the partitions and their
/// leases) stay, and requests published afterwards are served. Nothing else watches the intake
/// connection, so the router must notice it itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intake_connection_closed_by_the_broker_is_opened_again_without_a_session_restart() {
    let fake = FakeLlm::new().start().await.unwrap();
    let env = TestEnv::new("intakeclosed");
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.reconnect_backoff_max = "1s".into();
    let mut started = start_with_replies(&env, &raw).await;
    let pid = |suffix: &str| broker::daemon_connection_pid(&raw.instance.name, suffix);
    let (consume, publish, intake) = (pid(""), pid(" publish"), pid(" intake"));
    let lost_before = counter("input_consumer_failures_total", "reason", "connection_lost");
    let input = env.input_queue();
    let reply = started.reply.clone();

    let first = completions_workload("intakeclosed-first", 10, 2);
    started.amqp.publish_requests(&input, &first, &reply).await;
    started.results.until_all(&ids(&first), DEADLINE).await;
    let intake_name = format!("prefix-batcher {} intake", raw.instance.name);
    broker::close_connection_named(&intake_name).await;
    let deadline = Instant::now() + DEADLINE;
    while broker::connection_pid(&intake_name).is_none_or(|p| p == intake) {
        assert!(Instant::now() < deadline, "the intake connection was not opened again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let later = completions_workload("intakeclosed-later", 20, 2);
    started.amqp.publish_requests(&input, &later, &reply).await;
    started.results.until_all(&ids(&later), DEADLINE).await;

    assert!(counter("input_consumer_failures_total", "reason", "connection_lost") > lost_before, "the lost intake connection was not counted");
    assert_eq!((pid(""), pid(" publish")), (consume, publish), "the consuming or publishing connection changed: the session restarted");
    stop_with_input_empty(started, env).await;
}

/// Reported: at a graceful stop, the deliveries the broker had sent to the router's consumer
/// before its cancel took effect, not handed on yet, were returned by the channel's close, each
/// charged a delivery: every rolling restart under a backlog used up one of
/// `amqp.delivery_limit` deliveries of some requests. They are forwarded now, like the others.
/// The same for the partitions' consumers: none of the requests left in any queue is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_under_a_backlog_charges_no_input_delivery() {
    let fake = FakeLlm::new().start().await.unwrap();
    let env = TestEnv::new("stop-intake");
    let raw = env.raw_config(fake.url.as_str());
    let Started { amqp, daemon, results, .. } = start_with_replies(&env, &raw).await;
    let reqs = completions_workload("stopintake", 6_000, 16);
    let publisher = common::cluster::PacedPublisher::start(env.input_queue(), reqs, 3_000);
    publisher.wait_published(1_500, DEADLINE).await;
    daemon.stop().await.expect("daemon stops cleanly");
    publisher.finish(DEADLINE).await;
    let queues: Vec<String> = std::iter::once(env.input_queue()).chain((0..PARTITIONS).map(|p| env.partition_queue(p))).collect();
    let mut charged = Vec::new();
    for queue in &queues {
        let depth = amqp.queue_depth(queue).await.0 as usize;
        let mut left = amqp.consume(queue).await;
        left.until(&format!("the {depth} messages left in {queue}"), DEADLINE, |r| r.len() >= depth).await;
        let n = left.received.iter().filter(|m| m.header("x-delivery-count").is_some_and(|n| n != "0")).count();
        charged.push((queue.as_str(), depth, n));
        left.close().await;
    }
    eprintln!("requests left after the stop, and how many of them were charged a delivery: {charged:?}");
    assert!(charged.iter().all(|(_, _, n)| *n == 0), "requests charged a delivery by the stop: {charged:?}");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}
