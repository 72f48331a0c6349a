//! Properties of the backoff: every wait lies within its window and under the cap, and clients
//! that failed together come back spread over the whole window, not in a wave.

use std::time::Duration;

use idem_client::{Backoff, IdempotencyMiddleware};
use proptest::prelude::*;

proptest! {
    #[test]
    fn every_delay_lies_within_zero_and_the_cap(
        base_ms in 0u64..20_000,
        cap_ms in 0u64..120_000,
        retry in 0u32..100,
    ) {
        let cap = Duration::from_millis(cap_ms);
        let backoff = Backoff::new(Duration::from_millis(base_ms), cap);
        let window = backoff.window(retry);
        prop_assert!(window <= cap);
        for _ in 0..20 {
            let delay = backoff.delay(retry);
            prop_assert!(delay <= window, "{:?} is outside [0, {:?}]", delay, window);
        }
    }

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
