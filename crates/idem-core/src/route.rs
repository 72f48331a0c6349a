//! Rules by path: a request's path picks the policy it runs under, or lets it pass untouched.
//!
//! The gateway's `[[route]]` tables and the tower layer's [`Routes`] are the same thing: the first
//! route whose pattern matches the path wins, and a path no route matches gets the default policy.
//!
//! A path is matched as an upstream could read it, so that no spelling of it gets weaker
//! protection than the route it names (see [`Routes::choose`]). Three readings are taken:
//!
//! * **literally**, segment by segment exactly as sent, escapes and dot segments left in, as a
//!   server that routes on the raw path does (Express, Node's `http`, Starlette): so
//!   `/payments/../webhooks/x` is read under `/payments/*` too;
//! * **as sent**, with only percent-encoded unreserved characters (`%61` for `a`) decoded and dot
//!   segments (`/a/../b`) resolved, which RFC 3986 says change nothing;
//! * **normalised**, as WSGI/ASGI servers, nginx or Spring read it: every `%XX` decoded (`%2F` and
//!   `%5C` become separators, and so does a backslash, as IIS reads it) and dot segments removed,
//!   so `/payments%2F1` and `/webhooks/..\payments\1` read `/payments/1`.
//!
//! Repeated slashes are merged and a trailing slash ignored only once normalised: many servers
//! (Express in strict mode, Spring 6) route `/payments/1/` and `//payments/1` apart from
//! `/payments/1`.
//!
//! Which reading's route a request gets depends on whether each one protects it: see
//! [`Routes::choose`]. [`PathReadings`] adds, for upstreams that route that way, ASCII
//!   case-insensitive matching and the stripping of `;params` from each segment.
//!
//! One decoding only: `%252F` reads `%2F`, not `/`. The request itself is forwarded as sent; only
//! the choice of rules uses the readings.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::policy::{Policy, PolicyError};

/// A route's path pattern.
///
/// * `/payments`: exactly that path;
/// * `/orders/{id}/pay`: a `{name}` segment matches any one non-empty segment;
/// * `/webhooks/*`: a trailing `*` matches the prefix and everything below it (`/webhooks`,
///   `/webhooks/`, `/webhooks/github/push`), and `/*` matches every path.
///
/// A pattern is matched against each reading of a path (see `docs/design.md`): literally and as
/// sent, segment by segment, and normalised, with the pattern's own literals normalised the same
/// way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePattern {
    text: Arc<str>,
    segments: Vec<Segment>,
    /// A trailing `/*`: longer paths match too.
    prefix: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
}

/// A route pattern that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid route path {pattern:?}: {reason}")]
pub struct RoutePatternError {
    pattern: String,
    reason: &'static str,
}

impl FromStr for RoutePattern {
    type Err = RoutePatternError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let err = |reason| RoutePatternError {
            pattern: text.to_owned(),
            reason,
        };
        let rest = text.strip_prefix('/').ok_or_else(|| err("a path starts with /"))?;
        if text.contains(['?', '#']) {
            return Err(err("a route matches the path only, without a query or fragment"));
        }
        let mut raw: Vec<&str> = rest.split('/').collect();
        let prefix = raw.last() == Some(&"*");
        if prefix {
            raw.pop();
        }
        let mut segments = Vec::with_capacity(raw.len());
        for segment in raw {
            if segment.contains('*') {
                return Err(err("* may only be the whole last segment, as in /webhooks/*"));
            }
            if matches!(&*unreserved_decoded(segment), "." | "..") {
                return Err(err(
                    "dot segments (. and ..) never reach the gateway; write the path they resolve to",
                ));
            }
            segments.push(match segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                Some(name) if !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') => {
                    Segment::Param
                }
                Some(_) => return Err(err("a parameter is {name}, with letters, digits or _ in its name")),
                None if segment.contains(['{', '}']) => {
                    return Err(err("a parameter is a whole segment, as in /orders/{id}/pay"));
                }
                None => Segment::Literal(unreserved_decoded(segment).into_owned()),
            });
        }
        Ok(Self {
            text: text.into(),
            segments,
            prefix,
        })
    }
}

impl fmt::Display for RoutePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl RoutePattern {
    /// The pattern as written, which is also its metrics label.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The pattern as written, shared.
    pub fn label(&self) -> Arc<str> {
        self.text.clone()
    }

    /// Whether `path` (a request's path, without its query) matches as sent (with unreserved
    /// escapes and dot segments resolved). [`Routes::choose`] looks at the other readings too.
    pub fn matches(&self, path: &str) -> bool {
        match normalized(path) {
            Some(segments) => self.matches_segments(&segments),
            None => false,
        }
    }

