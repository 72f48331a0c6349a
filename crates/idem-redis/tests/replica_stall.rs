//! A replica that stalls under `replicas=1` (its process stopped with `SIGSTOP`, as a long GC or
//! disk pause does) while new keys keep arriving, 40 a second: each claim is refused within its
//! own `replica_timeout` (no claim waits behind another's `WAIT`), the refusal names the replica
//! setting, and a key refused as new is forgotten, so its next request runs as the first one,
//! unflagged. A takeover no replica acknowledged stays in flight (its run may have had effects).
//! Once the replica goes on, everything runs cleanly.
//!
//! The servers are the tests' own (`idem_test_support::replicated`), gone with them.

use std::sync::Arc;
use std::time::Duration;

use idem_core::protocol::{Admission, Decision, Outcome, Protocol};
use idem_core::testkit::{claim, fingerprint, fresh_id};
use idem_core::{
    Fingerprint, Policy, Store, StoreError, UnixMillis,
    store::{Begin, FencingToken, RecordState, Release},
};
use idem_redis::RedisStore;
use idem_test_support::redis_store::{connect_url, fresh_prefix};
use idem_test_support::replicated::ReplicatedRedis;
use idem_test_support::servers::with_options;
use tokio::time::Instant;

/// How long a write waits for the replica.
const REPLICA_TIMEOUT: Duration = Duration::from_millis(500);
/// New keys during the stall, one every [`ARRIVAL_GAP`] (40 a second).
const NEW_KEYS: usize = 44;
const ARRIVAL_GAP: Duration = Duration::from_millis(25);
/// A refusal later than this is a claim that waited behind others (4× the replica timeout: a
/// machine under load stays far below it, a queue behind 4 connections' `WAIT`s does not).
const REFUSED_WITHIN: Duration = Duration::from_secs(2);

/// A primary with one stoppable replica, and a store on the primary that waits for it.
async fn stallable() -> (ReplicatedRedis, RedisStore) {
    stallable_with(REPLICA_TIMEOUT).await
}

/// As [`stallable`], with writes that wait `replica_timeout` for the replica.
async fn stallable_with(replica_timeout: Duration) -> (ReplicatedRedis, RedisStore) {
    let redis = ReplicatedRedis::start(1).await;
    let options = format!(
        "prefix={}&replicas=1&replica_timeout={}ms",
        fresh_prefix(),
        replica_timeout.as_millis()
    );
    let url = with_options(&redis.primary_url(), &options);
    let store = connect_url(&url).await;
    // The first write after a full sync waits for the replica's first acknowledgement.
    let (id, fp) = (fresh_id(), fingerprint("{}"));
    store
        .begin(claim(&id, &fp, UnixMillis::now(), FencingToken::random()))
        .await
        .expect("a write the replica acknowledges");
    (redis, store)
}

/// Starts `count` tasks, one every [`ARRIVAL_GAP`], each running `work(i)` and timing it.
async fn arriving<T: Send + 'static, F>(count: usize, work: impl Fn(usize) -> F) -> Vec<(Duration, T)>
where
    F: Future<Output = T> + Send + 'static,
{
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        let work = work(i);
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let out = work.await;
            (started.elapsed(), out)
        }));
        tokio::time::sleep(ARRIVAL_GAP).await;
    }
    let mut done = Vec::with_capacity(count);
    for task in tasks {
        done.push(task.await.expect("a claim's task"));
    }
    done
}

