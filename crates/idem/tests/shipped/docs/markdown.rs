//! A markdown page cut into blocks (headings, text, fenced code) as GitHub cuts it, and what a
//! check reads from them: the lines outside code and every link.

use std::collections::HashMap;
use std::path::Path;

use super::inline::{inline_links, reference_definition, without_code_spans};

/// A markdown page, cut into blocks.
#[derive(Debug)]
pub(crate) struct Doc {
    pub(crate) blocks: Vec<Block>,
}

/// A block of a page, with the number of its first line.
#[derive(Debug)]
pub(crate) enum Block {
    /// An ATX (`## …`) or setext heading.
    Heading { line: usize, level: usize, text: String },
    /// Lines up to a blank line, a heading or a fence: a paragraph, a list, a table.
    Text { line: usize, text: String },
    /// A fenced code block: its info string and its lines.
    Code { line: usize, info: String, text: String },
}

/// A link found in a page.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) line: usize,
    pub(crate) target: String,
}

impl Doc {
    /// The page at `page` (relative to `root`), read and parsed.
    pub(crate) fn read(root: &Path, page: &Path) -> Self {
        let text =
            std::fs::read_to_string(root.join(page)).unwrap_or_else(|err| panic!("read {}: {err}", page.display()));
        Self::parse(&text)
    }

    /// A page's text cut into blocks: fenced code up to its closing fence, headings (ATX, and
    /// setext under a paragraph that is not a list, a table or a quote), and text between them.
    pub(crate) fn parse(text: &str) -> Self {
        let lines: Vec<&str> = text.lines().collect();
        let mut blocks = Vec::new();
        let mut paragraph: Vec<(usize, &str)> = Vec::new();
        let flush = |paragraph: &mut Vec<(usize, &str)>, blocks: &mut Vec<Block>| {
            if let Some(&(line, _)) = paragraph.first() {
                let text = paragraph.iter().map(|(_, text)| *text).collect::<Vec<_>>().join("\n");
                blocks.push(Block::Text { line, text });
            }
            paragraph.clear();
        };
        let mut i = 0;
        while i < lines.len() {
            let (number, line) = (i + 1, lines[i]);
            i += 1;
            if let Some((fence, info)) = fence_opening(line) {
                flush(&mut paragraph, &mut blocks);
                let mut body = Vec::new();
                while i < lines.len() && !is_fence_closing(lines[i], &fence) {
                    body.push(lines[i]);
                    i += 1;
                }
                i += 1;
                blocks.push(Block::Code {
                    line: number,
                    info,
                    text: body.join("\n"),
                });
            } else if line.trim().is_empty() {
                flush(&mut paragraph, &mut blocks);
            } else if let Some((level, text)) = atx_heading(line) {
                flush(&mut paragraph, &mut blocks);
                blocks.push(Block::Heading {
                    line: number,
                    level,
                    text,
                });
            } else if let Some(level) = setext_underline(line).filter(|_| {
                paragraph
                    .first()
                    .is_some_and(|(_, first)| !first.trim_start().starts_with(['-', '*', '+', '|', '>']))
            }) {
                let text = paragraph
                    .iter()
                    .map(|(_, text)| text.trim())
                    .collect::<Vec<_>>()
                    .join(" ");
                blocks.push(Block::Heading {
                    line: paragraph[0].0,
                    level,
                    text,
                });
                paragraph.clear();
            } else {
                paragraph.push((number, line));
            }
        }
        flush(&mut paragraph, &mut blocks);
        Self { blocks }
    }

    /// Every line outside code blocks, with its number.
    pub(crate) fn lines_outside_code(&self) -> Vec<(usize, &str)> {
        let mut lines = Vec::new();
        for block in &self.blocks {
            match block {
                Block::Heading { line, text, .. } => lines.push((*line, text.as_str())),
                Block::Text { line, text } => lines.extend(text.lines().enumerate().map(|(i, text)| (line + i, text))),
                Block::Code { .. } => {}
            }
        }
        lines
    }

