//! The weights a push sends, made without holding up the training thread.
//!
//! Publishing a version used to convert the whole model to a bfloat16 safetensors payload
//! and hash it on the training thread (0.4–1 s a step for gpt2-124m on two cores). Now:
//! - AdamW writes each parameter it updates as bfloat16 straight into its slot of a
//!   [`Payload`] ([`AdamW::step_exporting`](crate::optim::AdamW::step_exporting)): one
//!   store per parameter, in the pass the optimizer makes anyway;
//! - the [`Exporter`]'s own thread hashes the finished payload (BLAKE3) and hands the
//!   [`WeightSet`] to the weight sync, newest first (a payload overtaken by a newer one
//!   before it was hashed is dropped, never published after it);
//! - payload buffers are pooled: when the last push of a set (and the sync's handle on it)
//!   let go of its bytes, the buffer goes back to the pool, so a step writes into memory
//!   already mapped instead of faulting in a fresh 249 MB. Every worker's push sends
//!   slices of the one buffer; no copy per worker;
//! - with a shared directory (`--shared-dir`, the same-host path), the export thread also
//!   writes each payload there once, as a file of its own name (written aside, then
//!   renamed into place; the oldest written over when no worker reads it:
//!   [`SharedFiles`]); workers on this host read it instead of receiving the stream.

use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bytes::Bytes;
use candle_core::{DType, Device, Result as CandleResult, Var};
use rollout_worker::weights::WeightSet;
use rookworld_lm::bf16_payload::{Layout, write_bf16_parallel};
use tokio::sync::watch;

mod shared_files;
pub use shared_files::{KEEP_FILES, SharedFiles, process_dir};

/// Spare payload buffers kept for reuse.
const POOL: usize = 2;

/// Where the weight sync takes the newest published set from.
pub type Latest = Arc<watch::Sender<Option<Arc<WeightSet>>>>;

/// What payloads of one model share: the layout, the parameter names, the buffer pool.
#[derive(Debug)]
struct Shared {
    layout: Layout,
    names: Vec<String>,
    pool: Mutex<Vec<Vec<u8>>>,
}

impl Shared {
    /// Fills the pool with buffers whose pages are mapped: the first touch of 249 MB of new
    /// memory took 0.7 s on two cores, paid here at start instead of by a training step.
    fn prefill(&self) {
        for _ in 0..POOL {
            let mut bytes = vec![0u8; self.layout.len()];
            for page in bytes.chunks_mut(4096) {
                // SAFETY: a write of a byte inside the buffer; volatile, so it is not
                // elided as a write of the zero already there.
                unsafe { std::ptr::write_volatile(&mut page[0], 0) };
            }
            let mut pool = self.pool.lock().expect("pool lock");
            if pool.len() >= POOL {
                return;
            }
            pool.push(bytes);
        }
    }

    /// A buffer of the payload's size, its header written: a pooled one if there is one.
    fn buffer(&self) -> Vec<u8> {
        let pooled = self.pool.lock().expect("pool lock").pop();
        let mut bytes = pooled.unwrap_or_else(|| vec![0u8; self.layout.len()]);
        self.layout.write_header(&mut bytes);
        bytes
    }
}

/// A payload being written: one bfloat16 slot per parameter, in the order of the vars it
/// was made for.
#[derive(Debug)]
pub struct Payload {
    shared: Arc<Shared>,
    bytes: Vec<u8>,
    written: Vec<bool>,
}

