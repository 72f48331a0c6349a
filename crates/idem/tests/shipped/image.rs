//! The image `deploy/image/build.sh` makes, checked as users get it: built from the shipped `idem`
//! (`--binary`), its configuration as `podman image inspect` shows it, its filesystem listed, and
//! idem run from that filesystem as the image's user.
//!
//! These machines refuse `podman run` (crun cannot set `RLIMIT_NPROC`), so idem runs from the
//! image's own files: `podman image mount` (read-only), then `chroot` with the image's user and
//! environment. Each run builds a tag of its own and removes it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use idem_test_support::servers;
use serde_json::Value;
use tokio::process::Command;

use super::binaries::shipped_binaries;
use crate::common::{Gateway, Upstream, count, new_key, reserve_port, succeeds};

/// Where the image keeps the binary (its entrypoint).
const ENTRYPOINT: &str = "/usr/local/bin/idem";
/// The image's user and group, `idem`.
const USER: u32 = 65532;
/// The working directory, where the default SQLite store is created.
const WORKDIR: &str = "/var/lib/idem";
/// The CA bundle, where rustls-native-certs looks first on Debian-like systems.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The small files the recipe writes, with their exact content.
const WRITTEN: [(&str, &str); 3] = [
    ("/etc/passwd", "idem:x:65532:65532:idem:/var/lib/idem:/sbin/nologin\n"),
    ("/etc/group", "idem:x:65532:\n"),
    ("/etc/nsswitch.conf", "hosts: files dns\n"),
];
/// Names that would mean a shell or a package manager came in.
const FORBIDDEN: [&str; 10] = [
    "sh", "bash", "dash", "busybox", "apt", "apt-get", "dpkg", "rpm", "dnf", "apk",
];

/// Fails, saying how to get it, if `tool --version` does not run (`package` holds it).
fn require(tool: &str, package: &str) {
    let ran = std::process::Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    assert!(
        ran.is_ok_and(|status| status.success()),
        "`{tool}` is needed to build and run idem's image and does not run here: \
         bash .ci/services installs it (Debian: apt-get install {package})"
    );
}

