//! The generators of message framing: huge heads, `Content-Length`s, chunked bodies and bodies that
//! break off or are hostile in content.

use idem_test_support::wire::{Raw, escape};

use super::cases::{Expect, KeyClass, Spec, Then, dubious, either, refused, runs};
use super::generator::{Gen, Keyed, chunked, small_body, target, token};
use crate::MAX_BODY;

/// Large heads: long values, many headers, long targets.
pub(crate) fn huge_heads(g: &mut Gen) {
    for _ in 0..2 {
        let rows = [
            Keyed::new("valid key, a 50 KB header", "T")
                .h("X-Junk", "j".repeat(50_000))
                .then(Then::Replay),
            Keyed::new("valid key, a 60 KB credential", "T")
                .h("Authorization", format!("Bearer {}", "c".repeat(60_000)))
                .then(Then::Replay),
            Keyed::new("valid key, a 10 KB header name", "T").h(format!("X-{}", "n".repeat(10_000)), "1"),
            Keyed::new("valid key, 90 headers", "T").many(90),
            // Beyond hyper's limits (100 headers, a ~400 KB head, a 64 KB target): hyper's 431/414.
            Keyed::new("valid key, 120 headers", "T")
                .many(120)
                .spec(dubious(KeyClass::Valid)),
            Keyed::new("Valid key, a 500 KB header", "T")
                .h("X-Junk", "j".repeat(500_000))
                .spec(dubious(KeyClass::Valid)),
            Keyed::new("Invalid key, a 500 KB header", "a b")
                .h("X-Junk", "j".repeat(500_000))
                .spec(dubious(KeyClass::Invalid)),
            Keyed::new("invalid key, a 70 KB target", "a b")
                .path(format!("?{}", "q".repeat(70_000)))
                .spec(dubious(KeyClass::Invalid)),
            Keyed::new("a 300 KB key", "x".repeat(300_000)).spec(dubious(KeyClass::Invalid)),
        ];
        for row in rows {
            g.keyed(row);
        }
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

/// A framing case, a row of a table: a request with a random key ([`framing_key`]), more header
/// lines, then `rest` exactly as given. Unless the row says otherwise: HTTP-dubious, the client
/// does not half-close, and nothing is sent after.
struct Framed {
    what: String,
    headers: Vec<(String, String)>,
    rest: Vec<u8>,
    half_close: bool,
    early_close: bool,
    /// The body breaks off: then the same key with a whole body must run ([`unclaimed`]).
    unclaimed: bool,
    /// A well-formed request: a valid key runs (and is replayed half of the time), an invalid one
    /// is refused.
    well_formed: bool,
}

impl Framed {
    fn new(what: impl Into<String>, rest: impl Into<Vec<u8>>) -> Self {
        Self {
            what: what.into(),
            headers: Vec::new(),
            rest: rest.into(),
            half_close: false,
            early_close: false,
            unclaimed: false,
            well_formed: false,
        }
    }

    /// With one more header line.
    fn h(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    /// The client half-closes after the bytes, so that a body shorter than announced breaks off.
    fn half_close(mut self) -> Self {
        self.half_close = true;
        self
    }

    /// The body breaks off (the client half-closes): nothing was claimed, so the same key with a
    /// whole body must run.
    fn breaks_off(mut self) -> Self {
        self.unclaimed = true;
        self.half_close()
    }

    /// The gateway may answer before reading the whole body, then close.
    fn early_close(mut self) -> Self {
        self.early_close = true;
        self
    }

    /// Well-formed: a valid key runs, an invalid one is refused.
    fn well_formed(mut self) -> Self {
        self.well_formed = true;
        self
    }

    /// Adds the case under the next case number.
    fn add(self, g: &mut Gen) {
        let id = g.id();
        let (class, mut raw) = framed_raw(g, id);
        for (name, value) in &self.headers {
            raw = raw.h(name, value);
        }
        let mut spec = match (self.well_formed, class) {
            (false, _) => dubious(class),
            (true, KeyClass::Invalid) => Spec::new(class, true, Expect::Refused(400)),
            (true, _) => Spec::new(class, true, Expect::Success),
        };
        spec.early_close_ok = self.early_close;
        let then = if self.unclaimed {
            unclaimed(class, id)
        } else if self.well_formed && class == KeyClass::Valid {
            g.maybe_replay(50)
        } else {
            Then::Nothing
        };
        g.push_raw(id, self.what, raw.then_raw(&self.rest), self.half_close, spec, then);
    }
}

/// Bogus `Content-Length` values and lengths that do not match the body. The client half-closes
/// after the bytes, so that a body shorter than announced breaks off instead of waiting.
pub(crate) fn content_lengths(g: &mut Gen) {
    for _ in 0..6 {
        let body = small_body(0);
        let bogus = [
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
        ];
        // Dubious: hyper refuses most of these; the few it takes (leading zeros, list of one
        // value) are complete requests, answered by idem.
        let mut rows: Vec<Framed> = bogus
            .iter()
            .map(|bogus| {
                Framed::new(format!("Content-Length: {bogus:?}"), &body[..5])
                    .h("Content-Length", *bogus)
                    .half_close()
            })
            .collect();
        rows.extend([
            Framed::new("two differing Content-Lengths", b"123456")
                .h("Content-Length", "5")
                .h("Content-Length", "6"),
            Framed::new("two equal Content-Lengths", b"12345")
                .h("Content-Length", "5")
                .h("Content-Length", "5"),
            // A body that breaks off: half of what was announced, then the client half-closes.
            Framed::new("Content-Length 100, 20 bytes, half-close", &body[..body.len().min(20)])
                .h("Content-Length", "100")
                .breaks_off(),
            // More body than announced: the rest is a broken second request.
            Framed::new("Content-Length 5, 16 bytes", b"12345GARBAGE\r\n\r\n").h("Content-Length", "5"),
            // Both framings at once (a smuggling classic).
            Framed::new("Content-Length and chunked", chunked(b"{}"))
                .h("Content-Length", "3")
                .h("Transfer-Encoding", "chunked"),
            // Declared over --max-body, little sent.
            Framed::new("Content-Length 2 MiB, 6 bytes, half-close", b"[1,2,3")
                .h("Content-Length", (MAX_BODY * 2).to_string())
                .half_close()
                .early_close(),
        ]);
        for row in rows {
            row.add(g);
        }
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
        let mut rows: Vec<Framed> = broken
            .into_iter()
            .map(|(what, rest, half_close)| {
                let row = Framed::new(format!("chunked: {what}"), rest).h("Transfer-Encoding", "chunked");
                if half_close { row.breaks_off() } else { row }
            })
            .collect();
        rows.extend(
            [
                "gzip, chunked",
                "chunked, gzip",
                "xchunked",
                "chunked, chunked",
                "identity",
            ]
            .map(|te| Framed::new(format!("Transfer-Encoding: {te}"), chunked(&body)).h("Transfer-Encoding", te)),
        );
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
            rows.push(
                Framed::new(format!("chunked: {what}"), rest)
                    .h("Transfer-Encoding", "chunked")
                    .well_formed(),
            );
        }
        for row in rows {
            row.add(g);
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
            if round == 3 {
                // An invalid key is refused whatever the body; the gateway need not read a large
                // one first, and may close before it was all sent.
                let mut spec = refused(KeyClass::Invalid, 400);
                spec.early_close_ok = body.len() > 32 * 1024;
                g.keyed(
                    Keyed::new(format!("body {what}, invalid key"), "\"T")
                        .any_method()
                        .body(body.as_slice())
                        .spec(spec),
                );
                continue;
            }
            let id = g.id();
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
            g.keyed(
                Keyed::new(format!("Content-Encoding: {coding} with a garbage body"), "T")
                    .any_method()
                    .h("Content-Encoding", coding)
                    .body(body)
                    .spec(either(KeyClass::Valid))
                    .maybe_replay(50),
            );
        }
    }
    for _ in 0..2 {
        let rows = [
            // Over --max-body, announced: 413, possibly before the body is read.
            Keyed::new("body of --max-body + 1", "T")
                .body(vec![b'1'; MAX_BODY + 1])
                .spec(refused(KeyClass::Valid, 413).early_close()),
            // A same-key retry with a different body after a mismatch is 422; checked here on a
            // body that is not JSON.
            Keyed::new("not I-JSON, then another body under the same key", "T")
                .body(b"{\"a\":1,\"a\":2}")
                .mismatch(b"{\"a\":1,\"a\":3}"),
        ];
        for row in rows {
            g.keyed(row);
        }
    }
}
