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
mod log_format;
mod log_redact;
mod log_writer;
mod misconfigured;
mod proxy;
mod request;
mod serve;
mod settings;
mod stores;
mod telemetry;
mod terminal;
mod tls;
mod units;

use std::process::ExitCode;

use crate::cli::Command;

/// The gateway allocates and frees small buffers on every request (headers, bodies, store
/// replies) from both runtime threads; mimalloc's per-thread pages cost it less than glibc's
/// arenas (`bench/README.md`, "idem serve, new keys").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = cli::parse();
    // One TLS provider for the whole process: the clients that take the process's default (the
    // OTLP exporter's, `idem request`'s) use ring, as the gateway's own TLS does.
    let _ = rustls::crypto::ring::default_provider().install_default();
    // The demo's gateways and the bench's layer would log every request: their output is the
    // table (and writing a line per request would be part of what the bench measures).
    let default_filter = match cli.command {
        Command::Demo(_) => "error",
        // An operator's reading commands print what they found; how the store was opened is noise.
        Command::Bench(_) | Command::List(_) | Command::Inspect(_) => "warn",
        _ => "info",
    };
    // Only the gateway exports traces and batches its log lines: the other commands serve no
    // keyed requests.
    let serving = matches!(cli.command, Command::Serve(_));
    let telemetry = match telemetry::init(default_filter, serving) {
        Ok(telemetry) => telemetry,
        Err(err) => {
            eprintln!("idem: {err:#}");
            return ExitCode::from(if err.is::<misconfigured::Misconfigured>() { 2 } else { 1 });
        }
    };
    let result = match cli.command {
        Command::Serve(args) => serve::run(*args, &telemetry).await,
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
    telemetry.shutdown();
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
