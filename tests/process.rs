//! End-to-end tests of the real binary (`prefix-batcher run` / `check-config` as child
//! processes): crash safety under `kill -9`, graceful SIGTERM, startup refusal, config checks.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use llm_fakes::fake::{FakeLlm, FakeLlmHandle};
use prefix_batcher::config::RawConfig;
use tokio::time::Instant;

/// A daemon process holding every lease, and the test's reply queue.
struct ProcessStarted {
    amqp: Amqp,
    redis: RedisProbe,
    daemon: DaemonProcess,
    results: Collector,
    /// Name of the reply queue (`{env.name}.reply`).
    reply: String,
}

/// Runs the binary with `raw` as process `label`, waits until it holds every lease
/// ([`wait_ready`]), and opens the reply queue `{env.name}.reply`.
async fn run_with_replies(env: &TestEnv, raw: &RawConfig, label: &str) -> ProcessStarted {
    let amqp = Amqp::connect().await;
    let mut redis = RedisProbe::connect().await.unwrap();
    let mut daemon = DaemonProcess::run(env, label, raw);
    wait_ready(&mut redis, env, &mut daemon, &raw.instance.name).await;
    let reply = format!("{}.reply", env.name);
    let results = amqp.reply_queue(&reply).await;
    ProcessStarted { amqp, redis, daemon, results, reply }
}

impl ProcessStarted {
    /// SIGTERM: the daemon must drain and exit 0 (else the assertion shows its log's tail). Then
    /// closes the reply queue's consumer and the test's connection, and deletes what `env` made.
    async fn stop_and_clean_up(mut self, env: TestEnv) {
        self.daemon.sigterm();
        assert_eq!(self.daemon.wait_exit(DEADLINE).await.code(), Some(0), "log:\n{}", self.daemon.log_tail(30));
        self.results.close().await;
        self.amqp.close().await;
        env.cleanup().await;
    }
}

/// A deployment of [`PARTITIONS`] partitions that ran once and stopped: its partition count is
/// recorded in Redis and its partition queues exist.
struct Existing {
    env: TestEnv,
    /// Keeps the fake LLM serving for the rest of the test.
    _fake: FakeLlmHandle,
    raw: RawConfig,
    redis: RedisProbe,
}

/// Starts a deployment (in process) for test `test`, waits until it holds every lease, and stops
/// it (it must stop cleanly).
async fn existing_deployment(test: &str) -> Existing {
    let env = TestEnv::new(test);
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let mut redis = RedisProbe::connect().await.unwrap();
    let daemon = start_daemon(&raw);
    redis.wait_all_held_by(env.key_prefix(), PARTITIONS, &raw.instance.name).await;
    daemon.stop().await.expect("daemon stops cleanly");
    Existing { env, _fake: fake, raw, redis }
}

/// `raw` with `partitions` partitions, as instance `env.instance(suffix)`.
fn with_partitions(env: &TestEnv, raw: &RawConfig, partitions: u32, suffix: &str) -> RawConfig {
    let mut other = raw.clone();
    other.amqp.partitions = partitions;
    other.instance.name = env.instance(suffix);
    other
}

