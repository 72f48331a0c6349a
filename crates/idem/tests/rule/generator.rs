//! The generator: one seeded stream of steps — requests (keyed or not, in 3 scopes, with keys
//! reused across scopes, method and path spelt many ways, bodies that change now and then),
//! upstream behaviours, operator commands, the clock moved, gateways killed — drawn so that the
//! same keys come back often enough to be replayed, expired, deleted and re-run.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use idem_test_support::seed::Rng;

use super::oracle::{RecordId, Shape};
use super::upstream::Behaviour;

/// The callers: anonymous, and two credentials.
pub(crate) const SCOPES: [Option<&str>; 3] = [None, Some("Bearer alice"), Some("Bearer bob")];
/// How many keys each run draws from (the same keys in every scope).
const KEYS: usize = 4;

/// One request to send.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) scope: usize,
    pub(crate) key: Option<String>,
    pub(crate) shape: Shape,
    pub(crate) behaviour: Behaviour,
    pub(crate) instance: usize,
}

impl Plan {
    /// The record it addresses, if keyed.
    pub(crate) fn id(&self) -> Option<RecordId> {
        self.key.clone().map(|key| (self.scope, key))
    }

    /// The same request (another copy), to `instance`, with `behaviour`.
    pub(crate) fn copy(&self, instance: usize, behaviour: Behaviour) -> Self {
        Self {
            instance,
            behaviour,
            ..self.clone()
        }
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} key={} scope={} body={} do={} @gw{}",
            self.shape.method,
            self.shape.target,
            self.key.as_deref().unwrap_or("-"),
            SCOPES[self.scope].unwrap_or("anonymous"),
            self.shape.body,
            self.behaviour.header(),
            self.instance
        )
    }
}

/// One step of a sequence.
#[derive(Debug, Clone)]
pub(crate) enum Step {
    /// One request.
    Send(Plan),
    /// Copies of one request sent at once, spread over the instances.
    Copies(Vec<Plan>),
    /// A request the upstream holds past `--upstream-timeout` (504, the run goes on), then a
    /// retry of it if `retry`.
    Hang { plan: Plan, retry: Option<Plan> },
    /// `idem delete` of a key while a run of it hangs at the upstream and a copy waits.
    DeleteInFlight { plan: Plan, waiter: Plan },
    /// `idem delete` of a key.
    Delete(RecordId),
    /// `idem purge`.
    Purge,
    /// Every idem process's clock moved ahead.
    Jump(Duration),
    /// A gateway killed (kill -9) and started again; with a run of `Some` hanging at the upstream.
    Kill { instance: usize, during: Option<Plan> },
    /// A request sent while the upstream refuses connections.
    Refused(Plan),
    /// The store loses every record and its salt under the running gateways; then one of them is
    /// started again (an instance of after the loss beside the others), or none.
    LoseData { restart: Option<usize> },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Send(plan) => write!(f, "send {plan}"),
            Self::Copies(plans) => write!(f, "{} copies of {}", plans.len(), plans[0]),
            Self::Hang { plan, retry } => write!(f, "hang {plan}{}", if retry.is_some() { " + a retry" } else { "" }),
            Self::DeleteInFlight { plan, waiter } => {
                write!(f, "delete in flight: {plan}, waiter @gw{}", waiter.instance)
            }
            Self::Delete((scope, key)) => write!(f, "idem delete {key} in {}", SCOPES[*scope].unwrap_or("anonymous")),
            Self::Purge => write!(f, "idem purge"),
            Self::Jump(by) => write!(f, "clock +{}", humantime::format_duration(*by)),
            Self::Kill { instance, during } => match during {
                Some(plan) => write!(f, "kill -9 gw{instance} during {plan}"),
                None => write!(f, "kill -9 gw{instance} (idle)"),
            },
            Self::Refused(plan) => write!(f, "upstream down: {plan}"),
            Self::LoseData { restart } => match restart {
                Some(instance) => write!(f, "the store loses its data, gw{instance} restarted"),
                None => write!(f, "the store loses its data"),
            },
        }
    }
}

