//! The test's reading of its own config file, written from the design (docs/design.md): which route a path falls
//! under as an upstream could read it, and what that route asks of a request. The gateway's
//! matching code is never consulted.

use std::time::Duration;

use crate::common::percent_decoded;

/// The config file every gateway of the rule test runs with.
pub(crate) const CONFIG: &str = r#"
ttl = "1h"
tombstone-ttl = "1d"
lease = "6s"
wait = "2s"
upstream-timeout = "400ms"
run-timeout = "2s"

# Payments must carry a key.
[[route]]
path = "/payments/{id}"
missing-key = "require"

# Orders are replayable for ten minutes, and PUT is protected there instead of PATCH.
[[route]]
path = "/orders/{id}"
methods = ["POST", "PUT"]
ttl = "10m"
tombstone-ttl = "1h"

# Webhooks pass through untouched.
[[route]]
path = "/hooks/*"
enabled = false

# Everything else: the gateway's defaults.
[[route]]
path = "/*"
"#;

const HOUR: u64 = 3600;
/// The gateway-wide ttl and tombstone-ttl of [`CONFIG`].
const TTL: Duration = Duration::from_secs(HOUR);
const TOMBSTONE_TTL: Duration = Duration::from_secs(24 * HOUR);
/// The methods the protocol applies to by default.
const DEFAULT_METHODS: &[&str] = &["POST", "PATCH"];

/// How a route's path matches.
#[derive(Debug, Clone, Copy)]
enum Pattern {
    /// `/FIRST/{param}`: exactly two segments, the first literal, the second not empty.
    Param(&'static str),
    /// `/FIRST/*`, or `/*` when empty: every path under it.
    Prefix(&'static str),
}

/// One `[[route]]` of [`CONFIG`], as the design says it acts.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) name: &'static str,
    pattern: Pattern,
    enabled: bool,
    require: bool,
    methods: &'static [&'static str],
    pub(crate) ttl: Duration,
    pub(crate) tombstone_ttl: Duration,
}

/// The routes of [`CONFIG`], in order (the first that matches wins).
pub(crate) static ROUTES: [Route; 4] = [
    Route {
        name: "payments",
        pattern: Pattern::Param("payments"),
        enabled: true,
        require: true,
        methods: DEFAULT_METHODS,
        ttl: TTL,
        tombstone_ttl: TOMBSTONE_TTL,
    },
    Route {
        name: "orders",
        pattern: Pattern::Param("orders"),
        enabled: true,
        require: false,
        methods: &["POST", "PUT"],
        ttl: Duration::from_secs(600),
        tombstone_ttl: Duration::from_secs(HOUR),
    },
    Route {
        name: "hooks",
        pattern: Pattern::Prefix("hooks"),
        enabled: false,
        require: false,
        methods: DEFAULT_METHODS,
        ttl: TTL,
        tombstone_ttl: TOMBSTONE_TTL,
    },
    Route {
        name: "catch-all",
        pattern: Pattern::Prefix(""),
        enabled: true,
        require: false,
        methods: DEFAULT_METHODS,
        ttl: TTL,
        tombstone_ttl: TOMBSTONE_TTL,
    },
];

impl Route {
    fn matches(&self, path: &str) -> bool {
        if path == "*" {
            // The asterisk form gets the catch-all's rules.
            return matches!(self.pattern, Pattern::Prefix(""));
        }
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        let segments: Vec<&str> = rest.split('/').collect();
        match self.pattern {
            Pattern::Param(first) => segments.len() == 2 && segments[0] == first && !segments[1].is_empty(),
            Pattern::Prefix("") => true,
            Pattern::Prefix(first) => segments.len() >= 2 && segments[0] == first,
        }
    }

    /// Whether the protocol applies to `method` (any case) here.
    fn protects(&self, method: &str) -> bool {
        self.enabled && self.methods.iter().any(|m| m.eq_ignore_ascii_case(method))
    }
}

