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

use std::time::{Duration, Instant};

use lapin::types::FieldTable;
use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::amqp::header_u64;
use crate::config::AmqpSettings;

/// Header in which quorum queues count earlier deliveries of a message.
pub const HEADER_DELIVERY_COUNT: &str = "x-delivery-count";

/// How many request ids [`note_failure`] remembers.
pub const LAST_FAILURES_CAPACITY: usize = 10_000;

/// Longest remembered error text, in characters.
const MAX_ERROR_CHARS: usize = 300;

/// A map that forgets its oldest keys once it holds `capacity`: the tables of this module.
struct Bounded<K, V> {
    capacity: usize,
    map: HashMap<K, V>,
    order: VecDeque<K>,
}

impl<K: std::hash::Hash + Eq + Clone, V> Bounded<K, V> {
    fn new(capacity: usize) -> Self {
        Self { capacity, map: HashMap::new(), order: VecDeque::new() }
    }

    /// Sets `key` to `value`; false when `key` was there already (its value is replaced, its
    /// age kept).
    fn insert(&mut self, key: K, value: V) -> bool {
        let first = self.map.insert(key.clone(), value).is_none();
        if first {
            self.order.push_back(key);
            while self.order.len() > self.capacity {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
        first
    }

    fn contains(&self, key: &K) -> bool {
        self.map.contains_key(key)
    }

    /// Removes `key`; true when it was there. Its place in the order stays until it is the
    /// oldest (removing it then removes nothing).
    fn take(&mut self, key: &K) -> bool {
        self.map.remove(key).is_some()
    }
}

static LAST_FAILURES: LazyLock<Mutex<Bounded<String, String>>> = LazyLock::new(|| Mutex::new(Bounded::new(LAST_FAILURES_CAPACITY)));

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

/// Header the router sets (to `1`) on a forward of an input delivery that the input queue had
/// delivered before (AMQP 0-9-1 `basic.deliver` `redelivered`): an earlier delivery of the same
/// message may have been forwarded already and not acked, because the router's intake
/// connection or channel closed between the forward's confirm and the ack (a message the AMQP
/// client cannot read, a broker restart, a network fault). Set only by the router: dropped from
/// what publishers send and from the copies the daemon publishes again
/// ([`crate::publisher::carried_props`]). Read by [`is_second_copy`].
pub const HEADER_INPUT_REDELIVERED: &str = "x-input-redelivered";

/// Header the router sets (to `1`) on a copy of an input delivery that it put back into the
/// input queue after a forward whose outcome it could not know (no confirm in time, or an earlier
/// publish on its channel failed): the broker may still have enqueued that forward. The router
/// marks the forward of such a copy with [`HEADER_INPUT_REDELIVERED`], as it does for a
/// redelivered input message, so the partition's owner answers it once ([`is_second_copy`]).
/// A publisher can set it too: its forward is then marked, which only makes a later identical
/// copy of that request (same fingerprint) count as a second copy.
pub const HEADER_FORWARDED_BEFORE: &str = "x-forwarded-before";

/// Header the router sets on a copy of an input delivery that it put back into the input queue:
/// when it did so (Unix milliseconds). A copy that comes back sooner than one put-back pause
/// waits out the rest of it before going back again, so that copies cannot go round at the
/// broker's speed (`crate::router`).
pub const HEADER_PUT_BACK_AT_MS: &str = "x-put-back-at-ms";

/// Header the router sets on every forward: a fresh UUID v4 (32 hex digits) naming that one
/// message, kept across its redeliveries from the partition queue. Set only by the router
/// (dropped from what publishers send and from the copies the daemon publishes again,
/// [`crate::publisher::carried_props`]). Read by [`answered_before`].
pub const HEADER_FORWARD_ID: &str = "x-forward-id";

/// How many entries [`is_second_copy`] and [`answered_before`] remember: 131,072 each, about
/// 5 MB each. [`is_second_copy`] keeps two per forward taken (three for a marked one): at 4,000
/// requests/s, the last 15 s.
pub const RECENT_REQUESTS_CAPACITY: usize = 1 << 17;

/// A set of 128-bit fingerprints, each with when it was last noted, that forgets the oldest once
/// `capacity` are kept.
type RecentSet = Bounded<u128, Instant>;

/// How long after a request was taken a copy marked [`HEADER_INPUT_REDELIVERED`] `1` (or an
/// unmarked one behind such a copy) counts as its second copy ([`is_second_copy`]): 10 s.
///
/// Such a mark says only that the input queue delivered the message before; it does not say that
/// a router forwarded that earlier delivery. When one did (its intake connection closed between
/// the forward's confirm and the ack), the broker gives the message back at once, and another
/// instance's router forwards it again within milliseconds to a second or so. Beyond that
/// window, a marked copy is more likely a publisher's resend of the same message that happened to
/// be delivered twice (a connection fault in between), and dropping it would lose that request:
/// so it is processed, and at worst answered twice. Copies marked `2` (the router put the
/// delivery back after a forward whose outcome it did not know) count without a window.
pub const SECOND_COPY_WINDOW: Duration = Duration::from_secs(10);

/// [`HEADER_INPUT_REDELIVERED`] value of a forward whose input delivery the router, or one
/// before it, put back after a forward whose outcome it did not know
/// ([`HEADER_FORWARDED_BEFORE`]): that earlier forward may be in the partition queue, however
/// long ago.
pub const MARK_FORWARDED_MAYBE: u64 = 2;

impl RecentSet {
    /// [`is_second_copy`] on this set, at `now`: it holds the fingerprint of every request taken,
    /// that fingerprint XOR [`MARKED`] for every copy marked `1` taken, and XOR
    /// [`MARKED_FORWARDED`] for every copy marked [`MARK_FORWARDED_MAYBE`] taken, each with when.
    fn is_second_copy(&mut self, taken: u128, redelivered: bool, headers: Option<&FieldTable>, now: Instant) -> bool {
        let mark = header_u64(headers, HEADER_INPUT_REDELIVERED).unwrap_or(0);
        let marked = mark > 0;
        let forwarded_maybe = mark >= MARK_FORWARDED_MAYBE;
        let put_back = header_u64(headers, HEADER_EARLIER_DELIVERIES).is_some();
        // The same forward (its id and the request's fingerprint together) published again.
        let forward = forward_fingerprint(headers).map(|f| f ^ taken ^ SENT_AGAIN);
        let recent = |k: u128| self.map.get(&k).is_some_and(|at| now.saturating_duration_since(*at) <= SECOND_COPY_WINDOW);
        let copy = !redelivered
            && (forward.is_some_and(|f| self.contains(&f))
                || if forwarded_maybe {
                    self.contains(&taken)
                } else if marked {
                    recent(taken)
                } else {
                    !put_back && (self.contains(&(taken ^ MARKED_FORWARDED)) || recent(taken ^ MARKED))
                });
        if !copy {
            self.insert(taken, now);
            if marked {
                self.insert(taken ^ if forwarded_maybe { MARKED_FORWARDED } else { MARKED }, now);
            }
            if let Some(f) = forward {
                self.insert(f, now);
            }
        }
        copy
    }
}

/// A set of 128-bit forward fingerprints that forgets the oldest once `capacity` are kept.
type AnsweredSet = Bounded<u128, ()>;

impl AnsweredSet {
    /// [`answered_before`] on this set.
    fn answered_before(&self, redelivered: bool, headers: Option<&FieldTable>) -> bool {
        redelivered && forward_fingerprint(headers).is_some_and(|f| self.contains(&f))
    }
}

/// Told apart from a request's fingerprint, that of a copy marked `1` ([`HEADER_INPUT_REDELIVERED`]).
const MARKED: u128 = 0x5a5a_5a5a_5a5a_5a5a_a5a5_a5a5_a5a5_a5a5;

/// Told apart from the others, that of a copy marked [`MARK_FORWARDED_MAYBE`].
const MARKED_FORWARDED: u128 = 0x7878_8787_7878_8787_8787_7878_8787_7878;

/// Told apart from the others, the entry of a forward taken: its [`HEADER_FORWARD_ID`]'s hash
/// XOR the request's fingerprint XOR this.
const SENT_AGAIN: u128 = 0x3c3c_3c3c_c3c3_c3c3_3c3c_3c3c_c3c3_c3c3;

/// Requests that entered this process's partition consumers, by their fingerprint.
static RECENT_REQUESTS: LazyLock<Mutex<RecentSet>> = LazyLock::new(|| Mutex::new(RecentSet::new(RECENT_REQUESTS_CAPACITY)));

/// Forwards whose outcome this process published (confirmed), by [`forward_fingerprint`]. Input
/// messages whose forward it published (confirmed) are in [`INPUT_ACKS`], by [`input_key`].
static ANSWERED_FORWARDS: LazyLock<Mutex<AnsweredSet>> = LazyLock::new(|| Mutex::new(AnsweredSet::new(RECENT_REQUESTS_CAPACITY)));

/// 128-bit hash of a message's [`HEADER_FORWARD_ID`], when it has one.
fn forward_fingerprint(headers: Option<&FieldTable>) -> Option<u128> {
    crate::amqp::header_str(headers, HEADER_FORWARD_ID).map(|f| xxh3_128_with_seed(f.as_bytes(), 0))
}

/// Notes that a partition consumer of this process took a request with `fingerprint` (a hash of
/// its id, body and the properties its publisher set: [`crate::publisher::request_fingerprint`]),
/// and tells whether this delivery is a second copy of a request it took before, to be acked
/// without processing. Only a delivery that the partition queue delivers for the first time
/// (`redelivered` false; one it delivers again is [`answered_before`]'s case) can be one, when
/// this process took a request with the same fingerprint from a partition queue among its last
/// [`RECENT_REQUESTS_CAPACITY`] requests, and either
/// - it carries [`HEADER_INPUT_REDELIVERED`] (the router forwarded it from a redelivered input
///   message), or
/// - the copy taken before carried it: the router that first took the input message sent its
///   forward after the broker had already given the message to another router, whose marked
///   forward reached the partition queue first;
///
/// or when it is a forward taken before, published again: the same [`HEADER_FORWARD_ID`] with
/// the same fingerprint. The router publishes a forward again, with the same properties, when
/// the broker did not confirm it (no confirm in time, a nack, or an earlier publish on its
/// channel failed: ordered settlement), though the broker often enqueued it anyway, as around
/// a quorum queue's leader election.
///
/// The mark says that the input queue delivered the message before, not that a router forwarded
/// it (it may have waited in a router's prefetch window): so the fingerprint covers everything
/// the publisher set, and two messages count as one request only when they are the same in
/// body, id, `reply_to`, `correlation_id`, `timestamp` and headers, where each answer would be
/// the same message to the same requester. A publisher's retry that differs in any of them
/// (another correlation id, timestamp, reply queue) is processed, and so is a copy that the
/// daemon put back uncharged ([`HEADER_EARLIER_DELIVERIES`]).
///
/// Dropping such a copy loses no answer: the copy taken before either reached an outcome (a
/// result or a dead letter, then acked), is still unacked (the broker gives it back if that
/// attempt does not end), or was put back uncharged, as a copy that is always processed.
/// Requests without an id (a UUID generated per delivery) are never recognised, nor are copies
/// taken by another instance (the partition moved in between).
pub fn is_second_copy(fingerprint: u128, redelivered: bool, headers: Option<&FieldTable>) -> bool {
    RECENT_REQUESTS.lock().unwrap_or_else(|p| p.into_inner()).is_second_copy(fingerprint, redelivered, headers, Instant::now())
}

/// Notes that the outcome (a result or a dead letter) of the partition delivery with these
/// headers was confirmed by the broker; called before its ack. Nothing for a message without
/// [`HEADER_FORWARD_ID`].
pub fn note_answered(headers: Option<&FieldTable>) {
    if let Some(f) = forward_fingerprint(headers) {
        ANSWERED_FORWARDS.lock().unwrap_or_else(|p| p.into_inner()).insert(f, ());
    }
}

/// Whether a partition queue delivers again (`redelivered`) a forward whose outcome this
/// process already published ([`note_answered`], among the last [`RECENT_REQUESTS_CAPACITY`]):
/// its ack was lost with a channel or connection (a broker restart, a network fault, the lease
/// deadline passing between the confirm and the ack) and this instance took the partition
/// again. Such a delivery is acked without processing: its outcome is in the broker's hands.
pub fn answered_before(redelivered: bool, headers: Option<&FieldTable>) -> bool {
    // Most deliveries are first deliveries: no lock for them.
    redelivered && ANSWERED_FORWARDS.lock().unwrap_or_else(|p| p.into_inner()).answered_before(redelivered, headers)
}

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
    LAST_FAILURES.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_owned(), error);
}

