//! `y = x W + b` for CPU inference, with `W` packed once into column panels.
//!
//! Decode steps multiply a few dozen rows by every weight matrix: M is small, so a
//! general GEMM spends much of its time re-packing the weights on every call. Here each
//! weight is packed once, at load, into panels of [`NR`] columns stored k-major
//! (`panel[k][0..NR]`), so a step streams each weight exactly once, sequentially. An
//! AVX2/FMA micro-kernel keeps an `MR × NR` tile of the output in registers; threads
//! (rayon) split the panels. Machines without AVX2 and FMA keep candle's matmul.
//!
//! The panels hold f32, or BF16 ([`PanelDtype`]): half the memory and half the bytes a
//! step streams. A BF16 weight is widened to f32 in registers (exactly: a BF16 value is
//! the top half of an f32) and multiplied with f32 inputs into f32 sums, so for weights
//! that are BF16 values already (a learner's BF16 push) the product is the f32 panels'
//! to the last bit; f32 weights are rounded to the nearest BF16 once, when packed.
//!
//! Where the CPU has AVX-512 ([`avx512`]), BF16 and INT8 panels take its dot products: BF16
//! panels are laid out in pairs of k for `vdpbf16ps` (inputs rounded to BF16 at each
//! product, f32 sums: PyTorch's BF16 autocast on such a CPU; unlike AVX2's, not the f32
//! panels' product to the bit), INT8 panels keep their layout and sum each group of four k
//! in one `vpdpbusd` (VNNI) instead of three AVX2 instructions, to the same i32 sums.
//!
//! Where the CPU has AMX and the kernel grants this process its tiles ([`amx`]: Intel
//! Xeons since Sapphire Rapids), BF16 pair panels whose K fills whole tile steps (32) and
//! INT8 panels whose K fills whole steps (64) are multiplied by `tdpbf16ps` / `tdpbusd`
//! instead, the panels read as laid out: the same BF16 operands and f32 sums, the same
//! INT8 bytes and i32 sums (to the bit); so is [`gemm_bf16`], the learner's.
//!
//! Letters: M rows of `x`, K inputs, N outputs.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use crate::cpu_features::supported_cached;
pub use crate::cpu_features::{Avx512, avx512, supported};
use crate::simd;
pub use amx::{Amx, amx, status as amx_status};

mod amx;
mod bf16;
mod general;
mod int8;
mod lines;
mod pack;
mod round;
mod tile;
use bf16::kernel_bf16_pairs;
pub use general::{PackedRhs, gemm_bf16, gemm_bf16_packed};
use int8::Int8Panels;
use pack::{fill_panels, fill_panels_bf16};
pub use tile::{BF16_COLUMNS, NR, Strided};
use tile::{MR, SharedOut};

/// What is applied to each output after the bias, while it is still in cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    None,
    /// GPT-2's `gelu_new` ([`simd::gelu_new_inplace`]).
    GeluNew,
}

/// What a [`PackedMatrix`]'s panels hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PanelDtype {
    #[default]
    F32,
    /// BF16 bit patterns, each panel row in [`BF16_COLUMNS`] order.
    Bf16,
    /// Each column quantized to i8 with its own scale; the inputs quantized per row at
    /// each product (see `int8.rs`).
    Int8,
}

/// Whether BF16 products pay on this CPU: it has AVX512-BF16 ([`avx512`]) and its
/// `vdpbf16ps` runs at least 1.3× the FLOP rate of its f32 FMAs, measured once in
/// registers (under a millisecond): rounding and packing the operands cost the rest. AMD
/// Zen 4 and 5 sum two products per lane at the FMA's rate (about 2×: BF16 products
/// there run the learner's step 1.3× faster than f32 ones); a 2-core Intel Xeon (Emerald
/// Rapids, AMX not exposed) measured 0.48–0.50×, and its learner step took 16.8 s in
/// BF16 against 10.3 s in f32.
///
/// Where AMX tiles multiply ([`amx`]), the rate weighed is `tdpbf16ps`'s instead (on a
/// 2-core Xeon that exposes AMX: 14.2–14.7× the FMA's, where its `vdpbf16ps` is 0.49×).
pub fn bf16_products_pay() -> bool {
    static PAYS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PAYS.get_or_init(|| {
        let (ratio, what) = if amx().bf16 {
            (amx::tile_to_fma_rate(), "tdpbf16ps")
        } else {
            (bf16::dot_to_fma_rate(), "vdpbf16ps")
        };
        tracing::debug!(ratio, "{what} FLOP rate over vfmadd231ps's");
        ratio >= 1.3
    })
}

/// The CPU kernels the products take here, one line for bench reports and run records:
/// the AMX tiles in use (`amx-bf16 amx-int8`), then AVX-512's dot products, then `avx2`
/// (or `scalar` without AVX2 and FMA); without tiles, why (`AMX off: …`).
pub fn kernels_line() -> String {
    if !supported() {
        return "scalar".into();
    }
    let (tiles, dots) = (amx(), avx512());
    let names = [
        (tiles.bf16, "amx-bf16"),
        (tiles.int8, "amx-int8"),
        (dots.bf16, "avx512-bf16"),
        (dots.vnni, "avx512-vnni"),
        (true, "avx2"),
    ];
    let line: Vec<&str> = names
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| *n)
        .collect();
    let line = line.join(" ");
    if tiles.bf16 || tiles.int8 {
        line
    } else {
        format!("{line} (AMX {})", amx_status())
    }
}