/// Runs `program args` to completion (it must succeed) and returns its stdout.
async fn run(program: &str, args: &[&str]) -> String {
    let output = succeeds(Command::new(program).args(args), &format!("{program} {args:?}")).await;
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

/// The test's image: unmounted and untagged (so removed, unless an identical image holds another
/// tag) at the end, whatever happens.
struct Image {
    tags: Vec<String>,
    mounted: bool,
}

impl Drop for Image {
    fn drop(&mut self) {
        if self.mounted {
            // A chrooted idem killed a moment ago may still hold the mount.
            for _ in 0..50 {
                let unmounted = std::process::Command::new("podman")
                    .args(["image", "unmount", &self.tags[0]])
                    .stdout(Stdio::null())
                    .status();
                if unmounted.is_ok_and(|status| status.success()) {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        for tag in &self.tags {
            let _ = std::process::Command::new("podman")
                .args(["rmi", tag])
                .stdout(Stdio::null())
                .status();
        }
    }
}

/// Deletes the test's Redis keys at the end, whatever happens.
struct DeleteKeys(String, String);

impl Drop for DeleteKeys {
    fn drop(&mut self) {
        servers::delete_redis_keys(&self.0, &self.1);
    }
}

/// Builds the image of `idem` as `tag` by `deploy/image/build.sh`; returns the id it prints.
async fn build(workspace: &Path, idem: &Path, tag: &str) -> String {
    let mut command = Command::new("bash");
    command
        .arg(workspace.join("deploy/image/build.sh"))
        .arg("--binary")
        .arg(idem)
        .args(["--tag", tag])
        .env_remove("SOURCE_DATE_EPOCH");
    let built = succeeds(&mut command, "deploy/image/build.sh").await;
    String::from_utf8_lossy(&built.stdout).trim().to_owned()
}

/// The checkout's commit as the image's `revision` label gives it, and its time in RFC 3339.
async fn checkout(workspace: &Path) -> (String, String) {
    let workspace = workspace.to_str().expect("a UTF-8 path");
    let head = run("git", &["-C", workspace, "rev-parse", "HEAD"]).await;
    let changed = run(
        "git",
        &["-C", workspace, "status", "--porcelain", "--untracked-files=no"],
    )
    .await;
    let revision = format!(
        "{}{}",
        head.trim(),
        if changed.trim().is_empty() { "" } else { "-dirty" }
    );
    let output = Command::new("git")
        .args([
            "-C",
            workspace,
            "log",
            "-1",
            "--date=format-local:%Y-%m-%dT%H:%M:%SZ",
            "--format=%cd",
        ])
        .env("TZ", "UTC")
        .output()
        .await
        .expect("run git log");
    (revision, String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The port of the default `idem serve --help` shows for `flag`.
fn default_port(help: &str, flag: &str) -> u16 {
    let entry = help
        .split(&format!("--{flag} <"))
        .nth(1)
        .unwrap_or_else(|| panic!("--{flag} in idem serve --help:\n{help}"));
    let default = entry
        .split("[default: ")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .unwrap_or_else(|| panic!("no default for --{flag} in idem serve --help:\n{help}"));
    default
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("--{flag}'s default {default:?} has no port"))
}

/// The files `ldd` says `binary` loads (the dynamic loader included), at the paths it gives.
async fn runtime_libraries(binary: &Path) -> BTreeSet<String> {
    let listed = run("ldd", &[binary.to_str().expect("a UTF-8 path")]).await;
    assert!(!listed.contains("not found"), "ldd {}:\n{listed}", binary.display());
    listed
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                [_, "=>", path, ..] | [path, ..] if path.starts_with('/') => Some((*path).to_owned()),
                _ => None,
            }
        })
        .collect()
}

/// Whether two files hold the same bytes (read in chunks: the binary is large).
fn same_bytes(a: &Path, b: &Path) -> bool {
    let open = |path: &Path| std::fs::File::open(path).unwrap_or_else(|err| panic!("open {}: {err}", path.display()));
    let (mut a, mut b) = (open(a), open(b));
    let (mut chunk_a, mut chunk_b) = (vec![0; 1 << 16], vec![0; 1 << 16]);
    loop {
        let read = a.read(&mut chunk_a).expect("read");
        if read == 0 {
            return b.read(&mut chunk_b).expect("read") == 0;
        }
        if b.read_exact(&mut chunk_b[..read]).is_err() || chunk_a[..read] != chunk_b[..read] {
            return false;
        }
    }
}

/// Every entry under `root`, by its path in the image, with its metadata (links not followed).
fn tree(root: &Path) -> BTreeMap<String, std::fs::Metadata> {
    let mut entries = BTreeMap::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|err| panic!("list {}: {err}", dir.display())) {
            let path = entry.expect("a directory entry").path();
            let metadata = std::fs::symlink_metadata(&path).expect("metadata");
            if metadata.is_dir() {
                pending.push(path.clone());
            }
            let inside = Path::new("/").join(path.strip_prefix(root).expect("under the root"));
            entries.insert(inside.display().to_string(), metadata);
        }
    }
    entries
}

/// `chroot` into `root` as the image's user with the image's environment only, running the
/// entrypoint; arguments are added by the caller.
fn in_image(root: &Path, user: &str, env: &[(String, String)]) -> Command {
    let mut command = Command::new("chroot");
    command
        .arg(format!("--userspec={user}"))
        .arg(root)
        .arg(ENTRYPOINT)
        .env_clear()
        .envs(env.iter().map(|(name, value)| (name, value)));
    command
}

/// The object `field` of an image's `config`.
fn object<'a>(config: &'a Value, field: &str) -> &'a serde_json::Map<String, Value> {
    config[field]
        .as_object()
        .unwrap_or_else(|| panic!("{field}: an object in the image's config"))
}

