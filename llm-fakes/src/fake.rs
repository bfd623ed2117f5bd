//! A fake OpenAI-compatible LLM server, in process: for unit and integration tests, benchmarks of
//! the pipeline without a GPU, and demos.
//!
//! Built with a builder ([`FakeLlm`]), bound to an OS-chosen port ([`FakeLlm::start`]) or to a
//! listener the caller owns ([`FakeLlm::serve`]). It answers:
//!
//! - `POST /v1/completions` — `prompt` a string or a list of strings; one choice per prompt with
//!   `index`, `text` = `"ok:"` + the prompt's first 8 characters and `finish_reason: "length"`, and
//!   OpenAI `usage` with vLLM's `prompt_tokens_details.cached_tokens`. [`ListShape`] switches to
//!   the answer shapes of llama.cpp's llama-server (with its `timings`: `prompt_n`, `cache_n`,
//!   `predicted_n`).
//! - `POST /v1/chat/completions` — `choices[0].message = {role: "assistant", content}`.
//! - `GET /v1/models`, `GET /health`, and `GET /metrics` with vLLM's prefix cache counters
//!   `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (in tokens).
//!
//! Token model: a prompt of `c` characters has `max(1, ceil(c / 4))` prompt tokens; its cached
//! tokens are `floor(l / 4)` where `l` is the longest common prefix, in characters, with any prompt
//! this server answered before (earlier prompts of the same list included), so tests can observe a
//! cache effect. Failures and bad JSON come first, in call order (see [`FakeLlm::fail_first`]),
//! and are not counted in the cache model.
//!
//! The fake ignores a request's `n` (choices per prompt): it always answers one choice per
//! prompt, indices `0..prompts`, like a server that does not implement `n` for list prompts.
//!
//! Prompts can be marked to fail ([`FakeLlm::fail_prompts_containing`]) or to be slow
//! ([`FakeLlm::slow_prompts_containing`]) on their own, on an otherwise healthy server.
//!
//! Runtime fault switches on the [`FakeLlmHandle`] (for fault tests of a running pipeline):
//! [`FakeLlmHandle::set_status`] answers every POST with one HTTP status until switched back,
//! [`FakeLlmHandle::set_chat_refused`] answers every chat call 400 as vLLM does without a chat
//! template, [`FakeLlmHandle::set_refuse`] closes the listening socket (connections are refused) and later
//! binds the same address again.

use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use url::Url;

use crate::openai::{self, error_response};

/// Builder and configuration of a fake server. Every option defaults to "behave well, instantly".
#[derive(Debug, Clone)]
pub struct FakeLlm {
    model: String,
    latency: Duration,
    per_prompt_latency: Duration,
    fail_first: usize,
    fail_status: u16,
    always_fail: Option<u16>,
    bad_json_first: usize,
    retry_after: Option<u64>,
    cache: CacheReport,
    shape: ListShape,
    reverse_choices: bool,
    omit_choice: Option<usize>,
    max_prompt_chars: Option<usize>,
    fail_marker: Option<(String, u16)>,
    slow_marker: Option<(String, Duration)>,
    strict_model: bool,
    chat_only: bool,
    /// The status and error message of a completions call when [`Self::chat_only`].
    no_completions: (u16, &'static str),
    echo_authorization: bool,
}

/// How the fake reports cached prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheReport {
    /// The longest-common-prefix model of the module docs (default).
    #[default]
    LongestPrefix,
    /// Always report `cached_tokens: 0`.
    Zero,
    /// Report no `prompt_tokens_details` at all, like a server without prefix caching.
    Omit,
}

/// The answer shape of `/v1/completions`, which matters for a list `prompt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ListShape {
    /// One object, one choice per prompt, `usage` for the whole call (OpenAI API, vLLM, SGLang).
    /// Default.
    #[default]
    Choices,
    /// Current llama.cpp llama-server: one object, one choice per prompt, but the top-level
    /// `usage` and `timings` are those of the first answered prompt only.
    LlamaMerged,
    /// Older llama-server builds: for more than one prompt, a JSON array of per-prompt completion
    /// objects, each with its own `usage` and `timings`.
    PerPromptArray,
}

impl Default for FakeLlm {
    fn default() -> Self {
        FakeLlm {
            model: "fake-model".into(),
            latency: Duration::ZERO,
            per_prompt_latency: Duration::ZERO,
            fail_first: 0,
            fail_status: 500,
            always_fail: None,
            bad_json_first: 0,
            retry_after: None,
            cache: CacheReport::default(),
            shape: ListShape::default(),
            reverse_choices: false,
            omit_choice: None,
            max_prompt_chars: None,
            fail_marker: None,
            slow_marker: None,
            strict_model: false,
            chat_only: false,
            no_completions: (404, "Not Found"),
            echo_authorization: false,
        }
    }
}

impl FakeLlm {
    /// A well-behaved, instant server named `fake-model`.
    pub fn new() -> Self {
        Self::default()
    }

    /// The model id reported by `/v1/models` and in answers that name no model.
    pub fn model(mut self, name: impl Into<String>) -> Self {
        self.model = name.into();
        self
    }

