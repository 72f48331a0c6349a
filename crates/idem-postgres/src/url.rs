//! `postgres://` URLs: the options of this store are taken out of the query string; everything
//! else is handed to tokio-postgres as it is.

use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::config::Host;

use idem_core::{redact_url, url_userinfo_end};

use crate::PostgresError;
use crate::read_first::ReadFirst;

/// Connections in the pool unless `pool_size` says otherwise.
pub(crate) const DEFAULT_POOL_SIZE: usize = 16;
/// Connections shared by replays' reads unless `read_connections` says otherwise.
pub(crate) const DEFAULT_READ_CONNECTIONS: usize = 2;
/// The longest pause between two checks of a waiter unless `poll_interval` says otherwise.
pub(crate) const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// How long connecting may take unless `connect_timeout` says otherwise.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive unless the URL says otherwise: a connection whose peer vanished (a half-open
/// connection after a failover or a dropped NAT entry) is found dead within about a minute,
/// instead of after the kernel's two hours.
const DEFAULT_KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const DEFAULT_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const DEFAULT_KEEPALIVE_RETRIES: u32 = 3;
/// Names the connections in `pg_stat_activity` unless `application_name` says otherwise.
const DEFAULT_APPLICATION_NAME: &str = "idem";

/// What a store URL says.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// The connection settings for tokio-postgres, this store's options removed.
    pub(crate) config: tokio_postgres::Config,
    /// The server, for messages: `user@host:port/database`, never a password.
    pub(crate) target: String,
    /// `pool_size=N`.
    pub(crate) pool_size: usize,
    /// `notify=on|off`: whether waiters are woken by `LISTEN`/`NOTIFY`.
    pub(crate) notify: bool,
    /// `poll_interval=DUR`: the longest pause between two checks of a waiter.
    pub(crate) poll_interval: Duration,
    /// `schema=NAME`: the PostgreSQL schema that holds the tables, created if missing.
    pub(crate) schema: Option<String>,
    /// `read_first=auto|always|never`: whether `begin` reads the record on a shared connection
    /// before it claims (`read_first.rs`).
    pub(crate) read_first: ReadFirst,
    /// `read_connections=N`: the connections those reads share.
    pub(crate) read_connections: usize,
    /// The URL with this store's options taken out, as other clients of the database connect.
    pub(crate) database_url: String,
}

/// The database a store URL names, for a service's own connections beside the store (its
/// business tables, written in the transactions that complete records): the URL without the
/// store's own options (`pool_size`, `notify`, `poll_interval`, `schema`, `read_first`,
/// `read_connections`), which sqlx or tokio-postgres connect with, and the store's schema. Parsed
/// as the store parses its URL, so a password holding `?` or `#` is never taken for options.
#[derive(Clone)]
pub struct StoreDatabase {
    url: String,
    schema: Option<String>,
}

impl StoreDatabase {
    /// Reads the database of the store URL `url`; refused as [`PostgresStore::connect`]
    /// would refuse it.
    ///
    /// [`PostgresStore::connect`]: crate::PostgresStore::connect
    pub fn parse(url: &str) -> Result<Self, PostgresError> {
        let settings = Settings::parse(url)?;
        Ok(Self {
            url: settings.database_url,
            schema: settings.schema,
        })
    }

    /// The URL to connect with: the store's, its own options taken out (it may hold a password).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The schema of the store's tables and functions (`schema=`), if the URL named one.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// `name` in the store's schema (`"schema".name`), or as it is without one, for SQL.
    pub fn qualify(&self, name: &str) -> String {
        match &self.schema {
            // Checked when the URL was read: lower-case letters, digits and `_`.
            Some(schema) => format!("\"{schema}\".{name}"),
            None => name.to_owned(),
        }
    }
}

impl std::fmt::Debug for StoreDatabase {
    /// Never shows the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreDatabase")
            .field("url", &redact_url(&self.url))
            .field("schema", &self.schema)
            .finish()
    }
}

