//! The log writer: access log lines are gathered in memory and written to
//! stderr by one thread of their own, off the request path (what nginx's
//! `access_log … buffer=64k flush=1s` does). Every other line (warnings,
//! the audit log, start and stop) is written through at once, behind the
//! access lines gathered before it, so the order of lines is kept.
//!
//! Contracts:
//! - **No line is lost at a clean stop**: [`LogGuard`] writes out everything
//!   gathered when it is dropped (or [`LogGuard::close`]d), which `serve`
//!   does after the gateway has drained. After that, lines are written
//!   straight to the sink.
//! - **Bounded memory**: at most `max_bytes` of lines wait in memory, plus
//!   the batch being written. When the sink falls behind (a slow disk, a
//!   log collector that stops reading the pipe), a thread that logs waits
//!   until there is room again: lines are never dropped, and the gateway
//!   slows down to the sink's speed, as it did when every line was one
//!   unbuffered write to stderr.
//! - A line that is not an access line returns only once it (and every line
//!   before it) has been handed to the sink, as an unbuffered stderr did.
//!
//! The proxy's access lines are formatted by [`access`] (the same bytes as
//! `tracing_subscriber`'s, at a fraction of the cost) when `serve` installs
//! it; other callers go through `tracing`.
//!
//! This module must not log through `tracing` itself: its writer thread
//! would wait on its own buffer.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

mod access;
pub use access::{install_access, write_access, Field};

/// The target of access log lines, the only ones gathered in memory.
pub const ACCESS_TARGET: &str = "fencegate::access";

/// When gathered lines are written, and how many may wait.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Write as soon as this many bytes are gathered.
    pub flush_bytes: usize,
    /// Write at least this often while anything is gathered.
    pub flush_interval: Duration,
    /// At most this many bytes wait in memory (besides the batch being
    /// written); a thread that logs past it waits for the writer.
    pub max_bytes: usize,
}

impl Default for Limits {
    /// 64 KiB or 1 s, whichever comes first; 1 MiB at most waiting.
    fn default() -> Self {
        Limits { flush_bytes: 64 * 1024, flush_interval: Duration::from_secs(1), max_bytes: 1024 * 1024 }
    }
}

struct State {
    /// Lines gathered, not yet taken by the writer.
    buf: Vec<u8>,
    /// Bytes ever appended / ever handed to the sink (positions in one
    /// stream, so a waiting line knows when it is out).
    appended: u64,
    written: u64,
    /// A line that may not wait is in `buf`.
    urgent: bool,
    /// The writer thread has ended (or is ending): write straight through.
    closed: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the writer thread.
    work: Condvar,
    /// Wakes threads waiting for room or for their line to be written.
    progress: Condvar,
    limits: Limits,
    /// Used after close, and by the writer thread.
    sink: Mutex<Box<dyn Write + Send>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves only bytes in a Vec behind.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_sink(&self, bytes: &[u8]) {
        let mut sink = self.sink.lock().unwrap_or_else(PoisonError::into_inner);
        // Nowhere to report a failed write to the log: the line is gone,
        // as with an unbuffered stderr.
        let _ = sink.write_all(bytes);
        let _ = sink.flush();
    }

    /// Appends one line; `urgent` lines return once written.
    fn append(&self, line: &[u8], urgent: bool) {
        let mut st = self.lock();
        // Room: wait while the gathered lines are at the limit (a line
        // longer than the whole limit goes in once the buffer is empty).
        while !st.closed && !st.buf.is_empty() && st.buf.len() + line.len() > self.limits.max_bytes {
            self.work.notify_one();
            st = self.progress.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        if st.closed {
            drop(st);
            self.write_sink(line);
            return;
        }
        st.buf.extend_from_slice(line);
        st.appended += line.len() as u64;
        let end = st.appended;
        if urgent {
            st.urgent = true;
            self.work.notify_one();
            while st.written < end && !st.closed {
                st = self.progress.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
        } else if st.buf.len() >= self.limits.flush_bytes {
            self.work.notify_one();
        }
    }

    /// The writer thread: takes what is gathered and writes it, when
    /// `flush_bytes` are gathered, an urgent line came, the interval has
    /// passed, or at close.
    fn run(&self) {
        let mut spare = Vec::new();
        let mut st = self.lock();
        loop {
            let ready = |st: &State| st.closed || st.urgent || st.buf.len() >= self.limits.flush_bytes;
            if !ready(&st) {
                let (next, _) = self
                    .work
                    .wait_timeout_while(st, self.limits.flush_interval, |st| !ready(st))
                    .unwrap_or_else(PoisonError::into_inner);
                st = next;
            }
            let closing = st.closed;
            if !st.buf.is_empty() {
                std::mem::swap(&mut st.buf, &mut spare);
                st.urgent = false;
                let upto = st.appended;
                drop(st);
                self.write_sink(&spare);
                // Keep the allocation unless one huge batch inflated it.
                if spare.capacity() > 2 * self.limits.max_bytes {
                    spare = Vec::new();
                } else {
                    spare.clear();
                }
                st = self.lock();
                st.written = upto;
                self.progress.notify_all();
            }
            if closing && st.buf.is_empty() {
                return;
            }
        }
    }
}

/// Hands `tracing_subscriber` one writer per line.
#[derive(Clone)]
pub struct LogWriter {
    shared: Arc<Shared>,
}

/// Ends the writer thread, writing out every line gathered.
pub struct LogGuard {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for LogGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogGuard").finish_non_exhaustive()
    }
}

/// Starts the writer thread on `sink`. If the thread cannot be started,
/// every line is written straight through.
pub fn start(sink: Box<dyn Write + Send>, limits: Limits) -> (LogWriter, LogGuard) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            buf: Vec::with_capacity(limits.flush_bytes.min(limits.max_bytes)),
            appended: 0,
            written: 0,
            urgent: false,
            closed: false,
        }),
        work: Condvar::new(),
        progress: Condvar::new(),
        limits,
        sink: Mutex::new(sink),
    });
    let runner = Arc::clone(&shared);
    let thread = std::thread::Builder::new().name("fencegate-log".into()).spawn(move || runner.run()).ok();
    if thread.is_none() {
        shared.lock().closed = true;
    }
    (LogWriter { shared: Arc::clone(&shared) }, LogGuard { shared, thread })
}

