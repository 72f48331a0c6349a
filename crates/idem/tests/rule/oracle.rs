//! The oracle: what the design (docs/design.md) says each key's record is, and what it allows a run and an answer
//! to be. It is written from the design alone (retention, the outcomes table, the upstream's side,
//! `idem delete`), never from idem's code, and it only forbids what the design rules out: where
//! the design leaves a choice (a copy that waited may get `409 key-in-flight`, a spelling read two
//! ways may be refused with a `400`), every choice passes.

use std::collections::HashMap;
use std::time::Duration;

use super::routes::{Protection, normalised};
use super::upstream::Behaviour;
use super::wire::{Answer, Reading};

/// How far from a ttl or tombstone-ttl boundary either side of it is accepted: covers the time a
/// run takes between its claim and its answer, whichever of the two a store counts from.
const MARGIN: Duration = Duration::from_secs(60);

/// Who sent a request and with which key: a record's identity.
pub(crate) type RecordId = (usize, String);

/// A request as its bytes go out: what the fingerprint reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) method: String,
    pub(crate) target: String,
    pub(crate) body: String,
}

impl Shape {
    /// The same request as an upstream reads it (method case and path spelling aside): a replay of
    /// one for the other is fine, and so is a `key-mismatch`.
    fn reads_as(&self, other: &Shape) -> bool {
        self.method.eq_ignore_ascii_case(&other.method)
            && normalised(&self.target) == normalised(&other.target)
            && self.body == other.body
    }
}

/// What the design says the store holds for one key.
#[derive(Debug, Clone)]
pub(crate) enum Record {
    /// Nothing: never used, released (a released status or nothing sent), or deleted.
    Fresh,
    /// An answer stored at `at` (model time).
    Completed {
        run: u64,
        status: u16,
        shape: Shape,
        at: Duration,
        ttl: Vec<Duration>,
        tombstone_ttl: Vec<Duration>,
    },
    /// An outcome nobody knows: the next run must carry `Idempotency-Recovered: true`.
    Unknown {
        shape: Shape,
        at: Duration,
        ttl: Vec<Duration>,
        tombstone_ttl: Vec<Duration>,
        /// Its holder may still hold a lease (it was killed, or its record deleted, mid-run):
        /// a copy may get `409 key-in-flight` meanwhile.
        held: bool,
        /// Its holder crashed: the record stays in flight until a copy takes it over, flagged
        /// recovered (the outcomes table sets no ttl on that).
        crashed: bool,
    },
}

impl Record {
    /// The unknown outcome of a run of `shape` under `protection` at `now` (`held`: its holder
    /// may still hold a lease; `crashed`: its holder crashed).
    fn unknown(shape: &Shape, protection: &Protection, now: Duration, held: bool, crashed: bool) -> Self {
        let (ttl, tombstone_ttl) = protection.retention();
        Self::Unknown {
            shape: shape.clone(),
            at: now,
            ttl,
            tombstone_ttl,
            held,
            crashed,
        }
    }
}

/// Which retention phases a record may be in at some moment (near a boundary, two).
#[derive(Debug, Clone, Copy)]
struct Phases {
    /// Within ttl: replayable (or, unknown, run flagged).
    live: bool,
    /// Past ttl, within tombstone-ttl: `key-expired`.
    expired: bool,
    /// Past tombstone-ttl: the key is free again.
    gone: bool,
}

fn phases(at: Duration, now: Duration, ttl: &[Duration], tombstone_ttl: &[Duration]) -> Phases {
    let age = now.saturating_sub(at);
    let min = |v: &[Duration]| v.iter().copied().min().unwrap_or_default();
    let max = |v: &[Duration]| v.iter().copied().max().unwrap_or_default();
    Phases {
        live: age < max(ttl) + MARGIN,
        expired: age + MARGIN > min(ttl) && age < max(tombstone_ttl) + MARGIN,
        gone: age + MARGIN > min(tombstone_ttl),
    }
}

/// What happens to a key when its run ends this way at the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The answer is stored (a status below 500 other than 408, 409, 425, 429).
    Stored(u16),
    /// The key is released: the next run may go unflagged (unless the run was a recovery: see
    /// [`Outcome::after`]).
    Released,
    /// Nobody knows what happened: the next run is flagged recovered.
    Unknown,
}

