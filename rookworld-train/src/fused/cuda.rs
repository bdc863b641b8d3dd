//! The fused pass on CUDA (`--step-path fused`): `rookworld_train`'s CUDA backend on the
//! device that holds the policy. It reads the weights of the candle tensors in place and
//! adds the gradients into f32 tensors of its own on the device, which the optimizer takes
//! as they are (the global norm and AdamW's in-place kernels already run there). The
//! objective runs on the host between the forward and the backward, on the N log-probs:
//! one small read and one small write per micro-batch.

use crate::cuda::{Cuda, DevF32, DeviceVec};
use crate::kernels::{StepKernel, StepKernels};
use crate::launch::AttentionForm;
use crate::weights::Weights;
use crate::{Activations, KernelProfile};
use candle_core::{DType, Device, Result as CandleResult, Tensor};
use rookworld_lm::config::Config;
use rookworld_lm::kernels::{Family, Finding};

/// The CUDA pass's buffers, kept from step to step: every activation the pass planned,
/// the gradients and the backend's scratch, so that a step of a shape already seen
/// allocates nothing.
#[derive(Default)]
pub struct CudaWorkspace {
    policy: Activations<Cuda>,
    reference: Activations<Cuda>,
    /// One f32 tensor per parameter, in `Params` order, zeroed at each step's start.
    grads: Vec<Tensor>,
    scratch: DeviceVec,
    /// The kernels' device time of every pass since profiling began
    /// ([`crate::policy::Trainable::profile_kernels`]); `None`: not profiling.
    pub profile: Option<KernelProfile>,
}

impl std::fmt::Debug for CudaWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaWorkspace")
            .field("policy", &self.policy)
            .field("reference", &self.reference)
            .field("grads", &self.grads.len())
            .finish_non_exhaustive()
    }
}

