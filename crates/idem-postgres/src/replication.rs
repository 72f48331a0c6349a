//! What a failover (or a crash) of the PostgreSQL server can lose of idem's commits: read once
//! when a store connects (`synchronous_commit`, `synchronous_standby_names`, the standbys that
//! stream from the server, whether it is a standby itself), classified by a pure function
//! ([`classify`]) into a [`Replication`], and logged from one place ([`Replication::log`]).

use std::fmt;

use deadpool_postgres::Pool;

use crate::error::describe;

/// The settings, as this store's own connections see them: a `synchronous_commit` set in the URL
/// (`options=-c synchronous_commit=off`), for the role or for the database counts, since it is
/// these sessions' commits that matter. Walsenders of logical replication and base backups are
/// not standbys a failover could promote, so they are not counted.
const READ: &str = "
WITH senders AS (
    SELECT r.sync_state
    FROM pg_stat_replication r
    WHERE r.state IS DISTINCT FROM 'backup'
      AND NOT EXISTS (
        SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical'
      )
)
SELECT pg_is_in_recovery(),
    current_setting('synchronous_commit'),
    current_setting('synchronous_standby_names'),
    (SELECT count(*) FROM senders),
    (SELECT count(*) FROM senders WHERE sync_state IN ('sync', 'quorum')),
    (SELECT count(*) FROM senders WHERE sync_state IS NULL)";

/// How long a commit waits before it is acknowledged (`synchronous_commit`), from least to most.
/// The three remote levels wait for a standby only when `synchronous_standby_names` names one;
/// otherwise they wait for the server's own disk, as `local` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SynchronousCommit {
    /// `off`: not even for the server's own disk. A crash of the server loses the commits of its
    /// last moments (up to three times `wal_writer_delay`, 600 ms by default).
    Off,
    /// `local`: for the server's own disk, never for a standby.
    Local,
    /// `remote_write`: for the synchronous standbys to have handed the commit to their operating
    /// system. Survives the loss of the primary, but not that together with an operating-system
    /// crash of the standby, which had not flushed it yet.
    RemoteWrite,
    /// `on`: for the synchronous standbys to have flushed the commit to their disk. Survives the
    /// loss of the primary, and an operating-system crash of the standby as well.
    On,
    /// `remote_apply`: as `on`, and for the standbys to have applied it, so that reads on them see
    /// it too (idem reads from the primary only: for idem it keeps what `on` keeps).
    RemoteApply,
}

impl SynchronousCommit {
    /// Reads `current_setting('synchronous_commit')` (its canonical spellings only, which is what
    /// `current_setting` returns).
    fn parse(value: &str) -> Option<Self> {
        Some(match value {
            "off" => Self::Off,
            "local" => Self::Local,
            "remote_write" => Self::RemoteWrite,
            "on" => Self::On,
            "remote_apply" => Self::RemoteApply,
            _ => return None,
        })
    }

    /// The setting's value, as PostgreSQL spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Local => "local",
            Self::RemoteWrite => "remote_write",
            Self::On => "on",
            Self::RemoteApply => "remote_apply",
        }
    }

    /// Whether a commit at this level waits for the synchronous standbys (when some are named).
    fn waits_for_standbys(self) -> bool {
        self >= Self::RemoteWrite
    }
}

impl fmt::Display for SynchronousCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a failover of the PostgreSQL server can lose of the claims and answers idem commits, as
/// read when the store connected ([`PostgresStore::replication`](crate::PostgresStore::replication)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Replication {
    /// Every commit waits for the synchronous standbys that `synchronous_standby_names` names: a
    /// failover to one of them loses no claim and no answer that idem acted on
    /// (`remote_write`: unless that standby's operating system crashes in the same moment).
    Synchronous {
        /// `on`, `remote_apply` or `remote_write`.
        commit: SynchronousCommit,
        /// `synchronous_standby_names`, as set (`FIRST 1 (standby1)`, `ANY 1 (a, b)`, ...).
        standby_names: String,
        /// How many synchronous (or quorum) standbys stream from the server now; `None` when the
        /// role may not see it (it needs `pg_read_all_stats`). With none, every commit waits
        /// until one is back.
        connected: Option<usize>,
    },
    /// Standbys receive commits after they were acknowledged: a failover can lose the claims and
    /// answers committed in its last moments, up to the replication lag.
    Asynchronous {
        /// `synchronous_commit`; `off` also loses the last commits when the server itself crashes.
        commit: SynchronousCommit,
        /// `synchronous_standby_names` (empty when no standby is synchronous).
        standby_names: String,
        /// How many standbys stream from the server.
        standbys: usize,
    },
    /// No standby streams from the server and none is named synchronous: there is no failover to
    /// lose commits in, but the server's disk holds the only copy. Replication below PostgreSQL
    /// (the storage of a managed service) is not visible from here.
    Standalone {
        /// `synchronous_commit`; `off` loses the last commits when the server crashes.
        commit: SynchronousCommit,
    },
    /// The server is a standby itself (`pg_is_in_recovery()`): it refuses every write.
    Standby,
    /// The settings could not be read (a server that only looks like PostgreSQL, or an error).
    Unknown {
        /// Why, in words.
        reason: String,
    },
}

