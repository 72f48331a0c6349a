//! The operator's commands: `inspect`, `delete`, `purge` and `migrate` (`list` has a module of
//! its own). Those that judge time
//! (what is expired, what is due for purging) judge it on the store's clock, as `idem serve`
//! does, never on this machine's.

use std::fmt::Write as _;
use std::sync::Arc;

use anyhow::Context as _;
use bytes::Bytes;
use idem_core::store::backend::{COMPLETED, IN_FLIGHT, UNKNOWN};
use idem_core::{
    Clock as _, IdempotencyKey, Keyring, Policy, Scope, Store, StoreError, StoredResponse, UnixMillis,
    protocol::{CredentialScopes, Protocol},
    store::{Checkpoint, Record, RecordId, RecordState, StoreClock},
};
use idem_postgres::Access;
use serde::Serialize;

use crate::cli::{InspectArgs, RecordArgs, StoreArgs};
use crate::stores;
use crate::terminal::escaped;

/// The batch size of `idem purge`.
const PURGE_BATCH: usize = 1000;

/// The store's clock, measured now. A machine whose clock is days off (a stopped NTP daemon, a
/// VM resumed from a pause) would otherwise purge live answers, or show them expired; a store
/// whose clock cannot be read stops the command rather than let this machine's stand in.
pub(crate) async fn store_clock(store: &Arc<dyn Store>) -> anyhow::Result<Arc<StoreClock>> {
    let clock = StoreClock::new(store.clone());
    clock
        .sync()
        .await
        .context("cannot read the store's clock, on which expiry is judged; nothing was done")?;
    Ok(clock)
}

/// Opens the store, reads its clock and names the record the arguments point at.
async fn open_record(args: &RecordArgs, access: Access) -> anyhow::Result<(Arc<dyn Store>, Arc<StoreClock>, RecordId)> {
    let key = IdempotencyKey::new(&args.key).with_context(|| format!("{:?} is not a valid key", args.key))?;
    let store = stores::open_for_operator(&args.store.store, access).await?;
    let clock = store_clock(&store).await?;
    let id = match &args.authorization {
        Some(credential) => credential_record(&*store, credential, key, clock.now()).await?,
        None => RecordId {
            scope: Scope::from_stored(args.scope.as_str()),
            key,
        },
    };
    Ok((store, clock, id))
}

/// The record of `key` in the scope of callers presenting `credential`, hashed as the gateway
/// hashes it (the store's salt, `IDEM_SCOPE_SECRET`): under the current form, or an earlier one
/// if the record was stored before a change of hashing. A record the store cannot read counts as
/// found.
async fn credential_record(
    store: &dyn Store,
    credential: &str,
    key: IdempotencyKey,
    now: UnixMillis,
) -> anyhow::Result<RecordId> {
    let secrets = crate::config::scope_secrets_from_env()?;
    let scopes = CredentialScopes::load(store, &secrets, now)
        .await
        .context("cannot read the store's scope salt")?;
    let forms = scopes.every_form(credential.as_bytes());
    for scope in &forms {
        let id = RecordId {
            scope: scope.clone(),
            key: key.clone(),
        };
        match store.get(&id).await {
            Ok(Some(_)) => return Ok(id),
            Ok(None) => {}
            // A record is there, whatever it holds: `inspect` reports it, `delete` removes it.
            Err(StoreError::Corrupt(_)) => return Ok(id),
            Err(err) => return Err(anyhow::Error::new(err).context("cannot read the record")),
        }
    }
    Ok(RecordId {
        scope: forms[0].clone(),
        key,
    })
}

fn no_record(id: &RecordId) -> anyhow::Error {
    anyhow::anyhow!(
        "no record for key {:?} in scope {:?}",
        id.key.as_str(),
        id.scope.as_str()
    )
}

