//! The command line: every flag also reads `IDEM_<FLAG>` from the environment, and `idem serve`'s
//! also from its config file.

use std::path::PathBuf;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use idem_core::store::ListedState;

use crate::settings::ServeSettings;

/// idem: make HTTP requests safe to retry.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The command line, parsed; `--help` shows each setting's default from where it is kept.
pub(crate) fn parse() -> Cli {
    let matches = command().get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit())
}

// The variables that hold secrets: read from the environment only (a flag's value shows in `ps`),
// and listed in `idem serve --help`.

/// The environment variable of the sealing keys.
pub(crate) const ENCRYPTION_KEYS: &str = "IDEM_ENCRYPTION_KEYS";
/// The environment variable of the secret mixed into the hash of credential scopes.
pub(crate) const SCOPE_SECRET: &str = "IDEM_SCOPE_SECRET";
/// The environment variable of the secret used before `IDEM_SCOPE_SECRET` (`none`: there was
/// none), kept for one retention after a change so that keys used before it still replay.
pub(crate) const SCOPE_SECRET_PREVIOUS: &str = "IDEM_SCOPE_SECRET_PREVIOUS";

/// The command, with `idem serve`'s defaults in its help (its flags have none of their own, so
/// that the config file can come between them and the defaults) and, after its flags, the
/// variables it reads from the environment only.
fn command() -> clap::Command {
    Cli::command().mut_subcommand("serve", |serve| {
        let serve = serve.after_help(serve_environment());
        ServeSettings::shown_defaults()
            .into_iter()
            .filter_map(|(id, default)| Some((id, default?)))
            .fold(serve, |serve, (id, default)| {
                serve.mut_arg(id, |arg| {
                    let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
                    arg.help(format!("{help} [default: {default}]"))
                })
            })
    })
}

/// The variables `idem serve` reads that no flag has, and what each holds, laid out as clap lays
/// out the flags above them. The secrets are among them because a flag's value shows in the
/// process list (`ps`) to every user of the machine.
fn serve_environment() -> String {
    let scope_secret = SCOPE_SECRET;
    let variables: [(&str, String); 6] = [
        (
            scope_secret,
            format!(
                "A secret mixed into the hash of credential scopes (the `Authorization` header's), kept outside \
                 the store so that a dump alone gives nothing to test guesses against: at least {} bytes",
                idem_core::MIN_SECRET_LEN
            ),
        ),
        (
            SCOPE_SECRET_PREVIOUS,
            format!(
                "The secret {scope_secret} held before a change (`none` if there was none), kept for one retention \
                 so that the keys used before it still replay"
            ),
        ),
        (
            ENCRYPTION_KEYS,
            "The secret keys that seal stored answers: `ID:BASE64` entries of 32-byte keys, comma-separated \
             (`k2026:…,k2025:…`); the first seals, every one listed opens"
                .into(),
        ),
        (
            "IDEM_LOG",
            "Which log lines are written: a filter of targets and levels (`info`, `idem=debug,warn`)".into(),
        ),
        (
            "IDEM_LOG_FORMAT",
            "`json`: each log line a JSON object, its fields named as OpenTelemetry's log data model names them".into(),
        ),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_*",
            "Export idem's spans over OTLP/HTTP (protobuf): the OpenTelemetry SDK's variables, read as it reads them"
                .into(),
        ),
    ];
    let mut text = "Environment, read there only (a secret given as a flag would show in the process list):".to_owned();
    for (names, holds) in variables {
        text.push_str(&format!("\n  {names}\n          {holds}"));
    }
    text
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the gateway: a reverse proxy that applies the idempotency protocol in front of any HTTP upstream.
    Serve(Box<ServeArgs>),
    /// Show one record: when, which method and path, its state, its stored status, its replays.
    /// A key without a record exits 1, with a message on stderr (with --json too).
    Inspect(InspectArgs),
    /// List the store's records, newest first, by state, time, path and recovery: one line each
    /// (created, state, status, replays, recovered, method and path, trace id, scope, key), judged
    /// on the store's clock. Answers the questions of an investigation: which keys were recovered,
    /// are stuck in flight, or ended with their outcome unknown.
    List(ListArgs),
    /// Forget one record and show what it was. A completed record, a tombstone or an unknown outcome
    /// is deleted: the key is free for a new request. A record in flight is not freed, as its run
    /// may have had effects: the run is fenced (its answer is not stored) and the key left unknown,
    /// so the same request runs again marked `Idempotency-Recovered: true` (delete it again to free
    /// the key). A key without a record exits 1, with a message on stderr.
    Delete(RecordArgs),
    /// Delete expired answers and records now (the gateway also does this in the background).
    Purge(StoreArgs),
    /// Create or upgrade the store's schema.
    Migrate(StoreArgs),
    /// Measure what a keyed request costs the store: operations per new request and per replay, and
    /// each operation's latency.
    Bench(BenchArgs),
    /// See why idempotency keys need one shared store: payments through several gateway instances
    /// over a faulty network, in three set-ups, counted in one table.
    Demo(DemoArgs),
    /// Send one request like curl, with an idempotency key and retries; body to stdout, a summary line
    /// (status, attempts, key, replayed) to stderr.
    Request(crate::request::RequestArgs),
}

