//! The gateway's own metrics beside the protocol's: every store operation's latency and failures
//! (`idem_core::store::Observed` does the timing), the writes Redis replicas did not acknowledge,
//! the purged records, and the run timeout each route's runs are judged against.

use std::time::Duration;

use idem_core::{
    Policy, RouteRule, Routes, StoreError, metric_names,
    store::{Observer, Purged, StoreOperation},
};

/// The route label of requests no route matches (as `idem_requests_total` names it).
const DEFAULT_ROUTE: &str = "default";

/// Feeds the Prometheus metrics `idem_store_operation_seconds`, `idem_store_errors_total`,
/// `idem_replica_ack_timeouts_total` and `idem_purged_records_total`.
#[derive(Debug)]
pub(crate) struct Prometheus;

impl Observer for Prometheus {
    fn observe(&self, operation: StoreOperation, elapsed: Duration, failed: bool) {
        let operation = operation.as_str();
        metrics::histogram!(metric_names::STORE_OPERATION_SECONDS, "operation" => operation)
            .record(elapsed.as_secs_f64());
        if failed {
            metrics::counter!(metric_names::STORE_ERRORS_TOTAL, "operation" => operation).increment(1);
        }
    }

    fn error(&self, operation: StoreOperation, err: &StoreError) {
        // Also in `idem_store_errors_total`: this says which of them a failover could have lost.
        if idem_redis::is_unacknowledged(err) {
            metrics::counter!(metric_names::REPLICA_ACK_TIMEOUTS_TOTAL, "operation" => operation.as_str()).increment(1);
        }
    }

    fn purged(&self, purged: &Purged) {
        metrics::counter!(metric_names::PURGED_RECORDS_TOTAL).increment(purged.total());
    }
}

/// What the gateway exports from its start: the counters and gauges without labels at 0, so that
/// a rule sees the first increase (a counter that appears at 1 shows none) and a dashboard shows
/// 0 rather than no data; and `idem_run_timeout_seconds` for the default policy and each
/// protecting route, under the route labels the layer counts their requests by, so that a rule can
/// compare a route's run time with its own limit.
pub(crate) fn at_start(policy: &Policy, routes: &Routes) {
    for counter in [
        metric_names::FENCED_COMPLETIONS_TOTAL,
        metric_names::PURGED_RECORDS_TOTAL,
        metric_names::REPLAY_CACHE_ANSWERS_TOTAL,
    ] {
        metrics::counter!(counter).increment(0);
    }
    for gauge in [
        metric_names::RUNS_IN_FLIGHT,
        metric_names::WAITERS,
        metric_names::PENDING_ANSWERS,
    ] {
        metrics::gauge!(gauge).increment(0.0);
    }
    let protected = routes.iter().filter_map(|route| match &route.rule {
        RouteRule::Protect(policy) => Some((route.pattern.label().to_string(), policy)),
        RouteRule::PassThrough => None,
    });
    for (route, policy) in std::iter::once((DEFAULT_ROUTE.to_owned(), policy)).chain(protected) {
        metrics::gauge!(metric_names::RUN_TIMEOUT_SECONDS, "route" => route).set(policy.run_timeout.as_secs_f64());
    }
}