/// The settings [`classify`] reads, as the server reported them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
    pub(crate) in_recovery: bool,
    pub(crate) synchronous_commit: String,
    pub(crate) synchronous_standby_names: String,
    /// Physical walsenders: the standbys that stream from the server.
    pub(crate) standbys: usize,
    /// Those whose `sync_state` is `sync` or `quorum`.
    pub(crate) synchronous: usize,
    /// Those whose `sync_state` this role may not see.
    pub(crate) hidden: usize,
}

/// What the settings mean for a failover. Durable against one only when a standby is named
/// synchronous and commits wait for it (`on`, `remote_apply`, `remote_write`).
pub(crate) fn classify(settings: &Settings) -> Replication {
    if settings.in_recovery {
        return Replication::Standby;
    }
    let Some(commit) = SynchronousCommit::parse(settings.synchronous_commit.trim()) else {
        return Replication::Unknown {
            reason: format!("synchronous_commit is {:?}", settings.synchronous_commit),
        };
    };
    let standby_names = settings.synchronous_standby_names.trim().to_owned();
    if !standby_names.is_empty() && commit.waits_for_standbys() {
        let connected = (settings.hidden == 0).then_some(settings.synchronous);
        return Replication::Synchronous {
            commit,
            standby_names,
            connected,
        };
    }
    if settings.standbys == 0 && standby_names.is_empty() {
        return Replication::Standalone { commit };
    }
    Replication::Asynchronous {
        commit,
        standby_names,
        standbys: settings.standbys,
    }
}

/// Reads the settings on one of the store's own connections; an error becomes
/// [`Replication::Unknown`], never a failure to connect.
pub(crate) async fn read(pool: &Pool) -> Replication {
    let read = async {
        let client = pool.get().await.map_err(|err| describe(&err))?;
        let row = client.query_one(READ, &[]).await.map_err(|err| describe(&err))?;
        let count = |i: usize| -> Result<usize, String> {
            let n: i64 = row.try_get(i).map_err(|err| describe(&err))?;
            Ok(usize::try_from(n).unwrap_or(0))
        };
        Ok::<_, String>(Settings {
            in_recovery: row.try_get(0).map_err(|err| describe(&err))?,
            synchronous_commit: row.try_get(1).map_err(|err| describe(&err))?,
            synchronous_standby_names: row.try_get(2).map_err(|err| describe(&err))?,
            standbys: count(3)?,
            synchronous: count(4)?,
            hidden: count(5)?,
        })
    };
    match read.await {
        Ok(settings) => classify(&settings),
        Err(reason) => Replication::Unknown { reason },
    }
}

/// What a failover can lose when commits do not wait for a standby.
const FAILOVER_LOSES: &str = "claims and stored answers committed in the last moments before a failover (up to the \
     replication lag) can be lost: a retry would run again without Idempotency-Recovered";
/// How to lose nothing.
const FIX: &str = "name a synchronous standby (synchronous_standby_names = 'FIRST 1 (standby1)') and set \
     synchronous_commit = on or remote_apply";
/// What `synchronous_commit = off` loses without any failover.
const CRASH_LOSES: &str = "synchronous_commit = off: a crash of the server can lose the claims and stored answers \
     of its last moments (a retry would run again without Idempotency-Recovered); set it to on";

impl Replication {
    /// Logs what the settings mean, once, when a store connects: a warning when a failover or a
    /// crash can lose claims or answers, or when commits wait for a standby that is not there;
    /// a line of information otherwise.
    pub(crate) fn log(&self, server: &str) {
        match self {
            Self::Synchronous {
                commit,
                standby_names,
                connected: Some(0),
            } => tracing::warn!(
                server = %server,
                synchronous_commit = %commit,
                synchronous_standby_names = %standby_names,
                "PostgreSQL commits wait for a synchronous standby, and none is connected: every write waits \
                 until one is, and keyed requests get 503 store-unavailable meanwhile"
            ),
            Self::Synchronous {
                commit,
                standby_names,
                connected,
            } => tracing::info!(
                server = %server,
                synchronous_commit = %commit,
                synchronous_standby_names = %standby_names,
                connected = connected.map(|n| n as u64),
                survives = if *commit == SynchronousCommit::RemoteWrite {
                    "the loss of the primary, but not together with an OS crash of the standby"
                } else {
                    "the loss of the primary"
                },
                "PostgreSQL commits wait for a synchronous standby: a failover to it loses no claim and no answer"
            ),
            Self::Asynchronous {
                commit,
                standby_names,
                standbys,
            } => {
                let crash = if *commit == SynchronousCommit::Off {
                    " (with synchronous_commit = off, a crash of the server alone loses them too)"
                } else {
                    ""
                };
                tracing::warn!(
                    server = %server,
                    synchronous_commit = %commit,
                    synchronous_standby_names = %standby_names,
                    standbys = *standbys as u64,
                    "PostgreSQL replicates asynchronously: {FAILOVER_LOSES}{crash}. To lose nothing, {FIX}"
                );
            }
            Self::Standalone { commit } if *commit == SynchronousCommit::Off => {
                tracing::warn!(server = %server, synchronous_commit = %commit, "PostgreSQL has {CRASH_LOSES}")
            }
            Self::Standalone { commit } => tracing::info!(
                server = %server,
                synchronous_commit = %commit,
                "no PostgreSQL standby streams from this server: there is no failover to lose commits in, \
                 but its disk holds the only copy of every claim and answer"
            ),
            Self::Standby => tracing::warn!(
                server = %server,
                "the PostgreSQL server is a standby (in recovery) and refuses every write: point the store URL \
                 at the primary"
            ),
            Self::Unknown { reason } => tracing::warn!(
                server = %server,
                %reason,
                "could not read PostgreSQL's replication settings: what a failover can lose is unknown"
            ),
        }
    }
}

