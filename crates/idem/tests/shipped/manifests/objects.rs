//! The Kubernetes manifests read as the API server reads them (YAML, duplicate keys refused), by
//! folder, and the references between their objects resolved: a workload's pods, a container's
//! ports, its variables from Secrets and ConfigMaps, the files mounted from ConfigMaps.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::served::Env;
use super::{INSTALL, shown, workspace};

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
pub(crate) fn manifests() -> BTreeMap<PathBuf, Vec<(PathBuf, Value)>> {
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
pub(crate) fn pod_template(doc: &Value) -> Option<(&Value, &Value)> {
    let template = match doc["kind"].as_str()? {
        "Pod" => return Some((&doc["metadata"]["labels"], &doc["spec"])),
        "CronJob" => &doc["spec"]["jobTemplate"]["spec"]["template"],
        _ => doc["spec"].get("template")?,
    };
    Some((&template["metadata"]["labels"], &template["spec"]))
}

/// The tag of an image of idem (`REGISTRY/…/idem:TAG`); `None` for another image.
pub(crate) fn idem_image_tag(image: &str) -> Option<&str> {
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
pub(crate) fn container_port(container: &Value, port: &Value) -> Option<u64> {
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
pub(crate) fn container_env(
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
pub(crate) fn mounted_file(
    pod: &Value,
    container: &Value,
    path: &str,
    docs: &[(PathBuf, Value)],
) -> Result<String, String> {
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
