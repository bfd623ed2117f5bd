//! Wiring, reconnects and graceful shutdown.
//!
//! [`run`] takes its shutdown signal as an argument (tests pass their own). It serves HTTP, then
//! runs *sessions*: one AMQP connection each, with the topology declared, the router and the
//! ownership manager running. A failed connection ends the session (every partition is aborted
//! and its lease released) and a new one starts after an exponential backoff. On shutdown, within
//! ONE deadline (`shutdown.drain_timeout`): the router stops taking input, every partition
//! flushes, finishes in-flight work, acks and releases its lease, the member key is deleted, the
//! connection closes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::Settings;
use crate::llm::LlmClient;
use crate::metrics;
use crate::ownership::Ownership;
use crate::topology::{self, TopologyError};

/// Exit code for a bad configuration (`EX_CONFIG` from sysexits.h).
pub const EXIT_CONFIG: i32 = 78;
/// Exit code when the drain deadline was exceeded (`EX_SOFTWARE` from sysexits.h).
pub const EXIT_DRAIN_TIMEOUT: i32 = 70;

/// Why the daemon stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Configuration or deployment mismatch (exit 78).
    #[error(transparent)]
    Topology(TopologyError),
    /// The drain did not finish within `shutdown.drain_timeout` (exit 70).
    #[error("drain did not finish within {0:?}; unfinished requests return to their queues")]
    DrainTimeout(Duration),
    /// Anything else (exit 1).
    #[error("{0}")]
    Fatal(String),
}

impl AppError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            AppError::Topology(TopologyError::Mismatch { .. } | TopologyError::PartitionCount { .. }) => EXIT_CONFIG,
            AppError::DrainTimeout(_) => EXIT_DRAIN_TIMEOUT,
            _ => 1,
        }
    }
}

/// Events reported to the service manager (systemd `sd_notify`); see [`run_with_events`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// Topology declared and the first lease round done.
    Ready,
    /// The main loop is alive (sent periodically while healthy).
    Alive,
    /// The drain started.
    Stopping,
}

/// Runs the daemon until `shutdown` completes. See [`run_with_events`].
pub async fn run(settings: Settings, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), AppError> {
    run_with_events(settings, shutdown, |_| {}).await
}

/// Runs the daemon until `shutdown` completes, reporting lifecycle events to `events`.
pub async fn run_with_events(
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + 'static,
    mut events: impl FnMut(Lifecycle) + Send,
) -> Result<(), AppError> {
    metrics::init();
    let settings = Arc::new(settings);
    let stop = CancellationToken::new();
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            shutdown.await;
            stop.cancel();
        });
    }

    let listener = tokio::net::TcpListener::bind(settings.http_listen)
        .await
        .map_err(|e| AppError::Fatal(format!("cannot listen on http.listen {}: {e}", settings.http_listen)))?;
    let addr = listener.local_addr().map_err(|e| AppError::Fatal(e.to_string()))?;
    info!(%addr, instance = %settings.instance_name, "http listening");
    let http_stop = CancellationToken::new();
    let http = tokio::spawn(crate::http::serve(listener, http_stop.clone().cancelled_owned()));

    let llm = LlmClient::new(&settings.llm).map_err(|e| AppError::Fatal(format!("llm client: {e}")))?;
    let nonce = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let result = sessions(&settings, &llm, &nonce, &stop, &mut events).await;
    metrics::set_ready(false);
    http_stop.cancel();
    let _ = http.await;
    result
}

async fn connect_redis(settings: &Settings) -> Result<ConnectionManager, redis::RedisError> {
    let client = redis::Client::open(settings.redis.url.expose())?;
    let cfg = ConnectionManagerConfig::new()
        .set_response_timeout(Some(settings.redis.command_timeout))
        .set_connection_timeout(Some(settings.redis.command_timeout))
        .set_number_of_retries(2);
    client.get_connection_manager_with_config(cfg).await
}

enum SessionEnd {
    /// Shutdown requested and the drain finished.
    Stopped,
    /// The connection or a component failed: reconnect.
    Failed(String),
}

