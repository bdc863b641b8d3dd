//! The CUDA backend's launch decisions as pure functions, built without the `cuda`
//! feature: which kernel serves a shape, each kernel's grid, block and shared memory, the
//! sizes of the head's blocks, and the shapes the backend refuses. The backend
//! (`crate::cuda`) launches what these return, the emulated kernel tests
//! (`tests/emulated_kernels.rs`) run the same grids on the CPU, and `tests/launch.rs` runs
//! every function over each shape the product, its presets and its checks use — so a shape
//! without a kernel is a test failure, not a surprise on a GPU.
//!
//! The constants mirror the `#define`s of `kernels/pass.cu` that fix a launch's shape.

use crate::backend::{Error, Heads, Result};

/// Threads of a block of the element-wise and partial-sum kernels.
pub const THREADS: u32 = 256;
/// Warps of a block of the warp-per-row kernels (`ROWS_PER_BLOCK`).
pub const ROWS_PER_BLOCK: u32 = 8;
/// Rows of one partial sum of `column_partials` (`SUM_ROWS`).
pub const SUM_ROWS: usize = 256;
/// Rows of one partial sum of `layer_norm_partials` (`LN_CHUNK`).
pub const LN_CHUNK: usize = 32;
/// Rows of a tile of the tiled attention (`TILE`), and its block's threads
/// (`TILE_THREADS`).
pub const TILE: usize = 32;
pub const TILE_THREADS: u32 = 256;
/// Threads per row of the head's kernels (`HEAD_THREADS`).
pub const HEAD_THREADS: u32 = 512;
/// Logit elements of one block of the head's rows (256 MiB of f32).
pub const HEAD_BLOCK_ELEMENTS: usize = 64 << 20;
/// Probabilities a chunk of the head keeps, with the head kept (1 GiB of f32).
pub const HEAD_KEEP_ELEMENTS: usize = 256 << 20;

/// Widths of a head the attention kernels serve, a warp per (row, head)
/// (`attention_*_d{D}`), and those the tiled kernels serve (`attention_tile_*_d{D}`).
pub const ATTENTION_WIDTHS: [usize; 3] = [32, 64, 128];
pub const TILE_WIDTHS: [usize; 2] = [32, 64];
/// Widths of a head the tensor-core attention serves (`attention_mma_*_d{D}`, the trial
/// family `step_attention_mma`: multiples of a fragment's 16 columns; at 128 its
/// forward's staging would pass the 48 KiB of static shared memory a block may have).
pub const MMA_WIDTHS: [usize; 3] = [16, 32, 64];
/// Threads of a block of the tensor-core attention (`MMA_THREADS`: four warps, one per
/// 16 × 16 block of a tile's scores).
pub const MMA_THREADS: u32 = 128;

pub use rookworld_lm::launch::Grid;

/// `grid`, or an error naming `op` when it would pass a device limit or launch nothing.
fn checked(grid: Grid, op: &'static str) -> Result<Grid> {
    grid.within_limits()
        .map(|()| grid)
        .map_err(|why| launch_error(op, format!("{why}: past the device's limits")))
}

fn launch_error(op: &'static str, message: String) -> Error {
    Error::Kernel {
        backend: "cuda",
        op,
        message,
    }
}

/// `v` as the kernels' `int`, or an error naming `op`.
pub fn int(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| launch_error(op, format!("{v} does not fit a kernel's int")))
}

fn blocks(op: &'static str, n: usize, per_block: usize) -> Result<u32> {
    u32::try_from(n.div_ceil(per_block).max(1))
        .map_err(|_| launch_error(op, format!("{n} elements need too many blocks")))
}

/// A grid-stride launch over `n` elements: [`THREADS`] a block, at most 65,536 blocks
/// (each thread takes every grid's-width element after its first).
pub fn elementwise(op: &'static str, n: usize) -> Result<Grid> {
    int(op, n)?;
    checked(
        Grid {
            grid: (blocks(op, n, THREADS as usize)?.min(1 << 16), 1, 1),
            block: (THREADS, 1, 1),
            shared_bytes: 0,
        },
        op,
    )
}

/// A warp per task, [`ROWS_PER_BLOCK`] tasks a block (the layer norm's rows, the warp
/// attention's (row, head) pairs).
pub fn warps(op: &'static str, tasks: usize) -> Result<Grid> {
    int(op, tasks.saturating_mul(32))?; // the kernels' thread index
    checked(
        Grid {
            grid: (blocks(op, tasks, ROWS_PER_BLOCK as usize)?, 1, 1),
            block: (ROWS_PER_BLOCK * 32, 1, 1),
            shared_bytes: 0,
        },
        op,
    )
}

