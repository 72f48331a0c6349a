//! The store conformance suite of `idem-core`, against a real PostgreSQL server (`test` on
//! 127.0.0.1:5432, or `IDEM_TEST_POSTGRES_URL`). Every case runs in a PostgreSQL schema of its
//! own; every `open` is a new store with its own pool and listening connection, as another
//! instance of a service would have.

use std::sync::Arc;

use async_trait::async_trait;
use idem_core::Store;
use idem_core::testkit::Harness;
use idem_test_support::postgres_store::TestSchema;
use idem_test_support::servers;

struct PgHarness {
    schema: TestSchema,
    options: &'static str,
}

impl PgHarness {
    fn new(options: &'static str) -> Self {
        Self {
            schema: TestSchema::new(),
            options,
        }
    }
}

#[async_trait]
impl Harness for PgHarness {
    async fn open(&self) -> Arc<dyn Store> {
        Arc::new(self.schema.connect(self.options).await)
    }

    /// The schema dropped and migrated anew (by a store that connects and asks for no salt).
    async fn lose_data(&self) {
        let (url, name) = (servers::Server::Postgres.configured_url(), self.schema.name.clone());
        tokio::task::spawn_blocking(move || servers::drop_postgres_schema(&url, &name))
            .await
            .expect("dropping the schema");
        drop(self.schema.connect(self.options).await);
    }
}

// Small pools: the cases run in parallel on one server shared with other tests. `begin` claims
// first until replays are most of the recent ones (`read_first=auto`).
idem_core::conformance_tests!(PgHarness::new("pool_size=8"));

/// The same suite with every `begin` reading the record on the shared connections first.
mod read_first {
    use super::*;

    idem_core::conformance_tests!(PgHarness::new("pool_size=8&read_first=always&read_connections=1"));
}
