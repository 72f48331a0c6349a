//! [`redact_url`]: a URL as it may be shown, in a log line, an error or a command's output,
//! with its password masked. Every store crate and the gateway show URLs through it, so that no
//! two of them disagree on what a password is.

use std::borrow::Cow;

/// What stands in for a password.
const MASK: &str = "***";

/// `url` with every password masked by `***`: the password of its user info
/// (`postgres://user:secret@host` → `postgres://user:***@host`), a `password=` query option,
/// and, in a `redis…://` URL, a bare user info (`redis://secret@host`, which Redis users write
/// for a password as often as for a user name).
///
/// The user info ends at the last `@` that a host follows, so a password that holds an unescaped
/// `/`, `@`, `?` or `#` is masked whole. Text that is not a URL is returned as it is.
///
/// ```
/// assert_eq!(
///     idem_core::redact_url("postgres://idem:s3cr3t@db:5432/app?pool_size=4"),
///     "postgres://idem:***@db:5432/app?pool_size=4"
/// );
/// assert_eq!(idem_core::redact_url("redis://:s3cr3t@cache:6379/"), "redis://:***@cache:6379/");
/// ```
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The query starts after the user info, which may hold any character.
    let hosts_at = url_userinfo_end(rest).map_or(0, |at| at + 1);
    let query_at = rest[hosts_at..].find(['?', '#']).map_or(rest.len(), |at| hosts_at + at);
    let (before_query, query) = rest.split_at(query_at);
    let mut out = format!("{scheme}://");
    match hosts_at
        .checked_sub(1)
        .map(|at| (&before_query[..at], &before_query[at + 1..]))
    {
        Some((userinfo, hosts)) => {
            match userinfo.split_once(':') {
                Some((user, _password)) => out.push_str(&format!("{user}:{MASK}")),
                None if scheme.to_ascii_lowercase().starts_with("redis") => out.push_str(MASK),
                None => out.push_str(userinfo),
            }
            out.push('@');
            out.push_str(hosts);
        }
        None => out.push_str(before_query),
    }
    out.push_str(&redact_query(query));
    out
}