/// Waits until the process `name` holds every lease; fails early (with its log) if it exits.
async fn wait_ready(redis: &mut RedisProbe, env: &TestEnv, daemon: &mut DaemonProcess, name: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(daemon.is_running(), "{} exited during startup; its log:\n{}", daemon.label, daemon.log_tail(40));
        let leases = redis.leases(env.key_prefix(), PARTITIONS).await;
        if leases.iter().all(|l| l.as_ref().is_some_and(|l| l.name == name)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} did not acquire every lease within {DEADLINE:?} ({leases:?}); its log:\n{}",
            daemon.label,
            daemon.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `kill -9` of a busy daemon loses nothing: after a restart (same name, so it must wait out the
/// dead process's 6 s leases) every request has at least one result. Duplicates are allowed
/// (at-least-once) and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_run_then_restart_loses_no_request() {
    let env = TestEnv::new("crash");
    let fake = FakeLlm::new().latency(Duration::from_millis(300)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    // The restart must find the killed process's name and leases still held, to say so: TTLs
    // that outlast its startup (connections and declarations on a broker busy requeueing the
    // killed process's deliveries took up to a second or two), not the tests' short ones.
    (raw.ownership.member_ttl, raw.ownership.lease_ttl, raw.ownership.renew_deadline) = ("10s".into(), "6s".into(), "4s".into());
    let ProcessStarted { amqp, daemon: mut first, mut results, reply, .. } = run_with_replies(&env, &raw, "first").await;

    let reqs = completions_workload("crash", 400, 5);
    let all = ids(&reqs);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    results.until("40 results before the crash", DEADLINE, |r| r.len() >= 40).await;
    first.kill9();
    let before = results.distinct_of(&all);
    assert!(before < all.len(), "every request finished before the kill ({before}); the test proves nothing");
    let epochs_before: HashSet<(u32, u64)> = results.received.iter().map(|m| (m.result().partition, m.epoch())).collect();
    let killed_at = Instant::now();

    let mut second = DaemonProcess::run(&env, "second", &raw);
    results.until_all(&all, DEADLINE).await;
    let recovered_in = killed_at.elapsed();
    assert!(second.is_running(), "the restarted daemon died; its log:\n{}", second.log_tail(40));
    // A restart under the same name takes the name over quietly: no name conflict.
    assert!(second.log().contains("took over the instance name from a previous process"), "{}", second.log_tail(40));
    assert!(!second.log().contains("another process is heartbeating"), "a restart reported as a name conflict:\n{}", second.log_tail(40));
    // Its wait for the killed process's leases is said, not silent.
    assert!(second.log().contains("lease is still held by a previous process of this instance"), "{}", second.log_tail(40));
    second.sigterm();
    let status = second.wait_exit(DEADLINE).await;
    assert!(status.success(), "SIGTERM must exit 0, got {status}; log:\n{}", second.log_tail(40));
    results.barrier(&amqp).await;

    let by_id = results.by_correlation();
    let mut duplicates = 0;
    for r in &reqs {
        let got = by_id.get(&r.id).map_or(0, Vec::len);
        assert!(got >= 1, "request {} was lost", r.id);
        duplicates += got - 1;
        for m in &by_id[&r.id] {
            let res = m.result();
            assert!(res.ok, "request {} failed: {:?}", r.id, res.error);
            assert_eq!(res.id, r.id);
        }
    }
    // The restarted process worked under new epochs (fencing tokens).
    let after: Vec<(u32, u64)> = results
        .received
        .iter()
        .map(|m| (m.result().partition, m.epoch()))
        .filter(|pe| !epochs_before.contains(pe))
        .collect();
    assert!(!after.is_empty(), "no result came from a new epoch after the restart");
    for (p, e) in &after {
        let old = epochs_before.iter().filter(|(q, _)| q == p).map(|(_, e)| *e).max().unwrap_or(0);
        assert!(*e > old, "partition {p}: epoch {e} after the restart is not above {old}");
    }
    for p in 0..PARTITIONS {
        assert_eq!(amqp.queue_depth(&env.partition_queue(p)).await.0, 0, "partition {p} not empty at the end");
    }
    assert_eq!(amqp.queue_depth(&env.input_queue()).await.0, 0, "input not empty at the end");
    println!(
        "kill -9: {} requests, {before} had results before the kill, {duplicates} duplicate results, all done {:.1}s after the kill",
        reqs.len(),
        recovered_in.as_secs_f64()
    );

    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// SIGTERM drains: exit code 0, every lease and the member key deleted (long TTLs, so only a
/// release explains their absence), and a successor finishes the rest at once: nothing lost,
/// nothing duplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_releases_and_exits_zero() {
    let env = TestEnv::new("term");
    let fake = FakeLlm::new().latency(Duration::from_millis(200)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.ownership.lease_ttl = "60s".into();
    raw.ownership.renew_deadline = "40s".into();
    raw.ownership.renew_interval = "1s".into();
    raw.ownership.member_ttl = "60s".into();
    let ProcessStarted { amqp, mut redis, mut daemon, mut results, reply } = run_with_replies(&env, &raw, "term").await;
    assert_eq!(redis.keys(&format!("{}:member:*", env.key_prefix())).await.len(), 1, "the member key should exist");

    let reqs = completions_workload("term", 300, 5);
    let all = ids(&reqs);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    results.until("30 results before SIGTERM", DEADLINE, |r| r.len() >= 30).await;
    daemon.sigterm();
    let status = daemon.wait_exit(Duration::from_secs(30)).await;
    assert_eq!(status.code(), Some(0), "SIGTERM must exit 0; log:\n{}", daemon.log_tail(40));
    let leases = redis.keys(&format!("{}:lease:*", env.key_prefix())).await;
    assert!(leases.is_empty(), "leases left after a graceful stop: {leases:?}");
    let members = redis.keys(&format!("{}:member:*", env.key_prefix())).await;
    assert!(members.is_empty(), "member key left after a graceful stop: {members:?}");
    results.barrier(&amqp).await; // everything the first daemon published is in
    let done_by_first = results.distinct_of(&all);
    assert!(done_by_first < all.len(), "the first daemon finished everything; the successor is not exercised");

    // A successor (different name) takes over at once: the leases were released, not left to
    // expire after 60 s.
    let mut raw_b = raw.clone();
    raw_b.instance.name = env.instance("b");
    let successor = start_daemon(&raw_b);
    results.until_all(&all, Duration::from_secs(30)).await;
    successor.stop().await.expect("successor stops cleanly");
    results.barrier(&amqp).await;

    let by_id = results.by_correlation();
    for r in &reqs {
        let got = by_id.get(&r.id).map_or(0, Vec::len);
        assert_eq!(got, 1, "request {} got {got} results; a graceful drain neither loses nor duplicates", r.id);
        let res = by_id[&r.id][0].result();
        assert!(res.ok, "request {} failed: {:?}", r.id, res.error);
    }
    println!("sigterm: {done_by_first} of {} requests done by the first daemon, the rest by its successor", reqs.len());

    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// A stopping instance still draining shows in `status` as draining, not as a crashed owner
/// (its leases are held by a name that left the member set), and its draining mark is gone
/// once it has exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_instance_shows_as_draining_in_status() {
    let env = TestEnv::new("drainstat");
    // Slow calls keep the drain going for seconds after the SIGTERM.
    let fake = FakeLlm::new().latency(Duration::from_secs(4)).start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let ProcessStarted { amqp, mut redis, mut daemon, results, reply } = run_with_replies(&env, &raw, "drainstat").await;
    let reqs = completions_workload("drainstat", 16, 4);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    tokio::time::timeout(DEADLINE, fake.wait_for_calls(1)).await.expect("no LLM call");
    daemon.sigterm();
    let mark = format!("{}:member_draining:{}", env.key_prefix(), raw.instance.name);
    let config = write_config(&env, "status", &raw);
    let status_json = || {
        let config = config.clone();
        tokio::task::spawn_blocking(move || {
            let out = bin_command().arg("--config").arg(&config).args(["status", "--json"]).output().expect("run status");
            assert!(out.status.success(), "status failed: {}", String::from_utf8_lossy(&out.stderr));
            serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("status --json is JSON")
        })
    };
    // The instance leaves the member set at its next ownership round after the signal; the
    // calls in flight keep it draining for seconds after that.
    let deadline = Instant::now() + DEADLINE;
    let status = loop {
        let status = status_json().await.unwrap();
        if status["draining_owners"].as_array().is_some_and(|d| !d.is_empty()) {
            break status;
        }
        assert!(Instant::now() < deadline, "status never showed the instance as draining: {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let name = serde_json::Value::from(raw.instance.name.clone());
    assert!(status["members"].as_array().unwrap().iter().all(|m| m["name"] != name), "the stopping instance is still a member: {status}");
    assert_eq!(status["draining_owners"], serde_json::json!([raw.instance.name]), "status: {status}");
    let notes: Vec<&serde_json::Value> = status["partitions"].as_array().unwrap().iter().filter(|p| p["owner"] == name).map(|p| &p["note"]).collect();
    assert!(!notes.is_empty(), "the draining instance holds no lease: {status}");
    assert!(notes.iter().all(|n| *n == "owner draining"), "partitions of the draining instance: {notes:?}");
    let exit = daemon.wait_exit(DEADLINE).await;
    assert_eq!(exit.code(), Some(0), "log:\n{}", daemon.log_tail(30));
    assert!(redis.keys(&mark).await.is_empty(), "the draining mark outlived the drain");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// SIGHUP (an operator's "reload", a closed terminal), SIGUSR1 and SIGUSR2 (a logrotate script's
/// "reopen the log") are logged and ignored: the daemon goes on serving, then drains on SIGTERM as
/// usual. Their default action would end the process at once (observed for SIGUSR1 before: exit
/// status 138, no drain, no log line).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_and_the_user_signals_are_logged_and_ignored() {
    let env = TestEnv::new("hup");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let mut started = run_with_replies(&env, &raw, "hup").await;
    for name in ["HUP", "USR1", "USR2"] {
        started.daemon.signal(name);
        started.daemon.wait_log_line(&format!("SIG{name}"), DEADLINE, &format!("the SIG{name}")).await;
    }
    let reqs = completions_workload("hup", 10, 2);
    started.amqp.publish_requests(&env.input_queue(), &reqs, &started.reply).await;
    started.results.until_all(&ids(&reqs), DEADLINE).await;
    assert!(started.daemon.is_running(), "the daemon exited after the signals");
    started.stop_and_clean_up(env).await;
}

/// Two live processes with one `instance.name` (a copied unit or configuration): each finds the
/// other's nonce in the name's member key, so a warning names the conflict, the counter rises,
/// and both still stop cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_with_one_instance_name_are_reported() {
    let env = TestEnv::new("samename");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let mut one = DaemonProcess::run(&env, "one", &raw);
    let mut two = DaemonProcess::run(&env, "two", &raw);
    let warning = "another process is heartbeating with this instance.name";
    one.wait_log_line(warning, DEADLINE, "the name conflict").await;
    two.wait_log_line(warning, DEADLINE, "the name conflict").await;
    let (_, metrics) = http_get(&one.http_addr().await, "/metrics").await;
    let conflicts: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("prefix_batcher_instance_name_conflicts_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no conflict counter in /metrics"));
    assert!(conflicts >= 1.0, "conflicts counted: {conflicts}");
    for d in [&mut one, &mut two] {
        d.sigterm();
        let status = d.wait_exit(DEADLINE).await;
        assert!(status.success(), "SIGTERM must exit 0, got {status}; log:\n{}", d.log_tail(40));
    }
    env.cleanup().await;
}

/// A daemon configured with another `amqp.partitions` than the existing deployment refuses to
/// start with exit code 78 and a message naming the partition count — whether the mismatch is
/// found in Redis (recorded count) or on the broker (partition queue P exists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_partition_count_is_refused_with_78() {
    // The existing deployment: P = 8.
    let Existing { env, _fake, raw, mut redis } = existing_deployment("refuse").await;
    let recorded_key = format!("{}:partitions", env.key_prefix());
    assert_eq!(redis.get(&recorded_key).await.as_deref(), Some("8"), "the deployment records its partition count");

    let raw4 = with_partitions(&env, &raw, 4, "four");

    // 1. Redis knows the deployment has 8.
    let mut p = DaemonProcess::run(&env, "p4-redis", &raw4);
    let status = p.wait_exit(DEADLINE).await;
    let log = p.log();
    assert_eq!(status.code(), Some(78), "want exit 78 (EX_CONFIG), got {status}; log:\n{log}");
    assert!(log.contains("amqp.partitions") && log.contains("8 partitions"), "the refusal must name the partition counts; log:\n{log}");

    // `status` with the outdated configuration shows the deployment's 8 partitions, and says so.
    let config4 = write_config(&env, "status4", &raw4);
    let (json, table) = tokio::task::spawn_blocking(move || {
        let run = |json: bool| {
            let mut cmd = bin_command();
            cmd.arg("--config").arg(&config4).arg("status");
            if json {
                cmd.arg("--json");
            }
            let out = cmd.output().expect("run status");
            assert!(out.status.success(), "status failed: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap()
        };
        (run(true), run(false))
    })
    .await
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!((json["partition_count"].as_u64(), json["configured_partitions"].as_u64()), (Some(8), Some(4)), "status: {json}");
    assert_eq!(json["partitions"].as_array().map(Vec::len), Some(8));
    assert!(table.contains("amqp.partitions = 4, but the deployment records 8"), "{table}");

    // 2. Without the Redis record, the broker still shows partition queue 4 (of 0..8).
    redis.del(&recorded_key).await;
    let mut p = DaemonProcess::run(&env, "p4-broker", &raw4);
    let status = p.wait_exit(DEADLINE).await;
    let log = p.log();
    assert_eq!(status.code(), Some(78), "want exit 78 (EX_CONFIG), got {status}; log:\n{log}");
    assert!(log.contains("amqp.partitions") && log.contains("more than 4"), "the refusal must name the partition counts; log:\n{log}");

    // Refused instances never joined: no member, no lease.
    assert!(redis.keys(&format!("{}:member:*", env.key_prefix())).await.is_empty());
    assert!(redis.keys(&format!("{}:lease:*", env.key_prefix())).await.is_empty());
    env.cleanup().await;
}

/// A daemon configured with another partition queue prefix, shard exchange or dead-letter queue
/// than the existing deployment refuses to start with exit code 78, naming both routes and the keys, and declares
/// nothing: in a rolling restart, its queues would be bound to the deployment's exchange next to
/// the old ones, and every request copied into both (an operator's run: 464 results for 300
/// requests, and copies piling up in the old queues).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_partition_queue_names_are_refused_with_78() {
    let Existing { env, _fake, raw, mut redis } = existing_deployment("route").await;
    let route_key = format!("{}:partitions:route", env.key_prefix());
    assert!(redis.get(&route_key).await.is_some_and(|r| r.contains(&raw.amqp.partition_queue_prefix)), "the deployment records its route");
    for (what, change) in [
        ("prefix", Box::new(|r: &mut RawConfig, n: &str| r.amqp.partition_queue_prefix = format!("{n}.renamed")) as Box<dyn Fn(&mut RawConfig, &str)>),
        ("exchange", Box::new(|r: &mut RawConfig, n: &str| r.amqp.shard_exchange = format!("{n}.renamed-shards"))),
        // Bound to the same fanout dead-letter exchange, both queues would get every dead letter.
        ("dlq", Box::new(|r: &mut RawConfig, n: &str| r.amqp.dead_letter_queue = format!("{n}.renamed-dead-letter"))),
    ] {
        let mut other = raw.clone();
        change(&mut other, &env.name);
        other.instance.name = env.instance(what);
        let mut p = DaemonProcess::run(&env, what, &other);
        let status = p.wait_exit(DEADLINE).await;
        let log = p.log();
        assert_eq!(status.code(), Some(78), "{what}: want exit 78 (EX_CONFIG), got {status}; log:\n{log}");
        assert!(
            log.contains("amqp.partition_queue_prefix") && log.contains(&raw.amqp.partition_queue_prefix) && log.contains(&route_key),
            "{what}: the refusal must name the routes and the Redis key; log:\n{log}"
        );
    }
    let declared = broker::queues(&format!("{}.renamed", env.name));
    assert!(declared.is_empty(), "a refused instance declared its partition queues: {declared:?}");
    // The deployment as configured still starts.
    let mut ok = DaemonProcess::run(&env, "same", &raw);
    wait_ready(&mut redis, &env, &mut ok, &raw.instance.name).await;
    ok.sigterm();
    assert_eq!(ok.wait_exit(DEADLINE).await.code(), Some(0));
    env.cleanup().await;
}

/// A recorded partition count that the broker's partition queues contradict, while they match
/// the configuration (Redis restored from data older than a partition-count change), is stale:
/// the instance records the broker's count with a warning and starts. Before, every instance was
/// refused with either count (exit 78) until an operator fixed the key by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_recorded_partition_count_is_corrected_from_the_broker() {
    let Existing { env, _fake, raw, mut redis } = existing_deployment("stalecount").await;
    let recorded_key = format!("{}:partitions", env.key_prefix());
    redis.set(&recorded_key, "16").await;
    let mut d = DaemonProcess::run(&env, "restart", &raw);
    wait_ready(&mut redis, &env, &mut d, &raw.instance.name).await;
    assert!(d.log().contains("the record is stale"), "no warning about the stale record; log:\n{}", d.log_tail(20));
    assert_eq!(redis.get(&recorded_key).await.as_deref(), Some("8"), "the broker's count is recorded again");
    d.sigterm();
    assert_eq!(d.wait_exit(DEADLINE).await.code(), Some(0));
    env.cleanup().await;
}

/// The recorded route is written again by the running instances' heartbeats once Redis lost it
/// (before, one instance started with other names then recorded its own, and bound its queues
/// next to the deployment's); a recorded route whose partition queues do not exist while the
/// configured ones do is stale (Redis restored from older data) and is replaced, with a
/// warning, instead of refusing every correctly configured instance; a record naming other
/// queues than a running instance's is reported by its heartbeat at ERROR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_or_stale_route_record_is_written_again() {
    let Existing { env, _fake, raw, mut redis } = existing_deployment("routerecord").await;
    let route_key = format!("{}:partitions:route", env.key_prefix());
    let route = redis.get(&route_key).await.expect("the route is recorded");
    // Stale: names whose queues do not exist.
    redis.set(&route_key, &format!("exchange `{n}.old`, partition queues `{n}.old-partition.NNN`, dead letters `{n}.old-dlx` to `{n}.old-dl`", n = env.name)).await;
    let mut d = DaemonProcess::run(&env, "restart", &raw);
    wait_ready(&mut redis, &env, &mut d, &raw.instance.name).await;
    assert!(d.log().contains("the record is stale"), "no warning about the stale route; log:\n{}", d.log_tail(20));
    assert_eq!(redis.get(&route_key).await.as_deref(), Some(route.as_str()));
    // Lost while the instance runs: its heartbeat records it again.
    redis.del(&route_key).await;
    let deadline = Instant::now() + DEADLINE;
    while redis.get(&route_key).await.is_none() {
        assert!(Instant::now() < deadline, "the route was not recorded again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(redis.get(&route_key).await.as_deref(), Some(route.as_str()));
    // Other names recorded while it runs (an instance with other names won the moment after a
    // Redis data loss): the running instance says so at its next heartbeat.
    redis.set(&route_key, &format!("exchange `{n}.shards`, partition queues `{n}.other.NNN`, dead letters `{n}.dlx` to `{n}.dead-letter`", n = env.name)).await;
    d.wait_log_line("Redis records other queue names for this deployment than this instance uses", DEADLINE, "the other recorded route").await;
    d.sigterm();
    assert_eq!(d.wait_exit(DEADLINE).await.code(), Some(0));
    env.cleanup().await;
}

/// A refused start must not change the deployment's recorded partition count, or the correctly
/// configured instances are refused at their next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_start_does_not_poison_the_recorded_partition_count() {
    let Existing { env, _fake, raw, mut redis } = existing_deployment("poison").await;
    let recorded_key = format!("{}:partitions", env.key_prefix());
    redis.del(&recorded_key).await; // e.g. Redis restarted without persistence

    let raw4 = with_partitions(&env, &raw, 4, "four");
    let mut p = DaemonProcess::run(&env, "p4", &raw4);
    assert_eq!(p.wait_exit(DEADLINE).await.code(), Some(78));

    // The correctly configured deployment must still start.
    let mut ok = DaemonProcess::run(&env, "p8", &raw);
    wait_ready(&mut redis, &env, &mut ok, &raw.instance.name).await;
    ok.sigterm();
    assert_eq!(ok.wait_exit(DEADLINE).await.code(), Some(0));
    env.cleanup().await;
}

/// A batch id names one batch while the process runs. Observed: after a partition's consumer
/// restarted within its epoch (its queue deleted under load), the count began again at 1, and
/// `3-7-1` named two batches, so a log search for one batch mixed two. Here every (empty)
/// partition queue is deleted between two waves of requests: each partition's consumer declares
/// it again and restarts, keeping its lease and epoch, and the results of each batch id agree on
/// its size and key and are no more than its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_id_is_not_reused_after_a_consumer_restart() {
    let env = TestEnv::new("batchids");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let mut st = run_with_replies(&env, &raw, "ids").await;
    let first = completions_workload("batchids-a", 64, 8);
    st.amqp.publish_requests(&env.input_queue(), &first, &st.reply).await;
    st.results.until_all(&ids(&first), DEADLINE).await;
    for p in 0..PARTITIONS {
        st.amqp.ch.queue_delete(env.partition_queue(p).as_str().into(), lapin::options::QueueDeleteOptions::default()).await.expect("delete a partition queue");
    }
    let deadline = Instant::now() + DEADLINE;
    while st.daemon.log().matches("partition queue was deleted").count() < PARTITIONS as usize {
        assert!(Instant::now() < deadline, "not every consumer saw its queue deleted; log:\n{}", st.daemon.log_tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let second = completions_workload("batchids-b", 64, 8);
    st.amqp.publish_requests(&env.input_queue(), &second, &st.reply).await;
    st.results.until_all(&ids(&second), DEADLINE).await;
    let mut batches: HashMap<String, (usize, String, usize)> = HashMap::new();
    for m in st.results.received.iter() {
        let r = m.result();
        let (size, key, seen) = batches.entry(r.batch_id.clone()).or_insert((r.batch_size, r.prefix_key.clone(), 0));
        assert_eq!((*size, key.as_str()), (r.batch_size, r.prefix_key.as_str()), "batch id {} names two batches", r.batch_id);
        *seen += 1;
        assert!(*seen <= *size, "batch id {} has more results than its size {size}", r.batch_id);
    }
    let epochs: HashSet<(u32, u64)> = st.results.received.iter().map(|m| (m.result().partition, m.epoch())).collect();
    let partitions: HashSet<u32> = epochs.iter().map(|(p, _)| *p).collect();
    assert_eq!(epochs.len(), partitions.len(), "every partition kept its epoch (else the ids differ anyway): {epochs:?}");
    st.stop_and_clean_up(env).await;
}

/// Two instances of a new deployment started at the same moment with other partition counts:
/// one is refused (exit 78) before it declares anything, so the broker holds exactly the
/// winner's partition queues. Observed before: the loser was refused only after declaring and
/// binding its queues, so when the smaller count won, its extra queues stayed bound to the shard
/// exchange with no consumer, and once Redis lost the record the correctly configured instances
/// were refused ("more than 4") while a wrong one was accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_counts_started_at_once_the_refused_one_declares_nothing() {
    let env = TestEnv::new("countrace");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let raw4 = with_partitions(&env, &raw, 4, "four");
    let mut redis = RedisProbe::connect().await.unwrap();
    let mut eight = DaemonProcess::run(&env, "p8", &raw);
    let mut four = DaemonProcess::run(&env, "p4", &raw4);
    let deadline = Instant::now() + DEADLINE;
    let (winner, loser, p) = loop {
        if !four.is_running() {
            break (eight, four, PARTITIONS);
        }
        if !eight.is_running() {
            break (four, eight, 4);
        }
        assert!(Instant::now() < deadline, "neither instance was refused; logs:\n{}\n{}", eight.log_tail(20), four.log_tail(20));
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (mut winner, mut loser) = (winner, loser);
    let status = loser.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(78), "the refused instance: {status}; log:\n{}", loser.log_tail(20));
    let name = if p == 4 { raw4.instance.name.clone() } else { raw.instance.name.clone() };
    let ready = Instant::now() + DEADLINE;
    while !redis.leases(env.key_prefix(), p).await.iter().all(|l| l.as_ref().is_some_and(|l| l.name == name)) {
        assert!(winner.is_running() && Instant::now() < ready, "the instance with {p} partitions did not start; log:\n{}", winner.log_tail(40));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let queues = broker::queues(&format!("{}.", raw.amqp.partition_queue_prefix));
    assert_eq!(queues.len() as u32, p, "the broker holds other partition queues than the winner's {p}: {queues:?}");
    winner.sigterm();
    assert_eq!(winner.wait_exit(DEADLINE).await.code(), Some(0));
    env.cleanup().await;
}

/// A daemon with MORE partitions than the existing deployment is refused too, even when the
/// Redis record of the count is gone (the broker still shows the deployment's queues).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn larger_partition_count_is_refused_without_the_redis_record() {
    let Existing { env, _fake, raw, mut redis } = existing_deployment("larger").await;
    redis.del(&format!("{}:partitions", env.key_prefix())).await;

    let raw16 = with_partitions(&env, &raw, 16, "sixteen");
    let mut p = DaemonProcess::run(&env, "p16", &raw16);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if !p.is_running() {
            break Some(p.wait_exit(DEADLINE).await);
        }
        // Started for real: it holds leases of the 16-partition layout.
        if redis.leases(env.key_prefix(), 16).await.iter().any(|l| l.is_some()) || Instant::now() >= deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    if status.is_none() {
        p.sigterm();
        let _ = p.wait_exit(DEADLINE).await;
    }
    assert_eq!(status.and_then(|s| s.code()), Some(78), "P = 16 on an 8-partition deployment must be refused; log:\n{}", p.log_tail(20));
    env.cleanup().await;
}

/// Credentials the broker or Redis refuses stop the startup with exit 78 and a message naming
/// the configuration key, without the password: a wrong AMQP password (403 ACCESS_REFUSED), a
/// vhost that does not exist (530 NOT_ALLOWED), a wrong Redis password, a Redis database the
/// server does not have. Before, the daemon
/// retried each of them for ever with a warning. With `amqp.urls`, one refusing node is not
/// enough: the daemon goes on to the next node and starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_stop_the_startup_with_78() {
    let env = TestEnv::new("refused");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    const WRONG: &str = "pbt-wrong-password-5c1e";
    let wrong_login = AMQP_URL.replacen("guest:guest@", &format!("guest:{WRONG}@"), 1);
    assert_ne!(wrong_login, AMQP_URL, "the test's AMQP URL has the guest user");
    let (base, _vhost) = AMQP_URL.rsplit_once('/').unwrap();
    let cases = [
        ("amqp-password", "amqp.url", "403 ACCESS_REFUSED", {
            let mut r = raw.clone();
            r.amqp.url = wrong_login.clone();
            r
        }),
        ("amqp-vhost", "amqp.url", "530 NOT_ALLOWED", {
            let mut r = raw.clone();
            r.amqp.url = format!("{base}/{}-no-such-vhost", env.name);
            r
        }),
        ("redis-password", "redis.url", "refused the daemon's credentials", {
            let mut r = raw.clone();
            r.redis.url = REDIS_URL.replacen("redis://", &format!("redis://:{WRONG}@"), 1);
            r
        }),
        // A database the server does not have (16 by default) used to be retried for ever.
        ("redis-database", "redis.url", "has no such database", {
            let mut r = raw.clone();
            r.redis.url = format!("{}/99", REDIS_URL.trim_end_matches('/'));
            r
        }),
    ];
    for (label, key, says, bad) in cases {
        let mut p = DaemonProcess::run(&env, label, &bad);
        let status = p.wait_exit(DEADLINE).await;
        let log = p.log();
        assert_eq!(status.code(), Some(78), "{label}: want exit 78 (EX_CONFIG), got {status}; log:\n{log}");
        assert!(log.contains(key) && log.contains(says), "{label}: the message must name {key} and say {says:?}; log:\n{log}");
        assert!(!log.contains(WRONG), "{label}: the password must not reach the log:\n{log}");
    }

    // Two nodes that both refuse, each its own way: exit 78 naming both refusals.
    let mut both = raw.clone();
    both.amqp.urls = vec![wrong_login.clone(), format!("{base}/{}-no-such-vhost", env.name)];
    let mut p = DaemonProcess::run(&env, "both-nodes", &both);
    let status = p.wait_exit(DEADLINE).await;
    let log = p.log();
    assert_eq!(status.code(), Some(78), "both nodes refusing: want exit 78, got {status}; log:\n{log}");
    let stop = log.lines().find(|l| l.contains("stopping")).unwrap_or_else(|| panic!("no stopping line; log:\n{log}"));
    assert!(stop.contains("node 0") && stop.contains("403 ACCESS_REFUSED") && stop.contains("node 1") && stop.contains("530 NOT_ALLOWED"), "the message names both nodes' refusals: {stop}");

    // Two nodes, the first refusing the login: the daemon starts on the second.
    let mut two = raw.clone();
    two.amqp.urls = vec![wrong_login, AMQP_URL.to_owned()];
    let mut redis = RedisProbe::connect().await.unwrap();
    let mut p = DaemonProcess::run(&env, "second-node", &two);
    wait_ready(&mut redis, &env, &mut p, &two.instance.name).await;
    assert!(p.log().contains("403 ACCESS_REFUSED"), "node 0's refusal is logged; log:\n{}", p.log_tail(20));
    p.sigterm();
    assert_eq!(p.wait_exit(DEADLINE).await.code(), Some(0), "log:\n{}", p.log_tail(20));
    env.cleanup().await;
}

