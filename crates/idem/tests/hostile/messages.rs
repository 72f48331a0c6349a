//! The generators of the rest of a message: `Accept-Encoding`s (and the replays of answers whose
//! coding is broken), odd headers, request lines, and well-formed keyed requests between them.

use idem_test_support::wire::{Raw, escape};

use super::cases::{Case, Expect, KeyClass, Reach, Sending, Spec, Then, dubious, either, refused, runs};
use super::generator::{Gen, Keyed, small_body, target, token};
use super::upstream::BROKEN_CODINGS;
use crate::common::{now_millis, uuid_v7_at};

/// Replays of a gzip-encoded answer to clients with junk `Accept-Encoding`s, and of answers whose
/// bytes are not in their coding.
pub(crate) fn accept_encodings(g: &mut Gen) {
    let junk: &[&[u8]] = &[
        b"gzip;q=abc",
        b"*;q=0",
        b"identity;q=0, *;q=0",
        b"gzip;q=0",
        b"gzip;q=0, identity",
        b"\xff\xfe",
        b"br;q=1e9999",
        b"gzip;q=0.5;q=1",
        b"x-gzip",
        b"GZIP",
        b"gzip;q=-1",
        b"gzip;q=1.0000",
        b"gzip, gzip, gzip",
        b";;;",
        b"=",
        b"q=1",
        b"identity;q=0",
        b"zstd;q=0.001, br;q=0.002",
        b"*",
        b"gzip;Q=0",
        b"",
    ];
    for _ in 0..3 {
        let mut rows: Vec<Keyed> = junk
            .iter()
            .map(|value| {
                Keyed::new(format!("gzip answer, Accept-Encoding: {}", escape(value, 60)), "T")
                    .path("/gz")
                    .h("Accept-Encoding", value)
                    .then(Then::Replay)
            })
            .collect();
        // A hostile upstream: answers labelled with a coding they are not in, and a bomb; replayed
        // to clients that accept only identity (so the gateway has to decode) or anything.
        for name in BROKEN_CODINGS {
            for accept in [&b"identity"[..], b"gzip;q=0, br;q=0, zstd;q=0, deflate;q=0", b"*"] {
                let what = format!("upstream answer bad-{name}, Accept-Encoding: {}", escape(accept, 60));
                rows.push(
                    Keyed::new(what, "T")
                        .path(format!("/bad-{name}"))
                        .h("Accept-Encoding", accept)
                        .then(Then::ReplayAsStored),
                );
            }
        }
        let long = ",".repeat(2000) + &"gzip;q=0.1,".repeat(500);
        rows.push(
            Keyed::new("gzip answer, 7 KB Accept-Encoding", "T")
                .path("/gz")
                .h("Accept-Encoding", long)
                .then(Then::Replay),
        );
        for row in rows {
            g.keyed(row);
        }
    }
}

/// Odd or non-UTF-8 headers beside a key.
pub(crate) fn odd_headers(g: &mut Gen) {
    let valid: &[(&str, &[u8], &[u8])] = &[
        ("non-UTF-8 header", b"X-Junk", b"\x80\xff\xfe"),
        ("non-UTF-8 credential", b"Authorization", b"Bearer \xff\xfe\x80"),
        ("non-UTF-8 Accept", b"Accept", b"\x80"),
        ("non-UTF-8 X-Forwarded-For", b"X-Forwarded-For", b"\xff"),
        ("non-UTF-8 Connection", b"Connection", b"\xff"),
        ("Connection naming the key", b"Connection", b"idempotency-key"),
        ("a forged Idempotency-Recovered", b"Idempotency-Recovered", b"true"),
        ("Expect: 100-continue", b"Expect", b"100-continue"),
        ("a bogus Expect", b"Expect", b"200-ok"),
        ("TE: trailers", b"TE", b"trailers"),
        ("Upgrade: h2c", b"Upgrade", b"h2c"),
        ("Upgrade: websocket", b"Upgrade", b"websocket"),
        ("Idempotency-Replayed from the client", b"Idempotency-Replayed", b"true"),
        (
            "Content-Type with NUL-free junk",
            b"Content-Type",
            b"application/json; boundary=\"\x80\"",
        ),
    ];
    for _ in 0..3 {
        for (what, name, value) in valid {
            g.keyed(
                Keyed::new(format!("valid key, {what}"), "T")
                    .any_method()
                    .h(name, value)
                    .maybe_replay(40),
            );
            // The same with an invalid key: refused before anything else.
            g.keyed(
                Keyed::new(format!("invalid key, {what}"), "T x")
                    .any_method()
                    .h(name, value)
                    .spec(refused(KeyClass::Invalid, 400)),
            );
        }
        // Heads without Host, or with two.
        let hosts = [
            Keyed::new("valid key, no Host", "T")
                .without("Host")
                .spec(either(KeyClass::Valid)),
            Keyed::new("valid key, two Hosts", "T")
                .h("Host", "evil.example")
                .spec(dubious(KeyClass::Valid)),
            Keyed::new("valid key, non-UTF-8 Host", "T")
                .without("Host")
                .h("Host", b"\xff\xfe")
                .spec(dubious(KeyClass::Valid)),
        ];
        for row in hosts {
            g.keyed(row);
        }
        // Broken header lines: hyper refuses the head.
        for (what, line) in [
            ("space before the colon", &b"Idempotency-Key : a b"[..]),
            ("empty name", b": x"),
            ("name with a space", b"X Junk: 1"),
            ("obs-fold", b"X-Junk: a\r\n folded"),
            ("DEL in a value", b"X-Junk: a\x7fb"),
            ("NUL in a name", b"X-J\x00nk: 1"),
            ("no colon", b"Idempotency-Key a b"),
        ] {
            let id = g.id();
            // `h` writes "name: value"; for these the whole line is in the name.
            let raw = Raw::new("POST", &target(id))
                .json()
                .h("Idempotency-Key", "a b")
                .h(line, b"");
            let bytes = raw.sized(&small_body(id));
            let bytes = replace_all(&bytes, &[line, b": \r\n"].concat(), &[line, b"\r\n"].concat());
            g.raw(
                id,
                format!("invalid key, header line with {what}"),
                bytes,
                dubious(KeyClass::Invalid),
                Then::Nothing,
            );
        }
    }
}

