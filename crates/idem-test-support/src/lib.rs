//! What idem's tests share, so that it is written once: a TCP relay that injects real network
//! faults between idem and its store ([`relay`]), fault storms driven by a printed, replayable seed
//! ([`storm`], [`seed`]), and the servers the tests run against ([`servers`]; a private Redis
//! Cluster behind relays in [`cluster`]; private servers a test may kill in [`private`]; Redis
//! with real replicas, Sentinels and failovers in [`replicated`]), HTTP/1.1 on raw TCP, client
//! and upstream side ([`wire`]), and idem's stores on those servers, each test in a PostgreSQL
//! schema ([`postgres_store`]) or under a Redis key prefix ([`redis_store`]) of its own; their
//! servers' tasks end with them ([`task`]).
//!
//! A test that needs a server it cannot reach fails with a message saying how to start it
//! (`bash .ci/services`); it never skips.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use idem_test_support::relay::Relay;
//! use idem_test_support::seed::Seed;
//! use idem_test_support::servers;
//! use idem_test_support::storm::{self, StormPlan};
//!
//! # async fn example() {
//! let postgres = servers::postgres_url();
//! let relay = Relay::start(servers::socket_addr(&postgres)).await;
//! let through_relay = servers::with_addr(&postgres, relay.addr());
//! // … start idem on `through_relay`, send traffic, and meanwhile:
//! let mut rng = Seed::for_this_run().rng("postgres");
//! let faults = storm::run(&[&relay], &mut rng, &StormPlan::over(Duration::from_secs(20))).await;
//! println!("{faults}");
//! # }
//! ```
#![forbid(unsafe_code)]

pub mod cluster;
pub mod postgres_store;
pub mod private;
pub mod raw;
pub mod redis_store;
pub mod relay;
pub mod replicated;
pub mod seed;
pub mod servers;
pub mod storm;
pub mod task;
pub mod wire;

/// An error and its causes, `: `-separated, for panic messages.
pub fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cause = err.source();
    while let Some(err) = cause {
        out.push_str(": ");
        out.push_str(&err.to_string());
        cause = err.source();
    }
    out
}