/// An empty `RUST_LOG=` (an `EnvironmentFile` line without a value) counts as unset, as
/// documented: the daemon logs at `log.level`. Observed: it was read as a filter without
/// directives, and a daemon stopping with exit 78 said nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_rust_log_still_logs_the_error_that_stops_the_daemon() {
    let env = TestEnv::new("emptylog");
    let mut raw = env.raw_config("http://127.0.0.1:1/");
    raw.redis.url = format!("{}/99", REDIS_URL.trim_end_matches('/'));
    let cfg = write_config(&env, "empty-rust-log", &raw);
    let mut cmd = bin_command();
    cmd.env("RUST_LOG", "").arg("--config").arg(&cfg).arg("run");
    let mut p = DaemonProcess::spawn(&env, "empty-rust-log", cmd);
    let status = p.wait_exit(DEADLINE).await;
    let log = p.log();
    assert_eq!(status.code(), Some(78), "log:\n{log}");
    assert!(log.contains("http listening") && log.contains("has no such database"), "RUST_LOG= silenced the log:\n{log}");
    env.cleanup().await;
}

/// A header of tables nested 10,000 levels deep (70 kB, within RabbitMQ's default `frame_max`):
/// the AMQP client parses field tables recursively, and with the default 2 MiB thread stacks the
/// daemon's process aborted at about 200 levels (`thread 'lapin-io-loop' has overflowed its
/// stack`), again at every redelivery, and the broker's delivery limit dead-lettered the requests
/// delivered with it, untried. The daemon now runs with 256 MiB thread stacks: the request is
/// answered like any other, and so are the ones around it, by the same process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deeply_nested_header_is_served_and_crashes_nothing() {
    let env = TestEnv::new("nested");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let mut started = run_with_replies(&env, &raw, "nested").await;
    let pid = started.daemon.pid();
    let input = env.input_queue();
    let reply = started.reply.clone();
    let body = |id: &str| serde_json::to_vec(&serde_json::json!({"id": id, "prompt": format!("nested header test {id}")})).unwrap();
    let headers = raw_amqp::nested_table(10_000);
    let mut want = HashSet::new();
    for id in ["nested-before", "nested-deep", "nested-after"] {
        let props = raw_amqp::RawProps {
            correlation_id: Some(id.as_bytes()),
            reply_to: Some(reply.as_bytes()),
            headers: (id == "nested-deep").then_some(headers.as_slice()),
            ..Default::default()
        };
        raw_amqp::publish(&input, &body(id), props).await;
        want.insert(id.to_owned());
    }
    started.results.until_all(&want, DEADLINE).await;
    for id in &want {
        let r = started.results.received.iter().find(|m| &m.correlation_id == id).unwrap().result();
        assert!(r.ok, "{id}: {r:?}");
    }
    assert_eq!(started.daemon.pid(), pid);
    assert!(!started.daemon.log().contains("overflowed its stack"), "log tail:\n{}", started.daemon.log_tail(20));
    started.stop_and_clean_up(env).await;
}

