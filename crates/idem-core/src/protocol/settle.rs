//! After the handler: how a run ended decides what becomes of its record and what the client gets.
//!
//! This is the second half of the outcome table (the first is [`Protocol::begin`]). The tower
//! layer and the gateway only report how a run ended, as a [`RunEnd`]; [`Protocol::settle`]
//! answers with a [`Settlement`], and they carry it out. Every problem a run can end in is made
//! here, so a rule about releases, tombstones or checkpoints is written once.
//!
//! | how the run ended | the record | the client gets |
//! |---|---|---|
//! | answered, status stored by the policy | stored (compact if the body is over `max_stored_body`) | the answer |
//! | answered, status released (5xx, 408, 409, 425, 429) | released | the answer |
//! | nothing sent (the upstream refused the connection) | released | `502 upstream-unavailable` |
//! | the caller left before anything ran | released | nothing (nobody is listening) |
//! | sent, no answer (connection lost, body broke, handler error) | unknown | `502 upstream-failed` / the error |
//! | the handler panicked | unknown | `500 internal-error` |
//! | the run passed `run_timeout` | unknown | `504 upstream-timeout` + `Retry-After` |
//!
//! *Released* means forgotten, so that the retry runs again as new, unless the run may already
//! have had effects that a plain re-run would repeat: a run that recorded a checkpoint, or a
//! recovered run (the effects of the run before it are still unknown). Such a release keeps the
//! record as *unknown* — its checkpoints with it — so the retry resumes after the last recorded
//! step and is marked recovered.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};

use super::in_transaction::claim_lost;
use super::{Claim, Outcome, Protocol};
use crate::policy::Policy;
use crate::problem::{Problem, ProblemKind};
use crate::store::{ClaimState, Release, StoreError, StoreOperation};
use crate::time::UnixMillis;

/// Put into a response's extensions by an inner service whose response is not the handler's
/// answer, such as a proxy that could not reach its upstream; [`Protocol::settle`] (or
/// [`no_answer_problem`] for a request outside the protocol) turns it into the client's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoAnswer {
    /// Nothing was sent (the connection was refused or failed before the request went out): the
    /// request can be run again as if new. `cause` says why, for the client's detail.
    NotSent {
        /// Why, in words.
        cause: String,
    },
    /// The request was sent but no answer came back: whether it took effect is unknown.
    OutcomeUnknown {
        /// Why, in words.
        cause: String,
    },
    /// The client's own body broke off while it was being forwarded (only a request outside the
    /// protocol can get here: a keyed body is read whole before anything is sent).
    ClientBodyBroke {
        /// Why, in words.
        cause: String,
    },
    /// No answer within `after` (the limit of a request outside the protocol).
    TimedOut {
        /// The limit that passed.
        after: Duration,
    },
}

/// How a run under a claim ended, as the layer or the gateway saw it.
#[derive(Debug, Clone, Copy)]
pub enum RunEnd<'a> {
    /// The handler answered with this status; its body is `body_len` bytes long if declared.
    Answered {
        /// The answer's status.
        status: StatusCode,
        /// The body's declared length (`None`: not known in advance, as for a chunked body).
        body_len: Option<usize>,
    },
    /// The inner service answered, but not with the handler's answer.
    NoAnswer(&'a NoAnswer),
    /// The inner service returned an error instead of a response (it may have acted).
    HandlerFailed,
    /// The handler panicked (it may have acted).
    Panicked,
    /// The run passed the policy's `run_timeout` and was given up.
    TimedOut,
    /// The answer's body failed before it was complete.
    AnswerBroke,
    /// The caller hung up after the claim was made and before anything ran.
    CallerLeft,
    /// The handler answered on a route whose runs complete in their own transaction, and this is
    /// where its claim stands now ([`Protocol::confirm`]): completed if that transaction committed.
    /// `marked`: the answer says it was completed so
    /// ([`CompletedInTransaction`](super::CompletedInTransaction)); an unmarked one is an answer
    /// of a run declared to complete in its transaction that did not (a validation error, or an
    /// upstream that rolled back).
    AnsweredInTransaction {
        /// The answer was completed in the handler's transaction, by its own account.
        marked: bool,
        /// Where the claim stands.
        state: Result<ClaimState, &'a StoreError>,
    },
}

