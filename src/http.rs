//! The HTTP endpoints: `/metrics` (Prometheus text format), `/healthz` (liveness: the process
//! serves requests) and `/readyz` (readiness from [`Readiness`]: 200 `ready`, or 503
//! `not ready: {reasons}`, e.g. `not ready: amqp down`).

use std::future::Future;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics;
use crate::readiness::Readiness;

/// Content type of the Prometheus text exposition format 0.0.4.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The router with all endpoints; `/readyz` answers from `readiness`.
pub fn router(readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(|| async { ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], metrics::render()) }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(readiness)
}

async fn readyz(State(readiness): State<Readiness>) -> impl IntoResponse {
    let state = readiness.state();
    let code = if state.is_ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, format!("{state}\n"))
}

/// How long the server waits, once told to stop, for its open connections to finish: 5 s.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a client has to send a request's whole header, from the moment the server waits for
/// it (at connect, and once a response is sent on a kept-alive connection): 30 s, hyper's default
/// for its HTTP/1 server (`hyper::server::conn::http1::Builder::header_read_timeout`). A
/// connection that has sent no complete header by then is closed.
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How many HTTP connections the server holds at once: 256. For a connection beyond them, the
/// oldest open one is closed (logged, at most 10 times a minute): clients that hold connections
/// cannot keep a scraper or a health check out, which need one for milliseconds. Prometheus, a
/// load balancer's health checks and an operator's `curl` need a few; without a bound, clients
/// that keep their connections open (say, pipelining requests and never reading the answers,
/// which no header timeout ends) take every file descriptor of the process, and its LLM calls,
/// Redis and AMQP connections fail with `EMFILE`.
pub const MAX_CONNECTIONS: usize = 256;

/// How long the server keeps one HTTP connection open: 5 min, then it is closed, whatever it is
/// doing. A kept-alive scraper connects again; a client that stopped reading its answers frees
/// its place.
pub const MAX_CONNECTION_AGE: std::time::Duration = std::time::Duration::from_secs(300);

/// The limits of [`serve`]: the daemon's are [`Limits::DAEMON`].
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long the server waits, once told to stop, for the connections in progress to finish.
    pub grace: std::time::Duration,
    /// How long a connection has to send a request's whole header.
    pub header_timeout: std::time::Duration,
    /// How many connections are held at once.
    pub max_connections: usize,
    /// How long one connection is kept open.
    pub max_age: std::time::Duration,
}

impl Limits {
    /// [`SHUTDOWN_GRACE`], [`HEADER_READ_TIMEOUT`], [`MAX_CONNECTIONS`], [`MAX_CONNECTION_AGE`].
    pub const DAEMON: Limits = Limits { grace: SHUTDOWN_GRACE, header_timeout: HEADER_READ_TIMEOUT, max_connections: MAX_CONNECTIONS, max_age: MAX_CONNECTION_AGE };
}

