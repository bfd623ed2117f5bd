//! Per-key batching with a flush timeout: the BATCHER stage of one owned partition.
//!
//! A [`Batcher`] keeps one buffer per prefix key and hands a buffer back as a [`Batch`] when
//!
//! - it reaches `max_batch_size` items ([`FlushReason::Size`], returned by [`Batcher::push`]),
//! - its *first* item is `max_batch_wait` old ([`FlushReason::Timeout`], [`Batcher::flush_expired`]),
//! - all buffers together hold `max_buffered` items, the partition's prefetch: no further delivery
//!   can arrive before some are settled, so every buffer goes ([`FlushReason::Prefetch`],
//!   [`Batcher::flush_full`]),
//! - the instance's byte budget is spent (the driver's `budget_spent` signal): every buffer goes
//!   ([`FlushReason::ByteBudget`]),
//! - the partition shuts down or is revoked ([`FlushReason::Shutdown`] / [`FlushReason::Revoke`],
//!   [`Batcher::drain`]).
//!
//! It is pure: no I/O, no clock, no tasks. The caller passes `now` in, so every rule is unit-tested
//! with exact instants. [`run`] is the thin async driver that feeds it from a channel under
//! `tokio::time` (so tests run it under `tokio::time::pause()`).
//!
//! Timers: unlike Vector's `partitioned_batcher` (one timer per key) there is exactly one deadline
//! the driver sleeps on. `max_batch_wait` is the same for every key, so buffers expire in the order
//! their first items arrived; an ordered index `(first arrival, sequence) → key` yields the next
//! deadline in O(log n) (n = keys with a buffer). Size flushes remove buffers from the middle of that
//! order, which is why it is an ordered map with eager removal rather than an arrival-ordered queue
//! with lazy deletion: no stale entries, bounded memory whatever the caller does, and an
//! out-of-order `now` cannot corrupt the order. Every operation is O(log n) plus the items it moves.
//!
//! In `[keying] mode = "off"` the caller passes one constant key, so each batch is a mixed batch of
//! the partition (plain competing consumers), while [`purity`] is still measured with the real keys.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::Hash;
use std::num::NonZeroUsize;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Why a batch was flushed; also the `reason` label of `prefix_batcher_batches_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlushReason {
    /// The key's buffer reached `max_batch_size`.
    Size,
    /// The key's first buffered item became `max_batch_wait` old.
    Timeout,
    /// The buffers together held `max_buffered` items (the partition's prefetch): the broker
    /// sends no further delivery until some are settled, so waiting for `max_batch_wait` could
    /// only add latency. Every buffer flushes.
    Prefetch,
    /// The instance's byte budget for held requests (`batching.max_buffered_bytes`) was spent:
    /// no partition accepts a delivery until bytes are given back, so every buffer flushes.
    ByteBudget,
    /// The input ended (graceful shutdown): every partial batch is flushed.
    Shutdown,
    /// The partition's lease was lost or handed over: every partial batch is handed back.
    Revoke,
}

impl FlushReason {
    /// Every reason, in label order; for pre-registering metric label values.
    pub const ALL: [FlushReason; 6] = [
        FlushReason::Size,
        FlushReason::Timeout,
        FlushReason::Prefetch,
        FlushReason::ByteBudget,
        FlushReason::Shutdown,
        FlushReason::Revoke,
    ];

    /// The metric label value: `"size"`, `"timeout"`, `"prefetch"`, `"byte_budget"`, `"shutdown"`
    /// or `"revoke"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            FlushReason::Size => "size",
            FlushReason::Timeout => "timeout",
            FlushReason::Prefetch => "prefetch",
            FlushReason::ByteBudget => "byte_budget",
            FlushReason::Shutdown => "shutdown",
            FlushReason::Revoke => "revoke",
        }
    }
}

impl fmt::Display for FlushReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Batching limits of one partition, already validated by the config loader
/// (`max_batch_wait > 0`, prefetch ≥ `max_batch_size`; DESIGN §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// Items per batch at most; a key's buffer flushes with [`FlushReason::Size`] when it gets there.
    pub max_batch_size: NonZeroUsize,
    /// How long the first item of a buffer may wait before the buffer flushes with
    /// [`FlushReason::Timeout`]. Must be > 0 (a zero wait is rejected at config load).
    pub max_batch_wait: Duration,
    /// Items all buffers together may hold before every buffer flushes with
    /// [`FlushReason::Prefetch`]: the partition consumer's prefetch (`amqp.partition_prefetch`,
    /// AMQP `basic.qos`). When the buffers hold that many deliveries, all unacked, the broker
    /// sends the consumer nothing more until some are settled, so no buffer can grow and each
    /// would only wait out `max_batch_wait` (with many distinct keys per partition: at most
    /// prefetch requests per `max_batch_wait`). `usize::MAX`: no such limit.
    pub max_buffered: usize,
}

/// Items of one key flushed together, in arrival order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch<K, T> {
    /// The key every item was pushed with.
    pub key: K,
    /// The items in the order they were pushed; never empty, at most `max_batch_size` long.
    pub items: Vec<T>,
    /// Why the batch was flushed.
    pub reason: FlushReason,
    /// Arrival (the `now` given to [`Batcher::push`]) of the first item.
    pub oldest: Instant,
}

/// Entries beyond this are not preallocated per buffer, so a large `max_batch_size` with many
/// small batches does not reserve memory it never uses.
const INITIAL_BUFFER_CAPACITY: usize = 16;

/// How far off a deadline is taken to be when `first arrival + max_batch_wait` overflows
/// `Instant` (an absurd configured wait); the same horizon tokio uses for "never".
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// One key's partial batch.
#[derive(Debug)]
struct Buffer<T> {
    items: Vec<T>,
    /// Arrival of the first item: the buffer's deadline is `oldest + max_batch_wait`.
    oldest: Instant,
    /// Tie-breaker in `Batcher::by_age`, so buffers created at the same instant stay FIFO.
    seq: u64,
}

/// Per-key buffers of one partition with a size limit and a flush timeout; pure, no I/O, no clock.
///
/// `K` is the prefix key (`Eq + Hash + Clone`; it is stored twice, in the buffer map and the age
/// index, so it should be cheap to clone), `T` the buffered item.
#[derive(Debug)]
pub struct Batcher<K, T> {
    cfg: BatchConfig,
    buffers: HashMap<K, Buffer<T>>,
    /// `(first arrival, seq) → key` for every buffer: the first entry expires first.
    by_age: BTreeMap<(Instant, u64), K>,
    next_seq: u64,
    /// Items over all buffers, kept so [`Batcher::buffered`] is O(1).
    buffered: usize,
}

