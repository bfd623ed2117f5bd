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

/// Serves on `listener` until `shutdown` completes, then waits at most `grace` for the
/// connections in progress to finish ([`SHUTDOWN_GRACE`] in the daemon) and drops the rest.
/// axum's graceful shutdown waits for every open connection, and one whose request never
/// completes (a client that sent half a request and stalled, a scanner) would keep the process
/// from exiting after its drain: axum serves without hyper's header-read timeout.
pub async fn serve(
    listener: tokio::net::TcpListener,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: std::time::Duration,
) -> std::io::Result<()> {
    let (fired, told) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = fired.send(());
    };
    let server = std::future::IntoFuture::into_future(axum::serve(listener, router(readiness)).with_graceful_shutdown(signal));
    tokio::pin!(server);
    tokio::select! {
        ended = &mut server => return ended,
        Ok(()) = told => {}
    }
    match tokio::time::timeout(grace, server).await {
        Ok(ended) => ended,
        Err(_) => {
            tracing::info!(grace = ?grace, "HTTP connections still open after the shutdown grace time; closing them");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readiness::NotReady;

    #[tokio::test]
    async fn readyz_answers_from_the_readiness_state_and_names_the_reasons() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/readyz", listener.local_addr().unwrap());
        let readiness = Readiness::new();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, readiness.clone(), async move {
            let _ = stopped.await;
        }, SHUTDOWN_GRACE));
        crate::tls::install_crypto_provider();
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
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let grace = std::time::Duration::from_millis(300);
        let server = tokio::spawn(serve(listener, Readiness::new(), async move {
            let _ = stopped.await;
        }, grace));
        let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        // The server has taken the connection once it answers another one.
        crate::tls::install_crypto_provider();
        let r = reqwest::get(format!("http://{addr}/healthz")).await.unwrap();
        assert_eq!(r.status(), reqwest::StatusCode::OK);
        stop.send(()).unwrap();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(30), server).await;
        assert!(ended.is_ok(), "the server still waits for the half-sent request");
        drop(half);
    }
}