/// What becomes of the record of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Store the answer whole if its body turns out to fit `max_stored_body` (read it up to that
    /// limit), else compact.
    Store,
    /// Store only the answer's head: its body is declared larger than `max_stored_body`.
    StoreCompact,
    /// Release the record this way ([`Protocol::release`]).
    Release(Release),
    /// Leave the record as it is: its answer was stored by the run's own transaction, or it is
    /// not this run's any more, or where it stands could not be read (then its lease runs out).
    Leave,
}

/// What the client gets.
#[derive(Debug)]
pub enum Reply {
    /// The handler's own answer (or error).
    Handler,
    /// This problem instead.
    Problem(Response<Bytes>),
}

/// What [`Protocol::settle`] decided for a run.
#[derive(Debug)]
#[must_use = "a settlement is carried out by the caller"]
pub struct Settlement {
    /// What becomes of the record.
    pub keep: Keep,
    /// What the client gets.
    pub reply: Reply,
    /// How the request is logged and counted.
    pub outcome: Outcome,
    /// The status the client gets (for logs), when it is not the handler's own.
    pub status: Option<StatusCode>,
    /// The problem of [`Reply::Problem`], to be said again if the release finds the claim
    /// elsewhere ([`Protocol::release_settled`]).
    problem: Option<Problem>,
}

impl Settlement {
    fn answer(keep: Keep, run: Run) -> Self {
        Self {
            keep,
            reply: Reply::Handler,
            outcome: run.outcome,
            status: None,
            problem: None,
        }
    }

    fn problem(keep: Keep, problem: Problem, outcome: Outcome) -> Self {
        Self {
            keep,
            status: Some(problem.kind.status()),
            reply: Reply::Problem(problem.to_response()),
            outcome,
            problem: Some(problem),
        }
    }
}

/// Where an in-transaction run's claim was found when its release changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// Its transaction is still open (the store did not wait for it).
    Open,
    /// Its transaction committed the answer.
    Committed,
    /// Another run took the key over, or it was deleted.
    Lost,
}

/// The problem of a run given up (`given_up`: what the settlement would have said) whose claim
/// turned out to stand as `found`.
fn said_again(given_up: &Problem, found: Found, retry_after: Duration) -> Problem {
    let lead = given_up
        .detail
        .split_once("; ")
        .map_or(given_up.detail.as_str(), |(lead, _)| lead);
    let now = match found {
        Found::Lost => return claim_lost().retry_after(retry_after),
        Found::Committed => "but its transaction committed its answer: retry with the same key to receive it",
        Found::Open => {
            "its transaction was still open: if it commits, a retry with the same key receives its answer; if it does not, the retry runs the request again"
        }
    };
    Problem::new(given_up.kind, format!("{lead}; {now}")).retry_after(retry_after)
}

/// What settling needs to know of a run besides how it ended.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// An earlier run of the key may have had effects.
    recovered: bool,
    /// This run recorded a checkpoint.
    stepped: bool,
    /// This run keeps its every effect in the transaction that completes its record, and is not
    /// a recovered run ([`FencingToken::in_transaction`](crate::store::FencingToken::in_transaction)).
    in_transaction: bool,
    /// How the run is logged when it answered.
    outcome: Outcome,
    /// The window of a provisional key.
    provisional: Option<Duration>,
}

