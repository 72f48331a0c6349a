//! A TCP relay between a store and Redis that injects real network faults: it resets every
//! connection, holds the replies of a connection once its client sends a given command, and
//! slips an extra reply in front of a real one. Bytes are relayed unchanged otherwise.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// A fault that waits for a connection whose client sends `trigger`.
struct Armed<T> {
    trigger: Vec<u8>,
    what: T,
}

/// Holds the replies of every connection whose client sends `trigger` before `until`.
struct Hold {
    armed: Armed<Duration>,
    until: Instant,
}

#[derive(Default)]
struct Faults {
    hold: Option<Hold>,
    /// Strikes once: writes these bytes to the client just before the connection's next reply.
    inject: Option<Armed<Vec<u8>>>,
}

struct Shared {
    upstream: SocketAddr,
    faults: Mutex<Faults>,
    connections: Mutex<JoinSet<()>>,
    accepted: AtomicUsize,
    holds: AtomicUsize,
    injections: AtomicUsize,
}

impl Shared {
    fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn connections(&self) -> MutexGuard<'_, JoinSet<()>> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What one connection's two directions share.
#[derive(Default)]
struct ConnFaults {
    hold_until: Option<Instant>,
    inject: Option<Vec<u8>>,
}

/// The relay; it stops (and drops every connection) when dropped.
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Listens on a free loopback port and relays every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the relay");
        let addr = listener.local_addr().expect("the relay's address");
        let shared = Arc::new(Shared {
            upstream,
            faults: Mutex::default(),
            connections: Mutex::new(JoinSet::new()),
            accepted: AtomicUsize::new(0),
            holds: AtomicUsize::new(0),
            injections: AtomicUsize::new(0),
        });
        let acceptor = tokio::spawn(accept(listener, Arc::clone(&shared)));
        Self { addr, shared, acceptor }
    }

    /// Where the relay listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every open connection at once, with a TCP reset towards the client.
    pub fn reset_all(&self) {
        self.shared.connections().abort_all();
    }

    /// For the next `window`, every connection whose client sends `trigger` gets its replies held
    /// for `duration` from that moment (the server's bytes wait in the relay, then flow again, in
    /// order): a stall of the connections made during the window, once they are in use.
    pub fn hold_replies_after(&self, trigger: &[u8], duration: Duration, window: Duration) {
        self.shared.faults().hold = Some(Hold {
            armed: Armed {
                trigger: trigger.to_vec(),
                what: duration,
            },
            until: Instant::now() + window,
        });
    }

    /// The next connection whose client sends `trigger` receives `reply` just before the server's
    /// next bytes: one reply more than the client asked for.
    pub fn inject_reply_after(&self, trigger: &[u8], reply: &[u8]) {
        self.shared.faults().inject = Some(Armed {
            trigger: trigger.to_vec(),
            what: reply.to_vec(),
        });
    }

    /// How many connections were accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// On how many connections a hold struck.
    pub fn holds(&self) -> usize {
        self.shared.holds.load(Ordering::SeqCst)
    }

    /// How many replies were injected.
    pub fn injections(&self) -> usize {
        self.shared.injections.load(Ordering::SeqCst)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.shared.connections().abort_all();
    }
}

async fn accept(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let task = relay(client, Arc::clone(&shared));
        let mut connections = shared.connections();
        while connections.try_join_next().is_some() {}
        connections.spawn(task);
    }
}

async fn relay(client: TcpStream, shared: Arc<Shared>) {
    // A reset, not an orderly close, when the connection is dropped.
    let _ = client.set_zero_linger();
    let _ = client.set_nodelay(true);
    let Ok(server) = TcpStream::connect(shared.upstream).await else {
        return;
    };
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let conn = Arc::new(Mutex::new(ConnFaults::default()));
    let requests = requests(client_read, server_write, Arc::clone(&shared), Arc::clone(&conn));
    let replies = replies(server_read, client_write, conn);
    // Either direction ending ends the connection (both sockets are dropped).
    tokio::select! {
        () = requests => {}
        () = replies => {}
    }
}

/// Client to server: watches for the armed faults' triggers.
async fn requests(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, shared: Arc<Shared>, conn: Arc<Mutex<ConnFaults>>) {
    let mut buf = vec![0u8; 64 * 1024];
    // The end of the previous chunk, so that a trigger split between two reads is still seen.
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut window = std::mem::take(&mut tail);
        window.extend_from_slice(&buf[..n]);
        {
            let mut faults = shared.faults();
            let mut this = conn.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(hold) = &faults.hold
                && this.hold_until.is_none()
                && Instant::now() < hold.until
                && contains(&window, &hold.armed.trigger)
            {
                // Set before the request goes on: its reply cannot be on its way yet.
                this.hold_until = Some(Instant::now() + hold.armed.what);
                shared.holds.fetch_add(1, Ordering::SeqCst);
            }
            if faults
                .inject
                .as_ref()
                .is_some_and(|armed| contains(&window, &armed.trigger))
            {
                let armed = faults.inject.take().expect("armed");
                this.inject = Some(armed.what);
                shared.injections.fetch_add(1, Ordering::SeqCst);
            }
        }
        let keep = window.len().min(64);
        tail = window[window.len() - keep..].to_vec();
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Server to client: applies the connection's hold and injection.
async fn replies(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, conn: Arc<Mutex<ConnFaults>>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let (hold_until, inject) = {
            let mut this = conn.lock().unwrap_or_else(PoisonError::into_inner);
            (this.hold_until, this.inject.take())
        };
        if let Some(until) = hold_until {
            tokio::time::sleep_until(until).await;
        }
        if let Some(extra) = inject
            && to.write_all(&extra).await.is_err()
        {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|window| window == needle)
}
