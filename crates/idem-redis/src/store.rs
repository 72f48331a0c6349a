//! [`RedisStore`]: the `Store` primitives as Lua scripts, one round trip each.
//!
//! The scripts are in `scripts.rs`, their replies are read in `decode.rs`, and `call.rs` checks
//! that a reply answers the call it reached: this module is the operations.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use async_trait::async_trait;
use idem_core::store::Invalidations;
use idem_core::store::backend::{ReplayCounts, abandoned_purge_at, claim_purge_at, wait_for_change};
use idem_core::{
    Store, StoreError, UnixMillis,
    store::{
        Begin, BeginRequest, Checkpoint, ClaimState, Completion, FencingToken, ListQuery, Listed, Newest, Purged,
        Record, RecordId, Release, ScopeSalt, StoreIdentity, WaitOutcome,
    },
};
use redis::{Cmd, Pipeline, Value};
use tokio::sync::Notify;

use crate::ack::Acknowledgement;
use crate::call::{Call, Written};
use crate::conn::{Commands, Conn, Node, follow_sentinels};
use crate::decode::{
    Claimed, Found, LISTED_FIELDS, StoredHash, parse_begin, parse_checkpoints, parse_identity, parse_listed,
    parse_millis, parse_scan, parse_scope_salt,
};
use crate::keys::{
    RecordKeys, deletions_channel, identity_copy_key, identity_copy_pattern, record_pattern, scope_salt_key,
};
use crate::notify::{Deletions, Subscriptions, Watch};
use crate::script_load::StoreScript;
use crate::scripts::{
    BEGIN_SCRIPT, CHECKPOINT_SCRIPT, CHECKPOINTS_SCRIPT, CLAIM_STATE_SCRIPT, COMPLETE_SCRIPT, COPY_IDENTITY_SCRIPT,
    COUNT_REPLAYS_SCRIPT, DELETE_SCRIPT, GET_SCRIPT, IDENTITY_SCRIPT, RELEASE_SCRIPT, RENEW_SCRIPT, SCOPE_SALT_SCRIPT,
};
use crate::timeouts::RESPONSE_TIMEOUT;
use crate::url::Target;
use crate::write::{Durability, run_script};
use crate::{RedisError, origin, url};

/// An idempotency store in Redis: one server (`redis://`) or a Redis Cluster
/// (`redis+cluster://`).
///
/// Every write is one Lua script, so claims are atomic across every instance that shares the
/// server. Retention is native: keys expire by themselves, [`Store::purge`] has nothing to do.
/// Waiters are woken by pub/sub messages (sharded pub/sub on a cluster), with polling as a
/// fallback for messages lost while a connection was down.
///
/// The store holds two multiplexed connections (on a cluster, two per node): one runs commands,
/// the other holds the wake-up subscriptions; with replicas to wait for, writes go over a pool of
/// connections each lent to one write and its `WAIT` at a time. Both reconnect by themselves after an outage;
/// operations fail with [`StoreError::Unavailable`] meanwhile. Every reply names the call it
/// answers (its nonce): one that does not is an error, never acted on, and the connection it came
/// on is replaced. Cloning is cheap and shares both connections.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    commands: Arc<Commands>,
    /// The replicas a write waits for, and the connections that carry such writes.
    ack: Arc<Acknowledgement>,
    prefix: String,
    poll_interval: Duration,
    /// The URL without its password.
    url: String,
    /// `PUBLISH` on one server, `SPUBLISH` on a cluster (the channel lives on the record's shard).
    publish: &'static str,
    subscriptions: Subscriptions,
    /// Holds the deletions channel subscribed for as long as the store lives.
    _deletions: Watch,
    /// What the deletions channel tells this instance's replay caches.
    invalidations: Arc<Invalidations>,
    /// Replays counted here and not yet added to their records.
    replays: Arc<ReplayCounts>,
    /// Claims whose `complete` failed as unavailable: it may have stored their answer unseen.
    /// As many as the protocol holds answers to store again (it gives them up when fenced).
    unseen_completions: Mutex<HashSet<(RecordId, FencingToken)>>,
}

/// The most claims remembered as having perhaps stored their answer unseen.
const MAX_UNSEEN_COMPLETIONS: usize = 10_000;

/// How often the replays counted by a store are added to their records.
const FLUSH_REPLAYS_EVERY: Duration = Duration::from_millis(500);

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.inner.url)
            .field("cluster", &self.is_cluster())
            .field("prefix", &self.inner.prefix)
            .field("poll_interval", &self.inner.poll_interval)
            .finish()
    }
}

/// How many keys one `SCAN` step looks at, at most (a hint to the server): the fields of the
/// records it finds are then read in one pipeline.
const SCAN_BATCH: usize = 1000;

