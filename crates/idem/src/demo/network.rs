//! The faulty network between the clients and the gateways: a round-robin TCP balancer that, for
//! some attempts, resets the connection before the request arrives or drops the answer after the
//! gateway sent it (so after the payment went through).
//!
//! An attempt's fate is a function of the seed, the payment (read from the request line) and how
//! many attempts of that payment came before, so one seed gives the same faults in every set-up.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Attempts of one payment from this one on always get through: the network is bad, not
/// malicious, so every client that keeps retrying ends up heard.
const FAULTY_ATTEMPTS: u32 = 3;

/// The longest request head the balancer reads before deciding.
const MAX_REQUEST_LINE: usize = 8 * 1024;

/// What the network does to one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fate {
    /// Delivered, both ways.
    Deliver,
    /// The connection is reset before the request reaches a gateway.
    Reset,
    /// The request is delivered and answered, and the answer is lost on its way back.
    DropAnswer,
}

/// The seeded fault plan.
#[derive(Debug, Clone, Copy)]
pub(super) struct Faults {
    pub(super) seed: u64,
    pub(super) drop_rate: f64,
    pub(super) reset_rate: f64,
}

impl Faults {
    /// The fate of attempt `attempt` (0 for the first) of `payment`.
    pub(super) fn fate(&self, payment: u64, attempt: u32) -> Fate {
        if attempt >= FAULTY_ATTEMPTS {
            return Fate::Deliver;
        }
        let draw = unit(mix(self.seed
            ^ mix(payment.wrapping_add(0x9e37_79b9))
            ^ mix(u64::from(attempt) << 48)));
        if draw < self.reset_rate {
            Fate::Reset
        } else if draw < self.reset_rate + self.drop_rate {
            Fate::DropAnswer
        } else {
            Fate::Deliver
        }
    }
}

/// SplitMix64's finaliser: a well-spread hash of one number.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A number in `[0, 1)` from 53 bits of `bits`.
fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// What the network did.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) resets: AtomicU64,
    pub(super) dropped_answers: AtomicU64,
}

#[derive(Debug)]
struct Shared {
    backends: Mutex<Vec<SocketAddr>>,
    next: AtomicUsize,
    faults: Faults,
    attempts: Mutex<HashMap<u64, u32>>,
    counters: Counters,
}

/// The balancer; stops accepting when dropped.
#[derive(Debug)]
pub(super) struct Balancer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Balancer {
    /// Starts on an ephemeral port of 127.0.0.1, spreading connections over `backends`.
    pub(super) async fn start(backends: Vec<SocketAddr>, faults: Faults) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot listen for the balancer")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            backends: Mutex::new(backends),
            next: AtomicUsize::new(0),
            faults,
            attempts: Mutex::new(HashMap::new()),
            counters: Counters::default(),
        });
        let task = tokio::spawn({
            let shared = shared.clone();
            async move {
                loop {
                    match listener.accept().await {
                        Ok((client, _)) => {
                            tokio::spawn(relay(shared.clone(), client));
                        }
                        Err(err) => {
                            // Out of file descriptors, for instance: wait instead of spinning.
                            tracing::warn!(error = %err, "the balancer could not accept a connection");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
            }
        });
        Ok(Self { addr, shared, task })
    }

    /// `http://127.0.0.1:PORT`.
    pub(super) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Points backend `index` at a new address (a restarted instance).
    pub(super) fn replace(&self, index: usize, addr: SocketAddr) {
        self.shared.backends.lock().unwrap_or_else(PoisonError::into_inner)[index] = addr;
    }

    pub(super) fn counters(&self) -> &Counters {
        &self.shared.counters
    }
}

impl Shared {
    fn fate(&self, payment: u64) -> Fate {
        let attempt = {
            let mut attempts = self.attempts.lock().unwrap_or_else(PoisonError::into_inner);
            let seen = attempts.entry(payment).or_default();
            *seen += 1;
            *seen - 1
        };
        self.faults.fate(payment, attempt)
    }

    /// A connection to the next backend that accepts one, in round-robin order; a dead instance
    /// refuses at once and is skipped, as a load balancer's health check would.
    async fn connect(&self) -> Option<TcpStream> {
        let count = self.backends.lock().unwrap_or_else(PoisonError::into_inner).len();
        for _ in 0..count {
            let index = self.next.fetch_add(1, Ordering::Relaxed) % count;
            let addr = self.backends.lock().unwrap_or_else(PoisonError::into_inner)[index];
            if let Ok(Ok(stream)) = tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr)).await {
                let _ = stream.set_nodelay(true);
                return Some(stream);
            }
        }
        None
    }
}

