//! The minimal pass-through consumer of the overhead benchmark: two hops like the daemon, same
//! broker, same queue types, same publisher confirms, nothing else.
//!
//! Hop 1 (like the router): consume the input queue (quorum, prefetch = the daemon's
//! `amqp.input_prefetch`), publish each message persistent and confirmed through a direct
//! exchange to one middle queue (quorum, single-active-consumer, like a partition queue), then ack.
//! Hop 2 (like a partition worker without batching or LLM): consume the middle queue (prefetch =
//! `amqp.partition_prefetch`), publish a small JSON result to `reply_to`, confirmed, then ack.
//! Every delivery is handled in its own task, as the daemon's router does.
//!
//! Two variants bring it closer to the daemon, one step each:
//! - `connections = 2`: publishes go through a second connection, as the daemon's do (RabbitMQ
//!   blocks publishing connections under an alarm, so consumers and their acks get their own;
//!   <https://www.rabbitmq.com/docs/connection-blocked>). Each connection has its own I/O thread in
//!   lapin, so this adds the thread hand-offs the daemon pays.
//! - `llm = Some(url)`: hop 2 also calls the LLM, one `POST /v1/completions` per message (no
//!   batching), and publishes its text: a competing consumer that does the daemon's job without
//!   keying, batching or leases.

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

/// Calls the LLM for one request body (`{"prompt": …}`) and returns the completion's text.
async fn complete(http: &reqwest::Client, url: &str, body: &[u8]) -> anyhow::Result<String> {
    let req: serde_json::Value = serde_json::from_slice(body)?;
    let call = json!({"model": "pass-through", "prompt": req["prompt"], "max_tokens": 1});
    let resp: serde_json::Value = http.post(url).json(&call).send().await?.error_for_status()?.json().await?;
    Ok(resp["choices"][0]["text"].as_str().unwrap_or_default().to_owned())
}

/// Runs until SIGTERM. `name`: prefix of the queues (`{name}.input`, `{name}.pt-mid`) and exchange
/// (`{name}.pt`); `connections`: 1 (one connection for everything) or 2 (publishes on a second
/// one); `llm`: base URL of an OpenAI-compatible server hop 2 calls per message.
pub async fn run(name: &str, input_prefetch: u16, mid_prefetch: u16, connections: u8, llm: Option<String>) -> anyhow::Result<()> {
    let conn = Connection::connect(crate::procs::AMQP_URL, ConnectionProperties::default()).await?;
    let pub_conn = if connections >= 2 { Some(Connection::connect(crate::procs::AMQP_URL, ConnectionProperties::default()).await?) } else { None };
    let publisher = pub_conn.as_ref().unwrap_or(&conn);
    let completions = llm.map(|base| format!("{}/v1/completions", base.trim_end_matches('/')));
    let http = reqwest::Client::new();
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
    ch1.basic_qos(input_prefetch, BasicQosOptions::default()).await?;
    let pub1 = publisher.create_channel().await?;
    pub1.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut c1 = ch1.basic_consume(input.as_str().into(), "pt-1".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
    let hop1 = tokio::spawn(async move {
        while let Some(Ok(d)) = c1.next().await {
            let (ch, exchange) = (pub1.clone(), exchange.clone());
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
    ch2.basic_qos(mid_prefetch, BasicQosOptions::default()).await?;
    let pub2 = publisher.create_channel().await?;
    pub2.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut c2 = ch2.basic_consume(mid.as_str().into(), "pt-2".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
    let hop2 = tokio::spawn(async move {
        while let Some(Ok(d)) = c2.next().await {
            let (ch, http, completions) = (pub2.clone(), http.clone(), completions.clone());
            tokio::spawn(async move {
                let id = d.properties.correlation_id().as_ref().map(|c| c.to_string()).unwrap_or_default();
                let reply = d.properties.reply_to().as_ref().map(|c| c.to_string()).unwrap_or_default();
                let output = match &completions {
                    Some(url) => match complete(&http, url, &d.data).await {
                        Ok(text) => text,
                        Err(e) => {
                            eprintln!("pass-through: LLM call failed: {e:#}");
                            let _ = d.acker.nack(lapin::options::BasicNackOptions { requeue: true, ..Default::default() }).await;
                            return;
                        }
                    },
                    None => "pass-through".to_owned(),
                };
                let body = serde_json::to_vec(&json!({"id": id, "ok": true, "output": output})).unwrap();
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
    if let Some(c) = pub_conn {
        let _ = c.close(200, "pass-through done".into()).await;
    }
    Ok(())
}
