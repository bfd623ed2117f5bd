//! Redeliveries: how often a request was delivered, and why its last attempt here did not end.
//!
//! Quorum queues count the deliveries of every message and put the count in the header
//! `x-delivery-count` of each redelivery (absent on the first delivery;
//! <https://www.rabbitmq.com/docs/quorum-queues#poison-message-handling>). The daemon dead-letters a
//! request whose count reached `amqp.delivery_limit`, with reason `delivery_limit` and the last
//! error it saw for it, so a poison message (one that crashes a task, or times out the LLM server
//! on every try) ends in the dead-letter queue with a reason instead of looping.
//!
//! The last error is remembered per request id (a failed call, a refused publish, a panic, or a
//! return by the partitions' `amqp.consumer_timeout` guard), in this process only, in a bounded table
//! ([`LAST_FAILURES_CAPACITY`] entries, oldest forgotten first): a redelivery that reaches another
//! instance is dead-lettered with the detail "delivered N times; last error: unknown on this instance"
//! (see [`crate::publisher::parse_or_dead_letter`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{LazyLock, Mutex};

use std::time::Duration;

use lapin::types::FieldTable;

use crate::amqp::header_u64;
use crate::config::AmqpSettings;

/// Header in which quorum queues count earlier deliveries of a message.
pub const HEADER_DELIVERY_COUNT: &str = "x-delivery-count";

/// How many request ids [`note_failure`] remembers.
pub const LAST_FAILURES_CAPACITY: usize = 10_000;

/// Longest remembered error text, in characters.
const MAX_ERROR_CHARS: usize = 300;

#[derive(Default)]
struct LastFailures {
    by_id: HashMap<String, String>,
    order: VecDeque<String>,
}

static LAST_FAILURES: LazyLock<Mutex<LastFailures>> = LazyLock::new(Mutex::default);

/// How long a delivery whose publish the broker did not confirm (a forward or a dead letter:
/// channel closed, unroutable, nacked, no confirm) is held before it is requeued:
/// `amqp.reconnect_backoff_initial` × 2^`earlier_deliveries`, at most
/// `amqp.reconnect_backoff_max`. Every requeue counts towards `amqp.delivery_limit` (and the
/// broker's own limit), so a broker fault must not use the deliveries up in milliseconds.
pub fn requeue_backoff(a: &AmqpSettings, earlier_deliveries: u64) -> Duration {
    let factor = 1u32 << earlier_deliveries.min(16);
    a.reconnect_backoff_initial.saturating_mul(factor).min(a.reconnect_backoff_max)
}

/// Header of a request the daemon put back in its partition queue as a new message without
/// charging it a delivery ([`crate::partition`]: a drain or handoff while its LLM endpoint was
/// down): the deliveries charged to it before. Set only by the daemon; the router drops it from
/// the requests it forwards ([`crate::publisher::carried_props`]).
pub const HEADER_EARLIER_DELIVERIES: &str = "x-earlier-deliveries";

/// Which queue a delivery came from, for [`delivery_count`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The input queue: publishers write there, so [`HEADER_EARLIER_DELIVERIES`] is not trusted.
    Input,
    /// A partition queue: only the router and the partitions publish there.
    Partition,
}

/// Earlier deliveries charged to a request: from [`HEADER_DELIVERY_COUNT`], 0 on its first
/// delivery (`redelivered` false: AMQP 0-9-1 `basic.deliver`), whatever that header says then;
/// plus, from a partition queue, [`HEADER_EARLIER_DELIVERIES`]. A quorum queue sets
/// `x-delivery-count` only on a redelivery and passes a publisher's own through on the first, so
/// a publisher must not be able to make its request look delivered many times (dead-lettered
/// with `delivery_limit` at once).
pub fn delivery_count(source: Source, redelivered: bool, headers: Option<&FieldTable>) -> u64 {
    let carried = match source {
        Source::Partition => header_u64(headers, HEADER_EARLIER_DELIVERIES).unwrap_or(0),
        Source::Input => 0,
    };
    let own = if redelivered { header_u64(headers, HEADER_DELIVERY_COUNT).unwrap_or(0) } else { 0 };
    carried.saturating_add(own)
}

/// Remembers why the attempt at request `id` ended without a result (the delivery goes back to
/// its queue). Bounded: the oldest ids are forgotten first.
pub fn note_failure(id: &str, error: &str) {
    let error: String = error.chars().take(MAX_ERROR_CHARS).collect();
    let mut t = LAST_FAILURES.lock().unwrap_or_else(|p| p.into_inner());
    if t.by_id.insert(id.to_owned(), error).is_none() {
        t.order.push_back(id.to_owned());
        while t.order.len() > LAST_FAILURES_CAPACITY {
            if let Some(old) = t.order.pop_front() {
                t.by_id.remove(&old);
            }
        }
    }
}

/// The last error [`note_failure`] remembered for request `id`.
pub fn last_failure(id: &str) -> Option<String> {
    LAST_FAILURES.lock().unwrap_or_else(|p| p.into_inner()).by_id.get(id).cloned()
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, ShortString};

    use super::*;

    #[test]
    fn the_table_is_bounded_and_keeps_the_newest() {
        note_failure("redelivery-test-first", "timeout");
        note_failure("redelivery-test-first", "server: 503");
        assert_eq!(last_failure("redelivery-test-first").as_deref(), Some("server: 503"));
        for i in 0..LAST_FAILURES_CAPACITY {
            note_failure(&format!("redelivery-test-{i}"), "x");
        }
        assert_eq!(last_failure("redelivery-test-first"), None, "the oldest id is forgotten");
        assert!(last_failure(&format!("redelivery-test-{}", LAST_FAILURES_CAPACITY - 1)).is_some());
        assert!(LAST_FAILURES.lock().unwrap().by_id.len() <= LAST_FAILURES_CAPACITY);
    }

    #[test]
    fn delivery_count_reads_the_quorum_queue_header() {
        use Source::{Input, Partition};
        assert_eq!(delivery_count(Input, true, None), 0);
        let mut t = FieldTable::default();
        t.insert(ShortString::from(HEADER_DELIVERY_COUNT), AMQPValue::LongLongInt(3));
        assert_eq!(delivery_count(Input, true, Some(&t)), 3);
        assert_eq!(delivery_count(Input, false, Some(&t)), 0, "a first delivery has no earlier one, whatever the publisher set");
        // A request put back uncharged carries its earlier deliveries; trusted from a partition
        // queue only.
        t.insert(ShortString::from(HEADER_EARLIER_DELIVERIES), AMQPValue::LongLongInt(2));
        assert_eq!(delivery_count(Partition, false, Some(&t)), 2);
        assert_eq!(delivery_count(Partition, true, Some(&t)), 5);
        assert_eq!(delivery_count(Input, false, Some(&t)), 0, "a publisher cannot set it");
        assert_eq!(delivery_count(Input, true, Some(&t)), 3);
    }
}
