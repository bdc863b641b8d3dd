//! AMX tiles (Intel Xeons since Sapphire Rapids): the BF16 and INT8 products of
//! [`gemm_bf16`](super::gemm_bf16) and of [`PackedMatrix`](super::PackedMatrix)'s BF16 pair
//! and INT8 panels, where the CPU has AMX and the kernel lets this process use it.
//!
//! A tile register holds 16 rows of 64 bytes. `tdpbf16ps C, A, B` adds to each f32 of the
//! 16 × 16 tile C the dot products of a row of A (32 BF16 values of k) with a column of B
//! (16 rows of k-pairs, each column's pair adjacent): 8,192 multiply-adds in one
//! instruction, summed in f32 as `vdpbf16ps` sums (both inputs BF16, subnormals flushed).
//! `tdpbusd` does the same for unsigned × signed bytes in groups of four k into i32: the
//! INT8 panels' `vpdpbusd`, to the same sums. The B layouts are the panels' own: a BF16
//! pair panel (⌈K/2⌉, 16, 2) and an INT8 panel (⌈K/4⌉, 16 × 4) are B tiles of 16 k-steps
//! stacked (64 bytes a row), so a panel whose k-groups fill whole tiles is multiplied in
//! place. The left operand is packed row-major ([`pack_bf16`], the INT8 quantizer's
//! [`super::int8::quantize_rows_flat`]), K padded with zeros to whole tiles, rows to
//! whole tiles.
//!
//! A block is at most 2 × 2 output tiles (32 × 32): tiles 0–3 hold its sums, 4–5 the two
//! row tiles of A, 6–7 the two panels' B tiles, every k-step 4 loads and 4 products. The
//! work is split like [`gemm_bf16`](super::gemm_bf16)'s: items of a chunk of row tiles times
//! a group of panels, each configured for tiles on its own thread.
//!
//! Use needs three things: the CPU says AMX-TILE (with AMX-BF16 or AMX-INT8) in CPUID leaf
//! 7; Linux grants this process the tile data's state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`, refused by kernels before 5.16 and by some sandboxes); and a
//! product of each kind agrees with its reference once, at first use. A refusal or a
//! disagreement leaves the AVX-512 kernels in charge, said once in the log ([`status`]).
//! `ROOKWORLD_CPU_KERNELS=avx512` (or `avx2`) turns the tiles off.

use rayon::prelude::*;

use super::lines::Lines;

/// Rows of a tile (and of a block of the left operand).
pub(super) const TILE_ROWS: usize = 16;
/// Bytes of a tile row: 32 BF16 or 64 INT8 values of k; one k-step.
const ROW_BYTES: usize = 64;
/// Bytes of one k-step of a panel: 16 rows of 64 bytes.
const STEP_BYTES: usize = TILE_ROWS * ROW_BYTES;
/// Row tiles per work item: 256 rows, whose packed values (K ≤ 3,520 in BF16: ≤ 1.8 MiB)
/// stay in a core's L2 across the item's panels.
const CHUNK_TILES: usize = 16;
/// Panels per work item at most: 192 columns.
const PANEL_GROUP: usize = 12;

/// The AMX products this process uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Amx {
    /// `tdpbf16ps`: BF16 pair panels and [`gemm_bf16`](super::gemm_bf16).
    pub bf16: bool,
    /// `tdpbusd`: INT8 panels.
    pub int8: bool,
}

/// What of [`Amx`] the products use here: detected, granted and checked once.
pub fn amx() -> Amx {
    state().0
}

/// One line on the tiles here: `"amx-bf16 amx-int8"` (those in use), or `"off: "` and why
/// (no AMX on this CPU, the kernel's refusal, a failed check, the environment).
pub fn status() -> &'static str {
    &state().1
}

fn state() -> &'static (Amx, String) {
    static STATE: std::sync::OnceLock<(Amx, String)> = std::sync::OnceLock::new();
    STATE.get_or_init(|| {
        let found = match granted() {
            Ok(found) => found,
            Err(why) => {
                if why.starts_with("the kernel") {
                    tracing::info!("AMX tiles unused, AVX-512 kernels instead: {why}");
                }
                return (Amx::default(), format!("off: {why}"));
            }
        };
        // On a pool of its own: the check's products use threads, and every thread of the
        // global pool may be waiting here for this very value.
        let checked = match rayon::ThreadPoolBuilder::new().num_threads(2).build() {
            Ok(pool) => pool.install(|| check(found)),
            Err(e) => {
                return (
                    Amx::default(),
                    format!("off: no threads for its check: {e}"),
                );
            }
        };
        let mut names = Vec::new();
        if checked.bf16 {
            names.push("amx-bf16");
        }
        if checked.int8 {
            names.push("amx-int8");
        }
        let line = if names.is_empty() {
            "off: its products disagreed with the reference".to_string()
        } else {
            names.join(" ")
        };
        (checked, line)
    })
}

