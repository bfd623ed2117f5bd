//! Horizontal scale: several real daemon processes of the built binary against real RabbitMQ and
//! Redis, with an in-process fake LLM that adds latency so work is in flight when instances join,
//! leave, crash or stall (issue 3, DESIGN.md §4).
//!
//! - a. [`a_three_instances_balance_and_status`]: balance, one consumer per partition, `status`,
//!   graceful restart (SIGTERM handoff time, stickiness).
//! - b. [`b_churn_under_load`]: ≥ 5,000 requests while a 4th instance joins, one is SIGTERMed,
//!   one is `kill -9`ed and restarted: nothing lost, duplicates only from the kill, no two
//!   instances processing one partition at overlapping times (ownership log from the results).
//! - c. [`c_redis_outage`] and d. [`d_rabbitmq_restart`]: DISRUPTIVE — they stop Redis for 20 s
//!   and restart RabbitMQ, which breaks every other test or daemon on the machine. They are
//!   `#[ignore]`d and also refuse to run unless `PREFIX_BATCHER_DISRUPTIVE_TESTS=1`:
//!
//!   ```text
//!   PREFIX_BATCHER_DISRUPTIVE_TESTS=1 cargo test --test scale -- --ignored --test-threads=1
//!   ```
//!
//!   (run alone: nothing else may use the local RabbitMQ/Redis meanwhile).
//! - e. [`e_stale_owner_after_sigstop`]: an instance paused longer than its lease TTL stops
//!   before publishing or acking anything on wake-up; stale publications are counted and must be
//!   detectable by their older `x-partition-epoch`.
//! - f. [`f_frozen_owner_is_cut_off_by_the_heartbeat`]: an instance paused longer than its
//!   lease TTL and two AMQP heartbeat intervals loses its partition queues to another instance
//!   while still paused (the broker closes its silent connections).
//! - g. [`g_an_instance_whose_llm_is_down_hands_its_partitions_over`]: an instance whose every
//!   LLM endpoint stays down hands its partitions to the instance whose server answers, and takes
//!   them back when its server is back.
//! - [`lease_protocol_against_redis`]: the Lua scripts (epochs, compare-and-set, data loss).
//!
//! The tests of this file run one at a time (a process-wide lock): they measure handoff times,
//! and four daemons each on two shared cores are enough load already.
//!
//! Lease timings are the test defaults of `TestEnv::raw_config`: lease TTL 3 s, renew deadline
//! 2 s, renew every 500 ms, member TTL 2 s, settle 200 ms.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use common::cluster::*;
use common::*;
use prefix_batcher::config::RawConfig;
use llm_fakes::fake::FakeLlm;
use prefix_batcher::lease::{Acquire, LeaseValue, Leases};
use prefix_batcher::request::RequestResult;
use tokio::time::Instant;

/// Lease TTL of the test configuration (`TestEnv::raw_config`).
const LEASE_TTL: Duration = Duration::from_secs(3);
/// How long after the test takes a timestamp its SIGSTOP or SIGCONT may take effect.
const SIGNAL_SLACK: Duration = Duration::from_millis(50);
/// Renew deadline of the test configuration.
const RENEW_DEADLINE: Duration = Duration::from_secs(2);
/// Environment variable that allows the disruptive tests (c, d) to run.
const DISRUPTIVE_ENV: &str = "PREFIX_BATCHER_DISRUPTIVE_TESTS";

/// One scale test at a time (an async lock: each test has its own runtime, and a failed test
/// does not poison it).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The test configuration with `partitions` partitions.
fn scale_config(env: &TestEnv, llm_url: &str, partitions: u32) -> RawConfig {
    let mut raw = env.raw_config(llm_url);
    raw.amqp.partitions = partitions;
    raw
}

fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

/// For each partition in `parts`, when (after `since`) its first result from an epoch above
/// `old_epoch[p]` arrived.
fn first_results_after(results: &[Observed], parts: &BTreeMap<u32, u64>, since: Instant) -> BTreeMap<u32, Duration> {
    let mut out = BTreeMap::new();
    for o in results {
        if let Some(old) = parts.get(&o.partition) {
            if o.epoch > *old && o.at >= since {
                out.entry(o.partition).or_insert(o.at - since);
            }
        }
    }
    out
}

/// Checks the ownership log: every epoch published by one instance, no overlaps. Returns it.
fn check_ownership_log(results: &[Observed], t0: Instant, print: bool) -> Vec<Tenure> {
    let log = ownership_log(results);
    if print {
        println!("ownership log ({} tenures):\n{}", log.len(), render_ownership_log(&log, t0));
    }
    for t in &log {
        assert_eq!(t.instances.len(), 1, "partition {} epoch {} was published by several instances: {:?}", t.partition, t.epoch, t.instances);
    }
    let overlaps = ownership_overlaps(&log);
    assert!(
        overlaps.is_empty(),
        "{} ownership overlaps (two epochs of one partition processing at once):\n{}",
        overlaps.len(),
        overlaps.iter().map(|(a, b)| format!("{a:?}\n  vs {b:?}")).collect::<Vec<_>>().join("\n")
    );
    log
}

// ---------------------------------------------------------------------------------------------
// a. Balance.
// ---------------------------------------------------------------------------------------------