    fn matches_segments(&self, path: &[Cow<'_, str>]) -> bool {
        let fits = if self.prefix {
            path.len() >= self.segments.len()
        } else {
            path.len() == self.segments.len()
        };
        fits && self.segments.iter().zip(path).all(|(pattern, segment)| match pattern {
            Segment::Param => !segment.is_empty(),
            Segment::Literal(literal) => literal == segment,
        })
    }

    /// Whether every path `other` matches is matched by `self` too: then `other`, listed after
    /// `self`, could never match.
    pub fn covers(&self, other: &RoutePattern) -> bool {
        let fits = if self.prefix {
            other.segments.len() >= self.segments.len()
        } else {
            !other.prefix && other.segments.len() == self.segments.len()
        };
        fits && self
            .segments
            .iter()
            .zip(&other.segments)
            .all(|(mine, theirs)| match (mine, theirs) {
                (Segment::Param, Segment::Param) => true,
                (Segment::Param, Segment::Literal(literal)) => !literal.is_empty(),
                (Segment::Literal(_), Segment::Param) => false,
                (Segment::Literal(a), Segment::Literal(b)) => a == b,
            })
    }
}

/// The pattern normalised as paths are under `readings`: its literals decoded, split at decoded
/// slashes, empty and `.` pieces dropped, `..` resolved, `;params` stripped and case folded if
/// asked.
fn normal_form(pattern: &RoutePattern, readings: PathReadings) -> NormalPattern {
    let mut segments = Vec::with_capacity(pattern.segments.len());
    for segment in &pattern.segments {
        match segment {
            Segment::Param => segments.push(NormalSegment::Param),
            Segment::Literal(literal) => {
                for piece in normal_pieces(literal, readings) {
                    match piece {
                        Piece::Up => {
                            segments.pop();
                        }
                        Piece::Segment(bytes) => segments.push(NormalSegment::Literal(bytes)),
                    }
                }
            }
        }
    }
    NormalPattern {
        segments,
        prefix: pattern.prefix,
    }
}

/// A pattern as the normalised reading sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NormalPattern {
    segments: Vec<NormalSegment>,
    prefix: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum NormalSegment {
    Literal(Vec<u8>),
    Param,
}

impl NormalPattern {
    fn matches(&self, path: &[Vec<u8>]) -> bool {
        let fits = if self.prefix {
            path.len() >= self.segments.len()
        } else {
            path.len() == self.segments.len()
        };
        // A normalised path has no empty segments, so `{param}` matches any of them.
        fits && self.segments.iter().zip(path).all(|(pattern, segment)| match pattern {
            NormalSegment::Param => true,
            NormalSegment::Literal(literal) => literal == segment,
        })
    }
}

/// What one raw segment contributes to the normalised reading.
enum Piece {
    /// A `..`: drop the segment before.
    Up,
    Segment(Vec<u8>),
}

/// The pieces of one raw segment in the normalised reading: `;params` stripped if asked (before
/// decoding, as Tomcat does, so `%3B` stays a character), every escape decoded, split at decoded
/// slashes, empty and `.` pieces dropped, case folded if asked.
fn normal_pieces(segment: &str, readings: PathReadings) -> Vec<Piece> {
    let segment = match segment.split_once(';') {
        Some((kept, _)) if readings.strip_params => kept,
        _ => segment,
    };
    // A backslash is a separator too (IIS, and Windows servers generally, read it as one).
    percent_decoded(segment)
        .split(|&b| b == b'/' || b == b'\\')
        .filter_map(|piece| match piece {
            b"" | b"." => None,
            b".." => Some(Piece::Up),
            _ if readings.case_insensitive => Some(Piece::Segment(piece.to_ascii_lowercase())),
            _ => Some(Piece::Segment(piece.to_vec())),
        })
        .collect()
}

/// The normalised reading of a path: its segments as bytes, none of them empty, `.` or `..`;
/// `None` for a path that is not absolute.
fn normal_reading(path: &str, readings: PathReadings) -> Option<Vec<Vec<u8>>> {
    let rest = path.strip_prefix('/')?;
    let mut segments = Vec::new();
    for piece in rest.split('/').flat_map(|segment| normal_pieces(segment, readings)) {
        match piece {
            Piece::Up => {
                segments.pop();
            }
            Piece::Segment(bytes) => segments.push(bytes),
        }
    }
    Some(segments)
}

/// Whether some reading of `path` climbs above its root: a `..` segment, as sent, percent-encoded
/// (`%2e%2e`), behind a decoded slash or backslash (`a%2F..%2F..`), with `;params` after it
/// (`..;x`, as Tomcat reads it) or with `;params` kept (`a;%2F..%2F..`, as a server that decodes
/// before it splits reads it), with more `..` than segments before it. An upstream reached under
/// a path prefix (`http://host/api`) that normalises such a path would serve a path outside the
/// prefix: admission refuses it ([`Protocol::admit_path`](crate::protocol::Protocol::admit_path)).
pub(crate) fn climbs_above_root(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    [false, true].into_iter().any(|strip_params| {
        let readings = PathReadings {
            case_insensitive: false,
            strip_params,
        };
        let mut depth = 0_usize;
        for piece in rest.split('/').flat_map(|segment| normal_pieces(segment, readings)) {
            match piece {
                Piece::Up if depth == 0 => return true,
                Piece::Up => depth -= 1,
                Piece::Segment(_) => depth += 1,
            }
        }
        false
    })
}

/// `text` with every valid `%XX` decoded (to bytes: the result need not be UTF-8); a `%` not
/// followed by two hex digits stays as it is.
pub(crate) fn percent_decoded(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| text.get(i + 1..i + 3))
            .flatten()
            .filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(b) => {
                decoded.push(b);
                i += 3;
            }
            None => {
                decoded.push(bytes[i]);
                i += 1;
            }
        }
    }
    decoded
}

