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