fn route_of(path: &str) -> &'static Route {
    ROUTES
        .iter()
        .find(|route| route.matches(path))
        .expect("the catch-all matches every path")
}

/// The path as an upstream could read it: percent-decoded (`%2F` included), dot segments
/// removed, repeated slashes merged, a trailing slash dropped.
pub(crate) fn normalised(target: &str) -> String {
    if target == "*" {
        return "*".to_owned();
    }
    let path = target.split('?').next().unwrap_or("");
    let decoded = percent_decoded(path);
    let mut out: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    format!("/{}", out.join("/"))
}

/// What the design asks of one request, from its method and target read both ways.
#[derive(Debug, Clone)]
pub(crate) struct Protection {
    /// The routes of the readings under which the protocol applies (empty: it applies under none).
    pub(crate) protecting: Vec<&'static Route>,
    /// The routes of both readings (one if they agree): where they differ, which one's ttl the
    /// stricter reading takes is the gateway's choice.
    readings: Vec<&'static Route>,
    /// A keyless request must be refused (`require` under some protecting reading).
    pub(crate) require: bool,
    /// Refusing the request with a `400` problem is allowed: the raw and the normalised readings
    /// fall under different routes, or the method is not spelt in upper case (the issue lets a
    /// gateway refuse a non-canonical spelling of a method instead of matching it).
    pub(crate) may_refuse: bool,
    /// Both readings' route names, for the step log.
    pub(crate) routes: String,
}

impl Protection {
    /// The protection `method target` gets.
    pub(crate) fn of(method: &str, target: &str) -> Self {
        let raw = route_of(target.split('?').next().unwrap_or(""));
        let normal = route_of(&normalised(target));
        let mut protecting = Vec::new();
        for route in [raw, normal] {
            if route.protects(method) && !protecting.iter().any(|r: &&Route| r.name == route.name) {
                protecting.push(route);
            }
        }
        let readings = if raw.name == normal.name {
            vec![raw]
        } else {
            vec![raw, normal]
        };
        Self {
            require: protecting.iter().any(|route| route.require),
            protecting,
            readings,
            may_refuse: raw.name != normal.name || method != method.to_ascii_uppercase(),
            routes: if raw.name == normal.name {
                raw.name.to_owned()
            } else {
                format!("{} as sent, {} as read", raw.name, normal.name)
            },
        }
    }

    /// Whether the protocol applies.
    pub(crate) fn protected(&self) -> bool {
        !self.protecting.is_empty()
    }

    /// The ttls and tombstone-ttls the record may get (one per reading's route).
    pub(crate) fn retention(&self) -> (Vec<Duration>, Vec<Duration>) {
        (
            self.readings.iter().map(|r| r.ttl).collect(),
            self.readings.iter().map(|r| r.tombstone_ttl).collect(),
        )
    }
}

#[test]
fn the_readings_are_what_an_upstream_reads() {
    for spelling in [
        "/payments/1",
        "//payments/1",
        "/payments//1",
        "/payments/1/",
        "/payments%2F1",
        "/payments%2f1",
        "/payments/./1",
        "/payments/x/../1",
        "/hooks/../payments/1",
        "/%70ayments/1",
    ] {
        assert_eq!(normalised(spelling), "/payments/1", "{spelling}");
        let protection = Protection::of("post", spelling);
        assert!(protection.require, "{spelling}");
    }
    assert!(!Protection::of("POST", "/hooks/x").protected());
    assert!(!Protection::of("PATCH", "/orders/1").protected());
    assert!(Protection::of("put", "/orders/1").protected());
    assert!(Protection::of("POST", "*").protected());
    assert!(!Protection::of("POST", "/payments/1").may_refuse);
    assert!(Protection::of("post", "/payments/1").may_refuse);
    assert!(Protection::of("POST", "/payments%2F1").may_refuse);
}
