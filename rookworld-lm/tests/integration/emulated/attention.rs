//! `grouped_attention.cu`: the decode step's attention over a group's shared prompt and each
//! row's own suffix (the warp, split and captured-step kernels) against the attention
//! written out in f64.

use super::*;
// Which kernel of `grouped_attention.cu` a launch runs.
use rookworld_lm::launch::AttentionKernel as Attention;

/// A decode step over the grouped cache (letters as in `grouped.rs`): 26 rows in three
/// groups of 17, 5 and 4 rows, interleaved (the first group spans two blocks of the warp
/// kernel's 16 row slots; the others leave most slots empty), prompts padded by 0, 9 and 39
/// of the pool's 40 columns (two tiles of 32 keys, one, and a single key), rows joined at
/// different suffix columns (row 0 at column 0: 46 keys of its own, two tiles; row 13 at
/// the cursor: one key).
struct Step {
    heads: usize,
    head_dim: usize,
    /// Pool columns L, suffix columns C, the column this step wrote.
    pool_len: usize,
    suffix_cols: usize,
    cursor: usize,
    group_pad: Vec<usize>,
    row_group: Vec<usize>,
    row_start: Vec<usize>,
}

impl Step {
    fn new(head_dim: usize) -> Self {
        let cursor = 45;
        let row_group = (0..26)
            .map(|r| match r % 6 {
                1 => 1,
                4 => 2,
                _ => 0,
            })
            .collect();
        let row_start = (0..26).map(|r| (r * 7) % (cursor + 1)).collect();
        Step {
            heads: 2,
            head_dim,
            pool_len: 40,
            suffix_cols: 48,
            cursor,
            group_pad: vec![0, 9, 39],
            row_group,
            row_start,
        }
    }

    fn rows(&self) -> usize {
        self.row_group.len()
    }

    fn groups(&self) -> usize {
        self.group_pad.len()
    }

    /// (N·R) row of slot (g, k), B for an empty slot, and R, as `GroupedCache::step_inputs`
    /// lays them out.
    fn scatter(&self) -> (Vec<u32>, usize) {
        let (b, n) = (self.rows(), self.groups());
        let mut members = vec![Vec::new(); n];
        for (r, &g) in self.row_group.iter().enumerate() {
            members[g].push(r as u32);
        }
        let r = members.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut scatter = vec![b as u32; n * r];
        for (g, rows) in members.iter().enumerate() {
            scatter[g * r..][..rows.len()].copy_from_slice(rows);
        }
        (scatter, r)
    }

    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// The attention output (B, H, D) in f64, the CPU path's formula
    /// (`cpu_attention::decode_attention`): for row r of group g and head h, the keys are
    /// pool columns `group_pad[g]..L` of (g, h) and suffix columns `row_start[r]..=cursor`
    /// of (r, h); `s_j = scale · q·k_j`, `p = softmax(s)`, `out = Σ_j p_j v_j`.
    /// q (≥ B, H, D); pk, pv (N, H, L, D); sk, sv (≥ B, H, C, D).
    fn reference(&self, q: &[f32], pk: &[f32], pv: &[f32], sk: &[f32], sv: &[f32]) -> Vec<f32> {
        let (h, d, l, c) = (self.heads, self.head_dim, self.pool_len, self.suffix_cols);
        let scale = f64::from(self.scale());
        let mut out = vec![0f32; self.rows() * h * d];
        for row in 0..self.rows() {
            let g = self.row_group[row];
            for head in 0..h {
                let qv = &q[(row * h + head) * d..][..d];
                let prefix = (self.group_pad[g]..l).map(|j| ((g * h + head) * l + j) * d);
                let suffix =
                    (self.row_start[row]..=self.cursor).map(|j| ((row * h + head) * c + j) * d);
                let keys: Vec<(&[f32], &[f32])> = prefix
                    .map(|at| (&pk[at..at + d], &pv[at..at + d]))
                    .chain(suffix.map(|at| (&sk[at..at + d], &sv[at..at + d])))
                    .collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|(k, _)| {
                        scale
                            * qv.iter()
                                .zip(*k)
                                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                                .sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                let y = &mut out[(row * h + head) * d..][..d];
                for (i, y) in y.iter_mut().enumerate() {
                    let sum: f64 = weights
                        .iter()
                        .zip(&keys)
                        .map(|(w, (_, v))| w * f64::from(v[i]))
                        .sum();
                    *y = (sum / total) as f32;
                }
            }
        }
        out
    }
}

/// The step's inputs in P: q for `rows` rows, the pool, the suffix for `rows` rows; each
/// buffer and the values the kernel reads.
struct AttentionInputs<P: Precision> {
    q: (Guarded<P::Bits>, Vec<f32>),
    pk: (Guarded<P::Bits>, Vec<f32>),
    pv: (Guarded<P::Bits>, Vec<f32>),
    sk: (Guarded<P::Bits>, Vec<f32>),
    sv: (Guarded<P::Bits>, Vec<f32>),
}

impl<P: Precision> AttentionInputs<P> {
    fn new(step: &Step, rows: usize, seed: u64) -> Self {
        let (h, d) = (step.heads, step.head_dim);
        let mut values = Values(seed);
        // Queries of a few units: scores that spread the softmax over the keys.
        let q = P::store(&values.scaled(rows * h * d, 3.0));
        let pool = step.groups() * h * step.pool_len * d;
        let (pk, pv) = (P::store(&values.take(pool)), P::store(&values.take(pool)));
        let suffix = rows * h * step.suffix_cols * d;
        let (sk, sv) = (
            P::store(&values.take(suffix)),
            P::store(&values.take(suffix)),
        );
        AttentionInputs { q, pk, pv, sk, sv }
    }

