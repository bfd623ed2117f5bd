//! The LLM client: runs one batch against one OpenAI-compatible server (vLLM, SGLang, llama.cpp's
//! llama-server, TensorRT-LLM, …), and tells request faults from server faults.
//!
//! A batch is split into *call groups* of identical (kind, model, params):
//!
//! - a completions group with `n` ≤ 1 becomes ONE `POST {base}/v1/completions` whose `prompt` is
//!   the list of the group's prompts (OpenAI completions API: `prompt` may be a list of strings).
//!   The answer is accepted only when it demultiplexes exactly (see `demux_completions`): one
//!   choice per prompt with the indices `0 .. prompts` each once (OpenAI's shape: vLLM, SGLang,
//!   current llama-server), or older llama-server builds' JSON *array* of one complete
//!   completion object per prompt. Anything else — a server that ignores `n`, drops or repeats a
//!   choice — and any 4xx request fault or invalid answer of the list call (400, 413, 422, a body
//!   that is not a valid completion) makes the group go again prompt by prompt, so no item ever
//!   gets another's text and only the offending prompt fails. Current llama-server reports `usage` and `timings` of the *first* prompt only
//!   in a list answer (recognised by its top-level `timings`): that usage goes to the first item,
//!   and the endpoint is switched to one call per prompt from then on (see [`LlmClient::infer`]);
//! - a completions group with `n` > 1 goes one prompt per call (the index arithmetic
//!   `prompt × n + j` is where servers disagree);
//! - a chat group becomes one `POST {base}/v1/chat/completions` per item, run concurrently (the chat
//!   API has no list form).
//!
//! Every HTTP call holds one permit of the endpoint's semaphore (`llm.max_concurrency`), passes the
//! endpoint's circuit breaker ([`crate::breaker`]), is classified once by [`classify`] into an
//! [`ErrorKind`] (whose [`Fault`] says whose fault it was), reported to the [`LlmHook`] per attempt,
//! and retried with exponential backoff and full jitter while the kind is
//! [retryable](ErrorKind::retryable), attempts remain and the breaker stays closed. While an
//! endpoint's breaker is open its calls fail fast with [`ErrorKind::Unavailable`] and no HTTP call.
//!
//! **Answered faults and request timeouts are verified.** An HTTP 5xx or an invalid 2xx answer
//! ([`ErrorKind::Server`], [`ErrorKind::InvalidResponse`]) and a request timeout
//! ([`ErrorKind::Timeout`]: the connection was made but the whole answer did not come within
//! `llm.request_timeout`, or HTTP 408) are server faults for the caller (the request is
//! requeued, never answered `ok: false`), but they may be the request's own: a prompt the server
//! cannot handle fails every time, and a prompt with a huge `max_tokens` (or one the server
//! chokes on) outlasts the timeout every time, while every other prompt succeeds. So for the
//! breaker they are faults to verify ([`Outcome::AnsweredFault`], [`Outcome::TimedOut`]): when
//! they trip the breaker's rule, the call that tripped it sends the probe below at once (a
//! *verification*) and waits for it; a failing probe opens the breaker, a passing one discounts
//! them and the breaker stays closed (see [`crate::breaker`]). Refused or broken connections,
//! connections not made within `llm.connect_timeout` (reqwest reports those as connect errors,
//! [`ErrorKind::Connect`]), 401/403/404 and 429 are hard faults and open it without a probe.
//!
//! A server that answers the one-token probe but no real call in time (overloaded, or a
//! `llm.request_timeout` too short for its model) is not given the benefit of the doubt: a
//! passing probe discounts request timeouts only when a real call on the endpoint was answered
//! after the first of them was sent ([`Breaker::probe_passed`]). When none was (calls one after
//! the other with `llm.max_concurrency = 1`, or no other traffic), the probe replays a real call
//! the endpoint answered before (see below): answered within `llm.request_timeout`, it shows
//! the server doing real work in time, so the timeouts were the requests' own and are charged a
//! delivery (a request that outlasts the timeout on its own is dead-lettered after
//! `amqp.delivery_limit`); timed out too, or with no call to replay, the breaker opens and the
//! requests wait for the endpoint, uncharged. An endpoint that has answered no real call yet
//! replays a typical call another endpoint answered (`LlmClient::borrowed_call`).
//!
//! Likewise a server that answers the probe but 5xx or an invalid answer to every real call (an
//! answer none of whose items is valid counts as invalid, as one that does not parse): once
//! answered faults came from [`crate::breaker::DISTINCT_FAULTY_CALLS`] different one-prompt calls
//! on one route (completions or chat: one API of a server can fail while the other works) with
//! no real call of that route answered since, a passing one-token probe is followed by a
//! *replay*: a real call the endpoint answered on that route before is sent again, the one of
//! median answer time among a sample of them (`KnownCalls`: the first 8 answered calls, then
//! every 64th in place of the oldest; each up to [`KNOWN_GOOD_MAX_BYTES`]), and its answer must
//! parse as the real call's did.
//! When that route has such a call to replay, the replay follows every passing probe from the
//! first failing call on (a request's last delivery may come before many calls have failed). If it fails with a server fault, the endpoint counts as down (the breaker opens, and
//! stays open until a probe's replay passes); if it passes, the failures were the prompts' own
//! (poison prompts, however many), they are discounted and their requests charged. Without a
//! call answered before (a server broken since the daemon started, or a daemon started during
//! such an outage), the endpoint counts as down too, and its half-open probes let real calls try
//! it again without charging them: the first that fails reopens the breaker, the first answered
//! ends the doubt and becomes the call to replay.
//!
//! **Refusals are verified.** A 4xx for one prompt (400, 413, 422) is normally that request's
//! fault: it gets an `ok: false` result at once, so a server that refuses *every* request would
//! burn a whole backlog into error results — and some do, from their configuration: vLLM answers
//! 400 to every chat call when the model has no chat template ("As of transformers v4.44, default
//! chat template is no longer allowed…"), a gateway answers 400 to every call for a model it does
//! not route. So the refusal of a one-prompt call counts as the request's own only when the
//! server accepts other requests on that API: a real call on it was answered after the refused
//! one was sent, or else a *minimal* call of that API (`llm.model`, `max_tokens: 1`, the prompt
//! [`PROBE_PROMPT`], for chat as one user message), sent after the refusal, is answered. When
//! the minimal call is refused too, the API refuses every request: the call fails with
//! [`ErrorKind::EndpointConfig`] (a server fault: its request waits, uncharged), the breaker
//! opens at once, the log says so at ERROR with the server's answer, and every probe repeats the
//! API's minimal call until it is answered. When the minimal call fails otherwise (a timeout, a
//! 5xx: the server's front end refuses while its engine hangs), the refusal is a server fault of
//! that kind. Refusals that come together share one minimal call and its verdict; one met while
//! the endpoint's breaker is open is not judged (it goes again once the server is back), nor one
//! whose batch runs out of time first; a list call's refusal goes again prompt by prompt first
//! (one prompt may be the cause).
//! The other way round, a 401/403/404 is the endpoint's fault (a wrong URL, token or
//! `llm.model`) except for a call whose requests name another model than `llm.model`: vLLM
//! answers 404 "The model `…` does not exist." to a request's typo'd model, a gateway 401/403 to
//! a model its key may not use. Such a refusal is judged the same way and, when the minimal call
//! (with `llm.model`) is answered, fails its requests as [`ErrorKind::Rejected`] (`ok: false`,
//! at once, the server's message), without counting against the endpoint; otherwise it stays
//! an endpoint fault.
//!
//! A *hung* server (it accepts connections but never answers) is found by the liveness check
//! below; without it (`llm.liveness_check_after = 0`), or when its HTTP front end answers while its
//! engine is stuck, it times out every call and the probe too, so it still opens the breaker: the probe is limited to
//! min(`llm.request_timeout`, [`PROBE_TIMEOUT_MAX`] = 30 s), so a hung server is seen down at most
//! one probe limit after its calls' timeouts trip the rule: with the defaults 300 s + 30 s after
//! calls start hanging when 5 calls time out in a row (e.g. 5 in flight). A single batch alone
//! meets `llm.max_attempts` timeouts (4 × 300 s plus backoffs with the defaults), then the
//! partition's probe ([`LlmClient::confirm_server_fault`], 30 s more) opens the breaker.
//!
//! **Liveness.** A server that is frozen rather than dead (SIGSTOP, a paused VM or container, a
//! host or network black hole) accepts connections, or lets them hang, and answers nothing, so
//! without a check it would be seen only at the request timeouts above. So while a call waits, once
//! `llm.liveness_check_after` (30 s by default) passed with no answer from its endpoint (no call on
//! it answered meanwhile), the call checks the endpoint's HTTP side: `GET {base}/v1/models`
//! ([`MODELS_PATH`]), limited to min(`llm.liveness_check_after`, [`LIVENESS_TIMEOUT_MAX`]), where
//! any HTTP status counts as an answer (a server busy with long generations still answers it: its
//! HTTP front end does not wait for the model). [`LIVENESS_MISSES`] checks in a row without an answer
//! and the endpoint is found not answering: its breaker opens at once ([`Breaker::trip`]), and this
//! call and every other call waiting on it end with [`ErrorKind::Connect`] (their requests then
//! wait for an endpoint, uncharged, like any outage's); the probe closes the breaker once the
//! server answers again. With the defaults a frozen server is left within about 50 s of its
//! oldest waiting call.
//!
//! **Probing.** Real requests never probe a down endpoint: a request used as a probe would be
//! requeued on failure, and every requeue counts towards its delivery limit. When a breaker opens,
//! the client starts one prober task for that endpoint: once the open time is over it sends a
//! one-token completion (`POST {base}/v1/completions` with `llm.model`, prompt [`PROBE_PROMPT`],
//! `max_tokens: 1`) with the bearer token — the path real calls take, so a server that is up but
//! refuses the token, lacks the model or has a dead engine keeps failing the probe, where
//! `GET /v1/models` would answer 200. A 2xx whose body is a valid one-prompt completion (JSON with
//! a non-empty `choices` list whose choice has a string `text`, as real calls are parsed) closes
//! the breaker (so does, for a server without a completions API — a 401/403/404 there — a valid
//! answer to a minimal chat call: one user message [`PROBE_PROMPT`], `max_tokens: 1`); a 2xx with
//! any other body (HTML from a misconfigured gateway, an `error` object,
//! garbage) and a server-fault class (5xx, 401/403/404, 429, timeout, refused connection) reopen
//! it with a doubled open time; the probe gets min(`llm.request_timeout`, [`PROBE_TIMEOUT_MAX`])
//! (it asks for one token: a healthy server answers it in far less than a real completion); a request fault (400/422: the server is up and judged the probe
//! itself) also closes it, unless the completions API was found refusing every request (see
//! "Refusals are verified": then the probe's refusal keeps it open, and for a chat API found so
//! the probe also sends the minimal chat call, which must be answered). [`LlmClient::available`] is true only while the breaker is closed, so
//! partitions paused on [`LlmClient::wait_available`] resume only after a successful probe. The
//! same probe serves the verification of answered faults and
//! [`LlmClient::confirm_server_fault`].
//! The cancellation token aborts in-flight calls (dropping the request closes the connection) and
//! ends the batch with [`ErrorKind::Cancelled`] for every unfinished item.
//!
//! Logs name endpoints by index and by a credential-free URL, never by the configured URL, and the
//! bearer token only travels in a header marked sensitive.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use serde_json::{Map, Value};
use tokio::sync::watch;

use crate::permits::KeyedPermits;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use url::Url;

use crate::breaker::{Admission, Breaker, BreakerPolicy, BreakerState, Outcome, DISTINCT_FAULTY_CALLS};
use crate::config::LlmSettings;
use crate::request::{Body, ResultChoice, Usage};

/// Path of the OpenAI completions API, appended to each endpoint's base URL.
pub const COMPLETIONS_PATH: &str = "v1/completions";
/// Path of the OpenAI chat completions API, appended to each endpoint's base URL.
pub const CHAT_COMPLETIONS_PATH: &str = "v1/chat/completions";
/// Bounds the "LLM call failed" line: an outage fails every batch's call
/// ([`crate::log_limit`]).
static CALL_FAILED_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();
/// Bounds the "refuses a minimal call of this API" line: every refused request of such a server
/// meets it ([`crate::log_limit`]).
static REFUSING_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();
/// Bounds the probe's "refuses the configured token, URL or model" line: every probe of such an
/// endpoint meets it ([`crate::log_limit`]).
static ENDPOINT_CONFIG_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();
/// Bounds the "retrying its prompts one by one" line ([`crate::log_limit`]).
static LIST_SPLIT_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();
/// The prompt of the half-open probe: a one-token completion (see the module doc, "Probing").
pub const PROBE_PROMPT: &str = "ping";
/// Path of the OpenAI models list, appended to each endpoint's base URL: the liveness check's
/// `GET` (module doc, "Liveness"). vLLM, SGLang, llama-server and OpenAI-compatible gateways serve
/// it from their HTTP front end, without the model's queue.
pub const MODELS_PATH: &str = "v1/models";
/// The longest a liveness check waits for an answer: min(`llm.liveness_check_after`, this).
pub const LIVENESS_TIMEOUT_MAX: Duration = Duration::from_secs(10);
/// Liveness checks in a row without an answer that make an endpoint count as not answering (one
/// lost packet or a slow accept is not a frozen server).
pub const LIVENESS_MISSES: u32 = 2;

/// When a call's frozen-server check ends at the latest: `llm.liveness_check_after` plus
/// [`LIVENESS_MISSES`] checks of min(it, [`LIVENESS_TIMEOUT_MAX`]) each. A call that times out
/// (`llm.request_timeout`) before then is never judged by the check. `None` when the check is off.
pub fn liveness_verdict_after(settings: &LlmSettings) -> Option<Duration> {
    settings.liveness_check_after.map(|after| after + after.min(LIVENESS_TIMEOUT_MAX) * LIVENESS_MISSES)
}
/// Largest body of a real call kept for `LlmClient::probe` to replay (64 KiB).
pub const KNOWN_GOOD_MAX_BYTES: usize = 64 * 1024;
/// How often a call waiting to retry after a server fault checks whether its endpoint's breaker
/// opened meanwhile ([`LlmClient::send_with_retries`]).
const BREAKER_CHECK_DURING_BACKOFF: Duration = Duration::from_millis(100);

/// The longest a probe may take: a probe is limited to min(`llm.request_timeout`, this). A
/// one-token completion answers in far less on a healthy server, even a busy one; a hung server
/// fails it this long after it was sent (not one whole `llm.request_timeout`, 300 s by default).
pub const PROBE_TIMEOUT_MAX: Duration = Duration::from_secs(30);
/// Default cap of one LLM response body, in bytes (64 MiB): far above any completion the batcher
/// asks for, low enough that a broken server cannot exhaust memory.
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
/// How much of an error response body goes into [`LlmError::message`], in characters.
const ERROR_BODY_PREVIEW_CHARS: usize = 300;

/// What the client reports, for metrics: given to the [`LlmHook`] as it happens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LlmEvent<'a> {
    /// One call attempt ended (or failed fast at the breaker, with `seconds` = 0).
    /// `outcome`: `Ok(())` or the error's class; its label is [`call_outcome_label`].
    Call { endpoint: usize, outcome: Result<(), ErrorKind>, seconds: f64 },
    /// A successful answer's token counts: sums of `usage.prompt_tokens` and of the cached tokens
    /// over the answer (0 when not reported).
    Tokens { prompt_tokens: u64, cached_tokens: u64 },
    /// An endpoint's circuit breaker changed state. `name` is the credential-free base URL.
    ///
    /// `reopened`: it went to open again from a failed half-open probe, without having closed (the
    /// same outage; the first opening of an outage has `false`).
    Breaker { endpoint: usize, name: &'a str, state: BreakerState, reopened: bool },
    /// A probe of an endpoint run by a task of its own (the half-open prober, a verification)
    /// panicked; it counted as a failed probe (half-open) or as no verdict (verification).
    ProbePanicked { endpoint: usize },
}

/// The callback that receives every [`LlmEvent`]; called inline, so it must be cheap and must not
/// block (counting a metric is the intended use).
pub type LlmHook = Arc<dyn Fn(&LlmEvent<'_>) + Send + Sync>;

/// The `outcome` label of a call: `ok` or [`ErrorKind::as_str`].
pub fn call_outcome_label(outcome: Result<(), ErrorKind>) -> &'static str {
    match outcome {
        Ok(()) => "ok",
        Err(kind) => kind.as_str(),
    }
}

/// Every value [`call_outcome_label`] can return, for pre-registering metric labels.
pub const CALL_OUTCOME_LABELS: [&str; 10] = [
    "ok",
    "timeout",
    "connect",
    "rate_limited",
    "server",
    "endpoint_config",
    "unavailable",
    "rejected",
    "invalid_response",
    "cancelled",
];

/// What [`LlmClient::with_options`] takes besides the settings.
#[derive(Clone)]
pub struct ClientOptions {
    /// Receives calls, tokens and breaker changes; [`ClientOptions::default`] drops them.
    pub hook: LlmHook,
    /// Larger response bodies fail the call with [`ErrorKind::InvalidResponse`].
    pub max_response_bytes: usize,
    /// The rule of every endpoint's circuit breaker.
    pub breaker: BreakerPolicy,
    /// `amqp.partitions`: the home endpoints of partitions `0..partitions` are balanced
    /// ([`LlmClient::endpoint_ranking`]); 0 (the default) ranks every partition by plain
    /// rendezvous hashing.
    pub partitions: u32,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions { hook: Arc::new(|_| {}), max_response_bytes: MAX_RESPONSE_BYTES, breaker: BreakerPolicy::default(), partitions: 0 }
    }
}

/// A client for a fixed set of OpenAI-compatible endpoints. Cheap to clone (an `Arc` inside);
/// clones share the HTTP connection pool, the per-endpoint concurrency limits and breakers.
#[derive(Clone)]
pub struct LlmClient {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    endpoints: Vec<Endpoint>,
    /// The home endpoint of each partition below [`ClientOptions::partitions`]
    /// ([`crate::keying::assignment`] of the partitions over the endpoints' names).
    homes: Vec<usize>,
    /// `llm.model`: sent when an item names no model.
    model: String,
    max_attempts: u32,
    backoff_initial: Duration,
    backoff_max: Duration,
    /// `llm.list_prompts`: a completions group goes as one list-prompt call (else one call per
    /// prompt, in order, under one permit).
    list_prompts: bool,
    /// The time limit of a probe: min(`llm.request_timeout`, [`PROBE_TIMEOUT_MAX`]).
    probe_timeout: Duration,
    /// `llm.request_timeout`: what a call may take, for [`LlmClient::infer_within`]'s budget.
    request_timeout: Duration,
    max_response_bytes: usize,
    /// `llm.liveness_check_after` (`None`: never checked).
    liveness_after: Option<Duration>,
    /// Bumped by [`LlmClient::check_liveness_now`]: the waiting calls check their endpoints at once.
    check_now: watch::Sender<()>,
    /// Bumped at each change of the permits of any endpoint ([`LlmClient::call_slots_changed`]).
    slots_changed: Arc<watch::Sender<u64>>,
    hook: LlmHook,
}

/// `(item index, result)` for each member of a call group.
type ItemResults = Vec<(usize, Result<Completion, LlmError>)>;

/// One group's calls, boxed so list, sequential and chat calls run side by side.
type CallFuture<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ItemResults> + Send + 'a>>;

struct Endpoint {
    /// The base URL without userinfo, query or fragment: the HRW member name and the only form that
    /// is ever logged, so rotating a password in the URL moves no partition and leaks nothing.
    name: String,
    completions: Url,
    chat: Url,
    /// `llm.max_concurrency` permits; one HTTP call (not one item) holds one permit. Handed out
    /// continuation first ([`crate::permits`]).
    permits: KeyedPermits,
    /// Set once the endpoint answered a list prompt llama.cpp-style, with the usage of its first
    /// prompt only: completions groups then go as one call per prompt, so every item gets its own
    /// exact usage and the cached-token metrics stay true.
    per_prompt_calls: AtomicBool,
    breaker: Mutex<Breaker>,
    /// Per route ([`CallKind::route`]: completions, chat), a sample of the real calls this
    /// endpoint answered on it ([`KnownCalls`]): one of them is replayed by [`LlmClient::probe`]
    /// when the one-token probe passes while different real calls on that route keep failing
    /// ([`Breaker::unrepresented_routes`]), or while request timeouts wait to be judged
    /// ([`Breaker::timeouts_unanswered`]).
    known_good: Mutex<[KnownCalls; ROUTES]>,
    /// Per route, what tells a refusal of the request from a refusal of every request
    /// ([`LlmClient::judge_refusal`]).
    routes: Mutex<[RouteHealth; ROUTES]>,
    /// Held while a refusal check runs on this endpoint: refusals that come together share one
    /// check.
    refusal_check: tokio::sync::Mutex<()>,
    /// The last server fault seen on the endpoint (a call's, a probe's or a check's): its class
    /// and detail, named by the line that logs the breaker's opening.
    last_fault: Mutex<Option<(ErrorKind, String)>>,
    /// A prober task ([`probe_until_closed`]) runs for this endpoint.
    probing: AtomicBool,
    /// The last probe made by [`LlmClient::confirm_server_fault`]: when it ended and its outcome.
    /// Held while that probe runs, so the partitions whose batches failed meanwhile wait for it
    /// and share its verdict instead of each sending a probe (and a replay, up to
    /// `llm.request_timeout` long) of their own to a server that may be struggling.
    last_check: tokio::sync::Mutex<Option<(Instant, Outcome)>>,
    /// Bumped on every admission or outcome that may change [`Breaker::available`], so waiters
    /// re-check it.
    changed: watch::Sender<()>,
    /// `GET` target of the liveness check ([`MODELS_PATH`]).
    models: Url,
    /// When the endpoint last gave any HTTP answer (a call's, of any status, or a liveness check's).
    last_answer: Mutex<Option<Instant>>,
    /// How many times the endpoint was found not answering ([`LlmClient::stopped_answering`]);
    /// the calls waiting on it then end too.
    found_hung: AtomicU64,
    /// One permit: the calls of requests suspected of taking the server down go one at a time
    /// ([`LlmClient::isolated_call_permit`]).
    isolation: tokio::sync::Semaphore,
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
    /// The prefix key the batch was formed by (its 64-bit hash), or `None`. Calls of the same key
    /// get the endpoint's permits one after another ([`crate::permits`]); no other effect.
    pub prefix_key: Option<u64>,
}

/// Receives `(item index, answer)` for the items of a batch that get their final answer while
/// other calls of the batch still run: the other prompts of a sequence that a slow prompt's
/// retries follow, the chat calls that end before the slowest one
/// ([`LlmClient::infer_answering_early`]). A final answer is a completion or a refusal of the
/// request itself ([`Fault::Request`], judged already); a server fault never is (the caller
/// decides whether it goes again). An item may be given more than once; its answer is also in
/// the batch's results.
pub type EarlyAnswers<'a> = &'a (dyn Fn(usize, &Result<Completion, LlmError>) + Sync);

/// The successful result of one item.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Completions: the generated text as a JSON string (`choices[i].text`). Chat: the assistant
    /// message object exactly as the server returned it (`choices[0].message`, with `role`,
    /// `content` and possibly `tool_calls`). Of the first choice in index order when the server
    /// returned several for the prompt (`n` > 1 in params).
    pub output: Value,
    /// The choice's `logprobs` as the server returned it, when not absent or `null`.
    pub logprobs: Option<Value>,
    /// Every choice the server returned for the prompt, in index order, when it returned more
    /// than one (`n` > 1 in params); `None` for one.
    pub choices: Option<Vec<ResultChoice>>,
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
    /// How long the call that served this item waited for one of the endpoint's
    /// `llm.max_concurrency` permits, all its attempts together (for a batch sent prompt by
    /// prompt under one permit: that permit's wait). Not part of the HTTP time.
    pub permit_wait: Duration,
}

/// Why an item failed. The same error is given to every item of the failed HTTP call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct LlmError {
    /// The class, decided once by [`classify`]; drives retries, requeueing and the metric label.
    pub kind: ErrorKind,
    /// Human-readable detail (for an HTTP error: the status and the start of the body). Never
    /// contains the endpoint URL or the token.
    pub message: String,
    /// The HTTP status, when the server answered.
    pub status: Option<u16>,
    /// Whether an attempt of the call lost the server during the call: its connection was
    /// closed or reset after it was made, before the whole answer came, or a gateway answered
    /// 502 or 504 (its upstream went away). Not for a refused connection or a timeout. What a
    /// server that crashes on a prompt does to the call carrying it (`crate::partition` counts
    /// such calls when the endpoint then proves down).
    pub connection_lost: bool,
}

impl LlmError {
    /// An error of `kind` with `message` and the answer's HTTP `status`, if any; not
    /// [`Self::connection_lost`].
    pub fn new(kind: ErrorKind, message: impl Into<String>, status: Option<u16>) -> Self {
        LlmError { kind, message: message.into(), status, connection_lost: false }
    }

    /// The error of a failed HTTP exchange (`status`: of the answer whose body failed).
    fn transport(e: reqwest::Error, status: Option<u16>) -> Self {
        let kind = classify(Problem::Transport(&e));
        let connection_lost = kind == ErrorKind::Connect && !e.is_connect();
        LlmError { connection_lost, ..LlmError::new(kind, transport_message(e), status) }
    }

    fn cancelled() -> Self {
        LlmError::new(ErrorKind::Cancelled, "the batch was cancelled (lease lost or shutdown)", None)
    }

    /// A prompt that was not sent: less than `llm.request_timeout` was left before its batch's
    /// deadline ([`LlmClient::infer_within`]), used by the prompts before it or the wait for an
    /// endpoint permit.
    fn not_sent() -> Self {
        LlmError::new(
            ErrorKind::Cancelled,
            "not sent: the prompts before it or the wait for an LLM permit used its batch's time (less than llm.request_timeout was left)",
            None,
        )
    }

    fn invalid(message: impl Into<String>) -> Self {
        LlmError::new(ErrorKind::InvalidResponse, message, None)
    }

