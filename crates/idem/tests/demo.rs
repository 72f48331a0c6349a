//! `idem demo`: a small run on every store has a shared-store row with no double charge and no
//! lost payment, while the network really dropped answers; `--json` has the table's shape and its
//! arithmetic.

mod common;

use std::time::Duration;

use idem_test_support::{postgres_store, redis_store};
use serde_json::Value;

/// A small run takes a few seconds; this leaves room for a loaded machine.
const LIMIT: Duration = Duration::from_secs(120);

const PAYMENTS: u64 = 60;

/// Runs `idem demo` with `args`; returns its exit status, stdout and stderr.
async fn demo(args: &[&str]) -> (std::process::ExitStatus, String, String) {
    let output = common::run_idem(&[&["demo"][..], args].concat(), LIMIT).await;
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Runs a small `idem demo --json` (answers dropped at `drop_rate`) on `store` (or the default
/// store) and returns its report, checked for shape and arithmetic.
async fn small_demo(store: Option<&str>, drop_rate: &str) -> Value {
    let payments = PAYMENTS.to_string();
    let mut args = vec![
        "--json",
        "--payments",
        &payments,
        "--clients",
        "8",
        "--drop-rate",
        drop_rate,
    ];
    if let Some(store) = store {
        args.extend(["--store", store]);
    }
    let (status, stdout, stderr) = demo(&args).await;
    assert!(status.success(), "idem demo {args:?} failed ({status}):\n{stderr}");
    let report: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|err| panic!("idem demo --json printed no JSON ({err}):\n{stdout}\n{stderr}"));
    check(&report, PAYMENTS);
    report
}

fn count(row: &Value, field: &str) -> u64 {
    row[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} is not a count in {row}"))
}

/// The report's shape, and the invariants of every row and of the shared-store row.
fn check(report: &Value, payments: u64) {
    for field in ["seed", "instances", "payments", "clients"] {
        assert!(report[field].is_u64(), "{field} is a count: {report:#}");
    }
    for field in ["drop_rate", "reset_rate", "seconds"] {
        assert!(report[field].is_f64(), "{field} is a number: {report:#}");
    }
    assert!(
        report["store"].is_string(),
        "store is the shared store's URL: {report:#}"
    );
    assert_eq!(report["payments"], payments);
    let rows = report["rows"].as_array().expect("rows is a list");
    let set_ups: Vec<&str> = rows.iter().map(|row| row["set_up"].as_str().unwrap_or("?")).collect();
    // The fourth, whose payments service commits each charge with its answer, needs PostgreSQL.
    let on_postgres = report["store"]
        .as_str()
        .is_some_and(|store| store.starts_with("postgres"));
    let expected: &[&str] = if on_postgres {
        &["no-idempotency", "store-per-instance", "shared-store", "in-transaction"]
    } else {
        &["no-idempotency", "store-per-instance", "shared-store"]
    };
    assert_eq!(set_ups, expected, "{report:#}");
    for row in rows {
        assert!(row["title"].is_string(), "{row}");
        assert!(row["seconds"].is_f64(), "{row}");
        for field in ["attempts", "replayed", "dropped_answers", "resets", "recovered_runs"] {
            count(row, field);
        }
        let (charges, double, lost, errors) = (
            count(row, "charges"),
            count(row, "double_charges"),
            count(row, "lost"),
            count(row, "client_errors"),
        );
        assert_eq!(count(row, "payments"), payments, "{row}");
        assert_eq!(
            charges + lost,
            payments + double,
            "charges = payments - lost + double charges: {row}"
        );
        assert!(lost <= payments && errors <= payments, "{row}");
        assert!(
            count(row, "attempts") >= payments,
            "every payment is at least one attempt: {row}"
        );
    }
    let shared = &rows[2];
    assert_eq!(
        (count(shared, "double_charges"), count(shared, "lost")),
        (0, 0),
        "one shared store: every payment charged exactly once: {shared}"
    );
    assert_eq!(
        count(shared, "client_errors"),
        0,
        "one shared store: every client got its success: {shared}"
    );
    assert_eq!(count(shared, "charges"), payments, "{shared}");
}

/// The shared store held up against real faults, not an idle network.
fn faults_were_real(report: &Value) {
    let shared = &report["rows"][2];
    assert!(
        count(shared, "dropped_answers") > 0,
        "the network dropped answers: {shared}"
    );
    assert!(
        count(shared, "replayed") > 0,
        "retries of dropped answers got the stored answer: {shared}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_shared_store_charges_every_payment_once() {
    let report = small_demo(None, "0.3").await;
    faults_were_real(&report);
    assert!(
        report["store"].as_str().is_some_and(|s| s.starts_with("sqlite://")),
        "the default store is a SQLite file: {report:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_shared_store_charges_every_payment_once() {
    let report = small_demo(Some(&postgres_store::store_url()), "0.3").await;
    faults_were_real(&report);
    // Charges committed with their answers: under the same faults and crash, no double charge,
    // and no run reaches the payments service flagged recovered.
    let in_transaction = &report["rows"][3];
    assert_eq!(
        (
            count(in_transaction, "double_charges"),
            count(in_transaction, "lost"),
            count(in_transaction, "client_errors"),
            count(in_transaction, "recovered_runs"),
        ),
        (0, 0, 0, 0),
        "{in_transaction}"
    );
    assert!(count(in_transaction, "dropped_answers") > 0, "{in_transaction}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_shared_store_charges_every_payment_once() {
    faults_were_real(&small_demo(Some(&redis_store::store_url()), "0.3").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_shared_store_charges_every_payment_once() {
    faults_were_real(&small_demo(Some(&redis_store::cluster_store_url()), "0.3").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_idempotency_dropped_answers_double_charge() {
    // Half the answers dropped: with 60 payments, some are certainly dropped after the charge.
    let report = small_demo(None, "0.5").await;
    let none = &report["rows"][0];
    assert!(
        count(none, "double_charges") > 0,
        "retries of dropped answers charge again without idempotency: {none}"
    );
    assert_eq!(count(none, "replayed"), 0, "nothing replays without a store: {none}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_shows_every_set_up_and_the_seed() {
    let (status, stdout, stderr) = demo(&["--payments", "30", "--clients", "4", "--seed", "12345"]).await;
    assert!(status.success(), "idem demo failed ({status}):\n{stderr}");
    let header = stdout
        .lines()
        .find(|line| line.starts_with("| set-up"))
        .unwrap_or_else(|| panic!("no table:\n{stdout}"));
    let columns: Vec<&str> = header.split('|').map(str::trim).filter(|c| !c.is_empty()).collect();
    assert_eq!(
        columns,
        [
            "set-up",
            "payments",
            "charges",
            "double charges",
            "lost",
            "client errors",
            "recovered runs"
        ]
    );
    for title in ["no idempotency", "a store per instance", "one shared store"] {
        assert!(
            stdout.lines().any(|line| line.starts_with(&format!("| {title} "))),
            "a row for {title:?}:\n{stdout}"
        );
    }
    let shared = stdout
        .lines()
        .find(|line| line.starts_with("| one shared store "))
        .expect("the shared row");
    let cells: Vec<&str> = shared.split('|').map(str::trim).filter(|c| !c.is_empty()).collect();
    assert_eq!(cells[1..6], ["30", "30", "0", "0", "0"], "{stdout}");
    assert!(stdout.contains("--seed 12345"), "the seed is printed:\n{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_outside_zero_to_one_is_a_usage_error() {
    let (status, _, stderr) = demo(&["--drop-rate", "1.5"]).await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("between 0 and 1"), "{stderr}");
}
