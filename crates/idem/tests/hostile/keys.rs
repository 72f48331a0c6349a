//! The generators of key headers: every byte, hand-written shapes, fuzzed values and repeated
//! headers.

use idem_test_support::wire::Raw;

use super::cases::{KeyClass, Then, either, refused};
use super::generator::{Gen, Headers, Rng, small_body, target, token};

/// Every byte 0x00-0xFF in a key: at its start, in its middle, inside an sf-string, and alone.
pub(crate) fn key_bytes(g: &mut Gen) {
    for b in 0u8..=255 {
        for form in ["start", "middle", "sf-string", "alone"] {
            let id = g.id();
            let t = token(id);
            let value: Vec<u8> = match form {
                "start" => [&[b][..], t.as_bytes(), b"z"].concat(),
                "middle" => [t.as_bytes(), &[b][..], b"z"].concat(),
                "sf-string" => [b"\"", t.as_bytes(), &[b][..], b"z\""].concat(),
                // The only single-byte keys of a run, so they are unique too.
                _ => vec![b],
            };
            g.key_value(id, format!("key byte 0x{b:02x} ({form})"), &value);
        }
    }
}

/// sf-string and list edge cases, and lengths around the limit. `T` stands for the case's token.
pub(crate) fn key_shapes(g: &mut Gen) {
    let shapes: &[&[u8]] = &[
        b"\"T",
        b"\"T\\\"x\"",
        b"\"T\\\\x\"",
        b"\"T\\x\"",
        b"\"T\\u0041\"",
        b"\"T\";a=1",
        b"\"T\"; a=1",
        b"\"T\";a",
        b"\"T\";a=1;b=?0",
        b"\"T\";",
        b"T;a=1",
        b"T;",
        b"T=",
        b"(\"T\" \"u\")",
        b"(\"T\")",
        b"(T u)",
        b"(T)",
        b"\"T\", \"u\"",
        b"\"T\",",
        b"T, u",
        b"T,",
        b",T",
        b"\"T\"x",
        b"\"T\"\"",
        b"\"T\"\"u\"",
        b"\"T\" \"u\"",
        b"\"T\" , ",
        b"\"\"",
        b"\"",
        b"\"\\\"",
        b"\\",
        b"\"T\" ",
        b" T",
        b"\tT\t",
        b"\"T\"\t",
        b"'T'",
        b"T\"",
        b"\"T\\\"",
        b"\"T\\\\\"",
        b"\"T\\",
        b"\"\\T\"",
        b"?T",
        b"?1T",
        b":VGVzdA==:T",
        b"*T",
        b"@T",
        b"\"T%22\"",
        b"T\\x",
        b"=?utf-8?b?T?=",
        b"T u",
        b"\"T u\"",
        b"\" T\"",
        b"\"T \"",
        b"\"T\tu\"",
        b"T\tu",
        b"\"T\x80\"",
        b"T\xc3\xa9",
        b"\"T\xc3\xa9\"",
        b"T\x7f",
        b"T()<>@:/[]?={}",
        b"\"T()<>@,;:/[]?={}\"",
        b"\"T,u\"",
        b"T\r\n x",
        b"T\r\nIdempotency-Key x",
    ];
    for _ in 0..3 {
        for shape in shapes {
            let id = g.id();
            let t = token(id);
            let mut value = Vec::new();
            for &b in *shape {
                if b == b'T' {
                    value.extend_from_slice(t.as_bytes());
                } else {
                    value.push(b);
                }
            }
            g.key_value(id, "sf-string shape".to_owned(), &value);
        }
    }
    // Lengths: the limit is 255 characters of key, whatever the quoting.
    for _ in 0..3 {
        let lengths: &[(&str, usize)] = &[
            ("bare", 1),
            ("bare", 254),
            ("bare", 255),
            ("bare", 256),
            ("bare", 10_000),
            ("bare", 100_000),
            ("quoted", 255),
            ("quoted", 256),
            ("quoted+escapes", 255),
            ("quoted+escapes", 256),
            ("bare+spaces", 255),
        ];
        for &(form, len) in lengths {
            let id = g.id();
            let t = token(id);
            let pad = |n: usize| "k".repeat(n.saturating_sub(t.len()));
            let value = match form {
                "bare" if len < t.len() => "k".to_owned(), // unique enough: only one per round
                "bare" => format!("{t}{}", pad(len)),
                "quoted" => format!("\"{t}{}\"", pad(len)),
                // Each `\"` is one character of key but two bytes on the wire.
                "quoted+escapes" => format!("\"{t}{}{}\"", "\\\"".repeat(100), pad(len - 100)),
                _ => format!("  {t}{}  \t", pad(len)),
            };
            if form == "bare" && len == 1 {
                continue; // covered by the byte sweep
            }
            g.key_value(id, format!("{form} key of {len} characters"), value.as_bytes());
        }
    }
}

