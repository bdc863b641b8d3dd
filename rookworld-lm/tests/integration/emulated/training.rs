//! `train_ops.cu`: the training ops against their CPU implementations (`train_ops::*`).

use super::*;
use rookworld_lm::kernels::Kernels;

#[test]
fn layer_norm_forward_input_gradient_and_parameter_partials_match_the_cpu() {
    let Some(module) = train_ops_module() else {
        return;
    };
    // 37 rows: not a multiple of a block's 8 warps nor of a partial sum's 32 rows; rows of
    // 80 (lanes take two or three columns).
    let (m, e, eps) = (37usize, 80usize, 1e-5f32);
    let mut values = Values(41);
    let x: Vec<f32> = values.scaled(m * e, 3.0).iter().map(|v| v + 0.5).collect();
    let (w, b, dy) = (values.take(e), values.take(e), values.take(m * e));
    let (mut y_cpu, mut mean, mut rstd) = (vec![0f32; m * e], vec![0f32; m], vec![0f32; m]);
    layer_norm::forward(&mut y_cpu, &mut mean, &mut rstd, &x, &w, &b, eps);
    let mut dx_cpu = vec![0f32; m * e];
    layer_norm::backward_dx(&mut dx_cpu, &dy, &x, &mean, &rstd, &w);
    let parts_cpu = layer_norm::param_partials(&dy, &x, &mean, &rstd, e);

    let (gx, gw, gb, gdy) = (
        Guarded::from_slice(&x),
        Guarded::from_slice(&w),
        Guarded::from_slice(&b),
        Guarded::from_slice(&dy),
    );
    // As `train_ops::layer_norm::cuda::norm_rows`: warp_rows(M), (x, w, b | dy, out, M, E,
    // eps).
    for (kernel, third, want) in [
        ("layer_norm_fwd", &gb, &y_cpu),
        ("layer_norm_dx", &gdy, &dx_cpu),
    ] {
        let mut out = unwritten(m * e);
        launch(
            module,
            kernel,
            warp_rows(m),
            &[
                Arg::buf(&gx),
                Arg::buf(&gw),
                Arg::buf(third),
                Arg::buf_mut(&mut out),
                int(m),
                int(e),
                Arg::f32(eps),
            ],
        );
        assert_close(kernel, out.as_slice(), want, 1e-5);
    }
    // As `train_ops::layer_norm::cuda::layer_norm_params`: grid ⌈M / 32⌉ of 256 threads,
    // (x, dy, out, M, E, eps).
    let chunks = m.div_ceil(layer_norm::PARAM_CHUNK);
    let mut parts = unwritten(chunks * 2 * e);
    launch(
        module,
        "layer_norm_params",
        ([chunks as u32, 1, 1], [256, 1, 1]),
        &[
            Arg::buf(&gx),
            Arg::buf(&gdy),
            Arg::buf_mut(&mut parts),
            int(m),
            int(e),
            Arg::f32(eps),
        ],
    );
    assert_close(
        "layer norm parameter partials",
        parts.as_slice(),
        &parts_cpu,
        1e-5,
    );
}

#[test]
fn bias_gelu_backward_and_bias_rows_match_the_cpu() {
    let Some(module) = train_ops_module() else {
        return;
    };
    let (m, n) = (6usize, 150usize);
    let mut values = Values(43);
    let (x, b, dy) = (
        values.scaled(m * n, 4.0),
        values.take(n),
        values.take(m * n),
    );
    let want = gelu::bias_backward(&x, &b, &dy);
    let (gx, gb, gdy) = (
        Guarded::from_slice(&x),
        Guarded::from_slice(&b),
        Guarded::from_slice(&dy),
    );
    let mut dz = unwritten(m * n);
    // As `train_ops::gelu::cuda::bias_gelu_bwd`: elementwise(M·N), (x, b, dy, dz, M, N).
    launch(
        module,
        "bias_gelu_bwd",
        elementwise(m * n),
        &[
            Arg::buf(&gx),
            Arg::buf(&gb),
            Arg::buf(&gdy),
            Arg::buf_mut(&mut dz),
            int(m),
            int(n),
        ],
    );
    assert_close("bias + GELU backward", dz.as_slice(), &want, 1e-5);

    // Every row of an (M, N) output set to the bias: `out[r, j] = b[j]`.
    let mut rows = unwritten(m * n);
    // As `train_ops::linear` (the mixed linear with a bias): elementwise(M·N), (out, b,
    // M·N, N).
    launch(
        module,
        "bias_rows",
        elementwise(m * n),
        &[Arg::buf_mut(&mut rows), Arg::buf(&gb), size(m * n), int(n)],
    );
    assert_eq!(rows.to_vec(), b.repeat(m));
}

