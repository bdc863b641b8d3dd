//! What a training step reports: the `--log-jsonl` record, the progress bar on a terminal
//! (plain log lines otherwise), the rollout dump, the Prometheus metrics and the
//! TensorBoard curves (`--tensorboard`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use metrics::{counter, gauge, histogram};
use rookworld_service::logging::Progress;
use serde::{Deserialize, Serialize};

use crate::eval::periodic::Outcome;
use crate::metrics::names;
use crate::queue::ScoredGroup;
use crate::tensorboard::EventWriter;
use rookworld_train::step::StepReport;

/// What a run did in this process.
#[derive(Debug, Default)]
pub struct TrainSummary {
    pub warm_up: Vec<crate::sft::SftStep>,
    pub steps: Vec<StepRecord>,
    /// Whether it stopped on the shutdown signal before its last step.
    pub interrupted: bool,
    /// The checkpoint written last.
    pub checkpoint: Option<std::path::PathBuf>,
    /// The evaluations (`--eval-every`), in the order they finished.
    pub evals: Vec<Outcome>,
    /// A resumed run had done all its steps already: what to do instead.
    pub already_done: Option<String>,
}

/// Where a step's wall time went, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepSeconds {
    pub total: f64,
    /// Waiting for enough scored groups.
    pub wait: f64,
    pub forward_backward: f64,
    pub optimizer: f64,
    /// BF16 conversion and hand-off of the weight push (the sending runs in background).
    pub push: f64,
}

/// One GRPO step (one `--log-jsonl` line).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    /// Weight version after the step.
    pub version: u64,
    pub reward_mean: f64,
    pub reward_std: f64,
    /// Mean of each reward component over the step's completions.
    pub reward_components: BTreeMap<String, f64>,
    pub loss: f64,
    pub policy_loss: f64,
    pub kl: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub clip_frac: f64,
    /// Of those, the shares clipped below 1 − ε (A < 0) and above 1 + ε (A > 0; for CISPO:
    /// weights truncated at 1 + ε_high).
    #[serde(default)]
    pub clip_low: f64,
    #[serde(default)]
    pub clip_high: f64,
    /// Groups without signal consumed and skipped while gathering the step's groups
    /// (`--dynamic-sampling`).
    #[serde(default)]
    pub dynamic_skipped: usize,
    /// The policy's mean entropy per token on the step's batch (nats), where measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<f64>,
    /// Completions left out of the loss as cut off (`--mask-truncated`).
    #[serde(default)]
    pub masked_truncated: usize,
    /// Completion tokens left out of the loss as sampled by weights past the staleness
    /// limit (`--max-version-lag`; an update that reached a worker mid-completion).
    #[serde(default)]
    pub masked_stale_tokens: usize,
    /// The workers' sampling log-probs against the learner's on the step's tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mismatch: Option<rookworld_train::offpolicy::Mismatch>,
    /// Completion tokens trained on (those of the groups not skipped).
    pub tokens: usize,
    /// Completion tokens the workers generated for the step's groups, skipped ones too.
    #[serde(default)]
    pub generated_tokens: usize,
    pub groups: usize,
    /// Groups whose rewards were all equal (no signal).
    pub skipped_groups: usize,
    /// Groups dropped as too stale, in total so far.
    pub dropped_stale_total: u64,
    pub step_seconds: StepSeconds,
    /// Mean weight-version lag of the step's groups.
    pub staleness_mean: f64,
    /// Model FLOPs of the step's forward/backward over the device's peak.
    pub mfu: f64,
    /// Generated completion tokens per second of the step's wall time.
    pub tokens_per_second: f64,
    /// Bytes the weight pushes that reached workers sent since the previous step, by kind
    /// (whole payloads, deltas, shared files).
    #[serde(default)]
    pub pushed: crate::push::PushBytes,
}

