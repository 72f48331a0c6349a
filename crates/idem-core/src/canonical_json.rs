//! The canonical form of a JSON body for fingerprints: RFC 8785 (JCS), except that every number keeps
//! its exact decimal value. It owns a strict I-JSON parser; a body it refuses (not I-JSON, nested too
//! deeply, an absurd exponent) is hashed by the caller as raw bytes instead.

use std::borrow::Cow;

/// How deeply arrays and objects may nest. serde_json, behind the canonicaliser that produced the
/// digests already stored, accepted 127 levels and refused 128; refusing the same bodies keeps those
/// digests valid. The limit also bounds the recursion of the parser and of the writer.
const MAX_DEPTH: usize = 127;

/// The largest magnitude of a number's decimal exponent (of its first significant digit). No request
/// needs more, and it keeps every exponent computation far from `i64` overflow.
const MAX_EXPONENT: i64 = 1_000_000_000_000_000;

/// The canonical bytes of `body`, or `None` if it must be hashed as raw bytes.
///
/// Two bodies get the same canonical bytes exactly when they are the same JSON value. Where RFC 8785's
/// rendering of a number (the shortest form of the nearest `f64`) denotes exactly the number's value,
/// that rendering is used, so such documents canonicalise as `serde_json_canonicalizer` did.
pub(crate) fn canonicalise(body: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut parser = Parser { text, pos: 0 };
    parser.skip_whitespace();
    let value = parser.value(0)?;
    parser.skip_whitespace();
    if parser.pos != text.len() {
        return None;
    }
    let mut out = Vec::with_capacity(body.len());
    value.write(&mut out);
    Some(out)
}

