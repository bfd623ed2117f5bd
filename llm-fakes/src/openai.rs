//! The OpenAI-compatible HTTP surface both servers share: routes, request parsing (completion
//! prompts, chat messages), answer objects with OpenAI `usage` (plus vLLM's
//! `prompt_tokens_details.cached_tokens`), errors, `/v1/models` and the Prometheus text of
//! vLLM's prefix cache counters.
//!
//! Shapes follow the OpenAI API reference (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`) as vLLM serves it; metric names and help texts are vLLM's.

// The handlers return an axum `Response` as their error, as axum does: it is sent as is.
#![allow(clippy::result_large_err)]

use std::fmt::Display;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, MethodRouter};
use axum::{Json, Router};
use serde_json::{json, Map, Value};

/// The routes of an OpenAI-compatible server: `POST /v1/completions`, `POST /v1/chat/completions`,
/// `GET /v1/models`, `GET /metrics`, and `GET /health` (always 200).
pub fn routes<S: Clone + Send + Sync + 'static>(
    completions: MethodRouter<S>,
    chat_completions: MethodRouter<S>,
    models: MethodRouter<S>,
    metrics: MethodRouter<S>,
) -> Router<S> {
    Router::new()
        .route("/v1/completions", completions)
        .route("/v1/chat/completions", chat_completions)
        .route("/v1/models", models)
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", metrics)
}

/// Tokens of a text in the character approximation: `max(1, ceil(chars / chars_per_token))`,
/// characters being Unicode scalar values (`chars_per_token` 0 counts as 1).
pub fn tokens(text: &str, chars_per_token: usize) -> u64 {
    (text.chars().count() as u64).div_ceil(chars_per_token.max(1) as u64).max(1)
}

/// Seconds since the Unix epoch (the `created` field); 0 if the clock is before it.
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// An OpenAI-style error answer: HTTP `status` (500 if not a valid status code) with body
/// `{"error": {"message", "type", "code": status}}`, `type` being `server_error` for 5xx and
/// `invalid_request_error` otherwise; plus `Retry-After: secs` when given.
pub fn error_response(status: u16, message: &str, retry_after: Option<u64>) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let kind = if code.is_server_error() { "server_error" } else { "invalid_request_error" };
    let body = Json(json!({"error": {"message": message, "type": kind, "code": status}}));
    let mut response = (code, body).into_response();
    if let Some(secs) = retry_after {
        response.headers_mut().insert(header::RETRY_AFTER, secs.into());
    }
    response
}

fn request_object(body: &[u8]) -> Result<Map<String, Value>, Response> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(error_response(400, "body must be a JSON object", None)),
    }
}

/// A `/v1/completions` body: its prompts in request order (`prompt` is a string or a non-empty
/// list of strings) and every other field (`model`, sampling params, …).
///
/// # Errors
/// A finished HTTP 400 answer when the body is not a JSON object or `prompt` is anything else
/// (token-id prompts included).
pub fn completion_request(body: &[u8]) -> Result<(Vec<String>, Map<String, Value>), Response> {
    let mut req = request_object(body)?;
    let prompts = match req.remove("prompt") {
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(list)) if !list.is_empty() && list.iter().all(Value::is_string) => {
            list.into_iter().filter_map(|v| v.as_str().map(str::to_owned)).collect()
        }
        _ => return Err(error_response(400, "`prompt` must be a string or a non-empty list of strings", None)),
    };
    Ok((prompts, req))
}

/// A `/v1/chat/completions` body: its `messages` and every other field.
///
/// # Errors
/// A finished HTTP 400 answer when the body is not a JSON object or `messages` is not a
/// non-empty list.
pub fn chat_request(body: &[u8]) -> Result<(Vec<Value>, Map<String, Value>), Response> {
    let mut req = request_object(body)?;
    match req.remove("messages") {
        Some(Value::Array(m)) if !m.is_empty() => Ok((m, req)),
        _ => Err(error_response(400, "`messages` must be a non-empty list", None)),
    }
}

/// Text of a chat message's `content`: a string, or the `text` parts joined.
pub fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect(),
        _ => String::new(),
    }
}

/// A conversation as one prompt text: `<|role|>\ncontent\n` per message (role `?` when missing).
pub fn render_chat(messages: &[Value]) -> String {
    let mut rendered = String::new();
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("?");
        rendered.push_str(&format!("<|{role}|>\n{}\n", content_text(m.get("content"))));
    }
    rendered
}

/// OpenAI `usage`; with `cached` it carries vLLM's `prompt_tokens_details.cached_tokens`, without
/// it no `prompt_tokens_details` at all (a server without prefix caching).
pub fn usage(prompt_tokens: u64, cached: Option<u64>, completion_tokens: u64) -> Value {
    let mut usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    if let Some(cached) = cached {
        usage["prompt_tokens_details"] = json!({ "cached_tokens": cached });
    }
    usage
}

/// One completions choice for prompt `index`, cut by length (`finish_reason: "length"`).
pub fn completion_choice(index: usize, text: String) -> Value {
    json!({"index": index, "text": text, "logprobs": null, "finish_reason": "length"})
}

/// A `text_completion` object (`created` in Unix seconds).
pub fn text_completion(id: String, created: u64, model: &str, choices: Vec<Value>, usage: Value) -> Value {
    json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    })
}

/// A `chat.completion` object with one assistant message cut by length.
pub fn chat_completion(id: String, model: &str, content: String, usage: Value) -> Value {
    json!({
        "id": id,
        "object": "chat.completion",
        "created": unix_now(),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}],
        "usage": usage,
    })
}

/// The `/v1/models` answer: one model `id`, owned by `owned_by`.
pub fn models(id: &str, owned_by: &str) -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": id, "object": "model", "created": 0, "owned_by": owned_by}]}))
}

/// Prometheus text exposition (format 0.0.4) of one metric with one series labelled
/// `model_name`, appended to `out`.
pub fn push_series(out: &mut String, name: &str, kind: &str, help: &str, model: &str, value: impl Display) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{model_name=\"{model}\"}} {value}\n"));
}

/// vLLM's prefix cache counters, in tokens: `vllm:prefix_cache_queries_total` (prompt tokens
/// looked up) and `vllm:prefix_cache_hits_total` (prompt tokens served from the cache).
pub fn push_prefix_cache_counters(out: &mut String, model: &str, queries: u64, hits: u64) {
    let queries_help = "Prefix cache queries, in terms of number of queried tokens.";
    push_series(out, "vllm:prefix_cache_queries_total", "counter", queries_help, model, queries);
    let hits_help = "Prefix cache hits, in terms of number of cached tokens.";
    push_series(out, "vllm:prefix_cache_hits_total", "counter", hits_help, model, hits);
}

/// A `/metrics` answer with Prometheus text `text`.
pub fn metrics_response(text: String) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}
