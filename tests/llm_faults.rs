//! The LLM client against small local servers that misbehave: request faults must fail only their
//! own request, server faults must be reported as such (so the partition requeues instead of
//! answering `ok: false`), no request may receive another's answer, and the per-endpoint circuit
//! breaker must fail fast while an endpoint is down and close again after a successful probe.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use prefix_batcher::breaker::{BreakerPolicy, BreakerState};
use prefix_batcher::config::{LlmSettings, RawConfig, Settings};
use prefix_batcher::llm::{
    call_outcome_label, ClientOptions, Completion, ErrorKind, Fault, InferenceItem, LlmClient, LlmError, LlmEvent, MAX_RESPONSE_BYTES,
};
use prefix_batcher::request::Body;
use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;
use url::Url;

/// Answers a completions request body (with `prompt` always a list) for the `call`-th call (0-based).
type Handler = dyn Fn(&Value, usize) -> Response + Send + Sync;

/// A local OpenAI-style server on an OS-chosen port that records every request body.
struct Server {
    url: Url,
    bodies: Arc<Mutex<Vec<Value>>>,
    /// HTTP status of the circuit breaker's probe (a one-token completion of
    /// `prefix_batcher::llm::PROBE_PROMPT`, not recorded as a call), 200 by default.
    models_status: Arc<AtomicU16>,
    /// While set, the probe is answered 200 with an HTML page instead of a completion.
    probe_garbage: Arc<AtomicBool>,
    stop: CancellationToken,
}

impl Server {
    async fn start(handler: impl Fn(&Value, usize) -> Response + Send + Sync + 'static) -> Server {
        let handler: Arc<Handler> = Arc::new(handler);
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let recorded = bodies.clone();
        let models_status = Arc::new(AtomicU16::new(200));
        let status = models_status.clone();
        let probe_garbage = Arc::new(AtomicBool::new(false));
        let garbage = probe_garbage.clone();
        let route = move |Json(body): Json<Value>| {
            let (handler, recorded, status, garbage) = (handler.clone(), recorded.clone(), status.clone(), garbage.clone());
            async move {
                if body["prompt"] == prefix_batcher::llm::PROBE_PROMPT {
                    if garbage.load(Ordering::SeqCst) {
                        return html_page();
                    }
                    let status = StatusCode::from_u16(status.load(Ordering::SeqCst)).unwrap();
                    return (status, Json(json!({"choices": [{"index": 0, "text": "pong", "finish_reason": "length"}]}))).into_response();
                }
                let call = {
                    let mut b = recorded.lock().unwrap();
                    b.push(body.clone());
                    b.len() - 1
                };
                handler(&body, call)
            }
        };
        let app = axum::Router::new()
            .route("/v1/completions", axum::routing::post(route.clone()))
            .route("/v1/chat/completions", axum::routing::post(route));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        let stop = CancellationToken::new();
        let shutdown = stop.clone().cancelled_owned();
        tokio::spawn(async move { axum::serve(listener, app).with_graceful_shutdown(shutdown).await });
        Server { url, bodies, models_status, probe_garbage, stop }
    }

    fn calls(&self) -> usize {
        self.bodies.lock().unwrap().len()
    }

