//! The CUDA backend: f32 buffers in device memory that the pass plans ([`DeviceVec`]),
//! every product one cuBLAS `gemm` with BF16 products and f32 sums
//! (`CUBLAS_COMPUTE_32F_FAST_16BF`: the CPU backend's [`Matmuls::Bf16`](crate::cpu::ops::Matmuls)
//! maths), and a kernel per other operation (`kernels/pass.cu`, each the GPU form of the
//! CPU backend's kernel of the same name). It runs on candle's CUDA device: its stream,
//! its cuBLAS handle and its module cache, so weights held by candle tensors are read in
//! place ([`DevF32::of`]).
//!
//! Every launch is on the device's one stream, in the pass's order; a host read
//! ([`Backend::read`]) waits for what came before it. The backend's own scratch (the
//! head's block of logits, the partial sums of the column and layer-norm reductions) is
//! sized on first use and kept.
//!
//! Profiled ([`Cuda::profiled`]), every launch, product and fill is bracketed by two
//! timing events on the stream, and [`Cuda::take_profile`] reads their device times by
//! kernel name (a product by its shape and transposes).

mod buffer;

pub use buffer::{DevF32, DeviceVec};

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

use candle_core::CudaDevice;
use candle_core::cuda::cudarc::cublas::{result as blas, sys as blas_sys};
use candle_core::cuda::cudarc::driver::sys::{self as drv_sys, CUdeviceptr};
use candle_core::cuda::cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg, result as drv,
};

use crate::backend::{
    Backend, Epilogue, Error, HeadBackward, HeadForward, Heads, Result, composed_epilogue,
};
use crate::gemm::{EpilogueKind, Gemm};
use crate::launch::{self, Grid, int};
use crate::packed::{Packed, ScatterPlan};
use crate::profile::KernelProfile;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/pass.ptx"));
const MODULE: &str = "rookworld_train_pass";

/// A [`ScatterPlan`] on the device.
struct DevicePlan {
    targets: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    sources: CudaSlice<u32>,
    destinations: usize,
}

/// A micro-batch's layout on the device.
pub struct CudaRows {
    ids: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    head_rows: CudaSlice<u32>,
    targets: CudaSlice<u32>,
    /// Per row (p0, p1, o0, q_end): [`Packed::row_meta`].
    meta: CudaSlice<i32>,
    /// The scatters of the backward: rows into tokens, rows into positions, predicting
    /// rows into rows.
    by_token: DevicePlan,
    by_position: DevicePlan,
    by_head_row: DevicePlan,
    /// With tiled attention: [`Packed::row_tiles`] of `ATTENTION_TILE` rows, (first, rows)
    /// each, and how many.
    tiles: Option<(CudaSlice<i32>, usize)>,
    rows: usize,
    predicted: usize,
}

/// Launches kernel `$name` on grid `$cfg` with the arguments listed, each pushed by
/// reference (they live until the launch, at the end of the statement).
macro_rules! launch {
    ($self:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        // Kernel `$name` of `kernels/pass.cu`, looked up once per backend.
        let func = $self.function($name)?;
        let stream = $self.device.cuda_stream();
        let mut builder = stream.launch_builder(&func);
        $( builder.arg($arg); )+
        let timed = $self.time_start()?;
        // SAFETY: each call site pushes the arguments of the kernel's signature in
        // `kernels/pass.cu`, in its order, with buffers at least as long as the sizes it
        // passes (the pass sizes them from the same shape), on a grid the kernel's bounds
        // checks cover.
        unsafe { builder.launch($cfg) }.map_err(|e| fail($name, e))?;
        $self.time_end(timed, || $name.to_string())
    }};
}

mod attention;
mod head;
mod lt;