/// Relays one client connection to a gateway, applying its attempt's fate.
async fn relay(shared: Arc<Shared>, mut client: TcpStream) {
    let _ = client.set_nodelay(true);
    let mut head = Vec::with_capacity(1024);
    while !head.windows(2).any(|w| w == b"\r\n") && head.len() < MAX_REQUEST_LINE {
        let mut buf = [0u8; 2048];
        match client.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let fate = payment_of(&head).map_or(Fate::Deliver, |payment| shared.fate(payment));
    if fate == Fate::Reset {
        shared.counters.resets.fetch_add(1, Ordering::Relaxed);
        return reset(client);
    }
    let Some(mut gateway) = shared.connect().await else {
        return reset(client);
    };
    if gateway.write_all(&head).await.is_err() {
        return reset(client);
    }
    match fate {
        Fate::DropAnswer => {
            let answered = {
                let (mut from_client, _) = client.split();
                let (mut from_gateway, mut to_gateway) = gateway.split();
                let mut first = [0u8; 1];
                tokio::select! {
                    _ = tokio::io::copy(&mut from_client, &mut to_gateway) => false,
                    read = from_gateway.read(&mut first) => matches!(read, Ok(n) if n > 0),
                }
            };
            if answered {
                shared.counters.dropped_answers.fetch_add(1, Ordering::Relaxed);
            }
            reset(client);
        }
        Fate::Deliver | Fate::Reset => {
            if tokio::io::copy_bidirectional(&mut client, &mut gateway).await.is_err() {
                // The gateway went away mid-answer (a crash): the client sees its connection reset.
                reset(client);
            }
        }
    }
}

/// Closes the connection with a TCP reset instead of an orderly close.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// The payment of a request line such as `POST /pay?payment=17 HTTP/1.1`.
fn payment_of(head: &[u8]) -> Option<u64> {
    let line = head.split(|&b| b == b'\r').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let target = line.split(' ').nth(1)?;
    let (_, query) = target.split_once('?')?;
    query
        .split('&')
        .find_map(|pair| pair.strip_prefix("payment="))
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_payment_from_the_request_line() {
        assert_eq!(payment_of(b"POST /pay?payment=17 HTTP/1.1\r\nhost: x\r\n"), Some(17));
        assert_eq!(payment_of(b"POST /pay?a=1&payment=3 HTTP/1.1\r\n"), Some(3));
        assert_eq!(payment_of(b"POST /pay HTTP/1.1\r\n"), None);
        assert_eq!(payment_of(b"GET /?payment=x HTTP/1.1\r\n"), None);
    }

    #[test]
    fn fates_follow_the_seed_and_the_rates() {
        let faults = Faults {
            seed: 42,
            drop_rate: 0.2,
            reset_rate: 0.1,
        };
        let fates: Vec<Fate> = (0..10_000).map(|p| faults.fate(p, 0)).collect();
        let share = |fate| fates.iter().filter(|&&f| f == fate).count() as f64 / fates.len() as f64;
        assert!(
            (share(Fate::DropAnswer) - 0.2).abs() < 0.02,
            "{}",
            share(Fate::DropAnswer)
        );
        assert!((share(Fate::Reset) - 0.1).abs() < 0.02, "{}", share(Fate::Reset));
        assert_eq!(fates, (0..10_000).map(|p| faults.fate(p, 0)).collect::<Vec<_>>());
        let other = Faults { seed: 43, ..faults };
        assert_ne!(fates, (0..10_000).map(|p| other.fate(p, 0)).collect::<Vec<_>>());
    }

    #[test]
    fn late_attempts_always_get_through() {
        let faults = Faults {
            seed: 1,
            drop_rate: 0.5,
            reset_rate: 0.5,
        };
        assert!((0..100).all(|p| faults.fate(p, 0) != Fate::Deliver));
        assert!((0..100).all(|p| faults.fate(p, FAULTY_ATTEMPTS) == Fate::Deliver));
    }
}