/// The image's configuration and labels, checked against the recipe and the workspace.
fn check_config(image: &Value, serve_help: &str, revision: &str, created: &str) {
    let config = &image["Config"];
    let user = config["User"].as_str().expect("a user");
    assert_eq!(
        user,
        format!("{USER}:{USER}"),
        "the image's user (numeric, for runAsNonRoot)"
    );
    assert_eq!(config["Entrypoint"], serde_json::json!([ENTRYPOINT]), "entrypoint");
    assert_eq!(config["Cmd"], serde_json::json!(["serve"]), "command");
    assert_eq!(config["WorkingDir"], WORKDIR, "working directory");
    assert_eq!(config["StopSignal"], "SIGTERM", "stop signal");

    // The gateway and the admin listener on every interface, at the ports idem defaults to,
    // and those ports declared.
    let env: Vec<&str> = config["Env"]
        .as_array()
        .expect("an environment")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let (listen, admin) = (
        default_port(serve_help, "listen"),
        default_port(serve_help, "admin-listen"),
    );
    for expected in [
        format!("IDEM_LISTEN=0.0.0.0:{listen}"),
        format!("IDEM_ADMIN_LISTEN=0.0.0.0:{admin}"),
    ] {
        assert!(
            env.contains(&expected.as_str()),
            "{expected} in the image's environment {env:?}"
        );
    }
    let exposed: BTreeSet<&str> = object(config, "ExposedPorts").keys().map(String::as_str).collect();
    let expected: BTreeSet<String> = [format!("{listen}/tcp"), format!("{admin}/tcp")].into();
    assert_eq!(exposed, expected.iter().map(String::as_str).collect(), "exposed ports");

    let labels: BTreeMap<&str, &str> = object(config, "Labels")
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_str().expect("a text label")))
        .collect();
    let expected: BTreeMap<&str, &str> = [
        ("org.opencontainers.image.title", "idem"),
        ("org.opencontainers.image.version", env!("CARGO_PKG_VERSION")),
        ("org.opencontainers.image.source", env!("CARGO_PKG_REPOSITORY")),
        ("org.opencontainers.image.revision", revision),
        ("org.opencontainers.image.licenses", env!("CARGO_PKG_LICENSE")),
        ("org.opencontainers.image.description", env!("CARGO_PKG_DESCRIPTION")),
        ("org.opencontainers.image.created", created),
    ]
    .into();
    assert_eq!(labels, expected, "the image's labels");
    // Reproducible: the image is dated by the commit, not by the build.
    assert_eq!(image["Created"], created, "the image's creation time");
}

