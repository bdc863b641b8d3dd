//! `sample.cu`: the device sampler against `device_sampling::sample_reference`, row by row.

use super::*;

fn draw(temperature: f32, top_k: u32, top_p: f32, uniform: f64) -> RowDraw {
    RowDraw {
        temperature,
        top_k,
        top_p,
        uniform,
    }
}

/// Draws `rows` (each V logits, in P) through `sample_rows_*` with rows `ld` apart (the
/// padding holds 100, above every logit: a read past column V would win) and checks each
/// row against `sample_reference` on the values the kernel read.
fn sample_rows_match<P: Precision>(v: usize, ld: usize, rows: &[(Vec<f32>, RowDraw)]) {
    let Some(module) = sample_module() else {
        return;
    };
    let b = rows.len();
    // (B − 1)·ld + V elements, as `cuda::sample::sample_rows` slices them: the last row's
    // end is the buffer's.
    let mut logits = Vec::with_capacity((b - 1) * ld + v);
    for (i, (row, _)) in rows.iter().enumerate() {
        assert_eq!(row.len(), v);
        logits.extend_from_slice(row);
        if i + 1 < b {
            logits.extend(std::iter::repeat_n(100.0, ld - v));
        }
    }
    let (logits, read) = P::store(&logits);
    let draws: Vec<f64> = rows
        .iter()
        .flat_map(|(_, d)| {
            [
                f64::from(d.temperature),
                f64::from(d.top_k),
                f64::from(d.top_p),
                d.uniform,
            ]
        })
        .collect();
    let draws = Guarded::from_slice(&draws);
    let mut out = Guarded::<u32>::zeros(3 * b);
    // As `cuda::sample::sample_rows` (and `DecodeGraphs::enqueue`): grid (B) of
    // SAMPLE_THREADS, (logits, V, ld, draws, out).
    launch(
        module,
        &P::kernel("sample_rows"),
        (
            [b as u32, 1, 1],
            [rookworld_lm::launch::SAMPLE_THREADS, 1, 1],
        ),
        &[
            Arg::buf(&logits),
            int(v),
            Arg::u64(ld as u64),
            Arg::buf(&draws),
            Arg::buf_mut(&mut out),
        ],
    );
    let out = out.to_vec();
    let (tokens, rest) = out.split_at(b);
    let (logprobs, status) = rest.split_at(b);
    for (r, (_, d)) in rows.iter().enumerate() {
        let what = format!("{} row {r} ({d:?})", P::NAME);
        let lp = f32::from_bits(logprobs[r]);
        match sample_reference(&read[r * ld..][..v], d) {
            Ok(want) => {
                assert_eq!(status[r], 0, "{what}: status");
                assert_eq!(tokens[r], want.token, "{what}: token");
                assert!(
                    (lp - want.logprob).abs() <= 2e-5 * want.logprob.abs().max(1.0),
                    "{what}: log-probability {lp} where the reference gives {}",
                    want.logprob
                );
            }
            Err(_) => {
                assert_eq!(status[r], 1, "{what}: status of a row with no finite logit");
                assert_eq!(tokens[r], 0, "{what}: token");
                assert!(lp.is_nan(), "{what}: log-probability {lp}");
            }
        }
    }
}

