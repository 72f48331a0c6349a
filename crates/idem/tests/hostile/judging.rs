//! Judging: the rules every answer must keep, and each case's own expectation.

use idem_test_support::wire::{Answer, Ending};

use super::cases::{Expect, KeyClass, Spec};
use super::upstream::gunzip;
use crate::ANSWER_LIMIT;

/// How the test reads an answer, beyond what the wire shows.
pub(crate) trait Reading {
    /// Whether the upstream wrote it (`x-upstream`).
    fn by_upstream(&self) -> bool;
    /// A problem's `type`.
    fn problem_type(&self) -> Option<String>;
    /// What kind of answer it is, for the tally.
    fn label(&self) -> String;
}

impl Reading for Answer {
    fn by_upstream(&self) -> bool {
        self.header("x-upstream").is_some()
    }

    fn problem_type(&self) -> Option<String> {
        let body: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        Some(body.get("type")?.as_str()?.to_owned())
    }

    fn label(&self) -> String {
        match (self.is_problem(), self.problem_type()) {
            (true, Some(kind)) => format!("{} {}", self.status, kind.rsplit(':').next().unwrap_or(&kind)),
            _ if self.by_upstream() => format!("{} upstream", self.status),
            _ if self.replayed() => format!("{} replayed", self.status),
            _ => format!("{} other", self.status),
        }
    }
}

/// The rules for every answer, then the case's expectation.
pub(crate) fn judge(spec: &Spec, answer: Option<&Answer>, ending: &Ending) -> Result<(), String> {
    let Some(answer) = answer else {
        return match ending {
            Ending::TimedOut => Err(format!(
                "no answer and no close within {ANSWER_LIMIT:?}: the gateway hung"
            )),
            Ending::ConnectFailed(err) => Err(format!("could not connect to the gateway: {err}")),
            _ if !spec.http_valid || spec.early_close_ok => Ok(()),
            other => Err(format!("no answer ({other:?}) to a well-formed HTTP/1.1 request")),
        };
    };
    if answer.status >= 500 {
        return Err(format!(
            "a {} answer (nothing here is the upstream's fault)",
            answer.status
        ));
    }
    if !answer.complete && spec.http_valid {
        return Err("the answer's body broke off".into());
    }
    match answer.status {
        200..=299 => {
            if matches!(spec.key, KeyClass::Invalid | KeyClass::Expired) {
                return Err(format!("a request with an {:?} key got a {}", spec.key, answer.status));
            }
            if !answer.by_upstream() {
                return Err("a 2xx that the upstream did not write (a first request cannot be a replay)".into());
            }
        }
        400..=499 => {
            if !answer.is_problem() {
                // hyper's own refusals of a malformed head: 400, 414 or 431 with no content type;
                // or the upstream's answer to a streamed body that broke off.
                let hyper = matches!(answer.status, 400 | 414 | 431) && answer.header("content-type").is_none();
                if spec.http_valid || !(hyper || answer.by_upstream()) {
                    return Err(format!("a {} that is not application/problem+json", answer.status));
                }
            }
        }
        other => return Err(format!("an unexpected {other}")),
    }
    let ok = |cond: bool, what: &str| if cond { Ok(()) } else { Err(format!("expected {what}")) };
    let success = (200..300).contains(&answer.status) && answer.by_upstream();
    match spec.expect {
        Expect::Success => ok(success, "a 2xx from the upstream"),
        Expect::Refused(status) => ok(
            answer.status == status && answer.is_problem(),
            &format!("a {status} problem"),
        ),
        Expect::Either => ok(
            success || answer.is_problem(),
            "a 2xx from the upstream or a 4xx problem",
        ),
        Expect::Anything => Ok(()),
    }
}

/// A replay: 2xx, marked replayed, not from the upstream, its body decoding as its headers say.
pub(crate) fn judge_replay(answer: Option<&Answer>, ending: &Ending, decodes: bool) -> Result<(), String> {
    let Some(answer) = answer else {
        return Err(format!("no answer to the retry ({ending:?})"));
    };
    if !(200..300).contains(&answer.status) || !answer.replayed() || answer.by_upstream() || !answer.complete {
        return Err("expected the retry to be a replay (2xx, Idempotency-Replayed: true)".into());
    }
    if !decodes {
        return Ok(());
    }
    let body = match answer.header("content-encoding").as_deref().map(str::trim) {
        None | Some("") | Some("identity") => Some(answer.body.clone()),
        Some(coding) if coding.eq_ignore_ascii_case("gzip") => gunzip(&answer.body),
        Some(coding) => return Err(format!("a replay in an unexpected coding {coding:?}")),
    };
    match body {
        Some(body) if String::from_utf8_lossy(&body).contains("\"case\"") => Ok(()),
        Some(_) => Err("the replay's body is not the upstream's answer".into()),
        None => Err("the replay's body does not decode as its Content-Encoding says".into()),
    }
}

/// A follow-up that must be answered as `expect` says, and not as a replay.
pub(crate) fn judge_follow_up(expect: Expect, answer: Option<&Answer>, ending: &Ending) -> Result<(), String> {
    let spec = Spec::new(KeyClass::Valid, true, expect);
    judge(&spec, answer, ending)?;
    match answer {
        Some(answer) if answer.replayed() => Err("the follow-up was answered as a replay".into()),
        _ => Ok(()),
    }
}
