//! Logs and secrets, with the real binary:
//!
//! - `--log-format json` writes one JSON object per line, and lines logged inside a batch carry the
//!   batch span (`partition`, `batch_id`, `key`);
//! - real credentials — a RabbitMQ user and a Redis ACL user created for the test, each with its
//!   own password, and an LLM bearer token — never appear in the logs (at `trace` for every crate),
//!   in error messages (wrong passwords, a malformed configuration), in `check-config` output, or
//!   in the `submit` and `status` commands' errors. The credentials come from the environment, as
//!   under systemd (`EnvironmentFile=`), and the file holds unusable ones, so the daemon can only
//!   work if the environment wins.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use llm_fakes::fake::FakeLlm;
use tokio::time::Instant;

fn rabbitmqctl(args: &[&str]) -> std::process::Output {
    let run = |bin: &str| Command::new(bin).args(args).output();
    run("rabbitmqctl").or_else(|_| run("/usr/sbin/rabbitmqctl")).expect("rabbitmqctl (scripts/services installs RabbitMQ)")
}

/// Credentials created for one test, deleted on drop.
struct Credentials {
    amqp_user: String,
    amqp_password: String,
    redis_user: String,
    redis_password: String,
    token: String,
}

impl Credentials {
    async fn create(env: &TestEnv) -> Credentials {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let c = Credentials {
            amqp_user: format!("{}-user", env.name),
            amqp_password: format!("amqp-pw-{}", &id[..12]),
            redis_user: format!("{}-user", env.name),
            redis_password: format!("redis-pw-{}", &id[12..24]),
            token: format!("sk-token-{}", &id[20..]),
        };
        let out = rabbitmqctl(&["add_user", &c.amqp_user, &c.amqp_password]);
        assert!(out.status.success(), "rabbitmqctl add_user: {}", String::from_utf8_lossy(&out.stderr));
        let out = rabbitmqctl(&["set_permissions", "-p", "/", &c.amqp_user, ".*", ".*", ".*"]);
        assert!(out.status.success(), "rabbitmqctl set_permissions: {}", String::from_utf8_lossy(&out.stderr));
        let mut r = RedisProbe::connect().await.unwrap();
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(&c.redis_user)
            .arg("reset")
            .arg("on")
            .arg(format!(">{}", c.redis_password))
            .arg("~*")
            .arg("&*")
            .arg("+@all")
            .query_async(&mut r.conn)
            .await
            .expect("redis ACL SETUSER");
        c
    }

    fn amqp_url(&self, password: &str) -> String {
        format!("amqp://{}:{password}@127.0.0.1:5672/%2f", self.amqp_user)
    }

    fn redis_url(&self, password: &str) -> String {
        format!("redis://{}:{password}@127.0.0.1:6379/", self.redis_user)
    }

    fn secrets(&self) -> [&str; 3] {
        [&self.amqp_password, &self.redis_password, &self.token]
    }
}

impl Drop for Credentials {
    fn drop(&mut self) {
        let _ = rabbitmqctl(&["delete_user", &self.amqp_user]);
        if let Ok(client) = redis::Client::open(REDIS_URL) {
            if let Ok(mut c) = client.get_connection() {
                let _: Result<i64, _> = redis::cmd("ACL").arg("DELUSER").arg(&self.redis_user).query(&mut c);
            }
        }
    }
}

/// Fails when `text` holds one of `secrets` as text or as the list of its bytes in decimal (how
/// a `Debug` print of a byte buffer shows it: lapin's TRACE frames printed the SASL response of
/// `connection.start-ok`, user and password, that way).
fn assert_no_secret(what: &str, text: &str, secrets: &[&str]) {
    for s in secrets {
        assert!(!text.contains(s), "{what} contains the secret {s:?}:\n{text}");
        let bytes = s.bytes().map(|b| b.to_string()).collect::<Vec<_>>().join(", ");
        assert!(!text.contains(&bytes), "{what} contains the secret {s:?} as bytes ({bytes})");
    }
}

