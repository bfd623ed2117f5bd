//! Returned messages (`basic.return`) against the real RabbitMQ and Redis, with a daemon running
//! in this process and the fake LLM. In its own test binary: it publishes thousands of results
//! that count in the process-wide `reply_to_refused_total`, which other tests read.

mod common;

use std::time::Duration;

use common::*;
use llm_fakes::fake::FakeLlm;

/// Results for a `reply_to` queue that does not exist go to the results queue, each exactly
/// once. RabbitMQ's `basic.return` carries no delivery tag, and lapin gives a return to
/// whichever publisher confirm it completes next: with several results of a partition in flight
/// on one channel and a `multiple` ack, the return of one result went to its neighbour's confirm.
/// The neighbour was then published to the results queue a second time, and the returned one
/// was taken as delivered and acked: a new-user test lost 8 of 3,000 results and duplicated 8;
/// this test, before the fix, lost 6 and 1 of 3,000 in two runs. Now every return is compared
/// with what the channel's waiting publishes sent and reported to its own publish
/// ([`prefix_batcher::publisher::publish_confirmed`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_for_a_missing_reply_queue_reach_the_results_queue_exactly_once() {
    let fake = FakeLlm::new().start().await.unwrap();
    let env = TestEnv::new("noreply");
    let raw = env.raw_config(fake.url.as_str());
    let started = start_with_replies(&env, &raw).await;
    let n = 3000;
    let missing = format!("{}.never-declared", env.name);
    let reqs = completions_workload("noreply", n, 64);
    started.amqp.publish_requests(&env.input_queue(), &reqs, &missing).await;
    let mut results = started.amqp.consume(&env.results_queue()).await;
    results.until("every result in the results queue", DEADLINE, |r| r.len() >= n).await;
    results.collect_for(Duration::from_millis(500)).await;
    let by_id = results.by_correlation();
    let all = ids(&reqs);
    let lost: Vec<&String> = all.iter().filter(|id| !by_id.contains_key(*id)).collect();
    let twice: Vec<&String> = by_id.iter().filter(|(_, v)| v.len() > 1).map(|(k, _)| k).collect();
    assert!(lost.is_empty() && twice.is_empty(), "lost {lost:?}, more than once {twice:?}");
    assert!(results.received.iter().all(|m| m.header("x-reply-to-refused") == Some("unroutable")), "every result says why");
    started.daemon.stop().await.expect("daemon stops cleanly");
    assert_eq!(started.amqp.queue_depth(&env.input_queue()).await.0, 0, "input queue not empty");
    for p in 0..PARTITIONS {
        assert_eq!(started.amqp.queue_depth(&env.partition_queue(p)).await.0, 0, "partition {p} not empty");
    }
    results.close().await;
    started.results.close().await;
    started.amqp.close().await;
    env.cleanup().await;
}

/// Many forwards in flight on one shared confirm channel (as the router publishes), half of them
/// to a partition whose binding is missing (returned), half to a bound partition queue. A
/// `basic.return` names no delivery tag, and under a `multiple` ack lapin may hand it to another
/// publish's confirm: before the fix, that publish was reported unroutable (its message was
/// delivered, and would be forwarded twice) and the returned message's own publisher was told
/// it was delivered (its request acked: lost). Then the publish that received another's return
/// placed it again in the input queue itself, and a placement that failed three times lost it,
/// its own publisher having been told it was delivered. Now the channel's confirm collector
/// hands every return to its own publish while that one still waits for its outcome: with no
/// publish given up, each returned forward is reported to its own publisher, none is placed
/// again, and no delivered one is reported returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_return_on_a_shared_channel_reaches_its_own_publisher_or_is_placed_again() {
    let out = shared_channel_returns("sharedret", "10s", "10s").await;
    assert_eq!(out.timed_out, 0, "no confirm should take 10 s here");
    assert_eq!(out.after_failed, 0, "no publish failed, so none follows a failed one");
    assert_eq!(out.placed_twice, 0, "without timeouts nothing is placed twice");
    assert_eq!(out.placed, 0, "a return reached a publish other than its own and was placed again, its own publish told delivered");
    eprintln!("2000 forwards: {} returns met their own confirm, {} were placed again by another publish", out.returned, out.placed);
}

