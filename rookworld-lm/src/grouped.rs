//! A decode-time KV cache in which the G samples of a prompt share one copy of its
//! prompt's keys and values, and sequences join and leave between steps (continuous
//! batching).
//!
//! Two stores per layer (letters as in `model.rs`, plus N prompt groups, R rows per group
//! at most, L pool columns, C suffix capacity):
//! - the **prefix pool** (groups capacity, H, L, D): each prompt's cache once, left-padded
//!   to L, groups 0..N live;
//! - the **suffix buffer** (rows capacity, H, C, D): each row's generated tokens, written in
//!   place at a shared column cursor. A row joining at cursor c owns columns c.. and the
//!   columns before are hidden from it, so rows of any age share one buffer.
//!
//! Both stay where they are while the work fits them: a group joins by writing its prompt
//! into the next free slots of the pool, a group leaves by the later ones moving down in
//! place, a row leaves by the last row moving into its slot. They are rebuilt, larger (by
//! doubling), only when the groups, a prompt, the rows or the window outgrow them, and
//! [`GroupedCache::rebuilds`] counts those moves: between two, every buffer of every
//! layer keeps its address (what a captured decode step relies on).
//!
//! A decode step attends each row to its group's prefix and to its own suffix with one
//! softmax over both. The prefix part is one batched matmul per layer over all groups:
//! the queries of a group's rows are scattered into (N, H, R, D), so each prompt's keys
//! are read once per step however many samples share them.

use candle_core::{Device, Result, Tensor};

use crate::cache::KvCache;
use crate::cpu_attention::{Geometry, decode_attention, with_f32};
use crate::kernels::{Kernel, Kernels};
use crate::mask::LeftPadding;

/// Smallest suffix buffer, in columns and in rows.
const MIN_COLUMNS: usize = 64;
const MIN_ROWS: usize = 8;
/// Smallest prefix pool, in groups; its columns are a multiple of `POOL_COLUMNS`.
const MIN_GROUPS: usize = 4;
const POOL_COLUMNS: usize = 32;

/// One live sequence: which prompt it continues and where its suffix starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    group: usize,
    /// Suffix column of its first fed token.
    start: usize,
}

#[derive(Debug, Default)]
pub(crate) struct GroupedLayer {
    /// Prefix pool (groups capacity, H, L, D); `None` until a group is held.
    prefix: Option<(Tensor, Tensor)>,
    /// Suffix buffers (rows capacity, H, C, D).
    suffix: Option<(Tensor, Tensor)>,
}

/// What every layer of one decode step shares (built once per step). Its integer inputs
/// cross to the device in one transfer, as one buffer ([`StepInputs`]) of which the
/// tensors here are views.
#[derive(Debug)]
pub(crate) struct StepPlan {
    /// Live rows B.
    pub rows: usize,
    /// Groups held N.
    pub groups: usize,
    /// Column this step writes.
    pub cursor: usize,
    /// First suffix column any live row uses; the step attends to `first..=cursor`.
    pub first: usize,
    /// Max rows of one group (R).
    pub group_rows: usize,
    /// (B, 1) u32: the token each row feeds.
    pub ids: Tensor,
    /// (B, 1) u32 position id of the token each row feeds.
    pub positions: Tensor,
    /// (N·R) u32: row index of slot (g, k), or B for an empty slot (a zero row).
    pub scatter: Tensor,
    /// (B) u32: slot g·R + k of each row.
    pub gather: Tensor,
    /// The tensor path's masks, made on its first use in the step.
    biases: std::sync::OnceLock<(Tensor, Tensor)>,
    /// The same geometry as plain numbers, for the CPU attention kernel.
    pub row_group: Vec<usize>,
    pub row_start: Vec<usize>,
    pub group_pad: Vec<usize>,
    pub pool_len: usize,
    /// Use the fused attention kernel (CPU, or CUDA) when the buffers allow it.
    pub cpu_kernel: bool,
    /// Run the layers with the fused decode ops ([`crate::decode_ops`]): on CUDA, or
    /// where a test asks ([`GroupedCache::with_decode_ops`]).
    pub decode_ops: bool,
    /// The same geometry on the device, for the CUDA kernel (CUDA steps only).
    #[cfg(feature = "cuda")]
    pub device_geometry: Option<crate::cuda::DeviceGeometry>,
}

