//! The decode attention kernels' launch decisions as pure functions, built without the
//! `cuda` feature: which kernel of `kernels/grouped_attention.cu` applies to a head width
//! and dtype, and each one's grid. The CUDA launches (`cuda::attention`,
//! `cuda::DecodeGraphs`) take them from here, the emulated kernel tests launch the same
//! grids on the CPU, and a CPU test runs them over every shape the presets and the checks
//! use.
//!
//! The constants mirror the `#define`s of `kernels/grouped_attention.cu`.

/// Which kernel of `kernels/grouped_attention.cu` runs a step's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// `grouped_attention`: a warp per row slot, the group's prefix staged in shared
    /// memory once per block, each row's suffix walked by its warp.
    Warp,
    /// `grouped_attention_split`: a block of [`SPLIT_WARPS`] warps per (row, head), the
    /// row's keys split across them and read in 16-byte loads (the trial family
    /// [`Kernel::SplitAttention`](crate::kernels::Kernel::SplitAttention)).
    Split,
}

/// Rows of a group one block of the warp kernel serves (one warp each):
/// `ROWS_PER_BLOCK`.
pub const ROWS_PER_BLOCK: usize = 16;
/// Largest head width the warp kernel holds (`MAX_D`); it must also be a multiple of 32.
pub const MAX_HEAD_DIM: usize = 128;
/// Warps of a block of the split kernel and of `row_attention` (`SPLIT_WARPS`).
pub const SPLIT_WARPS: u32 = 4;

/// A launch's shape: blocks of the grid, threads of a block, dynamic shared memory. Both
/// crates' CUDA launches are described by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

/// The device's limits a launch must keep: threads of a block, blocks along each axis of
/// the grid, dynamic shared memory of a block without opting in.
const MAX_BLOCK_THREADS: u64 = 1024;
const MAX_GRID: (u32, u32, u32) = (i32::MAX as u32, 65_535, 65_535);
const MAX_SHARED_BYTES: u32 = 48 << 10;

impl Grid {
    /// Blocks × threads: how many threads the launch runs.
    pub fn threads(&self) -> u64 {
        let (g, b) = (self.grid, self.block);
        [g.0, g.1, g.2, b.0, b.1, b.2]
            .iter()
            .map(|&v| v as u64)
            .product()
    }

    /// `Err` saying which of the device's limits the launch passes, or that it launches
    /// nothing.
    pub fn within_limits(&self) -> Result<(), String> {
        let (g, b) = (self.grid, self.block);
        let threads = b.0 as u64 * b.1 as u64 * b.2 as u64;
        if !(1..=MAX_BLOCK_THREADS).contains(&threads) {
            return Err(format!(
                "a block of {b:?} threads (1 to {MAX_BLOCK_THREADS})"
            ));
        }
        let axes = [(g.0, MAX_GRID.0), (g.1, MAX_GRID.1), (g.2, MAX_GRID.2)];
        if axes.iter().any(|&(v, max)| !(1..=max).contains(&v)) {
            return Err(format!("a grid of {g:?} blocks (at most {MAX_GRID:?})"));
        }
        if self.shared_bytes > MAX_SHARED_BYTES {
            return Err(format!(
                "{} bytes of shared memory a block (at most {MAX_SHARED_BYTES})",
                self.shared_bytes
            ));
        }
        Ok(())
    }
}

/// Whether a head of width `d` in elements of `elem_bytes` bytes has the 16-byte walk of
/// the split kernel and `row_attention`: a key's 16-byte pieces on a power-of-two number
/// of a warp's lanes (so at most 32 pieces: D ≤ 256 in BF16, 128 in f32).
pub fn vectorised_heads(elem_bytes: usize, d: usize) -> bool {
    if !matches!(elem_bytes, 2 | 4) {
        return false;
    }
    let vec = 16 / elem_bytes;
    d.is_multiple_of(vec) && (d / vec).is_power_of_two() && d / vec <= 32
}

/// Whether `kernel` serves heads of width `d` in elements of `elem_bytes` bytes (f32 or
/// BF16; other dtypes take the tensor path): the warp kernel a multiple of 32 up to
/// [`MAX_HEAD_DIM`], the split kernel [`vectorised_heads`].
pub fn attention_applies(kernel: AttentionKernel, elem_bytes: usize, d: usize) -> bool {
    match kernel {
        AttentionKernel::Warp => {
            matches!(elem_bytes, 2 | 4) && d.is_multiple_of(32) && (32..=MAX_HEAD_DIM).contains(&d)
        }
        AttentionKernel::Split => vectorised_heads(elem_bytes, d),
    }
}

/// The grid of `kernel` over `groups` groups of at most `group_rows` rows and `heads`
/// heads: the warp kernel a block per (group, head, slice of up to [`ROWS_PER_BLOCK`]
/// rows), a warp per row; the split kernel a block per (group, head, row slot), an empty
/// slot's block leaving at once.
pub fn attention_grid(
    kernel: AttentionKernel,
    groups: usize,
    heads: usize,
    group_rows: usize,
) -> Grid {
    let (n, h) = (groups.max(1) as u32, heads.max(1) as u32);
    match kernel {
        AttentionKernel::Warp => {
            let warps = group_rows.clamp(1, ROWS_PER_BLOCK);
            Grid {
                grid: (n, h, group_rows.div_ceil(warps).max(1) as u32),
                block: (32, warps as u32, 1),
                shared_bytes: 0,
            }
        }
        AttentionKernel::Split => Grid {
            grid: (n, h, group_rows.max(1) as u32),
            block: (32, SPLIT_WARPS, 1),
            shared_bytes: 0,
        },
    }
}

