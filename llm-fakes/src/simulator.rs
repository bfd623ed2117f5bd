//! An OpenAI-compatible LLM server **simulator** that models vLLM's automatic prefix caching
//! (APC), for benchmarks at a scale no CPU can serve for real (`bench/`, `llm-fakes simulate`).
//! It generates no text: it only accounts for the prefix cache and the time a GPU would spend.
//!
//! # Model
//!
//! - **Tokens from characters.** A prompt of `c` characters (Unicode scalar values) has
//!   `max(1, ceil(c / chars_per_token))` tokens; token `i` is characters
//!   `[i·r, (i+1)·r)` with `r = chars_per_token` (default [`DEFAULT_CHARS_PER_TOKEN`] = 4, the
//!   usual rule of thumb for English text with BPE tokenizers such as GPT-2's or Llama's).
//! - **Blocks hashed in a chain**, like vLLM's `hash_request_tokens`: the prompt is cut into full
//!   blocks of `block_tokens` tokens (default 16, vLLM's `--block-size`); block `k`'s hash is
//!   `xxh3_64(block text, seed = hash of block k-1)`, so equal hashes mean equal *prefixes*, not
//!   just equal blocks. A trailing partial block is never cached.
//! - **Lookup** (vLLM v1 `KVCacheManager.get_computed_blocks`): the cached prefix is the longest
//!   run of leading blocks found in the cache, looking only at blocks that end before the last
//!   prompt token (the last token is always computed, to get logits). `cached_tokens` = hit
//!   blocks × `block_tokens`.
//! - **Insertion and LRU eviction**: after the lookup every full block of the prompt is inserted or
//!   touched (most recently used); while the cache holds more than `capacity_blocks` blocks the
//!   least recently used one is evicted. (vLLM never evicts blocks of running requests; this model
//!   ignores that, which only matters when one prompt is larger than the whole cache.)
//! - **Time**: a request holds one of `max_concurrency` slots (FIFO wait for one) for
//!   `uncached_tokens × prefill_seconds_per_token + output_tokens × decode_seconds_per_token`
//!   *model* seconds; slots do not slow each other down (an idealised continuous-batching
//!   server). `output_tokens` is the request's `max_tokens` (default `default_max_tokens`). The
//!   wall-clock wait is the model time divided by `speedup`, so a trace replayed `speedup` times
//!   faster sees the same queueing as in real time. *Simulated GPU-seconds* are the summed model
//!   service times (`simulator_busy_seconds_total`), split into prefill and decode.
//!
//! # HTTP
//!
//! `POST /v1/completions` (`prompt` a string or a list: every prompt is one request with its own
//! slot; one answer with one choice per prompt and the summed `usage`, as vLLM does),
//! `POST /v1/chat/completions` (messages rendered as `<|role|>\ncontent\n` each), `GET /v1/models`,
//! `GET /health`, `POST /v1/chat/completions/render` and `/v1/completions/render` (vLLM's
//! template rendering: the prompt's token ids in the simulator's tokenization, see [`token_ids`];
//! no cache effect), SGLang's `GET /get_model_info` and `/model_info`, `/get_server_info` and
//! `/server_info`, `/get_load`, `/health_generate` (the routers' probes; any other path is
//! answered 404 and logged to stderr), and `GET /metrics` with vLLM's `vllm:prefix_cache_queries_total` and
//! `vllm:prefix_cache_hits_total` (in tokens), `vllm:num_requests_running`/`_waiting`, and the
//! simulator's own `simulator_*` series (block counts, evictions, GPU-seconds).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::openai;

/// Default characters per token (English BPE rule of thumb).
pub const DEFAULT_CHARS_PER_TOKEN: usize = 4;
/// vLLM's default KV block size in tokens.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// Simulator settings. See the module docs for the model.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Model id reported in answers and `/v1/models`.
    pub model: String,
    /// Characters per token (≥ 1).
    pub chars_per_token: usize,
    /// Tokens per KV block (≥ 1).
    pub block_tokens: usize,
    /// Prefix cache capacity in blocks (0 disables caching).
    pub capacity_blocks: usize,
    /// Model seconds per uncached prompt token.
    pub prefill_seconds_per_token: f64,
    /// Model seconds per generated token.
    pub decode_seconds_per_token: f64,
    /// Requests served at once; the rest wait in FIFO order.
    pub max_concurrency: usize,
    /// Wall-clock time = model time / `speedup` (> 0).
    pub speedup: f64,
    /// Output tokens of a request without `max_tokens`.
    pub default_max_tokens: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            model: "simulated".into(),
            chars_per_token: DEFAULT_CHARS_PER_TOKEN,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            capacity_blocks: 65_536,
            prefill_seconds_per_token: 0.000_1,
            decode_seconds_per_token: 0.002,
            max_concurrency: 16,
            speedup: 1.0,
            default_max_tokens: 16,
        }
    }
}