impl Outcome {
    /// The outcome the design gives a run the upstream treats with `behaviour`.
    pub(crate) fn of(behaviour: Behaviour) -> Self {
        match behaviour {
            Behaviour::Status(code) if code >= 500 || matches!(code, 408 | 409 | 425 | 429) => Self::Released,
            Behaviour::Status(code) => Self::Stored(code),
            Behaviour::HangThenCreated(_) => Self::Stored(201),
            Behaviour::HangUntilDropped | Behaviour::Drop => Self::Unknown,
        }
    }

    /// The outcome of a run that was itself a recovery (`recovered`): a release does not make the
    /// earlier run's effects any better known, so the key stays unknown (the design's settle table).
    pub(crate) fn after(self, recovered: bool) -> Self {
        match self {
            Self::Released if recovered => Self::Unknown,
            outcome => outcome,
        }
    }
}

/// Every key's record, as the design says it is.
#[derive(Debug, Default)]
pub(crate) struct Model {
    records: HashMap<RecordId, Record>,
}

impl Model {
    /// The record of `id`.
    pub(crate) fn record(&self, id: &RecordId) -> Record {
        self.records.get(id).cloned().unwrap_or(Record::Fresh)
    }

    /// Judges a run of a protected request of `id` that reached the upstream at `now`.
    pub(crate) fn judge_run(&self, id: &RecordId, recovered: bool, now: Duration) -> Result<(), String> {
        match self.record(id) {
            Record::Fresh => Ok(()),
            Record::Completed {
                run,
                at,
                ttl,
                tombstone_ttl,
                ..
            } => {
                let p = phases(at, now, &ttl, &tombstone_ttl);
                if p.gone {
                    Ok(())
                } else if p.live {
                    Err(format!(
                        "ran again (recovered: {recovered}) while its answer (run {run}) is replayable"
                    ))
                } else {
                    Err(format!(
                        "ran again (recovered: {recovered}) past its ttl, where its tombstone answers key-expired"
                    ))
                }
            }
            Record::Unknown {
                at,
                ttl,
                tombstone_ttl,
                crashed,
                ..
            } => {
                let p = phases(at, now, &ttl, &tombstone_ttl);
                if p.gone || ((p.live || crashed) && recovered) {
                    Ok(())
                } else if p.live {
                    Err("ran again WITHOUT Idempotency-Recovered after an unknown outcome".to_owned())
                } else if recovered {
                    Err(
                        "ran again (flagged) past the ttl of an unknown outcome, which must answer key-expired"
                            .to_owned(),
                    )
                } else {
                    Err("ran again WITHOUT Idempotency-Recovered past the ttl of an unknown outcome (must be key-expired)".to_owned())
                }
            }
        }
    }

    /// Records the outcome of run `run` of `id`.
    pub(crate) fn ran(
        &mut self,
        id: &RecordId,
        run: u64,
        outcome: Outcome,
        shape: &Shape,
        protection: &Protection,
        now: Duration,
    ) {
        let (ttl, tombstone_ttl) = protection.retention();
        let record = match outcome {
            Outcome::Stored(status) => Record::Completed {
                run,
                status,
                shape: shape.clone(),
                at: now,
                ttl,
                tombstone_ttl,
            },
            Outcome::Released => Record::Fresh,
            Outcome::Unknown => Record::unknown(shape, protection, now, false, false),
        };
        self.records.insert(id.clone(), record);
    }

    /// A recovery of the unknown `id` found the upstream down: the key is released unknown again,
    /// its ttl counted from `now` (the design's settle table keeps a recovered release unknown).
    /// Only a recovery can have found it so: an unknown key past its tombstone was claimed anew,
    /// and that claim, having sent nothing, is forgotten.
    pub(crate) fn released_unknown_again(&mut self, id: &RecordId, now: Duration) {
        let Some(Record::Unknown {
            at,
            ttl,
            tombstone_ttl,
            crashed,
            ..
        }) = self.records.get_mut(id)
        else {
            return;
        };
        let p = phases(*at, now, ttl, tombstone_ttl);
        if p.live || *crashed && !p.gone {
            *at = now;
        } else if p.gone {
            self.records.insert(id.clone(), Record::Fresh);
        }
    }

    /// `idem delete` of `id`: a completed or unknown record is forgotten; one in flight is left
    /// unknown (its holder fenced, the next run flagged).
    pub(crate) fn deleted(&mut self, id: &RecordId, in_flight: Option<(&Shape, &Protection)>, now: Duration) {
        let record = match in_flight {
            None => Record::Fresh,
            Some((shape, protection)) => Record::unknown(shape, protection, now, true, false),
        };
        self.records.insert(id.clone(), record);
    }

