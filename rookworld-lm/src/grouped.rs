//! A decode-time KV cache in which the G samples of a prompt share one copy of its
//! prompt's keys and values, and sequences join and leave between steps (continuous
//! batching).
//!
//! Two stores per layer (letters as in `model.rs`, plus N prompt groups, R rows per group
//! at most, L pool columns, C suffix capacity):
//! - the **prefix pool** (N, H, L, D): each prompt's cache once, left-padded to L;
//! - the **suffix buffer** (rows capacity, H, C, D): each row's generated tokens, written in
//!   place at a shared column cursor. A row joining at cursor c owns columns c.. and the
//!   columns before are hidden from it, so rows of any age share one buffer.
//!
//! A decode step attends each row to its group's prefix and to its own suffix with one
//! softmax over both. The prefix part is one batched matmul per layer over all groups:
//! the queries of a group's rows are scattered into (N, H, R, D), so each prompt's keys
//! are read once per step however many samples share them.

use candle_core::{Device, Result, Tensor};

use crate::cache::KvCache;
use crate::cpu_attention::{Geometry, decode_attention, with_f32};
use crate::kernels::{self, Kernel};
use crate::mask::LeftPadding;

/// Smallest suffix buffer, in columns and in rows.
const MIN_COLUMNS: usize = 64;
const MIN_ROWS: usize = 8;

/// One live sequence: which prompt it continues and where its suffix starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    group: usize,
    /// Suffix column of its first fed token.
    start: usize,
}

#[derive(Debug, Default)]
pub(crate) struct GroupedLayer {
    /// Prefix pool (N, H, L, D); `None` while no group is held.
    prefix: Option<(Tensor, Tensor)>,
    /// Suffix buffers (rows capacity, H, C, D).
    suffix: Option<(Tensor, Tensor)>,
}

/// What every layer of one decode step shares (built once per step).
#[derive(Debug)]
pub(crate) struct StepPlan {
    /// Live rows B.
    pub rows: usize,
    /// Column this step writes.
    pub cursor: usize,
    /// First suffix column any live row uses; the step attends to `first..=cursor`.
    pub first: usize,
    /// Max rows of one group (R).
    pub group_rows: usize,
    /// (N·R) u32: row index of slot (g, k), or B for an empty slot (a zero row).
    pub scatter: Tensor,
    /// (B) u32: slot g·R + k of each row.
    pub gather: Tensor,
    /// (N, 1, 1, L) f32: −∞ on each group's left padding.
    pub prefix_bias: Tensor,
    /// (B, 1, 1, W) f32, W = cursor + 1 − first: −∞ before each row's start.
    pub suffix_bias: Tensor,
    /// (B, 1) u32 position id of the token each row feeds.
    pub positions: Tensor,
    /// The same geometry as plain numbers, for the CPU attention kernel.
    pub row_group: Vec<usize>,
    pub row_start: Vec<usize>,
    pub group_pad: Vec<usize>,
    pub pool_len: usize,
    /// Use the fused attention kernel (CPU, or CUDA) when the buffers allow it.
    pub cpu_kernel: bool,
    /// Run the layers with the fused decode ops ([`crate::fused_ops`]): on CUDA, or
    /// where a test asks ([`GroupedCache::with_fused_ops`]).
    pub fused_ops: bool,
    /// The same geometry on the device, for the CUDA kernel (CUDA steps only).
    #[cfg(feature = "cuda")]
    pub device_geometry: Option<crate::cuda::DeviceGeometry>,
}

/// Prompt caches held once per prompt, plus the per-row caches of their samples.
#[derive(Debug)]
pub struct GroupedCache {
    layers: Vec<GroupedLayer>,
    /// Real prompt tokens of each group.
    prefix_len: Vec<usize>,
    /// Pool columns L (the longest prompt held).
    pool_len: usize,
    rows: Vec<Row>,
    cursor: usize,
    /// Whether steps use the fused attention kernel: in place on the CPU in f32, one
    /// launch per layer on CUDA (the default).
    cpu_kernel: bool,
    /// Whether CPU steps use the fused decode ops too (CUDA steps always do).
    fused_ops_on_cpu: bool,
}