impl StepPlan {
    /// The tensor path's masks: (N, 1, 1, L) f32, −∞ on each group's left padding, and
    /// (B, 1, 1, W) f32, W = cursor + 1 − first, −∞ before each row's start.
    pub fn biases(&self) -> Result<(&Tensor, &Tensor)> {
        if self.biases.get().is_none() {
            let device = self.ids.device();
            let (n, l) = (self.group_pad.len(), self.pool_len);
            let mut prefix = vec![0f32; n * l];
            for (g, &pad) in self.group_pad.iter().enumerate() {
                prefix[g * l..g * l + pad].fill(f32::NEG_INFINITY);
            }
            let window = self.cursor + 1 - self.first;
            let mut suffix = vec![0f32; self.rows * window];
            for (r, &start) in self.row_start.iter().enumerate() {
                suffix[r * window..r * window + start - self.first].fill(f32::NEG_INFINITY);
            }
            let made = (
                Tensor::from_vec(prefix, (n, 1, 1, l), device)?,
                Tensor::from_vec(suffix, (self.rows, 1, 1, window), device)?,
            );
            let _ = self.biases.set(made);
        }
        let (prefix, suffix) = self.biases.get().expect("made above");
        Ok((prefix, suffix))
    }
}

/// A decode step's integer inputs as one buffer, B rows, N groups of at most R rows:
/// `ids (B) | positions (B) | gather (B) | row_start (B) | scatter (N·R) | group_pad (N)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepInputs {
    pub values: Vec<u32>,
    pub rows: usize,
    pub groups: usize,
    pub group_rows: usize,
}

impl StepInputs {
    /// Where part `i` of the six starts, and its length.
    pub fn part(&self, i: usize) -> (usize, usize) {
        let b = self.rows;
        let lens = [b, b, b, b, self.groups * self.group_rows, self.groups];
        (lens[..i].iter().sum(), lens[i])
    }
}

/// Smallest bucket of rows a captured decode step is made for; a bucket is a power of two.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const MIN_BUCKET: usize = 8;

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// The bucket of rows a captured decode step of `rows` live rows runs in.
pub(crate) fn bucket(rows: usize) -> usize {
    rows.next_power_of_two().max(MIN_BUCKET)
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// Where a captured decode step of `bucket` rows finds its inputs in one u32 buffer:
/// `rows, cursor | ids | positions | row groups | row starts | group pads`, each
/// per-row part `bucket` long (rows past the live ones padding), the pads one per group.
/// A captured step reads them at fixed places; only their values change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GraphLayout {
    pub bucket: usize,
}

impl GraphLayout {
    /// `rows, cursor`: the live rows and the column the step writes.
    pub const HEADER: usize = 2;

    pub fn ids(self) -> usize {
        Self::HEADER
    }
    pub fn positions(self) -> usize {
        Self::HEADER + self.bucket
    }
    pub fn row_group(self) -> usize {
        Self::HEADER + 2 * self.bucket
    }
    pub fn row_start(self) -> usize {
        Self::HEADER + 3 * self.bucket
    }
    pub fn group_pad(self) -> usize {
        Self::HEADER + 4 * self.bucket
    }
    /// The buffer's length for `groups` groups.
    pub fn len(self, groups: usize) -> usize {
        self.group_pad() + groups
    }
}

/// Prompt caches held once per prompt, plus the per-row caches of their samples.
#[derive(Debug)]
pub struct GroupedCache {
    layers: Vec<GroupedLayer>,
    /// Real prompt tokens of each group.
    prefix_len: Vec<usize>,
    /// Pool columns L (at least the longest prompt held).
    pool_len: usize,
    /// Times a buffer was rebuilt (moved) since the cache was made.
    rebuilds: u64,
    rows: Vec<Row>,
    cursor: usize,
    /// Whether steps use the fused attention kernel: in place on the CPU in f32, one
    /// launch per layer on CUDA (the default).
    cpu_kernel: bool,
    /// Whether CPU steps use the fused decode ops too (CUDA steps always do).
    decode_ops_on_cpu: bool,
    /// The captured decode steps over these buffers (the trial `decode_graphs`), made
    /// again after a rebuild.
    #[cfg(feature = "cuda")]
    pub(crate) graphs: Option<crate::cuda::DecodeGraphs>,
}

