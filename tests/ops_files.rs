//! The operations files (`grafana/`, `prometheus/`, `systemd/`) against the daemon itself, without
//! external tools (`scripts/ops-check` runs the same files through promtool, systemd-analyze, a
//! Prometheus server and Grafana's schema):
//!
//! - every metric name in a dashboard query or an alert rule is one the daemon exports (or one of
//!   vLLM's, listed in [`VLLM_METRICS`], or Prometheus' own `up`);
//! - the dashboard has the `DS_PROMETHEUS` input and variables, uses them everywhere, has the
//!   panels the operators need, and its panels do not overlap;
//! - every alert the runbook promises exists, with a severity, a summary, a description, a
//!   runbook text and a firing test in `prometheus/alerts_test.yml`;
//! - the systemd units say what the daemon's contract needs (notify, watchdog, stop timeout
//!   above the drain timeout, no restart on exit 78, hardening).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use prefix_batcher::config::RawConfig;
use prefix_batcher::metrics;
use serde_json::Value;

/// vLLM's own metrics that the dashboard reads when Prometheus scrapes the vLLM servers
/// (<https://docs.vllm.ai/en/latest/design/metrics.html>); the fake LLM serves them too.
const VLLM_METRICS: &[&str] = &["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"];
/// Prometheus' own series used by the alert rules.
const PROMETHEUS_METRICS: &[&str] = &["up"];

fn path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(path(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

fn dashboard() -> Value {
    serde_json::from_str(&read("grafana/dashboards/prefix-batcher.json")).expect("the dashboard is valid JSON")
}

/// Every panel, the panels nested in collapsed rows included.
fn panels(d: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        out.push(p);
        if let Some(nested) = p["panels"].as_array() {
            out.extend(nested);
        }
    }
    out
}

/// `(panel title, expr)` of every query target.
fn dashboard_exprs(d: &Value) -> Vec<(String, String)> {
    panels(d)
        .into_iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"].as_array().into_iter().flatten().filter_map(move |t| t["expr"].as_str().map(|e| (title.clone(), e.to_owned())))
        })
        .collect()
}

/// The sample names the daemon exports: every family of the registry, with a label set of each
/// vector family exercised so that it shows up in the exposition.
fn exported_names() -> BTreeSet<String> {
    metrics::init(&prefix_batcher::llm::CALL_OUTCOME_LABELS, 1, &prefix_batcher::publisher::OwnDestination::LABELS, prefix_batcher::publisher::REPLY_REFUSALS);
    metrics::deployment(8);
    metrics::buffer_state(9999, 1, 0.5);
    metrics::partition_backlog(9999, 1);
    metrics::unsettled_deliveries(9999, 1);
    metrics::lease_op("renew", "lost");
    metrics::tls_client_certificate_expiry("redis", 1);
    let text = metrics::render();
    metrics::partition_released(9999);
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

/// The metric names a PromQL expression selects: identifiers that are not functions,
/// aggregations, keywords, label names (inside `{…}` or after `by`/`without`/`on`/`ignoring`/
/// `group_left`/`group_right`), durations or numbers, with string literals skipped.
fn promql_metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: &[&str] = &["and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"];
    const LABEL_LISTS: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];
    let c: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let (mut i, mut braces, mut brackets) = (0, 0i32, 0i32);
    let mut skip_label_list = false;
    while i < c.len() {
        let ch = c[i];
        if ch == '"' || ch == '\'' || ch == '`' {
            i += 1;
            while i < c.len() && c[i] != ch {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        match ch {
            '{' => braces += 1,
            '}' => braces -= 1,
            '[' => brackets += 1,
            ']' => brackets -= 1,
            _ => {}
        }
        if ch.is_ascii_digit() || (ch == '.' && c.get(i + 1).is_some_and(char::is_ascii_digit)) {
            // A number or a duration (`5m`, `1e3`, `0x1f`): one token.
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '.') {
                i += 1;
            }
            continue;
        }
        if ch.is_ascii_alphabetic() || ch == '_' || ch == ':' {
            let start = i;
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '_' || c[i] == ':') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let mut j = i;
            while j < c.len() && c[j].is_whitespace() {
                j += 1;
            }
            let next = c.get(j).copied();
            if braces > 0 || brackets > 0 || skip_label_list {
                continue;
            }
            if LABEL_LISTS.contains(&word.as_str()) {
                if next == Some('(') {
                    skip_label_list = true;
                }
                continue;
            }
            let next_word: String = c[j..].iter().take_while(|x| x.is_ascii_alphanumeric() || **x == '_').collect();
            if next == Some('(') || next_word == "by" || next_word == "without" || KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) {
                continue; // function, aggregation (`sum by (…) (…)`) or keyword
            }
            names.insert(word);
            continue;
        }
        if ch == ')' && skip_label_list {
            skip_label_list = false;
        }
        i += 1;
    }
    names
}

