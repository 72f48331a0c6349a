//! Stored answers sealed at rest (`IDEM_ENCRYPTION_KEYS`), through real `idem serve` processes:
//! the bytes of every store hold neither an answer nor a credential in clear; keys rotate without
//! losing records; an answer no configured key opens is `500 answer-unreadable`, never run again;
//! a sealed answer copied onto another record does not open; a malformed key stops the start. A
//! record the store holds but cannot read (damaged) is `500 answer-unreadable` too, never run, not
//! even under `--fail-open`, and `idem delete --authorization` removes it.

mod common;

use common::{Gateway, Reply, Upstream, count, new_key, run_idem, send, serve_refusing};
use idem_test_support::raw;
use idem_test_support::{postgres_store, redis_store};

const KEY_A: &str = "a:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
const KEY_B: &str = "b:HxwdHhsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=";
const KEY_C: &str = "c:ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";

/// A keyed payment whose body (echoed in the answer) carries `card`, from the caller `token`.
async fn pay(gw: &Gateway, key: &str, token: &str, card: &str) -> Reply {
    let request = gw
        .post("/pay", format!(r#"{{"card":"{card}"}}"#))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {token}"))
        .header("idempotency-key", key);
    send(request).await
}

/// On `store` (the `name`d kind): a sealed answer and an unsealed one side by side; then the store's
/// bytes hold the unsealed answer and none of the secrets.
async fn sealed_at_rest(name: &str, store: &str) {
    println!("store: {name}");
    let upstream = Upstream::start().await;
    let sealing =
        Gateway::start_on_store_with_env(&upstream.url(), store, &[], &[("IDEM_ENCRYPTION_KEYS", KEY_A)]).await;
    let (sealed_key, plain_key) = (new_key(), new_key());
    let first = pay(&sealing, &sealed_key, "TOKEN-SEALED-7731", "CARD-SEALED-4242").await;
    assert_eq!(first.status, 201, "{first}");
    let replay = pay(&sealing, &sealed_key, "TOKEN-SEALED-7731", "CARD-SEALED-4242").await;
    assert!(replay.replayed(), "a sealed answer replays: {replay}");
    assert_eq!(replay.body, first.body);

    // Beside it, a gateway without keys stores as before (and shows the reader sees answers).
    let plain = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let other = pay(&plain, &plain_key, "TOKEN-PLAIN-5511", "CARD-PLAIN-1111").await;
    assert_eq!(other.status, 201, "{other}");
    // It cannot open the sealed answer: 500, and the payment is not made again.
    let unreadable = pay(&plain, &sealed_key, "TOKEN-SEALED-7731", "CARD-SEALED-4242").await;
    unreadable.assert_problem(500, "answer-unreadable");
    assert_eq!(count(&upstream.state.pay), 2, "an unreadable answer is never run again");

    let bytes = common::store_bytes(store);
    assert!(
        raw::contains(&bytes, b"CARD-PLAIN-1111"),
        "{name}: the store's bytes hold the unsealed answer ({} bytes read): the reader sees answers",
        bytes.len()
    );
    for secret in ["CARD-SEALED-4242", "TOKEN-SEALED-7731", "TOKEN-PLAIN-5511"] {
        assert!(
            !raw::contains(&bytes, secret.as_bytes()),
            "{name}: {secret} is in the store's bytes"
        );
    }
}

/// Every kind of store, in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_store_holds_an_answer_or_credential_in_clear() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let stores = [
        ("sqlite", common::store_url_in(dir.path())),
        ("postgres", postgres_store::store_url()),
        ("redis", redis_store::store_url()),
        ("redis cluster", redis_store::cluster_store_url()),
    ];
    for (name, store) in stores {
        sealed_at_rest(name, &store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_rotate_and_a_key_that_is_gone_leaves_the_answer_unreadable_not_rerun() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = common::store_url_in(dir.path());
    let (old, new) = (new_key(), new_key());

    let before =
        Gateway::start_on_store_with_env(&upstream.url(), &store, &[], &[("IDEM_ENCRYPTION_KEYS", KEY_A)]).await;
    let sealed_by_a = pay(&before, &old, "t", "CARD-1").await;
    drop(before);

    // Rotation: the new key first, the old kept.
    let rotated = format!("{KEY_B},{KEY_A}");
    let after =
        Gateway::start_on_store_with_env(&upstream.url(), &store, &[], &[("IDEM_ENCRYPTION_KEYS", &rotated)]).await;
    let replay = pay(&after, &old, "t", "CARD-1").await;
    assert!(
        replay.replayed(),
        "a record sealed by the old key still replays: {replay}"
    );
    assert_eq!(replay.body, sealed_by_a.body);
    pay(&after, &new, "t", "CARD-2").await;
    assert_eq!(
        common::inspect_json(&store, &old, Some("t"), &[]).await["sealed_by"],
        "a"
    );
    assert_eq!(
        common::inspect_json(&store, &new, Some("t"), &[]).await["sealed_by"],
        "b",
        "new answers are sealed by the first key"
    );
    drop(after);

    // The old key dropped too soon: its records cannot be read, and are not run again.
    let without_a =
        Gateway::start_on_store_with_env(&upstream.url(), &store, &[], &[("IDEM_ENCRYPTION_KEYS", KEY_C)]).await;
    pay(&without_a, &old, "t", "CARD-1")
        .await
        .assert_problem(500, "answer-unreadable");
    pay(&without_a, &new, "t", "CARD-2")
        .await
        .assert_problem(500, "answer-unreadable");
    assert_eq!(count(&upstream.state.pay), 2, "nothing ran again");
    assert!(
        without_a.stderr().contains("sealed under key"),
        "the log says why: {}",
        without_a.stderr()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_answer_copied_onto_another_record_does_not_open() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = common::store_url_in(dir.path());
    let env = [("IDEM_ENCRYPTION_KEYS", KEY_A)];
    let gw = Gateway::start_on_store_with_env(&upstream.url(), &store, &[], &env).await;
    let (victim, thief) = (new_key(), new_key());
    let victims = pay(&gw, &victim, "victim", "CARD-VICTIM").await;
    assert_eq!(victims.status, 201);
    pay(&gw, &thief, "thief", "CARD-THIEF").await;

    // Someone with write access to the store moves the victim's sealed answer onto their record.
    let db = rusqlite::Connection::open(store.strip_prefix("sqlite://").expect("a sqlite:// URL"))
        .expect("open the SQLite file");
    let moved = db
        .execute(
            "UPDATE idem_records SET response = (SELECT response FROM idem_records WHERE key = ?1) WHERE key = ?2",
            [victim.trim_matches('"'), thief.trim_matches('"')],
        )
        .expect("move the answer");
    assert_eq!(moved, 1);
    let stolen = pay(&gw, &thief, "thief", "CARD-THIEF").await;
    stolen.assert_problem(500, "answer-unreadable");
    assert!(!stolen.text().contains("CARD-VICTIM"), "{stolen}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_key_stops_the_start_without_showing_it() {
    for keys in [
        "a:AAECAw==",
        "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
        "a:@@@",
        &format!("{KEY_A},{KEY_A}"),
    ] {
        let output = serve_refusing(&["--upstream", "http://127.0.0.1:9"], &[("IDEM_ENCRYPTION_KEYS", keys)]).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("IDEM_ENCRYPTION_KEYS"), "{keys}: {stderr}");
        assert!(!stderr.contains("AAECAw"), "{keys}: the key is not shown: {stderr}");
    }
}

/// `store`'s record of `key` is damaged by `damage` after its request ran: every copy of the
/// request is told `500 answer-unreadable`, with no `Retry-After` (retrying cannot help), by a
/// gateway that fails open too (the store answered: this is no outage), and nothing runs again;
/// `idem inspect --authorization` says the record cannot be read, `idem delete --authorization`
/// removes it, and the key then runs as a new one.
async fn a_damaged_record_is_refused_until_deleted(store: &str, damage: impl Fn(&str)) {
    let upstream = Upstream::start().await;
    let closed = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let open = Gateway::start_on_store(&upstream.url(), store, &["--fail-open"]).await;
    let key = new_key();
    let first = pay(&closed, &key, "damaged", "CARD-1").await;
    assert_eq!(first.status, 201, "{first}");
    damage(&key);
    for gw in [&closed, &open, &closed] {
        let refused = pay(gw, &key, "damaged", "CARD-1").await;
        refused.assert_problem(500, "answer-unreadable");
        assert_eq!(refused.header("retry-after"), None, "{refused}");
        assert!(refused.detail().contains("retrying does not help"), "{refused}");
    }
    assert_eq!(count(&upstream.state.pay), 1, "a damaged record is never run again");

    let limit = std::time::Duration::from_secs(30);
    let record = ["--store", store, "--authorization", "Bearer damaged", &key];
    let inspect = run_idem(&[&["inspect"][..], &record].concat(), limit).await;
    assert!(!inspect.status.success(), "{}", common::describe(&inspect));
    assert!(
        String::from_utf8_lossy(&inspect.stderr).contains("corrupt record"),
        "{}",
        common::describe(&inspect)
    );
    let delete = run_idem(&[&["delete"][..], &record].concat(), limit).await;
    assert!(delete.status.success(), "{}", common::describe(&delete));
    assert!(
        String::from_utf8_lossy(&delete.stdout).contains("could not read")
            && String::from_utf8_lossy(&delete.stdout).contains("not marked recovered"),
        "{}",
        common::describe(&delete)
    );
    let again = pay(&closed, &key, "damaged", "CARD-1").await;
    assert_eq!(again.status, 201, "{again}");
    assert!(!again.replayed(), "{again}");
    assert_eq!(
        count(&upstream.state.pay),
        2,
        "deleted by the operator: the key runs again"
    );
    assert!(pay(&open, &key, "damaged", "CARD-1").await.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_damaged_record_is_refused_until_deleted() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = common::store_url_in(dir.path());
    let file = store.strip_prefix("sqlite://").expect("a sqlite:// URL").to_owned();
    a_damaged_record_is_refused_until_deleted(&store, |key| {
        let db = rusqlite::Connection::open(&file).expect("open the SQLite file");
        let damaged = db
            .execute("UPDATE idem_records SET fingerprint = x'00' WHERE key = ?1", [key])
            .expect("damage the record");
        assert_eq!(damaged, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_damaged_record_is_refused_until_deleted() {
    let store = redis_store::store_url();
    let (server, prefix) = store.split_once("/?prefix=").expect("a URL with a prefix");
    let redis_cli = |args: &[&str]| common::redis_cli(server, args);
    a_damaged_record_is_refused_until_deleted(&store, |_key| {
        // The test's prefix holds this one record.
        let pattern = format!("{prefix}:*:rec");
        let scanned = redis_cli(&["--scan", "--pattern", &pattern]);
        let records: Vec<&str> = scanned.lines().collect();
        assert_eq!(records.len(), 1, "{scanned}");
        redis_cli(&["HSET", records[0], "expires_at", "soon"]);
    })
    .await;
}