    /// The `prompt` list of every call so far.
    fn prompts(&self) -> Vec<Vec<String>> {
        let bodies = self.bodies.lock().unwrap();
        bodies.iter().map(prompts_of).collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn prompts_of(body: &Value) -> Vec<String> {
    body["prompt"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_owned()).collect()
}

/// A well-formed OpenAI completions answer with `choices[i] = {index: indices[i], text: texts[i]}`.
fn answer(indices: &[usize], texts: &[String]) -> Response {
    let choices: Vec<Value> =
        indices.iter().zip(texts).map(|(i, t)| json!({"index": i, "text": t, "finish_reason": "stop"})).collect();
    Json(json!({"object": "text_completion", "model": "m", "choices": choices})).into_response()
}

/// A server that follows the API but ignores `n`: one choice per prompt, `"answer:" + prompt`.
fn echo(body: &Value) -> Response {
    let prompts = prompts_of(body);
    let texts: Vec<String> = prompts.iter().map(|p| format!("answer:{p}")).collect();
    answer(&(0..prompts.len()).collect::<Vec<_>>(), &texts)
}

/// HTTP 200 with an HTML page: a misconfigured gateway in front of the server.
fn html_page() -> Response {
    (StatusCode::OK, [("content-type", "text/html")], "<html><body>Welcome to nginx!</body></html>").into_response()
}

fn error_response(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message, "type": "invalid_request_error"}}))).into_response()
}

/// The default `llm` settings with these endpoints and millisecond backoffs.
fn settings(urls: &[&Url]) -> LlmSettings {
    let mut llm = Settings::from_raw(&RawConfig::default()).expect("the defaults are valid").llm;
    llm.endpoints = urls.iter().map(|&u| u.clone()).collect();
    llm.max_attempts = NonZeroU32::new(3).unwrap();
    (llm.backoff_initial, llm.backoff_max) = (Duration::from_millis(1), Duration::from_millis(5));
    llm.list_prompts = true;
    llm
}

/// A client whose events are recorded, with a breaker that opens for `open_time` (then doubles,
/// up to 5 × `open_time`).
fn client_with(urls: &[&Url], max_response_bytes: usize, open_time: Duration) -> (LlmClient, Arc<Mutex<Vec<String>>>) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let options = ClientOptions {
        hook: Arc::new(move |e: &LlmEvent<'_>| {
            let line = match e {
                LlmEvent::Call { endpoint, outcome, .. } => format!("call {endpoint} {}", call_outcome_label(*outcome)),
                LlmEvent::Tokens { prompt_tokens, cached_tokens } => format!("tokens {prompt_tokens} {cached_tokens}"),
                LlmEvent::Breaker { endpoint, state, .. } => format!("breaker {endpoint} {}", state.as_str()),
                LlmEvent::ProbePanicked { endpoint } => format!("probe panicked {endpoint}"),
            };
            sink.lock().unwrap().push(line);
        }),
        max_response_bytes,
        breaker: BreakerPolicy { open_initial: open_time, open_max: open_time * 5, ..BreakerPolicy::default() },
        ..ClientOptions::default()
    };
    (LlmClient::with_options(&settings(urls), options).unwrap(), events)
}

/// A client with default limits whose breaker, once open, stays open longer than any test.
fn client(url: &Url) -> LlmClient {
    client_with(&[url], MAX_RESPONSE_BYTES, LONG).0
}

const LONG: Duration = Duration::from_secs(60);

fn requests(prompts: &[&str], params: Value) -> Vec<(Body, Map<String, Value>)> {
    let params = params.as_object().cloned().unwrap();
    prompts.iter().map(|p| (Body::Completion((*p).to_owned()), params.clone())).collect()
}

async fn infer(client: &LlmClient, reqs: &[(Body, Map<String, Value>)]) -> Vec<Result<Completion, LlmError>> {
    let items: Vec<InferenceItem<'_>> = reqs.iter().map(|(body, params)| InferenceItem { body, model: None, params, prefix_key: None }).collect();
    client.infer(0, &items, &CancellationToken::new()).await
}

