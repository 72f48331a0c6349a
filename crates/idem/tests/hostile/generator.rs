//! The seeded generator: a small random number generator whose seed is printed (and replayed with
//! `IDEM_HOSTILE_SEED`), and [`Gen`], which collects the cases the generators write.

use crate::common::random_u64;
use idem_test_support::wire::{Raw, escape};

use super::cases::{Case, Expect, KeyClass, Sending, Spec, Then, runs};
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

/// `shape` with every `T` replaced by `token`.
pub(crate) fn with_token(shape: &[u8], token: &str) -> Vec<u8> {
    let mut value = Vec::new();
    for &b in shape {
        if b == b'T' {
            value.extend_from_slice(token.as_bytes());
        } else {
            value.push(b);
        }
    }
    value
}

/// What a [`Keyed`] case sends after the first answer.
enum After {
    Then(Then),
    /// A replay, some of the time (in percent).
    MaybeReplay(u64),
    /// The same head with this body: a mismatch.
    Mismatch(Vec<u8>),
}

/// A hand-written case, a row of a table: a request to the case's path with a JSON content type,
/// one key header (`T` in it stands for the case's token) and more header lines, sent as raw
/// bytes. Unless the row says otherwise: a `POST` with a small body that must run, and nothing
/// sent after.
pub(crate) struct Keyed {
    what: String,
    /// `None`: a protected method picked at random.
    method: Option<&'static str>,
    /// After the case's path.
    path: String,
    /// Header fields taken out of [`Raw::new`]'s before the others go in.
    without: Vec<&'static str>,
    key: Vec<u8>,
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    body: Option<Vec<u8>>,
    spec: Spec,
    after: After,
}

impl Keyed {
    /// A `POST` with the key header `key` that must run.
    pub(crate) fn new(what: impl Into<String>, key: impl AsRef<[u8]>) -> Self {
        Self {
            what: what.into(),
            method: Some("POST"),
            path: String::new(),
            without: Vec::new(),
            key: key.as_ref().to_vec(),
            headers: Vec::new(),
            body: None,
            spec: runs(KeyClass::Valid),
            after: After::Then(Then::Nothing),
        }
    }

    /// With a protected method picked at random.
    pub(crate) fn any_method(mut self) -> Self {
        self.method = None;
        self
    }

    /// With `suffix` after the case's path.
    pub(crate) fn path(mut self, suffix: impl Into<String>) -> Self {
        self.path = suffix.into();
        self
    }

    /// Without the default header field `name` (`Host`, `Connection`).
    pub(crate) fn without(mut self, name: &'static str) -> Self {
        self.without.push(name);
        self
    }

    /// With one more header line after the key.
    pub(crate) fn h(mut self, name: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Self {
        self.headers.push((name.as_ref().to_vec(), value.as_ref().to_vec()));
        self
    }

    /// With `X-Many-0: 1` to `X-Many-<count - 1>: 1`.
    pub(crate) fn many(self, count: usize) -> Self {
        (0..count).fold(self, |row, i| row.h(format!("X-Many-{i}"), "1"))
    }

    /// With `body` instead of the small one.
    pub(crate) fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = Some(body.into());
        self
    }

    /// Judged by `spec`.
    pub(crate) fn spec(mut self, spec: Spec) -> Self {
        self.spec = spec;
        self
    }

    /// With `then` after the first answer.
    pub(crate) fn then(mut self, then: Then) -> Self {
        self.after = After::Then(then);
        self
    }

    /// A replay after the first answer, `percent` of the time.
    pub(crate) fn maybe_replay(mut self, percent: u64) -> Self {
        self.after = After::MaybeReplay(percent);
        self
    }

    /// The same head with `body` after the first answer: `422`.
    pub(crate) fn mismatch(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.after = After::Mismatch(body.into());
        self
    }
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

    /// Adds `row` under the next case number.
    pub(crate) fn keyed(&mut self, row: Keyed) {
        let id = self.id();
        let method = row.method.unwrap_or_else(|| self.method());
        let mut raw = Raw::new(method, &format!("{}{}", target(id), row.path));
        for name in row.without {
            raw = raw.without(name);
        }
        raw = raw.json().h("Idempotency-Key", with_token(&row.key, &token(id)));
        for (name, value) in row.headers {
            raw = raw.h(name, value);
        }
        let then = match row.after {
            After::Then(then) => then,
            After::MaybeReplay(percent) => self.maybe_replay(percent),
            After::Mismatch(body) => Then::Mismatch(raw.sized(&body)),
        };
        let body = row.body.unwrap_or_else(|| small_body(id));
        self.raw(id, row.what, raw.sized(&body), row.spec, then);
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
