//! `idem demo`: why idempotency keys need one shared store. In this process: a payments service
//! that records every charge, gateway instances behind a round-robin balancer that drops answers
//! and resets connections, and clients that retry with `idem-client`; one instance is killed
//! partway and restarted. The same traffic runs in three set-ups, counted in one table; on a
//! PostgreSQL store a fourth, whose payments service commits each charge with its answer.

mod clients;
mod instance;
mod network;
mod payments;
mod report;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use idem_core::Policy;

use crate::cli::DemoArgs;
use instance::{Instance, InstanceConfig, Protection};
use network::{Balancer, Faults};
use payments::Payments;
use report::{Report, Row};

/// The gateways' lease: short, so that the keys of the crashed instance are taken over quickly.
const LEASE: Duration = Duration::from_secs(2);
/// How long the demo's answers (then their tombstones) are kept: well beyond a client's deadline.
const RETENTION: Duration = Duration::from_secs(600);
/// How long a gateway waits for the upstream before answering `504` (and keeps waiting).
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest the crashed instance stays down (it is back when two thirds of the payments are
/// done, or after this long if that takes longer: with one instance nothing is done while it is down).
const MAX_DOWN: Duration = Duration::from_secs(1);

/// The three set-ups, in the order of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SetUp {
    /// The balancer in front of plain proxies.
    NoIdempotency,
    /// Each instance with a SQLite file of its own: the in-memory map with several instances.
    StorePerInstance,
    /// Every instance on the one store.
    SharedStore,
    /// Every instance on the one PostgreSQL store, and the payments service commits each charge
    /// with its answer (`idem_complete`) in the store's database.
    InTransaction,
}

impl SetUp {
    /// The set-ups a run shows: the fourth needs the shared store to be PostgreSQL, in whose
    /// database the payments service keeps its charges.
    fn for_store(store: &str) -> Vec<SetUp> {
        let mut set_ups = vec![Self::NoIdempotency, Self::StorePerInstance, Self::SharedStore];
        if crate::config::completes_with_sql(store) {
            set_ups.push(Self::InTransaction);
        }
        set_ups
    }

    /// The name in the JSON output.
    fn id(self) -> &'static str {
        match self {
            Self::NoIdempotency => "no-idempotency",
            Self::StorePerInstance => "store-per-instance",
            Self::SharedStore => "shared-store",
            Self::InTransaction => "in-transaction",
        }
    }

    /// The name in the table.
    fn title(self) -> &'static str {
        match self {
            Self::NoIdempotency => "no idempotency",
            Self::StorePerInstance => "a store per instance",
            Self::SharedStore => "one shared store",
            Self::InTransaction => "shared, charge and answer in one transaction",
        }
    }
}

/// One run's settings.
#[derive(Debug)]
struct Plan {
    instances: usize,
    payments: u64,
    clients: u16,
    faults: Faults,
    /// The shared store's URL.
    store: String,
    /// Where the per-instance (and default shared) SQLite files go.
    dir: tempfile::TempDir,
}

impl Plan {
    /// The instance that is killed.
    fn victim(&self) -> usize {
        self.instances / 2
    }
}

pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("idem-demo-")
        .tempdir()
        .context("cannot create a temporary directory")?;
    let default_store = args.store.is_none();
    let store = match args.store {
        Some(url) => url,
        None => format!("sqlite://{}", dir.path().join("shared.db").display()),
    };
    let plan = Plan {
        instances: usize::from(args.instances),
        payments: args.payments,
        clients: args.clients,
        faults: Faults {
            seed: args.seed.unwrap_or_else(random_seed),
            drop_rate: args.drop_rate,
            reset_rate: args.reset_rate,
        },
        store,
        dir,
    };
    let started = Instant::now();
    let mut rows = Vec::new();
    let set_ups = SetUp::for_store(&plan.store);
    for (n, &set_up) in set_ups.iter().enumerate() {
        eprintln!("idem demo: set-up {} of {}, {} …", n + 1, set_ups.len(), set_up.title());
        let row = run_set_up(&plan, set_up)
            .await
            .with_context(|| format!("the set-up {:?} failed", set_up.title()))?;
        eprintln!("idem demo: {} done in {:.1} s", set_up.title(), row.seconds);
        rows.push(row);
    }
    let report = Report {
        seed: plan.faults.seed,
        instances: plan.instances,
        payments: plan.payments,
        clients: plan.clients,
        drop_rate: plan.faults.drop_rate,
        reset_rate: plan.faults.reset_rate,
        store: idem_core::redact_url(&plan.store),
        seconds: started.elapsed().as_secs_f64(),
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let temporary = default_store.then_some("a temporary SQLite file (--store URL for another)");
        print!("{}", report.table(plan.victim() + 1, temporary));
    }
    Ok(())
}