impl<K, T> Batcher<K, T>
where
    K: Eq + Hash + Clone,
{
    /// An empty batcher.
    pub fn new(cfg: BatchConfig) -> Self {
        Batcher {
            cfg,
            buffers: HashMap::new(),
            by_age: BTreeMap::new(),
            next_seq: 0,
            buffered: 0,
        }
    }

    /// Adds `item`, which arrived at `now`, to `key`'s buffer, after the items already there.
    ///
    /// Returns the buffer as a [`FlushReason::Size`] batch when this item fills it to
    /// `max_batch_size`; the key's next item then starts a new buffer with a new deadline.
    /// The first item of a buffer fixes its deadline (`now + max_batch_wait`); later items never
    /// extend it. Expiry is not checked here: call [`Batcher::flush_expired`] at the deadline.
    pub fn push(&mut self, key: K, item: T, now: Instant) -> Option<Batch<K, T>> {
        let max = self.cfg.max_batch_size.get();
        match self.buffers.entry(key) {
            Entry::Occupied(mut entry) => {
                let buffer = entry.get_mut();
                buffer.items.push(item);
                if buffer.items.len() < max {
                    self.buffered += 1;
                    return None;
                }
                let (key, buffer) = entry.remove_entry();
                self.by_age.remove(&(buffer.oldest, buffer.seq));
                // The new item was never counted; the others were.
                self.buffered -= buffer.items.len() - 1;
                Some(Batch {
                    key,
                    items: buffer.items,
                    reason: FlushReason::Size,
                    oldest: buffer.oldest,
                })
            }
            Entry::Vacant(entry) if max == 1 => Some(Batch {
                key: entry.into_key(),
                items: vec![item],
                reason: FlushReason::Size,
                oldest: now,
            }),
            Entry::Vacant(entry) => {
                let seq = self.next_seq;
                self.next_seq += 1;
                self.by_age.insert((now, seq), entry.key().clone());
                let mut items = Vec::with_capacity(max.min(INITIAL_BUFFER_CAPACITY));
                items.push(item);
                entry.insert(Buffer {
                    items,
                    oldest: now,
                    seq,
                });
                self.buffered += 1;
                None
            }
        }
    }

    /// The earliest deadline over all buffers (first-item arrival + `max_batch_wait`), for the
    /// caller's `sleep_until`; `None` when nothing is buffered.
    pub fn next_deadline(&self) -> Option<Instant> {
        let wait = self.cfg.max_batch_wait;
        self.by_age.first_key_value().map(|(&(oldest, _), _)| {
            oldest
                .checked_add(wait)
                .or_else(|| oldest.checked_add(FAR_FUTURE))
                .unwrap_or(oldest)
        })
    }

    /// Removes and returns, as [`FlushReason::Timeout`] batches, every buffer whose deadline is
    /// `<= now` (its first item is at least `max_batch_wait` old), oldest first. Empty when none is
    /// due; O(log n) per flushed buffer plus one comparison.
    pub fn flush_expired(&mut self, now: Instant) -> Vec<Batch<K, T>> {
        self.flush_expired_up_to(now, usize::MAX)
    }

    /// As [`Batcher::flush_expired`], but at most `limit` buffers, the oldest; the other due
    /// buffers stay, keep taking items of their keys (a full one flushes with
    /// [`FlushReason::Size`]) and are due at every later call.
    pub fn flush_expired_up_to(&mut self, now: Instant, limit: usize) -> Vec<Batch<K, T>> {
        let mut flushed = Vec::new();
        while flushed.len() < limit && self.has_expired(now) {
            let Some(entry) = self.by_age.first_entry() else { break };
            let key = entry.remove();
            flushed.extend(self.take(key, FlushReason::Timeout));
        }
        flushed
    }

    /// Whether a buffer is due at `now`: its first item is at least `max_batch_wait` old.
    pub fn has_expired(&self, now: Instant) -> bool {
        let wait = self.cfg.max_batch_wait;
        // Compared as an age, so a wait too large for `Instant` never overflows.
        self.by_age
            .first_key_value()
            .is_some_and(|(&(oldest, _), _)| now.checked_duration_since(oldest).is_some_and(|age| age >= wait))
    }

    /// When the buffers hold at least `max_buffered` items, removes and returns every buffer,
    /// oldest first, as [`FlushReason::Prefetch`] batches; else nothing. Call it after
    /// [`Batcher::push`].
    pub fn flush_full(&mut self) -> Vec<Batch<K, T>> {
        if self.buffered < self.cfg.max_buffered {
            return Vec::new();
        }
        self.drain(FlushReason::Prefetch)
    }

    /// Removes and returns every buffer, oldest first, each as a batch with `reason` (meant for
    /// [`FlushReason::Shutdown`] and [`FlushReason::Revoke`]). Leaves the batcher empty.
    pub fn drain(&mut self, reason: FlushReason) -> Vec<Batch<K, T>> {
        let by_age = std::mem::take(&mut self.by_age);
        let drained = by_age
            .into_values()
            .filter_map(|key| self.take(key, reason))
            .collect();
        debug_assert!(self.buffers.is_empty() && self.buffered == 0);
        drained
    }

    /// Items buffered over all keys (the `buffered_requests` gauge).
    pub fn buffered(&self) -> usize {
        self.buffered
    }

    /// Age at `now` of the oldest buffered item (the `oldest_buffered_age_seconds` gauge); zero if
    /// `now` is before its arrival, `None` when nothing is buffered.
    pub fn oldest_age(&self, now: Instant) -> Option<Duration> {
        self.by_age
            .first_key_value()
            .map(|(&(oldest, _), _)| now.saturating_duration_since(oldest))
    }

    /// True when no item is buffered.
    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    /// Removes `key`'s buffer (already removed from `by_age`) as a batch.
    fn take(&mut self, key: K, reason: FlushReason) -> Option<Batch<K, T>> {
        let buffer = self.buffers.remove(&key);
        debug_assert!(buffer.is_some(), "age index and buffers disagree");
        let buffer = buffer?;
        self.buffered -= buffer.items.len();
        Some(Batch {
            key,
            items: buffer.items,
            reason,
            oldest: buffer.oldest,
        })
    }
}

/// What [`run`] asks before a flush by age ([`FlushReason::Timeout`]): whether the LLM server
/// serving the partition has a free call slot (`llm.max_concurrency`), and whether a batch of
/// the partition already waits for one.
///
/// Why: when every call slot is taken (a backlog, a slow server, the queue after an outage), a
/// partial batch flushed at its deadline only waits for a slot, and keeps its deliveries, which
/// hold the partition's prefetch, out of reach of the requests of its key that arrive meanwhile.
/// Each freed slot then brings in a few deliveries, which flush at their own deadline as small
/// batches and wait in turn: batches shrink to one request each and a backlog drains at a
/// fraction of the server's speed (observed: 600 requests, 2 s calls, 4 slots, batches of 8
/// allowed: mean batch size 3.6 in the first 20 s, 1.0 from the second minute, 240 s to drain).
/// So while no slot is free and a batch of the partition waits for one, due buffers stay and
/// keep growing (a full one flushes by size). With no batch of the partition waiting (none under
/// way, or all calling the server), the oldest due buffer goes, so every partition keeps one
/// batch in line, and a batch that takes long (a slow prompt's retries) holds nothing back. A
/// due buffer goes as soon as a slot frees or the partition's batch in line gets its slot.
pub struct CallSlots {
    /// Whether a call to the partition's endpoint would start at once.
    pub free: Box<dyn Fn() -> bool + Send>,
    /// Whether a batch of the partition waits for a call slot.
    pub in_line: Box<dyn Fn() -> bool + Send>,
    /// Changes when the slots or their waiting calls change
    /// ([`crate::llm::LlmClient::call_slots_changed`]).
    pub changed: watch::Receiver<u64>,
    /// Changes when a batch of the partition ends.
    pub ended: watch::Receiver<u64>,
}

impl CallSlots {
    /// How many due buffers may flush now: all with a free slot, the oldest with none free but
    /// no batch of the partition in line, else none.
    fn due_flushes(&self) -> usize {
        if (self.free)() {
            usize::MAX
        } else if !(self.in_line)() {
            1
        } else {
            0
        }
    }
}

/// Waits until the call slots or the partition's batches change; never with no `slots`.
async fn slots_changed(slots: Option<&mut CallSlots>) {
    let Some(slots) = slots else { return std::future::pending().await };
    tokio::select! {
        // A closed sender (the LLM client or the partition gone) changes nothing more: wait on.
        Ok(()) = slots.changed.changed() => {}
        Ok(()) = slots.ended.changed() => {}
        else => std::future::pending().await,
    }
}

/// Flushes the due buffers that `slots` lets go ([`CallSlots`]; all of them without `slots`) and
/// says in `held` whether any stayed.
fn flush_due<K, T>(batcher: &mut Batcher<K, T>, now: Instant, slots: Option<&CallSlots>, held: &mut bool) -> Vec<Batch<K, T>>
where
    K: Eq + Hash + Clone,
{
    let limit = slots.map_or(usize::MAX, CallSlots::due_flushes);
    let flushed = batcher.flush_expired_up_to(now, limit);
    *held = batcher.has_expired(now);
    flushed
}

/// What woke the driver.
enum Event<K, T> {
    Item((K, T)),
    Deadline,
    BudgetSpent,
    InputClosed,
    Revoked,
}

