//! The monitoring shipped in `deploy/`: the Prometheus rules (`deploy/prometheus/idem.rules.yml`)
//! pass `promtool check rules` and their unit tests (`promtool test rules`: each alert fires when it
//! should and stays quiet when it should not), and no expression in the rules or in the Grafana
//! dashboard (`deploy/grafana/idem.json`) names a metric, a label or a label value that idem does
//! not export. What idem exports is read from the `/metrics` of gateways on a Redis of the test's
//! own, sent the traffic (and the faults) that make every family appear; on the way, the metrics
//! that exist for the alerts are seen to move when what they count happens.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use idem_core::protocol::Outcome;
use idem_core::store::StoreOperation;
use idem_test_support::private::PrivateRedis;
use promql_parser::label::{MatchOp, Matcher};
use promql_parser::parser::value::ValueType;
use promql_parser::parser::{Expr, LabelModifier, VectorMatchCardinality, VectorSelector};
use yaml_rust2::{Yaml, YamlLoader};

use crate::common::{Gateway, Upstream, config_file, describe, new_key, read_until, run_idem, send, wait_for_count};

/// Labels Prometheus gives every series of a target when it scrapes it.
const TARGET_LABELS: [&str; 2] = ["job", "instance"];

/// How long a command of the operator's may take.
const COMMAND_LIMIT: Duration = Duration::from_secs(30);

/// How long a gateway's state may take to show in its scrape (a channel to notice it is down).
const SEEN_WITHIN: Duration = Duration::from_secs(20);

fn deploy(dir: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy").join(dir)
}

// ---------------------------------------------------------------------------------------------
// promtool
// ---------------------------------------------------------------------------------------------

/// `promtool ARGS` in `deploy/prometheus`.
fn promtool(args: &[&str]) -> Output {
    match std::process::Command::new("promtool")
        .args(args)
        .current_dir(deploy("prometheus"))
        .output()
    {
        Ok(output) => output,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            panic!("promtool is not installed: bash .ci/services installs promtool (Debian's `prometheus` package)")
        }
        Err(err) => panic!("cannot run promtool: {err}"),
    }
}

#[test]
fn promtool_checks_the_rules_and_their_unit_tests_pass() {
    let checked = promtool(&["check", "rules", "idem.rules.yml"]);
    assert!(
        checked.status.success(),
        "promtool check rules:\n{}",
        describe(&checked)
    );
    let tested = promtool(&["test", "rules", "idem.rules.test.yml"]);
    assert!(tested.status.success(), "promtool test rules:\n{}", describe(&tested));
    // Every alert has unit tests: a rule nobody tested can be quiet forever.
    let (rules, tests) = (
        read_rules(),
        read_yaml(&deploy("prometheus").join("idem.rules.test.yml")),
    );
    let tested: BTreeSet<&str> = tests["tests"]
        .as_vec()
        .expect("tests")
        .iter()
        .flat_map(|test| test["alert_rule_test"].as_vec().into_iter().flatten())
        .filter_map(|case| case["alertname"].as_str())
        .collect();
    for rule in rules.iter().filter_map(|rule| rule.alert.as_deref()) {
        assert!(tested.contains(rule), "{rule} has no case in idem.rules.test.yml");
    }
}

// ---------------------------------------------------------------------------------------------
// What a gateway exports
// ---------------------------------------------------------------------------------------------

/// One sample line of a scrape.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The sample lines of a Prometheus text scrape.
fn samples(scrape: &str) -> Vec<Sample> {
    scrape
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| sample(line).unwrap_or_else(|| panic!("a sample line of /metrics that does not parse: {line}")))
        .collect()
}

