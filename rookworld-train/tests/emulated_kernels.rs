//! The CUDA backend's kernels (`kernels/pass.cu`) run on the CPU (rookworld-cuda-emu) and
//! compared with the CPU backend's kernels of the same name, on the grids and with the
//! arguments the CUDA backend (`src/cuda/`) launches them with: CI without a GPU checks
//! their maths, indexing, barriers and shuffles, and that none reads or writes past its
//! buffers.
//!
//! Tolerances: the kernels sum in other orders than the CPU's (and the emulator's `expf` is
//! the host's), so values agree to a few f32 ulps of their magnitude, not bit for bit.

use std::path::Path;
use std::sync::OnceLock;

use rookworld_cuda_emu::{Arg, Guarded, Module, Values, assert_close, build_for_test};
use rookworld_train::cpu::{attention, ops};
use rookworld_train::launch::{self, AttentionForm, Part};
use rookworld_train::packed::ScatterPlan;
use rookworld_train::{Heads, Packed};

/// Every kernel of `kernels/pass.cu`.
const KERNELS: &[&str] = &[
    "embedding_fwd",
    "scatter_add_planned",
    "broadcast_rows",
    "column_partials",
    "column_finish",
    "add",
    "gelu_fwd",
    "gelu_bwd",
    "pass_layer_norm_fwd",
    "pass_layer_norm_dx",
    "layer_norm_partials",
    "layer_norm_finish",
    "gather_rows",
    "attention_fwd_d32",
    "attention_bwd_dq_d32",
    "attention_bwd_dkv_d32",
    "attention_fwd_d64",
    "attention_bwd_dq_d64",
    "attention_bwd_dkv_d64",
    "attention_fwd_d128",
    "attention_bwd_dq_d128",
    "attention_bwd_dkv_d128",
    "attention_tile_fwd_d32",
    "attention_tile_dq_d32",
    "attention_tile_dkv_d32",
    "attention_tile_fwd_d64",
    "attention_tile_dq_d64",
    "attention_tile_dkv_d64",
    "attention_mma_fwd_d16",
    "attention_mma_dq_d16",
    "attention_mma_dkv_d16",
    "attention_mma_fwd_d32",
    "attention_mma_dq_d32",
    "attention_mma_dkv_d32",
    "attention_mma_fwd_d64",
    "attention_mma_dq_d64",
    "attention_mma_dkv_d64",
    "head_logprobs",
    "head_grad",
    "head_probs",
    "head_grad_kept",
];

/// The CUDA backend's launch shapes, from the functions it launches with
/// ([`rookworld_train::launch`]).
type Grid = ([u32; 3], [u32; 3]);

fn dims(g: launch::Grid) -> Grid {
    assert_eq!(
        g.shared_bytes, 0,
        "the emulated tests size no dynamic shared memory"
    );
    let ((a, b, c), (x, y, z)) = (g.grid, g.block);
    ([a, b, c], [x, y, z])
}

fn elementwise(n: usize) -> Grid {
    dims(launch::elementwise("test", n).unwrap())
}

fn warps(tasks: usize) -> Grid {
    dims(launch::warps("test", tasks).unwrap())
}

/// `kernels/pass.cu`, built once; `None` where no C++ compiler is installed (the tests then
/// say SKIPPED, see `build_for_test`).
fn module() -> Option<&'static Module> {
    static MODULE: OnceLock<Option<Module>> = OnceLock::new();
    MODULE
        .get_or_init(|| {
            let pass = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/pass.cu");
            build_for_test(&pass, KERNELS)
        })
        .as_ref()
}

/// Runs `kernel` on `grid`, panicking with the emulator's reason if it faults.
fn launch(kernel: &str, (grid, block): Grid, args: &[Arg<'_>]) {
    let module = module().expect("the test checked for the module first");
    // SAFETY: every buffer is sized from the shapes passed beside it, as the CUDA backend
    // sizes them; an overrun past a buffer's end is caught by its guard page.
    unsafe { module.launch(kernel, grid, block, args) }.unwrap_or_else(|e| panic!("{e}"));
}

fn int(v: usize) -> Arg<'static> {
    Arg::i32(i32::try_from(v).unwrap())
}

