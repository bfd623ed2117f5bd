//! The router: consumes the input queue (competing consumers: every instance runs one), keys each
//! request and forwards it to its partition queue.
//!
//! Per delivery: parse ([`publisher::parse_or_dead_letter`]) → key ([`route`]: in the default
//! adaptive mode the shortest key level that is not split) → pick shard → partition → publish to the shard exchange with
//! routing key = partition, wait for the confirm → ack the input. Bad input is published to the
//! dead-letter exchange with its reason, confirmed, then acked: never dropped, never requeued in a
//! loop. Deliveries are handled concurrently; `amqp.input_prefetch` bounds how many.

use std::sync::Arc;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::amqp::{Connections, REPLY_SUCCESS};
use crate::config::{AmqpSettings, KeyingMode, Settings};
use crate::affinity::{self, RoutedKey};
use crate::keying::{derive_key, level_count, level_key, partition_of, pick_shard, shards_for, static_shards, KeySource};
use crate::metrics::{self, outcome, stage};
use crate::publisher::{self, headers_with, Intake, HEADER_ROUTED_KEY, HEADER_SHARD};
use crate::splits::Affinity;

/// Where one valid request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub request_id: String,
    /// Hex of the key the request routes by (its routed level's key).
    pub key_hex: String,
    /// The key it routes by, with its level; sent as header `x-routed-key`.
    pub routed: RoutedKey,
    /// The first characters of the level-0 key material, for logs.
    pub key_preview: String,
    pub shard: u32,
    pub partition: u32,
}

/// Decides the route of a parsed request with the split view of its deployment
/// ([`Affinity::for_prefix`]); see [`route_in`].
pub fn route(req: &crate::request::Request, settings: &Settings) -> Route {
    route_in(req, settings, &Affinity::for_prefix(&settings.redis.key_prefix))
}

/// Decides the route of a parsed request (no I/O: it reads the local split view; the shard is
/// random):
/// - `adaptive`: a key with a static entry (`sharding.keys`, `sharding.rules`) uses it at level
///   0; any other routes by the shortest level whose key is not split ([`affinity::choose`]),
///   over the shards of a spread key. The arrival and key hygiene are recorded in `affinity`.
/// - `prefix` (static): the level-0 key over `shards_for` shards.
/// - `off`: a random partition.
pub fn route_in(req: &crate::request::Request, settings: &Settings, affinity: &Affinity) -> Route {
    let keyed = derive_key(req, &settings.keying);
    let level0 = RoutedKey { level: 0, levels: 1, key: keyed.key };
    let p = settings.amqp.partitions;
    let (routed, shard, partition) = match settings.keying.mode {
        KeyingMode::Adaptive => {
            let fixed = static_shards(&keyed, &settings.sharding);
            let choice = match fixed {
                Some(n) => affinity::Choice { routed: level0, shards: n, through: Vec::new(), deeper: Vec::new() },
                None => affinity::choose(&affinity.view(), level_count(req), |l| match l {
                    0 => keyed.key,
                    l => level_key(req, &settings.keying, l).expect("choose asks only for levels below level_count"),
                }),
            };
            let unsplittable = fixed.is_some() || (choice.routed.is_finest() && choice.shards >= settings.sharding.max_shards);
            // Explicit keys are names, not prompt text: their length says nothing about caching.
            let material_chars = if keyed.source == KeySource::Explicit { usize::MAX } else { keyed.material.chars().count() };
            affinity.routed(&choice, keyed.key, material_chars, unsplittable);
            let shard = pick_shard(choice.shards);
            (choice.routed, shard, partition_of(choice.routed.key, shard, p))
        }
        KeyingMode::Prefix => {
            let shard = pick_shard(shards_for(&keyed, &settings.sharding));
            (level0, shard, partition_of(keyed.key, shard, p))
        }
        KeyingMode::Off => (level0, 0, fastrand::u32(0..p.get())),
    };
    Route {
        request_id: req.id.clone(),
        key_hex: routed.key.to_string(),
        routed,
        key_preview: keyed.preview().to_owned(),
        shard,
        partition,
    }
}

