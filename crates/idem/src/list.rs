//! `idem list`: the records of a store by state, time, path and recovery, on the store's clock —
//! the first step of an investigation (which keys were recovered, which are stuck in flight,
//! which ended with their outcome unknown), before `idem inspect` of one of them.

use std::fmt::Write as _;

use anyhow::Context as _;
use idem_core::Clock as _;
use idem_core::store::{ListQuery, Listed};
use serde::Serialize;

use crate::cli::ListArgs;
use crate::commands::store_clock;
use crate::stores;
use crate::terminal::escaped;

/// `idem list`: prints the records the arguments ask for, newest first, as a table or as JSON
/// lines; says on stderr when none match, or when the limit cut the list short.
pub(crate) async fn list(args: ListArgs) -> anyhow::Result<()> {
    let store = stores::open_for_operator(&args.store.store, idem_postgres::Access::Read).await?;
    let clock = store_clock(&store).await?;
    let now = clock.now();
    let limit = args.limit as usize;
    let query = ListQuery {
        state: args.state,
        recovered: args.recovered,
        since: args.since.map(|since| now.minus(since)),
        path: args.route.clone(),
        ..ListQuery::all(now, limit)
    };
    let listed = store.list(&query).await.context("cannot list the store's records")?;
    if args.json {
        let mut out = String::new();
        for record in &listed {
            out.push_str(&serde_json::to_string(&ListedJson::of(record))?);
            out.push('\n');
        }
        print!("{out}");
    } else if !listed.is_empty() {
        print!("{}", table(&listed));
    }
    for record in &listed {
        if let Some(why) = &record.damaged {
            eprintln!(
                "the record of key {:?} in scope {:?} is damaged: {why}; `idem inspect` shows it, `idem delete` removes it",
                record.id.key.as_str(),
                record.id.scope.as_str()
            );
        }
    }
    if listed.is_empty() {
        eprintln!("no record matches");
    } else if listed.len() == limit {
        eprintln!("the newest {limit} records shown; there may be more (raise --limit, or narrow with --since)");
    }
    Ok(())
}

/// The records as an aligned table with a header, one line each; what callers chose (scope, key,
/// path) escaped for a terminal.
fn table(listed: &[Listed]) -> String {
    const HEADER: [&str; 9] = [
        "CREATED",
        "STATE",
        "STATUS",
        "REPLAYS",
        "RECOVERED",
        "REQUEST",
        "TRACE",
        "SCOPE",
        "KEY",
    ];
    let rows: Vec<[String; 9]> = listed
        .iter()
        .map(|record| {
            [
                record.created_at.to_string(),
                // A damaged record's state is judged on times that cannot be right.
                if record.damaged.is_some() {
                    "damaged".to_owned()
                } else {
                    record.state.to_string()
                },
                record
                    .status
                    .map_or_else(|| "-".to_owned(), |status| status.to_string()),
                record.replays.to_string(),
                if record.recovered { "yes" } else { "no" }.to_owned(),
                request(record),
                record
                    .origin
                    .trace
                    .map_or_else(|| "-".to_owned(), |trace| trace.trace_id.to_string()),
                escaped(record.id.scope.as_str()).into_owned(),
                escaped(record.id.key.as_str()).into_owned(),
            ]
        })
        .collect();
    let mut widths = HEADER.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (cell, width) in cells.zip(widths) {
            let _ = write!(text, "{cell:width$}  ");
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut HEADER.into_iter());
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// `METHOD PATH` (escaped for a terminal), or `-` for a record written before records kept them.
fn request(record: &Listed) -> String {
    if record.origin.method.is_empty() && record.origin.path.is_empty() {
        "-".to_owned()
    } else {
        format!("{} {}", escaped(&record.origin.method), escaped(&record.origin.path))
    }
}

/// One line of `idem list --json`: the facts of the table, each in its own field (`null` where a
/// record has none).
#[derive(Debug, Serialize)]
struct ListedJson<'a> {
    /// RFC 3339; `null` if the record holds a time past the year 9999 (see `damaged`).
    created_at: Option<String>,
    /// `in-flight`, `unknown`, `completed` or `tombstone`.
    state: &'static str,
    status: Option<u16>,
    replays: u64,
    recovered: bool,
    /// `null` for a record written before records kept its request.
    method: Option<&'a str>,
    path: Option<&'a str>,
    trace_id: Option<String>,
    scope: &'a str,
    key: &'a str,
    /// Why the record is damaged (a time past the year 9999, which no setting makes), else `null`.
    damaged: Option<&'a str>,
}

impl<'a> ListedJson<'a> {
    fn of(record: &'a Listed) -> Self {
        let kept = |text: &'a str| (!text.is_empty()).then_some(text);
        Self {
            created_at: record.created_at.rfc3339(),
            state: record.state.as_str(),
            status: record.status,
            replays: record.replays,
            recovered: record.recovered,
            method: kept(&record.origin.method),
            path: kept(&record.origin.path),
            trace_id: record.origin.trace.map(|trace| trace.trace_id.to_string()),
            scope: record.id.scope.as_str(),
            key: record.id.key.as_str(),
            damaged: record.damaged.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use idem_core::store::{ListedState, Origin, RecordId};
    use idem_core::trace_context::RunTrace;
    use idem_core::{IdempotencyKey, Scope, UnixMillis};
    use serde_json::json;

    use super::*;

    fn listed(origin: Origin, status: Option<u16>) -> Listed {
        Listed {
            id: RecordId {
                scope: Scope::from_stored("cred-mac:ab12"),
                key: IdempotencyKey::new("order-7").unwrap(),
            },
            state: ListedState::Completed,
            origin,
            status,
            created_at: UnixMillis(1_000),
            replays: 2,
            recovered: true,
            damaged: None,
        }
    }

    #[test]
    fn the_table_lines_up_and_marks_what_a_record_lacks() {
        let trace = RunTrace::from_stored("4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7");
        let table = table(&[
            listed(Origin::new("POST", "/payments/pay_1", trace), Some(201)),
            listed(Origin::default(), None),
        ]);
        let lines: Vec<_> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        assert!(lines[0].starts_with("CREATED"), "{table}");
        let status_at = lines[0].find("STATUS").unwrap();
        assert_eq!(&lines[1][status_at..status_at + 3], "201", "{table}");
        assert_eq!(&lines[2][status_at..status_at + 1], "-", "{table}");
        assert!(lines[1].contains("POST /payments/pay_1") && lines[1].contains("4bf92f3577b34da6a3ce929d0e0e4736"));
        assert!(lines[1].ends_with("cred-mac:ab12  order-7"), "{table}");
    }

    #[test]
    fn json_lines_name_every_fact() {
        let record = listed(Origin::default(), None);
        let value = serde_json::to_value(ListedJson::of(&record)).unwrap();
        assert_eq!(
            value,
            json!({
                "created_at": UnixMillis(1_000).to_string(), "state": "completed", "status": null,
                "replays": 2, "recovered": true, "method": null, "path": null, "trace_id": null,
                "scope": "cred-mac:ab12", "key": "order-7", "damaged": null,
            })
        );
    }
}
