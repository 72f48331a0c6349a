//! `idem SUBCOMMAND --help` as these checks read it: the flags, with the variable and the
//! default of each, and the variables read from the environment only; and the checks of a
//! deployment's command line and variables against it.

use std::collections::{BTreeMap, BTreeSet};

use crate::common::IDEM;

/// One subcommand's `--help`: its flags by long name, with their variable and default, and the
/// variables it lists under `Environment` (those no flag has: the secrets, the logs' settings).
#[derive(Debug, Default)]
pub(crate) struct Help {
    pub(crate) flags: BTreeMap<String, Flag>,
    /// The names listed under `Environment`; one ending in `*` stands for every name it begins.
    pub(crate) env_only: BTreeSet<String>,
}

/// A flag in the help: the variable it also reads, and its default.
#[derive(Debug, Default)]
pub(crate) struct Flag {
    pub(crate) env: Option<String>,
    pub(crate) default: Option<String>,
}

impl Help {
    /// `idem SUBCOMMAND --help`, read; `None` when idem has no such subcommand.
    fn of(subcommand: &str) -> Option<Self> {
        // A variable set here would show in the help (`[env: IDEM_STORE=…]`).
        let output = std::process::Command::new(IDEM)
            .args([subcommand, "--help"])
            .env_clear()
            .output()
            .expect("run idem --help");
        output
            .status
            .success()
            .then(|| Self::parse(&String::from_utf8_lossy(&output.stdout)))
    }

    fn parse(text: &str) -> Self {
        let mut flags = BTreeMap::new();
        let mut env_only = BTreeSet::new();
        let mut current: Option<String> = None;
        let mut in_environment = false;
        for line in text.lines() {
            let trimmed = line.trim_start();
            // A section's heading (`Options:`, `Environment, …:`) or the text around the sections:
            // what follows belongs to no flag seen so far.
            if line == trimmed && !line.is_empty() {
                in_environment = line.starts_with("Environment");
                current = None;
                continue;
            }
            if in_environment {
                // A variable's line (`  IDEM_LOG`, `  A, B`); its text is indented deeper, as a flag's.
                if !trimmed.is_empty() && line.len() - trimmed.len() <= 6 {
                    env_only.extend(trimmed.split(", ").map(str::to_owned));
                }
                continue;
            }
            // An option's line (`  -h, --help`, `      --store <STORE>`); its text is indented deeper.
            if trimmed.starts_with('-') && line.len() - trimmed.len() <= 6 {
                current = trimmed.split([' ', ',']).find_map(|word| {
                    let name: String = word
                        .strip_prefix("--")?
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                        .collect();
                    (!name.is_empty()).then_some(name)
                });
                if let Some(name) = &current {
                    flags.insert(name.clone(), Flag::default());
                }
            }
            let Some(flag) = current.as_ref().and_then(|name| flags.get_mut(name)) else {
                continue;
            };
            if let Some(env) = bracketed(line, "[env: ") {
                flag.env = env.split('=').next().map(str::to_owned);
            }
            if let Some(default) = bracketed(line, "[default: ") {
                flag.default = Some(default);
            }
        }
        Self { flags, env_only }
    }

    /// Whether `name` is a variable of one of these flags, or one listed under `Environment`.
    fn reads(&self, name: &str) -> bool {
        self.flags.values().any(|flag| flag.env.as_deref() == Some(name))
            || self.env_only.iter().any(|listed| match listed.strip_suffix('*') {
                Some(prefix) => name.starts_with(prefix),
                None => listed == name,
            })
    }
}

/// The text between `open` and the next `]` on `line`.
fn bracketed(line: &str, open: &str) -> Option<String> {
    let start = line.find(open)? + open.len();
    let end = line[start..].find(']')? + start;
    Some(line[start..end].to_owned())
}

/// Each subcommand's help, read once per check.
#[derive(Debug, Default)]
pub(crate) struct Helps(BTreeMap<String, Option<Help>>);