/// The panels' values.
#[derive(Debug, Clone)]
enum Panels {
    F32(Vec<f32>),  // (⌈N/NR⌉, K, NR)
    Bf16(Vec<u16>), // (⌈N/NR⌉, K, NR), rows in BF16_COLUMNS order
    /// BF16 for `vdpbf16ps`: (⌈N/NR⌉, ⌈K/2⌉, NR, 2), each column's two k adjacent (the
    /// even k first), zero past K.
    Bf16Pairs(lines::Lines<u16>),
    Int8(Int8Panels),
}

impl Panels {
    /// Empty panels of `dtype` for a (K, N) weight, laid out for the kernels `isa` allows.
    fn new(dtype: PanelDtype, isa: Avx512, k: usize, n: usize) -> Self {
        let len = n.div_ceil(NR) * k * NR;
        match dtype {
            PanelDtype::F32 => Self::F32(vec![0f32; len]),
            PanelDtype::Bf16 if isa.bf16 => {
                Self::Bf16Pairs(lines::Lines::zeroed(general::pair_panels_len(k, n)))
            }
            PanelDtype::Bf16 => Self::Bf16(vec![0u16; len]),
            PanelDtype::Int8 => Self::Int8(Int8Panels::new(k, n)),
        }
    }

    fn dtype(&self) -> PanelDtype {
        match self {
            Self::F32(_) => PanelDtype::F32,
            Self::Bf16(_) | Self::Bf16Pairs(_) => PanelDtype::Bf16,
            Self::Int8(_) => PanelDtype::Int8,
        }
    }

    fn fill(&mut self, w: &[f32], k: usize, n: usize, transposed: bool) {
        match self {
            Self::F32(panels) => fill_panels(panels, w, k, n, transposed),
            Self::Bf16(panels) => fill_panels_bf16(panels, w, k, n, transposed),
            Self::Bf16Pairs(panels) => {
                let b = if transposed { (w, 1, k) } else { (w, n, 1) };
                general::fill_pair_panels(panels, b, k, n, k.div_ceil(2))
            }
            Self::Int8(panels) => panels.fill(w, k, n, transposed),
        }
    }

    /// Panels `first..` of a transposed (N, K) weight from `rows`, its rows `first · NR..`
    /// ((rows, K) row-major; a multiple of NR rows unless they end the matrix): what
    /// [`Self::fill`] writes there, since each panel is NR whole rows.
    fn fill_transposed_rows(&mut self, rows: &[f32], k: usize, first: usize) {
        let n = rows.len() / k;
        let (at, end) = (first, first + n.div_ceil(NR));
        match self {
            Self::F32(panels) => {
                fill_panels(&mut panels[at * k * NR..end * k * NR], rows, k, n, true)
            }
            Self::Bf16(panels) => {
                fill_panels_bf16(&mut panels[at * k * NR..end * k * NR], rows, k, n, true)
            }
            Self::Bf16Pairs(panels) => {
                let len = general::pair_panels_len(k, NR); // one panel
                let panels = &mut panels[at * len..end * len];
                general::fill_pair_panels(panels, (rows, 1, k), k, n, k.div_ceil(2))
            }
            Self::Int8(panels) => panels.fill_transposed_rows(rows, k, first),
        }
    }

    /// [`Self::fill`] from BF16 values (little-endian bit patterns) into BF16 panels,
    /// placed as they are ([`pack::place_bf16`]). Returns false, writing nothing, when
    /// the panels hold f32 or INT8 values.
    fn fill_bf16(&mut self, w: &[u8], k: usize, n: usize, transposed: bool) -> bool {
        match self {
            Self::Bf16(panels) => pack::place_bf16(panels, w, (k, n), transposed),
            Self::Bf16Pairs(panels) => pack::place_bf16_pairs(panels, w, (k, n), transposed),
            Self::F32(_) | Self::Int8(_) => return false,
        }
        true
    }
}

/// A weight matrix (K, N) packed into ⌈N / NR⌉ panels of (K, NR), zero-padded.
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    k: usize,
    n: usize,
    panels: Panels,
    bias: Option<Vec<f32>>, // (N)
    epilogue: Epilogue,
}

/// A CPU feature a kernel's test needs, with the environment variable that makes its
/// absence a failure: CI sets the variable for each feature its CPU has (`.ci/run` reads
/// them from `/proc/cpuinfo`), so a test cannot pass there without running its kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestFeature {
    /// AVX2 and FMA: every packed kernel.
    Avx2,
    /// AVX512-BF16 (`vdpbf16ps`): the BF16 pair kernels.
    Avx512Bf16,
    /// AVX512-VNNI (`vpdpbusd`): the INT8 kernel's VNNI form.
    Avx512Vnni,
    /// AMX tiles, granted by the kernel and checked ([`amx`]): the tile products.
    Amx,
}

impl TestFeature {
    /// Whether the packed kernels use this feature here.
    pub fn present(self) -> bool {
        match self {
            Self::Avx2 => supported(),
            Self::Avx512Bf16 => avx512().bf16,
            Self::Avx512Vnni => avx512().vnni,
            Self::Amx => amx().bf16 && amx().int8,
        }
    }

