//! Which of this project's CUDA kernels the process uses. Opening a CUDA device runs the
//! start-up check (`cuda::startup_check`) of the families that are on
//! ([`families_to_check`]): each runs once on a small random input against its reference
//! on the same inputs, and the device is synchronised after it, so that an asynchronous
//! error lands on the family that caused it. A family that fails to load or disagrees
//! beyond its tolerance is logged as one ERROR naming it and turned off here for the rest
//! of the process: its dispatch points ([`enabled`]) take candle's composed ops instead —
//! slower, but correct. With [`set_strict`] (`--strict-kernels`) such a finding is an
//! error instead. A fault that poisons the CUDA context ([`poisons_context`]) leaves no
//! fallback — every later call fails, candle's included — so it ends the process in one
//! line naming the family ([`ContextLost`], [`end_process`]).

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

    /// The family that must be on for this one to run: the split attention and the fused
    /// decode ops run only beside `grouped_attention` (they use its geometry), the step's
    /// trials only inside `step_backend`.
    pub fn needs(self) -> Option<Kernel> {
        match self {
            Kernel::SplitAttention | Kernel::DecodeOps => Some(Kernel::Attention),
            Kernel::StepAttentionTiles | Kernel::StepHeadKept => Some(Kernel::StepBackend),
            _ => None,
        }
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

/// The families the device's start-up check (`cuda::check_families`) covers, in the order
/// their checks run; the step's families are checked by the learner's.
pub const CHECKED_FAMILIES: [Kernel; 7] = [
    Kernel::Attention,
    Kernel::SplitAttention,
    Kernel::Sampling,
    Kernel::DecodeOps,
    Kernel::TrainOps,
    Kernel::WeightsInPlace,
    Kernel::DecodeGraphs,
];

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

    /// The trial families turned on.
    fn trials_on(&self) -> Vec<Kernel> {
        Kernel::ALL
            .into_iter()
            .filter(|&k| k.trial() && self.trial_on[index(k)].load(Ordering::Relaxed))
            .collect()
    }

    /// Which of `candidates` a start-up check runs now ([`families_to_check`] of these
    /// switches).
    pub fn to_check(&self, candidates: &[Kernel]) -> Vec<Kernel> {
        families_to_check(candidates, &self.trials_on(), &self.disabled())
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

/// Which of `candidates` a start-up check runs, in their order: the families that are on —
/// a trial family only when turned on (`trials_on`, [`ENABLE_ENV`]), none that is `off`
/// ([`DISABLE_ENV`], or a finding of an earlier device's check) — and whose
/// [`Kernel::needs`] is on too. A family that nothing runs is not checked: its check
/// would cost start-up time and could leave a fault in the context for nothing.
pub fn families_to_check(
    candidates: &[Kernel],
    trials_on: &[Kernel],
    off: &[Kernel],
) -> Vec<Kernel> {
    let on = |k: Kernel| (!k.trial() || trials_on.contains(&k)) && !off.contains(&k);
    candidates
        .iter()
        .copied()
        .filter(|&k| on(k) && k.needs().is_none_or(on))
        .collect()
}

/// Whether CUDA driver error `code` (a `CUresult`) poisons the context: the driver's
/// documentation says of these that the process is left in an inconsistent state and
/// every later CUDA call returns the same error (a kernel's illegal or misaligned access,
/// illegal instruction, hardware stack error, invalid PC or address space, failed
/// assertion, trap or timeout; an uncorrectable ECC or NVLink error, an error contained by
/// the GPU; a destroyed context). Any other error (out of memory, an invalid argument, a
/// launch the device cannot fit) leaves the context usable.
pub fn poisons_context(code: u32) -> bool {
    matches!(
        code,
        214 // CUDA_ERROR_ECC_UNCORRECTABLE
            | 220 // CUDA_ERROR_NVLINK_UNCORRECTABLE
            | 226 // CUDA_ERROR_CONTAINED
            | 700 // CUDA_ERROR_ILLEGAL_ADDRESS
            | 702 // CUDA_ERROR_LAUNCH_TIMEOUT
            | 709 // CUDA_ERROR_CONTEXT_IS_DESTROYED
            | 710 // CUDA_ERROR_ASSERT
            | 714 // CUDA_ERROR_HARDWARE_STACK_ERROR
            | 715 // CUDA_ERROR_ILLEGAL_INSTRUCTION
            | 716 // CUDA_ERROR_MISALIGNED_ADDRESS
            | 717 // CUDA_ERROR_INVALID_ADDRESS_SPACE
            | 718 // CUDA_ERROR_INVALID_PC
            | 719 // CUDA_ERROR_LAUNCH_FAILED
    )
}

/// An error a CUDA driver call returned: its `CUresult` and its name and description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverFault {
    pub code: u32,
    /// e.g. `CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered`.
    pub message: String,
}

/// A CUDA context poisoned by a fault ([`poisons_context`]): the device, the family whose
/// work ran since the last synchronisation (`None`: work before the kernel checks) and the
/// error. Its message is the one line the process ends with ([`end_process`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the CUDA context of {device} is lost: {} ({fault}); every later CUDA call fails, \
     so the process ends{}",
    culprit_words(*.family),
    hint(*.family),
    fault = .fault.message
)]
pub struct ContextLost {
    pub device: String,
    pub family: Option<Kernel>,
    pub fault: DriverFault,
}