fn output(r: &Result<Completion, LlmError>) -> String {
    r.as_ref().unwrap().output.as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_server_ignoring_n_never_mixes_up_answers() {
    let server = Server::start(|body, _| echo(body)).await;
    let client = client(&server.url);
    let reqs = requests(&["p0", "p1", "p2"], json!({"n": 2}));
    let results = infer(&client, &reqs).await;
    let outputs: Vec<String> = results.iter().map(output).collect();
    assert_eq!(outputs, ["answer:p0", "answer:p1", "answer:p2"]);
    assert_eq!(server.prompts(), [["p0"], ["p1"], ["p2"]], "n > 1 goes one prompt per call");
}

#[tokio::test]
async fn a_list_answer_with_wrong_indices_goes_again_prompt_by_prompt() {
    // Lists get every choice numbered 0 (as if `prompt` were one string), single prompts are fine.
    let server = Server::start(|body, _| {
        let prompts = prompts_of(body);
        let texts: Vec<String> = prompts.iter().map(|p| format!("answer:{p}")).collect();
        answer(&vec![0; prompts.len()], &texts)
    })
    .await;
    let client = client(&server.url);
    let results = infer(&client, &requests(&["p0", "p1", "p2"], json!({}))).await;
    let outputs: Vec<String> = results.iter().map(output).collect();
    assert_eq!(outputs, ["answer:p0", "answer:p1", "answer:p2"]);
    assert_eq!(server.prompts(), vec![vec!["p0", "p1", "p2"], vec!["p0"], vec!["p1"], vec!["p2"]]);

    // One choice short: never shifted onto the wrong prompt either.
    let short = Server::start(|body, _| {
        let prompts = prompts_of(body);
        let texts: Vec<String> = prompts.iter().map(|p| format!("answer:{p}")).collect();
        let keep = prompts.len().div_ceil(2);
        answer(&(0..keep).collect::<Vec<_>>(), &texts[..keep])
    })
    .await;
    let results = infer(&client_for(&short), &requests(&["p0", "p1"], json!({}))).await;
    assert_eq!(results.iter().map(output).collect::<Vec<_>>(), ["answer:p0", "answer:p1"]);
}

fn client_for(server: &Server) -> LlmClient {
    client(&server.url)
}

#[tokio::test]
async fn an_over_long_prompt_fails_alone() {
    for status in [StatusCode::BAD_REQUEST, StatusCode::PAYLOAD_TOO_LARGE] {
        let server = Server::start(move |body, _| {
            if prompts_of(body).iter().any(|p| p.starts_with("LONG")) {
                error_response(status, "context length exceeded")
            } else {
                echo(body)
            }
        })
        .await;
        let client = client(&server.url);
        let results = infer(&client, &requests(&["short one", "LONG one", "short two"], json!({}))).await;
        assert_eq!(output(&results[0]), "answer:short one");
        assert_eq!(output(&results[2]), "answer:short two");
        let e = results[1].as_ref().unwrap_err();
        assert_eq!((e.kind, e.status, e.fault()), (ErrorKind::Rejected, Some(status.as_u16()), Fault::Request));
        assert_eq!(
            server.calls(),
            4,
            "{status}: the list call, then each prompt once (request faults are not retried; the minimal call that judges the refusal is a probe, not recorded)"
        );
        assert!(client.available(0), "a request fault does not open the breaker");
    }
}

#[tokio::test]
async fn an_outage_opens_the_breaker_which_fails_fast_then_a_probe_closes_it() {
    let down = Arc::new(AtomicBool::new(true));
    let flag = down.clone();
    let server = Server::start(move |body, _| {
        if flag.load(Ordering::SeqCst) {
            error_response(StatusCode::SERVICE_UNAVAILABLE, "loading model")
        } else {
            echo(body)
        }
    })
    .await;
    server.models_status.store(503, Ordering::SeqCst);
    let (client, events) = client_with(&[&server.url], MAX_RESPONSE_BYTES, Duration::from_millis(200));
    let reqs = requests(&["p0", "p1"], json!({}));

    // 3 attempts, then 2 more: the 5th consecutive server fault opens the breaker and stops the retries.
    for expected_calls in [3, 5] {
        let results = infer(&client, &reqs).await;
        for r in &results {
            let e = r.as_ref().unwrap_err();
            assert_eq!((e.kind, e.status), (ErrorKind::Server, Some(503)));
            assert!(e.is_server_fault());
        }
        assert_eq!(server.calls(), expected_calls);
    }
    assert!(!client.available(0) && !client.any_available());
    assert_eq!(client.breaker_state(0), Some(BreakerState::Open));

    // While open: fail fast, no HTTP call.
    let results = infer(&client, &reqs).await;
    assert!(results.iter().all(|r| r.as_ref().unwrap_err().kind == ErrorKind::Unavailable));
    assert_eq!(server.calls(), 5);

    // Probes fail while the probe completion answers 503: still unavailable after several open times.
    let cancelled = CancellationToken::new();
    cancelled.cancel();
    assert!(!client.wait_available(0, &cancelled).await);
    let early = tokio::time::timeout(Duration::from_millis(700), client.wait_available(0, &CancellationToken::new())).await;
    assert!(early.is_err(), "a failed probe keeps the breaker open");
    // A paused partition is woken by the client's own successful probe (no request is used).
    down.store(false, Ordering::SeqCst);
    server.models_status.store(200, Ordering::SeqCst);
    let woke = tokio::time::timeout(Duration::from_secs(10), client.wait_available(0, &CancellationToken::new())).await;
    assert_eq!(woke, Ok(true));
    assert_eq!(client.breaker_state(0), Some(BreakerState::Closed));
    assert_eq!(server.calls(), 5, "the probes are not completions calls");

    let results = infer(&client, &reqs).await;
    assert_eq!(results.iter().map(output).collect::<Vec<_>>(), ["answer:p0", "answer:p1"]);
    let events = events.lock().unwrap();
    let breaker: Vec<&str> = events.iter().filter(|e| e.starts_with("breaker")).map(String::as_str).collect();
    assert!(breaker.len() >= 5, "{breaker:?}");
    assert_eq!(breaker[..3], ["breaker 0 open", "breaker 0 half_open", "breaker 0 open"], "the first probe failed");
    assert_eq!(breaker[breaker.len() - 2..], ["breaker 0 half_open", "breaker 0 closed"]);
    assert_eq!(events.iter().filter(|e| *e == "call 0 server").count(), 5);
    assert_eq!(events.iter().filter(|e| *e == "call 0 unavailable").count(), 1, "the list call failed fast");
    assert!(events.contains(&"call 0 ok".to_owned()));
}

#[tokio::test]
async fn unauthorized_is_a_server_fault_and_does_not_burn_the_backlog() {
    let server = Server::start(|_, _| error_response(StatusCode::UNAUTHORIZED, "invalid api key")).await;
    server.models_status.store(401, Ordering::SeqCst);
    let (client, _) = client_with(&[&server.url], MAX_RESPONSE_BYTES, Duration::from_millis(50));
    let mut kinds = Vec::new();
    for i in 0..10 {
        let results = infer(&client, &requests(&[&format!("p{i}")], json!({}))).await;
        let e = results[0].as_ref().unwrap_err();
        assert!(e.is_server_fault(), "{e}");
        kinds.push(e.kind);
    }
    assert_eq!(kinds[..5], [ErrorKind::EndpointConfig; 5], "not retried: one call each");
    assert_eq!(kinds[5..], [ErrorKind::Unavailable; 5], "then the breaker is open");
    assert_eq!(server.calls(), 5);
    // Probes meet the same 401: the breaker stays open however long one waits.
    let waited = tokio::time::timeout(Duration::from_millis(500), client.wait_available(0, &CancellationToken::new())).await;
    assert!(waited.is_err(), "a probe answered 401 must not close the breaker");
    assert!(!client.available(0));
}

#[tokio::test]
async fn refused_connections_are_server_faults() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
    drop(listener);
    let client = client(&url);
    let results = infer(&client, &requests(&["p0", "p1"], json!({}))).await;
    for r in &results {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Connect, "{e}");
        assert_eq!(e.fault(), Fault::Server);
    }
}