impl StepRecord {
    /// The record of step `step`, which trained on `groups` (gathered while the weights
    /// were at `version`) as `report` says, and made version `version + 1`: the loss and
    /// its parts, the groups' rewards and staleness. The timings, throughput and queue
    /// counters are the caller's to add.
    pub fn of(step: u64, version: u64, report: &StepReport, groups: &[ScoredGroup]) -> Self {
        let mut record = Self {
            step,
            version: version + 1,
            loss: report.loss,
            policy_loss: report.policy_loss,
            kl: report.kl,
            grad_norm: report.grad_norm,
            lr: report.lr,
            clip_frac: report.clip_frac,
            clip_low: report.clip_low,
            clip_high: report.clip_high,
            mismatch: report.mismatch,
            masked_truncated: report.masked_truncated,
            masked_stale_tokens: groups
                .iter()
                .flat_map(|g| &g.completions)
                .map(|c| c.stale_prefix)
                .sum(),
            entropy: report.entropy,
            tokens: report.tokens,
            groups: groups.len(),
            skipped_groups: report.skipped_groups,
            staleness_mean: groups
                .iter()
                .map(|g| version.saturating_sub(g.weight_version) as f64)
                .sum::<f64>()
                / groups.len().max(1) as f64,
            ..Self::default()
        };
        record.rewards_of(groups);
        record
    }

    /// The step's TensorBoard scalars: `train/<name>` (`train/reward`, `train/loss`, …;
    /// the sampler/learner figures where measured).
    pub fn scalars(&self) -> Vec<(String, f64)> {
        let s = self.step_seconds;
        let mut out: Vec<(String, f64)> = [
            ("reward", self.reward_mean),
            ("reward_std", self.reward_std),
            ("loss", self.loss),
            ("policy_loss", self.policy_loss),
            ("kl", self.kl),
            ("clip_frac", self.clip_frac),
            ("clip_low", self.clip_low),
            ("clip_high", self.clip_high),
            ("grad_norm", self.grad_norm),
            ("lr", self.lr),
            ("tokens_per_second", self.tokens_per_second),
            ("step_seconds", s.total),
            ("wait_seconds", s.wait),
            ("forward_backward_seconds", s.forward_backward),
            ("staleness", self.staleness_mean),
            ("mfu", self.mfu),
            (
                "skipped_groups",
                (self.skipped_groups + self.dynamic_skipped) as f64,
            ),
            ("dropped_stale_total", self.dropped_stale_total as f64),
        ]
        .into_iter()
        .map(|(name, v)| (format!("train/{name}"), v))
        .collect();
        if let Some(h) = self.entropy {
            out.push(("train/entropy".into(), h));
        }
        if let Some(m) = &self.mismatch {
            for (name, v) in [
                ("sampler_logp_diff_mean", m.logp_diff_mean),
                ("sampler_logp_diff_max", m.logp_diff_max),
                ("sampler_kl", m.sampler_kl),
                ("is_ess", m.ess),
            ] {
                out.push((format!("train/{name}"), v));
            }
        }
        for (name, v) in &self.reward_components {
            out.push((format!("train/reward_component/{name}"), *v));
        }
        let p = &self.pushed;
        if p.pushes > 0 {
            for (name, v) in [
                ("full", p.full),
                ("delta", p.delta),
                ("shared", p.shared),
                ("relayed", p.relayed),
                ("per_push", p.per_push()),
            ] {
                out.push((format!("push/bytes_{name}"), v as f64));
            }
        }
        out
    }

    /// Reward statistics of the step's groups (population std over every completion).
    pub fn rewards_of(&mut self, groups: &[ScoredGroup]) {
        let rewards: Vec<f64> = groups
            .iter()
            .flat_map(|g| g.completions.iter().map(|c| f64::from(c.reward)))
            .collect();
        let n = rewards.len().max(1) as f64;
        self.reward_mean = rewards.iter().sum::<f64>() / n;
        self.reward_std = (rewards
            .iter()
            .map(|r| (r - self.reward_mean).powi(2))
            .sum::<f64>()
            / n)
            .sqrt();
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        for c in groups.iter().flat_map(|g| &g.completions) {
            for (name, v) in &c.components {
                *sums.entry(name.clone()).or_default() += f64::from(*v);
            }
        }
        self.reward_components = sums.into_iter().map(|(k, v)| (k, v / n)).collect();
    }
}

/// Writes each step to the log file, the dump, the terminal or log, and the metrics.
pub struct Reporter {
    jsonl: Option<BufWriter<File>>,
    dump: Option<BufWriter<File>>,
    progress: Progress,
    tensorboard: Option<EventWriter>,
    /// Whether a step with nothing to learn from was explained (once a run).
    said_idle: bool,
}

/// A run's log or rollout dump could not be written: which file (with its flag), and why.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct ReportError {
    what: String,
    #[source]
    source: std::io::Error,
}