/// A parsed value. Its strings and numbers borrow the body's text where it is already their
/// canonical form (a string without escapes, a number written as RFC 8785 writes it), which is the
/// common case: a request's fingerprint then allocates once per array or object, not per token.
enum Value<'a> {
    Null,
    Bool(bool),
    /// Already in its canonical rendering.
    Number(Cow<'a, [u8]>),
    String(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    /// Sorted by the UTF-16 code units of the names, which are unique.
    Object(Vec<(Cow<'a, str>, Value<'a>)>),
}

struct Parser<'a> {
    text: &'a str,
    /// Always on a character boundary between tokens: it only ever stops at ASCII bytes.
    pos: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        let found = self.peek() == Some(byte);
        self.pos += usize::from(found);
        found
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// A value starting at `pos`, inside `depth` arrays and objects.
    fn value(&mut self, depth: usize) -> Option<Value<'a>> {
        match self.peek()? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => self.string().map(Value::String),
            b't' => self.literal("true", Value::Bool(true)),
            b'f' => self.literal("false", Value::Bool(false)),
            b'n' => self.literal("null", Value::Null),
            b'-' | b'0'..=b'9' => self.number().map(Value::Number),
            _ => None,
        }
    }

    fn literal(&mut self, word: &str, value: Value<'a>) -> Option<Value<'a>> {
        let found = self.text.as_bytes()[self.pos..].starts_with(word.as_bytes());
        found.then(|| {
            self.pos += word.len();
            value
        })
    }

    fn array(&mut self, depth: usize) -> Option<Value<'a>> {
        // Checked before descending, so hostile nesting never grows the stack past the limit.
        if depth > MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_whitespace();
        if self.eat(b']') {
            return Some(Value::Array(items));
        }
        loop {
            items.push(self.value(depth)?);
            self.skip_whitespace();
            if self.eat(b']') {
                return Some(Value::Array(items));
            }
            if !self.eat(b',') {
                return None;
            }
            self.skip_whitespace();
        }
    }

    fn object(&mut self, depth: usize) -> Option<Value<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        let mut members = Vec::new();
        self.skip_whitespace();
        if !self.eat(b'}') {
            loop {
                if self.peek() != Some(b'"') {
                    return None;
                }
                let name = self.string()?;
                self.skip_whitespace();
                if !self.eat(b':') {
                    return None;
                }
                self.skip_whitespace();
                members.push((name, self.value(depth)?));
                self.skip_whitespace();
                if self.eat(b'}') {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
                self.skip_whitespace();
            }
        }
        members.sort_unstable_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
        // Sorted, equal names are neighbours. I-JSON forbids them, and keeping either one would make
        // `{"amount":1,"amount":500}` the same request as `{"amount":500}`.
        if members.windows(2).any(|pair| pair[0].0 == pair[1].0) {
            return None;
        }
        Some(Value::Object(members))
    }

    /// The text of the string whose opening quote is at `pos`, escapes resolved: borrowed from the
    /// body unless it has escapes.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.pos += 1;
        let text: &'a str = self.text;
        let bytes = text.as_bytes();
        let mut resolved: Option<String> = None;
        loop {
            // Whole runs at a time: a long string costs one pass, not one push per character.
            let run = bytes[self.pos..]
                .iter()
                .position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20)?;
            let chunk = &text[self.pos..self.pos + run];
            self.pos += run;
            match bytes[self.pos] {
                b'"' => {
                    self.pos += 1;
                    return Some(match resolved {
                        None => Cow::Borrowed(chunk),
                        Some(mut owned) => {
                            owned.push_str(chunk);
                            Cow::Owned(owned)
                        }
                    });
                }
                b'\\' => {
                    self.pos += 1;
                    let owned = resolved.get_or_insert_with(String::new);
                    owned.push_str(chunk);
                    owned.push(self.escape()?);
                }
                // A raw control character: JSON requires it to be escaped.
                _ => return None,
            }
        }
    }

    /// The character of the escape after a backslash.
    fn escape(&mut self) -> Option<char> {
        let byte = self.peek()?;
        self.pos += 1;
        Some(match byte {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let unit = self.hex4()?;
                if (0xD800..0xDC00).contains(&unit) {
                    // A high surrogate is text only together with a low one right after it; a lone
                    // surrogate is not I-JSON, and could not be told apart from U+FFFD once replaced.
                    if !(self.eat(b'\\') && self.eat(b'u')) {
                        return None;
                    }
                    let low = self.hex4()?;
                    if !(0xDC00..0xE000).contains(&low) {
                        return None;
                    }
                    char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))?
                } else {
                    // `None` for a lone low surrogate.
                    char::from_u32(unit)?
                }
            }
            _ => return None,
        })
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.text.as_bytes().get(self.pos..self.pos + 4)?;
        let mut unit = 0;
        for &digit in digits {
            unit = unit * 16 + char::from(digit).to_digit(16)?;
        }
        self.pos += 4;
        Some(unit)
    }

    /// The canonical rendering of the number at `pos`.
    fn number(&mut self) -> Option<Cow<'a, [u8]>> {
        let start = self.pos;
        // Every character a number may contain; the strict grammar is checked by `Decimal::parse`.
        // Valid JSON never has one of them right after a number, so the token's extent is right.
        let len = self.text.as_bytes()[start..]
            .iter()
            .position(|byte| !matches!(byte, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
            .unwrap_or(self.text.len() - start);
        self.pos += len;
        let text: &'a str = self.text;
        render_number(&text[start..self.pos])
    }
}

/// The exact value of a number: `±d₁.d₂d₃… × 10^exponent`.
#[derive(PartialEq, Eq)]
struct Decimal {
    /// Never set for zero, so that `-0` and `0` are one value.
    negative: bool,
    /// ASCII digits without leading or trailing zeros; empty for zero.
    digits: Vec<u8>,
    /// The power of ten of the first digit; 0 for zero.
    exponent: i64,
}

