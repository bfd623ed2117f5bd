//! A circuit breaker for one LLM endpoint: a pure state machine driven by call outcomes and a
//! clock passed in (no I/O, no timers of its own), in the shape of Nygard's breaker
//! (*Release It!*, "Circuit Breaker"): closed → open → half-open → closed.
//!
//! - **Closed**: every call goes through. Only *server faults* count against the endpoint (a
//!   request fault means the server answered and judged the request, so it counts as a sign of
//!   health). The breaker opens after [`BreakerPolicy::consecutive_faults`] server faults in a row,
//!   or when the last [`BreakerPolicy::window`] outcomes hold at least
//!   [`BreakerPolicy::min_calls`] calls of which [`BreakerPolicy::fault_ratio`] or more were server
//!   faults (a storm of 429s or 5xx interleaved with a few successes).
//! - **Open**: calls fail fast, without an HTTP call, for an open time that starts at
//!   [`BreakerPolicy::open_initial`] and doubles on every reopening without a successful probe in
//!   between, up to [`BreakerPolicy::open_max`].
//! - **Half-open**: once the open time is over, exactly ONE probe may go ([`Breaker::admit_probe`]):
//!   a lightweight call the owner of the breaker makes itself, never a real request (a request
//!   used as a probe would be requeued on failure and its redelivery count would grow with every
//!   probe of a long outage). Real calls still fail fast. The probe's success closes the breaker
//!   (and resets the open time), its server fault reopens it with the next, longer open time; an
//!   abandoned probe (cancelled) frees the probe slot.
//!
//! [`Breaker::available`] is true only while closed: work resumes once a probe has shown the
//! endpoint healthy. Outcomes of calls admitted before the breaker opened are ignored while it is
//! open or half-open, so only the probe decides.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// The numbers of the breaker rule. [`BreakerPolicy::default`] gives: open after 5 consecutive
/// server faults, or ≥ 50 % server faults among the last 20 outcomes once ≥ 10 are known; open
/// for 1 s, doubling per reopening up to 30 s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerPolicy {
    /// Server faults in a row that open the breaker (≥ 1).
    pub consecutive_faults: u32,
    /// How many of the latest outcomes the ratio rule looks at (≥ 1).
    pub window: usize,
    /// The ratio rule applies only once the window holds at least this many outcomes.
    pub min_calls: usize,
    /// Share of server faults in the window (0.0 ..= 1.0) that opens the breaker.
    pub fault_ratio: f64,
    /// Open time after the first opening.
    pub open_initial: Duration,
    /// Cap of the doubling open time.
    pub open_max: Duration,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        BreakerPolicy {
            consecutive_faults: 5,
            window: 20,
            min_calls: 10,
            fault_ratio: 0.5,
            open_initial: Duration::from_secs(1),
            open_max: Duration::from_secs(30),
        }
    }
}

/// The outcome of one admitted call, as the breaker sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The server answered usefully.
    Success,
    /// The server answered, but refused this request for itself (400, 413, 422, …): the endpoint
    /// is healthy.
    RequestFault,
    /// The endpoint failed: refused or broken connection, timeout, 5xx, 401/403/404, 429.
    ServerFault,
    /// The call was cancelled before it finished: says nothing about the endpoint.
    Abandoned,
}

/// The breaker's state, without its bookkeeping (for metrics and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    /// `closed`, `open` or `half_open`.
    pub fn as_str(&self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// What [`Breaker::admit`] decided for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The breaker is closed: go ahead.
    Allowed,
    /// Fail fast without calling. `retry_at`: when a probe may go, if known (None while a probe
    /// is in flight).
    Rejected { retry_at: Option<Instant> },
}

impl Admission {
    /// Whether the call may go ahead.
    pub fn allowed(&self) -> bool {
        !matches!(self, Admission::Rejected { .. })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed,
    Open { until: Instant },
    HalfOpen { probe_in_flight: bool },
}

/// One endpoint's breaker. See the module documentation for the rule.
#[derive(Debug, Clone)]
pub struct Breaker {
    policy: BreakerPolicy,
    state: State,
    /// Server faults in a row while closed.
    consecutive: u32,
    /// The latest outcomes while closed, `true` = server fault; at most `policy.window` long.
    recent: VecDeque<bool>,
    /// Openings since the breaker was last closed by a successful probe (drives the doubling).
    openings: u32,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(policy: BreakerPolicy) -> Self {
        Breaker { policy, state: State::Closed, consecutive: 0, recent: VecDeque::new(), openings: 0 }
    }