/// a. Three instances: every partition is owned by exactly one instance — its desired owner —
/// each owns P/3 ± 2 (24 partitions: 8 each, the assignment bounds loads), every partition queue
/// has exactly one consumer, and `status` (table and `--json`) shows members, owner and epoch per
/// partition, backlog and no unowned partition. Then one instance is restarted gracefully: its
/// partitions are handed over within 2 s of the SIGTERM, and it gets exactly the same ones back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_instances_balance_and_status() {
    let _serial = SERIAL.lock().await;
    const P: u32 = 24;
    let env = TestEnv::new("bal");
    let fake = FakeLlm::new().latency(Duration::from_millis(30)).start().await.unwrap();
    let raw = scale_config(&env, fake.url.as_str(), P);
    let prefix = env.key_prefix().to_owned();
    let mut redis = RedisProbe::connect().await.unwrap();
    let (mut cluster, leases, took) = Cluster::start_settled(&env, raw, &["a", "b", "c"], &mut redis).await;
    let owners = held_by(&leases);
    println!("3 instances settled in {}: {:?}", secs(took), owners.iter().map(|(n, ps)| (n, ps.len())).collect::<Vec<_>>());
    assert_eq!(owners.len(), 3, "three owners: {owners:?}");
    for (name, ps) in &owners {
        let n = ps.len() as i64;
        assert!((n - i64::from(P / 3)).abs() <= 2, "{name} owns {n} partitions, want {} ± 2", P / 3);
    }
    let amqp = Amqp::connect().await;
    for p in 0..P {
        amqp.wait_consumers(&env.partition_queue(p), 1, Duration::from_secs(10)).await;
    }

    // Some traffic, so the backlog column has something to show, then `status`.
    let reqs = completions_workload("bal", 300, 24);
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    let table = cluster.status(false).await;
    println!("prefix-batcher status (3 instances, under load):\n{table}");
    results.until_all(&ids(&reqs), DEADLINE).await;
    let table = cluster.status(false).await;
    println!("prefix-batcher status (3 instances, idle):\n{table}");
    for s in ["a", "b", "c"] {
        assert!(table.contains(&cluster.name(s)), "status must list member {s}:\n{table}");
    }
    assert!(table.contains("unowned 0"), "status must report no unowned partition:\n{table}");
    let json: serde_json::Value = serde_json::from_str(&cluster.status(true).await).expect("status --json is JSON");
    assert_eq!(json["members"].as_array().unwrap().len(), 3);
    assert!(json["unowned"].as_array().unwrap().is_empty());
    let leases_now = redis.leases(&prefix, P).await;
    for (p, part) in json["partitions"].as_array().unwrap().iter().enumerate() {
        let l = leases_now[p].as_ref().expect("owned");
        assert_eq!(part["owner"].as_str(), Some(l.name.as_str()), "status owner of partition {p}");
        assert_eq!(part["epoch"].as_u64(), Some(l.epoch), "status epoch of partition {p}");
        assert_eq!(part["desired_owner"], part["owner"], "partition {p} is not on its desired owner");
        assert_eq!(part["backlog"].as_u64(), Some(0), "partition {p} backlog after all results");
        assert_eq!(part["consumers"].as_u64(), Some(1));
    }

    // Graceful restart of b: SIGTERM hands its partitions over (released, not expired), then the
    // restarted b (same name) gets exactly the same partitions back.
    let b = cluster.name("b");
    let b_parts = owners[&b].clone();
    let t_term = Instant::now();
    cluster.sigterm("b");
    let (_, at) = poll_leases(&mut redis, &prefix, P, "b's partitions to move", DEADLINE, Duration::from_millis(10), |ls| {
        b_parts.iter().all(|p| ls[*p as usize].as_ref().is_some_and(|l| l.name != b))
    })
    .await;
    let handoff = at - t_term;
    assert_eq!(cluster.wait_exit("b", DEADLINE).await.code(), Some(0), "SIGTERM must exit 0");
    println!("SIGTERM handoff (idle, {} partitions): {}", b_parts.len(), secs(handoff));
    assert!(handoff < Duration::from_secs(2), "SIGTERM handoff took {handoff:?}, want < 2 s");

    cluster.start(&env, "b");
    let (leases, took) = cluster.wait_settled(&mut redis, &prefix, P, DEADLINE).await;
    assert_eq!(held_by(&leases)[&b], b_parts, "the restarted b must get its partitions back");
    println!("restarted b got its {} partitions back in {}", b_parts.len(), secs(took));

    cluster.stop_all(DEADLINE).await;
    assert!(redis.keys(&format!("{prefix}:lease:*")).await.is_empty(), "leases left after a graceful stop");
    assert!(redis.keys(&format!("{prefix}:member:*")).await.is_empty(), "members left after a graceful stop");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// b. Churn.
// ---------------------------------------------------------------------------------------------

/// b. Churn under load: 5,000 requests at ~110/s; a 4th instance joins, one instance gets
/// SIGTERM, one gets `kill -9` and is restarted under the same name. At the end every request
/// has a result; duplicates come only from the kill (their later copy arrived after it, and
/// there are at most as many as the killed instance could hold unacked); the ownership log
/// (partition, epoch, instance, first/last result) has no overlap; SIGTERM handoff < 2 s,
/// kill -9 takeover < lease TTL + 3 s; the restarted instance gets its partitions back.
///
/// Longer than 80 lines on purpose: one scenario read top to bottom (setup, load, the event,
/// the assertions in the order they happen); split into helpers it would hide its timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b_churn_under_load() {
    let _serial = SERIAL.lock().await;
    const P: u32 = 24;
    const N: usize = 5_000;
    let env = TestEnv::new("churn");
    let fake = FakeLlm::new().latency(Duration::from_millis(30)).start().await.unwrap();
    let raw = scale_config(&env, fake.url.as_str(), P);
    let (input_prefetch, partition_prefetch) = (raw.amqp.input_prefetch as usize, raw.amqp.partition_prefetch as usize);
    let prefix = env.key_prefix().to_owned();
    let mut redis = RedisProbe::connect().await.unwrap();
    let (mut cluster, ..) = Cluster::start_settled(&env, raw, &["a", "b", "c"], &mut redis).await;

    let Load { t0, log, reqs, publisher } = Load::start(&env, "churn", N, 40, 110);

    // 1. A 4th instance joins.
    publisher.wait_published(800, DEADLINE).await;
    cluster.start(&env, "d");
    let (_, join_settle) = cluster.wait_settled(&mut redis, &prefix, P, DEADLINE).await;
    println!("d joined: leases settled on 4 instances in {}", secs(join_settle));

    // 2. SIGTERM b.
    publisher.wait_published(1_800, DEADLINE).await;
    let b = cluster.name("b");
    let leases = redis.leases(&prefix, P).await;
    let b_parts = epochs_held_by(&leases, &b);
    assert!(!b_parts.is_empty());
    let t_term = Instant::now();
    cluster.sigterm("b");
    let (_, at) = poll_leases(&mut redis, &prefix, P, "b's partitions to get a new owner", DEADLINE, Duration::from_millis(10), |ls| {
        b_parts.keys().all(|p| ls[*p as usize].as_ref().is_some_and(|l| l.name != b))
    })
    .await;
    let term_takeover = at - t_term;
    let st = cluster.wait_exit("b", DEADLINE).await;
    assert_eq!(st.code(), Some(0), "SIGTERM must exit 0; log:\n{}", cluster.proc("b").log_tail(30));
    let b_exit = t_term.elapsed();
    cluster.wait_settled(&mut redis, &prefix, P, DEADLINE).await;

    // 3. kill -9 c, then restart it under the same name.
    publisher.wait_published(3_000, DEADLINE).await;
    let c = cluster.name("c");
    let leases = redis.leases(&prefix, P).await;
    let c_leases: BTreeMap<u32, LeaseValue> =
        leases.iter().enumerate().filter_map(|(p, l)| l.clone().filter(|l| l.name == c).map(|l| (p as u32, l))).collect();
    let c_parts: BTreeSet<u32> = c_leases.keys().copied().collect();
    let c_epochs: BTreeMap<u32, u64> = c_leases.iter().map(|(p, l)| (*p, l.epoch)).collect();
    let members_at_kill = cluster.running_names();
    let t_kill = Instant::now();
    cluster.kill9("c");
    let done_at_kill = log.distinct().len();
    let (_, at) = poll_leases(&mut redis, &prefix, P, "c's partitions to be taken over", DEADLINE, Duration::from_millis(10), |ls| {
        c_leases.iter().all(|(p, old)| ls[*p as usize].as_ref().is_some_and(|l| l.nonce != old.nonce))
    })
    .await;
    let kill_takeover = at - t_kill;
    cluster.start(&env, "c");
    let (leases, sticky_in) = cluster.wait_settled(&mut redis, &prefix, P, DEADLINE).await;
    assert_eq!(cluster.running_names(), members_at_kill);
    assert_eq!(held_by(&leases).get(&c), Some(&c_parts), "the restarted c must get exactly its partitions back");

    // 4. Everything gets a result; then stop everything gracefully.
    wait_all_done(publisher, &log, &reqs).await;
    let drained_at = t0.elapsed();
    cluster.assert_running(&["a", "c", "d"]);
    let results = log.stop_after(&mut cluster).await;

    // Accounting.
    let t = tally(&reqs, &results);
    assert!(t.lost.is_empty(), "{} requests lost: {:?}", t.lost.len(), &t.lost[..t.lost.len().min(10)]);
    assert_eq!(t.failed, 0, "failed results");
    let mut partition_stage = 0;
    for (id, copies) in &t.duplicated {
        for later in &copies[1..] {
            assert!(later.at > t_kill, "request {id} was duplicated before the kill: {copies:?}");
        }
        let first = &copies[0];
        if first.instance == c && c_epochs.get(&first.partition) == Some(&first.epoch) {
            partition_stage += 1;
        }
        // Every copy is distinguishable by its (partition, epoch) or batch.
        let keys: HashSet<(u32, u64, &str)> = copies.iter().map(|o| (o.partition, o.epoch, o.batch_id.as_str())).collect();
        assert_eq!(keys.len(), copies.len(), "request {id}: identical copies {copies:?}");
    }
    let bound = input_prefetch + partition_prefetch * c_parts.len();
    assert!(t.duplicates() <= bound, "{} duplicates, more than the killed instance could hold unacked ({bound})", t.duplicates());

    // The ownership log: no overlaps, one instance per epoch.
    let own = check_ownership_log(&results, t0, std::env::var_os("SCALE_PRINT_LOG").is_some());
    let moved = own.iter().map(|t| t.partition).collect::<Vec<_>>().windows(2).filter(|w| w[0] == w[1]).count();

    let term_first = first_results_after(&results, &b_parts, t_term);
    let kill_first = first_results_after(&results, &c_epochs, t_kill);
    let max = |m: &BTreeMap<u32, Duration>| m.values().max().copied();
    println!("churn: {N} requests, {} results, {} distinct, lost {}, duplicates {} ({} from the killed partitions' unacked results, {} from its router), all done {:.1}s after the start",
        t.results, t.requests - t.lost.len(), t.lost.len(), t.duplicates(), partition_stage, t.duplicated.len() - partition_stage, drained_at.as_secs_f64());
    println!("churn: 4th instance settled in {}", secs(join_settle));
    println!(
        "churn: SIGTERM of b ({} partitions): leases taken over in {} (max), first successor result after {} (max over {} partitions), b exited after {}",
        b_parts.len(),
        secs(term_takeover),
        max(&term_first).map_or("-".into(), secs),
        term_first.len(),
        secs(b_exit)
    );
    println!(
        "churn: kill -9 of c ({} partitions, {} requests done at the kill): leases taken over in {} (max), first successor result after {} (max over {} partitions); restarted c got its partitions back {} after its restart",
        c_parts.len(),
        done_at_kill,
        secs(kill_takeover),
        max(&kill_first).map_or("-".into(), secs),
        kill_first.len(),
        secs(sticky_in)
    );
    println!("churn: ownership log: {} tenures, {} handovers, 0 overlaps", own.len(), moved);
    assert!(term_takeover < Duration::from_secs(2), "SIGTERM handoff took {term_takeover:?}, want < 2 s");
    assert!(kill_takeover < LEASE_TTL + Duration::from_secs(3), "kill -9 takeover took {kill_takeover:?}, want < lease TTL + 3 s");
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// e. Stale owner.
// ---------------------------------------------------------------------------------------------