impl SimConfig {
    /// Model seconds one request spends in its slot.
    pub fn service_seconds(&self, uncached_tokens: u64, output_tokens: u64) -> f64 {
        uncached_tokens as f64 * self.prefill_seconds_per_token + output_tokens as f64 * self.decode_seconds_per_token
    }

    /// Tokens of a prompt: `max(1, ceil(chars / chars_per_token))`.
    pub fn prompt_tokens(&self, text: &str) -> u64 {
        openai::tokens(text, self.chars_per_token)
    }
}

/// Chained hashes of the full blocks of `text`, `block_chars` characters each (a trailing partial
/// block is left out). Hash `k` covers the whole prefix up to the end of block `k`.
pub fn block_hashes(text: &str, block_chars: usize) -> Vec<u64> {
    let block_chars = block_chars.max(1);
    let mut out = Vec::new();
    let mut prev: u64 = 0x5eed_b10c;
    let mut start = 0usize;
    let mut n = 0usize;
    for (i, _) in text.char_indices() {
        if n == block_chars {
            prev = xxhash_rust::xxh3::xxh3_64_with_seed(&text.as_bytes()[start..i], prev);
            out.push(prev);
            start = i;
            n = 0;
        }
        n += 1;
    }
    if n == block_chars {
        out.push(xxhash_rust::xxh3::xxh3_64_with_seed(&text.as_bytes()[start..], prev));
    }
    out
}

/// A prefix cache of chained block hashes with LRU eviction at a capacity in blocks.
///
/// Within one prompt the blocks are touched tail first, so the prompt's last blocks are the
/// first of it to be evicted and its head, which later prompts can still reach, stays longest.
/// That is vLLM's order: `KVCacheManager.free` returns a finished request's blocks to the free
/// queue in reverse "so that the tail blocks are evicted first" (vllm/v1/core/kv_cache_manager.py).
/// A head-first order would evict a chain's first block while its unreachable tail stays cached.
#[derive(Debug, Default, Clone)]
pub struct PrefixCache {
    capacity: usize,
    tick: u64,
    /// Block hash → last use tick.
    blocks: HashMap<u64, u64>,
    /// Last use tick → block hash (the LRU order).
    lru: BTreeMap<u64, u64>,
    evictions: u64,
}

impl PrefixCache {
    /// An empty cache of `capacity` blocks (`usize::MAX`: never evicts, the oracle).
    pub fn new(capacity: usize) -> Self {
        PrefixCache { capacity, ..Default::default() }
    }

    /// Looks up the longest cached run of leading blocks among the first `lookup_limit` hashes,
    /// then inserts or touches every hash of `hashes`, last one first (so the first is the most
    /// recently used), and evicts down to the capacity. Returns the number of hit blocks.
    pub fn lookup_and_insert(&mut self, hashes: &[u64], lookup_limit: usize) -> usize {
        let hits = hashes.iter().take(lookup_limit).take_while(|h| self.blocks.contains_key(h)).count();
        if self.capacity == 0 {
            return hits;
        }
        for &h in hashes.iter().rev() {
            self.tick += 1;
            if let Some(old) = self.blocks.insert(h, self.tick) {
                self.lru.remove(&old);
            }
            self.lru.insert(self.tick, h);
        }
        while self.blocks.len() > self.capacity {
            let Some((_, h)) = self.lru.pop_first() else { break };
            self.blocks.remove(&h);
            self.evictions += 1;
        }
        hits
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}

/// The cache outcome of one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Full blocks of the prompt (the block "queries").
    pub blocks: u64,
    /// Leading blocks found in the cache.
    pub hit_blocks: u64,
}

