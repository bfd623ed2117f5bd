//! RabbitMQ cluster tests.
//!
//! - `quorum_group_size_on_one_node_and_queues_declared_without_it` (shared broker, runs with the
//!   integration tests): `x-quorum-initial-group-size` = 3 declares fine on a single node
//!   (RabbitMQ caps it at the node count); a queue that exists WITHOUT it refuses a redeclare with
//!   it (406 `PRECONDITION_FAILED`), and the daemon's topology accepts such a queue (and one
//!   without `x-delivery-limit` either) with a warning; so it does queues made with group size 3
//!   when the key changes to 1 or 0, while another `amqp.delivery_limit` is still refused.
//! - `node_loss_under_load` (`#[ignore]`, heavy stage of scripts/test, about 3 minutes): a
//!   3-node cluster from `scripts/cluster rabbit` (started when not running, stopped again at the
//!   end), 3 daemon processes connected to the node that leads the most partition queues,
//!   5,000 requests at a steady rate. That node is killed (`kill -9` of its beam.smp) and
//!   restarted; in a second run it is stopped gracefully (`rabbitmqctl stop_app`, then
//!   `start_app`). Passes with 0 lost requests; prints duplicates and the recovery times
//!   (`--nocapture`). Run alone: `cargo test --test cluster_rabbit -- --ignored --nocapture`.
//!
//! The test's own publisher and result consumer use the node that is never disrupted, so every
//! loss or duplicate counted is the daemon's. Each run deletes its queues and exchanges from the
//! cluster and its Redis keys; a cluster this test started is stopped (and its data deleted) at
//! the end, also when it fails; a cluster that was already running is left running, and after a
//! failure it may keep the failed run's queues (`scripts/cluster rabbit stop` deletes them).

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::cluster::*;
use common::*;
use lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Connection, ConnectionProperties};
use llm_fakes::fake::FakeLlm;
use prefix_batcher::config::{RawConfig, Settings};
use tokio::time::Instant;

/// Requests of one run.
const N: usize = 5_000;
/// Their rate (requests/s): N at 110/s is about 45 s of publishing.
const RATE: u32 = 110;
/// Partitions of the test deployment.
const P: u32 = 8;

fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

// ---------------------------------------------------------------------------------------------
// Queue arguments on a single node (shared broker).
// ---------------------------------------------------------------------------------------------

/// A redis connection manager on the shared Redis (for the partition-count key of
/// `topology::declare`).
async fn redis_manager() -> redis::aio::ConnectionManager {
    redis::Client::open(REDIS_URL).unwrap().get_connection_manager().await.expect("redis (run scripts/services)")
}

fn settings(raw: &RawConfig) -> Settings {
    Settings::from_raw(raw).unwrap_or_else(|e| panic!("test configuration is invalid: {e}"))
}