#[tokio::test]
async fn a_down_home_endpoint_fails_over_to_the_next_healthy_one() {
    let healthy = Server::start(|body, _| echo(body)).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refused = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
    drop(listener);
    let (client, _) = client_with(&[&refused, &healthy.url], MAX_RESPONSE_BYTES, LONG);
    let partition = (0..64).find(|&p| client.endpoint_ranking(p)[0] == 0).expect("some partition lives on endpoint 0");
    assert_eq!(client.endpoint_for(partition), 0);
    let reqs = requests(&["p0"], json!({}));
    let items: Vec<InferenceItem<'_>> = reqs.iter().map(|(body, params)| InferenceItem { body, model: None, params, prefix_key: None }).collect();
    for _ in 0..2 {
        client.infer(0, &items, &CancellationToken::new()).await;
    }
    assert!(!client.available(0) && client.any_available());
    assert_eq!(client.endpoint_for(partition), 1);
    let results = client.infer(client.endpoint_for(partition), &items, &CancellationToken::new()).await;
    assert_eq!(output(&results[0]), "answer:p0");
}

#[tokio::test]
async fn an_error_object_in_a_200_answer_is_a_failure() {
    let server = Server::start(|_, _| Json(json!({"error": {"message": "out of memory", "code": 500}})).into_response()).await;
    let results = infer(&client_for(&server), &requests(&["p0", "p1"], json!({}))).await;
    for r in &results {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidResponse, "{e}");
        assert!(e.message.contains("out of memory"), "{e}");
    }

    // A choice ending with finish_reason "error" fails its own item only.
    let server = Server::start(|body, _| {
        let prompts = prompts_of(body);
        let choices: Vec<Value> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let reason = if p == "bad" { "error" } else { "stop" };
                json!({"index": i, "text": format!("answer:{p}"), "finish_reason": reason})
            })
            .collect();
        Json(json!({"choices": choices})).into_response()
    })
    .await;
    let results = infer(&client_for(&server), &requests(&["good", "bad"], json!({}))).await;
    assert_eq!(output(&results[0]), "answer:good");
    assert_eq!(results[1].as_ref().unwrap_err().kind, ErrorKind::InvalidResponse);
    assert_eq!(server.calls(), 1);
}

