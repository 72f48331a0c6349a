//! What [`Store::list`](super::Store::list) is asked and answers: the records of a store by state,
//! time, route and recovery, for the operator chasing a payment (`idem list`).

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;
use std::str::FromStr;

use super::{Origin, RecordId};
use crate::time::UnixMillis;

/// Where a listed record is in its life, as an operator asks about it. A record's stored state
/// and its times at the store's `now` decide it: an answer or an unknown outcome past its
/// `expires_at` is a tombstone (the key is kept, refused as expired, until `purge_at`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ListedState {
    /// A run holds the key (its lease may have ended without anyone taking it over yet).
    InFlight,
    /// A run ended without an answer (its caller left, the upstream failed): the same request
    /// runs again, recovered, until `expires_at`.
    Unknown,
    /// The answer is stored and replayed.
    Completed,
    /// Past `expires_at`: the answer (or the chance to run again) is gone, the key is kept.
    Tombstone,
}

impl ListedState {
    /// Every state, in the order of a record's life.
    pub const ALL: [Self; 4] = [Self::InFlight, Self::Unknown, Self::Completed, Self::Tombstone];

    /// The word `idem list` reads and writes.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InFlight => "in-flight",
            Self::Unknown => "unknown",
            Self::Completed => "completed",
            Self::Tombstone => "tombstone",
        }
    }

    /// The state of a record stored as `state` (a stored word: `in-flight`, `completed`,
    /// `unknown`) with these times, at `now`. `has_answer`: a completed record still holds its
    /// answer (a store that drops answers at `expires_at` may not know; then true).
    pub fn at(
        state: &str,
        expires_at: Option<UnixMillis>,
        purge_at: Option<UnixMillis>,
        has_answer: bool,
        now: UnixMillis,
    ) -> Option<Self> {
        let live = |until: Option<UnixMillis>| until.is_some_and(|until| now < until);
        match state {
            super::backend::IN_FLIGHT => Some(Self::InFlight),
            // Released before records kept `expires_at`: taken over until `purge_at`.
            super::backend::UNKNOWN if live(expires_at.or(purge_at)) => Some(Self::Unknown),
            super::backend::COMPLETED if has_answer && live(expires_at) => Some(Self::Completed),
            super::backend::UNKNOWN | super::backend::COMPLETED => Some(Self::Tombstone),
            _ => None,
        }
    }
}

impl fmt::Display for ListedState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ListedState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|state| state.as_str() == s).ok_or_else(|| {
            let words: Vec<_> = Self::ALL.iter().map(|state| state.as_str()).collect();
            format!("{s:?} is not a record state; one of {}", words.join(", "))
        })
    }
}

/// Which records [`Store::list`](super::Store::list) returns: every condition given must hold.
#[derive(Debug, Clone)]
pub struct ListQuery {
    /// The store's time, by which states are judged (read with [`Store::clock`](super::Store::clock)).
    pub now: UnixMillis,
    /// Only records in this state.
    pub state: Option<ListedState>,
    /// Only records whose latest run was recovered.
    pub recovered: bool,
    /// Only records created at or after this time.
    pub since: Option<UnixMillis>,
    /// Only records of this path or below it, read as servers may read it and without regard to
    /// ASCII case ([`path_is_under`]): `/payments` matches `/payments`, `/payments/pay_1` and
    /// `/PAYMENTS/%70ay_2`, not `/payments-old`.
    pub path: Option<String>,
    /// At most this many records.
    pub limit: usize,
}

impl ListQuery {
    /// Every record, at most `limit`, judged at `now`.
    pub fn all(now: UnixMillis, limit: usize) -> Self {
        Self {
            now,
            state: None,
            recovered: false,
            since: None,
            path: None,
            limit,
        }
    }

    /// The route a store compares records' paths with: the query's path as [`path_reading`] reads
    /// it, in ASCII lower case. A record matches when its path, in ASCII lower case, equals it or
    /// starts with it and a `/` (every path, for `/`).
    pub fn route_reading(&self) -> Option<String> {
        self.path.as_deref().map(route_key)
    }

    /// Whether `listed` answers the query. A store that filters in its own language holds its
    /// filter to this one (the conformance suite runs both).
    pub fn matches(&self, listed: &Listed) -> bool {
        self.state.is_none_or(|state| listed.state == state)
            && (!self.recovered || listed.recovered)
            && self.since.is_none_or(|since| listed.created_at >= since)
            && self
                .path
                .as_deref()
                .is_none_or(|path| path_is_under(&listed.origin.path, path))
    }
}