/// Rows of 3001 logits (each warp a segment of 96 tokens, three rounds of 32, the draw's
/// runs three tokens a lane; the last warp's segment part-filled) under every kind of
/// draw, rows 3072 apart.
fn sampling_rows(values: &mut Values, v: usize) -> Vec<(Vec<f32>, RowDraw)> {
    let settings = [
        // Greedy, and greedy where 1/T overflows.
        (0.0f32, 0u32, 1.0f32),
        (1e-39, 0, 1.0),
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.0, 50, 1.0),
        (1.0, 0, 0.9),
        (0.8, 40, 0.95),
        (1.3, 1, 1.0),
        (1.0, 0, 0.05),
        // Top-k past the vocabulary: off.
        (1.0, v as u32 + 5, 1.0),
    ];
    settings
        .iter()
        .enumerate()
        .map(|(i, &(t, k, p))| {
            let mut row = values.scaled(v, 6.0);
            match i {
                // A tie for the maximum within a warp (tokens 10 and 40, two rounds of warp
                // 0's segment) and across warps (token 2000, warp 20's): the first wins; NaNs
                // lose.
                0 => {
                    row.iter_mut()
                        .skip(3)
                        .step_by(7)
                        .for_each(|x| *x = f32::NAN);
                    for i in [10, 40, 2000] {
                        row[i] = 9.0;
                    }
                }
                // Masked tokens.
                2 | 6 => row
                    .iter_mut()
                    .step_by(5)
                    .for_each(|x| *x = f32::NEG_INFINITY),
                _ => {}
            }
            let uniform = (i as f64 * 0.618_033_988_749_895 + 0.1).fract();
            (row, draw(t, k, p, uniform))
        })
        .collect()
}

#[test]
fn sample_rows_draws_the_reference_token_in_f32_from_padded_rows() {
    let v = 3001;
    let rows = sampling_rows(&mut Values(67), v);
    sample_rows_match::<F32>(v, v.next_multiple_of(64), &rows);
}

#[test]
fn sample_rows_draws_the_reference_token_in_bf16_from_padded_rows() {
    let v = 3001;
    let rows = sampling_rows(&mut Values(71), v);
    sample_rows_match::<Bf16>(v, v.next_multiple_of(64), &rows);
}

/// A vocabulary of 1000 (segments of 32 tokens, the last warp's 8), contiguous rows: a
/// row of NaNs and one of −∞ (no finite logit: status 1), a row with a single finite
/// logit (the last token), and a tempered draw.
#[test]
fn sample_rows_reports_rows_with_no_finite_logit_and_draws_the_rest() {
    let v = 1000;
    let mut values = Values(73);
    let mut single = vec![f32::NEG_INFINITY; v];
    single[999] = -3.0;
    let rows = vec![
        (vec![f32::NAN; v], draw(1.0, 0, 1.0, 0.5)),
        (values.scaled(v, 6.0), draw(0.9, 20, 0.8, 0.3)),
        (vec![f32::NEG_INFINITY; v], draw(0.0, 0, 1.0, 0.5)),
        (single, draw(1.0, 0, 0.5, 0.999)),
    ];
    sample_rows_match::<F32>(v, v, &rows);
}

/// Vocabularies under a block's threads, so that most warps' segments are empty: every
/// kind of draw on rows of 5 and 100 logits (3 and 29 warps with none).
#[test]
fn sample_rows_draws_from_rows_shorter_than_the_block() {
    let mut values = Values(79);
    for v in [5usize, 100] {
        let mut rows = Vec::new();
        for (i, &(t, k, p)) in [
            (0.0f32, 0u32, 1.0f32),
            (1.0, 0, 1.0),
            (0.8, 3, 1.0),
            (1.0, 0, 0.5),
            (0.7, 4, 0.9),
        ]
        .iter()
        .enumerate()
        {
            let uniform = (i as f64 * 0.618_033_988_749_895 + 0.3).fract();
            rows.push((values.scaled(v, 6.0), draw(t, k, p, uniform)));
        }
        rows.push((values.scaled(v, 6.0), draw(1.0, 0, 1.0, 0.999_999)));
        rows.push((values.scaled(v, 6.0), draw(1.0, 0, 1.0, 0.0)));
        sample_rows_match::<F32>(v, v, &rows);
    }
}

/// The launch's threads are the kernel's `THREADS`.
#[test]
fn the_samplers_block_is_the_kernels() {
    let source = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/sample.cu"),
    )
    .unwrap();
    let define = format!("#define THREADS {}", rookworld_lm::launch::SAMPLE_THREADS);
    assert!(source.lines().any(|l| l.trim() == define), "{define}");
}