    /// The store lost its data: every record is gone, as if never written.
    pub(crate) fn lost(&mut self) {
        self.records.clear();
    }

    /// A gateway was killed while it ran `id`: the outcome is unknown, and the dead holder's lease
    /// holds until it runs out.
    pub(crate) fn holder_killed(&mut self, id: &RecordId, shape: &Shape, protection: &Protection, now: Duration) {
        self.records
            .insert(id.clone(), Record::unknown(shape, protection, now, true, true));
    }

    /// Judges the answer to a protected request of `id` that did not reach the upstream, against
    /// the record as it is after the step. `copies_ran`: another request of the step may have held
    /// the key meanwhile.
    pub(crate) fn judge_unrun_answer(
        &self,
        id: &RecordId,
        shape: &Shape,
        protection: &Protection,
        answer: &Answer,
        in_flight_possible: bool,
        now: Duration,
    ) -> Result<(), String> {
        let record = self.record(id);
        let problem = answer.problem();
        let problem = problem.as_deref();
        if answer.status == 503 && problem == Some("store-unavailable") {
            return Ok(());
        }
        if answer.status == 400 && protection.may_refuse {
            return Ok(());
        }
        match (&record, answer.replayed()) {
            (
                Record::Completed {
                    run,
                    status,
                    shape: stored,
                    at,
                    ttl,
                    tombstone_ttl,
                },
                true,
            ) => {
                let p = phases(*at, now, ttl, tombstone_ttl);
                if answer.run() != Some(*run) || answer.status != *status {
                    return Err(format!(
                        "replayed {} but the key's stored answer is {status} run {run}",
                        answer.summary()
                    ));
                }
                if !stored.reads_as(shape) {
                    return Err(format!(
                        "replayed the answer of another request ({} {} {}) for this one",
                        stored.method, stored.target, stored.body
                    ));
                }
                if !p.live {
                    return Err("replayed an answer past its ttl (must be key-expired)".to_owned());
                }
                Ok(())
            }
            (_, true) => Err(format!(
                "replayed {} but the key has no stored answer ({record:?})",
                answer.summary()
            )),
            (_, false) => {
                let stored = match &record {
                    Record::Fresh => None,
                    Record::Completed {
                        shape,
                        at,
                        ttl,
                        tombstone_ttl,
                        ..
                    }
                    | Record::Unknown {
                        shape,
                        at,
                        ttl,
                        tombstone_ttl,
                        ..
                    } => Some((shape, phases(*at, now, ttl, tombstone_ttl))),
                };
                let held = matches!(record, Record::Unknown { held: true, .. });
                match (answer.status, problem) {
                    (409, Some("key-in-flight")) if in_flight_possible || held => Ok(()),
                    (422, Some("key-mismatch")) => match stored {
                        Some((stored, p)) if stored != shape && (p.live || p.expired) => Ok(()),
                        Some((_, _)) => Err("key-mismatch for the very same request".to_owned()),
                        None => Err(format!("key-mismatch although the key has no record ({record:?})")),
                    },
                    (422, Some("key-expired")) => match stored {
                        Some((_, p)) if p.expired || p.gone => Ok(()),
                        Some(_) => Err(format!("key-expired within the ttl ({record:?})")),
                        None => Err(format!("key-expired although the key has no record ({record:?})")),
                    },
                    _ => Err(format!(
                        "answered {} without running it; the key's record is {record:?}",
                        answer.summary()
                    )),
                }
            }
        }
    }
}

/// Judges the answer to a request that ran at the upstream as `run` with `behaviour`.
pub(crate) fn judge_own_answer(answer: &Answer, run: u64, behaviour: Behaviour) -> Result<(), String> {
    let own = answer.run() == Some(run) && !answer.replayed();
    let fine = match behaviour {
        Behaviour::Status(code) => own && answer.status == code,
        Behaviour::HangThenCreated(_) => answer.status == 504 || (own && answer.status == 201),
        Behaviour::HangUntilDropped => answer.status == 504,
        Behaviour::Drop => answer.status == 502,
    };
    if fine {
        Ok(())
    } else {
        Err(format!(
            "ran as run {run} ({}) but answered {}",
            behaviour.header(),
            answer.summary()
        ))
    }
}
