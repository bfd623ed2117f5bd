//! Observed faults, each reduced to its smallest input, against the real RabbitMQ and Redis and
//! the fake LLM: the assertion is the correct outcome.
//!
//! - A server that ignores `n`: no request ever gets another request's text.
//! - One over-long prompt in a list: only that request fails (`rejected`), the others are answered.
//! - An LLM answering 401 to everything: nothing fails, the requests stay queued, `/readyz` says
//!   why, and all are answered once the server accepts the key again.
//! - A Redis holding millions of unrelated keys: the daemon is ready within seconds.
//! - A Redis outage past the renew deadline, or a lease taken by another holder, while calls are
//!   in flight: the partitions are aborted, and their requests go back uncharged.
//! - One instance's link to Redis slower than `redis.command_timeout`: the other instance takes
//!   its partitions and serves them.
//! - And the test harness itself: a panicking test leaves nothing on the broker or in Redis.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use llm_fakes::fake::{FakeLlm, FakeLlmHandle};
use prefix_batcher::request::RequestResult;
use serde_json::{json, Value};
use tokio::time::Instant;

/// A completions request with an explicit prefix key and a prompt of its own (so the fake's answer,
/// `ok:` + the prompt's first 8 characters, tells whose answer a result carries).
fn keyed(id: &str, key: &str, prompt: &str, params: Value) -> TestRequest {
    let body = json!({"id": id, "prompt": prompt, "prefix_key": key, "params": params});
    TestRequest { id: id.to_owned(), body: serde_json::to_vec(&body).unwrap(), group: 0 }
}

/// The fake's answer to `prompt`.
fn answer_of(prompt: &str) -> String {
    format!("ok:{}", prompt.chars().take(8).collect::<String>())
}

