//! The systemd unit (`deploy/systemd/`): `systemd-analyze verify` and `security` accept it, it
//! stops idem with SIGTERM and gives it longer than `--shutdown-grace`, and it starts an idem
//! that applies the environment file and config file shipped beside it.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use super::help::{Helps, check_command_line, check_variables};
use super::served::{Env, Served, check_grace, refuses_its_shipped_secrets, starts_and_applies_its_settings};
use super::{INSTALL, shown, workspace};
use crate::common::{IDEM, describe};

/// The exposure `systemd-analyze security` may give the unit at most (0 to 10; 1.1 as shipped).
const MOST_EXPOSURE: &str = "2.0";

/// A unit file's `Key=value` lines, by section, in order (continued lines joined).
fn unit_entries(text: &str) -> Vec<(String, String, String)> {
    let mut entries = Vec::new();
    let mut section = String::new();
    let mut pending = String::new();
    for line in text.lines() {
        let line = line.trim();
        if pending.is_empty() && (line.is_empty() || line.starts_with('#') || line.starts_with(';')) {
            continue;
        }
        if let Some(continued) = line.strip_suffix('\\') {
            pending.push_str(continued);
            pending.push(' ');
            continue;
        }
        let line = std::mem::take(&mut pending) + line;
        if let Some(name) = line.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')) {
            section = name.to_owned();
        } else if let Some((key, value)) = line.split_once('=') {
            entries.push((section.clone(), key.trim().to_owned(), value.trim().to_owned()));
        }
    }
    entries
}

/// An environment file's variables (`NAME=value`, optionally quoted).
fn env_file(text: &str) -> BTreeMap<String, Env> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#') && !line.starts_with(';'))
        .filter_map(|line| line.split_once('='))
        .map(|(name, value)| {
            let value = value.trim();
            let unquoted = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
                .unwrap_or(value);
            (
                name.trim().to_owned(),
                Env {
                    value: Some(unquoted.to_owned()),
                    secret: false,
                },
            )
        })
        .collect()
}

/// A file the unit names (`/etc/idem/idem.toml`), as shipped beside it (`deploy/systemd/idem.toml`).
fn beside_the_unit(path: &str, place: &str, problems: &mut Vec<String>) -> Option<String> {
    let name = Path::new(path).file_name()?;
    let shipped = workspace().join("deploy/systemd").join(name);
    match std::fs::read_to_string(&shipped) {
        Ok(text) => Some(text),
        Err(err) => {
            problems.push(format!(
                "{place}: {path} is to be installed from {}, which cannot be read: {err}",
                shown(&shipped)
            ));
            None
        }
    }
}

/// `systemd-analyze COMMAND` on the unit at `path`.
fn systemd_analyze(args: &[&str], path: &Path) -> std::process::Output {
    std::process::Command::new("systemd-analyze")
        .args(args)
        .arg(path)
        .output()
        .unwrap_or_else(|err| panic!("systemd-analyze ({err}): {INSTALL}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_systemd_unit_runs_idem_as_it_reads_it() {
    let unit_path = workspace().join("deploy/systemd/idem.service");
    let text = std::fs::read_to_string(&unit_path).expect("deploy/systemd/idem.service");
    let place = shown(&unit_path);
    let entries = unit_entries(&text);
    let service = |key: &str| -> Vec<&str> {
        entries
            .iter()
            .filter(|(section, name, _)| section == "Service" && name == key)
            .map(|(_, _, value)| value.as_str())
            .collect()
    };
    let mut problems = Vec::new();
    let mut helps = Helps::default();

    let exec_start = service("ExecStart");
    let [exec_start] = exec_start[..] else {
        panic!("{place}: one ExecStart, got {exec_start:?}");
    };
    assert!(
        !exec_start.contains(['"', '\'']),
        "{place}: the test splits ExecStart on spaces; it has quotes: {exec_start}"
    );
    let mut words = exec_start.split_whitespace().map(str::to_owned);
    let program = words
        .next()
        .expect("a program")
        .trim_start_matches(['-', '@', '+', '!', ':'])
        .to_owned();
    assert!(
        program.starts_with('/') && program.ends_with("/idem"),
        "{place}: ExecStart runs idem by its absolute path, not {program}"
    );
    let args: Vec<String> = words.collect();
    let subcommand = check_command_line(&args, &mut helps, &place, &mut problems);
    assert_eq!(
        subcommand.as_deref(),
        Some("serve"),
        "{place}: the unit runs idem serve: {problems:?}"
    );

    let mut env = BTreeMap::new();
    for file in service("EnvironmentFile") {
        let file = file.trim_start_matches('-');
        if let Some(text) = beside_the_unit(file, &place, &mut problems) {
            env.extend(env_file(&text));
        }
    }
    for assignments in service("Environment") {
        env.extend(env_file(&assignments.split_whitespace().collect::<Vec<_>>().join("\n")));
    }
    check_variables(env.keys(), "serve", &mut helps, &place, &mut problems);
    let served = Served::new(place.clone(), &args, env, |path| {
        beside_the_unit(path, &place, &mut problems)
    });

    if service("KillSignal") != ["SIGTERM"] {
        problems.push(format!(
            "{place}: KillSignal=SIGTERM, the signal on which idem finishes what runs"
        ));
    }
    let stop = service("TimeoutStopSec")
        .last()
        .or(service("TimeoutSec").last())
        .map(|v| v.to_string());
    match stop.as_deref().map(|value| {
        value
            .parse::<u64>()
            .map(Duration::from_secs)
            .or_else(|_| humantime::parse_duration(value))
    }) {
        Some(Ok(timeout)) => check_grace(
            &served,
            helps.of("serve").expect("idem serve's help"),
            timeout,
            Duration::ZERO,
            &mut problems,
        ),
        other => problems.push(format!(
            "{place}: TimeoutStopSec must be a time longer than --shutdown-grace: {other:?}"
        )),
    }

    // systemd checks the unit as shipped, but for the binary's path, which is this test's idem
    // (systemd-analyze verify refuses a program that does not exist).
    let dir = tempfile::tempdir().expect("a temp dir");
    let copy = dir.path().join("idem.service");
    std::fs::write(&copy, text.replace(&program, IDEM)).expect("write the unit's copy");
    let verified = systemd_analyze(&["verify"], &copy);
    if !verified.status.success() || !verified.stdout.is_empty() || !verified.stderr.is_empty() {
        problems.push(format!("{place}: systemd-analyze verify: {}", describe(&verified)));
    }
    let threshold = format!("--threshold={}", MOST_EXPOSURE.replace('.', ""));
    let security = systemd_analyze(&["security", "--offline=yes", &threshold], &copy);
    if !security.status.success() {
        problems.push(format!(
            "{place}: systemd-analyze security rates the unit's exposure above {MOST_EXPOSURE}: {}",
            describe(&security)
        ));
    }
    assert!(problems.is_empty(), "the systemd unit:\n- {}", problems.join("\n- "));
    starts_and_applies_its_settings(&served).await;
    refuses_its_shipped_secrets(&served, &mut problems).await;
    assert!(
        problems.is_empty(),
        "the systemd unit's environment file:\n- {}",
        problems.join("\n- ")
    );
}
