//! Wiring, reconnects and graceful shutdown.
//!
//! [`run`] takes its shutdown signal as an argument (tests pass their own). It serves HTTP, then
//! runs *sessions*: one AMQP connection each, with the topology declared, the router and the
//! ownership manager running. A failed connection ends the session (every partition is aborted
//! and its lease released) and a new one starts after an exponential backoff.
//!
//! Cancellation is one tree. The root token lives as long as [`run_with_events`]; its children
//! are the HTTP server's token and the *work* token, which the shutdown signal cancels. Each
//! session hangs a session token under the work token, and the router, the backlog poller and
//! the ownership manager get children of that (partition workers are children of the ownership
//! token). So a shutdown reaches every component at once, and a failed session cancels only
//! its own subtree.
//!
//! On shutdown, within ONE deadline (`shutdown.drain_timeout`) that covers the whole teardown:
//! the router stops taking input, every partition flushes, finishes in-flight work (LLM calls
//! until [`crate::partition::drain_call_cutoff`], after which their requests are put back
//! uncharged), acks and releases its lease, the member key is deleted, the connection closes. Past the deadline only
//! the hard stop runs (abort every partition, best-effort lease release) and the exit code is
//! [`EX_SOFTWARE`]. A drain cut short by a connection failure is an error too
//! ([`AppError::DrainFailed`], exit [`EX_FAILURE`]): its unfinished requests return to their
//! queues and may be processed again.
//!
//! Broker flow control: [`watch_connection_blocked`] follows each AMQP connection's
//! `connection.blocked` / `connection.unblocked` notifications and keeps the daemon not ready
//! (and the `amqp_connection_blocked` gauge at 1) while the broker blocks it.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use futures_util::{Stream, StreamExt};
use lapin::Connection;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::amqp::{Connections, Link};
use crate::config::Settings;
use crate::exit::{EX_CONFIG, EX_FAILURE, EX_SOFTWARE};
use crate::lease::RedisConn;
use crate::breaker::BreakerState;
use crate::llm::{call_outcome_label, ClientOptions, LlmClient, LlmError, LlmEvent, LlmHook};
use crate::metrics;
use crate::ownership::{Ownership, OwnershipError};
use crate::readiness::{NotReady, Readiness};
use crate::topology::{self, TopologyError};

/// How often [`Lifecycle::Alive`] is reported while the AMQP connection is up.
pub const ALIVE_PERIOD: Duration = Duration::from_secs(1);

/// Why the daemon stopped with an error. [`AppError::exit_code`] maps each to its exit code.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Configuration or deployment mismatch (exit [`EX_CONFIG`]).
    #[error(transparent)]
    Topology(TopologyError),
    /// The drain did not finish within `shutdown.drain_timeout` (exit [`EX_SOFTWARE`]).
    #[error("drain did not finish within {0:?}; unfinished requests return to their queues")]
    DrainTimeout(Duration),
    /// The connection failed during the drain (exit [`EX_FAILURE`]).
    #[error("the drain was cut short ({0}); unfinished requests return to their queues")]
    DrainFailed(#[source] SessionError),
    /// `http.listen` cannot be bound (exit [`EX_FAILURE`]).
    #[error("cannot listen on http.listen {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The LLM client cannot be built (exit [`EX_FAILURE`]).
    #[error("llm client: {0}")]
    Llm(#[source] LlmError),
    /// Before any session started, every broker node refused the daemon's login or vhost, or
    /// Redis refused its credentials (exit [`EX_CONFIG`]). The text names the configuration key
    /// (see [`SessionError::access_refused`]). Once a session has started, the same refusal is
    /// logged at error level and retried instead (credentials being rotated).
    #[error("{0}")]
    AccessRefused(String),
}

impl AppError {
    /// The process exit code for this error (see [`crate::exit`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            AppError::Topology(e) if e.is_config_error() => EX_CONFIG,
            AppError::AccessRefused(_) => EX_CONFIG,
            AppError::DrainTimeout(_) => EX_SOFTWARE,
            _ => EX_FAILURE,
        }
    }
}

