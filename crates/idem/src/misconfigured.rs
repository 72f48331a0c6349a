//! The error of a setting that parses but cannot work. Every layer that checks settings (the
//! config, the TLS files, the upstream) returns it, and `main` exits 2 on it, as for a usage error.

/// A setting that parses but cannot work: `idem` exits 2 (as for a usage error) naming the flag
/// (or the environment variable, for a setting that is read from the environment only).
#[derive(Debug, thiserror::Error)]
#[error("{}{flag}: {reason}", if flag.starts_with("IDEM_") || flag.starts_with("OTEL_") { "" } else { "--" })]
pub(crate) struct Misconfigured {
    pub(crate) flag: &'static str,
    pub(crate) reason: String,
}
