//! One optimizer step on a batch of groups, in micro-batches whose gradients add up to
//! the full batch's.

use std::ops::DerefMut;
use std::time::Instant;

use crate::{Activations, Backend, Weights};
use candle_core::Result as CandleResult;
use rookworld_lm::Gpt2;
use rookworld_weights::export::Payload;
use serde::Serialize;

use crate::batch::{GrpoBatch, Layout};
use crate::fused::micro_batch::{MicroBatch, micro_step, reference_logprobs};
use crate::fused::{self, Params, Workspace};
use crate::grpo::Aggregation;
use crate::loss::{LossConfig, grpo_loss};
use crate::optim::{AdamW, Gradients, Schedule};
use crate::policy::{Pass, Trainable};

/// How a step is run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepConfig {
    pub loss: LossConfig,
    /// Prompts (groups) per micro-batch; the step's gradient is their weighted sum.
    pub micro_batch_groups: usize,
    /// Global gradient-norm bound.
    pub max_grad_norm: f64,
}

/// What one step did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepReport {
    pub loss: f64,
    pub policy_loss: f64,
    pub kl: f64,
    /// Before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    pub clip_frac: f64,
    /// Shares of tokens clipped below 1 − ε (A < 0) and above 1 + ε (A > 0).
    pub clip_low: f64,
    pub clip_high: f64,
    /// The sampler against the learner over the step's tokens (batches with the sampler's
    /// log-probs).
    pub mismatch: Option<crate::offpolicy::Mismatch>,
    /// Completions left out of the loss as cut off at the token budget.
    pub masked_truncated: usize,
    /// The policy's mean entropy per counted token, nats (fused pass only).
    pub entropy: Option<f64>,
    pub tokens: usize,
    pub skipped_groups: usize,
    pub forward_backward_seconds: f64,
    pub optimizer_seconds: f64,
    /// The fused pass's split of `forward_backward_seconds` (0 on the candle path):
    /// reference forward, policy forward, loss + backward.
    pub reference_seconds: f64,
    pub forward_seconds: f64,
    pub backward_seconds: f64,
    /// Largest activation plan of a micro-batch (bytes; fused pass only).
    pub activation_bytes: usize,
}

/// Gradients of the whole batch, accumulated over micro-batches: micro-batch k's loss is
/// weighted by its share of the batch (completions for sequence aggregation, tokens for
/// token aggregation), so the sum is the full batch's loss and gradient.
pub fn accumulate(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    batch: &GrpoBatch,
    cfg: &StepConfig,
) -> CandleResult<(Gradients, StepReport)> {
    match policy.pass() {
        Pass::FusedCpu => accumulate_fused(policy, reference, batch, cfg),
        #[cfg(feature = "cuda")]
        Pass::FusedCuda => accumulate_fused_cuda(policy, reference, batch, cfg),
        #[cfg(not(feature = "cuda"))]
        Pass::FusedCuda => candle_core::bail!("the fused pass on CUDA needs the cuda feature"),
        Pass::Autograd => accumulate_autograd(policy, reference, batch, cfg),
    }
}

/// A micro-batch's part of the step: its completions, those of them masked as cut off,
/// those with a token counted in the loss, and the tokens its loss counts.
#[derive(Debug, Clone, Copy)]
struct Share {
    completions: usize,
    masked_truncated: usize,
    sequences: usize,
    tokens: usize,
}

impl Share {
    /// n_k, the micro-batch's weight before normalising (its loss's own denominator):
    /// the completions it counts (sequence), all its completions (constant: each divides
    /// by the token budget), or its tokens (token).
    fn size(self, aggregation: Aggregation) -> f64 {
        match aggregation {
            Aggregation::Sequence => self.sequences as f64,
            Aggregation::Constant => self.completions as f64,
            Aggregation::Token => self.tokens as f64,
        }
    }
}

/// What one micro-batch's pass gives back for the step's report.
#[derive(Debug, Default)]
struct MicroOutcome {
    policy_loss: f64,
    kl: f64,
    /// Shares of the micro-batch's tokens clipped below and above.
    clip_low: f64,
    clip_high: f64,
    mismatch: Option<crate::offpolicy::Mismatch>,
    /// Σ of the policy's entropy over the counted tokens (fused pass only).
    entropy_sum: Option<f64>,
    forward_seconds: f64,
    backward_seconds: f64,
    activation_bytes: usize,
}

