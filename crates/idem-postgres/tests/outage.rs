//! An outage of the server, without stopping the real one (other tests share it): the store
//! reaches PostgreSQL through a TCP proxy of this test, which is stopped (every connection cut,
//! new ones refused) and started again on the same port. While it is down, operations fail as
//! unavailable; once it is back, the same store object works again and its waiters are woken by
//! notifications again.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::testkit::{DAY, acquire, completion, fingerprint, fresh_id};
use idem_core::{Store, StoreError, UnixMillis, store::WaitOutcome};
use idem_test_support::chain;
use idem_test_support::postgres_store::TestSchema;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};

/// Forwards a local port to the PostgreSQL server; `stop` is the outage.
struct Proxy {
    port: u16,
    upstream: SocketAddr,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Self {
            port: listener.local_addr().unwrap().port(),
            upstream,
            tasks: Arc::default(),
        };
        proxy.serve(listener);
        proxy
    }

    fn serve(&self, listener: TcpListener) {
        let (tasks, upstream) = (Arc::clone(&self.tasks), self.upstream);
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let forward = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                tasks.lock().unwrap().push(forward);
            }
        });
        self.tasks.lock().unwrap().push(accept);
    }

    /// Cuts every connection and refuses new ones.
    fn stop(&self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    /// Accepts connections on the same port again.
    async fn restart(&self) {
        let started = Instant::now();
        let listener = loop {
            match TcpListener::bind(("127.0.0.1", self.port)).await {
                Ok(listener) => break listener,
                Err(err) if started.elapsed() < Duration::from_secs(5) => {
                    let _ = err;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(err) => panic!("cannot listen on port {} again: {err}", self.port),
            }
        };
        self.serve(listener);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_comes_back_after_an_outage() {
    let schema = TestSchema::new();
    let app = format!("idem_test_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let options = format!("poll_interval=60s&application_name={app}&connect_timeout=2");
    let (upstream, _) = schema.through(0, &options);
    let proxy = Proxy::start(upstream).await;
    let (_, url) = schema.through(proxy.port, &options);
    let store = idem_postgres::PostgresStore::connect(&url)
        .await
        .unwrap_or_else(|err| panic!("{}", chain(&err)));
    // The holder reaches the server directly: it is not part of the outage.
    let holder = schema.connect("").await;
    store.ping().await.expect("ping before the outage");

    proxy.stop();
    let err = store.ping().await.expect_err("the server is unreachable");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let err = store.get(&id).await.expect_err("the server is unreachable");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(err.to_string().contains(&format!("127.0.0.1:{}", proxy.port)), "{err}");
    // Long enough for the listener to fail a few reconnection attempts.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    proxy.restart().await;
    let started = Instant::now();
    while let Err(err) = store.ping().await {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the store did not come back: {err}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let admin = schema.client().await;
    while admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'",
            &[&app],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 0
    {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the listening connection did not come back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let token = acquire(&holder, &id, &fp, now).await;
    let waiter = {
        let (store, id) = (store.clone(), id.clone());
        let deadline = Instant::now() + Duration::from_secs(30);
        tokio::spawn(async move { store.wait(&id, token, deadline).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "the waiter waits while the claim is held");
    holder
        .complete(&id, token, completion(b"done", now, DAY, 7 * DAY))
        .await
        .expect("complete");
    let outcome = timeout(Duration::from_secs(2), waiter)
        .await
        .expect("woken by a notification after the outage, not by polling")
        .expect("task")
        .expect("wait");
    assert_eq!(outcome, WaitOutcome::Changed);
}