/// The slowest and the median of `times`, for the test's output.
fn slowest_and_median(times: &mut [Duration]) -> (Duration, Duration) {
    times.sort_unstable();
    (times[times.len() - 1], times[times.len() / 2])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_new_claim_is_refused_within_its_replica_timeout_naming_the_replica_and_forgotten() {
    let (mut redis, store) = stallable().await;
    let store = Arc::new(store);
    let replica = redis.replicas()[0];
    let fp = fingerprint("{}");

    // Keys whose last run's outcome is unknown: their next claim is a takeover.
    let mut unknown = Vec::new();
    for _ in 0..4 {
        let (id, token) = (fresh_id(), FencingToken::random());
        store
            .begin(claim(&id, &fp, UnixMillis::now(), token))
            .await
            .expect("claim");
        let (expires_at, purge_at) = (
            UnixMillis::now().plus(Duration::from_secs(3600)),
            UnixMillis::now().plus(Duration::from_secs(7200)),
        );
        store
            .release(&id, token, Release::Unknown { expires_at, purge_at })
            .await
            .expect("released as unknown");
        unknown.push(id);
    }

    redis.freeze(replica);
    let new_ids: Vec<_> = (0..NEW_KEYS).map(|_| fresh_id()).collect();
    let takeovers: Vec<_> = unknown.iter().map(|_| FencingToken::random()).collect();
    let refused = arriving(NEW_KEYS + unknown.len(), |i| {
        let (store, fp) = (Arc::clone(&store), fp.clone());
        let (id, token) = match new_ids.get(i) {
            Some(id) => (id.clone(), FencingToken::random()),
            None => (unknown[i - NEW_KEYS].clone(), takeovers[i - NEW_KEYS]),
        };
        async move { store.begin(claim(&id, &fp, UnixMillis::now(), token)).await }
    })
    .await;
    redis.thaw(replica);

    let mut times = Vec::new();
    let mut vague = Vec::new();
    for (i, (took, begun)) in refused.iter().enumerate() {
        match begun {
            Err(StoreError::Unavailable(err)) => {
                let message = err.to_string();
                if !(message.contains("acknowledged") && message.contains("replicas=1")) {
                    vague.push(message);
                }
            }
            other => panic!("claim {i} during the stall: {other:?}"),
        }
        times.push(*took);
    }
    let (slowest, median) = slowest_and_median(&mut times);
    eprintln!(
        "{} claims refused during the stall: median {median:?}, slowest {slowest:?}",
        refused.len()
    );
    assert!(
        vague.is_empty(),
        "{} of {} refusals do not name the replica setting: {:?}",
        vague.len(),
        refused.len(),
        &vague[..vague.len().min(3)]
    );
    assert!(
        slowest < REFUSED_WITHIN,
        "a claim was refused only after {slowest:?} (replica_timeout {REPLICA_TIMEOUT:?}): it queued behind others"
    );

    redis.wait_until_replicated(1, Duration::from_secs(10)).await;
    for (i, id) in new_ids.iter().enumerate() {
        let begun = store
            .begin(claim(id, &fp, UnixMillis::now(), FencingToken::random()))
            .await;
        assert!(
            matches!(begun, Ok(Begin::Acquired { recovered: false })),
            "new key {i}, refused during the stall, is claimed again as new: {begun:?}"
        );
    }
    for (id, token) in unknown.iter().zip(&takeovers) {
        let record = store.get(id).await.expect("get").expect("the takeover stands");
        assert!(
            matches!(record.state, RecordState::InFlight { token: held, .. } if held == *token),
            "a takeover no replica acknowledged is not forgotten: {record:?}"
        );
    }
}

/// A write whose caller gives up on it (a timeout of its own, a client gone) while it waits for
/// the stalled replica leaves no `WAIT` behind on the server: its connection is closed, not lent
/// to the next write, which would queue behind that `WAIT` for the rest of its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_its_caller_abandons_leaves_no_wait_on_the_server() {
    const LONG_TIMEOUT: Duration = Duration::from_secs(10);
    let (mut redis, store) = stallable_with(LONG_TIMEOUT).await;
    let (primary, replica) = (redis.primary(), redis.replicas()[0]);
    let fp = fingerprint("{}");
    let blocked = async |redis: &ReplicatedRedis| -> u64 {
        let info: String = redis.command(primary, redis::cmd("INFO").arg("clients")).await;
        info.lines()
            .find_map(|line| line.trim().strip_prefix("blocked_clients:"))
            .and_then(|count| count.parse().ok())
            .expect("INFO clients counts blocked_clients")
    };

    redis.freeze(replica);
    for _ in 0..3 {
        let id = fresh_id();
        let begun = tokio::time::timeout(
            Duration::from_millis(200),
            store.begin(claim(&id, &fp, UnixMillis::now(), FencingToken::random())),
        )
        .await;
        assert!(begun.is_err(), "the claim waits for the stalled replica: {begun:?}");
    }
    let deadline = Instant::now() + LONG_TIMEOUT / 4;
    let mut left = blocked(&redis).await;
    while left > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = blocked(&redis).await;
    }
    redis.thaw(replica);
    assert_eq!(
        left, 0,
        "WAITs of abandoned writes still block their connections on the server"
    );
}

