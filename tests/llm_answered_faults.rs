//! Answered server faults — an HTTP 5xx, or a 2xx that is not a valid completion — against the
//! real RabbitMQ and Redis, the daemon in this process and the fake LLM:
//!
//! - A few prompts the server answers 500 on their own (the server is otherwise healthy: its
//!   probe and every other prompt succeed): the circuit breaker never opens for them, they are
//!   charged a delivery each time and dead-lettered after `amqp.delivery_limit`, and every other
//!   request is answered `ok`.
//! - A server that answers every call (its probe included) with HTTP 200 and an HTML page for a
//!   while, then recovers: the breaker opens, no request gets an `ok: false` result or is
//!   charged a delivery, and all are answered once the server answers properly.
//! - A few prompts that on their own keep the server busy beyond `llm.request_timeout` (the
//!   server is otherwise healthy): request timeouts are verified like answered faults, so the
//!   breaker never opens for them and they are dead-lettered after `amqp.delivery_limit`; so is
//!   one such request alone with one permit, judged by a replay of a call answered before.
//!
//! Both read `prefix_batcher_llm_circuit_opened_total`, a process-wide counter: the tests of this
//! file run one at a time ([`SERIAL`]).

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use llm_fakes::fake::FakeLlm;
use serde_json::json;
use tokio::time::Instant;

/// Serialises the tests of this file (they compare a process-wide metric before and after).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A prompt containing this is answered HTTP 500 by the fake, alone.
const POISON: &str = "NU-POISON";

/// A prompt containing this is answered by the fake only after [`SLOW_DELAY`], far beyond the
/// test's `llm.request_timeout`.
const SLOW: &str = "NU-SLOW";
const SLOW_DELAY: Duration = Duration::from_secs(20);