/// `row_attention`'s grid in the captured decode step: a block of [`SPLIT_WARPS`] warps
/// per (row of the bucket, head).
pub fn row_attention_grid(bucket_rows: usize, heads: usize) -> Grid {
    Grid {
        grid: (bucket_rows.max(1) as u32, heads.max(1) as u32, 1),
        block: (32, SPLIT_WARPS, 1),
        shared_bytes: 0,
    }
}

/// Threads of a block of `add_layer_norm` (`NORM_THREADS`).
pub const NORM_THREADS: u32 = 256;

/// Threads of a block of `sample_rows_*`, one block per row (`THREADS` in
/// `kernels/sample.cu`: 32 warps, each scanning a contiguous segment of the row, so that
/// enough loads are in flight on a pass over logits not yet in cache).
pub const SAMPLE_THREADS: u32 = 1024;

/// `add_layer_norm`'s grid over `m` rows of width `e`: a block per row, the row and the
/// block's partial sums (`e + 32` floats) in dynamic shared memory; `Err` where that passes
/// what a block may hold without opting in (a width over 12,256).
pub fn add_layer_norm_grid(m: usize, e: usize) -> Result<Grid, String> {
    let grid = Grid {
        grid: (u32::try_from(m.max(1)).unwrap_or(u32::MAX), 1, 1),
        block: (NORM_THREADS, 1, 1),
        shared_bytes: u32::try_from((e + 32) * 4).unwrap_or(u32::MAX),
    };
    grid.within_limits()
        .map(|()| grid)
        .map_err(|why| format!("add_layer_norm over rows of {e}: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// Every preset's heads, in f32 and BF16: which kernel serves them, and grids that
    /// cover every (group, head, row) of the worker's batches (up to 32 groups of 16).
    #[test]
    fn every_presets_heads_have_a_decode_attention_or_take_the_tensor_path() {
        for (preset, warp, split) in [("gpt2-124m", true, true), ("tiny", false, true)] {
            let cfg = Config::preset(preset).unwrap();
            let d = cfg.head_dim();
            for bytes in [4, 2] {
                assert_eq!(
                    attention_applies(AttentionKernel::Warp, bytes, d),
                    warp,
                    "{preset}"
                );
                assert_eq!(
                    attention_applies(AttentionKernel::Split, bytes, d),
                    split,
                    "{preset}"
                );
                assert_eq!(vectorised_heads(bytes, d), split, "{preset}");
            }
            for (groups, rows) in [(1, 1), (4, 8), (32, 8), (3, 17), (32, 16)] {
                for kernel in [AttentionKernel::Warp, AttentionKernel::Split] {
                    let g = attention_grid(kernel, groups, cfg.n_head, rows);
                    assert_eq!((g.grid.0 as usize, g.grid.1 as usize), (groups, cfg.n_head));
                    g.within_limits().unwrap();
                    let slots = match kernel {
                        AttentionKernel::Warp => g.grid.2 as usize * g.block.1 as usize,
                        AttentionKernel::Split => g.grid.2 as usize,
                    };
                    assert!(slots >= rows, "{kernel:?} misses rows: {g:?}");
                }
                let g = row_attention_grid(groups * rows, cfg.n_head);
                g.within_limits().unwrap();
                assert_eq!(
                    g.grid.0 as usize * g.grid.1 as usize,
                    groups * rows * cfg.n_head
                );
            }
        }
    }

    #[test]
    fn every_presets_width_fits_the_fused_layer_norms_block() {
        for preset in ["gpt2-124m", "tiny"] {
            let e = Config::preset(preset).unwrap().n_embd;
            for m in [1, 256, 4096] {
                let g = add_layer_norm_grid(m, e).unwrap();
                assert_eq!(g.grid.0 as usize, m);
            }
        }
        let err = add_layer_norm_grid(8, 16_384).unwrap_err();
        assert!(err.contains("shared memory"), "{err}");
    }

    #[test]
    fn heads_the_kernels_cannot_hold_take_the_tensor_path() {
        // Past the warp kernel's 128, not a multiple of 32, an f16-sized or f64 element.
        assert!(!attention_applies(AttentionKernel::Warp, 4, 256));
        assert!(!attention_applies(AttentionKernel::Warp, 4, 48));
        assert!(!attention_applies(AttentionKernel::Warp, 8, 64));
        assert!(!attention_applies(AttentionKernel::Split, 8, 64));
        // 16-byte pieces on a power-of-two number of lanes, at most 32.
        assert!(attention_applies(AttentionKernel::Split, 2, 256));
        assert!(!attention_applies(AttentionKernel::Split, 4, 256));
        assert!(!attention_applies(AttentionKernel::Split, 4, 96));
    }
}
