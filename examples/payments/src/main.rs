//! Runs the payments example on `PAYMENTS_LISTEN` (default `127.0.0.1:3000`), its idempotency
//! records in the SQLite file `PAYMENTS_STORE` (default `payments-idem.db`).

use std::error::Error;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let listen = std::env::var("PAYMENTS_LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let path = std::env::var("PAYMENTS_STORE").unwrap_or_else(|_| "payments-idem.db".to_owned());
    let store = idem_sqlite::SqliteStore::open(&path).await?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("payments listening on http://{}", listener.local_addr()?);
    axum::serve(listener, idem_example_payments::app(store)).await?;
    Ok(())
}
