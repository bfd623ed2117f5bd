//! The `llm-fakes` binary's contract with its callers (bench/, scripts/ops-check): the first stdout
//! line is the base URL of a server that answers; invalid simulator settings exit 78.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// Kills the child when dropped, so a failing test leaves no server behind.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `llm-fakes {args}` and returns it with the URL from its first stdout line.
fn start(args: &[&str]) -> (Server, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_llm-fakes"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start llm-fakes");
    let stdout = child.stdout.take().expect("piped");
    let server = Server(child);
    // Blocks until the line is written; the binary prints it right after binding.
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read the URL line");
    let url = line.trim().to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "first stdout line: {line:?}");
    (server, url)
}

/// An HTTP client: reqwest's rustls needs the process's crypto provider (ring, as the daemon's).
fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

#[tokio::test]
async fn fake_prints_its_url_and_answers_completions() {
    let (_server, url) = start(&["fake", "--latency", "1ms"]);
    let http = client();
    let v: serde_json::Value = http
        .post(format!("{url}/v1/completions"))
        .json(&serde_json::json!({"prompt": ["hello world", "hello there"]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][1]["text"], "ok:hello th");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 1, "6 shared characters");
}

#[tokio::test]
async fn simulate_prints_its_url_and_reports_its_metrics() {
    let (_server, url) = start(&["simulate", "--model", "m", "--decode-ms-per-token", "0"]);
    let page = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("vllm:prefix_cache_hits_total{model_name=\"m\"} 0\n"), "{page}");
    assert!(page.contains("simulator_busy_seconds_total"), "{page}");
}

#[test]
fn simulate_rejects_settings_that_are_not_positive() {
    let out = Command::new(env!("CARGO_BIN_EXE_llm-fakes")).args(["simulate", "--speedup", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(out.stdout.is_empty(), "nothing is served");
}
