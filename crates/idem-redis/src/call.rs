//! One call to Redis and its reply: every call has a fresh nonce, and a script's reply must name
//! the nonce of the call it answers (its errors about a record, the nonce and the record). A reply
//! that names another call came on a connection whose replies are shifted: it is refused, never
//! acted on, and the connection is replaced.

use std::fmt;
use std::sync::Arc;

use idem_core::store::backend::hex;
use idem_core::{StoreError, store::FencingToken};
use redis::{RedisResult, Value};

use crate::conn::Commands;
use crate::scripts::CORRUPT;

/// A reply that answers another call than the one it reached: the connection's replies are
/// shifted (a reply too many, or one missing, before it).
#[derive(Debug, thiserror::Error)]
#[error(
    "Redis answered {what} on {record} (call {nonce}) with the reply of another command: {got}; \
     the connection is out of step and is being replaced"
)]
struct MisroutedReply {
    what: &'static str,
    record: String,
    nonce: String,
    /// The start of what came instead.
    got: String,
}

/// One call to Redis: what it is, the record it is about and its nonce.
pub(crate) struct Call<'a> {
    pub(crate) what: &'static str,
    pub(crate) record: &'a str,
    /// Fresh for every call: the reply and the errors about the record must carry it.
    pub(crate) nonce: String,
}

impl<'a> Call<'a> {
    pub(crate) fn new(what: &'static str, record: &'a str) -> Self {
        Self {
            what,
            record,
            nonce: hex(FencingToken::random().as_bytes()),
        }
    }

    pub(crate) fn misrouted(&self, got: &dyn fmt::Debug) -> StoreError {
        let mut got = format!("{got:?}");
        if got.len() > 200 {
            let mut end = 200;
            while !got.is_char_boundary(end) {
                end -= 1;
            }
            got.truncate(end);
            got.push('…');
        }
        StoreError::unavailable(MisroutedReply {
            what: self.what,
            record: self.record.to_owned(),
            nonce: self.nonce.clone(),
            got,
        })
    }

    /// The payload of a script's reply, after the nonce it names, if it is this call's; the whole
    /// reply otherwise.
    pub(crate) fn open(&self, reply: Value) -> Result<std::vec::IntoIter<Value>, Value> {
        let Value::Array(items) = reply else {
            return Err(reply);
        };
        if !names(items.first(), &self.nonce) {
            return Err(Value::Array(items));
        }
        let mut items = items.into_iter();
        items.next();
        Ok(items)
    }

    /// A Redis error: `Ok` with the store's error for this call (the scripts' complaint about a
    /// record they cannot read, or the store being unavailable), `Err` if it is a complaint about
    /// another record or call, which came here out of step.
    pub(crate) fn error(&self, err: redis::RedisError) -> Result<StoreError, StoreError> {
        if err.code() != Some(CORRUPT) {
            return Ok(StoreError::unavailable(err));
        }
        let about = err
            .detail()
            .and_then(|detail| detail.strip_prefix(self.nonce.as_str()))
            .and_then(|rest| rest.strip_prefix(' '))
            .filter(|about| {
                about
                    .strip_prefix(self.record)
                    .is_some_and(|rest| rest.starts_with(' '))
            });
        // An error raised in a script ends with where: `script: <sha>, on @user_script:<line>.`
        let about = about.map(|about| about.split_once(" script: ").map_or(about, |(about, _)| about));
        match about {
            Some(about) => Ok(StoreError::Corrupt(about.to_owned())),
            None => Err(self.misrouted(&err)),
        }
    }
}

/// A script's reply, and whether the replicas the rule wants acknowledged what it wrote.
pub(crate) struct Written {
    /// The reply, after the nonce it names.
    pub(crate) payload: std::vec::IntoIter<Value>,
    /// Why the write does not count, if it does not: too few replicas acknowledged it.
    pub(crate) unacknowledged: Option<StoreError>,
}

impl Written {
    /// A reply that needs no acknowledgement.
    pub(crate) fn counted(payload: std::vec::IntoIter<Value>) -> Self {
        Self {
            payload,
            unacknowledged: None,
        }
    }

    /// The reply, if the write counts.
    pub(crate) fn into_payload(self) -> Result<std::vec::IntoIter<Value>, StoreError> {
        match self.unacknowledged {
            None => Ok(self.payload),
            Some(err) => Err(err),
        }
    }
}

impl Call<'_> {
    /// The payload of `reply` if it answers this call; the store's error otherwise, with the
    /// connection `generation` of `commands` replaced if the reply belongs to another call.
    pub(crate) fn take(
        &self,
        reply: RedisResult<Value>,
        commands: &Arc<Commands>,
        generation: u64,
    ) -> Result<std::vec::IntoIter<Value>, StoreError> {
        let out_of_step = |err| {
            tracing::warn!(error = %err, "a Redis reply reached the wrong command");
            commands.out_of_step(generation);
            err
        };
        match reply {
            Ok(reply) => self.open(reply).map_err(|other| out_of_step(self.misrouted(&other))),
            Err(err) => Err(self.error(err).unwrap_or_else(out_of_step)),
        }
    }
}

/// Whether a reply's item is the bulk string `expected`.
fn names(item: Option<&Value>, expected: &str) -> bool {
    matches!(item, Some(Value::BulkString(bytes)) if bytes.as_slice() == expected.as_bytes())
}

#[cfg(test)]
mod tests {
    use redis::PushKind;

    use super::*;

    fn reply(nonce: &str, payload: Value) -> Value {
        Value::Array(vec![Value::BulkString(nonce.as_bytes().to_vec()), payload])
    }

    #[test]
    fn a_reply_is_taken_only_by_the_call_it_names() {
        let call = Call::new("get", "p:{a}:rec");
        let payload: Vec<Value> = call
            .open(reply(&call.nonce, Value::Int(1)))
            .expect("its own reply")
            .collect();
        assert_eq!(payload, vec![Value::Int(1)]);

        let other_call = Call::new("get", "p:{a}:rec");
        assert_ne!(call.nonce, other_call.nonce, "every call has its own nonce");
        for stray in [
            reply(&other_call.nonce, Value::Int(1)),
            // The shape of an older build's reply, which named the record before the nonce.
            Value::Array(vec![
                Value::BulkString(b"p:{a}:rec".to_vec()),
                Value::BulkString(call.nonce.as_bytes().to_vec()),
                Value::Int(1),
            ]),
            Value::Okay,
            Value::Array(vec![Value::Int(1)]),
            Value::Push {
                kind: PushKind::Subscribe,
                data: vec![Value::BulkString(b"p:{a}:wake".to_vec()), Value::Int(2)],
            },
        ] {
            assert!(call.open(stray.clone()).is_err(), "taken: {stray:?}");
        }

        let err = call.misrouted(&Value::Okay);
        assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains(&call.nonce) && message.contains("p:{a}:rec"),
            "{message}"
        );
    }
}