/// `haystack` with every `from` replaced by `to`.
pub(crate) fn replace_all(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut i = 0;
    while i < haystack.len() {
        if haystack[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(haystack[i]);
            i += 1;
        }
    }
    out
}

/// Odd request lines, pipelining, an HTTP/2 preface.
pub(crate) fn request_lines(g: &mut Gen) {
    for _ in 0..3 {
        // Well-formed HTTP, odd forms: idem must judge the key as usual.
        for (what, line, http_valid) in [
            ("HTTP/1.0", "POST {t} HTTP/1.0", true),
            ("absolute form", "POST http://127.0.0.1{t} HTTP/1.1", true),
            ("double slash", "POST /{t} HTTP/1.1", true),
            ("dot segments", "POST {t}/../../x HTTP/1.1", true),
            ("odd query", "POST {t}?a=%ZZ&b=%00&&=; HTTP/1.1", true),
            ("extra word", "POST {t} HTTP/1.1 x", false),
            ("HTTP/2.0 line", "POST {t} HTTP/2.0", false),
            ("HTTP/1.2", "POST {t} HTTP/1.2", false),
            ("lower-case version", "POST {t} http/1.1", false),
            ("no version", "POST {t}", false),
            ("tab separators", "POST\t{t}\tHTTP/1.1", false),
            ("two spaces", "POST  {t} HTTP/1.1", false),
            ("fragment", "POST {t}#frag HTTP/1.1", false),
            ("asterisk", "POST * HTTP/1.1", false),
            ("NUL in the target", "POST {t}\0 HTTP/1.1", false),
            ("non-UTF-8 target", "POST {t}?\u{ff} HTTP/1.1", false),
        ] {
            for valid_key in [true, false] {
                let id = g.id();
                let line = line.replace("{t}", &target(id));
                let line = if what == "non-UTF-8 target" {
                    replace_all(line.as_bytes(), "\u{ff}".as_bytes(), b"\xff")
                } else {
                    line.into_bytes()
                };
                let key = if valid_key {
                    token(id)
                } else {
                    format!("{} x", token(id))
                };
                let raw = Raw::line(line).json().h("Idempotency-Key", key);
                let (class, expect) = match (valid_key, http_valid) {
                    (_, false) => (
                        if valid_key { KeyClass::Valid } else { KeyClass::Invalid },
                        Expect::Anything,
                    ),
                    (true, true) => (KeyClass::Valid, Expect::Success),
                    (false, true) => (KeyClass::Invalid, Expect::Refused(400)),
                };
                let what = format!("request line: {what}, {class:?} key");
                g.raw(
                    id,
                    what,
                    raw.sized(&small_body(id)),
                    Spec::new(class, http_valid, expect),
                    Then::Nothing,
                );
            }
        }
        // Two requests in one write, without bodies (so nothing needs draining in between).
        for (first_valid, second_valid) in [(false, false), (true, false), (false, true), (true, true)] {
            let (a, b) = (g.id(), g.id());
            let key = |id: u64, valid: bool| if valid { token(id) } else { format!("\"{}", token(id)) };
            let first = Raw::new("POST", &target(a))
                .without("Connection")
                .json()
                .h("Idempotency-Key", key(a, first_valid));
            let second = Raw::new("POST", &target(b))
                .json()
                .h("Idempotency-Key", key(b, second_valid));
            let bytes = [first.sized(b""), second.sized(b"")].concat();
            let spec = |valid: bool| {
                if valid {
                    runs(KeyClass::Valid)
                } else {
                    refused(KeyClass::Invalid, 400)
                }
            };
            let specs = vec![spec(first_valid), spec(second_valid)];
            let reach = vec![(a, specs[0].reach(&Then::Nothing)), (b, specs[1].reach(&Then::Nothing))];
            g.cases.push(Case {
                id: a,
                what: format!("pipelined: {first_valid} key then {second_valid} key"),
                sending: Sending::Raw {
                    bytes,
                    half_close: false,
                },
                specs,
                then: Then::Nothing,
                reach,
            });
        }
        // Not HTTP/1.1 at all: an HTTP/2 preface then junk, binary junk, a TLS ClientHello.
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        let junk: Vec<u8> = (0..512).map(|_| g.rng.next() as u8).collect();
        for (what, bytes) in [
            (
                "HTTP/2 preface then junk",
                [preface, b"\x00\x00\x04\xff\xff\xff\xff\xff\xff\xff\xff".as_slice()].concat(),
            ),
            ("binary junk", junk),
            (
                "TLS ClientHello",
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03".to_vec(),
            ),
        ] {
            let id = g.id();
            g.raw(id, what, bytes, dubious(KeyClass::Absent), Then::Nothing);
        }
        // An HTTP/2 preface, then a keyed HTTP/1.1 request.
        let id = g.id();
        let http1 = Raw::new("POST", &target(id))
            .json()
            .h("Idempotency-Key", "a b")
            .sized(&small_body(id));
        let bytes = [preface.as_slice(), &http1].concat();
        g.raw(
            id,
            "HTTP/2 preface then HTTP/1.1",
            bytes,
            dubious(KeyClass::Invalid),
            Then::Nothing,
        );
    }
}

