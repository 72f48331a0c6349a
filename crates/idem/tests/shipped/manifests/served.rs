//! One `idem serve` as a deployment declares it (its arguments, its variables, its config file),
//! and what is checked by running it: it starts and applies its settings, it refuses the secrets
//! shipped as placeholders, and it is given longer to stop than `--shutdown-grace`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;

use super::help::{Help, flag_value};
use crate::common::{Gateway, IDEM, Upstream, client, config_file, describe, new_key, send, store_url_in};

/// The secrets `idem serve` reads (from the environment only: its help lists them under
/// `Environment`), each with the value the test runs the shipped settings with. The value shipped
/// for each (in a Secret, in an env file) must be one idem refuses at start naming the variable,
/// so that a copy left unedited never runs with a secret everyone can read here; the refusal
/// also shows that idem reads the variable by that name.
const SECRETS: [(&str, &str); 2] = [
    ("IDEM_SCOPE_SECRET", "the manifests test's scope secret"),
    (
        "IDEM_ENCRYPTION_KEYS",
        "test:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
    ),
];

/// Settings the test gives `idem serve` itself (the helper's flags, which beat the environment):
/// a shipped value for these is not used by the test's run.
const GIVEN_BY_THE_TEST: [&str; 4] = ["IDEM_UPSTREAM", "IDEM_LISTEN", "IDEM_ADMIN_LISTEN", "IDEM_STORE"];

/// A variable as a deployment sets it.
#[derive(Debug, Clone)]
pub(crate) struct Env {
    /// Its value, when the test can read it (a literal, a Secret's `stringData`).
    pub(crate) value: Option<String>,
    /// Whether it comes from a Secret: not a place for settings the test must read.
    pub(crate) secret: bool,
}

/// One `idem serve` as a deployment starts it.
#[derive(Debug)]
pub(crate) struct Served {
    /// Where it is declared, for messages.
    pub(crate) place: String,
    /// The arguments after `serve`.
    pub(crate) args: Vec<String>,
    pub(crate) env: BTreeMap<String, Env>,
    /// The config file's text (a ConfigMap's key, the file beside the unit).
    pub(crate) config: Option<String>,
}

impl Served {
    /// `idem serve` as declared at `place`, run with `args` (`serve` first) and `env`; its config
    /// file is the one `--config` names, else `IDEM_CONFIG`, read by `read` from where the
    /// deployment installs it.
    pub(crate) fn new(
        place: String,
        args: &[String],
        env: BTreeMap<String, Env>,
        read: impl FnOnce(&str) -> Option<String>,
    ) -> Self {
        let config = flag_value(args, "config")
            .or_else(|| env.get("IDEM_CONFIG").and_then(|config| config.value.clone()))
            .and_then(|path| read(&path));
        Self {
            place,
            args: args[1..].to_vec(),
            env,
            config,
        }
    }

    fn config_table(&self) -> Result<Option<toml::Table>, String> {
        self.config
            .as_deref()
            .map(|text| toml::from_str(text).map_err(|err| format!("its config file is not TOML: {err}")))
            .transpose()
    }

    /// The value `idem serve` runs with for `--flag`: the flag's, else its variable's, else the
    /// config file's, else its default, as `idem serve --help` lists them.
    pub(crate) fn setting(&self, flag: &str, help: &Help) -> Result<String, String> {
        if let Some(value) = flag_value(&self.args, flag) {
            return Ok(value);
        }
        let declared = help.flags.get(flag).ok_or(format!("idem serve has no --{flag}"))?;
        if let Some(env) = declared.env.as_ref().and_then(|var| self.env.get(var)) {
            if env.secret {
                return Err(format!("--{flag} comes from a Secret, where this test cannot read it"));
            }
            return env
                .value
                .clone()
                .ok_or(format!("the test cannot read the value of --{flag}"));
        }
        if let Some(value) = self.config_table()?.and_then(|table| table.get(flag).cloned()) {
            return Ok(match value {
                toml::Value::String(text) => text,
                toml::Value::Integer(number) => number.to_string(),
                toml::Value::Boolean(yes) => yes.to_string(),
                other => {
                    return Err(format!(
                        "the config file's {flag} is not a string, number or boolean: {other:?}"
                    ));
                }
            });
        }
        declared
            .default
            .clone()
            .ok_or(format!("--{flag} is given nowhere and has no default"))
    }