impl RedisStore {
    /// Connects to the store named by `url`:
    ///
    /// * `redis://[user:password@]host:port[/db]` — one server;
    /// * `redis+sentinel://[user:password@]host:port,host:port,.../primary-name[/db]` — the
    ///   primary that these sentinels name, followed through their failovers (the credentials are
    ///   the primary's; the sentinels are asked without any);
    /// * `redis+cluster://[user:password@]host:port,host:port,...` — a Redis Cluster, given some of
    ///   its nodes (the others are discovered).
    ///
    /// Options, as a query string: `prefix=NAME` puts every key under `NAME:` (default `idem`;
    /// no braces), `poll_interval=DURATION` is the longest pause between two checks of a waited-on
    /// record when no notification comes (default 250 ms), `replicas=auto|N` is how many replicas
    /// must acknowledge a write before it counts (default `auto`: one once every primary has been
    /// seen with a replica; `0`: never wait), and `replica_timeout=DURATION` how long a write
    /// waits for them before it fails as unavailable (default 500 ms).
    ///
    /// Needs Redis 7 or newer (RESP3 push messages; `SPUBLISH` on a cluster). Fails if the server
    /// cannot be reached now; once connected, the store rides out outages.
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        let config = url::parse(url)?;
        let connect_error = |err| RedisError::connect(&config.display, err);
        let commands = Commands::connect(&config, RESPONSE_TIMEOUT)
            .await
            .map_err(connect_error)?;
        redis::cmd("PING")
            .query_async::<Value>(&mut commands.get().0)
            .await
            .map_err(connect_error)?;
        let ack = Acknowledgement::new(&config, &commands).await.map_err(connect_error)?;
        let invalidations = Arc::new(Invalidations::new());
        let deletions = Deletions {
            channel: deletions_channel(&config.prefix),
            invalidations: Arc::clone(&invalidations),
        };
        let subscriptions = Subscriptions::connect(&config, deletions.clone())
            .await
            .map_err(connect_error)?;
        // Subscribed before the store is used; if it cannot be yet, replay caches answer nothing
        // until it is.
        let mut deletions_watch = subscriptions.watch(&deletions.channel);
        deletions_watch.subscribed().await;
        let publish = if commands.is_cluster() { "SPUBLISH" } else { "PUBLISH" };
        tracing::debug!(url = %config.display, prefix = %config.prefix, "Redis store connected");
        let inner = Arc::new(Inner {
            commands: commands.clone(),
            ack: Arc::clone(&ack),
            prefix: config.prefix.clone(),
            poll_interval: config.poll_interval,
            url: config.display,
            publish,
            subscriptions,
            _deletions: deletions_watch,
            invalidations,
            replays: Arc::default(),
            unseen_completions: Mutex::default(),
        });
        ack.watch(commands.clone(), Arc::downgrade(&inner));
        if let Target::Sentinel(target) = &config.target {
            let (main, ack) = (commands.clone(), Arc::clone(&ack));
            let connections = move || std::iter::once(main.clone()).chain(ack.connections()).collect();
            follow_sentinels(target.clone(), connections, Arc::downgrade(&inner));
        }
        let prefix = config.prefix;
        ReplayCounts::flush_forever(
            inner.replays.clone(),
            FLUSH_REPLAYS_EVERY,
            Arc::downgrade(&inner),
            move |counts| write_replays(commands.clone(), prefix.clone(), counts),
        );
        Ok(Self { inner })
    }

    /// The prefix of every key of this store.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// Whether the store is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.commands.is_cluster()
    }

    /// The Redis keys and channel of a record, for looking at it with `redis-cli`.
    pub fn record_keys(&self, id: &RecordId) -> RecordKeys {
        RecordKeys::new(&self.inner.prefix, id)
    }

    /// Runs `script` (the operation `what`) on the record's three keys with a fresh nonce and
    /// `args`; returns the reply after the record and nonce it names. A reply that names another
    /// record or call, or is not a script's reply at all, is an error, and the connection it came
    /// on is replaced.
    async fn run(
        &self,
        durability: Durability<'_>,
        what: &'static str,
        script: &StoreScript,
        keys: &RecordKeys,
        args: impl FnOnce(&mut Cmd),
    ) -> Result<std::vec::IntoIter<Value>, StoreError> {
        let keys = [keys.record.as_str(), &keys.body, &keys.checkpoints];
        run_script(&self.inner.commands, durability, what, script, &keys, args)
            .await?
            .into_payload()
    }

    /// What a call that writes must reach: the replicas the store waits for.
    fn writes(&self) -> Durability<'_> {
        Durability::Replicas(&self.inner.ack)
    }

    /// Where the claim `token` on the record stands, read for `what` (`claim_state`, or a
    /// waiter's check that the claim is still current).
    async fn read_claim_state(
        &self,
        what: &'static str,
        keys: &RecordKeys,
        token: FencingToken,
    ) -> Result<ClaimState, StoreError> {
        let reply = self
            .run(Durability::Primary, what, &CLAIM_STATE_SCRIPT, keys, |script| {
                script.arg(&token.as_bytes()[..]);
            })
            .await?;
        Ok(match flag(what, reply)? {
            2 => ClaimState::Current,
            1 => ClaimState::Completed,
            _ => ClaimState::Ended,
        })
    }

    /// The latest `purge_at` among the records under the store's prefix (`None`: it holds none), for
    /// the scope salt kept in `salt_key`. A record too corrupt to have a `purge_at` is left out: no
    /// operation can use it anyway.
    async fn latest_purge_at(&self, salt_key: &str) -> Result<Option<UnixMillis>, StoreError> {
        let mut latest = None;
        let read = |reads: &mut Pipeline, record: &[u8]| {
            reads.cmd("HGET").arg(record).arg("purge_at");
        };
        self.for_each_record("scope_salt", salt_key, read, |record, purge_at| match purge_at {
            // Gone since the scan found it.
            Value::Nil => {}
            Value::BulkString(digits) if let Some(at) = parse_millis(&digits) => {
                latest = latest.max(Some(at));
            }
            other => tracing::warn!(
                record = %String::from_utf8_lossy(record),
                purge_at = ?other,
                "a record has no valid purge_at; the scope salt leaves it out"
            ),
        })
        .await?;
        Ok(latest.map(UnixMillis::from_i64))
    }

    /// Walks every record hash under the store's prefix, on every node that holds keys (every
    /// primary of a cluster), with `SCAN`, [`SCAN_BATCH`] keys at a time: for the records of each
    /// batch, `read` adds one command per record to a pipeline, and `found` gets each record's name
    /// and the reply to its command. Part of the call `what` about `about`.
    async fn for_each_record(
        &self,
        what: &'static str,
        about: &str,
        read: impl Fn(&mut Pipeline, &[u8]),
        found: impl FnMut(&[u8], Value),
    ) -> Result<(), StoreError> {
        let pattern = record_pattern(&self.inner.prefix);
        self.for_each_key(what, about, &pattern, read, found).await
    }

    /// [`Self::for_each_record`] for the keys that match `pattern`.
    async fn for_each_key(
        &self,
        what: &'static str,
        about: &str,
        pattern: &str,
        read: impl Fn(&mut Pipeline, &[u8]),
        mut found: impl FnMut(&[u8], Value),
    ) -> Result<(), StoreError> {
        let (mut conn, generation) = self.inner.commands.get();
        let nodes = conn.primaries().await.map_err(StoreError::unavailable)?;
        for node in &nodes {
            let mut cursor = b"0".to_vec();
            loop {
                let mut scan = redis::pipe();
                scan.cmd("SCAN")
                    .arg(&cursor[..])
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(SCAN_BATCH);
                let reply = self.on_node(&mut conn, generation, node, (what, about), scan).await?;
                let (next, records) = parse_scan(reply)?;
                if !records.is_empty() {
                    let mut reads = redis::pipe();
                    for record in &records {
                        read(&mut reads, record);
                    }
                    let replies = self.on_node(&mut conn, generation, node, (what, about), reads).await?;
                    for (record, reply) in records.iter().zip(replies) {
                        found(record, reply);
                    }
                }
                if next == b"0" {
                    break;
                }
                cursor = next;
            }
        }
        Ok(())
    }

    /// Sends `pipeline` to `node` with an `ECHO` of a fresh nonce after it, and returns the
    /// pipeline's replies if the echo comes back last, after exactly as many: these commands have
    /// no record and nonce in their replies, so a shifted connection shows in the echo (and
    /// connection `generation` is replaced). Part of the call `what` about `about`.
    async fn on_node(
        &self,
        conn: &mut Conn,
        generation: u64,
        node: &Node,
        (what, about): (&'static str, &str),
        mut pipeline: Pipeline,
    ) -> Result<Vec<Value>, StoreError> {
        let call = Call::new(what, about);
        let count = pipeline.len();
        pipeline.cmd("ECHO").arg(&call.nonce);
        let mut replies = conn
            .pipeline_on(node, &pipeline)
            .await
            .map_err(StoreError::unavailable)?;
        match replies.pop() {
            Some(Value::BulkString(echo)) if echo == call.nonce.as_bytes() && replies.len() == count => Ok(replies),
            other => {
                tracing::warn!("a Redis reply reached the wrong command");
                self.inner.commands.out_of_step(generation);
                Err(call.misrouted(&other))
            }
        }
    }

    /// The `begin` script, with the hash that holds the identity for the record's slot.
    async fn claim(
        &self,
        request: &BeginRequest<'_>,
        keys: &RecordKeys,
        identity_key: &str,
    ) -> Result<Claimed, StoreError> {
        let claim_purge_at = claim_purge_at(request.purge_at, request.lease_until);
        let identity = request.identity.map(|identity| identity.to_hex()).unwrap_or_default();
        let names = [keys.record.as_str(), &keys.body, &keys.checkpoints, identity_key];
        let written = run_script(
            &self.inner.commands,
            self.writes(),
            "begin",
            &BEGIN_SCRIPT,
            &names,
            |script| {
                script
                    .arg(millis_arg(request.now))
                    .arg(millis_arg(request.lease_until))
                    .arg(&request.token.as_bytes()[..])
                    .arg(&request.fingerprint.digest()[..])
                    .arg(request.fingerprint.encode())
                    .arg(millis_arg(claim_purge_at))
                    .arg(&keys.channel)
                    .arg(self.inner.publish)
                    .arg(millis_arg(request.expires_at))
                    .arg(origin::encode(request.id, request.origin))
                    .arg(request.origin.trace.map(|trace| trace.to_string()).unwrap_or_default())
                    .arg(identity);
            },
        )
        .await?;
        let claimed = parse_begin(written.payload, request)?;
        if let Some(unacknowledged) = written.unacknowledged {
            match claimed {
                // The script wrote nothing (a replay, a mismatch, a copy in flight to wait for,
                // another store): what it read is what the primary holds, and the `WAIT` only
                // counted earlier writes of its connection.
                Claimed::Begun(Begin::Existing(_), _) | Claimed::OtherStore(_) => {}
                Claimed::Begun(Begin::Acquired { recovered }, _) => {
                    if !recovered {
                        self.forget_unacknowledged(request, keys).await;
                    }
                    return Err(unacknowledged);
                }
            }
        }
        Ok(match claimed {
            Claimed::Begun(Begin::Existing(record), true) => {
                Claimed::Begun(Begin::Existing(self.inner.replays.replayed(record)), true)
            }
            Claimed::Begun(Begin::Existing(record), false) => {
                Claimed::Begun(Begin::Existing(self.inner.replays.with_pending(record)), false)
            }
            other => other,
        })
    }

    /// Forgets a new claim that no replica acknowledged (the script said it was new, not a
    /// takeover): nothing ran under it, nothing will, so the key's next request runs unflagged, as
    /// the first. Compare-and-set on the claim's token, on the primary alone: if a failover loses
    /// the deletion, the replica either never had the claim (the key is new there too) or has it
    /// in flight, and its lease ends in a takeover flagged as recovered. If it cannot be
    /// forgotten now, the protocol gives it up as unknown (a release that finds it forgotten is
    /// fenced, a no-op).
    async fn forget_unacknowledged(&self, request: &BeginRequest<'_>, keys: &RecordKeys) {
        let forgotten = self
            .run(Durability::Primary, "release", &RELEASE_SCRIPT, keys, |script| {
                script
                    .arg(&request.token.as_bytes()[..])
                    .arg("forget")
                    .arg(0)
                    .arg(&keys.channel)
                    .arg(self.inner.publish)
                    .arg(0);
            })
            .await
            .and_then(|reply| flag("release", reply));
        match forgotten {
            Ok(1) => tracing::debug!(record = %keys.record, "forgot a new claim that no replica acknowledged"),
            Ok(_) => {}
            Err(err) => tracing::warn!(
                record = %keys.record, error = %err,
                "cannot forget a new claim that no replica acknowledged; it is given up as unknown"
            ),
        }
    }

    /// Writes `salt` (the salt hash as it stands) into the cluster's copy `key`, acknowledged as
    /// any write, if the copy still holds `held` (what the claim found there): false if another
    /// instance rewrote it meanwhile.
    async fn copy_identity(&self, key: &str, held: &[u8], salt: &ScopeSalt) -> Result<bool, StoreError> {
        let reply = run_script(
            &self.inner.commands,
            self.writes(),
            "copy_identity",
            &COPY_IDENTITY_SCRIPT,
            &[key],
            |script| {
                script
                    .arg(held)
                    .arg(salt.identity.to_hex())
                    .arg(&salt.salt[..])
                    .arg(millis_arg(salt.created_at))
                    .arg(
                        salt.older_records_until
                            .map(|at| millis_arg(at).to_string())
                            .unwrap_or_default(),
                    );
            },
        )
        .await?
        .into_payload()?
        .next();
        match reply {
            Some(Value::Int(copied)) => Ok(copied == 1),
            other => Err(StoreError::Corrupt(format!(
                "unexpected reply of copy_identity: {other:?}"
            ))),
        }
    }

    /// A copy of the salt that a cluster kept in a slot whose node did not lose its data, for a
    /// salt hash that is gone (its own node lost its data): the salt is made again from it, so
    /// that the records of the nodes that kept theirs are still found under their callers'
    /// scopes. `None` if no slot kept one (the whole store lost its data, or it is new).
    async fn surviving_copy(&self) -> Result<Option<ScopeSalt>, StoreError> {
        let pattern = identity_copy_pattern(&self.inner.prefix);
        let mut copy = None;
        let read = |reads: &mut Pipeline, key: &[u8]| {
            reads.cmd("HGETALL").arg(key);
        };
        self.for_each_key("scope_salt", &pattern, &pattern, read, |key, fields| {
            if copy.is_some() {
                return;
            }
            let key = String::from_utf8_lossy(key);
            match parse_scope_salt(vec![fields].into_iter(), &key) {
                Ok(found) => copy = found,
                Err(err) => {
                    tracing::warn!(copy = %key, error = %err, "a copy of the scope salt does not read; it is left out")
                }
            }
        })
        .await?;
        Ok(copy)
    }

    /// Runs the scope salt's script on `key`, as a write, with `args` (the candidate's identity to
    /// read the salt, and the candidate's salt with it to make one): the salt the key holds
    /// afterwards, if any.
    async fn run_scope_salt_script(
        &self,
        key: &str,
        args: impl FnOnce(&mut Cmd),
    ) -> Result<Option<ScopeSalt>, StoreError> {
        let reply = run_script(
            &self.inner.commands,
            self.writes(),
            "scope_salt",
            &SCOPE_SALT_SCRIPT,
            &[key],
            args,
        )
        .await?
        .into_payload()?;
        parse_scope_salt(reply, key)
    }

    /// Runs a compare-and-set script on the claim `token`, its first argument (`args` come after
    /// it), which writes: 1 done, 0 fenced.
    async fn compare_and_set(
        &self,
        what: &'static str,
        script: &StoreScript,
        keys: &RecordKeys,
        token: FencingToken,
        args: impl FnOnce(&mut Cmd),
    ) -> Result<(), StoreError> {
        let args = |script: &mut Cmd| {
            script.arg(&token.as_bytes()[..]);
            args(script);
        };
        match flag(what, self.run(self.writes(), what, script, keys, args).await?)? {
            1 => Ok(()),
            0 => Err(StoreError::Fenced),
            other => Err(StoreError::Corrupt(format!("unexpected reply of {what}: {other}"))),
        }
    }
}

