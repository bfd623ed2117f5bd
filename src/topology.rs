//! Declares and checks the RabbitMQ topology: input queue, shard exchange, `P` partition queues,
//! results queue, dead-letter exchange and queue.
//!
//! Declarations are idempotent. RabbitMQ refuses to redeclare a queue with other arguments
//! (`PRECONDITION_FAILED`, reply code 406, <https://www.rabbitmq.com/docs/queues#property-equivalence>);
//! that refusal is turned into a [`TopologyError::Mismatch`] naming the queue. A deployment's
//! partition count is also checked: partition queue `P` must not exist (else the deployment has
//! more partitions than configured), and Redis records `P` at first start (`{prefix}:partitions`).

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Connection, ExchangeKind};
use tracing::warn;

use crate::amqp::{answered, close_channel, reply_code, NOT_FOUND, PRECONDITION_FAILED};
use crate::config::AmqpSettings;

/// Topology errors. [`TopologyError::is_config_error`] tells a configuration or deployment
/// mismatch (exit 78) from a broker or Redis failure (retried).
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// An existing queue or exchange has other arguments than configured (the broker refused
    /// the redeclare with reply code 406 `PRECONDITION_FAILED`).
    #[error("{what} `{name}` exists with other settings than configured ({source}){}; delete it or change the configuration", configured_by(&source.to_string()))]
    Mismatch {
        what: &'static str,
        name: String,
        #[source]
        source: lapin::Error,
    },
    /// The broker refused to create a queue because a queue limit is reached (406
    /// `PRECONDITION_FAILED` "… queue limit in vhost … is reached": the vhost's `max-queues`, or
    /// the cluster's). Not a configuration error: it clears when queues are deleted or the limit
    /// is raised, so it is retried.
    #[error("{what} `{name}` cannot be declared: the broker's queue limit is reached (the vhost's max-queues: rabbitmqctl list_vhost_limits; or the cluster-wide limit) ({source})")]
    QueueLimit {
        what: &'static str,
        name: String,
        #[source]
        source: lapin::Error,
    },
    /// The deployment has another partition count.
    #[error("the deployment has {existing} partitions but amqp.partitions = {configured}; the partition count is fixed for the life of a deployment (to change it: stop publishing and let the deployment empty its partition queues, stop every instance, delete the partition queues and the Redis key `{redis_key}`, then start the instances with the new count; deleting a queue under a running instance only has it declared again, and deletes the requests it held)")]
    PartitionCount { existing: String, configured: u32, redis_key: String },
    /// The deployment routes through another shard exchange, other partition queues, or another
    /// dead-letter exchange or queue.
    #[error("the deployment routes requests through {existing} but this instance is configured for {configured} (amqp.shard_exchange, amqp.partition_queue_prefix, amqp.dead_letter_exchange, amqp.dead_letter_queue); they are fixed for the life of a deployment: instances with both would leave two sets of queues bound to one exchange, so requests or dead letters would be copied into both or stranded in the old ones. To change them: stop every instance, drain or move the old queues' messages, delete the old queues, and delete the Redis key `{redis_key}`")]
    PartitionRoute { existing: String, configured: String, redis_key: String },
    /// Broker or connection failure.
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    /// Redis failure while checking the partition count.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

impl TopologyError {
    /// Whether the configuration or the deployment is wrong (retrying cannot help; exit 78).
    pub fn is_config_error(&self) -> bool {
        matches!(self, TopologyError::Mismatch { .. } | TopologyError::PartitionCount { .. } | TopologyError::PartitionRoute { .. })
    }
}

/// The configuration keys behind each queue argument the daemon declares, by the argument's name
/// as RabbitMQ quotes it in a 406 refusal (`inequivalent arg 'x-delivery-limit' for queue …`).
const ARGUMENT_KEYS: [(&str, &str); 5] = [
    ("x-delivery-limit", "amqp.delivery_limit (the queue argument is amqp.delivery_limit + 2)"),
    ("x-quorum-initial-group-size", "amqp.quorum_initial_group_size"),
    ("x-dead-letter-exchange", "amqp.dead_letter_exchange"),
    ("x-single-active-consumer", "no key (partition queues always have a single active consumer)"),
    ("x-queue-type", "no key (the daemon's queues are quorum queues)"),
];

