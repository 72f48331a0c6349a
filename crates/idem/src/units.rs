//! The command line's sizes (`256KiB`, `1MiB`, `1048576`), durations (`24h`, `500ms`) and methods,
//! parsed and written back.

use std::str::FromStr;
use std::time::Duration;

/// Parses a byte size: a whole number with an optional unit (`B`, `KiB`, `MiB`, `GiB`, `KB`, `MB`, `GB`).
pub(crate) fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: usize = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 256KiB or 1048576"))?;
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit {other:?}: use B, KiB, MiB, GiB, KB, MB or GB"
            ));
        }
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Parses a method name, in any case, and keeps it uppercased (`patch` is `PATCH`): the protocol
/// matches methods without regard to case, as the frameworks behind it route them.
pub(crate) fn parse_method(text: &str) -> Result<http::Method, String> {
    let text = text.trim();
    http::Method::from_str(&text.to_ascii_uppercase()).map_err(|_| format!("{text:?} is not an HTTP method"))
}

/// Writes a duration the way it is best read back: `24h`, `7d`, `500ms`.
pub(crate) fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    let units: [(u128, &str); 4] = [(86_400_000, "d"), (3_600_000, "h"), (60_000, "m"), (1_000, "s")];
    match units
        .iter()
        .find(|(size, unit)| millis.is_multiple_of(*size) && (millis >= 2 * size || *unit != "d"))
    {
        Some((size, unit)) if millis > 0 => format!("{}{unit}", millis / size),
        _ => format!("{millis}ms"),
    }
}

/// Writes a size in the largest binary unit that divides it: `256KiB`, `1MiB`.
pub(crate) fn format_size(bytes: usize) -> String {
    let units: [(usize, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    match units.iter().find(|(size, _)| bytes > 0 && bytes.is_multiple_of(*size)) {
        Some((size, unit)) => format!("{}{unit}", bytes / size),
        None => bytes.to_string(),
    }
}

/// Parses a humantime duration (`24h`, `500ms`, `1m 30s`).
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{text:?} is not a duration such as 500ms or 24h: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("256KiB"), Ok(256 * 1024));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert_eq!(parse_size("2 MB"), Ok(2_000_000));
        assert!(parse_size("1XB").is_err());
        assert!(parse_size("KiB").is_err());
        assert!(parse_size("-1").is_err());
    }

    #[test]
    fn what_is_written_reads_back() {
        for (duration, text) in [
            (86_400, "24h"),
            (7 * 86_400, "7d"),
            (60, "1m"),
            (90, "90s"),
            (300, "5m"),
        ] {
            let duration = Duration::from_secs(duration);
            assert_eq!(format_duration(duration), text);
            assert_eq!(parse_duration(text), Ok(duration));
        }
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        for (bytes, text) in [(1 << 20, "1MiB"), (256 << 10, "256KiB"), (1000, "1000")] {
            assert_eq!(format_size(bytes), text);
            assert_eq!(parse_size(text), Ok(bytes));
        }
    }

    #[test]
    fn methods() {
        assert_eq!(parse_method("POST"), Ok(http::Method::POST));
        assert_eq!(parse_method("PURGE").unwrap().as_str(), "PURGE");
        assert_eq!(parse_method("patch"), Ok(http::Method::PATCH));
        assert_eq!(parse_method(" Post "), Ok(http::Method::POST));
        assert_eq!(parse_method("purge").unwrap().as_str(), "PURGE");
        assert!(parse_method("PO ST").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert!(parse_duration("soon").is_err());
    }
}
