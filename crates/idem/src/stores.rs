//! Opens the store a URL names. A URL is only ever shown through `redact_url`: it may carry a
//! password.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use idem_core::{Store, redact_url};
use idem_postgres::{Access, PostgresError, PostgresStore, StoreDatabase};
use idem_redis::{RedisError, RedisStore};
use idem_sqlite::{SqliteError, SqliteStore};

use crate::misconfigured::Misconfigured;

/// The store of every command that is given none: a SQLite file in the working directory.
pub(crate) const DEFAULT_STORE: &str = "sqlite://idem.db";

/// Opens (and migrates) the store at `url`: `sqlite://`, `postgres://`, `redis://`, `redis+sentinel://` or `redis+cluster://`.
///
/// On PostgreSQL, a schema that is current is only read (no DDL), and the role is checked for the
/// rights `access` needs (`None`: only the schema's, as for `idem migrate`); a right it lacks is
/// named with its object (exit 1).
///
/// A URL that does not parse (an unknown scheme, a bad option) is a setting that cannot work: it
/// fails as [`Misconfigured`], so the command exits 2 as for a bad flag. A store that cannot be
/// reached or opened fails as itself (exit 1): the same command may work once it is up.
pub(crate) async fn open(url: &str, access: Option<Access>) -> anyhow::Result<Arc<dyn Store>> {
    let scheme = url.split_once(':').map_or(url, |(scheme, _)| scheme);
    match scheme {
        "sqlite" => match SqliteStore::from_url(url).await {
            Ok(store) => Ok(Arc::new(store)),
            Err(err @ SqliteError::InvalidUrl { .. }) => Err(misconfigured(err)),
            Err(err) => Err(anyhow::Error::new(err).context(format!("cannot open the store {}", redact_url(url)))),
        },
        "postgres" | "postgresql" => match PostgresStore::connect(url).await {
            Ok(store) => {
                if let Some(access) = access {
                    store
                        .check_access(access)
                        .await
                        .context("the PostgreSQL store cannot be used")?;
                }
                Ok(Arc::new(store))
            }
            Err(err @ PostgresError::InvalidUrl { .. }) => Err(misconfigured(err)),
            Err(err) => Err(anyhow::Error::new(err).context("cannot open the PostgreSQL store")),
        },
        "redis" | "redis+sentinel" | "redis+cluster" => match RedisStore::connect(url).await {
            Ok(store) => Ok(Arc::new(store)),
            Err(err @ RedisError::InvalidUrl { .. }) => Err(misconfigured(err)),
            Err(err) => Err(anyhow::Error::new(err).context("cannot open the Redis store")),
        },
        _ => Err(misconfigured(format!(
            "unknown store URL {:?}: use sqlite://PATH, postgres://…, redis://HOST:PORT, redis+sentinel://S1:P1,S2:P2,…/PRIMARY or redis+cluster://H1:P1,H2:P2,…",
            redact_url(url)
        ))),
    }
}

/// The longest any one statement of an operator's command may run or wait on the store's
/// server (a listing of a large store included), so that a command never hangs on a lock.
pub(crate) const OPERATOR_BOUND: Duration = Duration::from_secs(30);

/// Opens the store for an operator's command (`list`, `inspect`, `delete`, `purge`): every operation is
/// bounded on the server by [`OPERATOR_BOUND`], and an operator's delete never waits for a run's
/// open transaction (it reports it instead).
pub(crate) async fn open_for_operator(url: &str, access: Access) -> anyhow::Result<Arc<dyn Store>> {
    let store = open(url, Some(access)).await?;
    store.bound_operations(OPERATOR_BOUND);
    Ok(store)
}

/// A store URL that cannot work, named as the `--store` setting (its message redacts the URL's
/// password, as every store's does).
fn misconfigured(reason: impl std::fmt::Display) -> anyhow::Error {
    Misconfigured {
        flag: "store",
        reason: reason.to_string(),
    }
    .into()
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