impl GroupedCache {
    pub fn new(n_layer: usize) -> Self {
        Self {
            layers: (0..n_layer).map(|_| GroupedLayer::default()).collect(),
            prefix_len: Vec::new(),
            pool_len: 0,
            rebuilds: 0,
            rows: Vec::new(),
            cursor: 0,
            cpu_kernel: true,
            decode_ops_on_cpu: false,
            #[cfg(feature = "cuda")]
            graphs: None,
        }
    }

    /// Runs the fused decode ops that CUDA steps run (split q/k/v straight into the
    /// cache, bias + GELU, residual + layer norm) on the CPU too: for tests that compare
    /// them with the tensor path.
    pub fn with_decode_ops(mut self) -> Self {
        self.decode_ops_on_cpu = true;
        self
    }

    /// Turns the fused attention kernels (and the fused decode ops) off, so the tensor
    /// path is used: for tests that compare the two.
    pub fn without_cpu_kernel(mut self) -> Self {
        self.cpu_kernel = false;
        self
    }

    /// Whether steps use the fused kernels ([`Self::without_cpu_kernel`] turns them off).
    pub fn uses_fused_kernels(&self) -> bool {
        self.cpu_kernel
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

    /// Position id of the token `row` feeds at the cursor: its prompt's length plus the
    /// columns since it joined. The one place a row's position is worked out, for every
    /// layout of a step's inputs.
    fn position(&self, row: &Row) -> usize {
        self.prefix_len[row.group] + self.cursor - row.start
    }

    /// Each group's left padding in the pool (L − its prompt's length), group by group.
    fn group_pads(&self) -> impl Iterator<Item = usize> + '_ {
        self.prefix_len.iter().map(|&len| self.pool_len - len)
    }

    /// Checks that a step feeds one id per live row and makes room for its column and rows.
    fn prepare_step(&mut self, ids: &[u32]) -> Result<()> {
        let b = self.rows.len();
        assert!(b > 0, "a decode step needs a live row");
        if ids.len() != b {
            candle_core::bail!("{} ids for {b} live rows", ids.len());
        }
        self.reserve(b)
    }

    /// First suffix column a live row uses (the cursor when none is live).
    fn first_live_column(&self) -> usize {
        self.rows
            .iter()
            .map(|r| r.start)
            .min()
            .unwrap_or(self.cursor)
    }

    /// Times the cache's buffers were allocated or moved (a group, a prompt, the rows or
    /// the window outgrowing them; [`Self::clear`]); while it stays the same, every
    /// buffer of every layer keeps its address.
    pub fn rebuilds(&self) -> u64 {
        self.rebuilds
    }

    /// Adds the prompts just prefilled into `prefill` (rows padded as `padding` says) as new
    /// groups; returns the index of the first. Their rows are added with [`Self::add_row`].
    /// The prompts are written into the pool's next free slots; the pool is rebuilt only
    /// when they do not fit it.
    pub fn add_groups(&mut self, prefill: &KvCache, padding: &LeftPadding) -> Result<usize> {
        let first = self.groups();
        let new_len = prefill.seq_len();
        let added = padding.pads().len();
        for i in 0..self.layers.len() {
            let (k, v) = prefill.layer_kv(i).expect("prefilled cache"); // (P, H, Ln, D)
            self.reserve_groups(i, first + added, new_len, &k)?;
            let layer = &mut self.layers[i];
            let (pk, pv) = layer.prefix.as_ref().expect("reserved");
            let pool_len = pk.dim(2)?;
            // (P, H, L, D) each, written at group slots first.. of the pool.
            pk.slice_set(
                &left_pad(&k.to_dtype(pk.dtype())?, pool_len - new_len)?,
                0,
                first,
            )?;
            pv.slice_set(
                &left_pad(&v.to_dtype(pv.dtype())?, pool_len - new_len)?,
                0,
                first,
            )?;
        }
        if let Some((pk, _)) = self.layers.first().and_then(|l| l.prefix.as_ref()) {
            self.pool_len = pk.dim(2)?;
        }
        self.prefix_len
            .extend(padding.pads().iter().map(|&p| new_len - p));
        Ok(first)
    }

