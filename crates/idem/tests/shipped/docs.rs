//! The documentation as a reader follows it: every relative link of the README, `docs/`,
//! `deploy/`, `bench/README.md` and `examples/*/README.md` leads to a file of the repository (its
//! `#anchor` to a heading there), every `idem` flag those pages show is one that `idem <command>
//! --help` lists, and the README stays a front door of at most 300 lines.
//!
//! The markdown is read by hand (no dependency): fenced code blocks and code spans hold no links,
//! headings are slugged as GitHub slugs them, and each test fails listing every problem it found.

mod flags;
mod inline;
mod links;
mod markdown;
mod shell;

use std::path::{Path, PathBuf};

use flags::Help;
use links::{Anchors, resolve};
use markdown::Doc;

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
