//! The LLM client: runs one batch against one OpenAI-compatible server (vLLM, SGLang, llama.cpp's
//! llama-server, TensorRT-LLM, …).
//!
//! A batch is split into *call groups* of identical (kind, model, params):
//!
//! - a completions group becomes ONE `POST {base}/v1/completions` whose `prompt` is the list of the
//!   group's prompts (OpenAI completions API: `prompt` may be a list of strings). The answer is
//!   demultiplexed by `choices[].index`. Three response shapes are understood:
//!   - OpenAI's (vLLM, SGLang): one object, one choice per prompt, `index` = prompt position, and
//!     `usage` for the whole call;
//!   - current llama.cpp llama-server's: the same object, but its `usage` and `timings` are those
//!     of the *first* prompt only (the server merges its per-prompt answers into the first one).
//!     It is recognised by the top-level `timings` object that only llama.cpp sends. That usage
//!     goes to the first prompt's item, and since the other prompts' token counts are lost, the
//!     endpoint is switched to one call per prompt from then on (see [`LlmClient::infer`]);
//!   - older llama-server builds': a JSON *array* of complete per-prompt completion objects, each
//!     with its own `usage` and `timings`;
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
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// `llm.list_prompts`: a completions group goes as one list-prompt call (else one call per
    /// prompt, in order, under one permit).
    list_prompts: bool,
}

/// One group's calls, boxed so list, sequential and chat calls fit in one `join_all`.
type CallFuture<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Vec<(usize, Result<Completion, LlmError>)>> + Send + 'a>>;

