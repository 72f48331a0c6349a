//! `sqlite:` URLs: which file a store URL names.

use std::path::PathBuf;

use crate::SqliteError;

/// The file named by `sqlite://relative/path.db`, `sqlite:///absolute/path.db` or `sqlite:path`.
pub(crate) fn path_of(url: &str) -> Result<PathBuf, SqliteError> {
    let invalid = |reason| SqliteError::InvalidUrl {
        url: url.to_owned(),
        reason,
    };
    let (scheme, rest) = url.split_once(':').ok_or_else(|| invalid("it has no scheme"))?;
    if !scheme.eq_ignore_ascii_case("sqlite") {
        return Err(invalid("the scheme is not sqlite"));
    }
    // `sqlite://a/b` is relative (as in sqlx), `sqlite:///a/b` absolute; without the slashes the
    // rest is the path as it is.
    let path = rest.strip_prefix("//").unwrap_or(rest);
    if path.is_empty() {
        return Err(invalid("it names no file"));
    }
    if path.contains(['?', '#']) {
        return Err(invalid("query parameters and fragments are not supported"));
    }
    Ok(PathBuf::from(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_forms() {
        assert_eq!(path_of("sqlite://idem.db").unwrap(), PathBuf::from("idem.db"));
        assert_eq!(path_of("sqlite://data/idem.db").unwrap(), PathBuf::from("data/idem.db"));
        assert_eq!(
            path_of("sqlite:///var/lib/idem.db").unwrap(),
            PathBuf::from("/var/lib/idem.db")
        );
        assert_eq!(path_of("sqlite:idem.db").unwrap(), PathBuf::from("idem.db"));
        assert_eq!(path_of("sqlite:/tmp/idem.db").unwrap(), PathBuf::from("/tmp/idem.db"));
        assert_eq!(path_of("SQLite://idem.db").unwrap(), PathBuf::from("idem.db"));
        assert_eq!(path_of("sqlite::memory:").unwrap(), PathBuf::from(":memory:"));
    }

    #[test]
    fn refusals_say_why() {
        for (url, why) in [
            ("postgres://localhost/test", "scheme is not sqlite"),
            ("idem.db", "no scheme"),
            ("sqlite://", "names no file"),
            ("sqlite:", "names no file"),
            ("sqlite://idem.db?mode=rwc", "query parameters"),
        ] {
            let err = path_of(url).unwrap_err().to_string();
            assert!(err.contains(why), "{url}: {err}");
            assert!(err.contains(url), "{url}: {err}");
        }
    }
}