/// The cache model of one server, without time: usable offline (the bench's oracle) and by the
/// HTTP simulator.
#[derive(Debug, Clone)]
pub struct CacheModel {
    chars_per_token: usize,
    block_tokens: usize,
    cache: PrefixCache,
}

impl CacheModel {
    /// A model with `capacity_blocks` blocks (`usize::MAX` for an infinite cache).
    pub fn new(chars_per_token: usize, block_tokens: usize, capacity_blocks: usize) -> Self {
        CacheModel { chars_per_token: chars_per_token.max(1), block_tokens: block_tokens.max(1), cache: PrefixCache::new(capacity_blocks) }
    }

    /// Runs one prompt through the cache (lookup, then insert).
    pub fn admit(&mut self, text: &str) -> Admission {
        let prompt_tokens = openai::tokens(text, self.chars_per_token);
        let hashes = block_hashes(text, self.chars_per_token * self.block_tokens);
        // Only blocks that end before the last token can be reused: the last token is computed.
        let lookup_limit = ((prompt_tokens - 1) / self.block_tokens as u64) as usize;
        let hit_blocks = self.cache.lookup_and_insert(&hashes, lookup_limit) as u64;
        Admission { prompt_tokens, cached_tokens: hit_blocks * self.block_tokens as u64, blocks: hashes.len() as u64, hit_blocks }
    }

    /// The underlying cache.
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }
}

/// Counters exported on `/metrics`.
#[derive(Debug, Default)]
struct Counters {
    requests: u64,
    query_tokens: u64,
    hit_tokens: u64,
    query_blocks: u64,
    hit_blocks: u64,
    prompt_tokens: u64,
    output_tokens: u64,
    prefill_seconds: f64,
    decode_seconds: f64,
}

struct Shared {
    cfg: SimConfig,
    model: Mutex<CacheModel>,
    counters: Mutex<Counters>,
    slots: Semaphore,
    running: AtomicU64,
    waiting: AtomicU64,
    next_id: AtomicU64,
    /// Render requests answered (`simulator_render_requests_total`).
    renders: AtomicU64,
}

impl Shared {
    fn model(&self) -> MutexGuard<'_, CacheModel> {
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn counters(&self) -> MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A snapshot of the simulator's counters (for tests and in-process use).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimStats {
    pub requests: u64,
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up.
    pub query_tokens: u64,
    /// `vllm:prefix_cache_hits_total`: prompt tokens served from the cache.
    pub hit_tokens: u64,
    pub query_blocks: u64,
    pub hit_blocks: u64,
    /// Model seconds of prefill and of decode.
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub evictions: u64,
    pub cached_blocks: usize,
}

/// A simulator server. Build with a [`SimConfig`], then [`Simulator::serve`].
#[derive(Clone)]
pub struct Simulator {
    shared: Arc<Shared>,
}

impl Simulator {
    /// A simulator with an empty cache.
    pub fn new(cfg: SimConfig) -> Self {
        let model = CacheModel::new(cfg.chars_per_token, cfg.block_tokens, cfg.capacity_blocks);
        Simulator {
            shared: Arc::new(Shared {
                slots: Semaphore::new(cfg.max_concurrency.max(1)),
                cfg,
                model: Mutex::new(model),
                counters: Mutex::new(Counters::default()),
                running: AtomicU64::new(0),
                waiting: AtomicU64::new(0),
                next_id: AtomicU64::new(0),
                renders: AtomicU64::new(0),
            }),
        }
    }

    /// The counters now.
    pub fn stats(&self) -> SimStats {
        let (evictions, cached_blocks) = {
            let m = self.shared.model();
            (m.cache().evictions(), m.cache().len())
        };
        let c = self.shared.counters();
        SimStats {
            requests: c.requests,
            query_tokens: c.query_tokens,
            hit_tokens: c.hit_tokens,
            query_blocks: c.query_blocks,
            hit_blocks: c.hit_blocks,
            prefill_seconds: c.prefill_seconds,
            decode_seconds: c.decode_seconds,
            evictions,
            cached_blocks,
        }
    }

