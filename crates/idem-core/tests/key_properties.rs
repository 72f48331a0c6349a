//! Properties of the `Idempotency-Key` parser, through the public API, checked against a reference
//! reading of the contract (docs/design.md, "What is protected"): the value is one RFC 8941 sf-string or a bare
//! key, surrounded by nothing but optional whitespace; the key (the decoded content of the string) is
//! 1 to 255 visible ASCII characters; a bare key has no `"`, `,` or `\`; a value that starts with `"`
//! is a whole sf-string (no parameters, no list, nothing after it); more than one key header is refused,
//! whatever the values. Parsing never panics, whatever the bytes.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use http::header::{HeaderMap, HeaderValue};
use idem_core::{IdempotencyKey, KeyError, MAX_KEY_LEN};
use proptest::prelude::*;

const KEY_HEADER: &str = "idempotency-key";

// ---------------------------------------------------------------------------------------------------
// The reference: what the contract says a header value means.
// ---------------------------------------------------------------------------------------------------

/// The key a header value carries according to the contract, or `None` when it must be refused.
///
/// Written from docs/design.md and RFC 8941 §3.3.3 / §4.2.5, not from the parser: the field value's
/// surrounding whitespace (OWS: SP and HTAB) is not part of it; a value starting with `"` is exactly
/// one sf-string (characters %x20-7E, `\` escaping only `"` and `\`) and nothing else; otherwise it is
/// a bare key with no `"`, `,` or `\`. Either way the key is 1 to [`MAX_KEY_LEN`] visible ASCII
/// characters, counted after decoding.
fn expected_key(value: &[u8]) -> Option<String> {
    let is_ows = |b: &u8| matches!(b, b' ' | b'\t');
    let start = value.iter().position(|b| !is_ows(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !is_ows(b)).map_or(start, |last| last + 1);
    let value = &value[start..end];
    let key = if value.first() == Some(&b'"') {
        let mut key = Vec::new();
        let mut index = 1;
        loop {
            match *value.get(index)? {
                b'"' => {
                    index += 1;
                    break;
                }
                b'\\' => match *value.get(index + 1)? {
                    escaped @ (b'"' | b'\\') => {
                        key.push(escaped);
                        index += 2;
                    }
                    _ => return None,
                },
                plain @ 0x20..=0x7e => {
                    key.push(plain);
                    index += 1;
                }
                _ => return None,
            }
        }
        if index != value.len() {
            // Parameters, a list, or anything else after the string.
            return None;
        }
        key
    } else {
        if value.iter().any(|b| matches!(b, b'"' | b',' | b'\\')) {
            return None;
        }
        value.to_vec()
    };
    let valid = (1..=MAX_KEY_LEN).contains(&key.len()) && key.iter().all(u8::is_ascii_graphic);
    valid.then(|| String::from_utf8(key).expect("visible ASCII is UTF-8"))
}

/// A key serialised as an RFC 8941 sf-string: quoted, with `"` and `\` escaped.
fn sf_string(key: &str) -> String {
    let mut quoted = String::with_capacity(key.len() + 2);
    quoted.push('"');
    for c in key.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    quoted
}

/// Parses a list of header values the way a server receives them: all values of one header name.
fn parse_values(values: &[HeaderValue]) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut headers = HeaderMap::new();
    // Another header around the key header: it must not be read.
    headers.append("x-other", HeaderValue::from_static("\"decoy\""));
    for value in values {
        headers.append(KEY_HEADER, value.clone());
    }
    IdempotencyKey::from_headers(headers.get_all(KEY_HEADER))
}

/// Parses one header value, given as bytes that `HeaderValue` accepts.
fn parse(value: &[u8]) -> Result<IdempotencyKey, KeyError> {
    let value = HeaderValue::from_bytes(value).expect("the test passes only valid header values");
    let through_headers = parse_values(std::slice::from_ref(&value))
        .map(|key| key.expect("one header value is present, so a key or an error comes back"));
    assert_eq!(through_headers, IdempotencyKey::from_header_value(&value));
    through_headers
}

fn hash_of(key: &IdempotencyKey) -> u64 {
    let mut hasher = DefaultHasher::new();
    key.hash(&mut hasher);
    hasher.finish()
}

