//! The seeded generator: a small random number generator whose seed is printed (and replayed with
//! `IDEM_HOSTILE_SEED`), and [`Gen`], which collects the cases the generators write.

use crate::common::random_u64;
use idem_test_support::wire::{Raw, escape};

use super::cases::{Case, Expect, KeyClass, Sending, Spec, Then};
use super::oracle::{http_value_ok, key_is_valid};

/// Header lines given as (name, value).
pub(crate) type Headers<'a> = &'a [(&'a str, &'a [u8])];

/// SplitMix64: small, seedable, good enough to pick test inputs.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    pub(crate) fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

/// This run's seed: `IDEM_HOSTILE_SEED`, or a random one.
pub(crate) fn seed() -> u64 {
    match std::env::var("IDEM_HOSTILE_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("IDEM_HOSTILE_SEED={text:?} is not a u64")),
        Err(_) => random_u64(),
    }
}

/// `body` as one chunk and the last chunk.
pub(crate) fn chunked(body: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", body.len()).into_bytes();
    out.extend_from_slice(body);
    out.extend_from_slice(b"\r\n0\r\n\r\n");
    out
}

/// A token unique to case `id`, to build keys around.
pub(crate) fn token(id: u64) -> String {
    // `~` never appears in generated junk, so keys built around distinct tokens never collide.
    format!("~{id}~")
}

/// The path of case `id` (`/h/<id>`), by which the upstream's log names it.
pub(crate) fn target(id: u64) -> String {
    format!("/h/{id}")
}

/// A small JSON body for case `id`.
pub(crate) fn small_body(id: u64) -> Vec<u8> {
    format!(r#"{{"case":{id},"amount":1000}}"#).into_bytes()
}

/// Collects the cases the generators write, numbering them.
pub(crate) struct Gen {
    pub(crate) rng: Rng,
    pub(crate) next: u64,
    pub(crate) cases: Vec<Case>,
}

impl Gen {
    pub(crate) fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// A protected method.
    pub(crate) fn method(&mut self) -> &'static str {
        if self.rng.chance(75) { "POST" } else { "PATCH" }
    }

    pub(crate) fn raw(&mut self, id: u64, what: impl Into<String>, bytes: Vec<u8>, spec: Spec, then: Then) {
        self.push_raw(id, what, bytes, false, spec, then);
    }

    pub(crate) fn push_raw(
        &mut self,
        id: u64,
        what: impl Into<String>,
        bytes: Vec<u8>,
        half_close: bool,
        spec: Spec,
        then: Then,
    ) {
        let reach = vec![(id, spec.reach(&then))];
        self.cases.push(Case {
            id,
            what: what.into(),
            sending: Sending::Raw { bytes, half_close },
            specs: vec![spec],
            then,
            reach,
        });
    }

    /// A replay follow-up, some of the time.
    pub(crate) fn maybe_replay(&mut self, percent: u64) -> Then {
        if self.rng.chance(percent) {
            Then::Replay
        } else {
            Then::Nothing
        }
    }

    /// A protected request with one key header holding `value`; its expectations follow from the
    /// value (see [`key_is_valid`], [`http_value_ok`]).
    pub(crate) fn key_value(&mut self, id: u64, what: String, value: &[u8]) {
        let method = self.method();
        let bytes = Raw::new(method, &target(id))
            .json()
            .h("Idempotency-Key", value)
            .sized(&small_body(id));
        let http_valid = http_value_ok(value);
        let valid = key_is_valid(value);
        let (key, expect) = match (http_valid, valid) {
            (false, _) => (KeyClass::Invalid, Expect::Anything),
            (true, true) => (KeyClass::Valid, Expect::Success),
            (true, false) => (KeyClass::Invalid, Expect::Refused(400)),
        };
        let then = if valid && http_valid {
            self.maybe_replay(25)
        } else {
            Then::Nothing
        };
        let what = format!("{method} {what}: Idempotency-Key: {}", escape(value, 120));
        self.raw(id, what, bytes, Spec::new(key, http_valid, expect), then);
    }
}
