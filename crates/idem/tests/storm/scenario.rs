//! The scenario every storm runs, written once: two gateways on one store, 16 clients paying 320
//! payments through them while faults strike, then every key sent once more and the verdict.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use http::Extensions;
use idem_client::reqwest_middleware::{self, ClientBuilder, ClientWithMiddleware, Middleware, Next};
use idem_client::{ErrorExt, IdempotencyMiddleware, ResponseExt, RetryBudget};
use idem_test_support::seed::{Rng, Seed};
use tokio::time::Instant;

use crate::common::{self, Gateway, Upstream, now_millis, uuid_v7_at};

/// Clients paying at once, and payments each: 320 payments.
const CLIENTS: usize = 16;
const PAYMENTS_PER_CLIENT: usize = 20;
/// One payment in this many is sent twice at once, once to each instance.
const TWIN_EVERY: usize = 4;
/// The fewest faults a storm of point faults must land.
pub(crate) const MIN_FAULTS: usize = 100;
/// The gateways' settings. The lease outlasts, with renewals to spare, the longest a storm keeps an
/// instance from its store (up to ~8 s seen on Redis, whose one multiplexed connection every reset
/// breaks; a lock held 7.5 s on SQLite): a held answer is stored, never taken over. (An instance
/// cut off for longer than its lease while the other one is not *would* lose its held answer to a
/// takeover: that is what a lease is.) It is short, though, because a claim whose `begin` reply
/// was lost has no holder and waits for it to run out. A copy waits 3 s for the run in flight
/// before `409`.
const GATEWAY_ARGS: &[&str] = &["--lease", "15s", "--wait", "3s"];
/// The longest a payment may take, every attempt and re-send included.
const PAYMENT_LIMIT: Duration = Duration::from_secs(75);
/// A directory to keep the gateways' logs in (they are deleted with the test otherwise).
const LOGS_VAR: &str = "IDEM_STORM_LOGS";
/// How long an instance may take to be ready again once the faults stop. The storms and the
/// replicated failovers share this binary and run side by side on two cores: a cluster's
/// reconnection then took more than 15 s under load; what is checked is that it comes back.
const READY_WITHIN: Duration = Duration::from_secs(45);

// ---------------------------------------------------------------------------------------------
// The scenario, written once
// ---------------------------------------------------------------------------------------------

/// Two gateways on `store`, the payments spread over `duration` while `storm` injects faults (it
/// returns how many struck, at least `min_faults`, and a description), then the checks and the
/// figures.
pub(crate) async fn scenario<S, F>(name: &str, store: &str, duration: Duration, min_faults: usize, storm: S)
where
    S: FnOnce(Rng) -> F,
    F: Future<Output = (usize, String)>,
{
    let seed = Seed::for_this_run();
    let mut rng = seed.rng(name);
    let upstream = Upstream::start().await;
    let gateways = [
        Gateway::start_on_store(&upstream.url(), store, GATEWAY_ARGS).await,
        Gateway::start_on_store(&upstream.url(), store, GATEWAY_ARGS).await,
    ];
    let plan = plan_payments(&mut rng, duration);
    let observer = Observer::default();
    let started = Instant::now();
    let storm_rng = Rng::new(rng.next_u64());
    let ((faults, fault_text), paid) = tokio::join!(storm(storm_rng), pay_all(&gateways, &plan, &observer));
    let payments_done = started.elapsed();

    // The faults have stopped: both instances are up and ready.
    for gateway in &gateways {
        wait_ready(gateway).await;
    }
    // Every key once more, from the instance its payment did not go to: the stored answer.
    let verify_client = client(observer.clone());
    let mut verified = Vec::with_capacity(plan.len());
    for payment in &plan {
        let other = &gateways[1 - payment.gateway];
        verified.push(pay(&verify_client, other, payment).await);
    }
    let elapsed = started.elapsed();

    let report = Report::new(&plan, &paid, &verified, &upstream);
    eprintln!(
        "storm {name}: {} payments ({} sent twice at once) in {:.1} s ({:.1} s until the last was paid), seed {} ({}={})\n  \
         faults: {fault_text}\n  \
         attempts: {}\n  \
         upstream runs: {}; flagged recovered: {} ({} re-runs of a key that had run, {:.1} % of keys; {} first runs flagged, the key had not run); \
         silent duplicates: {}",
        plan.len(),
        plan.iter().filter(|p| p.twin.is_some()).count(),
        elapsed.as_secs_f64(),
        payments_done.as_secs_f64(),
        seed.0,
        idem_test_support::seed::SEED_VAR,
        seed.0,
        observer.summary(),
        report.runs,
        report.flagged_reruns + report.flagged_first,
        report.flagged_reruns,
        100.0 * report.keys_rerun as f64 / plan.len() as f64,
        report.flagged_first,
        report.silent_duplicates,
    );
    if report.flagged_first > 0 {
        eprintln!(
            "  first runs flagged: a `begin` whose reply was lost (a reset after the store executed it, \
             a client-side timeout in a black hole) leaves a claim nobody holds; a retry takes it over \
             when its lease runs out, flagged as the claim's fate is unknown to idem"
        );
    }
    if report.keys_rerun * 100 > plan.len() {
        eprintln!(
            "  more than 1 % of keys ran twice: look for `taken over` and `held answer` in the gateways' logs \
             ({LOGS_VAR}=DIR keeps them)"
        );
    }
    if !report.flagged_keys.is_empty() {
        eprintln!(
            "  flagged keys (grep the gateways' logs for them): {:?}",
            &report.flagged_keys[..report.flagged_keys.len().min(5)]
        );
    }

    if let Ok(dir) = std::env::var(LOGS_VAR) {
        for (i, gateway) in gateways.iter().enumerate() {
            let file = Path::new(&dir).join(format!("storm-{name}-{i}.log"));
            std::fs::write(&file, gateway.stderr()).expect("write a gateway's log");
            eprintln!("  instance {i}'s log: {}", file.display());
        }
    }

    let replay = format!("replay with {}={}", idem_test_support::seed::SEED_VAR, seed.0);
    assert!(
        faults >= min_faults,
        "only {faults} faults struck ({fault_text}); {replay}"
    );
    assert!(
        report.failures.is_empty(),
        "{name}: {} payments did not end 2xx ({replay}): {:#?}",
        report.failures.len(),
        &report.failures[..report.failures.len().min(10)]
    );
    assert!(
        report.duplicated.is_empty(),
        "{name}: keys ran more than once without Idempotency-Recovered: true ({replay}): {:#?}",
        report.duplicated
    );
    assert!(
        report.two_bodies.is_empty(),
        "{name}: keys answered 2xx with different bodies ({replay}): {:#?}",
        &report.two_bodies[..report.two_bodies.len().min(10)]
    );
    let unexpected = observer.unexpected();
    assert!(
        unexpected.is_empty(),
        "{name}: answers other than 2xx, 409 key-in-flight, 502, 503, 504 ({replay}): {:#?}",
        &unexpected[..unexpected.len().min(10)]
    );
}

