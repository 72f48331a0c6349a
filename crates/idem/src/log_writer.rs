//! `idem serve`'s log lines, written to stderr in batches.
//!
//! Under load the gateway logs one line per keyed request, tens of thousands a second; one
//! `write(2)` each was about a tenth of a cached replay's CPU (`bench/log_cost.sh`). Here a line
//! at `info` or below is appended to a buffer that a thread of its own writes out every
//! [`FLUSH_EVERY`], or sooner once it holds [`HIGH_WATER`] bytes. That thread sleeps between
//! batches rather than waking for every line (a channel-fed writer did, and measured no better
//! than writing directly).
//!
//! Nothing is dropped, and the order of lines is kept:
//! * a `warn` or `error` line drains the buffer and is written at once, after it, by the thread
//!   that logs it, so a line that says something is wrong is never held back;
//! * a buffer at [`LIMIT`] (stderr not keeping up) is written by the thread that fills it, which
//!   waits for it as a direct write would wait: back-pressure, not loss;
//! * whoever takes lines out of the buffer takes the output's lock before letting the buffer go,
//!   so batches reach stderr in the order they were taken;
//! * [`LogWriter::flush`] writes what is left when the process stops, and a panic drains the
//!   buffer before its message is printed.
//!
//! A batch is written in runs of whole lines of at most `PIPE_BUF` bytes, so that processes
//! sharing one stderr pipe never tear each other's lines (one write per line never did either).
//!
//! What it gives up: a process killed by a signal it does not handle (`SIGKILL`, `SIGHUP`,
//! `SIGQUIT`) loses the `info` lines of its last [`FLUSH_EVERY`], or, if stderr was not keeping
//! up, the lines it still held, [`LIMIT`] at most (their requests' records are in the store
//! either way).

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

/// How long a line may wait in the buffer.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(20);

/// A buffer this large is written without waiting for the next tick.
const HIGH_WATER: usize = 64 * 1024;

/// A buffer this large is written by the thread that fills it (stderr is not keeping up). It
/// bounds what a `SIGKILL` can lose while stderr is behind.
const LIMIT: usize = 1024 * 1024;

/// A [`MakeWriter`] for the log layer: see the module's documentation.
#[derive(Clone, Debug)]
pub(crate) struct LogWriter {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    /// Lines not yet written.
    pending: Mutex<Vec<u8>>,
    /// Wakes the writing thread early (the buffer passed [`HIGH_WATER`]).
    wake: Condvar,
    /// Held while a batch is written: taken before `pending` is let go, so batches keep their order.
    out: Mutex<()>,
}

impl LogWriter {
    /// Starts the thread that writes the buffered lines, and installs a panic hook that drains
    /// them before the panic's message.
    pub(crate) fn start() -> io::Result<Self> {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Vec::with_capacity(HIGH_WATER)),
            wake: Condvar::new(),
            out: Mutex::new(()),
        });
        let writer = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("idem-log".to_owned())
            .spawn(move || writer.run())?;
        let on_panic = Arc::clone(&shared);
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            on_panic.drain(None);
            previous(info);
        }));
        Ok(Self { shared })
    }

    /// Writes every buffered line now (the process is stopping).
    pub(crate) fn flush(&self) {
        self.shared.drain(None);
    }
}

impl Shared {
    /// The writing thread: a batch every [`FLUSH_EVERY`], or sooner when woken.
    fn run(&self) {
        let mut spare = Vec::with_capacity(HIGH_WATER);
        loop {
            let pending = lock(&self.pending);
            let (mut pending, _) = self
                .wake
                .wait_timeout_while(pending, FLUSH_EVERY, |lines| lines.len() < HIGH_WATER)
                .unwrap_or_else(PoisonError::into_inner);
            if pending.is_empty() {
                continue;
            }
            std::mem::swap(&mut *pending, &mut spare);
            let out = lock(&self.out);
            drop(pending);
            write_stderr(&spare, None);
            drop(out);
            spare.clear();
            if spare.capacity() > LIMIT {
                spare = Vec::with_capacity(HIGH_WATER);
            }
        }
    }

    /// Writes the buffered lines, then `line`, from the calling thread.
    fn drain(&self, line: Option<&[u8]>) {
        let mut pending = lock(&self.pending);
        let batch = std::mem::take(&mut *pending);
        let out = lock(&self.out);
        drop(pending);
        write_stderr(&batch, line);
        drop(out);
    }