impl Protocol {
    /// Decides, from how a run under `claim` ended, what becomes of its record and what the client
    /// gets. Nothing is done here: the caller carries the [`Settlement`] out (stores the answer,
    /// or [`release`](Self::release)s the record with the [`Keep::Release`] given).
    pub fn settle(&self, claim: &Claim, end: RunEnd<'_>) -> Settlement {
        let run = Run {
            recovered: claim.recovered(),
            stepped: claim.stepped(),
            in_transaction: claim.token().in_transaction(),
            outcome: claim.outcome(),
            provisional: claim.provisional(),
        };
        decide(self.policy(), self.now(), run, end)
    }

    /// Gives the claim up as `release` says ([`Keep::Release`]).
    pub async fn release(&self, claim: &Claim, release: Release) -> Result<(), StoreError> {
        self.bounded(
            StoreOperation::Release,
            self.store().release(claim.id(), claim.token(), release),
        )
        .await
    }

    /// Carries out the release `settlement` asks for, if any ([`Keep::Release`]), and returns
    /// the settlement to answer with.
    ///
    /// A run that completes in its own transaction may be given up (its run timeout, its caller
    /// gone) while that transaction is still open. Its release then changes nothing: the store
    /// does not wait for the transaction ([`StoreError::Locked`]), or finds the claim completed
    /// by it or taken over ([`StoreError::Fenced`]). The problem the client gets is then said
    /// again from where the claim stands: its answer committed (the retry replays it), its
    /// transaction still open (the retry replays it if it commits, and runs again if it does
    /// not), or the key another run's. A release that fails otherwise leaves the record in
    /// flight until its lease ends; the settlement is answered as it is.
    pub async fn release_settled(&self, claim: &Claim, mut settlement: Settlement) -> Settlement {
        let Keep::Release(release) = settlement.keep else {
            return settlement;
        };
        let (scope, key) = (&claim.id().scope, &claim.id().key);
        let found = match self.release(claim, release).await {
            Ok(()) => return settlement,
            Err(StoreError::Locked) => Found::Open,
            Err(StoreError::Fenced) => match self.confirm(claim).await {
                Ok(ClaimState::Completed) => Found::Committed,
                Ok(ClaimState::Ended) => Found::Lost,
                Ok(ClaimState::Current) | Err(_) => {
                    tracing::warn!(%scope, %key, "the record was not released: its claim changed");
                    return settlement;
                }
            },
            Err(err) => {
                // The record stays in flight until its lease ends; then a retry takes it over,
                // marked recovered (or unmarked if nothing of an in-transaction run stands).
                tracing::error!(%scope, %key, error = %err, "could not release the record");
                return settlement;
            }
        };
        tracing::info!(%scope, %key, found = ?found, "the run's release changed nothing: its claim was found elsewhere");
        if let Some(problem) = settlement.problem.as_ref().filter(|_| claim.token().in_transaction()) {
            let problem = said_again(problem, found, self.policy().retry_after);
            settlement.status = Some(problem.kind.status());
            settlement.reply = Reply::Problem(problem.to_response());
            settlement.problem = Some(problem);
        }
        settlement.keep = Keep::Leave;
        settlement
    }

    /// The answer to a client whose request is still running after the layer's response timeout:
    /// `504` with `Retry-After`; the run goes on and its answer is kept for the retry.
    pub fn still_running(&self, waited: Duration) -> Response<Bytes> {
        let retry_after = self.policy().retry_after;
        let detail = format!(
            "no answer within {}; the request is still running and its answer will be kept: retry in {} s with the same key to receive it",
            seconds(waited),
            retry_after.as_secs().max(1)
        );
        Problem::new(ProblemKind::UpstreamTimeout, detail)
            .retry_after(retry_after)
            .to_response()
    }

    /// `413`: a keyed request's body is over `max_body`; nothing was claimed.
    pub fn body_too_large(&self) -> (Problem, Outcome) {
        let limit = self.policy().max_body;
        let problem = Problem::new(
            ProblemKind::BodyTooLarge,
            format!("the body of a request with an idempotency key may be at most {limit} bytes"),
        );
        (problem, Outcome::TooLarge)
    }
}