impl Settings {
    /// Parses `postgres://user[:password]@host[:port]/database[?options]` (or `postgresql://`).
    pub(crate) fn parse(url: &str) -> Result<Self, PostgresError> {
        let invalid = |reason: String| PostgresError::InvalidUrl {
            url: redact_url(url),
            reason,
        };
        let scheme = url.split_once("://").map(|(scheme, _)| scheme);
        if !scheme.is_some_and(|s| s.eq_ignore_ascii_case("postgres") || s.eq_ignore_ascii_case("postgresql")) {
            return Err(invalid("the scheme is not postgres:// or postgresql://".to_owned()));
        }
        // The query starts after the user info: a password may hold a `?`.
        let hosts_at = url.find("://").map_or(0, |at| {
            let rest = &url[at + 3..];
            at + 3 + url_userinfo_end(rest).map_or(0, |end| end + 1)
        });
        let (base, query) = match url[hosts_at..].find('?') {
            Some(at) => (&url[..hosts_at + at], &url[hosts_at + at + 1..]),
            None => (url, ""),
        };
        let mut pool_size = DEFAULT_POOL_SIZE;
        let mut notify = true;
        let mut poll_interval = DEFAULT_POLL_INTERVAL;
        let mut schema = None;
        let mut read_first = ReadFirst::Auto;
        let mut read_connections = DEFAULT_READ_CONNECTIONS;
        let mut passed_on = Vec::new();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            match name {
                "pool_size" => {
                    pool_size = value
                        .parse()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| invalid(format!("pool_size={value} is not a positive number")))?;
                }
                "notify" => {
                    notify = match value {
                        "on" | "true" | "1" => true,
                        "off" | "false" | "0" => false,
                        _ => return Err(invalid(format!("notify={value} is neither on nor off"))),
                    };
                }
                "poll_interval" => {
                    poll_interval = humantime::parse_duration(value)
                        .ok()
                        .filter(|d| !d.is_zero())
                        .ok_or_else(|| {
                            invalid(format!(
                                "poll_interval={value} is not a positive duration such as 200ms or 1s"
                            ))
                        })?;
                }
                "schema" => {
                    check_schema_name(value).map_err(|why| invalid(format!("schema={value} {why}")))?;
                    schema = Some(value.to_owned());
                }
                "read_first" => {
                    read_first = match value {
                        "auto" => ReadFirst::Auto,
                        "always" => ReadFirst::Always,
                        "never" => ReadFirst::Never,
                        _ => return Err(invalid(format!("read_first={value} is not auto, always or never"))),
                    };
                }
                "read_connections" => {
                    read_connections = value.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                        invalid(format!(
                            "read_connections={value} is not a positive number (read_first=never turns the reads off)"
                        ))
                    })?;
                }
                _ => passed_on.push(pair),
            }
        }
        let rest = if passed_on.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", passed_on.join("&"))
        };
        let mut config =
            tokio_postgres::Config::from_str(&rest).map_err(|err| invalid(crate::error::describe(&err)))?;
        if config.get_hosts().is_empty() {
            return Err(invalid("it names no host".to_owned()));
        }
        if config.get_application_name().is_none() {
            config.application_name(DEFAULT_APPLICATION_NAME);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
        }
        let given = |name: &str| rest.contains(&format!("{name}="));
        config.keepalives(true);
        if !given("keepalives_idle") {
            config.keepalives_idle(DEFAULT_KEEPALIVE_IDLE);
        }
        if !given("keepalives_interval") {
            config.keepalives_interval(DEFAULT_KEEPALIVE_INTERVAL);
        }
        if !given("keepalives_retries") {
            config.keepalives_retries(DEFAULT_KEEPALIVE_RETRIES);
        }
        if let Some(schema) = &schema {
            // A startup option rather than a `SET` per connection: it survives `RESET ALL` and
            // applies to every connection made from this configuration.
            let options = match config.get_options() {
                Some(options) if !options.trim().is_empty() => format!("{options} -c search_path={schema}"),
                _ => format!("-c search_path={schema}"),
            };
            config.options(options);
        }
        let target = target_of(&config);
        Ok(Self {
            config,
            target,
            pool_size,
            notify,
            poll_interval,
            schema,
            read_first,
            read_connections,
            database_url: rest,
        })
    }
}

