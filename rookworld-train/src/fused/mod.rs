//! The fused training pass of the GPT-2 policy on the CPU, in llm.c's manner: an explicit
//! layer-by-layer forward that keeps exactly the activations its backward needs
//! ([`Activations`], sized before the pass runs), and a hand-written backward: the pass of
//! `rookworld_train` on its CPU backend, which this module feeds with the weights of the
//! candle model in place.
//!
//! - **The prompt once per group.** A group's G completions share its prompt: the prompt's
//!   rows go through the layers once, completion rows attend to its keys and values
//!   (`crate::cpu::attention`), and in the backward the prompt's gradients collect all G
//!   completions' contributions — the sharing the rollout engine does when sampling.
//!   A completion's last token predicts nothing, so it is never fed.
//! - **Only predicting rows through the head**, whose probabilities are kept for the
//!   backward when they fit the budget, recomputed otherwise (`crate::cpu::head`).
//! - **Weights read in place** from the candle tensors that hold them ([`Params`]), the
//!   gradient of each parameter one `Vec<f32>` handed to the optimizer as is.
//!
//! It is a faster path of the same maths as `rookworld_lm::Gpt2::forward` (checked by
//! `tests/fused_parity.rs` and the GRPO parity against PyTorch), used on the CPU in f32
//! when the model uses `gelu_new`; elsewhere the candle-autograd path runs, but on CUDA
//! with `--step-path fused`: the same pass on the CUDA backend ([`cuda`]).
//!
//! Letters: R rows fed (prompts once, completions without their last token), E width,
//! H heads, I MLP width, V vocabulary, N predicted tokens.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod micro_batch;

use crate::cpu::Cpu;
use crate::cpu::ops::Matmuls;
use crate::weights::{self, Weights};
use candle_core::{CpuStorage, DType, Result as CandleResult, Storage, StorageRef, Tensor};
use rookworld_lm::config::{Activation, Config};

pub use crate::{GroupInput, Packed};

/// Whether the fused pass runs a model of `cfg` whose weights are `sample` on this host.
pub fn applies(cfg: &Config, sample: &Tensor) -> bool {
    sample.device().is_cpu()
        && sample.dtype() == DType::F32
        && cfg.activation_function == Activation::GeluNew
}

/// A tensor's elements read in place: a read lock on its storage, contiguous f32 on the
/// CPU. Shared by the fused pass ([`Params`]) and the optimizer's host paths.
pub struct HostF32<'a> {
    storage: StorageRef<'a>,
    range: std::ops::Range<usize>,
}

impl<'a> HostF32<'a> {
    /// `None` when `t` is not a contiguous f32 tensor on the CPU.
    pub fn new(t: &'a Tensor) -> Option<Self> {
        let (storage, layout) = t.storage_and_layout();
        let (a, b) = layout.contiguous_offsets()?;
        match &*storage {
            Storage::Cpu(CpuStorage::F32(_)) => Some(Self {
                storage,
                range: a..b,
            }),
            _ => None,
        }
    }

    pub fn as_slice(&self) -> &[f32] {
        match &*self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => &v[self.range.clone()],
            _ => unreachable!("checked in new"),
        }
    }
}

/// Read access to a model's parameters in place, in `Gpt2::named_tensors` order: wte,
/// wpe, 12 per block, ln_f (w, b), then an untied LM head.
pub struct Params<'a> {
    held: Vec<HostF32<'a>>,
    pub cfg: &'a Config,
    /// How the pass multiplies (f32 unless [`with_matmuls`](Self::with_matmuls) says).
    pub matmuls: Matmuls,
}

