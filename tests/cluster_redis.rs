//! Redis Sentinel deployments: the daemon follows a failover, and fencing (epochs) survives it.
//!
//! - [`epoch_is_at_least_redis_time`] (fast, shared Redis): the acquire rule
//!   `epoch = max(INCR, TIME in ms)` — a lowered or deleted counter never yields a smaller epoch.
//! - [`a_primary_failure_under_load`] (`#[ignore]`, private Sentinel set): three daemons under a
//!   steady load; the primary is SIGKILLed. Nothing is lost, every partition's
//!   `x-partition-epoch` never decreases in the order results arrive, and the leases recover.
//! - [`a2_primary_failure_within_the_renew_deadline`] (`#[ignore]`): the same with the default
//!   lease timings: the failover ends before any renew deadline and no lease moves.
//! - [`b_replica_lag_then_failover`] (`#[ignore]`, private Sentinel set): the replica is cut off
//!   from the primary while epochs advance, then a failover promotes it; every partition's next
//!   epoch is still greater than any epoch issued before.
//! - [`c_redis_commands_per_instance`] (`#[ignore]`, measurement): Redis commands per second of
//!   one daemon with the default timings, idle and under load (`INFO commandstats`).
//! - [`d_epoch_rule_cost`] (`#[ignore]`, measurement): acquire latency and Redis CPU of the epoch
//!   rule against the counter alone and against `INCR` + `WAIT 1 100`.
//!
//! Each ignored test starts its own Redis primary, replica and three sentinels on ports the OS
//! picks (`scripts/cluster-redis` with a private `CLUSTER_REDIS_DIR`) and stops them at the end;
//! they do not touch the shared Redis or each other:
//!
//! ```text
//! cargo test --test cluster_redis -- --ignored --nocapture --test-threads=1
//! ```
//!
//! (`scripts/test` runs a, a2 and b in its heavy stage; c and d print the numbers quoted in
//! docs/operations.md and `src/lease.rs`.)

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::cluster::*;
use common::*;
use llm_fakes::fake::FakeLlm;
use prefix_batcher::config::{RawConfig, RawOwnership, Settings};
use prefix_batcher::lease::{self, Acquire, Leases};
use tokio::time::Instant;

// ---------------------------------------------------------------------------------------------
// A private Sentinel set.
// ---------------------------------------------------------------------------------------------

/// One primary, one replica, three sentinels of this test only (`scripts/cluster-redis` with its
/// own directory); stopped (and the directory deleted) on drop.
struct SentinelSet {
    dir: PathBuf,
    sentinels: Vec<String>,
    master: String,
}

fn cluster_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/cluster-redis")
}

impl SentinelSet {
    fn start(env: &TestEnv) -> SentinelSet {
        // Not under `env.dir`: `TestEnv::cleanup` deletes that before this set is dropped, and
        // `stop` needs the pid files.
        let dir = std::env::temp_dir().join(format!("{}-redis", env.name));
        let out = Command::new(cluster_script())
            .arg("start")
            .env("CLUSTER_REDIS_DIR", &dir)
            .env("CLUSTER_REDIS_MASTER", format!("{}-master", env.name))
            .output()
            .expect("run scripts/cluster-redis");
        assert!(out.status.success(), "scripts/cluster-redis start failed: {}", String::from_utf8_lossy(&out.stderr));
        let vars: HashMap<String, String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
            .collect();
        SentinelSet {
            dir,
            sentinels: vars["REDIS_SENTINELS"].split(',').map(str::to_owned).collect(),
            master: vars["REDIS_SENTINEL_MASTER"].clone(),
        }
    }

    /// `raw` pointed at this set: sentinels and master name; `redis.url` only for its scheme.
    fn configure(&self, raw: &mut RawConfig) {
        raw.redis.url = "redis://127.0.0.1:1/".into();
        raw.redis.sentinels = self.sentinels.clone();
        raw.redis.sentinel_master = self.master.clone();
    }

