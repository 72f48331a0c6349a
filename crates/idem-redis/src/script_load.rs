//! A script and the one load of it that the calls which found it missing share.
//!
//! Calls send `EVALSHA`; a server that does not know the script (a fresh or restarted server, a
//! replica just promoted, a `SCRIPT FLUSH`) answers `NOSCRIPT`, and the script must be loaded
//! before it is sent again. Under load every call in flight gets that answer at once, and if each
//! loaded the script itself the server would compile it as many times (thousands, at the moment
//! it is busiest getting back on its feet). So the calls that find a script missing take turns:
//! the first loads it, and the others, seeing that a load was tried since they sent, only send
//! again. A load that failed is not tried again by every waiter in turn (a server that is down
//! would make each wait its timeout): the waiters send again, and find out for themselves.
//!
//! The turns are kept per connection ([`ScriptLoads`] in each `Commands`), so that loads on one
//! server never stand for loads on another (two stores in one process, a test's private server).

use std::sync::atomic::{AtomicU64, Ordering};

use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, Pipeline, RedisResult, Script, ServerErrorKind, Value};
use tokio::sync::Mutex;

/// How many scripts the store has: each has its own place (`index`) in a [`ScriptLoads`].
pub(crate) const SCRIPTS: usize = 13;

/// One of the store's Lua scripts.
pub(crate) struct StoreScript {
    script: Script,
    /// Its place in a [`ScriptLoads`], below [`SCRIPTS`] and no other script's.
    index: usize,
}

/// The loads of each script on one connection: the turns of [`StoreScript::send`].
#[derive(Default)]
pub(crate) struct ScriptLoads {
    scripts: [Turns; SCRIPTS],
}

#[derive(Default)]
struct Turns {
    /// Loads tried so far (ended, whether they succeeded or not).
    tried: AtomicU64,
    /// Held while a load is tried.
    loading: Mutex<()>,
}

impl StoreScript {
    /// The script with `code`, at `index` in a [`ScriptLoads`].
    pub(crate) fn new(index: usize, code: &str) -> Self {
        assert!(index < SCRIPTS, "a script's index is below SCRIPTS");
        Self {
            script: Script::new(code),
            index,
        }
    }

    /// Its place in a [`ScriptLoads`].
    #[cfg(test)]
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// The script's SHA1, which `EVALSHA` names it by.
    pub(crate) fn hash(&self) -> &str {
        self.script.get_hash()
    }

    /// Sends `call` (the script's `EVALSHA`, alone or in a pipeline) on `conn` and returns its
    /// reply; if the server did not know the script, loads it, once for every call that found it
    /// missing meanwhile on the connection whose turns are `loads`, and sends it again. A call
    /// that still finds it missing then (the load another call tried failed) loads it itself.
    pub(crate) async fn send<C: ScriptCall>(
        &self,
        loads: &ScriptLoads,
        conn: &mut (impl ConnectionLike + Send),
        call: &C,
    ) -> RedisResult<C::Reply> {
        let turns = &loads.scripts[self.index];
        let seen = turns.tried.load(Ordering::Acquire);
        let reply = call.send(conn).await;
        if !C::missing(&reply) {
            return reply;
        }
        {
            let _turn = turns.loading.lock().await;
            if turns.tried.load(Ordering::Acquire) == seen {
                let loaded = self.load(conn).await;
                turns.tried.fetch_add(1, Ordering::AcqRel);
                loaded?;
            }
        }
        let reply = call.send(conn).await;
        if !C::missing(&reply) {
            return reply;
        }
        self.load(conn).await?;
        call.send(conn).await
    }

    async fn load(&self, conn: &mut (impl ConnectionLike + Send)) -> RedisResult<()> {
        self.script.load_async(conn).await.map(drop)
    }
}

/// What carries a script's `EVALSHA`: the command alone, or a pipeline that starts with it.
pub(crate) trait ScriptCall {
    /// The reply to what is sent.
    type Reply;

    /// Sends it.
    fn send<'a>(
        &'a self,
        conn: &'a mut (impl ConnectionLike + Send),
    ) -> impl Future<Output = RedisResult<Self::Reply>> + Send + 'a;

    /// True if `reply` says the server does not know the script.
    fn missing(reply: &RedisResult<Self::Reply>) -> bool;
}

impl ScriptCall for Cmd {
    type Reply = Value;

    fn send<'a>(
        &'a self,
        conn: &'a mut (impl ConnectionLike + Send),
    ) -> impl Future<Output = RedisResult<Value>> + Send + 'a {
        self.query_async(conn)
    }

    fn missing(reply: &RedisResult<Value>) -> bool {
        matches!(reply, Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript))
    }
}

/// A pipeline whose first command is the script's `EVALSHA`: a pipeline's replies come as they
/// are, errors included, so the script's is the first.
impl ScriptCall for Pipeline {
    type Reply = Vec<Value>;

    fn send<'a>(
        &'a self,
        conn: &'a mut (impl ConnectionLike + Send),
    ) -> impl Future<Output = RedisResult<Vec<Value>>> + Send + 'a {
        conn.req_packed_commands(self, 0, self.len())
    }

    fn missing(reply: &RedisResult<Vec<Value>>) -> bool {
        matches!(reply, Ok(replies) if matches!(replies.first(), Some(Value::ServerError(err)) if err.code() == "NOSCRIPT"))
    }
}
