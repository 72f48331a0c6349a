//! Where a link leads: a file or folder of the repository, and for an `#anchor` a heading (as
//! GitHub slugs it) or an explicit `<a id>` of the markdown file it names, or a line of another file.

use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

use super::inline::{shown_text, without_code_spans};
use super::markdown::{Block, Doc};
use crate::common::percent_decoded;

/// Checks one link's target from `page`: a file or directory of the repository, and a heading
/// (or an explicit `<a id>`/`<a name>`) of a markdown file for its `#anchor`. Links with a scheme
/// (`https:`, `mailto:`) are not followed.
pub(crate) fn resolve(root: &Path, page: &Path, target: &str, anchors: &mut Anchors) -> Result<(), String> {
    if has_scheme(target) || target.starts_with("//") {
        return Ok(());
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let path = percent_decoded(path.split_once('?').map_or(path, |(path, _)| path));
    let file = if path.is_empty() {
        page.to_path_buf()
    } else {
        let base = if path.starts_with('/') {
            Path::new("")
        } else {
            page.parent().expect("a page's folder")
        };
        normalised(&base.join(path.trim_start_matches('/'))).ok_or_else(|| "leaves the repository".to_string())?
    };
    let full = root.join(&file);
    if !full.exists() {
        return Err(format!("no such file: {}", file.display()));
    }
    let Some(anchor) = anchor else { return Ok(()) };
    if full.is_dir() {
        return Err(format!("an anchor into a folder: {}", file.display()));
    }
    if file.extension().is_some_and(|ext| ext == "md") {
        let known = anchors.of(root, &file);
        if known.contains(anchor) {
            return Ok(());
        }
        return Err(format!("no heading or anchor #{anchor} in {}", file.display()));
    }
    if is_line_anchor(anchor) {
        return Ok(());
    }
    Err(format!(
        "#{anchor} is not a line anchor (#L12, #L12-L20) of {}",
        file.display()
    ))
}

fn has_scheme(target: &str) -> bool {
    let Some((scheme, _)) = target.split_once(':') else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

fn is_line_anchor(anchor: &str) -> bool {
    let line = |part: &str| {
        part.strip_prefix('L')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    match anchor.split_once('-') {
        Some((from, to)) => line(from) && line(to),
        None => line(anchor),
    }
}

/// `path` with `.` and `..` resolved; `None` if it climbs above the root.
fn normalised(path: &Path) -> Option<PathBuf> {
    let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => parts.push(part),
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    Some(parts.iter().collect())
}

/// The anchors of each markdown file, read once.
#[derive(Debug, Default)]
pub(crate) struct Anchors(HashMap<PathBuf, BTreeSet<String>>);

impl Anchors {
    fn of(&mut self, root: &Path, file: &Path) -> &BTreeSet<String> {
        self.0
            .entry(file.to_path_buf())
            .or_insert_with(|| Doc::read(root, file).anchors())
    }
}

/// GitHub's anchor for a heading: its text as shown (code spans' content, links' text, no HTML
/// tags), lowercased, with every character but letters, digits, `-`, `_` and spaces removed and
/// each space a `-`.
fn slug(heading: &str) -> String {
    shown_text(heading)
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

impl Doc {
    /// The page's anchors: its headings' slugs (a repeated one gets `-1`, `-2`, …) and explicit
    /// `<a id>`/`<a name>` anchors.
    fn anchors(&self) -> BTreeSet<String> {
        let mut anchors = BTreeSet::new();
        let mut seen: HashMap<String, usize> = HashMap::new();
        for block in &self.blocks {
            let text = match block {
                Block::Heading { text, .. } => {
                    let slug = slug(text);
                    let count = seen.entry(slug.clone()).or_insert(0);
                    anchors.insert(if *count == 0 { slug } else { format!("{slug}-{count}") });
                    *count += 1;
                    text
                }
                Block::Text { text, .. } => text,
                Block::Code { .. } => continue,
            };
            let text = without_code_spans(text);
            for attribute in ["id=\"", "name=\""] {
                for (at, _) in text.match_indices(attribute) {
                    let tag_start = text[..at].rfind('<').map(|start| &text[start..at]);
                    if tag_start.is_some_and(|tag| tag.starts_with("<a ") && !tag.contains('>')) {
                        let value = &text[at + attribute.len()..];
                        anchors.insert(value[..value.find('"').unwrap_or(value.len())].to_string());
                    }
                }
            }
        }
        anchors
    }
}

// The reader on the cases the docs hold: it must find what a broken page would hide.

#[test]
fn slugs_are_github_s() {
    for (heading, expected) in [
        ("The demo: `idem demo`", "the-demo-idem-demo"),
        ("What a record's origin costs", "what-a-records-origin-costs"),
        (
            "idem — make HTTP requests safe to retry",
            "idem--make-http-requests-safe-to-retry",
        ),
        ("SQLite (`idem-sqlite`)", "sqlite-idem-sqlite"),
        (
            "Where each store waits, and the bound",
            "where-each-store-waits-and-the-bound",
        ),
        (
            "[Traces](operations.md#traces) and `idem_complete`",
            "traces-and-idem_complete",
        ),
    ] {
        assert_eq!(slug(heading), expected, "{heading}");
    }
    let doc = Doc::parse("# A\n\n## A\n\nA\n---\n\n```\n# not a heading\n```\n<a id=\"here\"></a>\n");
    let anchors: Vec<String> = doc.anchors().into_iter().collect();
    assert_eq!(anchors, ["a", "a-1", "a-2", "here"]);
}
