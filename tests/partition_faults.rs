//! Faults under an owned partition, against the real RabbitMQ and Redis with the daemon in this
//! process: every delivery must reach a definite outcome (ack after a confirmed publish, or nack
//! with requeue), a server-wide LLM failure must pause intake instead of burning the backlog into
//! `ok: false` results, and one bad request must harm no other.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::Arc;
use std::num::NonZeroU32;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use common::*;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use llm_fakes::fake::{FakeLlm, FakeLlmHandle};
use prefix_batcher::config::{AmqpSettings, RawConfig, Settings};
use prefix_batcher::keying::{partition_of, PrefixKey};
use prefix_batcher::llm::{ClientOptions, LlmClient};
use prefix_batcher::topology;
use serde_json::{json, Value};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A prompt containing this is refused by [`SwitchableLlm`] with a 400 (a request fault).
const REJECTED: &str = "REJECT-ME";

/// A call with a prompt containing this gets a 500 from [`SwitchableLlm`] (a prompt that crashes
/// the server: a server fault the probe does not share).
const POISON: &str = "CRASH-ME";

/// An OpenAI-style completions server on an OS-chosen port whose every answer (completions and
/// the circuit breaker's one-token probe completion alike) is HTTP `status` while it is not 200: an outage that can be
/// switched on and off. While up, it answers 400 to any call with a prompt containing
/// [`REJECTED`].
struct SwitchableLlm {
    url: String,
    status: Arc<AtomicU16>,
    /// `POST /v1/completions` calls answered with an error status.
    failed_calls: Arc<AtomicUsize>,
    /// While set, every call but the daemon's one-token probe (prompt `ping`) gets a 500.
    probe_only: Arc<std::sync::atomic::AtomicBool>,
    stop: CancellationToken,
}

impl SwitchableLlm {
    async fn start(status: u16) -> SwitchableLlm {
        let state = Arc::new(AtomicU16::new(status));
        let failed_calls = Arc::new(AtomicUsize::new(0));
        let probe_only = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, f, po) = (state.clone(), failed_calls.clone(), probe_only.clone());
        let completions = move |Json(body): Json<Value>| {
            let (status, failed) = (s.load(Ordering::SeqCst), f.clone());
            let probe_only = po.load(Ordering::SeqCst);
            async move {
                if status != 200 {
                    failed.fetch_add(1, Ordering::SeqCst);
                    return outage(status);
                }
                // A list from the daemon's calls, a string from its probe.
                let prompts = match &body["prompt"] {
                    Value::Array(list) => list.clone(),
                    p @ Value::String(_) => vec![p.clone()],
                    _ => Vec::new(),
                };
                let probe = prompts.len() == 1 && prompts[0].as_str() == Some(prefix_batcher::llm::PROBE_PROMPT);
                if (probe_only && !probe) || prompts.iter().any(|p| p.as_str().is_some_and(|p| p.contains(POISON))) {
                    failed.fetch_add(1, Ordering::SeqCst);
                    return outage(500);
                }
                if prompts.iter().any(|p| p.as_str().is_some_and(|p| p.contains(REJECTED))) {
                    let error = json!({"error": {"message": "prompt too long", "type": "invalid_request_error"}});
                    return (StatusCode::BAD_REQUEST, Json(error)).into_response();
                }
                let choices: Vec<Value> = prompts
                    .iter()
                    .enumerate()
                    .map(|(i, p)| json!({"index": i, "text": format!("answer:{}", p.as_str().unwrap_or("")), "finish_reason": "stop"}))
                    .collect();
                Json(json!({"object": "text_completion", "model": "test-model", "choices": choices})).into_response()
            }
        };
        let app = axum::Router::new().route("/v1/completions", axum::routing::post(completions));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        let shutdown = stop.clone().cancelled_owned();
        tokio::spawn(async move { axum::serve(listener, app).with_graceful_shutdown(shutdown).await });
        SwitchableLlm { url, status: state, failed_calls, probe_only, stop }
    }

    fn set(&self, status: u16) {
        self.status.store(status, Ordering::SeqCst);
    }
}

impl Drop for SwitchableLlm {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn outage(status: u16) -> Response {
    let status = StatusCode::from_u16(status).unwrap();
    (status, Json(json!({"error": {"message": "outage", "type": "server_error"}}))).into_response()
}

/// `n` requests of group `g`, ids `{tag}-{i}`.
fn one_key(tag: &str, n: usize, g: usize) -> Vec<TestRequest> {
    (0..n).map(|i| completion(&format!("{tag}-{i}"), g, &format!(" question {i}?"))).collect()
}

/// Ready messages over every partition queue.
async fn ready_in_partitions(amqp: &Amqp, env: &TestEnv) -> u32 {
    let mut ready = 0;
    for p in 0..PARTITIONS {
        ready += amqp.queue_depth(&env.partition_queue(p)).await.0;
    }
    ready
}

/// Messages in the partition queues, ready or delivered and held unacked (from `rabbitmqctl`,
/// whose quorum-queue counts lag a little: callers wait on them with a deadline).
fn waiting_in_partitions(env: &TestEnv) -> u64 {
    let first = env.partition_queue(0);
    let prefix = first.trim_end_matches(|c: char| c.is_ascii_digit());
    broker::queues(prefix).iter().map(|(_, ready, unacked)| ready + unacked).sum()
}

/// A daemon with `amqp.delivery_limit = 1` (one delivery charged to a request dead-letters it)
/// holding every partition, and a consumer of its dead-letter queue.
async fn start_charging_every_delivery(test: &str, llm_url: &str) -> (TestEnv, Started, Collector) {
    let (env, _, started, dead) = start_with_delivery_limit(test, llm_url, None, 1).await;
    (env, started, dead)
}

/// A daemon with `amqp.delivery_limit = limit`, connected to RabbitMQ as `user` when given,
/// holding every partition, and a consumer of its dead-letter queue; also returns the daemon's
/// configuration.
async fn start_with_delivery_limit(test: &str, llm_url: &str, user: Option<&BrokerUser>, limit: u32) -> (TestEnv, RawConfig, Started, Collector) {
    let env = TestEnv::new(test);
    let mut raw = env.raw_config(llm_url);
    raw.amqp.delivery_limit = limit;
    if let Some(user) = user {
        raw.amqp.url = user.url();
    }
    let started = start_with_replies(&env, &raw).await;
    let dead = started.amqp.consume(&env.dead_letter_queue()).await;
    (env, raw, started, dead)
}

/// Stops the daemon gracefully, then checks that nothing was left unsettled (a delivery held
/// unacked would be back in its partition queue once the daemon's channels are closed), and
/// cleans up.
async fn stop_and_check_nothing_held(env: TestEnv, started: Started, others: Vec<Collector>) {
    let Started { amqp, daemon, results, .. } = started;
    daemon.stop().await.expect("daemon stops cleanly");
    assert_eq!(ready_in_partitions(&amqp, &env).await, 0, "requests left in (or returned to) the partition queues");
    assert_eq!(amqp.queue_depth(&env.input_queue()).await.0, 0, "input queue not empty");
    for c in others.into_iter().chain([results]) {
        c.close().await;
    }
    amqp.close().await;
    env.cleanup().await;
}

/// A test namespace and a daemon in it holding every partition, against the LLM at `llm_url`.
async fn start(test: &str, llm_url: &str) -> (TestEnv, Started) {
    let env = TestEnv::new(test);
    let raw = env.raw_config(llm_url);
    let started = start_with_replies(&env, &raw).await;
    (env, started)
}

/// The value of the sample `series` (name and labels, as rendered) in this process's metrics; 0
/// when absent.
fn metric(series: &str) -> f64 {
    let text = prefix_batcher::metrics::render();
    let line = text.lines().find(|l| l.rsplit_once(' ').is_some_and(|(s, _)| s == series));
    line.and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
}

/// A policy on the broker's `/` vhost, cleared when dropped, so a failing test leaves none behind.
struct Policy(String);

impl Policy {
    /// Sets policy `name` on the queues matching `pattern` with `definition` (JSON), priority 100.
    fn set(name: &str, pattern: &str, definition: &str) -> Policy {
        broker::rabbitmqctl(&["set_policy", "-p", "/", "--apply-to", "queues", "--priority", "100", name, pattern, definition]).expect("rabbitmqctl set_policy");
        Policy(name.to_owned())
    }

    /// A policy that makes `queue` hold one message and refuse further publishes.
    fn refusing(name: &str, queue: &str) -> Policy {
        Policy::set(name, &format!("^{}$", queue.replace('.', "\\.")), r#"{"max-length": 1, "overflow": "reject-publish"}"#)
    }
}

impl Drop for Policy {
    fn drop(&mut self) {
        let _ = broker::rabbitmqctl(&["clear_policy", "-p", "/", &self.0]);
    }
}

/// Makes the results queue of `env` refuse every result: it is filled with two messages and gets
/// a policy of one message at most with `reject-publish` (a quorum queue takes one publish beyond
/// `max-length` before it refuses). Dropping the returned policy makes it take results again.
async fn refuse_results(env: &TestEnv, amqp: &Amqp) -> Policy {
    let results_queue = env.results_queue();
    for _ in 0..2 {
        amqp.publish(&results_queue, b"{\"filler\": true}", lapin::BasicProperties::default()).await;
    }
    Policy::refusing(&env.name, &results_queue)
}

/// An LLM server that accepts connections and never answers (a frozen process: SIGSTOP, a paused
/// VM), on an OS-chosen port; it stops accepting when dropped.
struct FrozenLlm {
    url: String,
    /// Connections accepted so far.
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl FrozenLlm {
    async fn start() -> FrozenLlm {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                held.push(stream);
            }
        });
        FrozenLlm { url, accepted, task }
    }
}

impl Drop for FrozenLlm {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Stops `daemon`, which must end cleanly (`expect` says why), then waits (≤ 20 s) until exactly
/// `n` requests are in `env`'s partition queues: every one it held put back once. Returns how
/// long the stop took.
async fn stop_and_wait_all_back(daemon: Daemon, env: &TestEnv, n: usize, expect: &str) -> Duration {
    let stopping = Instant::now();
    daemon.stop().await.expect(expect);
    let took = stopping.elapsed();
    wait_all_back(env, n, "after the stop").await;
    took
}

/// Waits (≤ 20 s) until the partition queues hold exactly `n` messages, all ready (none
/// unacked: a count taken after the stop), and fails naming `when` otherwise. RabbitMQ refreshes
/// a quorum queue's counts every few seconds (`quorum_tick_interval`, 5 s by default), so a count
/// read right after a stop can predate it (`n` held unacked) or fall between a drain's publish of
/// an uncharged copy and its ack of the original (`n` and more); neither passes or fails here.
async fn wait_all_back(env: &TestEnv, n: usize, when: &str) {
    let first = env.partition_queue(0);
    let prefix = first.trim_end_matches(|c: char| c.is_ascii_digit()).to_owned();
    let counts = || {
        let qs = broker::queues(&prefix);
        (qs.iter().map(|(_, ready, _)| ready).sum::<u64>(), qs.iter().map(|(_, _, unacked)| unacked).sum::<u64>())
    };
    let back = wait_for("every held request back in its partition queue, once", Duration::from_secs(20), || async { counts() == (n as u64, 0) }).await;
    let (ready, unacked) = counts();
    assert!(back, "{when}: {ready} ready and {unacked} unacked messages in the partition queues, not {n} and 0");
}

/// Declares the exclusive reply queue `name`, which holds `max_len` messages and refuses
/// publishes beyond them (`x-max-length`, `x-overflow = reject-publish`).
async fn declare_refusing_reply_queue(ch: &lapin::Channel, name: &str, max_len: i32) {
    let mut args = FieldTable::default();
    args.insert(ShortString::from("x-max-length"), AMQPValue::LongInt(max_len));
    args.insert(ShortString::from("x-overflow"), AMQPValue::LongString("reject-publish".into()));
    let opts = QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() };
    ch.queue_declare(name.into(), opts, args).await.expect("declare the refusing reply queue");
}