/// Runs the traffic once through `set_up`.
async fn run_set_up(plan: &Plan, set_up: SetUp) -> anyhow::Result<Row> {
    let started = Instant::now();
    let payments = Payments::start((set_up == SetUp::InTransaction).then_some(plan.store.as_str())).await?;
    let config = |index: usize| InstanceConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        upstream: payments.uri(),
        upstream_timeout: UPSTREAM_TIMEOUT,
        protection: match set_up {
            SetUp::NoIdempotency => Protection::None,
            SetUp::StorePerInstance => Protection::Store {
                url: format!(
                    "sqlite://{}",
                    plan.dir.path().join(format!("instance-{index}.db")).display()
                ),
                policy: Box::new(policy()),
            },
            SetUp::SharedStore => Protection::Store {
                url: plan.store.clone(),
                policy: Box::new(policy()),
            },
            // The payments service completes every run in its transaction, and has no other effect.
            SetUp::InTransaction => Protection::Store {
                url: plan.store.clone(),
                policy: Box::new(Policy {
                    in_transaction: true,
                    ..policy()
                }),
            },
        },
    };
    let mut instances = Vec::with_capacity(plan.instances);
    for index in 0..plan.instances {
        let instance = Instance::start(config(index))
            .await
            .with_context(|| format!("cannot start gateway instance {}", index + 1))?;
        instances.push(Some(instance));
    }
    let addrs = instances.iter().flatten().map(Instance::addr).collect();
    let balancer = Balancer::start(addrs, plan.faults).await?;

    let done = Arc::new(AtomicU64::new(0));
    let url = balancer.url();
    let traffic = clients::pay_all(&url, plan.payments, plan.clients, done.clone());
    // The crash: when a third of the payments are done, one instance dies with everything it had
    // in flight; when two thirds are done it is back (a fresh instance on the same store).
    let victim = plan.victim();
    let crash = async {
        while done.load(Ordering::Relaxed) < plan.payments / 3 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if let Some(instance) = instances[victim].take() {
            instance.kill().await;
        }
        let back_at = tokio::time::Instant::now() + MAX_DOWN;
        while done.load(Ordering::Relaxed) < plan.payments * 2 / 3 && tokio::time::Instant::now() < back_at {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let restarted = Instance::start(config(victim))
            .await
            .context("cannot restart the killed instance")?;
        balancer.replace(victim, restarted.addr());
        instances[victim] = Some(restarted);
        anyhow::Ok(())
    };
    // If the clients fail, the payments stop counting up: the crash must not wait for them.
    let failed = tokio_util::sync::CancellationToken::new();
    let (paid, crashed) = tokio::join!(
        async {
            let paid = traffic.await;
            if paid.is_err() {
                failed.cancel();
            }
            paid
        },
        async {
            tokio::select! {
                crashed = crash => crashed,
                () = failed.cancelled() => Ok(()),
            }
        },
    );
    let paid = paid?;
    crashed?;
    for instance in instances.into_iter().flatten() {
        instance.stop().await;
    }

    let tally = payments.tally(plan.payments).await?;
    let counters = balancer.counters();
    Ok(Row {
        set_up: set_up.id(),
        title: set_up.title(),
        payments: plan.payments,
        charges: tally.charges,
        double_charges: tally.double_charges,
        lost: tally.lost,
        client_errors: paid.iter().filter(|p| !p.ok).count() as u64,
        attempts: paid.iter().map(|p| u64::from(p.attempts)).sum(),
        replayed: paid.iter().filter(|p| p.replayed).count() as u64,
        dropped_answers: counters.dropped_answers.load(Ordering::Relaxed),
        resets: counters.resets.load(Ordering::Relaxed),
        recovered_runs: tally.recovered_runs,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The gateways' policy: the defaults, with a short lease, and records that go soon from a store
/// that outlives the demo (`--store`).
fn policy() -> Policy {
    Policy {
        lease: LEASE,
        ttl: RETENTION,
        tombstone_ttl: RETENTION,
        ..Policy::default()
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now()) % 1_000_000
}
