//! The load of the contention storm: steady new keys and payments, open loop (sent on schedule
//! whatever the answers, so a stall shows as latency and errors, not as fewer requests), through
//! two gateways. One payment in ten is slow: its run holds its transaction for a while, and 10–20
//! copies of it follow it to both gateways. The baseline sends the same traffic with every hold at
//! zero, so the storm's figures are read against the same run's.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use idem_test_support::seed::Rng;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::common::ledger::HOLD_HEADER;

/// The numbers of one run.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// `short` or `long`.
    pub(crate) name: &'static str,
    /// How long the storm sends; the baseline sends half as long before it and half after.
    pub(crate) phase: Duration,
    /// New keys per second besides the payments.
    pub(crate) steady_rate: f64,
    /// Payments per second; one in [`Plan::slow_every`] is slow.
    pub(crate) payment_rate: f64,
    /// One payment in this many is slow.
    pub(crate) slow_every: usize,
    /// How long a slow payment's run holds its transaction.
    pub(crate) hold: (Duration, Duration),
    /// How many copies of a slow payment follow it.
    pub(crate) copies: (u64, u64),
    /// When the copies follow it.
    pub(crate) copies_after: (Duration, Duration),
    /// The gateways' settings (the store's own are in its URL).
    pub(crate) gateway_args: &'static [&'static str],
    /// The gateways' PostgreSQL pool (`pool_size=`).
    pub(crate) pool_size: usize,
    /// Transactions the upstream may hold open at once.
    pub(crate) upstream_connections: usize,
}

/// The variable that picks the long plan (`IDEM_CONTENTION=long`, what `bench/contention.sh` sets).
pub(crate) const SIZE_VAR: &str = "IDEM_CONTENTION";

impl Plan {
    /// What `bash .ci/test` runs: a few slow transactions of 3–6 s, held past the 4 s lease.
    pub(crate) fn short() -> Self {
        Self {
            name: "short",
            phase: Duration::from_secs(8),
            steady_rate: 20.0,
            payment_rate: 10.0,
            slow_every: 10,
            hold: (Duration::from_secs(3), Duration::from_secs(6)),
            copies: (10, 20),
            copies_after: (Duration::from_millis(200), Duration::from_millis(1500)),
            gateway_args: &["--lease", "4s", "--wait", "10s"],
            pool_size: 8,
            upstream_connections: 24,
        }
    }

    /// The benchmark's: the design's figures, slow transactions of 3–15 s, some past the wait
    /// (the short plan's rates of payments, slow ones and copies).
    pub(crate) fn long() -> Self {
        Self {
            name: "long",
            phase: Duration::from_secs(60),
            steady_rate: 40.0,
            hold: (Duration::from_secs(3), Duration::from_secs(15)),
            copies_after: (Duration::from_millis(200), Duration::from_millis(2000)),
            gateway_args: &["--lease", "5s", "--wait", "10s"],
            pool_size: 16,
            upstream_connections: 32,
            ..Self::short()
        }
    }

    /// The long plan when `IDEM_CONTENTION=long`, the short one otherwise.
    pub(crate) fn from_env() -> Self {
        match std::env::var(SIZE_VAR).as_deref() {
            Ok("long") => Self::long(),
            Ok("short" | "") | Err(_) => Self::short(),
            Ok(other) => panic!("{SIZE_VAR}={other:?}: say `short` or `long`"),
        }
    }
}

/// Baseline (every hold zero) or storm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The same traffic without slow transactions.
    Baseline,
    /// One payment in ten holds its transaction.
    Storm,
}

impl Phase {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Storm => "storm",
        }
    }
}

/// One answer (or its absence) as a client saw it.
#[derive(Debug, Clone)]
pub(crate) struct Sent {
    /// When it was sent.
    pub(crate) sent_at: Instant,
    /// From sending to the whole answer read.
    pub(crate) latency: Duration,
    /// The status; 0 when no answer came.
    pub(crate) status: u16,
    /// The problem's name (`store-unavailable`, …) of a problem answer.
    pub(crate) problem: Option<String>,
    /// Marked `Idempotency-Replayed: true`.
    pub(crate) replayed: bool,
    /// The body; the error when no answer came.
    pub(crate) body: Bytes,
}