impl GroupedCache {
    pub fn new(n_layer: usize) -> Self {
        Self {
            layers: (0..n_layer).map(|_| GroupedLayer::default()).collect(),
            prefix_len: Vec::new(),
            pool_len: 0,
            rows: Vec::new(),
            cursor: 0,
            cpu_kernel: true,
            fused_ops_on_cpu: false,
        }
    }

    /// Runs the fused decode ops that CUDA steps run (split q/k/v straight into the
    /// cache, bias + GELU, residual + layer norm) on the CPU too: for tests that compare
    /// them with the tensor path.
    pub fn with_fused_ops(mut self) -> Self {
        self.fused_ops_on_cpu = true;
        self
    }

    /// Turns the fused attention kernels (and the fused decode ops) off, so the tensor
    /// path is used: for tests that compare the two.
    pub fn without_cpu_kernel(mut self) -> Self {
        self.cpu_kernel = false;
        self
    }

    /// Prompt groups held (N).
    pub fn groups(&self) -> usize {
        self.prefix_len.len()
    }

    /// Live rows (B).
    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// Group of row `r`.
    pub fn row_group(&self, r: usize) -> usize {
        self.rows[r].group
    }

    /// First suffix column a live row uses (the cursor when none is live).
    fn first_live_column(&self) -> usize {
        self.rows
            .iter()
            .map(|r| r.start)
            .min()
            .unwrap_or(self.cursor)
    }