impl Helps {
    /// `idem SUBCOMMAND --help`, read the first time it is asked for.
    pub(crate) fn of(&mut self, subcommand: &str) -> Option<&Help> {
        self.0
            .entry(subcommand.to_owned())
            .or_insert_with(|| Help::of(subcommand))
            .as_ref()
    }
}

/// The value of `--name` in `args` (`--name VALUE` or `--name=VALUE`; the last one counts).
pub(crate) fn flag_value(args: &[String], name: &str) -> Option<String> {
    let flag = format!("--{name}");
    let mut value = None;
    for (at, arg) in args.iter().enumerate() {
        if *arg == flag {
            value = args.get(at + 1).cloned();
        } else if let Some(given) = arg.strip_prefix(&format!("{flag}=")) {
            value = Some(given.to_owned());
        }
    }
    value
}

/// Checks the command line `args` (`SUBCOMMAND --flag …`): the subcommand exists, and so does
/// every flag in its help.
pub(crate) fn check_command_line(
    args: &[String],
    helps: &mut Helps,
    place: &str,
    problems: &mut Vec<String>,
) -> Option<String> {
    let Some(subcommand) = args.first() else {
        problems.push(format!("{place}: no idem subcommand given (serve, migrate, …)"));
        return None;
    };
    let Some(help) = helps.of(subcommand) else {
        problems.push(format!("{place}: `idem {subcommand}` is not a subcommand of idem"));
        return None;
    };
    for arg in &args[1..] {
        let Some(flag) = arg.strip_prefix("--") else {
            continue;
        };
        let name = flag.split('=').next().unwrap_or(flag);
        if !help.flags.contains_key(name) {
            problems.push(format!(
                "{place}: `--{name}` is not a flag of `idem {subcommand}` (see `idem {subcommand} --help`)"
            ));
        }
    }
    Some(subcommand.clone())
}

/// Checks that idem reads every `IDEM_` variable of `names` in `subcommand`: each is in its help,
/// as a flag's variable or under `Environment` (a misspelt name would be ignored in silence).
pub(crate) fn check_variables<'a>(
    names: impl IntoIterator<Item = &'a String>,
    subcommand: &str,
    helps: &mut Helps,
    place: &str,
    problems: &mut Vec<String>,
) {
    let Some(help) = helps.of(subcommand) else {
        return;
    };
    for name in names.into_iter().filter(|name| name.starts_with("IDEM_")) {
        if !help.reads(name) {
            problems.push(format!(
                "{place}: idem {subcommand} does not read {name}: `idem {subcommand} --help` lists it neither as a \
                 flag's variable nor under Environment (it lists {:?} there)",
                help.env_only
            ));
        }
    }
}

// The reader on help as clap writes it, with the section idem adds after the flags.
#[test]
fn a_help_s_flags_and_its_environment_section_are_read_apart() {
    let help = Help::parse(
        "Run the gateway\n\nUsage: idem serve [OPTIONS]\n\nOptions:\n      --store <STORE>\n          The store \
         [default: sqlite://idem.db] [env: IDEM_STORE=]\n  -h, --help\n          Print help\n\n\
         Environment, read there only:\n  IDEM_SCOPE_SECRET\n          A secret [env: IDEM_NOT_A_FLAG=]\n  \
         OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_*\n          Traces [default: none]\n",
    );
    assert_eq!(help.flags.keys().collect::<Vec<_>>(), ["help", "store"]);
    let store = &help.flags["store"];
    assert_eq!(
        (store.env.as_deref(), store.default.as_deref()),
        (Some("IDEM_STORE"), Some("sqlite://idem.db"))
    );
    let after_the_flags = &help.flags["help"];
    assert_eq!((&after_the_flags.env, &after_the_flags.default), (&None, &None));
    for (name, read) in [
        ("IDEM_STORE", true),
        ("IDEM_SCOPE_SECRET", true),
        ("OTEL_SERVICE_NAME", true),
        ("IDEM_SCOPE", false),
        ("IDEM_NOT_A_FLAG", false),
        ("IDEM_LOG", false),
    ] {
        assert_eq!(help.reads(name), read, "{name}");
    }
}
