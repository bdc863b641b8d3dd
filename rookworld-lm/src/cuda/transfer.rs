//! Host bytes to and from device memory in one transfer through page-locked memory.
//!
//! A copy between ordinary (pageable) host memory and the device is staged by the driver
//! through its own small page-locked buffers, a piece at a time, at a fraction of the
//! link's bandwidth (a 249 MB weight push: ~40 ms on an H200 host). Here the bytes cross
//! in one DMA transfer to or from one page-locked buffer, and every core copies them
//! between it and their place. The buffer is allocated on first use and kept for the next
//! (grown when a larger transfer comes): a weight push is the same size every time. One
//! buffer per device serves both directions (the learner's bfloat16 copy out, a worker's
//! push in), one transfer at a time; it is cached host memory, which the cores read back
//! at full speed (write-combined memory would not be).

use std::sync::Mutex;

use candle_core::cuda::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda::cudarc::driver::{
    CudaContext, CudaStream, DevicePtrMut, PinnedHostSlice, result,
};
use candle_core::cuda::{CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, Result};
use rayon::prelude::*;

/// The process's staging buffers, one per device.
static STAGING: Mutex<Vec<(usize, PinnedHostSlice<u8>)>> = Mutex::new(Vec::new());

/// Bytes each core copies at a time into the staging buffer.
const PIECE: usize = 1 << 20;

/// Copies `src` to the `src.len()` bytes of device memory at `dst` on `device`'s stream,
/// after every kernel launched before it there, and returns when they have landed.
/// Through the page-locked staging buffer, or — when page-locked memory cannot be had —
/// straight from `src` (slower, the same bytes).
///
/// # Safety
/// `dst` must be `src.len()` bytes of device memory of `device` that nothing else uses
/// until this returns.
pub unsafe fn upload(device: &CudaDevice, dst: CUdeviceptr, src: &[u8]) -> Result<()> {
    with_staging(device, src.len(), |staging, stream| {
        match staging {
            // SAFETY: the caller's contract for `dst`; `src` outlives the copy, which
            // ends before the synchronisation below returns.
            None => unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }.w()?,
            Some(host) => {
                host.par_chunks_mut(PIECE)
                    .zip(src.par_chunks(PIECE))
                    .for_each(|(d, s)| d.copy_from_slice(s));
                // SAFETY: the caller's contract for `dst`; `host` is page-locked memory of
                // this context that nothing else touches (the staging lock is held) until
                // the copy has ended, before the synchronisation below returns.
                unsafe { result::memcpy_htod_async(dst, &*host, stream.cu_stream()) }.w()?
            }
        }
        stream.synchronize().w()
    })
}

/// Copies the `dst.len()` bytes of device memory at `src` on `device`'s stream (after
/// every kernel launched before it there) into `dst`, through the page-locked staging
/// buffer in one transfer, or — when page-locked memory cannot be had — straight into
/// `dst` (slower, the same bytes).
///
/// # Safety
/// `src` must be `dst.len()` bytes of device memory of `device` that stays allocated
/// until this returns.
pub unsafe fn download(device: &CudaDevice, src: CUdeviceptr, dst: &mut [u8]) -> Result<()> {
    with_staging(device, dst.len(), |staging, stream| {
        let Some(host) = staging else {
            // SAFETY: the caller's contract for `src`; `dst` outlives the copy, which ends
            // before the synchronisation below returns.
            unsafe { result::memcpy_dtoh_async(&mut *dst, src, stream.cu_stream()) }.w()?;
            return stream.synchronize().w();
        };
        // SAFETY: the caller's contract for `src`; `host` is page-locked memory of this
        // context that nothing else touches (the staging lock is held) until the copy
        // has ended, before the synchronisation below returns.
        unsafe { result::memcpy_dtoh_async(&mut *host, src, stream.cu_stream()) }.w()?;
        stream.synchronize().w()?;
        dst.par_chunks_mut(PIECE)
            .zip(host.par_chunks(PIECE))
            .for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    })
}

/// Runs `transfer` of `len` bytes (nothing when there are none) with `device`'s context
/// bound to this thread and the staging lock held, given the first `len` bytes of the
/// device's page-locked staging buffer, or `None` when it cannot be had.
fn with_staging(
    device: &CudaDevice,
    len: usize,
    transfer: impl FnOnce(Option<&mut [u8]>, &CudaStream) -> Result<()>,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let stream = device.cuda_stream();
    let ctx = stream.context().clone();
    let mut staging = STAGING.lock().unwrap_or_else(|e| e.into_inner());
    ctx.bind_to_thread().w()?;
    match staging_for(&mut staging, &ctx, len) {
        // Every earlier transfer through this buffer ended before its call returned.
        Some(pinned) => transfer(Some(&mut pinned.as_mut_slice().w()?[..len]), &stream),
        None => transfer(None, &stream),
    }
}

/// Copies `src` into `storage` from element `start` on (the same dtype: raw bytes), as
/// [`upload`] does.
pub fn upload_into(storage: &mut CudaStorage, start: usize, src: &[u8]) -> Result<()> {
    let device = storage.device.clone();
    let stream = device.cuda_stream();
    let (len, size, base) = match &mut storage.slice {
        CudaStorageSlice::BF16(s) => (s.len(), 2, s.device_ptr_mut(&stream).0),
        CudaStorageSlice::F32(s) => (s.len(), 4, s.device_ptr_mut(&stream).0),
        _ => candle_core::bail!("upload: weights are f32 or bfloat16"),
    };
    if !src.len().is_multiple_of(size) || start + src.len() / size > len {
        candle_core::bail!(
            "upload: {} bytes from element {start} of a buffer of {len} {size}-byte elements",
            src.len()
        );
    }
    // SAFETY: the range is inside the storage (checked), which `&mut` keeps to this call;
    // the device has one stream, so no event guards the address.
    unsafe { upload(&device, base + (start * size) as CUdeviceptr, src) }
}

/// The staging buffer of `ctx`, at least `len` bytes: the kept one, or a new one (the
/// old freed first); `None` when page-locked memory of that size cannot be had.
fn staging_for<'a>(
    staging: &'a mut Vec<(usize, PinnedHostSlice<u8>)>,
    ctx: &std::sync::Arc<CudaContext>,
    len: usize,
) -> Option<&'a mut PinnedHostSlice<u8>> {
    let ordinal = ctx.ordinal();
    let at = staging.iter().position(|(o, _)| *o == ordinal);
    if let Some(i) = at
        && staging[i].1.len() < len
    {
        staging.swap_remove(i); // freed before the larger one is allocated
    }
    if !staging.iter().any(|(o, _)| *o == ordinal) {
        // Cached (no flags): the cores read it back after a download.
        // SAFETY: every use writes the bytes it then reads (a copy in, then out).
        match unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) } {
            Ok(pinned) => staging.push((ordinal, pinned)),
            Err(e) => {
                tracing::warn!(bytes = len, error = %e, "no page-locked staging buffer; transfers copy to and from pageable memory");
                return None;
            }
        }
    }
    staging
        .iter_mut()
        .find(|(o, _)| *o == ordinal)
        .map(|(_, p)| p)
}