/// A flood of malformed requests is dead-lettered in full, and its per-request warning reaches
/// the log at most `log_limit::BURST` times a minute (the rest go to `DEBUG`): before, every one
/// of them was a `WARN` line, and journald drops lines of a unit over its rate limit, the
/// important ones included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_malformed_requests_is_dead_lettered_in_full_and_logged_within_the_burst() {
    const N: usize = 200;
    let env = TestEnv::new("flood");
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let started = run_with_replies(&env, &raw, "flood").await;
    let mut dead = started.amqp.consume(&env.dead_letter_queue()).await;
    // First one with no id at all: its line names the publisher's app_id and the body's size.
    let anonymous = lapin::BasicProperties::default().with_app_id("legacy-publisher".into());
    started.amqp.publish(&env.input_queue(), b"not json at all", anonymous).await;
    for i in 1..N {
        let props = lapin::BasicProperties::default().with_message_id(format!("flood-{i}").into());
        started.amqp.publish(&env.input_queue(), format!("not json {i}").as_bytes(), props).await;
    }
    dead.until("every malformed request dead-lettered", DEADLINE, |got| got.len() >= N).await;
    let log = started.daemon.log();
    assert!(
        log.lines().any(|l| l.contains("dead-lettering request") && l.contains("app_id=\"legacy-publisher\"") && l.contains("bytes=15")),
        "the id-less message's line names its app_id and size; log tail:\n{}",
        started.daemon.log_tail(20)
    );
    assert!(log.lines().any(|l| l.contains("dead-lettering request") && l.contains("message_id=\"flood-1\"") && l.contains("bytes=10")));
    let warned = log.lines().filter(|l| l.contains("WARN") && l.contains("dead-lettering request")).count();
    assert_eq!(
        warned,
        prefix_batcher::log_limit::BURST as usize,
        "{N} malformed requests within a minute: want {} WARN lines of them; log tail:\n{}",
        prefix_batcher::log_limit::BURST,
        started.daemon.log_tail(20)
    );
    started.stop_and_clean_up(env).await;
}

