//! The operator's commands: `inspect`, `purge` and `migrate`.

use std::fmt::Write as _;

use anyhow::Context as _;
use idem_core::{IdempotencyKey, Policy, Protocol, Record, RecordId, RecordState, Scope, StoredResponse};

use crate::cli::{InspectArgs, StoreArgs};
use crate::stores;

/// The batch size of `idem purge`.
const PURGE_BATCH: usize = 1000;

/// `idem inspect`: prints one record; fails when there is none.
pub(crate) async fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let store = stores::open(&args.store.store).await?;
    let key = IdempotencyKey::new(&args.key).with_context(|| format!("{:?} is not a valid key", args.key))?;
    let scope = match &args.authorization {
        Some(credential) => Scope::credential(credential.as_bytes()),
        None => Scope::from_stored(args.scope.as_str()),
    };
    let id = RecordId { scope, key };
    let record = store.get(&id).await.context("cannot read the record")?;
    match record {
        Some(record) => {
            print!("{}", describe(&record));
            Ok(())
        }
        None => anyhow::bail!("no record for key {:?} in scope {:?}", args.key, id.scope.as_str()),
    }
}

fn describe(record: &Record) -> String {
    let mut out = String::new();
    let fp = &record.fingerprint;
    let _ = writeln!(out, "scope:    {}", record.id.scope);
    let _ = writeln!(out, "key:      {}", record.id.key);
    let _ = writeln!(out, "request:  {} {}", fp.method(), fp.path());
    let _ = writeln!(out, "created:  {}", record.created_at);
    match &record.state {
        RecordState::InFlight { lease_until, .. } => {
            let _ = writeln!(out, "state:    in-flight (lease until {lease_until})");
        }
        RecordState::Completed {
            response,
            completed_at,
            expires_at,
            ..
        } => {
            let _ = writeln!(
                out,
                "state:    completed at {completed_at}, replayable until {expires_at}"
            );
            match response.as_deref().map(StoredResponse::decode) {
                Some(Ok(stored)) => {
                    let body = match &stored.body {
                        Some(body) => format!("{} bytes", body.len()),
                        None => "not kept (compact)".to_owned(),
                    };
                    let _ = writeln!(out, "status:   {}", stored.status.as_u16());
                    let _ = writeln!(out, "body:     {body}");
                }
                Some(Err(err)) => {
                    let _ = writeln!(out, "status:   unreadable ({err})");
                }
                None => {
                    let _ = writeln!(out, "status:   expired (tombstone)");
                }
            }
        }
        RecordState::Unknown { purge_at } => {
            let _ = writeln!(
                out,
                "state:    outcome unknown (the next run is marked recovered; kept until {purge_at})"
            );
        }
    }
    let _ = writeln!(out, "replays:  {}", record.replays);
    out
}

/// `idem purge`: runs every due batch of retention work now.
pub(crate) async fn purge(args: StoreArgs) -> anyhow::Result<()> {
    let store = stores::open(&args.store).await?;
    let purged = Protocol::new(store, Policy::default())
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

/// `idem migrate`: opening the store creates or upgrades its schema.
pub(crate) async fn migrate(args: StoreArgs) -> anyhow::Result<()> {
    stores::open(&args.store).await?;
    println!("schema of {} is up to date", args.store);
    Ok(())
}
