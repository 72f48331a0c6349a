//! The operator's commands judge time on the store's clock, as `idem serve` does: `idem purge`
//! and `idem inspect` run on a machine whose clock is days ahead (libfaketime) change nothing a
//! client gets and show the record as the store's clock has it. The server's clock is the
//! store's on PostgreSQL and Redis; SQLite's is the machine's by design, so it is not tried here.

mod common;

use std::time::Duration;

use common::{Gateway, Upstream, count, describe, json_field, new_key, run_idem_skewed};
use idem_test_support::{postgres_store, redis_store};

const PAY_BODY: &str = r#"{"amount":1000,"currency":"EUR"}"#;
const LIMIT: Duration = Duration::from_secs(60);

/// A key answered through a gateway whose clock is right; then `purge` and `inspect` run
/// 2 days ahead (past the answer's ttl of 24 h) and 9 days ahead (past its tombstone's 7 d).
async fn commands_on_a_clock_days_ahead_change_nothing(store: &str) {
    let upstream = Upstream::start().await;
    let gw = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let key = new_key();
    let first = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(first.status, 201, "{first}");

    for ahead in ["+2d", "+9d"] {
        let purge = run_idem_skewed(&["purge", "--store", store], ahead, LIMIT).await;
        assert!(purge.status.success(), "purge {ahead}: {}", describe(&purge));

        let inspect = run_idem_skewed(&["inspect", "--store", store, "--json", &key], ahead, LIMIT).await;
        assert!(inspect.status.success(), "inspect {ahead}: {}", describe(&inspect));
        let json = String::from_utf8_lossy(&inspect.stdout).into_owned();
        assert_eq!(
            json_field(&json, "state").as_deref(),
            Some("completed"),
            "{ahead}: {json}"
        );
        assert_eq!(
            json_field(&json, "answer").as_deref(),
            Some("whole"),
            "{ahead}: on the store's clock the answer is live: {json}"
        );

        let retry = gw.post_json("/pay", Some(&key), PAY_BODY).await;
        retry.assert_replay_of(&first, &format!("the retry after purge {ahead}"));
    }
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
}

common::store_tests!(commands_on_a_clock_days_ahead_change_nothing {
    postgres_commands_on_a_clock_days_ahead_change_nothing: postgres_store::store_url(),
    redis_commands_on_a_clock_days_ahead_change_nothing: redis_store::store_url(),
});