/// The last error [`note_failure`] remembered for request `id`.
pub fn last_failure(id: &str) -> Option<String> {
    LAST_FAILURES.lock().unwrap_or_else(|p| p.into_inner()).map.get(id).cloned()
}

/// Key of an input message for [`OutcomeInFlight`] and the uncharged returns
/// ([`note_uncharged_return`]): its request's fingerprint
/// ([`crate::publisher::request_fingerprint`]), told apart from the keys of forwards
/// ([`forward_key`]).
pub fn input_key(request_fingerprint: u128) -> u128 {
    request_fingerprint ^ INPUT_KEY
}

/// Told apart from the keys of forwards, the key of an input message ([`input_key`]).
const INPUT_KEY: u128 = 0x6969_9696_6969_9696_9696_6969_9696_6969;

/// Key of a forward (a partition queue's message) for [`OutcomeInFlight`] and the uncharged
/// returns ([`note_uncharged_return`]): the hash of its [`HEADER_FORWARD_ID`], kept across its
/// redeliveries. `None` for a message without one (published straight to a partition queue).
pub fn forward_key(headers: Option<&FieldTable>) -> Option<u128> {
    forward_fingerprint(headers)
}

/// The outcome publishes of this process not yet settled, by key ([`input_key`]: forwards of an
/// input message; [`forward_key`]: results and dead letters of a forward), each with how many
/// there are and what tells their waiters that one ended.
static OUTCOMES_IN_FLIGHT: LazyLock<Mutex<HashMap<u128, InFlightCount>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// How many outcome publishes of one key are in flight, what wakes their waiters when one ends,
/// and whether one of them was handed to the broker ([`note_sending`]).
type InFlightCount = (usize, std::sync::Arc<tokio::sync::Notify>, bool);

