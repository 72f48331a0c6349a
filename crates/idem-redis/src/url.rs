//! Store URLs: `redis://host:port[/db][?options]` for one server,
//! `redis+sentinel://host:port,host:port,.../primary-name[/db][?options]` for a primary that
//! Sentinel watches, and `redis+cluster://host:port,host:port,...[?options]` for a Redis Cluster.
//!
//! The options are the store's own (`prefix`, `poll_interval`, `replicas`, `replica_timeout`);
//! anything else is refused, so that a typo does not go unnoticed. The connection itself
//! (address, user, password, database) is parsed by the `redis` crate.

use std::time::Duration;

use redis::{ConnectionInfo, IntoConnectionInfo, ProtocolVersion};

use idem_core::{redact_url, url_userinfo_end};

use crate::RedisError;

/// The key prefix when the URL names none.
pub(crate) const DEFAULT_PREFIX: &str = "idem";

/// The longest pause between two checks of a waited-on record when no notification comes.
pub(crate) const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(250);

/// How long a write waits for its replicas when the URL names no `replica_timeout`.
pub(crate) const DEFAULT_REPLICA_TIMEOUT: Duration = Duration::from_millis(500);

/// The longest `replica_timeout` a URL may ask for.
const MAX_REPLICA_TIMEOUT: Duration = Duration::from_secs(10);

/// How many replicas must hold a write before the store reports it done (`replicas=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replicas {
    /// One, from the moment the topology shows a replica for every primary (and from then on,
    /// even if the replica goes away); none while a primary has never been seen with one.
    Auto,
    /// Exactly this many, whatever the topology (0: never wait).
    Exactly(u32),
}

/// Where the store lives.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// One server (or a primary that replicas follow).
    Standalone(ConnectionInfo),
    /// The primary that Sentinel names, whichever server that is now.
    Sentinel(SentinelTarget),
    /// The seed nodes of a cluster; the others are discovered.
    Cluster(Vec<ConnectionInfo>),
}

/// A primary found through Sentinel.
#[derive(Debug, Clone)]
pub(crate) struct SentinelTarget {
    /// The sentinels to ask (without credentials: the URL's user and password are the primary's).
    pub(crate) sentinels: Vec<ConnectionInfo>,
    /// The name the sentinels know the primary by.
    pub(crate) primary_name: String,
    /// The connection to the primary, but for its address: credentials, database, protocol.
    pub(crate) primary: ConnectionInfo,
}

/// A parsed store URL.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) target: Target,
    pub(crate) prefix: String,
    pub(crate) poll_interval: Duration,
    /// The replicas a write waits for.
    pub(crate) replicas: Replicas,
    /// How long a write waits for them before the store fails it as unavailable.
    pub(crate) replica_timeout: Duration,
    /// The URL without its password, for messages.
    pub(crate) display: String,
}

