//! The load driver: publishes requests to an input queue on a schedule (publisher confirms, an
//! exclusive reply queue), collects one result per request, and records end-to-end latency
//! (result received − request published, one clock) and the backlog over time (requests
//! published but not yet answered: queued, buffered, or at the LLM).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use serde_json::Value;
use tokio::time::Instant;

/// One request to publish `at` after the start.
#[derive(Debug, Clone)]
pub struct Req {
    pub id: String,
    pub body: Vec<u8>,
    pub at: Duration,
}

/// Requests outstanding but no new result for this long ends a drive with an error. The slowest
/// legitimate gap between two results, a daemon's batch of 8 long prompts on a one-thread
/// llama-server, is under a minute on this 2-core machine (part 1's runs).
pub const STALL: Duration = Duration::from_secs(180);

/// Completes with a [`crate::procs::Fatal`] error when a process of `watch` is gone, or when
/// requests are outstanding and no new result came for `stall`; else never. `progress` gives
/// (requests published or sent, requests answered) of a drive of `total` requests. Checks
/// every second.
pub(crate) async fn watchdog(watch: &[crate::procs::Watched], stall: Duration, total: usize, progress: impl Fn() -> (u64, u64)) -> anyhow::Error {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let (mut seen, mut since) = (0u64, Instant::now());
    loop {
        tick.tick().await;
        let (published, answered) = progress();
        // The stall clock runs only while something is outstanding, from its last result.
        if answered != seen || published <= answered {
            (seen, since) = (answered, Instant::now());
        }
        let outstanding = published.saturating_sub(answered);
        if let Some(gone) = watch.iter().find(|w| !w.alive()) {
            return crate::procs::Fatal(format!(
                "{} is gone (killed or crashed; its log: {}): {answered} of {total} requests answered, {outstanding} outstanding",
                gone.what,
                gone.log.display()
            ))
            .into();
        }
        if since.elapsed() >= stall {
            let names: Vec<&str> = watch.iter().map(|w| w.what.as_str()).collect();
            return crate::procs::Fatal(format!(
                "no new result for {} s: {answered} of {total} requests answered, {outstanding} outstanding{}",
                stall.as_secs(),
                if names.is_empty() { String::new() } else { format!(" (still running: {})", names.join(", ")) }
            ))
            .into();
        }
    }
}

/// Aborts background tasks when the drive ends, however it ends.
pub(crate) struct AbortOnDrop(pub(crate) Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

/// What one drive measured.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Drive {
    pub sent: usize,
    pub results: usize,
    pub ok: usize,
    pub failed: usize,
    pub duplicates: usize,
    /// First publish → last result, seconds.
    pub wall_s: f64,
    pub p50_s: f64,
    pub p99_s: f64,
    /// (seconds since start, outstanding requests).
    pub backlog: Vec<(f64, u64)>,
    /// Sums over results that carry usage.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Results without per-request usage.
    pub usage_missing: usize,
    /// Every result, in arrival order (not serialised: the sums above are what results.json keeps).
    #[serde(skip)]
    pub answers: Vec<Answer>,
}

