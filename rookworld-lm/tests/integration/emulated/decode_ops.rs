//! `decode_ops.cu`: the fused decode ops against their formulas and CPU implementations.

use super::*;

/// q, k and v of c_attn's (B, 3E) output plus its bias, each written at its column of a
/// (·, H, C, D) buffer: `dst[((r·H + h)·C + col)·D + d] = qkv[r, part·E + h·D + d] +
/// bias[part·E + h·D + d]` rounded once to the type (`decode_ops::QkvSplit`), every other
/// element untouched. Through `qkv_split` (col an argument) and `qkv_split_step` (col read
/// from the step's header).
fn qkv_split_matches<P: Precision>() {
    let Some(module) = decode_ops_module() else {
        return;
    };
    // B·E = 504: two blocks, the second partly idle.
    let (b, h, d) = (7usize, 3usize, 24usize);
    let e = h * d;
    let mut values = Values(23);
    let (qkv, qkv_v) = P::store(&values.scaled(b * 3 * e, 2.0));
    let (bias, bias_v) = P::store(&values.take(3 * e));
    let expect = |dst0: &[P::Bits], part: usize, cap_c: usize, col: usize| -> Vec<P::Bits> {
        let mut dst = dst0.to_vec();
        for r in 0..b {
            for i in 0..e {
                let v = qkv_v[r * 3 * e + part * e + i] + bias_v[part * e + i];
                dst[((r * h + i / d) * cap_c + col) * d + i % d] = P::bits(v);
            }
        }
        dst
    };
    // q into its own (B, H, 1, D): `cuda::ops::qkv_extract` (C = 1, col 0).
    let mut q = P::unwritten(b * e);
    // As `cuda::ops::split_into`: elementwise(B·E), (qkv, bias, dst, part, B, H, D, C, col).
    launch(
        module,
        &P::kernel("qkv_split"),
        elementwise(b * e),
        &[
            Arg::buf(&qkv),
            Arg::buf(&bias),
            Arg::buf_mut(&mut q),
            int(0),
            int(b),
            int(h),
            int(d),
            int(1),
            int(0),
        ],
    );
    assert_eq!(q.to_vec(), expect(&vec![P::bits(0.0); b * e], 0, 1, 0), "q");
    // k and v into a cache of 9 rows and 11 columns at column 6 (`write_into`), and through
    // the captured step's kernel at column 10, the last.
    let (cap, c) = (9usize, 11usize);
    let dst0: Vec<P::Bits> = values
        .take(cap * h * c * d)
        .iter()
        .map(|&x| P::bits(x))
        .collect();
    for part in [1usize, 2] {
        let mut dst = Guarded::from_slice(&dst0);
        launch(
            module,
            &P::kernel("qkv_split"),
            elementwise(b * e),
            &[
                Arg::buf(&qkv),
                Arg::buf(&bias),
                Arg::buf_mut(&mut dst),
                int(part),
                int(b),
                int(h),
                int(d),
                int(c),
                int(6),
            ],
        );
        assert_eq!(
            dst.to_vec(),
            expect(&dst0, part, c, 6),
            "part {part} at column 6"
        );
        let header = Guarded::from_slice(&[b as u32, 10]);
        let mut dst = Guarded::from_slice(&dst0);
        // As `DecodeGraphs::enqueue`: elementwise(B·E), (qkv, bias, dst, part, B, H, D, C,
        // step).
        launch(
            module,
            &P::kernel("qkv_split_step"),
            elementwise(b * e),
            &[
                Arg::buf(&qkv),
                Arg::buf(&bias),
                Arg::buf_mut(&mut dst),
                int(part),
                int(b),
                int(h),
                int(d),
                int(c),
                Arg::buf(&header),
            ],
        );
        assert_eq!(
            dst.to_vec(),
            expect(&dst0, part, c, 10),
            "part {part} at the step's column"
        );
    }
}

#[test]
fn qkv_split_writes_each_part_plus_bias_at_its_column_in_f32_and_bf16() {
    qkv_split_matches::<F32>();
    qkv_split_matches::<Bf16>();
}

/// `tok[r] = wte[ids[r]]`, `pos[r] = wpe[positions[r]]`, copied exactly.
fn embed_rows_matches<P: Precision>() {
    let Some(module) = decode_ops_module() else {
        return;
    };
    let (b, e, v, p) = (6usize, 70usize, 50usize, 30usize);
    let mut values = Values(29);
    let (wte, wte_v) = P::store(&values.take(v * e));
    let (wpe, wpe_v) = P::store(&values.take(p * e));
    let ids: Vec<u32> = (0..b as u32).map(|r| (r * 17 + 3) % v as u32).collect();
    let positions: Vec<u32> = (0..b as u32).map(|r| (r * 11 + 29) % p as u32).collect();
    let (gi, gp) = (Guarded::from_slice(&ids), Guarded::from_slice(&positions));
    let (mut tok, mut pos) = (P::unwritten(b * e), P::unwritten(b * e));
    // As `DecodeGraphs::enqueue`: elementwise(B·E), (wte, wpe, ids, positions, tok, pos, B,
    // E).
    launch(
        module,
        &P::kernel("embed_rows"),
        elementwise(b * e),
        &[
            Arg::buf(&wte),
            Arg::buf(&wpe),
            Arg::buf(&gi),
            Arg::buf(&gp),
            Arg::buf_mut(&mut tok),
            Arg::buf_mut(&mut pos),
            int(b),
            int(e),
        ],
    );
    let rows = |table: &[f32], at: &[u32]| -> Vec<f32> {
        at.iter()
            .flat_map(|&i| table[i as usize * e..][..e].to_vec())
            .collect()
    };
    assert_eq!(P::read(&tok), rows(&wte_v, &ids), "token embeddings");
    assert_eq!(
        P::read(&pos),
        rows(&wpe_v, &positions),
        "position embeddings"
    );
}