/// Two groups: one whose prompt and completions fit a tile, one whose prompt (40 rows) and
/// a completion (35 rows) take two tiles and two chunks of keys; one completion of a single
/// token (no row fed).
fn batch() -> Packed {
    let tokens = |n: usize, base: u32| (0..n as u32).map(|i| base + i).collect::<Vec<_>>();
    Packed::of(
        &[tokens(7, 1), tokens(40, 100)],
        &[
            vec![tokens(6, 10), tokens(10, 20), tokens(1, 30)],
            vec![tokens(4, 40), tokens(36, 200)],
        ],
    )
}

/// The largest difference of `got` from `want` relative to the larger of 1 and `want`'s
/// largest value (as [`assert_close`] measures it).
fn normwise(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0f32, |m, (g, w)| m.max((g - w).abs() / scale))
}

/// The attention forward and backward through each form of kernels that has the heads'
/// width (a warp per row, the tiles, the tiles on tensor cores), on the grids the backend
/// launches ([`launch::attention_kernel`]), against the CPU backend's. The f32 forms agree
/// to f32 rounding; the tensor cores' BF16 operands (8 significant bits: each rounding
/// within 2⁻⁹ of its value) to `BF16` of the outputs' scale: measured 1.8e-3 to 2.4e-3
/// forward, 1.8e-3 to 2.8e-3 backward over these widths.
fn attention_matches(d: usize) {
    /// The tensor cores' forward rounds q/√D, k, v and P; its backward also dO and dS.
    const BF16: f32 = 5e-3;
    let packed = batch();
    let (r, h) = (packed.rows(), 2);
    let heads = Heads { e: h * d, h };
    let e = heads.e;
    let mut values = Values(d as u64);
    let qkv = values.take(r * 3 * e);
    let dy = values.take(r * e);

    let mut y_cpu = vec![0f32; r * e];
    let mut probs = vec![0f32; h * packed.groups.iter().map(|g| g.probs_len()).sum::<usize>()];
    attention::attention_forward(&mut y_cpu, &mut probs, &qkv, &packed.groups, heads);
    let mut dqkv_cpu = vec![0f32; r * 3 * e];
    attention::attention_backward(&mut dqkv_cpu, &dy, &qkv, &probs, &packed.groups, heads);

    let meta = Guarded::from_slice(&packed.row_meta());
    let tiles = Guarded::from_slice(&packed.row_tiles(launch::TILE));
    let (qkv, dy) = (Guarded::from_slice(&qkv), Guarded::from_slice(&dy));
    let mut ran = Vec::new();
    for form in [
        AttentionForm::Warp,
        AttentionForm::Tiles,
        AttentionForm::Mma,
    ] {
        let kernel = |part: Part| launch::attention_kernel(heads, part, r, tiles.len(), form);
        match kernel(Part::Fwd) {
            Ok((_, _, got)) if got == form => {}
            _ => continue, // no kernel of this form for the width
        }
        ran.push(form);
        let what = |part: &str| format!("attention {part}, D = {d}, {form:?}");
        let (fwd_tol, bwd_tol) = match form {
            AttentionForm::Mma => (BF16, BF16),
            _ => (2e-6, 1e-5),
        };
        let mut y = Guarded::<f32>::zeros(r * e);
        let mut lse = Guarded::<f32>::zeros(r * h);
        let last = || match form {
            AttentionForm::Warp => int(r),
            _ => Arg::buf(&tiles),
        };
        let (name, grid, _) = kernel(Part::Fwd).unwrap();
        launch(
            name,
            dims(grid),
            &[
                Arg::buf_mut(&mut y),
                Arg::buf_mut(&mut lse),
                Arg::buf(&qkv),
                Arg::buf(&meta),
                last(),
                int(h),
            ],
        );
        assert_close(&what("forward"), y.as_slice(), &y_cpu, fwd_tol);
        let mut dqkv = Guarded::<f32>::zeros(r * 3 * e);
        for part in [Part::Dq, Part::Dkv] {
            let (name, grid, _) = kernel(part).unwrap();
            launch(
                name,
                dims(grid),
                &[
                    Arg::buf_mut(&mut dqkv),
                    Arg::buf(&dy),
                    Arg::buf(&y),
                    Arg::buf(&qkv),
                    Arg::buf(&lse),
                    Arg::buf(&meta),
                    last(),
                    int(h),
                ],
            );
        }
        assert_close(&what("backward"), dqkv.as_slice(), &dqkv_cpu, bwd_tol);
        eprintln!(
            "{}: forward within {:.2e}, backward {:.2e} of the scale",
            what("kernels"),
            normwise(y.as_slice(), &y_cpu),
            normwise(dqkv.as_slice(), &dqkv_cpu)
        );
    }
    let mut want = Vec::new();
    for (widths, form) in [
        (&launch::ATTENTION_WIDTHS[..], AttentionForm::Warp),
        (&launch::TILE_WIDTHS[..], AttentionForm::Tiles),
        (&launch::MMA_WIDTHS[..], AttentionForm::Mma),
    ] {
        if widths.contains(&d) {
            want.push(form);
        }
    }
    assert_eq!(ran, want, "the forms run for heads of {d}");
}