/// One result of a drive.
#[derive(Debug, Clone, Default)]
pub struct Answer {
    pub id: String,
    /// Seconds from the drive's start to this result.
    pub done_s: f64,
    /// Seconds from this request's publish (or arrival) to its result.
    pub latency_s: f64,
    /// Usage of the answer (0 when it carried none).
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

struct State {
    sent_at: HashMap<String, Instant>,
    done: HashMap<String, ()>,
    published: u64,
    answered: u64,
    lat: Vec<f64>,
    ok: usize,
    failed: usize,
    dup: usize,
    prompt: u64,
    cached: u64,
    missing_usage: usize,
    last_result: Option<Instant>,
    answers: Vec<Answer>,
}

/// Publishes `reqs` to `queue` (each at its `at`) and waits for all results, at most `timeout`
/// after the last publish. Samples the backlog every `sample`. Fails early with a
/// [`crate::procs::Fatal`] error when a process of `watch` (the servers and daemons the requests
/// depend on) is gone, or when no result came for [`STALL`] while requests were outstanding; the
/// error says how many requests were answered.
///
/// Longer than 80 lines on purpose: one event loop (publish on schedule, collect, sample the
/// backlog) whose branches share the run's state.
pub async fn drive(queue: &str, reqs: Vec<Req>, timeout: Duration, sample: Duration, watch: &[crate::procs::Watched]) -> anyhow::Result<Drive> {
    let conn = Connection::connect(crate::procs::AMQP_URL, ConnectionProperties::default()).await.context("connecting to RabbitMQ")?;
    let pub_ch = conn.create_channel().await?;
    pub_ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let sub_ch = conn.create_channel().await?;
    let reply = sub_ch
        .queue_declare("".into(), QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() }, FieldTable::default())
        .await?;
    let reply = reply.name().to_string();
    let mut consumer = sub_ch
        .basic_consume(reply.as_str().into(), "bench".into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default())
        .await?;
    let total = reqs.len();
    let state = Arc::new(Mutex::new(State {
        sent_at: HashMap::with_capacity(total),
        done: HashMap::with_capacity(total),
        published: 0,
        answered: 0,
        lat: Vec::with_capacity(total),
        ok: 0,
        failed: 0,
        dup: 0,
        prompt: 0,
        cached: 0,
        missing_usage: 0,
        last_result: None,
        answers: Vec::with_capacity(total),
    }));
    let start = Instant::now();

