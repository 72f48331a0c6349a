//! The Redis store never sends an expiry Redis refuses. `PEXPIRE` takes at most `i64::MAX` ms
//! minus the server's clock, and the scripts compute in Lua doubles: a record whose times lie
//! past that (a library user's policy that skipped `Policy::validate`, a store author's call)
//! is stored with its expiry cut to 2^53 ms from now, and its times as given, never refused
//! with "invalid expire time" (which left the key claimed without an expiry or answered 503).

use idem_core::testkit::{LEASE, fingerprint, fresh_id};
use idem_core::{
    Store, UnixMillis,
    store::{Begin, BeginRequest, Completion, FencingToken, RecordState},
};
use idem_test_support::redis_store::{Server, TestPrefix};

/// The longest expiry the scripts set: 2^53 ms.
const MOST_TTL: i64 = 1 << 53;

/// The key's `PTTL` on the standalone test server.
fn pttl(key: &str) -> i64 {
    let url = Server::Standalone.node_urls().remove(0);
    let mut conn = redis::Client::open(url.as_str())
        .expect("client")
        .get_connection()
        .expect("connection");
    redis::cmd("PTTL").arg(key).query(&mut conn).expect("PTTL")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn times_past_what_redis_expires_are_stored_with_an_expiry_it_takes() {
    let prefix = TestPrefix::new(Server::Standalone);
    let store = prefix.connect("").await;
    let cases = [
        ("the last time RFC 3339 writes", UnixMillis::LAST_RFC3339),
        ("2^53 ms", UnixMillis(1 << 53)),
        ("i64::MAX ms", UnixMillis(i64::MAX.unsigned_abs())),
        ("u64::MAX ms", UnixMillis(u64::MAX)),
    ];
    for (case, at) in cases {
        let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
        let token = FencingToken::random();
        let claimed = store
            .begin(BeginRequest {
                id: &id,
                fingerprint: &fp,
                now,
                lease_until: now.plus(LEASE),
                expires_at: at,
                purge_at: at,
                token,
                origin: idem_core::testkit::origin(),
                identity: None,
            })
            .await;
        assert!(
            matches!(claimed, Ok(Begin::Acquired { recovered: false })),
            "{case}: {claimed:?}"
        );
        let keys = store.record_keys(&id);
        let expires_within = |key: &str, what: &str| {
            let pttl = pttl(key);
            assert!((1..=MOST_TTL).contains(&pttl), "{case}: {what} has PTTL {pttl}");
        };
        expires_within(&keys.record, "the claim");

        let completed = store
            .complete(
                &id,
                token,
                Completion {
                    response: bytes::Bytes::from_static(b"answer"),
                    status: 201,
                    completed_at: now,
                    expires_at: at,
                    purge_at: at,
                },
            )
            .await;
        assert!(completed.is_ok(), "{case}: {completed:?}");
        expires_within(&keys.record, "the record");
        expires_within(&keys.body, "the answer");
        let record = store.get(&id).await.expect("get").expect("the record");
        assert!(
            matches!(record.state, RecordState::Completed { expires_at, .. } if expires_at.as_i64() == at.as_i64()),
            "{case}: the times are kept as given: {record:?}"
        );
    }
}
