//! Publishing with publisher confirms: results, dead letters and forwarded requests.
//!
//! Every publish here waits for the broker's confirm (<https://www.rabbitmq.com/docs/confirms>)
//! before the caller acks the message that caused it: at-least-once end to end. Publishes are
//! `mandatory`, so a message that no queue takes is returned instead of silently dropped.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel};

/// Header carrying the dead-letter reason (a stable kind, see [`crate::request::DEAD_LETTER_REASONS`]).
pub const HEADER_DEATH_REASON: &str = "x-death-reason";
/// Header carrying the human-readable dead-letter detail.
pub const HEADER_DEATH_DETAIL: &str = "x-death-detail";
/// Header carrying the request id on results.
pub const HEADER_REQUEST_ID: &str = "x-request-id";
/// Header carrying the partition lease epoch (fencing token) on results.
pub const HEADER_PARTITION_EPOCH: &str = "x-partition-epoch";
/// Header carrying the partition on results.
pub const HEADER_PARTITION: &str = "x-partition";
/// Header of an explicit prefix key on requests.
pub const HEADER_PREFIX_KEY: &str = "x-prefix-key";
/// Header set by the router on forwarded requests: the chosen shard.
pub const HEADER_SHARD: &str = "x-shard";

/// Header with the publish time in Unix milliseconds, the name RabbitMQ's message-timestamp plugin
/// uses (<https://github.com/rabbitmq/rabbitmq-message-timestamp>); preferred over the AMQP
/// `timestamp` property, which has whole-second resolution.
pub const HEADER_TIMESTAMP_MS: &str = "timestamp_in_ms";

/// AMQP delivery mode 2: persistent.
pub const PERSISTENT: u8 = 2;

/// Publish errors.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Channel or connection failure.
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker refused the message (`basic.nack`).
    #[error("broker nacked the publish")]
    Nacked,
    /// No queue took the message (`basic.return` of a mandatory publish).
    #[error("unroutable: no queue is bound for exchange `{exchange}` routing key `{routing_key}`")]
    Unroutable { exchange: String, routing_key: String },
    /// No confirm within `amqp.confirm_timeout`.
    #[error("no publisher confirm within {0:?}")]
    Timeout(Duration),
}

/// Publishes one message and waits for its confirm. The channel must be in confirm mode.
pub async fn publish_confirmed(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
    timeout: Duration,
) -> Result<(), PublishError> {
    let fut = async {
        let confirm = ch
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() },
                body,
                props,
            )
            .await?
            .await?;
        if confirm.is_nack() {
            return Err(PublishError::Nacked);
        }
        if confirm.take_message().is_some() {
            return Err(PublishError::Unroutable { exchange: exchange.to_owned(), routing_key: routing_key.to_owned() });
        }
        Ok(())
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| PublishError::Timeout(timeout))?
}

/// Copies `headers` and adds `extra` (string values).
pub fn headers_with(base: Option<&FieldTable>, extra: &[(&str, String)]) -> FieldTable {
    let mut t = base.cloned().unwrap_or_default();
    for (k, v) in extra {
        t.insert(ShortString::from(*k), AMQPValue::LongString(v.as_str().into()));
    }
    t
}

/// Reads a string header (long or short string).
pub fn header_str<'a>(headers: Option<&'a FieldTable>, name: &str) -> Option<std::borrow::Cow<'a, str>> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) => Some(std::borrow::Cow::Borrowed(s.as_str())),
        _ => None,
    }
}

/// Reads an integer header.
pub fn header_u64(headers: Option<&FieldTable>, name: &str) -> Option<u64> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        _ => None,
    }
}

/// Publishes a dead letter: the original body and properties, plus `x-death-reason` and
/// `x-death-detail` headers, to the dead-letter exchange.
pub async fn dead_letter(
    ch: &Channel,
    dead_letter_exchange: &str,
    body: &[u8],
    props: &BasicProperties,
    reason: &str,
    detail: &str,
    timeout: Duration,
) -> Result<(), PublishError> {
    let headers = headers_with(
        props.headers().as_ref(),
        &[(HEADER_DEATH_REASON, reason.to_owned()), (HEADER_DEATH_DETAIL, detail.chars().take(1000).collect())],
    );
    let props = props.clone().with_headers(headers).with_delivery_mode(PERSISTENT);
    publish_confirmed(ch, dead_letter_exchange, "", body, props, timeout).await
}