/// Runs a [`Batcher`] over `input` (items arrive as `(key, item)`, stamped with
/// `tokio::time::Instant::now()` on receipt) and sends its batches on `out`.
///
/// - Size batches are sent as soon as they fill; timeout batches at their deadline (one sleep on
///   [`Batcher::next_deadline`], expiry is also checked on every received item, so a busy input
///   cannot starve it), unless `slots` holds them back: while the LLM server has no free call
///   slot and a batch of the partition waits for one, due buffers stay and keep growing, and go
///   when a slot frees or that batch gets its slot ([`CallSlots`]).
/// - When `input` closes (every sender dropped), all partial batches are sent with
///   [`FlushReason::Shutdown`] and `run` returns: nothing sent on `input` is lost.
/// - When `revoke` is cancelled, `input` is closed (later sends fail and give the item back to
///   the sender), the items already queued in it are taken too, and everything is sent as
///   [`FlushReason::Revoke`] batches (size-split as usual) before `run` returns. Revoke batches are
///   handed back, not dropped: the caller decides (nack/requeue or drop) what happens to them.
/// - When `out` is closed, `run` returns at once and drops what it holds.
///
/// Backpressure: while `out` is full `run` waits and reads no input; it does not see `revoke` until
/// the send completes, so the caller keeps receiving from `out` (or drops it) until `run` returns.
/// `on_state(buffered items, age of the oldest buffered item)` is called after every change of the
/// buffers (not periodically) and with `(0, None)` on return, for the `buffered_requests` and
/// `oldest_buffered_age_seconds` gauges. Uses `tokio::time`, so it runs under
/// `tokio::time::pause()` in tests.
pub async fn run<K, T>(
    cfg: BatchConfig,
    mut input: mpsc::Receiver<(K, T)>,
    out: mpsc::Sender<Batch<K, T>>,
    revoke: CancellationToken,
    mut budget_spent: watch::Receiver<u64>,
    mut slots: Option<CallSlots>,
    mut on_state: impl FnMut(usize, Option<Duration>),
) where
    K: Eq + Hash + Clone,
{
    let mut batcher = Batcher::new(cfg);
    // Due buffers held back by `slots`: no deadline to sleep on until the slots change.
    let mut held = false;
    loop {
        let deadline = if held { None } else { batcher.next_deadline() };
        let event = tokio::select! {
            biased;
            () = revoke.cancelled() => Event::Revoked,
            () = crate::task::sleep_until_some(deadline) => Event::Deadline,
            () = slots_changed(slots.as_mut()), if held => Event::Deadline,
            Ok(()) = budget_spent.changed() => Event::BudgetSpent,
            received = input.recv() => received.map_or(Event::InputClosed, Event::Item),
        };
        let now = Instant::now();
        let mut ready = Vec::new();
        let last = match event {
            Event::Item((key, item)) => {
                // Expire first: an item arriving at or after its key's deadline starts a new
                // batch, unless its buffer is held back (then it joins it).
                ready.extend(flush_due(&mut batcher, now, slots.as_ref(), &mut held));
                ready.extend(batcher.push(key, item, now));
                ready.extend(batcher.flush_full());
                false
            }
            Event::Deadline => {
                ready.extend(flush_due(&mut batcher, now, slots.as_ref(), &mut held));
                false
            }
            Event::BudgetSpent => {
                // Items already on their way (sent before the intake found the budget spent) hold
                // bytes too: they go with the rest.
                push_queued(&mut batcher, &mut input, now, &mut ready);
                ready.extend(batcher.drain(FlushReason::ByteBudget));
                false
            }
            Event::InputClosed => {
                ready.extend(batcher.drain(FlushReason::Shutdown));
                true
            }
            Event::Revoked => {
                input.close();
                push_queued(&mut batcher, &mut input, now, &mut ready);
                ready.extend(batcher.drain(FlushReason::Revoke));
                for batch in &mut ready {
                    batch.reason = FlushReason::Revoke;
                }
                true
            }
        };
        // Held only while a held buffer is still there and due (not flushed by size, prefetch,
        // budget or the end).
        held = held && batcher.has_expired(now);
        on_state(batcher.buffered(), batcher.oldest_age(now));
        for batch in ready {
            if out.send(batch).await.is_err() {
                on_state(0, None);
                return;
            }
        }
        if last {
            return;
        }
    }
}

/// Pushes every item already waiting in `input` (without waiting for more), adding the size
/// batches they fill to `ready`.
fn push_queued<K, T>(batcher: &mut Batcher<K, T>, input: &mut mpsc::Receiver<(K, T)>, now: Instant, ready: &mut Vec<Batch<K, T>>)
where
    K: Eq + Hash + Clone,
{
    while let Ok((key, item)) = input.try_recv() {
        ready.extend(batcher.push(key, item, now));
    }
}

/// Batch purity: the share of the batch held by its most common key, in `(0, 1]`
/// (1.0 = every item has the same key; 1/n = n distinct keys). An empty batch counts as pure (1.0).
/// For the `prefix_batcher_batch_purity` histogram; pass the *derived* keys, also in `mode = "off"`.
pub fn purity<K: Eq + Hash>(keys: impl IntoIterator<Item = K>) -> f64 {
    let mut counts: HashMap<K, usize> = HashMap::new();
    let (mut total, mut dominant) = (0usize, 0usize);
    for key in keys {
        let count = counts.entry(key).or_insert(0);
        *count += 1;
        dominant = dominant.max(*count);
        total += 1;
    }
    if total == 0 {
        1.0
    } else {
        dominant as f64 / total as f64
    }
}

/// Shared prefix ratio: the longest common prefix of all `prompts` divided by their mean length,
/// both in characters (Unicode scalar values, as in key derivation), in `[0, 1]`.
/// 1.0 for a single non-empty prompt or identical prompts; 0.0 when the mean length is 0 (empty
/// prompts, or no prompts at all). For the `prefix_batcher_batch_shared_prefix_ratio` histogram.
/// O(total length).
pub fn shared_prefix_ratio<S: AsRef<str>>(prompts: &[S]) -> f64 {
    let Some((first, rest)) = prompts.split_first() else {
        return 0.0;
    };
    let first = first.as_ref();
    let mut common = first.len(); // bytes of `first` shared by every prompt so far
    let mut total_chars = first.chars().count();
    for prompt in rest {
        let prompt = prompt.as_ref();
        total_chars += prompt.chars().count();
        common = common_prefix_bytes(&first[..common], prompt);
    }
    if total_chars == 0 {
        return 0.0;
    }
    let common_chars = first[..common].chars().count();
    let mean_chars = total_chars as f64 / prompts.len() as f64;
    common_chars as f64 / mean_chars
}