/// Shows a normalised reading as a path, for messages.
fn shown(segments: &[Vec<u8>]) -> String {
    let mut text = String::new();
    for segment in segments {
        text.push('/');
        text.push_str(&String::from_utf8_lossy(segment));
    }
    if text.is_empty() {
        text.push('/');
    }
    text
}

/// A path's segments with unreserved characters decoded and dot segments resolved (the reading as
/// sent, as RFC 3986 says is equivalent); `None` for a path that is not absolute (`*` of
/// `OPTIONS *`). Repeated and trailing slashes stay empty segments: many servers route them apart.
fn normalized(path: &str) -> Option<Vec<Cow<'_, str>>> {
    let rest = path.strip_prefix('/')?;
    let mut segments: Vec<Cow<'_, str>> = Vec::new();
    let mut raw = rest.split('/').peekable();
    while let Some(segment) = raw.next() {
        let segment = unreserved_decoded(segment);
        let last = raw.peek().is_none();
        match &*segment {
            "." if last => segments.push(Cow::Borrowed("")),
            "." => {}
            ".." => {
                segments.pop();
                if last {
                    segments.push(Cow::Borrowed(""));
                }
            }
            _ => segments.push(segment),
        }
    }
    Some(segments)
}

/// A path's segments exactly as sent, escapes, dot segments and empty segments left in: what a
/// server that routes on the raw path (Express, Node's `http`, Starlette) matches, so that
/// `/payments/../webhooks/x` is read under `/payments/*` too.
fn literal(path: &str) -> Option<Vec<Cow<'_, str>>> {
    let rest = path.strip_prefix('/')?;
    Some(rest.split('/').map(Cow::Borrowed).collect())
}

/// `segment` with percent-encoded unreserved characters (letters, digits, `-._~`) decoded, as
/// RFC 3986 says is equivalent; other escapes are left as they are.
fn unreserved_decoded(segment: &str) -> Cow<'_, str> {
    if !segment.contains('%') {
        return Cow::Borrowed(segment);
    }
    let bytes = segment.as_bytes();
    let mut decoded = String::with_capacity(segment.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| segment.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok())
            .filter(|b| b.is_ascii_alphanumeric() || b"-._~".contains(b));
        match escaped {
            Some(b) => {
                decoded.push(char::from(b));
                i += 3;
            }
            None => {
                // Char boundaries: copy up to the next '%' whole.
                let next = segment[i + 1..].find('%').map_or(bytes.len(), |at| i + 1 + at);
                decoded.push_str(&segment[i..next]);
                i = next;
            }
        }
    }
    Cow::Owned(decoded)
}

/// What a route does with the requests it matches.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant, reason = "built once at start, and plain to write")]
pub enum RouteRule {
    /// Apply the protocol with this policy.
    Protect(Policy),
    /// Pass the requests through untouched: no key is read, nothing is stored.
    PassThrough,
}

/// A pattern and its rule.
#[derive(Debug, Clone)]
pub struct Route {
    /// Which paths.
    pub pattern: RoutePattern,
    /// What happens to them.
    pub rule: RouteRule,
}

/// A route that cannot be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// The pattern does not parse.
    #[error(transparent)]
    Pattern(#[from] RoutePatternError),
    /// An earlier route matches every path this one does, so it could never match.
    #[error("route {pattern} can never match: every path it matches is matched first by route {by}")]
    Shadowed {
        /// The route that can never match.
        pattern: String,
        /// The earlier route that takes its paths.
        by: String,
    },
    /// The route's policy cannot work.
    #[error("route {pattern}: {error}")]
    Policy {
        /// The route.
        pattern: String,
        /// What is wrong with its policy.
        error: PolicyError,
    },
}

/// How the upstream may read paths beyond the three readings every route table uses (literally,
/// as sent, and normalised: see `docs/design.md`). Both are off by default; turn on what the upstream
/// does, so that a spelling it reads as a protected path is matched as that path.
///
/// Written as a flag takes it: `standard` (nothing added), or a comma-separated list of
/// `case-insensitive` and `strip-params`.
///
/// ```
/// use idem_core::PathReadings;
///
/// let tomcat: PathReadings = "strip-params".parse()?;
/// assert!(tomcat.strip_params && !tomcat.case_insensitive);
/// assert_eq!(PathReadings::default().to_string(), "standard");
/// # Ok::<(), idem_core::PathReadingsError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PathReadings {
    /// The normalised reading ignores ASCII case (`/PAYMENTS/1` is `/payments/1`), as ASP.NET and
    /// IIS route.
    pub case_insensitive: bool,
    /// The normalised reading drops `;params` from each segment (`/pay;jsessionid=1` is `/pay`),
    /// as Tomcat, Jetty and Spring do.
    pub strip_params: bool,
}