/// The same with a confirm timeout so short (5 ms) for the forwards to the bound partition that
/// they give up on their confirm. A confirm that comes after its publish gave up may still
/// carry another publish's return: the channel's confirm collector keeps waiting for it and
/// hands that return to its own publish (or places it again when that one gave up too),
/// instead of leaving it with lapin (lost, since its own publisher was told it was delivered).
/// With the confirm dropped on a timeout, this test failed 4 runs of 4 (20 ms); with only the
/// confirm (not the send) handed to a task, 2 of 3 (5 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_on_a_confirm_that_came_too_late_is_placed_again() {
    let out = shared_channel_returns("lateret", "10s", "5ms").await;
    assert!(out.timed_out > 0, "no publish timed out; the test proves nothing");
    eprintln!(
        "2000 forwards: {} timed out, {} after a failed one, {} returns met their own confirm, {} delivered-and-returned ones were placed again ({} of them twice)",
        out.timed_out, out.after_failed, out.returned, out.placed, out.placed_twice
    );
}

/// What [`shared_channel_returns`] counted.
struct SharedChannelOutcome {
    /// Partition-0 publishes reported unroutable to their own publisher.
    returned: usize,
    /// Partition-0 publishes reported delivered: each was placed again in the input queue.
    placed: usize,
    /// Publishes whose confirm did not come within the timeout (their callers requeue).
    timed_out: usize,
    /// Publishes sent after one that timed out ([`PublishError::AfterFailed`]; their callers
    /// publish again or requeue).
    after_failed: usize,
    /// Messages in the input queue twice: a placement retried after its own confirm timed out
    /// (at least once, as every retry after a timeout).
    placed_twice: usize,
}

/// Publishes 2,000 forwards concurrently on one confirm channel, alternating a bound partition
/// (1, `amqp.confirm_timeout` = `bound_confirm_timeout`) and one with no queue bound (0,
/// `confirm_timeout`), and
/// checks that no message is lost: every forward reported delivered is in its partition queue
/// or (partition 0) was placed again in the input queue; none reported returned is there too.
async fn shared_channel_returns(test: &str, confirm_timeout: &str, bound_confirm_timeout: &str) -> SharedChannelOutcome {
    use lapin::options::QueueDeclareOptions;
    use lapin::BasicProperties;
    use prefix_batcher::config::{AmqpSettings, Settings};
    use prefix_batcher::publisher::{publish_confirmed, PublishError};
    use std::collections::HashSet;
    use std::sync::Arc;

    let env = TestEnv::new(test);
    let mut raw = env.raw_config("http://127.0.0.1:9");
    raw.amqp.confirm_timeout = confirm_timeout.into();
    let settings = Settings::from_raw(&raw).expect("valid test config");
    let a = Arc::new(settings.amqp.clone());
    raw.amqp.confirm_timeout = bound_confirm_timeout.into();
    let a_bound = Arc::new(Settings::from_raw(&raw).expect("valid test config").amqp);
    let amqp = Amqp::connect().await;
    // The input queue and partition 1's route; partition 0 has no queue bound.
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    amqp.ch.queue_declare(a.input_queue.as_str().into(), durable, prefix_batcher::topology::input_queue_args(&a)).await.expect("input queue");
    prefix_batcher::topology::declare_route(&amqp.conn, &a, 1).await.expect("partition 1 route");
    let conn = Arc::new(lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default()).await.expect("connect"));
    let ch = prefix_batcher::amqp::ConfirmChannel::open(&conn).await.expect("confirm channel");

    let n = 2000;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (id, p) = (format!("fwd-{i}"), (i % 2) as u32);
        let (ch, conn, a) = (ch.clone(), conn.clone(), if p == 1 { a_bound.clone() } else { a.clone() });
        tasks.spawn(async move {
            let props = BasicProperties::default().with_message_id(id.as_str().into()).with_correlation_id(id.as_str().into());
            let body = format!(r#"{{"id":"{id}","prompt":"p"}}"#);
            let rk = AmqpSettings::partition_routing_key(p);
            let out = publish_confirmed(&ch, &conn, &a, &a.shard_exchange, &rk, body.as_bytes(), props).await;
            (id, p, out)
        });
    }
    let (mut returned, mut delivered_p0, mut delivered_p1, mut timed_out) = (HashSet::new(), HashSet::new(), HashSet::new(), HashSet::new());
    let mut after_failed = HashSet::new();
    let mut wrong = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        let (id, p, out) = joined.expect("publish task");
        match (p, out) {
            (0, Err(PublishError::Unroutable { .. })) => assert!(returned.insert(id)),
            (0, Ok(())) => assert!(delivered_p0.insert(id)),
            (1, Ok(())) => assert!(delivered_p1.insert(id)),
            (_, Err(PublishError::Timeout(_))) => assert!(timed_out.insert(id)),
            // Sent after a publish that timed out: its caller publishes it again or requeues.
            (_, Err(PublishError::AfterFailed)) => assert!(after_failed.insert(id)),
            (_, other) => wrong.push(format!("{id}: {other:?}")),
        }
    }
    assert!(wrong.is_empty(), "publishes with a wrong outcome (a bound partition reported returned, or an error): {wrong:?}");

    // Every partition-0 forward reported as delivered must reach the input queue (placed again
    // by the publish that received its return, perhaps after that one gave up), once; none
    // reported returned may be there.
    let mut input = amqp.consume(&a.input_queue).await;
    input.until("every partition-0 forward reported delivered", DEADLINE, |r| {
        let got: HashSet<&str> = r.iter().map(|m| m.correlation_id.as_str()).collect();
        delivered_p0.iter().all(|id| got.contains(id.as_str()))
    })
    .await;
    input.collect_for(Duration::from_millis(500)).await;
    let mut in_input = HashSet::new();
    let mut placed_twice = 0;
    for m in &input.received {
        placed_twice += usize::from(!in_input.insert(m.correlation_id.clone()));
    }
    input.close().await;
    let doubled: Vec<&String> = returned.iter().filter(|id| in_input.contains(*id)).collect();
    assert!(doubled.is_empty(), "returned forwards both reported and placed again: {doubled:?}");
    let strays: Vec<&String> = in_input.iter().filter(|id| !delivered_p0.contains(*id) && !timed_out.contains(*id) && !after_failed.contains(*id)).collect();
    assert!(strays.is_empty(), "only returned forwards go back to the input queue: {strays:?}");
    let in_p1 = drain_ids(&amqp, &env.partition_queue(1)).await;
    let missing_p1: Vec<&String> = delivered_p1.iter().filter(|id| !in_p1.contains(*id)).collect();
    assert!(missing_p1.is_empty(), "forwards to the bound partition reported delivered and not in its queue: {missing_p1:?}");
    let _ = ch.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;
    amqp.close().await;
    env.cleanup().await;
    SharedChannelOutcome { returned: returned.len(), placed: delivered_p0.len(), timed_out: timed_out.len(), after_failed: after_failed.len(), placed_twice }
}

