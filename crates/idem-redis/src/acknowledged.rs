//! A write that counts only once the replicas acknowledge it: the script and `WAIT` in one
//! pipeline, on a connection lent to this call alone (`ack_pool`), within `replica_timeout` from
//! the moment the call asks for a connection. Every way it can fail says which setting asked for
//! the replicas and what did not acknowledge, so a refusal in a log is never a bare "timed out".

use std::sync::Arc;
use std::time::Duration;

use idem_core::StoreError;
use redis::{Cmd, ErrorKind, ServerErrorKind, Value};
use tokio::time::Instant;

use crate::ack::{Acknowledgement, Setting};
use crate::ack_pool::{MAX_CONNECTIONS, NotLent};
use crate::call::{Call, Written};
use crate::conn::Node;
use crate::script_load::StoreScript;

/// A write that too few replicas acknowledged in time: the primary has it, a failover may lose
/// it, so it does not count.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} acknowledged {} on {record} within {} ms ({setting}, replica_timeout): a failover now could lose it, so it does not count",
    acknowledging(*.acknowledged, *.wanted), noun(.what), .timeout.as_millis()
)]
struct NotAcknowledged {
    what: &'static str,
    record: String,
    acknowledged: i64,
    wanted: u32,
    timeout: Duration,
    setting: Setting,
}

/// Whether `err` is a write that too few Redis replicas acknowledged within `replica_timeout`
/// (the URL's `replicas=`): the primary has it, but it does not count, and the operation failed
/// as the store being unavailable. The gateway counts these apart from other failures.
pub fn is_unacknowledged(err: &StoreError) -> bool {
    matches!(err, StoreError::Unavailable(source) if source.is::<NotAcknowledged>())
}

/// A write that was never sent, or whose replies were lost, while it was to wait for replicas.
#[derive(Debug, thiserror::Error)]
#[error("{} on {record} was to wait for Redis replicas ({setting}, replica_timeout {} ms) and {why}", noun(.what), .timeout.as_millis())]
struct WaitFailed {
    what: &'static str,
    record: String,
    setting: Setting,
    timeout: Duration,
    why: String,
    #[source]
    source: Option<redis::RedisError>,
}

/// Who acknowledged: "no Redis replica", or "1 of the 2 Redis replicas wanted".
fn acknowledging(acknowledged: i64, wanted: u32) -> String {
    if acknowledged <= 0 {
        "no Redis replica".to_owned()
    } else {
        format!("only {acknowledged} of the {wanted} Redis replicas wanted")
    }
}

/// What an operation writes, as a message names it.
fn noun(what: &str) -> &str {
    match what {
        "begin" => "the claim",
        "complete" => "the answer",
        "release" => "the release of the claim",
        "renew" => "the renewal of the lease",
        "checkpoint" => "the checkpoint",
        "delete" => "the deletion",
        other => other,
    }
}

