//! End-to-end tests of the pipeline with daemons running in this process (`app::run`), against
//! the real RabbitMQ and Redis and the in-process fake LLM.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use llm_fakes::fake::FakeLlm;
use prefix_batcher::keying::{partition_of, PrefixKey};
use prefix_batcher::keying::desired_partitions;
use serde_json::{json, Value};

/// 300 requests over 6 prefixes (4 derived completions prefixes, 1 explicit `prefix_key`, 1 chat
/// system prompt): exactly one ok result each, with the right correlation id, output and
/// headers; every batch is key-pure, and so is every call the LLM server saw.
///
/// Longer than 80 lines on purpose: one scenario read top to bottom (setup, load, the event,
/// the assertions in the order they happen); split into helpers it would hide its timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_load_is_batched_by_prefix_with_one_result_each() {
    let env = TestEnv::new("mixed");
    let fake = FakeLlm::new().latency(Duration::from_millis(20)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    // The chat group shares its system prompt: keyed by it, the group is one prefix.
    raw.keying.chat_key = "system".into();
    let Started { amqp, daemon, mut results, reply } = start_with_replies(&env, &raw).await;

    // The workload. `expect` holds, per request: group, expected key material, the exact prompt
    // text the LLM server sees, and the expected output text.
    struct Expect {
        group: usize,
        material: String,
        llm_prompt: String,
        output: String,
    }
    let mut reqs = Vec::new();
    let mut expect: HashMap<String, Expect> = HashMap::new();
    let chat_system = "You are the chat assistant of group five. Answer briefly and politely.";
    for i in 0..300 {
        let id = format!("mixed-{i}");
        let group = i % 6;
        let (body, material, llm_prompt, output) = match group {
            0..=3 => {
                let prompt = format!("{} question number {i}?", group_prefix(group));
                let out = format!("ok:{}", &prompt[..8]);
                (json!({"id": id, "prompt": prompt, "params": {"max_tokens": 8}}), group_prefix(group), prompt, out)
            }
            4 => {
                // Explicit key; prompts start with a unique text, so the output (the prompt's
                // first 8 characters) proves the answers were demultiplexed to the right request.
                let prompt = format!("{i:08} tenant request text");
                let out = format!("ok:{}", &prompt[..8]);
                (json!({"id": id, "prompt": prompt, "prefix_key": "tenant-four"}), "tenant-four".to_owned(), prompt, out)
            }
            _ => {
                let user = format!("{i:06}-what is the answer?");
                let llm_prompt = format!("<|system|>\n{chat_system}\n<|user|>\n{user}\n");
                let out = format!("ok:{}", &user[..8]);
                let body = json!({"id": id, "messages": [
                    {"role": "system", "content": chat_system},
                    {"role": "user", "content": user},
                ]});
                (body, format!("<|system|>\n{chat_system}\n"), llm_prompt, out)
            }
        };
        reqs.push(TestRequest { id: id.clone(), body: serde_json::to_vec(&body).unwrap(), group });
        expect.insert(id, Expect { group, material, llm_prompt, output });
    }
    let all = ids(&reqs);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    results.until_all(&all, DEADLINE).await;

    // Stop the daemon (drain), then a FIFO barrier: any duplicate would be in the queue by now.
    daemon.stop().await.expect("daemon stops cleanly");
    results.barrier(&amqp).await;

    let by_id = results.by_correlation();
    let mut batches: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new(); // batch_id → (id, prefix_key)
    let mut key_of_group: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for r in &reqs {
        let got = by_id.get(&r.id).map(Vec::as_slice).unwrap_or_default();
        assert_eq!(got.len(), 1, "request {} got {} results, want exactly 1", r.id, got.len());
        let m = got[0];
        let res = m.result();
        let e = &expect[&r.id];
        assert_eq!(res.id, r.id, "result id");
        assert!(res.ok, "request {} failed: {:?}", r.id, res.error);
        assert!(res.error.is_none());
        match e.group {
            5 => assert_eq!(res.output, json!({"role": "assistant", "content": e.output}), "chat output of {}", r.id),
            _ => assert_eq!(res.output, Value::String(e.output.clone()), "completion output of {}", r.id),
        }
        assert_eq!(res.model.as_deref(), Some("test-model"), "model of {}", r.id);
        // Per-request usage exists when the server reported it for this request alone: a chat
        // call, or a one-prompt completions call (a list answer's usage is the whole batch's).
        if e.group == 5 || res.batch_size == 1 {
            let usage = res.usage.as_ref().unwrap_or_else(|| panic!("result {} has no usage", r.id));
            assert!(usage.prompt_tokens > 0 && usage.completion_tokens > 0, "usage of {}: {usage:?}", r.id);
        }
        // Keying: the documented key of the request (xxh3 of the key material).
        assert_eq!(res.prefix_key, PrefixKey::of(&e.material).to_string(), "prefix key of {} (group {})", r.id, e.group);
        // Shard and partition: shard < shards per key, partition = xxh3(key ‖ shard) mod P.
        assert!(res.shard < 4, "shard {} of {} is not below sharding.default_shards = 4", res.shard, r.id);
        let key = PrefixKey(u64::from_str_radix(&res.prefix_key, 16).unwrap());
        assert_eq!(res.partition, partition_of(key, res.shard, NonZeroU32::new(PARTITIONS).unwrap()), "partition of {}", r.id);
        // Headers.
        assert_eq!(m.header("x-request-id"), Some(r.id.as_str()), "x-request-id of {}: {:?}", r.id, m.headers);
        let epoch = m.epoch();
        assert!(epoch >= 1);
        assert_eq!(m.header("x-partition"), Some(res.partition.to_string().as_str()), "x-partition of {}", r.id);
        assert!(
            res.batch_id.starts_with(&format!("{}-{}-", res.partition, epoch)),
            "batch_id {} of {} is not {{partition}}-{{epoch}}-{{seq}} with epoch {epoch}",
            res.batch_id,
            r.id
        );
        assert!(res.batch_size >= 1 && res.batch_size <= 8, "batch_size {} of {}", res.batch_size, r.id);
        batches.entry(res.batch_id.clone()).or_default().push((r.id.clone(), res.prefix_key.clone()));
        key_of_group.entry(e.group).or_default().insert(res.prefix_key.clone());
    }
    // One key per group, six different keys.
    for (g, keys) in &key_of_group {
        assert_eq!(keys.len(), 1, "group {g} was given several prefix keys: {keys:?}");
    }
    let distinct: BTreeSet<&String> = key_of_group.values().flatten().collect();
    assert_eq!(distinct.len(), 6, "the six prefixes must map to six keys");

    // Batch purity, from the results.
    for (batch_id, members) in &batches {
        let keys: BTreeSet<&String> = members.iter().map(|(_, k)| k).collect();
        assert_eq!(keys.len(), 1, "batch {batch_id} mixes prefix keys: {members:?}");
        let size = by_id[&members[0].0][0].result().batch_size;
        assert_eq!(size, members.len(), "batch {batch_id} reports batch_size {size} but {} results carry its id", members.len());
    }
    assert!(
        batches.len() < reqs.len(),
        "no batching happened: {} batches for {} requests",
        batches.len(),
        reqs.len()
    );

    // Batch purity, as the LLM server saw it: every call holds prompts of one group only.
    let group_of_prompt: HashMap<&str, usize> = expect.values().map(|e| (e.llm_prompt.as_str(), e.group)).collect();
    let calls = fake.calls();
    let mut prompts_seen = 0;
    for (n, call) in calls.iter().enumerate() {
        assert_eq!(call.status, 200);
        assert_eq!(call.model.as_deref(), Some("test-model"));
        let groups: BTreeSet<usize> = call
            .prompts
            .iter()
            .map(|p| *group_of_prompt.get(p.as_str()).unwrap_or_else(|| panic!("call {n} carries an unknown prompt {p:?}")))
            .collect();
        assert_eq!(groups.len(), 1, "LLM call {n} ({}) mixes prefixes of groups {groups:?}", call.path);
        if groups.contains(&5) {
            assert_eq!(call.path, "/v1/chat/completions");
        } else {
            assert_eq!(call.path, "/v1/completions");
        }
        prompts_seen += call.prompts.len();
    }
    assert_eq!(prompts_seen, reqs.len(), "every request must reach the LLM exactly once in a stable run");
    println!("mixed load: {} requests, {} batches, {} LLM calls", reqs.len(), batches.len(), calls.len());

    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// Malformed requests are dead-lettered with their reason, detail and original body, and the
/// daemon keeps serving valid requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_are_dead_lettered_and_the_daemon_keeps_going() {
    let env = TestEnv::new("dead");
    let fake = FakeLlm::new().start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.max_message_bytes = 2048;
    let Started { amqp, daemon, mut results, reply } = start_with_replies(&env, &raw).await;
    let mut dead = amqp.consume(&env.dead_letter_queue()).await;

    let too_large = serde_json::to_vec(&json!({"prompt": "x".repeat(3000)})).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("invalid_json", b"{\"prompt\": \"unterminated".to_vec()),
        ("missing_prompt", br#"{"id": "m1", "params": {"max_tokens": 3}}"#.to_vec()),
        (
            "both_prompt_and_messages",
            br#"{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}"#.to_vec(),
        ),
        ("unknown_message_schema", br#"{"messages": [{"role": "wizard", "content": "abracadabra"}]}"#.to_vec()),
        ("invalid_utf8", b"{\"prompt\": \"caf\xe9 \xff\xfe\"}".to_vec()),
        ("too_large", too_large),
    ];
    for (reason, body) in &cases {
        amqp.publish(&env.input_queue(), body, request_props(&format!("bad-{reason}"), &reply)).await;
    }
    let good = completion("good-1", 0, " after the bad ones");
    amqp.publish_requests(&env.input_queue(), std::slice::from_ref(&good), &reply).await;

    dead.until("six dead letters", DEADLINE, |r| r.len() >= cases.len()).await;
    results.until_all(&ids(std::slice::from_ref(&good)), DEADLINE).await;
    assert!(!daemon.is_finished(), "the daemon stopped after bad input");

    for (reason, body) in &cases {
        let id = format!("bad-{reason}");
        let got: Vec<&Received> = dead.received.iter().filter(|m| m.correlation_id == id).collect();
        assert_eq!(got.len(), 1, "{reason}: want exactly one dead letter, got {}", got.len());
        let m = got[0];
        assert_eq!(m.header("x-death-reason"), Some(*reason), "x-death-reason of the {reason} case: {:?}", m.headers);
        let detail = m.header("x-death-detail").unwrap_or_else(|| panic!("{reason}: no x-death-detail header"));
        assert!(!detail.trim().is_empty(), "{reason}: empty x-death-detail");
        assert_eq!(&m.body, body, "{reason}: the dead letter must keep the original body");
    }
    let r = results.received.iter().find(|m| m.correlation_id == "good-1").unwrap().result();
    assert!(r.ok, "the valid request failed: {:?}", r.error);

    // After a drain nothing is left anywhere and nothing else was produced.
    daemon.stop().await.expect("daemon stops cleanly");
    results.barrier(&amqp).await;
    dead.barrier(&amqp).await;
    assert_eq!(dead.received.len(), cases.len(), "unexpected extra dead letters: {:?}", dead.received);
    let ids_seen: Vec<&str> = results.received.iter().map(|m| m.correlation_id.as_str()).collect();
    assert_eq!(ids_seen, vec!["good-1"], "only the valid request may produce a result");
    assert_eq!(amqp.queue_depth(&env.input_queue()).await.0, 0, "input queue not empty");
    for p in 0..PARTITIONS {
        assert_eq!(amqp.queue_depth(&env.partition_queue(p)).await.0, 0, "partition {p} not empty");
    }

    results.close().await;
    dead.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// A partition whose prefetch is all buffered flushes at once. One partition with a prefetch of 4,
/// batches of up to 4, a 10-minute `max_batch_wait`, and 16 requests with 16 different prefix
/// keys: each key's buffer holds one request, the broker sends the 5th delivery only after one of
/// the first 4 is acked, so without the prefetch flush every 4 requests would wait out the
/// 10 minutes. Every request must be answered (one call each: no two share a key), all before
/// the first `max_batch_wait` could have run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_whose_prefetch_is_all_buffered_flushes_at_once() {
    let env = TestEnv::new("prefetch");
    let fake = FakeLlm::new().start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.partitions = 1;
    raw.amqp.partition_prefetch = 4;
    raw.batching.max_batch_size = 4;
    raw.batching.max_batch_wait = "10m".into();
    let started = start_with_replies(&env, &raw).await;
    let t0 = std::time::Instant::now();
    let reqs = completions_workload("prefetch", 16, 16);
    let (amqp, results) = started.publish_and_drain(&env, &reqs).await;
    let took = t0.elapsed();
    results.assert_one_ok_result_each(&reqs, "failed");
    let calls = fake.calls();
    println!("16 requests with 16 keys, prefetch 4: {} LLM calls, all answered in {took:?}", calls.len());
    assert!(calls.iter().all(|c| c.prompts.len() == 1), "one key per batch: {:?}", calls.iter().map(|c| c.prompts.len()).collect::<Vec<_>>());
    assert!(took < Duration::from_secs(600), "requests waited out max_batch_wait");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// A spent byte budget flushes every buffer at once. One partition, a prefetch of 64, a
/// 10-minute `max_batch_wait`, and a `batching.max_buffered_bytes` that holds 4 of the 16
/// requests (16 prefix keys): once 4 are buffered the intake waits for bytes that only a flushed
/// batch gives back, so without the flush every 4 requests would wait out the 10 minutes. With
/// it, all but the last few are answered within seconds; those last ones, with no request behind
/// them to spend the budget, wait for their `max_batch_wait` as usual, and the graceful stop
/// flushes them (`reason="shutdown"`); one still waiting for budget at the stop returns to the
/// queue and a second run serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_byte_budget_flushes_the_buffers_at_once() {
    let env = TestEnv::new("budget");
    let fake = FakeLlm::new().start().await.unwrap();
    let reqs = completions_workload("budget", 16, 16);
    let largest = reqs.iter().map(|r| r.body.len()).max().unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.partitions = 1;
    raw.amqp.max_message_bytes = largest;
    raw.batching.max_buffered_bytes = 4 * largest + largest / 2;
    raw.batching.max_batch_wait = "10m".into();
    let Started { amqp, daemon, mut results, reply } = start_with_replies(&env, &raw).await;
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    // Without the flush, no request would be answered for 10 minutes: the first 4 fill the budget.
    results.until("12 of 16 results", DEADLINE, |r| r.len() >= 12).await;
    let early = results.distinct_of(&ids(&reqs));
    daemon.stop().await.expect("daemon stops cleanly");
    // The stop flushes what was buffered. A delivery still waiting for budget when the stop came
    // (results are published one at a time per partition, so the budget comes back one result at
    // a time) was returned to the queue unacked: a second run of the daemon (with a short
    // max_batch_wait) serves it.
    let mut raw_again = raw.clone();
    raw_again.batching.max_batch_wait = "100ms".into();
    let again = start_daemon(&raw_again);
    results.until_all(&ids(&reqs), DEADLINE).await;
    again.stop().await.expect("daemon stops cleanly");
    results.barrier(&amqp).await;
    results.assert_one_ok_result_each(&reqs, "failed");
    let calls = fake.calls();
    println!("16 requests with 16 keys, a byte budget of 4.5 requests: {early} answered before the stop; {} LLM calls", calls.len());
    assert!(calls.iter().all(|c| c.prompts.len() == 1), "one key per batch");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// A backlog behind a busy LLM server drains in batches, not one request at a time. 160
/// requests of 6 prefix keys published at once, 2 partitions with a prefetch of 16, one call
/// slot (`llm.max_concurrency = 1`) on a server that takes 300 ms per call, `max_batch_wait`
/// 50 ms. Before, a partial batch flushed at its deadline waited for the slot with its
/// deliveries, each freed delivery started a batch of its own that flushed 50 ms later, and the
/// batches shrank towards one request each (observed: 118 calls for 160 requests, 1.4 requests
/// per call, the last 20 calls single, 36.8 s). Now a due batch stays open while no slot is free
/// and a batch of its partition waits for one, so it takes the requests of its key that arrive
/// meanwhile (observed: 34 calls, 4.7 requests per call, 11.3 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_behind_a_busy_server_drains_in_batches() {
    let env = TestEnv::new("backlog");
    let fake = FakeLlm::new().latency(Duration::from_millis(300)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.keying.mode = "prefix".into();
    raw.sharding.default_shards = 1;
    raw.amqp.partitions = 2;
    raw.amqp.partition_prefetch = 16;
    raw.batching.max_batch_size = 8;
    raw.batching.max_batch_wait = "50ms".into();
    raw.llm.max_concurrency = 1;
    let reqs = completions_workload("backlog", 160, 6);
    let started = start_with_replies(&env, &raw).await;
    let t0 = std::time::Instant::now();
    let (amqp, results) = started.publish_and_drain(&env, &reqs).await;
    let took = t0.elapsed();
    results.assert_one_ok_result_each(&reqs, "failed");
    let sizes: Vec<usize> = fake.calls().iter().map(|c| c.prompts.len()).collect();
    let mean = reqs.len() as f64 / sizes.len() as f64;
    let last: Vec<usize> = sizes.iter().rev().take(20).rev().copied().collect();
    println!("160 requests, 6 keys, 1 call slot of 300 ms: {} calls, {mean:.1} requests per call, drained in {took:?}; the last 20 calls: {last:?}", sizes.len());
    assert!(sizes.iter().all(|&n| n <= 8), "max_batch_size exceeded: {sizes:?}");
    assert!(mean >= 3.0, "the backlog drained in small batches: {mean:.1} requests per call, sizes {sizes:?}");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// Two HTTP 500s followed by success are retried: every request ends ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_server_errors_are_retried() {
    let env = TestEnv::new("retry");
    let fake = FakeLlm::new().fail_first(2, 500).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.llm.max_attempts = 4;
    let started = start_with_replies(&env, &raw).await;

    let reqs = completions_workload("retry", 24, 3);
    let (amqp, results) = started.publish_and_drain(&env, &reqs).await;
    results.assert_one_ok_result_each(&reqs, "failed despite retries");
    let calls = fake.calls();
    let failed: Vec<_> = calls.iter().filter(|c| c.status != 200).collect();
    assert_eq!(failed.len(), 2, "the fake fails exactly its first 2 calls");
    assert!(calls[..2].iter().all(|c| c.status == 500));
    // Every prompt of a failed call was sent again later and answered.
    for f in &failed {
        for p in &f.prompts {
            assert!(
                calls.iter().any(|c| c.status == 200 && c.received_at >= f.received_at && c.prompts.contains(p)),
                "prompt {p:?} of a failed call was never retried successfully"
            );
        }
    }
    let answered: usize = calls.iter().filter(|c| c.status == 200).map(|c| c.prompts.len()).sum();
    assert_eq!(answered, reqs.len(), "each request answered once by the LLM");

    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// A server-wide 500 is not the requests' fault: no request gets an `ok: false` result. The
/// server fails its first 6 calls (the breaker opens after 5 consecutive server faults, the
/// requests of the failed batches are requeued, intake pauses); once the breaker's own probe
/// closes it, every request is answered `ok` exactly once, and nothing is left in any queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_wide_llm_failure_requeues_instead_of_failing_requests() {
    let env = TestEnv::new("fail");
    let fake = FakeLlm::new().fail_first(6, 500).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.llm.max_attempts = 2;
    let started = start_with_replies(&env, &raw).await;

    let reqs = completions_workload("fail", 30, 3);
    let (amqp, results) = started.publish_and_drain(&env, &reqs).await;
    results.assert_one_ok_result_each(&reqs, "was answered ok:false for a server fault");
    assert!(fake.call_count() >= 6, "the failing calls were made");
    assert_eq!(amqp.queue_depth(&env.input_queue()).await.0, 0, "input queue not empty");
    for p in 0..PARTITIONS {
        assert_eq!(amqp.queue_depth(&env.partition_queue(p)).await.0, 0, "partition {p} still holds requests");
    }

    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// One observation of the ownership state.
#[derive(Debug, Clone)]
struct Sample {
    /// Lease holder name and epoch per partition.
    leases: Vec<Option<(String, u64)>>,
    /// Consumers per partition queue.
    consumers: Vec<u32>,
}

/// Two daemons (different instance names, same Redis and queues): B joins while A is busy.
/// Partitions move by rendezvous hashing; at no time does a partition queue have two
/// consumers or a lease have a foreign holder; each partition's results come from one epoch at a
/// time (epochs never go back in arrival order); every request gets exactly one result; in the
/// end every lease is held by its desired owner and both daemons served requests.
///
/// Longer than 80 lines on purpose: one scenario read top to bottom (setup, load, the event,
/// the assertions in the order they happen); split into helpers it would hide its timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_never_share_a_partition() {
    let env = TestEnv::new("two");
    let fake = FakeLlm::new().latency(Duration::from_millis(50)).start().await.unwrap();
    let raw_a = env.raw_config(fake.url.as_str());
    let a = raw_a.instance.name.clone();
    // The partitions the workload can reach: 6 prefixes × 4 shards (keys are deterministic).
    let p_count = NonZeroU32::new(PARTITIONS).unwrap();
    let reached: BTreeSet<u32> =
        (0..6).flat_map(|g| (0..4).map(move |s| partition_of(PrefixKey::of(&group_prefix(g)), s, p_count))).collect();
    // Pick B's name so that, once both run, each of A and B owns at least two of those.
    let (b, b_share) = (0..)
        .map(|i| env.instance(&format!("b{i}")))
        .map(|b| {
            let members = vec![a.clone(), b.clone()];
            let share = desired_partitions(PARTITIONS, &members, &b);
            (b, share)
        })
        .find(|(_, share)| share.intersection(&reached).count() >= 2 && reached.difference(share).count() >= 2)
        .unwrap();
    let mut raw_b = raw_a.clone();
    raw_b.instance.name = b.clone();

    let amqp = Amqp::connect().await;
    let mut redis = RedisProbe::connect().await.unwrap();
    let daemon_a = start_daemon(&raw_a);
    redis.wait_all_held_by(env.key_prefix(), PARTITIONS, &a).await;
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;

    // Monitor: lease holders and consumer counts, every 25 ms, until stopped.
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let monitor_stop = stop_flag();
    let monitor = {
        let (samples, stop, prefix) = (samples.clone(), monitor_stop.clone(), env.key_prefix().to_owned());
        let queues: Vec<String> = (0..PARTITIONS).map(|p| env.partition_queue(p)).collect();
        tokio::spawn(async move {
            let probe_amqp = Amqp::connect().await;
            let mut probe = RedisProbe::connect().await.unwrap();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let leases = probe.leases(&prefix, PARTITIONS).await.into_iter().map(|l| l.map(|l| (l.name, l.epoch))).collect();
                let mut consumers = Vec::new();
                for q in &queues {
                    consumers.push(probe_amqp.queue_depth(q).await.1);
                }
                samples.lock().unwrap().push(Sample { leases, consumers });
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            probe_amqp.close().await;
        })
    };

    // Phase 1: work in flight on A, then B joins.
    let first = completions_workload("two-first", 160, 6);
    amqp.publish_requests(&env.input_queue(), &first, &reply).await;
    results.until("the first results", DEADLINE, |r| r.len() >= 10).await;
    let daemon_b = start_daemon(&raw_b);
    let members = vec![a.clone(), b.clone()];
    let settled = redis
        .wait_leases(env.key_prefix(), PARTITIONS, "every lease held by its rendezvous owner", DEADLINE, |ls| {
            ls.iter().enumerate().all(|(p, l)| {
                let want = if b_share.contains(&(p as u32)) { &b } else { &a };
                l.as_ref().is_some_and(|l| &l.name == want)
            })
        })
        .await;
    assert_eq!(desired_partitions(PARTITIONS, &members, &b), b_share);

    // Phase 2: work after the handover, spread over both daemons.
    let second = completions_workload("two-second", 160, 6);
    amqp.publish_requests(&env.input_queue(), &second, &reply).await;
    let all: HashSet<String> = ids(&first).union(&ids(&second)).cloned().collect();
    results.until_all(&all, DEADLINE).await;

    // Every partition queue has exactly one consumer: its lease holder.
    for p in 0..PARTITIONS {
        amqp.wait_consumers(&env.partition_queue(p), 1, Duration::from_secs(10)).await;
    }
    monitor_stop.store(true, std::sync::atomic::Ordering::SeqCst);
    monitor.await.unwrap();
    let (ra, rb) = tokio::join!(daemon_a.stop(), daemon_b.stop());
    ra.expect("daemon A stops cleanly");
    rb.expect("daemon B stops cleanly");
    results.barrier(&amqp).await;

    // Exactly one result per request.
    let by_id = results.by_correlation();
    for id in &all {
        let n = by_id.get(id).map_or(0, Vec::len);
        assert_eq!(n, 1, "request {id} got {n} results, want exactly 1");
    }
    // Each partition's results come from one epoch at a time: in arrival order, epochs never
    // go back (the old owner's results are all in before the new owner's first).
    let mut last_epoch: BTreeMap<u32, u64> = BTreeMap::new();
    let mut epochs: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    for m in &results.received {
        let res = m.result();
        let epoch = m.epoch();
        assert_eq!(m.header("x-partition"), Some(res.partition.to_string().as_str()));
        let prev = last_epoch.insert(res.partition, epoch).unwrap_or(0);
        assert!(
            epoch >= prev,
            "partition {}: a result of epoch {epoch} arrived after one of epoch {prev} (two owners at once?)",
            res.partition
        );
        epochs.entry(res.partition).or_default().insert(epoch);
    }
    // Both daemons served phase-2 requests (mapped through the settled lease epochs).
    let holder_of: HashMap<(u32, u64), String> = settled
        .iter()
        .enumerate()
        .filter_map(|(p, l)| l.as_ref().map(|l| ((p as u32, l.epoch), l.name.clone())))
        .collect();
    let second_ids = ids(&second);
    let mut served_by = BTreeSet::new();
    for m in results.received.iter().filter(|m| second_ids.contains(&m.correlation_id)) {
        let res = m.result();
        let holder = holder_of
            .get(&(res.partition, m.epoch()))
            .unwrap_or_else(|| panic!("phase-2 result {} has epoch {} of partition {} which is not the settled lease", m.correlation_id, m.epoch(), res.partition));
        served_by.insert(holder.clone());
    }
    assert_eq!(served_by, BTreeSet::from([a.clone(), b.clone()]), "both daemons should have served requests");

    // What the monitor saw.
    let samples = samples.lock().unwrap().clone();
    assert!(samples.len() >= 5, "the monitor took only {} samples", samples.len());
    for (i, s) in samples.iter().enumerate() {
        for (p, c) in s.consumers.iter().enumerate() {
            assert!(*c <= 1, "sample {i}: partition {p} had {c} consumers at once");
        }
        for (p, l) in s.leases.iter().enumerate() {
            if let Some((name, _)) = l {
                assert!(name == &a || name == &b, "sample {i}: partition {p} leased by a stranger {name}");
            }
        }
    }
    let moved: usize = epochs.values().filter(|e| e.len() > 1).count();
    println!(
        "two daemons: {} samples, {} partitions served by more than one epoch, B's share {:?}",
        samples.len(),
        moved,
        b_share
    );
    // Both gone: no lease and no member left behind by the graceful stops.
    assert!(redis.keys(&format!("{}:lease:*", env.key_prefix())).await.is_empty(), "leases left after both stopped");
    assert!(redis.keys(&format!("{}:member:*", env.key_prefix())).await.is_empty(), "members left after both stopped");

    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// A stop flag for the monitor task.
fn stop_flag() -> Arc<std::sync::atomic::AtomicBool> {
    Arc::new(std::sync::atomic::AtomicBool::new(false))
}