/// Length in bytes of the longest common prefix of `a` and `b` that ends on a char boundary.
/// UTF-8 is self-synchronising, so the common *byte* prefix cut back to a char boundary is exactly
/// the common *char* prefix (two chars sharing a lead byte do not count).
fn common_prefix_bytes(a: &str, b: &str) -> usize {
    let mut n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    while !a.is_char_boundary(n) {
        n -= 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::HashSet;

    const WAIT: Duration = Duration::from_millis(1000);
    const MS: Duration = Duration::from_millis(1);

    fn cfg(size: usize, wait: Duration) -> BatchConfig {
        BatchConfig {
            max_batch_size: NonZeroUsize::new(size).unwrap(),
            max_batch_wait: wait,
            max_buffered: usize::MAX,
        }
    }

    fn batcher(size: usize) -> Batcher<&'static str, u32> {
        Batcher::new(cfg(size, WAIT))
    }

    /// Asserts that `b` buffers nothing: no key, no item, no deadline.
    fn assert_holds_nothing(b: &Batcher<&'static str, u32>) {
        assert!(b.is_empty());
        assert_eq!(b.buffered(), 0);
        assert_eq!(b.next_deadline(), None);
    }

    // ---- FlushReason ------------------------------------------------------------------------

    #[test]
    fn flush_reason_labels_are_stable_and_distinct() {
        let labels: Vec<_> = FlushReason::ALL.iter().map(FlushReason::as_str).collect();
        assert_eq!(labels, ["size", "timeout", "prefetch", "byte_budget", "shutdown", "revoke"]);
        assert_eq!(FlushReason::Revoke.to_string(), "revoke");
        let distinct: HashSet<_> = FlushReason::ALL.iter().collect();
        assert_eq!(distinct.len(), 6);
    }

    // ---- Batcher: size ----------------------------------------------------------------------

    #[test]
    fn size_flush_returns_full_batch_in_push_order() {
        let t0 = Instant::now();
        let mut b = batcher(3);
        assert!(b.push("a", 1, t0).is_none());
        assert!(b.push("a", 2, t0 + MS).is_none());
        let batch = b.push("a", 3, t0 + 2 * MS).expect("full");
        assert_eq!(batch.key, "a");
        assert_eq!(batch.items, [1, 2, 3]);
        assert_eq!(batch.reason, FlushReason::Size);
        assert_eq!(batch.oldest, t0);
        assert_holds_nothing(&b);
    }

    #[test]
    fn max_batch_size_one_flushes_every_push() {
        let t0 = Instant::now();
        let mut b = batcher(1);
        for i in 0..3 {
            let batch = b.push("a", i, t0 + MS * i).expect("size 1 flushes at once");
            assert_eq!(batch.items, [i]);
            assert_eq!(batch.reason, FlushReason::Size);
            assert_eq!(batch.oldest, t0 + MS * i);
            assert_holds_nothing(&b);
        }
    }

    #[test]
    fn size_flush_at_the_deadline_instant_is_a_size_flush() {
        let t0 = Instant::now();
        let mut b = batcher(2);
        b.push("a", 1, t0);
        let batch = b.push("a", 2, t0 + WAIT).expect("full");
        assert_eq!(batch.reason, FlushReason::Size);
        assert!(b.flush_expired(t0 + WAIT).is_empty());
    }

    // ---- Batcher: timeout -------------------------------------------------------------------

    #[test]
    fn timeout_flush_exactly_at_max_batch_wait_not_before() {
        let t0 = Instant::now();
        let mut b = batcher(10);
        b.push("a", 1, t0);
        b.push("a", 2, t0 + 10 * MS);
        assert_eq!(b.next_deadline(), Some(t0 + WAIT));
        assert!(b.flush_expired(t0 + WAIT - MS).is_empty(), "1 ms early");
        assert!(
            b.flush_expired(t0 + WAIT - Duration::from_nanos(1))
                .is_empty(),
            "1 ns early"
        );
        assert_eq!(b.buffered(), 2);
        let flushed = b.flush_expired(t0 + WAIT);
        assert_eq!(flushed.len(), 1);
        assert_eq!(flushed[0].items, [1, 2]);
        assert_eq!(flushed[0].reason, FlushReason::Timeout);
        assert_eq!(flushed[0].oldest, t0);
        assert!(b.is_empty());
        assert_eq!(b.next_deadline(), None);
    }

    #[test]
    fn late_flush_expired_still_flushes_overdue_buffers() {
        let t0 = Instant::now();
        let mut b = batcher(10);
        b.push("a", 1, t0);
        let flushed = b.flush_expired(t0 + 5 * WAIT);
        assert_eq!(flushed.len(), 1);
        assert_eq!(flushed[0].reason, FlushReason::Timeout);
    }

    #[test]
    fn later_items_do_not_extend_the_deadline() {
        let t0 = Instant::now();
        let mut b = batcher(10);
        b.push("a", 1, t0);
        b.push("a", 2, t0 + WAIT - MS);
        assert_eq!(b.next_deadline(), Some(t0 + WAIT));
        let flushed = b.flush_expired(t0 + WAIT);
        assert_eq!(flushed[0].items, [1, 2]);
    }

    #[test]
    fn flush_expired_returns_only_due_buffers_oldest_first() {
        let t0 = Instant::now();
        let mut b = batcher(10);
        b.push("c", 30, t0 + 2 * MS);
        b.push("a", 10, t0);
        b.push("b", 20, t0 + MS);
        b.push("d", 40, t0 + 3 * MS);
        let flushed = b.flush_expired(t0 + WAIT + 2 * MS);
        let keys: Vec<_> = flushed.iter().map(|x| x.key).collect();
        assert_eq!(keys, ["a", "b", "c"]);
        assert!(flushed.iter().all(|x| x.reason == FlushReason::Timeout));
        assert_eq!(b.buffered(), 1);
        assert_eq!(b.next_deadline(), Some(t0 + 3 * MS + WAIT));
    }

    #[test]
    fn flush_expired_on_empty_batcher_is_empty() {
        let mut b = batcher(3);
        assert!(b.flush_expired(Instant::now() + WAIT).is_empty());
        assert!(b.is_empty());
    }

    #[test]
    fn buffers_created_at_the_same_instant_keep_arrival_order() {
        let t0 = Instant::now();
        let mut b = batcher(10);
        for key in ["z", "m", "a", "q"] {
            b.push(key, 0, t0);
        }
        let keys: Vec<_> = b.flush_expired(t0 + WAIT).iter().map(|x| x.key).collect();
        assert_eq!(keys, ["z", "m", "a", "q"]);
    }

    // ---- Batcher: per-key isolation -----------------------------------------------------------

    #[test]
    fn full_key_does_not_flush_other_keys_and_their_deadlines_stand() {
        let t0 = Instant::now();
        let mut b = batcher(2);
        b.push("b", 100, t0);
        b.push("a", 1, t0 + 5 * MS);
        let full = b.push("a", 2, t0 + 6 * MS).expect("a is full");
        assert_eq!(full.key, "a");
        assert_eq!(full.items, [1, 2]);
        // b is untouched, with its own deadline from its own first item.
        assert_eq!(b.buffered(), 1);
        assert_eq!(b.next_deadline(), Some(t0 + WAIT));
        assert!(b.flush_expired(t0 + WAIT - MS).is_empty());
        let flushed = b.flush_expired(t0 + WAIT);
        assert_eq!(flushed.len(), 1);
        assert_eq!(flushed[0].key, "b");
        assert_eq!(flushed[0].items, [100]);
    }

    #[test]
    fn items_of_other_keys_never_join_a_batch() {
        let t0 = Instant::now();
        let mut b = batcher(3);
        assert!(b.push("a", 1, t0).is_none());
        assert!(b.push("b", 2, t0).is_none());
        assert!(b.push("a", 3, t0).is_none());
        assert!(b.push("b", 4, t0).is_none());
        let a = b.push("a", 5, t0).expect("a full");
        assert_eq!((a.key, a.items), ("a", vec![1, 3, 5]));
        let b_batch = b.push("b", 6, t0).expect("b full");
        assert_eq!((b_batch.key, b_batch.items), ("b", vec![2, 4, 6]));
    }

    #[test]
    fn key_flushed_on_size_starts_a_fresh_deadline_with_its_next_item() {
        let t0 = Instant::now();
        let mut b = batcher(2);
        b.push("a", 1, t0);
        b.push("a", 2, t0 + MS).expect("full");
        let t1 = t0 + 700 * MS;
        b.push("a", 3, t1);
        assert_eq!(b.next_deadline(), Some(t1 + WAIT));
        // The old deadline (t0 + WAIT) no longer applies.
        assert!(b.flush_expired(t0 + WAIT).is_empty());
        assert!(b.flush_expired(t1 + WAIT - MS).is_empty());
        let flushed = b.flush_expired(t1 + WAIT);
        assert_eq!(flushed[0].items, [3]);
        assert_eq!(flushed[0].oldest, t1);
    }

    #[test]
    fn key_flushed_on_timeout_starts_a_fresh_buffer() {
        let t0 = Instant::now();
        let mut b = batcher(5);
        b.push("a", 1, t0);
        assert_eq!(b.flush_expired(t0 + WAIT).len(), 1);
        b.push("a", 2, t0 + WAIT);
        assert_eq!(b.next_deadline(), Some(t0 + 2 * WAIT));
        assert_eq!(b.buffered(), 1);
    }

    // ---- Batcher: next_deadline -------------------------------------------------------------

    #[test]
    fn next_deadline_follows_the_oldest_buffer_through_flushes() {
        let t0 = Instant::now();
        let mut b = batcher(2);
        assert_eq!(b.next_deadline(), None);
        b.push("a", 1, t0);
        b.push("b", 1, t0 + 10 * MS);
        b.push("c", 1, t0 + 20 * MS);
        assert_eq!(b.next_deadline(), Some(t0 + WAIT));
        // Size-flushing the oldest moves the deadline to the next oldest.
        b.push("a", 2, t0 + 30 * MS).expect("full");
        assert_eq!(b.next_deadline(), Some(t0 + 10 * MS + WAIT));
        // Size-flushing a middle buffer leaves it unchanged.
        b.push("c", 2, t0 + 40 * MS).expect("full");
        assert_eq!(b.next_deadline(), Some(t0 + 10 * MS + WAIT));
        // A new buffer does not move it either.
        b.push("a", 3, t0 + 50 * MS);
        assert_eq!(b.next_deadline(), Some(t0 + 10 * MS + WAIT));
        // Timeout flush of b moves it to a's new buffer.
        assert_eq!(b.flush_expired(t0 + 10 * MS + WAIT).len(), 1);
        assert_eq!(b.next_deadline(), Some(t0 + 50 * MS + WAIT));
        b.drain(FlushReason::Shutdown);
        assert_eq!(b.next_deadline(), None);
    }

    #[test]
    fn out_of_order_arrival_becomes_the_oldest() {
        let t0 = Instant::now() + WAIT;
        let mut b = batcher(10);
        b.push("a", 1, t0);
        b.push("b", 2, t0 - 100 * MS);
        assert_eq!(b.next_deadline(), Some(t0 - 100 * MS + WAIT));
        assert_eq!(b.oldest_age(t0), Some(100 * MS));
        let keys: Vec<_> = b.flush_expired(t0 + WAIT).iter().map(|x| x.key).collect();
        assert_eq!(keys, ["b", "a"]);
    }

    #[test]
    fn huge_wait_never_panics_and_never_expires() {
        let t0 = Instant::now();
        let mut b: Batcher<u8, u8> = Batcher::new(cfg(4, Duration::MAX));
        b.push(1, 1, t0);
        let deadline = b.next_deadline().expect("buffered");
        assert!(deadline > t0 + Duration::from_secs(86_400 * 365));
        assert!(b
            .flush_expired(t0 + Duration::from_secs(86_400 * 365))
            .is_empty());
        assert_eq!(b.buffered(), 1);
    }

    // ---- Batcher: drain ---------------------------------------------------------------------

    #[test]
    fn drain_returns_every_item_oldest_first_with_the_given_reason() {
        for reason in [FlushReason::Shutdown, FlushReason::Revoke] {
            let t0 = Instant::now();
            let mut b = batcher(10);
            b.push("b", 1, t0 + MS);
            b.push("a", 2, t0);
            b.push("b", 3, t0 + 2 * MS);
            b.push("c", 4, t0 + 3 * MS);
            b.push("a", 5, t0 + 4 * MS);
            let drained = b.drain(reason);
            let got: Vec<_> = drained
                .iter()
                .map(|x| (x.key, x.items.clone(), x.reason, x.oldest))
                .collect();
            assert_eq!(
                got,
                [
                    ("a", vec![2, 5], reason, t0),
                    ("b", vec![1, 3], reason, t0 + MS),
                    ("c", vec![4], reason, t0 + 3 * MS),
                ]
            );
            assert!(b.is_empty());
            assert_eq!(b.buffered(), 0);
            assert_eq!(b.oldest_age(t0), None);
            assert!(b.drain(reason).is_empty());
        }
    }

    #[test]
    fn batcher_is_reusable_after_drain() {
        let t0 = Instant::now();
        let mut b = batcher(2);
        b.push("a", 1, t0);
        b.drain(FlushReason::Revoke);
        assert!(b.push("a", 2, t0 + MS).is_none());
        assert_eq!(b.push("a", 3, t0 + MS).unwrap().items, [2, 3]);
    }

    // ---- Batcher: gauges --------------------------------------------------------------------

    #[test]
    fn buffered_and_oldest_age_track_every_change() {
        let t0 = Instant::now();
        let mut b = batcher(3);
        assert!(b.is_empty());
        assert_eq!(b.buffered(), 0);
        assert_eq!(b.oldest_age(t0), None);
        b.push("a", 1, t0);
        b.push("b", 2, t0 + 100 * MS);
        b.push("a", 3, t0 + 200 * MS);
        assert!(!b.is_empty());
        assert_eq!(b.buffered(), 3);
        assert_eq!(b.oldest_age(t0 + 250 * MS), Some(250 * MS));
        // `now` before the oldest arrival saturates to zero.
        assert_eq!(b.oldest_age(t0), Some(Duration::ZERO));
        b.push("a", 4, t0 + 300 * MS).expect("a full");
        assert_eq!(b.buffered(), 1);
        assert_eq!(b.oldest_age(t0 + 300 * MS), Some(200 * MS));
        b.flush_expired(t0 + 100 * MS + WAIT);
        assert_eq!(b.buffered(), 0);
        assert_eq!(b.oldest_age(t0 + 2 * WAIT), None);
        assert!(b.is_empty());
    }

    // ---- Batcher: property-ish ---------------------------------------------------------------

    /// Pushes random `(key, id)` with random time steps, calls `flush_expired` at every deadline
    /// on the way, and checks: each item comes out exactly once, in a batch of its own key, in
    /// push order; no batch exceeds the size limit (size batches are exactly full); no item waits
    /// longer than `max_batch_wait`; timeout batches flush exactly at their deadline; the gauges
    /// agree with a model.
    #[test]
    fn random_workload_loses_nothing_and_respects_size_and_wait() {
        for (seed, size, keys) in [(7, 4, 5), (42, 1, 3), (2024, 16, 40), (99, 3, 1)] {
            let mut rng = fastrand::Rng::with_seed(seed);
            let wait = Duration::from_millis(rng.u64(50..=500));
            let mut b: Batcher<u32, usize> = Batcher::new(cfg(size, wait));
            let n = 4000;
            let mut arrival = Vec::with_capacity(n);
            let mut key_of = Vec::with_capacity(n);
            let mut seen = vec![false; n];
            let mut emitted = 0usize;
            let t0 = Instant::now();
            let mut now = t0;

            let mut check =
                |batch: Batch<u32, usize>, at: Instant, arrival: &[Instant], key_of: &[u32]| {
                    assert!(!batch.items.is_empty());
                    assert!(batch.items.len() <= size, "batch over max size");
                    if batch.reason == FlushReason::Size {
                        assert_eq!(batch.items.len(), size, "size batch not full");
                    }
                    if batch.reason == FlushReason::Timeout {
                        assert_eq!(at, batch.oldest + wait, "timeout not at the deadline");
                    }
                    assert_eq!(batch.oldest, arrival[batch.items[0]]);
                    assert!(batch.items.windows(2).all(|w| w[0] < w[1]), "order");
                    for &id in &batch.items {
                        assert_eq!(key_of[id], batch.key, "item in another key's batch");
                        assert!(!seen[id], "item {id} flushed twice");
                        seen[id] = true;
                        assert!(at >= arrival[id]);
                        assert!(at - arrival[id] <= wait, "item {id} waited too long");
                    }
                    batch.items.len()
                };

            for id in 0..n {
                // Mostly small steps, sometimes a long pause, sometimes none.
                let step = match rng.u8(0..10) {
                    0..=2 => Duration::ZERO,
                    3..=8 => Duration::from_millis(rng.u64(0..wait.as_millis() as u64 / 4)),
                    _ => Duration::from_millis(rng.u64(0..3 * wait.as_millis() as u64)),
                };
                let next = now + step;
                while let Some(deadline) = b.next_deadline().filter(|d| *d <= next) {
                    assert!(deadline >= now, "a deadline was missed");
                    now = deadline;
                    let flushed = b.flush_expired(now);
                    assert!(!flushed.is_empty());
                    for batch in flushed {
                        assert_eq!(batch.reason, FlushReason::Timeout);
                        emitted += check(batch, now, &arrival, &key_of);
                    }
                }
                now = next;
                // Skewed keys: a few hot, many cold.
                let key = if rng.bool() {
                    rng.u32(0..keys.min(3))
                } else {
                    rng.u32(0..keys)
                };
                arrival.push(now);
                key_of.push(key);
                if let Some(batch) = b.push(key, id, now) {
                    assert_eq!(batch.reason, FlushReason::Size);
                    emitted += check(batch, now, &arrival, &key_of);
                }
                assert_eq!(b.buffered(), id + 1 - emitted);
                assert_eq!(b.is_empty(), b.buffered() == 0);
                if let Some(age) = b.oldest_age(now) {
                    assert!(age < wait, "a due buffer was left behind");
                }
            }
            for batch in b.drain(FlushReason::Shutdown) {
                assert_eq!(batch.reason, FlushReason::Shutdown);
                emitted += check(batch, now, &arrival, &key_of);
            }
            assert_eq!(emitted, n);
            assert!(seen.iter().all(|s| *s), "an item was lost");
            assert!(b.is_empty());
        }
    }

    // ---- run (driver) -----------------------------------------------------------------------

    type States = std::sync::Arc<std::sync::Mutex<Vec<(usize, Option<Duration>)>>>;

    /// A spawned [`run`] with channels of capacity 64 and its `on_state` calls recorded.
    struct Harness {
        tx: mpsc::Sender<(&'static str, u32)>,
        out: mpsc::Receiver<Batch<&'static str, u32>>,
        revoke: CancellationToken,
        states: States,
        task: tokio::task::JoinHandle<()>,
        /// The byte budget's "spent" signal the driver watches.
        spent: watch::Sender<u64>,
    }

    fn spawn_run(size: usize, wait: Duration) -> Harness {
        spawn_run_with(cfg(size, wait))
    }

    fn spawn_run_with(cfg: BatchConfig) -> Harness {
        let (tx, in_rx) = mpsc::channel(64);
        let (out_tx, out) = mpsc::channel(64);
        let revoke = CancellationToken::new();
        let states = States::default();
        let recorded = states.clone();
        let spent = watch::Sender::new(0);
        let task = tokio::spawn(run(
            cfg,
            in_rx,
            out_tx,
            revoke.clone(),
            spent.subscribe(),
            None,
            move |n, age| recorded.lock().unwrap().push((n, age)),
        ));
        Harness {
            tx,
            out,
            revoke,
            states,
            task,
            spent,
        }
    }

    /// The next batch from `run`; a failure rather than a hang when none comes (under paused time
    /// the hour passes at once when nothing else is pending).
    async fn next(out: &mut mpsc::Receiver<Batch<&'static str, u32>>) -> Batch<&'static str, u32> {
        tokio::time::timeout(Duration::from_secs(3600), out.recv())
            .await
            .expect("no batch within an hour")
            .expect("`out` closed")
    }

    #[tokio::test(start_paused = true)]
    async fn run_flushes_on_size_immediately() {
        let Harness { tx, mut out, .. } = spawn_run(3, WAIT);
        let t0 = Instant::now();
        for i in 1..=3 {
            tx.send(("a", i)).await.unwrap();
        }
        let batch = next(&mut out).await;
        assert_eq!(batch.items, [1, 2, 3]);
        assert_eq!(batch.reason, FlushReason::Size);
        assert_eq!(Instant::now(), t0, "no waiting for a full batch");
    }

    #[tokio::test(start_paused = true)]
    async fn run_flushes_on_timeout_exactly_at_max_batch_wait() {
        let Harness { tx, mut out, .. } = spawn_run(10, WAIT);
        let t0 = Instant::now();
        tx.send(("a", 1)).await.unwrap();
        tokio::time::sleep(WAIT - MS).await;
        tx.send(("a", 2)).await.unwrap();
        assert!(
            out.try_recv().is_err(),
            "nothing due 1 ms before the deadline"
        );
        let batch = next(&mut out).await;
        assert_eq!(Instant::now(), t0 + WAIT);
        assert_eq!(batch.items, [1, 2]);
        assert_eq!(batch.reason, FlushReason::Timeout);
        assert_eq!(batch.oldest, t0);
    }

    /// While the LLM server has no free call slot and a batch of the partition waits for one, a
    /// due buffer stays open and takes its key's later items; it goes when a slot frees or the
    /// waiting batch gets its slot, or by size when it fills. With no batch of the partition
    /// waiting, only the oldest due buffer goes ([`CallSlots`]).
    #[tokio::test(start_paused = true)]
    async fn run_holds_due_buffers_while_every_call_slot_is_taken() {
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        let (free, in_line) = (std::sync::Arc::new(AtomicBool::new(false)), std::sync::Arc::new(AtomicBool::new(false)));
        let (changed, ended) = (watch::Sender::new(0u64), watch::Sender::new(0u64));
        let (is_free, is_in_line) = (free.clone(), in_line.clone());
        let slots = CallSlots {
            free: Box::new(move || is_free.load(SeqCst)),
            in_line: Box::new(move || is_in_line.load(SeqCst)),
            changed: changed.subscribe(),
            ended: ended.subscribe(),
        };
        let (tx, in_rx) = mpsc::channel(64);
        let (out_tx, mut out) = mpsc::channel(64);
        tokio::spawn(run(cfg(4, WAIT), in_rx, out_tx, CancellationToken::new(), watch::channel(0).1, Some(slots), |_, _| {}));
        let settle = || tokio::time::sleep(MS);
        let t0 = Instant::now();
        tx.send(("a", 1)).await.unwrap();
        tx.send(("b", 2)).await.unwrap();
        // No slot free and no batch in line: the oldest due buffer goes, alone.
        let a = next(&mut out).await;
        assert_eq!((a.key, a.items, a.reason, Instant::now()), ("a", vec![1], FlushReason::Timeout, t0 + WAIT));
        // a's batch waits for a slot; "b", due, is held and takes its key's later items.
        in_line.store(true, SeqCst);
        tokio::time::sleep(WAIT * 3).await;
        tx.send(("b", 3)).await.unwrap();
        tx.send(("b", 4)).await.unwrap();
        settle().await;
        assert!(out.try_recv().is_err(), "b went while a batch of the partition waited and no slot was free");
        // A slot frees: b goes at once, with what it took meanwhile.
        free.store(true, SeqCst);
        changed.send_modify(|n| *n += 1);
        let t1 = Instant::now();
        let b = next(&mut out).await;
        assert_eq!((b.key, b.items, b.reason, Instant::now()), ("b", vec![2, 3, 4], FlushReason::Timeout, t1));
        // With a slot free, due buffers go at their deadline as before.
        let t2 = Instant::now();
        tx.send(("c", 5)).await.unwrap();
        let c = next(&mut out).await;
        assert_eq!((c.items, Instant::now()), (vec![5], t2 + WAIT));
        // No slot again: a held buffer that fills goes by size.
        free.store(false, SeqCst);
        for i in 6..=9 {
            tx.send(("d", i)).await.unwrap();
            tokio::time::sleep(WAIT).await;
        }
        let d = next(&mut out).await;
        assert_eq!((d.items, d.reason), (vec![6, 7, 8, 9], FlushReason::Size));
        // Held while a batch waits; the partition's batches changing (one ended) is not enough.
        tx.send(("e", 10)).await.unwrap();
        tx.send(("f", 11)).await.unwrap();
        tokio::time::sleep(WAIT * 2).await;
        ended.send_modify(|n| *n += 1);
        settle().await;
        assert!(out.try_recv().is_err(), "e went while a batch of the partition waited and no slot was free");
        // The waiting batch got its slot (none free, none waiting): the oldest due buffer goes,
        // the next one stays for the next turn.
        in_line.store(false, SeqCst);
        changed.send_modify(|n| *n += 1);
        let t3 = Instant::now();
        let e = next(&mut out).await;
        assert_eq!((e.items, e.reason, Instant::now()), (vec![10], FlushReason::Timeout, t3));
        in_line.store(true, SeqCst);
        settle().await;
        assert!(out.try_recv().is_err(), "f went with e");
        in_line.store(false, SeqCst);
        ended.send_modify(|n| *n += 1);
        assert_eq!(next(&mut out).await.items, vec![11]);
    }

    #[test]
    fn every_buffer_flushes_once_the_buffers_hold_the_prefetch() {
        let mut b = Batcher::new(BatchConfig { max_buffered: 4, ..cfg(8, WAIT) });
        let t0 = Instant::now();
        for (i, key) in ["a", "b", "a"].into_iter().enumerate() {
            assert!(b.push(key, i as u32, t0 + i as u32 * MS).is_none());
            assert!(b.flush_full().is_empty(), "{} of 4 buffered: not full", i + 1);
        }
        assert!(b.push("c", 3, t0 + 3 * MS).is_none());
        let flushed = b.flush_full();
        let got: Vec<_> = flushed.iter().map(|x| (x.key, x.items.clone(), x.reason, x.oldest)).collect();
        assert_eq!(
            got,
            [
                ("a", vec![0, 2], FlushReason::Prefetch, t0),
                ("b", vec![1], FlushReason::Prefetch, t0 + MS),
                ("c", vec![3], FlushReason::Prefetch, t0 + 3 * MS),
            ],
            "oldest first, every buffer"
        );
        assert_eq!((b.buffered(), b.next_deadline()), (0, None));
        // A size flush takes its items out of the count.
        let mut b = Batcher::new(BatchConfig { max_buffered: 3, ..cfg(2, WAIT) });
        assert!(b.push("a", 0, t0).is_none());
        assert!(b.push("a", 1, t0).is_some_and(|x| x.reason == FlushReason::Size));
        assert!(b.push("b", 2, t0).is_none() && b.push("c", 3, t0).is_none());
        assert!(b.flush_full().is_empty(), "2 buffered after the size flush");
    }

    #[tokio::test(start_paused = true)]
    async fn run_flushes_distinct_keys_at_once_when_the_prefetch_is_buffered() {
        let Harness { tx, mut out, .. } = spawn_run_with(BatchConfig { max_buffered: 3, ..cfg(8, WAIT) });
        let t0 = Instant::now();
        for (key, item) in [("a", 1), ("b", 2), ("c", 3)] {
            tx.send((key, item)).await.unwrap();
        }
        let mut got = Vec::new();
        for _ in 0..3 {
            let batch = next(&mut out).await;
            got.push((batch.key, batch.items, batch.reason));
        }
        assert_eq!(Instant::now(), t0, "no max_batch_wait when nothing more can arrive");
        assert_eq!(got, [("a", vec![1], FlushReason::Prefetch), ("b", vec![2], FlushReason::Prefetch), ("c", vec![3], FlushReason::Prefetch)]);
    }

    #[tokio::test(start_paused = true)]
    async fn run_flushes_every_buffer_when_the_byte_budget_is_spent() {
        let Harness { tx, mut out, spent, .. } = spawn_run(8, WAIT);
        let t0 = Instant::now();
        for (key, item) in [("a", 1), ("b", 2), ("a", 3)] {
            tx.send((key, item)).await.unwrap();
        }
        tokio::time::sleep(10 * MS).await;
        assert!(out.try_recv().is_err(), "nothing due yet");
        // An item still in the channel when the signal comes goes too.
        spent.send_modify(|n| *n += 1);
        tx.send(("b", 5)).await.unwrap();
        let (a, b) = (next(&mut out).await, next(&mut out).await);
        assert_eq!(Instant::now(), t0 + 10 * MS, "at once, not at max_batch_wait");
        assert_eq!((a.key, a.items, a.reason), ("a", vec![1, 3], FlushReason::ByteBudget));
        assert_eq!((b.key, b.items, b.reason), ("b", vec![2, 5], FlushReason::ByteBudget));
        // The driver goes on: the next item waits for its own deadline again.
        tx.send(("c", 4)).await.unwrap();
        let c = next(&mut out).await;
        assert_eq!((c.key, c.reason, Instant::now()), ("c", FlushReason::Timeout, t0 + 10 * MS + WAIT));
    }

    #[tokio::test(start_paused = true)]
    async fn run_keeps_keys_apart_with_independent_deadlines() {
        let Harness { tx, mut out, .. } = spawn_run(2, WAIT);
        let t0 = Instant::now();
        tx.send(("b", 100)).await.unwrap();
        tokio::time::sleep(300 * MS).await;
        tx.send(("a", 1)).await.unwrap();
        tx.send(("a", 2)).await.unwrap();
        let a = next(&mut out).await;
        assert_eq!(
            (a.key, a.items, a.reason),
            ("a", vec![1, 2], FlushReason::Size)
        );
        tx.send(("a", 3)).await.unwrap();
        let b = next(&mut out).await;
        assert_eq!(
            (b.key, b.items, b.reason),
            ("b", vec![100], FlushReason::Timeout)
        );
        assert_eq!(Instant::now(), t0 + WAIT);
        let a = next(&mut out).await;
        assert_eq!(
            (a.key, a.items, a.reason),
            ("a", vec![3], FlushReason::Timeout)
        );
        assert_eq!(Instant::now(), t0 + 300 * MS + WAIT);
    }

    #[tokio::test(start_paused = true)]
    async fn run_busy_input_does_not_delay_timeouts() {
        let Harness { tx, mut out, .. } = spawn_run(5000, WAIT);
        let t0 = Instant::now();
        tx.send(("a", 0)).await.unwrap();
        // Another key keeps the input busy every millisecond across a's deadline.
        let producer = tokio::spawn(async move {
            for i in 1..=1500 {
                tokio::time::sleep(MS).await;
                if tx.send(("b", i)).await.is_err() {
                    break;
                }
            }
        });
        let a = next(&mut out).await;
        assert_eq!((a.key, a.reason), ("a", FlushReason::Timeout));
        assert_eq!(Instant::now(), t0 + WAIT);
        let b = next(&mut out).await;
        assert_eq!((b.key, b.reason), ("b", FlushReason::Timeout));
        assert!(b.items.windows(2).all(|w| w[0] < w[1]));
        producer.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn run_drains_everything_with_shutdown_when_input_closes() {
        let Harness {
            tx,
            mut out,
            revoke,
            states,
            task,
            ..
        } = spawn_run(3, WAIT);
        let mut sent = Vec::new();
        for i in 0..20u32 {
            let key = ["a", "b", "c", "d"][(i % 4) as usize];
            tx.send((key, i)).await.unwrap();
            sent.push(i);
        }
        drop(tx);
        task.await.unwrap();
        assert!(!revoke.is_cancelled());
        let mut got = Vec::new();
        let mut reasons = Vec::new();
        while let Some(batch) = out.recv().await {
            assert!(batch.items.len() <= 3);
            assert!(batch.items.windows(2).all(|w| w[0] < w[1]));
            reasons.push(batch.reason);
            got.extend(batch.items);
        }
        got.sort_unstable();
        assert_eq!(got, sent, "every item exactly once");
        // 5 items per key: one size batch of 3 and one shutdown batch of 2 each.
        assert_eq!(
            reasons.iter().filter(|r| **r == FlushReason::Size).count(),
            4
        );
        assert_eq!(
            reasons
                .iter()
                .filter(|r| **r == FlushReason::Shutdown)
                .count(),
            4
        );
        assert_eq!(states.lock().unwrap().last(), Some(&(0, None)));
    }

    #[tokio::test(start_paused = true)]
    async fn run_emits_revoke_batches_including_queued_input_then_stops() {
        let (in_tx, in_rx) = mpsc::channel(64);
        let (out_tx, mut out) = mpsc::channel(64);
        let revoke = CancellationToken::new();
        // Queue items before the driver ever runs, and revoke at once: queued input is not lost.
        for i in 0..5 {
            in_tx
                .send((if i < 4 { "a" } else { "b" }, i))
                .await
                .unwrap();
        }
        revoke.cancel();
        run(cfg(3, WAIT), in_rx, out_tx, revoke, watch::channel(0).1, None, |_, _| {}).await;
        let mut batches = Vec::new();
        while let Some(batch) = out.recv().await {
            batches.push((batch.key, batch.items, batch.reason));
        }
        assert_eq!(
            batches,
            [
                ("a", vec![0, 1, 2], FlushReason::Revoke),
                ("a", vec![3], FlushReason::Revoke),
                ("b", vec![4], FlushReason::Revoke),
            ]
        );
        // Intake is closed: a late send fails and hands the item back.
        assert_eq!(in_tx.send(("a", 9)).await.unwrap_err().0, ("a", 9));
    }

    #[tokio::test(start_paused = true)]
    async fn run_revoke_while_buffering_hands_back_partial_batches() {
        let Harness {
            tx,
            mut out,
            revoke,
            states,
            task,
            ..
        } = spawn_run(10, WAIT);
        let t0 = Instant::now();
        tx.send(("a", 1)).await.unwrap();
        tx.send(("b", 2)).await.unwrap();
        tokio::time::sleep(100 * MS).await;
        revoke.cancel();
        task.await.unwrap();
        let a = next(&mut out).await;
        assert_eq!(
            (a.key, a.items, a.reason, a.oldest),
            ("a", vec![1], FlushReason::Revoke, t0)
        );
        let b = next(&mut out).await;
        assert_eq!(
            (b.key, b.items, b.reason),
            ("b", vec![2], FlushReason::Revoke)
        );
        assert!(out.recv().await.is_none(), "run returned and dropped `out`");
        assert_eq!(
            Instant::now(),
            t0 + 100 * MS,
            "revoke does not wait for deadlines"
        );
        assert_eq!(states.lock().unwrap().last(), Some(&(0, None)));
        assert!(tx.send(("a", 3)).await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn run_returns_when_out_is_closed() {
        let Harness {
            tx,
            out,
            states,
            task,
            ..
        } = spawn_run(1, WAIT);
        drop(out);
        tx.send(("a", 1)).await.unwrap();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("run returns")
            .unwrap();
        assert_eq!(states.lock().unwrap().last(), Some(&(0, None)));
        assert!(tx.send(("a", 2)).await.is_err(), "input dropped");
    }

    #[tokio::test(start_paused = true)]
    async fn run_preserves_order_and_mixes_keys_in_off_mode() {
        // mode = "off": one constant key, so the batch holds every request in arrival order.
        let Harness { tx, mut out, .. } = spawn_run(6, WAIT);
        for i in 0..6 {
            tx.send(("", i)).await.unwrap();
        }
        let batch = next(&mut out).await;
        assert_eq!(batch.items, [0, 1, 2, 3, 4, 5]);
        assert_eq!(batch.reason, FlushReason::Size);
    }

    #[tokio::test(start_paused = true)]
    async fn run_reports_buffered_and_oldest_age() {
        let Harness {
            tx,
            mut out,
            states,
            task,
            ..
        } = spawn_run(3, WAIT);
        tx.send(("a", 1)).await.unwrap();
        tokio::time::sleep(200 * MS).await;
        tx.send(("b", 2)).await.unwrap();
        tx.send(("a", 3)).await.unwrap();
        tokio::time::sleep(10 * MS).await;
        assert_eq!(
            *states.lock().unwrap(),
            [
                (1, Some(Duration::ZERO)),
                (2, Some(200 * MS)),
                (3, Some(200 * MS))
            ]
        );
        drop(tx);
        task.await.unwrap();
        assert_eq!(
            states.lock().unwrap()[3..],
            [(0, None)],
            "drained, then nothing buffered"
        );
        assert_eq!(next(&mut out).await.items, [1, 3]);
        assert_eq!(next(&mut out).await.items, [2]);
    }

    // ---- purity -----------------------------------------------------------------------------

    #[test]
    fn purity_is_the_dominant_key_share() {
        assert_eq!(purity(Vec::<u64>::new()), 1.0, "empty counts as pure");
        assert_eq!(purity([7u64]), 1.0);
        assert_eq!(purity([7u64; 10]), 1.0);
        assert_eq!(purity([1, 1, 1, 2]), 0.75);
        assert_eq!(purity([1, 2, 1, 3, 1, 2]), 0.5);
        assert_eq!(purity([1, 2, 3, 4, 5]), 0.2);
        assert_eq!(purity(["x", "y", "y"].iter()), 2.0 / 3.0);
    }

    // ---- shared_prefix_ratio ------------------------------------------------------------------

    #[test]
    fn shared_prefix_ratio_basic_cases() {
        assert_eq!(shared_prefix_ratio::<&str>(&[]), 0.0);
        assert_eq!(shared_prefix_ratio(&["hello"]), 1.0);
        assert_eq!(shared_prefix_ratio(&[""]), 0.0);
        assert_eq!(shared_prefix_ratio(&["", ""]), 0.0);
        assert_eq!(shared_prefix_ratio(&["abc", "abc", "abc"]), 1.0);
        assert_eq!(shared_prefix_ratio(&["abc", "xyz"]), 0.0);
        // LCP "abcd" = 4, mean (8 + 8) / 2 = 8.
        assert_eq!(shared_prefix_ratio(&["abcdwxyz", "abcdefgh"]), 0.5);
        // One prompt a prefix of the other: LCP 2, mean 3.
        assert_eq!(shared_prefix_ratio(&["ab", "abcd"]), 2.0 / 3.0);
        // An empty prompt among others: no common prefix.
        assert_eq!(shared_prefix_ratio(&["abc", ""]), 0.0);
        // The prefix shared by all, not by most: LCP "ab" = 2, mean 4.
        assert_eq!(shared_prefix_ratio(&["abcd", "abcd", "abxx"]), 0.5);
        // Works with owned strings too.
        assert_eq!(
            shared_prefix_ratio(&[String::from("aa"), String::from("ab")]),
            0.5
        );
    }

    #[test]
    fn shared_prefix_ratio_counts_chars_not_bytes() {
        // "héllo " = 6 chars (7 bytes); lengths 11 and 11 chars.
        assert_eq!(
            shared_prefix_ratio(&["héllo wörld", "héllo there"]),
            6.0 / 11.0
        );
        // é (C3 A9) and è (C3 A8) share a lead byte but are different chars: LCP "a" = 1 of 2.
        assert_eq!(shared_prefix_ratio(&["aé", "aè"]), 0.5);
        // 4-byte chars: "🦀🦀" shared (2 chars), lengths 3 and 3.
        assert_eq!(shared_prefix_ratio(&["🦀🦀x", "🦀🦀y"]), 2.0 / 3.0);
        // 😀 (F0 9F 98 80) vs 😁 (F0 9F 98 81) differ only in the last byte.
        assert_eq!(shared_prefix_ratio(&["😀", "😁"]), 0.0);
        assert_eq!(
            shared_prefix_ratio(&["日本語の", "日本語が", "日本人"]),
            2.0 / (11.0 / 3.0)
        );
        assert_eq!(shared_prefix_ratio(&["日本語"]), 1.0);
    }

    #[test]
    fn common_prefix_bytes_stops_on_char_boundaries() {
        assert_eq!(common_prefix_bytes("aé", "aè"), 1);
        assert_eq!(common_prefix_bytes("é", "é"), 2);
        assert_eq!(common_prefix_bytes("éa", "é"), 2);
        assert_eq!(common_prefix_bytes("", "x"), 0);
    }
}
