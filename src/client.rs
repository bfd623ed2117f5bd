//! The client commands: `submit` (publish JSONL requests and optionally wait for their results)
//! and `status` (members, partition owners and epochs, backlog).

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde::Serialize;
use serde_json::Value;
use tokio::io::AsyncBufReadExt;

use crate::config::Settings;
use crate::lease::{read_all, LeaseValue};
use crate::ownership::{desired_partitions, read_members};
use crate::request::RequestResult;

/// Options of `submit`.
#[derive(Debug, Clone)]
pub struct SubmitOptions {
    /// JSONL input; `None` reads stdin.
    pub input: Option<std::path::PathBuf>,
    /// Queue to publish to; defaults to `amqp.input_queue`.
    pub queue: Option<String>,
    /// Wait for one result per request.
    pub wait: bool,
    /// Where results go (JSONL); `None` writes stdout.
    pub out: Option<std::path::PathBuf>,
    /// How long to wait for results in total.
    pub timeout: Duration,
}

/// What `submit` did. Printed as one JSON line on stderr.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SubmitSummary {
    /// Requests published and confirmed.
    pub requests: usize,
    /// Distinct requests that got a result.
    pub results: usize,
    pub ok: usize,
    pub failed: usize,
    /// Extra results for a request that already had one (at-least-once redelivery).
    pub duplicates: usize,
    /// Requests without a result when the wait ended.
    pub missing: usize,
    /// From the first publish to the last result (or to the last confirm without `--wait`).
    pub wall_s: f64,
    /// Sums over results that carry per-request usage.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// Publishes every line of the input as one request (lines that are blank are skipped). Each
