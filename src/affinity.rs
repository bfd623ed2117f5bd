//! Adaptive granularity: which key level a request routes by, and when a key is split, spread
//! over shards or merged back. Pure: no I/O, time passed in (`tokio::time::Instant`), tested
//! under paused time. The shared state in Redis and the background refresh are in
//! [`crate::splits`].
//!
//! # Routing
//!
//! Every request has key levels ([`crate::keying::level_key`]), from level 0 (short material,
//! e.g. a system prompt) to its finest level (long material, e.g. system + first user message).
//! A request routes by the **shortest level whose key is not split** ([`choose`]): a hot system
//! prompt fans out by conversation, and each conversation keeps its partition (and so its LLM
//! server and its cached prefix). A finest-level key that is itself hot (identical long
//! prefixes: nothing left to tell its requests apart) is **spread** over `sharding.max_shards`
//! random shards instead, the only case that scatters one prefix over several partitions.
//!
//! # When a key splits ([`LoadTracker`])
//!
//! The owner of each partition measures, per 1 s window, the queueing delay of the requests it
//! dequeues (router's forward → dequeue, header `x-routed-at-ms`; counted from the moment the
//! partition began consuming at the earliest: what a request waited in the input queue, for an
//! owner after a crash, or for an LLM endpoint through an outage, is not its partition's load)
//! and how many of them each routed key carried. A key is **hot** when, over the last [`SplitRules::delay_windows`] (3) windows,
//! - the partition's median queueing delay exceeds `max(2 s, 2 × batching.max_batch_wait)`: one
//!   batch wait is normal, two mean requests wait for earlier batches, i.e. the partition drains
//!   slower than its requests arrive;
//! - the key carried ≥ 50 % of the partition's requests: it is the cause, and moving it helps
//!   (a partition overloaded by many small keys is not helped by splitting any one of them);
//! - and the partition dequeued at least 10 requests in those windows (no decision on noise).
//!
//! Why queueing delay and not arrival rate × service time: the delay needs no model of the LLM
//! server (batch size, concurrency, prompt lengths, cache hits all change the service time), it
//! is measured where the bottleneck is, and it is already known per request. A short spike
//! (one slow batch) moves the median of 3 s of requests only when it delays most of them.
//!
//! A hot key is split (or spread) with its **drain rate** recorded: the requests per second the
//! partition dequeued while it was hot, i.e. what one partition manages.
//!
//! # When a dominant key splits ([`TrafficShares`])
//!
//! Queueing delay finds a key that one partition cannot *drain*. It misses a key that one
//! partition drains but whose working set one server cannot *cache*: a system prompt shared by
//! every conversation sends all conversations to one partition, so one server's KV cache holds all
//! of their histories while the other servers' caches sit idle (the Mooncake conversation trace:
//! its block 0 is in every request). So each router also counts the keys it routes by, per 1 s
//! window, and a key is **dominant** when, over the last [`SplitRules::delay_windows`] windows,
//! - it carried more than 50 % of all the requests this router routed, beyond chance: the
//!   one-sided 95 % lower bound of its share ([`share_lower_bound`]) is at least 0.5 (5 of 5
//!   requests, 8 of 10, 14 of 20; a key at 60 % needs about 70 requests, one at 50 % never
//!   dominates), so a key does not split because light traffic happened to favour it for a
//!   few seconds;
//! - it did so too, by the same bound, over the longer look: the last
//!   [`SplitRules::dominant_horizon`] (60) windows from the first one in which it appeared. The
//!   short test is repeated at every refresh, and repeated often enough a key at 30–45 % passes
//!   it now and then by chance (observed: keys at 32–42 % split within 26–100 s); a key that
//!   appears dominating (or dominates from the start) is judged on its own traffic at once, so
//!   this delays only a key that grows into dominance from a smaller share, by up to about half
//!   the look;
//! - it is not its requests' finest level (splitting keeps each conversation together at the
//!   next level; a finest key has no next level and is spread only when it is slow),
//! - and the windows hold at least [`SplitRules::dominant_min_requests`] (5) requests.
//!
//! Every request routed by a key before it splits may lose its conversation's cached start when
//! the split moves the conversation's next turn, so the rule decides on as few requests as the
//! bound allows: a router asks for a refresh at once when it has routed the requests the last
//! refresh lacked, and again each time as many requests again arrived while a key is dominant as
//! observed but not yet beyond chance ([`TrafficShares::observe`]).
//!
//! A dominant key is split without a drain rate; its merge rule measures against the highest
//! arrival rate it sustained for [`SplitRules::cool`] since the split instead (a shorter burst
//! does not set it). The deeper levels that do not tell its requests
//! apart (one key carries more than half of them, by the same bound: a system prompt longer than a level) are split with it
//! in the same decision ([`choose`] hands the router every deeper level's key), so its requests
//! route at once by the first level that tells them apart, e.g. the conversation.
//!
//! # When a key merges back ([`SplitLedger`])
//!
//! Routers count the arrivals of split keys (only of those), summed over all instances through
//! Redis. A split key merges back when its arrival rate has stayed at or below half its drain
//! rate for 10 s ([`SplitRules::cool`]) and it has been split for at least 30 s
//! ([`SplitRules::hold`]). Half: after the merge the one partition then runs at ≤ 50 % of what
//! it drained, far from the delay that split it (hysteresis). A key whose split was merged back
//! is not split again within the hold time either, so a key's decision changes at most once per
//! hold time.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;
use std::time::Duration;

use tokio::time::Instant;

use crate::keying::PrefixKey;

/// The numbers of the split and merge rule. [`SplitRules::new`] gives the documented defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitRules {
    /// Length of one measurement window (1 s).
    pub window: Duration,
    /// Windows the delay median and the key shares are taken over (3).
    pub delay_windows: usize,
    /// Median queueing delay above which a partition is overloaded: `max(2 s, 2 × max_batch_wait)`.
    pub delay_threshold: Duration,
    /// Share of the partition's requests a key must carry to be split (0.5).
    pub min_share: f64,
    /// Fewest requests in the delay windows for any decision (10).
    pub min_requests: u64,
    /// Least time between two decision changes of one key (30 s).
    pub hold: Duration,
    /// How long a split key's arrivals must stay at or below `merge_ratio × drain rate` (10 s).
    pub cool: Duration,
    /// Fraction of the drain rate below which a split key is cool (0.5).
    pub merge_ratio: f64,
    /// Shards a hot finest-level key is spread over (`sharding.max_shards`).
    pub max_shards: NonZeroU32,
    /// Share of a router's requests above which a key is dominant ([`TrafficShares`], 0.5),
    /// beyond chance ([`share_lower_bound`]).
    pub dominant_share: f64,
    /// Fewest requests in the windows for a dominance decision ([`DOMINANT_MIN_REQUESTS`], 5).
    pub dominant_min_requests: u64,
    /// Windows over which a dominant key must also carry more than `dominant_share` beyond
    /// chance, counted from the first of them in which it appeared ([`DOMINANT_HORIZON_WINDOWS`], 60).
    pub dominant_horizon: usize,
}

impl SplitRules {
    /// The documented defaults for `batching.max_batch_wait` and `sharding.max_shards`.
    pub fn new(max_batch_wait: Duration, max_shards: NonZeroU32) -> Self {
        SplitRules {
            window: Duration::from_secs(1),
            delay_windows: 3,
            delay_threshold: Duration::from_secs(2).max(max_batch_wait * 2),
            min_share: 0.5,
            min_requests: MIN_REQUESTS,
            hold: Duration::from_secs(30),
            cool: Duration::from_secs(10),
            merge_ratio: 0.5,
            max_shards,
            dominant_share: DOMINANT_SHARE,
            dominant_min_requests: DOMINANT_MIN_REQUESTS,
            dominant_horizon: DOMINANT_HORIZON_WINDOWS,
        }
    }
}

/// The key a request was routed by: its level, the number of levels it has, and the key.
/// Travels with the forwarded request as header `x-routed-key` = `"{level}/{levels}:{key hex}"`
/// (e.g. `"1/3:c934e2bc27728a8a"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RoutedKey {
    pub level: u8,
    /// Levels of the request ([`crate::keying::level_count`]); `level + 1 == levels` is the finest.
    pub levels: u8,
    pub key: PrefixKey,
}