#[test]
fn attention_with_heads_of_16_matches_the_cpu_on_tensor_cores() {
    if module().is_none() {
        return;
    }
    attention_matches(16);
}

#[test]
fn attention_with_heads_of_32_matches_the_cpu_warp_tiled_and_on_tensor_cores() {
    if module().is_none() {
        return;
    }
    attention_matches(32);
}

#[test]
fn attention_with_heads_of_64_matches_the_cpu_warp_tiled_and_on_tensor_cores() {
    if module().is_none() {
        return;
    }
    attention_matches(64);
}

#[test]
fn attention_with_heads_of_128_matches_the_cpu() {
    if module().is_none() {
        return;
    }
    attention_matches(128);
}

#[test]
fn layer_norm_forward_and_backward_match_the_cpu() {
    if module().is_none() {
        return;
    }
    // 37 rows: not a multiple of a block's 8 warps nor of a partial sum's 32 rows.
    let (m, e) = (37, 80);
    let mut values = Values(7);
    let (x, w, b, dout) = (
        values.take(m * e),
        values.take(e),
        values.take(e),
        values.take(m * e),
    );
    let dx0 = values.take(m * e);
    let (dw0, db0) = (values.take(e), values.take(e));
    let eps = 1e-5f32;
    let (mut out_cpu, mut mean_cpu, mut rstd_cpu) =
        (vec![0f32; m * e], vec![0f32; m], vec![0f32; m]);
    ops::layernorm_forward(&mut out_cpu, &mut mean_cpu, &mut rstd_cpu, &x, &w, &b, eps);
    let (mut dx_cpu, mut dw_cpu, mut db_cpu) = (dx0.clone(), dw0.clone(), db0.clone());
    ops::layernorm_backward(
        &mut dx_cpu,
        &mut dw_cpu,
        &mut db_cpu,
        &dout,
        &x,
        &mean_cpu,
        &rstd_cpu,
        &w,
    );

    let (gx, gw, gb, gdout) = (
        Guarded::from_slice(&x),
        Guarded::from_slice(&w),
        Guarded::from_slice(&b),
        Guarded::from_slice(&dout),
    );
    let mut out = Guarded::<f32>::zeros(m * e);
    let (mut mean, mut rstd) = (Guarded::<f32>::zeros(m), Guarded::<f32>::zeros(m));
    launch(
        "pass_layer_norm_fwd",
        warps(m),
        &[
            Arg::buf_mut(&mut out),
            Arg::buf_mut(&mut mean),
            Arg::buf_mut(&mut rstd),
            Arg::buf(&gx),
            Arg::buf(&gw),
            Arg::buf(&gb),
            int(m),
            int(e),
            Arg::f32(eps),
        ],
    );
    assert_close("layer norm output", out.as_slice(), &out_cpu, 2e-6);
    assert_close("layer norm mean", mean.as_slice(), &mean_cpu, 1e-6);
    assert_close("layer norm 1/σ", rstd.as_slice(), &rstd_cpu, 1e-6);

    let mut dx = Guarded::from_slice(&dx0);
    launch(
        "pass_layer_norm_dx",
        warps(m),
        &[
            Arg::buf_mut(&mut dx),
            Arg::buf(&gdout),
            Arg::buf(&gx),
            Arg::buf(&mean),
            Arg::buf(&rstd),
            Arg::buf(&gw),
            int(m),
            int(e),
        ],
    );
    assert_close("layer norm dx", dx.as_slice(), &dx_cpu, 4e-6);
    let (grid, k) = launch::layer_norm_partials(m).unwrap();
    let mut partial = Guarded::<f32>::zeros(k * 2 * e);
    launch(
        "layer_norm_partials",
        dims(grid),
        &[
            Arg::buf_mut(&mut partial),
            Arg::buf(&gdout),
            Arg::buf(&gx),
            Arg::buf(&mean),
            Arg::buf(&rstd),
            int(m),
            int(e),
        ],
    );
    let (mut dw, mut db) = (Guarded::from_slice(&dw0), Guarded::from_slice(&db0));
    launch(
        "layer_norm_finish",
        elementwise(e),
        &[
            Arg::buf_mut(&mut dw),
            Arg::buf_mut(&mut db),
            Arg::buf(&partial),
            int(k),
            int(e),
        ],
    );
    assert_close("layer norm dw", dw.as_slice(), &dw_cpu, 4e-6);
    assert_close("layer norm db", db.as_slice(), &db_cpu, 4e-6);
}

