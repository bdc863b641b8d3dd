//! The trainable policy (every weight a candle `Var`) and the frozen reference, and the
//! per-token log-probs the objective needs.

use std::path::Path;
use std::sync::Mutex;

use candle_core::{DType, Device, Result as CandleResult, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rookworld_lm::{Gpt2, LeftPadding, model_io};

use crate::batch::Layout;
use crate::fused::Workspace;
use crate::head::{head_logprobs, plain_head_logprobs};
use crate::kernels::{KernelChoice, StepKernel, StepKernels};
use crate::optim::Gradients;

/// Which pass computes a step's gradients (`learner train --step-path`, `learner bench
/// --path`; [`Trainable::set_step_path`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StepPath {
    /// The fused pass on the CPU; candle's autograd on CUDA, until a GPU run has passed
    /// the CUDA backend's check (`learner compare-backends`).
    #[default]
    Auto,
    /// The fused pass: on the CPU, or on CUDA the CUDA backend of `rookworld_train` (a
    /// learner built with the `cuda` feature, BF16 products); refused, with the reason,
    /// where it does not apply.
    Fused,
    /// candle's autograd on the plain model (every device and dtype).
    Autograd,
}

impl crate::choice::Choice for StepPath {
    const NAMES: &'static [(Self, &'static str)] = &[
        (Self::Auto, "auto"),
        (Self::Fused, "fused"),
        (Self::Autograd, "autograd"),
    ];
}

/// How the learner's products run (`--matmul-precision`). The weights, the optimizer's
/// moments, layer-norm and softmax statistics and the log-probs stay f32 whatever is
/// chosen. Not the weights' dtype of a worker or an evaluation (`--weight-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulPrecision {
    /// BF16 matmul inputs on CUDA (TF32 for the f32 matmuls left) and on a CPU whose
    /// AVX512-BF16 dot products outrun its f32 FMAs (the fused pass's `vdpbf16ps`
    /// products: AMD Zen 4 and 5; [`rookworld_lm::cpu_gemm::bf16_products_pay`]); f32 on
    /// other CPUs, Intel Xeons without AMX among them.
    Auto,
    /// f32 matmuls everywhere (TF32 still allowed on CUDA).
    F32,
    /// BF16 matmul inputs with f32 accumulation (cuBLAS; on the CPU the fused pass's
    /// BF16 products: `vdpbf16ps` with AVX512-BF16, rounded operands in f32 elsewhere).
    Bf16,
}

impl std::str::FromStr for MatmulPrecision {
    type Err = String;

    /// `auto`, `f32` or `bf16`; a weight dtype (`f16`, `int8`) is refused with the key
    /// that takes it.
    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "auto" => Ok(Self::Auto),
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "f16" | "float16" | "half" | "int8" => Err(format!(
                "{name} is a weight dtype, not a precision of the learner's products (auto, \
                 f32, bf16): a rollout worker's or an evaluation's weights take it \
                 (--weight-dtype {name}; with train --local, --rollout-weight-dtype {name})"
            )),
            other => Err(format!(
                "unknown matmul precision `{other}` (use auto, f32 or bf16)"
            )),
        }
    }
}

impl MatmulPrecision {
    /// The matmuls' input dtype on `device` (`None`: the weights' f32).
    pub fn matmul_dtype(self, device: &Device) -> Option<DType> {
        match self {
            Self::Auto => (device.is_cuda()
                || (device.is_cpu() && rookworld_lm::cpu_gemm::bf16_products_pay()))
            .then_some(DType::BF16),
            Self::F32 => None,
            Self::Bf16 => Some(DType::BF16),
        }
    }

    /// Sets `model`'s matmuls (policy or reference) to this precision; on CUDA also lets
    /// cuBLAS run the f32 matmuls in TF32.
    pub fn apply(self, model: &mut Gpt2) {
        if model.device().is_cuda() {
            candle_core::cuda::set_gemm_reduced_precision_f32(true);
        }
        model.set_matmul_dtype(self.matmul_dtype(model.device()));
    }
}