impl RoutedKey {
    /// Whether this is the request's finest level (it can only be spread, not split).
    pub fn is_finest(&self) -> bool {
        self.level + 1 >= self.levels
    }
}

impl fmt::Display for RoutedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.level, self.levels, self.key)
    }
}

/// A malformed `x-routed-key` or split member.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed routed key {0:?}")]
pub struct BadKey(pub String);

fn parse_hex(s: &str, whole: &str) -> Result<PrefixKey, BadKey> {
    u64::from_str_radix(s, 16).map(PrefixKey).map_err(|_| BadKey(whole.to_owned()))
}

impl FromStr for RoutedKey {
    type Err = BadKey;
    fn from_str(s: &str) -> Result<Self, BadKey> {
        let bad = || BadKey(s.to_owned());
        let (lv, hex) = s.split_once(':').ok_or_else(bad)?;
        let (level, levels) = lv.split_once('/').ok_or_else(bad)?;
        let (level, levels) = (level.parse().map_err(|_| bad())?, levels.parse().map_err(|_| bad())?);
        if level >= levels {
            return Err(bad());
        }
        Ok(RoutedKey { level, levels, key: parse_hex(hex, s)? })
    }
}

/// What the split set says about one (level, key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SplitState {
    /// Requests route by their next level.
    Split,
    /// Requests stay at this level, spread over this many random shards.
    Spread(NonZeroU32),
}

/// One entry of the split set. Stored in Redis as member `"{level}:{key hex}"` (split) or
/// `"{level}:{key hex}:{shards}"` (spread).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SplitMember {
    pub level: u8,
    pub key: PrefixKey,
    pub state: SplitState,
}

impl fmt::Display for SplitMember {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.state {
            SplitState::Split => write!(f, "{}:{}", self.level, self.key),
            SplitState::Spread(n) => write!(f, "{}:{}:{}", self.level, self.key, n),
        }
    }
}

impl FromStr for SplitMember {
    type Err = BadKey;
    fn from_str(s: &str) -> Result<Self, BadKey> {
        let bad = || BadKey(s.to_owned());
        let mut parts = s.split(':');
        let level = parts.next().and_then(|l| l.parse().ok()).ok_or_else(bad)?;
        let key = parse_hex(parts.next().ok_or_else(bad)?, s)?;
        let state = match parts.next() {
            None => SplitState::Split,
            Some(n) => SplitState::Spread(n.parse().map_err(|_| bad())?),
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(SplitMember { level, key, state })
    }
}

/// The split set as one instance sees it (its local view, refreshed from Redis).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SplitView {
    entries: HashMap<(u8, PrefixKey), SplitState>,
}

impl SplitView {
    /// A view of `members` (a key listed twice keeps its last state).
    pub fn new(members: impl IntoIterator<Item = SplitMember>) -> Self {
        SplitView { entries: members.into_iter().map(|m| ((m.level, m.key), m.state)).collect() }
    }
    /// The state of `key` at `level`; `None`: not split.
    pub fn get(&self, level: u8, key: PrefixKey) -> Option<SplitState> {
        self.entries.get(&(level, key)).copied()
    }
    /// Every entry, in no particular order.
    pub fn members(&self) -> impl Iterator<Item = SplitMember> + '_ {
        self.entries.iter().map(|(&(level, key), &state)| SplitMember { level, key, state })
    }
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// Whether nothing is split.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Entries per level (index = level; levels above the last entry are absent).
    pub fn per_level(&self) -> Vec<usize> {
        let mut n = Vec::new();
        for (level, _) in self.entries.keys() {
            let l = usize::from(*level);
            if n.len() <= l {
                n.resize(l + 1, 0);
            }
            n[l] += 1;
        }
        n
    }
    /// Decision changes from `self` to `next`: entries added, removed or changed.
    pub fn moves_to(&self, next: &SplitView) -> usize {
        let changed = next.entries.iter().filter(|(k, v)| self.entries.get(k) != Some(v)).count();
        changed + self.entries.keys().filter(|k| !next.entries.contains_key(k)).count()
    }
}

/// Where [`choose`] routes a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub routed: RoutedKey,
    /// Shards to pick from: 1 unless the routed key is spread.
    pub shards: NonZeroU32,
    /// The split entries the request passed through (their arrivals are counted for merging),
    /// the spread routed key included.
    pub through: Vec<SplitMember>,
    /// The request's keys of the levels below the routed one, in order (empty when the routed
    /// key is spread or the finest): a dominant key's split looks at them ([`TrafficShares`]).
    pub deeper: Vec<PrefixKey>,
}

/// Routes by the shortest level whose key is not split: level by level from 0, computing each
/// level's key only when the level before it is split (`key_at(level)`, called for
/// `level < levels` only), then the keys of the levels below the routed one ([`Choice::deeper`]).
/// A spread key stays at its level with its shards; the finest level is never split (a `Split`
/// entry there, which a request with fewer levels than the one that split it may meet, counts
/// as not split).
pub fn choose(view: &SplitView, levels: u8, mut key_at: impl FnMut(u8) -> PrefixKey) -> Choice {
    let one = NonZeroU32::MIN;
    let levels = levels.max(1);
    let mut through = Vec::new();
    for level in 0..levels {
        let key = key_at(level);
        let routed = RoutedKey { level, levels, key };
        match view.get(level, key) {
            Some(SplitState::Split) if !routed.is_finest() => {
                through.push(SplitMember { level, key, state: SplitState::Split });
            }
            Some(SplitState::Spread(n)) => {
                through.push(SplitMember { level, key, state: SplitState::Spread(n) });
                return Choice { routed, shards: n, through, deeper: Vec::new() };
            }
            _ => {
                let deeper = (level + 1..levels).map(&mut key_at).collect();
                return Choice { routed, shards: one, through, deeper };
            }
        }
    }
    unreachable!("the finest level always returns")
}

/// One window of one partition's dequeues.
#[derive(Debug, Default, Clone)]
struct Window {
    delays_ms: Vec<u64>,
    keys: HashMap<RoutedKey, u64>,
}

/// A key found hot by [`LoadTracker::tick`]: the new split entry to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct HotKey {
    pub partition: u32,
    pub member: SplitMember,
    /// Share of the partition's requests the key carried (0..1).
    pub share: f64,
    /// Requests per second the partition dequeued over the delay windows.
    pub drain_rps: f64,
    /// Median queueing delay of the partition over the delay windows.
    pub median_delay: Duration,
}

/// Per-partition load at the partition owner: queueing delays and key shares per window. A
/// partition this instance stops owning keeps closing empty windows, which never make a key hot.
#[derive(Debug, Default)]
pub struct LoadTracker {
    /// Closed windows (the newest last, at most `delay_windows`) and the open one, per partition.
    partitions: HashMap<u32, (VecDeque<Window>, Window)>,
    /// Start of the open window.
    window_start: Option<Instant>,
}

impl LoadTracker {
    /// Records one dequeued request of `partition`, routed by `routed`, that waited `queued`.
    pub fn observe(&mut self, partition: u32, routed: RoutedKey, queued: Duration) {
        let (_, open) = self.partitions.entry(partition).or_default();
        open.delays_ms.push(queued.as_millis() as u64);
        *open.keys.entry(routed).or_default() += 1;
    }

