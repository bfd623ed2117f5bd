//! The LLM client: runs one batch against one OpenAI-compatible server (vLLM, SGLang, llama.cpp's
//! llama-server, TensorRT-LLM, …).
//!
//! A batch is split into *call groups* of identical (kind, model, params):
//!
//! - a completions group becomes ONE `POST {base}/v1/completions` whose `prompt` is the list of the
//!   group's prompts (OpenAI completions API: `prompt` may be a list of strings). The answer is
//!   demultiplexed by `choices[].index`. Two response shapes are understood: the OpenAI one (one
//!   object, one choice per prompt, `index` = prompt position; vLLM, SGLang) and llama-server's
//!   (a JSON *array* of complete per-prompt completion objects, each with its own `usage` and
//!   `timings`, when the list has more than one prompt);
//! - a chat group becomes one `POST {base}/v1/chat/completions` per item, run concurrently (the chat
//!   API has no list form).
//!
//! Every HTTP call holds one permit of the endpoint's semaphore (`llm.max_concurrency`), is
//! classified once by [`classify`] into an [`ErrorKind`], counted in `metrics::llm_call` per attempt,
//! and retried with exponential backoff and full jitter while the kind is
//! [retryable](ErrorKind::retryable) and attempts remain. The cancellation token aborts in-flight
//! calls (dropping the request closes the connection) and ends the batch with
//! [`ErrorKind::Cancelled`] for every unfinished item.
//!
//! Logs name endpoints by index and by a credential-free URL, never by the configured URL, and the
//! bearer token only travels in a header marked sensitive.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use serde_json::{Map, Value};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use url::Url;

use crate::config::LlmSettings;
use crate::metrics;
use crate::request::{Body, Usage};

/// Path of the OpenAI completions API, appended to each endpoint's base URL.
pub const COMPLETIONS_PATH: &str = "v1/completions";
/// Path of the OpenAI chat completions API, appended to each endpoint's base URL.
pub const CHAT_COMPLETIONS_PATH: &str = "v1/chat/completions";
/// How much of an error response body goes into [`LlmError::message`], in characters.
const ERROR_BODY_PREVIEW_CHARS: usize = 300;

/// A client for a fixed set of OpenAI-compatible endpoints. Cheap to clone (an `Arc` inside);
/// clones share the HTTP connection pool and the per-endpoint concurrency limits.
#[derive(Clone)]
pub struct LlmClient {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    endpoints: Vec<Endpoint>,
    /// `llm.model`: sent when an item names no model.
    model: String,
    max_attempts: u32,
    backoff_initial: Duration,
    backoff_max: Duration,
}

struct Endpoint {
    /// The base URL without userinfo, query or fragment: the HRW member name and the only form that
    /// is ever logged, so rotating a password in the URL moves no partition and leaks nothing.
    name: String,
    completions: Url,
    chat: Url,
    /// `llm.max_concurrency` permits; one HTTP call (not one item) holds one permit.
    permits: Semaphore,
}

impl fmt::Debug for LlmClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.inner.endpoints.iter().map(|e| e.name.as_str()).collect();
        f.debug_struct("LlmClient")
            .field("endpoints", &names)
            .field("model", &self.inner.model)
            .field("max_attempts", &self.inner.max_attempts)
            .finish_non_exhaustive()
    }
}

/// One request of a batch, borrowed from the batcher's buffer.
#[derive(Debug, Clone, Copy)]
pub struct InferenceItem<'a> {
    /// The prompt: completions (`prompt`) or chat (`messages`).
    pub body: &'a Body,
    /// Overrides `llm.model` for this item.
    pub model: Option<&'a str>,
    /// OpenAI sampling params, merged into the top level of the request body untouched (unknown
    /// ones such as llama.cpp's `cache_prompt` included). `model`, `prompt` and `messages` are
    /// always ours; a `stream: true` is turned into `false` (and `stream_options` dropped) because
    /// the batcher needs one whole answer per call.
    pub params: &'a Map<String, Value>,
}

