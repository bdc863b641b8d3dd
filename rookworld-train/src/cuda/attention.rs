//! The attention kernels' launches, each group's completions over its prompt
//! (`kernels/pass.cu`): a warp per (row, head), `attention_*_d{D}`, or — the trial family
//! `step_attention_tiles` — a block per (tile of rows, head), `attention_tile_*_d{D}`.

use candle_core::cuda::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{Cuda, CudaRows, DevF32, fail, int, warps};
use crate::backend::{Heads, Result};

/// Rows of a tile, and threads of a block, of the tiled kernels (`TILE`, `TILE_THREADS`).
pub(super) const TILE: usize = 32;
const TILE_THREADS: u32 = 256;

/// The tiled kernel `attention_tile_{part}_d{D}`, its grid and the tiles' address, where
/// `rows` carries tiles and the heads' width has one; `None`: the warp kernels.
fn tile_kernel(
    b: &Cuda,
    heads: Heads,
    part: &str,
    rows: &CudaRows,
) -> Option<(&'static str, LaunchConfig, CUdeviceptr)> {
    let (slice, tiles) = rows.tiles.as_ref()?;
    if heads.h == 0 || heads.h * heads.d() != heads.e {
        return None;
    }
    let name = match (heads.d(), part) {
        (32, "fwd") => "attention_tile_fwd_d32",
        (64, "fwd") => "attention_tile_fwd_d64",
        (32, "dq") => "attention_tile_dq_d32",
        (64, "dq") => "attention_tile_dq_d64",
        (32, "dkv") => "attention_tile_dkv_d32",
        (64, "dkv") => "attention_tile_dkv_d64",
        _ => return None,
    };
    let cfg = LaunchConfig {
        grid_dim: (*tiles as u32, heads.h as u32, 1),
        block_dim: (TILE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    Some((name, cfg, b.ptr(slice)))
}

impl Cuda {
    pub(super) fn attention_fwd(
        &self,
        out: &mut DevF32,
        state: &mut DevF32,
        qkv: &DevF32,
        rows: &CudaRows,
        heads: Heads,
    ) -> Result<()> {
        if rows.rows == 0 {
            return Ok(());
        }
        let (r, h) = (int("attention", rows.rows)?, int("attention", heads.h)?);
        int("attention", rows.rows * heads.h * 32)?; // the kernels' thread index
        let meta = self.ptr(&rows.meta);
        if let Some((name, cfg, tiles)) = tile_kernel(self, heads, "fwd", rows) {
            return launch!(
                self, name, cfg, &out.ptr, &state.ptr, &qkv.ptr, &meta, &tiles, &h
            );
        }
        let name = attention_kernel(heads, "fwd")?;
        launch!(
            self,
            name,
            warps(rows.rows * heads.h),
            &out.ptr,
            &state.ptr,
            &qkv.ptr,
            &meta,
            &r,
            &h
        )
    }

    /// `dqkv` from the output's gradient, the output, `qkv` and the forward's state.
    pub(super) fn attention_bwd(
        &self,
        dqkv: &mut DevF32,
        (dout, out, qkv, state): (&DevF32, &DevF32, &DevF32, &DevF32),
        rows: &CudaRows,
        heads: Heads,
    ) -> Result<()> {
        if rows.rows == 0 {
            return Ok(());
        }
        let (r, h) = (int("attention", rows.rows)?, int("attention", heads.h)?);
        int("attention", rows.rows * heads.h * 32)?; // the kernels' thread index
        let meta = self.ptr(&rows.meta);
        // The query part (dq, row by row), then the key and value parts (key row by key
        // row): each writes its own columns of dqkv.
        for part in ["dq", "dkv"] {
            if let Some((name, cfg, tiles)) = tile_kernel(self, heads, part, rows) {
                launch!(
                    self, name, cfg, &dqkv.ptr, &dout.ptr, &out.ptr, &qkv.ptr, &state.ptr, &meta,
                    &tiles, &h
                )?;
                continue;
            }
            let name = attention_kernel(heads, part)?;
            launch!(
                self,
                name,
                warps(rows.rows * heads.h),
                &dqkv.ptr,
                &dout.ptr,
                &out.ptr,
                &qkv.ptr,
                &state.ptr,
                &meta,
                &r,
                &h
            )?;
        }
        Ok(())
    }
}

/// The attention kernel `attention_{part}_d{D}` for the heads' width (which must divide
/// the model's width: the kernels compute E as H·D).
fn attention_kernel(heads: Heads, part: &str) -> Result<&'static str> {
    if heads.h == 0 || heads.h * heads.d() != heads.e {
        return Err(fail(
            "attention",
            format!("{} heads do not divide a width of {}", heads.h, heads.e),
        ));
    }
    Ok(match (heads.d(), part) {
        (32, "fwd") => "attention_fwd_d32",
        (64, "fwd") => "attention_fwd_d64",
        (128, "fwd") => "attention_fwd_d128",
        (32, "dq") => "attention_bwd_dq_d32",
        (64, "dq") => "attention_bwd_dq_d64",
        (128, "dq") => "attention_bwd_dq_d128",
        (32, "dkv") => "attention_bwd_dkv_d32",
        (64, "dkv") => "attention_bwd_dkv_d64",
        (128, "dkv") => "attention_bwd_dkv_d128",
        (d, _) => {
            return Err(fail(
                "attention",
                format!("no kernel for heads of width {d} (32, 64 or 128)"),
            ));
        }
    })
}