    fn duration(&self, flag: &str, help: &Help) -> Result<Duration, String> {
        let text = self.setting(flag, help)?;
        humantime::parse_duration(&text).map_err(|err| format!("--{flag} {text:?} is not a duration: {err}"))
    }

    /// The address `idem serve` listens on for `--flag` (`listen`, `admin-listen`).
    pub(crate) fn address(&self, flag: &str, help: &Help) -> Result<SocketAddr, String> {
        let text = self.setting(flag, help)?;
        text.parse()
            .map_err(|err| format!("--{flag} {text:?} is not an address: {err}"))
    }

    /// The paths of the config file's `[[route]]` tables that require a key.
    fn routes_requiring_a_key(&self) -> Vec<String> {
        let Ok(Some(table)) = self.config_table() else {
            return Vec::new();
        };
        let routes = table
            .get("route")
            .and_then(toml::Value::as_array)
            .cloned()
            .unwrap_or_default();
        routes
            .iter()
            .filter(|route| route.get("missing-key").and_then(toml::Value::as_str) == Some("require"))
            .filter_map(|route| route.get("path").and_then(toml::Value::as_str).map(str::to_owned))
            .collect()
    }
}

/// A path that `pattern` (`/exact`, `/with/{param}`, `/prefix/*`) matches.
fn path_under(pattern: &str) -> String {
    let segments: Vec<&str> = pattern
        .split('/')
        .map(|segment| {
            if segment == "*" || segment.starts_with('{') {
                "1"
            } else {
                segment
            }
        })
        .collect();
    segments.join("/")
}