/// `idem inspect`: prints one record, as text or as one JSON object; fails (exit 1, a message on
/// stderr, nothing on stdout) when there is none.
pub(crate) async fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let (store, clock, id) = open_record(&args.record, Access::Read).await?;
    let keyring = crate::config::keyring_from_env()?;
    let record = store
        .get(&id)
        .await
        .context("cannot read the record")?
        .ok_or_else(|| no_record(&id))?;
    let checkpoints = store
        .checkpoints(&id)
        .await
        .context("cannot read the record's checkpoints")?;
    let now = clock.now();
    if args.json {
        let mut json = RecordJson::of(&record, keyring.as_ref(), now);
        json.checkpoints = checkpoints.iter().map(CheckpointJson::of).collect();
        println!("{}", serde_json::to_string(&json)?);
    } else {
        let mut out = describe(&record, keyring.as_ref(), now);
        for checkpoint in &checkpoints {
            let _ = writeln!(
                out,
                "step:     {} ({} bytes)",
                escaped(&checkpoint.name),
                checkpoint.value.len()
            );
        }
        print!("{out}");
    }
    Ok(())
}

/// A completed record's stored answer, as far as it can be read: which key sealed it (`None`:
/// stored as it is), and the answer, opened with `keyring` if it is sealed.
struct Answer {
    sealed_by: Option<String>,
    stored: Result<StoredResponse, String>,
}

impl Answer {
    fn read(id: &RecordId, bytes: &Bytes, keyring: Option<&Keyring>) -> Self {
        let sealed_by = idem_core::seal::sealed_by(bytes).ok().flatten().map(str::to_owned);
        let stored = idem_core::seal::open_answer(keyring, id, bytes).map_err(|err| err.to_string());
        Self { sealed_by, stored }
    }
}

/// `idem delete`: forgets one record and prints what it was; fails (exit 1, a message on stderr)
/// when there is none. A completed record, a tombstone or an unknown outcome is deleted and the key
/// is free; a record in flight is fenced and left unknown (see `Store::delete`), since its run may
/// have had effects: the same request then runs again marked recovered.
pub(crate) async fn delete(args: RecordArgs) -> anyhow::Result<()> {
    let (store, clock, id) = open_record(&args, Access::Delete).await?;
    let deleted = match store.delete(&id).await {
        Ok(deleted) => deleted.ok_or_else(|| no_record(&id))?,
        // The store deletes a record it cannot read all the same: make sure, then say so.
        Err(err @ StoreError::Corrupt(_)) => {
            let gone = store.get(&id).await.is_ok_and(|record| record.is_none());
            if !gone {
                return Err(anyhow::Error::new(err).context("cannot delete the record"));
            }
            println!(
                "deleted the record of key {:?} in scope {:?}, which the store could not read ({err}); \
                 the key is free: its next request runs as a new one, not marked recovered, since what \
                 the record said about an earlier run could not be read",
                id.key.as_str(),
                id.scope.as_str()
            );
            return Ok(());
        }
        // The store did not wait for the transaction holding the record: what it would have
        // deleted is not what the record will be once that transaction ends.
        Err(StoreError::Locked) => anyhow::bail!(
            "nothing was deleted: the record of key {:?} in scope {:?} is locked by a transaction still open \
             (its run completing in its own transaction, or, on SQLite, another writer of the file). Look again \
             with `idem inspect` once it has ended: if it committed an answer, that answer is kept for retries, \
             and deleting it would let the key run again",
            id.key.as_str(),
            id.scope.as_str()
        ),
        Err(err) => return Err(anyhow::Error::new(err).context("cannot delete the record")),
    };
    // Every running instance forgets the answer in its replay cache as the store announces the
    // delete; a store whose announcement is polled (SQLite, across processes) takes up to this
    // long, and the command returns only then.
    if let Some(invalidations) = store.invalidations() {
        tokio::time::sleep(invalidations.reach()).await;
    }
    let state = match &deleted.state {
        RecordState::InFlight { .. } => "in-flight",
        RecordState::Completed { response: None, .. } => "tombstone",
        RecordState::Completed { .. } => "completed",
        RecordState::Unknown { .. } => "outcome-unknown",
    };
    let fp = &deleted.fingerprint;
    let effect = if matches!(deleted.state, RecordState::InFlight { .. }) {
        "its run is fenced and the key is left unknown"
    } else {
        "the key is free for a new request"
    };
    let mut out = format!(
        "deleted:  the {state} record of {} {}; {effect}\n",
        escaped(fp.method()),
        escaped(fp.path())
    );
    let keyring = crate::config::keyring_from_env()?;
    out.push_str(&describe(&deleted, keyring.as_ref(), clock.now()));
    if let RecordState::InFlight { expires_at, .. } = deleted.state {
        let until = expires_at.map(|at| format!(" until {at}")).unwrap_or_default();
        let _ = writeln!(
            out,
            "note:     it was in flight and may have had effects: if that run is still going its answer \
             will not be stored; the same request runs again marked Idempotency-Recovered: true{until} \
             (then answers key-expired), and another request with this key is refused. Delete the key \
             again to free it"
        );
    }
    print!("{out}");
    Ok(())
}

