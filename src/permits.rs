//! The concurrency permits of one LLM endpoint (`llm.max_concurrency`), handed out
//! **continuation first**: when a call ends and calls are waiting, the permit goes to the oldest
//! waiting call with the same prefix key as the call that ended, else to the oldest waiting call.
//!
//! Why: a server's prefix cache holds what it computed last. A llama-server slot keeps one
//! prompt's KV cache, and is overwritten by the next prompt it serves (`-np` slots per server);
//! vLLM and SGLang evict least recently used blocks first. When two batches of one key wait behind
//! batches of other keys, first-come-first-served order runs the other keys in between, and the
//! second batch finds its prefix evicted. Continuation first runs them back to back. Measured on
//! two llama-servers with 2 slots each (`bench/run --medium`, part 1): see `bench/REPORT.md`.
//!
//! Fairness: a waiting call is passed over by continuations at most [`MAX_PASSES`] times; after
//! that, it goes first whatever the key of the call that ended. So a key whose batches keep coming
//! delays another key's call by at most [`MAX_PASSES`] calls, never indefinitely.
//!
//! Metric: `prefix_batcher_llm_permit_handoffs_total{order}` counts the calls that waited, by
//! whether they went ahead as a continuation or in arrival order.
//!
//! Cancellation: dropping an [`Acquire`] future (a cancelled batch) removes its place in the
//! queue, or, when a permit was already handed to it, passes that permit on; no permit is lost.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::sync::oneshot;

/// How many times a waiting call can be passed over by a later call of the key that just ended
/// before it goes first. 3 lets a key's batch and two more of its batches run back to back (a
/// group of 24 requests at the default `batching.max_batch_size = 8`).
pub const MAX_PASSES: u32 = 3;

/// Permits of one endpoint; cheap to share (`Arc` inside).
#[derive(Clone, Debug)]
pub struct KeyedPermits {
    state: Arc<Mutex<State>>,
}

#[derive(Debug)]
struct State {
    free: usize,
    waiters: VecDeque<Waiter>,
    next_id: u64,
    /// Bumped at each change of who holds or waits ([`KeyedPermits::signal_changes`]).
    changed: Option<Arc<tokio::sync::watch::Sender<u64>>>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    key: Option<u64>,
    passes: u32,
    tx: oneshot::Sender<()>,
}

/// One permit; dropping it hands it to the next waiting call (continuation first) or frees it.
#[derive(Debug)]
pub struct Permit {
    state: Arc<Mutex<State>>,
    key: Option<u64>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        release(&self.state, self.key);
    }
}

impl KeyedPermits {
    /// `n` permits (n ≥ 1 in practice: `llm.max_concurrency`).
    pub fn new(n: usize) -> Self {
        KeyedPermits { state: Arc::new(Mutex::new(State { free: n, waiters: VecDeque::new(), next_id: 0, changed: None })) }
    }

    /// Waits for a permit for a call of prefix key `key` (`None`: a call of no particular key,
    /// such as a probe; it is never preferred as a continuation). Calls get permits in arrival
    /// order except for continuations (module docs). Cancel-safe.
    pub fn acquire(&self, key: Option<u64>) -> Acquire {
        let mut s = lock(&self.state);
        if s.free > 0 && s.waiters.is_empty() {
            s.free -= 1;
            return Acquire { state: self.state.clone(), key, wait: Wait::Granted };
        }
        let (tx, rx) = oneshot::channel();
        let id = s.next_id;
        s.next_id += 1;
        s.waiters.push_back(Waiter { id, key, passes: 0, tx });
        Acquire { state: self.state.clone(), key, wait: Wait::Queued(id, rx) }
    }

    /// Permits free now: a call would get one without waiting.
    pub fn available(&self) -> usize {
        lock(&self.state).free
    }

    /// From now on, bumps `changed` each time a permit is handed to a waiting call or becomes
    /// free, and each time a waiting call leaves the queue without one, so that a batcher holding
    /// back batches while every permit is taken ([`crate::batcher::CallSlots`]) looks again.
    pub fn signal_changes(&self, changed: Arc<tokio::sync::watch::Sender<u64>>) {
        lock(&self.state).changed = Some(changed);
    }

    /// Whether a call waits for a permit whose prefix key satisfies `of` (a call of no particular
    /// key never does).
    pub fn has_waiter(&self, of: impl Fn(u64) -> bool) -> bool {
        lock(&self.state).waiters.iter().any(|w| w.key.is_some_and(&of))
    }
}

/// The future of [`KeyedPermits::acquire`].
#[derive(Debug)]
pub struct Acquire {
    state: Arc<Mutex<State>>,
    key: Option<u64>,
    wait: Wait,
}

