//! The pipeline of one owned partition: consumer → batcher → LLM → publisher → ack.
//!
//! One instance of this runs per partition whose lease the instance holds. Stages are tasks
//! joined by bounded channels (`batching.channel_capacity`); the AMQP prefetch
//! (`amqp.partition_prefetch`) bounds the unacked deliveries.
//!
//! Three ways to stop, chosen by the owner ([`crate::ownership`]):
//! - `drain` (SIGTERM): stop consuming, flush every buffer (`reason="shutdown"`), finish the
//!   in-flight batches, publish and ack, close the channel.
//! - `revoke` (cooperative handoff to another instance): the same, but buffers flush with
//!   `reason="revoke"`.
//! - `abort` (lease lost): close the channel at once — the broker requeues every unacked
//!   delivery in order — abort in-flight LLM calls and drop their unpublished results.
//!
//! Before publishing any result, and again before acking ([`publisher::publish_result`]), the
//! worker checks its local lease deadline ([`LeaseClock`]); a worker whose lease may have expired (e.g. after a SIGSTOP)
//! publishes and acks nothing. The worker also stops by itself at that deadline, like an `abort`,
//! without waiting for the owner to notice (the owner's loop may be stuck on an unreachable
//! Redis): consumption stops within the renew deadline whatever happens to the rest.
//!
//! Every result carries `x-partition`, `x-partition-epoch` (the lease epoch, a fencing token: a
//! result with a lower epoch than one already seen for its partition is stale) and `x-instance`
//! (the instance name), so consumers and tests can build an ownership log from results alone.

use std::sync::Arc;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::Channel;

use crate::amqp::{Connections, REPLY_SUCCESS};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::batcher::{self, Batch, BatchConfig, FlushReason};
use crate::config::{KeyingMode, Settings};
use crate::keying::PrefixKey;
use crate::lease::LeaseClock;
use crate::llm::{InferenceItem, LlmClient};
use crate::metrics::{self, outcome, stage};
use crate::publisher::{self, header_u64, unix_ms, BatchInfo, Intake, Tenure, HEADER_SHARD, HEADER_TIMESTAMP_MS};
use crate::request::{Request, TimingsMs};

/// Everything one partition worker needs.
#[derive(Clone)]
pub struct PartitionContext {
    pub partition: u32,
    /// Lease epoch (fencing token), sent as `x-partition-epoch` on every result.
    pub epoch: u64,
    pub settings: Arc<Settings>,
    pub llm: LlmClient,
    pub lease: Arc<LeaseClock>,
}

/// Stop signals of a worker.
#[derive(Clone, Default)]
pub struct StopSignals {
    /// Graceful stop for shutdown: flush with `reason="shutdown"`.
    pub drain: CancellationToken,
    /// Graceful stop for a handoff: flush with `reason="revoke"`.
    pub revoke: CancellationToken,
    /// Hard stop: lease lost.
    pub abort: CancellationToken,
}

/// A request waiting in a batch.
struct Pending {
    delivery: Delivery,
    req: Request,
    key: PrefixKey,
    shard: u32,
    received: Instant,
    queued_ms: u64,
    enqueued_unix_ms: Option<u64>,
}

