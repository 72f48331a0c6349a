//! Credential scopes are stored as a keyed hash (HMAC-SHA256 under the store's salt and
//! `IDEM_SCOPE_SECRET`), through real `idem serve` processes on every store:
//! * records written before the change, under the bare-SHA-256 `cred:` scope of earlier versions,
//!   still replay after the upgrade (and still refuse a changed body), also to many copies at once;
//! * the store's bytes hold neither a credential nor its bare hash;
//! * a change of secret loses nothing while the previous one is configured;
//! * a malformed secret stops the start.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Gateway, Reply, Upstream, count, new_key, send, serve_refusing};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use idem_core::{
    Fingerprint, HeaderAllowList, IdempotencyKey, Scope, Store, StoredResponse, UnixMillis,
    store::{Begin, BeginRequest, Completion, FencingToken, RecordId},
};
use idem_test_support::raw;
use idem_test_support::{postgres_store, redis_store};
use sha2::{Digest, Sha256};

const BODY: &str = r#"{"amount":4200}"#;
/// What the previous version stored as the answer of the payment made before the upgrade.
const ANSWER_BEFORE: &str = r#"{"paid":"before the upgrade"}"#;
const SECRET: &str = "scope-secret-for-tests-0123456789";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The scope earlier versions stored for a credential: `cred:` and its bare SHA-256.
fn unsalted(authorization: &str) -> String {
    format!("cred:{}", hex(&Sha256::digest(authorization.as_bytes())))
}

async fn pay(gw: &Gateway, key: &str, token: &str, body: &str) -> Reply {
    let request = gw
        .post("/pay", body.to_owned())
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {token}"))
        .header("idempotency-key", key);
    send(request).await
}

/// Stores, as the previous version did, the completed payment `key` of the caller `token`: under
/// the unsalted scope, in a store that has no salt yet.
async fn write_as_before(store: &dyn Store, token: &str, key: &str) {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let fingerprint = Fingerprint::of(&Method::POST, &"/pay".parse().unwrap(), &headers, BODY.as_bytes());
    let id = RecordId {
        scope: Scope::from_stored(unsalted(&format!("Bearer {token}"))),
        key: IdempotencyKey::new(key).unwrap(),
    };
    let (now, token) = (UnixMillis::now(), FencingToken::random());
    let request = BeginRequest {
        id: &id,
        fingerprint: &fingerprint,
        now,
        lease_until: now.plus(Duration::from_secs(60)),
        expires_at: now.plus(std::time::Duration::from_secs(24 * 3600)),
        purge_at: now.plus(std::time::Duration::from_secs(7 * 24 * 3600)),
        token,
        origin: &idem_core::store::Origin::new("POST", "/pay", None),
        identity: None,
    };
    assert!(matches!(
        store.begin(request).await.unwrap(),
        Begin::Acquired { recovered: false }
    ));
    let answer = StoredResponse::capture(
        StatusCode::CREATED,
        &headers,
        &HeaderAllowList::default(),
        Some(Bytes::from_static(ANSWER_BEFORE.as_bytes())),
    );
    let day = Duration::from_secs(24 * 3600);
    let completion = Completion {
        response: answer.encode().into(),
        status: 201,
        completed_at: now,
        expires_at: now.plus(day),
        purge_at: now.plus(7 * day),
    };
    store.complete(&id, token, completion).await.unwrap();
}