#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    /// The store: sqlite://PATH, postgres://…, redis://HOST:PORT, redis+sentinel://S1:P1,S2:P2,…/PRIMARY or redis+cluster://H1:P1,H2:P2,….
    #[arg(long, env = "IDEM_STORE", default_value = crate::stores::DEFAULT_STORE)]
    pub(crate) store: String,
}

#[derive(Debug, Args)]
pub(crate) struct InspectArgs {
    #[command(flatten)]
    pub(crate) record: RecordArgs,
    /// Print the record as one JSON object on one line, for scripts (times in RFC 3339, UTC).
    #[arg(long)]
    pub(crate) json: bool,
}

/// `idem list`'s question.
#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Only records in this state: `in-flight` (a run holds the key), `unknown` (a run ended
    /// without an answer: the same request runs again, recovered), `completed` (the answer is
    /// replayed) or `tombstone` (past its ttl: the key answers key-expired).
    #[arg(long, value_parser = parse_state)]
    pub(crate) state: Option<ListedState>,
    /// Only records whose latest run was recovered (it ran with `Idempotency-Recovered: true`).
    #[arg(long)]
    pub(crate) recovered: bool,
    /// Only records created within this long before now on the store's clock (`1h`, `30m`).
    #[arg(long, value_parser = crate::units::parse_duration, value_name = "DURATION")]
    pub(crate) since: Option<std::time::Duration>,
    /// Only records of this path or below it (`/payments` takes `/payments/pay_1`, not
    /// `/payments-old`).
    #[arg(long, value_name = "PATH")]
    pub(crate) route: Option<String>,
    /// At most this many records (the newest).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) limit: u32,
    /// One JSON object per record and line, for scripts (times in RFC 3339, UTC).
    #[arg(long)]
    pub(crate) json: bool,
}

fn parse_state(text: &str) -> Result<ListedState, String> {
    text.parse()
}

/// Which record an operator's command is about.
#[derive(Debug, Args)]
pub(crate) struct RecordArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The record's scope as stored: `anonymous`, `shared` (`--scope none`), `header:VALUE`,
    /// `cred-mac:HASH`, `app:ID`.
    #[arg(long, default_value = "anonymous", conflicts_with = "authorization")]
    pub(crate) scope: String,
    /// The caller's `Authorization` header value, for records in a credential scope (the default
    /// of `idem serve`); idem hashes it as the gateway does (with the store's salt and
    /// `IDEM_SCOPE_SECRET`), and finds records stored before a change of hashing too.
    #[arg(long)]
    pub(crate) authorization: Option<String>,
    /// The idempotency key (without quotes).
    pub(crate) key: String,
}

