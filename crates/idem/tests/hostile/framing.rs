//! The generators of message framing: huge heads, `Content-Length`s, chunked bodies and bodies that
//! break off or are hostile in content.

use idem_test_support::wire::{Raw, escape};

use super::cases::{Expect, KeyClass, Spec, Then, dubious, either, refused, runs};
use super::generator::{Gen, chunked, small_body, target, token};
use crate::MAX_BODY;

/// Large heads: long values, many headers, long targets.
pub(crate) fn huge_heads(g: &mut Gen) {
    for _ in 0..2 {
        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let junk = "j".repeat(50_000);
        g.raw(
            id,
            "valid key, a 50 KB header",
            raw.clone().h("X-Junk", &junk).sized(&small_body(id)),
            runs(KeyClass::Valid),
            Then::Replay,
        );

        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let bytes = raw
            .h("Authorization", format!("Bearer {}", "c".repeat(60_000)))
            .sized(&small_body(id));
        g.raw(
            id,
            "valid key, a 60 KB credential",
            bytes,
            runs(KeyClass::Valid),
            Then::Replay,
        );

        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let bytes = raw.h(format!("X-{}", "n".repeat(10_000)), "1").sized(&small_body(id));
        g.raw(
            id,
            "valid key, a 10 KB header name",
            bytes,
            runs(KeyClass::Valid),
            Then::Nothing,
        );

        let id = g.id();
        let mut raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        for i in 0..90 {
            raw = raw.h(format!("X-Many-{i}"), "1");
        }
        g.raw(
            id,
            "valid key, 90 headers",
            raw.sized(&small_body(id)),
            runs(KeyClass::Valid),
            Then::Nothing,
        );

        // Beyond hyper's limits (100 headers, a ~400 KB head, a 64 KB target): hyper's 431/414.
        let id = g.id();
        let mut raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        for i in 0..120 {
            raw = raw.h(format!("X-Many-{i}"), "1");
        }
        g.raw(
            id,
            "valid key, 120 headers",
            raw.sized(&small_body(id)),
            dubious(KeyClass::Valid),
            Then::Nothing,
        );

        for (class, key) in [
            (KeyClass::Valid, token(g.next + 1)),
            (KeyClass::Invalid, "a b".to_owned()),
        ] {
            let id = g.id();
            let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", &key);
            let bytes = raw.h("X-Junk", "j".repeat(500_000)).sized(&small_body(id));
            g.raw(
                id,
                format!("{class:?} key, a 500 KB header"),
                bytes,
                dubious(class),
                Then::Nothing,
            );
        }

        let id = g.id();
        let long_target = format!("{}?{}", target(id), "q".repeat(70_000));
        let raw = Raw::new("POST", &long_target).json().h("Idempotency-Key", "a b");
        g.raw(
            id,
            "invalid key, a 70 KB target",
            raw.sized(&small_body(id)),
            dubious(KeyClass::Invalid),
            Then::Nothing,
        );

        let id = g.id();
        let raw = Raw::new("POST", &target(id))
            .json()
            .h("Idempotency-Key", "x".repeat(300_000));
        g.raw(
            id,
            "a 300 KB key",
            raw.sized(&small_body(id)),
            dubious(KeyClass::Invalid),
            Then::Nothing,
        );
    }
}

/// A key for a framing case: valid, invalid or none.
pub(crate) fn framing_key(g: &mut Gen, id: u64) -> (KeyClass, Option<Vec<u8>>) {
    match g.rng.below(3) {
        0 => (KeyClass::Valid, Some(token(id).into_bytes())),
        1 => (KeyClass::Invalid, Some(format!("\"{}", token(id)).into_bytes())),
        _ => (KeyClass::Absent, None),
    }
}

pub(crate) fn framed_raw(g: &mut Gen, id: u64) -> (KeyClass, Raw) {
    let (class, key) = framing_key(g, id);
    let mut raw = Raw::new(g.method(), &target(id)).json();
    if let Some(key) = key {
        raw = raw.h("Idempotency-Key", key);
    }
    (class, raw)
}