/// Why `record` is damaged, if it is: a time past the year 9999, which no setting idem accepts
/// makes (a record written by hand, or by a version that accepted any ttl).
fn damage(record: &Record) -> Option<String> {
    let mut times = vec![("created_at", record.created_at)];
    match &record.state {
        RecordState::InFlight {
            lease_until,
            expires_at,
            ..
        } => {
            times.push(("lease_until", *lease_until));
            times.extend(expires_at.map(|at| ("expires_at", at)));
        }
        RecordState::Completed {
            completed_at,
            expires_at,
            purge_at,
            ..
        } => times.extend([
            ("completed_at", *completed_at),
            ("expires_at", *expires_at),
            ("purge_at", *purge_at),
        ]),
        RecordState::Unknown { expires_at, purge_at } => {
            times.extend([("expires_at", *expires_at), ("purge_at", *purge_at)]);
        }
    }
    UnixMillis::past_rfc3339(&times)
}

/// `record` as text, its times judged against `now` on the store's clock; what callers chose
/// (scope, key, path) escaped for a terminal.
fn describe(record: &Record, keyring: Option<&Keyring>, now: UnixMillis) -> String {
    let mut out = String::new();
    let fp = &record.fingerprint;
    let _ = writeln!(out, "scope:    {}", escaped(record.id.scope.as_str()));
    let _ = writeln!(out, "key:      {}", escaped(record.id.key.as_str()));
    let _ = writeln!(out, "request:  {} {}", escaped(fp.method()), escaped(fp.path()));
    let _ = writeln!(out, "created:  {}", record.created_at);
    if let Some(why) = damage(record) {
        let _ = writeln!(out, "damaged:  {why}; `idem delete` removes it");
    }
    if let Some(trace) = record.origin.trace {
        let _ = match trace.span_id {
            Some(span_id) => writeln!(out, "trace:    {} (of the latest run; span {span_id})", trace.trace_id),
            None => writeln!(out, "trace:    {} (of the latest run)", trace.trace_id),
        };
    }
    if record.recovered {
        let _ = writeln!(
            out,
            "recovered: yes (the latest run took the key over from one whose outcome is unknown)"
        );
    }
    match &record.state {
        RecordState::InFlight { lease_until, .. } if now >= *lease_until => {
            let _ = writeln!(
                out,
                "state:    in-flight, its lease ended at {lease_until} (the next copy takes it over, marked recovered)"
            );
        }
        RecordState::InFlight { lease_until, .. } => {
            let _ = writeln!(out, "state:    in-flight (lease until {lease_until})");
        }
        RecordState::Completed {
            response,
            completed_at,
            expires_at,
            purge_at,
        } => {
            let expired = now >= *expires_at;
            if expired {
                let _ = writeln!(
                    out,
                    "state:    completed at {completed_at}, expired at {expires_at} (answers key-expired until {purge_at})"
                );
            } else {
                let _ = writeln!(
                    out,
                    "state:    completed at {completed_at}, replayable until {expires_at}"
                );
            }
            let answer = response
                .as_ref()
                .filter(|_| !expired)
                .map(|bytes| Answer::read(&record.id, bytes, keyring));
            if let Some(key) = answer.as_ref().and_then(|answer| answer.sealed_by.as_deref()) {
                let _ = writeln!(out, "sealed:   by key {}", escaped(key));
            }
            match answer.map(|answer| answer.stored) {
                Some(Ok(stored)) => {
                    let body = match &stored.body {
                        Some(body) => format!("{} bytes", body.len()),
                        None => "not kept (compact)".to_owned(),
                    };
                    let _ = writeln!(out, "status:   {}", stored.status.as_u16());
                    let _ = writeln!(out, "body:     {body}");
                }
                Some(Err(err)) => {
                    let _ = writeln!(out, "status:   unreadable ({})", escaped(&err));
                }
                None => match record.status {
                    Some(status) => {
                        let _ = writeln!(out, "status:   {status} (the answer expired: tombstone)");
                    }
                    None => {
                        let _ = writeln!(out, "status:   expired (tombstone)");
                    }
                },
            }
        }
        RecordState::Unknown { expires_at, purge_at } => {
            let _ = writeln!(
                out,
                "state:    outcome unknown (the same request runs again marked recovered until {expires_at}, \
                 then answers key-expired; kept until {purge_at})"
            );
        }
    }
    let _ = writeln!(out, "replays:  {}", record.replays);
    out
}

