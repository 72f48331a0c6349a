//! Properties of the fingerprints of JSON bodies, through the public API: every way of writing one
//! document gives one fingerprint, documents of different values never share one, and documents that
//! the old canonicaliser (`serde_json_canonicalizer`) rendered exactly keep the digests already stored.

use http::{HeaderMap, Method, Uri, header::CONTENT_TYPE};
use idem_core::Fingerprint;
use proptest::prelude::*;
use sha2::{Digest, Sha256};

/// A JSON document as a value: what a fingerprint must respect, whatever the text.
#[derive(Debug, Clone)]
enum Json {
    Null,
    Bool(bool),
    Number(Decimal),
    String(String),
    Array(Vec<Json>),
    /// The names are unique.
    Object(Vec<(String, Json)>),
}

/// An exact decimal `±digits × 10^exponent`, normalised so that equal values are equal structs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Decimal {
    /// Never set for zero.
    negative: bool,
    /// Without leading or trailing zeros; empty for zero.
    digits: String,
    exponent: i64,
}

impl Decimal {
    fn new(negative: bool, digits: &str, exponent: i64) -> Self {
        let significant = digits.trim_start_matches('0');
        let trimmed = significant.trim_end_matches('0');
        if trimmed.is_empty() {
            return Self {
                negative: false,
                digits: String::new(),
                exponent: 0,
            };
        }
        Self {
            negative,
            digits: trimmed.to_owned(),
            exponent: exponent + (significant.len() - trimmed.len()) as i64,
        }
    }

    fn integer(value: i128) -> Self {
        Self::new(value < 0, &value.unsigned_abs().to_string(), 0)
    }

    /// The value of a literal as ryu_js writes one: `-1.5e-7`, `1e+21`, `100`, `0.002`.
    fn parse(literal: &str) -> Self {
        let (negative, rest) = match literal.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, literal),
        };
        let (mantissa, exponent) = match rest.split_once(['e', 'E']) {
            Some((mantissa, exponent)) => (mantissa, exponent.parse::<i64>().unwrap()),
            None => (rest, 0),
        };
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        Self::new(negative, &format!("{int}{frac}"), exponent - frac.len() as i64)
    }

    /// The value one unit of its last digit further from zero (`away`) or closer to it.
    fn nudged(&self, away: bool) -> Self {
        if self.digits.is_empty() {
            return Self::integer(if away { 1 } else { -1 });
        }
        let mut digits = self.digits.clone().into_bytes();
        if away {
            let mut index = digits.len();
            loop {
                if index == 0 {
                    digits.insert(0, b'1');
                    break;
                }
                index -= 1;
                if digits[index] == b'9' {
                    digits[index] = b'0';
                } else {
                    digits[index] += 1;
                    break;
                }
            }
        } else {
            // The last digit is not 0 (normalised), so nothing is borrowed.
            *digits.last_mut().unwrap() -= 1;
        }
        Self::new(self.negative, std::str::from_utf8(&digits).unwrap(), self.exponent)
    }

    /// A text naming this number, such as `"1"` for 1.
    fn text(&self) -> String {
        let sign = if self.negative { "-" } else { "" };
        match (self.digits.as_str(), self.exponent) {
            ("", _) => "0".to_owned(),
            (digits, 0) => format!("{sign}{digits}"),
            (digits, exponent) => format!("{sign}{digits}e{exponent}"),
        }
    }
}

fn same_value(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Null, Json::Null) => true,
        (Json::Bool(a), Json::Bool(b)) => a == b,
        (Json::Number(a), Json::Number(b)) => a == b,
        (Json::String(a), Json::String(b)) => a == b,
        (Json::Array(a), Json::Array(b)) => a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same_value(a, b)),
        (Json::Object(a), Json::Object(b)) => {
            a.len() == b.len()
                && a.iter()
                    .all(|(name, a)| b.iter().any(|(other, b)| name == other && same_value(a, b)))
        }
        _ => false,
    }
}

/// The choices of one way of writing a document, drawn from a seed (splitmix64), so that proptest
/// only has to generate and shrink the seed.
struct Style(u64);

