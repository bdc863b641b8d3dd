//! The crate's CUDA kernels (`kernels/*.cu`) run on the CPU (rookworld-cuda-emu) and
//! compared with their CPU references, on the grids and with the arguments the CUDA code
//! (`src/cuda/*.rs`, the `cuda` modules of `src/train_ops/*.rs`) launches them with: CI
//! without a GPU checks their maths, indexing, barriers and shuffles, and that none reads
//! or writes past its buffers (each buffer ends at a guard page).
//!
//! - `grouped_attention.cu` (the decode step's attention over a group's shared prompt and
//!   each row's own suffix): the warp, split and captured-step (`row_attention`) kernels,
//!   f32 and BF16, against the attention written out in f64 (the CPU path,
//!   `cpu_attention::decode_attention`, is private to the crate);
//! - `decode_ops.cu` (the fused decode ops): against the formulas of `decode_ops` written out
//!   (private too), and bias + GELU against the op itself (`train_ops::bias_gelu`);
//! - `train_ops.cu`: against each op's public CPU implementation (`train_ops::*`);
//! - `sample.cu`: against `device_sampling::sample_reference`, row by row.
//!
//! Tolerances: the kernels sum in other orders than the references (and the emulator's
//! `expf` is the host's), so f32 values agree to a few ulps of their magnitude, not bit for
//! bit; a BF16 output to one BF16 ulp (2⁻⁷ of its scale: the kernel's f32 value and the
//! reference may round to neighbours), the references computed from the same BF16 inputs
//! widened to f32. Outputs start as NaN (the CUDA code's are uninitialised), so an element a
//! kernel leaves unwritten fails.

mod attention;
mod decode_ops;
mod sample;
mod training;

use std::path::Path;
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use half::bf16;
use rookworld_cuda_emu::{Arg, Element, Guarded, Module, Values, assert_close, build_for_test};
use rookworld_lm::device_sampling::sample_reference;
use rookworld_lm::sampling::RowDraw;
use rookworld_lm::train_ops::adamw::{self, AdamWStep, ManyItem};
use rookworld_lm::train_ops::softmax::{self, SoftmaxGeometry};
use rookworld_lm::train_ops::{self, gelu, layer_norm, logprobs};

type Grid = ([u32; 3], [u32; 3]);

/// Builds `kernels/{file}` with `kernels` once per test binary; `None` where no C++
/// compiler is installed (the tests then say SKIPPED and pass, see `build_for_test`).
fn built(
    cell: &'static OnceLock<Option<Module>>,
    file: &str,
    kernels: &[&str],
) -> Option<&'static Module> {
    cell.get_or_init(|| {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("kernels")
            .join(file);
        build_for_test(&path, kernels)
    })
    .as_ref()
}

fn attention_module() -> Option<&'static Module> {
    static MODULE: OnceLock<Option<Module>> = OnceLock::new();
    built(
        &MODULE,
        "grouped_attention.cu",
        &[
            "grouped_attention_f32",
            "grouped_attention_bf16",
            "grouped_attention_split_f32",
            "grouped_attention_split_bf16",
            "row_attention_f32",
            "row_attention_bf16",
        ],
    )
}

fn decode_ops_module() -> Option<&'static Module> {
    static MODULE: OnceLock<Option<Module>> = OnceLock::new();
    let mut kernels = Vec::new();
    for base in [
        "qkv_split",
        "qkv_split_step",
        "embed_rows",
        "bias_gelu",
        "add_layer_norm",
    ] {
        for suffix in ["f32", "bf16"] {
            kernels.push(format!("{base}_{suffix}"));
        }
    }
    let kernels: Vec<&str> = kernels.iter().map(String::as_str).collect();
    built(&MODULE, "decode_ops.cu", &kernels)
}

fn sample_module() -> Option<&'static Module> {
    static MODULE: OnceLock<Option<Module>> = OnceLock::new();
    built(
        &MODULE,
        "sample.cu",
        &["sample_rows_f32", "sample_rows_bf16"],
    )
}

fn train_ops_module() -> Option<&'static Module> {
    static MODULE: OnceLock<Option<Module>> = OnceLock::new();
    built(
        &MODULE,
        "train_ops.cu",
        &[
            "layer_norm_fwd",
            "layer_norm_dx",
            "layer_norm_params",
            "bias_gelu_bwd",
            "masked_softmax_fwd",
            "softmax_bwd",
            "target_logprobs_fwd",
            "target_logprobs_bwd",
            "adamw_moments",
            "adamw_param",
            "bias_rows",
            "adamw_many",
            "square_sums_many",
        ],
    )
}