    /// Serves HTTP on `listener` until `shutdown` completes.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> io::Result<()> {
        let app = openai::routes(post(completions), post(chat_completions), get(models), get(metrics))
            .route("/v1/chat/completions/render", post(render_chat_completion))
            .route("/v1/completions/render", post(render_completion))
            .route("/health_generate", get(|| async { axum::http::StatusCode::OK }))
            .route("/get_model_info", get(model_info))
            .route("/model_info", get(model_info))
            .route("/get_server_info", get(server_info))
            .route("/server_info", get(server_info))
            .route("/get_load", get(load))
            .route("/get_loads", get(load))
            .fallback(unknown)
            .with_state(self.shared);
        axum::serve(listener, app).with_graceful_shutdown(shutdown).await
    }

    /// Binds `addr` and serves in a background task; returns the bound address.
    pub async fn spawn(self, addr: SocketAddr) -> io::Result<SocketAddr> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        tokio::spawn(self.serve(listener, std::future::pending()));
        Ok(local)
    }
}

/// Token ids of a text in the simulator's tokenization: token `i` is characters
/// `[i·r, (i+1)·r)` (`r = chars_per_token`), and its id is a 31-bit hash of those characters. Equal
/// texts have equal ids and a text's prefix has a prefix of its ids, so a router that matches
/// token ids sees the same prefixes as the cache model (which hashes the same characters).
pub fn token_ids(text: &str, chars_per_token: usize) -> Vec<u32> {
    let r = chars_per_token.max(1);
    let mut out = Vec::with_capacity(text.len() / r + 1);
    let (mut start, mut n) = (0usize, 0usize);
    for (i, _) in text.char_indices() {
        if n == r {
            out.push(token_id(&text.as_bytes()[start..i]));
            start = i;
            n = 0;
        }
        n += 1;
    }
    if n > 0 || out.is_empty() {
        out.push(token_id(&text.as_bytes()[start..]));
    }
    out
}

fn token_id(bytes: &[u8]) -> u32 {
    (xxhash_rust::xxh3::xxh3_64(bytes) & 0x7fff_ffff) as u32
}

/// Runs one prompt: waits for a slot, runs the cache model, holds the slot for the service time.
async fn run_prompt(state: &Shared, text: &str, output_tokens: u64) -> Admission {
    state.waiting.fetch_add(1, Ordering::Relaxed);
    let permit = state.slots.acquire().await.expect("semaphore is never closed");
    state.waiting.fetch_sub(1, Ordering::Relaxed);
    state.running.fetch_add(1, Ordering::Relaxed);
    let a = state.model().admit(text);
    let cfg = &state.cfg;
    let prefill = (a.prompt_tokens - a.cached_tokens) as f64 * cfg.prefill_seconds_per_token;
    let decode = output_tokens as f64 * cfg.decode_seconds_per_token;
    {
        let mut c = state.counters();
        c.requests += 1;
        c.query_tokens += a.prompt_tokens;
        c.hit_tokens += a.cached_tokens;
        c.query_blocks += a.blocks;
        c.hit_blocks += a.hit_blocks;
        c.prompt_tokens += a.prompt_tokens;
        c.output_tokens += output_tokens;
        c.prefill_seconds += prefill;
        c.decode_seconds += decode;
    }
    let wall = (prefill + decode) / cfg.speedup.max(f64::MIN_POSITIVE);
    if wall > 0.0 && wall.is_finite() {
        tokio::time::sleep(Duration::from_secs_f64(wall)).await;
    }
    state.running.fetch_sub(1, Ordering::Relaxed);
    drop(permit);
    a
}

fn max_tokens(req: &serde_json::Map<String, Value>, default: u64) -> u64 {
    req.get("max_tokens").or_else(|| req.get("max_completion_tokens")).and_then(Value::as_u64).unwrap_or(default)
}

/// The stand-in output text: the simulator generates no language.
fn output_text(output_tokens: u64) -> String {
    format!("[simulated {output_tokens} tokens]")
}

async fn completions(State(state): State<Arc<Shared>>, body: Bytes) -> Result<Response, Response> {
    let (prompts, req) = openai::completion_request(&body)?;
    let out = max_tokens(&req, state.cfg.default_max_tokens);
    let admissions = futures_util::future::join_all(prompts.iter().map(|p| run_prompt(&state, p, out))).await;
    let choices: Vec<Value> = (0..prompts.len()).map(|i| openai::completion_choice(i, output_text(out))).collect();
    let prompt: u64 = admissions.iter().map(|a| a.prompt_tokens).sum();
    let cached: u64 = admissions.iter().map(|a| a.cached_tokens).sum();
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let model = req.get("model").and_then(Value::as_str).unwrap_or(&state.cfg.model);
    let usage = openai::usage(prompt, Some(cached), out * prompts.len() as u64);
    Ok(Json(openai::text_completion(format!("cmpl-sim-{id}"), openai::unix_now(), model, choices, usage)).into_response())
}

