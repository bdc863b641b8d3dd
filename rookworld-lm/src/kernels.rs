//! Which of this project's CUDA kernels a device runs, as values: each crate names its
//! kernel families (a [`Family`]: this crate's [`Kernel`], the training step's in
//! `rookworld-train`), and a command line's choice ([`KernelChoice`]: `--enable-kernels`,
//! `--disable-kernels`, `--strict-kernels`, or their environment variables and run-file
//! keys) is parsed once. Opening a CUDA device ([`crate::device::DeviceChoice::open`])
//! runs the start-up check (`cuda::startup_check`) of the families the choice leaves on
//! ([`Switches::to_check`]): each runs once on a small random input against its reference
//! on the same inputs, and the device is synchronised after it, so that an asynchronous
//! error lands on the family that caused it. What the open returns ([`Kernels`]) is the
//! device's verdict, handed to the model, its caches, the sampler and the optimizer at
//! construction: a family that failed to load or disagreed beyond its tolerance is logged
//! as one ERROR naming it and is off in that value — its dispatch points take candle's
//! composed ops instead, slower but correct. With `--strict-kernels` such a finding is an
//! error instead. A fault that poisons the CUDA context ([`poisons_context`]) leaves no
//! fallback — every later call fails, candle's included — so it ends the process in one
//! line naming the family ([`ContextLost`], [`end_process`]). Nothing here is
//! process-wide: two devices, or two tests, hold two values.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{Error, Result};

/// A crate's kind of kernel family: a fixed list of names, each with a candle fallback.
pub trait Family: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// Every family, in a fixed order.
    const ALL: &'static [Self];

    /// The name logs, metrics, errors and the command line use.
    fn name(self) -> &'static str;

    /// A family that runs only when `--enable-kernels` ([`ENABLE_ENV`]) names it, until a
    /// GPU run has passed its check and timed it; its start-up check runs only then.
    fn trial(self) -> bool;

    /// The family that must be on for this one to run.
    fn needs(self) -> Option<Self>;
}

/// The names of `F`'s families, in their order.
pub fn names<F: Family>() -> Vec<&'static str> {
    F::ALL.iter().map(|k| k.name()).collect()
}

/// A family of this crate's CUDA kernels, each with its own candle fallback. (The
/// training step's families are `rookworld_train::kernels::StepKernel`.)
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
    /// trial ([`Family::trial`]); without it, `grouped_attention`.
    SplitAttention,
    /// A weight push written into the worker's own device buffers, copied from
    /// page-locked memory in one transfer (`cuda::upload`, `model_io::refill_in_place`).
    /// A trial ([`Family::trial`]); without it each version is a new model, uploaded in one
    /// copy from pageable memory.
    WeightsInPlace,
    /// The decode step captured as one CUDA graph per bucket of rows, the sampler inside
    /// it (`cuda::DecodeGraphs`, the `row_attention`, `qkv_split_step` and `embed_rows`
    /// kernels). A trial ([`Family::trial`]); without it, the decode step's launches one by
    /// one from the host.
    DecodeGraphs,
}

impl Family for Kernel {
    const ALL: &'static [Kernel] = &[
        Kernel::Attention,
        Kernel::Sampling,
        Kernel::DecodeOps,
        Kernel::TrainOps,
        Kernel::SplitAttention,
        Kernel::WeightsInPlace,
        Kernel::DecodeGraphs,
    ];

    fn trial(self) -> bool {
        matches!(
            self,
            Kernel::SplitAttention | Kernel::WeightsInPlace | Kernel::DecodeGraphs
        )
    }

    /// The split attention and the fused decode ops run only beside `grouped_attention`
    /// (they use its geometry).
    fn needs(self) -> Option<Kernel> {
        match self {
            Kernel::SplitAttention | Kernel::DecodeOps => Some(Kernel::Attention),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kernel::Attention => "grouped_attention",
            Kernel::Sampling => "sample_rows",
            Kernel::DecodeOps => "decode_ops",
            Kernel::TrainOps => "train_ops",
            Kernel::SplitAttention => "grouped_attention_split",
            Kernel::WeightsInPlace => "weights_in_place",
            Kernel::DecodeGraphs => "decode_graphs",
        }
    }
}