/// Whether the fused pass's CUDA backend can train a model of `cfg` whose products take
/// `matmuls` operands, or why not: BF16 operands with f32 sums, and heads of a width its
/// attention has kernels for ([`crate::launch::serves`]) — the `tiny` preset's
/// heads of 16 have none, so its steps on CUDA take candle's autograd.
pub fn fused_cuda_applies(
    cfg: &rookworld_lm::config::Config,
    matmuls: Option<DType>,
) -> Result<(), String> {
    if matmuls != Some(DType::BF16) {
        return Err(
            "the fused pass on CUDA multiplies in BF16 with f32 sums: use \
             --matmul-precision auto or bf16"
                .into(),
        );
    }
    let heads = crate::Heads {
        e: cfg.n_embd,
        h: cfg.n_head,
    };
    crate::launch::serves(heads)
        .map_err(|e| format!("the fused pass on CUDA cannot run this model: {e}"))
}

/// A model whose weights are `Var`s, named as in a Hugging Face checkpoint.
#[derive(Debug)]
pub struct Trainable {
    pub model: Gpt2,
    /// Every parameter once (the tied LM head is `transformer.wte.weight`), by name.
    pub vars: Vec<(String, Var)>,
    /// The fused pass's buffers, reused from step to step.
    pub workspace: Mutex<Workspace>,
    /// Which pass computes the gradients ([`Trainable::set_step_path`]).
    step_path: StepPath,
    /// Rows of the LM head per chunk of the fused pass on the CPU
    /// ([`Trainable::set_head_chunk_rows`]).
    head_chunk_rows: Option<usize>,
    /// Which of the step's CUDA kernels run ([`Trainable::set_step_path`]'s verdict;
    /// until then none).
    step_kernels: StepKernels,
}

/// The pass a step runs ([`Trainable::pass`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The fused pass on the CPU backend ([`crate::fused`]).
    FusedCpu,
    /// The fused pass on the CUDA backend (`crate::fused::cuda`).
    FusedCuda,
    /// candle's autograd on the plain model.
    Autograd,
}

impl Trainable {
    /// Loads a checkpoint directory in f32 on `device` as trainable weights.
    pub fn load(dir: &Path, device: &Device) -> rookworld_lm::Result<Self> {
        Self::from_model(&model_io::load(dir, DType::F32, device)?)
    }

    /// Trainable copies of `model`'s weights.
    /// The model's device kernels ([`Gpt2::kernels`]) come along.
    pub fn from_model(model: &Gpt2) -> rookworld_lm::Result<Self> {
        let kernels = model.kernels().clone();
        let varmap = VarMap::new();
        let mut vars = Vec::new();
        {
            let mut data = varmap.data().lock().expect("var map lock");
            for (name, t) in model.named_tensors() {
                let var = Var::from_tensor(&t.to_dtype(DType::F32)?)?;
                data.insert(name.clone(), var.clone());
                vars.push((name, var));
            }
        }
        let root = VarBuilder::from_varmap(&varmap, DType::F32, model.device());
        let cfg = model.config().clone();
        let mut model = Gpt2::load(root.pp("transformer"), root, &cfg)?;
        model.set_kernels(kernels);
        // f32 on the CPU until a command applies its --matmul-precision (library users and the
        // parity tests get the exact pass); BF16 matmul inputs on CUDA.
        let default = if model.device().is_cuda() {
            MatmulPrecision::Auto
        } else {
            MatmulPrecision::F32
        };
        default.apply(&mut model);
        // Where the step runs candle's autograd (CUDA; the CPU off the fused pass): its
        // layer norms, softmaxes, bias + GELU and head log-probs as single ops with their
        // own backwards.
        model.set_train_ops(true);
        Ok(Self {
            model,
            vars,
            workspace: Mutex::default(),
            step_path: StepPath::Auto,
            head_chunk_rows: None,
            step_kernels: StepKernels::none(),
        })
    }

