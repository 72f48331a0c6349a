//! Sentinel and store URLs from a hostile side (each test here failed when a breaker wrote it): a
//! password with `#` or `?` in it is never printed; a stale sentinel listed first does not keep the
//! store from the primary the others name; a sentinel is never asked on a default port; with every
//! replica acknowledging, no promotion loses a claim. They start their own servers
//! (`idem_test_support::replicated`) where they need any.

use std::net::SocketAddr;
use std::time::Duration;

use idem_core::testkit::{acquire, claim, fingerprint, fresh_id};
use idem_core::{Store, StoreError, UnixMillis, store::FencingToken};
use idem_redis::RedisStore;
use idem_test_support::redis_store::fresh_prefix;
use idem_test_support::replicated::{ReplicatedRedis, Role};
use idem_test_support::servers::with_options;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The error a store URL gets, as `idem serve` would print it.
async fn connect_error(url: &str) -> String {
    match tokio::time::timeout(Duration::from_secs(20), RedisStore::connect(url)).await {
        Ok(Ok(_)) => panic!("{url} connected"),
        Ok(Err(err)) => format!("{err} / {err:?}"),
        Err(_) => panic!("{url} hung"),
    }
}

/// A password with a `#` or a `?` that its owner forgot to percent-encode is a hostile but
/// ordinary spelling: the URL is refused, and the error shows it with the password masked.
#[tokio::test]
async fn a_password_with_a_hash_or_question_mark_is_never_printed() {
    for url in [
        "redis://:hunter#TOPSECRET1@127.0.0.1:6379/0",
        "redis://:hunter?TOPSECRET2@127.0.0.1:6379/0",
        "redis+sentinel://:se#TOPSECRET3@127.0.0.1:26379,127.0.0.1:26380/idem",
        "redis+sentinel://app:se?TOPSECRET4@127.0.0.1:26379/idem?replicas=1",
        "redis+cluster://:x#TOPSECRET5@127.0.0.1:7000,127.0.0.1:7001",
    ] {
        let message = connect_error(url).await;
        assert!(
            !message.contains("TOPSECRET"),
            "the error for a URL whose password has a # or ? prints the password: {message}"
        );
    }
}

