//! Records damaged in ways a hash allows and the store never writes: each is corrupt, never
//! absent and never the store being unavailable (which `fail-open` would run through), and an
//! operator's `delete` clears it.

use idem_core::store::FencingToken;
use idem_core::testkit::{self, DAY, fingerprint, fresh_id};
use idem_core::{Store, StoreError, UnixMillis};
use idem_redis::RecordKeys;

use crate::common::Server;
use crate::{completed, fresh_store, present, query};

/// The commands that damage a record, given its keys.
type Damage = fn(&RecordKeys) -> Vec<redis::Cmd>;

/// Each damage, done to a completed record: `begin`, `get` and `delete` all say the record is
/// corrupt (`begin` naming what it lacks, where the damage leaves a hash that says, and never
/// with Lua's internals), and the delete clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_the_wrong_shape_are_corrupt_not_absent_or_unavailable() {
    let server = Server::Standalone;
    let (store, _cleanup) = fresh_store(server, "").await;
    let now = UnixMillis::now();
    // Each damage, and what `begin`'s report of it names.
    let damages: [(&str, Damage, &str); 4] = [
        (
            "a state and nothing else",
            |keys| {
                vec![
                    redis::cmd("DEL").arg(&keys.record).arg(&keys.body).clone(),
                    redis::cmd("HSET")
                        .arg(&keys.record)
                        .arg("state")
                        .arg("completed")
                        .clone(),
                ]
            },
            "purge_at",
        ),
        (
            "no state",
            |keys| vec![redis::cmd("HDEL").arg(&keys.record).arg("state").clone()],
            "",
        ),
        (
            "a string record",
            |keys| {
                vec![
                    redis::cmd("DEL").arg(&keys.record).clone(),
                    redis::cmd("SET").arg(&keys.record).arg("junk").clone(),
                ]
            },
            "",
        ),
        (
            "a hash answer",
            |keys| {
                vec![
                    redis::cmd("DEL").arg(&keys.body).clone(),
                    redis::cmd("HSET").arg(&keys.body).arg("a").arg("b").clone(),
                ]
            },
            "",
        ),
    ];
    for (damage, commands, named) in damages {
        let id = fresh_id();
        completed(&store, &id, DAY).await;
        let keys = store.record_keys(&id);
        for command in commands(&keys) {
            let _: redis::Value = query(server, &command);
        }
        let begun = store
            .begin(testkit::claim(&id, &fingerprint("a"), now, FencingToken::random()))
            .await;
        assert!(
            matches!(begun, Err(StoreError::Corrupt(ref why)) if why.contains(named)),
            "{damage}: begin gave {begun:?}, not a corrupt record naming {named:?}"
        );
        let read = store.get(&id).await;
        assert!(
            matches!(read, Err(StoreError::Corrupt(_))),
            "{damage}: get gave {read:?}"
        );
        if let Err(StoreError::Corrupt(why)) = &read {
            assert!(!why.contains("user_script"), "{damage}: no Lua internals: {why}");
        }
        let deleted = store.delete(&id).await;
        assert!(
            matches!(deleted, Err(StoreError::Corrupt(_))),
            "{damage}: delete gave {deleted:?}"
        );
        assert_eq!(
            present(server, &[&keys.record, &keys.body]),
            0,
            "{damage}: an operator can clear it"
        );
        assert!(store.get(&id).await.expect("get").is_none(), "{damage}");
    }
}