/// The CUDA backend on a candle CUDA device.
pub struct Cuda {
    device: CudaDevice,
    scratch: RefCell<DeviceVec>,
    /// The kernels launched so far, by name: a launch looks its kernel up here instead of
    /// in candle's module cache (a lock, a map and a driver call each time).
    functions: RefCell<HashMap<&'static str, CudaFunction>>,
    /// The attention's kernels ([`Cuda::with_attention`]).
    attention: launch::AttentionForm,
    /// The head's probabilities kept from its forward for its backward
    /// ([`Cuda::with_kept_head`]).
    kept_head: bool,
    /// The products' epilogues inside them on cuBLASLt ([`Cuda::with_epilogues`]).
    epilogues: bool,
    /// Profiled: each timed operation's name and the events recorded before and after it,
    /// read by [`Cuda::take_profile`].
    timing: Option<RefCell<Vec<(String, CudaEvent, CudaEvent)>>>,
    /// Not `Send`: candle's device issues work on its creating thread's stream, and the
    /// raw copies, fills and cuBLAS calls here are ordered only on that stream.
    _one_thread: std::marker::PhantomData<*const ()>,
}

fn fail(op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Kernel {
        backend: "cuda",
        op,
        message: e.to_string(),
    }
}

/// A launch's shape ([`crate::launch`]) as cudarc takes it.
fn config(g: Grid) -> LaunchConfig {
    LaunchConfig {
        grid_dim: g.grid,
        block_dim: g.block,
        shared_mem_bytes: g.shared_bytes,
    }
}

/// A product's name in profiles: `gemm M×N×K` and its transposes, `gemm+<epilogue> …`
/// with an epilogue inside it.
fn product_name(g: &Gemm, epilogue: Option<EpilogueKind>) -> String {
    let t = |trans: bool| if trans { 'T' } else { 'N' };
    let (ta, tb) = (t(g.a.trans), t(g.b.trans));
    let with = epilogue.map_or(String::new(), |k| format!("+{}", k.name()));
    format!("gemm{with} {}×{}×{} {ta}{tb}", g.m, g.n, g.k)
}

/// A grid-stride launch over `n` elements ([`launch::elementwise`]).
fn elementwise(n: usize) -> Result<LaunchConfig> {
    launch::elementwise("elementwise", n).map(config)
}

/// A warp per task ([`launch::warps`]).
fn warps(tasks: usize) -> Result<LaunchConfig> {
    launch::warps("warps", tasks).map(config)
}

impl Cuda {
    pub fn new(device: CudaDevice) -> Self {
        Self {
            device,
            scratch: RefCell::new(DeviceVec::default()),
            functions: RefCell::default(),
            attention: launch::AttentionForm::Warp,
            kept_head: false,
            epilogues: false,
            timing: None,
            _one_thread: std::marker::PhantomData,
        }
    }

    /// The backend with the attention's kernels of `form` where the heads' width has them
    /// ([`launch::attention_kernel`]): a warp per row and head (the default), a tile of
    /// rows per block (the trial family `step_attention_tiles`, heads of width 32 or 64),
    /// or the tiles on tensor cores (`step_attention_mma`, heads of width 16, 32 or 64;
    /// the fused pass takes 32 and 64 of those, the widths the start-up check runs).
    /// Set before its first [`Backend::rows`].
    pub fn with_attention(self, form: launch::AttentionForm) -> Self {
        Self {
            attention: form,
            ..self
        }
    }

    /// The backend with the LM head's probabilities kept from its forward for its backward
    /// (the trial family `step_head_kept`): [`crate::train`]'s head runs in chunks of at
    /// most 1 GiB of probabilities ([`Backend::head_keep_rows`]), each chunk's logits one
    /// product, turned into probabilities in place (`head_probs`) and then into the logits'
    /// gradient (`head_grad_kept`) — the backward's product that recomputes them is gone.
    /// Without it, nothing is kept and the backward recomputes each block's logits.
    pub fn with_kept_head(self, on: bool) -> Self {
        Self {
            kept_head: on,
            ..self
        }
    }

    /// The backend with each product's epilogue inside it (the trial family
    /// `step_epilogues`, [`Backend::gemm_epilogue`]): one `cublasLtMatmul` adds the bias,
    /// applies GELU keeping its input, applies GELU's gradient, or sums the bias's
    /// gradient, where without it a kernel of its own reads and writes the whole result
    /// again. A call cuBLASLt has no algorithm for runs composed (logged once per kind).
    pub fn with_epilogues(self, on: bool) -> Self {
        Self {
            epilogues: on,
            ..self
        }
    }

    /// The backend timing every kernel, product and fill it enqueues, with a device event
    /// before and after each (a few microseconds of host time per launch, no waiting).
    pub fn profiled(self) -> Self {
        Self {
            timing: Some(RefCell::default()),
            ..self
        }
    }