/// The successful result of one item.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Completions: the generated text as a JSON string (`choices[i].text`). Chat: the assistant
    /// message object exactly as the server returned it (`choices[0].message`, with `role`,
    /// `content` and possibly `tool_calls`). With `n` > 1 in params, the first choice of the prompt.
    pub output: Value,
    /// `finish_reason` of the choice (`"stop"`, `"length"`, …) when the server sent one.
    pub finish_reason: Option<String>,
    /// This item's own token counts, or `None` when the server only reported usage for a whole
    /// list-prompt call (vLLM, SGLang): whole-call usage is never apportioned between items. Taken
    /// from `usage` (`prompt_tokens`, `completion_tokens`, and vLLM/SGLang/llama-server's
    /// `usage.prompt_tokens_details.cached_tokens`), else derived from llama-server's `timings`
    /// (`prompt_tokens = prompt_n + cache_n`, `cached_tokens = cache_n`).
    pub usage: Option<Usage>,
    /// The `model` the server says it used.
    pub model: Option<String>,
    /// HTTP attempts used by the call that served this item, 1 ..= `llm.max_attempts`.
    pub attempts: u32,
}

/// Why an item failed. The same error is given to every item of the failed HTTP call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct LlmError {
    /// The class, decided once by [`classify`]; drives retries and the metric label.
    pub kind: ErrorKind,
    /// Human-readable detail (for an HTTP error: the status and the start of the body). Never
    /// contains the endpoint URL or the token.
    pub message: String,
    /// The HTTP status, when the server answered.
    pub status: Option<u16>,
}

impl LlmError {
    fn new(kind: ErrorKind, message: impl Into<String>, status: Option<u16>) -> Self {
        LlmError { kind, message: message.into(), status }
    }

    fn cancelled() -> Self {
        LlmError::new(ErrorKind::Cancelled, "the batch was cancelled (lease lost or shutdown)", None)
    }

    fn invalid(message: impl Into<String>) -> Self {
        LlmError::new(ErrorKind::InvalidResponse, message, None)
    }
}

/// The closed set of failure classes. [`ErrorKind::as_str`] is the `kind` of the result's `error`
/// object and the `outcome` label of `prefix_batcher_llm_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// `llm.connect_timeout` or `llm.request_timeout` elapsed, or the server answered 408.
    Timeout,
    /// The connection could not be made or broke mid-call.
    Connect,
    /// HTTP 429; `Retry-After` (seconds) is honoured, capped at `llm.backoff_max`.
    RateLimited,
    /// HTTP 5xx.
    Server,
    /// Any other non-success HTTP status (4xx other than 408/429, unfollowed 3xx), or a request
    /// that could not be built (including an invalid configuration at [`LlmClient::new`]).
    Rejected,
    /// A 2xx whose body is not JSON or not the expected shape, or a list-prompt answer that has no
    /// choice for this item.
    InvalidResponse,
    /// The batch's cancellation token fired before the item finished.
    Cancelled,
}

impl ErrorKind {
    /// Every kind, for metric initialisation and docs.
    pub const ALL: [ErrorKind; 7] = [
        ErrorKind::Timeout,
        ErrorKind::Connect,
        ErrorKind::RateLimited,
        ErrorKind::Server,
        ErrorKind::Rejected,
        ErrorKind::InvalidResponse,
        ErrorKind::Cancelled,
    ];