async fn sessions(
    settings: &Arc<Settings>,
    llm: &LlmClient,
    nonce: &str,
    stop: &CancellationToken,
    events: &mut (impl FnMut(Lifecycle) + Send),
) -> Result<(), AppError> {
    let mut backoff = settings.amqp.reconnect_backoff_initial;
    let mut redis: Option<ConnectionManager> = None;
    loop {
        if stop.is_cancelled() {
            return Ok(());
        }
        let end = match &redis {
            Some(r) => session(settings, llm, nonce, r.clone(), stop, events).await?,
            None => match connect_redis(settings).await {
                Ok(r) => {
                    redis = Some(r.clone());
                    session(settings, llm, nonce, r, stop, events).await?
                }
                Err(e) => SessionEnd::Failed(format!("redis: {e}")),
            },
        };
        match end {
            SessionEnd::Stopped => return Ok(()),
            SessionEnd::Failed(why) => {
                if metrics::is_ready() {
                    // The session had been healthy: start the backoff over.
                    backoff = settings.amqp.reconnect_backoff_initial;
                }
                metrics::set_ready(false);
                warn!(reason = %why, retry_in = ?backoff, "session ended; reconnecting");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tokio::time::sleep(jitter(backoff)) => {}
        }
        backoff = (backoff * 2).min(settings.amqp.reconnect_backoff_max);
    }
}

fn jitter(d: Duration) -> Duration {
    d.mul_f64(0.5 + fastrand::f64() * 0.5)
}

async fn session(
    settings: &Arc<Settings>,
    llm: &LlmClient,
    nonce: &str,
    mut redis: ConnectionManager,
    stop: &CancellationToken,
    events: &mut (impl FnMut(Lifecycle) + Send),
) -> Result<SessionEnd, AppError> {
    let props = ConnectionProperties::default().with_connection_name(format!("prefix-batcher {}", settings.instance_name).into());
    let conn = match Connection::connect(settings.amqp.url.expose(), props).await {
        Ok(c) => c,
        Err(e) => return Ok(SessionEnd::Failed(format!("amqp connect: {e}"))),
    };
    let conn = Arc::new(conn);
    let meta_key = format!("{}:partitions", settings.redis.key_prefix);
    match topology::declare(&conn, &settings.amqp, &mut redis, &meta_key).await {
        Ok(()) => {}
        Err(e @ (TopologyError::Mismatch { .. } | TopologyError::PartitionCount { .. })) => {
            error!(error = %e, "refusing to start");
            let _ = conn.close(200, "bad topology".into()).await;
            return Err(AppError::Topology(e));
        }
        Err(e) => return Ok(SessionEnd::Failed(format!("topology: {e}"))),
    }
    info!(partitions = settings.amqp.partitions.get(), "topology declared");

    let router_stop = CancellationToken::new();
    let mut router = {
        let (conn, settings, rs) = (conn.clone(), settings.clone(), router_stop.clone());
        tokio::spawn(async move { crate::router::run(&conn, settings, rs).await })
    };
    let backlog_stop = CancellationToken::new();
    let backlog = tokio::spawn(poll_backlog(conn.clone(), settings.clone(), backlog_stop.clone()));

    let mut own = Ownership::new(settings.clone(), redis.clone(), nonce.to_owned(), llm.clone());
    let own_stop = CancellationToken::new();
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let deadline;
    let outcome = {
        let own_fut = own.run(conn.clone(), own_stop.clone(), move || {
            let _ = ready_tx.send(());
        });
        tokio::pin!(own_fut);
        let mut alive = tokio::time::interval(Duration::from_secs(1));
        let failure = loop {
            tokio::select! {
                r = &mut own_fut => break Some(match r { Ok(()) => "ownership stopped".to_string(), Err(e) => e.to_string() }),
                r = &mut router => break Some(format!("router stopped: {:?}", r.map(|x| x.map_err(|e| e.to_string())))),
                _ = stop.cancelled() => break None,
                Some(()) = ready_rx.recv() => {
                    metrics::set_ready(true);
                    events(Lifecycle::Ready);
                    info!("ready");
                }
                _ = alive.tick() => {
                    if conn.status().connected() {
                        events(Lifecycle::Alive);
                    }
                }
            }
        };
        match failure {
            Some(why) => {
                router_stop.cancel();
                Err(why)
            }
            None => {
                // Graceful drain, under one deadline.
                events(Lifecycle::Stopping);
                info!(timeout = ?settings.drain_timeout, "draining");
                metrics::set_ready(false);
                deadline = tokio::time::Instant::now() + settings.drain_timeout;
                router_stop.cancel();
                own_stop.cancel();
                let drained = tokio::time::timeout_at(deadline, async {
                    let _ = (&mut router).await;
                    own_fut.await
                })
                .await;
                Ok(drained)
            }
        }
    };
    backlog_stop.cancel();
    let _ = backlog.await;
    match outcome {
        Err(why) => {
            own.abort_and_release().await;
            router.abort();
            let _ = conn.close(200, "session failed".into()).await;
            Ok(SessionEnd::Failed(why))
        }
        Ok(Ok(Ok(()))) => {
            let _ = conn.close(200, "shutdown".into()).await;
            info!("drained; bye");
            Ok(SessionEnd::Stopped)
        }
        Ok(Ok(Err(e))) => {
            own.abort_and_release().await;
            Ok(SessionEnd::Failed(e.to_string()))
        }
        Ok(Err(_elapsed)) => {
            own.abort_and_release().await;
            router.abort();
            let _ = conn.close(200, "drain timeout".into()).await;
            Err(AppError::DrainTimeout(settings.drain_timeout))
        }
    }
}

async fn poll_backlog(conn: Arc<Connection>, settings: Arc<Settings>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(settings.amqp.backlog_poll_interval);
    let mut ch: Option<lapin::Channel> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                if let Some(c) = ch {
                    let _ = c.close(200, "stopping".into()).await;
                }
                return;
            }
            _ = tick.tick() => {}
        }
        if ch.is_none() {
            ch = conn.create_channel().await.ok();
        }
        let Some(c) = &ch else { continue };
        let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        match c.queue_declare(settings.amqp.input_queue.as_str().into(), opts, FieldTable::default()).await {
            Ok(q) => metrics::input_backlog(q.message_count()),
            Err(_) => {
                ch = None;
                continue;
            }
        }
        // Every partition, owned here or not: an unowned partition's backlog is what an operator
        // most needs to see. Dashboards take `max by (partition)` over instances.
        for p in 0..settings.amqp.partitions.get() {
            match c.queue_declare(settings.amqp.partition_queue(p).as_str().into(), opts, FieldTable::default()).await {
                Ok(q) => metrics::partition_backlog(p, q.message_count()),
                Err(_) => {
                    ch = None;
                    break;
                }
            }
        }
    }
}