#[test]
fn promql_name_extraction_handles_the_usual_shapes() {
    let got = promql_metric_names(
        r#"sum by (job, "odd") (rate(a_total{x="b_total", y=~"$i"}[5m] offset 1h)) / on (job) group_left (z) max(vllm:hits_total) > 0.5 and histogram_quantile(0.99, sum by (le) (rate(h_bucket[$__rate_interval]))) unless up == bool 1e3"#,
    );
    let want: BTreeSet<String> = ["a_total", "vllm:hits_total", "h_bucket", "up"].iter().map(|s| s.to_string()).collect();
    assert_eq!(got, want);
}

/// The rules of `prometheus/alerts.yml`: name → (expr, the rule's whole text). A line-based reader
/// of the file's own layout (`- alert:` items, `expr:` inline or as a `|` block).
fn alert_rules() -> BTreeMap<String, (String, String)> {
    let text = read("prometheus/alerts.yml");
    let lines: Vec<&str> = text.lines().collect();
    let mut rules = BTreeMap::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(name) = lines[i].trim_start().strip_prefix("- alert:") else {
            i += 1;
            continue;
        };
        let indent = lines[i].len() - lines[i].trim_start().len();
        let start = i;
        i += 1;
        while i < lines.len() && (lines[i].trim().is_empty() || lines[i].len() - lines[i].trim_start().len() > indent) {
            i += 1;
        }
        let body = &lines[start..i];
        let mut expr = String::new();
        for (k, l) in body.iter().enumerate() {
            if let Some(v) = l.trim_start().strip_prefix("expr:") {
                let v = v.trim();
                if v == "|" || v == ">" {
                    let ind = l.len() - l.trim_start().len();
                    for m in &body[k + 1..] {
                        if !m.trim().is_empty() && m.len() - m.trim_start().len() <= ind {
                            break;
                        }
                        expr.push_str(m.trim());
                        expr.push('\n');
                    }
                } else {
                    expr = v.to_owned();
                }
            }
        }
        assert!(!expr.is_empty(), "alert {name}: no expr found");
        rules.insert(name.trim().to_owned(), (expr, body.join("\n")));
    }
    rules
}

#[test]
fn every_queried_metric_is_exported() {
    let exported = exported_names();
    for must in ["prefix_batcher_partitions", "prefix_batcher_build_info", "prefix_batcher_queue_messages"] {
        assert!(exported.contains(must), "{must} is not exported: {exported:?}");
    }
    let allowed = |n: &str| exported.contains(n) || VLLM_METRICS.contains(&n) || PROMETHEUS_METRICS.contains(&n);
    let d = dashboard();
    let mut queries: Vec<(String, String)> = dashboard_exprs(&d).into_iter().map(|(t, e)| (format!("dashboard panel {t:?}"), e)).collect();
    for v in d["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"].as_str().and_then(|q| q.strip_prefix("label_values(")) {
            let metric = q.rsplit_once(',').expect("label_values(metric, label)").0;
            queries.push((format!("dashboard variable {}", v["name"]), metric.to_owned()));
        }
    }
    queries.extend(alert_rules().into_iter().map(|(n, (e, _))| (format!("alert {n}"), e)));
    assert!(queries.len() > 30, "too few queries found: {}", queries.len());
    let mut unknown = Vec::new();
    for (place, q) in &queries {
        let names = promql_metric_names(q);
        assert!(!names.is_empty(), "{place}: no metric in {q}");
        unknown.extend(names.into_iter().filter(|n| !allowed(n)).map(|n| format!("{place}: {n}")));
    }
    assert!(unknown.is_empty(), "metric names the daemon does not export:\n{}", unknown.join("\n"));
}