/// The families a device's start-up check (`cuda::check_families`) covers, in the order
/// their checks run.
pub const CHECKED_FAMILIES: [Kernel; 7] = [
    Kernel::Attention,
    Kernel::SplitAttention,
    Kernel::Sampling,
    Kernel::DecodeOps,
    Kernel::TrainOps,
    Kernel::WeightsInPlace,
    Kernel::DecodeGraphs,
];

/// What a start-up check found wrong with one kernel family.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding<F = Kernel> {
    pub kernel: F,
    /// e.g. `max |Δ| 0.31 against 1e-4` or the load error.
    pub problem: String,
}

/// The environment variable of `--disable-kernels`, which turns kernel families off on
/// purpose: a comma-separated list of names ([`Family::name`]) or `all`. For running
/// candle's path where a kernel misbehaves in a way its check does not catch, and for
/// measuring what each one buys.
pub const DISABLE_ENV: &str = "ROOKWORLD_DISABLE_KERNELS";

/// The environment variable of `--enable-kernels`, which turns trial families on
/// ([`Family::trial`]): a comma-separated list of their names, or `all`.
pub const ENABLE_ENV: &str = "ROOKWORLD_ENABLE_KERNELS";

/// A command line's choice of kernels, parsed once (`rookworld_lm::cli::KernelArgs`): the
/// trial families to turn on, the families to turn off, and whether a failed start-up
/// check is an error. Names are checked against every family the binary has; each
/// crate's [`Switches::chosen`] takes its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelChoice {
    enable: Vec<&'static str>,
    disable: Vec<&'static str>,
    strict: bool,
}

impl KernelChoice {
    /// The choice from `--enable-kernels` and `--disable-kernels` (each a comma-separated
    /// list of names, or `all`) and `--strict-kernels`; a name not in `known` (every
    /// family of the binary) is an error naming the known ones.
    pub fn parse(
        enable: Option<&str>,
        disable: Option<&str>,
        strict: bool,
        known: &[&'static str],
    ) -> Result<Self> {
        let list = |flag: &str, value: Option<&str>| match value {
            Some(v) => parse_names(flag, v, known),
            None => Ok(Vec::new()),
        };
        Ok(Self {
            enable: list("--enable-kernels", enable)?,
            disable: list("--disable-kernels", disable)?,
            strict,
        })
    }

    /// The families of `F` turned on (`--enable-kernels`).
    pub fn enabled<F: Family>(&self) -> Vec<F> {
        Self::families(&self.enable)
    }

    /// The families of `F` turned off (`--disable-kernels`).
    pub fn disabled<F: Family>(&self) -> Vec<F> {
        Self::families(&self.disable)
    }

    fn families<F: Family>(names: &[&'static str]) -> Vec<F> {
        F::ALL
            .iter()
            .copied()
            .filter(|k| names.contains(&k.name()))
            .collect()
    }
}

/// The names `value` (of `flag`: a comma-separated list, or `all`) gives, each one of
/// `known`; `all` is every one.
fn parse_names(flag: &str, value: &str, known: &[&'static str]) -> Result<Vec<&'static str>> {
    let mut out = Vec::new();
    for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if name == "all" {
            return Ok(known.to_vec());
        }
        match known.iter().find(|k| **k == name) {
            Some(k) => out.push(*k),
            None => {
                return Err(Error::InvalidArgument(format!(
                    "{flag}: unknown kernel `{name}` (known: {}, or all)",
                    known.join(", ")
                )));
            }
        }
    }
    Ok(out)
}

/// Which families of `F` one device runs: those its choice left on ([`Switches::chosen`])
/// less those its start-up check, or a later failure, turned off ([`Switches::apply`]).
/// Clones share one state: a family turned off for the device is off for every holder.
#[derive(Clone)]
pub struct Switches<F: Family> {
    state: Arc<State>,
    family: PhantomData<fn() -> F>,
}

/// This crate's families on one device: what the model, its caches, the sampler and
/// AdamW dispatch on.
pub type Kernels = Switches<Kernel>;

#[derive(Debug)]
struct State {
    off: Vec<AtomicBool>,
    trial_on: Vec<bool>,
    fallbacks: AtomicU64,
    strict: bool,
}

impl<F: Family> std::fmt::Debug for Switches<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on: Vec<&str> = F::ALL
            .iter()
            .filter(|&&k| self.enabled(k))
            .map(|k| k.name())
            .collect();
        f.debug_struct("Switches").field("on", &on).finish()
    }
}

impl<F: Family> Default for Switches<F> {
    /// [`Switches::none`].
    fn default() -> Self {
        Self::none()
    }
}

fn index<F: Family>(kernel: F) -> usize {
    F::ALL.iter().position(|&k| k == kernel).unwrap_or(0)
}

impl<F: Family> Switches<F> {
    fn with(trial_on: impl Fn(F) -> bool, off: impl Fn(F) -> bool, strict: bool) -> Self {
        Self {
            state: Arc::new(State {
                off: F::ALL.iter().map(|&k| AtomicBool::new(off(k))).collect(),
                trial_on: F::ALL.iter().map(|&k| trial_on(k)).collect(),
                fallbacks: AtomicU64::new(0),
                strict,
            }),
            family: PhantomData,
        }
    }

