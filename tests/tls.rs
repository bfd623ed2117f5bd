//! The daemon over TLS on all three links — `amqps://` to a private RabbitMQ node with a TLS
//! listener, `rediss://` to a private redis-server with `tls-auth-clients yes` (mutual TLS), and
//! an `https://` fake LLM — with a throwaway CA generated for the test ([`common::tls`]); and a
//! wrong CA on each link, which fails with an error naming the link while the daemon keeps
//! retrying with backoff.

mod common;

use std::path::Path;
use std::time::Duration;

use common::tls::{TlsBroker, TlsFiles, TlsRedis};
use common::*;
use llm_fakes::fake::{FakeLlm, FakeLlmHandle};
use prefix_batcher::config::RawConfig;
use tokio::time::Instant;

fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The HTTPS fake LLM with the test CA's `localhost` server certificate; it requires a client
/// certificate signed by the test CA (mutual TLS).
async fn https_fake(files: &TlsFiles) -> FakeLlmHandle {
    let (cert, key) = (std::fs::read(&files.server_cert).unwrap(), std::fs::read(&files.server_key).unwrap());
    let ca = std::fs::read(&files.ca_cert).unwrap();
    FakeLlm::new().start_tls(&cert, &key, Some(&ca)).await.expect("start the HTTPS fake LLM")
}

/// A fresh throwaway CA with its certificates, and the three TLS servers: a private RabbitMQ
/// node, a redis-server requiring client certificates, the HTTPS fake LLM.
async fn servers() -> (TlsFiles, TlsBroker, TlsRedis, FakeLlmHandle) {
    let files = TlsFiles::generate();
    let broker = TlsBroker::start(&files).await;
    let redis = TlsRedis::start(&files, true).await;
    let fake = https_fake(&files).await;
    (files, broker, redis, fake)
}

/// The test configuration with every link over TLS, each with the client certificate (mutual
/// TLS): the broker's amqps port, the TLS Redis, the HTTPS fake; each link trusts `ca` (the test
/// CA or another one).
fn tls_config(env: &TestEnv, files: &TlsFiles, broker: &TlsBroker, redis: &TlsRedis, fake: &FakeLlmHandle, ca: [&Path; 3]) -> RawConfig {
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.url = broker.amqps_url();
    raw.amqp.tls_ca_file = path(ca[0]);
    // The broker verifies a client certificate when one is presented (`verify_peer`).
    (raw.amqp.tls_cert_file, raw.amqp.tls_key_file) = (path(&files.client_cert), path(&files.client_key));
    raw.redis.url = redis.url();
    raw.redis.tls_ca_file = path(ca[1]);
    (raw.redis.tls_cert_file, raw.redis.tls_key_file) = (path(&files.client_cert), path(&files.client_key));
    raw.llm.tls_ca_file = path(ca[2]);
    (raw.llm.tls_cert_file, raw.llm.tls_key_file) = (path(&files.client_cert), path(&files.client_key));
    raw
}

/// 40 requests over amqps + rediss (mutual TLS) + https (mutual TLS): every one answered `ok`, by
/// the HTTPS fake; the daemon stops cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_main_job_runs_over_amqps_rediss_and_https() {
    let (files, broker, redis, fake) = servers().await;
    let env = TestEnv::new("tls");
    let ca = files.ca_cert.as_path();
    let daemon = start_daemon(&tls_config(&env, &files, &broker, &redis, &fake, [ca, ca, ca]));
    let amqp = Amqp::connect_to(&broker.amqp_url()).await;
    let results = amqp.run_main_job(&env, "tls", 40, 4).await;
    assert!(fake.call_count() > 0, "the HTTPS fake was not called");
    eprintln!("tls: 40 requests answered over amqps + rediss + https, mutual TLS on all three, in {} calls", fake.call_count());
    // `status` shows in the instance's health line that its client certificates (7 days) expire
    // within 14 days.
    let settings = prefix_batcher::config::Settings::from_raw(&tls_config(&env, &files, &broker, &redis, &fake, [ca, ca, ca])).unwrap();
    let status = prefix_batcher::client::status(&settings).await.expect("status over TLS");
    let health = status.members.iter().find_map(|m| m.health.clone()).expect("the instance publishes its health");
    for link in ["amqp", "redis", "llm"] {
        let note = format!("{link} client certificate expires in ");
        assert!(health.contains(&format!("{note}6 days")) || health.contains(&format!("{note}7 days")), "no {note:?} in the health line {health:?}");
    }
    assert!(health.starts_with("ready; "), "{health}");
    // The client certificate's expiry, as openssl reads it, is exported for each link.
    let not_after = openssl_not_after(&files.client_cert);
    let exported = prefix_batcher::metrics::render();
    for link in ["amqp", "redis", "llm"] {
        let line = format!("prefix_batcher_tls_client_certificate_expiry_timestamp_seconds{{link=\"{link}\"}} {not_after}");
        assert!(exported.lines().any(|l| l == line), "no line {line:?} in:\n{}", exported.lines().filter(|l| l.contains("tls_client")).collect::<Vec<_>>().join("\n"));
    }
    daemon.stop().await.expect("the daemon stops cleanly");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// The `notAfter` of the certificate at `cert`, in Unix seconds, as the openssl command line and
