//! The membership scripts against the real Redis: the member set is a sorted set scored by Redis
//! time, listed without scanning the keyspace; a stopping process never removes a restarted
//! successor with the same name; a silent member drops out after its own `member_ttl`, whatever
//! the readers' TTL; a member's LLM-down flag is seen by every other member and goes with it.

mod common;

use std::time::Duration;

use common::*;
use prefix_batcher::membership::{
    assignable, member_health_key, member_key, member_llm_down_key, member_llm_unavailable_key, member_name_conflict_key, members_key, read_members, LlmFlags, Member,
    Membership,
};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_against_redis() {
    // Redis only: a unique key prefix, no RabbitMQ resources to clean up.
    let prefix = &format!("pb-test-members-{:016x}", fastrand::u64(..));
    let client = redis::Client::open(REDIS_URL).unwrap();
    let mut conn = client.get_connection_manager().await.unwrap();
    let (ttl, t) = (Duration::from_secs(30), Duration::from_secs(2));
    let a = Membership::new(conn.clone(), prefix, "a", "n1", ttl, t);
    let a2 = Membership::new(conn.clone(), prefix, "a", "n2", ttl, t); // `a` restarted
    let b = Membership::new(conn.clone(), prefix, "b", "n3", ttl, t);
    let mut probe = RedisProbe::connect().await.unwrap();

    assert_eq!(b.heartbeat(false).await.unwrap().members, ["b"]);
    assert_eq!(a.heartbeat(false).await.unwrap().members, ["a", "b"], "sorted live names");
    let listed = read_members(&mut conn, prefix).await.unwrap();
    let member = |name: &str, nonce: &str| Member { name: name.into(), nonce: Some(nonce.into()), llm_down: false, llm_unavailable: false, name_conflict: false, health: None };
    assert_eq!(listed, [member("a", "n1"), member("b", "n3")]);
    let kind: String = redis::cmd("TYPE").arg(members_key(prefix)).query_async(&mut probe.conn).await.unwrap();
    assert_eq!(kind, "zset");

    // A heartbeat reports no other process while the name's key holds its own nonce.
    assert_eq!(a.heartbeat(false).await.unwrap().previous_nonce, None);
    // A restarted process takes the name over, and its heartbeat names the previous process;
    // the old one's leave must not remove it.
    let taken = a2.heartbeat(false).await.unwrap();
    assert_eq!((taken.members, taken.previous_nonce), (vec!["a".to_owned(), "b".to_owned()], Some("n1".to_owned())));
    assert_eq!(a2.heartbeat(false).await.unwrap().previous_nonce, None, "its own nonce from then on");
    assert!(!a.leave().await.unwrap(), "leave by a stale nonce");
    let listed = read_members(&mut conn, prefix).await.unwrap();
    assert_eq!(listed[0], member("a", "n2"));

    // A member's health line goes with its heartbeats and expires with them; an empty one
    // deletes it; a line longer than the limit is cut at a character boundary.
    a2.set_health("not ready: amqp connection blocked; 1 of 2 LLM endpoints down: http://x:1/v1 (open)");
    a2.heartbeat(false).await.unwrap();
    let listed = read_members(&mut conn, prefix).await.unwrap();
    assert_eq!(listed[0].health.as_deref(), Some("not ready: amqp connection blocked; 1 of 2 LLM endpoints down: http://x:1/v1 (open)"));
    assert_eq!(listed[1].health, None, "b published none");
    let health_ttl: i64 = redis::cmd("PTTL").arg(member_health_key(prefix, "a")).query_async(&mut probe.conn).await.unwrap();
    assert!(health_ttl > 0 && health_ttl <= ttl.as_millis() as i64, "the health line expires with the heartbeat: PTTL {health_ttl}");
    a2.set_health(&"é".repeat(prefix_batcher::membership::MAX_HEALTH_BYTES));
    a2.heartbeat(false).await.unwrap();
    let cut = read_members(&mut conn, prefix).await.unwrap()[0].health.clone().unwrap();
    assert_eq!(cut.len(), prefix_batcher::membership::MAX_HEALTH_BYTES, "cut to the limit");
    a2.set_health("");
    a2.heartbeat(false).await.unwrap();
    assert_eq!(probe.get(&member_health_key(prefix, "a")).await, None, "an empty line deletes it");
    a2.set_health("ready");
    a2.heartbeat(false).await.unwrap();

    // A member whose LLM is down says so with its heartbeat; every heartbeat and the listing
    // report it, and its next heartbeat without the flag clears it.
    let beat = b.heartbeat(true).await.unwrap();
    assert_eq!((beat.members.clone(), beat.llm_down.clone()), (vec!["a".to_owned(), "b".to_owned()], vec!["b".to_owned()]));
    assert_eq!(a2.heartbeat(false).await.unwrap().llm_down, ["b"], "another member's heartbeat sees the flag");
    assert!(read_members(&mut conn, prefix).await.unwrap()[1].llm_down);
    let flag_ttl: i64 = redis::cmd("PTTL").arg(member_llm_down_key(prefix, "b")).query_async(&mut probe.conn).await.unwrap();
    assert!(flag_ttl > 0 && flag_ttl <= ttl.as_millis() as i64, "the flag expires with the heartbeat: PTTL {flag_ttl}");
    assert_eq!(beat.llm_unavailable, ["b"], "a member flagged down is unavailable too");
    assert_eq!(assignable(&beat.members, &beat.llm_down, &beat.llm_unavailable), ["a"], "partitions go to the members whose LLM is up");
    assert_eq!(assignable(&beat.members, &beat.members, &beat.members), ["a", "b"], "all down: all keep their partitions");
    // Every server down, `b` flagged first and `a` unavailable (not flagged yet): nobody could
    // serve b's partitions, so nothing moves; every heartbeat and the listing report it.
    let beat = a2.heartbeat_flagging(LlmFlags { down: false, unavailable: true }, None).await.unwrap();
    assert_eq!((beat.llm_down.clone(), beat.llm_unavailable.clone()), (vec!["b".to_owned()], vec!["a".to_owned(), "b".to_owned()]));
    assert_eq!(assignable(&beat.members, &beat.llm_down, &beat.llm_unavailable), ["a", "b"]);
    assert!(read_members(&mut conn, prefix).await.unwrap()[0].llm_unavailable);
    assert!(a2.heartbeat(false).await.unwrap().llm_unavailable == ["b"], "its next heartbeat without the flag clears it");
    assert!(b.heartbeat(false).await.unwrap().llm_down.is_empty());
    assert_eq!(probe.get(&member_llm_down_key(prefix, "b")).await, None);
    assert_eq!(probe.get(&member_llm_unavailable_key(prefix, "b")).await, None);
    b.set_health("ready");
    b.heartbeat(false).await.unwrap();
    assert_eq!(read_members(&mut conn, prefix).await.unwrap()[1].health.as_deref(), Some("ready"));

    // A leave removes the name, its nonce key, its flag and its health line at once.
    assert!(b.heartbeat(true).await.unwrap().llm_down == ["b"]);
    assert!(b.leave().await.unwrap());
    assert_eq!(a2.heartbeat(false).await.unwrap().members, ["a"]);
    assert_eq!(probe.get(&member_key(prefix, "b")).await, None);
    assert_eq!(probe.get(&member_llm_down_key(prefix, "b")).await, None);
    assert_eq!(probe.get(&member_health_key(prefix, "b")).await, None);

    // A member that stops heartbeating drops out after its own TTL (shorter than the reader's),
    // and its entry is removed.
    let short = Duration::from_millis(300);
    let c = Membership::new(conn.clone(), prefix, "c", "n4", short, t);
    let since = Instant::now();
    assert_eq!(c.heartbeat(false).await.unwrap().members, ["a", "c"]);
    let deadline = since + DEADLINE;
    while a2.heartbeat(false).await.unwrap().members.contains(&"c".to_owned()) {
        assert!(Instant::now() < deadline, "silent member still listed after {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(since.elapsed() >= short - Duration::from_millis(50), "dropped after {:?}, before its TTL", since.elapsed());
    let score: Option<f64> = redis::cmd("ZSCORE").arg(members_key(prefix)).arg("c").query_async(&mut probe.conn).await.unwrap();
    assert_eq!(score, None, "expired entry removed by the next heartbeat");

    // Two live processes with one name: each heartbeat finds the other's nonce (the daemon
    // reports it as a name conflict after its first heartbeat).
    let d1 = Membership::new(conn.clone(), prefix, "d", "n5", ttl, t);
    let d2 = Membership::new(conn.clone(), prefix, "d", "n6", ttl, t);
    assert_eq!(d1.heartbeat(false).await.unwrap().previous_nonce, None);
    for _ in 0..2 {
        assert_eq!(d2.heartbeat(false).await.unwrap().previous_nonce.as_deref(), Some("n5"));
        assert_eq!(d1.heartbeat(false).await.unwrap().previous_nonce.as_deref(), Some("n6"));
    }
    // The daemon then flags the conflict with its heartbeats, for `status`; the flag outlives
    // the heartbeat that set it, and a leave removes it.
    d2.heartbeat_flagging(LlmFlags::default(), Some(prefix_batcher::membership::NAME_CONFLICT_FLAG_TTL)).await.unwrap();
    let d = read_members(&mut conn, prefix).await.unwrap().into_iter().find(|m| m.name == "d").unwrap();
    assert!(d.name_conflict && !d.llm_down);
    d2.heartbeat_flagging(LlmFlags::default(), None).await.unwrap();
    assert!(read_members(&mut conn, prefix).await.unwrap().iter().any(|m| m.name == "d" && m.name_conflict), "a heartbeat without the flag leaves it to expire");
    let flag_ttl: i64 = redis::cmd("PTTL").arg(member_name_conflict_key(prefix, "d")).query_async(&mut probe.conn).await.unwrap();
    assert!(flag_ttl > ttl.as_millis() as i64 && flag_ttl <= 60_000, "PTTL {flag_ttl}");
    assert!(d2.leave().await.unwrap());
    assert_eq!(probe.get(&member_name_conflict_key(prefix, "d")).await, None);

    // The last leave leaves nothing behind.
    assert!(a2.leave().await.unwrap());
    assert!(read_members(&mut conn, prefix).await.unwrap().is_empty());
    let exists: i64 = redis::cmd("EXISTS").arg(members_key(prefix)).query_async(&mut probe.conn).await.unwrap();
    assert_eq!(exists, 0);
    let left = probe.keys(&format!("{prefix}:*")).await;
    assert!(left.is_empty(), "keys left behind: {left:?}");
}

/// Members publish their routing settings with each heartbeat, and each heartbeat names the live
/// members whose settings differ from its own (a router with another `keying.mode` sends a key
/// to other partitions); a member without settings (an older version) is not compared, and a
/// leave removes the settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_other_routing_settings_are_named() {
    let prefix = &format!("pb-test-routing-{:016x}", fastrand::u64(..));
    let conn = redis::Client::open(REDIS_URL).unwrap().get_connection_manager().await.unwrap();
    let (ttl, t) = (Duration::from_secs(30), Duration::from_secs(2));
    let adaptive = |name: &str| Membership::new(conn.clone(), prefix, name, name, ttl, t).with_routing("mode=Adaptive".into());
    let (a, b) = (adaptive("a"), adaptive("b"));
    let off = Membership::new(conn.clone(), prefix, "c", "c", ttl, t).with_routing("mode=Off".into());
    let old = Membership::new(conn.clone(), prefix, "d", "d", ttl, t);
    old.heartbeat(false).await.unwrap();
    a.heartbeat(false).await.unwrap();
    assert!(b.heartbeat(false).await.unwrap().routing_differs.is_empty(), "same settings");
    assert!(off.heartbeat(false).await.unwrap().routing_differs.len() == 2, "c differs from a and b");
    assert_eq!(a.heartbeat(false).await.unwrap().routing_differs, [("c".to_owned(), "mode=Off".to_owned())]);
    assert!(old.heartbeat(false).await.unwrap().routing_differs.is_empty(), "a member without settings compares nothing");
    assert!(off.leave().await.unwrap());
    assert!(a.heartbeat(false).await.unwrap().routing_differs.is_empty(), "gone with its leave");
    for m in [&a, &b, &old] {
        assert!(m.leave().await.unwrap());
    }
    let mut probe = RedisProbe::connect().await.unwrap();
    let left = probe.keys(&format!("{prefix}:*")).await;
    assert!(left.is_empty(), "keys left behind: {left:?}");
}

/// After Redis lost its data (`FLUSHALL`, a restart without persistence), a member's next
/// heartbeat finds its own entry gone (the ownership manager then waits `settle_time` before
/// acquiring, instead of taking the partitions of the members that have not heartbeated yet),
/// and the first heartbeat records the partition count again, never overwriting one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_sees_that_redis_lost_its_data() {
    let prefix = &format!("pb-test-lost-{:016x}", fastrand::u64(..));
    let conn = redis::Client::open(REDIS_URL).unwrap().get_connection_manager().await.unwrap();
    let mut probe = RedisProbe::connect().await.unwrap();
    let (ttl, t) = (Duration::from_secs(30), Duration::from_secs(2));
    let count_key = prefix_batcher::topology::partition_count_key(prefix);
    let a = Membership::new(conn.clone(), prefix, "a", "a", ttl, t).with_partition_count(12);
    let b = Membership::new(conn.clone(), prefix, "b", "b", ttl, t).with_partition_count(12);
    let first = a.heartbeat(false).await.unwrap();
    assert!(!first.was_listed, "a first heartbeat finds no entry");
    assert!(first.recorded_partition_count, "nothing was recorded");
    assert_eq!(probe.get(&count_key).await.as_deref(), Some("12"));
    let beat = b.heartbeat(false).await.unwrap();
    assert!(!beat.was_listed && !beat.recorded_partition_count, "already recorded: {beat:?}");
    let beat = a.heartbeat(false).await.unwrap();
    assert!(beat.was_listed && !beat.recorded_partition_count, "{beat:?}");

    // Redis loses the deployment's data.
    let keys = probe.keys(&format!("{prefix}:*")).await;
    let _: i64 = redis::cmd("DEL").arg(&keys).query_async(&mut probe.conn).await.unwrap();
    let beat = a.heartbeat(false).await.unwrap();
    assert_eq!(beat.members, ["a"], "b has not heartbeated since");
    assert!(!beat.was_listed, "the entry is gone although a heartbeated just now");
    assert!(beat.recorded_partition_count);
    assert_eq!(probe.get(&count_key).await.as_deref(), Some("12"));
    assert!(!b.heartbeat(false).await.unwrap().was_listed, "b too");
    assert!(a.heartbeat(false).await.unwrap().was_listed);

    // A recorded count is never overwritten, whatever this member's own.
    let _: () = redis::cmd("SET").arg(&count_key).arg("16").query_async(&mut probe.conn).await.unwrap();
    assert!(!a.heartbeat(false).await.unwrap().recorded_partition_count);
    assert_eq!(probe.get(&count_key).await.as_deref(), Some("16"));

    for m in [&a, &b] {
        assert!(m.leave().await.unwrap());
    }
    let _: i64 = redis::cmd("DEL").arg(&count_key).query_async(&mut probe.conn).await.unwrap();
    let left = probe.keys(&format!("{prefix}:*")).await;
    assert!(left.is_empty(), "keys left behind: {left:?}");
}