/// The error of writing `what` (a flag, a path).
fn at(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> ReportError {
    move |source| ReportError {
        what: what.to_string(),
        source,
    }
}

fn append(path: &Path, what: &str) -> Result<BufWriter<File>, ReportError> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map(BufWriter::new)
        .map_err(at(format_args!("{what} {}", path.display())))
}

/// Checks at start that `path` can be appended to (created if missing), so that a bad
/// path is refused before the warm-up, not after it.
pub(super) fn writable(path: &Path, what: &str) -> Result<(), ReportError> {
    // A file in a directory the run is to make (`runs/new/steps.jsonl`): made now.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(at(format_args!("{what} {}", dir.display())))?;
    }
    append(path, what).map(drop)
}

/// Keeps, in a JSONL file of step lines, only the lines of steps up to `step` (and none
/// that does not parse, such as a line torn by a crash): what a run resumed at `step` has
/// really done. Returns how many lines went.
fn roll_back(path: &Path, step: u64) -> Result<usize, ReportError> {
    use std::io::BufRead;
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(at(path.display())(e)),
    };
    #[derive(Deserialize)]
    struct Step {
        step: u64,
    }
    let tmp = path.with_extension("rollback.tmp");
    let mut out = File::create(&tmp)
        .map(BufWriter::new)
        .map_err(at(tmp.display()))?;
    let mut dropped = 0;
    for line in std::io::BufReader::new(file).split(b'\n') {
        let line = line.map_err(at(path.display()))?;
        match serde_json::from_slice::<Step>(&line) {
            Ok(s) if s.step <= step => {
                out.write_all(&line)
                    .and_then(|()| out.write_all(b"\n"))
                    .map_err(at(tmp.display()))?;
            }
            _ => dropped += 1,
        }
    }
    out.flush().map_err(at(tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(at(path.display()))?;
    Ok(dropped)
}

impl Reporter {
    /// Opens the log and the dump for appending; with `roll_back` (a run resumed at
    /// `first_step`, or one started over at 0) both first lose the steps after it. A new
    /// TensorBoard event file in `tensorboard` starts at the step after `first_step` (one
    /// that cannot be made is logged, and the run goes on without).
    pub fn new(
        jsonl: Option<&Path>,
        dump: Option<&Path>,
        tensorboard: Option<&Path>,
        progress: bool,
        total_steps: u64,
        first_step: u64,
        roll_back: bool,
    ) -> Result<Self, ReportError> {
        if roll_back {
            for path in [jsonl, dump].into_iter().flatten() {
                let dropped = self::roll_back(path, first_step)?;
                if dropped > 0 {
                    tracing::warn!(file = %path.display(), lines = dropped, step = first_step, "rolled back to the checkpoint's step (lines of steps the resumed run redoes)");
                }
            }
        }
        let jsonl = jsonl.map(|p| append(p, "--log-jsonl")).transpose()?;
        let dump = dump.map(|p| append(p, "--rollout-dump")).transpose()?;
        let tensorboard = tensorboard.and_then(|dir| {
            EventWriter::create(dir, first_step + 1)
                .inspect(|w| tracing::info!(file = %w.path().display(), "TensorBoard event file"))
                .map_err(|e| tracing::warn!(error = %e, "--tensorboard: no TensorBoard events this run (training goes on)"))
                .ok()
        });
        Ok(Self {
            jsonl,
            dump,
            progress: Progress::new("step", first_step, total_steps, progress),
            tensorboard,
            said_idle: false,
        })
    }

    /// Appends the step's groups to the rollout dump.
    pub fn dump(&mut self, step: u64, groups: &[ScoredGroup]) -> Result<(), ReportError> {
        let Some(f) = self.dump.as_mut() else {
            return Ok(());
        };
        #[derive(Serialize)]
        struct Line<'a> {
            step: u64,
            #[serde(flatten)]
            group: &'a ScoredGroup,
        }
        for group in groups {
            let line = serde_json::to_string(&Line { step, group }).expect("group serialises");
            writeln!(f, "{line}").map_err(at("--rollout-dump"))?;
        }
        f.flush().map_err(at("--rollout-dump"))
    }

    pub fn step(&mut self, r: &StepRecord) -> Result<(), ReportError> {
        record_metrics(r);
        if r.tokens == 0 && !self.said_idle {
            self.said_idle = true;
            tracing::warn!(
                step = r.step,
                "nothing to learn from in this step: every group's completions scored alike{}; until they differ the policy does not move (a model that cannot yet write the tasks' format needs the supervised warm-up, --sft-steps, or a trained --model)",
                if r.reward_mean <= -1.0 && r.reward_std == 0.0 {
                    " (reward −1: none in the tasks' format, empty or cut off)"
                } else {
                    ""
                }
            );
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.scalars(r.step, r.scalars());
        }
        if let Some(f) = self.jsonl.as_mut() {
            let line = serde_json::to_string(r).expect("record serialises");
            writeln!(f, "{line}")
                .and_then(|()| f.flush())
                .map_err(at("--log-jsonl"))?;
        }
        if self.progress.on_terminal() {
            let detail = format!(
                "reward {:+.3} ±{:.3}  kl {:.4}  loss {:+.4}  {:.0} tok/s",
                r.reward_mean, r.reward_std, r.kl, r.loss, r.tokens_per_second
            );
            self.progress.update(r.step, &detail);
        } else {
            tracing::info!(
                step = r.step,
                reward_mean = format!("{:.4}", r.reward_mean),
                reward_std = format!("{:.4}", r.reward_std),
                loss = format!("{:.5}", r.loss),
                kl = format!("{:.5}", r.kl),
                grad_norm = format!("{:.4}", r.grad_norm),
                lr = format!("{:.3e}", r.lr),
                clip_frac = format!("{:.3}", r.clip_frac),
                tokens = r.tokens,
                seconds = format!("{:.2}", r.step_seconds.total),
                wait = format!("{:.2}", r.step_seconds.wait),
                staleness = format!("{:.2}", r.staleness_mean),
                pushed = %r.pushed,
                "step"
            );
        }
        Ok(())
    }

    /// Writes an evaluation's line to the log and sets its metrics.
    pub fn eval(&mut self, e: &crate::eval::periodic::Outcome) -> Result<(), ReportError> {
        e.record_metrics();
        if let Some(tb) = self.tensorboard.as_mut() {
            let seconds = ("eval/seconds".to_owned(), e.seconds);
            tb.scalars(e.step, e.flat().into_iter().chain([seconds]));
        }
        if let Some(f) = self.jsonl.as_mut() {
            writeln!(f, "{}", e.json_line())
                .and_then(|()| f.flush())
                .map_err(at("--log-jsonl"))?;
        }
        Ok(())
    }

    /// Ends the progress line (before other output).
    pub fn finish(&mut self) {
        self.progress.finish();
    }
}