/// A stray consumer that took a partition queue before its owner (single active consumer: the
/// owner's consumer then waits, and receives nothing) starves the owner: after one stall window
/// the owner restarts its consumer (a stuck consumer would be cured by that), and when the next
/// window passes without a delivery it says that another consumer most likely holds the queue,
/// naming it, and counts `prefix_batcher_partition_other_consumer_total`. Before, nothing said
/// why the partition's requests did not come back. When the stray consumer leaves, the owner
/// serves every request, the one the stray consumer held included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_consumer_on_an_owned_partition_queue_is_reported() {
    use lapin::options::{BasicConsumeOptions, BasicQosOptions};
    use lapin::types::FieldTable;
    let Existing { env, _fake, raw, redis: _ } = existing_deployment("stray").await;
    let queue = env.partition_queue(0);
    let stray = Amqp::connect().await;
    stray.ch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    let _held = stray.ch.basic_consume(queue.as_str().into(), "stray".into(), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    let mut started = run_with_replies(&env, &raw, "owner").await;
    let ids: HashSet<String> = (0..5).map(|i| format!("stray-{i}")).collect();
    for id in &ids {
        let body = serde_json::to_vec(&serde_json::json!({"id": id, "prompt": "waiting for its owner"})).unwrap();
        started.amqp.publish(&queue, &body, request_props(id, &started.reply)).await;
    }
    let settings = prefix_batcher::config::Settings::from_raw(&raw).unwrap();
    let within = 2 * prefix_batcher::partition::stall_window(&settings) + Duration::from_secs(20);
    let line = started.daemon.wait_log_line("another consumer is active on its queue", within, "the stray consumer").await;
    assert!(line.contains(&queue) && line.contains("restarts=1"), "the warning names the queue and the restart before it: {line}");
    assert!(started.daemon.log().contains("reason=\"stalled\""), "the first stall restarted the consumer");
    let (_, metrics) = http_get(&started.daemon.http_addr().await, "/metrics").await;
    assert!(metrics.lines().any(|l| l.starts_with("prefix_batcher_partition_other_consumer_total ") && !l.ends_with(" 0")), "the counter counts it");
    assert!(started.results.received.is_empty(), "the owner received nothing while the stray consumer was active");

    stray.close().await;
    started.results.until_all(&ids, DEADLINE).await;
    started.stop_and_clean_up(env).await;
}