#[test]
fn element_wise_kernels_match_the_cpu() {
    if module().is_none() {
        return;
    }
    let mut values = Values(11);
    // GELU, forward and backward in place.
    let n = 1000;
    let x = values.take(n).iter().map(|v| v * 4.0).collect::<Vec<_>>();
    let d0 = values.take(n);
    let mut out_cpu = vec![0f32; n];
    ops::gelu_forward(&mut out_cpu, &x);
    let mut d_cpu = d0.clone();
    ops::gelu_backward(&mut d_cpu, None, &x);
    let gx = Guarded::from_slice(&x);
    let mut out = Guarded::<f32>::zeros(n);
    launch(
        "gelu_fwd",
        elementwise(n),
        &[Arg::buf_mut(&mut out), Arg::buf(&gx), int(n)],
    );
    assert_close("gelu", out.as_slice(), &out_cpu, 2e-6);
    let mut d = Guarded::from_slice(&d0);
    launch(
        "gelu_bwd",
        elementwise(n),
        &[Arg::buf_mut(&mut d), Arg::buf(&gx), int(n)],
    );
    assert_close("gelu backward", d.as_slice(), &d_cpu, 2e-6);

    // out = a + b.
    let (a, b) = (values.take(n), values.take(n));
    let want: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
    let (ga, gb) = (Guarded::from_slice(&a), Guarded::from_slice(&b));
    let mut sum = Guarded::<f32>::zeros(n);
    launch(
        "add",
        elementwise(n),
        &[Arg::buf_mut(&mut sum), Arg::buf(&ga), Arg::buf(&gb), int(n)],
    );
    assert_eq!(sum.to_vec(), want);

    // Every row = the bias.
    let (rows, cols) = (9, 70);
    let bias = values.take(cols);
    let mut broadcast = Guarded::<f32>::zeros(rows * cols);
    launch(
        "broadcast_rows",
        elementwise(rows * cols),
        &[
            Arg::buf_mut(&mut broadcast),
            Arg::buf(&Guarded::from_slice(&bias)),
            int(rows),
            int(cols),
        ],
    );
    assert_eq!(broadcast.to_vec(), bias.repeat(rows));
}

#[test]
fn column_sums_match_the_cpu_over_several_partial_blocks() {
    if module().is_none() {
        return;
    }
    // 600 rows: three partial sums of up to 256 rows; 300 columns: two blocks of columns.
    let (rows, n) = (600, 300);
    let mut values = Values(13);
    let (m, acc0) = (values.take(rows * n), values.take(n));
    let mut want = acc0.clone();
    ops::column_sums(&mut want, &m, n);
    let (grid, k) = launch::column_partials(rows, n).unwrap();
    let gm = Guarded::from_slice(&m);
    let mut partial = Guarded::<f32>::zeros(k * n);
    launch(
        "column_partials",
        dims(grid),
        &[Arg::buf(&gm), Arg::buf_mut(&mut partial), int(rows), int(n)],
    );
    let mut acc = Guarded::from_slice(&acc0);
    launch(
        "column_finish",
        elementwise(n),
        &[Arg::buf_mut(&mut acc), Arg::buf(&partial), int(k), int(n)],
    );
    assert_close("column sums", acc.as_slice(), &want, 1e-5);
}