/// Runs the router until `stop` fires or the connection fails. On stop it cancels its consumer
/// and finishes the deliveries it has (publish, confirm, ack) before returning.
pub async fn run(conns: &Connections, settings: Arc<Settings>, stop: CancellationToken) -> Result<(), lapin::Error> {
    let ch = conns.consume.create_channel().await?;
    let publish = conns.publish_channel().await?;
    ch.basic_qos(settings.amqp.input_prefetch, BasicQosOptions::default()).await?;
    let tag = format!("router-{}", settings.instance_name);
    let mut consumer = ch
        .basic_consume(
            settings.amqp.input_queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    info!(queue = %settings.amqp.input_queue, "router consuming");
    let mut inflight = tokio::task::JoinSet::new();
    let result = loop {
        tokio::select! {
            _ = stop.cancelled() => break Ok(()),
            Some(_) = inflight.join_next(), if !inflight.is_empty() => {}
            next = consumer.next() => match next {
                Some(Ok(delivery)) => {
                    let (ch, settings) = (publish.clone(), settings.clone());
                    inflight.spawn(async move { handle(&ch, &settings, delivery).await });
                }
                Some(Err(e)) => break Err(e),
                None => break Ok(()),
            },
        }
    };
    let _ = ch.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await;
    while inflight.join_next().await.is_some() {}
    let _ = ch.close(REPLY_SUCCESS, "router stopped".into()).await;
    let _ = publish.close(REPLY_SUCCESS, "router stopped".into()).await;
    info!("router stopped");
    result
}

/// Handles one input delivery: parse (or dead-letter), route, forward with a confirm, ack.
/// A delivery whose forward or dead letter is not confirmed is requeued.
async fn handle(ch: &Channel, settings: &Settings, delivery: Delivery) {
    let a = &settings.amqp;
    let (req, delivery) = match publisher::parse_or_dead_letter(ch, a, delivery, None).await {
        Intake::Valid(req, delivery) => (req, delivery),
        Intake::DeadLettered => return,
        Intake::Unacked(delivery) => return requeue(delivery).await,
    };
    let r = route(&req, settings);
    debug!(request_id = %r.request_id, key = %r.key_hex, material = %r.key_preview, shard = r.shard, partition = r.partition, "routing");
    let fwd = forward_props(&delivery.properties, &r);
    let rk = AmqpSettings::partition_routing_key(r.partition);
    if let Err(e) = publisher::publish_confirmed(ch, &a.shard_exchange, &rk, &delivery.data, fwd, a.confirm_timeout).await {
        warn!(error = %e, "forwarding failed; requeueing input");
        return requeue(delivery).await;
    }
    if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await {
        warn!(error = %e, "input ack failed; the broker will redeliver");
        return;
    }
    metrics::requests(stage::ROUTER, outcome::ROUTED, 1);
}

/// Not acked: requeue so another attempt (here or on another instance) can succeed.
async fn requeue(delivery: Delivery) {
    let _ = delivery.acker.nack(BasicNackOptions { requeue: true, ..BasicNackOptions::default() }).await;
}

/// Properties of a forwarded request: the original ones, with `message_id` = request id (so every
/// stage agrees on a generated id), `correlation_id` defaulting to the request id, the shard and
/// the routed key in headers (`x-shard`, `x-routed-key`), and persistent delivery.
fn forward_props(props: &BasicProperties, r: &Route) -> BasicProperties {
    let mut p = props.clone().with_message_id(r.request_id.as_str().into()).with_delivery_mode(publisher::PERSISTENT);
    if props.correlation_id().is_none() {
        p = p.with_correlation_id(r.request_id.as_str().into());
    }
    let extra = [(HEADER_SHARD, r.shard.to_string()), (HEADER_ROUTED_KEY, r.routed.to_string())];
    p.with_headers(headers_with(props.headers().as_ref(), &extra))
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::affinity::{SplitMember, SplitState, SplitView};
    use crate::config::RawConfig;
    use crate::keying::{level_key, PrefixKey};
    use crate::request::{parse, Envelope};

    fn settings(edit: impl FnOnce(&mut RawConfig)) -> Settings {
        let mut raw = RawConfig::default();
        raw.keying.prefix_chars = 8;
        edit(&mut raw);
        Settings::from_raw(&raw).unwrap()
    }

    fn req(json: &str) -> crate::request::Request {
        parse(json.as_bytes(), &Envelope::default(), 1 << 20).unwrap()
    }

    #[test]
    fn adaptive_routes_by_the_shortest_unsplit_level_and_static_entries_win() {
        let s = settings(|r| {
            r.sharding.keys.insert("tenant-1".into(), 3);
        });
        let a = Affinity::default();
        let r = req(r#"{"prompt":"shared prefix, then the rest of a long prompt"}"#);
        let first = route_in(&r, &s, &a);
        assert_eq!((first.routed.level, first.routed.levels, first.shard), (0, 4, 0));
        assert_eq!(first.routed.key, PrefixKey::of("shared p"));

        a.set_view(SplitView::new([SplitMember { level: 0, key: first.routed.key, state: SplitState::Split }]));
        let split = route_in(&r, &s, &a);
        assert_eq!(split.routed.level, 1);
        assert_eq!(Some(split.routed.key), level_key(&r, &s.keying, 1));
        assert_eq!(split.key_hex, split.routed.key.to_string());
        assert_eq!(split.partition, partition_of(split.routed.key, 0, s.amqp.partitions));

        // An explicit key with a static entry keeps its static shards, whatever the view says.
        let t = req(r#"{"prompt":"x","prefix_key":"tenant-1"}"#);
        a.set_view(SplitView::new([SplitMember { level: 0, key: PrefixKey::of("tenant-1"), state: SplitState::Spread(NonZeroU32::new(8).unwrap()) }]));
        for _ in 0..50 {
            let rt = route_in(&t, &s, &a);
            assert!(rt.shard < 3 && rt.routed.level == 0, "{rt:?}");
        }
    }

    #[test]
    fn static_and_off_modes_ignore_the_split_view() {
        let r = req(r#"{"prompt":"shared prefix, then more"}"#);
        let a = Affinity::default();
        a.set_view(SplitView::new([SplitMember { level: 0, key: PrefixKey::of("shared p"), state: SplitState::Split }]));
        let s = settings(|r| {
            r.keying.mode = "prefix".into();
            r.sharding.default_shards = 2;
        });
        for _ in 0..20 {
            let rt = route_in(&r, &s, &a);
            assert_eq!((rt.routed.level, rt.routed.key), (0, PrefixKey::of("shared p")));
            assert!(rt.shard < 2);
        }
        let off = settings(|r| r.keying.mode = "off".into());
        assert_eq!(route_in(&r, &off, &a).shard, 0);
    }
}