/// Runs the partition until stopped. Returns an error when the channel or connection fails.
pub async fn run(conns: &Connections, ctx: PartitionContext, stop: StopSignals) -> Result<(), lapin::Error> {
    let s = &ctx.settings;
    let p = ctx.partition;
    let queue = s.amqp.partition_queue(p);
    let ch = conns.consume.create_channel().await?;
    let publish = conns.publish_channel().await?;
    ch.basic_qos(s.amqp.partition_prefetch, BasicQosOptions::default()).await?;
    let tag = format!("{}:p{}:e{}", s.instance_name, p, ctx.epoch);
    let mut consumer = ch
        .basic_consume(queue.as_str().into(), tag.as_str().into(), BasicConsumeOptions::default(), FieldTable::default())
        .await?;
    info!(partition = p, epoch = ctx.epoch, queue = %queue, "partition consuming");

    let cap = s.batching.channel_capacity.get();
    let (item_tx, item_rx) = mpsc::channel::<(PrefixKey, Pending)>(cap);
    let (batch_tx, batch_rx) = mpsc::channel::<Batch<PrefixKey, Pending>>(cap);
    let cfg = BatchConfig { max_batch_size: s.batching.max_batch_size, max_batch_wait: s.batching.max_batch_wait };
    let batcher = tokio::spawn(batcher::run(cfg, item_rx, batch_tx, stop.revoke.clone(), move |n, age| {
        metrics::buffer_state(p, n, age.map_or(0.0, |d| d.as_secs_f64()))
    }));

    let executor = tokio::spawn(execute(ctx.clone(), publish.clone(), batch_rx, stop.abort.clone()));

    // Intake.
    let keyed = s.keying.mode != KeyingMode::Off;
    let mut result = Ok(());
    let lease = ctx.lease.clone();
    let expired = lease.expired();
    tokio::pin!(expired);
    loop {
        tokio::select! {
            biased;
            _ = stop.abort.cancelled() => break,
            _ = &mut expired => {
                // Renew deadline passed and the owner has not aborted us yet: stop on our own, as
                // an abort (in-flight LLM calls are cancelled through the same token).
                warn!(partition = p, epoch = ctx.epoch, "lease deadline passed; stopping the partition");
                ctx.lease.invalidate(); // a late renewal must not revive it for in-flight work
                stop.abort.cancel();
                break;
            }
            _ = stop.drain.cancelled() => break,
            _ = stop.revoke.cancelled() => break,
            next = consumer.next() => match next {
                Some(Ok(delivery)) => {
                    if let Some(pending) = accept(&ctx, &publish, delivery).await {
                        let bkey = if keyed { pending.key } else { PrefixKey(0) };
                        if item_tx.send((bkey, pending)).await.is_err() {
                            break;
                        }
                    }
                }
                Some(Err(e)) => { result = Err(e); break; }
                None => break,
            },
        }
    }

    if stop.abort.is_cancelled() || result.is_err() {
        // Lease lost or channel broken: close at once so the broker requeues everything unacked.
        // Stop publishing first, so no result goes out after the requeue.
        executor.abort();
        batcher.abort();
        let _ = ch.close(REPLY_SUCCESS, "partition lease lost".into()).await;
        let _ = publish.close(REPLY_SUCCESS, "partition lease lost".into()).await;
        info!(partition = p, epoch = ctx.epoch, "partition aborted; unacked requests return to the queue");
        return result;
    }
    // Graceful: no new deliveries, then flush and finish everything buffered and in flight.
    let _ = ch.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await;
    drop(item_tx); // batcher drains with reason "shutdown" (or "revoke" if that token fired)
    let _ = batcher.await;
    let _ = executor.await;
    let _ = ch.close(REPLY_SUCCESS, "partition released".into()).await;
    let _ = publish.close(REPLY_SUCCESS, "partition released".into()).await;
    metrics::buffer_state(p, 0, 0.0);
    info!(partition = p, epoch = ctx.epoch, "partition drained");
    Ok(())
}

