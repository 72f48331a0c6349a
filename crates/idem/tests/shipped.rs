//! What users are given, checked as they get it: the binaries `cargo build` makes (not the test
//! run's own), started with their documented environment; the image built from them; the
//! deployments, alert rules and dashboard in `deploy/`; and the README and `docs/` (links, flags).
//!
//! Runs in `cargo test --workspace` (`bash .ci/test`); on its own:
//! `cargo test -p idem --all-features --test shipped`.

mod common;

/// The checks, in `tests/shipped/`, one module per thing shipped.
mod shipped {
    pub(crate) mod binaries;
    pub(crate) mod docs;
    pub(crate) mod image;
    pub(crate) mod manifests;
    pub(crate) mod monitoring;
}