#[test]
fn embedding_gather_and_planned_scatter_match_the_cpu() {
    if module().is_none() {
        return;
    }
    let packed = batch();
    let (r, e, vocab, ctx) = (packed.rows(), 48, 256, 128);
    let mut values = Values(17);
    let (wte, wpe) = (values.take(vocab * e), values.take(ctx * e));
    let mut want = vec![0f32; r * e];
    ops::embedding_forward(&mut want, &packed.ids, &packed.positions, &wte, &wpe);
    let (ids, pos) = (
        Guarded::from_slice(&packed.ids),
        Guarded::from_slice(&packed.positions),
    );
    let mut out = Guarded::<f32>::zeros(r * e);
    launch(
        "embedding_fwd",
        elementwise(r * e),
        &[
            Arg::buf_mut(&mut out),
            Arg::buf(&ids),
            Arg::buf(&pos),
            Arg::buf(&Guarded::from_slice(&wte)),
            Arg::buf(&Guarded::from_slice(&wpe)),
            int(r),
            int(e),
        ],
    );
    assert_eq!(out.to_vec(), want);

    // The predicting rows of the head, gathered, then their gradients scattered back.
    let n = packed.head_rows.len();
    let mut gathered = Guarded::<f32>::zeros(n * e);
    let head_rows = Guarded::from_slice(&packed.head_rows);
    launch(
        "gather_rows",
        elementwise(n * e),
        &[
            Arg::buf_mut(&mut gathered),
            Arg::buf(&out),
            Arg::buf(&head_rows),
            int(n),
            int(e),
        ],
    );
    let want_gathered: Vec<f32> = packed
        .head_rows
        .iter()
        .flat_map(|&row| want[row as usize * e..][..e].to_vec())
        .collect();
    assert_eq!(gathered.to_vec(), want_gathered);

    let plan = ScatterPlan::new(&packed.head_rows);
    let src = values.take(n * e);
    let dst0 = values.take(r * e);
    let mut dst_cpu = dst0.clone();
    plan.apply(&mut dst_cpu, &src, e);
    let (targets, offsets, sources) = (&plan.targets, &plan.offsets, &plan.sources);
    let mut dst = Guarded::from_slice(&dst0);
    launch(
        "scatter_add_planned",
        elementwise(targets.len() * e),
        &[
            Arg::buf_mut(&mut dst),
            Arg::buf(&Guarded::from_slice(&src)),
            Arg::buf(&Guarded::from_slice(targets)),
            Arg::buf(&Guarded::from_slice(offsets)),
            Arg::buf(&Guarded::from_slice(sources)),
            int(targets.len()),
            int(e),
        ],
    );
    assert_eq!(dst.to_vec(), dst_cpu);
}