/// The mounted image holds the binary, exactly its libraries, the CA bundle, the recipe's small
/// files, an empty /tmp and the user's empty working directory: nothing else.
fn check_tree(root: &Path, binary: &Path, libraries: &BTreeSet<String>) {
    let entries = tree(root);
    let mut files: BTreeMap<String, PathBuf> = libraries
        .iter()
        .map(|library| (library.clone(), PathBuf::from(library)))
        .collect();
    files.insert(ENTRYPOINT.to_owned(), binary.to_path_buf());
    files.insert(CA_BUNDLE.to_owned(), PathBuf::from(CA_BUNDLE));
    let empty_dirs = ["/tmp", WORKDIR];

    // Everything listed, and the directories above it.
    let leaves: Vec<&str> = files
        .keys()
        .map(String::as_str)
        .chain(WRITTEN.iter().map(|(path, _)| *path))
        .chain(empty_dirs)
        .collect();
    let above_a_leaf = |dir: &str| {
        leaves.iter().any(|leaf| {
            Path::new(leaf)
                .ancestors()
                .skip(1)
                .any(|ancestor| ancestor == Path::new(dir))
        })
    };
    let unexpected: Vec<&String> = entries
        .iter()
        .filter(|(path, metadata)| {
            let listed = if metadata.is_dir() {
                empty_dirs.contains(&path.as_str()) || above_a_leaf(path)
            } else {
                metadata.is_file() && leaves.contains(&path.as_str())
            };
            !listed
        })
        .map(|(path, _)| path)
        .collect();
    assert!(
        unexpected.is_empty(),
        "the image holds what the recipe does not put there: {unexpected:?}"
    );
    let forbidden: Vec<&String> = entries
        .keys()
        .filter(|path| FORBIDDEN.iter().any(|name| path.rsplit('/').next() == Some(name)))
        .collect();
    assert!(
        forbidden.is_empty(),
        "a shell or a package manager in the image: {forbidden:?}"
    );

    for (inside, source) in &files {
        let metadata = entries
            .get(inside)
            .unwrap_or_else(|| panic!("{inside} is missing from the image"));
        assert_eq!((metadata.uid(), metadata.gid()), (0, 0), "{inside} is root's");
        assert!(
            same_bytes(&root.join(&inside[1..]), source),
            "{inside} in the image differs from {}",
            source.display()
        );
    }
    for (path, content) in WRITTEN {
        let written = std::fs::read_to_string(root.join(&path[1..])).unwrap_or_else(|err| panic!("read {path}: {err}"));
        assert_eq!(written, content, "{path}");
        assert_eq!(entries[path].mode() & 0o7777, 0o644, "{path}'s mode");
    }
    let binary_mode = entries[ENTRYPOINT].mode() & 0o7777;
    assert_eq!(binary_mode, 0o755, "{ENTRYPOINT}'s mode");

    for dir in empty_dirs {
        let empty = entries.keys().all(|path| !path.starts_with(&format!("{dir}/")));
        assert!(empty, "{dir} is not empty in the image");
    }
    let tmp = &entries["/tmp"];
    assert_eq!(tmp.permissions().mode() & 0o7777, 0o1777, "/tmp's mode");
    let workdir = &entries[WORKDIR];
    assert_eq!((workdir.uid(), workdir.gid()), (USER, USER), "{WORKDIR}'s owner");
    assert_eq!(workdir.permissions().mode() & 0o7777, 0o700, "{WORKDIR}'s mode");
    for (path, metadata) in &entries {
        if metadata.is_dir() && !empty_dirs.contains(&path.as_str()) {
            assert_eq!(metadata.uid(), 0, "{path} is root's");
            assert_eq!(
                metadata.permissions().mode() & 0o022,
                0,
                "{path} is writable by root only"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_holds_idem_alone_and_runs_it_as_its_user() {
    for (tool, package) in [("podman", "podman"), ("chroot", "coreutils"), ("ldd", "libc-bin")] {
        require(tool, package);
    }
    let uid = std::fs::metadata("/proc/self").expect("/proc/self").uid();
    assert_eq!(
        uid, 0,
        "`podman image mount` and `chroot` need root: run this test as root"
    );
    let idem = &shipped_binaries().await["idem"];
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");

    // Build, with tags of this run's own; twice, as the same binary gives the same image.
    let tag = format!("localhost/idem-image-test:{}", servers::unique_name("t"));
    let again = format!("{tag}-again");
    let mut image = Image {
        tags: vec![tag.clone(), again.clone()],
        mounted: false,
    };
    let id = build(&workspace, idem, &tag).await;
    assert_eq!(
        build(&workspace, idem, &again).await,
        id,
        "the same binary builds the same image"
    );

    let inspected: Value = serde_json::from_str(&run("podman", &["image", "inspect", &tag]).await).expect("JSON");
    let inspected = &inspected[0];
    assert_eq!(
        inspected["Id"].as_str().map(|full| full.trim_start_matches("sha256:")),
        Some(id.trim_start_matches("sha256:")),
        "build.sh prints the image's id"
    );
    let serve_help = run(idem.to_str().expect("a UTF-8 path"), &["serve", "--help"]).await;
    let (revision, created) = checkout(&workspace).await;
    check_config(inspected, &serve_help, &revision, &created);

    let root = PathBuf::from(run("podman", &["image", "mount", &tag]).await.trim());
    image.mounted = true;
    check_tree(&root, idem, &runtime_libraries(idem).await);

    // idem from the image's files, as the image's user, with the image's environment only.
    let user = inspected["Config"]["User"].as_str().expect("a user");
    let env: Vec<(String, String)> = inspected["Config"]["Env"]
        .as_array()
        .expect("an environment")
        .iter()
        .filter_map(|entry| entry.as_str()?.split_once('='))
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect();
    check_runs(&root, user, &env).await;
    drop(image);
}

/// idem from the image mounted at `root`: its version, and `idem serve` in front of an upstream
/// on the shared Redis, where a keyed request runs once and its copy is its replay.
async fn check_runs(root: &Path, user: &str, env: &[(String, String)]) {
    let version = in_image(root, user, env)
        .arg("--version")
        .output()
        .await
        .expect("run chroot");
    assert!(version.status.success(), "idem --version in the image: {version:?}");
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("idem {}", env!("CARGO_PKG_VERSION")),
        "idem --version in the image"
    );

    let base = servers::redis_url();
    let prefix = servers::unique_name("idem-image");
    let _keys = DeleteKeys(base.clone(), prefix.clone());
    let store = servers::with_options(&base, &format!("prefix={prefix}"));
    let upstream = Upstream::start().await;
    let mut gateway = Gateway::start_command_on_store(in_image(root, user, env), &upstream.url(), &store, &[]).await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", gateway.pid())).expect("the gateway's status");
    let uids = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .expect("a Uid line");
    assert!(
        uids.split_whitespace().all(|id| id == USER.to_string()),
        "idem serve runs as {USER}: Uid {uids}"
    );
    let key = new_key();
    let first = gateway.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
    assert_eq!(first.status, 201, "the first request: {first}");
    assert!(!first.replayed(), "the first request ran: {first}");
    let copy = gateway.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
    assert_eq!(copy.status, 201, "its copy: {copy}");
    assert!(copy.replayed(), "its copy is a replay: {copy}");
    assert_eq!(copy.body, first.body, "the replay is the first answer");
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran the payment once");
    gateway.kill().await;

    // An https:// upstream needs the image's CA bundle at start: without one idem refuses to
    // start (no CA is trusted). Nothing listens there; starting is what is checked.
    let https = format!("https://{}", reserve_port());
    let mut gateway = Gateway::start_command_on_store(in_image(root, user, env), &https, &store, &[]).await;
    gateway.kill().await;
}
