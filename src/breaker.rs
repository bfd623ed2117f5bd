//! A circuit breaker for one LLM endpoint: a pure state machine driven by call outcomes and a
//! clock passed in (no I/O, no timers of its own), in the shape of Nygard's breaker
//! (*Release It!*, "Circuit Breaker"): closed → open → half-open → closed.
//!
//! - **Closed**: every call goes through. Only *server faults* count against the endpoint (a
//!   request fault means the server answered and judged the request, so it counts as a sign of
//!   health). The rule trips after [`BreakerPolicy::consecutive_faults`] server faults in a row,
//!   or when the last [`BreakerPolicy::window`] outcomes hold at least
//!   [`BreakerPolicy::min_calls`] calls of which [`BreakerPolicy::fault_ratio`] or more were server
//!   faults (a storm of 429s or 5xx interleaved with a few successes).
//!
//!   Server faults come in two sorts. A **hard fault** ([`Outcome::ServerFault`]: refused or
//!   broken connection, a connection not made within `llm.connect_timeout`, 401/403/404, 429)
//!   says the endpoint failed whatever was asked: when hard faults alone trip the rule, the
//!   breaker opens at once. A **fault to verify** may be the request's own: an *answered fault*
//!   ([`Outcome::AnsweredFault`]: an HTTP 5xx, or a 2xx that is not a valid completion — a
//!   prompt the server cannot handle, as llama-server answers 500 "Failed to parse tools" to a
//!   malformed `tools` param) or a *request timeout* ([`Outcome::TimedOut`]: the connection was
//!   made but the answer did not come within `llm.request_timeout`, or HTTP 408 — a prompt with
//!   a huge `max_tokens`, or one the server chokes on, while every other prompt is answered in
//!   time). Such a request fails every time it is sent while every other prompt succeeds. When
//!   faults to verify take part in tripping the rule, the breaker does NOT open: it becomes
//!   *suspect* and asks its owner for one **verification probe**
//!   ([`Breaker::take_verification`]; the same lightweight call as the half-open probe). A probe
//!   that fails (a hung server's probe times out too) confirms the faults and opens the breaker
//!   ([`Breaker::verified`]); a probe that succeeds refutes them: they are discounted (they count
//!   as request faults from then on) and the breaker stays closed. So a handful of poison
//!   requests, retried and redelivered, never makes a healthy endpoint look down, and a real
//!   outage (the probe fails too) still opens it, one probe later.
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
//! **A probe that passes while real calls keep failing** does not clear the endpoint: a server
//! that answers the one-token probe but 5xx (or an invalid answer) to every real call (a broken
//! model for real prompt lengths, a gateway that routes only short calls) would otherwise have
//! every request charged a delivery until its delivery limit dead-letters the whole backlog. So
//! when answered faults came from at least [`DISTINCT_FAULTY_CALLS`] different one-prompt calls
//! on one route (different bodies: retries and redeliveries of one request count once; the caller
//! reports only one-prompt calls, as a failed list call goes again prompt by prompt; a route is
//! one of the server's APIs, numbered by the owner, since one can fail while another works) and
//! no real call of that route has been answered since the first of them
//! ([`Breaker::probes_unrepresentative`], [`Breaker::record_call`]), the owner's
//! probe does not stop at the one-token call: it replays a real call the endpoint answered
//! before (see [`crate::llm`]), and reports a server fault when that fails, which opens the
//! breaker; the requests then wait for the endpoint, uncharged. When the replay passes, the
//! failing prompts are poison prompts, however many; the owner clears the count
//! ([`Breaker::clear_faulty_calls`]) and they are refuted as before. With no call to replay (none
//! answered since the daemon started) the owner reports a server fault too, and its half-open
//! probe closes the breaker on the one-token call alone, keeping the count: the first real call
//! that fails again reopens it, the first one answered clears the count
//! ([`Breaker::record`] of a real success).
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

/// How many different one-prompt calls (by body) answered with a fault, with no real call
/// answered since the first of them, make a passing probe open the breaker instead of refuting
/// them (see the module documentation). Above the handful of poison requests a healthy server
/// may meet at once (tests/llm_answered_faults.rs sends 5 with no other traffic left).
pub const DISTINCT_FAULTY_CALLS: usize = 10;

/// The outcome of one admitted call, as the breaker sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The server answered usefully.
    Success,
    /// The server answered, but refused this request for itself (400, 413, 422, …): the endpoint
    /// is healthy.
    RequestFault,
    /// A hard fault: the endpoint failed whatever was asked (refused or broken connection, connect
    /// timeout, 401/403/404, 429). Counts towards opening at once.
    ServerFault,
    /// An answered fault: the server answered with a 5xx, or with a 2xx that is not a valid
    /// completion. It may be the request's own, so it opens the breaker only once a verification
    /// probe confirms it (see the module documentation).
    AnsweredFault,
    /// A request timeout: the connection was made but the whole answer did not come in time (or
    /// the server answered 408). It may be the request's own (a huge `max_tokens`, a prompt the
    /// server chokes on), so like an answered fault it opens the breaker only once a verification
    /// probe confirms it; a hung server's probe times out too.
    TimedOut,
    /// The call was cancelled before it finished: says nothing about the endpoint.
    Abandoned,
}

