//! What a failover can lose, read from the test server when a store connects: the test server
//! has no standby, and a `synchronous_commit` set in the URL is the one the store's commits use.

use idem_postgres::{Replication, SynchronousCommit};
use idem_test_support::postgres_store::{TestSchema, raw_client};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_standbys_is_standalone() {
    let schema = TestSchema::new();
    let store = schema.connect("pool_size=1&notify=off").await;
    assert_eq!(
        store.replication(),
        &Replication::Standalone {
            commit: SynchronousCommit::On
        },
        "the test server (bash .ci/services) has no standby and the default synchronous_commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_commit_off_in_the_url_is_what_the_store_reads() {
    let schema = TestSchema::new();
    let store = schema
        .connect("pool_size=1&notify=off&options=-c%20synchronous_commit%3Doff")
        .await;
    assert_eq!(
        store.replication(),
        &Replication::Standalone {
            commit: SynchronousCommit::Off
        }
    );
    // The store's own sessions commit that way: the setting was read on one of them.
    let client = raw_client(&schema.url("options=-c%20synchronous_commit%3Doff")).await;
    let seen: String = client.query_one("SHOW synchronous_commit", &[]).await.unwrap().get(0);
    assert_eq!(seen, "off");
}