/// request gets `message_id` and `correlation_id` = its `id` (or a generated UUID when the line has
/// none), `timestamp` = now, and `reply_to` = an exclusive reply queue when waiting.
///
/// Errors: connection failures, unreadable input, a publish the broker refuses.
pub async fn submit(settings: &Settings, opts: &SubmitOptions) -> anyhow::Result<SubmitSummary> {
    let conn = Connection::connect(settings.amqp.url.expose(), ConnectionProperties::default())
        .await
        .with_context(|| format!("connecting to {}", settings.amqp.url))?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let queue = opts.queue.clone().unwrap_or_else(|| settings.amqp.input_queue.clone());

    let reply_queue = if opts.wait {
        let q = ch
            .queue_declare("".into(), QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() }, FieldTable::default())
            .await?;
        Some(q.name().to_string())
    } else {
        None
    };
    let mut consumer = match &reply_queue {
        Some(q) => Some(ch.basic_consume(q.as_str().into(), "submit".into(), BasicConsumeOptions::default(), FieldTable::default()).await?),
        None => None,
    };

    let reader: Box<dyn tokio::io::AsyncBufRead + Unpin + Send> = match &opts.input {
        Some(p) => Box::new(tokio::io::BufReader::new(
            tokio::fs::File::open(p).await.with_context(|| format!("opening {}", p.display()))?,
        )),
        None => Box::new(tokio::io::BufReader::new(tokio::io::stdin())),
    };
    let mut lines = reader.lines();
    let started = Instant::now();
    let mut ids = HashSet::new();
    let mut confirms = Vec::new();
    while let Some(line) = lines.next_line().await? {
        if line.trim().is_empty() {
            continue;
        }
        let id = match serde_json::from_str::<Value>(&line) {
            Ok(Value::Object(o)) => o.get("id").and_then(|v| v.as_str().map(str::to_owned).or_else(|| v.as_u64().map(|n| n.to_string()))),
            _ => None,
        }
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        if !ids.insert(id.clone()) {
            bail!("duplicate request id {id:?} in the input");
        }
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let mut props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(crate::publisher::PERSISTENT)
            .with_message_id(id.as_str().into())
            .with_correlation_id(id.as_str().into())
            .with_timestamp(now);
        if let Some(q) = &reply_queue {
            props = props.with_reply_to(q.as_str().into());
        }
        let confirm = ch
            .basic_publish("".into(), queue.as_str().into(), BasicPublishOptions { mandatory: true, ..Default::default() }, line.as_bytes(), props)
            .await?;
        confirms.push(confirm);
        // Bound the confirms in flight.
        if confirms.len() >= 1000 {
            for c in confirms.drain(..) {
                check_confirm(c.await?, &queue)?;
            }
        }
    }
    for c in confirms.drain(..) {
        check_confirm(c.await?, &queue)?;
    }
    let mut summary = SubmitSummary { requests: ids.len(), ..Default::default() };
    eprintln!("submit: published {} requests to {queue}", ids.len());

    if let Some(consumer) = consumer.as_mut() {
        let mut out: Box<dyn Write + Send> = match &opts.out {
            Some(p) => Box::new(std::io::BufWriter::new(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)),
            None => Box::new(std::io::BufWriter::new(std::io::stdout())),
        };
        let mut seen = HashSet::new();
        let deadline = tokio::time::Instant::now() + opts.timeout;
        let mut last_progress = Instant::now();
        while seen.len() < ids.len() {
            let next = tokio::time::timeout_at(deadline, consumer.next()).await;
            let delivery = match next {
                Ok(Some(Ok(d))) => d,
                Ok(Some(Err(e))) => return Err(e.into()),
                Ok(None) => bail!("reply consumer closed"),
                Err(_) => break,
            };
            delivery.acker.ack(BasicAckOptions::default()).await?;
            let key = delivery
                .properties
                .correlation_id()
                .as_ref()
                .map(|c| c.to_string())
                .unwrap_or_default();
            if !ids.contains(&key) {
                continue;
            }
            if !seen.insert(key) {
                summary.duplicates += 1;
                continue;
            }
            out.write_all(&delivery.data)?;
            out.write_all(b"\n")?;
            if let Ok(r) = serde_json::from_slice::<RequestResult>(&delivery.data) {
                if r.ok {
                    summary.ok += 1;
                } else {
                    summary.failed += 1;
                }
                if let Some(u) = r.usage {
                    summary.prompt_tokens += u.prompt_tokens;
                    summary.cached_tokens += u.cached_tokens.unwrap_or(0);
                }
            }
            if last_progress.elapsed() >= Duration::from_secs(10) {
                last_progress = Instant::now();
                eprintln!("submit: {}/{} results", seen.len(), ids.len());
            }
        }
        out.flush()?;
        summary.results = seen.len();
        summary.missing = ids.len() - seen.len();
    }
    summary.wall_s = started.elapsed().as_secs_f64();
    let _ = conn.close(200, "done".into()).await;
    Ok(summary)
}

fn check_confirm(c: lapin::Confirmation, queue: &str) -> anyhow::Result<()> {
    if c.is_nack() {
        bail!("the broker refused a request (nack)");
    }
    if c.take_message().is_some() {
        bail!("queue {queue:?} does not exist (start the daemon once to declare it)");
    }
    Ok(())
}

/// One partition in `status`.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionStatus {
    pub partition: u32,
    /// Lease holder name, `None` when no instance owns it.
    pub owner: Option<String>,
    pub epoch: Option<u64>,
    /// Member the rendezvous hashing wants as owner.
    pub desired_owner: Option<String>,
    /// Ready messages (backlog).
    pub backlog: Option<u32>,
    /// Consumers attached (1 active; more are single-active-consumer standbys).
    pub consumers: Option<u32>,
}

/// The answer of `status`.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub members: Vec<String>,
    pub partitions: Vec<PartitionStatus>,
    pub unowned: Vec<u32>,
    pub input_backlog: Option<u32>,
    /// Partitions owned per member.
    pub owned_per_member: BTreeMap<String, usize>,
}

