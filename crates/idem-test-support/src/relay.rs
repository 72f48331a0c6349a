//! A TCP relay between a client (idem) and a server (its store) that injects real network faults:
//! connections reset before a command reaches the server, or after the server executed it (its
//! reply lost), latency spikes, black holes that hold every byte for a while, and, for protocol
//! tests, replies held or one reply too many. Bytes are relayed unchanged otherwise; the relay
//! knows nothing of the protocol it carries.

use std::collections::VecDeque;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Add;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// How long a connection waits for the reply of a command whose reply is to be lost before it is
/// reset anyway (a command that has no reply, or a connection that only listens).
const REPLY_WAIT: Duration = Duration::from_secs(1);

/// After the first bytes of a lost reply, how long the relay keeps swallowing before the reset:
/// on a multiplexed connection (Redis) those bytes may answer an earlier command, and the server
/// executes what it received in order, well within this.
const REPLY_SETTLE: Duration = Duration::from_millis(30);

/// A fault that strikes the next chunk of bytes any client sends through the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The connection is reset (both ways) and the chunk never reaches the server: the command
    /// was not executed, the client cannot know it.
    ResetBeforeForward,
    /// The chunk reaches the server, which executes it; its reply is swallowed and the connection
    /// reset: the command took effect, the client cannot know it.
    ResetAfterReply,
    /// The chunk waits this long before it goes on (and the connection's later chunks behind it).
    Delay(Duration),
}

/// How many faults struck.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCount {
    /// Connections reset before a command was forwarded.
    pub resets_before: usize,
    /// Connections reset after a command was executed, its reply lost.
    pub resets_after: usize,
    /// Latency spikes.
    pub delays: usize,
    /// Black holes (each holds every connection of a relay for a while).
    pub black_holes: usize,
}

impl FaultCount {
    /// All faults.
    pub fn total(&self) -> usize {
        self.resets_before + self.resets_after + self.delays + self.black_holes
    }
}

impl Add for FaultCount {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            resets_before: self.resets_before + other.resets_before,
            resets_after: self.resets_after + other.resets_after,
            delays: self.delays + other.delays,
            black_holes: self.black_holes + other.black_holes,
        }
    }
}

impl fmt::Display for FaultCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} faults ({} resets before a command, {} resets after one with its reply lost, {} latency spikes, {} black holes)",
            self.total(),
            self.resets_before,
            self.resets_after,
            self.delays,
            self.black_holes
        )
    }
}

/// A fault that waits for a connection whose client sends `trigger`.
#[derive(Debug)]
struct Armed<T> {
    trigger: Vec<u8>,
    what: T,
}

/// Holds the replies of every connection whose client sends `trigger` before `until`.
#[derive(Debug)]
struct Hold {
    armed: Armed<Duration>,
    until: Instant,
}

#[derive(Debug, Default)]
struct Faults {
    /// Strike the next chunks sent, one each, in order; one whose window (if any) has passed
    /// without a chunk is dropped.
    armed: VecDeque<(Fault, Option<Instant>)>,
    /// Until then, no byte moves and no new connection reaches the server.
    black_hole_until: Option<Instant>,
    hold: Option<Hold>,
    /// Strikes once, on the next chunk that contains the trigger (before the `armed` ones).
    armed_on: Option<Armed<Fault>>,
    /// Strikes once: writes these bytes to the client just before the connection's next reply.
    inject: Option<Armed<Vec<u8>>>,
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicUsize,
    chunks: AtomicUsize,
    resets_before: AtomicUsize,
    resets_after: AtomicUsize,
    delays: AtomicUsize,
    black_holes: AtomicUsize,
    holds: AtomicUsize,
    injections: AtomicUsize,
}

#[derive(Debug)]
struct Shared {
    /// Where new connections go ([`Relay::retarget`] changes it).
    upstream: Mutex<SocketAddr>,
    faults: Mutex<Faults>,
    connections: Mutex<JoinSet<()>>,
    counters: Counters,
}

