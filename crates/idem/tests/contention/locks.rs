//! What idem's own connections do on PostgreSQL during the storm, read from `pg_stat_activity`
//! by the gateways' `application_name` (a name of this run's own): how many wait on a lock at
//! once, sampled through the storm, and what is still running once it ended.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::common::ledger::connect;

/// How often `pg_stat_activity` is read.
const EVERY: Duration = Duration::from_millis(200);

/// The lock waits seen by a [`Watch`].
#[derive(Debug, Default, Clone)]
pub(crate) struct Waits {
    /// Reads of `pg_stat_activity`.
    pub(crate) samples: usize,
    /// The most of idem's connections seen waiting on a lock at once.
    pub(crate) most_at_once: usize,
    /// Reads that saw at least one.
    pub(crate) samples_with_waits: usize,
    /// The statements seen waiting (their first 70 characters), with how many samples saw them.
    pub(crate) statements: BTreeMap<String, usize>,
}

impl Waits {
    /// These samples and `later`'s, as one watch.
    pub(crate) fn and(mut self, later: Self) -> Self {
        self.samples += later.samples;
        self.samples_with_waits += later.samples_with_waits;
        self.most_at_once = self.most_at_once.max(later.most_at_once);
        for (statement, seen) in later.statements {
            *self.statements.entry(statement).or_default() += seen;
        }
        self
    }
}

impl std::fmt::Display for Waits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} samples saw idem's connections waiting on a lock (at most {} at once)",
            self.samples_with_waits, self.samples, self.most_at_once
        )?;
        for (statement, seen) in &self.statements {
            write!(f, "\n    {seen:>4} × {statement}")?;
        }
        Ok(())
    }
}

/// Samples idem's lock waits until stopped.
pub(crate) struct Watch {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Waits>,
}

impl Watch {
    /// Starts sampling the connections named `application` on `database`.
    pub(crate) async fn start(database: &str, application: &str) -> Self {
        let client = connect(database).await;
        let application = application.to_owned();
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let mut waits = Waits::default();
            loop {
                let rows = client
                    .query(
                        "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 70) FROM pg_stat_activity
                         WHERE application_name = $1 AND wait_event_type = 'Lock'",
                        &[&application],
                    )
                    .await
                    .expect("read pg_stat_activity");
                waits.samples += 1;
                if !rows.is_empty() {
                    waits.samples_with_waits += 1;
                    waits.most_at_once = waits.most_at_once.max(rows.len());
                    for row in rows {
                        *waits.statements.entry(row.get(0)).or_default() += 1;
                    }
                }
                tokio::select! {
                    _ = &mut stopped => return waits,
                    () = tokio::time::sleep(EVERY) => {}
                }
            }
        });
        Self { stop, task }
    }

    /// Stops sampling; what was seen.
    pub(crate) async fn stop(self) -> Waits {
        let _ = self.stop.send(());
        self.task.await.expect("the lock watch")
    }
}