impl Outcome {
    /// Whether this server fault may be the request's own, so the breaker verifies it with a
    /// probe before opening: [`Outcome::AnsweredFault`] and [`Outcome::TimedOut`].
    pub fn needs_verification(&self) -> bool {
        matches!(self, Outcome::AnsweredFault | Outcome::TimedOut)
    }
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

/// One outcome in the closed breaker's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// A success, a request fault, or a refuted fault to verify.
    Healthy,
    Hard,
    /// An answered fault or a request timeout, not judged by a probe yet.
    Unconfirmed,
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
    /// Server faults (hard or to verify) in a row while closed.
    consecutive: u32,
    /// How many of the `consecutive` faults were faults to verify.
    consecutive_unconfirmed: u32,
    /// The latest outcomes while closed; at most `policy.window` long.
    recent: VecDeque<Mark>,
    /// Openings since the breaker was last closed by a successful probe (drives the doubling).
    openings: u32,
    /// The rule tripped with faults to verify: a verification probe is wanted.
    suspect: bool,
    /// A verification probe is in flight ([`Self::take_verification`] .. [`Self::verified`]):
    /// the number of openings when it was taken.
    verifying: Option<u64>,
    /// Openings since the breaker was made (never reset): a verification taken before the last
    /// opening speaks of an earlier time.
    opened: u64,
    /// When the first call of the request timeouts not yet judged by a probe was sent
    /// ([`Self::timed_out_call_sent`]; else when that timeout was recorded).
    timeouts_since: Option<Instant>,
    /// When a real call (not a probe) was last answered: a success or a request fault.
    last_answer: Option<Instant>,
    /// `(route, fingerprint)` of the different real calls answered with a fault since a real call
    /// of the same route was last answered ([`Self::answered_fault_call`]); at most
    /// [`DISTINCT_FAULTY_CALLS`] per route.
    faulty_calls: Vec<(usize, u64)>,
    /// When the breaker last left the closed state (its first opening since it was last
    /// closed); `None` while closed.
    down_since: Option<Instant>,
    /// The breaker is on trial ([`Self::close_for_trial`], or an opening with request timeouts
    /// not yet judged among its causes): a close by a half-open probe keeps the doubling of the
    /// open time, and it stays on trial until a real call is answered, whatever opens it again
    /// meanwhile (a probe that times out on a busy host, the liveness check).
    trial: bool,
    /// The route of the latest real call recorded as [`Outcome::TimedOut`] ([`Self::record_call`]).
    timed_out_route: Option<usize>,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(policy: BreakerPolicy) -> Self {
        Breaker {
            policy,
            state: State::Closed,
            consecutive: 0,
            consecutive_unconfirmed: 0,
            recent: VecDeque::new(),
            openings: 0,
            suspect: false,
            verifying: None,
            opened: 0,
            timeouts_since: None,
            last_answer: None,
            faulty_calls: Vec::new(),
            down_since: None,
            trial: false,
            timed_out_route: None,
        }
    }

    /// Tells the breaker the fingerprint of a real call (a hash of its body) on `route` (the
    /// owner's numbering of the server's APIs, e.g. completions 0 and chat 1: one of them can fail
    /// while the other works) that is about to be recorded as [`Outcome::AnsweredFault`]: see
    /// [`Self::probe_passed`].
    pub fn answered_fault_call(&mut self, route: usize, fingerprint: u64) {
        let on_route = self.faulty_calls.iter().filter(|(r, _)| *r == route).count();
        if self.state == State::Closed && on_route < DISTINCT_FAULTY_CALLS && !self.faulty_calls.contains(&(route, fingerprint)) {
            self.faulty_calls.push((route, fingerprint));
        }
    }

    /// Whether the one-token probe alone cannot clear the endpoint: answered faults from
    /// [`DISTINCT_FAULTY_CALLS`] different one-prompt calls on one route and no real call of
    /// that route answered since.
    pub fn probes_unrepresentative(&self) -> bool {
        !self.unrepresented_routes().is_empty()
    }

    /// The routes with at least one different failing call counted, in ascending order.
    pub fn routes_with_faulty_calls(&self) -> Vec<usize> {
        let mut routes: Vec<usize> = self.faulty_calls.iter().map(|(r, _)| *r).collect();
        routes.sort_unstable();
        routes.dedup();
        routes
    }

    /// The routes of [`Self::probes_unrepresentative`], in ascending order.
    pub fn unrepresented_routes(&self) -> Vec<usize> {
        let mut routes = self.routes_with_faulty_calls();
        routes.retain(|&route| self.faulty_calls.iter().filter(|(r, _)| *r == route).count() >= DISTINCT_FAULTY_CALLS);
        routes
    }

    /// [`Self::record`] for a real call on `route`: an answer clears the different failing
    /// calls counted on that route only (another route of the server may still fail them all).
    pub fn record_call(&mut self, outcome: Outcome, route: usize, now: Instant) -> Option<BreakerState> {
        self.record_on(outcome, false, Some(route), now)
    }

    /// The route of the latest real call that timed out, if one did: a replay judging request
    /// timeouts ([`Self::timeouts_unanswered`]) is best made on the same API.
    pub fn timed_out_route(&self) -> Option<usize> {
        self.timed_out_route
    }