/// A reply queue that refuses publishes once it holds one message (`x-max-length = 1`,
/// `x-overflow = reject-publish`) and is never consumed: 70 requests on one key answer into it,
/// then 10 more on the same key with a normal reply queue. The 10 are answered at once; the 69
/// refused results go to the results queue with `x-reply-to-refused = nacked` and the original
/// `x-reply-to`; nothing stays unacked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_reply_queue_diverts_results_and_stalls_nothing() {
    let fake = FakeLlm::new().start().await.unwrap();
    let (env, mut st) = start("fullreply", fake.url.as_str()).await;
    let (amqp, reply) = (&st.amqp, st.reply.clone());
    let full = format!("{}.full", env.name);
    declare_refusing_reply_queue(&amqp.ch, &full, 1).await;
    let mut diverted = amqp.consume(&env.results_queue()).await;
    let replaced = || metric("prefix_batcher_publish_channels_replaced_total{reason=\"publish_failed\"}");
    let replaced_before = replaced();

    let refused = one_key("refused", 70, 0);
    amqp.publish_requests(&env.input_queue(), &refused, &full).await;
    let normal = one_key("normal", 10, 0);
    let started = Instant::now();
    amqp.publish_requests(&env.input_queue(), &normal, &reply).await;
    st.results.until_all(&ids(&normal), Duration::from_secs(30)).await;
    let answered_in = started.elapsed();

    let refused_ids = ids(&refused);
    diverted.until("69 refused results", Duration::from_secs(30), |r| {
        r.iter().filter(|m| refused_ids.contains(&m.correlation_id)).map(|m| &m.correlation_id).collect::<HashSet<_>>().len() >= 69
    })
    .await;
    for m in diverted.received.iter().filter(|m| refused_ids.contains(&m.correlation_id)) {
        assert_eq!(m.header("x-reply-to-refused"), Some("nacked"), "{:?}", m.headers);
        assert_eq!(m.header("x-reply-to"), Some(full.as_str()));
        assert!(m.result().ok);
    }
    assert_eq!(amqp.queue_depth(&full).await.0, 1, "the full reply queue holds its one result");
    assert!(replaced() > replaced_before, "the channel replacements after the refusals are counted");
    eprintln!("full reply queue: the 10 answered in {answered_in:?}; {} refused results diverted", diverted.received.len());
    stop_and_check_nothing_held(env, st, vec![diverted]).await;
}

/// A result whose reply queue does not exist, held while the results queue refuses it too
/// (full, `reject-publish`): each attempt finds `reply_to` unroutable again, and
/// `reply_to_refused_total{reason="unroutable"}` counts each result once, not once per attempt
/// (observed: 239 for 200 requests, each held attempt counted again). Every request gets one
/// result in the results queue once it takes results again, marked `unroutable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reply_to_is_counted_once_per_result_however_often_it_is_held() {
    let fake = FakeLlm::new().start().await.unwrap();
    let (env, st) = start("refusedonce", fake.url.as_str()).await;
    let amqp = &st.amqp;
    let unroutable = || metric("prefix_batcher_reply_to_refused_total{reason=\"unroutable\"}");
    let (unroutable_before, held_before) = (unroutable(), results_held());
    let policy = refuse_results(&env, amqp).await;
    let reqs = one_key("refusedonce", 20, 0);
    let missing = format!("{}.missing", env.name);
    amqp.publish_requests(&env.input_queue(), &reqs, &missing).await;
    let held = wait_for("held attempts, two per result", Duration::from_secs(30), || async { results_held() >= held_before + 40.0 }).await;
    assert!(held, "the refused results were not held ({} attempts)", results_held() - held_before);
    drop(policy);
    let mut diverted = amqp.consume(&env.results_queue()).await;
    let want = ids(&reqs);
    diverted.until("20 diverted results", Duration::from_secs(30), |r| r.iter().filter(|m| want.contains(&m.correlation_id)).count() >= 20).await;
    diverted.collect_for(Duration::from_secs(1)).await;
    let ours: Vec<_> = diverted.received.iter().filter(|m| want.contains(&m.correlation_id)).collect();
    assert_eq!(ours.len(), 20, "one result each");
    assert!(ours.iter().all(|m| m.header("x-reply-to-refused") == Some("unroutable")));
    let counted = unroutable() - unroutable_before;
    eprintln!("20 results refused by reply_to and held: {} held attempts, {counted} refusals counted", results_held() - held_before);
    assert_eq!(counted, 20.0, "refusals counted per attempt, not per result");
    stop_and_check_nothing_held(env, st, vec![diverted]).await;
}

/// A reply queue that holds 100 results and refuses the rest (`x-max-length = 100`,
/// `x-overflow = reject-publish`, never consumed), for 500 requests on 16 keys, so many results
/// are in flight on each partition's publishing channel when the refusals start. Every request
/// has exactly one result: the first 100 in the reply queue, the other 400 diverted to the
/// results queue. (A refused result used to make the results queue publishes behind it on the
/// same channel go again although the broker had taken them: 8 duplicates in 500.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_queue_refusing_under_load_duplicates_nothing() {
    let fake = FakeLlm::new().start().await.unwrap();
    let (env, st) = start("fullload", fake.url.as_str()).await;
    let amqp = &st.amqp;
    let full = format!("{}.full", env.name);
    declare_refusing_reply_queue(&amqp.ch, &full, 100).await;
    let mut diverted = amqp.consume(&env.results_queue()).await;

    let reqs = completions_workload("fullload", 500, 16);
    let all = ids(&reqs);
    amqp.publish_requests(&env.input_queue(), &reqs, &full).await;
    diverted.until("400 diverted results", Duration::from_secs(60), |r| {
        r.iter().filter(|m| all.contains(&m.correlation_id)).map(|m| &m.correlation_id).collect::<HashSet<_>>().len() >= 400
    })
    .await;
    // Every publish has settled once the requests are acked; then nothing more can arrive.
    let settled = wait_for("every request acked", Duration::from_secs(30), || async { waiting_in_partitions(&env) == 0 }).await;
    assert!(settled);
    diverted.barrier(amqp).await;
    let mut held = amqp.consume(&full).await;
    held.until("the 100 held results", Duration::from_secs(30), |r| r.len() >= 100).await;

    let mut copies: std::collections::HashMap<&str, usize> = Default::default();
    for m in held.received.iter().chain(diverted.received.iter()).filter(|m| all.contains(&m.correlation_id)) {
        *copies.entry(m.correlation_id.as_str()).or_default() += 1;
    }
    let duplicated: Vec<_> = copies.iter().filter(|(_, &n)| n > 1).collect();
    assert_eq!(copies.len(), 500, "requests with a result");
    assert!(duplicated.is_empty(), "{} requests have more than one result, e.g. {:?}", duplicated.len(), duplicated.first());
    assert_eq!(held.received.len(), 100);
    for m in diverted.received.iter().filter(|m| all.contains(&m.correlation_id)) {
        assert_eq!(m.header("x-reply-to-refused"), Some("nacked"), "{:?}", m.headers);
    }
    eprintln!("reply queue refusing under load: 100 held, {} diverted, 0 duplicates", copies.len() - held.received.len());
    stop_and_check_nothing_held(env, st, vec![diverted, held]).await;
}

/// One request whose id (and AMQP `message_id`) is 250 bytes, plus 7 on the same key: building
/// the result's message id must not panic (`{id}:result` would exceed an AMQP short string). The 7
/// are answered; the long one is answered or dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_request_id_harms_no_other_request() {
    let fake = FakeLlm::new().start().await.unwrap();
    let (env, mut st) = start("longid", fake.url.as_str()).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let results = &mut st.results;

    let long_id = format!("long-{}", "x".repeat(245));
    assert_eq!(long_id.len(), 250);
    let mut reqs = one_key("short", 7, 1);
    reqs.insert(3, completion(&long_id, 1, " the long one"));
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let short: HashSet<String> = reqs.iter().map(|r| r.id.clone()).filter(|i| *i != long_id).collect();
    results.until_all(&short, Duration::from_secs(30)).await;

    let deadline = Instant::now() + Duration::from_secs(30);
    let long_done = loop {
        let has = |r: &[Received]| r.iter().any(|m| m.correlation_id == long_id);
        let _ = tokio::time::timeout(Duration::from_millis(200), results.until("the long one", DEADLINE, has)).await;
        let _ = tokio::time::timeout(Duration::from_millis(200), dead.until("the long one", DEADLINE, has)).await;
        if has(&results.received) || has(&dead.received) || Instant::now() > deadline {
            break has(&results.received) || has(&dead.received);
        }
    };
    assert!(long_done, "the request with a 250-byte id was neither answered nor dead-lettered");
    if let Some(m) = results.received.iter().find(|m| m.correlation_id == long_id) {
        assert_eq!(m.result().id, long_id);
    }
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// 60 requests at 10/s while the LLM server answers 503 to everything (the breaker's probe
/// included) for 8 s, then recovers: no `ok: false` result, nothing dead-lettered, every request
/// answered `ok` once the server is back; the requests waited in their queues (ready, or held
/// unacked) meanwhile. With `amqp.delivery_limit = 1` a single delivery charged to a request by
/// the outage would dead-letter it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llm_outage_pauses_intake_and_loses_nothing() {
    let llm = SwitchableLlm::start(503).await;
    let (env, mut st, mut dead) = start_charging_every_delivery("outage", &llm.url).await;
    let (amqp, reply) = (&st.amqp, st.reply.clone());

    let reqs = completions_workload("outage", 60, 4);
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    for r in &reqs {
        tick.tick().await;
        amqp.publish_requests(&env.input_queue(), std::slice::from_ref(r), &reply).await;
    }
    // The requests wait in their partition queues (intake paused; what was delivered is held).
    let waiting = wait_for("the requests to wait in the partition queues", Duration::from_secs(20), || async {
        waiting_in_partitions(&env) >= 55
    })
    .await;
    assert!(waiting);
    tokio::time::sleep_until(started + Duration::from_secs(8)).await; // the outage lasts 8 s
    let failed_calls = llm.failed_calls.load(Ordering::SeqCst);
    llm.set(200);
    st.results.until_all(&ids(&reqs), Duration::from_secs(60)).await;
    let recovered_in = started.elapsed();

    let not_ok: Vec<&Received> = st.results.received.iter().filter(|m| !m.result().ok).collect();
    assert!(not_ok.is_empty(), "{} ok:false results, e.g. {}", not_ok.len(), String::from_utf8_lossy(&not_ok[0].body));
    dead.barrier(&st.amqp).await;
    assert_eq!(dead.received.len(), 0, "dead-lettered during the outage: {:?}", dead.received.first().map(|m| &m.headers));
    assert!(failed_calls <= 30, "{failed_calls} completions calls during the outage: the backlog was used to probe");
    eprintln!("outage: 60 answered ok after {recovered_in:?}, 0 ok:false, {failed_calls} failed completions calls");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A server that answered real calls, then answers the daemon's one-token probe but 500 to every
/// real call, for 8 s, then recovers: 40 requests on 8 keys with `amqp.delivery_limit = 3` and one attempt per call. The
/// probe passing does not make the failures the requests' own once different calls all failed:
/// the probe replays a call the server answered before, which fails too, so the breaker opens, the requests wait uncharged, and every one is answered `ok` after the
/// recovery; nothing is dead-lettered. (Before, all 40 were dead-lettered with reason
/// `delivery_limit` within seconds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_answers_only_the_probe_pauses_intake() {
    probe_only_outage("probeonly", true).await;
}

/// The same server fault met by a daemon that started during it, so no real call was ever
/// answered and there is nothing to replay (observed: freshly restarted daemons dead-lettered all
/// 200 requests of a backlog with `delivery_limit` within 20 s, "last error: HTTP 503"). The
/// endpoint counts as down once different calls all failed, the requests wait uncharged, the
/// half-open probes let real calls try it again without charging them, and after the recovery
/// every request is answered `ok`; nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_answers_only_the_probe_from_the_start_pauses_intake() {
    probe_only_outage("probecold", false).await;
}