    /// Every link outside code: inline links and images, reference links and their definitions,
    /// and `href`/`src` of HTML tags.
    pub(crate) fn links(&self) -> Vec<Link> {
        let mut definitions: HashMap<String, String> = HashMap::new();
        let mut links = Vec::new();
        let mut texts = Vec::new();
        for block in &self.blocks {
            let (line, text) = match block {
                Block::Heading { line, text, .. } | Block::Text { line, text } => (*line, without_code_spans(text)),
                Block::Code { .. } => continue,
            };
            let mut kept = Vec::new();
            for (i, row) in text.lines().enumerate() {
                match reference_definition(row) {
                    Some((label, target)) => {
                        links.push(Link {
                            line: line + i,
                            target: target.clone(),
                        });
                        definitions.insert(label, target);
                        kept.push("");
                    }
                    None => kept.push(row),
                }
            }
            texts.push((line, kept.join("\n")));
        }
        for (line, text) in &texts {
            links.extend(
                inline_links(text, &definitions)
                    .into_iter()
                    .map(|(offset, target)| Link {
                        line: line + text[..offset].matches('\n').count(),
                        target,
                    }),
            );
        }
        links
    }
}

/// A fence's opening (its character and length) and info string.
fn fence_opening(line: &str) -> Option<(String, String)> {
    let trimmed = line.trim_start();
    let c = trimmed.chars().next().filter(|c| matches!(c, '`' | '~'))?;
    let length = trimmed.chars().take_while(|&other| other == c).count();
    let info = trimmed[length..].trim();
    (length >= 3 && !(c == '`' && info.contains('`'))).then(|| (trimmed[..length].to_string(), info.to_string()))
}

fn is_fence_closing(line: &str, fence: &str) -> bool {
    let trimmed = line.trim();
    let c = fence.chars().next().expect("a fence");
    trimmed.len() >= fence.len() && trimmed.chars().all(|other| other == c)
}

fn atx_heading(line: &str) -> Option<(usize, String)> {
    if line.len() - line.trim_start_matches(' ').len() > 3 {
        return None;
    }
    let trimmed = line.trim_start();
    let level = trimmed.chars().take_while(|&c| c == '#').count();
    let rest = &trimmed[level..];
    if !(1..=6).contains(&level) || !(rest.is_empty() || rest.starts_with([' ', '\t'])) {
        return None;
    }
    let text = rest.trim();
    // A closing sequence of `#` after a space is not part of the text.
    let text = match text.trim_end_matches('#') {
        stripped if stripped.is_empty() || stripped.ends_with(' ') => stripped.trim_end(),
        _ => text,
    };
    Some((level, text.to_string()))
}

fn setext_underline(line: &str) -> Option<usize> {
    if line.len() - line.trim_start_matches(' ').len() > 3 {
        return None;
    }
    let trimmed = line.trim();
    if !trimmed.is_empty() && trimmed.chars().all(|c| c == '=') {
        Some(1)
    } else if !trimmed.is_empty() && trimmed.chars().all(|c| c == '-') {
        Some(2)
    } else {
        None
    }
}

// The reader on the cases the docs hold: it must find what a broken page would hide.

#[test]
fn links_are_found_outside_code_only() {
    let doc = Doc::parse(
        "See [`bench/`](bench) and [the design](docs/design.md#the-rule \"title\"), ![x](img.png),\n\
         [ref][r], [r][], [r], `[not](a-link)`, [text](<with space.md>) and <a href=\"x.md\">.\n\
         \n```md\n[not](this)\n```\n[r]: target.md\n[broken][nowhere]\n",
    );
    let targets: Vec<String> = doc.links().into_iter().map(|link| link.target).collect();
    assert_eq!(
        targets,
        [
            "target.md",
            "bench",
            "docs/design.md#the-rule",
            "img.png",
            "target.md",
            "target.md",
            "target.md",
            "with space.md",
            "x.md",
            "[nowhere] (an undefined reference)",
        ]
    );
}
