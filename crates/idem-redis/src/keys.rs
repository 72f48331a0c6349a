//! Where a record lives: its three keys and its wake-up channel, all with the same cluster hash tag;
//! and where the store's scope salt lives.

use std::collections::HashMap;
use std::sync::LazyLock;

use idem_core::store::RecordId;
use idem_core::store::backend::hex;
use redis::cluster_routing::Slot;
use sha2::{Digest, Sha256};

/// The Redis names of one record: `PREFIX:{TAG}:rec`, `PREFIX:{TAG}:body`,
/// `PREFIX:{TAG}:checkpoints` and `PREFIX:{TAG}:wake`.
///
/// `TAG` is the hex SHA-256 of the length-prefixed scope and key, so any character in either is
/// safe and the four names hash to one cluster slot (Redis hashes only what is between the first
/// `{` and the next `}`). Useful for looking at a record with `redis-cli`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordKeys {
    /// The hash holding the record: `state` (`in-flight`, `completed` or `unknown`),
    /// `fingerprint`, `digest`, `token`, `lease_until`, `created_at`, `completed_at`,
    /// `expires_at`, `purge_at`, `replays` (times in Unix milliseconds), and what it keeps for the
    /// operator who reads the store: `origin` (the record's scope and key, which its name only
    /// hashes, and the method and path of the request that made it: each part its length in
    /// decimal, a `:` and its bytes, `5:app:a2:k14:POST9:/payments`), `trace_id` (the latest run's
    /// trace as `RunTrace` writes it, `<trace id>-<span id>` in hex, empty for none), `recovered` (`1` if the latest run took the key over,
    /// else `0`) and `status` (the answer's, once completed). A record written before records kept
    /// `origin`, `trace_id`, `recovered` and `status` has none of them: it reads without them, and
    /// [`Store::list`](idem_core::Store::list) cannot name it, so leaves it out.
    pub record: String,
    /// The string holding the stored answer, present while it is replayable.
    pub body: String,
    /// The hash holding the checkpoints of the record's run, present while it has any: `count`
    /// (how many names), `name:<i>` (the i-th name first written, from 1) and `value:<name>` (its
    /// latest value). It never outlives the record.
    pub checkpoints: String,
    /// The pub/sub channel (sharded on a cluster) that announces a change of holder.
    pub channel: String,
}

impl RecordKeys {
    pub(crate) fn new(prefix: &str, id: &RecordId) -> Self {
        let mut hasher = Sha256::new();
        for part in [id.scope.as_str(), id.key.as_str()] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        let tag = hex(&hasher.finalize());
        // Built by hand, not with `format!`: every store operation makes these four names.
        let name = |suffix: &str| {
            let mut name = String::with_capacity(prefix.len() + tag.len() + suffix.len() + 4);
            name.push_str(prefix);
            name.push_str(":{");
            name.push_str(&tag);
            name.push_str("}:");
            name.push_str(suffix);
            name
        };
        Self {
            record: name("rec"),
            body: name("body"),
            checkpoints: name("checkpoints"),
            channel: name("wake"),
        }
    }
}

/// The hash that holds the store's scope salt: `PREFIX:scope-salt`. It has no hash tag: one key,
/// on the slot its whole name hashes to.
pub(crate) fn scope_salt_key(prefix: &str) -> String {
    format!("{prefix}:scope-salt")
}

/// The pattern of the copies of the salt a cluster keeps, one per slot that held a claim
/// (`PREFIX:identity:{TAG}`, see [`identity_copy_key`]), with the prefix's glob characters escaped.
pub(crate) fn identity_copy_pattern(prefix: &str) -> String {
    format!("{}:identity:*", escape_glob(prefix))
}

/// The copy of the salt (and of the store's identity) that a cluster keeps in the slot of the
/// record named `record`: `PREFIX:identity:{TAG}`, where `TAG` is the shortest decimal number that
/// hashes to that slot. A claim's script reads it in its own slot, as a script on a cluster can
/// read no other; it is written from the salt hash (`PREFIX:scope-salt`, which decides) by the
/// first claim in the slot, and again by one that finds it missing (its node lost its data) or
/// other than the salt hash.
pub(crate) fn identity_copy_key(prefix: &str, record: &str) -> String {
    let tag = &SLOT_TAGS[&Slot::for_key(record)];
    format!("{prefix}:identity:{{{tag}}}")
}