/// `text` (a log line, an error message) with the password of every URL in it masked as
/// [`redact_url`] masks one: a URL is found by its `scheme://` and runs to the next space, quote,
/// control character or other character that a URL cannot hold unescaped (`<>"'`…), less
/// trailing punctuation (`)`, `,`, `.`, …) that closes a sentence or a bracket around it. Text
/// without `://` is returned as it is, without copying (every log line comes through here).
///
/// ```
/// assert_eq!(
///     idem_core::redact_urls_in("error sending request for url (http://u:s3cr3t@collector:4318/v1/traces)"),
///     "error sending request for url (http://u:***@collector:4318/v1/traces)"
/// );
/// ```
pub fn redact_urls_in(text: &str) -> Cow<'_, str> {
    if !text.contains("://") {
        return Cow::Borrowed(text);
    }
    let is_scheme = |c: char| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.');
    let ends_url = |c: char| {
        c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'' | '<' | '>' | '`' | '\\' | '{' | '}' | '|' | '^')
    };
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let scheme_at = rest[..at]
            .char_indices()
            .rev()
            .take_while(|&(_, c)| is_scheme(c))
            .last()
            .map_or(at, |(start, _)| start);
        let after = at + 3;
        let mut end = rest[after..].find(ends_url).map_or(rest.len(), |len| after + len);
        while end > after && rest[..end].ends_with([')', ',', '.', ';', ':', '!', '?']) {
            end -= 1;
        }
        out.push_str(&rest[..scheme_at]);
        if scheme_at < at {
            out.push_str(&redact_url(&rest[scheme_at..end]));
        } else {
            // `://` with no scheme before it is no URL.
            out.push_str(&rest[scheme_at..end]);
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// Where the user info of `rest` (a URL after its `://`) ends, the index of its `@`: the last `@`
/// that a host list follows (up to a `/`, `?`, `#` or the end), unless what comes before it is
/// already a plain `host[:port]` and then a path or a query (`host:1?prefix=a@b`: that `@` is the
/// query's). A password may so hold `/`, `@`, `?` or `#` unescaped: whoever splits a URL into its
/// parts looks for the query after this, so no piece of a password is ever taken for an option.
pub fn url_userinfo_end(rest: &str) -> Option<usize> {
    let is_hosts = |hosts: &str| {
        !hosts.is_empty()
            && hosts
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-_:[],% ".contains(c))
    };
    let is_plain_authority = |authority: &str| {
        is_hosts(authority)
            && authority
                .rsplit_once(':')
                .is_none_or(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
    };
    let at = rest
        .char_indices()
        .rev()
        .filter(|&(_, c)| c == '@')
        .map(|(at, _)| at)
        .find(|&at| {
            let after = &rest[at + 1..];
            is_hosts(&after[..after.find(['/', '?', '#']).unwrap_or(after.len())])
        })?;
    let before = &rest[..at];
    match before.find(['/', '?', '#']) {
        Some(cut) if is_plain_authority(&before[..cut]) => None,
        _ => Some(at),
    }
}

/// `query` (with its leading `?`, or empty) with the value of every `password=` option masked.
fn redact_query(query: &str) -> String {
    let Some(options) = query.strip_prefix('?') else {
        return query.to_owned();
    };
    let (options, fragment) = options.split_at(options.find('#').unwrap_or(options.len()));
    let options: Vec<String> = options
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}={MASK}"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("?{}{fragment}", options.join("&"))
}

#[cfg(test)]
mod tests {
    use super::{redact_url, redact_urls_in};

    #[test]
    fn masks_every_url_in_a_line() {
        for (line, shown) in [
            ("no url here", "no url here"),
            (
                "HttpClient.NetworkError url=\"http://user:pass@127.0.0.1:9/v1/traces\" error=\"error sending request for url (http://user:pass@127.0.0.1:9/v1/traces)\"",
                "HttpClient.NetworkError url=\"http://user:***@127.0.0.1:9/v1/traces\" error=\"error sending request for url (http://user:***@127.0.0.1:9/v1/traces)\"",
            ),
            ("(http://user:pass@host:9)", "(http://user:***@host:9)"),
            ("to http://u:p@h, then", "to http://u:***@h, then"),
            (
                "store=postgres://db/app?password=pw&x=1 ok",
                "store=postgres://db/app?password=***&x=1 ok",
            ),
            ("redis://token@cache:6379/0", "redis://***@cache:6379/0"),
            (
                r#"{"endpoint":"https://a:b@c/d","other":"https://e:f@g"}"#,
                r#"{"endpoint":"https://a:***@c/d","other":"https://e:***@g"}"#,
            ),
            ("a :// b http://plain/path", "a :// b http://plain/path"),
            ("über http://ü:ß@h", "über http://ü:***@h"),
        ] {
            assert_eq!(redact_urls_in(line), shown, "{line}");
        }
    }

    #[test]
    fn masks_every_password_and_nothing_else() {
        for (url, shown) in [
            (
                "postgres://idem:s3cr3t@db:5432/app?pool_size=4",
                "postgres://idem:***@db:5432/app?pool_size=4",
            ),
            ("postgres://idem@db/app", "postgres://idem@db/app"),
            (
                "postgres://db/app?user=idem&password=s3cr3t",
                "postgres://db/app?user=idem&password=***",
            ),
            ("postgres://a:b:c@d@host/app", "postgres://a:***@host/app"),
            ("postgres://a:pa/ss@host/app", "postgres://a:***@host/app"),
            ("redis://:hunter2@host:1/0", "redis://:***@host:1/0"),
            ("redis://user:hunter2@host", "redis://user:***@host"),
            ("redis://token@host", "redis://***@host"),
            (
                "redis+cluster://u:pw@h1:1,h2:2/?prefix=p",
                "redis+cluster://u:***@h1:1,h2:2/?prefix=p",
            ),
            ("redis://host:1?prefix=a@b", "redis://host:1?prefix=a@b"),
            ("redis://:hunter#TOP@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
            (
                "redis://:hunter?TOP&x@127.0.0.1:6379/0?prefix=p",
                "redis://:***@127.0.0.1:6379/0?prefix=p",
            ),
            (
                "redis+sentinel://:a?b#c@s1:26379,s2:26379/idem",
                "redis+sentinel://:***@s1:26379,s2:26379/idem",
            ),
            ("postgres://db/app?user=x@y", "postgres://db/app?user=x@y"),
            ("sqlite:///tmp/idem.db", "sqlite:///tmp/idem.db"),
            (
                "https://user:pw@upstream:8443/api",
                "https://user:***@upstream:8443/api",
            ),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }
}