/// `": set by KEY"` for the argument a broker refusal names ([`ARGUMENT_KEYS`]), else nothing.
fn configured_by(refusal: &str) -> String {
    ARGUMENT_KEYS
        .iter()
        .find(|(arg, _)| refusal.contains(&format!("'{arg}'")))
        .map(|(_, key)| format!(": set by {key}"))
        .unwrap_or_default()
}

/// Turns a refused declare into a [`TopologyError`]: 406 `PRECONDITION_FAILED` is a mismatch, or
/// a reached queue limit when the broker says so.
fn declare_error(what: &'static str, name: &str, e: lapin::Error) -> TopologyError {
    if reply_code(&e) == Some(PRECONDITION_FAILED) && e.to_string().contains("queue limit") {
        TopologyError::QueueLimit { what, name: name.to_owned(), source: e }
    } else if reply_code(&e) == Some(PRECONDITION_FAILED) {
        TopologyError::Mismatch { what, name: name.to_owned(), source: e }
    } else {
        e.into()
    }
}

/// Queue argument of a quorum queue's delivery limit.
const DELIVERY_LIMIT_ARG: &str = "x-delivery-limit";

/// Queue argument of a new quorum queue's replica count
/// (<https://www.rabbitmq.com/docs/quorum-queues#replication-factor>).
const INITIAL_GROUP_SIZE_ARG: &str = "x-quorum-initial-group-size";

/// Arguments a queue declared by an older version may lack: a redeclare that the broker refuses
/// (406) is repeated without them (see [`declare_queue`]), most recent first.
const LATER_ARGS: [&str; 2] = [INITIAL_GROUP_SIZE_ARG, DELIVERY_LIMIT_ARG];

/// How many deliveries beyond `amqp.delivery_limit` the broker allows before it dead-letters a
/// message by itself (see [`input_queue_args`]).
pub const BROKER_DELIVERY_LIMIT_MARGIN: u32 = 2;

/// Arguments of the input queue: a quorum queue dead-lettering to `amqp.dead_letter_exchange`,
/// with `x-delivery-limit` = `amqp.delivery_limit` + [`BROKER_DELIVERY_LIMIT_MARGIN`]
/// (<https://www.rabbitmq.com/docs/quorum-queues#poison-message-handling>). The daemon
/// dead-letters a request delivered `amqp.delivery_limit` times itself, with reason
/// `delivery_limit` and its last error; the broker's limit is a backstop for a message the daemon
/// never gets to handle (its task keeps dying), dead-lettered through the same exchange with the
/// broker's own `x-death` reason (`delivery_limit`), so nothing is dropped.
///
/// Every quorum queue the daemon declares also carries `x-quorum-initial-group-size` =
/// `amqp.quorum_initial_group_size` unless that is 0 (see `group_size`).
pub fn input_queue_args(cfg: &AmqpSettings) -> FieldTable {
    group_size(cfg, quorum_args(Some(&cfg.dead_letter_exchange), false, Some(broker_delivery_limit(cfg))))
}

/// Arguments of a partition queue: those of [`input_queue_args`], with a single active consumer.
pub fn partition_queue_args(cfg: &AmqpSettings) -> FieldTable {
    group_size(cfg, quorum_args(Some(&cfg.dead_letter_exchange), true, Some(broker_delivery_limit(cfg))))
}

/// Arguments of the results and dead-letter queues: quorum queues without a delivery limit.
pub fn plain_quorum_args(cfg: &AmqpSettings) -> FieldTable {
    group_size(cfg, quorum_args(None, false, None))
}

/// Adds `x-quorum-initial-group-size` = `amqp.quorum_initial_group_size` (when not 0): the
/// replicas a NEW quorum queue gets. RabbitMQ caps it at the number of cluster nodes, so 3 works
/// on a single node too (one replica); it does not change an existing queue (members are added
/// with `rabbitmq-queues add_member` or `grow`).
fn group_size(cfg: &AmqpSettings, mut t: FieldTable) -> FieldTable {
    if let Some(n) = cfg.quorum_initial_group_size {
        t.insert(ShortString::from(INITIAL_GROUP_SIZE_ARG), AMQPValue::LongLongInt(i64::from(n.get())));
    }
    t
}

