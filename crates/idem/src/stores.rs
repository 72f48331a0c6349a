//! Opens the store a URL names.

use std::sync::Arc;

use anyhow::Context as _;
use idem_core::Store;
use idem_postgres::PostgresStore;
use idem_sqlite::SqliteStore;

/// Opens (and migrates) the store at `url`.
pub(crate) async fn open(url: &str) -> anyhow::Result<Arc<dyn Store>> {
    let scheme = url.split_once(':').map_or(url, |(scheme, _)| scheme);
    match scheme {
        "sqlite" => {
            let store = SqliteStore::from_url(url)
                .await
                .with_context(|| format!("cannot open the store {url}"))?;
            Ok(Arc::new(store))
        }
        "postgres" | "postgresql" => {
            let store = PostgresStore::connect(url).await.context("cannot open the PostgreSQL store")?;
            Ok(Arc::new(store))
        }
        "redis" | "redis+cluster" => {
            anyhow::bail!("the {scheme} store is not available in this build of idem yet")
        }
        _ => anyhow::bail!("unknown store URL {url:?}: use sqlite://PATH or postgres://…"),
    }
}
