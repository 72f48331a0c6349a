//! Running the cases against the gateway and tallying what came back.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_test_support::wire::{self, Answer, Ending, escape};

use super::cases::{Case, Expect, KeyClass, Sending, Then};
use super::generator::target;
use super::judging::{Reading, judge, judge_follow_up, judge_replay};
use crate::ANSWER_LIMIT;
use crate::common::{self, try_send};

/// What every case needs to reach the gateway.
pub(crate) struct Ctx {
    pub(crate) addr: SocketAddr,
    pub(crate) base: String,
    pub(crate) client: reqwest::Client,
    pub(crate) seed: u64,
    /// `IDEM_HOSTILE_VERBOSE=1`: print every case's answers.
    pub(crate) verbose: bool,
}

/// What came back, counted, and the failures found.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) requests: AtomicUsize,
    pub(crate) failures: Mutex<Vec<String>>,
    pub(crate) labels: Mutex<BTreeMap<String, usize>>,
    pub(crate) endings: Mutex<BTreeMap<String, usize>>,
}

impl Tally {
    pub(crate) fn count(&self, answers: &[Answer], ending: &Ending) {
        let mut labels = self.labels.lock().unwrap();
        for answer in answers {
            *labels.entry(answer.label()).or_default() += 1;
        }
        let ending = match ending {
            Ending::Broken(_) => "broken".to_owned(),
            Ending::NotHttp(_) => "not HTTP".to_owned(),
            Ending::ConnectFailed(_) => "connect failed".to_owned(),
            other => format!("{other:?}").to_lowercase(),
        };
        *self.endings.lock().unwrap().entry(ending).or_default() += 1;
    }

    pub(crate) fn fail(
        &self,
        ctx: &Ctx,
        case: &Case,
        step: &str,
        why: String,
        answer: Option<&Answer>,
        ending: &Ending,
    ) {
        let request = match &case.sending {
            Sending::Raw { bytes, half_close } => {
                format!(
                    "{}{}",
                    escape(bytes, 400),
                    if *half_close { " <half-close>" } else { "" }
                )
            }
            Sending::Client { key, body, .. } => format!("reqwest POST /h/{} key {key:?} body {body}", case.id),
        };
        self.failures.lock().unwrap().push(format!(
            "case {} [{}; key {:?}] ({step}): {why}\n    request: {request}\n    answer: {}\n    ending: {ending:?} (seed {})",
            case.id,
            case.what,
            case.specs.iter().map(|s| s.key).collect::<Vec<_>>(),
            answer.map_or_else(|| "none".to_owned(), Answer::describe),
            ctx.seed,
        ));
    }
}

/// Sends a case (and its follow-up) and judges every answer.
pub(crate) async fn run_case(ctx: &Ctx, case: &Case, tally: &Tally) {
    let (answers, ending) = match &case.sending {
        Sending::Raw { bytes, half_close } => exchange(ctx.addr, bytes, *half_close, case.specs.len()).await,
        Sending::Client { key, body, .. } => client_send(ctx, case.id, key, body).await,
    };
    tally.requests.fetch_add(1, Ordering::Relaxed);
    tally.count(&answers, &ending);
    if ctx.verbose {
        let labels: Vec<String> = answers.iter().map(Answer::label).collect();
        let keys: Vec<KeyClass> = case.specs.iter().map(|s| s.key).collect();
        eprintln!(
            "hostile: case {} [{}; key {keys:?}] -> {labels:?} {ending:?}",
            case.id, case.what
        );
    }
    let mut all_good = true;
    for (i, spec) in case.specs.iter().enumerate() {
        if let Err(why) = judge(spec, answers.get(i), &ending) {
            all_good = false;
            tally.fail(ctx, case, &format!("answer {}", i + 1), why, answers.get(i), &ending);
        }
    }
    if !all_good {
        return;
    }
    // A retry is a replay (or a mismatch) only of a first request that ran; an `Either` case may
    // have been refused.
    let ran = answers
        .first()
        .is_some_and(|a| (200..300).contains(&a.status) && a.by_upstream());
    if matches!(case.then, Then::Replay | Then::ReplayAsStored | Then::Mismatch(_)) && !ran {
        return;
    }
    let (step, expect, answers, ending) = match (&case.then, &case.sending) {
        (Then::Nothing, _) => return,
        (Then::Replay, Sending::Raw { bytes, .. }) => {
            let (answers, ending) = exchange(ctx.addr, bytes, false, 1).await;
            ("replay", None, answers, ending)
        }
        (Then::ReplayAsStored, Sending::Raw { bytes, .. }) => {
            let (answers, ending) = exchange(ctx.addr, bytes, false, 1).await;
            (
                "replay of an answer that does not decode",
                Some(Expect::Success),
                answers,
                ending,
            )
        }
        (Then::ReplayAsStored, Sending::Client { .. }) => unreachable!("only raw cases replay broken codings"),
        (Then::Replay, Sending::Client { key, retry, .. }) => {
            let (answers, ending) = client_send(ctx, case.id, key, retry).await;
            ("replay", None, answers, ending)
        }
        (Then::Mismatch(bytes), Sending::Raw { .. }) => {
            let (answers, ending) = exchange(ctx.addr, bytes, false, 1).await;
            ("mismatch", Some(Expect::Refused(422)), answers, ending)
        }
        (Then::Mismatch(_), Sending::Client { key, retry, .. }) => {
            let (answers, ending) = client_send(ctx, case.id, key, retry).await;
            ("mismatch", Some(Expect::Refused(422)), answers, ending)
        }
        (Then::Unclaimed(bytes), _) => {
            let (answers, ending) = exchange(ctx.addr, bytes, false, 1).await;
            (
                "whole retry after a broken body",
                Some(Expect::Success),
                answers,
                ending,
            )
        }
    };
    tally.requests.fetch_add(1, Ordering::Relaxed);
    tally.count(&answers, &ending);
    let verdict = match expect {
        None => judge_replay(answers.first(), &ending, true),
        Some(_) if matches!(case.then, Then::ReplayAsStored) => judge_replay(answers.first(), &ending, false),
        Some(expect) => judge_follow_up(expect, answers.first(), &ending),
    };
    if let Err(why) = verdict {
        tally.fail(ctx, case, step, why, answers.first(), &ending);
    }
}

/// Sends a well-formed keyed JSON `POST` for case `id` through reqwest.
pub(crate) async fn client_send(ctx: &Ctx, id: u64, key: &str, body: &str) -> (Vec<Answer>, Ending) {
    let request = ctx
        .client
        .post(format!("{}{}", ctx.base, target(id)))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned());
    match try_send(request).await {
        Ok(reply) => (vec![from_reply(reply)], Ending::Answered),
        Err(err) => (Vec::new(), Ending::Broken(err)),
    }
}

/// Whether the process is alive (not a zombie), where `/proc` can tell.
pub(crate) fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| !matches!(state, 'Z' | 'X')),
        Err(_) => !cfg!(target_os = "linux"),
    }
}

/// A reqwest reply, as if read off the wire.
pub(crate) fn from_reply(reply: common::Reply) -> Answer {
    Answer {
        status: reply.status,
        headers: reply
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect(),
        body: reply.body.to_vec(),
        complete: true,
    }
}

/// Writes `bytes` on a new connection (half-closing after them if asked) while reading, until
/// `want` answers came, the server closed, or [`ANSWER_LIMIT`] passed.
pub(crate) async fn exchange(addr: SocketAddr, bytes: &[u8], half_close: bool, want: usize) -> (Vec<Answer>, Ending) {
    wire::exchange(addr, bytes, half_close, want, ANSWER_LIMIT).await
}