/// Serves on `listener` until `shutdown` completes, then waits at most `limits.grace` for the
/// connections in progress to finish and closes the rest. Each connection must send a request's
/// whole header within `limits.header_timeout`, or it is closed: a client that sent half a
/// request and stalled, or connected and sent nothing (a scanner, a stuck scraper), would
/// otherwise hold a file descriptor until the process stops. (axum's own `serve` runs hyper
/// without a timer, so without that limit.) At most `limits.max_connections` are open at once,
/// each for at most `limits.max_age` ([`MAX_CONNECTIONS`], [`MAX_CONNECTION_AGE`]). A failed
/// accept that is not the one connection's fault (e.g. `EMFILE`, no file descriptor left) is
/// logged and retried after 1 s, as axum's `serve` does.
pub async fn serve(listener: tokio::net::TcpListener, readiness: Readiness, shutdown: impl Future<Output = ()> + Send + 'static, limits: Limits) -> std::io::Result<()> {
    let Limits { grace, header_timeout, max_connections, max_age } = limits;
    let app = router(readiness);
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(header_timeout);
    let open = std::sync::Arc::new(tokio::sync::Semaphore::new(max_connections));
    // The open connections, oldest first, each with the token that closes it.
    type Live = std::collections::VecDeque<(u64, tokio_util::sync::CancellationToken)>;
    let live: std::sync::Arc<std::sync::Mutex<Live>> = std::sync::Arc::default();
    let mut next_id = 0u64;
    let connections = hyper_util::server::graceful::GracefulShutdown::new();
    // Closes the connections still open after the grace time.
    let close = tokio_util::sync::CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    if !is_connection_error(&e) {
                        crate::warn_limited!(ACCEPT_LOG, error = %e, "the HTTP server cannot accept a connection; retrying in 1 s");
                        tokio::select! {
                            () = &mut shutdown => break,
                            () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                        }
                    }
                    continue;
                }
            },
        };
        let place = match open.clone().try_acquire_owned() {
            Ok(place) => place,
            Err(_) => {
                crate::warn_limited!(FULL_LOG, max = max_connections, "the HTTP server holds its most connections; closing the oldest for a new one (do clients keep connections open without reading the answers?)");
                let oldest = live.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop_front();
                if let Some((_, oldest)) = oldest {
                    oldest.cancel();
                }
                match tokio::time::timeout(std::time::Duration::from_secs(1), open.clone().acquire_owned()).await {
                    Ok(Ok(place)) => place,
                    _ => continue,
                }
            }
        };
        let evicted = tokio_util::sync::CancellationToken::new();
        let id = next_id;
        next_id += 1;
        live.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push_back((id, evicted.clone()));
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = connections.watch(http1.serve_connection(hyper_util::rt::TokioIo::new(stream), service));
        let close = close.clone();
        let live = live.clone();
        tokio::spawn(async move {
            // The client's own trouble (a reset, the header timeout): nothing to report.
            tokio::select! {
                _ = conn => {}
                () = close.cancelled() => {}
                () = evicted.cancelled() => {}
                () = tokio::time::sleep(max_age) => {}
            }
            live.lock().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|(i, _)| *i != id);
            drop(place);
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, connections.shutdown()).await.is_err() {
        tracing::info!(grace = ?grace, "HTTP connections still open after the shutdown grace time; closing them");
        close.cancel();
    }
    Ok(())
}

/// Bounds the lines of a failing accept in [`serve`].
static ACCEPT_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// Bounds the lines of connections closed beyond [`MAX_CONNECTIONS`] in [`serve`].
static FULL_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

