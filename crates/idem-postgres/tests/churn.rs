//! One key claimed and released over and over by several stores at once: the record often
//! disappears between a begin's conflicting insert and its read, which `begin` must survive
//! (by trying again) without ever handing out two claims at the same time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::testkit::{begin, fingerprint, fresh_id};
use idem_core::{
    Store, UnixMillis,
    store::{Begin, Release},
};
use idem_test_support::postgres_store::TestSchema;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_stay_exclusive_while_the_record_comes_and_goes() {
    let schema = TestSchema::new();
    let stores = [schema.connect("pool_size=4").await, schema.connect("pool_size=4").await];
    let (id, fp) = (fresh_id(), fingerprint("a"));
    let holders = Arc::new(AtomicUsize::new(0));
    let claims = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            let (store, id, fp) = (stores[i % 2].clone(), id.clone(), fp.clone());
            let (holders, claims) = (Arc::clone(&holders), Arc::clone(&claims));
            tokio::spawn(async move {
                for _ in 0..40 {
                    let (begun, token) = begin(&store, &id, &fp, UnixMillis::now()).await;
                    if let Begin::Acquired { recovered } = begun {
                        assert!(!recovered, "nobody's lease ran out");
                        let others = holders.fetch_add(1, Ordering::SeqCst);
                        assert_eq!(others, 0, "two claims on one record at once");
                        claims.fetch_add(1, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                        holders.fetch_sub(1, Ordering::SeqCst);
                        store.release(&id, token, Release::Forget).await.expect("release");
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("no begin failed and no claim overlapped");
    }
    assert!(claims.load(Ordering::SeqCst) > 6, "the key was claimed again and again");
    assert!(stores[0].get(&id).await.expect("get").is_none());
}