    fn unavailable(name: &str) -> Self {
        let message = format!("the circuit breaker of LLM endpoint {name} is open; no call was made");
        LlmError::new(ErrorKind::Unavailable, message, None)
    }

    /// Whose fault the failure is: see [`ErrorKind::fault`].
    pub fn fault(&self) -> Fault {
        self.kind.fault()
    }

    /// Whether the endpoint (not the request) failed: the request should be requeued, not
    /// answered with `ok: false`.
    pub fn is_server_fault(&self) -> bool {
        self.kind.is_server_fault()
    }
}

/// Whose fault a failure is; the caller's policy follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The request itself was refused (a 4xx for it alone): answer it with `ok: false`.
    Request,
    /// The endpoint or its configuration failed, or the server answered with a 5xx or an invalid
    /// answer: requeue the request. Whether it is charged a delivery is decided by
    /// [`LlmClient::confirm_server_fault`]: not while the endpoint is down (then pause intake
    /// until [`LlmClient::wait_available`] returns), yes when the endpoint answers its probe.
    Server,
    /// The batch was cancelled (lease lost, shutdown): neither answer nor count the request.
    Cancelled,
}

/// The closed set of failure classes. [`ErrorKind::as_str`] is the `kind` of the result's `error`
/// object and the `outcome` label of `prefix_batcher_llm_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Server fault: the connection was made but `llm.request_timeout` elapsed before the whole
    /// answer came, or the server answered 408. Verified like [`ErrorKind::Server`]: it may be
    /// this prompt's own (a huge `max_tokens`, a prompt the server chokes on), so the breaker
    /// counts it only once its probe confirms it (a hung server's probe times out too), and a
    /// request that keeps timing out while the probe passes is charged a delivery each time.
    Timeout,
    /// Server fault: the connection could not be made (refused, or not within
    /// `llm.connect_timeout`) or broke mid-call (reset). A hard fault.
    Connect,
    /// Server fault: HTTP 429; `Retry-After` (seconds) is honoured, capped at `llm.backoff_max`.
    RateLimited,
    /// Server fault: HTTP 5xx. An *answered* fault: it may be this prompt's own (llama-server
    /// answers 500 "Failed to parse tools" to a malformed `tools` param), so the breaker counts
    /// it only once its probe confirms it (module doc, "Answered faults are verified"), and a
    /// request that keeps meeting it while the probe passes is charged a delivery each time.
    Server,
    /// Server fault: HTTP 401, 403 or 404, or an unfollowed 3xx — a wrong token, URL or model,
    /// which every request would meet (not when only the request's own model is refused: then
    /// [`ErrorKind::Rejected`]); a 4xx refusal that a minimal call of the same API meets too
    /// (module doc, "Refusals are verified"); or an invalid configuration at [`LlmClient::new`].
    EndpointConfig,
    /// Server fault: the endpoint's circuit breaker is open; the call failed fast, no HTTP call.
    Unavailable,
    /// Request fault: HTTP 400, 413, 422 or another 4xx for this prompt alone, or a request that
    /// could not be built. A one-prompt call's refusal is judged first (module doc, "Refusals are
    /// verified"): when the server refuses a minimal call of the same API too, the call fails with
    /// [`ErrorKind::EndpointConfig`] instead.
    Rejected,
    /// Server fault, answered like [`ErrorKind::Server`]: a 2xx whose body is not JSON, not the
    /// expected shape, larger than the response limit, an `error` object, or a choice with
    /// `finish_reason: "error"`; or, in a list answer, no valid choice for this item. A server
    /// that answers everything so (a misconfigured gateway's HTML) also fails the probe, which
    /// validates its answer: the breaker opens and the requests wait, uncharged. One malformed
    /// answer while the probe passes is charged to its request (requeue; the delivery limit
    /// bounds it), never turned into an `ok: false` result at once. A list call's invalid answer
    /// makes its group go again prompt by prompt (a server that cannot demultiplex a list).
    InvalidResponse,
    /// The batch's cancellation token fired before the item finished.
    Cancelled,
}

impl ErrorKind {
    /// Every kind, for docs and tests (metric labels: [`CALL_OUTCOME_LABELS`]).
    pub const ALL: [ErrorKind; 9] = [
        ErrorKind::Timeout,
        ErrorKind::Connect,
        ErrorKind::RateLimited,
        ErrorKind::Server,
        ErrorKind::EndpointConfig,
        ErrorKind::Unavailable,
        ErrorKind::Rejected,
        ErrorKind::InvalidResponse,
        ErrorKind::Cancelled,
    ];

    /// The stable machine-readable name: `timeout`, `connect`, `rate_limited`, `server`,
    /// `endpoint_config`, `unavailable`, `rejected`, `invalid_response`, `cancelled`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ErrorKind::Timeout => "timeout",
            ErrorKind::Connect => "connect",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::Server => "server",
            ErrorKind::EndpointConfig => "endpoint_config",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Rejected => "rejected",
            ErrorKind::InvalidResponse => "invalid_response",
            ErrorKind::Cancelled => "cancelled",
        }
    }

    /// Whose fault this class is (DESIGN §5, "Request faults and server faults differ").
    pub fn fault(&self) -> Fault {
        match self {
            ErrorKind::Timeout
            | ErrorKind::Connect
            | ErrorKind::RateLimited
            | ErrorKind::Server
            | ErrorKind::EndpointConfig
            | ErrorKind::Unavailable
            | ErrorKind::InvalidResponse => Fault::Server,
            ErrorKind::Rejected => Fault::Request,
            ErrorKind::Cancelled => Fault::Cancelled,
        }
    }

    /// Whether the server answered, so the fault may be the request's own: a 5xx or an invalid
    /// 2xx answer. The breaker counts these only once a probe confirms them.
    pub fn is_answered_fault(&self) -> bool {
        matches!(self, ErrorKind::Server | ErrorKind::InvalidResponse)
    }

    /// Whether the breaker verifies this server fault with a probe before opening, because it
    /// may be the request's own: an answered fault, or a request timeout.
    pub fn is_verified_fault(&self) -> bool {
        self.is_answered_fault() || *self == ErrorKind::Timeout
    }

    /// Whether a failed list-prompt call goes again prompt by prompt: a 4xx refusal or an invalid
    /// answer, which one prompt may cause (or which a server that cannot demultiplex gives).
    fn splits_list(&self) -> bool {
        matches!(self, ErrorKind::Rejected | ErrorKind::InvalidResponse)
    }

    /// Shorthand for `fault() == Fault::Server`.
    pub fn is_server_fault(&self) -> bool {
        self.fault() == Fault::Server
    }

    /// Whether another attempt at once may succeed: timeouts, connection errors, 429, 5xx and
    /// invalid answers. Not: a refused request (the server will refuse it again), a wrong
    /// endpoint configuration, an open breaker, a cancelled batch.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            ErrorKind::Timeout | ErrorKind::Connect | ErrorKind::RateLimited | ErrorKind::Server | ErrorKind::InvalidResponse
        )
    }

    /// How the breaker sees a call that failed with this kind.
    fn breaker_outcome(&self) -> Outcome {
        match self.fault() {
            Fault::Request => Outcome::RequestFault,
            Fault::Server if *self == ErrorKind::Timeout => Outcome::TimedOut,
            Fault::Server if self.is_answered_fault() => Outcome::AnsweredFault,
            Fault::Server => Outcome::ServerFault,
            Fault::Cancelled => Outcome::Abandoned,
        }
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
    /// A 2xx answer whose body is not JSON, lacks the fields the OpenAI API promises, carries an
    /// error, does not demultiplex, or is larger than the limit.
    InvalidBody,
}

/// The one place that maps a failure to an [`ErrorKind`]; retry policy, requeueing, the breaker
/// and metric labels use its answer, never message text.
///
/// Statuses: 408 → `Timeout`, 429 → `RateLimited`, 5xx → `Server`, 401/403/404 and 3xx (redirects
/// are not followed: a POST to a moved API is a configuration error) → `EndpointConfig`, any other
/// (400, 413, 422, …) → `Rejected`. Transport errors: connect errors (refused, unreachable, or
/// `llm.connect_timeout` elapsed: reqwest reports a connect timeout as both `is_connect()` and
/// `is_timeout()`, and it is a connect failure, a hard fault) → `Connect`; other timeouts
/// (`llm.request_timeout` elapsed, while waiting for the answer or reading its body; also while
/// still connecting when `llm.connect_timeout` ≥ `llm.request_timeout`) → `Timeout`; decode errors → `InvalidResponse`, builder errors → `Rejected`, anything else
/// (reset, broken body) → `Connect`.
pub fn classify(problem: Problem<'_>) -> ErrorKind {
    match problem {
        Problem::Status(408) => ErrorKind::Timeout,
        Problem::Status(429) => ErrorKind::RateLimited,
        Problem::Status(s) if (500..600).contains(&s) => ErrorKind::Server,
        Problem::Status(401 | 403 | 404) => ErrorKind::EndpointConfig,
        Problem::Status(s) if (300..400).contains(&s) => ErrorKind::EndpointConfig,
        Problem::Status(_) => ErrorKind::Rejected,
        Problem::InvalidBody => ErrorKind::InvalidResponse,
        Problem::Transport(e) if e.is_connect() => ErrorKind::Connect,
        Problem::Transport(e) if e.is_timeout() => ErrorKind::Timeout,
        Problem::Transport(e) if e.is_decode() => ErrorKind::InvalidResponse,
        Problem::Transport(e) if e.is_builder() => ErrorKind::Rejected,
        Problem::Transport(_) => ErrorKind::Connect,
    }
}

impl LlmClient {
    /// [`LlmClient::with_options`] with [`ClientOptions::default`] (events are dropped).
    pub fn new(settings: &LlmSettings) -> Result<Self, LlmError> {
        Self::with_options(settings, ClientOptions { max_response_bytes: settings.max_response_bytes.get(), ..ClientOptions::default() })
    }