/// Scores (2, 3, 5, 45) under a bias of one batch row or of two, with keys masked (−∞)
/// at the end of some queries and every key of one query masked (a row of zeros).
fn masked_softmax_matches(bias_batch: usize) {
    let Some(module) = train_ops_module() else {
        return;
    };
    let (batch, heads, queries, keys) = (2usize, 3usize, 5usize, 45usize);
    let rows = batch * heads * queries;
    let mut values = Values(47 + bias_batch as u64);
    let s = values.scaled(rows * keys, 4.0);
    let mut bias = values.take(bias_batch * queries * keys);
    for (r, row) in bias.chunks_mut(keys).enumerate() {
        let (bb, t) = (r / queries, r % queries);
        for (j, v) in row.iter_mut().enumerate() {
            if j > 40 + t || (bb + 1 == bias_batch && t == 2) {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    let geom = SoftmaxGeometry {
        heads,
        queries,
        keys,
        bias_batch,
    };
    let scale = 0.3f32;
    let want = softmax::cpu_forward(&s, &bias, geom, scale);
    let (gs, gbias) = (Guarded::from_slice(&s), Guarded::from_slice(&bias));
    let mut p = unwritten(rows * keys);
    // As `train_ops::softmax::cuda::masked_softmax`: warp_rows(rows), (s, bias, p, rows,
    // H, T, S, BB, scale).
    launch(
        module,
        "masked_softmax_fwd",
        warp_rows(rows),
        &[
            Arg::buf(&gs),
            Arg::buf(&gbias),
            Arg::buf_mut(&mut p),
            int(rows),
            int(heads),
            int(queries),
            int(keys),
            int(bias_batch),
            Arg::f32(scale),
        ],
    );
    let what = format!("masked softmax, bias batch {bias_batch}");
    assert_close(&what, p.as_slice(), &want, 1e-6);
    assert!(
        want.iter().filter(|&&x| x == 0.0).count() >= heads * keys,
        "a fully masked query"
    );

    // Its backward from the kernel's p.
    let dp = values.take(rows * keys);
    let want = softmax::cpu_backward(p.as_slice(), &dp, keys, scale);
    let gdp = Guarded::from_slice(&dp);
    let mut ds = unwritten(rows * keys);
    // As `train_ops::softmax::cuda::softmax_bwd`: warp_rows(rows), (p, dp, ds, rows, S,
    // scale).
    launch(
        module,
        "softmax_bwd",
        warp_rows(rows),
        &[
            Arg::buf(&p),
            Arg::buf(&gdp),
            Arg::buf_mut(&mut ds),
            int(rows),
            int(keys),
            Arg::f32(scale),
        ],
    );
    assert_close(&format!("{what} backward"), ds.as_slice(), &want, 1e-6);
}

#[test]
fn masked_softmax_and_its_backward_match_the_cpu_with_one_bias_or_one_per_batch_row() {
    masked_softmax_matches(1);
    masked_softmax_matches(2);
}

#[test]
fn target_logprobs_and_their_gradients_match_the_cpu() {
    let Some(module) = train_ops_module() else {
        return;
    };
    // A vocabulary that is not a multiple of the forward's 512 threads nor of the
    // backward's 256; one row with masked (−∞) logits.
    let (n, v, inv_t) = (5usize, 1000usize, 1.0f32 / 0.7);
    let mut values = Values(53);
    let mut logits = values.scaled(n * v, 6.0);
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 397 + 1) % v as u32).collect();
    for (j, x) in logits[2 * v..3 * v].iter_mut().enumerate() {
        if j % 3 == 0 && j != targets[2] as usize {
            *x = f32::NEG_INFINITY;
        }
    }
    let want = logprobs::cpu_forward(&logits, &targets, v, inv_t);
    let (gl, gt) = (Guarded::from_slice(&logits), Guarded::from_slice(&targets));
    let mut lp = unwritten(n);
    // As `train_ops::logprobs::cuda::target_logprobs`: grid N of REDUCE_THREADS = 512,
    // (logits, targets, out, N, V, inv_t).
    launch(
        module,
        "target_logprobs_fwd",
        ([n as u32, 1, 1], [512, 1, 1]),
        &[
            Arg::buf(&gl),
            Arg::buf(&gt),
            Arg::buf_mut(&mut lp),
            int(n),
            int(v),
            Arg::f32(inv_t),
        ],
    );
    assert_close("target log-probs", lp.as_slice(), &want, 2e-6);

    let g = values.take(n);
    let rg: Vec<f32> = lp
        .as_slice()
        .iter()
        .zip(&g)
        .flat_map(|(&l, &g)| [l, g])
        .collect();
    let want = logprobs::cpu_backward(&logits, &targets, &rg, v, inv_t);
    let grg = Guarded::from_slice(&rg);
    let mut d = unwritten(n * v);
    // As `train_ops::logprobs::cuda::target_logprobs_bwd`: grid (⌈V / 256⌉, min(N, 65535))
    // of 256, (logits, targets, rg, d, N, V, inv_t).
    launch(
        module,
        "target_logprobs_bwd",
        (
            [(v as u32).div_ceil(256), n.min(65_535) as u32, 1],
            [256, 1, 1],
        ),
        &[
            Arg::buf(&gl),
            Arg::buf(&gt),
            Arg::buf(&grg),
            Arg::buf_mut(&mut d),
            int(n),
            int(v),
            Arg::f32(inv_t),
        ],
    );
    assert_close("target log-prob gradients", d.as_slice(), &want, 1e-6);
}

fn adamw_constants() -> AdamWStep {
    AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        shrink: 1.0 - 1e-4,
        s1: 10.0,
        s2: 1000.0,
        grad_scale: 0.5,
    }
}

