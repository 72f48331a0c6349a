//! The conformance suite every [`Store`] must pass, written once and run by each store crate
//! against a real server with [`conformance_tests!`](crate::conformance_tests).
//!
//! Every case works in its own random scope and keeps its fake times either near the present or in
//! its own stretch of the past, so that cases can share one database and run at the same time.
//!
//! The cases, by concern: claims (`claims.rs`), waiting for a copy in
//! flight (`waiting.rs`), an operator's delete (`deletion.rs`), retention (`expiry.rs`), what a
//! store keeps (`storage.rs`), checkpoints (`checkpoints.rs`), the store's identity and scope salt
//! (`identity.rs`), what a record keeps and `list` (`listing.rs`) and the replay cache
//! (`replay_cache.rs`); the helpers they build claims with (`helpers.rs`), which the store crates'
//! own tests use too, and a store whose operations are counted (`counting.rs`). Every name is
//! here, at `idem_core::testkit::`.

use std::sync::Arc;

use async_trait::async_trait;

use crate::Store;

mod checkpoints;
mod claims;
mod counting;
mod deletion;
mod expiry;
mod helpers;
mod identity;
mod listing;
mod replay_cache;
mod storage;
mod waiting;

pub use checkpoints::{
    a_new_claim_never_sees_old_checkpoints, checkpoints_belong_to_the_current_claim,
    checkpoints_survive_a_takeover_and_end_with_the_run,
};
pub use claims::{
    an_in_transaction_claim_that_died_is_taken_over_unflagged, claim_state_follows_the_claim, claims_a_new_key,
    completes_and_replays, fencing, one_claim_under_concurrency, release_forgets_or_remembers, renewal_keeps_the_claim,
    takeover_needs_the_same_fingerprint,
};
pub use counting::{CountingStore, Counts, counting};
pub use deletion::{delete_fences_the_holder, delete_frees_the_key_in_every_state, delete_of_a_missing_key_is_none};
pub use expiry::{
    abandoned_claim_expires_at_its_ttl, expiry_leaves_a_tombstone, purge_in_batches,
    purge_keeps_unanswered_keys_until_purge_at, purge_time_frees_the_key_without_purge,
    unknown_outcome_expires_at_its_ttl,
};
pub use helpers::{
    DAY, LEASE, acquire, begin, claim, completion, eventually, existing, fingerprint, fresh_id, in_flight_token,
    origin, run_trace, stored_response, unknown_at,
};
pub use identity::{
    claims_check_the_stores_identity, one_salt_of, scope_salt_is_one_per_store,
    scope_salt_tells_how_long_older_records_live,
};
pub use listing::{a_record_keeps_its_origin_status_and_recovery, lists_records_by_state_time_path_and_recovery};
pub use replay_cache::{
    DELETE_REACHES_CACHES_WITHIN, a_delete_while_the_channel_is_down_is_not_missed,
    replay_cache_forgets_what_any_instance_deletes,
};
pub use storage::{large_bodies, records_survive_reopen, scopes_are_isolated, tells_its_time};
pub use waiting::{wait_checks_before_sleeping, wait_wakes_on_completion, wait_wakes_on_delete, wait_wakes_on_release};

/// Opens handles on the store under test.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// Opens a new handle (a new connection or pool) on the same backing store, as another
    /// instance of a service would. Panics with a message saying how to start the server when it
    /// cannot connect.
    async fn open(&self) -> Arc<dyn Store>;

    /// Makes the store lose every record and its salt under the handles already open, as a store
    /// restarted without persistence, flushed, failed over to an empty node or whose schema was
    /// dropped and migrated anew does.
    async fn lose_data(&self);
}

/// Generates one `#[tokio::test]` per conformance case, each calling `$harness` for its store:
/// a store crate's test file holds its [`Harness`] and the line
/// `idem_core::conformance_tests!(MyHarness::new());`.
///
/// `conformance_tests!(in_sequence $harness)`, written inside an async test instead, runs every
/// case there, one after another, each on a harness `$harness` makes afresh: for stores whose
/// servers are costly to start (a replicated Redis the test starts itself), started once.
#[macro_export]
macro_rules! conformance_tests {
    (in_sequence $harness:expr) => {
        $crate::conformance_tests! { @list @sequence $harness }
    };
    ($harness:expr) => {
        $crate::conformance_tests! { @list @cases $harness }
    };
    (@list @$mode:ident $harness:expr) => {
        $crate::conformance_tests! { @$mode $harness;
            claims_a_new_key, one_claim_under_concurrency, completes_and_replays, fencing,
            takeover_needs_the_same_fingerprint, renewal_keeps_the_claim, wait_wakes_on_completion,
            wait_wakes_on_release, wait_wakes_on_delete, wait_checks_before_sleeping,
            release_forgets_or_remembers, delete_fences_the_holder, delete_frees_the_key_in_every_state,
            delete_of_a_missing_key_is_none, unknown_outcome_expires_at_its_ttl,
            abandoned_claim_expires_at_its_ttl, purge_keeps_unanswered_keys_until_purge_at,
            expiry_leaves_a_tombstone, purge_time_frees_the_key_without_purge, purge_in_batches,
            scopes_are_isolated, large_bodies, records_survive_reopen, tells_its_time,
            checkpoints_belong_to_the_current_claim, checkpoints_survive_a_takeover_and_end_with_the_run,
            a_new_claim_never_sees_old_checkpoints, scope_salt_is_one_per_store,
            scope_salt_tells_how_long_older_records_live, claims_check_the_stores_identity,
            claim_state_follows_the_claim,
            an_in_transaction_claim_that_died_is_taken_over_unflagged,
            replay_cache_forgets_what_any_instance_deletes, a_record_keeps_its_origin_status_and_recovery,
            lists_records_by_state_time_path_and_recovery }
    };
    (@cases $harness:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::testkit::$case(&$harness).await;
            }
        )*
    };
    (@sequence $harness:expr; $($case:ident),* $(,)?) => {
        $(
            ::std::eprintln!("conformance case {}", ::std::stringify!($case));
            $crate::testkit::$case(&$harness).await;
        )*
    };
}