fn record_metrics(r: &StepRecord) {
    counter!(names::STEPS_TOTAL).increment(1);
    gauge!(names::WEIGHT_VERSION).set(r.version as f64);
    gauge!(names::REWARD_MEAN).set(r.reward_mean);
    gauge!(names::REWARD_STD).set(r.reward_std);
    for (name, v) in &r.reward_components {
        gauge!(names::REWARD_COMPONENT, "component" => name.clone()).set(*v);
    }
    gauge!(names::LOSS).set(r.loss);
    gauge!(names::POLICY_LOSS).set(r.policy_loss);
    gauge!(names::KL).set(r.kl);
    gauge!(names::GRAD_NORM).set(r.grad_norm);
    gauge!(names::LR).set(r.lr);
    gauge!(names::CLIPPED_TOKENS_RATIO).set(r.clip_frac);
    gauge!(names::CLIPPED_LOW_RATIO).set(r.clip_low);
    gauge!(names::CLIPPED_HIGH_RATIO).set(r.clip_high);
    if let Some(h) = r.entropy {
        gauge!(names::POLICY_ENTROPY).set(h);
    }
    if let Some(m) = &r.mismatch {
        gauge!(names::SAMPLER_LOGP_DIFF_MEAN).set(m.logp_diff_mean);
        gauge!(names::SAMPLER_LOGP_DIFF_MAX).set(m.logp_diff_max);
        gauge!(names::SAMPLER_KL).set(m.sampler_kl);
        gauge!(names::IS_WEIGHT_MIN).set(m.is_min);
        gauge!(names::IS_WEIGHT_MEAN).set(m.is_mean);
        gauge!(names::IS_WEIGHT_MAX).set(m.is_max);
        gauge!(names::IS_BOUNDED_RATIO).set(m.is_bounded);
        gauge!(names::IS_ESS_RATIO).set(m.ess);
    }
    gauge!(names::STALENESS_MEAN_VERSIONS).set(r.staleness_mean);
    gauge!(names::MFU_RATIO).set(r.mfu);
    counter!(names::TOKENS_TOTAL).increment(r.tokens as u64);
    counter!(names::GROUPS_SKIPPED_TOTAL).increment((r.skipped_groups + r.dynamic_skipped) as u64);
    counter!(names::COMPLETIONS_MASKED_TRUNCATED_TOTAL).increment(r.masked_truncated as u64);
    counter!(names::TOKENS_MASKED_STALE_TOTAL).increment(r.masked_stale_tokens as u64);
    let s = r.step_seconds;
    for (phase, v) in [
        ("wait", s.wait),
        ("forward_backward", s.forward_backward),
        ("optimizer", s.optimizer),
        ("push", s.push),
        ("total", s.total),
    ] {
        histogram!(names::STEP_SECONDS, "phase" => phase).record(v);
    }
}