/// After a body that broke off: the same key with a whole body must run.
pub(crate) fn unclaimed(class: KeyClass, id: u64) -> Then {
    if class == KeyClass::Valid {
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        Then::Unclaimed(raw.sized(br#"{"whole":true}"#))
    } else {
        Then::Nothing
    }
}

/// Bogus `Content-Length` values and lengths that do not match the body. The client half-closes
/// after the bytes, so that a body shorter than announced breaks off instead of waiting.
pub(crate) fn content_lengths(g: &mut Gen) {
    for _ in 0..6 {
        let body = small_body(0);
        for bogus in [
            "-1",
            "abc",
            "1e3",
            "0x10",
            "+5",
            "5 5",
            "99999999999999999999",
            "",
            "5,6",
            "007",
            " 5 ",
        ] {
            let id = g.id();
            let (class, raw) = framed_raw(g, id);
            let bytes = raw.h("Content-Length", bogus).then_raw(&body[..5]);
            // Dubious: hyper refuses most of these; the few it takes (leading zeros, list of one
            // value) are complete requests, answered by idem.
            g.push_raw(
                id,
                format!("Content-Length: {bogus:?}"),
                bytes,
                true,
                dubious(class),
                Then::Nothing,
            );
        }
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw
            .h("Content-Length", "5")
            .h("Content-Length", "6")
            .then_raw(b"123456");
        g.raw(
            id,
            "two differing Content-Lengths",
            bytes,
            dubious(class),
            Then::Nothing,
        );

        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw.h("Content-Length", "5").h("Content-Length", "5").then_raw(b"12345");
        g.raw(id, "two equal Content-Lengths", bytes, dubious(class), Then::Nothing);

        // A body that breaks off: half of what was announced, then the client half-closes.
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw.h("Content-Length", "100").then_raw(&body[..body.len().min(20)]);
        let then = unclaimed(class, id);
        g.push_raw(
            id,
            "Content-Length 100, 20 bytes, half-close",
            bytes,
            true,
            dubious(class),
            then,
        );

        // More body than announced: the rest is a broken second request.
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw.h("Content-Length", "5").then_raw(b"12345GARBAGE\r\n\r\n");
        g.raw(id, "Content-Length 5, 16 bytes", bytes, dubious(class), Then::Nothing);

        // Both framings at once (a smuggling classic).
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw
            .h("Content-Length", "3")
            .h("Transfer-Encoding", "chunked")
            .then_raw(&chunked(b"{}"));
        g.raw(id, "Content-Length and chunked", bytes, dubious(class), Then::Nothing);

        // Declared over --max-body, little sent.
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw.h("Content-Length", (MAX_BODY * 2).to_string()).then_raw(b"[1,2,3");
        let spec = dubious(class).early_close();
        g.push_raw(
            id,
            "Content-Length 2 MiB, 6 bytes, half-close",
            bytes,
            true,
            spec,
            Then::Nothing,
        );
    }
}

/// Malformed chunked bodies, trailers, odd `Transfer-Encoding`s.
pub(crate) fn chunked_bodies(g: &mut Gen) {
    let body = small_body(0);
    for _ in 0..5 {
        let broken: Vec<(&str, Vec<u8>, bool)> = vec![
            ("bad chunk size", b"zz\r\nhello\r\n0\r\n\r\n".to_vec(), false),
            ("negative chunk size", b"-5\r\nhello\r\n0\r\n\r\n".to_vec(), false),
            (
                "chunk size overflow",
                b"ffffffffffffffffffff\r\nhello\r\n0\r\n\r\n".to_vec(),
                false,
            ),
            ("no CRLF after the data", b"5\r\nhelloXX0\r\n\r\n".to_vec(), false),
            ("chunk longer than its size", b"2\r\nhello\r\n0\r\n\r\n".to_vec(), false),
            ("LF only", b"5\nhello\n0\n\n".to_vec(), false),
            ("truncated data, half-close", b"10\r\nhello".to_vec(), true),
            ("truncated size line, half-close", b"1".to_vec(), true),
            ("no last chunk, half-close", b"5\r\nhello\r\n".to_vec(), true),
            (
                "bad trailer, half-close",
                b"5\r\nhello\r\n0\r\nno colon here\r\n\r\n".to_vec(),
                true,
            ),
        ];
        for (what, rest, half_close) in broken {
            let id = g.id();
            let (class, raw) = framed_raw(g, id);
            let bytes = raw.h("Transfer-Encoding", "chunked").then_raw(&rest);
            let then = if half_close {
                unclaimed(class, id)
            } else {
                Then::Nothing
            };
            g.push_raw(id, format!("chunked: {what}"), bytes, half_close, dubious(class), then);
        }
        for te in [
            "gzip, chunked",
            "chunked, gzip",
            "xchunked",
            "chunked, chunked",
            "identity",
        ] {
            let id = g.id();
            let (class, raw) = framed_raw(g, id);
            let bytes = raw.h("Transfer-Encoding", te).then_raw(&chunked(&body));
            g.raw(
                id,
                format!("Transfer-Encoding: {te}"),
                bytes,
                dubious(class),
                Then::Nothing,
            );
        }
        // Well-formed chunked bodies: a valid key runs, an invalid one is refused.
        for (what, rest) in [
            ("one chunk", chunked(&body)),
            (
                "chunk extensions",
                [
                    b"5;ext=1;q=\"x\"\r\n".as_slice(),
                    &body[..5],
                    b"\r\n",
                    format!("{:x}\r\n", body.len() - 5).as_bytes(),
                    &body[5..],
                    b"\r\n0\r\n\r\n",
                ]
                .concat(),
            ),
            (
                "one-byte chunks",
                body.iter()
                    .flat_map(|&b| [b'1', b'\r', b'\n', b, b'\r', b'\n'])
                    .chain(*b"0\r\n\r\n")
                    .collect(),
            ),
        ] {
            let id = g.id();
            let (class, raw) = framed_raw(g, id);
            let bytes = raw.h("Transfer-Encoding", "chunked").then_raw(&rest);
            let expect = match class {
                KeyClass::Invalid => Expect::Refused(400),
                _ => Expect::Success,
            };
            let then = if class == KeyClass::Valid {
                g.maybe_replay(50)
            } else {
                Then::Nothing
            };
            g.raw(
                id,
                format!("chunked: {what}"),
                bytes,
                Spec::new(class, true, expect),
                then,
            );
        }
        // A key in the trailers: the head decides; the trailers must not smuggle a key upstream.
        for (head_key, trailer_key) in [(None, "a b"), (None, "\"x"), (Some(()), "a b"), (None, "~trailer~")] {
            let id = g.id();
            let mut raw = Raw::new("POST", &target(id))
                .json()
                .h("Transfer-Encoding", "chunked")
                .h("Trailer", "Idempotency-Key");
            let class = match head_key {
                Some(()) => {
                    raw = raw.h("Idempotency-Key", token(id));
                    KeyClass::Valid
                }
                None => KeyClass::Absent,
            };
            let mut rest = format!("{:x}\r\n", body.len()).into_bytes();
            rest.extend_from_slice(&body);
            rest.extend_from_slice(format!("\r\n0\r\nIdempotency-Key: {trailer_key}\r\n\r\n").as_bytes());
            g.raw(
                id,
                format!("chunked with Idempotency-Key: {trailer_key} in the trailers"),
                raw.then_raw(&rest),
                runs(class),
                Then::Nothing,
            );
        }
        // Over --max-body without a Content-Length: refused once the limit is passed.
        let id = g.id();
        let raw = Raw::new("POST", &target(id))
            .json()
            .h("Idempotency-Key", token(id))
            .h("Transfer-Encoding", "chunked");
        let mut rest = Vec::new();
        let piece = vec![b'7'; 64 * 1024];
        for _ in 0..(MAX_BODY / piece.len() + 2) {
            rest.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
            rest.extend_from_slice(&piece);
            rest.extend_from_slice(b"\r\n");
        }
        rest.extend_from_slice(b"0\r\n\r\n");
        let spec = refused(KeyClass::Valid, 413).early_close();
        g.raw(
            id,
            "chunked body over --max-body",
            raw.then_raw(&rest),
            spec,
            Then::Nothing,
        );
    }
}

/// Bodies that are not JSON, or are JSON at its edges, under a valid key (they must run, and a
/// byte-identical retry must replay), and a few keyless.
pub(crate) fn hostile_bodies(g: &mut Gen) {
    let nested_ok = format!("{}{}", "[".repeat(127), "]".repeat(127));
    let nested_over = format!("{}{}", "[".repeat(128), "]".repeat(128));
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("100k [", vec![b'['; 100_000]),
        ("50k {\"a\":", "{\"a\":".repeat(50_000).into_bytes()),
        (
            "100k balanced []",
            format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
        ),
        ("nesting 127", nested_ok.into_bytes()),
        ("nesting 128", nested_over.into_bytes()),
        (
            "an integer of 300k digits",
            format!("1{}", "0".repeat(300_000)).into_bytes(),
        ),
        (
            "a decimal of 200k digits",
            format!("[0.{}1]", "0".repeat(200_000)).into_bytes(),
        ),
        ("a huge exponent", b"1e999999999999999999999".to_vec()),
        (
            "the largest exponent",
            b"[1e1000000000000000,-1e-1000000000000000]".to_vec(),
        ),
        ("just past the largest exponent", b"[1e1000000000000001]".to_vec()),
        (
            "a 40-digit exponent",
            b"[1e0000000000000000000000000000000000000001]".to_vec(),
        ),
        ("f64 overflow", b"[1e400,-1e400,1e-400]".to_vec()),
        ("2^53+1", b"{\"n\":9007199254740993}".to_vec()),
        (
            "50k big numbers",
            format!("[{}0]", "1.5e300,".repeat(50_000)).into_bytes(),
        ),
        ("-0 and 0", b"[-0,0,-0.0,0e5,-0E-5]".to_vec()),
        ("lone high surrogate", b"\"\\ud800\"".to_vec()),
        ("lone low surrogate", b"{\"s\":\"\\udc00\"}".to_vec()),
        ("high surrogate then a letter", b"[\"\\ud800\\u0041\"]".to_vec()),
        ("reversed surrogates", b"\"\\udc00\\ud800\"".to_vec()),
        ("surrogate pair", b"\"\\ud83d\\ude00\"".to_vec()),
        ("surrogate in a name", b"{\"\\ud800\":1}".to_vec()),
        ("truncated \\u", b"\"\\u12\"".to_vec()),
        ("\\u at the end", b"\"\\u".to_vec()),
        ("bad escape", b"\"\\x41\"".to_vec()),
        ("invalid UTF-8", b"{\"a\":\"\xff\xfe\"}".to_vec()),
        ("overlong UTF-8", b"\"\xc0\xaf\"".to_vec()),
        ("UTF-8 surrogate", b"\"\xed\xa0\x80\"".to_vec()),
        ("truncated UTF-8", b"\"\xe2\x82\"".to_vec()),
        ("BOM", b"\xef\xbb\xbf{}".to_vec()),
        ("NUL in a string", b"{\"a\":\"\x00\"}".to_vec()),
        ("NUL after", b"{}\x00".to_vec()),
        ("duplicate names", b"{\"a\":1,\"a\":2}".to_vec()),
        ("trailing comma", b"[1,]".to_vec()),
        ("unterminated", b"{\"a\":".to_vec()),
        ("unterminated string", b"\"abc".to_vec()),
        ("garbage after", b"{} x".to_vec()),
        ("two documents", b"{}{}".to_vec()),
        ("empty", Vec::new()),
        ("whitespace", b"   \n\t\r ".to_vec()),
        ("vertical tab", b"\x0b{}".to_vec()),
        ("literals", b"[true,false,null,tru,nul]".to_vec()),
        ("bad numbers", b"[01,1.,.5,+1,1e,--1,0x10,NaN,Infinity]".to_vec()),
        ("a 500 KB string", format!("\"{}\"", "a".repeat(500_000)).into_bytes()),
        ("100k escapes", format!("\"{}\"", "\\n".repeat(100_000)).into_bytes()),
        (
            "30k members",
            format!(
                "{{{}\"z\":0}}",
                (0..30_000).map(|i| format!("\"k{i}\":{i},")).collect::<String>()
            )
            .into_bytes(),
        ),
        (
            "30k equal names",
            format!("{{{}\"z\":0}}", "\"k\":1,".repeat(30_000)).into_bytes(),
        ),
        ("just under --max-body", vec![b' '; MAX_BODY]),
    ];
    let content_types: &[&[u8]] = &[
        b"application/json",
        b"application/json; charset=utf-8",
        b"APPLICATION/JSON",
        b"application/problem+json",
        b"application/vnd.x+json",
        b"application/json; charset=\xff\xfe",
        b"application/json, text/html",
        b"text/plain",
        b"\xff/\xfe",
    ];
    for round in 0..4 {
        for (what, body) in &bodies {
            let id = g.id();
            if round == 3 {
                // An invalid key is refused whatever the body; the gateway need not read a large
                // one first, and may close before it was all sent.
                let raw = Raw::new(g.method(), &target(id))
                    .json()
                    .h("Idempotency-Key", format!("\"{}", token(id)));
                let mut spec = refused(KeyClass::Invalid, 400);
                spec.early_close_ok = body.len() > 32 * 1024;
                g.raw(
                    id,
                    format!("body {what}, invalid key"),
                    raw.sized(body),
                    spec,
                    Then::Nothing,
                );
                continue;
            }
            let keyless = round == 2;
            let content_type = *g.rng.pick(content_types);
            let mut raw =
                Raw::new(if keyless { "POST" } else { g.method() }, &target(id)).h("Content-Type", content_type);
            let class = if keyless {
                KeyClass::Absent
            } else {
                raw = raw.h("Idempotency-Key", token(id));
                KeyClass::Valid
            };
            let then = if keyless { Then::Nothing } else { g.maybe_replay(60) };
            let what = format!("body {what} ({}, {class:?} key)", escape(content_type, 60));
            g.raw(id, what, raw.sized(body), runs(class), then);
        }
    }
    // Compressed request bodies that are not: idem may hash them as they are, or refuse them.
    for _ in 0..4 {
        for (coding, body) in [
            ("gzip", b"\x1f\x8b\x08\x00garbage".to_vec()),
            ("gzip", b"not gzip at all".to_vec()),
            ("gzip, br", b"{}".to_vec()),
            ("zstd", vec![0x28, 0xb5, 0x2f, 0xfd, 0xff, 0xff]),
            ("x-\u{fffd}", b"{}".to_vec()),
        ] {
            let id = g.id();
            let raw = Raw::new(g.method(), &target(id))
                .json()
                .h("Idempotency-Key", token(id))
                .h("Content-Encoding", coding);
            let then = g.maybe_replay(50);
            g.raw(
                id,
                format!("Content-Encoding: {coding} with a garbage body"),
                raw.sized(&body),
                either(KeyClass::Valid),
                then,
            );
        }
    }
    // Over --max-body, announced: 413, possibly before the body is read.
    for _ in 0..2 {
        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let spec = refused(KeyClass::Valid, 413).early_close();
        g.raw(
            id,
            "body of --max-body + 1",
            raw.sized(&vec![b'1'; MAX_BODY + 1]),
            spec,
            Then::Nothing,
        );
        // A same-key retry with a different body after a mismatch is 422; checked here on a body
        // that is not JSON.
        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let other = raw.sized(b"{\"a\":1,\"a\":3}");
        g.raw(
            id,
            "not I-JSON, then another body under the same key",
            raw.sized(b"{\"a\":1,\"a\":2}"),
            runs(KeyClass::Valid),
            Then::Mismatch(other),
        );
    }
}
