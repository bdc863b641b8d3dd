//! One training step after another: gather P scored groups, update the policy on them,
//! publish the new weight version, and say what the step did as a [`StepRecord`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rookworld_weights::export::Exporter;
use tokio::sync::watch;

use super::error::TrainError;
use super::gather::{Gathered, gather, to_batch};
use super::plan::Plan;
use super::report::{Reporter, StepRecord, StepSeconds};
use super::state::Run;
use super::watchdog::Watchdog;
use crate::checkpoint;
use crate::eval::periodic::Evaluator;
use crate::push::Fleet;
use rookworld_train::optim::Schedule;
use rookworld_train::step::{StepConfig, StepReport, Updater, step_flops};

/// How a step ended.
pub(super) enum Stepped {
    Trained(Box<StepRecord>),
    /// The shutdown signal came while it waited for groups.
    Stopped,
    /// No step for `--stall-timeout`: what the run was waiting on.
    Stalled(String),
}

/// What a step needs, step after step.
pub(super) struct Trainer<'a> {
    pub plan: &'a Plan,
    pub run: &'a mut Run,
    pub exporter: &'a Exporter,
    pub evaluator: Option<&'a Evaluator>,
    pub fleet: &'a Arc<Mutex<Fleet>>,
    pub reporter: &'a mut Reporter,
    pub schedule: Schedule,
    pub step_cfg: StepConfig,
    /// The FLOP/s a step's MFU is measured against.
    pub peak: f64,
    pub seeds: rand_chacha::ChaCha8Rng,
    pub stop: watch::Receiver<bool>,
    pub watchdog: Watchdog,
}

impl Trainer<'_> {
    /// Runs the next step: waits for its groups, trains on them, publishes the new version
    /// when it is due (every `--push-every` steps, the last, and before an evaluation).
    #[tracing::instrument(name = "step", skip_all, fields(step = self.run.step + 1))]
    pub async fn step(&mut self) -> Result<Stepped, TrainError> {
        let (plan, s) = (self.plan, &self.plan.settings);
        let started = Instant::now();
        let gathered = gather(
            self.run,
            s,
            &mut self.seeds,
            &mut self.stop,
            &mut self.watchdog,
            self.fleet,
        )
        .await;
        let (groups, dynamic_skipped) = match gathered {
            Gathered::Groups(groups, skipped) => (groups, skipped),
            Gathered::Stopped => return Ok(Stepped::Stopped),
            Gathered::Stalled(why) => return Ok(Stepped::Stalled(why)),
        };
        let wait = started.elapsed().as_secs_f64();
        let run = &mut *self.run;
        self.reporter.dump(run.step + 1, &groups)?;
        let version = run.version.load(Ordering::SeqCst);
        let batch = to_batch(&groups);
        let last = run.step + 1 == s.steps;
        let evaluating = self.evaluator.is_some() && plan.schedule.eval_due(run.step + 1, last);
        let publishing =
            (run.step + 1).is_multiple_of(plan.schedule.push_every) || last || evaluating;
        let mut payload = publishing.then(|| self.exporter.payload());
        let report = tokio::task::block_in_place(|| {
            Updater {
                policy: &run.policy,
                reference: run.reference.as_ref(),
                opt: &mut run.opt,
                schedule: &self.schedule,
                cfg: &self.step_cfg,
            }
            .updates(run.step, &batch, s.updates_per_batch, payload.as_mut())
        })?;
        run.step += 1;
        self.watchdog.stepped(Instant::now());
        let new_version = version + 1;
        run.version.store(new_version, Ordering::SeqCst);

        let push_started = Instant::now();
        if let Some(payload) = payload {
            // Recorded first, so a crash never reuses the number.
            checkpoint::record_published(&plan.outputs.run_dir, new_version)?;
            self.exporter.publish(&run.run_id, new_version, payload)?;
        }
        if let Some(ev) = self.evaluator.filter(|_| evaluating) {
            ev.request(run.step, new_version);
        }
        let push = push_started.elapsed().as_secs_f64();

        let mut record = StepRecord::of(run.step, version, &report, &groups);
        record.dynamic_skipped = dynamic_skipped;
        record.dropped_stale_total = run
            .queue
            .run(|q| q.depths().counters.groups_dropped_stale)
            .await;
        record.step_seconds = StepSeconds {
            total: started.elapsed().as_secs_f64(),
            wait,
            forward_backward: report.forward_backward_seconds,
            optimizer: report.optimizer_seconds,
            push,
        };
        record.mfu = self.mfu(&report, &batch);
        record.generated_tokens = batch.completions.iter().flatten().map(Vec::len).sum();
        record.pushed = self
            .fleet
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take_pushed();
        record.tokens_per_second =
            record.generated_tokens as f64 / record.step_seconds.total.max(1e-9);
        Ok(Stepped::Trained(Box::new(record)))
    }

    /// The step's model FLOPs over its compute time, against the peak. Each of the μ
    /// updates runs the forward/backward (and the reference) again.
    fn mfu(&self, report: &StepReport, batch: &rookworld_train::batch::GrpoBatch) -> f64 {
        let run = &*self.run;
        let with_reference = run.reference.is_some() && self.plan.settings.objective.beta > 0.0;
        let flops = f64::from(self.plan.settings.updates_per_batch)
            * step_flops(&run.policy.model, batch, with_reference);
        flops / (report.forward_backward_seconds + report.optimizer_seconds).max(1e-9) / self.peak
    }
}

/// `--peak-tflops`, or the device's estimate ([`rookworld_train::step::device_peak_flops`]): on
/// the CPU 64 (AVX-512) or 32 f32 FLOPs per cycle per core at 3 GHz, twice that for BF16
/// products; on CUDA the H100/H200 dense peak in the policy's matmul dtype (BF16 989, TF32
/// 495 TFLOP/s).
pub(super) fn peak_flops(plan: &Plan, model: &rookworld_lm::Gpt2) -> f64 {
    plan.outputs.peak_flops.unwrap_or_else(|| {
        rookworld_train::step::device_peak_flops(model.device(), model.matmul_dtype())
    })
}