/// Whether a failed accept is about the one connection (it was reset or aborted before it was
/// taken), so the next accept can follow at once; the list is axum's (`axum::serve`).
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readiness::NotReady;

    /// A server on a port chosen by the OS: its address, the sender that stops it, and its task.
    async fn start(
        readiness: Readiness,
        grace: std::time::Duration,
        header_timeout: std::time::Duration,
    ) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<std::io::Result<()>>) {
        start_with(readiness, Limits { grace, header_timeout, ..Limits::DAEMON }).await
    }

    /// [`start`] with all of `limits`.
    async fn start_with(readiness: Readiness, limits: Limits) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<std::io::Result<()>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, readiness, async move {
            let _ = stopped.await;
        }, limits));
        crate::tls::install_crypto_provider();
        (addr, stop, server)
    }

    /// Whether the server closes `conn` within 20 s: a read to its end finishes (EOF, or a reset).
    async fn closed_by_server(conn: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut buf = Vec::new();
        tokio::time::timeout(std::time::Duration::from_secs(20), conn.read_to_end(&mut buf)).await.is_ok()
    }

    #[tokio::test]
    async fn readyz_answers_from_the_readiness_state_and_names_the_reasons() {
        let readiness = Readiness::new();
        let (addr, stop, server) = start(readiness.clone(), SHUTDOWN_GRACE, HEADER_READ_TIMEOUT).await;
        let url = format!("http://{addr}/readyz");
        let get = || async { reqwest::get(url.as_str()).await.unwrap() };

        readiness.set(NotReady::AmqpDown, true);
        let r = get().await;
        assert_eq!(r.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.text().await.unwrap(), "not ready: starting, amqp down\n");

        readiness.set(NotReady::Starting, false);
        readiness.set(NotReady::AmqpDown, false);
        let r = get().await;
        assert_eq!(r.status(), reqwest::StatusCode::OK);
        assert_eq!(r.text().await.unwrap(), "ready\n");

        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }

    /// A connection whose request never completes does not keep the server from stopping.
    /// Observed: a client that sent `GET /metrics HTTP/1.1` and one header, then stalled, kept
    /// the process running after its drain until it was killed.
    #[tokio::test]
    async fn a_half_sent_request_does_not_hold_up_the_shutdown() {
        use tokio::io::AsyncWriteExt;
        let grace = std::time::Duration::from_millis(300);
        // A header timeout far beyond the test's deadline: only the grace time can end the wait.
        let (addr, stop, server) = start(Readiness::new(), grace, std::time::Duration::from_secs(3600)).await;
        let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        // The server has taken the connection once it answers another one.
        let r = reqwest::get(format!("http://{addr}/healthz")).await.unwrap();
        assert_eq!(r.status(), reqwest::StatusCode::OK);
        stop.send(()).unwrap();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(30), server).await;
        assert!(ended.is_ok(), "the server still waits for the half-sent request");
        // The connection is closed too, not left to the header timeout.
        assert!(closed_by_server(&mut half).await, "the half-sent request's connection is still open after the shutdown");
    }

    /// A connection that sends no complete request header within the header timeout is closed
    /// while the server runs on. Observed before: a client that sent half a request (or nothing)
    /// held its connection, a file descriptor of the daemon, until the process stopped.
    #[tokio::test]
    async fn a_connection_without_a_whole_header_is_closed_after_the_header_timeout() {
        use tokio::io::AsyncWriteExt;
        let header_timeout = std::time::Duration::from_millis(300);
        let (addr, stop, server) = start(Readiness::new(), SHUTDOWN_GRACE, header_timeout).await;
        let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        // Closed by the server: the read ends (EOF, or a reset) instead of waiting. The deadline
        // is far above the header timeout; without the timeout the read never ends.
        for (what, conn) in [("half-sent request", &mut half), ("silent connection", &mut silent)] {
            assert!(closed_by_server(conn).await, "the server still holds the {what}'s connection");
        }
        // The server runs on.
        let r = reqwest::get(format!("http://{addr}/healthz")).await.unwrap();
        assert_eq!(r.status(), reqwest::StatusCode::OK);
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }

    /// Clients that keep connections open hold at most [`Limits::max_connections`] of them, each
    /// for at most [`Limits::max_age`], and a new client is served by closing the oldest.
    /// Observed before: 20 connections that each pipelined 100 `GET /metrics` and never read the
    /// answers were held for as long as the test ran (no header timeout applies to a blocked
    /// write), and 2,000 idle ones, under a limit of 1,024 file descriptors, failed the daemon's
    /// LLM calls with `EMFILE` until the header timeout.
    #[tokio::test]
    async fn connections_are_bounded_in_number_and_age() {
        use tokio::io::AsyncWriteExt;
        let limits = Limits { max_connections: 2, max_age: std::time::Duration::from_millis(1500), header_timeout: std::time::Duration::from_secs(3600), ..Limits::DAEMON };
        let (addr, stop, server) = start_with(Readiness::new(), limits).await;
        // Two clients that send requests and never read the answers.
        let mut stuck = Vec::new();
        for _ in 0..2 {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(&b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(100)).await.unwrap();
            stuck.push(c);
        }
        // A third client is served: the oldest connection is closed for it.
        let r = reqwest::get(format!("http://{addr}/healthz")).await.unwrap();
        assert_eq!(r.status(), reqwest::StatusCode::OK);
        let t = tokio::time::Instant::now();
        assert!(closed_by_server(&mut stuck[0]).await, "the oldest connection is still open");
        // The other one is closed at its age.
        assert!(closed_by_server(&mut stuck[1]).await, "a connection that reads nothing is still open past its age");
        assert!(t.elapsed() < std::time::Duration::from_secs(10));
        let r = reqwest::get(format!("http://{addr}/healthz")).await.unwrap();
        assert_eq!(r.status(), reqwest::StatusCode::OK);
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}