/// Reads `queue` to the end (auto-ack) and returns the correlation ids it held; panics on a
/// duplicate.
async fn drain_ids(amqp: &Amqp, queue: &str) -> std::collections::HashSet<String> {
    let want = amqp.queue_depth(queue).await.0 as usize;
    let mut c = amqp.consume(queue).await;
    c.until(&format!("{want} messages"), DEADLINE, |r| r.len() >= want).await;
    c.collect_for(Duration::from_millis(200)).await;
    let mut ids = std::collections::HashSet::new();
    for r in &c.received {
        assert!(ids.insert(r.correlation_id.clone()), "{} twice in {queue}", r.correlation_id);
    }
    c.close().await;
    ids
}

/// A quorum queue that is full (`x-max-length = 50`, `x-overflow = reject-publish`) while a
/// consumer drains it nacks some of 3,000 publishes in flight on one shared publishing channel
/// and takes the others, as a full reply queue does to a partition's results. Two faults could
/// turn that into a loss, a publish reported delivered that never reached the queue:
/// - after the broker rejects a publish, a RabbitMQ 3.10 quorum queue can drop the channel's
///   later publishes while confirming them (rabbitmq-server #14589);
/// - lapin numbers a publish and queues its frames under two locks, so two tasks publishing at
///   once can each receive the other's confirm (a nack reported to the wrong publisher).
///
/// Every publish goes through [`prefix_batcher::publisher::publish_on`]: after a failed one,
/// the later ones of that channel are reported `AfterFailed` and go again on a new channel.
/// Every publish reported delivered must be consumed from the queue. (The same load on one
/// plain shared lapin channel, without the ordering, lost nothing in 3 runs either: a full queue
/// does not trigger the quorum queue defect, which a leader election did in
/// `tests/cluster_rabbit.rs`. This test guards the ordering against losing anything itself.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_publish_after_a_nack_on_a_shared_channel_is_reported_delivered_and_lost() {
    use lapin::options::{QueueDeleteOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    use lapin::BasicProperties;
    use prefix_batcher::amqp::SharedConfirmChannel;
    use prefix_batcher::config::Settings;
    use prefix_batcher::publisher::{publish_on, PublishError};
    use std::collections::HashSet;
    use std::sync::Arc;

    let env = TestEnv::new("nackorder");
    let a = Arc::new(Settings::from_raw(&env.raw_config("http://127.0.0.1:9")).expect("valid test config").amqp);
    let amqp = Amqp::connect().await;
    let queue = format!("{}.full", env.name);
    let mut args = FieldTable::default();
    args.insert(ShortString::from("x-queue-type"), AMQPValue::LongString("quorum".into()));
    args.insert(ShortString::from("x-max-length"), AMQPValue::LongLongInt(50));
    args.insert(ShortString::from("x-overflow"), AMQPValue::LongString("reject-publish".into()));
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    amqp.ch.queue_declare(queue.as_str().into(), durable, args).await.expect("declare the full queue");
    // A slow consumer (one message per millisecond at most), so that the queue is full and
    // takes a publish again now and then.
    let got = Arc::new(std::sync::Mutex::new(HashSet::new()));
    let publishing = tokio_util::sync::CancellationToken::new();
    let drain_ch = amqp.conn.create_channel().await.expect("channel");
    let drain = {
        let (got, publishing, queue) = (got.clone(), publishing.clone(), queue.clone());
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + DEADLINE;
            while tokio::time::Instant::now() < deadline {
                let m = drain_ch.basic_get(queue.as_str().into(), lapin::options::BasicGetOptions { no_ack: true }).await.expect("basic.get");
                match m {
                    Some(m) => {
                        let id = m.delivery.properties.correlation_id().as_ref().map(|c| c.to_string()).unwrap_or_default();
                        assert!(got.lock().unwrap().insert(id.clone()), "{id} twice in the queue");
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    None if publishing.is_cancelled() => return,
                    None => tokio::time::sleep(Duration::from_millis(1)).await,
                }
            }
            panic!("the queue was not drained within {DEADLINE:?}");
        })
    };
    let conn = Arc::new(lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default()).await.expect("connect"));
    let out = Arc::new(SharedConfirmChannel::new(conn.clone(), a.confirm_timeout * 2, "test".to_owned()));

    let n = 3000;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (out, a, queue, id) = (out.clone(), a.clone(), queue.clone(), format!("m-{i}"));
        tasks.spawn(async move {
            let props = BasicProperties::default().with_message_id(id.as_str().into()).with_correlation_id(id.as_str().into());
            let outcome = publish_on(&out, &a, "", &queue, id.as_bytes(), props, None).await;
            (id, outcome)
        });
    }
    let (mut delivered, mut nacked, mut after_failed, mut other) = (HashSet::new(), 0, 0, Vec::new());
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("publish task") {
            (id, Ok(())) => {
                delivered.insert(id);
            }
            (_, Err(PublishError::Nacked)) => nacked += 1,
            (_, Err(PublishError::AfterFailed)) => after_failed += 1,
            (id, Err(e)) => other.push(format!("{id}: {e}")),
        }
    }
    publishing.cancel();
    drain.await.expect("drain task");
    let got = got.lock().unwrap().clone();
    eprintln!("{n} publishes: {} delivered, {nacked} nacked, {after_failed} after a failed one; {} consumed", delivered.len(), got.len());
    assert!(other.is_empty(), "publishes that failed otherwise: {other:?}");
    assert!(nacked > 0, "the queue never refused a publish: the test proves nothing");
    let lost: Vec<&String> = delivered.iter().filter(|id| !got.contains(*id)).collect();
    assert!(lost.is_empty(), "{} publishes reported delivered are not in the queue: {lost:?}", lost.len());
    out.close("done").await;
    let _ = conn.close(200, "done".into()).await;
    let _ = amqp.ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await;
    amqp.close().await;
    env.cleanup().await;
}