fn cpu_vec(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Moments of n elements: first moments in [-1, 1), second in [0, 1).
fn moments(values: &mut Values, n: usize) -> Vec<f32> {
    let mut mv = values.take(2 * n);
    mv[n..].iter_mut().for_each(|v| *v = v.abs());
    mv
}

#[test]
fn adamw_moments_then_param_take_the_cpu_step() {
    let Some(module) = train_ops_module() else {
        return;
    };
    let n = 1000;
    let c = adamw_constants();
    let mut values = Values(59);
    let (p0, g, mv0) = (values.take(n), values.take(n), moments(&mut values, n));
    let tensor = |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape, &Device::Cpu).unwrap();
    let (p_cpu, mv_cpu) = (tensor(&p0, &[n]), tensor(&mv0, &[2, n]));
    adamw::adamw_step(&p_cpu, &tensor(&g, &[n]), &mv_cpu, &c, &Kernels::cpu()).unwrap();

    let (mut p, mut mv, gg) = (
        Guarded::from_slice(&p0),
        Guarded::from_slice(&mv0),
        Guarded::from_slice(&g),
    );
    // As `train_ops::adamw::cuda::adamw_pass`: elementwise(n); adamw_moments (mv, g, n, b1,
    // b2, gs), then adamw_param (p, mv, n, lr, eps, shrink, s1, s2).
    launch(
        module,
        "adamw_moments",
        elementwise(n),
        &[
            Arg::buf_mut(&mut mv),
            Arg::buf(&gg),
            size(n),
            Arg::f32(c.beta1),
            Arg::f32(c.beta2),
            Arg::f32(c.grad_scale),
        ],
    );
    // The moments: the same f32 expressions as the CPU's, bit for bit.
    assert_eq!(mv.to_vec(), cpu_vec(&mv_cpu), "moments");
    launch(
        module,
        "adamw_param",
        elementwise(n),
        &[
            Arg::buf_mut(&mut p),
            Arg::buf(&mv),
            size(n),
            Arg::f32(c.lr),
            Arg::f32(c.eps),
            Arg::f32(c.shrink),
            Arg::f32(c.s1),
            Arg::f32(c.s2),
        ],
    );
    // The same f32 operations in the same order: bit for bit here (a GPU may fuse the last
    // multiply and subtract into one rounding).
    assert_eq!(p.to_vec(), cpu_vec(&p_cpu), "parameters");
}