    fn reference(&self, step: &Step) -> Vec<f32> {
        step.reference(&self.q.1, &self.pk.1, &self.pv.1, &self.sk.1, &self.sv.1)
    }
}

/// `kernel`'s output for `step` in P against the f64 reference.
fn grouped_attention_matches<P: Precision>(kernel: Attention, head_dim: usize) {
    let Some(module) = attention_module() else {
        return;
    };
    let step = Step::new(head_dim);
    let (b, h, d) = (step.rows(), step.heads, step.head_dim);
    let (n, l, c) = (step.groups(), step.pool_len, step.suffix_cols);
    let inputs = AttentionInputs::<P>::new(&step, b, head_dim as u64);
    let want = inputs.reference(&step);
    let (scatter, r) = step.scatter();
    let u32s = |v: &[usize]| Guarded::from_slice(&v.iter().map(|&x| x as u32).collect::<Vec<_>>());
    let (scatter, row_start, group_pad) = (
        Guarded::from_slice(&scatter),
        u32s(&step.row_start),
        u32s(&step.group_pad),
    );
    let mut out = P::unwritten(b * h * d);
    // The grid `cuda::attention::launch` takes (rookworld_lm::launch::attention_grid), with
    // (q, pk, pv, sk, sv, scatter, row_start, group_pad, out, B, H, D, L, C, R, cursor,
    // scale).
    let base = match kernel {
        Attention::Warp => "grouped_attention",
        Attention::Split => "grouped_attention_split",
    };
    assert!(rookworld_lm::launch::attention_applies(
        kernel,
        P::DTYPE.size_in_bytes(),
        d
    ));
    let g = rookworld_lm::launch::attention_grid(kernel, n, h, r);
    let ((gx, gy, gz), (bx, by, bz)) = (g.grid, g.block);
    let grid = ([gx, gy, gz], [bx, by, bz]);
    launch(
        module,
        &P::kernel(base),
        grid,
        &[
            Arg::buf(&inputs.q.0),
            Arg::buf(&inputs.pk.0),
            Arg::buf(&inputs.pv.0),
            Arg::buf(&inputs.sk.0),
            Arg::buf(&inputs.sv.0),
            Arg::buf(&scatter),
            Arg::buf(&row_start),
            Arg::buf(&group_pad),
            Arg::buf_mut(&mut out),
            int(b),
            int(h),
            int(d),
            int(l),
            int(c),
            int(r),
            int(step.cursor),
            Arg::f32(step.scale()),
        ],
    );
    let what = format!("{kernel:?} attention, {}, D = {d}", P::NAME);
    assert_close(&what, &P::read(&out), &want, P::tol(1e-5));
}

#[test]
fn grouped_attention_warp_kernel_matches_the_cpu_decode_attention_in_f32() {
    grouped_attention_matches::<F32>(Attention::Warp, 64);
}

#[test]
fn grouped_attention_warp_kernel_matches_the_cpu_decode_attention_in_bf16() {
    grouped_attention_matches::<Bf16>(Attention::Warp, 64);
}

/// The largest head the warp kernel holds (four output dims a lane) and the smallest (one).
#[test]
fn grouped_attention_warp_kernel_handles_heads_of_128_and_32() {
    grouped_attention_matches::<F32>(Attention::Warp, 128);
    grouped_attention_matches::<Bf16>(Attention::Warp, 32);
}

/// D = 64: a key on 16 lanes in f32 (two keys a warp), on 8 in BF16 (four a warp); the
/// keys of a row (up to 86) walked by the block's four warps in several double passes.
#[test]
fn grouped_attention_split_matches_the_cpu_decode_attention_in_f32_and_bf16() {
    grouped_attention_matches::<F32>(Attention::Split, 64);
    grouped_attention_matches::<Bf16>(Attention::Split, 64);
}

/// A key on a whole warp (f32, D = 128: no merge across a warp's key groups) and on four
/// lanes (BF16, D = 32: eight keys a warp).
#[test]
fn grouped_attention_split_handles_a_key_per_warp_and_eight_keys_per_warp() {
    grouped_attention_matches::<F32>(Attention::Split, 128);
    grouped_attention_matches::<Bf16>(Attention::Split, 32);
}

/// The captured step's attention: a bucket of 32 rows, 26 live; rows past the live ones
/// leave their output untouched.
fn row_attention_matches<P: Precision>() {
    let Some(module) = attention_module() else {
        return;
    };
    let step = Step::new(64);
    let (live, h, d) = (step.rows(), step.heads, step.head_dim);
    let bucket = 32; // grouped::bucket(26)
    let inputs = AttentionInputs::<P>::new(&step, bucket, 3);
    let want = inputs.reference(&step);
    // The parts of the step's input buffer (`GraphLayout`), each in a buffer of its own:
    // (live rows, cursor), each row's group and first column (bucket long; padding rows
    // in group 0 from the cursor, as `graph_step_inputs` pads them), each group's padding.
    let mut row_group: Vec<u32> = step.row_group.iter().map(|&g| g as u32).collect();
    row_group.resize(bucket, 0);
    let mut row_start: Vec<u32> = step.row_start.iter().map(|&s| s as u32).collect();
    row_start.resize(bucket, step.cursor as u32);
    let group_pad: Vec<u32> = step.group_pad.iter().map(|&p| p as u32).collect();
    let header = Guarded::from_slice(&[live as u32, step.cursor as u32]);
    let (row_group, row_start, group_pad) = (
        Guarded::from_slice(&row_group),
        Guarded::from_slice(&row_start),
        Guarded::from_slice(&group_pad),
    );
    let sentinel = P::bits(7.0);
    let mut out = Guarded::from_slice(&vec![sentinel; bucket * h * d]);
    // The grid `DecodeGraphs::enqueue` takes (rookworld_lm::launch::row_attention_grid),
    // with (q, pk, pv, sk, sv, step, row_group, row_start, group_pad, out, H, D, L, C,
    // scale).
    let g = rookworld_lm::launch::row_attention_grid(bucket, h);
    let ((gx, gy, gz), (bx, by, bz)) = (g.grid, g.block);
    launch(
        module,
        &P::kernel("row_attention"),
        ([gx, gy, gz], [bx, by, bz]),
        &[
            Arg::buf(&inputs.q.0),
            Arg::buf(&inputs.pk.0),
            Arg::buf(&inputs.pv.0),
            Arg::buf(&inputs.sk.0),
            Arg::buf(&inputs.sv.0),
            Arg::buf(&header),
            Arg::buf(&row_group),
            Arg::buf(&row_start),
            Arg::buf(&group_pad),
            Arg::buf_mut(&mut out),
            int(h),
            int(d),
            int(step.pool_len),
            int(step.suffix_cols),
            Arg::f32(step.scale()),
        ],
    );
    let got = P::read(&out);
    let (rows, padding) = got.split_at(live * h * d);
    assert_close(
        &format!("row attention, {}", P::NAME),
        rows,
        &want,
        P::tol(1e-5),
    );
    assert!(
        out.as_slice()[live * h * d..]
            .iter()
            .all(|&b| b == sentinel),
        "row attention wrote a padding row: {:?}",
        &padding[..8]
    );
}

#[test]
fn row_attention_matches_the_cpu_decode_attention_and_skips_padding_rows() {
    row_attention_matches::<F32>();
    row_attention_matches::<Bf16>();
}