/// A sentinel that keeps naming `primary` (a sentinel cut off from its peers on the old primary's
/// side of a partition answers exactly so): `SENTINEL get-master-addr-by-name` gets `primary`,
/// every other command `+OK`.
async fn stale_sentinel(primary: SocketAddr) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = socket.read(&mut chunk).await else { return };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    // Answer every complete command in the buffer (arrays of bulk strings).
                    while let Some((args, used)) = parse_command(&buf) {
                        buf.drain(..used);
                        let reply = if args.first().is_some_and(|a| a.eq_ignore_ascii_case("SENTINEL")) {
                            let (host, port) = (primary.ip().to_string(), primary.port().to_string());
                            format!("*2\r\n${}\r\n{host}\r\n${}\r\n{port}\r\n", host.len(), port.len())
                        } else {
                            "+OK\r\n".to_owned()
                        };
                        if socket.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

fn parse_command(buf: &[u8]) -> Option<(Vec<String>, usize)> {
    let line = |at: usize| -> Option<(&[u8], usize)> {
        let end = buf[at..].windows(2).position(|w| w == b"\r\n")? + at;
        Some((&buf[at..end], end + 2))
    };
    let (head, mut at) = line(0)?;
    let count: usize = std::str::from_utf8(head.strip_prefix(b"*")?).ok()?.parse().ok()?;
    let mut args = Vec::with_capacity(count);
    for _ in 0..count {
        let (len, next) = line(at)?;
        let len: usize = std::str::from_utf8(len.strip_prefix(b"$")?).ok()?.parse().ok()?;
        if buf.len() < next + len + 2 {
            return None;
        }
        args.push(String::from_utf8_lossy(&buf[next..next + len]).into_owned());
        at = next + len + 2;
    }
    Some((args, at))
}

/// Three real sentinels agree on the new primary after a failover; a fourth, listed first, was
/// cut off from them and still names the old primary (which came back as a replica). The store
/// asks every sentinel and goes where most of them point, so the stale one keeps no new store
/// (an `idem serve` restart, an `idem inspect`) away from the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stale_sentinel_listed_first_does_not_keep_the_store_away_from_the_new_primary() {
    let mut redis = ReplicatedRedis::start_with_sentinels(1, 3).await;
    let old = redis.primary();
    let stale = stale_sentinel(redis.node_addr(old)).await;
    redis.kill(old);
    let promoted = redis.wait_for_failover(Duration::from_secs(30)).await;
    redis.restart_as_replica_of(old, promoted).await;
    assert_eq!(redis.role(old).await, Some(Role::Replica));

    let url = redis
        .sentinel_url()
        .replacen("redis+sentinel://", &format!("redis+sentinel://{stale},"), 1);
    let url = with_options(&url, &format!("prefix={}", fresh_prefix()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let store = loop {
        match tokio::time::timeout(Duration::from_secs(10), RedisStore::connect(&url)).await {
            Ok(Ok(store)) => break store,
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "3 of 4 sentinels name the new primary, yet the store cannot connect for 15 s: {:?}",
                other.map(|r| r.map(|_| ()))
            ),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let (id, fp) = (fresh_id(), fingerprint("{}"));
    store
        .begin(claim(&id, &fp, UnixMillis::now(), FencingToken::random()))
        .await
        .expect("a claim on the new primary");
}

/// With two replicas, `replicas=1` survives the loss of the primary only if the replica promoted
/// acknowledged (a breaker showed Sentinel promoting the lagging one when the other was paused):
/// `replicas=2`, every replica, survives any promotion. One replica is cut off, so a claim is
/// refused (one acknowledgement of two); the replica that has everything is paused; the primary
/// is killed; Sentinel promotes the lagging replica; every claim made before is on it, and the
/// refused one, never acted on, is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_replica_acknowledging_no_promotion_loses_a_claim() {
    let mut redis = ReplicatedRedis::start_with_sentinels(2, 3).await;
    let url = with_options(&redis.sentinel_url(), "replicas=2");
    let store = RedisStore::connect(&with_options(&url, &format!("prefix={}", fresh_prefix())))
        .await
        .expect("connect");
    let (old, up_to_date, lagging) = (redis.primary(), redis.replicas()[0], redis.replicas()[1]);
    let (kept, refused, fp, now) = (fresh_id(), fresh_id(), fingerprint("{}"), UnixMillis::now());
    let token = acquire(&store, &kept, &fp, now).await;

    redis.isolate(lagging).await;
    let begun = store.begin(claim(&refused, &fp, now, FencingToken::random())).await;
    assert!(
        matches!(&begun, Err(StoreError::Unavailable(err)) if err.to_string().contains("acknowledged")),
        "one replica of two acknowledged: {begun:?}"
    );
    redis.freeze(up_to_date);
    redis.kill(old);
    redis.thaw(lagging);
    let promoted = redis.wait_for_failover(Duration::from_secs(40)).await;
    redis.thaw(up_to_date);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let record = loop {
        match store.get(&kept).await {
            Ok(record) => break record,
            Err(err) => assert!(tokio::time::Instant::now() < deadline, "not back: {err}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let record = record.unwrap_or_else(|| panic!("the claim both replicas acknowledged is on node {promoted}"));
    assert!(
        matches!(record.state, idem_core::store::RecordState::InFlight { token: held, .. } if held == token),
        "{record:?}"
    );
    assert!(
        store.get(&refused).await.expect("get").is_none(),
        "the refused claim was never acted on"
    );
}

/// A sentinel without a port is refused, an IPv6 literal as an IPv4 one, rather than asked on the
/// client's default port (6379, an ordinary Redis).
#[tokio::test]
async fn an_ipv6_sentinel_without_a_port_is_refused_as_an_ipv4_one_is() {
    let v4 = connect_error("redis+sentinel://127.0.0.1/idem").await;
    assert!(v4.contains("has no port"), "{v4}");
    let v6 = connect_error("redis+sentinel://[::1]/idem").await;
    assert!(
        v6.contains("has no port"),
        "an IPv6 sentinel without a port is taken for [::1]:6379: {v6}"
    );
}
