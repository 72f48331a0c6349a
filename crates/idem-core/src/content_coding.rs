//! Content codings (RFC 9110 §8.4) of replayed answers: which codings a client accepts, read from
//! its `Accept-Encoding`, and how a stored body is decoded for a client that does not accept the
//! coding it was stored in.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::{self, Read};

use http::HeaderMap;
use http::header::{ACCEPT_ENCODING, CONTENT_ENCODING};

/// The most bytes a stored body is decoded to for a replay. Stored bodies are small (the default
/// `max-stored-body` is 256 KiB, compressed), so only a decompression bomb comes near this; it
/// bounds the memory one replay can take.
pub(crate) const MAX_DECODED: usize = 64 << 20;

/// A weight of 1 in thousandths, the unit of RFC 9110's qvalues (three decimals).
const FULL_WEIGHT: u16 = 1000;

/// The content codings a client accepts, read from its `Accept-Encoding` (RFC 9110 §12.5.3).
///
/// `identity` is always acceptable: a stored answer can always be decoded for its client. Without
/// the header (the default) no other coding is: decoding is always correct, guessing is not.
///
/// ```
/// use http::HeaderMap;
/// use idem_core::protocol::AcceptEncoding;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("accept-encoding", "gzip, br;q=0".parse()?);
/// let accept = AcceptEncoding::from_headers(&headers);
/// assert!(accept.accepts("gzip") && accept.accepts("identity"));
/// assert!(!accept.accepts("br") && !accept.accepts("zstd"));
/// assert!(!AcceptEncoding::default().accepts("gzip"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AcceptEncoding {
    /// Named codings (canonical names) and their weights in thousandths; a map, so that a header
    /// listing thousands of codings costs no more than sorting them.
    codings: BTreeMap<String, u16>,
    /// The weight of `*`, when listed.
    any: Option<u16>,
}

impl AcceptEncoding {
    /// Reads every `Accept-Encoding` header of a request. Entries that do not parse are ignored,
    /// so that one client's junk never turns into an error.
    pub fn from_headers(headers: &HeaderMap) -> Self {
        let mut accept = Self::default();
        for value in headers.get_all(ACCEPT_ENCODING) {
            for entry in String::from_utf8_lossy(value.as_bytes()).split(',') {
                if let Some((coding, weight)) = parse_entry(entry) {
                    accept.add(coding, weight);
                }
            }
        }
        accept
    }

    fn add(&mut self, coding: String, weight: u16) {
        // A coding listed twice counts at its lower weight: in doubt, decoding is the safe side.
        let slot = if coding == "*" {
            self.any.get_or_insert(weight)
        } else {
            self.codings.entry(coding).or_insert(weight)
        };
        *slot = (*slot).min(weight);
    }

    /// Whether the client accepts a body in `coding` (a content-coding name, case-insensitive;
    /// `x-gzip` is `gzip`).
    pub fn accepts(&self, coding: &str) -> bool {
        let coding = canonical(coding);
        if coding == "identity" {
            return true;
        }
        match self.codings.get(&*coding) {
            Some(weight) => *weight > 0,
            None => self.any.is_some_and(|weight| weight > 0),
        }
    }

    /// Whether the client accepts a body with all of these codings applied.
    pub(crate) fn accepts_all(&self, codings: &[String]) -> bool {
        codings.iter().all(|coding| self.accepts(coding))
    }
}

/// One `coding[;q=weight]` entry; `None` when it does not parse (or is empty, as between `,,`).
fn parse_entry(entry: &str) -> Option<(String, u16)> {
    let mut parts = entry.split(';');
    let coding = parts.next()?.trim();
    if coding.is_empty() || !coding.bytes().all(is_tchar) {
        return None;
    }
    let mut weight = None;
    for param in parts {
        let (name, value) = param.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("q") {
            // Accept-Encoding defines no other parameter; one we do not know changes nothing.
            continue;
        }
        if weight.is_some() {
            return None;
        }
        weight = Some(parse_qvalue(value.trim())?);
    }
    Some((canonical(coding).into_owned(), weight.unwrap_or(FULL_WEIGHT)))
}

/// A qvalue (RFC 9110 §12.4.2: `0`, `0.5`, `1.000`, at most three decimals) in thousandths.
fn parse_qvalue(text: &str) -> Option<u16> {
    let (int, frac) = text.split_once('.').unwrap_or((text, ""));
    if frac.len() > 3 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let thousandths = frac
        .bytes()
        .zip([100, 10, 1])
        .map(|(b, unit)| u16::from(b - b'0') * unit)
        .sum::<u16>();
    match int {
        "0" => Some(thousandths),
        "1" if thousandths == 0 => Some(FULL_WEIGHT),
        _ => None,
    }
}