/// `idem serve`'s arguments: the settings, and the file that may give the ones the flags and the
/// environment leave out.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// A TOML file of settings by their flag names (`ttl = "24h"`) and `[[route]]` rules by path.
    /// Flags beat the environment, which beats the file, which beats the defaults.
    #[arg(long, env = "IDEM_CONFIG", value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) settings: ServeSettings,
}

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Requests per phase (new keys, then the same keys replayed).
    #[arg(long, default_value_t = 2000)]
    pub(crate) requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    pub(crate) concurrency: usize,
    /// The size of each stored answer's body, in bytes.
    #[arg(long, default_value_t = 256)]
    pub(crate) body_size: usize,
    /// What each new key's handler writes besides its answer, in the store's database (PostgreSQL):
    /// `none`; `separate`, a row committed on its own, then the answer stored by the layer; or
    /// `in-transaction`, the row and the answer committed together (`complete_in_client`).
    #[arg(long, value_enum, default_value = "none")]
    pub(crate) write: BusinessWrite,
    /// Answer replays from the replay cache, as `idem serve` does by default. Off here, so that
    /// the replay phase measures the store.
    #[arg(long)]
    pub(crate) replay_cache: bool,
}

/// What `idem bench`'s handler writes besides its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum BusinessWrite {
    /// Nothing.
    None,
    /// A row in a transaction of its own; the layer stores the answer.
    Separate,
    /// A row and the answer in one transaction.
    InTransaction,
}

impl BusinessWrite {
    /// As the flag spells it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Separate => "separate",
            Self::InTransaction => "in-transaction",
        }
    }
}

#[derive(Debug, Args)]
#[command(after_help = "\
Starts, in this process, a payments service that records every charge, gateway instances behind a
round-robin balancer that drops answers and resets connections, and clients that retry with
idem-client; one instance is killed partway and restarted. The same traffic runs with no
idempotency, with a store per instance, and with one shared store.")]
pub(crate) struct DemoArgs {
    /// Gateway instances behind the balancer.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub(crate) instances: u16,
    /// Payments sent in each set-up.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) payments: u64,
    /// The share of answers the network drops after the payment went through (0 to 1).
    #[arg(long, default_value_t = 0.1, value_parser = parse_rate)]
    pub(crate) drop_rate: f64,
    /// The share of connections the network resets before the request arrives (0 to 1).
    #[arg(long, default_value_t = 0.05, value_parser = parse_rate)]
    pub(crate) reset_rate: f64,
    /// Clients sending payments at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub(crate) clients: u16,
    /// The shared store of the third set-up (default: a fresh temporary SQLite file).
    #[arg(long)]
    pub(crate) store: Option<String>,
    /// The seed of the faults; the same seed gives every payment the same faults (random by default,
    /// and printed).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Print the results as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

fn parse_rate(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(rate) if (0.0..=1.0).contains(&rate) => Ok(rate),
        _ => Err(format!("{text:?} is not a rate between 0 and 1, such as 0.1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        // Also checks that every default shown names a flag of `idem serve`.
        super::command().debug_assert();
    }

    #[test]
    fn every_default_is_shown_in_the_help() {
        let unshown: Vec<&str> = ServeSettings::shown_defaults()
            .into_iter()
            .filter(|(_, shown)| shown.is_none())
            .map(|(id, _)| id)
            .collect();
        assert!(unshown.is_empty(), "give these settings a `shown`: {unshown:?}");
    }

    #[test]
    fn serve_s_help_lists_the_variables_it_reads_from_the_environment_only() {
        let mut command = super::command();
        let help = command
            .find_subcommand_mut("serve")
            .expect("idem serve")
            .render_long_help()
            .to_string();
        let (_, environment) = help
            .split_once("\nEnvironment")
            .expect("an Environment section after the flags");
        for name in [
            SCOPE_SECRET,
            SCOPE_SECRET_PREVIOUS,
            ENCRYPTION_KEYS,
            "IDEM_LOG",
            "IDEM_LOG_FORMAT",
        ] {
            assert!(
                environment
                    .lines()
                    .any(|line| line.starts_with("  ") && line.trim().split(", ").any(|listed| listed == name)),
                "{name} is not listed under Environment:\n{help}"
            );
        }
    }
}