    /// Closes the open window when `rules.window` has passed since it opened and returns the
    /// keys that are hot by the rule of the module doc. A hot finest-level key becomes a spread
    /// entry with `max_shards`; a key already spread that is hot again is not returned (nothing
    /// left to do: [`KeyHygiene`] reports it).
    pub fn tick(&mut self, now: Instant, rules: &SplitRules, view: &SplitView) -> Vec<HotKey> {
        let start = *self.window_start.get_or_insert(now);
        if now.saturating_duration_since(start) < rules.window {
            return Vec::new();
        }
        self.window_start = Some(now);
        let secs = rules.window.as_secs_f64() * rules.delay_windows as f64;
        let mut hot = Vec::new();
        for (&partition, (closed, open)) in &mut self.partitions {
            closed.push_back(std::mem::take(open));
            while closed.len() > rules.delay_windows {
                closed.pop_front();
            }
            if closed.len() < rules.delay_windows {
                continue;
            }
            let mut delays: Vec<u64> = closed.iter().flat_map(|w| w.delays_ms.iter().copied()).collect();
            let n = delays.len() as u64;
            if n < rules.min_requests {
                continue;
            }
            let mid = delays.len() / 2;
            let median = Duration::from_millis(*delays.select_nth_unstable(mid).1);
            if median <= rules.delay_threshold {
                continue;
            }
            let mut keys: HashMap<RoutedKey, u64> = HashMap::new();
            for w in closed.iter() {
                for (k, c) in &w.keys {
                    *keys.entry(*k).or_default() += c;
                }
            }
            let Some((&routed, &count)) = keys.iter().max_by_key(|(k, c)| (**c, **k)) else { continue };
            let share = count as f64 / n as f64;
            if share < rules.min_share {
                continue;
            }
            let state = if routed.is_finest() { SplitState::Spread(rules.max_shards) } else { SplitState::Split };
            if matches!(view.get(routed.level, routed.key), Some(SplitState::Spread(_))) {
                continue;
            }
            let member = SplitMember { level: routed.level, key: routed.key, state };
            hot.push(HotKey { partition, member, share, drain_rps: n as f64 / secs, median_delay: median });
        }
        hot
    }
}

/// A key found dominant by [`TrafficShares::tick`]: the new split entries to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct DominantKey {
    /// The dominant key, then each deeper level's key that carries ≥ `dominant_share` of its
    /// requests (the levels that do not tell them apart), down to the level above the first
    /// one that does (never the finest).
    pub members: Vec<SplitMember>,
    /// Share of the router's requests the key carried (0..1).
    pub share: f64,
    /// Requests the router routed over the windows.
    pub requests: u64,
}

/// Routed-key counts of one window: (routed key, the keys of its deeper levels) → requests.
type ShareWindow = HashMap<(RoutedKey, Vec<PrefixKey>), u64>;

/// Whether requests still route by `k` under `view` (not split past it).
fn routed_by(view: &SplitView, k: &RoutedKey) -> bool {
    k.is_finest() || view.get(k.level, k.key) != Some(SplitState::Split)
}

/// Lower bound of the share a key carries, from `count` of `requests` observed: the lower end of
/// the Wilson score interval at z = 1.645, i.e. a one-sided 95 % bound (E. B. Wilson, "Probable
/// inference, the law of succession, and statistical inference", JASA 22, 1927). A key whose
/// observed share is above [`DOMINANT_SHARE`] only by chance, over the few requests of light
/// traffic, is not dominant: 5 of 5 requests give 0.65 and 8 of 10 give 0.54, but 4 of 5 only
/// 0.44, 6 of 10 only 0.35 and 100 of 200 0.44.
pub fn share_lower_bound(count: u64, requests: u64) -> f64 {
    if requests == 0 {
        return 0.0;
    }
    const Z: f64 = 1.645;
    let (n, p) = (requests as f64, count as f64 / requests as f64);
    let z2 = Z * Z;
    (p + z2 / (2.0 * n) - Z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt()) / (1.0 + z2 / n)
}

/// Fewest requests in the measurement windows for a split by queueing delay ([`SplitRules::min_requests`]).
pub const MIN_REQUESTS: u64 = 10;

/// Fewest requests in the measurement windows for a split by dominance
/// ([`SplitRules::dominant_min_requests`]). Fewer than [`MIN_REQUESTS`] because the share must
/// also be dominant beyond chance ([`share_lower_bound`]): a key that carries every request
/// splits after 5, and the fewer requests routed by a key that is about to split, the fewer
/// conversations lose their cached start when it does.
pub const DOMINANT_MIN_REQUESTS: u64 = 5;

/// Windows of the longer look a dominant key must also pass ([`SplitRules::dominant_horizon`]):
/// the share test of the last few seconds alone, repeated at every refresh, lets a key at 30–45 %
/// of the traffic pass now and then by chance (observed: keys at 32 %, 40 % and 42 % split within
/// 26–100 s, with 12, 10 and 7 of a router's requests), and a dominance split stays until the key's
/// traffic halves.
pub const DOMINANT_HORIZON_WINDOWS: usize = 60;

/// Per-router counts of the routed keys, per window, for the dominance rule of the module doc.
#[derive(Debug)]
pub struct TrafficShares {
    /// Closed windows (the newest last, at most `delay_windows`) and the open one.
    closed: VecDeque<ShareWindow>,
    /// The routed-key counts of the closed windows of the longer look (newest last, at most
    /// `dominant_horizon`).
    history: VecDeque<HashMap<RoutedKey, u64>>,
    open: ShareWindow,
    window_start: Option<Instant>,
    /// Requests observed since the last [`TrafficShares::tick`].
    since_tick: u64,
    /// Requests after which the next early tick is due: those the last tick lacked to reach
    /// `dominant_min_requests` ([`DOMINANT_MIN_REQUESTS`] before the first tick), or as many as
    /// the windows held when a key was dominant as observed but not beyond chance; 0 otherwise.
    short_by: u64,
}

impl Default for TrafficShares {
    fn default() -> Self {
        TrafficShares {
            closed: VecDeque::new(),
            history: VecDeque::new(),
            open: ShareWindow::default(),
            window_start: None,
            since_tick: 0,
            short_by: DOMINANT_MIN_REQUESTS,
        }
    }
}

impl TrafficShares {
    /// Records one routed request. Returns `true` once the requests observed since the last
    /// [`TrafficShares::tick`] make up the `dominant_min_requests` that tick lacked (at start:
    /// the first [`DOMINANT_MIN_REQUESTS`] requests), or, when that tick found a key dominant as
    /// observed but not beyond chance, as many requests as the windows held (10, 20, 40, …: a
    /// burst routed between two refreshes is decided within it): the caller may then tick at
    /// once instead of waiting for its next refresh, so a key that dominates from the first
    /// request splits after 5 requests, not after 5 plus a refresh interval of them. At most
    /// once per tick; at steady load the windows hold more requests than arrive between two
    /// refreshes, so it does not fire there.
    pub fn observe(&mut self, choice: &Choice) -> bool {
        *self.open.entry((choice.routed, choice.deeper.clone())).or_default() += 1;
        self.since_tick += 1;
        self.short_by > 0 && self.since_tick == self.short_by
    }

