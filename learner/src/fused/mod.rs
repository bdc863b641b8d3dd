//! The fused training pass of the GPT-2 policy on the CPU, in llm.c's manner: an explicit
//! layer-by-layer forward that keeps exactly the activations its backward needs
//! ([`model::Activations`], sized before the pass runs), and a hand-written backward
//! ([`ops`], [`attention`], the LM head of [`crate::head`]).
//!
//! - **The prompt once per group.** A group's G completions share its prompt: the prompt's
//!   rows go through the layers once, completion rows attend to its keys and values
//!   ([`attention`]), and in the backward the prompt's gradients collect all G
//!   completions' contributions — the sharing the rollout engine does when sampling.
//!   A completion's last token predicts nothing, so it is never fed.
//! - **Only predicting rows through the head**, whose probabilities are kept for the
//!   backward when they fit the budget, recomputed otherwise ([`crate::head`]).
//! - **Weights read in place** from the candle tensors that hold them ([`Params`]), the
//!   gradient of each parameter one `Vec<f32>` handed to the optimizer as is.
//!
//! It is a faster path of the same maths as `rookworld_lm::Gpt2::forward` (checked by
//! `tests/fused_parity.rs` and the GRPO parity against PyTorch), used on the CPU in f32
//! when the model uses `gelu_new`; elsewhere the candle-autograd path runs.
//!
//! Letters: R rows fed (prompts once, completions without their last token), E width,
//! H heads, I MLP width, V vocabulary, N predicted tokens.

pub mod attention;
pub mod model;
pub mod ops;
pub mod step;

use candle_core::{CpuStorage, DType, Result as CandleResult, Storage, StorageRef, Tensor};
use rookworld_lm::config::{Activation, Config};

use crate::fused::attention::GroupRows;

/// Tensors per transformer block, in `Gpt2::named_tensors` order: ln_1 (w, b), c_attn
/// (w, b), attn.c_proj (w, b), ln_2 (w, b), c_fc (w, b), mlp.c_proj (w, b).
pub const PER_LAYER: usize = 12;

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
    pub matmuls: ops::Matmuls,
}

impl<'a> Params<'a> {
    /// Holds a read lock on every tensor (contiguous f32 on the CPU, else an error).
    pub fn new(tensors: &'a [Tensor], cfg: &'a Config) -> CandleResult<Self> {
        let want = 4 + PER_LAYER * cfg.n_layer + usize::from(!cfg.tie_word_embeddings);
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
            matmuls: ops::Matmuls::F32,
        })
    }

    /// The pass multiplies as `matmuls` says.
    pub fn with_matmuls(mut self, matmuls: ops::Matmuls) -> Self {
        self.matmuls = matmuls;
        self
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

    /// Index of parameter `j` (0..12) of block `l`.
    pub fn layer(l: usize, j: usize) -> usize {
        2 + l * PER_LAYER + j
    }

    /// Index of the LM head's weight (V, E): `wte` when tied.
    pub fn head_index(&self) -> usize {
        if self.cfg.tie_word_embeddings {
            0
        } else {
            self.held.len() - 1
        }
    }

    /// Index of ln_f's weight (its bias follows).
    pub fn ln_f(&self) -> usize {
        2 + PER_LAYER * self.cfg.n_layer
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

/// One group: its prompt and its completions.
#[derive(Debug, Clone, Copy)]
pub struct GroupInput<'a> {
    pub prompt: &'a [u32],
    pub completions: &'a [Vec<u32>],
}

/// A micro-batch of groups laid out as rows: per group its prompt's rows, then each
/// completion's rows (all of its tokens but the last).
#[derive(Debug, Clone)]
pub struct Packed {
    /// (R) token fed at each row, and its position.
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub groups: Vec<GroupRows>,
    /// (N) the row whose hidden state predicts each completion token, and that token;
    /// completion after completion, in batch order.
    pub head_rows: Vec<u32>,
    pub targets: Vec<u32>,
    /// Per completion (batch order), its tokens' range in `head_rows`.
    pub tokens: Vec<std::ops::Range<usize>>,
}

impl Packed {
    pub fn new(groups: &[GroupInput]) -> Self {
        let mut p = Packed {
            ids: Vec::new(),
            positions: Vec::new(),
            groups: Vec::new(),
            head_rows: Vec::new(),
            targets: Vec::new(),
            tokens: Vec::new(),
        };
        for g in groups {
            let start = p.ids.len();
            p.ids.extend_from_slice(g.prompt);
            p.positions.extend(0..g.prompt.len() as u32);
            let prompt = start..p.ids.len();
            let last = (prompt.end - 1) as u32;
            let mut completions = Vec::new();
            for c in g.completions {
                let first = p.ids.len();
                let fed = &c[..c.len().saturating_sub(1)];
                p.ids.extend_from_slice(fed);
                let lp = g.prompt.len() as u32;
                p.positions.extend(lp..lp + fed.len() as u32);
                let n0 = p.head_rows.len();
                for (j, &y) in c.iter().enumerate() {
                    p.head_rows
                        .push(if j == 0 { last } else { (first + j - 1) as u32 });
                    p.targets.push(y);
                }
                p.tokens.push(n0..p.head_rows.len());
                completions.push(first..p.ids.len());
            }
            p.groups.push(GroupRows {
                prompt,
                completions,
            });
        }
        p
    }

    /// Rows fed.
    pub fn rows(&self) -> usize {
        self.ids.len()
    }
}
