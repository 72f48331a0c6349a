//! A gateway's wall clock that steps while it serves (an NTP correction, `date -s`, a resumed VM
//! setting its time) moves nothing: once the store's clock is measured, the gateway carries it
//! forward on a clock that is never stepped, so a step of days either way neither re-runs a
//! completed key nor writes a record whose purge time another instance reads as past. Real `idem serve`
//! processes on PostgreSQL and Redis; the stepped one reads its wall clock through libfaketime from
//! a file the test rewrites (its steady clocks are left alone, as a real step leaves them).

mod common;

use std::path::Path;

use common::{Gateway, Reply, Upstream, count, new_key, send, skewed_clock};
use idem_test_support::relay::Relay;
use idem_test_support::{postgres_store, redis_store};
use tokio::process::Command;

const BODY: &str = r#"{"amount":700,"currency":"EUR"}"#;

async fn pay(gw: &Gateway, key: &str) -> Reply {
    send(
        gw.post("/pay", BODY)
            .header("content-type", "application/json")
            .header("authorization", "Bearer clock-steps")
            .header("idempotency-key", key),
    )
    .await
}

/// A relay in front of the server `url` names, and `url` through it (its options kept).
async fn behind_relay(url: &str) -> (Relay, String) {
    let relay = Relay::start(idem_test_support::servers::socket_addr(url)).await;
    let through = idem_test_support::servers::with_addr(url, relay.addr());
    (relay, through)
}

/// Sets the stepped gateway's wall clock to `offset` from now (`+8d`, `-8d`, `+0`).
fn step(file: &Path, offset: &str) {
    std::fs::write(file, format!("{offset}\n")).expect("write the fake time file");
}

async fn a_step_of_the_wall_clock_moves_nothing(store: &str) {
    let upstream = Upstream::start().await;
    let steady = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let time_file = dir.path().join("faketime");
    step(&time_file, "+0");
    let mut command = Command::new(common::IDEM);
    let [preload, _, monotonic] = skewed_clock("+0");
    command
        .env(preload.0, preload.1)
        .env(monotonic.0, monotonic.1)
        .env("FAKETIME_TIMESTAMP_FILE", &time_file)
        .env("FAKETIME_NO_CACHE", "1");
    let stepped = Gateway::start_command_on_store(command, &upstream.url(), store, &[]).await;

    // A key answered before the step: the stepped gateway replays it after a step of eight days
    // ahead (past its tombstone's seven), and after one eight days back.
    let answered = new_key();
    let first = pay(&steady, &answered).await;
    assert_eq!(first.status, 201, "{first}");
    for offset in ["+8d", "-8d"] {
        step(&time_file, offset);
        let again = pay(&stepped, &answered).await;
        assert!(
            again.status == 201 && again.replayed() && again.body == first.body,
            "after a step of {offset}: {again}"
        );
    }
    assert_eq!(count(&upstream.state.pay), 1, "the answered key ran once");

    // A key first run on the stepped gateway while its clock is eight days back: the record it
    // writes is judged by the steady gateway as live, not as purged a day ago.
    step(&time_file, "-8d");
    let fresh = new_key();
    let ran = pay(&stepped, &fresh).await;
    assert_eq!((ran.status, ran.replayed()), (201, false), "{ran}");
    let replayed = pay(&steady, &fresh).await;
    assert!(
        replayed.replayed() && replayed.body == ran.body,
        "the steady gateway replays the stepped one's answer: {replayed}"
    );
    step(&time_file, "+8d");
    let ahead = new_key();
    let ran = pay(&stepped, &ahead).await;
    assert_eq!((ran.status, ran.replayed()), (201, false), "{ran}");
    assert!(pay(&steady, &ahead).await.replayed(), "and the same eight days ahead");
    assert_eq!(count(&upstream.state.pay), 3, "each key ran once");
    let recovered = upstream
        .state
        .seen("pay")
        .iter()
        .filter(|seen| seen.recovered.is_some())
        .count();
    assert_eq!(recovered, 0, "no run was a recovery either");
}

common::store_tests!(a_step_of_the_wall_clock_moves_nothing {
    a_step_of_the_wall_clock_moves_nothing_on_postgres: postgres_store::store_url(),
    a_step_of_the_wall_clock_moves_nothing_on_redis: redis_store::store_url(),
});

/// A gateway whose wall clock is eight days ahead, started while its store is slow to tell the
/// time (a reply held 1.5 s, over the precision wanted of later measurements), still judges on
/// the store's clock from its first request: the first measurement is taken however slow, since
/// half its round trip bounds its error where the machine's own clock has no bound at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_while_its_store_is_slow_to_tell_the_time_judges_on_the_store_clock() {
    let upstream = Upstream::start().await;
    let direct = redis_store::store_url();
    let steady = Gateway::start_on_store(&upstream.url(), &direct, &[]).await;
    let answered = new_key();
    let first = pay(&steady, &answered).await;
    assert_eq!(first.status, 201, "{first}");

    let (relay, through_relay) = behind_relay(&direct).await;
    // Every `TIME` for the next 20 s answers 1.5 s late: the measurement before the gateway
    // listens, and the one its clock makes at its first use.
    relay.hold_replies_after(
        b"TIME",
        std::time::Duration::from_millis(1_500),
        std::time::Duration::from_secs(20),
    );
    let ahead = Gateway::start_skewed(&upstream.url(), &through_relay, "+8d", &[]).await;
    assert!(relay.holds() > 0, "the store's clock was slow to answer at the start");
    let again = pay(&ahead, &answered).await;
    assert!(
        again.status == 201 && again.replayed() && again.body == first.body,
        "judged on the store's clock, the answer is eight days from its purge, not past it: {again}"
    );
    assert_eq!(count(&upstream.state.pay), 1, "the answered key ran once");
}

/// A store that stays slow to tell the time is followed by its most precise reading: a
/// measurement over the usual second replaces the one held when it is no slower, instead of being
/// thrown away while the first, slower one stays in use for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_stays_slow_to_tell_the_time_is_followed_by_its_best_reading() {
    let upstream = Upstream::start().await;
    let (relay, through_relay) = behind_relay(&redis_store::store_url()).await;
    let hold = |millis, secs| {
        relay.hold_replies_after(
            b"TIME",
            std::time::Duration::from_millis(millis),
            std::time::Duration::from_secs(secs),
        );
    };
    // The first readings answer 1.9 s late; from then on every one 1.2 s late.
    hold(1_900, 3);
    let gw = Gateway::start_on_store(&upstream.url(), &through_relay, &[]).await;
    hold(1_200, 60);
    let key = new_key();
    assert_eq!(pay(&gw, &key).await.status, 201);
    // The readings at the start may each be refused or kept, by a millisecond either way: what
    // counts is what becomes of those made from now on.
    let before = gw.stderr().len();
    // The clock measures again 10 s after its first use: that reading (1.2 s) is kept.
    tokio::time::sleep(std::time::Duration::from_secs(13)).await;
    assert!(relay.holds() >= 2, "the store's clock was read again, slowly");
    let stderr = gw.stderr();
    assert!(
        !stderr[before..].contains("could not read the store's clock"),
        "a reading no slower than the one held is used, not refused:\n{stderr}"
    );
    assert!(pay(&gw, &key).await.replayed());
}
