//! The configuration reference against the code: `docs/configuration.md` documents every key of
//! [`RawConfig`] with its real default and environment variable, `config/example.toml` lists every
//! key with its default, every documented environment variable really overrides its key, and
//! `check-config` prints a complete, valid TOML rendering of the effective configuration that it
//! accepts again.

mod common;

use std::collections::BTreeMap;

use common::*;
use prefix_batcher::config::{self, RawConfig, ENV_PREFIX};
use serde_json::Value;

fn read(rel: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

/// `section.key` → default value (as JSON) of every key.
fn keys() -> BTreeMap<String, Value> {
    let v = serde_json::to_value(RawConfig::default()).unwrap();
    let mut out = BTreeMap::new();
    for (section, body) in v.as_object().unwrap() {
        for (k, d) in body.as_object().unwrap() {
            out.insert(format!("{section}.{k}"), d.clone());
        }
    }
    out
}

/// A JSON value as a TOML literal (how the reference writes defaults).
fn toml_literal(v: &Value) -> String {
    match v {
        Value::Object(m) if m.is_empty() => "{}".into(),
        Value::Array(a) => format!("[{}]", a.iter().map(toml_literal).collect::<Vec<_>>().join(", ")),
        other => other.to_string(),
    }
}

fn env_name(key: &str) -> String {
    format!("{ENV_PREFIX}__{}", key.replace('.', "__").to_ascii_uppercase())
}

/// Keys that only the file can set (tables and arrays of tables).
const FILE_ONLY: &[&str] = &["sharding.keys", "sharding.rules"];

#[test]
fn the_reference_documents_every_key_with_its_default_and_environment_variable() {
    let doc = read("docs/configuration.md");
    let rows: BTreeMap<String, Vec<String>> = doc
        .lines()
        .filter_map(|l| {
            let cells: Vec<String> = l.split(" | ").map(|c| c.trim_matches(|x: char| x == '|' || x.is_whitespace()).to_owned()).collect();
            let key = cells.first()?.strip_prefix('`')?.strip_suffix('`')?.to_owned();
            (cells.len() == 5).then_some((key, cells))
        })
        .collect();
    let mut problems = Vec::new();
    for (key, default) in keys() {
        let Some(cells) = rows.get(&key) else {
            problems.push(format!("{key}: no row in docs/configuration.md"));
            continue;
        };
        let (meaning, unit, doc_default, env) = (&cells[1], &cells[2], &cells[3], &cells[4]);
        if meaning.len() < 20 {
            problems.push(format!("{key}: meaning too short: {meaning:?}"));
        }
        if unit.is_empty() {
            problems.push(format!("{key}: no unit/type"));
        }
        let want = format!("`{}`", toml_literal(&default));
        if doc_default != &want {
            problems.push(format!("{key}: documented default {doc_default} but the code says {want}"));
        }
        let want_env = if FILE_ONLY.contains(&key.as_str()) { "file only".to_owned() } else { format!("`{}`", env_name(&key)) };
        if !env.starts_with(&want_env) {
            problems.push(format!("{key}: environment variable cell {env:?}, want {want_env}"));
        }
    }
    for key in rows.keys() {
        if !keys().contains_key(key) {
            problems.push(format!("{key}: documented but not a configuration key"));
        }
    }
    assert!(problems.is_empty(), "docs/configuration.md is out of date:\n{}", problems.join("\n"));
}

#[test]
fn the_example_lists_every_key_with_its_default() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/example.toml");
    let text = read("config/example.toml");
    // Textually: every scalar and list key is written out in its section, the tables are shown.
    let mut section = String::new();
    let mut written = std::collections::BTreeSet::new();
    for l in text.lines() {
        let t = l.trim_start_matches('#').trim();
        if let Some(s) = l.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = s.trim_matches(['[', ']']).to_owned();
            written.insert(section.clone());
        } else if let Some((k, _)) = t.split_once(" = ") {
            if !l.starts_with('#') {
                written.insert(format!("{section}.{}", k.trim()));
            }
        }
    }
    let commented_rules = text.contains("# [[sharding.rules]]");
    for key in keys().keys() {
        let shown = written.contains(key) || (key == "sharding.rules" && commented_rules);
        assert!(shown, "config/example.toml does not show `{key}`");
    }
    // Semantically: loading the example gives exactly the defaults (the environment of this test
    // process has no PREFIX_BATCHER__ variables, or the comparison would be meaningless).
    assert!(std::env::vars().all(|(k, _)| !k.starts_with(&format!("{ENV_PREFIX}__"))), "unset PREFIX_BATCHER__* to run this test");
    let loaded = serde_json::to_value(config::load_raw(Some(&path)).expect("the example loads")).unwrap();
    let defaults = serde_json::to_value(RawConfig::default()).unwrap();
    assert_eq!(loaded, defaults, "config/example.toml must hold every default");
}