#[test]
fn dashboard_has_the_datasource_input_variables_and_panels() {
    let d = dashboard();
    let input = &d["__inputs"][0];
    assert_eq!((input["name"].as_str(), input["type"].as_str(), input["pluginId"].as_str()), (Some("DS_PROMETHEUS"), Some("datasource"), Some("prometheus")));
    let vars: BTreeMap<&str, &Value> = d["templating"]["list"].as_array().unwrap().iter().map(|v| (v["name"].as_str().unwrap(), v)).collect();
    assert_eq!(vars["DS_PROMETHEUS"]["type"], "datasource", "provisioned dashboards resolve ${{DS_PROMETHEUS}} through this variable");
    assert_eq!(vars["DS_PROMETHEUS"]["query"], "prometheus");
    for v in ["instance", "partition"] {
        assert_eq!(vars[v]["type"], "query", "variable {v}");
        assert_eq!(vars[v]["datasource"]["uid"], "${DS_PROMETHEUS}", "variable {v}");
        assert_eq!(vars[v]["includeAll"], true, "variable {v}");
        assert_eq!(vars[v]["allValue"], ".*", "variable {v}: All must be a regex for =~ matchers");
    }

    let mut ids = BTreeSet::new();
    let mut cells: BTreeMap<(i64, i64), String> = BTreeMap::new();
    for p in panels(&d) {
        let title = p["title"].as_str().unwrap_or_default();
        assert!(ids.insert(p["id"].as_i64().expect("panel id")), "duplicate panel id in {title:?}");
        let g = &p["gridPos"];
        let (x, y, w, h) = (g["x"].as_i64().unwrap(), g["y"].as_i64().unwrap(), g["w"].as_i64().unwrap(), g["h"].as_i64().unwrap());
        assert!(x >= 0 && w > 0 && x + w <= 24 && h > 0, "{title:?}: gridPos {g} outside the 24-column grid");
        for cx in x..x + w {
            for cy in y..y + h {
                if let Some(other) = cells.insert((cx, cy), title.to_owned()) {
                    panic!("panels {other:?} and {title:?} overlap at ({cx}, {cy})");
                }
            }
        }
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{title:?}: panel datasource");
        assert!(!p["description"].as_str().unwrap_or_default().is_empty(), "{title:?}: no description");
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("{title:?}: no targets"));
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${DS_PROMETHEUS}", "{title:?}: target datasource");
            assert!(t["refId"].is_string() && t["expr"].is_string(), "{title:?}: target {t}");
            let e = t["expr"].as_str().unwrap();
            if e.contains("prefix_batcher_") && !e.contains("queue=\"input\"") && !e.contains("prefix_batcher_partitions)") && !e.contains("queue=\"partition\"") {
                assert!(e.contains("instance=~\"$instance\""), "{title:?}: query ignores the instance variable: {e}");
            }
        }
    }

    let exprs: Vec<String> = dashboard_exprs(&d).into_iter().map(|(_, e)| e).collect();
    let any = |needles: &[&str]| exprs.iter().any(|e| needles.iter().all(|n| e.contains(n)));
    let required: &[(&str, &[&str])] = &[
        ("batch purity", &["prefix_batcher_batch_purity_sum", "prefix_batcher_batch_purity_count"]),
        ("our cached-token ratio", &["prefix_batcher_llm_cached_prompt_tokens_total", "prefix_batcher_llm_prompt_tokens_total"]),
        ("the server's cached-token ratio", &["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"]),
        ("input backlog", &["prefix_batcher_queue_messages{queue=\"input\"}"]),
        ("backlog per partition", &["prefix_batcher_queue_messages{queue=\"partition\"", "by (partition)"]),
        ("oldest buffered age", &["prefix_batcher_oldest_buffered_age_seconds"]),
        ("throughput by outcome", &["prefix_batcher_requests_total", "outcome"]),
        ("flush reasons", &["prefix_batcher_batches_total", "by (reason)"]),
        ("batch size", &["prefix_batcher_batch_size_bucket"]),
        ("LLM latency p50", &["histogram_quantile(0.5", "prefix_batcher_llm_request_duration_seconds_bucket"]),
        ("LLM latency p99", &["histogram_quantile(0.99", "prefix_batcher_llm_request_duration_seconds_bucket"]),
        ("LLM error ratio", &["prefix_batcher_llm_requests_total{", "outcome!~", "/ sum(rate(prefix_batcher_llm_requests_total"]),
        ("partitions owned per instance", &["prefix_batcher_partitions_owned", "by (instance)"]),
        ("lease operations", &["prefix_batcher_lease_operations_total"]),
        ("rebalances", &["prefix_batcher_rebalances_total"]),
        ("dead-letter rate", &["rate(prefix_batcher_dead_letters_total"]),
        ("split keys per level", &["prefix_batcher_key_splits", "by (level)"]),
        ("hottest keys' share", &["prefix_batcher_hot_key_share", "by (rank)"]),
        ("unsplittable key share", &["prefix_batcher_unsplittable_key_share"]),
    ];
    for (what, needles) in required {
        assert!(any(needles), "no dashboard query shows {what} (looked for {needles:?})");
    }
}

