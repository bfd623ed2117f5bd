//! The client commands: `submit` (publish JSONL requests and optionally wait for their results)
//! and `status` (members, partition owners and epochs, backlog, hot keys).

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, ConnectionProperties};
use serde::Serialize;
use serde_json::Value;
use tokio::io::AsyncBufReadExt;

use crate::amqp::{answered, REPLY_SUCCESS};
use crate::config::Settings;
use crate::lease::{read_all, LeaseValue, Leases};
use crate::keying::assignment;
use crate::membership::read_members;
use crate::affinity::SplitState;
use crate::splits::{SplitRecord, SplitStore};
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
    /// The wait was ended by SIGINT (Ctrl-C) or SIGTERM before every result arrived. The results
    /// received so far, and those already in the reply queue, are written and counted; the reply
    /// queue is then deleted, so results that come later go to `amqp.results_queue`.
    pub interrupted: bool,
    /// From the first publish to the last result (or to the last confirm without `--wait`).
    pub wall_s: f64,
    /// Sums over results that carry per-request usage.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// Why `submit` failed. Displays name the step; the cause is the `source`.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// RabbitMQ unreachable or refusing the login (the URL is shown with its password redacted).
    #[error("connecting to {url}")]
    Connect {
        url: String,
        #[source]
        source: lapin::Error,
    },
    /// A channel, declare, consume, publish or ack failed.
    #[error("amqp")]
    Amqp(#[from] lapin::Error),
    /// The input file cannot be opened or read.
    #[error("reading {path}")]
    Input {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The results file cannot be created or written.
    #[error("writing {path}")]
    Output {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Two input lines carry the same `id`.
    #[error("duplicate request id {0:?} in the input")]
    DuplicateId(String),
    /// The broker refused a publish (`basic.nack`).
    #[error("the broker refused a request (nack)")]
    Nacked,
    /// A mandatory publish came back: the queue does not exist.
    #[error("queue {0:?} does not exist (start the daemon once to declare it)")]
    NoQueue(String),
    /// An input line's `id` cannot be an AMQP `message_id` (longer than
    /// [`crate::request::MAX_ID_BYTES`] bytes); the lines before it were published.
    #[error("input line with request id {id:?}: {source}")]
    InvalidId {
        id: String,
        #[source]
        source: crate::request::ParseError,
    },
    /// An input line is a request the daemon would dead-letter (the same checks as the daemon's
    /// intake: [`crate::request::parse`] and `requests.*`, [`crate::policy::RequestPolicy`]), with
    /// the dead-letter reason and its detail.
    #[error("the daemon would dead-letter this request with reason {reason}: {detail}")]
    InvalidRequest { reason: &'static str, detail: String },
    /// The reply queue's consumer ended before every result arrived.
    #[error("reply consumer closed")]
    ReplyConsumerClosed,
    /// An input line was refused ([`ClientError::DuplicateId`], [`ClientError::InvalidId`],
    /// [`ClientError::InvalidRequest`]) after the lines before it were published: `line` is 1-based, `published` counts the
    /// requests already published (they will be processed; resubmitting them makes duplicates).
    #[error("input line {line}: {source}; {} before it", published_text(*.published))]
    AtLine {
        line: usize,
        published: usize,
        #[source]
        source: Box<ClientError>,
    },
}

impl ClientError {
    /// The exit code `submit` ends with for this error ([`crate::exit`]): RabbitMQ refusing the
    /// login or the vhost 77 (`EX_NOPERM`), no RabbitMQ node reachable 69 (`EX_UNAVAILABLE`), as
    /// for `status`; an unreadable input file 66 (`EX_NOINPUT`), an output file that cannot be
    /// created or written 73 (`EX_CANTCREAT`); any other failure 1.
    pub fn exit_code(&self) -> u8 {
        match self {
            ClientError::Connect { .. } if login_refused(&error_text(self)) => crate::exit::EX_NOPERM,
            ClientError::Connect { .. } => crate::exit::EX_UNAVAILABLE,
            ClientError::Input { .. } => crate::exit::EX_NOINPUT,
            ClientError::Output { .. } => crate::exit::EX_CANTCREAT,
            _ => crate::exit::EX_FAILURE,
        }
    }
}

/// "the N requests … were published", for [`ClientError::AtLine`].
fn published_text(n: usize) -> String {
    match n {
        0 => "no request was published".to_owned(),
        1 => "the 1 request was published".to_owned(),
        n => format!("the {n} requests were published"),
    }
}

/// Where `submit` reads requests from and writes results to.
fn input_name(opts: &SubmitOptions) -> String {
    opts.input.as_ref().map_or_else(|| "stdin".to_owned(), |p| p.display().to_string())
}

fn output_name(opts: &SubmitOptions) -> String {
    opts.out.as_ref().map_or_else(|| "stdout".to_owned(), |p| p.display().to_string())
}

/// Publishes every line of the input as one request (lines that are blank are skipped). Each
/// request gets `message_id` and `correlation_id` = its `id` (or a generated UUID when the line has
/// none), `timestamp` = now, and `reply_to` = an exclusive reply queue when waiting.
///
/// Errors: connection failures, unreadable input, a duplicate `id`, a publish the broker
/// refuses, an unwritable output (see [`ClientError`]).
pub async fn submit(settings: &Settings, opts: &SubmitOptions) -> Result<SubmitSummary, ClientError> {
    // Before anything is published: an output that cannot be written must not fail the run
    // after its requests were sent.
    let mut out = if opts.wait { Some(open_output(opts)?) } else { None };
    let (conn, _node) = crate::amqp::connect(&settings.amqp, ConnectionProperties::default())
        .await
        .map_err(|source| ClientError::Connect { url: nodes_label(settings), source })?;
    let ch = answered("channel.open", conn.create_channel()).await?;
    answered("confirm.select", ch.confirm_select(ConfirmSelectOptions::default())).await?;
    let queue = opts.queue.clone().unwrap_or_else(|| settings.amqp.input_queue.clone());
    let reply = if opts.wait { Some(open_reply_queue(&ch).await?) } else { None };

    let started = Instant::now();
    let (ids, refused) = publish_input(&ch, settings, opts, &queue, reply.as_ref().map(|(q, _)| q.as_str())).await?;
    let mut summary = SubmitSummary { requests: ids.len(), ..Default::default() };
    crate::report!("submit: published {} requests to {queue}", ids.len());
    if let (Some((name, mut consumer)), Some(out)) = (reply, out.as_mut()) {
        if refused.is_some() && !ids.is_empty() {
            // Their results come to this reply queue, which goes with the connection: waiting for
            // them keeps them from going to the results queue instead.
            crate::report!("submit: the input stopped at a refused line; waiting for the results of the {} requests published before it", ids.len());
        }
        let reply = ReplyQueue { conn: &conn, ch: &ch, name: &name };
        collect_results(&reply, &mut consumer, &ids, opts, out, &mut summary).await?;
    }
    summary.wall_s = started.elapsed().as_secs_f64();
    let _ = conn.close(REPLY_SUCCESS, "done".into()).await;
    match refused {
        Some(e) => Err(e),
        None => Ok(summary),
    }
}

/// An exclusive reply queue (server-named; it goes with the connection) and a consumer on it.
/// Not auto-delete: an interrupted wait cancels its consumer and then still reads what the queue
/// holds ([`rescue_results`]).
async fn open_reply_queue(ch: &lapin::Channel) -> Result<(String, lapin::Consumer), ClientError> {
    let opts = QueueDeclareOptions { exclusive: true, ..Default::default() };
    let q = ch.queue_declare("".into(), opts, FieldTable::default()).await?;
    let name = q.name().to_string();
    let consumer = ch.basic_consume(name.as_str().into(), "submit".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
    Ok((name, consumer))
}

/// Publishes every non-blank input line to `queue` with publisher confirms (at most 1000
/// unconfirmed at a time); returns the ids of the requests published (and confirmed) and, when
/// a line was refused, why ([`ClientError::AtLine`]). Each line is checked first as the daemon
/// will check it ([`check_line`]), and for a repeated id: the first line refused stops the input
/// there. Errors: the input cannot be read, or the broker refused a publish.
async fn publish_input(
    ch: &lapin::Channel,
    settings: &Settings,
    opts: &SubmitOptions,
    queue: &str,
    reply_queue: Option<&str>,
) -> Result<(HashSet<String>, Option<ClientError>), ClientError> {
    let input_error = |source| ClientError::Input { path: input_name(opts), source };
    let reader: Box<dyn tokio::io::AsyncBufRead + Unpin + Send> = match &opts.input {
        Some(p) => Box::new(tokio::io::BufReader::new(tokio::fs::File::open(p).await.map_err(input_error)?)),
        None => Box::new(tokio::io::BufReader::new(tokio::io::stdin())),
    };
    // Lines as bytes: a line that is not UTF-8 is a request the daemon would dead-letter
    // (`invalid_utf8`), named with its number like any other refused line.
    let mut lines = reader.split(b'\n');
    let mut ids = HashSet::new();
    let mut confirms = Vec::new();
    // Requests the broker confirmed so far.
    let mut confirmed = 0usize;
    let mut number = 0;
    let mut refused = None;
    while let Some(bytes) = lines.next_segment().await.map_err(input_error)? {
        number += 1;
        let at_line = |source| ClientError::AtLine { line: number, published: ids.len(), source: Box::new(source) };
        let line = match String::from_utf8(bytes) {
            Ok(l) => l,
            Err(e) => {
                let e = crate::request::ParseError::InvalidUtf8(e.utf8_error().to_string());
                refused = Some(at_line(ClientError::InvalidRequest { reason: e.reason(), detail: e.to_string() }));
                break;
            }
        };
        let line = line.strip_suffix('\r').unwrap_or(&line);
        // A byte order mark opening the file (editors on Windows write one) is not part of the
        // first request.
        let line = if number == 1 { line.strip_prefix('\u{feff}').unwrap_or(line) } else { line };
        if line.trim().is_empty() {
            continue;
        }
        let id = request_id(line);
        let publish = BasicPublishOptions { mandatory: true, ..Default::default() };
        let checked = if ids.contains(&id) {
            Err(ClientError::DuplicateId(id.clone()))
        } else {
            request_properties(&id, reply_queue).and_then(|props| check_line(settings, line, &id, reply_queue).map(|()| props))
        };
        let props = match checked {
            Ok(props) => props,
            Err(e) => {
                refused = Some(at_line(e));
                break;
            }
        };
        match ch.basic_publish("".into(), queue.into(), publish, line.as_bytes(), props).await {
            Ok(confirm) => confirms.push((number, confirm)),
            Err(e) => {
                // A channel the broker closed (403 ACCESS_REFUSED for a user without write
                // access, 404 for a missing exchange) fails every later publish with "invalid
                // channel state"; the broker's reason is in the confirm of the publish it refused.
                await_confirms(&mut confirms, queue, &mut confirmed).await?;
                return Err(ClientError::AtLine { line: number, published: confirmed, source: Box::new(e.into()) });
            }
        }
        ids.insert(id.clone());
        // Bound the confirms in flight.
        if confirms.len() >= 1000 {
            await_confirms(&mut confirms, queue, &mut confirmed).await?;
        }
    }
    await_confirms(&mut confirms, queue, &mut confirmed).await?;
    Ok((ids, refused))
}

/// Checks input `line` as the daemon's intake will check the request `submit` publishes from it
/// (`message_id` = `correlation_id` = `id`, `reply_to`): the message contract
/// ([`crate::request::parse`], `amqp.max_message_bytes`) and the requests policy (`requests.*`).
/// Errors: [`ClientError::InvalidRequest`] with the reason the daemon would dead-letter it with.
fn check_line(settings: &Settings, line: &str, id: &str, reply_queue: Option<&str>) -> Result<(), ClientError> {
    let env = crate::request::Envelope { message_id: Some(id), correlation_id: Some(id), reply_to: reply_queue, ..Default::default() };
    let req = crate::request::parse(line.as_bytes(), &env, settings.amqp.max_message_bytes)
        .map_err(|e| ClientError::InvalidRequest { reason: e.reason(), detail: e.to_string() })?;
    settings.requests.check(&req, reply_queue).map_err(|(reason, detail)| ClientError::InvalidRequest { reason, detail })
}

/// The request's `id` (a string, or an integer in the 64-bit range as the daemon reads it), else a
/// new UUID. A number the daemon refuses (see [`crate::request::parse`]) also gets a UUID here;
/// [`check_line`] then refuses the line.
fn request_id(line: &str) -> String {
    match serde_json::from_str::<Value>(line) {
        Ok(Value::Object(o)) => o.get("id").and_then(|v| match v {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
            _ => None,
        }),
        _ => None,
    }
    .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

/// Persistent JSON message with `message_id` = `correlation_id` = `id`, `timestamp` (seconds)
/// and the millisecond timestamp header, and `reply_to` when waiting. Errors when `id` is longer
/// than [`crate::request::MAX_ID_BYTES`] (the daemon would dead-letter it as `invalid_field`).
pub fn request_properties(id: &str, reply_queue: Option<&str>) -> Result<BasicProperties, ClientError> {
    let id_string = crate::request::short_string("id", id, crate::request::MAX_ID_BYTES)
        .map_err(|source| ClientError::InvalidId { id: id.chars().take(40).collect(), source })?;
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
    let mut headers = FieldTable::default();
    headers.insert(crate::publisher::HEADER_TIMESTAMP_MS.into(), lapin::types::AMQPValue::LongLongInt(now_ms as i64));
    let props = BasicProperties::default()
        .with_headers(headers)
        .with_content_type("application/json".into())
        .with_delivery_mode(crate::publisher::PERSISTENT)
        .with_message_id(id_string.clone())
        .with_correlation_id(id_string)
        .with_timestamp(now_ms / 1000);
    Ok(match reply_queue {
        Some(q) => props.with_reply_to(q.into()),
        None => props,
    })
}

/// Awaits the confirms of `confirms` (input line, confirm) in order, counting the confirmed ones
/// in `confirmed`. Errors: the first publish the broker refused, as [`ClientError::AtLine`] with
/// its line and the requests confirmed before it (publishes after a refused one on the same
/// channel are not published either: the refusal closed the channel).
async fn await_confirms(confirms: &mut Vec<(usize, lapin::PublisherConfirm)>, queue: &str, confirmed: &mut usize) -> Result<(), ClientError> {
    for (line, c) in confirms.drain(..) {
        // Bounded: a broker under a memory or disk alarm stops reading the connection, and its
        // confirms would never come.
        let checked = match answered("the publisher confirm", c).await {
            Ok(c) => check_confirm(c, queue),
            Err(e) => Err(e.into()),
        };
        if let Err(e) = checked {
            return Err(ClientError::AtLine { line, published: *confirmed, source: Box::new(e) });
        }
        *confirmed += 1;
    }
    Ok(())
}

/// The results' output (`opts.out`, created or truncated, else stdout).
fn open_output(opts: &SubmitOptions) -> Result<Box<dyn Write + Send>, ClientError> {
    Ok(match &opts.out {
        Some(p) => Box::new(std::io::BufWriter::new(std::fs::File::create(p).map_err(|source| ClientError::Output { path: output_name(opts), source })?)),
        None => Box::new(std::io::BufWriter::new(std::io::stdout())),
    })
}

/// Consumes results until every request in `ids` has one or `opts.timeout` elapses; writes each
/// first result as one JSONL line and counts it into `summary`.
async fn collect_results(
    reply: &ReplyQueue<'_>,
    consumer: &mut lapin::Consumer,
    ids: &HashSet<String>,
    opts: &SubmitOptions,
    out: &mut Box<dyn Write + Send>,
    summary: &mut SubmitSummary,
) -> Result<(), ClientError> {
    let output_error = |source| ClientError::Output { path: output_name(opts), source };
    let mut seen = HashSet::new();
    let deadline = tokio::time::Instant::now() + opts.timeout;
    let mut last_progress = Instant::now();
    let mut interrupt = std::pin::pin!(interrupted());
    while seen.len() < ids.len() {
        let next = tokio::select! {
            next = tokio::time::timeout_at(deadline, consumer.next()) => next,
            () = &mut interrupt => {
                summary.interrupted = true;
                break;
            }
        };
        let delivery = match next {
            Ok(Some(d)) => d?,
            Ok(None) => return Err(ClientError::ReplyConsumerClosed),
            Err(_) => break,
        };
        delivery.acker.ack(BasicAckOptions::default()).await?;
        take_result(&delivery, ids, &mut seen, out, summary).map_err(output_error)?;
        if last_progress.elapsed() >= Duration::from_secs(10) {
            last_progress = Instant::now();
            crate::report!("submit: {}/{} results", seen.len(), ids.len());
        }
    }
    // Interrupted or timed out: results may be in the reply queue or delivered to the consumer
    // and not read yet. They are acked by the daemon already, and the queue goes with the
    // connection, so they are read now; the queue is then deleted, and later results go to
    // the results queue.
    if seen.len() < ids.len() {
        match tokio::time::timeout(RESCUE_LIMIT, rescue_results(reply, ids, &mut seen, out, summary, &output_error)).await {
            Ok(rescued) => rescued?,
            Err(_) => crate::report!("submit: reading the results left in the reply queue got no answer from the broker within {RESCUE_LIMIT:?}"),
        }
    }
    out.flush().map_err(output_error)?;
    summary.results = seen.len();
    summary.missing = ids.len() - seen.len();
    if seen.len() < ids.len() {
        crate::report!(
            "submit: {} with {} of {} results; the rest will go to the results queue (the reply queue is deleted)",
            if summary.interrupted { "interrupted" } else { "timed out" },
            seen.len(),
            ids.len()
        );
    }
    let when = if summary.interrupted { "when interrupted".to_owned() } else { format!("after {:?}", opts.timeout) };
    report_missing(ids, &seen, &when);
    Ok(())
}

/// `submit`'s reply queue: its connection, the channel consuming it, and its name.
struct ReplyQueue<'a> {
    conn: &'a lapin::Connection,
    ch: &'a lapin::Channel,
    name: &'a str,
}

/// Writes the result in `delivery` when it answers one of `ids` for the first time, and counts
/// it into `summary` (a repeat counts as a duplicate; a stranger is skipped).
fn take_result(
    delivery: &lapin::message::Delivery,
    ids: &HashSet<String>,
    seen: &mut HashSet<String>,
    out: &mut Box<dyn Write + Send>,
    summary: &mut SubmitSummary,
) -> std::io::Result<()> {
    let key = delivery.properties.correlation_id().as_ref().map(|c| c.to_string()).unwrap_or_default();
    if !ids.contains(&key) {
        return Ok(());
    }
    if !seen.insert(key) {
        summary.duplicates += 1;
        return Ok(());
    }
    out.write_all(&delivery.data).and_then(|()| out.write_all(b"\n"))?;
    tally(summary, &delivery.data);
    Ok(())
}

/// How long [`rescue_results`] may take before `submit` gives up on the broker.
const RESCUE_LIMIT: Duration = Duration::from_secs(30);

/// After an interrupted or timed-out wait: the results already in the reply queue (or delivered to the
/// consumer and not yet read) are written too, then the queue is deleted, so that every later
/// result goes to `amqp.results_queue` and none is destroyed with the queue.
///
/// Closing the consuming channel returns its unread deliveries to the queue; the queue is then
/// read to the end and deleted only if empty (`if-empty`), reading again when a result arrived in
/// between (the failed delete closes its channel with 406, so each round uses a new one).
async fn rescue_results(
    reply: &ReplyQueue<'_>,
    ids: &HashSet<String>,
    seen: &mut HashSet<String>,
    out: &mut Box<dyn Write + Send>,
    summary: &mut SubmitSummary,
    output_error: &dyn Fn(std::io::Error) -> ClientError,
) -> Result<(), ClientError> {
    let _ = reply.ch.close(REPLY_SUCCESS, "interrupted".into()).await;
    for _ in 0..100 {
        let ch = reply.conn.create_channel().await?;
        while let Some(msg) = ch.basic_get(reply.name.into(), BasicGetOptions::default()).await? {
            take_result(&msg.delivery, ids, seen, out, summary).map_err(output_error)?;
            msg.delivery.acker.ack(BasicAckOptions::default()).await?;
        }
        match ch.queue_delete(reply.name.into(), QueueDeleteOptions { if_empty: true, ..Default::default() }).await {
            Ok(_) => return Ok(()),
            Err(e) if crate::amqp::reply_code(&e) == Some(crate::amqp::PRECONDITION_FAILED) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    crate::report!("submit: results kept arriving while the reply queue was being deleted; giving up after 100 rounds");
    Ok(())
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM, so `submit --wait` can write what it has and print
/// its summary instead of being killed with results acked but not yet written. Never completes
/// when the handlers cannot be installed.
async fn interrupted() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        r = tokio::signal::ctrl_c() => if r.is_err() { std::future::pending::<()>().await },
        () = term => {}
    }
}

/// Counts one result (`ok`/`failed`, token usage) into `summary`.
fn tally(summary: &mut SubmitSummary, body: &[u8]) {
    let Ok(r) = serde_json::from_slice::<RequestResult>(body) else { return };
    if r.ok {
        summary.ok += 1;
    } else {
        summary.failed += 1;
    }
    if let Some(u) = r.usage {
        summary.prompt_tokens = summary.prompt_tokens.saturating_add(u.prompt_tokens);
        summary.cached_tokens = summary.cached_tokens.saturating_add(u.cached_tokens.unwrap_or(0));
    }
}

/// Names (up to 20 of) the requests without a result on stderr.
fn report_missing(ids: &HashSet<String>, seen: &HashSet<String>, when: &str) {
    let mut missing: Vec<&String> = ids.iter().filter(|i| !seen.contains(*i)).collect();
    if missing.is_empty() {
        return;
    }
    missing.sort();
    crate::report!(
        "submit: {} requests without a result {} (a dead-lettered request never gets one: see the dead-letter queue); first: {:?}",
        missing.len(),
        when,
        &missing[..missing.len().min(20)]
    );
}

fn check_confirm(c: lapin::Confirmation, queue: &str) -> Result<(), ClientError> {
    if c.is_nack() {
        return Err(ClientError::Nacked);
    }
    if c.take_message().is_some() {
        return Err(ClientError::NoQueue(queue.to_owned()));
    }
    Ok(())
}

/// The broker nodes for messages: `amqp.url`, or every node of `amqp.urls`, passwords redacted.
fn nodes_label(settings: &Settings) -> String {
    settings.amqp.nodes.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// One broker node (of `amqp.urls`, or `amqp.url`) in `status`.
#[derive(Debug, Clone, Serialize)]
pub struct AmqpNodeStatus {
    /// Index in `amqp.urls` (the `node` label of `prefix_batcher_amqp_connected_node`).
    pub node: usize,
    /// The URL with its password redacted.
    pub url: String,
    /// Whether an AMQP connection to it opened within `amqp.confirm_timeout`.
    pub reachable: bool,
    /// Why not, when it is not reachable.
    pub error: Option<String>,
}

/// Tries an AMQP connection to every broker node (all at once, each bounded by
/// `amqp.confirm_timeout`) and closes it again.
async fn probe_nodes(settings: &Settings) -> Vec<AmqpNodeStatus> {
    // Every node at once: a cluster with silent nodes costs one timeout, not one per node.
    let probes = settings.amqp.nodes.iter().enumerate().map(|(node, url)| async move {
        let attempt = tokio::time::timeout(
            settings.amqp.confirm_timeout,
            crate::amqp::connect_node(&settings.amqp, node, ConnectionProperties::default()),
        )
        .await;
        let error = match attempt {
            Ok(Ok(conn)) => {
                let _ = conn.close(REPLY_SUCCESS, "status".into()).await;
                None
            }
            Ok(Err(e)) => Some(crate::config::redact_text(&e.to_string())),
            Err(_) => Some(format!("no connection within {:?}", settings.amqp.confirm_timeout)),
        };
        AmqpNodeStatus { node, url: url.to_string(), reachable: error.is_none(), error }
    });
    futures_util::future::join_all(probes).await
}

/// One partition in `status`.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionStatus {
    pub partition: u32,
    /// Lease holder name, `None` when no instance owns it.
    pub owner: Option<String>,
    /// Lease epoch (fencing token); results of this tenure carry it in `x-partition-epoch`.
    pub epoch: Option<u64>,
    /// Time until the lease expires unless renewed, in milliseconds.
    pub lease_expires_in_ms: Option<u64>,
    /// The member the assignment ([`crate::keying::assignment`]) wants as owner.
    pub desired_owner: Option<String>,
    /// Ready messages (backlog); `None` when RabbitMQ could not be asked.
    pub backlog: Option<u32>,
    /// Consumers attached (1 active; more are single-active-consumer standbys).
    pub consumers: Option<u32>,
    /// What needs attention, if anything: `unowned`, `owner draining` (a stopping instance that
    /// hands the partition over when its held requests are finished), `owner not a live member`
    /// (a crashed instance whose lease has not expired yet), `moving` (owner ≠ desired owner: a handoff is
    /// due or in progress), `standby consumers`, `no consumer`.
    pub note: Option<&'static str>,
}

/// One live member in `status`.
#[derive(Debug, Clone, Serialize)]
pub struct MemberStatus {
    /// Stable instance name (`instance.name`).
    pub name: String,
    /// Boot nonce of the process heartbeating under that name.
    pub nonce: Option<String>,
    /// Its version (`--version`: `0.1.0+<commit>`), from its health line
    /// ([`crate::ownership::with_version`]); `None` for an instance that publishes none.
    pub version: Option<String>,
    /// Partitions whose lease it holds.
    pub owned: usize,
    /// Partitions the assignment gives it.
    pub desired: usize,
    /// Every LLM endpoint of it has been down for `ownership.llm_down_hand_over_after`: the
    /// assignment gives it nothing while another member's LLM is up.
    pub llm_down: bool,
    /// Another live process heartbeats under the same name (within the last minute): while
    /// both run, one of them does no partition work.
    pub name_conflict: bool,
    /// Its health line as of its last heartbeat ([`crate::ownership::health_line`]): `ready`
    /// or `not ready: ` with the reasons of its `/readyz` (`llm endpoints unavailable`,
    /// `amqp connection blocked` by a broker's resource alarm, …), then its LLM endpoints whose
    /// circuit breaker is not closed, then its client certificates that expire within 14 days.
    /// `None` for an instance that publishes none.
    pub health: Option<String>,
}

/// One entry of the split set (a hot key) in `status`.
#[derive(Debug, Clone, Serialize)]
pub struct HotKeyStatus {
    /// Key level ([`crate::keying::level_key`]).
    pub level: u8,
    /// Key hex.
    pub key: String,
    /// `split` (its requests route by their next level) or `spread` (over `shards` shards).
    pub state: &'static str,
    pub shards: u32,
    /// Requests/s routed through it, all instances, over the last few seconds.
    pub arrivals_rps: f64,
    /// Requests/s its partition drained when it was split (it merges back below half of it).
    pub drain_rps: Option<f64>,
    /// Time until it expires unless an instance refreshes it, in milliseconds.
    pub expires_in_ms: u64,
}

impl From<SplitRecord> for HotKeyStatus {
    fn from(r: SplitRecord) -> Self {
        let (state, shards) = match r.member.state {
            SplitState::Split => ("split", 1),
            SplitState::Spread(n) => ("spread", n.get()),
        };
        HotKeyStatus {
            level: r.member.level,
            key: r.member.key.to_string(),
            state,
            shards,
            arrivals_rps: r.arrivals_rps,
            drain_rps: r.drain_rps,
            expires_in_ms: r.expires_in_ms,
        }
    }
}

/// The answer of `status`.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// `amqp.partitions`.
    pub partition_count: u32,
    pub members: Vec<MemberStatus>,
    pub partitions: Vec<PartitionStatus>,
    /// Partitions without a lease holder.
    pub unowned: Vec<u32>,
    /// Partitions whose holder is not their desired owner.
    pub moving: Vec<u32>,
    /// Owned partitions whose queue has no consumer on the broker: nothing consumes them although
    /// a lease is held (a crashed owner until its lease expires; an owner that restarted under
    /// the same name and waits for its previous process's lease; a handover between release and
    /// consume). `None` (`null` in JSON) when RabbitMQ could not be asked: not known.
    /// A consumer of another process (a foreign client on the queue, a frozen owner until the
    /// broker drops its connection) counts as a consumer here; `rabbitmqctl list_consumers`
    /// shows which one is active.
    pub no_consumer: Option<Vec<u32>>,
    /// Lease holders that are not live members (name → partitions).
    pub stale_owners: BTreeMap<String, Vec<u32>>,
    /// Those of `stale_owners` that are stopping and draining their partitions (their draining
    /// mark, [`crate::membership::member_draining_key`]); the others crashed or lost Redis, and
    /// their leases expire after `ownership.lease_ttl`.
    pub draining_owners: Vec<String>,
    /// Ready messages in the input queue.
    pub input_backlog: Option<u32>,
    /// Ready messages over all partition queues.
    pub partition_backlog: Option<u64>,
    /// Why the RabbitMQ part is missing, when it is.
    pub amqp_error: Option<String>,
    /// The broker node (index in `amqp.urls`) the queue depths were read from: the first
    /// reachable one.
    pub amqp_node: Option<usize>,
    /// Every broker node and whether it accepts connections.
    pub amqp_nodes: Vec<AmqpNodeStatus>,
    /// The split set (adaptive keying): hot keys, busiest first.
    pub hot_keys: Vec<HotKeyStatus>,
    /// `host:port` of the Redis primary read (with `redis.sentinels`: as the sentinels report it).
    pub redis_primary: String,
    /// Whether Redis holds anything of a deployment under `redis.key_prefix`: a live member, a
    /// lease, or the recorded partition count. `false` under a mistyped prefix or Redis URL (or
    /// a deployment whose keys were deleted or lost).
    pub deployment_found: bool,
    /// This configuration's `amqp.partitions` when it differs from the count the deployment
    /// recorded in Redis, which `partition_count` and the table follow.
    pub configured_partitions: Option<u32>,
}

impl Status {
    /// Whether the RabbitMQ part is missing because a node refused the login or the vhost
    /// ([`login_refused`]) rather than because none could be reached. With several
    /// `amqp.urls`, the connection's error is the last node's (often one that is down), so
    /// every node's answer counts: a rotated password must not read as a network outage.
    pub fn amqp_login_refused(&self) -> bool {
        self.amqp_error.as_deref().is_some_and(login_refused) || self.amqp_nodes.iter().filter_map(|n| n.error.as_deref()).any(login_refused)
    }
}

/// Queue depths from RabbitMQ: `(ready, consumers)` per partition, then the input backlog, and
/// the broker node (index in `amqp.urls`) they were read from.
async fn queue_depths(settings: &Settings, p: u32) -> anyhow::Result<(Vec<Option<(u32, u32)>>, Option<u32>, usize)> {
    let (conn, node) = tokio::time::timeout(
        settings.amqp.confirm_timeout * settings.amqp.nodes.len() as u32,
        crate::amqp::connect(&settings.amqp, ConnectionProperties::default()),
    )
    .await
    .map_err(|_| anyhow::anyhow!("timed out connecting to {}", nodes_label(settings)))?
    .with_context(|| format!("connecting to {}", nodes_label(settings)))?;
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let mut ch = answered("channel.open", conn.create_channel()).await?;
    let mut depths = Vec::with_capacity(p as usize);
    for part in 0..p {
        match answered("queue.declare", ch.queue_declare(settings.amqp.partition_queue(part).as_str().into(), passive, FieldTable::default())).await {
            Ok(q) => depths.push(Some((q.message_count(), q.consumer_count()))),
            Err(e) => {
                if crate::amqp::reply_code(&e).is_none() {
                    // No answer: the broker is not serving this connection.
                    let _ = crate::amqp::close_connection(&conn, "status").await;
                    return Err(e.into());
                }
                // A failed passive declare closes the channel.
                depths.push(None);
                ch = answered("channel.open", conn.create_channel()).await?;
            }
        }
    }
    let input = answered("queue.declare", ch.queue_declare(settings.amqp.input_queue.as_str().into(), passive, FieldTable::default()))
        .await
        .ok()
        .map(|q| q.message_count());
    let _ = crate::amqp::close_connection(&conn, "status").await;
    Ok((depths, input, node))
}

/// The split set, busiest key first. Errors: Redis unreachable, failing or too slow.
async fn hot_keys(r: &crate::lease::RedisConn, prefix: &str, timeout: Duration) -> anyhow::Result<Vec<HotKeyStatus>> {
    let mut hot: Vec<HotKeyStatus> = SplitStore::new(r.clone(), prefix, timeout).read().await?.into_iter().map(HotKeyStatus::from).collect();
    hot.sort_by(|a, b| b.arrivals_rps.total_cmp(&a.arrivals_rps).then_with(|| a.key.cmp(&b.key)));
    Ok(hot)
}

/// Reads members, nonces, leases and their remaining TTLs from Redis, and queue depths and
/// consumer counts from RabbitMQ (when RabbitMQ is unreachable the rest is still reported, with
/// `amqp_error` set).
///
/// Errors: Redis unreachable or answering with an error.
pub async fn status(settings: &Settings) -> anyhow::Result<Status> {
    let r = connect_redis(settings).await?;
    // A Redis that accepts the connection and then stalls (`CLIENT PAUSE`, a long `DEBUG
    // SLEEP`, a saturated server) fails a command with only `timed out`.
    read_status(settings, r).await.with_context(|| format!("reading the deployment from {}", redis_target(settings)))
}

/// [`status`] once connected to Redis (`r`).
async fn read_status(settings: &Settings, mut r: crate::lease::RedisConn) -> anyhow::Result<Status> {
    let timeout = settings.redis.command_timeout;
    let prefix = &settings.redis.key_prefix;
    let live = read_members(&mut r, prefix).await?;
    let hot_keys = hot_keys(&r, prefix, timeout).await?;
    // The deployment's partition count as recorded, which wins over this configuration's: a
    // `status` run with an outdated configuration would report partitions that do not exist as
    // unowned, and existing ones as missing.
    let recorded: Option<String> = redis::cmd("GET").arg(crate::topology::partition_count_key(prefix)).query_async(&mut r).await?;
    let configured = settings.amqp.partitions.get();
    let p = recorded.as_deref().and_then(|v| v.parse::<u32>().ok()).filter(|n| (1..=1024).contains(n)).unwrap_or(configured);
    let leases: Vec<Option<LeaseValue>> = read_all(&mut r, prefix, p, timeout).await?;
    let pttls = lease_pttls(&mut r, prefix, p).await?;
    let deployment_found = recorded.is_some() || !live.is_empty() || leases.iter().any(Option::is_some);

    // Both open their own connections: run them together, so a silent broker costs one
    // `connection_timeout`, not two.
    let (depths, amqp_nodes) = tokio::join!(queue_depths(settings, p), probe_nodes(settings));
    let (depths, input_backlog, amqp_error, amqp_node) = match depths {
        Ok((d, i, node)) => (d, i, None, Some(node)),
        Err(e) => (vec![None; p as usize], None, Some(error_text(e.as_ref())), None),
    };

    let names: Vec<String> = live.iter().map(|m| m.name.clone()).collect();
    let desired = desired_owners(p, &live);
    let (stale_owners, draining_owners) = stale_owners(&mut r, prefix, &leases, &names).await?;
    let mut members: Vec<MemberStatus> = live.into_iter().map(member_status).collect();
    let mut partitions = Vec::with_capacity(p as usize);
    for part in 0..p {
        let lease = leases[part as usize].as_ref();
        let want = desired[part as usize];
        if let Some(i) = want {
            members[i].desired += 1;
        }
        let live_owner = lease.and_then(|l| names.iter().position(|n| *n == l.name));
        if let Some(i) = live_owner {
            members[i].owned += 1;
        }
        let depth = depths[part as usize];
        let note = partition_note(lease, depth, live_owner, want, &draining_owners);
        partitions.push(PartitionStatus {
            partition: part,
            owner: lease.map(|l| l.name.clone()),
            epoch: lease.map(|l| l.epoch),
            lease_expires_in_ms: lease.and(pttls.get(part as usize).copied().flatten()),
            desired_owner: want.map(|i| names[i].clone()),
            backlog: depth.map(|d| d.0),
            consumers: depth.map(|d| d.1),
            note,
        });
    }
    let unowned = partitions.iter().filter(|s| s.owner.is_none()).map(|s| s.partition).collect();
    let moving = partitions.iter().filter(|s| s.note == Some("moving")).map(|s| s.partition).collect();
    let no_consumer = amqp_error.is_none().then(|| owned_without_consumer(&partitions));
    let partition_backlog =
        if depths.iter().all(Option::is_some) { Some(depths.iter().flatten().map(|d| u64::from(d.0)).sum()) } else { None };
    Ok(Status {
        partition_count: p,
        members,
        partitions,
        unowned,
        moving,
        no_consumer,
        stale_owners,
        draining_owners,
        input_backlog,
        partition_backlog,
        amqp_error,
        amqp_node,
        amqp_nodes,
        hot_keys,
        redis_primary: r.primary(),
        deployment_found,
        configured_partitions: (p != configured).then_some(configured),
    })
}

/// For each of the `p` partitions, the index in `live` of the member the assignment gives it
/// (members flagged LLM-down get none while another member's LLM is up:
/// [`crate::membership::assignable`]).
fn desired_owners(p: u32, live: &[crate::membership::Member]) -> Vec<Option<usize>> {
    let names: Vec<String> = live.iter().map(|m| m.name.clone()).collect();
    let down: Vec<String> = live.iter().filter(|m| m.llm_down).map(|m| m.name.clone()).collect();
    let unavailable: Vec<String> = live.iter().filter(|m| m.llm_unavailable).map(|m| m.name.clone()).collect();
    let assignable = crate::membership::assignable(&names, &down, &unavailable);
    assignment(p, &assignable).into_iter().map(|o| o.and_then(|i| names.iter().position(|n| *n == assignable[i]))).collect()
}

/// Redis as `status` names it in errors: `redis.url` (its password masked), or the Sentinel
/// primary.
fn redis_target(settings: &Settings) -> String {
    match &settings.redis.sentinel {
        None => format!("Redis at {}", settings.redis.url),
        Some(s) => format!("the Redis primary of `{}` through redis.sentinels", s.master),
    }
}

/// Connects to the deployment's Redis (directly or through Sentinel) within
/// `redis.command_timeout`. Errors name the target ([`redis_target`]).
async fn connect_redis(settings: &Settings) -> anyhow::Result<crate::lease::RedisConn> {
    let target = redis_target(settings);
    tokio::time::timeout(settings.redis.command_timeout, crate::lease::connect(&settings.redis))
        .await
        .map_err(|_| anyhow::anyhow!("timed out connecting to {target}"))?
        .with_context(|| format!("connecting to {target}"))
}

/// The remaining time to live of each of the `p` partitions' leases, in ms (`None`: no lease).
async fn lease_pttls(r: &mut crate::lease::RedisConn, prefix: &str, p: u32) -> redis::RedisResult<Vec<Option<u64>>> {
    let mut pipe = redis::pipe();
    for part in 0..p {
        pipe.cmd("PTTL").arg(Leases::lease_key(prefix, part));
    }
    let pttls: Vec<i64> = pipe.query_async(r).await?;
    Ok(pttls.into_iter().map(|t| (t >= 0).then_some(t as u64)).collect())
}

/// Lease holders that are not live members (`names`), with their partitions: a stopping
/// instance draining them, or a crashed one whose leases have not expired yet; and which of
/// them marked themselves draining.
async fn stale_owners(
    r: &mut crate::lease::RedisConn,
    prefix: &str,
    leases: &[Option<LeaseValue>],
    names: &[String],
) -> redis::RedisResult<(BTreeMap<String, Vec<u32>>, Vec<String>)> {
    let mut stale: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (part, l) in (0u32..).zip(leases) {
        if let Some(l) = l.as_ref().filter(|l| !names.contains(&l.name)) {
            stale.entry(l.name.clone()).or_default().push(part);
        }
    }
    let mut pipe = redis::pipe();
    for name in stale.keys() {
        pipe.cmd("EXISTS").arg(crate::membership::member_draining_key(prefix, name));
    }
    let marked: Vec<bool> = if stale.is_empty() { Vec::new() } else { pipe.query_async(r).await? };
    let draining = stale.keys().zip(marked).filter(|(_, d)| *d).map(|(n, _)| n.clone()).collect();
    Ok((stale, draining))
}

/// The owned partitions whose queue the broker reports with no consumer ([`Status::no_consumer`]).
fn owned_without_consumer(partitions: &[PartitionStatus]) -> Vec<u32> {
    partitions.iter().filter(|s| s.owner.is_some() && s.consumers == Some(0)).map(|s| s.partition).collect()
}

/// The note `status` puts on a partition: its `lease`, queue `depth` (ready, consumers), the
/// index of its owner among the live members and the one the assignment wants.
fn partition_note(lease: Option<&LeaseValue>, depth: Option<(u32, u32)>, live_owner: Option<usize>, want: Option<usize>, draining_owners: &[String]) -> Option<&'static str> {
    match (lease, depth) {
        (None, _) => Some("unowned"),
        (Some(l), _) if live_owner.is_none() && draining_owners.contains(&l.name) => Some("owner draining"),
        (Some(_), _) if live_owner.is_none() => Some("owner not a live member"),
        (Some(_), _) if live_owner != want => Some("moving"),
        (Some(_), Some((_, c))) if c > 1 => Some("standby consumers"),
        (Some(_), Some((_, 0))) => Some("no consumer"),
        _ => None,
    }
}

/// Whether a RabbitMQ error text of `status` is a refusal of the login or the vhost
/// (`ACCESS_REFUSED`, 403; `NOT_ALLOWED`, 530), not an unreachable node. A 530 for a reached
/// connection limit is not a refusal of the login: it clears when other connections close.
pub fn login_refused(error: &str) -> bool {
    (error.contains("ACCESS_REFUSED") || error.contains("NOT_ALLOWED")) && !error.contains("connection limit")
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// The note `status` puts after a member flagged LLM-down: whether the assignment gave its
/// partitions to the others, or left them with it because no other member's LLM is up
/// ([`crate::membership::assignable`]). Empty for a member that is not flagged.
fn llm_down_note(m: &MemberStatus) -> &'static str {
    match (m.llm_down, m.desired) {
        (false, _) => "",
        (true, 0) => "  (LLM down: its partitions go to the others)",
        (true, _) => "  (LLM down; no other member's LLM is up, so it keeps its partitions)",
    }
}

/// Renders `status` as a human table.
pub fn render_status(s: &Status) -> String {
    let mut out = String::new();
    render_members(&mut out, s);
    render_summary(&mut out, s);
    render_partitions(&mut out, s);
    render_hot_keys(&mut out, s);
    out
}

/// A live member as `status` shows it, its version taken out of its health line
/// ([`crate::ownership::split_version`]); owned and desired counted later.
fn member_status(m: crate::membership::Member) -> MemberStatus {
    let (version, health) = match m.health.as_deref().map(crate::ownership::split_version) {
        Some((version, health)) => (version.map(str::to_owned), Some(health.to_owned())),
        None => (None, None),
    };
    MemberStatus { name: m.name, nonce: m.nonce, version, owned: 0, desired: 0, llm_down: m.llm_down, name_conflict: m.name_conflict, health }
}

/// The members table of [`render_status`], with the lease holders that are not live members.
fn render_members(out: &mut String, s: &Status) {
    out.push_str(&format!("members ({}):\n", s.members.len()));
    // As wide as the longest version (`0.1.0+<commit>.modified` is 27 characters), so the columns
    // after it stay aligned.
    let vw = s.members.iter().filter_map(|m| m.version.as_deref()).map(str::len).max().unwrap_or(0).max(20);
    out.push_str(&format!("  {:<40} {:<14} {:<vw$} {:>5} {:>8}  {}\n", "name", "nonce", "version", "owns", "desired", "health"));
    for m in &s.members {
        let down = llm_down_note(m);
        let conflict = if m.name_conflict { "  (NAME CONFLICT: another process heartbeats with this instance.name; names must be unique)" } else { "" };
        out.push_str(&format!(
            "  {:<40} {:<14} {:<vw$} {:>5} {:>8}  {}{down}{conflict}\n",
            m.name,
            m.nonce.as_deref().unwrap_or("-"),
            m.version.as_deref().unwrap_or("-"),
            m.owned,
            m.desired,
            m.health.as_deref().unwrap_or("-")
        ));
    }
    for (name, ps) in &s.stale_owners {
        if s.draining_owners.contains(name) {
            out.push_str(&format!("  {name:<40} (stopping: drains {} partition(s), each handed over when its held requests are finished)\n", ps.len()));
        } else {
            out.push_str(&format!("  {name:<40} (not a live member: crashed, or reconnecting to RabbitMQ or Redis; still holds {} lease(s) until they expire)\n", ps.len()));
        }
    }
}

/// The deployment summary of [`render_status`]: partition counts, backlog, Redis primary,
/// warnings (a configuration with another partition count, no deployment found, RabbitMQ
/// unreachable) and the RabbitMQ nodes.
fn render_summary(out: &mut String, s: &Status) {
    let owned = s.partitions.iter().filter(|p| p.owner.is_some()).count();
    out.push_str(&format!(
        "\npartitions: {}, owned {owned}{}, unowned {}, moving {}, owned without a consumer {}; backlog (ready messages; deliveries held by owners are in prefix_batcher_unsettled_deliveries): input {}, partitions {}\n",
        s.partition_count,
        stale_owned_note(s),
        s.unowned.len(),
        s.moving.len(),
        s.no_consumer.as_ref().map_or("?".to_owned(), |l| l.len().to_string()),
        s.input_backlog.map_or("?".to_owned(), |b| b.to_string()),
        s.partition_backlog.map_or("?".to_owned(), |b| b.to_string()),
    ));
    out.push_str(&format!("Redis primary: {}\n", s.redis_primary));
    if let Some(configured) = s.configured_partitions {
        out.push_str(&format!(
            "NOTE: this configuration has amqp.partitions = {configured}, but the deployment records {} partitions in Redis; shown as the deployment has them (update this configuration)\n",
            s.partition_count
        ));
    }
    if !s.deployment_found {
        out.push_str("NO DEPLOYMENT FOUND under this redis.key_prefix: no member, no lease, no recorded partition count (check redis.url and redis.key_prefix against the daemons' configuration; the recorded partition count has no expiry, so a stopped deployment is found unless its keys were deleted or Redis lost them)\n");
        let queued = s.input_backlog.is_some() || s.partitions.iter().any(|p| p.backlog.is_some());
        if queued {
            out.push_str(&format!(
                "  but RabbitMQ holds this configuration's queues (ready: input {}, partitions {}): with the right redis.url and redis.key_prefix, Redis lost its data (restarted without persistence, flushed) or the deployment's keys were deleted while no instance ran; an instance that starts records the deployment again and takes the partitions\n",
                s.input_backlog.map_or("?".to_owned(), |b| b.to_string()),
                s.partition_backlog.map_or("?".to_owned(), |b| b.to_string()),
            ));
        }
    }
    if let Some(e) = &s.amqp_error {
        let what = if s.amqp_login_refused() { "RabbitMQ refused the login" } else { "RabbitMQ unreachable" };
        out.push_str(&format!("{what}, backlog unknown: {e}\n"));
    }
    out.push_str(&format!("\nRabbitMQ nodes ({}):\n", s.amqp_nodes.len()));
    for n in &s.amqp_nodes {
        let state = match (&n.error, s.amqp_node == Some(n.node)) {
            (None, true) => "reachable (queue depths read here)".to_owned(),
            (None, false) => "reachable".to_owned(),
            (Some(e), _) if login_refused(e) => format!("LOGIN REFUSED: {e}"),
            (Some(e), _) => format!("UNREACHABLE: {e}"),
        };
        out.push_str(&format!("  {:>4}  {:<48} {state}\n", n.node, n.url));
    }
}

/// How many of the owned partitions a lease holder that is not a live member holds, for the
/// summary line: `" (3 by instances that are not live members until their leases expire, 1 by
/// stopping instances)"`, or empty. Such a partition has an owner but may have no consumer and a
/// growing backlog (a crashed instance), so counting it as owned alone would hide it.
fn stale_owned_note(s: &Status) -> String {
    let held = |draining: bool| -> usize { s.stale_owners.iter().filter(|(n, _)| s.draining_owners.contains(n) == draining).map(|(_, ps)| ps.len()).sum() };
    let (crashed, stopping) = (held(false), held(true));
    let mut parts = Vec::new();
    if crashed > 0 {
        parts.push(format!("{crashed} by instances that are not live members until their leases expire"));
    }
    if stopping > 0 {
        parts.push(format!("{stopping} by stopping instances"));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

/// The partitions table of [`render_status`] and the unowned ones.
fn render_partitions(out: &mut String, s: &Status) {
    out.push_str(&format!(
        "\n{:>9}  {:<32} {:>14} {:>9} {:>8} {:>9}  {:<32} {}\n",
        "partition", "owner", "epoch", "lease ttl", "backlog", "consumers", "desired owner", "note"
    ));
    for p in &s.partitions {
        out.push_str(&format!(
            "{:>9}  {:<32} {:>14} {:>9} {:>8} {:>9}  {:<32} {}\n",
            p.partition,
            p.owner.as_deref().unwrap_or("-"),
            opt(p.epoch),
            p.lease_expires_in_ms.map_or("-".to_owned(), |ms| format!("{:.1}s", ms as f64 / 1000.0)),
            p.backlog.map_or("?".to_owned(), |b| b.to_string()),
            p.consumers.map_or("?".to_owned(), |b| b.to_string()),
            p.desired_owner.as_deref().unwrap_or("-"),
            p.note.unwrap_or(""),
        ));
    }
    out.push_str(&format!("\nunowned partitions ({}): {:?}\n", s.unowned.len(), s.unowned));
}

/// The hot keys (split or spread) of [`render_status`].
fn render_hot_keys(out: &mut String, s: &Status) {
    out.push_str(&format!("\nhot keys ({}):\n", s.hot_keys.len()));
    if !s.hot_keys.is_empty() {
        out.push_str(&format!("  {:>5}  {:<16}  {:<12} {:>12} {:>12} {:>8}\n", "level", "key", "state", "arrivals/s", "drained/s", "expires"));
    }
    for h in &s.hot_keys {
        let state = if h.state == "spread" { format!("spread x{}", h.shards) } else { h.state.to_owned() };
        out.push_str(&format!(
            "  {:>5}  {:<16}  {:<12} {:>12.1} {:>12} {:>7.1}s\n",
            h.level,
            h.key,
            state,
            h.arrivals_rps,
            h.drain_rps.map_or("-".to_owned(), |d| format!("{d:.1}")),
            h.expires_in_ms as f64 / 1000.0
        ));
    }
}

/// `e` and its causes, `error: cause: cause` (as anyhow prints with `{:#}`), leaving out a cause
/// whose text the line already holds (lapin's I/O error prints its source's text, which then
/// follows it again).
pub fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = String::new();
    for cause in std::iter::successors(Some(e), |c| c.source()) {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Partition `p` held by `owner`, with `consumers` (`None`: RabbitMQ not asked).
    fn partition(p: u32, owner: Option<&str>, consumers: Option<u32>) -> PartitionStatus {
        PartitionStatus {
            partition: p,
            owner: owner.map(Into::into),
            epoch: None,
            lease_expires_in_ms: None,
            desired_owner: None,
            backlog: consumers.map(|_| 0),
            consumers,
            note: None,
        }
    }

    /// A reachable deployment's status with `partitions` and nothing else to note.
    fn status_of(partitions: Vec<PartitionStatus>) -> Status {
        Status {
            partition_count: partitions.len() as u32,
            members: Vec::new(),
            partitions,
            unowned: Vec::new(),
            moving: Vec::new(),
            no_consumer: Some(Vec::new()),
            stale_owners: BTreeMap::new(),
            draining_owners: Vec::new(),
            input_backlog: Some(0),
            partition_backlog: Some(0),
            amqp_error: None,
            amqp_node: None,
            amqp_nodes: Vec::new(),
            hot_keys: Vec::new(),
            redis_primary: "127.0.0.1:6379".into(),
            deployment_found: true,
            configured_partitions: None,
        }
    }

    #[test]
    fn the_summary_says_how_many_owned_partitions_a_crashed_or_stopping_instance_holds() {
        let owned = |p: u32, owner: &str| partition(p, Some(owner), None);
        let mut s = status_of(vec![owned(0, "a"), owned(1, "b"), owned(2, "b"), owned(3, "c")]);
        let line = |s: &Status| render_status(s).lines().find(|l| l.starts_with("partitions:")).unwrap().to_owned();
        assert!(line(&s).starts_with("partitions: 4, owned 4, unowned 0"), "{}", line(&s));
        s.stale_owners.insert("b".into(), vec![1, 2]);
        assert!(line(&s).starts_with("partitions: 4, owned 4 (2 by instances that are not live members until their leases expire), unowned 0"), "{}", line(&s));
        s.stale_owners.insert("c".into(), vec![3]);
        s.draining_owners.push("c".into());
        assert!(line(&s).contains("owned 4 (2 by instances that are not live members until their leases expire, 1 by stopping instances), unowned 0"), "{}", line(&s));
        assert!(line(&s).contains("moving 0, owned without a consumer 0;"), "{}", line(&s));
    }

    /// An instance killed and restarted at once under its name: its partitions are owned (the
    /// previous process's leases, by a live member) and consumed by nobody until those leases
    /// expire. The summary and `no_consumer` say so, where `unowned` is empty.
    #[test]
    fn owned_partitions_without_a_consumer_are_counted() {
        let parts = vec![
            partition(0, Some("a"), Some(1)),
            partition(1, Some("b"), Some(0)),
            partition(2, Some("b"), Some(0)),
            partition(3, None, Some(0)),
            partition(4, Some("a"), None),
        ];
        assert_eq!(owned_without_consumer(&parts), vec![1, 2], "owned with 0 consumers; not unowned, not unknown");
        let mut s = Status { no_consumer: Some(owned_without_consumer(&parts)), unowned: vec![3], ..status_of(parts) };
        let line = |s: &Status| render_status(s).lines().find(|l| l.starts_with("partitions:")).unwrap().to_owned();
        assert!(line(&s).contains("unowned 1, moving 0, owned without a consumer 2;"), "{}", line(&s));
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["no_consumer"], serde_json::json!([1, 2]));
        // Without RabbitMQ: unknown, not empty (a check for an empty list must not pass).
        s.amqp_error = Some("connection refused".into());
        s.no_consumer = None;
        assert!(line(&s).contains("owned without a consumer ?;"), "unknown without RabbitMQ: {}", line(&s));
        assert_eq!(serde_json::to_value(&s).unwrap()["no_consumer"], serde_json::Value::Null);
    }

    /// A build from a modified checkout (`….modified`, 27 characters) keeps the members table's
    /// columns aligned.
    #[test]
    fn a_long_version_keeps_the_members_table_aligned() {
        let member = |name: &str, version: &str| MemberStatus { name: name.into(), nonce: Some("807219e30b85".into()), version: Some(version.into()), owned: 4, desired: 4, llm_down: false, name_conflict: false, health: Some("ready".into()) };
        let s = Status { members: vec![member("a", "0.1.0+2a836be9f629"), member("b", "0.1.0+2a836be9f629.modified")], ..status_of(Vec::new()) };
        let out = render_status(&s);
        let cols: Vec<usize> = out.lines().filter(|l| l.starts_with("  name") || l.starts_with("  a ") || l.starts_with("  b ")).map(|l| l.find("ready").or_else(|| l.find("health")).unwrap()).collect();
        assert_eq!(cols.len(), 3, "{out}");
        assert!(cols.iter().all(|c| *c == cols[0]), "health column at {cols:?}:\n{out}");
    }

    #[test]
    fn a_flagged_member_is_said_to_keep_its_partitions_only_when_the_assignment_gives_it_some() {
        let member = |llm_down: bool, desired: usize| MemberStatus { name: "a".into(), nonce: None, version: None, owned: 0, desired, llm_down, name_conflict: false, health: None };
        assert_eq!(llm_down_note(&member(false, 8)), "");
        assert!(llm_down_note(&member(true, 0)).contains("go to the others"));
        // A lone member, or every member flagged: the assignment still counts it.
        assert!(llm_down_note(&member(true, 16)).contains("keeps its partitions"));
    }

    #[test]
    fn request_ids_become_message_ids_up_to_the_limit() {
        let ok = "a".repeat(crate::request::MAX_ID_BYTES);
        let props = request_properties(&ok, Some("replies")).expect("an id at the limit is accepted");
        assert_eq!(props.message_id().as_ref().map(|m| m.as_str()), Some(ok.as_str()));
        assert_eq!(props.correlation_id().as_ref().map(|m| m.as_str()), Some(ok.as_str()));
        let long = "a".repeat(300);
        match request_properties(&long, None) {
            Err(ClientError::InvalidId { source, .. }) => assert_eq!(source.reason(), "invalid_field"),
            other => panic!("a 300-byte id must be refused, got {other:?}"),
        }
    }

    #[test]
    fn a_line_id_is_read_as_the_daemon_reads_it() {
        let env = crate::request::Envelope::default();
        for line in [r#"{"id":"abc","prompt":"p"}"#, r#"{"id":42,"prompt":"p"}"#, r#"{"id":-7,"prompt":"p"}"#, r#"{"id":18446744073709551615,"prompt":"p"}"#] {
            let daemon = crate::request::parse(line.as_bytes(), &env, 1000).unwrap().id;
            assert_eq!(request_id(line), daemon, "{line}");
        }
        // A number the daemon refuses gets a fresh UUID (so two such lines are not duplicates).
        let a = request_id(r#"{"id":1e2,"prompt":"p"}"#);
        let b = request_id(r#"{"id":1e2,"prompt":"p"}"#);
        assert!(uuid::Uuid::parse_str(&a).is_ok() && a != b, "{a} {b}");
    }
}