/// `prefix_batcher_llm_circuit_opened_total{endpoint="0"}` now.
fn circuit_openings() -> f64 {
    let text = prefix_batcher::metrics::render();
    let line = text.lines().find(|l| l.starts_with("prefix_batcher_llm_circuit_opened_total{endpoint=\"0\"}"));
    line.and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// A completions request of group `g` whose prompt carries a malformed `tools` param too (as in
/// the observed case; the fake ignores it and fails on the prompt's marker).
fn poison(id: &str, g: usize) -> TestRequest {
    let prompt = format!("{} {POISON} call a tool", group_prefix(g));
    let body = json!({"id": id, "prompt": prompt, "params": {"max_tokens": 8, "tools": "not a list"}});
    TestRequest { id: id.to_owned(), body: serde_json::to_vec(&body).unwrap(), group: g }
}

/// A completions request of group `g` whose prompt the fake answers only after [`SLOW_DELAY`]
/// (as a prompt with a huge `max_tokens` would keep a real server busy).
fn slow(id: &str, g: usize) -> TestRequest {
    let prompt = format!("{} {SLOW} write a very long story", group_prefix(g));
    let body = json!({"id": id, "prompt": prompt, "params": {"max_tokens": 30000}});
    TestRequest { id: id.to_owned(), body: serde_json::to_vec(&body).unwrap(), group: g }
}

/// Every `normal` request got one `ok` result and no `bad` one did; each `bad` request was
/// dead-lettered once with reason `delivery_limit` and a detail naming its last error (`error`).
fn assert_answered_and_dead_lettered(results: &Collector, dead: &Collector, normal: &[TestRequest], bad: &[TestRequest], error: &str) {
    let bad_ids = ids(bad);
    for m in results.received.iter() {
        assert!(!bad_ids.contains(&m.correlation_id), "a bad request got a result: {}", String::from_utf8_lossy(&m.body));
        let r = m.result();
        assert!(r.ok, "{} failed: {:?}", m.correlation_id, r.error);
    }
    let answered: HashSet<&str> = results.received.iter().map(|m| m.correlation_id.as_str()).collect();
    assert_eq!(answered.len(), normal.len());
    assert_eq!(dead.received.len(), bad.len(), "each bad request is dead-lettered once");
    for m in &dead.received {
        assert_eq!(m.header("x-death-reason"), Some("delivery_limit"), "{:?}", m.headers);
        let detail = m.header("x-death-detail").unwrap_or_default();
        assert!(detail.contains(error), "the detail names the last error: {detail}");
    }
}

/// After the slow requests `bad` were dead-lettered: waits for every result, asserts that the
/// `normal` requests were answered `ok`, each of `bad` dead-lettered once with its last error a
/// timeout, and the breaker never opened since `opened_before`. Returns the openings (0) and the
/// calls of the fake that carried a slow prompt.
async fn judged_as_the_requests_own(
    st: &mut Started,
    dead: &Collector,
    fake: &llm_fakes::fake::FakeLlmHandle,
    normal: &[TestRequest],
    bad: &[TestRequest],
    opened_before: f64,
) -> (f64, usize) {
    st.results.barrier(&st.amqp).await;
    let opened = circuit_openings() - opened_before;
    assert_answered_and_dead_lettered(&st.results, dead, normal, bad, "timeout");
    assert_eq!(opened, 0.0, "the breaker opened {opened} times for requests that time out on their own");
    (opened, fake.calls().iter().filter(|c| c.prompts.iter().any(|p| p.contains(SLOW))).count())
}

/// Stops the daemon gracefully, checks that no request is left in (or returned to) the input
/// and partition queues, closes the collectors and deletes everything the test created.
async fn stop_and_check_nothing_held(env: TestEnv, started: Started, others: Vec<Collector>) {
    let Started { amqp, daemon, results, .. } = started;
    daemon.stop().await.expect("daemon stops cleanly");
    let mut ready = 0;
    for p in 0..PARTITIONS {
        ready += amqp.queue_depth(&env.partition_queue(p)).await.0;
    }
    assert_eq!(ready, 0, "requests left in (or returned to) the partition queues");
    assert_eq!(amqp.queue_depth(&env.input_queue()).await.0, 0, "input queue not empty");
    for c in others.into_iter().chain([results]) {
        c.close().await;
    }
    amqp.close().await;
    env.cleanup().await;
}

/// The observed case of 5 poison requests among normal traffic, where the breaker opened 217
/// times in 4.5 min and the 5 were never dead-lettered: here the breaker does not open at all
/// (the server answers its probe every time), the 5 are dead-lettered with reason
/// `delivery_limit` (default limit 5) and the last error (the 500), and the 120 others are
/// answered `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_few_poison_500_prompts_are_dead_lettered_and_never_open_the_breaker() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().fail_prompts_containing(POISON, 500).start().await.unwrap();
    let env = TestEnv::new("nu-poison500");
    let raw = env.raw_config(fake.url.as_str());
    assert_eq!(raw.amqp.delivery_limit, 5, "the default delivery limit");
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let opened_before = circuit_openings();

    let normal = completions_workload("nu-normal", 120, 4);
    let bad: Vec<TestRequest> = (0..5).map(|i| poison(&format!("nu-poison-{i}"), i % 4)).collect();
    let bad_ids = ids(&bad);
    // Normal traffic in 6 waves, the poison requests in the first one (each shares its batch
    // with normal requests of its key).
    let started = Instant::now();
    for (wave, chunk) in normal.chunks(20).enumerate() {
        if wave == 0 {
            st.amqp.publish_requests(&env.input_queue(), &bad, &st.reply).await;
        }
        st.amqp.publish_requests(&env.input_queue(), chunk, &st.reply).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    st.results.until_all(&ids(&normal), Duration::from_secs(60)).await;
    let normal_in = started.elapsed();
    dead.until_all(&bad_ids, Duration::from_secs(90)).await;
    let dead_in = started.elapsed();
    st.results.barrier(&st.amqp).await;

    let opened = circuit_openings() - opened_before;
    assert_answered_and_dead_lettered(&st.results, &dead, &normal, &bad, "500");
    assert_eq!(opened, 0.0, "the breaker opened {opened} times for requests the server fails on their own");
    let calls = fake.calls();
    let failed_calls = calls.iter().filter(|c| c.status == 500).count();
    eprintln!(
        "poison 500: 120 answered ok in {normal_in:?}, 5 dead-lettered after {dead_in:?}, breaker opened {opened} times, \
         {failed_calls} of {} calls answered 500",
        calls.len()
    );
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// The new-user case of a few prompts that on their own outlast `llm.request_timeout` on a
/// healthy server, which opened the breaker again and again (a timeout was a hard fault) and
/// paused intake for every request of the endpoint: here the breaker does not open at all (the
/// server answers its probe, fast, every time), the 3 slow requests are dead-lettered with
/// reason `delivery_limit` and the last error (a timeout), and the normal requests sent
/// meanwhile are answered `ok`. A 400 ms request timeout, 2 attempts and a delivery limit of 3
/// keep it short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_few_poison_timeout_prompts_are_dead_lettered_and_never_open_the_breaker() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().slow_prompts_containing(SLOW, SLOW_DELAY).start().await.unwrap();
    let env = TestEnv::new("nu-poisontimeout");
    let mut raw = env.raw_config(fake.url.as_str());
    (raw.llm.request_timeout, raw.llm.max_attempts, raw.amqp.delivery_limit) = ("400ms".into(), 2, 3);
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let opened_before = circuit_openings();

    let bad: Vec<TestRequest> = (0..3).map(|i| slow(&format!("nu-slow-{i}"), i % 4)).collect();
    let bad_ids = ids(&bad);
    // The slow requests first, then normal traffic of the same keys (so they share batches) in
    // waves of 5 every 300 ms until the slow ones are dead-lettered: steady traffic, whose
    // answers show the probe's verdict right (without any, only timeouts since they began, the
    // breaker takes the server for too slow and opens: see the breaker's `probe_passed`).
    let started = Instant::now();
    st.amqp.publish_requests(&env.input_queue(), &bad, &st.reply).await;
    let mut normal: Vec<TestRequest> = Vec::new();
    while dead.distinct_of(&bad_ids) < bad.len() {
        assert!(started.elapsed() < Duration::from_secs(90), "the slow requests were not dead-lettered within 90 s");
        let wave = completions_workload(&format!("nu-normal-{}", normal.len() / 5), 5, 4);
        st.amqp.publish_requests(&env.input_queue(), &wave, &st.reply).await;
        normal.extend(wave);
        dead.collect_for(Duration::from_millis(300)).await;
    }
    let dead_in = started.elapsed();
    st.results.until_all(&ids(&normal), Duration::from_secs(60)).await;
    let normal_in = started.elapsed();
    let (opened, slow_calls) = judged_as_the_requests_own(&mut st, &dead, &fake, &normal, &bad, opened_before).await;
    let calls = fake.calls();
    let probes = calls.iter().filter(|c| c.prompts == [prefix_batcher::llm::PROBE_PROMPT]).count();
    eprintln!(
        "poison timeouts: {} answered ok in {normal_in:?}, 3 dead-lettered after {dead_in:?}, breaker opened {opened} times, \
         {slow_calls} of {} calls timed out, {probes} probes",
        normal.len(),
        calls.len()
    );
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A request queued in one batch behind requests that outlast `llm.request_timeout` on their own,
/// with calls one after the other (`llm.max_concurrency = 1`, `llm.list_prompts = false`).
/// Observed against llama-server: the slow ones timed out with no real call answered since, the
/// breaker took the server for too slow and opened, after each opening the batch went again in
/// the same order, the first slow request reopened the breaker on the trial close, and the normal
/// one was never sent (7 minutes and counting). Now the sequence stops once timeouts used the
/// batch's time for LLM calls (here one `llm.request_timeout`: `llm.max_attempts = 1`): the
/// prompts behind go back to the partition queue uncharged, and a request charged before goes
/// after the fresh ones of its batch, so the normal one is answered on its next delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_behind_slow_ones_in_its_batch_is_answered() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().slow_prompts_containing(SLOW, SLOW_DELAY).start().await.unwrap();
    let env = TestEnv::new("nu-behindslow");
    let mut raw = env.raw_config(fake.url.as_str());
    (raw.llm.request_timeout, raw.llm.max_attempts, raw.llm.max_concurrency, raw.llm.list_prompts) = ("400ms".into(), 1, 1, false);
    raw.batching.max_batch_wait = "1s".into(); // one batch: the 5 slow requests, then the normal one
    let mut st = start_with_replies(&env, &raw).await;
    let opened_before = circuit_openings();
    let slow_ones: Vec<TestRequest> = (0..5).map(|i| slow(&format!("nu-behind-slow-{i}"), 0)).collect();
    st.amqp.publish_requests(&env.input_queue(), &slow_ones, &st.reply).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let normal = vec![completion("nu-behind-normal", 0, " a short question?")];
    st.amqp.publish_requests(&env.input_queue(), &normal, &st.reply).await;
    let started = Instant::now();
    st.results.until_all(&ids(&normal), Duration::from_secs(30)).await;
    eprintln!(
        "behind slow requests: the normal request answered {:?} after it was published; breaker opened {} times",
        started.elapsed(),
        circuit_openings() - opened_before
    );
    let Started { amqp, daemon, results, .. } = st;
    daemon.stop().await.expect("daemon stops cleanly");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// A request that outlasts `llm.request_timeout` on its own, with one permit
/// (`llm.max_concurrency = 1`) and no other traffic, on a server that answered a real call
/// before: nothing else is answered while it runs, so the one-token probe alone took the server
/// for too slow, the breaker opened and closed again and again, and the request was never
/// charged (observed against llama-server `-np 1`: `/readyz` 503 for minutes). The probe now
/// replays the call answered before, which the server answers in time: the request is charged
/// each time and dead-lettered after `amqp.delivery_limit`, and the breaker never opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_outlasting_the_timeout_alone_with_one_permit_is_dead_lettered() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().slow_prompts_containing(SLOW, SLOW_DELAY).start().await.unwrap();
    let env = TestEnv::new("nu-alone");
    let mut raw = env.raw_config(fake.url.as_str());
    (raw.llm.request_timeout, raw.llm.max_attempts, raw.llm.max_concurrency, raw.amqp.delivery_limit) = ("400ms".into(), 1, 1, 3);
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    // One real call answered first: the call the probe can replay.
    let normal = vec![completion("nu-alone-normal", 1, " a short question?")];
    st.amqp.publish_requests(&env.input_queue(), &normal, &st.reply).await;
    st.results.until_all(&ids(&normal), Duration::from_secs(30)).await;
    let opened_before = circuit_openings();
    let bad = vec![slow("nu-alone-slow", 0)];
    let started = Instant::now();
    st.amqp.publish_requests(&env.input_queue(), &bad, &st.reply).await;
    while dead.distinct_of(&ids(&bad)) < 1 {
        assert!(started.elapsed() < Duration::from_secs(60), "not dead-lettered within 60 s (breaker opened {} times)", circuit_openings() - opened_before);
        dead.collect_for(Duration::from_millis(300)).await;
    }
    let dead_in = started.elapsed();
    let (opened, slow_calls) = judged_as_the_requests_own(&mut st, &dead, &fake, &normal, &bad, opened_before).await;
    let replays = fake.calls().iter().filter(|c| c.prompts.iter().any(|p| p.ends_with(" a short question?"))).count() - 1;
    eprintln!("alone with one permit: dead-lettered after {dead_in:?}, {slow_calls} timed-out calls, {replays} replays, breaker opened {opened} times");
    assert_eq!(slow_calls, 3, "one call per delivery (delivery limit 3, 1 attempt)");
    assert!(replays >= 1, "the probe replayed the call answered before");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// The observed case of one slow prompt in a list-prompt batch of 8 (`llm.list_prompts = true`,
/// the default): the list call was retried `llm.max_attempts` times, then its prompts one by one
/// with the slow one retried as often again, so the 7 others, answered, waited about twice what
/// the `amqp.consumer_timeout` check allows for; the guard requeued the whole batch, charged,
/// each time, and all 8 were dead-lettered although the server answered 7 of them every time.
/// Here the list goes prompt by prompt after its first timeout, the slow prompt's retries come
/// after the others and stop at the batch's time for LLM calls, and no delivery nears the guard:
/// the 7 are answered `ok` once each, the slow one is dead-lettered after `amqp.delivery_limit`,
/// and the breaker never opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_prompt_in_a_list_batch_costs_the_others_nothing() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().slow_prompts_containing(SLOW, SLOW_DELAY).start().await.unwrap();
    let env = TestEnv::new("nu-listslow");
    let mut raw = env.raw_config(fake.url.as_str());
    (raw.llm.request_timeout, raw.llm.max_attempts, raw.llm.list_prompts, raw.amqp.delivery_limit) = ("1s".into(), 3, true, 3);
    // The longest hold the check allows for: 0.5 s wait + 3 × 1 s + backoffs + 2 × 1 s ≈ 5.6 s,
    // within 0.8 × 7 s; the guard releases deliveries held 6.3 s (0.9 × 7 s). Before, this batch
    // was held about 2 × 3 × 1 s plus probes.
    (raw.amqp.confirm_timeout, raw.amqp.consumer_timeout, raw.batching.max_batch_wait) = ("1s".into(), "7s".into(), "500ms".into());
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let opened_before = circuit_openings();
    let mut batch: Vec<TestRequest> = (0..7).map(|i| completion(&format!("nu-listslow-{i}"), 0, &format!(" question {i}?"))).collect();
    // The same shape as the others (same key), only its marker makes it slow.
    let bad = vec![completion("nu-listslow-slow", 0, &format!(" {SLOW} question?"))];
    batch.insert(3, bad[0].clone());
    let normal: Vec<TestRequest> = batch.iter().filter(|r| r.id != bad[0].id).cloned().collect();
    let started = Instant::now();
    st.amqp.publish_requests(&env.input_queue(), &batch, &st.reply).await;
    st.results.until_all(&ids(&normal), Duration::from_secs(30)).await;
    let answered_in = started.elapsed();
    while dead.distinct_of(&ids(&bad)) < 1 {
        assert!(started.elapsed() < Duration::from_secs(60), "the slow request was not dead-lettered within 60 s");
        dead.collect_for(Duration::from_millis(300)).await;
    }
    let (opened, slow_calls) = judged_as_the_requests_own(&mut st, &dead, &fake, &normal, &bad, opened_before).await;
    let lists = fake.calls().iter().filter(|c| c.prompts.len() > 1).count();
    eprintln!("a slow prompt in a list batch: 7 answered in {answered_in:?}, {slow_calls} calls carried the slow prompt, {lists} list calls, breaker opened {opened} times");
    assert_eq!(st.results.received.len(), normal.len(), "each of the 7 answered once");
    assert_eq!(lists, 1, "the list call that timed out is not retried as a list");
    // Its first delivery: the list call, then its own calls after the others, as many as fit in
    // the batch's time (3 × 1 s, the list's second included); its 2 later deliveries, alone in
    // their batch: `llm.max_attempts` calls each, as any one-prompt call.
    assert!((2 + 2 * 3..=3 + 2 * 3).contains(&slow_calls), "calls that carried the slow prompt: {slow_calls}");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A chat request whose user message is `question`, on a system prompt of its own.
fn chat(id: &str, question: &str) -> TestRequest {
    let messages = json!([{"role": "system", "content": "nu-early: answer in one word."}, {"role": "user", "content": question}]);
    let body = json!({"id": id, "messages": messages, "params": {"max_tokens": 8}});
    TestRequest { id: id.to_owned(), body: serde_json::to_vec(&body).unwrap(), group: 1 }
}

/// When the fake received the `n`-th (1-based) call carrying [`SLOW`] on `path`.
fn slow_call_at(fake: &llm_fakes::fake::FakeLlmHandle, path: &str, n: usize) -> Option<Instant> {
    let slow_calls = fake.calls().into_iter().filter(|c| c.path == path && c.prompts.iter().any(|p| p.contains(SLOW)));
    slow_calls.map(|c| c.received_at).nth(n - 1)
}

/// A prompt containing this is refused by the fake (HTTP 400), alone.
const REFUSED: &str = "NU-REFUSED";

/// The results of a slow prompt's batch-mates used to be published with the batch, once the slow
/// prompt's retries ended: up to `llm.max_attempts` × `llm.request_timeout` later (20 minutes with
/// the defaults), for requests the server had answered (or refused) at once. Here one prompt
/// outlasts the timeout in a batch of 4 sent one after the other (`llm.list_prompts = false`) and
/// one chat call in a batch of 5 chat calls, one of which the server refuses: the others of each
/// batch get their results (the refused one `ok: false`) before the slow one's next attempt is
/// even sent, and each slow request is dead-lettered once (`amqp.delivery_limit = 1`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_requests_do_not_wait_for_a_slow_batch_mates_retries() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().slow_prompts_containing(SLOW, SLOW_DELAY).fail_prompts_containing(REFUSED, 400).start().await.unwrap();
    let env = TestEnv::new("nu-early");
    let mut raw = env.raw_config(fake.url.as_str());
    (raw.llm.request_timeout, raw.llm.max_attempts, raw.llm.list_prompts, raw.amqp.delivery_limit) = ("2s".into(), 3, false, 1);
    (raw.batching.max_batch_wait, raw.sharding.default_shards) = ("500ms".into(), 1);
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let opened_before = circuit_openings();
    // The slow ones first in their batches: the others are sent after its first timeout.
    let slow_completion = completion("nu-early-slow", 0, &format!(" {SLOW} question?"));
    let completions: Vec<TestRequest> = (0..3).map(|i| completion(&format!("nu-early-{i}"), 0, &format!(" question {i}?"))).collect();
    let slow_chat = chat("nu-early-chat-slow", &format!("{SLOW} question?"));
    let refused = chat("nu-early-chat-refused", &format!("{REFUSED} question?"));
    let mut chats: Vec<TestRequest> = (0..3).map(|i| chat(&format!("nu-early-chat-{i}"), &format!("question {i}?"))).collect();
    let bad = vec![slow_completion.clone(), slow_chat.clone()];
    let all: Vec<TestRequest> = [vec![slow_completion, slow_chat, refused.clone()], completions.clone(), chats.clone()].concat();
    st.amqp.publish_requests(&env.input_queue(), &all, &st.reply).await;
    chats.push(refused.clone());
    // When each of the two sets was all answered (at most this late).
    let (mut chats_answered, mut completions_answered) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(30);
    while chats_answered.is_none() || completions_answered.is_none() {
        assert!(st.results.next_until(deadline).await, "not all answered within 30 s");
        let got: HashSet<&str> = st.results.received.iter().map(|m| m.correlation_id.as_str()).collect();
        for (set, at) in [(&chats, &mut chats_answered), (&completions, &mut completions_answered)] {
            if at.is_none() && set.iter().all(|r| got.contains(r.id.as_str())) {
                *at = Some(Instant::now());
            }
        }
    }
    let (chats_answered, completions_answered) = (chats_answered.unwrap(), completions_answered.unwrap());
    let started = Instant::now();
    while dead.distinct_of(&ids(&bad)) < bad.len() {
        assert!(started.elapsed() < Duration::from_secs(60), "the slow requests were not dead-lettered within 60 s");
        dead.collect_for(Duration::from_millis(300)).await;
    }
    // Each slow request made its 3 attempts in its one delivery.
    let last_completion_attempt = slow_call_at(&fake, "/v1/completions", 3).expect("3 calls of the slow prompt");
    let second_chat_attempt = slow_call_at(&fake, "/v1/chat/completions", 2).expect("a second call of the slow chat request");
    st.results.barrier(&st.amqp).await;
    eprintln!(
        "early answers: completions published {:?} before the slow prompt's last attempt was sent, chat {:?} before the slow chat request's second attempt",
        last_completion_attempt.saturating_duration_since(completions_answered),
        second_chat_attempt.saturating_duration_since(chats_answered),
    );
    assert!(completions_answered < last_completion_attempt, "the 3 completions waited for the slow prompt's retries");
    assert!(chats_answered < second_chat_attempt, "the chat requests waited for the slow chat request's retries");
    // One result each, `ok` but for the refused one; no result for the slow ones, one dead
    // letter each.
    let mut answered: Vec<&str> = st.results.received.iter().map(|m| m.correlation_id.as_str()).collect();
    answered.sort_unstable();
    let mut expected: Vec<&str> = completions.iter().chain(&chats).map(|r| r.id.as_str()).collect();
    expected.sort_unstable();
    assert_eq!(answered, expected, "one result for each answered or refused request");
    for m in &st.results.received {
        let r = m.result();
        assert_eq!(r.ok, m.correlation_id != refused.id, "{}: {:?}", m.correlation_id, r.error);
    }
    assert_eq!(dead.received.len(), bad.len(), "each slow request is dead-lettered once");
    assert_eq!(circuit_openings() - opened_before, 0.0, "the breaker opened");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// The value of the process-wide metric line starting with `prefix` (0 when absent).
fn metric(prefix: &str) -> f64 {
    let text = prefix_batcher::metrics::render();
    text.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// `prefix_batcher_consumer_restarts_total` for the `amqp.consumer_timeout` guard, which returns
/// what it holds charged.
const GUARD_RESTARTS: &str = "prefix_batcher_consumer_restarts_total{reason=\"consumer_timeout\"}";
/// Requests put back in their partition queue uncharged.
const RETURNED_UNCHARGED: &str = "prefix_batcher_requests_total{outcome=\"returned_uncharged\",stage=\"batcher\"}";

/// The configuration of the outage tests: `llm.request_timeout` 1 s and 2 attempts,
/// `amqp.delivery_limit` 1 (a single charged delivery dead-letters a request), and the smallest
/// `amqp.consumer_timeout` the check accepts with those, about 5.2 s: 6 s (its guard fires at
/// 5.4 s).
fn outage_config(env: &TestEnv, llm_url: &str) -> prefix_batcher::config::RawConfig {
    let mut raw = env.raw_config(llm_url);
    (raw.llm.request_timeout, raw.llm.max_attempts, raw.amqp.delivery_limit) = ("1s".into(), 2, 1);
    (raw.amqp.confirm_timeout, raw.amqp.consumer_timeout) = ("1s".into(), "6s".into());
    raw
}

/// Stops the daemon, closes `dead` and the results, and cleans up.
async fn stop_and_clean(env: TestEnv, st: Started, dead: Collector) {
    let Started { amqp, daemon, results, .. } = st;
    daemon.stop().await.expect("daemon stops cleanly");
    for c in [dead, results] {
        c.close().await;
    }
    amqp.close().await;
    env.cleanup().await;
}

/// The observed case of a server that turns too slow for every real call after a batch spent its
/// time for LLM calls on timeouts (its one-token probe still passing, nothing answered yet to
/// replay): the breaker opened, the requests waited for the endpoint in memory, and the
/// `amqp.consumer_timeout` guard, which counts from when a request was received, returned them
/// charged 3 s into the outage; with `amqp.delivery_limit = 1` all were dead-lettered. Now a batch
/// stops waiting before the guard would fire and puts its requests back uncharged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_after_a_batch_spent_its_time_charges_nothing() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().slow_prompts_containing("question", SLOW_DELAY).start().await.unwrap();
    let env = TestEnv::new("nu-lateoutage");
    let raw = outage_config(&env, fake.url.as_str());
    let st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let (guard, returned) = (GUARD_RESTARTS, RETURNED_UNCHARGED);
    let (guard_before, returned_before) = (metric(guard), metric(returned));
    let reqs: Vec<TestRequest> = (0..4).map(|i| completion(&format!("nu-lateoutage-{i}"), 0, &format!(" question {i}?"))).collect();
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let started = Instant::now();
    while metric(returned) < returned_before + reqs.len() as f64 {
        assert!(started.elapsed() < Duration::from_secs(30), "the waiting requests were not put back uncharged within 30 s");
        dead.collect_for(Duration::from_millis(300)).await;
    }
    dead.collect_for(Duration::from_secs(2)).await;
    assert_eq!(dead.received.len(), 0, "dead-lettered (charged with delivery_limit 1): {:?}", dead.received.first().map(|m| &m.headers));
    assert_eq!(metric(guard), guard_before, "the consumer_timeout guard returned requests charged");
    eprintln!("late outage: put back uncharged after {:?}, breaker opened {} times", started.elapsed(), circuit_openings());
    stop_and_clean(env, st, dead).await;
}

/// An outage longer than the `amqp.consumer_timeout` guard's limit: the partition's intake is
/// paused, and the requests the broker had already sent it wait in the consumer's buffer, where
/// the guard (which sees only held requests) did not look; RabbitMQ's own `consumer_timeout`
/// would have closed the channel and charged each a delivery (with `amqp.delivery_limit = 1`:
/// dead-lettered). Now each guard period they go back to the queue uncharged, so during a 6 s
/// `consumer_timeout` (guard at 5.4 s) outage every request is put back uncharged at least twice,
/// and once the server is back each is answered `ok`, once, and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_for_a_paused_intake_go_back_uncharged_within_the_consumer_timeout() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().start().await.unwrap();
    fake.set_refuse(true).await;
    let env = TestEnv::new("nu-pausedbuf");
    let mut raw = outage_config(&env, fake.url.as_str());
    (raw.keying.mode, raw.sharding.default_shards) = ("prefix".into(), 1);
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let (guard, returned) = (GUARD_RESTARTS, RETURNED_UNCHARGED);
    let (guard_before, returned_before) = (metric(guard), metric(returned));
    // One group: one partition, whose intake pauses at the first refused call.
    let reqs: Vec<TestRequest> = (0..8).map(|i| completion(&format!("nu-pausedbuf-{i}"), 0, &format!(" question {i}?"))).collect();
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let started = Instant::now();
    let twice = returned_before + 2.0 * reqs.len() as f64;
    while metric(returned) < twice {
        let put_back = metric(returned) - returned_before;
        assert!(started.elapsed() < Duration::from_secs(40), "{put_back} requests put back uncharged in 40 s, fewer than twice each");
        dead.collect_for(Duration::from_millis(300)).await;
    }
    let outage = started.elapsed();
    fake.set_refuse(false).await;
    eprintln!("paused intake: {} put back uncharged in {outage:?}", metric(returned) - returned_before);
    answered_once_none_charged(&mut st, &mut dead, &reqs, guard_before).await;
    stop_and_clean(env, st, dead).await;
}

/// Once the server is back: every one of `reqs` is answered `ok`, once, nothing is
/// dead-lettered (with `amqp.delivery_limit = 1` a charged delivery would be), and the
/// `amqp.consumer_timeout` guard (at `guard_before` restarts before) returned nothing.
async fn answered_once_none_charged(st: &mut Started, dead: &mut Collector, reqs: &[TestRequest], guard_before: f64) {
    st.results.until_all(&ids(reqs), DEADLINE).await;
    st.results.collect_for(Duration::from_millis(500)).await;
    dead.collect_for(Duration::from_millis(500)).await;
    assert_eq!(dead.received.len(), 0, "dead-lettered (charged with delivery_limit 1): {:?}", dead.received.first().map(|m| &m.headers));
    assert_eq!(metric(GUARD_RESTARTS), guard_before, "the consumer_timeout guard returned requests charged");
    let results: Vec<_> = st.results.received.iter().map(|m| m.result()).collect();
    assert_eq!(results.len(), reqs.len(), "each request answered once");
    assert!(results.iter().all(|r| r.ok), "ok: false results: {:?}", results.iter().find(|r| !r.ok));
}

/// Reported: a batch that flushes while every endpoint is down (its requests taken before the
/// breaker opened, waiting for `batching.max_batch_wait`) waited for an endpoint without a
/// bound in its first round of calls, until the `amqp.consumer_timeout` guard returned its
/// requests charged: with `amqp.delivery_limit = 1`, dead-lettered. Group 0's 4 requests fill a
/// batch at once, and its calls' 503s open the breaker; group 1's one request flushes 1.5 s later,
/// into the outage. It must go back uncharged by its release time (2.8 s after its receipt, the
/// guard at 5.4 s), and be answered once the server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_starts_in_an_outage_goes_back_uncharged() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().start().await.unwrap();
    fake.set_status(Some(503));
    let env = TestEnv::new("nu-startout");
    let mut raw = outage_config(&env, fake.url.as_str());
    // One attempt per call: the longest hold must stay within 0.8 × consumer_timeout.
    (raw.batching.max_batch_size, raw.batching.max_batch_wait, raw.llm.max_attempts) = (4, "1500ms".into(), 1);
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let (guard, returned) = (GUARD_RESTARTS, RETURNED_UNCHARGED);
    let (guard_before, returned_before, opened_before) = (metric(guard), metric(returned), circuit_openings());
    let mut reqs: Vec<TestRequest> = (0..4).map(|i| completion(&format!("nu-startout-{i}"), 0, &format!(" question {i}?"))).collect();
    reqs.push(completion("nu-startout-late", 1, " the late batch?"));
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let started = Instant::now();
    while metric(returned) < returned_before + reqs.len() as f64 {
        let put_back = metric(returned) - returned_before;
        assert!(started.elapsed() < Duration::from_secs(30), "{put_back} of {} requests put back uncharged in 30 s", reqs.len());
        dead.collect_for(Duration::from_millis(300)).await;
    }
    assert!(circuit_openings() > opened_before, "the 503s opened the breaker");
    fake.set_status(None);
    answered_once_none_charged(&mut st, &mut dead, &reqs, guard_before).await;
    stop_and_clean(env, st, dead).await;
}