/// `date` read it (independently of the daemon's X.509 parser).
fn openssl_not_after(cert: &Path) -> i64 {
    let out = std::process::Command::new("openssl").args(["x509", "-noout", "-enddate", "-in"]).arg(cert).output().expect("run openssl");
    let text = String::from_utf8(out.stdout).unwrap();
    let date = text.trim().strip_prefix("notAfter=").unwrap_or_else(|| panic!("openssl printed {text:?}"));
    let out = std::process::Command::new("date").args(["-u", "+%s", "-d", date]).output().expect("run date");
    String::from_utf8(out.stdout).unwrap().trim().parse().unwrap_or_else(|e| panic!("date -d {date:?}: {e}"))
}

/// `check-config` shows each client certificate's subject and expiry and each CA bundle's first
/// expiry, as RFC 3339 times, with the time left.
#[tokio::test]
async fn check_config_shows_the_certificates_validity() {
    let files = TlsFiles::generate();
    let env = TestEnv::new("tlscheck");
    let mut raw = env.raw_config("https://localhost:1/");
    raw.redis.url = "rediss://localhost:1/".into();
    raw.redis.tls_ca_file = path(&files.ca_cert);
    (raw.redis.tls_cert_file, raw.redis.tls_key_file) = (path(&files.client_cert), path(&files.client_key));
    let cfg = write_config(&env, "check", &raw);
    let out = bin_command().arg("check-config").arg(&cfg).output().expect("run check-config");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let rfc3339 = |at: i64| prefix_batcher::tls::rfc3339(at);
    // 7 days from when the certificates were made: "in 7 days" within the second they were made,
    // "in 6 days" (whole days, rounded down) after it.
    let client = format!("# redis.tls_cert_file: CN=pbt-client, valid until {} (in ", rfc3339(openssl_not_after(&files.client_cert)));
    let ca = format!("# redis.tls_ca_file: 1 certificate; the first to expire: CN=pbt-test-ca, valid until {} (in ", rfc3339(openssl_not_after(&files.ca_cert)));
    for want in [client, ca] {
        let found = stdout.lines().any(|l| l.strip_prefix(want.as_str()).is_some_and(|rest| rest == "6 days)" || rest == "7 days)"));
        assert!(found, "no line {want:?}6 or 7 days) in:\n{stdout}");
    }
    assert!(!stdout.contains("amqp.tls_") && !stdout.contains("llm.tls_cert_file:"), "links without TLS files are not listed:\n{stdout}");
    env.cleanup().await;
}