/// Why a session ended early; the session is retried after a backoff (or, during the drain,
/// the error becomes [`AppError::DrainFailed`]).
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The session's Redis connection could not be opened.
    #[error("redis: {0}")]
    Redis(#[source] crate::lease::ConnectError),
    #[error("amqp connect: {0}")]
    Connect(#[source] lapin::Error),
    #[error("topology: {0}")]
    Topology(#[source] TopologyError),
    #[error("ownership: {0}")]
    Ownership(#[source] OwnershipError),
    /// The ownership manager returned without a shutdown request.
    #[error("ownership stopped")]
    OwnershipStopped,
    #[error("router: {0}")]
    Router(#[source] lapin::Error),
    /// The router returned without a shutdown request.
    #[error("router stopped")]
    RouterStopped,
    /// The router task panicked or was cancelled.
    #[error("router task: {0}")]
    RouterTask(#[source] tokio::task::JoinError),
    /// One of the session's AMQP connections closed (the broker closed it, e.g. after a hard
    /// error such as `INTERNAL_ERROR`), found by the session's once-a-second check.
    #[error("an amqp connection of the session closed ({0})")]
    ConnectionClosed(&'static str),
    /// The broker stopped answering on the consuming connection while lapin still held it open:
    /// the backlog poller's passive `queue.declare` got no answer within
    /// [`crate::amqp::RPC_TIMEOUT`].
    #[error("the broker stopped answering: {0}")]
    BrokerSilent(#[source] lapin::Error),
    /// The backlog poller task panicked or was cancelled.
    #[error("backlog poller task: {0}")]
    BacklogTask(#[source] tokio::task::JoinError),
}

impl SessionError {
    /// Whether the broker link failed (every failure but Redis's): the next session then tries
    /// the next broker node.
    fn amqp_failed(&self) -> bool {
        !matches!(self, SessionError::Redis(_) | SessionError::Topology(TopologyError::Redis(_)))
    }

    /// When a broker refused the connection because a connection limit is reached (530
    /// `NOT_ALLOWED` "… connection limit (N) is reached", RabbitMQ's per-vhost `max-connections`
    /// or per-user limit), what to tell the operator. `None` for any other failure.
    pub fn connection_limit(&self) -> Option<String> {
        let SessionError::Connect(e) = self else { return None };
        let text = e.to_string();
        (crate::amqp::reply_code(e) == Some(crate::amqp::NOT_ALLOWED) && text.contains("connection limit")).then(|| {
            format!("the broker refused the connection: a connection limit of the vhost or of the user is reached (rabbitmqctl list_vhost_limits, list_user_limits; each instance opens 3 connections); retrying (the broker said: {text})")
        })
    }

    /// When this failure is a refusal of the daemon's credentials, what to tell the operator: a
    /// sentence naming the configuration key that holds them, without the password.
    ///
    /// Refusals: broker node `node` answered `connection.open` with 403 `ACCESS_REFUSED` (the
    /// login: user or password) or 530 `NOT_ALLOWED` (RabbitMQ: the vhost does not exist or the
    /// user may not use it), AMQP 0-9-1 `connection.close`; or Redis refused the password or
    /// user (`WRONGPASS`, `NOAUTH`; the redis crate's `AuthenticationFailed`) or a command for
    /// lack of permission (`NOPERM`, Redis ACL), or the database of `redis.url` does not exist
    /// (`ERR DB index is out of range`).
    pub fn access_refused(&self, settings: &Settings, node: usize) -> Option<String> {
        let amqp = &settings.amqp;
        let key = if amqp.nodes.len() > 1 { "amqp.urls" } else { "amqp.url" };
        let url = amqp.nodes.get(node).map(ToString::to_string).unwrap_or_default();
        match self {
            SessionError::Connect(e) => match crate::amqp::reply_code(e) {
                // EXTERNAL: the client certificate is the login (RabbitMQ's rabbitmq_auth_mechanism_ssl).
                Some(crate::amqp::ACCESS_REFUSED) if url.to_ascii_lowercase().contains("auth_mechanism=external") => Some(format!(
                    "RabbitMQ node {node} ({url}) refused the login (403 ACCESS_REFUSED): with auth_mechanism=external the client certificate (amqp.tls_cert_file) is the login: check that its subject (ssl_cert_login_from: common_name or distinguished_name) names an existing RabbitMQ user (the broker said: {e})"
                )),
                Some(crate::amqp::ACCESS_REFUSED) => Some(format!(
                    "RabbitMQ node {node} ({url}) refused the login (403 ACCESS_REFUSED): check the user and password in {key} (the broker said: {e})"
                )),
                // A connection limit (of the vhost, or of the user: `rabbitmqctl set_vhost_limits`,
                // `set_user_limits`) is 530 too; it clears when other connections close, so it is
                // retried, not a configuration error ([`SessionError::connection_limit`]).
                Some(crate::amqp::NOT_ALLOWED) if self.connection_limit().is_some() => None,
                Some(crate::amqp::NOT_ALLOWED) => Some(format!(
                    "RabbitMQ node {node} ({url}) refused the vhost (530 NOT_ALLOWED): the vhost in {key} does not exist or its user has no permissions on it; see rabbitmqctl list_vhosts and list_user_permissions (the broker said: {e})"
                )),
                _ => None,
            },
            SessionError::Redis(crate::lease::ConnectError::Sentinels { sentinels, source, .. }) if redis_refused(source) => Some(format!(
                "the Redis sentinels ({sentinels}) refused the daemon's credentials: check the user and password in redis.sentinels (the sentinel said: {source})"
            )),
            SessionError::Redis(crate::lease::ConnectError::Sentinels { .. }) => None,
            SessionError::Redis(crate::lease::ConnectError::Redis { source: e, .. }) | SessionError::Topology(TopologyError::Redis(e)) if redis_refused(e) => Some(format!(
                "{} refused the daemon's credentials or a command: check the user and password in redis.url, and that the user's ACL allows the daemon's commands on the keys under redis.key_prefix (docs/operations.md, Least privilege) (Redis said: {e})",
                redis_target(settings, self),
            )),
            SessionError::Redis(crate::lease::ConnectError::Redis { source: e, .. }) | SessionError::Topology(TopologyError::Redis(e)) if redis_no_such_database(e) => Some(format!(
                "{} has no such database: the number after the last / of redis.url must be below the server's `databases` setting (16 by default) (Redis said: {e})",
                redis_target(settings, self),
            )),
            _ => None,
        }
    }

    /// The not-ready reason this failure stands for.
    fn not_ready(&self) -> NotReady {
        match self {
            SessionError::Redis(_) => NotReady::RedisDown,
            _ => NotReady::AmqpDown,
        }
    }
}

/// The Redis server a failure is about, for messages: `Redis (redis.url's URL, password
/// redacted)`, or in Sentinel mode the primary the sentinels named (when known).
fn redis_target(settings: &Settings, failure: &SessionError) -> String {
    match (&settings.redis.sentinel, failure) {
        (None, _) => format!("Redis ({})", settings.redis.url),
        (Some(_), SessionError::Redis(crate::lease::ConnectError::Redis { primary: Some(p), .. })) => {
            format!("the Redis primary {p} that redis.sentinels named (reached with the credentials and database of redis.url)")
        }
        (Some(_), _) => "the Redis primary that redis.sentinels name (reached with the credentials and database of redis.url)".to_owned(),
    }
}

/// Whether Redis refused the `SELECT` of the database in `redis.url` (`ERR DB index is out of
/// range`: the number is not below the server's `databases` setting).
fn redis_no_such_database(e: &redis::RedisError) -> bool {
    e.to_string().contains("DB index is out of range")
}

/// Whether Redis refused the daemon's credentials (`WRONGPASS`, `NOAUTH`; the redis crate's
/// `AuthenticationFailed`) or a command for lack of permission (`NOPERM`).
fn redis_refused(e: &redis::RedisError) -> bool {
    crate::lease::refused_credentials(e) || e.code() == Some("NOPERM")
}

/// Events reported to the service manager (systemd `sd_notify`); see [`run_with_events`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// Topology declared and the first lease round done.
    Ready,
    /// The main loop is alive (sent every [`ALIVE_PERIOD`] while the AMQP connection is up).
    Alive,
    /// The drain started.
    Stopping,
}

/// The lowest AMQP heartbeat timeout RabbitMQ advises, in seconds ("values within the 5 to 20
/// seconds range are optimal", <https://www.rabbitmq.com/docs/heartbeats>); a lower
/// `amqp.heartbeat` is allowed, with a warning at startup.
pub const MIN_ADVISED_HEARTBEAT_SECS: u16 = 5;

/// Runs the daemon until `shutdown` completes. See [`run_with_events`].
pub async fn run(settings: Settings, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), AppError> {
    run_with_events(settings, shutdown, |_| {}).await
}

/// Exports the expiry of each link's client certificate
/// (`prefix_batcher_tls_client_certificate_expiry_timestamp_seconds{link}`) and warns when one
/// expires within 14 days: the files are read only at startup, so a renewed certificate counts
/// after a restart. (An already expired one was refused by the configuration.)
fn report_client_certificates(settings: &Settings) {
    let now = crate::tls::unix_now();
    for (link, files) in settings.tls_links() {
        let Some(at) = files.client.as_ref().and_then(|c| c.expires_at) else { continue };
        metrics::tls_client_certificate_expiry(link, at);
        if at - now < crate::tls::CLIENT_CERT_WARN_SECS {
            warn!(
                link,
                expires_at = %crate::tls::rfc3339(at),
                "the client certificate ({link}.tls_cert_file) expires in {}: renew it, then restart the daemon (it reads the file only at startup)",
                crate::tls::span_text(at - now)
            );
        }
    }
}

/// Runs the daemon until `shutdown` completes, reporting lifecycle events to `events`.
///
/// Errors: see [`AppError`]; `Ok(())` only after a complete drain (or a shutdown requested
/// while no session was running).
pub async fn run_with_events(
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + 'static,
    mut events: impl FnMut(Lifecycle) + Send,
) -> Result<(), AppError> {
    metrics::init(&crate::llm::CALL_OUTCOME_LABELS, settings.llm.endpoints.len(), &crate::publisher::OwnDestination::LABELS, crate::publisher::REPLY_REFUSALS);
    let root = CancellationToken::new();
    let _cancel_all_on_return = root.clone().drop_guard();
    let work = root.child_token();
    tokio::spawn(cancel_on(shutdown, work.clone(), root.clone()));

    let readiness = Readiness::new();
    let listener = tokio::net::TcpListener::bind(settings.http_listen)
        .await
        .map_err(|source| AppError::Listen { addr: settings.http_listen, source })?;
    let addr = listener.local_addr().map_err(|source| AppError::Listen { addr: settings.http_listen, source })?;
    info!(%addr, instance = %settings.instance_name, "http listening");
    for advice in advisories(&settings) {
        warn!("{advice}");
    }
    report_client_certificates(&settings);
    let http_token = root.child_token();
    let http = tokio::spawn(crate::http::serve(listener, readiness.clone(), http_token.clone().cancelled_owned(), crate::http::Limits::DAEMON));

    let options = ClientOptions {
        hook: llm_hook(settings.llm.endpoints.len(), readiness.clone()),
        max_response_bytes: settings.llm.max_response_bytes.get(),
        partitions: settings.amqp.partitions.get(),
        ..ClientOptions::default()
    };
    let llm = LlmClient::with_options(&settings.llm, options).map_err(AppError::Llm)?;
    let nonce = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let app = App { settings: Arc::new(settings), llm, nonce, readiness, opened: AtomicBool::new(false), last_errors: Default::default() };
    let result = app.sessions(&work, &mut events).await;
    app.readiness.set(NotReady::Draining, true);
    http_token.cancel();
    let _ = http.await;
    result
}

/// The LLM client's events, mirrored into metrics; the daemon is not ready
/// ([`NotReady::LlmUnavailable`]) while the circuit breaker of every one of the `endpoints`
/// endpoints is open or half-open (a half-open breaker is probing with a one-token completion; requests
/// resume only once it is closed).
fn llm_hook(endpoints: usize, readiness: Readiness) -> LlmHook {
    let open = std::sync::Mutex::new(vec![false; endpoints]);
    Arc::new(move |event: &LlmEvent<'_>| match event {
        LlmEvent::Call { endpoint, outcome, seconds } => metrics::llm_call(*endpoint, call_outcome_label(*outcome), *seconds),
        LlmEvent::Tokens { prompt_tokens, cached_tokens } => metrics::llm_tokens(*prompt_tokens, *cached_tokens),
        LlmEvent::ProbePanicked { .. } => metrics::task_panicked(metrics::stage::LLM_PROBE),
        LlmEvent::Breaker { endpoint, name, state, reopened } => {
            metrics::llm_circuit(*endpoint, state.as_str(), *reopened);
            match state {
                BreakerState::Open if *reopened => {
                    debug!(endpoint = *endpoint, url = %name, "LLM endpoint circuit open again after a failed probe")
                }
                BreakerState::Open => warn!(endpoint = *endpoint, url = %name, "LLM endpoint circuit open: server-wide failures; its partitions call another endpoint of this instance while one is available, else pause intake"),
                _ => info!(endpoint = *endpoint, url = %name, state = state.as_str(), "LLM endpoint circuit"),
            }
            let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(slot) = open.get_mut(*endpoint) {
                *slot = *state != BreakerState::Closed;
            }
            readiness.set(NotReady::LlmUnavailable, open.iter().all(|o| *o));
        }
    })
}

/// Cancels `token` when `signal` completes; gives up when `root` is cancelled first.
async fn cancel_on(signal: impl Future<Output = ()>, token: CancellationToken, root: CancellationToken) {
    tokio::select! {
        _ = signal => token.cancel(),
        _ = root.cancelled() => {}
    }
}

enum SessionEnd {
    /// Shutdown requested and the drain finished.
    Stopped,
    /// The connection or a component failed: reconnect.
    Failed(SessionError),
}

/// How a session's running phase ended.
enum Phase {
    /// A component failed before any shutdown request.
    Failed(SessionError),
    /// Shutdown requested; the drain ended so.
    Drained(Drain),
}

/// How a drain ended.
#[derive(Debug)]
enum Drain {
    /// Everything flushed, acked and released; the connection closed.
    Finished,
    /// The connection failed during the drain.
    Failed(SessionError),
    /// `shutdown.drain_timeout` elapsed first.
    DeadlineExceeded,
}

/// Settings that are valid but probably not what the operator wants, one sentence each naming
/// the keys and values: logged at WARN when the daemon starts, printed by `check-config`.
pub fn advisories(s: &Settings) -> Vec<String> {
    let mut out = Vec::new();
    if (1..MIN_ADVISED_HEARTBEAT_SECS).contains(&s.amqp.heartbeat) {
        out.push(format!(
            "amqp.heartbeat = {}s is below the 5 s RabbitMQ advises: a busy host or network may see healthy connections closed (https://www.rabbitmq.com/docs/heartbeats)",
            s.amqp.heartbeat
        ));
    }
    if let Some(verdict) = crate::llm::liveness_verdict_after(&s.llm).filter(|v| s.llm.request_timeout <= *v) {
        out.push(format!(
            "llm.request_timeout = {:?} is too short for the frozen-server check (llm.liveness_check_after plus two checks of min(10s, it) each: {verdict:?}): calls to a frozen server are found by their timeouts instead, one probe later; lower llm.liveness_check_after or raise llm.request_timeout",
            s.llm.request_timeout
        ));
    }
    if s.llm.connect_timeout >= s.llm.request_timeout {
        out.push(format!(
            "llm.connect_timeout = {:?} is not below llm.request_timeout = {:?}: a connection still pending when the request timeout fires counts as a request timeout (verified by a probe before the breaker opens), not as the hard fault a connect timeout is",
            s.llm.connect_timeout, s.llm.request_timeout
        ));
    }
    out
}

/// What a drain's end means for the process: only a finished drain stops it cleanly.
// Returned once, when the process ends: the size of its error does not matter.
#[allow(clippy::result_large_err)]
fn drain_verdict(drain: Drain, timeout: Duration) -> Result<(), AppError> {
    match drain {
        Drain::Finished => Ok(()),
        Drain::Failed(e) => Err(AppError::DrainFailed(e)),
        Drain::DeadlineExceeded => Err(AppError::DrainTimeout(timeout)),
    }
}

type RouterTask = JoinHandle<Result<(), lapin::Error>>;
/// The backlog poller's task ([`poll_backlog`]).
type BacklogTask = JoinHandle<Result<(), lapin::Error>>;

fn router_failure(r: Result<Result<(), lapin::Error>, tokio::task::JoinError>) -> SessionError {
    match r {
        Ok(Ok(())) => SessionError::RouterStopped,
        Ok(Err(e)) => SessionError::Router(e),
        Err(e) => SessionError::RouterTask(e),
    }
}

/// What every session shares.
struct App {
    settings: Arc<Settings>,
    llm: LlmClient,
    /// Boot nonce written to the member key, so a restarted process is told from its past self.
    nonce: String,
    readiness: Readiness,
    /// Whether a session has opened its connections and declared the topology. Until then, a
    /// refused login stops the daemon ([`AppError::AccessRefused`]); from then on it is retried
    /// (credentials being rotated).
    opened: AtomicBool,
    /// The last error lapin reported on the current session's consuming and publishing
    /// connections ([`LastError`]): the line of a session that ended says what the broker said.
    last_errors: [LastError; 2],
}

impl App {
    /// Runs sessions until `work` is cancelled, reconnecting with an exponential backoff.
    ///
    /// The first session connects to the first broker node of `amqp.urls`; after a session whose
    /// broker link failed, the next one tries the node after it ([`crate::amqp::next_node`]), so
    /// a lost node is left for the next live one after one backoff.
    async fn sessions(&self, work: &CancellationToken, events: &mut (impl FnMut(Lifecycle) + Send)) -> Result<(), AppError> {
        let amqp = &self.settings.amqp;
        let mut backoff = amqp.reconnect_backoff_initial;
        let mut redis: Option<RedisConn> = None;
        let mut node = 0;
        // Broker nodes that refused the login or vhost before any session opened, with why.
        let mut refused_nodes = std::collections::BTreeMap::new();
        metrics::amqp_connected_node(None, amqp.nodes.len());
        while !work.is_cancelled() {
            let began = tokio::time::Instant::now();
            let end = self.connect_and_run(&mut redis, node, work, events).await;
            metrics::amqp_connected_node(None, amqp.nodes.len());
            let failure = match end? {
                SessionEnd::Stopped => return Ok(()),
                SessionEnd::Failed(e) => e,
            };
            if self.readiness.is_ready() && began.elapsed() >= amqp.reconnect_backoff_max {
                // The session had been healthy for a while: start the backoff over. One that ends
                // soon after it became ready (its input queue refused to the daemon's user, say)
                // keeps doubling it, so a broker that refuses every session is not asked twice a
                // second.
                backoff = amqp.reconnect_backoff_initial;
            }
            self.readiness.set(failure.not_ready(), true);
            let refused = failure.access_refused(&self.settings, node);
            if let Some(why) = &refused {
                let everywhere = match failure {
                    SessionError::Connect(_) => {
                        refused_nodes.insert(node, why.clone());
                        refused_nodes.len() == amqp.nodes.len()
                    }
                    _ => true,
                };
                if everywhere && !self.opened.load(Ordering::Relaxed) {
                    // Every node's refusal: with amqp.urls they may differ (one password, one vhost).
                    let all = match failure {
                        SessionError::Connect(_) => refused_nodes.into_values().collect::<Vec<_>>().join("; "),
                        _ => why.clone(),
                    };
                    return Err(AppError::AccessRefused(all));
                }
            }
            let failed_node = node;
            if failure.amqp_failed() {
                node = crate::amqp::next_node(node, amqp.nodes.len());
            }
            let wait = jitter(backoff);
            self.log_session_end(refused.as_deref(), &failure, wait, failed_node, node);
            tokio::select! {
                _ = work.cancelled() => return Ok(()),
                _ = tokio::time::sleep(wait) => {}
            }
            backoff = (backoff * 2).min(amqp.reconnect_backoff_max);
        }
        Ok(())
    }

    /// Logs why a session ended and when the next one starts (after `wait`, the backoff with its
    /// jitter, on broker node `node` after `failed_node`): at ERROR for what lasts until an
    /// operator acts (a refused login or access, a connection limit, queues that no longer
    /// match, a queue limit), else at WARN with what the broker said.
    fn log_session_end(&self, refused: Option<&str>, failure: &SessionError, wait: Duration, failed_node: usize, node: usize) {
        let amqp = &self.settings.amqp;
        match (refused, failure) {
            (None, f) if f.connection_limit().is_some() => {
                let why = f.connection_limit().unwrap_or_default();
                error!(retry_in = ?wait, failed_node, next_node = node, nodes = amqp.nodes.len(), "{why}")
            }
            (Some(why), _) => error!(error = %failure, retry_in = ?wait, failed_node, next_node = node, nodes = amqp.nodes.len(), "{why}; reconnecting"),
            (None, SessionError::Topology(e)) if e.is_config_error() => error!(
                error = %e,
                retry_in = ?wait,
                "the broker's queues no longer match the configuration (changed under the running daemon); not serving until they do: \
                 delete the queue named so the daemon declares it again, or change the configuration and restart"
            ),
            // It lasts until an operator raises the limit or deletes queues.
            (None, SessionError::Topology(e @ TopologyError::QueueLimit { .. })) => error!(error = %e, retry_in = ?wait, "not serving until a queue can be declared; retrying"),
            // Permissions changed under the running daemon: they last until an operator acts.
            (None, SessionError::Topology(TopologyError::Amqp(e))) if crate::amqp::reply_code(e) == Some(crate::amqp::ACCESS_REFUSED) => error!(
                error = %e,
                retry_in = ?wait,
                "the broker refused the daemon's user access to one of its queues or exchanges (403 ACCESS_REFUSED): \
                 check the user's configure, write and read permissions on the vhost (rabbitmqctl list_user_permissions); retrying"
            ),
            // Before any AMQP connection: the broker is not the one at fault.
            (None, SessionError::Redis(crate::lease::ConnectError::Sentinels { .. })) => {
                warn!(error = %failure, retry_in = ?wait, "cannot learn the Redis primary from the sentinels (redis.sentinels); retrying")
            }
            (None, SessionError::Redis(_)) if self.settings.redis.sentinel.is_some() => {
                warn!(error = %failure, retry_in = ?wait, "cannot connect to the Redis primary that the sentinels name (redis.sentinels; credentials of redis.url); retrying")
            }
            (None, SessionError::Redis(_)) => {
                let hint = crate::tls::plain_port_hint(&failure.to_string());
                warn!(error = %failure, url = %self.settings.redis.url, retry_in = ?wait, hint, "cannot connect to Redis (redis.url); retrying")
            }
            (None, _) => {
                // What the broker said, when it closed a connection: the error above is often
                // only the component that noticed first.
                let said = |from_broker: bool| {
                    let mut texts: Vec<String> = self.last_errors.iter().filter_map(last_error).filter(|e| e.0 == from_broker).map(|e| e.1).collect();
                    texts.dedup();
                    texts.join("; ")
                };
                let (broker_said, client_found) = (said(true), said(false));
                let hint = crate::tls::plain_port_hint(&failure.to_string());
                warn!(error = %failure, broker_said, client_found, retry_in = ?wait, failed_node, next_node = node, nodes = amqp.nodes.len(), hint, "session ended; reconnecting")
            }
        }
    }

    /// Connects Redis once (the connection manager reconnects by itself), then runs a session.
    async fn connect_and_run(
        &self,
        redis: &mut Option<RedisConn>,
        node: usize,
        work: &CancellationToken,
        events: &mut (impl FnMut(Lifecycle) + Send),
    ) -> Result<SessionEnd, AppError> {
        let r = match redis {
            Some(r) => r.clone(),
            None => match work.run_until_cancelled(crate::lease::connect(&self.settings.redis)).await {
                None => return Ok(SessionEnd::Stopped),
                Some(Ok(r)) => redis.insert(r).clone(),
                Some(Err(e)) => return Ok(SessionEnd::Failed(SessionError::Redis(e))),
            },
        };
        self.session(r, node, work, events).await
    }

    /// Opens the session's three AMQP connections to broker node `node` (see [`Connections`]:
    /// consumers and acks on one, publishes on another, the router's input consumer on the
    /// third; named `prefix-batcher {instance}`, `prefix-batcher {instance} publish` and
    /// `prefix-batcher {instance} intake`) and declares the topology; closes them again when the
    /// topology is refused.
    async fn open(&self, redis: &RedisConn, node: usize) -> Result<Connections, SessionError> {
        let s = &self.settings;
        let connect = |link| crate::amqp::connect_link(&s.amqp, node, &s.instance_name, link);
        let (consume, publish, intake) = tokio::join!(connect(Link::Consume), connect(Link::Publish), connect(Link::Intake));
        let (consume, publish, intake) = match (consume, publish, intake) {
            (Ok(c), Ok(p), Ok(i)) => (c, p, i),
            // `e` is the first failure, `x` and `y` the other two results.
            (Err(e), x, y) | (x @ Ok(_), Err(e), y) | (x @ Ok(_), y @ Ok(_), Err(e)) => {
                let opened: Vec<_> = [x, y].into_iter().filter_map(Result::ok).collect();
                futures_util::future::join_all(opened.iter().map(|c| crate::amqp::close_connection(c, "another connection of the session failed"))).await;
                return Err(SessionError::Connect(e));
            }
        };
        let conns = Connections::new(consume, publish, intake, node, &s.instance_name, s.amqp.confirm_timeout * 2);
        let meta_key = topology::partition_count_key(&s.redis.key_prefix);
        if let Err(e) = topology::declare(&conns.consume, &s.amqp, &mut redis.manager(), &meta_key).await {
            if let topology::TopologyError::Redis(re) = &e {
                redis.report(re);
            }
            let _ = conns.close("topology refused").await;
            return Err(SessionError::Topology(e));
        }
        info!(partitions = s.amqp.partitions.get(), node, url = %s.amqp.nodes[node], "topology declared");
        self.opened.store(true, Ordering::Relaxed);
        metrics::amqp_connected_node(Some(node), s.amqp.nodes.len());
        Ok(conns)
    }

    /// One session: open, run the router, backlog poller and ownership manager until a failure
    /// or the shutdown, then drain or hard-stop.
    async fn session(
        &self,
        redis: RedisConn,
        node: usize,
        work: &CancellationToken,
        events: &mut (impl FnMut(Lifecycle) + Send),
    ) -> Result<SessionEnd, AppError> {
        // Opening waits for the broker (up to the connect timeout per connection, see
        // `amqp::connect_node`): a shutdown requested meanwhile ends it at once.
        let opened = tokio::select! {
            _ = work.cancelled() => return Ok(SessionEnd::Stopped),
            opened = self.open(&redis, node) => opened,
        };
        let conns = match opened {
            Ok(c) => c,
            // Before the first session: the deployment does not match the configuration; logged
            // once, by the caller that ends the process with the error's exit code. After it, the
            // same refusal means that someone changed a queue under the running daemon (deleted it
            // and declared it with other arguments; another deployment's partition count): every
            // instance would meet it at its next reconnect, and an exit the service manager does
            // not restart (78) would take the whole deployment down. So it is retried, logged
            // at ERROR, until the queue is set right ([`Self::sessions`]).
            Err(SessionError::Topology(e)) if e.is_config_error() && !self.opened.load(Ordering::Relaxed) => {
                return Err(AppError::Topology(e));
            }
            Err(e) => return Ok(SessionEnd::Failed(e)),
        };
        let _blocked = self.watch_blocked(&conns);
        let session = work.child_token();
        // The session's checks of direct reply-to nodes, on a connection of their own.
        let reply_nodes = Arc::new(crate::reply_node::NodeCheck::new(self.settings.clone(), node));
        let r = &self.settings.redis;
        let reports = crate::intake_reports::IntakeReports::new(redis.clone(), &r.key_prefix, &self.settings.instance_name, r.command_timeout);
        let mut router: RouterTask = {
            let (conns, settings, token, checks) = (conns.clone(), self.settings.clone(), session.child_token(), reply_nodes.clone());
            let reports = reports.clone();
            tokio::spawn(async move { crate::router::run(&conns, settings, token, checks, reports).await })
        };
        let mut backlog = tokio::spawn(poll_backlog(conns.consume.clone(), self.settings.clone(), session.child_token()));
        tokio::spawn(crate::splits::run_restarting(self.settings.clone(), redis.clone(), session.child_token()));
        let mut own = Ownership::new(self.settings.clone(), redis, self.nonce.clone(), self.llm.clone(), self.readiness.clone(), reply_nodes.clone());
        let (redis_tx, mut redis_rx) = mpsc::unbounded_channel::<bool>();
        let phase = {
            let mut own_fut = pin!(own.run(conns.clone(), session.child_token(), move |ok| {
                let _ = redis_tx.send(ok);
            }));
            match self.watch(&conns, own_fut.as_mut(), &mut router, &mut backlog, &mut redis_rx, work, events).await {
                Some(e) => Phase::Failed(e),
                None => Phase::Drained(self.drain(&conns, own_fut, &mut router, &mut backlog, events).await),
            }
        };
        session.cancel();
        reply_nodes.close().await;
        match phase {
            Phase::Drained(Drain::Finished) => {
                info!("drained; bye");
                Ok(SessionEnd::Stopped)
            }
            Phase::Drained(drain) => {
                hard_stop(&mut own, &router, &backlog, &conns, "drain incomplete").await;
                drain_verdict(drain, self.settings.drain_timeout).map(|()| SessionEnd::Stopped)
            }
            Phase::Failed(e) => {
                hard_stop(&mut own, &router, &backlog, &conns, "session failed").await;
                // The router was aborted: the deliveries it held are back in the input queue.
                crate::router::report_intake_end(&reports, true).await;
                self.await_close_reason(&conns).await;
                Ok(SessionEnd::Failed(e))
            }
        }
    }

    /// Watches the session's consuming and publishing connections for `connection.blocked`
    /// ([`watch_connection_blocked`]), with the last errors of the session before cleared. The
    /// watchers are aborted when the returned value is dropped, however the session ends;
    /// aborting counts as unblocked.
    fn watch_blocked(&self, conns: &Connections) -> [AbortOnDrop; 2] {
        for slot in &self.last_errors {
            *slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        }
        let [consume_error, publish_error] = self.last_errors.clone();
        [
            AbortOnDrop(tokio::spawn(watch_connection_blocked(&conns.consume, metrics::connection::CONSUME, self.readiness.clone(), consume_error))),
            AbortOnDrop(tokio::spawn(watch_connection_blocked(&conns.publish, metrics::connection::PUBLISH, self.readiness.clone(), publish_error))),
        ]
    }

    /// When a connection of `conns` is closed, waits (at most [`LAST_ERROR_WAIT`]) for its
    /// reason: lapin reports the broker's `connection.close` (its reply code and text) a moment
    /// after the connection's status changed, which is what ended the session.
    async fn await_close_reason(&self, conns: &Connections) {
        if conns.consume.status().connected() && conns.publish.status().connected() {
            return;
        }
        let reported = || self.last_errors.iter().any(|slot| last_error(slot).is_some());
        let deadline = tokio::time::Instant::now() + LAST_ERROR_WAIT;
        while !reported() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Runs until a component fails (`Some`) or the shutdown is requested (`None`), reporting
    /// readiness and liveness on the way.
    // Each argument is a different part of the session this watches; a struct for them would
    // only be built for this call.
    #[allow(clippy::too_many_arguments)]
    async fn watch(
        &self,
        conns: &Connections,
        mut own_fut: Pin<&mut impl Future<Output = Result<(), OwnershipError>>>,
        router: &mut RouterTask,
        backlog: &mut BacklogTask,
        redis_rx: &mut mpsc::UnboundedReceiver<bool>,
        work: &CancellationToken,
        events: &mut (impl FnMut(Lifecycle) + Send),
    ) -> Option<SessionError> {
        let mut alive = tokio::time::interval(ALIVE_PERIOD);
        loop {
            tokio::select! {
                // A shutdown first: the tasks below end on it too (their tokens are children of
                // `work`), and that is not a failure.
                biased;
                _ = work.cancelled() => return None,
                r = own_fut.as_mut() => return Some(r.err().map_or(SessionError::OwnershipStopped, SessionError::Ownership)),
                r = &mut *router => return Some(router_failure(r)),
                r = &mut *backlog => return Some(match r {
                    Ok(Ok(())) => SessionError::BrokerSilent(lapin::Error::from(std::io::Error::other("the backlog poller stopped"))),
                    Ok(Err(e)) => SessionError::BrokerSilent(e),
                    Err(e) => SessionError::BacklogTask(e),
                }),
                Some(redis_ok) = redis_rx.recv() => {
                    if !redis_ok {
                        warn!("the membership heartbeat failed (Redis unreachable, or refusing the write: its reason is on the \"membership heartbeat failed\" line); not ready");
                        self.readiness.set(NotReady::RedisDown, true);
                    } else {
                        // A heartbeat from a running session: RabbitMQ and Redis both answer. This
                        // clears what a failed session set (`amqp down` or `redis down`) as well
                        // as `starting`.
                        let starting = self.readiness.state().reasons().any(|r| r == NotReady::Starting);
                        let was_ready = self.readiness.is_ready();
                        for reason in [NotReady::Starting, NotReady::AmqpDown, NotReady::RedisDown] {
                            self.readiness.set(reason, false);
                        }
                        if starting {
                            events(Lifecycle::Ready);
                            info!("ready");
                        } else if !was_ready && self.readiness.is_ready() {
                            info!("ready again");
                        }
                    }
                }
                _ = alive.tick() => {
                    // A closed connection ends the session at once: the router would otherwise
                    // keep consuming with a dead publishing connection and requeue every request.
                    if !conns.consume.status().connected() {
                        return Some(SessionError::ConnectionClosed(metrics::connection::CONSUME));
                    }
                    if !conns.publish.status().connected() {
                        return Some(SessionError::ConnectionClosed(metrics::connection::PUBLISH));
                    }
                    events(Lifecycle::Alive);
                }
            }
        }
    }

    /// The graceful drain under ONE deadline covering the whole teardown: the router stops, the
    /// ownership manager drains every partition, releases the leases and deletes the member key,
    /// the backlog poller stops, the connection closes. The tokens are already cancelled (they
    /// are children of the work token).
    async fn drain(
        &self,
        conns: &Connections,
        own_fut: Pin<&mut impl Future<Output = Result<(), OwnershipError>>>,
        router: &mut RouterTask,
        backlog: &mut BacklogTask,
        events: &mut (impl FnMut(Lifecycle) + Send),
    ) -> Drain {
        events(Lifecycle::Stopping);
        info!(timeout = ?self.settings.drain_timeout, "draining");
        self.readiness.set(NotReady::Draining, true);
        // The drain waits for the LLM calls in flight: a frozen server's would outlast it, so
        // their endpoints are checked now (their requests then go back uncharged).
        self.llm.check_liveness_now();
        let deadline = tokio::time::Instant::now() + self.settings.drain_timeout;
        let teardown = async {
            // At once, not one after the other: a router slow to stop (a forward waiting for its
            // confirm) must not hold up the partitions' drains and their lease releases.
            let router_stopped = async {
                if let Ok(Err(e)) = (&mut *router).await {
                    warn!(error = %e, "router failed during the drain; its unacked input returns to the input queue");
                }
            };
            let ((), owned) = tokio::join!(router_stopped, own_fut);
            let _ = backlog.await;
            if let Err(e) = owned {
                return Drain::Failed(SessionError::Ownership(e));
            }
            if let Err(e) = conns.close("shutdown").await {
                warn!(error = %e, "closing the connection after the drain failed; nothing was left unacked");
            }
            Drain::Finished
        };
        tokio::time::timeout_at(deadline, teardown).await.unwrap_or(Drain::DeadlineExceeded)
    }
}

/// Hard stop of a session: abort every partition, release its lease and delete the member key
/// (best effort, each Redis call bounded by `redis.command_timeout`), stop the tasks, close the
/// connection.
async fn hard_stop(own: &mut Ownership, router: &RouterTask, backlog: &BacklogTask, conns: &Connections, why: &str) {
    own.abort_and_release().await;
    router.abort();
    backlog.abort();
    let _ = conns.close(why).await;
}

fn jitter(d: Duration) -> Duration {
    d.mul_f64(0.5 + fastrand::f64() * 0.5)
}

/// Reads the input and every partition queue's backlog every `amqp.backlog_poll_interval`
/// until `stop` is cancelled.
///
/// It is also the session's check that the broker still answers on the consuming connection:
/// each poll is a round trip, and one that gets no answer within [`crate::amqp::RPC_TIMEOUT`]
/// ends the poller with the timeout error, which ends the session
/// ([`SessionError::BrokerSilent`]). lapin finds most dead connections itself (socket errors,
/// missing heartbeats); this catches the rest, such as a connection it still reports open after
/// the process was frozen. The consuming connection never publishes, so RabbitMQ never blocks it
/// under a memory or disk alarm and its answers do not stop for that. A refused declare (a queue
/// deleted under the daemon) only reopens the channel at the next poll.
async fn poll_backlog(conn: Arc<Connection>, settings: Arc<Settings>, stop: CancellationToken) -> Result<(), lapin::Error> {
    let mut tick = tokio::time::interval(settings.amqp.backlog_poll_interval);
    let mut ch: Option<lapin::Channel> = None;
    let silent = |e: lapin::Error| if crate::amqp::is_timeout(&e) { Err(e) } else { Ok(()) };
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                if let Some(c) = ch {
                    let _ = crate::amqp::close_channel(&c, "stopping").await;
                }
                return Ok(());
            }
            _ = tick.tick() => {}
        }
        if ch.is_none() {
            match crate::amqp::answered("channel.open", conn.create_channel()).await {
                Ok(c) => ch = Some(c),
                Err(e) => {
                    silent(e)?;
                    continue;
                }
            }
        }
        let Some(c) = &ch else { continue };
        let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        let declare = |queue: &str| crate::amqp::answered("queue.declare", c.queue_declare(queue.into(), opts, FieldTable::default()));
        match declare(&settings.amqp.input_queue).await {
            Ok(q) => metrics::input_backlog(q.message_count()),
            Err(e) => {
                silent(e)?;
                ch = None;
                continue;
            }
        }
        // Every partition, owned here or not: an unowned partition's backlog is what an operator
        // most needs to see. Dashboards take `max by (partition)` over instances.
        for p in 0..settings.amqp.partitions.get() {
            let queue = settings.amqp.partition_queue(p);
            match declare(&queue).await {
                Ok(q) => {
                    metrics::partition_backlog(p, q.message_count());
                    crate::partition::observe_queue(&queue, q.message_count());
                }
                Err(e) => {
                    silent(e)?;
                    ch = None;
                    break;
                }
            }
        }
    }
}

/// Watches the AMQP connection `conn`, labelled `connection` (a value of [`metrics::connection`]),
/// for broker flow control. RabbitMQ blocks a connection that publishes while a memory or disk
/// alarm is in effect (`connection.blocked`, <https://www.rabbitmq.com/docs/connection-blocked>);
/// publishes and their confirms stall until `connection.unblocked`. While it is blocked: one warn
/// log with the broker's reason, `amqp_connection_blocked_total` counted once,
/// `amqp_connection_blocked` at 1, and [`NotReady::ConnectionBlocked`] set through
/// [`Readiness::set_connection_blocked`] (per connection, so several connections can be watched).
///
/// The listener is registered when this is called, so call it right after connecting. The future
/// ends when the connection's event stream ends; dropping it (or aborting its task) counts as an
/// unblock, so a closed connection leaves no stale state. Spawn it and abort it when the
/// connection is done with.
///
/// It also keeps the last error lapin reports on the connection ([`lapin::Event::Error`], not
/// a channel's soft error) in `last_error`.
pub fn watch_connection_blocked(
    conn: &Connection,
    connection: &'static str,
    readiness: Readiness,
    last_error: LastError,
) -> impl Future<Output = ()> + Send + 'static {
    // Boxed as a `'static` trait object: lapin's opaque stream type names the borrow of `conn`.
    let events: Pin<Box<dyn Stream<Item = lapin::Event> + Send>> = Box::pin(conn.events_listener());
    follow_connection_blocked(events, connection, readiness, last_error)
}

/// The last error lapin reported on one AMQP connection (not a channel's soft error): whether
/// the broker sent it (a `connection.close`, or a `channel.close` with a hard reply code, with
/// its reply code and text) or lapin found it itself (a socket error, missing heartbeats), and
/// its text (credentials redacted). The line of a session that ended says them as `broker_said`
/// and `client_found`.
pub type LastError = Arc<std::sync::Mutex<Option<(bool, String)>>>;

/// How long a session that ended because a connection closed waits for lapin to report the
/// broker's reason ([`LastError`]); it comes within milliseconds, later on a loaded machine.
const LAST_ERROR_WAIT: Duration = Duration::from_secs(1);

fn last_error(slot: &LastError) -> Option<(bool, String)> {
    slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
}

async fn follow_connection_blocked(events: impl Stream<Item = lapin::Event> + Send, connection: &'static str, readiness: Readiness, last_error: LastError) {
    let mut state = Blocked { connection, readiness, since: None };
    let mut events = pin!(events);
    while let Some(event) = events.next().await {
        match event {
            lapin::Event::ConnectionBlocked(reason) => state.block(&reason),
            lapin::Event::ConnectionUnblocked => state.unblock(),
            // A channel's error (a soft reply code: a passive declare's 404, a refused publish's
            // 406) closes only that channel, and is logged where it happens; kept here, it would
            // be reported as the reason of a later, unrelated connection loss.
            lapin::Event::Error(e) if e.is_amqp_soft_error() => {}
            lapin::Event::Error(e) => {
                let from_broker = e.is_amqp_error();
                *last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some((from_broker, crate::config::redact_text(&e.to_string())));
            }
            _ => {}
        }
    }
}

/// The blocked state of one connection; dropping it unblocks.
struct Blocked {
    connection: &'static str,
    readiness: Readiness,
    /// When the current block began; `None` while not blocked.
    since: Option<tokio::time::Instant>,
}

impl Blocked {
    fn block(&mut self, reason: &str) {
        if self.since.is_some() {
            return;
        }
        self.since = Some(tokio::time::Instant::now());
        if self.connection == metrics::connection::PUBLISH {
            crate::publisher::note_publishing_blocked();
        }
        warn!(connection = self.connection, reason, "the broker blocked the AMQP connection (resource alarm): publishing stalls until it unblocks");
        metrics::amqp_connection_blocked(self.connection, true);
        self.readiness.set_connection_blocked(self.connection, true);
    }

    fn unblock(&mut self) {
        let Some(since) = self.since.take() else { return };
        info!(connection = self.connection, blocked_for = ?since.elapsed(), "the broker unblocked the AMQP connection");
        if self.connection == metrics::connection::PUBLISH {
            crate::publisher::note_publishing_unblocked();
        }
        metrics::amqp_connection_blocked(self.connection, false);
        self.readiness.set_connection_blocked(self.connection, false);
    }
}

impl Drop for Blocked {
    fn drop(&mut self) {
        self.unblock();
    }
}

/// Aborts the task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(kind: lapin::protocol::AMQPErrorKind, text: &str) -> lapin::Error {
        lapin::ErrorKind::ProtocolError(lapin::protocol::AMQPError::new(kind, text.into())).into()
    }

    /// RabbitMQ refuses a connection over a vhost's or user's connection limit with 530, as it
    /// refuses a missing vhost: the limit is retried (it clears when connections close), the
    /// missing vhost stops the daemon (exit 78).
    #[test]
    fn a_connection_limit_is_retried_and_a_refused_vhost_is_not() {
        use lapin::protocol::{AMQPErrorKind, AMQPHardError};
        let settings = Settings::from_raw(&crate::config::RawConfig::default()).expect("default settings");
        let limit = SessionError::Connect(refusal(
            AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED),
            "NOT_ALLOWED - access to vhost 'v' refused for user 'u': connection limit (4) is reached",
        ));
        assert!(limit.access_refused(&settings, 0).is_none(), "a connection limit stopped the daemon");
        assert!(limit.connection_limit().is_some_and(|why| why.contains("connection limit") && why.contains("list_vhost_limits")));
        assert!(!crate::client::login_refused(&limit.to_string()));
        let vhost = SessionError::Connect(refusal(AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED), "NOT_ALLOWED - vhost v not found"));
        assert!(vhost.access_refused(&settings, 0).is_some_and(|why| why.contains("refused the vhost")));
        assert!(vhost.connection_limit().is_none());
        assert!(crate::client::login_refused(&vhost.to_string()));
    }

    fn gauge_line(connection: &str) -> String {
        let text = metrics::render();
        let prefix = format!("prefix_batcher_amqp_connection_blocked{{connection=\"{connection}\"}} ");
        text.lines().find(|l| l.starts_with(&prefix)).map(str::to_owned).unwrap_or_default()
    }

    fn count_line(connection: &str) -> String {
        let text = metrics::render();
        let prefix = format!("prefix_batcher_amqp_connection_blocked_total{{connection=\"{connection}\"}} ");
        text.lines().find(|l| l.starts_with(&prefix)).map(str::to_owned).unwrap_or_default()
    }

    #[test]
    fn advisories_name_likely_mistakes_and_the_defaults_have_none() {
        let mut raw = crate::config::RawConfig::default();
        assert_eq!(advisories(&Settings::from_raw(&raw).unwrap()), Vec::<String>::new());
        raw.amqp.heartbeat = "2s".into();
        raw.llm.request_timeout = "40s".into();
        raw.llm.connect_timeout = "45s".into();
        let got = advisories(&Settings::from_raw(&raw).unwrap());
        assert_eq!(got.len(), 3, "{got:#?}");
        assert!(got[0].starts_with("amqp.heartbeat = 2s"), "{}", got[0]);
        assert!(got[1].starts_with("llm.request_timeout = 40s") && got[1].contains("50s"), "{}", got[1]);
        assert!(got[2].starts_with("llm.connect_timeout = 45s is not below llm.request_timeout = 40s"), "{}", got[2]);
    }

    /// Seen on a daemon: a passive declare's 404 on a channel of the publishing connection,
    /// minutes earlier, was the `broker_said` of a later connection loss that had nothing to do
    /// with it. A channel's soft error is not kept; a connection's error is.
    #[tokio::test]
    async fn a_channel_error_is_not_kept_as_the_connection_error() {
        use lapin::protocol::{AMQPError, AMQPErrorKind};
        let amqp_error = |code: u16, text: &str| {
            let kind = AMQPErrorKind::from_id(code).expect("an AMQP reply code");
            lapin::Error::from(lapin::ErrorKind::ProtocolError(AMQPError::new(kind, text.into())))
        };
        let (tx, rx) = mpsc::unbounded_channel::<lapin::Event>();
        let events = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
        let slot = LastError::default();
        let task = tokio::spawn(follow_connection_blocked(events, "test-errors", Readiness::new(), slot.clone()));
        tx.send(lapin::Event::Error(amqp_error(404, "NOT_FOUND - no queue 'amq.rabbitmq.reply-to.x'"))).unwrap();
        tx.send(lapin::Event::Error(amqp_error(406, "PRECONDITION_FAILED - message size"))).unwrap();
        drop(tx);
        task.await.unwrap();
        assert_eq!(last_error(&slot), None, "a channel's soft error was kept");

        let (tx, rx) = mpsc::unbounded_channel::<lapin::Event>();
        let events = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
        let task = tokio::spawn(follow_connection_blocked(events, "test-errors", Readiness::new(), slot.clone()));
        tx.send(lapin::Event::Error(amqp_error(404, "NOT_FOUND - no queue 'q'"))).unwrap();
        tx.send(lapin::Event::Error(amqp_error(320, "CONNECTION_FORCED - broker forced connection closure"))).unwrap();
        tx.send(lapin::Event::Error(amqp_error(404, "NOT_FOUND - a later channel error"))).unwrap();
        drop(tx);
        task.await.unwrap();
        let (from_broker, text) = last_error(&slot).expect("the connection's error is kept");
        assert!(from_broker && text.contains("CONNECTION_FORCED"), "{text}");
    }

    #[tokio::test]
    async fn a_blocked_connection_is_not_ready_until_unblocked_or_gone() {
        let readiness = Readiness::new();
        readiness.set(NotReady::Starting, false);
        let (tx, rx) = mpsc::unbounded_channel::<lapin::Event>();
        let events = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
        let task = tokio::spawn(follow_connection_blocked(events, "test-blocked-a", readiness.clone(), LastError::default()));
        let seen = readiness.subscribe();
        let wait_for = |ready: bool| {
            let mut seen = seen.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(5), seen.wait_for(|s| s.is_ready() == ready)).await.expect("readiness changed").unwrap();
            }
        };
        tx.send(lapin::Event::ConnectionBlocked("low on memory".into())).unwrap();
        wait_for(false).await;
        assert_eq!(readiness.state().reasons().collect::<Vec<_>>(), vec![NotReady::ConnectionBlocked]);
        assert!(gauge_line("test-blocked-a").ends_with(" 1"), "{}", gauge_line("test-blocked-a"));
        tx.send(lapin::Event::ConnectionBlocked("low on memory".into())).unwrap(); // a repeat is one block
        tx.send(lapin::Event::ConnectionUnblocked).unwrap();
        wait_for(true).await;
        assert!(gauge_line("test-blocked-a").ends_with(" 0"));
        assert!(count_line("test-blocked-a").ends_with(" 1"), "{}", count_line("test-blocked-a"));
        // Blocked again, then the task is aborted (its connection is done with): ready again.
        tx.send(lapin::Event::ConnectionBlocked("low on disk".into())).unwrap();
        wait_for(false).await;
        task.abort();
        let _ = task.await;
        assert!(readiness.is_ready(), "{}", readiness.state());
        assert!(gauge_line("test-blocked-a").ends_with(" 0"));
        assert!(count_line("test-blocked-a").ends_with(" 2"));
    }

    #[test]
    fn only_a_finished_drain_exits_zero() {
        let t = Duration::from_secs(5);
        assert!(drain_verdict(Drain::Finished, t).is_ok());
        let failed = drain_verdict(Drain::Failed(SessionError::Ownership(OwnershipError::ConnectionLost)), t).unwrap_err();
        assert!(matches!(failed, AppError::DrainFailed(_)), "{failed:?}");
        assert_eq!(failed.exit_code(), EX_FAILURE);
        assert!(failed.to_string().contains("amqp connection lost"), "{failed}");
        let late = drain_verdict(Drain::DeadlineExceeded, t).unwrap_err();
        assert_eq!(late.exit_code(), EX_SOFTWARE);
        assert_ne!(EX_FAILURE, 0);
    }

    #[test]
    fn config_mismatch_exits_78_other_topology_errors_1() {
        let e = AppError::Topology(TopologyError::PartitionCount { existing: "8".into(), configured: 4, redis_key: "pb:partitions".into() });
        assert_eq!(e.exit_code(), EX_CONFIG);
        assert!(e.to_string().contains("stop every instance, delete the partition queues and the Redis key `pb:partitions`"), "{e}");
        let io: lapin::Error = std::io::Error::other("reset").into();
        assert_eq!(AppError::Topology(TopologyError::Amqp(io)).exit_code(), EX_FAILURE);
    }
}