/// The observed case of a server answering every call with HTTP 200 and a body that is no
/// completion (a misconfigured gateway's HTML), which turned requests into `ok: false` results
/// with `invalid_response` while the breaker stayed closed: here the breaker opens (its probe
/// validates the answer), intake pauses, and with `amqp.delivery_limit = 1` (a single charged
/// delivery would dead-letter a request) nothing is dead-lettered; once the server answers
/// properly, every request is answered `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_answering_200_garbage_costs_requests_nothing() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().start().await.unwrap();
    fake.set_garbage(true);
    let env = TestEnv::new("nu-garbage200");
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.delivery_limit = 1;
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let opened_before = circuit_openings();

    let reqs = completions_workload("nu-garbage", 60, 4);
    let started = Instant::now();
    for chunk in reqs.chunks(10) {
        st.amqp.publish_requests(&env.input_queue(), chunk, &st.reply).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The garbage lasts ≥ 6 s, long enough for several probes (open time 1 s, then 2 s, 4 s).
    let opened = wait_until(Duration::from_secs(20), || circuit_openings() > opened_before).await;
    assert!(opened, "the breaker never opened while every answer was garbage");
    tokio::time::sleep_until(started + Duration::from_secs(6)).await;
    st.results.barrier(&st.amqp).await;
    let early = st.results.received.len();
    let garbage_calls = fake.call_count();
    fake.set_garbage(false);
    st.results.until_all(&ids(&reqs), Duration::from_secs(60)).await;
    let recovered_in = started.elapsed();
    st.results.barrier(&st.amqp).await;

    let not_ok: Vec<_> = st.results.received.iter().filter(|m| !m.result().ok).collect();
    assert!(not_ok.is_empty(), "{} ok:false results, e.g. {}", not_ok.len(), String::from_utf8_lossy(&not_ok[0].body));
    assert_eq!(early, 0, "no result while every answer was garbage");
    dead.barrier(&st.amqp).await;
    assert_eq!(dead.received.len(), 0, "dead-lettered (charged a delivery): {:?}", dead.received.first().map(|m| &m.headers));
    let openings = circuit_openings() - opened_before;
    eprintln!(
        "garbage 200: {garbage_calls} calls (probes included) answered garbage, breaker opened {openings} times, \
         60 answered ok after {recovered_in:?}"
    );
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// Polls `cond` every 50 ms until it holds (true) or `within` passes (false).
async fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond()
}