    /// Marks the next close by a passing half-open probe as a trial: the probe could not show
    /// that real calls are answered (none to replay), so real calls try the endpoint, and the
    /// open time keeps doubling until one of them is answered. Without this, a server that
    /// answers only the one-token probe would be retried with real calls every
    /// [`BreakerPolicy::open_initial`].
    pub fn close_for_trial(&mut self) {
        self.trial = true;
    }

    /// Whether the closed breaker holds request timeouts not yet judged with no real call
    /// answered since the first of them was sent: a passing one-token probe alone then opens it
    /// ([`Self::probe_passed`]). Its owner can first replay a real call the endpoint answered
    /// before ([`Self::replay_answered`]).
    pub fn timeouts_unanswered(&self) -> bool {
        self.state == State::Closed && self.timeouts_since.is_some_and(|since| self.last_answer.is_none_or(|answered| answered < since))
    }

    /// A real call on `route` that the endpoint answered before was sent again by the owner's
    /// probe and answered at `now`, within `llm.request_timeout`: the server does real work in
    /// time. It counts as a real call answered ([`Self::probe_passed`] then discounts the request
    /// timeouts so far as the requests' own) and clears the different failing calls counted on
    /// that route ([`Self::clear_faulty_calls_of`]).
    pub fn replay_answered(&mut self, route: usize, now: Instant) {
        self.last_answer = Some(self.last_answer.map_or(now, |t| t.max(now)));
        self.clear_faulty_calls_of(route);
    }

    /// Forgets the different failing calls counted so far: a real call was answered again (a
    /// replay), so they were the prompts' own.
    pub fn clear_faulty_calls(&mut self) {
        self.faulty_calls.clear();
    }

    /// [`Self::clear_faulty_calls`] of one route: a replay on that route was answered.
    pub fn clear_faulty_calls_of(&mut self, route: usize) {
        self.faulty_calls.retain(|(r, _)| *r != route);
    }

    /// Since when the endpoint has been unavailable without a break: the first opening since
    /// the breaker was last closed (reopenings after failed probes do not move it). `None` while
    /// closed.
    pub fn down_since(&self) -> Option<Instant> {
        self.down_since
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
        self.record_on(outcome, probe, None, now)
    }