/// Checks the parser against the reference on one value of any bytes, and what an accepted key must
/// satisfy. Never panics itself except through a failed assertion.
fn check_value(value: &[u8]) -> Result<(), TestCaseError> {
    let Ok(header) = HeaderValue::from_bytes(value) else {
        // `http` refuses it (a control character or DEL): it never reaches the parser as a header.
        // The constructor must still not panic on the same text.
        let text = String::from_utf8_lossy(value);
        let _ = IdempotencyKey::new(&text);
        return Ok(());
    };
    let parsed = parse(header.as_bytes());
    let expected = expected_key(value);
    match (&parsed, &expected) {
        (Ok(key), Some(expected)) => {
            prop_assert_eq!(
                key.as_str(),
                expected.as_str(),
                "value {:?}",
                String::from_utf8_lossy(value)
            );
            check_accepted(key)?;
        }
        (Err(error), None) => {
            let starts_quoted = value.iter().find(|b| !matches!(b, b' ' | b'\t')) == Some(&b'"');
            if starts_quoted {
                prop_assert_ne!(
                    error,
                    &KeyError::BareKeyCharacters,
                    "value {:?}",
                    String::from_utf8_lossy(value)
                );
            } else {
                prop_assert_ne!(
                    error,
                    &KeyError::MalformedString,
                    "value {:?}",
                    String::from_utf8_lossy(value)
                );
            }
            prop_assert_ne!(error, &KeyError::Repeated);
        }
        _ => prop_assert!(
            false,
            "value {:?} (bytes {:?}): parsed {:?}, the contract says {:?}",
            String::from_utf8_lossy(value),
            value,
            parsed,
            expected
        ),
    }
    Ok(())
}

/// What every accepted key satisfies: 1 to 255 visible ASCII characters; its sf-string form (ours and
/// the crate's) parses back to it; so does its bare form when it has no `"`, `,` or `\`.
fn check_accepted(key: &IdempotencyKey) -> Result<(), TestCaseError> {
    let text = key.as_str();
    prop_assert!((1..=MAX_KEY_LEN).contains(&text.len()), "{:?}", key);
    prop_assert!(text.bytes().all(|b| b.is_ascii_graphic()), "{:?}", key);
    prop_assert_eq!(IdempotencyKey::new(text), Ok(key.clone()));
    let quoted = sf_string(text);
    prop_assert_eq!(parse(quoted.as_bytes()), Ok(key.clone()), "{}", quoted);
    let header = key.to_header_value();
    prop_assert_eq!(header.as_bytes(), quoted.as_bytes());
    if !text.contains(['"', ',', '\\']) {
        prop_assert_eq!(parse(text.as_bytes()), Ok(key.clone()), "{}", text);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------
// Strategies.
// ---------------------------------------------------------------------------------------------------

/// A visible ASCII character, with the ones that need care (`"`, `\`, `,`, `;`) more often.
fn key_char() -> impl Strategy<Value = char> {
    prop_oneof![
        12 => (0x21u8..=0x7e).prop_map(char::from),
        1 => Just('"'),
        1 => Just('\\'),
        1 => Just(','),
        1 => Just(';'),
    ]
}

/// A visible ASCII character that a bare key may hold.
fn token_char() -> impl Strategy<Value = char> {
    (0x21u8..=0x7e)
        .prop_map(char::from)
        .prop_filter("not \" , or \\", |c| !matches!(c, '"' | ',' | '\\'))
}

/// A valid key: 1 to 255 characters, long ones as often as short ones.
fn valid_key() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::collection::vec(key_char(), 1..=16),
        prop::collection::vec(key_char(), 1..=MAX_KEY_LEN),
        prop::collection::vec(key_char(), (MAX_KEY_LEN - 4)..=MAX_KEY_LEN),
    ]
    .prop_map(String::from_iter)
}

fn token_key() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::collection::vec(token_char(), 1..=16),
        prop::collection::vec(token_char(), 1..=MAX_KEY_LEN),
    ]
    .prop_map(String::from_iter)
}

/// Optional whitespace around a field value.
fn ows() -> impl Strategy<Value = String> {
    prop::collection::vec(prop_oneof![Just(' '), Just('\t')], 0..3).prop_map(String::from_iter)
}