    /// The stable machine-readable name: `timeout`, `connect`, `rate_limited`, `server`,
    /// `rejected`, `invalid_response`, `cancelled`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ErrorKind::Timeout => "timeout",
            ErrorKind::Connect => "connect",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::Server => "server",
            ErrorKind::Rejected => "rejected",
            ErrorKind::InvalidResponse => "invalid_response",
            ErrorKind::Cancelled => "cancelled",
        }
    }

    /// Whether another attempt may succeed: everything but [`ErrorKind::Rejected`] (the server
    /// will refuse the same request again) and [`ErrorKind::Cancelled`].
    pub fn retryable(&self) -> bool {
        !matches!(self, ErrorKind::Rejected | ErrorKind::Cancelled)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failure to classify; see [`classify`].
#[derive(Debug, Clone, Copy)]
pub enum Problem<'a> {
    /// The HTTP exchange itself failed (connect, timeout, broken connection, body read).
    Transport(&'a reqwest::Error),
    /// The server answered with this non-2xx status.
    Status(u16),
    /// A 2xx answer whose body is not JSON or lacks the fields the OpenAI API promises.
    InvalidBody,
}

/// The one place that maps a failure to an [`ErrorKind`]; retry policy and metric labels use its
/// answer, never message text.
///
/// Statuses: 408 → `Timeout`, 429 → `RateLimited`, 5xx → `Server`, any other → `Rejected`
/// (redirects are not followed: a POST to a moved API is a configuration error). Transport errors:
/// timeouts → `Timeout`, decode errors → `InvalidResponse`, builder errors → `Rejected`, anything
/// else (refused, reset, broken body) → `Connect`.
pub fn classify(problem: Problem<'_>) -> ErrorKind {
    match problem {
        Problem::Status(408) => ErrorKind::Timeout,
        Problem::Status(429) => ErrorKind::RateLimited,
        Problem::Status(s) if (500..600).contains(&s) => ErrorKind::Server,
        Problem::Status(_) => ErrorKind::Rejected,
        Problem::InvalidBody => ErrorKind::InvalidResponse,
        Problem::Transport(e) if e.is_timeout() => ErrorKind::Timeout,
        Problem::Transport(e) if e.is_decode() => ErrorKind::InvalidResponse,
        Problem::Transport(e) if e.is_builder() => ErrorKind::Rejected,
        Problem::Transport(_) => ErrorKind::Connect,
    }
}

impl LlmClient {
    /// Builds the client: one HTTP connection pool with `llm.connect_timeout` and
    /// `llm.request_timeout` (whole call, body included), a default `Authorization: Bearer …`
    /// header (marked sensitive) when `llm.api_key` is set, and one semaphore of
    /// `llm.max_concurrency` permits per endpoint.
    ///
    /// Errors (kind [`ErrorKind::Rejected`]): no endpoints, an endpoint that is not plain `http`
    /// (this build has no TLS), a token that is not a valid header value, or an HTTP client that
    /// cannot be built.
    pub fn new(settings: &LlmSettings) -> Result<Self, LlmError> {
        let config_error = |m: String| LlmError::new(ErrorKind::Rejected, m, None);
        if settings.endpoints.is_empty() {
            return Err(config_error("llm.endpoints is empty".into()));
        }
        let mut endpoints = Vec::with_capacity(settings.endpoints.len());
        for (i, base) in settings.endpoints.iter().enumerate() {
            let name = public_name(base);
            if base.scheme() != "http" {
                return Err(config_error(format!(
                    "llm.endpoints[{i}] = {name}: only http:// is supported (this build has no TLS)"
                )));
            }
            let join = |path: &str| {
                let mut dir = base.clone();
                if !dir.path().ends_with('/') {
                    let p = format!("{}/", dir.path());
                    dir.set_path(&p);
                }
                dir.join(path)
                    .map_err(|e| config_error(format!("llm.endpoints[{i}] = {name}: cannot append {path}: {e}")))
            };
            endpoints.push(Endpoint {
                completions: join(COMPLETIONS_PATH)?,
                chat: join(CHAT_COMPLETIONS_PATH)?,
                name,
                permits: Semaphore::new(settings.max_concurrency.get()),
            });
        }
        let mut headers = HeaderMap::new();
        if let Some(key) = &settings.api_key {
            let mut value = HeaderValue::from_str(&format!("Bearer {}", key.expose()))
                .map_err(|_| config_error("llm.api_key is not a valid HTTP header value".into()))?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .connect_timeout(settings.connect_timeout)
            .timeout(settings.request_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| config_error(format!("cannot build the HTTP client: {}", e.without_url())))?;
        Ok(LlmClient {
            inner: Arc::new(Inner {
                http,
                endpoints,
                model: settings.model.clone(),
                max_attempts: settings.max_attempts.get(),
                backoff_initial: settings.backoff_initial,
                backoff_max: settings.backoff_max,
            }),
        })
    }

    /// Number of configured endpoints (≥ 1).
    pub fn endpoint_count(&self) -> usize {
        self.inner.endpoints.len()
    }

    /// The credential-free base URL of endpoint `index`, for logs and status output.
    pub fn endpoint_name(&self, index: usize) -> Option<&str> {
        self.inner.endpoints.get(index).map(|e| e.name.as_str())
    }

    /// The endpoint serving a partition: rendezvous (HRW) hashing of the partition number over the
    /// endpoints' credential-free base URLs ([`crate::keying::hrw_pick`]), so a prefix sticks to one
    /// server's cache, and adding or removing a server moves only ~1/N of the partitions.
    pub fn endpoint_for(&self, partition: u32) -> usize {
        let names: Vec<&str> = self.inner.endpoints.iter().map(|e| e.name.as_str()).collect();
        crate::keying::hrw_pick(u64::from(partition), &names).unwrap_or(0)
    }

    /// Runs one batch on endpoint `endpoint` (an index below [`Self::endpoint_count`]).
    ///
    /// Returns exactly one result per item, in item order; never panics and never drops an item.
    /// Every item of a failed HTTP call gets that call's last error (after up to `llm.max_attempts`
    /// attempts); an item whose choice is missing from an otherwise good list-prompt answer gets
    /// [`ErrorKind::InvalidResponse`]; when `cancel` fires, in-flight calls are aborted and every
    /// unfinished item gets [`ErrorKind::Cancelled`] at once. An out-of-range endpoint index fails
    /// every item with [`ErrorKind::Rejected`].
    pub async fn infer(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        cancel: &CancellationToken,
    ) -> Vec<Result<Completion, LlmError>> {
        if endpoint >= self.inner.endpoints.len() {
            let e = LlmError::new(ErrorKind::Rejected, format!("no LLM endpoint with index {endpoint}"), None);
            return items.iter().map(|_| Err(e.clone())).collect();
        }
        let mut calls = Vec::new();
        for group in group_items(items, &self.inner.model) {
            match group.kind {
                CallKind::Completions => calls.push(self.run_call(endpoint, items, group, cancel)),
                CallKind::Chat => {
                    for &member in &group.members {
                        let single = Group { members: vec![member], ..group.clone() };
                        calls.push(self.run_call(endpoint, items, single, cancel));
                    }
                }
            }
        }
        let mut out: Vec<Option<Result<Completion, LlmError>>> = items.iter().map(|_| None).collect();
        for (i, result) in futures_util::future::join_all(calls).await.into_iter().flatten() {
            out[i] = Some(result);
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(LlmError::invalid("internal: no result was produced for this item"))))
            .collect()
    }

    /// One HTTP call (with retries) for `group`; returns `(item index, result)` for every member.
    async fn run_call(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        group: Group<'_>,
        cancel: &CancellationToken,
    ) -> Vec<(usize, Result<Completion, LlmError>)> {
        let ep = &self.inner.endpoints[endpoint];
        let mut body = group.params.clone();
        if body.contains_key("stream") {
            body.insert("stream".into(), Value::Bool(false));
            body.remove("stream_options");
        }
        body.insert("model".into(), Value::String(group.model.to_owned()));
        let n_members = group.members.len();
        let (url, choices_per_prompt) = match group.kind {
            CallKind::Completions => {
                let prompts = group
                    .members
                    .iter()
                    .map(|&i| match items[i].body {
                        Body::Completion(p) => Value::String(p.clone()),
                        Body::Chat(_) => Value::Null, // unreachable: grouped by kind
                    })
                    .collect();
                body.insert("prompt".into(), Value::Array(prompts));
                let n = group.params.get("n").and_then(Value::as_u64).filter(|&n| n >= 1).unwrap_or(1);
                (&ep.completions, n)
            }
            CallKind::Chat => {
                let messages = match items[group.members[0]].body {
                    Body::Chat(m) => m.iter().map(|m| m.raw.clone()).collect(),
                    Body::Completion(_) => Vec::new(), // unreachable: grouped by kind
                };
                body.insert("messages".into(), Value::Array(messages));
                (&ep.chat, 1)
            }
        };
        let payload = match serde_json::to_vec(&body) {
            Ok(p) => p,
            Err(e) => {
                let e = LlmError::new(ErrorKind::Rejected, format!("cannot serialise the request: {e}"), None);
                return group.members.iter().map(|&i| (i, Err(e.clone()))).collect();
            }
        };
        let kind = group.kind;
        let parse = move |v: Value| match kind {
            CallKind::Completions => demux_completions(v, n_members, choices_per_prompt),
            CallKind::Chat => parse_chat(v),
        };
        let (result, attempts) = self.send_with_retries(endpoint, url, payload, n_members, cancel, parse).await;
        match result {
            Ok(parsed) => {
                metrics::llm_tokens(parsed.prompt_tokens, parsed.cached_tokens);
                group
                    .members
                    .iter()
                    .zip(parsed.items)
                    .map(|(&i, r)| {
                        (
                            i,
                            r.map(|mut c| {
                                c.attempts = attempts;
                                c
                            }),
                        )
                    })
                    .collect()
            }
            Err(e) => group.members.iter().map(|&i| (i, Err(e.clone()))).collect(),
        }
    }

    /// Sends `payload` to `url` until it succeeds, fails for good, attempts run out or `cancel`
    /// fires. Returns the parsed answer or the last error, and the number of attempts made.
    async fn send_with_retries(
        &self,
        endpoint: usize,
        url: &Url,
        payload: Vec<u8>,
        n_items: usize,
        cancel: &CancellationToken,
        parse: impl Fn(Value) -> Result<Parsed, LlmError>,
    ) -> (Result<Parsed, LlmError>, u32) {
        let ep = &self.inner.endpoints[endpoint];
        let mut attempt = 0u32;
        loop {
            let permit = tokio::select! {
                biased;
                _ = cancel.cancelled() => return (Err(LlmError::cancelled()), attempt),
                p = ep.permits.acquire() => p,
            };
            attempt += 1;
            let started = Instant::now();
            let outcome = tokio::select! {
                biased;
                _ = cancel.cancelled() => None,
                r = self.attempt(url, payload.clone(), &parse) => Some(r),
            };
            drop(permit);
            let seconds = started.elapsed().as_secs_f64();
            let (error, retry_after) = match outcome {
                None => {
                    metrics::llm_call(ErrorKind::Cancelled.as_str(), seconds);
                    tracing::debug!(endpoint, attempt, "LLM call cancelled");
                    return (Err(LlmError::cancelled()), attempt);
                }
                Some(Ok(parsed)) => {
                    metrics::llm_call("ok", seconds);
                    tracing::debug!(endpoint, attempt, items = n_items, seconds, "LLM call succeeded");
                    return (Ok(parsed), attempt);
                }
                Some(Err(failure)) => failure,
            };
            metrics::llm_call(error.kind.as_str(), seconds);
            if !error.kind.retryable() || attempt >= self.inner.max_attempts {
                tracing::warn!(
                    endpoint,
                    attempt,
                    items = n_items,
                    kind = error.kind.as_str(),
                    status = error.status,
                    error = %error.message,
                    "LLM call failed; failing its items"
                );
                return (Err(error), attempt);
            }
            let delay = backoff_delay(attempt, retry_after, self.inner.backoff_initial, self.inner.backoff_max);
            tracing::warn!(
                endpoint,
                attempt,
                items = n_items,
                kind = error.kind.as_str(),
                status = error.status,
                delay_ms = delay.as_millis() as u64,
                error = %error.message,
                "LLM call failed; retrying"
            );
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return (Err(LlmError::cancelled()), attempt),
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// One HTTP attempt. On failure also returns the server's `Retry-After`, if any.
    async fn attempt(
        &self,
        url: &Url,
        payload: Vec<u8>,
        parse: &impl Fn(Value) -> Result<Parsed, LlmError>,
    ) -> Result<Parsed, (LlmError, Option<Duration>)> {
        let transport = |e: reqwest::Error| {
            let kind = classify(Problem::Transport(&e));
            (LlmError::new(kind, transport_message(e), None), None)
        };
        let response = self
            .inner
            .http
            .post(url.clone())
            .header(CONTENT_TYPE, "application/json")
            .body(payload)
            .send()
            .await
            .map_err(transport)?;
        let status = response.status();
        let retry_after = parse_retry_after(response.headers());
        let bytes = response.bytes().await.map_err(transport)?;
        if !status.is_success() {
            let kind = classify(Problem::Status(status.as_u16()));
            let message = format!("HTTP {status}: {}", preview(&bytes));
            return Err((LlmError::new(kind, message, Some(status.as_u16())), retry_after));
        }
        let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
            let kind = classify(Problem::InvalidBody);
            (LlmError::new(kind, format!("response is not JSON ({e}): {}", preview(&bytes)), Some(status.as_u16())), None)
        })?;
        parse(value).map_err(|mut e| {
            e.status = Some(status.as_u16());
            (e, None)
        })
    }
}

/// The URL with userinfo, query and fragment removed: safe to log and stable across credential
/// rotation.
fn public_name(url: &Url) -> String {
    let mut u = url.clone();
    // These only fail for cannot-be-a-base URLs, which have no userinfo anyway.
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.set_query(None);
    u.set_fragment(None);
    u.as_str().trim_end_matches('/').to_owned()
}

/// A reqwest error's message and causes, without the URL (which may carry credentials).
fn transport_message(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}

/// The first [`ERROR_BODY_PREVIEW_CHARS`] characters of a response body, lossily decoded.
fn preview(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out: String = text.chars().take(ERROR_BODY_PREVIEW_CHARS).collect();
    if out.len() < text.len() {
        out.push('…');
    }
    out
}

/// `Retry-After` in its delay-seconds form (RFC 9110 §10.2.3). The HTTP-date form is ignored
/// (the normal backoff applies): LLM servers and gateways send seconds.
fn parse_retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    text.parse::<u64>().ok().map(Duration::from_secs)
}

