//! Which protocol a request runs under, picked by its path from the layer's [`Routes`] once the
//! path is admitted.

use idem_core::{Problem, RouteRule, Routes, protocol::Protocol};
use metrics::SharedString;

/// The metrics label of requests no route matches.
pub(crate) const DEFAULT_ROUTE: &str = "default";

/// The layer's default protocol and one per route, each with its metrics label.
#[derive(Debug)]
pub(crate) struct Routing {
    routes: Routes,
    /// Per route, in the routes' order.
    picks: Vec<Pick>,
    default: Pick,
    /// The protocol of paths no route names (also `default.protocol`).
    default_protocol: Protocol,
}

/// What a request's path picked.
#[derive(Debug, Clone)]
pub(crate) struct Pick {
    /// The protocol to apply (`None`: pass the request through untouched).
    pub(crate) protocol: Option<Protocol>,
    /// The route's pattern, or [`DEFAULT_ROUTE`]: a label of bounded values, never the raw path.
    pub(crate) route: SharedString,
}

impl Routing {
    /// `default` for paths no route matches; each protecting route shares its store, clock and
    /// held answers under its own policy.
    pub(crate) fn new(default: Protocol, routes: Routes) -> Self {
        let picks = routes
            .iter()
            .map(|route| Pick {
                protocol: match &route.rule {
                    RouteRule::Protect(policy) => Some(default.with_policy(policy.clone())),
                    RouteRule::PassThrough => None,
                },
                route: SharedString::from(route.pattern.label()),
            })
            .collect();
        Self {
            routes,
            picks,
            default: Pick {
                protocol: Some(default.clone()),
                route: SharedString::const_str(DEFAULT_ROUTE),
            },
            default_protocol: default,
        }
    }

    /// The `Retry-After` of answers made outside any route's protocol (the default policy's).
    pub(crate) fn retry_after(&self) -> std::time::Duration {
        self.default_protocol.policy().retry_after
    }

    /// The pick for a `method` request's path, matched in every reading an upstream could give it;
    /// a path admission refuses (one that climbs out of the layer's path prefix), or whose
    /// readings fall under two different protecting rules, gets none but the problem that says
    /// so (`400 path-ambiguous`, both of them).
    pub(crate) fn pick(&self, method: &http::Method, path: &str) -> Result<&Pick, Problem> {
        self.default_protocol.admit_path(path)?;
        let chosen = self
            .routes
            .choose(method, path, self.default_protocol.policy())
            .map_err(|ambiguous| ambiguous.to_problem())?;
        Ok(match chosen {
            Some(at) => &self.picks[at],
            None => &self.default,
        })
    }
}