async fn chat_completions(State(state): State<Arc<Shared>>, body: Bytes) -> Result<Response, Response> {
    let (messages, req) = openai::chat_request(&body)?;
    let rendered = openai::render_chat(&messages);
    let out = max_tokens(&req, state.cfg.default_max_tokens);
    let a = run_prompt(&state, &rendered, out).await;
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let model = req.get("model").and_then(Value::as_str).unwrap_or(&state.cfg.model);
    let usage = openai::usage(a.prompt_tokens, Some(a.cached_tokens), out);
    Ok(Json(openai::chat_completion(format!("chatcmpl-sim-{id}"), model, output_text(out), usage)).into_response())
}

/// `POST /v1/chat/completions/render`, as vLLM answers it (its template-rendering endpoint, which
/// vLLM's router calls before it routes a chat request): the rendered prompt's token ids plus the
/// request's sampling parameters, in the shape of vLLM's `GenerateRequest` (`request_id`,
/// `token_ids`, `features`, `sampling_params`, `model`, `stream`). Nothing is computed or cached.
async fn render_chat_completion(State(state): State<Arc<Shared>>, body: Bytes) -> Result<Response, Response> {
    let (messages, req) = openai::chat_request(&body)?;
    state.renders.fetch_add(1, Ordering::Relaxed);
    let ids = token_ids(&openai::render_chat(&messages), state.cfg.chars_per_token);
    Ok(Json(rendered_request(&state, &req, ids, "chatcmpl")).into_response())
}

/// `POST /v1/completions/render`: one rendered request per prompt (a list, as vLLM answers it).
async fn render_completion(State(state): State<Arc<Shared>>, body: Bytes) -> Result<Response, Response> {
    let (prompts, req) = openai::completion_request(&body)?;
    state.renders.fetch_add(1, Ordering::Relaxed);
    let out: Vec<Value> =
        prompts.iter().map(|p| rendered_request(&state, &req, token_ids(p, state.cfg.chars_per_token), "cmpl")).collect();
    Ok(Json(Value::Array(out)).into_response())
}

fn rendered_request(state: &Shared, req: &serde_json::Map<String, Value>, ids: Vec<u32>, kind: &str) -> Value {
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let model = req.get("model").and_then(Value::as_str).unwrap_or(&state.cfg.model);
    serde_json::json!({
        "request_id": format!("{kind}-sim-render-{id}"),
        "token_ids": ids,
        "features": null,
        "sampling_params": {
            "max_tokens": max_tokens(req, state.cfg.default_max_tokens),
            "temperature": req.get("temperature").cloned().unwrap_or(Value::Null),
        },
        "model": model,
        "stream": req.get("stream").and_then(Value::as_bool).unwrap_or(false),
    })
}

/// `GET /get_model_info` (SGLang's model info, probed by SGLang's router).
async fn model_info(State(state): State<Arc<Shared>>) -> Json<Value> {
    Json(serde_json::json!({
        "model_path": state.cfg.model,
        "tokenizer_path": state.cfg.model,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": "simulated",
        "architectures": ["Simulated"],
    }))
}

/// `GET /get_server_info` (SGLang's server info, probed by both routers).
async fn server_info(State(state): State<Arc<Shared>>) -> Json<Value> {
    Json(serde_json::json!({
        "model_path": state.cfg.model,
        "served_model_name": state.cfg.model,
        "tokenizer_path": state.cfg.model,
        "max_total_num_tokens": state.cfg.capacity_blocks.saturating_mul(state.cfg.block_tokens),
        "page_size": state.cfg.block_tokens,
        "max_running_requests": state.cfg.max_concurrency,
        "dp_size": 1,
        "tp_size": 1,
        "version": "simulated",
    }))
}

/// `GET /get_load`, `/get_loads`: requests running and waiting (SGLang's load report).
async fn load(State(state): State<Arc<Shared>>) -> Json<Value> {
    let running = state.running.load(Ordering::Relaxed);
    let waiting = state.waiting.load(Ordering::Relaxed);
    Json(serde_json::json!({"load": running + waiting, "num_reqs": running + waiting, "num_running_reqs": running, "num_waiting_reqs": waiting}))
}