/// Runs one daemon against `fake` with static prefix keys, one shard per key and a long enough
/// batch wait (so requests published together on one key form one batch, one list call),
/// publishes `reqs`, waits for every result, stops the daemon and cleans up; returns the results
/// by request id.
async fn results_of(test: &str, fake: &FakeLlmHandle, reqs: &[TestRequest]) -> HashMap<String, RequestResult> {
    let env = TestEnv::new(test);
    let mut raw = env.raw_config(fake.url.as_str());
    raw.keying.mode = "prefix".into();
    raw.sharding.default_shards = 1;
    raw.batching.max_batch_wait = "500ms".into();
    assert!(raw.llm.list_prompts, "the fixtures need list prompts");
    let Started { amqp, daemon, mut results, reply } = start_with_replies(&env, &raw).await;
    amqp.publish_requests(&env.input_queue(), reqs, &reply).await;
    results.until_all(&ids(reqs), DEADLINE).await;
    daemon.stop().await.expect("daemon stops cleanly");
    amqp.close().await;
    env.cleanup().await;
    results.received.iter().map(|m| (m.correlation_id.clone(), m.result())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_ignoring_n_never_gives_a_request_anothers_answer() {
    // The fake always answers one choice per prompt (indices 0, 1, 2), whatever `n` asks for.
    let fake = FakeLlm::new().start().await.unwrap();
    let prompts = ["AAAAAAAA first question", "BBBBBBBB second question", "CCCCCCCC third question"];
    let reqs: Vec<TestRequest> =
        prompts.iter().enumerate().map(|(i, p)| keyed(&format!("n-{i}"), "ignore-n", p, json!({"n": 2, "max_tokens": 4}))).collect();
    let by_id = results_of("ignore-n", &fake, &reqs).await;
    for (r, prompt) in reqs.iter().zip(prompts) {
        let res = &by_id[&r.id];
        if res.ok {
            let own = answer_of(prompt);
            let texts: Vec<&str> = match &res.output {
                Value::String(s) => vec![s.as_str()],
                Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                other => panic!("output of {} is neither text nor a list of texts: {other}", r.id),
            };
            assert!(texts.iter().all(|t| *t == own), "request {} ({prompt:?}) got {texts:?}, its own answer is {own:?}", r.id);
        } else {
            let e = res.error.as_ref().unwrap_or_else(|| panic!("failed result {} without an error", r.id));
            assert!(!e.message.is_empty(), "failed result {} must say why", r.id);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_prompt_fails_alone() {
    let fake = FakeLlm::new().max_prompt_chars(100).start().await.unwrap();
    let short = "SHORTONE a question that fits";
    let long = format!("LONGLONG {}", "x".repeat(200));
    let reqs = vec![keyed("short", "too-long", short, json!({})), keyed("long", "too-long", &long, json!({}))];
    let by_id = results_of("too-long", &fake, &reqs).await;
    let ok = &by_id["short"];
    assert!(ok.ok, "the short request must be answered: {:?}", ok.error);
    assert_eq!(ok.output, Value::String(answer_of(short)));
    let failed = &by_id["long"];
    assert!(!failed.ok, "the over-long request must fail");
    assert_eq!(failed.error.as_ref().map(|e| e.kind.as_str()), Some("rejected"), "{:?}", failed.error);
}

/// Polls `/readyz` on `addr` every 50 ms until `done(status, body)` holds; panics after `within`
/// saying `what` did not happen.
async fn wait_readyz(addr: &str, what: &str, within: Duration, done: impl Fn(u16, &str) -> bool) {
    let deadline = Instant::now() + within;
    loop {
        let (status, body) = http_get(addr, "/readyz").await;
        if done(status, &body) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for {what}; /readyz: {status} {body:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Messages (ready + unacked) in the deployment's input and partition queues.
fn queued(env: &TestEnv) -> u64 {
    let input = broker::queues(&env.input_queue());
    let partitions = broker::queues(&env.partition_queue_prefix());
    input.iter().chain(&partitions).map(|(_, ready, unacked)| ready + unacked).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthorized_llm_keeps_requests_queued_until_it_accepts_again() {
    let env = TestEnv::new("llm-401");
    let fake = FakeLlm::new().start().await.unwrap();
    fake.set_status(Some(401));
    let raw = env.raw_config(fake.url.as_str());
    let daemon = DaemonProcess::run(&env, "a", &raw);
    let mut redis = RedisProbe::connect().await.unwrap();
    redis.wait_all_held_by(env.key_prefix(), PARTITIONS, &raw.instance.name).await;
    let http = daemon.http_addr().await;
    let amqp = Amqp::connect().await;
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    let reqs = completions_workload("auth", 50, 4);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;

    fake.wait_for_calls(1).await;
    wait_readyz(&http, "/readyz 503 naming the LLM", DEADLINE, |s, b| s == 503 && b.contains("llm endpoints unavailable")).await;
    let early = results.collect_for(Duration::from_secs(3)).await;
    assert_eq!(early, 0, "no result while the LLM answers 401: {:?}", results.received.first().map(|m| m.result()));
    // rabbitmqctl's queue counts lag behind (quorum queue metrics are refreshed every few
    // seconds): wait for them to show every request, with a deadline.
    let deadline = Instant::now() + Duration::from_secs(20);
    while queued(&env) != 50 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(queued(&env), 50, "every request stays queued (input or partition queues)");
    assert_eq!(results.collect_for(Duration::from_millis(100)).await, 0, "no result while the LLM answers 401");

    fake.set_status(None);
    results.until_all(&ids(&reqs), DEADLINE).await;
    let failed: Vec<_> = results.received.iter().map(|m| m.result()).filter(|r| !r.ok).collect();
    assert!(failed.is_empty(), "{} ok:false results after a 401 period, e.g. {:?}", failed.len(), failed.first());
    wait_readyz(&http, "/readyz 200 after the LLM recovered", DEADLINE, |s, _| s == 200).await;
    drop(daemon);
    amqp.close().await;
    env.cleanup().await;
}

/// Observed: `status` against a Redis that took the connection and then stalled (`CLIENT PAUSE`)
/// printed only `prefix-batcher status: timed out`; it now names Redis and its address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_against_a_stalled_redis_names_redis() {
    let env = TestEnv::new("redis-stall");
    let redis = RedisServer::start(&env, "redis").await;
    let mut raw = env.raw_config("http://127.0.0.1:9");
    raw.redis.url = redis.url.clone();
    raw.redis.command_timeout = "1s".into();
    let config = write_config(&env, "status", &raw);
    let address = redis.url.rsplit('@').next().unwrap_or(&redis.url).trim_start_matches("redis://").trim_end_matches('/').to_owned();
    let address = address.trim_start_matches("unix://").to_owned();
    let mut c = redis.connect().await.expect("connect");
    let _: String = redis::cmd("CLIENT").arg("PAUSE").arg(20_000).arg("ALL").query_async(&mut c).await.expect("CLIENT PAUSE");
    let out = tokio::task::spawn_blocking(move || bin_command().arg("--config").arg(&config).arg("status").output().expect("run status"))
        .await
        .expect("status");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("timed out") && text.contains(&address) && text.contains("Redis at"), "names neither Redis nor {address}: {text}");
    drop(redis);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_with_millions_of_keys_does_not_delay_readiness() {
    let env = TestEnv::new("redis-big");
    let redis = RedisServer::start(&env, "redis").await;
    let mut conn = redis.connect().await.unwrap();
    let _: String = redis::cmd("DEBUG").arg("POPULATE").arg(3_000_000).query_async(&mut conn).await.expect("DEBUG POPULATE");
    let fake = FakeLlm::new().start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.redis.url = redis.url.clone();

    let started = Instant::now();
    let daemon = DaemonProcess::run(&env, "a", &raw);
    let http = daemon.http_addr().await;
    let within = Duration::from_secs(20);
    wait_readyz(&http, "readiness with 3 million unrelated keys", within, |s, _| s == 200).await;
    eprintln!("ready after {:.1} s with 3 million unrelated Redis keys", started.elapsed().as_secs_f64());

    let amqp = Amqp::connect().await;
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    let reqs = completions_workload("big", 10, 2);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    results.until_all(&ids(&reqs), DEADLINE).await;
    assert!(results.received.iter().all(|m| m.result().ok), "every request answered ok");
    drop(daemon);
    amqp.close().await;
    env.cleanup().await;
}

/// Runs a test body that starts a daemon, publishes, and panics, on a runtime of `flavor`; returns
/// the namespace it used.
fn run_panicking_test(multi_thread: bool) -> String {
    let (name_tx, name_rx) = std::sync::mpsc::channel();
    let outcome = std::thread::spawn(move || {
        let rt = if multi_thread {
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()
        } else {
            tokio::runtime::Builder::new_current_thread().enable_all().build()
        };
        rt.unwrap().block_on(async move {
            let env = TestEnv::new("panics");
            name_tx.send(env.name.clone()).unwrap();
            let fake = FakeLlm::new().start().await.unwrap();
            let raw = env.raw_config(fake.url.as_str());
            let Started { amqp, daemon: _daemon, results: _results, reply } = start_with_replies(&env, &raw).await;
            amqp.publish_requests(&env.input_queue(), &completions_workload("p", 5, 1), &reply).await;
            panic!("a failing assertion of some test");
        })
    })
    .join();
    assert!(outcome.is_err(), "the body panicked");
    name_rx.recv().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_test_leaves_nothing_behind() {
    for multi_thread in [true, false] {
        let name = tokio::task::spawn_blocking(move || run_panicking_test(multi_thread)).await.unwrap();
        let (queues, exchanges) = broker::names_with_prefix(&format!("{name}."));
        assert!(queues.is_empty() && exchanges.is_empty(), "left on the broker: {queues:?} {exchanges:?}");
        let keys = RedisProbe::connect().await.unwrap().keys(&format!("{name}:*")).await;
        assert!(keys.is_empty(), "left in Redis (multi_thread = {multi_thread}): {keys:?}");
    }
}

/// How [`aborted_mid_call`] makes the daemon abort its partitions.
#[derive(Clone, Copy, Debug)]
enum Abort {
    /// Redis answers nothing for 4 s: longer than the renew deadline (2 s) and the lease TTL (3 s).
    RedisOutage,
    /// Another holder takes every lease (for 3 s): the daemon's next renewal finds it lost.
    LeaseTaken,
}

/// One daemon on a private redis-server with `amqp.delivery_limit = 1` (one charged delivery
/// dead-letters a request) and LLM calls of 3 s, which outlast the renew deadline (2 s): once the
/// first call has started, every partition is aborted (`abort`), and is taken again once the
/// leases are free. Every request must get an `ok` result, none dead-lettered, and some prompt
/// must have been sent twice (an abort cut its call).
async fn aborted_mid_call(test: &str, abort: Abort) {
    let env = TestEnv::new(test);
    let redis = RedisServer::start(&env, "redis").await;
    let fake = FakeLlm::new().latency(Duration::from_secs(3)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.redis.url = redis.url.clone();
    raw.amqp.delivery_limit = 1;
    // Room in the prefetch for the copies put back: a consumer still subscribed while its batches
    // put their requests back is delivered those copies again.
    raw.amqp.partition_prefetch = 256;
    raw.keying.mode = "prefix".into();
    raw.sharding.default_shards = 1;
    let daemon = start_daemon(&raw);
    let mut probe = RedisProbe { conn: redis.connect().await.unwrap() };
    probe.wait_all_held_by(env.key_prefix(), raw.amqp.partitions, &raw.instance.name).await;
    let amqp = Amqp::connect().await;
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    let reqs = completions_workload(test, 96, 6);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    tokio::time::timeout(DEADLINE, fake.wait_for_calls(1)).await.expect("a first LLM call");
    match abort {
        Abort::RedisOutage => redis.pause(4.0).await.await.expect("DEBUG SLEEP"),
        Abort::LeaseTaken => {
            for (p, lease) in probe.leases(env.key_prefix(), raw.amqp.partitions).await.into_iter().enumerate() {
                let epoch = lease.expect("held").epoch + 1;
                let key = format!("{}:lease:{p}", env.key_prefix());
                let _: () = redis::cmd("SET").arg(&key).arg(format!("other:0:{epoch}")).arg("PX").arg(3_000).query_async(&mut probe.conn).await.unwrap();
            }
        }
    }
    results.until_all(&ids(&reqs), DEADLINE).await;

    let mut sent: HashMap<String, usize> = HashMap::new();
    for prompt in fake.calls().iter().flat_map(|c| c.prompts.clone()) {
        *sent.entry(prompt).or_default() += 1;
    }
    assert!(sent.values().any(|&n| n > 1), "{abort:?}: no call was cut by the abort (no prompt sent twice)");
    let failed: Vec<(String, RequestResult)> =
        results.received.iter().map(|m| (m.correlation_id.clone(), m.result())).filter(|(_, r)| !r.ok).collect();
    assert!(failed.is_empty(), "{abort:?}: requests charged by the abort and dead-lettered: {failed:?}");
    assert_eq!(amqp.queue_depth(&env.dead_letter_queue()).await.0, 0, "{abort:?}: dead-letter queue not empty");
    daemon.stop().await.expect("daemon stops cleanly");
    drop(redis);
    amqp.close().await;
    env.cleanup().await;
}

/// Observed: a Redis outage longer than `ownership.renew_deadline` aborted the instance's
/// partitions, and the close of their channels returned every request they held charged one
/// delivery, so each such outage used up one of `amqp.delivery_limit` deliveries of every
/// request in flight. An abort is no request's fault: they now go back uncharged. Before the
/// fix, the requests whose call the abort cut were dead-lettered (no result within the deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_past_the_renew_deadline_charges_no_request() {
    aborted_mid_call("abort-outage", Abort::RedisOutage).await;
}

/// The same for a lease lost to another holder (the renewal's compare fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_charges_no_request() {
    aborted_mid_call("abort-lost", Abort::LeaseTaken).await;
}

/// A TCP proxy to the test Redis that, once [`SlowLink::slow_down`] is called, holds everything
/// it forwards for a while in each direction: a congested or distant link that loses nothing.
struct SlowLink {
    addr: std::net::SocketAddr,
    /// The delay each way, in milliseconds (0: none).
    delay_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl SlowLink {
    async fn start(upstream: &'static str) -> SlowLink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let delay_ms = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let delay = delay_ms.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else { continue };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(Self::forward(cr, sw, delay.clone()));
                tokio::spawn(Self::forward(sr, cw, delay.clone()));
            }
        });
        SlowLink { addr, delay_ms, task }
    }

    /// Copies `from` to `to`, each chunk after the delay of the moment it was read.
    async fn forward(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, delay_ms: std::sync::Arc<std::sync::atomic::AtomicU64>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(n) if n > 0 => n,
                _ => return,
            };
            let delay = delay_ms.load(std::sync::atomic::Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    fn slow_down(&self, each_way: Duration) {
        self.delay_ms.store(each_way.as_millis() as u64, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One instance's link to Redis becomes slower than its `redis.command_timeout` (0.7 s each way,
/// a timeout of 1 s), losing nothing. Its lease renewals time out and it stops its partitions;
/// its heartbeats time out too, but reach Redis late and renewed its membership, so the other
/// instance still saw it live and the desired owner of its partitions, and took none of them
/// for as long as the slowness lasted (observed: 2 of 6 partitions unserved for the whole 46 s
/// of such a link). Now an instance whose heartbeat failed sends the next one only once Redis
/// answers a `PING` in time: its membership expires, the other instance holds every partition,
/// and requests to all of them are answered. Once the link is fast again it takes its share
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_with_a_redis_link_slower_than_the_timeout_gives_up_its_partitions() {
    let env = TestEnv::new("slowredis");
    let fake = FakeLlm::new().start().await.unwrap();
    let link = SlowLink::start("127.0.0.1:6379").await;
    let raw_a = env.raw_config(fake.url.as_str());
    let mut raw_b = raw_a.clone();
    raw_b.instance.name = env.instance("b");
    raw_b.redis.url = format!("redis://{}/", link.addr);
    raw_b.redis.command_timeout = "1s".into();
    let (name_a, name_b) = (raw_a.instance.name.clone(), raw_b.instance.name.clone());
    let mut redis = RedisProbe::connect().await.unwrap();
    let prefix = env.key_prefix().to_owned();
    let a = start_daemon(&raw_a);
    let b = start_daemon(&raw_b);
    let holders = |ls: &[Option<prefix_batcher::lease::LeaseValue>]| -> std::collections::BTreeSet<String> { ls.iter().flatten().map(|l| l.name.clone()).collect() };
    let both: std::collections::BTreeSet<String> = [name_a.clone(), name_b.clone()].into();
    redis.wait_leases(&prefix, PARTITIONS, "both instances to hold partitions", DEADLINE, |ls| ls.iter().all(Option::is_some) && holders(ls) == both).await;

    link.slow_down(Duration::from_millis(700));
    let slowed = Instant::now();
    redis.wait_all_held_by(&prefix, PARTITIONS, &name_a).await;
    let taken_over = slowed.elapsed();
    let amqp = Amqp::connect().await;
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    let reqs = completions_workload("slowredis", 64, 16);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    results.until_all(&ids(&reqs), DEADLINE).await;
    println!("a Redis link of 0.7 s each way on instance b: instance a held every partition {taken_over:?} after the slow-down; 64 requests answered");

    link.slow_down(Duration::ZERO);
    redis.wait_leases(&prefix, PARTITIONS, "instance b to take its share back", DEADLINE, |ls| ls.iter().all(Option::is_some) && holders(ls) == both).await;
    b.stop().await.expect("b stops cleanly");
    a.stop().await.expect("a stops cleanly");
    results.barrier(&amqp).await;
    results.assert_one_ok_result_each(&reqs, "failed");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}