/// Runs `kernel` of `module` on `grid`, panicking with the emulator's reason if it faults.
#[track_caller]
fn launch(module: &Module, kernel: &str, grid: Grid, args: &[Arg<'_>]) {
    launch_shared(module, kernel, grid, 0, args);
}

/// [`launch`] with `shared` bytes of dynamic shared memory a block.
#[track_caller]
fn launch_shared(
    module: &Module,
    kernel: &str,
    (grid, block): Grid,
    shared: u32,
    args: &[Arg<'_>],
) {
    // SAFETY: every buffer is sized from the shapes passed beside it, as the CUDA code
    // sizes them (each test says which function it follows); an overrun past a buffer's
    // end is caught by its guard page.
    unsafe { module.launch_shared(kernel, grid, block, shared, args) }
        .unwrap_or_else(|e| panic!("{e}"));
}

/// `cuda::elementwise`: 256 threads a block, at most 65 536 blocks (grid-stride loops).
fn elementwise(n: usize) -> Grid {
    (
        [(n as u32).div_ceil(256).clamp(1, 1 << 16), 1, 1],
        [256, 1, 1],
    )
}

/// `cuda::train::warp_rows`: a warp per row, eight rows a block.
fn warp_rows(rows: usize) -> Grid {
    ([(rows as u32).div_ceil(8), 1, 1], [256, 1, 1])
}

fn int(v: usize) -> Arg<'static> {
    Arg::i32(i32::try_from(v).unwrap())
}

/// A `size_t` argument.
fn size(v: usize) -> Arg<'static> {
    Arg::u64(v as u64)
}

/// The element type of a kernel's instantiation: `_f32` (f32 buffers) or `_bf16` (BF16
/// bits in u16 buffers).
trait Precision {
    type Bits: Element + PartialEq + std::fmt::Debug;
    const NAME: &'static str;
    /// The candle dtype of the same values.
    const DTYPE: DType;
    fn bits(x: f32) -> Self::Bits;
    fn value(b: Self::Bits) -> f32;

    /// Tolerance of an output stored in this type, relative to its scale: `f32_tol` for
    /// f32, a BF16 ulp (2⁻⁷ relative: a value on the other side of a rounding boundary)
    /// for BF16.
    fn tol(f32_tol: f32) -> f32 {
        if Self::DTYPE == DType::BF16 {
            8e-3
        } else {
            f32_tol
        }
    }

    fn kernel(base: &str) -> String {
        format!("{base}_{}", Self::NAME)
    }

    /// `values` stored in this type, and the values the kernel reads from them.
    fn store(values: &[f32]) -> (Guarded<Self::Bits>, Vec<f32>) {
        let bits: Vec<Self::Bits> = values.iter().map(|&x| Self::bits(x)).collect();
        let read = bits.iter().map(|&b| Self::value(b)).collect();
        (Guarded::from_slice(&bits), read)
    }

    /// `n` NaNs, for a kernel's output: the CUDA code's outputs are uninitialised
    /// (`cuda::output`), so an element the kernel leaves unwritten fails the comparison.
    fn unwritten(n: usize) -> Guarded<Self::Bits> {
        Guarded::from_slice(&vec![Self::bits(f32::NAN); n])
    }

    fn read(buffer: &Guarded<Self::Bits>) -> Vec<f32> {
        buffer.as_slice().iter().map(|&b| Self::value(b)).collect()
    }
}

struct F32;
struct Bf16;

/// [`Precision::unwritten`] in f32.
fn unwritten(n: usize) -> Guarded<f32> {
    F32::unwritten(n)
}

impl Precision for F32 {
    type Bits = f32;
    const NAME: &'static str = "f32";
    const DTYPE: DType = DType::F32;
    fn bits(x: f32) -> f32 {
        x
    }
    fn value(b: f32) -> f32 {
        b
    }
}

impl Precision for Bf16 {
    type Bits = u16;
    const NAME: &'static str = "bf16";
    const DTYPE: DType = DType::BF16;
    fn bits(x: f32) -> u16 {
        bf16::from_f32(x).to_bits()
    }
    fn value(b: u16) -> f32 {
        bf16::from_bits(b).to_f32()
    }
}
