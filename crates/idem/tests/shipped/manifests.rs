//! The deployments users copy: the Kubernetes manifests (`deploy/kubernetes/`) and the systemd
//! unit (`deploy/systemd/`). Each is read as its system reads it (the Kubernetes API's schema,
//! offline, with kubernetes-validate; `systemd-analyze`) and checked against the `idem` it runs:
//! what a schema cannot see is whether a flag or an `IDEM_` variable is one idem reads, whether
//! the probes reach the admin listener, whether the grace outlasts `--shutdown-grace`, and
//! whether the config file starts a gateway that applies it.
//!
//! In `manifests/`: idem's help as the checks read it, one `idem serve` as a deployment declares
//! and runs it, the Kubernetes objects read and resolved, the Kubernetes checks, the systemd unit.

mod help;
mod kubernetes;
mod objects;
mod served;
mod systemd;

use std::path::{Path, PathBuf};

/// How to install what these checks run.
const INSTALL: &str = "bash .ci/services installs it (kubernetes-validate: python3 -m pip install \
                       kubernetes-validate==1.37.0, which brings PyYAML; systemd-analyze: apt-get install systemd)";

/// The repository's root.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `path` relative to the workspace, for messages.
fn shown(path: &Path) -> String {
    path.strip_prefix(workspace()).unwrap_or(path).display().to_string()
}
