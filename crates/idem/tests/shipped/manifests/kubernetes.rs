//! The Kubernetes manifests (`deploy/kubernetes/`): each passes the API's schema (offline, with
//! kubernetes-validate), and what a schema cannot see holds: the hardening of every container,
//! idem's image and command line, the probes on the admin listener, the grace, the Services.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::help::{Help, Helps, check_command_line, check_variables};
use super::objects::{container_env, container_port, idem_image_tag, manifests, mounted_file, pod_template};
use super::served::{Served, check_grace, refuses_its_shipped_secrets, starts_and_applies_its_settings};
use super::{INSTALL, shown, workspace};
use crate::common::describe;

/// The Kubernetes versions whose API schema the manifests must pass: the oldest they need (1.30,
/// for the preStop `sleep` action) and the newest that kubernetes-validate 1.37.0 carries.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];

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
                let served = Served::new(place.clone(), &args, env, |path| {
                    mounted_file(pod, container, path, &docs)
                        .map_err(|err| problems.push(format!("{place}: --config: {err}")))
                        .ok()
                });
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