fn culprit_words(family: Option<Kernel>) -> String {
    match family {
        Some(k) => format!("the {} kernel check faulted", k.name()),
        None => "work before the kernel checks faulted".into(),
    }
}

/// How to run without the family that faulted.
fn hint(family: Option<Kernel>) -> String {
    match family {
        Some(k) if k.trial() => format!(" (leave {} out of {ENABLE_ENV})", k.name()),
        Some(k) => format!(" (turn {} off with {DISABLE_ENV}={})", k.name(), k.name()),
        None => String::new(),
    }
}

/// What a synchronisation after `family`'s check (on `device`) reported: nothing; a
/// finding for the family (an error that leaves the context usable); or, for a fault
/// that poisons it, the lost context naming the family.
pub fn after_synchronize(
    device: &str,
    family: Option<Kernel>,
    fault: Option<DriverFault>,
) -> std::result::Result<Option<Finding>, ContextLost> {
    match fault {
        None => Ok(None),
        Some(fault) if poisons_context(fault.code) => Err(ContextLost {
            device: device.to_owned(),
            family,
            fault,
        }),
        Some(fault) => Ok(family.map(|kernel| Finding {
            kernel,
            problem: format!("did not run: synchronising after it: {}", fault.message),
        })),
    }
}

/// Ends the process on a lost context: its one line on stderr (`error: …`, as every
/// command's error) and exit status 1. Nothing else can run — candle's fallback included —
/// and a finding would only move the failure to the next CUDA call.
pub fn end_process(lost: &ContextLost) -> ! {
    eprintln!("error: {lost}");
    std::process::exit(1)
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
    fn only_the_families_that_are_on_are_checked() {
        use Kernel::*;
        let here = [
            Attention,
            SplitAttention,
            Sampling,
            DecodeOps,
            TrainOps,
            WeightsInPlace,
            DecodeGraphs,
        ];
        // By default: no trial, nothing off.
        assert_eq!(
            families_to_check(&here, &[], &[]),
            [Attention, Sampling, DecodeOps, TrainOps]
        );
        // Trials only when turned on; a family turned off not at all.
        assert_eq!(
            families_to_check(&here, &[DecodeGraphs, SplitAttention], &[Sampling]),
            [Attention, SplitAttention, DecodeOps, TrainOps, DecodeGraphs]
        );
        // What needs an attention that is off is not checked either.
        assert_eq!(
            families_to_check(&here, &[SplitAttention], &[Attention]),
            [Sampling, TrainOps]
        );
        // `all` in both: nothing left.
        assert_eq!(families_to_check(&here, &Kernel::ALL, &Kernel::ALL), []);
        // The step's: its trials inside step_backend only.
        let step = [StepBackend, StepAttentionTiles, StepHeadKept];
        assert_eq!(families_to_check(&step, &[], &[]), [StepBackend]);
        assert_eq!(families_to_check(&step, &step, &[]), step);
        assert_eq!(families_to_check(&step, &step, &[StepBackend]), []);
        assert_eq!(
            families_to_check(&step, &[StepHeadKept], &[]),
            [StepBackend, StepHeadKept]
        );
        // Every family's prerequisite is itself a family that is no trial.
        for k in Kernel::ALL {
            assert!(
                k.needs().is_none_or(|n| !n.trial() && n.needs().is_none()),
                "{k:?}"
            );
        }

        // The switches' own choice is the same function of their state.
        let switches = Switches::new();
        assert_eq!(
            switches.to_check(&here),
            [Attention, Sampling, DecodeOps, TrainOps]
        );
        switches.turn_on(&[DecodeGraphs, Sampling]);
        switches.turn_off(&[TrainOps]);
        assert_eq!(
            switches.to_check(&here),
            [Attention, Sampling, DecodeOps, DecodeGraphs]
        );
        let failed = [judge(Attention, "f32 max |Δ|", 1.0, 1e-4).unwrap()];
        switches.apply("cuda:0", &failed).unwrap(); // a second device checks less
        assert_eq!(switches.to_check(&here), [Sampling, DecodeGraphs]);
    }

    #[test]
    fn a_fault_that_poisons_the_context_ends_the_process_naming_its_family() {
        // Sticky: the context is dead. Not sticky: the call failed, the context lives.
        for code in [700, 702, 710, 714, 715, 716, 717, 718, 719, 214, 226] {
            assert!(poisons_context(code), "{code}");
        }
        for code in [
            0, 1, 2, 98, 200, 201, 209, 218, 400, 500, 600, 701, 720, 801, 999,
        ] {
            assert!(!poisons_context(code), "{code}");
        }
        let fault = |code: u32, name: &str| DriverFault {
            code,
            message: format!("{name}: what the driver says"),
        };

        assert_eq!(
            after_synchronize("cuda:0", Some(Kernel::Sampling), None),
            Ok(None)
        );
        let lost = after_synchronize(
            "cuda:1",
            Some(Kernel::DecodeGraphs),
            Some(fault(700, "CUDA_ERROR_ILLEGAL_ADDRESS")),
        )
        .unwrap_err();
        assert_eq!(lost.family, Some(Kernel::DecodeGraphs));
        let line = lost.to_string();
        assert!(!line.contains('\n'), "one line: {line}");
        assert!(
            line.contains("cuda:1")
                && line.contains("decode_graphs kernel check")
                && line.contains("CUDA_ERROR_ILLEGAL_ADDRESS")
                && line.contains(ENABLE_ENV),
            "{line}"
        );
        let line = after_synchronize(
            "cuda:0",
            Some(Kernel::TrainOps),
            Some(fault(716, "CUDA_ERROR_MISALIGNED_ADDRESS")),
        )
        .unwrap_err()
        .to_string();
        assert!(
            line.contains("train_ops kernel check")
                && line.contains(&format!("{DISABLE_ENV}=train_ops")),
            "{line}"
        );
        let line = after_synchronize("cuda:0", None, Some(fault(719, "CUDA_ERROR_LAUNCH_FAILED")))
            .unwrap_err()
            .to_string();
        assert!(line.contains("before the kernel checks"), "{line}");

        // An error that leaves the context usable is the family's finding (a fallback).
        let finding = after_synchronize(
            "cuda:0",
            Some(Kernel::Attention),
            Some(fault(701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")),
        )
        .unwrap()
        .unwrap();
        assert_eq!(finding.kernel, Kernel::Attention);
        assert!(
            finding.problem.contains("OUT_OF_RESOURCES"),
            "{}",
            finding.problem
        );
        assert_eq!(
            after_synchronize("cuda:0", None, Some(fault(2, "CUDA_ERROR_OUT_OF_MEMORY"))),
            Ok(None)
        );
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