/// e. Stale owner: instance a is paused (SIGSTOP) for lease TTL + 2 s while it has LLM calls in
/// flight (the fake LLM answers after 400 ms). Meanwhile b acquires a's leases and attaches to
/// a's partition queues as a single-active-consumer standby (a's consumers are still the active
/// ones: its connection is alive). After SIGCONT, a finds its lease deadline passed and stops
/// before publishing or acking anything for those partitions; b takes over; a gets its partitions
/// back once it rejoins. Any stale publication (a result of a's old epoch that arrived after the
/// SIGCONT) is counted and must be detectable: a newer epoch of the same partition published the
/// same request. Nothing is lost.
///
/// Longer than 80 lines on purpose: one scenario read top to bottom (setup, load, the event,
/// the assertions in the order they happen); split into helpers it would hide its timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_stale_owner_after_sigstop() {
    let _serial = SERIAL.lock().await;
    const P: u32 = 16;
    const N: usize = 1_000;
    let env = TestEnv::new("stale");
    let latency = Duration::from_millis(400);
    let fake = FakeLlm::new().latency(latency).start().await.unwrap();
    let mut raw = scale_config(&env, fake.url.as_str(), P);
    // Slow calls need many in flight: ~20 batches/s per instance × 0.4 s.
    raw.llm.max_concurrency = 64;
    let prefix = env.key_prefix().to_owned();
    let mut redis = RedisProbe::connect().await.unwrap();
    let amqp = Amqp::connect().await;
    let (mut cluster, ..) = Cluster::start_settled(&env, raw, &["a", "b"], &mut redis).await;
    let Load { t0, log, reqs, publisher } = Load::start(&env, "stale", N, 32, 40);
    log.wait_len(120, DEADLINE).await;

    let a = cluster.name("a");
    let b = cluster.name("b");
    let leases = redis.leases(&prefix, P).await;
    let a_epochs = epochs_held_by(&leases, &a);
    let t_stop = Instant::now();
    cluster.sigstop("a");
    let in_flight = fake.calls().iter().filter(|c| c.received_at + latency > t_stop).count();

    // b takes the leases after a's expire; its consumers are standbys behind a's stale ones.
    let (_, at) = poll_leases(&mut redis, &prefix, P, "b to hold a's leases", Duration::from_secs(10), Duration::from_millis(20), |ls| {
        a_epochs.keys().all(|p| ls[*p as usize].as_ref().is_some_and(|l| l.name == b))
    })
    .await;
    let lease_takeover = at - t_stop;
    // Who is the active consumer of a's partition queues now (`rabbitmqctl`, when available:
    // the AMQP queue.declare-ok count of a quorum queue does not include waiting consumers).
    let queue_prefix = env.partition_queue_prefix();
    let consumers = tokio::task::spawn_blocking(move || sac_consumers(&queue_prefix)).await.unwrap();
    let pause = LEASE_TTL + Duration::from_secs(2);
    tokio::time::sleep_until(t_stop + pause).await;
    let (during_pause, during_pause_a) = {
        let snap = log.snapshot();
        let d: Vec<&Observed> = snap.iter().filter(|o| o.at > t_stop).collect();
        (d.len(), d.iter().filter(|o| o.instance == a).count())
    };
    let t_cont = Instant::now();
    cluster.sigcont("a");
    // The broker fence: b held a's leases for seconds, yet none of its new epochs of a's
    // partitions published anything before a woke up (its consumers were standbys).
    let b_during_pause = log
        .snapshot()
        .iter()
        .filter(|o| o.at < t_cont && o.instance == b && a_epochs.get(&o.partition).is_some_and(|e| o.epoch > *e))
        .count();

    // a rejoins and gets its partitions back.
    let (leases, back_in) = cluster.wait_settled(&mut redis, &prefix, P, DEADLINE).await;
    let a_parts: BTreeSet<u32> = a_epochs.keys().copied().collect();
    assert_eq!(held_by(&leases).get(&a), Some(&a_parts), "a must get its partitions back after the stall");
    wait_all_done(publisher, &log, &reqs).await;
    cluster.assert_running(&["a", "b"]);
    let a_log = cluster.proc("a").log();
    let results = log.stop_after(&mut cluster).await;

    let t = tally(&reqs, &results);
    assert!(t.lost.is_empty(), "{} requests lost", t.lost.len());
    // Stale publications: a result of one of a's pre-pause epochs that arrived after SIGCONT.
    let stale: Vec<&Observed> =
        results.iter().filter(|o| o.at > t_cont && o.instance == a && a_epochs.get(&o.partition) == Some(&o.epoch)).collect();
    let by_id: BTreeMap<&str, Vec<&Observed>> = results.iter().fold(BTreeMap::new(), |mut m, o| {
        m.entry(o.id.as_str()).or_default().push(o);
        m
    });
    // A stale publication with no newer copy is the request's only result: its publish passed
    // the lease check before the SIGSTOP and its frames were still in the client's buffers or the
    // socket (the ack follows the confirm even when the deadline passed since:
    // `publisher::ack_published`). So its LLM call must have answered before the SIGSTOP; a result
    // whose answer came during the pause must not be published with the old epoch.
    let calls = fake.calls();
    let mut only_copies = 0;
    for s in &stale {
        let newer = by_id[s.id.as_str()].iter().any(|o| o.partition == s.partition && o.epoch > s.epoch);
        if newer {
            continue;
        }
        only_copies += 1;
        let prompt = prompt_of(&reqs, &s.id);
        let answered = calls.iter().filter(|c| c.prompts.contains(&prompt)).map(|c| c.received_at + latency).min();
        assert!(
            answered.is_some_and(|at| at <= t_stop + SIGNAL_SLACK),
            "stale result {s:?} is its request's only result, yet its LLM call answered at {:?} after the SIGSTOP: a published after its lease deadline",
            answered.map(|at| at.saturating_duration_since(t_stop))
        );
    }
    for (id, copies) in &t.duplicated {
        let keys: HashSet<(u32, u64)> = copies.iter().map(|o| (o.partition, o.epoch)).collect();
        assert_eq!(keys.len(), copies.len(), "duplicate of {id} not detectable by (partition, epoch): {copies:?}");
    }
    let log_tail = check_ownership_log_allowing(&results, &stale, t0);
    let noticed = a_log.matches("lease deadline passed").count() + a_log.matches("renew deadline passed").count() + a_log.matches("lease lost").count();
    let not_published = a_log.matches("lease deadline passed; not publishing").count();
    let (a_active, b_standby) = match &consumers {
        Some(cs) => (
            cs.iter().filter(|(q, tag, active)| *active && tag.starts_with(&format!("{a}:")) && a_queue(q, &a_epochs)).count(),
            cs.iter().filter(|(q, tag, active)| !*active && tag.starts_with(&format!("{b}:")) && a_queue(q, &a_epochs)).count(),
        ),
        None => (0, 0),
    };
    println!(
        "stale owner: a paused {} with {in_flight} LLM calls in flight (both instances); b held a's {} leases {} after SIGSTOP; during the pause {}; b published {b_during_pause} results for a's partitions before SIGCONT; a got its partitions back {} after SIGCONT",
        secs(pause),
        a_epochs.len(),
        secs(lease_takeover),
        if consumers.is_some() {
            format!("a's stopped consumers were still active on {a_active} of its queues and b's were single-active-consumer standbys on {b_standby}")
        } else {
            "rabbitmqctl was not available to list consumers".to_owned()
        },
        secs(back_in)
    );
    println!(
        "stale owner: lost {}, duplicates {}, stale publications {} ({only_copies} of them their request's only result, published before the SIGSTOP), results received during the pause {} ({} from a, in flight to the broker at the SIGSTOP), a's log: {noticed} lease-expiry lines, {not_published} results dropped unpublished; ownership log {log_tail}",
        t.lost.len(),
        t.duplicates(),
        stale.len(),
        during_pause,
        during_pause_a,
    );
    assert!(a_log.contains("partition aborted"), "a must have aborted its partitions after the pause; log:\n{a_log}");
    assert!(in_flight > 0, "no LLM call was in flight at the SIGSTOP; the test proves less than it should");
    assert_eq!(b_during_pause, 0, "b published for a's partitions while a's consumers were still the active ones");
    if consumers.is_some() {
        assert!(b_standby > 0, "b's consumers should have been single-active-consumer standbys during the pause");
    }
    assert!(lease_takeover < LEASE_TTL + Duration::from_secs(3));
    amqp.close().await;
    env.cleanup().await;
}

