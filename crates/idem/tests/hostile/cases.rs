//! What a case is: the bytes (or the client request) it sends, how each answer is judged, what it
//! sends after the first answer, and how often the upstream may see it.

/// The key a request carries, as the test generated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyClass {
    /// One valid key header.
    Valid,
    /// A key header that is not one valid key (malformed, repeated, …): never processed.
    Invalid,
    /// A valid UUIDv7 key older than `--ttl`: `422 key-expired`, never processed.
    Expired,
    /// No key header.
    Absent,
}

/// What the answer must be, besides the rules that hold for every answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// A 2xx from the upstream (a first run, not a replay).
    Success,
    /// A problem with this status from idem.
    Refused(u16),
    /// A 2xx from the upstream or a 4xx problem from idem.
    Either,
    /// Only the rules for every answer.
    Anything,
}

/// How one request (or one of two pipelined requests) is judged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spec {
    pub(crate) key: KeyClass,
    /// A complete, well-formed HTTP/1.1 message: it must get an answer.
    pub(crate) http_valid: bool,
    pub(crate) expect: Expect,
    /// The gateway may answer before reading the whole body and close; the answer may be lost.
    pub(crate) early_close_ok: bool,
}

impl Spec {
    pub(crate) fn new(key: KeyClass, http_valid: bool, expect: Expect) -> Self {
        Self {
            key,
            http_valid,
            expect,
            early_close_ok: false,
        }
    }

    /// The gateway may answer before reading the whole body, then close.
    pub(crate) fn early_close(mut self) -> Self {
        self.early_close_ok = true;
        self
    }

    /// How often the upstream may see the case in the end.
    pub(crate) fn reach(&self, then: &Then) -> Reach {
        match (self.key, self.expect, then) {
            (KeyClass::Invalid | KeyClass::Expired, _, _) => Reach::Never,
            (_, Expect::Refused(_), _) => Reach::Never,
            (_, _, Then::Unclaimed(_)) => Reach::Once,
            (_, Expect::Success, _) => Reach::Once,
            _ => Reach::Any,
        }
    }
}

/// An HTTP-valid request that must run (a 2xx from the upstream).
pub(crate) fn runs(key: KeyClass) -> Spec {
    Spec::new(key, true, Expect::Success)
}

/// An HTTP-valid request that idem must refuse with a `status` problem.
pub(crate) fn refused(key: KeyClass, status: u16) -> Spec {
    Spec::new(key, true, Expect::Refused(status))
}

/// An HTTP-valid request that may run or be refused with a problem.
pub(crate) fn either(key: KeyClass) -> Spec {
    Spec::new(key, true, Expect::Either)
}

/// A request malformed at the HTTP/1.1 level: only the rules for every answer hold.
pub(crate) fn dubious(key: KeyClass) -> Spec {
    Spec::new(key, false, Expect::Anything)
}

/// How often the upstream may see a case in the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    Never,
    Once,
    Any,
}

/// What to send after the first answer.
#[derive(Debug, Clone)]
pub(crate) enum Then {
    Nothing,
    /// The same bytes again: a replay (2xx, `Idempotency-Replayed`), the upstream not called again;
    /// a replayed body decodes as its `Content-Encoding` says.
    Replay,
    /// The same key with another body: `422`.
    Mismatch(Vec<u8>),
    /// After a request whose body broke off: a complete request with the same key runs (nothing
    /// was claimed).
    Unclaimed(Vec<u8>),
    /// The same bytes again, for an answer whose body does not decode: a replay (2xx,
    /// `Idempotency-Replayed`), whatever its body.
    ReplayAsStored,
}

/// How a case's request goes out.
#[derive(Debug, Clone)]
pub(crate) enum Sending {
    /// Bytes written to a fresh connection; `half_close` shuts the write side after them.
    Raw { bytes: Vec<u8>, half_close: bool },
    /// A well-formed keyed JSON POST through reqwest; the retry's body (possibly re-serialised).
    Client { key: String, body: String, retry: String },
}

/// One generated case: what it sends and how it is judged.
#[derive(Debug)]
pub(crate) struct Case {
    pub(crate) id: u64,
    pub(crate) what: String,
    pub(crate) sending: Sending,
    /// One spec per expected answer (two for pipelined requests).
    pub(crate) specs: Vec<Spec>,
    pub(crate) then: Then,
    /// How often the upstream may see each case number.
    pub(crate) reach: Vec<(u64, Reach)>,
}