    /// The variable under which a skip fails.
    pub fn require_var(self) -> &'static str {
        match self {
            Self::Avx2 => "ROOKWORLD_REQUIRE_AVX2",
            Self::Avx512Bf16 => "ROOKWORLD_REQUIRE_AVX512_BF16",
            Self::Avx512Vnni => "ROOKWORLD_REQUIRE_AVX512_VNNI",
            Self::Amx => "ROOKWORLD_REQUIRE_AMX",
        }
    }

    /// Whether a test of `what` can run here. Where it cannot, it says `SKIPPED:` with the
    /// reason on stderr (the test then returns without asserting anything of `what`) —
    /// unless [`require_var`](Self::require_var) is set, where it panics instead.
    pub fn test_runs(self, what: &str) -> bool {
        if self.present() {
            return true;
        }
        let var = self.require_var();
        let why = match self {
            Self::Amx => format!("AMX tiles are {}", amx_status()),
            _ => format!("this CPU lacks {self:?} (or ROOKWORLD_CPU_KERNELS=avx2 turned it off)"),
        };
        assert!(
            std::env::var_os(var).is_none(),
            "{what}: {var} is set and {why}"
        );
        eprintln!("SKIPPED: {what}: {why}");
        false
    }
}

impl PackedMatrix {
    /// Packs `w` into f32 panels: (K, N) row-major, or (N, K) row-major when `transposed`
    /// (a `Linear` weight or the tied embedding used as the LM head).
    pub fn pack(w: &[f32], k: usize, n: usize, transposed: bool, bias: Option<Vec<f32>>) -> Self {
        Self::pack_as(PanelDtype::F32, w, k, n, transposed, bias)
    }

    /// [`pack`](Self::pack) into panels of `dtype`.
    pub fn pack_as(
        dtype: PanelDtype,
        w: &[f32],
        k: usize,
        n: usize,
        transposed: bool,
        bias: Option<Vec<f32>>,
    ) -> Self {
        Self::pack_for(avx512(), dtype, w, k, n, transposed, bias)
    }

    /// [`pack_as`](Self::pack_as) for the kernels `isa` allows.
    fn pack_for(
        isa: Avx512,
        dtype: PanelDtype,
        w: &[f32],
        k: usize,
        n: usize,
        transposed: bool,
        bias: Option<Vec<f32>>,
    ) -> Self {
        assert_eq!(w.len(), k * n, "weight of {k}×{n}");
        let mut panels = Panels::new(dtype, isa, k, n);
        panels.fill(w, k, n, transposed);
        Self {
            k,
            n,
            panels,
            bias,
            epilogue: Epilogue::None,
        }
    }

    /// Packs new values `w` of the same shape into this matrix's own panels (memory
    /// already faulted in: no allocation; their dtype kept), and `bias` into its bias.
    /// Returns false, changing nothing, when the shape or the presence of a bias differs.
    pub fn repack(&mut self, w: &[f32], transposed: bool, bias: Option<&[f32]>) -> bool {
        if w.len() != self.k * self.n || !self.same_bias(bias) {
            return false;
        }
        self.panels.fill(w, self.k, self.n, transposed);
        self.set_bias(bias);
        true
    }

    /// [`repack`](Self::repack) from BF16 values — little-endian bit patterns, as a
    /// payload stores them — into BF16 panels, with no f32 copy: the panels end as a
    /// repack of the values' f32 widening leaves them. Returns false, changing nothing,
    /// when the panels are not BF16 or the shape or the presence of a bias differs.
    pub fn repack_bf16(&mut self, w: &[u8], transposed: bool, bias: Option<&[f32]>) -> bool {
        if w.len() != 2 * self.k * self.n
            || !self.same_bias(bias)
            || !self.panels.fill_bf16(w, self.k, self.n, transposed)
        {
            return false;
        }
        self.set_bias(bias);
        true
    }

    /// Whether `bias` can replace this matrix's bias (same presence, same length).
    fn same_bias(&self, bias: Option<&[f32]>) -> bool {
        match (&self.bias, bias) {
            (Some(old), Some(new)) => old.len() == new.len(),
            (None, None) => true,
            _ => false,
        }
    }

    /// Copies `bias` into this matrix's bias ([`Self::same_bias`] checked).
    fn set_bias(&mut self, bias: Option<&[f32]>) {
        if let (Some(old), Some(new)) = (self.bias.as_mut(), bias) {
            old.copy_from_slice(new);
        }
    }

