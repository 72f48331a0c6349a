//! Hostile tests of the replica/Sentinel change (branch break26): each test here failed when it
//! was written. They start their own servers (`idem_test_support::replicated`) where they need
//! any.

use std::time::Duration;

use idem_redis::RedisStore;

/// The error a store URL gets, as `idem serve` would print it.
async fn connect_error(url: &str) -> String {
    match tokio::time::timeout(Duration::from_secs(20), RedisStore::connect(url)).await {
        Ok(Ok(_)) => panic!("{url} connected"),
        Ok(Err(err)) => format!("{err} / {err:?}"),
        Err(_) => panic!("{url} hung"),
    }
}

/// A password with a `#` or a `?` that its owner forgot to percent-encode is a hostile but
/// ordinary spelling. `redact_url` cuts the URL at the first `?`/`#` before it looks for the
/// userinfo, so it finds no `@` and masks nothing; the URL parser then refuses the URL and the
/// error prints the "redacted" URL (and, for `?`, the option name) — the password in clear.
/// Sentinel URLs (the new scheme) leak the same way.
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

mod common;

use std::net::SocketAddr;

use common::{fresh_prefix, with_options};
use idem_core::testkit::{acquire, claim, fingerprint, fresh_id};
use idem_core::{Store, UnixMillis, store::FencingToken};
use idem_test_support::replicated::{ReplicatedRedis, Role};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
/// asks the sentinels "in turn" but takes the first answer, checks `ROLE` there, and fails —
/// without asking the next sentinel. So a single stale sentinel at the head of the list keeps
/// every new store (every `idem serve` restart, every `idem inspect`/`idem delete`) unavailable
/// for as long as it is stale, although the majority names the primary.
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

/// The documentation says `replicas=1` survives the loss of the primary "when the replica promoted
/// is one that acknowledged (Sentinel and Cluster promote the most up-to-date replica unless
/// `replica-priority` says otherwise)". Sentinel promotes the most up-to-date replica *it can
/// reach*: with two replicas, one cut off (lagging) and the one that acknowledged paused for a
/// few seconds when the primary dies, Sentinel promotes the lagging one, with no
/// `replica-priority` involved — and an acknowledged claim is gone: the retry is a fresh claim,
/// i.e. the key runs again at the upstream without `Idempotency-Recovered`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_sentinel_an_acknowledged_claim_survives_the_loss_of_the_primary() {
    let mut redis = ReplicatedRedis::start_with_sentinels(2, 3).await;
    let prefix = fresh_prefix();
    let url = with_options(
        &with_options(&redis.sentinel_url(), "replicas=1"),
        &format!("prefix={prefix}"),
    );
    let store = RedisStore::connect(&url).await.expect("connect");
    let (old, acked, lagging) = (redis.primary(), redis.replicas()[0], redis.replicas()[1]);
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());

    redis.isolate(lagging).await;
    let token = acquire(&store, &id, &fp, now).await;
    // The acknowledged replica has it; the lagging one does not.
    redis.freeze(acked); // a pause (GC, VM steal, a network blip) of the replica that acknowledged
    redis.kill(old);
    redis.thaw(lagging);
    let promoted = redis.wait_for_failover(Duration::from_secs(40)).await;
    let record_key = store.record_keys(&id).record;
    let on_promoted: i64 = redis.command(promoted, redis::cmd("EXISTS").arg(&record_key)).await;
    redis.thaw(acked);
    // What the store itself reads once it has moved to the new primary (a read: no claim made).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let record = loop {
        match store.get(&id).await {
            Ok(record) => break record,
            Err(err) => assert!(tokio::time::Instant::now() < deadline, "not back: {err}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        on_promoted == 1 && record.is_some(),
        "Sentinel promoted node {promoted} (the replica that acknowledged was {acked}, the lagging one {lagging}) \
         without any replica-priority; the acknowledged claim (token {token:?}) is gone from it \
         (EXISTS {record_key} = {on_promoted}, the store reads {record:?}), so a retry claims the key afresh \
         and runs it again without Idempotency-Recovered"
    );
}

/// `redis+sentinel://127.0.0.1/idem` is refused ("the sentinel has no port (sentinels listen on
/// 26379)"), but the same URL with an IPv6 literal passes the check — it looks for a `:` and the
/// address has several — and the store then asks port 6379, an ordinary Redis, for the primary.
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
