//! The weights a push sends, made without holding up the training thread.
//!
//! Converting the whole model to a bfloat16 safetensors payload and hashing it on the
//! training thread would hold each step up (0.4–1 s a step for gpt2-124m on two cores), so:
//! - AdamW writes each parameter it updates as bfloat16 straight into its slot of a
//!   [`Payload`] (the learner's `AdamW::step_exporting`): one
//!   store per parameter, in the pass the optimizer makes anyway;
//! - the [`Exporter`]'s own thread hashes the finished payload (BLAKE3) and hands the
//!   [`WeightSet`] to the weight sync, newest first (a payload overtaken by a newer one
//!   before it was hashed is dropped, never published after it);
//! - payload buffers are pooled: when the last push of a set (and the sync's handle on it)
//!   let go of its bytes, the buffer goes back to the pool, so a step writes into memory
//!   already mapped instead of faulting in a fresh 249 MB. Every worker's push sends
//!   slices of the one buffer; no copy per worker;
//! - with a shared directory (`--shared-dir`, the same-host path) every buffer is a file
//!   there, mapped into memory ([`buffer`]): the optimizer's stores are the file's bytes,
//!   and publishing names it after its version — workers on this host map it instead of
//!   receiving the stream, and nothing is copied to get it there.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::set::{WeightSet, shared_file_name};
use bytes::Bytes;
use candle_core::{DType, Device, Result as CandleResult, Var};
use rookworld_lm::bf16_payload::{Layout, write_bf16_parallel};
use tokio::sync::watch;

mod buffer;
use buffer::{Buffer, PayloadFile};

/// Spare payload buffers kept for reuse.
pub const POOL: usize = 2;

/// Where the weight sync takes the newest published set from.
pub type Latest = Arc<watch::Sender<Option<Arc<WeightSet>>>>;

/// A directory of this process, `{name}-{pid}`, under /dev/shm (memory, where the
/// same-host path belongs), or under the system's temporary directory where there is no
/// /dev/shm. Not created here.
pub fn process_dir(name: &str) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    base.join(format!("{name}-{}", std::process::id()))
}

/// What payloads of one model share: the layout, the parameter names, the buffer pool and
/// the shared directory their files go into.
#[derive(Debug)]
struct Shared {
    layout: Layout,
    names: Vec<String>,
    pool: Mutex<Vec<Buffer>>,
    dir: Option<PathBuf>,
    /// The last payload file could not be made or published (said once, until one is).
    failing: AtomicBool,
}

impl Shared {
    /// Fills the pool, so the first steps write into memory already faulted in.
    fn prefill(self: &Arc<Self>) {
        for _ in 0..POOL {
            let fresh = self.fresh();
            let mut pool = self.pool.lock().expect("pool lock");
            if pool.len() >= POOL {
                return;
            }
            pool.push(fresh);
        }
    }

    /// A new buffer: a file in the shared directory when there is one and it takes it,
    /// else heap memory (that payload is then streamed to every worker).
    fn fresh(&self) -> Buffer {
        if let Some(dir) = &self.dir {
            match PayloadFile::create(dir, self.layout.len()) {
                Ok(file) => {
                    self.file_ok();
                    return Buffer::File(file);
                }
                Err(e) => self.file_failed(dir, &e),
            }
        }
        Buffer::heap(self.layout.len())
    }

    fn file_ok(&self) {
        if self.failing.swap(false, Ordering::Relaxed) {
            tracing::info!("shared payload files written again");
        }
    }

    fn file_failed(&self, dir: &Path, e: &std::io::Error) {
        if !self.failing.swap(true, Ordering::Relaxed) {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot write the shared payload file; workers on this host are streamed the weights");
        }
    }