    /// Adds the prompts just prefilled into `prefill` (rows padded as `padding` says) as new
    /// groups; returns the index of the first. Their rows are added with [`Self::add_row`].
    pub fn add_groups(&mut self, prefill: &KvCache, padding: &LeftPadding) -> Result<usize> {
        let first = self.groups();
        let new_len = prefill.seq_len();
        let pool_len = self.pool_len.max(new_len);
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let (k, v) = prefill.layer_kv(i).expect("prefilled cache"); // (P, H, Ln, D)
            let widen = |t: &Tensor, from: usize| left_pad(t, pool_len - from);
            let (k, v) = (widen(&k, new_len)?, widen(&v, new_len)?);
            layer.prefix = Some(match layer.prefix.take() {
                None => (k, v),
                Some((pk, pv)) => (
                    Tensor::cat(&[&widen(&pk, self.pool_len)?, &k], 0)?,
                    Tensor::cat(&[&widen(&pv, self.pool_len)?, &v], 0)?,
                ),
            });
        }
        self.pool_len = pool_len;
        self.prefix_len
            .extend(padding.pads().iter().map(|&p| new_len - p));
        Ok(first)
    }

    /// Drops the groups whose `keep` is false (none of their rows may be live); group
    /// indices shift down to stay dense. Returns the new index of each old group.
    pub fn retain_groups(&mut self, keep: &[bool]) -> Result<Vec<Option<usize>>> {
        assert_eq!(keep.len(), self.groups(), "one flag per group");
        let mut remap = vec![None; keep.len()];
        let mut kept = Vec::new();
        for (g, &k) in keep.iter().enumerate() {
            if k {
                remap[g] = Some(kept.len());
                kept.push(g as u32);
            }
        }
        for row in &mut self.rows {
            row.group = remap[row.group].expect("a dropped group has no live rows");
        }
        if kept.len() == keep.len() {
            return Ok(remap);
        }
        self.prefix_len = kept.iter().map(|&g| self.prefix_len[g as usize]).collect();
        let pool_len = self.prefix_len.iter().copied().max().unwrap_or(0);
        for layer in &mut self.layers {
            layer.prefix = match (layer.prefix.take(), kept.is_empty()) {
                (Some((k, v)), false) => {
                    let idx = Tensor::new(kept.as_slice(), k.device())?;
                    let trim = |t: Tensor| -> Result<Tensor> {
                        t.index_select(&idx, 0)?
                            .narrow(2, self.pool_len - pool_len, pool_len)?
                            .contiguous()
                    };
                    Some((trim(k)?, trim(v)?))
                }
                _ => None,
            };
        }
        self.pool_len = pool_len;
        Ok(remap)
    }

    /// Adds a row continuing group `group`; it feeds its first token at the next step.
    /// Returns its row index (the last).
    pub fn add_row(&mut self, group: usize) -> usize {
        assert!(group < self.groups(), "row of an unknown group");
        self.rows.push(Row {
            group,
            start: self.cursor,
        });
        self.rows.len() - 1
    }

    /// Removes row `r`; the last row moves into its place (as `Vec::swap_remove`).
    pub fn swap_remove_row(&mut self, r: usize) -> Result<()> {
        let last = self.rows.len() - 1;
        if r != last {
            for layer in &mut self.layers {
                if let Some((k, v)) = &layer.suffix
                    && k.dim(0)? > last
                {
                    k.slice_set(&k.narrow(0, last, 1)?.copy()?, 0, r)?;
                    v.slice_set(&v.narrow(0, last, 1)?.copy()?, 0, r)?;
                }
            }
        }
        self.rows.swap_remove(r);
        if self.rows.is_empty() {
            self.cursor = 0;
        }
        Ok(())
    }

    /// Drops every row and group.
    pub fn clear(&mut self) {
        let (cpu_kernel, fused_ops_on_cpu) = (self.cpu_kernel, self.fused_ops_on_cpu);
        *self = Self::new(self.layers.len());
        self.cpu_kernel = cpu_kernel;
        self.fused_ops_on_cpu = fused_ops_on_cpu;
    }

    /// Makes room for this step's column and rows, and builds what every layer shares.
    pub(crate) fn plan_step(&mut self, device: &Device) -> Result<StepPlan> {
        let b = self.rows.len();
        assert!(b > 0, "a decode step needs a live row");
        self.reserve(b)?;
        let first = self.first_live_column();
        let cursor = self.cursor;
        let window = cursor + 1 - first;

        let n = self.groups();
        let mut members = vec![Vec::new(); n];
        for (r, row) in self.rows.iter().enumerate() {
            members[row.group].push(r as u32);
        }
        let group_rows = members.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut scatter = vec![b as u32; n * group_rows];
        let mut gather = vec![0u32; b];
        for (g, rows) in members.iter().enumerate() {
            for (k, &r) in rows.iter().enumerate() {
                scatter[g * group_rows + k] = r;
                gather[r as usize] = (g * group_rows + k) as u32;
            }
        }
        let mut prefix_bias = vec![0f32; n * self.pool_len];
        for (g, &len) in self.prefix_len.iter().enumerate() {
            prefix_bias[g * self.pool_len..g * self.pool_len + self.pool_len - len]
                .fill(f32::NEG_INFINITY);
        }
        let mut suffix_bias = vec![0f32; b * window];
        let mut positions = Vec::with_capacity(b);
        for (r, row) in self.rows.iter().enumerate() {
            suffix_bias[r * window..r * window + row.start - first].fill(f32::NEG_INFINITY);
            positions.push((self.prefix_len[row.group] + cursor - row.start) as u32);
        }
        let scatter = Tensor::from_vec(scatter, n * group_rows, device)?;
        let row_start: Vec<usize> = self.rows.iter().map(|r| r.start).collect();
        let group_pad: Vec<usize> = self.prefix_len.iter().map(|&l| self.pool_len - l).collect();
        #[cfg(feature = "cuda")]
        let device_geometry =
            if device.is_cuda() && self.cpu_kernel && kernels::enabled(Kernel::Attention) {
                let on_device = |v: &[usize]| {
                    let v: Vec<u32> = v.iter().map(|&x| x as u32).collect();
                    Tensor::new(v.as_slice(), device)
                };
                Some(crate::cuda::DeviceGeometry {
                    scatter: scatter.clone(),
                    row_start: on_device(&row_start)?,
                    group_pad: on_device(&group_pad)?,
                    group_rows,
                    cursor,
                })
            } else {
                None
            };
        Ok(StepPlan {
            rows: b,
            cursor,
            first,
            group_rows,
            scatter,
            gather: Tensor::from_vec(gather, b, device)?,
            prefix_bias: Tensor::from_vec(prefix_bias, (n, 1, 1, self.pool_len), device)?,
            suffix_bias: Tensor::from_vec(suffix_bias, (b, 1, 1, window), device)?,
            positions: Tensor::from_vec(positions, (b, 1), device)?,
            row_group: self.rows.iter().map(|r| r.group).collect(),
            row_start,
            group_pad,
            pool_len: self.pool_len,
            cpu_kernel: self.cpu_kernel,
            // On CUDA the fused layers also need the attention kernel's geometry.
            fused_ops: self.cpu_kernel
                && if device.is_cuda() {
                    kernels::enabled(Kernel::Attention) && kernels::enabled(Kernel::DecodeOps)
                } else {
                    self.fused_ops_on_cpu
                },
            #[cfg(feature = "cuda")]
            device_geometry,
        })
    }

    /// Called after every layer has written the step's column.
    pub(crate) fn finish_step(&mut self) {
        self.cursor += 1;
    }

    /// Takes back the last decode step (its column is written over by the next): for a
    /// caller whose use of the step's logits failed (an out-of-memory error while
    /// sampling), so that the step can run again as if it never had.
    pub fn undo_step(&mut self) {
        self.cursor = self.cursor.saturating_sub(1);
    }

    pub(crate) fn layers_mut(&mut self) -> impl Iterator<Item = &mut GroupedLayer> {
        self.layers.iter_mut()
    }

    /// Grows the suffix buffers to hold `rows` rows and the cursor's column. A rebuilt
    /// buffer holds the live window at column 0 with room for as many columns again.
    fn reserve(&mut self, rows: usize) -> Result<()> {
        let Some((k, _)) = self.layers.first().and_then(|l| l.suffix.as_ref()) else {
            return Ok(()); // allocated by the first step's `append`
        };
        let (cap_rows, _, cap_cols, _) = k.dims4()?;
        if rows <= cap_rows && self.cursor < cap_cols {
            return Ok(());
        }
        let first = self.first_live_column();
        let window = self.cursor - first; // columns written and still in use
        let new_rows = rows.max(cap_rows).next_power_of_two().max(MIN_ROWS);
        let new_cols = (2 * (window + 1)).next_power_of_two().max(MIN_COLUMNS);
        let kept_rows = cap_rows.min(rows);
        let rebuild = |t: &Tensor| -> Result<Tensor> {
            let (_, h, _, d) = t.dims4()?;
            let grown = Tensor::zeros((new_rows, h, new_cols, d), t.dtype(), t.device())?;
            if window > 0 {
                let live = t.narrow(0, 0, kept_rows)?.narrow(2, first, window)?;
                let live = if kept_rows < new_rows {
                    let pad = (new_rows - kept_rows, h, window, d);
                    Tensor::cat(&[&live, &Tensor::zeros(pad, t.dtype(), t.device())?], 0)?
                } else {
                    live.contiguous()?
                };
                grown.slice_set(&live, 2, 0)?;
            }
            Ok(grown)
        };
        for layer in &mut self.layers {
            if let Some((k, v)) = layer.suffix.take() {
                layer.suffix = Some((rebuild(&k)?, rebuild(&v)?));
            }
        }
        for row in &mut self.rows {
            row.start -= first;
        }
        self.cursor -= first;
        Ok(())
    }
}