/// The after-the-handler table (see the module's doc), as a pure function of the policy, the
/// time on the store's clock, the run and how it ended.
fn decide(policy: &Policy, now: UnixMillis, run: Run, end: RunEnd<'_>) -> Settlement {
    // Kept as unknown: the next run within `ttl` is marked recovered; after it the key is
    // expired until its tombstone ends, as an answered key is.
    let (expires_at, purge_at) = policy.retention(now, run.provisional);
    let kept_unknown = Keep::Release(Release::Unknown { expires_at, purge_at });
    // A run that had no effect of its own is forgotten, so the retry runs as new — unless an
    // effect may stand from before (a recorded checkpoint, or the unknown outcome of the run this
    // one recovered from), which a plain re-run would repeat unflagged: then the record stays
    // unknown, its checkpoints kept.
    let released = if run.recovered || run.stepped {
        kept_unknown
    } else {
        Keep::Release(Release::Forget)
    };
    // An in-transaction run that ends without having completed had no effect either: its
    // transaction did not commit the answer, so it committed nothing, and once the release has
    // changed the claim it never can (its completion checks the token under the record's lock).
    let unknown = if run.in_transaction { released } else { kept_unknown };
    match end {
        RunEnd::Answered { status, body_len } => {
            let keep = if !policy.stores(status) {
                released
            } else if body_len.is_some_and(|len| len > policy.max_stored_body) {
                Keep::StoreCompact
            } else {
                Keep::Store
            };
            Settlement::answer(keep, run)
        }
        RunEnd::NoAnswer(NoAnswer::NotSent { cause }) => Settlement::problem(released, not_sent(cause), run.outcome),
        RunEnd::NoAnswer(NoAnswer::OutcomeUnknown { cause } | NoAnswer::ClientBodyBroke { cause }) => {
            Settlement::problem(unknown, outcome_unknown(cause), run.outcome)
        }
        // Keyed runs are bounded by `run_timeout`, not by the unkeyed limit; should an inner
        // service still give up on its own, whether the request took effect is unknown.
        RunEnd::NoAnswer(NoAnswer::TimedOut { after }) => {
            Settlement::problem(unknown, upstream_timed_out(*after, policy.retry_after), run.outcome)
        }
        RunEnd::HandlerFailed => Settlement::answer(unknown, run),
        RunEnd::Panicked => Settlement::problem(unknown, internal_error(), Outcome::Internal),
        RunEnd::TimedOut => {
            let what_now = if unknown == kept_unknown {
                "whether it took effect is unknown: retry with the same key (the retry is marked recovered)"
            } else {
                "it did not complete, so nothing of it stands: retry with the same key"
            };
            let detail = format!(
                "the request ran longer than {} and was given up; {what_now}",
                seconds(policy.run_timeout)
            );
            let problem = Problem::new(ProblemKind::UpstreamTimeout, detail).retry_after(policy.retry_after);
            Settlement::problem(unknown, problem, Outcome::RunTimedOut)
        }
        RunEnd::AnswerBroke => {
            let detail = if unknown == kept_unknown {
                "the answer was lost before it was complete; retry with the same key (the retry is marked recovered)"
            } else {
                "the answer was lost before it was complete; retry with the same key"
            };
            Settlement::problem(unknown, Problem::new(ProblemKind::UpstreamFailed, detail), run.outcome)
        }
        RunEnd::CallerLeft => Settlement::answer(released, run),
        RunEnd::AnsweredInTransaction {
            state: Ok(ClaimState::Completed),
            ..
        } => Settlement::answer(Keep::Leave, run),
        // The handler answered as if its transaction had committed, but it did not: nothing of it
        // stands.
        RunEnd::AnsweredInTransaction {
            marked: true,
            state: Ok(ClaimState::Current),
        } => {
            let detail =
                "the request's transaction did not commit, so it had no effect; send it again with the same key";
            Settlement::problem(unknown, Problem::new(ProblemKind::Internal, detail), Outcome::Internal)
        }
        // Answered without completing: the run is declared to have no effect outside the
        // transaction that completes, so nothing of it stands. The answer is passed on, not stored
        // (storing it would replay a success whose writes rolled back), and the retry runs again.
        RunEnd::AnsweredInTransaction {
            marked: false,
            state: Ok(ClaimState::Current),
        } => Settlement::answer(released, run),
        // Taken over (its lease ran out) or deleted while it ran: its transaction could not commit,
        // and the run that holds the key now answers.
        RunEnd::AnsweredInTransaction {
            state: Ok(ClaimState::Ended),
            ..
        } => Settlement::problem(Keep::Leave, claim_lost().retry_after(policy.retry_after), run.outcome),
        // Committed or not, the record tells the retry: replayed, or (the lease run out, nothing
        // of it standing) run again.
        RunEnd::AnsweredInTransaction { state: Err(err), .. } => {
            let detail = format!(
                "the request ran, but whether its transaction committed could not be read ({err}); retry with the same key"
            );
            let problem = Problem::new(ProblemKind::StoreUnavailable, detail).retry_after(policy.retry_after);
            Settlement::problem(Keep::Leave, problem, Outcome::StoreError)
        }
    }
}

