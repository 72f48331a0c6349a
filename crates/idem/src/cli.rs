//! The command line: every flag also reads `IDEM_<FLAG>` from the environment, and `idem serve`'s
//! also from its config file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use idem_core::{AnonymousPolicy, KeyTimeFormats, MissingKeyPolicy, PathReadings, ScopeSource};
use serde::Deserialize;

use crate::config::de;
use crate::units::{parse_duration, parse_method, parse_size};

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

/// The command, with `idem serve`'s defaults in its help (its flags have none of their own, so
/// that the config file can come between them and the defaults).
fn command() -> clap::Command {
    Cli::command().mut_subcommand("serve", |serve| {
        crate::config::Defaults::shown()
            .into_iter()
            .fold(serve, |serve, (id, default)| {
                serve.mut_arg(id, |arg| {
                    let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
                    arg.help(format!("{help} [default: {default}]"))
                })
            })
    })
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the gateway: a reverse proxy that applies the idempotency protocol in front of any HTTP upstream.
    Serve(Box<ServeArgs>),
    /// Show one record: when, which method and path, its state, its stored status, its replays.
    /// A key without a record exits 1, with a message on stderr (with --json too).
    Inspect(InspectArgs),
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
    /// The store: sqlite://PATH, postgres://…, redis://HOST:PORT or redis+cluster://H1:P1,H2:P2,….
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

/// Every setting of `idem serve`, as a flag (also read from `IDEM_<FLAG>`) and as a key of the
/// config file by the same name. `None`: this source leaves the setting to the next one; the
/// defaults are in one place (`config::Defaults`, and `Policy::default` for the protocol's).
#[derive(Debug, Default, Args, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct ServeSettings {
    /// The upstream every request is forwarded to, such as http://127.0.0.1:3000 (required).
    #[arg(long, env = "IDEM_UPSTREAM")]
    #[serde(deserialize_with = "de::parsed")]
    pub(crate) upstream: Option<http::Uri>,
    /// Where the gateway listens.
    #[arg(long, env = "IDEM_LISTEN")]
    #[serde(deserialize_with = "de::parsed")]
    pub(crate) listen: Option<SocketAddr>,
    /// Where /metrics, /healthz and /readyz are served.
    #[arg(long, env = "IDEM_ADMIN_LISTEN")]
    #[serde(deserialize_with = "de::parsed")]
    pub(crate) admin_listen: Option<SocketAddr>,
    /// The store: sqlite://PATH, postgres://…, redis://HOST:PORT or redis+cluster://H1:P1,H2:P2,….
    #[arg(long, env = "IDEM_STORE")]
    pub(crate) store: Option<String>,
    /// How long an answer is replayable.
    #[arg(long, env = "IDEM_TTL", value_parser = parse_duration)]
    #[serde(deserialize_with = "de::duration")]
    pub(crate) ttl: Option<Duration>,
    /// How long an expired key still answers key-expired.
    #[arg(long, env = "IDEM_TOMBSTONE_TTL", value_parser = parse_duration)]
    #[serde(deserialize_with = "de::duration")]
    pub(crate) tombstone_ttl: Option<Duration>,
    /// The lease of a running request; renewed while it runs.
    #[arg(long, env = "IDEM_LEASE", value_parser = parse_duration)]
    #[serde(deserialize_with = "de::duration")]
    pub(crate) lease: Option<Duration>,
    /// How long a request may run before it is given up and its key released as unknown (the
    /// retry runs, marked Idempotency-Recovered), so a hung upstream never wedges its key.
    #[arg(long, env = "IDEM_RUN_TIMEOUT", value_parser = parse_duration)]
    #[serde(deserialize_with = "de::duration")]
    pub(crate) run_timeout: Option<Duration>,
    /// How long a copy waits for the first request before 409 key-in-flight.
    #[arg(long, env = "IDEM_WAIT", value_parser = parse_duration)]
    #[serde(deserialize_with = "de::duration")]
    pub(crate) wait: Option<Duration>,
    /// Who the caller is: credential, none or header:NAME.
    #[arg(long, env = "IDEM_SCOPE")]
    #[serde(deserialize_with = "de::parsed")]
    pub(crate) scope: Option<ScopeSource>,
    /// Keyed requests from callers without a credential (or scope header): allow (they share the
    /// anonymous scope) or reject (401 credential-missing).
    #[arg(long, env = "IDEM_ANONYMOUS")]
    #[serde(deserialize_with = "de::parsed")]
    pub(crate) anonymous: Option<AnonymousPolicy>,
    /// Key formats whose embedded time expires a key older than --ttl on first sight: uuid7,
    /// ulid (comma-separated) or off. ULIDs have no version marker, so any 26-character Crockford
    /// string reads as one: add ulid only if your clients send ULIDs.
    #[arg(long, env = "IDEM_EXPIRE_BY_KEY_TIME")]
    #[serde(deserialize_with = "de::parsed")]
    pub(crate) expire_by_key_time: Option<KeyTimeFormats>,
    /// Keyless requests: allow, require, grace:<RFC 3339 date> or fingerprint:<duration>.
    #[arg(long, env = "IDEM_MISSING_KEY")]
    #[serde(deserialize_with = "de::parsed")]
    pub(crate) missing_key: Option<MissingKeyPolicy>,
    /// The methods the protocol applies to, comma-separated.
    #[arg(long, env = "IDEM_METHODS", value_delimiter = ',', value_parser = parse_method)]
    #[serde(deserialize_with = "de::methods")]
    pub(crate) methods: Option<Vec<http::Method>>,
    /// The largest keyed request body (larger: 413).
    #[arg(long, env = "IDEM_MAX_BODY", value_parser = parse_size)]
    #[serde(deserialize_with = "de::size")]
    pub(crate) max_body: Option<usize>,
    /// The largest answer stored whole; larger answers stream through and are stored compact.
    #[arg(long, env = "IDEM_MAX_STORED_BODY", value_parser = parse_size)]
    #[serde(deserialize_with = "de::size")]
    pub(crate) max_stored_body: Option<usize>,
    /// Store 5xx answers instead of letting a retry run again.
    #[arg(long, env = "IDEM_STORE_5XX", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub(crate) store_5xx: Option<bool>,
    /// Forward requests unprotected when the store is down, instead of 503.
    #[arg(long, env = "IDEM_FAIL_OPEN", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub(crate) fail_open: Option<bool>,
    /// How long a client waits for the upstream before 504; the gateway keeps waiting and stores
    /// the answer for the retry.
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT", value_parser = parse_duration)]
    #[serde(deserialize_with = "de::duration")]
    pub(crate) upstream_timeout: Option<Duration>,
    /// How long a client may take to send a request's head (counted from when its connection
    /// opened or went idle, so an idle connection is closed after it too), and how long in all it
    /// may keep the gateway waiting for the body (a keyed body cut off by it is 400
    /// body-incomplete, nothing claimed).
    #[arg(long, env = "IDEM_READ_TIMEOUT", value_parser = parse_duration)]
    #[serde(deserialize_with = "de::duration")]
    pub(crate) read_timeout: Option<Duration>,
    /// The most client connections open at once; further connections wait in the listen queue
    /// until one closes.
    #[arg(long, env = "IDEM_MAX_CONNECTIONS")]
    pub(crate) max_connections: Option<usize>,
    /// On SIGTERM: how long running requests may take to finish and store their answers before
    /// the gateway closes what is left and exits.
    #[arg(long, env = "IDEM_SHUTDOWN_GRACE", value_parser = parse_duration)]
    #[serde(deserialize_with = "de::duration")]
    pub(crate) shutdown_grace: Option<Duration>,
    /// A PEM bundle of CA certificates trusted for an https:// upstream, besides the system's; a
    /// server certificate that is one of them byte for byte is accepted as pinned (a self-signed
    /// `openssl req -x509` certificate), if it names the upstream and is valid now.
    #[arg(long, env = "IDEM_UPSTREAM_CA", value_name = "FILE")]
    pub(crate) upstream_ca: Option<PathBuf>,
    /// Speak HTTP/2 by prior knowledge (h2c) to an http:// upstream. Over https:// HTTP/2 is
    /// negotiated by ALPN without asking.
    #[arg(long, env = "IDEM_UPSTREAM_HTTP2", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub(crate) upstream_http2: Option<bool>,
    /// Serve clients over TLS with this PEM certificate chain (the server's first); needs
    /// --tls-key. ALPN offers h2 and http/1.1.
    #[arg(long, env = "IDEM_TLS_CERT", value_name = "FILE")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "IDEM_TLS_KEY", value_name = "FILE")]
    pub(crate) tls_key: Option<PathBuf>,
    /// How the upstream reads paths, besides as sent and normalised (percent-decoded, dot
    /// segments removed, slashes merged, a trailing slash ignored), which routes always match:
    /// standard, or case-insensitive and/or strip-params (comma-separated) for upstreams that
    /// route case-insensitively (ASP.NET) or drop `;params` (Tomcat).
    #[arg(long, env = "IDEM_PATH_READINGS")]
    #[serde(deserialize_with = "de::parsed")]
    pub(crate) path_readings: Option<PathReadings>,
    /// Rules by path, in the config file only: `[[route]]` tables.
    #[arg(skip)]
    pub(crate) route: Vec<RouteSettings>,
}

