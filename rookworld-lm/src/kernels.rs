//! Which of this project's CUDA kernels the process uses. Opening a CUDA device runs the
//! start-up check (`cuda::startup_check`): every PTX module is loaded and each kernel
//! family runs once on a small random input against its reference on the same inputs.
//! A family that fails to load or disagrees beyond its tolerance is logged as one ERROR
//! naming it and turned off here for the rest of the process: its dispatch points
//! ([`enabled`]) take candle's composed ops instead — slower, but correct. With
//! [`set_strict`] (`--strict-kernels`) such a finding is an error instead.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{Error, Result};

/// A family of this project's CUDA kernels, each with its own candle fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// `grouped_attention` (`kernels/grouped_attention.cu`); without it a decode step runs
    /// the composed attention (and no fused decode ops, which need its geometry).
    Attention,
    /// `sample_rows` (`kernels/sample.cu`); without it rows sample on the host.
    Sampling,
    /// The fused decode ops (`kernels/decode_ops.cu`); without them, candle's ops.
    DecodeOps,
    /// The training ops and AdamW (`kernels/train_ops.cu`); without them, candle's
    /// composed ops and their autograd backwards, and the composed AdamW.
    TrainOps,
    /// `grouped_attention_split` (`kernels/grouped_attention.cu`): the decode attention
    /// with each row's keys split across a block's warps and read in 16-byte loads. A
    /// trial kernel ([`Kernel::trial`]): off unless [`ENABLE_ENV`] names it; without it,
    /// `grouped_attention`.
    SplitAttention,
    /// The CUDA backend of the learner's fused pass (`rookworld-train/kernels/pass.cu`),
    /// checked against the CPU backend when `--step-path fused` chooses it; without it,
    /// candle's autograd.
    StepBackend,
    /// A weight push written into the worker's own device buffers, copied from
    /// page-locked memory in one transfer (`cuda::upload`, `checkpoint::refill_in_place`).
    /// A trial ([`Kernel::trial`]); without it each version is a new model, uploaded in one
    /// copy from pageable memory.
    WeightsInPlace,
    /// The decode step captured as one CUDA graph per bucket of rows, the sampler inside
    /// it (`cuda::DecodeGraphs`, the `row_attention`, `qkv_split_step` and `embed_rows`
    /// kernels). A trial ([`Kernel::trial`]); without it, the decode step's launches one by
    /// one from the host.
    DecodeGraphs,
    /// The step backend's attention a tile of rows per block, each chunk of keys (or, for
    /// the keys' gradients, of query rows) read once for the tile through shared memory
    /// (`attention_tile_*` in `rookworld-train/kernels/pass.cu`), heads of width 32 or
    /// 64. A trial ([`Kernel::trial`]), checked like [`Kernel::StepBackend`]; without it,
    /// a warp per row and head walks its keys from device memory.
    StepAttentionTiles,
    /// The step backend's LM head keeping a chunk's probabilities from its forward for its
    /// backward (`head_probs`, `head_grad_kept` in `rookworld-train/kernels/pass.cu`),
    /// chunks of at most 1 GiB: the backward's product that recomputes the logits is gone.
    /// A trial ([`Kernel::trial`]), checked like [`Kernel::StepBackend`]; without it, the
    /// backward recomputes each block's logits.
    StepHeadKept,
}

impl Kernel {
    pub const ALL: [Kernel; 10] = [
        Kernel::Attention,
        Kernel::Sampling,
        Kernel::DecodeOps,
        Kernel::TrainOps,
        Kernel::SplitAttention,
        Kernel::StepBackend,
        Kernel::WeightsInPlace,
        Kernel::DecodeGraphs,
        Kernel::StepAttentionTiles,
        Kernel::StepHeadKept,
    ];

    /// A family that runs only when [`ENABLE_ENV`] names it, until a GPU run has passed
    /// its check and timed it; the start-up check still checks it when it is named.
    pub fn trial(self) -> bool {
        matches!(
            self,
            Kernel::SplitAttention
                | Kernel::WeightsInPlace
                | Kernel::DecodeGraphs
                | Kernel::StepAttentionTiles
                | Kernel::StepHeadKept
        )
    }

    /// The name logs, metrics and errors use.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Attention => "grouped_attention",
            Kernel::Sampling => "sample_rows",
            Kernel::DecodeOps => "decode_ops",
            Kernel::TrainOps => "train_ops",
            Kernel::SplitAttention => "grouped_attention_split",
            Kernel::StepBackend => "step_backend",
            Kernel::WeightsInPlace => "weights_in_place",
            Kernel::DecodeGraphs => "decode_graphs",
            Kernel::StepAttentionTiles => "step_attention_tiles",
            Kernel::StepHeadKept => "step_head_kept",
        }
    }
}

/// What the start-up check found wrong with one kernel family.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub kernel: Kernel,
    /// e.g. `max |Δ| 0.31 against 1e-4` or the load error.
    pub problem: String,
}