/// A pass's weights and the activations it plans into.
pub type Side<'a, 'w> = (&'a Weights<'w, Cuda>, &'a mut Activations<Cuda>);

/// Runs `run` on the CUDA backend of `device` with the policy's weights (`tensors.0`, in
/// `Params` order), the reference's when given, and the step's zeroed gradients; returns
/// its result and the gradient tensors (f32 on the device, in `Params` order), every
/// kernel of the step ended.
///
/// The backend is made here, on the calling thread, and dropped before returning: candle's
/// device issues work on the calling thread's stream, and the backend's raw calls must be
/// on that stream too.
pub fn with_pass<R>(
    work: &mut CudaWorkspace,
    (device, kernels): (&Device, &StepKernels),
    cfg: &Config,
    tensors: (&[Tensor], Option<&[Tensor]>),
    run: impl FnOnce(&Cuda, Side, Option<Side>, &mut [&mut DevF32]) -> CandleResult<R>,
) -> CandleResult<(R, Vec<Tensor>)> {
    let Device::Cuda(cuda) = device else {
        candle_core::bail!("the fused pass on CUDA: the policy is on {device:?}")
    };
    let wrap = candle_core::Error::wrap;
    let views = |ts: &[Tensor]| -> CandleResult<Vec<DevF32>> {
        ts.iter()
            .map(|t| DevF32::of_tensor(t, cuda).map_err(wrap))
            .collect()
    };
    let policy = views(tensors.0)?;
    let reference = tensors.1.map(views).transpose()?;
    let fits = work.grads.len() == tensors.0.len()
        && work
            .grads
            .iter()
            .zip(tensors.0)
            .all(|(g, t)| g.shape() == t.shape());
    if !fits {
        work.grads = tensors
            .0
            .iter()
            .map(|t| Tensor::zeros(t.shape(), DType::F32, device))
            .collect::<CandleResult<_>>()?;
    }
    let mut grads = views(&work.grads)?;
    let mut b = Cuda::with_scratch(cuda.clone(), std::mem::take(&mut work.scratch))
        .with_attention(crate::kernels::attention_form(kernels))
        .with_kept_head(kernels.enabled(StepKernel::HeadKept))
        .with_epilogues(kernels.enabled(StepKernel::Epilogues));
    if work.profile.is_some() {
        b = b.profiled();
    }
    let out: CandleResult<R> = (|| {
        use crate::Backend;
        if fits {
            for g in &mut grads {
                b.fill(g, 0.0).map_err(wrap)?;
            }
        }
        let policy = Weights::new(cfg, policy.iter().collect()).map_err(wrap)?;
        let reference = match &reference {
            Some(r) => Some(Weights::new(cfg, r.iter().collect()).map_err(wrap)?),
            None => None,
        };
        let mut grads: Vec<&mut DevF32> = grads.iter_mut().collect();
        let out = run(
            &b,
            (&policy, &mut work.policy),
            reference.as_ref().map(|r| (r, &mut work.reference)),
            &mut grads,
        )?;
        b.synchronize().map_err(wrap)?;
        if let Some(profile) = &mut work.profile {
            profile.merge(&b.take_profile().map_err(wrap)?);
        }
        Ok(out)
    })();
    work.scratch = b.into_scratch();
    Ok((out?, work.grads.clone()))
}

/// The CUDA backend of `device` against the CPU's on a small synthetic micro-batch
/// ([`crate::compare::self_check`]): a finding for the `step_backend` kernel
/// family when a buffer differs beyond tolerance (naming it) or the check cannot run;
/// and, for each of the trials `step_attention_tiles`, `step_attention_mma`,
/// `step_head_kept` and `step_epilogues` turned on, the same with it, a finding for that family (so that it
/// alone is turned off). Only the families `kernels` has on are checked
/// ([`rookworld_lm::kernels::Switches::to_check`]: none when `step_backend` is turned
/// off), each followed by a synchronisation of the device; a fault that poisons the CUDA
/// context ends the process in one line naming the family whose check raised it (candle's
/// autograd could not run in that context either).
pub fn startup_check(device: &Device, kernels: &StepKernels) -> Vec<Finding<StepKernel>> {
    use rookworld_lm::kernels::end_process;
    let Device::Cuda(cuda) = device else {
        return Vec::new();
    };
    let check = |kernel: StepKernel, b: Cuda| match checked(kernel, &b) {
        Ok(c) => c.first_divergence().map(|_| Finding {
            kernel,
            problem: c.summary(),
        }),
        Err(e) => Some(Finding {
            kernel,
            problem: format!("did not run: {e}"),
        }),
    };
    let settle = |family: Option<StepKernel>| {
        rookworld_lm::cuda::settle(device, family).unwrap_or_else(|lost| end_process(&lost))
    };
    // Whatever the device ran before is not blamed on the step's families.
    settle(None);
    let mut findings = Vec::new();
    for kernel in kernels.to_check(StepKernel::ALL) {
        let backend = Cuda::new(cuda.clone());
        let backend = match kernel {
            StepKernel::AttentionTiles => backend.with_attention(AttentionForm::Tiles),
            StepKernel::AttentionMma => backend.with_attention(AttentionForm::Mma),
            StepKernel::HeadKept => backend.with_kept_head(true),
            StepKernel::Epilogues => backend.with_epilogues(true),
            StepKernel::Backend => backend,
        };
        let found = check(kernel, backend);
        let settled = settle(Some(kernel));
        findings.extend(found.or(settled));
    }
    findings
}

/// The start-up check of `kernel` on `b`: the step's buffers against the CPU backend's
/// ([`crate::compare::self_check`]), after, for `step_epilogues`, each epilogue against
/// its composed form on the device ([`crate::compare::epilogue_check`], whose measured
/// errors are logged: they say which GELU and which bias-gradient sum the device has).
fn checked(kernel: StepKernel, b: &Cuda) -> crate::Result<crate::compare::Comparison> {
    let mut all = crate::compare::Comparison::default();
    if kernel == StepKernel::Epilogues {
        all = crate::compare::epilogue_check(b)?;
        for c in &all.checked {
            tracing::info!(
                "step_epilogues: {}: max |Δ| {:.2e} against a scale of {:.2e}",
                c.name,
                c.max_diff,
                c.scale
            );
        }
    }
    let step = crate::compare::self_check(b)?;
    all.checked.extend(step.checked);
    all.skipped.extend(step.skipped);
    Ok(all)
}
