//! The TLS test services themselves (tests/common/tls.rs), checked with external clients: the
//! certificates, the TLS redis-server and the private RabbitMQ node behave as the TLS tests of the
//! daemon assume.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::tls::{TlsBroker, TlsFiles, TlsRedis};
use lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// `openssl s_client` to `localhost:port` trusting only `ca`, failing on any verification
/// error (`-verify_return_error`), checking the name `localhost`; stdin is empty, so it closes
/// right after the handshake. Killed after 20 s.
fn s_client(port: u16, ca: &Path) -> Output {
    Command::new("timeout")
        .args(["20", "/usr/bin/openssl", "s_client", "-connect", &format!("localhost:{port}")])
        .args(["-verify_hostname", "localhost", "-verify_return_error", "-brief", "-CAfile"])
        .arg(ca)
        .stdin(Stdio::null())
        .output()
        .expect("run openssl s_client")
}

fn text(out: &Output) -> String {
    format!("status {}\nstdout: {}\nstderr: {}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_services_accept_the_test_ca_and_refuse_others() {
    let files = TlsFiles::generate();
    for key in [&files.server_key, &files.client_key] {
        let pem = std::fs::read_to_string(key).unwrap();
        assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----"), "{} is not PKCS#8 PEM", key.display());
    }
    let (redis, broker) = tokio::join!(TlsRedis::start(&files, true), TlsBroker::start(&files));
    eprintln!("RabbitMQ node {} ready after {:?}; TLS redis on port {}", broker.node, broker.startup, redis.port);

    // The broker's TLS listener: the test CA verifies it under the name localhost, another CA
    // does not.
    let ok = s_client(broker.amqps_port, &files.ca_cert);
    assert!(ok.status.success(), "handshake with the test CA failed: {}", text(&ok));
    assert!(String::from_utf8_lossy(&ok.stderr).contains("Verification: OK"), "{}", text(&ok));
    let wrong_ca = s_client(broker.amqps_port, &files.other_ca_cert);
    assert!(!wrong_ca.status.success(), "handshake trusting another CA succeeded: {}", text(&wrong_ca));

    // Redis with --tls-auth-clients yes: PONG with the client certificate, nothing without.
    let ping = redis.cli(true, &["PING"]);
    assert_eq!(String::from_utf8_lossy(&ping.stdout).trim(), "PONG", "{}", text(&ping));
    let anonymous = redis.cli(false, &["PING"]);
    assert!(!String::from_utf8_lossy(&anonymous.stdout).contains("PONG"), "PING without a client certificate answered: {}", text(&anonymous));
    assert!(!anonymous.status.success(), "{}", text(&anonymous));
    assert!(redis.url().starts_with("rediss://localhost:"), "{}", redis.url());

    // The node's plain port: a queue can be declared, used and deleted.
    let conn = Connection::connect(&broker.amqp_url(), ConnectionProperties::default()).await.expect("connect to the plain port");
    let ch = conn.create_channel().await.expect("channel");
    let queue = format!("pbt-tls-harness-{}", uuid::Uuid::new_v4().simple());
    let q = ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), FieldTable::default()).await.expect("declare");
    assert_eq!(q.name().as_str(), queue);
    ch.confirm_select(ConfirmSelectOptions::default()).await.expect("confirm.select");
    let confirm = ch
        .basic_publish("".into(), queue.as_str().into(), BasicPublishOptions::default(), b"hello", BasicProperties::default())
        .await
        .expect("publish")
        .await
        .expect("publisher confirm");
    assert!(confirm.is_ack(), "the node nacked the publish");
    let got = ch.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.expect("basic.get");
    assert_eq!(got.expect("the published message").delivery.data, b"hello");
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.expect("delete");
    conn.close(200, "done".into()).await.expect("close");
    assert!(broker.amqps_url().starts_with("amqps://guest:guest@localhost:"), "{}", broker.amqps_url());

    // Dropping stops both servers and deletes every directory.
    let dirs = [files.dir.clone(), redis.dir.clone(), broker.dir.clone()];
    let ports = [redis.port, broker.amqp_port, broker.amqps_port];
    drop((broker, redis, files));
    for dir in dirs {
        assert!(!dir.exists(), "{} was not deleted", dir.display());
    }
    for port in ports {
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "port {port} still accepts connections");
    }
}