/// Schema names are kept to what needs no quoting anywhere (an unquoted identifier, which
/// PostgreSQL would fold to lower case, and no space, which the startup options would split at).
fn check_schema_name(name: &str) -> Result<(), &'static str> {
    let mut chars = name.chars();
    match chars.next() {
        None => return Err("is empty"),
        Some(c) if !(c.is_ascii_lowercase() || c == '_') => {
            return Err("must start with a lower-case letter or _");
        }
        Some(_) => {}
    }
    if !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
        return Err("may only hold lower-case letters, digits and _");
    }
    if name.len() > 63 {
        return Err("is longer than 63 characters");
    }
    if name.starts_with("pg_") {
        return Err("must not start with pg_ (reserved by PostgreSQL)");
    }
    Ok(())
}

/// `user@host:port/database`, as PostgreSQL will see it.
pub(crate) fn target_of(config: &tokio_postgres::Config) -> String {
    let ports = config.get_ports();
    let hosts = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            match host {
                Host::Tcp(name) if name.contains(':') => format!("[{name}]:{port}"),
                Host::Tcp(name) => format!("{name}:{port}"),
                #[cfg(unix)]
                Host::Unix(path) => format!("{}:{port}", path.display()),
            }
        })
        .collect::<Vec<_>>()
        .join(",");
    let user = config.get_user().map(|user| format!("{user}@")).unwrap_or_default();
    let database = config.get_dbname().or(config.get_user()).unwrap_or("");
    format!("{user}{hosts}/{database}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_its_options_out_and_passes_the_rest_on() {
        let settings = Settings::parse(
            "postgres://idem:pw@db.local:6432/app?pool_size=4&notify=off&poll_interval=1s&schema=tenant_1&application_name=pay",
        )
        .unwrap();
        assert_eq!(settings.pool_size, 4);
        assert!(!settings.notify);
        assert_eq!(settings.poll_interval, Duration::from_secs(1));
        assert_eq!(settings.schema.as_deref(), Some("tenant_1"));
        assert_eq!(settings.config.get_application_name(), Some("pay"));
        assert_eq!(settings.config.get_options(), Some("-c search_path=tenant_1"));
        assert_eq!(settings.config.get_password(), Some(&b"pw"[..]));
        assert_eq!(settings.target, "idem@db.local:6432/app");
    }

    #[test]
    fn reads_first_as_told_and_refuses_what_is_not_a_setting() {
        let settings =
            Settings::parse("postgres://p@h/d?read_first=never&read_connections=3&application_name=x").unwrap();
        assert_eq!((settings.read_first, settings.read_connections), (ReadFirst::Never, 3));
        assert_eq!(settings.database_url, "postgres://p@h/d?application_name=x");
        let always = Settings::parse("postgres://p@h/d?read_first=always").unwrap();
        assert_eq!(always.read_first, ReadFirst::Always);
        for (bad, says) in [
            (
                "read_first=sometimes",
                "read_first=sometimes is not auto, always or never",
            ),
            ("read_connections=0", "read_connections=0 is not a positive number"),
            ("read_connections=two", "read_connections=two is not a positive number"),
        ] {
            let err = Settings::parse(&format!("postgres://p@h/d?{bad}"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn defaults() {
        let settings = Settings::parse("postgresql://postgres@127.0.0.1/test").unwrap();
        assert_eq!(settings.pool_size, DEFAULT_POOL_SIZE);
        assert!(settings.notify);
        assert_eq!(settings.poll_interval, DEFAULT_POLL_INTERVAL);
        assert_eq!(settings.schema, None);
        assert_eq!(settings.read_first, ReadFirst::Auto);
        assert_eq!(settings.read_connections, DEFAULT_READ_CONNECTIONS);
        assert_eq!(settings.config.get_options(), None);
        assert_eq!(settings.config.get_application_name(), Some("idem"));
        assert_eq!(settings.config.get_connect_timeout(), Some(&DEFAULT_CONNECT_TIMEOUT));
        assert!(settings.config.get_keepalives());
        assert_eq!(settings.config.get_keepalives_idle(), DEFAULT_KEEPALIVE_IDLE);
        assert_eq!(settings.target, "postgres@127.0.0.1:5432/test");
    }

    #[test]
    fn keeps_the_callers_startup_options() {
        let settings =
            Settings::parse("postgres://u@h/d?options=-c%20statement_timeout%3D5s&schema=s&connect_timeout=3").unwrap();
        assert_eq!(
            settings.config.get_options(),
            Some("-c statement_timeout=5s -c search_path=s")
        );
        assert_eq!(settings.config.get_connect_timeout(), Some(&Duration::from_secs(3)));
        let keepalive = Settings::parse("postgres://u@h/d?keepalives_idle=300").unwrap();
        assert_eq!(keepalive.config.get_keepalives_idle(), Duration::from_secs(300));
    }

    #[test]
    fn refusals_say_why_and_hide_the_password() {
        for (url, why) in [
            ("sqlite://idem.db", "scheme"),
            ("postgres://u:secret@h/d?pool_size=0", "pool_size=0"),
            ("postgres://u:secret@h/d?notify=maybe", "notify=maybe"),
            ("postgres://u:secret@h/d?poll_interval=fast", "poll_interval=fast"),
            ("postgres://u:secret@h/d?schema=Tenant", "schema=Tenant"),
            ("postgres://u:secret@h/d?schema=a%20b", "schema=a%20b"),
            ("postgres://u:secret@h/d?schema=pg_x", "pg_"),
            ("postgres://u:secret@h:port/d", "invalid"),
        ] {
            let err = Settings::parse(url).unwrap_err().to_string();
            assert!(err.contains(why), "{url}: {err}");
            assert!(!err.contains("secret"), "{url}: {err}");
        }
    }

    #[test]
    fn the_store_database_is_the_url_without_the_store_options() {
        let database =
            StoreDatabase::parse("postgres://u:p?w@h:5432/d?pool_size=4&schema=pay_1&application_name=pay").unwrap();
        assert_eq!(database.url(), "postgres://u:p?w@h:5432/d?application_name=pay");
        assert_eq!(database.schema(), Some("pay_1"));
        assert_eq!(database.qualify("ledger"), "\"pay_1\".ledger");
        assert!(!format!("{database:?}").contains(":p?w@"), "{database:?}");
        let database = StoreDatabase::parse("postgres://h/d?notify=off").unwrap();
        assert_eq!((database.url(), database.schema()), ("postgres://h/d", None));
        assert_eq!(database.qualify("ledger"), "ledger");
        let database = StoreDatabase::parse("postgres://h/d").unwrap();
        assert_eq!((database.url(), database.schema()), ("postgres://h/d", None));
    }

    #[test]
    fn a_password_with_a_question_mark_or_a_hash_is_never_taken_for_options_or_shown() {
        for url in [
            "postgres://u:pa?ss=TOPSECRET@h/d",
            "postgres://u:pa#TOPSECRET@h/d?pool_size=0",
            "postgres://u:a?pool_size=0&TOPSECRET@h:port/d",
        ] {
            match Settings::parse(url) {
                Ok(settings) => assert_eq!(settings.pool_size, DEFAULT_POOL_SIZE, "{url}: no option taken from it"),
                Err(err) => assert!(!err.to_string().contains("TOPSECRET"), "{url}: {err}"),
            }
        }
    }
}
