//! The figures of a contention run, per phase: unrelated keys' latency (p50, p99, max) and
//! outcomes, the slow keys' copies and their outcomes. Printed as a markdown table, the form the
//! benchmark page (docs/numbers.md) takes.

use std::collections::BTreeMap;
use std::time::Duration;

use super::driver::{PhaseResult, Sent};

/// One phase, summed up.
#[derive(Debug, Clone)]
pub(crate) struct Figures {
    pub(crate) phase: &'static str,
    /// Unrelated keys sent.
    pub(crate) unrelated: usize,
    pub(crate) p50: Duration,
    pub(crate) p99: Duration,
    pub(crate) max: Duration,
    /// Unrelated keys' outcomes other than `201`, by outcome.
    pub(crate) errors: BTreeMap<String, usize>,
    /// Slow keys, and their copies (the first request not counted).
    pub(crate) slow_keys: usize,
    pub(crate) copies: usize,
    /// Outcomes of every request of a slow key (first and copies): `201`, `201 replayed`,
    /// `409 key-in-flight`, …
    pub(crate) slow_outcomes: BTreeMap<String, usize>,
    /// Unrelated keys sent per second.
    pub(crate) rate: f64,
}

impl Figures {
    pub(crate) fn of(result: &PhaseResult) -> Self {
        let mut latencies: Vec<Duration> = result.unrelated.iter().map(|(_, sent)| sent.latency).collect();
        latencies.sort();
        let mut errors = BTreeMap::new();
        for (_, sent) in &result.unrelated {
            if sent.status != 201 || sent.replayed {
                *errors.entry(outcome(sent)).or_default() += 1;
            }
        }
        let mut slow_outcomes = BTreeMap::new();
        for key in &result.slow {
            for sent in &key.answers {
                *slow_outcomes.entry(outcome(sent)).or_default() += 1;
            }
        }
        Self {
            phase: result.phase.name(),
            unrelated: latencies.len(),
            p50: percentile(&latencies, 50.0),
            p99: percentile(&latencies, 99.0),
            max: latencies.last().copied().unwrap_or_default(),
            errors,
            slow_keys: result.slow.len(),
            copies: result.slow.iter().map(|key| key.answers.len() - 1).sum(),
            slow_outcomes,
            rate: latencies.len() as f64 / result.sending.as_secs_f64().max(0.001),
        }
    }
}

/// `201`, `201 replayed`, `503 store-unavailable`, `no answer`.
pub(crate) fn outcome(sent: &Sent) -> String {
    if sent.status == 201 && sent.replayed {
        "201 replayed".to_owned()
    } else {
        sent.outcome()
    }
}

/// The `p`th percentile of sorted samples (nearest rank); zero when there are none.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}

fn counts(counts: &BTreeMap<String, usize>) -> String {
    if counts.is_empty() {
        return "0".to_owned();
    }
    counts
        .iter()
        .map(|(outcome, n)| format!("{n} × {outcome}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The phases as a markdown table, with the storm's p99 against the baseline's.
pub(crate) fn table(store: &str, phases: &[Figures]) -> String {
    let mut out = format!(
        "| {store} | unrelated keys | req/s | p50 | p99 | max | unrelated errors | slow keys (copies) | slow keys' answers |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    for figures in phases {
        out.push_str(&format!(
            "| {} | {} | {:.0} | {} | {} | {} | {} | {} ({}) | {} |\n",
            figures.phase,
            figures.unrelated,
            figures.rate,
            ms(figures.p50),
            ms(figures.p99),
            ms(figures.max),
            counts(&figures.errors),
            figures.slow_keys,
            figures.copies,
            counts(&figures.slow_outcomes),
        ));
    }
    out
}

/// Where the storm's slowest unrelated keys fell: each one's send time and latency, beside when
/// each slow key's copies were sent (seconds from the phase's start), to tell a stall that
/// follows the copies from one that does not.
pub(crate) fn slowest(result: &PhaseResult, n: usize) -> String {
    let at = |sent: &Sent| sent.sent_at.duration_since(result.started).as_secs_f64();
    let mut unrelated: Vec<&Sent> = result.unrelated.iter().map(|(_, sent)| sent).collect();
    unrelated.sort_by_key(|sent| std::cmp::Reverse(sent.latency));
    let slowest: Vec<String> = unrelated
        .iter()
        .take(n)
        .map(|sent| format!("+{:.2}s {}", at(sent), ms(sent.latency)))
        .collect();
    let mut slow: Vec<_> = result.slow.iter().collect();
    slow.sort_by_key(|key| key.answers.first().map(|sent| sent.sent_at));
    let copies: Vec<String> = slow
        .iter()
        .take(n)
        .filter_map(|key| {
            let first = key.answers.first()?;
            let copy = key.answers.get(1)?;
            Some(format!(
                "+{:.2}s (copies +{:.2}s, held {:.1}s)",
                at(first),
                at(copy),
                key.hold.as_secs_f64()
            ))
        })
        .collect();
    format!(
        "slowest unrelated keys: {}\nfirst slow keys sent: {}",
        slowest.join(", "),
        copies.join(", ")
    )
}