/// The run's outcome on stdout: warm-up loss, first and last 20% of steps' mean reward.
pub fn print_summary(summary: &TrainSummary) {
    if let Some(line) = &summary.already_done {
        println!("{line}");
    }
    if let (Some(first), Some(last)) = (summary.warm_up.first(), summary.warm_up.last()) {
        println!(
            "warm-up: {} steps, loss {:.3} -> {:.3}",
            summary.warm_up.len(),
            first.loss,
            last.loss
        );
    }
    if let Some((early, late)) = reward_trend(&summary.steps) {
        println!(
            "GRPO: {} steps, mean reward first 20% {early:.4}, last 20% {late:.4} ({:+.4})",
            summary.steps.len(),
            late - early
        );
    }
    if let Some(meaning) = trend_meaning(&summary.steps) {
        println!("  {meaning}");
    }
    if let Some(dir) = &summary.checkpoint {
        println!("checkpoint: {}", dir.display());
    }
}

/// What a run's reward trend ([`reward_trend`]) shows, in one line: that most steps had
/// nothing to learn from (every group's completions scored alike — for a model that cannot
/// yet write the tasks' format, all −1), or whether the change between the first and the
/// last 20% is beyond the step-to-step noise: twice the standard error of the difference of
/// two windows' means, `2·s·√(2/k)` for the steps' reward standard deviation `s` and `k`
/// steps a window.
pub fn trend_meaning(steps: &[StepRecord]) -> Option<String> {
    let (early, late) = reward_trend(steps)?;
    let n = steps.len();
    let idle = steps.iter().filter(|r| r.tokens == 0).count();
    if idle * 2 >= n {
        let unformatted = steps
            .iter()
            .filter(|r| r.tokens == 0)
            .all(|r| r.reward_mean <= -1.0 && r.reward_std == 0.0);
        return Some(format!(
            "{idle} of {n} steps had nothing to learn from: every group's completions scored alike{}; the model cannot yet write what the tasks ask — start from the supervised warm-up (--sft-steps) or a trained --model",
            if unformatted {
                " (−1: none in the tasks' format, empty or cut off)"
            } else {
                ""
            }
        ));
    }
    if n < 2 {
        return None;
    }
    let k = (n / 5).max(1) as f64;
    let mean = steps.iter().map(|r| r.reward_mean).sum::<f64>() / n as f64;
    let var = steps
        .iter()
        .map(|r| (r.reward_mean - mean).powi(2))
        .sum::<f64>()
        / (n - 1) as f64;
    let noise = 2.0 * var.sqrt() * (2.0 / k).sqrt();
    let change = late - early;
    Some(if change.abs() <= noise {
        format!(
            "the change is within the step-to-step noise (±{noise:.4}): {n} steps show no trend yet; a longer run (the default's 100 steps) shows whether the reward rises"
        )
    } else if change > 0.0 {
        format!("the rise is beyond the step-to-step noise (±{noise:.4})")
    } else {
        format!("the fall is beyond the step-to-step noise (±{noise:.4})")
    })
}