    /// What `choice` leaves on before any check: every family that is no trial, the
    /// trials it turns on (a line each), less the families it turns off (a warning
    /// each, counted as fallbacks).
    pub fn chosen(choice: &KernelChoice) -> Self {
        let on: Vec<F> = KernelChoice::families(&choice.enable);
        let off: Vec<F> = KernelChoice::families(&choice.disable);
        for k in on.iter().filter(|k| k.trial()) {
            tracing::info!(
                kernel = k.name(),
                "trial CUDA kernel turned on by --enable-kernels ({ENABLE_ENV})"
            );
        }
        for k in &off {
            tracing::warn!(
                kernel = k.name(),
                "CUDA kernel turned off by --disable-kernels ({DISABLE_ENV}); using candle's ops for it"
            );
        }
        let switches = Self::with(|k| on.contains(&k), |k| off.contains(&k), choice.strict);
        switches
            .state
            .fallbacks
            .store(off.len() as u64, Ordering::Relaxed);
        switches
    }

    /// Every family off: what a model holds until it is given its device's
    /// ([`crate::Gpt2::set_kernels`]) — on CUDA candle's ops everywhere, slower but
    /// correct. (The CPU's paths do not depend on it.)
    pub fn none() -> Self {
        Self::with(|_| false, |_| true, false)
    }

    /// A CPU device's: none of these CUDA kernels runs there (every dispatch point asks
    /// for CUDA first), so nothing is turned on, off or counted.
    pub fn cpu() -> Self {
        Self::with(|_| false, |_| false, false)
    }

    /// Every family on, trials included, nothing checked: for the start-up checks
    /// themselves and for tests that run the kernels.
    pub fn every() -> Self {
        Self::with(|_| true, |_| false, false)
    }

    /// Whether `kernel` may run: chosen (a trial turned on) and not turned off.
    pub fn enabled(&self, kernel: F) -> bool {
        self.chosen_on(kernel) && !self.state.off[index(kernel)].load(Ordering::Relaxed)
    }

    /// Whether a trial family is on (every other family counts as on).
    fn chosen_on(&self, kernel: F) -> bool {
        !kernel.trial() || self.state.trial_on[index(kernel)]
    }

    /// Whether a failed check is an error (`--strict-kernels`).
    pub fn strict(&self) -> bool {
        self.state.strict
    }

