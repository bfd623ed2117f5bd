//! The daemon runs the main job with exactly the least-privilege users of `docs/operations.md`
//! ("Least privilege"): the test reads the `rabbitmqctl` and `ACL SETUSER` lines from that file,
//! puts its own prefix in place of `prefix-batcher` (queue, exchange, key and user names alike),
//! creates the users — a RabbitMQ user on the shared broker, a Redis ACL user on a private
//! redis-server — and runs 30 requests through a daemon that connects as them. Redis' `ACL LOG`
//! must stay empty (no command or key was denied).

mod common;

use common::broker::rabbitmqctl;
use common::*;

/// The lines of `docs/operations.md`'s least-privilege section that start with `prefix`, with the
/// documented names and password replaced.
fn documented(prefix: &str, name: &str, password: &str) -> Vec<String> {
    let doc = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md")).unwrap();
    let section = doc.split("\n### ").find(|s| s.starts_with("Least privilege")).expect("docs/operations.md has a \"Least privilege\" section");
    let lines: Vec<String> =
        section.lines().filter(|l| l.starts_with(prefix)).map(|l| l.replace("prefix-batcher", name).replace("CHANGE-ME", password)).collect();
    assert!(!lines.is_empty(), "docs/operations.md has no line starting with {prefix:?}");
    lines
}

/// The arguments of a documented shell line (single quotes only, as in the docs).
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut quoted = false;
    let mut word = String::new();
    for c in line.chars() {
        match c {
            '\'' => quoted = !quoted,
            ' ' if !quoted => words.extend((!word.is_empty()).then(|| std::mem::take(&mut word))),
            c => word.push(c),
        }
    }
    words.extend((!word.is_empty()).then_some(word));
    words
}

/// Deletes the test's RabbitMQ user on drop.
struct BrokerUserGuard(String);