/// The process's switches: which families are off, which trial families are on, how
/// many were turned off, strictness.
#[derive(Debug, Default)]
pub struct Switches {
    off: [AtomicBool; Kernel::ALL.len()],
    trial_on: [AtomicBool; Kernel::ALL.len()],
    fallbacks: AtomicU64,
    strict: AtomicBool,
}

fn index(kernel: Kernel) -> usize {
    Kernel::ALL.iter().position(|&k| k == kernel).unwrap_or(0)
}

impl Switches {
    pub const fn new() -> Self {
        Self {
            off: [const { AtomicBool::new(false) }; Kernel::ALL.len()],
            trial_on: [const { AtomicBool::new(false) }; Kernel::ALL.len()],
            fallbacks: AtomicU64::new(0),
            strict: AtomicBool::new(false),
        }
    }

    fn slot(&self, kernel: Kernel) -> &AtomicBool {
        &self.off[index(kernel)]
    }

    /// Turns trial families on (`ROOKWORLD_ENABLE_KERNELS`), with a line each; naming a
    /// family that is not a trial changes nothing.
    pub fn turn_on(&self, kernels: &[Kernel]) {
        for &k in kernels.iter().filter(|k| k.trial()) {
            tracing::info!(
                kernel = k.name(),
                "trial CUDA kernel turned on by {ENABLE_ENV}"
            );
            self.trial_on[index(k)].store(true, Ordering::Relaxed);
        }
    }

    /// Whether a trial family is on (every other family counts as on).
    fn chosen(&self, kernel: Kernel) -> bool {
        !kernel.trial() || self.trial_on[index(kernel)].load(Ordering::Relaxed)
    }