    /// [`Self::record`] of a call on `route` (`None`: any route; an answer clears the failing
    /// calls counted on every route).
    fn record_on(&mut self, outcome: Outcome, probe: bool, route: Option<usize>, now: Instant) -> Option<BreakerState> {
        match self.state {
            State::Closed => self.record_closed(outcome, probe, route, now),
            State::HalfOpen { .. } if probe => match outcome {
                Outcome::Success | Outcome::RequestFault => {
                    self.close();
                    Some(BreakerState::Closed)
                }
                Outcome::ServerFault | Outcome::AnsweredFault | Outcome::TimedOut => {
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

    /// Whether the closed breaker is suspect: faults to verify (answered faults, request
    /// timeouts) tripped its rule and no probe has judged them yet (a verification probe is wanted or in flight).
    pub fn suspect(&self) -> bool {
        self.state == State::Closed && (self.suspect || self.verifying.is_some())
    }

    /// Takes the verification slot: `Some` when the closed breaker is suspect and no
    /// verification probe is in flight. The caller then probes the endpoint and reports the
    /// probe's outcome with [`Self::verified`] and this value (also when it gave up:
    /// [`Outcome::Abandoned`]).
    pub fn take_verification(&mut self) -> Option<Verification> {
        if self.state != State::Closed || !self.suspect || self.verifying.is_some() {
            return None;
        }
        self.verifying = Some(self.opened);
        Some(Verification(self.opened))
    }

    /// The outcome of the verification probe `taken` ([`Self::take_verification`]): a server
    /// fault of any sort (a probe that timed out included) confirms the suspicion and opens the breaker (returns the new
    /// state); a success or request fault refutes it ([`Self::refute`]); an abandoned probe
    /// leaves the breaker suspect, for the next call's verification. Ignored (apart from freeing
    /// the slot) when the breaker is no longer closed, or has opened since the probe was taken
    /// (its close freed the slot): the probe then speaks of a time before the server was found
    /// back, and a late failure of it would open the breaker that a passing probe just closed.
    pub fn verified(&mut self, taken: Verification, outcome: Outcome, now: Instant) -> Option<BreakerState> {
        if self.verifying == Some(taken.0) {
            self.verifying = None;
        }
        if self.state != State::Closed || taken.0 != self.opened {
            return None;
        }
        match outcome {
            Outcome::ServerFault | Outcome::AnsweredFault | Outcome::TimedOut => {
                self.open(now);
                Some(BreakerState::Open)
            }
            Outcome::Success | Outcome::RequestFault => self.probe_passed(now),
            Outcome::Abandoned => None,
        }
    }

    /// Tells the closed breaker when a call that is about to be recorded as
    /// [`Outcome::TimedOut`] was sent: a real call answered after that instant shows the server
    /// doing real work while the timed-out one ran ([`Self::probe_passed`]).
    pub fn timed_out_call_sent(&mut self, sent: Instant) {
        if self.state == State::Closed {
            self.timeouts_since = Some(self.timeouts_since.map_or(sent, |t| t.min(sent)));
        }
    }

    /// A probe of the closed endpoint passed (a success or a request fault). Its faults to verify
    /// were the requests' own ([`Self::refute`], returns `None`) unless request timeouts are
    /// among them and no real call was answered since the first of them was sent: the server then answers
    /// a one-token probe but does no real work in time (overloaded, or too slow for
    /// `llm.request_timeout`), which is the server's fault, and the breaker opens (returns the new
    /// state). A poison request that times out among normal traffic is refuted, because the other
    /// calls are answered meanwhile.
    pub fn probe_passed(&mut self, now: Instant) -> Option<BreakerState> {
        if self.state != State::Closed {
            return None;
        }
        if let Some(since) = self.timeouts_since {
            if self.last_answer.is_none_or(|answered| answered < since) {
                // The half-open probe is the same one-token call, which this server answers: its
                // close is a trial ([`Self::close_for_trial`]), so the open time keeps doubling
                // until a real call is answered. Without this, a server slow for every real call
                // was open 1 s of every 10 (the probe closed it, the real calls timed out again).
                self.trial = true;
                self.open(now);
                return Some(BreakerState::Open);
            }
        }
        self.refute();
        None
    }

    /// The endpoint answered a probe while closed: its answered faults and request timeouts so
    /// far were the requests' own. They are discounted (they count as healthy answers from now on), the run of faults
    /// starts again, and the breaker is no longer suspect. Hard faults in the window stay.
    pub fn refute(&mut self) {
        if self.state != State::Closed {
            return;
        }
        for mark in self.recent.iter_mut().filter(|m| **m == Mark::Unconfirmed) {
            *mark = Mark::Healthy;
        }
        self.consecutive = 0;
        self.consecutive_unconfirmed = 0;
        self.suspect = false;
        self.timeouts_since = None;
    }

    fn record_closed(&mut self, outcome: Outcome, probe: bool, route: Option<usize>, now: Instant) -> Option<BreakerState> {
        let mark = match outcome {
            Outcome::Abandoned => return None,
            Outcome::Success | Outcome::RequestFault => Mark::Healthy,
            Outcome::ServerFault => Mark::Hard,
            Outcome::AnsweredFault | Outcome::TimedOut => Mark::Unconfirmed,
        };
        if mark == Mark::Healthy && !probe {
            self.last_answer = Some(now);
            match route {
                Some(route) => self.clear_faulty_calls_of(route),
                None => self.clear_faulty_calls(),
            }
            self.openings = 0;
            self.trial = false;
        } else if outcome == Outcome::TimedOut {
            self.timeouts_since.get_or_insert(now);
            self.timed_out_route = route.or(self.timed_out_route);
        }
        if mark == Mark::Healthy {
            self.consecutive = 0;
            self.consecutive_unconfirmed = 0;
        } else {
            self.consecutive += 1;
            self.consecutive_unconfirmed += u32::from(mark == Mark::Unconfirmed);
        }
        self.recent.push_back(mark);
        while self.recent.len() > self.policy.window.max(1) {
            self.recent.pop_front();
        }
        let hard = self.recent.iter().filter(|&&m| m == Mark::Hard).count();
        let unconfirmed = self.recent.iter().filter(|&&m| m == Mark::Unconfirmed).count();
        let ratio_reached = |faults: usize| {
            self.recent.len() >= self.policy.min_calls.max(1) && faults as f64 >= self.policy.fault_ratio * self.recent.len() as f64
        };
        let run_trips = self.consecutive >= self.policy.consecutive_faults.max(1);
        let hard_run_trips = run_trips && self.consecutive_unconfirmed == 0;
        if hard_run_trips || ratio_reached(hard) {
            self.open(now);
            return Some(BreakerState::Open);
        }
        if run_trips || ratio_reached(hard + unconfirmed) {
            self.suspect = true;
        }
        None
    }

    fn open(&mut self, now: Instant) {
        let factor = 2u32.saturating_pow(self.openings);
        let wait = self.policy.open_initial.saturating_mul(factor).min(self.policy.open_max);
        self.openings = self.openings.saturating_add(1);
        self.opened += 1;
        // Request timeouts among the causes: a passing one-token probe will not show that real
        // calls are answered in time, so its close is a trial.
        self.trial |= self.timeouts_since.is_some();
        self.state = State::Open { until: now + wait };
        self.down_since.get_or_insert(now);
        self.suspect = false;
        self.timeouts_since = None;
    }

    fn close(&mut self) {
        self.state = State::Closed;
        self.down_since = None;
        self.consecutive = 0;
        self.consecutive_unconfirmed = 0;
        self.recent.clear();
        if !self.trial {
            self.openings = 0;
        }
        self.suspect = false;
        // A verification still in flight was taken before the opening: its outcome is ignored.
        self.verifying = None;
    }
}

/// A verification probe's slot, taken by [`Breaker::take_verification`] and handed back with the
/// probe's outcome to [`Breaker::verified`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verification(u64);

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
        assert_eq!(b.down_since(), None);
        trip(&mut b);
        let opened = Instant::now();
        let mut waits = Vec::new();
        for _ in 0..7 {
            let wait = b.open_until().unwrap() - Instant::now();
            waits.push(wait.as_secs());
            tokio::time::advance(wait).await;
            assert!(b.admit_probe(Instant::now()));
            assert_eq!(b.record(Outcome::ServerFault, true, Instant::now()), Some(BreakerState::Open));
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(b.down_since(), Some(opened), "down since the first opening, whatever the reopenings");
        // A successful probe resets the doubling.
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(b.admit_probe(Instant::now()));
        assert_eq!(b.record(Outcome::RequestFault, true, Instant::now()), Some(BreakerState::Closed));
        assert_eq!(b.down_since(), None, "closed: not down");
        tokio::time::advance(Duration::from_secs(5)).await;
        trip(&mut b);
        assert_eq!(b.down_since(), Some(Instant::now()), "a new outage starts its own time");
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
    #[test]
    fn answered_faults_make_it_suspect_and_only_a_failed_verification_opens_it() {
        let mut b = Breaker::new(BreakerPolicy::default());
        let t0 = Instant::now();
        for _ in 0..12 {
            assert_eq!(b.record(Outcome::AnsweredFault, false, t0), None, "answered faults never open it by themselves");
        }
        assert!(b.available(t0) && b.suspect());
        let v = b.take_verification().unwrap();
        assert!(b.take_verification().is_none(), "one verification probe at a time");
        assert_eq!(b.record(Outcome::AnsweredFault, false, t0), None);
        assert_eq!(b.verified(v, Outcome::ServerFault, t0), Some(BreakerState::Open), "the probe failed too: an outage");
        assert_eq!(b.open_until(), Some(t0 + Duration::from_secs(1)));
        assert!(!b.suspect() && b.take_verification().is_none());
    }

    /// Records `n` answered faults of the real call with body fingerprint `call` (route 0).
    fn answered_faults(b: &mut Breaker, call: u64, n: usize, now: Instant) {
        answered_faults_on(b, 0, call, n, now);
    }

    fn answered_faults_on(b: &mut Breaker, route: usize, call: u64, n: usize, now: Instant) {
        for _ in 0..n {
            b.answered_fault_call(route, call);
            b.record_call(Outcome::AnsweredFault, route, now);
        }
    }

    /// One route of the server (chat) failing every call while another (completions) answers:
    /// the answers on the other route do not clear the failing route's count, so the probe is
    /// unrepresentative for it; an answer on the failing route itself does.
    #[test]
    fn a_route_that_fails_every_call_is_not_cleared_by_another_routes_answers() {
        let mut b = Breaker::new(BreakerPolicy::default());
        let t0 = Instant::now();
        for call in 1..=10 {
            answered_faults_on(&mut b, 1, call, 1, t0);
            b.record_call(Outcome::Success, 0, t0);
        }
        assert_eq!(b.unrepresented_routes(), [1], "chat failed 10 different calls; completions answers do not refute them");
        b.clear_faulty_calls_of(0);
        assert!(b.probes_unrepresentative());
        b.record_call(Outcome::Success, 1, t0);
        assert!(!b.probes_unrepresentative(), "a chat call was answered");
        for call in 1..=10 {
            answered_faults_on(&mut b, 1, call, 1, t0);
        }
        b.clear_faulty_calls_of(1);
        assert!(!b.probes_unrepresentative(), "a chat replay passed");
    }

    /// Ten different one-prompt calls failing with no real call answered since make the
    /// one-token probe unrepresentative (the owner then replays a real call); retries of one
    /// call count once, and a real call answered starts the count again.
    #[test]
    fn different_failing_calls_make_the_probe_unrepresentative() {
        let mut b = Breaker::new(BreakerPolicy::default());
        let t0 = Instant::now();
        for call in 1..10 {
            answered_faults(&mut b, call, 3, t0);
        }
        assert!(!b.probes_unrepresentative(), "nine different calls");
        answered_faults(&mut b, 10, 1, t0);
        assert!(b.probes_unrepresentative());
        b.clear_faulty_calls();
        assert!(!b.probes_unrepresentative(), "a replay passed: the prompts' own");
        for call in 20..29 {
            answered_faults(&mut b, call, 1, t0);
        }
        b.record(Outcome::Success, false, t0);
        answered_faults(&mut b, 29, 1, t0);
        assert!(!b.probes_unrepresentative(), "the ones before the answered call do not count");
        assert_eq!(b.probe_passed(t0), None, "the breaker itself only refutes");
    }

    #[test]
    fn a_passing_verification_discounts_the_answered_faults() {
        let mut b = Breaker::new(BreakerPolicy::default());
        let t0 = Instant::now();
        for _ in 0..5 {
            b.record(Outcome::AnsweredFault, false, t0);
        }
        let v = b.take_verification().unwrap();
        assert_eq!(b.verified(v, Outcome::Success, t0), None);
        assert!(b.available(t0) && !b.suspect(), "refuted: closed and no longer suspect");
        // The discounted faults no longer count: 4 more answered faults do not make it suspect
        // (the run starts again, the window holds 5 healthy + 4).
        for _ in 0..4 {
            b.record(Outcome::AnsweredFault, false, t0);
        }
        assert!(!b.suspect());
        b.record(Outcome::AnsweredFault, false, t0);
        assert!(b.suspect(), "5 in a row again: another verification");
        // An abandoned verification leaves it suspect for the next one.
        let v = b.take_verification().unwrap();
        assert_eq!(b.verified(v, Outcome::Abandoned, t0), None);
        assert!(b.suspect());
            let v = b.take_verification().unwrap();
        // A request fault answering the probe refutes too.
        assert_eq!(b.verified(v, Outcome::RequestFault, t0), None);
        assert!(!b.suspect());
    }

    #[test]
    fn hard_faults_still_open_at_once_and_mixed_runs_are_verified() {
        let mut b = Breaker::new(BreakerPolicy::default());
        let t0 = Instant::now();
        // Answered faults in the run: suspect, not open.
        for outcome in [Outcome::ServerFault, Outcome::AnsweredFault, Outcome::ServerFault, Outcome::ServerFault, Outcome::ServerFault] {
            assert_eq!(b.record(outcome, false, t0), None);
        }
        assert!(b.available(t0) && b.suspect());
        let v = b.take_verification().unwrap();
        // Hard faults alone reaching the rule open it, suspect or not, verification in flight or
        // not: here the ratio over hard faults only, 8 of the 10 latest outcomes.
        b.record(Outcome::Success, false, t0);
        for _ in 0..3 {
            assert_eq!(b.record(Outcome::ServerFault, false, t0), None);
        }
        assert_eq!(b.record(Outcome::ServerFault, false, t0), Some(BreakerState::Open));
        // A verification finishing after the opening only frees its slot.
        assert!(b.take_verification().is_none());
        assert_eq!(b.verified(v, Outcome::Success, t0), None);
        assert_eq!(b.state(t0), BreakerState::Open);
    }

    #[test]
    fn refuting_keeps_the_hard_faults_of_the_window() {
        let mut b = Breaker::new(BreakerPolicy::default());
        let t0 = Instant::now();
        // 10 outcomes: 4 hard faults, 4 answered, 2 successes: 80 % faults, suspect.
        for outcome in [Outcome::Success, Outcome::Success]
            .into_iter()
            .chain([Outcome::ServerFault, Outcome::AnsweredFault].into_iter().cycle().take(8))
        {
            assert_eq!(b.record(outcome, false, t0), None);
        }
        assert!(b.suspect());
        b.refute();
        assert!(!b.suspect());
        // The 4 hard faults still count: with one success more (4 of 11), 3 more hard faults
        // reach 50 % (7 of 14), far fewer than the 5 in a row of the run rule.
        assert_eq!(b.record(Outcome::Success, false, t0), None);
        assert_eq!(b.record(Outcome::ServerFault, false, t0), None);
        assert_eq!(b.record(Outcome::ServerFault, false, t0), None);
        assert_eq!(b.record(Outcome::ServerFault, false, t0), Some(BreakerState::Open));
    }

    #[test]
    fn request_timeouts_are_verified_before_opening_and_a_passing_probe_discounts_them() {
        let mut b = Breaker::new(BreakerPolicy::default());
        let t0 = Instant::now();
        // A poison prompt timing out again and again (retries, redeliveries), now and then a
        // normal call's success (the first call too): the breaker never opens, a probe refutes
        // every suspicion.
        let mut verifications = 0;
        for i in 0..200 {
            let outcome = if i % 7 == 0 { Outcome::Success } else { Outcome::TimedOut };
            assert_eq!(b.record(outcome, false, t0), None, "call {i}: request timeouts never open it by themselves");
            if let Some(v) = b.take_verification() {
                verifications += 1;
                assert_eq!(b.verified(v, Outcome::Success, t0), None, "the endpoint answers its probe");
            }
            assert!(b.available(t0), "call {i}");
        }
        assert!(verifications > 0, "timeouts tripped the rule and were verified");
        // Timeouts and answered faults make one run: 5 in a row make it suspect.
        for outcome in [Outcome::TimedOut, Outcome::AnsweredFault, Outcome::TimedOut, Outcome::AnsweredFault] {
            assert_eq!(b.record(outcome, false, t0), None);
        }
        b.refute();
        assert!(!b.suspect());
        for _ in 0..4 {
            b.record(Outcome::TimedOut, false, t0);
        }
        assert!(!b.suspect(), "4 in a row after a refutation");
        b.record(Outcome::TimedOut, false, t0);
        assert!(b.suspect() && b.available(t0));
    }

    #[test]
    fn a_server_whose_real_calls_all_time_out_opens_it_though_it_answers_the_probe() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        // Only timeouts since they began: the probe's one token proves no real work was done.
        let mut b = Breaker::new(BreakerPolicy::default());
        assert_eq!(b.record(Outcome::Success, false, t0), None);
        for i in 1..=5 {
            assert_eq!(b.record(Outcome::TimedOut, false, t0 + i * ms), None);
        }
        let v = b.take_verification().unwrap();
        assert_eq!(b.verified(v, Outcome::Success, t0 + 6 * ms), Some(BreakerState::Open));
        // The same through the partition's check (`LlmClient::confirm_server_fault`).
        let mut b = Breaker::new(BreakerPolicy::default());
        b.record(Outcome::TimedOut, false, t0);
        assert_eq!(b.probe_passed(t0 + ms), Some(BreakerState::Open));
        // A real call answered after the first timeout: the timeouts were the requests' own.
        let mut b = Breaker::new(BreakerPolicy::default());
        for i in 0..5 {
            b.record(Outcome::TimedOut, false, t0 + i * 2 * ms);
            b.record(Outcome::Success, false, t0 + (i * 2 + 1) * ms);
        }
        assert_eq!(b.probe_passed(t0 + 20 * ms), None);
        assert!(b.available(t0 + 20 * ms));
        // What counts is when the timed-out call was sent: an answer while it ran refutes.
        let mut b = Breaker::new(BreakerPolicy::default());
        b.record(Outcome::Success, false, t0 + 5 * ms);
        b.timed_out_call_sent(t0);
        b.record(Outcome::TimedOut, false, t0 + 400 * ms);
        assert_eq!(b.probe_passed(t0 + 401 * ms), None, "answered while the timed-out call ran");
        b.timed_out_call_sent(t0 + 10 * ms);
        b.record(Outcome::TimedOut, false, t0 + 410 * ms);
        assert_eq!(b.probe_passed(t0 + 411 * ms), Some(BreakerState::Open), "nothing answered since it was sent");
        // A passing probe is not a real answer, and answered faults alone are still refuted.
        let mut b = Breaker::new(BreakerPolicy::default());
        b.record(Outcome::TimedOut, false, t0);
        b.record(Outcome::Success, true, t0 + ms);
        assert_eq!(b.probe_passed(t0 + 2 * ms), Some(BreakerState::Open));
        let mut b = Breaker::new(BreakerPolicy::default());
        b.record(Outcome::AnsweredFault, false, t0);
        assert_eq!(b.probe_passed(t0 + ms), None);
    }

    /// A request that outlasts `llm.request_timeout` on its own, with one permit and no other
    /// traffic: nothing is answered while it runs, so the probe's one token alone would open the
    /// breaker every time. A replayed real call answered after it was sent refutes its timeouts.
    #[test]
    fn a_replayed_call_answered_after_a_timeout_refutes_it() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let mut b = Breaker::new(BreakerPolicy::default());
        assert!(!b.timeouts_unanswered());
        b.record_call(Outcome::Success, 0, t0);
        b.answered_fault_call(1, 7);
        b.timed_out_call_sent(t0 + ms);
        b.record_call(Outcome::TimedOut, 0, t0 + 400 * ms);
        assert!(b.timeouts_unanswered(), "nothing answered since the timed-out call was sent");
        // A replay answered before the timed-out call was sent does not count.
        b.replay_answered(0, t0);
        assert!(b.timeouts_unanswered());
        b.replay_answered(1, t0 + 401 * ms);
        assert!(!b.timeouts_unanswered());
        assert_eq!(b.routes_with_faulty_calls(), Vec::<usize>::new(), "the replayed route's failing calls are cleared");
        assert_eq!(b.probe_passed(t0 + 402 * ms), None, "refuted: the server answers real calls in time");
        assert!(b.available(t0 + 402 * ms) && !b.suspect());
        // Without the replay, the same timeout opens it.
        let mut b = Breaker::new(BreakerPolicy::default());
        b.record_call(Outcome::Success, 0, t0);
        b.timed_out_call_sent(t0 + ms);
        b.record_call(Outcome::TimedOut, 0, t0 + 400 * ms);
        assert_eq!(b.probe_passed(t0 + 402 * ms), Some(BreakerState::Open));
        assert!(!b.timeouts_unanswered(), "only a closed breaker has timeouts to judge");
    }

    #[test]
    fn a_trial_close_keeps_doubling_the_open_time_until_a_real_call_is_answered() {
        let policy = BreakerPolicy::default();
        let mut b = Breaker::new(policy);
        let t0 = Instant::now();
        assert_eq!(b.trip(t0), Some(BreakerState::Open));
        let mut now = t0;
        for wait in [1, 2, 4] {
            let until = b.open_until().unwrap();
            assert_eq!(until - now, Duration::from_secs(wait));
            now = until;
            assert!(b.admit_probe(now));
            b.close_for_trial();
            assert_eq!(b.record(Outcome::Success, true, now), Some(BreakerState::Closed));
            assert_eq!(b.trip(now), Some(BreakerState::Open), "the first real call fails again");
        }
        assert_eq!(b.open_until().unwrap() - now, Duration::from_secs(8));
        // A real call answered while closed ends the doubling.
        now = b.open_until().unwrap();
        assert!(b.admit_probe(now));
        b.close_for_trial();
        b.record(Outcome::Success, true, now);
        b.record(Outcome::Success, false, now);
        assert_eq!(b.trip(now), Some(BreakerState::Open));
        assert_eq!(b.open_until().unwrap() - now, policy.open_initial);
        // An ordinary close by a probe resets it as before.
        now = b.open_until().unwrap();
        assert!(b.admit_probe(now));
        b.record(Outcome::Success, true, now);
        assert_eq!(b.trip(now), Some(BreakerState::Open));
        assert_eq!(b.open_until().unwrap() - now, policy.open_initial);
    }

    /// Observed: a server answering real calls in 8 s and the one-token probe in 0.1 s, with
    /// `llm.request_timeout = 5s`: the breaker opened for 1 s of every 10, each passing half-open
    /// probe resetting the open time. Now the open time doubles until a real call is answered.
    #[test]
    fn a_server_slow_for_every_real_call_stays_open_longer_each_time() {
        let policy = BreakerPolicy::default();
        let mut b = Breaker::new(policy);
        let t0 = Instant::now();
        let mut now = t0;
        for wait in [1, 2, 4, 8, 16, 30, 30] {
            // Real calls time out, and the probe that verifies them passes: opened.
            b.record(Outcome::TimedOut, false, now);
            assert_eq!(b.probe_passed(now), Some(BreakerState::Open));
            let until = b.open_until().unwrap();
            assert_eq!(until - now, Duration::from_secs(wait));
            now = until;
            // The half-open probe (the same one-token call) passes and closes it for a trial.
            assert!(b.admit_probe(now));
            assert_eq!(b.record(Outcome::Success, true, now), Some(BreakerState::Closed));
        }
        // A real call answered ends the doubling (a later call timing out opens it anew).
        let ms = Duration::from_millis(1);
        b.record(Outcome::Success, false, now);
        b.timed_out_call_sent(now + ms);
        b.record(Outcome::TimedOut, false, now + 2 * ms);
        assert_eq!(b.probe_passed(now + 3 * ms), Some(BreakerState::Open));
        assert_eq!(b.open_until().unwrap() - (now + 3 * ms), policy.open_initial);
    }

    /// Observed: a server too slow for every real call (`llm.request_timeout = 1s`, 200-token
    /// answers taking 5.8 s) on a busy host, where the verification probe sometimes timed out
    /// too: that opening was not a trial, so the next passing half-open probe reset the open
    /// time to 1 s, again and again (15 openings in 160 s, `/readyz` 200 in most samples) while
    /// no real call was answered. An opening caused by request timeouts is a trial whichever way
    /// its probe went, and once closed for a trial, every reopening keeps doubling until a real
    /// call is answered.
    #[test]
    fn a_failed_probe_during_a_trial_keeps_the_open_time_doubling() {
        let policy = BreakerPolicy::default();
        let mut b = Breaker::new(policy);
        let mut now = Instant::now();
        let mut waits = Vec::new();
        // The first opening too: real calls timed out and so did the probe (measured again on a
        // host starved by other load: 1, 1, 1 s until a probe happened to pass).
        for probe_fails in [true, false, true, true, false, true] {
            for _ in 0..5 {
                b.record(Outcome::TimedOut, false, now);
            }
            let v = b.take_verification().unwrap();
            let verdict = if probe_fails { Outcome::ServerFault } else { Outcome::Success };
            assert_eq!(b.verified(v, verdict, now), Some(BreakerState::Open));
            let until = b.open_until().unwrap();
            waits.push((until - now).as_secs());
            now = until;
            assert!(b.admit_probe(now));
            assert_eq!(b.record(Outcome::Success, true, now), Some(BreakerState::Closed));
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30]);
        // A real call answered ends it, and the next close is an ordinary one again.
        b.record(Outcome::Success, false, now);
        assert!(!b.trial);
        assert_eq!(b.trip(now), Some(BreakerState::Open));
        assert_eq!(b.open_until().unwrap() - now, policy.open_initial);
    }

    /// A verification probe still in flight when the breaker opened otherwise (hard faults) and a
    /// half-open probe closed it again speaks of the time before: its late failure leaves the
    /// closed breaker closed, and a verification taken since is not disturbed by it.
    #[test]
    fn a_verification_taken_before_an_opening_is_ignored_after_it() {
        let mut b = Breaker::new(BreakerPolicy::default());
        let t0 = Instant::now();
        for _ in 0..5 {
            b.record(Outcome::AnsweredFault, false, t0);
        }
        let old = b.take_verification().unwrap();
        // Meanwhile hard faults open it, and its half-open probe closes it.
        assert_eq!(trip(&mut b), Some(BreakerState::Open));
        let t1 = b.open_until().unwrap();
        assert!(b.admit_probe(t1));
        assert_eq!(b.record(Outcome::Success, true, t1), Some(BreakerState::Closed));
        // Suspect again, and verified again while the old probe still runs.
        for _ in 0..5 {
            b.record(Outcome::AnsweredFault, false, t1);
        }
        let new = b.take_verification().expect("the close freed the old probe's slot");
        assert_eq!(b.verified(old, Outcome::ServerFault, t1), None, "the old probe's late failure");
        assert!(b.available(t1) && b.suspect());
        assert!(b.take_verification().is_none(), "the new probe still holds the slot");
        assert_eq!(b.verified(new, Outcome::ServerFault, t1), Some(BreakerState::Open), "the new probe's failure counts");
    }

    #[test]
    fn a_hung_server_whose_probe_times_out_too_opens_it() {
        let t0 = Instant::now();
        // Every call times out, and so does the verification probe (the client reports a failed
        // probe as a server fault; a timed-out outcome opens it as well).
        for probe in [Outcome::ServerFault, Outcome::TimedOut] {
            let mut b = Breaker::new(BreakerPolicy::default());
            for _ in 0..5 {
                assert_eq!(b.record(Outcome::TimedOut, false, t0), None);
            }
            assert!(b.suspect());
            let v = b.take_verification().unwrap();
            assert_eq!(b.verified(v, probe, t0), Some(BreakerState::Open), "{probe:?}");
            assert!(!b.available(t0));
            // The half-open probe times out too: it reopens, with the doubled open time.
            let t1 = t0 + Duration::from_secs(1);
            assert!(b.admit_probe(t1));
            assert_eq!(b.record(probe, true, t1), Some(BreakerState::Open));
            assert_eq!(b.open_until(), Some(t1 + Duration::from_secs(2)));
        }
        // Hard faults (refused connections, connect timeouts) still open it at once.
        let mut b = Breaker::new(BreakerPolicy::default());
        assert_eq!(trip(&mut b), Some(BreakerState::Open));
        assert!(Outcome::TimedOut.needs_verification() && Outcome::AnsweredFault.needs_verification());
        assert!(!Outcome::ServerFault.needs_verification() && !Outcome::RequestFault.needs_verification());
    }
}
