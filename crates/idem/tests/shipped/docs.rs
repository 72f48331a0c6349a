//! The documentation as a reader follows it: every relative link of the README, `docs/`,
//! `deploy/`, `bench/README.md` and `examples/*/README.md` leads to a file of the repository (its
//! `#anchor` to a heading there), every `idem` flag those pages show is one that `idem <command>
//! --help` lists, and the README stays a front door of at most 300 lines.
//!
//! The markdown is read by hand (no dependency): fenced code blocks and code spans hold no links,
//! headings are slugged as GitHub slugs them, and each test fails listing every problem it found.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use crate::common::IDEM;

/// The README's length, at most: what idem is, two commands, three ways to use it, a map.
const README_MAX_LINES: usize = 300;

#[test]
fn every_relative_link_and_anchor_resolves() {
    let root = repository();
    let mut anchors = Anchors::default();
    let mut problems = Vec::new();
    let pages = pages(&root);
    for page in &pages {
        let doc = Doc::read(&root, page);
        for link in doc.links() {
            if let Err(problem) = resolve(&root, page, &link.target, &mut anchors) {
                problems.push(format!("{}:{}: ({}) {problem}", page.display(), link.line, link.target));
            }
        }
        for (line, text) in doc.lines_outside_code() {
            if text.contains("/work/shared") || text.contains("../shared") {
                problems.push(format!(
                    "{}:{line}: points outside the repository: {text}",
                    page.display()
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} broken link(s) in {} page(s):\n{}",
        problems.len(),
        pages.len(),
        problems.join("\n")
    );
}

#[test]
fn every_idem_flag_the_docs_show_is_in_its_help() {
    let root = repository();
    let mut help = Help::default();
    let mut problems = Vec::new();
    let mut checked = 0;
    for page in pages(&root) {
        let doc = Doc::read(&root, &page);
        for shown in doc.shown_flags() {
            checked += 1;
            let where_ = format!("{}:{}", page.display(), shown.line);
            let Some(command) = &shown.command else {
                problems.push(format!(
                    "{where_}: a table of flags ({}) under no heading that names its command (`idem <command>`)",
                    shown.flag
                ));
                continue;
            };
            match help.flags(command) {
                Err(problem) => problems.push(format!("{where_}: {problem}")),
                Ok(flags) if !flags.contains(&shown.flag) => problems.push(format!(
                    "{where_}: `{}` is not a flag of `idem {command}` (its --help lists {})",
                    shown.flag,
                    flags.iter().cloned().collect::<Vec<_>>().join(" ")
                )),
                Ok(_) => {}
            }
        }
    }
    assert!(checked > 0, "no idem flag found in the docs: the parser lost them");
    assert!(
        problems.is_empty(),
        "{} of {checked} flags shown in the docs are not in `--help`:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn the_readme_is_a_front_door() {
    let readme = std::fs::read_to_string(repository().join("README.md")).expect("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move the reference into docs/"
    );
}

/// The repository's root.
fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository's root")
}

/// The pages checked, relative to the root: README.md, docs/*.md, deploy/**/*.md,
/// bench/README.md and examples/*/README.md.
fn pages(root: &Path) -> Vec<PathBuf> {
    let mut pages = vec![PathBuf::from("README.md"), PathBuf::from("bench/README.md")];
    pages.extend(markdown_in(root, Path::new("docs"), false));
    pages.extend(markdown_in(root, Path::new("deploy"), true));
    for example in sorted_entries(&root.join("examples")) {
        let readme = Path::new("examples")
            .join(example.file_name().expect("a name"))
            .join("README.md");
        if root.join(&readme).is_file() {
            pages.push(readme);
        }
    }
    pages
}

fn markdown_in(root: &Path, dir: &Path, recursive: bool) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in sorted_entries(&root.join(dir)) {
        let relative = dir.join(entry.file_name().expect("a name"));
        if entry.is_dir() && recursive {
            found.extend(markdown_in(root, &relative, true));
        } else if entry.extension().is_some_and(|ext| ext == "md") {
            found.push(relative);
        }
    }
    found
}

/// A directory's entries, sorted; none if it does not exist.
fn sorted_entries(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries.map(|entry| entry.expect("a directory entry").path()).collect();
    paths.sort();
    paths
}

// ---------------------------------------------------------------------------------------------
// Links
// ---------------------------------------------------------------------------------------------

/// Checks one link's target from `page`: a file or directory of the repository, and a heading
/// (or an explicit `<a id>`/`<a name>`) of a markdown file for its `#anchor`. Links with a scheme
/// (`https:`, `mailto:`) are not followed.
fn resolve(root: &Path, page: &Path, target: &str, anchors: &mut Anchors) -> Result<(), String> {
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

fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|hex| std::str::from_utf8(hex).ok());
        match (bytes[i], hex.and_then(|hex| u8::from_str_radix(hex, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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
struct Anchors(HashMap<PathBuf, BTreeSet<String>>);

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

/// Inline markdown as it reads: code spans' content, a link's text, no HTML tags.
fn shown_text(inline: &str) -> String {
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

// ---------------------------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------------------------

/// A flag a page shows for a command of `idem` (`serve`, or empty for `idem` itself); `None` for
/// a table of flags under no heading that names a command.
#[derive(Debug)]
struct ShownFlag {
    line: usize,
    command: Option<String>,
    flag: String,
}

/// The flags each command's `--help` lists, asked once per command.
#[derive(Debug, Default)]
struct Help(HashMap<String, Result<BTreeSet<String>, String>>);

impl Help {
    fn flags(&mut self, command: &str) -> Result<&BTreeSet<String>, String> {
        self.0
            .entry(command.to_string())
            .or_insert_with(|| help_flags(command))
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// The long and short flags `idem <command> --help` lists: the option lines of clap's help.
fn help_flags(command: &str) -> Result<BTreeSet<String>, String> {
    let mut run = Command::new(IDEM);
    if !command.is_empty() {
        run.arg(command);
    }
    let output = run
        .arg("--help")
        .output()
        .map_err(|err| format!("cannot run {IDEM}: {err}"))?;
    if !output.status.success() {
        return Err(format!(
            "`idem {command}` is not a command of idem: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let mut flags = BTreeSet::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let spec = line.trim_start();
        // Options start within the first few columns; their descriptions are indented further.
        if !spec.starts_with('-') || line.len() - spec.len() > 6 {
            continue;
        }
        let spec = spec.split("  ").next().unwrap_or_default();
        for name in spec.split(", ") {
            let name = name.split([' ', '=', '[', '<']).next().unwrap_or_default();
            if name.starts_with('-') {
                flags.insert(name.to_string());
            }
        }
    }
    Ok(flags)
}

/// The languages of code blocks that hold commands a reader types (or their output).
fn is_shell(info: &str) -> bool {
    let language = info.split([' ', ',', '{']).next().unwrap_or_default();
    matches!(
        language,
        "" | "sh" | "bash" | "shell" | "console" | "sh-session" | "text"
    )
}

/// The `idem` commands in a shell text: `idem CMD …`, `target/release/idem CMD …` and
/// `cargo run … -- CMD …`, each with the flags it is given (placeholders and quoted values are
/// not flags); flags before the command are idem's own (command ""), as in `idem --version`.
fn idem_commands(shell: &str) -> Vec<(String, Vec<String>)> {
    let mut commands = Vec::new();
    for words in simple_commands(shell) {
        let Some(args) = idem_args(&words) else { continue };
        let mut args = args.iter();
        let mut own = Vec::new();
        let mut command = None;
        for word in args.by_ref() {
            if word.quoted || word.text.starts_with('-') {
                own.extend(flag(word));
            } else {
                command = Some(word.text.clone());
                break;
            }
        }
        if !own.is_empty() {
            commands.push((String::new(), own));
        }
        // `idem <command>`, `idem CMD`, `idem …`: a placeholder, not a command.
        let Some(command) = command.filter(|command| command.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'))
        else {
            continue;
        };
        commands.push((command, args.filter_map(flag).collect()));
    }
    commands
}

/// The arguments given to `idem`, if `words` runs it.
fn idem_args(words: &[Word]) -> Option<&[Word]> {
    let program = words
        .iter()
        .position(|word| !word.quoted && !is_assignment(&word.text))?;
    let name = words[program].text.as_str();
    if name == "idem"
        || (name.ends_with("/idem") && (name.contains("target/") || name.contains("bin/") || name.starts_with("./")))
    {
        return Some(&words[program + 1..]);
    }
    if name != "cargo" || words.get(program + 1).map(|word| word.text.as_str()) != Some("run") {
        return None;
    }
    let cargo = &words[program + 2..];
    let separator = cargo.iter().position(|word| word.text == "--" && !word.quoted)?;
    let other_package = cargo[..separator].windows(2).any(|pair| {
        matches!(pair[0].text.as_str(), "-p" | "--package" | "--bin" | "--example") && pair[1].text != "idem"
    });
    (!other_package).then(|| &cargo[separator + 1..])
}

fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
    })
}

/// A word's flag: `--name` (from `--name=value` too) or `-X`, with a synopsis' brackets taken off.
fn flag(word: &Word) -> Option<String> {
    if word.quoted {
        return None;
    }
    let text = word.text.trim_start_matches(['[', '(']);
    let text = text.split(['=', ']', ')', '…']).next().unwrap_or_default();
    let text = text.trim_end_matches("...").trim_end_matches(',');
    let long = text.strip_prefix("--").is_some_and(|name| {
        name.starts_with(|c: char| c.is_ascii_alphanumeric())
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    });
    let short = text.len() == 2 && text.starts_with('-') && text.as_bytes()[1].is_ascii_alphanumeric();
    (long || short).then(|| text.to_string())
}

/// A word of a shell command; `quoted` if any of it was in quotes (a value, never a flag).
#[derive(Debug, Clone)]
struct Word {
    text: String,
    quoted: bool,
}

/// A shell text's logical lines, each with the offset of its first line: comments dropped, and
/// lines continued by `\` or by indentation (a synopsis' next line) joined.
fn logical_lines(shell: &str) -> Vec<(usize, String)> {
    let mut logical: Vec<(usize, String)> = Vec::new();
    let mut continues = false;
    for (offset, line) in shell.lines().enumerate() {
        let line = line.strip_prefix("$ ").unwrap_or(line);
        let line = without_comment(line).trim_end();
        let (line, backslash) = match line.strip_suffix('\\') {
            Some(line) => (line, true),
            None => (line, false),
        };
        let indented = line.starts_with([' ', '\t']) && !line.trim().is_empty();
        match logical.last_mut() {
            Some((_, last)) if continues || indented => {
                last.push(' ');
                last.push_str(line.trim());
            }
            _ => logical.push((offset, line.trim().to_string())),
        }
        continues = backslash;
    }
    logical
}

/// The simple commands of a shell text, as words: split at `;`, `&&`, `||`, `&` and a lone `|`
/// (a `|` inside a word is a synopsis' choice, `allow|reject`), redirections left out.
fn simple_commands(shell: &str) -> Vec<Vec<Word>> {
    let mut commands = Vec::new();
    for (_, line) in logical_lines(shell) {
        let mut words: Vec<Word> = Vec::new();
        for word in shell_words(&line) {
            let redirection =
                word.text.starts_with(['>', '<']) || word.text.starts_with("2>") || word.text.starts_with("1>");
            if !word.quoted && matches!(word.text.as_str(), ";" | "&&" | "||" | "&" | "|") {
                commands.push(std::mem::take(&mut words));
            } else if word.quoted || !redirection {
                words.push(word);
            }
        }
        commands.push(words);
    }
    commands.retain(|words| !words.is_empty());
    commands
}

/// A line without its shell comment: from a `#` that starts a word, outside quotes.
fn without_comment(line: &str) -> &str {
    let mut quote = None;
    let mut previous = ' ';
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if previous.is_whitespace() => return &line[..i],
            _ => {}
        }
        previous = c;
    }
    line
}

/// A line's words, quotes removed (a quoted part marks its word `quoted`); `;` is a word of its own.
fn shell_words(line: &str) -> Vec<Word> {
    let mut words = Vec::new();
    let mut current = Word {
        text: String::new(),
        quoted: false,
    };
    let mut quote = None;
    let mut started = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => current.text.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                current.quoted = true;
                started = true;
            }
            (None, c) if c.is_whitespace() || c == ';' => {
                if started {
                    words.push(std::mem::replace(
                        &mut current,
                        Word {
                            text: String::new(),
                            quoted: false,
                        },
                    ));
                    started = false;
                }
                if c == ';' {
                    words.push(Word {
                        text: ";".into(),
                        quoted: false,
                    });
                }
            }
            (None, c) => {
                current.text.push(c);
                started = true;
            }
        }
    }
    if started {
        words.push(current);
    }
    words
}

// ---------------------------------------------------------------------------------------------
// Markdown
// ---------------------------------------------------------------------------------------------

/// A markdown page, cut into blocks.
#[derive(Debug)]
struct Doc {
    blocks: Vec<Block>,
}

#[derive(Debug)]
enum Block {
    /// An ATX (`## …`) or setext heading.
    Heading { line: usize, level: usize, text: String },
    /// Lines up to a blank line, a heading or a fence: a paragraph, a list, a table.
    Text { line: usize, text: String },
    /// A fenced code block: its info string and its lines.
    Code { line: usize, info: String, text: String },
}

/// A link found in a page.
#[derive(Debug)]
struct Link {
    line: usize,
    target: String,
}

impl Doc {
    fn read(root: &Path, page: &Path) -> Self {
        let text =
            std::fs::read_to_string(root.join(page)).unwrap_or_else(|err| panic!("read {}: {err}", page.display()));
        Self::parse(&text)
    }

    fn parse(text: &str) -> Self {
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
    fn lines_outside_code(&self) -> Vec<(usize, &str)> {
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

    /// Every link outside code: inline links and images, reference links and their definitions,
    /// and `href`/`src` of HTML tags.
    fn links(&self) -> Vec<Link> {
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

    /// The flags the page shows: in `idem` commands of shell code blocks and of code spans, and in
    /// the first column of tables headed `flag`, for the command the nearest heading above names.
    fn shown_flags(&self) -> Vec<ShownFlag> {
        let mut shown = Vec::new();
        let mut headings: Vec<(usize, Option<String>)> = Vec::new();
        let push = |shown: &mut Vec<ShownFlag>, line: usize, shell: &str| {
            for (command, flags) in idem_commands(shell) {
                shown.extend(flags.into_iter().map(|flag| ShownFlag {
                    line,
                    command: Some(command.clone()),
                    flag,
                }));
            }
        };
        for block in &self.blocks {
            match block {
                Block::Code { line, info, text } if is_shell(info) => {
                    for (offset, logical) in logical_lines(text) {
                        push(&mut shown, line + 1 + offset, &logical);
                    }
                }
                Block::Code { .. } => {}
                Block::Heading { line, level, text } => {
                    headings.retain(|(above, _)| above < level);
                    headings.push((*level, named_command(text)));
                    for span in code_spans(text) {
                        push(&mut shown, *line, &span.content);
                    }
                }
                Block::Text { line, text } => {
                    for span in code_spans(text) {
                        push(
                            &mut shown,
                            line + text[..span.whole.start].matches('\n').count(),
                            &span.content,
                        );
                    }
                    let command = headings.iter().rev().find_map(|(_, command)| command.clone());
                    shown.extend(flag_table(text).into_iter().map(|(offset, flag)| ShownFlag {
                        line: line + offset,
                        command: command.clone(),
                        flag,
                    }));
                }
            }
        }
        shown
    }
}

/// The command a heading names in a code span, `idem serve` giving `serve`.
fn named_command(heading: &str) -> Option<String> {
    code_spans(heading).iter().find_map(|span| {
        let mut words = span.content.split_whitespace();
        (words.next() == Some("idem"))
            .then(|| words.next().map(str::to_string))
            .flatten()
    })
}

/// The flags in the first column of a table whose first header is `flag` (or `flags`), with each
/// row's line offset in `text`.
fn flag_table(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut flags = Vec::new();
    let mut i = 0;
    while i + 1 < lines.len() {
        let header = table_cells(lines[i]);
        let is_flag_table = header
            .first()
            .is_some_and(|cell| matches!(cell.trim().to_lowercase().as_str(), "flag" | "flags"))
            && is_delimiter_row(lines[i + 1]);
        if !is_flag_table {
            i += 1;
            continue;
        }
        i += 2;
        while i < lines.len() && lines[i].trim_start().starts_with('|') {
            if let Some(first) = table_cells(lines[i]).first() {
                for span in code_spans(first) {
                    let word = Word {
                        text: span.content.clone(),
                        quoted: false,
                    };
                    flags.extend(flag(&word).map(|flag| (i, flag)));
                }
            }
            i += 1;
        }
    }
    flags
}

/// A table row's cells: split at `|` outside code spans and not escaped.
fn table_cells(row: &str) -> Vec<String> {
    let row = row.trim();
    if !row.starts_with('|') {
        return Vec::new();
    }
    let spans = code_spans(row);
    let mut cells = Vec::new();
    let mut start = 1;
    for (at, _) in row.match_indices('|').skip(1) {
        let escaped = row[..at].ends_with('\\');
        let in_code = spans.iter().any(|span| span.whole.contains(&at));
        if !escaped && !in_code {
            cells.push(row[start..at].to_string());
            start = at + 1;
        }
    }
    cells
}

fn is_delimiter_row(row: &str) -> bool {
    let row = row.trim();
    row.starts_with('|') && row.contains('-') && row.chars().all(|c| matches!(c, '|' | '-' | ':' | ' '))
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

/// `[label]: target` at the start of a line; the label as it matches (case and spaces folded).
fn reference_definition(row: &str) -> Option<(String, String)> {
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
fn inline_links(text: &str, definitions: &HashMap<String, String>) -> Vec<(usize, String)> {
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
struct CodeSpan {
    whole: Range<usize>,
    content: String,
}

/// The code spans of a block's text: a run of backticks closed by a run of the same length
/// (unmatched backticks are literal); content with line ends as spaces, one surrounding space
/// taken off when both ends have one.
fn code_spans(text: &str) -> Vec<CodeSpan> {
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
fn without_code_spans(text: &str) -> String {
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

#[cfg(test)]
mod parser {
    //! The reader of markdown and shell above, on the cases the docs hold: it must find what a
    //! broken page would hide.

    use super::*;

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

    #[test]
    fn flags_are_read_from_commands_synopses_and_tables() {
        let doc = Doc::parse(
            "# The gateway\n\n## `idem serve`\n\n### Settings\n\n\
             ```\nidem serve --upstream URL [--listen ADDR]\n           [--tls-cert FILE --tls-key FILE] # --not-this\n```\n\n\
             | flag | default |\n|---|---|\n| `--ttl`, `--lease` | 1 |\n| `-X` | 2 |\n\n\
             Run `cargo run --release -p idem -- demo --seed 3` or `cargo run -p other -- --nope`;\n\
             `idem list --state=unknown` and `EXTRA=\"--quoted\" target/release/idem bench --store \"$s\" 2>/dev/null`.\n\n\
             ## Elsewhere\n\n| flag | x |\n|---|---|\n| `--orphan` | y |\n",
        );
        let shown: Vec<(Option<String>, String)> = doc
            .shown_flags()
            .into_iter()
            .map(|shown| (shown.command, shown.flag))
            .collect();
        let expected: Vec<(Option<String>, String)> = [
            (Some("serve"), "--upstream"),
            (Some("serve"), "--listen"),
            (Some("serve"), "--tls-cert"),
            (Some("serve"), "--tls-key"),
            (Some("serve"), "--ttl"),
            (Some("serve"), "--lease"),
            (Some("serve"), "-X"),
            (Some("demo"), "--seed"),
            (Some("list"), "--state"),
            (Some("bench"), "--store"),
            (None, "--orphan"),
        ]
        .into_iter()
        .map(|(command, flag)| (command.map(str::to_string), flag.to_string()))
        .collect();
        assert_eq!(shown, expected);
    }
}