/// Prepends `n` zero columns (dimension 2) to a (N, H, L, D) tensor.
fn left_pad(t: &Tensor, n: usize) -> Result<Tensor> {
    if n == 0 {
        return t.contiguous();
    }
    let (g, h, _, d) = t.dims4()?;
    let zeros = Tensor::zeros((g, h, n, d), t.dtype(), t.device())?;
    Tensor::cat(&[&zeros, t], 2)
}

impl GroupedLayer {
    /// The prefix pool (N, H, L, D) keys and values.
    pub(crate) fn prefix(&self) -> (&Tensor, &Tensor) {
        let (k, v) = self.prefix.as_ref().expect("a decode step has groups");
        (k, v)
    }

    /// Writes the step's keys and values (B, H, 1, D) at the cursor column and returns
    /// the window `first..=cursor` of the live rows: (B, H, W, D) each.
    pub(crate) fn append(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        plan: &StepPlan,
    ) -> Result<(Tensor, Tensor)> {
        let (b, h, _, d) = k.dims4()?;
        let (sk, sv) = self.suffix_for(b, h, d, k.dtype(), plan)?;
        let cap_rows = sk.dim(0)?;
        let fill = |t: &Tensor| -> Result<Tensor> {
            if cap_rows == b {
                return t.contiguous();
            }
            let pad = Tensor::zeros((cap_rows - b, h, 1, d), t.dtype(), t.device())?;
            Tensor::cat(&[t, &pad], 0)
        };
        sk.slice_set(&fill(k)?, 2, plan.cursor)?;
        sv.slice_set(&fill(v)?, 2, plan.cursor)?;
        let window = plan.cursor + 1 - plan.first;
        let view = |t: &Tensor| t.narrow(0, 0, b)?.narrow(2, plan.first, window);
        Ok((view(&sk)?, view(&sv)?))
    }
}

