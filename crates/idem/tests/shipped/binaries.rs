//! Every binary the workspace ships starts as `cargo build` makes it.
//!
//! The binaries a test run builds (`CARGO_BIN_EXE_*`) are not those: their dependencies' features
//! are unified with the dev-dependencies', and a dev-dependency (reqwest's `rustls`, which brings a
//! TLS crypto provider of its own) can bring back what the shipped build lacks. So this test builds
//! the workspace's binaries without them (`cargo build --workspace --bins`), then starts each one
//! with its documented environment and checks that it answers.
//!
//! The build shares the tests' build directory and profile, so it compiles only the crates whose
//! features differ, but puts its binaries in a target directory of their own: in the tests' one
//! they would replace the binaries the other tests run (`CARGO_BIN_EXE_*`) while they run.
//!
//! The build runs once per test run ([`shipped_binaries`]); the image's test packs the `idem` it
//! built.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use tokio::sync::OnceCell;

use crate::common::{Gateway, Upstream, client, new_key, reserve_port, send, store_url_in, succeeds};

/// How long a started binary may take to say that it listens.
const STARTUP: Duration = Duration::from_secs(30);

/// The workspace's binaries, by name, as `cargo build --workspace --bins` builds them (the paths
/// cargo reports); built once for every test of this binary that asks.
pub(crate) async fn shipped_binaries() -> &'static BTreeMap<String, PathBuf> {
    static BUILT: OnceCell<BTreeMap<String, PathBuf>> = OnceCell::const_new();
    BUILT.get_or_init(build_shipped_binaries).await
}

async fn build_shipped_binaries() -> BTreeMap<String, PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // This test runs from `<build dir>/<profile dir>/deps/`.
    let this = std::env::current_exe().expect("the test's path");
    let profile_dir = this.ancestors().nth(2).expect("the profile's directory");
    let build_dir = profile_dir.parent().expect("the build directory");
    let profile = match profile_dir.file_name().and_then(|name| name.to_str()) {
        Some("debug") | None => "dev",
        Some(profile) => profile,
    };
    let mut command = Command::new(env!("CARGO"));
    // Cargo gives this test the variables of the crate under test (`CARGO_PKG_*`, `OUT_DIR`, …).
    // Passed on, they would change the environment of the build scripts that watch them (ring's),
    // which would run again, and everything above them would be rebuilt twice: here and in the
    // next test build.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_MANIFEST_")
            || name.starts_with("CARGO_BIN_EXE_")
            || [
                "CARGO_CRATE_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "OUT_DIR",
            ]
            .contains(&&*name)
        {
            command.env_remove(&*name);
        }
    }
    command
        .current_dir(&workspace)
        .args(["build", "--workspace", "--bins", "--locked", "--profile", profile])
        .arg("--config")
        .arg(format!("build.build-dir={:?}", build_dir.display().to_string()))
        .arg("--target-dir")
        .arg(build_dir.join("shipped-binaries"))
        .arg("--message-format=json-render-diagnostics");
    let output = succeeds(&mut command, "cargo build --workspace --bins").await;
    let mut built = BTreeMap::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let is_bin = message["reason"] == "compiler-artifact"
            && message["target"]["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|kind| kind == "bin"));
        if let (true, Some(name), Some(executable)) = (
            is_bin,
            message["target"]["name"].as_str(),
            message["executable"].as_str(),
        ) {
            built.insert(name.to_owned(), PathBuf::from(executable));
        }
    }
    built
}

/// Spawns `command` and waits for the stdout line that starts with `prefix`, which it returns
/// with the child; panics with the child's stderr if the child exits or stays silent.
async fn started(mut command: Command, prefix: &str, stderr_path: &Path) -> (Child, String) {
    let stderr = std::fs::File::create(stderr_path).expect("create the stderr log");
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true);
    let mut child = command.spawn().expect("spawn the binary");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let found = tokio::time::timeout(STARTUP, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.starts_with(prefix) {
                return Some(line);
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(line)) => {
            // Keep draining stdout so that the child never blocks on a full pipe.
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            (child, line)
        }
        outcome => {
            let _ = child.start_kill();
            let status = child.wait().await;
            panic!(
                "{command:?} did not print `{prefix}…` ({}; {status:?}); stderr:\n{}",
                if outcome.is_err() { "timed out" } else { "stdout closed" },
                std::fs::read_to_string(stderr_path).unwrap_or_default()
            );
        }
    }
}

/// `idem serve` with traces exported over OTLP to an `https://` endpoint (nothing listens there:
/// the export fails and is logged, which is not what is checked), whose reqwest client takes the
/// process's TLS provider; then one keyed request through it.
async fn idem_serves(idem: &Path) {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let mut command = Command::new(idem);
    command.envs([
        ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("https://{}", reserve_port())),
        ("OTEL_SERVICE_NAME", "shipped-binaries".to_owned()),
    ]);
    let gateway = Gateway::start_command_on_store(command, &upstream.url(), &store_url_in(dir.path()), &[]).await;
    let reply = gateway.post_json("/pay", Some(&new_key()), r#"{"amount":1}"#).await;
    assert_eq!(
        reply.status,
        201,
        "idem serve answered {}: {}",
        reply.status,
        reply.text()
    );
}

/// The payments example with its payment provider at an `http://` URL on this machine (as
/// `examples/payments/README.md` runs it; the client is built at start whatever the scheme);
/// then one request it answers itself.
async fn payments_serves(payments: &Path) {
    let provider = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let mut command = Command::new(payments);
    command.envs([
        ("PAYMENTS_LISTEN", "127.0.0.1:0".to_owned()),
        ("PAYMENTS_PROVIDER", provider.url()),
        (
            "PAYMENTS_STORE",
            dir.path().join("payments-idem.db").display().to_string(),
        ),
    ]);
    // The binary's other settings are its own to read: none comes from this process.
    command
        .env_remove("PAYMENTS_DATABASE")
        .env_remove("PAYMENTS_LEASE_SECS");
    let (_child, line) = started(command, "payments listening on ", &dir.path().join("stderr.log")).await;
    let base = line.trim_start_matches("payments listening on ").trim().to_owned();
    let reply = send(client().get(format!("{base}/orders/1"))).await;
    assert_eq!(
        reply.status,
        404,
        "GET /orders/1 answered {}: {}",
        reply.status,
        reply.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shipped_binary_starts_as_the_workspace_builds_it() {
    let built = shipped_binaries().await;
    // A binary added to the workspace must say here how it starts.
    assert_eq!(
        built.keys().map(String::as_str).collect::<Vec<_>>(),
        ["idem", "payments"],
        "the workspace's binaries: {built:?}"
    );
    idem_serves(&built["idem"]).await;
    payments_serves(&built["payments"]).await;
}
