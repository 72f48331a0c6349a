//! The driver: starts the set-up (upstream, gateways, store, shared clock), runs each step against
//! the real processes, then hands what the upstream saw and what each client got to the oracle.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use idem_test_support::seed::Rng;

use super::generator::{Generator, Plan, SCOPES, Step};
use super::oracle::{Model, Outcome, Record, RecordId, Shape, judge_own_answer};
use super::routes::{CONFIG, Protection};
use super::upstream::{self, Arrival, Upstream};
use super::wire::{self, Answer, Reading};
use crate::common::{Gateway, faketime_library, lose_store_data, run_idem_with_env};
use idem_core::replay_cache::IDENTITY_CHECK;

/// How long the driver waits for a hung run to end and its record to settle.
const SETTLE: Duration = Duration::from_secs(20);
/// How long an operator's command may take.
const COMMAND: Duration = Duration::from_secs(30);

/// Whose clock moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Clock {
    /// Every idem process (gateways and commands) reads one shared libfaketime offset, which the
    /// `Jump` steps move: the store's clock (SQLite: the machine's) moves with it.
    Shared,
    /// The store keeps its own clock (PostgreSQL `now()`); the operator's commands run on a
    /// skewed machine clock, which must change nothing a client gets.
    SkewedOperator,
}

/// One set-up of the rule test.
#[derive(Debug)]
pub(crate) struct Setup {
    pub(crate) name: &'static str,
    pub(crate) instances: usize,
    /// The store URL (`None`: a fresh SQLite file).
    pub(crate) store: Option<String>,
    pub(crate) clock: Clock,
    /// Flags added to `idem serve` besides `--config`.
    pub(crate) flags: &'static [&'static str],
}

/// One request sent, and what came of it.
#[derive(Debug)]
struct Sent {
    n: u64,
    plan: Plan,
    answer: Result<Answer, String>,
    /// Its gateway was killed under it: no answer is fine.
    may_fail: bool,
}

/// Something that changed a record between two runs of a step.
#[derive(Debug)]
enum Event {
    /// `idem delete` of a record in flight (`Some`) or idle (`None`).
    Deleted(RecordId, Option<(Shape, Protection)>),
    /// `idem delete` of a record it said was in flight, with no run of the step under it (a dead
    /// holder's).
    DeletedHeld(RecordId),
    /// The gateway running this record was killed.
    Killed(RecordId, Shape, Protection),
    /// The store lost every record.
    Lost,
}

/// The running set-up and the oracle's model of it.
pub(crate) struct Driver {
    setup: Setup,
    upstream: Upstream,
    gateways: Vec<Gateway>,
    store: String,
    config: PathBuf,
    clock_file: PathBuf,
    offset: Duration,
    started: Instant,
    model: Model,
    /// Arrivals already judged.
    seen: usize,
    next_req: u64,
    skew_rng: Rng,
    pub(crate) log: Vec<String>,
    pub(crate) violations: Vec<String>,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("setup", &self.setup)
            .finish_non_exhaustive()
    }
}

