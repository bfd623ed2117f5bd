//! The minimal pass-through consumer of the overhead benchmark: two hops like the daemon, same
//! broker, same queue types, same publisher confirms, nothing else.
//!
//! Hop 1 (like the router): consume the input queue (quorum, prefetch = the daemon's
//! `amqp.input_prefetch`), publish each message persistent and confirmed through a direct
//! exchange to one middle queue (quorum, single-active-consumer, like a partition queue), then ack.
//! Hop 2 (like a partition worker without batching or LLM): consume the middle queue (prefetch =
//! `amqp.partition_prefetch`), publish a small JSON result to `reply_to`, confirmed, then ack.
//! Every delivery is handled in its own task, as the daemon's router does.

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde_json::json;

fn quorum(single_active: bool) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(ShortString::from("x-queue-type"), AMQPValue::LongString("quorum".into()));
    if single_active {
        t.insert(ShortString::from("x-single-active-consumer"), AMQPValue::Boolean(true));
    }
    t
}

async fn publish_confirmed(ch: &Channel, exchange: &str, key: &str, body: &[u8], props: BasicProperties) -> anyhow::Result<()> {
    let c = ch
        .basic_publish(exchange.into(), key.into(), BasicPublishOptions { mandatory: true, ..Default::default() }, body, props)
        .await?
        .await?;
    anyhow::ensure!(!c.is_nack(), "nacked");
    Ok(())
}

/// Runs until SIGTERM. `name`: prefix of the queues (`{name}.input`, `{name}.pt-mid`) and exchange (`{name}.pt`).
pub async fn run(name: &str, input_prefetch: u16, mid_prefetch: u16) -> anyhow::Result<()> {
    let conn = Connection::connect(crate::procs::AMQP_URL, ConnectionProperties::default()).await?;
    let input = format!("{name}.input");
    let mid = format!("{name}.pt-mid");
    let exchange = format!("{name}.pt");
    let setup = conn.create_channel().await?;
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    setup.queue_declare(input.as_str().into(), durable, quorum(false)).await?;
    setup.queue_declare(mid.as_str().into(), durable, quorum(true)).await?;
    setup
        .exchange_declare(exchange.as_str().into(), ExchangeKind::Direct, ExchangeDeclareOptions { durable: true, ..Default::default() }, FieldTable::default())
        .await?;
    setup.queue_bind(mid.as_str().into(), exchange.as_str().into(), "0".into(), QueueBindOptions::default(), FieldTable::default()).await?;

    // Hop 1.
    let ch1 = conn.create_channel().await?;
    ch1.confirm_select(ConfirmSelectOptions::default()).await?;
    ch1.basic_qos(input_prefetch, BasicQosOptions::default()).await?;
    let mut c1 = ch1.basic_consume(input.as_str().into(), "pt-1".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
    let hop1 = tokio::spawn(async move {
        while let Some(Ok(d)) = c1.next().await {
            let (ch, exchange) = (ch1.clone(), exchange.clone());
            tokio::spawn(async move {
                let props = d.properties.clone().with_delivery_mode(2);
                if publish_confirmed(&ch, &exchange, "0", &d.data, props).await.is_ok() {
                    let _ = d.acker.ack(BasicAckOptions::default()).await;
                }
            });
        }
    });

    // Hop 2.
    let ch2 = conn.create_channel().await?;
    ch2.confirm_select(ConfirmSelectOptions::default()).await?;
    ch2.basic_qos(mid_prefetch, BasicQosOptions::default()).await?;
    let mut c2 = ch2.basic_consume(mid.as_str().into(), "pt-2".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
    let hop2 = tokio::spawn(async move {
        while let Some(Ok(d)) = c2.next().await {
            let ch = ch2.clone();
            tokio::spawn(async move {
                let id = d.properties.correlation_id().as_ref().map(|c| c.to_string()).unwrap_or_default();
                let reply = d.properties.reply_to().as_ref().map(|c| c.to_string()).unwrap_or_default();
                let body = serde_json::to_vec(&json!({"id": id, "ok": true, "output": "pass-through"})).unwrap();
                let props = BasicProperties::default()
                    .with_content_type("application/json".into())
                    .with_delivery_mode(2)
                    .with_correlation_id(id.as_str().into());
                if publish_confirmed(&ch, "", &reply, &body, props).await.is_ok() {
                    let _ = d.acker.ack(BasicAckOptions::default()).await;
                }
            });
        }
    });
    println!("ready");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    term.recv().await;
    hop1.abort();
    hop2.abort();
    let _ = conn.close(200, "pass-through done".into()).await;
    Ok(())
}
