//! PostgreSQL and Redis servers of a test's own, which it may kill (as a crash would) and start
//! again on the same port and data: an outage of the store without touching the shared servers
//! that other tests use. PostgreSQL's server binaries (`apt-get install postgresql`) and
//! `redis-server` must be installed; `bash .ci/services` installs both.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::servers::free_port;

/// Waits (at most 30 s) until something listens on the loopback `port` (`up`) or nothing does.
fn wait_for_port(port: u16, up: bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answers = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        if answers == up {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "port {port} did not go {}",
            if up { "up" } else { "down" }
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A PostgreSQL server of the test's own, in a temporary data directory. Stopped when dropped.
#[derive(Debug)]
pub struct PrivatePostgres {
    dir: tempfile::TempDir,
    port: u16,
    bin: PathBuf,
}

impl PrivatePostgres {
    /// `initdb` and start a server on a free port (as the `postgres` user: PostgreSQL refuses root).
    pub fn start() -> Self {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|versions| {
                versions
                    .filter_map(Result::ok)
                    .map(|v| v.path().join("bin"))
                    .find(|b| b.join("initdb").exists())
            })
            .expect("PostgreSQL's server binaries under /usr/lib/postgresql/*/bin (apt-get install postgresql)");
        let dir = tempfile::tempdir().expect("a temp dir");
        let port = free_port();
        let data = dir.path().join("data");
        run_as_postgres(&format!("chown postgres {}", dir.path().display()), false);
        run_as_postgres(
            &format!(
                "{} -D {} -U postgres --auth=trust -E UTF8 --no-sync",
                bin.join("initdb").display(),
                data.display()
            ),
            true,
        );
        let server = Self { dir, port, bin };
        server.restart();
        server
    }

    /// The URL of its `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Kills the server at once, as a crash would.
    pub fn kill(&self) {
        run_as_postgres(
            &format!(
                "{} -D {} stop -m immediate -w",
                self.bin.join("pg_ctl").display(),
                self.data()
            ),
            true,
        );
        wait_for_port(self.port, false);
    }

    /// Starts the server (again) on the same port and data.
    pub fn restart(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.path().display()
        );
        run_as_postgres(
            &format!(
                "{} -D {} -o '{options}' -l {}/log -w start",
                self.bin.join("pg_ctl").display(),
                self.data(),
                self.dir.path().display()
            ),
            true,
        );
        wait_for_port(self.port, true);
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = Command::new("su")
            .args([
                "postgres",
                "-c",
                &format!(
                    "{} -D {} stop -m immediate",
                    self.bin.join("pg_ctl").display(),
                    self.data()
                ),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Runs `command` in a shell, as the `postgres` user if asked; panics if it fails.
fn run_as_postgres(command: &str, as_postgres: bool) {
    let output = if as_postgres {
        Command::new("su").args(["postgres", "-c", command]).output()
    } else {
        Command::new("sh").args(["-c", command]).output()
    }
    .expect("run a PostgreSQL command");
    assert!(
        output.status.success(),
        "`{command}` failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A Redis server of the test's own, without persistence. Killed when dropped.
#[derive(Debug)]
pub struct PrivateRedis {
    port: u16,
    child: Option<Child>,
}

impl PrivateRedis {
    /// Starts `redis-server` on a free port.
    pub fn start() -> Self {
        let mut server = Self {
            port: free_port(),
            child: None,
        };
        server.restart();
        server
    }

    /// The URL of the server.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server at once.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        wait_for_port(self.port, false);
    }

    /// Starts the server (again) on the same port; without persistence it comes back empty.
    pub fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (apt-get install redis-server)");
        self.child = Some(child);
        wait_for_port(self.port, true);
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}