#[async_trait]
impl Store for RedisStore {
    /// One script, which checks the store's identity first. On a cluster the script can only read
    /// the copy of the identity in the record's slot: a copy that is missing (the slot's first
    /// claim, or its node lost its data) or other than the salt hash is written again from the salt
    /// hash, which decides, if that holds the identity the caller knows, and the claim made again.
    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        let keys = self.record_keys(request.id);
        let identity_key = match self.is_cluster() {
            true => identity_copy_key(&self.inner.prefix, &keys.record),
            false => scope_salt_key(&self.inner.prefix),
        };
        let held = match self.claim(&request, &keys, &identity_key).await? {
            Claimed::Begun(begun, _) => return Ok(begun),
            Claimed::OtherStore(held) => held,
        };
        let Some(known) = request.identity.filter(|_| self.is_cluster()) else {
            return Err(StoreError::IdentityChanged);
        };
        let salt = self.scope_salt(ScopeSalt::random(request.now)).await?;
        if salt.identity != known || !self.copy_identity(&identity_key, &held, &salt).await? {
            return Err(StoreError::IdentityChanged);
        }
        match self.claim(&request, &keys, &identity_key).await? {
            Claimed::Begun(begun, _) => Ok(begun),
            Claimed::OtherStore(_) => Err(StoreError::IdentityChanged),
        }
    }

    /// Stores the answer. A call that failed as unavailable may have stored it unseen (its
    /// reply, or its replicas' acknowledgement, was missing): the claim's next call may then find
    /// its own answer stored, writes it once more so that the replicas acknowledge it, and
    /// succeeds.
    async fn complete(&self, id: &RecordId, token: FencingToken, completion: Completion) -> Result<(), StoreError> {
        let keys = self.record_keys(id);
        let unseen = (id.clone(), token);
        let again = self
            .inner
            .unseen_completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&unseen);
        let stored = self
            .compare_and_set("complete", &COMPLETE_SCRIPT, &keys, token, |script| {
                script
                    .arg(&completion.response[..])
                    .arg(millis_arg(completion.completed_at))
                    .arg(millis_arg(completion.expires_at))
                    .arg(millis_arg(completion.purge_at))
                    .arg(&keys.channel)
                    .arg(self.inner.publish)
                    .arg(if again { "again" } else { "" })
                    .arg(completion.status);
            })
            .await;
        let mut unseen_completions = self
            .inner
            .unseen_completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !matches!(stored, Err(StoreError::Unavailable(_))) {
            unseen_completions.remove(&unseen);
        } else if unseen_completions.len() < MAX_UNSEEN_COMPLETIONS {
            // Beyond the cap (answers the protocol gave up on), a retry is fenced as before.
            unseen_completions.insert(unseen);
        }
        stored
    }

    async fn release(&self, id: &RecordId, token: FencingToken, release: Release) -> Result<(), StoreError> {
        let keys = self.record_keys(id);
        let (mode, expires_at, purge_at) = match release {
            Release::Forget => ("forget", UnixMillis(0), UnixMillis(0)),
            Release::Unknown { expires_at, purge_at } => ("unknown", expires_at, purge_at),
        };
        self.compare_and_set("release", &RELEASE_SCRIPT, &keys, token, |script| {
            script
                .arg(mode)
                .arg(millis_arg(purge_at))
                .arg(&keys.channel)
                .arg(self.inner.publish)
                .arg(millis_arg(expires_at));
        })
        .await
    }

    async fn renew(&self, id: &RecordId, token: FencingToken, lease_until: UnixMillis) -> Result<(), StoreError> {
        let keys = self.record_keys(id);
        self.compare_and_set("renew", &RENEW_SCRIPT, &keys, token, |script| {
            script
                .arg(millis_arg(lease_until))
                .arg(millis_arg(abandoned_purge_at(lease_until)));
        })
        .await
    }

    /// Writes the checkpoint in one script that checks the token first: a fenced holder writes
    /// nothing. The checkpoints hash expires with the record.
    async fn checkpoint(&self, id: &RecordId, token: FencingToken, checkpoint: Checkpoint) -> Result<(), StoreError> {
        let keys = self.record_keys(id);
        self.compare_and_set("checkpoint", &CHECKPOINT_SCRIPT, &keys, token, |script| {
            script.arg(checkpoint.name.as_bytes()).arg(&checkpoint.value[..]);
        })
        .await
    }

    /// Reads the checkpoints as of the server's clock, as [`Store::get`] reads the record: none
    /// unless the record is in flight or unknown and not past its `purge_at`.
    async fn checkpoints(&self, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
        let keys = self.record_keys(id);
        let items = self
            .run(Durability::Primary, "checkpoints", &CHECKPOINTS_SCRIPT, &keys, |_| {})
            .await?;
        parse_checkpoints(items, id)
    }

    /// Reads the record as of the server's clock (`TIME` in the script): a record past its
    /// `purge_at` reads as absent
    /// and an answer past its `expires_at` as dropped (a tombstone), also in the moments before
    /// Redis expires their keys (native expiry runs relative to the `now` of the write, which
    /// may lag the clock).
    async fn claim_state(&self, id: &RecordId, token: FencingToken) -> Result<ClaimState, StoreError> {
        self.read_claim_state("claim_state", &self.record_keys(id), token).await
    }

    /// Redis keeps no transaction of the caller's: a route that completes in transactions is an
    /// ordinary one here.
    fn completes_in_transactions(&self) -> bool {
        false
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let keys = self.record_keys(id);
        let mut items = self.run(Durability::Primary, "get", &GET_SCRIPT, &keys, |_| {}).await?;
        let fields = items.next().unwrap_or_default();
        let body = items.next().unwrap_or_default();
        StoredHash::parse(fields, body)?
            .map(|stored| Ok(self.inner.replays.with_pending(stored.into_record(id.clone())?)))
            .transpose()
    }

    /// Deletes the record and its answer in one script, which also publishes on the record's
    /// channel so that its waiters look again, and on the deletions channel so that every
    /// instance's replay cache forgets it; returns the record as [`Store::get`] would have
    /// read it.
    async fn delete(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let keys = self.record_keys(id);
        let mut items = self
            .run(self.writes(), "delete", &DELETE_SCRIPT, &keys, |script| {
                script
                    .arg(&keys.channel)
                    .arg(self.inner.publish)
                    .arg(deletions_channel(&self.inner.prefix))
                    .arg(&id.digest()[..]);
            })
            .await?;
        let fields = items.next().unwrap_or_default();
        let body = items.next().unwrap_or_default();
        let record = StoredHash::parse(fields, body)
            .and_then(|stored| stored.map(|stored| stored.into_record(id.clone())).transpose());
        self.inner.replays.deleted(id, record)
    }

    /// Reads the salt (`PREFIX:scope-salt`) with one script. If there is none, walks every node
    /// (every primary of a cluster) for the latest `purge_at` of the records under the prefix, then
    /// makes the salt with a script that writes the hash only if the key still does not exist and
    /// returns what it holds afterwards: of instances that race, each gets the one made first.
    /// The walk happens only while there is no salt, so about once in the life of a store.
    ///
    /// The key has no expiry (a `volatile-*` eviction policy never takes it) and no operation
    /// deletes it.
    async fn scope_salt(&self, candidate: ScopeSalt) -> Result<ScopeSalt, StoreError> {
        let key = scope_salt_key(&self.inner.prefix);
        let read = self
            .run_scope_salt_script(&key, |script| {
                script.arg(candidate.identity.to_hex());
            })
            .await?;
        if let Some(salt) = read {
            return Ok(salt);
        }
        let surviving = match self.is_cluster() {
            true => self.surviving_copy().await?,
            false => None,
        };
        let (candidate, older_records_until) = match surviving {
            Some(copy) => {
                tracing::warn!(salt = %key, "the scope salt is gone but a slot of the cluster kept a copy: it is made again from the copy");
                (copy, copy.older_records_until)
            }
            None => (candidate, self.latest_purge_at(&key).await?),
        };
        let made = self
            .run_scope_salt_script(&key, |script| {
                script
                    .arg(candidate.identity.to_hex())
                    .arg(&candidate.salt[..])
                    .arg(millis_arg(candidate.created_at))
                    .arg(
                        older_records_until
                            .map(|at| millis_arg(at).to_string())
                            .unwrap_or_default(),
                    );
            })
            .await?;
        made.ok_or_else(|| StoreError::Corrupt(format!("the scope salt {key} is missing right after it was made")))
    }

    /// The salt hash's `identity` field, read on its node (none: no salt).
    async fn identity(&self) -> Result<Option<StoreIdentity>, StoreError> {
        let key = scope_salt_key(&self.inner.prefix);
        let reply = run_script(
            &self.inner.commands,
            Durability::Primary,
            "identity",
            &IDENTITY_SCRIPT,
            &[&key],
            |_| {},
        )
        .await?
        .into_payload()?
        .next();
        match reply {
            None | Some(Value::Nil | Value::Boolean(false)) => Ok(None),
            Some(Value::BulkString(hex)) => parse_identity(&hex)
                .map(Some)
                .ok_or_else(|| StoreError::Corrupt(format!("the scope salt {key} has no valid identity"))),
            Some(other) => Err(StoreError::Corrupt(format!("unexpected reply of identity: {other:?}"))),
        }
    }

    async fn wait(&self, id: &RecordId, token: FencingToken, deadline: Instant) -> Result<WaitOutcome, StoreError> {
        let keys = self.record_keys(id);
        // Subscribed before the first check: a change made after it still wakes us.
        let mut watch = self.inner.subscriptions.watch(&keys.channel);
        let notify = tokio::time::timeout_at(deadline, watch.subscribed())
            .await
            .ok()
            .flatten()
            // Not subscribed (the deadline came first, or the runtime shuts down): poll only.
            .unwrap_or_else(|| Arc::new(Notify::new()));
        let cap = self.inner.poll_interval;
        wait_for_change(Some(&notify), deadline, cap / 4, cap, || async {
            Ok(self.read_claim_state("wait", &keys, token).await? == ClaimState::Current)
        })
        .await
    }

    /// Does nothing and returns [`Purged::default()`]: Redis expires records by itself. An
    /// answer's key expires at its `expires_at`, leaving the record as a tombstone, and the record
    /// expires at its `purge_at` (an unknown outcome or abandoned claim too: the tombstone of its
    /// route, and never before a running lease ends). Every script
    /// also compares the stored times with the caller's `now`, so a record is never treated as
    /// live after its time even before Redis evicts it.
    async fn purge(&self, _now: UnixMillis, _batch: usize) -> Result<Purged, StoreError> {
        Ok(Purged::default())
    }

    /// `PING` with a nonce, which the server echoes; on a cluster every node must answer.
    async fn ping(&self) -> Result<(), StoreError> {
        let call = Call::new("ping", "the server");
        let (mut conn, generation) = self.inner.commands.get();
        let reply: Value = match redis::cmd("PING").arg(&call.nonce).query_async(&mut conn).await {
            Ok(reply) => reply,
            Err(err) => {
                // A connection that cannot answer a ping is not trusted to heal itself (a
                // cluster connection whose nodes went away under it may not find them again):
                // a new one is made beside it, and the next ping (readiness is polled) tells.
                self.inner.commands.unanswered(generation);
                return Err(StoreError::unavailable(err));
            }
        };
        match reply {
            Value::BulkString(echo) if echo == call.nonce.as_bytes() => Ok(()),
            other => {
                self.inner.commands.out_of_step(generation);
                Err(call.misrouted(&other))
            }
        }
    }

    async fn clock(&self) -> Result<UnixMillis, StoreError> {
        let call = Call::new("clock", "the server");
        let (mut conn, generation) = self.inner.commands.get();
        let reply: Value = redis::cmd("TIME")
            .query_async(&mut conn)
            .await
            .map_err(StoreError::unavailable)?;
        // TIME answers [seconds, microseconds]; anything else is another command's reply.
        let number = |value: &Value| match value {
            Value::BulkString(digits) => std::str::from_utf8(digits).ok()?.parse::<u64>().ok(),
            _ => None,
        };
        let time = match &reply {
            Value::Array(parts) if parts.len() == 2 => number(&parts[0]).zip(number(&parts[1])),
            _ => None,
        };
        match time {
            Some((secs, micros)) if micros < 1_000_000 => Ok(UnixMillis(secs * 1000 + micros / 1000)),
            _ => {
                self.inner.commands.out_of_step(generation);
                Err(call.misrouted(&reply))
            }
        }
    }

    fn invalidations(&self) -> Option<Arc<Invalidations>> {
        Some(Arc::clone(&self.inner.invalidations))
    }

    fn count_replay(&self, id: &RecordId) {
        self.inner.replays.count(id);
    }

    /// Walks every record under the prefix, node by node, a thousand keys at a time, each
    /// batch's fields read in one pipeline (never an answer), and keeps the newest `query.limit`
    /// that match: a scan of the whole keyspace, for an operator, never for a request. A record
    /// past its `purge_at` is left out, as [`Store::get`] reads none; so is one written before
    /// records kept their scope and key (this version of the store names every record it claims),
    /// counted in one warning; one that does not read is left out with a warning of its own.
    async fn list(&self, query: &ListQuery) -> Result<Vec<Listed>, StoreError> {
        if query.limit == 0 {
            return Ok(Vec::new());
        }
        let prefix = &self.inner.prefix;
        let pattern = record_pattern(prefix);
        let mut newest = Newest::new(query.limit);
        let mut without_origin = 0_u64;
        let read = |reads: &mut Pipeline, record: &[u8]| {
            reads.cmd("HMGET").arg(record).arg(&LISTED_FIELDS[..]);
        };
        let record_name = |id: &RecordId| RecordKeys::new(prefix, id).record;
        self.for_each_record("list", &pattern, read, |record, fields| {
            match parse_listed(record, fields, query.now, record_name) {
                Ok(Found::Listed(listed)) if query.matches(&listed) => newest.offer(listed),
                Ok(Found::Listed(_) | Found::Gone) => {}
                Ok(Found::WithoutOrigin) => without_origin += 1,
                Err(why) => tracing::warn!(
                    record = %String::from_utf8_lossy(record),
                    "a record does not read; the list leaves it out: {why}"
                ),
            }
        })
        .await?;
        if without_origin > 0 {
            tracing::warn!(
                records = without_origin,
                "records written before records kept their scope and key cannot be named; the list leaves them out"
            );
        }
        Ok(newest.into_vec())
    }
}