/// The accumulation both passes run. The batch is cut into micro-batches of
/// `cfg.micro_batch_groups` groups (`prepare` gives `None` for one without signal); each
/// is run at weight `w_k = n_k / Σ_j n_j` ([`Share::size`]), so that
/// `Σ_k w_k · L_k = L` and `Σ_k w_k · ∇L_k = ∇L`, the full batch's loss and gradient
/// (`w_k = 0` when nothing counts). `run(m, w_k)` computes micro-batch m's loss scaled by
/// `w_k` and adds its gradient to the pass's accumulator.
fn accumulate_micro_batches<M>(
    batch: &GrpoBatch,
    cfg: &StepConfig,
    mut prepare: impl FnMut(&GrpoBatch) -> CandleResult<Option<M>>,
    share: impl Fn(&M) -> (Share, usize),
    mut run: impl FnMut(&M, f64) -> CandleResult<MicroOutcome>,
) -> CandleResult<StepReport> {
    let micro = cfg.micro_batch_groups.max(1);
    let mut micros = Vec::new();
    for start in (0..batch.prompts.len()).step_by(micro) {
        micros.extend(prepare(&slice(batch, start, micro))?);
    }
    let kept: usize = micros.iter().map(|m| share(m).1).sum();
    let mut report = StepReport {
        skipped_groups: batch.prompts.len() - kept,
        ..StepReport::default()
    };
    let aggregation = cfg.loss.aggregation;
    let total: f64 = micros.iter().map(|m| share(m).0.size(aggregation)).sum();
    for m in &micros {
        let (s, _) = share(m);
        let w = if total > 0.0 {
            s.size(aggregation) / total
        } else {
            0.0
        };
        let r = run(m, w)?;
        report.policy_loss += w * r.policy_loss;
        report.kl += w * r.kl;
        report.clip_low += r.clip_low * s.tokens as f64;
        report.clip_high += r.clip_high * s.tokens as f64;
        merge(&mut report.mismatch, r.mismatch);
        report.masked_truncated += s.masked_truncated;
        if let Some(h) = r.entropy_sum {
            *report.entropy.get_or_insert(0.0) += h;
        }
        report.tokens += s.tokens;
        report.forward_seconds += r.forward_seconds;
        report.backward_seconds += r.backward_seconds;
        report.activation_bytes = report.activation_bytes.max(r.activation_bytes);
    }
    report.close(cfg.loss.beta);
    Ok(report)
}

/// [`accumulate`] through candle's autograd on the plain model (every device and dtype;
/// the fused pass is checked against it).
pub fn accumulate_autograd(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    batch: &GrpoBatch,
    cfg: &StepConfig,
) -> CandleResult<(Gradients, StepReport)> {
    let pad = policy.model.config().eos_token_id;
    let device = policy.model.device();
    let scale = cfg.loss.advantage_norm.scale(&batch.rewards);
    let mut grads = Gradients::default();
    let started = Instant::now();
    let mut report = accumulate_micro_batches(
        batch,
        cfg,
        |part| Layout::new(part, scale, pad, cfg.loss.mask_truncated, device),
        |l: &Layout| {
            let completions = l.advantages.dims().first().copied().unwrap_or(0);
            let share = Share {
                completions,
                masked_truncated: l.masked_truncated,
                sequences: l.sequences,
                tokens: l.tokens,
            };
            (share, l.group_advantages.len())
        },
        |layout, w| {
            let out = grpo_loss(&policy.model, reference, layout, &cfg.loss)?;
            let store = (out.loss * w)?.backward()?;
            grads.accumulate(&store, &policy.vars)?;
            Ok(MicroOutcome {
                policy_loss: out.policy_loss,
                kl: out.kl,
                clip_low: out.clip_low,
                clip_high: out.clip_high,
                mismatch: out.mismatch,
                ..MicroOutcome::default()
            })
        },
    )?;
    report.forward_backward_seconds = started.elapsed().as_secs_f64();
    Ok((grads, report))
}