/// A `POST /pay` with `key`, admitted by `protocol`, and its fingerprint.
fn keyed(protocol: &Protocol, key: &str) -> (idem_core::protocol::Keyed, Fingerprint) {
    let request = http::Request::post("/pay")
        .header("idempotency-key", format!("\"{key}\""))
        .body(())
        .expect("a request");
    let (parts, ()) = request.into_parts();
    let Admission::Keyed(keyed) = protocol.admit(&parts) else {
        panic!("a keyed POST is subject to the protocol")
    };
    let fingerprint = Fingerprint::of(&parts.method, &parts.uri, &parts.headers, b"{}");
    (keyed, fingerprint)
}

/// What the protocol decided for a request: run (recovered or not), or the outcome it answered.
#[derive(Debug, PartialEq)]
enum Decided {
    Run { recovered: bool },
    Answered(Outcome),
    PassedThrough,
}

async fn decide(protocol: &Protocol, key: &str) -> (Decided, Option<idem_core::protocol::Claim>) {
    let (keyed, fp) = keyed(protocol, key);
    match protocol.begin(keyed, &fp).await {
        Decision::Run(claim) => (
            Decided::Run {
                recovered: claim.recovered(),
            },
            Some(claim),
        ),
        Decision::Respond { outcome, .. } => (Decided::Answered(outcome), None),
        Decision::PassThrough { .. } => (Decided::PassedThrough, None),
    }
}

/// Through the protocol, as the gateway and the layer use it: during the stall each new key is
/// answered `503`, and the protocol gives its claim up (as unknown, not knowing better) while the
/// store has forgotten it; after the stall, each key's next request runs unflagged — the upstream
/// never sees `Idempotency-Recovered` for a key that never ran — and fresh keys run as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_refused_during_the_stall_runs_unflagged_after_it() {
    let (mut redis, store) = stallable().await;
    let protocol = Protocol::new(Arc::new(store), Policy::default());
    let replica = redis.replicas()[0];
    let keys: Vec<String> = (0..NEW_KEYS).map(|_| uuid::Uuid::new_v4().to_string()).collect();
    // The scope salt is read (made) by the first request, before the stall.
    let (decided, warm) = decide(&protocol, &uuid::Uuid::new_v4().to_string()).await;
    assert_eq!(decided, Decided::Run { recovered: false }, "a key before the stall");
    protocol
        .release(&warm.expect("a run"), Release::Forget)
        .await
        .expect("released");

    redis.freeze(replica);
    let during = arriving(NEW_KEYS, |i| {
        let (protocol, key) = (protocol.clone(), keys[i].clone());
        async move { decide(&protocol, &key).await.0 }
    })
    .await;
    redis.thaw(replica);
    for (i, (_, decided)) in during.iter().enumerate() {
        assert_eq!(
            *decided,
            Decided::Answered(Outcome::StoreError),
            "key {i} during the stall"
        );
    }

    redis.wait_until_replicated(1, Duration::from_secs(10)).await;
    // Past the protocol's first tries to give the refused claims up.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut flagged = 0;
    for (i, key) in keys.iter().enumerate() {
        let (decided, claim) = decide(&protocol, key).await;
        match decided {
            Decided::Run { recovered: false } => {}
            Decided::Run { recovered: true } => flagged += 1,
            other => panic!("key {i} after the stall: {other:?}"),
        }
        protocol
            .release(&claim.expect("a run"), Release::Forget)
            .await
            .expect("an acknowledged release, the replica back");
    }
    assert_eq!(
        flagged, 0,
        "of {NEW_KEYS} keys that never ran, {flagged} ran after the stall flagged Idempotency-Recovered"
    );
    for _ in 0..8 {
        let (decided, _) = decide(&protocol, &uuid::Uuid::new_v4().to_string()).await;
        assert_eq!(
            decided,
            Decided::Run { recovered: false },
            "a fresh key after the stall"
        );
    }
}