/// Reported: a result whose `reply_to` publish waited out `amqp.confirm_timeout` went to the
/// results queue although the lease deadline had passed meanwhile (the lease was checked once,
/// before the first publish), so the next owner answered the request too. Every publish of a
/// partition now checks its lease first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_published_for_a_partition_once_its_lease_deadline_passed() {
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use lapin::BasicProperties;
    use prefix_batcher::amqp::SharedConfirmChannel;
    use prefix_batcher::config::Settings;
    use prefix_batcher::lease::LeaseClock;
    use prefix_batcher::publisher::{publish_on, PublishError};
    use std::sync::Arc;

    let env = TestEnv::new("leasepub");
    let a = Settings::from_raw(&env.raw_config("http://127.0.0.1:9")).expect("valid test config").amqp;
    let amqp = Amqp::connect().await;
    let queue = format!("{}.out", env.name);
    amqp.ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), Default::default()).await.expect("declare");
    let out = SharedConfirmChannel::new(Arc::new(lapin::Connection::connect(AMQP_URL, Default::default()).await.expect("connect")), a.confirm_timeout, "test".to_owned());
    let lease = LeaseClock::new(tokio::time::Instant::now() + Duration::from_secs(60));
    let props = BasicProperties::default().with_message_id("m".into());
    publish_on(&out, &a, "", &queue, b"first", props.clone(), Some(&lease)).await.expect("published under a valid lease");
    lease.invalidate();
    let refused = publish_on(&out, &a, "", &queue, b"second", props.clone(), Some(&lease)).await;
    assert!(matches!(refused, Err(PublishError::LeaseExpired)), "{refused:?}");
    publish_on(&out, &a, "", &queue, b"third", props, None).await.expect("published without a lease (the router's)");
    assert_eq!(amqp.queue_depth(&queue).await.0, 2, "the publish after the lease deadline reached the queue");
    out.close("done").await;
    let _ = amqp.ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await;
    amqp.close().await;
    env.cleanup().await;
}

