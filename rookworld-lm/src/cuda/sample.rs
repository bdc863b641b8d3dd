//! The sampling kernel's launch (`kernels/sample.cu`): (B, V) logits in, B tokens and
//! log-probabilities out.

use candle_core::cuda::WrapErr;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Layout, Storage, Tensor};

use super::{SAMPLE_PTX, cuda_device, kernel};
use crate::error::Result;
use crate::launch::SAMPLE_THREADS;
use crate::sampling::{RowDraw, Sampled, not_finite};

/// Draws row r's token from `logits[r]` (B, V) on their CUDA device with `draws[r]`.
/// The logits are f32 or BF16, contiguous or a view of the first V columns of wider rows
/// (a padded head's output: [`Gpt2::prepare_for_inference`](crate::Gpt2)); other layouts
/// and dtypes are copied to contiguous f32 first. An all-NaN or all −∞ row is an error,
/// as on the CPU.
pub fn sample_rows(logits: &Tensor, draws: &[RowDraw]) -> Result<Vec<Sampled>> {
    let (b, v) = logits.dims2()?;
    if draws.len() != b {
        return Err(crate::Error::InvalidArgument(format!(
            "{} draws for {b} rows of logits",
            draws.len()
        )));
    }
    if b == 0 {
        return Ok(Vec::new());
    }
    let (logits, ld) = match (logits.dtype(), row_stride(logits.layout(), v)) {
        (DType::F32 | DType::BF16, Some(ld)) => (logits.clone(), ld),
        _ => (logits.to_dtype(DType::F32)?.contiguous()?, v),
    };
    let device = cuda_device(&logits)?;
    let name = kernel("sample_rows", logits.dtype())?;
    let func = device.get_or_load_custom_func(&name, "rookworld_sample", SAMPLE_PTX)?;
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
        let Storage::Cuda(cuda) = &*storage else {
            return Err(crate::Error::InvalidArgument(
                "the sampling kernel was given logits off the GPU".into(),
            ));
        };
        // Rows r·ld .. r·ld + V of the storage from the layout's start: (B − 1)·ld + V
        // elements.
        let (start, len) = (layout.start_offset(), (b - 1) * ld + v);
        let (v_arg, ld_arg) = (v as i32, ld as i64);
        let cfg = LaunchConfig {
            grid_dim: (b as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        macro_rules! launch {
            ($t:ty) => {{
                let x = cuda.as_cuda_slice::<$t>()?.slice(start..start + len);
                let mut builder = func.builder();
                builder
                    .arg(&x)
                    .arg(&v_arg)
                    .arg(&ld_arg)
                    .arg(&packed)
                    .arg(&mut out);
                // SAFETY: the arguments match the kernel's signature; each block reads
                // elements row·ld .. row·ld + V of `x` (inside its (B − 1)·ld + V) and
                // row blockIdx.x of the (B, 4) draws, and writes element blockIdx.x of
                // each third of `out` (3·B).
                unsafe { builder.launch(cfg) }.w()?;
            }};
        }
        match logits.dtype() {
            DType::BF16 => launch!(half::bf16),
            _ => launch!(f32),
        }
    }
    let out = stream.clone_dtoh(&out).w()?;
    sampled(&out, b, b)
}

/// The first `rows` rows of the kernel's output for `b` rows (3·B: tokens, log-probability
/// bits, status); an error when one of them had no finite logit.
pub(crate) fn sampled(out: &[u32], b: usize, rows: usize) -> Result<Vec<Sampled>> {
    let (tokens, rest) = out.split_at(b);
    let (logprobs, status) = rest.split_at(b);
    if status[..rows].iter().any(|&s| s != 0) {
        return Err(not_finite());
    }
    Ok(tokens[..rows]
        .iter()
        .zip(logprobs)
        .map(|(&token, &bits)| Sampled {
            token,
            logprob: f32::from_bits(bits),
        })
        .collect())
}

/// The distance between consecutive rows of a (B, V) layout whose rows are each
/// contiguous (column stride 1, row stride at least V); `None` for other layouts.
fn row_stride(layout: &Layout, v: usize) -> Option<usize> {
    match layout.stride() {
        [ld, 1] if *ld >= v => Some(*ld),
        [_, _] if v <= 1 && layout.is_contiguous() => Some(v),
        _ => None,
    }
}