/// Random junk around a unique token, classified by the rules above.
pub(crate) fn key_fuzz(g: &mut Gen, count: usize) {
    fn junk(rng: &mut Rng, out: &mut Vec<u8>, n: usize) {
        const SPECIAL: &[u8] = b"\"\\,;=()?:*<>@[]{}/' \t";
        for _ in 0..n {
            let b = match rng.below(100) {
                0..=54 => 0x21 + rng.below(94) as u8,
                55..=84 => *rng.pick(SPECIAL),
                85..=92 => 0x80 + rng.below(128) as u8,
                // Control bytes, but not CR or LF: those end the header line, and what follows
                // could parse as another header.
                _ => *rng.pick(&[0x00, 0x01, 0x08, 0x0b, 0x0c, 0x1b, 0x1f, 0x7f]),
            };
            out.push(if b == b'~' { b'-' } else { b });
        }
    }
    for _ in 0..count {
        let id = g.id();
        let mut value = Vec::new();
        if g.rng.chance(45) {
            value.push(b'"');
        }
        let n = g.rng.below(6);
        junk(&mut g.rng, &mut value, n);
        value.extend_from_slice(token(id).as_bytes());
        let n = if g.rng.chance(8) {
            200 + g.rng.below(100)
        } else {
            g.rng.below(6)
        };
        junk(&mut g.rng, &mut value, n);
        if g.rng.chance(40) {
            value.push(b'"');
        }
        g.key_value(id, "fuzzed key".to_owned(), &value);
    }
}

/// Several key headers, and repeated headers around a valid key.
pub(crate) fn repeated_headers(g: &mut Gen) {
    for _ in 0..4 {
        let sets: Vec<(&str, Vec<(&str, String)>)> = {
            let a = token(g.next + 1);
            vec![
                (
                    "same key twice",
                    vec![("Idempotency-Key", a.clone()), ("Idempotency-Key", a.clone())],
                ),
                (
                    "two keys",
                    vec![("Idempotency-Key", a.clone()), ("Idempotency-Key", format!("{a}b"))],
                ),
                (
                    "valid and invalid",
                    vec![("Idempotency-Key", a.clone()), ("Idempotency-Key", "a b".into())],
                ),
                (
                    "valid and empty",
                    vec![("Idempotency-Key", a.clone()), ("Idempotency-Key", String::new())],
                ),
                (
                    "differing case",
                    vec![("Idempotency-Key", a.clone()), ("IDEMPOTENCY-KEY", format!("{a}b"))],
                ),
                (
                    "three",
                    vec![
                        ("idempotency-key", a.clone()),
                        ("Idempotency-key", a.clone()),
                        ("Idempotency-Key", a.clone()),
                    ],
                ),
                (
                    "quoted and bare",
                    vec![("Idempotency-Key", format!("\"{a}\"")), ("Idempotency-Key", a.clone())],
                ),
                ("empty value", vec![("Idempotency-Key", String::new())]),
                ("only spaces", vec![("Idempotency-Key", "   ".into())]),
            ]
        };
        for (what, headers) in sets {
            let id = g.id();
            let method = g.method();
            let mut raw = Raw::new(method, &target(id)).json();
            for (name, value) in headers {
                raw = raw.h(name, value);
            }
            let bytes = raw.sized(&small_body(id));
            let spec = refused(KeyClass::Invalid, 400);
            g.raw(
                id,
                format!("{method} repeated key headers: {what}"),
                bytes,
                spec,
                Then::Nothing,
            );
        }
        // Repeated headers next to one valid key: idem may refuse them (a repeated scope header is
        // `400 scope-invalid`) or let them through; either way the key is valid.
        let others: &[(&str, Headers<'_>)] = &[
            (
                "two credentials",
                &[("Authorization", b"Bearer a"), ("Authorization", b"Bearer b")],
            ),
            (
                "the same credential twice",
                &[("Authorization", b"Bearer a"), ("Authorization", b"Bearer a")],
            ),
            ("an empty credential", &[("Authorization", b"")]),
            ("two content types", &[("Content-Type", b"text/plain")]),
            (
                "two accept-encodings",
                &[("Accept-Encoding", b"gzip"), ("Accept-Encoding", b"br")],
            ),
        ];
        for (what, headers) in others {
            let id = g.id();
            let mut raw = Raw::new(g.method(), &target(id)).json().h("Idempotency-Key", token(id));
            for (name, value) in *headers {
                raw = raw.h(name, value);
            }
            let then = g.maybe_replay(30);
            let spec = either(KeyClass::Valid);
            g.raw(id, format!("valid key, {what}"), raw.sized(&small_body(id)), spec, then);
        }
    }
}