/// Polls `/readyz` until it answers 200.
async fn wait_ready(gateway: &Gateway) {
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        let ready = gateway
            .client
            .get(format!("{}/readyz", gateway.admin))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        match ready {
            Ok(response) if response.status() == 200 => return,
            other => assert!(
                Instant::now() < deadline,
                "instance {} is not ready {READY_WITHIN:?} after the faults stopped: {other:?}",
                gateway.base
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The payments
// ---------------------------------------------------------------------------------------------

/// One payment: its key and body, which instance it goes to, when, and whether (and how much
/// later) a twin with the same key goes to the other instance.
#[derive(Debug, Clone)]
struct Payment {
    client: usize,
    at: Duration,
    key: String,
    path: String,
    body: String,
    gateway: usize,
    twin: Option<Duration>,
}

/// The payments of every client, spread evenly over `duration` with jitter.
fn plan_payments(rng: &mut Rng, duration: Duration) -> Vec<Payment> {
    let slot = duration / u32::try_from(PAYMENTS_PER_CLIENT).expect("a few");
    let mut plan = Vec::with_capacity(CLIENTS * PAYMENTS_PER_CLIENT);
    for client in 0..CLIENTS {
        for j in 0..PAYMENTS_PER_CLIENT {
            let n = plan.len();
            plan.push(Payment {
                client,
                at: slot * u32::try_from(j).expect("a few") + rng.between(Duration::ZERO, slot),
                key: uuid_v7_at(now_millis()),
                // The upstream takes a moment, so runs overlap the faults.
                path: format!("/pay?delay={}", rng.below(80)),
                body: format!(
                    r#"{{"payment":{n},"amount":{},"currency":"EUR"}}"#,
                    100 + rng.below(10_000)
                ),
                gateway: (client + j) % 2,
                twin: (n % TWIN_EVERY == 0).then(|| rng.between(Duration::ZERO, Duration::from_millis(50))),
            });
        }
    }
    plan
}

/// How one send of a payment ended.
#[derive(Debug, Clone)]
struct Paid {
    status: u16,
    body: Bytes,
    replayed: bool,
}

/// How a payment ended, and its twin if it had one (`Err`: why it did not end 2xx).
type Sent = (Result<Paid, String>, Option<Result<Paid, String>>);

/// Each client pays its payments on schedule (its twins beside it); returns, per payment, how the
/// payment and its twin ended.
async fn pay_all(gateways: &[Gateway; 2], plan: &[Payment], observer: &Observer) -> Vec<Sent> {
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS).map(|_| client(observer.clone())).collect();
    let sends = plan.iter().map(|payment| {
        let client = &clients[payment.client];
        async move {
            tokio::time::sleep_until(started + payment.at).await;
            let twin = async {
                match payment.twin {
                    Some(after) => {
                        tokio::time::sleep(after).await;
                        Some(pay(client, &gateways[1 - payment.gateway], payment).await)
                    }
                    None => None,
                }
            };
            tokio::join!(pay(client, &gateways[payment.gateway], payment), twin)
        }
    });
    // A client's payments follow its schedule; each runs to its end, however long it takes.
    futures_util::future::join_all(sends).await
}

/// A client as applications build one: `idem-client`'s middleware (backoff with jitter from 50 ms
/// to 1 s, `Retry-After` honoured, a 45 s deadline). Its retry budget, there to spare a failing
/// server a retry storm, is unlimited: here the faults are on purpose and every payment is meant
/// to get through (as in `idem demo`).
fn client(observer: Observer) -> ClientWithMiddleware {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(15))
        .build()
        .expect("an HTTP client");
    let retries = IdempotencyMiddleware::new()
        .with_max_retries(30)
        .with_base_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(1))
        .with_deadline(Duration::from_secs(45))
        .with_budget(RetryBudget::unlimited());
    ClientBuilder::new(http).with(retries).with(observer).build()
}