#[test]
fn embed_rows_copies_each_rows_token_and_position_embeddings_in_f32_and_bf16() {
    embed_rows_matches::<F32>();
    embed_rows_matches::<Bf16>();
}

/// `gelu_new(x + b)` against the fused op's CPU implementation (`train_ops::bias_gelu`, the
/// decode step's `BiasGelu`) on the same values in the same dtype.
fn bias_gelu_matches<P: Precision>() {
    let Some(module) = decode_ops_module() else {
        return;
    };
    let (m, n) = (5usize, 130usize);
    let mut values = Values(31);
    let (x, x_v) = P::store(&values.scaled(m * n, 4.0));
    let (bias, bias_v) = P::store(&values.take(n));
    let on_cpu = |v: Vec<f32>, shape: &[usize]| {
        Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(P::DTYPE)
            .unwrap()
    };
    let want = train_ops::bias_gelu(&on_cpu(x_v, &[m, n]), &on_cpu(bias_v, &[n]))
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let mut out = P::unwritten(m * n);
    // As `cuda::ops::bias_gelu_t`: elementwise(M·N), (x, bias, out, M, N).
    launch(
        module,
        &P::kernel("bias_gelu"),
        elementwise(m * n),
        &[
            Arg::buf(&x),
            Arg::buf(&bias),
            Arg::buf_mut(&mut out),
            int(m),
            int(n),
        ],
    );
    assert_close(
        &format!("bias + GELU, {}", P::NAME),
        &P::read(&out),
        &want,
        P::tol(1e-5),
    );
}

#[test]
fn bias_gelu_matches_the_decode_ops_cpu_implementation_in_f32_and_bf16() {
    bias_gelu_matches::<F32>();
    bias_gelu_matches::<Bf16>();
}

/// `s = x + (y + c)`, each addition rounded to the type (bit for bit the CPU op's,
/// `decode_ops::AddLayerNorm`), then `(s − μ)/√(σ² + eps) · w + b` with μ and σ² the
/// row's mean and population variance (here in f64), out = (2, M, E): s, then the norm.
fn add_layer_norm_matches<P: Precision>() {
    let Some(module) = decode_ops_module() else {
        return;
    };
    // E = 300: threads 0..43 take two columns, the rest one.
    let (m, e, eps) = (5usize, 300usize, 1e-5f32);
    let mut values = Values(37);
    let (x, x_v) = P::store(&values.scaled(m * e, 2.0));
    let (y, y_v) = P::store(&values.take(m * e));
    let (c, c_v) = P::store(&values.take(e));
    let (w, w_v) = P::store(&values.take(e));
    let (b, b_v) = P::store(&values.take(e));
    let round = |v: f32| P::value(P::bits(v));
    let sums: Vec<f32> = (0..m * e)
        .map(|i| round(x_v[i] + round(y_v[i] + c_v[i % e])))
        .collect();
    let mut norms = vec![0f32; m * e];
    for (s, out) in sums.chunks(e).zip(norms.chunks_mut(e)) {
        let mean = s.iter().map(|&v| f64::from(v)).sum::<f64>() / e as f64;
        let var = s
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / e as f64;
        let inv = 1.0 / (var + f64::from(eps)).sqrt();
        for (i, o) in out.iter_mut().enumerate() {
            *o = ((f64::from(s[i]) - mean) * inv * f64::from(w_v[i]) + f64::from(b_v[i])) as f32;
        }
    }
    let mut out = P::unwritten(2 * m * e);
    // As `cuda::ops::add_layer_norm_t` (and `DecodeGraphs::add_norm`): grid (M), block
    // (256), (E + 32)·4 bytes of dynamic shared memory, (x, y, c, w, b, out, M, E, eps).
    launch_shared(
        module,
        &P::kernel("add_layer_norm"),
        ([m as u32, 1, 1], [256, 1, 1]),
        ((e + 32) * 4) as u32,
        &[
            Arg::buf(&x),
            Arg::buf(&y),
            Arg::buf(&c),
            Arg::buf(&w),
            Arg::buf(&b),
            Arg::buf_mut(&mut out),
            int(m),
            int(e),
            Arg::f32(eps),
        ],
    );
    let got = P::read(&out);
    let (got_sums, got_norms) = got.split_at(m * e);
    assert_eq!(got_sums, sums.as_slice(), "residual sums, {}", P::NAME);
    assert_close(
        &format!("layer norm, {}", P::NAME),
        got_norms,
        &norms,
        P::tol(1e-5),
    );
}

#[test]
fn add_layer_norm_matches_the_residual_add_then_layer_norm_in_f32_and_bf16() {
    add_layer_norm_matches::<F32>();
    add_layer_norm_matches::<Bf16>();
}
