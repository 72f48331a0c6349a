//! Finding the primary through Sentinel.
//!
//! Every sentinel is asked at once (`SENTINEL get-master-addr-by-name`); the address most of them
//! name is checked against the server itself (`ROLE` must say `master`), then the others, so a
//! sentinel that has not yet heard of a failover, or a primary that was demoted, is never written
//! to as the primary. While the store lives, the sentinels are asked again every second
//! (`conn::follow_sentinels`), and the store's connections move to a new primary as soon as most
//! of them name one. Between the failure and the move, calls fail as unavailable (a demoted
//! primary refuses writes with `READONLY`): nothing is ever written where a failover could lose
//! it unseen.

use redis::{ConnectionAddr, ConnectionInfo, ErrorKind, RedisResult, Value};

use crate::decode::{text, unexpected};
use crate::timeouts::{CONNECTION_TIMEOUT, RESPONSE_TIMEOUT};
use crate::url::SentinelTarget;

/// The addresses the sentinels give for the primary, the one most of them name first: every
/// sentinel is asked at once, so one that is cut off from the others (and still names an old
/// primary) is outvoted, and one that does not answer is not waited for beyond its timeout.
pub(crate) async fn named_primaries(target: &SentinelTarget) -> RedisResult<Vec<(String, u16)>> {
    let answers = futures_util::future::join_all(
        target
            .sentinels
            .iter()
            .map(|sentinel| ask(sentinel, &target.primary_name)),
    )
    .await;
    let mut votes: Vec<((String, u16), usize)> = Vec::new();
    let mut last = None;
    for answer in answers {
        match answer {
            Ok(address) => match votes.iter_mut().find(|(named, _)| *named == address) {
                Some((_, count)) => *count += 1,
                None => votes.push((address, 1)),
            },
            Err(err) => last = Some(err),
        }
    }
    if votes.is_empty() {
        return Err(last.unwrap_or_else(|| (ErrorKind::Client, "no sentinel is configured").into()));
    }
    // Stable: of addresses named as often, the one a sentinel listed earlier in the URL named.
    votes.sort_by_key(|(_, count)| std::cmp::Reverse(*count));
    Ok(votes.into_iter().map(|(address, _)| address).collect())
}

/// The primary's connection: of the addresses the sentinels name, most named first, the first
/// whose server says it is the primary.
pub(crate) async fn primary(target: &SentinelTarget) -> RedisResult<ConnectionInfo> {
    let mut last = None;
    for (host, port) in named_primaries(target).await? {
        let info = target.primary.clone().set_addr(ConnectionAddr::Tcp(host.clone(), port));
        match is_primary(&info).await {
            Ok(true) => return Ok(info),
            Ok(false) => {
                last = Some(
                    (
                        ErrorKind::Client,
                        "the server the sentinels name is not a primary (a failover is under way)",
                        format!("{} at {host}:{port}", target.primary_name),
                    )
                        .into(),
                );
            }
            Err(err) => last = Some(err),
        }
    }
    Err(last.unwrap_or_else(|| (ErrorKind::Client, "no sentinel named a primary").into()))
}

/// Whether the server at `info` says it is a primary (`ROLE`).
async fn is_primary(info: &ConnectionInfo) -> RedisResult<bool> {
    let client = redis::Client::open(info.clone())?;
    let mut conn = bounded(client.get_multiplexed_async_connection()).await?;
    let role: Value = bounded(redis::cmd("ROLE").query_async(&mut conn)).await?;
    Ok(
        matches!(role, Value::Array(parts) if matches!(parts.first(), Some(Value::BulkString(role)) if role == b"master")),
    )
}

/// Asks one sentinel where the primary is.
async fn ask(sentinel: &ConnectionInfo, name: &str) -> RedisResult<(String, u16)> {
    let client = redis::Client::open(sentinel.clone())?;
    let mut conn = bounded(client.get_multiplexed_async_connection()).await?;
    let reply: Value = bounded(
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(name)
            .query_async(&mut conn),
    )
    .await?;
    match &reply {
        Value::Array(parts) if parts.len() == 2 => {
            let host = text(&parts[0]);
            let port = text(&parts[1]).and_then(|port| port.parse().ok());
            host.zip(port)
                .ok_or_else(|| unexpected("SENTINEL get-master-addr-by-name", &reply))
        }
        Value::Nil => Err((
            ErrorKind::Client,
            "the sentinel does not know the primary",
            name.to_owned(),
        )
            .into()),
        _ => Err(unexpected("SENTINEL get-master-addr-by-name", &reply)),
    }
}

async fn bounded<T>(call: impl Future<Output = RedisResult<T>>) -> RedisResult<T> {
    tokio::time::timeout(CONNECTION_TIMEOUT + RESPONSE_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err((ErrorKind::Io, "the server did not answer in time").into()))
}