/// One `[[route]]` table of the config file: which paths, and the settings that differ there
/// from the gateway's (any setting left out is the gateway's).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RouteSettings {
    /// `/exact`, `/with/{param}` segments, or a `/prefix/*`.
    pub(crate) path: toml::Spanned<String>,
    /// `false`: pass the route's requests through untouched.
    #[serde(default)]
    pub(crate) enabled: Option<bool>,
    #[serde(default, deserialize_with = "de::methods")]
    pub(crate) methods: Option<Vec<http::Method>>,
    #[serde(default, deserialize_with = "de::duration")]
    pub(crate) ttl: Option<Duration>,
    #[serde(default, deserialize_with = "de::duration")]
    pub(crate) tombstone_ttl: Option<Duration>,
    #[serde(default, deserialize_with = "de::parsed")]
    pub(crate) missing_key: Option<MissingKeyPolicy>,
    #[serde(default, deserialize_with = "de::parsed")]
    pub(crate) scope: Option<ScopeSource>,
    #[serde(default, deserialize_with = "de::size")]
    pub(crate) max_body: Option<usize>,
    #[serde(default, deserialize_with = "de::size")]
    pub(crate) max_stored_body: Option<usize>,
    #[serde(default)]
    pub(crate) store_5xx: Option<bool>,
    #[serde(default, deserialize_with = "de::duration")]
    pub(crate) run_timeout: Option<Duration>,
}

/// A setting that parses but cannot work: `idem` exits 2 (as for a usage error) naming the flag
/// (or the environment variable, for a setting that is read from the environment only).
#[derive(Debug, thiserror::Error)]
#[error("{}{flag}: {reason}", if flag.starts_with("IDEM_") { "" } else { "--" })]
pub(crate) struct Misconfigured {
    pub(crate) flag: &'static str,
    pub(crate) reason: String,
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
    #[test]
    fn the_command_line_is_well_formed() {
        // Also checks that every default shown names a flag of `idem serve`.
        super::command().debug_assert();
    }
}
