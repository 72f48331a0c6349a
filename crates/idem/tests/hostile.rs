//! Hostile traffic against a real `idem serve`: several thousand generated requests, most of them
//! malformed or hostile (written byte by byte over TCP), with well-formed keyed requests interleaved.
//!
//! What must hold, whatever the input:
//! * the gateway stays up and still answers a well-formed keyed request (201, then a replay);
//! * no 5xx: the upstream here never fails, so a 502/503/504 would be the gateway's fault, and a 500
//!   is always a bug; every 4xx that idem writes is `application/problem+json`;
//! * nothing with an invalid idempotency key reaches the upstream: the upstream records the key
//!   headers it receives, every one must parse as a valid key, and no request generated with an
//!   invalid key may arrive at all.
//!
//! The generator is seeded: the seed is printed, and `IDEM_HOSTILE_SEED=<seed>` replays a run.
//! Every request carries its case number in its path (`/h/<case>`), so the upstream's log can be
//! matched with the cases.
//!
//! Which answers are acceptable is decided per case. A request that is a complete, well-formed
//! HTTP/1.1 message ("HTTP-valid") must get an answer. A request that is malformed at the HTTP/1.1
//! level (a control byte in a header value, bogus framing, a body that breaks off, a broken request
//! line, …) is "HTTP-dubious": hyper may refuse it with its own bare `400`/`414`/`431` (no body, no
//! content type) or close the connection without a word, and both are acceptable; a problem
//! answer from idem is acceptable too. For HTTP-valid requests a closed connection without an
//! answer is a failure, except where the client sends a body the gateway is entitled not to read
//! (a refused key with a large body, a body over `--max-body`): there the server may answer early
//! and close, and the kernel's reset can eat the answer. A client that half-closes its side after a
//! request is dubious too: hyper's default (`half_close(false)`) drops such a connection when it
//! reads the end of input, possibly before the answer is written, so only bodies that break off are
//! sent that way.
//!
//! Invalid keys are sent only with `POST` and `PATCH`, the methods idem protects by default; other
//! methods pass through untouched by design. A body that breaks off is the client's fault, keyed or
//! not, so it must not be answered with a 5xx either.
//!
//! The upstream also plays hostile for replays: some of its answers are labelled with a
//! `Content-Encoding` their bytes are not in, or are a decompression bomb; their replays, to
//! clients that do or do not accept the coding, must still be replays and never a 5xx.

mod common;

/// The test's parts, in `tests/hostile/`: the seeded generator and its cases, the generators of
/// hostile requests, the independent key oracle, the recording upstream, judging and running.
mod hostile {
    pub(crate) mod cases;
    pub(crate) mod framing;
    pub(crate) mod generator;
    pub(crate) mod judging;
    pub(crate) mod keys;
    pub(crate) mod messages;
    pub(crate) mod oracle;
    pub(crate) mod running;
    pub(crate) mod upstream;
}

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Gateway, try_send};
use hostile::cases::Reach;
use hostile::framing::{chunked_bodies, content_lengths, hostile_bodies, huge_heads};
use hostile::generator::{Gen, Rng, seed};
use hostile::keys::{key_bytes, key_fuzz, key_shapes, repeated_headers};
use hostile::messages::{accept_encodings, odd_headers, request_lines, well_formed};
use hostile::oracle::{key_is_valid, library_accepts};
use hostile::running::{Ctx, Tally, alive, run_case};
use hostile::upstream::{check_the_upstream_log, start_upstream};
use idem_test_support::wire::escape;