struct Endpoint {
    /// The base URL without userinfo, query or fragment: the HRW member name and the only form that
    /// is ever logged, so rotating a password in the URL moves no partition and leaks nothing.
    name: String,
    completions: Url,
    chat: Url,
    /// `llm.max_concurrency` permits; one HTTP call (not one item) holds one permit.
    permits: Semaphore,
    /// Set once the endpoint answered a list prompt llama.cpp-style, with the usage of its first
    /// prompt only: completions groups then go as one call per prompt, so every item gets its own
    /// exact usage and the cached-token metrics stay true.
    per_prompt_calls: AtomicBool,
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
                per_prompt_calls: AtomicBool::new(false),
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
                list_prompts: settings.list_prompts,
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
    /// Completions items sharing (model, params) go as one list-prompt call, unless
    /// `llm.list_prompts = false` or the endpoint has shown llama-server's merged answer (usage of
    /// the first prompt only): then the group's prompts go one call each, back to back, under one
    /// permit. Chat items get one call each, run concurrently within `llm.max_concurrency`.
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
        let per_prompt = !self.inner.list_prompts || self.inner.endpoints[endpoint].per_prompt_calls.load(Ordering::Relaxed);
        let mut calls: Vec<CallFuture<'_>> = Vec::new();
        for group in group_items(items, &self.inner.model) {
            match group.kind {
                CallKind::Completions if !per_prompt => calls.push(Box::pin(self.run_call(endpoint, items, group, cancel, false))),
                CallKind::Completions => calls.push(Box::pin(self.run_sequential(endpoint, items, group, cancel))),
                CallKind::Chat => {
                    for &member in &group.members {
                        let single = Group { members: vec![member], ..group.clone() };
                        calls.push(Box::pin(self.run_call(endpoint, items, single, cancel, false)));
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

    /// A completions group as one call per prompt, in order, under ONE permit of the endpoint:
    /// the prompts of a batch reach the server back to back, so a server with per-slot caches
    /// (llama-server) serves them from the slot that holds their shared prefix instead of
    /// spreading them over cold slots or interleaving them with other batches.
    async fn run_sequential(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        group: Group<'_>,
        cancel: &CancellationToken,
    ) -> Vec<(usize, Result<Completion, LlmError>)> {
        let ep = &self.inner.endpoints[endpoint];
        let _permit = tokio::select! {
            biased;
            _ = cancel.cancelled() => return group.members.iter().map(|&i| (i, Err(LlmError::cancelled()))).collect(),
            p = ep.permits.acquire() => p,
        };
        let mut out = Vec::with_capacity(group.members.len());
        for &member in &group.members {
            let single = Group { members: vec![member], ..group.clone() };
            out.extend(self.run_call(endpoint, items, single, cancel, true).await);
        }
        out
    }

    /// One HTTP call (with retries) for `group`; returns `(item index, result)` for every member.
    /// `permit_held`: the caller already holds an endpoint permit for this call.
    async fn run_call(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        group: Group<'_>,
        cancel: &CancellationToken,
        permit_held: bool,
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
        let (result, attempts) = self.send_with_retries(endpoint, url, payload, n_members, cancel, parse, permit_held).await;
        match result {
            Ok(parsed) => {
                metrics::llm_tokens(parsed.prompt_tokens, parsed.cached_tokens);
                if parsed.first_prompt_usage_only && !ep.per_prompt_calls.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        endpoint,
                        name = %ep.name,
                        "the LLM server reports usage for the first prompt of a list only (llama-server); \
                         sending one completions call per prompt to this endpoint from now on"
                    );
                }
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
        permit_held: bool,
    ) -> (Result<Parsed, LlmError>, u32) {
        let ep = &self.inner.endpoints[endpoint];
        let mut attempt = 0u32;
        loop {
            let permit = if permit_held {
                None
            } else {
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => return (Err(LlmError::cancelled()), attempt),
                    p = ep.permits.acquire() => Some(p),
                }
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
    /// The answer was llama-server's merged list answer: its usage covers only the first prompt.
    first_prompt_usage_only: bool,
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
/// Accepts one OpenAI object or older llama-server's array of per-prompt objects; the choices' own
/// `index` values are used when they are distinct and in range, else positions. An object with a
/// top-level `timings` (llama.cpp's merged answer) has the usage of its first choice's prompt only.
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
    let mut indexed: Vec<(u64, usize, usize, &Value)> = flat
        .iter()
        .zip(&declared)
        .enumerate()
        .map(|(pos, (&(o, c, ch), d))| {
            let index = match (declared_ok, is_array) {
                (true, _) => d.unwrap_or_default(),
                (false, true) => o as u64 * choices_per_prompt + c as u64,
                (false, false) => pos as u64,
            };
            (index, o, c, ch)
        })
        .collect();
    indexed.sort_by_key(|&(index, _, _, _)| index);

    let mut out: Vec<Option<Result<Completion, LlmError>>> = (0..n_items).map(|_| None).collect();
    // Which items each object's choices served, to decide whether the object's usage is one item's.
    let mut items_of_object: Vec<Vec<usize>> = vec![Vec::new(); objects.len()];
    // The item served by the first choice of a single-object answer.
    let mut first_choice_item = None;
    for (index, o, c, choice) in indexed {
        let item = (index / choices_per_prompt) as usize;
        if item >= n_items || out[item].is_some() {
            continue;
        }
        items_of_object[o].push(item);
        if !is_array && c == 0 {
            first_choice_item = Some(item);
        }
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
    // An object's usage is an item's own when that object served exactly that one item (each
    // element of older llama-server's array, or the whole answer of a one-prompt call), or, in
    // llama.cpp's merged answer, the item of the first choice.
    let merged = !is_array && objects.first().is_some_and(|o| o.get("timings").is_some_and(Value::is_object));
    let first_prompt_usage_only = merged && items_of_object.first().is_some_and(|served| served.len() > 1);
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
        let owner = if served.len() == 1 && (is_array || n_items == 1) {
            Some(served[0])
        } else if merged {
            first_choice_item
        } else {
            None
        };
        if let Some(owner) = owner {
            if let Some(Some(Ok(c))) = out.get_mut(owner) {
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
    Ok(Parsed { items, prompt_tokens, cached_tokens, first_prompt_usage_only })
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
    Ok(Parsed { items: vec![Ok(completion)], prompt_tokens, cached_tokens, first_prompt_usage_only: false })
}

/// A JSON value cut to 200 characters for error messages.
fn short(v: &Value) -> String {
    preview(v.to_string().as_bytes()).chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;
    use crate::fake_llm::{FakeLlm, ListShape};
    use crate::request::ChatMessage;
    use serde_json::json;
    use std::num::{NonZeroU32, NonZeroUsize};

    fn settings(url: &Url) -> LlmSettings {
        LlmSettings {
            endpoints: vec![url.clone()],
            model: "m".into(),
            api_key: None,
            max_concurrency: NonZeroUsize::new(4).unwrap(),
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
            max_attempts: NonZeroU32::new(3).unwrap(),
            backoff_initial: Duration::from_millis(1),
            backoff_max: Duration::from_millis(5),
            list_prompts: true,
            max_response_bytes: NonZeroUsize::new(64 << 20).unwrap(),
        }
    }

    fn params(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    fn completion(p: &str) -> Body {
        Body::Completion(p.into())
    }

    fn chat(text: &str) -> Body {
        Body::Chat(vec![
            ChatMessage { role: "system".into(), text: "Be brief.".into(), raw: json!({"role": "system", "content": "Be brief."}) },
            ChatMessage { role: "user".into(), text: text.into(), raw: json!({"role": "user", "content": text}) },
        ])
    }

    fn items<'a>(reqs: &'a [(Body, Map<String, Value>)]) -> Vec<InferenceItem<'a>> {
        reqs.iter().map(|(body, params)| InferenceItem { body, model: None, params }).collect()
    }

    async fn run(client: &LlmClient, reqs: &[(Body, Map<String, Value>)]) -> Vec<Result<Completion, LlmError>> {
        client.infer(0, &items(reqs), &CancellationToken::new()).await
    }

    fn three_prompts(p: &Map<String, Value>) -> Vec<(Body, Map<String, Value>)> {
        ["alpha prompt", "bravo prompt", "charlie prompt"].iter().map(|s| (completion(s), p.clone())).collect()
    }

    #[tokio::test]
    async fn list_prompt_is_one_call_demuxed_by_index() {
        let fake = FakeLlm::new().reverse_choices().start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let p = params(json!({"max_tokens": 4, "cache_prompt": true, "x_unknown": [1]}));
        let results = run(&client, &three_prompts(&p)).await;

        let calls = fake.calls();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].path, "/v1/completions");
        assert_eq!(calls[0].prompts, ["alpha prompt", "bravo prompt", "charlie prompt"]);
        assert_eq!(calls[0].model.as_deref(), Some("m"));
        assert_eq!(calls[0].params, p, "params pass through untouched");
        let outputs: Vec<Value> = results.iter().map(|r| r.as_ref().unwrap().output.clone()).collect();
        assert_eq!(outputs, [json!("ok:alpha pr"), json!("ok:bravo pr"), json!("ok:charlie ")]);
        for r in &results {
            let c = r.as_ref().unwrap();
            assert_eq!(c.attempts, 1);
            assert_eq!(c.finish_reason.as_deref(), Some("length"));
            assert_eq!(c.model.as_deref(), Some("m"));
            assert_eq!(c.usage, None, "whole-call usage is not apportioned");
        }
    }

    #[tokio::test]
    async fn one_prompt_call_gets_the_call_usage() {
        let fake = FakeLlm::new().start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let reqs = vec![(completion("abcdefghij"), Map::new())];
        let c = run(&client, &reqs).await.remove(0).unwrap();
        assert_eq!(c.usage, Some(Usage { prompt_tokens: 3, completion_tokens: 3, cached_tokens: Some(0) }));
    }

    #[tokio::test]
    async fn llama_server_array_shape_gives_per_item_usage() {
        let fake = FakeLlm::new().list_shape(ListShape::PerPromptArray).reverse_choices().start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let shared = "You are a helpful assistant. Answer: ";
        let reqs: Vec<_> = ["one", "two", "six"].iter().map(|s| (completion(&format!("{shared}{s}")), Map::new())).collect();
        let results = run(&client, &reqs).await;
        assert_eq!(fake.call_count(), 1);
        for (i, r) in results.iter().enumerate() {
            let c = r.as_ref().unwrap();
            assert_eq!(c.output, json!("ok:You are "));
            let u = c.usage.as_ref().expect("per-prompt usage");
            assert_eq!(u.prompt_tokens, 10);
            // The first prompt sees an empty cache; later ones share `shared` (37 chars → 9 tokens).
            assert_eq!(u.cached_tokens, Some(if i == 0 { 0 } else { 9 }), "item {i}");
        }
    }

    #[tokio::test]
    async fn llama_server_merged_answer_switches_the_endpoint_to_per_prompt_calls() {
        let fake = FakeLlm::new().list_shape(ListShape::LlamaMerged).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(fake.call_count(), 1);
        let usages: Vec<Option<Usage>> = results.into_iter().map(|r| r.unwrap().usage).collect();
        assert_eq!(usages[0], Some(Usage { prompt_tokens: 3, completion_tokens: 3, cached_tokens: Some(0) }));
        assert_eq!(usages[1..], [None, None], "the merged usage is the first prompt's only");

        let results = run(&client, &three_prompts(&Map::new())).await;
        let calls = fake.calls();
        assert_eq!(calls.len(), 4, "one call per prompt from now on");
        assert!(calls[1..].iter().all(|c| c.prompts.len() == 1));
        for r in results {
            let u = r.unwrap().usage.expect("exact per-item usage");
            let cached = u.cached_tokens.unwrap();
            assert!(cached > 0 && cached <= u.prompt_tokens, "seen before: {u:?}");
        }
    }

    /// Runs against a real OpenAI-compatible server, e.g.
    /// `LLM_SERVER_URL=$(scripts/llm-server start) cargo test --lib llm::tests::real_server -- --ignored --nocapture`.
    #[tokio::test]
    #[ignore = "needs a real LLM server in LLM_SERVER_URL"]
    async fn real_server() {
        let url = Url::parse(&std::env::var("LLM_SERVER_URL").expect("LLM_SERVER_URL")).unwrap();
        let mut s = settings(&url);
        s.request_timeout = Duration::from_secs(120);
        let client = LlmClient::new(&s).unwrap();
        let p = params(json!({"max_tokens": 4, "temperature": 0, "cache_prompt": true}));
        let shared = "Q: What is the capital of France?\nA: Paris.\nQ: What is the capital of Italy?\nA: Rome.\nQ: ";
        let reqs: Vec<_> = ["Spain", "Germany", "Japan"]
            .iter()
            .map(|c| (completion(&format!("{shared}What is the capital of {c}?\nA:")), p.clone()))
            .chain([(chat("Say hi."), p.clone())])
            .collect();
        for round in 0..2 {
            let results = run(&client, &reqs).await;
            for r in &results {
                let c = r.as_ref().unwrap();
                println!("round {round}: {:?} usage={:?} finish={:?}", c.output, c.usage, c.finish_reason);
            }
            if round == 1 {
                let cached: u64 = results.iter().filter_map(|r| r.as_ref().unwrap().usage.as_ref()?.cached_tokens).sum();
                assert!(cached > 0, "the shared prefix was cached");
            }
        }
    }

    #[tokio::test]
    async fn server_errors_are_retried_until_success() {
        let fake = FakeLlm::new().fail_first(2, 500).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(fake.call_count(), 3);
        for r in results {
            assert_eq!(r.unwrap().attempts, 3);
        }
    }

    #[tokio::test]
    async fn permanent_server_error_fails_every_item_after_max_attempts() {
        let fake = FakeLlm::new().always_fail(500).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(fake.call_count(), 3, "max_attempts = 3");
        assert_eq!(results.len(), 3);
        for r in results {
            let e = r.unwrap_err();
            assert_eq!(e.kind, ErrorKind::Server);
            assert_eq!(e.status, Some(500));
            assert!(e.message.contains("fake failure"), "{}", e.message);
        }
    }

    #[tokio::test]
    async fn rate_limit_honours_retry_after_capped_at_backoff_max() {
        let fake = FakeLlm::new().fail_first(1, 429).retry_after(1).start().await.unwrap();
        let mut s = settings(&fake.url);
        s.backoff_max = Duration::from_millis(300);
        let client = LlmClient::new(&s).unwrap();
        let started = Instant::now();
        let results = run(&client, &three_prompts(&Map::new())).await;
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(300), "waited only {waited:?}");
        assert!(waited < Duration::from_millis(1000), "Retry-After must be capped: {waited:?}");
        let calls = fake.calls();
        assert_eq!(calls.len(), 2);
        assert!(calls[1].received_at - calls[0].received_at >= Duration::from_millis(300));
        assert!(results.iter().all(|r| r.as_ref().unwrap().attempts == 2));
    }

    #[tokio::test]
    async fn client_errors_are_not_retried() {
        let fake = FakeLlm::new().always_fail(400).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(fake.call_count(), 1);
        for r in results {
            let e = r.unwrap_err();
            assert_eq!((e.kind, e.status), (ErrorKind::Rejected, Some(400)));
        }
    }

    #[tokio::test]
    async fn bad_json_is_retried() {
        let fake = FakeLlm::new().bad_json_first(1).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(fake.call_count(), 2);
        assert!(results.iter().all(|r| r.as_ref().unwrap().attempts == 2));

        let fake = FakeLlm::new().bad_json_first(10).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(fake.call_count(), 3);
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::InvalidResponse));
    }

    #[tokio::test]
    async fn cancellation_aborts_in_flight_calls_quickly() {
        let fake = FakeLlm::new().latency(Duration::from_secs(60)).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let cancel = CancellationToken::new();
        let task = {
            let (client, cancel) = (client.clone(), cancel.clone());
            tokio::spawn(async move {
                let mut reqs = three_prompts(&Map::new());
                reqs.push((chat("hi"), Map::new()));
                client.infer(0, &items(&reqs), &cancel).await
            })
        };
        fake.wait_for_calls(2).await;
        let started = Instant::now();
        cancel.cancel();
        let results = tokio::time::timeout(Duration::from_secs(5), task).await.expect("returns quickly").unwrap();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(results.len(), 4);
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::Cancelled));
        assert_eq!(fake.call_count(), 2);
    }

    #[tokio::test]
    async fn batch_is_split_by_kind_model_and_params() {
        let fake = FakeLlm::new().start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let (one, two) = (params(json!({"max_tokens": 1})), params(json!({"max_tokens": 2})));
        let reqs = vec![
            (completion("a1"), one.clone()),
            (completion("b2"), two.clone()),
            (chat("c3"), one.clone()),
            (completion("d1"), one.clone()),
            (completion("e2"), two.clone()),
        ];
        let mut its = items(&reqs);
        its.push(InferenceItem { body: &reqs[0].0, model: Some("other"), params: &one });
        let results = client.infer(0, &its, &CancellationToken::new()).await;
        let outputs: Vec<Value> = results.into_iter().map(|r| r.unwrap().output).collect();
        assert_eq!(
            outputs,
            [
                json!("ok:a1"),
                json!("ok:b2"),
                json!({"role": "assistant", "content": "ok:c3"}),
                json!("ok:d1"),
                json!("ok:e2"),
                json!("ok:a1"),
            ]
        );
        let mut calls: Vec<(String, Option<String>, Vec<String>, Value)> = fake
            .calls()
            .into_iter()
            .map(|c| (c.path, c.model, c.prompts, c.params["max_tokens"].clone()))
            .collect();
        calls.sort_by(|a, b| (&a.2, &a.1).cmp(&(&b.2, &b.1)));
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            calls,
            [
                ("/v1/chat/completions".into(), Some("m".into()), s(&["<|system|>\nBe brief.\n<|user|>\nc3\n"]), json!(1)),
                ("/v1/completions".into(), Some("other".into()), s(&["a1"]), json!(1)),
                ("/v1/completions".into(), Some("m".into()), s(&["a1", "d1"]), json!(1)),
                ("/v1/completions".into(), Some("m".into()), s(&["b2", "e2"]), json!(2)),
            ]
        );
    }