/// What the CPU offers and the kernel grants, or why nothing.
fn granted() -> Result<Amx, String> {
    if let Ok(v) = std::env::var("ROOKWORLD_CPU_KERNELS")
        && (v == "avx2" || v == "avx512")
    {
        return Err(format!("turned off by ROOKWORLD_CPU_KERNELS={v}"));
    }
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        // CPUID leaf 7, sub-leaf 0, EDX: AMX-BF16 (bit 22), AMX-TILE (24), AMX-INT8 (25).
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        let has = |bit: u32| edx >> bit & 1 == 1;
        if !has(24) || !crate::cpu_features::avx512().bf16 {
            return Err("this CPU has no AMX tiles".into());
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with an integer argument reads and writes no memory of ours.
        let refused = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        } != 0;
        if refused {
            return Err(format!(
                "the kernel refuses this process the tile data (arch_prctl \
                 ARCH_REQ_XCOMP_PERM: {})",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Amx {
            bf16: has(22),
            int8: has(25),
        })
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    Err("AMX is used on x86-64 Linux only".into())
}

/// `found` less any product that disagrees with its reference on a product with edge
/// tiles in every dimension (each such disagreement a WARN line).
fn check(found: Amx) -> Amx {
    let (m, n, k) = (37, 40, 256); // INT8 panels of whole tiles: K a multiple of 64
    let value = |i: usize, seed: usize| ((i * 7 + seed * 13) % 23) as f32 / 11.0 - 1.0;
    let a: Vec<f32> = (0..m * k).map(|i| value(i, 1)).collect();
    let b: Vec<f32> = (0..k * n).map(|i| value(i, 2)).collect();
    let mut out = found;
    if found.bf16 {
        let (rows, stride) = pack_bf16((&a, k, 1), m, k);
        let kps = k.div_ceil(2).next_multiple_of(TILE_ROWS);
        let panels = pair_panels(&b, k, n, kps);
        let mut got = vec![0f32; m * n];
        bf16_product(
            &mut got,
            (m, n),
            false,
            (&rows, stride),
            (&panels, kps, 0..kps / TILE_ROWS),
            None,
        );
        let round = |v: f32| f64::from(half::bf16::from_f32(v).to_f32());
        let worst = max_error(&got, m, n, |i, j| {
            (0..k)
                .map(|kk| round(a[i * k + kk]) * round(b[kk * n + j]))
                .sum()
        });
        if worst > 1e-4 {
            tracing::warn!(
                worst,
                "AMX BF16 products disagree with the reference: turned off"
            );
            out.bf16 = false;
        }
    }
    if found.int8 {
        let (rows, scales) = super::int8::quantize_rows_flat(&a, m, k);
        let panels = super::int8::Int8Panels::new_filled(&b, k, n);
        let mut got = vec![0f32; m * n];
        int8_product(&mut got, (m, n, k), (&rows, &scales), &panels, None);
        let want = panels.reference_product(&a, (m, n, k));
        let worst = max_error(&got, m, n, |i, j| f64::from(want[i * n + j]));
        if worst != 0.0 {
            tracing::warn!(
                worst,
                "AMX INT8 products disagree with the reference: turned off"
            );
            out.int8 = false;
        }
    }
    out
}

/// `b` (K, N) row-major in pair panels of `kps` pairs, value by value: (⌈N/16⌉, kps, 16,
/// 2), each column's k = 2·pair, 2·pair + 1 adjacent, zero past K and N. The check's own
/// packing, apart from the packers it checks the tiles for.
fn pair_panels(b: &[f32], k: usize, n: usize, kps: usize) -> Vec<u16> {
    let mut panels = vec![0u16; n.div_ceil(16) * kps * 32];
    for kk in 0..k {
        for c in 0..n {
            let (p, col) = (c / 16, c % 16);
            let at = (p * kps + kk / 2) * 32 + col * 2 + kk % 2;
            panels[at] = half::bf16::from_f32(b[kk * n + c]).to_bits();
        }
    }
    panels
}

/// The largest |got − want(i, j)| over an (m, n) result.
fn max_error(got: &[f32], m: usize, n: usize, want: impl Fn(usize, usize) -> f64) -> f64 {
    (0..m * n)
        .map(|i| (f64::from(got[i]) - want(i / n, i % n)).abs())
        .fold(0.0, f64::max)
}

/// `a` (M, K) rounded to BF16 into whole row tiles: (⌈M/16⌉·16, stride) row-major with
/// `stride` = K rounded up to whole k-steps (32), zero past K and past M. Returns the values
/// and the stride.
pub(super) fn pack_bf16(a: super::tile::Strided, m: usize, k: usize) -> (Lines<u16>, usize) {
    let mut rows = Lines::default();
    let stride = pack_bf16_into(&mut rows, a, m, k);
    (rows, stride)
}

/// [`pack_bf16`] into `rows` (resized; its memory reused); returns the stride.
pub(super) fn pack_bf16_into(
    rows: &mut Lines<u16>,
    (a, rs, cs): super::tile::Strided,
    m: usize,
    k: usize,
) -> usize {
    let stride = k.next_multiple_of(32);
    // Every value is written below: the operand's, or zero past K and M.
    rows.fit(m.div_ceil(TILE_ROWS) * TILE_ROWS * stride);
    rows.par_chunks_mut(TILE_ROWS * stride)
        .enumerate()
        .for_each_init(Vec::new, |wide: &mut Vec<f32>, (t, tile)| {
            let height = TILE_ROWS.min(m - t * TILE_ROWS);
            let first = t * TILE_ROWS;
            for (r, row) in tile.chunks_exact_mut(stride).enumerate() {
                row[if r < height { k } else { 0 }..].fill(0);
            }
            if cs != 1 && rs == 1 {
                // A transposed operand: the tile's rows are adjacent at each k, so read k
                // after k (one short run per k) rather than each row down its stride.
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx512bw") {
                    // The operand's extent: a value per (row < height, k < K) from `first`.
                    assert!(a.len() >= first + height + (k - 1) * cs);
                    // SAFETY: AVX512F, BW and BF16 are present (BF16 where tiles are in use,
                    // checked before any is packed; BW above); reads stay inside `a`
                    // (asserted), writes inside the tile (16 rows of `stride` ≥ K values).
                    unsafe { tile_from_columns(tile, stride, a[first..].as_ptr(), cs, height, k) };
                    return;
                }
                wide.clear();
                wide.resize(height * k, 0.0); // (height, K)
                for kk in 0..k {
                    let run = &a[first + kk * cs..][..height];
                    for (r, &v) in run.iter().enumerate() {
                        wide[r * k + kk] = v;
                    }
                }
                for (r, row) in wide.chunks_exact(k).enumerate() {
                    super::round::round_into(row, &mut tile[r * stride..r * stride + k]);
                }
                return;
            }
            for r in 0..height {
                let start = (first + r) * rs;
                let dst = &mut tile[r * stride..r * stride + k];
                if cs == 1 {
                    super::round::round_into(&a[start..start + k], dst);
                } else {
                    wide.clear();
                    wide.extend((0..k).map(|kk| a[start + kk * cs]));
                    super::round::round_into(wide, dst);
                }
            }
        });
    stride
}

/// One row tile of [`pack_bf16`] from a transposed operand (row r, k at `a + r + k·cs`):
/// per pair of k, the two runs of `height` values rounded together (`vcvtne2ps2bf16`) and
/// interleaved into each row's pair (`vpermw`); 16 pairs at a time turned into the rows'
/// 64-byte runs ([`transpose_16x16`](super::round::transpose_16x16)), one store a row,
/// instead of a scatter per pair. Rows past `height` and pairs past K are written zero.
///
/// # Safety
/// The CPU has AVX512F, AVX512BW and AVX512-BF16; `a + r + kk·cs` is readable for r <
/// height ≤ 16, kk < k; `tile` holds 16 rows of `stride` values, `stride` a multiple of 32
/// at least k, starting a cache line.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile_from_columns(
    tile: &mut [u16],
    stride: usize,
    a: *const f32,
    cs: usize,
    height: usize,
    k: usize,
) {
    use std::arch::x86_64::*;
    assert!(tile.len() >= TILE_ROWS * stride && stride >= k && height <= TILE_ROWS);
    assert!(stride.is_multiple_of(32));
    let kp = k.div_ceil(2);
    // SAFETY: (the whole body) the caller guarantees the features and extents: loads are
    // masked to `height` rows at k < K, each store is 16 pairs of one of the 16 rows, below
    // `stride` (a whole number of 32 values).
    unsafe {
        let mask: __mmask16 = if height >= 16 {
            !0
        } else {
            (1u16 << height) - 1
        };
        let out = tile.as_mut_ptr();
        for group in 0..kp.div_ceil(16) {
            // pairs[p] lane r: row r's pair 16·group + p.
            let mut pairs = [_mm512_setzero_si512(); 16];
            for (p, lanes) in pairs.iter_mut().enumerate() {
                let pair = 16 * group + p;
                if pair < kp {
                    let odd = (2 * pair + 1 < k).then(|| a.add((2 * pair + 1) * cs));
                    *lanes = super::round::rounded_pairs(mask, a.add(2 * pair * cs), odd);
                }
            }
            super::round::transpose_16x16(&mut pairs);
            for (r, run) in pairs.iter().enumerate() {
                _mm512_storeu_si512(out.add(r * stride + 32 * group).cast(), *run);
            }
        }
    }
}