/// Outcome publishes that ended without a confirm or a refusal: the broker may have taken them.
static MAYBE_PUBLISHED: LazyLock<Mutex<Bounded<u128, Instant>>> = LazyLock::new(|| Mutex::new(Bounded::new(RECENT_REQUESTS_CAPACITY)));

/// The publish of a delivery's outcome (the router's forward of an input message, or a
/// partition's result or dead letter of a forward), from its start until it is settled.
///
/// While a publishing connection is blocked (a memory or disk alarm) or a confirm is slow, the
/// broker may return the delivery before its outcome is confirmed: its channel closes (the
/// broker's `consumer_timeout`, a fault of the consuming connection) or the partitions'
/// `amqp.consumer_timeout` guard returns it. Its redelivery must not make a second outcome
/// while the first may still land: a dead letter at `amqp.delivery_limit` next to a result, or a
/// second result. So a redelivery waits for the outcome in flight ([`earlier_outcome`]).
/// Observed before: a 75 s memory alarm with a 20 s `consumer_timeout` and
/// `amqp.delivery_limit = 1` answered 32 of 400 requests and dead-lettered them too.
pub struct OutcomeInFlight {
    key: u128,
    /// Confirmed ([`Self::confirmed`]) or refused ([`Self::refused`]): its end is known.
    settled: bool,
}

impl OutcomeInFlight {
    /// Notes the start of an outcome publish for `key`.
    pub fn begin(key: u128) -> Self {
        let mut all = OUTCOMES_IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner());
        all.entry(key).or_insert_with(|| (0, std::sync::Arc::new(tokio::sync::Notify::new()), false)).0 += 1;
        Self { key, settled: false }
    }

    /// The broker confirmed the outcome: a redelivery of its message has its outcome
    /// ([`Earlier::Confirmed`]). A partition's outcome is noted by [`note_answered`] instead.
    /// Until its ack completes ([`note_input_ack`]), its message's ack is unsettled
    /// ([`earlier_input_ack`]), whatever an earlier message alike to it left.
    pub fn confirmed(mut self) {
        self.settled = true;
        INPUT_ACKS.lock().unwrap_or_else(|p| p.into_inner()).insert(self.key, InputAck::Unsettled(Instant::now()));
    }

    /// The broker refused the outcome (a nack, a return, a closed channel before the publish): it
    /// is not in any queue.
    pub fn refused(mut self) {
        self.settled = true;
    }
}

impl Drop for OutcomeInFlight {
    fn drop(&mut self) {
        if !self.settled && !confirmed_before(self.key) {
            MAYBE_PUBLISHED.lock().unwrap_or_else(|p| p.into_inner()).insert(self.key, Instant::now());
        }
        let mut all = OUTCOMES_IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((n, ended, _)) = all.get_mut(&self.key) {
            *n -= 1;
            ended.notify_waiters();
            if *n == 0 {
                all.remove(&self.key);
            }
        }
    }
}

/// Whether an outcome with `key` was confirmed in this process: a partition's result or dead
/// letter of a forward ([`ANSWERED_FORWARDS`], [`forward_key`]) or the router's forward of an
/// input message ([`INPUT_ACKS`], [`input_key`]).
fn confirmed_before(key: u128) -> bool {
    ANSWERED_FORWARDS.lock().unwrap_or_else(|p| p.into_inner()).contains(&key) || INPUT_ACKS.lock().unwrap_or_else(|p| p.into_inner()).contains(&key)
}

