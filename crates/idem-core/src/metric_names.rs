//! Every metric idem exports, named once. Instances aggregate them in Prometheus: histograms and
//! counters with their units in the name, `_total` for counters.

/// Counter: keyed requests by `outcome` and `route`.
pub const REQUESTS_TOTAL: &str = "idem_requests_total";
/// Histogram: how long a copy waited for the run in flight (`waited` and `in-flight` outcomes).
pub const WAIT_SECONDS: &str = "idem_wait_seconds";
/// Gauge: copies waiting for a run in flight, now.
pub const WAITERS: &str = "idem_waiters";
/// Gauge: runs under a claim, now.
pub const RUNS_IN_FLIGHT: &str = "idem_runs_in_flight";
/// Gauge: answers held in memory because the store did not take them yet.
pub const PENDING_ANSWERS: &str = "idem_pending_answers";
/// Histogram: store operation latency by `operation`.
pub const STORE_OPERATION_SECONDS: &str = "idem_store_operation_seconds";
/// Counter: store operations that failed, by `operation`.
pub const STORE_ERRORS_TOTAL: &str = "idem_store_errors_total";
/// Counter: records purged (deleted or turned into tombstones).
pub const PURGED_RECORDS_TOTAL: &str = "idem_purged_records_total";
/// Counter: keyed requests answered from this instance's replay cache, without a store round
/// trip (each is also counted in [`REQUESTS_TOTAL`] by its outcome).
pub const REPLAY_CACHE_ANSWERS_TOTAL: &str = "idem_replay_cache_answers_total";
/// Histogram: the upstream's time to its answer's head, by `result` (gateway).
pub const UPSTREAM_SECONDS: &str = "idem_upstream_seconds";
/// Gauge: open connections by `listener` (gateway).
pub const CONNECTIONS_OPEN: &str = "idem_connections_open";
/// Counter: answers the store refused because their run's claim was no longer current (another
/// run took the key over after the lease ran out, or an operator deleted it while it ran).
pub const FENCED_COMPLETIONS_TOTAL: &str = "idem_fenced_completions_total";
/// Histogram: how long keyed runs took by `route`, from the handler's call under its claim to
/// its answer's head (or to being given up at the run timeout).
pub const RUN_SECONDS: &str = "idem_run_seconds";
/// Gauge: the run timeout of each `route`, in seconds (gateway): what [`RUN_SECONDS`] is
/// compared against.
pub const RUN_TIMEOUT_SECONDS: &str = "idem_run_timeout_seconds";
/// Gauge: 1 while the store's channel that announces deletes to the replay cache is up, 0 while
/// it is down (the cache then answers nothing). Absent without a replay cache (gateway).
pub const REPLAY_CACHE_CHANNEL_UP: &str = "idem_replay_cache_channel_up";
/// Counter: store writes, by `operation`, that too few Redis replicas acknowledged within
/// `replica_timeout` (gateway): each failed as the store being unavailable.
pub const REPLICA_ACK_TIMEOUTS_TOTAL: &str = "idem_replica_ack_timeouts_total";

/// Every name above, for documentation and tests.
pub const ALL: [&str; 16] = [
    REQUESTS_TOTAL,
    WAIT_SECONDS,
    WAITERS,
    RUNS_IN_FLIGHT,
    PENDING_ANSWERS,
    STORE_OPERATION_SECONDS,
    STORE_ERRORS_TOTAL,
    PURGED_RECORDS_TOTAL,
    REPLAY_CACHE_ANSWERS_TOTAL,
    UPSTREAM_SECONDS,
    CONNECTIONS_OPEN,
    FENCED_COMPLETIONS_TOTAL,
    RUN_SECONDS,
    RUN_TIMEOUT_SECONDS,
    REPLAY_CACHE_CHANNEL_UP,
    REPLICA_ACK_TIMEOUTS_TOTAL,
];