/// Sends a payment until it ends 2xx, as an application would: the middleware retries; if it
/// stops on something worth a retry (its deadline), the payment is sent again with the same key.
async fn pay(client: &ClientWithMiddleware, gateway: &Gateway, payment: &Payment) -> Result<Paid, String> {
    let give_up = Instant::now() + PAYMENT_LIMIT;
    loop {
        let sent = client
            .post(gateway.url(&payment.path))
            .header("content-type", "application/json")
            .header("idempotency-key", payment.key.as_str())
            .body(payment.body.clone())
            .send()
            .await;
        let why = match sent {
            Ok(response) => {
                let status = response.status().as_u16();
                let report = response.retry_report().cloned();
                let body = response.bytes().await;
                match body {
                    Ok(body) if (200..300).contains(&status) => {
                        return Ok(Paid {
                            status,
                            body,
                            replayed: report.is_some_and(|r| r.replayed),
                        });
                    }
                    Ok(body) if report.as_ref().is_some_and(|r| r.stopped.is_some()) => {
                        format!("{status} {} ({report:?})", String::from_utf8_lossy(&body))
                    }
                    Ok(body) => {
                        return Err(format!(
                            "key {}: final answer {status} from {}: {}",
                            payment.key,
                            gateway.base,
                            String::from_utf8_lossy(&body)
                        ));
                    }
                    Err(err) => format!("{status} whose body broke off: {err}"),
                }
            }
            Err(err) => format!("{err} ({:?})", err.retry_error().and_then(|e| e.report())),
        };
        if Instant::now() >= give_up {
            return Err(format!(
                "key {}: no 2xx within {PAYMENT_LIMIT:?}; last: {why}",
                payment.key
            ));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// What the clients saw, attempt by attempt
// ---------------------------------------------------------------------------------------------

/// A middleware inside `idem-client`'s (so it sees every attempt): counts the answers by status
/// and problem type, and keeps those a client should never see.
#[derive(Debug, Clone, Default)]
struct Observer {
    seen: Arc<Mutex<Seen>>,
}

#[derive(Debug, Default)]
struct Seen {
    by_kind: BTreeMap<String, usize>,
    unexpected: Vec<String>,
}

impl Observer {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn summary(&self) -> String {
        let seen = self.seen();
        let total: usize = seen.by_kind.values().sum();
        let kinds: Vec<String> = seen.by_kind.iter().map(|(kind, n)| format!("{kind}: {n}")).collect();
        format!("{total} ({})", kinds.join(", "))
    }

    fn unexpected(&self) -> Vec<String> {
        self.seen().unexpected.clone()
    }
}

#[async_trait::async_trait]
impl Middleware for Observer {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let key = request
            .headers()
            .get("idempotency-key")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default();
        let response = match next.run(request, extensions).await {
            Ok(response) => response,
            Err(err) => {
                *self.seen().by_kind.entry("no answer".to_owned()).or_default() += 1;
                return Err(err);
            }
        };
        let status = response.status();
        if status.is_success() {
            *self.seen().by_kind.entry(status.as_u16().to_string()).or_default() += 1;
            return Ok(response);
        }
        // Read the problem, then hand on an answer with the same head and body.
        let (parts, body) = http::Response::<reqwest::Body>::from(response).into_parts();
        let body = match http_body_util::BodyExt::collect(body).await {
            Ok(collected) => collected.to_bytes(),
            Err(err) => {
                *self
                    .seen()
                    .by_kind
                    .entry(format!("{} broken off", status.as_u16()))
                    .or_default() += 1;
                return Err(reqwest_middleware::Error::Reqwest(err));
            }
        };
        let text = String::from_utf8_lossy(&body).into_owned();
        let problem = common::json_field(&text, "type")
            .and_then(|t| t.rsplit(':').next().map(str::to_owned))
            .unwrap_or_default();
        let kind = format!("{} {problem}", status.as_u16()).trim().to_owned();
        let expected = matches!(status.as_u16(), 502..=504) || (status.as_u16() == 409 && problem == "key-in-flight");
        {
            let mut seen = self.seen();
            *seen.by_kind.entry(kind).or_default() += 1;
            if !expected {
                seen.unexpected.push(format!("key {key}: {status} {text}"));
            }
        }
        Ok(reqwest::Response::from(http::Response::from_parts(
            parts,
            reqwest::Body::from(body),
        )))
    }
}

// ---------------------------------------------------------------------------------------------
// The verdict
// ---------------------------------------------------------------------------------------------

/// What the upstream and the clients saw, per key.
#[derive(Debug, Default)]
struct Report {
    /// Upstream executions.
    runs: usize,
    /// Runs marked `Idempotency-Recovered: true` after an earlier run of their key.
    flagged_reruns: usize,
    /// Runs marked recovered that were their key's first (a claim orphaned without a run).
    flagged_first: usize,
    /// Keys that ran more than once (each re-run flagged, or it is in `duplicated`).
    keys_rerun: usize,
    /// Runs beyond the first that were not marked recovered: must be 0.
    silent_duplicates: usize,
    flagged_keys: Vec<String>,
    duplicated: Vec<String>,
    two_bodies: Vec<String>,
    failures: Vec<String>,
}

impl Report {
    fn new(plan: &[Payment], paid: &[Sent], verified: &[Result<Paid, String>], upstream: &Upstream) -> Self {
        let mut report = Self::default();
        let mut runs: HashMap<String, Vec<bool>> = HashMap::new();
        for seen in upstream.state.seen("pay") {
            let key = seen.key.unwrap_or_default();
            runs.entry(key)
                .or_default()
                .push(seen.recovered.as_deref() == Some("true"));
        }
        report.runs = runs.values().map(Vec::len).sum();
        let planned: HashMap<&str, &Payment> = plan.iter().map(|p| (p.key.as_str(), p)).collect();
        for (key, flags) in &runs {
            assert!(
                planned.contains_key(key.as_str()),
                "the upstream ran a key no client sent: {key:?}"
            );
            let unflagged = flags.iter().filter(|&&flagged| !flagged).count();
            report.silent_duplicates += unflagged.saturating_sub(1);
            if unflagged > 1 {
                report
                    .duplicated
                    .push(format!("{key}: {} runs, {unflagged} without the flag", flags.len()));
            }
            if flags[0] {
                report.flagged_first += 1;
            }
            report.flagged_reruns += flags[1..].iter().filter(|&&flagged| flagged).count();
            if flags.len() > 1 {
                report.keys_rerun += 1;
            }
            if flags.iter().any(|&flagged| flagged) {
                report.flagged_keys.push(key.clone());
            }
        }
        for ((payment, (first, twin)), again) in plan.iter().zip(paid).zip(verified) {
            let mut bodies: Vec<(&str, &Paid)> = Vec::new();
            for (what, outcome) in [
                ("payment", Some(first)),
                ("twin", twin.as_ref()),
                ("replay afterwards", Some(again)),
            ] {
                match outcome {
                    Some(Ok(paid)) => bodies.push((what, paid)),
                    Some(Err(err)) => report.failures.push(format!("{what}: {err}")),
                    None => {}
                }
            }
            if let Ok(again) = again
                && !again.replayed
            {
                report.failures.push(format!(
                    "key {}: the replay afterwards ran instead of replaying ({} {})",
                    payment.key,
                    again.status,
                    String::from_utf8_lossy(&again.body)
                ));
            }
            if bodies.windows(2).any(|pair| pair[0].1.body != pair[1].1.body) {
                let described: Vec<String> = bodies
                    .iter()
                    .map(|(what, paid)| format!("{what}: {} {}", paid.status, String::from_utf8_lossy(&paid.body)))
                    .collect();
                report
                    .two_bodies
                    .push(format!("key {}: {}", payment.key, described.join(" | ")));
            }
            if !runs.contains_key(&payment.key) && !bodies.is_empty() {
                report.failures.push(format!(
                    "key {}: answered 2xx, but the upstream never ran it",
                    payment.key
                ));
            }
        }
        report
    }
}