    /// A buffer of the payload's size, its header written: a pooled one when there is one
    /// (a file a worker still reads is let go of: it is removed when the worker is done).
    fn buffer(self: &Arc<Self>) -> Pooled {
        let mut buffer = loop {
            let pooled = self.pool.lock().expect("pool lock").pop();
            match pooled {
                Some(Buffer::File(mut file)) => match file.claim() {
                    Ok(()) => break Buffer::File(file),
                    Err(e) => {
                        tracing::debug!(error = %e, "a payload file is still read; another is made")
                    }
                },
                Some(heap) => break heap,
                None => break self.fresh(),
            }
        };
        self.layout.write_header(buffer.as_mut_slice());
        Pooled {
            buffer,
            shared: self.clone(),
        }
    }
}

/// A buffer of the pool, back in it when dropped (unless the pool is full).
#[derive(Debug)]
struct Pooled {
    buffer: Buffer,
    shared: Arc<Shared>,
}

impl Pooled {
    /// Names a payload file `name` for the workers: the name, or `None` for a heap
    /// buffer or a rename that failed (that set is streamed).
    fn publish_file(&mut self, name: &str) -> Option<String> {
        let Buffer::File(file) = &mut self.buffer else {
            return None;
        };
        match file.publish(name) {
            Ok(()) => {
                self.shared.file_ok();
                Some(name.to_owned())
            }
            Err(e) => {
                let dir = self.shared.dir.clone().unwrap_or_default();
                self.shared.file_failed(&dir, &e);
                None
            }
        }
    }
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        self.buffer.as_slice()
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let buffer = std::mem::replace(&mut self.buffer, Buffer::Heap(Vec::new()));
        let mut pool = self.shared.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < POOL {
            pool.push(buffer);
        }
    }
}

/// A payload being written: one bfloat16 slot per parameter, in the order of the vars it
/// was made for.
#[derive(Debug)]
pub struct Payload {
    buf: Pooled,
    written: Vec<bool>,
}

impl Payload {
    /// Parameter `i`'s slot (marked written); `name` must be that parameter's.
    pub fn slot(&mut self, i: usize, name: &str) -> &mut [u8] {
        let shared = &self.buf.shared;
        assert_eq!(shared.names[i], name, "payload slot {i} is not `{name}`");
        self.written[i] = true;
        let range = shared.layout.slot(i);
        &mut self.buf.buffer.as_mut_slice()[range]
    }

    /// The payload's data section and every parameter's slot in it (bytes, in order), all
    /// marked written: for a writer that fills them all at once (the optimizer's
    /// multi-tensor step on a GPU, which copies the section out in one transfer). `names`
    /// must be the parameters' names in that order, as [`Payload::slot`] checks one.
    pub fn data_section<'a>(
        &mut self,
        names: impl ExactSizeIterator<Item = &'a str>,
    ) -> (&mut [u8], Vec<Range<usize>>) {
        let shared = &self.buf.shared;
        assert_eq!(
            names.len(),
            shared.names.len(),
            "payload slots: wrong count of names"
        );
        for (i, name) in names.enumerate() {
            assert_eq!(shared.names[i], name, "payload slot {i} is not `{name}`");
        }
        self.written.fill(true);
        let shared = &self.buf.shared;
        let start = shared.layout.data_start();
        let slots = (0..shared.names.len())
            .map(|i| {
                let r = shared.layout.slot(i);
                r.start - start..r.end - start
            })
            .collect();
        let end = shared.layout.len();
        (&mut self.buf.buffer.as_mut_slice()[start..end], slots)
    }

    /// Converts every parameter of `vars` whose slot was not written (no gradient this
    /// step, or no optimizer step at all).
    pub fn fill_rest(&mut self, vars: &[(String, Var)]) -> CandleResult<()> {
        for (i, (name, var)) in vars.iter().enumerate() {
            if self.written.get(i).copied().unwrap_or(true) {
                continue;
            }
            let values = var
                .as_tensor()
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?
                .to_vec1::<f32>()?;
            write_bf16_parallel(&values, self.slot(i, name));
        }
        Ok(())
    }

    /// Whether every slot is written.
    pub fn complete(&self) -> bool {
        self.written.iter().all(|&w| w)
    }
}