/// The wait before attempt `failed_attempt + 1`.
///
/// The server's `Retry-After` wins, capped at `max`. Otherwise exponential backoff with full jitter
/// (AWS Architecture Blog, "Exponential Backoff And Jitter"): uniform in
/// `[0, min(max, initial × 2^(failed_attempt − 1))]`.
fn backoff_delay(failed_attempt: u32, retry_after: Option<Duration>, initial: Duration, max: Duration) -> Duration {
    if let Some(wait) = retry_after {
        return wait.min(max);
    }
    let factor = 2u32.saturating_pow(failed_attempt.saturating_sub(1));
    let cap = initial.saturating_mul(factor).min(max);
    let cap_nanos = u64::try_from(cap.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(fastrand::u64(0..=cap_nanos))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallKind {
    Completions,
    Chat,
}

/// Items that can share one request body: same kind, model and params.
#[derive(Debug, Clone)]
struct Group<'a> {
    kind: CallKind,
    model: &'a str,
    params: &'a Map<String, Value>,
    /// Item indices, in item order.
    members: Vec<usize>,
}

/// Splits a batch into groups of identical (kind, model, params), keeping item order within each
/// group and ordering groups by their first item. Linear search: a batch has few distinct groups.
fn group_items<'a>(items: &[InferenceItem<'a>], default_model: &'a str) -> Vec<Group<'a>> {
    let mut groups: Vec<Group<'a>> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let kind = match item.body {
            Body::Completion(_) => CallKind::Completions,
            Body::Chat(_) => CallKind::Chat,
        };
        let model = item.model.unwrap_or(default_model);
        match groups.iter_mut().find(|g| g.kind == kind && g.model == model && g.params == item.params) {
            Some(g) => g.members.push(i),
            None => groups.push(Group { kind, model, params: item.params, members: vec![i] }),
        }
    }
    groups
}