fn broker_delivery_limit(cfg: &AmqpSettings) -> u32 {
    cfg.delivery_limit.get().saturating_add(BROKER_DELIVERY_LIMIT_MARGIN)
}

fn quorum_args(dlx: Option<&str>, single_active: bool, delivery_limit: Option<u32>) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(ShortString::from("x-queue-type"), AMQPValue::LongString("quorum".into()));
    if single_active {
        t.insert(ShortString::from("x-single-active-consumer"), AMQPValue::Boolean(true));
    }
    if let Some(dlx) = dlx {
        t.insert(ShortString::from("x-dead-letter-exchange"), AMQPValue::LongString(dlx.into()));
    }
    if let Some(n) = delivery_limit {
        t.insert(ShortString::from(DELIVERY_LIMIT_ARG), AMQPValue::LongLongInt(i64::from(n)));
    }
    t
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() }
}

/// Declares a queue on a fresh channel, so a refusal (which closes the channel) affects nothing
/// else.
///
/// A queue declared by a version without `x-delivery-limit` or `x-quorum-initial-group-size`
/// ([`LATER_ARGS`]) refuses a redeclare with them (406 `PRECONDITION_FAILED`, also when the values
/// would change nothing): then the declare is repeated without the one, then the other, then
/// both, and accepted with a warning when the queue matches otherwise. Without
/// `x-delivery-limit` the broker's backstop is missing unless a `delivery-limit` policy sets it
/// (docs/operations.md "Upgrading to the broker delivery limit"); without
/// `x-quorum-initial-group-size` nothing changes for an existing queue (the argument only sizes a
/// new one).
///
/// For the same reason a queue declared with another `x-quorum-initial-group-size` (the key
/// changed, or set to 0, after the queue was made) is accepted with a warning: the refusal says
/// the queue's value ([`existing_value`]), and the declare is repeated with it (and without
/// `x-delivery-limit` if that is missing too). A refusal for any other argument, or another
/// `x-delivery-limit`, is returned as a [`TopologyError::Mismatch`] naming that argument.
async fn declare_queue(conn: &Connection, name: &str, args: FieldTable) -> Result<(), TopologyError> {
    let err = match declare_queue_once(conn, name, args.clone()).await {
        Err(e @ TopologyError::Mismatch { .. }) => e,
        other => return other,
    };
    let mut refusals = vec![err.to_string()];
    let present: Vec<&str> = LATER_ARGS.into_iter().filter(|a| args.contains_key(a)).collect();
    // Subsets to leave out, the smallest first: each alone, then all of them.
    let mut attempts: Vec<Vec<&str>> = present.iter().map(|a| vec![*a]).collect();
    if present.len() > 1 {
        attempts.push(present.clone());
    }
    for omit in attempts {
        match declare_queue_once(conn, name, without_args(&args, &omit)).await {
            Ok(()) => {
                // Each warning once per queue and process: every session's declare meets the
                // queue again (one line per queue per reconnect otherwise).
                for arg in omit.iter().filter(|a| warned_once(name, a)) {
                    warn_omitted(name, arg);
                }
                return Ok(());
            }
            Err(e @ TopologyError::Mismatch { .. }) => refusals.push(e.to_string()),
            Err(e) => return Err(e),
        }
    }
    let Some(existing) = refusals.iter().find_map(|r| existing_value(r, INITIAL_GROUP_SIZE_ARG)) else {
        return Err(err);
    };
    let mut with_existing = args.clone();
    with_existing.insert(ShortString::from(INITIAL_GROUP_SIZE_ARG), AMQPValue::LongLongInt(existing));
    let configured = match args.inner().get(INITIAL_GROUP_SIZE_ARG) {
        Some(AMQPValue::LongLongInt(n)) => n.to_string(),
        _ => "none (amqp.quorum_initial_group_size = 0)".to_owned(),
    };
    let omissions: &[&[&str]] = if args.contains_key(DELIVERY_LIMIT_ARG) { &[&[], &[DELIVERY_LIMIT_ARG]] } else { &[&[]] };
    // The group size is accepted: what the queue refuses now (another delivery limit) is the
    // mismatch to report.
    let mut blocking = None;
    for omit in omissions {
        match declare_queue_once(conn, name, without_args(&with_existing, omit)).await {
            Ok(()) => {
                if warned_once(name, INITIAL_GROUP_SIZE_ARG) {
                    warn!(
                        queue = name,
                        existing,
                        configured = %configured,
                        "queue has another x-quorum-initial-group-size than configured (amqp.quorum_initial_group_size); accepted as it is: the argument only sizes a new queue (`rabbitmq-queues grow` and `shrink` change an existing queue's replicas)"
                    );
                }
                for arg in omit.iter().filter(|a| warned_once(name, a)) {
                    warn_omitted(name, arg);
                }
                return Ok(());
            }
            Err(e @ TopologyError::Mismatch { .. }) => {
                blocking.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(blocking.unwrap_or(err))
}

/// Warns that `queue` was accepted although it lacks `argument` ([`LATER_ARGS`]).
fn warn_omitted(queue: &str, argument: &str) {
    match argument {
        DELIVERY_LIMIT_ARG => warn!(queue, "queue was declared without x-delivery-limit; the broker's delivery-limit backstop is off unless a policy sets delivery-limit"),
        _ => warn!(queue, argument, "queue was declared without this argument; accepted as it is (the argument only sizes a new queue; `rabbitmq-queues grow` adds replicas)"),
    }
}

/// True the first time it is called for `queue` and `argument` in this process: a warning about
/// a queue's argument that each session's declare would repeat is logged once.
fn warned_once(queue: &str, argument: &str) -> bool {
    static WARNED: std::sync::Mutex<std::collections::BTreeSet<(String, String)>> = std::sync::Mutex::new(std::collections::BTreeSet::new());
    WARNED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert((queue.to_owned(), argument.to_owned()))
}

/// `args` without the arguments named in `omit`.
fn without_args(args: &FieldTable, omit: &[&str]) -> FieldTable {
    let mut without = FieldTable::default();
    for (k, v) in args.inner().iter().filter(|(k, _)| !omit.contains(&k.as_str())) {
        without.insert(k.clone(), v.clone());
    }
    without
}

/// The integer value an existing queue has for `arg`, from RabbitMQ's 406 refusal of a declare
/// that differs in it: `inequivalent arg 'ARG' for queue 'Q' in vhost '/': received … but current
/// is 'N'` (both declares set the argument) or `… but current is the value 'N' of type 'long'`
/// (the refused declare left it out). Format of `rabbit_misc:assert_args_equivalence` in
/// rabbitmq-server 3.8–4.x. `None` when the refusal names another argument, or the queue has
/// none.
fn existing_value(refusal: &str, arg: &str) -> Option<i64> {
    let (_, rest) = refusal.split_once(&format!("inequivalent arg '{arg}'"))?;
    let (_, current) = rest.split_once("but current is ")?;
    let current = current.strip_prefix("the value ").unwrap_or(current).strip_prefix('\'')?;
    let (value, _) = current.split_once('\'')?;
    value.parse().ok()
}

async fn declare_queue_once(conn: &Connection, name: &str, args: FieldTable) -> Result<(), TopologyError> {
    let ch = answered("channel.open", conn.create_channel()).await?;
    match answered("queue.declare", ch.queue_declare(name.into(), durable(), args)).await {
        Ok(_) => {
            let _ = close_channel(&ch, "ok").await;
            Ok(())
        }
        Err(e) => Err(declare_error("queue", name, e)),
    }
}

async fn declare_exchange(conn: &Connection, name: &str, kind: ExchangeKind) -> Result<(), TopologyError> {
    let ch = answered("channel.open", conn.create_channel()).await?;
    let opts = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
    match answered("exchange.declare", ch.exchange_declare(name.into(), kind, opts, FieldTable::default())).await {
        Ok(()) => {
            let _ = close_channel(&ch, "ok").await;
            Ok(())
        }
        Err(e) => Err(declare_error("exchange", name, e)),
    }
}

/// Whether a queue exists (passive declare on a throwaway channel; the broker answers a missing
/// queue with reply code 404 `NOT_FOUND`).
pub async fn queue_exists(conn: &Connection, name: &str) -> Result<bool, lapin::Error> {
    let ch = answered("channel.open", conn.create_channel()).await?;
    let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    match answered("queue.declare", ch.queue_declare(name.into(), opts, FieldTable::default())).await {
        Ok(_) => {
            let _ = close_channel(&ch, "ok").await;
            Ok(true)
        }
        Err(e) if reply_code(&e) == Some(NOT_FOUND) => {
            // With `RUST_LOG` naming the AMQP client (`RUST_LOG=debug`), lapin logs this answer at
            // ERROR; it is the check's expected answer at every start.
            tracing::debug!(queue = name, "no such queue: the channel closed with NOT_FOUND is this check's answer, not a fault");
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Redis key recording a deployment's partition count (see [`declare`]).
pub fn partition_count_key(prefix: &str) -> String {
    format!("{prefix}:partitions")
}

/// Redis key recording a deployment's shard exchange and partition queue names (see [`declare`]),
/// next to its partition count (`count_key`, [`partition_count_key`]).
pub fn partition_route_key(count_key: &str) -> String {
    format!("{count_key}:route")
}

/// How [`partition_route_key`] records the route: `` exchange `X`, partition queues `P.NNN`,
/// dead letters `DLX` to `DLQ` ``.
pub fn partition_route(cfg: &AmqpSettings) -> String {
    format!(
        "exchange `{}`, partition queues `{}.NNN`, dead letters `{}` to `{}`",
        cfg.shard_exchange, cfg.partition_queue_prefix, cfg.dead_letter_exchange, cfg.dead_letter_queue
    )
}

/// Declares everything, idempotently, and checks the partition count against the broker and
/// Redis (`redis_key` = `{prefix}:partitions`), and the shard exchange and partition queue names
/// against Redis ([`partition_route_key`]): a deployment whose instances disagree on them would
/// have two sets of partition queues bound to one exchange (every request copied into both) or
/// requests stranded in queues no instance consumes.
pub async fn declare(
    conn: &Connection,
    cfg: &AmqpSettings,
    redis: &mut redis::aio::ConnectionManager,
    redis_key: &str,
) -> Result<(), TopologyError> {
    let p = cfg.partitions.get();
    // Partition count first: nothing is declared for a deployment we would refuse to run.
    let recorded: Option<String> = redis::cmd("GET").arg(redis_key).query_async(redis).await?;
    if let Some(existing) = recorded.filter(|e| *e != p.to_string()) {
        // The broker's partition queues are the deployment: when exactly the configured P of them
        // exist (queue P-1 does, queue P does not), the record is stale, as after Redis was
        // restored from data older than a partition-count change, and would otherwise refuse
        // every instance with either count.
        let broker_has_p = queue_exists(conn, &cfg.partition_queue(p - 1)).await? && !queue_exists(conn, &cfg.partition_queue(p)).await?;
        if !broker_has_p {
            return Err(TopologyError::PartitionCount { existing, configured: p, redis_key: redis_key.to_owned() });
        }
        warn!(
            recorded = %existing,
            partitions = p,
            redis_key,
            "Redis records another partition count than the broker's partition queues show, which match amqp.partitions (queues 0 to P-1 exist, queue P does not): the record is stale (Redis restored from older data?); recording the broker's count"
        );
        let _: () = redis::cmd("SET").arg(redis_key).arg(p).query_async(redis).await?;
    }
    // Partition queues are declared from P-1 down to 0, so "queue 0 exists" means the whole set
    // exists: a missing queue P-1 then reveals a smaller deployment, an existing queue P a larger one.
    if queue_exists(conn, &cfg.partition_queue(p)).await? {
        return Err(TopologyError::PartitionCount { existing: format!("more than {p}"), configured: p, redis_key: redis_key.to_owned() });
    }
    if queue_exists(conn, &cfg.partition_queue(0)).await? && !queue_exists(conn, &cfg.partition_queue(p - 1)).await? {
        return Err(TopologyError::PartitionCount { existing: format!("fewer than {p}"), configured: p, redis_key: redis_key.to_owned() });
    }
    // The route is recorded before anything is declared: of two instances started at once with
    // other names, the second is refused before it binds its queues next to the first's.
    record_route(conn, cfg, redis, redis_key).await?;
    // So is the count, once the broker showed no other: of two instances of a new deployment
    // started at once with other counts, the second is refused before it declares a queue (its
    // extra partition queues, bound and never consumed, would otherwise make the deployment look
    // larger than it is once Redis lost the record).
    record_count(redis, redis_key, p).await?;

    declare_dead_letter(conn, cfg).await?;
    declare_queue(conn, &cfg.input_queue, input_queue_args(cfg)).await?;
    declare_results(conn, cfg).await?;
    declare_exchange(conn, &cfg.shard_exchange, ExchangeKind::Direct).await?;
    let ch = answered("channel.open", conn.create_channel()).await?;
    for part in (0..p).rev() {
        let q = cfg.partition_queue(part);
        declare_queue(conn, &q, partition_queue_args(cfg)).await?;
        let bind = ch.queue_bind(
            q.as_str().into(),
            cfg.shard_exchange.as_str().into(),
            AmqpSettings::partition_routing_key(part).into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        );
        answered("queue.bind", bind).await?;
    }
    let _ = close_channel(&ch, "ok").await;
    // Again once everything exists (Redis may have lost the record meanwhile); re-read to catch a
    // concurrent start with another P.
    record_count(redis, redis_key, p).await?;
    Ok(())
}

/// Records the deployment's route (its queue and exchange names, [`partition_route`]) in Redis
/// unless one is recorded, and refuses another recorded route, unless that record is stale (its
/// first partition queue is gone and this configuration's exists: Redis restored from data
/// older than a change of the names), which is then replaced.
async fn record_route(conn: &Connection, cfg: &AmqpSettings, redis: &mut redis::aio::ConnectionManager, redis_key: &str) -> Result<(), TopologyError> {
    let (route_key, route) = (partition_route_key(redis_key), partition_route(cfg));
    let _: bool = redis::cmd("SETNX").arg(&route_key).arg(&route).query_async(redis).await?;
    let recorded: Option<String> = redis::cmd("GET").arg(&route_key).query_async(redis).await?;
    if let Some(existing) = recorded.filter(|e| *e != route) {
        // A stale record (Redis restored from data older than a change of the names): the
        // recorded names' first partition queue is gone and this configuration's exists.
        let stale = match recorded_first_partition_queue(&existing) {
            Some(old) if old != cfg.partition_queue(0) => !queue_exists(conn, &old).await? && queue_exists(conn, &cfg.partition_queue(0)).await?,
            _ => false,
        };
        if !stale {
            return Err(TopologyError::PartitionRoute { existing, configured: route, redis_key: route_key });
        }
        warn!(
            recorded = %existing,
            configured = %route,
            redis_key = %route_key,
            "Redis records other queue names than the broker has: the recorded partition queues do not exist and the configured ones do, so the record is stale (Redis restored from older data?); recording the configured route"
        );
        let _: () = redis::cmd("SET").arg(&route_key).arg(&route).query_async(redis).await?;
    }
    Ok(())
}

/// Records partition count `p` under `redis_key` unless one is recorded, and refuses another
/// recorded count (of two instances started at once with other counts, the second).
async fn record_count(redis: &mut redis::aio::ConnectionManager, redis_key: &str, p: u32) -> Result<(), TopologyError> {
    let _: bool = redis::cmd("SETNX").arg(redis_key).arg(p).query_async(redis).await?;
    let recorded: Option<String> = redis::cmd("GET").arg(redis_key).query_async(redis).await?;
    if let Some(existing) = recorded.filter(|e| *e != p.to_string()) {
        return Err(TopologyError::PartitionCount { existing, configured: p, redis_key: redis_key.to_owned() });
    }
    Ok(())
}

/// Partition queue 0 of a route recorded by [`partition_route`] (`` partition queues `P.NNN` ``
/// gives `P.000`); `None` when the text has no such part.
fn recorded_first_partition_queue(route: &str) -> Option<String> {
    let rest = &route[route.find("partition queues `")? + "partition queues `".len()..];
    Some(format!("{}.000", rest.split(".NNN`").next().filter(|p| !p.is_empty() && p.len() < rest.len())?))
}

/// Declares the dead-letter exchange (fanout) and the dead-letter queue, and binds the queue to
/// the exchange, idempotently: at startup ([`declare`]), and when a dead letter finds them missing
/// at run time (someone deleted the queue or the exchange; [`crate::publisher::dead_letter_and_ack`]).
pub async fn declare_dead_letter(conn: &Connection, cfg: &AmqpSettings) -> Result<(), TopologyError> {
    declare_exchange(conn, &cfg.dead_letter_exchange, ExchangeKind::Fanout).await?;
    declare_queue(conn, &cfg.dead_letter_queue, plain_quorum_args(cfg)).await?;
    let ch = answered("channel.open", conn.create_channel()).await?;
    let (queue, exchange) = (cfg.dead_letter_queue.as_str(), cfg.dead_letter_exchange.as_str());
    answered("queue.bind", ch.queue_bind(queue.into(), exchange.into(), "".into(), QueueBindOptions::default(), FieldTable::default())).await?;
    let _ = close_channel(&ch, "ok").await;
    Ok(())
}

/// Declares the results queue (`amqp.results_queue`), idempotently: at startup ([`declare`]),
/// and when a result finds it missing at run time ([`crate::publisher::publish_result`]).
pub async fn declare_results(conn: &Connection, cfg: &AmqpSettings) -> Result<(), TopologyError> {
    declare_queue(conn, &cfg.results_queue, plain_quorum_args(cfg)).await
}

/// Declares the shard exchange and partition queue `p`, bound to it, idempotently: when a
/// forward finds its route missing at run time (the exchange or the queue was deleted; the
/// router, through [`crate::publisher::declare_again`]).
pub async fn declare_route(conn: &Connection, cfg: &AmqpSettings, p: u32) -> Result<(), TopologyError> {
    declare_exchange(conn, &cfg.shard_exchange, ExchangeKind::Direct).await?;
    declare_partition(conn, cfg, p).await
}

/// Declares partition queue `p` with the arguments [`declare`] gives it and binds it to the shard
/// exchange, idempotently: a partition worker calls it when its queue was deleted under it
/// (consume refused with 404 `NOT_FOUND`, or the consumer cancelled by the broker).
pub async fn declare_partition(conn: &Connection, cfg: &AmqpSettings, p: u32) -> Result<(), TopologyError> {
    let queue = cfg.partition_queue(p);
    declare_queue(conn, &queue, partition_queue_args(cfg)).await?;
    let ch = answered("channel.open", conn.create_channel()).await?;
    let (exchange, key) = (cfg.shard_exchange.as_str(), AmqpSettings::partition_routing_key(p));
    let bound = answered("queue.bind", ch.queue_bind(queue.as_str().into(), exchange.into(), key.into(), QueueBindOptions::default(), FieldTable::default())).await;
    let _ = close_channel(&ch, if bound.is_ok() { "ok" } else { "queue.bind failed" }).await;
    bound?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_first_partition_queue_of_a_recorded_route() {
        let mut cfg = crate::config::Settings::from_raw(&crate::config::RawConfig::default()).unwrap().amqp;
        cfg.partition_queue_prefix = "a.b-c".into();
        assert_eq!(super::recorded_first_partition_queue(&super::partition_route(&cfg)).as_deref(), Some("a.b-c.000"));
        assert_eq!(super::recorded_first_partition_queue("something else"), None);
        assert_eq!(super::recorded_first_partition_queue("partition queues `x"), None);
    }

    use super::*;
    use crate::config::{RawConfig, Settings};

    /// A refusal names the configuration key behind the argument (a changed
    /// `amqp.delivery_limit` used to print only the broker's `x-delivery-limit`).
    #[test]
    fn a_mismatch_names_the_key_behind_the_argument() {
        let refusal = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received '7' but current is '6'";
        assert_eq!(configured_by(refusal), ": set by amqp.delivery_limit (the queue argument is amqp.delivery_limit + 2)");
        assert!(configured_by("inequivalent arg 'x-dead-letter-exchange' for queue").contains("amqp.dead_letter_exchange"));
        assert_eq!(configured_by("inequivalent arg 'x-max-length' for queue"), "");
        assert_eq!(BROKER_DELIVERY_LIMIT_MARGIN, 2, "the text above says + 2");
    }

    /// An existing queue's group size is read from the broker's refusal, in both of RabbitMQ's
    /// forms (both declares set it; the refused one left it out), and only for that argument.
    #[test]
    fn the_existing_group_size_is_read_from_the_refusal() {
        let g = "x-quorum-initial-group-size";
        let both = "queue `p.000` exists with other settings than configured (PRECONDITION_FAILED - inequivalent arg 'x-quorum-initial-group-size' for queue 'p.000' in vhost '/': received '1' but current is '3')";
        assert_eq!(existing_value(both, g), Some(3));
        let left_out = "PRECONDITION_FAILED - inequivalent arg 'x-quorum-initial-group-size' for queue 'q' in vhost '/': received none but current is the value '5' of type 'long'";
        assert_eq!(existing_value(left_out, g), Some(5));
        let queue_has_none = "PRECONDITION_FAILED - inequivalent arg 'x-quorum-initial-group-size' for queue 'q' in vhost '/': received the value '3' of type 'long' but current is none";
        assert_eq!(existing_value(queue_has_none, g), None, "no value: the omission attempts handle it");
        let other_arg = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received '7' but current is '6'";
        assert_eq!(existing_value(other_arg, g), None, "another argument's value is not the group size");
        assert_eq!(existing_value("inequivalent arg 'x-quorum-initial-group-size' for queue 'q': received '1' but current is 'x'", g), None);
    }

    /// A declare refused by a reached queue limit is retried, and says so; an argument mismatch
    /// stops the daemon.
    #[test]
    fn a_queue_limit_is_not_a_mismatch() {
        use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};
        let refused = |text: &str| -> lapin::Error { lapin::ErrorKind::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED), text.into())).into() };
        let limit = declare_error("queue", "q", refused("PRECONDITION_FAILED - cannot declare queue 'q': queue limit in vhost 'v' (13) is reached"));
        assert!(matches!(limit, TopologyError::QueueLimit { .. }) && !limit.is_config_error());
        assert!(limit.to_string().contains("queue limit is reached") && !limit.to_string().contains("other settings"), "{limit}");
        let mismatch = declare_error("queue", "q", refused("PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q'"));
        assert!(matches!(mismatch, TopologyError::Mismatch { .. }) && mismatch.is_config_error());
    }

    #[test]
    fn input_and_partition_queues_carry_the_broker_delivery_limit() {
        let mut raw = RawConfig::default();
        raw.amqp.delivery_limit = 5;
        let s = Settings::from_raw(&raw).unwrap();
        for (args, single) in [(input_queue_args(&s.amqp), false), (partition_queue_args(&s.amqp), true)] {
            let t = args.inner();
            assert_eq!(t.get("x-delivery-limit"), Some(&AMQPValue::LongLongInt(7)));
            assert_eq!(t.get("x-dead-letter-exchange"), Some(&AMQPValue::LongString(s.amqp.dead_letter_exchange.as_str().into())));
            assert_eq!(t.contains_key("x-single-active-consumer"), single);
            assert_eq!(t.get("x-quorum-initial-group-size"), Some(&AMQPValue::LongLongInt(3)));
        }
        assert_eq!(plain_quorum_args(&s.amqp).inner().get("x-quorum-initial-group-size"), Some(&AMQPValue::LongLongInt(3)));
        raw.amqp.quorum_initial_group_size = 0;
        let s = Settings::from_raw(&raw).unwrap();
        for args in [input_queue_args(&s.amqp), partition_queue_args(&s.amqp), plain_quorum_args(&s.amqp)] {
            assert!(!args.contains_key("x-quorum-initial-group-size"), "0 leaves the argument out");
        }
    }
}