/// f. Frozen owner: instance a is paused (SIGSTOP) for longer than the broker waits for its
/// AMQP heartbeats (`amqp.heartbeat` = 2 s here: RabbitMQ closes a connection silent for about
/// two intervals). b takes a's leases after the lease TTL, as in e; unlike e, the broker then
/// closes a's connections, so b's single-active-consumer standbys become the active consumers
/// and serve a's partitions *while a is still frozen*. With the broker's own 60 s heartbeat a's
/// requests would wait for the SIGCONT. After it, a reconnects and gets its partitions back.
/// Nothing is lost; every duplicate is detectable by its (partition, epoch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f_frozen_owner_is_cut_off_by_the_heartbeat() {
    let _serial = SERIAL.lock().await;
    const P: u32 = 8;
    const N: usize = 600;
    /// Longest freeze: far above the lease TTL + two heartbeat intervals, far below the broker's
    /// default heartbeat (60 s, detected after up to 2 intervals).
    const FREEZE_MAX: Duration = Duration::from_secs(30);
    let env = TestEnv::new("frozen");
    let fake = FakeLlm::new().latency(Duration::from_millis(50)).start().await.unwrap();
    let mut raw = scale_config(&env, fake.url.as_str(), P);
    raw.amqp.heartbeat = "2s".into();
    let prefix = env.key_prefix().to_owned();
    let mut redis = RedisProbe::connect().await.unwrap();
    let (mut cluster, ..) = Cluster::start_settled(&env, raw, &["a", "b"], &mut redis).await;
    let Load { log, reqs, publisher, .. } = Load::start(&env, "frozen", N, 16, 40);
    log.wait_len(40, DEADLINE).await;

    let (a, b) = (cluster.name("a"), cluster.name("b"));
    let a_epochs = epochs_held_by(&redis.leases(&prefix, P).await, &a);
    assert!(!a_epochs.is_empty(), "a must own partitions before the freeze");
    let t_stop = Instant::now();
    cluster.sigstop("a");
    // b serves a's partitions under new epochs while a is frozen.
    let served = |log: &ResultLog| {
        log.snapshot().iter().filter(|o| o.at > t_stop && o.instance == b && a_epochs.get(&o.partition).is_some_and(|e| o.epoch > *e)).count()
    };
    let deadline = t_stop + FREEZE_MAX;
    while served(&log) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took_over = Instant::now() - t_stop;
    let b_during_freeze = served(&log);
    // Let b serve a while longer, then wake a.
    tokio::time::sleep(Duration::from_secs(1)).await;
    cluster.sigcont("a");
    let t_cont = Instant::now();
    println!(
        "frozen owner: b published {b_during_freeze} results for a's {} partitions {} after a's SIGSTOP (lease TTL {}, heartbeat 2s); a frozen {}",
        a_epochs.len(),
        secs(took_over),
        secs(LEASE_TTL),
        secs(t_cont - t_stop)
    );
    assert!(b_during_freeze > 0, "b never served a's partitions during a {} freeze: a's frozen consumers kept them", secs(FREEZE_MAX));

    let (leases, back_in) = cluster.wait_settled(&mut redis, &prefix, P, DEADLINE).await;
    assert!(held_by(&leases).contains_key(&a), "a must get partitions back after the freeze");
    wait_all_done(publisher, &log, &reqs).await;
    cluster.assert_running(&["a", "b"]);
    let a_log = cluster.proc("a").log();
    let results = log.stop_after(&mut cluster).await;
    let t = tally(&reqs, &results);
    println!(
        "frozen owner: a settled again {} after SIGCONT; lost {}, duplicates {}",
        secs(back_in),
        t.lost.len(),
        t.duplicates()
    );
    assert!(t.lost.is_empty(), "{} requests lost", t.lost.len());
    for (id, copies) in &t.duplicated {
        let keys: HashSet<(u32, u64)> = copies.iter().map(|o| (o.partition, o.epoch)).collect();
        assert_eq!(keys.len(), copies.len(), "duplicate of {id} not detectable by (partition, epoch): {copies:?}");
    }
    assert!(
        a_log.contains("session ended; reconnecting"),
        "a's broker session must have ended (the broker closed its silent connections):\n{a_log}"
    );
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// g. An instance whose LLM is down.
// ---------------------------------------------------------------------------------------------

