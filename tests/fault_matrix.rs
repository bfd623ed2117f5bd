//! The fault matrix: the main job (2 daemons in this process, ~300 requests at 15/s, the real
//! RabbitMQ, a private redis-server, the fake LLM) while one fault happens, for each fault in turn.
//! Prints one table row per fault:
//!
//! `fault | requests | ok | ok:false | lost | duplicates | recovery s | unacked | left | dead | pass | note`
//!
//! A fault passes with 0 lost, 0 `ok: false` (every fault here is a server-side one), no message
//! unacked in the deployment's input and partition queues once the results are in (`unacked`,
//! daemons running) and none left there after the daemons stopped (`left`); `dead` counts the
//! dead-letter queue's messages (where a lost request may have gone). Recovery is the time
//! from the fault's end to the last result of the requests published before it ended.
//!
//! Faults (`PREFIX_BATCHER_FAULTS=name,name,…` selects; default all):
//! - `llm_refused`: the LLM refuses connections for 14 s.
//! - `llm_503`, `llm_401`: the LLM answers 503 / 401 to everything for 14 s.
//!
//!   The three LLM faults and `redis_paused` run with `amqp.delivery_limit = 1`: an outage must
//!   charge no request a delivery, so a single charged delivery would dead-letter a request and
//!   fail the row.
//! - `reply_queue_rejects`: every request names a reply queue that holds 1 message and rejects
//!   the rest (`x-max-length = 1`, `x-overflow = reject-publish`, not consumed); results it rejects
//!   must reach the results queue. The one it holds counts as delivered.
//! - `memory_alarm`: the broker's memory watermark set to 0.0001 for 20 s (blocks every publisher
//!   on the broker: run it alone), then restored to its previous value.
//! - `redis_paused`: the daemons' redis-server sleeps 5 s (`DEBUG SLEEP`), longer than the renew
//!   deadline (2 s): every partition is aborted, and puts the requests it held back uncharged.
//! - `partition_queue_deleted`: an empty partition queue is deleted mid-run; requests routed to it
//!   afterwards must still be answered (the queue is declared again).
//!
//! `#[ignore]`d: run by the heavy stage of `scripts/test`:
//! `cargo test --test fault_matrix -- --ignored --nocapture --test-threads=1`.

mod common;

use std::collections::HashSet;
use std::num::NonZeroU32;
use std::time::Duration;

use common::cluster::{tally, Observed, PacedPublisher, ResultLog};
use common::*;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use llm_fakes::fake::{FakeLlm, FakeLlmHandle};
use prefix_batcher::keying::{partition_of, PrefixKey};
use prefix_batcher::request::RequestResult;
use tokio::time::Instant;

const FAULTS_ENV: &str = "PREFIX_BATCHER_FAULTS";
const REQUESTS: usize = 300;
const RATE: u32 = 15;
/// Requests published before a fault starts.
const BEFORE_FAULT: usize = 50;
/// Groups (prefix keys) of the workload.
const GROUPS: usize = 6;
/// How long after the fault's end every result must be in.
const RECOVERY_DEADLINE: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    LlmRefused,
    Llm503,
    Llm401,
    ReplyQueueRejects,
    MemoryAlarm,
    RedisPaused,
    PartitionQueueDeleted,
}

const ALL: [Fault; 7] = [
    Fault::LlmRefused,
    Fault::Llm503,
    Fault::Llm401,
    Fault::ReplyQueueRejects,
    Fault::MemoryAlarm,
    Fault::RedisPaused,
    Fault::PartitionQueueDeleted,
];

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::LlmRefused => "llm_refused",
            Fault::Llm503 => "llm_503",
            Fault::Llm401 => "llm_401",
            Fault::ReplyQueueRejects => "reply_queue_rejects",
            Fault::MemoryAlarm => "memory_alarm",
            Fault::RedisPaused => "redis_paused",
            Fault::PartitionQueueDeleted => "partition_queue_deleted",
        }
    }
}

/// The faults named in [`FAULTS_ENV`] (all when unset); panics on an unknown name.
fn selected() -> Vec<Fault> {
    let Ok(list) = std::env::var(FAULTS_ENV) else { return ALL.to_vec() };
    list.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            let known: Vec<&str> = ALL.iter().map(|f| f.name()).collect();
            *ALL.iter().find(|f| f.name() == n).unwrap_or_else(|| panic!("{FAULTS_ENV}: unknown fault {n:?}; known: {known:?}"))
        })
        .collect()
}