    /// The device time of everything enqueued since the last call, by kernel name (a
    /// product as `gemm M×N×K` and its transposes); waits for the last of it. Empty unless
    /// [`profiled`](Self::profiled).
    pub fn take_profile(&self) -> Result<KernelProfile> {
        let mut profile = KernelProfile::default();
        let Some(timing) = &self.timing else {
            return Ok(profile);
        };
        for (name, start, end) in timing.borrow_mut().drain(..) {
            let ms = start.elapsed_ms(&end).map_err(|e| fail("profile", e))?;
            profile.add(&name, f64::from(ms) / 1e3);
        }
        Ok(profile)
    }

    /// When profiled, an event recorded on the stream before an operation.
    fn time_start(&self) -> Result<Option<CudaEvent>> {
        if self.timing.is_none() {
            return Ok(None);
        }
        let flags = drv_sys::CUevent_flags::CU_EVENT_DEFAULT; // with timing
        self.device
            .cuda_stream()
            .record_event(Some(flags))
            .map(Some)
            .map_err(|e| fail("profile", e))
    }

    /// When profiled, an event recorded after the operation `time_start` began, kept
    /// under its name.
    fn time_end(&self, start: Option<CudaEvent>, name: impl FnOnce() -> String) -> Result<()> {
        let (Some(timing), Some(start)) = (&self.timing, start) else {
            return Ok(());
        };
        let flags = drv_sys::CUevent_flags::CU_EVENT_DEFAULT;
        let end = self
            .device
            .cuda_stream()
            .record_event(Some(flags))
            .map_err(|e| fail("profile", e))?;
        timing.borrow_mut().push((name(), start, end));
        Ok(())
    }

    /// The backend with `scratch` as its own (a step's backend handing it to the next
    /// one's: [`Cuda::into_scratch`]), so that no step allocates it again.
    pub fn with_scratch(device: CudaDevice, scratch: DeviceVec) -> Self {
        Self {
            scratch: RefCell::new(scratch),
            ..Self::new(device)
        }
    }

    /// The scratch, kept for the next backend on this device.
    pub fn into_scratch(self) -> DeviceVec {
        self.scratch.into_inner()
    }

    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Kernel `name` of `kernels/pass.cu` (its module loaded on first use).
    fn function(&self, name: &'static str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.borrow().get(name) {
            return Ok(f.clone());
        }
        let f = self
            .device
            .get_or_load_custom_func(name, MODULE, PTX)
            .map_err(|e| fail(name, e))?
            .into_cuda_function();
        self.functions.borrow_mut().insert(name, f.clone());
        Ok(f)
    }

    /// The scratch, at least `len` elements.
    fn scratch(&self, len: usize) -> Result<std::cell::RefMut<'_, DeviceVec>> {
        let mut s = self.scratch.borrow_mut();
        if s.memory.as_ref().is_none_or(|m| m.len() < len) {
            self.fit(&mut s, len)?;
        }
        s.view.len = len;
        Ok(s)
    }

    fn upload<T: candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        op: &'static str,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        let stream = self.device.cuda_stream();
        // One element at least: CUDA refuses a zero-byte allocation.
        if host.is_empty() {
            // SAFETY: the one element is never read (its length says 0 to no kernel).
            return unsafe { stream.alloc::<T>(1) }.map_err(|e| fail(op, e));
        }
        stream.clone_htod(host).map_err(|e| fail(op, e))
    }

    /// Makes the device's context current on this thread (before a raw driver or cuBLAS
    /// call: kernel launches and cudarc's own calls do it themselves).
    fn bind(&self, op: &'static str) -> Result<()> {
        self.device
            .cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(|e| fail(op, e))
    }

    fn plan(&self, index: &[u32]) -> Result<DevicePlan> {
        let plan = ScatterPlan::new(index);
        Ok(DevicePlan {
            targets: self.upload("rows", &plan.targets)?,
            offsets: self.upload("rows", &plan.offsets)?,
            sources: self.upload("rows", &plan.sources)?,
            destinations: plan.targets.len(),
        })
    }

    /// `dst` (·, E) += `src` (·, E) scattered by `plan` (E = `width`).
    fn scatter(
        &self,
        dst: &mut DevF32,
        src: &DevF32,
        plan: &DevicePlan,
        width: usize,
    ) -> Result<()> {
        if plan.destinations == 0 || width == 0 {
            return Ok(());
        }
        let (k, e) = (int("scatter", plan.destinations)?, int("scatter", width)?);
        int("scatter", plan.destinations * width)?;
        let (t, o, s) = (
            self.ptr(&plan.targets),
            self.ptr(&plan.offsets),
            self.ptr(&plan.sources),
        );
        launch!(
            self,
            "scatter_add_planned",
            elementwise(plan.destinations * width)?,
            &dst.ptr,
            &src.ptr,
            &t,
            &o,
            &s,
            &k,
            &e
        )
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> CUdeviceptr {
        let stream = self.device.cuda_stream();
        let (ptr, _record) = s.device_ptr(&stream);
        ptr
    }
}