/// The JSON form of a record (`idem inspect --json`): the facts `inspect` prints, each in its
/// own field; fields that do not apply to the record's state are `null`.
#[derive(Debug, Serialize)]
struct RecordJson<'a> {
    scope: &'a str,
    key: &'a str,
    method: &'a str,
    path: &'a str,
    /// RFC 3339, as every time here; `null` past the year 9999 (the record is `damaged`).
    created_at: Option<String>,
    /// `in-flight`, `completed` or `unknown` (outcome unknown: the next run is marked recovered).
    state: &'static str,
    /// In flight: when the holder's lease ends unless renewed.
    lease_until: Option<String>,
    completed_at: Option<String>,
    /// Completed: until when the answer is replayable. Unknown: until when the same request runs
    /// again, marked recovered (after it: `key-expired`).
    expires_at: Option<String>,
    /// Completed or unknown: when the record is deleted.
    purge_at: Option<String>,
    /// Completed: what is kept of the answer: `whole`, `status` (the body was too large to keep:
    /// compact), `expired` (a tombstone, or past `expires_at` on the store's clock: the key
    /// answers key-expired) or `unreadable`.
    answer: Option<&'static str>,
    /// The stored answer's status, when it is kept (or, past its expiry, when the record kept it).
    status: Option<u16>,
    /// The stored answer's body length, when the body is kept.
    body_bytes: Option<usize>,
    /// The id of the key that sealed the stored answer (`IDEM_ENCRYPTION_KEYS`); `null` when it
    /// is stored as it is, or not kept.
    sealed_by: Option<String>,
    replays: u64,
    /// The W3C trace id of the latest run, if known (its request's `traceparent`, or idem's span).
    trace_id: Option<String>,
    /// The span a replay links to: idem's span of the latest run when idem exported traces,
    /// else the caller's span.
    span_id: Option<String>,
    /// Whether the latest run was recovered (`Idempotency-Recovered: true`).
    recovered: bool,
    /// The steps the run recorded (name and size; their values are the handler's).
    checkpoints: Vec<CheckpointJson>,
    /// Why the record is damaged (a time past the year 9999, which no setting makes), else `null`.
    damaged: Option<String>,
}

/// A checkpoint in `idem inspect --json`.
#[derive(Debug, Serialize)]
struct CheckpointJson {
    name: String,
    bytes: usize,
}

impl CheckpointJson {
    fn of(checkpoint: &Checkpoint) -> Self {
        Self {
            name: checkpoint.name.clone(),
            bytes: checkpoint.value.len(),
        }
    }
}

