//! [`Checkpoints`]: a keyed handler records the steps it has done, so that a run taking its record
//! over (its instance died, or its run was given up) resumes after them instead of repeating them.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use idem_core::{
    StoreError,
    protocol::{Claim, Protocol},
    store::Checkpoint,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::OnceCell;

/// The longest checkpoint name, in bytes.
pub const MAX_CHECKPOINT_NAME: usize = 128;

/// The largest checkpoint value, in bytes: a checkpoint holds an id or a small result, not a
/// document.
pub const MAX_CHECKPOINT_BYTES: usize = 64 * 1024;

/// The steps of a keyed request's run, in its request extensions (with axum:
/// `Option<Extension<Checkpoints>>`; requests without a key have none).
///
/// A step that has an effect outside the handler (charging a card, sending a mail) is wrapped in
/// [`step`](Self::step): the first run does it and records its result under the request's claim;
/// a run marked recovered, which takes over from a run that died after the step, gets the recorded
/// result back without doing it again.
///
/// ```no_run
/// use axum::Extension;
/// use idem_tower::{CheckpointError, Checkpoints};
///
/// # struct Provider;
/// # impl Provider { async fn charge(&self, cents: u64) -> Result<String, PayError> { Ok("ch_1".into()) } }
/// # async fn send_receipt(charge: &str) -> Result<(), PayError> { Ok(()) }
/// #[derive(Debug)]
/// enum PayError {
///     Provider(String),
///     Checkpoint(CheckpointError),
/// }
///
/// impl From<CheckpointError> for PayError {
///     fn from(err: CheckpointError) -> Self {
///         Self::Checkpoint(err)
///     }
/// }
///
/// async fn pay(steps: Checkpoints, provider: &Provider) -> Result<String, PayError> {
///     // Charged once, whatever happens to the run after this line.
///     let charge: String = steps.step("charge_created", || provider.charge(1000)).await?;
///     send_receipt(&charge).await?;
///     Ok(charge)
/// }
/// ```
#[derive(Clone, Debug)]
pub struct Checkpoints {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    protocol: Protocol,
    claim: Claim,
    /// What the runs before this one recorded, read from the store on first use (never for a
    /// run that is not recovered: there is nothing to read).
    earlier: OnceCell<Vec<Checkpoint>>,
    /// What this run recorded.
    saved: Mutex<Vec<Checkpoint>>,
}

/// A checkpoint that could not be read or recorded.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The request's claim was lost: another run holds the record now. Stop without further
    /// effects; the other run answers the client.
    #[error("the claim on this request was lost to another run; stop without further effects")]
    Fenced,
    /// The store did not answer.
    #[error("the store did not record or read the checkpoint: {0}")]
    Store(#[source] StoreError),
    /// The name or the value is not one a checkpoint can hold.
    #[error("checkpoint {name:?}: {reason}")]
    Invalid {
        /// The checkpoint's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The value did not serialise, or a recorded value did not deserialise as asked.
    #[error("checkpoint {name:?}: {source}")]
    Json {
        /// The checkpoint's name.
        name: String,
        /// What serde_json said.
        #[source]
        source: serde_json::Error,
    },
}

impl From<StoreError> for CheckpointError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::Fenced => Self::Fenced,
            other => Self::Store(other),
        }
    }
}

impl Checkpoints {
    pub(crate) fn new(protocol: Protocol, claim: Claim) -> Self {
        Self {
            inner: Arc::new(Inner {
                protocol,
                claim,
                earlier: OnceCell::new(),
                saved: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Whether a run before this one may have had effects: then [`get`](Self::get) can find
    /// what it recorded.
    pub fn recovered(&self) -> bool {
        self.inner.claim.recovered()
    }

    /// The value recorded under `name`, by this run or the one before it.
    pub async fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, CheckpointError> {
        let Some(bytes) = self.get_bytes(name).await? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| CheckpointError::Json {
                name: name.to_owned(),
                source,
            })
    }

    /// Records `value` under `name` (replacing an earlier value of that name). Call it once the
    /// step is done, before the next step starts. [`CheckpointError::Fenced`]: stop.
    pub async fn save<T: Serialize + ?Sized>(&self, name: &str, value: &T) -> Result<(), CheckpointError> {
        let bytes = serde_json::to_vec(value).map_err(|source| CheckpointError::Json {
            name: name.to_owned(),
            source,
        })?;
        self.save_bytes(name, Bytes::from(bytes)).await
    }

    /// Runs `step` unless a run of this request already did (its result was recorded under
    /// `name`): then its recorded result is returned and `step` is not run. A result that `step`
    /// produces is recorded before it is returned.
    pub async fn step<T, E, F, Fut>(&self, name: &str, step: F) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<CheckpointError>,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        if let Some(done) = self.get(name).await? {
            return Ok(done);
        }
        let value = step().await?;
        self.save(name, &value).await?;
        Ok(value)
    }

    /// The raw bytes recorded under `name`, by this run or the one before it.
    pub async fn get_bytes(&self, name: &str) -> Result<Option<Bytes>, CheckpointError> {
        let mine = self.saved().iter().find(|c| c.name == name).map(|c| c.value.clone());
        if mine.is_some() {
            return Ok(mine);
        }
        let earlier = self
            .inner
            .earlier
            .get_or_try_init(|| self.inner.protocol.checkpoints(&self.inner.claim))
            .await?;
        Ok(earlier.iter().find(|c| c.name == name).map(|c| c.value.clone()))
    }

    /// Records raw bytes under `name`.
    pub async fn save_bytes(&self, name: &str, value: Bytes) -> Result<(), CheckpointError> {
        let invalid = |reason: String| CheckpointError::Invalid {
            name: name.to_owned(),
            reason,
        };
        if name.is_empty() || name.len() > MAX_CHECKPOINT_NAME {
            return Err(invalid(format!("a name has 1 to {MAX_CHECKPOINT_NAME} bytes")));
        }
        if value.len() > MAX_CHECKPOINT_BYTES {
            return Err(invalid(format!(
                "{} bytes; a checkpoint holds at most {MAX_CHECKPOINT_BYTES} (an id or a small result)",
                value.len()
            )));
        }
        let checkpoint = Checkpoint {
            name: name.to_owned(),
            value,
        };
        self.inner
            .protocol
            .checkpoint(&self.inner.claim, checkpoint.clone())
            .await?;
        let mut saved = self.saved();
        match saved.iter_mut().find(|c| c.name == name) {
            Some(earlier) => *earlier = checkpoint,
            None => saved.push(checkpoint),
        }
        Ok(())
    }

    fn saved(&self) -> std::sync::MutexGuard<'_, Vec<Checkpoint>> {
        // Each critical section leaves the list whole.
        self.inner.saved.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