    /// Closes the open window when `rules.window` has passed since it opened and returns the
    /// dominant key, if any: a key not in `view` (neither split nor spread) that is not its
    /// requests' finest level, carrying more than `dominant_share` beyond chance
    /// ([`share_lower_bound`]) of ≥ `dominant_min_requests` requests over
    /// the last `delay_windows` windows and the open one (fewer windows when they already hold
    /// enough requests; requests counted under a key split since then are left out). Its deeper levels that do
    /// not tell its requests apart are split with it, so the requests route at once by the
    /// first level that does.
    pub fn tick(&mut self, now: Instant, rules: &SplitRules, view: &SplitView) -> Option<DominantKey> {
        let start = *self.window_start.get_or_insert(now);
        if now.saturating_duration_since(start) >= rules.window {
            self.window_start = Some(now);
            let mut keys: HashMap<RoutedKey, u64> = HashMap::new();
            for ((k, _), c) in &self.open {
                *keys.entry(*k).or_default() += c;
            }
            self.history.push_back(keys);
            while self.history.len() > rules.dominant_horizon {
                self.history.pop_front();
            }
            self.closed.push_back(std::mem::take(&mut self.open));
            while self.closed.len() > rules.delay_windows {
                self.closed.pop_front();
            }
        }
        // The open window counts too, so a key that dominates from the start splits as soon as
        // `dominant_min_requests` arrived. Keys split since they were counted route by a deeper level now:
        // their requests count again under those keys.
        let counted = || self.closed.iter().chain(std::iter::once(&self.open)).flatten().filter(|((k, _), _)| routed_by(view, k));
        let mut keys: HashMap<RoutedKey, u64> = HashMap::new();
        for ((k, _), c) in counted() {
            *keys.entry(*k).or_default() += c;
        }
        let requests: u64 = keys.values().sum();
        self.since_tick = 0;
        self.short_by = rules.dominant_min_requests.saturating_sub(requests);
        if requests < rules.dominant_min_requests {
            return None;
        }
        let (&routed, &count) = keys.iter().max_by_key(|(k, c)| (**c, **k))?;
        let share = count as f64 / requests as f64;
        if routed.is_finest() || view.get(routed.level, routed.key).is_some() || share <= rules.dominant_share {
            return None;
        }
        if share_lower_bound(count, requests) < rules.dominant_share {
            // Undecided: dominant as observed, but not beyond chance yet. Ask for another tick as
            // soon as as many requests again have arrived (10, 20, 40, … requests: a burst routed
            // between two refreshes is decided within it, and at steady load the windows already
            // hold more requests than arrive between two refreshes, so this never fires there).
            self.short_by = requests;
            return None;
        }
        if !self.sustained(routed, rules, view) {
            return None;
        }
        let split = |level: u8, key: PrefixKey| SplitMember { level, key, state: SplitState::Split };
        let mut members = vec![split(routed.level, routed.key)];
        // Walk down while one deeper key carries the dominant share of the key's requests.
        let mut chosen: Vec<PrefixKey> = Vec::new();
        for depth in 0..usize::from(routed.levels - routed.level - 1) {
            let level = routed.level + 1 + depth as u8;
            if level + 1 >= routed.levels {
                break; // the finest level is routed by, never split
            }
            let mut next: HashMap<PrefixKey, u64> = HashMap::new();
            for ((_, deeper), c) in counted().filter(|((k, d), _)| *k == routed && d.starts_with(&chosen) && d.len() > depth) {
                *next.entry(deeper[depth]).or_default() += c;
            }
            match next.into_iter().max_by_key(|(k, c)| (*c, *k)) {
                Some((key, c)) if share_lower_bound(c, count) >= rules.dominant_share => {
                    members.push(split(level, key));
                    chosen.push(key);
                }
                _ => break,
            }
        }
        Some(DominantKey { members, share, requests })
    }

    /// Whether `routed` also carried more than `dominant_share`, beyond chance, of the requests
    /// this router routed over the longer look: the last `dominant_horizon` windows and the open
    /// one, from the first window in which `routed` appeared (so a key that arrives dominating,
    /// or dominates from the start, is judged on its own traffic at once, while a key that has
    /// long carried less than half is not split by a few seconds that favoured it). Requests
    /// counted under keys split since are left out, as in [`TrafficShares::tick`].
    fn sustained(&self, routed: RoutedKey, rules: &SplitRules, view: &SplitView) -> bool {
        let open: HashMap<RoutedKey, u64> = self.open.iter().fold(HashMap::new(), |mut m, ((k, _), c)| {
            *m.entry(*k).or_default() += c;
            m
        });
        let windows: Vec<&HashMap<RoutedKey, u64>> = self.history.iter().chain(std::iter::once(&open)).collect();
        let Some(first) = windows.iter().position(|w| w.get(&routed).is_some_and(|c| *c > 0)) else { return false };
        let (mut count, mut requests) = (0, 0);
        for w in &windows[first..] {
            count += w.get(&routed).copied().unwrap_or(0);
            requests += w.iter().filter(|(k, _)| routed_by(view, k)).map(|(_, c)| c).sum::<u64>();
        }
        share_lower_bound(count, requests) >= rules.dominant_share
    }
}

/// What [`SplitLedger::review`] says about one split entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Keep it (and refresh its expiry).
    Keep,
    /// Merge it back: remove it from the split set.
    Merge,
}

#[derive(Debug, Clone)]
struct Tracked {
    seen_at: Instant,
    below_since: Option<Instant>,
    /// Highest arrival rate sustained for `rules.cool` since the entry was first seen
    /// (requests/s): the lowest rate reviewed over such a stretch, so a burst shorter than it
    /// (a paused instance's prefetch handed back at once, a publisher's spike) does not make the
    /// key's steady traffic look cool afterwards.
    peak_rps: f64,
    /// The rates reviewed over the last `rules.cool`, oldest first.
    recent: VecDeque<(Instant, f64)>,
}

impl Tracked {
    fn new(now: Instant) -> Self {
        Tracked { seen_at: now, below_since: None, peak_rps: 0.0, recent: VecDeque::new() }
    }

    /// Takes in the rate reviewed at `now` and raises the sustained peak. After a gap of `cool`
    /// or more since the last review (Redis unreachable, the process stopped), no stretch before
    /// it counts: neither toward the cool time nor toward the peak.
    fn observe(&mut self, now: Instant, rps: f64, cool: Duration) {
        if self.recent.back().is_some_and(|(t, _)| now.saturating_duration_since(*t) >= cool) {
            self.recent.clear();
            self.below_since = None;
        }
        self.recent.push_back((now, rps));
        // Keep one review at or before the start of the stretch, so the stretch is covered.
        while self.recent.len() > 1 && now.saturating_duration_since(self.recent[1].0) >= cool {
            self.recent.pop_front();
        }
        if now.saturating_duration_since(self.recent[0].0) >= cool {
            let sustained = self.recent.iter().map(|(_, r)| *r).fold(f64::INFINITY, f64::min);
            self.peak_rps = self.peak_rps.max(sustained);
        }
    }
}

/// Each instance's memory of the split set over time: when it first saw each entry (the hold
/// time runs from there), since when each entry has been cool, and when keys last changed (so a
/// merged key is not split again within the hold time).
#[derive(Debug, Default)]
pub struct SplitLedger {
    tracked: HashMap<(u8, PrefixKey), Tracked>,
    changed_at: HashMap<(u8, PrefixKey), Instant>,
}

impl SplitLedger {
    /// Takes in a refreshed view: new entries start their hold time, vanished ones are recorded
    /// as changed now.
    pub fn update(&mut self, now: Instant, view: &SplitView) {
        self.tracked.retain(|k, _| {
            let keep = view.entries.contains_key(k);
            if !keep {
                self.changed_at.insert(*k, now);
            }
            keep
        });
        for k in view.entries.keys() {
            self.tracked.entry(*k).or_insert_with(|| {
                self.changed_at.insert(*k, now);
                Tracked::new(now)
            });
        }
    }

    /// Whether `key` at `level` changed decision less than `hold` ago (then it must not change
    /// again). Also forgets changes older than `hold`.
    pub fn holding(&mut self, now: Instant, hold: Duration, level: u8, key: PrefixKey) -> bool {
        self.changed_at.retain(|_, t| now.saturating_duration_since(*t) < hold);
        self.changed_at.contains_key(&(level, key))
    }

    /// Reviews one entry of the current view given its recorded drain rate and its current
    /// arrival rate (requests per second, all instances): merge when split for at least
    /// `rules.hold` and at or below `merge_ratio × drain_rps` for at least `rules.cool`. A drain
    /// rate ≤ 0 (a dominant key, split without one) stands for the highest arrival rate sustained
    /// for `rules.cool` since the split (not the highest reviewed: a short burst would raise it,
    /// and the key's unchanged traffic would then merge it back while it still dominates).
    /// Call it once per fresh rate: a rate reviewed again (a refresh that got no answer) would
    /// count toward the cool time as if it had been measured again.
    pub fn review(&mut self, now: Instant, rules: &SplitRules, member: &SplitMember, drain_rps: f64, arrivals_rps: f64) -> Verdict {
        let t = self.tracked.entry((member.level, member.key)).or_insert_with(|| Tracked::new(now));
        t.observe(now, arrivals_rps, rules.cool);
        let basis = if drain_rps > 0.0 { drain_rps } else { t.peak_rps };
        if arrivals_rps <= rules.merge_ratio * basis {
            let since = *t.below_since.get_or_insert(now);
            let held = now.saturating_duration_since(t.seen_at) >= rules.hold;
            if held && now.saturating_duration_since(since) >= rules.cool {
                return Verdict::Merge;
            }
        } else {
            t.below_since = None;
        }
        Verdict::Keep
    }
}