/// Sends the script and `WAIT` in one pipeline on a connection lent to this call: the `WAIT`
/// counts the replicas that have everything this connection wrote, the script included, and no
/// other call's command waits behind it.
pub(crate) async fn run(
    ack: &Acknowledgement,
    call: &Call<'_>,
    script: &StoreScript,
    evalsha: &Cmd,
) -> Result<Written, StoreError> {
    let wanted = ack.wanted();
    let timeout = ack.timeout();
    let deadline = Instant::now() + timeout;
    let failed = |why: String, source: Option<redis::RedisError>| {
        StoreError::unavailable(WaitFailed {
            what: call.what,
            record: call.record.to_owned(),
            setting: ack.setting(),
            timeout,
            why,
            source,
        })
    };
    let lent = ack.lend(deadline).await.map_err(|not_lent| match not_lent {
        NotLent::AllBusy => failed(
            format!("no connection was free for it in time: {MAX_CONNECTIONS} writes were waiting for replicas"),
            None,
        ),
        NotLent::Open(Some(err)) => failed("a connection to send it on could not be opened".to_owned(), Some(err)),
        NotLent::Open(None) => failed("a connection to send it on was not open in time".to_owned(), None),
    })?;
    let commands = Arc::clone(lent.commands());
    let (mut conn, generation) = commands.get();
    // What is left of the replica timeout once a connection is lent; never 0, which waits forever.
    let left = deadline.saturating_duration_since(Instant::now()).as_millis().max(1);
    let mut pipeline = redis::pipe();
    pipeline
        .add_command(evalsha.clone())
        .cmd("WAIT")
        .arg(wanted)
        .arg(u64::try_from(left).unwrap_or(u64::MAX));
    let sent = |err: redis::RedisError| failed("Redis did not answer it".to_owned(), Some(err));
    let mut replies = script.send(&commands.loads, &mut conn, &pipeline).await.map_err(sent)?;
    if let Some(target) = asked_elsewhere(replies.first()) {
        // The record's slot is being migrated and its keys already live on `target`: the script
        // goes there, after `ASKING`, with its `WAIT` on the same connection.
        let mut asking = redis::pipe();
        asking.cmd("ASKING");
        for command in pipeline.cmd_iter() {
            asking.add_command(command.clone());
        }
        // Boxed: a rare path whose future would otherwise make every acknowledged write's larger.
        let mut there = Box::pin(conn.pipeline_on(&target, &asking)).await.map_err(sent)?;
        // The reply to ASKING comes first.
        replies = there.split_off(1.min(there.len()));
    }
    let mut replies = replies.into_iter();
    let (reply, acknowledged) = (replies.next(), replies.next());
    let reply = match reply {
        Some(Value::ServerError(err)) => {
            let err = redis::RedisError::from(err);
            if err.kind() == ErrorKind::Server(ServerErrorKind::Moved) {
                // A pipeline is not redirected as a lone command is: let one be, so that the
                // client learns where the record's slot lives now, and fail this call (MOVED,
                // TRYAGAIN and CLUSTERDOWN are all the store being unavailable for a moment).
                let _ = redis::cmd("EXISTS")
                    .arg(call.record)
                    .query_async::<Value>(&mut conn)
                    .await;
            }
            Err(err)
        }
        Some(reply) => Ok(reply),
        None => Err((ErrorKind::UnexpectedReturnType, "no reply to the script").into()),
    };
    // Every reply of the pipeline has been read: nothing of this call holds the connection.
    lent.give_back();
    let payload = call.take(reply, &commands, generation)?;
    match acknowledged {
        Some(Value::Int(acknowledged)) if acknowledged >= i64::from(wanted) => Ok(Written::counted(payload)),
        Some(Value::Int(acknowledged)) => Ok(Written {
            payload,
            unacknowledged: Some(StoreError::unavailable(NotAcknowledged {
                what: call.what,
                record: call.record.to_owned(),
                acknowledged,
                wanted,
                timeout,
                setting: ack.setting(),
            })),
        }),
        other => {
            tracing::warn!("a Redis reply reached the wrong command");
            commands.out_of_step(generation);
            Err(call.misrouted(&other))
        }
    }
}

/// The node an `ASK` redirection names: a slot under migration whose keys are already there.
fn asked_elsewhere(reply: Option<&Value>) -> Option<Node> {
    let Some(Value::ServerError(err)) = reply else {
        return None;
    };
    let err = redis::RedisError::from(err.clone());
    if err.kind() != ErrorKind::Server(ServerErrorKind::Ask) {
        return None;
    }
    let (address, _slot) = err.redirect_node()?;
    let (host, port) = address.rsplit_once(':')?;
    Some(Node::Primary {
        host: host.to_owned(),
        port: port.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::url::Replicas;

    #[test]
    fn a_refusal_names_the_setting_and_what_did_not_acknowledge() {
        let refusal = |acknowledged, wanted, replicas| {
            NotAcknowledged {
                what: "begin",
                record: "p:{a}:rec".to_owned(),
                acknowledged,
                wanted,
                timeout: Duration::from_millis(500),
                setting: Setting::new(replicas, wanted),
            }
            .to_string()
        };
        assert_eq!(
            refusal(0, 1, Replicas::Exactly(1)),
            "no Redis replica acknowledged the claim on p:{a}:rec within 500 ms (replicas=1, replica_timeout): \
             a failover now could lose it, so it does not count"
        );
        let some = refusal(1, 2, Replicas::Auto);
        assert!(
            some.starts_with("only 1 of the 2 Redis replicas wanted acknowledged the claim")
                && some.contains("(replicas=auto, 2 now, replica_timeout)"),
            "{some}"
        );
    }

    #[test]
    fn only_a_refusal_of_the_replicas_is_told_apart() {
        let refusal = StoreError::unavailable(NotAcknowledged {
            what: "complete",
            record: "p:{a}:rec".to_owned(),
            acknowledged: 0,
            wanted: 1,
            timeout: Duration::from_millis(500),
            setting: Setting::new(Replicas::Exactly(1), 1),
        });
        assert!(is_unacknowledged(&refusal));
        let unsent = StoreError::unavailable(WaitFailed {
            what: "complete",
            record: "p:{a}:rec".to_owned(),
            setting: Setting::new(Replicas::Exactly(1), 1),
            timeout: Duration::from_millis(500),
            why: "Redis did not answer it".to_owned(),
            source: None,
        });
        for other in [unsent, StoreError::Fenced, StoreError::Locked] {
            assert!(!is_unacknowledged(&other), "{other:?}");
        }
    }
}