/// The head's log-probs, entropies and logit gradients of a block of rows, recomputed or
/// from kept probabilities, against the same maths in f64.
#[test]
fn head_logprobs_and_gradients_match_the_maths() {
    if module().is_none() {
        return;
    }
    // A vocabulary that is not a multiple of the block's 512 threads, in rows padded as
    // the backend pads them (1000 -> 1024): the padding holds a logit above every other,
    // so a kernel that read it would give wrong results, and it must stay as it was.
    let (m, v, temperature) = (5, 1000, 0.7f64);
    let ld = launch::head_ld(v);
    assert_eq!(ld, 1024);
    const PAD: f32 = 1e30;
    let padded = |rows: &[f32]| -> Vec<f32> {
        rows.chunks(v)
            .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(PAD, ld - v)))
            .collect()
    };
    // The V values of each row, the padding checked untouched.
    let unpadded = |what: &str, buf: &[f32]| -> Vec<f32> {
        assert_eq!(buf.len(), m * ld, "{what}");
        for row in buf.chunks(ld) {
            assert!(
                row[v..].iter().all(|&x| x == PAD),
                "{what}: padding written"
            );
        }
        buf.chunks(ld).flat_map(|r| r[..v].to_vec()).collect()
    };
    let mut values = Values(19);
    let logits: Vec<f32> = values.take(m * v).iter().map(|x| x * 6.0).collect();
    let targets: Vec<u32> = (0..m as u32).map(|i| (i * 397) % v as u32).collect();
    let g = values.take(m);
    let inv_t = (1.0 / temperature) as f32;
    let (mut want_logp, mut want_entropy, mut want_probs, mut want_grad) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for n in 0..m {
        let z: Vec<f64> = logits[n * v..][..v]
            .iter()
            .map(|&l| f64::from(l) * f64::from(inv_t))
            .collect();
        let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = z.iter().map(|z| (z - mx).exp()).sum();
        let lse = mx + s.ln();
        want_logp.push((z[targets[n] as usize] - lse) as f32);
        let mean_z: f64 = z.iter().map(|z| (z - lse).exp() * z).sum();
        want_entropy.push((lse - mean_z) as f32);
        for (j, z) in z.iter().enumerate() {
            let p = (z - lse).exp();
            want_probs.push(p as f32);
            let onehot = if j == targets[n] as usize { 1.0 } else { 0.0 };
            want_grad.push((f64::from(g[n]) * f64::from(inv_t) * (onehot - p)) as f32);
        }
    }
    let gl = Guarded::from_slice(&padded(&logits));
    let gt = Guarded::from_slice(&targets);
    let (mut logp, mut entropy) = (Guarded::<f32>::zeros(m), Guarded::<f32>::zeros(m));
    let per_row = dims(launch::per_row(m).unwrap());
    launch(
        "head_logprobs",
        per_row,
        &[
            Arg::buf(&gl),
            Arg::buf(&gt),
            Arg::buf_mut(&mut logp),
            Arg::buf_mut(&mut entropy),
            int(v),
            int(ld),
            Arg::f32(inv_t),
        ],
    );
    assert_close("head log-probs", logp.as_slice(), &want_logp, 2e-6);
    assert_close("head entropies", entropy.as_slice(), &want_entropy, 2e-6);
    // Without entropies (a null pointer), the log-probs alone.
    let mut logp_only = Guarded::<f32>::zeros(m);
    launch(
        "head_logprobs",
        per_row,
        &[
            Arg::buf(&gl),
            Arg::buf(&gt),
            Arg::buf_mut(&mut logp_only),
            Arg::null(),
            int(v),
            int(ld),
            Arg::f32(inv_t),
        ],
    );
    assert_eq!(logp_only.to_vec(), logp.to_vec());
    let mut grad = Guarded::from_slice(&padded(&logits));
    launch(
        "head_grad",
        per_row,
        &[
            Arg::buf_mut(&mut grad),
            Arg::buf(&gt),
            Arg::buf(&Guarded::from_slice(&g)),
            int(v),
            int(ld),
            Arg::f32(inv_t),
        ],
    );
    let grad = unpadded("head logit gradients", grad.as_slice());
    assert_close("head logit gradients", &grad, &want_grad, 2e-6);

    // Kept (the trial family step_head_kept): the same log-probs and entropies, the
    // probabilities left in place of the logits, then the gradients from them.
    let (mut kept_logp, mut kept_entropy) = (Guarded::<f32>::zeros(m), Guarded::<f32>::zeros(m));
    let mut probs = Guarded::from_slice(&padded(&logits));
    launch(
        "head_probs",
        per_row,
        &[
            Arg::buf_mut(&mut probs),
            Arg::buf(&gt),
            Arg::buf_mut(&mut kept_logp),
            Arg::buf_mut(&mut kept_entropy),
            int(v),
            int(ld),
            Arg::f32(inv_t),
        ],
    );
    assert_eq!(kept_logp.to_vec(), logp.to_vec());
    assert_eq!(kept_entropy.to_vec(), entropy.to_vec());
    let kept = unpadded("head probabilities", probs.as_slice());
    assert_close("head probabilities", &kept, &want_probs, 2e-6);
    launch(
        "head_grad_kept",
        elementwise(m * v),
        &[
            Arg::buf_mut(&mut probs),
            Arg::buf(&gt),
            Arg::buf(&Guarded::from_slice(&g)),
            int(m),
            int(v),
            int(ld),
            Arg::f32(inv_t),
        ],
    );
    let what = "head logit gradients from kept probabilities";
    assert_close(what, &unpadded(what, probs.as_slice()), &want_grad, 2e-6);
}