/// `400 body-incomplete`: a keyed request's body broke off before it was read whole; nothing was
/// claimed.
pub fn body_incomplete(cause: &dyn std::fmt::Display) -> (Problem, Outcome) {
    let problem = Problem::new(
        ProblemKind::BodyIncomplete,
        format!(
            "the request body broke off before it was complete ({cause}); nothing was processed, send the request again"
        ),
    );
    (problem, Outcome::BodyIncomplete)
}

/// The answer to a request outside the protocol (no key, a pass-through route) whose inner
/// service reported [`NoAnswer`]; `retry_after` is the policy's.
pub fn no_answer_problem(no_answer: &NoAnswer, retry_after: Duration) -> Response<Bytes> {
    match no_answer {
        NoAnswer::NotSent { cause } => not_sent(cause),
        NoAnswer::OutcomeUnknown { cause } => outcome_unknown(cause),
        // The client's fault, not the upstream's: no 5xx that would page someone about the upstream.
        NoAnswer::ClientBodyBroke { cause } => Problem::new(
            ProblemKind::BodyIncomplete,
            format!("the request body broke off before it was complete ({cause}); send the request again"),
        ),
        NoAnswer::TimedOut { after } => upstream_timed_out(*after, retry_after),
    }
    .to_response()
}

/// `500 internal-error`: a bug in the request's path, said as a problem rather than an empty answer.
pub fn internal_error() -> Problem {
    let detail = "the idempotency layer failed unexpectedly (a bug, logged); if the request was keyed, retry it with the same key: a run that may have had effects is marked recovered";
    Problem::new(ProblemKind::Internal, detail)
}

fn not_sent(cause: &str) -> Problem {
    Problem::new(
        ProblemKind::UpstreamUnavailable,
        format!("the upstream could not be reached ({cause}); nothing was sent, retry with the same key"),
    )
}

fn outcome_unknown(cause: &str) -> Problem {
    let detail = format!(
        "the connection to the upstream was lost after the request was sent ({cause}), so whether it took effect is unknown; retry with the same key (the upstream is told the retry is a recovery)"
    );
    Problem::new(ProblemKind::UpstreamFailed, detail)
}

fn upstream_timed_out(after: Duration, retry_after: Duration) -> Problem {
    let detail = format!("the upstream did not answer within {}", seconds(after));
    Problem::new(ProblemKind::UpstreamTimeout, detail).retry_after(retry_after)
}