/// Parses a store URL.
pub(crate) fn parse(url: &str) -> Result<Config, RedisError> {
    let display = redact_url(url);
    let invalid = |reason: String| RedisError::InvalidUrl {
        url: display.clone(),
        reason,
    };
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| invalid("it has no scheme".to_owned()))?;
    // The query starts after the user info: a password may hold a `?`.
    let hosts_at = url_userinfo_end(rest).map_or(0, |at| at + 1);
    let (location, query) = match rest[hosts_at..].find('?') {
        Some(at) => (&rest[..hosts_at + at], Some(&rest[hosts_at + at + 1..])),
        None => (rest, None),
    };
    if location[hosts_at..].contains('#') || query.is_some_and(|q| q.contains('#')) {
        return Err(invalid("fragments are not supported".to_owned()));
    }
    let mut prefix = DEFAULT_PREFIX.to_owned();
    let mut poll_interval = DEFAULT_POLL_INTERVAL;
    let mut replicas = Replicas::Auto;
    let mut replica_timeout = DEFAULT_REPLICA_TIMEOUT;
    for pair in query.into_iter().flat_map(|q| q.split('&')).filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match name {
            "prefix" => prefix = check_prefix(value).map_err(&invalid)?,
            "poll_interval" => {
                poll_interval = humantime::parse_duration(value)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        invalid(format!(
                            "poll_interval={value:?} is not a positive duration such as 250ms or 2s"
                        ))
                    })?;
            }
            "replicas" => {
                replicas = match value {
                    "auto" => Replicas::Auto,
                    count => Replicas::Exactly(count.parse().map_err(|_| {
                        invalid(format!(
                            "replicas={value:?} is not auto or a number of replicas such as 1 (0: do not wait)"
                        ))
                    })?),
                };
            }
            "replica_timeout" => {
                replica_timeout = humantime::parse_duration(value)
                    .ok()
                    .filter(|d| *d >= Duration::from_millis(1) && *d <= MAX_REPLICA_TIMEOUT)
                    .ok_or_else(|| {
                        invalid(format!(
                            "replica_timeout={value:?} is not a duration from 1ms to 10s such as 500ms"
                        ))
                    })?;
            }
            other => {
                return Err(invalid(format!(
                    "unknown option {other:?}; the options are prefix=NAME, poll_interval=DURATION, \
                     replicas=auto|N and replica_timeout=DURATION"
                )));
            }
        }
    }
    let target = if scheme.eq_ignore_ascii_case("redis") {
        Target::Standalone(connection_info(&format!("redis://{location}"), &invalid)?)
    } else if scheme.eq_ignore_ascii_case("redis+cluster") {
        Target::Cluster(cluster_nodes(location, &invalid)?)
    } else if scheme.eq_ignore_ascii_case("redis+sentinel") {
        Target::Sentinel(sentinel_target(location, &invalid)?)
    } else {
        return Err(invalid(format!(
            "the scheme {scheme:?} is not redis, redis+sentinel or redis+cluster"
        )));
    };
    Ok(Config {
        target,
        prefix,
        poll_interval,
        replicas,
        replica_timeout,
        display,
    })
}

/// A prefix must not contain braces: the first `{...}` of a key is its cluster hash tag, and it
/// must be the record's own tag, not the prefix.
fn check_prefix(value: &str) -> Result<String, String> {
    if value.is_empty() {
        return Err("prefix= is empty".to_owned());
    }
    if value.contains(['{', '}']) {
        return Err(format!(
            "prefix={value:?} contains a brace, which would change the keys' cluster hash tag"
        ));
    }
    if value.chars().any(|c| c.is_control() || c == ' ') {
        return Err(format!("prefix={value:?} contains spaces or control characters"));
    }
    Ok(value.to_owned())
}

/// `host:port,host:port,...`, optionally after `user:password@` (which applies to every node) and
/// before a `/` with no database (a cluster has only database 0).
fn cluster_nodes(location: &str, invalid: &impl Fn(String) -> RedisError) -> Result<Vec<ConnectionInfo>, RedisError> {
    let (userinfo, rest) = split_userinfo(location);
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    if !path.is_empty() && path != "0" {
        return Err(invalid(
            "a Redis Cluster has only database 0; remove the path after the node list".to_owned(),
        ));
    }
    host_list(hosts, "node", invalid, |host| {
        let node = match userinfo {
            Some(userinfo) => format!("redis://{userinfo}@{host}"),
            None => format!("redis://{host}"),
        };
        connection_info(&node, invalid)
    })
}

/// `host:port,host:port,.../primary-name[/db]`, optionally after `user:password@` (the
/// primary's credentials; the sentinels are asked without any).
fn sentinel_target(location: &str, invalid: &impl Fn(String) -> RedisError) -> Result<SentinelTarget, RedisError> {
    let (userinfo, rest) = split_userinfo(location);
    let (hosts, path) = rest.split_once('/').ok_or_else(|| {
        invalid("it names no primary; expected redis+sentinel://host:port,host:port/primary-name".to_owned())
    })?;
    let (primary_name, db) = path.split_once('/').unwrap_or((path, ""));
    if primary_name.is_empty() {
        return Err(invalid(
            "the primary's name is empty; expected redis+sentinel://host:port,host:port/primary-name".to_owned(),
        ));
    }
    let sentinels = host_list(hosts, "sentinel", invalid, |host| {
        // `[v6]:port` or `host:port`: the port is never left to the client's default (6379).
        let port = match host.strip_prefix('[') {
            Some(v6) => v6.split_once("]:").map(|(_, port)| port),
            None => host.rsplit_once(':').map(|(_, port)| port),
        };
        if port.is_none_or(str::is_empty) {
            return Err(invalid(format!(
                "the sentinel {host:?} has no port (sentinels listen on 26379)"
            )));
        }
        format!("redis://{host}")
            .into_connection_info()
            .map_err(|err| invalid(format!("{err}")))
    })?;
    // The primary's address comes from the sentinels; this one is replaced before any use.
    let primary = match userinfo {
        Some(userinfo) => format!("redis://{userinfo}@sentinel.invalid/{db}"),
        None => format!("redis://sentinel.invalid/{db}"),
    };
    Ok(SentinelTarget {
        sentinels,
        primary_name: primary_name.to_owned(),
        primary: connection_info(&primary, invalid)?,
    })
}