/// A [`PathReadings`] that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown path reading {0:?}: use standard, or case-insensitive and/or strip-params (comma-separated)")]
pub struct PathReadingsError(String);

impl FromStr for PathReadings {
    type Err = PathReadingsError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut readings = Self::default();
        for word in text.split(',').map(str::trim) {
            match word {
                "standard" => {}
                "case-insensitive" => readings.case_insensitive = true,
                "strip-params" => readings.strip_params = true,
                other => return Err(PathReadingsError(other.to_owned())),
            }
        }
        Ok(readings)
    }
}

impl fmt::Display for PathReadings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.case_insensitive, self.strip_params) {
            (false, false) => f.write_str("standard"),
            (true, false) => f.write_str("case-insensitive"),
            (false, true) => f.write_str("strip-params"),
            (true, true) => f.write_str("case-insensitive,strip-params"),
        }
    }
}

/// A path whose readings fall under two different protecting rules: which one the upstream runs
/// depends on how it reads paths, so neither is applied and the request is refused
/// (`400 path-ambiguous`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the path {path} falls under {as_sent} as sent, but reads as {normalised} once decoded and normalised (as many servers read it), which falls under {normalised_rules}: idem cannot tell which of the two the upstream runs, so it applies neither. Send the path as the upstream names it. The request was not processed."
)]
pub struct PathAmbiguous {
    /// The path as sent.
    pub path: String,
    /// The rules of the reading as sent: `route PATTERN` or `the default rules (no route)`.
    pub as_sent: String,
    /// The normalised reading.
    pub normalised: String,
    /// The rules of the normalised reading.
    pub normalised_rules: String,
}

impl PathAmbiguous {
    /// The client's answer: `400 path-ambiguous`, the detail naming both readings.
    pub fn to_problem(&self) -> crate::problem::Problem {
        crate::problem::Problem::new(crate::problem::ProblemKind::PathAmbiguous, self.to_string())
    }
}

/// Rules by path, tried in order: the first route whose pattern matches a request's path decides
/// its policy; a path no route matches gets the default policy.
///
/// Each path is matched in three readings, literally, as sent and normalised (see `docs/design.md`);
/// [`choose`](Self::choose) says how they are reconciled.
///
/// ```
/// use std::time::Duration;
/// use http::Method;
/// use idem_core::{MissingKeyPolicy, Policy, RouteRule, Routes};
///
/// let defaults = Policy::default();
/// let routes = Routes::new()
///     .with("/webhooks/*", RouteRule::PassThrough)?
///     .with(
///         "/payments/{id}/capture",
///         RouteRule::Protect(Policy { missing_key: MissingKeyPolicy::Require, ..defaults.clone() }),
///     )?
///     .with("/exports", RouteRule::Protect(Policy { ttl: Duration::from_secs(600), ..defaults }))?;
/// assert!(matches!(routes.find(&Method::POST, "/webhooks/github", &Policy::default()).unwrap().map(|r| &r.rule), Some(RouteRule::PassThrough)));
/// let capture = routes.find(&Method::POST, "/payments/p_1/capture", &Policy::default()).unwrap().unwrap();
/// assert_eq!(capture.pattern.as_str(), "/payments/{id}/capture");
/// // Another spelling of the same path, as servers read it, gets the same route.
/// let spelt = routes.find(&Method::POST, "/payments/p_1%2Fcapture/", &Policy::default()).unwrap().unwrap();
/// assert_eq!(spelt.pattern.as_str(), "/payments/{id}/capture");
/// assert!(routes.find(&Method::POST, "/refunds", &Policy::default()).unwrap().is_none());
/// // A route an earlier one hides is refused.
/// assert!(Routes::new().with("/*", RouteRule::PassThrough)?.with("/pay", RouteRule::PassThrough).is_err());
/// # Ok::<(), idem_core::RouteError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Routes {
    routes: Vec<Route>,
    /// Each route's pattern as the normalised reading sees it, in the routes' order.
    normal: Vec<NormalPattern>,
    readings: PathReadings,
}

impl Routes {
    /// No routes: every request gets the default policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads paths as the upstream does too: case-insensitively, or with `;params` stripped.
    pub fn with_readings(mut self, readings: PathReadings) -> Self {
        self.readings = readings;
        self.normal = self
            .routes
            .iter()
            .map(|route| normal_form(&route.pattern, readings))
            .collect();
        self
    }

    /// The readings added to the standard two.
    pub fn readings(&self) -> PathReadings {
        self.readings
    }