/// A direct reply-to result returned to another publish's confirm, whose requester has left, is
/// placed in the results queue marked `gone`, as a result whose own confirm got the return is
/// ([`prefix_batcher::publisher::place_returned`]). Observed under load: 20 of 300 results of
/// requesters that had left came marked `unroutable`, so a consumer keyed on `gone` missed them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placed_direct_reply_to_result_of_a_requester_that_left_is_marked_gone() {
    use lapin::options::{BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
    use lapin::BasicProperties;
    use prefix_batcher::config::Settings;
    use std::sync::Arc;

    let env = TestEnv::new("placedgone");
    let raw = env.raw_config("http://127.0.0.1:9");
    let a = Settings::from_raw(&raw).expect("valid test config").amqp;
    let amqp = Amqp::connect().await;
    prefix_batcher::topology::declare_results(&amqp.conn, &a).await.expect("results queue");
    // A requester: consumes direct reply-to on its own channel and publishes a request, whose
    // reply_to the broker rewrites to the generated name; then it leaves (closes the channel).
    let requests = format!("{}.requests", env.name);
    amqp.ch.queue_declare(requests.as_str().into(), QueueDeclareOptions::default(), Default::default()).await.expect("request queue");
    let requester = amqp.conn.create_channel().await.expect("requester channel");
    let no_ack = BasicConsumeOptions { no_ack: true, ..Default::default() };
    let _replies = requester.basic_consume("amq.rabbitmq.reply-to".into(), "r".into(), no_ack, Default::default()).await.expect("consume replies");
    let props = BasicProperties::default().with_reply_to("amq.rabbitmq.reply-to".into());
    requester.basic_publish("".into(), requests.as_str().into(), BasicPublishOptions::default(), b"request", props).await.expect("publish");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let get = loop {
        if let Some(m) = amqp.ch.basic_get(requests.as_str().into(), BasicGetOptions { no_ack: true }).await.expect("basic.get") {
            break m;
        }
        assert!(tokio::time::Instant::now() < deadline, "the request never reached its queue");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let name = get.properties.reply_to().as_ref().expect("a generated reply_to").as_str().to_owned();
    assert!(name.starts_with("amq.rabbitmq.reply-to."), "{name}");
    requester.close(200, "requester leaves".into()).await.expect("close");
    // The result, published mandatory: RabbitMQ returns it (direct reply-to always is).
    let conn = Arc::new(lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default()).await.expect("connect"));
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(Default::default()).await.expect("confirms");
    let result = BasicProperties::default().with_message_id("placedgone-1:result".into()).with_correlation_id("placedgone-1".into());
    let mandatory = BasicPublishOptions { mandatory: true, ..Default::default() };
    let confirm = ch.basic_publish("".into(), name.as_str().into(), mandatory, b"{}", result).await.expect("publish").await.expect("confirm");
    let returned = confirm.take_message().expect("direct reply-to publishes are returned");
    prefix_batcher::publisher::place_returned(&conn, &a, returned).await;
    let mut results = amqp.consume(&a.results_queue).await;
    results.until("the placed result", DEADLINE, |r| !r.is_empty()).await;
    assert_eq!(results.received[0].correlation_id, "placedgone-1");
    assert_eq!(results.received[0].header("x-reply-to-refused"), Some("gone"), "{:?}", results.received[0].headers);
    assert_eq!(results.received[0].header("x-reply-to"), Some(name.as_str()));
    results.close().await;
    let _ = conn.close(200, "done".into()).await;
    amqp.ch.queue_delete(requests.as_str().into(), lapin::options::QueueDeleteOptions::default()).await.expect("delete the request queue");
    amqp.close().await;
    env.cleanup().await;
}