#[tokio::test]
async fn oversized_bodies_are_refused() {
    let big = "x".repeat(4096);
    let sized = {
        let big = big.clone();
        Server::start(move |_, _| answer(&[0], std::slice::from_ref(&big))).await
    };
    let chunked = Server::start(move |_, _| {
        let chunks = (0..8).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1024]));
        axum::body::Body::from_stream(futures_util::stream::iter(chunks)).into_response()
    })
    .await;
    for server in [&sized, &chunked] {
        let (client, _) = client_with(&[&server.url], 2048, LONG);
        let results = infer(&client, &requests(&["p0"], json!({}))).await;
        let e = results[0].as_ref().unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidResponse, "{e}");
        assert!(e.message.contains("larger than 2048 bytes"), "{e}");
    }
    let (client, _) = client_with(&[&sized.url], 1 << 20, LONG);
    let results = infer(&client, &requests(&["p0"], json!({}))).await;
    assert_eq!(output(&results[0]), big, "under the limit");
}

/// A prompt the server answers 500 on its own (llama-server's "Failed to parse tools"), while
/// the probe and every other prompt succeed: a server fault for the caller (requeue), but the
/// breaker never opens for it, however often it is sent; answered faults that trip the rule are
/// verified by a probe, which refutes them.
#[tokio::test]
async fn a_prompt_the_server_fails_alone_never_opens_the_breaker() {
    let server = Server::start(|body, _| {
        if prompts_of(body).iter().any(|p| p.contains("POISON")) {
            error_response(StatusCode::INTERNAL_SERVER_ERROR, "Failed to parse tools")
        } else {
            echo(body)
        }
    })
    .await;
    let (client, events) = client_with(&[&server.url], MAX_RESPONSE_BYTES, LONG);
    for round in 0..10 {
        let results = infer(&client, &requests(&["fine", "POISON one"], json!({}))).await;
        let e = results[1].as_ref().unwrap_err();
        assert_eq!((e.kind, e.status), (ErrorKind::Server, Some(500)), "round {round}: {e}");
        assert!(e.is_server_fault());
        // The list call failed as a whole (a 500 is not split by the client): the partition asks
        // the endpoint, which answers its probe, so the fault is the requests' own.
        assert!(results[0].is_err());
        assert!(!client.confirm_server_fault(0).await, "round {round}: the endpoint answers its probe");
        assert!(client.available(0), "round {round}: the breaker stays closed");
        let fine = infer(&client, &requests(&["fine"], json!({}))).await;
        assert_eq!(output(&fine[0]), "answer:fine");
    }
    // Without the partition's check in between: 5 in a row make the breaker suspect; the
    // verification probe passes and discounts them.
    for _ in 0..5 {
        let results = infer(&client, &requests(&["POISON again"], json!({}))).await;
        assert_eq!(results[0].as_ref().unwrap_err().kind, ErrorKind::Server);
    }
    assert!(client.available(0));
    let prompts = server.prompts();
    let poison = prompts.iter().filter(|p| p.iter().any(|p| p.contains("POISON"))).count();
    assert_eq!(poison, 10 * 3 + 5 * 3, "every attempt was made: nothing failed fast");
    // The rest: the 10 `fine` calls, and the probe's replays of the first call answered (`fine`),
    // which pass, so the failures stay the prompt's own.
    let replays = prompts.len() - poison - 10;
    assert!(prompts.iter().all(|p| p.iter().any(|p| p.contains("POISON")) || p == &["fine"]), "{prompts:?}");
    assert!(replays >= 1, "the probe replays the call answered before");
    let events = events.lock().unwrap();
    assert!(!events.iter().any(|e| e.starts_with("breaker")), "{events:?}");
}

