//! The demo's results: the table, and the same as JSON.

use std::fmt::Write as _;

use serde::Serialize;

/// A whole run.
#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(super) seed: u64,
    pub(super) instances: usize,
    pub(super) payments: u64,
    pub(super) clients: u16,
    pub(super) drop_rate: f64,
    pub(super) reset_rate: f64,
    /// The shared store's URL, without its password.
    pub(super) store: String,
    pub(super) seconds: f64,
    pub(super) rows: Vec<Row>,
}

/// One set-up's results. `charges = payments - lost + double_charges` by construction: every
/// payment is charged zero times (lost), once, or once plus its double charges.
#[derive(Debug, Serialize)]
pub(super) struct Row {
    pub(super) set_up: &'static str,
    pub(super) title: &'static str,
    pub(super) payments: u64,
    /// Charges the payments service made.
    pub(super) charges: u64,
    /// Charges beyond the first of a payment.
    pub(super) double_charges: u64,
    /// Payments never charged.
    pub(super) lost: u64,
    /// Payments whose client ended without a 2xx answer.
    pub(super) client_errors: u64,
    /// Attempts the clients made, all payments together.
    pub(super) attempts: u64,
    /// Payments whose final answer was a stored answer replayed.
    pub(super) replayed: u64,
    /// Answers the network dropped after the gateway sent them.
    pub(super) dropped_answers: u64,
    /// Connections the network reset before the request arrived.
    pub(super) resets: u64,
    /// Runs the gateways marked `Idempotency-Recovered: true` (keys of the crashed instance).
    pub(super) recovered_runs: u64,
    pub(super) seconds: f64,
}

impl Report {
    /// The table with a few lines saying what ran; `victim` is the killed instance (from 1),
    /// `shared_store` how to call the shared store if not by its URL.
    pub(super) fn table(&self, victim: usize, shared_store: Option<&str>) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} payments from {} clients through {} gateway instance{} behind a round-robin balancer.",
            self.payments,
            self.clients,
            self.instances,
            if self.instances == 1 { "" } else { "s" }
        );
        let _ = writeln!(
            out,
            "The network drops {} of the answers after the payment went through and resets {} of the\n\
             connections; instance {victim} is killed when a third of the payments are done, and restarted when\n\
             two thirds are. Shared store: {}.\n\
             Seed {} (--seed {} replays the same faults).\n",
            percent(self.drop_rate),
            percent(self.reset_rate),
            shared_store.unwrap_or(&self.store),
            self.seed,
            self.seed
        );
        let headers = [
            "set-up",
            "payments",
            "charges",
            "double charges",
            "lost",
            "client errors",
            "recovered runs",
        ];
        let cells: Vec<[String; 7]> = self
            .rows
            .iter()
            .map(|row| {
                [
                    row.title.to_owned(),
                    row.payments.to_string(),
                    row.charges.to_string(),
                    row.double_charges.to_string(),
                    row.lost.to_string(),
                    row.client_errors.to_string(),
                    row.recovered_runs.to_string(),
                ]
            })
            .collect();
        let widths: Vec<usize> = (0..headers.len())
            .map(|i| {
                cells
                    .iter()
                    .map(|row| row[i].len())
                    .chain([headers[i].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |out: &mut String, values: &[&str]| {
            for (i, value) in values.iter().enumerate() {
                // The first column is text (left), the others are counts (right).
                if i == 0 {
                    let _ = write!(out, "| {value:<width$} ", width = widths[i]);
                } else {
                    let _ = write!(out, "| {value:>width$} ", width = widths[i]);
                }
            }
            out.push_str("|\n");
        };
        line(&mut out, &headers);
        let rule: Vec<String> = widths
            .iter()
            .enumerate()
            .map(|(i, w)| {
                if i == 0 {
                    "-".repeat(*w)
                } else {
                    format!("{}:", "-".repeat(w - 1))
                }
            })
            .collect();
        let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
        line(&mut out, &rule);
        for row in &cells {
            let values: Vec<&str> = row.iter().map(String::as_str).collect();
            line(&mut out, &values);
        }
        let _ = writeln!(
            out,
            "\ndouble charges: charges beyond a payment's first; lost: payments never charged;\n\
             client errors: payments whose client ended without a 2xx answer; recovered runs: runs that\n\
             reached the payments service flagged Idempotency-Recovered (it must check before charging).\n\
             Finished in {:.1} s.",
            self.seconds
        );
        out
    }
}

fn percent(rate: f64) -> String {
    format!("{}%", (rate * 1000.0).round() / 10.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages() {
        assert_eq!(percent(0.1), "10%");
        assert_eq!(percent(0.055), "5.5%");
        assert_eq!(percent(0.0), "0%");
    }
}