    /// Builds the client: one HTTP connection pool with `llm.connect_timeout` and
    /// `llm.request_timeout` (whole call, body included), a default `Authorization: Bearer …`
    /// header (marked sensitive) when `llm.api_key` is set, and per endpoint one semaphore of
    /// `llm.max_concurrency` permits and one closed circuit breaker.
    ///
    /// Errors (kind [`ErrorKind::EndpointConfig`]): no endpoints, an endpoint that is not plain
    /// `http` or `https`, unreadable TLS files, a token that is not a valid header value, or an HTTP client
    /// that cannot be built.
    pub fn with_options(settings: &LlmSettings, options: ClientOptions) -> Result<Self, LlmError> {
        let config_error = |m: String| LlmError::new(ErrorKind::EndpointConfig, m, None);
        if settings.endpoints.is_empty() {
            return Err(config_error("llm.endpoints is empty".into()));
        }
        let mut endpoints = Vec::with_capacity(settings.endpoints.len());
        for (i, base) in settings.endpoints.iter().enumerate() {
            endpoints.push(Endpoint::new(i, base, settings, options.breaker).map_err(config_error)?);
        }
        let mut headers = HeaderMap::new();
        if let Some(key) = &settings.api_key {
            mask_token(key.expose());
            let mut value = HeaderValue::from_str(&format!("Bearer {}", key.expose()))
                .map_err(|_| config_error("llm.api_key is not a valid HTTP header value".into()))?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        crate::tls::install_crypto_provider();
        let mut builder = reqwest::Client::builder()
            .default_headers(headers)
            .connect_timeout(settings.connect_timeout)
            .timeout(settings.request_timeout)
            .redirect(reqwest::redirect::Policy::none());
        // https:// endpoints: the CA bundle replaces the system roots; the client certificate
        // and key, when set, authenticate the daemon (mutual TLS).
        if let Some(pem) = &settings.tls.ca_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| config_error(format!("llm.tls_ca_file: {}", e.without_url())))?;
            builder = builder.tls_certs_only(certs);
        }
        if let Some(c) = &settings.tls.client {
            let identity = reqwest::Identity::from_pem(&[c.cert_pem.as_slice(), b"\n", c.key_pem.as_slice()].concat())
                .map_err(|e| config_error(format!("llm.tls_cert_file / llm.tls_key_file: {}", e.without_url())))?;
            builder = builder.identity(identity);
        }
        let http = builder.build().map_err(|e| config_error(format!("cannot build the HTTP client: {}", e.without_url())))?;
        let names: Vec<&str> = endpoints.iter().map(|e| e.name.as_str()).collect();
        let homes = crate::keying::assignment(options.partitions, &names).into_iter().map(|h| h.unwrap_or(0)).collect();
        let slots_changed = Arc::new(watch::Sender::new(0));
        for ep in &endpoints {
            ep.permits.signal_changes(slots_changed.clone());
        }
        Ok(LlmClient {
            inner: Arc::new(Inner {
                http,
                endpoints,
                homes,
                model: settings.model.clone(),
                max_attempts: settings.max_attempts.get(),
                backoff_initial: settings.backoff_initial,
                backoff_max: settings.backoff_max,
                list_prompts: settings.list_prompts,
                probe_timeout: settings.request_timeout.min(PROBE_TIMEOUT_MAX),
                request_timeout: settings.request_timeout,
                max_response_bytes: options.max_response_bytes,
                liveness_after: settings.liveness_check_after,
                check_now: watch::Sender::new(()),
                slots_changed,
                hook: options.hook,
            }),
        })
    }

    /// How many endpoints (`llm.endpoints`) this client calls.
    pub fn endpoint_count(&self) -> usize {
        self.inner.endpoints.len()
    }

    /// The credential-free base URL of endpoint `index`, for logs and status output.
    pub fn endpoint_name(&self, index: usize) -> Option<&str> {
        self.inner.endpoints.get(index).map(|e| e.name.as_str())
    }

    /// The endpoints a partition tries, in order. The first is the partition's home, so a prefix
    /// sticks to one server's cache: below [`ClientOptions::partitions`], the home given by
    /// rendezvous hashing with bounded loads ([`crate::keying::assignment`] of the partitions
    /// over the endpoints' credential-free base URLs), so N endpoints are the homes of ⌊P/N⌋ or
    /// ⌈P/N⌉ partitions each; plain rendezvous hashing gives each a binomial count instead (12 of
    /// 16 partitions on one of two servers happens in 1 deployment of 13). The others follow in
    /// rendezvous (HRW) order ([`crate::keying::hrw_score`] of the partition number, ties as in
    /// [`crate::keying::hrw_pick`]). Every instance with the same endpoints computes the same
    /// order, and adding or removing a server moves few partitions (1.2–1.5 × the 1/N minimum).
    pub fn endpoint_ranking(&self, partition: u32) -> Vec<usize> {
        let names: Vec<&str> = self.inner.endpoints.iter().map(|e| e.name.as_str()).collect();
        let mut order: Vec<usize> = (0..names.len()).collect();
        let score = |i: usize| crate::keying::hrw_score(u64::from(partition), names[i]);
        order.sort_by(|&a, &b| score(b).cmp(&score(a)).then_with(|| names[a].cmp(names[b])));
        if let Some(&home) = self.inner.homes.get(partition as usize) {
            order.retain(|&i| i != home);
            order.insert(0, home);
        }
        order
    }

    /// The endpoint serving a partition now: the first [available](Self::available) endpoint in
    /// [`Self::endpoint_ranking`] order (the home endpoint while its breaker lets calls through,
    /// else the next healthy one), or the home endpoint when none is available.
    pub fn endpoint_for(&self, partition: u32) -> usize {
        let order = self.endpoint_ranking(partition);
        order.iter().copied().find(|&i| self.available(i)).unwrap_or(order[0])
    }

    /// Whether a call to `endpoint` would be let through now: its breaker is closed, or its open
    /// time is over and no probe is in flight. False for an unknown index.
    pub fn available(&self, endpoint: usize) -> bool {
        self.inner.endpoints.get(endpoint).is_some_and(|ep| lock(&ep.breaker).available(Instant::now()))
    }

    /// Whether a call to `endpoint` would start at once: one of its `llm.max_concurrency`
    /// permits is free. False for an unknown index.
    pub fn call_slot_free(&self, endpoint: usize) -> bool {
        self.inner.endpoints.get(endpoint).is_some_and(|ep| ep.permits.available() > 0)
    }

    /// Whether a call to `endpoint` waits for a permit with a prefix key that satisfies `of`.
    /// False for an unknown index.
    pub fn call_waiting(&self, endpoint: usize, of: impl Fn(u64) -> bool) -> bool {
        self.inner.endpoints.get(endpoint).is_some_and(|ep| ep.permits.has_waiter(of))
    }

    /// A receiver whose value changes each time a permit of any endpoint is handed to a waiting
    /// call or becomes free, or a waiting call leaves without one: a batcher that holds back
    /// partial batches while [`Self::call_slot_free`] is false waits on it
    /// ([`crate::batcher::CallSlots`]).
    pub fn call_slots_changed(&self) -> watch::Receiver<u64> {
        self.inner.slots_changed.subscribe()
    }

    /// Whether any endpoint is [available](Self::available) (for `/readyz`).
    pub fn any_available(&self) -> bool {
        (0..self.inner.endpoints.len()).any(|i| self.available(i))
    }

    /// How long every endpoint has been down without a break (each breaker open or half-open
    /// since [`crate::breaker::Breaker::down_since`]): the time since the last of them went down;
    /// `None` while any endpoint is available.
    pub fn all_down_for(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut latest: Option<Instant> = None;
        for ep in self.inner.endpoints.iter() {
            let since = lock(&ep.breaker).down_since()?;
            latest = Some(latest.map_or(since, |l| l.max(since)));
        }
        latest.map(|t| now.saturating_duration_since(t))
    }

    /// The state of `endpoint`'s breaker (an open breaker whose open time is over reports
    /// half-open); `None` for an unknown index.
    pub fn breaker_state(&self, endpoint: usize) -> Option<BreakerState> {
        self.inner.endpoints.get(endpoint).map(|ep| lock(&ep.breaker).state(Instant::now()))
    }

    /// Waits until `endpoint` is [available](Self::available) (its breaker closed after a
    /// successful probe): returns `true` then, `false` when `cancel` fires first or the index is
    /// unknown. Wakes on every breaker change, so a partition can pause intake while its endpoint
    /// is down.
    pub async fn wait_available(&self, endpoint: usize, cancel: &CancellationToken) -> bool {
        let Some(ep) = self.inner.endpoints.get(endpoint) else { return false };
        let mut changed = ep.changed.subscribe();
        loop {
            changed.borrow_and_update();
            if lock(&ep.breaker).available(Instant::now()) {
                return true;
            }
            tokio::select! {
                _ = cancel.cancelled() => return false,
                r = changed.changed() => if r.is_err() { return false },
            }
        }
    }

    /// Waits for the isolation lane of `endpoint`: among the calls that hold it, one at a time.
    /// The partitions send the requests that were in flight when endpoints went down, twice
    /// ([`crate::redelivery::note_outage_during_call`]), one call each under it, so when the
    /// server goes down again during such a call, that request is the only suspect of this
    /// instance (other calls go on as usual meanwhile). `None` for an unknown endpoint.
    pub async fn isolated_call_permit(&self, endpoint: usize) -> Option<tokio::sync::SemaphorePermit<'_>> {
        self.inner.endpoints.get(endpoint)?.isolation.acquire().await.ok()
    }

    /// Runs one batch on endpoint `endpoint` (an index below the number of endpoints, usually
    /// [`Self::endpoint_for`]).
    ///
    /// Completions items sharing (model, params) go as one list-prompt call, unless
    /// `llm.list_prompts = false`, `n` > 1, or the endpoint has shown llama-server's merged answer
    /// (usage of the first prompt only): then the group's prompts go one call each, back to back,
    /// under one permit. A list call that fails with a request fault, or whose answer does not
    /// demultiplex exactly, goes again prompt by prompt. Chat items get one call each, run
    /// concurrently within `llm.max_concurrency`.
    ///
    /// Returns exactly one result per item, in item order; never panics and never drops an item.
    /// Every item of a failed HTTP call gets that call's last error (after up to `llm.max_attempts`
    /// attempts, fewer when the breaker opens); while the breaker is open, items fail with
    /// [`ErrorKind::Unavailable`] without a call; when `cancel` fires, in-flight calls are
    /// aborted and every unfinished item gets [`ErrorKind::Cancelled`] at once. An out-of-range
    /// endpoint index fails every item with [`ErrorKind::EndpointConfig`].
    pub async fn infer(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        cancel: &CancellationToken,
    ) -> Vec<Result<Completion, LlmError>> {
        self.infer_within(endpoint, items, cancel, None).await
    }

    /// [`Self::infer`], with every call ending by `deadline`: no attempt starts with less than
    /// `llm.request_timeout` left before it (reqwest's timeout covers a whole attempt, so an
    /// attempt started in time ends in time). A prompt none of whose attempts started, because
    /// the prompts before it in a sequence, or the wait for an endpoint permit, used the time,
    /// gets [`ErrorKind::Cancelled`] with `LlmError::not_sent`'s message (the caller puts it
    /// back in its queue uncharged); one whose later attempt did not start keeps its last
    /// attempt's error. So slow prompts, slow servers and busy permits cannot hold the answers of
    /// the prompts of a batch past what `amqp.consumer_timeout` allows (the partition's deadline
    /// is [`crate::partition`]'s `release_at`).
    ///
    /// Timeouts of calls for several prompts are not retried at once: a list-prompt call that
    /// timed out goes again prompt by prompt, as a refused one does (one prompt's long generation
    /// times out the whole list), and within a sequence a prompt that timed out gets its further
    /// attempts after the other prompts were sent, while the time lasts, instead of making them
    /// wait for its retries. `None`: no limit.
    pub async fn infer_within(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        cancel: &CancellationToken,
        deadline: Option<Instant>,
    ) -> Vec<Result<Completion, LlmError>> {
        self.infer_answering_early(endpoint, items, cancel, deadline, None).await
    }

    /// [`Self::infer_within`], giving `early` each answer that is final while other calls of the
    /// batch still run ([`EarlyAnswers`]), so the caller can publish it without waiting for a
    /// slow prompt's retries (up to `llm.max_attempts` × `llm.request_timeout`). `None`:
    /// the results only.
    pub async fn infer_answering_early(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        cancel: &CancellationToken,
        deadline: Option<Instant>,
        early: Option<EarlyAnswers<'_>>,
    ) -> Vec<Result<Completion, LlmError>> {
        if endpoint >= self.inner.endpoints.len() {
            let e = LlmError::new(ErrorKind::EndpointConfig, format!("no LLM endpoint with index {endpoint}"), None);
            return items.iter().map(|_| Err(e.clone())).collect();
        }
        let per_prompt = !self.inner.list_prompts || self.inner.endpoints[endpoint].per_prompt_calls.load(Ordering::Relaxed);
        let mut calls: Vec<CallFuture<'_>> = Vec::new();
        for group in group_items(items, &self.inner.model) {
            match group.kind {
                CallKind::Completions if per_prompt || group.choices_per_prompt() > 1 => {
                    calls.push(Box::pin(self.run_sequential(endpoint, items, group, cancel, deadline, early)))
                }
                CallKind::Completions => calls.push(Box::pin(self.run_list(endpoint, items, group, cancel, deadline, early))),
                CallKind::Chat => {
                    for &member in &group.members {
                        let single = Group { members: vec![member], ..group.clone() };
                        calls.push(Box::pin(self.run_call(endpoint, items, single, cancel, None, true, deadline)));
                    }
                }
            }
        }
        let mut out: Vec<Option<Result<Completion, LlmError>>> = items.iter().map(|_| None).collect();
        let mut running: futures_util::stream::FuturesUnordered<CallFuture<'_>> = calls.into_iter().collect();
        while let Some(results) = futures_util::StreamExt::next(&mut running).await {
            if !running.is_empty() {
                answer_early(early, &results);
            }
            for (i, result) in results {
                out[i] = Some(result);
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(LlmError::invalid("internal: no result was produced for this item"))))
            .collect()
    }

    /// Whether a call started now ends by `deadline` (at most `llm.request_timeout`); `None`: no
    /// limit.
    fn fits(&self, deadline: Option<Instant>) -> bool {
        deadline.is_none_or(|d| Instant::now() + self.inner.request_timeout <= d)
    }

    /// Completes when a call could no longer end by `deadline` ([`Self::fits`]); never with `None`.
    async fn latest_start(&self, deadline: Option<Instant>) {
        match deadline.and_then(|d| d.checked_sub(self.inner.request_timeout)) {
            Some(at) => tokio::time::sleep_until(at).await,
            None if deadline.is_some() => {}
            None => std::future::pending().await,
        }
    }

    /// A completions group as one list-prompt call; when that call fails with a request fault (one
    /// prompt too long), an invalid answer (one that does not demultiplex exactly) or a request
    /// timeout while the endpoint stays available (one prompt's long generation), the group goes
    /// again prompt by prompt so only the offending prompts fail. `deadline`: see
    /// [`Self::infer_within`].
    async fn run_list(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        group: Group<'_>,
        cancel: &CancellationToken,
        deadline: Option<Instant>,
        early: Option<EarlyAnswers<'_>>,
    ) -> ItemResults {
        if group.members.len() == 1 {
            return self.run_call(endpoint, items, group, cancel, None, true, deadline).await;
        }
        let results = self.run_call(endpoint, items, group.clone(), cancel, None, false, deadline).await;
        let splits = |e: &&LlmError| e.kind.splits_list() || (e.kind == ErrorKind::Timeout && self.available(endpoint));
        let request_fault = results.iter().find_map(|(_, r)| r.as_ref().err().filter(splits));
        // A failed call gives all members the same error; a parsed answer with bad items does not.
        let whole_call_failed = results.iter().all(|(_, r)| r.is_err());
        match request_fault {
            // A refusal of the group's model (judged already) is every prompt's.
            Some(e) if whole_call_failed && !is_model_refusal(e.status) => {
                // Bounded: a server that cannot demultiplex a list does this on every batch.
                crate::info_limited!(
                    LIST_SPLIT_LOG,
                    endpoint,
                    items = group.members.len(),
                    kind = e.kind.as_str(),
                    status = e.status,
                    "the list-prompt call was refused, answered invalidly or timed out; retrying its prompts one by one"
                );
                self.run_sequential(endpoint, items, group, cancel, deadline, early).await
            }
            _ => results,
        }
    }

    /// A completions group as one call per prompt, in order, under ONE permit of the endpoint:
    /// the prompts of a batch reach the server back to back, so a server with per-slot caches
    /// (llama-server) serves them from the slot that holds their shared prefix instead of
    /// spreading them over cold slots or interleaving them with other batches. With several
    /// prompts, a prompt whose call timed out is retried after the others (rounds of one attempt
    /// each, up to `llm.max_attempts` per prompt). No call starts that could not end by
    /// `deadline`, counted with the wait for the permit: a prompt not sent by then gets
    /// [`LlmError::not_sent`] ([`Self::infer_within`]). Each completion followed by more calls
    /// of the sequence goes to `early` as it comes.
    async fn run_sequential(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        group: Group<'_>,
        cancel: &CancellationToken,
        deadline: Option<Instant>,
        early: Option<EarlyAnswers<'_>>,
    ) -> ItemResults {
        let ep = &self.inner.endpoints[endpoint];
        let asked = Instant::now();
        let none_sent = |e: fn() -> LlmError| group.members.iter().map(|&i| (i, Err(e()))).collect();
        let _permit = tokio::select! {
            biased;
            _ = cancel.cancelled() => return none_sent(LlmError::cancelled),
            () = self.latest_start(deadline) => return none_sent(LlmError::not_sent),
            p = ep.permits.acquire(items[group.members[0]].prefix_key) => p,
        };
        let waited = asked.elapsed();
        let fits = || self.fits(deadline);
        let alone = group.members.len() == 1;
        let is_timeout = |r: &Result<Completion, LlmError>| r.as_ref().is_err_and(|e| e.kind == ErrorKind::Timeout);
        let mut out: ItemResults = Vec::with_capacity(group.members.len());
        // Positions in `out` of the prompts whose call timed out: retried after the others.
        let mut retry = Vec::new();
        for (n, &member) in group.members.iter().enumerate() {
            if !fits() {
                out.push((member, Err(LlmError::not_sent())));
                continue;
            }
            let single = Group { members: vec![member], ..group.clone() };
            let results = self.run_call(endpoint, items, single, cancel, Some(waited), alone, deadline).await;
            if !alone && results.iter().any(|(_, r)| is_timeout(r)) {
                retry.push(out.len());
            }
            if n + 1 < group.members.len() {
                answer_early(early, &results);
            }
            out.extend(results);
        }
        // The last prompt's answer, when retries of the prompts that timed out follow it.
        if !retry.is_empty() {
            answer_early(early, &out[out.len() - 1..]);
        }
        // Rounds of one more attempt each, while attempts (`llm.max_attempts` per prompt) and the
        // time last; a prompt left with its timeout is charged a delivery by the caller.
        let mut attempts = 1;
        while !retry.is_empty() && attempts < self.inner.max_attempts && !cancel.is_cancelled() {
            attempts += 1;
            let mut still = Vec::new();
            for &i in &retry {
                if !fits() {
                    still.clear();
                    break;
                }
                let single = Group { members: vec![out[i].0], ..group.clone() };
                let result = self.run_call(endpoint, items, single, cancel, Some(waited), false, deadline).await.pop().map(|(_, r)| r);
                match result {
                    // The breaker opened meanwhile: the timeout says more than "unavailable", and
                    // the caller finds the endpoint down either way.
                    Some(Err(e)) if e.kind == ErrorKind::Unavailable => {
                        still.clear();
                        break;
                    }
                    Some(r) => {
                        if is_timeout(&r) {
                            still.push(i);
                        }
                        out[i].1 = r;
                        answer_early(early, &out[i..=i]);
                    }
                    None => {}
                }
            }
            retry = still;
        }
        out
    }

    /// One HTTP call (with retries) for `group`; returns `(item index, result)` for every member.
    /// `held`: `Some(its wait)` when the caller already holds an endpoint permit for this call.
    /// `retry_timeouts`: whether a request timeout is retried at once like other server faults (not for a
    /// list call or a prompt of a sequence: see [`Self::infer_within`]). `deadline`: no attempt
    /// starts that could not end by it ([`Self::infer_within`]).
    #[allow(clippy::too_many_arguments)]
    async fn run_call(
        &self,
        endpoint: usize,
        items: &[InferenceItem<'_>],
        group: Group<'_>,
        cancel: &CancellationToken,
        held: Option<Duration>,
        retry_timeouts: bool,
        deadline: Option<Instant>,
    ) -> ItemResults {
        let (permit_held, held_wait) = (held.is_some(), held.unwrap_or_default());
        let ep = &self.inner.endpoints[endpoint];
        let n_members = group.members.len();
        let choices_per_prompt = group.choices_per_prompt();
        let (url, payload) = match request_body(items, &group) {
            Ok(body) => (ep.url(group.kind), body),
            Err(e) => return group.members.iter().map(|&i| (i, Err(e.clone()))).collect(),
        };
        let kind = group.kind;
        let parse = move |v: Value| match kind {
            CallKind::Completions => demux_completions(v, n_members, choices_per_prompt),
            CallKind::Chat => parse_chat(v),
        };
        let prefix_key = group.members.first().and_then(|&i| items[i].prefix_key);
        let call = Call {
            endpoint,
            url,
            payload,
            kind,
            choices_per_prompt,
            n_items: n_members,
            permit_held,
            list: n_members > 1,
            retry_timeouts,
            prefix_key,
            deadline,
            permit_wait_us: AtomicU64::new(0),
            last_sent: Mutex::new(None),
            unreported_seconds: Mutex::new(None),
            model_override: (group.model != self.inner.model).then_some(group.model),
        };
        let (result, attempts) = self.send_with_retries(&call, cancel, parse).await;
        let parsed = match result {
            Ok(parsed) => parsed,
            // A refusal may be every request's, or a request's own model's (module doc,
            // "Refusals are verified").
            Err(e) if call.refusal_to_judge(&e) => {
                let refused = e.kind;
                let e = self.judge_refusal(&call, e, cancel).await;
                let seconds = lock(&call.unreported_seconds).take().unwrap_or_default();
                // A refusal left unjudged (the breaker open, the batch's time out) was still the
                // server's answer to a call made: counted as what the server said, not as a call
                // that failed fast or was never sent.
                let outcome = match e.kind {
                    ErrorKind::Unavailable => refused,
                    ErrorKind::Cancelled if !cancel.is_cancelled() => refused,
                    kind => kind,
                };
                (self.inner.hook)(&LlmEvent::Call { endpoint, outcome: Err(outcome), seconds });
                return group.members.iter().map(|&i| (i, Err(e.clone()))).collect();
            }
            Err(e) if e.kind == ErrorKind::EndpointConfig && e.status.is_some() => {
                self.api_refused(&call, &e);
                return group.members.iter().map(|&i| (i, Err(e.clone()))).collect();
            }
            Err(e) => return group.members.iter().map(|&i| (i, Err(e.clone()))).collect(),
        };
        (self.inner.hook)(&LlmEvent::Tokens { prompt_tokens: parsed.prompt_tokens, cached_tokens: parsed.cached_tokens });
        if parsed.first_prompt_usage_only && !ep.per_prompt_calls.swap(true, Ordering::Relaxed) {
            tracing::info!(
                endpoint,
                name = %ep.name,
                "the LLM server reports usage for the first prompt of a list only (llama-server); \
                 sending one completions call per prompt to this endpoint from now on"
            );
        }
        let permit_wait = held_wait + Duration::from_micros(call.permit_wait_us.load(Ordering::Relaxed));
        let with_attempts = |r: Result<Completion, LlmError>| r.map(|c| Completion { attempts, permit_wait, ..c });
        group.members.iter().zip(parsed.items).map(|(&i, r)| (i, with_attempts(r))).collect()
    }

    /// Sends `call.payload` until it succeeds, fails for good, attempts run out, the breaker stops
    /// letting calls through or `cancel` fires. Returns the parsed answer or the last error, and
    /// the number of HTTP attempts made. A list call returns its first request fault or invalid
    /// answer at once (its caller retries the prompts one by one).
    async fn send_with_retries(
        &self,
        call: &Call<'_>,
        cancel: &CancellationToken,
        parse: impl Fn(Value) -> Result<Parsed, LlmError>,
    ) -> (Result<Parsed, LlmError>, u32) {
        let endpoint = call.endpoint;
        let mut attempt = 0u32;
        let mut last_error: Option<LlmError> = None;
        // Whether an attempt so far lost the server during the call: kept on the error returned
        // (a crashed server's later attempts are refused).
        let mut lost = false;
        loop {
            let outcome = match self.attempt_through_breaker(call, cancel, &parse).await {
                Gate::Cancelled => return (Err(LlmError::cancelled()), attempt),
                // Out of time: the last attempt's error, or "not sent" when none was made.
                Gate::OutOfTime => return (Err(last_error.unwrap_or_else(LlmError::not_sent)), attempt),
                // Fail fast: the last real error says more than "unavailable" when there was one.
                Gate::Closed(e) => return (Err(last_error.unwrap_or(e)), attempt),
                Gate::Attempted(outcome) => outcome,
            };
            attempt += 1;
            let (mut error, retry_after) = match outcome {
                Ok(parsed) => {
                    tracing::debug!(endpoint, attempt, items = call.n_items, "LLM call succeeded");
                    return (Ok(parsed), attempt);
                }
                Err(failure) => failure,
            };
            lost |= error.connection_lost;
            error.connection_lost = lost;
            let stop_for_split = call.list && error.kind.splits_list();
            let breaker_closed = error.is_server_fault() && !self.available(endpoint);
            let timeout_kept = error.kind == ErrorKind::Timeout && !call.retry_timeouts;
            let give_up = stop_for_split || timeout_kept || breaker_closed || !error.kind.retryable() || attempt >= self.inner.max_attempts;
            let delay = (!give_up).then(|| backoff_delay(attempt, retry_after, self.inner.backoff_initial, self.inner.backoff_max));
            // No retry that could not end by the call's deadline ([`Self::infer_within`]).
            let delay = delay.filter(|d| call.deadline.is_none_or(|end| Instant::now() + *d + self.inner.request_timeout <= end));
            let give_up = delay.is_none();
            if !stop_for_split {
                crate::warn_limited!(
                    CALL_FAILED_LOG,
                    endpoint,
                    attempt,
                    items = call.n_items,
                    kind = error.kind.as_str(),
                    status = error.status,
                    delay_ms = delay.map(|d| d.as_millis() as u64),
                    error = %error.message,
                    "LLM call failed; {}",
                    if give_up { "giving its items the error (a server fault requeues them, a request fault answers them)" } else { "retrying" }
                );
            }
            let Some(delay) = delay else { return (Err(error), attempt) };
            let server_fault = error.is_server_fault();
            // A server fault's wait (a 429 or 503 `Retry-After` can be up to `llm.backoff_max`)
            // ends when the endpoint's breaker opens meanwhile: the items then go to another
            // endpoint or wait for this one, as when it was open before the retry.
            let opened = async {
                let mut tick = tokio::time::interval(BREAKER_CHECK_DURING_BACKOFF);
                loop {
                    tick.tick().await;
                    if !self.available(endpoint) {
                        break;
                    }
                }
            };
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return (Err(LlmError::cancelled()), attempt),
                () = opened, if server_fault => {
                    tracing::debug!(endpoint, attempt, "the endpoint's circuit breaker opened while a call waited to retry; giving up on it");
                    return (Err(error), attempt);
                }
                _ = tokio::time::sleep(delay) => {}
            }
            last_error = Some(error);
        }
    }

    /// One attempt: takes a permit (unless held), asks the breaker, makes the HTTP call, reports
    /// its outcome to the breaker and the hook. When faults to verify (answered faults, request
    /// timeouts) made the breaker suspect,
    /// waits for the verification probe ([`Self::verify`]) before returning, so the retry
    /// decision sees its verdict.
    async fn attempt_through_breaker(
        &self,
        call: &Call<'_>,
        cancel: &CancellationToken,
        parse: &impl Fn(Value) -> Result<Parsed, LlmError>,
    ) -> Gate {
        let ep = &self.inner.endpoints[call.endpoint];
        let permit = if call.permit_held {
            None
        } else {
            let asked = Instant::now();
            let permit = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Gate::Cancelled,
                () = self.latest_start(call.deadline) => return Gate::OutOfTime,
                p = ep.permits.acquire(call.prefix_key) => p,
            };
            call.permit_wait_us.fetch_add(asked.elapsed().as_micros().try_into().unwrap_or(u64::MAX), Ordering::Relaxed);
            Some(permit)
        };
        if !self.fits(call.deadline) {
            return Gate::OutOfTime;
        }
        let admission = self.admit(call.endpoint);
        if !admission.allowed() {
            (self.inner.hook)(&LlmEvent::Call { endpoint: call.endpoint, outcome: Err(ErrorKind::Unavailable), seconds: 0.0 });
            return Gate::Closed(LlmError::unavailable(&ep.name));
        }
        let started = Instant::now();
        *lock(&call.last_sent) = Some(started);
        let outcome = tokio::select! {
            biased;
            _ = cancel.cancelled() => None,
            r = self.attempt(call.url, call.payload.clone(), parse) => Some(r),
            e = self.stopped_answering(call.endpoint) => Some(Err((e, None))),
        };
        // An answer none of whose items is valid is an invalid answer, as one that does not parse
        // at all: retried, and counted by the breaker (a server garbling every answer in a
        // well-formed envelope must not pass for a run of poison prompts).
        let outcome = outcome.map(|r| r.and_then(|parsed| match every_item_invalid(&parsed) {
            Some(e) => Err((e, None)),
            None => Ok(parsed),
        }));
        drop(permit);
        if matches!(&outcome, Some(Ok(_))) || matches!(&outcome, Some(Err((e, _))) if e.status.is_some()) {
            *lock(&ep.last_answer) = Some(Instant::now());
        }
        let breaker_outcome = self.record_attempt(call, &outcome, started);
        if breaker_outcome.needs_verification() {
            if let Some(verification) = self.start_verification(call.endpoint) {
                // Not past the call's deadline: the verification goes on in its own task, and
                // the breaker holds its verdict for the next call.
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => {}
                    _ = verification => {}
                    () = crate::task::sleep_until_some(call.deadline) => {}
                }
            }
        }
        match outcome {
            None => Gate::Cancelled,
            Some(r) => Gate::Attempted(r),
        }
    }

    /// Records the `outcome` of an attempt of `call` sent at `started` (`None`: cancelled): the
    /// hook's call event (held back for a refusal still to be judged), and for the endpoint its
    /// breaker, last server fault, last answered call per route and the answered calls kept to
    /// replay. Returns the outcome as the breaker counts it.
    fn record_attempt(&self, call: &Call<'_>, outcome: &Option<Result<Parsed, (LlmError, Option<Duration>)>>, started: Instant) -> Outcome {
        let ep = &self.inner.endpoints[call.endpoint];
        let seconds = started.elapsed().as_secs_f64();
        let model_refused = matches!(outcome, Some(Err((e, _))) if call.model_refusal(e));
        let kind = match outcome {
            None => Err(ErrorKind::Cancelled),
            Some(Ok(_)) => Ok(()),
            // A request fault for the breaker until judged (below).
            Some(Err(_)) if model_refused => Err(ErrorKind::Rejected),
            Some(Err((e, _))) => Err(e.kind),
        };
        if matches!(outcome, Some(Err((e, _))) if call.refusal_to_judge(e)) {
            // Reported once judged ([`Self::run_call`]), with the judged class: a refusal of
            // every request is the endpoint's, not the request's.
            *lock(&call.unreported_seconds) = Some(seconds);
        } else {
            (self.inner.hook)(&LlmEvent::Call { endpoint: call.endpoint, outcome: kind, seconds });
        }
        // A refusal of the request's own model says nothing of the endpoint until judged
        // ([`Self::judge_refusal`], which trips the breaker when it is the endpoint's): a request
        // fault for the breaker, as `kind` says.
        let breaker_outcome = kind.err().map_or(Outcome::Success, |k| k.breaker_outcome());
        if breaker_outcome == Outcome::TimedOut {
            lock(&ep.breaker).timed_out_call_sent(started);
        }
        // Only one-prompt calls: which prompt of a failed list call was at fault is unknown, and
        // the combinations that a few poison requests form in their batches would count as
        // many different calls (a failed list call goes again prompt by prompt anyway).
        if let Some(Err((e, _))) = outcome {
            if e.is_server_fault() && !model_refused {
                *lock(&ep.last_fault) = Some((e.kind, e.message.clone()));
            }
        }
        let route = call.kind.route();
        if breaker_outcome == Outcome::Success {
            lock(&ep.routes)[route].answered = Some(Instant::now());
        }
        if breaker_outcome == Outcome::AnsweredFault && call.n_items == 1 {
            lock(&ep.breaker).answered_fault_call(route, xxhash_rust::xxh3::xxh3_64(&call.payload));
        }
        if breaker_outcome == Outcome::Success && call.payload.len() <= KNOWN_GOOD_MAX_BYTES {
            let mut known = lock(&ep.known_good);
            if known[route].counts_answer() {
                known[route].keep(KnownCall {
                    url: call.url.clone(),
                    payload: call.payload.clone(),
                    kind: call.kind,
                    n_items: call.n_items,
                    choices_per_prompt: call.choices_per_prompt,
                    seconds,
                });
            }
        }
        let changed = lock(&ep.breaker).record_call(breaker_outcome, route, Instant::now());
        self.after_record(call.endpoint, changed, false);
        breaker_outcome
    }

    /// Completes once `endpoint` is found not answering HTTP while a call waits on it (module doc,
    /// "Liveness"), with the error that call ends with ([`ErrorKind::Connect`], a hard server
    /// fault); never while the endpoint answers, nor when `llm.liveness_check_after` is 0. Every
    /// `llm.liveness_check_after` without an answer from the endpoint (no call on it answered
    /// meanwhile) it checks the endpoint ([`Self::answers_http`]); after [`LIVENESS_MISSES`]
    /// checks in a row without an answer it opens the endpoint's breaker ([`Breaker::trip`]) and
    /// ends, and so does every other call waiting on the endpoint.
    async fn stopped_answering(&self, endpoint: usize) -> LlmError {
        let Some(after) = self.inner.liveness_after else { return std::future::pending().await };
        let ep = &self.inner.endpoints[endpoint];
        let mut changed = ep.changed.subscribe();
        let mut check_now = self.inner.check_now.subscribe();
        let seen = ep.found_hung.load(Ordering::Acquire);
        let started = Instant::now();
        let mut next = started + after;
        loop {
            let mut forced = false;
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                r = changed.changed() => {
                    if r.is_err() {
                        return std::future::pending().await;
                    }
                }
                r = check_now.changed() => forced = r.is_ok(),
            }
            if ep.found_hung.load(Ordering::Acquire) != seen {
                return LlmError::new(ErrorKind::Connect, "abandoned: the server stopped answering (found by the liveness check of another call)", None);
            }
            let now = Instant::now();
            if !forced && now < next {
                continue;
            }
            if let Some(answered) = lock(&ep.last_answer).filter(|t| !forced && now.saturating_duration_since(*t) < after) {
                next = answered + after;
                continue;
            }
            let mut misses = Vec::new();
            while misses.len() < LIVENESS_MISSES as usize {
                match self.answers_http(endpoint, after).await {
                    Ok(()) => break,
                    Err(detail) => misses.push(detail),
                }
            }
            if misses.len() < LIVENESS_MISSES as usize {
                next = Instant::now() + after;
                continue;
            }
            let waited = started.elapsed();
            if ep.found_hung.compare_exchange(seen, seen + 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                tracing::warn!(
                    endpoint,
                    name = %ep.name,
                    waited_s = waited.as_secs_f64(),
                    checks = LIVENESS_MISSES,
                    error = %misses.last().map_or("", String::as_str),
                    "the LLM server stopped answering (no HTTP answer to GET {MODELS_PATH}): frozen, paused or hung; its calls are abandoned and \
                     its circuit breaker opens, so their requests wait for an endpoint, not charged a delivery"
                );
                *lock(&ep.last_fault) = Some((ErrorKind::Connect, format!("no HTTP answer to GET {MODELS_PATH}")));
                let changed = lock(&ep.breaker).trip(Instant::now());
                self.after_record(endpoint, changed, false);
                // Wakes the other calls waiting on the endpoint (also when the breaker was not
                // closed, so `trip` changed nothing): they end too.
                ep.changed.send_replace(());
            }
            return LlmError::new(
                ErrorKind::Connect,
                format!(
                    "the server stopped answering: no HTTP answer to GET {MODELS_PATH} in {} checks after the call waited {:.1} s ({})",
                    LIVENESS_MISSES,
                    waited.as_secs_f64(),
                    misses.last().map_or("", String::as_str)
                ),
                None,
            );
        }
    }

    /// Makes every call waiting on an endpoint check it at once (`Self::stopped_answering`),
    /// instead of after `llm.liveness_check_after`: called when a drain starts, so a frozen
    /// server found within the checks' time (at most 2 × 10 s) lets the drain return its requests
    /// uncharged instead of outlasting `shutdown.drain_timeout`. Nothing when the check is off.
    pub fn check_liveness_now(&self) {
        self.inner.check_now.send_replace(());
    }

    /// The liveness check of `endpoint`: `GET {base}/v1/models` ([`MODELS_PATH`]) with the bearer
    /// token, waiting at most min(`after`, [`LIVENESS_TIMEOUT_MAX`]). Any HTTP answer (every
    /// status: a 404 of a server without that path, a 503 of one loading its model) shows the
    /// server's HTTP side running; only no answer at all (no connection, a timeout, a reset) is
    /// an error, with a detail for the log.
    async fn answers_http(&self, endpoint: usize, after: Duration) -> Result<(), String> {
        let ep = &self.inner.endpoints[endpoint];
        match self.inner.http.get(ep.models.clone()).timeout(after.min(LIVENESS_TIMEOUT_MAX)).send().await {
            Ok(_) => {
                *lock(&ep.last_answer) = Some(Instant::now());
                Ok(())
            }
            Err(e) => Err(transport_message(e)),
        }
    }

    /// Asks `endpoint`'s breaker to admit a real call now (only while closed).
    fn admit(&self, endpoint: usize) -> Admission {
        lock(&self.inner.endpoints[endpoint].breaker).admit(Instant::now())
    }

    /// Gives `endpoint`'s breaker a call outcome; reports a state change, and starts the prober
    /// when the breaker opened.
    fn record(&self, endpoint: usize, outcome: Outcome, probe: bool) {
        let changed = lock(&self.inner.endpoints[endpoint].breaker).record(outcome, probe, Instant::now());
        self.after_record(endpoint, changed, probe);
    }

    /// Decides whose fault the server faults of a batch on `endpoint` were, before its requests
    /// are settled: `true` when the endpoint is down (its breaker is open, or it fails a probe now —
    /// the one-token completion of the half-open probe, see the module doc — which then opens the
    /// breaker), so the requests must wait for it instead of being charged a delivery; `false`
    /// when the endpoint answers the probe (or judges it as a request fault), so the fault may be
    /// the requests' own and the delivery limit applies; the breaker then also discounts its
    /// answered faults and request timeouts ([`Breaker::refute`]), so the requests' own 5xx,
    /// invalid answers or timeouts never add up to an opening. An unknown index counts as down.
    ///
    /// This is what keeps an outage's first failures, before the breaker's own rule
    /// ([`BreakerPolicy`]) opens it, from costing the requests deliveries: a server that answers
    /// 401 to everything fails each batch at once, and without this check the same requests would
    /// go round the queue several times in a second.
    ///
    /// Callers that ask while another caller's probe of the endpoint runs wait for it and share
    /// its outcome (a probe that ended after they asked): one probe per burst of failed batches.
    pub async fn confirm_server_fault(&self, endpoint: usize) -> bool {
        if endpoint >= self.inner.endpoints.len() || !self.available(endpoint) {
            return true;
        }
        let asked = Instant::now();
        let outcome = {
            let mut last = self.inner.endpoints[endpoint].last_check.lock().await;
            match *last {
                Some((ended, outcome)) if ended >= asked => outcome,
                _ => {
                    let outcome = self.probe(endpoint, false).await;
                    *last = Some((Instant::now(), outcome));
                    outcome
                }
            }
        };
        // The shared probe's verdict may have opened the breaker already (another caller's
        // check below).
        if !self.available(endpoint) {
            return true;
        }
        if outcome != Outcome::ServerFault {
            let changed = lock(&self.inner.endpoints[endpoint].breaker).probe_passed(Instant::now());
            if changed.is_none() {
                return false;
            }
            self.after_record(endpoint, changed, false);
            return true;
        }
        let changed = lock(&self.inner.endpoints[endpoint].breaker).trip(Instant::now());
        self.after_record(endpoint, changed, false);
        true
    }

    /// Starts the verification probe of `endpoint` when its breaker is suspect and none is in
    /// flight ([`Breaker::take_verification`]); the returned task ends once the verdict is
    /// recorded. A task, not a future of the caller, so a dropped caller cannot leave the
    /// verification slot taken.
    fn start_verification(&self, endpoint: usize) -> Option<tokio::task::JoinHandle<()>> {
        let taken = lock(&self.inner.endpoints[endpoint].breaker).take_verification()?;
        let client = self.clone();
        Some(tokio::spawn(async move { client.verify(endpoint, taken).await }))
    }

    /// The verification probe: answered faults or request timeouts tripped the breaker's rule;
    /// the probe decides
    /// whether the endpoint is down (the breaker opens) or they were the requests' own (they are
    /// discounted, the breaker stays closed).
    async fn verify(&self, endpoint: usize, taken: crate::breaker::Verification) {
        let ep = &self.inner.endpoints[endpoint];
        tracing::info!(
            endpoint,
            name = %ep.name,
            "server faults that may be the requests' own (5xx, invalid answers, request timeouts) tripped the circuit breaker's rule; \
             probing before opening it"
        );
        let outcome = self.probe_guarded(endpoint, false, Outcome::Abandoned).await;
        let changed = lock(&ep.breaker).verified(taken, outcome, Instant::now());
        if changed.is_none() && outcome != Outcome::ServerFault {
            tracing::info!(
                endpoint,
                name = %ep.name,
                "the LLM endpoint answered the probe; its recent 5xx, invalid answers or request timeouts are counted as the requests' own"
            );
        }
        self.after_record(endpoint, changed, false);
    }

    /// Logs and reports a breaker change (see [`Self::record`]), and starts the prober when the
    /// breaker opened.
    fn after_record(&self, endpoint: usize, changed: Option<BreakerState>, probe: bool) {
        let ep = &self.inner.endpoints[endpoint];
        match changed {
            // A failed probe reopens it: the probe's own line (`LLM endpoint probe failed`) says
            // so, and a WARN line per probe of a long outage would only repeat the first.
            Some(BreakerState::Open) if probe => {
                tracing::debug!(endpoint, name = %ep.name, "LLM endpoint circuit breaker reopened after a failed probe")
            }
            Some(BreakerState::Open) => {
                let (kind, error) = lock(&ep.last_fault).clone().map_or(("", String::new()), |(k, e)| (k.as_str(), e));
                tracing::warn!(endpoint, name = %ep.name, kind, error = %error, "LLM endpoint circuit breaker opened; its calls fail fast")
            }
            Some(BreakerState::Closed) => tracing::info!(endpoint, name = %ep.name, "LLM endpoint circuit breaker closed"),
            _ => {}
        }
        if let Some(state) = changed {
            self.breaker_changed(endpoint, state, probe && state == BreakerState::Open);
        } else if probe {
            ep.changed.send_replace(()); // an abandoned probe frees the probe slot
        }
        if changed == Some(BreakerState::Open) && !ep.probing.swap(true, Ordering::AcqRel) {
            tokio::spawn(probe_until_closed(Arc::downgrade(&self.inner), endpoint));
        }
    }