/// Draws steps.
#[derive(Debug)]
pub(crate) struct Generator {
    rng: Rng,
    instances: usize,
    can_jump: bool,
    /// Only canonical spellings (upper-case methods, paths as routed): narrows a failure down.
    plain: bool,
    keys: Vec<String>,
    /// The last request sent with each key: most requests repeat it.
    last: HashMap<RecordId, Shape>,
}

/// The paths requests are aimed at, as an upstream reads them.
const PATHS: &[(&str, u32)] = &[
    ("/payments/1", 6),
    ("/payments/2", 3),
    ("/orders/7", 3),
    ("/misc/a", 2),
    ("/hooks/x", 1),
    ("*", 1),
];

const METHODS: &[(&str, u32)] = &[
    ("POST", 8),
    ("post", 2),
    ("Post", 2),
    ("PATCH", 2),
    ("patch", 2),
    ("PUT", 1),
];

impl Generator {
    /// A generator over `instances` gateways; `can_jump`: the clock can be moved.
    pub(crate) fn new(rng: Rng, instances: usize, can_jump: bool, plain: bool, nonce: &str) -> Self {
        let keys = (0..KEYS).map(|i| format!("rule-{nonce}-{i}")).collect();
        Self {
            rng,
            instances,
            can_jump,
            plain,
            keys,
            last: HashMap::new(),
        }
    }