    /// `host:port` of the primary as the first answering sentinel reports it.
    async fn primary(&self) -> String {
        for s in &self.sentinels {
            let Ok(client) = redis::Client::open(format!("redis://{s}/")) else { continue };
            let Ok(Ok(mut c)) = tokio::time::timeout(Duration::from_secs(2), client.get_multiplexed_async_connection()).await else { continue };
            let addr: redis::RedisResult<(String, u16)> =
                redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg(&self.master).query_async(&mut c).await;
            if let Ok((h, p)) = addr {
                return format!("{h}:{p}");
            }
        }
        panic!("no sentinel of {:?} answered", self.sentinels);
    }

    /// Waits until the sentinels report a primary other than `old`; returns it.
    async fn wait_new_primary(&self, old: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let p = self.primary().await;
            if p != old {
                return p;
            }
            assert!(Instant::now() < deadline, "no failover away from {old} within {within:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A [`RedisProbe`] on the current primary.
    async fn probe(&self) -> RedisProbe {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let addr = self.primary().await;
            if let Ok(Ok(conn)) = tokio::time::timeout(Duration::from_secs(2), node(&addr)).await {
                return RedisProbe { conn };
            }
            assert!(Instant::now() < deadline, "primary {addr} not reachable");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Pid of the redis-server listening on `addr` (from the set's pid files).
    fn pid_of(&self, addr: &str) -> u32 {
        let port = addr.rsplit(':').next().unwrap();
        for n in ["redis-a", "redis-b"] {
            let d = self.dir.join(n);
            if std::fs::read_to_string(d.join("port")).unwrap().trim() == port {
                return std::fs::read_to_string(d.join("pid")).unwrap().trim().parse().unwrap();
            }
        }
        panic!("{addr} is not a node of this set");
    }

    /// `host:port` of the node that is not `addr`.
    fn other_node(&self, addr: &str) -> String {
        let port = addr.rsplit(':').next().unwrap();
        for n in ["redis-a", "redis-b"] {
            let p = std::fs::read_to_string(self.dir.join(n).join("port")).unwrap();
            if p.trim() != port {
                return format!("127.0.0.1:{}", p.trim());
            }
        }
        unreachable!()
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        let _ = Command::new(cluster_script()).arg("stop").env("CLUSTER_REDIS_DIR", &self.dir).output();
    }
}

async fn node(addr: &str) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    redis::Client::open(format!("redis://{addr}/"))?.get_multiplexed_async_connection().await
}

fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

// ---------------------------------------------------------------------------------------------
// The epoch rule (fast).
// ---------------------------------------------------------------------------------------------

/// Wall clock in ms (the machine Redis runs on; Redis's `TIME` reads the same clock).
fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

/// `epoch = max(INCR, TIME in ms)`, written back to the counter: a counter that a failover
/// rolled back (lowered) or lost (deleted) still yields an epoch above every earlier one, and a
/// counter ahead of the clock keeps counting from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epoch_is_at_least_redis_time() {
    let env = TestEnv::new("epoch-time");
    let conn = redis::Client::open(REDIS_URL).unwrap().get_connection_manager().await.unwrap();
    let (ttl, t) = (Duration::from_secs(3), Duration::from_secs(2));
    let a = Leases::new(conn, env.key_prefix(), "a:n1".into(), ttl, t);
    let mut probe = RedisProbe::connect().await.unwrap();
    let counter = Leases::epoch_key(env.key_prefix(), 3);

    let before = now_ms();
    let Acquire::Acquired(e1) = a.acquire(3).await.unwrap() else { panic!("free lease not acquired") };
    assert!(e1 >= before && e1 <= now_ms(), "first epoch {e1} is Redis's time in ms (test clock {before}..)");
    assert_eq!(probe.get(&counter).await, Some(e1.to_string()), "the epoch is written back to the counter");

    // A counter rolled back by a failover (the new primary missed the last INCRs).
    let _: () = redis::cmd("SET").arg(&counter).arg(e1 - 1_000).query_async(&mut probe.conn).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2)).await;
    let Acquire::Acquired(e2) = a.acquire(3).await.unwrap() else { panic!() };
    assert!(e2 > e1, "after a rolled-back counter: {e2} must exceed {e1}");

    // A lost counter.
    probe.del(&counter).await;
    tokio::time::sleep(Duration::from_millis(2)).await;
    let Acquire::Acquired(e3) = a.acquire(3).await.unwrap() else { panic!() };
    assert!(e3 > e2, "after a lost counter: {e3} must exceed {e2}");