impl StepReport {
    /// Makes the sums over micro-batches the step's: the loss from its parts, the clip
    /// shares and the entropy per counted token.
    fn close(&mut self, beta: f64) {
        self.loss = self.policy_loss + beta * self.kl;
        let n = self.tokens.max(1) as f64;
        self.clip_low /= n;
        self.clip_high /= n;
        self.clip_frac = self.clip_low + self.clip_high;
        if let Some(h) = self.entropy.as_mut() {
            *h /= n;
        }
    }
}

fn merge(into: &mut Option<crate::offpolicy::Mismatch>, part: Option<crate::offpolicy::Mismatch>) {
    if let Some(part) = part {
        into.get_or_insert_with(Default::default).merge(&part);
    }
}

/// Groups per reference forward of the fused pass (it keeps no activations, so it can
/// take more rows than a training micro-batch).
const REFERENCE_GROUPS: usize = 4;

/// [`accumulate`] on the fused pass on the CPU ([`crate::fused`]): the same micro-batches
/// and weights, each group's prompt computed once.
fn accumulate_fused(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    batch: &GrpoBatch,
    cfg: &StepConfig,
) -> CandleResult<(Gradients, StepReport)> {
    let policy_tensors = policy.tensors();
    let ref_tensors = reference.map(fused::micro_batch::model_tensors);
    let model_cfg = policy.model.config();
    let matmuls = policy.fused_matmuls();
    let params = Params::new(&policy_tensors, model_cfg)?.with_matmuls(matmuls);
    let ref_params = match &ref_tensors {
        Some(t) => Some(Params::new(t, model_cfg)?.with_matmuls(matmuls)),
        None => None,
    };
    let ref_weights = ref_params.as_ref().map(Params::weights);
    let mut work = policy.workspace.lock().expect("workspace lock");
    let mut grads = work.zeroed_grads(&params);
    let Workspace {
        policy: acts,
        reference: ref_acts,
        ..
    } = &mut *work;
    let (report, ran) = fused_micro_batches(
        &policy.fused_backend(),
        (&params.weights(), acts),
        ref_weights.as_ref().map(|w| (w, ref_acts)),
        &mut grads,
        model_cfg.eos_token_id,
        batch,
        cfg,
    )?;
    drop(work);
    let out = if ran {
        policy.host_gradients(grads)
    } else {
        Gradients::default()
    };
    Ok((out, report))
}

/// [`accumulate`] on the fused pass on CUDA ([`crate::fused::cuda`]): the CPU's sequence
/// on the CUDA backend, its gradients f32 tensors on the device for the optimizer.
#[cfg(feature = "cuda")]
fn accumulate_fused_cuda(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    batch: &GrpoBatch,
    cfg: &StepConfig,
) -> CandleResult<(Gradients, StepReport)> {
    let policy_tensors = policy.tensors();
    let ref_tensors = reference.map(fused::micro_batch::model_tensors);
    let model_cfg = policy.model.config();
    let mut work = policy.workspace.lock().expect("workspace lock");
    let workspace = work.cuda.get_or_insert_with(Default::default);
    let eot = model_cfg.eos_token_id;
    let ((report, ran), grads) = fused::cuda::with_pass(
        workspace,
        (policy.model.device(), policy.step_kernels()),
        model_cfg,
        (&policy_tensors, ref_tensors.as_deref()),
        |b, policy, reference, grads| {
            fused_micro_batches(b, policy, reference, grads, eot, batch, cfg)
        },
    )?;
    drop(work);
    let out = if ran {
        policy.device_gradients(grads)
    } else {
        Gradients::default()
    };
    Ok((out, report))
}