/// A successfully parsed answer: one result per member, and the call's token totals for metrics.
#[derive(Debug)]
struct Parsed {
    items: Vec<Result<Completion, LlmError>>,
    /// Sum of `usage.prompt_tokens` over the answer (0 when not reported).
    prompt_tokens: u64,
    /// Sum of `usage.prompt_tokens_details.cached_tokens` (or `timings.cache_n`) over the answer.
    cached_tokens: u64,
}

/// Reads token counts from an OpenAI `usage` object, falling back to llama-server's `timings`
/// (`prompt_n` = prompt tokens evaluated, `cache_n` = prompt tokens reused from the cache,
/// `predicted_n` = generated tokens).
fn parse_usage(usage: Option<&Value>, timings: Option<&Value>) -> Option<Usage> {
    let num = |v: Option<&Value>, field: &str| v.and_then(|v| v.get(field)).and_then(Value::as_u64);
    let cache_n = num(timings, "cache_n");
    if let Some(prompt_tokens) = num(usage, "prompt_tokens") {
        let cached = usage
            .and_then(|u| u.get("prompt_tokens_details"))
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .or(cache_n);
        return Some(Usage {
            prompt_tokens,
            completion_tokens: num(usage, "completion_tokens").unwrap_or(0),
            cached_tokens: cached,
        });
    }
    let prompt_n = num(timings, "prompt_n")?;
    Some(Usage {
        prompt_tokens: prompt_n + cache_n.unwrap_or(0),
        completion_tokens: num(timings, "predicted_n").unwrap_or(0),
        cached_tokens: cache_n,
    })
}

