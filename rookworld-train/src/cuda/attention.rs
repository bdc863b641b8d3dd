//! The attention kernels' launches, each group's completions over its prompt
//! (`kernels/pass.cu`), in the form the backend was given where the heads' width has it
//! ([`launch::attention_kernel`]): a warp per (row, head), `attention_*_d{D}`; a block per
//! (tile of rows, head), `attention_tile_*_d{D}` (the trial family
//! `step_attention_tiles`); or the tiles on tensor cores, `attention_mma_*_d{D}`
//! (`step_attention_mma`).

use candle_core::cuda::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{Cuda, CudaRows, DevF32, config, fail, int};
use crate::backend::{Heads, Result};
use crate::launch::{self, AttentionForm, Part};

impl Cuda {
    /// The kernel of `part` for these rows: its name, launch shape, and its last argument
    /// but one — the rows (a warp kernel) or the rows' tiles.
    fn attention_kernel(
        &self,
        rows: &CudaRows,
        heads: Heads,
        part: Part,
    ) -> Result<(&'static str, LaunchConfig, Last)> {
        let tiles = rows.tiles.as_ref().map_or(0, |(_, n)| *n);
        let (name, grid, form) =
            launch::attention_kernel(heads, part, rows.rows, tiles, self.attention)?;
        let last = match (form, &rows.tiles) {
            (AttentionForm::Warp, _) => Last::Rows(int("attention", rows.rows)?),
            (_, Some((slice, _))) => Last::Tiles(self.ptr(slice)),
            (_, None) => return Err(fail("attention", "tiled kernels without the rows' tiles")),
        };
        Ok((name, config(grid), last))
    }

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
        let h = int("attention", heads.h)?;
        let meta = self.ptr(&rows.meta);
        let (name, cfg, last) = self.attention_kernel(rows, heads, Part::Fwd)?;
        match last {
            Last::Rows(r) => launch!(
                self, name, cfg, &out.ptr, &state.ptr, &qkv.ptr, &meta, &r, &h
            ),
            Last::Tiles(t) => launch!(
                self, name, cfg, &out.ptr, &state.ptr, &qkv.ptr, &meta, &t, &h
            ),
        }
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
        let h = int("attention", heads.h)?;
        let meta = self.ptr(&rows.meta);
        // The query part (dq, row by row), then the key and value parts (key row by key
        // row): each writes its own columns of dqkv.
        for part in [Part::Dq, Part::Dkv] {
            let (name, cfg, last) = self.attention_kernel(rows, heads, part)?;
            let (d, o, q, s) = (&dout.ptr, &out.ptr, &qkv.ptr, &state.ptr);
            match last {
                Last::Rows(r) => launch!(self, name, cfg, &dqkv.ptr, d, o, q, s, &meta, &r, &h)?,
                Last::Tiles(t) => launch!(self, name, cfg, &dqkv.ptr, d, o, q, s, &meta, &t, &h)?,
            }
        }
        Ok(())
    }
}

/// A kernel's last argument but one: the rows (`int R`) or the tiles (`const int2 *`).
enum Last {
    Rows(i32),
    Tiles(CUdeviceptr),
}