/// For every slot of a cluster, the shortest decimal number that hashes to it: found by trying
/// numbers in turn (about 160 000, a few milliseconds, once per process).
static SLOT_TAGS: LazyLock<HashMap<Slot, String>> = LazyLock::new(|| {
    const SLOTS: usize = 16_384;
    let mut tags = HashMap::with_capacity(SLOTS);
    let mut n: u64 = 0;
    while tags.len() < SLOTS {
        let tag = n.to_string();
        tags.entry(Slot::for_key(&tag)).or_insert(tag);
        n += 1;
    }
    tags
});

/// `prefix` with the glob characters of `SCAN MATCH` escaped.
fn escape_glob(prefix: &str) -> String {
    let mut escaped = String::with_capacity(prefix.len() + 4);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// The channel on which every delete of a record is announced, with the record's digest, to the
/// replay caches of every instance: `PREFIX:deletions`. A plain (not sharded) channel, so that on
/// a cluster the announcement reaches every node, whatever the slot of the record deleted.
pub(crate) fn deletions_channel(prefix: &str) -> String {
    format!("{prefix}:deletions")
}

/// The string that says the store's primaries have had replicas: `PREFIX:replicated`. Written
/// (with no expiry) by the first instance that sees a replica for every primary; under
/// `replicas=auto`, an instance or a command that starts while a replica is cut off reads it and
/// waits for a replica anyway.
pub(crate) fn replicated_key(prefix: &str) -> String {
    format!("{prefix}:replicated")
}

/// The `SCAN MATCH` pattern of the record hashes under `prefix`, and of no other prefix's:
/// `PREFIX:{*}:rec`, with the prefix's glob characters escaped. A prefix has no braces, so the
/// `{` right after it keeps out the records of a longer prefix that starts with this one
/// (`idem:x:{TAG}:rec` is not a record of `idem`).
pub(crate) fn record_pattern(prefix: &str) -> String {
    format!("{}:{{*}}:rec", escape_glob(prefix))
}

/// The record of `key` in the scope stored as `scope`, for the crate's unit tests.
#[cfg(test)]
pub(crate) fn test_id(scope: &str, key: &str) -> RecordId {
    RecordId {
        scope: idem_core::Scope::from_stored(scope),
        key: idem_core::IdempotencyKey::new(key).unwrap(),
    }
}

#[cfg(test)]
mod tests {
    use super::test_id as id;
    use super::*;

    #[test]
    fn layout() {
        let keys = RecordKeys::new("idem", &id("app:alice", "k1"));
        let tag = keys
            .record
            .strip_prefix("idem:{")
            .unwrap()
            .strip_suffix("}:rec")
            .unwrap();
        assert_eq!(tag.len(), 64);
        assert!(tag.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(keys.body, format!("idem:{{{tag}}}:body"));
        assert_eq!(keys.checkpoints, format!("idem:{{{tag}}}:checkpoints"));
        assert_eq!(keys.channel, format!("idem:{{{tag}}}:wake"));
    }

    #[test]
    fn the_record_pattern_escapes_the_prefix() {
        assert_eq!(record_pattern("idem"), "idem:{*}:rec");
        assert_eq!(record_pattern(r"a*b?c[d]e\f"), r"a\*b\?c\[d\]e\\f:{*}:rec");
        assert_eq!(scope_salt_key("idem"), "idem:scope-salt");
    }

    #[test]
    fn an_identity_copy_shares_its_records_slot() {
        for key in ["k1", "k2", "k3", "k4"] {
            let keys = RecordKeys::new("idem", &id("app:alice", key));
            let copy = identity_copy_key("idem", &keys.record);
            assert!(copy.starts_with("idem:identity:{"), "{copy}");
            assert_eq!(Slot::for_key(&copy), Slot::for_key(&keys.record), "{copy}");
        }
        assert_eq!(identity_copy_pattern("a*b"), r"a\*b:identity:*");
    }

    #[test]
    fn the_length_prefix_keeps_scope_and_key_apart() {
        let a = RecordKeys::new("p", &id("ab", "c"));
        let b = RecordKeys::new("p", &id("a", "bc"));
        assert_ne!(a, b);
        assert_eq!(a, RecordKeys::new("p", &id("ab", "c")));
        assert_ne!(a.record, RecordKeys::new("q", &id("ab", "c")).record);
    }
}
