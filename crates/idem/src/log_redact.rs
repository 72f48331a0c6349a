//! [`RedactUrls`]: every log line, whoever logged it, with the passwords of the URLs in it masked
//! ([`idem_core::redact_urls_in`]). idem masks the URLs it logs itself, but its dependencies do
//! not: the OTLP exporter's `HttpClient.NetworkError` line, at `debug`, prints the endpoint's URL
//! whole on every failed export. Masking the written line catches them all.

use std::borrow::Cow;
use std::io::{self, Write};

use tracing::Metadata;
use tracing_subscriber::fmt::MakeWriter;

/// A [`MakeWriter`] whose writers mask URL passwords in what they are given before `M`'s write it.
///
/// The fmt layer formats an event into one buffer and hands it over in one `write_all`, so each
/// write is a whole line and a URL is never cut between two writes.
#[derive(Clone, Debug)]
pub(crate) struct RedactUrls<M>(pub(crate) M);

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for RedactUrls<M> {
    type Writer = Redacting<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        Redacting(self.0.make_writer())
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Self::Writer {
        Redacting(self.0.make_writer_for(meta))
    }
}

/// One line's writer ([`RedactUrls`]).
#[derive(Debug)]
pub(crate) struct Redacting<W>(W);

impl<W: Write> Write for Redacting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match redacted(buf) {
            Cow::Borrowed(same) => self.0.write(same),
            Cow::Owned(masked) => {
                // The masked line is shorter or longer than `buf`: all of it, or none.
                self.0.write_all(&masked)?;
                Ok(buf.len())
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// `bytes` with the URL passwords in them masked. The fmt layer writes UTF-8; bytes that are not
/// are masked in their valid UTF-8 runs (the rest kept as it is).
fn redacted(bytes: &[u8]) -> Cow<'_, [u8]> {
    if !bytes.windows(3).any(|w| w == b"://") {
        return Cow::Borrowed(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.extend_from_slice(idem_core::redact_urls_in(chunk.valid()).as_bytes());
        out.extend_from_slice(chunk.invalid());
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_is_masked_before_it_is_written() {
        let mut out = Vec::new();
        {
            let mut line = Redacting(&mut out);
            line.write_all(b"DEBUG opentelemetry_otlp: url=http://user:pass@127.0.0.1:9/v1/traces\n")
                .unwrap();
            line.write_all(b"INFO idem: no url\n").unwrap();
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "DEBUG opentelemetry_otlp: url=http://user:***@127.0.0.1:9/v1/traces\nINFO idem: no url\n"
        );
        assert_eq!(redacted(b"a \xff http://u:p@h"), &b"a \xff http://u:***@h"[..]);
    }
}
