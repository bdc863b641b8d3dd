//! The sampling kernel's launch (`kernels/sample.cu`): (B, V) logits in, B tokens and
//! log-probabilities out.

use candle_core::cuda::WrapErr;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Tensor};

use super::{SAMPLE_PTX, cuda_device, view};
use crate::device_sampling::RowDraw;
use crate::error::Result;
use crate::sampling::{Sampled, not_finite};

/// Threads per row (`THREADS` in the kernel).
const THREADS: u32 = 1024;

/// Draws row r's token from `logits[r]` (B, V) on their CUDA device with `draws[r]`.
/// An all-NaN or all −∞ row is an error, as on the CPU.
pub fn sample_rows(logits: &Tensor, draws: &[RowDraw]) -> Result<Vec<Sampled>> {
    let (b, v) = logits.dims2()?;
    if draws.len() != b {
        return Err(crate::Error::InvalidArgument(format!(
            "{} draws for {b} rows of logits",
            draws.len()
        )));
    }
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let device = cuda_device(&logits)?;
    let func = device.get_or_load_custom_func("sample_rows", "rookworld_sample", SAMPLE_PTX)?;
    let stream = device.cuda_stream();
    let packed: Vec<f64> = draws
        .iter()
        .flat_map(|d| {
            let (t, k, p) = (d.temperature, d.top_k, d.top_p);
            [f64::from(t), f64::from(k), f64::from(p), d.uniform]
        })
        .collect();
    let packed = stream.clone_htod(&packed).w()?;
    let mut out = device.alloc_zeros::<u32>(3 * b)?; // tokens, log-prob bits, status
    {
        let (storage, layout) = logits.storage_and_layout();
        let x = view::<f32>(&storage, layout)?;
        let v_arg = v as i32;
        let mut builder = func.builder();
        builder.arg(&x).arg(&v_arg).arg(&packed).arg(&mut out);
        let cfg = LaunchConfig {
            grid_dim: (b as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; each block reads row
        // blockIdx.x of the (B, V) logits and of the (B, 4) draws and writes element
        // blockIdx.x of each third of `out` (3·B).
        unsafe { builder.launch(cfg) }.w()?;
    }
    let out = stream.clone_dtoh(&out).w()?;
    let (tokens, rest) = out.split_at(b);
    let (logprobs, status) = rest.split_at(b);
    if status.iter().any(|&s| s != 0) {
        return Err(not_finite());
    }
    Ok(tokens
        .iter()
        .zip(logprobs)
        .map(|(&token, &bits)| Sampled {
            token,
            logprob: f32::from_bits(bits),
        })
        .collect())
}