    /// Makes layer `i`'s pool hold `groups` groups of prompts up to `len` columns, the
    /// groups held kept (right-aligned in wider columns); `like` (·, H, ·, D) gives the
    /// heads, head dim, dtype and device of a pool yet to be made.
    fn reserve_groups(&mut self, i: usize, groups: usize, len: usize, like: &Tensor) -> Result<()> {
        let held = self.prefix_len.len();
        let layer = &mut self.layers[i];
        let (cap_groups, cap_len) = match &layer.prefix {
            Some((pk, _)) => (pk.dim(0)?, pk.dim(2)?),
            None => (0, 0),
        };
        if groups <= cap_groups && len <= cap_len {
            return Ok(());
        }
        let new_groups = groups.max(cap_groups).next_power_of_two().max(MIN_GROUPS);
        let new_len = len.max(cap_len).next_multiple_of(POOL_COLUMNS);
        let (_, h, _, d) = like.dims4()?;
        let grow = |old: Option<&Tensor>| -> Result<Tensor> {
            let dtype = old.map_or(like.dtype(), Tensor::dtype);
            let grown = Tensor::zeros((new_groups, h, new_len, d), dtype, like.device())?;
            if let Some(old) = old.filter(|_| held > 0) {
                grown.slice_set(
                    &left_pad(&old.narrow(0, 0, held)?, new_len - cap_len)?,
                    0,
                    0,
                )?;
            }
            Ok(grown)
        };
        let (pk, pv) = match layer.prefix.take() {
            Some((pk, pv)) => (grow(Some(&pk))?, grow(Some(&pv))?),
            None => (grow(None)?, grow(None)?),
        };
        layer.prefix = Some((pk, pv));
        if i == 0 {
            self.rebuilds += 1;
        }
        Ok(())
    }

    /// Drops the groups whose `keep` is false (none of their rows may be live); group
    /// indices shift down to stay dense, the kept groups' prompts moving down in place.
    /// Returns the new index of each old group.
    pub fn retain_groups(&mut self, keep: &[bool]) -> Result<Vec<Option<usize>>> {
        assert_eq!(keep.len(), self.groups(), "one flag per group");
        let mut remap = vec![None; keep.len()];
        let mut kept = Vec::new();
        for (g, &k) in keep.iter().enumerate() {
            if k {
                remap[g] = Some(kept.len());
                kept.push(g);
            }
        }
        for row in &mut self.rows {
            row.group = remap[row.group].expect("a dropped group has no live rows");
        }
        if kept.len() == keep.len() {
            return Ok(remap);
        }
        self.prefix_len = kept.iter().map(|&g| self.prefix_len[g]).collect();
        for layer in &mut self.layers {
            let Some((pk, pv)) = &layer.prefix else {
                continue;
            };
            for (to, &from) in kept.iter().enumerate().filter(|(to, from)| to != *from) {
                for t in [pk, pv] {
                    t.slice_set(&t.narrow(0, from, 1)?.copy()?, 0, to)?;
                }
            }
        }
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
        let (cpu_kernel, decode_ops_on_cpu) = (self.cpu_kernel, self.decode_ops_on_cpu);
        let rebuilds = self.rebuilds + 1;
        *self = Self::new(self.layers.len());
        self.cpu_kernel = cpu_kernel;
        self.decode_ops_on_cpu = decode_ops_on_cpu;
        self.rebuilds = rebuilds;
    }