/// Runs `prefix-batcher check-config [path]` with `env`; returns (exit code, stdout, stderr).
fn check_config(args: &[&std::ffi::OsStr], env: &[(String, String)]) -> (Option<i32>, String, String) {
    let mut cmd = bin_command();
    cmd.arg("check-config").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run check-config");
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The `key = value` lines of a `check-config` output, as `section.key` → value text.
fn parse_output(out: &str) -> BTreeMap<String, String> {
    let mut section = String::new();
    let mut m = BTreeMap::new();
    for l in out.lines() {
        if let Some(s) = l.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = s.to_owned();
        } else if let Some((k, v)) = l.split_once(" = ") {
            m.insert(format!("{section}.{k}"), v.to_owned());
        }
    }
    m
}

#[test]
fn every_documented_environment_variable_overrides_its_key() {
    // A valid, non-default value for every key an environment variable can set; list items
    // with spaces around them, as people write lists, which check-config prints trimmed.
    let values: &[(&str, &str, &str)] = &[
        // (key, environment value, expected in check-config's output)
        // Text that looks like a number stays text (observed: `007` became `7`, `1e3` `1000`).
        ("instance.name", "007", "\"007\""),
        ("amqp.url", "amqps://envuser:envpass@rabbit.example:5673/%2f", "\"amqps://envuser:***@rabbit.example:5673/%2f\""),
        ("amqp.input_queue", "env.input", "\"env.input\""),
        ("amqp.shard_exchange", "env.shards", "\"env.shards\""),
        ("amqp.partition_queue_prefix", "env.partition", "\"env.partition\""),
        ("amqp.results_queue", "env.results", "\"env.results\""),
        ("amqp.dead_letter_exchange", "env.dlx", "\"env.dlx\""),
        ("amqp.dead_letter_queue", "env.dead-letter", "\"env.dead-letter\""),
        ("amqp.partitions", "32", "32"),
        ("amqp.input_prefetch", "100", "100"),
        ("amqp.partition_prefetch", "50", "50"),
        ("amqp.max_message_bytes", "1000000", "1000000"),
        ("amqp.confirm_timeout", "11s", "\"11s\""),
        ("amqp.reconnect_backoff_initial", "200ms", "\"200ms\""),
        ("amqp.reconnect_backoff_max", "20s", "\"20s\""),
        ("amqp.backlog_poll_interval", "7s", "\"7s\""),
        ("amqp.consumer_timeout", "40m", "\"40m\""),
        ("amqp.delivery_limit", "3", "3"),
        ("amqp.quorum_initial_group_size", "5", "5"),
        ("amqp.heartbeat", "20s", "\"20s\""),
        (
            "amqp.urls",
            "amqps://envuser:envpass@r1.example:5671/%2f , amqps://envuser:envpass@r2.example:5671/%2f",
            "[\"amqps://envuser:***@r1.example:5671/%2f\", \"amqps://envuser:***@r2.example:5671/%2f\"]",
        ),
        ("redis.url", "rediss://envuser:envpass@redis.example:6380/2", "\"rediss://envuser:***@redis.example:6380/2\""),
        ("redis.key_prefix", "env-prefix", "\"env-prefix\""),
        ("redis.command_timeout", "3s", "\"3s\""),
        (
            "redis.sentinels",
            "redis://:envpass@s1.example:26379, redis://:envpass@s2.example:26380",
            "[\"redis://:***@s1.example:26379\", \"redis://:***@s2.example:26380\"]",
        ),
        ("redis.sentinel_master", "env-master", "\"env-master\""),
        ("ownership.lease_ttl", "20s", "\"20s\""),
        ("ownership.renew_deadline", "12s", "\"12s\""),
        ("ownership.renew_interval", "4s", "\"4s\""),
        ("ownership.member_ttl", "11s", "\"11s\""),
        ("ownership.settle_time", "3s", "\"3s\""),
        ("ownership.llm_down_hand_over_after", "90s", "\"90s\""),
        ("keying.mode", "off", "\"off\""),
        ("keying.prefix_chars", "128", "128"),
        ("keying.chat_key", "rendered", "\"rendered\""),
        ("sharding.default_shards", "4", "4"),
        ("sharding.max_shards", "6", "6"),
        ("batching.max_batch_size", "10", "10"),
        ("batching.max_batch_wait", "300ms", "\"300ms\""),
        ("batching.channel_capacity", "32", "32"),
        ("batching.max_buffered_bytes", "2000000", "2000000"),
        ("llm.endpoints", "https://a.example:8000, http://b.example:8001", "[\"https://a.example:8000\", \"http://b.example:8001\"]"),
        ("llm.model", "1e3", "\"1e3\""),
        ("llm.api_key", "env-token-123", "\"***\""),
        ("llm.max_concurrency", "7", "7"),
        ("llm.request_timeout", "60s", "\"60s\""),
        ("llm.connect_timeout", "2s", "\"2s\""),
        ("llm.max_attempts", "2", "2"),
        ("llm.backoff_initial", "100ms", "\"100ms\""),
        ("llm.backoff_max", "5s", "\"5s\""),
        ("llm.list_prompts", "false", "false"),
        ("llm.max_response_bytes", "1000000", "1000000"),
        ("llm.liveness_check_after", "45s", "\"45s\""),
        ("requests.reply_to_pattern", "tenant-a\\..*", "'tenant-a\\..*'"),
        ("requests.allowed_params", "max_tokens, temperature", "[\"max_tokens\", \"temperature\"]"),
        ("requests.max_tokens", "512", "512"),
        ("requests.max_n", "2", "2"),
        ("requests.max_logprobs", "5", "5"),
        ("requests.models", " small , large", "[\"small\", \"large\"]"),
        ("requests.max_messages", "64", "64"),
        ("http.listen", "0.0.0.0:9999", "\"0.0.0.0:9999\""),
        ("shutdown.drain_timeout", "40s", "\"40s\""),
        ("log.format", "json", "\"json\""),
        ("log.level", "debug", "\"debug\""),
    ];
    // The TLS files must exist and parse: a throwaway CA and client certificate.
    let files = common::tls::TlsFiles::generate();
    let file = |p: &std::path::Path| (p.to_string_lossy().into_owned(), format!("{:?}", p.to_string_lossy()));
    let mut values: Vec<(&str, String, String)> = values.iter().map(|(k, v, w)| (*k, v.to_string(), w.to_string())).collect();
    for keys in [["amqp.tls_ca_file", "amqp.tls_cert_file", "amqp.tls_key_file"], ["redis.tls_ca_file", "redis.tls_cert_file", "redis.tls_key_file"], ["llm.tls_ca_file", "llm.tls_cert_file", "llm.tls_key_file"]] {
        for (key, p) in keys.into_iter().zip([&files.ca_cert, &files.client_cert, &files.client_key]) {
            let (value, want) = file(p);
            values.push((key, value, want));
        }
    }
    let covered: std::collections::BTreeSet<&str> = values.iter().map(|v| v.0).collect();
    for key in keys().keys() {
        assert!(covered.contains(key.as_str()) || FILE_ONLY.contains(&key.as_str()), "no environment override test for `{key}`");
    }
    let env: Vec<(String, String)> = values.iter().map(|(k, v, _)| (env_name(k), v.clone())).collect();
    let (code, out, err) = check_config(&[], &env);
    assert_eq!(code, Some(0), "check-config with every override failed:\n{err}");
    let got = parse_output(&out);
    for (key, _, want) in &values {
        assert_eq!(got.get(*key), Some(want), "{} did not set `{key}`; output:\n{out}", env_name(key));
    }
    for secret in ["envpass", "env-token-123"] {
        assert!(!out.contains(secret) && !err.contains(secret), "a secret reached check-config's output");
    }
}