    /// Chooses the pass of this policy's steps (`--step-path`), after its matmul
    /// precision is set, with the step's CUDA kernels `kernels` chooses. `fused` where the
    /// fused pass does not apply is refused with the reason, in one line.
    pub fn set_step_path(&mut self, path: StepPath, kernels: &KernelChoice) -> Result<(), String> {
        // Judged on CUDA only: no CUDA kernel of the step runs elsewhere, so the CPU's
        // verdict turns nothing on or off (and says nothing), as the model's does.
        self.step_kernels = if self.model.device().is_cuda() {
            StepKernels::chosen(kernels)
        } else {
            StepKernels::cpu()
        };
        if path == StepPath::Fused {
            let pass = self
                .fused_pass()
                .map_err(|why| format!("--step-path fused: {why}"))?;
            // The CUDA backend against the CPU's first: a wrong kernel is named and the
            // step falls back to candle's autograd (or, with --strict-kernels, refused).
            // (Without the cuda feature `fused_pass` never gives FusedCuda.)
            if pass == Pass::FusedCuda {
                #[cfg(feature = "cuda")]
                {
                    let device = self.model.device();
                    let findings = crate::fused::cuda::startup_check(device, &self.step_kernels);
                    self.step_kernels
                        .apply(&rookworld_lm::device::name(device), &findings)
                        .map_err(|e| format!("--step-path fused: {e}"))?;
                }
            }
        }
        self.step_path = path;
        Ok(())
    }

    /// Which of the step's CUDA kernels run: the verdict of [`Self::set_step_path`].
    pub fn step_kernels(&self) -> &StepKernels {
        &self.step_kernels
    }

    /// The pass of this policy's steps: `auto` runs the fused pass on the CPU and candle's
    /// autograd on CUDA (the CUDA backend is opted into with `fused`: the default once a
    /// GPU run has passed its check), `fused` and `autograd` what they say.
    pub fn pass(&self) -> Pass {
        match (self.step_path, self.fused_pass()) {
            (StepPath::Autograd, _) | (_, Err(_)) => Pass::Autograd,
            (StepPath::Auto, Ok(Pass::FusedCuda)) => Pass::Autograd,
            // Failed its start-up check, or turned off (--disable-kernels).
            (_, Ok(Pass::FusedCuda)) if !self.step_kernels.enabled(StepKernel::Backend) => {
                Pass::Autograd
            }
            (_, Ok(pass)) => pass,
        }
    }

    /// The fused pass this policy can run, or why it cannot: on the CPU f32 weights with
    /// f32 or BF16 products; on CUDA (a learner built with the `cuda` feature) BF16
    /// products and heads of a width the CUDA backend's attention serves
    /// ([`crate::launch::serves`]); `gelu_new` on both.
    fn fused_pass(&self) -> Result<Pass, String> {
        let cfg = self.model.config();
        if cfg.activation_function != rookworld_lm::config::Activation::GeluNew {
            return Err(format!(
                "the fused pass computes gelu_new; this model's activation is {:?}",
                cfg.activation_function
            ));
        }
        let matmuls = self.model.matmul_dtype();
        let head = self.model.head_weight();
        if head.device().is_cpu() {
            return match matmuls {
                None | Some(DType::BF16) if crate::fused::applies(cfg, head) => Ok(Pass::FusedCpu),
                _ => Err(format!(
                    "the fused pass on the CPU takes f32 weights with f32 or BF16 products, \
                     not {:?} products of {:?} weights",
                    matmuls.unwrap_or(head.dtype()),
                    head.dtype()
                )),
            };
        }
        if !head.device().is_cuda() || !cfg!(feature = "cuda") {
            return Err(format!(
                "no fused pass on {:?} (this learner's: the CPU{})",
                head.device().location(),
                if cfg!(feature = "cuda") { ", CUDA" } else { "" }
            ));
        }
        fused_cuda_applies(cfg, matmuls).map(|()| Pass::FusedCuda)
    }

    /// Times every kernel of the step's CUDA backend from now on, with device events
    /// around each launch (`learner bench --profile`); read with
    /// [`Self::take_kernel_profile`]. Refused where the steps do not run on the CUDA
    /// backend (`--device cuda --path fused`): on the CPU, `perf record` samples the same.
    pub fn profile_kernels(&self) -> Result<(), String> {
        let runs = match self.pass() {
            Pass::FusedCuda => None,
            Pass::FusedCpu => Some("the fused pass on the CPU (perf record samples it)"),
            Pass::Autograd => Some("candle's autograd"),
        };
        if let Some(runs) = runs {
            return Err(format!(
                "--profile times the kernels of the fused pass on CUDA (--device cuda \
                 --path fused); this step runs {runs}"
            ));
        }
        #[cfg(feature = "cuda")]
        {
            let mut work = self.workspace.lock().expect("workspace lock");
            work.cuda.get_or_insert_with(Default::default).profile = Some(Default::default());
        }
        Ok(())
    }

