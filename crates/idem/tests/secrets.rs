//! No secret is ever printed: a store URL's password, the sealing keys (`IDEM_ENCRYPTION_KEYS`)
//! and the scope secret (`IDEM_SCOPE_SECRET`) stay out of every log line, error, `/metrics` label
//! and command output of real `idem` processes, on success and on failure.

mod common;

use std::time::Duration;

use common::{Gateway, Upstream, describe, run_idem, run_idem_with_env, serve_refusing};
use idem_test_support::{postgres_store, redis_store};

/// The password put into every store URL here; it must never come out.
const PASSWORD: &str = "Sup3r-S3cret-Pw";
/// The scope secret given to the gateway.
const SCOPE_SECRET: &str = "scope-secret-Xy7Qw9";
const LIMIT: Duration = Duration::from_secs(60);

/// `url` (`scheme://[user@]rest`) with `PASSWORD` as its user's password.
fn with_password(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    match rest.split_once('@') {
        Some((user, host)) => format!("{scheme}://{user}:{PASSWORD}@{host}"),
        None => format!("{scheme}://:{PASSWORD}@{rest}"),
    }
}

#[track_caller]
fn assert_secret_free(what: &str, text: &str, secrets: &[&str]) {
    for secret in secrets {
        assert!(!text.contains(secret), "{what} printed a secret ({secret}):\n{text}");
    }
}

fn printed(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `idem migrate`, `serve` (its start line, its log and `/metrics`), `inspect`, `delete` and
/// `purge` on a store whose URL carries a password.
async fn no_command_prints_the_store_password(store: &str) {
    assert!(store.contains(PASSWORD), "{store}");
    let env = [("IDEM_SCOPE_SECRET", SCOPE_SECRET)];
    let secrets = [PASSWORD, SCOPE_SECRET];

    let upstream = Upstream::start().await;
    let gw = Gateway::start_on_store_with_env(&upstream.url(), store, &[], &env).await;
    let key = common::new_key();
    let reply = common::send(
        gw.post("/pay", "{}")
            .header("content-type", "application/json")
            .header("authorization", "Bearer alice")
            .header("idempotency-key", &key),
    )
    .await;
    assert_eq!(reply.status, 201, "{reply}");
    let metrics = common::send(gw.client.get(format!("{}/metrics", gw.admin))).await;
    assert_eq!(metrics.status, 200, "{metrics}");
    assert_secret_free("/metrics", &metrics.text(), &secrets);
    let log = gw.stderr_once("the request's log line", |log| log.contains(&key)).await;
    assert_secret_free("idem serve's log", &log, &secrets);
    assert!(log.contains("idem serve started"), "{log}");

    let migrate = run_idem(&["migrate", "--store", store], LIMIT).await;
    assert!(migrate.status.success(), "{}", describe(&migrate));
    assert_secret_free("idem migrate", &printed(&migrate), &secrets);
    assert!(
        printed(&migrate).contains("***"),
        "the URL is shown with its password masked: {}",
        describe(&migrate)
    );

    for args in [
        &["inspect", "--store", store, "--authorization", "Bearer alice", &key][..],
        &["inspect", "--store", store, "--json", "no-such-key"],
        &["delete", "--store", store, "--authorization", "Bearer alice", &key],
        &["purge", "--store", store],
    ] {
        let output = run_idem_with_env(args, &env, LIMIT).await;
        assert_secret_free(&format!("idem {}", args[0]), &printed(&output), &secrets);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_no_command_prints_the_store_password() {
    no_command_prints_the_store_password(&with_password(&postgres_store::store_url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_no_command_prints_the_store_password() {
    no_command_prints_the_store_password(&with_password(&redis_store::store_url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_cannot_be_opened_is_named_without_its_password() {
    // Nothing listens on port 1: every one of these fails to open.
    for store in [
        format!("postgres://idem:{PASSWORD}@127.0.0.1:1/test"),
        format!("postgres://127.0.0.1:1/test?user=idem&password={PASSWORD}"),
        format!("redis://:{PASSWORD}@127.0.0.1:1/"),
        format!("redis://idem:{PASSWORD}@127.0.0.1:1/?prefix=x&pool=bad"),
        format!("redis+cluster://idem:{PASSWORD}@127.0.0.1:1,127.0.0.1:2/"),
        format!("mysql://idem:{PASSWORD}@127.0.0.1:1/test"),
        format!("postgres://idem:{PASSWORD}@127.0.0.1:1/test?pool_size=0"),
    ] {
        for command in ["migrate", "purge"] {
            let output = run_idem(&[command, "--store", &store], LIMIT).await;
            assert!(!output.status.success(), "{store}: {}", describe(&output));
            assert_secret_free(&format!("idem {command} on {store}"), &printed(&output), &[PASSWORD]);
        }
        let output = serve_refusing_or_failing(&store).await;
        assert_secret_free(&format!("idem serve on {store}"), &output, &[PASSWORD]);
    }
}

/// What `idem serve` on `store` (which cannot be opened) printed before it exited.
async fn serve_refusing_or_failing(store: &str) -> String {
    let output = common::serve_to_end("http://127.0.0.1:9", store, LIMIT).await;
    assert!(!output.status.success(), "{store}: {}", describe(&output));
    printed(&output)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_sealing_key_is_refused_without_echoing_it() {
    // Two real 32-byte keys in base64, written the wrong way round or with a stray separator.
    let key = "q83vEjRWeJCrze8SNFZ4kKvN7xI0VniQq83vEjRWeJA=";
    let other = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    for keys in [
        format!("{key}:k1"),
        format!("k1={key}:x"),
        format!("k1:{other},{key}:k2"),
        format!("k1:{key}x"),
        format!("k1:{key},k1:{other}"),
        key.to_owned(),
        format!("k1:{}", &key[..20]),
    ] {
        let output = serve_refusing(
            &["--upstream", "http://127.0.0.1:9"],
            &[("IDEM_ENCRYPTION_KEYS", keys.as_str())],
        )
        .await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("IDEM_ENCRYPTION_KEYS"),
            "{keys}: names the variable: {stderr}"
        );
        for secret in [key, &key[..20], &key[8..28], other, &other[8..28]] {
            assert!(
                !stderr.contains(secret),
                "{keys}: the error echoes key material:\n{stderr}"
            );
        }
        let dir = tempfile::tempdir().expect("a temp dir");
        let store = common::store_url_in(dir.path());
        let inspect = run_idem_with_env(
            &["inspect", "--store", &store, "k"],
            &[("IDEM_ENCRYPTION_KEYS", keys.as_str())],
            LIMIT,
        )
        .await;
        for secret in [key, &key[8..28], other, &other[8..28]] {
            assert!(
                !printed(&inspect).contains(secret),
                "{keys}: idem inspect echoes key material:\n{}",
                describe(&inspect)
            );
        }
    }
}