    /// The integer inputs of a step feeding `ids` (one per live row) at the cursor.
    pub(crate) fn step_inputs(&self, ids: &[u32]) -> StepInputs {
        let (b, n) = (self.rows.len(), self.groups());
        let mut members = vec![Vec::new(); n];
        for (r, row) in self.rows.iter().enumerate() {
            members[row.group].push(r as u32);
        }
        let group_rows = members.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut values = Vec::with_capacity(4 * b + n * (group_rows + 1));
        values.extend_from_slice(ids);
        values.extend(self.rows.iter().map(|row| self.position(row) as u32));
        let mut gather = vec![0u32; b];
        let mut scatter = vec![b as u32; n * group_rows];
        for (g, rows) in members.iter().enumerate() {
            for (k, &r) in rows.iter().enumerate() {
                scatter[g * group_rows + k] = r;
                gather[r as usize] = (g * group_rows + k) as u32;
            }
        }
        values.extend(gather);
        values.extend(self.rows.iter().map(|row| row.start as u32));
        values.extend(scatter);
        values.extend(self.group_pads().map(|pad| pad as u32));
        StepInputs {
            values,
            rows: b,
            groups: n,
            group_rows,
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// Makes room for a step feeding `ids` (one per live row) and lays its inputs out
    /// for a captured step ([`GraphLayout`]): padding rows feed token 0 at position 0 in
    /// group 0 and start at the cursor (the step's attention skips them).
    pub(crate) fn graph_step_inputs(&mut self, ids: &[u32]) -> Result<(GraphLayout, Vec<u32>)> {
        self.prepare_step(ids)?;
        let b = self.rows.len();
        let layout = GraphLayout { bucket: bucket(b) };
        let cursor = self.cursor as u32;
        let mut values = vec![0u32; layout.len(self.groups())];
        values[0] = b as u32;
        values[1] = cursor;
        values[layout.row_start()..layout.group_pad()].fill(cursor);
        for (r, (row, &id)) in self.rows.iter().zip(ids).enumerate() {
            values[layout.ids() + r] = id;
            values[layout.positions() + r] = self.position(row) as u32;
            values[layout.row_group() + r] = row.group as u32;
            values[layout.row_start() + r] = row.start as u32;
        }
        for (g, pad) in self.group_pads().enumerate() {
            values[layout.group_pad() + g] = pad as u32;
        }
        Ok((layout, values))
    }

    /// Makes room for this step's column and rows, and builds what every layer shares,
    /// its integer inputs ([`Self::step_inputs`]) in one transfer to `device`, whose
    /// verdict on this project's kernels is `kernels`.
    pub(crate) fn plan_step(
        &mut self,
        ids: &[u32],
        device: &Device,
        kernels: &Kernels,
    ) -> Result<StepPlan> {
        self.prepare_step(ids)?;
        let b = self.rows.len();
        let first = self.first_live_column();
        let cursor = self.cursor;
        let inputs = self.step_inputs(ids);
        let (n, group_rows) = (inputs.groups, inputs.group_rows);
        let parts: Vec<(usize, usize)> = (0..6).map(|i| inputs.part(i)).collect();
        let all = Tensor::from_slice(&inputs.values, inputs.values.len(), device)?;
        let part = |i: usize| -> Result<Tensor> {
            let (start, len) = parts[i];
            all.narrow(0, start, len)
        };
        let row_start: Vec<usize> = self.rows.iter().map(|r| r.start).collect();
        let group_pad: Vec<usize> = self.group_pads().collect();
        #[cfg(feature = "cuda")]
        let device_geometry =
            if device.is_cuda() && self.cpu_kernel && kernels.enabled(Kernel::Attention) {
                Some(crate::cuda::DeviceGeometry {
                    split: kernels.enabled(Kernel::SplitAttention),
                    scatter: part(4)?,
                    row_start: part(3)?,
                    group_pad: part(5)?,
                    group_rows,
                    cursor,
                })
            } else {
                None
            };
        Ok(StepPlan {
            rows: b,
            groups: n,
            cursor,
            first,
            group_rows,
            ids: part(0)?.reshape((b, 1))?,
            positions: part(1)?.reshape((b, 1))?,
            gather: part(2)?,
            scatter: part(4)?,
            biases: std::sync::OnceLock::new(),
            row_group: self.rows.iter().map(|r| r.group).collect(),
            row_start,
            group_pad,
            pool_len: self.pool_len,
            cpu_kernel: self.cpu_kernel,
            // On CUDA the fused layers also need the attention kernel's geometry.
            decode_ops: self.cpu_kernel
                && if device.is_cuda() {
                    kernels.enabled(Kernel::Attention) && kernels.enabled(Kernel::DecodeOps)
                } else {
                    self.decode_ops_on_cpu
                },
            #[cfg(feature = "cuda")]
            device_geometry,
        })
    }

    /// Each layer's prefix pool and suffix buffers (keys and values of each), for a
    /// captured step; `None` before the first step has made the suffix buffers.
    #[cfg(feature = "cuda")]
    pub(crate) fn buffers(&self) -> Option<Vec<[&Tensor; 4]>> {
        self.layers
            .iter()
            .map(|l| match (&l.prefix, &l.suffix) {
                (Some((pk, pv)), Some((sk, sv))) => Some([pk, pv, sk, sv]),
                _ => None,
            })
            .collect()
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
            // The first step: each layer's buffers in its pool's heads, head dim and dtype.
            let rows = rows.next_power_of_two().max(MIN_ROWS);
            let cols = (self.cursor + 1).next_power_of_two().max(MIN_COLUMNS);
            for layer in &mut self.layers {
                let (pk, _) = layer.prefix.as_ref().expect("a decode step has groups");
                let (_, h, _, d) = pk.dims4()?;
                let zeros = || Tensor::zeros((rows, h, cols, d), pk.dtype(), pk.device());
                layer.suffix = Some((zeros()?, zeros()?));
            }
            self.rebuilds += 1;
            return Ok(());
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
        self.rebuilds += 1;
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
    /// The prefix pool's first `groups` groups (N, H, L, D), keys and values: views, no
    /// copy.
    pub(crate) fn prefix(&self, groups: usize) -> Result<(Tensor, Tensor)> {
        let (k, v) = self.prefix.as_ref().expect("a decode step has groups");
        Ok((k.narrow(0, 0, groups)?, v.narrow(0, 0, groups)?))
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
        let (sk, sv) = self.suffix();
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
    /// The suffix buffers (rows capacity, H, C, D), which `reserve` has made and made
    /// room in for the step.
    pub(crate) fn suffix(&self) -> (Tensor, Tensor) {
        let (sk, sv) = self.suffix.as_ref().expect("reserved by the step's plan");
        (sk.clone(), sv.clone())
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
            let (pk, pv) = (pk.narrow(0, 0, plan.groups)?, pv.narrow(0, 0, plan.groups)?);
            return crate::cuda::grouped_attention(q, (&pk, &pv), (sk, sv), geometry);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Three groups (prompts of 5, 3 and 7 tokens in a pool of 32 columns), four rows of
    /// which two continue group 2, joined at columns 0, 2, 2 and 4; the cursor at 6.
    fn cache() -> GroupedCache {
        let mut cache = GroupedCache::new(1);
        cache.prefix_len = vec![5, 3, 7];
        cache.pool_len = 32;
        cache.cursor = 6;
        cache.rows = [(2, 0), (0, 2), (2, 2), (1, 4)]
            .map(|(group, start)| Row { group, start })
            .to_vec();
        cache
    }

    #[test]
    fn a_steps_inputs_are_one_buffer_in_six_parts() {
        let inputs = cache().step_inputs(&[11, 12, 13, 14]);
        assert_eq!((inputs.rows, inputs.groups, inputs.group_rows), (4, 3, 2));
        let part = |i| {
            let (start, len) = inputs.part(i);
            &inputs.values[start..start + len]
        };
        assert_eq!(part(0), [11, 12, 13, 14], "ids");
        // Prompt length + the columns since the row joined.
        assert_eq!(part(1), [7 + 6, 5 + 4, 7 + 4, 3 + 2], "positions");
        // Slot g·R + k of each row: group 2's rows 0 and 2 in slots 4 and 5.
        assert_eq!(part(2), [4, 0, 5, 2], "gather");
        assert_eq!(part(3), [0, 2, 2, 4], "row starts");
        // Row of each slot, B (4) where a group has fewer rows than R.
        assert_eq!(part(4), [1, 4, 3, 4, 0, 2], "scatter");
        assert_eq!(part(5), [27, 29, 25], "group pads");
        assert_eq!(inputs.values.len(), 4 * 4 + 3 * 2 + 3);
    }

    #[test]
    fn a_captured_steps_inputs_sit_at_the_places_of_its_bucket() {
        let mut cache = cache();
        let pool = Tensor::zeros((4, 1, 32, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        cache.layers[0].prefix = Some((pool.clone(), pool));
        let (layout, values) = cache.graph_step_inputs(&[11, 12, 13, 14]).unwrap();
        assert_eq!(layout, GraphLayout { bucket: 8 });
        assert_eq!(values.len(), 2 + 4 * 8 + 3);
        assert_eq!(values[..2], [4, 6], "live rows, cursor");
        let part = |at: usize| &values[at..at + 8];
        assert_eq!(part(layout.ids()), [11, 12, 13, 14, 0, 0, 0, 0]);
        assert_eq!(part(layout.positions()), [13, 9, 11, 5, 0, 0, 0, 0]);
        assert_eq!(part(layout.row_group()), [2, 0, 2, 1, 0, 0, 0, 0]);
        assert_eq!(part(layout.row_start()), [0, 2, 2, 4, 6, 6, 6, 6]);
        assert_eq!(values[layout.group_pad()..], [27, 29, 25]);
        // Nine rows take the bucket of 16, and the suffix grows to hold it.
        for _ in 0..5 {
            cache.add_row(1);
        }
        let ids = [0; 9];
        let (layout, _) = cache.graph_step_inputs(&ids).unwrap();
        assert_eq!(layout.bucket, 16);
        let (sk, _) = cache.layers[0].suffix.as_ref().unwrap();
        assert!(sk.dim(0).unwrap() >= 16);
        assert_eq!(bucket(1), 8);
        assert_eq!(bucket(256), 256);
        assert_eq!(bucket(257), 512);
    }

    #[test]
    fn the_tensor_paths_masks_hide_padding_and_earlier_columns() {
        // Rows joined at columns 2, 2, 2 and 4; the window is columns 2..=6.
        let plan = StepPlan {
            rows: 4,
            groups: 3,
            cursor: 6,
            first: 2,
            group_rows: 2,
            ids: Tensor::zeros((4, 1), candle_core::DType::U32, &Device::Cpu).unwrap(),
            positions: Tensor::zeros((4, 1), candle_core::DType::U32, &Device::Cpu).unwrap(),
            scatter: Tensor::zeros(6, candle_core::DType::U32, &Device::Cpu).unwrap(),
            gather: Tensor::zeros(4, candle_core::DType::U32, &Device::Cpu).unwrap(),
            biases: std::sync::OnceLock::new(),
            row_group: vec![2, 0, 2, 1],
            row_start: vec![2, 2, 2, 4],
            group_pad: vec![27, 29, 25],
            pool_len: 32,
            cpu_kernel: false,
            decode_ops: false,
            #[cfg(feature = "cuda")]
            device_geometry: None,
        };
        let (prefix, suffix) = plan.biases().unwrap();
        let prefix = prefix.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (g, pad) in [27, 29, 25].into_iter().enumerate() {
            let row = &prefix[g * 32..(g + 1) * 32];
            assert!(row[..pad].iter().all(|x| x.is_infinite() && *x < 0.0));
            assert!(row[pad..].iter().all(|&x| x == 0.0));
        }
        let suffix = suffix.to_dtype(candle_core::DType::F32).unwrap();
        assert_eq!(suffix.dims(), [4, 1, 1, 5]);
        let suffix = suffix.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(
            &suffix[15..20],
            [f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, 0.0, 0.0]
        );
        assert!(suffix[..15].iter().all(|&x| x == 0.0));
    }
}