/// Starts `served` as shipped, but for the upstream, the store and the ports (the test's own,
/// given as flags, which beat the environment and the file) and for the secrets (test values):
/// it must start, be ready, protect a keyed POST (one run, then a replay) and apply its file's
/// routes that require a key; with `IDEM_LOG_FORMAT=json` every log line is a JSON object.
pub(crate) async fn starts_and_applies_its_settings(served: &Served) {
    let place = &served.place;
    // Says which deployment, should the start below fail.
    eprintln!("{place}: idem serve with its settings");
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let mut args: Vec<String> = served.args.clone();
    let _config_dir = served.config.as_ref().map(|text| {
        let (guard, path) = config_file(text);
        match args.iter().position(|arg| arg == "--config") {
            Some(at) => args[at + 1] = path.display().to_string(),
            None => args.extend(["--config".to_owned(), path.display().to_string()]),
        }
        guard
    });
    let mut command = Command::new(IDEM);
    for (name, env) in &served.env {
        if GIVEN_BY_THE_TEST.contains(&name.as_str()) || name == "IDEM_CONFIG" {
            continue;
        }
        let value = match SECRETS.iter().find(|(secret, _)| *secret == name.as_str()) {
            Some((_, value)) => (*value).to_owned(),
            None => {
                assert!(
                    !env.secret,
                    "{place}: {name} comes from a Secret: give the test a value for it (SECRETS)"
                );
                env.value
                    .clone()
                    .unwrap_or_else(|| panic!("{place}: the test cannot read {name}'s value"))
            }
        };
        command.env(name, value);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gateway = Gateway::start_command_on_store(command, &upstream.url(), &store_url_in(dir.path()), &args).await;

    for (path, answer) in [("/readyz", "ready\n"), ("/healthz", "ok\n")] {
        let reply = send(client().get(format!("{}{path}", gateway.admin))).await;
        assert_eq!(
            (reply.status, reply.text().as_str()),
            (200, answer),
            "{place}: GET {path}: {reply}"
        );
    }
    let key = new_key();
    let first = gateway.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
    assert_eq!(
        (first.status, first.replayed()),
        (201, false),
        "{place}: a new key runs: {first}"
    );
    let copy = gateway.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
    assert_eq!(
        (copy.status, copy.replayed()),
        (201, true),
        "{place}: its copy is a replay: {copy}"
    );
    assert_eq!(
        crate::common::count(&upstream.state.pay),
        1,
        "{place}: the upstream ran the key once"
    );
    for route in served.routes_requiring_a_key() {
        let path = path_under(&route);
        let reply = gateway.post_json(&path, None, r#"{"amount":1}"#).await;
        reply.assert_problem(400, "key-missing");
    }
    if let Some(format) = served.env.get("IDEM_LOG_FORMAT") {
        assert_eq!(
            format.value.as_deref(),
            Some("json"),
            "{place}: IDEM_LOG_FORMAT's one value is json"
        );
        let stderr = gateway.stderr();
        let lines: Vec<&str> = stderr.lines().filter(|line| !line.trim().is_empty()).collect();
        assert!(!lines.is_empty(), "{place}: idem serve logged nothing");
        for line in lines {
            let parsed: Result<serde_json::Map<String, Value>, _> = serde_json::from_str(line);
            assert!(
                parsed.is_ok(),
                "{place}: IDEM_LOG_FORMAT=json, yet a log line is not a JSON object: {line}"
            );
        }
    }
}

/// Every secret `served` is shipped with is one idem refuses at start, naming its variable: a
/// copy left unedited never runs with a secret published here (and the refusal shows that idem
/// reads the variable by that name).
pub(crate) async fn refuses_its_shipped_secrets(served: &Served, problems: &mut Vec<String>) {
    let place = &served.place;
    for (name, _) in SECRETS {
        let Some(env) = served.env.get(name) else {
            continue;
        };
        let Some(shipped) = &env.value else {
            problems.push(format!("{place}: the test cannot read the value shipped for {name}"));
            continue;
        };
        let Some(config) = &served.config else {
            problems.push(format!("{place}: no config file to start idem serve with"));
            continue;
        };
        let (_dir, path) = config_file(config);
        let path = path.display().to_string();
        let mut env: Vec<(&str, &str)> = SECRETS.into_iter().filter(|(secret, _)| *secret != name).collect();
        env.push((name, shipped.as_str()));
        let dir = tempfile::tempdir().expect("a temp dir");
        let mut serve = Command::new(IDEM);
        serve
            .args(["serve", "--upstream", "http://127.0.0.1:9", "--config", &path])
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--store", &store_url_in(dir.path())])
            .envs(env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let output = tokio::time::timeout(Duration::from_secs(30), serve.output())
            .await
            .map(|output| output.expect("run idem serve"));
        match output {
            Ok(output) if output.status.code() == Some(2) && String::from_utf8_lossy(&output.stderr).contains(name) => {
            }
            Ok(output) => problems.push(format!(
                "{place}: started with the shipped {name}, idem serve should refuse it (exit 2, naming it): {}",
                describe(&output)
            )),
            Err(_) => problems.push(format!(
                "{place}: idem serve runs with the shipped {name}: ship a value idem refuses, so that a copy left \
                 unedited never runs with a secret published here"
            )),
        }
    }
}

/// The stop timeout (the pod's grace, systemd's TimeoutStopSec) outlasts what comes before the
/// SIGTERM (a preStop) plus the `--shutdown-grace` that `served` runs with.
pub(crate) fn check_grace(
    served: &Served,
    help: &Help,
    stop_timeout: Duration,
    before_sigterm: Duration,
    problems: &mut Vec<String>,
) {
    match served.duration("shutdown-grace", help) {
        Ok(grace) if stop_timeout > before_sigterm + grace => {}
        Ok(grace) => {
            let before = if before_sigterm.is_zero() {
                String::new()
            } else {
                format!("the preStop's {} plus ", humantime::format_duration(before_sigterm))
            };
            problems.push(format!(
                "{}: the stop timeout ({}) must be longer than {before}--shutdown-grace ({}), or the answers being \
                 stored when it ends are cut off (their keys run again, marked recovered)",
                served.place,
                humantime::format_duration(stop_timeout),
                humantime::format_duration(grace)
            ))
        }
        Err(err) => problems.push(format!("{}: {err}", served.place)),
    }
}