/// `column_partials` over `rows` rows of `n` columns: a thread per column, a block row
/// per [`SUM_ROWS`] rows; returns the grid and the number of partial sums.
pub fn column_partials(rows: usize, n: usize) -> Result<(Grid, usize)> {
    let op = "column_sums";
    int(op, rows.saturating_mul(n))?;
    let k = rows.div_ceil(SUM_ROWS);
    let grid = checked(
        Grid {
            grid: (
                blocks(op, n, THREADS as usize)?,
                u32::try_from(k.max(1)).unwrap_or(u32::MAX),
                1,
            ),
            block: (THREADS, 1, 1),
            shared_bytes: 0,
        },
        op,
    )?;
    Ok((grid, k))
}

/// `layer_norm_partials` over `rows` rows: a block per [`LN_CHUNK`] rows; returns the
/// grid and the number of partial sums.
pub fn layer_norm_partials(rows: usize) -> Result<(Grid, usize)> {
    let op = "layer_norm";
    let k = rows.div_ceil(LN_CHUNK);
    let grid = checked(
        Grid {
            grid: (blocks(op, rows, LN_CHUNK)?, 1, 1),
            block: (THREADS, 1, 1),
            shared_bytes: 0,
        },
        op,
    )?;
    Ok((grid, k))
}

/// A block of [`HEAD_THREADS`] threads per row of the head, `m` rows.
pub fn per_row(m: usize) -> Result<Grid> {
    let op = "head";
    checked(
        Grid {
            grid: (u32::try_from(m.max(1)).unwrap_or(u32::MAX), 1, 1),
            block: (HEAD_THREADS, 1, 1),
            shared_bytes: 0,
        },
        op,
    )
}

/// Columns of a row of the head's logits on the device are a multiple of this.
pub const HEAD_ROW_ALIGN: usize = 64;

/// Elements between rows of the head's logits (and probabilities, and their gradient) on
/// the device: the vocabulary rounded up to [`HEAD_ROW_ALIGN`] (50,257 → 50,304), so every
/// row starts 256-byte aligned and cuBLAS can take its vectorised kernels for the head's
/// three products (rows of 50,257 f32 leave all but every fourth row 4-byte aligned
/// only). The padding columns are never read or written.
pub fn head_ld(vocab: usize) -> usize {
    vocab.max(1).next_multiple_of(HEAD_ROW_ALIGN)
}

/// Elements of `rows` rows of the head's logits (or probabilities) on the device, rows
/// [`head_ld`] apart: what a kept chunk is fitted to, and what its backward recognises.
pub fn head_rows_len(rows: usize, vocab: usize) -> usize {
    rows * head_ld(vocab)
}

/// Rows of the head per block when its logits are recomputed: at most
/// [`HEAD_BLOCK_ELEMENTS`] elements of rows [`head_ld`] apart, at least one row, at most the
/// `n` rows there are.
pub fn head_block(vocab: usize, n: usize) -> usize {
    (HEAD_BLOCK_ELEMENTS / head_ld(vocab)).clamp(1, n.max(1))
}

/// Rows of a chunk whose probabilities are kept: at most [`HEAD_KEEP_ELEMENTS`] elements of
/// rows [`head_ld`] apart, at least one.
pub fn keep_rows(vocab: usize) -> usize {
    (HEAD_KEEP_ELEMENTS / head_ld(vocab)).max(1)
}

/// A part of the attention: the forward, the queries' gradient, the keys' and values'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Fwd,
    Dq,
    Dkv,
}

impl Part {
    pub const ALL: [Part; 3] = [Part::Fwd, Part::Dq, Part::Dkv];
}

/// Which kernels run the step's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionForm {
    /// A warp per (row, head), walking its keys from device memory (`attention_*`).
    #[default]
    Warp,
    /// A block per (tile of rows, head), each chunk of keys staged in shared memory once
    /// for the tile (`attention_tile_*`, the trial `step_attention_tiles`).
    Tiles,
    /// The tiles' walk with every product on tensor cores, BF16 operands and f32 sums
    /// (`attention_mma_*`, the trial `step_attention_mma`).
    Mma,
}

/// `Err` unless `H` heads divide the width `E` (the kernels compute E as H·D).
fn divides(heads: Heads) -> Result<()> {
    if heads.h == 0 || !heads.e.is_multiple_of(heads.h) {
        return Err(launch_error(
            "attention",
            format!("{} heads do not divide a width of {}", heads.h, heads.e),
        ));
    }
    Ok(())
}

/// `Err` unless the CUDA backend has attention kernels for `heads`: `H` heads that divide
/// the width `E` (the kernels compute E as H·D), each of a width in [`ATTENTION_WIDTHS`].
/// What gates the fused pass on CUDA before anything runs.
pub fn serves(heads: Heads) -> Result<()> {
    divides(heads)?;
    let d = heads.d();
    if !ATTENTION_WIDTHS.contains(&d) {
        return Err(launch_error(
            "attention",
            format!(
                "no kernel for heads of width {d} ({} of a width of {}); the CUDA step's \
                 attention serves widths {ATTENTION_WIDTHS:?}",
                heads.h, heads.e
            ),
        ));
    }
    Ok(())
}

