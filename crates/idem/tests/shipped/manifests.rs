//! The deployments users copy: the Kubernetes manifests (`deploy/kubernetes/`) and the systemd
//! unit (`deploy/systemd/`). Each is read as its system reads it (the Kubernetes API's schema,
//! offline, with kubernetes-validate; `systemd-analyze`) and checked against the `idem` it runs:
//! what a schema cannot see is whether a flag or an `IDEM_` variable is one idem reads, whether
//! the probes reach the admin listener, whether the grace outlasts `--shutdown-grace`, and
//! whether the config file starts a gateway that applies it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;

use crate::common::{Gateway, IDEM, Upstream, client, config_file, describe, new_key, send, store_url_in};

/// The Kubernetes versions whose API schema the manifests must pass: the oldest they need (1.30,
/// for the preStop `sleep` action) and the newest that kubernetes-validate 1.37.0 carries.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];

/// How to install what these checks run.
const INSTALL: &str = "bash .ci/services installs it (kubernetes-validate: python3 -m pip install \
                       kubernetes-validate==1.37.0, which brings PyYAML; systemd-analyze: apt-get install systemd)";

/// The `IDEM_` variables `idem serve` reads besides its flags' (which `--help` lists), and how
/// this test shows that idem reads each one, since a misspelt name would be ignored in silence.
const SERVE_ENV_ONLY: [(&str, EnvProof); 3] = [
    ("IDEM_SCOPE_SECRET", EnvProof::RefusesTheShippedValue),
    ("IDEM_ENCRYPTION_KEYS", EnvProof::RefusesTheShippedValue),
    ("IDEM_LOG_FORMAT", EnvProof::JsonLogs),
];

/// How a variable that `--help` does not list is shown to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EnvProof {
    /// A secret: the value shipped in the example (a Secret, an env file) must be one idem
    /// refuses at start naming the variable, so that a copy left unedited never runs with a
    /// secret everyone can read here.
    RefusesTheShippedValue,
    /// `json`: the gateway's log lines are JSON objects.
    JsonLogs,
}

/// The secrets the test runs the shipped settings with, in place of the refused examples.
const TEST_SECRETS: [(&str, &str); 2] = [
    ("IDEM_SCOPE_SECRET", "the manifests test's scope secret"),
    (
        "IDEM_ENCRYPTION_KEYS",
        "test:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
    ),
];