/// `name{label="value",...} number`, label values escaped as the text format escapes them.
fn sample(line: &str) -> Option<Sample> {
    let end = line.find(['{', ' '])?;
    let (name, mut rest) = line.split_at(end);
    let mut labels = BTreeMap::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices();
        let mut closed = None;
        while let Some((at, c)) = chars.next() {
            match c {
                '}' => {
                    closed = Some(at);
                    break;
                }
                ',' | ' ' => continue,
                _ => {}
            }
            let eq = inner[at..].find('=')? + at;
            let label = inner[at..eq].to_owned();
            while chars.next()?.0 < eq + 1 {}
            let mut value = String::new();
            loop {
                match chars.next()?.1 {
                    '"' => break,
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    other => value.push(other),
                }
            }
            labels.insert(label, value);
        }
        rest = &inner[closed? + 1..];
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// The value of the one sample named `name` whose labels include `with`, if there is one.
fn value(scrape: &[Sample], name: &str, with: &[(&str, &str)]) -> Option<f64> {
    let found: Vec<f64> = scrape
        .iter()
        .filter(|s| {
            s.name == name
                && with
                    .iter()
                    .all(|(l, v)| s.labels.get(*l).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .collect();
    assert!(found.len() <= 1, "{name} {with:?} names {} samples", found.len());
    found.first().copied()
}

/// What gateways were seen exporting, across their scrapes.
#[derive(Debug, Default)]
struct Exported {
    /// Series name (a histogram's `_bucket`, `_sum` and `_count` each) → the labels it carries.
    series: BTreeMap<String, BTreeSet<String>>,
    /// Label → every value a sample carried.
    values: BTreeMap<String, BTreeSet<String>>,
}

impl Exported {
    fn add(&mut self, scrape: &[Sample]) {
        for sample in scrape {
            let labels = self.series.entry(sample.name.clone()).or_default();
            for (label, value) in &sample.labels {
                labels.insert(label.clone());
                self.values.entry(label.clone()).or_default().insert(value.clone());
            }
        }
    }
}

/// The values a label can take where idem's code has a closed list of them.
fn closed_values(label: &str) -> Option<BTreeSet<String>> {
    match label {
        "outcome" => Some(Outcome::ALL.iter().map(|o| o.as_str().to_owned()).collect()),
        "operation" => Some(StoreOperation::ALL.iter().map(|o| o.as_str().to_owned()).collect()),
        _ => None,
    }
}

async fn scrape(gateway: &Gateway) -> Vec<Sample> {
    let reply = send(gateway.client.get(format!("{}/metrics", gateway.admin))).await;
    assert_eq!(reply.status, 200, "/metrics: {reply}");
    samples(&reply.text())
}

/// Scrapes `gateway` until `done` holds for the scrape (at most [`SEEN_WITHIN`]).
async fn scrape_until(gateway: &Gateway, what: &str, done: impl Fn(&[Sample]) -> bool) -> Vec<Sample> {
    read_until(
        SEEN_WITHIN,
        Duration::from_millis(100),
        async || scrape(gateway).await,
        |scraped| done(scraped),
        |_| format!("/metrics did not show {what} within {SEEN_WITHIN:?}"),
    )
    .await
}

/// The run timeout of `/orders/{id}` in the gateway's config.
const ORDERS_RUN_TIMEOUT: f64 = 1.0;

/// Gateways on a Redis of the test's own, sent what makes every family appear: new keys, replays
/// (from the store and from the replay cache), a mismatch, a copy that waits for a run and is
/// answered `409`, a run given up at its route's run timeout, a run whose record an operator deletes while
/// it runs, the store killed and started again, and a gateway that waits for a Redis replica there
/// is none of. The metrics the alerts need are checked to move as each of these happens.
async fn exported_by_gateways() -> Exported {
    let upstream = Upstream::start().await;
    let mut redis = PrivateRedis::start();
    let store = format!("{}?prefix=monitoring", redis.url());
    let (_dir, config) = config_file(&format!(
        "[[route]]\npath = \"/orders/{{id}}\"\nrun-timeout = \"{ORDERS_RUN_TIMEOUT}s\"\n"
    ));
    let gateway = Gateway::start_on_store(
        &upstream.url(),
        &store,
        &["--wait", "1s", "--config", config.to_str().unwrap()],
    )
    .await;
    let mut exported = Exported::default();

    // From the start: the run timeout of each route, no answer refused, the channel up.
    let started = scrape_until(&gateway, "the replay cache's channel up", |s| {
        value(s, "idem_replay_cache_channel_up", &[]) == Some(1.0)
    })
    .await;
    let run_timeout = |route: &str| value(&started, "idem_run_timeout_seconds", &[("route", route)]);
    assert_eq!(run_timeout("default"), Some(300.0), "the default run timeout (5 min)");
    assert_eq!(run_timeout("/orders/{id}"), Some(ORDERS_RUN_TIMEOUT), "the route's own");
    assert_eq!(value(&started, "idem_fenced_completions_total", &[]), Some(0.0));
    exported.add(&started);

    // A new key, its replays (the second from the replay cache), and the key reused.
    let key = new_key();
    let first = gateway.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
    assert_eq!(first.status, 201, "{first}");
    for _ in 0..2 {
        let again = gateway.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
        assert!(again.replayed(), "{again}");
    }
    gateway
        .post_json("/pay", Some(&key), r#"{"amount":2}"#)
        .await
        .assert_problem(422, "key-mismatch");

    // A copy that waits its whole --wait (1 s) for a run of 2 s: 409 key-in-flight.
    let key = new_key();
    let slow = tokio::spawn(send(gateway.keyed("/pay?delay=2000", &key, r#"{"amount":3}"#)));
    wait_for_count(&upstream.state.pay, 2, Duration::from_secs(10)).await;
    let copy = gateway
        .post_json("/pay?delay=2000", Some(&key), r#"{"amount":3}"#)
        .await;
    copy.assert_problem(409, "key-in-flight");
    let slow = slow.await.unwrap();
    assert_eq!(slow.status, 201, "{slow}");

    // A run past its route's run timeout is given up, and its time counted by route.
    let given_up = gateway.post_json("/orders/1?then=hang", Some(&new_key()), "{}").await;
    assert_eq!(given_up.status, 504, "{given_up}");
    let scraped = scrape(&gateway).await;
    let orders = [("route", "/orders/{id}")];
    assert_eq!(
        value(&scraped, "idem_run_seconds_count", &orders),
        Some(1.0),
        "the run given up is counted in its route's run time"
    );
    assert_eq!(
        value(
            &scraped,
            "idem_requests_total",
            &[("route", "/orders/{id}"), ("outcome", "run-timeout")]
        ),
        Some(1.0)
    );

    // An operator deletes a key while its run is in flight: its answer is refused when it comes.
    let key = new_key();
    let running = tokio::spawn(send(gateway.keyed("/pay?delay=3000", &key, r#"{"amount":4}"#)));
    wait_for_count(&upstream.state.pay, 3, Duration::from_secs(10)).await;
    let deleted = run_idem(&["delete", "--store", &store, &key], COMMAND_LIMIT).await;
    assert!(deleted.status.success(), "idem delete: {}", describe(&deleted));
    let answered = running.await.unwrap();
    assert_eq!(answered.status, 201, "the client still gets its answer: {answered}");
    let fenced = scrape_until(&gateway, "the fenced completion", |s| {
        value(s, "idem_fenced_completions_total", &[]) == Some(1.0)
    })
    .await;
    exported.add(&fenced);

    // The store killed: the replay cache's channel goes down, keyed requests get 503.
    redis.kill();
    let down = scrape_until(&gateway, "the replay cache's channel down", |s| {
        value(s, "idem_replay_cache_channel_up", &[]) == Some(0.0)
    })
    .await;
    exported.add(&down);
    gateway
        .post_json("/pay", Some(&new_key()), r#"{"amount":5}"#)
        .await
        .assert_problem(503, "store-unavailable");
    redis.restart();
    let back = scrape_until(&gateway, "the replay cache's channel up again", |s| {
        value(s, "idem_replay_cache_channel_up", &[]) == Some(1.0)
    })
    .await;
    assert!(
        value(&back, "idem_store_errors_total", &[("operation", "begin")]).is_some_and(|n| n >= 1.0),
        "the failed begin is counted"
    );
    exported.add(&back);

    // A gateway that waits for a Redis replica there is none of: its writes are refused, the
    // first of them the store's salt, which a request's claim needs first.
    let unreplicated = format!(
        "{}?prefix=monitoring-replicas&replicas=1&replica_timeout=100ms",
        redis.url()
    );
    let waiting = Gateway::start_on_store(&upstream.url(), &unreplicated, &[]).await;
    let before = scrape(&waiting).await;
    let timeouts = |s: &[Sample]| -> f64 {
        s.iter()
            .filter(|sample| sample.name == "idem_replica_ack_timeouts_total")
            .map(|sample| sample.value)
            .sum()
    };
    waiting
        .post_json("/pay", Some(&new_key()), r#"{"amount":6}"#)
        .await
        .assert_problem(503, "store-unavailable");
    let after = scrape(&waiting).await;
    assert!(
        timeouts(&after) > timeouts(&before),
        "the write no replica acknowledged is counted: {} before the request, {} after",
        timeouts(&before),
        timeouts(&after)
    );
    exported.add(&after);
    exported
}

// ---------------------------------------------------------------------------------------------
// What the rules and the dashboard name
// ---------------------------------------------------------------------------------------------

type Labels = BTreeSet<String>;

/// Checks expressions against what gateways export, collecting every problem.
struct Check<'a> {
    exported: &'a Exported,
    /// Series recorded by the rules read so far → the labels each carries.
    recorded: BTreeMap<String, Labels>,
    problems: Vec<String>,
}

impl<'a> Check<'a> {
    fn new(exported: &'a Exported) -> Self {
        Self {
            exported,
            recorded: BTreeMap::new(),
            problems: Vec::new(),
        }
    }

    fn problem(&mut self, place: &str, what: String) {
        self.problems.push(format!("{place}: {what}"));
    }

    /// Parses `text` and checks it; the labels of its result (`None`: a scalar, or it did not parse).
    fn expression(&mut self, place: &str, text: &str) -> Option<Labels> {
        match promql_parser::parser::parse(text) {
            Ok(expr) => self.walk(place, &expr),
            Err(err) => {
                self.problem(place, format!("does not parse ({err}): {text}"));
                None
            }
        }
    }

    /// The labels of `expr`'s result, `None` for a scalar or a string.
    fn walk(&mut self, place: &str, expr: &Expr) -> Option<Labels> {
        match expr {
            Expr::Aggregate(aggregate) => {
                if let Some(param) = &aggregate.param {
                    self.walk(place, param);
                }
                let inner = self.walk(place, &aggregate.expr).unwrap_or_default();
                if let Some(modifier) = &aggregate.modifier {
                    for label in &modifier.labels().labels {
                        self.carried(place, label, &inner, &format!("{} by/without", aggregate.op));
                    }
                }
                let op = aggregate.op.to_string();
                Some(match (&aggregate.modifier, op.as_str()) {
                    // These select series rather than aggregate them.
                    (_, "topk" | "bottomk" | "limitk" | "limit_ratio") => inner,
                    (Some(LabelModifier::Include(by)), _) => by.labels.iter().cloned().collect(),
                    (Some(LabelModifier::Exclude(without)), _) => inner
                        .difference(&without.labels.iter().cloned().collect())
                        .cloned()
                        .collect(),
                    (None, _) => Labels::new(),
                })
            }
            Expr::Unary(unary) => self.walk(place, &unary.expr),
            Expr::Paren(paren) => self.walk(place, &paren.expr),
            Expr::Subquery(subquery) => self.walk(place, &subquery.expr),
            Expr::NumberLiteral(_) | Expr::StringLiteral(_) => None,
            Expr::VectorSelector(selector) => Some(self.selector(place, selector)),
            Expr::MatrixSelector(matrix) => Some(self.selector(place, &matrix.vs)),
            Expr::Call(call) => {
                let args: Vec<Option<Labels>> = call.args.args.iter().map(|arg| self.walk(place, arg)).collect();
                let text = |i: usize| match call.args.args.get(i).map(|arg| &**arg) {
                    Some(Expr::StringLiteral(s)) => s.val.clone(),
                    _ => String::new(),
                };
                match call.func.name {
                    "histogram_quantile" => {
                        let mut labels = args.get(1).cloned().flatten().unwrap_or_default();
                        if !labels.remove("le") {
                            self.problem(place, "histogram_quantile over series without `le`".to_owned());
                        }
                        Some(labels)
                    }
                    "label_replace" | "label_join" => {
                        let mut labels = args.first().cloned().flatten().unwrap_or_default();
                        let sources: Vec<String> = if call.func.name == "label_replace" {
                            vec![text(3)]
                        } else {
                            (3..call.args.args.len()).map(text).collect()
                        };
                        for source in sources.iter().filter(|s| !s.is_empty()) {
                            self.carried(place, source, &labels, call.func.name);
                        }
                        labels.insert(text(1));
                        Some(labels)
                    }
                    "vector" | "absent" | "absent_over_time" => Some(Labels::new()),
                    _ if call.func.return_type == ValueType::Scalar => None,
                    _ => args.into_iter().flatten().next(),
                }
            }
            Expr::Binary(binary) => {
                let (lhs, rhs) = (self.walk(place, &binary.lhs), self.walk(place, &binary.rhs));
                let (lhs, rhs) = match (lhs, rhs) {
                    (Some(lhs), Some(rhs)) => (lhs, rhs),
                    (one, other) => return one.or(other),
                };
                let matching = binary.modifier.as_ref().and_then(|m| m.matching.as_ref());
                let card = binary
                    .modifier
                    .as_ref()
                    .map_or(&VectorMatchCardinality::OneToOne, |m| &m.card);
                let both: Labels = lhs.union(&rhs).cloned().collect();
                match matching {
                    Some(LabelModifier::Include(on)) => {
                        for label in &on.labels {
                            self.carried(place, label, &lhs, "on (left side)");
                            self.carried(place, label, &rhs, "on (right side)");
                        }
                    }
                    Some(LabelModifier::Exclude(ignoring)) => {
                        for label in &ignoring.labels {
                            self.carried(place, label, &both, "ignoring");
                        }
                    }
                    None => {}
                }
                match card {
                    VectorMatchCardinality::ManyToOne(copied) => {
                        for label in &copied.labels {
                            self.carried(place, label, &rhs, "group_left");
                        }
                    }
                    VectorMatchCardinality::OneToMany(copied) => {
                        for label in &copied.labels {
                            self.carried(place, label, &lhs, "group_right");
                        }
                    }
                    _ => {}
                }
                if binary.op.is_set_operator() {
                    return Some(if binary.op.to_string() == "or" { both } else { lhs });
                }
                Some(match (card, matching) {
                    (VectorMatchCardinality::ManyToOne(copied), _) => {
                        lhs.into_iter().chain(copied.labels.iter().cloned()).collect()
                    }
                    (VectorMatchCardinality::OneToMany(copied), _) => {
                        rhs.into_iter().chain(copied.labels.iter().cloned()).collect()
                    }
                    (_, Some(LabelModifier::Include(on))) => on.labels.iter().cloned().collect(),
                    (_, Some(LabelModifier::Exclude(ignoring))) => {
                        let ignoring: Labels = ignoring.labels.iter().cloned().collect();
                        let (l, r): (Labels, Labels) = (&lhs - &ignoring, &rhs - &ignoring);
                        if l != r {
                            self.problem(place, format!("{} matches nothing: {l:?} against {r:?}", binary.op));
                        }
                        l
                    }
                    (_, None) => {
                        if lhs != rhs {
                            let what = format!("{} matches nothing: {lhs:?} against {rhs:?}", binary.op);
                            self.problem(place, what);
                        }
                        lhs
                    }
                })
            }
            Expr::Extension(_) => {
                self.problem(place, "an extension expression".to_owned());
                None
            }
        }
    }

    fn carried(&mut self, place: &str, label: &str, labels: &Labels, context: &str) {
        if !labels.contains(label) {
            self.problem(
                place,
                format!("{context} names the label `{label}`, which is not among {labels:?}"),
            );
        }
    }

    /// The labels a selector's series carry; each of its matchers checked.
    fn selector(&mut self, place: &str, selector: &VectorSelector) -> Labels {
        let matchers: Vec<&Matcher> = selector
            .matchers
            .matchers
            .iter()
            .chain(selector.matchers.or_matchers.iter().flatten())
            .collect();
        let named = matchers
            .iter()
            .find(|m| m.name == "__name__" && matches!(m.op, MatchOp::Equal))
            .map(|m| m.value.clone());
        let Some(name) = selector.name.clone().or(named) else {
            self.problem(place, "a selector without a metric name".to_owned());
            return Labels::new();
        };
        let labels = if let Some(labels) = self.exported.series.get(&name) {
            labels.iter().cloned().chain(TARGET_LABELS.map(str::to_owned)).collect()
        } else if let Some(labels) = self.recorded.get(&name) {
            labels.clone()
        } else {
            self.problem(
                place,
                format!("`{name}` is not a series idem exports, nor one a rule records"),
            );
            return Labels::new();
        };
        for matcher in matchers.into_iter().filter(|m| m.name != "__name__") {
            if labels.contains(&matcher.name) {
                self.matched_value(place, &name, matcher);
            } else {
                let what = format!("`{name}` has no label `{}` (it has {labels:?})", matcher.name);
                self.problem(place, what);
            }
        }
        labels
    }

    /// A matcher's value must be one idem can emit: from the code's closed list where it has one
    /// (`outcome`, `operation`), otherwise one a gateway was seen exporting. Target labels are the
    /// deployment's.
    fn matched_value(&mut self, place: &str, name: &str, matcher: &Matcher) {
        let label = matcher.name.as_str();
        if TARGET_LABELS.contains(&label) || matcher.value.is_empty() {
            return;
        }
        let known = closed_values(label)
            .or_else(|| self.exported.values.get(label).cloned())
            .unwrap_or_default();
        let literal = |v: &str| !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric() || "-_".contains(c));
        let unknown: Vec<String> = match &matcher.op {
            MatchOp::Equal | MatchOp::NotEqual => Some(matcher.value.clone())
                .filter(|v| !known.contains(v))
                .into_iter()
                .collect(),
            MatchOp::Re(_) | MatchOp::NotRe(_) if matcher.value.split('|').all(literal) => matcher
                .value
                .split('|')
                .filter(|v| !known.contains(*v))
                .map(str::to_owned)
                .collect(),
            MatchOp::Re(regex) | MatchOp::NotRe(regex) => {
                if known.iter().any(|v| regex.is_match(v)) {
                    Vec::new()
                } else {
                    vec![matcher.value.clone()]
                }
            }
        };
        if !unknown.is_empty() {
            let what = format!("`{name}{{{label}}}` is never {unknown:?} (idem emits {known:?})");
            self.problem(place, what);
        }
    }

    /// `{{ $labels.NAME }}` (alerts) or `{{NAME}}` (legends) in `text` must be among `labels`.
    fn templated(&mut self, place: &str, text: &str, labels: &Labels, prefix: &str) {
        let mut rest = text;
        while let Some(open) = rest.find("{{") {
            let Some(close) = rest[open..].find("}}") else { break };
            let inside = rest[open + 2..open + close].trim();
            if let Some(label) = inside.strip_prefix(prefix)
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                let label = label.to_owned();
                self.carried(place, &label, labels, "the template");
            }
            rest = &rest[open + close + 2..];
        }
    }
}

/// One rule of `idem.rules.yml`.
#[derive(Debug)]
struct Rule {
    record: Option<String>,
    alert: Option<String>,
    expr: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

fn read_yaml(path: &Path) -> Yaml {
    let text = std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    let mut docs = YamlLoader::load_from_str(&text).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    assert_eq!(docs.len(), 1, "{}: one YAML document", path.display());
    docs.remove(0)
}

fn strings(yaml: &Yaml) -> BTreeMap<String, String> {
    yaml.as_hash()
        .into_iter()
        .flatten()
        .map(|(k, v)| {
            let value = v.as_str().map(str::to_owned).unwrap_or_else(|| format!("{v:?}"));
            (k.as_str().expect("a string key").to_owned(), value)
        })
        .collect()
}

/// Every rule of `deploy/prometheus/idem.rules.yml`, in order.
fn read_rules() -> Vec<Rule> {
    let doc = read_yaml(&deploy("prometheus").join("idem.rules.yml"));
    let groups = doc["groups"].as_vec().expect("groups");
    groups
        .iter()
        .flat_map(|group| group["rules"].as_vec().expect("a group's rules"))
        .map(|rule| Rule {
            record: rule["record"].as_str().map(str::to_owned),
            alert: rule["alert"].as_str().map(str::to_owned),
            expr: rule["expr"].as_str().expect("a rule's expr").to_owned(),
            labels: strings(&rule["labels"]),
            annotations: strings(&rule["annotations"]),
        })
        .collect()
}

fn check_rules(check: &mut Check<'_>, rules: &[Rule]) {
    for rule in rules {
        let name = rule
            .record
            .as_deref()
            .or(rule.alert.as_deref())
            .expect("a rule records or alerts");
        let place = format!("idem.rules.yml {name}");
        let mut labels = check.expression(&place, &rule.expr).unwrap_or_default();
        labels.extend(rule.labels.keys().cloned());
        if let Some(record) = &rule.record {
            check.recorded.insert(record.clone(), labels);
        } else {
            for (key, text) in &rule.annotations {
                check.templated(&format!("{place} annotation {key}"), text, &labels, "$labels.");
            }
        }
    }
}

/// The value a dashboard variable stands for in a query: any job or instance, Grafana's own
/// intervals as a 5-minute window would have them.
fn substitute(check: &mut Check<'_>, place: &str, query: &str, variables: &BTreeSet<String>) -> String {
    let mut out = String::new();
    let mut rest = query;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (name, len) = match after.strip_prefix('{') {
            Some(braced) => {
                let end = braced.find('}').unwrap_or(braced.len());
                (&braced[..end], end + 2)
            }
            None => {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                (&after[..end], end)
            }
        };
        let value = match name {
            "__rate_interval" | "__range" => "5m",
            "__interval" => "1m",
            name if variables.contains(name) => ".*",
            name => {
                check.problem(place, format!("uses `${name}`, which the dashboard does not define"));
                ".*"
            }
        };
        out.push_str(value);
        rest = &after[len..];
    }
    out.push_str(rest);
    out
}

fn check_dashboard(check: &mut Check<'_>, dashboard: &serde_json::Value) {
    let templating = dashboard["templating"]["list"].as_array().expect("templating.list");
    let datasource_variables: Vec<&serde_json::Value> =
        templating.iter().filter(|v| v["type"] == "datasource").collect();
    assert!(
        datasource_variables.len() == 1 && datasource_variables[0]["query"] == "prometheus",
        "the dashboard has one Prometheus datasource variable: {datasource_variables:?}"
    );
    let datasource = format!("${{{}}}", datasource_variables[0]["name"].as_str().expect("its name"));
    let variables: BTreeSet<String> = templating
        .iter()
        .filter_map(|v| v["name"].as_str().map(str::to_owned))
        .collect();
    for variable in templating.iter().filter(|v| v["type"] == "query") {
        let place = format!("idem.json variable {}", variable["name"]);
        assert_eq!(variable["datasource"]["uid"], datasource.as_str(), "{place}");
        let definition = variable["definition"].as_str().expect("a query variable's definition");
        let query = substitute(check, &place, definition, &variables);
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("{place}: label_values(SELECTOR, LABEL) expected: {definition}"));
        let (selector, label) = inner.rsplit_once(',').expect("label_values(SELECTOR, LABEL)");
        let labels = check.expression(&place, selector.trim()).unwrap_or_default();
        check.carried(&place, label.trim(), &labels, "label_values");
    }
    let mut panels: Vec<&serde_json::Value> = dashboard["panels"].as_array().expect("panels").iter().collect();
    let mut queries = 0;
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        let place = format!("idem.json panel {}", panel["title"]);
        if panel["type"] != "row" {
            assert_eq!(
                panel["datasource"]["uid"],
                datasource.as_str(),
                "{place}: the datasource variable"
            );
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            assert_eq!(
                target["datasource"]["uid"],
                datasource.as_str(),
                "{place}: the datasource variable"
            );
            let expr = target["expr"].as_str().expect("a target's expr");
            let query = substitute(check, &place, expr, &variables);
            let labels = check.expression(&place, &query).unwrap_or_default();
            if let Some(legend) = target["legendFormat"].as_str() {
                check.templated(&format!("{place} legend"), legend, &labels, "");
            }
            queries += 1;
        }
    }
    assert!(queries > 10, "the dashboard's panels hold {queries} queries");
}

/// Every problem with the rules and the dashboard, against what was exported.
fn problems(exported: &Exported) -> Vec<String> {
    let mut check = Check::new(exported);
    check_rules(&mut check, &read_rules());
    let path = deploy("grafana").join("idem.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    check_dashboard(&mut check, &dashboard);
    check.problems
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rules_and_the_dashboard_name_only_what_a_gateway_exports() {
    let exported = exported_by_gateways().await;
    for family in idem_core::metric_names::ALL {
        assert!(
            exported.series.keys().any(|series| series == family
                || series
                    .strip_prefix(family)
                    .is_some_and(|s| ["_bucket", "_sum", "_count"].contains(&s))),
            "the gateways' traffic did not make {family} appear: {:?}",
            exported.series.keys()
        );
    }
    let problems = problems(&exported);
    assert!(
        problems.is_empty(),
        "the rules and the dashboard name what idem does not export:\n{}",
        problems.join("\n")
    );
}

/// The check itself: an export that lacks what the rules name is caught, name, label and value.
#[test]
fn the_check_names_what_idem_does_not_export() {
    let mut exported = Exported::default();
    exported.add(&samples(
        "idem_requests_total{outcome=\"new\",route=\"default\"} 1\n\
         idem_store_operation_seconds_bucket{operation=\"begin\",le=\"0.1\"} 1\n\
         idem_store_operation_seconds_bucket{operation=\"begin\",le=\"+Inf\"} 1\n",
    ));
    let mut check = Check::new(&exported);
    let cases = [
        (
            "sum(rate(idem_request_total[5m]))",
            "`idem_request_total` is not a series",
        ),
        (
            "sum by (operation) (rate(idem_requests_total[5m]))",
            "names the label `operation`",
        ),
        ("idem_requests_total{outcome=\"recoverd\"}", "is never [\"recoverd\"]"),
        (
            "idem_requests_total{outcome=~\"new|taken-over\"}",
            "is never [\"taken-over\"]",
        ),
        ("idem_requests_total{result=\"answered\"}", "has no label `result`"),
        (
            "histogram_quantile(0.99, sum by (operation) (rate(idem_store_operation_seconds_bucket[5m])))",
            "without `le`",
        ),
        (
            "sum by (job) (rate(idem_requests_total[5m])) / sum by (route) (rate(idem_requests_total[5m]))",
            "matches nothing",
        ),
        (
            "idem_store_operation_seconds{operation=\"begin\"}",
            "`idem_store_operation_seconds` is not a series",
        ),
    ];
    for (expr, says) in cases {
        check.problems.clear();
        check.expression("case", expr);
        assert!(
            check.problems.iter().any(|p| p.contains(says)),
            "{expr}: expected a problem saying {says:?}, got {:?}",
            check.problems
        );
    }
    // What is exported passes, target labels included.
    check.problems.clear();
    let labels = check.expression(
        "case",
        "histogram_quantile(0.99, sum by (job, operation, le) (rate(idem_store_operation_seconds_bucket{operation=~\"begin|complete\"}[5m])))",
    );
    assert_eq!(check.problems, Vec::<String>::new());
    assert_eq!(labels, Some(["job", "operation"].map(str::to_owned).into()));
    check.templated(
        "case",
        "{{ $labels.instance }} {{ $value }}",
        &labels.unwrap(),
        "$labels.",
    );
    assert!(
        check.problems.iter().any(|p| p.contains("`instance`")),
        "{:?}",
        check.problems
    );
}