/// A server (a gateway in front of it) answering every call, the probe included, with HTTP 200
/// and an HTML page: every item fails with `invalid_response` as a server fault (requeued, never
/// `ok: false`), the breaker opens after the verification probe fails too, stays open while the
/// probe gets garbage, and closes once the server answers properly.
#[tokio::test]
async fn a_server_answering_200_garbage_is_down_until_it_answers_properly() {
    let garbage = Arc::new(AtomicBool::new(true));
    let flag = garbage.clone();
    let server = Server::start(move |body, _| if flag.load(Ordering::SeqCst) { html_page() } else { echo(body) }).await;
    server.probe_garbage.store(true, Ordering::SeqCst);
    let (client, events) = client_with(&[&server.url], MAX_RESPONSE_BYTES, Duration::from_millis(100));
    let reqs = requests(&["p0", "p1"], json!({}));
    let results = infer(&client, &reqs).await;
    for r in &results {
        let e = r.as_ref().unwrap_err();
        assert_eq!((e.kind, e.status, e.fault()), (ErrorKind::InvalidResponse, Some(200), Fault::Server), "{e}");
        assert!(e.message.contains("not JSON"), "{e}");
    }
    // The list call (split at once), p0 three times, p1 once: the 5th answered fault makes the
    // breaker suspect, the verification probe gets garbage too, the breaker opens.
    assert_eq!(server.calls(), 5);
    assert!(!client.available(0));
    assert!(client.confirm_server_fault(0).await, "down: the requests wait, uncharged");
    let early = tokio::time::timeout(Duration::from_millis(500), client.wait_available(0, &CancellationToken::new())).await;
    assert!(early.is_err(), "a probe answered with garbage must not close the breaker");

    garbage.store(false, Ordering::SeqCst);
    server.probe_garbage.store(false, Ordering::SeqCst);
    let woke = tokio::time::timeout(Duration::from_secs(10), client.wait_available(0, &CancellationToken::new())).await;
    assert_eq!(woke, Ok(true));
    let results = infer(&client, &reqs).await;
    assert_eq!(results.iter().map(output).collect::<Vec<_>>(), ["answer:p0", "answer:p1"]);
    let events = events.lock().unwrap();
    assert_eq!(events.iter().filter(|e| *e == "call 0 invalid_response").count(), 5);
    assert_eq!(events.iter().find(|e| e.starts_with("breaker")).map(String::as_str), Some("breaker 0 open"));
}