    #[tokio::test]
    async fn chat_items_run_concurrently_up_to_the_endpoint_limit() {
        let fake = FakeLlm::new().latency(Duration::from_millis(100)).start().await.unwrap();
        let mut s = settings(&fake.url);
        s.max_concurrency = NonZeroUsize::new(2).unwrap();
        let client = LlmClient::new(&s).unwrap();
        let reqs: Vec<_> = (0..6).map(|i| (chat(&format!("question {i}")), Map::new())).collect();
        let started = Instant::now();
        let results = run(&client, &reqs).await;
        assert_eq!(fake.call_count(), 6);
        assert_eq!(fake.max_in_flight(), 2);
        assert!(started.elapsed() >= Duration::from_millis(300), "6 calls, 2 at a time, 100 ms each");
        for (i, r) in results.into_iter().enumerate() {
            let c = r.unwrap();
            assert_eq!(c.output, json!({"role": "assistant", "content": format!("ok:question")}));
            assert!(c.usage.is_some(), "item {i}");
        }
    }

    #[tokio::test]
    async fn a_missing_choice_fails_only_its_item() {
        let fake = FakeLlm::new().omit_choice(1).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(fake.call_count(), 1, "not retried");
        assert!(results[0].is_ok() && results[2].is_ok());
        assert_eq!(results[1].as_ref().unwrap_err().kind, ErrorKind::InvalidResponse);
    }