/// [`Self::probe`] of a task of its own (the half-open prober, a verification): a panic is
    /// logged at ERROR, reported ([`LlmEvent::ProbePanicked`]) and taken as
    /// `on_panic`, so that the probe or verification slot it held is given back; a slot kept by a
    /// task that is gone would leave the breaker with no probe ever again.
    async fn probe_guarded(&self, endpoint: usize, half_open: bool, on_panic: Outcome) -> Outcome {
        crate::task::catch_panic(self.probe(endpoint, half_open)).await.unwrap_or_else(|panic| {
            let name = &self.inner.endpoints[endpoint].name;
            tracing::error!(endpoint, name = %name, panic = %panic, outcome = ?on_panic, "the LLM endpoint probe panicked");
            (self.inner.hook)(&LlmEvent::ProbePanicked { endpoint });
            on_panic
        })
    }

    /// The probe of `endpoint` (half-open probe, verification, [`Self::confirm_server_fault`]): a
    /// one-token completion of [`PROBE_PROMPT`] with `llm.model` and the bearer token, limited to
    /// min(`llm.request_timeout`, [`PROBE_TIMEOUT_MAX`]). A 2xx
    /// whose body parses as a valid one-prompt completion (the parser of real calls) is a
    /// success; a 4xx request fault counts as an answer of a healthy server
    /// ([`Outcome::RequestFault`]); everything else — an invalid 2xx body, 5xx, 401/403/404, 429,
    /// timeouts, refused connections — is [`Outcome::ServerFault`]: the endpoint failed a check
    /// that is nobody's request.
    ///
    /// When different real calls keep failing ([`Breaker::probes_unrepresentative`]), or request
    /// timeouts came with no real call answered since ([`Breaker::timeouts_unanswered`]), a passing
    /// one-token call is followed by a replay of a real call the endpoint answered before
    /// ([`Breaker::replay_answered`] when it is answered). Without
    /// one (no real call answered since the daemon started), nothing tells a server that fails
    /// every real call from that many poison prompts, and charging them would dead-letter a whole
    /// backlog after a restart during such an outage: the endpoint counts as down
    /// ([`Outcome::ServerFault`]) and the requests wait, uncharged. The half-open probe
    /// (`half_open`) then closes the breaker for a trial instead: the failing calls stay counted,
    /// so the first real call that fails again reopens it at once, and the first one answered
    /// clears them (and becomes the call to replay).
    ///
    /// An API found refusing every request ([`Self::judge_refusal`]) keeps the probe failing
    /// until its minimal call is answered ([`Self::still_refusing`]).
    async fn probe(&self, endpoint: usize, half_open: bool) -> Outcome {
        let outcome = self.ping(endpoint).await;
        let ep = &self.inner.endpoints[endpoint];
        if let Some(refused) = self.still_refusing(endpoint, outcome).await {
            return refused;
        }
        let (failing, unrepresented, timeouts, timed_out_route) = {
            let breaker = lock(&ep.breaker);
            (breaker.routes_with_faulty_calls(), breaker.unrepresented_routes(), breaker.timeouts_unanswered(), breaker.timed_out_route())
        };
        if outcome != Outcome::Success || (failing.is_empty() && !timeouts) {
            return outcome;
        }
        // The one-token probe passes while real calls on some route failed with none of that
        // route answered since: ask again with a real call this endpoint answered before on that
        // route. From the first such failure, not only after many: a request's last delivery may
        // come before many different calls have failed, and a server-wide fault must not charge
        // it. Without a call to replay, the failures count as the prompts' own until they come
        // from `DISTINCT_FAULTY_CALLS` different calls.
        let known: Vec<Option<KnownCall>> = lock(&ep.known_good).iter().map(KnownCalls::typical).collect();
        let mut replays = Vec::new();
        for route in failing {
            match &known[route] {
                Some(call) => replays.push((route, call.clone())),
                None if unrepresented.contains(&route) => return self.nothing_to_replay(endpoint, half_open),
                None => {}
            }
        }
        // Request timeouts with no real call answered since the first of them was sent: the
        // one-token answer does not show that the server does real work in time (it may be
        // overloaded, or `llm.request_timeout` too short for its model), so a real call it
        // answered before goes again, unless one just did. Answered in time, the timeouts were
        // the requests' own (a request outlasting the timeout on its own, with one permit and no
        // other traffic to answer beside it) and are charged; timed out too, the endpoint is
        // slow for real work and counts as down. With no call to replay, the breaker's rule
        // decides ([`Breaker::probe_passed`]).
        if timeouts && replays.is_empty() {
            // The API of the latest timeout first: chat and completions calls may take different times.
            let latest = timed_out_route.unwrap_or(0);
            let routes: Vec<usize> = std::iter::once(latest).chain((0..ROUTES).filter(|&r| r != latest)).collect();
            let own = routes.iter().find_map(|&route| Some((route, known.get(route)?.clone()?)));
            if let Some(replay) = own.or_else(|| self.borrowed_call(endpoint, &routes)) {
                replays.push(replay);
            }
        }
        for (route, call) in replays {
            let replayed = self.replay(endpoint, &call).await;
            if replayed == Outcome::ServerFault {
                return replayed;
            }
            if matches!(replayed, Outcome::Success | Outcome::RequestFault) {
                lock(&ep.breaker).replay_answered(route, Instant::now());
            }
        }
        Outcome::Success
    }

    /// The part of [`Self::probe`] for the APIs found refusing every request
    /// ([`Self::judge_refusal`]), given the one-token probe's `ping` outcome: each such API's
    /// minimal call goes again (for completions, the one-token probe is that call). `None` when
    /// there is none, or every one is answered now (the API is marked healthy again); otherwise
    /// the outcome the probe reports: [`Outcome::ServerFault`] while a minimal call is still
    /// refused (a 4xx), or the minimal call's (or `ping`'s) own failure.
    async fn still_refusing(&self, endpoint: usize, ping: Outcome) -> Option<Outcome> {
        let ep = &self.inner.endpoints[endpoint];
        let refusing: Vec<CallKind> =
            [CallKind::Completions, CallKind::Chat].into_iter().filter(|k| lock(&ep.routes)[k.route()].refusing).collect();
        if refusing.is_empty() {
            return None;
        }
        if !matches!(ping, Outcome::Success | Outcome::RequestFault) {
            return Some(ping);
        }
        for kind in refusing {
            let result = match kind {
                CallKind::Completions if ping == Outcome::Success => Ok(()),
                CallKind::Completions => Err((ErrorKind::Rejected, "refused the one-token probe".to_owned())),
                CallKind::Chat => self.minimal_call(endpoint, kind).await,
            };
            match result {
                Ok(()) => {
                    lock(&ep.routes)[kind.route()].refusing = false;
                    tracing::info!(endpoint, name = %ep.name, api = kind.api(), "the LLM server answers a minimal call of this API again");
                }
                Err((error_kind, detail)) => {
                    tracing::info!(endpoint, name = %ep.name, api = kind.api(), error = %detail, "the LLM server still refuses a minimal call of this API");
                    *lock(&ep.last_fault) = Some((error_kind, format!("minimal {} call: {detail}", kind.api())));
                    return Some(if error_kind == ErrorKind::Rejected { Outcome::ServerFault } else { fault_outcome(error_kind) });
                }
            }
        }
        if ping == Outcome::RequestFault {
            return Some(ping);
        }
        None
    }

    /// For judging request timeouts on `endpoint` when it has answered no real call yet (its first
    /// calls timed out): a typical call another endpoint of this client answered, on the first
    /// of `routes` that has one, addressed to `endpoint`. The endpoints serve the same traffic,
    /// so a server that answers such a call in time does real work in time; one that does not,
    /// or does not serve its model, counts as down, as without a call to replay.
    fn borrowed_call(&self, endpoint: usize, routes: &[usize]) -> Option<(usize, KnownCall)> {
        let ep = &self.inner.endpoints[endpoint];
        let others = self.inner.endpoints.iter().enumerate().filter(|(i, _)| *i != endpoint);
        let (route, mut call) = routes.iter().find_map(|&route| others.clone().find_map(|(_, other)| Some((route, lock(&other.known_good)[route].typical()?))))?;
        call.url = ep.url(call.kind).clone();
        Some((route, call))
    }

    /// [`Self::probe`] when a route failing different real calls has no answered call to replay.
    fn nothing_to_replay(&self, endpoint: usize, half_open: bool) -> Outcome {
        let ep = &self.inner.endpoints[endpoint];
        if half_open {
            lock(&ep.breaker).close_for_trial();
            tracing::info!(endpoint, name = %ep.name, "the LLM endpoint answers the one-token probe; no real call was answered since the daemon started, so real calls try it again (the first one that fails reopens the breaker)");
            return Outcome::Success;
        }
        tracing::warn!(
            endpoint,
            name = %ep.name,
            different_calls = DISTINCT_FAULTY_CALLS,
            "the LLM endpoint answers the one-token probe, but different real calls all failed and none was answered since the daemon started: treated as down (the requests wait, not charged a delivery)"
        );
        *lock(&ep.last_fault) = Some((ErrorKind::Server, format!("{DISTINCT_FAULTY_CALLS} different real calls failed, none answered since the daemon started")));
        Outcome::ServerFault
    }

    /// Sends a real call the endpoint answered before ([`Endpoint::known_good`]), limited to
    /// `llm.request_timeout`: a 2xx answer that parses as the real call's did, every item valid
    /// ([`KnownCall::check`]), passes; the outcome is classified as for the probe.
    async fn replay(&self, endpoint: usize, call: &KnownCall) -> Outcome {
        let ep = &self.inner.endpoints[endpoint];
        let request = self.inner.http.post(call.url.clone()).header(CONTENT_TYPE, "application/json").body(call.payload.clone());
        let Err((kind, detail)) = self.check_call(request, |bytes| call.check(bytes)).await else {
            tracing::info!(endpoint, name = %ep.name, "the LLM endpoint answered a real call it answered before: its recent failures are the requests' own");
            return Outcome::Success;
        };
        tracing::warn!(
            endpoint,
            name = %ep.name,
            kind = kind.as_str(),
            error = %detail,
            "the LLM endpoint answers the one-token probe but failed a real call it answered before: treated as down"
        );
        *lock(&ep.last_fault) = Some((kind, format!("replayed call: {detail}")));
        fault_outcome(kind)
    }

    /// The one-token probe (see the module doc, "Probing").
    ///
    /// A server without a completions API (a 401/403/404 or 3xx there, [`ErrorKind::EndpointConfig`])
    /// that answers a minimal chat call passes too, while no real completions call met that
    /// refusal: a server or gateway serving only chat would otherwise never close its breaker
    /// once it opened. Once completions requests met it ([`Self::api_refused`]), it fails until
    /// the completions API answers.
    ///
    /// A request fault on the one-token completion (another 4xx: Azure OpenAI answers 400
    /// `OperationNotSupported` to a completions call for a chat deployment) is an answer of a
    /// healthy server only if its chat API agrees: the minimal chat call goes too, and when it
    /// fails with a server fault (5xx, an invalid answer, a timeout), so does the probe. Without
    /// that, a chat-only gateway whose chat backend failed every call would pass every probe, and
    /// the outage would be charged to the requests.
    async fn ping(&self, endpoint: usize) -> Outcome {
        let Err((kind, detail)) = self.minimal_call(endpoint, CallKind::Completions).await else {
            return Outcome::Success;
        };
        let name = &self.inner.endpoints[endpoint].name;
        let completions_refusing = lock(&self.inner.endpoints[endpoint].routes)[CallKind::Completions.route()].refusing;
        let ask_chat = !completions_refusing && (kind.fault() == Fault::Request || kind == ErrorKind::EndpointConfig);
        let chat = if ask_chat { Some(self.minimal_call(endpoint, CallKind::Chat).await) } else { None };
        match chat {
            Some(Ok(())) => {
                tracing::debug!(endpoint, name = %name, error = %detail, "the LLM endpoint refuses the one-token completion but answers a minimal chat call");
                return Outcome::Success;
            }
            Some(Err((chat_kind, chat_detail))) if kind.fault() == Fault::Request && chat_kind.fault() == Fault::Server => {
                tracing::info!(endpoint, name = %name, kind = chat_kind.as_str(), error = %chat_detail, completions = %detail, "LLM endpoint probe failed on its chat API (its completions API refuses the probe)");
                *lock(&self.inner.endpoints[endpoint].last_fault) = Some((chat_kind, format!("probe (chat): {chat_detail}")));
                return Outcome::ServerFault;
            }
            _ => {}
        }
        *lock(&self.inner.endpoints[endpoint].last_fault) = Some((kind, format!("probe: {detail}")));
        if kind == ErrorKind::EndpointConfig {
            // Lasts until an operator acts: a wrong token, URL or model name, or a missing API.
            crate::error_limited!(
                ENDPOINT_CONFIG_LOG,
                endpoint,
                name = %name,
                kind = kind.as_str(),
                error = %detail,
                "LLM endpoint probe failed: the server refuses the configured token, URL or model, or lacks the API (HTTP 401/403/404 or a redirect); \
                 check llm.api_key, llm.endpoints and llm.model against the server's (vLLM: --api-key, --served-model-name)"
            );
        } else {
            tracing::info!(endpoint, name = %name, kind = kind.as_str(), error = %detail, "LLM endpoint probe failed");
        }
        fault_outcome(kind)
    }

    /// A minimal valid call on one API of `endpoint`, with `llm.model`, the bearer token and
    /// `max_tokens: 1`, limited to min(`llm.request_timeout`, [`PROBE_TIMEOUT_MAX`]):
    /// completions with the prompt [`PROBE_PROMPT`] (the one-token probe), or chat with one user
    /// message of it. `Ok` when a 2xx answer parses as a valid one-prompt answer of that API (the
    /// parser of real calls); otherwise the error kind ([`classify`]) and a detail for the log
    /// (with the start of an error answer's body).
    async fn minimal_call(&self, endpoint: usize, kind: CallKind) -> Result<(), (ErrorKind, String)> {
        let ep = &self.inner.endpoints[endpoint];
        let model = &self.inner.model;
        let url = ep.url(kind);
        let body = match kind {
            CallKind::Completions => serde_json::json!({"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1}),
            CallKind::Chat => serde_json::json!({"model": model, "messages": [{"role": "user", "content": PROBE_PROMPT}], "max_tokens": 1}),
        };
        let request = self.inner.http.post(url.clone()).json(&body).timeout(self.inner.probe_timeout);
        self.check_call(request, |bytes| valid_answer(bytes, kind, 1, 1)).await
    }

    /// A real call of `call`'s API got `refusal`, a 401/403/404 or 3xx for the configured model
    /// ([`ErrorKind::EndpointConfig`]: a wrong token, URL or `llm.model`, or a server without
    /// this API, as a gateway serving only chat answers 404 to completions). The API is marked as
    /// refusing every request, so the endpoint counts as down until a probe's minimal call of
    /// this API is answered ([`Self::still_refusing`]); without the mark, a server without a
    /// completions API would pass the probe on its chat API ([`Self::ping`]) and charge every
    /// completions request a delivery. Logged at ERROR when the mark is new.
    fn api_refused(&self, call: &Call<'_>, refusal: &LlmError) {
        let ep = &self.inner.endpoints[call.endpoint];
        let was = std::mem::replace(&mut lock(&ep.routes)[call.kind.route()].refusing, true);
        if !was {
            crate::error_limited!(
                REFUSING_LOG,
                endpoint = call.endpoint,
                name = %ep.name,
                api = call.kind.api(),
                error = %refusal.message,
                "the LLM server refuses calls of this API for the configured token, URL or model, or lacks the API \
                 (HTTP 401/403/404 or a redirect; some gateways serve only chat); check llm.api_key, llm.endpoints and llm.model. \
                 The endpoint counts as down, and its requests wait or go to another endpoint, not charged a delivery, \
                 until a probe's minimal call of this API is answered"
            );
        }
    }

    /// Judges the 4xx refusal of a one-prompt call (module doc, "Refusals are verified"). Returns
    /// `refusal` itself, a request fault, when the server accepts other requests on the call's
    /// API: a real call on it was answered after this one was sent, or a minimal call
    /// ([`Self::minimal_call`]) sent after it was answered. Otherwise a server fault: when the
    /// API refuses the minimal call too (any 4xx), it refuses every request, whatever it holds
    /// (vLLM answers 400 to every chat call when the model has no chat template), so the error is
    /// [`ErrorKind::EndpointConfig`], the endpoint's breaker opens at once ([`Breaker::trip`]) and
    /// stays open until a probe's minimal call on that API is answered ([`Self::probe`]); when the
    /// minimal call fails otherwise (5xx, timeout, refused connection), that failure's kind.
    /// Refusals that come together share one minimal call, and its verdict, whichever it is. A
    /// refusal judged while the endpoint's breaker is open (the server is down, or found faulty,
    /// by then) is not judged: [`ErrorKind::Unavailable`], so its request goes again once the
    /// server is back. `cancel` ends the wait with [`ErrorKind::Cancelled`], and so does the
    /// call's deadline ([`Self::infer_within`]): a request whose refusal could not be judged in
    /// its batch's time goes back uncharged.
    ///
    /// Reported: refusals that came together (a server whose front end still answered 400 to
    /// over-long prompts while its engine hung) were judged one at a time, each with a minimal
    /// call of its own that waited out `llm.probe_timeout`, after the breaker had opened too,
    /// until the batches holding them passed the `amqp.consumer_timeout` guard, which returned
    /// every request of the partition charged a delivery.
    async fn judge_refusal(&self, call: &Call<'_>, refusal: LlmError, cancel: &CancellationToken) -> LlmError {
        let ep = &self.inner.endpoints[call.endpoint];
        let route = call.kind.route();
        let sent = lock(&call.last_sent).unwrap_or_else(Instant::now);
        // The request's own: a model refusal becomes a request fault.
        let own = |refusal: LlmError| match (refusal.kind, call.model_override) {
            (ErrorKind::EndpointConfig, Some(model)) => LlmError::new(
                ErrorKind::Rejected,
                format!("{} (the server refuses this request's model {model:?}; it serves the configured llm.model)", refusal.message),
                refusal.status,
            ),
            _ => refusal,
        };
        let known = || {
            let health = lock(&ep.routes)[route];
            if health.refusing {
                Some(Judged::RefusesAll)
            } else if health.answered.is_some_and(|t| t >= sent) || health.check_passed.is_some_and(|t| t >= sent) {
                Some(Judged::Own)
            } else if let Some((_, kind)) = health.check_failed.filter(|(t, _)| *t >= sent) {
                Some(Judged::CheckFailed(kind))
            } else if !self.available(call.endpoint) {
                Some(Judged::Down)
            } else {
                None
            }
        };
        let refused_everything = |detail: &str| {
            LlmError::new(
                ErrorKind::EndpointConfig,
                format!(
                    "the LLM server refuses a minimal {} call too ({detail}), so it refuses every such request: a fault of the server, not of this request (it answered: {})",
                    call.kind.api(),
                    refusal.message
                ),
                refusal.status,
            )
        };
        let judged = |j: Judged| match j {
            Judged::Own => own(refusal.clone()),
            Judged::RefusesAll => refused_everything("found before"),
            Judged::CheckFailed(kind) => LlmError::new(
                kind,
                format!("{}; then a minimal {} call sent after it failed too ({})", refusal.message, call.kind.api(), kind.as_str()),
                refusal.status,
            ),
            Judged::Down => LlmError::new(
                ErrorKind::Unavailable,
                format!("{}; not judged: the endpoint's circuit breaker opened meanwhile (the server is down or faulty), so the request goes again", refusal.message),
                refusal.status,
            ),
        };
        let out_of_time = || {
            LlmError::new(
                ErrorKind::Cancelled,
                format!("{}; not judged within the batch's time (the check of a refusal that came before it took it), so the request goes back uncharged", refusal.message),
                refusal.status,
            )
        };
        if let Some(j) = known() {
            return judged(j);
        }
        let _one_check = tokio::select! {
            biased;
            _ = cancel.cancelled() => return LlmError::cancelled(),
            () = crate::task::sleep_until_some(call.deadline) => return out_of_time(),
            guard = ep.refusal_check.lock() => guard,
        };
        if let Some(j) = known() {
            return judged(j);
        }
        let checked = Instant::now();
        let result = tokio::select! {
            biased;
            _ = cancel.cancelled() => return LlmError::cancelled(),
            () = crate::task::sleep_until_some(call.deadline) => return out_of_time(),
            r = self.minimal_call(call.endpoint, call.kind) => r,
        };
        match result {
            Ok(()) => {
                lock(&ep.routes)[route].check_passed = Some(checked);
                own(refusal)
            }
            Err((ErrorKind::Rejected, detail)) => {
                self.api_refuses_everything(call, &detail, &refusal.message);
                refused_everything(&detail)
            }
            Err((kind, detail)) => {
                lock(&ep.routes)[route].check_failed = Some((checked, kind));
                LlmError::new(kind, format!("{}; then a minimal {} call failed too: {detail}", refusal.message, call.kind.api()), refusal.status)
            }
        }
    }

    /// The endpoint's API (`call.kind`) refused a minimal call (`detail`) as well as a request
    /// (`request_error`): marks the route refusing, logs it at ERROR with a hint, and trips the
    /// endpoint's breaker until a probe's minimal call of that API is answered.
    fn api_refuses_everything(&self, call: &Call<'_>, detail: &str, request_error: &str) {
        let ep = &self.inner.endpoints[call.endpoint];
        let route = call.kind.route();
        lock(&ep.routes)[route].refusing = true;
        crate::error_limited!(
            REFUSING_LOG,
            endpoint = call.endpoint,
            name = %ep.name,
            api = call.kind.api(),
            error = %detail,
            request_error = %request_error,
            hint = match call.kind {
                CallKind::Chat => "vLLM answers 400 so to every chat call when the model has no chat template: start it with --chat-template",
                CallKind::Completions => "check the server's answer, and that it serves llm.model",
            },
            "the LLM server refuses a minimal call of this API as well as the requests: its configuration is at fault, not the requests; \
             its circuit breaker opens, and the requests wait for it or go to another endpoint, not charged a delivery, \
             until a probe's minimal call of this API is answered"
        );
        *lock(&ep.last_fault) = Some((ErrorKind::EndpointConfig, format!("minimal {} call: {detail}", call.kind.api())));
        let changed = lock(&ep.breaker).trip(Instant::now());
        self.after_record(call.endpoint, changed, false);
    }

    /// Sends a call of the probe (`ping` or `replay`) and checks its answer with `answered`: the
    /// error kind and a detail for the log when the call fails, the status is not 2xx or
    /// `answered` refuses the body.
    ///
    /// A call that fails on an open connection (a write refused, a connection reset or closed
    /// before the answer: no timeout, no refused connection) goes once more: the connection was
    /// most likely a kept-alive one the server had closed. A server that answers 413 (or any
    /// error) before it has read a large body closes the connection; a minimal call that took it
    /// from the pool failed with `Broken pipe`, and the request's refusal was judged a server
    /// fault (observed: a 3 MB prompt, dead-lettered after 5 deliveries instead of answered
    /// `rejected`).
    async fn check_call(
        &self,
        request: reqwest::RequestBuilder,
        answered: impl FnOnce(&[u8]) -> Result<(), String>,
    ) -> Result<(), (ErrorKind, String)> {
        let again = request.try_clone();
        let sent = match (request.send().await, again) {
            (Err(e), Some(again)) if !e.is_connect() && !e.is_timeout() && !e.is_builder() => {
                tracing::debug!(error = %transport_message(e), "a probe call failed on an open connection; sending it once more");
                again.send().await
            }
            (sent, _) => sent,
        };
        match sent {
            Ok(r) if r.status().is_success() => match read_body(r, self.inner.max_response_bytes).await {
                Ok(bytes) => answered(&bytes).map_err(|e| (ErrorKind::InvalidResponse, e)),
                Err((e, _)) => Err((e.kind, e.message)),
            },
            Ok(r) => {
                let status = r.status();
                let body = read_body(r, self.inner.max_response_bytes).await.map(|b| preview(&b)).unwrap_or_default();
                Err((classify(Problem::Status(status.as_u16())), format!("HTTP {status}: {body}")))
            }
            Err(e) => Err((classify(Problem::Transport(&e)), transport_message(e))),
        }
    }

    fn breaker_changed(&self, endpoint: usize, state: BreakerState, reopened: bool) {
        let ep = &self.inner.endpoints[endpoint];
        (self.inner.hook)(&LlmEvent::Breaker { endpoint, name: &ep.name, state, reopened });
        ep.changed.send_replace(());
    }

    /// One HTTP attempt. On failure also returns the server's `Retry-After`, if any.
    async fn attempt(
        &self,
        url: &Url,
        payload: Vec<u8>,
        parse: &impl Fn(Value) -> Result<Parsed, LlmError>,
    ) -> Result<Parsed, (LlmError, Option<Duration>)> {
        let transport = |e: reqwest::Error| (LlmError::transport(e, None), None);
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
        let location = status.is_redirection().then(|| response.headers().get(LOCATION).and_then(|v| v.to_str().ok()).map(shown_location)).flatten();
        let bytes = read_body(response, self.inner.max_response_bytes).await?;
        if !status.is_success() {
            let kind = classify(Problem::Status(status.as_u16()));
            let message = match location {
                Some(to) => format!("HTTP {status} to {to} (redirects are not followed: set llm.endpoints to the URL that answers): {}", preview(&bytes)),
                None => format!("HTTP {status}: {}", preview(&bytes)),
            };
            // 502 and 504: a gateway lost the server behind it.
            let connection_lost = matches!(status.as_u16(), 502 | 504);
            return Err((LlmError { connection_lost, ..LlmError::new(kind, message, Some(status.as_u16())) }, retry_after));
        }
        let value: Value = serde_json::from_slice(without_bom(&bytes)).map_err(|e| {
            let kind = classify(Problem::InvalidBody);
            (LlmError::new(kind, format!("response is not JSON ({e}): {}", preview(&bytes)), Some(status.as_u16())), None)
        })?;
        parse(value).map_err(|mut e| {
            e.status = Some(status.as_u16());
            (e, None)
        })
    }
}

/// `bytes` without a leading UTF-8 byte order mark, which RFC 8259 §8.1 lets a parser ignore
/// (requests are read the same way, `request.rs`).
fn without_bom(bytes: &[u8]) -> &[u8] {
    bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes)
}

