//! The stale-answer walk-through of the README, against a real listener: create an order, cancel
//! it, replay the create. The replay says what that request did (`201`, `Location`, the order as
//! it was created), and `Location` leads to the order as it is now: cancelled.

use std::net::SocketAddr;

use reqwest::StatusCode;
use serde_json::Value;

/// The order the walk-through creates.
const ORDER: &str = r#"{"item":"book","quantity":1}"#;
/// A payment.
const PAYMENT: &str = r#"{"amount":1250,"currency":"EUR"}"#;

struct Service {
    base: String,
    client: reqwest::Client,
    _dir: tempfile::TempDir,
}

async fn start() -> Service {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = idem_sqlite::SqliteStore::open(dir.path().join("idem.db"))
        .await
        .expect("open the store");
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, idem_example_payments::app(store)).await });
    Service {
        base: format!("http://{addr}"),
        client: reqwest::Client::builder().no_proxy().build().expect("a client"),
        _dir: dir,
    }
}

struct Reply {
    status: StatusCode,
    location: Option<String>,
    replayed: bool,
    body: Value,
}

impl Service {
    async fn send(&self, request: reqwest::RequestBuilder) -> Reply {
        let response = request.send().await.expect("an answer");
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().expect("a text header").to_owned())
        };
        let (status, location) = (response.status(), header("location"));
        let replayed = header("idempotency-replayed").as_deref() == Some("true");
        let text = response.text().await.expect("a body");
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Reply {
            status,
            location,
            replayed,
            body,
        }
    }

    /// `POST {path}` of the JSON `body` under `key`.
    async fn post(&self, path: &str, key: &str, body: &str) -> Reply {
        let request = self
            .client
            .post(format!("{}{path}", self.base))
            .header("idempotency-key", format!("\"{key}\""))
            .header("content-type", "application/json")
            .body(body.to_owned());
        self.send(request).await
    }

    /// `GET {path}`.
    async fn get(&self, path: &str) -> Reply {
        self.send(self.client.get(format!("{}{path}", self.base))).await
    }
}

#[tokio::test]
async fn a_replayed_create_says_what_it_did_and_its_location_shows_the_order_now() {
    let service = start().await;

    let created = service.post("/orders", "order-1", ORDER).await;
    assert_eq!(created.status, StatusCode::CREATED);
    assert_eq!(created.location.as_deref(), Some("/orders/1"));
    assert!(!created.replayed);
    assert_eq!(created.body["status"], "open");

    let cancelled = service.post("/orders/1/cancel", "cancel-1", "").await;
    assert_eq!(cancelled.status, StatusCode::OK);
    assert_eq!(cancelled.body["status"], "cancelled");

    // The client never heard the first answer and sends the create again, with the same key.
    let replay = service.post("/orders", "order-1", ORDER).await;
    assert_eq!(replay.status, StatusCode::CREATED, "the replay is the create's answer");
    assert!(replay.replayed, "marked Idempotency-Replayed: true");
    assert_eq!(replay.location.as_deref(), Some("/orders/1"), "the same order");
    assert_eq!(
        replay.body["status"], "open",
        "the replay says what that request did, not what the order is now"
    );

    let location = replay.location.expect("a Location");
    let now = service.get(&location).await;
    assert_eq!(now.status, StatusCode::OK);
    assert_eq!(now.body["status"], "cancelled", "Location leads to the current state");

    let second = service.get("/orders/2").await;
    assert_eq!(second.status, StatusCode::NOT_FOUND, "the replay created nothing");
}

#[tokio::test]
async fn a_retried_payment_is_charged_once() {
    let service = start().await;

    let first = service.post("/pay", "pay-1", PAYMENT).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body["charge"], "ch_1");
    let retry = service.post("/pay", "pay-1", PAYMENT).await;
    assert!(retry.replayed);
    assert_eq!(retry.body, first.body);

    let other = service.post("/pay", "pay-2", PAYMENT).await;
    assert_eq!(other.body["charge"], "ch_2", "a new key is a new payment");

    let changed = service
        .post("/pay", "pay-1", r#"{"amount":9999,"currency":"EUR"}"#)
        .await;
    assert_eq!(
        changed.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "the same key with another body is refused: {:?}",
        changed.body
    );
}