impl Driver {
    /// Starts the upstream and the gateways of `setup`.
    pub(crate) async fn start(setup: Setup, skew_rng: Rng) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let config = dir.path().join("idem.toml");
        std::fs::write(&config, CONFIG).expect("write the config file");
        let clock_file = dir.path().join("faketime");
        std::fs::write(&clock_file, "+0").expect("write the clock file");
        let store = setup
            .store
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}", dir.path().join("idem.db").display()));
        let mut driver = Self {
            upstream: Upstream::start().await,
            gateways: Vec::new(),
            store,
            config,
            clock_file,
            offset: Duration::ZERO,
            started: Instant::now(),
            model: Model::default(),
            seen: 0,
            next_req: 1,
            skew_rng,
            log: Vec::new(),
            violations: Vec::new(),
            setup,
            _dir: dir,
        };
        for _ in 0..driver.setup.instances {
            let gateway = driver.start_gateway().await;
            driver.gateways.push(gateway);
        }
        driver
    }

    /// The environment of a gateway: the shared clock, when it moves.
    fn gateway_env(&self) -> Vec<(String, String)> {
        match self.setup.clock {
            Clock::Shared => self.shared_clock_env(),
            Clock::SkewedOperator => Vec::new(),
        }
    }

    fn shared_clock_env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), faketime_library().display().to_string()),
            ("FAKETIME_TIMESTAMP_FILE".into(), self.clock_file.display().to_string()),
            ("FAKETIME_NO_CACHE".into(), "1".into()),
            ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
        ]
    }

    /// The environment of an operator's command: the shared clock, or a skewed one.
    fn command_env(&mut self) -> (Vec<(String, String)>, String) {
        match self.setup.clock {
            Clock::Shared => (self.shared_clock_env(), String::new()),
            Clock::SkewedOperator => {
                const SKEWS: &[&str] = &["+0", "+2d", "+9d", "-1d", "+3h"];
                let skew = SKEWS[self.skew_rng.below(SKEWS.len() as u64) as usize];
                (
                    vec![
                        ("LD_PRELOAD".into(), faketime_library().display().to_string()),
                        ("FAKETIME".into(), skew.into()),
                        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
                    ],
                    format!(" (machine clock {skew})"),
                )
            }
        }
    }

    async fn start_gateway(&self) -> Gateway {
        let mut args = vec!["--config".to_owned(), self.config.display().to_string()];
        args.extend(self.setup.flags.iter().map(|f| (*f).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env = self.gateway_env();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Gateway::start_on_store_with_env(&self.upstream.url(), &self.store, &args, &env).await
    }

    /// Model time: real time since the start plus every jump of the clock.
    fn now(&self) -> Duration {
        self.started.elapsed() + self.offset
    }

    async fn send(&self, n: u64, plan: &Plan) -> Result<Answer, String> {
        let mut headers = vec![(upstream::REQ, n.to_string()), (upstream::DO, plan.behaviour.header())];
        if let Some(key) = &plan.key {
            headers.push(("idempotency-key", key.clone()));
        }
        if let Some(credential) = SCOPES[plan.scope] {
            headers.push(("authorization", credential.to_owned()));
        }
        let addr = self.gateways[plan.instance].addr();
        wire::exchange(addr, &plan.shape.method, &plan.shape.target, &headers, &plan.shape.body).await
    }

    fn number(&mut self) -> u64 {
        let n = self.next_req;
        self.next_req += 1;
        n
    }

    /// Runs an operator's command, returning its exit code and output for the log.
    async fn idem(&mut self, args: &[&str]) -> (Option<i32>, String) {
        let (env, note) = self.command_env();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut full: Vec<&str> = args.to_vec();
        full.extend(["--store", self.store.as_str()]);
        let output = run_idem_with_env(&full, &env, COMMAND).await;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let said: Vec<&str> = [stdout.lines().next(), stderr.lines().last()]
            .into_iter()
            .flatten()
            .filter(|line| !line.trim().is_empty())
            .collect();
        let text = format!("{}{note}", said.join(" / "));
        (output.status.code(), text)
    }

    fn record_args(id: &RecordId) -> Vec<String> {
        match SCOPES[id.0] {
            Some(credential) => vec!["--authorization".into(), credential.into(), id.1.clone()],
            None => vec!["--scope".into(), "anonymous".into(), id.1.clone()],
        }
    }

    /// Runs `idem delete`; returns whether it deleted (exit 0: a refusal or a missing record
    /// changes nothing) and what it said.
    async fn delete(&mut self, id: &RecordId) -> (bool, String) {
        let mut args = vec!["delete".to_owned()];
        args.extend(Self::record_args(id));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, text) = self.idem(&args).await;
        (code == Some(0), format!("delete exit {code:?}: {text}"))
    }

    /// Waits until no run hangs at the upstream and the records of `ids` are no longer in
    /// flight (a hung run stored or given up). Never fails: what did not settle is the oracle's.
    async fn settle_records(&mut self, ids: &[RecordId]) {
        let deadline = Instant::now() + SETTLE;
        while self.upstream.open() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for id in ids {
            let mut args = vec!["inspect".to_owned(), "--json".to_owned()];
            args.extend(Self::record_args(id));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            while Instant::now() < deadline {
                let (env, _) = match self.setup.clock {
                    Clock::Shared => (self.shared_clock_env(), ()),
                    Clock::SkewedOperator => (Vec::new(), ()),
                };
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let mut full = args.clone();
                full.extend(["--store", self.store.as_str()]);
                let output = run_idem_with_env(&full, &env, COMMAND).await;
                if !String::from_utf8_lossy(&output.stdout).contains("\"state\":\"in-flight\"") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    async fn wait_for_arrival(&self, n: u64, task: &tokio::task::JoinHandle<Result<Answer, String>>) -> bool {
        let deadline = Instant::now() + SETTLE;
        while Instant::now() < deadline {
            if self.upstream.arrivals().iter().any(|a| a.req == Some(n)) {
                return true;
            }
            if task.is_finished() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    fn spawn_send(&self, n: u64, plan: &Plan) -> tokio::task::JoinHandle<Result<Answer, String>> {
        let addr = self.gateways[plan.instance].addr();
        let plan = plan.clone();
        tokio::spawn(async move {
            let mut headers = vec![(upstream::REQ, n.to_string()), (upstream::DO, plan.behaviour.header())];
            if let Some(key) = &plan.key {
                headers.push(("idempotency-key", key.clone()));
            }
            if let Some(credential) = SCOPES[plan.scope] {
                headers.push(("authorization", credential.to_owned()));
            }
            wire::exchange(addr, &plan.shape.method, &plan.shape.target, &headers, &plan.shape.body).await
        })
    }

    /// Runs one step and judges it; returns the step's log line.
    pub(crate) async fn step(&mut self, step: &Step) -> String {
        let mut events = Vec::new();
        let mut notes = String::new();
        // Requests judged before the step's end (logged with the others).
        let mut earlier: Vec<Sent> = Vec::new();
        // The upstream refused connections during the step.
        let mut refused = false;
        let (sent, in_flight_possible) = match step {
            Step::Send(plan) => {
                let n = self.number();
                let answer = self.send(n, plan).await;
                (vec![sent(n, plan, answer)], false)
            }
            Step::Copies(plans) => {
                let numbered: Vec<(u64, &Plan)> = plans.iter().map(|p| (self.number(), p)).collect();
                let tasks: Vec<_> = numbered.iter().map(|(n, p)| self.spawn_send(*n, p)).collect();
                let mut out = Vec::new();
                for ((n, plan), task) in numbered.into_iter().zip(tasks) {
                    out.push(sent(n, plan, task.await.expect("the copy's task")));
                }
                (out, true)
            }
            Step::Hang { plan, retry } => {
                let n = self.number();
                let answer = self.send(n, plan).await;
                let mut out = vec![sent(n, plan, answer)];
                if let Some(retry) = retry {
                    let retry_n = self.number();
                    let answer = self.send(retry_n, retry).await;
                    out.push(sent(retry_n, retry, answer));
                }
                // Only a run that reached the upstream leaves its record in flight to wait for.
                let ran = self.upstream.arrivals().iter().any(|a| a.req == Some(n));
                let ids: Vec<RecordId> = plan.id().filter(|_| ran).into_iter().collect();
                self.settle_records(&ids).await;
                (out, true)
            }
            Step::DeleteInFlight { plan, waiter } => {
                let id = plan.id().expect("keyed");
                let n = self.number();
                let task = self.spawn_send(n, plan);
                if !self.wait_for_arrival(n, &task).await {
                    // It never ran (a replay, a mismatch): judge it on the record as it was, then
                    // delete the record at rest.
                    let first = sent(n, plan, task.await.expect("the request's task"));
                    self.judge(std::slice::from_ref(&first), Vec::new(), false, false);
                    let deleted;
                    (deleted, notes) = self.delete(&id).await;
                    if deleted {
                        let event = if said_in_flight(&notes) {
                            Event::DeletedHeld(id)
                        } else {
                            Event::Deleted(id, None)
                        };
                        self.apply(event, self.now());
                    }
                    earlier.push(first);
                    (Vec::new(), false)
                } else {
                    let waiter_n = self.number();
                    let waiter_task = self.spawn_send(waiter_n, waiter);
                    // Give the waiter time to reach its wait (not asserted: any order is judged).
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let at = self.upstream.arrived();
                    let deleted;
                    (deleted, notes) = self.delete(&id).await;
                    // On a slow machine the run may have ended before the delete: then it
                    // deleted the answer, and says so.
                    let said_in_flight = said_in_flight(&notes);
                    let still_running = self.upstream.open() > 0;
                    let protection = Protection::of(&plan.shape.method, &plan.shape.target);
                    if deleted {
                        let in_flight = (protection.protected() && said_in_flight && still_running)
                            .then(|| (plan.shape.clone(), protection));
                        events.push((at, Event::Deleted(id.clone(), in_flight)));
                    }
                    let first = sent(n, plan, task.await.expect("the request's task"));
                    let second = sent(waiter_n, waiter, waiter_task.await.expect("the waiter's task"));
                    self.settle_records(&[id]).await;
                    (vec![first, second], true)
                }
            }
            Step::Delete(id) => {
                let deleted;
                (deleted, notes) = self.delete(id).await;
                if deleted {
                    let event = if said_in_flight(&notes) {
                        Event::DeletedHeld(id.clone())
                    } else {
                        Event::Deleted(id.clone(), None)
                    };
                    events.push((self.upstream.arrived(), event));
                }
                (Vec::new(), false)
            }
            Step::Purge => {
                let (code, text) = self.idem(&["purge"]).await;
                notes = format!("purge exit {code:?}: {text}");
                (Vec::new(), false)
            }
            Step::Jump(by) => {
                self.settle_records(&[]).await;
                self.offset += *by;
                std::fs::write(&self.clock_file, format!("+{}", self.offset.as_secs())).expect("move the clock");
                (Vec::new(), false)
            }
            Step::Refused(plan) => {
                self.upstream.stop_listening().await;
                // Connections the gateway opened ahead (its pool races a new connection against an
                // idle one) and the upstream had not accepted are reset with the listener: give
                // the gateway a moment to notice, so that it finds the upstream refusing. Any
                // order is judged all the same.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let n = self.number();
                let answer = self.send(n, plan).await;
                self.upstream.listen_again().await;
                refused = true;
                (vec![sent(n, plan, answer)], false)
            }
            Step::LoseData { restart } => {
                self.settle_records(&[]).await;
                lose_store_data(&self.store).await;
                events.push((self.upstream.arrived(), Event::Lost));
                if let Some(instance) = restart {
                    self.gateways[*instance].kill().await;
                    let restarted = self.start_gateway().await;
                    self.gateways[*instance] = restarted;
                }
                // A gateway that only replays from its cache finds the loss within this.
                tokio::time::sleep(IDENTITY_CHECK * 2).await;
                (Vec::new(), false)
            }
            Step::Kill { instance, during } => {
                let mut out = Vec::new();
                let mut task = None;
                if let Some(plan) = during {
                    let n = self.number();
                    let handle = self.spawn_send(n, plan);
                    let running = self.wait_for_arrival(n, &handle).await;
                    let protection = Protection::of(&plan.shape.method, &plan.shape.target);
                    if running && let Some(id) = plan.id().filter(|_| protection.protected()) {
                        events.push((
                            self.upstream.arrived(),
                            Event::Killed(id, plan.shape.clone(), protection),
                        ));
                    }
                    task = Some((n, plan, handle));
                }
                // The run must still hang at the upstream when its gateway dies (it does for
                // 2.5 s; only a very slow machine could miss it, and then nothing is claimed).
                if self.upstream.open() == 0 {
                    events.retain(|(_, event)| !matches!(event, Event::Killed(..)));
                }
                self.gateways[*instance].kill().await;
                let restarted = self.start_gateway().await;
                self.gateways[*instance] = restarted;
                if let Some((n, plan, handle)) = task {
                    let mut item = sent(n, plan, handle.await.expect("the request's task"));
                    item.may_fail = true;
                    out.push(item);
                }
                self.settle_records(&[]).await;
                (out, true)
            }
        };
        self.judge(&sent, events, in_flight_possible, refused);
        let answers: Vec<String> = earlier
            .iter()
            .chain(&sent)
            .map(|s| match &s.answer {
                Ok(answer) => format!("#{} {}", s.n, answer.summary()),
                Err(failure) => format!("#{} no answer ({failure})", s.n),
            })
            .collect();
        let mut line = format!("{step}");
        if !answers.is_empty() {
            line.push_str(&format!(" → {}", answers.join(", ")));
        }
        if !notes.is_empty() {
            line.push_str(&format!(" [{}]", notes.trim()));
        }
        line
    }

    /// Hands the step's runs (in order of arrival, with the step's events between them) and its
    /// answers to the oracle.
    fn judge(&mut self, sent: &[Sent], events: Vec<(usize, Event)>, in_flight_possible: bool, refused: bool) {
        let arrivals = self.upstream.arrivals();
        let by_n: HashMap<u64, &Sent> = sent.iter().map(|s| (s.n, s)).collect();
        let mut runs: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut events = events.into_iter().peekable();
        let now = self.now();
        let mut violations = Vec::new();
        for (index, arrival) in arrivals.iter().enumerate().skip(self.seen) {
            while let Some((_, event)) = events.next_if(|(at, _)| *at <= index) {
                self.apply(event, now);
            }
            let Some(s) = arrival.req.and_then(|n| by_n.get(&n)) else {
                violations.push(format!(
                    "a run that no request of this step asked for reached the upstream: {arrival:?}"
                ));
                continue;
            };
            runs.entry(s.n).or_default().push(arrival.run);
            if let Err(err) = self.judge_run(s, arrival, now) {
                violations.push(format!("#{} {}: {err}", s.n, s.plan));
            }
        }
        self.seen = arrivals.len();
        for (_, event) in events {
            self.apply(event, now);
        }
        for s in sent {
            // A connection reset under a request already sent (one the gateway opened before the
            // upstream went down) is an unknown outcome for the gateway: the key is unknown then.
            if refused
                && let Ok(answer) = &s.answer
                && answer.status == 502
                && answer.problem().as_deref() == Some("upstream-failed")
                && let Some(id) = s.plan.id()
            {
                let protection = Protection::of(&s.plan.shape.method, &s.plan.shape.target);
                if protection.protected() && matches!(self.model.record(&id), Record::Fresh) {
                    self.model
                        .ran(&id, 0, Outcome::Unknown, &s.plan.shape, &protection, now);
                }
            }
            let judged = self.judge_answer(
                refused,
                s,
                runs.get(&s.n).map_or(&[][..], Vec::as_slice),
                &arrivals,
                in_flight_possible,
                now,
            );
            if let Err(err) = judged {
                violations.push(format!("#{} {}: {err}", s.n, s.plan));
            }
            // A recovery that found the upstream down releases the key unknown again, from now.
            if refused
                && let Ok(answer) = &s.answer
                && answer.status == 502
                && answer.problem().as_deref() == Some("upstream-unavailable")
                && let Some(id) = s.plan.id()
            {
                self.model.released_unknown_again(&id, now);
            }
        }
        self.violations.extend(violations);
    }

    fn apply(&mut self, event: Event, now: Duration) {
        match event {
            Event::Deleted(id, Some((shape, protection))) => self.model.deleted(&id, Some((&shape, &protection)), now),
            Event::Deleted(id, None) => self.model.deleted(&id, None, now),
            Event::DeletedHeld(id) => {
                // The record of a dead holder was still in flight (the delete said so): deleting
                // it leaves the key unknown, as it was.
                if !matches!(self.model.record(&id), Record::Unknown { held: true, .. }) {
                    self.model.deleted(&id, None, now);
                }
            }
            Event::Killed(id, shape, protection) => self.model.holder_killed(&id, &shape, &protection, now),
            Event::Lost => self.model.lost(),
        }
    }

    fn judge_run(&mut self, s: &Sent, arrival: &Arrival, now: Duration) -> Result<(), String> {
        let protection = Protection::of(&s.plan.shape.method, &s.plan.shape.target);
        if arrival.key != s.plan.key {
            return Err(format!("the upstream got key {:?}", arrival.key));
        }
        // Forwarded as sent: the method's spelling and the body's bytes.
        if arrival.method != s.plan.shape.method || arrival.body != s.plan.shape.body.as_bytes() {
            return Err(format!(
                "the upstream got {} {} with body {:?}",
                arrival.method,
                arrival.target,
                String::from_utf8_lossy(&arrival.body)
            ));
        }
        match s.plan.id() {
            None if protection.require => Err(format!(
                "a keyless request on a route that requires a key ({}) reached the upstream as {} {}",
                protection.routes, arrival.method, arrival.target
            )),
            None => Ok(()),
            Some(_) if !protection.protected() => Ok(()),
            Some(id) => {
                let verdict = self.model.judge_run(&id, arrival.recovered, now).map_err(|err| {
                    format!(
                        "run {} (recovered: {}) {err} [{}]",
                        arrival.run, arrival.recovered, protection.routes
                    )
                });
                self.model.ran(
                    &id,
                    arrival.run,
                    Outcome::of(s.plan.behaviour).after(arrival.recovered),
                    &s.plan.shape,
                    &protection,
                    now,
                );
                verdict
            }
        }
    }

    fn judge_answer(
        &self,
        refused: bool,
        s: &Sent,
        runs: &[u64],
        arrivals: &[Arrival],
        in_flight_possible: bool,
        now: Duration,
    ) -> Result<(), String> {
        let answer = match &s.answer {
            Ok(answer) => answer,
            Err(_) if s.may_fail => return Ok(()),
            Err(failure) => return Err(format!("no answer: {failure}")),
        };
        // No caller ever gets another caller's answer.
        if let Some(run) = answer.run() {
            let owner = arrivals.iter().find(|a| a.run == run);
            let caller = (SCOPES[s.plan.scope].map(str::to_owned), s.plan.key.clone());
            match owner {
                Some(a) if (a.authorization.clone(), a.key.clone()) != caller => {
                    return Err(format!(
                        "got the answer of another caller or key (run {run} of {:?} {:?})",
                        a.authorization, a.key
                    ));
                }
                Some(a) if s.plan.key.is_none() && a.req != Some(s.n) => {
                    return Err(format!("a keyless request got the answer of request #{:?}", a.req));
                }
                _ => {}
            }
        }
        match runs {
            [run] => return judge_own_answer(answer, *run, s.plan.behaviour),
            [] => {}
            many => {
                return Err(format!(
                    "one request reached the upstream {} times: runs {many:?}",
                    many.len()
                ));
            }
        }
        let protection = Protection::of(&s.plan.shape.method, &s.plan.shape.target);
        let refused_spelling = answer.status == 400 && protection.may_refuse;
        // Nothing was sent: 502 upstream-unavailable, and the record is as it was (an answer
        // still replays; an unknown outcome stays unknown).
        let problem = answer.problem();
        if refused
            && answer.status == 502
            && matches!(problem.as_deref(), Some("upstream-unavailable" | "upstream-failed"))
        {
            return match s.plan.id().filter(|_| protection.protected()) {
                // Only a key that could have run (flagged) may find the upstream down.
                Some(id) => self.model.judge_run(&id, true, now).map_err(|err| {
                    format!("answered 502 (the upstream down) where the key could not run: it would have {err}")
                }),
                None => Ok(()),
            };
        }
        match s.plan.id() {
            None if protection.require => {
                if answer.status == 400 {
                    Ok(())
                } else {
                    Err(format!(
                        "a keyless request on a route that requires a key was answered {}",
                        answer.summary()
                    ))
                }
            }
            Some(id) if protection.protected() => {
                self.model
                    .judge_unrun_answer(&id, &s.plan.shape, &protection, answer, in_flight_possible, now)
            }
            _ if refused_spelling => Ok(()),
            _ => Err(format!(
                "a request the protocol does not apply to ({}) did not reach the upstream: {}",
                protection.routes,
                answer.summary()
            )),
        }
    }
}

fn sent(n: u64, plan: &Plan, answer: Result<Answer, String>) -> Sent {
    Sent {
        n,
        plan: plan.clone(),
        answer,
        may_fail: false,
    }
}

/// Runs `steps` steps of `generator` on a started driver, stopping at the first step with a
/// violation unless `keep_going`. Each violation is named by its step's number.
pub(crate) async fn run(driver: &mut Driver, generator: &mut Generator, steps: usize, keep_going: bool) {
    for i in 1..=steps {
        let step = generator.next();
        let before = driver.violations.len();
        let began = Instant::now();
        let line = driver.step(&step).await;
        driver
            .log
            .push(format!("{i:>3}. {line} ({} ms)", began.elapsed().as_millis()));
        for violation in &mut driver.violations[before..] {
            *violation = format!("step {i}: {violation}");
        }
        if !driver.violations.is_empty() && !keep_going {
            break;
        }
    }
}

/// Whether `idem delete` said the record it deleted was in flight (its holder fenced, the key left
/// unknown) rather than completed or unknown (the key freed).
fn said_in_flight(notes: &str) -> bool {
    let text = notes.to_ascii_lowercase();
    text.contains("in-flight") || text.contains("in flight")
}