    /// Delay before every POST answer (failures included).
    pub fn latency(mut self, d: Duration) -> Self {
        self.latency = d;
        self
    }

    /// Extra delay per prompt of a POST (a list of 4 prompts waits 4 × `d`).
    pub fn per_prompt_latency(mut self, d: Duration) -> Self {
        self.per_prompt_latency = d;
        self
    }

    /// The first `n` POST calls are answered with HTTP `status` and an OpenAI-style error body.
    pub fn fail_first(mut self, n: usize, status: u16) -> Self {
        self.fail_first = n;
        self.fail_status = status;
        self
    }

    /// Every POST call is answered with HTTP `status`.
    pub fn always_fail(mut self, status: u16) -> Self {
        self.always_fail = Some(status);
        self
    }

    /// After the [`fail_first`](Self::fail_first) calls, the next `n` POST calls get HTTP 200 with
    /// a truncated JSON body.
    pub fn bad_json_first(mut self, n: usize) -> Self {
        self.bad_json_first = n;
        self
    }

    /// Adds `Retry-After: secs` to every failure response.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// How cached tokens are reported; see [`CacheReport`].
    pub fn cached_tokens(mut self, mode: CacheReport) -> Self {
        self.cache = mode;
        self
    }

    /// The answer shape for list prompts; see [`ListShape`].
    pub fn list_shape(mut self, shape: ListShape) -> Self {
        self.shape = shape;
        self
    }

    /// Return choices in reverse index order (the OpenAI API promises `index`, not order).
    pub fn reverse_choices(mut self) -> Self {
        self.reverse_choices = true;
        self
    }

    /// Leave out the choice for prompt `index` of every list answer (a misbehaving server).
    pub fn omit_choice(mut self, index: usize) -> Self {
        self.omit_choice = Some(index);
        self
    }

    /// A context window of `chars` characters: a call with any prompt longer than that is
    /// answered HTTP 400 with vLLM's "maximum context length" error, like a real server whose
    /// context length the prompt exceeds (the whole list fails, not only the long prompt).
    pub fn max_prompt_chars(mut self, chars: usize) -> Self {
        self.max_prompt_chars = Some(chars);
        self
    }

    /// A call with any prompt containing `marker` is answered HTTP `status` with an OpenAI-style
    /// error body, while every other call (the daemon's probe included) is served normally: a
    /// prompt the server cannot handle on an otherwise healthy server (llama-server answers 500
    /// "Failed to parse tools" to a malformed `tools` param). A list call carrying it fails as a
    /// whole, as on a real server.
    pub fn fail_prompts_containing(mut self, marker: impl Into<String>, status: u16) -> Self {
        self.fail_marker = Some((marker.into(), status));
        self
    }

    /// The error body of a [`fail_prompts_containing`](Self::fail_prompts_containing) call
    /// quotes the call's `Authorization` header, as some gateways and home-grown servers do
    /// ("Incorrect API key provided: Bearer sk-…").
    pub fn echo_authorization(mut self) -> Self {
        self.echo_authorization = true;
        self
    }

    /// A call with any prompt containing `marker` waits `delay` longer before it is answered (on
    /// top of [`latency`](Self::latency)), then is answered normally, while every other call (the
    /// daemon's probe included) is served at once: a prompt that on its own keeps an otherwise
    /// healthy server busy beyond the client's timeout (a huge `max_tokens`, a prompt the server
    /// chokes on). A list call carrying it is slow as a whole, as on a real server. Recorded with
    /// status 200 on arrival; a client that gives up first just closes the connection.
    pub fn slow_prompts_containing(mut self, marker: impl Into<String>, delay: Duration) -> Self {
        self.slow_marker = Some((marker.into(), delay));
        self
    }

    /// A call naming a model other than [`model`](Self::model) is answered HTTP 404 with vLLM's
    /// "The model `…` does not exist." (a call naming none is served); by default any model is
    /// served.
    pub fn strict_model(mut self) -> Self {
        self.strict_model = true;
        self
    }

    /// No completions API: every `POST /v1/completions` is answered HTTP 404 (recorded with that
    /// status), as by a server or gateway that serves only `/v1/chat/completions`.
    pub fn chat_only(mut self) -> Self {
        self.chat_only = true;
        self
    }

    /// As [`chat_only`](Self::chat_only), but a completions call is answered `status` with
    /// `message`: Azure OpenAI answers 400 `OperationNotSupported` ("The completion operation
    /// does not work with the specified model") to a completions call for a chat deployment.
    pub fn chat_only_answering(mut self, status: u16, message: &'static str) -> Self {
        self.chat_only = true;
        self.no_completions = (status, message);
        self
    }