impl Style {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

/// The document written one way: random member order, whitespace, escapes and number notation.
fn write(document: &Json, seed: u64) -> String {
    let mut style = Style(seed);
    let mut out = String::new();
    whitespace(&mut style, &mut out);
    write_value(document, &mut style, &mut out);
    whitespace(&mut style, &mut out);
    out
}

fn whitespace(style: &mut Style, out: &mut String) {
    if style.below(3) == 0 {
        for _ in 0..=style.below(3) {
            out.push([' ', '\t', '\n', '\r'][style.below(4)]);
        }
    }
}

fn write_value(value: &Json, style: &mut Style, out: &mut String) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(value) => out.push_str(if *value { "true" } else { "false" }),
        Json::Number(number) => write_number(number, style, out),
        Json::String(text) => write_string(text, style, out),
        Json::Array(items) => {
            out.push('[');
            whitespace(style, out);
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                    whitespace(style, out);
                }
                write_value(item, style, out);
                whitespace(style, out);
            }
            out.push(']');
        }
        Json::Object(members) => {
            let mut order: Vec<usize> = (0..members.len()).collect();
            for index in (1..order.len()).rev() {
                order.swap(index, style.below(index + 1));
            }
            out.push('{');
            whitespace(style, out);
            for (position, &index) in order.iter().enumerate() {
                if position > 0 {
                    out.push(',');
                    whitespace(style, out);
                }
                let (name, value) = &members[index];
                write_string(name, style, out);
                whitespace(style, out);
                out.push(':');
                whitespace(style, out);
                write_value(value, style, out);
                whitespace(style, out);
            }
            out.push('}');
        }
    }
}

fn write_number(number: &Decimal, style: &mut Style, out: &mut String) {
    if number.digits.is_empty() {
        if style.coin() {
            out.push('-');
        }
        out.push('0');
        if style.coin() {
            out.push('.');
            out.push_str(&"0".repeat(1 + style.below(3)));
        }
        if style.coin() {
            let exponent = style.below(41) as i64 - 20;
            write_exponent(exponent, style, out);
        }
        return;
    }
    if number.negative {
        out.push('-');
    }
    // `digits × 10^exponent`, with some trailing zeros and the decimal point anywhere.
    let padding = style.below(3);
    let digits = format!("{}{}", number.digits, "0".repeat(padding));
    let exponent = number.exponent - padding as i64;
    let fraction = style.below(digits.len() + 3);
    if fraction == 0 {
        out.push_str(&digits);
    } else if fraction < digits.len() {
        let (int, frac) = digits.split_at(digits.len() - fraction);
        out.push_str(&format!("{int}.{frac}"));
    } else {
        out.push_str(&format!("0.{}{digits}", "0".repeat(fraction - digits.len())));
    }
    let written = exponent + fraction as i64;
    if written != 0 || style.coin() {
        write_exponent(written, style, out);
    }
}

fn write_exponent(exponent: i64, style: &mut Style, out: &mut String) {
    out.push(if style.coin() { 'e' } else { 'E' });
    if exponent < 0 {
        out.push('-');
    } else if style.coin() {
        out.push('+');
    }
    out.push_str(&"0".repeat(style.below(3)));
    out.push_str(&exponent.unsigned_abs().to_string());
}