    /// Turns `kernel` off, counting it the first time only.
    fn off(&self, kernel: Kernel) {
        if !self.slot(kernel).swap(true, Ordering::Relaxed) {
            self.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn enabled(&self, kernel: Kernel) -> bool {
        self.chosen(kernel) && !self.slot(kernel).load(Ordering::Relaxed)
    }

    /// The families turned off so far (a trial family not turned on is not one of them).
    pub fn disabled(&self) -> Vec<Kernel> {
        Kernel::ALL
            .into_iter()
            .filter(|&k| self.slot(k).load(Ordering::Relaxed))
            .collect()
    }

    /// Applies a start-up check's findings: each is logged as one ERROR naming the kernel
    /// and device, counted, and its family turned off — or, when strict, the first is
    /// returned as an error and nothing is turned off. Findings of a trial family that is
    /// not on are left out: nothing runs it.
    pub fn apply(&self, device: &str, findings: &[Finding]) -> Result<()> {
        let findings: Vec<&Finding> = findings.iter().filter(|f| self.chosen(f.kernel)).collect();
        if let Some(f) = findings.first()
            && self.strict.load(Ordering::Relaxed)
        {
            return Err(Error::InvalidArgument(format!(
                "the {} kernel failed its start-up check on {device}: {} (--strict-kernels; \
                 without it the process would use candle's ops for it)",
                f.kernel.name(),
                f.problem
            )));
        }
        for f in findings {
            tracing::error!(
                kernel = f.kernel.name(),
                device,
                problem = %f.problem,
                "a CUDA kernel failed its start-up check; using candle's ops for it from now on"
            );
            self.off(f.kernel);
        }
        Ok(())
    }

    /// Turns `kernels` off on request (`ROOKWORLD_DISABLE_KERNELS`), with a warning each.
    pub fn turn_off(&self, kernels: &[Kernel]) {
        for &k in kernels {
            tracing::warn!(
                kernel = k.name(),
                "CUDA kernel turned off by {DISABLE_ENV}; using candle's ops for it"
            );
            self.off(k);
        }
    }

    #[cfg(test)]
    fn set_strict_for_test(&self, strict: bool) {
        self.strict.store(strict, Ordering::Relaxed);
    }

    /// Kernel families turned off since the process started.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }
}

/// The environment variable that turns kernel families off on purpose: a comma-separated
/// list of names ([`Kernel::name`]) or `all`. For running candle's path where a kernel
/// misbehaves in a way its check does not catch, and for measuring what each one buys.
pub const DISABLE_ENV: &str = "ROOKWORLD_DISABLE_KERNELS";

/// The environment variable that turns trial families on ([`Kernel::trial`]): a
/// comma-separated list of their names, or `all`.
pub const ENABLE_ENV: &str = "ROOKWORLD_ENABLE_KERNELS";

/// The families `value` (of [`DISABLE_ENV`]) names; an unknown name is an error naming
/// the known ones.
pub fn parse_disabled(value: &str) -> Result<Vec<Kernel>> {
    parse_kernels(DISABLE_ENV, value)
}

/// The families `value` of environment variable `var` names ([`DISABLE_ENV`],
/// [`ENABLE_ENV`]); an unknown name is an error naming the known ones.
pub fn parse_kernels(var: &str, value: &str) -> Result<Vec<Kernel>> {
    let mut out = Vec::new();
    for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if name == "all" {
            return Ok(Kernel::ALL.to_vec());
        }
        match Kernel::ALL.into_iter().find(|k| k.name() == name) {
            Some(k) => out.push(k),
            None => {
                let known: Vec<_> = Kernel::ALL.iter().map(|k| k.name()).collect();
                return Err(Error::InvalidArgument(format!(
                    "{var}: unknown kernel `{name}` (known: {}, or all)",
                    known.join(", ")
                )));
            }
        }
    }
    Ok(out)
}

/// The process's switches.
pub static SWITCHES: Switches = Switches::new();

/// Whether `kernel` may run (it passed the start-up check, or none has run).
pub fn enabled(kernel: Kernel) -> bool {
    SWITCHES.enabled(kernel)
}

/// Makes a start-up check's finding an error rather than a fallback (`--strict-kernels`).
pub fn set_strict(strict: bool) {
    SWITCHES.strict.store(strict, Ordering::Relaxed);
}

/// One family's result against its tolerance: a finding where it is over, or not a
/// number (a NaN never passes).
pub fn judge(kernel: Kernel, figure: &str, value: f64, tolerance: f64) -> Option<Finding> {
    (value.is_nan() || value > tolerance).then(|| Finding {
        kernel,
        problem: format!("{figure} {value:.3e} against a tolerance of {tolerance:.0e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_turns_its_kernel_off_once_and_strict_refuses_instead() {
        let switches = Switches::new();
        let forced = [
            judge(Kernel::Sampling, "log-prob max |Δ|", 0.5, 1e-3).unwrap(),
            judge(Kernel::TrainOps, "max rel. error", f64::NAN, 1e-3).unwrap(),
        ];
        assert!(judge(Kernel::Attention, "max |Δ|", 1e-6, 1e-4).is_none());
        assert!(
            forced[0].problem.contains("5.000e-1"),
            "{}",
            forced[0].problem
        );

        switches.strict.store(true, Ordering::Relaxed);
        let err = switches.apply("cuda:0", &forced).unwrap_err().to_string();
        assert!(
            err.contains("sample_rows") && err.contains("--strict-kernels"),
            "{err}"
        );
        assert!(
            Kernel::ALL
                .iter()
                .filter(|k| !k.trial())
                .all(|&k| switches.enabled(k)),
            "nothing turned off"
        );

        switches.strict.store(false, Ordering::Relaxed);
        switches.apply("cuda:0", &forced).unwrap();
        switches.apply("cuda:0", &forced[..1]).unwrap(); // a second open: counted once
        assert_eq!(switches.disabled(), [Kernel::Sampling, Kernel::TrainOps]);
        assert_eq!(switches.fallbacks(), 2);
        assert!(switches.enabled(Kernel::Attention) && switches.enabled(Kernel::DecodeOps));
        switches.turn_off(&[Kernel::Attention, Kernel::Sampling]);
        assert_eq!(switches.fallbacks(), 3);
        assert!(!switches.enabled(Kernel::Attention));
    }

    #[test]
    fn a_trial_kernel_runs_only_when_turned_on() {
        let switches = Switches::new();
        assert!(Kernel::SplitAttention.trial() && !Kernel::Attention.trial());
        assert!(!switches.enabled(Kernel::SplitAttention));
        assert!(switches.enabled(Kernel::Attention));
        assert_eq!(switches.disabled(), [], "not turned on is not a fallback");
        let bad = [judge(Kernel::SplitAttention, "bf16 max |Δ|", 1.0, 2e-2).unwrap()];
        switches.set_strict_for_test(true);
        switches.apply("cuda:0", &bad).unwrap(); // nothing runs it: left out, even strict
        switches.set_strict_for_test(false);
        assert_eq!(switches.fallbacks(), 0);

        switches.turn_on(&[Kernel::SplitAttention, Kernel::Sampling]);
        assert!(switches.enabled(Kernel::SplitAttention));
        switches.apply("cuda:0", &bad).unwrap();
        assert!(
            !switches.enabled(Kernel::SplitAttention),
            "failed its check: off"
        );
        assert_eq!(switches.disabled(), [Kernel::SplitAttention]);
        assert_eq!(switches.fallbacks(), 1);
        assert_eq!(
            parse_kernels(ENABLE_ENV, "grouped_attention_split").unwrap(),
            [Kernel::SplitAttention]
        );
        let err = parse_kernels(ENABLE_ENV, "split").unwrap_err().to_string();
        assert!(err.starts_with(ENABLE_ENV), "{err}");
    }

    #[test]
    fn the_environment_names_kernels_to_turn_off() {
        assert_eq!(parse_disabled("").unwrap(), []);
        assert_eq!(
            parse_disabled("sample_rows, train_ops").unwrap(),
            [Kernel::Sampling, Kernel::TrainOps]
        );
        assert_eq!(parse_disabled("all").unwrap(), Kernel::ALL);
        let err = parse_disabled("sampler").unwrap_err().to_string();
        assert!(
            err.contains("`sampler`") && err.contains("grouped_attention"),
            "{err}"
        );
    }
}