/// Elements of a chunk of the multi-tensor launches (`MANY_CHUNK`).
const MANY_CHUNK: usize = 65_536;

/// The table of `ManyTensor`s (48 bytes each: p, g, mv, out, n, shrink, unused) and the
/// (tensor, chunk) pairs, each with the sentinel entry `adamw::many::tables` appends, and
/// the number of chunks.
fn many_tables(
    rows: &[[u64; 4]],
    n: &[usize],
    shrink: &[f32],
) -> (Guarded<u64>, Guarded<[i32; 2]>, usize) {
    let mut table = Vec::new();
    let mut chunks = Vec::new();
    for (k, (ptrs, (&len, &sh))) in rows.iter().zip(n.iter().zip(shrink)).enumerate() {
        table.extend_from_slice(ptrs);
        table.extend([len as u64, u64::from(sh.to_bits())]);
        for c in 0..len.div_ceil(MANY_CHUNK) {
            chunks.push([k as i32, c as i32]);
        }
    }
    let count = chunks.len();
    chunks.push([0, 0]);
    table.extend([0u64; 6]);
    (
        Guarded::from_slice(&table),
        Guarded::from_slice(&chunks),
        count,
    )
}

#[test]
fn adamw_many_and_square_sums_many_match_the_cpu_over_several_chunks() {
    let Some(module) = train_ops_module() else {
        return;
    };
    // A tensor of two chunks (the second partial), a small one with no bfloat16 copy, and
    // one of 300 elements.
    let sizes = [70_000usize, 10, 300];
    let exported = [true, false, true];
    let shrinks = [1.0 - 1e-4, 1.0, 1.0 - 2e-4];
    let c = adamw_constants();
    let mut values = Values(61);
    let p0: Vec<Vec<f32>> = sizes.iter().map(|&n| values.take(n)).collect();
    let g: Vec<Vec<f32>> = sizes.iter().map(|&n| values.take(n)).collect();
    let mv0: Vec<Vec<f32>> = sizes.iter().map(|&n| moments(&mut values, n)).collect();
    // Each exported parameter's bits at its range of one buffer, in order.
    let mut ranges = Vec::new();
    let mut at = 0;
    for (&n, &e) in sizes.iter().zip(&exported) {
        ranges.push(e.then(|| at..at + 2 * n));
        at += if e { 2 * n } else { 0 };
    }
    let mut bits_cpu = vec![0u8; at];

    let tensor = |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape, &Device::Cpu).unwrap();
    let params: Vec<Tensor> = p0.iter().map(|p| tensor(p, &[p.len()])).collect();
    let grads: Vec<Tensor> = g.iter().map(|g| tensor(g, &[g.len()])).collect();
    let mvs: Vec<Tensor> = mv0.iter().map(|m| tensor(m, &[2, m.len() / 2])).collect();
    let items: Vec<ManyItem> = (0..sizes.len())
        .map(|k| ManyItem {
            param: &params[k],
            grad: &grads[k],
            moments: &mvs[k],
            shrink: shrinks[k],
            out: ranges[k].clone(),
        })
        .collect();
    adamw::adamw_step_many(&items, &c, &mut bits_cpu, &Kernels::cpu()).unwrap();

    let mut gp: Vec<Guarded<f32>> = p0.iter().map(|v| Guarded::from_slice(v)).collect();
    let gg: Vec<Guarded<f32>> = g.iter().map(|v| Guarded::from_slice(v)).collect();
    let mut gmv: Vec<Guarded<f32>> = mv0.iter().map(|v| Guarded::from_slice(v)).collect();
    let mut bits = Guarded::<u16>::zeros(at / 2);
    let bits_at = bits.as_mut_ptr() as u64;
    let rows: Vec<[u64; 4]> = (0..sizes.len())
        .map(|k| {
            [
                gp[k].as_mut_ptr() as u64,
                gg[k].as_ptr() as u64,
                gmv[k].as_mut_ptr() as u64,
                ranges[k].as_ref().map_or(0, |r| bits_at + r.start as u64),
            ]
        })
        .collect();
    let (table, chunks, count) = many_tables(&rows, &sizes, &shrinks);
    assert_eq!(count, 4);
    // As `train_ops::adamw::many::adamw`: grid min(chunks, 65535) of MANY_THREADS = 256,
    // (tensors, chunks, n_chunks, b1, b2, gs, lr, eps, s1, s2); the table's pointers are
    // the buffers above, which outlive the launch and are not borrowed during it.
    launch(
        module,
        "adamw_many",
        ([count.min(65_535) as u32, 1, 1], [256, 1, 1]),
        &[
            Arg::buf(&table),
            Arg::buf(&chunks),
            int(count),
            Arg::f32(c.beta1),
            Arg::f32(c.beta2),
            Arg::f32(c.grad_scale),
            Arg::f32(c.lr),
            Arg::f32(c.eps),
            Arg::f32(c.s1),
            Arg::f32(c.s2),
        ],
    );
    for k in 0..sizes.len() {
        assert_eq!(gmv[k].to_vec(), cpu_vec(&mvs[k]), "moments of tensor {k}");
        assert_eq!(gp[k].to_vec(), cpu_vec(&params[k]), "parameter {k}");
        if let Some(r) = &ranges[k] {
            // The kernel's bfloat16 copy is its own parameter rounded to nearest even.
            let own: Vec<u16> = gp[k]
                .as_slice()
                .iter()
                .map(|&x| bf16::from_f32(x).to_bits())
                .collect();
            assert_eq!(&bits.as_slice()[r.start / 2..r.end / 2], own.as_slice());
            let cpu: Vec<u16> = bits_cpu[r.clone()]
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            let off_by_more_than_an_ulp = own
                .iter()
                .zip(&cpu)
                .filter(|(a, b)| a.abs_diff(**b) > 1)
                .count();
            assert_eq!(off_by_more_than_an_ulp, 0, "bfloat16 copy {k}");
        }
    }

    // The gradients' sums of squares: chunk by chunk, then (in f64) over all.
    let rows: Vec<[u64; 4]> = gg.iter().map(|g| [0, g.as_ptr() as u64, 0, 0]).collect();
    let (table, chunks, count) = many_tables(&rows, &sizes, &[1.0; 3]);
    let mut partial = Guarded::<f32>::zeros(count);
    // As `train_ops::adamw::many::square_sums`: grid n_chunks of 256, (tensors, chunks,
    // n_chunks, partial).
    launch(
        module,
        "square_sums_many",
        ([count as u32, 1, 1], [256, 1, 1]),
        &[
            Arg::buf(&table),
            Arg::buf(&chunks),
            int(count),
            Arg::buf_mut(&mut partial),
        ],
    );
    let want: Vec<f32> = g
        .iter()
        .flat_map(|g| {
            g.chunks(MANY_CHUNK)
                .map(|c| c.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() as f32)
        })
        .collect();
    assert_close("chunks' sums of squares", partial.as_slice(), &want, 1e-5);
    let total: f64 = partial.as_slice().iter().map(|&s| f64::from(s)).sum();
    let grads: Vec<&Tensor> = grads.iter().collect();
    let cpu = adamw::square_sum_many(&grads, &Kernels::cpu()).unwrap();
    assert!(
        (total - cpu).abs() <= 1e-5 * cpu,
        "sum of squares {total} where the CPU gives {cpu}"
    );
}