    /// [`repack`](Self::repack) of a transposed (N, K) weight — the tied LM head — a block
    /// of `block_rows` rows (rounded up to a multiple of [`NR`]) at a time: `rows(range,
    /// buf)` writes the weight's rows `range` into `buf`, row-major. The panels end as a
    /// repack of the whole matrix leaves them, through a buffer of one block instead of a
    /// copy of the matrix. Bias and epilogue are kept.
    pub fn repack_transposed_by_rows<E>(
        &mut self,
        block_rows: usize,
        buf: &mut Vec<f32>,
        mut rows: impl FnMut(std::ops::Range<usize>, &mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let (k, n) = (self.k, self.n);
        let block = block_rows.max(1).next_multiple_of(NR);
        for start in (0..n).step_by(block) {
            let end = (start + block).min(n);
            buf.resize((end - start) * k, 0.0);
            rows(start..end, buf)?;
            self.panels.fill_transposed_rows(buf, k, start / NR);
        }
        Ok(())
    }

    /// Applies `epilogue` to every output from now on.
    pub fn with_epilogue(mut self, epilogue: Epilogue) -> Self {
        self.epilogue = epilogue;
        self
    }

    /// Applies `epilogue` to every output from now on.
    pub fn set_epilogue(&mut self, epilogue: Epilogue) {
        self.epilogue = epilogue;
    }

    pub fn epilogue(&self) -> Epilogue {
        self.epilogue
    }

    pub fn n(&self) -> usize {
        self.n
    }

    /// Inputs (rows of the weight).
    pub fn k(&self) -> usize {
        self.k
    }

    /// What the panels hold.
    pub fn dtype(&self) -> PanelDtype {
        self.panels.dtype()
    }

    /// Whether products round their inputs to BF16 (BF16 panels on a CPU with
    /// AVX512-BF16): then BF16 panels are not the f32 panels' product to the bit.
    pub fn rounds_inputs_to_bf16(&self) -> bool {
        matches!(self.panels, Panels::Bf16Pairs(_))
    }

    /// `x` (M, K) row-major → (M, N) row-major, bias (and epilogue) applied.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        let (k, n) = (self.k, self.n);
        assert_eq!(x.len(), m * k, "input of {m}×{k}");
        let mut out = vec![0f32; m * n];
        let target = SharedOut(out.as_mut_ptr());
        match &self.panels {
            Panels::F32(panels) => self.float_product(x, m, panels, target, kernel),
            Panels::Bf16(panels) => self.float_product(x, m, panels, target, kernel_bf16),
            Panels::Bf16Pairs(panels) if amx().bf16 && k.is_multiple_of(32) => {
                // Whole AMX k-steps in every panel: multiplied in place.
                let (a, stride) = amx::pack_bf16((x, k, 1), m, k);
                let b = (&panels[..], k / 2, 0..k / 32);
                let finish = |col: usize, row: &mut [f32]| self.finish_row(col, row);
                let finish = self.finishes().then_some(&finish as amx::Finish);
                amx::bf16_product(&mut out, (m, n), false, (&a, stride), b, finish);
            }
            Panels::Int8(panels) if amx().int8 && k.is_multiple_of(64) => {
                let a = int8::quantize_rows_flat(x, m, k);
                let (a, scales) = (&a.0[..], &a.1[..]);
                let finish = |col: usize, row: &mut [f32]| self.finish_row(col, row);
                let finish = self.finishes().then_some(&finish as amx::Finish);
                amx::int8_product(&mut out, (m, n, k), (a, scales), panels, finish);
            }
            Panels::Bf16Pairs(panels) => {
                let kp = k.div_ceil(2);
                let a = general::pack_rows((x, k, 1), m, k);
                panels
                    .par_chunks(kp * 2 * NR)
                    .enumerate()
                    .for_each(|(p, panel)| {
                        self.panel_product(m, p, target, |blk, tile| {
                            kernel_bf16_pairs(
                                &a[blk * kp * MR..(blk + 1) * kp * MR],
                                panel,
                                tile,
                                kp,
                            )
                        })
                    })
            }
            Panels::Int8(panels) => {
                let (a, row_scales) = int8::quantize_rows(x, m, k);
                let kq = int8::groups(k);
                let block = kq * MR * 4;
                panels
                    .panels(k)
                    .enumerate()
                    .for_each(|(p, (q, col_scales, corrections))| {
                        self.panel_product(m, p, target, |blk, tile| {
                            let mut sums = [0i32; MR * NR];
                            int8::kernel(&a[blk * block..(blk + 1) * block], q, &mut sums, kq);
                            let rows = &row_scales[blk * MR..(blk + 1) * MR];
                            int8::dequantize(tile, &sums, rows, (col_scales, corrections));
                        })
                    })
            }
        }
        out
    }

    /// The product over panels of f32 or BF16 weights: `x` packed by row block in f32,
    /// each block times each panel by `kernel`.
    fn float_product<T: Sync>(
        &self,
        x: &[f32],
        m: usize,
        panels: &[T],
        target: SharedOut,
        kernel: fn(&[f32], &[T], &mut [f32; MR * NR], usize),
    ) {
        let k = self.k;
        let a = pack_rows(x, m, k);
        let block = k * MR; // values of `a` per row block
        panels
            .par_chunks(k * NR)
            .enumerate()
            .for_each(|(p, panel)| {
                self.panel_product(m, p, target, |blk, tile| {
                    kernel(&a[blk * block..(blk + 1) * block], panel, tile, k)
                })
            })
    }

    /// Whether outputs take a bias or an epilogue ([`Self::finish_row`] does something).
    fn finishes(&self) -> bool {
        self.bias.is_some() || self.epilogue != Epilogue::None
    }