/// Requests in flight at once.
const CONCURRENCY: usize = 32;
/// How long one exchange may take before the gateway counts as hung.
pub(crate) const ANSWER_LIMIT: Duration = Duration::from_secs(20);
/// The gateway's default `--max-body`.
pub(crate) const MAX_BODY: usize = 1024 * 1024;
/// The key header.
pub(crate) const KEY: &str = "idempotency-key";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_never_crash_the_gateway_nor_reach_the_upstream_with_an_invalid_key() {
    let seed = seed();
    eprintln!("hostile: seed {seed} (replay this run with IDEM_HOSTILE_SEED={seed})");
    let started = Instant::now();
    let (upstream_url, log, _upstream) = start_upstream().await;
    check_the_upstream_log(&upstream_url, &log).await;
    let gw = Gateway::start(&upstream_url, &[]).await;

    let mut g = Gen {
        rng: Rng(seed),
        next: 0,
        cases: Vec::new(),
    };
    key_bytes(&mut g);
    key_shapes(&mut g);
    key_fuzz(&mut g, 1500);
    repeated_headers(&mut g);
    huge_heads(&mut g);
    content_lengths(&mut g);
    chunked_bodies(&mut g);
    hostile_bodies(&mut g);
    accept_encodings(&mut g);
    odd_headers(&mut g);
    request_lines(&mut g);
    well_formed(&mut g, 800);
    let mut cases = std::mem::take(&mut g.cases);
    g.rng.shuffle(&mut cases);
    let expected_reach: Vec<(u64, Reach, usize)> = cases
        .iter()
        .enumerate()
        .flat_map(|(i, case)| case.reach.iter().map(move |&(id, reach)| (id, reach, i)))
        .collect();
    eprintln!("hostile: {} cases generated in {:?}", cases.len(), started.elapsed());

    let ctx = Arc::new(Ctx {
        addr: gw.addr(),
        base: gw.base.clone(),
        client: gw.client.clone(),
        seed,
        verbose: std::env::var_os("IDEM_HOSTILE_VERBOSE").is_some(),
    });
    let cases = Arc::new(cases);
    let tally = Arc::new(Tally::default());
    let next = Arc::new(AtomicU64::new(0));
    let sending = Instant::now();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (ctx, cases, tally, next) = (ctx.clone(), cases.clone(), tally.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some(case) = cases.get(i) else { break };
                    run_case(&ctx, case, &tally).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("a worker panicked");
    }
    let sent = tally.requests.load(Ordering::Relaxed);
    eprintln!(
        "hostile: {sent} requests answered or refused in {:?}",
        sending.elapsed()
    );

    // 1. The gateway is still up and still does its job.
    let pid = gw.pid();
    let mut failures = std::mem::take(&mut *tally.failures.lock().unwrap());
    if !alive(pid) {
        failures.push(format!("the gateway process {pid} died"));
    }
    let final_key = common::new_key();
    let final_body = r#"{"amount":1,"currency":"EUR"}"#;
    match try_send(gw.keyed("/h/0/final", &final_key, final_body)).await {
        Ok(first) if first.status == 201 && !first.replayed() => {
            match try_send(gw.keyed("/h/0/final", &final_key, final_body)).await {
                Ok(second) if second.status == 201 && second.replayed() && second.body == first.body => {}
                other => failures.push(format!("the final retry was not a replay: {other:?}")),
            }
        }
        other => failures.push(format!("the final well-formed request did not get 201: {other:?}")),
    }
    let stderr = gw.stderr();
    if let Some(at) = stderr.find("panicked") {
        let from = stderr[..at].rfind('\n').map_or(0, |i| i + 1);
        let line = stderr[from..].lines().next().unwrap_or_default();
        failures.push(format!("the gateway logged a panic: {line}"));
    }

    // 3. What reached the upstream. Give handlers of abandoned connections a moment to arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let arrivals = std::mem::take(&mut *log.arrivals.lock().unwrap());
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for arrival in &arrivals {
        if let Some(case) = arrival.case {
            *counts.entry(case).or_default() += 1;
        }
        let shown = |keys: &[Vec<u8>]| keys.iter().map(|k| escape(k, 100)).collect::<Vec<_>>().join(" | ");
        let keys_valid = library_accepts(&arrival.keys) && arrival.keys.iter().all(|k| key_is_valid(k));
        if !arrival.keys.is_empty() && !keys_valid {
            failures.push(format!(
                "an invalid key reached the upstream: {} {} with Idempotency-Key {}",
                arrival.method,
                arrival.target,
                shown(&arrival.keys)
            ));
        }
        if arrival.trailer_keys.iter().any(|k| !key_is_valid(k)) {
            failures.push(format!(
                "an invalid key reached the upstream in the trailers: {} {} with {}",
                arrival.method,
                arrival.target,
                shown(&arrival.trailer_keys)
            ));
        }
        if !arrival.recovered.is_empty() {
            failures.push(format!(
                "Idempotency-Recovered reached the upstream although nothing crashed: {} {}",
                arrival.method, arrival.target
            ));
        }
    }
    for (id, reach, index) in expected_reach {
        let seen = counts.get(&id).copied().unwrap_or(0);
        let case = &cases[index];
        let wrong = match reach {
            Reach::Never => seen != 0,
            Reach::Once => seen != 1,
            Reach::Any => false,
        };
        if wrong {
            failures.push(format!(
                "case {id} [{}]: the upstream saw it {seen} time(s), expected {reach:?}",
                case.what
            ));
        }
    }

    let keyed = arrivals.iter().filter(|a| !a.keys.is_empty()).count();
    let trailed = arrivals.iter().filter(|a| !a.trailer_keys.is_empty()).count();
    let broken = arrivals.iter().filter(|a| a.broken_body).count();
    eprintln!(
        "hostile: upstream arrivals with a key header: {keyed}, with a key in the trailers: {trailed}, \
         whose body broke off: {broken}"
    );
    eprintln!("hostile: answers by kind: {:?}", tally.labels.lock().unwrap());
    eprintln!("hostile: exchanges by ending: {:?}", tally.endings.lock().unwrap());
    eprintln!(
        "hostile: the upstream was called {} times; total run time {:?}",
        arrivals.len(),
        started.elapsed()
    );
    assert!(sent >= 3000, "only {sent} requests were sent");
    if !failures.is_empty() {
        let shown: Vec<&String> = failures.iter().take(40).collect();
        panic!(
            "{} failure(s) with seed {seed} (IDEM_HOSTILE_SEED={seed} replays the run); the first {}:\n{}",
            failures.len(),
            shown.len(),
            shown.iter().map(|f| f.as_str()).collect::<Vec<_>>().join("\n")
        );
    }
}