/// Two instances `a` and `b`, each with its own LLM server (5 ms a call) and
/// `ownership.llm_down_hand_over_after = 2s`, started and settled over `p` partitions.
struct OwnServers {
    cluster: Cluster,
    fake_a: llm_fakes::fake::FakeLlmHandle,
    fake_b: llm_fakes::fake::FakeLlmHandle,
    redis: RedisProbe,
    /// The leases once settled.
    leases: Vec<Option<prefix_batcher::lease::LeaseValue>>,
}

async fn two_instances_with_own_servers(env: &TestEnv, p: u32) -> OwnServers {
    let fake_a = FakeLlm::new().latency(Duration::from_millis(5)).start().await.unwrap();
    let fake_b = FakeLlm::new().latency(Duration::from_millis(5)).start().await.unwrap();
    let mut raw = scale_config(env, fake_a.url.as_str(), p);
    raw.ownership.llm_down_hand_over_after = "2s".into();
    let mut raw_b = raw.clone();
    raw_b.llm.endpoints = vec![fake_b.url.as_str().trim_end_matches('/').to_owned()];
    let mut redis = RedisProbe::connect().await.unwrap();
    let mut cluster = Cluster::new(env, raw);
    cluster.start(env, "a");
    cluster.start_with(env, "b", raw_b);
    let (leases, _) = cluster.wait_settled(&mut redis, env.key_prefix(), p, DEADLINE).await;
    OwnServers { cluster, fake_a, fake_b, redis, leases }
}

