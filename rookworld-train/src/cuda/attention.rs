//! The attention kernels' launches: a warp per (row, head), each group's completions over
//! its prompt (`kernels/pass.cu`, `attention_*_d{D}`).

use candle_core::cuda::cudarc::driver::PushKernelArg;

use super::{Cuda, CudaRows, DevF32, fail, int, warps};
use crate::backend::{Heads, Result};

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
        let name = attention_kernel(heads, "fwd")?;
        let (r, h) = (int("attention", rows.rows)?, int("attention", heads.h)?);
        int("attention", rows.rows * heads.h * 32)?; // the kernels' thread index
        let meta = self.ptr(&rows.meta);
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