/// 40 requests on 8 keys (`amqp.delivery_limit = 3`, one attempt per call) meet a server that
/// answers the one-token probe but 500 to every real call for 8 s (after one warm-up request
/// answered normally when `warm`), then recovers: none is dead-lettered, every one is answered
/// `ok`.
async fn probe_only_outage(name: &str, warm: bool) {
    let llm = SwitchableLlm::start(200).await;
    let env = TestEnv::new(name);
    let mut raw = env.raw_config(&llm.url);
    (raw.amqp.delivery_limit, raw.llm.max_attempts) = (3, 1);
    if !warm {
        llm.probe_only.store(true, Ordering::SeqCst);
    }
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    if warm {
        // The server works first: a real call it answered is what the probe replays.
        let warm = one_key(&format!("{name}-warm"), 1, 9);
        st.amqp.publish_requests(&env.input_queue(), &warm, &st.reply).await;
        st.results.until_all(&ids(&warm), Duration::from_secs(30)).await;
        llm.probe_only.store(true, Ordering::SeqCst);
    }
    let reqs = completions_workload(name, 40, 8);
    let started = Instant::now();
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    tokio::time::sleep_until(started + Duration::from_secs(8)).await;
    let failed_calls = llm.failed_calls.load(Ordering::SeqCst);
    dead.barrier(&st.amqp).await;
    assert_eq!(dead.received.len(), 0, "dead-lettered while only the probe was answered (warm: {warm}): {:?}", dead.received.first().map(|m| &m.headers));
    llm.probe_only.store(false, Ordering::SeqCst);
    st.results.until_all(&ids(&reqs), Duration::from_secs(60)).await;
    let not_ok = st.results.received.iter().filter(|m| !m.result().ok).count();
    assert_eq!(not_ok, 0, "ok:false results");
    dead.barrier(&st.amqp).await;
    assert_eq!(dead.received.len(), 0);
    eprintln!("probe-only server (warm: {warm}): 40 answered ok after {:?}, 0 dead-lettered, {failed_calls} failed real calls", started.elapsed());
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// Restarting the daemon while its LLM endpoint is down charges no request a delivery
/// (`amqp.delivery_limit = 1`: one charged delivery dead-letters a request). Observed before: the
/// requests held in memory, waiting for the endpoint, went back to their queue on every graceful
/// stop with a delivery charged (quorum queues count every return), so a rolling deploy or a
/// restart loop during an outage dead-lettered them with `delivery_limit` ("delivered 3 times;
/// last error: unknown on this instance" after 3 restarts with the limit at 3). Now a drain puts
/// them back as new messages carrying their earlier deliveries, uncharged, and so are the
/// deliveries received but not yet taken (waiting for the byte budget, or buffered while intake
/// was paused); after two restarts and the recovery every request is answered `ok` and none is
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_during_an_outage_charge_no_request() {
    let llm = SwitchableLlm::start(503).await;
    let env = TestEnv::new("outagerestart");
    let mut raw = env.raw_config(&llm.url);
    raw.amqp.delivery_limit = 1;
    // A byte budget of about 10 requests for the instance: the other deliveries the broker sends
    // wait for it (in `admit`) or stay in the consumer's buffer while intake is paused, and a
    // stop must put those back uncharged too.
    (raw.amqp.max_message_bytes, raw.batching.max_buffered_bytes) = (2048, 2048);
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let mut redis = RedisProbe::connect().await.unwrap();
    let reqs = completions_workload("outagerestart", 60, 2);
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let unacked = || {
        let first = env.partition_queue(0);
        let prefix = first.trim_end_matches(|c: char| c.is_ascii_digit()).to_owned();
        async move { broker::queues(&prefix).iter().map(|(_, _, unacked)| unacked).sum::<u64>() }
    };
    for restart in 1..=2 {
        let held = wait_for("requests held in memory for the endpoint", Duration::from_secs(30), || async { unacked().await > 0 }).await;
        assert!(held, "restart {restart}: no request was held waiting for the endpoint");
        let Started { amqp, daemon, results, reply } = st;
        daemon.stop().await.expect("daemon stops cleanly");
        wait_all_back(&env, 60, &format!("restart {restart}")).await;
        let daemon = start_daemon(&raw);
        redis.wait_all_held_by(env.key_prefix(), raw.amqp.partitions, &raw.instance.name).await;
        st = Started { amqp, daemon, results, reply };
    }
    let returned = metric("prefix_batcher_requests_total{outcome=\"returned_uncharged\",stage=\"batcher\"}");
    llm.set(200);
    st.results.until_all(&ids(&reqs), Duration::from_secs(60)).await;
    let not_ok = st.results.received.iter().filter(|m| !m.result().ok).count();
    assert_eq!(not_ok, 0, "ok:false results");
    dead.barrier(&st.amqp).await;
    assert_eq!(dead.received.len(), 0, "dead-lettered: {:?}", dead.received.first().map(|m| &m.headers));
    eprintln!("2 restarts during an outage: 60 answered ok, 0 dead-lettered, {returned} requests put back uncharged");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A graceful stop during an LLM outage with a backlog beyond the prefetch puts every held and
/// buffered delivery back exactly once (observed before: a quorum queue applied the channel's
/// close before the last acknowledgements of the drain, rabbitmq-server #10327, so some acked
/// originals came back next to their uncharged copies and were answered twice: 11 of 400, 47 of
/// 1,200). After the stop the partition queues hold exactly the published requests, and
/// after the restart and the recovery each one has exactly one result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_an_outage_puts_every_delivery_back_once() {
    const N: usize = 800;
    let llm = SwitchableLlm::start(503).await;
    let env = TestEnv::new("stopback");
    let mut raw = env.raw_config(&llm.url);
    raw.amqp.partition_prefetch = 64;
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let mut redis = RedisProbe::connect().await.unwrap();
    let reqs = completions_workload("stopback", N, 8);
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let routed = wait_for("every request routed to a partition queue", Duration::from_secs(60), || async { waiting_in_partitions(&env) == N as u64 }).await;
    assert!(routed, "{} of {N} requests in the partition queues", waiting_in_partitions(&env));
    let first = env.partition_queue(0);
    let prefix = first.trim_end_matches(|c: char| c.is_ascii_digit()).to_owned();
    let held = wait_for("the prefetch of every partition held", Duration::from_secs(30), || async {
        broker::queues(&prefix).iter().all(|(_, ready, unacked)| *unacked > 0 || *ready == 0)
    })
    .await;
    assert!(held, "no request held: {:?}", broker::queues(&prefix));
    let Started { amqp, daemon, results, reply } = st;
    daemon.stop().await.expect("daemon stops cleanly");
    wait_all_back(&env, N, "after the stop").await;
    let daemon = start_daemon(&raw);
    redis.wait_all_held_by(env.key_prefix(), raw.amqp.partitions, &raw.instance.name).await;
    st = Started { amqp, daemon, results, reply };
    llm.set(200);
    st.results.until_all(&ids(&reqs), Duration::from_secs(120)).await;
    st.results.barrier(&st.amqp).await;
    let mut per_id: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for m in &st.results.received {
        *per_id.entry(m.correlation_id.clone()).or_default() += 1;
    }
    let twice: Vec<&String> = per_id.iter().filter(|(_, n)| **n > 1).map(|(id, _)| id).collect();
    assert!(twice.is_empty(), "{} requests answered more than once, e.g. {:?}", twice.len(), twice.first());
    assert_eq!(per_id.len(), N);
    dead.barrier(&st.amqp).await;
    assert_eq!(dead.received.len(), 0, "dead-lettered: {:?}", dead.received.first().map(|m| &m.headers));
    eprintln!("stop during an outage with {N} requests: each put back once and answered once");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A server that answers 401 to everything (a wrong token, not retried by the client, so every
/// call fails at once): intake pauses, no `ok: false` result, and no request is charged a
/// delivery (`amqp.delivery_limit = 1`: one charged delivery would dead-letter it); once the
/// token is right again (200), every request is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthorized_pauses_intake_without_failing_requests() {
    let llm = SwitchableLlm::start(401).await;
    let (env, mut st, mut dead) = start_charging_every_delivery("unauth", &llm.url).await;
    let reqs = completions_workload("unauth", 20, 2);
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let waiting = wait_for("all 20 requests to wait in the partition queues", Duration::from_secs(20), || async {
        waiting_in_partitions(&env) == 20
    })
    .await;
    assert!(waiting);
    // A few more seconds of outage: the breaker reopens and probes meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    st.results.barrier(&st.amqp).await;
    assert_eq!(st.results.received.len(), 0, "no result while the server refuses the token");
    llm.set(200);
    st.results.until_all(&ids(&reqs), Duration::from_secs(60)).await;
    assert!(st.results.received.iter().filter(|m| ids(&reqs).contains(&m.correlation_id)).all(|m| m.result().ok));
    dead.barrier(&st.amqp).await;
    assert_eq!(dead.received.len(), 0, "dead-lettered: {:?}", dead.received.first().map(|m| &m.headers));
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A daemon with `amqp.delivery_limit = 1` (a charged delivery dead-letters) whose LLM
/// endpoints are `servers`, in this order, and a consumer of its dead-letter queue.
async fn start_on_servers(test: &str, servers: &[&FakeLlmHandle]) -> (TestEnv, Started, Collector) {
    let env = TestEnv::new(test);
    let mut raw = env.raw_config(servers[0].url.as_str());
    raw.llm.endpoints = servers.iter().map(|s| s.url.as_str().trim_end_matches('/').to_owned()).collect();
    raw.amqp.delivery_limit = 1;
    let started = start_with_replies(&env, &raw).await;
    let dead = started.amqp.consume(&env.dead_letter_queue()).await;
    (env, started, dead)
}

/// Starts servers from `make` until one is the home (first in [`LlmClient::endpoint_ranking`])
/// of at least half of the [`PARTITIONS`] partitions beside `other`, and returns it. The daemon
/// balances the homes (each of two servers is the home of half the partitions), so the first
/// server started is returned; the check keeps the tests' premise explicit, since a test that
/// needs requests to meet a server first would otherwise depend on the hashes of URLs whose
/// ports the OS picks.
async fn home_of_half_the_partitions(make: impl Fn() -> FakeLlm, other: &FakeLlmHandle) -> FakeLlmHandle {
    for _ in 0..100 {
        let server = make().start().await.unwrap();
        if home_of_half(server.url.as_str(), other.url.as_str()) {
            return server;
        }
    }
    panic!("no server of 100 was the home of half the partitions");
}

/// Whether the LLM server at `url` is the home of at least half the [`PARTITIONS`] partitions
/// when `other` is the only other server.
fn home_of_half(url: &str, other: &str) -> bool {
    let mut llm = Settings::from_raw(&RawConfig::default()).expect("the defaults are valid").llm;
    llm.endpoints = vec![url.parse().unwrap(), other.parse().unwrap()];
    let client = LlmClient::with_options(&llm, ClientOptions { partitions: PARTITIONS, ..ClientOptions::default() }).unwrap();
    (0..PARTITIONS).filter(|&p| client.endpoint_ranking(p)[0] == 0).count() * 2 >= PARTITIONS as usize
}

/// Waits (≤ 60 s) until each of `reqs` has a result, then asserts that each got exactly one,
/// `ok`, and that nothing was dead-lettered.
async fn assert_answered_ok_once(st: &mut Started, dead: &mut Collector, reqs: &[TestRequest]) {
    assert_only_rejected(st, reqs, &[], "", Duration::from_secs(60)).await;
    dead.barrier(&st.amqp).await;
    assert!(dead.received.is_empty(), "dead-lettered: {:?}", dead.received.iter().map(|m| m.header("x-death-detail")).collect::<Vec<_>>());
}

/// Waits (≤ `within`) until each of `reqs` has a result, then asserts that each got exactly
/// one: `ok: false` with kind `rejected` and an error message containing `message` for the ids
/// in `rejected`, `ok` for the others.
async fn assert_only_rejected(st: &mut Started, reqs: &[TestRequest], rejected: &[String], message: &str, within: Duration) {
    st.results.until_all(&ids(reqs), within).await;
    st.results.barrier(&st.amqp).await;
    let by_id = st.results.by_correlation();
    for r in reqs {
        let got = &by_id[&r.id];
        assert_eq!(got.len(), 1, "request {} got {} results", r.id, got.len());
        let res = got[0].result();
        if rejected.contains(&r.id) {
            let e = res.error.as_ref().filter(|_| !res.ok).unwrap_or_else(|| panic!("{} was answered", r.id));
            assert_eq!(e.kind.as_str(), "rejected", "{e:?}");
            assert!(e.message.contains(message), "{e:?}");
        } else {
            assert!(res.ok, "{} failed: {:?}", r.id, res.error);
        }
    }
}

/// A chat request with `{tag}-{i}` as id and user message, on system prompt `system`.
fn chat_request(tag: &str, i: usize, system: &str) -> TestRequest {
    let id = format!("{tag}-{i}");
    let body = json!({"id": id, "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("question {i}?")}], "params": {"max_tokens": 8}});
    TestRequest { id, body: serde_json::to_vec(&body).unwrap(), group: 0 }
}

/// vLLM answers 400 to every chat call when its model has no chat template (a server started
/// without `--chat-template`). Each refusal looks like a request fault, and each used to give its
/// request an `ok: false` result at once, a whole backlog burned for a server setting. Now the
/// refusal is judged by a minimal chat call, which is refused too, so the server is at fault:
/// with `amqp.delivery_limit = 1` (a charged delivery dead-letters), no result and no dead letter
/// while it refuses, the requests wait; once the server answers chat again, every request (the
/// completions ones beside them too) is answered `ok`, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_a_chat_template_fails_no_chat_request() {
    let fake = FakeLlm::new().start().await.unwrap();
    fake.set_chat_refused(true);
    let (env, _, mut st, mut dead) = start_with_delivery_limit("nochattpl", fake.url.as_str(), None, 1).await;
    let mut reqs: Vec<TestRequest> = (0..30).map(|i| chat_request("nochattpl", i, "Answer in one word.")).collect();
    reqs.extend(completions_workload("nochattpl-c", 10, 2));
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let refused = wait_for("the server to refuse a minimal chat call", Duration::from_secs(30), || async {
        fake.calls().iter().any(|c| c.path == "/v1/chat/completions" && c.status == 400 && c.prompts[0] == "<|user|>\nping\n")
    })
    .await;
    assert!(refused);
    // A few more seconds of refusals: the breaker's probes ask the chat API again meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    st.results.barrier(&st.amqp).await;
    let failed: Vec<_> = st.results.received.iter().filter(|m| !m.result().ok).map(|m| (m.correlation_id.clone(), m.result().error)).collect();
    assert!(failed.is_empty(), "requests failed for the server's configuration: {} of {}, first {:?}", failed.len(), reqs.len(), failed.first());
    fake.set_chat_refused(false);
    assert_answered_ok_once(&mut st, &mut dead, &reqs).await;
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// One server of two refuses every chat call (no chat template), the other is healthy: the
/// partitions that rank the refusing one first fail over, and every chat request is answered
/// `ok`, once, none charged a delivery (`amqp.delivery_limit = 1`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_leave_a_server_without_a_chat_template_for_a_healthy_one() {
    let healthy = FakeLlm::new().start().await.unwrap();
    let refusing = home_of_half_the_partitions(FakeLlm::new, &healthy).await;
    refusing.set_chat_refused(true);
    let (env, mut st, mut dead) = start_on_servers("nochattpl2", &[&refusing, &healthy]).await;
    // One key per request (the key is the first 32 characters of the rendered opening, so the
    // number comes early), and the 40 keys fall in all 8 partitions: the refusing server is the
    // home of half of them, so some requests meet it first.
    let reqs: Vec<TestRequest> = (0..40).map(|i| chat_request("nochattpl2", i, &format!("Assistant {i}. Answer briefly."))).collect();
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    assert_answered_ok_once(&mut st, &mut dead, &reqs).await;
    assert!(refusing.calls().iter().any(|c| c.path == "/v1/chat/completions" && c.status == 400), "no request went to the refusing server first");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// One server of two has no completions API (404 there; it serves chat, as some gateways do),
/// the other is healthy. Completions requests: its partitions fail over, every request is
/// answered `ok`, once, none charged a delivery (`amqp.delivery_limit = 1`). Its probe used to
/// pass on the chat API, so the breaker flapped and each request that met the 404 was charged:
/// 17 of 300 dead-lettered in a tester's run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_requests_leave_a_chat_only_server_for_a_healthy_one() {
    let healthy = FakeLlm::new().start().await.unwrap();
    let chat_only = home_of_half_the_partitions(|| FakeLlm::new().chat_only(), &healthy).await;
    let (env, mut st, mut dead) = start_on_servers("chatonly", &[&chat_only, &healthy]).await;
    // The chat-only server is the home of half the partitions; in waves further apart
    // than the breaker's open time, so a probe that passed would let each wave meet the 404.
    let reqs = completions_workload("chatonly", 160, 40);
    for wave in reqs.chunks(40) {
        st.amqp.publish_requests(&env.input_queue(), wave, &st.reply).await;
        st.results.until_all(&ids(wave), Duration::from_secs(60)).await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
    }
    assert_answered_ok_once(&mut st, &mut dead, &reqs).await;
    assert!(chat_only.calls().iter().any(|c| c.path == "/v1/completions" && c.status == 404), "no request went to the chat-only server first");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A request naming a model the servers do not serve (vLLM answers 404 "The model `…` does not
/// exist.") while they serve the configured `llm.model`: it gets an `ok: false` result (kind
/// `rejected`, the server's message) at once, and nothing else is held up. As a 404 it counted
/// as the endpoint's fault: each such request was charged deliveries until dead-lettered
/// (`amqp.delivery_limit = 1` here: at once), and 5 in a row opened the endpoint's breaker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_a_model_the_servers_lack_fails_alone() {
    let env = TestEnv::new("badmodel");
    let mut raw = env.raw_config("http://127.0.0.1:9");
    let fake = FakeLlm::new().model(raw.llm.model.clone()).strict_model().start().await.unwrap();
    raw.llm.endpoints = vec![fake.url.as_str().trim_end_matches('/').to_owned()];
    raw.amqp.delivery_limit = 1;
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let mut reqs = completions_workload("badmodel", 20, 2);
    let bad: Vec<String> = (0..8).map(|i| format!("badmodel-typo-{i}")).collect();
    for (i, id) in bad.iter().enumerate() {
        let body = json!({"id": id, "model": "no-such-model", "prompt": format!("{} typo {i}?", group_prefix(i % 2)), "params": {"max_tokens": 8}});
        reqs.push(TestRequest { id: id.clone(), body: serde_json::to_vec(&body).unwrap(), group: i % 2 });
    }
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    assert_only_rejected(&mut st, &reqs, &bad, "does not exist", Duration::from_secs(30)).await;
    dead.barrier(&st.amqp).await;
    assert!(dead.received.is_empty(), "dead-lettered: {:?}", dead.received.iter().map(|m| m.header("x-death-detail")).collect::<Vec<_>>());
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A request fault (400 for one prompt) gives exactly that request an `ok: false` result (kind
/// `rejected`), acked; the other requests of its batch are answered `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_fault_fails_only_its_request() {
    let llm = SwitchableLlm::start(200).await;
    let (env, mut st) = start("reqfault", &llm.url).await;
    let mut reqs = one_key("reqfault", 7, 2);
    let bad_id = "reqfault-bad".to_owned();
    reqs.push(completion(&bad_id, 2, &format!(" {REJECTED}")));
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    assert_only_rejected(&mut st, &reqs, &[bad_id], "", Duration::from_secs(30)).await;
    stop_and_check_nothing_held(env, st, vec![]).await;
}

/// A prompt that crashes the server (500 for any call that carries it, while the probe and every
/// other call succeed), batched with 7 innocent requests on one key: the 7 are answered `ok` (the
/// failed list call goes again one prompt per call), and the offender is dead-lettered with
/// reason `delivery_limit` after `amqp.delivery_limit` = 2 deliveries, its last error in the
/// detail. Nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_crashes_the_server_is_dead_lettered_alone() {
    let llm = SwitchableLlm::start(200).await;
    let env = TestEnv::new("poison");
    let mut raw = env.raw_config(&llm.url);
    raw.amqp.delivery_limit = 2;
    raw.llm.max_attempts = 2;
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let mut reqs = one_key("poison", 7, 4);
    let bad_id = "poison-bad".to_owned();
    reqs.push(completion(&bad_id, 4, &format!(" {POISON}")));
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let innocent: HashSet<String> = reqs.iter().filter(|r| r.id != bad_id).map(|r| r.id.clone()).collect();
    st.results.until_all(&innocent, Duration::from_secs(30)).await;
    dead.until_all(&HashSet::from([bad_id.clone()]), Duration::from_secs(30)).await;
    st.results.barrier(&st.amqp).await;
    let by_id = st.results.by_correlation();
    for id in &innocent {
        let got = &by_id[id];
        assert_eq!(got.len(), 1, "request {id} got {} results", got.len());
        assert!(got[0].result().ok, "{id} failed: {:?}", got[0].result().error);
    }
    assert!(!by_id.contains_key(&bad_id), "the offender got a result");
    drop(by_id);
    let m = &dead.received[0];
    assert_eq!(m.header("x-death-reason"), Some("delivery_limit"), "{:?}", m.headers);
    let detail = m.header("x-death-detail").unwrap_or_default().to_owned();
    assert!(detail.contains("500"), "the detail names the last error: {detail}");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// The observed case: a server that answers each call in 1.5 s, `amqp.consumer_timeout = 10s`,
/// and the 8 requests of one key sent one call after the other (`llm.max_concurrency = 1`;
/// completions with `llm.list_prompts = false` run in one sequence under one permit, chat calls
/// each wait for the permit). The batch outlasted the guard's 0.9 × 10 s, which returned all 8
/// charged, the 5 answered ones with them: with `amqp.delivery_limit = 1` they were dead-lettered.
/// Now no call starts that could not end by the requests' deadline (receipt + 0.8 × 10 s − 2 ×
/// `amqp.confirm_timeout`), permit waits included: the prompts not sent go back uncharged and
/// come again. Every request is answered, once, none dead-lettered, and the guard never fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_slow_calls_stops_starting_calls_before_the_consumer_timeout() {
    let llm = FakeLlm::new().slow_prompts_containing("question", Duration::from_millis(1500)).start().await.unwrap();
    let env = TestEnv::new("slowseq");
    let mut raw = env.raw_config(llm.url.as_str());
    (raw.amqp.consumer_timeout, raw.amqp.confirm_timeout, raw.amqp.delivery_limit) = ("10s".into(), "1s".into(), 1);
    (raw.llm.request_timeout, raw.llm.max_attempts, raw.llm.list_prompts) = ("4s".into(), 1, false);
    raw.llm.max_concurrency = 1;
    let restarts = || metric("prefix_batcher_consumer_restarts_total{reason=\"consumer_timeout\"}");
    let before = restarts();
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let completions = one_key("slowseq", 8, 3);
    let chats: Vec<TestRequest> = (0..8).map(|i| chat_request("slowseqchat", i, "Answer in one word.")).collect();
    for reqs in [&completions, &chats] {
        st.amqp.publish_requests(&env.input_queue(), reqs, &st.reply).await;
        assert_only_rejected(&mut st, reqs, &[], "", Duration::from_secs(90)).await;
    }
    dead.barrier(&st.amqp).await;
    assert!(dead.received.is_empty(), "dead-lettered: {:?}", dead.received.iter().map(|m| m.header("x-death-detail")).collect::<Vec<_>>());
    assert_eq!(restarts(), before, "the consumer_timeout guard fired");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A partition queue deleted under its consumer (the broker cancels the consumer) is declared
/// again, bound to the shard exchange, and consumed: requests routed to it are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_partition_queue_is_declared_again_and_consumed() {
    let fake = FakeLlm::new().start().await.unwrap();
    let (env, mut st) = start("redeclare", fake.url.as_str()).await;
    let queue = env.partition_queue(0);
    st.amqp.ch.queue_delete(queue.as_str().into(), lapin::options::QueueDeleteOptions::default()).await.expect("delete the queue");
    partition_0_is_declared_and_answers_again(&env, &mut st, "redeclare").await;
    stop_and_check_nothing_held(env, st, vec![]).await;
}

/// Waits until partition queue 0 exists again and has its consumer, then checks that the shard
/// exchange routes to it (its binding is back) and that a request sent that way is answered.
async fn partition_0_is_declared_and_answers_again(env: &TestEnv, st: &mut Started, tag: &str) {
    let queue = env.partition_queue(0);
    let back = wait_for("the partition queue to be declared and consumed again", Duration::from_secs(20), || async {
        topology::queue_exists(&st.amqp.conn, &queue).await.unwrap_or(false) && st.amqp.queue_depth(&queue).await.1 == 1
    })
    .await;
    assert!(back);
    let req = completion(&format!("{tag}-0"), 0, " via the shard exchange");
    let key = AmqpSettings::partition_routing_key(0);
    let options = lapin::options::BasicPublishOptions { mandatory: true, ..Default::default() };
    let publish = st.amqp.ch.basic_publish(env.shard_exchange().as_str().into(), key.as_str().into(), options, &req.body, request_props(&req.id, &st.reply));
    let confirm = publish.await.expect("publish").await.expect("confirm");
    assert!(confirm.take_message().is_none(), "partition queue 0 is not bound to the shard exchange");
    st.results.until_all(&ids(std::slice::from_ref(&req)), Duration::from_secs(30)).await;
}

/// A partition queue deleted under its consumer and declared again at once by someone else as a
/// classic queue (no single active consumer, no dead-lettering, not bound to the shard exchange).
/// The worker used to consume that foreign queue after one failed declare (and the router, which
/// cannot route to it, held the partition's forwards). Now it does not consume it and declares
/// again until the queue is deleted; then its own queue is back, bound, and consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_queue_declared_again_by_someone_else_is_not_consumed() {
    let fake = FakeLlm::new().start().await.unwrap();
    let (env, mut st) = start("foreignpq", fake.url.as_str()).await;
    let queue = env.partition_queue(0);
    let missing = || metric("prefix_batcher_consumer_restarts_total{reason=\"queue_missing\"}");
    let before = missing();
    // Delete and declare in one go on one channel: the broker runs both before the worker learns
    // of the delete, so the worker finds the classic queue.
    let ch = st.amqp.conn.create_channel().await.expect("channel");
    let classic = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
    let (deleted, declared) = futures_util::join!(
        ch.queue_delete(queue.as_str().into(), lapin::options::QueueDeleteOptions::default()),
        ch.queue_declare(queue.as_str().into(), classic, FieldTable::default())
    );
    deleted.expect("delete the partition queue");
    declared.expect("declare it as a classic queue");
    assert!(wait_for("the worker to find its queue gone", Duration::from_secs(20), || async { missing() > before }).await);
    // A window, not a condition: the foreign queue must stay without a consumer through it (it
    // had one within 200 ms before).
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(3) {
        assert_eq!(st.amqp.queue_depth(&queue).await.1, 0, "the worker consumes the foreign classic queue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ch.queue_delete(queue.as_str().into(), lapin::options::QueueDeleteOptions::default()).await.expect("delete the classic queue");
    partition_0_is_declared_and_answers_again(&env, &mut st, "foreignpq").await;
    let _ = ch.close(200, "done".into()).await;
    stop_and_check_nothing_held(env, st, vec![]).await;
}

/// A byte budget of ten small requests for the whole instance (`batching.max_buffered_bytes`):
/// intake waits for it instead of holding more, and 200 requests over 8 partitions are all
/// answered (settled requests give their bytes back; nothing deadlocks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_byte_budget_slows_intake_but_loses_nothing() {
    let fake = FakeLlm::new().latency(Duration::from_millis(20)).start().await.unwrap();
    let env = TestEnv::new("budget");
    let mut raw = env.raw_config(fake.url.as_str());
    (raw.amqp.max_message_bytes, raw.batching.max_buffered_bytes) = (1000, 1000);
    let mut st = start_with_replies(&env, &raw).await;
    let reqs = completions_workload("budget", 200, 8);
    assert!(reqs.iter().all(|r| (80..=120).contains(&r.body.len())), "about ten requests fit the budget");
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    st.results.until_all(&ids(&reqs), Duration::from_secs(60)).await;
    stop_and_check_nothing_held(env, st, vec![]).await;
}

/// Polls `cond` every 100 ms until it holds (true) or `within` passes (false, with a message).
async fn wait_for<F, Fut>(what: &str, within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() > deadline {
            eprintln!("timed out after {within:?} waiting for {what}");
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The test's own RabbitMQ user with every permission on `/`, deleted (with its permissions) on
/// drop.
struct BrokerUser {
    name: String,
    password: String,
}

impl BrokerUser {
    fn create(test: &str) -> BrokerUser {
        let u = BrokerUser { name: format!("pbt-{test}-{}", &uuid::Uuid::new_v4().simple().to_string()[..10]), password: uuid::Uuid::new_v4().simple().to_string() };
        broker::rabbitmqctl(&["add_user", &u.name, &u.password]).expect("rabbitmqctl add_user");
        u.permit_writes(".*");
        u
    }

    /// Sets the user's permissions on `/`: configure and read everything, write what matches `write`.
    fn permit_writes(&self, write: &str) {
        broker::rabbitmqctl(&["set_permissions", "-p", "/", &self.name, ".*", write, ".*"]).expect("rabbitmqctl set_permissions");
    }

    fn url(&self) -> String {
        format!("amqp://{}:{}@127.0.0.1:5672/%2f", self.name, self.password)
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = broker::rabbitmqctl(&["delete_user", &self.name]);
    }
}

/// Failed attempts to publish a held result in this process
/// (`requests_total{stage="publisher",outcome="result_held"}`).
fn results_held() -> f64 {
    metric("prefix_batcher_requests_total{outcome=\"result_held\",stage=\"publisher\"}")
}

/// A broker that stops taking results, first refusing them (the results queue full, with
/// `overflow = reject-publish`: `basic.nack`), then also refusing the daemon's user write access
/// to the default exchange (403 `ACCESS_REFUSED`, which closes the publishing channel), then
/// taking them again. With `amqp.delivery_limit = 2`, a request charged per refused attempt would
/// be dead-lettered: every one of 200 answered requests must instead be held, uncharged, through more
/// than the stall window, and get exactly one result once the broker takes results again.
/// (Before, each refusal requeued the request: an operator's permission slip dead-lettered every
/// answered request within seconds; then a hold longer than the stall window restarted the
/// consumers, which charged the held requests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy: holds publishes for up to a minute; run alone by the heavy stage of scripts/test (in the parallel default stage some requests stayed unanswered in 2 of 3 clean CI runs, cause not found)"]
async fn a_broker_refusing_results_holds_the_requests_uncharged() {
    let fake = FakeLlm::new().start().await.unwrap();
    let user = BrokerUser::create("resultsheld");
    // A limit of 2, not 1: the test holds results for about 50 s, and on a loaded machine a lease
    // may be lost meanwhile (3 s lease in tests), which charges its held requests one delivery, as
    // documented. A charge per refused attempt, as before, still dead-letters them at once.
    let (env, raw, st, mut dead) = start_with_delivery_limit("resultsheld", fake.url.as_str(), Some(&user), 2).await;
    let results_queue = env.results_queue();
    let policy = refuse_results(&env, &st.amqp).await;
    let held = results_held;
    let held_before = held();

    // 200 requests: more than the partitions' prefetch (16 each), so requests also wait in the
    // partition queues while the held ones fill the prefetch.
    let reqs = completions_workload("resultsheld", 200, 2);
    st.amqp.publish_requests(&env.input_queue(), &reqs, "").await;
    // The first results of each partition are refused together; then the partition's held
    // results take turns, one attempt per backoff that doubles up to 1 s here.
    if !wait_for("refused results to be held", Duration::from_secs(30), || async { held() >= held_before + 40.0 }).await {
        dead.collect_for(Duration::from_secs(1)).await;
        panic!("refused results were not held; {} requests dead-lettered instead", dead.received.len());
    }
    // Held for longer than the stall window: a consumer whose prefetch is full of held requests
    // is not idle, and is not restarted (a restart would charge each held request a delivery).
    let stalled = || metric("prefix_batcher_consumer_restarts_total{reason=\"stalled\"}");
    let stalled_before = stalled();
    let window = prefix_batcher::partition::stall_window(&prefix_batcher::config::Settings::from_raw(&raw).unwrap());
    tokio::time::sleep(window + Duration::from_secs(5)).await;
    assert_eq!(stalled(), stalled_before, "a partition holding refused results was restarted as stalled");

    // Now the publishing channels the daemon opens have no write access to the default exchange.
    let closed = || metric("prefix_batcher_publish_channels_replaced_total{reason=\"closed\"}");
    let closed_before = closed();
    user.permit_writes(r"^(?!amq\.default$).*");
    assert!(wait_for("a publishing channel closed by the broker", Duration::from_secs(30), || async { closed() > closed_before }).await);
    drop(policy);
    let still_held = held();
    // Held results take turns per partition (one attempt per backoff, at most 1 s here).
    assert!(wait_for("more held attempts after the refused access", Duration::from_secs(30), || async { held() >= still_held + 20.0 }).await);
    assert_eq!(st.amqp.queue_depth(&results_queue).await.0, 2, "a result got through while results were refused");

    user.permit_writes(".*");
    let mut results = st.amqp.consume(&results_queue).await;
    let want = ids(&reqs);
    let deadline = Instant::now() + Duration::from_secs(60);
    let answered_count = |r: &Collector| r.received.iter().filter(|m| want.contains(&m.correlation_id)).map(|m| m.correlation_id.as_str()).collect::<HashSet<_>>().len();
    while answered_count(&results) < want.len() && Instant::now() < deadline {
        results.collect_for(Duration::from_millis(500)).await;
    }
    if answered_count(&results) < want.len() {
        dead.collect_for(Duration::from_secs(1)).await;
        panic!(
            "{} of {} answered 60 s after results were taken again; held attempts {}; stall restarts {}; lease losses {}; dead letters: {:?}; in the partition queues (ready + unacked): {}",
            answered_count(&results),
            want.len(),
            held() - held_before,
            stalled() - stalled_before,
            metric("prefix_batcher_lease_operations_total{op=\"renew\",outcome=\"lost\"}"),
            dead.received.iter().map(|m| (m.correlation_id.clone(), m.header("x-death-detail").map(str::to_owned))).collect::<Vec<_>>(),
            waiting_in_partitions(&env)
        );
    }
    // Any late second copy of a result would arrive within the retry backoff (1 s here).
    results.collect_for(Duration::from_secs(2)).await;
    let answered: Vec<&str> = results.received.iter().map(|m| m.correlation_id.as_str()).filter(|c| c.starts_with("resultsheld-")).collect();
    let distinct: HashSet<&str> = answered.iter().copied().collect();
    assert_eq!(answered.len(), 200, "one result per request ({} results for {} requests)", answered.len(), distinct.len());
    dead.collect_for(Duration::from_millis(500)).await;
    assert!(dead.received.is_empty(), "requests were charged a delivery and dead-lettered: {:?}", dead.received.iter().map(|m| m.header("x-death-detail")).collect::<Vec<_>>());
    stop_and_check_nothing_held(env, st, vec![results, dead]).await;
}

/// The publishing connection lost while the partitions hold results the broker refuses (the
/// results queue full with `reject-publish`): every held request goes back to its partition
/// queue once, charged one delivery, and is answered once results are taken again. With
/// `amqp.delivery_limit = 2` a second charge dead-letters it: before, each partition consumed
/// again on the still-open consuming connection, took the returned requests again, and the
/// session's end a moment later returned them a second time (114 of about 256 held requests
/// dead-lettered in an operator's run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy: holds publishes; run alone by the heavy stage of scripts/test"]
async fn a_lost_publishing_connection_charges_held_requests_once() {
    let fake = FakeLlm::new().start().await.unwrap();
    let (env, raw, st, mut dead) = start_with_delivery_limit("pubheld", fake.url.as_str(), None, 2).await;
    let results_queue = env.results_queue();
    let policy = refuse_results(&env, &st.amqp).await;
    let held = results_held;
    let held_before = held();
    // 8 keys over the 8 partitions, 16 requests each: the held requests fill the partitions'
    // prefetch (16 each in the tests), so most requests are unacked when the connection goes.
    let reqs = completions_workload("pubheld", 128, 8);
    st.amqp.publish_requests(&env.input_queue(), &reqs, "").await;
    assert!(wait_for("refused results to be held", Duration::from_secs(30), || async { held() >= held_before + 64.0 }).await);
    broker::close_connection_named(&format!("prefix-batcher {} publish", raw.instance.name)).await;
    // The next session holds the returned requests' results again.
    let after_close = held();
    assert!(wait_for("results held again by the next session", Duration::from_secs(30), || async { held() >= after_close + 32.0 }).await);
    drop(policy);

    let mut results = st.amqp.consume(&results_queue).await;
    let want = ids(&reqs);
    let deadline = Instant::now() + Duration::from_secs(60);
    let answered = |r: &Collector| r.received.iter().filter(|m| want.contains(&m.correlation_id)).map(|m| m.correlation_id.clone()).collect::<HashSet<_>>();
    while answered(&results).len() + dead.received.len() < want.len() && Instant::now() < deadline {
        results.collect_for(Duration::from_millis(300)).await;
        dead.collect_for(Duration::from_millis(200)).await;
    }
    dead.collect_for(Duration::from_millis(500)).await;
    assert!(
        dead.received.is_empty(),
        "{} of {} requests were charged twice for one lost connection and dead-lettered, e.g. {:?}",
        dead.received.len(),
        want.len(),
        dead.received.first().and_then(|m| m.header("x-death-detail").map(str::to_owned))
    );
    assert_eq!(answered(&results).len(), want.len(), "requests without a result 60 s after results were taken again");
    stop_and_check_nothing_held(env, st, vec![results, dead]).await;
}

/// A broker that stops taking the router's forwards (the shard exchange deleted, which closes the
/// router's publishing channel, and write access to it revoked from the daemon's user, so the
/// forwards on the new channel are refused with 403 `ACCESS_REFUSED`), then takes them again.
/// Every one of 20 requests must be held at the router, uncharged, and answered once; while the
/// broker refuses them, the held forwards take turns (one attempt per backoff, not one per held
/// request). The hold is not the partition queue's delay: it splits no key.
///
/// `amqp.delivery_limit = 2`, not 1: before the turns, the held forwards' attempts met on one
/// channel, and a refusal closing it while others were queued on it made lapin send them after
/// the channel's close-ok, so the broker closed the whole publishing connection (504
/// `CHANNEL_ERROR`), and the session's end charged every request one delivery (seen once in a
/// clean CI run). The first attempts, made before the first refusal is seen, can still meet so.
/// A charge per refused attempt, the fault this test is for, still dead-letters them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy: holds publishes for up to a minute; run alone by the heavy stage of scripts/test (in the parallel default stage some requests stayed unanswered in 2 of 3 clean CI runs, cause not found)"]
async fn a_broker_refusing_forwards_holds_the_requests_uncharged() {
    let fake = FakeLlm::new().start().await.unwrap();
    let user = BrokerUser::create("forwardsheld");
    let (env, _, mut st, mut dead) = start_with_delivery_limit("forwardsheld", fake.url.as_str(), Some(&user), 2).await;
    user.permit_writes(&format!("^(?!{}$).*", env.shard_exchange().replace('.', "\\.")));
    st.amqp.ch.exchange_delete(env.shard_exchange().as_str().into(), Default::default()).await.expect("delete the shard exchange");
    let held = || metric("prefix_batcher_requests_total{outcome=\"forward_held\",stage=\"router\"}");
    let held_before = held();
    let splits = || {
        metric("prefix_batcher_key_split_decisions_total{decision=\"split\"}") + metric("prefix_batcher_key_split_decisions_total{decision=\"spread\"}")
    };
    let splits_before = splits();

    let reqs = completions_workload("forwardsheld", 20, 2);
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    if !wait_for("refused forwards to be held", Duration::from_secs(30), || async { held() >= held_before + 20.0 }).await {
        dead.collect_for(Duration::from_secs(1)).await;
        panic!("refused forwards were not held; {} requests dead-lettered instead", dead.received.len());
    }
    // Held forwards take turns: each holds its turn through its backoff (at least 200 ms after
    // its first refusal, with `reconnect_backoff_initial = 100ms`), so about 5 attempts a
    // second (15 in 3 s measured); each of 20 deliveries retrying on its own made 142 in 3 s.
    let (before_window, window) = (held(), Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (attempts, secs) = (held() - before_window, window.elapsed().as_secs_f64());
    assert!(attempts <= (secs * 5.0).ceil() + 5.0, "{attempts} refused attempts in {secs:.1} s: the held forwards did not take turns");
    let held_now = || metric("prefix_batcher_held_publishes{kind=\"forward\"}");
    // 20 measured: each held forward counts, whether it waits for its turn or was refused itself.
    assert!((1.0..=20.0).contains(&held_now()), "held_publishes{{kind=\"forward\"}} = {} for 20 held forwards", held_now());
    user.permit_writes(".*");
    let want = ids(&reqs);
    let deadline = Instant::now() + Duration::from_secs(90);
    while st.results.received.iter().filter(|m| want.contains(&m.correlation_id)).count() < 20 && Instant::now() < deadline {
        st.results.collect_for(Duration::from_millis(500)).await;
    }
    st.results.collect_for(Duration::from_secs(2)).await;
    let answered = st.results.received.iter().filter(|m| m.correlation_id.starts_with("forwardsheld-")).count();
    if answered < 20 {
        dead.collect_for(Duration::from_secs(1)).await;
        panic!(
            "{answered} of 20 answered; held attempts {}; dead letters: {:?}; input queue {:?}",
            held() - held_before,
            dead.received.iter().map(|m| (m.correlation_id.clone(), m.header("x-death-detail").map(str::to_owned))).collect::<Vec<_>>(),
            st.amqp.queue_depth(&env.input_queue()).await
        );
    }
    assert_eq!(answered, 20, "one result per request");
    assert_eq!(held_now(), 0.0, "forwards taken are no longer counted as held");
    // Reported: a held forward kept its first `x-routed-at-ms`, so the owner counted the hold
    // (seconds, against the split rule's 2 s) as the partition queue's delay, and split the two
    // keys once the broker took them (measured: both, median delay 3.7 s). The owner decides
    // at the end of the third 1 s window after their dequeue, so absence is checked after 5 s.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(splits(), splits_before, "the keys split on the time their forwards were held at the router");
    dead.collect_for(Duration::from_millis(500)).await;
    assert!(dead.received.is_empty(), "requests were charged a delivery and dead-lettered: {:?}", dead.received.iter().map(|m| m.header("x-death-detail")).collect::<Vec<_>>());
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// For the tests of one partition queue apart from the others: a configuration of `env` where
/// each prefix group goes to exactly one partition (static prefix keys, one shard), with
/// `amqp.delivery_limit = 1` (one charge dead-letters a request) and an input prefetch of 16
/// (at most 8 held for refusing queues); the partition of group 0; 40 requests of group 0
/// (ids `{tag}-p-N`) and, published after them, 40 spread over 4 groups of other partitions
/// (`{tag}-o-N`).
struct OnePartitionApart {
    raw: RawConfig,
    partition: u32,
    to_it: Vec<TestRequest>,
    to_others: Vec<TestRequest>,
}

impl OnePartitionApart {
    fn new(env: &TestEnv, llm_url: &str, tag: &str) -> OnePartitionApart {
        let mut raw = env.raw_config(llm_url);
        raw.amqp.delivery_limit = 1;
        raw.amqp.input_prefetch = 16;
        raw.keying.mode = "prefix".into();
        raw.sharding.default_shards = 1;
        let partitions = NonZeroU32::new(PARTITIONS).unwrap();
        let partition_of_group = |g: usize| partition_of(PrefixKey::of(&group_prefix(g)), 0, partitions);
        let partition = partition_of_group(0);
        let others: Vec<usize> = (1..64).filter(|&g| partition_of_group(g) != partition).take(4).collect();
        let to_it = (0..40).map(|i| completion(&format!("{tag}-p-{i}"), 0, &format!(" question {i}?"))).collect();
        let to_others = (0..40).map(|i| completion(&format!("{tag}-o-{i}"), others[i % others.len()], &format!(" question {i}?"))).collect();
        OnePartitionApart { raw, partition, to_it, to_others }
    }

    /// Publishes the requests for the partition, then the others.
    async fn publish(&self, st: &Started, input_queue: &str) {
        st.amqp.publish_requests(input_queue, &self.to_it, &st.reply).await;
        st.amqp.publish_requests(input_queue, &self.to_others, &st.reply).await;
    }

    /// Every request of both sets.
    fn all(&self) -> Vec<TestRequest> {
        self.to_it.iter().chain(&self.to_others).cloned().collect()
    }

    /// Once the fault has ended: waits until every request has a result, collects for `then`
    /// more (for second answers), checks one `ok` result each and no dead letter, then stops the
    /// daemon ([`stop_and_check_nothing_held`]). `after` names the fault in failure messages.
    async fn check_answered_once(&self, env: TestEnv, mut st: Started, mut dead: Collector, then: Duration, after: &str) {
        let all = self.all();
        st.results.until_all(&ids(&all), DEADLINE).await;
        st.results.collect_for(then).await;
        st.results.assert_one_ok_result_each(&all, after);
        dead.collect_for(Duration::from_millis(500)).await;
        let details: Vec<_> = dead.received.iter().map(|m| m.header("x-death-detail")).collect();
        assert!(dead.received.is_empty(), "requests charged a delivery and dead-lettered {after}: {details:?}");
        stop_and_check_nothing_held(env, st, vec![dead]).await;
    }
}

/// Counted in this process: deliveries routers put back into their input queue uncharged.
fn router_put_backs() -> f64 {
    metric("prefix_batcher_requests_total{outcome=\"returned_uncharged\",stage=\"router\"}")
}

/// The Raft member of a quorum queue, suspended (`sys:suspend`) while it lives, resumed when
/// dropped: the queue takes publishes and confirms none of them, as a queue whose leader's node
/// stalls does.
struct SuspendedQueue(String);

impl SuspendedQueue {
    fn suspend(queue: &str) -> SuspendedQueue {
        let ra = format!("'%2F_{queue}'");
        let out = broker::rabbitmqctl(&["eval", &format!("sys:suspend(whereis({ra})).")]).expect("rabbitmqctl eval sys:suspend");
        assert_eq!(out.trim(), "ok", "suspending the Raft member of {queue}");
        SuspendedQueue(ra)
    }
}

impl Drop for SuspendedQueue {
    fn drop(&mut self) {
        let _ = broker::rabbitmqctl(&["eval", &format!("sys:resume(whereis({})).", self.0)]);
    }
}

/// A partition queue that confirms no forward (its Raft member suspended) for longer than
/// `amqp.confirm_timeout`, while the others take theirs: the forwards sent to it before the
/// router knew are held or put back into the input queue, but the broker enqueues them once the
/// queue runs again. The copies put back carry `x-forwarded-before`, so their forwards are marked
/// and the owner answers each request once. Reported before by an outside test: 8 of 200 answered
/// twice with an input prefetch of 16, 128 of 400 with 256.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_a_partition_queue_never_confirmed_are_answered_once() {
    let fake = FakeLlm::new().start().await.unwrap();
    let env = TestEnv::new("unconfirmed");
    let mut load = OnePartitionApart::new(&env, fake.url.as_str(), "unconfirmed");
    load.raw.amqp.confirm_timeout = "2s".into();
    let mut st = start_with_replies(&env, &load.raw).await;
    let dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let put_back_before = router_put_backs();
    let suspended = SuspendedQueue::suspend(&env.partition_queue(load.partition));

    load.publish(&st, &env.input_queue()).await;
    st.results.until_all(&ids(&load.to_others), DEADLINE).await;
    assert!(router_put_backs() > put_back_before, "no delivery beyond half the input prefetch was put back");
    drop(suspended);

    // Time for second answers: the queue has run again for the held forwards' next attempt (at
    // most 5 s) and the forwards of the copies.
    load.check_answered_once(env, st, dead, Duration::from_secs(8), "after a partition queue confirmed no forward").await;
}

/// Forwards refused for longer than `amqp.consumer_timeout` allows (write access to the shard
/// exchange revoked: 403 `ACCESS_REFUSED`): each held delivery, and each waiting for its turn, is
/// put back into the input queue uncharged when its hold nears the timeout (here 15 s: after
/// 0.8 × 15 s − 2 × `amqp.confirm_timeout` = 8 s), instead of being charged a delivery when
/// RabbitMQ's `consumer_timeout` closes the channel. `amqp.delivery_limit = 2`, as in
/// [`a_broker_refusing_forwards_holds_the_requests_uncharged`], whose first attempts can meet a
/// closed connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy: holds publishes for half a minute; run alone by the heavy stage of scripts/test"]
async fn forwards_refused_beyond_the_consumer_timeout_are_put_back_uncharged() {
    let fake = FakeLlm::new().start().await.unwrap();
    let user = BrokerUser::create("forwardsputback");
    let env = TestEnv::new("forwardsputback");
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.url = user.url();
    raw.amqp.delivery_limit = 2;
    raw.amqp.consumer_timeout = "15s".into();
    raw.amqp.confirm_timeout = "2s".into();
    raw.llm.request_timeout = "2s".into();
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    user.permit_writes(&format!("^(?!{}$).*", env.shard_exchange().replace('.', "\\.")));
    // Channels opened before keep their write access (RabbitMQ caches it per channel): the
    // deleted exchange closes the router's, and the forwards on the next one are refused.
    st.amqp.ch.exchange_delete(env.shard_exchange().as_str().into(), Default::default()).await.expect("delete the shard exchange");
    let put_back = || metric("prefix_batcher_requests_total{outcome=\"returned_uncharged\",stage=\"router\"}");
    let put_back_before = put_back();
    let reqs = completions_workload("forwardsputback", 10, 2);
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let all_put_back = wait_for("every held delivery put back", Duration::from_secs(40), || async { put_back() >= put_back_before + 10.0 }).await;
    assert!(all_put_back, "{} of 10 held deliveries put back within 40 s", put_back() - put_back_before);
    assert!(st.results.received.is_empty(), "answered although the broker refused every forward");
    user.permit_writes(".*");
    st.results.until_all(&ids(&reqs), DEADLINE).await;
    st.results.collect_for(Duration::from_secs(1)).await;
    st.results.assert_one_ok_result_each(&reqs, "after forwards refused beyond the consumer timeout");
    dead.collect_for(Duration::from_millis(500)).await;
    assert!(dead.received.is_empty(), "requests charged and dead-lettered: {:?}", dead.received.iter().map(|m| m.header("x-death-detail")).collect::<Vec<_>>());
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// One partition queue refusing forwards for long (full, with `overflow = reject-publish`, and
/// nobody consuming it: another instance holds its lease) while the other partition queues take
/// theirs. Its forwards are held, at most half of `amqp.input_prefetch` at once, and those beyond
/// are put back into the input queue uncharged, as are the held ones at a stop. Measured before:
/// the forwards of every partition took one turn, and the held ones came to fill the input
/// prefetch (16 here): none of the 40 requests for other partitions was answered in 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_queue_refusing_forwards_holds_up_no_other_partition() {
    let fake = FakeLlm::new().start().await.unwrap();
    let env = TestEnv::new("refusingpartition");
    let load = OnePartitionApart::new(&env, fake.url.as_str(), "refusingpartition");
    let (raw, refusing) = (&load.raw, load.partition);
    let mut redis = RedisProbe::connect().await.unwrap();
    let lease = format!("{}:lease:{refusing}", env.key_prefix());
    let _: () = redis::cmd("SET").arg(&lease).arg("other:0:1").arg("PX").arg(300_000).query_async(&mut redis.conn).await.unwrap();
    let amqp = Amqp::connect().await;
    let daemon = start_daemon(raw);
    let name = raw.instance.name.clone();
    redis
        .wait_leases(env.key_prefix(), PARTITIONS, "every other partition held", DEADLINE, |ls| {
            ls.iter().enumerate().all(|(p, l)| p == refusing as usize || l.as_ref().is_some_and(|l| l.name == name))
        })
        .await;
    let reply = format!("{}.reply", env.name);
    let results = amqp.reply_queue(&reply).await;
    let mut st = Started { amqp, daemon, results, reply };
    let dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let queue = env.partition_queue(refusing);
    for _ in 0..2 {
        st.amqp.publish(&queue, b"{\"filler\": true}", lapin::BasicProperties::default()).await;
    }
    let policy = Policy::refusing(&env.name, &queue);
    let put_back_before = router_put_backs();

    load.publish(&st, &env.input_queue()).await;
    let to_others = &load.to_others;
    let want = ids(to_others);
    let answered = |st: &Started| st.results.received.iter().filter(|m| want.contains(&m.correlation_id)).count();
    let deadline = Instant::now() + DEADLINE;
    while answered(&st) < to_others.len() && Instant::now() < deadline {
        st.results.collect_for(Duration::from_millis(250)).await;
    }
    assert_eq!(answered(&st), to_others.len(), "requests for the other partitions answered while partition {refusing} refused forwards");
    let refused_answered = st.results.received.iter().filter(|m| m.correlation_id.starts_with("refusingpartition-p-")).count();
    assert_eq!(refused_answered, 0, "answered although their partition queue refused forwards");
    // (The metrics are the test process's: other tests running at the same time hold and put back
    // forwards too, so the number held is not checked against the cap here.)
    assert!(router_put_backs() > put_back_before, "no delivery beyond half the input prefetch was put back");

    // A stop while the forwards are held puts them back uncharged: all 40 wait in the input queue
    // for the next start.
    let Started { amqp, daemon, results, reply } = st;
    daemon.stop().await.expect("daemon stops cleanly");
    assert_eq!(amqp.queue_depth(&env.input_queue()).await.0, 40, "the requests held at the stop are back in the input queue");
    let daemon = start_daemon(raw);
    redis
        .wait_leases(env.key_prefix(), PARTITIONS, "every other partition held again", DEADLINE, |ls| {
            ls.iter().enumerate().all(|(p, l)| p == refusing as usize || l.as_ref().is_some_and(|l| l.name == name))
        })
        .await;
    let st = Started { amqp, daemon, results, reply };

    // The fault ends: the fillers go, the queue takes forwards, and its lease is free again.
    st.amqp.ch.queue_purge(queue.as_str().into(), Default::default()).await.expect("purge the fillers");
    drop(policy);
    redis.del(&lease).await;
    load.check_answered_once(env, st, dead, Duration::from_secs(1), "after a partition queue refused forwards").await;
}

/// A graceful stop while the broker refuses results (the results queue full with
/// `reject-publish`): the stop does not wait `shutdown.drain_timeout` for the broker (it ends
/// cleanly, where it used to time out with exit 70), and every held request goes back to its
/// partition queue exactly once, uncharged: with `amqp.delivery_limit = 1` a charged delivery
/// would dead-letter it. Started again with the results queue taking results, the daemon answers
/// each request once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_the_broker_refuses_results_returns_the_requests_uncharged() {
    const N: usize = 40;
    let fake = FakeLlm::new().start().await.unwrap();
    let (env, raw, st, mut dead) = start_with_delivery_limit("stopheld", fake.url.as_str(), None, 1).await;
    let results_queue = env.results_queue();
    let policy = refuse_results(&env, &st.amqp).await;
    let held = results_held;
    let held_before = held();
    // Fewer requests than the partitions' prefetch: every one of them is held by the daemon.
    let reqs = completions_workload("stopheld", N, 2);
    st.amqp.publish_requests(&env.input_queue(), &reqs, "").await;
    if !wait_for("every refused result held", Duration::from_secs(30), || async { held() >= held_before + N as f64 }).await {
        dead.collect_for(Duration::from_secs(1)).await;
        panic!("refused results were not held: {} more held attempts, {} dead letters", held() - held_before, dead.received.len());
    }
    // The hold shows: in `held_publishes` and in the instance's health line in `status`.
    let held_now = || metric("prefix_batcher_held_publishes{kind=\"result\"}");
    assert!(held_now() >= 1.0 && held_now() <= N as f64, "held_publishes{{kind=\"result\"}} = {}", held_now());
    let settings = prefix_batcher::config::Settings::from_raw(&raw).unwrap();
    let health = prefix_batcher::client::status(&settings).await.expect("status").members.iter().find_map(|m| m.health.clone()).unwrap_or_default();
    assert!(health.starts_with("ready; ") && health.contains(" held: the broker does not take them"), "health line: {health:?}");

    let Started { amqp, daemon, results, reply } = st;
    let took = stop_and_wait_all_back(daemon, &env, N, "a stop during a result hold ends cleanly, without waiting for the broker").await;
    assert_eq!(held_now(), 0.0, "a released hold is no longer counted");
    eprintln!("stop during a result hold: {N} requests put back in {took:?}");

    drop(policy);
    let mut redis = RedisProbe::connect().await.unwrap();
    let daemon = start_daemon(&raw);
    redis.wait_all_held_by(env.key_prefix(), raw.amqp.partitions, &raw.instance.name).await;
    let st = Started { amqp, daemon, results, reply };
    let mut answers = st.amqp.consume(&results_queue).await;
    answers.until_all(&ids(&reqs), Duration::from_secs(60)).await;
    answers.collect_for(Duration::from_secs(2)).await;
    let answered: Vec<&str> = answers.received.iter().map(|m| m.correlation_id.as_str()).filter(|c| c.starts_with("stopheld-")).collect();
    let distinct: HashSet<&str> = answered.iter().copied().collect();
    assert_eq!((answered.len(), distinct.len()), (N, N), "one result per request");
    dead.barrier(&st.amqp).await;
    assert!(dead.received.is_empty(), "requests were charged a delivery and dead-lettered: {:?}", dead.received.iter().map(|m| m.header("x-death-detail")).collect::<Vec<_>>());
    stop_and_check_nothing_held(env, st, vec![answers, dead]).await;
}

/// An LLM server that accepts connections and never answers (frozen: SIGSTOP, a paused VM),
/// beside a healthy one. With `llm.request_timeout = 120s` its calls would wait two minutes
/// before anything noticed; the liveness check (`llm.liveness_check_after = 1s` here) finds it
/// not answering, opens its breaker and abandons its calls, and their requests go to the healthy
/// server, uncharged (`amqp.delivery_limit = 1`: one charged delivery would dead-letter them).
/// Every request is answered once, well within the request timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_llm_server_is_left_for_a_healthy_one_long_before_the_request_timeout() {
    let fake = FakeLlm::new().start().await.unwrap();
    // The frozen server is the home of half the partitions, so requests meet it first (without
    // this, in about 1 run of 64 none of the 6 partitions the requests use ranked it first).
    let mut frozen = FrozenLlm::start().await;
    while !home_of_half(&frozen.url, fake.url.as_str()) {
        frozen = FrozenLlm::start().await;
    }
    let env = TestEnv::new("frozenllm");
    let mut raw = env.raw_config(fake.url.as_str());
    raw.llm.endpoints = vec![frozen.url.clone(), fake.url.as_str().trim_end_matches('/').to_owned()];
    raw.llm.request_timeout = "120s".into();
    raw.llm.liveness_check_after = "1s".into();
    raw.amqp.delivery_limit = 1;
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let reqs = completions_workload("frozenllm", 80, 8);
    let started = Instant::now();
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    st.results.until_all(&ids(&reqs), Duration::from_secs(60)).await;
    let took = started.elapsed();
    st.results.collect_for(Duration::from_millis(500)).await;
    let answered: Vec<&str> = st.results.received.iter().map(|m| m.correlation_id.as_str()).filter(|c| c.starts_with("frozenllm-")).collect();
    let distinct: HashSet<&str> = answered.iter().copied().collect();
    assert_eq!((answered.len(), distinct.len()), (reqs.len(), reqs.len()), "one result per request");
    assert!(st.results.received.iter().filter(|m| m.correlation_id.starts_with("frozenllm-")).all(|m| m.result().ok), "a request was failed instead of moved");
    dead.barrier(&st.amqp).await;
    assert!(dead.received.is_empty(), "requests were charged a delivery and dead-lettered: {:?}", dead.received.iter().map(|m| m.header("x-death-detail")).collect::<Vec<_>>());
    eprintln!("a frozen LLM server beside a healthy one: {} requests answered in {took:?} (request timeout 120 s)", reqs.len());
    drop(frozen);
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A stop while the LLM server is alive but slower than the drain: every call takes 120 s, and
/// the server answers its liveness check, so the drain (`shutdown.drain_timeout = 6s`) cannot
/// finish them. Left to the drain's deadline, the hard stop closed the channels, which returned
/// every request charged one delivery (with `amqp.delivery_limit = 1`, a dead letter each), and
/// the stop exited 70. Now the drain abandons the calls at its cutoff (4.5 s here) and puts their
/// requests back uncharged: the stop ends cleanly within the drain timeout, and a daemon started
/// again with a fast server answers each request once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_generations_longer_than_the_drain_returns_the_requests_uncharged() {
    const N: usize = 16;
    let slow = FakeLlm::new().latency(Duration::from_secs(120)).start().await.unwrap();
    let env = TestEnv::new("stopslow");
    let mut raw = env.raw_config(slow.url.as_str());
    raw.shutdown.drain_timeout = "6s".into();
    raw.amqp.delivery_limit = 1;
    let st = start_with_replies(&env, &raw).await;
    let dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let reqs = completions_workload("stopslow", N, 4);
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    let routed = wait_for("every request taken by a partition and calls on the slow server", Duration::from_secs(30), || async {
        waiting_in_partitions(&env) == N as u64 && slow.call_count() > 0
    })
    .await;
    assert!(routed, "{} of {N} requests in the partition queues, {} calls", waiting_in_partitions(&env), slow.call_count());

    let Started { amqp, daemon, results, reply } = st;
    let took = stop_and_wait_all_back(daemon, &env, N, "a stop during calls longer than the drain ends cleanly, exit 0").await;
    eprintln!("stop during generations longer than the drain: drained in {took:?}, {N} requests put back");
    assert!(took < Duration::from_secs(6), "the stop took {took:?}, past shutdown.drain_timeout");
    drop(slow);
    answered_once_after_a_restart(env, raw, (amqp, results, reply), &reqs, dead).await;
}

/// A stop while the only LLM server is frozen (it accepts connections and never answers): the
/// drain waits for the calls in flight, which would outlast `shutdown.drain_timeout` (25 s here,
/// `llm.request_timeout = 120s`) and end with exit 70, every request charged a delivery. The drain
/// checks the server at once instead of after `llm.liveness_check_after` (12 s here: found at
/// about 32 s without that, after the drain's end), finds it frozen, and puts every request back
/// uncharged: the stop ends cleanly, and with `amqp.delivery_limit = 1` each request is answered
/// once by a daemon started again with a working server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_the_llm_server_is_frozen_returns_the_requests_uncharged() {
    const N: usize = 20;
    let frozen = FrozenLlm::start().await;
    let env = TestEnv::new("stopfrozen");
    let mut raw = env.raw_config(&frozen.url);
    raw.llm.request_timeout = "120s".into();
    raw.llm.liveness_check_after = "12s".into();
    raw.shutdown.drain_timeout = "25s".into();
    raw.amqp.delivery_limit = 1;
    let st = start_with_replies(&env, &raw).await;
    let dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let reqs = completions_workload("stopfrozen", N, 4);
    st.amqp.publish_requests(&env.input_queue(), &reqs, &st.reply).await;
    assert!(wait_for("calls to reach the frozen server", Duration::from_secs(30), || async { frozen.accepted.load(Ordering::SeqCst) > 0 }).await);

    let Started { amqp, daemon, results, reply } = st;
    let took = stop_and_wait_all_back(daemon, &env, N, "a stop while the LLM server is frozen ends within the drain timeout").await;
    eprintln!("stop while the LLM server is frozen: drained in {took:?}, {N} requests put back");
    drop(frozen);
    answered_once_after_a_restart(env, raw, (amqp, results, reply), &reqs, dead).await;
}

/// Starts the daemon of `raw` again, with a working LLM server, on the test's AMQP connection,
/// results collector and reply queue (`parts`): every request of `reqs` is answered exactly once
/// and none is dead-lettered (`dead` collects the dead-letter queue; with
/// `amqp.delivery_limit = 1` a charged delivery would dead-letter its request). Then stops it and
/// checks that nothing is held.
async fn answered_once_after_a_restart(env: TestEnv, mut raw: RawConfig, parts: (Amqp, Collector, String), reqs: &[TestRequest], mut dead: Collector) {
    let (amqp, results, reply) = parts;
    let fake = FakeLlm::new().start().await.unwrap();
    raw.llm.endpoints = vec![fake.url.as_str().trim_end_matches('/').to_owned()];
    let mut redis = RedisProbe::connect().await.unwrap();
    let daemon = start_daemon(&raw);
    redis.wait_all_held_by(env.key_prefix(), raw.amqp.partitions, &raw.instance.name).await;
    let mut st = Started { amqp, daemon, results, reply };
    let wanted = ids(reqs);
    st.results.until_all(&wanted, Duration::from_secs(60)).await;
    st.results.collect_for(Duration::from_millis(500)).await;
    let answered = st.results.received.iter().filter(|m| wanted.contains(&m.correlation_id)).count();
    assert_eq!(answered, reqs.len(), "one result per request");
    dead.barrier(&st.amqp).await;
    assert!(dead.received.is_empty(), "requests were charged a delivery and dead-lettered: {:?}", dead.received.iter().map(|m| m.header("x-death-detail")).collect::<Vec<_>>());
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// Write access to the dead-letter exchange alone refused while valid and malformed requests
/// arrive together: the refused dead letters must not take forwards with them. Before, the
/// router's dead letters shared its publishing channel with the forwards; each refused dead letter
/// closed it, and forwards the broker had already taken failed with it and were forwarded again
/// (an operator's run: 369 extra copies of 600 requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_dead_letter_does_not_duplicate_forwards() {
    refused_dead_letters_duplicate_nothing("dlxrefused", 200, |env, _| env.input_queue()).await;
}

/// The same on the partitions' side: malformed messages straight in the partition queues (a
/// producer that publishes there) while write access to the dead-letter exchange is refused and
/// valid requests are answered. A refused dead letter closes the channel it was published on; on
/// a partition's result channel, results the broker had already taken failed with it and were
/// published again (18 to 53 of these 800 requests answered twice, in 4 runs of 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_dead_letter_of_a_partition_does_not_duplicate_results() {
    refused_dead_letters_duplicate_nothing("dlxrefusedp", 800, |env, i| env.partition_queue(i as u32 % PARTITIONS)).await;
}

/// A daemon whose user may write anywhere but to the dead-letter exchange gets `n` valid
/// requests (on 8 keys, into the input queue) and, after every 10 of them, a malformed message
/// into the queue `junk_queue(env, i)`. Every request is answered exactly once; once write access
/// is back, each malformed message is dead-lettered, once.
async fn refused_dead_letters_duplicate_nothing(test: &str, n: usize, junk_queue: impl Fn(&TestEnv, usize) -> String) {
    let fake = FakeLlm::new().latency(Duration::from_millis(20)).start().await.unwrap();
    let user = BrokerUser::create(test);
    let (env, _raw, mut st, mut dead) = start_with_delivery_limit(test, fake.url.as_str(), Some(&user), 5).await;
    user.permit_writes(&format!("^(?!{}$).*", env.dead_letter_exchange().replace('.', "\\.")));
    let reqs = completions_workload(test, n, 8);
    let want = ids(&reqs);
    let mut junk = 0;
    for (i, chunk) in reqs.chunks(10).enumerate() {
        st.amqp.publish_requests(&env.input_queue(), chunk, &st.reply).await;
        let props = lapin::BasicProperties::default().with_correlation_id(format!("junk-{i}").into());
        st.amqp.publish(&junk_queue(&env, i), b"not json", props).await;
        junk += 1;
    }
    st.results.until_all(&want, DEADLINE).await;
    user.permit_writes(".*");
    let deadline = Instant::now() + DEADLINE;
    while dead.received.len() < junk && Instant::now() < deadline {
        dead.collect_for(Duration::from_millis(500)).await;
    }
    assert_eq!(dead.received.len(), junk, "the malformed messages are dead-lettered once write access is back");
    // A second copy of a forward or a result would be answered within a moment.
    st.results.collect_for(Duration::from_secs(2)).await;
    let copies: Vec<(String, usize)> =
        st.results.by_correlation().into_iter().filter(|(id, r)| want.contains(id) && r.len() > 1).map(|(id, r)| (id, r.len())).collect();
    assert!(copies.is_empty(), "{} requests answered more than once: {copies:?}", copies.len());
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A memory alarm on the broker while this lives (`set_vm_memory_high_watermark absolute 1`):
/// RabbitMQ blocks every publishing connection, the test's too
/// (<https://www.rabbitmq.com/docs/connection-blocked>). Dropping it restores the watermark.
struct MemoryAlarm(String);

impl MemoryAlarm {
    fn raise() -> MemoryAlarm {
        let before = broker::rabbitmqctl(&["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."]).expect("rabbitmqctl reads the memory watermark");
        broker::rabbitmqctl(&["set_vm_memory_high_watermark", "absolute", "1"]).expect("rabbitmqctl sets the memory watermark");
        MemoryAlarm(before.trim().to_owned())
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let _ = broker::rabbitmqctl(&["eval", &format!("vm_memory_monitor:set_vm_memory_high_watermark({}).", self.0)]);
    }
}

/// The broker's `consumer_timeout` set (for channels opened from then on) while this lives,
/// restored when dropped.
struct BrokerConsumerTimeout(String);

impl BrokerConsumerTimeout {
    fn set(t: Duration) -> BrokerConsumerTimeout {
        let before = broker::rabbitmqctl(&["eval", "application:get_env(rabbit, consumer_timeout)."]).expect("rabbitmqctl reads consumer_timeout");
        let set = format!("application:set_env(rabbit, consumer_timeout, {}).", t.as_millis());
        broker::rabbitmqctl(&["eval", &set]).expect("rabbitmqctl sets consumer_timeout");
        BrokerConsumerTimeout(before.trim().to_owned())
    }
}

impl Drop for BrokerConsumerTimeout {
    fn drop(&mut self) {
        let restore = match self.0.strip_prefix("{ok,").and_then(|v| v.strip_suffix('}')) {
            Some(v) => format!("application:set_env(rabbit, consumer_timeout, {v})."),
            None => "application:unset_env(rabbit, consumer_timeout).".to_owned(),
        };
        let _ = broker::rabbitmqctl(&["eval", &restore]);
    }
}

/// A memory alarm (the broker blocks every publishing connection) that outlasts the broker's
/// `consumer_timeout` (20 s here), with `amqp.delivery_limit = 1`: first while the partitions
/// hold the requests (their `amqp.consumer_timeout` guard returns them), then while the router
/// holds them (a daemon started during the alarm; the broker's own `consumer_timeout` closes the
/// router's input channel). Nothing can be published or put back meanwhile, so the broker
/// counts these returns; they are not the requests' fault. None is dead-lettered, and each is
/// answered once, except those whose results were written before the broker's notice of the
/// block (at most twice: see the check). Measured before (400 requests per phase, 75 s alarm): the first phase
/// dead-lettered 218 (4 of them answered too), the second answered 32 and dead-lettered them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy: a broker-wide memory alarm for up to two minutes; run alone by the heavy stage of scripts/test"]
async fn a_memory_alarm_beyond_the_consumer_timeout_charges_no_request() {
    let fake = FakeLlm::new().latency(Duration::from_secs(2)).start().await.unwrap();
    let env = TestEnv::new("memoryalarm");
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.delivery_limit = 1;
    (raw.amqp.consumer_timeout, raw.amqp.confirm_timeout) = ("20s".into(), "3s".into());
    (raw.llm.request_timeout, raw.llm.max_attempts, raw.llm.backoff_max) = ("3s".into(), 2, "1s".into());
    let _timeout = BrokerConsumerTimeout::set(Duration::from_secs(20));
    let mut st = start_with_replies(&env, &raw).await;
    let mut dead = st.amqp.consume(&env.dead_letter_queue()).await;
    let blocked = || metric("prefix_batcher_amqp_connection_blocked{connection=\"publish\"}") == 1.0;

    // The partitions hold the requests when the alarm begins.
    let held_by_partitions = completions_workload("memoryalarm-p", 100, 10);
    st.amqp.publish_requests(&env.input_queue(), &held_by_partitions, &st.reply).await;
    let input = env.input_queue();
    let forwarded = wait_for("every request forwarded", DEADLINE, || async { broker::queues(&input).iter().all(|(q, ready, unacked)| *q != input || ready + unacked == 0) }).await;
    assert!(forwarded, "the input queue did not empty");
    let guard_returns = || metric("prefix_batcher_consumer_restarts_total{reason=\"consumer_timeout\"}");
    let guard_before = guard_returns();
    let alarm = MemoryAlarm::raise();
    assert!(wait_for("the publishing connection blocked", Duration::from_secs(20), || async { blocked() }).await);
    let returned = wait_for("the consumer_timeout guard", Duration::from_secs(60), || async { guard_returns() > guard_before }).await;
    assert!(returned, "the partitions' consumer_timeout guard did not return the held requests");
    drop(alarm);
    st.results.until_all(&ids(&held_by_partitions), DEADLINE).await;

    // The router holds them: a daemon started during the alarm.
    st.daemon.stop().await.expect("daemon stops cleanly");
    let held_by_router = completions_workload("memoryalarm-r", 100, 10);
    st.amqp.publish_requests(&env.input_queue(), &held_by_router, &st.reply).await;
    let closed = || metric("prefix_batcher_input_consumer_failures_total{reason=\"channel_closed\"}");
    let closed_before = closed();
    let alarm = MemoryAlarm::raise();
    st.daemon = start_daemon(&raw);
    assert!(wait_for("the publishing connection blocked", Duration::from_secs(20), || async { blocked() }).await);
    let timed_out = wait_for("the broker's consumer_timeout", Duration::from_secs(150), || async { closed() > closed_before }).await;
    assert!(timed_out, "the broker's consumer_timeout did not close the router's input channel");
    drop(alarm);

    let all: Vec<TestRequest> = held_by_partitions.iter().chain(&held_by_router).cloned().collect();
    st.results.until_all(&ids(&all), DEADLINE).await;
    st.results.collect_for(Duration::from_secs(3)).await;
    st.results.assert_one_ok_result_each(&held_by_router, "after a memory alarm beyond the consumer timeout");
    // RabbitMQ tells a connection that it is blocked only when it publishes during the alarm, and
    // reads nothing more from it: the results written before that notice reached the daemon go
    // out when the alarm ends, though their requests were returned meanwhile and answered again.
    // Those may have two answers; no other request may.
    let by_id = st.results.by_correlation();
    let answers: Vec<usize> = held_by_partitions.iter().map(|r| by_id.get(&r.id).map_or(0, Vec::len)).collect();
    let twice = answers.iter().filter(|&&n| n == 2).count();
    eprintln!("held by the partitions: {twice} of {} requests answered twice", answers.len());
    assert!(answers.iter().all(|&n| (1..=2).contains(&n)), "answers per request: {answers:?}");
    assert!(st.results.received.iter().all(|m| m.result().ok), "a failed result");
    dead.collect_for(Duration::from_millis(500)).await;
    let details: Vec<_> = dead.received.iter().map(|m| m.header("x-death-detail")).collect();
    assert!(dead.received.is_empty(), "requests charged a delivery and dead-lettered: {details:?}");
    stop_and_check_nothing_held(env, st, vec![dead]).await;
}

/// A partition's publish that waits for the broker to unblock its connection (a memory alarm)
/// publishes nothing if its lease ended meanwhile: the lease is checked after that wait, with no
/// await before the frames are queued (`publisher::publish_on`). Measured before: the publish
/// whose lease ended during the alarm went out when the alarm ended, confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy: a broker-wide memory alarm for a few seconds; run alone by the heavy stage of scripts/test"]
async fn a_lease_that_ends_while_the_broker_blocks_publishing_publishes_nothing() {
    use prefix_batcher::amqp::SharedConfirmChannel;
    use prefix_batcher::lease::LeaseClock;
    use prefix_batcher::publisher::{publish_on, PublishError};

    let env = TestEnv::new("alarmlease");
    let settings = Arc::new(Settings::from_raw(&env.raw_config("http://127.0.0.1:9")).expect("valid test config"));
    let amqp = Amqp::connect().await;
    let queue = env.results_queue();
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    amqp.ch.queue_declare(queue.as_str().into(), durable, FieldTable::default()).await.expect("declare the queue");
    let conn = Arc::new(lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default()).await.expect("connect"));
    let out = Arc::new(SharedConfirmChannel::new(conn.clone(), Duration::from_secs(1), "test".into()));
    let publish = |body: &'static str, lease: Option<Arc<LeaseClock>>| {
        let (out, settings, queue) = (out.clone(), settings.clone(), queue.clone());
        tokio::spawn(async move {
            let props = lapin::BasicProperties::default().with_message_id(body.into());
            publish_on(&out, &settings.amqp, "", &queue, body.as_bytes(), props, lease.as_deref()).await
        })
    };

    let alarm = MemoryAlarm::raise();
    // RabbitMQ tells a connection it is blocked when it publishes during the alarm.
    let first = publish("first", None);
    assert!(wait_for("the connection blocked", Duration::from_secs(20), || async { conn.status().blocked() }).await);
    let ends = Arc::new(LeaseClock::new(Instant::now() + Duration::from_secs(1)));
    let lasts = Arc::new(LeaseClock::new(Instant::now() + Duration::from_secs(600)));
    let stale = publish("stale", Some(ends.clone()));
    let owned = publish("owned", Some(lasts));
    assert!(wait_for("the short lease to end", Duration::from_secs(5), || async { !ends.is_valid() }).await);
    assert!(conn.status().blocked(), "the alarm ended before the lease");
    drop(alarm);

    let within = |t| tokio::time::timeout(Duration::from_secs(60), t);
    assert!(matches!(within(first).await.expect("first settles").unwrap(), Ok(())));
    assert!(matches!(within(owned).await.expect("owned settles").unwrap(), Ok(())));
    let stale = within(stale).await.expect("stale settles").unwrap();
    assert!(matches!(stale, Err(PublishError::LeaseExpired)), "a publish whose lease ended during the alarm: {stale:?}");
    let mut got = Vec::new();
    while let Some(m) = amqp.ch.basic_get(queue.as_str().into(), lapin::options::BasicGetOptions { no_ack: true }).await.expect("basic.get") {
        got.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
    }
    got.sort();
    assert_eq!(got, ["first", "owned"], "what reached the queue");
    let _ = conn.close(200, "done".into()).await;
    amqp.close().await;
    env.cleanup().await;
}