/// A request's path as the many servers that route it may read it, for an operator to find
/// every spelling of one resource under one route: escapes decoded (`%2F` too: a server that
/// decodes before it routes reads a separator), `;params` dropped from each segment, empty and
/// `.` segments dropped and `..` resolved. Case is kept (identifiers are case-sensitive); the
/// route filter ignores ASCII case instead ([`path_is_under`]). Control characters a decoded
/// escape produced become U+FFFD, so that the reading is a valid text value in every store. A
/// path that is not absolute (`*`) is kept as it is.
pub fn path_reading(path: &str) -> String {
    if !path.starts_with('/') {
        return path.to_owned();
    }
    let decoded = String::from_utf8_lossy(&crate::route::percent_decoded(path)).into_owned();
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        let segment = segment.split(';').next().unwrap_or_default();
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            _ => segments.push(segment),
        }
    }
    let mut reading = String::with_capacity(decoded.len() + 1);
    for segment in &segments {
        reading.push('/');
        reading.extend(segment.chars().map(|c| if c.is_control() { '\u{FFFD}' } else { c }));
    }
    if reading.is_empty() {
        reading.push('/');
    }
    reading
}

/// Whether a record's `path` (a [`path_reading`], as records keep it) is `route` or lies below
/// it, `route` read the same way and both compared without regard to ASCII case:
/// `/payments` takes `/payments`, `/Payments/pay_1` and `/%70ayments//pay_2`, not
/// `/payments-old`; `/` takes every path. The route as a store compares it is
/// [`ListQuery::route_reading`].
pub fn path_is_under(path: &str, route: &str) -> bool {
    let route = route_key(route);
    let path = path.to_ascii_lowercase();
    route == "/" || path == route || path.strip_prefix(&route).is_some_and(|rest| rest.starts_with('/'))
}

/// `route`'s reading in lower case; a route written without its leading `/` (or empty) is read
/// with it.
fn route_key(route: &str) -> String {
    let reading = match route.strip_prefix('/') {
        Some(_) => path_reading(route),
        None => path_reading(&format!("/{route}")),
    };
    reading.to_ascii_lowercase()
}

/// One record as [`Store::list`](super::Store::list) returns it: what it is about, never its
/// answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The record.
    pub id: RecordId,
    /// Where it is in its life at the query's `now`.
    pub state: ListedState,
    /// The request that made it, and the trace of its latest run.
    pub origin: Origin,
    /// The stored answer's status (completed records, and tombstones of them, written since
    /// records kept it).
    pub status: Option<u16>,
    /// When it was first claimed.
    pub created_at: UnixMillis,
    /// How many times its answer was replayed.
    pub replays: u64,
    /// Whether its latest run was a recovered one.
    pub recovered: bool,
    /// Why the record cannot be as stored, if it cannot: a time past the year 9999
    /// ([`UnixMillis::past_rfc3339`]), which no setting idem accepts makes. It is listed all the
    /// same, so that the operator sees it (and one such record never stops a listing).
    pub damaged: Option<String>,
}

impl Listed {
    /// The order of [`Store::list`](super::Store::list)'s answer: newest first, then by scope
    /// and key, so that every store lists the same records in the same order.
    pub fn newest_first(a: &Self, b: &Self) -> Ordering {
        b.created_at
            .cmp(&a.created_at)
            .then_with(|| a.id.scope.as_str().cmp(b.id.scope.as_str()))
            .then_with(|| a.id.key.as_str().cmp(b.id.key.as_str()))
    }
}

/// The first `limit` records of those offered, in [`Listed::newest_first`] order, holding at most
/// `limit` at a time: for a store that scans.
///
/// A binary heap whose top is the oldest record kept, so that each offer costs O(log `limit`)
/// whatever the order records come in: a store scans in hash order, and a sorted `Vec` paid a
/// shift of up to `limit` records for each one kept (200 000 records listed with `--limit 100000`
/// took 45 s of CPU on Redis).
#[derive(Debug)]
pub struct Newest {
    limit: usize,
    kept: BinaryHeap<Oldest>,
}

/// A kept record, ordered so that the heap's greatest is the one [`Listed::newest_first`] puts
/// last: the first to go when a newer one comes.
#[derive(Debug)]
struct Oldest(Listed);

impl Ord for Oldest {
    fn cmp(&self, other: &Self) -> Ordering {
        Listed::newest_first(&self.0, &other.0)
    }
}

impl PartialOrd for Oldest {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Oldest {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Oldest {}

impl Newest {
    /// Keeps up to `limit` records.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            kept: BinaryHeap::with_capacity(limit.min(1024)),
        }
    }

    /// Offers one record.
    pub fn offer(&mut self, listed: Listed) {
        if self.kept.len() < self.limit {
            self.kept.push(Oldest(listed));
            return;
        }
        // Full (or a limit of zero): the record replaces the oldest kept if it comes before it.
        if let Some(mut oldest) = self.kept.peek_mut()
            && Listed::newest_first(&listed, &oldest.0) == Ordering::Less
        {
            *oldest = Oldest(listed);
        }
    }