    // A counter ahead of the clock (acquisitions faster than one per ms) counts on: INCR wins.
    let ahead = now_ms() + 60_000;
    let _: () = redis::cmd("SET").arg(&counter).arg(ahead).query_async(&mut probe.conn).await.unwrap();
    let Acquire::Acquired(e4) = a.acquire(3).await.unwrap() else { panic!() };
    assert_eq!(e4, ahead + 1);
    assert_eq!(probe.get(&Leases::lease_key(env.key_prefix(), 3)).await, Some(format!("a:n1:{e4}")));
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// a. Primary failure under load.
// ---------------------------------------------------------------------------------------------

/// a. Three daemons with `redis.sentinels` (test timings: lease 3 s, renew deadline 2 s) under a
/// steady load of 3,000 requests at 150/s; after 900 requests the Redis primary is SIGKILLed.
/// The sentinels promote the replica (down-after 2 s); the daemons find it through the sentinels.
/// Pass: every request gets an ok result, each partition's `x-partition-epoch` never decreases in
/// the order results arrive, every partition is leased again with an epoch above its epoch at the
/// kill, and every daemon logged the new primary. Prints the recovery times and duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private Redis Sentinel set and kills its primary; ~1 min"]
async fn a_primary_failure_under_load() {
    const P: u32 = 12;
    const N: usize = 3_000;
    let env = TestEnv::new("sentinel-kill");
    let set = SentinelSet::start(&env);
    let fake = FakeLlm::new().latency(Duration::from_millis(30)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.partitions = P;
    set.configure(&mut raw);
    let prefix = env.key_prefix().to_owned();
    let mut probe = set.probe().await;
    let (mut cluster, ..) = Cluster::start_settled(&env, raw, &["a", "b", "c"], &mut probe).await;

    let Load { t0, log, reqs, publisher } = Load::start(&env, "failover", N, 40, 150);
    publisher.wait_published(900, DEADLINE).await;
    let at_kill = probe.leases(&prefix, P).await;
    assert!(at_kill.iter().all(Option::is_some), "every partition leased before the kill: {at_kill:?}");
    let old_primary = set.primary().await;
    let t_kill = Instant::now();
    send_signal(set.pid_of(&old_primary), "KILL");
    let done_at_kill = log.distinct().len();

    let new_primary = set.wait_new_primary(&old_primary, Duration::from_secs(30)).await;
    let promoted = t_kill.elapsed();
    let mut probe = set.probe().await;
    let (_, at) = poll_leases(&mut probe, &prefix, P, "every partition leased again above its epoch at the kill", DEADLINE, Duration::from_millis(20), |ls| {
        ls.iter().zip(&at_kill).all(|(l, old)| l.as_ref().is_some_and(|l| l.epoch > old.as_ref().map_or(0, |o| o.epoch)))
    })
    .await;
    let leases_back = at - t_kill;

    wait_all_done(publisher, &log, &reqs).await;
    cluster.assert_running(&["a", "b", "c"]);
    let results = log.stop_after(&mut cluster).await;

    let t = tally(&reqs, &results);
    assert!(t.lost.is_empty(), "{} requests lost: {:?}", t.lost.len(), &t.lost[..t.lost.len().min(10)]);
    assert_eq!(t.failed, 0, "failed results");
    let decreases = epoch_decreases(&results);
    assert!(decreases.is_empty(), "x-partition-epoch decreased in arrival order: {decreases:?}");
    let old_epochs: BTreeMap<u32, u64> = at_kill.iter().enumerate().map(|(p, l)| (p as u32, l.as_ref().unwrap().epoch)).collect();
    let first_new = first_results_after(&results, &old_epochs, t_kill);
    for s in ["a", "b", "c"] {
        let log = cluster.proc(s).log();
        assert!(log.contains("Redis primary changed") && log.contains(&new_primary), "instance {s} did not log the new primary {new_primary}");
    }
    println!(
        "sentinel kill: {N} requests, {} results, lost {}, duplicates {} ({} requests done at the kill); primary {old_primary} -> {new_primary}",
        t.results,
        t.lost.len(),
        t.duplicates(),
        done_at_kill
    );
    println!(
        "sentinel kill: replica promoted {} after the SIGKILL; all {P} partitions leased again (new epochs) {} after it; first result of a new epoch {} (max over {} partitions); all done {:.1}s after the start; epochs never decreased ({} results checked)",
        secs(promoted),
        secs(leases_back),
        first_new.values().max().map_or("-".into(), |d| secs(*d)),
        first_new.len(),
        t0.elapsed().as_secs_f64(),
        results.len()
    );
    env.cleanup().await;
}

/// a2. The same failure with the default lease timings (lease 15 s, renew deadline 10 s, renew
/// every 3 s, member TTL 10 s): the failover (~3 s) ends before any renew deadline, so renewals
/// resume on the new primary, which has the leases (replicated before the kill), and nothing
/// moves: every partition keeps its holder and epoch, nothing is lost or duplicated, and
/// `prefix-batcher status` (through the sentinels) names the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private Redis Sentinel set and kills its primary; ~40 s"]
async fn a2_primary_failure_within_the_renew_deadline() {
    const P: u32 = 12;
    const N: usize = 1_500;
    let env = TestEnv::new("sentinel-keep");
    let set = SentinelSet::start(&env);
    let fake = FakeLlm::new().latency(Duration::from_millis(30)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.partitions = P;
    raw.ownership = RawOwnership::default();
    set.configure(&mut raw);
    let prefix = env.key_prefix().to_owned();
    let mut probe = set.probe().await;
    let (mut cluster, ..) = Cluster::start_settled(&env, raw, &["a", "b", "c"], &mut probe).await;

    let Load { log, reqs, publisher, .. } = Load::start(&env, "keep", N, 40, 150);
    publisher.wait_published(400, DEADLINE).await;
    let at_kill = probe.leases(&prefix, P).await;
    assert!(at_kill.iter().all(Option::is_some), "every partition leased before the kill: {at_kill:?}");
    let old_primary = set.primary().await;
    let t_kill = Instant::now();
    send_signal(set.pid_of(&old_primary), "KILL");
    let new_primary = set.wait_new_primary(&old_primary, Duration::from_secs(30)).await;
    let promoted = t_kill.elapsed();
    // Renewals resume: every lease's remaining TTL is back near the full 15 s.
    let mut probe = set.probe().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let renewed = loop {
        let mut pipe = redis::pipe();
        for p in 0..P {
            pipe.cmd("PTTL").arg(Leases::lease_key(&prefix, p));
        }
        let pttls: Vec<i64> = pipe.query_async(&mut probe.conn).await.unwrap();
        if pttls.iter().all(|t| *t > 12_000) {
            break t_kill.elapsed();
        }
        assert!(Instant::now() < deadline, "leases not renewed on the new primary: PTTLs {pttls:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    wait_all_done(publisher, &log, &reqs).await;
    let after = probe.leases(&prefix, P).await;
    cluster.assert_running(&["a", "b", "c"]);
    let status = cluster.status(false).await;
    assert!(status.contains(&format!("Redis primary: {new_primary}")), "status must show the new primary:\n{status}");
    let results = log.stop_after(&mut cluster).await;
    assert_eq!(after, at_kill, "no lease may move or change its epoch");
    let t = tally(&reqs, &results);
    assert!(t.lost.is_empty(), "{} requests lost", t.lost.len());
    assert_eq!(t.failed, 0, "failed results");
    assert_eq!(t.duplicates(), 0, "duplicates although no partition moved");
    assert!(epoch_decreases(&results).is_empty());
    println!(
        "sentinel kill, default timings: primary {old_primary} -> {new_primary} promoted {} after the SIGKILL; every lease renewed on it {} after the kill; no lease moved; {N} requests, lost 0, duplicates 0",
        secs(promoted),
        secs(renewed)
    );
    env.cleanup().await;
}

/// Results whose `x-partition-epoch` is lower than an earlier result of the same partition, in
/// arrival order: `(partition, earlier epoch, later epoch, request id)`.
fn epoch_decreases(results: &[Observed]) -> Vec<(u32, u64, u64, String)> {
    let mut sorted: Vec<&Observed> = results.iter().collect();
    sorted.sort_by_key(|o| o.seq);
    let mut last: BTreeMap<u32, u64> = BTreeMap::new();
    let mut out = Vec::new();
    for o in sorted {
        let prev = last.entry(o.partition).or_insert(o.epoch);
        if o.epoch < *prev {
            out.push((o.partition, *prev, o.epoch, o.id.clone()));
        } else {
            *prev = o.epoch;
        }
    }
    out
}

/// For each partition of `old`, when (after `since`) its first result of a newer epoch arrived.
fn first_results_after(results: &[Observed], old: &BTreeMap<u32, u64>, since: Instant) -> BTreeMap<u32, Duration> {
    let mut out = BTreeMap::new();
    for o in results {
        if old.get(&o.partition).is_some_and(|e| o.epoch > *e) && o.at >= since {
            out.entry(o.partition).or_insert(o.at - since);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// b. Replica lag.
// ---------------------------------------------------------------------------------------------

/// b. Epochs advance on the primary while the replica is cut off from it (`REPLICAOF` a closed
/// port: it keeps its data but receives nothing), then `SENTINEL FAILOVER` promotes that replica;
/// the old primary becomes its replica and drops the unreplicated writes. The lease client (one
/// [`lease::RedisConn`] through the sentinels) follows the new primary, and every partition's next
/// epoch exceeds every epoch issued before, although the new primary's counters are behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private Redis Sentinel set and fails it over; ~20 s"]
async fn b_replica_lag_then_failover() {
    const P: u32 = 8;
    let env = TestEnv::new("sentinel-lag");
    let set = SentinelSet::start(&env);
    let mut raw = env.raw_config("http://127.0.0.1:1");
    set.configure(&mut raw);
    let settings = Settings::from_raw(&raw).unwrap();
    let conn = lease::connect(&settings.redis).await.unwrap();
    let old_primary = conn.primary();
    assert_eq!(old_primary, set.primary().await);
    let leases = Leases::new(conn.clone(), env.key_prefix(), "t:n1".into(), Duration::from_secs(3), Duration::from_secs(2));
    let mut issued: BTreeMap<u32, u64> = BTreeMap::new();
    // Acquire and release every partition in turn, ~1 acquisition per partition per 10 ms.
    let churn = |rounds: usize| {
        let leases = leases.clone();
        async move {
            let mut max: BTreeMap<u32, u64> = BTreeMap::new();
            for _ in 0..rounds {
                for p in 0..P {
                    let Acquire::Acquired(e) = leases.acquire(p).await.unwrap() else { panic!("partition {p} busy") };
                    let prev = max.insert(p, e);
                    assert!(prev.is_none_or(|x| e > x), "epochs of partition {p} must increase: {prev:?} then {e}");
                    assert!(leases.release(p, e).await.unwrap());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            max
        }
    };
    issued.extend(churn(20).await);

    // Cut the replica off: it keeps its data and its role, and receives nothing more.
    let replica = set.other_node(&old_primary);
    let mut r = node(&replica).await.unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _: () = redis::cmd("REPLICAOF").arg("127.0.0.1").arg(closed).query_async(&mut r).await.unwrap();
    issued.extend(churn(20).await);
    let mut behind = 0;
    for (p, e) in &issued {
        let on_replica: Option<u64> = redis::cmd("GET").arg(Leases::epoch_key(env.key_prefix(), *p)).query_async(&mut r).await.unwrap();
        behind += usize::from(on_replica.is_none_or(|x| x < *e));
    }
    assert_eq!(behind, P as usize, "the replica must lack the last epochs of every partition");
    // Point it back at the primary only through the failover: promote it now.
    let mut s = node(&set.sentinels[0]).await.unwrap();
    let t_failover = Instant::now();
    let _: () = redis::cmd("SENTINEL").arg("FAILOVER").arg(&set.master).query_async(&mut s).await.unwrap();
    let new_primary = set.wait_new_primary(&old_primary, Duration::from_secs(30)).await;
    assert_eq!(new_primary, replica);

    // The lease client follows (READONLY or a killed connection makes it ask the sentinels).
    let deadline = Instant::now() + Duration::from_secs(30);
    let (p0_epoch, followed) = loop {
        let via = conn.primary();
        match leases.acquire(0).await {
            Ok(Acquire::Acquired(e)) if via == new_primary && conn.primary() == new_primary => break (e, t_failover.elapsed()),
            Ok(Acquire::Acquired(e)) => {
                // Still the old primary, before the sentinels demoted it: an epoch that the
                // failover will lose, issued all the same.
                let x = issued.entry(0).or_insert(e);
                *x = (*x).max(e);
                let _ = leases.release(0, e).await;
            }
            Ok(Acquire::Busy(v)) => panic!("partition 0 busy: {v}"),
            Err(_) => {}
        }
        assert!(Instant::now() < deadline, "the lease client did not follow the failover to {new_primary}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut after: BTreeMap<u32, u64> = BTreeMap::from([(0, p0_epoch)]);
    for p in 1..P {
        let Acquire::Acquired(e) = leases.acquire(p).await.unwrap() else { panic!("partition {p} busy after the failover") };
        after.insert(p, e);
    }
    for p in 0..P {
        assert!(after[&p] > issued[&p], "partition {p}: epoch {} after the failover, but {} was issued before it", after[&p], issued[&p]);
    }
    let margin = (0..P).map(|p| after[&p] - issued[&p]).min().unwrap();
    println!(
        "replica lag: {P} partitions, the promoted replica lacked the last epochs of all {behind}; the lease client reached the new primary {} after SENTINEL FAILOVER; every next epoch exceeded the last one issued (smallest margin {margin} ms)",
        secs(followed)
    );
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// c. Redis commands per instance.
// ---------------------------------------------------------------------------------------------

/// Total `calls` per command of `INFO commandstats` on the node at `addr`.
async fn commandstats(addr: &str) -> BTreeMap<String, u64> {
    let mut c = node(addr).await.unwrap();
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut c).await.unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?.parse().ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// Commands per second over `window` on `addr`, per command, without the probe's own `info`.
async fn rate_over(addr: &str, window: Duration) -> (f64, BTreeMap<String, f64>) {
    let a = commandstats(addr).await;
    tokio::time::sleep(window).await;
    let b = commandstats(addr).await;
    let per: BTreeMap<String, f64> = b
        .iter()
        .filter(|(k, _)| k.as_str() != "info")
        .map(|(k, v)| (k.clone(), (v - a.get(k).copied().unwrap_or(0)) as f64 / window.as_secs_f64()))
        .filter(|(_, r)| *r > 0.0)
        .collect();
    (per.values().sum(), per)
}

/// Redis commands per second of one daemon with the default timings (lease 15 s, renew every
/// 3 s, …) and 16 partitions, over 30 s idle and 30 s under 100 requests/s, read from the
/// primary's `INFO commandstats` (scripts run as `evalsha`, their inner calls are counted under
/// their own names as well). Prints the numbers for docs/operations.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: one daemon for ~80 s against a private Redis Sentinel set"]
async fn c_redis_commands_per_instance() {
    const P: u32 = 16;
    let window = Duration::from_secs(30);
    let env = TestEnv::new("sentinel-rate");
    let set = SentinelSet::start(&env);
    let fake = FakeLlm::new().latency(Duration::from_millis(30)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.partitions = P;
    raw.ownership = RawOwnership::default();
    set.configure(&mut raw);
    let primary = set.primary().await;
    let mut probe = set.probe().await;
    let (mut cluster, ..) = Cluster::start_settled(&env, raw, &["a"], &mut probe).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (idle, idle_per) = rate_over(&primary, window).await;
    let Load { log, reqs, publisher, .. } = Load::start(&env, "rate", 4_000, 40, 100);
    publisher.wait_published(200, DEADLINE).await;
    let (busy, busy_per) = rate_over(&primary, window).await;
    wait_all_done(publisher, &log, &reqs).await;
    let _ = log.stop_after(&mut cluster).await;
    let fmt = |m: &BTreeMap<String, f64>| m.iter().map(|(k, v)| format!("{k} {v:.2}")).collect::<Vec<_>>().join(", ");
    println!("redis commands/s, one instance, {P} partitions, default timings: idle {idle:.2} ({}); under 100 req/s {busy:.2} ({})", fmt(&idle_per), fmt(&busy_per));
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// d. The cost of the epoch rule.
// ---------------------------------------------------------------------------------------------

/// The acquire script before the `max(INCR, TIME)` rule: `TIME` only when the counter is missing.
const ACQUIRE_INCR_ONLY: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur then
  local mine = ARGV[1] .. ':'
  if string.sub(cur, 1, string.len(mine)) ~= mine then
    return {0, cur}
  end
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  local t = redis.call('TIME')
  redis.call('SET', KEYS[2], string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
end
local e = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. e, 'PX', ARGV[2])
return {e, ''}
"#;

/// `(mean, p50, p99)` in µs.
fn latency_summary(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = v.iter().map(|d| us(*d)).sum::<f64>() / v.len() as f64;
    (mean, us(v[v.len() / 2]), us(v[v.len() * 99 / 100]))
}

/// Server-side `usec_per_call` of `evalsha` on `addr` (after a `CONFIG RESETSTAT`).
async fn evalsha_usec(addr: &str) -> f64 {
    let mut c = node(addr).await.unwrap();
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut c).await.unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:")?.split(',').find_map(|kv| kv.strip_prefix("usec_per_call=")?.parse().ok()))
        .unwrap_or(f64::NAN)
}

/// The acquire latency (client-side, sequential, one connection) and the primary's CPU time per
/// script call of three ways to make epochs survive a failover, 3,000 acquisitions each (after
/// 300 warm-up ones) on a primary with one replica: the counter alone (`INCR`, the old rule,
/// which a failover can roll back), `max(INCR, TIME)` (this daemon's rule), and `INCR` followed by
/// `WAIT 1 100` (wait until the replica has the write, up to 100 ms). Prints the numbers for the
/// docs of [`prefix_batcher::lease`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: a private Redis Sentinel set; ~15 s"]
async fn d_epoch_rule_cost() {
    const N: usize = 3_000;
    let env = TestEnv::new("sentinel-cost");
    let set = SentinelSet::start(&env);
    let primary = set.primary().await;
    let conn = redis::Client::open(format!("redis://{primary}/")).unwrap().get_connection_manager().await.unwrap();
    let (ttl, t) = (Duration::from_secs(3), Duration::from_secs(2));
    let leases = Leases::new(conn.clone(), env.key_prefix(), "a:n1".into(), ttl, t);
    let old = redis::Script::new(ACQUIRE_INCR_ONLY);
    let mut c = conn.clone();
    let mut rows = Vec::new();
    for variant in ["INCR only", "max(INCR, TIME)", "INCR + WAIT 1 100"] {
        let mut lat = Vec::with_capacity(N);
        let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut c).await.unwrap();
        for i in 0..N + 300 {
            let p = (i % 8) as u32;
            let start = std::time::Instant::now();
            if variant == "max(INCR, TIME)" {
                let Acquire::Acquired(_) = leases.acquire(p).await.unwrap() else { panic!() };
            } else {
                let (e, _): (u64, String) = old
                    .key(Leases::lease_key(env.key_prefix(), p))
                    .key(Leases::epoch_key(env.key_prefix(), p))
                    .arg("a:n1")
                    .arg(3_000)
                    .invoke_async(&mut c)
                    .await
                    .unwrap();
                assert!(e > 0);
                if variant.contains("WAIT") {
                    let acked: i64 = redis::cmd("WAIT").arg(1).arg(100).query_async(&mut c).await.unwrap();
                    assert_eq!(acked, 1, "the replica acknowledges");
                }
            }
            if i >= 300 {
                lat.push(start.elapsed());
            }
        }
        let (mean, p50, p99) = latency_summary(lat);
        let cpu = evalsha_usec(&primary).await;
        rows.push(format!("{variant:<18} acquire mean {mean:6.0} µs, p50 {p50:6.0} µs, p99 {p99:6.0} µs; primary CPU {cpu:.2} µs per script call"));
    }
    println!("epoch rule cost ({N} sequential acquisitions each, primary with one replica, debug build client):\n  {}", rows.join("\n  "));
    drop(set);
    env.cleanup().await;
}
