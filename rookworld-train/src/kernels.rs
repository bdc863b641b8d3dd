//! The training step's CUDA kernel families ([`StepKernel`]), chosen and judged as the
//! model's are ([`rookworld_lm::kernels`]): the command line's [`KernelChoice`] turns
//! trials on and families off, and the step backend's start-up check
//! (`fused::cuda::startup_check`, run when `--step-path fused` chooses the CUDA backend)
//! turns off a family that disagrees with the CPU backend. The verdict ([`StepKernels`])
//! is the policy's ([`crate::Trainable::step_kernels`]).

use rookworld_lm::kernels::{Family, Switches};

pub use rookworld_lm::kernels::KernelChoice;

/// A family of the training step's CUDA kernels (`kernels/pass.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKernel {
    /// The CUDA backend of the learner's fused pass, checked against the CPU backend
    /// when `--step-path fused` chooses it; without it, candle's autograd.
    Backend,
    /// The step backend's attention a tile of rows per block, each chunk of keys (or, for
    /// the keys' gradients, of query rows) read once for the tile through shared memory
    /// (`attention_tile_*`), heads of width 32 or 64. A trial ([`Family::trial`]),
    /// checked like [`StepKernel::Backend`]; without it, a warp per row and head walks its
    /// keys from device memory.
    AttentionTiles,
    /// The step backend's attention on tensor cores: the tiles' walk with every product a
    /// warp matrix product of BF16 operands with f32 sums (`attention_mma_*`), heads of
    /// width 32 or 64 in the fused pass (its kernels also serve 16, which the pass refuses:
    /// the warp kernels have no 16, and the start-up check does not run it). A trial
    /// ([`Family::trial`]), checked like [`StepKernel::Backend`]; where it is on it runs
    /// instead of the tiles.
    AttentionMma,
    /// The step backend's LM head keeping a chunk's probabilities from its forward for its
    /// backward (`head_probs`, `head_grad_kept`), chunks of at most 1 GiB: the backward's
    /// product that recomputes the logits is gone. A trial ([`Family::trial`]), checked
    /// like [`StepKernel::Backend`]; without it, the backward recomputes each block's
    /// logits.
    HeadKept,
    /// The step backend's products with their epilogues inside them (cuBLASLt): the
    /// linear layers' bias, the MLP's bias and GELU (its pre-activation kept as the
    /// product's auxiliary output), GELU's gradient in the product that reaches it, and
    /// each bias's gradient in its weight's gradient product
    /// ([`crate::backend::Epilogue`]). A trial ([`Family::trial`]), checked like
    /// [`StepKernel::Backend`]; without it, or for a call cuBLASLt has no algorithm for,
    /// the kernels each epilogue replaces (`broadcast_rows`, `gelu_fwd`, `gelu_bwd`,
    /// `column_partials`).
    Epilogues,
}

impl Family for StepKernel {
    const ALL: &'static [StepKernel] = &[
        StepKernel::Backend,
        StepKernel::AttentionTiles,
        StepKernel::AttentionMma,
        StepKernel::HeadKept,
        StepKernel::Epilogues,
    ];

    fn name(self) -> &'static str {
        match self {
            StepKernel::Backend => "step_backend",
            StepKernel::AttentionTiles => "step_attention_tiles",
            StepKernel::AttentionMma => "step_attention_mma",
            StepKernel::HeadKept => "step_head_kept",
            StepKernel::Epilogues => "step_epilogues",
        }
    }

    fn trial(self) -> bool {
        matches!(
            self,
            StepKernel::AttentionTiles
                | StepKernel::AttentionMma
                | StepKernel::HeadKept
                | StepKernel::Epilogues
        )
    }

    /// The trials run only inside the step backend.
    fn needs(self) -> Option<StepKernel> {
        match self {
            StepKernel::Backend => None,
            _ => Some(StepKernel::Backend),
        }
    }
}

/// Which of the step's families a device runs.
pub type StepKernels = Switches<StepKernel>;

/// The attention's kernels that `kernels` turn on: the tensor cores' where
/// `step_attention_mma` is on, else the tiles' where `step_attention_tiles` is, else a warp
/// per row and head.
pub fn attention_form(kernels: &StepKernels) -> crate::launch::AttentionForm {
    use crate::launch::AttentionForm;
    if kernels.enabled(StepKernel::AttentionMma) {
        AttentionForm::Mma
    } else if kernels.enabled(StepKernel::AttentionTiles) {
        AttentionForm::Tiles
    } else {
        AttentionForm::Warp
    }
}

/// Every kernel family's name of the learner's crates: the model's and the step's, for
/// checking a command line's choice.
pub fn names() -> Vec<&'static str> {
    let mut all = rookworld_lm::kernels::names::<rookworld_lm::kernels::Kernel>();
    all.extend(rookworld_lm::kernels::names::<StepKernel>());
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use StepKernel::*;
    use rookworld_lm::kernels::families_to_check;

    #[test]
    fn the_steps_trials_are_checked_inside_its_backend_only() {
        let step = StepKernel::ALL;
        assert_eq!(families_to_check(step, &[], &[]), [Backend]);
        assert_eq!(families_to_check(step, step, &[]), step);
        assert_eq!(families_to_check(step, step, &[Backend]), []);
        assert_eq!(
            families_to_check(step, &[HeadKept], &[]),
            [Backend, HeadKept]
        );
        // The names the command line takes: the model's and the step's, none twice.
        let all = names();
        assert!(all.contains(&"step_head_kept") && all.contains(&"grouped_attention"));
        let mut unique = all.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), all.len());

        let choice =
            KernelChoice::parse(Some("step_head_kept"), Some("train_ops"), false, &all).unwrap();
        let kernels = StepKernels::chosen(&choice);
        assert!(kernels.enabled(Backend) && kernels.enabled(HeadKept));
        assert!(!kernels.enabled(AttentionTiles));
        assert_eq!(kernels.disabled(), [], "train_ops is the model's");
    }

    #[test]
    fn the_tensor_cores_attention_runs_where_it_is_on_the_tiles_otherwise() {
        use crate::launch::AttentionForm;
        let all = names();
        let form = |on: &str| {
            let choice = KernelChoice::parse(Some(on), None, false, &all).unwrap();
            attention_form(&StepKernels::chosen(&choice))
        };
        assert_eq!(form("step_head_kept"), AttentionForm::Warp);
        assert_eq!(form("step_attention_tiles"), AttentionForm::Tiles);
        assert_eq!(form("step_attention_mma"), AttentionForm::Mma);
        assert_eq!(
            form("step_attention_tiles,step_attention_mma"),
            AttentionForm::Mma
        );
    }
}
