//! Properties of the backoff: the windows double up to the cap, every wait is spread evenly over the
//! whole of its window (full jitter), and clients that failed together come back spread over the
//! whole window, not in a wave.

use std::time::Duration;

use idem_client::{Backoff, IdempotencyMiddleware};
use proptest::prelude::*;

/// How many waits each case draws: enough that each tolerance below is over six standard
/// deviations of a uniform draw wide (a false failure has a chance under 10⁻⁸ in a whole run),
/// while waits that are not spread over the whole window (no jitter, jitter over half the window,
/// jitter clamped to the cap) miss them by far more.
const DRAWS: usize = 10_000;

/// docs/clients.md's promise: the `n`th retry's window is `min(cap, base × 2ⁿ⁻¹)` (0 counts as 1).
fn promised_window(base_ms: u64, cap_ms: u64, retry: u32) -> Duration {
    let doublings = retry.saturating_sub(1).min(64);
    let grown = u128::from(base_ms) << doublings;
    Duration::from_millis(grown.min(u128::from(cap_ms)) as u64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn waits_are_spread_evenly_over_the_whole_window(
        base_ms in 1u64..20_000,
        cap_ms in 1u64..120_000,
        retry in 0u32..40,
    ) {
        let backoff = Backoff::new(Duration::from_millis(base_ms), Duration::from_millis(cap_ms));
        let window = promised_window(base_ms, cap_ms, retry);
        prop_assert_eq!(backoff.window(retry), window);
        let mut tenths = [0usize; 10];
        let mut sum = 0.0;
        for _ in 0..DRAWS {
            let delay = backoff.delay(retry);
            prop_assert!(delay <= window, "{:?} is outside [0, {:?}]", delay, window);
            let fraction = delay.as_secs_f64() / window.as_secs_f64();
            sum += fraction;
            tenths[((fraction * 10.0) as usize).min(9)] += 1;
        }
        let mean = sum / DRAWS as f64;
        prop_assert!(
            (mean - 0.5).abs() < 0.02,
            "full jitter waits half the window on average, but the waits of retry {} averaged {:.3} of its \
             {:?} window",
            retry,
            mean,
            window
        );
        prop_assert!(
            tenths.iter().all(|&n| n.abs_diff(DRAWS / 10) < DRAWS / 50),
            "every tenth of retry {}'s {:?} window must hold a tenth of the waits (within 2 %), from the first \
             to the last; they held {:?} of {}",
            retry,
            window,
            tenths,
            DRAWS
        );
    }
}

proptest! {
    #[test]
    fn windows_never_shrink_from_one_retry_to_the_next(
        base_ms in 0u64..20_000,
        cap_ms in 0u64..120_000,
        retry in 0u32..100,
    ) {
        let backoff = Backoff::new(Duration::from_millis(base_ms), Duration::from_millis(cap_ms));
        prop_assert!(backoff.window(retry) <= backoff.window(retry + 1));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_first_retries_of_a_thousand_clients_spread_over_the_whole_window(
        base_ms in 1u64..5_000,
        cap_ms in 1u64..10_000,
    ) {
        let clients: Vec<IdempotencyMiddleware> = (0..1_000)
            .map(|_| {
                IdempotencyMiddleware::new()
                    .with_base_delay(Duration::from_millis(base_ms))
                    .with_max_delay(Duration::from_millis(cap_ms))
            })
            .collect();
        let window = clients[0].backoff().window(1);
        prop_assert_eq!(window, Duration::from_millis(base_ms.min(cap_ms)));
        let mut tenths = [0usize; 10];
        for client in &clients {
            let delay = client.backoff().delay(1);
            prop_assert!(delay <= window);
            let tenth = ((delay.as_secs_f64() / window.as_secs_f64()) * 10.0) as usize;
            tenths[tenth.min(9)] += 1;
        }
        prop_assert!(
            tenths.iter().all(|&n| n <= 200),
            "no tenth of the window may hold more than a fifth of the clients: {:?}",
            tenths
        );
    }
}
