//! The retry budget: a token bucket shared by every request of one client, so that a failing
//! server sees a bounded number of retries instead of a storm.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A token bucket that every retry draws from, shared by all clones of one client.
///
/// * It starts full, with `capacity` tokens.
/// * Each retry costs one token; when less than one is left, the client stops retrying and hands
///   back the last answer (or error) as it is.
/// * Each final answer that needed no further retry (a success, or an error that is not worth
///   retrying: the server is up) refills `refill_per_success` tokens (default 0.1): under a steady
///   failure rate, retries stay below about a tenth of the traffic.
/// * A minimum reserve refills `min_per_second` tokens each second whatever happens (default 1), so
///   that a client that sends few requests is never left without retries for long.
///
/// Against a server that answers nothing but errors, all the requests of one client together
/// make at most `capacity + min_per_second × seconds` retries.
///
/// The budget is shared by clones (it is an `Arc` inside); configure it before sharing it.
///
/// ```
/// use idem_client::{IdempotencyMiddleware, RetryBudget};
///
/// let budget = RetryBudget::new(20).with_refill_per_success(0.2).with_min_per_second(0.5);
/// let middleware = IdempotencyMiddleware::new().with_budget(budget.clone());
/// assert_eq!(budget.available(), 20.0);
/// # drop(middleware);
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    capacity: f64,
    per_success: f64,
    per_second: f64,
    state: Arc<Mutex<State>>,
}

#[derive(Debug)]
struct State {
    tokens: f64,
    refreshed: Instant,
}

impl Default for RetryBudget {
    /// 10 tokens, 0.1 per success, a reserve of 1 per second.
    fn default() -> Self {
        Self::new(10)
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("capacity", &self.capacity)
            .field("refill_per_success", &self.per_success)
            .field("min_per_second", &self.per_second)
            .field("available", &self.available())
            .finish()
    }
}

fn non_negative(value: f64) -> f64 {
    if value.is_nan() { 0.0 } else { value.max(0.0) }
}

impl RetryBudget {
    /// A full bucket of `capacity` tokens that refills 0.1 token per success and 1 per second.
    pub fn new(capacity: u32) -> Self {
        Self::with_capacity(f64::from(capacity))
    }

    /// A budget that never runs out: every retry the other limits allow is made.
    pub fn unlimited() -> Self {
        Self::with_capacity(f64::INFINITY)
    }

    fn with_capacity(capacity: f64) -> Self {
        Self {
            capacity,
            per_success: 0.1,
            per_second: 1.0,
            state: Arc::new(Mutex::new(State {
                tokens: capacity,
                refreshed: Instant::now(),
            })),
        }
    }

    /// Tokens added by each answer that ends a request without a retry (negative counts as 0).
    pub fn with_refill_per_success(mut self, tokens: f64) -> Self {
        self.per_success = non_negative(tokens);
        self
    }

    /// Tokens added per second of time alone, the minimum reserve (0 turns it off).
    pub fn with_min_per_second(mut self, tokens: f64) -> Self {
        self.per_second = non_negative(tokens);
        self
    }

    /// The tokens left now.
    pub fn available(&self) -> f64 {
        self.available_at(Instant::now())
    }

    /// Takes one token for a retry; `false` (and nothing taken) when less than one is left.
    pub fn try_withdraw(&self) -> bool {
        self.try_withdraw_at(Instant::now())
    }

    /// Adds the refill of one success.
    pub fn deposit(&self) {
        self.deposit_at(Instant::now());
    }

    fn with_state<T>(&self, now: Instant, f: impl FnOnce(&mut State) -> T) -> T {
        // The state is two numbers that are always consistent: a panic elsewhere cannot leave
        // it half-written, so a poisoned lock is safe to keep using.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let elapsed = now.saturating_duration_since(state.refreshed);
        if elapsed > Duration::ZERO {
            state.tokens = (state.tokens + elapsed.as_secs_f64() * self.per_second).min(self.capacity);
            state.refreshed = now;
        }
        f(&mut state)
    }

    fn available_at(&self, now: Instant) -> f64 {
        self.with_state(now, |s| s.tokens)
    }

    fn try_withdraw_at(&self, now: Instant) -> bool {
        self.with_state(now, |s| {
            if s.tokens >= 1.0 {
                s.tokens -= 1.0;
                true
            } else {
                false
            }
        })
    }

    fn deposit_at(&self, now: Instant) {
        let (add, capacity) = (self.per_success, self.capacity);
        self.with_state(now, |s| s.tokens = (s.tokens + add).min(capacity));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_retry_costs_one_token_until_none_is_left() {
        let budget = RetryBudget::new(3).with_min_per_second(0.0);
        let now = Instant::now();
        let granted = (0..10).filter(|_| budget.try_withdraw_at(now)).count();
        assert_eq!(granted, 3);
        assert_eq!(budget.available_at(now), 0.0);
    }

    #[test]
    fn successes_refill_a_fraction_up_to_the_capacity() {
        let budget = RetryBudget::new(2)
            .with_refill_per_success(0.25)
            .with_min_per_second(0.0);
        let now = Instant::now();
        assert!(budget.try_withdraw_at(now));
        assert!(budget.try_withdraw_at(now));
        assert!(!budget.try_withdraw_at(now));
        for _ in 0..3 {
            budget.deposit_at(now);
        }
        assert!(!budget.try_withdraw_at(now), "0.75 token is not a retry");
        budget.deposit_at(now);
        assert!(budget.try_withdraw_at(now), "four successes pay for one retry");
        for _ in 0..100 {
            budget.deposit_at(now);
        }
        assert_eq!(budget.available_at(now), 2.0, "never above the capacity");
    }

    #[test]
    fn the_reserve_refills_with_time_alone() {
        let budget = RetryBudget::new(5)
            .with_refill_per_success(0.0)
            .with_min_per_second(2.0);
        let start = Instant::now();
        while budget.try_withdraw_at(start) {}
        assert!(!budget.try_withdraw_at(start + Duration::from_millis(400)));
        // 0.8 token after 400 ms, 1.0 after 500 ms.
        assert!(budget.try_withdraw_at(start + Duration::from_millis(500)));
        assert!(!budget.try_withdraw_at(start + Duration::from_millis(500)));
        assert_eq!(budget.available_at(start + Duration::from_secs(3600)), 5.0);
    }

    #[test]
    fn clones_share_one_bucket() {
        let budget = RetryBudget::new(2).with_min_per_second(0.0);
        let other = budget.clone();
        assert!(budget.try_withdraw());
        assert!(other.try_withdraw());
        assert!(!budget.try_withdraw());
    }

    #[test]
    fn unlimited_never_runs_out() {
        let budget = RetryBudget::unlimited();
        assert!((0..10_000).all(|_| budget.try_withdraw()));
    }

    #[test]
    fn nonsense_rates_count_as_zero() {
        let budget = RetryBudget::new(1)
            .with_refill_per_success(f64::NAN)
            .with_min_per_second(-3.0);
        let now = Instant::now();
        assert!(budget.try_withdraw_at(now));
        budget.deposit_at(now);
        assert!(!budget.try_withdraw_at(now + Duration::from_secs(60)));
    }
}