/// What this process knows of an earlier outcome of a message ([`earlier_outcome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Earlier {
    /// None that this process published (among its last [`RECENT_REQUESTS_CAPACITY`]).
    Nothing,
    /// Confirmed by the broker: the message has its outcome.
    Confirmed,
    /// Published but neither confirmed nor refused: the broker may have taken it. Told once:
    /// [`earlier_outcome`] forgets it.
    Maybe,
}

/// Notes that an outcome publish for `key` in flight ([`OutcomeInFlight::begin`]) is about to be
/// handed to the broker: from now on the broker may take it, and [`maybe_forwarded`] names it. A
/// forward noted only as begun may never be published (its delivery's channel closes first),
/// and named in an intake-loss report it would make a resend alike to it count as a copy.
/// Observed before: 1 of 13 resends behind an unreadable message lost that way.
pub fn note_sending(key: u128) {
    if let Some((_, _, sent)) = OUTCOMES_IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&key) {
        *sent = true;
    }
}

/// Whether an outcome publish for `key` is in flight in this process ([`OutcomeInFlight`]).
pub fn outcome_in_flight(key: u128) -> bool {
    OUTCOMES_IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&key)
}

/// The earlier outcome of the message with `key` in this process, once no outcome publish for it
/// is in flight any more: this waits for those in flight, however long their publishes wait (a
/// blocked connection is waited out, see [`crate::publisher`]).
pub async fn earlier_outcome(key: u128) -> Earlier {
    loop {
        let ended = {
            let all = OUTCOMES_IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner());
            match all.get(&key) {
                Some((_, ended, _)) => ended.clone(),
                None => break,
            }
        };
        let notified = ended.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if !outcome_in_flight(key) {
            break;
        }
        notified.await;
    }
    if confirmed_before(key) {
        Earlier::Confirmed
    } else if MAYBE_PUBLISHED.lock().unwrap_or_else(|p| p.into_inner()).take(&key) {
        Earlier::Maybe
    } else {
        Earlier::Nothing
    }
}

/// Where the input ack of a forward this process published (confirmed) stands
/// ([`earlier_input_ack`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InputAck {
    /// Not completed: the ack is under way, or failed (the broker then delivers the message
    /// again), since then.
    Unsettled(Instant),
    /// Completed then: lapin handed its frame to the connection.
    Completed(Instant),
}

/// The input acks of confirmed forwards, by [`input_key`].
static INPUT_ACKS: LazyLock<Mutex<Bounded<u128, InputAck>>> = LazyLock::new(|| Mutex::new(Bounded::new(RECENT_REQUESTS_CAPACITY)));

/// When the router of each instance of this process (by `instance.name`) lost its consumer of the
/// input queue ([`note_intake_lost`]): the last [`INTAKE_LOSSES_KEPT`] of each.
static INTAKE_LOSSES: LazyLock<Mutex<HashMap<String, VecDeque<Instant>>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// How many intake losses [`INTAKE_LOSSES`] keeps per instance.
const INTAKE_LOSSES_KEPT: usize = 64;

/// How long after an input ack completed a loss of the router's consumer of the input queue may
/// still have lost it: 2 s. lapin completes an ack once its frame is handed to the connection; the
/// broker applies it when it reads the frame, which on a live connection takes milliseconds.
pub const ACK_LOSS_WINDOW: Duration = Duration::from_secs(2);

/// How long after an ack failed, or after the intake loss that may have lost it, the message's
/// redelivery is taken for the copy of its forward: 30 s. The broker returns the message at
/// once, and the router consumes again within its reconnect backoff; a message alike to it
/// that comes later is another one (published again), and goes on, marked, to the partition's
/// window ([`SECOND_COPY_WINDOW`]).
pub const REDELIVERY_WINDOW: Duration = Duration::from_secs(30);

/// Notes the end of the input ack of a message with `key` ([`input_key`]) whose forward the
/// broker confirmed: completed (`ok`), or failed (the broker delivers the message again, and that
/// redelivery is a copy of the forward).
pub fn note_input_ack(key: u128, ok: bool) {
    let now = Instant::now();
    INPUT_ACKS.lock().unwrap_or_else(|p| p.into_inner()).insert(key, if ok { InputAck::Completed(now) } else { InputAck::Unsettled(now) });
}

/// Notes that the router of `instance` lost its consumer of the input queue (its channel or
/// connection closed): the acks it had sent shortly before may be lost ([`earlier_input_ack`]).
pub fn note_intake_lost(instance: &str) {
    let mut all = INTAKE_LOSSES.lock().unwrap_or_else(|p| p.into_inner());
    let losses = all.entry(instance.to_owned()).or_default();
    losses.push_back(Instant::now());
    while losses.len() > INTAKE_LOSSES_KEPT {
        losses.pop_front();
    }
}

/// The keys of the input messages whose forward this process may have published and whose ack
/// may not reach the broker, for [`crate::intake_reports::IntakeReports::report`]: every outcome
/// publish under way and handed to the broker ([`OutcomeInFlight`], [`note_sending`]: a forward
/// whose delivery is then acked on a closed channel), every one that ended with its outcome
/// unknown (no confirm in time, a failed earlier publish on its channel) within
/// [`REDELIVERY_WINDOW`], and every confirmed forward whose ack
/// is under way or failed within [`REDELIVERY_WINDOW`]; after a loss (`lost`), also those whose
/// ack completed within [`ACK_LOSS_WINDOW`] (after a stop, whose channel closed after its acks,
/// those reached the broker). Keys of partition outcomes come along; no input message has them.
pub fn maybe_forwarded(lost: bool) -> Vec<u128> {
    let now = Instant::now();
    let mut keys: Vec<u128> = OUTCOMES_IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner()).iter().filter(|(_, (_, _, sent))| *sent).map(|(k, _)| *k).collect();
    let unknown = MAYBE_PUBLISHED.lock().unwrap_or_else(|p| p.into_inner());
    keys.extend(unknown.map.iter().filter(|(_, at)| now.saturating_duration_since(**at) <= REDELIVERY_WINDOW).map(|(k, _)| *k));
    drop(unknown);
    let acks = INPUT_ACKS.lock().unwrap_or_else(|p| p.into_inner());
    keys.extend(acks.map.iter().filter(|(_, ack)| maybe_unacked(**ack, lost, now)).map(|(k, _)| *k));
    drop(acks);
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// Whether an input ack in state `ack` may not have reached the broker at `now` ([`maybe_forwarded`]).
fn maybe_unacked(ack: InputAck, lost: bool, now: Instant) -> bool {
    match ack {
        InputAck::Unsettled(since) => now.saturating_duration_since(since) <= REDELIVERY_WINDOW,
        InputAck::Completed(at) => lost && now.saturating_duration_since(at) <= ACK_LOSS_WINDOW,
    }
}

