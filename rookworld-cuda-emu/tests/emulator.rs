//! The emulator itself: barriers, shared memory and shuffles give CUDA's results, and what a
//! GPU leaves undefined is an error naming the kernel, block and thread.

use std::path::Path;
use std::sync::OnceLock;

use rookworld_cuda_emu::{Arg, Error, Guarded, Module, build_for_test};

const KERNELS: [&str; 9] = [
    "block_sum",
    "shuffles",
    "divergent_barrier",
    "partial_mask",
    "fill",
    "wide",
    "rotate",
    "tile_product",
    "misaligned_tile",
];

/// The probe kernels, built once; `None` where no C++ compiler is installed (the tests
/// then say SKIPPED, see `build_for_test`).
fn module() -> Option<&'static Module> {
    static MODULE: OnceLock<Option<Module>> = OnceLock::new();
    MODULE
        .get_or_init(|| {
            let probe = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/probe.cu");
            build_for_test(&probe, &KERNELS)
        })
        .as_ref()
}

fn kernel_error(r: rookworld_cuda_emu::Result<()>) -> String {
    match r {
        Err(Error::Kernel(message)) => message,
        other => panic!(
            "expected a kernel error, got {:?}",
            other.map_err(|e| e.to_string())
        ),
    }
}

#[test]
fn a_block_reduction_through_shared_memory_and_shuffles_sums_each_block() {
    let Some(m) = module() else { return };
    let input: Vec<f32> = (0..3 * 256).map(|i| (i % 97) as f32).collect();
    let x = Guarded::from_slice(&input);
    let mut out = Guarded::<f32>::zeros(3);
    // SAFETY: `x` holds 3 blocks of 256, `out` one value per block.
    unsafe {
        m.launch(
            "block_sum",
            [3, 1, 1],
            [256, 1, 1],
            &[Arg::buf_mut(&mut out), Arg::buf(&x)],
        )
    }
    .unwrap();
    let want: Vec<f32> = input.chunks(256).map(|c| c.iter().sum()).collect();
    assert_eq!(out.to_vec(), want);
}

#[test]
fn shuffles_read_the_lanes_cuda_names() {
    let Some(m) = module() else { return };
    let mut out = Guarded::<i32>::zeros(96);
    // SAFETY: one warp writes 96 values.
    unsafe {
        m.launch(
            "shuffles",
            [1, 1, 1],
            [32, 1, 1],
            &[
                Arg::buf_mut(&mut out),
                Arg::i32(5),
                Arg::i32(3),
                Arg::i32(2),
            ],
        )
    }
    .unwrap();
    let out = out.to_vec();
    assert!(out[..32].iter().all(|&v| v == 50), "{:?}", &out[..32]);
    let up: Vec<i32> = (0..32).map(|l| if l >= 3 { l - 3 } else { l }).collect();
    assert_eq!(out[32..64], up[..]);
    let down: Vec<i32> = (0..32)
        .map(|l| if l + 2 < 32 { l + 2 } else { l })
        .collect();
    assert_eq!(out[64..], down[..]);
}

#[test]
fn a_barrier_that_a_returned_thread_never_reaches_is_named() {
    let Some(m) = module() else { return };
    let mut out = Guarded::<f32>::zeros(64);
    // SAFETY: 64 threads write their own value.
    let message = kernel_error(unsafe {
        m.launch(
            "divergent_barrier",
            [2, 1, 1],
            [64, 1, 1],
            &[Arg::buf_mut(&mut out)],
        )
    });
    assert!(
        message.starts_with("kernel divergent_barrier, block (0, 0, 0)")
            && message.contains("63 threads wait at __syncthreads")
            && message.contains("1 returned"),
        "{message}"
    );
}

#[test]
fn a_shuffle_leaving_out_lanes_is_named() {
    let Some(m) = module() else { return };
    let mut out = Guarded::<f32>::zeros(32);
    // SAFETY: one warp writes its own values.
    let message = kernel_error(unsafe {
        m.launch(
            "partial_mask",
            [1, 1, 1],
            [32, 1, 1],
            &[Arg::buf_mut(&mut out)],
        )
    });
    assert!(
        message.contains("kernel partial_mask") && message.contains("mask leaves out lanes"),
        "{message}"
    );
}

#[test]
fn a_write_past_a_buffers_end_is_caught_and_the_next_launch_runs() {
    let Some(m) = module() else { return };
    let mut out = Guarded::<f32>::zeros(100);
    // SAFETY: the overrun lands on the guard page, which the launch catches.
    let message = kernel_error(unsafe {
        m.launch(
            "fill",
            [1, 1, 1],
            [32, 1, 1],
            &[Arg::buf_mut(&mut out), Arg::i32(5000), Arg::f32(1.0)],
        )
    });
    assert!(
        message.starts_with("kernel fill, block (0, 0, 0), thread (")
            && message.contains("segmentation fault"),
        "{message}"
    );
    // SAFETY: within the buffer.
    unsafe {
        m.launch(
            "fill",
            [1, 1, 1],
            [32, 1, 1],
            &[Arg::buf_mut(&mut out), Arg::i32(100), Arg::f32(2.0)],
        )
    }
    .unwrap();
    assert!(out.as_slice().iter().all(|&v| v == 2.0));
}