impl Shared {
    fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn upstream(&self) -> SocketAddr {
        *self.upstream.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn connections(&self) -> MutexGuard<'_, JoinSet<()>> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Returns once no black hole is open.
    async fn out_of_black_hole(&self) {
        loop {
            let until = self.faults().black_hole_until;
            match until {
                Some(until) if Instant::now() < until => tokio::time::sleep_until(until).await,
                _ => return,
            }
        }
    }
}

/// What one connection's two directions share.
#[derive(Debug, Default)]
struct Conn {
    state: Mutex<ConnState>,
    /// Told when server bytes arrive while they are being swallowed.
    replied: Notify,
}

#[derive(Debug, Default)]
struct ConnState {
    hold_until: Option<Instant>,
    inject: Option<Vec<u8>>,
    /// The server's bytes are dropped: the connection is about to be reset.
    swallow: bool,
}

impl Conn {
    fn state(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The relay; it stops (and resets every connection) when dropped.
#[derive(Debug)]
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Listens on a free loopback port and relays every connection to `upstream` (connected
    /// only when a client connects, so the server may start after the relay).
    ///
    /// # Panics
    /// If no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the relay");
        let addr = listener.local_addr().expect("the relay's address");
        let shared = Arc::new(Shared {
            upstream: Mutex::new(upstream),
            faults: Mutex::default(),
            connections: Mutex::new(JoinSet::new()),
            counters: Counters::default(),
        });
        let acceptor = tokio::spawn(accept(listener, Arc::clone(&shared)));
        Self { addr, shared, acceptor }
    }

    /// Where the relay listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the relay connects new connections to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream()
    }

    /// Points the relay at another server, as a managed endpoint's name is pointed at a new
    /// primary after a failover: every connection accepted from now on goes to `upstream`. Open
    /// connections stay with the server they were made to (call [`Relay::reset_all`] to end them,
    /// as an endpoint that moves does); the armed faults stay armed.
    pub fn retarget(&self, upstream: SocketAddr) {
        *self.shared.upstream.lock().unwrap_or_else(PoisonError::into_inner) = upstream;
    }

    /// Closes every open connection at once, with a TCP reset both ways.
    pub fn reset_all(&self) {
        self.shared.connections().abort_all();
    }

    /// Arms `fault`: it strikes the next chunk of bytes a client sends, whichever connection
    /// sends it (after the faults armed before it).
    pub fn arm(&self, fault: Fault) {
        self.shared.faults().armed.push_back((fault, None));
    }

    /// Arms `fault` for `window`: it strikes the next chunk sent within it, or lapses. (A fault
    /// that waited for traffic however long would strike whatever comes first after a quiet
    /// spell — typically the handshake of a client reconnecting — and faults armed on a schedule
    /// would then keep a client from ever reconnecting.)
    pub fn arm_for(&self, fault: Fault, window: Duration) {
        self.shared
            .faults()
            .armed
            .push_back((fault, Some(Instant::now() + window)));
    }

    /// Arms `fault` for the next chunk a client sends that contains `trigger`, whichever
    /// connection sends it and however late: a fault aimed at one command, without racing the
    /// client's other traffic. It strikes before the faults of [`Relay::arm`].
    pub fn arm_on(&self, trigger: &[u8], fault: Fault) {
        self.shared.faults().armed_on = Some(Armed {
            trigger: trigger.to_vec(),
            what: fault,
        });
    }

    /// How many armed faults have neither struck nor lapsed yet.
    pub fn armed(&self) -> usize {
        let now = Instant::now();
        let mut faults = self.shared.faults();
        faults.armed.retain(|(_, until)| until.is_none_or(|until| now < until));
        faults.armed.len()
    }

    /// Takes back the faults that have not struck.
    pub fn disarm(&self) {
        let mut faults = self.shared.faults();
        faults.armed.clear();
        faults.armed_on = None;
    }

    /// Opens a black hole for `duration`: no byte moves either way and new connections do not
    /// reach the server until it closes; then everything held flows on, in order (as a network
    /// partition that heals: TCP retransmits what was lost). A client that gave up meanwhile
    /// finds its connection dead afterwards, but what it sent is still delivered.
    pub fn black_hole(&self, duration: Duration) {
        let until = Instant::now() + duration;
        let mut faults = self.shared.faults();
        faults.black_hole_until = Some(faults.black_hole_until.map_or(until, |open| open.max(until)));
        self.shared.counters.black_holes.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether a black hole is open now.
    pub fn in_black_hole(&self) -> bool {
        self.shared
            .faults()
            .black_hole_until
            .is_some_and(|until| Instant::now() < until)
    }

    /// For the next `window`, every connection whose client sends `trigger` gets its replies held
    /// for `duration` from that moment (the server's bytes wait in the relay, then flow again, in
    /// order): a stall of the connections made during the window, once they are in use. A
    /// connection whose hold has ended is held again by its next `trigger` within the window, so
    /// a window longer than `duration` makes every such request slow.
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
        self.shared.counters.accepted.load(Ordering::SeqCst)
    }

    /// How many chunks of bytes clients sent through the relay (each a command or a few).
    pub fn chunks(&self) -> usize {
        self.shared.counters.chunks.load(Ordering::SeqCst)
    }

    /// On how many connections a hold struck.
    pub fn holds(&self) -> usize {
        self.shared.counters.holds.load(Ordering::SeqCst)
    }

    /// How many replies were injected.
    pub fn injections(&self) -> usize {
        self.shared.counters.injections.load(Ordering::SeqCst)
    }

