//! Slow and stuck clients cannot hold the gateway: `--read-timeout` closes a connection whose head
//! does not come and cuts off a keyed body that does not (`400 body-incomplete`, nothing claimed),
//! `--max-connections` keeps the connections beyond it waiting in the listen queue, and SIGTERM
//! exits within `--shutdown-grace` after letting a running upstream call store its answer.
//! Clients here are raw TCP sockets, so that they can stop halfway through a request.

mod common;

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{Gateway, Reply, count, new_key, send, wait_for_count};
use idem_test_support::wire;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BODY: &str = r#"{"amount":42}"#;

/// A keyed `POST /pay` head announcing `BODY`, without the body.
fn keyed_head(key: &str) -> String {
    format!(
        "POST /pay HTTP/1.1\r\nHost: idem\r\nContent-Type: application/json\r\nIdempotency-Key: {key}\r\nContent-Length: {}\r\n\r\n",
        BODY.len()
    )
}

async fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr).await.expect("connect to the gateway")
}

/// Waits up to `limit` for the server to close `stream` (end of stream or a reset); says when that
/// was seen, or what happened instead.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Result<Instant, String> {
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at((started + limit).into(), stream.read(&mut buf)).await {
            Err(_) => return Err(format!("the connection was still open after {limit:?}")),
            Ok(Ok(0)) => return Ok(Instant::now()),
            Ok(Err(err)) if matches!(err.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                return Ok(Instant::now());
            }
            Ok(Err(err)) => return Err(format!("reading failed: {err}")),
            // An answer (say, hyper's own 408) before the close is fine.
            Ok(Ok(_)) => {}
        }
    }
}