    // Results.
    let st = state.clone();
    let collector = tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let now = Instant::now();
            let id = d.properties.correlation_id().as_ref().map(|c| c.to_string()).unwrap_or_default();
            let v: Value = serde_json::from_slice(&d.data).unwrap_or(Value::Null);
            let mut g = st.lock().unwrap();
            let Some(&sent) = g.sent_at.get(&id) else { continue };
            if g.done.insert(id.clone(), ()).is_some() {
                g.dup += 1;
                continue;
            }
            g.answered += 1;
            g.last_result = Some(now);
            g.lat.push((now - sent).as_secs_f64());
            let usage = v.get("usage").filter(|u| u.is_object());
            let (p, c) = usage.map(|u| (u["prompt_tokens"].as_u64().unwrap_or(0), u["cached_tokens"].as_u64().unwrap_or(0))).unwrap_or((0, 0));
            g.answers.push(Answer { id: id.clone(), done_s: (now - start).as_secs_f64(), latency_s: (now - sent).as_secs_f64(), prompt_tokens: p, cached_tokens: c });
            if v["ok"].as_bool() == Some(true) {
                g.ok += 1;
            } else {
                g.failed += 1;
            }
            match v.get("usage").filter(|u| u.is_object()) {
                Some(u) => {
                    g.prompt += u["prompt_tokens"].as_u64().unwrap_or(0);
                    g.cached += u["cached_tokens"].as_u64().unwrap_or(0);
                }
                None => g.missing_usage += 1,
            }
            if g.answered as usize == total {
                break;
            }
        }
    });

    // Backlog sampler: runs until aborted (by the guard below, also on early errors).
    let st = state.clone();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let out = samples.clone();
    let sampler = tokio::spawn(async move {
        let mut tick = tokio::time::interval(sample);
        loop {
            tick.tick().await;
            let (p, a) = {
                let g = st.lock().unwrap();
                (g.published, g.answered)
            };
            out.lock().unwrap().push((start.elapsed().as_secs_f64(), p.saturating_sub(a)));
        }
    });
    let _guard = AbortOnDrop(vec![sampler.abort_handle(), collector.abort_handle()]);

    // Publisher: confirms are awaited in a separate task so a slow confirm never delays the schedule.
    let (ctx, mut crx) = tokio::sync::mpsc::channel::<lapin::PublisherConfirm>(4096);
    let confirmer = tokio::spawn(async move {
        let mut n = 0usize;
        while let Some(c) = crx.recv().await {
            let c = c.await?;
            if c.is_nack() {
                bail!("the broker nacked a request");
            }
            if c.take_message().is_some() {
                bail!("a request was unroutable (input queue missing?)");
            }
            n += 1;
        }
        Ok(n)
    });
    let publish_and_collect = async {
        for r in reqs {
            tokio::time::sleep_until(start + r.at).await;
            // The daemon's own `submit` properties, including the publish time it measures
            // queueing delay from (the adaptive keying's split signal).
            let props = prefix_batcher::client::request_properties(&r.id, Some(reply.as_str()))?;
            state.lock().unwrap().sent_at.insert(r.id.clone(), Instant::now());
            let c = pub_ch
                .basic_publish("".into(), queue.into(), BasicPublishOptions { mandatory: true, ..Default::default() }, &r.body, props)
                .await?;
            state.lock().unwrap().published += 1;
            ctx.send(c).await.ok();
        }
        drop(ctx);
        let confirmed = confirmer.await??;
        match tokio::time::timeout(timeout, collector).await {
            Err(_) => bail!("timed out after {timeout:?} waiting for results: {} of {total} answered", state.lock().unwrap().answered),
            Ok(Err(e)) => bail!("result collector failed: {e}"),
            Ok(Ok(())) => {}
        }
        anyhow::Ok(confirmed)
    };
    let progress = || {
        let g = state.lock().unwrap();
        (g.published, g.answered)
    };
    let confirmed = tokio::select! {
        r = publish_and_collect => r?,
        e = watchdog(watch, STALL, total, progress) => return Err(e),
    };
    let drive = {
        let g = state.lock().unwrap();
        if (g.answered as usize) < total {
            bail!("the result consumer ended after {} of {total} results (connection lost?)", g.answered);
        }
        let mut backlog = samples.lock().unwrap().clone();
        backlog.push((g.last_result.map(|t| (t - start).as_secs_f64()).unwrap_or(0.0), 0));
        let mut lat = g.lat.clone();
        lat.sort_by(|a, b| a.total_cmp(b));
        Drive {
            sent: confirmed,
            results: g.answered as usize,
            ok: g.ok,
            failed: g.failed,
            duplicates: g.dup,
            wall_s: g.last_result.map(|t| (t - start).as_secs_f64()).unwrap_or(f64::NAN),
            p50_s: crate::procs::percentile(&lat, 0.5),
            p99_s: crate::procs::percentile(&lat, 0.99),
            backlog,
            prompt_tokens: g.prompt,
            cached_tokens: g.cached,
            usage_missing: g.missing_usage,
            answers: g.answers.clone(),
        }
    };
    let _ = conn.close(200, "bench done".into()).await;
    Ok(drive)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procs::Watched;

    #[tokio::test]
    async fn watchdog_reports_a_stall_with_the_answered_count() {
        let e = tokio::time::timeout(Duration::from_secs(10), watchdog(&[], Duration::from_secs(1), 5, || (5, 2))).await.expect("the stall is reported");
        assert!(crate::procs::is_fatal(&e));
        assert!(e.to_string().contains("no new result for 1 s: 2 of 5 requests answered, 3 outstanding"), "{e}");
    }

    #[tokio::test]
    async fn watchdog_is_quiet_while_nothing_is_outstanding() {
        assert!(tokio::time::timeout(Duration::from_millis(2500), watchdog(&[], Duration::from_secs(1), 5, || (3, 3))).await.is_err());
    }

    #[tokio::test]
    async fn watchdog_names_a_process_that_is_gone_before_it_is_reaped() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let w = Watched::new("sleeper", child.id(), std::path::Path::new("/dev/null"));
        assert!(w.alive());
        child.kill().unwrap();
        // Not reaped yet: a zombie, which counts as gone.
        let e = tokio::time::timeout(Duration::from_secs(10), watchdog(std::slice::from_ref(&w), Duration::from_secs(60), 4, || (4, 1)))
            .await
            .expect("the dead process is reported");
        child.wait().unwrap();
        assert!(!w.alive());
        assert!(e.to_string().starts_with("sleeper is gone") && e.to_string().contains("1 of 4 requests answered, 3 outstanding"), "{e}");
    }
}
