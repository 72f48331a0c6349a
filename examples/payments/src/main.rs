//! Runs the payments example on `PAYMENTS_LISTEN` (default `127.0.0.1:3000`), its idempotency
//! records in the SQLite file `PAYMENTS_STORE` (default `payments-idem.db`), charging the HTTP
//! provider at `PAYMENTS_PROVIDER` if set (else its own books), with a lease of
//! `PAYMENTS_LEASE_SECS` (default 60).
//!
//! With `PAYMENTS_DATABASE` (a `postgres://` URL, or a SQLite file: `sqlite://relative.db`,
//! `sqlite:///absolute.db` or a plain path), the records and the payments ledger are both in
//! that database, `POST /pay` completes in the ledger's transaction, and `PAYMENTS_STORE` is not
//! read.

use std::error::Error;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    // The TLS crypto provider of the payment provider's client (reqwest over rustls), installed
    // here rather than assumed: in a workspace build reqwest has `idem`'s `rustls-no-provider`,
    // and its `Client::build` panics without a process default. Ring, as `idem` uses; an error
    // only means that one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let listen = std::env::var("PAYMENTS_LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let mut config = idem_example_payments::Config {
        provider: std::env::var("PAYMENTS_PROVIDER").ok(),
        database: std::env::var("PAYMENTS_DATABASE").ok().filter(|db| !db.is_empty()),
        ..Default::default()
    };
    if let Ok(secs) = std::env::var("PAYMENTS_LEASE_SECS") {
        let secs: u64 = secs
            .parse()
            .map_err(|_| format!("PAYMENTS_LEASE_SECS={secs:?} is not a number of seconds"))?;
        config.lease = std::time::Duration::from_secs(secs);
    }
    let app = if config.database.is_some() {
        idem_example_payments::app_on_database(config).await?
    } else {
        let path = std::env::var("PAYMENTS_STORE").unwrap_or_else(|_| "payments-idem.db".to_owned());
        let store = idem_sqlite::SqliteStore::open(&path).await?;
        idem_example_payments::app_with(store, config)
    };
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("payments listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