    /// The kernels timed since profiling began or the last call, which starts anew;
    /// `None` unless [`Self::profile_kernels`].
    pub fn take_kernel_profile(&self) -> Option<crate::KernelProfile> {
        #[cfg(feature = "cuda")]
        {
            let mut work = self.workspace.lock().expect("workspace lock");
            let profile = work.cuda.as_mut()?.profile.as_mut()?;
            Some(std::mem::take(profile))
        }
        #[cfg(not(feature = "cuda"))]
        None
    }

    /// Whether the fused CPU pass runs this policy's steps.
    pub fn fused_pass_applies(&self) -> bool {
        self.pass() == Pass::FusedCpu
    }

    /// How the fused pass multiplies for this policy's `--matmul-precision`.
    pub fn fused_matmuls(&self) -> crate::cpu::ops::Matmuls {
        match self.model.matmul_dtype() {
            Some(DType::BF16) => crate::cpu::ops::Matmuls::Bf16,
            _ => crate::cpu::ops::Matmuls::F32,
        }
    }

    /// Sets the rows of the LM head whose probabilities the fused pass on the CPU keeps
    /// at once, a chunk of whole completions between the head's forward and backward
    /// (`None`: 128 MiB's worth; see [`crate::train`]). The gradients are the
    /// same whatever the chunks; smaller ones hold less memory and pass over the head's
    /// weight gradient more often.
    pub fn set_head_chunk_rows(&mut self, rows: Option<usize>) {
        self.head_chunk_rows = rows;
    }

    /// The CPU backend of this policy's fused pass.
    pub fn fused_backend(&self) -> crate::cpu::Cpu {
        let cpu = crate::cpu::Cpu::new(self.fused_matmuls());
        match self.head_chunk_rows {
            Some(rows) => cpu.with_head_keep_rows(rows),
            None => cpu,
        }
    }

    /// The parameters' tensors in `vars` order (the fused pass's `Params` order).
    pub fn tensors(&self) -> Vec<Tensor> {
        self.vars
            .iter()
            .map(|(_, v)| v.as_tensor().clone())
            .collect()
    }

    /// The fused pass's gradient buffers (in `vars` order) as named gradients.
    pub fn host_gradients(&self, buffers: Vec<Vec<f32>>) -> Gradients {
        let mut grads = Gradients::default();
        for ((name, var), g) in self.vars.iter().zip(buffers) {
            grads.insert_host(name.clone(), g, var.shape().clone());
        }
        grads
    }

    /// The fused pass's gradient tensors on a device (in `vars` order) as named
    /// gradients.
    pub fn device_gradients(&self, tensors: Vec<Tensor>) -> Gradients {
        let mut grads = Gradients::default();
        for ((name, _), g) in self.vars.iter().zip(tensors) {
            grads.insert_tensor(name.clone(), g);
        }
        grads
    }

    /// Keeps the host gradient buffers of a finished step for the next one.
    pub fn recycle(&self, grads: Gradients) {
        let buffers = grads.recycle(&self.vars);
        if !buffers.is_empty() {
            self.workspace.lock().expect("workspace lock").grads = buffers;
        }
    }
}

/// `log softmax(logits / temperature)` of each completion slot's target: (C, T−1), 0 on
/// other slots (only the completion slots go through the LM head). No dropout exists
/// anywhere, so this is the same forward that sampling ran.
pub fn token_logprobs(model: &Gpt2, layout: &Layout, temperature: f64) -> CandleResult<Tensor> {
    let (c, t) = layout.ids.dims2()?;
    let y = layout
        .targets
        .flatten_all()?
        .index_select(&layout.slots, 0)?; // (N)
    let logp = slot_logprobs(model, &layout.ids, &layout.slots, &y, temperature)?; // (N)
    Tensor::zeros(c * (t - 1), DType::F32, model.device())?
        .index_add(&layout.slots, &logp, 0)?
        .reshape((c, t - 1)) // (C, T−1)
}