#[test]
fn alerts_cover_the_runbook_and_are_tested() {
    let rules = alert_rules();
    for required in [
        "PrefixBatcherBacklogGrowing",
        "PrefixBatcherLowBatchPurity",
        "PrefixBatcherLeaseFlapping",
        "PrefixBatcherDeadLetters",
        "PrefixBatcherLlmErrors",
        "PrefixBatcherInstanceDown",
        "PrefixBatcherAllInstancesMissing",
        "PrefixBatcherPartitionsUnowned",
        "PrefixBatcherAmqpConnectionBlocked",
        "PrefixBatcherUnsplittableHotKey",
    ] {
        assert!(rules.contains_key(required), "alert {required} missing from prometheus/alerts.yml");
    }
    assert!(rules["PrefixBatcherLowBatchPurity"].0.contains("< 0.95"), "purity threshold is 0.95");
    assert!(rules["PrefixBatcherBacklogGrowing"].1.contains("for: 10m"), "backlog must grow for 10 minutes");
    let tests = read("prometheus/alerts_test.yml");
    for (name, (_, body)) in &rules {
        for field in ["severity:", "summary:", "description:", "runbook: |"] {
            assert!(body.contains(field), "alert {name}: no {field}");
        }
        let fires = tests.split("alertname: ").skip(1).any(|t| t.starts_with(name.as_str()) && t.split("alertname: ").next().unwrap().contains("exp_labels"));
        assert!(fires, "alert {name}: prometheus/alerts_test.yml has no test in which it fires");
    }
}

/// `key → values` of a unit file (a key may repeat).
fn unit(rel: &str) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for l in read(rel).lines() {
        let l = l.trim();
        if l.starts_with('#') || l.starts_with('[') || l.is_empty() {
            continue;
        }
        let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("{rel}: not key=value: {l}"));
        m.entry(k.trim().to_owned()).or_default().push(v.trim().to_owned());
    }
    m
}

fn seconds(v: &str) -> Duration {
    humantime::parse_duration(v).unwrap_or_else(|e| panic!("{v:?}: {e}"))
}