impl Payload {
    /// Parameter `i`'s slot (marked written); `name` must be that parameter's.
    pub fn slot(&mut self, i: usize, name: &str) -> &mut [u8] {
        assert_eq!(
            self.shared.names[i], name,
            "payload slot {i} is not `{name}`"
        );
        self.written[i] = true;
        let range = self.shared.layout.slot(i);
        &mut self.bytes[range]
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

/// The bytes of a published set: a pooled buffer that goes back to the pool when the last
/// `Bytes` of it is dropped.
struct Pooled {
    bytes: Vec<u8>,
    shared: Arc<Shared>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let mut pool = self.shared.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < POOL {
            pool.push(std::mem::take(&mut self.bytes));
        }
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

/// Hashes and publishes payloads on its own thread.
#[derive(Debug)]
pub struct Exporter {
    shared: Arc<Shared>,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Exporter {
    /// An exporter for payloads of `vars` (names and shapes, in this order), publishing to
    /// `latest`, and writing each payload into `shared_dir` when given.
    pub fn new(vars: &[(String, Var)], latest: Latest, shared_dir: Option<PathBuf>) -> Self {
        let shapes: Vec<(String, Vec<usize>)> = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.dims().to_vec()))
            .collect();
        let shared = Arc::new(Shared {
            layout: Layout::new(&shapes, &[("format", "pt")]),
            names: shapes.into_iter().map(|(n, _)| n).collect(),
            pool: Mutex::new(Vec::new()),
        });
        let (jobs, rx) = mpsc::channel();
        let prefill = shared.clone();
        let thread = std::thread::Builder::new()
            .name("weight-export".into())
            .spawn(move || {
                prefill.prefill();
                let mut files = shared_dir.map(SharedFiles::new);
                publish_loop(&rx, &latest, files.as_mut());
                if let Some(files) = files {
                    files.remove_all();
                }
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
            bytes: self.shared.buffer(),
            written: vec![false; self.shared.names.len()],
            shared: self.shared.clone(),
        }
    }

    /// Hands a complete `payload` over as version `version` of run `run_id`: hashed and
    /// published on the export thread. Returns at once.
    pub fn publish(&self, run_id: &str, version: u64, payload: Payload) -> Result<(), String> {
        if !payload.complete() {
            return Err(format!(
                "payload of version {version} has unwritten parameters"
            ));
        }
        self.send(Job::Publish {
            run_id: run_id.to_owned(),
            version,
            payload,
        })
    }

    /// Waits until every payload handed over so far is published.
    pub fn flush(&self) -> Result<(), String> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Job::Flush(tx))?;
        rx.recv()
            .map_err(|_| "the weight export thread ended".to_owned())
    }

    fn send(&self, job: Job) -> Result<(), String> {
        self.jobs
            .as_ref()
            .and_then(|j| j.send(job).ok())
            .ok_or_else(|| "the weight export thread ended".to_owned())
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
fn publish_loop(rx: &mpsc::Receiver<Job>, latest: &Latest, mut files: Option<&mut SharedFiles>) {
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
            let Payload { shared, bytes, .. } = payload;
            let bytes = Bytes::from_owner(Pooled { bytes, shared });
            let mut set = WeightSet::from_shared(&run_id, version, bytes);
            if let Some(files) = files.as_deref_mut() {
                files.write(&mut set);
            }
            latest.send_replace(Some(Arc::new(set)));
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};
    use rookworld_lm::checkpoint::{self, init_random};
    use rookworld_lm::config::Config;

    use super::*;
    use crate::optim::{AdamW, AdamWConfig};
    use crate::policy::Trainable;

    fn gradients(policy: &Trainable, seed: u32) -> crate::optim::Gradients {
        let buffers = policy
            .vars
            .iter()
            .map(|(_, v)| {
                (0..v.elem_count())
                    .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / 4e9 - 0.5)
                    .collect()
            })
            .collect();
        policy.host_gradients(buffers)
    }

    #[test]
    fn the_optimizer_s_payload_equals_the_model_s_export_and_buffers_are_reused() {
        let model = init_random(&Config::tiny(), 5, DType::F32, &Device::Cpu).unwrap();
        let policy = Trainable::from_model(&model).unwrap();
        let (tx, mut rx) = watch::channel(None);
        let exporter = Exporter::new(&policy.vars, Arc::new(tx), None);
        let mut opt = AdamW::new(AdamWConfig::default());
        for version in 1..=3u64 {
            let mut payload = exporter.payload();
            let grads = gradients(&policy, version as u32);
            opt.step_exporting(&policy.vars, &grads, 1e-3, Some(&mut payload))
                .unwrap();
            payload.fill_rest(&policy.vars).unwrap();
            exporter.publish("run", version, payload).unwrap();
            exporter.flush().unwrap();
            let set = rx.borrow_and_update().clone().expect("published");
            assert_eq!(set.version, version);
            // Bit for bit what converting the updated model gives, hash included.
            let want = WeightSet::from_model(&policy.model, "run", version).unwrap();
            assert_eq!(set.blake3, want.blake3, "version {version}");
            assert_eq!(set.bytes, want.bytes);
            let back =
                checkpoint::from_bytes(&set.bytes, &Config::tiny(), DType::F32, &Device::Cpu);
            assert!(back.is_ok());
        }
        // Every set but the newest was let go of: their buffers are back in the pool.
        assert!(!exporter.shared.pool.lock().unwrap().is_empty());
        // An incomplete payload is refused, never published.
        let err = exporter.publish("run", 4, exporter.payload()).unwrap_err();
        assert!(err.contains("unwritten"), "{err}");
        assert_eq!(rx.borrow().as_ref().unwrap().version, 3);
    }

    #[test]
    fn a_step_without_gradients_still_exports_every_parameter() {
        let model = init_random(&Config::tiny(), 6, DType::F32, &Device::Cpu).unwrap();
        let policy = Trainable::from_model(&model).unwrap();
        let (tx, rx) = watch::channel(None);
        let exporter = Exporter::new(&policy.vars, Arc::new(tx), None);
        let mut payload = exporter.payload();
        payload.fill_rest(&policy.vars).unwrap();
        exporter.publish("run", 1, payload).unwrap();
        exporter.flush().unwrap();
        let set = rx.borrow().clone().unwrap();
        let want = WeightSet::from_model(&policy.model, "run", 1).unwrap();
        assert_eq!(set.blake3, want.blake3);
    }
}
