//! Choosing the device and dtype from command-line style names, and what is kept once per
//! device for the process ([`PerDevice`]).

use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device};

use crate::cpu_gemm::PanelDtype;

use crate::error::{Error, Result};
use crate::kernels::{KernelChoice, Kernels};

/// `cpu`, `cuda`, `cuda:N` or `auto` (CUDA device 0 when usable, else the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda(usize),
    Auto,
}

impl FromStr for DeviceChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::InvalidArgument(format!(
                "unknown device `{s}` (use cpu, cuda, cuda:N or auto)"
            ))
        };
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda(0)),
            "auto" => Ok(Self::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(bad),
        }
    }
}

impl DeviceChoice {
    /// Opens the device and judges this crate's CUDA kernels on it: on CUDA the start-up
    /// check of the families `choice` leaves on ([`crate::kernels`]), whose verdict is
    /// the [`Kernels`] returned, for the model and what runs beside it. CUDA asked for but
    /// absent is an error naming the reason; `auto` falls back to the CPU and logs why.
    pub fn open(self, choice: &KernelChoice) -> Result<(Device, Kernels)> {
        let device = self.open_device()?;
        let kernels = judge_kernels(&device, choice)?;
        Ok((device, kernels))
    }

    /// Opens the device again beside an open of it whose verdict is `judged`, without
    /// checking its kernels again: its own stream (and cuBLAS handle) on the same GPU, the
    /// same verdict (e.g. `learner train --local`'s worker beside the learner).
    pub fn open_beside(self, judged: &Kernels) -> Result<(Device, Kernels)> {
        Ok((self.open_device()?, judged.clone()))
    }

    fn open_device(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => open_cuda(ordinal),
            Self::Auto => match open_cuda(0) {
                Ok(device) => Ok(device),
                Err(reason) => {
                    tracing::warn!("--device auto: {reason}; using the CPU");
                    Ok(Device::Cpu)
                }
            },
        }
    }
}

/// The verdict on this crate's kernels for `device`: on the CPU none runs
/// ([`Kernels::cpu`]); on CUDA the start-up check's.
fn judge_kernels(device: &Device, choice: &KernelChoice) -> Result<Kernels> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => startup_check(device, choice),
        _ => {
            let _ = choice;
            Ok(Kernels::cpu())
        }
    }
}

/// Compute capability the CUDA kernels were built for (`CUDA_COMPUTE_CAP` at build time).
#[cfg(feature = "cuda")]
pub const BUILT_COMPUTE_CAP: &str = match option_env!("CUDA_COMPUTE_CAP") {
    Some(cap) => cap,
    None => "unknown (CUDA_COMPUTE_CAP unset at build time)",
};

/// Opens CUDA device `ordinal` and runs a tiny kernel on it, so that a build without
/// kernels for this GPU fails here, naming both the GPU's and the build's capability,
/// instead of in the middle of a run.
#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device> {
    // One stream of its own, not candle's default per-thread stream: models are built,
    // weights swapped in and casts run on one host thread and the engine runs them on
    // another, and only work on one stream is ordered without a synchronisation. Each
    // open is its own stream and cuBLAS handle (the learner and an in-process worker).
    let device = Device::new_cuda_with_stream(ordinal).map_err(|e| {
        Error::InvalidArgument(format!("CUDA device {ordinal} is unavailable: {e}"))
    })?;
    if let Device::Cuda(cuda) = &device {
        // A stream of its own puts cudarc in multi-stream mode, where every buffer gets
        // two CUDA events and every use of it a wait and a record: about ten driver calls
        // around each launch, which made the decode step host-bound (2.15 ms of launches
        // for 1.03 ms of kernels on an H200).
        // SAFETY: the events order uses of a buffer across streams; here there is one.
        // Every tensor of this device is used on its stream only (candle refuses ops that
        // mix devices, and each open is its own device), cuBLAS and cuRAND run on it too,
        // and frees are stream-ordered (`cuMemFreeAsync` on it), so stream order alone
        // serialises every use. Called before the first tensor of the device exists.
        unsafe { cuda.disable_event_tracking() };
        keep_pool_memory(cuda);
    }
    let probe = candle_core::Tensor::ones(8, DType::F32, &device)
        .and_then(|t| t.affine(2.0, 1.0))
        .and_then(|t| t.sum_all())
        .and_then(|t| t.to_scalar::<f32>());
    match probe {
        Ok(_) => Ok(device),
        Err(e) => {
            let gpu = match &device {
                Device::Cuda(d) => d
                    .cuda_stream()
                    .context()
                    .compute_capability()
                    .map(|(major, minor)| {
                        format!("{major}.{minor} (CUDA_COMPUTE_CAP={major}{minor})")
                    })
                    .unwrap_or_else(|_| "unknown".into()),
                _ => "unknown".into(),
            };
            Err(Error::InvalidArgument(format!(
                "CUDA device {ordinal} cannot run this build's kernels: the GPU has compute \
                 capability {gpu}, the kernels were built for {BUILT_COMPUTE_CAP}; rebuild with \
                 the GPU's CUDA_COMPUTE_CAP ({e})"
            )))
        }
    }
}