/// RFC 9110 §5.6.2 token characters.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Coding names are case-insensitive, and `x-gzip`/`x-compress` are the old names of
/// `gzip`/`compress` (RFC 9110 §8.4.1).
fn canonical(coding: &str) -> Cow<'_, str> {
    let lower = if coding.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(coding.to_ascii_lowercase())
    } else {
        Cow::Borrowed(coding)
    };
    match &*lower {
        "x-gzip" => Cow::Borrowed("gzip"),
        "x-compress" => Cow::Borrowed("compress"),
        _ => lower,
    }
}

/// The codings applied to a body, in the order they were applied, from its `Content-Encoding`
/// headers. `identity` is skipped: it means no coding. Names that are not tokens are kept (as
/// text) so that decoding reports them as unknown instead of ignoring them.
pub(crate) fn content_codings(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(CONTENT_ENCODING)
        .iter()
        .flat_map(|value| {
            String::from_utf8_lossy(value.as_bytes())
                .split(',')
                .map(|coding| canonical(coding.trim()).into_owned())
                .collect::<Vec<_>>()
        })
        .filter(|coding| !coding.is_empty() && coding != "identity")
        .collect()
}

/// Why a stored body could not be decoded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    /// A coding idem does not decode (`compress`, or a made-up name).
    #[error("unknown content coding {0:?}")]
    Unknown(String),
    /// The bytes are not valid in their coding.
    #[error("the body is not valid {coding}")]
    Corrupt {
        /// The coding that failed.
        coding: String,
        /// The decoder's error.
        #[source]
        source: io::Error,
    },
    /// The body decodes to more than the limit.
    #[error("the body decodes to more than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
}

/// Undoes `codings` (as [`content_codings`] lists them) on `body`, producing at most `limit` bytes.
pub(crate) fn decode(codings: &[String], body: &[u8], limit: usize) -> Result<Vec<u8>, DecodeError> {
    // Servers label empty answers (a 201 with no body) with the coding they would have used, and
    // an empty body is empty in every coding.
    if body.is_empty() {
        return Ok(Vec::new());
    }
    let mut current = Cow::Borrowed(body);
    // The codings were applied in the order listed, so they come off in reverse.
    for coding in codings.iter().rev() {
        current = Cow::Owned(decode_one(coding, &current, limit)?);
    }
    Ok(current.into_owned())
}

fn decode_one(coding: &str, body: &[u8], limit: usize) -> Result<Vec<u8>, DecodeError> {
    match coding {
        "gzip" => read_capped(coding, Ok(flate2::read::MultiGzDecoder::new(body)), limit),
        // RFC 9110 says zlib, but servers send raw deflate too. Raw deflate that happens to pass
        // zlib's two-byte header check still fails its Adler-32 checksum, and falls back here.
        "deflate" => match read_capped(coding, Ok(flate2::read::ZlibDecoder::new(body)), limit) {
            Err(DecodeError::Corrupt { .. }) => read_capped(coding, Ok(flate2::read::DeflateDecoder::new(body)), limit),
            other => other,
        },
        "br" => read_capped(coding, Ok(brotli_decompressor::Decompressor::new(body, 4096)), limit),
        "zstd" => read_capped(coding, zstd::stream::read::Decoder::with_buffer(body), limit),
        other => Err(DecodeError::Unknown(other.to_owned())),
    }
}