    fn pick<'a>(&mut self, choices: &[(&'a str, u32)]) -> &'a str {
        let weights: Vec<u32> = choices.iter().map(|(_, w)| *w).collect();
        let choice = choices[self.rng.weighted(&weights)].0;
        if self.plain && choice.chars().any(|c| c.is_ascii_lowercase()) && !choice.starts_with('/') {
            // A method spelt in lower or mixed case: its canonical spelling.
            return choices
                .iter()
                .find(|(c, _)| c.eq_ignore_ascii_case(choice) && !c.chars().any(|c| c.is_ascii_lowercase()))
                .map_or(choice, |(c, _)| c);
        }
        choice
    }

    fn key(&mut self) -> String {
        let i = self.below(self.keys.len());
        self.keys[i].clone()
    }

    fn below(&mut self, n: usize) -> usize {
        self.rng.below(n as u64) as usize
    }

    /// One spelling of `path` that an upstream reads as `path`.
    fn spell(&mut self, path: &str) -> String {
        if path == "*" || self.rng.chance(0.55) {
            return path.to_owned();
        }
        if self.plain {
            return path.to_owned();
        }
        let (first, rest) = path[1..].split_once('/').expect("two segments");
        match self.below(10) {
            0 => format!("//{first}/{rest}"),
            1 => format!("/{first}//{rest}"),
            2 => format!("/{first}/{rest}/"),
            3 => format!("/{first}%2F{rest}"),
            4 => format!("/{first}%2f{rest}"),
            5 => format!("/{first}/./{rest}"),
            6 => format!("/{first}/x/../{rest}"),
            7 => format!("/hooks/../{first}/{rest}"),
            8 => format!("/%{:02X}{}/{rest}", first.as_bytes()[0], &first[1..]),
            _ => format!("/{first}/{rest}//"),
        }
    }

    fn body(&mut self) -> String {
        format!(r#"{{"amount":{},"note":"n{}"}}"#, 1 + self.below(999), self.below(5))
    }

    fn fresh_shape(&mut self) -> Shape {
        let path = self.pick(PATHS);
        Shape {
            method: self.pick(METHODS).to_owned(),
            target: self.spell(path),
            body: self.body(),
        }
    }

    /// A keyed request: most often the key's last request again (sometimes spelt another way, or
    /// with another body), else a new one.
    fn keyed(&mut self, behaviour: Behaviour) -> Plan {
        let scope = self.below(SCOPES.len());
        let key = self.key();
        let id = (scope, key.clone());
        let shape = match self.last.get(&id).cloned() {
            Some(last) if self.rng.chance(0.7) => last,
            Some(last) if self.rng.chance(0.5) => {
                let path = super::routes::normalised(&last.target);
                let methods: Vec<(&str, u32)> = METHODS
                    .iter()
                    .copied()
                    .filter(|(m, _)| m.eq_ignore_ascii_case(&last.method))
                    .collect();
                Shape {
                    method: self.pick(&methods).to_owned(),
                    target: self.spell(&path),
                    body: last.body,
                }
            }
            _ => self.fresh_shape(),
        };
        self.last.insert(id, shape.clone());
        Plan {
            scope,
            key: Some(key),
            shape,
            behaviour,
            instance: self.below(self.instances),
        }
    }

    fn keyless(&mut self) -> Plan {
        let mut shape = self.fresh_shape();
        if self.rng.chance(0.6) {
            // Most keyless requests aim at the route that requires a key.
            shape.target = self.spell("/payments/1");
            shape.method = self.pick(&METHODS[..5]).to_owned();
        }
        Plan {
            scope: self.below(SCOPES.len()),
            key: None,
            shape,
            behaviour: Behaviour::Status(201),
            instance: self.below(self.instances),
        }
    }

    fn behaviour(&mut self) -> Behaviour {
        const CODES: &[(u16, u32)] = &[
            (201, 30),
            (200, 4),
            (404, 3),
            (422, 2),
            (500, 5),
            (503, 3),
            (429, 2),
            (409, 2),
            (408, 1),
            (425, 1),
            (0, 6),
        ];
        let weights: Vec<u32> = CODES.iter().map(|(_, w)| *w).collect();
        match CODES[self.rng.weighted(&weights)].0 {
            0 => Behaviour::Drop,
            code => Behaviour::Status(code),
        }
    }

    fn other_instance(&mut self, instance: usize) -> usize {
        if self.instances > 1 {
            (instance + 1) % self.instances
        } else {
            instance
        }
    }

    /// The next step.
    pub(crate) fn next(&mut self) -> Step {
        let weights = [30, 7, 12, 5, 3, 5, 3, 4, if self.can_jump { 9 } else { 0 }, 2, 2, 3, 2];
        match self.rng.weighted(&weights) {
            0 => {
                let behaviour = self.behaviour();
                Step::Send(self.keyed(behaviour))
            }
            1 => {
                let behaviour = if self.rng.chance(0.7) {
                    Behaviour::Status(201)
                } else {
                    Behaviour::Status(500)
                };
                let plan = self.keyed(behaviour);
                let n = 2 + self.below(2);
                let copies = (0..n)
                    .map(|i| plan.copy((plan.instance + i) % self.instances, behaviour))
                    .collect();
                Step::Copies(copies)
            }
            2 => Step::Send(self.keyless()),
            3 => {
                let plan = self.keyed(Behaviour::HangThenCreated(1500));
                let retry = self
                    .rng
                    .chance(0.6)
                    .then(|| plan.copy(self.other_instance(plan.instance), Behaviour::Status(201)));
                Step::Hang { plan, retry }
            }
            4 => Step::Hang {
                plan: self.keyed(Behaviour::HangUntilDropped),
                retry: None,
            },
            5 => {
                let scope = self.below(SCOPES.len());
                let key = self.key();
                Step::Delete((scope, key))
            }
            6 => {
                let plan = self.keyed(Behaviour::HangThenCreated(1500));
                let waiter = plan.copy(self.other_instance(plan.instance), Behaviour::Status(201));
                Step::DeleteInFlight { plan, waiter }
            }
            7 => Step::Purge,
            8 => {
                const JUMPS: &[(u64, u32)] = &[
                    (20, 3),
                    (8 * 60, 2),
                    (30 * 60, 2),
                    (2 * 3600, 2),
                    (12 * 3600, 1),
                    (2 * 86400, 1),
                ];
                let weights: Vec<u32> = JUMPS.iter().map(|(_, w)| *w).collect();
                Step::Jump(Duration::from_secs(JUMPS[self.rng.weighted(&weights)].0))
            }
            9 => Step::Kill {
                instance: self.below(self.instances),
                during: None,
            },
            10 => {
                let plan = self.keyed(Behaviour::HangThenCreated(2500));
                Step::Kill {
                    instance: plan.instance,
                    during: Some(plan),
                }
            }
            11 => Step::Refused(self.keyed(Behaviour::Status(201))),
            _ => Step::LoseData {
                restart: self.rng.chance(0.5).then(|| self.below(self.instances)),
            },
        }
    }
}