/// The executor: one task per batch until the batcher's output closes, then waits for them all.
/// The LLM client's per-endpoint semaphore bounds the concurrent calls.
async fn execute(ctx: PartitionContext, ch: Channel, mut batch_rx: mpsc::Receiver<Batch<PrefixKey, Pending>>, abort: CancellationToken) {
    let mut tasks = tokio::task::JoinSet::new();
    let mut seq = 0u64;
    loop {
        tokio::select! {
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            batch = batch_rx.recv() => match batch {
                Some(batch) => {
                    seq += 1;
                    let batch_id = format!("{}-{}-{}", ctx.partition, ctx.epoch, seq);
                    let span = info_span!("batch", partition = ctx.partition, batch_id = %batch_id, key = %batch.key);
                    tasks.spawn(process_batch(ctx.clone(), ch.clone(), batch, batch_id, abort.clone()).instrument(span));
                }
                None => break,
            },
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// Parses a delivery from a partition queue. The router validated it already; a message that
/// still fails (e.g. published straight to a partition queue) is dead-lettered and acked
/// ([`publisher::parse_or_dead_letter`]), or left unacked while the lease is not valid.
async fn accept(ctx: &PartitionContext, ch: &Channel, delivery: Delivery) -> Option<Pending> {
    let s = &ctx.settings;
    let (req, delivery) = match publisher::parse_or_dead_letter(ch, &s.amqp, delivery, Some(&ctx.lease)).await {
        Intake::Valid(req, delivery) => (req, delivery),
        Intake::DeadLettered | Intake::Unacked(_) => return None,
    };
    metrics::requests(stage::BATCHER, outcome::RECEIVED, 1);
    let headers = delivery.properties.headers().as_ref();
    let shard = header_u64(headers, HEADER_SHARD).unwrap_or(0) as u32;
    // Millisecond publish time when the publisher (or RabbitMQ's message-timestamp plugin) set
    // header `timestamp_in_ms`; else the AMQP `timestamp`, whole seconds only.
    let enqueued_unix_ms =
        header_u64(headers, HEADER_TIMESTAMP_MS).or_else(|| delivery.properties.timestamp().map(|t| t.saturating_mul(1000)));
    let queued_ms = enqueued_unix_ms.map_or(0, |t| unix_ms().saturating_sub(t));
    let key = crate::splits::batch_key(s, ctx.partition, &req, headers, queued_ms);
    Some(Pending { delivery, req, key, shard, received: Instant::now(), queued_ms, enqueued_unix_ms })
}

/// Runs one batch: LLM call, then one confirmed result per request, then its ack.
async fn process_batch(ctx: PartitionContext, ch: Channel, batch: Batch<PrefixKey, Pending>, batch_id: String, abort: CancellationToken) {
    let n = batch.items.len();
    let purity = batcher::purity(batch.items.iter().map(|p| p.key));
    let texts: Vec<std::borrow::Cow<'_, str>> = batch.items.iter().map(|p| p.req.body.text_for_stats()).collect();
    let shared = batcher::shared_prefix_ratio(&texts);
    drop(texts);
    metrics::batch_flushed(batch.reason, n, purity, shared);
    debug!(size = n, reason = batch.reason.as_str(), purity, "batch flushed");
    if batch.reason == FlushReason::Revoke && abort.is_cancelled() {
        return;
    }

    let flushed = Instant::now();
    let items: Vec<InferenceItem<'_>> = batch
        .items
        .iter()
        .map(|p| InferenceItem { body: &p.req.body, model: p.req.model.as_deref(), params: &p.req.params })
        .collect();
    let endpoint = ctx.llm.endpoint_for(ctx.partition);
    let results = ctx.llm.infer(endpoint, &items, &abort).await;
    let llm_ms = flushed.elapsed().as_millis() as u64;
    drop(items);
    if abort.is_cancelled() {
        return; // lease lost: the channel is closing and the broker requeues these requests
    }

    let tenure = Tenure { partition: ctx.partition, epoch: ctx.epoch, instance: &ctx.settings.instance_name, lease: &ctx.lease };
    let info = BatchInfo { partition: ctx.partition, batch_id: &batch_id, batch_size: n };
    let publishes = batch.items.into_iter().zip(results).filter_map(|(pending, answer)| {
        let batch_wait = flushed.saturating_duration_since(pending.received).as_millis() as u64;
        let timings = TimingsMs { queued: pending.queued_ms, batch_wait, llm: llm_ms };
        let result = publisher::shape_result(info, pending.req.id.clone(), pending.key.to_string(), pending.shard, timings, answer)?;
        let span = info_span!("request", request_id = %result.id, shard = pending.shard);
        let publish = publisher::publish_result(&ch, &ctx.settings.amqp, tenure, pending.delivery, result, pending.enqueued_unix_ms);
        Some(publish.instrument(span))
    });
    futures_util::future::join_all(publishes.collect::<Vec<_>>()).await;
}