/// A stray consumer that drains the partition queues before their owner subscribes (another
/// deployment on the same queue names, with its own Redis) keeps their ready count at 0, so no
/// stall is ever seen: the owner notices that requests its own router forwarded to a queue never
/// reached it, and says so once per window, counting
/// `prefix_batcher_partition_other_consumer_total`. Before, nothing was reported at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_consumer_that_drains_owned_partition_queues_is_reported() {
    use lapin::options::BasicConsumeOptions;
    use lapin::types::FieldTable;
    let Existing { env, _fake, raw, redis: _ } = existing_deployment("drained").await;
    let stray = Amqp::connect().await;
    let mut taken = Vec::new();
    for p in 0..PARTITIONS {
        let opts = BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() };
        let queue = env.partition_queue(p);
        taken.push(stray.ch.basic_consume(queue.as_str().into(), format!("stray-{p}").as_str().into(), opts, FieldTable::default()).await.unwrap());
    }
    let mut started = run_with_replies(&env, &raw, "owner").await;
    let reqs = completions_workload("drained", 12, 4);
    started.amqp.publish_requests(&env.input_queue(), &reqs, &started.reply).await;
    let settings = prefix_batcher::config::Settings::from_raw(&raw).unwrap();
    let within = prefix_batcher::partition::stall_window(&settings) + Duration::from_secs(20);
    started.daemon.wait_log_line("went to another consumer", within, "the draining consumer").await;
    assert!(!started.daemon.log().contains("reason=\"stalled\""), "no stall was seen (the queues held nothing ready)");
    let (_, metrics) = http_get(&started.daemon.http_addr().await, "/metrics").await;
    assert!(metrics.lines().any(|l| l.starts_with("prefix_batcher_partition_other_consumer_total ") && !l.ends_with(" 0")), "the counter counts it");
    // An owned partition whose intake runs exports 0, not nothing, from its session's start.
    assert!(metrics.lines().any(|l| l == "prefix_batcher_intake_paused{partition=\"0\"} 0"), "intake_paused of an owned partition:\n{metrics}");
    // `status` counts the stray consumer as the owner's (1 consumer, none missing); the owner's
    // health line, published with its next heartbeat, says what it found.
    let config = write_config(&env, "status", &raw);
    let deadline = Instant::now() + DEADLINE;
    loop {
        let c = config.clone();
        let out = tokio::task::spawn_blocking(move || bin_command().arg("--config").arg(&c).args(["status", "--json"]).output().expect("run status")).await.unwrap();
        let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json is JSON");
        let health = status["members"][0]["health"].as_str().unwrap_or_default().to_owned();
        if health.contains("another consumer is active on the queue of partition") {
            break;
        }
        assert!(Instant::now() < deadline, "status never showed the other consumer: {status}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(started.results.received.is_empty(), "the owner received nothing while the stray consumer was active");
    drop(taken);
    stray.close().await;
    started.stop_and_clean_up(env).await;
}

/// `check-config` accepts the documented example and rejects a zero `max_batch_wait` with 78,
/// naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_accepts_the_example_and_rejects_a_zero_batch_wait() {
    let env = TestEnv::new("check");
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.toml");
    let mut cmd = bin_command();
    cmd.arg("check-config").arg(example);
    let mut p = DaemonProcess::spawn(&env, "example", cmd);
    let status = p.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(0), "config/example.toml must be valid; stderr:\n{}", p.log());
    assert!(p.out().contains("configuration is valid"), "stdout:\n{}", p.out());

    let bad = env.dir.join("zero-wait.toml");
    std::fs::write(&bad, "[batching]\nmax_batch_wait = \"0s\"\n").unwrap();
    let mut cmd = bin_command();
    cmd.arg("check-config").arg(&bad);
    let mut p = DaemonProcess::spawn(&env, "zero-wait", cmd);
    let status = p.wait_exit(DEADLINE).await;
    let stderr = p.log();
    assert_eq!(status.code(), Some(78), "a zero max_batch_wait must exit 78; stderr:\n{stderr}");
    assert!(stderr.contains("batching.max_batch_wait"), "stderr must name the key:\n{stderr}");

    // The same file through `run` is refused the same way, before touching any service.
    let mut cmd = bin_command();
    cmd.arg("--config").arg(&bad).arg("run");
    let mut p = DaemonProcess::spawn(&env, "zero-wait-run", cmd);
    let status = p.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(78), "run with a zero max_batch_wait must exit 78; stderr:\n{}", p.log());
    assert!(p.log().contains("batching.max_batch_wait"));

    // Environment overrides are validated too.
    let mut cmd = bin_command();
    cmd.arg("check-config").arg(example).env("PREFIX_BATCHER__BATCHING__MAX_BATCH_WAIT", "0ms");
    let mut p = DaemonProcess::spawn(&env, "zero-wait-env", cmd);
    let status = p.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(78), "an env override of 0ms must exit 78; stderr:\n{}", p.log());
    assert!(p.log().contains("batching.max_batch_wait"));
    env.cleanup().await;
}

/// `submit --wait` ended by SIGINT (Ctrl-C) or SIGTERM: the results that arrived are written,
/// the summary says `interrupted` and how many are missing, and the exit code is 3. Before,
/// the signal killed the process: results already acked but still in its output buffer were
/// lost, and there was no summary; and results still in the reply queue went with it. Nobody
/// consumes the input queue here; the test answers three requests itself through their
/// `reply_to`, the third right before the signal. A wait that times out ends the same way (the
/// results in the reply queue are read before it goes; before, they were dropped with it), but
/// not `interrupted`. An output path that cannot be written stops `submit` before it publishes
/// anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_submit_wait_writes_its_results_and_its_summary() {
    use lapin::options::{BasicGetOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    let env = TestEnv::new("submitint");
    let amqp = Amqp::connect().await;
    let queue = env.input_queue();
    amqp.ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    let raw = env.raw_config("http://127.0.0.1:9");
    let cfg = write_config(&env, "submit", &raw);

    for signal in ["-INT", "-TERM", "timeout"] {
        let timeout = if signal == "timeout" { "4s" } else { "10m" };
        let input = env.dir.join("requests.jsonl");
        let lines: String = (0..5).map(|i| format!("{{\"id\":\"int{i}\",\"prompt\":\"hello {i}\"}}\n")).collect();
        std::fs::write(&input, lines).unwrap();
        let out = env.dir.join("results.jsonl");
        let mut cmd = bin_command();
        cmd.arg("--config").arg(&cfg).args(["submit", "--wait", "--timeout", timeout, "--queue", &queue, "--file"]).arg(&input).arg("--out").arg(&out);
        let mut submit = DaemonProcess::spawn(&env, &format!("submit{signal}"), cmd);

        // Answer the first two requests as the daemon would.
        let mut answered = 0;
        let mut reply_to = String::new();
        let deadline = Instant::now() + DEADLINE;
        while answered < 2 {
            assert!(Instant::now() < deadline, "submit published nothing: {}", submit.log());
            let Some(msg) = amqp.ch.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap() else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            let props = &msg.delivery.properties;
            let id = props.correlation_id().as_ref().unwrap().to_string();
            reply_to = props.reply_to().as_ref().unwrap().to_string();
            let body = format!("{{\"id\":\"{id}\",\"ok\":true,\"text\":\"hi\"}}");
            amqp.publish(&reply_to, body.as_bytes(), request_props(&id, &reply_to)).await;
            answered += 1;
        }
        // Wait until submit has taken and acked both (the reply queue is empty), then signal.
        let deadline = Instant::now() + DEADLINE;
        loop {
            let counts = broker::queues(&reply_to);
            if counts.iter().any(|(name, ready, unacked)| *name == reply_to && *ready == 0 && *unacked == 0) {
                break;
            }
            assert!(Instant::now() < deadline, "submit did not take its results: {counts:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A third result goes into the reply queue right before the signal: whether submit has
        // read it by then or not, it must reach the output file, not vanish with the queue.
        let msg = loop {
            if let Some(m) = amqp.ch.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap() {
                break m;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let id = msg.delivery.properties.correlation_id().as_ref().unwrap().to_string();
        let body = format!("{{\"id\":\"{id}\",\"ok\":true,\"text\":\"hi\"}}");
        amqp.publish(&reply_to, body.as_bytes(), request_props(&id, &reply_to)).await;
        if signal != "timeout" {
            let ok = std::process::Command::new("kill").arg(signal).arg(submit.pid().to_string()).status().unwrap().success();
            assert!(ok);
        }
        let status = submit.wait_exit(Duration::from_secs(10)).await;
        let log = submit.log();
        assert_eq!(status.code(), Some(3), "{signal}: {log}");
        let written = std::fs::read_to_string(&out).unwrap();
        assert_eq!(written.lines().count(), 3, "{signal}: the results sent before the signal are written: {written:?}");
        let summary: serde_json::Value = serde_json::from_str(log.lines().last().unwrap()).unwrap_or_else(|e| panic!("{signal}: no summary ({e}): {log}"));
        assert_eq!(summary["interrupted"], signal != "timeout", "{signal}: {summary}");
        assert_eq!(summary["results"], 3, "{signal}: {summary}");
        assert_eq!(summary["missing"], 2, "{signal}: {summary}");
        if signal == "timeout" {
            assert!(log.contains("timed out with 3 of 5 results") && log.contains("without a result after 4s"), "{log}");
        } else {
            assert!(log.contains("interrupted with 3 of 5 results"), "{signal}: {log}");
            assert!(log.contains("without a result when interrupted"), "{signal}: {log}");
        }
        assert!(broker::queues(&reply_to).is_empty(), "the reply queue is deleted");
        // The three unanswered requests are still in the input queue.
        let _ = amqp.ch.queue_purge(queue.as_str().into(), Default::default()).await;
    }

    // An output that cannot be written stops submit before it publishes anything.
    let input = env.dir.join("requests.jsonl");
    let bad_out = env.dir.join("no-such-dir").join("results.jsonl");
    let mut cmd = bin_command();
    cmd.arg("--config").arg(&cfg).args(["submit", "--wait", "--queue", &queue, "--file"]).arg(&input).arg("--out").arg(&bad_out);
    let mut submit = DaemonProcess::spawn(&env, "submit-bad-out", cmd);
    let status = submit.wait_exit(DEADLINE).await;
    let log = submit.log();
    assert_eq!(status.code(), Some(i32::from(prefix_batcher::exit::EX_CANTCREAT)), "{log}");
    assert!(log.contains("no-such-dir") && !log.contains("published"), "names the output, publishes nothing: {log}");
    assert_eq!(amqp.queue_depth(&queue).await.0, 0, "nothing was published");
    amqp.close().await;
    env.cleanup().await;
}

/// For a test of `submit` without a daemon: its namespace, a connection, the input queue
/// (declared, consumed by nobody) and a configuration file naming it.
async fn submit_without_daemon(test: &str) -> (TestEnv, Amqp, String, std::path::PathBuf) {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let env = TestEnv::new(test);
    let amqp = Amqp::connect().await;
    let queue = env.input_queue();
    amqp.ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    let cfg = write_config(&env, "submit", &env.raw_config("http://127.0.0.1:9"));
    (env, amqp, queue, cfg)
}

/// `submit` refuses a duplicate id, an id too long for a `message_id`, and a line the daemon
/// would dead-letter (not JSON, an id that is a float or holds a control character, no prompt)
/// partway through its input: the message names the line, the reason and says how many requests before it were published
/// (they will be processed; resubmitting the file would duplicate them). It exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_input_line_names_its_number_and_what_was_published() {
    let (env, amqp, queue, cfg) = submit_without_daemon("submitline").await;
    let long = "L".repeat(201);
    let cases = [
        ("dup", "{\"id\":\"a\",\"prompt\":\"1\"}\n\n{\"id\":\"b\",\"prompt\":\"2\"}\n{\"id\":\"a\",\"prompt\":\"3\"}\n".to_owned(), "input line 4: duplicate request id \"a\" in the input; the 2 requests were published before it"),
        ("long", format!("{{\"id\":\"c\",\"prompt\":\"1\"}}\n{{\"id\":\"{long}\",\"prompt\":\"2\"}}\n"), "input line 2: input line with request id"),
        // Lines the daemon would dead-letter: refused before they are published.
        ("not-json", "{\"id\":\"d\",\"prompt\":\"1\"}\nnot json\n".to_owned(), "input line 2: the daemon would dead-letter this request with reason invalid_json"),
        ("float-id", "{\"id\":1e2,\"prompt\":\"1\"}\n".to_owned(), "input line 1: the daemon would dead-letter this request with reason invalid_field: invalid field `id`: a numeric id must be an integer"),
        ("control", "{\"id\":\"bell\\u0007\",\"prompt\":\"1\"}\n".to_owned(), "input line 1: the daemon would dead-letter this request with reason invalid_field"),
        ("no-prompt", "{\"id\":\"e\"}\n".to_owned(), "input line 1: the daemon would dead-letter this request with reason missing_prompt"),
        // A byte order mark opening the file is not part of line 1, whose id is read: line 2
        // repeats it.
        ("bom", "\u{feff}{\"id\":\"h\",\"prompt\":\"1\"}\n{\"id\":\"h\",\"prompt\":\"2\"}\n".to_owned(), "input line 2: duplicate request id \"h\" in the input; the 1 request was published before it"),
    ];
    let mut not_utf8 = b"{\"id\":\"f\",\"prompt\":\"1\"}\r\n{\"id\":\"g\",\"prompt\":\"".to_vec();
    not_utf8.extend_from_slice(b"\xff\"}\n");
    let cases = cases.into_iter().map(|(label, lines, want)| (label, lines.into_bytes(), want)).chain([(
        "not-utf8",
        not_utf8,
        "input line 2: the daemon would dead-letter this request with reason invalid_utf8",
    )]);
    for (label, lines, want) in cases {
        let input = env.dir.join(format!("{label}.jsonl"));
        std::fs::write(&input, lines).unwrap();
        let out = bin_command().arg("--config").arg(&cfg).args(["submit", "--queue", &queue, "--file"]).arg(&input).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{label}: {stderr}");
        assert!(stderr.contains(want), "{label}: {stderr}");
    }
    assert_eq!(amqp.queue_depth(&queue).await.0, 6, "2 + 1 + 1 + 1 + 1 requests were published before the refused lines");
    amqp.close().await;
    env.cleanup().await;
}

/// `submit --wait` stopped by a refused line still waits for the results of the requests it
/// published before that line, writes them, and then exits 1 naming the line. Observed: it
/// exited at once, its reply queue went with it, and those results went to the results queue.
/// Nobody consumes the input queue here; the test answers the two requests itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_wait_stopped_by_a_refused_line_waits_for_what_it_published() {
    use lapin::options::BasicGetOptions;
    let (env, amqp, queue, cfg) = submit_without_daemon("submitstop").await;
    let input = env.dir.join("requests.jsonl");
    std::fs::write(&input, "{\"id\":\"s1\",\"prompt\":\"1\"}\n{\"id\":\"s2\",\"prompt\":\"2\"}\nnot json\n").unwrap();
    let out = env.dir.join("results.jsonl");
    let mut cmd = bin_command();
    cmd.arg("--config").arg(&cfg).args(["submit", "--wait", "--timeout", "10m", "--queue", &queue, "--file"]).arg(&input).arg("--out").arg(&out);
    let mut submit = DaemonProcess::spawn(&env, "submit", cmd);
    let mut answered = 0;
    let deadline = Instant::now() + DEADLINE;
    while answered < 2 {
        assert!(Instant::now() < deadline && submit.is_running(), "submit did not wait for its 2 requests: {}", submit.log());
        let Some(msg) = amqp.ch.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap() else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let props = &msg.delivery.properties;
        let id = props.correlation_id().as_ref().unwrap().to_string();
        let reply_to = props.reply_to().as_ref().unwrap().to_string();
        let body = format!("{{\"id\":\"{id}\",\"ok\":true,\"text\":\"hi\"}}");
        amqp.publish(&reply_to, body.as_bytes(), request_props(&id, &reply_to)).await;
        answered += 1;
    }
    let status = submit.wait_exit(DEADLINE).await;
    let log = submit.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("waiting for the results of the 2 requests published before it"), "{log}");
    assert!(log.contains("input line 3: the daemon would dead-letter this request with reason invalid_json"), "{log}");
    let written = std::fs::read_to_string(&out).unwrap();
    let ids: Vec<String> = written.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["id"].as_str().unwrap().to_owned()).collect();
    assert_eq!(ids.len(), 2, "both results are written: {written:?}");
    assert!(ids.contains(&"s1".to_owned()) && ids.contains(&"s2".to_owned()), "{ids:?}");
    amqp.close().await;
    env.cleanup().await;
}