/// On `store` (`open` is it, opened in this process): a payment stored before the upgrade replays
/// after it, and a new one is stored under a keyed hash.
async fn upgrade_keeps_replaying(store: &str, open: Arc<dyn Store>) {
    let old_key = new_key();
    write_as_before(&*open, "TOKEN-OLD-9001", &old_key).await;
    drop(open);

    let upstream = Upstream::start().await;
    let gw = Gateway::start_on_store_with_env(&upstream.url(), store, &[], &[("IDEM_SCOPE_SECRET", SECRET)]).await;
    // Sixteen copies of the retry at once: every one gets the answer stored before the upgrade.
    let copies = (0..16).map(|_| pay(&gw, &old_key, "TOKEN-OLD-9001", BODY));
    for reply in futures_util::future::join_all(copies).await {
        assert_eq!(reply.status, 201, "{reply}");
        assert_eq!(reply.text(), ANSWER_BEFORE, "{reply}");
        assert!(reply.replayed(), "{reply}");
    }
    assert_eq!(
        count(&upstream.state.pay),
        0,
        "a payment made before the upgrade is not made again"
    );
    // The record of before still judges the key: another body is refused, not run.
    pay(&gw, &old_key, "TOKEN-OLD-9001", r#"{"amount":1}"#)
        .await
        .assert_problem(422, "key-mismatch");
    // Another caller's key of the same name is its own.
    let other = pay(&gw, &old_key, "TOKEN-OTHER-1234", BODY).await;
    assert_eq!((other.status, other.replayed()), (201, false), "{other}");

    // A new payment: stored under the keyed hash, and replayed.
    let new = new_key();
    let first = pay(&gw, &new, "TOKEN-NEW-5150", BODY).await;
    assert_eq!(first.status, 201, "{first}");
    let again = pay(&gw, &new, "TOKEN-NEW-5150", BODY).await;
    assert!(again.replayed() && again.body == first.body, "{again}");
    assert_eq!(count(&upstream.state.pay), 2);

    let bytes = common::store_bytes(store);
    assert!(
        raw::contains(&bytes, b"before the upgrade"),
        "the store's bytes hold the answer stored before the upgrade ({} bytes read): the reader sees records",
        bytes.len()
    );
    for secret in [
        "TOKEN-NEW-5150".to_owned(),
        "TOKEN-OTHER-1234".to_owned(),
        hex(&Sha256::digest(b"Bearer TOKEN-NEW-5150")),
        hex(&Sha256::digest(b"Bearer TOKEN-OTHER-1234")),
    ] {
        assert!(
            !raw::contains(&bytes, secret.as_bytes()),
            "{secret} is in the store's bytes"
        );
    }

    // The operator finds both records by the caller's credential.
    let env = [("IDEM_SCOPE_SECRET", SECRET)];
    assert_eq!(
        common::inspect_json(store, &old_key, Some("TOKEN-OLD-9001"), &env).await["scope"],
        unsalted("Bearer TOKEN-OLD-9001")
    );
    let found = common::inspect_json(store, &new, Some("TOKEN-NEW-5150"), &env).await;
    let scope = found["scope"].as_str().expect("a scope");
    assert!(scope.starts_with("cred-mac:"), "{found}");
}

/// [`upgrade_keeps_replaying`] on every store: its records written as before by a store of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_from_before_the_keyed_hash_still_replay_on_every_store() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let sqlite = common::store_url_in(dir.path());
    let stores = [
        sqlite,
        postgres_store::store_url(),
        redis_store::store_url(),
        redis_store::cluster_store_url(),
    ];
    for store in stores {
        println!("case: {store}");
        let open: Arc<dyn Store> = if let Some(path) = store.strip_prefix("sqlite://") {
            Arc::new(idem_sqlite::SqliteStore::open(path).await.unwrap())
        } else if store.starts_with("postgres") {
            Arc::new(idem_postgres::PostgresStore::connect(&store).await.unwrap())
        } else {
            Arc::new(idem_redis::RedisStore::connect(&store).await.unwrap())
        };
        upgrade_keeps_replaying(&store, open).await;
    }
}

/// Setting a secret changes every credential scope: with the one before kept as
/// `IDEM_SCOPE_SECRET_PREVIOUS`, keys used before still replay; without it, they would not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_secret_keeps_replaying_while_the_previous_one_is_configured() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = common::store_url_in(dir.path());
    let key = new_key();

    let before = Gateway::start_on_store_with_env(&upstream.url(), &store, &[], &[]).await;
    let first = pay(&before, &key, "TOKEN-ROTATE", BODY).await;
    assert_eq!(first.status, 201, "{first}");
    drop(before);

    let changed = [("IDEM_SCOPE_SECRET", SECRET), ("IDEM_SCOPE_SECRET_PREVIOUS", "none")];
    let during = Gateway::start_on_store_with_env(&upstream.url(), &store, &[], &changed).await;
    let replay = pay(&during, &key, "TOKEN-ROTATE", BODY).await;
    assert!(replay.replayed() && replay.body == first.body, "{replay}");
    assert_eq!(count(&upstream.state.pay), 1, "not paid again");
    drop(during);

    // The secret is part of the hash: once the previous one is dropped, the same caller's old key
    // is a new key (which is why the previous secret must be kept for one retention).
    let after = Gateway::start_on_store_with_env(&upstream.url(), &store, &[], &[("IDEM_SCOPE_SECRET", SECRET)]).await;
    let other = new_key();
    let made = pay(&after, &other, "TOKEN-ROTATE", BODY).await;
    assert!(!made.replayed(), "{made}");
    assert!(pay(&after, &other, "TOKEN-ROTATE", BODY).await.replayed());
    let forgotten = pay(&after, &key, "TOKEN-ROTATE", BODY).await;
    assert!(!forgotten.replayed(), "the hash depends on the secret: {forgotten}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_secret_stops_the_start() {
    let upstream = ["--upstream", "http://127.0.0.1:9"];
    for (env, says) in [
        (
            [("IDEM_SCOPE_SECRET", "short-secret")],
            "IDEM_SCOPE_SECRET: is 12 bytes long; a scope secret must be at least 16 bytes",
        ),
        (
            [("IDEM_SCOPE_SECRET_PREVIOUS", "tiny-secret")],
            "IDEM_SCOPE_SECRET_PREVIOUS: is 11 bytes long",
        ),
    ] {
        let output = serve_refusing(&upstream, &env).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(says), "{stderr}");
        assert!(!stderr.contains(env[0].1), "the secret is not echoed: {stderr}");
    }
    let same = [("IDEM_SCOPE_SECRET", SECRET), ("IDEM_SCOPE_SECRET_PREVIOUS", SECRET)];
    let output = serve_refusing(&upstream, &same).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("IDEM_SCOPE_SECRET_PREVIOUS: is the same as IDEM_SCOPE_SECRET"),
        "{stderr}"
    );
    assert!(!stderr.contains(SECRET), "the secret is not echoed: {stderr}");
}