impl<'a> Params<'a> {
    /// Holds a read lock on every tensor (contiguous f32 on the CPU, else an error).
    pub fn new(tensors: &'a [Tensor], cfg: &'a Config) -> CandleResult<Self> {
        let want = weights::count(cfg);
        if tensors.len() != want {
            candle_core::bail!("fused pass: {} tensors, want {want}", tensors.len());
        }
        let held = tensors
            .iter()
            .map(|t| match HostF32::new(t) {
                Some(h) => Ok(h),
                None => candle_core::bail!("fused pass: weights must be contiguous f32 on the CPU"),
            })
            .collect::<CandleResult<Vec<_>>>()?;
        Ok(Self {
            held,
            cfg,
            matmuls: Matmuls::F32,
        })
    }

    /// The pass multiplies as `matmuls` says.
    pub fn with_matmuls(mut self, matmuls: Matmuls) -> Self {
        self.matmuls = matmuls;
        self
    }

    /// The CPU backend that multiplies as these parameters say.
    pub fn backend(&self) -> Cpu {
        Cpu::new(self.matmuls)
    }

    /// The parameters as the pass reads them.
    pub fn weights(&self) -> Weights<'_, Cpu> {
        let bufs = self.held.iter().map(|h| h.as_slice()).collect();
        Weights::new(self.cfg, bufs).expect("counted in Params::new")
    }

    /// Number of parameter tensors.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Parameter `i` as a slice.
    pub fn get(&self, i: usize) -> &[f32] {
        self.held[i].as_slice()
    }

    /// Zeroed gradients, one per parameter: `reuse`'s buffers when they fit (the memory
    /// is then already mapped), new ones otherwise.
    pub fn zero_grads(&self, reuse: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        use rayon::prelude::*;
        let fits = reuse.len() == self.len()
            && reuse
                .iter()
                .enumerate()
                .all(|(i, g)| g.len() == self.get(i).len());
        if !fits {
            return (0..self.len())
                .map(|i| vec![0f32; self.get(i).len()])
                .collect();
        }
        let mut grads = reuse;
        grads
            .iter_mut()
            .for_each(|g| g.par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0)));
        grads
    }
}

/// The fused pass's activations on the CPU.
pub type Activations = crate::Activations<Cpu>;

/// The buffers of the fused pass, kept from step to step by the model that trains
/// ([`crate::policy::Trainable`]): the policy's activations and the reference's.
#[derive(Debug, Default)]
pub struct Workspace {
    pub policy: Activations,
    pub reference: Activations,
    /// Gradient buffers of the last step, handed back after its optimizer step
    /// ([`crate::optim::Gradients::recycle`]).
    pub grads: Vec<Vec<f32>>,
    /// The fused pass's buffers on CUDA.
    #[cfg(feature = "cuda")]
    pub cuda: Option<cuda::CudaWorkspace>,
}

impl Workspace {
    /// Zeroed gradient buffers for `params`: the last step's when they fit.
    pub fn zeroed_grads(&mut self, params: &Params) -> Vec<Vec<f32>> {
        params.zero_grads(std::mem::take(&mut self.grads))
    }
}

/// Forward of `packed` on the CPU: the log-prob of every predicted token (N) under
/// `softmax(logits / temperature)`; with `keep`, `acts` holds what [`backward`] needs
/// ([`crate::forward`]).
pub fn forward(
    params: &Params,
    packed: &Packed,
    temperature: f64,
    acts: &mut Activations,
    keep: bool,
) -> CandleResult<Vec<f32>> {
    crate::forward(
        &params.backend(),
        &params.weights(),
        packed,
        temperature,
        acts,
        keep,
    )
    .map_err(candle_core::Error::wrap)
}

/// Backward of [`forward`] for upstream gradients `dlogp` (N): adds every parameter's
/// gradient to `grads` (indexed as [`Params`]).
pub fn backward(
    params: &Params,
    packed: &Packed,
    acts: &mut Activations,
    dlogp: &[f32],
    temperature: f64,
    grads: &mut [Vec<f32>],
) -> CandleResult<()> {
    crate::backward(
        &params.backend(),
        &params.weights(),
        packed,
        acts,
        dlogp,
        temperature,
        grads,
    )
    .map_err(candle_core::Error::wrap)
}