/// The fused pass's part of [`accumulate`] on backend `b`: the reference's log-probs over
/// several micro-batches at once (with β > 0 and a reference), then every micro-batch's
/// loss and gradients added to `grads`. Also says whether any micro-batch ran.
fn fused_micro_batches<B: Backend, G: DerefMut<Target = B::Buf>>(
    b: &B,
    (params, acts): (&Weights<B>, &mut Activations<B>),
    reference: Option<(&Weights<B>, &mut Activations<B>)>,
    grads: &mut [G],
    eot: u32,
    batch: &GrpoBatch,
    cfg: &StepConfig,
) -> CandleResult<(StepReport, bool)> {
    let micro = cfg.micro_batch_groups.max(1);
    let scale = cfg.loss.advantage_norm.scale(&batch.rewards);
    let truncated_without = cfg.loss.mask_truncated.then_some(eot);
    let started = Instant::now();
    // The reference over several micro-batches at once, then split by micro-batch.
    let ref_logp = match reference {
        Some((r, ref_acts)) if cfg.loss.beta > 0.0 => {
            let mut all = Vec::new();
            for start in (0..batch.prompts.len()).step_by(REFERENCE_GROUPS.max(micro)) {
                let chunk = slice(batch, start, REFERENCE_GROUPS.max(micro));
                if let Some(m) = MicroBatch::new(&chunk, scale, None) {
                    all.extend(reference_logprobs(b, r, &m, &cfg.loss, ref_acts)?);
                }
            }
            Some(all)
        }
        _ => None,
    };
    let reference_seconds = started.elapsed().as_secs_f64();
    let (mut offset, mut ran) = (0, false);
    let mut report = accumulate_micro_batches(
        batch,
        cfg,
        |part| Ok(MicroBatch::new(part, scale, truncated_without)),
        |m: &MicroBatch| {
            let share = Share {
                completions: m.completions(),
                masked_truncated: m.masked_truncated(),
                sequences: m.sequences(),
                tokens: m.counted_tokens,
            };
            (share, m.group_advantages.len())
        },
        |m, w| {
            let r_logp = ref_logp.as_ref().map(|r| &r[offset..offset + m.tokens]);
            offset += m.tokens;
            ran = true;
            let r = micro_step(b, params, r_logp, m, &cfg.loss, w, grads, acts)?;
            Ok(MicroOutcome {
                policy_loss: r.policy_loss,
                kl: r.kl,
                clip_low: r.clip_low,
                clip_high: r.clip_high,
                mismatch: r.mismatch,
                entropy_sum: Some(r.entropy_sum),
                forward_seconds: r.forward_seconds,
                backward_seconds: r.backward_seconds,
                activation_bytes: r.activation_bytes,
            })
        },
    )?;
    report.reference_seconds = reference_seconds;
    report.forward_backward_seconds = started.elapsed().as_secs_f64();
    Ok((report, ran))
}

/// What an optimizer step updates, and how: the policy, the frozen reference, AdamW at
/// its schedule's rate, and the step's configuration.
pub struct Updater<'a> {
    pub policy: &'a Trainable,
    pub reference: Option<&'a Gpt2>,
    pub opt: &'a mut AdamW,
    pub schedule: &'a Schedule,
    pub cfg: &'a StepConfig,
}

impl Updater<'_> {
    /// A full step: gradients, clipping, AdamW at the schedule's rate for `step`; with
    /// `export`, the updated weights are also written into it as bfloat16 (see
    /// [`rookworld_weights::export`]).
    pub fn step(
        &mut self,
        step: u64,
        batch: &GrpoBatch,
        export: Option<&mut Payload>,
    ) -> CandleResult<StepReport> {
        let (policy, cfg) = (self.policy, self.cfg);
        let (mut grads, mut report) = accumulate(policy, self.reference, batch, cfg)?;
        let started = Instant::now();
        report.grad_norm = grads.clip(cfg.max_grad_norm, policy.model.kernels())?;
        report.lr = self.schedule.lr_at(step);
        let mut export = export;
        if report.tokens > 0 {
            self.opt.step_exporting(
                &policy.vars,
                &grads,
                report.lr,
                export.as_deref_mut(),
                policy.model.kernels(),
            )?;
        }
        if let Some(payload) = export {
            payload.fill_rest(&policy.vars)?;
        }
        policy.recycle(grads);
        report.optimizer_seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }

    /// `updates` optimizer steps on one batch (PPO's epochs, `--updates-per-batch`): π_old
    /// stays the sampler's log-probs throughout; under the off-policy correction the
    /// proximal log-probs are the policy's own before the first update. Only the last
    /// update writes `export`. Reports the first update's loss parts and gradient norm,
    /// and the time of all.
    pub fn updates(
        &mut self,
        step: u64,
        batch: &GrpoBatch,
        updates: u32,
        mut export: Option<&mut Payload>,
    ) -> CandleResult<StepReport> {
        let cfg = self.cfg;
        let owned;
        let batch = if updates > 1 && cfg.loss.correction.on() && batch.proximal_logprobs.is_none()
        {
            let own = crate::policy::own_logprobs(&self.policy.model, batch, cfg.loss.temperature)?;
            owned = GrpoBatch {
                proximal_logprobs: Some(own),
                ..batch.clone()
            };
            &owned
        } else {
            batch
        };
        let mut first: Option<StepReport> = None;
        for k in 0..updates.max(1) {
            let out = if k + 1 == updates.max(1) {
                export.take()
            } else {
                None
            };
            let r = self.step(step, batch, out)?;
            match first.as_mut() {
                None => first = Some(r),
                Some(f) => {
                    f.forward_backward_seconds += r.forward_backward_seconds;
                    f.optimizer_seconds += r.optimizer_seconds;
                    f.reference_seconds += r.reference_seconds;
                    f.forward_seconds += r.forward_seconds;
                    f.backward_seconds += r.backward_seconds;
                }
            }
        }
        Ok(first.expect("at least one update"))
    }
}