/// A byte of a hostile value: anything, often one that means something to the parser.
fn tricky_byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        3 => any::<u8>(),
        6 => 0x21u8..=0x7e,
        6 => prop::sample::select(vec![
            b'"', b'\\', b',', b';', b'=', b'(', b')', b'%', b'@', b'*', b':', b' ', b'\t', 0x00, 0x0a, 0x0d,
            0x1f, 0x7f, 0x80, 0xc3, 0xa9, 0xff,
        ]),
    ]
}

/// A valid key, written bare or quoted, with whitespace around and then a few bytes inserted, replaced
/// or removed: mostly near-misses of valid values.
fn mutated_value() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![valid_key(), token_key()],
        any::<bool>(),
        any::<u8>(),
        ows(),
        ows(),
        prop::option::weighted(0.2, suffix()),
        prop::collection::vec((any::<prop::sample::Index>(), tricky_byte(), 0u8..3), 0..3),
    )
        .prop_map(|(key, quoted, bare_anyway, before, after, suffix, edits)| {
            let body = if quoted || (key.contains(['"', ',', '\\']) && bare_anyway % 4 != 0) {
                sf_string(&key)
            } else {
                key
            };
            let mut value = format!("{before}{body}").into_bytes();
            if let Some(suffix) = suffix {
                value.extend(suffix);
            }
            value.extend(after.into_bytes());
            for (at, byte, kind) in edits {
                match kind {
                    0 => value.insert(at.index(value.len() + 1), byte),
                    1 if !value.is_empty() => {
                        let at = at.index(value.len());
                        value[at] = byte;
                    }
                    _ if !value.is_empty() => {
                        value.remove(at.index(value.len()));
                    }
                    _ => {}
                }
            }
            value
        })
}

/// A byte a `HeaderValue` can hold, often one that means something to the parser.
fn header_byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        8 => (0x21u8..=0x7e).prop_filter("not \" or \\", |b| !matches!(b, b'"' | b'\\')),
        1 => prop::sample::select(vec![b',', b';', b'=', b'(', b')', b' ', b'\t', 0x80, 0xc3, 0xa9, 0xff]),
    ]
}

/// One piece of the content of an sf-string: mostly a plain character or a valid escape, sometimes
/// an invalid escape, a stray `"`, or any byte.
fn string_piece() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        40 => header_byte().prop_map(|b| vec![b]),
        3 => Just(b"\\\"".to_vec()),
        3 => Just(b"\\\\".to_vec()),
        1 => tricky_byte().prop_map(|b| vec![b'\\', b]),
        1 => tricky_byte().prop_map(|b| vec![b]),
    ]
}

/// What may follow a closing `"`: parameters, list members, or any bytes.
fn suffix() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(tricky_byte(), 1..6),
        prop::sample::select(vec![
            &b";a=1"[..],
            b";a",
            b";*b=?0",
            b"; a=1",
            b" ;a=1",
            b";a=\"x\"",
            b";a=1;b=2",
            b";",
            b",",
            b", \"b\"",
            b",\"a\"",
            b" x",
            b"\"",
            b"\"\"",
        ])
        .prop_map(<[u8]>::to_vec),
    ]
}

/// An sf-string-like value: whitespace, `"`, content, maybe a closing `"`, maybe a suffix.
fn quoted_like_value() -> impl Strategy<Value = Vec<u8>> {
    (
        ows(),
        prop_oneof![
            prop::collection::vec(string_piece(), 0..20),
            prop::collection::vec(string_piece(), 0..300),
        ],
        prop::sample::select(vec![0u8, 1, 1, 1, 2]),
        suffix(),
        ows(),
    )
        .prop_map(|(before, content, end, suffix, after)| {
            let mut value = before.into_bytes();
            value.push(b'"');
            value.extend(content.concat());
            // 0: unterminated; 1: closed; 2: closed and followed by something.
            if end >= 1 {
                value.push(b'"');
            }
            if end == 2 {
                value.extend(suffix);
            }
            value.extend(after.into_bytes());
            value
        })
}

/// Any bytes a header value may be made of, of any length up to a few KB.
fn any_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // Every byte value, uniformly: most of these are refused by `http` already.
        2 => prop::collection::vec(any::<u8>(), 0..4096),
        // Every byte a `HeaderValue` can hold (HTAB, SP..~, obs-text), uniformly.
        2 => prop::collection::vec(prop_oneof![Just(b'\t'), 0x20u8..=0x7e, 0x80u8..=0xff], 0..4096),
        // Long values of mostly visible ASCII: far past the limit, bare or quoted.
        1 => prop::collection::vec(tricky_byte(), 200..4096),
        2 => prop::collection::vec(tricky_byte(), 0..64),
        3 => quoted_like_value(),
        6 => mutated_value(),
    ]
}