/// A systemd size (`MemoryMax=`): bytes, or with a base-1024 suffix K, M, G, T.
fn memory_bytes(v: &str) -> u64 {
    let (digits, shift) = match v.chars().last() {
        Some('K') => (&v[..v.len() - 1], 10),
        Some('M') => (&v[..v.len() - 1], 20),
        Some('G') => (&v[..v.len() - 1], 30),
        Some('T') => (&v[..v.len() - 1], 40),
        _ => (v, 0),
    };
    digits.parse::<u64>().unwrap_or_else(|e| panic!("MemoryMax={v}: {e}")) << shift
}

#[test]
fn systemd_units_match_the_daemon_contract() {
    let drain = seconds(&RawConfig::default().shutdown.drain_timeout);
    for rel in ["systemd/prefix-batcher.service", "systemd/prefix-batcher@.service"] {
        let u = unit(rel);
        let one = |k: &str| -> &str {
            let v = u.get(k).unwrap_or_else(|| panic!("{rel}: {k}= missing"));
            v.last().unwrap()
        };
        assert_eq!(one("Type"), "notify", "{rel}");
        assert_eq!(one("NotifyAccess"), "main", "{rel}");
        assert_eq!(one("Restart"), "on-failure", "{rel}");
        assert_eq!(one("RestartPreventExitStatus"), prefix_batcher::exit::EX_CONFIG.to_string(), "{rel}: a bad config must not restart-loop");
        let watchdog = seconds(one("WatchdogSec"));
        assert!(watchdog >= Duration::from_secs(2), "{rel}: the main loop reports every 1 s, so WatchdogSec must be at least 2 s");
        assert!(seconds(one("TimeoutStopSec")) > drain, "{rel}: TimeoutStopSec must exceed shutdown.drain_timeout ({drain:?})");
        assert!(one("ExecStart").ends_with(" run"), "{rel}");
        assert!(u.contains_key("EnvironmentFile"), "{rel}: no EnvironmentFile for secrets");
        assert!(one("DynamicUser") == "yes" || u.contains_key("User"), "{rel}: needs a dedicated or dynamic user");
        for (k, v) in [
            ("NoNewPrivileges", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("PrivateTmp", "yes"),
            ("PrivateDevices", "yes"),
            ("CapabilityBoundingSet", ""),
            ("MemoryDenyWriteExecute", "yes"),
            ("LockPersonality", "yes"),
            ("RestrictNamespaces", "yes"),
        ] {
            assert_eq!(one(k), v, "{rel}: {k}");
        }
        assert_eq!(u["SystemCallFilter"][0], "@system-service", "{rel}");
        let memory_max = memory_bytes(one("MemoryMax"));
        let budget = RawConfig::default().batching.max_buffered_bytes as u64;
        assert!(memory_max >= budget + (64 << 20), "{rel}: MemoryMax= must hold batching.max_buffered_bytes ({budget}) plus the baseline");
        let families = one("RestrictAddressFamilies");
        for f in ["AF_INET", "AF_INET6", "AF_UNIX"] {
            assert!(families.split_whitespace().any(|x| x == f), "{rel}: {f} is needed (AF_UNIX for the notify socket)");
        }
    }
    let t = unit("systemd/prefix-batcher@.service");
    assert!(t["Environment"].iter().any(|e| e == "INSTANCE=%i"), "the template passes %i as INSTANCE (instance name)");
    assert!(t["Environment"].iter().any(|e| e.starts_with("PREFIX_BATCHER__HTTP__LISTEN=") && e.contains("%i")), "each instance needs its own metrics port");
}

#[test]
fn grafana_provisioning_points_at_the_dashboard() {
    let ds = read("grafana/provisioning/datasources/prometheus.yml");
    assert!(ds.contains("type: prometheus") && ds.contains("isDefault: true"), "{ds}");
    let dash = read("grafana/provisioning/dashboards/prefix-batcher.yml");
    assert!(dash.contains("type: file") && dash.contains("path: /var/lib/grafana/dashboards/prefix-batcher"), "{dash}");
    assert!(read("docs/operations.md").contains("/var/lib/grafana/dashboards/prefix-batcher"), "docs/operations.md must say where the dashboard goes");
}