impl Sent {
    /// `201`, `503 store-unavailable`, `no answer`: how the figures name an outcome.
    pub(crate) fn outcome(&self) -> String {
        match (self.status, &self.problem) {
            (0, _) => "no answer".to_owned(),
            (status, Some(problem)) => format!("{status} {problem}"),
            (status, None) => status.to_string(),
        }
    }
}

/// A slow payment and its copies.
#[derive(Debug, Clone)]
pub(crate) struct SlowKey {
    pub(crate) key: String,
    /// How long its run held its transaction (zero in the baseline).
    pub(crate) hold: Duration,
    /// The first request, then the copies.
    pub(crate) answers: Vec<Sent>,
}

/// What one phase sent and got.
#[derive(Debug)]
pub(crate) struct PhaseResult {
    pub(crate) phase: Phase,
    /// Every key that is not slow: its one request.
    pub(crate) unrelated: Vec<(String, Sent)>,
    pub(crate) slow: Vec<SlowKey>,
    /// When the phase started.
    pub(crate) started: Instant,
    /// From the first request sent to the last.
    pub(crate) sending: Duration,
}

impl PhaseResult {
    /// This phase and `later`, of the same kind, as one.
    pub(crate) fn and(mut self, later: Self) -> Self {
        self.unrelated.extend(later.unrelated);
        self.slow.extend(later.slow);
        self.sending += later.sending;
        self
    }
}

/// The two gateways' base URLs and a client for them.
#[derive(Clone)]
pub(crate) struct Target {
    pub(crate) gateways: [String; 2],
    client: reqwest::Client,
}

impl Target {
    pub(crate) fn new(gateways: [String; 2]) -> Self {
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("a reqwest client");
        Self { gateways, client }
    }

    /// `POST /pay` with `key` to gateway `which`, asking the upstream to hold `hold`.
    pub(crate) async fn pay(&self, which: usize, key: &str, hold: Duration) -> Sent {
        let started = Instant::now();
        let sent = self
            .client
            .post(format!("{}/pay", self.gateways[which % 2]))
            .header("idempotency-key", format!("\"{key}\""))
            .header("content-type", "application/json")
            .header(HOLD_HEADER, hold.as_millis().to_string())
            .body(r#"{"amount":1250,"currency":"EUR"}"#)
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(err) => return no_answer(started, &err),
        };
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get("idempotency-replayed")
            .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"));
        let problem_json = response
            .headers()
            .get("content-type")
            .is_some_and(|value| value.as_bytes().starts_with(b"application/problem+json"));
        let body = match response.bytes().await {
            Ok(body) => body,
            Err(err) => return no_answer(started, &err),
        };
        let problem = problem_json
            .then(|| serde_json::from_slice::<serde_json::Value>(&body).ok())
            .flatten()
            .and_then(|value| value.get("type")?.as_str().map(str::to_owned))
            .map(|kind| kind.rsplit([':', '/']).next().unwrap_or_default().to_owned());
        Sent {
            sent_at: started,
            latency: started.elapsed(),
            status,
            problem,
            replayed,
            body,
        }
    }
}

fn no_answer(started: Instant, err: &reqwest::Error) -> Sent {
    Sent {
        sent_at: started,
        latency: started.elapsed(),
        status: 0,
        problem: None,
        replayed: false,
        body: Bytes::from(format!("{err:?}")),
    }
}

/// What the scheduler drew for one slow payment, before its task starts.
struct SlowDraw {
    key: String,
    first: usize,
    hold: Duration,
    copies: u64,
    after: Duration,
}