    /// The records kept, in order.
    pub fn into_vec(self) -> Vec<Listed> {
        // Ascending by `Oldest`'s order is newest first.
        self.kept.into_sorted_vec().into_iter().map(|kept| kept.0).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;
    use crate::scope::Scope;

    fn listed(key: &str, created_at: i64) -> Listed {
        Listed {
            id: RecordId {
                scope: Scope::from_stored("s"),
                key: IdempotencyKey::new(key).unwrap(),
            },
            state: ListedState::Completed,
            origin: Origin::new("POST", "/payments/1", None),
            status: Some(201),
            created_at: UnixMillis::from_i64(created_at),
            replays: 0,
            recovered: false,
            damaged: None,
        }
    }

    #[test]
    fn newest_keeps_the_newest_in_order() {
        let mut newest = Newest::new(3);
        for (i, at) in [5, 1, 9, 7, 3, 9].into_iter().enumerate() {
            newest.offer(listed(&format!("k{i}"), at));
        }
        let kept: Vec<_> = newest
            .into_vec()
            .into_iter()
            .map(|l| (l.created_at.as_i64(), l.id.key.as_str().to_owned()))
            .collect();
        assert_eq!(kept, [(9, "k2".to_owned()), (9, "k5".to_owned()), (7, "k3".to_owned())]);
        assert!(Newest::new(0).into_vec().is_empty());
    }

    proptest::proptest! {
        /// Whatever the order records come in, ties and duplicates included, the kept records
        /// are the first `limit` of them all sorted.
        #[test]
        fn newest_keeps_what_a_sort_would(
            offered in proptest::collection::vec((0_i64..20, 0_u8..3, 0_u8..30), 0..200),
            limit in 0_usize..60,
        ) {
            let records: Vec<Listed> = offered
                .iter()
                .map(|&(at, scope, key)| Listed {
                    id: RecordId {
                        scope: Scope::from_stored(format!("s{scope}")),
                        key: IdempotencyKey::new(&format!("k{key}")).unwrap(),
                    },
                    ..listed("k", at)
                })
                .collect();
            let mut newest = Newest::new(limit);
            for record in records.iter().cloned() {
                newest.offer(record);
            }
            let mut sorted = records;
            sorted.sort_by(Listed::newest_first);
            sorted.truncate(limit);
            proptest::prop_assert_eq!(newest.into_vec(), sorted);
        }
    }

    #[test]
    fn a_route_matches_its_path_and_below_only() {
        assert!(path_is_under("/payments", "/payments"));
        assert!(path_is_under("/payments/pay_1", "/payments"));
        assert!(path_is_under("/payments/pay_1", "/payments/"));
        assert!(path_is_under("/Payments/pay_1", "/PAYMENTS"));
        assert!(path_is_under("/payments/pay_1", "//%70ayments;x/."));
        assert!(!path_is_under("/payments-old", "/payments"));
        assert!(!path_is_under("/pay", "/payments"));
        assert!(path_is_under("/anything", "/"));
        assert!(path_is_under("/anything", ""));
        assert!(path_is_under("/payments/pay_1", "payments"));
    }

    #[test]
    fn every_spelling_of_a_path_reads_alike() {
        for spelling in [
            "/payments/pay_1",
            "/%70ayments/pay_1",
            "//payments/pay_1",
            "/x/../payments/pay_1",
            "/payments%2Fpay_1",
            "/payments;jsessionid=7/pay_1/",
            "/./payments/./pay_1",
        ] {
            assert_eq!(path_reading(spelling), "/payments/pay_1", "{spelling}");
        }
        assert_eq!(path_reading("/PAYMENTS/Pay_1"), "/PAYMENTS/Pay_1", "case is kept");
        assert_eq!(path_reading("/a/%00b/%C3%A9"), "/a/\u{FFFD}b/é");
        assert_eq!(path_reading("/a/%ZZ/%c3"), "/a/%ZZ/\u{FFFD}");
        assert_eq!(path_reading("/../.."), "/");
        assert_eq!(path_reading("*"), "*");
    }

    #[test]
    fn states_are_judged_at_now() {
        let at = UnixMillis::from_i64;
        let now = at(100);
        // (stored state, expires_at, has an answer) -> what a listing shows at 100, purge_at 200
        let cases = [
            (("in-flight", Some(50), false), ListedState::InFlight),
            (("completed", Some(150), true), ListedState::Completed),
            (("completed", Some(100), true), ListedState::Tombstone),
            (("completed", Some(150), false), ListedState::Tombstone),
            (("unknown", Some(150), false), ListedState::Unknown),
            (("unknown", None, false), ListedState::Unknown),
            (("unknown", Some(90), false), ListedState::Tombstone),
        ];
        for ((state, expires_at, has_answer), shown) in cases {
            assert_eq!(
                ListedState::at(state, expires_at.map(at), Some(at(200)), has_answer, now),
                Some(shown),
                "{state}, expiring at {expires_at:?}, with an answer: {has_answer}"
            );
        }
        assert_eq!(ListedState::at("bogus", None, None, false, now), None);
        assert_eq!("tombstone".parse::<ListedState>(), Ok(ListedState::Tombstone));
        assert!(
            "done"
                .parse::<ListedState>()
                .unwrap_err()
                .contains("in-flight, unknown, completed, tombstone")
        );
    }
}