fn write_string(text: &str, style: &mut Style, out: &mut String) {
    out.push('"');
    for character in text.chars() {
        let short = match character {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        let must_escape = character < ' ' || character == '"' || character == '\\';
        match (style.below(4), short) {
            (0 | 1, _) if !must_escape => out.push(character),
            (0..=2, Some(short)) => out.push_str(short),
            _ => {
                let upper = style.coin();
                let mut units = [0u16; 2];
                for unit in character.encode_utf16(&mut units) {
                    out.push_str(&if upper {
                        format!("\\u{unit:04X}")
                    } else {
                        format!("\\u{unit:04x}")
                    });
                }
            }
        }
    }
    out.push('"');
}

/// Changes the value of one node (the `target`-th in pre-order, modulo their number) minimally.
fn mutate(document: &mut Json, target: usize, choice: usize) {
    let mut remaining = target % count_nodes(document);
    assert!(mutate_node(document, &mut remaining, choice));
}

fn count_nodes(value: &Json) -> usize {
    1 + match value {
        Json::Array(items) => items.iter().map(count_nodes).sum(),
        Json::Object(members) => members.iter().map(|(_, value)| count_nodes(value)).sum(),
        _ => 0,
    }
}

fn mutate_node(value: &mut Json, remaining: &mut usize, choice: usize) -> bool {
    if *remaining == 0 {
        change(value, choice);
        return true;
    }
    *remaining -= 1;
    match value {
        Json::Array(items) => items.iter_mut().any(|item| mutate_node(item, remaining, choice)),
        Json::Object(members) => members
            .iter_mut()
            .any(|(_, value)| mutate_node(value, remaining, choice)),
        _ => false,
    }
}

fn change(value: &mut Json, choice: usize) {
    *value = match std::mem::replace(value, Json::Null) {
        Json::Null => match choice % 3 {
            0 => Json::Number(Decimal::integer(0)),
            1 => Json::Bool(false),
            _ => Json::String("null".to_owned()),
        },
        Json::Bool(value) if choice.is_multiple_of(2) => Json::Bool(!value),
        Json::Bool(value) => Json::String(value.to_string()),
        Json::Number(number) => match choice % 5 {
            0 => Json::Number(number.nudged(true)),
            1 => Json::Number(number.nudged(false)),
            2 => Json::String(number.text()),
            3 if !number.digits.is_empty() => Json::Number(Decimal {
                negative: !number.negative,
                ..number
            }),
            _ if number.digits.is_empty() => Json::Null,
            _ => Json::Number(number.nudged(true)),
        },
        Json::String(text) if choice.is_multiple_of(2) && text.parse::<i128>().is_ok() => {
            Json::Number(Decimal::integer(text.parse().unwrap()))
        }
        Json::String(text) => {
            let mut characters: Vec<char> = text.chars().collect();
            match (choice / 2) % 3 {
                0 if !characters.is_empty() => {
                    let index = choice % characters.len();
                    characters[index] = if characters[index] == 'a' { 'b' } else { 'a' };
                }
                1 if !characters.is_empty() => {
                    characters.remove(choice % characters.len());
                }
                _ => characters.insert(choice % (characters.len() + 1), 'a'),
            }
            Json::String(characters.into_iter().collect())
        }
        Json::Array(mut items) => {
            if items.is_empty() || choice.is_multiple_of(2) {
                items.insert(choice % (items.len() + 1), Json::Null);
            } else {
                items.remove(choice % items.len());
            }
            Json::Array(items)
        }
        Json::Object(mut members) => {
            let fresh = |members: &[(String, Json)], mut name: String| {
                while members.iter().any(|(other, _)| *other == name) {
                    name.push('a');
                }
                name
            };
            match choice % 3 {
                0 if !members.is_empty() => {
                    members.remove(choice % members.len());
                }
                1 if !members.is_empty() => {
                    let index = choice % members.len();
                    let name = fresh(&members, members[index].0.clone());
                    members[index].0 = name;
                }
                _ => {
                    let name = fresh(&members, String::new());
                    members.push((name, Json::Null));
                }
            }
            Json::Object(members)
        }
    };
}

fn character() -> impl Strategy<Value = char> {
    prop_oneof![
        // A small alphabet, so that names and strings often collide or nearly do.
        4 => prop::char::range('a', 'c'),
        2 => any::<char>(),
        1 => prop::char::range('\0', '\u{1f}'),
        1 => prop::sample::select(vec![
            '"', '\\', '/', '\u{7f}', 'é', '\u{2028}', '\u{e000}', '\u{ffff}', '😀', '\u{10ffff}'
        ]),
    ]
}

fn text(max_len: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(character(), 0..max_len).prop_map(String::from_iter)
}

fn digits(len: std::ops::Range<usize>) -> impl Strategy<Value = String> {
    prop::collection::vec(0u8..10, len)
        .prop_map(|digits| digits.into_iter().map(|digit| char::from(b'0' + digit)).collect())
}

/// Numbers that f64 holds exactly, written as RFC 8785 writes them: what the old canonicaliser
/// rendered exactly.
fn f64_exact_number() -> BoxedStrategy<Decimal> {
    prop_oneof![
        (-100_000i64..100_000).prop_map(|integer| integer as f64),
        (-1_000_000i64..1_000_000, 1i32..4).prop_map(|(units, places)| units as f64 / 10f64.powi(places)),
        any::<u64>()
            .prop_map(f64::from_bits)
            .prop_filter("finite", |value| value.is_finite()),
    ]
    .prop_map(|value| Decimal::parse(ryu_js::Buffer::new().format_finite(value)))
    .boxed()
}

fn any_number() -> BoxedStrategy<Decimal> {
    prop_oneof![
        (-1000i128..1000).prop_map(Decimal::integer),
        // Around 2^53, where f64 stops telling integers apart.
        (-2000i128..2000, any::<bool>()).prop_map(|(offset, negative)| {
            let magnitude = (1i128 << 53) + offset;
            Decimal::integer(if negative { -magnitude } else { magnitude })
        }),
        any::<i128>().prop_map(Decimal::integer),
        // Long fractions.
        (any::<bool>(), digits(1..40), -45i64..0)
            .prop_map(|(negative, digits, exponent)| Decimal::new(negative, &digits, exponent)),
        // Beyond f64's range both ways.
        (any::<bool>(), digits(1..20), -400i64..400)
            .prop_map(|(negative, digits, exponent)| Decimal::new(negative, &digits, exponent)),
        f64_exact_number(),
    ]
    .boxed()
}

fn document(number: BoxedStrategy<Decimal>) -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        number.prop_map(Json::Number),
        text(8).prop_map(Json::String),
    ];
    leaf.prop_recursive(4, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
            prop::collection::btree_map(text(4), inner, 0..6)
                .prop_map(|members| Json::Object(members.into_iter().collect())),
        ]
    })
}