    /// Binds `127.0.0.1:0` and serves in a background task until the handle is dropped or
    /// [`FakeLlmHandle::shutdown`] is called. The handle's fault switches work on this server.
    pub async fn start(self) -> io::Result<FakeLlmHandle> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr: SocketAddr = listener.local_addr()?;
        let url = Url::parse(&format!("http://{addr}")).map_err(io::Error::other)?;
        let state = Arc::new(Shared::new(self));
        tokio::spawn(serve_switchable(state.clone(), listener, addr));
        Ok(FakeLlmHandle { url, state })
    }

    /// Like [`Self::start`], over HTTPS: binds `127.0.0.1:0` and serves TLS with the PEM
    /// certificate chain `cert_pem` and PEM private key `key_pem` (rustls, ring provider). With
    /// `client_ca_pem`, clients must present a certificate signed by that CA (mutual TLS). The
    /// handle's URL is `https://localhost:PORT` (the certificate must name `localhost`). A client
    /// whose handshake fails is dropped; the server goes on. The refuse switch is not supported.
    ///
    /// Errors: bad PEM, or the socket cannot be bound.
    pub async fn start_tls(self, cert_pem: &[u8], key_pem: &[u8], client_ca_pem: Option<&[u8]>) -> io::Result<FakeLlmHandle> {
        let acceptor = tls_acceptor(cert_pem, key_pem, client_ca_pem)?;
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr: SocketAddr = listener.local_addr()?;
        let url = Url::parse(&format!("https://localhost:{}", addr.port())).map_err(io::Error::other)?;
        let state = Arc::new(Shared::new(self));
        let stop = state.stop.clone();
        let app = app(state.clone());
        tokio::spawn(async move {
            let _ = axum::serve(TlsListener { tcp: listener, acceptor }, app).with_graceful_shutdown(stop.cancelled_owned()).await;
        });
        Ok(FakeLlmHandle { url, state })
    }

    /// Serves on `listener` until `shutdown` completes (for a CLI subcommand or a caller that owns
    /// the socket). Pending answers are cut short at shutdown (HTTP 503).
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> io::Result<()> {
        serve_shared(Arc::new(Shared::new(self)), listener, shutdown).await
    }
}

/// One POST the fake received, recorded on arrival (before its latency).
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedCall {
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: String,
    /// The request's `model`.
    pub model: Option<String>,
    /// The completion prompts in request order, or for chat the one conversation rendered as
    /// `<|role|>\ncontent\n` per message.
    pub prompts: Vec<String>,
    /// Everything else of the request body (sampling params, `cache_prompt`, `stream`, …).
    pub params: Map<String, Value>,
    /// The HTTP status the fake decided to answer with.
    pub status: u16,
    /// The `Authorization` header, as received.
    pub authorization: Option<String>,
    /// Arrival time.
    pub received_at: tokio::time::Instant,
}

/// A running fake server. Dropping it stops the server.
pub struct FakeLlmHandle {
    /// Base URL, `http://127.0.0.1:PORT` (`https://localhost:PORT` from
    /// [`FakeLlm::start_tls`]; no `/v1`).
    pub url: Url,
    state: Arc<Shared>,
}

impl FakeLlmHandle {
    /// Every POST received so far, in arrival order.
    pub fn calls(&self) -> Vec<RecordedCall> {
        self.state.lock().calls.clone()
    }

    /// Number of POSTs received so far.
    pub fn call_count(&self) -> usize {
        self.state.lock().calls.len()
    }

    /// Waits until at least `n` POSTs have arrived (no polling, no sleeps).
    pub async fn wait_for_calls(&self, n: usize) {
        let mut rx = self.state.arrivals.subscribe();
        // The sender lives as long as `self`, so this only ends when the count is reached.
        let _ = rx.wait_for(|&count| count >= n).await;
    }

    /// The highest number of POSTs that were being answered at the same time.
    pub fn max_in_flight(&self) -> usize {
        self.state.lock().max_in_flight
    }

    /// The `/metrics` counters: (prompt tokens queried, prompt tokens served from the cache).
    pub fn prefix_cache_counters(&self) -> (u64, u64) {
        let g = self.state.lock();
        (g.cache_queries, g.cache_hits)
    }

    /// While `Some(status)`, every POST is answered with HTTP `status` and an OpenAI-style error
    /// body (e.g. 503 for an overloaded server, 401 for a revoked API key); `None` switches back
    /// to the configured behaviour. Calls are recorded with the status they got.
    pub fn set_status(&self, status: Option<u16>) {
        self.state.lock().forced_status = status;
    }

    /// While `true`, every `POST /v1/chat/completions` is answered HTTP 400 with the error vLLM
    /// gives to every chat call when the model has no chat template ([`NO_CHAT_TEMPLATE`]), while
    /// completions are served as configured (a server started without `--chat-template`);
    /// `false` switches back. Calls are recorded with status 400. The runtime status switch
    /// ([`Self::set_status`]) wins.
    pub fn set_chat_refused(&self, refused: bool) {
        self.state.lock().chat_refused = refused;
    }

    /// While `true`, every POST is answered HTTP 200 with an HTML page instead of a completion
    /// (a misconfigured gateway or proxy in front of the server); `false` switches back. Calls
    /// are recorded with status 200. The runtime status switch ([`Self::set_status`]) wins.
    pub fn set_garbage(&self, garbage: bool) {
        self.state.lock().garbage = garbage;
    }