// ---------------------------------------------------------------------------------------------------
// Properties.
// ---------------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Never panics, whatever the bytes; accepts exactly what the contract accepts, with its key.
    #[test]
    fn any_value_is_parsed_as_the_contract_says_without_panicking(value in any_value()) {
        check_value(&value)?;
    }


    /// `IdempotencyKey::new` takes the key itself (no quoting): it never panics on any text, and accepts
    /// exactly 1 to 255 visible ASCII characters.
    #[test]
    fn new_accepts_exactly_visible_ascii_keys(
        key in prop_oneof![
            any::<String>(),
            prop::collection::vec(any::<char>(), 0..400).prop_map(String::from_iter),
            prop::collection::vec(key_char(), 0..400).prop_map(String::from_iter),
        ],
    ) {
        let valid = (1..=MAX_KEY_LEN).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic());
        match IdempotencyKey::new(&key) {
            Ok(parsed) => {
                prop_assert!(valid, "{:?}", key);
                prop_assert_eq!(parsed.as_str(), key.as_str());
            }
            Err(_) => prop_assert!(!valid, "{:?}", key),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Two accepted values give equal keys exactly when they carry the same decoded key: never two
    /// different keys that compare (or hash) equal, never one key that compares different from itself.
    #[test]
    fn keys_are_equal_exactly_when_their_decoded_values_are(
        first in any_value(),
        second in any_value(),
        same_key in valid_key(),
        first_quoted: bool,
        second_quoted: bool,
        first_ows in (ows(), ows()),
        second_ows in (ows(), ows()),
    ) {
        let write = |key: &str, quoted: bool, (before, after): &(String, String)| {
            let body = if quoted || key.contains(['"', ',', '\\']) { sf_string(key) } else { key.to_owned() };
            format!("{before}{body}{after}").into_bytes()
        };
        let pairs = [
            (first.clone(), second.clone()),
            (write(&same_key, first_quoted, &first_ows), write(&same_key, second_quoted, &second_ows)),
            (first, write(&same_key, second_quoted, &second_ows)),
        ];
        for (first, second) in pairs {
            let (Ok(_), Ok(_)) = (HeaderValue::from_bytes(&first), HeaderValue::from_bytes(&second)) else {
                continue;
            };
            let (Ok(a), Ok(b)) = (parse(&first), parse(&second)) else {
                continue;
            };
            let (decoded_a, decoded_b) = (expected_key(&first), expected_key(&second));
            prop_assert!(decoded_a.is_some() && decoded_b.is_some(), "{:?} {:?}", first, second);
            let same = decoded_a == decoded_b;
            prop_assert_eq!(a == b, same, "{:?} vs {:?}", a, b);
            prop_assert_eq!(a.as_str() == b.as_str(), same, "{:?} vs {:?}", a, b);
            prop_assert_eq!(a.cmp(&b).is_eq(), same, "{:?} vs {:?}", a, b);
            if same {
                prop_assert_eq!(hash_of(&a), hash_of(&b));
            }
        }
    }

    /// Two distinct valid keys never give equal parsed keys, however each is written.
    #[test]
    fn distinct_keys_never_compare_equal(
        first in valid_key(),
        second in valid_key(),
        edit in (any::<prop::sample::Index>(), key_char()),
        quoted in any::<[bool; 2]>(),
    ) {
        // Besides two random keys, a key and a one-character change of it (often `"` for `\`).
        let (at, c) = edit;
        let mut near: Vec<char> = first.chars().collect();
        let at = at.index(near.len());
        near[at] = c;
        let near = String::from_iter(near);
        for (a, b) in [(&first, &second), (&first, &near)] {
            let write = |key: &str, quoted: bool| {
                if quoted || key.contains(['"', ',', '\\']) { sf_string(key) } else { key.to_owned() }
            };
            let pa = parse(write(a, quoted[0]).as_bytes()).expect("a valid key is accepted");
            let pb = parse(write(b, quoted[1]).as_bytes()).expect("a valid key is accepted");
            prop_assert_eq!(pa.as_str(), a.as_str());
            prop_assert_eq!(pb.as_str(), b.as_str());
            prop_assert_eq!(pa == pb, a == b, "{:?} vs {:?}", pa, pb);
        }
    }

    /// Any key the parser accepts, serialised as an sf-string, parses back to the same key; and any valid
    /// key, so written, with any surrounding whitespace, is accepted as itself.
    #[test]
    fn sf_strings_round_trip(key in valid_key(), (before, after) in (ows(), ows())) {
        let value = format!("{before}{}{after}", sf_string(&key));
        let parsed = parse(value.as_bytes());
        prop_assert_eq!(parsed.as_ref().map(IdempotencyKey::as_str), Ok(key.as_str()), "{}", value);
        let parsed = parsed.unwrap();
        check_accepted(&parsed)?;
        let again = parse(parsed.to_header_value().as_bytes()).unwrap();
        prop_assert_eq!(again, parsed);
    }

    /// A key with no `"`, `,` or `\` means the same bare or quoted.
    #[test]
    fn bare_and_quoted_forms_give_the_same_key(key in token_key(), (before, after) in (ows(), ows())) {
        let bare = parse(format!("{before}{key}{after}").as_bytes());
        let quoted = parse(format!("{after}{}{before}", sf_string(&key)).as_bytes());
        prop_assert_eq!(bare.as_ref().map(IdempotencyKey::as_str), Ok(key.as_str()));
        prop_assert_eq!(bare, quoted);
    }

    /// The limit is on the key, in characters after decoding: escapes in the sf-string do not count
    /// twice, and whitespace around the value does not count at all.
    #[test]
    fn the_length_limit_applies_to_the_decoded_key(
        chars in prop::collection::vec(key_char(), (MAX_KEY_LEN - 3)..=(MAX_KEY_LEN + 3)),
        (before, after) in (ows(), ows()),
    ) {
        let key = String::from_iter(chars);
        let quoted = parse(format!("{before}{}{after}", sf_string(&key)).as_bytes());
        if key.len() <= MAX_KEY_LEN {
            prop_assert_eq!(quoted.as_ref().map(IdempotencyKey::as_str), Ok(key.as_str()));
        } else {
            prop_assert_eq!(quoted, Err(KeyError::TooLong(key.len())));
        }
        let bare_key: String = key.chars().map(|c| if matches!(c, '"' | ',' | '\\') { '_' } else { c }).collect();
        let bare = parse(format!("{before}{bare_key}{after}").as_bytes());
        if bare_key.len() <= MAX_KEY_LEN {
            prop_assert_eq!(bare.as_ref().map(IdempotencyKey::as_str), Ok(bare_key.as_str()));
        } else {
            prop_assert_eq!(bare, Err(KeyError::TooLong(bare_key.len())));
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// More than one key header is refused, whatever the values: equal, different, valid or not.
    #[test]
    fn more_than_one_key_header_is_refused(
        values in prop::collection::vec(any_value(), 2..5),
        key in valid_key(),
        copies in 2usize..4,
    ) {
        let values: Vec<HeaderValue> =
            values.iter().filter_map(|value| HeaderValue::from_bytes(value).ok()).collect();
        if values.len() >= 2 {
            prop_assert_eq!(parse_values(&values), Err(KeyError::Repeated));
        }
        let same = vec![HeaderValue::from_str(&sf_string(&key)).unwrap(); copies];
        prop_assert_eq!(parse_values(&same), Err(KeyError::Repeated));
    }
}

// ---------------------------------------------------------------------------------------------------
// Every byte value, in every place that means something; and the edge cases by name.
// ---------------------------------------------------------------------------------------------------

#[test]
fn every_byte_value_in_every_position_is_parsed_as_the_contract_says() {
    for byte in 0..=u8::MAX {
        let b = [byte];
        let templates: [&[&[u8]]; 14] = [
            &[&b],
            &[b"a", &b, b"c"],
            &[&b, b"abc"],
            &[b"abc", &b],
            &[b"\"", &b, b"\""],
            &[b"\"a", &b, b"c\""],
            &[b"\"a\\", &b, b"c\""],
            &[b"\"abc\"", &b],
            &[b"\"abc\"", &b, b"a=1"],
            &[&b, b"\"abc\""],
            &[b"\"abc", &b],
            &[b" \"abc\"", &b, b" "],
            &[b"\t", &b, b"\t"],
            &[b"\"", &b],
        ];
        for parts in templates {
            let value = parts.concat();
            check_value(&value).unwrap_or_else(|error| panic!("byte {byte:#04x}: {error}"));
        }
    }
}

#[test]
fn the_limit_is_exactly_255_characters_bare_and_quoted() {
    let ok = |value: &str| parse(value.as_bytes()).map(|key| key.as_str().len());
    assert_eq!(ok(&"k".repeat(255)), Ok(255));
    assert_eq!(ok(&"k".repeat(256)), Err(KeyError::TooLong(256)));
    assert_eq!(ok(&format!(" \t{}\t ", "k".repeat(255))), Ok(255));
    assert_eq!(ok(&format!("\"{}\"", "k".repeat(255))), Ok(255));
    assert_eq!(ok(&format!("\"{}\"", "k".repeat(256))), Err(KeyError::TooLong(256)));
    assert_eq!(ok(&format!("  \"{}\"\t", "k".repeat(255))), Ok(255));
    // Escaped characters count once: 255 of them are a 512-byte header value and a valid key.
    assert_eq!(ok(&format!("\"{}\"", "\\\"".repeat(255))), Ok(255));
    assert_eq!(ok(&format!("\"{}\"", "\\\\".repeat(255))), Ok(255));
    assert_eq!(ok(&format!("\"{}\"", "\\\"".repeat(256))), Err(KeyError::TooLong(256)));
    assert_eq!(ok(&format!("\"a{}\"", "\\\\".repeat(255))), Err(KeyError::TooLong(256)));
    assert_eq!(
        IdempotencyKey::new(&"k".repeat(255)).map(|key| key.as_str().len()),
        Ok(255)
    );
    assert_eq!(IdempotencyKey::new(&"k".repeat(256)), Err(KeyError::TooLong(256)));
    assert_eq!(MAX_KEY_LEN, 255);
}

#[test]
fn malformed_sf_strings_are_refused() {
    let refused = [
        // Unterminated.
        &b"\""[..],
        b"\"abc",
        b"\"abc\\\"",
        b"\"abc\\",
        b"\"abc\\\\\\\"",
        // Escapes other than \" and \\.
        b"\"a\\xb\"",
        b"\"a\\nb\"",
        b"\"a\\tb\"",
        b"\"a\\ b\"",
        b"\"\\u0041\"",
        // HTAB and obs-text inside the quotes (other controls cannot be in a `HeaderValue` at all).
        b"\"a\tb\"",
        "\"cl\u{e9}\"".as_bytes(),
        b"\"a\x80b\"",
        b"\"a\xffb\"",
        // Parameters, in any form.
        b"\"abc\";a=1",
        b"\"abc\";a",
        b"\"abc\";",
        b"\"abc\"; a=1",
        b"\"abc\" ;a=1",
        b"\"abc\";a=\"x\"",
        // A list, or anything else after the string.
        b"\"a\", \"b\"",
        b"\"a\",\"a\"",
        b"\"abc\",",
        b"\"abc\"x",
        b"\"abc\"\"def\"",
        b"\"abc\" \"def\"",
        b"\"abc\" x",
        b"\"abc\"\"",
    ];
    for value in refused {
        let parsed = parse(value);
        assert!(
            matches!(parsed, Err(KeyError::MalformedString | KeyError::NotVisibleAscii)),
            "{:?} gave {parsed:?}",
            String::from_utf8_lossy(value)
        );
        assert_eq!(
            expected_key(value),
            None,
            "the reference disagrees on {:?}",
            String::from_utf8_lossy(value)
        );
    }
    // Well-formed strings whose content is not a key.
    assert_eq!(parse(b"\"\""), Err(KeyError::Empty));
    assert_eq!(parse(b" \"\" "), Err(KeyError::Empty));
    assert_eq!(parse(b"\"a b\""), Err(KeyError::NotVisibleAscii));
    assert_eq!(parse(b"\" abc\""), Err(KeyError::NotVisibleAscii));
    assert_eq!(parse(b"\"abc \""), Err(KeyError::NotVisibleAscii));
    assert_eq!(parse(b"\" \""), Err(KeyError::NotVisibleAscii));
    // Control characters and non-ASCII are refused by the key itself too.
    for c in (0u8..0x20)
        .chain([0x7f])
        .map(char::from)
        .chain(['\u{e9}', '\u{80}', '\u{ff}', '\u{1F600}'])
    {
        assert!(IdempotencyKey::new(&format!("a{c}b")).is_err(), "{c:?}");
    }
}

#[test]
fn bare_keys_follow_the_contract() {
    assert_eq!(parse(b"abc-123").unwrap().as_str(), "abc-123");
    assert_eq!(parse(b" \tabc-123\t ").unwrap().as_str(), "abc-123");
    // `;`, `=`, `(`, `%`, `@` mean nothing to a bare key: they are part of it.
    assert_eq!(parse(b"abc;a=1").unwrap().as_str(), "abc;a=1");
    assert_eq!(parse(b"(abc)").unwrap().as_str(), "(abc)");
    assert_eq!(parse(b"@123").unwrap().as_str(), "@123");
    assert_eq!(parse(b"a\"").unwrap_err(), KeyError::BareKeyCharacters);
    assert_eq!(parse(b"%\"abc\"").unwrap_err(), KeyError::BareKeyCharacters);
    assert_eq!(parse(b"a,b").unwrap_err(), KeyError::BareKeyCharacters);
    assert_eq!(parse(b"a, b").unwrap_err(), KeyError::BareKeyCharacters);
    assert_eq!(parse(b"a\\b").unwrap_err(), KeyError::BareKeyCharacters);
    assert_eq!(parse(b"a b").unwrap_err(), KeyError::NotVisibleAscii);
    assert_eq!(parse(b"a\tb").unwrap_err(), KeyError::NotVisibleAscii);
    assert_eq!(parse("cl\u{e9}".as_bytes()).unwrap_err(), KeyError::NotVisibleAscii);
    assert_eq!(parse(b"").unwrap_err(), KeyError::Empty);
    assert_eq!(parse(b" \t ").unwrap_err(), KeyError::Empty);
    // Equal keys, however written.
    let key = parse(b"8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap();
    assert_eq!(parse(b"\"8e03978e-40d5-43e8-bc93-6894a57f9324\"").unwrap(), key);
    assert_eq!(parse(b"\t\"8e03978e-40d5-43e8-bc93-6894a57f9324\" ").unwrap(), key);
    // Keys that differ only in what was escaped are different keys.
    let quote = parse(br#""\"""#).unwrap();
    let backslash = parse(br#""\\""#).unwrap();
    assert_eq!((quote.as_str(), backslash.as_str()), ("\"", "\\"));
    assert_ne!(quote, backslash);
    assert_ne!(parse(br#""a\"b""#).unwrap(), parse(br#""a\\b""#).unwrap());
}

#[test]
fn repeated_key_headers_are_refused_even_when_equal() {
    let value = |s: &'static str| HeaderValue::from_static(s);
    assert_eq!(parse_values(&[]), Ok(None));
    assert_eq!(parse_values(&[value("\"a\"")]).unwrap().unwrap().as_str(), "a");
    // The same value twice: refused too, since two headers are "never processed" (docs/design.md).
    assert_eq!(parse_values(&[value("\"a\""), value("\"a\"")]), Err(KeyError::Repeated));
    assert_eq!(parse_values(&[value("a"), value("a")]), Err(KeyError::Repeated));
    // The same key, written two ways.
    assert_eq!(parse_values(&[value("a"), value("\"a\"")]), Err(KeyError::Repeated));
    assert_eq!(parse_values(&[value("\"a\""), value("\"b\"")]), Err(KeyError::Repeated));
    // Whatever the values: even when one or both would be refused alone.
    assert_eq!(parse_values(&[value("\"a\""), value("")]), Err(KeyError::Repeated));
    assert_eq!(parse_values(&[value("\"a"), value("b,c")]), Err(KeyError::Repeated));
    assert_eq!(
        parse_values(&[value("a"), value("b"), value("c")]),
        Err(KeyError::Repeated)
    );
    // Two keys folded into one line by an intermediary are a list, refused as well.
    assert_eq!(parse_values(&[value("\"a\", \"a\"")]), Err(KeyError::MalformedString));
    assert_eq!(parse_values(&[value("a, a")]), Err(KeyError::BareKeyCharacters));
}