/// A redirect's `Location` as the error shows it: without user, password, query or fragment,
/// which may carry credentials (a signed URL's token); a relative one cut before its query.
fn shown_location(location: &str) -> String {
    match Url::parse(location) {
        Ok(mut url) => {
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url.set_query(None);
            url.set_fragment(None);
            url.to_string()
        }
        Err(_) => location.split(['?', '#']).next().unwrap_or_default().to_owned(),
    }
}

/// What a failed probe call says of the endpoint, by the fault of its error kind.
fn fault_outcome(kind: ErrorKind) -> Outcome {
    match kind.fault() {
        Fault::Request => Outcome::RequestFault,
        Fault::Cancelled => Outcome::Abandoned,
        Fault::Server => Outcome::ServerFault,
    }
}

/// Whether a 2xx body answers a call of `kind` for `n_items` prompts with `n` =
/// `choices_per_prompt` as the parser of real calls ([`demux_completions`], [`parse_chat`]) wants
/// it, every item valid; the error says what is wrong with it.
fn valid_answer(bytes: &[u8], kind: CallKind, n_items: usize, choices_per_prompt: u64) -> Result<(), String> {
    let bytes = without_bom(bytes);
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("response is not JSON ({e}): {}", preview(bytes)))?;
    let parsed = match kind {
        CallKind::Completions => demux_completions(v, n_items, choices_per_prompt),
        CallKind::Chat => parse_chat(v),
    }
    .map_err(|e| e.message)?;
    match parsed.items.into_iter().find_map(Result::err) {
        Some(e) => Err(e.message),
        None => Ok(()),
    }
}

/// A real call an endpoint answered, kept to be replayed ([`Endpoint::known_good`]).
#[derive(Debug, Clone)]
struct KnownCall {
    url: Url,
    payload: Vec<u8>,
    kind: CallKind,
    n_items: usize,
    choices_per_prompt: u64,
    /// How long the endpoint took to answer it, in seconds.
    seconds: f64,
}

/// How many answered calls [`KnownCalls`] keeps per route.
const KNOWN_CALLS: usize = 8;

/// After the first [`KNOWN_CALLS`], every this-many-th answered call replaces the oldest kept one.
const KNOWN_CALLS_EVERY: u64 = 64;

/// A sample of the real calls an endpoint answered on one route, so that a replay stands for the
/// traffic: the first [`KNOWN_CALLS`] answered, then every [`KNOWN_CALLS_EVERY`]-th answered
/// call in place of the oldest, so the sample follows the traffic as it changes (one body copy
/// per 64 answers on the hot path).
#[derive(Debug, Clone, Default)]
struct KnownCalls {
    calls: Vec<KnownCall>,
    answered: u64,
    /// Where the next kept call goes once the sample is full.
    next: usize,
}

impl KnownCalls {
    /// Counts one answered call; true when it is to be kept ([`Self::keep`]).
    fn counts_answer(&mut self) -> bool {
        self.answered += 1;
        self.calls.len() < KNOWN_CALLS || self.answered.is_multiple_of(KNOWN_CALLS_EVERY)
    }

    fn keep(&mut self, call: KnownCall) {
        if self.calls.len() < KNOWN_CALLS {
            self.calls.push(call);
        } else {
            self.calls[self.next] = call;
            self.next = (self.next + 1) % KNOWN_CALLS;
        }
    }

    /// The kept call with the median answer time (the lower one of an even sample): a typical
    /// call of the traffic. Not the quickest: a server too slow for most real calls (a slower
    /// model, a throttled CPU) may still answer the smallest one in time, and its replay would
    /// then charge the requests for the server's slowness. `None` before any call was answered.
    fn typical(&self) -> Option<KnownCall> {
        let mut by_time: Vec<&KnownCall> = self.calls.iter().collect();
        by_time.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
        by_time.get(by_time.len().saturating_sub(1) / 2).map(|c| (*c).clone())
    }
}

impl KnownCall {
    /// Checks an answer to this call as the real call's answer was checked ([`valid_answer`]), so
    /// a server that garbles every answer is not taken as healthy because its garbage has a
    /// `choices` list.
    fn check(&self, bytes: &[u8]) -> Result<(), String> {
        valid_answer(bytes, self.kind, self.n_items, self.choices_per_prompt)
    }
}

/// What is known of a 4xx refusal before a minimal call is sent ([`LlmClient::judge_refusal`]).
#[derive(Debug, Clone, Copy)]
enum Judged {
    /// The API answered another call sent after the refusal: the request's own fault.
    Own,
    /// The API refuses every call.
    RefusesAll,
    /// A minimal call sent after the refusal failed so (a server fault).
    CheckFailed(ErrorKind),
    /// The endpoint's breaker is open: not judged now.
    Down,
}

/// The routes (APIs) of an endpoint told apart by the breaker: completions and chat.
const ROUTES: usize = 2;

/// What one route of an endpoint showed of its own health, for judging 4xx refusals
/// ([`LlmClient::judge_refusal`]).
#[derive(Debug, Clone, Copy, Default)]
struct RouteHealth {
    /// When a real call on the route was last answered (a 2xx with a valid answer).
    answered: Option<Instant>,
    /// When the last minimal call on the route that was answered was sent.
    check_passed: Option<Instant>,
    /// When the last minimal call on the route that failed other than by a refusal (a timeout,
    /// a 5xx, a refused connection) was sent, and how it failed: the refusals sent before it
    /// share its verdict instead of each waiting for a minimal call of its own.
    check_failed: Option<(Instant, ErrorKind)>,
    /// The route refused a minimal call (a 4xx): it refuses every request, so the endpoint counts
    /// as down until a probe's minimal call on the route is answered.
    refusing: bool,
}

/// The error of an answer whose every item failed to parse (HTTP 200, so with that status), or
/// `None` when some item is valid (or there is none).
fn every_item_invalid(parsed: &Parsed) -> Option<LlmError> {
    let mut errors = parsed.items.iter().map(|r| r.as_ref().err());
    let first = errors.next()??;
    if !errors.all(|e| e.is_some()) {
        return None;
    }
    let message = if parsed.items.len() == 1 { first.message.clone() } else { format!("no item of the answer is valid; the first: {}", first.message) };
    Some(LlmError::new(ErrorKind::InvalidResponse, message, Some(200)))
}

/// One HTTP call's fixed parts, for [`LlmClient::send_with_retries`].
struct Call<'a> {
    endpoint: usize,
    url: &'a Url,
    payload: Vec<u8>,
    kind: CallKind,
    /// The request's `n`, for checking a replay of this call ([`KnownCall::check`]).
    choices_per_prompt: u64,
    n_items: usize,
    /// The caller already holds an endpoint permit.
    permit_held: bool,
    /// A list-prompt call of several prompts: its request faults are not retried as a whole.
    list: bool,
    /// Whether a request timeout is retried ([`LlmClient::run_call`]).
    retry_timeouts: bool,
    /// The prefix key of its items, for the permit order.
    prefix_key: Option<u64>,
    /// No attempt starts that could not end by then ([`LlmClient::infer_within`]).
    deadline: Option<Instant>,
    /// Time its attempts waited for an endpoint permit, in microseconds (added up by
    /// [`LlmClient::attempt_through_breaker`]).
    permit_wait_us: AtomicU64,
    /// When its last attempt was sent (set by [`LlmClient::attempt_through_breaker`]).
    last_sent: Mutex<Option<Instant>>,
    /// The duration in seconds of its last attempt when that attempt's refusal is judged before
    /// the [`LlmEvent::Call`] reports it ([`Call::refusal_to_judge`]).
    unreported_seconds: Mutex<Option<f64>>,
    /// The model its items name instead of `llm.model`, if any: a 401/403/404 may then be
    /// that model's, not the endpoint's ([`Call::refusal_to_judge`]).
    model_override: Option<&'a str>,
}

impl Call<'_> {
    /// Whether `error`, this call's final error, is a refusal that may be the request's own or
    /// the server's, judged by [`LlmClient::judge_refusal`]: a 4xx request fault of a one-prompt
    /// call (a list call's goes again prompt by prompt first), or a 401/403/404 of a call whose
    /// items name another model than `llm.model` (one model for the whole list, so a list call's
    /// too).
    fn refusal_to_judge(&self, error: &LlmError) -> bool {
        match error.kind {
            ErrorKind::Rejected => error.status.is_some() && !self.list,
            _ => self.model_refusal(error),
        }
    }

    /// Whether `error` is a 401/403/404 of a call whose items name another model than
    /// `llm.model`: maybe a refusal of that model alone ([`Call::refusal_to_judge`]).
    fn model_refusal(&self, error: &LlmError) -> bool {
        self.model_override.is_some() && error.kind == ErrorKind::EndpointConfig && is_model_refusal(error.status)
    }
}

/// Whether an HTTP status is one a server gives to a model it does not serve or will not serve
/// to this client: 404 (vLLM: "The model `…` does not exist."), 401 or 403 (gateways whose key is
/// not allowed that model).
fn is_model_refusal(status: Option<u16>) -> bool {
    matches!(status, Some(401 | 403 | 404))
}

/// How one attempt through the breaker went.
enum Gate {
    Cancelled,
    /// Less than `llm.request_timeout` was left before the call's deadline (its permit wait
    /// included): not sent.
    OutOfTime,
    /// The breaker did not let the call through.
    Closed(LlmError),
    Attempted(Result<Parsed, (LlmError, Option<Duration>)>),
}

impl Endpoint {
    /// The URL of the endpoint's API for calls of `kind`.
    fn url(&self, kind: CallKind) -> &Url {
        match kind {
            CallKind::Completions => &self.completions,
            CallKind::Chat => &self.chat,
        }
    }

    /// Endpoint `i` of the settings; the error is a config message naming it without credentials.
    fn new(i: usize, base: &Url, settings: &LlmSettings, policy: BreakerPolicy) -> Result<Self, String> {
        let name = public_name(base);
        if base.scheme() != "http" && base.scheme() != "https" {
            return Err(format!("llm.endpoints[{i}] = {name}: only http:// and https:// are supported"));
        }
        let join = |path: &str| {
            let mut dir = base.clone();
            if !dir.path().ends_with('/') {
                let p = format!("{}/", dir.path());
                dir.set_path(&p);
            }
            dir.join(path).map_err(|e| format!("llm.endpoints[{i}] = {name}: cannot append {path}: {e}"))
        };
        Ok(Endpoint {
            completions: join(COMPLETIONS_PATH)?,
            chat: join(CHAT_COMPLETIONS_PATH)?,
            models: join(MODELS_PATH)?,
            last_answer: Mutex::new(None),
            found_hung: AtomicU64::new(0),
            isolation: tokio::sync::Semaphore::new(1),
            probing: AtomicBool::new(false),
            last_check: tokio::sync::Mutex::new(None),
            name,
            permits: KeyedPermits::new(settings.max_concurrency.get()),
            per_prompt_calls: AtomicBool::new(false),
            breaker: Mutex::new(Breaker::new(policy)),
            known_good: Mutex::new([KnownCalls::default(), KnownCalls::default()]),
            routes: Mutex::new([RouteHealth::default(); ROUTES]),
            refusal_check: tokio::sync::Mutex::new(()),
            last_fault: Mutex::new(None),
            changed: watch::Sender::new(()),
        })
    }
}

/// Locks a breaker; a poisoned lock is taken over (the breaker's state is valid after any panic,
/// every method leaves it consistent).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The prober of one endpoint, started when its breaker opens: sleeps until the open time is
/// over, takes the probe slot, probes ([`LlmClient::probe`]) and records the outcome, until the
/// breaker is closed. Holds only a weak reference between probes, so a dropped client ends it.
async fn probe_until_closed(inner: std::sync::Weak<Inner>, endpoint: usize) {
    loop {
        let Some(client) = inner.upgrade().map(|inner| LlmClient { inner }) else { return };
        let ep = &client.inner.endpoints[endpoint];
        let (closed, until) = {
            let b = lock(&ep.breaker);
            (b.available(Instant::now()), b.open_until())
        };
        if closed {
            ep.probing.store(false, Ordering::Release);
            // A reopening between the check and the store found `probing` still set: go on then.
            if lock(&ep.breaker).available(Instant::now()) || ep.probing.swap(true, Ordering::AcqRel) {
                return;
            }
            continue;
        }
        if let Some(until) = until.filter(|&t| t > Instant::now()) {
            drop(client);
            tokio::time::sleep_until(until).await;
            continue;
        }
        if !lock(&ep.breaker).admit_probe(Instant::now()) {
            // Another prober holds the slot (not started by this client: cannot happen). The
            // next opening starts a prober again.
            ep.probing.store(false, Ordering::Release);
            return;
        }
        tracing::info!(endpoint, name = %ep.name, "LLM endpoint circuit breaker half-open; probing with a one-token completion");
        client.breaker_changed(endpoint, BreakerState::HalfOpen, false);
        let outcome = client.probe_guarded(endpoint, true, Outcome::ServerFault).await;
        client.record(endpoint, outcome, true);
    }
}

/// The JSON request body of `group`: its params (with `stream` forced off and `stream_options`
/// left out when `stream` is given), `model`, and `prompt` (the list of the members' prompts) or
/// `messages` (the one member's). Written straight from the requests ([`RequestBody`]), without
/// copying the prompts into a JSON tree first.
fn request_body(items: &[InferenceItem<'_>], group: &Group<'_>) -> Result<Vec<u8>, LlmError> {
    serde_json::to_vec(&RequestBody { items, group }).map_err(|e| LlmError::new(ErrorKind::Rejected, format!("cannot serialise the request: {e}"), None))
}

/// The keys of a call's body that the daemon writes itself; the same keys in a request's `params`
/// are left out.
const OWN_BODY_KEYS: [&str; 4] = ["model", "prompt", "messages", "stream"];

/// Serialises [`request_body`].
struct RequestBody<'a, 'b> {
    items: &'a [InferenceItem<'b>],
    group: &'a Group<'b>,
}

impl serde::Serialize for RequestBody<'_, '_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let (items, group) = (self.items, self.group);
        let stream = group.params.contains_key("stream");
        let mut map = serializer.serialize_map(None)?;
        for (k, v) in group.params {
            if OWN_BODY_KEYS.contains(&k.as_str()) || (stream && k == "stream_options") {
                continue;
            }
            map.serialize_entry(k, v)?;
        }
        if stream {
            map.serialize_entry("stream", &false)?;
        }
        map.serialize_entry("model", group.model)?;
        match group.kind {
            CallKind::Completions => {
                let prompts: Vec<&str> = group
                    .members
                    .iter()
                    .filter_map(|&i| match items[i].body {
                        Body::Completion(p) => Some(p.as_str()),
                        Body::Chat(_) => None, // unreachable: grouped by kind
                    })
                    .collect();
                map.serialize_entry("prompt", &prompts)?;
            }
            CallKind::Chat => {
                let messages: Vec<&Value> = match items[group.members[0]].body {
                    Body::Chat(m) => m.iter().map(|m| &m.raw).collect(),
                    Body::Completion(_) => Vec::new(), // unreachable: grouped by kind
                };
                map.serialize_entry("messages", &messages)?;
            }
        }
        map.end()
    }
}