/// Shortest key material a server can cache: one KV-cache block of 16 tokens (vLLM's default
/// `--block-size`, <https://docs.vllm.ai/en/latest/configuration/engine_args.html>) at about 4
/// characters per token.
pub const SHORT_MATERIAL_CHARS: usize = 64;
/// Requests per [`KeyHygiene`] window.
pub const HYGIENE_WINDOW: usize = 200;
/// Longest [`KeyHygiene`] window: one that has not seen [`HYGIENE_WINDOW`] requests closes
/// after this long, so the gauges follow light traffic and fall to 0 when traffic stops.
pub const HYGIENE_MAX_WINDOW: Duration = Duration::from_secs(60);
/// A [`KeyHygiene`] window with requests closes when none came for this long: the end of a
/// burst is judged while it is recent, not a minute later, after the silence that followed.
pub const HYGIENE_IDLE: Duration = Duration::from_secs(10);
/// Fewest requests in a window for a hygiene warning (and a non-zero unsplittable share): with
/// fewer, one request alone would be "volatile" and one key would "carry all traffic".
pub const HYGIENE_MIN_REQUESTS: usize = 20;
/// Share of distinct level-0 keys in a window above which key material looks volatile.
pub const VOLATILE_DISTINCT: f64 = 0.95;
/// Share of a window's requests above which a key "carries most of the traffic".
pub const DOMINANT_SHARE: f64 = 0.5;

/// What [`KeyHygiene`] found over one window: [`HYGIENE_WINDOW`] routed requests, or fewer
/// over [`HYGIENE_MAX_WINDOW`].
#[derive(Debug, Clone, PartialEq)]
pub struct HygieneReport {
    /// Requests in the window.
    pub requests: usize,
    /// Distinct level-0 keys ÷ requests.
    pub distinct: f64,
    /// Share of requests whose level-0 material is shorter than [`SHORT_MATERIAL_CHARS`].
    pub short: f64,
    /// Shares of the 5 most frequent routed keys, largest first (fewer when fewer keys).
    pub top_shares: Vec<f64>,
    /// The routed key with the largest share, when it cannot be split any further (spread over
    /// `max_shards` already, or a static override), with its share; `None` in a window of fewer
    /// than [`HYGIENE_MIN_REQUESTS`].
    pub unsplittable: Option<(RoutedKey, f64)>,
}

impl HygieneReport {
    /// Whether the window has requests enough to judge.
    fn judged(&self) -> bool {
        self.requests >= HYGIENE_MIN_REQUESTS
    }
    /// Nearly every request has its own key: e.g. a timestamp or request id at the start of
    /// the prompt, so nothing is shared and batching by key does nothing.
    pub fn volatile(&self) -> bool {
        self.judged() && self.distinct >= VOLATILE_DISTINCT
    }
    /// Most key material is shorter than a cache block: keys group requests that share less
    /// than the server can reuse.
    pub fn short_material(&self) -> bool {
        self.judged() && self.short >= 0.5
    }
    /// One key that cannot be split carries most of the traffic.
    pub fn dominant_unsplittable(&self) -> Option<(RoutedKey, f64)> {
        self.unsplittable.filter(|(_, s)| *s >= DOMINANT_SHARE)
    }
}

/// Key hygiene at the router, per window of [`HYGIENE_WINDOW`] requests or
/// [`HYGIENE_MAX_WINDOW`], whichever ends first.
#[derive(Debug, Default)]
pub struct KeyHygiene {
    level0: HashMap<PrefixKey, u32>,
    routed: HashMap<RoutedKey, (u32, bool)>,
    short: u32,
    n: usize,
    /// When the current window opened (`None` until the first request or tick).
    opened: Option<Instant>,
    /// When its last request came.
    last: Option<Instant>,
}

impl KeyHygiene {
    /// Records one routed request at `now`; returns the report when this request closes a
    /// window. `material_chars`: length of its level-0 material; `unsplittable`: whether its
    /// routed key can be split no further.
    pub fn observe(&mut self, now: Instant, level0: PrefixKey, material_chars: usize, routed: RoutedKey, unsplittable: bool) -> Option<HygieneReport> {
        self.opened.get_or_insert(now);
        self.last = Some(now);
        *self.level0.entry(level0).or_default() += 1;
        let e = self.routed.entry(routed).or_default();
        e.0 += 1;
        e.1 = unsplittable;
        self.short += u32::from(material_chars < SHORT_MATERIAL_CHARS);
        self.n += 1;
        (self.n >= HYGIENE_WINDOW).then(|| self.close(now))
    }

    /// Closes the window at `now` when it has lasted [`HYGIENE_MAX_WINDOW`], or has requests
    /// and none for [`HYGIENE_IDLE`], with the requests it has (none: a report of zeros), and
    /// returns its report.
    pub fn tick(&mut self, now: Instant) -> Option<HygieneReport> {
        let opened = *self.opened.get_or_insert(now);
        let idle = self.last.is_some_and(|t| now.saturating_duration_since(t) >= HYGIENE_IDLE);
        (idle || now.saturating_duration_since(opened) >= HYGIENE_MAX_WINDOW).then(|| self.close(now))
    }