/// The logs of the process, kept for counting.
#[derive(Clone, Default)]
struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("logs").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The shape, measured (not a check: run by hand with `--ignored --nocapture`): new keys
/// at `RATE` a second (40) for `STALL_SECS` (4) of replica stall, a second before and after;
/// prints the refusals, how long they took, what their log lines say, and how many refused keys
/// ran flagged `Idempotency-Recovered` after the stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: cargo test -p idem-redis --test replica_stall -- --ignored --nocapture"]
async fn measure_a_stall() {
    let number = |name: &str, default: u64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let (stall, rate) = (Duration::from_secs(number("STALL_SECS", 4)), number("RATE", 40));
    let logs = Logs::default();
    let writer = logs.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish(),
    )
    .expect("the only subscriber");
    let (mut redis, store) = stallable().await;
    let protocol = Protocol::new(Arc::new(store), Policy::default());
    let replica = redis.replicas()[0];
    let (decided, warm) = decide(&protocol, &uuid::Uuid::new_v4().to_string()).await;
    assert_eq!(decided, Decided::Run { recovered: false });
    protocol
        .release(&warm.expect("a run"), Release::Forget)
        .await
        .expect("released");

    let total = usize::try_from(rate * (stall.as_secs() + 2)).expect("a count");
    let gap = Duration::from_secs(1) / u32::try_from(rate).expect("a rate");
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(total);
    let (mut frozen, mut thawed) = (false, false);
    for _ in 0..total {
        let since = started.elapsed();
        if !frozen && since >= Duration::from_secs(1) {
            redis.freeze(replica);
            frozen = true;
        }
        if !thawed && since >= Duration::from_secs(1) + stall {
            redis.thaw(replica);
            thawed = true;
        }
        let (protocol, key) = (protocol.clone(), uuid::Uuid::new_v4().to_string());
        tasks.push(tokio::spawn(async move {
            let at = Instant::now();
            let (decided, claim) = decide(&protocol, &key).await;
            let took = at.elapsed();
            if let Some(claim) = claim {
                let _ = protocol.release(&claim, Release::Forget).await;
            }
            (key, decided, took)
        }));
        tokio::time::sleep(gap).await;
    }
    if !thawed {
        redis.thaw(replica);
    }
    let mut refused = Vec::new();
    let mut times = Vec::new();
    for task in tasks {
        let (key, decided, took) = task.await.expect("a request");
        if decided == Decided::Answered(Outcome::StoreError) {
            refused.push(key);
            times.push(took);
        }
    }
    redis.wait_until_replicated(1, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut flagged = 0;
    for key in &refused {
        if let (Decided::Run { recovered: true }, _) = decide(&protocol, key).await {
            flagged += 1;
        }
    }
    let text = String::from_utf8_lossy(&logs.0.lock().expect("logs")).into_owned();
    let failures: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("idempotency store failed"))
        .collect();
    let naming = failures.iter().filter(|line| line.contains("replicas=")).count();
    let timed_out = failures.iter().filter(|line| line.contains("timed out")).count();
    times.sort_unstable();
    let at = |q: f64| {
        times
            .get(((times.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or_default()
    };
    println!(
        "{total} new keys at {rate}/s, replica stopped {stall:?}: {} answered 503 (p50 {:?}, p90 {:?}, max {:?}); \
         {} log lines, {naming} name the replica setting, {timed_out} say timed out; \
         {flagged} of {} refused keys ran flagged Idempotency-Recovered after the stall",
        refused.len(),
        at(0.5),
        at(0.9),
        at(1.0),
        failures.len(),
        refused.len()
    );
}