    /// Bias and epilogue on the outputs of one row, columns `col..col + row.len()`.
    fn finish_row(&self, col: usize, row: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for (v, b) in row.iter_mut().zip(&bias[col..]) {
                *v += b;
            }
        }
        if self.epilogue == Epilogue::GeluNew {
            simd::gelu_new_inplace(row);
        }
    }

    /// Columns p·NR.. of `out` (M, N) for panel p: each row block's tile from `product`
    /// (row block → the tile), bias and epilogue applied, written into `out`.
    fn panel_product(
        &self,
        m: usize,
        p: usize,
        target: SharedOut,
        product: impl Fn(usize, &mut [f32; MR * NR]),
    ) {
        let n = self.n;
        let (bias, epilogue) = (self.bias.as_deref(), self.epilogue);
        let cols = NR.min(n - p * NR);
        let mut tile = [0f32; MR * NR];
        for blk in 0..m.div_ceil(MR) {
            product(blk, &mut tile);
            if let Some(bias) = bias {
                for row in tile.chunks_exact_mut(NR) {
                    for (v, b) in row[..cols].iter_mut().zip(&bias[p * NR..]) {
                        *v += b;
                    }
                }
            }
            if epilogue == Epilogue::GeluNew {
                simd::gelu_new_inplace(&mut tile);
            }
            let rows = MR.min(m - blk * MR);
            for (r, src) in tile.chunks_exact(NR).take(rows).enumerate() {
                let offset = (blk * MR + r) * n + p * NR;
                // SAFETY: panel p owns columns p·NR..p·NR+cols of every row, so no two
                // threads write the same element, and offset + cols ≤ m·n.
                unsafe { target.write(offset, &src[..cols]) };
            }
        }
    }
}

/// `x` (M, K) packed by row block, k-major: `a[block][k][r]`, zero rows past M.
fn pack_rows(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let mut a = vec![0f32; m.div_ceil(MR) * k * MR];
    for (row, xs) in x.chunks_exact(k).enumerate() {
        let (b, r) = (row / MR, row % MR);
        let dst = &mut a[b * k * MR..(b + 1) * k * MR];
        for (kk, &v) in xs.iter().enumerate() {
            dst[kk * MR + r] = v;
        }
    }
    a
}

/// `tile (MR, NR) = a (k, MR)ᵀ · b (k, NR)`.
fn kernel(a: &[f32], b: &[f32], tile: &mut [f32; MR * NR], k: usize) {
    assert!(a.len() == k * MR && b.len() == k * NR);
    #[cfg(target_arch = "x86_64")]
    if supported_cached() {
        // SAFETY: AVX2 and FMA are present (checked above); the slices hold exactly the
        // elements the kernel reads and writes (asserted above).
        unsafe { kernel_avx2(a.as_ptr(), b.as_ptr(), tile.as_mut_ptr(), k) };
        return;
    }
    for r in 0..MR {
        for j in 0..NR {
            let mut s = 0.0;
            for kk in 0..k {
                s += a[kk * MR + r] * b[kk * NR + j];
            }
            tile[r * NR + j] = s;
        }
    }
}

/// [`kernel`] over a BF16 panel `b` (rows in [`BF16_COLUMNS`] order): each weight widened
/// to f32, the same sums.
fn kernel_bf16(a: &[f32], b: &[u16], tile: &mut [f32; MR * NR], k: usize) {
    assert!(a.len() == k * MR && b.len() == k * NR);
    #[cfg(target_arch = "x86_64")]
    if supported_cached() {
        // SAFETY: AVX2 and FMA are present (checked above); the slices hold exactly the
        // elements the kernel reads and writes (asserted above).
        unsafe { kernel_bf16_avx2(a.as_ptr(), b.as_ptr(), tile.as_mut_ptr(), k) };
        return;
    }
    kernel_bf16_scalar(a, b, tile, k)
}

/// [`kernel_bf16`] value by value: the reference.
fn kernel_bf16_scalar(a: &[f32], b: &[u16], tile: &mut [f32; MR * NR], k: usize) {
    for r in 0..MR {
        for (pos, &col) in BF16_COLUMNS.iter().enumerate() {
            let mut s = 0.0;
            for kk in 0..k {
                s += a[kk * MR + r] * f32::from_bits(u32::from(b[kk * NR + pos]) << 16);
            }
            tile[r * NR + col] = s;
        }
    }
}

/// One 6×16 tile of a product: `tile[r·NR + j] = Σ_kk a[kk·MR + r] · b[kk·NR + j]`, over a
/// packed panel of the input (`a`) and one of the weight (`b`).
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` points to `k * MR` readable values, `b` to `k * NR`, and
/// `tile` to `MR * NR` writable ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2(a: *const f32, b: *const f32, tile: *mut f32, k: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's guarantees; row kk of the panel is b[kk·NR..(kk + 1)·NR].
    unsafe {
        fma_tile(a, tile, k, |kk| {
            [
                _mm256_loadu_ps(b.add(kk * NR)),
                _mm256_loadu_ps(b.add(kk * NR + 8)),
            ]
        })
    }
}

/// [`kernel_avx2`] over a BF16 panel: each row of 16 weights is one load, widened to
/// two registers of f32 by interleaving zeros below each value (see [`BF16_COLUMNS`]).
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` points to `k * MR` readable values, `b` to `k * NR`, and
/// `tile` to `MR * NR` writable ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_bf16_avx2(a: *const f32, b: *const u16, tile: *mut f32, k: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's guarantees; row kk of the panel is b[kk·NR..(kk + 1)·NR].
    unsafe {
        let zero = _mm256_setzero_si256();
        fma_tile(a, tile, k, |kk| {
            let raw = _mm256_loadu_si256(b.add(kk * NR).cast());
            [
                _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw)), // columns 0..8
                _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw)), // columns 8..16
            ]
        })
    }
}