/// Well-formed keyed requests with random valid keys, sent by a real client, each retried.
pub(crate) fn well_formed(g: &mut Gen, count: usize) {
    for _ in 0..count {
        let id = g.id();
        let t = token(id);
        let kind = g.rng.below(10);
        let (key, quoted) = match kind {
            0 => (uuid_v7_at(now_millis()), false),
            1 => (format!("{t}{:016x}{:016x}", g.rng.next(), g.rng.next()), false),
            _ => {
                let len = g.rng.below(256 - t.len());
                let mut key = t.clone();
                for _ in 0..len {
                    let c = (0x21 + g.rng.below(94) as u8) as char;
                    key.push(if c == '~' { '+' } else { c });
                }
                let needs_quotes = key.contains(['"', ',', '\\']);
                (key, needs_quotes || g.rng.chance(40))
            }
        };
        let header = if quoted {
            format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
        } else {
            key.clone()
        };
        let amount = g.rng.below(1_000_000);
        let note: String = (0..g.rng.below(40))
            .map(|_| (b'a' + g.rng.below(26) as u8) as char)
            .collect();
        let body = format!(r#"{{"amount":{amount},"currency":"EUR","note":"{note}"}}"#);
        let (retry, then) = match g.rng.below(20) {
            // The same value serialised differently still replays.
            0..=7 => (
                format!(r#"{{ "note": "{note}", "currency": "EUR", "amount": {amount} }}"#),
                Then::Replay,
            ),
            8 => (
                format!(r#"{{"amount":{},"currency":"EUR","note":"{note}"}}"#, amount + 1),
                Then::Mismatch(Vec::new()),
            ),
            _ => (body.clone(), Then::Replay),
        };
        let spec = runs(KeyClass::Valid);
        g.cases.push(Case {
            id,
            what: format!("well-formed, Idempotency-Key: {header}"),
            sending: Sending::Client {
                key: header,
                body,
                retry,
            },
            specs: vec![spec],
            reach: vec![(id, Reach::Once)],
            then,
        });
    }
    // Time-ordered keys older than --ttl: refused as expired, never run.
    for _ in 0..20 {
        let id = g.id();
        let key = uuid_v7_at(now_millis() - 3 * 24 * 3600 * 1000);
        let spec = refused(KeyClass::Expired, 422);
        g.cases.push(Case {
            id,
            what: format!("UUIDv7 key from three days ago: {key}"),
            sending: Sending::Client {
                key,
                body: "{}".into(),
                retry: "{}".into(),
            },
            specs: vec![spec],
            reach: vec![(id, Reach::Never)],
            then: Then::Nothing,
        });
    }
}
