//! How long the store's calls to Redis may take: every connection (commands, the acknowledged
//! pool, wake-ups, the questions to Sentinel) is bounded by these.

use std::time::Duration;

/// How long one command may take before it fails (the store is then unavailable). Generous
/// enough for a stored answer of several MiB.
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// How much longer than one attempt a cluster command may take with its redirections and retries.
pub(crate) const CLUSTER_OVERALL_TIMEOUT: Duration = Duration::from_secs(3);

/// How long one attempt to (re)connect may take.
pub(crate) const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