/// Mean reward over the first and the last 20% of `steps` (at least one step each).
pub fn reward_trend(steps: &[StepRecord]) -> Option<(f64, f64)> {
    if steps.is_empty() {
        return None;
    }
    let k = (steps.len() / 5).max(1);
    let mean = |s: &[StepRecord]| s.iter().map(|r| r.reward_mean).sum::<f64>() / s.len() as f64;
    Some((mean(&steps[..k]), mean(&steps[steps.len() - k..])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: super::super::config::TrainArgs,
    }

    fn steps(rewards: &[f64], tokens: usize) -> Vec<StepRecord> {
        rewards
            .iter()
            .enumerate()
            .map(|(i, &reward_mean)| StepRecord {
                step: i as u64 + 1,
                reward_mean,
                tokens,
                ..StepRecord::default()
            })
            .collect()
    }

    #[test]
    fn a_short_run_says_what_its_reward_change_shows() {
        // A model that cannot write the format: every completion −1, nothing to learn.
        let idle = steps(&[-1.0; 10], 0);
        let line = trend_meaning(&idle).unwrap();
        assert!(
            line.starts_with("10 of 10 steps had nothing to learn from")
                && line.contains("(−1: none in the tasks' format")
                && line.contains("--sft-steps"),
            "{line}"
        );
        // Noise: +0.017 over 30 steps whose rewards swing ±0.2.
        let swing: Vec<f64> = (0..30)
            .map(|i| -0.5 + if i % 2 == 0 { 0.2 } else { -0.2 } + i as f64 * 0.0006)
            .collect();
        let line = trend_meaning(&steps(&swing, 100)).unwrap();
        assert!(
            line.starts_with("the change is within the step-to-step noise (±"),
            "{line}"
        );
        assert!(line.contains("30 steps show no trend yet"), "{line}");
        // A steady rise well beyond it.
        let rise: Vec<f64> = (0..60).map(|i| -0.8 + i as f64 * 0.01).collect();
        let line = trend_meaning(&steps(&rise, 100)).unwrap();
        assert!(
            line.starts_with("the rise is beyond the step-to-step noise"),
            "{line}"
        );
        assert_eq!(trend_meaning(&[]), None);
    }

    #[test]
    fn a_step_gives_its_curves_and_the_gap_only_where_measured() {
        let mut r = StepRecord {
            reward_mean: -0.25,
            loss: 0.5,
            reward_components: [("format".to_owned(), 0.75)].into(),
            ..StepRecord::default()
        };
        let tags = |r: &StepRecord| -> BTreeMap<String, f64> { r.scalars().into_iter().collect() };
        let t = tags(&r);
        assert_eq!(t["train/reward"], -0.25);
        assert_eq!(t["train/loss"], 0.5);
        assert_eq!(t["train/reward_component/format"], 0.75);
        for tag in ["train/kl", "train/clip_frac", "train/grad_norm", "train/lr"] {
            assert!(t.contains_key(tag), "{tag}");
        }
        assert!(!t.contains_key("train/sampler_logp_diff_mean"));
        r.mismatch = Some(rookworld_train::offpolicy::Mismatch {
            logp_diff_mean: 0.03,
            ..Default::default()
        });
        assert_eq!(tags(&r)["train/sampler_logp_diff_mean"], 0.03);
        assert!(
            !t.contains_key("push/bytes_delta"),
            "no push, no push curves"
        );
        r.pushed = crate::push::PushBytes {
            pushes: 2,
            full: 1000,
            delta: 100,
            shared: 0,
            relayed: 0,
        };
        let t = tags(&r);
        assert_eq!(
            (
                t["push/bytes_full"],
                t["push/bytes_delta"],
                t["push/bytes_per_push"]
            ),
            (1000.0, 100.0, 550.0)
        );
        assert_eq!(
            r.pushed.to_string(),
            "2 pushes, 550 B each: 1.0 kB full, 100 B delta"
        );
    }

    #[test]
    fn the_curves_go_under_the_run_with_local_elsewhere_only_when_asked() {
        let dir = |argv: &[&str]| {
            let argv = ["train", "--run-dir", "RUN"].iter().chain(argv);
            Cli::parse_from(argv).args.tensorboard_dir()
        };
        assert_eq!(dir(&["--local"]), Some("RUN/tensorboard".into()));
        assert_eq!(dir(&["--local", "--tensorboard", "off"]), None);
        assert_eq!(dir(&["--local", "--tensorboard", "tb"]), Some("tb".into()));
        assert_eq!(dir(&[]), None);
        assert_eq!(dir(&["--tensorboard", "tb"]), Some("tb".into()));
    }
}
