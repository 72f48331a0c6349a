//! The rule, checked generatively: no key runs again at the upstream unless its last answer
//! was released (5xx, 408, 409, 425, 429, or nothing sent) or the run carries
//! `Idempotency-Recovered: true`; no caller gets another caller's answer; an answer replays until
//! its ttl, then answers `422 key-expired` until its tombstone-ttl, and so does an unknown outcome.
//!
//! A seeded, model-based test against real processes: `idem serve` gateways (two on one SQLite
//! file, one alone on SQLite, two on one PostgreSQL schema), a scripted upstream in this process
//! that records every request it reads, and the operator's commands run as processes. Each step
//! is drawn by [`rule::generator`], run by [`rule::driver`], and judged by [`rule::oracle`], which is
//! written from the design (docs/design.md), not from idem's code. The seed is printed at the start and with any
//! failure, with every step so far.
//!
//! * `IDEM_RULE_SEED=N` replays a run (decimal or `0x` hex);
//! * `IDEM_RULE_STEPS=N` runs N steps per set-up (default 120: the three set-ups run in about a
//!   minute together in a debug build on two cores);
//! * `IDEM_RULE_KEEP_GOING=1` goes on after a violation and reports them all at the end;
//! * `IDEM_RULE_PLAIN=1` spells every method and path canonically (same draws otherwise), to
//!   look past a failure in how methods and paths are read.
//!
//! What the generator covers (keep this list in step with `rule/generator.rs`):
//! * keyed requests in 3 scopes (anonymous, two `Authorization` credentials), 4 keys reused in
//!   every scope, most repeating the key's last request, some spelt another way or with another
//!   body (a key-mismatch);
//! * method spellings `POST`, `post`, `Post`, `PATCH`, `patch`, `PUT`; path spellings of
//!   `/payments/1` and the others: `//a/b`, `/a//b`, `/a/b/`, `/a/b//`, `/a%2Fb`, `/a%2fb`,
//!   `/a/./b`, `/a/x/../b`, `/hooks/../a/b` (through the disabled route), `/%61/b`, and `*`;
//! * a config with four routes: `/payments/{id}` requiring a key, `/orders/{id}` with its own
//!   ttl, tombstone-ttl and methods (`POST`, `PUT`), `/hooks/*` disabled, the catch-all `/*`; the
//!   default method set, and `--methods POST,PATCH` given as a flag in one set-up;
//! * keyless requests, most on the route that requires a key;
//! * upstream behaviours: 200/201 and stored 4xx (404, 422), released statuses (500, 503, 408,
//!   409, 425, 429), the connection dropped after the request was read, a hang past
//!   `--upstream-timeout` that then answers (with a retry sent meanwhile), a hang past
//!   `--run-timeout`, the upstream refusing connections;
//! * copies of one request sent at once to different instances;
//! * `idem delete` of a key at rest, of a key whose run hangs at the upstream while a copy waits
//!   on another instance, of a key whose holder was killed; `idem purge`;
//! * the clock of every idem process moved ahead (libfaketime reading one shared file) by 20 s
//!   (past the lease), 8 min, 30 min (past /orders' ttl), 2 h (past the ttl), 12 h, 2 d (past
//!   the tombstone-ttl); on PostgreSQL, whose clock cannot move, the operator's commands run on a
//!   machine clock skewed by up to 9 days instead;
//! * a gateway killed (kill -9) and restarted, idle or while its run hangs at the upstream;
//! * the store losing its data under the running gateways (SQLite's rows deleted, PostgreSQL's
//!   schema dropped and migrated anew), with one gateway started again after it or none: every
//!   record is then gone, and no instance may replay a lost answer or split a caller's scope.
//!
//! Not covered: `missing-key = "fingerprint:…"`, the library's checkpoints, TLS, secrets in logs.

mod common;

/// The test's parts, in `tests/rule/`.
mod rule {
    pub(crate) mod driver;
    pub(crate) mod generator;
    pub(crate) mod oracle;
    pub(crate) mod routes;
    pub(crate) mod upstream;
    pub(crate) mod wire;
}

use idem_test_support::seed::Seed;
use idem_test_support::servers;

use rule::driver::{self, Clock, Driver, Setup};
use rule::generator::Generator;

/// The variable that replays a run.
const SEED_VAR: &str = "IDEM_RULE_SEED";
/// Steps per set-up unless `IDEM_RULE_STEPS` says otherwise.
const DEFAULT_STEPS: usize = 120;

/// This process's seed, chosen once and printed once.
fn seed() -> Seed {
    static SEED: std::sync::OnceLock<Seed> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        let seed = match std::env::var(SEED_VAR) {
            Ok(text) if !text.trim().is_empty() => Seed::parse(&text)
                .unwrap_or_else(|| panic!("{SEED_VAR}={text:?} is not a number (decimal or 0x hexadecimal)")),
            _ => Seed(common::random_u64() >> 11),
        };
        eprintln!("rule seed: {} (replay with {SEED_VAR}={})", seed.0, seed.0);
        seed
    })
}

fn steps() -> usize {
    match std::env::var("IDEM_RULE_STEPS") {
        Ok(text) if !text.trim().is_empty() => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("IDEM_RULE_STEPS={text:?} is not a number")),
        _ => DEFAULT_STEPS,
    }
}

/// Runs the generated steps on `setup` and fails, with the seed and every step, on a violation.
async fn check(setup: Setup) {
    let seed = seed();
    let name = setup.name;
    let instances = setup.instances;
    let can_jump = setup.clock == Clock::Shared;
    let nonce = format!("{:x}", common::random_u64() & 0xffff_ffff);
    let plain = std::env::var("IDEM_RULE_PLAIN").is_ok_and(|v| v == "1");
    let mut generator = Generator::new(seed.rng(name), instances, can_jump, plain, &nonce);
    let mut driver = Driver::start(setup, seed.rng(&format!("{name}/skew"))).await;
    let keep_going = std::env::var("IDEM_RULE_KEEP_GOING").is_ok_and(|v| v == "1");
    driver::run(&mut driver, &mut generator, steps(), keep_going).await;
    if !driver.violations.is_empty() {
        panic!(
            "The rule broken in set-up {name} (seed {}; replay with {SEED_VAR}={}):\n  {}\nsteps:\n{}",
            seed.0,
            seed.0,
            driver.violations.join("\n  "),
            driver.log.join("\n")
        );
    }
    eprintln!("{name}: {} steps kept the rule (seed {})", driver.log.len(), seed.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_sqlite_file_keep_the_rule() {
    check(Setup {
        name: "two-on-sqlite",
        instances: 2,
        store: None,
        clock: Clock::Shared,
        flags: &[],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_on_sqlite_keeps_the_rule() {
    check(Setup {
        name: "one-on-sqlite",
        instances: 1,
        store: None,
        clock: Clock::Shared,
        flags: &["--methods", "POST,PATCH"],
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_postgres_keep_the_rule_whatever_the_operators_clock() {
    let schema = servers::unique_name("rule");
    let base = servers::postgres_url();
    let store = servers::with_options(&base, &format!("schema={schema}"));
    let _cleanup = servers::Cleanup::postgres_schema(&base, &schema);
    check(Setup {
        name: "two-on-postgres",
        instances: 2,
        store: Some(store),
        clock: Clock::SkewedOperator,
        flags: &[],
    })
    .await;
}