impl Drop for BrokerUserGuard {
    fn drop(&mut self) {
        let _ = rabbitmqctl(&["delete_user", &self.0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_main_job_runs_with_the_documented_least_privilege_users() {
    let env = TestEnv::new("leastpriv");
    let password = uuid::Uuid::new_v4().simple().to_string();
    let user = env.name.clone();

    let _guard = BrokerUserGuard(user.clone());
    for line in documented("rabbitmqctl ", &env.name, &password) {
        let words = shell_words(&line);
        let args: Vec<&str> = words[1..].iter().map(String::as_str).collect();
        assert!(rabbitmqctl(&args).is_some(), "{line} failed");
    }

    let redis = RedisServer::start(&env, "redis").await;
    let mut admin = redis.connect().await.expect("connect to the private redis-server");
    for line in documented("ACL SETUSER ", &env.name, &password) {
        let mut cmd = redis::cmd("ACL");
        for w in line.split_whitespace().skip(1) {
            cmd.arg(w);
        }
        let _: () = cmd.query_async(&mut admin).await.unwrap_or_else(|e| panic!("{line}: {e}"));
    }

    let fake = llm_fakes::fake::FakeLlm::new().start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.amqp.url = format!("amqp://{user}:{password}@127.0.0.1:5672/%2f");
    raw.redis.url = format!("{}?user={user}&pass={password}", redis.url);
    let daemon = start_daemon(&raw);
    let amqp = Amqp::connect().await;
    let results = amqp.run_main_job(&env, "leastpriv", 30, 3).await;

    let denied: Vec<redis::Value> = redis::cmd("ACL").arg("LOG").query_async(&mut admin).await.unwrap();
    assert!(denied.is_empty(), "Redis denied the daemon something: {denied:?}");
    daemon.stop().await.expect("the daemon stops cleanly");
    let denied: Vec<redis::Value> = redis::cmd("ACL").arg("LOG").query_async(&mut admin).await.unwrap();
    assert!(denied.is_empty(), "Redis denied the daemon something while it stopped: {denied:?}");
    eprintln!("least privilege: 30 requests answered with the documented RabbitMQ and Redis users");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// Credentials refused by Redis under a running daemon (its ACL user's password changed and its
/// connections killed, as a rotation gone wrong does), then taken again: the daemon gets over it
/// without a restart. The redis crate's connection manager keeps a reconnect that failed on
/// credentials and never tries again, so the daemon opens a new connection itself, retried until
/// Redis takes the credentials; before, every instance stayed without its partitions for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_refused_by_redis_under_a_running_daemon_are_retried_until_taken() {
    let env = TestEnv::new("redisauth");
    let password = uuid::Uuid::new_v4().simple().to_string();
    let user = env.name.clone();
    let redis = RedisServer::start(&env, "redis").await;
    let mut admin = redis.connect().await.expect("connect to the private redis-server");
    let acl = |args: Vec<String>| {
        let mut cmd = redis::cmd("ACL");
        for a in args {
            cmd.arg(a);
        }
        cmd
    };
    for line in documented("ACL SETUSER ", &env.name, &password) {
        let _: () = acl(line.split_whitespace().skip(1).map(str::to_owned).collect()).query_async(&mut admin).await.unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    let fake = llm_fakes::fake::FakeLlm::new().start().await.unwrap();
    let mut raw = env.raw_config(fake.url.as_str());
    raw.redis.url = format!("{}?user={user}&pass={password}", redis.url);
    let daemon = start_daemon(&raw);
    let amqp = Amqp::connect().await;
    amqp.run_main_job(&env, "redisauth-before", 10, 2).await.close().await;

    // The password changes and the daemon's connections are killed: its reconnects are refused,
    // its leases cannot be renewed, and it stops consuming every partition.
    let _: () = acl(vec!["SETUSER".into(), user.clone(), "resetpass".into(), format!(">{password}-rotated")]).query_async(&mut admin).await.unwrap();
    let _: redis::Value = redis::cmd("CLIENT").arg("KILL").arg("USER").arg(&user).query_async(&mut admin).await.unwrap();
    for p in 0..PARTITIONS {
        amqp.wait_consumers(&env.partition_queue(p), 0, std::time::Duration::from_secs(30)).await;
    }
    // The password the daemon has is taken again: it must come back by itself.
    let _: () = acl(vec!["SETUSER".into(), user.clone(), "resetpass".into(), format!(">{password}")]).query_async(&mut admin).await.unwrap();
    let results = amqp.run_main_job(&env, "redisauth-after", 10, 2).await;
    eprintln!("Redis refused the daemon's credentials under load, then took them again: the daemon recovered without a restart");
    daemon.stop().await.expect("the daemon stops cleanly");
    results.close().await;
    amqp.close().await;
    env.cleanup().await;
}

/// `submit` as a broker user without write access to the default exchange names the broker's
/// refusal (403 `ACCESS_REFUSED` and the exchange), not only the closed channel it leaves behind
/// (`invalid channel state: Closed (basic.publish)`, which every later publish meets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_without_write_access_names_the_refusal() {
    let env = TestEnv::new("submitdenied");
    let password = uuid::Uuid::new_v4().simple().to_string();
    let user = env.name.clone();
    let _guard = BrokerUserGuard(user.clone());
    for args in [vec!["add_user", &user, &password], vec!["set_permissions", "-p", "/", &user, ".*", "^$", ".*"]] {
        assert!(rabbitmqctl(&args).is_some(), "rabbitmqctl {} failed", args[0]);
    }
    let mut raw = env.raw_config("http://127.0.0.1:9");
    raw.amqp.url = format!("amqp://{user}:{password}@127.0.0.1:5672/%2f");
    let config = write_config(&env, "submit", &raw);
    let input = env.dir.join("requests.jsonl");
    let lines: Vec<String> = (0..50).map(|i| format!(r#"{{"id":"denied-{i}","prompt":"p {i}","params":{{"max_tokens":4}}}}"#)).collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = tokio::task::spawn_blocking(move || bin_command().arg("--config").arg(&config).arg("submit").arg("--file").arg(&input).output().expect("run submit"))
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "submit succeeded without write access: {err}");
    assert!(err.contains("ACCESS_REFUSED") && err.contains("amq.default"), "submit does not name the refusal: {err}");
    // The broker took none of them: the refusal of the first publish closed the channel. (Before,
    // the line and count were those of the publish that met the closed channel, e.g. "input line
    // 3: … the 2 requests were published before it".)
    assert!(err.contains("input line 1:") && err.contains("no request was published before it"), "submit misreports what was published: {err}");
    env.cleanup().await;
}
