//! The `idem` flags a page shows (in shell code, in code spans, in tables of flags under a
//! heading that names the command) and the flags each command's `--help` lists.

use std::collections::{BTreeSet, HashMap};
use std::process::Command;

use super::inline::code_spans;
use super::markdown::{Block, Doc};
use super::shell::{Word, flag, idem_commands, is_shell, logical_lines};
use crate::common::IDEM;

/// A flag a page shows for a command of `idem` (`serve`, or empty for `idem` itself); `None` for
/// a table of flags under no heading that names a command.
#[derive(Debug)]
pub(crate) struct ShownFlag {
    pub(crate) line: usize,
    pub(crate) command: Option<String>,
    pub(crate) flag: String,
}

/// The flags each command's `--help` lists, asked once per command.
#[derive(Debug, Default)]
pub(crate) struct Help(HashMap<String, Result<BTreeSet<String>, String>>);

impl Help {
    /// The flags `idem <command> --help` lists (`""`: idem's own), or why they cannot be known.
    pub(crate) fn flags(&mut self, command: &str) -> Result<&BTreeSet<String>, String> {
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

impl Doc {
    /// The flags the page shows: in `idem` commands of shell code blocks and of code spans, and in
    /// the first column of tables headed `flag`, for the command the nearest heading above names.
    pub(crate) fn shown_flags(&self) -> Vec<ShownFlag> {
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

// The reader on the cases the docs hold: it must find what a broken page would hide.

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