/// The warp attention's kernel `attention_{part}_d{D}` for `heads`, and its grid over
/// `rows` rows: a warp per (row, head).
pub fn attention(heads: Heads, part: Part, rows: usize) -> Result<(&'static str, Grid)> {
    serves(heads)?;
    int("attention", rows)?;
    let name = match (heads.d(), part) {
        (32, Part::Fwd) => "attention_fwd_d32",
        (64, Part::Fwd) => "attention_fwd_d64",
        (128, Part::Fwd) => "attention_fwd_d128",
        (32, Part::Dq) => "attention_bwd_dq_d32",
        (64, Part::Dq) => "attention_bwd_dq_d64",
        (128, Part::Dq) => "attention_bwd_dq_d128",
        (32, Part::Dkv) => "attention_bwd_dkv_d32",
        (64, Part::Dkv) => "attention_bwd_dkv_d64",
        (128, Part::Dkv) => "attention_bwd_dkv_d128",
        (d, _) => unreachable!("serves() admits widths {ATTENTION_WIDTHS:?}, not {d}"),
    };
    Ok((name, warps("attention", rows.saturating_mul(heads.h))?))
}

/// A block of `threads` per (tile, head); `None` past the device's limits.
fn per_tile(heads: Heads, tiles: usize, threads: u32) -> Option<Grid> {
    let grid = Grid {
        grid: (
            u32::try_from(tiles.max(1)).ok()?,
            u32::try_from(heads.h).ok()?,
            1,
        ),
        block: (threads, 1, 1),
        shared_bytes: 0,
    };
    checked(grid, "attention").ok()
}

/// The tiled attention's kernel `attention_tile_{part}_d{D}` and its grid, a block per
/// (tile, head), where the heads' width has one ([`TILE_WIDTHS`]); `None`: the warp
/// kernels serve it.
pub fn tiled_attention(heads: Heads, part: Part, tiles: usize) -> Option<(&'static str, Grid)> {
    serves(heads).ok()?;
    let name = match (heads.d(), part) {
        (32, Part::Fwd) => "attention_tile_fwd_d32",
        (64, Part::Fwd) => "attention_tile_fwd_d64",
        (32, Part::Dq) => "attention_tile_dq_d32",
        (64, Part::Dq) => "attention_tile_dq_d64",
        (32, Part::Dkv) => "attention_tile_dkv_d32",
        (64, Part::Dkv) => "attention_tile_dkv_d64",
        _ => return None,
    };
    Some((name, per_tile(heads, tiles, TILE_THREADS)?))
}

/// The tensor-core attention's kernel `attention_mma_{part}_d{D}` and its grid, a block of
/// [`MMA_THREADS`] per (tile, head), where the heads' width has one ([`MMA_WIDTHS`]);
/// `None`: another form serves it.
pub fn mma_attention(heads: Heads, part: Part, tiles: usize) -> Option<(&'static str, Grid)> {
    divides(heads).ok()?;
    let name = match (heads.d(), part) {
        (16, Part::Fwd) => "attention_mma_fwd_d16",
        (32, Part::Fwd) => "attention_mma_fwd_d32",
        (64, Part::Fwd) => "attention_mma_fwd_d64",
        (16, Part::Dq) => "attention_mma_dq_d16",
        (32, Part::Dq) => "attention_mma_dq_d32",
        (64, Part::Dq) => "attention_mma_dq_d64",
        (16, Part::Dkv) => "attention_mma_dkv_d16",
        (32, Part::Dkv) => "attention_mma_dkv_d32",
        (64, Part::Dkv) => "attention_mma_dkv_d64",
        _ => return None,
    };
    Some((name, per_tile(heads, tiles, MMA_THREADS)?))
}

/// The kernel that runs `part` of the attention for `heads` when `form` is asked for: that
/// form's where it serves the heads' width, else the tiled one's (asked for tiles or
/// tensor cores), else the warp kernels' (`Err` where none serves). Returns the kernel, its
/// grid over `rows` rows or `tiles` tiles, and the form it is: a warp kernel's arguments
/// end with the rows and the heads, the others' with the tiles and the heads.
pub fn attention_kernel(
    heads: Heads,
    part: Part,
    rows: usize,
    tiles: usize,
    form: AttentionForm,
) -> Result<(&'static str, Grid, AttentionForm)> {
    if form == AttentionForm::Mma
        && let Some((name, grid)) = mma_attention(heads, part, tiles)
    {
        return Ok((name, grid, AttentionForm::Mma));
    }
    if form != AttentionForm::Warp
        && let Some((name, grid)) = tiled_attention(heads, part, tiles)
    {
        return Ok((name, grid, AttentionForm::Tiles));
    }
    let (name, grid) = attention(heads, part, rows)?;
    Ok((name, grid, AttentionForm::Warp))
}
