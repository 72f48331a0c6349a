//! The payments binary as a process of its own, for the tests that kill or freeze it.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Starts the payments binary on an ephemeral port with `env` set; returns the process and its
/// base URL, once it listens.
pub(crate) async fn start_payments(env: &[(&str, &str)]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_payments"))
        .env("PAYMENTS_LISTEN", "127.0.0.1:0")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the payments binary");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the service starts within 30 s")
        .expect("read stdout")
        .unwrap_or_else(|| panic!("the service exited before listening: {:?}", child.try_wait()));
    let base = line
        .strip_prefix("payments listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    (child, base)
}