impl Decimal {
    /// The value of a JSON number literal; `None` if it is not one, or if its exponent is beyond
    /// [`MAX_EXPONENT`].
    fn parse(literal: &[u8]) -> Option<Self> {
        let (negative, rest) = match literal {
            [b'-', rest @ ..] => (true, rest),
            _ => (false, literal),
        };
        let (int, rest) = rest.split_at(leading_digits(rest));
        if int.is_empty() || (int.len() > 1 && int[0] == b'0') {
            return None;
        }
        let (frac, rest) = match rest {
            [b'.', rest @ ..] => {
                let (frac, rest) = rest.split_at(leading_digits(rest));
                if frac.is_empty() {
                    return None;
                }
                (frac, rest)
            }
            _ => (&[][..], rest),
        };
        // `None` for an exponent too large for an i64 (more than 18 significant digits).
        let written_exponent: Option<i64> = match rest {
            [] => Some(0),
            [b'e' | b'E', rest @ ..] => {
                let (exponent_negative, digits) = match rest {
                    [b'-', digits @ ..] => (true, digits),
                    [b'+', digits @ ..] => (false, digits),
                    digits => (false, digits),
                };
                if digits.is_empty() || leading_digits(digits) != digits.len() {
                    return None;
                }
                let significant = &digits[digits.iter().take_while(|&&digit| digit == b'0').count()..];
                (significant.len() <= 18).then(|| {
                    let magnitude = significant
                        .iter()
                        .fold(0i64, |value, digit| value * 10 + i64::from(digit - b'0'));
                    if exponent_negative { -magnitude } else { magnitude }
                })
            }
            _ => return None,
        };
        let mut digits: Vec<u8> = int.iter().chain(frac).copied().collect();
        let Some(leading_zeros) = digits.iter().position(|&digit| digit != b'0') else {
            // Zero, whatever its sign and exponent: `0e999999999999999999999` is 0 too.
            return Some(Self {
                negative: false,
                digits: Vec::new(),
                exponent: 0,
            });
        };
        let trailing_zeros = digits.iter().rev().take_while(|&&digit| digit == b'0').count();
        digits.truncate(digits.len() - trailing_zeros);
        digits.drain(..leading_zeros);
        // The integer part's length and the leading zeros are bounded by the input's length, so
        // this cannot overflow once the written exponent has at most 18 digits.
        let exponent = written_exponent? + int.len() as i64 - 1 - leading_zeros as i64;
        (exponent.abs() <= MAX_EXPONENT).then_some(Self {
            negative,
            digits,
            exponent,
        })
    }

    /// A rendering that denotes exactly this value: `-d.ddde+N`, every digit kept.
    fn exact_rendering(&self) -> Vec<u8> {
        let Some((first, rest)) = self.digits.split_first() else {
            return b"0".to_vec();
        };
        let mut out = Vec::with_capacity(self.digits.len() + 24);
        if self.negative {
            out.push(b'-');
        }
        out.push(*first);
        if !rest.is_empty() {
            out.push(b'.');
            out.extend_from_slice(rest);
        }
        out.extend_from_slice(format!("e{:+}", self.exponent).as_bytes());
        out
    }
}

fn leading_digits(bytes: &[u8]) -> usize {
    bytes.iter().take_while(|byte| byte.is_ascii_digit()).count()
}

/// The canonical rendering of a number literal. RFC 8785's rendering (the shortest form of the
/// nearest `f64`) where it denotes exactly the literal's value, otherwise the exact rendering. Either
/// way the text denotes the value exactly, so different values never share a rendering, and which one
/// is chosen depends only on the value.
fn render_number(literal: &str) -> Option<Cow<'_, [u8]>> {
    let value = Decimal::parse(literal.as_bytes())?;
    // The standard library's parse is correctly rounded, as serde_json's was for the old digests.
    let nearest: f64 = literal.parse().ok()?;
    if nearest.is_finite() {
        let mut buffer = ryu_js::Buffer::new();
        let shortest = buffer.format_finite(nearest);
        if shortest == literal {
            // Already written as RFC 8785 writes it (`100`, `0.5`), so it denotes the value.
            return Some(Cow::Borrowed(literal.as_bytes()));
        }
        if Decimal::parse(shortest.as_bytes()).is_some_and(|shortest| shortest == value) {
            return Some(Cow::Owned(shortest.as_bytes().to_vec()));
        }
    }
    Some(Cow::Owned(value.exact_rendering()))
}