fn seconds(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW_MS: i64 = 1_000_000;

    fn run(recovered: bool, stepped: bool) -> Run {
        Run {
            recovered,
            stepped,
            in_transaction: false,
            outcome: if recovered { Outcome::Recovered } else { Outcome::New },
            provisional: None,
        }
    }

    fn answered(status: u16, body_len: Option<usize>) -> RunEnd<'static> {
        RunEnd::Answered {
            status: StatusCode::from_u16(status).unwrap(),
            body_len,
        }
    }

    fn unknown(policy: &Policy) -> Keep {
        let now = UnixMillis::from_i64(NOW_MS);
        Keep::Release(Release::Unknown {
            expires_at: now.plus(policy.ttl),
            purge_at: now.plus(policy.tombstone_ttl.max(policy.ttl)),
        })
    }

    const FORGET: Keep = Keep::Release(Release::Forget);

    /// How a run that ended so is settled at `NOW_MS`.
    fn settle(policy: &Policy, run: Run, end: RunEnd<'_>) -> Settlement {
        decide(policy, UnixMillis::from_i64(NOW_MS), run, end)
    }

    #[test]
    fn every_ending_of_a_run_is_settled_as_the_table_says() {
        let policy = Policy::default();
        let not_sent = NoAnswer::NotSent {
            cause: "refused".into(),
        };
        let lost = NoAnswer::OutcomeUnknown { cause: "reset".into() };
        let broke = NoAnswer::ClientBodyBroke { cause: "eof".into() };
        let timed_out = NoAnswer::TimedOut {
            after: Duration::from_secs(3),
        };
        let big = policy.max_stored_body + 1;
        // (ending, keep for a fresh run, the client's problem status if not the handler's)
        let table: Vec<(RunEnd<'_>, Keep, Option<u16>)> = vec![
            (answered(200, Some(10)), Keep::Store, None),
            (answered(201, None), Keep::Store, None),
            (answered(404, Some(0)), Keep::Store, None),
            (answered(200, Some(big)), Keep::StoreCompact, None),
            (answered(500, Some(0)), FORGET, None),
            (answered(503, None), FORGET, None),
            (answered(408, None), FORGET, None),
            (answered(409, None), FORGET, None),
            (answered(425, None), FORGET, None),
            (answered(429, None), FORGET, None),
            (RunEnd::NoAnswer(&not_sent), FORGET, Some(502)),
            (RunEnd::NoAnswer(&lost), unknown(&policy), Some(502)),
            (RunEnd::NoAnswer(&broke), unknown(&policy), Some(502)),
            (RunEnd::NoAnswer(&timed_out), unknown(&policy), Some(504)),
            (RunEnd::HandlerFailed, unknown(&policy), None),
            (RunEnd::Panicked, unknown(&policy), Some(500)),
            (RunEnd::TimedOut, unknown(&policy), Some(504)),
            (RunEnd::AnswerBroke, unknown(&policy), Some(502)),
            (RunEnd::CallerLeft, FORGET, None),
        ];
        for (end, keep, status) in table {
            let settled = settle(&policy, run(false, false), end);
            assert_eq!(settled.keep, keep, "{end:?}");
            assert_eq!(settled.status.map(|s| s.as_u16()), status, "{end:?}");
            match (&settled.reply, status) {
                (Reply::Handler, None) => {}
                (Reply::Problem(response), Some(status)) => assert_eq!(response.status().as_u16(), status),
                (reply, _) => panic!("{end:?}: {reply:?}"),
            }
        }
    }

    #[test]
    fn a_release_never_forgets_an_effect_that_may_stand() {
        let policy = Policy::default();
        let not_sent = NoAnswer::NotSent {
            cause: "refused".into(),
        };
        for (recovered, stepped) in [(true, false), (false, true), (true, true)] {
            for end in [
                answered(500, None),
                answered(429, None),
                RunEnd::NoAnswer(&not_sent),
                RunEnd::CallerLeft,
            ] {
                let settled = settle(&policy, run(recovered, stepped), end);
                assert_eq!(
                    settled.keep,
                    unknown(&policy),
                    "recovered {recovered}, stepped {stepped}: {end:?} keeps the record unknown"
                );
            }
            // What is stored is stored, whatever came before.
            let settled = settle(&policy, run(recovered, stepped), answered(200, Some(1)));
            assert_eq!(settled.keep, Keep::Store);
        }
    }

    #[test]
    fn an_in_transaction_run_that_did_not_complete_is_forgotten_unless_an_effect_may_stand() {
        let policy = Policy::default();
        let lost = NoAnswer::OutcomeUnknown { cause: "reset".into() };
        let endings = [
            RunEnd::NoAnswer(&lost),
            RunEnd::HandlerFailed,
            RunEnd::Panicked,
            RunEnd::TimedOut,
            RunEnd::AnswerBroke,
            answered(500, None),
        ];
        for end in endings {
            let in_transaction = Run {
                in_transaction: true,
                ..run(false, false)
            };
            let settled = settle(&policy, in_transaction, end);
            assert_eq!(settled.keep, FORGET, "{end:?}: its transaction committed nothing");
            let stepped = Run {
                in_transaction: true,
                ..run(false, true)
            };
            let settled = settle(&policy, stepped, end);
            assert_eq!(settled.keep, unknown(&policy), "{end:?}: a recorded step stands");
        }
    }

    #[test]
    fn store_5xx_keeps_server_errors() {
        let policy = Policy {
            store_5xx: true,
            ..Policy::default()
        };
        let settled = settle(&policy, run(false, false), answered(500, Some(3)));
        assert_eq!(settled.keep, Keep::Store);
    }

    #[test]
    fn answers_outside_the_protocol_say_what_happened() {
        let retry = Duration::from_secs(2);
        let cases = [
            (
                NoAnswer::NotSent {
                    cause: "refused".into(),
                },
                502,
                "upstream-unavailable",
            ),
            (
                NoAnswer::OutcomeUnknown { cause: "reset".into() },
                502,
                "upstream-failed",
            ),
            (
                NoAnswer::ClientBodyBroke { cause: "eof".into() },
                400,
                "body-incomplete",
            ),
            (
                NoAnswer::TimedOut {
                    after: Duration::from_secs(3),
                },
                504,
                "upstream-timeout",
            ),
        ];
        for (no_answer, status, name) in cases {
            let response = no_answer_problem(&no_answer, retry);
            assert_eq!(response.status().as_u16(), status, "{no_answer:?}");
            let body = String::from_utf8(response.body().to_vec()).unwrap();
            assert!(body.contains(name), "{no_answer:?}: {body}");
        }
        let timed_out = no_answer_problem(
            &NoAnswer::TimedOut {
                after: Duration::from_secs(3),
            },
            retry,
        );
        assert_eq!(timed_out.headers()["retry-after"], "2");
    }

    /// A run given up whose release found its claim elsewhere is told where: its status kept,
    /// its first clause kept, the rest said again.
    #[test]
    fn a_given_up_run_is_told_where_its_claim_stands() {
        let given_up = Problem::new(
            ProblemKind::UpstreamTimeout,
            "the request ran longer than 2.0 s and was given up; it did not complete, so nothing of it stands: retry with the same key",
        );
        let retry = Duration::from_secs(3);
        for (found, says) in [
            (Found::Open, "its transaction was still open: if it commits"),
            (Found::Committed, "but its transaction committed its answer"),
        ] {
            let problem = said_again(&given_up, found, retry);
            assert_eq!(problem.kind, ProblemKind::UpstreamTimeout);
            assert!(
                problem
                    .detail
                    .starts_with("the request ran longer than 2.0 s and was given up; "),
                "{problem:?}"
            );
            assert!(problem.detail.contains(says), "{problem:?}");
            assert!(!problem.detail.contains("nothing of it stands"), "{problem:?}");
            assert_eq!(problem.retry_after, Some(retry));
        }
        let lost = said_again(&given_up, Found::Lost, retry);
        assert_eq!(lost.kind, ProblemKind::KeyInFlight);
    }
}