impl LogGuard {
    /// Writes out every gathered line and ends the writer thread; later
    /// lines go straight to the sink. Idempotent.
    pub fn close(&mut self) {
        self.shared.lock().closed = true;
        self.shared.work.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Whatever a thread appended after the writer's last look (it saw
        // `closed` false just before close) is written here.
        let rest = {
            let mut st = self.shared.lock();
            st.written = st.appended;
            self.shared.progress.notify_all();
            std::mem::take(&mut st.buf)
        };
        if !rest.is_empty() {
            self.shared.write_sink(&rest);
        }
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        self.close();
    }
}

/// One line on its way to the buffer.
pub struct LineWriter<'a> {
    shared: &'a Shared,
    urgent: bool,
}

impl Write for LineWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.shared.append(buf, self.urgent);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter { shared: &self.shared, urgent: true }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        LineWriter { shared: &self.shared, urgent: meta.target() != ACCESS_TARGET }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::time::Instant;

    /// A sink that keeps what it is given and can be held shut.
    #[derive(Clone, Default)]
    pub(super) struct Sink {
        out: Arc<Mutex<Vec<u8>>>,
        shut: Arc<(Mutex<bool>, Condvar)>,
    }

    impl Sink {
        pub(super) fn text(&self) -> String {
            String::from_utf8(self.out.lock().unwrap().clone()).unwrap()
        }
        fn set_shut(&self, shut: bool) {
            *self.shut.0.lock().unwrap() = shut;
            self.shut.1.notify_all();
        }
    }

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut shut = self.shut.0.lock().unwrap();
            while *shut {
                shut = self.shut.1.wait(shut).unwrap();
            }
            self.out.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    pub(super) fn limits(flush_bytes: usize, max_bytes: usize, interval_ms: u64) -> Limits {
        Limits { flush_bytes, max_bytes, flush_interval: Duration::from_millis(interval_ms) }
    }

    #[test]
    fn every_gathered_line_is_written_in_order_at_close() {
        let sink = Sink::default();
        let (w, mut guard) = start(Box::new(sink.clone()), limits(1 << 20, 4 << 20, 60_000));
        for i in 0..10_000 {
            w.shared.append(format!("line {i}\n").as_bytes(), false);
        }
        // Nothing reached the flush size or the interval: all still gathered.
        assert_eq!(sink.text(), "");
        guard.close();
        let text = sink.text();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 10_000);
        assert!(lines.iter().enumerate().all(|(i, l)| *l == format!("line {i}")));
        // After close, straight through.
        w.shared.append(b"late\n", false);
        assert!(sink.text().ends_with("late\n"));
    }

    #[test]
    fn an_urgent_line_returns_written_behind_the_lines_before_it() {
        let sink = Sink::default();
        let (w, _guard) = start(Box::new(sink.clone()), limits(1 << 20, 4 << 20, 60_000));
        w.shared.append(b"access 1\n", false);
        w.shared.append(b"access 2\n", false);
        w.shared.append(b"warning\n", true);
        assert_eq!(sink.text(), "access 1\naccess 2\nwarning\n");
    }

    #[test]
    fn gathered_lines_are_written_after_the_interval_without_more_traffic() {
        let sink = Sink::default();
        let (w, _guard) = start(Box::new(sink.clone()), limits(1 << 20, 4 << 20, 100));
        w.shared.append(b"lonely\n", false);
        let started = Instant::now();
        while sink.text().is_empty() {
            assert!(started.elapsed() < Duration::from_secs(5), "not written after the interval");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(sink.text(), "lonely\n");
    }

    #[test]
    fn a_stalled_sink_holds_loggers_at_the_memory_bound_and_loses_nothing() {
        let sink = Sink::default();
        sink.set_shut(true);
        let (w, mut guard) = start(Box::new(sink.clone()), limits(1024, 8 * 1024, 10));
        let line = [b'x'; 99];
        let mut line = line.to_vec();
        line.push(b'\n');
        let logger = {
            let w = w.clone();
            std::thread::spawn(move || {
                for _ in 0..2_000 {
                    w.shared.append(&line, false);
                }
            })
        };
        // The logger fills the buffer, then waits: memory stays bounded.
        std::thread::sleep(Duration::from_millis(300));
        assert!(!logger.is_finished(), "a logger went past the bound while the sink was stalled");
        {
            let st = w.shared.lock();
            assert!(st.buf.len() <= 8 * 1024, "{} bytes gathered", st.buf.len());
            // What is gathered plus the one batch the writer holds.
            assert!(st.appended - st.written <= 2 * 8 * 1024 + 100);
        }
        sink.set_shut(false);
        logger.join().unwrap();
        guard.close();
        assert_eq!(sink.text().lines().count(), 2_000);
    }
}