/// A TCP proxy to the test broker that can turn the connections open through it into dead ones
/// that look alive: [`ZombieProxy::kill_open_connections`] closes their broker side (the broker
/// drops the connection, requeues its unacked deliveries and frees its consumers), swallows
/// whatever the client sends, and sends the client an AMQP heartbeat frame every second. The
/// client's AMQP library then sees a connection that is open and beating, on which no method is
/// ever answered. Connections made later pass through untouched.
struct ZombieProxy {
    addr: std::net::SocketAddr,
    generation: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
    task: tokio::task::JoinHandle<()>,
}

impl ZombieProxy {
    async fn start(upstream: &'static str) -> ZombieProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let generation = std::sync::Arc::new(tokio::sync::watch::channel(0u64).0);
        let gen = generation.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else { continue };
                let mut killed = gen.subscribe();
                let born = *killed.borrow_and_update();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let mut killed_too = killed.clone();
                    let up = async {
                        tokio::select! {
                            _ = tokio::io::copy(&mut cr, &mut sw) => {}
                            _ = killed_too.wait_for(|g| *g > born) => {}
                        }
                    };
                    let down = async {
                        tokio::select! {
                            _ = tokio::io::copy(&mut sr, &mut cw) => {}
                            _ = killed.wait_for(|g| *g > born) => {}
                        }
                    };
                    tokio::join!(up, down);
                    if *killed.borrow() == born {
                        return; // closed normally
                    }
                    // The broker side closes; the client side stays open, swallows what the
                    // client sends and gets a heartbeat frame (AMQP 0-9-1 §4.2.7: type 8,
                    // channel 0, size 0, frame-end 0xCE) every second.
                    drop((sr, sw));
                    let heartbeat = [8u8, 0, 0, 0, 0, 0, 0, 0xCE];
                    let mut beat = tokio::time::interval(Duration::from_secs(1));
                    let mut buf = [0u8; 4096];
                    loop {
                        tokio::select! {
                            n = cr.read(&mut buf) => if !matches!(n, Ok(n) if n > 0) { return },
                            _ = beat.tick() => if cw.write_all(&heartbeat).await.is_err() { return },
                        }
                    }
                });
            }
        });
        ZombieProxy { addr, generation, task }
    }

    /// Turns every connection open now into a zombie.
    fn kill_open_connections(&self) {
        self.generation.send_modify(|g| *g += 1);
    }
}