/// Makes the device's memory pool keep what is freed across synchronisations. Every
/// candle op allocates its output from the pool (`cuMemAllocAsync`) and frees it there;
/// with the default release threshold (0) the pool hands all free memory back to the
/// driver at each synchronisation — a decode step ends with one — and the next step's
/// allocations map it again. Memory then stays with the process up to its peak use, as
/// in PyTorch's caching allocator. Best effort: a device without pools keeps its
/// synchronous allocations.
#[cfg(feature = "cuda")]
fn keep_pool_memory(device: &candle_core::CudaDevice) {
    use candle_core::cuda::cudarc::driver::{result, sys};
    let context = device.cuda_stream().context().clone();
    let kept = context.bind_to_thread().and_then(|()| {
        // SAFETY: the device handle comes from the context just bound, and the release
        // threshold's value is a u64, as the attribute takes it.
        unsafe {
            let pool = result::device::get_mem_pool(context.cu_device())?;
            let mut threshold = u64::MAX;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut threshold).cast(),
            )
        }
    });
    if let Err(e) = kept {
        tracing::debug!("CUDA memory pool keeps its default release threshold: {e}");
    }
}

/// How logs and errors name `device`: `cuda:N` as `--device` takes it.
pub fn name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}"),
    }
}

/// The start-up check of this crate's kernels ([`crate::kernels`]) on `device`, of the
/// families `choice` leaves on: a kernel that fails it is off in the verdict returned
/// (or, strict, the open fails). A fault that poisons the CUDA context ends the process
/// in one line naming the family whose check raised it: nothing — no fallback, no other
/// device choice — could run in that context.
#[cfg(feature = "cuda")]
fn startup_check(device: &Device, choice: &KernelChoice) -> Result<Kernels> {
    use crate::kernels::Family;
    let name = name(device);
    let kernels = Kernels::chosen(choice);
    let started = std::time::Instant::now();
    let families = kernels.to_check(&crate::kernels::CHECKED_FAMILIES);
    // The decode graphs' reference step runs op by op on the kernels this choice keeps.
    let findings = crate::cuda::startup_findings(device, &families, &kernels)
        .unwrap_or_else(|lost| crate::kernels::end_process(&lost));
    kernels.apply(&name, &findings)?;
    tracing::info!(
        device = %name,
        seconds = started.elapsed().as_secs_f64(),
        checked = ?families.iter().map(|k| k.name()).collect::<Vec<_>>(),
        disabled = ?kernels.disabled().iter().map(|k| k.name()).collect::<Vec<_>>(),
        "CUDA kernels checked against their references"
    );
    Ok(kernels)
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> Result<Device> {
    Err(Error::InvalidArgument(format!(
        "CUDA device {ordinal} requested, but this binary was built without the `cuda` feature \
         (rebuild with `--features cuda`, or use --device cpu)"
    )))
}

/// What is made once per device and kept for the process: the first caller for a device
/// (`K`: its ordinal) makes it, every later one gets the same. Held in a `static`, nothing
/// made is ever dropped — what is kept this way (the captured decode step's stream, cuBLAS
/// handle and workspace) would synchronise the whole device on its way out.
#[derive(Debug)]
pub struct PerDevice<K, V> {
    made: Mutex<Vec<(K, Arc<V>)>>,
}

impl<K: PartialEq + Copy, V> PerDevice<K, V> {
    pub const fn new() -> Self {
        Self {
            made: Mutex::new(Vec::new()),
        }
    }

    /// `device`'s value, made by `make` when there is none yet. A failure to make it is
    /// returned and nothing is kept, so that a later call tries again. Callers for other
    /// devices wait while one is made (it happens once per device).
    pub fn get_or_try_make<E>(
        &self,
        device: K,
        make: impl FnOnce() -> std::result::Result<V, E>,
    ) -> std::result::Result<Arc<V>, E> {
        let mut made = self.made.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, value)) = made.iter().find(|(k, _)| *k == device) {
            return Ok(value.clone());
        }
        let value = Arc::new(make()?);
        made.push((device, value.clone()));
        Ok(value)
    }
}

impl<K: PartialEq + Copy, V> Default for PerDevice<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

/// `f32`, `f16` or `bf16` (also `float32`, `float16`, `bfloat16`).
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" | "half" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => Err(Error::InvalidArgument(format!(
            "unknown dtype `{other}` (use f32, f16 or bf16)"
        ))),
    }
}

