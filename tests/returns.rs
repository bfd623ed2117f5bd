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
