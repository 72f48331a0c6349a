//! Why a Redis store could not be set up. Errors of store operations are
//! [`idem_core::StoreError`]s; this type only covers connecting.

/// A Redis store could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// The URL is not a store URL this crate understands.
    #[error(
        "invalid Redis store URL {url:?}: {reason}; expected redis://host:port[/db][?options], redis+sentinel://host:port,host:port,.../primary-name[/db][?options] or redis+cluster://host:port,host:port,...[?options], with the options prefix=NAME, poll_interval=DURATION, replicas=auto|N and replica_timeout=DURATION"
    )]
    InvalidUrl {
        /// The URL as given, without its password.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The server (or no node of the cluster) could be reached, or it refused the connection.
    #[error("cannot connect to Redis at {url}: {reason}")]
    Connect {
        /// The URL as given, without its password.
        url: String,
        /// What went wrong, in words.
        reason: String,
        /// The error of the Redis client.
        #[source]
        source: redis::RedisError,
    },
}

impl RedisError {
    pub(crate) fn connect(url: &str, source: redis::RedisError) -> Self {
        let reason = if source.is_connection_refusal() {
            "the connection was refused; is redis-server running and listening there?".to_owned()
        } else if source.is_timeout() {
            "the server did not answer in time".to_owned()
        } else if source.kind() == redis::ErrorKind::AuthenticationFailed {
            "authentication failed; check the user and password in the URL".to_owned()
        } else if source.kind() == redis::ErrorKind::RESP3NotSupported {
            "the server does not speak RESP3, which this store needs for its notifications (Redis 6 or newer)"
                .to_owned()
        } else {
            source.to_string()
        };
        Self::Connect {
            url: url.to_owned(),
            reason,
            source,
        }
    }
}