/// Reads members and leases from Redis and queue depths from RabbitMQ.
pub async fn status(settings: &Settings) -> anyhow::Result<Status> {
    let client = redis::Client::open(settings.redis.url.expose())?;
    let mut r = client.get_connection_manager().await.with_context(|| format!("connecting to {}", settings.redis.url))?;
    let prefix = &settings.redis.key_prefix;
    let members = read_members(&mut r, prefix).await?;
    let p = settings.amqp.partitions.get();
    let leases: Vec<Option<LeaseValue>> = read_all(&mut r, prefix, p, settings.redis.command_timeout).await?;

    let conn = Connection::connect(settings.amqp.url.expose(), ConnectionProperties::default())
        .await
        .with_context(|| format!("connecting to {}", settings.amqp.url))?;
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let mut ch = conn.create_channel().await?;
    let mut backlogs = Vec::new();
    for part in 0..p {
        match ch.queue_declare(settings.amqp.partition_queue(part).as_str().into(), passive, FieldTable::default()).await {
            Ok(q) => backlogs.push(Some((q.message_count(), q.consumer_count()))),
            Err(_) => {
                backlogs.push(None);
                ch = conn.create_channel().await?;
            }
        }
    }
    let input_backlog = ch
        .queue_declare(settings.amqp.input_queue.as_str().into(), passive, FieldTable::default())
        .await
        .ok()
        .map(|q| q.message_count());
    let _ = conn.close(200, "status".into()).await;

    let mut desired_owner = vec![None; p as usize];
    for m in &members {
        for d in desired_partitions(p, &members, m) {
            desired_owner[d as usize] = Some(m.clone());
        }
    }
    let mut owned_per_member: BTreeMap<String, usize> = members.iter().map(|m| (m.clone(), 0)).collect();
    let partitions: Vec<PartitionStatus> = (0..p)
        .map(|part| {
            let lease = leases[part as usize].as_ref();
            if let Some(l) = lease {
                *owned_per_member.entry(l.name.clone()).or_default() += 1;
            }
            PartitionStatus {
                partition: part,
                owner: lease.map(|l| l.name.clone()),
                epoch: lease.map(|l| l.epoch),
                desired_owner: desired_owner[part as usize].clone(),
                backlog: backlogs[part as usize].map(|b| b.0),
                consumers: backlogs[part as usize].map(|b| b.1),
            }
        })
        .collect();
    let unowned = partitions.iter().filter(|s| s.owner.is_none()).map(|s| s.partition).collect();
    Ok(Status { members, partitions, unowned, input_backlog, owned_per_member })
}

/// Renders `status` as a human table.
pub fn render_status(s: &Status) -> String {
    let mut out = String::new();
    out.push_str(&format!("members ({}):\n", s.members.len()));
    for m in &s.members {
        out.push_str(&format!("  {m:<40} owns {}\n", s.owned_per_member.get(m).copied().unwrap_or(0)));
    }
    out.push_str(&format!(
        "input backlog: {}\n\n",
        s.input_backlog.map_or("?".to_string(), |b| b.to_string())
    ));
    out.push_str(&format!("{:>9}  {:<32} {:>6}  {:>8}  {:>9}  {}\n", "partition", "owner", "epoch", "backlog", "consumers", "desired owner"));
    for p in &s.partitions {
        out.push_str(&format!(
            "{:>9}  {:<32} {:>6}  {:>8}  {:>9}  {}\n",
            p.partition,
            p.owner.as_deref().unwrap_or("-"),
            p.epoch.map_or("-".into(), |e| e.to_string()),
            p.backlog.map_or("?".into(), |b| b.to_string()),
            p.consumers.map_or("?".into(), |b| b.to_string()),
            p.desired_owner.as_deref().unwrap_or("-"),
        ));
    }
    out.push_str(&format!("\nunowned partitions ({}): {:?}\n", s.unowned.len(), s.unowned));
    out
}
