//! What the training ops' launches share (`kernels/train_ops.cu`): the module's name, the
//! block shapes and the output wrapper. Each op's launches sit in its own module of
//! [`crate::train_ops`], beside its CPU implementation. f32 only.

use candle_core::cuda::CudaStorage;
use candle_core::cuda::cudarc::driver::LaunchConfig;
use candle_core::{CudaDevice, Layout, Result, Shape};

pub(crate) const MODULE: &str = "rookworld_train_ops";
/// Rows per block of the warp-per-row kernels (`ROWS_PER_BLOCK` in the kernel).
pub(crate) const ROWS_PER_BLOCK: u32 = 8;
/// Threads of the block-per-row log-softmax (`REDUCE_THREADS`).
pub(crate) const REDUCE_THREADS: u32 = 512;
/// Threads per block of the (V, N)-grid log-softmax backward.
pub(crate) const THREADS: u32 = 256;

pub(crate) type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// A warp per row, eight rows per block (rows > 0: zero rows return [`empty`] unlaunched).
pub(crate) fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(ROWS_PER_BLOCK), 1, 1),
        block_dim: (ROWS_PER_BLOCK * 32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// What an op on zero rows returns without a launch: a grid of one block would write into
/// its zero-length output, and CUDA refuses a zero-byte allocation. `shape` has no
/// elements; the one-element buffer under it is never read.
pub(crate) fn empty(device: CudaDevice, shape: impl Into<Shape>) -> Result<(CudaStorage, Shape)> {
    let shape = shape.into();
    debug_assert_eq!(shape.elem_count(), 0);
    done(crate::cuda::output::<f32>(&device, 1)?, device, shape)
}

pub(crate) fn done(
    out: candle_core::cuda::cudarc::driver::CudaSlice<f32>,
    device: CudaDevice,
    shape: impl Into<Shape>,
) -> Result<(CudaStorage, Shape)> {
    Ok((CudaStorage::wrap_cuda_slice(out, device), shape.into()))
}
