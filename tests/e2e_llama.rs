//! End to end against a real llama.cpp `llama-server` (SmolLM2-135M on CPU) with real
//! BIG-Bench-Hard few-shot prompts.
//!
//! Needs `PREFIX_BATCHER_LLM_URL` (the server's base URL, e.g. from `scripts/llm-server start`)
//! and the shared data directory (`PREFIX_BATCHER_DATA`, default `../shared/data`). `scripts/test`
//! starts the server and runs this test with `--ignored`.

mod common;

use std::collections::{HashMap, HashSet};
use std::io::BufRead;
use std::path::PathBuf;
use std::time::Duration;

use common::*;

fn data_dir() -> PathBuf {
    std::env::var_os("PREFIX_BATCHER_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data"))
}

/// `per_task` prompts of each of the `tasks` BBH tasks with the shortest few-shot headers.
fn bbh_prompts(tasks: usize, per_task: usize) -> Vec<(String, String)> {
    let dir = data_dir().join("bbh-cot");
    let headers = std::fs::read_to_string(dir.join("headers.jsonl"))
        .unwrap_or_else(|e| panic!("reading {}: {e} (set PREFIX_BATCHER_DATA to the shared data directory)", dir.display()));
    let mut hs: Vec<(usize, String)> = headers
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| (v["header"].as_str().unwrap().chars().count(), v["task"].as_str().unwrap().to_owned()))
        .collect();
    hs.sort();
    let wanted: HashSet<String> = hs.into_iter().take(tasks).map(|(_, t)| t).collect();
    // The prompts file is gzip; `zcat` keeps the test free of a decompression dependency.
    let out = std::process::Command::new("zcat").arg(dir.join("bbh_cot_prompts.jsonl.gz")).output().expect("zcat");
    assert!(out.status.success(), "zcat failed");
    let mut taken: HashMap<String, usize> = HashMap::new();
    let mut prompts = Vec::new();
    for line in out.stdout.lines() {
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        let task = v["task"].as_str().unwrap().to_owned();
        if wanted.contains(&task) && taken.get(&task).copied().unwrap_or(0) < per_task {
            *taken.entry(task.clone()).or_default() += 1;
            prompts.push((format!("{task}-{}", v["idx"]), v["prompt"].as_str().unwrap().to_owned()));
        }
    }
    assert_eq!(prompts.len(), tasks * per_task);
    // Interleave the tasks, as a competing-consumers queue would deliver them.
    prompts.sort_by_key(|(id, _)| id.rsplit('-').next().unwrap().parse::<u32>().unwrap_or(0));
    prompts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real llama-server: scripts/test runs it with PREFIX_BATCHER_LLM_URL set"]
async fn real_llama_server_batches_by_prefix_and_reuses_its_cache() {
    let url = std::env::var("PREFIX_BATCHER_LLM_URL").expect("PREFIX_BATCHER_LLM_URL must name the llama-server base URL");
    let env = TestEnv::new("e2e");
    let mut raw = env.raw_config(&url);
    raw.llm.list_prompts = false;
    raw.llm.max_concurrency = 1;
    raw.llm.request_timeout = "300s".into();
    raw.llm.max_attempts = 2;
    raw.sharding.default_shards = 1;
    raw.batching.max_batch_wait = "500ms".into();
    raw.keying.prefix_chars = 256;

    let prompts = bbh_prompts(2, 4);
    let reqs: Vec<TestRequest> = prompts
        .iter()
        .map(|(id, p)| {
            let body = serde_json::json!({"id": id, "prompt": p, "params": {"max_tokens": 4, "temperature": 0}});
            TestRequest { id: id.clone(), body: serde_json::to_vec(&body).unwrap(), group: 0 }
        })
        .collect();
    let Started { amqp, daemon, results: mut replies, reply } = start_with_replies(&env, &raw).await;
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    replies.until_all(&ids(&reqs), Duration::from_secs(600)).await;

    let results: Vec<_> = replies.received.iter().map(|r| r.result()).collect();
    assert_eq!(results.len(), reqs.len(), "exactly one result per request");
    let mut prompt_tokens = 0;
    let mut cached_tokens = 0;
    let mut keys_per_batch: HashMap<String, HashSet<String>> = HashMap::new();
    for r in &results {
        assert!(r.ok, "request {} failed: {:?}", r.id, r.error);
        assert!(r.output.as_str().is_some_and(|s| !s.is_empty()), "empty output for {}", r.id);
        let u = r.usage.as_ref().unwrap_or_else(|| panic!("no usage for {}", r.id));
        assert!(u.prompt_tokens > 100, "a BBH prompt has hundreds of tokens, got {}", u.prompt_tokens);
        prompt_tokens += u.prompt_tokens;
        cached_tokens += u.cached_tokens.expect("llama-server reports cached_tokens");
        keys_per_batch.entry(r.batch_id.clone()).or_default().insert(r.prefix_key.clone());
    }
    assert!(keys_per_batch.values().all(|k| k.len() == 1), "every batch is key-pure: {keys_per_batch:?}");
    let ratio = cached_tokens as f64 / prompt_tokens as f64;
    eprintln!("e2e: {} requests, {prompt_tokens} prompt tokens, {cached_tokens} cached ({ratio:.3})", results.len());
    // Two keys, four prompts each: after the first prompt of a key, its few-shot header is cached.
    assert!(ratio >= 0.4, "cached prompt-token ratio {ratio:.3} is too low for prefix-grouped prompts");

    daemon.stop().await.expect("daemon stops cleanly");
    env.cleanup().await;
}