/// Requests charged a delivery (requeued after a fault that may be their own).
const CHARGED: &str = "prefix_batcher_requests_total{outcome=\"requeued\",stage=\"publisher\"}";

/// A prompt containing this takes the server down ([`CrashingServer`]).
const CRASH: &str = "NU-CRASH";

/// A TCP proxy in front of a server that behaves like a server process a prompt kills: when the
/// bytes of a request contain [`CRASH`], every connection through it is cut without an answer
/// (the one carrying the prompt too), and its port refuses connections for `down_for` (the
/// process restarting), then accepts them again.
struct CrashingServer {
    url: String,
    crashes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl CrashingServer {
    async fn start(upstream: &url::Url, down_for: Duration) -> CrashingServer {
        use std::sync::atomic::AtomicUsize;
        use std::sync::Arc;
        let upstream = format!("{}:{}", upstream.host_str().unwrap(), upstream.port().unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let crashes = Arc::new(AtomicUsize::new(0));
        let (crash, _) = tokio::sync::watch::channel(0usize);
        let counter = crashes.clone();
        let task = tokio::spawn(async move {
            let mut listener = Some(listener);
            let mut crashed = crash.subscribe();
            loop {
                let Some(l) = listener.as_ref() else {
                    tokio::time::sleep(down_for).await;
                    // The same port again (tokio sets SO_REUSEADDR); a port taken meanwhile
                    // would leave the server down, which the test's deadlines report.
                    for _ in 0..500 {
                        listener = tokio::net::TcpListener::bind(addr).await.ok();
                        if listener.is_some() {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    if listener.is_none() {
                        eprintln!("the crashing server could not bind {addr} again");
                        return;
                    }
                    crashed.borrow_and_update();
                    continue;
                };
                tokio::select! {
                    _ = crashed.changed() => listener = None,
                    accepted = l.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        // Subscribed before the upstream connection is made: a crash meanwhile cuts it.
                        let (crash, crashed, counter, upstream) = (crash.clone(), crash.subscribe(), counter.clone(), upstream.clone());
                        tokio::spawn(async move {
                            let Ok(server) = tokio::net::TcpStream::connect(upstream).await else { return };
                            relay_until_crash(client, server, crash, crashed, counter).await;
                        });
                    }
                }
            }
        });
        CrashingServer { url: format!("http://{addr}"), crashes, task }
    }

    fn crashes(&self) -> usize {
        self.crashes.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for CrashingServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Relays bytes both ways until either side closes or a crash (its own request carried
/// [`CRASH`], or another connection's did) cuts both.
async fn relay_until_crash(
    mut client: tokio::net::TcpStream,
    mut server: tokio::net::TcpStream,
    crash: tokio::sync::watch::Sender<usize>,
    mut crashed: tokio::sync::watch::Receiver<usize>,
    counter: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut up, mut down) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    // The tail of the request bytes so far, so that a marker split between two reads is seen.
    let mut seen: Vec<u8> = Vec::new();
    loop {
        tokio::select! {
            _ = crashed.changed() => return,
            n = client.read(&mut up) => {
                let Ok(n) = n.map(|n| n.min(up.len())) else { return };
                if n == 0 { return }
                seen.extend_from_slice(&up[..n]);
                if seen.windows(CRASH.len()).any(|w| w == CRASH.as_bytes()) {
                    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    crash.send_modify(|n| *n += 1);
                    return;
                }
                seen.drain(..seen.len().saturating_sub(CRASH.len()));
                if server.write_all(&up[..n]).await.is_err() { return }
            }
            n = server.read(&mut down) => {
                let Ok(n) = n else { return };
                if n == 0 || client.write_all(&down[..n]).await.is_err() { return }
            }
        }
    }
}

/// A prompt that crashes the server (its process dies; it comes back a second later) among
/// normal requests of its key. The server was down when the daemon probed it, so each crash
/// was an outage: the request went back uncharged and took the server down again on every
/// restart, for ever. Now a request that was in flight when the endpoint went down twice is sent
/// alone, one at a time per endpoint; when the server goes down during such a call for the
/// second time, the request is charged a delivery, so it is dead-lettered after
/// `amqp.delivery_limit` (3 here) with the crash as its last error, and the normal requests
/// are each answered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_crashes_the_server_is_dead_lettered_and_the_others_answered() {
    let _serial = SERIAL.lock().await;
    let fake = FakeLlm::new().latency(Duration::from_millis(50)).start().await.unwrap();
    let server = CrashingServer::start(&fake.url, Duration::from_millis(1500)).await;
    let env = TestEnv::new("nu-crash");
    let mut raw = env.raw_config(&server.url);
    raw.amqp.delivery_limit = 3;
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let charged_before = metric(CHARGED);

    // Warm: the server answered real calls before (so its probes can replay one).
    let warm = completions_workload("nu-crash-warm", 8, 2);
    st.amqp.publish_requests(&env.input_queue(), &warm, &st.reply).await;
    st.results.until_all(&ids(&warm), Duration::from_secs(30)).await;
    // The crashing request first, in one batch with normal requests of its key.
    let prompt = format!("{} {CRASH} a prompt the server dies on", group_prefix(0));
    let body = json!({"id": "nu-crash-0", "prompt": prompt, "params": {"max_tokens": 8}});
    let bad = vec![TestRequest { id: "nu-crash-0".into(), body: serde_json::to_vec(&body).unwrap(), group: 0 }];
    let normal = completions_workload("nu-crash-normal", 24, 2);
    let started = Instant::now();
    st.amqp.publish_requests(&env.input_queue(), &bad, &st.reply).await;
    st.amqp.publish_requests(&env.input_queue(), &normal, &st.reply).await;
    dead.until_all(&ids(&bad), Duration::from_secs(120)).await;
    let dead_in = started.elapsed();
    st.results.until_all(&ids(&normal), Duration::from_secs(60)).await;
    st.results.barrier(&st.amqp).await;
    let all_normal: Vec<TestRequest> = warm.iter().chain(&normal).cloned().collect();
    assert_answered_and_dead_lettered(&st.results, &dead, &all_normal, &bad, "went down during this request's calls");
    assert_eq!(st.results.received.len(), all_normal.len(), "each normal request answered once");
    let crashes = server.crashes();
    // Only the crashing request was charged: once per delivery but its last.
    let charged = metric(CHARGED) - charged_before;
    assert_eq!(charged, f64::from(raw.amqp.delivery_limit), "requests charged a delivery");
    eprintln!("crashing prompt: dead-lettered after {dead_in:?} and {crashes} crashes of the server; {} others answered once", normal.len());
    assert!(crashes <= raw.amqp.delivery_limit as usize + 4, "{crashes} crashes for a delivery limit of {}", raw.amqp.delivery_limit);
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}
