//! The attention kernels' launches, each group's completions over its prompt
//! (`kernels/pass.cu`): a warp per (row, head), `attention_*_d{D}`, or — the trial family
//! `step_attention_tiles` — a block per (tile of rows, head), `attention_tile_*_d{D}`.

use candle_core::cuda::cudarc::driver::PushKernelArg;

use super::{Cuda, CudaRows, DevF32, config, fail, int};
use crate::backend::{Heads, Result};
use crate::launch::{self, Part};

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
        let meta = self.ptr(&rows.meta);
        if let Some((slice, tiles)) = &rows.tiles
            && let Some((name, grid)) = launch::tiled_attention(heads, Part::Fwd, *tiles)
        {
            let tiles = self.ptr(slice);
            return launch!(
                self,
                name,
                config(grid),
                &out.ptr,
                &state.ptr,
                &qkv.ptr,
                &meta,
                &tiles,
                &h
            );
        }
        let (name, grid) = launch::attention(heads, Part::Fwd, rows.rows)?;
        launch!(
            self,
            name,
            config(grid),
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
        let meta = self.ptr(&rows.meta);
        // The query part (dq, row by row), then the key and value parts (key row by key
        // row): each writes its own columns of dqkv.
        for part in [Part::Dq, Part::Dkv] {
            if let Some((slice, tiles)) = &rows.tiles
                && let Some((name, grid)) = launch::tiled_attention(heads, part, *tiles)
            {
                let tiles = self.ptr(slice);
                launch!(
                    self,
                    name,
                    config(grid),
                    &dqkv.ptr,
                    &dout.ptr,
                    &out.ptr,
                    &qkv.ptr,
                    &state.ptr,
                    &meta,
                    &tiles,
                    &h
                )?;
                continue;
            }
            let (name, grid) = launch::attention(heads, part, rows.rows)?;
            launch!(
                self,
                name,
                config(grid),
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