impl<'a> RecordJson<'a> {
    /// `record`'s facts, its answer judged against `now` on the store's clock.
    fn of(record: &'a Record, keyring: Option<&Keyring>, now: UnixMillis) -> Self {
        let fp = &record.fingerprint;
        let mut json = Self {
            scope: record.id.scope.as_str(),
            key: record.id.key.as_str(),
            method: fp.method(),
            path: fp.path(),
            created_at: record.created_at.rfc3339(),
            state: IN_FLIGHT,
            lease_until: None,
            completed_at: None,
            expires_at: None,
            purge_at: None,
            answer: None,
            status: None,
            body_bytes: None,
            sealed_by: None,
            replays: record.replays,
            trace_id: record.origin.trace.map(|trace| trace.trace_id.to_string()),
            span_id: record
                .origin
                .trace
                .and_then(|trace| trace.span_id)
                .map(|id| id.to_string()),
            recovered: record.recovered,
            checkpoints: Vec::new(),
            damaged: damage(record),
        };
        match &record.state {
            RecordState::InFlight { lease_until, .. } => json.lease_until = lease_until.rfc3339(),
            RecordState::Completed {
                response,
                completed_at,
                expires_at,
                purge_at,
            } => {
                json.state = COMPLETED;
                json.completed_at = completed_at.rfc3339();
                json.expires_at = expires_at.rfc3339();
                json.purge_at = purge_at.rfc3339();
                let answer = response
                    .as_ref()
                    .filter(|_| now < *expires_at)
                    .map(|bytes| Answer::read(&record.id, bytes, keyring));
                json.sealed_by = answer.as_ref().and_then(|answer| answer.sealed_by.clone());
                json.answer = Some(match answer.map(|answer| answer.stored) {
                    Some(Ok(stored)) => {
                        json.status = Some(stored.status.as_u16());
                        json.body_bytes = stored.body.as_ref().map(|body| body.len());
                        if stored.body.is_some() { "whole" } else { "status" }
                    }
                    Some(Err(_)) => "unreadable",
                    None => {
                        json.status = record.status;
                        "expired"
                    }
                });
            }
            RecordState::Unknown { expires_at, purge_at } => {
                json.state = UNKNOWN;
                json.expires_at = expires_at.rfc3339();
                json.purge_at = purge_at.rfc3339();
            }
        }
        json
    }
}

/// `idem purge`: runs every due batch of retention work now.
pub(crate) async fn purge(args: StoreArgs) -> anyhow::Result<()> {
    let store = stores::open_for_operator(&args.store, Access::Purge).await?;
    let clock = store_clock(&store).await?;
    let purged = Protocol::with_clock(store, Policy::default(), clock)
        .purge(PURGE_BATCH)
        .await
        .context("purge failed")?;
    if args.store.starts_with("redis") {
        // Redis deletes answers and records itself when their time comes (native expiry).
        println!("Redis expires records by itself: there is nothing to purge");
        return Ok(());
    }
    println!(
        "purged: {} records deleted, {} answers dropped to tombstones",
        purged.deleted, purged.tombstoned
    );
    Ok(())
}

