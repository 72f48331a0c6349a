//! The `BEGIN` script decides the claim rule in Lua, a copy of `StoredRecord::on_begin`. This holds
//! the copy to the rule's own table (`idem_core::store::backend::claim_rule_cases`): every row's record is
//! written straight into Redis, claimed at the row's `now`, and the claim must come out as the row
//! says.

use std::time::Duration;

use idem_core::store::backend::{ClaimRuleCase, Existing, StoredRecord, claim_rule_cases};
use idem_core::testkit::{fingerprint, fresh_id};
use idem_core::{
    Fingerprint, Store, UnixMillis,
    store::{Begin, BeginRequest, FencingToken, RecordState},
};
use idem_redis::RecordKeys;
use idem_test_support::redis_store::{Server, TestPrefix};

/// Writes `record` as the store keeps one: its fields in the record hash (times as decimal
/// milliseconds, absent fields left out) with the fingerprint's digest beside them, and the answer,
/// if it has one, in the body key. No expiry: the claim judges the times, not Redis.
fn write_record(conn: &mut redis::Connection, keys: &RecordKeys, record: &StoredRecord) {
    let digest = Fingerprint::decode(&record.fingerprint)
        .expect("the table's fingerprint")
        .digest()
        .to_vec();
    let mut hset = redis::cmd("HSET");
    hset.arg(&keys.record)
        .arg("state")
        .arg(&record.state)
        .arg("fingerprint")
        .arg(&record.fingerprint[..])
        .arg("digest")
        .arg(digest)
        .arg("created_at")
        .arg(record.created_at)
        .arg("replays")
        .arg(record.replays);
    if let Some(token) = &record.token {
        hset.arg("token").arg(&token[..]);
    }
    for (field, value) in [
        ("lease_until", record.lease_until),
        ("completed_at", record.completed_at),
        ("expires_at", record.expires_at),
        ("purge_at", record.purge_at),
    ] {
        if let Some(value) = value {
            hset.arg(field).arg(value);
        }
    }
    let _: i64 = hset.query(conn).expect("HSET of the record");
    if let Some(response) = &record.response {
        let _: () = redis::cmd("SET")
            .arg(&keys.body)
            .arg(&response[..])
            .query(conn)
            .expect("SET of the answer");
    }
}

/// What `begin` returned, in the words of the table; the record it returned must be the one
/// written, and a replay must count one and carry the answer.
fn judged(case: &ClaimRuleCase, begun: Begin) -> Existing {
    match begun {
        Begin::Acquired { recovered: false } => Existing::Replace,
        Begin::Acquired { recovered: true } => Existing::TakeOver,
        Begin::Existing(record) => {
            let written = u64::try_from(case.record.replays).expect("a count");
            if record.replays == written + 1 {
                assert!(
                    matches!(record.state, RecordState::Completed { response: Some(_), .. }),
                    "{}: a replay without its answer: {record:?}",
                    case.why
                );
                Existing::Replay
            } else {
                assert_eq!(
                    record.replays, written,
                    "{}: the count of replays changed by more than one",
                    case.why
                );
                Existing::Leave
            }
        }
    }
}

/// Every row of the claim rule's table, on one server, each on a key of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_begin_script_follows_the_claim_rule_table() {
    let prefix = TestPrefix::new(Server::Standalone);
    let store = prefix.connect("").await;
    let client = redis::Client::open(Server::Standalone.node_urls()[0].as_str()).expect("client");
    let mut conn = client.get_connection().expect("a connection to the test Redis");
    let another_request = fingerprint("another request");
    let cases = claim_rule_cases();
    assert!(!cases.is_empty());
    let mut disagreements = Vec::new();
    for case in &cases {
        let id = fresh_id();
        let keys = store.record_keys(&id);
        write_record(&mut conn, &keys, &case.record);
        let own = Fingerprint::decode(&case.record.fingerprint).expect("the table's fingerprint");
        let now = UnixMillis::from_i64(case.now);
        let request = BeginRequest {
            id: &id,
            fingerprint: if case.same_request { &own } else { &another_request },
            now,
            lease_until: now.plus(Duration::from_secs(60)),
            expires_at: now.plus(Duration::from_secs(3600)),
            purge_at: now.plus(Duration::from_secs(7200)),
            token: FencingToken::random(),
            origin: idem_core::testkit::origin(),
            identity: None,
        };
        let begun = store
            .begin(request)
            .await
            .unwrap_or_else(|err| panic!("{}: {err}", case.why));
        let got = judged(case, begun);
        if got != case.expected {
            disagreements.push(format!(
                "{} (same request: {}, now {}): expected {:?}, the script did {got:?}",
                case.why, case.same_request, case.now, case.expected
            ));
        }
    }
    assert!(
        disagreements.is_empty(),
        "the BEGIN script disagrees with the claim rule on {} of {} rows:\n{}",
        disagreements.len(),
        cases.len(),
        disagreements.join("\n")
    );
}