impl Value<'_> {
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Self::Null => out.extend_from_slice(b"null"),
            Self::Bool(true) => out.extend_from_slice(b"true"),
            Self::Bool(false) => out.extend_from_slice(b"false"),
            Self::Number(rendering) => out.extend_from_slice(rendering),
            Self::String(text) => write_string(text, out),
            Self::Array(items) => {
                out.push(b'[');
                for (index, item) in items.iter().enumerate() {
                    if index > 0 {
                        out.push(b',');
                    }
                    item.write(out);
                }
                out.push(b']');
            }
            Self::Object(members) => {
                out.push(b'{');
                for (index, (name, value)) in members.iter().enumerate() {
                    if index > 0 {
                        out.push(b',');
                    }
                    write_string(name, out);
                    out.push(b':');
                    value.write(out);
                }
                out.push(b'}');
            }
        }
    }
}

/// A string as RFC 8785 writes it: only `"`, `\` and control characters escaped.
fn write_string(text: &str, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = text.as_bytes();
    let mut start = 0;
    for (index, &byte) in bytes.iter().enumerate() {
        let control;
        let escape: &[u8] = match byte {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => {
                control = [
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(byte >> 4)],
                    HEX[usize::from(byte & 0xf)],
                ];
                &control
            }
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..index]);
        out.extend_from_slice(escape);
        start = index + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn canonical(body: &str) -> Option<String> {
        canonicalise(body.as_bytes()).map(|bytes| String::from_utf8(bytes).unwrap())
    }

    #[track_caller]
    fn assert_distinct(a: &str, b: &str) {
        let (ca, cb) = (canonical(a).unwrap(), canonical(b).unwrap());
        assert_ne!(ca, cb, "{a} and {b} are different values");
    }

    #[test]
    fn numbers_are_told_apart_by_exact_value() {
        assert_distinct("9007199254740993", "9007199254740992");
        assert_distinct(r#"{"to":9007199254740993}"#, r#"{"to":9007199254740992}"#);
        // Both are infinite as f64.
        assert_distinct("1e400", "1e401");
        assert_distinct("-1e400", "-1e401");
        assert_distinct("0.1", "0.10000000000000001");
        assert_distinct("123456789012345678901234567890", "123456789012345678901234567891");
        // Both are 0 as f64.
        assert_distinct("1e-400", "0");
        assert_distinct("-1e-400", "1e-400");
        assert_distinct("18446744073709551615", "18446744073709551616");
    }

    #[test]
    fn numbers_render_exactly() {
        for (literal, rendering) in [
            ("9007199254740993", "9.007199254740993e+15"),
            ("9007199254740992", "9007199254740992"),
            ("1e400", "1e+400"),
            ("-0.10000000000000001", "-1.0000000000000001e-1"),
            ("123456789012345678901234567890", "1.2345678901234567890123456789e+29"),
            ("1e-400", "1e-400"),
            // The RFC 8785 forms, where they are exact.
            ("1E30", "1e+30"),
            ("4.50", "4.5"),
            ("2e-3", "0.002"),
            ("0.000000000000000000000000001", "1e-27"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("0.000001", "0.000001"),
            ("1e-7", "1e-7"),
            ("5e-324", "5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ] {
            assert_eq!(canonical(literal).unwrap(), rendering, "{literal}");
        }
    }

    #[test]
    fn notations_of_one_value_agree() {
        for group in [
            &["1", "1.0", "10e-1", "0.1E1", "1.000e+0", "100E-02", "0.001e3"][..],
            &["0", "-0", "0.0", "-0.000e10", "0E-5", "0e999999999999999999999999"],
            &["1e400", "10e399", "0.1e401", "1.0E+400"],
            &["9007199254740993", "9.007199254740993e15", "90071992547409930e-1"],
            &["-12.5", "-125e-1", "-0.0125E3"],
        ] {
            let first = canonical(group[0]).unwrap();
            for literal in group {
                assert_eq!(canonical(literal).unwrap(), first, "{literal} vs {}", group[0]);
            }
        }
    }

    #[test]
    fn absurd_exponents_are_refused_unless_the_value_is_zero() {
        assert_eq!(canonical("1e999999999999999").unwrap(), "1e+999999999999999");
        assert_eq!(canonical("1e1000000000000001"), None);
        assert_eq!(canonical("1e-1000000000000001"), None);
        assert_eq!(canonical("1e99999999999999999999999"), None);
        assert_eq!(canonical("[0.1e-999999999999999]").unwrap(), "[1e-1000000000000000]");
        assert_eq!(canonical("0.01e-999999999999999"), None);
        assert_eq!(canonical("0e-99999999999999999999999").unwrap(), "0");
    }

    #[test]
    fn duplicate_member_names_are_refused() {
        assert_eq!(canonical(r#"{"amount":1,"amount":500}"#), None);
        assert_eq!(canonical(r#"{"a":1,"\u0061":2}"#), None);
        assert_eq!(canonical(r#"[{"x":{"b":1,"c":2,"b":1}}]"#), None);
        assert_eq!(
            canonical(r#"{"a":{"a":1},"b":{"a":1}}"#).unwrap(),
            r#"{"a":{"a":1},"b":{"a":1}}"#
        );
    }

    #[test]
    fn surrogates_must_pair() {
        for lone in [
            r#""\ud800""#,
            r#""\udc00""#,
            r#""\ude00\ud83d""#,
            r#""\ud800\u0041""#,
            r#""\ud800x""#,
            r#""\ud800\ud800""#,
            r#"{"\ud800":1}"#,
        ] {
            assert_eq!(canonical(lone), None, "{lone}");
        }
        assert_eq!(canonical(r#""\ud83d\ude00""#).unwrap(), "\"😀\"");
        assert_eq!(canonical(r#""\uD83D\uDE00""#), canonical("\"😀\""));
    }

    #[test]
    fn invalid_utf8_is_refused() {
        for body in [
            &b"\"\xff\""[..],
            b"\"\xc0\xaf\"",
            b"\"\xed\xa0\x80\"",
            b"[1]\xff",
            b"{\"\xe2\x82\":1}",
        ] {
            assert_eq!(canonicalise(body), None, "{body:?}");
        }
    }

    #[test]
    fn what_is_not_json_is_refused() {
        for body in [
            "",
            " ",
            "{",
            "[1,]",
            "[,1]",
            "{\"a\" 1}",
            "{\"a\":1,}",
            "{a:1}",
            "01",
            "-01",
            "1.",
            ".5",
            "+1",
            "-",
            "--1",
            "1e",
            "1e+",
            "1.e3",
            "0x10",
            "NaN",
            "Infinity",
            "tru",
            "nul",
            "True",
            "[1]x",
            "1 2",
            "\u{feff}1",
            "\"\t\"",
            "\"\\a\"",
            "\"\\u12\"",
            "\"\\u12g4\"",
            "\"abc",
            "'a'",
            "[1]\u{a0}",
        ] {
            assert_eq!(canonical(body), None, "{body:?}");
        }
    }

    #[test]
    fn strings_are_written_as_rfc_8785_says() {
        assert_eq!(canonical(r#""\u0041""#), canonical(r#""A""#));
        assert_eq!(canonical(r#""\/""#).unwrap(), r#""/""#);
        assert_eq!(canonical(r#""\u00e9\u00E9""#).unwrap(), "\"éé\"");
        // Text before, between and after escapes, and names and numbers already canonical (kept as
        // they are written) beside ones that are not.
        assert_eq!(
            canonical(r#"{"ab\u0063d":"x\ty\u0020z","plain":[100,0.5,-7,1E2,1.50]}"#).unwrap(),
            r#"{"abcd":"x\ty z","plain":[100,0.5,-7,100,1.5]}"#
        );
        assert_eq!(
            canonical(r#""\u0000\u0008\u0009\u000a\u000C\u000d\u001F\u007f\u0022\u005c\u2028""#).unwrap(),
            "\"\\u0000\\b\\t\\n\\f\\r\\u001f\u{7f}\\\"\\\\\u{2028}\""
        );
        // RFC 8785 section 3.2.4, but with 333333333.3333333 for 333333333.33333329, whose f64 form would
        // not be its exact value.
        let input = r#"{
          "numbers": [333333333.3333333, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        assert_eq!(
            canonical(input).unwrap(),
            concat!(
                r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"#,
                r#""string":"€$\u000f\nA'B\"\\\\\"/"}"#
            )
        );
    }

    #[test]
    fn members_are_sorted_by_utf16_code_units() {
        // RFC 8785 section 3.2.3: U+FB33 sorts after U+1F600, whose first UTF-16 unit is 0xD83D.
        let input = r#"{"\u20ac":1,"\r":2,"\ufb33":3,"1":4,"\ud83d\ude00":5,"\u0080":6,"\u00f6":7}"#;
        assert_eq!(
            canonical(input).unwrap(),
            "{\"\\r\":2,\"1\":4,\"\u{80}\":6,\"ö\":7,\"€\":1,\"😀\":5,\"\u{fb33}\":3}"
        );
    }

    fn nested(depth: usize) -> String {
        let mut body = String::new();
        for level in 0..depth {
            body.push_str(if level % 2 == 0 { "[" } else { "{\"k\":" });
        }
        body.push('1');
        for level in (0..depth).rev() {
            body.push(if level % 2 == 0 { ']' } else { '}' });
        }
        body
    }

    #[test]
    fn nesting_is_limited_like_the_old_canonicaliser() {
        assert!(canonical(&nested(MAX_DEPTH)).is_some());
        assert_eq!(canonical(&nested(MAX_DEPTH + 1)), None);
        assert_eq!(canonical(&nested(129)), None);
        // serde_json's limit: the bodies it refused were hashed as bytes, and still are.
        assert!(serde_json_canonicalizer::pipe(&nested(MAX_DEPTH)).is_ok());
        assert!(serde_json_canonicalizer::pipe(&nested(MAX_DEPTH + 1)).is_err());
        assert_eq!(
            canonical(&nested(MAX_DEPTH)).unwrap(),
            serde_json_canonicalizer::pipe(&nested(MAX_DEPTH)).unwrap()
        );
        // Hostile nesting is refused without descending into it.
        assert_eq!(canonical(&"[".repeat(1_000_000)), None);
        assert_eq!(canonical(&"{\"a\":".repeat(300_000)), None);
    }

    #[test]
    fn large_bodies_are_handled_in_one_pass() {
        const MIB: usize = 1 << 20;
        let long_string = format!("\"{}\"", "a\\u00e9\\n".repeat(MIB / 9));
        // Each repetition: "a", then "é" in two bytes, then the newline escaped again in two.
        assert_eq!(canonical(&long_string).unwrap().len(), 2 + 5 * (MIB / 9));
        let long_number = format!("0.{}1", "0".repeat(MIB));
        assert_eq!(canonical(&long_number).unwrap(), format!("1e-{}", MIB + 1));
        let long_digits = "7".repeat(MIB);
        assert_eq!(
            canonical(&long_digits).unwrap().len(),
            MIB + 1 + format!("e+{}", MIB - 1).len()
        );
        let many_members = format!(
            "{{{}}}",
            (0..60_000)
                .rev()
                .map(|n| format!("\"k{n}\":{n}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let canonical_members = canonical(&many_members).unwrap();
        assert!(canonical_members.starts_with(r#"{"k0":0,"k1":1,"k10":10,"#));
        let long_key_prefix = "x".repeat(4096);
        let shared_prefixes = format!(
            "{{{}}}",
            (0..200)
                .map(|n| format!("\"{long_key_prefix}{n}\":{n}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        assert!(canonical(&shared_prefixes).is_some());
    }

    /// A number whose RFC 8785 rendering is exact: the shortest form of an `f64`, possibly written
    /// another way (trailing zeros, an explicit exponent).
    fn f64_exact_number() -> impl Strategy<Value = String> {
        let shortest = prop_oneof![
            any::<u64>()
                .prop_map(f64::from_bits)
                .prop_filter("finite", |value| value.is_finite()),
            (-1_000_000i64..1_000_000, 0i32..4).prop_map(|(units, places)| units as f64 / 10f64.powi(places)),
        ]
        .prop_map(|value| ryu_js::Buffer::new().format_finite(value).to_owned());
        (shortest, 0u8..4).prop_map(|(literal, notation)| {
            let (mantissa, exponent) = match literal.split_once('e') {
                Some((mantissa, exponent)) => (mantissa.to_owned(), format!("e{exponent}")),
                None => (literal.clone(), String::new()),
            };
            match notation {
                1 if mantissa.contains('.') => format!("{mantissa}00{exponent}"),
                1 => format!("{mantissa}.0{exponent}"),
                2 if exponent.is_empty() => format!("{mantissa}E+0"),
                2 => format!("{mantissa}{}", exponent.to_uppercase()),
                _ => literal,
            }
        })
    }

    fn string_literal() -> impl Strategy<Value = String> {
        let character = prop_oneof![
            any::<char>(),
            prop::char::range('\0', '\u{1f}'),
            prop::char::range(' ', '~'),
            prop::char::range('\u{e000}', '\u{ffff}'),
            prop::sample::select(vec!['"', '\\', '/', '\u{7f}', '😀'])
        ];
        prop::collection::vec((character, any::<bool>()), 0..8).prop_map(|characters| {
            let mut literal = String::from("\"");
            for (character, escaped) in characters {
                match character {
                    '/' if escaped => literal.push_str("\\/"),
                    _ if escaped => {
                        let mut units = [0u16; 2];
                        for unit in character.encode_utf16(&mut units) {
                            literal.push_str(&format!("\\u{unit:04X}"));
                        }
                    }
                    '"' | '\\' | '\0'..='\u{1f}' => {
                        let quoted = serde_json::to_string(&character.to_string()).unwrap();
                        literal.push_str(&quoted[1..quoted.len() - 1]);
                    }
                    _ => literal.push(character),
                }
            }
            literal.push('"');
            literal
        })
    }

    fn f64_exact_document() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("false".to_owned()),
            f64_exact_number(),
            string_literal(),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(|items| format!("[{}]", items.join(" ,"))),
                prop::collection::vec((string_literal(), inner), 0..6).prop_map(|members| {
                    // Names written differently may still be one name; an object keeps only the first.
                    let mut names = std::collections::HashSet::new();
                    let members: Vec<String> = members
                        .into_iter()
                        .filter(|(name, _)| names.insert(serde_json::from_str::<String>(name).unwrap()))
                        .map(|(name, value)| format!("{name}: {value}"))
                        .collect();
                    format!("{{ {} }}", members.join(",\n"))
                }),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Digests stored before exact numbers must still match: where every number's RFC 8785 form is
        /// exact, the canonical bytes are those of `serde_json_canonicalizer`.
        #[test]
        fn documents_with_f64_exact_numbers_canonicalise_as_before(document in f64_exact_document()) {
            let before = serde_json_canonicalizer::pipe(&document).unwrap();
            prop_assert_eq!(canonical(&document), Some(before), "{}", document);
        }
    }
}
