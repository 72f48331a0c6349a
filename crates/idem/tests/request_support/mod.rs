//! What only the `idem request` tests need on top of `common`: a link that loses the first answer
//! on its way back, and running `idem` with its retry settings unset and reading its summary line.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

use idem_test_support::task::AbortOnDrop;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;

use crate::common::{IDEM, describe, run_to_end};

/// A TCP link in front of `target` that loses the first answer: on its first connection it
/// forwards the request, waits until the answer starts to come back (so the request was
/// processed), and then closes the connection without passing the answer on. Later connections
/// pass through untouched.
pub(crate) struct LossyLink {
    /// Where it listens.
    pub(crate) addr: SocketAddr,
    _task: AbortOnDrop,
}

impl LossyLink {
    /// Starts on an ephemeral port.
    pub(crate) async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _task = AbortOnDrop::spawn(async move {
            let mut first = true;
            while let Ok((client, _)) = listener.accept().await {
                let lose = std::mem::replace(&mut first, false);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    if lose {
                        lose_the_answer(client, server).await;
                    } else {
                        let (mut client, mut server) = (client, server);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Self { addr, _task }
    }

    /// The URL of `path` through the link.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

async fn lose_the_answer(client: TcpStream, server: TcpStream) {
    let (mut from_client, _to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let forward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
    });
    let mut byte = [0u8; 1];
    let _ = from_server.read(&mut byte).await;
    forward.abort();
    // Dropping both halves closes the client's connection with no answer on it.
}

/// Runs `idem ARGS` to completion (at most a minute), with the `IDEM_*` retry settings of the
/// environment unset so that only the arguments count.
pub(crate) async fn idem(args: &[&str]) -> Output {
    let mut command = Command::new(IDEM);
    command
        .env_remove("IDEM_RETRIES")
        .env_remove("IDEM_TIMEOUT")
        .env_remove("IDEM_DEADLINE");
    run_to_end(&mut command, args, Duration::from_secs(60)).await
}

/// The summary line `idem request` printed (the last line of stderr), as `name=value` pairs.
pub(crate) fn summary(output: &Output) -> HashMap<String, String> {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("idem: status="))
        .unwrap_or_else(|| panic!("no summary line:\n{}", describe(output)));
    line.trim_start_matches("idem: ")
        .split_whitespace()
        .filter_map(|word| word.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}