/// `idem migrate`: opening the store creates or upgrades its schema (the one command whose role
/// needs DDL rights, and no others).
pub(crate) async fn migrate(args: StoreArgs) -> anyhow::Result<()> {
    stores::open(&args.store, None).await?;
    println!("schema of {} is up to date", idem_core::redact_url(&args.store));
    Ok(())
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{HeaderMap, Method, StatusCode};
    use idem_core::{Fingerprint, HeaderAllowList, UnixMillis, store::FencingToken};
    use serde_json::{Value, json};

    use super::*;

    fn record(state: RecordState) -> Record {
        Record {
            id: RecordId {
                scope: Scope::anonymous(),
                key: IdempotencyKey::new("k").unwrap(),
            },
            fingerprint: Fingerprint::of(&Method::PATCH, &"/orders/7".parse().unwrap(), &HeaderMap::new(), b"{}"),
            created_at: UnixMillis(1_000),
            replays: 3,
            state,
            origin: idem_core::store::Origin::default(),
            recovered: false,
            status: None,
        }
    }

    /// The JSON form as seen at 2.5 s: after completion, before expiry.
    fn to_json(state: RecordState) -> Value {
        serde_json::to_value(RecordJson::of(&record(state), None, UnixMillis(2_500))).unwrap()
    }

    fn completed(response: Option<Bytes>) -> RecordState {
        RecordState::Completed {
            response,
            completed_at: UnixMillis(2_000),
            expires_at: UnixMillis(3_000),
            purge_at: UnixMillis(4_000),
        }
    }

    fn answer(body: Option<&'static [u8]>) -> Option<Bytes> {
        let stored = StoredResponse::capture(
            StatusCode::ACCEPTED,
            &HeaderMap::new(),
            &HeaderAllowList::default(),
            body.map(Bytes::from_static),
        );
        Some(Bytes::from(stored.encode()))
    }

    #[test]
    fn the_json_form_names_every_fact_and_nulls_what_the_state_lacks() {
        let whole = to_json(completed(answer(Some(b"12345"))));
        assert_eq!(
            whole,
            json!({
                "scope": "anonymous", "key": "k", "method": "PATCH", "path": "/orders/7",
                "created_at": "1970-01-01T00:00:01.000Z", "state": "completed", "lease_until": null,
                "completed_at": "1970-01-01T00:00:02.000Z", "expires_at": "1970-01-01T00:00:03.000Z",
                "purge_at": "1970-01-01T00:00:04.000Z", "answer": "whole", "status": 202, "body_bytes": 5,
                "sealed_by": null, "replays": 3, "trace_id": null, "span_id": null, "recovered": false,
                "checkpoints": [], "damaged": null
            })
        );

        let compact = to_json(completed(answer(None)));
        assert_eq!(
            (&compact["answer"], &compact["status"]),
            (&json!("status"), &json!(202))
        );
        assert_eq!(compact["body_bytes"], Value::Null);

        let tombstone = to_json(completed(None));
        assert_eq!(tombstone["answer"], "expired");
        assert_eq!(
            (&tombstone["status"], &tombstone["body_bytes"]),
            (&Value::Null, &Value::Null)
        );

        // Past its expiry on the store's clock, a stored answer is no longer replayable.
        let kept = record(completed(answer(Some(b"12345"))));
        let due = serde_json::to_value(RecordJson::of(&kept, None, UnixMillis(3_000))).unwrap();
        assert_eq!(due["answer"], "expired");
        assert_eq!((&due["status"], &due["body_bytes"]), (&Value::Null, &Value::Null));

        // A tombstone whose record kept its answer's status still tells it, as text and as JSON.
        let mut told = record(completed(None));
        told.status = Some(201);
        told.recovered = true;
        told.origin.trace =
            idem_core::trace_context::RunTrace::from_stored("4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7");
        let json = serde_json::to_value(RecordJson::of(&told, None, UnixMillis(2_500))).unwrap();
        assert_eq!(
            (
                &json["answer"],
                &json["status"],
                &json["recovered"],
                &json["trace_id"],
                &json["span_id"]
            ),
            (
                &json!("expired"),
                &json!(201),
                &json!(true),
                &json!("4bf92f3577b34da6a3ce929d0e0e4736"),
                &json!("00f067aa0ba902b7")
            )
        );
        let text = describe(&told, None, UnixMillis(2_500));
        for expected in [
            "status:   201 (the answer expired",
            "recovered: yes",
            "trace:    4bf92f3577b34da6a3ce929d0e0e4736",
        ] {
            assert!(text.contains(expected), "{expected:?} in:\n{text}");
        }

        let text = describe(&record(completed(answer(Some(b"12345")))), None, UnixMillis(3_000));
        assert!(text.contains("expired at") && text.contains("key-expired"), "{text}");
        assert!(!text.contains("replayable"), "{text}");

        let unreadable = to_json(completed(Some(Bytes::from_static(b"not an answer"))));
        assert_eq!(unreadable["answer"], "unreadable");

        let in_flight = to_json(RecordState::InFlight {
            token: FencingToken::random(),
            lease_until: UnixMillis(5_000),
            expires_at: Some(UnixMillis(5_500)),
        });
        assert_eq!(in_flight["state"], "in-flight");
        assert_eq!(in_flight["lease_until"], "1970-01-01T00:00:05.000Z");
        for absent in [
            "completed_at",
            "expires_at",
            "purge_at",
            "answer",
            "status",
            "body_bytes",
        ] {
            assert_eq!(in_flight[absent], Value::Null, "{absent}");
        }
        assert!(
            !in_flight.to_string().contains("token"),
            "the fencing token stays private"
        );

        let unknown = to_json(RecordState::Unknown {
            expires_at: UnixMillis(5_500),
            purge_at: UnixMillis(6_000),
        });
        assert_eq!(unknown["state"], "unknown");
        assert_eq!(unknown["expires_at"], "1970-01-01T00:00:05.500Z");
        assert_eq!(unknown["purge_at"], "1970-01-01T00:00:06.000Z");
        assert_eq!(unknown["answer"], Value::Null);
    }
}