/// How an inference model holds its weights and so runs its matmuls: `--weight-dtype
/// auto|f32|bf16|f16|int8` of the commands that load a model for generation (the rollout
/// worker, `learner eval`). Not the learner's step, whose products have a setting of their
/// own (`--matmul-precision`).
///
/// | weight dtype | CUDA | CPU with AVX2/FMA |
/// | --- | --- | --- |
/// | `auto` | BF16 weights | as `bf16` |
/// | `f32` | f32 weights (TF32 allowed) | f32 weights, f32 panels |
/// | `bf16` | BF16 weights | f32 weights and activations, BF16 panels for every matmul |
/// | `f16` | F16 weights | F16 weights (candle's matmul) |
/// | `int8` | (refused) | f32 activations, INT8 panels: each weight column quantized to 7 bits once, each input row to 8 at every product |
///
/// On the CPU, `bf16` keeps activations, layer-norm and softmax statistics and the
/// log-probs in f32 and only the packed matmul weights in BF16 ([`crate::cpu_gemm`]): half
/// the panels' memory and bytes per step, faster on every CPU measured, and for a
/// learner's BF16 pushes the very same products as f32 panels (so `auto` chooses it). A
/// CPU without AVX2/FMA gets candle's BF16 tensors for `bf16`, f32 for `auto`. `int8` is
/// an approximation the sampler's log-probs carry (the learner's off-policy correction
/// weighs it): opt-in, CPU only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDtype {
    Auto,
    F32,
    Bf16,
    F16,
    Int8,
}

impl std::str::FromStr for WeightDtype {
    type Err = Error;

    /// `auto`, `f32`, `bf16`, `f16` or `int8` (also `float32`, `bfloat16`, `float16`).
    fn from_str(name: &str) -> Result<Self> {
        Ok(match name {
            "auto" => Self::Auto,
            "f32" | "float32" => Self::F32,
            "bf16" | "bfloat16" => Self::Bf16,
            "f16" | "float16" | "half" => Self::F16,
            "int8" => Self::Int8,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown weight dtype `{other}` (use auto, f32, bf16, f16 or int8)"
                )));
            }
        })
    }
}

impl WeightDtype {
    /// The weights' dtype and the CPU kernel's panels on `device`; `int8` where the packed
    /// kernel does not run is an error that says so.
    pub fn resolve(self, device: &Device) -> Result<(DType, PanelDtype)> {
        let packs = device.is_cpu() && crate::cpu_gemm::supported();
        Ok(match self {
            Self::Auto | Self::Bf16 if packs => (DType::F32, PanelDtype::Bf16),
            Self::Int8 if packs => (DType::F32, PanelDtype::Int8),
            Self::Auto => (default_dtype(device), PanelDtype::F32),
            Self::F32 => (DType::F32, PanelDtype::F32),
            Self::Bf16 => (DType::BF16, PanelDtype::F32),
            Self::F16 => (DType::F16, PanelDtype::F32),
            Self::Int8 => {
                return Err(Error::InvalidArgument(format!(
                    "--weight-dtype int8 runs on the CPU with AVX2/FMA only, not on {device:?}"
                )));
            }
        })
    }
}

/// The dtype a device runs best: f32 on the CPU, bf16 on CUDA.
pub fn default_dtype(device: &Device) -> DType {
    if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_and_dtypes() {
        assert_eq!("cpu".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cpu);
        assert_eq!(
            "cuda:1".parse::<DeviceChoice>().unwrap(),
            DeviceChoice::Cuda(1)
        );
        assert!("tpu".parse::<DeviceChoice>().is_err());
        assert_eq!(parse_dtype("bf16").unwrap(), DType::BF16);
        assert!(parse_dtype("f8").unwrap_err().to_string().contains("f8"));
    }

    #[test]
    fn what_is_kept_per_device_is_made_once_and_handed_to_every_later_caller() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static KEPT: PerDevice<usize, (usize, usize)> = PerDevice::new();
        let makes = AtomicUsize::new(0);
        let make = |device: usize| {
            let nth = makes.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>((device, nth))
        };
        // Two devices, eight threads each asking for both, four times: one make each.
        let got: Vec<Arc<(usize, usize)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    scope.spawn(|| {
                        (0..4)
                            .flat_map(|_| [0, 1])
                            .map(|d| KEPT.get_or_try_make(d, || make(d)).unwrap())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(makes.load(Ordering::SeqCst), 2, "one per device");
        for value in &got {
            let first = if value.0 == 0 { &got[0] } else { &got[1] };
            assert!(Arc::ptr_eq(value, first), "the same one each time");
        }
        assert_ne!(got[0].0, got[1].0);

        // A failure keeps nothing: the next caller makes it.
        let failing: PerDevice<usize, u32> = PerDevice::new();
        assert_eq!(failing.get_or_try_make(3, || Err("no")).unwrap_err(), "no");
        assert_eq!(*failing.get_or_try_make(3, || Ok::<_, &str>(7)).unwrap(), 7);
        assert_eq!(*failing.get_or_try_make(3, || Ok::<_, &str>(8)).unwrap(), 7);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_names_the_reason_and_auto_falls_back() {
        let choice = KernelChoice::default();
        let err = DeviceChoice::Cuda(0).open(&choice).unwrap_err().to_string();
        assert!(err.contains("without the `cuda` feature"), "{err}");
        assert!(DeviceChoice::Auto.open(&choice).unwrap().0.is_cpu());
    }
}