    /// `true`: stops listening and closes every connection (idle ones at once, busy ones after
    /// their answer), so new connections are refused; `false`: binds the same address again.
    /// Returns once the server is in the asked state.
    pub async fn set_refuse(&self, refuse: bool) {
        self.state.refuse.send_replace(refuse);
        let mut listening = self.state.listening.subscribe();
        let _ = listening.wait_for(|&l| l != refuse).await;
    }

    /// Stops the server; pending answers end with HTTP 503.
    pub fn shutdown(self) {
        drop(self)
    }
}

impl std::fmt::Debug for FakeLlmHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeLlmHandle").field("url", &self.url.as_str()).finish_non_exhaustive()
    }
}

impl Drop for FakeLlmHandle {
    fn drop(&mut self) {
        self.state.stop.cancel();
    }
}

struct Shared {
    cfg: FakeLlm,
    inner: Mutex<Inner>,
    /// Number of POSTs received; `wait_for_calls` watches it.
    arrivals: watch::Sender<usize>,
    /// Fired at shutdown: ends pending latencies and the accept loop.
    stop: CancellationToken,
    /// The refuse switch ([`FakeLlmHandle::set_refuse`]).
    refuse: watch::Sender<bool>,
    /// Whether the server currently listens (follows `refuse` once the switch took effect).
    listening: watch::Sender<bool>,
}

#[derive(Default)]
struct Inner {
    calls: Vec<RecordedCall>,
    /// Prompts answered successfully, for the prefix cache model.
    seen: Vec<String>,
    cache_queries: u64,
    cache_hits: u64,
    in_flight: usize,
    max_in_flight: usize,
    completions: u64,
    /// The runtime status switch ([`FakeLlmHandle::set_status`]).
    forced_status: Option<u16>,
    /// The runtime garbage switch ([`FakeLlmHandle::set_garbage`]).
    garbage: bool,
    /// The chat refusal switch ([`FakeLlmHandle::set_chat_refused`]).
    chat_refused: bool,
}

