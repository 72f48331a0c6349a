//! The store conformance suite of `idem-core`, against a real PostgreSQL server (`test` on
//! 127.0.0.1:5432, or `IDEM_TEST_POSTGRES_URL`). Every case runs in a PostgreSQL schema of its
//! own; every `open` is a new store with its own pool and listening connection, as another
//! instance of a service would have.

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use common::TestSchema;
use idem_core::Store;
use idem_core::testkit::Harness;

struct PgHarness {
    schema: TestSchema,
}

impl PgHarness {
    fn new() -> Self {
        Self {
            schema: TestSchema::new(),
        }
    }
}

#[async_trait]
impl Harness for PgHarness {
    async fn open(&self) -> Arc<dyn Store> {
        // Small pools: the cases run in parallel on one server shared with other tests.
        Arc::new(self.schema.connect("pool_size=8").await)
    }
}

idem_core::conformance_tests!(PgHarness::new());