/// A one-message chat request.
fn chat_request(text: &str) -> (Body, Map<String, Value>) {
    let message = prefix_batcher::request::ChatMessage { role: "user".into(), text: text.into(), raw: json!({"role": "user", "content": text}) };
    (Body::Chat(vec![message]), Map::new())
}

/// A well-formed chat answer.
fn chat_answer(text: &str) -> Response {
    Json(json!({"object": "chat.completion", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}))
        .into_response()
}

/// A server whose chat API answers 500 to every call while `chat_down` is set, and to a chat
/// prompt containing `POISON` always; its completions API always answers.
async fn chat_route_server(chat_down: &Arc<AtomicBool>) -> Server {
    let flag = chat_down.clone();
    Server::start(move |body, _| match body.get("messages") {
        Some(m) if flag.load(Ordering::SeqCst) || m.to_string().contains("POISON") => {
            error_response(StatusCode::INTERNAL_SERVER_ERROR, "chat template failed")
        }
        Some(_) => chat_answer("hello"),
        None => echo(body),
    })
    .await
}

/// Sends `next(i)` for i = 0, 1, … until the endpoint's breaker opens; the calls it took, or
/// `None` when it stayed closed for `max` of them.
async fn calls_until_open(client: &LlmClient, max: usize, next: impl Fn(usize) -> Vec<(Body, Map<String, Value>)>) -> Option<usize> {
    for i in 0..max {
        if !client.available(0) {
            return Some(i);
        }
        let _ = infer(client, &next(i)).await;
    }
    (!client.available(0)).then_some(max)
}

/// A server that answered real calls, then answers every real call with 200 and a `choices` list
/// of garbage (`"text": 5`) while it still answers the one-token probe properly. Once different
/// calls all failed, the probe replays the call answered before; its answer is checked as real
/// answers are, fails, and the breaker opens: the requests wait, uncharged. (Before, the replay
/// passed on any `choices` list, the failures counted as the prompts' own, and every request was
/// dead-lettered: 15 of 15 and 20 of 20 in two runs.)
#[tokio::test]
async fn a_server_garbling_every_real_call_is_down_though_it_answers_the_probe() {
    let garble = Arc::new(AtomicBool::new(false));
    let flag = garble.clone();
    let server = Server::start(move |body, _| {
        if !flag.load(Ordering::SeqCst) {
            return echo(body);
        }
        Json(json!({"object": "text_completion", "model": "m", "choices": [{"index": 0, "text": 5, "finish_reason": "stop"}]})).into_response()
    })
    .await;
    let (client, events) = client_with(&[&server.url], MAX_RESPONSE_BYTES, Duration::from_millis(100));
    assert!(infer(&client, &requests(&["warm"], json!({}))).await[0].is_ok());
    garble.store(true, Ordering::SeqCst);
    let calls = calls_until_open(&client, 40, |i| requests(&[&format!("q{i}")], json!({}))).await;
    assert!(calls.is_some(), "the breaker stayed closed over 40 different calls answered with garbage: {:?}", events.lock().unwrap());
    assert!(client.confirm_server_fault(0).await, "down: the requests wait, uncharged");
    let early = tokio::time::timeout(Duration::from_millis(500), client.wait_available(0, &CancellationToken::new())).await;
    assert!(early.is_err(), "a garbled replay must not close the breaker");
    garble.store(false, Ordering::SeqCst);
    let woke = tokio::time::timeout(Duration::from_secs(10), client.wait_available(0, &CancellationToken::new())).await;
    assert_eq!(woke, Ok(true), "the replay passes again once the server answers properly");
    eprintln!("garbling server: breaker open after {} different calls", calls.unwrap());
}