    /// Turns `kernel` off, counting it the first time only.
    fn off(&self, kernel: F) {
        if !self.state.off[index(kernel)].swap(true, Ordering::Relaxed) {
            self.state.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The trial families turned on.
    fn trials_on(&self) -> Vec<F> {
        F::ALL
            .iter()
            .copied()
            .filter(|&k| k.trial() && self.state.trial_on[index(k)])
            .collect()
    }

    /// Which of `candidates` a start-up check runs now ([`families_to_check`] of these
    /// switches).
    pub fn to_check(&self, candidates: &[F]) -> Vec<F> {
        families_to_check(candidates, &self.trials_on(), &self.disabled())
    }

    /// The families turned off (a trial family not turned on is not one of them).
    pub fn disabled(&self) -> Vec<F> {
        F::ALL
            .iter()
            .copied()
            .filter(|&k| self.state.off[index(k)].load(Ordering::Relaxed))
            .collect()
    }

    /// Applies a check's findings: each is logged as one ERROR naming the kernel and
    /// device, counted, and its family turned off — or, when strict, the first is
    /// returned as an error and nothing is turned off. Findings of a trial family that is
    /// not on are left out: nothing runs it.
    pub fn apply(&self, device: &str, findings: &[Finding<F>]) -> Result<()> {
        let findings: Vec<&Finding<F>> = findings
            .iter()
            .filter(|f| self.chosen_on(f.kernel))
            .collect();
        if let Some(f) = findings.first()
            && self.state.strict
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

    /// Families turned off since these switches were chosen (on request or by a check).
    pub fn fallbacks(&self) -> u64 {
        self.state.fallbacks.load(Ordering::Relaxed)
    }
}

/// Which of `candidates` a start-up check runs, in their order: the families that are on —
/// a trial family only when turned on (`trials_on`), none that is `off` (turned off by
/// the choice, or by a finding) — and whose [`Family::needs`] is on too. A family that
/// nothing runs is not checked: its check would cost start-up time and could leave a
/// fault in the context for nothing.
pub fn families_to_check<F: Family>(candidates: &[F], trials_on: &[F], off: &[F]) -> Vec<F> {
    let on = |k: F| (!k.trial() || trials_on.contains(&k)) && !off.contains(&k);
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

/// A family by name, as a lost context names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Named {
    pub name: &'static str,
    pub trial: bool,
}

impl Named {
    pub fn of<F: Family>(family: F) -> Self {
        Self {
            name: family.name(),
            trial: family.trial(),
        }
    }
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
    pub family: Option<Named>,
    pub fault: DriverFault,
}

fn culprit_words(family: Option<Named>) -> String {
    match family {
        Some(k) => format!("the {} kernel check faulted", k.name),
        None => "work before the kernel checks faulted".into(),
    }
}

/// How to run without the family that faulted.
fn hint(family: Option<Named>) -> String {
    match family {
        Some(k) if k.trial => format!(" (leave {} out of {ENABLE_ENV})", k.name),
        Some(k) => format!(" (turn {} off with {DISABLE_ENV}={})", k.name, k.name),
        None => String::new(),
    }
}

/// What a synchronisation after `family`'s check (on `device`) reported: nothing; a
/// finding for the family (an error that leaves the context usable); or, for a fault
/// that poisons it, the lost context naming the family.
pub fn after_synchronize<F: Family>(
    device: &str,
    family: Option<F>,
    fault: Option<DriverFault>,
) -> std::result::Result<Option<Finding<F>>, ContextLost> {
    match fault {
        None => Ok(None),
        Some(fault) if poisons_context(fault.code) => Err(ContextLost {
            device: device.to_owned(),
            family: family.map(Named::of),
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
pub fn judge<F: Family>(kernel: F, figure: &str, value: f64, tolerance: f64) -> Option<Finding<F>> {
    (value.is_nan() || value > tolerance).then(|| Finding {
        kernel,
        problem: format!("{figure} {value:.3e} against a tolerance of {tolerance:.0e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice(enable: &str, disable: &str, strict: bool) -> KernelChoice {
        KernelChoice::parse(Some(enable), Some(disable), strict, &names::<Kernel>()).unwrap()
    }

    #[test]
    fn a_mismatch_turns_its_kernel_off_once_and_strict_refuses_instead() {
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

        let strict = Kernels::chosen(&choice("", "", true));
        assert!(strict.strict());
        let err = strict.apply("cuda:0", &forced).unwrap_err().to_string();
        assert!(
            err.contains("sample_rows") && err.contains("--strict-kernels"),
            "{err}"
        );
        assert!(
            Kernel::ALL
                .iter()
                .filter(|k| !k.trial())
                .all(|&k| strict.enabled(k)),
            "nothing turned off"
        );

        let switches = Kernels::chosen(&KernelChoice::default());
        let holder = switches.clone(); // e.g. the model's
        switches.apply("cuda:0", &forced).unwrap();
        switches.apply("cuda:0", &forced[..1]).unwrap(); // a second finding: counted once
        assert_eq!(switches.disabled(), [Kernel::Sampling, Kernel::TrainOps]);
        assert_eq!(
            holder.disabled(),
            switches.disabled(),
            "clones share the verdict"
        );
        assert_eq!(switches.fallbacks(), 2);
        assert!(switches.enabled(Kernel::Attention) && switches.enabled(Kernel::DecodeOps));

        // Values, not a process's switches: another device's are its own.
        let other = Kernels::chosen(&choice("", "grouped_attention,sample_rows", false));
        assert_eq!(other.fallbacks(), 2);
        assert!(!other.enabled(Kernel::Attention) && other.enabled(Kernel::TrainOps));
        assert!(switches.enabled(Kernel::Attention));
    }

    #[test]
    fn a_trial_kernel_runs_only_when_turned_on() {
        let switches = Kernels::chosen(&KernelChoice::default());
        assert!(Kernel::SplitAttention.trial() && !Kernel::Attention.trial());
        assert!(!switches.enabled(Kernel::SplitAttention));
        assert!(switches.enabled(Kernel::Attention));
        assert_eq!(switches.disabled(), [], "not turned on is not a fallback");
        let bad = [judge(Kernel::SplitAttention, "bf16 max |Δ|", 1.0, 2e-2).unwrap()];
        let strict = Kernels::chosen(&choice("", "", true));
        strict.apply("cuda:0", &bad).unwrap(); // nothing runs it: left out, even strict
        assert_eq!(strict.fallbacks(), 0);

        let switches = Kernels::chosen(&choice("grouped_attention_split,sample_rows", "", false));
        assert!(switches.enabled(Kernel::SplitAttention));
        switches.apply("cuda:0", &bad).unwrap();
        assert!(
            !switches.enabled(Kernel::SplitAttention),
            "failed its check: off"
        );
        assert_eq!(switches.disabled(), [Kernel::SplitAttention]);
        assert_eq!(switches.fallbacks(), 1);

        assert!(Kernel::ALL.iter().all(|&k| Kernels::every().enabled(k)));
        assert!(Kernel::ALL.iter().all(|&k| !Kernels::none().enabled(k)));
        assert_eq!(Kernels::none().fallbacks(), 0);
    }

    #[test]
    fn only_the_families_that_are_on_are_checked() {
        use Kernel::*;
        let here = CHECKED_FAMILIES;
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
        assert_eq!(families_to_check(&here, Kernel::ALL, Kernel::ALL), []);
        // Every family's prerequisite is itself a family that is no trial.
        for &k in Kernel::ALL {
            assert!(
                k.needs().is_none_or(|n| !n.trial() && n.needs().is_none()),
                "{k:?}"
            );
        }
        // The check covers every family of this crate.
        assert_eq!(here.len(), Kernel::ALL.len());
        assert!(Kernel::ALL.iter().all(|k| here.contains(k)));

        // The switches' own choice is the same function of their state.
        let switches = Kernels::chosen(&KernelChoice::default());
        assert_eq!(
            switches.to_check(&here),
            [Attention, Sampling, DecodeOps, TrainOps]
        );
        let switches = Kernels::chosen(&choice("decode_graphs,sample_rows", "train_ops", false));
        assert_eq!(
            switches.to_check(&here),
            [Attention, Sampling, DecodeOps, DecodeGraphs]
        );
        let failed = [judge(Attention, "f32 max |Δ|", 1.0, 1e-4).unwrap()];
        switches.apply("cuda:0", &failed).unwrap(); // checked again: less
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
        assert_eq!(lost.family, Some(Named::of(Kernel::DecodeGraphs)));
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
        let line = after_synchronize(
            "cuda:0",
            None::<Kernel>,
            Some(fault(719, "CUDA_ERROR_LAUNCH_FAILED")),
        )
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
            after_synchronize(
                "cuda:0",
                None::<Kernel>,
                Some(fault(2, "CUDA_ERROR_OUT_OF_MEMORY"))
            ),
            Ok(None)
        );
    }

    #[test]
    fn the_command_line_names_kernels_known_to_the_binary() {
        let known = ["grouped_attention", "sample_rows", "step_backend"];
        let parse = |enable, disable| KernelChoice::parse(enable, disable, false, &known);
        assert_eq!(parse(None, Some("")).unwrap(), KernelChoice::default());
        let c = parse(Some("step_backend"), Some("sample_rows, grouped_attention")).unwrap();
        // Each crate takes the names of its own families.
        let k = Kernels::chosen(&c);
        assert_eq!(k.disabled(), [Kernel::Attention, Kernel::Sampling]);
        assert_eq!(parse(None, Some("all")).unwrap().disable, known);
        let err = parse(None, Some("sampler")).unwrap_err().to_string();
        assert!(
            err.starts_with("--disable-kernels: unknown kernel `sampler`")
                && err.contains("grouped_attention, sample_rows, step_backend"),
            "{err}"
        );
        let err = parse(Some("split"), None).unwrap_err().to_string();
        assert!(err.starts_with("--enable-kernels"), "{err}");
    }
}