impl Shared {
    fn new(cfg: FakeLlm) -> Self {
        Shared {
            cfg,
            inner: Mutex::new(Inner::default()),
            arrivals: watch::Sender::new(0),
            stop: CancellationToken::new(),
            refuse: watch::Sender::new(false),
            listening: watch::Sender::new(true),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panicking test thread must not hide the recorded calls from the others.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn app(state: Arc<Shared>) -> axum::Router {
    openai::routes(post(completions), post(chat_completions), get(models), get(metrics)).with_state(state)
}

/// A rustls server configuration (ring provider) for `cert_pem`/`key_pem`, requiring client
/// certificates signed by `client_ca_pem` when given.
fn tls_acceptor(cert_pem: &[u8], key_pem: &[u8], client_ca_pem: Option<&[u8]>) -> io::Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = CertificateDer::pem_slice_iter(cert_pem).collect::<Result<Vec<_>, _>>().map_err(io::Error::other)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(io::Error::other)?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions().map_err(io::Error::other)?;
    let builder = match client_ca_pem {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(ca) {
                roots.add(cert.map_err(io::Error::other)?).map_err(io::Error::other)?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(io::Error::other)?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder.with_single_cert(certs, key).map_err(io::Error::other)?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// A TCP listener whose connections are TLS-accepted before axum serves them.
struct TlsListener {
    tcp: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((stream, addr)) = self.tcp.accept().await else { continue };
            // A failed handshake (wrong CA on the client, no client certificate) drops that
            // client only.
            if let Ok(tls) = self.acceptor.accept(stream).await {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

async fn serve_shared(
    state: Arc<Shared>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let stop = state.stop.clone();
    let signal = async move {
        tokio::select! {
            _ = shutdown => stop.cancel(),
            _ = stop.cancelled() => {}
        }
    };
    axum::serve(listener, app(state)).with_graceful_shutdown(signal).await
}

/// Serves on `first`, then follows the refuse switch: closes the listener (graceful: busy
/// connections finish their answer) while refusing, binds `addr` again when switched back, until
/// the stop token fires.
async fn serve_switchable(state: Arc<Shared>, first: TcpListener, addr: SocketAddr) {
    let mut listener = Some(first);
    loop {
        let current = match listener.take() {
            Some(l) => l,
            None => match rebind(&state, addr).await {
                Some(l) => l,
                None => return,
            },
        };
        state.listening.send_replace(true);
        let (mut refuse, stop) = (state.refuse.subscribe(), state.stop.clone());
        let signal = async move {
            tokio::select! {
                _ = refuse.wait_for(|&r| r) => {}
                _ = stop.cancelled() => {}
            }
        };
        let _ = axum::serve(current, app(state.clone())).with_graceful_shutdown(signal).await;
        state.listening.send_replace(false);
        if state.stop.is_cancelled() {
            return;
        }
    }
}

/// Waits until the refuse switch is off, then binds `addr` again (retrying every 20 ms while the
/// port is still in use); `None` at shutdown.
async fn rebind(state: &Shared, addr: SocketAddr) -> Option<TcpListener> {
    let mut refuse = state.refuse.subscribe();
    loop {
        tokio::select! {
            r = refuse.wait_for(|&r| !r) => r.ok()?,
            _ = state.stop.cancelled() => return None,
        };
        if let Ok(l) = TcpListener::bind(addr).await {
            return Some(l);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = state.stop.cancelled() => return None,
        }
    }
}

/// Tokens of a text in the fake's model: `max(1, ceil(chars / 4))`.
fn tokens(text: &str) -> u64 {
    openai::tokens(text, 4)
}

fn common_prefix_chars(a: &str, b: &str) -> usize {
    a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count()
}

/// The deterministic answer text for a prompt.
fn answer_text(prompt: &str) -> String {
    format!("ok:{}", prompt.chars().take(8).collect::<String>())
}

/// Per-prompt token accounting of one successful call.
struct PromptTokens {
    prompt: u64,
    cached: Option<u64>,
}

enum Decision {
    Fail(u16),
    /// A prompt exceeds [`FakeLlm::max_prompt_chars`]: HTTP 400.
    TooLong,
    BadJson,
    /// [`FakeLlmHandle::set_garbage`]: HTTP 200 with an HTML page.
    Garbage,
    /// A prompt contains the [`FakeLlm::fail_prompts_containing`] marker.
    MarkedFail(u16),
    /// A chat call while [`FakeLlmHandle::set_chat_refused`] is on: HTTP 400.
    NoChatTemplate,
    /// A call naming a model the fake does not serve ([`FakeLlm::strict_model`]): HTTP 404.
    UnknownModel(String),
    /// A completions call to a server without that API ([`FakeLlm::chat_only`]): HTTP 404, or
    /// the status of [`FakeLlm::chat_only_answering`].
    NoSuchApi,
    Answer(Vec<PromptTokens>),
}

/// The error message of a prompt over the context window (vLLM's wording).
const CONTEXT_EXCEEDED: &str = "This model's maximum context length is exceeded: reduce the length of the prompt";

/// vLLM's answer (HTTP 400) to every chat call when the model's tokenizer has no chat template
/// and none was given with `--chat-template` (vllm-project/vllm#7978, #18140).
pub const NO_CHAT_TEMPLATE: &str = "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template if the tokenizer does not define one.";

/// Decides the fate of the next call (the runtime status and garbage switches first, then the
/// builder's failures in call order, then the failing marker, then the context window) and runs
/// the cache model for an answer.
fn decide(cfg: &FakeLlm, g: &mut Inner, path: &str, model: Option<&str>, prompts: &[String]) -> Decision {
    let k = g.calls.len();
    if let Some(status) = g.forced_status.or(cfg.always_fail) {
        return Decision::Fail(status);
    }
    if let Some(other) = model.filter(|m| cfg.strict_model && *m != cfg.model) {
        return Decision::UnknownModel(other.to_owned());
    }
    if g.chat_refused && path == "/v1/chat/completions" {
        return Decision::NoChatTemplate;
    }
    if cfg.chat_only && path == "/v1/completions" {
        return Decision::NoSuchApi;
    }
    if g.garbage {
        return Decision::Garbage;
    }
    if k < cfg.fail_first {
        return Decision::Fail(cfg.fail_status);
    }
    if k < cfg.fail_first + cfg.bad_json_first {
        return Decision::BadJson;
    }
    if let Some((_, status)) = cfg.fail_marker.as_ref().filter(|(m, _)| prompts.iter().any(|p| p.contains(m.as_str()))) {
        return Decision::MarkedFail(*status);
    }
    if cfg.max_prompt_chars.is_some_and(|max| prompts.iter().any(|p| p.chars().count() > max)) {
        return Decision::TooLong;
    }
    let mut counts = Vec::with_capacity(prompts.len());
    for p in prompts {
        let prompt = tokens(p);
        let lcp = g.seen.iter().map(|s| common_prefix_chars(s, p)).max().unwrap_or(0);
        let cached = (lcp as u64 / 4).min(prompt);
        g.cache_queries += prompt;
        g.cache_hits += cached;
        g.seen.push(p.clone());
        counts.push(PromptTokens {
            prompt,
            cached: match cfg.cache {
                CacheReport::LongestPrefix => Some(cached),
                CacheReport::Zero => Some(0),
                CacheReport::Omit => None,
            },
        });
    }
    Decision::Answer(counts)
}

/// Records the call, decides its fate, runs the cache model and the latency; returns `Err` with a
/// finished response when the call fails, or the per-prompt token counts.
async fn admit(
    state: &Shared,
    path: &str,
    headers: &HeaderMap,
    model: Option<String>,
    prompts: Vec<String>,
    params: Map<String, Value>,
) -> Result<Vec<PromptTokens>, Response> {
    let cfg = &state.cfg;
    let n_prompts = prompts.len();
    let slow = match &cfg.slow_marker {
        Some((marker, d)) if prompts.iter().any(|p| p.contains(marker.as_str())) => *d,
        _ => Duration::ZERO,
    };
    let (decision, count) = {
        let mut g = state.lock();
        let decision = decide(cfg, &mut g, path, model.as_deref(), &prompts);
        let status = match decision {
            Decision::Fail(s) | Decision::MarkedFail(s) => s,
            Decision::TooLong | Decision::NoChatTemplate => 400,
            Decision::UnknownModel(_) => 404,
            Decision::NoSuchApi => cfg.no_completions.0,
            _ => 200,
        };
        g.calls.push(RecordedCall {
            path: path.to_owned(),
            model,
            prompts,
            params,
            status,
            authorization: headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_owned),
            received_at: tokio::time::Instant::now(),
        });
        g.in_flight += 1;
        g.max_in_flight = g.max_in_flight.max(g.in_flight);
        (decision, g.calls.len())
    };
    state.arrivals.send_replace(count);

    let _in_flight = InFlight(state);
    let delay = cfg.latency + cfg.per_prompt_latency * n_prompts as u32 + slow;
    if !delay.is_zero() {
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = state.stop.cancelled() => return Err(error_response(503, "fake server shutting down", None)),
        }
    }
    match decision {
        Decision::Fail(status) => Err(error_response(status, "fake failure", cfg.retry_after)),
        Decision::MarkedFail(status) => {
            let auth = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).filter(|_| cfg.echo_authorization);
            let message = match auth {
                Some(auth) => format!("fake failure: this prompt cannot be handled (request authorization: {auth})"),
                None => "fake failure: this prompt cannot be handled".to_owned(),
            };
            Err(error_response(status, &message, None))
        }
        Decision::Garbage => Err((
            [(header::CONTENT_TYPE, "text/html")],
            "<html><body><h1>Welcome to nginx!</h1></body></html>",
        )
            .into_response()),
        Decision::TooLong => Err(error_response(400, CONTEXT_EXCEEDED, None)),
        Decision::NoChatTemplate => Err(error_response(400, NO_CHAT_TEMPLATE, None)),
        Decision::NoSuchApi => Err(error_response(cfg.no_completions.0, cfg.no_completions.1, None)),
        Decision::UnknownModel(model) => Err(error_response(404, &format!("The model `{model}` does not exist."), None)),
        Decision::BadJson => Err(([(header::CONTENT_TYPE, "application/json")], "{\"choices\": [{\"text\": ").into_response()),
        Decision::Answer(counts) => Ok(counts),
    }
}

/// Decrements the in-flight gauge when an answer ends, however it ends.
struct InFlight<'a>(&'a Shared);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.lock().in_flight -= 1;
    }
}

fn usage_json(t: &PromptTokens, completion_tokens: u64) -> Value {
    openai::usage(t.prompt, t.cached, completion_tokens)
}

async fn completions(State(state): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Result<Response, Response> {
    let (prompts, mut req) = openai::completion_request(&body)?;
    let model = req.remove("model").and_then(|v| v.as_str().map(str::to_owned));
    let counts = admit(&state, "/v1/completions", &headers, model.clone(), prompts.clone(), req).await?;
    let cfg = &state.cfg;
    let model = model.unwrap_or_else(|| cfg.model.clone());
    let id = {
        let mut g = state.lock();
        g.completions += 1;
        g.completions
    };
    let created = openai::unix_now();
    // Per prompt: (choice, usage, llama.cpp timings), in prompt order, the omitted one left out.
    let mut answers: Vec<(Value, Value, Value)> = prompts
        .iter()
        .zip(&counts)
        .enumerate()
        .filter(|(i, _)| cfg.omit_choice != Some(*i))
        .map(|(i, (p, t))| {
            let text = answer_text(p);
            let completion_tokens = tokens(&text);
            let choice = openai::completion_choice(i, text);
            let cached = t.cached.unwrap_or(0);
            let timings = json!({"cache_n": cached, "prompt_n": t.prompt - cached, "predicted_n": completion_tokens});
            (choice, usage_json(t, completion_tokens), timings)
        })
        .collect();
    if cfg.reverse_choices {
        answers.reverse();
    }
    let object = |choices: Vec<Value>, usage: Value, timings: Option<Value>| {
        let mut o = openai::text_completion(format!("cmpl-fake-{id}"), created, &model, choices, usage);
        if let Some(t) = timings {
            o["timings"] = t;
        }
        o
    };
    let answer = match cfg.shape {
        ListShape::Choices => {
            let total = PromptTokens {
                prompt: counts.iter().map(|t| t.prompt).sum(),
                cached: counts.iter().map(|t| t.cached).sum(),
            };
            let completion_tokens: u64 = prompts.iter().map(|p| tokens(&answer_text(p))).sum();
            let choices = answers.into_iter().map(|(c, _, _)| c).collect();
            object(choices, usage_json(&total, completion_tokens), None)
        }
        ListShape::PerPromptArray if prompts.len() > 1 => Value::Array(
            answers.into_iter().map(|(c, usage, timings)| object(vec![c], usage, Some(timings))).collect(),
        ),
        ListShape::LlamaMerged | ListShape::PerPromptArray => {
            // llama.cpp merges the per-prompt answers into the first: its usage and timings stay.
            let (usage, timings) = answers.first().map(|(_, u, t)| (u.clone(), t.clone())).unwrap_or_default();
            let choices = answers.into_iter().map(|(c, _, _)| c).collect();
            object(choices, usage, Some(timings))
        }
    };
    Ok(Json(answer).into_response())
}

async fn chat_completions(State(state): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Result<Response, Response> {
    let (messages, mut req) = openai::chat_request(&body)?;
    let rendered = openai::render_chat(&messages);
    let last = openai::content_text(messages.last().and_then(|m| m.get("content")));
    let model = req.remove("model").and_then(|v| v.as_str().map(str::to_owned));
    let counts = admit(&state, "/v1/chat/completions", &headers, model.clone(), vec![rendered], req).await?;
    let id = {
        let mut g = state.lock();
        g.completions += 1;
        g.completions
    };
    let content = answer_text(&last);
    let completion_tokens = tokens(&content);
    let model = model.unwrap_or_else(|| state.cfg.model.clone());
    Ok(Json(openai::chat_completion(format!("chatcmpl-fake-{id}"), &model, content, usage_json(&counts[0], completion_tokens))).into_response())
}

async fn models(State(state): State<Arc<Shared>>) -> Json<Value> {
    openai::models(&state.cfg.model, "fake-llm")
}

async fn metrics(State(state): State<Arc<Shared>>) -> Response {
    let (queries, hits) = {
        let g = state.lock();
        (g.cache_queries, g.cache_hits)
    };
    let mut text = String::new();
    openai::push_prefix_cache_counters(&mut text, &state.cfg.model, queries, hits);
    openai::metrics_response(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn post(url: &Url, path: &str, body: Value) -> (u16, Value) {
        let r = crate::test_client().post(url.join(path).unwrap()).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn get_text(url: &Url, path: &str) -> (u16, String) {
        let r = crate::test_client().get(url.join(path).unwrap()).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    #[tokio::test]
    async fn completions_answer_every_prompt_with_cache_counts() {
        let fake = FakeLlm::new().start().await.unwrap();
        let (status, v) = post(&fake.url, "/v1/completions", json!({"model": "x", "prompt": "0123456789abcdef"})).await;
        assert_eq!(status, 200);
        assert_eq!(v["model"], "x");
        assert_eq!(v["choices"][0]["text"], "ok:01234567");
        assert_eq!(v["usage"]["prompt_tokens"], 4);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

        let (_, v) = post(&fake.url, "/v1/completions", json!({"prompt": ["0123456789abXYZ", "q"], "max_tokens": 1})).await;
        assert_eq!(v["choices"].as_array().unwrap().len(), 2);
        assert_eq!(v["choices"][1]["index"], 1);
        assert_eq!(v["usage"]["prompt_tokens"], 4 + 1);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 3, "12 shared chars");
        assert_eq!(fake.prefix_cache_counters(), (9, 3));
        assert_eq!(fake.calls()[1].params["max_tokens"], 1);
        let (status, metrics) = get_text(&fake.url, "/metrics").await;
        assert_eq!(status, 200);
        assert!(metrics.contains("vllm:prefix_cache_queries_total{model_name=\"fake-model\"} 9\n"), "{metrics}");
        assert!(metrics.contains("vllm:prefix_cache_hits_total{model_name=\"fake-model\"} 3\n"), "{metrics}");
    }

    #[tokio::test]
    async fn llama_server_shape_and_chat() {
        let fake = FakeLlm::new().list_shape(ListShape::PerPromptArray).cached_tokens(CacheReport::Omit).start().await.unwrap();
        let (_, v) = post(&fake.url, "/v1/completions", json!({"prompt": ["aaaa", "aaaab"]})).await;
        let arr = v.as_array().unwrap();
        assert_eq!(arr.len(), 2);
        assert_eq!(arr[1]["choices"][0]["index"], 1);
        assert_eq!(arr[1]["timings"]["cache_n"], 0, "cached tokens are not reported");
        assert!(arr[1]["usage"].get("prompt_tokens_details").is_none());

        let merged = FakeLlm::new().list_shape(ListShape::LlamaMerged).start().await.unwrap();
        let (_, v) = post(&merged.url, "/v1/completions", json!({"prompt": ["aaaa", "aaaabbbbcccc"]})).await;
        assert_eq!(v["choices"].as_array().unwrap().len(), 2);
        assert_eq!(v["usage"]["prompt_tokens"], 1, "the first prompt's usage only");
        assert_eq!(v["timings"]["prompt_n"], 1);

        let (_, v) = post(&fake.url, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]})).await;
        assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": "ok:hello th"}));
        assert_eq!(fake.calls()[1].prompts, ["<|user|>\nhello there\n"]);
    }

    #[tokio::test]
    async fn marked_prompts_fail_alone_and_the_garbage_switch() {
        let fake = FakeLlm::new().fail_prompts_containing("POISON", 500).start().await.unwrap();
        assert_eq!(post(&fake.url, "/v1/completions", json!({"prompt": ["fine", "a POISON prompt"]})).await.0, 500);
        assert_eq!(post(&fake.url, "/v1/completions", json!({"prompt": ["fine"]})).await.0, 200);
        assert_eq!(post(&fake.url, "/v1/completions", json!({"prompt": "ping", "max_tokens": 1})).await.0, 200);
        fake.set_garbage(true);
        let r = crate::test_client().post(fake.url.join("/v1/completions").unwrap()).json(&json!({"prompt": "ping"})).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert!(r.text().await.unwrap().starts_with("<html>"));
        fake.set_garbage(false);
        let (status, v) = post(&fake.url, "/v1/completions", json!({"prompt": "ping"})).await;
        assert_eq!((status, v["choices"][0]["text"].as_str()), (200, Some("ok:ping")));
        let statuses: Vec<u16> = fake.calls().iter().map(|c| c.status).collect();
        assert_eq!(statuses, [500, 200, 200, 200, 200]);
    }

    #[tokio::test]
    async fn marked_prompts_are_slow_alone() {
        let fake = FakeLlm::new().slow_prompts_containing("SLOW", Duration::from_millis(300)).start().await.unwrap();
        let started = tokio::time::Instant::now();
        let (status, v) = post(&fake.url, "/v1/completions", json!({"prompt": "ping", "max_tokens": 1})).await;
        assert_eq!((status, v["choices"][0]["text"].as_str()), (200, Some("ok:ping")));
        assert!(started.elapsed() < Duration::from_millis(300), "unmarked calls are not delayed");
        let (status, v) = post(&fake.url, "/v1/completions", json!({"prompt": ["fine", "a SLOW prompt"]})).await;
        assert!(started.elapsed() >= Duration::from_millis(300), "a list call carrying the marker is slow as a whole");
        assert_eq!((status, v["choices"].as_array().map(Vec::len)), (200, Some(2)), "then answered normally");
    }

    #[tokio::test]
    async fn failures_bad_requests_and_other_routes() {
        let fake = FakeLlm::new().fail_first(1, 503).retry_after(2).bad_json_first(1).start().await.unwrap();
        let r = crate::test_client().post(fake.url.join("/v1/completions").unwrap()).json(&json!({"prompt": "a"})).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 503);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let (status, v) = post(&fake.url, "/v1/completions", json!({"prompt": "a"})).await;
        assert_eq!((status, v), (200, Value::Null), "truncated JSON");
        let (status, _) = post(&fake.url, "/v1/completions", json!({"prompt": 5})).await;
        assert_eq!(status, 400);
        assert_eq!(post(&fake.url, "/v1/completions", json!({"prompt": "a"})).await.0, 200);
        assert_eq!(fake.call_count(), 3, "the 400 was rejected before being recorded");
        assert_eq!(get_text(&fake.url, "/health").await.0, 200);
        assert!(get_text(&fake.url, "/v1/models").await.1.contains("fake-model"));
    }

    #[tokio::test]
    async fn serve_stops_on_its_shutdown_future() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(FakeLlm::new().serve(listener, async move {
            let _ = rx.await;
        }));
        assert_eq!(get_text(&url, "/health").await.0, 200);
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn runtime_status_switch_fails_every_call_until_switched_back() {
        let fake = FakeLlm::new().start().await.unwrap();
        fake.set_status(Some(401));
        assert_eq!(post(&fake.url, "/v1/completions", json!({"prompt": "a"})).await.0, 401);
        fake.set_status(Some(503));
        let (status, v) = post(&fake.url, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
        assert_eq!((status, v["error"]["type"].as_str()), (503, Some("server_error")));
        fake.set_status(None);
        assert_eq!(post(&fake.url, "/v1/completions", json!({"prompt": "a"})).await.0, 200);
        let statuses: Vec<u16> = fake.calls().iter().map(|c| c.status).collect();
        assert_eq!(statuses, [401, 503, 200]);
    }

    #[tokio::test]
    async fn refuse_switch_closes_the_port_and_binds_it_again() {
        let fake = FakeLlm::new().start().await.unwrap();
        let client = crate::test_client();
        let health = fake.url.join("/health").unwrap();
        assert_eq!(client.get(health.clone()).send().await.unwrap().status().as_u16(), 200, "keeps a pooled connection");
        fake.set_refuse(true).await;
        let err = client.get(health.clone()).send().await.expect_err("refused while switched on");
        assert!(err.is_connect(), "a connect error, got {err:?}");
        fake.set_refuse(false).await;
        assert_eq!(client.get(health).send().await.unwrap().status().as_u16(), 200, "same URL after the switch back");
    }

    #[tokio::test]
    async fn a_prompt_over_the_context_window_fails_its_whole_call() {
        let fake = FakeLlm::new().max_prompt_chars(10).start().await.unwrap();
        let (status, v) = post(&fake.url, "/v1/completions", json!({"prompt": ["short", "far too long a prompt"]})).await;
        assert_eq!(status, 400);
        assert!(v["error"]["message"].as_str().unwrap().contains("maximum context length"), "{v}");
        let (status, v) = post(&fake.url, "/v1/completions", json!({"prompt": ["short", "0123456789"], "n": 2})).await;
        assert_eq!(status, 200);
        let indices: Vec<u64> = v["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
        assert_eq!(indices, [0, 1], "n is ignored: one choice per prompt");
        assert_eq!(fake.calls()[0].status, 400);
    }
}
