//! The HTTP endpoints: `/metrics` (Prometheus text format), `/healthz` (liveness: the process
//! serves requests) and `/readyz` (readiness: connected to RabbitMQ and Redis, first lease round
//! done; 503 otherwise).

use std::future::Future;

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics;

/// Content type of the Prometheus text exposition format 0.0.4.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The router with all endpoints.
pub fn router() -> Router {
    Router::new()
        .route("/metrics", get(|| async { ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], metrics::render()) }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|| async {
                if metrics::is_ready() {
                    (StatusCode::OK, "ready\n").into_response()
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
                }
            }),
        )
}

/// Serves on `listener` until `shutdown` completes.
pub async fn serve(listener: tokio::net::TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    axum::serve(listener, router()).with_graceful_shutdown(shutdown).await
}