#[test]
fn arguments_are_checked_against_the_parameters() {
    let Some(m) = module() else { return };
    let mut out = Guarded::<f32>::zeros(4);
    let wide = Guarded::<[i32; 4]>::from_slice(&[[1, 2, 3, 4]]);
    // SAFETY: every launch below is refused before it runs, or reads one int4.
    unsafe {
        let few = m.launch("fill", [1, 1, 1], [32, 1, 1], &[Arg::buf_mut(&mut out)]);
        assert!(
            matches!(&few, Err(Error::Kernel(e)) if e == "kernel fill takes 3 arguments, given 1"),
            "{:?}",
            few.map_err(|e| e.to_string())
        );
        let size = m.launch(
            "fill",
            [1, 1, 1],
            [32, 1, 1],
            &[Arg::buf_mut(&mut out), Arg::u64(4), Arg::f32(1.0)],
        );
        assert!(
            matches!(&size, Err(Error::Kernel(e)) if e.contains("argument 1 is 8 bytes, its parameter 4")),
            "{:?}",
            size.map_err(|e| e.to_string())
        );
        let unknown = m.launch("nothing", [1, 1, 1], [1, 1, 1], &[]);
        assert!(matches!(unknown, Err(Error::Unknown(k)) if k == "nothing"));
        let misaligned = Arg::u64(wide.as_ptr() as u64 + 4);
        let message = kernel_error(m.launch(
            "wide",
            [1, 1, 1],
            [1, 1, 1],
            &[Arg::buf_mut(&mut out), misaligned],
        ));
        assert!(
            message.contains("argument 1") && message.contains("not aligned"),
            "{message}"
        );
        m.launch(
            "wide",
            [1, 1, 1],
            [1, 1, 1],
            &[Arg::buf_mut(&mut out), Arg::buf(&wide)],
        )
        .unwrap();
    }
    assert_eq!(out.as_slice()[0], 10.0);
}

/// Each block gets the bytes its launch asked for, shared by its threads; a kernel that
/// uses more faults on the guard page after them.
#[test]
fn dynamic_shared_memory_is_shared_by_the_block_and_bounded_by_the_launch() {
    let Some(m) = module() else { return };
    let mut out = Guarded::<i32>::zeros(64);
    // SAFETY: 64 threads write their own value, into 64 ints of shared memory.
    unsafe {
        m.launch_shared(
            "rotate",
            [2, 1, 1],
            [64, 1, 1],
            64 * 4,
            &[Arg::buf_mut(&mut out)],
        )
    }
    .unwrap();
    let want: Vec<i32> = (0..64).map(|i| (i + 1) % 64).collect();
    assert_eq!(out.to_vec(), want);
    // SAFETY: the shared-memory overrun faults on the guard page, which the launch catches.
    let message = kernel_error(unsafe {
        m.launch_shared(
            "rotate",
            [1, 1, 1],
            [64, 1, 1],
            32 * 4,
            &[Arg::buf_mut(&mut out)],
        )
    });
    assert!(
        message.starts_with("kernel rotate, block (0, 0, 0), thread (32, 0, 0)")
            && message.contains("segmentation fault"),
        "{message}"
    );
}

/// `x` rounded to BF16 (to nearest, ties to even) and back.
fn bf16(x: f32) -> f32 {
    let u = x.to_bits();
    f32::from_bits((u + 0x7fff + ((u >> 16) & 1)) & 0xffff_0000)
}

#[test]
fn a_warp_matrix_product_is_the_product_of_its_bf16_operands() {
    let Some(m) = module() else { return };
    let mut values = rookworld_cuda_emu::Values(7);
    let (a, b, c) = (values.take(256), values.take(256), values.take(256));
    for a_col_major in [false, true] {
        let mut out = Guarded::<f32>::zeros(256);
        let (ga, gb, gc) = (
            Guarded::from_slice(&a),
            Guarded::from_slice(&b),
            Guarded::from_slice(&c),
        );
        // SAFETY: one warp reads 256 values of each operand and writes 256.
        unsafe {
            m.launch(
                "tile_product",
                [1, 1, 1],
                [32, 1, 1],
                &[
                    Arg::buf_mut(&mut out),
                    Arg::buf(&ga),
                    Arg::buf(&gb),
                    Arg::buf(&gc),
                    Arg::i32(a_col_major.into()),
                ],
            )
        }
        .unwrap();
        let a_at = |i: usize, k: usize| {
            bf16(if a_col_major {
                a[k * 16 + i]
            } else {
                a[i * 16 + k]
            })
        };
        let want: Vec<f32> = (0..256)
            .map(|at| {
                let (i, j) = (at / 16, at % 16);
                let dot: f64 = (0..16)
                    .map(|k| f64::from(a_at(i, k)) * f64::from(bf16(b[k * 16 + j])))
                    .sum();
                (dot + f64::from(c[at])) as f32
            })
            .collect();
        rookworld_cuda_emu::assert_close(
            &format!("tile product, a column-major: {a_col_major}"),
            out.as_slice(),
            &want,
            1e-6,
        );
    }
}

#[test]
fn a_warp_matrix_load_off_its_alignment_is_named() {
    let Some(m) = module() else { return };
    let mut out = Guarded::<f32>::zeros(32);
    // SAFETY: one warp writes one value a lane.
    let message = kernel_error(unsafe {
        m.launch(
            "misaligned_tile",
            [1, 1, 1],
            [32, 1, 1],
            &[Arg::buf_mut(&mut out)],
        )
    });
    assert!(
        message.contains("kernel misaligned_tile")
            && message.contains("load_matrix_sync: a pointer not 256-bit aligned"),
        "{message}"
    );
}