/// g. Two instances, each with its own LLM server; b's server refuses every connection. Once
/// every endpoint of b has been down for `ownership.llm_down_hand_over_after` (2 s here), b flags
/// itself in the member set, hands its partitions over, and a serves every request, b's included
/// (before, b kept its partitions with their intake paused, and their requests waited for b's
/// server however long it stayed down). When b's server is back, b's probe closes its breaker,
/// the flag goes and b gets its partitions back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g_an_instance_whose_llm_is_down_hands_its_partitions_over() {
    let _serial = SERIAL.lock().await;
    const P: u32 = 8;
    let env = TestEnv::new("llmdown");
    let prefix = env.key_prefix().to_owned();
    let OwnServers { mut cluster, fake_a: _fake_a, fake_b, mut redis, leases } = two_instances_with_own_servers(&env, P).await;
    let (a, b) = (cluster.name("a"), cluster.name("b"));
    let b_parts = held_by(&leases).get(&b).cloned().unwrap_or_default();
    assert!(!b_parts.is_empty(), "b owns no partition to hand over: {leases:?}");

    // b's server goes away; requests for every partition, b's included.
    fake_b.set_refuse(true).await;
    let amqp = Amqp::connect().await;
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    let reqs = completions_workload("llmdown", 200, 40);
    let t0 = Instant::now();
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    results.until_all(&ids(&reqs), DEADLINE).await;
    let served = t0.elapsed();
    let got: Vec<(String, RequestResult, String)> =
        results.received.iter().map(|r| (r.correlation_id.clone(), r.result(), r.header("x-instance").unwrap_or("").to_owned())).collect();
    let distinct: HashSet<&String> = got.iter().map(|(id, ..)| id).collect();
    assert_eq!((got.len(), distinct.len()), (reqs.len(), reqs.len()), "one result per request, no duplicate");
    let failed: Vec<&String> = got.iter().filter(|(_, r, _)| !r.ok).map(|(id, ..)| id).collect();
    assert!(failed.is_empty(), "a server outage is not the requests' fault: {failed:?}");
    let by_b = got.iter().filter(|(.., i)| *i == b).count();
    assert_eq!(by_b, 0, "b has no server: every result comes from a");
    println!("b's server down: {} requests answered by a in {}", reqs.len(), secs(served));

    let leases = redis.leases(&prefix, P).await;
    assert_eq!(held_by(&leases).get(&a).map(|ps| ps.len()), Some(P as usize), "a holds every partition: {leases:?}");
    let table = cluster.status(false).await;
    println!("prefix-batcher status (b's server down):\n{table}");
    let b_row = table.lines().find(|l| l.contains(&b)).unwrap_or_else(|| panic!("status lists b:\n{table}"));
    assert!(b_row.contains("LLM down: its partitions go to the others"), "status flags b: {b_row}");
    // Each member's health line: b's readiness and which of its endpoints is down, a ready.
    let b_port = format!(":{}", fake_b.url.port().unwrap());
    assert!(
        b_row.contains("not ready: llm endpoints unavailable; 1 of 1 LLM endpoints down: http://127.0.0.1") && b_row.contains(&b_port),
        "status gives b's health: {b_row}"
    );
    let a_row = table.lines().find(|l| l.contains(&a) && !l.contains("owns")).unwrap_or_else(|| panic!("status lists a:\n{table}"));
    assert!(a_row.trim_end().ends_with("  ready"), "status gives a's health: {a_row}");
    assert!(a_row.contains(&format!(" {} ", prefix_batcher::VERSION)), "status gives a's version: {a_row}");
    assert!(cluster.proc("b").log().contains("every LLM endpoint of this instance has been down"), "b logs why it hands over");

    // b's server is back: the flag goes and b gets its partitions back.
    fake_b.set_refuse(false).await;
    let t_back = Instant::now();
    let (leases, _) = cluster.wait_settled(&mut redis, &prefix, P, DEADLINE).await;
    println!("b's server back: b holds its {} partitions again after {}", held_by(&leases)[&b].len(), secs(t_back.elapsed()));
    assert!(cluster.proc("b").log().contains("answers again"), "b logs that it takes its partitions back");
    let more = completions_workload("llmback", 100, 40);
    amqp.publish_requests(&env.input_queue(), &more, &reply).await;
    results.until_all(&ids(&more), DEADLINE).await;
    let by_b = results.received.iter().filter(|r| r.correlation_id.starts_with("llmback") && r.header("x-instance") == Some(b.as_str())).count();
    assert!(by_b > 0, "b serves its partitions again");

    cluster.stop_all(DEADLINE).await;
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// g2. Every server down: both instances' servers refuse every connection (b's 1.5 s after a's)
/// and requests reach every partition, so both instances' breakers open. The first instance
/// flagged LLM-down must keep its partitions: the other's LLM is down too, only not flagged yet.
/// Then b's server comes back (b takes a's partitions) and fails again: b keeps them all. Observed before:
/// the first flagged handed its partitions to the other, whose flag came a heartbeat later, and
/// took them back at once (a useless move: held requests returned, rebalances counted). Every
/// lease keeps its epoch through the outage, and every request is answered once the servers
/// are back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_when_every_server_is_down_no_partition_moves() {
    let _serial = SERIAL.lock().await;
    const P: u32 = 8;
    let env = TestEnv::new("alldown");
    let prefix = env.key_prefix().to_owned();
    let OwnServers { mut cluster, fake_a, fake_b, mut redis, leases: before } = two_instances_with_own_servers(&env, P).await;

    // a's server first, b's 1.5 s later (requests to every partition each time, so that the
    // breakers open): a is flagged about 1.5 s before b, while b's breaker is already open.
    let amqp = Amqp::connect().await;
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    let reqs = completions_workload("alldown", 80, 40);
    let (first, second) = reqs.split_at(40);
    fake_a.set_refuse(true).await;
    amqp.publish_requests(&env.input_queue(), first, &reply).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    fake_b.set_refuse(true).await;
    amqp.publish_requests(&env.input_queue(), second, &reply).await;
    // Both flag themselves 2 s after their breakers opened; wait well past both flags.
    let deadline = Instant::now() + DEADLINE;
    while !["a", "b"].iter().all(|i| cluster.proc(i).log().contains("every LLM endpoint of this instance has been down")) {
        assert!(Instant::now() < deadline, "both instances should have flagged their LLM down");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = redis.leases(&prefix, P).await;
    for i in ["a", "b"] {
        let log = cluster.proc(i).log();
        assert!(!log.contains("handing partition over"), "{i} handed a partition over although no member's LLM was up:\n{log}");
    }
    assert_eq!(during, before, "every lease keeps its holder and epoch while no member's LLM is up");

    // b's server back: a, still flagged, hands its partitions to b. Then b's server fails again
    // (requests to every partition, all b's now): until b is flagged again it is only
    // unavailable, and nobody's LLM is up, so b keeps every partition. Observed before: b handed
    // a's partitions back to a, whose server was down too.
    let b = cluster.name("b");
    let flagged = |log: &str| log.matches("every LLM endpoint of this instance has been down").count();
    fake_b.set_refuse(false).await;
    let deadline = Instant::now() + DEADLINE;
    let held = loop {
        let leases = redis.leases(&prefix, P).await;
        if held_by(&leases).get(&b).map(|ps| ps.len()) == Some(P as usize) {
            break leases;
        }
        assert!(Instant::now() < deadline, "b should hold every partition once its server is back: {leases:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (handed, flags) = (cluster.proc("b").log().matches("handing partition over").count(), flagged(&cluster.proc("b").log()));
    fake_b.set_refuse(true).await;
    let third = completions_workload("alldown-again", 40, 40);
    amqp.publish_requests(&env.input_queue(), &third, &reply).await;
    while flagged(&cluster.proc("b").log()) <= flags {
        assert!(Instant::now() < deadline + DEADLINE, "b should have flagged its LLM down again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let b_log = cluster.proc("b").log();
    assert_eq!(b_log.matches("handing partition over").count(), handed, "b handed a partition over while no member's LLM was up:\n{b_log}");
    assert_eq!(redis.leases(&prefix, P).await, held, "every lease stays with b while no member's LLM is up");

    fake_a.set_refuse(false).await;
    fake_b.set_refuse(false).await;
    let reqs: Vec<TestRequest> = reqs.into_iter().chain(third).collect();
    results.until_all(&ids(&reqs), DEADLINE).await;
    let distinct: HashSet<&String> = results.received.iter().map(|r| &r.correlation_id).collect();
    assert_eq!(distinct.len(), reqs.len());
    assert!(results.received.iter().all(|r| r.result().ok), "a server outage is not the requests' fault");
    cluster.stop_all(DEADLINE).await;
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// h. Redis loses the deployment's data (every key of its prefix deleted, as by `FLUSHALL` or a
/// restart without persistence) while two instances run: each one's next heartbeat finds its own
/// entry gone and waits `settle_time` before acquiring, so no partition is ever taken by the
/// instance that is not its desired owner (without the wait, the first instance to heartbeat
/// sees itself alone and takes the other's partitions for a moment). The partition count is
/// recorded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h_redis_losing_its_data_moves_no_partition() {
    let _serial = SERIAL.lock().await;
    const P: u32 = 8;
    let env = TestEnv::new("datalost");
    let fake = FakeLlm::new().start().await.unwrap();
    let mut raw = scale_config(&env, fake.url.as_str(), P);
    // Longer than two ownership rounds (a third of renew_interval each), so both instances
    // heartbeat within it.
    raw.ownership.settle_time = "1s".into();
    let prefix = env.key_prefix().to_owned();
    let mut redis = RedisProbe::connect().await.unwrap();
    let (mut cluster, leases, _) = Cluster::start_settled(&env, raw, &["a", "b"], &mut redis).await;
    let want = desired_owners(P, &cluster.running_names());
    let count_key = prefix_batcher::topology::partition_count_key(&prefix);
    assert_eq!(redis.get(&count_key).await, Some(P.to_string()));

    let keys = redis.keys(&format!("{prefix}:*")).await;
    let _: i64 = redis::cmd("DEL").arg(&keys).query_async(&mut redis.conn).await.unwrap();
    let t_lost = Instant::now();
    let mut misplaced = BTreeSet::new();
    let (back, at) = poll_leases(&mut redis, &prefix, P, "every lease back on its desired owner", DEADLINE, Duration::from_millis(10), |now| {
        for (p, l) in now.iter().enumerate() {
            if let Some(l) = l.as_ref().filter(|l| l.name != want[p]) {
                misplaced.insert((p, l.name.clone(), l.epoch));
            }
        }
        now.iter().zip(&want).all(|(l, w)| l.as_ref().is_some_and(|l| &l.name == w))
    })
    .await;
    println!("Redis data lost: leases back on their owners after {}; epochs {:?} -> {:?}", secs(at - t_lost), leases.iter().map(|l| l.as_ref().map(|l| l.epoch)).collect::<Vec<_>>(), back.iter().map(|l| l.as_ref().map(|l| l.epoch)).collect::<Vec<_>>());
    assert!(misplaced.is_empty(), "partitions taken by an instance that is not their desired owner (partition, holder, epoch): {misplaced:?}");
    for s in ["a", "b"] {
        assert!(cluster.proc(s).log().contains("Redis no longer held this instance's membership entry"), "{s} logs the loss:\n{}", cluster.proc(s).log_tail(20));
    }
    let deadline = Instant::now() + DEADLINE;
    while redis.get(&count_key).await.is_none() {
        assert!(Instant::now() < deadline, "the partition count was not recorded again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(redis.get(&count_key).await, Some(P.to_string()));

    cluster.stop_all(DEADLINE).await;
    env.cleanup().await;
}

/// `(queue, consumer tag, active)` of every consumer of the queues starting with `prefix`, from
/// `rabbitmqctl list_consumers` (`None` when rabbitmqctl is not available).
fn sac_consumers(prefix: &str) -> Option<Vec<(String, String, bool)>> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_consumers", "queue_name", "consumer_tag", "active"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let text = String::from_utf8_lossy(&out.stdout);
    Some(
        text.lines()
            .filter_map(|l| {
                let mut f = l.split('\t');
                let (q, tag, active) = (f.next()?, f.next()?, f.next()?);
                q.starts_with(prefix).then(|| (q.to_owned(), tag.to_owned(), active == "true"))
            })
            .collect(),
    )
}

/// Whether partition queue `q` (`….NNN`) is one of `parts`.
fn a_queue(q: &str, parts: &BTreeMap<u32, u64>) -> bool {
    q.rsplit('.').next().and_then(|n| n.parse::<u32>().ok()).is_some_and(|p| parts.contains_key(&p))
}

/// The prompt of request `id` of a completions workload.
fn prompt_of(reqs: &[TestRequest], id: &str) -> String {
    let r = reqs.iter().find(|r| r.id == id).unwrap_or_else(|| panic!("no request {id} in the workload"));
    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    body["prompt"].as_str().unwrap().to_owned()
}

/// The ownership log check of the stale-owner test: overlaps are allowed only where they come
/// from a counted stale publication.
fn check_ownership_log_allowing(results: &[Observed], stale: &[&Observed], _t0: Instant) -> String {
    let log = ownership_log(results);
    for t in &log {
        assert_eq!(t.instances.len(), 1, "partition {} epoch {} was published by several instances", t.partition, t.epoch);
    }
    let stale_tenures: HashSet<(u32, u64)> = stale.iter().map(|o| (o.partition, o.epoch)).collect();
    let overlaps = ownership_overlaps(&log);
    for (a, b) in &overlaps {
        assert!(
            stale_tenures.contains(&(a.partition, a.epoch)),
            "ownership overlap not explained by a counted stale publication: {a:?} vs {b:?}"
        );
    }
    format!("{} tenures, {} overlaps (all from counted stale publications)", log.len(), overlaps.len())
}

// ---------------------------------------------------------------------------------------------
// c, d. Disruptive: Redis outage, RabbitMQ restart.
// ---------------------------------------------------------------------------------------------

fn services(cmd: &str) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services");
    let st = std::process::Command::new(script).arg(cmd).status().unwrap_or_else(|e| panic!("run {script} {cmd}: {e}"));
    assert!(st.success(), "{script} {cmd} failed: {st}");
}

async fn services_async(cmd: &'static str) {
    tokio::task::spawn_blocking(move || services(cmd)).await.unwrap();
}

/// Brings a service back when the test ends, even when it fails half-way.
struct Restore(&'static str);

impl Drop for Restore {
    fn drop(&mut self) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services");
        let _ = std::process::Command::new(script).arg(self.0).status();
    }
}

fn require_disruptive() {
    assert!(
        std::env::var(DISRUPTIVE_ENV).is_ok_and(|v| v == "1"),
        "this test stops Redis or restarts RabbitMQ for everyone on this machine; run it alone with \
         {DISRUPTIVE_ENV}=1 cargo test --test scale -- --ignored --test-threads=1"
    );
}

/// c. Redis outage: Redis is stopped for 20 s mid-run (it restarts empty: the test Redis has no
/// persistence). Every instance stops consuming within the renew deadline (all partition queues
/// lose their consumers, and no result arrives after that until Redis is back); afterwards they
/// rejoin, re-acquire (with epochs above the old ones even though the counters were lost) and
/// finish: nothing lost, no ownership overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "disruptive: stops the local Redis for 20 s; see the module docs"]
async fn c_redis_outage() {
    require_disruptive();
    let _serial = SERIAL.lock().await;
    const P: u32 = 16;
    const N: usize = 3_000;
    services("up");
    let env = TestEnv::new("redisout");
    let fake = FakeLlm::new().latency(Duration::from_millis(30)).start().await.unwrap();
    let raw = scale_config(&env, fake.url.as_str(), P);
    let prefix = env.key_prefix().to_owned();
    let mut redis = RedisProbe::connect().await.unwrap();
    let amqp = Amqp::connect().await;
    let (mut cluster, ..) = Cluster::start_settled(&env, raw, &["a", "b", "c"], &mut redis).await;
    let Load { t0, log, reqs, publisher } = Load::start(&env, "redisout", N, 32, 100);
    log.wait_len(400, DEADLINE).await;

    let restore = Restore("start-redis");
    let t_stop = Instant::now(); // before the stop: an upper bound for "stopped within"
    services_async("stop-redis").await;
    let stop_took = t_stop.elapsed();
    // Every partition queue loses its consumer.
    let mut consumers_gone = None;
    while t_stop.elapsed() < Duration::from_secs(10) {
        let mut total = 0;
        for p in 0..P {
            total += amqp.queue_depth(&env.partition_queue(p)).await.1;
        }
        if total == 0 {
            consumers_gone = Some(t_stop.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let consumers_gone = consumers_gone.expect("partition consumers still attached 10 s into the Redis outage");
    tokio::time::sleep_until(t_stop + Duration::from_secs(20)).await;
    let during: Vec<Observed> = log.snapshot();
    let last_during = during.iter().map(|o| o.at).max().map(|at| at.saturating_duration_since(t_stop));
    let late = during.iter().filter(|o| o.at > t_stop + RENEW_DEADLINE + Duration::from_millis(500)).count();
    services_async("start-redis").await;
    drop(restore);
    let mut redis = RedisProbe::connect().await.unwrap();
    let (_, recovered) = cluster.wait_settled(&mut redis, &prefix, P, DEADLINE).await;

    wait_all_done(publisher, &log, &reqs).await;
    cluster.assert_running(&["a", "b", "c"]);
    let results = log.stop_after(&mut cluster).await;
    let t = tally(&reqs, &results);
    let own = check_ownership_log(&results, t0, false);
    for (id, copies) in &t.duplicated {
        let keys: HashSet<(u32, u64)> = copies.iter().map(|o| (o.partition, o.epoch)).collect();
        assert_eq!(keys.len(), copies.len(), "duplicate of {id} not detectable by (partition, epoch): {copies:?}");
    }
    println!(
        "redis outage: stop-redis took {}; every partition consumer gone {} after the stop began; last result {} after it; {late} results later than the renew deadline + 0.5 s; leases settled {} after Redis came back; lost {}, duplicates {}, {} tenures, 0 overlaps",
        secs(stop_took),
        secs(consumers_gone),
        last_during.map_or("-".into(), secs),
        secs(recovered),
        t.lost.len(),
        t.duplicates(),
        own.len()
    );
    assert!(t.lost.is_empty(), "{} requests lost", t.lost.len());
    assert!(consumers_gone <= RENEW_DEADLINE + Duration::from_secs(1), "consumers stopped {consumers_gone:?} after the Redis stop, want within the renew deadline");
    assert_eq!(late, 0, "results published after the renew deadline while Redis was down");
    amqp.close().await;
    env.cleanup().await;
}

/// d. RabbitMQ restart mid-run: every instance loses its connection, reconnects with backoff,
/// re-declares its topology, re-acquires its partitions and finishes; requests published before
/// (some in flight) and after the restart all get a result. Results go to the durable results
/// queue (an exclusive reply queue would die with the broker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "disruptive: restarts the local RabbitMQ; see the module docs"]
async fn d_rabbitmq_restart() {
    require_disruptive();
    let _serial = SERIAL.lock().await;
    const P: u32 = 16;
    services("up");
    let env = TestEnv::new("mqrestart");
    // Slower calls than elsewhere, so that most of the first half is still queued or in flight
    // when the broker goes down.
    let fake = FakeLlm::new().latency(Duration::from_millis(100)).start().await.unwrap();
    let raw = scale_config(&env, fake.url.as_str(), P);
    let prefix = env.key_prefix().to_owned();
    let mut redis = RedisProbe::connect().await.unwrap();
    let (mut cluster, ..) = Cluster::start_settled(&env, raw, &["a", "b", "c"], &mut redis).await;
    let t0 = Instant::now();
    let log = ResultLog::start(&env.results_queue());
    let reqs = completions_workload("mqrestart", 2_400, 32);
    let (before, after) = reqs.split_at(1_200);

    PacedPublisher::start(env.input_queue(), before.to_vec(), 1_000).finish(DEADLINE).await;
    log.wait_len(100, DEADLINE).await;
    let done_at_restart = log.distinct().len();
    let restore = Restore("start-rabbitmq");
    let t_restart = Instant::now();
    services_async("restart-rabbitmq").await;
    drop(restore);
    let restart_took = t_restart.elapsed();
    let (_, recovered) = cluster.wait_settled(&mut redis, &prefix, P, Duration::from_secs(120)).await;
    PacedPublisher::start(env.input_queue(), after.to_vec(), 400).finish(DEADLINE).await;
    log.wait_all(&ids(&reqs), Duration::from_secs(180)).await;
    cluster.assert_running(&["a", "b", "c"]);
    let reconnected: Vec<bool> = ["a", "b", "c"].iter().map(|s| cluster.proc(s).log().contains("reconnecting")).collect();
    cluster.stop_all(DEADLINE).await;
    log.barrier().await;
    let sessions = log.sessions();
    let results = log.stop().await;
    let t = tally(&reqs, &results);
    let own = check_ownership_log(&results, t0, false);
    println!(
        "rabbitmq restart: {done_at_restart} of 1200 requests done when the restart began; restart took {}; leases settled {} after it; lost {}, duplicates {}, {} tenures, 0 overlaps; result log needed {sessions} connections",
        secs(restart_took),
        secs(recovered),
        t.lost.len(),
        t.duplicates(),
        own.len()
    );
    assert!(t.lost.is_empty(), "{} requests lost", t.lost.len());
    assert!(done_at_restart < before.len(), "everything finished before the restart; the test proves less than it should");
    assert!(reconnected.iter().all(|r| *r), "every instance should have logged its reconnect: {reconnected:?}");
    assert!(sessions >= 2, "the result log should have had to reconnect");
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Lease protocol.
// ---------------------------------------------------------------------------------------------

/// The lease scripts against the real Redis: acquire/busy/renew/release compare the full
/// `name:nonce:epoch`; every acquisition (also a re-acquire by the same process) gets a new,
/// larger epoch; a lost epoch counter (Redis data loss) restarts above the old epochs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_protocol_against_redis() {
    let env = TestEnv::new("lease");
    let client = redis::Client::open(REDIS_URL).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    let ttl = Duration::from_secs(3);
    let t = Duration::from_secs(2);
    let a = Leases::new(conn.clone(), env.key_prefix(), "a:n1".into(), ttl, t);
    let a2 = Leases::new(conn.clone(), env.key_prefix(), "a:n2".into(), ttl, t); // a restarted
    let b = Leases::new(conn.clone(), env.key_prefix(), "b:n3".into(), ttl, t);
    let mut probe = RedisProbe::connect().await.unwrap();

    let Acquire::Acquired(e1) = a.acquire(7).await.unwrap() else { panic!("free lease not acquired") };
    assert_eq!(b.acquire(7).await.unwrap(), Acquire::Busy(format!("a:n1:{e1}")));
    assert_eq!(a2.acquire(7).await.unwrap(), Acquire::Busy(format!("a:n1:{e1}")), "same name, other process: busy");
    assert!(a.renew(7, e1).await.unwrap());
    assert!(!b.renew(7, e1).await.unwrap(), "renew compares the holder");
    assert!(!a.release(7, e1 + 1).await.unwrap(), "release compares the epoch");
    let pttl: i64 = redis::cmd("PTTL").arg(Leases::lease_key(env.key_prefix(), 7)).query_async(&mut probe.conn).await.unwrap();
    assert!(pttl > 2_000 && pttl <= 3_000, "lease PTTL {pttl} ms, want the 3 s TTL");

    // Re-acquire by the same process: a new epoch; the old one no longer renews.
    let Acquire::Acquired(e2) = a.acquire(7).await.unwrap() else { panic!() };
    assert!(e2 > e1);
    assert!(!a.renew(7, e1).await.unwrap());
    assert!(a.renew(7, e2).await.unwrap());
    assert!(a.release(7, e2).await.unwrap());
    let Acquire::Acquired(e3) = b.acquire(7).await.unwrap() else { panic!("released lease not acquired") };
    assert!(e3 > e2);

    // Data loss: the lease and the epoch counter vanish; epochs still grow.
    probe.del(&Leases::lease_key(env.key_prefix(), 7)).await;
    probe.del(&Leases::epoch_key(env.key_prefix(), 7)).await;
    assert!(!b.renew(7, e3).await.unwrap(), "a vanished lease does not renew");
    tokio::time::sleep(Duration::from_millis(5)).await;
    let Acquire::Acquired(e4) = a2.acquire(7).await.unwrap() else { panic!() };
    assert!(e4 > e3, "epoch after a lost counter ({e4}) must exceed the old one ({e3})");
    assert_eq!(probe.get(&Leases::lease_key(env.key_prefix(), 7)).await, Some(format!("a:n2:{e4}")));

    // Release at any epoch (after an acquire that failed here but may have run): only the
    // holder's own lease goes, and only once.
    assert!(!a.release_any_epoch(7).await.unwrap(), "same name, other process: not released");
    assert!(!b.release_any_epoch(7).await.unwrap(), "other holder: not released");
    assert_eq!(probe.get(&Leases::lease_key(env.key_prefix(), 7)).await, Some(format!("a:n2:{e4}")));
    assert!(a2.release_any_epoch(7).await.unwrap());
    assert_eq!(probe.get(&Leases::lease_key(env.key_prefix(), 7)).await, None);
    assert!(!a2.release_any_epoch(7).await.unwrap(), "nothing left to release");
    env.cleanup().await;
}