/// What the router of `instance` knows of the input ack of its earlier confirmed forward of a
/// message alike to a redelivered one ([`earlier_input_ack`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EarlierAck {
    /// The ack may have been lost, recently: the redelivery is the copy of that forward.
    MaybeLost,
    /// The ack reached the broker: the redelivery is another message, published again by its
    /// publisher and delivered twice for a fault of its own delivery.
    Reached,
    /// Nothing recent: the redelivery may be a copy of another router's forward.
    Unknown,
}

/// What the router of `instance` knows of the input ack of its last confirmed forward of the
/// message with `key`: [`EarlierAck::MaybeLost`] when the ack is under way or failed, or completed
/// less than [`ACK_LOSS_WINDOW`] before an intake loss, within the last [`REDELIVERY_WINDOW`];
/// [`EarlierAck::Reached`] when it completed and no intake loss followed within
/// [`ACK_LOSS_WINDOW`]; else [`EarlierAck::Unknown`]. Observed before (when every alike message
/// counted as a copy): a publisher that sent 20 requests again, alike in id, body and properties,
/// a few seconds after their first answers, with an unreadable message ahead of them (which
/// closes the intake connection): all 20 were acked as copies and got neither a result nor a
/// dead letter.
pub fn earlier_input_ack(key: u128, instance: &str) -> EarlierAck {
    let ack = INPUT_ACKS.lock().unwrap_or_else(|p| p.into_inner()).map.get(&key).copied();
    let losses = INTAKE_LOSSES.lock().unwrap_or_else(|p| p.into_inner());
    input_ack_state(ack, losses.get(instance).into_iter().flatten().copied(), Instant::now())
}

/// [`earlier_input_ack`] at `now` for the ack state `ack` and the intake losses `losses`.
fn input_ack_state(ack: Option<InputAck>, losses: impl Iterator<Item = Instant>, now: Instant) -> EarlierAck {
    let recent = |at: Instant| now.saturating_duration_since(at) <= REDELIVERY_WINDOW;
    match ack {
        None => EarlierAck::Unknown,
        Some(InputAck::Unsettled(since)) if recent(since) => EarlierAck::MaybeLost,
        Some(InputAck::Unsettled(_)) => EarlierAck::Unknown,
        Some(InputAck::Completed(at)) => match losses.filter(|&lost| lost >= at && lost.saturating_duration_since(at) <= ACK_LOSS_WINDOW).max() {
            None => EarlierAck::Reached,
            Some(lost) if recent(lost) => EarlierAck::MaybeLost,
            Some(_) => EarlierAck::Unknown,
        },
    }
}

/// Returns of a message, by key ([`input_key`], [`forward_key`]), that were not its request's
/// fault, though the broker counted them in `x-delivery-count`: see [`note_uncharged_return`].
static UNCHARGED_RETURNS: LazyLock<Mutex<Bounded<u128, u64>>> = LazyLock::new(|| Mutex::new(Bounded::new(LAST_FAILURES_CAPACITY)));

/// Notes that the message with `key` went back to its queue, or is about to, for a fault that is
/// not its request's, where only a charged return was possible: while the broker blocked the
/// publishing connection (a memory or disk alarm: nothing can be published, so the message cannot
/// be put back as a copy, and `amqp.consumer_timeout` returns it anyway), or after an outcome of
/// an earlier delivery whose end is unknown. [`uncharged_returns`] then takes it off the
/// deliveries counted against `amqp.delivery_limit`. In this process only, bounded like the last
/// errors; the broker's own `x-delivery-limit` (`amqp.delivery_limit` + 2) still bounds every
/// message.
pub fn note_uncharged_return(key: u128) {
    let mut all = UNCHARGED_RETURNS.lock().unwrap_or_else(|p| p.into_inner());
    let n = all.map.get(&key).copied().unwrap_or(0);
    all.insert(key, n.saturating_add(1));
}

/// How many returns of the message with `key` were noted uncharged ([`note_uncharged_return`]).
pub fn uncharged_returns(key: u128) -> u64 {
    UNCHARGED_RETURNS.lock().unwrap_or_else(|p| p.into_inner()).map.get(&key).copied().unwrap_or(0)
}

/// Outages of an LLM endpoint that began while a call carrying the request was in flight, by
/// request id: [`note_outage_during_call`].
static OUTAGES_DURING_CALLS: LazyLock<Mutex<Bounded<String, OutagesDuringCalls>>> = LazyLock::new(|| Mutex::new(Bounded::new(LAST_FAILURES_CAPACITY)));

/// What [`note_outage_during_call`] counted for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutagesDuringCalls {
    /// Outages that began during one of its calls.
    pub all: u32,
    /// Those of them that began while it was sent alone.
    pub alone: u32,
}