    /// Adds a route after the others; refused if the pattern does not parse, if an earlier route
    /// matches every path it does, or if its policy cannot work.
    pub fn push(&mut self, pattern: RoutePattern, rule: RouteRule) -> Result<(), RouteError> {
        if let Some(earlier) = self.routes.iter().find(|route| route.pattern.covers(&pattern)) {
            return Err(RouteError::Shadowed {
                pattern: pattern.to_string(),
                by: earlier.pattern.to_string(),
            });
        }
        if let RouteRule::Protect(policy) = &rule {
            policy.validate().map_err(|error| RouteError::Policy {
                pattern: pattern.to_string(),
                error,
            })?;
        }
        self.normal.push(normal_form(&pattern, self.readings));
        self.routes.push(Route { pattern, rule });
        Ok(())
    }

    /// [`push`](Self::push), with the pattern parsed, for building routes in one expression.
    pub fn with(mut self, pattern: &str, rule: RouteRule) -> Result<Self, RouteError> {
        self.push(pattern.parse()?, rule)?;
        Ok(self)
    }

    /// The route whose rules a `method` request to `path` gets (`None`: the default policy,
    /// `default`), or why it gets none. See [`choose`](Self::choose).
    pub fn find(&self, method: &http::Method, path: &str, default: &Policy) -> Result<Option<&Route>, PathAmbiguous> {
        Ok(self.choose(method, path, default)?.map(|at| &self.routes[at]))
    }

