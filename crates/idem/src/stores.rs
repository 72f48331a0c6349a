//! Opens the store a URL names. A URL is only ever shown through `redact_url`: it may carry a
//! password.

use std::sync::Arc;

use anyhow::Context as _;
use idem_core::{Store, redact_url};
use idem_postgres::{PostgresStore, StoreDatabase};
use idem_redis::RedisStore;
use idem_sqlite::SqliteStore;

/// The store of every command that is given none: a SQLite file in the working directory.
pub(crate) const DEFAULT_STORE: &str = "sqlite://idem.db";

/// Opens (and migrates) the store at `url`: `sqlite://`, `postgres://`, `redis://`, `redis+sentinel://` or `redis+cluster://`.
pub(crate) async fn open(url: &str) -> anyhow::Result<Arc<dyn Store>> {
    let scheme = url.split_once(':').map_or(url, |(scheme, _)| scheme);
    match scheme {
        "sqlite" => {
            let store = SqliteStore::from_url(url)
                .await
                .with_context(|| format!("cannot open the store {}", redact_url(url)))?;
            Ok(Arc::new(store))
        }
        "postgres" | "postgresql" => {
            let store = PostgresStore::connect(url)
                .await
                .context("cannot open the PostgreSQL store")?;
            Ok(Arc::new(store))
        }
        "redis" | "redis+sentinel" | "redis+cluster" => {
            let store = RedisStore::connect(url).await.context("cannot open the Redis store")?;
            Ok(Arc::new(store))
        }
        _ => anyhow::bail!(
            "unknown store URL {:?}: use sqlite://PATH, postgres://…, redis://HOST:PORT, redis+sentinel://S1:P1,S2:P2,…/PRIMARY or redis+cluster://H1:P1,H2:P2,…",
            redact_url(url)
        ),
    }
}

/// A small pool of plain connections to the database of a `postgres://` store (`database`), for
/// the demo's and the bench's own tables.
pub(crate) fn postgres_pool(database: &StoreDatabase, size: usize) -> anyhow::Result<deadpool_postgres::Pool> {
    let config: tokio_postgres::Config = database
        .url()
        .parse()
        .with_context(|| format!("{} is not a PostgreSQL URL", redact_url(database.url())))?;
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    deadpool_postgres::Pool::builder(manager)
        .max_size(size)
        .build()
        .context("cannot make a pool of PostgreSQL connections")
}