    fn close(&mut self, now: Instant) -> HygieneReport {
        let requests = self.n;
        let n = requests.max(1) as f64;
        let mut top: Vec<(RoutedKey, (u32, bool))> = self.routed.drain().collect();
        top.sort_unstable_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(&b.0)));
        let report = HygieneReport {
            requests,
            distinct: self.level0.len() as f64 / n,
            short: f64::from(self.short) / n,
            top_shares: top.iter().take(5).map(|(_, (c, _))| f64::from(*c) / n).collect(),
            unsplittable: top
                .first()
                .filter(|(_, (_, u))| *u && requests >= HYGIENE_MIN_REQUESTS)
                .map(|(k, (c, _))| (*k, f64::from(*c) / n)),
        };
        *self = KeyHygiene { opened: Some(now), ..KeyHygiene::default() };
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> SplitRules {
        SplitRules::new(Duration::from_secs(1), NonZeroU32::new(8).unwrap())
    }

    fn rk(level: u8, levels: u8, key: u64) -> RoutedKey {
        RoutedKey { level, levels, key: PrefixKey(key) }
    }

    fn split(level: u8, key: u64) -> SplitMember {
        SplitMember { level, key: PrefixKey(key), state: SplitState::Split }
    }

    #[test]
    fn rule_numbers() {
        let r = rules();
        assert_eq!(r.delay_threshold, Duration::from_secs(2));
        assert_eq!(SplitRules::new(Duration::from_secs(3), r.max_shards).delay_threshold, Duration::from_secs(6));
    }

    #[test]
    fn routed_keys_and_members_round_trip() {
        let k = rk(1, 3, 0xc934e2bc27728a8a);
        assert_eq!(k.to_string(), "1/3:c934e2bc27728a8a");
        assert_eq!("1/3:c934e2bc27728a8a".parse::<RoutedKey>(), Ok(k));
        for bad in ["", "1:ab", "3/3:ab", "x/3:ab", "1/3:zz", "1/3"] {
            assert!(bad.parse::<RoutedKey>().is_err(), "{bad}");
        }
        let m = SplitMember { level: 2, key: PrefixKey(0xab), state: SplitState::Spread(NonZeroU32::new(8).unwrap()) };
        assert_eq!(m.to_string(), "2:00000000000000ab:8");
        assert_eq!("2:00000000000000ab:8".parse::<SplitMember>(), Ok(m));
        assert_eq!("0:ff".parse::<SplitMember>(), Ok(split(0, 0xff)));
        for bad in ["", "0", "0:ff:0", "0:ff:8:1", "a:ff"] {
            assert!(bad.parse::<SplitMember>().is_err(), "{bad}");
        }
    }

    #[test]
    fn routes_by_the_shortest_level_not_split_and_hands_over_the_deeper_keys() {
        let keys = [10u64, 11, 12, 13];
        let mut asked = Vec::new();
        let c = choose(&SplitView::default(), 4, |l| {
            asked.push(l);
            PrefixKey(keys[usize::from(l)])
        });
        assert_eq!((c.routed, c.shards.get(), asked), (rk(0, 4, 10), 1, vec![0, 1, 2, 3]), "each level once");
        assert_eq!(c.deeper, vec![PrefixKey(11), PrefixKey(12), PrefixKey(13)]);
        assert!(c.through.is_empty());

        let view = SplitView::new([split(0, 10), split(1, 11)]);
        let c = choose(&view, 4, |l| PrefixKey(keys[usize::from(l)]));
        assert_eq!((c.routed, c.shards.get(), c.deeper.clone()), (rk(2, 4, 12), 1, vec![PrefixKey(13)]));
        assert_eq!(c.through, vec![split(0, 10), split(1, 11)]);

        // The finest level is spread, never split.
        let eight = NonZeroU32::new(8).unwrap();
        let spread = SplitMember { level: 3, key: PrefixKey(13), state: SplitState::Spread(eight) };
        let view = SplitView::new([split(0, 10), split(1, 11), split(2, 12), spread]);
        let c = choose(&view, 4, |l| PrefixKey(keys[usize::from(l)]));
        assert_eq!((c.routed, c.shards), (rk(3, 4, 13), eight));
        assert_eq!(c.through.len(), 4);
        assert!(c.deeper.is_empty());
        let view = SplitView::new([split(0, 10)]);
        let c = choose(&view, 1, |_| PrefixKey(10));
        assert_eq!((c.routed, c.shards.get()), (rk(0, 1, 10), 1), "a split entry at a request's finest level");
    }

    fn feed(t: &mut LoadTracker, p: u32, key: RoutedKey, n: usize, delay_ms: u64) {
        for _ in 0..n {
            t.observe(p, key, Duration::from_millis(delay_ms));
        }
    }

    /// Drives `secs` windows of load and returns the hot keys of each tick.
    fn run(t: &mut LoadTracker, secs: u64, mut load: impl FnMut(&mut LoadTracker, u64)) -> Vec<Vec<HotKey>> {
        let view = SplitView::default();
        let mut out = Vec::new();
        let start = Instant::now();
        t.tick(start, &rules(), &view);
        for s in 1..=secs {
            load(t, s);
            out.push(t.tick(start + Duration::from_secs(s), &rules(), &view));
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn splits_after_sustained_delay() {
        let mut t = LoadTracker::default();
        let hot = rk(0, 4, 1);
        let ticks = run(&mut t, 4, |t, _| {
            feed(t, 7, hot, 8, 3_000);
            feed(t, 7, rk(0, 4, 2), 2, 3_000);
        });
        assert!(ticks[0].is_empty() && ticks[1].is_empty(), "needs 3 windows");
        let h = &ticks[2][0];
        assert_eq!((h.partition, h.member), (7, split(0, 1)));
        assert!((h.share - 0.8).abs() < 1e-9 && (h.drain_rps - 10.0).abs() < 1e-9, "{h:?}");
        assert_eq!(h.median_delay, Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn no_split_on_a_short_spike_a_small_key_or_little_traffic() {
        let hot = rk(0, 4, 1);
        // One slow window among fast ones.
        let ticks = run(&mut LoadTracker::default(), 6, |t, s| feed(t, 1, hot, 10, if s == 3 { 9_000 } else { 100 }));
        assert!(ticks.iter().all(Vec::is_empty), "{ticks:?}");
        // Delayed, but no key carries half the partition.
        let ticks = run(&mut LoadTracker::default(), 4, |t, _| {
            for k in 0..5 {
                feed(t, 1, rk(0, 4, k), 4, 5_000);
            }
        });
        assert!(ticks.iter().all(Vec::is_empty));
        // Too few requests to judge.
        let ticks = run(&mut LoadTracker::default(), 4, |t, _| feed(t, 1, hot, 3, 5_000));
        assert!(ticks.iter().all(Vec::is_empty));
    }

    #[tokio::test(start_paused = true)]
    async fn a_hot_finest_key_is_spread_over_max_shards_once() {
        let mut t = LoadTracker::default();
        let finest = rk(2, 3, 9);
        let ticks = run(&mut t, 3, |t, _| feed(t, 4, finest, 10, 4_000));
        let spread = SplitMember { level: 2, key: PrefixKey(9), state: SplitState::Spread(NonZeroU32::new(8).unwrap()) };
        assert_eq!(ticks[2][0].member, spread);
        // Already spread: nothing more to decide.
        feed(&mut t, 4, finest, 10, 4_000);
        let later = Instant::now() + Duration::from_secs(10);
        assert!(t.tick(later, &rules(), &SplitView::new([spread])).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn merges_only_after_hold_and_cool_time() {
        let (r, m, mut ledger, t0) = one_split();
        assert!(ledger.holding(t0, r.hold, 0, PrefixKey(1)));
        // Cool from the start, but the hold time (30 s) is not over.
        for s in 0..30 {
            assert_eq!(ledger.review(t0 + Duration::from_secs(s), &r, &m, 10.0, 1.0), Verdict::Keep, "{s}s");
        }
        assert_eq!(ledger.review(t0 + Duration::from_secs(30), &r, &m, 10.0, 1.0), Verdict::Merge);

        // Hot again for a moment: the cool time restarts.
        let mut ledger = SplitLedger::default();
        ledger.update(t0, &SplitView::new([m]));
        let at = |s| t0 + Duration::from_secs(s);
        assert_eq!(ledger.review(at(25), &r, &m, 10.0, 5.0), Verdict::Keep);
        assert_eq!(ledger.review(at(31), &r, &m, 10.0, 6.0), Verdict::Keep, "above half the drain rate");
        assert_eq!(ledger.review(at(32), &r, &m, 10.0, 2.0), Verdict::Keep);
        assert_eq!(ledger.review(at(41), &r, &m, 10.0, 2.0), Verdict::Keep);
        assert_eq!(ledger.review(at(42), &r, &m, 10.0, 2.0), Verdict::Merge);

        // Merged: no new split of that key within the hold time.
        ledger.update(at(42), &SplitView::default());
        assert!(ledger.holding(at(60), r.hold, 0, PrefixKey(1)));
        assert!(!ledger.holding(at(72), r.hold, 0, PrefixKey(1)));
    }

    /// A choice at `routed` with these deeper keys.
    fn at(routed: RoutedKey, deeper: &[u64]) -> Choice {
        Choice { routed, shards: NonZeroU32::MIN, through: Vec::new(), deeper: deeper.iter().map(|k| PrefixKey(*k)).collect() }
    }

    #[tokio::test(start_paused = true)]
    async fn a_dominant_key_splits_with_the_deeper_levels_that_do_not_tell_its_requests_apart() {
        let r = rules();
        let mut shares = TrafficShares::default();
        let start = Instant::now();
        let at_s = |s| start + Duration::from_secs(s);
        assert_eq!(shares.tick(at_s(0), &r, &SplitView::default()), None);
        // 16 of 20 requests on one system prompt, longer than level 1 (one level-1 key), whose
        // conversations differ at level 2; the other 4 have keys of their own.
        for i in 0..20u64 {
            shares.observe(&if i < 16 { at(rk(0, 4, 1), &[2, 100 + i % 3, 200 + i]) } else { at(rk(0, 4, 100 + i), &[i, i, i]) });
        }
        let d = shares.tick(at_s(1), &r, &SplitView::default()).expect("dominant");
        assert_eq!((d.members, d.requests), (vec![split(0, 1), split(1, 2)], 20));
        assert!((d.share - 0.8).abs() < 1e-9);
        // Split: its requests route by their level-2 keys (a third each): nothing more to split.
        let view = SplitView::new([split(0, 1), split(1, 2)]);
        for i in 0..12u64 {
            shares.observe(&at(rk(2, 4, 100 + i % 3), &[200 + i]));
        }
        assert_eq!(shares.tick(at_s(2), &r, &view), None);
        // Never down to the finest level: a dominant level-2 key with distinct level-3 keys splits alone.
        let mut shares = TrafficShares::default();
        shares.tick(at_s(0), &r, &view);
        for i in 0..20u64 {
            shares.observe(&at(rk(2, 4, 7), &[300 + i]));
        }
        assert_eq!(shares.tick(at_s(1), &r, &view).map(|d| d.members), Some(vec![split(2, 7)]));
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_dominating_from_the_start_splits_before_its_first_window_closes() {
        let r = rules();
        let mut shares = TrafficShares::default();
        let start = Instant::now();
        assert_eq!(shares.tick(start, &r, &SplitView::default()), None);
        for _ in 0..4 {
            shares.observe(&at(rk(0, 4, 1), &[2, 3, 4]));
        }
        assert_eq!(shares.tick(start + Duration::from_millis(250), &r, &SplitView::default()), None, "4 requests");
        shares.observe(&at(rk(0, 4, 1), &[2, 3, 4]));
        let d = shares.tick(start + Duration::from_millis(500), &r, &SplitView::default()).expect("dominant");
        assert_eq!(d.members, vec![split(0, 1), split(1, 2), split(2, 3)]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_requests_a_tick_lacked_ask_once_for_an_early_tick() {
        let r = rules();
        let view = SplitView::default();
        let mut shares = TrafficShares::default();
        let start = Instant::now();
        let at_ms = |ms| start + Duration::from_millis(ms);
        let key = |i: u64| at(rk(0, 3, i), &[]);
        // Before the first tick: the 5th request asks, and only it.
        let asks: Vec<u64> = (0..25).filter(|&i| shares.observe(&key(i))).collect();
        assert_eq!(asks, vec![DOMINANT_MIN_REQUESTS - 1]);
        // A tick that had enough requests: nothing asks until the windows run short again.
        assert_eq!(shares.tick(at_ms(0), &r, &view), None, "25 keys, none dominant");
        assert!((0..40).all(|i| !shares.observe(&key(100 + i))));
        // The windows age out (3 closed windows of 1 s): 0 counted; then a tick with 2 requests
        // lacks 3, and the 3rd request after it asks.
        for s in 1..=5 {
            shares.tick(at_ms(s * 1000), &r, &view);
        }
        assert!((0..2).all(|i| !shares.observe(&key(200 + i))));
        assert_eq!(shares.tick(at_ms(5250), &r, &view), None);
        let asks: Vec<u64> = (0..10).filter(|&i| shares.observe(&key(300 + i))).collect();
        assert_eq!(asks, vec![2]);
    }

    #[test]
    fn the_share_lower_bound_is_wilsons_one_sided_95_percent_bound() {
        // The Wilson score interval's lower end at z = 1.645.
        for (count, requests, bound) in [(5, 5, 0.649), (4, 5, 0.435), (8, 10, 0.541), (6, 10, 0.352), (14, 20, 0.516), (100, 200, 0.442), (10, 10, 0.787)] {
            let b = share_lower_bound(count, requests);
            assert!((b - bound).abs() < 0.001, "{count} of {requests}: {b}");
        }
        assert_eq!(share_lower_bound(0, 0), 0.0);
        assert!(share_lower_bound(0, 10) < 1e-12);
    }

    #[tokio::test(start_paused = true)]
    async fn a_share_above_half_by_chance_waits_for_more_requests() {
        let r = rules();
        let view = SplitView::default();
        let start = Instant::now();
        let at_ms = |ms| start + Duration::from_millis(ms);
        let obs = |shares: &mut TrafficShares, i: u64, hot: bool| shares.observe(&at(rk(0, 3, if hot { 1 } else { 100 + i }), &[i]));
        let mut shares = TrafficShares::default();
        shares.tick(at_ms(0), &r, &view);
        // 3 of 5 requests on one key, the rest on keys of their own: above half as observed, not
        // beyond chance (lower bound 0.27). The 5th request asked for the tick.
        let asks: Vec<u64> = (0..5).filter(|&i| obs(&mut shares, i, i < 3)).collect();
        assert_eq!(asks, vec![4]);
        assert_eq!(shares.tick(at_ms(10), &r, &view), None, "3 of 5");
        // Undecided: the tick asks for another once as many requests again have arrived (a burst
        // between two refreshes is decided within it). 6 of 10 (0.35): again, after 10 more.
        let asks: Vec<u64> = (5..10).filter(|&i| obs(&mut shares, i, i < 8)).collect();
        assert_eq!(asks, vec![9]);
        assert_eq!(shares.tick(at_ms(20), &r, &view), None, "6 of 10");
        let asks: Vec<u64> = (10..20).filter(|&i| obs(&mut shares, i, i < 18)).collect();
        assert_eq!(asks, vec![19]);
        let d = shares.tick(at_ms(30), &r, &view).expect("14 of 20 (0.70 as observed, 0.52 at least)");
        assert_eq!((d.members, d.requests), (vec![split(0, 1)], 20));
        // A key at half of the traffic is not dominant, however many requests: 0.5 as observed
        // is not above the rule's 0.5 beyond chance; and a decided tick asks for nothing more.
        let mut shares = TrafficShares::default();
        shares.tick(at_ms(0), &r, &view);
        let asks: Vec<u64> = (0..200).filter(|&i| obs(&mut shares, i, i % 2 == 0)).collect();
        assert_eq!(asks, vec![4]);
        assert_eq!(shares.tick(at_ms(250), &r, &view), None, "100 of 200");
        assert!((200..400).all(|i| !obs(&mut shares, i, i % 2 == 0)));
    }

    /// Observed: keys carrying 32–42 % of the traffic split as dominant within 26–100 s, by the
    /// short windows' test repeated at every refresh. Now a key must also dominate the longer look
    /// (from its first window in it): 20 minutes of a key at 40 % (4 requests/s, a refresh every
    /// 250 ms, seeded) split nothing; a key arriving at 90 % into a minute of other traffic still
    /// splits within seconds.
    #[tokio::test(start_paused = true)]
    async fn a_key_under_half_of_the_traffic_does_not_split_by_chance() {
        let r = rules();
        let view = SplitView::default();
        let start = Instant::now();
        let mut rng = fastrand::Rng::with_seed(7);
        let mut shares = TrafficShares::default();
        let tick_ms = 250;
        let key_at = |rng: &mut fastrand::Rng, hot: u64, p: f64| if rng.f64() < p { hot } else { 100 + rng.u64(0..50) };
        for t in 0..(20 * 60 * 1000 / tick_ms) {
            let k = key_at(&mut rng, 1, 0.4);
            shares.observe(&at(rk(0, 3, k), &[10_000 + t]));
            let d = shares.tick(start + Duration::from_millis(t * tick_ms), &r, &view);
            assert_eq!(d, None, "a key at 40 % split after {} s", t * tick_ms / 1000);
        }
        // Then a new key takes 90 % of the traffic: judged on the windows since it appeared.
        let base = 20 * 60 * 1000;
        let split_after = (0..200u64).find_map(|t| {
            let k = key_at(&mut rng, 2, 0.9);
            shares.observe(&at(rk(0, 3, k), &[1_000_000 + t]));
            shares.tick(start + Duration::from_millis(base + t * tick_ms), &r, &view).map(|d| (t, d))
        });
        let (t, d) = split_after.expect("the new key dominates");
        assert_eq!(d.members, vec![split(0, 2)]);
        assert!(t * tick_ms <= 5_000, "split {} ms after it appeared", t * tick_ms);
    }

    #[tokio::test(start_paused = true)]
    async fn no_dominance_below_half_on_little_traffic_or_at_the_finest_level() {
        let r = rules();
        let start = Instant::now();
        let view = SplitView::default();
        let load = |keys: &[RoutedKey], per_key: usize| {
            let mut shares = TrafficShares::default();
            shares.tick(start, &r, &view);
            for k in keys {
                for _ in 0..per_key {
                    shares.observe(&at(*k, &[]));
                }
            }
            shares.tick(start + Duration::from_secs(1), &r, &view).map(|d| d.members)
        };
        assert_eq!(load(&[rk(0, 3, 1), rk(0, 3, 2), rk(0, 3, 3)], 10), None, "a third each");
        assert_eq!(load(&[rk(0, 3, 1)], 4), None, "too few requests");
        assert_eq!(load(&[rk(0, 3, 1), rk(0, 3, 2)], 30), None, "half each");
        assert_eq!(load(&[rk(0, 1, 1)], 40), None, "an explicit key has no next level");
        assert_eq!(load(&[rk(0, 3, 1)], 20), Some(vec![split(0, 1)]));
    }

    /// The split rules, split member level 0 key 1, and a ledger that saw it split at the
    /// returned instant.
    fn one_split() -> (SplitRules, SplitMember, SplitLedger, Instant) {
        let (m, t0) = (split(0, 1), Instant::now());
        let mut ledger = SplitLedger::default();
        ledger.update(t0, &SplitView::new([m]));
        (rules(), m, ledger, t0)
    }

    /// A gap of the cool time or more between two reviews (Redis unreachable, the process
    /// stopped) is not cool time: the stretch starts again at the first review after it.
    #[tokio::test(start_paused = true)]
    async fn cool_time_needs_reviews_without_a_gap() {
        let (r, m, mut ledger, t0) = one_split();
        let at = |s| t0 + Duration::from_secs(s);
        for s in 25..=28 {
            assert_eq!(ledger.review(at(s), &r, &m, 10.0, 1.0), Verdict::Keep);
        }
        assert_eq!(ledger.review(at(60), &r, &m, 10.0, 1.0), Verdict::Keep, "cool since 25 s, but not seen from 28 s to 60 s");
        assert_eq!(ledger.review(at(69), &r, &m, 10.0, 1.0), Verdict::Keep);
        assert_eq!(ledger.review(at(70), &r, &m, 10.0, 1.0), Verdict::Merge, "cool for 10 s since the gap");
    }

    #[tokio::test(start_paused = true)]
    async fn a_dominant_split_merges_when_arrivals_fall_to_half_their_peak() {
        let (r, m, mut ledger, t0) = one_split();
        let at = |s| t0 + Duration::from_secs(s);
        for s in 0..35 {
            assert_eq!(ledger.review(at(s), &r, &m, 0.0, 20.0), Verdict::Keep, "steady at {s}s");
        }
        for s in 35..45 {
            assert_eq!(ledger.review(at(s), &r, &m, 0.0, 10.0), Verdict::Keep, "cooling at {s}s");
        }
        assert_eq!(ledger.review(at(45), &r, &m, 0.0, 10.0), Verdict::Merge);
    }

    /// The observed case: a dominant key split, steady traffic, then a burst of arrivals (a
    /// paused instance's prefetch handed back at once, or a publisher's 4 s spike at 4 × the
    /// rate): the burst set the peak, the steady rate was below half of it, and the key merged
    /// back 10 s later while it still carried 75 % of the traffic, then could not split again for
    /// the hold time. A burst shorter than the cool time does not set the peak now.
    #[tokio::test(start_paused = true)]
    async fn a_burst_does_not_merge_a_dominant_split_back() {
        let (r, m, mut ledger, t0) = one_split();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        for tick in 0..(120 * 4) {
            let ms = tick * 250;
            // The arrival rate over the last 5 s: 10/s, and 40/s while a 4 s burst is in it.
            let rps = if (40_000..49_000).contains(&ms) { 40.0 } else { 10.0 };
            assert_eq!(ledger.review(at(ms), &r, &m, 0.0, rps), Verdict::Keep, "at {ms} ms");
        }
        // A real cooling still merges it: half the sustained rate for the cool time.
        let end = 120_000;
        for tick in 0..40 {
            assert_eq!(ledger.review(at(end + tick * 250), &r, &m, 0.0, 5.0), Verdict::Keep);
        }
        assert_eq!(ledger.review(at(end + 10_000), &r, &m, 0.0, 5.0), Verdict::Merge);
    }

    #[test]
    fn view_counts_levels_and_moves() {
        let a = SplitView::new([split(0, 1), split(1, 2), split(1, 3)]);
        assert_eq!(a.per_level(), vec![1, 2]);
        let spread = SplitMember { level: 1, key: PrefixKey(3), state: SplitState::Spread(NonZeroU32::new(4).unwrap()) };
        let b = SplitView::new([split(0, 1), spread, split(2, 5)]);
        assert_eq!(a.moves_to(&b), 3, "1:2 removed, 1:3 changed, 2:5 added");
        assert_eq!(a.moves_to(&a), 0);
    }

    #[test]
    fn hygiene_flags_volatile_short_and_dominant_unsplittable_keys() {
        let mut h = KeyHygiene::default();
        let now = Instant::now();
        let mut report = None;
        for i in 0..HYGIENE_WINDOW as u64 {
            report = h.observe(now, PrefixKey(i), 20, rk(0, 4, i), false);
        }
        let r = report.unwrap();
        assert!(r.volatile() && r.short_material() && r.dominant_unsplittable().is_none());
        assert_eq!(r.top_shares.len(), 5);

        let mut report = None;
        for i in 0..HYGIENE_WINDOW as u64 {
            let hot = i % 4 != 0;
            let routed = if hot { rk(0, 1, 1) } else { rk(0, 4, i) };
            report = h.observe(now, routed.key, 300, routed, hot);
        }
        let r = report.unwrap();
        assert!(!r.volatile() && !r.short_material());
        assert_eq!(r.dominant_unsplittable(), Some((rk(0, 1, 1), 0.75)));
        assert_eq!(r.top_shares[0], 0.75);
    }

    /// Light traffic: a window that has not seen 200 requests closes after a minute, with the
    /// requests it has, or 10 s after its last request; then a minute without requests reports
    /// zeros (the gauges fall to 0 when the traffic stops, so an alert on them clears); fewer
    /// than 20 requests judge nothing. Before, a window closed only at its 200th request, so the
    /// gauges kept the last full window's shares for as long as traffic stayed away; and with the
    /// minute alone, the tail of a burst was judged a minute later, after the silence.
    #[test]
    fn hygiene_windows_close_after_a_minute_or_when_idle_and_report_zeros_without_traffic() {
        let mut h = KeyHygiene::default();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let hot = rk(3, 4, 9);
        assert_eq!(h.tick(t0), None);
        for i in 0..60u64 {
            assert_eq!(h.observe(t0 + s(i), PrefixKey(9), 20, hot, true), None);
        }
        assert_eq!(h.tick(t0 + s(59)), None, "the window is open for a minute");
        let r = h.tick(t0 + HYGIENE_MAX_WINDOW).expect("closed after a minute");
        assert_eq!((r.requests, r.top_shares.clone()), (60, vec![1.0]));
        assert_eq!(r.dominant_unsplittable(), Some((hot, 1.0)));
        assert!(r.short_material() && !r.volatile());

        // The tail of the traffic: 25 requests in 5 s, then silence.
        for i in 0..25u64 {
            h.observe(t0 + s(60) + Duration::from_millis(200 * i), PrefixKey(9), 20, hot, true);
        }
        assert_eq!(h.tick(t0 + s(69)), None, "not idle for 10 s yet");
        let r = h.tick(t0 + s(75)).expect("closed 10 s after its last request");
        assert_eq!(r.requests, 25);
        let r = h.tick(t0 + s(75) + HYGIENE_MAX_WINDOW).expect("the next minute, without traffic");
        assert_eq!((r.requests, r.top_shares.len(), r.unsplittable, r.distinct, r.short), (0, 0, None, 0.0, 0.0));

        let t1 = t0 + s(200);
        for i in 0..5u64 {
            h.observe(t1, PrefixKey(100 + i), 20, hot, true);
        }
        let r = h.tick(t1 + HYGIENE_IDLE).unwrap();
        assert_eq!(r.requests, 5);
        assert!(!r.volatile() && !r.short_material() && r.unsplittable.is_none(), "5 requests judge nothing: {r:?}");
        assert_eq!(r.top_shares, vec![1.0], "the shares are still reported");
    }
}
