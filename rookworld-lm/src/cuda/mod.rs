//! The decode step's CUDA kernels, written in CUDA C (`kernels/*.cu`), compiled to PTX by
//! `build.rs` and loaded by the driver on first use:
//! - [`grouped_attention`]: a layer's attention over the grouped cache in one launch, each
//!   prompt's keys and values read once per group (`kernels/grouped_attention.cu`);
//! - [`sample_rows`]: every row's token and log-probability drawn on the device
//!   (`kernels/sample.cu`);
//! - [`ops`]: the small fused ops of [`crate::decode_ops`] (`kernels/decode_ops.cu`);
//! - `train`: what the launches of [`crate::train_ops`] share (each op's launches sit in
//!   its own module there, `kernels/train_ops.cu`);
//! - [`DecodeGraphs`]: the decode step captured as one CUDA graph per bucket of rows;
//! - [`upload`], [`download`]: host bytes to and from device memory in one transfer
//!   through page-locked memory (a weight push written into a worker's weights; the
//!   learner's bfloat16 copy of its weights).
//!
//! Each has a CPU reference ([`crate::cpu_attention`], [`crate::device_sampling`],
//! each module of [`crate::train_ops`]) that [`self_check`] compares it with on a GPU, and
//! [`startup_findings`] for the families that are on (opening the device), the device synchronised after each
//! ([`settle`]) so that a CUDA fault is named with the family that raised it.

mod attention;
mod check;
mod graph;
pub(crate) mod ops;
mod sample;
pub(crate) mod train;
mod transfer;

pub use attention::{AttentionKernel, DeviceGeometry, grouped_attention, grouped_attention_with};
pub use check::{
    CHECKED_FAMILIES, KernelCheck, check_families, self_check, settle, startup_findings,
};
pub use graph::DecodeGraphs;
pub(crate) use graph::{LayerWeights, StepWeights};
pub use sample::sample_rows;
pub(crate) use sample::sampled;
pub use transfer::{download, upload, upload_into};

use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView};
use candle_core::cuda::{CudaDType, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, Device, Layout, Result, Shape, Storage, Tensor};

const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/grouped_attention.ptx"));
const DECODE_OPS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode_ops.ptx"));
const SAMPLE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sample.ptx"));
pub(crate) const TRAIN_OPS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/train_ops.ptx"));

/// The CUDA device a tensor lives on.
fn cuda_device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        other => candle_core::bail!("a CUDA kernel was given a tensor on {other:?}"),
    }
}

/// The device memory of a contiguous CUDA tensor, from its storage and layout.
fn view<'a, T: CudaDType>(storage: &'a Storage, layout: &Layout) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(cuda) = storage else {
        candle_core::bail!("a CUDA kernel was given a tensor off the GPU");
    };
    slice(cuda, layout)
}

/// The device memory of a contiguous CUDA storage (a custom op's operand).
pub(crate) fn slice<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("a CUDA kernel was given a non-contiguous tensor");
    };
    Ok(storage.as_cuda_slice::<T>()?.slice(start..end))
}

/// The name of kernel `base` for `dtype` (`{base}_f32`, `{base}_bf16`); an error for
/// dtypes the kernels lack.
fn kernel(base: &str, dtype: candle_core::DType) -> Result<String> {
    match dtype {
        candle_core::DType::F32 => Ok(format!("{base}_f32")),
        candle_core::DType::BF16 => Ok(format!("{base}_bf16")),
        other => candle_core::bail!("{base}: no kernel for {other:?}"),
    }
}

/// Element-wise launch over `n` elements: 256 threads a block, grid-stride loops in the
/// kernels (at most 65 536 blocks).
pub(crate) fn elementwise(n: usize) -> candle_core::cuda::cudarc::driver::LaunchConfig {
    const THREADS: u32 = 256;
    candle_core::cuda::cudarc::driver::LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS).clamp(1, 1 << 16), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// An uninitialised buffer of `len` elements for a kernel's output (no memset launch).
/// Callers launch a kernel that writes every element before anything reads it.
pub(crate) fn output<T: candle_core::cuda::cudarc::driver::DeviceRepr>(
    device: &CudaDevice,
    len: usize,
) -> Result<CudaSlice<T>> {
    // SAFETY: every caller's kernel writes all `len` elements before the buffer is read
    // (each documents the coverage at its launch).
    unsafe { device.alloc::<T>(len) }
}

/// A kernel's output buffer as a tensor of `shape`.
fn wrap<T: CudaDType>(slice: CudaSlice<T>, device: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, device.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}