/// Runs one phase of `plan` on `target` for `length`: keys named `{run}-{label}-…`. Returns when
/// every answer came (a slow run's copies included).
pub(crate) async fn run_phase(
    plan: &Plan,
    target: &Target,
    (run, label): (&str, &str),
    phase: Phase,
    length: Duration,
    rng: &mut Rng,
) -> PhaseResult {
    let started = Instant::now();
    let end = started + length;
    let unrelated: Arc<std::sync::Mutex<Vec<(String, Sent)>>> = Arc::default();
    let mut slow_tasks: JoinSet<SlowKey> = JoinSet::new();
    let mut fast_tasks: JoinSet<()> = JoinSet::new();
    let steady_every = Duration::from_secs_f64(1.0 / plan.steady_rate);
    let payment_every = Duration::from_secs_f64(1.0 / plan.payment_rate);
    let (mut next_steady, mut next_payment) = (started, started + payment_every / 2);
    let (mut steady, mut payments) = (0usize, 0usize);
    loop {
        let now = Instant::now();
        if next_steady.min(next_payment) >= end {
            break;
        }
        if next_steady <= now {
            let key = format!("{run}-{label}-new-{steady}");
            spawn_fast(&mut fast_tasks, target, &unrelated, key, steady);
            steady += 1;
            next_steady += steady_every;
            continue;
        }
        if next_payment <= now {
            let key = format!("{run}-{label}-pay-{payments}");
            if payments % plan.slow_every == plan.slow_every / 2 {
                let draw = SlowDraw {
                    key,
                    first: payments,
                    hold: match phase {
                        Phase::Baseline => Duration::ZERO,
                        Phase::Storm => rng.between(plan.hold.0, plan.hold.1),
                    },
                    copies: plan.copies.0 + rng.below(plan.copies.1 - plan.copies.0 + 1),
                    after: rng.between(plan.copies_after.0, plan.copies_after.1),
                };
                slow_tasks.spawn(slow_payment(target.clone(), draw));
            } else {
                spawn_fast(&mut fast_tasks, target, &unrelated, key, payments);
            }
            payments += 1;
            next_payment += payment_every;
            continue;
        }
        tokio::time::sleep_until(next_steady.min(next_payment)).await;
    }
    let sending = started.elapsed();
    while let Some(done) = fast_tasks.join_next().await {
        done.expect("a request's task");
    }
    let mut slow = Vec::new();
    while let Some(done) = slow_tasks.join_next().await {
        slow.push(done.expect("a slow payment's task"));
    }
    slow.sort_by(|a, b| a.key.cmp(&b.key));
    let unrelated = std::mem::take(&mut *unrelated.lock().expect("the answers"));
    PhaseResult {
        phase,
        unrelated,
        slow,
        started,
        sending,
    }
}

fn spawn_fast(
    tasks: &mut JoinSet<()>,
    target: &Target,
    answers: &Arc<std::sync::Mutex<Vec<(String, Sent)>>>,
    key: String,
    n: usize,
) {
    let (target, answers) = (target.clone(), answers.clone());
    tasks.spawn(async move {
        let sent = target.pay(n, &key, Duration::ZERO).await;
        answers.lock().expect("the answers").push((key, sent));
    });
}

/// The first request to one gateway, then, a moment later, the copies all at once, alternating
/// between the gateways (the first copy to the other one).
async fn slow_payment(target: Target, draw: SlowDraw) -> SlowKey {
    let first = {
        let (target, key) = (target.clone(), draw.key.clone());
        tokio::spawn(async move { target.pay(draw.first, &key, draw.hold).await })
    };
    tokio::time::sleep(draw.after).await;
    let copies: Vec<_> = (0..draw.copies)
        .map(|i| {
            let (target, key) = (target.clone(), draw.key.clone());
            let which = draw.first + 1 + usize::try_from(i).unwrap_or(0);
            tokio::spawn(async move { target.pay(which, &key, draw.hold).await })
        })
        .collect();
    let mut answers = vec![first.await.expect("the first request")];
    for copy in copies {
        answers.push(copy.await.expect("a copy"));
    }
    SlowKey {
        key: draw.key,
        hold: draw.hold,
        answers,
    }
}