/// One row of the table.
#[derive(Debug)]
struct Row {
    fault: &'static str,
    requests: usize,
    ok: usize,
    failed: usize,
    lost: usize,
    duplicates: usize,
    /// Unacked messages once the results are in (daemons running).
    unacked: u64,
    /// Messages ready or unacked after the daemons stopped.
    left: u64,
    /// Messages in the dead-letter queue at the end (a lost request may be there).
    dead_lettered: u64,
    /// Fault end → last result; `None` when the fault has no end (the whole run).
    recovery: Option<Duration>,
    note: String,
}

impl Row {
    fn passed(&self) -> bool {
        self.lost == 0 && self.failed == 0 && self.unacked == 0 && self.left == 0
    }
}

fn render(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<24} | {:>8} | {:>5} | {:>8} | {:>4} | {:>10} | {:>10} | {:>7} | {:>4} | {:>4} | {:<4} | note\n",
        "fault", "requests", "ok", "ok:false", "lost", "duplicates", "recovery s", "unacked", "left", "dead", "pass"
    );
    for r in rows {
        let recovery = r.recovery.map_or("-".to_owned(), |d| format!("{:.1}", d.as_secs_f64()));
        out.push_str(&format!(
            "{:<24} | {:>8} | {:>5} | {:>8} | {:>4} | {:>10} | {:>10} | {:>7} | {:>4} | {:>4} | {:<4} | {}\n",
            r.fault,
            r.requests,
            r.ok,
            r.failed,
            r.lost,
            r.duplicates,
            recovery,
            r.unacked,
            r.left,
            r.dead_lettered,
            if r.passed() { "yes" } else { "NO" },
            r.note
        ));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy (about a minute per fault; memory_alarm blocks every publisher on the broker): run by the heavy stage of scripts/test"]
async fn fault_matrix() {
    let faults = selected();
    let mut rows = Vec::new();
    for f in faults {
        eprintln!("fault matrix: {} …", f.name());
        let row = run_fault(f).await;
        eprintln!("{}", render(std::slice::from_ref(&row)));
        rows.push(row);
    }
    println!("\nfault matrix ({REQUESTS} requests at {RATE}/s per fault, 2 daemons)\n{}", render(&rows));
    let failed: Vec<&str> = rows.iter().filter(|r| !r.passed()).map(|r| r.fault).collect();
    assert!(failed.is_empty(), "faults that lost requests, failed requests or left messages behind: {failed:?}");
}

/// The deployment of one fault's run.
struct Deployment {
    // Dropped in this order when a test panics: the daemons stop before the namespace's cleanup
    // (a running daemon declares a deleted partition queue again).
    daemons: Vec<Daemon>,
    fake: FakeLlmHandle,
    redis: RedisServer,
    env: TestEnv,
}

/// Two daemons (`a`, `b`) on a private redis-server, static prefix keys with one shard per key
/// (so a key maps to exactly one partition), both holding leases before anything is published.
async fn deploy(fault: Fault) -> Deployment {
    let env = TestEnv::new(&format!("fm-{}", fault.name().replace('_', "-")));
    let redis = RedisServer::start(&env, "redis").await;
    let fake = FakeLlm::new().latency(Duration::from_millis(20)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.redis.url = redis.url.clone();
    raw.keying.mode = "prefix".into();
    raw.sharding.default_shards = 1;
    if matches!(fault, Fault::LlmRefused | Fault::Llm503 | Fault::Llm401 | Fault::RedisPaused) {
        raw.amqp.delivery_limit = 1;
    }
    let mut daemons = Vec::new();
    for suffix in ["a", "b"] {
        let mut r = raw.clone();
        r.instance.name = env.instance(suffix);
        daemons.push(start_daemon(&r));
    }
    let mut probe = RedisProbe { conn: redis.connect().await.unwrap() };
    probe
        .wait_leases(env.key_prefix(), PARTITIONS, "every partition held", DEADLINE, |ls| ls.iter().all(Option::is_some))
        .await;
    Deployment { env, redis, fake, daemons }
}

/// The partition of group `g`'s requests (one shard per key).
fn partition_of_group(g: usize) -> u32 {
    partition_of(PrefixKey::of(&group_prefix(g)), 0, NonZeroU32::new(PARTITIONS).unwrap())
}

/// The workload: [`REQUESTS`] requests over [`GROUPS`] groups. With `late_group`, every third
/// request of the second half belongs to that group instead (it lands on a partition no earlier
/// request used).
fn workload(tag: &str, late_group: Option<usize>) -> Vec<TestRequest> {
    (0..REQUESTS)
        .map(|i| {
            let g = match late_group {
                Some(late) if i >= REQUESTS / 2 && i % 3 == 0 => late,
                _ => i % GROUPS,
            };
            completion(&format!("{tag}-{i}"), g, &format!(" question {i}?"))
        })
        .collect()
}

/// A group whose partition no group of the base workload uses, and that partition.
fn unused_partition_group() -> (usize, u32) {
    let used: HashSet<u32> = (0..GROUPS).map(partition_of_group).collect();
    (GROUPS..10_000)
        .map(|g| (g, partition_of_group(g)))
        .find(|(_, p)| !used.contains(p))
        .expect("some partition is unused by the base workload")
}

/// What a run measured besides the results.
struct Measured {
    /// When the fault ended (`None`: it lasted the whole run).
    fault_end: Option<Instant>,
    /// Requests published when the fault ended (the first ones of the workload).
    published_by_end: usize,
    /// Unacked messages in the input and partition queues once the results are in, daemons running.
    unacked: u64,
    /// Messages ready or unacked in those queues after the daemons stopped.
    left: u64,
    /// Messages in the dead-letter queue after the daemons stopped.
    dead_lettered: u64,
    /// Ids whose result is in the (rejecting) reply queue.
    held_by_reply: HashSet<String>,
    note: String,
}

async fn run_fault(fault: Fault) -> Row {
    let mut d = deploy(fault).await;
    let late = (fault == Fault::PartitionQueueDeleted).then(unused_partition_group);
    let reqs = workload(fault.name(), late.map(|(g, _)| g));
    let reply = match fault {
        Fault::ReplyQueueRejects => Some(declare_rejecting_reply_queue(&d.env).await),
        _ => None,
    };
    let log = ResultLog::start(&d.env.results_queue());
    let publisher = PacedPublisher::start_replying(d.env.input_queue(), reqs.clone(), RATE, reply.clone());
    publisher.wait_published(BEFORE_FAULT, DEADLINE).await;
    let (fault_end, note) = inject(fault, &d, late.map(|(_, p)| p)).await;
    let published_by_end = if fault_end.is_some() { publisher.published() } else { reqs.len() };
    publisher.finish(DEADLINE * 2).await;

    let held_by_reply = wait_results(&log, &ids(&reqs), reply.as_deref()).await;
    let unacked = queue_messages(&d.env, |_, unacked| unacked).await;
    for daemon in d.daemons.drain(..) {
        if let Err(e) = daemon.stop().await {
            eprintln!("a daemon stopped with an error: {e}");
        }
    }
    log.barrier().await;
    let results = log.stop().await;
    let left = queue_messages(&d.env, |ready, unacked| ready + unacked).await;
    let dead_lettered = broker::queues(&d.env.dead_letter_queue()).iter().map(|(_, ready, unacked)| ready + unacked).sum();
    if let Some(q) = &reply {
        delete_queue(q).await;
    }
    let m = Measured { fault_end, published_by_end, unacked, left, dead_lettered, held_by_reply, note };
    let row = row(fault, &reqs, &results, m);
    drop(d.fake);
    drop(d.redis);
    d.env.cleanup().await;
    row
}

/// Waits (≤ [`RECOVERY_DEADLINE`]) until every id has a result in the results queue or in the
/// reply queue `reply`; returns the ids found in the reply queue.
async fn wait_results(log: &ResultLog, all: &HashSet<String>, reply: Option<&str>) -> HashSet<String> {
    let mut held_by_reply = HashSet::new();
    let deadline = Instant::now() + RECOVERY_DEADLINE;
    while Instant::now() < deadline && log.distinct().len() + held_by_reply.len() < all.len() {
        if let Some(q) = reply {
            held_by_reply.extend(reply_queue_ids(q).await);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    held_by_reply
}

fn row(fault: Fault, reqs: &[TestRequest], results: &[Observed], m: Measured) -> Row {
    let t = tally(reqs, results);
    let lost = t.lost.iter().filter(|id| !m.held_by_reply.contains(*id)).count();
    // Recovery: fault end → the last result of a request published before the fault ended.
    let before_end: HashSet<&str> = reqs[..m.published_by_end].iter().map(|r| r.id.as_str()).collect();
    let last = results.iter().filter(|o| before_end.contains(o.id.as_str())).map(|o| o.at).max();
    let recovery = m.fault_end.map(|end| last.map_or(Duration::ZERO, |l| l.saturating_duration_since(end)));
    Row {
        fault: fault.name(),
        requests: reqs.len(),
        ok: results.iter().filter(|o| o.ok).count() + m.held_by_reply.len(),
        failed: t.failed,
        lost,
        duplicates: t.duplicates(),
        unacked: m.unacked,
        left: m.left,
        dead_lettered: m.dead_lettered,
        recovery,
        note: m.note,
    }
}

/// Injects `fault` and ends it; returns when it ended (`None`: it lasts the whole run) and a note.
async fn inject(fault: Fault, d: &Deployment, empty_partition: Option<u32>) -> (Option<Instant>, String) {
    const LLM_FAULT: Duration = Duration::from_secs(14);
    match fault {
        Fault::LlmRefused => {
            d.fake.set_refuse(true).await;
            tokio::time::sleep(LLM_FAULT).await;
            d.fake.set_refuse(false).await;
            (Some(Instant::now()), String::new())
        }
        Fault::Llm503 | Fault::Llm401 => {
            d.fake.set_status(Some(if fault == Fault::Llm503 { 503 } else { 401 }));
            tokio::time::sleep(LLM_FAULT).await;
            d.fake.set_status(None);
            (Some(Instant::now()), String::new())
        }
        Fault::ReplyQueueRejects => (None, "results the reply queue rejects count when they reach the results queue".into()),
        Fault::MemoryAlarm => memory_alarm(Duration::from_secs(20)).await,
        Fault::RedisPaused => {
            let paused = d.redis.pause(5.0).await;
            paused.await.expect("DEBUG SLEEP task");
            (Some(Instant::now()), String::new())
        }
        Fault::PartitionQueueDeleted => {
            let p = empty_partition.expect("an unused partition");
            delete_partition_queue(d, p).await
        }
    }
}

/// Deletes partition queue `p` (empty: no request published so far maps to it), waits until it
/// is declared again (≤ 30 s); its requests come later in the workload.
async fn delete_partition_queue(d: &Deployment, p: u32) -> (Option<Instant>, String) {
    let queue = d.env.partition_queue(p);
    let before = broker::queues(&queue);
    assert!(broker::delete_queue(&queue), "rabbitmqctl delete_queue {queue}");
    let deleted = Instant::now();
    let deadline = deleted + Duration::from_secs(30);
    while broker::queues(&queue).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let note = match broker::queues(&queue).first() {
        Some(_) => format!("{queue} (held {before:?}) declared again after {:.1} s", deleted.elapsed().as_secs_f64()),
        None => format!("{queue} (held {before:?}) NOT declared again within 30 s"),
    };
    (Some(Instant::now()), note)
}

/// Sets the broker's memory watermark to 0.0001 for `length`, then restores the previous value
/// (also when this panics: [`WatermarkGuard`]).
async fn memory_alarm(length: Duration) -> (Option<Instant>, String) {
    let guard = WatermarkGuard::set("0.0001");
    tokio::time::sleep(length).await;
    let previous = guard.previous.join(" ");
    drop(guard);
    (Some(Instant::now()), format!("watermark restored to {previous}"))
}

/// Restores the broker's previous `vm_memory_high_watermark` when dropped.
struct WatermarkGuard {
    /// Arguments of `rabbitmqctl set_vm_memory_high_watermark` that restore it.
    previous: Vec<String>,
}

impl WatermarkGuard {
    fn set(fraction: &str) -> WatermarkGuard {
        let env = broker::rabbitmqctl(&["environment"]).expect("rabbitmqctl environment");
        let previous = parse_watermark(&env).unwrap_or_else(|| vec!["0.4".to_owned()]);
        assert!(broker::rabbitmqctl(&["set_vm_memory_high_watermark", fraction]).is_some(), "set the watermark");
        WatermarkGuard { previous }
    }
}

impl Drop for WatermarkGuard {
    fn drop(&mut self) {
        let mut args = vec!["set_vm_memory_high_watermark"];
        args.extend(self.previous.iter().map(String::as_str));
        if broker::rabbitmqctl(&args).is_none() {
            eprintln!("COULD NOT RESTORE the memory watermark: run rabbitmqctl {}", args.join(" "));
        }
    }
}

/// The watermark in `rabbitmqctl environment` output: `{vm_memory_high_watermark,0.4}` gives
/// `["0.4"]`, `{vm_memory_high_watermark,{absolute,1073741824}}` gives `["absolute", "1073741824"]`.
fn parse_watermark(environment: &str) -> Option<Vec<String>> {
    let rest = &environment[environment.find("{vm_memory_high_watermark,")? + "{vm_memory_high_watermark,".len()..];
    let value: String = rest.chars().take_while(|c| *c != '}').collect();
    let value = value.trim();
    match value.strip_prefix("{absolute,") {
        Some(n) => Some(vec!["absolute".to_owned(), n.trim().trim_matches('"').to_owned()]),
        None => value.parse::<f64>().ok().map(|_| vec![value.to_owned()]),
    }
}

#[test]
fn watermark_values_parse() {
    let env = "[{rabbit,[{vm_memory_calculation_strategy,rss},\n {vm_memory_high_watermark,0.4},\n {x,1}]}]";
    assert_eq!(parse_watermark(env), Some(vec!["0.4".to_owned()]));
    let abs = "{vm_memory_high_watermark,{absolute,1073741824}}";
    assert_eq!(parse_watermark(abs), Some(vec!["absolute".to_owned(), "1073741824".to_owned()]));
    assert_eq!(parse_watermark("nothing"), None);
}

/// Declares `{env.name}.reply`: holds one message, rejects further publishes, not consumed.
async fn declare_rejecting_reply_queue(env: &TestEnv) -> String {
    let name = format!("{}.reply", env.name);
    let amqp = Amqp::connect().await;
    let mut args = FieldTable::default();
    args.insert(ShortString::from("x-max-length"), AMQPValue::LongLongInt(1));
    args.insert(ShortString::from("x-overflow"), AMQPValue::LongString("reject-publish".into()));
    amqp.ch.queue_declare(name.as_str().into(), QueueDeclareOptions::default(), args).await.expect("declare the reply queue");
    amqp.close().await;
    name
}

/// Ids of the results waiting in reply queue `queue` (read with basic.get, left there).
async fn reply_queue_ids(queue: &str) -> HashSet<String> {
    let amqp = Amqp::connect().await;
    let mut out = HashSet::new();
    let got = amqp.ch.basic_get(queue.into(), BasicGetOptions { no_ack: false }).await.expect("basic.get");
    if let Some(m) = got {
        let r: RequestResult = serde_json::from_slice(&m.delivery.data).expect("a result in the reply queue");
        out.insert(r.id);
    }
    amqp.close().await; // closing the channel requeues what was not acked
    out
}

async fn delete_queue(queue: &str) {
    let amqp = Amqp::connect().await;
    let _ = amqp.ch.queue_delete(queue.into(), Default::default()).await;
    amqp.close().await;
}

/// `count(ready, unacked)` summed over the input and partition queues, polled until 0 for
/// ≤ 30 s (the broker's queue statistics lag by up to its collection interval, 5 s by default).
async fn queue_messages(env: &TestEnv, count: impl Fn(u64, u64) -> u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut qs = broker::queues(&env.input_queue());
        qs.extend(broker::queues(&env.partition_queue_prefix()));
        let n: u64 = qs.iter().map(|(_, ready, unacked)| count(*ready, *unacked)).sum();
        if n == 0 || Instant::now() >= deadline {
            if n > 0 {
                eprintln!("(name, ready, unacked): {:?}", qs.iter().filter(|q| count(q.1, q.2) > 0).collect::<Vec<_>>());
            }
            return n;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
