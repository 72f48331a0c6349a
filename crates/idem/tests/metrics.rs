//! What `/metrics` of a running `idem serve` offers an operator: histograms (which add up across
//! instances, unlike summaries) for store, upstream and wait latencies, counters ending in
//! `_total`, gauges for what is in progress, requests counted by route pattern, and label values
//! that stay few whatever the traffic.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{Gateway, Upstream, new_key, send, wait_for_count};

/// `# TYPE name kind` lines of a scrape.
fn families(scrape: &str) -> BTreeMap<String, String> {
    scrape
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| {
            let (name, kind) = rest.split_once(' ')?;
            Some((name.to_owned(), kind.to_owned()))
        })
        .collect()
}

/// The distinct label sets of one family's samples (for a histogram, of its `_count` samples).
fn series(scrape: &str, family: &str, kind: &str) -> BTreeSet<String> {
    let sample = if kind == "histogram" {
        format!("{family}_count")
    } else {
        family.to_owned()
    };
    scrape
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split_once(' ').map(|(name, _)| name))
        .filter(|name| name.split('{').next() == Some(sample.as_str()))
        .map(|name| {
            name.split_once('{')
                .map_or(String::new(), |(_, labels)| labels.to_owned())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_aggregatable_and_their_labels_stay_bounded() {
    let upstream = Upstream::start().await;
    // Requests are counted by route: its pattern, never the raw path.
    let dir = tempfile::tempdir().expect("a temp dir");
    let config = dir.path().join("idem.toml");
    std::fs::write(&config, "[[route]]\npath = \"/orders/{id}/pay\"\n").expect("write the config");
    let gw = Gateway::start(
        &upstream.url(),
        &["--wait", "10s", "--config", config.to_str().unwrap()],
    )
    .await;

    // A copy that waits for the first, so the wait histogram has a sample.
    let key = new_key();
    let request = || gw.keyed("/pay?delay=500", key.as_str(), "{}");
    let first = tokio::spawn(send(request()));
    wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;
    let copy = send(request()).await;
    assert!(copy.replayed(), "{copy}");
    first.await.unwrap();

    // A thousand distinct raw paths, keyed: none of them may become a label value.
    let paths: Vec<_> = (0..1000).map(|i| format!("/orders/{i}/pay")).collect();
    for chunk in paths.chunks(50) {
        let sends: Vec<_> = chunk
            .iter()
            .map(|path| {
                let request = gw.post(path, "{}").header("idempotency-key", new_key());
                tokio::spawn(send(request))
            })
            .collect();
        for sent in sends {
            let reply = sent.await.unwrap();
            assert!(reply.status < 500, "{reply}");
        }
    }

    let scrape = send(gw.client.get(format!("{}/metrics", gw.admin))).await.text();
    let kinds = families(&scrape);
    for (family, kind) in [
        ("idem_store_operation_seconds", "histogram"),
        ("idem_upstream_seconds", "histogram"),
        ("idem_wait_seconds", "histogram"),
        ("idem_requests_total", "counter"),
        ("idem_runs_in_flight", "gauge"),
        ("idem_waiters", "gauge"),
        ("idem_connections_open", "gauge"),
    ] {
        assert_eq!(
            kinds.get(family).map(String::as_str),
            Some(kind),
            "{family} is a {kind}; the families: {kinds:?}"
        );
    }
    for (family, kind) in &kinds {
        if kind == "counter" {
            assert!(family.ends_with("_total"), "a counter's name ends in _total: {family}");
        }
        assert_ne!(kind, "summary", "{family}: summaries cannot be summed across instances");
        let sets = series(&scrape, family, kind);
        assert!(
            sets.len() <= 16,
            "{family} has {} label sets after 1 000 distinct paths: {sets:?}",
            sets.len()
        );
        assert!(
            sets.iter()
                .all(|labels| !labels.contains("/orders/") || labels.contains("/orders/{id}/pay")),
            "{family} carries a raw path as a label: {sets:?}"
        );
    }
    let requests = series(&scrape, "idem_requests_total", "counter");
    for expected in [
        r#"outcome="new",route="/orders/{id}/pay"}"#,
        r#"outcome="new",route="default"}"#,
        r#"outcome="waited",route="default"}"#,
    ] {
        assert!(
            requests.contains(expected),
            "idem_requests_total{{{expected} is counted: {requests:?}"
        );
    }
    assert!(
        scrape.contains("idem_runs_in_flight 0") && scrape.contains("idem_waiters 0"),
        "nothing is in progress any more:\n{scrape}"
    );
}