fn fingerprint(body: &str) -> Fingerprint {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, "application/json".parse().unwrap());
    Fingerprint::of(
        &Method::POST,
        &Uri::from_static("/pay?currency=EUR"),
        &headers,
        body.as_bytes(),
    )
}

/// The digest that idem stored, before numbers were kept exact, for a JSON body whose
/// `serde_json_canonicalizer` form is `canonical`.
fn digest_before_exact_numbers(canonical: &str) -> [u8; 32] {
    let mut all = Sha256::new();
    for part in [
        b"idem-fingerprint-v1".as_slice(),
        b"POST",
        b"/pay",
        b"currency=EUR",
        b"json",
        canonical.as_bytes(),
    ] {
        all.update((part.len() as u64).to_be_bytes());
        all.update(part);
    }
    all.finalize().into()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_way_of_writing_a_document_has_one_fingerprint(
        document in document(any_number()),
        first_seed: u64,
        second_seed: u64,
    ) {
        let (first, second) = (write(&document, first_seed), write(&document, second_seed));
        prop_assert_eq!(fingerprint(&first), fingerprint(&second), "{}\n{}", first, second);
    }

    #[test]
    fn a_minimal_change_of_value_changes_the_fingerprint(
        document in document(any_number()),
        target: usize,
        choice: usize,
        first_seed: u64,
        second_seed: u64,
    ) {
        let mut changed = document.clone();
        mutate(&mut changed, target, choice);
        prop_assert!(!same_value(&document, &changed), "the mutation kept the value: {:?}", changed);
        let (first, second) = (write(&document, first_seed), write(&changed, second_seed));
        prop_assert_ne!(*fingerprint(&first).digest(), *fingerprint(&second).digest(), "{}\n{}", first, second);
    }

    #[test]
    fn documents_share_a_fingerprint_exactly_when_they_are_the_same_value(
        first in document(any_number()),
        second in document(any_number()),
        first_seed: u64,
        second_seed: u64,
    ) {
        let (first_body, second_body) = (write(&first, first_seed), write(&second, second_seed));
        prop_assert_eq!(
            same_value(&first, &second),
            fingerprint(&first_body) == fingerprint(&second_body),
            "{}\n{}", first_body, second_body
        );
    }

    #[test]
    fn integers_beyond_2_pow_53_are_told_apart(
        integer in (1i128 << 53)..(1i128 << 80),
        negative: bool,
        first_seed: u64,
        second_seed: u64,
    ) {
        let sign = if negative { -1 } else { 1 };
        let amount = |integer: i128| {
            Json::Object(vec![("amount".to_owned(), Json::Number(Decimal::integer(sign * integer)))])
        };
        let (first, second) = (write(&amount(integer), first_seed), write(&amount(integer + 1), second_seed));
        prop_assert_ne!(*fingerprint(&first).digest(), *fingerprint(&second).digest(), "{}\n{}", first, second);
    }

    #[test]
    fn digests_stored_before_exact_numbers_still_match(
        document in document(f64_exact_number()),
        seed: u64,
    ) {
        let body = write(&document, seed);
        let canonical = serde_json_canonicalizer::pipe(&body).unwrap();
        prop_assert_eq!(fingerprint(&body), fingerprint(&canonical), "{}", body);
        prop_assert_eq!(*fingerprint(&body).digest(), digest_before_exact_numbers(&canonical), "{}", body);
    }
}