impl fmt::Display for Replication {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Synchronous {
                commit, standby_names, ..
            } => write!(
                f,
                "synchronous (synchronous_commit = {commit}, synchronous_standby_names = '{standby_names}')"
            ),
            Self::Asynchronous {
                commit,
                standby_names,
                standbys,
            } => write!(
                f,
                "asynchronous ({standbys} standbys, synchronous_commit = {commit}, synchronous_standby_names = '{standby_names}')"
            ),
            Self::Standalone { commit } => write!(f, "standalone (no standby, synchronous_commit = {commit})"),
            Self::Standby => f.write_str("a standby (in recovery)"),
            Self::Unknown { reason } => write!(f, "unknown ({reason})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(commit: &str, names: &str, standbys: usize, synchronous: usize, hidden: usize) -> Settings {
        Settings {
            in_recovery: false,
            synchronous_commit: commit.to_owned(),
            synchronous_standby_names: names.to_owned(),
            standbys,
            synchronous,
            hidden,
        }
    }

    fn synchronous(commit: SynchronousCommit, names: &str, connected: Option<usize>) -> Replication {
        Replication::Synchronous {
            commit,
            standby_names: names.to_owned(),
            connected,
        }
    }

    fn asynchronous(commit: SynchronousCommit, names: &str, standbys: usize) -> Replication {
        Replication::Asynchronous {
            commit,
            standby_names: names.to_owned(),
            standbys,
        }
    }

    #[test]
    fn settings_are_classified_by_what_a_failover_can_lose() {
        use SynchronousCommit::*;
        let first = "FIRST 1 (standby1)";
        let cases = [
            // (commit, synchronous_standby_names, standbys, of them synchronous, hidden) → class
            (settings("on", "", 0, 0, 0), Replication::Standalone { commit: On }),
            (settings("off", "", 0, 0, 0), Replication::Standalone { commit: Off }),
            (
                settings("local", "", 0, 0, 0),
                Replication::Standalone { commit: Local },
            ),
            // Without a synchronous standby named, the remote levels wait for nobody.
            (settings("remote_apply", "", 2, 0, 0), asynchronous(RemoteApply, "", 2)),
            (settings("on", "", 1, 0, 0), asynchronous(On, "", 1)),
            (settings("on", "  ", 1, 0, 0), asynchronous(On, "", 1)),
            // Named, but commits do not wait for it.
            (settings("local", first, 1, 1, 0), asynchronous(Local, first, 1)),
            (settings("off", first, 1, 1, 0), asynchronous(Off, first, 1)),
            (settings("local", first, 0, 0, 0), asynchronous(Local, first, 0)),
            // Named, and commits wait for it.
            (settings("on", first, 1, 1, 0), synchronous(On, first, Some(1))),
            (
                settings("remote_apply", "ANY 1 (a, b)", 2, 2, 0),
                synchronous(RemoteApply, "ANY 1 (a, b)", Some(2)),
            ),
            (
                settings("remote_write", first, 2, 1, 0),
                synchronous(RemoteWrite, first, Some(1)),
            ),
            // Named, and none connected: commits block.
            (settings("on", first, 0, 0, 0), synchronous(On, first, Some(0))),
            // A role without pg_read_all_stats sees the standbys but not their sync_state.
            (settings("on", first, 2, 0, 2), synchronous(On, first, None)),
        ];
        for (settings, expected) in cases {
            assert_eq!(classify(&settings), expected, "{settings:?}");
        }
    }

    #[test]
    fn a_standby_and_an_unknown_level_are_told_apart() {
        let standby = Settings {
            in_recovery: true,
            ..settings("on", "FIRST 1 (s)", 0, 0, 0)
        };
        assert_eq!(classify(&standby), Replication::Standby);
        assert!(matches!(
            classify(&settings("sometimes", "", 0, 0, 0)),
            Replication::Unknown { reason } if reason.contains("sometimes")
        ));
    }
}
