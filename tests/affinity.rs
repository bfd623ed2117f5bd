//! Adaptive key granularity against real services: the split set shared through Redis (two
//! instances' views agree within the refresh period, a set Redis lost is put back, and a merge
//! reaches both), and routing that goes on with the last view when Redis becomes unreachable (a
//! private redis-server that the test kills, a daemon in process, the real RabbitMQ and the fake
//! LLM).

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use llm_fakes::fake::FakeLlm;
use prefix_batcher::affinity::{RoutedKey, SplitMember, SplitState};
use prefix_batcher::config::Settings;
use prefix_batcher::keying::{derive_key, prefix_chars, PrefixKey, LEVEL_GROWTH};
use prefix_batcher::request::{parse, Envelope, Request};
use prefix_batcher::router::route_in;
use prefix_batcher::splits::{self, Affinity, SplitStore, REFRESH_INTERVAL};
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

fn completion(prompt: &str) -> Request {
    parse(json!({ "prompt": prompt }).to_string().as_bytes(), &Envelope::default(), 1 << 20).unwrap()
}

/// Waits (polling every 10 ms, at most `within`) until `done` holds; returns the time it took.
async fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "timed out after {within:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

/// Instance A finds a key hot and splits it; instance B (its refresh loop running) sees the split
/// within one refresh period, and both route the key's requests alike, by their level-1 key.
/// When A merges the key back, B's view drops it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_agree_on_a_split_within_the_refresh_period() {
    let env = TestEnv::new("affinity-agree");
    let settings = Settings::from_raw(&env.raw_config("http://127.0.0.1:9")).unwrap();
    let conn = redis::Client::open(REDIS_URL).unwrap().get_connection_manager().await.unwrap();
    let rules = splits::rules(&settings);
    let a = Affinity::default();
    let store_a = SplitStore::new(conn.clone(), env.key_prefix(), Duration::from_secs(2));
    let b = Affinity::for_prefix(env.key_prefix());
    let stop = CancellationToken::new();
    let b_loop = tokio::spawn(splits::run(Arc::new(settings.clone()), conn.clone(), stop.clone()));

    let text = format!("{} and then a long tail {}", "shared system prompt ".repeat(3), "x".repeat(200));
    let req = completion(&text);
    let before = route_in(&req, &settings, &a);
    assert_eq!(before.routed.level, 0);

    // A partition of A is overloaded by this key: 5 s queueing delay over 3 windows.
    let t0 = Instant::now();
    let mut added = Vec::new();
    for s in 0..=3 {
        for _ in 0..if s == 0 { 0 } else { 20 } {
            a.dequeued(before.partition, before.routed, Duration::from_secs(5));
        }
        added.extend(a.refresh(&store_a, &rules, t0 + Duration::from_secs(s)).await.unwrap().added);
    }
    let member = SplitMember { level: 0, key: before.routed.key, state: SplitState::Split };
    assert_eq!(added, vec![member]);
    assert_eq!(a.view().get(0, member.key), Some(SplitState::Split));
    // Within one refresh, with room for a loaded 2-core machine's scheduling (Redis round trips,
    // sibling tests running daemons).
    let took = wait_for("B's view to show the split", 8 * REFRESH_INTERVAL, || b.view().get(0, member.key).is_some()).await;
    assert!(took <= REFRESH_INTERVAL + Duration::from_millis(750), "B saw the split after {took:?}");

    let (ra, rb) = (route_in(&req, &settings, &a), route_in(&req, &settings, &b));
    let level1 = PrefixKey::of(prefix_chars(&text, PREFIX_CHARS * LEVEL_GROWTH));
    assert_eq!(ra.routed, RoutedKey { level: 1, levels: 4, key: level1 });
    assert_eq!((ra.routed, ra.partition), (rb.routed, rb.partition), "both instances route alike");

    // Status lists it, with its drain rate (60 requests over 3 s).
    let listed = SplitStore::new(conn.clone(), env.key_prefix(), Duration::from_secs(2)).read().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].member, listed[0].drain_rps), (member, Some(20.0)));

    // Redis loses the set (restarted empty, flushed): B puts the split back from its view at its
    // next refresh, with its drain rate; no view ever drops it.
    let mut r = conn.clone();
    let lost = [splits::splits_key(env.key_prefix()), splits::drain_key(env.key_prefix()), splits::generation_key(env.key_prefix())];
    let _: i64 = redis::cmd("DEL").arg(&lost).query_async(&mut r).await.unwrap();
    let reader = SplitStore::new(conn.clone(), env.key_prefix(), Duration::from_secs(2));
    let lost_at = Instant::now();
    loop {
        let listed = reader.read().await.unwrap();
        if listed.len() == 1 {
            assert_eq!((listed[0].member, listed[0].drain_rps), (member, Some(20.0)));
            break;
        }
        assert!(lost_at.elapsed() < 2 * REFRESH_INTERVAL + Duration::from_millis(750), "B did not put the split back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(b.view().get(0, member.key), Some(SplitState::Split));

    // Cool (a request or two against a drain rate of 20/s): A merges it after the hold time and
    // 10 s of cool rates, reviewed each second (a gap of the cool time between two reviews
    // would start the cool time again).
    let mut merged = 0;
    for s in [10].into_iter().chain(40..=51) {
        merged += a.refresh(&store_a, &rules, t0 + Duration::from_secs(s)).await.unwrap().removed.len();
    }
    assert_eq!(merged, 1, "merged after 30 s split and 10 s cool");
    assert!(a.view().is_empty());
    wait_for("B's view to drop the merged key", 8 * REFRESH_INTERVAL, || b.view().is_empty()).await;
    assert_eq!(route_in(&req, &settings, &b).routed, before.routed);

    stop.cancel();
    b_loop.await.unwrap();
    env.cleanup().await;
}

/// A redis-server of this test only, on a port the OS picked; killed on drop.
struct PrivateRedis {
    child: Child,
    url: String,
}

impl PrivateRedis {
    /// Starts redis-server on a port the OS picked for a moment; again on another port (up to 3
    /// times) when the server exits, as when a parallel test took the port in between.
    async fn start(dir: &std::path::Path) -> PrivateRedis {
        for attempt in 1..=3 {
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let mut child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed");
            let url = format!("redis://127.0.0.1:{port}/");
            let client = redis::Client::open(url.as_str()).unwrap();
            let deadline = Instant::now() + DEADLINE;
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    eprintln!("private redis-server on port {port} exited ({status}), attempt {attempt} of 3");
                    break;
                }
                if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                    if redis::cmd("PING").query_async::<String>(&mut c).await.is_ok() {
                        return PrivateRedis { child, url };
                    }
                }
                assert!(Instant::now() < deadline, "private redis-server did not answer");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        panic!("private redis-server exited three times")
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

fn sync_failures() -> u64 {
    let text = prefix_batcher::metrics::render();
    text.lines()
        .find_map(|l| l.strip_prefix("prefix_batcher_split_sync_failures_total "))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// The daemon's view holds a split when its Redis dies: the refresh fails, the view stays, and
/// the router keeps routing the key's requests by their level-1 keys (the results carry the
/// routed key: the partitions batch by it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_goes_on_with_the_last_view_when_redis_is_unreachable() {
    let env = TestEnv::new("affinity-outage");
    let mut redis = PrivateRedis::start(&env.dir).await;
    let fake = FakeLlm::new().latency(Duration::from_millis(5)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.redis.url = redis.url.clone();
    // Leases long enough for the partitions to keep working after Redis is gone.
    raw.ownership.lease_ttl = "60s".into();
    raw.ownership.renew_deadline = "40s".into();
    raw.ownership.renew_interval = "10s".into();
    raw.ownership.member_ttl = "60s".into();
    let settings = Settings::from_raw(&raw).unwrap();
    let amqp = Amqp::connect().await;
    let daemon = start_daemon(&raw);

    // All leases held in the private Redis: the topology is declared.
    let mut r = redis::Client::open(redis.url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let lease_keys: Vec<String> = (0..PARTITIONS).map(|p| format!("{}:lease:{p}", env.key_prefix())).collect();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let held: Vec<Option<String>> = redis::cmd("MGET").arg(&lease_keys).query_async(&mut r).await.unwrap();
        if held.iter().all(Option::is_some) {
            break;
        }
        assert!(Instant::now() < deadline, "the daemon did not take its leases");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A split of the workload's level-0 key (as another instance would have published it).
    let head = "The hot shared prefix of this test.";
    let texts: Vec<String> = (0..24).map(|i| format!("{head} request {i:03} {}", "y".repeat(150))).collect();
    let level0 = derive_key(&completion(&texts[0]), &settings.keying).key;
    let member = SplitMember { level: 0, key: level0, state: SplitState::Split };
    let far = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64 + 3_600_000;
    let _: i64 = redis::cmd("ZADD").arg(splits::splits_key(env.key_prefix())).arg(far).arg(member.to_string()).query_async(&mut r).await.unwrap();
    let view = Affinity::for_prefix(env.key_prefix());
    wait_for("the daemon's view to show the split", DEADLINE, || view.view().get(0, level0).is_some()).await;

    // Redis dies; the next refresh fails.
    let failures = sync_failures();
    redis.kill();
    wait_for("a failed refresh", DEADLINE, || sync_failures() > failures).await;
    assert_eq!(view.view().get(0, level0), Some(SplitState::Split), "the view is kept");

    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    let reqs: Vec<TestRequest> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| TestRequest { id: format!("outage-{i}"), body: json!({ "id": format!("outage-{i}"), "prompt": t }).to_string().into_bytes(), group: 0 })
        .collect();
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    results.until_all(&ids(&reqs), DEADLINE).await;
    for (id, got) in results.by_correlation() {
        let i: usize = id.trim_start_matches("outage-").parse().unwrap();
        let level1 = PrefixKey::of(prefix_chars(&texts[i], PREFIX_CHARS * LEVEL_GROWTH));
        assert_eq!(got[0].result().prefix_key, level1.to_string(), "{id} routed and batched by its level-1 key");
    }
    assert_eq!(view.view().get(0, level0), Some(SplitState::Split), "still kept after routing");

    // Stop: releasing leases fails against the dead Redis; the daemon still stops.
    let _ = tokio::time::timeout(DEADLINE, daemon.stop()).await;
    results.close().await;
    amqp.close().await;
    drop(redis);
    env.cleanup().await;
}

/// A daemon whose one LLM server is slower than the arrivals of one hot key: the key's partition
/// queues requests for seconds, the key splits by itself, and the requests that arrive after the
/// split route (and batch) by their own level-1 keys; the split set in Redis holds the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_splits_by_itself_and_its_requests_fan_out() {
    let env = TestEnv::new("affinity-hot");
    // Drain: 2 calls in flight × 2 requests per batch / 300 ms ≈ 13 requests/s; arrivals 25/s.
    let fake = FakeLlm::new().latency(Duration::from_millis(300)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.batching.max_batch_size = 2;
    raw.llm.max_concurrency = 2;
    let settings = Settings::from_raw(&raw).unwrap();
    let Started { amqp, daemon, results: replies, .. } = start_with_replies(&env, &raw).await;
    let mut results = amqp.consume(&env.results_queue()).await;

    let head = "One hot shared system prompt....";
    assert_eq!(head.chars().count(), PREFIX_CHARS);
    let texts: Vec<String> = (0..240).map(|i| format!("{head} user turn {i:04} {}", "z".repeat(120))).collect();
    let reqs: Vec<TestRequest> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| TestRequest { id: format!("hot-{i}"), body: json!({ "id": format!("hot-{i}"), "prompt": t }).to_string().into_bytes(), group: 0 })
        .collect();
    let level0 = derive_key(&completion(&texts[0]), &settings.keying).key;
    let publisher = cluster::PacedPublisher::start(env.input_queue(), reqs.clone(), 25);
    let view = Affinity::for_prefix(env.key_prefix());
    wait_for("the hot key to split", DEADLINE, || view.view().get(0, level0) == Some(SplitState::Split)).await;
    let mut r = RedisProbe::connect().await.unwrap();
    let member = SplitMember { level: 0, key: level0, state: SplitState::Split };
    let score: Option<f64> =
        redis::cmd("ZSCORE").arg(splits::splits_key(env.key_prefix())).arg(member.to_string()).query_async(&mut r.conn).await.unwrap();
    assert!(score.is_some(), "the split is in the shared split set");

    results.until_all(&ids(&reqs), DEADLINE).await;
    let by_id = results.by_correlation();
    let (mut at_level0, mut at_level1) = (0, std::collections::HashSet::new());
    for (i, text) in texts.iter().enumerate() {
        let key = by_id[&format!("hot-{i}")][0].result().prefix_key;
        let level1 = PrefixKey::of(prefix_chars(text, PREFIX_CHARS * LEVEL_GROWTH)).to_string();
        if key == level0.to_string() {
            at_level0 += 1;
        } else {
            assert_eq!(key, level1, "hot-{i} routed by neither its level-0 nor its level-1 key");
            at_level1.insert(key);
        }
    }
    assert!(at_level0 > 0 && at_level1.len() > 10, "{at_level0} requests at level 0, {} distinct level-1 keys", at_level1.len());
    drop(publisher);

    daemon.stop().await.expect("daemon stops cleanly");
    results.close().await;
    replies.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// Requests that waited out an LLM outage are not load. The only server answers 503, so the
/// breaker opens and the intake pauses; 60 requests of one key wait 6 s in their partition queue
/// (`amqp.partition_prefetch = 4`: few are held in memory). When the server is back they drain at
/// once, and the key does not split: their wait counts for the split rule only from the intake's
/// resume. Counted from the router's forward, their median queueing delay was the outage (6 s
/// against the rule's 2 s), and every key with a backlog split when the server came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_backlog_does_not_split_its_key() {
    let env = TestEnv::new("affinity-outage");
    let fake = FakeLlm::new().start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.partition_prefetch = 4;
    raw.batching.max_batch_size = 4;
    let settings = Settings::from_raw(&raw).unwrap();
    let Started { amqp, daemon, results: replies, .. } = start_with_replies(&env, &raw).await;
    let mut results = amqp.consume(&env.results_queue()).await;

    let head = "One shared system prompt, outage";
    assert_eq!(head.chars().count(), PREFIX_CHARS);
    let texts: Vec<String> = (0..60).map(|i| format!("{head} user turn {i:04} {}", "z".repeat(120))).collect();
    let reqs: Vec<TestRequest> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| TestRequest { id: format!("outage-{i}"), body: json!({ "id": format!("outage-{i}"), "prompt": t }).to_string().into_bytes(), group: 0 })
        .collect();
    let level0 = derive_key(&completion(&texts[0]), &settings.keying).key;
    fake.set_status(Some(503));
    amqp.publish_requests(&env.input_queue(), &reqs, "").await;
    // The outage lasts 6 s from the publish: three times the split rule's 2 s.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(fake.call_count() > 0, "the server was called during the outage");
    assert_eq!(results.received.len(), 0, "nothing answered during the outage");
    fake.set_status(None);

    let view = Affinity::for_prefix(env.key_prefix());
    let split = || view.view().get(0, level0).is_some();
    let answered = Instant::now();
    let mut seen_split = false;
    while results.received.len() < reqs.len() && answered.elapsed() < DEADLINE {
        results.collect_for(Duration::from_millis(100)).await;
        seen_split |= split();
    }
    results.until_all(&ids(&reqs), DEADLINE).await;
    // Two more refresh periods after the last answer: a decision from the drained backlog shows.
    let after = Instant::now();
    while after.elapsed() < REFRESH_INTERVAL * 3 {
        seen_split |= split();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!seen_split, "the key split on the backlog of an outage: {:?}", view.view().get(0, level0));

    daemon.stop().await.expect("daemon stops cleanly");
    results.close().await;
    replies.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// A Redis that stalls (SIGSTOP, as a paused VM or a long fork would) while a split key's
/// requests keep coming: the refreshes time out, but Redis runs the calls queued on its socket
/// when it resumes. Every arrival must still be counted exactly once, in the second it was
/// counted in. Before, each timed-out call's arrivals were sent again with the next, so Redis
/// added them several times, all in the second it resumed: the key's rate read 2–3 × its
/// traffic, and the merge rule (half the peak) then merged back a key whose traffic never changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrivals_of_a_stalled_redis_are_counted_once_in_their_own_seconds() {
    let env = TestEnv::new("affinity-stall");
    let redis = PrivateRedis::start(&env.dir).await;
    let conn = redis::Client::open(redis.url.as_str()).unwrap().get_connection_manager().await.unwrap();
    let settings = Settings::from_raw(&env.raw_config("http://127.0.0.1:9")).unwrap();
    let rules = splits::rules(&settings);
    let store = SplitStore::new(conn.clone(), env.key_prefix(), Duration::from_millis(400));
    let a = Affinity::default();
    let member = SplitMember { level: 0, key: PrefixKey(42), state: SplitState::Split };
    let far = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64 + 3_600_000;
    let mut r = conn.clone();
    let _: i64 = redis::cmd("ZADD").arg(splits::splits_key(env.key_prefix())).arg(far).arg(member.to_string()).query_async(&mut r).await.unwrap();
    a.refresh(&store, &rules, Instant::now()).await.unwrap();
    assert_eq!(a.view().get(0, PrefixKey(42)), Some(SplitState::Split));

    // 20 requests/s through the split for 3 s, a 3 s stall, then 4 s more; a refresh every 250 ms.
    let signal = |sig: &str| assert!(Command::new("kill").args([sig, &redis.child.id().to_string()]).status().unwrap().success());
    let (mut routed, mut failed) = (0u64, 0);
    let start = Instant::now();
    let mut tick = tokio::time::interval(REFRESH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut stopped, mut resumed) = (false, false);
    while start.elapsed() < Duration::from_secs(10) {
        tick.tick().await;
        if !stopped && start.elapsed() >= Duration::from_secs(3) {
            signal("-STOP");
            stopped = true;
        }
        if !resumed && start.elapsed() >= Duration::from_secs(6) {
            signal("-CONT");
            resumed = true;
        }
        // Paced by the clock, not by the loop (a refresh that times out takes longer than a tick).
        let due = (start.elapsed().as_secs_f64() * 20.0) as u64;
        while routed < due {
            let choice = prefix_batcher::affinity::choose(&a.view(), 4, |l| PrefixKey(42 + u64::from(l)));
            a.routed(&choice, PrefixKey(42), 300, false);
            routed += 1;
        }
        failed += u64::from(a.refresh(&store, &rules, Instant::now()).await.is_err());
    }
    // The last batch, once more, so that every arrival has been delivered.
    for _ in 0..20 {
        if a.refresh(&store, &rules, Instant::now()).await.is_ok() {
            break;
        }
    }
    assert!(failed >= 3, "the stall made refreshes time out ({failed} did)");

    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{}:*", splits::arrivals_key_prefix(env.key_prefix()))).query_async(&mut r).await.unwrap();
    let mut per_second = Vec::new();
    for k in keys.iter().filter(|k| !k.contains("-seq:")) {
        let n: Option<u64> = redis::cmd("HGET").arg(k).arg(member.to_string()).query_async(&mut r).await.unwrap();
        per_second.push((k.rsplit(':').next().unwrap().parse::<u64>().unwrap(), n.unwrap_or(0)));
    }
    per_second.sort();
    println!("arrivals per second (20 routed a second, Redis stalled from 3 s to 6 s): {per_second:?}");
    assert_eq!(per_second.iter().map(|(_, n)| n).sum::<u64>(), routed, "every arrival counted once: {per_second:?}");
    // Filed where counted: no second holds the stall's arrivals (60) at once. A second holds 20,
    // up to 4 refreshes' worth more where the clock estimate and the refresh ticks straddle it.
    let most = per_second.iter().map(|(_, n)| *n).max().unwrap();
    assert!(most <= 40, "a second holds {most} arrivals: {per_second:?}");
    drop(redis);
    env.cleanup().await;
}