/// A server whose chat route fails every call (500) while its completions route, the one-token
/// probe included, keeps answering. The completions answers do not refute the chat failures:
/// once different chat calls all failed, the probe replays the chat call answered before, which
/// fails too, and the breaker opens (the requests wait, uncharged) until the chat route answers
/// again. (Before, the replay was a completions call and passed, and every chat request was
/// dead-lettered: 20 of 20.)
#[tokio::test]
async fn a_chat_route_failing_every_call_is_down_though_completions_answer() {
    let chat_down = Arc::new(AtomicBool::new(false));
    let server = chat_route_server(&chat_down).await;
    let (client, events) = client_with(&[&server.url], MAX_RESPONSE_BYTES, Duration::from_millis(100));
    assert!(infer(&client, &[chat_request("warm chat")]).await[0].is_ok());
    assert!(infer(&client, &requests(&["warm"], json!({}))).await[0].is_ok());
    chat_down.store(true, Ordering::SeqCst);
    // Chat and completions calls alternate: every completions call is answered.
    let calls = calls_until_open(&client, 60, |i| {
        if i % 2 == 0 {
            vec![chat_request(&format!("question {i}"))]
        } else {
            requests(&[&format!("c{i}")], json!({}))
        }
    })
    .await;
    assert!(calls.is_some(), "the breaker stayed closed while every chat call failed: {:?}", events.lock().unwrap());
    let early = tokio::time::timeout(Duration::from_millis(500), client.wait_available(0, &CancellationToken::new())).await;
    assert!(early.is_err(), "the chat replay fails: the breaker stays open");
    chat_down.store(false, Ordering::SeqCst);
    let woke = tokio::time::timeout(Duration::from_secs(10), client.wait_available(0, &CancellationToken::new())).await;
    assert_eq!(woke, Ok(true));
    assert_eq!(infer(&client, &[chat_request("after")]).await[0].as_ref().map(|c| c.output["content"].clone()).ok(), Some(json!("hello")));
    eprintln!("chat route down: breaker open after {} calls", calls.unwrap());
}

/// The first failing call of a server-wide outage is judged like the later ones: the partition
/// asks the endpoint before charging its request, the probe replays a call of the same API that
/// the server answered before, and that fails too, so the endpoint counts as down and the request
/// waits, uncharged. (Before, only 10 different failing calls made the probe replay, and a
/// request's deliveries could all be spent first: 5 of 5 chat requests were dead-lettered at 2
/// requests a second with the defaults.) A prompt the server fails alone is still its own.
#[tokio::test]
async fn the_first_failure_of_a_server_wide_outage_is_not_charged() {
    let chat_down = Arc::new(AtomicBool::new(false));
    let server = chat_route_server(&chat_down).await;
    let client = client(&server.url);
    assert!(infer(&client, &[chat_request("warm chat")]).await[0].is_ok());
    // A poison prompt: the replay passes, the fault is the prompt's own.
    let poison = infer(&client, &[chat_request("POISON")]).await;
    assert_eq!(poison[0].as_ref().unwrap_err().kind, ErrorKind::Server);
    assert!(!client.confirm_server_fault(0).await, "the server answers the chat call it answered before");
    assert!(client.available(0));
    // The chat API fails everything: the very first failure finds it.
    chat_down.store(true, Ordering::SeqCst);
    let first = infer(&client, &[chat_request("first question of the outage")]).await;
    assert_eq!(first[0].as_ref().unwrap_err().kind, ErrorKind::Server);
    assert!(client.confirm_server_fault(0).await, "down: the request waits, uncharged");
    assert!(!client.available(0));
}