    /// The index of the route whose rules a `method` request to `path` (without its query) gets;
    /// `None` for the default policy, `default` (whose methods say whether it protects the request).
    ///
    /// The first route matching each reading is found: the path exactly as sent (escapes and dot
    /// segments left in), with unreserved escapes decoded and dot segments resolved, and
    /// normalised (see the module docs). If the readings agree, that is the choice. If they do not,
    /// no spelling may get weaker protection than a reading of it. A reading *protects* the
    /// request when its route (or the default) applies the protocol to `method`:
    ///
    /// * a reading that does not protect the request (an `enabled = false` route, or one whose
    ///   `methods` leave `method` out) never wins over one that does: a spelling that reads as a
    ///   protected path is protected;
    /// * a route the normalised reading names wins over the default that another reading falls
    ///   to (`/%70ayments/1` is `/payments/{id}`): the default is for paths no route names;
    /// * any other pair of protections (two routes, or a route as sent and the default once
    ///   normalised, as with `/payments/..%2Frefunds`) is [`PathAmbiguous`].
    ///
    /// `*` (the asterisk form of `OPTIONS *`) gets the catch-all route `/*`, if there is one.
    pub fn choose(&self, method: &http::Method, path: &str, default: &Policy) -> Result<Option<usize>, PathAmbiguous> {
        if self.routes.is_empty() {
            return Ok(None);
        }
        if path == "*" {
            return Ok(self
                .routes
                .iter()
                .position(|route| route.pattern.prefix && route.pattern.segments.is_empty()));
        }
        let first = |segments: Option<Vec<Cow<'_, str>>>| {
            segments.and_then(|segments| {
                self.routes
                    .iter()
                    .position(|route| route.pattern.matches_segments(&segments))
            })
        };
        let raw = first(literal(path));
        let as_sent = first(normalized(path));
        let normal = normal_reading(path, self.readings);
        let normalised = normal
            .as_ref()
            .and_then(|segments| self.normal.iter().position(|pattern| pattern.matches(segments)));
        if raw == as_sent && as_sent == normalised {
            return Ok(normalised);
        }
        let protects = |at: &Option<usize>| match at {
            None => default.applies_to(method),
            Some(at) => match &self.routes[*at].rule {
                RouteRule::Protect(policy) => policy.applies_to(method),
                RouteRule::PassThrough => false,
            },
        };
        let mut protecting: Vec<Option<usize>> = [raw, as_sent, normalised].into_iter().filter(protects).collect();
        protecting.sort();
        protecting.dedup();
        match protecting.as_slice() {
            // No reading protects the request: it passes through whichever is taken.
            [] => Ok(normalised),
            [one] => Ok(*one),
            [None, Some(route)] if normalised == Some(*route) => Ok(normalised),
            _ => {
                let other = [raw, as_sent]
                    .into_iter()
                    .find(|at| *at != normalised && protects(at))
                    .unwrap_or(as_sent);
                Err(PathAmbiguous {
                    path: path.to_owned(),
                    as_sent: self.rules_of(other),
                    normalised: shown(normal.as_deref().unwrap_or_default()),
                    normalised_rules: self.rules_of(normalised),
                })
            }
        }
    }

    /// The rules a reading fell under, for messages.
    fn rules_of(&self, at: Option<usize>) -> String {
        match at {
            Some(at) => format!("route {}", self.routes[at].pattern),
            None => "the default rules (no route)".to_owned(),
        }
    }

    /// The routes, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter()
    }

    /// Whether there are no routes.
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Routes of `(pattern, rule)` rows, in order, each accepted.
    fn routes<const N: usize>(rows: [(&str, RouteRule); N]) -> Routes {
        rows.into_iter().fold(Routes::new(), |routes, (pattern, rule)| {
            routes.with(pattern, rule).unwrap()
        })
    }

    /// The route a `POST` to `path` gets, under the default policy.
    fn pick(routes: &Routes, path: &str) -> Result<Option<usize>, PathAmbiguous> {
        routes.choose(&http::Method::POST, path, &Policy::default())
    }

    fn pattern(text: &str) -> RoutePattern {
        text.parse().unwrap()
    }

    #[test]
    fn exact_param_and_prefix_patterns_match_what_they_say() {
        let cases: &[(&str, &[&str], &[&str])] = &[
            ("/payments", &["/payments"], &["/payments/", "/payments/1", "/pay", "/"]),
            ("/", &["/"], &["/a", "//"]),
            (
                "/orders/{id}/pay",
                &["/orders/1/pay", "/orders/o_9/pay"],
                &["/orders//pay", "/orders/1/pay/x", "/orders/pay"],
            ),
            (
                "/webhooks/*",
                &["/webhooks", "/webhooks/", "/webhooks/github/push"],
                &["/webhooksx", "/", "/web"],
            ),
            ("/*", &["/", "/anything/at/all"], &["*"]),
        ];
        for (text, yes, no) in cases {
            let p = pattern(text);
            for path in *yes {
                assert!(p.matches(path), "{text} matches {path}");
            }
            for path in *no {
                assert!(!p.matches(path), "{text} does not match {path}");
            }
        }
    }

    #[test]
    fn another_spelling_of_a_path_reaches_the_same_route() {
        let p = pattern("/webhooks/*");
        for path in [
            "/%77ebhooks/x",
            "/payments/../webhooks/x",
            "/./webhooks",
            "/webhooks/%2e%2E/webhooks",
        ] {
            assert!(p.matches(path), "{path}");
        }
        let pay = pattern("/payments");
        assert!(pay.matches("/webhooks/../payments"));
        assert!(pay.matches("/pay%6Dents"));
        // Reserved characters stay escaped: %2F is not a separator.
        assert!(!pattern("/a/b").matches("/a%2Fb"));
        // Escapes of other characters are left alone, multibyte text included.
        assert!(pattern("/caf%C3%A9").matches("/caf%C3%A9"));
    }

    #[test]
    fn bad_patterns_say_why() {
        for bad in [
            "payments",
            "/a*",
            "/*/x",
            "/a/{}",
            "/a/{id",
            "/a/x{id}",
            "/a?b=1",
            "/a/../b",
            "/{a-b}",
            "/a/%2E%2e/b",
        ] {
            assert!(bad.parse::<RoutePattern>().is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn a_route_an_earlier_one_covers_is_refused() {
        let shadowed = [
            ("/*", "/payments"),
            ("/*", "/"),
            ("/payments/*", "/payments"),
            ("/payments/*", "/payments/{id}/*"),
            ("/orders/{id}", "/orders/42"),
            ("/orders/{id}/*", "/orders/{x}/pay"),
            ("/a", "/a"),
        ];
        for (first, second) in shadowed {
            assert!(pattern(first).covers(&pattern(second)), "{first} covers {second}");
            let refused = routes([(first, RouteRule::PassThrough)]).with(second, RouteRule::PassThrough);
            assert!(
                matches!(refused, Err(RouteError::Shadowed { .. })),
                "{first} then {second}"
            );
        }
        let fine = [
            ("/payments", "/payments/*"),
            ("/orders/42", "/orders/{id}"),
            ("/orders/{id}", "/orders/{id}/pay"),
            ("/orders/{id}", "/orders/"),
            ("/a/*", "/b/*"),
            ("/orders/{id}/pay", "/orders/*"),
        ];
        for (first, second) in fine {
            assert!(
                !pattern(first).covers(&pattern(second)),
                "{first} does not cover {second}"
            );
        }
    }

    #[test]
    fn the_first_matching_route_wins_and_policies_are_checked() {
        let routes = routes([
            ("/payments/refunds", RouteRule::PassThrough),
            ("/payments/*", RouteRule::Protect(Policy::default())),
        ]);
        assert_eq!(pick(&routes, "/payments/refunds"), Ok(Some(0)));
        assert_eq!(pick(&routes, "/payments/p1"), Ok(Some(1)));
        assert_eq!(pick(&routes, "/other"), Ok(None));
        let bad = Policy {
            ttl: std::time::Duration::ZERO,
            ..Policy::default()
        };
        let refused = Routes::new().with("/x", RouteRule::Protect(bad)).unwrap_err();
        assert!(refused.to_string().contains("ttl"), "{refused}");
    }

    #[test]
    fn the_normalised_reading_is_what_servers_read() {
        let standard = PathReadings::default();
        let both = PathReadings {
            case_insensitive: true,
            strip_params: true,
        };
        let cases: &[(&str, PathReadings, &str)] = &[
            ("/payments/1", standard, "/payments/1"),
            ("//payments/1", standard, "/payments/1"),
            ("/payments//1", standard, "/payments/1"),
            ("/payments/1/", standard, "/payments/1"),
            ("/payments/1//", standard, "/payments/1"),
            ("/payments%2F1", standard, "/payments/1"),
            ("/payments%2f1", standard, "/payments/1"),
            ("/payments/./1", standard, "/payments/1"),
            ("/payments/x/../1", standard, "/payments/1"),
            ("/payments/x/..%2F1", standard, "/payments/1"),
            ("/webhooks/..%2Fpayments%2F1", standard, "/payments/1"),
            ("/../../payments/1", standard, "/payments/1"),
            ("/pay%6Dents/1", standard, "/payments/1"),
            ("/", standard, "/"),
            ("//", standard, "/"),
            ("/a/..", standard, "/"),
            // One decoding only, and escapes that are not two hex digits stay as they are.
            ("/payments%252F1", standard, "/payments%2F1"),
            ("/a%2", standard, "/a%2"),
            ("/a%+1", standard, "/a%+1"),
            ("/caf%C3%A9", standard, "/café"),
            // The settings: case folded, `;params` stripped before decoding.
            ("/PAYMENTS/1", standard, "/PAYMENTS/1"),
            ("/PAYMENTS/1", both, "/payments/1"),
            ("/pay;jsessionid=1", standard, "/pay;jsessionid=1"),
            ("/pay;jsessionid=1", both, "/pay"),
            ("/payments;a=b/1;c", both, "/payments/1"),
            ("/pay%3Bx", both, "/pay;x"),
        ];
        for &(path, readings, expected) in cases {
            let reading = normal_reading(path, readings).expect("an absolute path");
            assert_eq!(shown(&reading), expected, "{path} under {readings}");
        }
        assert_eq!(normal_reading("*", standard), None);
    }

    /// `/payments/{id}` requires a key; `/payments/*` and `/webhooks/*` pass through.
    fn payments() -> Routes {
        let require = Policy {
            missing_key: crate::MissingKeyPolicy::Require,
            ..Policy::default()
        };
        routes([
            ("/payments/{id}", RouteRule::Protect(require)),
            ("/payments/*", RouteRule::PassThrough),
            ("/webhooks/*", RouteRule::PassThrough),
            ("/orders/*", RouteRule::Protect(Policy::default())),
        ])
    }

    #[test]
    fn a_spelling_gets_the_protection_of_what_it_reads_as() {
        let routes = payments();
        // (path, the route chosen: None for the default)
        let cases: &[(&str, Option<usize>)] = &[
            ("/payments/1", Some(0)),
            // As sent: the default; normalised: the route. The route.
            ("//payments/1", Some(0)),
            ("/payments%2F1", Some(0)),
            ("/payments%2f1", Some(0)),
            // As sent: the pass-through `/payments/*`; normalised: the route. Protection wins.
            ("/payments//1", Some(0)),
            ("/payments/1/", Some(0)),
            ("/webhooks/..%2Fpayments%2F1", Some(0)),
            // As sent: the pass-through; normalised: the default. Protection wins.
            ("/webhooks/..%2Frefunds", None),
            // Both readings pass through, if by different routes: the request passes.
            ("/webhooks/..%2Fpayments%2F1%2Frefunds", Some(1)),
            ("/payments/1/refunds", Some(1)),
            ("/webhooks/github", Some(2)),
            // Both readings agree.
            ("/refunds", None),
            ("/orders//7", Some(3)),
            // Not absolute, and no catch-all route: the default.
            ("*", None),
            ("", None),
        ];
        for &(path, expected) in cases {
            assert_eq!(pick(&routes, path), Ok(expected), "{path}");
        }
    }

    #[test]
    fn a_spelling_under_two_protections_is_ambiguous() {
        let routes = payments();
        for (path, as_sent, normalised, normalised_rules) in [
            (
                "/payments/..%2Frefunds",
                "route /payments/{id}",
                "/refunds",
                "the default rules (no route)",
            ),
            (
                "/payments/..%2Forders%2F7",
                "route /payments/{id}",
                "/orders/7",
                "route /orders/*",
            ),
            (
                "/orders/..%2Fpayments%2F1",
                "route /orders/*",
                "/payments/1",
                "route /payments/{id}",
            ),
        ] {
            let err = pick(&routes, path).unwrap_err();
            assert_eq!(
                (
                    err.as_sent.as_str(),
                    err.normalised.as_str(),
                    err.normalised_rules.as_str()
                ),
                (as_sent, normalised, normalised_rules),
                "{path}"
            );
            let message = err.to_string();
            for named in [path, as_sent, normalised, normalised_rules] {
                assert!(message.contains(named), "{message} names {named}");
            }
        }
    }

    #[test]
    fn a_dot_segment_or_a_backslash_never_walks_a_path_out_of_its_protection() {
        let routes = routes([
            ("/payments/*", RouteRule::Protect(Policy::default())),
            ("/webhooks/*", RouteRule::PassThrough),
        ]);
        // Read literally (Express, Node's http), these are under /payments/*; resolved, under the
        // pass-through route. Protection wins.
        for path in [
            "/payments/../webhooks/x",
            "/payments/%2e%2e/webhooks/x",
            "/payments/.%2e/webhooks/x",
        ] {
            assert_eq!(pick(&routes, path), Ok(Some(0)), "{path}");
        }
        // IIS reads a backslash as a separator.
        for path in ["/webhooks/..\\payments\\1", "/webhooks/..%5Cpayments%5C1"] {
            assert_eq!(pick(&routes, path), Ok(Some(0)), "{path}");
        }
        // A pass-through spelling that reads as nothing protected stays passed through.
        assert_eq!(pick(&routes, "/webhooks/github/../gitlab"), Ok(Some(1)));
    }

    #[test]
    fn a_reading_whose_route_leaves_the_method_out_does_not_protect_it() {
        let post_only = Policy {
            methods: vec![http::Method::POST],
            ..Policy::default()
        };
        let routes = routes([
            ("/orders/{id}", RouteRule::Protect(post_only)),
            ("/*", RouteRule::Protect(Policy::default())),
        ]);
        let patch = |path| routes.choose(&http::Method::PATCH, path, &Policy::default());
        // Read as sent, `//orders/7` is the catch-all's (which protects PATCH); normalised, it is
        // /orders/{id}, which does not: the protection wins.
        assert_eq!(patch("//orders/7"), Ok(Some(1)));
        assert_eq!(
            patch("/orders/7"),
            Ok(Some(0)),
            "readings that agree are taken as they are"
        );
        // For a POST both readings protect, under different rules.
        assert!(pick(&routes, "//orders/7").is_err());
    }

    #[test]
    fn the_asterisk_form_gets_the_catch_all() {
        let catch_all = routes([
            ("/pay", RouteRule::PassThrough),
            ("/*", RouteRule::Protect(Policy::default())),
        ]);
        assert_eq!(pick(&catch_all, "*"), Ok(Some(1)));
        let passing = Routes::new().with("/*", RouteRule::PassThrough).unwrap();
        assert_eq!(pick(&passing, "*"), Ok(Some(0)));
        assert_eq!(pick(&payments(), "*"), Ok(None));
    }

    #[test]
    fn the_settings_add_what_the_upstream_reads() {
        let pay =
            |readings| routes([("/Payments/{id}", RouteRule::Protect(Policy::default()))]).with_readings(readings);
        let standard = pay(PathReadings::default());
        assert_eq!(pick(&standard, "/payments/1"), Ok(None));
        assert_eq!(
            pick(&standard, "/Payments/1;jsessionid=2"),
            Ok(Some(0)),
            "a param is a segment's text"
        );
        assert_eq!(pick(&standard, "/Payments/1/x;y"), Ok(None));
        let aspnet = pay("case-insensitive".parse().unwrap());
        for path in ["/payments/1", "/PAYMENTS/1", "/Payments/1/", "//pAyMeNtS%2f1"] {
            assert_eq!(pick(&aspnet, path), Ok(Some(0)), "{path}");
        }
        let tomcat = pay("strip-params".parse().unwrap());
        assert_eq!(pick(&tomcat, "/Payments;jsessionid=1/1"), Ok(Some(0)));
        assert_eq!(pick(&tomcat, "/payments/1"), Ok(None));
        // A route added after the setting is read the same way.
        let later = Routes::new()
            .with_readings("case-insensitive".parse().unwrap())
            .with("/Pay", RouteRule::Protect(Policy::default()))
            .unwrap();
        assert_eq!(pick(&later, "/pay"), Ok(Some(0)));
    }

    #[test]
    fn path_readings_parse_and_print() {
        for text in [
            "standard",
            "case-insensitive",
            "strip-params",
            "case-insensitive,strip-params",
        ] {
            let readings: PathReadings = text.parse().unwrap();
            assert_eq!(readings.to_string(), text);
        }
        let both: PathReadings = "strip-params, case-insensitive".parse().unwrap();
        assert!(both.case_insensitive && both.strip_params);
        for bad in ["", "lowercase", "case-insensitive,"] {
            assert!(bad.parse::<PathReadings>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_path_climbs_above_its_root_in_every_spelling_of_dot_dot() {
        for path in [
            "/..",
            "/../pay",
            "/%2e%2e/admin",
            "/%2E./admin",
            "/a/..%2F..%2Fadmin",
            "/a/..%5C..%5Cadmin",
            "/..;x/admin",
            "/a/../../admin",
            "/./../admin",
            "/a;%2f..%2f..%2fadmin",
            "/a;%5c..%5c..%5cadmin",
            "/a;\\..\\..\\admin",
        ] {
            assert!(climbs_above_root(path), "{path} climbs above the root");
        }
        for path in [
            "/",
            "/pay",
            "/a/../pay",
            "/a/b/../../pay",
            "/./pay",
            "/..a/b",
            "/a..",
            "/%2e%2e%2e/x",
            "*",
        ] {
            assert!(!climbs_above_root(path), "{path} stays below the root");
        }
    }
}