enum Job {
    Publish {
        run_id: String,
        version: u64,
        payload: Payload,
    },
    /// Answered once every payload sent before it is published (or dropped as overtaken).
    Flush(mpsc::SyncSender<()>),
}

/// Why a payload was not handed over.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    #[error("payload of version {0} has unwritten parameters")]
    Incomplete(u64),
    #[error("the weight export thread ended")]
    Ended,
}

/// Hashes and publishes payloads on its own thread.
#[derive(Debug)]
pub struct Exporter {
    shared: Arc<Shared>,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Exporter {
    /// An exporter for payloads of `vars` (names and shapes, in this order), publishing to
    /// `latest`; with `shared_dir`, each payload is a file there (see [`buffer`]).
    pub fn new(vars: &[(String, Var)], latest: Latest, shared_dir: Option<PathBuf>) -> Self {
        let shapes: Vec<(String, Vec<usize>)> = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.dims().to_vec()))
            .collect();
        let shared = Arc::new(Shared {
            layout: Layout::new(&shapes, &[("format", "pt")]),
            names: shapes.into_iter().map(|(n, _)| n).collect(),
            pool: Mutex::new(Vec::new()),
            dir: shared_dir,
            failing: AtomicBool::new(false),
        });
        let (jobs, rx) = mpsc::channel();
        let prefill = shared.clone();
        let thread = std::thread::Builder::new()
            .name("weight-export".into())
            .spawn(move || {
                prefill.prefill();
                drop(prefill);
                publish_loop(&rx, &latest);
            })
            .expect("spawn the weight export thread");
        Self {
            shared,
            jobs: Some(jobs),
            thread: Some(thread),
        }
    }

    /// An empty payload to write the next version into.
    pub fn payload(&self) -> Payload {
        Payload {
            buf: self.shared.buffer(),
            written: vec![false; self.shared.names.len()],
        }
    }

    /// Hands a complete `payload` over as version `version` of run `run_id`: hashed and
    /// published on the export thread. Returns at once.
    pub fn publish(&self, run_id: &str, version: u64, payload: Payload) -> Result<(), ExportError> {
        if !payload.complete() {
            return Err(ExportError::Incomplete(version));
        }
        self.send(Job::Publish {
            run_id: run_id.to_owned(),
            version,
            payload,
        })
    }

    /// Waits until every payload handed over so far is published.
    pub fn flush(&self) -> Result<(), ExportError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Job::Flush(tx))?;
        rx.recv().map_err(|_| ExportError::Ended)
    }

    /// Spare buffers in the pool now, ready for the next payloads.
    pub fn spare_buffers(&self) -> usize {
        self.shared.pool.lock().expect("pool lock").len()
    }

    fn send(&self, job: Job) -> Result<(), ExportError> {
        self.jobs
            .as_ref()
            .and_then(|j| j.send(job).ok())
            .ok_or(ExportError::Ended)
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The export thread: takes every job waiting, publishes the newest payload among them
/// (older ones are overtaken: their buffers go back to the pool), then answers flushes.
/// A payload file is named after its version once hashed, before the set is published.
fn publish_loop(rx: &mpsc::Receiver<Job>, latest: &Latest) {
    while let Ok(first) = rx.recv() {
        let mut newest = None;
        let mut flushes = Vec::new();
        for job in std::iter::once(first).chain(rx.try_iter()) {
            match job {
                Job::Publish {
                    run_id,
                    version,
                    payload,
                } => newest = Some((run_id, version, payload)),
                Job::Flush(done) => flushes.push(done),
            }
        }
        if let Some((run_id, version, payload)) = newest {
            let Payload { mut buf, .. } = payload;
            let blake3 = crate::set::hash(buf.as_ref());
            let shared_file = buf.publish_file(&shared_file_name(&run_id, version));
            let set = WeightSet {
                run_id,
                version,
                bytes: Bytes::from_owner(buf),
                blake3,
                shared_file,
            };
            latest.send_replace(Some(Arc::new(set)));
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}