/// What is done to each row of results before it is written (bias, epilogue):
/// `finish(first column, values)`.
pub(super) type Finish<'a> = &'a (dyn Fn(usize, &mut [f32]) + Sync);

/// `dst` (M, N) [+]= `a` · `b` over BF16 tiles: `a` from [`pack_bf16`] (values, stride),
/// `b` pair panels of `kps` pairs each (a multiple of 16), zero past K, starting a cache
/// line, of which k-steps `steps` (32 values of k each) are multiplied: `a`'s columns are
/// those steps' k. Without `finish`, whole tiles of sums are kept in `dst` itself (loaded
/// from it when accumulating or on a later pass, stored straight back).
///
/// # Panics
/// When an operand is too short for the shape, `kps` is not a whole number of k-steps, or
/// `steps` are not among them.
pub(super) fn bf16_product(
    dst: &mut [f32],
    (m, n): (usize, usize),
    accumulate: bool,
    (a, stride): (&[u16], usize),
    (b, kps, steps): (&[u16], usize, std::ops::Range<usize>),
    finish: Option<Finish>,
) {
    assert!(
        kps.is_multiple_of(TILE_ROWS) && dst.len() >= m * n,
        "gemm dst too short"
    );
    assert!(
        steps.end <= kps / TILE_ROWS,
        "k-steps {steps:?} of {kps} pairs"
    );
    // From the first step on: panel p's steps at p·kps pairs, each 512 values.
    let b = &b[steps.start * TILE_ROWS * 32..];
    let target = super::tile::SharedOut(dst.as_mut_ptr());
    let direct = finish.is_none().then_some(Direct {
        c: target,
        stride: 4 * n,
        accumulate,
    });
    drive::<false>(
        (m, n, steps.len()),
        (a.as_ptr().cast(), 2 * stride, a.len() * 2),
        (b.as_ptr().cast(), kps * 64, b.len() * 2),
        direct,
        &|(row, col), sums: &[u32]| {
            let mut line = [0f32; 16];
            let line = &mut line[..sums.len()];
            for (l, &s) in line.iter_mut().zip(sums) {
                *l = f32::from_bits(s);
            }
            if let Some(finish) = finish {
                finish(col, line);
            }
            // SAFETY: the item (row, col..) is this thread's alone, inside (m, n).
            unsafe { target.put(row * n + col, line, accumulate) };
        },
    );
}

