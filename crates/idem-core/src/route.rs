//! Rules by path: a request's path picks the policy it runs under, or lets it pass untouched.
//!
//! The gateway's `[[route]]` tables and the tower layer's [`Routes`] are the same thing: the first
//! route whose pattern matches the path wins, and a path no route matches gets the default policy.

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
/// Paths are compared segment by segment as sent, except that percent-encoded unreserved
/// characters (`%61` for `a`) and dot segments (`/a/../b`) are resolved first, so a request cannot
/// reach another route's rules by spelling its path differently.
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
            if segment == "." || segment == ".." {
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

    /// Whether `path` (a request's path, without its query) matches.
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

/// A path's segments with unreserved characters decoded and dot segments resolved; `None` for a
/// path that is not absolute (`*` of `OPTIONS *`).
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

/// Rules by path, tried in order: the first route whose pattern matches a request's path decides
/// its policy; a path no route matches gets the default policy.
///
/// ```
/// use std::time::Duration;
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
/// assert!(matches!(routes.find("/webhooks/github").map(|r| &r.rule), Some(RouteRule::PassThrough)));
/// assert_eq!(routes.find("/payments/p_1/capture").unwrap().pattern.as_str(), "/payments/{id}/capture");
/// assert!(routes.find("/refunds").is_none());
/// // A route an earlier one hides is refused.
/// assert!(Routes::new().with("/*", RouteRule::PassThrough)?.with("/pay", RouteRule::PassThrough).is_err());
/// # Ok::<(), idem_core::RouteError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Routes {
    routes: Vec<Route>,
}

impl Routes {
    /// No routes: every request gets the default policy.
    pub fn new() -> Self {
        Self::default()
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
        self.routes.push(Route { pattern, rule });
        Ok(())
    }

    /// [`push`](Self::push), with the pattern parsed, for building routes in one expression.
    pub fn with(mut self, pattern: &str, rule: RouteRule) -> Result<Self, RouteError> {
        self.push(pattern.parse()?, rule)?;
        Ok(self)
    }

    /// The first route matching `path`, if any.
    pub fn find(&self, path: &str) -> Option<&Route> {
        self.position(path).map(|at| &self.routes[at])
    }

    /// The index of the first route matching `path`, if any.
    pub fn position(&self, path: &str) -> Option<usize> {
        if self.routes.is_empty() {
            return None;
        }
        let segments = normalized(path)?;
        self.routes
            .iter()
            .position(|route| route.pattern.matches_segments(&segments))
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
            "payments", "/a*", "/*/x", "/a/{}", "/a/{id", "/a/x{id}", "/a?b=1", "/a/../b", "/{a-b}",
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
            let refused = Routes::new()
                .with(first, RouteRule::PassThrough)
                .unwrap()
                .with(second, RouteRule::PassThrough);
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
        let routes = Routes::new()
            .with("/payments/refunds", RouteRule::PassThrough)
            .unwrap()
            .with("/payments/*", RouteRule::Protect(Policy::default()))
            .unwrap();
        assert_eq!(routes.position("/payments/refunds"), Some(0));
        assert_eq!(routes.position("/payments/p1"), Some(1));
        assert_eq!(routes.position("/other"), None);
        let bad = Policy {
            ttl: std::time::Duration::ZERO,
            ..Policy::default()
        };
        let refused = Routes::new().with("/x", RouteRule::Protect(bad)).unwrap_err();
        assert!(refused.to_string().contains("ttl"), "{refused}");
    }
}
