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
/// this test, before the fix, lost 6 and 1 of 3,000 in two runs. Now a partition publishes one
/// message at a time on its channel, so a return always meets its own confirm.
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
/// it was delivered (its request acked: lost). Now every returned forward is either reported
/// to its own publisher or placed again in the input queue by the publish that received it, and
/// no delivered one is reported returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_return_on_a_shared_channel_reaches_its_own_publisher_or_is_placed_again() {
    let out = shared_channel_returns("sharedret", "10s", "10s").await;
    assert_eq!(out.timed_out, 0, "no confirm should take 10 s here");
    assert_eq!(out.placed_twice, 0, "without timeouts nothing is placed twice");
    eprintln!("2000 forwards: {} returns met their own confirm, {} were placed again by another publish", out.returned, out.placed);
}

/// The same with a confirm timeout so short (5 ms) for the forwards to the bound partition that
/// they give up on their confirm. A confirm that comes after its publish gave up may still
/// carry another publish's return: the publish's own task waits for it and places that message
/// again, instead of leaving it with lapin (lost, since its own publisher was told it was
/// delivered). With the confirm dropped on a timeout, this test failed 4 runs of 4 (20 ms);
/// with only the confirm (not the send) handed to a task, 2 of 3 (5 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_on_a_confirm_that_came_too_late_is_placed_again() {
    let out = shared_channel_returns("lateret", "10s", "5ms").await;
    assert!(out.timed_out > 0, "no publish timed out; the test proves nothing");
    eprintln!(
        "2000 forwards: {} timed out, {} returns met their own confirm, {} delivered-and-returned ones were placed again ({} of them twice)",
        out.timed_out, out.returned, out.placed, out.placed_twice
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
    let ch = prefix_batcher::amqp::confirm_channel(&conn).await.expect("confirm channel");

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
    let mut wrong = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        let (id, p, out) = joined.expect("publish task");
        match (p, out) {
            (0, Err(PublishError::Unroutable { .. })) => assert!(returned.insert(id)),
            (0, Ok(())) => assert!(delivered_p0.insert(id)),
            (1, Ok(())) => assert!(delivered_p1.insert(id)),
            (_, Err(PublishError::Timeout(_))) => assert!(timed_out.insert(id)),
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
    let strays: Vec<&String> = in_input.iter().filter(|id| !delivered_p0.contains(*id) && !timed_out.contains(*id)).collect();
    assert!(strays.is_empty(), "only returned forwards go back to the input queue: {strays:?}");
    let in_p1 = drain_ids(&amqp, &env.partition_queue(1)).await;
    let missing_p1: Vec<&String> = delivered_p1.iter().filter(|id| !in_p1.contains(*id)).collect();
    assert!(missing_p1.is_empty(), "forwards to the bound partition reported delivered and not in its queue: {missing_p1:?}");
    let _ = ch.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;
    amqp.close().await;
    env.cleanup().await;
    SharedChannelOutcome { returned: returned.len(), placed: delivered_p0.len(), timed_out: timed_out.len(), placed_twice }
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
