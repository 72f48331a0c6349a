//! [`escaped`]: text that a caller chose (a path, a header scope), as the operator's commands show
//! it on a terminal. A control character (C0, DEL, C1) could move the cursor, recolour or rewrite
//! what the operator reads, and a bidi control (U+202E, U+2066–U+2069, …) could reorder it, so
//! that one record passes for another: each is shown escaped instead. JSON output keeps values
//! exact (its encoding escapes what JSON needs); only text and tables go through here.

use std::borrow::Cow;
use std::fmt::Write as _;

/// `text` with every control and bidi character escaped: `\t`, `\n` and `\r` as such, other
/// ASCII controls as `\x1b`, the rest as `\u{202e}`. Text with none is returned as it is.
pub(crate) fn escaped(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if needs_escape(c) && c.is_ascii() => {
                let _ = write!(out, "\\x{:02x}", u32::from(c));
            }
            c if needs_escape(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Whether `c` must not reach a terminal as it is: a control character (C0, DEL, C1), a bidi
/// mark, embedding, override or isolate, or a line or paragraph separator (which some terminals
/// and pagers break the line on).
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{2028}' | '\u{2029}'
        )
}

#[cfg(test)]
mod tests {
    use super::escaped;

    #[test]
    fn controls_and_bidi_are_escaped_and_nothing_else() {
        for (text, shown) in [
            ("/payments/pay_1", "/payments/pay_1"),
            ("/café/über", "/café/über"),
            ("/a\u{202e}fdp.exe", "/a\\u{202e}fdp.exe"),
            (
                "x\u{2066}y\u{2069}\u{061c}\u{200e}\u{200f}",
                "x\\u{2066}y\\u{2069}\\u{61c}\\u{200e}\\u{200f}",
            ),
            ("\u{1b}[2J\u{7f}\u{0}", "\\x1b[2J\\x7f\\x00"),
            ("\u{9b}31m", "\\u{9b}31m"),
            ("a\tb\nc\rd", "a\\tb\\nc\\rd"),
            ("\u{2028}", "\\u{2028}"),
        ] {
            assert_eq!(escaped(text), shown, "{text:?}");
        }
    }
}