#[derive(Debug)]
enum Wait {
    /// A permit was free at once; not yet returned by `poll`.
    Granted,
    /// Queued as waiter `id`; `rx` fires when a permit is handed over.
    Queued(u64, oneshot::Receiver<()>),
    /// `poll` returned the permit: it belongs to the [`Permit`] now.
    Done,
}

impl Future for Acquire {
    type Output = Permit;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Permit> {
        match &mut self.wait {
            Wait::Granted => {}
            // The sender leaves the queue only to hand over a permit (or when this future's
            // own drop removes it), so a ready receiver means the permit is ours.
            Wait::Queued(_, rx) => match Pin::new(rx).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(_) => {}
            },
            Wait::Done => panic!("Acquire polled after it returned its permit"),
        }
        self.wait = Wait::Done;
        Poll::Ready(Permit { state: self.state.clone(), key: self.key })
    }
}

impl Drop for Acquire {
    fn drop(&mut self) {
        let (id, mut rx) = match std::mem::replace(&mut self.wait, Wait::Done) {
            Wait::Done => return,
            Wait::Granted => return release(&self.state, self.key),
            Wait::Queued(id, rx) => (id, rx),
        };
        let mut s = lock(&self.state);
        if let Some(i) = s.waiters.iter().position(|w| w.id == id) {
            s.waiters.remove(i);
            s.signal();
            return;
        }
        drop(s);
        // Handed a permit that was never taken: pass it on.
        if rx.try_recv().is_ok() {
            release(&self.state, self.key);
        }
    }
}

/// Hands the permit of a call of key `ended` to the next waiting call, or frees it.
fn release(state: &Mutex<State>, ended: Option<u64>) {
    let mut s = lock(state);
    while let Some(i) = next_waiter(&s.waiters, ended) {
        for w in s.waiters.iter_mut().take(i) {
            w.passes += 1;
        }
        let w = s.waiters.remove(i).expect("index from next_waiter");
        if w.tx.send(()).is_ok() {
            crate::metrics::llm_permit_handoff(i > 0);
            s.signal();
            return;
        }
    }
    s.free += 1;
    s.signal();
}

