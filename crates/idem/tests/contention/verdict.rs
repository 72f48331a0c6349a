//! The verdict of a contention run, every failed condition named at once: unrelated keys get no
//! error and a p99 within twice the baseline's; each slow key runs once and every copy gets its
//! answer (or `409 key-in-flight` after the wait); the ledger holds one row per payment answered;
//! on PostgreSQL, none of idem's connections waits on a lock or is left running.

use std::collections::{BTreeMap, HashMap};

use super::driver::{PhaseResult, Sent};
use super::figures::Figures;
use super::locks::Waits;
use crate::common::ledger::Runs;

/// The storm's p99 of unrelated keys may be at most this many times the baseline's.
pub(crate) const P99_RATIO: f64 = 2.0;

/// What the run saw besides the answers.
#[derive(Debug, Default)]
pub(crate) struct Evidence {
    /// The upstream's runs, per key.
    pub(crate) runs: HashMap<String, Runs>,
    /// Committed ledger rows, per key.
    pub(crate) rows: HashMap<String, i64>,
    /// Each slow key sent once more to each gateway after the storm.
    pub(crate) replays: Vec<(String, [Sent; 2])>,
    /// idem's lock waits during the storm (PostgreSQL).
    pub(crate) waits: Option<Waits>,
    /// idem's statements still running once the storm ended (PostgreSQL).
    pub(crate) left_running: Option<Vec<String>>,
}

/// The failed conditions of `phases` but the p99 ratio ([`p99_ratio`]); empty when they held.
pub(crate) fn failures<'a>(phases: impl IntoIterator<Item = &'a PhaseResult>, evidence: &Evidence) -> Vec<String> {
    let mut failed = Vec::new();
    let phases: Vec<&PhaseResult> = phases.into_iter().collect();
    for phase in &phases {
        let figures = Figures::of(phase);
        let errors: usize = figures.errors.values().sum();
        if errors > 0 {
            failed.push(format!(
                "{}: {errors} of {} unrelated keys were not answered 201: {:?}",
                figures.phase, figures.unrelated, figures.errors
            ));
        }
    }
    for phase in phases {
        for key in &phase.slow {
            failed.extend(slow_key(&key.key, &key.answers, evidence));
        }
        for (key, sent) in &phase.unrelated {
            if sent.status == 201 && evidence.rows.get(key).copied().unwrap_or(0) != 1 {
                failed.push(format!(
                    "{key} was answered 201 but the ledger holds {} rows for it",
                    evidence.rows.get(key).copied().unwrap_or(0)
                ));
            }
        }
    }
    for (key, rows) in &evidence.rows {
        if *rows > 1 {
            failed.push(format!("{key} has {rows} ledger rows: it ran more than once"));
        }
    }
    for (key, runs) in &evidence.runs {
        if runs.runs > 1 && runs.recovered + 1 < runs.runs {
            failed.push(format!(
                "{key} reached the upstream {runs:?}: run again without Idempotency-Recovered"
            ));
        }
    }
    for (key, [first, second]) in &evidence.replays {
        for sent in [first, second] {
            if sent.status != 201 || !sent.replayed {
                failed.push(format!(
                    "{key} sent again after the storm: {} ({}), not the stored answer replayed",
                    sent.outcome(),
                    String::from_utf8_lossy(&sent.body)
                ));
            }
        }
    }
    if let Some(waits) = &evidence.waits
        && waits.most_at_once > 0
    {
        failed.push(format!("during the storm, {waits}"));
    }
    if let Some(left) = &evidence.left_running
        && !left.is_empty()
    {
        failed.push(format!("once the storm ended, idem's connections still ran: {left:?}"));
    }
    failed
}

/// The storm's p99 of unrelated keys against the baseline's (`figures` of one cycle: baseline,
/// storm): what is wrong, if it is over [`P99_RATIO`].
pub(crate) fn p99_ratio(figures: &[Figures]) -> Option<String> {
    let [baseline, storm] = figures else {
        return Some(format!("{} phases, not a baseline and a storm", figures.len()));
    };
    let ratio = storm.p99.as_secs_f64() / baseline.p99.as_secs_f64().max(1e-6);
    (ratio > P99_RATIO).then(|| {
        format!(
            "unrelated keys' p99 in the storm is {ratio:.2}× the baseline's ({:?} against {:?}; at most {P99_RATIO}×)",
            storm.p99, baseline.p99
        )
    })
}

/// A slow key's answers: one run, one answer (the first `201` not replayed, the others the same
/// body replayed, or `409 key-in-flight` after the wait), one ledger row, and the same answer
/// replayed afterwards.
fn slow_key(key: &str, answers: &[Sent], evidence: &Evidence) -> Vec<String> {
    let mut failed = Vec::new();
    let fresh: Vec<&Sent> = answers.iter().filter(|a| a.status == 201 && !a.replayed).collect();
    if fresh.len() != 1 {
        failed.push(format!(
            "{key}: {} fresh 201 answers among its copies, not 1",
            fresh.len()
        ));
    }
    let body = fresh.first().map(|sent| &sent.body);
    let mut wrong: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for sent in answers {
        let outcome = match (sent.status, sent.problem.as_deref()) {
            (201, _) if Some(&sent.body) == body => continue,
            (409, Some("key-in-flight")) => continue,
            (201, _) => "201 with another answer".to_owned(),
            _ => sent.outcome(),
        };
        let seen = wrong
            .entry(outcome)
            .or_insert_with(|| (0, String::from_utf8_lossy(&sent.body).into_owned()));
        seen.0 += 1;
    }
    for (outcome, (n, example)) in wrong {
        failed.push(format!("{key}: {n} of its requests got {outcome} ({example})"));
    }
    let runs = evidence.runs.get(key).cloned().unwrap_or_default();
    if runs.runs != 1 || runs.recovered != 0 {
        failed.push(format!("{key}: reached the upstream {runs:?}, not once"));
    }
    let rows = evidence.rows.get(key).copied().unwrap_or(0);
    if rows != 1 {
        failed.push(format!("{key}: {rows} ledger rows, not 1"));
    }
    if let Some((_, again)) = evidence.replays.iter().find(|(k, _)| k == key)
        && let Some(body) = body
        && again.iter().any(|sent| sent.status == 201 && sent.body != *body)
    {
        failed.push(format!("{key}: replayed afterwards with another body"));
    }
    failed
}