/// `dst` (M, N) = the INT8 product of quantized rows (`a`: [`quantize_rows_flat`]'s bytes
/// and row scales) and `panels`, dequantized; then `finish(first column, values)` on each
/// row of results (bias, epilogue) before it is written.
///
/// [`quantize_rows_flat`]: super::int8::quantize_rows_flat
pub(super) fn int8_product(
    dst: &mut [f32],
    (m, n, k): (usize, usize, usize),
    (a, row_scales): (&[u8], &[f32]),
    panels: &super::int8::Int8Panels,
    finish: Option<Finish>,
) {
    let kq = super::int8::groups(k);
    assert!(kq.is_multiple_of(TILE_ROWS) && dst.len() >= m * n);
    let (q, col_scales, corrections) = panels.parts();
    let target = super::tile::SharedOut(dst.as_mut_ptr());
    drive::<true>(
        (m, n, kq / TILE_ROWS),
        (a.as_ptr(), kq * 4, a.len()),
        (q.as_ptr().cast(), kq * 64, q.len()),
        None,
        &|(row, col), sums: &[u32]| {
            let mut line = [0f32; 16];
            let line = &mut line[..sums.len()];
            let scale = row_scales[row];
            for (c, (out, &s)) in line.iter_mut().zip(sums).enumerate() {
                let j = col + c;
                *out = (s as i32 - corrections[j]) as f32 * (scale * col_scales[j]);
            }
            if let Some(finish) = finish {
                finish(col, line);
            }
            // SAFETY: the item (row, col..) is this thread's alone, inside (m, n).
            unsafe { target.write(row * n + col, line) };
        },
    );
}

/// Where a run of at most 16 sums of a row goes: `((row, first column), sums)` (f32 or
/// i32 bit patterns), the columns those inside the result.
type Sink<'a> = dyn Fn((usize, usize), &[u32]) + Sync + 'a;

/// K-steps per pass over an item's blocks: 512 BF16 values of k, so that a pair of panels'
/// part (32 KiB) stays in L1 while every row tile of the item passes by it.
const STEPS_A_PASS: usize = 16;

/// The result itself as the sums of whole tiles: f32 values, rows `stride` bytes apart
/// from `c`, the product added to what is there when `accumulate`.
#[derive(Clone, Copy)]
struct Direct {
    c: super::tile::SharedOut,
    stride: usize,
    accumulate: bool,
}

