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

/// Serves on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(readiness)).with_graceful_shutdown(shutdown).await
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
        }));
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
}