#[test]
fn check_config_prints_valid_complete_toml_that_round_trips() {
    let dir = std::env::temp_dir().join(format!("pbt-cfgtrip-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("in.toml");
    std::fs::write(
        &file,
        r#"[amqp]
url = "amqp://user:hunter2-file@rabbit.example:5672/%2f"
partitions = 16
[redis]
url = "redis://user:s3cret-file@redis.example:6379/1"
[sharding]
default_shards = 4
[sharding.keys]
"tenant-42" = 2
"0123456789abcdef" = 8
[[sharding.rules]]
pattern = "^You are a \"helpful\" assistant"
shards = 16
[[sharding.rules]]
pattern = '^\d+ tokens'
shards = 2
[llm]
endpoints = ["http://a.example:8000", "http://b.example:8000"]
api_key = "sk-file-token"
"#,
    )
    .unwrap();
    let (code, out, err) = check_config(&[file.as_os_str()], &[]);
    assert_eq!(code, Some(0), "{err}");
    for secret in ["hunter2-file", "s3cret-file", "sk-file-token"] {
        assert!(!out.contains(secret) && !err.contains(secret), "secret {secret} printed:\n{out}");
    }
    let printed = parse_output(&out);
    for key in keys().keys() {
        assert!(printed.contains_key(key) || out.contains(&format!("[{key}]")) || out.contains(&format!("[[{key}]]")), "check-config does not print `{key}`:\n{out}");
    }
    assert!(out.contains("tenant-42") && out.contains("0123456789abcdef") && out.contains("helpful") && out.contains("tokens"), "tables and rules are printed:\n{out}");

    // The output is valid TOML that check-config accepts again, with the same effective values.
    let again = dir.join("printed.toml");
    std::fs::write(&again, &out).unwrap();
    let (code2, out2, err2) = check_config(&[again.as_os_str()], &[]);
    assert_eq!(code2, Some(0), "check-config rejects its own output:\n{err2}\n--- output was:\n{out}");
    assert_eq!(out2, out, "printing the printed configuration changed it");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A configuration whose longest hold of a delivery comes too close to the broker's
/// `consumer_timeout` is refused with exit 78, naming the keys and the numbers.
#[test]
fn check_config_refuses_a_hold_past_the_consumer_timeout() {
    let env = [("amqp.consumer_timeout", "10m"), ("llm.request_timeout", "10m"), ("llm.max_attempts", "2")]
        .map(|(k, v)| (env_name(k), v.to_owned()));
    let (code, _, err) = check_config(&[], &env);
    assert_eq!(code, Some(78), "{err}");
    for part in ["amqp.consumer_timeout", "\"10m\"", "llm.request_timeout 600s", "llm.max_attempts 2", "480s"] {
        assert!(err.contains(part), "{part} missing from: {err}");
    }
}

/// `check-config | head -1`: a reader that stops reading is not an error. The pipe's read end is
/// closed before the command starts, so every write meets `EPIPE` (before, `println!` panicked:
/// exit 101, "failed printing to stdout: Broken pipe"). A full disk behind a redirect is an
/// error: exit 74 (`EX_IOERR`) with the system's reason, and a refused configuration whose
/// message cannot be written exits 78 all the same.
#[test]
fn check_config_into_a_closed_pipe_exits_0_and_into_a_full_disk_74() {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = bin_command().arg("check-config").stdout(writer).stderr(std::process::Stdio::piped()).output().expect("run check-config");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "closed pipe: {err}");
    assert!(!err.contains("panicked"), "closed pipe: {err}");
    if let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") {
        let out = bin_command().arg("check-config").stdout(full).stderr(std::process::Stdio::piped()).output().expect("run check-config");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(74), "/dev/full: {err}");
        assert!(err.contains("cannot write to stdout") && !err.contains("panicked"), "/dev/full: {err}");
        // A refused configuration with a standard error that cannot be written still exits 78
        // (eprintln! panicked: 101, which systemd's RestartPreventExitStatus=78 would restart).
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let out = bin_command().arg("check-config").env("PREFIX_BATCHER__AMQP__PARTITIONS", "0").stderr(full).output().expect("run check-config");
        assert_eq!(out.status.code(), Some(78), "a refused configuration with stderr on /dev/full");
    }
}
