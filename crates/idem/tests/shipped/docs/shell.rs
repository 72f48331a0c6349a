//! The shell a page shows a reader typing, read by hand: logical lines, simple commands, words
//! and quotes, and among them the `idem` commands with the flags they are given.

/// The languages of code blocks that hold commands a reader types (or their output).
pub(crate) fn is_shell(info: &str) -> bool {
    let language = info.split([' ', ',', '{']).next().unwrap_or_default();
    matches!(
        language,
        "" | "sh" | "bash" | "shell" | "console" | "sh-session" | "text"
    )
}

/// The `idem` commands in a shell text: `idem CMD …`, `target/release/idem CMD …` and
/// `cargo run … -- CMD …`, each with the flags it is given (placeholders and quoted values are
/// not flags); flags before the command are idem's own (command ""), as in `idem --version`.
pub(crate) fn idem_commands(shell: &str) -> Vec<(String, Vec<String>)> {
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
pub(crate) fn flag(word: &Word) -> Option<String> {
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
pub(crate) struct Word {
    pub(crate) text: String,
    pub(crate) quoted: bool,
}

/// A shell text's logical lines, each with the offset of its first line: comments dropped, and
/// lines continued by `\` or by indentation (a synopsis' next line) joined.
pub(crate) fn logical_lines(shell: &str) -> Vec<(usize, String)> {
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