    /// The faults that struck so far (armed ones and black holes).
    pub fn faults(&self) -> FaultCount {
        let counters = &self.shared.counters;
        FaultCount {
            resets_before: counters.resets_before.load(Ordering::SeqCst),
            resets_after: counters.resets_after.load(Ordering::SeqCst),
            delays: counters.delays.load(Ordering::SeqCst),
            black_holes: counters.black_holes.load(Ordering::SeqCst),
        }
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
        shared.counters.accepted.fetch_add(1, Ordering::SeqCst);
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
    shared.out_of_black_hole().await;
    let Ok(server) = TcpStream::connect(shared.upstream()).await else {
        return;
    };
    let _ = server.set_zero_linger();
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let conn = Arc::new(Conn::default());
    let requests = requests(client_read, server_write, Arc::clone(&shared), Arc::clone(&conn));
    let replies = replies(server_read, client_write, Arc::clone(&shared), conn);
    // Either direction ending ends the connection (both sockets are dropped: reset).
    tokio::select! {
        () = requests => {}
        () = replies => {}
    }
}

/// Client to server: applies the armed faults and watches for the triggers.
async fn requests(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, shared: Arc<Shared>, conn: Arc<Conn>) {
    let mut buf = vec![0u8; 64 * 1024];
    // The end of the previous chunk, so that a trigger split between two reads is still seen.
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        shared.counters.chunks.fetch_add(1, Ordering::SeqCst);
        let mut window = std::mem::take(&mut tail);
        window.extend_from_slice(&buf[..n]);
        let fault = {
            let mut faults = shared.faults();
            let mut this = conn.state();
            if let Some(hold) = &faults.hold
                && this.hold_until.is_none_or(|until| until <= Instant::now())
                && Instant::now() < hold.until
                && contains(&window, &hold.armed.trigger)
            {
                // Set before the request goes on: its reply cannot be on its way yet.
                this.hold_until = Some(Instant::now() + hold.armed.what);
                shared.counters.holds.fetch_add(1, Ordering::SeqCst);
            }
            if faults
                .inject
                .as_ref()
                .is_some_and(|armed| contains(&window, &armed.trigger))
            {
                let armed = faults.inject.take().expect("armed");
                this.inject = Some(armed.what);
                shared.counters.injections.fetch_add(1, Ordering::SeqCst);
            }
            let now = Instant::now();
            let fault = if faults
                .armed_on
                .as_ref()
                .is_some_and(|armed| contains(&window, &armed.trigger))
            {
                faults.armed_on.take().map(|armed| armed.what)
            } else {
                std::iter::from_fn(|| faults.armed.pop_front())
                    .find(|(_, until)| until.is_none_or(|until| now < until))
                    .map(|(fault, _)| fault)
            };
            if fault == Some(Fault::ResetAfterReply) {
                // Set before the request goes on, so that no byte of its reply gets through.
                this.swallow = true;
            }
            fault
        };
        let keep = window.len().min(64);
        tail = window[window.len() - keep..].to_vec();
        match fault {
            Some(Fault::ResetBeforeForward) => {
                shared.counters.resets_before.fetch_add(1, Ordering::SeqCst);
                return;
            }
            Some(Fault::Delay(pause)) => {
                shared.counters.delays.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(pause).await;
            }
            Some(Fault::ResetAfterReply) | None => {}
        }
        shared.out_of_black_hole().await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        if fault == Some(Fault::ResetAfterReply) {
            if tokio::time::timeout(REPLY_WAIT, conn.replied.notified()).await.is_ok() {
                tokio::time::sleep(REPLY_SETTLE).await;
            }
            shared.counters.resets_after.fetch_add(1, Ordering::SeqCst);
            return;
        }
    }
}

/// Server to client: applies the connection's hold, injection and swallowing.
async fn replies(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, shared: Arc<Shared>, conn: Arc<Conn>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                // Keep the connection open while a lost reply is awaited: the reset comes from
                // the other direction.
                if conn.state().swallow {
                    conn.replied.notify_one();
                    std::future::pending::<()>().await;
                }
                return;
            }
            Ok(n) => n,
        };
        let (hold_until, inject, swallow) = {
            let mut this = conn.state();
            (this.hold_until, this.inject.take(), this.swallow)
        };
        if swallow {
            conn.replied.notify_one();
            continue;
        }
        if let Some(until) = hold_until {
            tokio::time::sleep_until(until).await;
        }
        shared.out_of_black_hole().await;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers every chunk with `ok:<chunk>` and counts the chunks it received.
    async fn echo_server() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&received);
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                let counter = Arc::clone(&counter);
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = socket.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                        counter.fetch_add(1, Ordering::SeqCst);
                        let mut reply = b"ok:".to_vec();
                        reply.extend_from_slice(&buf[..n]);
                        if socket.write_all(&reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, received)
    }

    /// Sends `what` and reads one reply (an error if the connection broke).
    async fn ask(socket: &mut TcpStream, what: &[u8]) -> std::io::Result<Vec<u8>> {
        socket.write_all(what).await?;
        let mut buf = [0u8; 1024];
        match socket.read(&mut buf).await? {
            0 => Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => Ok(buf[..n].to_vec()),
        }
    }

    async fn settle(received: &AtomicUsize, n: usize) {
        for _ in 0..100 {
            if received.load(Ordering::SeqCst) >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn every_fault_strikes_as_described() {
        let (server, received) = echo_server().await;
        let relay = Relay::start(server).await;
        let mut socket = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(ask(&mut socket, b"a").await.unwrap(), b"ok:a");

        relay.arm(Fault::ResetBeforeForward);
        assert!(ask(&mut socket, b"b").await.is_err(), "the connection was reset");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(received.load(Ordering::SeqCst), 1, "b never reached the server");

        let mut socket = TcpStream::connect(relay.addr()).await.unwrap();
        relay.arm(Fault::ResetAfterReply);
        assert!(ask(&mut socket, b"c").await.is_err(), "the reply was lost");
        settle(&received, 2).await;
        assert_eq!(received.load(Ordering::SeqCst), 2, "c reached the server");

        let mut socket = TcpStream::connect(relay.addr()).await.unwrap();
        relay.arm(Fault::Delay(Duration::from_millis(300)));
        let started = Instant::now();
        assert_eq!(ask(&mut socket, b"d").await.unwrap(), b"ok:d");
        assert!(started.elapsed() >= Duration::from_millis(300));

        relay.black_hole(Duration::from_millis(400));
        let started = Instant::now();
        assert_eq!(ask(&mut socket, b"e").await.unwrap(), b"ok:e");
        let mut late = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(ask(&mut late, b"f").await.unwrap(), b"ok:f");
        assert!(
            started.elapsed() >= Duration::from_millis(350),
            "{:?}",
            started.elapsed()
        );

        assert_eq!(
            relay.faults(),
            FaultCount {
                resets_before: 1,
                resets_after: 1,
                delays: 1,
                black_holes: 1
            }
        );
        assert_eq!(relay.armed(), 0);

        relay.arm_for(Fault::ResetBeforeForward, Duration::from_millis(50));
        assert_eq!(relay.armed(), 1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(relay.armed(), 0, "the fault lapsed");
        assert_eq!(ask(&mut socket, b"g").await.unwrap(), b"ok:g");
        assert_eq!(relay.faults().resets_before, 1);
    }

    #[tokio::test]
    async fn a_retargeted_relay_sends_new_connections_to_the_new_server() {
        let (first, to_first) = echo_server().await;
        let (second, to_second) = echo_server().await;
        let relay = Relay::start(first).await;
        let mut old = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(ask(&mut old, b"a").await.unwrap(), b"ok:a");

        relay.retarget(second);
        assert_eq!(relay.upstream(), second);
        let mut new = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(ask(&mut new, b"b").await.unwrap(), b"ok:b");
        assert_eq!(ask(&mut old, b"c").await.unwrap(), b"ok:c", "an open connection stays");
        assert_eq!(to_first.load(Ordering::SeqCst), 2, "a and c went to the first server");
        assert_eq!(to_second.load(Ordering::SeqCst), 1, "b went to the second server");

        relay.reset_all();
        assert!(ask(&mut old, b"d").await.is_err(), "reset_all ends the old connection");
        let mut again = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(ask(&mut again, b"e").await.unwrap(), b"ok:e");
        assert_eq!(to_first.load(Ordering::SeqCst), 2);
        assert_eq!(to_second.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_fault_armed_on_a_trigger_waits_for_it() {
        let (server, received) = echo_server().await;
        let relay = Relay::start(server).await;
        let mut socket = TcpStream::connect(relay.addr()).await.unwrap();
        relay.arm_on(b"flush", Fault::ResetBeforeForward);
        assert_eq!(ask(&mut socket, b"a").await.unwrap(), b"ok:a", "not the trigger");
        assert_eq!(ask(&mut socket, b"b").await.unwrap(), b"ok:b");
        assert!(ask(&mut socket, b"a flush").await.is_err(), "the trigger was reset");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            received.load(Ordering::SeqCst),
            2,
            "the trigger never reached the server"
        );
        assert_eq!(relay.faults().resets_before, 1);

        let mut socket = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(
            ask(&mut socket, b"flush").await.unwrap(),
            b"ok:flush",
            "it strikes once"
        );
    }
}
