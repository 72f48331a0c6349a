//! A script run as a write of the store: sent on the shared connection when it need only reach
//! the primary, or with `WAIT` on a lent connection (`acknowledged.rs`) when the replicas must
//! have it, and its reply taken only if it names the call (`call.rs`).

use std::sync::Arc;

use idem_core::StoreError;
use redis::Cmd;

use crate::ack::Acknowledgement;
use crate::acknowledged;
use crate::call::{Call, Written};
use crate::conn::Commands;
use crate::script_load::StoreScript;

/// Where a call must have landed before it counts.
#[derive(Clone, Copy)]
pub(crate) enum Durability<'a> {
    /// On the primary: sent on the store's shared connection (reads, and writes a failover may
    /// lose without changing an answer).
    Primary,
    /// On the replicas that the rule wants, if any: the call is followed by `WAIT` on a
    /// connection of the rule's pool lent to it alone, and fails as unavailable if too few
    /// acknowledge it.
    Replicas(&'a Acknowledgement),
}

/// Room for a script call's arguments: the command, hash, key count, keys, nonce and the most any
/// operation passes (`begin`'s eleven), with room to spare.
const COMMAND_ARGS: usize = 24;
/// Room for a script call's bytes besides its keys' names: hash and nonce, the arguments of a claim
/// (fingerprint, origin, channel, times) or of a small answer. A larger answer grows it once.
const COMMAND_BYTES: usize = 768;

/// Runs `script` (the operation `what`) on `keys` with a fresh nonce and `args`; returns the reply
/// after the nonce it names. A reply that names another call, or is not a script's
/// reply at all, is an error, and the connection it came on is replaced. The reply of a call that
/// [`Durability::Replicas`] is returned even if too few replicas acknowledged it, with that failure
/// beside it ([`Written::into_payload`] fails then): the caller may have to undo what it wrote.
pub(crate) async fn run_script(
    commands: &Arc<Commands>,
    durability: Durability<'_>,
    what: &'static str,
    script: &StoreScript,
    keys: &[&str],
    args: impl FnOnce(&mut Cmd),
) -> Result<Written, StoreError> {
    let call = Call::new(what, keys[0]);
    // Sized for the whole call at once: grown argument by argument, the command's buffers would be
    // reallocated about ten times on every call.
    let names: usize = keys.iter().map(|key| key.len()).sum();
    let mut evalsha = Cmd::with_capacity(COMMAND_ARGS, COMMAND_BYTES + names);
    evalsha.arg("EVALSHA");
    evalsha.arg(script.hash()).arg(keys.len());
    for key in keys {
        evalsha.arg(*key);
    }
    evalsha.arg(&call.nonce);
    args(&mut evalsha);
    match durability {
        Durability::Replicas(ack) if ack.wanted() > 0 => acknowledged::run(ack, &call, script, &evalsha).await,
        _ => {
            let (mut conn, generation) = commands.get();
            let reply = script.send(&commands.loads, &mut conn, &evalsha).await;
            Ok(Written::counted(call.take(reply, commands, generation)?))
        }
    }
}