/// Runs the binary to completion with `args` and `env`; returns (exit code, stdout + stderr).
fn run_bin(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = bin_command();
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run prefix-batcher");
    (out.status.code(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Longer than 80 lines on purpose: one scenario read top to bottom (setup, load, the event,
/// the assertions in the order they happen); split into helpers it would hide its timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_batch_spans_and_no_secret_appears_anywhere() {
    let env = TestEnv::new("secrets");
    let creds = Credentials::create(&env).await;
    let secrets = creds.secrets();
    let fake = FakeLlm::new().latency(Duration::from_millis(20)).start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    // The file holds unusable credentials: only the environment's work.
    raw.amqp.url = "amqp://nobody:not-the-password@127.0.0.1:5672/%2f".into();
    raw.redis.url = "redis://nobody:not-the-password@127.0.0.1:6379/".into();
    raw.log.format = "pretty".into(); // --log-format json overrides it
    raw.log.level = "debug".into(); // check-config's output; the daemon logs at RUST_LOG's trace
    let cfg = write_config(&env, "daemon", &raw);
    let amqp_url = creds.amqp_url(&creds.amqp_password);
    let redis_url = creds.redis_url(&creds.redis_password);
    let secret_env = [
        ("PREFIX_BATCHER__AMQP__URL", amqp_url.as_str()),
        ("PREFIX_BATCHER__REDIS__URL", redis_url.as_str()),
        ("PREFIX_BATCHER__LLM__API_KEY", creds.token.as_str()),
    ];

    // check-config: the effective configuration, secrets as ***.
    let (code, out) = run_bin(&["--config", cfg.to_str().unwrap(), "check-config"], &secret_env);
    assert_eq!(code, Some(0), "{out}");
    assert_no_secret("check-config output", &out, &secrets);
    assert!(out.contains(&format!("url = \"amqp://{}:***@127.0.0.1:5672/%2f\"", creds.amqp_user)), "{out}");
    assert!(out.contains(&format!("url = \"redis://{}:***@127.0.0.1:6379/\"", creds.redis_user)), "{out}");
    assert!(out.contains("api_key = \"***\""), "{out}");

    // The daemon, with the secrets in its environment and a full log in JSON: every crate at
    // TRACE (`RUST_LOG` replaces `log.level`), as an operator chasing a connection problem sets it.
    let mut cmd = bin_command();
    cmd.arg("--config").arg(&cfg).arg("--log-format").arg("json").arg("run");
    for (k, v) in secret_env {
        cmd.env(k, v);
    }
    cmd.env("RUST_LOG", "trace");
    let mut daemon = DaemonProcess::spawn(&env, "daemon", cmd);
    let mut redis = RedisProbe::connect().await.unwrap();
    let deadline = Instant::now() + DEADLINE;
    while !redis.leases(env.key_prefix(), PARTITIONS).await.iter().all(|l| l.is_some()) {
        assert!(daemon.is_running() && Instant::now() < deadline, "the daemon did not take its leases; log:\n{}", daemon.log_tail(30));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let amqp = Amqp::connect().await;
    let reply = format!("{}.reply", env.name);
    let mut results = amqp.reply_queue(&reply).await;
    let reqs = completions_workload("secret", 60, 3);
    amqp.publish_requests(&env.input_queue(), &reqs, &reply).await;
    amqp.publish(&env.input_queue(), b"{not json", request_props("bad-1", &reply)).await; // a dead letter (warning)
    // A result the broker returns (its reply queue does not exist): it goes to the results queue.
    let gone = format!("{}.no-such-reply", env.name);
    amqp.publish(&env.input_queue(), br#"{"id":"returned-1","prompt":"returned"}"#, request_props("returned-1", &gone)).await;
    results.until_all(&ids(&reqs), DEADLINE).await;
    while amqp.queue_depth(&env.results_queue()).await.0 < 1 {
        assert!(Instant::now() < deadline + DEADLINE, "the returned result did not reach the results queue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let calls = fake.calls();
    assert!(!calls.is_empty() && calls.iter().all(|c| c.authorization.as_deref() == Some(&format!("Bearer {}", creds.token))), "the token must be sent");
    daemon.sigterm();
    let status = daemon.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(0), "log:\n{}", daemon.log_tail(30));

    let log = daemon.log();
    assert_no_secret("the daemon's log", &log, &secrets);
    assert_no_secret("the daemon's stdout", &daemon.out(), &secrets);
    assert!(log.lines().count() > 50, "a debug log has many lines:\n{log}");
    // lapin logs each returned message whole (the result's body, the LLM's output) at WARN,
    // unbounded; the daemon logs returns itself.
    assert!(!log.contains("lapin::returned_messages"), "the AMQP client logged a returned message whole");

    // JSON: every line an object with the standard fields.
    let mut batch_lines = 0;
    let mut warnings_with_request_id = 0;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        for field in ["timestamp", "level", "target", "fields"] {
            assert!(v.get(field).is_some(), "no {field} in {line}");
        }
        let in_batch = v["spans"].as_array().into_iter().flatten().find(|s| s["name"] == "batch");
        if let Some(span) = in_batch {
            let partition = span["partition"].as_u64().unwrap_or_else(|| panic!("batch span without partition: {line}"));
            let batch_id = span["batch_id"].as_str().unwrap_or_else(|| panic!("batch span without batch_id: {line}"));
            let key = span["key"].as_str().unwrap_or_else(|| panic!("batch span without key: {line}"));
            assert!(batch_id.starts_with(&format!("{partition}-")), "batch id {batch_id} of partition {partition}");
            assert!(key.len() == 16 && key.chars().all(|c| c.is_ascii_hexdigit()), "key hex: {key}");
            batch_lines += 1;
        }
        if v["level"] == "WARN" && v["fields"].get("request_id").is_some() {
            warnings_with_request_id += 1;
        }
    }
    assert!(batch_lines > 0, "no log line carries the batch span (partition, batch_id, key)");
    println!("json log: {} lines, {batch_lines} inside a batch span, {warnings_with_request_id} warnings with a request id", log.lines().count());

    results.close().await;
    amqp.close().await;
    drop(creds);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_problem_but_never_a_secret() {
    let env = TestEnv::new("secreterr");
    let creds = Credentials::create(&env).await;
    let wrong_amqp = format!("wrong-amqp-{}", &env.name[env.name.len() - 8..]);
    let wrong_redis = format!("wrong-redis-{}", &env.name[env.name.len() - 8..]);
    let mut secrets: Vec<&str> = creds.secrets().to_vec();
    secrets.extend([wrong_amqp.as_str(), wrong_redis.as_str()]);
    let fake = FakeLlm::new().start().await.unwrap();
    let raw = env.raw_config(fake.url.as_str());
    let cfg = write_config(&env, "base", &raw);
    let cfg = cfg.to_str().unwrap();
    let good_amqp = creds.amqp_url(&creds.amqp_password);
    let good_redis = creds.redis_url(&creds.redis_password);
    let bad_amqp = creds.amqp_url(&wrong_amqp);
    let bad_redis = creds.redis_url(&wrong_redis);

    // A daemon whose broker password is wrong, then one whose Redis password is wrong: both stop
    // the startup with exit 78 and say which credentials were refused.
    for (label, amqp, redis, expect) in [("wrong-amqp", &bad_amqp, &good_redis, "amqp.url"), ("wrong-redis", &good_amqp, &bad_redis, "redis.url")] {
        let mut cmd = bin_command();
        cmd.arg("--config").arg(cfg).arg("--log-format").arg("json").arg("run");
        cmd.env("PREFIX_BATCHER__AMQP__URL", amqp).env("PREFIX_BATCHER__REDIS__URL", redis).env("PREFIX_BATCHER__LLM__API_KEY", &creds.token);
        cmd.env("PREFIX_BATCHER__LOG__LEVEL", "debug");
        let mut daemon = DaemonProcess::spawn(&env, label, cmd);
        let status = daemon.wait_exit(DEADLINE).await;
        let log = daemon.log();
        assert_eq!(status.code(), Some(78), "{label}: refused credentials stop the startup; log:\n{}", daemon.log_tail(30));
        assert_no_secret(&format!("{label}: the log"), &log, &secrets);
        let error = log.lines().find(|l| l.contains("refused")).unwrap_or_else(|| panic!("{label}: no refusal in the log:\n{log}"));
        assert!(error.contains(expect), "{label}: the error names the refused credentials' key: {error}");
    }

    // Configuration errors quote the offending value without its password.
    let bad_file = env.dir.join("bad.toml");
    std::fs::write(
        &bad_file,
        format!("[amqp]\nurl = \"{good_amqp}\"\npartitions = 0\n[redis]\nurl = \"{good_redis}\"\n[llm]\napi_key = \"{}\"\n", creds.token),
    )
    .unwrap();
    for args in [vec!["check-config", bad_file.to_str().unwrap()], vec!["--config", bad_file.to_str().unwrap(), "run"]] {
        let (code, out) = run_bin(&args, &[]);
        assert_eq!(code, Some(78), "{args:?}: {out}");
        assert!(out.contains("amqp.partitions"), "{args:?}: {out}");
        assert_no_secret(&format!("{args:?}"), &out, &secrets);
    }
    let unparsable = format!("amqp://{}:{}@bad host/", creds.amqp_user, creds.amqp_password);
    let with_creds = format!("http://user:{}@127.0.0.1:8000", creds.token);
    for (key, value) in [("PREFIX_BATCHER__AMQP__URL", unparsable.as_str()), ("PREFIX_BATCHER__LLM__ENDPOINTS", with_creds.as_str())] {
        let (code, out) = run_bin(&["--config", cfg, "check-config"], &[(key, value)]);
        assert_eq!(code, Some(78), "{key}: {out}");
        assert_no_secret(key, &out, &secrets);
    }

    // The client commands' connection errors.
    // `submit` exits as `status` does for RabbitMQ: 77 for a refused login, 69 for no node.
    let (code, out) = run_bin(&["--config", cfg, "submit", "--file", "/dev/null"], &[("PREFIX_BATCHER__AMQP__URL", &bad_amqp)]);
    assert_eq!(code, Some(i32::from(prefix_batcher::exit::EX_NOPERM)), "submit with a wrong password: {out}");
    assert!(out.contains("ACCESS_REFUSED"), "{out}");
    assert_no_secret("submit's error", &out, &secrets);
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let unreachable = format!("amqp://{}:{}@127.0.0.1:{closed_port}/%2f", creds.amqp_user, creds.amqp_password);
    let (code, out) = run_bin(&["--config", cfg, "submit", "--file", "/dev/null"], &[("PREFIX_BATCHER__AMQP__URL", &unreachable)]);
    assert_eq!(code, Some(i32::from(prefix_batcher::exit::EX_UNAVAILABLE)), "submit without a broker: {out}");
    assert_no_secret("submit's error without a broker", &out, &secrets);
    // An input file that cannot be read: 66, naming the file.
    let missing = env.dir.join("no-such-input.jsonl");
    let (code, out) = run_bin(&["--config", cfg, "submit", "--file", missing.to_str().unwrap()], &[("PREFIX_BATCHER__AMQP__URL", &good_amqp)]);
    assert_eq!(code, Some(i32::from(prefix_batcher::exit::EX_NOINPUT)), "submit of a missing file: {out}");
    assert!(out.contains("no-such-input.jsonl"), "{out}");
    let (code, out) = run_bin(&["--config", cfg, "status"], &[("PREFIX_BATCHER__REDIS__URL", &bad_redis)]);
    assert_ne!(code, Some(0), "status with a wrong password must fail: {out}");
    assert_no_secret("status's error", &out, &secrets);
    // RabbitMQ refusing the login: the table from Redis is printed, and the exit code says the
    // login was refused (not that no node answered).
    let (code, out) = run_bin(&["--config", cfg, "status"], &[("PREFIX_BATCHER__AMQP__URL", &bad_amqp)]);
    assert_eq!(code, Some(i32::from(prefix_batcher::exit::EX_NOPERM)), "status without RabbitMQ: {out}");
    assert!(out.contains("RabbitMQ refused the login, backlog unknown") && out.contains("LOGIN REFUSED"), "{out}");
    assert_no_secret("status's RabbitMQ error", &out, &secrets);
    // Reported: with a second node that is down, the connection's error was that node's, and
    // `status` said "unreachable" with exit 69 although the first node refused the login.
    let down = format!("{bad_amqp},amqp://127.0.0.1:1/%2f");
    let (code, out) = run_bin(&["--config", cfg, "status"], &[("PREFIX_BATCHER__AMQP__URLS", &down)]);
    assert_eq!(code, Some(i32::from(prefix_batcher::exit::EX_NOPERM)), "status, one node refusing the login and one down: {out}");
    assert!(out.contains("RabbitMQ refused the login, backlog unknown") && out.contains("LOGIN REFUSED") && out.contains("UNREACHABLE"), "{out}");
    assert_no_secret("status's RabbitMQ errors", &out, &secrets);
    // A mistyped key prefix finds no deployment, and says so.
    let typo = format!("{}-typo", env.key_prefix());
    let (code, out) = run_bin(&["--config", cfg, "status"], &[("PREFIX_BATCHER__REDIS__KEY_PREFIX", &typo)]);
    assert_eq!(code, Some(i32::from(prefix_batcher::exit::EX_NO_DEPLOYMENT)), "{out}");
    assert!(out.contains("NO DEPLOYMENT FOUND"), "{out}");
    // The broker holds the configuration's queues (as after a Redis data loss with no instance
    // running): status says so, with what they hold.
    let amqp = Amqp::connect().await;
    amqp.ch.queue_declare(env.input_queue().as_str().into(), lapin::options::QueueDeclareOptions { durable: true, ..Default::default() }, lapin::types::FieldTable::default()).await.expect("declare the input queue");
    amqp.publish(&env.input_queue(), b"{\"prompt\": \"waiting\"}", request_props("waiting-1", "amq.gen-x")).await;
    let deadline = Instant::now() + DEADLINE;
    let out = loop {
        let (code, out) = run_bin(&["--config", cfg, "status"], &[("PREFIX_BATCHER__REDIS__KEY_PREFIX", &typo)]);
        assert_eq!(code, Some(i32::from(prefix_batcher::exit::EX_NO_DEPLOYMENT)), "{out}");
        if out.contains("RabbitMQ holds this configuration's queues (ready: input 1,") {
            break out;
        }
        assert!(Instant::now() < deadline, "status never named the queued request: {out}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(out.contains("Redis lost its data"), "{out}");
    amqp.close().await;

    drop(creds);
    env.cleanup().await;
}

/// A redis-server (`--sentinel` when `sentinel_of` names a primary port) of this test only, on a
/// port the OS picked, with password `password`; killed on drop.
struct PrivateRedis {
    child: std::process::Child,
    port: u16,
}

impl PrivateRedis {
    async fn start(env: &TestEnv, label: &str, password: &str, sentinel_of: Option<u16>) -> PrivateRedis {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let conf = env.dir.join(format!("{label}.conf"));
        let mut text = format!("port {port}\nbind 127.0.0.1\nrequirepass {password}\nsave \"\"\nappendonly no\ndir {}\n", env.dir.display());
        if let Some(primary) = sentinel_of {
            text.push_str(&format!("sentinel monitor m 127.0.0.1 {primary} 1\nsentinel auth-pass m primary-pw\n"));
        }
        std::fs::write(&conf, text).unwrap();
        let mut cmd = Command::new("redis-server");
        cmd.arg(&conf);
        if sentinel_of.is_some() {
            cmd.arg("--sentinel");
        }
        // Owned at once, so that a failed start below kills it (on drop).
        let server = PrivateRedis { child: cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().expect("redis-server is installed"), port };
        let url = format!("redis://:{password}@127.0.0.1:{port}/");
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Ok(mut c) = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await {
                if redis::cmd("PING").query_async::<String>(&mut c).await.is_ok() {
                    return server;
                }
            }
            assert!(Instant::now() < deadline, "private {label} did not answer on port {port}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for `d` to stop the startup with exit 78 and returns its log line saying what was
/// refused; fails when the log holds one of `secrets`.
async fn refusal(mut d: DaemonProcess, secrets: &[&str]) -> String {
    assert_eq!(d.wait_exit(DEADLINE).await.code(), Some(78), "log:\n{}", d.log_tail(20));
    assert_no_secret("the log", &d.log(), secrets);
    let line = d.log().lines().find(|l| l.contains("refused")).map(str::to_owned).unwrap_or_else(|| panic!("no refusal:\n{}", d.log()));
    println!("{line}");
    line
}

/// With `redis.sentinels`, a failure names where it happened. Observed before: a wrong sentinel
/// password, a missing one and an unreachable sentinel were all reported as failures of
/// `redis.url` at its placeholder address (`Redis (redis://:***@placeholder:6379/0) refused the
/// daemon's credentials … check the user and password in redis.url`), sending the operator to
/// fix a correct setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failures_name_the_sentinels_or_the_primary() {
    let env = TestEnv::new("sentinelerr");
    let primary = PrivateRedis::start(&env, "primary", "primary-pw", None).await;
    let sentinel = PrivateRedis::start(&env, "sentinel", "sentinel-pw", Some(primary.port)).await;
    let fake = FakeLlm::new().start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.redis.sentinel_master = "m".into();
    let run = |raw: &prefix_batcher::config::RawConfig, label: &str| {
        let cfg = write_config(&env, label, raw);
        let mut cmd = bin_command();
        cmd.arg("--config").arg(cfg).arg("run");
        DaemonProcess::spawn(&env, label, cmd)
    };
    let secrets = ["primary-pw", "sentinel-pw", "wrong-pw"];

    // The sentinel refuses its password: exit 78, naming redis.sentinels, not redis.url.
    raw.redis.url = "redis://:primary-pw@placeholder:6379/0".into();
    raw.redis.sentinels = vec![format!("redis://:wrong-pw@127.0.0.1:{}", sentinel.port)];
    let line = refusal(run(&raw, "wrong-sentinel-pw"), &secrets).await;
    assert!(line.contains("redis.sentinels") && line.contains(&format!("127.0.0.1:{}", sentinel.port)) && !line.contains("placeholder"), "{line}");

    // The primary the sentinel names refuses redis.url's password: exit 78, naming the primary.
    raw.redis.url = "redis://:wrong-pw@placeholder:6379/0".into();
    raw.redis.sentinels = vec![format!("redis://:sentinel-pw@127.0.0.1:{}", sentinel.port)];
    let line = refusal(run(&raw, "wrong-primary-pw"), &secrets).await;
    assert!(line.contains(&format!("primary 127.0.0.1:{}", primary.port)) && line.contains("redis.url") && !line.contains("placeholder"), "{line}");

    // No sentinel listening: retried, with a warning that names the sentinels.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    raw.redis.url = "redis://:primary-pw@placeholder:6379/0".into();
    raw.redis.sentinels = vec![format!("redis://:sentinel-pw@127.0.0.1:{closed}")];
    let mut d = run(&raw, "no-sentinel");
    let line = d.wait_log_line("cannot learn the Redis primary from the sentinels", DEADLINE, "the unreachable sentinel").await;
    println!("{line}");
    assert!(line.contains(&format!("127.0.0.1:{closed}")) && !line.contains("placeholder"), "{line}");
    d.sigterm();
    assert_eq!(d.wait_exit(DEADLINE).await.code(), Some(0), "log:\n{}", d.log_tail(20));
    assert_no_secret("the log", &d.log(), &secrets);
    drop((sentinel, primary));
    env.cleanup().await;
}