impl Drop for ZombieProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A broker connection that stays open and beating but answers nothing (here: its broker side is
/// gone behind a proxy that keeps sending heartbeats) ends the session within the backlog poll
/// interval + `RPC_TIMEOUT` (30 s), and the daemon reconnects and serves again. Before, nothing
/// noticed: lapin reported both connections open, every task waited on an answer for ever, and
/// the daemon served nothing until it was restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_connection_that_answers_nothing_ends_the_session() {
    let env = TestEnv::new("zombie");
    let fake = FakeLlm::new().start().await.unwrap();
    let proxy = ZombieProxy::start("127.0.0.1:5672").await;
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.url = format!("amqp://guest:guest@{}/%2f", proxy.addr);
    raw.amqp.heartbeat = "2s".into();
    let mut started = run_with_replies(&env, &raw, "zombie").await;
    let input = env.input_queue();
    let ask = |id: &str| serde_json::to_vec(&serde_json::json!({"id": id, "prompt": format!("zombie connection {id}")})).unwrap();
    let before: HashSet<String> = ["zombie-before".to_owned()].into();
    started.amqp.publish(&input, &ask("zombie-before"), request_props("zombie-before", &started.reply)).await;
    started.results.until_all(&before, DEADLINE).await;

    proxy.kill_open_connections();
    let killed_at = Instant::now();
    let within = prefix_batcher::amqp::RPC_TIMEOUT + Duration::from_secs(30);
    let ended = started.daemon.wait_log_line("session ended; reconnecting", within, "the end of the session whose connections went silent").await;
    println!("zombie connections: the session ended {:.1} s after they went silent: {ended}", killed_at.elapsed().as_secs_f64());
    assert!(ended.contains("the broker stopped answering") && ended.contains("did not answer"), "the reason names the silence: {ended}");

    let after: HashSet<String> = ["zombie-after".to_owned()].into();
    started.amqp.publish(&input, &ask("zombie-after"), request_props("zombie-after", &started.reply)).await;
    started.results.until_all(&after, DEADLINE).await;
    started.stop_and_clean_up(env).await;
}

/// A partition queue deleted while its worker holds a request: the broker deletes the unacked
/// request with the queue, and the log says so. Before, the broker's cancel of the consumer was
/// followed by `partition consumer closed; unacked requests return to the queue`, with no reason:
/// an operator was told the request would come back when it was gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_queue_deleted_under_a_held_request_is_logged_as_deleting_it() {
    use lapin::options::QueueDeleteOptions;
    let env = TestEnv::new("qdel");
    let fake = FakeLlm::new().latency(Duration::from_secs(5)).start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let started = run_with_replies(&env, &raw, "qdel").await;
    let queue = env.partition_queue(0);
    let body = serde_json::to_vec(&serde_json::json!({"id": "qdel-held", "prompt": "held while its queue is deleted"})).unwrap();
    started.amqp.publish(&queue, &body, request_props("qdel-held", &started.reply)).await;
    let deadline = Instant::now() + DEADLINE;
    while started.amqp.queue_depth(&queue).await.0 > 0 {
        assert!(Instant::now() < deadline, "the worker never took the request");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.amqp.ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.expect("delete the partition queue");
    let deadline = Instant::now() + DEADLINE;
    let wrong = |log: &str| log.lines().any(|l| l.contains("partition=0") && l.contains("unacked requests return to the queue"));
    while !started.daemon.log().contains("partition queue was deleted; the requests it held, unacked ones included, were deleted with it") {
        assert!(!wrong(&started.daemon.log()), "the log says the deleted request returns; log:\n{}", started.daemon.log_tail(20));
        assert!(Instant::now() < deadline, "no log line about the deleted requests; log:\n{}", started.daemon.log_tail(20));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!wrong(&started.daemon.log()), "the log says the deleted request returns; log:\n{}", started.daemon.log_tail(20));
    started.stop_and_clean_up(env).await;
}

/// A publisher's messages sent again, alike to ones answered a few seconds before, that wait in
/// the prefetch window of a router whose intake connection closes (here at a message the AMQP
/// client cannot read), are answered when another instance's router takes their redeliveries:
/// the first router reports in Redis that it forwarded none of them, and the second forwards
/// them unmarked. Observed before, with 2 instances: the second router forwarded them marked as
/// copies, and the partition's owner, which had taken the alike messages less than 10 s before,
/// acked them unanswered (10 of 20 and 7 of 20 lost in two runs of an outside test). The
/// processes are separate, as in production: routers in one process share what they forwarded.
///
/// Set-up: instance `b` consumes with a prefetch of 1, both processes are stopped (SIGSTOP)
/// while the messages are published, so `b` holds one filler and `a` everything after it: the
/// unreadable message first, then the messages sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_sent_again_that_another_instance_takes_after_an_intake_loss_are_answered() {
    let env = TestEnv::new("resendelse");
    let fake = FakeLlm::new().start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    // One partition for the shared prompt, so the copies meet the table of the one that took
    // the first messages; the unreadable message closes an intake at each of 2 deliveries.
    raw.sharding.default_shards = 1;
    raw.amqp.delivery_limit = 2;
    raw.log.level = "info,prefix_batcher::router=debug".into();
    let mut raw_b = with_partitions(&env, &raw, PARTITIONS, "b");
    raw_b.amqp.input_prefetch = 1;
    let amqp = Amqp::connect().await;
    let mut redis = RedisProbe::connect().await.unwrap();
    let mut a = DaemonProcess::run(&env, "a", &raw);
    let mut b = DaemonProcess::run(&env, "b", &raw_b);
    // Both sessions open (each holds a lease) and every partition held.
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(a.is_running() && b.is_running(), "a daemon exited during startup; logs:\n{}\n{}", a.log_tail(30), b.log_tail(30));
        let leases = redis.leases(env.key_prefix(), PARTITIONS).await;
        let held_by = |name: &str| leases.iter().any(|l| l.as_ref().is_some_and(|l| l.name == name));
        if leases.iter().all(Option::is_some) && held_by(&raw.instance.name) && held_by(&raw_b.instance.name) {
            break;
        }
        assert!(Instant::now() < deadline, "the two instances did not share the partitions: {leases:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    let input = env.input_queue();
    let ids: Vec<String> = (0..20).map(|i| format!("again-{i}")).collect();
    // Every copy of a message has all the properties of the first, its timestamp too.
    let messages: Vec<(Vec<u8>, lapin::BasicProperties)> =
        ids.iter().map(|id| (serde_json::to_vec(&serde_json::json!({"id": id, "prompt": "the same prompt"})).unwrap(), request_props(id, &reply))).collect();
    for (body, props) in &messages {
        amqp.publish(&input, body, props.clone()).await;
    }
    results.until_all(&ids.iter().cloned().collect(), DEADLINE).await;
    // Past the time in which an intake loss may still lose the first messages' acks (each
    // router then knows that its own acks reached the broker).
    tokio::time::sleep(prefix_batcher::redelivery::ACK_LOSS_WINDOW + Duration::from_secs(1)).await;

    a.signal("STOP");
    b.signal("STOP");
    let fillers: Vec<String> = (0..2).map(|i| format!("filler-{i}")).collect();
    for id in &fillers {
        amqp.publish(&input, &serde_json::to_vec(&serde_json::json!({"id": id, "prompt": "a filler"})).unwrap(), request_props(id, &reply)).await;
    }
    raw_amqp::publish(&input, br#"{"prompt":"unreadable"}"#, raw_amqp::RawProps { message_id: Some(b"bad\xff0"), ..Default::default() }).await;
    for (body, props) in &messages {
        amqp.publish(&input, body, props.clone()).await;
    }
    // The broker hands the messages to the stopped consumers' sockets.
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.signal("CONT");
    b.signal("CONT");

    let what = "every message answered twice, and the fillers once";
    results.until(what, DEADLINE, |r| ids.iter().chain(&fillers).all(|id| r.iter().any(|m| &m.correlation_id == id)) && ids.iter().all(|id| r.iter().filter(|m| &m.correlation_id == id).count() >= 2)).await;
    let dlq = env.dead_letter_queue();
    let deadline = Instant::now() + DEADLINE;
    while amqp.queue_depth(&dlq).await.0 < 1 {
        assert!(Instant::now() < deadline, "the unreadable message was not dead-lettered by the broker");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    results.barrier(&amqp).await;
    for id in &ids {
        let got = results.received.iter().filter(|m| &m.correlation_id == id).count();
        assert_eq!(got, 2, "{id}: {got} results for 2 messages");
    }
    assert_eq!(amqp.queue_depth(&dlq).await.0, 1, "only the unreadable message is dead-lettered");
    let reported = a.log().contains("forwarded unmarked") || b.log().contains("forwarded unmarked");
    for (daemon, name) in [(&mut a, "a"), (&mut b, "b")] {
        daemon.sigterm();
        assert_eq!(daemon.wait_exit(DEADLINE).await.code(), Some(0), "{name}'s log:\n{}", daemon.log_tail(30));
    }
    println!("resend after an intake loss: forwarded unmarked on the report of the other instance: {reported}");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}
