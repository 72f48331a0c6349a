//! `SqliteStore::complete_in` keeps what `complete` keeps: the answer's status beside it.
#![cfg(feature = "sqlx")]

use std::sync::Arc;

use bytes::Bytes;
use idem_core::protocol::{Admission, Decision, InTransaction, Protocol};
use idem_core::{Fingerprint, Policy, Store};
use idem_sqlite::SqliteStore;
use sqlx::Connection;

#[tokio::test]
async fn a_completion_in_the_callers_transaction_keeps_the_status() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).await.unwrap();
    let protocol = Protocol::new(Arc::new(store.clone()), Policy::default());

    let request = http::Request::post("/payments")
        .header("idempotency-key", "\"in-tx\"")
        .header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        .body(())
        .unwrap();
    let (parts, ()) = request.into_parts();
    let Admission::Keyed(keyed) = protocol.admit(&parts) else {
        panic!("a keyed POST is subject to the protocol")
    };
    let fingerprint = Fingerprint::of(&parts.method, &parts.uri, &parts.headers, b"");
    let Decision::Run(claim) = protocol.begin(keyed, &fingerprint).await else {
        panic!("a new key runs")
    };
    let run = InTransaction::new(protocol.clone(), claim);

    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let mut tx = conn.begin().await.unwrap();
    let mut answer = http::Response::builder()
        .status(http::StatusCode::ACCEPTED)
        .body(Bytes::from_static(b"queued"))
        .unwrap();
    store.complete_in(&mut tx, &run, &mut answer).await.unwrap();
    tx.commit().await.unwrap();

    let record = store.get(run.id()).await.unwrap().expect("the record");
    assert_eq!(record.status, Some(202));
    assert_eq!(
        (
            record.origin.method.as_str(),
            record.origin.path.as_str(),
            record.recovered
        ),
        ("POST", "/payments", false)
    );
    assert_eq!(
        record.origin.trace.map(|trace| trace.trace_id.to_string()).as_deref(),
        Some("4bf92f3577b34da6a3ce929d0e0e4736")
    );
}