/// Certificate login (SASL EXTERNAL, RabbitMQ's `rabbitmq_auth_mechanism_ssl`), with
/// `auth_mechanism=external` in `amqp.url` and no user or password in it: while no RabbitMQ user
/// has the certificate's CN, startup stops with exit 78 and a message that says the certificate
/// is the login; once the user exists, the main job runs over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_login_names_the_certificate_when_refused_and_then_runs() {
    let files = TlsFiles::generate();
    let broker = TlsBroker::start_with_certificate_login(&files).await;
    let fake = FakeLlm::new().start().await.expect("start the fake LLM");
    let env = TestEnv::new("tlsext");
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.url = format!("amqps://localhost:{}/%2f?auth_mechanism=external", broker.amqps_port);
    raw.amqp.tls_ca_file = path(&files.ca_cert);
    (raw.amqp.tls_cert_file, raw.amqp.tls_key_file) = (path(&files.client_cert), path(&files.client_key));

    let mut p = DaemonProcess::run(&env, "no-such-user", &raw);
    let status = p.wait_exit(DEADLINE).await;
    let log = p.log();
    assert_eq!(status.code(), Some(78), "want exit 78 while no user is named by the certificate; log:\n{log}");
    assert!(
        log.contains("403 ACCESS_REFUSED") && log.contains("with auth_mechanism=external the client certificate (amqp.tls_cert_file) is the login"),
        "the refusal must point at the certificate; log:\n{log}"
    );

    // The user named by the certificate's CN; its password is never used by EXTERNAL.
    broker.ctl(&["add_user", "pbt-client", &uuid::Uuid::new_v4().to_string()]);
    broker.ctl(&["set_permissions", "-p", "/", "pbt-client", ".*", ".*", ".*"]);
    let daemon = start_daemon(&raw);
    let amqp = Amqp::connect_to(&broker.amqp_url()).await;
    let results = amqp.run_main_job(&env, "tlsext", 20, 4).await;
    let users = std::process::Command::new("rabbitmqctl").args(["-q", "-n", &broker.node, "list_connections", "user", "auth_mechanism"]).output().expect("rabbitmqctl");
    let users = String::from_utf8_lossy(&users.stdout).into_owned();
    assert!(users.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["pbt-client", "EXTERNAL"]), "the daemon's connections log in as pbt-client by EXTERNAL:\n{users}");
    daemon.stop().await.expect("the daemon stops cleanly");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// Waits until the log of `d` contains every one of `needles` (case-insensitive); panics with the
/// log's end after the deadline. The daemon must still be running (it retries, it does not exit).
async fn wait_log(d: &mut DaemonProcess, needles: &[&str], within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let log = d.log();
        let lower = log.to_lowercase();
        if needles.iter().all(|n| lower.contains(&n.to_lowercase())) {
            assert!(d.is_running(), "the daemon exited:\n{log}");
            return log;
        }
        assert!(Instant::now() < deadline, "log never showed {needles:?}:\n{}", &log[log.len().saturating_sub(3000)..]);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A CA that did not sign the server's certificate, on each link in turn: the error names the
/// link and the certificate problem, and the daemon keeps retrying (a CA can be fixed without a
/// restart of the servers); nothing is answered meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_fails_with_an_error_naming_the_link() {
    let (files, broker, redis, fake) = servers().await;
    let env = TestEnv::new("tlsca");
    let (good, bad) = (files.ca_cert.as_path(), files.other_ca_cert.as_path());
    let cases: [(&str, [&Path; 3], &[&str]); 3] = [
        ("amqp", [bad, good, good], &["amqp connect", "certificate"]),
        ("redis", [good, bad, good], &["redis", "certificate"]),
        ("llm", [good, good, bad], &["LLM endpoint", "certificate"]),
    ];
    for (link, ca, needles) in cases {
        let mut raw = tls_config(&env, &files, &broker, &redis, &fake, ca);
        raw.instance.name = env.instance(link);
        let mut d = DaemonProcess::run(&env, &format!("wrong-ca-{link}"), &raw);
        if link == "llm" {
            // The LLM link is first used by a request.
            let amqp = Amqp::connect_to(&broker.amqp_url()).await;
            amqp.wait_consumed(&env.partition_queue(0)).await;
            amqp.publish_requests(&env.input_queue(), &completions_workload("tlsca", 4, 1), &format!("{}.reply", env.name)).await;
            amqp.close().await;
        }
        // Each link's 7-day client certificate is within the 14 days that startup warns of.
        let expiring = format!("client certificate ({link}.tls_cert_file) expires in ");
        let log = wait_log(&mut d, &[needles, &[expiring.as_str()]].concat(), DEADLINE).await;
        let warning = log.lines().find(|l| l.contains(&expiring)).unwrap();
        assert!(warning.contains("expires in 6 days") || warning.contains("expires in 7 days"), "{warning}");
        let line = log.lines().find(|l| l.to_lowercase().contains("certificate")).unwrap_or_default();
        eprintln!("wrong CA on {link}: {line}");
        d.kill9();
    }
    assert_eq!(fake.calls().iter().filter(|c| c.status == 200 && !c.prompts.iter().any(|p| p == "ping")).count(), 0, "a request was answered through a wrong CA");
    env.cleanup().await;
}
