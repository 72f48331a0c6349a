//! The `idem` command: the gateway (`idem serve`), the demo (`idem demo`) and the operator's commands.

mod admin;
mod bench;
mod cli;
mod commands;
mod config;
mod demo;
mod head_limit;
mod instrumented;
mod list;
mod listener;
mod misconfigured;
mod proxy;
mod request;
mod serve;
mod settings;
mod stores;
mod tls;
mod units;

use std::io::IsTerminal;
use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

use crate::cli::Command;

/// The gateway allocates and frees small buffers on every request (headers, bodies, store
/// replies) from both runtime threads; mimalloc's per-thread pages cost it less than glibc's
/// arenas (`bench/README.md`, "idem serve, new keys").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = cli::parse();
    // The demo's gateways and the bench's layer would log every request: their output is the
    // table (and writing a line per request would be part of what the bench measures).
    let default_filter = match cli.command {
        Command::Demo(_) => "error",
        // An operator's reading commands print what they found; how the store was opened is noise.
        Command::Bench(_) | Command::List(_) | Command::Inspect(_) => "warn",
        _ => "info",
    };
    let filter = EnvFilter::try_from_env("IDEM_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // One JSON object per line for log pipelines; readable text on a terminal.
    if std::env::var("IDEM_LOG_FORMAT").is_ok_and(|f| f == "json") {
        logs.json().init();
    } else {
        logs.with_ansi(std::io::stderr().is_terminal()).init();
    }
    let result = match cli.command {
        Command::Serve(args) => serve::run(*args).await,
        Command::Inspect(args) => commands::inspect(args).await,
        Command::List(args) => list::list(args).await,
        Command::Delete(args) => commands::delete(args).await,
        Command::Purge(args) => commands::purge(args).await,
        Command::Migrate(args) => commands::migrate(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Demo(args) => demo::run(args).await,
        // Its exit status tells the kind of answer, not just success or failure.
        Command::Request(args) => return request::run(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("idem: {err:#}");
            // Settings that cannot work are a usage error, like those clap finds.
            if err.is::<misconfigured::Misconfigured>() || err.is::<config::ConfigError>() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