/// Notes that an LLM endpoint went down (its probe failed) after a call carrying request `id`
/// lost the server during the call ([`crate::llm::LlmError::connection_lost`]), `alone` when the
/// request was sent alone, and returns what was counted for it so far. A request that crashes
/// its server is one of those every time; the others are there by chance. From
/// [`OUTAGES_BEFORE_ISOLATION`] outages on, the partitions send the request alone, one call at a
/// time per endpoint ([`crate::llm::LlmClient::isolated_call_permit`]), and from
/// [`LONE_OUTAGES_BEFORE_CHARGE`] outages while alone on, an outage during such a call charges
/// it a delivery. In this process only, bounded like the last errors.
pub fn note_outage_during_call(id: &str, alone: bool) -> OutagesDuringCalls {
    let mut all = OUTAGES_DURING_CALLS.lock().unwrap_or_else(|p| p.into_inner());
    let mut n = all.map.get(id).copied().unwrap_or_default();
    n.all = n.all.saturating_add(1);
    n.alone = n.alone.saturating_add(u32::from(alone));
    all.insert(id.to_owned(), n);
    n
}

/// How many outages began while a call of request `id` was in flight
/// ([`note_outage_during_call`]).
pub fn outages_during_calls(id: &str) -> u32 {
    OUTAGES_DURING_CALLS.lock().unwrap_or_else(|p| p.into_inner()).map.get(id).map_or(0, |n| n.all)
}

/// Forgets the outages noted for request `id` (it was answered): its counts are set to 0, so
/// the entry keeps its age in the table.
pub fn forget_outages_during_calls(id: &str) {
    if let Some(n) = OUTAGES_DURING_CALLS.lock().unwrap_or_else(|p| p.into_inner()).map.get_mut(id) {
        *n = OutagesDuringCalls::default();
    }
}

/// From this many outages during its calls ([`note_outage_during_call`]), a request is sent
/// alone, one call at a time per endpoint: the server went down twice while it was in flight (a
/// restart of the server under load puts every request in flight at one outage; those are not
/// slowed down).
pub const OUTAGES_BEFORE_ISOLATION: u32 = 2;