#[tokio::test]
async fn quorum_group_size_on_one_node_and_queues_declared_without_it() {
    let env = TestEnv::new("qgroup");
    let mut raw = env.raw_config("http://127.0.0.1:9");
    let with = settings(&raw);
    assert_eq!(with.amqp.quorum_initial_group_size.map(|n| n.get()), Some(3));
    raw.amqp.quorum_initial_group_size = 0;
    let without = settings(&raw);
    let meta = format!("{}:partitions", env.key_prefix());
    let mut redis = redis_manager().await;
    let conn = Connection::connect(AMQP_URL, ConnectionProperties::default()).await.expect("connect (run scripts/services)");

    // An "older" deployment: every queue declared without x-quorum-initial-group-size.
    prefix_batcher::topology::declare(&conn, &without.amqp, &mut redis, &meta).await.expect("declare without the group size");
    // The broker refuses a redeclare that adds the argument: 406 PRECONDITION_FAILED.
    let ch = conn.create_channel().await.unwrap();
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    let refused = ch
        .queue_declare(env.partition_queue(0).as_str().into(), durable, prefix_batcher::topology::partition_queue_args(&with.amqp))
        .await
        .expect_err("a redeclare adding x-quorum-initial-group-size must be refused");
    assert_eq!(prefix_batcher::amqp::reply_code(&refused), Some(prefix_batcher::amqp::PRECONDITION_FAILED), "{refused}");
    println!("redeclare adding x-quorum-initial-group-size = 3: {refused}");
    // The daemon's declare accepts the existing queues (with a warning).
    prefix_batcher::topology::declare(&conn, &with.amqp, &mut redis, &meta).await.expect("existing queues without the group size are accepted");

    // A queue without x-delivery-limit AND without the group size is accepted too.
    let p0 = env.partition_queue(0);
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(p0.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    let mut bare = FieldTable::default();
    for (k, v) in prefix_batcher::topology::partition_queue_args(&with.amqp).inner().iter() {
        if !["x-delivery-limit", "x-quorum-initial-group-size"].contains(&k.as_str()) {
            bare.insert(k.clone(), v.clone());
        }
    }
    ch.queue_declare(p0.as_str().into(), durable, bare).await.unwrap();
    prefix_batcher::topology::declare_partition(&conn, &with.amqp, 0).await.expect("a queue without both arguments is accepted");
    // Another argument that differs is still a mismatch.
    let mut other = prefix_batcher::topology::partition_queue_args(&with.amqp);
    other.insert(ShortString::from("x-single-active-consumer"), AMQPValue::Boolean(false));
    let ch = conn.create_channel().await.unwrap();
    assert!(ch.queue_declare(p0.as_str().into(), durable, other).await.is_err(), "another argument must still be refused");

    // A new deployment with the group size 3 on this single node: declared (capped at 1 replica).
    let fresh = TestEnv::new("qgroup-new");
    let mut raw3 = fresh.raw_config("http://127.0.0.1:9");
    raw3.amqp.quorum_initial_group_size = 3;
    let s3 = settings(&raw3);
    let meta3 = format!("{}:partitions", fresh.key_prefix());
    prefix_batcher::topology::declare(&conn, &s3.amqp, &mut redis, &meta3).await.expect("size 3 on a single node declares");
    let members = broker::rabbitmqctl(&["list_queues", "--no-table-headers", "name", "members"]).unwrap_or_default();
    let line = members.lines().find(|l| l.starts_with(&fresh.partition_queue(0))).unwrap_or_default().to_owned();
    println!("single node, x-quorum-initial-group-size = 3: {line}");
    // The group size changed after the queues were made (to 1, and to 0: the argument left out):
    // every existing queue is accepted as it is, and the broker still holds the old value.
    for size in [1, 0] {
        let mut changed = fresh.raw_config("http://127.0.0.1:9");
        changed.amqp.quorum_initial_group_size = size;
        let sc = settings(&changed);
        prefix_batcher::topology::declare(&conn, &sc.amqp, &mut redis, &meta3)
            .await
            .unwrap_or_else(|e| panic!("existing queues of group size 3 must be accepted with the key at {size}: {e}"));
    }
    let args = broker::rabbitmqctl(&["list_queues", "--no-table-headers", "name", "arguments"]).unwrap_or_default();
    let p0_args = args.lines().find(|l| l.starts_with(&fresh.partition_queue(0))).unwrap_or_default().to_owned();
    assert!(p0_args.contains("x-quorum-initial-group-size"), "the queue keeps its argument: {p0_args}");
    // Another delivery limit is still refused (amqp.delivery_limit is fixed for a queue's life).
    let mut limit = fresh.raw_config("http://127.0.0.1:9");
    limit.amqp.quorum_initial_group_size = 1;
    limit.amqp.delivery_limit += 1;
    let sl = settings(&limit);
    let refused = prefix_batcher::topology::declare(&conn, &sl.amqp, &mut redis, &meta3).await.expect_err("another delivery limit must be refused");
    assert!(refused.is_config_error() && refused.to_string().contains("amqp.delivery_limit"), "{refused}");
    let _ = conn.close(200, "done".into()).await;
    fresh.cleanup().await;
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// The local cluster (scripts/cluster rabbit).
// ---------------------------------------------------------------------------------------------

/// The 3-node cluster of `scripts/cluster rabbit`.
struct RabbitCluster {
    /// Node names, e.g. `pbc1@localhost`.
    nodes: Vec<String>,
    /// `amqp://guest:guest@127.0.0.1:{port}/%2f` per node.
    urls: Vec<String>,
    /// The file holding each node's beam.smp pid.
    pid_files: Vec<PathBuf>,
    /// Whether this test started it (and so stops it).
    started_here: bool,
}

fn harness(args: &[&str]) -> std::process::Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/cluster");
    Command::new(script).arg("rabbit").args(args).output().expect("run scripts/cluster")
}

impl RabbitCluster {
    /// The running cluster, or a new one (started and stopped by this test).
    fn up() -> RabbitCluster {
        let started_here = !harness(&["status"]).status.success();
        if started_here {
            let t = Instant::now();
            let out = harness(&["start"]);
            assert!(out.status.success(), "scripts/cluster rabbit start failed:\n{}", String::from_utf8_lossy(&out.stderr));
            println!("started the 3-node cluster in {}", secs(t.elapsed()));
        }
        let out = harness(&["env"]);
        assert!(out.status.success(), "scripts/cluster rabbit env failed");
        let vars: HashMap<String, String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
            .collect();
        let list = |k: &str| -> Vec<String> { vars[k].split(',').map(str::to_owned).collect() };
        let c = RabbitCluster {
            nodes: list("CLUSTER_RABBIT_NODES"),
            urls: list("CLUSTER_RABBIT_URLS"),
            pid_files: list("CLUSTER_RABBIT_PID_FILES").into_iter().map(PathBuf::from).collect(),
            started_here,
        };
        assert_eq!(c.nodes.len(), 3, "the harness runs 3 nodes: {:?}", c.nodes);
        c
    }

    /// `rabbitmqctl -q -n NODE args…` on node `i`; its stdout, or `None` when it fails.
    fn ctl(&self, i: usize, args: &[&str]) -> Option<String> {
        let out = Command::new("timeout").args(["60", "rabbitmqctl", "-q", "-n", &self.nodes[i]]).args(args).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The OS pid of node `i`'s VM.
    fn beam_pid(&self, i: usize) -> u32 {
        let pid: u32 = std::fs::read_to_string(&self.pid_files[i]).expect("node pid file").trim().parse().expect("a pid");
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        assert_eq!(comm.trim(), "beam.smp", "pid {pid} of {} is not its VM", self.nodes[i]);
        pid
    }

    /// `kill -9` of node `i`'s VM; returns once the process is gone.
    async fn kill9(&self, i: usize) {
        let pid = self.beam_pid(i);
        assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
        let deadline = Instant::now() + DEADLINE;
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(Instant::now() < deadline, "{} (pid {pid}) did not die", self.nodes[i]);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts every node that is not running (the harness is idempotent): a killed node rejoins.
    async fn restart_missing(&self) {
        let out = tokio::task::spawn_blocking(|| harness(&["start"])).await.unwrap();
        assert!(out.status.success(), "scripts/cluster rabbit start failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }

    /// `rabbitmqctl stop_app` / `start_app` on node `i`.
    async fn app(&self, i: usize, cmd: &'static str) {
        let node = self.nodes[i].clone();
        let ok = tokio::task::spawn_blocking(move || {
            Command::new("timeout").args(["120", "rabbitmqctl", "-q", "-n", &node, cmd]).status().map(|s| s.success()).unwrap_or(false)
        })
        .await
        .unwrap();
        assert!(ok, "rabbitmqctl {cmd} on {} failed", self.nodes[i]);
    }

    /// Leader node of every queue whose name starts with `prefix`, asked of a running node.
    fn leaders(&self, prefix: &str) -> BTreeMap<String, String> {
        let out = (0..self.nodes.len()).find_map(|i| self.ctl(i, &["list_queues", "--no-table-headers", "name", "leader"])).unwrap_or_default();
        out.lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let (q, leader) = (f.next()?, f.next()?);
                q.starts_with(prefix).then(|| (q.to_owned(), leader.to_owned()))
            })
            .collect()
    }

    /// Index of node `name`.
    fn index(&self, name: &str) -> usize {
        self.nodes.iter().position(|n| n == name).unwrap_or_else(|| panic!("unknown node {name}"))
    }

    /// Deletes the queues and exchanges of `env` (on a running node).
    async fn delete_namespace(&self, env: &TestEnv) {
        for url in &self.urls {
            let Ok(conn) = Connection::connect(url, ConnectionProperties::default()).await else { continue };
            let mut queues = vec![env.input_queue(), env.results_queue(), env.dead_letter_queue()];
            queues.extend((0..=P).map(|p| env.partition_queue(p)));
            for q in queues {
                let ch = conn.create_channel().await.unwrap();
                let _ = ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
            }
            for x in [env.shard_exchange(), env.dead_letter_exchange()] {
                let ch = conn.create_channel().await.unwrap();
                let _ = ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default()).await;
            }
            let _ = conn.close(200, "cleanup".into()).await;
            return;
        }
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        if self.started_here {
            let out = harness(&["stop"]);
            if !out.status.success() {
                eprintln!("scripts/cluster rabbit stop failed:\n{}", String::from_utf8_lossy(&out.stderr));
            }
        } else {
            // Leave the cluster as found: every node running.
            let _ = harness(&["start"]);
            for n in &self.nodes {
                let _ = Command::new("timeout").args(["120", "rabbitmqctl", "-q", "-n", n, "start_app"]).output();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Node loss under load.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Loss {
    /// `kill -9` of the node's VM, then a new start of the node.
    Kill,
    /// `rabbitmqctl stop_app`, then `start_app`.
    StopApp,
}

/// The broker node each instance's AMQP connections are on, from its
/// `prefix_batcher_amqp_connected_node{node}` gauge (index in its `amqp.urls`); `None` between
/// sessions or when /metrics does not answer.
async fn connected_node(addr: &str) -> Option<usize> {
    let (status, body) = http_get(addr, "/metrics").await;
    if status != 200 {
        return None;
    }
    body.lines().find_map(|l| {
        let rest = l.strip_prefix("prefix_batcher_amqp_connected_node{node=\"")?;
        let (node, value) = rest.split_once("\"} ")?;
        (value.trim() == "1").then(|| node.parse().ok()).flatten()
    })
}

/// Broker channels and consumers of the deployment `env`, per instance (by connection name), as
/// `rabbitmqctl list_connections` / `list_consumers` report them on node `i`.
///
/// The test's own consumer (on the results queue) is left out.
fn broker_usage(c: &RabbitCluster, i: usize, env: &TestEnv) -> String {
    let conns = c.ctl(i, &["list_connections", "--no-table-headers", "name", "channels", "client_properties"]).unwrap_or_default();
    let tag = format!("\"connection_name\",\"prefix-batcher {}", env.name);
    let mut rows = Vec::new();
    let mut channels = 0u64;
    for l in conns.lines().filter(|l| l.contains(&tag)) {
        let mut f = l.split('\t');
        let (addr, ch, props) = (f.next().unwrap_or_default(), f.next().unwrap_or_default(), f.next().unwrap_or_default());
        let name = props.split(&tag[..tag.len() - env.name.len()]).nth(1).and_then(|r| r.split('"').next()).unwrap_or_default();
        channels += ch.trim().parse::<u64>().unwrap_or(0);
        rows.push(format!("{name:<48} {ch:>3} channels  ({addr})"));
    }
    rows.sort();
    let consumers = c.ctl(i, &["list_consumers", "--no-table-headers", "queue_name"]).unwrap_or_default();
    let consumers: Vec<&str> = consumers.lines().filter(|l| l.starts_with(&env.name) && !l.starts_with(&env.results_queue())).collect();
    let on_input = consumers.iter().filter(|q| q.starts_with(&env.input_queue())).count();
    format!(
        "{} connections, {channels} channels, {} consumers ({on_input} on the input queue, {} on partition queues) for 3 instances and {P} partitions:\n  {}",
        rows.len(),
        consumers.len(),
        consumers.len() - on_input,
        rows.join("\n  ")
    )
}

/// Waits until every id in `ids` has a result, at most `within`; returns the ids still without
/// one.
async fn wait_results(log: &ResultLog, ids: &HashSet<String>, within: Duration) -> Vec<String> {
    let deadline = Instant::now() + within;
    loop {
        let have = log.distinct();
        let missing: Vec<String> = ids.iter().filter(|i| !have.contains(*i)).cloned().collect();
        if missing.is_empty() || Instant::now() >= deadline {
            return missing;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What one run measured.
struct Report {
    loss: Loss,
    node: String,
    leaders_on_node: usize,
    /// Requests confirmed by the broker before the disruption.
    published_before: usize,
    reconnected: Duration,
    node_back: Duration,
    /// From the disruption until every request published before it had a result.
    backlog_done: Duration,
    /// From the disruption until every result was in.
    all_done: Duration,
    /// From the last publish until every result was in.
    tail: Duration,
    /// The longest time without any result, around the disruption.
    longest_gap: Duration,
    lost: usize,
    duplicates: usize,
    failed: usize,
    usage: String,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} of {} (leader of {}/{} partition queues and holding every instance's connections), {} of {N} requests published before it:\n  \
             lost {}, duplicates {}, failed {}\n  \
             every instance on another node after {}; node back after {}\n  \
             requests published before the loss all answered after {}; longest pause in results {}\n  \
             full recovery (all {N} results in) {} after the loss, {} after the last publish",
            self.loss,
            self.node,
            self.leaders_on_node,
            P,
            self.published_before,
            self.lost,
            self.duplicates,
            self.failed,
            secs(self.reconnected),
            secs(self.node_back),
            secs(self.backlog_done),
            secs(self.longest_gap),
            secs(self.all_done),
            secs(self.tail),
        )
    }
}

async fn node_loss(c: &RabbitCluster, loss: Loss, tag: &str) -> Report {
    let env = TestEnv::new(tag);
    let fake = FakeLlm::new().latency(Duration::from_millis(30)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.partitions = P;
    raw.amqp.urls = c.urls.clone();
    // Every request's route and result in the logs, to follow one that goes missing.
    raw.log.level = "info,prefix_batcher::router=debug,prefix_batcher::publisher=debug".into();

    // The topology first (leaders placed by the nodes' queue_leader_locator = balanced), to pick
    // the node leading the most partition queues.
    let s = settings(&raw);
    let (conn, _) = prefix_batcher::amqp::connect(&s.amqp, ConnectionProperties::default()).await.expect("connect to the cluster");
    let meta = format!("{}:partitions", env.key_prefix());
    prefix_batcher::topology::declare(&conn, &s.amqp, &mut redis_manager().await, &meta).await.expect("declare the topology");
    let _ = conn.close(200, "declared".into()).await;
    let leaders = c.leaders(&env.partition_queue_prefix());
    assert_eq!(leaders.len(), P as usize, "a leader per partition queue: {leaders:?}");
    let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
    for l in leaders.values() {
        *per_node.entry(l.as_str()).or_default() += 1;
    }
    println!("{tag}: partition queue leaders per node: {per_node:?}");
    let (target_name, leaders_on_node) = per_node.iter().max_by_key(|(n, k)| (**k, std::cmp::Reverse(**n))).map(|(n, k)| (n.to_string(), *k)).unwrap();
    let target = c.index(&target_name);
    // Every instance connects to the target first; the test itself uses the node after next.
    raw.amqp.urls = (0..3).map(|k| c.urls[(target + k) % 3].clone()).collect();
    let survivor = c.urls[(target + 2) % 3].clone();

    let mut redis = RedisProbe::connect().await.unwrap();
    let (mut cluster, _, took) = Cluster::start_settled(&env, raw, &["a", "b", "c"], &mut redis).await;
    println!("{tag}: 3 instances settled in {}", secs(took));
    let mut addrs = Vec::new();
    for s in ["a", "b", "c"] {
        addrs.push(cluster.proc(s).http_addr().await);
    }
    for a in &addrs {
        assert_eq!(connected_node(a).await, Some(0), "every instance starts on its first node ({target_name})");
    }

    let t0 = Instant::now();
    let log = ResultLog::start_at(&survivor, &env.results_queue());
    let reqs = completions_workload(tag, N, 24);
    let publisher = PacedPublisher::start_at(survivor.clone(), env.input_queue(), reqs.clone(), RATE, None);
    publisher.wait_published(N / 3, DEADLINE).await;
    let usage = broker_usage(c, (target + 2) % 3, &env);

    // The disruption.
    let published_before = publisher.published();
    let t_loss = Instant::now();
    match loss {
        Loss::Kill => c.kill9(target).await,
        Loss::StopApp => c.app(target, "stop_app").await,
    }
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut moved = 0;
        for a in &addrs {
            if connected_node(a).await.is_some_and(|n| n != 0) {
                moved += 1;
            }
        }
        if moved == addrs.len() {
            break;
        }
        assert!(Instant::now() < deadline, "{moved} of 3 instances reconnected to another node within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reconnected = t_loss.elapsed();
    // `status` shows the lost node as unreachable (index 0 of the instances' amqp.urls).
    let table = cluster.status(false).await;
    let nodes: Vec<&str> = table.lines().skip_while(|l| !l.starts_with("RabbitMQ nodes")).take(4).collect();
    println!("{tag}: prefix-batcher status after the loss:\n{}", nodes.join("\n"));
    assert!(nodes.get(1).is_some_and(|l| l.contains("UNREACHABLE")), "status must show node 0 unreachable:\n{table}");
    assert!(nodes.get(2).is_some_and(|l| l.contains("reachable (queue depths read here)")), "status reads from node 1:\n{table}");
    // The node comes back while the results flow (a restart takes a while on 2 cores).
    let back = async {
        match loss {
            Loss::Kill => c.restart_missing().await,
            Loss::StopApp => c.app(target, "start_app").await,
        }
        t_loss.elapsed()
    };
    let before: HashSet<String> = reqs[..published_before].iter().map(|r| r.id.clone()).collect();
    let backlog = async {
        wait_results(&log, &before, Duration::from_secs(90)).await;
        t_loss.elapsed()
    };
    let (node_back, backlog_done) = tokio::join!(back, backlog);
    publisher.finish(Duration::from_secs(120)).await;
    let t_published = Instant::now();
    let missing = wait_results(&log, &ids(&reqs), Duration::from_secs(90)).await;
    let (all_done, tail) = (t_loss.elapsed(), t_published.elapsed());
    if !missing.is_empty() {
        // Where are they? Queue counts of the deployment on the cluster, before anything stops.
        let q = c.ctl((target + 2) % 3, &["list_queues", "--no-table-headers", "name", "messages_ready", "messages_unacknowledged", "consumers", "leader"]);
        let q: Vec<String> = q.unwrap_or_default().lines().filter(|l| l.starts_with(&env.name)).map(str::to_owned).collect();
        println!("{tag}: {} requests without a result, e.g. {:?}; the deployment's queues (name, ready, unacked, consumers, leader):\n  {}", missing.len(), &missing[..missing.len().min(10)], q.join("\n  "));
        for s in ["a", "b", "c"] {
            let log = cluster.proc(s).log();
            for id in &missing {
                for l in log.lines().filter(|l| l.contains(&format!("{id} ")) || l.contains(&format!("{id}\""))) {
                    println!("  {s}: {l}");
                }
            }
        }
    }
    cluster.assert_running(&["a", "b", "c"]);

    cluster.stop_all(DEADLINE).await;
    log.barrier().await;
    let results = log.stop().await;
    let t = tally(&reqs, &results);
    let mut times: Vec<Instant> = results.iter().map(|o| o.at).filter(|at| *at >= t0).collect();
    times.sort();
    let longest_gap = times.windows(2).filter(|w| w[1] >= t_loss).map(|w| w[1] - w[0].max(t_loss)).max().unwrap_or_default();
    c.delete_namespace(&env).await;
    if t.lost.is_empty() {
        env.cleanup().await;
    } else {
        // Dropped uncleaned: Redis keys are deleted, the daemons' logs are kept (path printed).
        drop(env);
    }
    Report {
        loss,
        node: target_name,
        leaders_on_node,
        published_before,
        reconnected,
        node_back,
        backlog_done,
        all_done,
        tail,
        longest_gap,
        lost: t.lost.len(),
        duplicates: t.duplicates(),
        failed: t.failed,
        usage,
    }
}

/// Node loss under load, twice: kill -9 (then restart) and a graceful `stop_app` (then
/// `start_app`) of the node that leads the most partition queues and holds every instance's
/// connections. Nothing may be lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy: a private 3-node RabbitMQ cluster and 3 daemon processes, about 3 minutes (scripts/test heavy stage)"]
async fn node_loss_under_load() {
    let started = Instant::now();
    let c = RabbitCluster::up();
    let mut reports = Vec::new();
    for (loss, tag) in [(Loss::Kill, "rmq-kill"), (Loss::StopApp, "rmq-stop")] {
        let t = Instant::now();
        let r = node_loss(&c, loss, tag).await;
        println!("\n{r}\n  (run took {})\nbroker usage: {}\n", secs(t.elapsed()), r.usage);
        reports.push(r);
    }
    drop(c);
    println!("node_loss_under_load: {} in all", secs(started.elapsed()));
    for r in &reports {
        assert_eq!(r.lost, 0, "{:?}: {} requests lost", r.loss, r.lost);
    }
}