/// The user info of `location` (a URL after its `://` and before its query) and what follows it,
/// split where every URL of idem is ([`url_userinfo_end`]).
fn split_userinfo(location: &str) -> (Option<&str>, &str) {
    match url_userinfo_end(location) {
        Some(at) => (Some(&location[..at]), &location[at + 1..]),
        None => (None, location),
    }
}

/// The entries of a comma-separated list of `host:port` (`what` names them in errors), trimmed,
/// each read by `read`; an empty entry is refused.
fn host_list<T>(
    hosts: &str,
    what: &str,
    invalid: &impl Fn(String) -> RedisError,
    read: impl Fn(&str) -> Result<T, RedisError>,
) -> Result<Vec<T>, RedisError> {
    hosts
        .split(',')
        .map(str::trim)
        .map(|host| {
            if host.is_empty() {
                return Err(invalid(format!(
                    "the {what} list has an empty entry; expected host:port,host:port,..."
                )));
            }
            read(host)
        })
        .collect()
}

/// The `redis` crate's reading of a `redis://` URL, switched to RESP3 (pub/sub messages arrive as
/// push messages on the ordinary multiplexed connection).
fn connection_info(url: &str, invalid: &impl Fn(String) -> RedisError) -> Result<ConnectionInfo, RedisError> {
    let info = url.into_connection_info().map_err(|err| invalid(format!("{err}")))?;
    let settings = info.redis_settings().clone().set_protocol(ProtocolVersion::RESP3);
    Ok(info.set_redis_settings(settings))
}

#[cfg(test)]
mod tests {
    use redis::ConnectionAddr;

    use super::*;

    fn tcp(info: &ConnectionInfo) -> (String, u16) {
        match info.addr() {
            ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
            other => panic!("not TCP: {other:?}"),
        }
    }

    #[test]
    fn standalone() {
        let config = parse("redis://127.0.0.1:6380/2").unwrap();
        let Target::Standalone(info) = &config.target else {
            panic!("standalone expected")
        };
        assert_eq!(tcp(info), ("127.0.0.1".to_owned(), 6380));
        assert_eq!(info.redis_settings().db(), 2);
        assert_eq!(info.redis_settings().protocol(), ProtocolVersion::RESP3);
        assert_eq!(config.prefix, DEFAULT_PREFIX);
        assert_eq!(config.poll_interval, DEFAULT_POLL_INTERVAL);
        assert_eq!(config.replicas, Replicas::Auto);
        assert_eq!(config.replica_timeout, DEFAULT_REPLICA_TIMEOUT);

        let config = parse("redis://localhost?prefix=test-1&poll_interval=60s").unwrap();
        let Target::Standalone(info) = &config.target else {
            panic!("standalone expected")
        };
        assert_eq!(tcp(info), ("localhost".to_owned(), 6379));
        assert_eq!(config.prefix, "test-1");
        assert_eq!(config.poll_interval, Duration::from_secs(60));

        let config = parse("redis://localhost?replicas=2&replica_timeout=1s").unwrap();
        assert_eq!(config.replicas, Replicas::Exactly(2));
        assert_eq!(config.replica_timeout, Duration::from_secs(1));
        assert_eq!(
            parse("redis://localhost?replicas=0").unwrap().replicas,
            Replicas::Exactly(0)
        );
        assert_eq!(
            parse("redis://localhost?replicas=auto").unwrap().replicas,
            Replicas::Auto
        );
    }