/// Groups `start..start + len` of `batch`.
fn slice(batch: &GrpoBatch, start: usize, len: usize) -> GrpoBatch {
    let end = (start + len).min(batch.prompts.len());
    GrpoBatch {
        prompts: batch.prompts[start..end].to_vec(),
        completions: batch.completions[start..end].to_vec(),
        rewards: batch.rewards[start..end].to_vec(),
        old_logprobs: batch.old_logprobs.as_ref().map(|o| o[start..end].to_vec()),
        proximal_logprobs: batch
            .proximal_logprobs
            .as_ref()
            .map(|o| o[start..end].to_vec()),
        stale_prefix: batch.stale_prefix.as_ref().map(|s| s[start..end].to_vec()),
    }
}

/// Model FLOPs of one step's forward and backward: 6 per weight per token for the policy
/// (2 forward, 4 backward) and 2 more for the reference forward — the transformer's
/// matmul weights for every sequence token, the LM head's only for the completion tokens
/// (the only positions that go through it); groups without signal are not run.
pub fn step_flops(model: &Gpt2, batch: &GrpoBatch, reference: bool) -> f64 {
    let c = model.config();
    let body = (c.n_layer * 12 * c.n_embd * c.n_embd) as f64;
    let head = (c.vocab_size * c.n_embd) as f64;
    let (mut seq, mut completion) = (0usize, 0usize);
    for ((p, group), rewards) in batch
        .prompts
        .iter()
        .zip(&batch.completions)
        .zip(&batch.rewards)
    {
        if rewards.iter().all(|r| *r == rewards[0]) {
            continue; // no signal: not forwarded
        }
        for g in group {
            seq += p.len() + g.len();
            completion += g.len();
        }
    }
    let per_weight_token = if reference { 8.0 } else { 6.0 };
    per_weight_token * (body * seq as f64 + head * completion as f64)
}

/// The peak a step's MFU is measured against: on the CPU [`cpu_peak_flops`], twice that
/// for BF16 products (`vdpbf16ps` sums two products per f32 lane where an f32 FMA does
/// one), and for BF16 products on AMX tiles 1,024 FLOP a cycle per core (a `tdpbf16ps`,
/// 16,384 FLOP, every 16 cycles; 3 GHz); on CUDA the dense peak of an H100/H200 SXM in the matmuls' dtype — 989 TFLOP/s in
/// BF16, 495 in TF32 (f32 matmuls).
pub fn device_peak_flops(
    device: &candle_core::Device,
    matmul_dtype: Option<candle_core::DType>,
) -> f64 {
    match (device.is_cpu(), matmul_dtype) {
        (true, Some(candle_core::DType::BF16)) if rookworld_lm::cpu_gemm::amx().bf16 => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            cores as f64 * 1024.0 * 3e9
        }
        (true, Some(candle_core::DType::BF16)) => 2.0 * cpu_peak_flops(),
        (true, _) => cpu_peak_flops(),
        (false, Some(candle_core::DType::BF16 | candle_core::DType::F16)) => 989e12,
        (false, _) => 495e12,
    }
}

/// An estimate of this CPU's f32 peak at 3 GHz: two FMA units per core, each 16 f32 wide
/// with AVX-512 (64 FLOPs per cycle, the kernels `gemm` picks there) or 8 wide with AVX2
/// (32 FLOPs per cycle).
pub fn cpu_peak_flops() -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores as f64 * cpu_flops_per_cycle() * 3e9
}

fn cpu_flops_per_cycle() -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return 64.0;
    }
    32.0
}