/// Runs an (m, n) product of `steps` k-steps on the threads: `a` (pointer, row stride in
/// bytes, length in bytes) holds ⌈m/16⌉ whole row tiles, `b` (pointer, bytes from one
/// panel to the next, length in bytes) ⌈n/16⌉ panels' first `steps` k-steps, both
/// starting a cache line (tile rows that straddle two lines halve the rate). Whole tiles of the result sum in `direct` where given; every
/// other result goes to `sink` 16 columns at a time.
///
/// An item — a chunk of row tiles times a group of panels — runs [`STEPS_A_PASS`] k-steps
/// a pass: panel pair by panel pair, each pair's part of the pass in L1 while every
/// row-tile pair of the chunk (in L2) is multiplied by it. Sums that do not go to `direct`
/// wait between passes in a buffer of the item's own.
fn drive<const INT8: bool>(
    (m, n, steps): (usize, usize, usize),
    (a, a_stride, a_len): (*const u8, usize, usize),
    (b, b_panel, b_len): (*const u8, usize, usize),
    direct: Option<Direct>,
    sink: &Sink,
) {
    if m == 0 || n == 0 {
        return;
    }
    let (tiles, panels) = (m.div_ceil(TILE_ROWS), n.div_ceil(16));
    assert!(a_stride >= steps * ROW_BYTES && a_len >= tiles * TILE_ROWS * a_stride);
    assert!(b_panel >= steps * STEP_BYTES && b_len >= (panels - 1) * b_panel + steps * STEP_BYTES);
    let chunks = tiles.div_ceil(CHUNK_TILES);
    let wanted = (2 * rayon::current_num_threads()).div_ceil(chunks);
    let per_group = PANEL_GROUP.min(panels.div_ceil(wanted)).max(2);
    let groups = panels.div_ceil(per_group);
    // Tiles and panels below these are whole: inside the result in every row and column.
    let (whole_tiles, whole_panels) = (m / TILE_ROWS, n / 16);
    let (a, b) = (Shared(a), Shared(b));
    (0..chunks * groups).into_par_iter().for_each(|item| {
        let (chunk, group) = (item / groups, item % groups);
        let tile_range = chunk * CHUNK_TILES..tiles.min((chunk + 1) * CHUNK_TILES);
        let panel_range = group * per_group..panels.min((group + 1) * per_group);
        // Whether tile t, panel p of the result sums in `direct`.
        let in_place = |t: usize, p: usize| direct.is_some() && t < whole_tiles && p < whole_panels;
        // The item's other sums: (rows, 16 · panels) four-byte values, 64 bytes a panel.
        let c_stride = panel_range.len() * ROW_BYTES;
        let mut sums = ITEM_SUMS.take();
        sums.fit(tile_range.len() * TILE_ROWS * c_stride / 4); // every value written first
        {
            let _tiles = Configured::new();
            for first in (0..steps).step_by(STEPS_A_PASS) {
                let pass = first..steps.min(first + STEPS_A_PASS);
                for (p, two_panels) in pairs(panel_range.clone(), whole_panels) {
                    for (t, two_rows) in pairs(tile_range.clone(), whole_tiles) {
                        let (c, c_stride, load_c) = match direct {
                            Some(d) if in_place(t, p) => {
                                let at = t * TILE_ROWS * d.stride + p * ROW_BYTES;
                                (
                                    d.c.0.cast::<u8>().wrapping_add(at),
                                    d.stride,
                                    first > 0 || d.accumulate,
                                )
                            }
                            _ => {
                                let at = (t - tile_range.start) * TILE_ROWS * c_stride
                                    + (p - panel_range.start) * ROW_BYTES;
                                (
                                    sums.as_mut_ptr().cast::<u8>().wrapping_add(at),
                                    c_stride,
                                    first > 0,
                                )
                            }
                        };
                        let operands = Block {
                            a: a.at(t * TILE_ROWS * a_stride + first * ROW_BYTES),
                            a_stride,
                            b: b.at(p * b_panel + first * STEP_BYTES),
                            b_panel,
                            steps: pass.len(),
                            c,
                            c_stride,
                            load_c,
                        };
                        // SAFETY: tiles are configured on this thread (`_tiles`); row tiles
                        // t, t + 1 and panels p, p + 1 lie inside `a` and `b` (asserted
                        // above: whole tiles and panels of `steps` k-steps, `pass` among
                        // them); the sums lie in `sums` (every tile of the item) or, for a
                        // block of whole tiles (`pairs` pairs no whole tile with another),
                        // in this item's rows and columns of `direct`'s result.
                        unsafe {
                            match (two_rows, two_panels) {
                                (true, true) => block::<2, 2, INT8>(&operands),
                                (true, false) => block::<2, 1, INT8>(&operands),
                                (false, true) => block::<1, 2, INT8>(&operands),
                                (false, false) => block::<1, 1, INT8>(&operands),
                            }
                        }
                    }
                }
            }
        }
        for t in tile_range.clone() {
            for p in panel_range.clone().filter(|&p| !in_place(t, p)) {
                let col = p * 16;
                for r in 0..TILE_ROWS.min(m - t * TILE_ROWS) {
                    let at = ((t - tile_range.start) * TILE_ROWS + r) * c_stride / 4
                        + (p - panel_range.start) * 16;
                    sink((t * TILE_ROWS + r, col), &sums[at..at + 16.min(n - col)]);
                }
            }
        }
        ITEM_SUMS.set(sums);
    });
}