/// The model's own log-probs of every completion token of `batch`, `[p][g][t]`, one
/// group per forward, no gradient: the proximal policy of the decoupled objective, taken
/// before a step's first update ([`crate::offpolicy`]).
pub fn own_logprobs(
    model: &Gpt2,
    batch: &crate::batch::GrpoBatch,
    temperature: f64,
) -> CandleResult<Vec<Vec<Vec<f32>>>> {
    let eot = model.config().eos_token_id;
    let mut out = Vec::with_capacity(batch.prompts.len());
    for (prompt, group) in batch.prompts.iter().zip(&batch.completions) {
        // Distinct rewards, so that the group is laid out whatever its real ones.
        let one = crate::batch::GrpoBatch {
            prompts: vec![prompt.clone()],
            completions: vec![group.clone()],
            rewards: vec![(0..group.len()).map(|g| g as f32).collect()],
            old_logprobs: None,
            proximal_logprobs: None,
            stale_prefix: None,
        };
        let scale = crate::grpo::Scale::Fixed(1.0);
        let first = prompt.len() - 1;
        let rows = match Layout::new(&one, scale, eot, false, model.device())? {
            Some(layout) => token_logprobs(model, &layout, temperature)?.to_vec2::<f32>()?,
            None => vec![Vec::new(); group.len()], // one completion: nothing to weigh
        };
        out.push(
            group
                .iter()
                .zip(rows)
                .map(|(c, row)| {
                    row.get(first..first + c.len())
                        .map_or_else(|| vec![0.0; c.len()], <[f32]>::to_vec)
                })
                .collect(),
        );
    }
    Ok(out)
}

/// Log-probs under `softmax(logits / temperature)` of `targets` (N) u32 at `slots` (N)
/// u32 of `ids` (C, T): slot `r·(T−1) + t` is the prediction made at position t of row r.
/// Only those positions go through the LM head.
pub fn slot_logprobs(
    model: &Gpt2,
    ids: &Tensor,
    slots: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> CandleResult<Tensor> {
    let (c, t) = ids.dims2()?;
    let hidden = model.forward_hidden(ids, &LeftPadding::none(c), &mut model.new_cache())?; // (C, T, E)
    let e = hidden.dim(2)?;
    let hidden = hidden.narrow(1, 0, t - 1)?.reshape((c * (t - 1), e))?; // (C·(T−1), E)
    let h = hidden.index_select(slots, 0)?; // (N, E)
    if model.train_ops() {
        // The (N, V) logits (BF16 matmul under mixed precision), then one kernel to the
        // targets' log-probs whose backward needs only those logits.
        let logits = model.logits(&h.unsqueeze(0)?)?.squeeze(0)?; // (N, V) f32
        return rookworld_lm::train_ops::target_logprobs(&logits, targets, temperature);
    }
    match model.matmul_dtype() {
        // Mixed precision: the head's matmul in BF16 too, its logits and log-softmax f32.
        Some(dtype) => plain_head_logprobs(
            &h.to_dtype(dtype)?,
            &model.head_weight().to_dtype(dtype)?,
            targets,
            temperature,
        ),
        None => head_logprobs(&h, model.head_weight(), targets, temperature), // (N)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookworld_lm::config::Config;

    /// The fused pass on CUDA is refused, naming why, where its kernels cannot run: the
    /// `tiny` preset's heads of 16 (its steps take candle's autograd instead of failing
    /// mid-step), f32 products; gpt2-124m with BF16 products runs it.
    #[test]
    fn the_fused_pass_on_cuda_is_gated_on_the_shapes_its_kernels_serve() {
        let gpt2 = Config::preset("gpt2-124m").unwrap();
        assert_eq!(fused_cuda_applies(&gpt2, Some(DType::BF16)), Ok(()));
        let f32 = fused_cuda_applies(&gpt2, None).unwrap_err();
        assert!(f32.contains("--matmul-precision"), "{f32}");
        let tiny = Config::preset("tiny").unwrap();
        let err = fused_cuda_applies(&tiny, Some(DType::BF16)).unwrap_err();
        assert!(err.contains("width 16"), "{err}");
    }
}
