//! The gateway's store observer: every store operation's latency and failures, and the purged
//! records, as Prometheus metrics (`idem_core::store::Observed` does the timing).

use std::time::Duration;

use idem_core::{
    metric_names,
    store::{Observer, Purged, StoreOperation},
};

/// Feeds the Prometheus metrics `idem_store_operation_seconds`, `idem_store_errors_total` and
/// `idem_purged_records_total`.
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

    fn purged(&self, purged: &Purged) {
        metrics::counter!(metric_names::PURGED_RECORDS_TOTAL).increment(purged.total());
    }
}