/// The blocks of `range` (tiles or panels): `(first, two)`, pairs of whole ones (below
/// `whole`) and then each other alone, so that no block mixes a whole tile with a part one.
fn pairs(range: std::ops::Range<usize>, whole: usize) -> impl Iterator<Item = (usize, bool)> {
    let split = range.end.min(whole).max(range.start);
    let whole_pairs = (range.start..split)
        .step_by(2)
        .map(move |i| (i, i + 1 < split));
    whole_pairs.chain((split..range.end).map(|i| (i, false)))
}

thread_local! {
    /// An item's sums, kept for the thread's next item (its pages mapped already).
    static ITEM_SUMS: std::cell::Cell<Lines<u32>> = std::cell::Cell::new(Lines::default());
}

/// A pointer the threads share, read only.
#[derive(Clone, Copy)]
struct Shared(*const u8);
// SAFETY: the threads only read through it, while the operand it points into is borrowed.
unsafe impl Send for Shared {}
// SAFETY: as for Send.
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer `offset` bytes on (a method, so that closures capture the whole `Shared`).
    fn at(self, offset: usize) -> *const u8 {
        self.0.wrapping_add(offset)
    }
}

/// The tile configuration of this thread while it lives: all eight tiles 16 rows of 64
/// bytes (palette 1); released when dropped.
struct Configured(());

impl Configured {
    fn new() -> Self {
        #[repr(C, align(64))]
        struct Config([u8; 64]);
        const CONFIG: Config = {
            let mut c = [0u8; 64];
            c[0] = 1; // palette 1
            let mut t = 0;
            while t < 8 {
                c[16 + 2 * t] = ROW_BYTES as u8; // bytes a row (u16, little-endian)
                c[48 + t] = TILE_ROWS as u8; // rows
                t += 1;
            }
            Config(c)
        };
        // SAFETY: the caller of any tile product established AMX (state()); the config is
        // 64 readable bytes.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly))
        };
        Self(())
    }
}

impl Drop for Configured {
    fn drop(&mut self) {
        // SAFETY: tiles are configured on this thread (new).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem))
        };
    }
}

/// One block's operands: row tile i of A at `a + 16·i·a_stride` (k-step s 64·s bytes on),
/// panel j of B at `b + j·b_panel` (k-step s 1,024·s bytes on, rows 64 bytes apart), sum
/// tile (i, j) at `c + 16·i·c_stride + 64·j` (rows `c_stride` apart), loaded first when
/// `load_c` (a later pass), else zero.
struct Block {
    a: *const u8,
    a_stride: usize,
    b: *const u8,
    b_panel: usize,
    steps: usize,
    c: *mut u8,
    c_stride: usize,
    load_c: bool,
}

/// Block `o` of R × C sum tiles (R, C ≤ 2) over its k-steps: tiles 0–3 the sums, 4–5 A's
/// row tiles, 6–7 B's.
///
/// # Safety
/// AMX is usable and tiles are configured on this thread ([`Configured`]); every byte `o`
/// names is readable (A, B) and writable (C).
#[inline(always)]
unsafe fn block<const R: usize, const C: usize, const INT8: bool>(o: &Block) {
    let (a1, b1) = (
        o.a.wrapping_add(TILE_ROWS * o.a_stride),
        o.b.wrapping_add(o.b_panel),
    );
    let c1 = o.c.wrapping_add(TILE_ROWS * o.c_stride);
    // SAFETY: (the whole body) the caller's guarantees.
    unsafe {
        if o.load_c {
            load::<0>(o.c, o.c_stride);
            if C == 2 {
                load::<1>(o.c.add(64), o.c_stride);
            }
            if R == 2 {
                load::<2>(c1, o.c_stride);
                if C == 2 {
                    load::<3>(c1.add(64), o.c_stride);
                }
            }
        } else {
            zero::<0>();
            if C == 2 {
                zero::<1>();
            }
            if R == 2 {
                zero::<2>();
                if C == 2 {
                    zero::<3>();
                }
            }
        }
        for s in 0..o.steps {
            load::<4>(o.a.add(s * ROW_BYTES), o.a_stride);
            load::<6>(o.b.add(s * STEP_BYTES), ROW_BYTES);
            dot::<INT8, 0, 4, 6>();
            if C == 2 {
                load::<7>(b1.add(s * STEP_BYTES), ROW_BYTES);
                dot::<INT8, 1, 4, 7>();
            }
            if R == 2 {
                load::<5>(a1.add(s * ROW_BYTES), o.a_stride);
                dot::<INT8, 2, 5, 6>();
                if C == 2 {
                    dot::<INT8, 3, 5, 7>();
                }
            }
        }
        store::<0>(o.c, o.c_stride);
        if C == 2 {
            store::<1>(o.c.add(64), o.c_stride);
        }
        if R == 2 {
            store::<2>(c1, o.c_stride);
            if C == 2 {
                store::<3>(c1.add(64), o.c_stride);
            }
        }
    }
}