fn usage_of(obj: &Value) -> Option<Usage> {
    parse_usage(obj.get("usage"), obj.get("timings"))
}

/// Demultiplexes a list-prompt completions answer into one result per prompt.
///
/// `choices_per_prompt` is the request's `n`: the OpenAI API numbers choices
/// `prompt_index × n + j`, so the item of a choice is `index / n` and its first choice is kept.
/// Accepts one OpenAI object or llama-server's array of per-prompt objects; for the array, the
/// choices' own `index` values are used when they are distinct and in range, else array positions.
fn demux_completions(v: Value, n_items: usize, choices_per_prompt: u64) -> Result<Parsed, LlmError> {
    let (objects, is_array) = match v {
        Value::Array(a) => (a, true),
        obj @ Value::Object(_) => (vec![obj], false),
        other => return Err(LlmError::invalid(format!("expected a JSON object or array, got {}", short(&other)))),
    };
    // (object position, choice position in the object, the choice)
    let mut flat: Vec<(usize, usize, &Value)> = Vec::new();
    for (o, obj) in objects.iter().enumerate() {
        match obj.get("choices") {
            Some(Value::Array(choices)) => flat.extend(choices.iter().enumerate().map(|(c, ch)| (o, c, ch))),
            _ if is_array => {} // this prompt's choice is missing; reported per item below
            _ => return Err(LlmError::invalid(format!("response has no `choices` list: {}", short(obj)))),
        }
    }
    let limit = n_items as u64 * choices_per_prompt;
    let declared: Vec<Option<u64>> = flat.iter().map(|(_, _, ch)| ch.get("index").and_then(Value::as_u64)).collect();
    let declared_ok = declared.iter().all(|d| d.is_some_and(|d| d < limit)) && {
        let mut seen: Vec<u64> = declared.iter().flatten().copied().collect();
        seen.sort_unstable();
        seen.windows(2).all(|w| w[0] != w[1])
    };
    let mut indexed: Vec<(u64, usize, &Value)> = flat
        .iter()
        .zip(&declared)
        .enumerate()
        .map(|(pos, (&(o, c, ch), d))| {
            let index = match (declared_ok, is_array) {
                (true, _) => d.unwrap_or_default(),
                (false, true) => o as u64 * choices_per_prompt + c as u64,
                (false, false) => pos as u64,
            };
            (index, o, ch)
        })
        .collect();
    indexed.sort_by_key(|&(index, _, _)| index);

    let mut out: Vec<Option<Result<Completion, LlmError>>> = (0..n_items).map(|_| None).collect();
    // Which items each object's choices served, to decide whether the object's usage is one item's.
    let mut items_of_object: Vec<Vec<usize>> = vec![Vec::new(); objects.len()];
    for (index, o, choice) in indexed {
        let item = (index / choices_per_prompt) as usize;
        if item >= n_items || out[item].is_some() {
            continue;
        }
        items_of_object[o].push(item);
        let obj = &objects[o];
        out[item] = Some(match choice.get("text") {
            Some(text @ Value::String(_)) => Ok(Completion {
                output: text.clone(),
                finish_reason: choice.get("finish_reason").and_then(Value::as_str).map(str::to_owned),
                usage: usage_of(choice),
                model: obj.get("model").and_then(Value::as_str).map(str::to_owned),
                attempts: 0,
            }),
            _ => Err(LlmError::invalid(format!("choice {index} has no string `text`"))),
        });
    }
    // An object's usage is an item's own when that object served exactly that one item: each
    // element of llama-server's array, or the whole answer of a one-prompt call.
    let (mut prompt_tokens, mut cached_tokens) = (0u64, 0u64);
    for (o, obj) in objects.iter().enumerate() {
        let usage = usage_of(obj);
        match &usage {
            Some(u) => {
                prompt_tokens += u.prompt_tokens;
                cached_tokens += u.cached_tokens.unwrap_or(0);
            }
            None => {
                // No whole-object usage: count what per-choice usage there is.
                for ch in obj.get("choices").and_then(Value::as_array).into_iter().flatten() {
                    if let Some(u) = usage_of(ch) {
                        prompt_tokens += u.prompt_tokens;
                        cached_tokens += u.cached_tokens.unwrap_or(0);
                    }
                }
            }
        }
        let served = &items_of_object[o];
        if served.len() == 1 && (is_array || n_items == 1) {
            if let Some(Some(Ok(c))) = out.get_mut(served[0]) {
                if c.usage.is_none() {
                    c.usage = usage;
                }
            }
        }
    }
    let items = out
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|| Err(LlmError::invalid(format!("the answer has no choice for prompt {i}")))))
        .collect();
    Ok(Parsed { items, prompt_tokens, cached_tokens })
}

/// Parses a chat completions answer: output is `choices[0].message`.
fn parse_chat(v: Value) -> Result<Parsed, LlmError> {
    let choice = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or_else(|| LlmError::invalid(format!("response has no `choices[0]`: {}", short(&v))))?;
    let message = match choice.get("message") {
        Some(m @ Value::Object(_)) => m.clone(),
        _ => return Err(LlmError::invalid("`choices[0].message` is missing or not an object")),
    };
    let usage = usage_of(&v);
    let (prompt_tokens, cached_tokens) =
        usage.as_ref().map(|u| (u.prompt_tokens, u.cached_tokens.unwrap_or(0))).unwrap_or_default();
    let completion = Completion {
        output: message,
        finish_reason: choice.get("finish_reason").and_then(Value::as_str).map(str::to_owned),
        usage,
        model: v.get("model").and_then(Value::as_str).map(str::to_owned),
        attempts: 0,
    };
    Ok(Parsed { items: vec![Ok(completion)], prompt_tokens, cached_tokens })
}

/// A JSON value cut to 200 characters for error messages.
fn short(v: &Value) -> String {
    preview(v.to_string().as_bytes()).chars().take(200).collect()
}