/// Settings the test gives `idem serve` itself (the helper's flags, which beat the environment):
/// a shipped value for these is not used by the test's run.
const GIVEN_BY_THE_TEST: [&str; 4] = ["IDEM_UPSTREAM", "IDEM_LISTEN", "IDEM_ADMIN_LISTEN", "IDEM_STORE"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `path` relative to the workspace, for messages.
fn shown(path: &Path) -> String {
    path.strip_prefix(workspace()).unwrap_or(path).display().to_string()
}

// ---------------------------------------------------------------------------------------------
// idem's help: the flags and variables it reads
// ---------------------------------------------------------------------------------------------

/// One subcommand's `--help`: its flags by long name, with their variable and default.
#[derive(Debug, Default)]
struct Help {
    flags: BTreeMap<String, Flag>,
}

#[derive(Debug, Default)]
struct Flag {
    env: Option<String>,
    default: Option<String>,
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
        let mut current: Option<String> = None;
        for line in text.lines() {
            let trimmed = line.trim_start();
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
        Self { flags }
    }

    /// Whether `name` is a variable of one of these flags.
    fn reads(&self, name: &str) -> bool {
        self.flags.values().any(|flag| flag.env.as_deref() == Some(name))
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
struct Helps(BTreeMap<String, Option<Help>>);

impl Helps {
    /// `idem SUBCOMMAND --help`, read the first time it is asked for.
    fn of(&mut self, subcommand: &str) -> Option<&Help> {
        self.0
            .entry(subcommand.to_owned())
            .or_insert_with(|| Help::of(subcommand))
            .as_ref()
    }
}

/// The value of `--name` in `args` (`--name VALUE` or `--name=VALUE`; the last one counts).
fn flag_value(args: &[String], name: &str) -> Option<String> {
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
fn check_command_line(args: &[String], helps: &mut Helps, place: &str, problems: &mut Vec<String>) -> Option<String> {
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

/// Checks that idem reads every `IDEM_` variable of `env` in `subcommand`.
fn check_variables<'a>(
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
        let env_only = subcommand == "serve" && SERVE_ENV_ONLY.iter().any(|(known, _)| known == name);
        if !help.reads(name) && !env_only {
            problems.push(format!(
                "{place}: idem {subcommand} does not read {name}: it is not in `idem {subcommand} --help`, nor one \
                 of the variables it reads besides its flags ({:?})",
                SERVE_ENV_ONLY.map(|(name, _)| name)
            ));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One `idem serve` as a deployment starts it
// ---------------------------------------------------------------------------------------------

/// A variable as a deployment sets it.
#[derive(Debug, Clone)]
struct Env {
    /// Its value, when the test can read it (a literal, a Secret's `stringData`).
    value: Option<String>,
    /// Whether it comes from a Secret: not a place for settings the test must read.
    secret: bool,
}

/// One `idem serve` as a deployment starts it.
#[derive(Debug)]
struct Served {
    /// Where it is declared, for messages.
    place: String,
    /// The arguments after `serve`.
    args: Vec<String>,
    env: BTreeMap<String, Env>,
    /// The config file's text (a ConfigMap's key, the file beside the unit).
    config: Option<String>,
}

impl Served {
    fn config_table(&self) -> Result<Option<toml::Table>, String> {
        self.config
            .as_deref()
            .map(|text| toml::from_str(text).map_err(|err| format!("its config file is not TOML: {err}")))
            .transpose()
    }

    /// The value `idem serve` runs with for `--flag`: the flag's, else its variable's, else the
    /// config file's, else its default, as `idem serve --help` lists them.
    fn setting(&self, flag: &str, help: &Help) -> Result<String, String> {
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

    fn address(&self, flag: &str, help: &Help) -> Result<SocketAddr, String> {
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
async fn starts_and_applies_its_settings(served: &Served) {
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
        let value = match TEST_SECRETS.iter().find(|(secret, _)| *secret == name.as_str()) {
            Some((_, value)) => (*value).to_owned(),
            None => {
                assert!(
                    !env.secret,
                    "{place}: {name} comes from a Secret: give the test a value for it (TEST_SECRETS)"
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
async fn refuses_its_shipped_secrets(served: &Served, problems: &mut Vec<String>) {
    let place = &served.place;
    for (name, _) in SERVE_ENV_ONLY
        .iter()
        .filter(|(_, proof)| *proof == EnvProof::RefusesTheShippedValue)
    {
        let Some(env) = served.env.get(*name) else {
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
        let mut env: Vec<(&str, &str)> = TEST_SECRETS
            .iter()
            .filter(|(secret, _)| secret != name)
            .copied()
            .collect();
        env.push((*name, shipped.as_str()));
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
fn check_grace(
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

// ---------------------------------------------------------------------------------------------
// Kubernetes
// ---------------------------------------------------------------------------------------------

/// Reads YAML files' documents as JSON, one list per file, refusing duplicate keys (which YAML
/// loaders, and so kubectl, resolve silently by keeping the last one). One python3 for them all.
fn yaml_documents(paths: &[PathBuf]) -> Vec<Vec<Value>> {
    const TO_JSON: &str = r#"
import json, sys, yaml

class Strict(yaml.SafeLoader):
    pass

def mapping(loader, node):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, "duplicate key %r" % (key,), key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)

Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
files = []
for path in sys.argv[1:]:
    with open(path) as f:
        files.append([d for d in yaml.load_all(f, Loader=Strict) if d is not None])
print(json.dumps(files))
"#;
    let output = std::process::Command::new("python3")
        .current_dir(workspace())
        .args(["-c", TO_JSON])
        .args(paths.iter().map(|path| shown(path)))
        .output()
        .unwrap_or_else(|err| panic!("python3 with PyYAML reads the manifests ({err}): {INSTALL}"));
    assert!(
        output.status.success(),
        "a manifest is not YAML that Kubernetes reads as written (or python3 has no PyYAML: {INSTALL}):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("python's JSON")
}

/// Every manifest under `deploy/kubernetes`, by folder (each folder is applied on its own).
fn manifests() -> BTreeMap<PathBuf, Vec<(PathBuf, Value)>> {
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read the folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|ext| ext == "yaml" || ext == "yml") {
                found.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&workspace().join("deploy/kubernetes"), &mut files);
    let mut folders: BTreeMap<PathBuf, Vec<(PathBuf, Value)>> = BTreeMap::new();
    for (file, docs) in files.iter().zip(yaml_documents(&files)) {
        let folder = folders.entry(file.parent().expect("a folder").to_owned()).or_default();
        folder.extend(docs.into_iter().map(|doc| (file.clone(), doc)));
    }
    folders
}

/// The labels and spec of a workload's pods, if the document is a workload.
fn pod_template(doc: &Value) -> Option<(&Value, &Value)> {
    let template = match doc["kind"].as_str()? {
        "Pod" => return Some((&doc["metadata"]["labels"], &doc["spec"])),
        "CronJob" => &doc["spec"]["jobTemplate"]["spec"]["template"],
        _ => doc["spec"].get("template")?,
    };
    Some((&template["metadata"]["labels"], &template["spec"]))
}

/// The tag of an image of idem (`REGISTRY/…/idem:TAG`); `None` for another image.
fn idem_image_tag(image: &str) -> Option<&str> {
    let name = image.rsplit('/').next()?;
    match name.split_once(':') {
        Some(("idem", tag)) => Some(tag),
        _ => None,
    }
}

/// The object of `kind` named `name` in a folder.
fn object<'a>(docs: &'a [(PathBuf, Value)], kind: &str, name: &str) -> Option<&'a Value> {
    docs.iter()
        .map(|(_, doc)| doc)
        .find(|doc| doc["kind"] == kind && doc["metadata"]["name"] == name)
}

/// A container's port, by number or by the name of one of its ports.
fn container_port(container: &Value, port: &Value) -> Option<u64> {
    match port {
        Value::Number(number) => number.as_u64(),
        Value::String(name) => container["ports"]
            .as_array()?
            .iter()
            .find(|declared| declared["name"] == name.as_str())
            .and_then(|declared| declared["containerPort"].as_u64()),
        _ => None,
    }
}

/// A container's variables, each resolved as far as the folder's Secrets and ConfigMaps allow;
/// a reference to a Secret or a key that the folder lacks is a problem.
fn container_env(
    container: &Value,
    docs: &[(PathBuf, Value)],
    place: &str,
    problems: &mut Vec<String>,
) -> BTreeMap<String, Env> {
    if !container["envFrom"].is_null() {
        problems.push(format!(
            "{place}: envFrom hides which variables the container gets: name each one under env"
        ));
    }
    let mut env = BTreeMap::new();
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().unwrap_or_default().to_owned();
        let from = &var["valueFrom"];
        let resolved = if let Some(value) = var["value"].as_str() {
            Env {
                value: Some(value.to_owned()),
                secret: false,
            }
        } else if let Some((kind, reference, field)) = [
            ("Secret", &from["secretKeyRef"], "stringData"),
            ("ConfigMap", &from["configMapKeyRef"], "data"),
        ]
        .into_iter()
        .find(|(_, reference, _)| !reference.is_null())
        {
            let (object_name, key) = (
                reference["name"].as_str().unwrap_or_default(),
                reference["key"].as_str().unwrap_or_default(),
            );
            let value = match object(docs, kind, object_name) {
                None => {
                    problems.push(format!(
                        "{place}: {name} reads {kind} {object_name:?}, which this folder does not declare"
                    ));
                    None
                }
                Some(found) => {
                    let value = found[field][key].as_str().map(str::to_owned);
                    let declared = value.is_some() || !found["data"][key].is_null();
                    if !declared {
                        problems.push(format!(
                            "{place}: {name} reads key {key:?} of {kind} {object_name:?}, which has no such key"
                        ));
                    } else if value.is_none() {
                        problems.push(format!(
                            "{place}: {name}: give {kind} {object_name:?}'s {key:?} under {field}, where the test can read it"
                        ));
                    }
                    value
                }
            };
            Env {
                value,
                secret: kind == "Secret",
            }
        } else {
            Env {
                value: None,
                secret: false,
            }
        };
        env.insert(name, resolved);
    }
    env
}

/// The text of the file at `path` in a container, from the ConfigMap mounted there.
fn mounted_file(pod: &Value, container: &Value, path: &str, docs: &[(PathBuf, Value)]) -> Result<String, String> {
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        let mount_path = mount["mountPath"].as_str().unwrap_or_default().trim_end_matches('/');
        let file = match mount["subPath"].as_str() {
            Some(sub_path) if path == mount_path => sub_path.to_owned(),
            Some(_) => continue,
            None => match path.strip_prefix(mount_path).and_then(|rest| rest.strip_prefix('/')) {
                Some(file) => file.to_owned(),
                None => continue,
            },
        };
        let volume = pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|volume| volume["name"] == mount["name"])
            .ok_or(format!(
                "{path} is on volume {}, which the pod does not declare",
                mount["name"]
            ))?;
        let config_map = &volume["configMap"];
        let name = config_map["name"].as_str().ok_or(format!(
            "{path} is on volume {}, which is not a ConfigMap",
            mount["name"]
        ))?;
        let key = match config_map["items"].as_array() {
            Some(items) => items
                .iter()
                .find(|item| item["path"] == file.as_str())
                .and_then(|item| item["key"].as_str())
                .ok_or(format!("ConfigMap {name:?}'s items put nothing at {path}"))?
                .to_owned(),
            None => file,
        };
        let found = object(docs, "ConfigMap", name).ok_or(format!("ConfigMap {name:?} is not in this folder"))?;
        return found["data"][key.as_str()]
            .as_str()
            .map(str::to_owned)
            .ok_or(format!("ConfigMap {name:?} has no key {key:?}"));
    }
    Err(format!("nothing is mounted at {path}"))
}

/// What a container must hold to itself, whatever it runs.
fn check_hardening(pod: &Value, container: &Value, place: &str, problems: &mut Vec<String>) {
    let context = &container["securityContext"];
    let non_root = context["runAsNonRoot"]
        .as_bool()
        .or(pod["securityContext"]["runAsNonRoot"].as_bool());
    let drops_all = context["capabilities"]["drop"]
        .as_array()
        .is_some_and(|dropped| dropped.iter().any(|cap| cap == "ALL"));
    for (holds, what) in [
        (non_root == Some(true), "runAsNonRoot: true"),
        (
            context["allowPrivilegeEscalation"] == false,
            "allowPrivilegeEscalation: false",
        ),
        (
            context["readOnlyRootFilesystem"] == true,
            "readOnlyRootFilesystem: true",
        ),
        (drops_all, "capabilities: drop: [ALL]"),
        (
            !container["resources"]["requests"]["memory"].is_null(),
            "resources: requests: memory",
        ),
        (
            !container["resources"]["limits"]["memory"].is_null(),
            "resources: limits: memory",
        ),
    ] {
        if !holds {
            problems.push(format!("{place}: needs {what}"));
        }
    }
}

/// An idem container that serves, for the Services that point at it.
#[derive(Debug)]
struct Serving {
    labels: Value,
    container: Value,
    listen_port: u16,
}

/// The static checks of every manifest; returns the `idem serve` containers found.
fn check_kubernetes(problems: &mut Vec<String>) -> Vec<Served> {
    let mut helps = Helps::default();
    let version = env!("CARGO_PKG_VERSION");
    let mut served_all = Vec::new();
    // Secrets by name: the gateways', and the migrations' (the DDL role's).
    let (mut serve_secrets, mut migrate_secrets) = (BTreeSet::new(), BTreeSet::new());
    for (folder, docs) in manifests() {
        let mut serving = Vec::new();
        for (file, doc) in &docs {
            let Some((labels, pod)) = pod_template(doc) else {
                continue;
            };
            for container in pod["containers"].as_array().into_iter().flatten() {
                let place = format!(
                    "{}: {} {}, container {}",
                    shown(file),
                    doc["kind"].as_str().unwrap_or_default(),
                    doc["metadata"]["name"].as_str().unwrap_or_default(),
                    container["name"].as_str().unwrap_or_default()
                );
                check_hardening(pod, container, &place, problems);
                let Some(tag) = container["image"].as_str().and_then(idem_image_tag) else {
                    continue;
                };
                if tag != version {
                    problems.push(format!(
                        "{place}: the image is idem:{tag}, not this version's idem:{version} (deploy/image/build.sh)"
                    ));
                }
                if !container["command"].is_null() {
                    problems.push(format!(
                        "{place}: the image's entrypoint is idem: give the subcommand and flags as args, not command"
                    ));
                }
                let args: Vec<String> = container["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|arg| arg.as_str().map(str::to_owned))
                    .collect();
                let env = container_env(container, &docs, &place, problems);
                let Some(subcommand) = check_command_line(&args, &mut helps, &place, problems) else {
                    continue;
                };
                check_variables(env.keys(), &subcommand, &mut helps, &place, problems);
                let secrets: BTreeSet<String> = container["env"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|var| var["valueFrom"]["secretKeyRef"]["name"].as_str().map(str::to_owned))
                    .collect();
                match subcommand.as_str() {
                    "serve" => serve_secrets.extend(secrets),
                    "migrate" => {
                        if env.get("IDEM_STORE").is_none_or(|store| !store.secret) {
                            problems.push(format!(
                                "{place}: the migration's store URL (the DDL role's password) comes from a Secret"
                            ));
                        }
                        migrate_secrets.extend(secrets);
                        continue;
                    }
                    _ => continue,
                }
                let config_path =
                    flag_value(&args, "config").or_else(|| env.get("IDEM_CONFIG").and_then(|c| c.value.clone()));
                let config = match config_path.map(|path| mounted_file(pod, container, &path, &docs)) {
                    Some(Ok(text)) => Some(text),
                    Some(Err(err)) => {
                        problems.push(format!("{place}: --config: {err}"));
                        None
                    }
                    None => None,
                };
                let served = Served {
                    place: place.clone(),
                    args: args[1..].to_vec(),
                    env,
                    config,
                };
                let help = helps.of("serve").expect("idem serve's help");
                if let Some(listen_port) = check_serving_pod(pod, container, &served, help, problems) {
                    serving.push(Serving {
                        labels: labels.clone(),
                        container: container.clone(),
                        listen_port,
                    });
                }
                served_all.push(served);
            }
        }
        check_services(&folder, &docs, &serving, problems);
    }
    for shared in serve_secrets.intersection(&migrate_secrets) {
        problems.push(format!(
            "Secret {shared:?} is read by the migration and by idem serve: the DDL role's password belongs to the \
             migration alone"
        ));
    }
    served_all
}

/// The checks of an `idem serve` container against its pod: the grace outlasts what runs at a
/// shutdown, the probes reach its admin listener, both listeners take the pod's IP, and in a pod
/// with the service itself it forwards inside the pod. Returns its proxy listener's port.
fn check_serving_pod(
    pod: &Value,
    container: &Value,
    served: &Served,
    help: &Help,
    problems: &mut Vec<String>,
) -> Option<u16> {
    let place = &served.place;
    let pre_stop = &container["lifecycle"]["preStop"];
    let before_sigterm = if pre_stop.is_null() {
        Some(0)
    } else {
        pre_stop["sleep"]["seconds"].as_u64()
    };
    match before_sigterm {
        Some(seconds) => {
            // The pod's grace counts from when the pod starts terminating, preStop included.
            let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
            check_grace(
                served,
                help,
                Duration::from_secs(grace),
                Duration::from_secs(seconds),
                problems,
            );
        }
        None => problems.push(format!(
            "{place}: the test cannot tell how long this preStop takes: use the sleep action"
        )),
    }
    let mut ports = BTreeMap::new();
    for (flag, probes) in [
        ("listen", &[][..]),
        (
            "admin-listen",
            &[
                ("readinessProbe", "/readyz", true),
                ("livenessProbe", "/healthz", true),
                ("startupProbe", "/healthz", false),
            ][..],
        ),
    ] {
        let address = match served.address(flag, help) {
            Ok(address) => address,
            Err(err) => {
                problems.push(format!("{place}: {err}"));
                continue;
            }
        };
        if !address.ip().is_unspecified() {
            problems.push(format!(
                "{place}: --{flag} is {address}: the kubelet and the Service reach the pod's IP, so listen on \
                     0.0.0.0 (or [::])"
            ));
        }
        ports.insert(flag, address.port());
        for (probe, path, required) in probes {
            let get = &container[probe]["httpGet"];
            if get.is_null() {
                if *required || !container[probe].is_null() {
                    problems.push(format!(
                        "{place}: needs a {probe} that GETs {path} on the admin listener"
                    ));
                }
                continue;
            }
            let port = container_port(container, &get["port"]);
            let shown_port = port.map_or_else(|| format!("{} (no such port)", get["port"]), |port| port.to_string());
            if get["path"] != *path
                || port != Some(u64::from(address.port()))
                || !(get["scheme"].is_null() || get["scheme"] == "HTTP")
            {
                problems.push(format!(
                    "{place}: {probe} GETs {} {} on port {shown_port}; idem answers {path} over HTTP on the \
                         admin listener, port {}",
                    get["scheme"].as_str().unwrap_or("HTTP"),
                    get["path"],
                    address.port()
                ));
            }
        }
    }
    // In a pod with the service it protects, idem reaches it inside the pod.
    if pod["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|other| other["image"].as_str().and_then(idem_image_tag).is_none())
    {
        match served.setting("upstream", help) {
            Ok(upstream)
                if upstream
                    .parse::<http::Uri>()
                    .is_ok_and(|uri| matches!(uri.host(), Some("127.0.0.1" | "localhost" | "[::1]"))) => {}
            Ok(upstream) => problems.push(format!(
                "{place}: the pod holds the service itself: idem's upstream is on 127.0.0.1, not {upstream}"
            )),
            Err(err) => problems.push(format!("{place}: {err}")),
        }
    }
    ports.get("listen").copied()
}

/// Every Service in `folder` sends its ports to idem's proxy listener in the pods it selects.
fn check_services(folder: &Path, docs: &[(PathBuf, Value)], serving: &[Serving], problems: &mut Vec<String>) {
    for (file, service) in docs.iter().filter(|(_, doc)| doc["kind"] == "Service") {
        let place = format!("{}: Service {}", shown(file), service["metadata"]["name"]);
        let selector = service["spec"]["selector"].as_object().cloned().unwrap_or_default();
        let selected: Vec<&Serving> = serving
            .iter()
            .filter(|pod| !selector.is_empty() && selector.iter().all(|(label, value)| pod.labels[label] == *value))
            .collect();
        if selected.is_empty() {
            problems.push(format!(
                "{place}: selects no pod of {} with idem serve in it",
                shown(folder)
            ));
        }
        for port in service["spec"]["ports"].as_array().into_iter().flatten() {
            let target = if port["targetPort"].is_null() {
                &port["port"]
            } else {
                &port["targetPort"]
            };
            for pod in &selected {
                if container_port(&pod.container, target) != Some(u64::from(pod.listen_port)) {
                    problems.push(format!(
                        "{place}: port {} goes to {target}, not to idem's listener on port {}",
                        port["port"], pod.listen_port
                    ));
                }
            }
        }
    }
}

#[test]
fn every_kubernetes_manifest_passes_the_api_schema() {
    let folders = manifests();
    let files: BTreeSet<String> = folders.values().flatten().map(|(file, _)| shown(file)).collect();
    let documents: usize = folders.values().map(Vec::len).sum();
    assert!(documents > 0, "no manifest under deploy/kubernetes");
    for version in KUBERNETES_VERSIONS {
        let output = std::process::Command::new("kubernetes-validate")
            .current_dir(workspace())
            .args(["--strict", "--kubernetes-version", version])
            .args(&files)
            .output()
            .unwrap_or_else(|err| panic!("kubernetes-validate ({err}): {INSTALL}"));
        let stdout = String::from_utf8_lossy(&output.stdout);
        // An unknown kind or apiVersion only warns ("Couldn't find schema"): a pass is a line
        // that says so, one per document.
        let passed = stdout
            .lines()
            .filter(|line| line.starts_with("INFO ") && line.contains(" passed for resource "))
            .count();
        assert!(
            output.status.success() && passed == documents && stdout.lines().count() == documents,
            "the manifests against Kubernetes {version}'s API schema (strict: unknown fields fail): {passed} of \
             {documents} documents passed:\n{}",
            describe(&output)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_manifests_run_idem_as_it_reads_them() {
    let mut problems = Vec::new();
    let served = check_kubernetes(&mut problems);
    assert!(
        served.len() >= 2,
        "the sidecar and the gateway shapes run idem serve: {served:?}"
    );
    assert!(
        problems.is_empty(),
        "the Kubernetes manifests:\n- {}",
        problems.join("\n- ")
    );
    for served in &served {
        starts_and_applies_its_settings(served).await;
    }
    for served in &served {
        refuses_its_shipped_secrets(served, &mut problems).await;
    }
    assert!(
        problems.is_empty(),
        "the Kubernetes manifests' Secrets:\n- {}",
        problems.join("\n- ")
    );
}

// ---------------------------------------------------------------------------------------------
// systemd
// ---------------------------------------------------------------------------------------------

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
    let config = flag_value(&args, "config")
        .or_else(|| env.get("IDEM_CONFIG").and_then(|c| c.value.clone()))
        .and_then(|path| beside_the_unit(&path, &place, &mut problems));
    let served = Served {
        place: place.clone(),
        args: args[1..].to_vec(),
        env,
        config,
    };

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