    #[test]
    fn cluster() {
        let config = parse("redis+cluster://app:secret@10.0.0.1:7001,10.0.0.2:7002, 10.0.0.3:7003/?prefix=x").unwrap();
        let Target::Cluster(nodes) = &config.target else {
            panic!("cluster expected")
        };
        let addrs: Vec<_> = nodes.iter().map(tcp).collect();
        assert_eq!(
            addrs,
            [
                ("10.0.0.1".to_owned(), 7001),
                ("10.0.0.2".to_owned(), 7002),
                ("10.0.0.3".to_owned(), 7003)
            ]
        );
        for node in nodes {
            assert_eq!(node.redis_settings().username(), Some("app"));
            assert_eq!(node.redis_settings().password(), Some("secret"));
            assert_eq!(node.redis_settings().protocol(), ProtocolVersion::RESP3);
        }
        assert_eq!(config.prefix, "x");
        assert_eq!(
            config.display,
            "redis+cluster://app:***@10.0.0.1:7001,10.0.0.2:7002, 10.0.0.3:7003/?prefix=x"
        );
    }

    #[test]
    fn sentinel() {
        let config = parse("redis+sentinel://app:secret@10.0.0.1:26379,10.0.0.2:26380/payments/2?replicas=1").unwrap();
        let Target::Sentinel(target) = &config.target else {
            panic!("sentinel expected")
        };
        let addrs: Vec<_> = target.sentinels.iter().map(tcp).collect();
        assert_eq!(addrs, [("10.0.0.1".to_owned(), 26379), ("10.0.0.2".to_owned(), 26380)]);
        for sentinel in &target.sentinels {
            assert_eq!(
                sentinel.redis_settings().password(),
                None,
                "the password is the primary's"
            );
        }
        assert_eq!(target.primary_name, "payments");
        assert_eq!(target.primary.redis_settings().db(), 2);
        assert_eq!(target.primary.redis_settings().username(), Some("app"));
        assert_eq!(target.primary.redis_settings().password(), Some("secret"));
        assert_eq!(target.primary.redis_settings().protocol(), ProtocolVersion::RESP3);
        assert_eq!(config.replicas, Replicas::Exactly(1));
        assert_eq!(
            config.display,
            "redis+sentinel://app:***@10.0.0.1:26379,10.0.0.2:26380/payments/2?replicas=1"
        );
        let Target::Sentinel(target) = parse("redis+sentinel://s1:26379/idem").unwrap().target else {
            panic!("sentinel expected")
        };
        assert_eq!(target.primary.redis_settings().db(), 0);
    }

    #[test]
    fn refusals_say_why() {
        for (url, why) in [
            ("127.0.0.1:6379", "no scheme"),
            (
                "postgres://localhost/test",
                "not redis, redis+sentinel or redis+cluster",
            ),
            ("redis+sentinel://s1:26379", "names no primary"),
            ("redis+sentinel://s1:26379/", "primary's name is empty"),
            ("redis+sentinel://s1:26379,,s2:26379/idem", "empty entry"),
            ("redis+sentinel://s1/idem", "has no port"),
            ("redis+sentinel://[::1]/idem", "has no port"),
            ("redis+sentinel://s1:/idem", "has no port"),
            ("redis://localhost?prefix={x}", "brace"),
            ("redis://localhost?prefix=", "empty"),
            ("redis://localhost?poll_interval=soon", "positive duration"),
            ("redis://localhost?poll_interval=0s", "positive duration"),
            ("redis://localhost?protocol=2", "unknown option"),
            ("redis://localhost?replicas=one", "not auto or a number"),
            ("redis://localhost?replicas=-1", "not auto or a number"),
            ("redis://localhost?replica_timeout=0s", "from 1ms to 10s"),
            ("redis://localhost?replica_timeout=1m", "from 1ms to 10s"),
            ("redis+cluster://a:1,,b:2", "empty entry"),
            ("redis+cluster://a:1,b:2/3", "only database 0"),
        ] {
            let err = parse(url).unwrap_err().to_string();
            assert!(err.contains(why), "{url}: {err}");
        }
    }

    #[test]
    fn passwords_stay_out_of_messages() {
        assert_eq!(redact_url("redis://:hunter2@host:1/0"), "redis://:***@host:1/0");
        assert_eq!(redact_url("redis://user:hunter2@host"), "redis://user:***@host");
        assert_eq!(redact_url("redis://token@host"), "redis://***@host");
        assert_eq!(redact_url("redis://host:1?prefix=a@b"), "redis://host:1?prefix=a@b");
        let err = parse("redis://user:hunter2@host?nope=1").unwrap_err().to_string();
        assert!(!err.contains("hunter2"), "{err}");
    }
}