/// Reads a response body chunk by chunk, refusing more than `limit` bytes (also when
/// `Content-Length` announces more) with [`ErrorKind::InvalidResponse`].
async fn read_body(mut response: reqwest::Response, limit: usize) -> Result<Vec<u8>, (LlmError, Option<Duration>)> {
    let status = Some(response.status().as_u16());
    let too_large = || {
        let kind = classify(Problem::InvalidBody);
        (LlmError::new(kind, format!("response body larger than {limit} bytes"), status), None)
    };
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    // Grown by doubling, but never past the limit: a `Vec` left to itself would double to twice
    // a body just under it (observed: 4 calls answered with bodies of about the limit held
    // 420 MB with a 64 MiB limit).
    let mut bytes = Vec::with_capacity(response.content_length().map_or(0, |n| n as usize));
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) if bytes.len() + chunk.len() > limit => return Err(too_large()),
            Ok(Some(chunk)) => {
                let needed = bytes.len() + chunk.len();
                if needed > bytes.capacity() {
                    bytes.reserve_exact(needed.max(bytes.capacity() * 2).min(limit) - bytes.len());
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(bytes),
            Err(e) => {
                return Err((LlmError::transport(e, status), None));
            }
        }
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

/// The `llm.api_key` of every client of this process ([`LlmClient::with_options`]), masked in
/// all server text the daemon repeats ([`preview`]).
static TOKENS: LazyLock<RwLock<Vec<MaskedToken>>> = LazyLock::new(|| RwLock::new(Vec::new()));

/// A token of [`TOKENS`] and the pattern of its escaped forms (`None`: masked as written only).
type MaskedToken = (String, Option<regex::Regex>);

/// Adds `token` to [`TOKENS`], matched as written and with any of its characters other than
/// letters and digits escaped as the bodies the daemon repeats may hold them: JSON (`\"`, `\\`,
/// `\/` as PHP's `json_encode` writes a slash, `\u00XX` as encoders that escape for HTML write
/// any of them) and percent-encoding (RFC 3986 §2.1: a server that quotes a URL or a form
/// field), with upper- or lower-case hex digits, each character on its own. Observed before: a
/// server error quoting a base64-style key with `%2F` and `\u002f` put it into the log. A key too
/// long for such a pattern (over the `regex` crate's size limit) is masked as written only.
fn mask_token(token: &str) {
    if token.is_empty() {
        return;
    }
    let mut pattern = String::new();
    for c in token.chars() {
        if c.is_ascii_alphanumeric() || !c.is_ascii() {
            pattern.push_str(&regex::escape(c.encode_utf8(&mut [0; 4])));
        } else {
            let b = c as u32;
            let literal = regex::escape(c.encode_utf8(&mut [0; 4]));
            pattern.push_str(&format!(r"(?:{literal}|\\{literal}|%{b:02X}|%{b:02x}|\\u00{b:02X}|\\u00{b:02x})"));
        }
    }
    let re = regex::Regex::new(&pattern).ok();
    let mut tokens = TOKENS.write().unwrap_or_else(|e| e.into_inner());
    if !tokens.iter().any(|(t, _)| t == token) {
        tokens.push((token.to_owned(), re));
    }
    // The longest first, so a token that contains another is replaced whole.
    tokens.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
}

/// The first [`ERROR_BODY_PREVIEW_CHARS`] characters of a response body, lossily decoded, with
/// every `llm.api_key` replaced by `***`: a server or gateway that quotes the `Authorization`
/// header in an error ("Incorrect API key provided: Bearer sk-…") would otherwise put the token
/// into the log and into the error results that requesters receive.
fn preview(bytes: &[u8]) -> String {
    let tokens = TOKENS.read().unwrap_or_else(|e| e.into_inner());
    // Only the start of the body is shown: the preview's characters, and room for a key that
    // begins among them, however it is escaped (6 bytes a character at most, `\u00XX`).
    let longest = tokens.first().map_or(0, |(t, _)| t.len());
    let window = (ERROR_BODY_PREVIEW_CHARS * 4 + longest * 6).min(bytes.len());
    let mut text = String::from_utf8_lossy(&bytes[..window]).into_owned();
    for (token, re) in tokens.iter() {
        match re {
            Some(re) => {
                if let std::borrow::Cow::Owned(masked) = re.replace_all(&text, "***") {
                    text = masked;
                }
            }
            None if text.contains(token.as_str()) => text = text.replace(token.as_str(), "***"),
            None => {}
        }
    }
    drop(tokens);
    let cut = window < bytes.len();
    // Control, bidirectional and invisible characters escaped (`\n`, `\u{1b}`, `\u{202e}`):
    // the text goes into log lines, where a line break would start a forged line and an escape
    // sequence or an override would disguise it (as ids are refused for, `request::is_control_like`).
    let mut out = String::new();
    let mut taken = 0;
    for c in text.chars().take(ERROR_BODY_PREVIEW_CHARS) {
        taken += c.len_utf8();
        if crate::request::is_control_like(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if cut || taken < text.len() {
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

impl CallKind {
    /// The breaker's route number of this API ([`Breaker::answered_fault_call`]).
    fn route(self) -> usize {
        match self {
            CallKind::Completions => 0,
            CallKind::Chat => 1,
        }
    }

    /// The API's name in logs and errors: `completions` or `chat completions`.
    fn api(self) -> &'static str {
        match self {
            CallKind::Completions => "completions",
            CallKind::Chat => "chat completions",
        }
    }
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

/// Gives `early` (when set) each final answer of `results`: a completion or a refusal of the
/// request itself ([`EarlyAnswers`]).
fn answer_early(early: Option<EarlyAnswers<'_>>, results: &[(usize, Result<Completion, LlmError>)]) {
    if let Some(early) = early {
        for (i, result) in results.iter().filter(|(_, r)| is_final(r)) {
            early(*i, result);
        }
    }
}

/// Whether `answer` is final for its request: a completion, or a refusal of the request itself.
pub fn is_final(answer: &Result<Completion, LlmError>) -> bool {
    answer.as_ref().err().is_none_or(|e| e.fault() == Fault::Request)
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
#[derive(Debug, Default)]
struct Parsed {
    items: Vec<Result<Completion, LlmError>>,
    /// Sum of `usage.prompt_tokens` over the answer (0 when not reported).
    prompt_tokens: u64,
    /// Sum of `usage.prompt_tokens_details.cached_tokens` (or `timings.cache_n`) over the answer.
    cached_tokens: u64,
    /// The answer was llama-server's merged list answer: its usage covers only the first prompt.
    first_prompt_usage_only: bool,
}

impl Parsed {
    fn add_tokens(&mut self, (prompt_tokens, cached_tokens): (u64, u64)) {
        // Saturating: the counts come from the server.
        self.prompt_tokens = self.prompt_tokens.saturating_add(prompt_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(cached_tokens);
    }
}

/// The largest token count of one prompt or completion taken from a server: 2^32 − 1
/// (4,294,967,295), far beyond any model's context window. A larger one is taken as not reported:
/// summed into the Prometheus counters (unsigned 64-bit, wrapping), 2^64 − 1 per call made them go
/// back by one each time.
pub const MAX_REPORTED_TOKENS: u64 = u32::MAX as u64;

/// Reads token counts from an OpenAI `usage` object, falling back to llama-server's `timings`
/// (`prompt_n` = prompt tokens evaluated, `cache_n` = prompt tokens reused from the cache,
/// `predicted_n` = generated tokens). Cached tokens are capped at the prompt tokens: a server
/// that reports more would push the cached-token ratio above 1. A count above
/// [`MAX_REPORTED_TOKENS`] counts as absent.
fn parse_usage(usage: Option<&Value>, timings: Option<&Value>) -> Option<Usage> {
    let count = |v: &Value| v.as_u64().filter(|&n| n <= MAX_REPORTED_TOKENS);
    let num = |v: Option<&Value>, field: &str| v.and_then(|v| v.get(field)).and_then(count);
    let cache_n = num(timings, "cache_n");
    if let Some(prompt_tokens) = num(usage, "prompt_tokens") {
        let cached = usage
            .and_then(|u| u.get("prompt_tokens_details"))
            .and_then(|d| d.get("cached_tokens"))
            .and_then(count)
            .or(cache_n)
            .map(|c| c.min(prompt_tokens));
        return Some(Usage {
            prompt_tokens,
            completion_tokens: num(usage, "completion_tokens").unwrap_or(0),
            cached_tokens: cached,
        });
    }
    let prompt_n = num(timings, "prompt_n")?;
    Some(Usage {
        prompt_tokens: prompt_n.saturating_add(cache_n.unwrap_or(0)),
        completion_tokens: num(timings, "predicted_n").unwrap_or(0),
        cached_tokens: cache_n,
    })
}

fn usage_of(obj: &Value) -> Option<Usage> {
    parse_usage(obj.get("usage"), obj.get("timings"))
}


impl Group<'_> {
    /// The request's `n` (choices per prompt), 1 when absent or invalid.
    fn choices_per_prompt(&self) -> u64 {
        self.params.get("n").and_then(Value::as_u64).filter(|&n| n >= 1).unwrap_or(1)
    }
}

/// Demultiplexes a completions answer for `n_items` prompts into one result per prompt, strictly:
/// no item may ever receive another prompt's text.
///
/// - One prompt: any non-empty `choices` list, every choice that prompt's ([`prompt_choices`]):
///   the first in index order is the item's output, and with more than one all of them are in
///   [`Completion::choices`] (with `n` > 1 the OpenAI API numbers a prompt's choices `0 .. n`).
/// - Several prompts, one object: accepted only when `choices` has exactly
///   `n_items × choices_per_prompt` entries whose `index` values are exactly
///   `0 .. n_items × choices_per_prompt`, each once (OpenAI numbers choice `j` of prompt `p` as
///   `p × n + j`); item `p` takes choice `p × n`. An object with a top-level `timings` (llama.cpp's
///   merged answer) has the usage of its first choice's prompt only.
/// - Several prompts, an array (older llama-server): accepted only with exactly one object per
///   prompt, in prompt order, each a one-prompt answer as above with its own usage.
///
/// Errors ([`ErrorKind::InvalidResponse`], failing every item of the call): not an object or
/// array, an `error` object in the answer, no `choices` list, or an answer that does not
/// demultiplex exactly. A choice without a string `text` or with `finish_reason: "error"` fails
/// its own item only.
fn demux_completions(v: Value, n_items: usize, choices_per_prompt: u64) -> Result<Parsed, LlmError> {
    match v {
        Value::Array(objects) => demux_array(&objects, n_items),
        obj @ Value::Object(_) => {
            let choices = choices_of(&obj)?;
            let mut parsed = Parsed::default();
            parsed.add_tokens(usage_totals(&obj));
            if n_items == 1 {
                parsed.items.push(one_prompt_item(&obj, choices));
                return Ok(parsed);
            }
            parsed.items = demux_list_choices(&obj, choices, n_items, choices_per_prompt)?;
            let merged = obj.get("timings").is_some_and(Value::is_object);
            if merged {
                // llama.cpp: the object's usage is that of the first choice's prompt.
                let first = choices[0].get("index").and_then(Value::as_u64).unwrap_or(0) / choices_per_prompt;
                if let Some(Ok(c)) = parsed.items.get_mut(first as usize) {
                    c.usage = c.usage.take().or_else(|| usage_of(&obj));
                }
                parsed.first_prompt_usage_only = true;
            }
            Ok(parsed)
        }
        other => Err(LlmError::invalid(format!("expected a JSON object or array, got {}", short(&other)))),
    }
}

/// Older llama-server's list answer: one complete one-prompt answer per prompt. The objects'
/// choice indices must be all 0 (then the objects are in prompt order) or exactly `0 .. n_items`
/// each once (then the index is the prompt); anything else does not demultiplex.
fn demux_array(objects: &[Value], n_items: usize) -> Result<Parsed, LlmError> {
    if objects.len() != n_items {
        return Err(LlmError::invalid(format!("list answer has {} objects for {n_items} prompts", objects.len())));
    }
    let mut slots: Vec<Option<Result<Completion, LlmError>>> = (0..n_items).map(|_| None).collect();
    let mut parsed = Parsed::default();
    let indices: Vec<Option<u64>> = objects
        .iter()
        .map(|o| o.get("choices").and_then(|c| c.get(0)).and_then(|c| c.get("index")).and_then(Value::as_u64))
        .collect();
    let positional = indices.iter().all(|&i| i == Some(0));
    for (position, (obj, index)) in objects.iter().zip(&indices).enumerate() {
        let slot = if positional { Some(position) } else { index.map(|i| i as usize).filter(|&i| i < n_items) };
        let Some(slot) = slot.filter(|&s| slots[s].is_none()) else {
            return Err(LlmError::invalid("list answer objects' choice indices are neither all 0 nor 0 .. prompts each once"));
        };
        slots[slot] = Some(one_prompt_item(obj, choices_of(obj)?));
        parsed.add_tokens(usage_totals(obj));
    }
    // Every slot is filled: n_items distinct in-range slots for n_items objects.
    parsed.items = slots.into_iter().map(|s| s.unwrap_or_else(|| Err(LlmError::invalid("no answer object")))).collect();
    Ok(parsed)
}

/// The `choices` list of a completions answer object; an `error` object or a missing list fails
/// the whole answer.
fn choices_of(obj: &Value) -> Result<&[Value], LlmError> {
    if let Some(error) = obj.get("error").filter(|e| !e.is_null()) {
        return Err(LlmError::invalid(format!("the answer carries an error: {}", short(error))));
    }
    match obj.get("choices") {
        Some(Value::Array(choices)) if !choices.is_empty() => Ok(choices),
        _ => Err(LlmError::invalid(format!("response has no `choices` list: {}", short(obj)))),
    }
}

/// The item of a one-prompt answer ([`prompt_choices`]), with the object's usage, which is the
/// item's own, when its first choice has none.
fn one_prompt_item(obj: &Value, choices: &[Value]) -> Result<Completion, LlmError> {
    let ordered = prompt_choices(choices);
    item_of(&ordered, 0, |choice, index| completion_of(obj, choice, index))
        .map(|c| Completion { usage: c.usage.or_else(|| usage_of(obj)), ..c })
}

/// The choices of a one-prompt answer (non-empty), in `index` order when their indices are
/// distinct integers, else in the answer's order. Every choice of a one-prompt call answers that
/// prompt, so none is refused: a server that ignores `n` or numbers its choices oddly still
/// answers the request, with as many choices as it generated.
fn prompt_choices(choices: &[Value]) -> Vec<&Value> {
    let index = |c: &&Value| c.get("index").and_then(Value::as_u64);
    let mut ordered: Vec<&Value> = choices.iter().collect();
    let mut distinct: Vec<u64> = ordered.iter().filter_map(index).collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() == ordered.len() {
        ordered.sort_by_key(index);
    }
    ordered
}

/// One prompt's item from its choices in index order (`ordered`, non-empty; the first has answer
/// index `first_index`): the first choice's completion, and with more than one choice all of
/// them in [`Completion::choices`]. Any failing choice fails the item.
fn item_of(
    ordered: &[&Value],
    first_index: u64,
    completion: impl Fn(&Value, u64) -> Result<Completion, LlmError>,
) -> Result<Completion, LlmError> {
    let Some((first, rest)) = ordered.split_first() else {
        return Err(LlmError::invalid("no choice for the prompt"));
    };
    let head = completion(first, first_index)?;
    if rest.is_empty() {
        return Ok(head);
    }
    let mut choices = vec![ResultChoice { output: head.output.clone(), finish_reason: head.finish_reason.clone(), logprobs: head.logprobs.clone() }];
    for (j, choice) in rest.iter().enumerate() {
        let c = completion(choice, first_index + 1 + j as u64)?;
        choices.push(ResultChoice { output: c.output, finish_reason: c.finish_reason, logprobs: c.logprobs });
    }
    Ok(Completion { choices: Some(choices), ..head })
}

/// The items of a several-prompt answer object, after checking that its indices are exactly
/// `0 .. n_items × choices_per_prompt`, each once.
fn demux_list_choices(
    obj: &Value,
    choices: &[Value],
    n_items: usize,
    choices_per_prompt: u64,
) -> Result<Vec<Result<Completion, LlmError>>, LlmError> {
    let expected = n_items as u64 * choices_per_prompt;
    let mismatch = |what: String| {
        LlmError::invalid(format!("list answer does not match its {n_items} prompts × n = {choices_per_prompt}: {what}"))
    };
    if choices.len() as u64 != expected {
        return Err(mismatch(format!("{} choices", choices.len())));
    }
    let mut by_index: Vec<Option<&Value>> = vec![None; choices.len()];
    for choice in choices {
        let index = choice.get("index").and_then(Value::as_u64).filter(|&i| i < expected);
        match index {
            Some(i) if by_index[i as usize].is_none() => by_index[i as usize] = Some(choice),
            _ => return Err(mismatch(format!("choice index {} missing, repeated or out of range", short(&choice["index"])))),
        }
    }
    // Every slot is filled: `expected` distinct in-range indices over `expected` slots.
    let by_index: Vec<&Value> = by_index.into_iter().flatten().collect();
    let items = by_index
        .chunks(choices_per_prompt as usize)
        .enumerate()
        .map(|(p, ordered)| item_of(ordered, p as u64 * choices_per_prompt, |choice, index| completion_of(obj, choice, index)))
        .collect();
    Ok(items)
}

/// One item's completion from its choice: a string `text` and no `finish_reason: "error"`. Usage
/// is the choice's own, if it has one.
fn completion_of(obj: &Value, choice: &Value, index: u64) -> Result<Completion, LlmError> {
    let finish_reason = choice.get("finish_reason").and_then(Value::as_str).map(str::to_owned);
    if finish_reason.as_deref() == Some("error") {
        return Err(LlmError::invalid(format!("choice {index} ended with finish_reason \"error\"")));
    }
    match choice.get("text") {
        Some(text @ Value::String(_)) => Ok(Completion {
            output: text.clone(),
            logprobs: logprobs_of(choice),
            choices: None,
            finish_reason,
            usage: usage_of(choice),
            model: obj.get("model").and_then(Value::as_str).map(str::to_owned),
            attempts: 0,
            permit_wait: Duration::ZERO,
        }),
        _ => Err(LlmError::invalid(format!("choice {index} has no string `text`"))),
    }
}

/// (prompt tokens, cached tokens) of an answer object for metrics: its `usage`/`timings`, else the
/// sum of its choices' own.
fn usage_totals(obj: &Value) -> (u64, u64) {
    let total = |u: Option<Usage>| u.map(|u| (u.prompt_tokens, u.cached_tokens.unwrap_or(0))).unwrap_or_default();
    if let Some(u) = usage_of(obj) {
        return total(Some(u));
    }
    let choices = obj.get("choices").and_then(Value::as_array).into_iter().flatten();
    choices.map(|c| total(usage_of(c))).fold((0, 0), |a, b| (a.0.saturating_add(b.0), a.1.saturating_add(b.1)))
}

/// A choice's `logprobs`, unless absent or `null`.
fn logprobs_of(choice: &Value) -> Option<Value> {
    choice.get("logprobs").filter(|l| !l.is_null()).cloned()
}

/// Parses a chat completions answer: output is the `message` of the first choice in index order
/// ([`prompt_choices`]), with more than one choice every choice's in [`Completion::choices`].
/// An `error` object fails it; so does a choice whose `message` is not an object, whose
/// `content` is neither a string, `null` nor a list of content parts (the OpenAI chat answer's
/// shapes), or that ended with `finish_reason: "error"`.
fn parse_chat(v: Value) -> Result<Parsed, LlmError> {
    if let Some(error) = v.get("error").filter(|e| !e.is_null()) {
        return Err(LlmError::invalid(format!("the answer carries an error: {}", short(error))));
    }
    let choices = match v.get("choices") {
        Some(Value::Array(choices)) if !choices.is_empty() => choices,
        _ => return Err(LlmError::invalid(format!("response has no `choices[0]`: {}", short(&v)))),
    };
    let ordered = prompt_choices(choices);
    let model = v.get("model").and_then(Value::as_str).map(str::to_owned);
    let completion = item_of(&ordered, 0, |choice, index| {
        let message = match choice.get("message") {
            Some(m @ Value::Object(_)) => m,
            _ => return Err(LlmError::invalid(format!("`choices[{index}].message` is missing or not an object"))),
        };
        let content_parts = |parts: &[Value]| parts.iter().all(|p| p.get("type").is_some_and(Value::is_string));
        let valid = match message.get("content") {
            None | Some(Value::String(_) | Value::Null) => true,
            Some(Value::Array(parts)) => content_parts(parts),
            Some(_) => false,
        };
        if !valid {
            return Err(LlmError::invalid(format!(
                "`choices[{index}].message.content` is neither a string, null nor a list of content parts (objects with a `type`): {}",
                short(&message["content"])
            )));
        }
        let finish_reason = choice.get("finish_reason").and_then(Value::as_str).map(str::to_owned);
        if finish_reason.as_deref() == Some("error") {
            return Err(LlmError::invalid(format!("choice {index} ended with finish_reason \"error\"")));
        }
        Ok(Completion {
            output: message.clone(),
            logprobs: logprobs_of(choice),
            choices: None,
            finish_reason,
            usage: None,
            model: model.clone(),
            attempts: 0,
            permit_wait: Duration::ZERO,
        })
    })?;
    let mut parsed = Parsed::default();
    parsed.add_tokens(usage_totals(&v));
    parsed.items.push(Ok(Completion { usage: usage_of(&v), ..completion }));
    Ok(parsed)
}

/// A JSON value cut to 200 characters for error messages.
fn short(v: &Value) -> String {
    preview(v.to_string().as_bytes()).chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;
    use llm_fakes::fake::{FakeLlm, ListShape};
    use crate::request::ChatMessage;
    use serde_json::json;
    use std::num::{NonZeroU32, NonZeroUsize};

    /// The replayed call is a typical one of a sample that follows the traffic: the median
    /// answer time, not the quickest.
    #[test]
    fn the_replayed_call_has_the_median_answer_time_of_a_sample_that_follows_the_traffic() {
        let url = Url::parse("http://127.0.0.1:1/v1/completions").unwrap();
        let call = |seconds: f64| KnownCall { url: url.clone(), payload: format!("{seconds}").into_bytes(), kind: CallKind::Completions, n_items: 1, choices_per_prompt: 1, seconds };
        let mut known = KnownCalls::default();
        assert!(known.typical().is_none());
        for seconds in [0.1, 9.0, 2.0] {
            assert!(known.counts_answer());
            known.keep(call(seconds));
        }
        assert_eq!(known.typical().unwrap().seconds, 2.0, "the median, not the quickest");
        for seconds in [3.0, 4.0, 5.0, 6.0, 7.0] {
            assert!(known.counts_answer());
            known.keep(call(seconds));
        }
        assert_eq!(known.typical().unwrap().seconds, 4.0, "the lower median of 8");
        // Full: only every 64th answered call is kept, in place of the oldest.
        let kept = (9..=200).filter(|_| known.counts_answer()).count();
        assert_eq!(kept, 3, "answers 64, 128 and 192");
        for _ in 0..KNOWN_CALLS {
            known.keep(call(0.5));
        }
        assert_eq!(known.typical().unwrap().seconds, 0.5, "the sample followed the traffic");
        assert_eq!(known.calls.len(), KNOWN_CALLS);
    }

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
            liveness_check_after: None,
            tls: Default::default(),
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
        reqs.iter().map(|(body, params)| InferenceItem { body, model: None, params, prefix_key: None }).collect()
    }

    async fn run(client: &LlmClient, reqs: &[(Body, Map<String, Value>)]) -> Vec<Result<Completion, LlmError>> {
        client.infer(0, &items(reqs), &CancellationToken::new()).await
    }

    /// A hook that records the outcome label of every [`LlmEvent::Call`].
    fn recording_hook() -> (LlmHook, Arc<Mutex<Vec<&'static str>>>) {
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let sink = outcomes.clone();
        let hook: LlmHook = Arc::new(move |e: &LlmEvent<'_>| {
            if let LlmEvent::Call { outcome, .. } = e {
                sink.lock().unwrap().push(call_outcome_label(*outcome));
            }
        });
        (hook, outcomes)
    }

    /// Reported: refusals that came together while the server's engine hung (its front end still
    /// answered 400) were judged one at a time, each with a minimal call of its own that waited
    /// out the probe timeout: six refusals took six probe timeouts, and their batches held every
    /// other request meanwhile. The refusals sent before a minimal call that failed share its
    /// verdict: one minimal call for all six, each a server fault (not charged).
    #[tokio::test]
    async fn refusals_that_come_together_share_one_failed_check() {
        let fake = FakeLlm::new().fail_prompts_containing("BAD", 400).slow_prompts_containing(PROBE_PROMPT, Duration::from_secs(60)).start().await.unwrap();
        let mut s = settings(&fake.url);
        s.request_timeout = Duration::from_millis(500);
        s.max_concurrency = NonZeroUsize::new(8).unwrap();
        let client = LlmClient::new(&s).unwrap();
        let reqs: Vec<Vec<(Body, Map<String, Value>)>> = (0..6).map(|i| vec![(completion(&format!("BAD {i}")), Map::new())]).collect();
        let results = futures_util::future::join_all(reqs.iter().map(|r| run(&client, r))).await;
        for r in &results {
            let e = r[0].as_ref().unwrap_err();
            assert_eq!(e.kind, ErrorKind::Timeout, "{}", e.message);
        }
        let checks = fake.calls().iter().filter(|c| c.prompts.iter().any(|p| p == PROBE_PROMPT)).count();
        assert_eq!(checks, 1, "one minimal call for the refusals sent before it");
        assert_eq!(fake.call_count(), 7);
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

    /// Observed: with a healthy second endpoint, batches that got 429 with `Retry-After: 999999`
    /// slept the whole capped delay (30 s) on the limited endpoint although its breaker opened
    /// 0.4 s later. Now the wait ends when the breaker opens, with the server fault.
    #[tokio::test]
    async fn a_call_waiting_out_a_retry_after_gives_up_when_its_breaker_opens() {
        let fake = FakeLlm::new().always_fail(429).retry_after(30).start().await.unwrap();
        let mut s = settings(&fake.url);
        s.backoff_max = Duration::from_secs(20);
        let client = LlmClient::new(&s).unwrap();
        let (c, started) = (client.clone(), Instant::now());
        let task = tokio::spawn(async move { run(&c, &three_prompts(&Map::new())).await });
        while fake.call_count() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!task.is_finished(), "the call waits out its Retry-After");
        lock(&client.inner.endpoints[0].breaker).trip(Instant::now());
        let results = tokio::time::timeout(Duration::from_secs(5), task).await.expect("the waiting call gave up when the breaker opened").unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(fake.call_count(), 1, "no second attempt on the open endpoint");
        for r in results {
            assert_eq!(r.unwrap_err().kind, ErrorKind::RateLimited);
        }
    }

    /// A list call's refusal goes again prompt by prompt, and only the refused prompt fails, not
    /// retried. Its refusal is judged by one minimal call (no real call was answered after it was
    /// sent), which the server answers: the prompt's own fault.
    #[tokio::test]
    async fn client_errors_are_not_retried_but_isolated_prompt_by_prompt() {
        let fake = FakeLlm::new().fail_prompts_containing("bravo", 400).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        let prompts: Vec<Vec<String>> = fake.calls().into_iter().map(|c| c.prompts).collect();
        let expected: [&[&str]; 5] =
            [&["alpha prompt", "bravo prompt", "charlie prompt"], &["alpha prompt"], &["bravo prompt"], &[PROBE_PROMPT], &["charlie prompt"]];
        assert_eq!(prompts, expected, "the list call, then each prompt once, and the minimal call after the refusal");
        assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
        let e = results[1].as_ref().unwrap_err();
        assert_eq!((e.kind, e.status, e.fault()), (ErrorKind::Rejected, Some(400), Fault::Request));
        assert!(client.available(0), "request faults do not open the breaker");
    }

    /// A server that refuses every call, a minimal one too, refuses for its configuration: its
    /// requests get server faults (they wait, not charged), never request faults, and its breaker
    /// opens at once.
    #[tokio::test]
    async fn a_server_that_refuses_every_call_is_down_not_the_requests() {
        let fake = FakeLlm::new().always_fail(400).start().await.unwrap();
        let (hook, outcomes) = recording_hook();
        let client = LlmClient::with_options(&settings(&fake.url), ClientOptions { hook, ..ClientOptions::default() }).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert_eq!(
            *outcomes.lock().unwrap(),
            ["rejected", "endpoint_config", "unavailable", "unavailable"],
            "the list call, then its first prompt counted as the endpoint's once judged, then the open breaker"
        );
        for r in &results {
            assert_eq!(r.as_ref().unwrap_err().fault(), Fault::Server, "{r:?}");
        }
        let first = results[0].as_ref().unwrap_err();
        assert_eq!((first.kind, first.status), (ErrorKind::EndpointConfig, Some(400)), "{first:?}");
        assert!(!client.available(0), "the breaker opened");
        assert_eq!(fake.call_count(), 3, "the list call, the first prompt, the minimal call; then the open breaker fails fast");
    }

    /// vLLM answers 400 to every chat call when the model has no chat template, while its
    /// completions work. After a restart so (chat calls were answered before), chat requests get
    /// server faults, the breaker opens, and its probes keep it open while the chat API refuses
    /// its minimal call, though the one-token completion passes; once the server answers chat
    /// again, the next probe closes it and the requests are answered.
    #[tokio::test]
    async fn a_chat_api_that_refuses_every_call_is_down_until_it_answers_again() {
        let fake = FakeLlm::new().start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let reqs = vec![(chat("one"), Map::new()), (chat("two"), Map::new())];
        assert!(run(&client, &reqs).await.iter().all(Result::is_ok));
        fake.set_chat_refused(true);
        let results = run(&client, &reqs).await;
        for r in &results {
            assert_eq!(r.as_ref().unwrap_err().fault(), Fault::Server, "{r:?}");
        }
        let refused = results.iter().filter_map(|r| r.as_ref().err()).find(|e| e.kind == ErrorKind::EndpointConfig).expect("an endpoint fault");
        assert!(refused.message.contains(llm_fakes::fake::NO_CHAT_TEMPLATE), "{}", refused.message);
        assert!(!client.available(0));
        // The half-open probe: the one-token completion, then the minimal chat call.
        let probed = tokio::time::timeout(Duration::from_secs(20), fake.wait_for_calls(fake.call_count() + 2)).await;
        assert!(probed.is_ok(), "no half-open probe: {:?}", fake.calls());
        let minimal_chat_refusals =
            fake.calls().iter().filter(|c| c.path == "/v1/chat/completions" && c.status == 400 && !c.prompts[0].contains("Be brief.")).count();
        assert!(minimal_chat_refusals >= 2, "the probe did not ask the chat API again: {:?}", fake.calls());
        assert!(!client.available(0), "a passing one-token completion does not close it while chat refuses");
        fake.set_chat_refused(false);
        let back = tokio::time::timeout(Duration::from_secs(20), client.wait_available(0, &CancellationToken::new())).await;
        assert_eq!(back.ok(), Some(true), "closed once the chat API answers its minimal call");
        assert!(run(&client, &reqs).await.iter().all(Result::is_ok));
    }

    /// A request naming a model the server does not serve (vLLM answers 404 "The model `…` does
    /// not exist.") is refused for its own model, while the configured `llm.model` is served: a
    /// request fault, not retried, that never counts against the endpoint, however many come in
    /// a row (a hard fault each, they used to open the breaker after 5).
    #[tokio::test]
    async fn a_request_for_a_model_the_server_lacks_is_refused_alone() {
        let fake = FakeLlm::new().model("m").strict_model().start().await.unwrap();
        let (hook, outcomes) = recording_hook();
        let client = LlmClient::with_options(&settings(&fake.url), ClientOptions { hook, ..ClientOptions::default() }).unwrap();
        let reqs = three_prompts(&Map::new());
        for round in 0..6 {
            let mut its = items(&reqs);
            its[0].model = Some("typo");
            its[1].model = Some("typo");
            let results = client.infer(0, &its, &CancellationToken::new()).await;
            for r in &results[..2] {
                let e = r.as_ref().unwrap_err();
                assert_eq!((e.kind, e.status, e.fault()), (ErrorKind::Rejected, Some(404), Fault::Request), "round {round}: {e:?}");
                assert!(e.message.contains("The model `typo` does not exist."), "{}", e.message);
            }
            assert!(results[2].is_ok(), "round {round}: {:?}", results[2]);
            assert!(client.available(0), "round {round}: the breaker opened for a request's model");
        }
        let typo_calls = fake.calls().iter().filter(|c| c.model.as_deref() == Some("typo")).count();
        assert_eq!(typo_calls, 6, "one list call per round, not retried nor split");
        let outcomes = outcomes.lock().unwrap();
        assert_eq!(outcomes.iter().filter(|&&o| o == "rejected").count(), 6, "counted as refusals of the requests: {outcomes:?}");
        assert!(!outcomes.contains(&"endpoint_config"), "{outcomes:?}");
    }

    /// A 404 for the configured model itself is the endpoint's (a wrong URL or `llm.model`): a
    /// server fault, as before.
    #[tokio::test]
    async fn a_404_for_the_configured_model_is_the_endpoints_fault() {
        let fake = FakeLlm::new().model("served").strict_model().start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        for r in &results {
            let e = r.as_ref().unwrap_err();
            assert_eq!((e.kind, e.fault()), (ErrorKind::EndpointConfig, Fault::Server), "{e:?}");
        }
    }

    /// A server without a completions API (404 there) that serves chat: once its breaker opened
    /// (here for refused connections during a restart), the one-token completion cannot close it
    /// again, so the probe asks the chat API then; the breaker closes once the server is back.
    #[tokio::test]
    async fn a_chat_only_server_is_probed_on_its_chat_api() {
        let fake = FakeLlm::new().chat_only().start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let reqs = vec![(chat("one"), Map::new())];
        assert!(run(&client, &reqs).await[0].is_ok());
        fake.set_refuse(true).await;
        assert!(client.confirm_server_fault(0).await, "refused connections: down");
        assert!(!client.available(0));
        fake.set_refuse(false).await;
        let back = tokio::time::timeout(Duration::from_secs(20), client.wait_available(0, &CancellationToken::new())).await;
        assert_eq!(back.ok(), Some(true), "the probe's chat call closes the breaker");
        assert!(run(&client, &reqs).await[0].is_ok());
    }

    /// A chat-only gateway whose completions API answers 400 (as Azure OpenAI does for a chat
    /// deployment), not 404: when its chat backend fails every call, the one-token completion's
    /// 400 must not pass the probe, or the outage is charged to the requests. Observed: the
    /// probe took the 400 as a healthy server's answer, so the breaker never opened.
    #[tokio::test]
    async fn a_chat_outage_behind_a_completions_400_is_the_servers_fault() {
        const AZURE: &str = "The completion operation does not work with the specified model. Please choose different model and try again.";
        let fake = FakeLlm::new().chat_only_answering(400, AZURE).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let reqs = vec![(chat("one"), Map::new())];
        assert!(run(&client, &reqs).await[0].is_ok());
        assert_eq!(client.probe(0, false).await, Outcome::Success, "healthy: the chat call answers");
        fake.set_garbage(true);
        assert!(run(&client, &reqs).await[0].is_err());
        assert!(client.confirm_server_fault(0).await, "chat fails: the server's fault, whatever completions answer");
        assert!(!client.available(0), "the breaker opened");
        fake.set_garbage(false);
        let back = tokio::time::timeout(Duration::from_secs(20), client.wait_available(0, &CancellationToken::new())).await;
        assert_eq!(back.ok(), Some(true), "the probe's chat call closes the breaker");
        assert!(run(&client, &reqs).await[0].is_ok());
    }

    /// Completions requests on a server without a completions API (404 there) that serves chat:
    /// server faults (they wait, not charged), and the endpoint stays down while its probes'
    /// completions call is refused, though its chat API answers.
    #[tokio::test]
    async fn completions_requests_on_a_chat_only_server_wait_for_its_completions_api() {
        let fake = FakeLlm::new().chat_only().start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        for r in &results {
            let e = r.as_ref().unwrap_err();
            assert_eq!((e.kind, e.fault()), (ErrorKind::EndpointConfig, Fault::Server), "{e:?}");
        }
        assert!(client.confirm_server_fault(0).await, "the endpoint is down for its completions requests");
        let probed = tokio::time::timeout(Duration::from_secs(20), fake.wait_for_calls(fake.call_count() + 2)).await;
        assert!(probed.is_ok(), "no half-open probe: {:?}", fake.calls());
        assert!(!client.available(0), "a minimal chat call does not close it while completions are refused");
        assert!(fake.calls().iter().all(|c| c.path == "/v1/completions"), "no chat fallback once completions requests met the refusal");
    }

    /// A minimal call that fails on an open connection goes once more. The server here closes its
    /// first connection after reading the request's head, as a server does that answered a
    /// large body with 413 before reading it (observed: the kept-alive connection then failed
    /// the minimal call of the refusal's check with `Broken pipe`, and a request the server
    /// refused was charged as for a server fault, delivery after delivery).
    #[tokio::test]
    async fn a_minimal_call_on_a_connection_the_server_closed_goes_once_more() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let mut accepted = 0;
            loop {
                let (mut sock, _) = listener.accept().await.unwrap();
                accepted += 1;
                let mut buf = vec![0u8; 65536];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = sock.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                if accepted == 1 {
                    drop(sock); // closed before any answer
                    continue;
                }
                let body = r#"{"choices":[{"index":0,"text":"pong","finish_reason":"length"}]}"#;
                let answer = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
                sock.write_all(answer.as_bytes()).await.unwrap();
                return accepted;
            }
        });
        let client = LlmClient::new(&settings(&Url::parse(&url).unwrap())).unwrap();
        assert_eq!(client.minimal_call(0, CallKind::Completions).await, Ok(()));
        assert_eq!(server.await.unwrap(), 2, "sent once more, on a new connection");
    }

    /// Token counts come from the server: absurd ones (above [`MAX_REPORTED_TOKENS`]) count as
    /// not reported, and sums saturate instead of overflowing (a panic in a debug build, a
    /// wrapped count in a release build). Observed before: a server reporting 2^64 − 1 prompt and
    /// cached tokens for a prompt made `llm_prompt_tokens_total` go back by one per call.
    #[test]
    fn token_counts_from_the_server_saturate() {
        let max = u64::MAX;
        let answer = json!({"choices": [
            {"text": "a", "usage": {"prompt_tokens": max, "prompt_tokens_details": {"cached_tokens": max}}},
            {"text": "b", "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}},
        ]});
        assert_eq!(usage_totals(&answer), (7, 3), "the absurd usage is dropped");
        let big = MAX_REPORTED_TOKENS;
        let answer = json!({"choices": [
            {"text": "a", "usage": {"prompt_tokens": big, "prompt_tokens_details": {"cached_tokens": big + 1}}},
        ]});
        assert_eq!(usage_totals(&answer), (big, 0), "the largest count is taken, a cached count above it is not");
        let timings = json!({"prompt_n": max, "cache_n": 5, "predicted_n": 1});
        assert_eq!(parse_usage(None, Some(&timings)), None);
        let timings = json!({"prompt_n": big, "cache_n": 5, "predicted_n": 1});
        assert_eq!(parse_usage(None, Some(&timings)).map(|u| u.prompt_tokens), Some(big + 5));
        let mut parsed = Parsed::default();
        parsed.add_tokens((max, 1));
        parsed.add_tokens((1, max));
        assert_eq!((parsed.prompt_tokens, parsed.cached_tokens), (max, max));
    }

    /// A leading byte order mark is skipped in answers as in requests (RFC 8259 §8.1). Observed
    /// before: such an answer counted as a server fault ("not JSON").
    #[test]
    fn an_answer_with_a_byte_order_mark_is_read() {
        let body = br#"{"choices":[{"index":0,"text":"a"}]}"#;
        let mut with_bom = b"\xEF\xBB\xBF".to_vec();
        with_bom.extend_from_slice(body);
        assert_eq!(valid_answer(&with_bom, CallKind::Completions, 1, 1), Ok(()));
        assert!(valid_answer(b"\xEF\xBB", CallKind::Completions, 1, 1).is_err());
    }

    #[tokio::test]
    async fn bad_json_is_retried() {
        let one = vec![(completion("alpha"), Map::new())];
        let fake = FakeLlm::new().bad_json_first(1).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &one).await;
        assert_eq!(fake.call_count(), 2);
        assert_eq!(results[0].as_ref().unwrap().attempts, 2);

        let fake = FakeLlm::new().bad_json_first(10).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let results = run(&client, &one).await;
        assert_eq!(fake.call_count(), 3);
        assert_eq!(results[0].as_ref().unwrap_err().kind, ErrorKind::InvalidResponse);
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
        its.push(InferenceItem { body: &reqs[0].0, model: Some("other"), params: &one, prefix_key: None });
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
    async fn a_waiting_batch_of_the_key_that_just_ran_goes_first() {
        // One permit. Batch a1 runs; b1 then a2 queue behind it. First come first served would
        // call the server a1, b1, a2 and let b1 overwrite the slot that holds a's prefix.
        for list_prompts in [true, false] {
            let fake = FakeLlm::new().latency(Duration::from_millis(50)).start().await.unwrap();
            let mut s = settings(&fake.url);
            (s.max_concurrency, s.list_prompts) = (NonZeroUsize::new(1).unwrap(), list_prompts);
            let client = LlmClient::new(&s).unwrap();
            let none = Map::new();
            let (a1, b1, a2) = (completion("a1"), completion("b1"), completion("a2"));
            let item = |body, key| [InferenceItem { body, model: None, params: &none, prefix_key: Some(key) }];
            let (ia1, ib1, ia2) = (item(&a1, 1), item(&b1, 2), item(&a2, 1));
            let cancel = CancellationToken::new();
            // `join!` polls in order: a1 takes the free permit, then b1 and a2 queue in that order.
            let (ra1, rb1, ra2) = tokio::join!(client.infer(0, &ia1, &cancel), client.infer(0, &ib1, &cancel), client.infer(0, &ia2, &cancel));
            assert!(ra1[0].is_ok() && rb1[0].is_ok() && ra2[0].is_ok());
            let order: Vec<String> = fake.calls().into_iter().flat_map(|c| c.prompts).collect();
            assert_eq!(order, ["a1", "a2", "b1"], "list_prompts = {list_prompts}");
            // Each waited for the permit while the calls before it ran (50 ms each).
            let wait = |r: &[Result<Completion, LlmError>]| r[0].as_ref().unwrap().permit_wait;
            let (wa1, wa2, wb1) = (wait(&ra1), wait(&ra2), wait(&rb1));
            assert!(wa1 < Duration::from_millis(50), "a1 found the permit free: {wa1:?}");
            assert!(wa2 >= Duration::from_millis(50) && wb1 >= Duration::from_millis(100), "a2 {wa2:?}, b1 {wb1:?}");
        }
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
    async fn a_bad_or_incomplete_list_answer_goes_again_prompt_by_prompt() {
        for fake in [FakeLlm::new().omit_choice(1), FakeLlm::new().bad_json_first(1)] {
            let fake = fake.start().await.unwrap();
            let client = LlmClient::new(&settings(&fake.url)).unwrap();
            let results = run(&client, &three_prompts(&Map::new())).await;
            assert_eq!(fake.call_count(), 4, "the list call is not retried as a whole");
            let outputs: Vec<Value> = results.into_iter().map(|r| r.unwrap().output).collect();
            assert_eq!(outputs, [json!("ok:alpha pr"), json!("ok:bravo pr"), json!("ok:charlie ")]);
        }
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
            assert!(!e.connection_lost, "a refused connection never reached the server: {e:?}");
        }
    }

    /// A server that reads the request and closes the connection without an answer (a process
    /// that dies during the call): `Connect`, and the call lost the server
    /// ([`LlmError::connection_lost`]), also when the later attempts are refused.
    #[tokio::test]
    async fn a_connection_closed_during_the_call_lost_the_server() {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        // The first connection is read from and closed; then the port refuses.
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            let _ = stream.read(&mut buf).await;
        });
        let client = LlmClient::new(&settings(&url)).unwrap();
        let results = run(&client, &[(completion("p"), Map::new())]).await;
        server.await.unwrap();
        let e = results.into_iter().next().unwrap().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Connect, "{e}");
        assert!(e.connection_lost, "the call lost the server: {e:?}");
    }

    #[tokio::test]
    async fn slow_server_times_out() {
        let fake = FakeLlm::new().latency(Duration::from_secs(30)).start().await.unwrap();
        let mut s = settings(&fake.url);
        s.request_timeout = Duration::from_millis(100);
        s.max_attempts = NonZeroU32::new(2).unwrap();
        let client = LlmClient::new(&s).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        // The list once (a list that timed out is not retried as one), then each prompt once, then
        // the first one's second attempt: the 5th timeout in a row makes the breaker suspect, its
        // probe times out too and the breaker opens (no budget given here to cut the sequence).
        let calls = fake.calls();
        assert_eq!(calls.iter().filter(|c| c.prompts != [PROBE_PROMPT]).map(|c| c.prompts.len()).collect::<Vec<_>>(), [3, 1, 1, 1, 1]);
        assert_eq!(client.breaker_state(0), Some(BreakerState::Open));
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::Timeout));
    }

    /// A listener that accepts connections and never answers: a hung server.
    /// A server that accepts connections and never answers (frozen) is found by the liveness
    /// check long before the request timeout: its calls end as connect faults and its breaker
    /// opens at once, without the request timeouts and the probe that would otherwise find it.
    #[tokio::test]
    async fn a_frozen_server_is_found_by_the_liveness_check() {
        let (url, _task) = hung_listener().await;
        let mut s = settings(&url);
        s.request_timeout = Duration::from_secs(60);
        s.liveness_check_after = Some(Duration::from_millis(200));
        let client = LlmClient::new(&s).unwrap();
        let started = Instant::now();
        let results = run(&client, &three_prompts(&Map::new())).await;
        let took = started.elapsed();
        for r in &results {
            let e = r.as_ref().unwrap_err();
            assert_eq!(e.kind, ErrorKind::Connect, "{e}");
            assert!(e.message.contains("stopped answering"), "{e}");
        }
        assert!(took < Duration::from_secs(30), "found only after {took:?} (the request timeout is 60 s)");
        assert_eq!(client.breaker_state(0), Some(BreakerState::Open));
    }

    /// A server slower than `llm.liveness_check_after` whose HTTP side answers (here a 404 to
    /// `GET /v1/models`: any status counts) is left alone: its calls are answered.
    #[tokio::test]
    async fn a_slow_server_that_answers_http_is_not_abandoned() {
        // Checks after 250 ms, each with 250 ms to answer (not 100: the lib tests run in
        // parallel on two cores), two missed ones to abandon the call: a frozen server would be
        // left by 750 ms, long before this one answers.
        let fake = FakeLlm::new().latency(Duration::from_millis(2000)).start().await.unwrap();
        let mut s = settings(&fake.url);
        s.liveness_check_after = Some(Duration::from_millis(250));
        let client = LlmClient::new(&s).unwrap();
        let results = run(&client, &three_prompts(&Map::new())).await;
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        assert_eq!(fake.call_count(), 1);
        assert_eq!(client.breaker_state(0), Some(BreakerState::Closed));
    }

    async fn hung_listener() -> (Url, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        (url, task)
    }

    /// A listener whose accept queue is full and that never accepts: the kernel drops further
    /// SYNs, so a connection cannot be made (as with an unreachable host). Returns the
    /// connections that fill the queue (keep them alive).
    async fn full_backlog_listener() -> (Url, tokio::net::TcpListener, Vec<tokio::net::TcpStream>) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut fill = Vec::new();
        // Backlog 0 holds one or two connections, depending on the kernel; fill until a connect hangs.
        for _ in 0..8 {
            match tokio::time::timeout(Duration::from_millis(200), tokio::net::TcpStream::connect(addr)).await {
                Ok(Ok(s)) => fill.push(s),
                _ => break,
            }
        }
        (Url::parse(&format!("http://{addr}")).unwrap(), listener, fill)
    }

    #[tokio::test]
    async fn a_connect_timeout_is_a_connect_failure_and_a_request_timeout_a_timeout() {
        // A bare reqwest client needs the process's rustls provider, which another test may not
        // have installed yet (this test alone, or first).
        crate::tls::install_crypto_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(100))
            .timeout(Duration::from_millis(400))
            .build()
            .unwrap();
        let (url, _listener, _fill) = full_backlog_listener().await;
        let e = http.post(url.join(COMPLETIONS_PATH).unwrap()).body("{}").send().await.unwrap_err();
        assert!(e.is_connect() && e.is_timeout(), "reqwest reports a connect timeout as both: {e:?}");
        assert_eq!(classify(Problem::Transport(&e)), ErrorKind::Connect, "the server is not reachable: a hard fault");
        let (url, hung) = hung_listener().await;
        let e = http.post(url.join(COMPLETIONS_PATH).unwrap()).body("{}").send().await.unwrap_err();
        assert!(e.is_timeout() && !e.is_connect(), "{e:?}");
        assert_eq!(classify(Problem::Transport(&e)), ErrorKind::Timeout, "connected, no answer in time: verified");
        hung.abort();
    }

    /// A prompt that on its own outlasts `llm.request_timeout` on a healthy server (every other
    /// call, the probe included, is answered at once): its calls fail with `timeout`, a server
    /// fault, but the breaker never opens; the timeouts that trip its rule are verified by a
    /// probe, which refutes them.
    #[tokio::test]
    async fn a_prompt_that_times_out_alone_never_opens_the_breaker() {
        let fake = FakeLlm::new().slow_prompts_containing("SLOW", Duration::from_secs(30)).start().await.unwrap();
        let mut s = settings(&fake.url);
        (s.request_timeout, s.max_attempts) = (Duration::from_millis(150), NonZeroU32::new(2).unwrap());
        let client = LlmClient::new(&s).unwrap();
        for round in 0..4 {
            let results = run(&client, &[(completion("a SLOW prompt"), Map::new())]).await;
            let e = results[0].as_ref().unwrap_err();
            assert_eq!((e.kind, e.fault()), (ErrorKind::Timeout, Fault::Server), "round {round}: {e}");
            assert_eq!(client.breaker_state(0), Some(BreakerState::Closed), "round {round}");
            let fine = run(&client, &[(completion("fine"), Map::new())]).await;
            assert_eq!(fine[0].as_ref().unwrap().output, json!("ok:fine"), "round {round}");
        }
        let calls = fake.calls();
        let probes = calls.iter().filter(|c| c.prompts == [PROBE_PROMPT]).count();
        let slow = calls.iter().filter(|c| c.prompts.iter().any(|p| p.contains("SLOW"))).count();
        assert_eq!(slow, 8, "every attempt was made: nothing failed fast");
        assert!(probes >= 1, "the timeouts tripped the rule and were verified ({probes} probes)");
    }

    /// A redirect is shown with where it points, without what may carry credentials.
    #[test]
    fn a_redirect_location_is_shown_without_credentials_or_query() {
        assert_eq!(shown_location("https://user:pw@llm.internal:8443/v1/completions?sig=abc#x"), "https://llm.internal:8443/v1/completions");
        assert_eq!(shown_location("/v1/completions?token=abc"), "/v1/completions");
    }

    /// The observed case of one prompt outlasting `llm.request_timeout` in a list-prompt call of
    /// 8: the whole list was retried `llm.max_attempts` times, then its prompts one by one with
    /// the slow one retried as often again, so the 7 answered prompts were held twice the time
    /// the `amqp.consumer_timeout` check allows for, and the broker's guard requeued all 8. Now
    /// the list goes prompt by prompt after its first timeout and the slow prompt is not retried
    /// within the sequence: 2 calls carry it, not 6, and the other 7 are answered.
    #[tokio::test]
    async fn a_list_call_that_times_out_goes_again_prompt_by_prompt_at_once() {
        let fake = FakeLlm::new().slow_prompts_containing("SLOW", Duration::from_secs(30)).start().await.unwrap();
        let mut s = settings(&fake.url);
        (s.request_timeout, s.max_attempts) = (Duration::from_millis(300), NonZeroU32::new(4).unwrap());
        let client = LlmClient::new(&s).unwrap();
        let reqs: Vec<_> = (0..8).map(|i| (completion(&if i == 3 { format!("p{i} SLOW") } else { format!("p{i}") }), Map::new())).collect();
        let started = Instant::now();
        // The time of 4 attempts (as `Settings::llm_call_budget`, backoffs aside): the list's
        // timeout and the slow prompt's leave room for the prompts behind it.
        let deadline = Some(Instant::now() + Duration::from_millis(1200));
        let results = client.infer_within(0, &items(&reqs), &CancellationToken::new(), deadline).await;
        let took = started.elapsed();
        for (i, r) in results.iter().enumerate() {
            match i {
                3 => assert_eq!(r.as_ref().unwrap_err().kind, ErrorKind::Timeout),
                _ => assert_eq!(r.as_ref().unwrap().output, json!(format!("ok:p{i}")), "prompt {i}"),
            }
        }
        let calls = fake.calls();
        let slow = calls.iter().filter(|c| c.prompts.iter().any(|p| p.contains("SLOW"))).count();
        assert!((2..=4).contains(&slow), "the list once, then the slow prompt on its own within the budget: {slow} calls");
        assert_eq!(calls.iter().filter(|c| c.prompts.len() == 8).count(), 1, "the list is not retried");
        // The 7 were answered in the first pass, before the slow prompt's retries.
        let first_single_slow = calls.iter().position(|c| c.prompts.len() == 1 && c.prompts[0].contains("SLOW")).unwrap();
        let after: Vec<_> = calls[first_single_slow + 1..].iter().filter(|c| c.prompts != [PROBE_PROMPT]).collect();
        let quick_after = after.iter().take_while(|c| !c.prompts[0].contains("SLOW")).count();
        assert_eq!(quick_after, 4, "p4..p7 went before the slow prompt's retries: {:?}", after.iter().map(|c| &c.prompts).collect::<Vec<_>>());
        assert!(took < Duration::from_millis(1600), "took {took:?}: within the budget and one request timeout");
    }

    /// Prompts sent one after the other (`llm.list_prompts = false`) behind slow ones: a prompt
    /// whose call could not end by the deadline is not sent (the partition puts it back
    /// uncharged).
    #[tokio::test]
    async fn a_sequence_slowed_by_timeouts_stops_at_its_deadline() {
        let fake = FakeLlm::new().slow_prompts_containing("SLOW", Duration::from_secs(30)).start().await.unwrap();
        let mut s = settings(&fake.url);
        (s.request_timeout, s.max_attempts, s.list_prompts) = (Duration::from_millis(200), NonZeroU32::new(2).unwrap(), false);
        let client = LlmClient::new(&s).unwrap();
        let deadline = Some(Instant::now() + Duration::from_millis(500));
        let reqs: Vec<_> = ["a SLOW", "b SLOW", "c SLOW", "d"].iter().map(|p| (completion(p), Map::new())).collect();
        let results = client.infer_within(0, &items(&reqs), &CancellationToken::new(), deadline).await;
        let kinds: Vec<_> = results.iter().map(|r| r.as_ref().err().map(|e| e.kind)).collect();
        assert_eq!(kinds, [Some(ErrorKind::Timeout), Some(ErrorKind::Timeout), Some(ErrorKind::Cancelled), Some(ErrorKind::Cancelled)]);
        assert!(results[3].as_ref().unwrap_err().message.starts_with("not sent"), "{:?}", results[3]);
        let slow = fake.calls().iter().filter(|c| c.prompts.iter().any(|p| p.contains("SLOW"))).count();
        assert_eq!(slow, 2, "no timeout retried within the sequence, the third slow prompt not sent");
    }

    /// What goes to `early` before the calls end: in a sequence with a slow prompt retried
    /// after the others, every other prompt's answer and refusal, each once it comes; never the
    /// slow prompt's timeout (a server fault, which the caller may send again). The last item
    /// of the results is the same as what went early.
    #[tokio::test]
    async fn answers_final_before_a_slow_prompts_retries_go_early() {
        let fake = FakeLlm::new().slow_prompts_containing("SLOW", Duration::from_secs(30)).fail_prompts_containing("REFUSED", 400).start().await.unwrap();
        let mut s = settings(&fake.url);
        (s.request_timeout, s.max_attempts, s.list_prompts) = (Duration::from_millis(300), NonZeroU32::new(3).unwrap(), false);
        let client = LlmClient::new(&s).unwrap();
        let reqs: Vec<_> = ["a SLOW", "b", "c REFUSED", "d"].iter().map(|p| (completion(p), Map::new())).collect();
        let early: Mutex<Vec<(usize, bool, Instant)>> = Mutex::new(Vec::new());
        let note = |i: usize, r: &Result<Completion, LlmError>| early.lock().unwrap().push((i, r.is_ok(), Instant::now()));
        let results = client.infer_answering_early(0, &items(&reqs), &CancellationToken::new(), None, Some(&note)).await;
        let ended = Instant::now();
        let kinds: Vec<_> = results.iter().map(|r| r.as_ref().err().map(|e| e.kind)).collect();
        assert_eq!(kinds, [Some(ErrorKind::Timeout), None, Some(ErrorKind::Rejected), None]);
        let early = early.into_inner().unwrap();
        let given: Vec<(usize, bool)> = early.iter().map(|&(i, ok, _)| (i, ok)).collect();
        assert_eq!(given, [(1, true), (2, false), (3, true)], "the answers and the refusal, in order, not the timeout");
        // The slow prompt's 2 retries (300 ms each) came after the last of them.
        assert!(early.iter().all(|&(_, _, at)| at + Duration::from_millis(500) < ended), "{early:?} ended {ended:?}");
        let slow = fake.calls().iter().filter(|c| c.prompts.iter().any(|p| p.contains("SLOW"))).count();
        assert_eq!(slow, 3, "the slow prompt's 3 attempts");

        // Chat calls run side by side: those that end before the slow one's retries go early.
        let chats: Vec<_> = ["SLOW", "x", "y"].iter().map(|p| (chat(p), Map::new())).collect();
        let given: Mutex<Vec<usize>> = Mutex::new(Vec::new());
        let note = |i: usize, _: &Result<Completion, LlmError>| given.lock().unwrap().push(i);
        let results = client.infer_answering_early(0, &items(&chats), &CancellationToken::new(), None, Some(&note)).await;
        assert!(results[0].as_ref().is_err_and(|e| e.kind == ErrorKind::Timeout) && results[1..].iter().all(Result::is_ok), "{results:?}");
        let mut given = given.into_inner().unwrap();
        given.sort_unstable();
        assert_eq!(given, [1, 2]);
    }

    /// The observed case: a sequence of prompts each answered well within `llm.request_timeout`
    /// (1.5 s each, 8 of them, `llm.request_timeout = 4s`) outlasted the partition's
    /// `amqp.consumer_timeout` guard, which returned all 8 charged, the answered ones with them.
    /// Now no call starts that could not end by the deadline, timeouts or not: the prompts before
    /// it are answered, the rest not sent.
    #[tokio::test]
    async fn a_sequence_of_slow_answers_stops_at_its_deadline_without_timeouts() {
        let fake = FakeLlm::new().slow_prompts_containing("q", Duration::from_millis(100)).start().await.unwrap();
        let mut s = settings(&fake.url);
        (s.request_timeout, s.list_prompts) = (Duration::from_secs(1), false);
        let client = LlmClient::new(&s).unwrap();
        let quick: Vec<_> = (0..30).map(|i| (completion(&format!("q{i}")), Map::new())).collect();
        let deadline = Some(Instant::now() + Duration::from_millis(2500));
        let results = client.infer_within(0, &items(&quick), &CancellationToken::new(), deadline).await;
        let answered = results.iter().take_while(|r| r.is_ok()).count();
        // Each call takes ≥ 100 ms and none starts after 1.5 s: at most 16 (about 15 on an idle
        // machine), the 30 taking ≥ 3 s.
        assert!((1..=16).contains(&answered), "{answered} answered: {results:?}");
        for r in &results[answered..] {
            let e = r.as_ref().unwrap_err();
            assert!(e.kind == ErrorKind::Cancelled && e.message.starts_with("not sent"), "{e}");
        }
        assert_eq!(fake.calls().len(), answered, "the prompts not sent made no call");
    }

    /// A wait for an endpoint permit counts: a call whose permit came too late to end by the
    /// deadline is not sent, in a sequence, a one-prompt call and a chat call alike.
    #[tokio::test]
    async fn a_call_whose_permit_comes_too_late_for_its_deadline_is_not_sent() {
        let fake = FakeLlm::new().slow_prompts_containing("SLOW", Duration::from_secs(30)).start().await.unwrap();
        let mut s = settings(&fake.url);
        (s.request_timeout, s.max_attempts, s.max_concurrency) = (Duration::from_millis(400), NonZeroU32::new(1).unwrap(), NonZeroUsize::new(1).unwrap());
        let client = LlmClient::new(&s).unwrap();
        let slow = [(completion("SLOW"), Map::new())];
        let waiting = [(completion("w1"), Map::new()), (completion("w2"), Map::new())];
        let one = [(completion("one"), Map::new())];
        let chat_one = [(chat("hello"), Map::new())];
        let cancel = CancellationToken::new();
        // The slow call holds the only permit for 400 ms; the others' calls may start until 100 ms.
        let deadline = Some(Instant::now() + Duration::from_millis(500));
        let (slow, waiting, one, chat_one) = (items(&slow), items(&waiting), items(&one), items(&chat_one));
        let (held, seq, single, chatted) = tokio::join!(
            client.infer(0, &slow, &cancel),
            client.infer_within(0, &waiting, &cancel, deadline),
            client.infer_within(0, &one, &cancel, deadline),
            client.infer_within(0, &chat_one, &cancel, deadline),
        );
        assert_eq!(held[0].as_ref().unwrap_err().kind, ErrorKind::Timeout);
        for r in seq.iter().chain(&single).chain(&chatted) {
            let e = r.as_ref().unwrap_err();
            assert!(e.kind == ErrorKind::Cancelled && e.message.starts_with("not sent"), "{e}");
        }
        let others = fake.calls().into_iter().filter(|c| c.prompts != [PROBE_PROMPT] && !c.prompts.iter().any(|p| p.contains("SLOW"))).count();
        assert_eq!(others, 0, "a call not sent reached the server");
    }

    /// A server too slow for every real call but quick to answer the one-token probe (overloaded,
    /// or an `llm.request_timeout` too short for its model): the timeouts are the server's, not
    /// the requests'. The breaker opens, so the requests wait for the endpoint uncharged, instead
    /// of being charged a delivery each round until every one of them is dead-lettered.
    #[tokio::test]
    async fn a_server_too_slow_for_every_real_call_opens_the_breaker_though_it_answers_the_probe() {
        let fake = FakeLlm::new().slow_prompts_containing("question", Duration::from_secs(30)).start().await.unwrap();
        let mut s = settings(&fake.url);
        (s.request_timeout, s.max_attempts) = (Duration::from_millis(150), NonZeroU32::new(2).unwrap());
        let ask = |i: usize| [(completion(&format!("question {i}")), Map::new())];
        // The partition's check after one failed batch.
        let client = LlmClient::new(&s).unwrap();
        let results = run(&client, &ask(0)).await;
        assert_eq!(results[0].as_ref().unwrap_err().kind, ErrorKind::Timeout);
        assert!(client.confirm_server_fault(0).await, "down, though the probe passed: no real call was answered");
        assert_eq!(client.breaker_state(0), Some(BreakerState::Open));
        // The breaker's own rule: the 5th timeout in a row makes it suspect, its verification
        // probe passes, and it opens all the same.
        let client = LlmClient::new(&s).unwrap();
        for i in 0..3 {
            run(&client, &ask(i)).await;
        }
        assert_eq!(client.breaker_state(0), Some(BreakerState::Open));
        let probes = fake.calls().iter().filter(|c| c.prompts == [PROBE_PROMPT] && c.status == 200).count();
        assert!(probes >= 2, "both verdicts came from passing probes ({probes})");
    }

    /// A request that times out on its own with nothing else answered meanwhile is judged by a
    /// replay of a call the endpoint answered before, of the timed-out call's API first.
    #[tokio::test]
    async fn a_timeout_alone_is_judged_by_replaying_an_answered_call_of_its_api() {
        let fake = FakeLlm::new().slow_prompts_containing("SLOW", Duration::from_secs(30)).start().await.unwrap();
        let mut s = settings(&fake.url);
        (s.request_timeout, s.max_attempts) = (Duration::from_millis(300), NonZeroU32::new(1).unwrap());
        let client = LlmClient::new(&s).unwrap();
        assert!(run(&client, &[(completion("a completions question"), Map::new())]).await[0].is_ok());
        assert!(run(&client, &[(chat("a chat question"), Map::new())]).await[0].is_ok());
        let results = run(&client, &[(chat("SLOW chat"), Map::new())]).await;
        assert_eq!(results[0].as_ref().unwrap_err().kind, ErrorKind::Timeout);
        assert!(!client.confirm_server_fault(0).await, "the replay was answered in time: the timeout is the request's own");
        assert_eq!(client.breaker_state(0), Some(BreakerState::Closed));
        let calls = fake.calls();
        let sent = |text: &str| calls.iter().filter(|c| c.prompts.iter().any(|p| p.contains(text))).count();
        assert_eq!((sent("a chat question"), sent("a completions question")), (2, 1), "the chat call was replayed");
        // Without a call answered before, the passing probe alone opens the breaker.
        let client = LlmClient::new(&s).unwrap();
        run(&client, &[(chat("SLOW chat"), Map::new())]).await;
        assert!(client.confirm_server_fault(0).await, "no call to replay: down");
        assert_eq!(client.breaker_state(0), Some(BreakerState::Open));
    }

    /// An endpoint whose first calls time out has no call of its own to replay: a typical call
    /// another endpoint answered judges its timeouts (observed with two llama-servers: one got
    /// the slow requests first, its breaker opened again and again and it answered none of 40
    /// normal requests).
    #[tokio::test]
    async fn an_endpoint_with_nothing_answered_yet_replays_a_call_another_endpoint_answered() {
        let a = FakeLlm::new().slow_prompts_containing("SLOW", Duration::from_secs(30)).start().await.unwrap();
        let b = FakeLlm::new().start().await.unwrap();
        let mut s = settings(&a.url);
        s.endpoints.push(b.url.clone());
        (s.request_timeout, s.max_attempts) = (Duration::from_millis(300), NonZeroU32::new(1).unwrap());
        let client = LlmClient::new(&s).unwrap();
        let normal = [(chat("a chat question"), Map::new())];
        assert!(client.infer(1, &items(&normal), &CancellationToken::new()).await[0].is_ok());
        let results = run(&client, &[(chat("SLOW chat"), Map::new())]).await;
        assert_eq!(results[0].as_ref().unwrap_err().kind, ErrorKind::Timeout);
        assert!(!client.confirm_server_fault(0).await, "the borrowed call was answered in time: the timeout is the request's own");
        assert_eq!(client.breaker_state(0), Some(BreakerState::Closed));
        let replayed: Vec<_> = a.calls().into_iter().filter(|c| c.prompts.iter().any(|p| p.contains("a chat question"))).collect();
        assert_eq!(replayed.len(), 1, "endpoint 1's call was replayed on endpoint 0");
        assert_eq!(replayed[0].path, "/v1/chat/completions");
    }

    /// Partitions whose batches failed at about the same time share one probe: those that ask
    /// while it runs wait for its verdict; one asking after it ended probes again.
    #[tokio::test]
    async fn checks_asked_while_one_runs_share_its_probe() {
        let fake = FakeLlm::new().latency(Duration::from_millis(300)).start().await.unwrap();
        let client = LlmClient::new(&settings(&fake.url)).unwrap();
        let probes = || fake.calls().iter().filter(|c| c.prompts == [PROBE_PROMPT]).count();
        let verdicts = futures_util::future::join_all((0..4).map(|_| client.confirm_server_fault(0))).await;
        assert_eq!(verdicts, [false; 4], "the endpoint answers its probe");
        assert_eq!(probes(), 1, "one probe for 4 checks asked at once");
        assert!(!client.confirm_server_fault(0).await);
        assert_eq!(probes(), 2, "a check asked after the probe ended probes again");
    }

    /// A hung server: every call times out, the probe too. The timeouts make the breaker
    /// suspect; the verification probe, limited to min(request_timeout, PROBE_TIMEOUT_MAX), times
    /// out as well and the breaker opens; the partition's own check confirms the outage.
    #[tokio::test]
    async fn a_hung_server_times_out_its_probe_too_and_opens_the_breaker() {
        let fake = FakeLlm::new().latency(Duration::from_secs(30)).start().await.unwrap();
        let mut s = settings(&fake.url);
        (s.request_timeout, s.max_attempts) = (Duration::from_millis(150), NonZeroU32::new(3).unwrap());
        let client = LlmClient::new(&s).unwrap();
        let reqs = three_prompts(&Map::new());
        // The list, each prompt alone, then the first prompt's second attempt: the 5th timeout in
        // a row makes the breaker suspect; the call waits for the verification probe, which
        // times out too: open, no further attempt.
        let results = run(&client, &reqs).await;
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::Timeout), "{results:?}");
        assert_eq!(client.breaker_state(0), Some(BreakerState::Open));
        assert!(client.confirm_server_fault(0).await, "down: the requests wait, uncharged");
        let calls = fake.calls();
        let probes: Vec<_> = calls.iter().filter(|c| c.prompts == [PROBE_PROMPT]).collect();
        assert_eq!((calls.len() - probes.len(), probes.len()), (5, 1), "5 timed-out calls, 1 verification probe");
        let results = run(&client, &reqs).await;
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::Unavailable), "open: fail fast");
        assert_eq!(fake.call_count(), 6, "no call while open");

        // The partition's check alone (fewer than 5 timeouts, as a batch of one prompt meets):
        // its probe times out and trips the breaker.
        let client = LlmClient::new(&s).unwrap();
        let results = run(&client, &reqs[..1]).await;
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::Timeout));
        assert_eq!(client.breaker_state(0), Some(BreakerState::Closed), "3 timeouts: not yet");
        let started = Instant::now();
        assert!(client.confirm_server_fault(0).await);
        assert!(started.elapsed() < Duration::from_secs(5), "the probe is bounded by the request timeout");
        assert_eq!(client.breaker_state(0), Some(BreakerState::Open));
        assert_eq!(client.inner.probe_timeout, Duration::from_millis(150));
        s.request_timeout = Duration::from_secs(300);
        assert_eq!(LlmClient::new(&s).unwrap().inner.probe_timeout, PROBE_TIMEOUT_MAX, "capped");
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

    /// Observed: a server that quotes the `Authorization` header in its error body (a gateway's
    /// "Incorrect API key provided: Bearer sk-…") had the token relayed into the log and into
    /// the error result the requester received. The error says `***` where the token was.
    #[tokio::test]
    async fn a_token_the_server_echoes_in_an_error_is_masked() {
        let fake = FakeLlm::new().fail_prompts_containing("POISON", 400).echo_authorization().start().await.unwrap();
        let mut s = settings(&fake.url);
        s.api_key = Some(Secret::new("sk-echoed-4711"));
        let client = LlmClient::new(&s).unwrap();
        let results = run(&client, &[(completion("POISON prompt"), Map::new())]).await;
        let e = results[0].as_ref().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Rejected, "{e:?}");
        assert!(e.message.contains("request authorization: Bearer ***") && !e.message.contains("sk-echoed-4711"), "{}", e.message);
    }

    /// The bodies the daemon repeats are JSON: a token with `"`, `\` or `/` is masked in its
    /// escaped forms too (`\"`, `\\`, and `\/` as PHP's `json_encode` writes a slash).
    #[test]
    fn a_token_is_masked_in_its_json_escaped_forms() {
        mask_token("sk-a/b\"c\\d-0042");
        for body in [
            r#"{"error": "auth Bearer sk-a/b\"c\\d-0042"}"#,
            r#"{"error": "auth Bearer sk-a\/b\"c\\d-0042"}"#,
            "plain auth Bearer sk-a/b\"c\\d-0042",
        ] {
            let shown = preview(body.as_bytes());
            assert!(shown.contains("Bearer ***") && !shown.contains("0042"), "{body} -> {shown}");
        }
        // Percent-encoded and `\u`-escaped, with either case of hex digits.
        mask_token("sk-b64/x+y=z-0043");
        for body in [
            "key sk-b64%2Fx%2By%3Dz-0043",
            "key sk-b64%2fx%2by%3dz-0043",
            r#"{"key": "sk\u002db64\u002fx\u002by\u003dz\u002d0043"}"#,
            r#"{"key": "sk\u002Db64\u002Fx\u002By\u003Dz\u002D0043"}"#,
            r#"{"key": "sk-b64\u002fx\u002by=z-0043"}"#,
            "key sk-b64%2Fx+y%3dz-0043",
        ] {
            let shown = preview(body.as_bytes());
            assert!(shown.contains("***") && !shown.contains("0043"), "{body} -> {shown}");
        }
    }

    /// Server text goes into log lines with its control, bidirectional and invisible characters
    /// escaped. Observed before: a plain-text 500 holding `\n` and a line that looked like the
    /// daemon's own (`… ERROR prefix_batcher::app: …`) made a forged log line, and ESC and U+202E
    /// reached the log raw.
    #[test]
    fn server_text_cannot_forge_or_disguise_a_log_line() {
        let body = "oops\n2026-12-07T17:00:00.000000Z ERROR prefix_batcher::app: FORGED\r\u{1b}[31mred\u{202e}txt\u{200b}\0";
        let shown = preview(body.as_bytes());
        assert!(!shown.chars().any(crate::request::is_control_like), "{shown:?}");
        assert!(shown.contains("oops\\n2026") && shown.contains("\\u{1b}[31m") && shown.contains("\\u{202e}"), "{shown}");
        assert_eq!(preview("naïve — ok".as_bytes()), "naïve — ok", "other text is kept");
        let long = "é".repeat(ERROR_BODY_PREVIEW_CHARS + 1);
        assert!(preview(long.as_bytes()).ends_with('…'));
        assert!(!preview("é".repeat(ERROR_BODY_PREVIEW_CHARS).as_bytes()).ends_with('…'));
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

    /// With `amqp.partitions` given, N endpoints are the homes of ⌊P/N⌋ or ⌈P/N⌉ partitions each,
    /// whatever their URLs; every ranking holds each endpoint once, and the same endpoints in
    /// another order give the same homes. Plain rendezvous hashing (no partition count) leaves
    /// some of these deployments unbalanced by more than one partition (checked, so that the
    /// balance is the option's doing).
    #[test]
    fn home_endpoints_are_balanced_over_the_partitions() {
        let homes = |client: &LlmClient, partitions: u32, n: usize| {
            let mut count = vec![0usize; n];
            for p in 0..partitions {
                let order = client.endpoint_ranking(p);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "partition {p}: every endpoint once");
                count[order[0]] += 1;
            }
            count
        };
        let mut unbalanced_plain = 0;
        for (deployment, (partitions, n)) in [(8u32, 2usize), (16, 2), (16, 3), (64, 2), (64, 4), (24, 5)].into_iter().cycle().take(60).enumerate() {
            let urls: Vec<Url> = (0..n).map(|i| Url::parse(&format!("http://10.0.{deployment}.{i}:{}/", 8000 + deployment)).unwrap()).collect();
            let mut s = settings(&urls[0]);
            s.endpoints = urls.clone();
            let options = || ClientOptions { partitions, ..ClientOptions::default() };
            let balanced = LlmClient::with_options(&s, options()).unwrap();
            let count = homes(&balanced, partitions, n);
            let (lo, hi) = (*count.iter().min().unwrap(), *count.iter().max().unwrap());
            assert!(hi - lo <= 1, "{partitions} partitions over {n} endpoints: homes {count:?}");
            s.endpoints.reverse();
            let reversed = LlmClient::with_options(&s, options()).unwrap();
            for p in 0..partitions {
                let name = |c: &LlmClient| c.endpoint_name(c.endpoint_ranking(p)[0]).unwrap().to_owned();
                assert_eq!(name(&balanced), name(&reversed), "partition {p}: the home does not depend on the list's order");
            }
            s.endpoints = urls;
            let count = homes(&LlmClient::new(&s).unwrap(), partitions, n);
            unbalanced_plain += usize::from(count.iter().max().unwrap() - count.iter().min().unwrap() > 1);
        }
        assert!(unbalanced_plain > 10, "plain rendezvous hashing was unbalanced in only {unbalanced_plain} of 60 deployments");
    }

    #[test]
    fn new_rejects_bad_configuration() {
        let mut s = settings(&Url::parse("ftp://llm:21").unwrap());
        assert_eq!(LlmClient::new(&s).unwrap_err().kind, ErrorKind::EndpointConfig);
        s.endpoints.clear();
        assert_eq!(LlmClient::new(&s).unwrap_err().kind, ErrorKind::EndpointConfig);
    }

    #[tokio::test]
    async fn out_of_range_endpoint_fails_every_item() {
        let client = LlmClient::new(&settings(&Url::parse("http://127.0.0.1:9").unwrap())).unwrap();
        let reqs = three_prompts(&Map::new());
        let results = client.infer(5, &items(&reqs), &CancellationToken::new()).await;
        assert_eq!(results.len(), 3);
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::EndpointConfig));
        assert!(client.infer(0, &[], &CancellationToken::new()).await.is_empty());
    }

    #[test]
    fn statuses_are_classified_into_request_and_server_faults() {
        let c = |s| classify(Problem::Status(s));
        let server = [(429, ErrorKind::RateLimited), (408, ErrorKind::Timeout), (500, ErrorKind::Server), (503, ErrorKind::Server)];
        let config = [(401, ErrorKind::EndpointConfig), (403, ErrorKind::EndpointConfig), (404, ErrorKind::EndpointConfig)];
        for (status, kind) in server.into_iter().chain(config).chain([(302, ErrorKind::EndpointConfig)]) {
            assert_eq!(c(status), kind, "{status}");
            assert!(kind.is_server_fault(), "{status}");
        }
        for status in [400, 413, 422, 409] {
            assert_eq!(c(status), ErrorKind::Rejected, "{status}");
            assert_eq!(c(status).fault(), Fault::Request, "{status}");
        }
        assert_eq!(classify(Problem::InvalidBody), ErrorKind::InvalidResponse);
        assert_eq!(ErrorKind::InvalidResponse.fault(), Fault::Server, "answered: verified by the probe, charged when it passes");
        let answered: Vec<&str> = ErrorKind::ALL.iter().filter(|k| k.is_answered_fault()).map(|k| k.as_str()).collect();
        assert_eq!(answered, ["server", "invalid_response"]);
        let verified: Vec<&str> = ErrorKind::ALL.iter().filter(|k| k.is_verified_fault()).map(|k| k.as_str()).collect();
        assert_eq!(verified, ["timeout", "server", "invalid_response"]);
        let outcomes: Vec<(&str, Outcome)> = ErrorKind::ALL.iter().map(|k| (k.as_str(), k.breaker_outcome())).collect();
        assert_eq!(
            outcomes,
            [
                ("timeout", Outcome::TimedOut),
                ("connect", Outcome::ServerFault),
                ("rate_limited", Outcome::ServerFault),
                ("server", Outcome::AnsweredFault),
                ("endpoint_config", Outcome::ServerFault),
                ("unavailable", Outcome::ServerFault),
                ("rejected", Outcome::RequestFault),
                ("invalid_response", Outcome::AnsweredFault),
                ("cancelled", Outcome::Abandoned),
            ],
            "408 and request timeouts are verified; 401/403/404, 429 and connect failures are hard"
        );
        assert_eq!(ErrorKind::Unavailable.fault(), Fault::Server);
        assert_eq!(ErrorKind::Cancelled.fault(), Fault::Cancelled);
        let retryable: Vec<&str> = ErrorKind::ALL.iter().filter(|k| k.retryable()).map(|k| k.as_str()).collect();
        assert_eq!(retryable, ["timeout", "connect", "rate_limited", "server", "invalid_response"]);
        let labels: Vec<&str> = std::iter::once(Ok(())).chain(ErrorKind::ALL.map(Err)).map(call_outcome_label).collect();
        assert_eq!(labels, CALL_OUTCOME_LABELS);
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
        let (prompt_tokens, cached_tokens) = (p.prompt_tokens, p.cached_tokens);
        let items: Vec<Completion> = p.items.into_iter().map(Result::unwrap).collect();
        let outs: Vec<&Value> = items.iter().map(|c| &c.output).collect();
        assert_eq!(outs, [&json!("a0"), &json!("b0")]);
        let texts = |c: &Completion| -> Vec<Value> { c.choices.iter().flatten().map(|c| c.output.clone()).collect() };
        assert_eq!(texts(&items[0]), [json!("a0"), json!("a1")], "every choice of prompt 0, in index order");
        assert_eq!(texts(&items[1]), [json!("b0"), json!("b1")]);
        assert_eq!((prompt_tokens, cached_tokens), (10, 4));
    }

    #[test]
    fn every_choice_and_its_logprobs_reach_the_result() {
        // Completions, n = 2, choices out of order, each with its logprobs.
        let lp = |t: &str| json!({"tokens": [t], "token_logprobs": [-0.5]});
        let v = json!({"choices": [
            {"index": 1, "text": "second", "logprobs": lp("s"), "finish_reason": "length"},
            {"index": 0, "text": "first", "logprobs": lp("f"), "finish_reason": "stop"},
        ]});
        let c = demux_completions(v, 1, 2).unwrap().items.remove(0).unwrap();
        assert_eq!((c.output.clone(), c.finish_reason.as_deref(), c.logprobs.clone()), (json!("first"), Some("stop"), Some(lp("f"))));
        let choices = c.choices.expect("two choices are all returned");
        let got: Vec<(Value, Option<String>, Option<Value>)> =
            choices.into_iter().map(|c| (c.output, c.finish_reason, c.logprobs)).collect();
        assert_eq!(
            got,
            [(json!("first"), Some("stop".into()), Some(lp("f"))), (json!("second"), Some("length".into()), Some(lp("s")))]
        );
        // One choice: no `choices` list; `logprobs: null` is no logprobs.
        let one = demux_completions(json!({"choices": [{"index": 0, "text": "t", "logprobs": null}]}), 1, 1).unwrap();
        let one = one.items[0].as_ref().unwrap();
        assert_eq!((one.choices.is_none(), one.logprobs.is_none()), (true, true));

        // Chat, n = 2: every message, in index order; the choice's logprobs.
        let msg = |t: &str| json!({"role": "assistant", "content": t});
        let v = json!({"choices": [
            {"index": 1, "message": msg("b"), "finish_reason": "stop"},
            {"index": 0, "message": msg("a"), "finish_reason": "stop", "logprobs": {"content": []}},
        ], "usage": {"prompt_tokens": 5, "completion_tokens": 2}});
        let c = parse_chat(v).unwrap().items.remove(0).unwrap();
        assert_eq!((c.output.clone(), c.logprobs.clone()), (msg("a"), Some(json!({"content": []}))));
        let outs: Vec<Value> = c.choices.unwrap().into_iter().map(|c| c.output).collect();
        assert_eq!(outs, [msg("a"), msg("b")]);
        assert_eq!(c.usage.map(|u| u.prompt_tokens), Some(5));
    }

    #[test]
    fn a_chat_answer_whose_content_is_not_text_is_invalid() {
        for content in [json!(5), json!(true), json!({"text": "x"}), json!([5, "x"]), json!([{"text": "no type"}])] {
            let v = json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]});
            let e = parse_chat(v).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidResponse, "content {content}");
            assert!(e.message.contains("content"), "{}", e.message);
        }
        // The OpenAI shapes pass: text, null (a tool call), a list of content parts.
        for content in [json!("x"), Value::Null, json!([{"type": "text", "text": "x"}])] {
            let v = json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]});
            assert!(parse_chat(v).is_ok(), "content {content}");
        }
    }

    #[test]
    fn cached_tokens_beyond_the_prompt_are_capped() {
        let over = json!({"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 7}});
        assert_eq!(parse_usage(Some(&over), None).and_then(|u| u.cached_tokens), Some(1));
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

/// Property-based fuzzing of the answer demultiplexer (`PROPTEST_CASES` cases per target;
/// `scripts/test` runs a fixed number): whatever a server answers, [`demux_completions`] and
/// [`parse_chat`] return without panicking, an accepted list answer has exactly one result per
/// prompt, and no prompt ever gets the text of a choice whose index belongs to another prompt.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::*;

    /// Any JSON, object keys biased towards the names the demultiplexer reads.
    fn any_json() -> impl Strategy<Value = Value> {
        let names = prop::sample::select(vec!["choices", "index", "text", "usage"]).prop_map(str::to_owned);
        crate::fuzz_json::any_json(prop_oneof![names, ".{0,8}"].boxed())
    }

    /// A list answer whose choices carry indices from 0..8 (missing, repeated or out of range
    /// ones included), each with the text `t{index}`, sometimes with a usage object or an error.
    fn list_answer() -> impl Strategy<Value = Value> {
        (prop::collection::vec(0u64..8, 0..10), any::<bool>(), any::<bool>()).prop_map(|(indices, usage, error)| {
            let choices: Vec<Value> = indices.iter().map(|i| json!({"index": i, "text": format!("t{i}"), "finish_reason": "stop"})).collect();
            let mut v = json!({"object": "text_completion", "choices": choices});
            if usage {
                v["usage"] = json!({"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}});
            }
            if error {
                v["error"] = json!({"message": "boom"});
            }
            v
        })
    }

    proptest! {
        #[test]
        fn fuzz_demux_arbitrary_answers(v in any_json(), n_items in 1usize..6, per in 1u64..3) {
            if let Ok(p) = demux_completions(v.clone(), n_items, per) {
                prop_assert_eq!(p.items.len(), n_items);
            }
            let _ = parse_chat(v);
        }

        #[test]
        // From 2 prompts on (one prompt's answer is its own, whatever its choice index).
        fn fuzz_demux_never_gives_a_prompt_anothers_text(v in list_answer(), n_items in 2usize..6) {
            if let Ok(p) = demux_completions(v, n_items, 1) {
                prop_assert_eq!(p.items.len(), n_items);
                for (i, item) in p.items.iter().enumerate() {
                    if let Ok(c) = item {
                        prop_assert_eq!(&c.output, &json!(format!("t{i}")), "prompt {} got another's text", i);
                    }
                }
            }
        }
    }
}
