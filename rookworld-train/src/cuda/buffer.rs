//! The CUDA backend's buffers: views of f32 device memory ([`DevF32`]), read in place from
//! candle's tensors or owned by the pass's plan ([`DeviceVec`]).

use std::ops::{Deref, DerefMut};

use candle_core::CudaDevice;
use candle_core::cuda::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr};

use super::fail;
use crate::backend::Result;

/// `len` f32 in device memory from `ptr`: a view, owning nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevF32 {
    pub(super) ptr: CUdeviceptr,
    pub(super) len: usize,
}

impl DevF32 {
    /// The view of elements `range` of an f32 CUDA slice (a contiguous candle tensor's
    /// storage and its layout's offsets, read in place); `None` when the range is not in
    /// the slice. The slice must outlive every use of the view.
    pub fn of(
        slice: &CudaSlice<f32>,
        range: std::ops::Range<usize>,
        device: &CudaDevice,
    ) -> Option<Self> {
        if range.start > range.end || range.end > slice.len() {
            return None;
        }
        let stream = device.cuda_stream();
        let (ptr, _record) = slice.device_ptr(&stream);
        Some(Self {
            ptr: ptr + (range.start * std::mem::size_of::<f32>()) as CUdeviceptr,
            len: range.len(),
        })
    }

    /// The view of a contiguous f32 tensor on `device` (a model's weight, an optimizer's
    /// gradient), read or written in place. The tensor must outlive every use of the view.
    pub fn of_tensor(t: &candle_core::Tensor, device: &CudaDevice) -> Result<Self> {
        let on = candle_core::Device::Cuda(device.clone());
        if !t.device().same_device(&on) || t.dtype() != candle_core::DType::F32 {
            return Err(fail(
                "view",
                format!(
                    "a {:?} tensor on {:?}, not f32 on the backend's device",
                    t.dtype(),
                    t.device().location()
                ),
            ));
        }
        let (storage, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(fail("view", "a tensor that is not contiguous"));
        };
        let candle_core::Storage::Cuda(storage) = &*storage else {
            return Err(fail("view", "a tensor off the GPU"));
        };
        let slice = storage
            .as_cuda_slice::<f32>()
            .map_err(|e| fail("view", e))?;
        Self::of(slice, start..end, device).ok_or_else(|| fail("view", "a range past its storage"))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of element `i`.
    pub(super) fn at(&self, i: usize) -> CUdeviceptr {
        self.ptr + (i * std::mem::size_of::<f32>()) as CUdeviceptr
    }
}

/// A buffer the pass plans: device memory it owns, of which the first `len` elements are
/// the buffer ([`Backend::fit`] grows the memory only when it is too small).
#[derive(Default)]
pub struct DeviceVec {
    pub(super) memory: Option<CudaSlice<f32>>,
    pub(super) view: DevF32,
}

impl Deref for DeviceVec {
    type Target = DevF32;

    fn deref(&self) -> &DevF32 {
        &self.view
    }
}

impl DerefMut for DeviceVec {
    fn deref_mut(&mut self) -> &mut DevF32 {
        &mut self.view
    }
}