    /// Appends `line` to the buffer, writing the buffer from here if it has grown to [`LIMIT`].
    fn push(&self, line: &[u8]) {
        let mut pending = lock(&self.pending);
        pending.extend_from_slice(line);
        let len = pending.len();
        if len >= LIMIT {
            let batch = std::mem::take(&mut *pending);
            let out = lock(&self.out);
            drop(pending);
            write_stderr(&batch, None);
            drop(out);
        } else if len >= HIGH_WATER && len - line.len() < HIGH_WATER {
            drop(pending);
            self.wake.notify_one();
        }
    }
}

/// Writes `batch` and then `line` to stderr. A log line that cannot be written is lost, as
/// `eprintln!`'s would be; logging never fails a request.
fn write_stderr(batch: &[u8], line: Option<&[u8]>) {
    // Straight to the file descriptor: `io::stderr()` is unbuffered, and the chunks must reach
    // the kernel as they are cut.
    let mut stderr = io::stderr().lock();
    for chunk in whole_lines(batch).chain(line.into_iter().flat_map(whole_lines)) {
        let _ = stderr.write_all(chunk);
    }
}

/// The most a write to a pipe may hold and still reach it whole, not interleaved with another
/// process's writes to the same pipe (`PIPE_BUF` on Linux).
const ATOMIC_WRITE: usize = 4096;

/// `bytes` cut into runs of whole lines of at most [`ATOMIC_WRITE`] bytes each (a longer line is
/// a run of its own): several processes that share one stderr pipe (a supervisor's, a shell's
/// `2>&1 |`) then never tear each other's lines, as with one write per line.
fn whole_lines(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = if rest.len() <= ATOMIC_WRITE {
            rest.len()
        } else {
            match rest[..ATOMIC_WRITE].iter().rposition(|&b| b == b'\n') {
                Some(newline) => newline + 1,
                // One line longer than a pipe keeps whole: to its end.
                None => rest
                    .iter()
                    .position(|&b| b == b'\n')
                    .map_or(rest.len(), |newline| newline + 1),
            }
        };
        let (chunk, after) = rest.split_at(end);
        rest = after;
        Some(chunk)
    })
}

/// A lock that a panic elsewhere does not poison for the logger: the buffer is bytes, and is
/// whole after any interrupted append.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One event's line, as the formatter writes it; handed over when the formatter is done.
pub(crate) struct Line<'a> {
    shared: &'a Shared,
    /// Written at once, after the buffer (`warn` and `error`).
    urgent: bool,
    bytes: Vec<u8>,
}

impl Write for Line<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        if self.urgent {
            self.shared.drain(Some(&self.bytes));
        } else if !self.bytes.is_empty() {
            self.shared.push(&self.bytes);
        }
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        Line {
            shared: &self.shared,
            urgent: false,
            bytes: Vec::new(),
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Self::Writer {
        Line {
            shared: &self.shared,
            urgent: *meta.level() <= Level::WARN,
            bytes: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(bytes: &[u8]) -> Vec<&[u8]> {
        whole_lines(bytes).collect()
    }

    #[test]
    fn a_batch_is_cut_into_whole_lines_that_a_pipe_keeps_whole() {
        let line = |c: u8, len: usize| {
            let mut line = vec![c; len - 1];
            line.push(b'\n');
            line
        };
        let batch: Vec<u8> = (0..100u8).flat_map(|i| line(b'a' + i % 26, 150)).collect();
        let cut = runs(&batch);
        assert_eq!(cut.concat(), batch, "nothing lost, nothing added, in order");
        for run in &cut {
            assert!(run.len() <= ATOMIC_WRITE, "{}", run.len());
            assert!(run.ends_with(b"\n"));
        }
        assert_eq!(cut[0].len(), 27 * 150, "as many whole lines as fit");

        // A line longer than a pipe keeps whole goes on its own, whole.
        let long = line(b'x', 10_000);
        let batch = [line(b'a', 100), long.clone(), line(b'b', 100)].concat();
        assert_eq!(runs(&batch), [&line(b'a', 100)[..], &long[..], &line(b'b', 100)[..]]);

        // A last line without its newline is written all the same.
        assert_eq!(runs(b"abc"), [&b"abc"[..]]);
        assert!(runs(b"").is_empty());
    }
}