impl Backend for Cuda {
    type Buf = DevF32;
    type Owned = DeviceVec;
    type Rows<'a> = CudaRows;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn fit(&self, buf: &mut DeviceVec, len: usize) -> Result<()> {
        let have = buf.memory.as_ref().map_or(0, |m| m.len());
        if have < len {
            let memory = self
                .device
                .cuda_stream()
                .alloc_zeros::<f32>(len)
                .map_err(|e| fail("alloc", e))?;
            buf.view.ptr = self.ptr(&memory);
            buf.memory = Some(memory);
        }
        buf.view.len = len;
        Ok(())
    }

    fn len(&self, buf: &DevF32) -> usize {
        buf.len
    }

    fn read(&self, buf: &DevF32) -> Result<Vec<f32>> {
        let mut host = vec![0f32; buf.len];
        if buf.len == 0 {
            return Ok(host);
        }
        self.bind("read")?;
        let stream = self.device.cuda_stream();
        // SAFETY: `buf` views `len` f32 of live device memory; the copy is on the stream
        // every kernel runs on, and the synchronisation ends it before `host` is read.
        unsafe { drv::memcpy_dtoh_async(&mut host, buf.ptr, stream.cu_stream()) }
            .map_err(|e| fail("read", e))?;
        stream.synchronize().map_err(|e| fail("read", e))?;
        Ok(host)
    }

    fn write(&self, buf: &mut DevF32, host: &[f32]) -> Result<()> {
        if buf.len != host.len() {
            return Err(fail(
                "write",
                format!("{} elements into {}", host.len(), buf.len),
            ));
        }
        if host.is_empty() {
            return Ok(());
        }
        self.bind("write")?;
        let stream = self.device.cuda_stream();
        // SAFETY: as in `read`; the synchronisation keeps `host` alive until the copy
        // from it has ended.
        unsafe { drv::memcpy_htod_async(buf.ptr, host, stream.cu_stream()) }
            .map_err(|e| fail("write", e))?;
        stream.synchronize().map_err(|e| fail("write", e))
    }

    fn fill(&self, buf: &mut DevF32, value: f32) -> Result<()> {
        if buf.len == 0 {
            return Ok(());
        }
        self.bind("fill")?;
        let timed = self.time_start()?;
        let stream = self.device.cuda_stream();
        // SAFETY: `buf` views `len` f32 of live device memory, on the kernels' stream.
        unsafe { drv_sys::cuMemsetD32Async(buf.ptr, value.to_bits(), buf.len, stream.cu_stream()) }
            .result()
            .map_err(|e| fail("fill", e))?;
        self.time_end(timed, || "fill".to_string())
    }

    fn synchronize(&self) -> Result<()> {
        self.device
            .cuda_stream()
            .synchronize()
            .map_err(|e| fail("synchronize", e))
    }

    fn rows(&self, packed: &Packed) -> Result<CudaRows> {
        let r = packed.rows();
        let meta: Vec<i32> = packed.row_meta().into_iter().flatten().collect();
        int("rows", r)?;
        Ok(CudaRows {
            ids: self.upload("rows", &packed.ids)?,
            positions: self.upload("rows", &packed.positions)?,
            head_rows: self.upload("rows", &packed.head_rows)?,
            targets: self.upload("rows", &packed.targets)?,
            meta: self.upload("rows", &meta)?,
            by_token: self.plan(&packed.ids)?,
            by_position: self.plan(&packed.positions)?,
            by_head_row: self.plan(&packed.head_rows)?,
            tiles: if self.attention != launch::AttentionForm::Warp {
                let tiles = packed.row_tiles(launch::TILE);
                let flat: Vec<i32> = tiles.iter().flatten().copied().collect();
                Some((self.upload("rows", &flat)?, tiles.len()))
            } else {
                None
            },
            rows: r,
            predicted: packed.targets.len(),
        })
    }

    fn attention_state_len(&self, packed: &Packed, heads: Heads) -> usize {
        // Each (row, head)'s log-sum-exp: the backward recomputes the probabilities.
        packed.rows() * heads.h
    }

    fn head_keep_rows(&self, vocab: usize) -> Option<usize> {
        self.kept_head.then(|| launch::keep_rows(vocab))
    }

    fn gemm(&self, c: &mut DevF32, g: &Gemm, a: &DevF32, b: &DevF32) -> Result<()> {
        g.check(a.len, b.len, c.len)?;
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (1f32, if g.accumulate { 1f32 } else { 0f32 });
        let dims = [g.m, g.n, g.k, g.a.ld.max(1), g.b.ld.max(1), g.ldc.max(1)]
            .map(|v| int("gemm", v))
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        self.bind("gemm")?;
        let timed = self.time_start()?;
        let handle = self.device.cublas_handle();
        let f32_type = blas_sys::cudaDataType::CUDA_R_32F;
        // SAFETY: `check` proved every element the call touches lies inside its buffer;
        // the handle runs on the kernels' stream; α and β outlive the (enqueued) call,
        // which reads them at once (host pointer mode).
        unsafe {
            blas::gemm_ex(
                *handle.handle(),
                op(g.a.trans),
                op(g.b.trans),
                dims[0],
                dims[1],
                dims[2],
                (&alpha as *const f32).cast::<c_void>(),
                a.at(g.a.offset) as *const c_void,
                f32_type,
                dims[3],
                b.at(g.b.offset) as *const c_void,
                f32_type,
                dims[4],
                (&beta as *const f32).cast::<c_void>(),
                c.at(g.c_offset) as *mut c_void,
                f32_type,
                dims[5],
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| fail("gemm", e))?;
        self.time_end(timed, || product_name(g, None))
    }

    fn gemm_epilogue(
        &self,
        c: &mut DevF32,
        g: &Gemm,
        (a, b): (&DevF32, &DevF32),
        epilogue: Epilogue<'_, Self>,
    ) -> Result<()> {
        let kind = epilogue.kind();
        if !self.epilogues || !g.lt_serves(kind) || g.m == 0 || g.n == 0 || g.k == 0 {
            return composed_epilogue(self, c, g, (a, b), epilogue);
        }
        epilogue.check(self, g, (c, a, b))?;
        let lt = lt::Lt::of(&self.device)?;
        self.bind("gemm")?;
        // The bias gradient is written by the product, then added into `db`.
        let partial = match kind {
            EpilogueKind::BiasGrad => Some(self.scratch(g.m)?),
            _ => None,
        };
        let (vector, aux) = match &epilogue {
            Epilogue::Bias { bias } => (Some(bias.ptr), None),
            Epilogue::BiasGelu { bias, pre } => (Some(bias.ptr), Some(pre.ptr)),
            Epilogue::Dgelu { pre } => (None, Some(pre.ptr)),
            Epilogue::BiasGrad { .. } => (partial.as_ref().map(|p| p.ptr), None),
        };
        let pointers = lt::Pointers {
            a: a.at(g.a.offset),
            b: b.at(g.b.offset),
            c: c.at(g.c_offset),
            vector,
            aux,
        };
        let timed = self.time_start()?;
        // SAFETY: `check` proved every element the call touches lies inside its buffer
        // (the vector and `pre` included); the buffers outlive the enqueued call (the
        // pass's, or the scratch, which nothing else uses before `column_finish` below).
        let outcome = unsafe { lt.matmul(&self.device, g, kind, pointers) }?;
        if let lt::Outcome::Refused(why) = outcome {
            if lt.first_refusal(kind) {
                tracing::warn!("step_epilogues: {why}; such products run composed");
            }
            drop(partial);
            return composed_epilogue(self, c, g, (a, b), epilogue);
        }
        self.time_end(timed, || product_name(g, Some(kind)))?;
        if let (Epilogue::BiasGrad { db }, Some(partial)) = (epilogue, partial) {
            let (one, n) = (1i32, int("bias grad", g.m)?);
            launch!(
                self,
                "column_finish",
                elementwise(g.m)?,
                &db.ptr,
                &partial.ptr,
                &one,
                &n
            )?;
        }
        Ok(())
    }

    fn broadcast_rows(&self, out: &mut DevF32, bias: &DevF32) -> Result<()> {
        if out.len == 0 {
            return Ok(());
        }
        let n = bias.len;
        if n == 0 || !out.len.is_multiple_of(n) {
            return Err(fail("broadcast_rows", "not whole rows of the bias"));
        }
        let (r, n) = (
            int("broadcast_rows", out.len / n)?,
            int("broadcast_rows", n)?,
        );
        launch!(
            self,
            "broadcast_rows",
            elementwise(out.len)?,
            &out.ptr,
            &bias.ptr,
            &r,
            &n
        )
    }

    fn column_sums(&self, acc: &mut DevF32, m: &DevF32) -> Result<()> {
        let n = acc.len;
        if n == 0 || m.len == 0 {
            return Ok(());
        }
        if !m.len.is_multiple_of(n) {
            return Err(fail("column_sums", "not whole rows"));
        }
        let rows = m.len / n;
        let (grid, k) = launch::column_partials(rows, n)?;
        let partial = self.scratch(k * n)?;
        let (ri, ni, ki) = (
            int("column_sums", rows)?,
            int("column_sums", n)?,
            int("column_sums", k)?,
        );
        launch!(
            self,
            "column_partials",
            config(grid),
            &m.ptr,
            &partial.ptr,
            &ri,
            &ni
        )?;
        launch!(
            self,
            "column_finish",
            elementwise(n)?,
            &acc.ptr,
            &partial.ptr,
            &ki,
            &ni
        )
    }

    fn add(&self, out: &mut DevF32, a: &DevF32, b: &DevF32) -> Result<()> {
        if out.len != a.len || out.len != b.len {
            return Err(fail("add", "lengths differ"));
        }
        if out.len == 0 {
            return Ok(());
        }
        let n = int("add", out.len)?;
        launch!(
            self,
            "add",
            elementwise(out.len)?,
            &out.ptr,
            &a.ptr,
            &b.ptr,
            &n
        )
    }

    fn embedding_forward(
        &self,
        out: &mut DevF32,
        rows: &CudaRows,
        wte: &DevF32,
        wpe: &DevF32,
    ) -> Result<()> {
        if rows.rows == 0 {
            return Ok(());
        }
        let e = out.len / rows.rows;
        let (r, ei) = (int("embedding", rows.rows)?, int("embedding", e)?);
        let (ids, pos) = (self.ptr(&rows.ids), self.ptr(&rows.positions));
        launch!(
            self,
            "embedding_fwd",
            elementwise(out.len)?,
            &out.ptr,
            &ids,
            &pos,
            &wte.ptr,
            &wpe.ptr,
            &r,
            &ei
        )
    }

    fn embedding_backward(
        &self,
        dwte: &mut DevF32,
        dwpe: &mut DevF32,
        dout: &DevF32,
        rows: &CudaRows,
    ) -> Result<()> {
        if rows.rows == 0 {
            return Ok(());
        }
        let e = dout.len / rows.rows;
        self.scatter(dwte, dout, &rows.by_token, e)?;
        self.scatter(dwpe, dout, &rows.by_position, e)
    }

    fn layernorm_forward(
        &self,
        out: &mut DevF32,
        mean: &mut DevF32,
        rstd: &mut DevF32,
        x: &DevF32,
        w: &DevF32,
        b: &DevF32,
        eps: f32,
    ) -> Result<()> {
        let rows = mean.len;
        if rows == 0 {
            return Ok(());
        }
        let (m, e) = (int("layer_norm", rows)?, int("layer_norm", w.len)?);
        launch!(
            self,
            "pass_layer_norm_fwd",
            warps(rows)?,
            &out.ptr,
            &mean.ptr,
            &rstd.ptr,
            &x.ptr,
            &w.ptr,
            &b.ptr,
            &m,
            &e,
            &eps
        )
    }

    fn layernorm_backward(
        &self,
        dx: &mut DevF32,
        dw: &mut DevF32,
        db: &mut DevF32,
        dout: &DevF32,
        x: &DevF32,
        mean: &DevF32,
        rstd: &DevF32,
        w: &DevF32,
    ) -> Result<()> {
        let rows = mean.len;
        if rows == 0 {
            return Ok(());
        }
        let e = w.len;
        let (m, ei) = (int("layer_norm", rows)?, int("layer_norm", e)?);
        launch!(
            self,
            "pass_layer_norm_dx",
            warps(rows)?,
            &dx.ptr,
            &dout.ptr,
            &x.ptr,
            &mean.ptr,
            &rstd.ptr,
            &w.ptr,
            &m,
            &ei
        )?;
        let (grid, k) = launch::layer_norm_partials(rows)?;
        let ki = int("layer_norm", k)?;
        let partial = self.scratch(k * 2 * e)?;
        launch!(
            self,
            "layer_norm_partials",
            config(grid),
            &partial.ptr,
            &dout.ptr,
            &x.ptr,
            &mean.ptr,
            &rstd.ptr,
            &m,
            &ei
        )?;
        launch!(
            self,
            "layer_norm_finish",
            elementwise(e)?,
            &dw.ptr,
            &db.ptr,
            &partial.ptr,
            &ki,
            &ei
        )
    }

    fn gelu_forward(&self, out: &mut DevF32, x: &DevF32) -> Result<()> {
        if x.len == 0 {
            return Ok(());
        }
        let n = int("gelu", x.len)?;
        launch!(self, "gelu_fwd", elementwise(x.len)?, &out.ptr, &x.ptr, &n)
    }

    fn gelu_backward(&self, d: &mut DevF32, x: &DevF32) -> Result<()> {
        if x.len == 0 {
            return Ok(());
        }
        let n = int("gelu", x.len)?;
        launch!(self, "gelu_bwd", elementwise(x.len)?, &d.ptr, &x.ptr, &n)
    }

    fn attention_forward(
        &self,
        out: &mut DevF32,
        state: &mut DevF32,
        qkv: &DevF32,
        rows: &CudaRows,
        heads: Heads,
    ) -> Result<()> {
        self.attention_fwd(out, state, qkv, rows, heads)
    }

    fn attention_backward(
        &self,
        dqkv: &mut DevF32,
        dout: &DevF32,
        out: &DevF32,
        qkv: &DevF32,
        state: &DevF32,
        rows: &CudaRows,
        heads: Heads,
    ) -> Result<()> {
        self.attention_bwd(dqkv, (dout, out, qkv, state), rows, heads)
    }

    fn gather_rows(&self, out: &mut DevF32, x: &DevF32, rows: &CudaRows) -> Result<()> {
        if rows.predicted == 0 {
            return Ok(());
        }
        let e = out.len / rows.predicted;
        let (n, ei) = (int("gather", rows.predicted)?, int("gather", e)?);
        let at = self.ptr(&rows.head_rows);
        launch!(
            self,
            "gather_rows",
            elementwise(out.len)?,
            &out.ptr,
            &x.ptr,
            &at,
            &n,
            &ei
        )
    }

    fn scatter_add_rows(&self, dst: &mut DevF32, src: &DevF32, rows: &CudaRows) -> Result<()> {
        if rows.predicted == 0 {
            return Ok(());
        }
        self.scatter(dst, src, &rows.by_head_row, src.len / rows.predicted)
    }

    fn head_forward(&self, f: HeadForward<'_, Self>, rows: &CudaRows) -> Result<()> {
        if self.kept_head && f.keep {
            self.head_forward_kept(f, rows)
        } else {
            self.head_forward_blocks(f, rows)
        }
    }

    fn head_backward(&self, b: HeadBackward<'_, Self>, rows: &CudaRows) -> Result<()> {
        let v = b.head.len / b.e.max(1);
        let kept =
            (b.probs.as_ref()).is_some_and(|p| p.len == launch::head_rows_len(b.span.len(), v));
        if self.kept_head && kept {
            self.head_backward_kept(b, rows)
        } else {
            self.head_backward_blocks(b, rows)
        }
    }
}
