//! A fault storm through one or more relays, scheduled by a seeded generator: point faults
//! (resets before a command, resets after it with the reply lost, latency spikes) armed at random
//! gaps, each striking the next command that goes through its relay within 150 ms (or lapsing),
//! and a few black holes spread over the storm. Only faults that struck are counted.

use std::time::Duration;

use tokio::time::Instant;

use crate::relay::{Fault, FaultCount, Relay};
use crate::seed::Rng;

/// The most faults armed on one relay and waiting for its traffic.
const MAX_QUEUED: usize = 2;
/// How long an armed fault waits for a command to strike; then it lapses (not counted).
const STRIKE_WINDOW: Duration = Duration::from_millis(150);

/// What a storm injects, and for how long.
#[derive(Debug, Clone, PartialEq)]
pub struct StormPlan {
    /// How long faults are injected.
    pub duration: Duration,
    /// The gap between two point faults being armed.
    pub gap: (Duration, Duration),
    /// The weights of resets before a command, resets after one, and latency spikes.
    pub weights: [u32; 3],
    /// How long a latency spike holds a command.
    pub spike: (Duration, Duration),
    /// How many black holes, spread over the storm (on one relay each, picked at random).
    pub black_holes: usize,
    /// How long a black hole lasts.
    pub black_hole: (Duration, Duration),
}

impl StormPlan {
    /// A storm of `duration`: a point fault every 40–140 ms (resets before and after a command
    /// and latency spikes of 0.1–1.5 s in equal parts), and one black hole of 2–3.5 s per 10 s.
    pub fn over(duration: Duration) -> Self {
        Self {
            duration,
            gap: (Duration::from_millis(40), Duration::from_millis(140)),
            weights: [1, 1, 1],
            spike: (Duration::from_millis(100), Duration::from_millis(1500)),
            black_holes: usize::try_from(duration.as_secs() / 10).unwrap_or(1).max(1),
            black_hole: (Duration::from_millis(2000), Duration::from_millis(3500)),
        }
    }
}

/// Runs the storm `plan` on `relays` (each fault on one of them, picked at random) and returns
/// the faults that struck. Armed faults that have not struck when the storm ends are taken back.
///
/// # Panics
/// If `relays` is empty.
pub async fn run(relays: &[&Relay], rng: &mut Rng, plan: &StormPlan) -> FaultCount {
    assert!(!relays.is_empty(), "a storm needs a relay");
    let before = relays
        .iter()
        .map(|relay| relay.faults())
        .fold(FaultCount::default(), |sum, count| sum + count);
    let started = Instant::now();
    let end = started + plan.duration;

    // The black holes: one per slice of the storm, at a random point of its first half.
    let slice = plan.duration / u32::try_from(plan.black_holes.max(1)).unwrap_or(u32::MAX);
    let mut holes: Vec<(Instant, usize, Duration)> = (0..plan.black_holes)
        .map(|i| {
            let offset = rng.between(Duration::ZERO, slice / 2);
            let at = started + slice * u32::try_from(i).unwrap_or(u32::MAX) + offset;
            let relay = pick(rng, relays.len());
            (at, relay, rng.between(plan.black_hole.0, plan.black_hole.1))
        })
        .collect();
    holes.reverse();

    let mut next_fault = started + rng.between(plan.gap.0, plan.gap.1);
    let mut target = None;
    while Instant::now() < end {
        let now = Instant::now();
        if let Some(&(at, relay, length)) = holes.last()
            && at <= now
        {
            relays[relay].black_hole(length);
            holes.pop();
        }
        // On schedule, whatever the traffic; a relay whose traffic is slow to take its armed
        // faults gets no more than a couple queued, so faults do not bunch up.
        // (The generator is drawn from only when a fault is armed, so that one seed is one
        // schedule however the loop is timed.)
        if now >= next_fault {
            let relay = *target.get_or_insert_with(|| pick(rng, relays.len()));
            if relays[relay].armed() < MAX_QUEUED {
                let fault = match rng.weighted(&plan.weights) {
                    0 => Fault::ResetBeforeForward,
                    1 => Fault::ResetAfterReply,
                    _ => Fault::Delay(rng.between(plan.spike.0, plan.spike.1)),
                };
                relays[relay].arm_for(fault, STRIKE_WINDOW);
                target = None;
                next_fault = now + rng.between(plan.gap.0, plan.gap.1);
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for relay in relays {
        relay.disarm();
    }
    let after = relays
        .iter()
        .map(|relay| relay.faults())
        .fold(FaultCount::default(), |sum, count| sum + count);
    FaultCount {
        resets_before: after.resets_before - before.resets_before,
        resets_after: after.resets_after - before.resets_after,
        delays: after.delays - before.delays,
        black_holes: after.black_holes - before.black_holes,
    }
}

fn pick(rng: &mut Rng, n: usize) -> usize {
    usize::try_from(rng.below(u64::try_from(n).unwrap_or(u64::MAX))).unwrap_or(0)
}