impl State {
    /// Bumps the change signal, if any ([`KeyedPermits::signal_changes`]).
    fn signal(&self) {
        if let Some(changed) = &self.changed {
            changed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}

/// The waiter that gets a permit after a call of key `ended`: the oldest with the same key, unless
/// a waiter ahead of it was already passed over [`MAX_PASSES`] times; else the oldest.
fn next_waiter(waiters: &VecDeque<Waiter>, ended: Option<u64>) -> Option<usize> {
    if waiters.is_empty() {
        return None;
    }
    if let Some(k) = ended {
        for (i, w) in waiters.iter().enumerate() {
            if w.key == Some(k) {
                return Some(i);
            }
            if w.passes >= MAX_PASSES {
                break;
            }
        }
    }
    Some(0)
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // The state stays consistent at every await-free step, so a panic elsewhere cannot break it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::FutureExt;

    use super::*;

    /// Queues calls of `keys` behind one running call of key `running` on one permit; returns the
    /// order in which they got the permit.
    async fn order(running: u64, keys: &[u64]) -> Vec<u64> {
        let p = KeyedPermits::new(1);
        let first = p.acquire(Some(running)).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for &k in keys {
            let (p, tx) = (p.clone(), tx.clone());
            let acquire = p.acquire(Some(k));
            tasks.push(tokio::spawn(async move {
                let _permit = acquire.await;
                tx.send(k).unwrap();
                tokio::task::yield_now().await;
            }));
        }
        drop(tx);
        drop(first);
        let mut got = Vec::new();
        while let Some(k) = rx.recv().await {
            got.push(k);
        }
        got
    }

    #[tokio::test]
    async fn a_continuation_goes_before_older_calls_of_other_keys() {
        // A's first batch runs; B1, C1 and A's second batch wait, in that order.
        assert_eq!(order(1, &[2, 3, 1]).await, vec![1, 2, 3]);
        // Each key's second batch follows its first: 1 1 2 2 3 3, not 1 2 3 1 2 3.
        assert_eq!(order(1, &[2, 3, 1, 2, 3]).await, vec![1, 2, 2, 3, 3]);
    }

    #[tokio::test]
    async fn without_continuations_the_order_is_arrival() {
        assert_eq!(order(9, &[2, 3, 4, 5]).await, vec![2, 3, 4, 5]);
    }

    #[tokio::test]
    async fn a_waiting_call_is_passed_over_at_most_max_passes_times() {
        // Key 1 keeps coming; key 2 waits from the start.
        let mut keys = vec![2];
        keys.extend(std::iter::repeat_n(1, 6));
        let got = order(1, &keys).await;
        let at = got.iter().position(|&k| k == 2).unwrap();
        assert_eq!(at, MAX_PASSES as usize, "{got:?}");
    }

    #[tokio::test]
    async fn a_free_permit_is_taken_at_once_and_returned_on_drop() {
        let p = KeyedPermits::new(2);
        let a = p.acquire(Some(1)).await;
        let b = p.acquire(None).await;
        assert_eq!(p.available(), 0);
        assert!(p.acquire(Some(1)).now_or_never().is_none(), "no third permit");
        drop(p.acquire(Some(1)));
        drop(a);
        // Granted at once but never polled: returned on drop.
        drop(p.acquire(Some(3)));
        drop(b);
        assert_eq!(p.available(), 2);
    }

    #[tokio::test]
    async fn a_cancelled_waiter_loses_no_permit() {
        let p = KeyedPermits::new(1);
        let held = p.acquire(Some(1)).await;
        // Cancelled while queued.
        let queued = p.acquire(Some(1));
        drop(queued);
        // Handed the permit, then dropped before it was polled.
        let handed = p.acquire(Some(1));
        drop(held);
        drop(handed);
        assert_eq!(p.available(), 1);
        let again = tokio::time::timeout(Duration::from_secs(5), p.acquire(Some(2))).await.expect("the permit is free");
        drop(again);
        assert_eq!(p.available(), 1);
    }

    /// The state's invariants: at most `n` free permits, none free while calls wait, waiters passed
    /// over at most [`MAX_PASSES`] times and never more often than an older waiter.
    fn check_invariants(p: &KeyedPermits, n: usize) -> u32 {
        let s = lock(&p.state);
        assert!(s.free <= n, "{} free of {n}", s.free);
        assert!(s.waiters.is_empty() || s.free == 0, "{} free while {} wait", s.free, s.waiters.len());
        let mut ahead = MAX_PASSES;
        for w in &s.waiters {
            assert!(w.passes <= ahead, "passes {} behind {ahead}", w.passes);
            ahead = w.passes;
        }
        s.waiters.front().map_or(0, |w| w.passes)
    }

    /// Holds a permit: counts it in `held` (asserting at most `n`) until dropped.
    struct Held {
        _permit: Permit,
        held: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Held {
        fn new(permit: Permit, held: &Arc<std::sync::atomic::AtomicUsize>, n: usize) -> Self {
            let now = held.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            let held = Held { _permit: permit, held: held.clone() };
            assert!(now <= n, "{now} permits held at once, of {n}");
            held
        }
    }

    impl Drop for Held {
        fn drop(&mut self) {
            self.held.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Waits `units`: under paused time, that many milliseconds; else that many task yields.
    async fn pause(units: u64, real: bool) {
        if real {
            for _ in 0..units {
                tokio::task::yield_now().await;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(units)).await;
        }
    }

    /// `tasks` calls of random keys on `n` permits, each cancelled (or not) in a random way at a
    /// random point; `real`: on a multi-threaded runtime (yields for time). Checks the invariants
    /// throughout, then that every permit came back and never more than `n` were held; returns the
    /// most times a waiting call was passed over.
    async fn stress(seed: u64, n: usize, tasks: usize, real: bool) -> u32 {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let held = Arc::new(AtomicUsize::new(0));
        let p = KeyedPermits::new(n);
        let mut rng = fastrand::Rng::with_seed(seed);
        // Checks the invariants between any two steps; returns the most passes seen.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let checker = tokio::spawn({
            let (p, stop) = (p.clone(), stop.clone());
            async move {
                let mut most = 0;
                while !stop.load(Ordering::SeqCst) {
                    most = most.max(check_invariants(&p, n));
                    pause(1, real).await;
                }
                most
            }
        });
        let mut handles = Vec::new();
        let mut aborts = Vec::new();
        for t in 0..tasks {
            let (permits, held) = (p.clone(), held.clone());
            let key = match rng.u8(0..10) {
                0 => None,
                k => Some(u64::from(k % 4)),
            };
            let (mode, a, b) = (rng.u8(0..8), rng.u64(0..6), rng.u64(0..6));
            let task = async move {
                let (p, held) = (permits, &held);
                pause(a, real).await;
                match mode {
                    // Awaited to the end, held, dropped.
                    0 | 1 => {
                        let _h = Held::new(p.acquire(key).await, held, n);
                        pause(b, real).await;
                    }
                    // Dropped before the first poll (granted or queued), maybe after a wait.
                    2 => {
                        let acquire = p.acquire(key);
                        pause(b, real).await;
                        drop(acquire);
                    }
                    // Polled once; if queued, dropped later (maybe handed a permit meanwhile).
                    3 => {
                        let mut acquire = p.acquire(key);
                        if let Some(permit) = (&mut acquire).now_or_never() {
                            let _h = Held::new(permit, held, n);
                            pause(b, real).await;
                        } else {
                            pause(b, real).await;
                            drop(acquire);
                        }
                    }
                    // Timed out while waiting, or held.
                    4 => {
                        let got = if real {
                            tokio::select! { got = p.acquire(key) => Some(got), _ = pause(b, real) => None }
                        } else {
                            tokio::time::timeout(Duration::from_millis(b), p.acquire(key)).await.ok()
                        };
                        if let Some(permit) = got {
                            let _h = Held::new(permit, held, n);
                            pause(a, real).await;
                        }
                    }
                    // A cancellation that wins ties (as in llm.rs: biased, cancel first).
                    5 => {
                        let got = tokio::select! {
                            biased;
                            _ = pause(b, real) => None,
                            got = p.acquire(key) => Some(got),
                        };
                        if let Some(permit) = got {
                            let _h = Held::new(permit, held, n);
                            pause(a, real).await;
                        }
                    }
                    // A permit held across a panic of its task.
                    6 if t % 50 == 0 => {
                        let _h = Held::new(p.acquire(key).await, held, n);
                        pause(b, real).await;
                        std::panic::resume_unwind(Box::new("a task of the test panics holding a permit"));
                    }
                    // Acquired and held; aborted from outside at a random time (below).
                    _ => {
                        let _h = Held::new(p.acquire(key).await, held, n);
                        pause(b + 100, real).await;
                    }
                }
                check_invariants(&p, n);
            };
            let handle = tokio::spawn(task);
            if mode == 7 {
                aborts.push((rng.u64(0..12), handle.abort_handle()));
            }
            handles.push(handle);
            if t % 8 == 0 {
                pause(1, real).await;
                check_invariants(&p, n);
            }
        }
        for (after, abort) in aborts {
            pause(after, real).await;
            abort.abort();
        }
        let all = async {
            for h in handles {
                if let Err(e) = h.await {
                    assert!(e.is_cancelled() || e.is_panic(), "{e}");
                }
            }
        };
        // A lost permit leaves calls waiting forever.
        tokio::time::timeout(Duration::from_secs(60), all).await.expect("every call ends");
        stop.store(true, Ordering::SeqCst);
        let most_passes = checker.await.expect("the invariants held throughout");
        check_invariants(&p, n);
        assert_eq!(held.load(Ordering::SeqCst), 0);
        assert_eq!(p.available(), n, "every permit is back");
        let again: Vec<Permit> = (0..n).map(|_| p.acquire(Some(0)).now_or_never().expect("a free permit")).collect();
        assert!(p.acquire(None).now_or_never().is_none(), "no permit beyond {n}");
        drop(again);
        assert_eq!(p.available(), n);
        most_passes
    }

    #[tokio::test(start_paused = true)]
    async fn random_cancellations_lose_and_duplicate_no_permit() {
        let mut most_passes = 0;
        for seed in 0..8 {
            most_passes = most_passes.max(stress(seed, 1 + (seed as usize % 3), 600, false).await);
        }
        assert_eq!(most_passes, MAX_PASSES, "the pass limit was reached and kept");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn random_cancellations_across_threads_lose_and_duplicate_no_permit() {
        for seed in 100..104 {
            assert!(stress(seed, 1 + (seed as usize % 3), 1500, true).await <= MAX_PASSES);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_poisoned_state_lock_loses_no_permit() {
        let p = KeyedPermits::new(2);
        let state = p.state.clone();
        let poisoned = std::thread::spawn(move || {
            let _guard = state.lock();
            std::panic::resume_unwind(Box::new("poisons the lock"));
        })
        .join();
        assert!(poisoned.is_err() && p.state.is_poisoned());
        stress_on(&p).await;
        assert_eq!(p.available(), 2);
    }

    /// A few acquires, hand-overs and cancellations on `p` (2 permits).
    async fn stress_on(p: &KeyedPermits) {
        let a = p.acquire(Some(1)).await;
        let b = p.acquire(Some(2)).await;
        let queued = p.acquire(Some(1));
        let handed = p.acquire(Some(1));
        drop(queued);
        drop(a);
        drop(handed);
        let c = tokio::time::timeout(Duration::from_secs(1), p.acquire(None)).await.expect("free");
        drop(b);
        drop(c);
    }
}