/// Tile T = 16 rows of 64 bytes from `p`, `stride` bytes apart.
#[inline(always)]
unsafe fn load<const T: u8>(p: *const u8, stride: usize) {
    // SAFETY: the caller's (block's) guarantees.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::asm!("tileloadd tmm{t}, [{p} + {s}]", t = const T, p = in(reg) p,
            s = in(reg) stride, options(nostack, readonly))
    }
}

/// Tile T's 16 rows of 64 bytes to `p`, `stride` bytes apart.
#[inline(always)]
unsafe fn store<const T: u8>(p: *mut u8, stride: usize) {
    // SAFETY: the caller's (block's) guarantees.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::asm!("tilestored [{p} + {s}], tmm{t}", t = const T, p = in(reg) p,
            s = in(reg) stride, options(nostack))
    }
}

/// Tile T = 0.
#[inline(always)]
unsafe fn zero<const T: u8>() {
    // SAFETY: the caller's (block's) guarantees.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::asm!("tilezero tmm{t}", t = const T, options(nostack, nomem))
    }
}

/// Tile C += tile A · tile B: `tdpbf16ps`, or `tdpbusd` (unsigned A × signed B) for INT8.
#[inline(always)]
unsafe fn dot<const INT8: bool, const C: u8, const A: u8, const B: u8>() {
    // SAFETY: the caller's (block's) guarantees.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        if INT8 {
            std::arch::asm!("tdpbusd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A,
                b = const B, options(nostack, nomem))
        } else {
            std::arch::asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A,
                b = const B, options(nostack, nomem))
        }
    }
}