    /// The state at `now` (an open breaker whose open time is over reports half-open: the next
    /// call will be its probe).
    pub fn state(&self, now: Instant) -> BreakerState {
        match self.state {
            State::Closed => BreakerState::Closed,
            State::Open { until } if now < until => BreakerState::Open,
            State::Open { .. } | State::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Whether a call made at `now` would be admitted: only while closed. (`now` is kept for
    /// symmetry with [`Self::state`].)
    pub fn available(&self, _now: Instant) -> bool {
        self.state == State::Closed
    }

    /// When an open breaker lets its probe through; `None` unless open.
    pub fn open_until(&self) -> Option<Instant> {
        match self.state {
            State::Open { until } => Some(until),
            _ => None,
        }
    }

    /// Decides whether a real call starting at `now` may go ahead: only while closed.
    pub fn admit(&self, now: Instant) -> Admission {
        match self.state {
            State::Closed => Admission::Allowed,
            State::Open { until } => Admission::Rejected { retry_at: Some(until) },
            State::HalfOpen { probe_in_flight: false } => Admission::Rejected { retry_at: Some(now) },
            State::HalfOpen { probe_in_flight: true } => Admission::Rejected { retry_at: None },
        }
    }

    /// Takes the one probe slot at `now`: true when the open time is over and no probe is in
    /// flight (the breaker is then half-open with the probe in flight; report its outcome with
    /// `probe = true`), false otherwise.
    pub fn admit_probe(&mut self, now: Instant) -> bool {
        match self.state {
            State::Open { until } if now >= until => {}
            State::HalfOpen { probe_in_flight: false } => {}
            _ => return false,
        }
        self.state = State::HalfOpen { probe_in_flight: true };
        true
    }

    /// Records the outcome of an admitted call (`probe`: it was admitted by [`Self::admit_probe`]).
    /// Returns the new state when this outcome changed it.
    pub fn record(&mut self, outcome: Outcome, probe: bool, now: Instant) -> Option<BreakerState> {
        match self.state {
            State::Closed => self.record_closed(outcome, now),
            State::HalfOpen { .. } if probe => match outcome {
                Outcome::Success | Outcome::RequestFault => {
                    self.close();
                    Some(BreakerState::Closed)
                }
                Outcome::ServerFault => {
                    self.open(now);
                    Some(BreakerState::Open)
                }
                Outcome::Abandoned => {
                    self.state = State::HalfOpen { probe_in_flight: false };
                    None
                }
            },
            State::Open { .. } | State::HalfOpen { .. } => None,
        }
    }

    /// Opens a closed breaker at `now` because the endpoint failed a check made outside the call
    /// path (see [`crate::llm::LlmClient::confirm_server_fault`]): the open time and the probing
    /// then go as after any opening. Returns the new state when it changed (only from closed).
    pub fn trip(&mut self, now: Instant) -> Option<BreakerState> {
        if self.state != State::Closed {
            return None;
        }
        self.open(now);
        Some(BreakerState::Open)
    }

    fn record_closed(&mut self, outcome: Outcome, now: Instant) -> Option<BreakerState> {
        let fault = match outcome {
            Outcome::Abandoned => return None,
            Outcome::Success | Outcome::RequestFault => false,
            Outcome::ServerFault => true,
        };
        self.consecutive = if fault { self.consecutive + 1 } else { 0 };
        self.recent.push_back(fault);
        while self.recent.len() > self.policy.window.max(1) {
            self.recent.pop_front();
        }
        let faults = self.recent.iter().filter(|&&f| f).count();
        let ratio_trips = self.recent.len() >= self.policy.min_calls.max(1)
            && faults as f64 >= self.policy.fault_ratio * self.recent.len() as f64;
        if self.consecutive >= self.policy.consecutive_faults.max(1) || ratio_trips {
            self.open(now);
            return Some(BreakerState::Open);
        }
        None
    }

    fn open(&mut self, now: Instant) {
        let factor = 2u32.saturating_pow(self.openings);
        let wait = self.policy.open_initial.saturating_mul(factor).min(self.policy.open_max);
        self.openings = self.openings.saturating_add(1);
        self.state = State::Open { until: now + wait };
    }

    fn close(&mut self) {
        self.state = State::Closed;
        self.consecutive = 0;
        self.recent.clear();
        self.openings = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trip(b: &mut Breaker) -> Option<BreakerState> {
        let mut last = None;
        for _ in 0..5 {
            assert!(b.admit(Instant::now()).allowed());
            last = b.record(Outcome::ServerFault, false, Instant::now());
        }
        last
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_server_faults_only() {
        let mut b = Breaker::new(BreakerPolicy::default());
        for _ in 0..4 {
            assert_eq!(b.record(Outcome::ServerFault, false, Instant::now()), None);
        }
        // A request fault is an answer from a healthy server: it resets the run.
        assert_eq!(b.record(Outcome::RequestFault, false, Instant::now()), None);
        for _ in 0..4 {
            assert_eq!(b.record(Outcome::ServerFault, false, Instant::now()), None);
        }
        assert_eq!(b.state(Instant::now()), BreakerState::Closed);
        assert_eq!(b.record(Outcome::ServerFault, false, Instant::now()), Some(BreakerState::Open));
        assert_eq!(b.state(Instant::now()), BreakerState::Open);
        assert!(!b.available(Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn opens_on_a_fault_ratio_over_the_window() {
        let mut b = Breaker::new(BreakerPolicy::default());
        // Fault, success, fault, success…: never 5 in a row, but 50 % of the window.
        let mut opened_at = None;
        for i in 0..20 {
            let outcome = if i % 2 == 0 { Outcome::ServerFault } else { Outcome::Success };
            if b.record(outcome, false, Instant::now()) == Some(BreakerState::Open) {
                opened_at = Some(i);
                break;
            }
        }
        assert_eq!(opened_at, Some(9), "10 outcomes (min_calls), 5 of them faults");
        let mut healthy = Breaker::new(BreakerPolicy::default());
        for i in 0..100 {
            let outcome = if i % 3 == 0 { Outcome::ServerFault } else { Outcome::Success };
            assert_eq!(healthy.record(outcome, false, Instant::now()), None, "33 % stays closed");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn open_fails_fast_then_one_probe_closes_it() {
        let mut b = Breaker::new(BreakerPolicy::default());
        trip(&mut b);
        let until = b.open_until().unwrap();
        assert_eq!(until - Instant::now(), Duration::from_secs(1));
        assert_eq!(b.admit(Instant::now()), Admission::Rejected { retry_at: Some(until) });
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(!b.admit(Instant::now()).allowed());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!b.available(Instant::now()), "not available before a probe succeeded");
        assert_eq!(b.state(Instant::now()), BreakerState::HalfOpen);
        assert!(!b.admit(Instant::now()).allowed(), "real calls never probe");
        assert!(b.admit_probe(Instant::now()));
        assert!(!b.admit_probe(Instant::now()), "one probe at a time");
        assert_eq!(b.admit(Instant::now()), Admission::Rejected { retry_at: None });
        assert!(!b.available(Instant::now()));
        // A late answer of a call admitted before the opening does not decide.
        assert_eq!(b.record(Outcome::Success, false, Instant::now()), None);
        assert_eq!(b.record(Outcome::Success, true, Instant::now()), Some(BreakerState::Closed));
        assert_eq!(b.admit(Instant::now()), Admission::Allowed);
        assert!(b.available(Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn failed_probes_double_the_open_time_up_to_the_cap() {
        let mut b = Breaker::new(BreakerPolicy::default());
        trip(&mut b);
        let mut waits = Vec::new();
        for _ in 0..7 {
            let wait = b.open_until().unwrap() - Instant::now();
            waits.push(wait.as_secs());
            tokio::time::advance(wait).await;
            assert!(b.admit_probe(Instant::now()));
            assert_eq!(b.record(Outcome::ServerFault, true, Instant::now()), Some(BreakerState::Open));
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        // A successful probe resets the doubling.
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(b.admit_probe(Instant::now()));
        assert_eq!(b.record(Outcome::RequestFault, true, Instant::now()), Some(BreakerState::Closed));
        trip(&mut b);
        assert_eq!(b.open_until().unwrap() - Instant::now(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_probe_frees_the_probe_slot() {
        let mut b = Breaker::new(BreakerPolicy::default());
        trip(&mut b);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(b.admit_probe(Instant::now()));
        assert_eq!(b.record(Outcome::Abandoned, true, Instant::now()), None);
        assert!(!b.available(Instant::now()));
        assert!(b.admit_probe(Instant::now()));
        // Outcomes while open are ignored.
        assert_eq!(b.record(Outcome::ServerFault, true, Instant::now()), Some(BreakerState::Open));
        assert_eq!(b.record(Outcome::ServerFault, false, Instant::now()), None);
        assert_eq!(b.record(Outcome::Success, false, Instant::now()), None);
        assert_eq!(b.state(Instant::now()), BreakerState::Open);
    }

    #[test]
    fn a_failed_check_trips_a_closed_breaker_once_and_probing_follows() {
        let mut b = Breaker::new(BreakerPolicy::default());
        let t0 = Instant::now();
        assert_eq!(b.trip(t0), Some(BreakerState::Open));
        assert!(!b.available(t0));
        assert_eq!(b.trip(t0), None, "only a closed breaker trips");
        assert_eq!(b.open_until(), Some(t0 + Duration::from_secs(1)));
        assert!(!b.admit_probe(t0));
        assert!(b.admit_probe(t0 + Duration::from_secs(1)));
        assert_eq!(b.record(Outcome::Success, true, t0 + Duration::from_secs(1)), Some(BreakerState::Closed));
        assert!(b.available(t0 + Duration::from_secs(1)));
    }
}