impl GroupedLayer {
    /// The suffix buffers (rows capacity, H, C, D), allocated at the first step (B rows,
    /// H heads of D, in `dtype`); `reserve` has made room for the step.
    pub(crate) fn suffix_for(
        &mut self,
        b: usize,
        h: usize,
        d: usize,
        dtype: candle_core::DType,
        plan: &StepPlan,
    ) -> Result<(Tensor, Tensor)> {
        if self.suffix.is_none() {
            let device = self.prefix().0.device().clone();
            let rows = b.next_power_of_two().max(MIN_ROWS);
            let cols = (plan.cursor + 1).next_power_of_two().max(MIN_COLUMNS);
            let zeros = || Tensor::zeros((rows, h, cols, d), dtype, &device);
            self.suffix = Some((zeros()?, zeros()?));
        }
        let (sk, sv) = self.suffix.as_ref().expect("allocated");
        Ok((sk.clone(), sv.clone()))
    }

    /// The step's attention output (B, H·D) by a fused kernel straight from the buffers,
    /// after [`Self::append`]: on the CPU in f32 ([`crate::cpu_attention`]), on CUDA in
    /// f32 or bf16 (`kernels/grouped_attention.cu`); `None` where neither applies (then
    /// the tensor path runs).
    pub(crate) fn fused_attention(
        &self,
        q: &Tensor, // (B, H, 1, D)
        plan: &StepPlan,
    ) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let (Some(geometry), Some((pk, pv)), Some((sk, sv))) =
            (&plan.device_geometry, &self.prefix, &self.suffix)
        {
            return crate::cuda::grouped_attention(q, (pk, pv), (sk, sv), geometry);
        }
        self.cpu_attention(q, plan)
    }

    /// The CPU kernel's output; `None` when the cache is not f32 on the CPU.
    fn cpu_attention(
        &self,
        q: &Tensor, // (B, H, 1, D)
        plan: &StepPlan,
    ) -> Result<Option<Tensor>> {
        let (Some((pk, pv)), Some((sk, sv)), true) = (&self.prefix, &self.suffix, plan.cpu_kernel)
        else {
            return Ok(None);
        };
        let (b, h, _, d) = q.dims4()?;
        let geometry = Geometry {
            heads: h,
            head_dim: d,
            pool_len: plan.pool_len,
            suffix_cols: sk.dim(2)?,
            group_pad: &plan.group_pad,
            row_group: &plan.row_group,
            row_start: &plan.row_start,
            cursor: plan.cursor,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let out = with_f32(q, |q| {
            with_f32(pk, |pk| {
                with_f32(pv, |pv| {
                    with_f32(sk, |sk| {
                        with_f32(sv, |sv| decode_attention(&geometry, q, (pk, pv), (sk, sv)))
                    })
                })
            })
        });
        match out.flatten().flatten().flatten().flatten() {
            Some(y) => Ok(Some(Tensor::from_vec(y, (b, h * d), q.device())?)),
            None => Ok(None),
        }
    }
}

/// Zero row appended before scattering, so empty group slots gather zeros.
pub(crate) fn with_zero_row(t: &Tensor) -> Result<Tensor> {
    let cols = t.dim(1)?;
    let zero = Tensor::zeros((1, cols), t.dtype(), t.device())?;
    Tensor::cat(&[t, &zero], 0)
}