fn read_capped(coding: &str, reader: io::Result<impl Read>, limit: usize) -> Result<Vec<u8>, DecodeError> {
    let corrupt = |source| DecodeError::Corrupt {
        coding: coding.to_owned(),
        source,
    };
    let mut out = Vec::new();
    // One byte past the limit tells "exactly the limit" from "more".
    reader
        .map_err(corrupt)?
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(corrupt)?;
    if out.len() > limit {
        return Err(DecodeError::TooLarge { limit });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use http::HeaderValue;

    use super::*;

    fn accept(values: &[&str]) -> AcceptEncoding {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(ACCEPT_ENCODING, HeaderValue::from_str(value).unwrap());
        }
        AcceptEncoding::from_headers(&headers)
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    fn raw_deflate(data: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    fn br(data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut encoder = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
        encoder.write_all(data).unwrap();
        drop(encoder);
        out
    }

    fn codings(list: &[&str]) -> Vec<String> {
        list.iter().map(|c| (*c).to_owned()).collect()
    }

    #[test]
    fn no_header_accepts_identity_only() {
        for accept in [AcceptEncoding::default(), accept(&[]), accept(&[""])] {
            assert!(accept.accepts("identity"));
            for coding in ["gzip", "deflate", "br", "zstd"] {
                assert!(!accept.accepts(coding), "{coding} with {accept:?}");
            }
        }
    }

    #[test]
    fn weights_decide() {
        let a = accept(&["gzip;q=0, deflate; Q=0.001, br;q=1.000", "ZSTD ; q=0.000"]);
        assert!(!a.accepts("gzip") && !a.accepts("x-gzip"));
        assert!(a.accepts("deflate") && a.accepts("br"));
        assert!(!a.accepts("zstd"));
        assert!(!a.accepts("compress"), "not listed and no *");
    }

    #[test]
    fn star_covers_what_is_not_listed() {
        let a = accept(&["*, gzip;q=0"]);
        assert!(a.accepts("br") && a.accepts("zstd") && !a.accepts("gzip"));
        let none = accept(&["*;q=0, identity;q=0"]);
        assert!(!none.accepts("br"));
        assert!(none.accepts("identity"), "a stored answer can always be decoded");
    }

    #[test]
    fn aliases_and_case() {
        let a = accept(&["X-GZIP"]);
        assert!(a.accepts("gzip") && a.accepts("x-gzip") && a.accepts("GZip"));
    }

    #[test]
    fn junk_entries_are_ignored() {
        let a =
            accept(&["gzip;q=2, br;q=0.5.5, zstd;q, deflate;q=0.5;q=1, \"x\", ,, ;q=1, identity, compress;level=9"]);
        for coding in ["gzip", "br", "zstd", "deflate"] {
            assert!(!a.accepts(coding), "{coding}");
        }
        assert!(a.accepts("compress"), "an unknown parameter does not void the entry");
        let non_utf8 = HeaderValue::from_bytes(b"gzip, \xffbr").unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(ACCEPT_ENCODING, non_utf8);
        let a = AcceptEncoding::from_headers(&headers);
        assert!(a.accepts("gzip") && !a.accepts("br"));
    }

    #[test]
    fn a_repeated_coding_counts_at_its_lowest_weight() {
        assert!(!accept(&["gzip", "gzip;q=0"]).accepts("gzip"));
        assert!(!accept(&["*;q=0, *"]).accepts("br"));
    }

    #[test]
    fn qvalues() {
        assert_eq!(parse_qvalue("0"), Some(0));
        assert_eq!(parse_qvalue("0."), Some(0));
        assert_eq!(parse_qvalue("0.5"), Some(500));
        assert_eq!(parse_qvalue("0.125"), Some(125));
        assert_eq!(parse_qvalue("1"), Some(1000));
        assert_eq!(parse_qvalue("1.000"), Some(1000));
        for bad in ["", "1.001", "2", "0.1234", "-0", "0.x", ".5", "01"] {
            assert_eq!(parse_qvalue(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn content_codings_in_order() {
        let mut headers = HeaderMap::new();
        headers.append(CONTENT_ENCODING, HeaderValue::from_static("X-Gzip, identity"));
        headers.append(CONTENT_ENCODING, HeaderValue::from_static(" br ,"));
        assert_eq!(content_codings(&headers), ["gzip", "br"]);
    }

    #[test]
    fn decodes_every_coding() {
        let data = br#"{"charge":1,"status":"accepted"}"#.repeat(50);
        let zstd = zstd::bulk::compress(&data, 3).unwrap();
        for (coding, encoded) in [
            ("gzip", gzip(&data)),
            ("deflate", zlib(&data)),
            ("deflate", raw_deflate(&data)),
            ("br", br(&data)),
            ("zstd", zstd),
        ] {
            assert_eq!(
                decode(&codings(&[coding]), &encoded, MAX_DECODED).unwrap(),
                data,
                "{coding}"
            );
        }
    }

    #[test]
    fn several_codings_come_off_in_reverse() {
        let data = b"layered".repeat(100);
        let encoded = br(&gzip(&data));
        assert_eq!(decode(&codings(&["gzip", "br"]), &encoded, MAX_DECODED).unwrap(), data);
        assert!(decode(&codings(&["br", "gzip"]), &encoded, MAX_DECODED).is_err());
    }

    #[test]
    fn failures_are_errors() {
        let data = b"x".repeat(10_000);
        let encoded = gzip(&data);
        assert!(matches!(
            decode(&codings(&["compress"]), &encoded, MAX_DECODED),
            Err(DecodeError::Unknown(c)) if c == "compress"
        ));
        assert!(matches!(
            decode(&codings(&["gzip"]), &encoded[..encoded.len() - 3], MAX_DECODED),
            Err(DecodeError::Corrupt { .. })
        ));
        assert!(matches!(
            decode(&codings(&["deflate"]), b"not deflate at all", MAX_DECODED),
            Err(DecodeError::Corrupt { .. })
        ));
        assert!(matches!(
            decode(&codings(&["gzip"]), &encoded, 9_999),
            Err(DecodeError::TooLarge { limit: 9_999 })
        ));
        assert_eq!(decode(&codings(&["gzip"]), &encoded, 10_000).unwrap(), data);
    }

    #[test]
    fn an_empty_body_is_empty_in_every_coding() {
        assert_eq!(decode(&codings(&["gzip", "whatever"]), b"", 0).unwrap(), b"");
    }
}