    #[tokio::test]
    async fn refused_connections_are_retried_then_fail_as_connect() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        drop(listener);
        let client = LlmClient::new(&settings(&url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        for r in results {
            let e = r.unwrap_err();
            assert_eq!(e.kind, ErrorKind::Connect, "{e}");
            assert!(!e.message.contains("127.0.0.1"), "no URL in messages: {}", e.message);
        }
    }

    #[tokio::test]
    async fn slow_server_times_out() {
        let fake = FakeLlm::new().latency(Duration::from_secs(30)).start().await.unwrap();
        let mut s = settings(&fake.url);
        s.request_timeout = Duration::from_millis(100);
        s.max_attempts = NonZeroU32::new(2).unwrap();
        let client = LlmClient::new(&s).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(fake.call_count(), 2);
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::Timeout));
    }

    #[tokio::test]
    async fn bearer_token_is_sent_but_never_shown() {
        let fake = FakeLlm::new().start().await.unwrap();
        let mut s = settings(&fake.url);
        s.api_key = Some(Secret::new("sk-test-123"));
        let client = LlmClient::new(&s).unwrap();
        run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(fake.calls()[0].authorization.as_deref(), Some("Bearer sk-test-123"));
        assert!(!format!("{client:?}").contains("sk-test"));
    }

    #[tokio::test]
    async fn stream_is_forced_off() {
        let fake = FakeLlm::new().start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let p = params(json!({"stream": true, "stream_options": {"include_usage": true}, "seed": 7}));
        let results = run(&client, &three_prompts(&p)).await;
        assert!(results.iter().all(Result::is_ok));
        assert_eq!(fake.calls()[0].params, params(json!({"stream": false, "seed": 7})));
    }

    #[test]
    fn endpoint_urls_and_names() {
        let mut s = settings(&Url::parse("http://user:pw@llm-a:8000/proxy").unwrap());
        s.endpoints.push(Url::parse("http://llm-b:8000/").unwrap());
        let client = LlmClient::new(&s).unwrap();
        let ep = &client.inner.endpoints;
        assert_eq!(ep[0].completions.as_str(), "http://user:pw@llm-a:8000/proxy/v1/completions");
        assert_eq!(ep[1].chat.as_str(), "http://llm-b:8000/v1/chat/completions");
        assert_eq!(client.endpoint_name(0), Some("http://llm-a:8000/proxy"));
        assert!(!format!("{client:?}").contains("pw"));
        let picks: Vec<usize> = (0..64).map(|p| client.endpoint_for(p)).collect();
        assert!(picks.iter().all(|&i| i < 2));
        assert!(picks.contains(&0) && picks.contains(&1), "both endpoints get partitions");
        assert_eq!(picks, (0..64).map(|p| client.endpoint_for(p)).collect::<Vec<_>>(), "stable");
    }

    #[test]
    fn new_rejects_bad_configuration() {
        let mut s = settings(&Url::parse("https://llm:443").unwrap());
        assert_eq!(LlmClient::new(&s).unwrap_err().kind, ErrorKind::Rejected);
        s.endpoints.clear();
        assert_eq!(LlmClient::new(&s).unwrap_err().kind, ErrorKind::Rejected);
    }

    #[tokio::test]
    async fn out_of_range_endpoint_fails_every_item() {
        let client = LlmClient::new(&settings(&Url::parse("http://127.0.0.1:9").unwrap())).unwrap();
        let reqs = three_prompts(&Map::new());
        let results = client.infer(5, &items(&reqs), &CancellationToken::new()).await;
        assert_eq!(results.len(), 3);
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::Rejected));
        assert!(client.infer(0, &[], &CancellationToken::new()).await.is_empty());
    }

    #[test]
    fn statuses_are_classified() {
        let c = |s| classify(Problem::Status(s));
        assert_eq!(c(429), ErrorKind::RateLimited);
        assert_eq!(c(408), ErrorKind::Timeout);
        assert_eq!(c(500), ErrorKind::Server);
        assert_eq!(c(503), ErrorKind::Server);
        assert_eq!(c(400), ErrorKind::Rejected);
        assert_eq!(c(404), ErrorKind::Rejected);
        assert_eq!(c(302), ErrorKind::Rejected);
        assert_eq!(classify(Problem::InvalidBody), ErrorKind::InvalidResponse);
        let retryable: Vec<&str> = ErrorKind::ALL.iter().filter(|k| k.retryable()).map(|k| k.as_str()).collect();
        assert_eq!(retryable, ["timeout", "connect", "rate_limited", "server", "invalid_response"]);
    }

    #[test]
    fn backoff_is_exponential_with_full_jitter_and_capped() {
        let (initial, max) = (Duration::from_millis(100), Duration::from_secs(1));
        for _ in 0..200 {
            assert!(backoff_delay(1, None, initial, max) <= initial);
            assert!(backoff_delay(3, None, initial, max) <= initial * 4);
            assert!(backoff_delay(40, None, initial, max) <= max);
        }
        assert_eq!(backoff_delay(1, Some(Duration::from_secs(30)), initial, max), max);
        assert_eq!(backoff_delay(1, Some(Duration::from_millis(200)), initial, max), Duration::from_millis(200));
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_static(" 7 "));
        assert_eq!(parse_retry_after(&h), Some(Duration::from_secs(7)));
        h.insert(RETRY_AFTER, HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"));
        assert_eq!(parse_retry_after(&h), None);
    }

    #[test]
    fn demux_handles_n_choices_per_prompt() {
        let v = json!({"choices": [
            {"index": 3, "text": "b1"}, {"index": 0, "text": "a0"},
            {"index": 2, "text": "b0"}, {"index": 1, "text": "a1"},
        ], "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}});
        let p = demux_completions(v, 2, 2).unwrap();
        let outs: Vec<Value> = p.items.into_iter().map(|r| r.unwrap().output).collect();
        assert_eq!(outs, [json!("a0"), json!("b0")]);
        assert_eq!((p.prompt_tokens, p.cached_tokens), (10, 4));
    }

    #[test]
    fn demux_array_without_usable_indices_goes_by_position() {
        // An older llama-server numbers every element's choice 0.
        let v = json!([
            {"choices": [{"index": 0, "text": "x"}], "timings": {"prompt_n": 3, "cache_n": 5, "predicted_n": 2}},
            {"choices": [{"index": 0, "text": "y"}], "usage": {"prompt_tokens": 8, "completion_tokens": 2}},
        ]);
        let p = demux_completions(v, 2, 1).unwrap();
        let items: Vec<Completion> = p.items.into_iter().map(Result::unwrap).collect();
        assert_eq!(items[0].output, json!("x"));
        assert_eq!(items[0].usage, Some(Usage { prompt_tokens: 8, completion_tokens: 2, cached_tokens: Some(5) }));
        assert_eq!(items[1].output, json!("y"));
        assert_eq!(items[1].usage, Some(Usage { prompt_tokens: 8, completion_tokens: 2, cached_tokens: None }));
        assert_eq!((p.prompt_tokens, p.cached_tokens), (16, 5));
    }

    #[test]
    fn demux_rejects_answers_without_choices() {
        let e = demux_completions(json!({"error": "overloaded"}), 2, 1).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidResponse);
        assert!(parse_chat(json!({"choices": []})).is_err());
        let p = demux_completions(json!({"choices": [{"index": 0, "text": 5}]}), 1, 1).unwrap();
        assert_eq!(p.items[0].as_ref().unwrap_err().kind, ErrorKind::InvalidResponse);
    }
}