/// From this many outages while it was sent alone ([`note_outage_during_call`]), an outage during
/// a request's lone call charges it a delivery instead of leaving it to wait uncharged. Two, not
/// one: a server that goes down for its own reasons now and then meets whichever request is
/// alone in flight at that moment, and rarely the same one twice; a request that crashes the
/// server meets every outage. Such a request is then dead-lettered at `amqp.delivery_limit`, after
/// about as many crashes as deliveries plus three, instead of crashing every restart of the
/// server for ever.
pub const LONE_OUTAGES_BEFORE_CHARGE: u32 = 2;

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, ShortString};
    use xxhash_rust::xxh3::xxh3_64;

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
        assert!(LAST_FAILURES.lock().unwrap().map.len() <= LAST_FAILURES_CAPACITY);
    }

    /// A fingerprint of `id` and `body` for these tests.
    fn fp(id: &str, body: &[u8]) -> u128 {
        xxh3_128_with_seed(body, xxh3_64(id.as_bytes()))
    }

    #[test]
    fn only_a_fresh_forward_of_a_redelivered_input_message_is_a_second_copy() {
        let mut marked = FieldTable::default();
        marked.insert(ShortString::from(HEADER_INPUT_REDELIVERED), AMQPValue::LongString("1".into()));
        let marked = Some(&marked);
        let mut t = RecentSet::new(100);
        let mut is_second_copy = |id: &str, body: &[u8], redelivered: bool, headers: Option<&FieldTable>| t.is_second_copy(fp(id, body), redelivered, headers, Instant::now());
        let body = br#"{"id":"copy-test-1","prompt":"p"}"#;
        assert!(!is_second_copy("copy-test-1", body, false, None), "the first copy taken is processed");
        assert!(is_second_copy("copy-test-1", body, false, marked), "a marked fresh copy of a request taken before");
        assert!(!is_second_copy("copy-test-1", body, false, None), "a publisher's own repeat is processed");
        assert!(!is_second_copy("copy-test-1", body, true, marked), "the partition queue delivered it before: its earlier delivery did not end");
        assert!(is_second_copy("copy-test-1", body, false, None), "a marked copy was taken since");
        assert!(!is_second_copy("copy-test-3", body, false, marked), "the first copy taken is processed, marked or not");
        assert!(!is_second_copy("copy-test-1", br#"{"id":"copy-test-1","prompt":"q"}"#, false, marked), "another body under the same id");
        assert!(!is_second_copy("copy-test-2", body, false, marked), "the same body under another id");
        let mut zero = FieldTable::default();
        zero.insert(ShortString::from(HEADER_INPUT_REDELIVERED), AMQPValue::LongString("0".into()));
        assert!(!is_second_copy("copy-test-4", body, false, None));
        assert!(!is_second_copy("copy-test-4", body, false, Some(&zero)), "x-input-redelivered 0 is no mark");
    }

    #[test]
    fn an_unmarked_copy_behind_a_marked_one_is_a_second_copy_unless_put_back() {
        let header = |k: &str, v: &str| {
            let mut h = FieldTable::default();
            h.insert(ShortString::from(k), AMQPValue::LongString(v.into()));
            h
        };
        let marked = header(HEADER_INPUT_REDELIVERED, "1");
        let put_back = header(HEADER_EARLIER_DELIVERIES, "0");
        let mut t = RecentSet::new(100);
        let body = b"{}";
        assert!(!t.is_second_copy(fp("late", body), false, None, Instant::now()), "the publisher's first and second publish");
        assert!(!t.is_second_copy(fp("late", body), false, None, Instant::now()));
        assert!(!t.is_second_copy(fp("race", body), false, Some(&marked), Instant::now()), "the marked copy reached the queue first");
        assert!(!t.is_second_copy(fp("race", body), false, Some(&put_back), Instant::now()), "put back uncharged: always processed");
        assert!(t.is_second_copy(fp("race", body), false, None, Instant::now()), "the first router's late forward");
        assert!(!t.is_second_copy(fp("race", body), true, None, Instant::now()), "delivered again by the partition queue");
        assert!(t.is_second_copy(fp("race", body), false, Some(&marked), Instant::now()));
        // A marked copy dropped is not noted as taken: a later repeat of the publisher is processed.
        assert!(!t.is_second_copy(fp("dropped", body), false, None, Instant::now()));
        assert!(t.is_second_copy(fp("dropped", body), false, Some(&marked), Instant::now()));
        assert!(!t.is_second_copy(fp("dropped", body), false, None, Instant::now()));
    }

    /// A copy marked `1` counts as a second copy only within [`SECOND_COPY_WINDOW`] of the
    /// request's take (and an unmarked one behind it likewise); one marked
    /// [`MARK_FORWARDED_MAYBE`] without a window. Observed before: a publisher's resend of 20
    /// messages alike to 20 answered seconds or minutes before, delivered twice behind an
    /// unreadable message, was dropped as copies: no result, no dead letter.
    #[test]
    fn a_copy_marked_redelivered_counts_only_within_the_window() {
        let header = |v: &str| {
            let mut h = FieldTable::default();
            h.insert(ShortString::from(HEADER_INPUT_REDELIVERED), AMQPValue::LongString(v.into()));
            h
        };
        let (marked, forwarded) = (header("1"), header("2"));
        let mut t = RecentSet::new(100);
        let t0 = Instant::now();
        let later = t0 + SECOND_COPY_WINDOW + Duration::from_millis(1);
        let body = b"{}";
        assert!(!t.is_second_copy(fp("w-1", body), false, None, t0));
        assert!(t.is_second_copy(fp("w-1", body), false, Some(&marked), t0 + SECOND_COPY_WINDOW), "within the window");
        assert!(!t.is_second_copy(fp("w-2", body), false, None, t0));
        assert!(!t.is_second_copy(fp("w-2", body), false, Some(&marked), later), "a resend past the window is processed");
        assert!(!t.is_second_copy(fp("w-3", body), false, None, t0));
        assert!(t.is_second_copy(fp("w-3", body), false, Some(&forwarded), later), "a forward that may be in the queue: no window");
        // Unmarked behind a marked copy.
        assert!(!t.is_second_copy(fp("w-4", body), false, Some(&marked), t0));
        assert!(t.is_second_copy(fp("w-4", body), false, None, t0 + Duration::from_secs(1)));
        assert!(!t.is_second_copy(fp("w-5", body), false, Some(&marked), t0));
        assert!(!t.is_second_copy(fp("w-5", body), false, None, later), "past the window");
        assert!(!t.is_second_copy(fp("w-6", body), false, Some(&forwarded), t0));
        assert!(t.is_second_copy(fp("w-6", body), false, None, later), "behind a copy marked 2: no window");
    }

    /// What a router knows of the ack of its earlier forward of a message alike to a redelivered
    /// one: lost maybe (under way, failed, or an intake loss right after it), within
    /// [`REDELIVERY_WINDOW`]; reached (no loss right after it); else unknown.
    #[test]
    fn an_earlier_input_ack_is_maybe_lost_only_just_before_an_intake_loss() {
        let t0 = Instant::now();
        let s = |ack: Option<InputAck>, losses: &[Instant], now: Instant| input_ack_state(ack, losses.iter().copied(), now);
        let later = t0 + REDELIVERY_WINDOW + Duration::from_secs(1);
        assert_eq!(s(None, &[], t0), EarlierAck::Unknown, "forgotten, or never forwarded here");
        assert_eq!(s(Some(InputAck::Unsettled(t0)), &[], t0 + Duration::from_secs(1)), EarlierAck::MaybeLost, "under way or failed");
        assert_eq!(s(Some(InputAck::Unsettled(t0)), &[], later), EarlierAck::Unknown, "failed long ago");
        let done = Some(InputAck::Completed(t0));
        assert_eq!(s(done, &[], later), EarlierAck::Reached);
        let far = t0 + ACK_LOSS_WINDOW + Duration::from_millis(1);
        assert_eq!(s(done, &[t0 - Duration::from_secs(1), far], t0 + Duration::from_secs(5)), EarlierAck::Reached, "losses before it, or long after");
        let near = t0 + Duration::from_millis(300);
        assert_eq!(s(done, &[near], t0 + Duration::from_secs(5)), EarlierAck::MaybeLost, "lost right after the ack");
        assert_eq!(s(done, &[near], near + REDELIVERY_WINDOW + Duration::from_secs(1)), EarlierAck::Unknown, "that loss is long past");
    }

    /// What a router reports as maybe forwarded when it lost its intake, or stopped: an ack
    /// under way or failed within [`REDELIVERY_WINDOW`]; after a loss, also one completed within
    /// [`ACK_LOSS_WINDOW`] before it (after a stop, the channel closed after its acks).
    #[test]
    fn a_report_names_the_acks_that_may_not_have_reached_the_broker() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_millis(s);
        assert!(maybe_unacked(InputAck::Unsettled(t0), false, at(1_000)), "under way at a stop");
        assert!(maybe_unacked(InputAck::Unsettled(t0), true, at(29_000)), "failed 29 s ago");
        assert!(!maybe_unacked(InputAck::Unsettled(t0), true, t0 + REDELIVERY_WINDOW + Duration::from_secs(1)), "failed long ago");
        assert!(maybe_unacked(InputAck::Completed(t0), true, at(1_500)), "completed just before the loss");
        assert!(!maybe_unacked(InputAck::Completed(t0), true, t0 + ACK_LOSS_WINDOW + Duration::from_millis(1)), "completed before that");
        assert!(!maybe_unacked(InputAck::Completed(t0), false, at(100)), "completed before a stop's close");
    }

    /// A forward in flight is reported as maybe forwarded only once it was handed to the broker:
    /// one begun whose delivery's channel closes before its publish is never published.
    #[test]
    fn a_forward_in_flight_is_reported_once_it_is_sent() {
        let key = fp("reported-once-sent", b"b");
        let in_flight = OutcomeInFlight::begin(key);
        assert!(!maybe_forwarded(true).contains(&key), "begun, not sent");
        note_sending(key);
        assert!(maybe_forwarded(true).contains(&key), "sent");
        in_flight.refused();
        assert!(!maybe_forwarded(true).contains(&key), "refused: in no queue");
        note_sending(key);
        assert!(!maybe_forwarded(true).contains(&key), "nothing in flight");
    }

    #[test]
    fn the_recent_requests_are_bounded_and_the_oldest_forgotten() {
        let mut marked = FieldTable::default();
        marked.insert(ShortString::from(HEADER_INPUT_REDELIVERED), AMQPValue::LongString("1".into()));
        let mut t = RecentSet::new(1000);
        assert!(!t.is_second_copy(fp("recent-first", b"b"), false, None, Instant::now()));
        for i in 0..1000 {
            t.is_second_copy(fp(&format!("recent-{i}"), b"b"), false, None, Instant::now());
        }
        assert!(!t.is_second_copy(fp("recent-first", b"b"), false, Some(&marked), Instant::now()), "the oldest is forgotten");
        assert!(t.is_second_copy(fp("recent-999", b"b"), false, Some(&marked), Instant::now()));
        assert!(t.is_second_copy(fp("recent-5", b"b"), false, Some(&marked), Instant::now()));
        assert!(t.map.len() <= 1000 && t.order.len() <= 1000);
    }

    /// Headers with [`HEADER_FORWARD_ID`] `f`.
    fn with_forward_id(f: &str) -> FieldTable {
        let mut h = FieldTable::default();
        h.insert(ShortString::from(HEADER_FORWARD_ID), AMQPValue::LongString(f.into()));
        h
    }

    #[test]
    fn a_forward_published_again_is_a_second_copy_but_its_redelivery_is_not() {
        let (a, b) = (with_forward_id("sent-again-test-a"), with_forward_id("sent-again-test-b"));
        let mut t = RecentSet::new(100);
        let req = fp("sent-again-1", b"body");
        assert!(!t.is_second_copy(req, false, Some(&a), Instant::now()), "the first copy taken is processed");
        // Observed: the router's forward got no confirm in time (or a nack, or an earlier publish
        // on its channel failed) though the broker had enqueued it; its second publish, the same
        // properties, was processed too and answered twice, counted nowhere.
        assert!(t.is_second_copy(req, false, Some(&a), Instant::now()), "the same forward, published again");
        assert!(!t.is_second_copy(req, true, Some(&a), Instant::now()), "the partition queue delivers it again: its earlier delivery did not end");
        assert!(!t.is_second_copy(req, false, Some(&b), Instant::now()), "another forward of the request (a publisher's own repeat)");
        let other = fp("sent-again-2", b"body");
        assert!(!t.is_second_copy(other, false, Some(&a), Instant::now()), "another request under the same forward id (published straight to the queue)");
        assert!(!t.is_second_copy(fp("sent-again-3", b"body"), false, None, Instant::now()), "no forward id");
    }

    #[test]
    fn only_a_redelivery_of_an_answered_forward_was_answered_before() {
        let (answered, other) = (with_forward_id("answered-before-test-1"), with_forward_id("answered-before-test-2"));
        let mut t = AnsweredSet::new(100);
        t.insert(forward_fingerprint(Some(&answered)).unwrap(), ());
        assert!(t.answered_before(true, Some(&answered)));
        assert!(!t.answered_before(false, Some(&answered)), "a first delivery (one published again is `is_second_copy`'s)");
        assert!(!t.answered_before(true, Some(&other)), "another forward");
        assert!(!t.answered_before(true, None), "no forward id: published straight to the partition queue");
        note_answered(Some(&answered));
        note_answered(None);
        assert!(answered_before(true, Some(&answered)) && !answered_before(true, Some(&other)));
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

    /// A redelivery waits for the outcome publish in flight, and learns how it ended: confirmed,
    /// refused, or neither (told once).
    #[tokio::test]
    async fn a_redelivery_waits_for_the_outcome_in_flight_and_learns_its_end() {
        let key = |n: u128| input_key(0x1234_5678 + n);
        assert_eq!(earlier_outcome(key(1)).await, Earlier::Nothing, "nothing published");

        let confirmed = OutcomeInFlight::begin(key(1));
        let second = OutcomeInFlight::begin(key(1));
        assert!(outcome_in_flight(key(1)));
        let waiter = tokio::spawn(earlier_outcome(key(1)));
        tokio::task::yield_now().await;
        second.refused();
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one publish of the two is still in flight");
        confirmed.confirmed();
        assert_eq!(waiter.await.unwrap(), Earlier::Confirmed);
        assert!(!outcome_in_flight(key(1)));
        assert_eq!(earlier_outcome(key(1)).await, Earlier::Confirmed, "kept");

        OutcomeInFlight::begin(key(2)).refused();
        assert_eq!(earlier_outcome(key(2)).await, Earlier::Nothing, "a refused publish is in no queue");

        drop(OutcomeInFlight::begin(key(3)));
        assert_eq!(earlier_outcome(key(3)).await, Earlier::Maybe, "neither confirmed nor refused");
        assert_eq!(earlier_outcome(key(3)).await, Earlier::Nothing, "told once");

        // A partition's outcome is confirmed by `note_answered` before the publish ends.
        let mut headers = FieldTable::default();
        headers.insert(ShortString::from(HEADER_FORWARD_ID), AMQPValue::LongString("0123456789abcdef0123456789abcdef".into()));
        let fwd = forward_key(Some(&headers)).unwrap();
        let result = OutcomeInFlight::begin(fwd);
        note_answered(Some(&headers));
        drop(result);
        assert_eq!(earlier_outcome(fwd).await, Earlier::Confirmed);
        assert_eq!(forward_key(None), None);
    }

    #[test]
    fn uncharged_returns_are_counted_per_key() {
        let key = input_key(0xfeed_0001);
        assert_eq!(uncharged_returns(key), 0);
        note_uncharged_return(key);
        note_uncharged_return(key);
        assert_eq!(uncharged_returns(key), 2);
        assert_eq!(uncharged_returns(input_key(0xfeed_0002)), 0);
        assert_ne!(input_key(7), 7, "told apart from forward keys");
    }
}
