//! Where a run stands between steps — the policy, its optimizer, the reference, the prompt
//! cursor, the queue, the weight version — and its checkpoint, written from here.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rookworld_lm::Gpt2;
use rookworld_train::optim::{AdamW, Schedule};
use rookworld_train::policy::Trainable;

use crate::checkpoint::{self, CheckpointError, TrainerState};
use crate::eval::periodic::Outcome;
use crate::prompts::Source;
use crate::queue::QueueHandle;

/// Where the run stands.
pub(super) struct Run {
    pub policy: Trainable,
    pub reference: Option<Gpt2>,
    pub opt: AdamW,
    pub step: u64,
    pub source: Source,
    pub queue: QueueHandle,
    pub version: Arc<AtomicU64>,
    /// The run's id ([`crate::run_dir::run_id`]), carried by every push.
    pub run_id: String,
    pub settings_json: serde_json::Value,
    /// Whether it continues from a checkpoint.
    pub resumed: bool,
    /// The newest evaluation (`--eval-every`).
    pub eval: Option<Outcome>,
    /// `RUN/config.toml`'s text ([`crate::run_record`]), kept in every checkpoint.
    pub record: Option<String>,
    /// The run directory's lock, held until the run ends.
    pub _lock: crate::run_lock::RunLock,
}

impl Run {
    /// Writes a checkpoint under `run_dir`: weights, optimizer, cursor, `schedule` and the
    /// queue's unfinished prompts. Call it on a blocking thread (`block_in_place`): the
    /// queue's snapshot waits for the queue's thread.
    pub fn save(&self, run_dir: &Path, schedule: Schedule) -> Result<PathBuf, CheckpointError> {
        let state = TrainerState {
            step: self.step,
            version: self.version.load(Ordering::SeqCst),
            adamw: self.opt.cfg,
            optimizer_steps: self.opt.steps,
            schedule,
            cursor: self.source.cursor(),
            settings: self.settings_json.clone(),
            record: self.record.clone(),
            queue: Some(self.queue.call(|q| q.snapshot())),
            eval: self
                .eval
                .as_ref()
                .filter(|e| e.step == self.step)
                .map(|e| serde_json::to_value(e).expect("the evaluation serialises")),
        };
        checkpoint::save(run_dir, &self.policy, &self.opt, &state)
    }
}