/// The FLOP rate of `tdpbf16ps` over that of `vfmadd231ps` (512-bit), both on register
/// operands, best of three timings: what [`super::bf16_products_pay`] weighs where the
/// tiles are in use; 0 where they are not. A `tdpbf16ps` is 16 · 16 · 32 · 2 = 16,384 FLOP.
pub(super) fn tile_to_fma_rate() -> f64 {
    if !amx().bf16 {
        return 0.0;
    }
    const ITERS: usize = 2_000;
    let mut best = f64::MAX;
    let _tiles = Configured::new();
    for _ in 0..3 {
        let start = std::time::Instant::now();
        for _ in 0..ITERS {
            // SAFETY: AMX is usable and configured here; register operands only.
            unsafe {
                dot::<false, 0, 4, 6>();
                dot::<false, 1, 4, 7>();
                dot::<false, 2, 5, 6>();
                dot::<false, 3, 5, 7>();
            }
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    let tile_rate = (ITERS * 4 * 16_384) as f64 / best.max(1e-9);
    tile_rate / super::bf16::fma_rate()
}

#[cfg(test)]
mod tests {
    use super::super::{TestFeature, values};
    use super::*;

    #[test]
    fn tile_products_equal_the_reference_over_the_models_shapes() {
        if !TestFeature::Amx.test_runs("the AMX BF16 tile product") {
            return;
        }
        // gpt2-124m's products (E = 768, 3E, 4E; rows of a step and of a decode batch),
        // and edge tiles in every dimension.
        for (m, n, k) in [
            (110, 2304, 768),
            (7, 768, 3072),
            (768, 768, 110),
            (33, 17, 70),
        ] {
            let (a, b) = (values(m * k, 21), values(k * n, 22));
            let (rows, stride) = pack_bf16((&a, k, 1), m, k);
            let kps = k.div_ceil(2).next_multiple_of(TILE_ROWS);
            let mut panels = vec![0u16; n.div_ceil(16) * kps * 32];
            super::super::general::fill_pair_panels(&mut panels, (&b, n, 1), k, n, kps);
            for accumulate in [false, true] {
                let start = values(m * n, 23);
                let mut got = start.clone();
                bf16_product(
                    &mut got,
                    (m, n),
                    accumulate,
                    (&rows, stride),
                    (&panels, kps, 0..kps / TILE_ROWS),
                    None,
                );
                let round = |v: f32| f64::from(half::bf16::from_f32(v).to_f32());
                let worst = max_error(&got, m, n, |i, j| {
                    let base = if accumulate {
                        f64::from(start[i * n + j])
                    } else {
                        0.0
                    };
                    base + (0..k)
                        .map(|kk| round(a[i * k + kk]) * round(b[kk * n + j]))
                        .sum::<f64>()
                });
                assert!(
                    worst < 1e-4 * (k as f64).sqrt(),
                    "{m}×{n}×{k} {accumulate}: {worst}"
                );
            }
        }
    }

    #[test]
    fn rows_packed_into_a_used_buffer_are_the_rows_packed_into_a_fresh_one() {
        if !TestFeature::Amx.test_runs("packing rows for the AMX tiles") {
            return;
        }
        // A buffer left full of an earlier, larger operand's values: every value of the
        // smaller one's tiles is written again, zero past its K (odd) and its M.
        let (m, k) = (21, 37);
        let a = values(m * k, 31);
        for op in [(&a[..], k, 1), (&a[..], 1, m)] {
            let (fresh, stride) = pack_bf16(op, m, k);
            let mut used = pack_bf16((&values(64 * 96, 32), 96, 1), 64, 96).0;
            assert_eq!(pack_bf16_into(&mut used, op, m, k), stride);
            assert_eq!(&used[..], &fresh[..], "strides {:?}", (op.1, op.2));
        }
    }

    #[test]
    fn int8_tile_products_equal_the_vnni_sums_to_the_bit() {
        if !TestFeature::Amx.test_runs("the AMX INT8 tile product") {
            return;
        }
        for (m, n, k) in [(32, 2304, 768), (5, 768, 3072), (17, 40, 64)] {
            let (a, b) = (values(m * k, 24), values(k * n, 25));
            let (rows, scales) = super::super::int8::quantize_rows_flat(&a, m, k);
            let panels = super::super::int8::Int8Panels::new_filled(&b, k, n);
            let mut got = vec![0f32; m * n];
            int8_product(&mut got, (m, n, k), (&rows, &scales), &panels, None);
            assert_eq!(got, panels.reference_product(&a, (m, n, k)), "{m}×{n}×{k}");
        }
    }

    #[test]
    fn packed_matrices_on_tiles_add_their_bias_and_epilogue_to_every_output() {
        if !TestFeature::Amx.test_runs("the AMX products of packed matrices") {
            return;
        }
        use super::super::{Epilogue, PackedMatrix, PanelDtype};
        // Whole and part tiles in both dimensions (through the result and the item's
        // buffer), with and without a bias and an epilogue.
        let (m, n, k) = (37, 40, 256);
        let (x, w, bias) = (values(m * k, 26), values(k * n, 27), values(n, 28));
        let finished = |mut y: Vec<f32>, with: bool| {
            if with {
                for row in y.chunks_exact_mut(n) {
                    row.iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
                    crate::simd::gelu_new_inplace(row);
                }
            }
            y
        };
        for with in [false, true] {
            let pack = |dtype| {
                let p = PackedMatrix::pack_as(dtype, &w, k, n, false, with.then(|| bias.clone()));
                p.with_epilogue(if with {
                    Epilogue::GeluNew
                } else {
                    Epilogue::None
                })
            };
            let int8 = pack(PanelDtype::Int8).matmul(&x, m);
            let panels = super::super::int8::Int8Panels::new_filled(&w, k, n);
            let want = finished(panels.reference_product(&x, (m, n, k)), with);
            assert_eq!(int8, want, "INT8, bias and epilogue: {with}");
            let bf16 = pack(PanelDtype::Bf16).matmul(&x, m);
            let round = |v: f32| f64::from(half::bf16::from_f32(v).to_f32());
            let exact: Vec<f32> = (0..m * n)
                .map(|i| {
                    let (r, c) = (i / n, i % n);
                    (0..k)
                        .map(|kk| round(x[r * k + kk]) * round(w[kk * n + c]))
                        .sum::<f64>() as f32
                })
                .collect();
            let want = finished(exact, with);
            let worst = max_error(&bf16, m, n, |i, j| f64::from(want[i * n + j]));
            assert!(worst < 1e-3, "BF16, bias and epilogue {with}: {worst}");
        }
    }

    #[test]
    fn the_tiles_are_on_exactly_where_the_cpu_and_the_kernel_allow_them() {
        let line = status();
        assert_eq!(
            line.starts_with("off: "),
            !amx().bf16 && !amx().int8,
            "{line}"
        );
        if amx().bf16 {
            let rate = tile_to_fma_rate();
            assert!(rate.is_finite() && rate > 0.0, "{rate}");
        } else {
            assert_eq!(tile_to_fma_rate(), 0.0);
        }
    }
}
