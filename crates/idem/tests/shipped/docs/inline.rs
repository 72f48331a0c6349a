//! Inline markdown, read by hand: code spans (which hold no links), links of every form with
//! their targets, reference definitions, and a heading's text as a reader sees it.

use std::collections::HashMap;
use std::ops::Range;

/// Inline markdown as it reads: code spans' content, a link's text, no HTML tags.
pub(crate) fn shown_text(inline: &str) -> String {
    let spans = code_spans(inline);
    let mut out = String::new();
    let mut i = 0;
    while i < inline.len() {
        if let Some(span) = spans.iter().find(|span| span.whole.start == i) {
            out.push_str(&span.content);
            i = span.whole.end;
            continue;
        }
        let rest = &inline[i..];
        if rest.starts_with("](") {
            // The end of a link's text: skip its target.
            match link_destination(inline, i + 2) {
                Some((_, end)) => i = end,
                None => {
                    out.push(']');
                    i += 1;
                }
            }
            continue;
        }
        // An HTML tag (`<a id="…">`), not a `<` of the text.
        if rest.starts_with('<')
            && let Some(end) = rest
                .find('>')
                .filter(|end| rest[1..*end].starts_with(|c: char| c.is_ascii_alphabetic() || c == '/'))
        {
            i += end + 1;
            continue;
        }
        let c = rest.chars().next().expect("a character");
        if !matches!(c, '[' | ']' | '!' | '\\') || (c == '!' && !rest.starts_with("![")) {
            out.push(c);
        }
        i += c.len_utf8();
    }
    out
}

/// `[label]: target` at the start of a line; the label as it matches (case and spaces folded).
pub(crate) fn reference_definition(row: &str) -> Option<(String, String)> {
    if row.len() - row.trim_start_matches(' ').len() > 3 {
        return None;
    }
    let rest = row.trim_start().strip_prefix('[')?;
    let (label, rest) = rest.split_once("]:")?;
    let target = rest.split_whitespace().next()?;
    let target = target
        .strip_prefix('<')
        .and_then(|t| t.strip_suffix('>'))
        .unwrap_or(target);
    Some((label_key(label), target.to_string()))
}

fn label_key(label: &str) -> String {
    label.split_whitespace().collect::<Vec<_>>().join(" ").to_lowercase()
}

/// Links in text without code spans: `[text](target)`, `![alt](src)`, `[text][label]`,
/// `[label][]`, `[label]` (when defined), and `href="…"`/`src="…"` in HTML tags; each with its
/// byte offset. A full reference to an undefined label is reported as a link to nothing.
pub(crate) fn inline_links(text: &str, definitions: &HashMap<String, String>) -> Vec<(usize, String)> {
    let bytes = text.as_bytes();
    let mut links = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'[' => {
                let Some(close) = matching_bracket(text, i) else {
                    i += 1;
                    continue;
                };
                let after = &text[close + 1..];
                if after.starts_with('(') {
                    if let Some((target, end)) = link_destination(text, close + 2) {
                        links.push((i, target));
                        // The text may hold an image: look inside it too.
                        links.extend(
                            inline_links(&text[i + 1..close], definitions)
                                .into_iter()
                                .map(|(at, t)| (i + 1 + at, t)),
                        );
                        i = end;
                        continue;
                    }
                } else if let Some(rest) = after.strip_prefix('[') {
                    if let Some(end) = rest.find(']') {
                        let label = if end == 0 { &text[i + 1..close] } else { &rest[..end] };
                        let target = definitions
                            .get(&label_key(label))
                            .cloned()
                            .unwrap_or_else(|| format!("[{label}] (an undefined reference)"));
                        links.push((i, target));
                        i = close + 2 + end + 1;
                        continue;
                    }
                } else if !after.starts_with(':')
                    && let Some(target) = definitions.get(&label_key(&text[i + 1..close]))
                {
                    links.push((i, target.clone()));
                }
                i += 1;
            }
            b'<' => {
                let end = text[i..].find('>').map_or(text.len(), |end| i + end);
                let tag = &text[i..end];
                for attribute in ["href=\"", "src=\""] {
                    if let Some(at) = tag.find(attribute) {
                        let value = &tag[at + attribute.len()..];
                        links.push((i, value[..value.find('"').unwrap_or(value.len())].to_string()));
                    }
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    links.retain(|(_, target)| !target.starts_with('[') || target.ends_with("(an undefined reference)"));
    links
}

/// The `]` that closes the `[` at `open` (nested brackets counted, escapes skipped).
fn matching_bracket(text: &str, open: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut depth = 0;
    let mut i = open;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 1,
            b'[' => depth += 1,
            b']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            b'\n' if text[i + 1..].starts_with('\n') => return None,
            _ => {}
        }
        i += 1;
    }
    None
}