/// Reads one HTTP/1.1 answer from `stream`, waiting at most `limit`.
async fn read_answer(stream: &mut TcpStream, limit: Duration) -> Result<Reply, String> {
    wire::read_answer(stream, limit).await.map(Reply::from)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_send_no_head_in_time_are_disconnected_after_the_read_timeout() {
    let (_upstream, gw, _) = common::start(&["--read-timeout", "1s"]).await;

    let mut half = connect(gw.addr()).await;
    half.write_all(b"POST /pay HTTP/1.1\r\nHost: idem\r\nContent-Ty")
        .await
        .unwrap();
    let half_since = Instant::now();
    // A client that connects and says nothing (the gateway cannot even tell its protocol yet).
    let mut silent = connect(gw.addr()).await;
    let silent_since = Instant::now();
    // A keep-alive connection after its answer: waiting for the next head is waiting too.
    let mut idle = connect(gw.addr()).await;
    idle.write_all(b"GET /pay HTTP/1.1\r\nHost: idem\r\n\r\n")
        .await
        .unwrap();
    let answer = read_answer(&mut idle, Duration::from_secs(10)).await.unwrap();
    assert_eq!(answer.status, 200, "{answer}");
    let idle_since = Instant::now();

    let limit = Duration::from_secs(10);
    let closed = tokio::join!(
        closed_within(&mut half, limit),
        closed_within(&mut silent, limit),
        closed_within(&mut idle, limit),
    );
    for (what, closed, since) in [
        ("half a head", closed.0, half_since),
        ("nothing", closed.1, silent_since),
        ("nothing more after an answer", closed.2, idle_since),
    ] {
        let closed = closed.unwrap_or_else(|err| panic!("a client that sent {what}: {err}"));
        let after = closed.duration_since(since);
        assert!(
            after >= Duration::from_millis(900) && after < Duration::from_secs(4),
            "a client that sent {what} was closed after {after:?}, with a read timeout of 1 s"
        );
    }
    // The gateway serves on, and a request waiting for a slow upstream is not a client that
    // stalls: it outlives the read timeout.
    let reply = send(gw.keyed("/pay?delay=1500", &new_key(), BODY)).await;
    assert_eq!(reply.status, 201, "{reply}");
}

/// Sends `bytes` (a request whose body stops short) to `gw`, whose read timeout is 1 s, and reads
/// its answer: `400 body-incomplete`, once the read timeout has passed.
async fn stall_after(gw: &Gateway, bytes: &str) -> (TcpStream, Reply) {
    let mut client = connect(gw.addr()).await;
    let sent = Instant::now();
    client.write_all(bytes.as_bytes()).await.unwrap();
    let answer = read_answer(&mut client, Duration::from_secs(10)).await.unwrap();
    let waited = sent.elapsed();
    answer.assert_problem(400, "body-incomplete");
    assert!(
        waited >= Duration::from_millis(900),
        "answered after {waited:?}, before the read timeout: {answer}"
    );
    (client, answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_body_that_stalls_is_400_body_incomplete_and_its_key_stays_unclaimed() {
    let (upstream, gw, key) = common::start(&["--read-timeout", "1s"]).await;

    let (mut client, answer) = stall_after(&gw, &format!("{}{}", keyed_head(&key), &BODY[..5])).await;
    assert!(
        answer.detail().contains("read timeout"),
        "the detail says why: {answer}"
    );
    closed_within(&mut client, Duration::from_secs(5))
        .await
        .expect("the connection of a body left unread is closed after the answer");
    assert_eq!(count(&upstream.state.pay), 0, "nothing reached the upstream");

    // Nothing was claimed: the whole request with the same key runs as new, not as a recovery.
    let retry = gw.post_json("/pay", Some(&key), BODY).await;
    assert_eq!(retry.status, 201, "{retry}");
    assert!(!retry.replayed(), "{retry}");
    assert_eq!(retry.header("x-seen-recovered"), None, "not a recovery: {retry}");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_body_dripped_slowly_is_cut_off_once_its_waits_add_up_to_the_read_timeout() {
    let (upstream, gw, key) = common::start(&["--read-timeout", "1s"]).await;

    let (mut reader, mut writer) = connect(gw.addr()).await.into_split();
    let sent = Instant::now();
    // One byte every 250 ms: each comes well within the second, the whole body would take 3 s.
    let drip = tokio::spawn(async move {
        writer.write_all(keyed_head(&key).as_bytes()).await?;
        for byte in BODY.bytes() {
            tokio::time::sleep(Duration::from_millis(250)).await;
            writer.write_all(&[byte]).await?;
        }
        std::io::Result::Ok(writer)
    });
    let data = {
        let mut data = Vec::new();
        let mut buf = [0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(10);
        while !String::from_utf8_lossy(&data).contains("body-incomplete") {
            match tokio::time::timeout_at(deadline.into(), reader.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => data.extend_from_slice(&buf[..n]),
                outcome => panic!(
                    "no body-incomplete answer ({outcome:?}); got {:?}",
                    String::from_utf8_lossy(&data)
                ),
            }
        }
        data
    };
    let waited = sent.elapsed();
    drip.abort();
    let text = String::from_utf8_lossy(&data).into_owned();
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_millis(2500),
        "cut off after {waited:?}: the waits between bytes add up"
    );
    assert_eq!(count(&upstream.state.pay), 0, "nothing reached the upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_max_connections_wait_until_one_closes() {
    let (upstream, gw, _) = common::start(&["--max-connections", "4", "--read-timeout", "60s"]).await;

    let mut held = Vec::new();
    for _ in 0..4 {
        let mut stream = connect(gw.addr()).await;
        stream.write_all(b"POST /pay HTTP/1.1\r\nHost: idem\r\n").await.unwrap();
        held.push(stream);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The fifth connects (the kernel queues it) but is not served while the four stay open.
    let mut fifth = connect(gw.addr()).await;
    fifth
        .write_all(b"GET /pay HTTP/1.1\r\nHost: idem\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(1500), fifth.peek(&mut byte)).await;
    assert!(
        early.is_err(),
        "a fifth connection was served while four were open: {early:?}"
    );
    assert_eq!(count(&upstream.state.pay_get), 0);

    // One closes: the fifth is served.
    drop(held.pop());
    let answer = read_answer(&mut fifth, Duration::from_secs(10)).await.unwrap();
    assert_eq!(answer.status, 200, "{answer}");
    assert!(
        gw.stderr().contains("connection limit reached"),
        "the gateway says it is full:\n{}",
        gw.stderr()
    );

    // And it serves on once the others go.
    drop(held);
    let reply = gw.post_json("/pay", Some(&new_key()), BODY).await;
    assert_eq!(reply.status, 201, "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_within_the_grace_despite_a_stuck_client_and_keeps_the_running_calls_answer() {
    let (upstream, mut gw, key) = common::start(&["--shutdown-grace", "3s"]).await;

    // An upstream call that takes 2 s, running when the signal comes.
    let slow = tokio::spawn(send(gw.keyed("/pay?delay=2000", key.as_str(), BODY)));
    wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;
    // A client stuck in the middle of its body (with the default 30 s read timeout).
    let mut stuck = connect(gw.addr()).await;
    stuck
        .write_all(format!("{}{}", keyed_head(&new_key()), &BODY[..5]).as_bytes())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let signalled = Instant::now();
    gw.terminate();
    // It stops accepting.
    loop {
        match TcpStream::connect(gw.addr()).await {
            Err(err) if err.kind() == ErrorKind::ConnectionRefused => break,
            _ if signalled.elapsed() > Duration::from_secs(2) => {
                panic!("still accepting connections 2 s after SIGTERM")
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let status = gw.wait_exit(Duration::from_secs(20)).await;
    let took = signalled.elapsed();
    assert!(
        status.success(),
        "a graceful shutdown exits 0, got {status:?}; stderr:\n{}",
        gw.stderr()
    );
    assert!(
        took < Duration::from_millis(4500),
        "exited {took:?} after SIGTERM, more than the 3 s grace allows"
    );
    closed_within(&mut stuck, Duration::from_secs(1))
        .await
        .expect("the stuck client's connection is closed");

    let first = slow.await.unwrap();
    assert_eq!(first.status, 201, "the running call's client got its answer: {first}");

    // The answer was stored: a gateway on the same store replays it without calling the upstream.
    let gw2 = Gateway::start_on_store(&upstream.url(), &gw.store, &[]).await;
    let retry = send(gw2.keyed("/pay?delay=2000", key.as_str(), BODY)).await;
    retry.assert_replay_of(&first, "the retry on another gateway");
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_limits_are_refused_at_start_naming_the_flag() {
    for (flag, zero) in [
        ("--read-timeout", "0s"),
        ("--max-connections", "0"),
        ("--shutdown-grace", "0s"),
        ("--upstream-timeout", "0s"),
    ] {
        common::assert_serve_refuses(&[flag, zero], &format!("{flag}: ")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unkeyed_body_that_stalls_is_cut_off_as_the_clients_fault_not_the_upstreams() {
    let (upstream, gw, _) = common::start(&["--read-timeout", "1s"]).await;

    let head = format!(
        "POST /pay HTTP/1.1\r\nHost: idem\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        BODY.len()
    );
    // Passed through, the body streams to the upstream: cutting it off must not read as an
    // upstream failure (a 502 would page someone about a healthy upstream).
    let _ = stall_after(&gw, &format!("{head}{}", &BODY[..5])).await;
    assert_eq!(count(&upstream.state.pay), 0, "the upstream did not act on half a body");
}
