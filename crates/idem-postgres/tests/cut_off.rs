//! A store connection cut off inside a transaction of idem's own. A gateway's takeover locks the
//! record's row (`SELECT … FOR UPDATE NOWAIT`) and then its network path to the server dies (a
//! dropped NAT entry, a firewall, a frozen VM): the gateway gives up, but the server keeps the
//! session, idle in its transaction and holding the row's lock, until TCP notices (two hours by
//! default). Other gateways read a locked row as a run alive and never take the key over, and an
//! operator's delete says the run is completing. The store's sessions must end such a transaction
//! within the store timeout. Through a relay of this test's that cuts one connection so.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::Store;
use idem_core::UnixMillis;
use idem_core::store::Begin;
use idem_core::testkit::{LEASE, acquire, begin, fingerprint, fresh_id};
use idem_postgres::PostgresStore;
use idem_test_support::chain;
use idem_test_support::postgres_store::TestSchema;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// The protocol code of an `SSLRequest`, the one untyped message that comes before the startup.
const SSL_REQUEST: u32 = 80_877_103;

/// A relay to PostgreSQL that, once armed, cuts the next connection that starts a transaction
/// and executes a statement in it: from that statement's `Sync` on, nothing the client sends
/// reaches the server and nothing the server sends reaches the client, and neither side is
/// closed (both are held here until the relay is dropped).
struct Cutter {
    port: u16,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    armed: AtomicBool,
    cut: AtomicUsize,
    /// Both sides of the cut connections, kept open.
    kept: Mutex<Vec<OwnedWriteHalf>>,
}

impl Cutter {
    async fn start(server: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the relay");
        let port = listener.local_addr().expect("the relay's address").port();
        let shared = Arc::new(Shared::default());
        let accepting = Arc::clone(&shared);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(relay(client, server, Arc::clone(&accepting)));
            }
        });
        Self { port, shared }
    }
}

/// Relays one connection, reading the client's messages to find where to cut it.
async fn relay(client: TcpStream, server: SocketAddr, shared: Arc<Shared>) {
    let Ok(server) = TcpStream::connect(server).await else {
        return;
    };
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let cut = Arc::new(AtomicBool::new(false));
    let (replies_cut, keeper) = (Arc::clone(&cut), Arc::clone(&shared));
    tokio::spawn(async move {
        let mut chunk = vec![0_u8; 64 * 1024];
        while let Ok(read @ 1..) = from_server.read(&mut chunk).await {
            // Cut: the server's bytes (its replies, its errors) go nowhere either.
            if !replies_cut.load(Ordering::SeqCst) && to_client.write_all(&chunk[..read]).await.is_err() {
                return;
            }
        }
        // The client's side of a cut connection stays open too, whatever the server does.
        if replies_cut.load(Ordering::SeqCst) {
            keeper.kept.lock().expect("not poisoned").push(to_client);
        }
    });
    let (mut pending, mut chunk) = (Vec::new(), vec![0_u8; 64 * 1024]);
    let (mut started, mut in_transaction, mut executed) = (false, false, false);
    loop {
        let Ok(read) = from_client.read(&mut chunk).await else {
            return;
        };
        if read == 0 {
            return;
        }
        pending.extend_from_slice(&chunk[..read]);
        let mut forward = Vec::new();
        loop {
            // Untyped (length first) until the startup message; then a type byte, then the length.
            let head = usize::from(started);
            let Some(length) = pending.get(head..head + 4) else {
                break;
            };
            let end = head + u32::from_be_bytes(length.try_into().expect("four bytes")) as usize;
            if pending.len() < end {
                break;
            }
            let message: Vec<u8> = pending.drain(..end).collect();
            forward.extend_from_slice(&message);
            if !started {
                started = u32::from_be_bytes(message[4..8].try_into().expect("four bytes")) != SSL_REQUEST;
                continue;
            }
            let text = String::from_utf8_lossy(&message).to_ascii_uppercase();
            match message[0] {
                b'Q' if text.contains("START TRANSACTION") || text.contains("BEGIN") => {
                    in_transaction = shared.armed.load(Ordering::SeqCst);
                }
                b'E' if in_transaction => executed = true,
                b'S' if executed => {
                    cut.store(true, Ordering::SeqCst);
                    shared.armed.store(false, Ordering::SeqCst);
                    shared.cut.fetch_add(1, Ordering::SeqCst);
                    drop(to_server.write_all(&forward).await);
                    shared.kept.lock().expect("not poisoned").push(to_server);
                    // From here on the client talks to nobody.
                    while from_client.read(&mut chunk).await.is_ok_and(|read| read > 0) {}
                    return;
                }
                _ => {}
            }
        }
        if to_server.write_all(&forward).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_cut_off_inside_its_transaction_does_not_lock_the_key_for_good() {
    let schema = TestSchema::new();
    let direct = schema.connect("").await;
    let (server, _) = schema.through(0, "");
    let cutter = Cutter::start(server).await;
    let (_, url) = schema.through(cutter.port, "pool_size=1&notify=off&read_first=never");
    let cut_off = PostgresStore::connect(&url)
        .await
        .unwrap_or_else(|err| panic!("cannot open the PostgreSQL store: {}", chain(&err)));
    let bound = Duration::from_millis(500);
    cut_off.bound_operations(bound);

    // A run whose gateway died: its lease ends, and the key is anyone's to take over.
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());
    acquire(&direct, &id, &fp, now).await;
    let later = now.plus(LEASE + Duration::from_secs(1));
    // One gateway's takeover locks the row, and its path to the server dies: it gives up.
    cutter.shared.armed.store(true, Ordering::SeqCst);
    let given_up = timeout(Duration::from_secs(2), begin(&cut_off, &id, &fp, later)).await;
    assert!(given_up.is_err(), "the takeover was answered: {given_up:?}");
    assert_eq!(
        cutter.shared.cut.load(Ordering::SeqCst),
        1,
        "the takeover's transaction was cut off"
    );

    // Another gateway takes the key over once the server has ended that transaction; today the
    // lock stays as long as the session, and every takeover reads it as a run alive.
    let mut tries = 0;
    let taken = loop {
        tries += 1;
        let (begun, _) = begin(&direct, &id, &fp, later).await;
        if matches!(begun, Begin::Acquired { .. }) || tries == 40 {
            break begun;
        }
        tokio::time::sleep(bound / 2).await;
    };
    assert!(
        matches!(taken, Begin::Acquired { recovered: true }),
        "after {tries} tries the key is still locked by a transaction nobody can reach: {taken:?}"
    );
}