/// A link's destination starting at `start` (after its `(`): the target and the offset after
/// the closing `)`. A title (`"…"`) is skipped.
fn link_destination(text: &str, start: usize) -> Option<(String, usize)> {
    let rest = &text[start..];
    let skipped = rest.len() - rest.trim_start().len();
    let rest = rest.trim_start();
    let (target, used) = if let Some(inner) = rest.strip_prefix('<') {
        let end = inner.find('>')?;
        (inner[..end].to_string(), end + 2)
    } else {
        let mut depth = 0usize;
        let mut end = rest.len();
        for (at, c) in rest.char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => {
                    end = at;
                    break;
                }
                ')' => depth -= 1,
                c if c.is_whitespace() => {
                    end = at;
                    break;
                }
                _ => {}
            }
        }
        (rest[..end].to_string(), end)
    };
    let after = &rest[used..];
    let close = after.find(')')?;
    let between = after[..close].trim();
    let is_title = between.is_empty()
        || (between.len() >= 2
            && matches!(between.as_bytes()[0], b'"' | b'\'' | b'(')
            && between.ends_with(['"', '\'', ')']));
    is_title.then(|| (target, start + skipped + used + close + 1))
}

/// A code span: its whole extent (backticks included) and its content as shown.
#[derive(Debug)]
pub(crate) struct CodeSpan {
    pub(crate) whole: Range<usize>,
    pub(crate) content: String,
}

/// The code spans of a block's text: a run of backticks closed by a run of the same length
/// (unmatched backticks are literal); content with line ends as spaces, one surrounding space
/// taken off when both ends have one.
pub(crate) fn code_spans(text: &str) -> Vec<CodeSpan> {
    let bytes = text.as_bytes();
    let mut spans = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            i += 2;
            continue;
        }
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let run = bytes[i..].iter().take_while(|&&b| b == b'`').count();
        let mut j = i + run;
        let mut close = None;
        while j < bytes.len() {
            if bytes[j] == b'`' {
                let other = bytes[j..].iter().take_while(|&&b| b == b'`').count();
                if other == run {
                    close = Some(j);
                    break;
                }
                j += other;
            } else {
                j += 1;
            }
        }
        match close {
            Some(close) => {
                let content = text[i + run..close].replace('\n', " ");
                let content = match content.strip_prefix(' ').and_then(|c| c.strip_suffix(' ')) {
                    Some(inner) if !inner.trim().is_empty() => inner.to_string(),
                    _ => content,
                };
                spans.push(CodeSpan {
                    whole: i..close + run,
                    content,
                });
                i = close + run;
            }
            None => i += run,
        }
    }
    spans
}

/// The text with each code span blanked (line ends kept, so that line numbers hold).
pub(crate) fn without_code_spans(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    for span in code_spans(text) {
        out.push_str(&text[last..span.whole.start]);
        out.extend(
            text[span.whole.clone()]
                .chars()
                .map(|c| if c == '\n' { '\n' } else { ' ' }),
        );
        last = span.whole.end;
    }
    out.push_str(&text[last..]);
    out
}