/// Adds `counts` to their records, one script each, all sent at once (they pipeline on the
/// multiplexed connection; on a cluster each goes to its record's node). A record that is gone
/// takes no count. Returns the counts that could not be written, to try again.
async fn write_replays(
    commands: Arc<Commands>,
    prefix: String,
    counts: HashMap<RecordId, u64>,
) -> HashMap<RecordId, u64> {
    let writes = counts.into_iter().map(|(id, n)| {
        let commands = &commands;
        let keys = RecordKeys::new(&prefix, &id);
        async move {
            // Counts are statistics: a failover may lose a batch, which never changes an answer.
            let written = run_script(
                commands,
                Durability::Primary,
                "count replays",
                &COUNT_REPLAYS_SCRIPT,
                &[keys.record.as_str()],
                |script| {
                    script.arg(n);
                },
            )
            .await
            .and_then(Written::into_payload);
            (id, n, written.err())
        }
    });
    let mut unwritten = HashMap::new();
    let mut error = None;
    for (id, n, failed) in futures_util::future::join_all(writes).await {
        match failed {
            None => {}
            // Not written: kept for the next round.
            Some(err @ StoreError::Unavailable(_)) => {
                error.get_or_insert(err);
                unwritten.insert(id, n);
            }
            // A record the script cannot count on: no later round would do better.
            Some(err) => tracing::warn!(error = %err, replays = n, "replays not counted"),
        }
    }
    if let Some(err) = error {
        tracing::warn!(error = %err, records = unwritten.len(), "could not write replay counts; trying again");
    }
    unwritten
}

/// The payload of the script `what`, one integer.
fn flag(what: &str, mut reply: std::vec::IntoIter<Value>) -> Result<i64, StoreError> {
    match reply.next() {
        Some(Value::Int(flag)) => Ok(flag),
        other => Err(StoreError::Corrupt(format!("unexpected reply of {what}: {other:?}"))),
    }
}

fn millis_arg(at: UnixMillis) -> i64 {
    at.as_i64()
}