/// Any other path: 404, logged to stderr (so a client's probes show in the simulator's log).
async fn unknown(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    eprintln!("llm-fakes simulate: 404 {method} {uri}");
    openai::error_response(404, &format!("no route {method} {}", uri.path()), None)
}

async fn models(State(state): State<Arc<Shared>>) -> Json<Value> {
    openai::models(&state.cfg.model, "llm-simulator")
}

async fn metrics(State(state): State<Arc<Shared>>) -> Response {
    let s = Simulator { shared: state.clone() }.stats();
    let m = &state.cfg.model;
    let mut t = String::new();
    openai::push_prefix_cache_counters(&mut t, m, s.query_tokens, s.hit_tokens);
    let mut series = |name: &str, kind: &str, help: &str, value: String| openai::push_series(&mut t, name, kind, help, m, value);
    series("vllm:num_requests_running", "gauge", "Requests holding a slot.", state.running.load(Ordering::Relaxed).to_string());
    series("vllm:num_requests_waiting", "gauge", "Requests waiting for a slot.", state.waiting.load(Ordering::Relaxed).to_string());
    series("simulator_requests_total", "counter", "Prompts served (each prompt of a list counts).", s.requests.to_string());
    series("simulator_render_requests_total", "counter", "Render requests answered (vLLM's /v1/.../render; no cache effect).", state.renders.load(Ordering::Relaxed).to_string());
    series("simulator_prefix_cache_block_queries_total", "counter", "Full KV blocks of served prompts.", s.query_blocks.to_string());
    series("simulator_prefix_cache_block_hits_total", "counter", "Leading KV blocks found in the cache.", s.hit_blocks.to_string());
    series("simulator_prefix_cache_evictions_total", "counter", "KV blocks evicted (LRU).", s.evictions.to_string());
    series("simulator_prefix_cache_blocks", "gauge", "KV blocks held in the cache.", s.cached_blocks.to_string());
    series("simulator_prefill_seconds_total", "counter", "Simulated GPU-seconds spent on prefill of uncached tokens.", format!("{:.6}", s.prefill_seconds));
    series("simulator_decode_seconds_total", "counter", "Simulated GPU-seconds spent on decode.", format!("{:.6}", s.decode_seconds));
    series("simulator_busy_seconds_total", "counter", "Simulated GPU-seconds (prefill + decode, model time).", format!("{:.6}", s.prefill_seconds + s.decode_seconds));
    openai::metrics_response(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::net::Ipv4Addr;

    /// 64 characters = one 16-token block at 4 characters per token.
    fn block(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    #[test]
    fn hashes_are_chained_and_only_full_blocks_count() {
        let a = block('a') + &block('b') + "tail";
        let b = block('a') + &block('b') + &block('c');
        let c = block('x') + &block('b');
        let (ha, hb, hc) = (block_hashes(&a, 64), block_hashes(&b, 64), block_hashes(&c, 64));
        assert_eq!(ha.len(), 2, "the 4-character tail is not a block");
        assert_eq!(hb.len(), 3);
        assert_eq!(ha[..], hb[..2], "same prefix, same hashes");
        assert_ne!(ha[1], hc[1], "same block after another prefix hashes differently");
        // Multi-byte characters count as one character each.
        assert_eq!(block_hashes(&"é".repeat(128), 64).len(), 2);
        assert!(block_hashes("short", 64).is_empty());
    }

    #[test]
    fn repeated_prefix_hits_but_the_last_token_is_always_computed() {
        let mut m = CacheModel::new(4, 16, usize::MAX);
        let header = block('h').repeat(3);
        let first = m.admit(&(header.clone() + "question one"));
        assert_eq!(first, Admission { prompt_tokens: 48 + 3, cached_tokens: 0, blocks: 3, hit_blocks: 0 });
        let second = m.admit(&(header.clone() + "question two"));
        assert_eq!((second.cached_tokens, second.hit_blocks), (48, 3));
        // An exact repeat of a block-aligned prompt reuses all blocks but the one holding the last token.
        let again = m.admit(&header);
        assert_eq!((again.prompt_tokens, again.cached_tokens), (48, 32));
        // A different first block: nothing is reused, even though later blocks are equal text.
        let other = m.admit(&(block('z') + &block('h').repeat(2) + "q"));
        assert_eq!(other.cached_tokens, 0);
    }

    #[test]
    fn lru_evicts_the_least_recently_used_block() {
        let mut c = PrefixCache::new(3);
        assert_eq!(c.lookup_and_insert(&[1, 2], 2), 0);
        assert_eq!(c.lookup_and_insert(&[3], 1), 0);
        assert_eq!(c.lookup_and_insert(&[1], 1), 1, "touches 1: 2 is now the oldest");
        assert_eq!(c.lookup_and_insert(&[4], 1), 0);
        assert_eq!(c.len(), 3);
        assert_eq!(c.evictions(), 1);
        assert_eq!(c.lookup_and_insert(&[2], 1), 0, "2 was evicted");
        assert_eq!(c.lookup_and_insert(&[1, 4], 2), 2, "inserting 2 evicted 3, the oldest; 1 and 4 stay");
        assert_eq!(c.lookup_and_insert(&[3], 1), 0);
    }

    #[test]
    fn a_prompts_tail_is_evicted_before_its_head() {
        let mut c = PrefixCache::new(3);
        c.lookup_and_insert(&[1, 2, 3], 3);
        c.lookup_and_insert(&[7], 1);
        assert_eq!(c.lookup_and_insert(&[1, 2, 3], 3), 2, "3 (the tail) was evicted, 1 and 2 still hit");
        let mut c = PrefixCache::new(3);
        c.lookup_and_insert(&[1, 2, 3], 3);
        c.lookup_and_insert(&[7, 8], 2);
        assert_eq!(c.lookup_and_insert(&[1, 2], 2), 1, "the head outlives the rest of its prompt");
    }

    #[test]
    fn lookup_stops_at_the_first_miss_and_zero_capacity_never_hits() {
        let mut c = PrefixCache::new(10);
        c.lookup_and_insert(&[1, 2, 3], 3);
        assert_eq!(c.lookup_and_insert(&[1, 9, 3], 3), 1, "a prefix run, not a set intersection");
        let mut none = CacheModel::new(4, 16, 0);
        let p = block('a').repeat(4);
        none.admit(&p);
        assert_eq!(none.admit(&p).cached_tokens, 0);
        assert!(none.cache().is_empty());
    }

    #[test]
    fn service_time_charges_uncached_prefill_and_decode() {
        let cfg = SimConfig { prefill_seconds_per_token: 0.001, decode_seconds_per_token: 0.02, ..SimConfig::default() };
        assert!((cfg.service_seconds(1000, 10) - (1.0 + 0.2)).abs() < 1e-9);
        assert_eq!(cfg.service_seconds(0, 0), 0.0);
        assert_eq!(cfg.prompt_tokens(""), 1);
        assert_eq!(cfg.prompt_tokens("abcde"), 2);
    }

    async fn start(cfg: SimConfig) -> (Simulator, String) {
        let sim = Simulator::new(cfg);
        let addr = sim.clone().spawn((Ipv4Addr::LOCALHOST, 0).into()).await.unwrap();
        (sim, format!("http://{addr}"))
    }

    #[tokio::test]
    async fn http_reports_cached_tokens_metrics_and_gpu_seconds() {
        let cfg = SimConfig {
            prefill_seconds_per_token: 0.01,
            decode_seconds_per_token: 0.1,
            speedup: 1000.0,
            ..SimConfig::default()
        };
        let (sim, url) = start(cfg).await;
        let http = crate::test_client();
        let header = block('s').repeat(2);
        let body = json!({"model": "m", "prompt": [header.clone() + "one", header.clone() + "two"], "max_tokens": 5});
        let v: Value = http.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap().json().await.unwrap();
        assert_eq!(v["choices"].as_array().unwrap().len(), 2);
        assert_eq!(v["choices"][1]["index"], 1);
        assert_eq!(v["usage"]["prompt_tokens"], 2 * 33);
        assert_eq!(v["usage"]["completion_tokens"], 10);
        // Both prompts run concurrently; whichever is admitted second reuses the 2 header blocks.
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 32);

        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        let v: Value = http.post(format!("{url}/v1/chat/completions")).json(&chat).send().await.unwrap().json().await.unwrap();
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["usage"]["prompt_tokens"], 3, "\"<|user|>\\nhi\\n\" is 12 characters");

        let s = sim.stats();
        assert_eq!((s.query_tokens, s.hit_tokens, s.requests), (66 + 3, 32, 3));
        assert!((s.prefill_seconds - (66.0 - 32.0 + 3.0) * 0.01).abs() < 1e-9, "{s:?}");
        assert!((s.decode_seconds - 11.0 * 0.1).abs() < 1e-9, "{s:?}");
        let metrics = http.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("vllm:prefix_cache_queries_total{model_name=\"simulated\"} 69\n"), "{metrics}");
        assert!(metrics.contains("vllm:prefix_cache_hits_total{model_name=\"simulated\"} 32\n"), "{metrics}");
        assert!(metrics.contains("simulator_busy_seconds_total"), "{metrics}");
        let bad = http.post(format!("{url}/v1/completions")).json(&json!({"prompt": 3})).send().await.unwrap();
        assert_eq!(bad.status().as_u16(), 400);
    }

    #[test]
    fn token_ids_follow_the_characters_and_keep_prefixes() {
        let a = token_ids(&(block('a') + "xyz"), 4);
        assert_eq!(a.len(), 17, "64 + 3 characters at 4 per token");
        let b = token_ids(&(block('a') + "xyzw and more"), 4);
        assert_eq!(a[..16], b[..16], "a shared prefix has shared ids");
        assert_eq!(token_ids("", 4).len(), 1, "an empty prompt is one token, as `prompt_tokens` counts it");
        assert!(a.iter().all(|&t| t <= 0x7fff_ffff));
    }

    #[tokio::test]
    async fn render_answers_token_ids_without_touching_the_cache_and_probes_answer() {
        let (sim, url) = start(SimConfig::default()).await;
        let http = crate::test_client();
        let messages = json!([{"role": "system", "content": block('s')}, {"role": "user", "content": "hi"}]);
        let body = json!({"model": "m", "messages": messages, "max_tokens": 7});
        let v: Value = http.post(format!("{url}/v1/chat/completions/render")).json(&body).send().await.unwrap().json().await.unwrap();
        let rendered = openai::render_chat(messages.as_array().unwrap());
        let ids: Vec<u64> = v["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
        assert_eq!(ids, token_ids(&rendered, 4).into_iter().map(u64::from).collect::<Vec<_>>());
        assert_eq!(ids.len() as u64, SimConfig::default().prompt_tokens(&rendered), "as many ids as the completion would count");
        assert_eq!(v["sampling_params"]["max_tokens"], 7);
        assert_eq!(v["model"], "m");
        let s = sim.stats();
        assert_eq!((s.requests, s.query_tokens, s.cached_blocks), (0, 0, 0), "rendering computes and caches nothing");
        let list: Value = http.post(format!("{url}/v1/completions/render")).json(&json!({"prompt": ["a", "b"]})).send().await.unwrap().json().await.unwrap();
        assert_eq!(list.as_array().unwrap().len(), 2);
        let metrics = http.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("simulator_render_requests_total{model_name=\"simulated\"} 2\n"), "{metrics}");
        for path in ["/get_model_info", "/model_info", "/server_info", "/get_server_info", "/get_load", "/health_generate", "/health", "/v1/models"] {
            assert!(http.get(format!("{url}{path}")).send().await.unwrap().status().is_success(), "{path}");
        }
        assert_eq!(http.get(format!("{url}/nope")).send().await.unwrap().status().as_u16(), 404);
    }

    #[tokio::test]
    async fn concurrency_limit_queues_requests() {
        // One slot, 0.2 model seconds per request at speedup 10 = 20 ms wall each.
        let cfg = SimConfig { max_concurrency: 1, decode_seconds_per_token: 0.1, speedup: 10.0, ..SimConfig::default() };
        let (_sim, url) = start(cfg).await;
        let http = crate::test_client();
        let started = std::time::Instant::now();
        let calls = (0..4).map(|i| {
            let http = http.clone();
            let url = url.clone();
            async move {
                http.post(format!("{url}/v1/completions")).json(&json!({"prompt": format!("p{i}"), "max_tokens": 2})).send().await.unwrap()
            }
        });
        futures_util::future::join_all(calls).await;
        assert!(started.elapsed() >= Duration::from_millis(80), "4 requests × 20 ms through one slot: {:?}", started.elapsed());
    }
}