/// The kernels' shared body: an `MR × NR` tile of sums in registers, `row(kk)` giving the
/// weight panel's row kk as f32 (columns 0..8, 8..16).
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` points to `k * MR` readable values, `tile` to `MR * NR`
/// writable ones, and `row` reads only its panel's rows 0..k.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn fma_tile(
    a: *const f32,
    tile: *mut f32,
    k: usize,
    row: impl Fn(usize) -> [std::arch::x86_64::__m256; 2],
) {
    use std::arch::x86_64::*;
    // SAFETY: (the whole body) the caller guarantees `a` holds k·MR and `tile` MR·NR
    // floats; every offset below stays inside those bounds.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        for kk in 0..k {
            let [b0, b1] = row(kk);
            let ak = a.add(kk * MR);
            for (r, sums) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*ak.add(r));
                sums[0] = _mm256_fmadd_ps(x, b0, sums[0]);
                sums[1] = _mm256_fmadd_ps(x, b1, sums[1]);
            }
        }
        for (r, sums) in acc.iter().enumerate() {
            _mm256_storeu_ps(tile.add(r * NR), sums[0]);
            _mm256_storeu_ps(tile.add(r * NR + 8), sums[1]);
        }
    }
}

/// Deterministic test inputs in [−1, 1): `len` values from `seed`.
#[cfg(test)]
fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, bias: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = bias[j] as f64;
                for kk in 0..k {
                    s += x[i * k + kk] as f64 * w[kk * n + j] as f64;
                }
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn packed_matmul_matches_a_naive_product_for_awkward_shapes() {
        for (m, k, n) in [(1, 7, 3), (5, 300, 33), (13, 513, 16), (32, 64, 50)] {
            let (x, w, bias) = (values(m * k, 1), values(k * n, 2), values(n, 3));
            let want = naive(&x, &w, m, k, n, &bias);
            let got = PackedMatrix::pack(&w, k, n, false, Some(bias.clone())).matmul(&x, m);
            let d = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-3, "{m}×{k}×{n}: max |Δ| = {d}");
            // The same weight given transposed (N, K).
            let wt = transpose(&w, k, n);
            let got_t = PackedMatrix::pack(&wt, k, n, true, Some(bias)).matmul(&x, m);
            assert_eq!(got, got_t);
        }
    }

    #[test]
    fn a_transposed_weight_repacked_by_blocks_of_rows_is_the_whole_repack() {
        let (m, k, n) = (5, 37, 100); // odd K, a padded last panel, a short last block
        let x = values(m * k, 9);
        let wt = values(n * k, 6); // (N, K)
        for dtype in [PanelDtype::F32, PanelDtype::Bf16, PanelDtype::Int8] {
            let whole = PackedMatrix::pack_as(dtype, &wt, k, n, true, None);
            let mut blocks = PackedMatrix::pack_as(dtype, &values(n * k, 4), k, n, true, None);
            let mut buf = Vec::new();
            let mut seen = Vec::new();
            blocks
                .repack_transposed_by_rows(40, &mut buf, |r, out| {
                    seen.push(r.clone());
                    out.copy_from_slice(&wt[r.start * k..r.end * k]);
                    Ok::<(), ()>(())
                })
                .unwrap();
            assert_eq!(
                seen,
                [0..48, 48..96, 96..100],
                "{dtype:?}: blocks of 48 rows"
            );
            assert_eq!(blocks.matmul(&x, m), whole.matmul(&x, m), "{dtype:?}");
        }
    }

    #[test]
    fn a_repacked_matrix_computes_what_a_fresh_pack_of_the_new_values_does() {
        let (m, k, n) = (7, 300, 33); // a padded last panel
        let x = values(m * k, 9);
        for transposed in [false, true] {
            let mut packed =
                PackedMatrix::pack(&values(k * n, 4), k, n, transposed, Some(values(n, 5)))
                    .with_epilogue(Epilogue::GeluNew);
            let (w, bias) = (values(k * n, 6), values(n, 7));
            assert!(packed.repack(&w, transposed, Some(&bias)));
            let fresh = PackedMatrix::pack(&w, k, n, transposed, Some(bias.clone()))
                .with_epilogue(Epilogue::GeluNew);
            assert_eq!(
                packed.matmul(&x, m),
                fresh.matmul(&x, m),
                "transposed: {transposed}"
            );
            // Another shape, or a bias where there was none, is refused and changes nothing.
            assert!(!packed.repack(&w[1..], transposed, Some(&bias)));
            assert!(!packed.repack(&w, transposed, None));
            assert_eq!(packed.matmul(&x, m), fresh.matmul(&x, m));
        }
    }

    /// `w` with every value rounded to the nearest BF16.
    fn bf16_values(w: &[f32]) -> Vec<f32> {
        w.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    }

    /// The widening layout (any AVX2 CPU) and the pairs layout (AVX512-BF16, else its
    /// scalar reference): what `isa` packs BF16 panels for.
    const BF16_KERNELS: [Avx512; 2] = [
        Avx512 {
            vnni: false,
            bf16: false,
        },
        Avx512 {
            vnni: false,
            bf16: true,
        },
    ];

    #[test]
    fn bf16_panels_compute_what_f32_panels_of_the_rounded_weights_do() {
        let widening = BF16_KERNELS[0];
        for (m, k, n) in [(1, 7, 3), (5, 300, 33), (13, 513, 16), (32, 64, 50)] {
            let (x, w, bias) = (values(m * k, 1), values(k * n, 2), values(n, 3));
            let rounded = bf16_values(&w);
            for transposed in [false, true] {
                let w_in = oriented(&w, k, n, transposed);
                let r_in = oriented(&rounded, k, n, transposed);
                let bf16 = PackedMatrix::pack_for(
                    widening,
                    PanelDtype::Bf16,
                    &w_in,
                    k,
                    n,
                    transposed,
                    Some(bias.clone()),
                )
                .with_epilogue(Epilogue::GeluNew);
                assert_eq!(bf16.dtype(), PanelDtype::Bf16);
                assert!(!bf16.rounds_inputs_to_bf16());
                let f32 = PackedMatrix::pack(&r_in, k, n, transposed, Some(bias.clone()))
                    .with_epilogue(Epilogue::GeluNew);
                // The same products to the bit: widening a BF16 value is exact.
                assert_eq!(bf16.matmul(&x, m), f32.matmul(&x, m), "{m}×{k}×{n}");
            }
            // Against a naive f64 product of the rounded weights.
            let got = PackedMatrix::pack_for(
                widening,
                PanelDtype::Bf16,
                &w,
                k,
                n,
                false,
                Some(bias.clone()),
            )
            .matmul(&x, m);
            let want = naive(&x, &rounded, m, k, n, &bias);
            let d = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-3, "{m}×{k}×{n}: max |Δ| = {d}");
        }
    }

    #[test]
    fn bf16_pair_panels_compute_the_product_of_rounded_inputs_and_weights() {
        let pairs = BF16_KERNELS[1];
        for (m, k, n) in [(1, 7, 3), (5, 300, 33), (13, 513, 16), (32, 64, 50)] {
            let (x, w, bias) = (values(m * k, 1), values(k * n, 2), values(n, 3));
            let want = naive(&bf16_values(&x), &bf16_values(&w), m, k, n, &bias);
            let mut first = None;
            for transposed in [false, true] {
                let w_in = oriented(&w, k, n, transposed);
                let bf16 = PackedMatrix::pack_for(
                    pairs,
                    PanelDtype::Bf16,
                    &w_in,
                    k,
                    n,
                    transposed,
                    Some(bias.clone()),
                );
                assert_eq!(bf16.dtype(), PanelDtype::Bf16);
                assert!(bf16.rounds_inputs_to_bf16());
                let got = bf16.matmul(&x, m);
                let d = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(d < 1e-3, "{m}×{k}×{n}: max |Δ| = {d}");
                // Either orientation packs the same panels.
                assert_eq!(first.get_or_insert_with(|| got.clone()), &got);
            }
        }
    }

    #[test]
    fn the_bf16_pairs_of_a_row_block_are_its_rounded_inputs_in_order() {
        let (m, k) = (7, 5); // an odd K and a part-filled second row block
        let x = values(m * k, 15);
        let a = general::pack_rows((&x, k, 1), m, k);
        let kp = k.div_ceil(2);
        assert_eq!(a.len(), 2 * kp * MR);
        for block in 0..2 {
            for pair in 0..kp {
                for r in 0..MR {
                    let (row, v) = (block * MR + r, a[(block * kp + pair) * MR + r]);
                    for (half, kk) in [(v & 0xffff, 2 * pair), (v >> 16, 2 * pair + 1)] {
                        let want = if row < m && kk < k {
                            half::bf16::from_f32(x[row * k + kk]).to_bits()
                        } else {
                            0 // past M or K: zero
                        };
                        assert_eq!(half as u16, want, "row {row}, k {kk}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_bf16_kernel_equals_its_scalar_reference() {
        if !TestFeature::Avx2.test_runs("the BF16 widening kernel") {
            return; // without AVX2 the kernel is its scalar reference
        }
        let k = 37;
        let a = values(k * MR, 11);
        let b: Vec<u16> = values(k * NR, 12)
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let (mut fast, mut reference) = ([0f32; MR * NR], [0f32; MR * NR]);
        kernel_bf16(&a, &b, &mut fast, k);
        kernel_bf16_scalar(&a, &b, &mut reference, k);
        for (f, r) in fast.iter().zip(&reference) {
            assert!((f - r).abs() <= 1e-5 * r.abs().max(1.0), "{f} vs {r}");
        }
    }

    #[test]
    fn a_bf16_matrix_repacks_into_its_own_panels() {
        for isa in BF16_KERNELS {
            for (m, k, n) in [(7, 300, 33), (3, 301, 17)] {
                let x = values(m * k, 9);
                let pack =
                    |w: &[f32]| PackedMatrix::pack_for(isa, PanelDtype::Bf16, w, k, n, true, None);
                let mut packed = pack(&values(k * n, 4));
                let w = values(k * n, 6);
                assert!(packed.repack(&w, true, None));
                assert_eq!(packed.dtype(), PanelDtype::Bf16);
                assert_eq!(packed.matmul(&x, m), pack(&w).matmul(&x, m), "{isa:?}");
            }
        }
    }

    #[test]
    fn the_bf16_probe_measures_a_rate_only_where_the_cpu_has_the_dot_product() {
        let ratio = bf16::dot_to_fma_rate();
        if avx512().bf16 {
            assert!(ratio.is_finite() && ratio > 0.0, "{ratio}");
        } else {
            assert_eq!(ratio, 0.0);
            assert!(!bf16_products_pay());
        }
    }

    #[test]
    fn bf16_values_repack_straight_into_the_panels_their_widening_packs_into() {
        for isa in BF16_KERNELS {
            // Whole panels through registers (pair panels: even K, and for a transposed
            // weight K/2 a multiple of 8; column panels: any K, a transposed weight's
            // last K % 16 values one by one); a last panel of fewer columns, and odd K
            // for pair panels, value by value.
            for (k, n, transposed) in [
                (300, 33, false),
                (32, 37, true),
                (300, 40, true),
                (301, 17, true),
                (7, 16, false),
                (9, 5, true),
                (20, 16, true),
                (768, 48, true),
                (64, 48, false),
            ] {
                let w = bf16_values(&values(k * n, 12));
                let bits: Vec<u8> = w
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect();
                let bias = values(n, 13);
                let pack = |w: &[f32]| {
                    PackedMatrix::pack_for(
                        isa,
                        PanelDtype::Bf16,
                        w,
                        k,
                        n,
                        transposed,
                        Some(values(n, 1)),
                    )
                };
                let mut direct = pack(&values(k * n, 4));
                assert!(direct.repack_bf16(&bits, transposed, Some(&bias)));
                let mut widened = pack(&values(k * n, 4));
                assert!(widened.repack(&w, transposed, Some(&bias)));
                let bits_of = |p: &Panels| -> Vec<u16> {
                    match p {
                        Panels::Bf16(v) => v.clone(),
                        Panels::Bf16Pairs(v) => v.to_vec(),
                        _ => panic!("BF16 panels"),
                    }
                };
                let (a, b) = (bits_of(&direct.panels), bits_of(&widened.panels));
                assert_eq!(a, b, "{isa:?} {k}×{n} transposed {transposed}");
                assert_eq!(direct.bias, widened.bias);
            }
        }
        let mut f32_panels = PackedMatrix::pack(&values(6, 1), 2, 3, false, None);
        let before = f32_panels.matmul(&[1.0, 1.0], 1);
        assert!(!f32_panels.repack_bf16(&[0; 12], false, None), "f32 panels");
        assert!(
            !PackedMatrix::pack_as(PanelDtype::Bf16, &values(6, 1), 2, 3, false, None)
                .repack_bf16(&[0; 10], false, None),
            "short payload"
        );
        assert_eq!(f32_panels.matmul(&[1.0, 1.0], 1), before, "nothing changed");
    }

    #[test]
    fn int8_panels_compute_the_product_to_the_quantization_error() {
        for (m, k, n) in [(1, 7, 3), (5, 300, 33), (13, 513, 16), (32, 64, 50)] {
            let (x, w, bias) = (values(m * k, 1), values(k * n, 2), values(n, 3));
            let want = naive(&x, &w, m, k, n, &bias);
            for transposed in [false, true] {
                let w_in = oriented(&w, k, n, transposed);
                let int8 = PackedMatrix::pack_as(
                    PanelDtype::Int8,
                    &w_in,
                    k,
                    n,
                    transposed,
                    Some(bias.clone()),
                );
                assert_eq!(int8.dtype(), PanelDtype::Int8);
                let got = int8.matmul(&x, m);
                // Inputs and weights within 1, inputs to half of 1/127 and weights to half
                // of 1/63: |Δ| ≤ Σ_k (|w| / 254 + |x| / 126).
                let bound = k as f32 * (1.0 / 254.0 + 1.0 / 126.0);
                let d = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(d < bound, "{m}×{k}×{n}: max |Δ| = {d} (bound {bound})");
                // A mean error far below the bound: rounding errors cancel.
                let mean = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .sum::<f32>()
                    / got.len() as f32;
                assert!(mean < bound / 8.0, "{m}×{k}×{n}: mean |Δ| = {mean}");
            }
        }
        // A zero row or zero column gives exactly the bias.
        let int8 = PackedMatrix::pack_as(
            PanelDtype::Int8,
            &[0.0; 8 * 5],
            8,
            5,
            false,
            Some(values(5, 3)),
        );
        assert_eq!(int8.matmul(&values(8, 1), 1), values(5, 3));
    }

    /// `w` (K, N) as `pack` takes it: itself, or its (N, K) transpose when `transposed`.
    fn oriented(w: &[f32], k: usize, n: usize, transposed: bool) -> Vec<f32> {
        if transposed {
            transpose(w, k, n)
        } else {
            w.to_vec()
        }
    }

    /// (K, N) row-major → (N, K) row-major.
    fn transpose(w: &[f32], k: usize, n: usize) -> Vec<f32> {
        let mut wt = vec![0f32; k * n];
        for kk in 0..k {
            for j in 0..n {
                wt[j * k + kk] = w[kk * n + j];
            }
        }
        wt
    }
}
