//! The seed of a fault storm: printed at the start, taken from `IDEM_STORM_SEED` to replay one, and
//! a small deterministic generator (SplitMix64) so that one seed always gives one fault schedule,
//! whatever the version of any random-number crate.

use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The environment variable that replays a storm.
pub const SEED_VAR: &str = "IDEM_STORM_SEED";

/// The seed of this test process's storms: `IDEM_STORM_SEED` (decimal or `0x` hexadecimal) if set,
/// otherwise a random one. Every scenario derives its own stream from it by name, so one number
/// replays every scenario of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seed(pub u64);

impl Seed {
    /// The seed of this process, chosen once and printed once (with how to replay it).
    ///
    /// # Panics
    /// If `IDEM_STORM_SEED` is set but is not a number.
    pub fn for_this_run() -> Self {
        static SEED: OnceLock<Seed> = OnceLock::new();
        *SEED.get_or_init(|| {
            let seed = match std::env::var(SEED_VAR) {
                Ok(text) if !text.trim().is_empty() => Self::parse(&text)
                    .unwrap_or_else(|| panic!("{SEED_VAR}={text:?} is not a number (decimal or 0x hexadecimal)")),
                _ => Self(random_u64()),
            };
            eprintln!("storm seed: {} (replay with {SEED_VAR}={})", seed.0, seed.0);
            seed
        })
    }

    /// Parses a decimal or `0x` hexadecimal seed.
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => text.parse().ok(),
        }
        .map(Self)
    }

    /// The generator of the scenario `name`: its own stream, fixed by the seed and the name.
    pub fn rng(self, name: &str) -> Rng {
        // FNV-1a: stable across Rust versions, unlike the standard library's hashers.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in name.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        Rng::new(self.0 ^ hash)
    }
}

fn random_u64() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    // Keep it below 2^53 so that it survives being pasted through tools that read JSON numbers.
    RandomState::new().hash_one(nanos) >> 11
}

/// SplitMix64 (Steele, Lea and Flood, 2014): tiny, fast and good enough to schedule faults.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator that starts from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is `0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Multiply-shift: no modulo bias worth speaking of for the small `n` used here.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A number in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// A duration in `[low, high]`, to the millisecond.
    pub fn between(&mut self, low: Duration, high: Duration) -> Duration {
        let (low_ms, high_ms) = (millis(low), millis(high).max(millis(low)));
        Duration::from_millis(low_ms + self.below(high_ms - low_ms + 1))
    }

    /// An index picked with the given weights (at least one positive).
    pub fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
        let mut pick = self.below(total);
        for (i, &weight) in weights.iter().enumerate() {
            if pick < u64::from(weight) {
                return i;
            }
            pick -= u64::from(weight);
        }
        weights.len().saturating_sub(1)
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_is_one_stream_per_name() {
        let seed = Seed(42);
        let a: Vec<u64> = (0..4)
            .map({
                let mut rng = seed.rng("postgres");
                move |_| rng.next_u64()
            })
            .collect();
        let again: Vec<u64> = (0..4)
            .map({
                let mut rng = seed.rng("postgres");
                move |_| rng.next_u64()
            })
            .collect();
        let other: Vec<u64> = (0..4)
            .map({
                let mut rng = seed.rng("redis");
                move |_| rng.next_u64()
            })
            .collect();
        assert_eq!(a, again);
        assert_ne!(a, other);
    }

    #[test]
    fn seeds_parse_in_decimal_and_hex() {
        assert_eq!(Seed::parse(" 123 "), Some(Seed(123)));
        assert_eq!(Seed::parse("0xff"), Some(Seed(255)));
        assert_eq!(Seed::parse("nope"), None);
    }

    #[test]
    fn draws_stay_in_their_ranges() {
        let mut rng = Rng::new(7);
        let mut seen = [0usize; 3];
        for _ in 0..10_000 {
            assert!(rng.below(10) < 10);
            let d = rng.between(Duration::from_millis(100), Duration::from_millis(200));
            assert!((100..=200).contains(&d.as_millis()));
            let u = rng.unit();
            assert!((0.0..1.0).contains(&u));
            seen[rng.weighted(&[1, 0, 3])] += 1;
        }
        assert_eq!(seen[1], 0, "a weight of zero is never picked");
        assert!(seen[2] > seen[0] * 2, "{seen:?}");
    }
}
