//! The decode step as one captured CUDA graph per bucket of rows (the trial family
//! [`Kernel::DecodeGraphs`]): the host's part of a step is one copy of its inputs in, one
//! graph launch and one copy of the sampled tokens out, instead of ~140 launches and
//! ~125 allocations.
//!
//! A graph replays its launches with the arguments they were captured with, so nothing
//! it touches may move and nothing that changes from step to step may be an argument:
//! - the weights stay where the model put them (a push written in place,
//!   [`crate::model_io::refill_in_place`], keeps them there);
//! - the cache's pool and suffix buffers stay put between rebuilds
//!   ([`GroupedCache::rebuilds`]); the graphs are made again after one;
//! - every activation lives in one arena, sized for the largest bucket made so far;
//! - the graphs are captured and launched on a stream of their own, their products on a
//!   cuBLAS handle of their own with its own workspace, so that no other thread's work on
//!   the device's stream is recorded and no product allocates during a capture. The
//!   stream, handle and workspace are made once per GPU and kept for the process
//!   ([`GraphStream`]): a cache rebuild makes the graphs again, not them (destroying a
//!   cuBLAS handle synchronises the whole device);
//! - a step waits for the device's stream, then does everything on the graph stream —
//!   the arena's allocation and zero-fill included — so each piece of its work is ordered
//!   after the one before;
//! - what changes (live rows, cursor, ids, positions, each row's group and first column,
//!   each group's padding: [`GraphLayout`], and the sampler's draws) is read from two
//!   device buffers that the step writes before the launch.
//!
//! A bucket is a power of two of rows ([`crate::grouped::bucket`]): a step of B live rows
//! runs the graph of the smallest bucket that holds them; the rows past B compute on
//! padding and are not read back, and the attention kernel skips them.
//!
//! The sequence is the fused decode step's ([`crate::Gpt2::decode_grouped`] with the
//! fused ops): per layer, the q/k/v product, the split (k and v straight into the cache at
//! the cursor), the attention (`row_attention`: one block per row and head), the output
//! product, residual + layer norm, the MLP's products around bias + GELU, residual + the
//! next layer norm; then the padded head's product and the sampler. Products run in
//! cuBLAS in the weights' dtype with f32 accumulation.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use candle_core::cuda::WrapErr;
use candle_core::cuda::cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use candle_core::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg, sys,
};
use candle_core::{CudaDevice, DType, Device, Storage, Tensor};
use half::bf16;

use super::{ATTENTION_PTX, DECODE_OPS_PTX, SAMPLE_PTX, elementwise, kernel};
use crate::device::PerDevice;
use crate::error::{Error, Result};
use crate::grouped::{GraphLayout, GroupedCache};
use crate::launch::{NORM_THREADS, SAMPLE_THREADS};
use crate::sampling::RowDraw;

/// Every arena buffer starts on this many bytes.
const ALIGN: usize = 256;
/// cuBLAS's workspace for captured products (what NVIDIA advises for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// One layer's weights, as the graph reads them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerWeights<'a> {
    pub ln_1: (&'a Tensor, &'a Tensor),
    pub c_attn: (&'a Tensor, &'a Tensor),    // (E, 3E), (3E)
    pub attn_proj: (&'a Tensor, &'a Tensor), // (E, E), (E)
    pub ln_2: (&'a Tensor, &'a Tensor),
    pub c_fc: (&'a Tensor, &'a Tensor),     // (E, I), (I)
    pub mlp_proj: (&'a Tensor, &'a Tensor), // (I, E), (E)
}

/// What a captured step reads of a model ([`crate::Gpt2::step_weights`]).
#[derive(Debug, Clone)]
pub(crate) struct StepWeights<'a> {
    pub wte: &'a Tensor, // (V, E)
    pub wpe: &'a Tensor, // (P, E)
    pub layers: Vec<LayerWeights<'a>>,
    pub ln_f: (&'a Tensor, &'a Tensor),
    /// The head with zero rows up to V' (V', E).
    pub head: &'a Tensor,
    pub vocab: usize,
    pub heads: usize,
    pub eps: f32,
}

/// A captured graph, kept with the cache that owns it.
struct Graph(CudaGraph);

// SAFETY: a graph's handles belong to its CUDA context, not to a host thread: cudarc binds
// the context before each use, and the cache that holds the graph is used by one thread
// at a time (through `&mut`).
unsafe impl Send for Graph {}

/// Device addresses of one layer's weights and cache buffers.
#[derive(Debug, Clone, Copy)]
struct LayerAt {
    ln_1: (u64, u64),
    c_attn: (u64, u64),
    attn_proj: (u64, u64),
    ln_2: (u64, u64),
    c_fc: (u64, u64),
    mlp_proj: (u64, u64),
    pk: u64,
    pv: u64,
    sk: u64,
    sv: u64,
}

/// Sizes a step's launches are made with.
#[derive(Debug, Clone, Copy)]
struct Dims {
    e: usize,
    heads: usize,
    inner: usize,
    vocab: usize,
    /// The padded head's rows V'.
    padded: usize,
    /// Pool columns L and suffix columns C of the cache.
    pool_len: usize,
    suffix_cols: usize,
    /// Groups the pool holds (the inputs' pads), rows the suffix holds.
    groups: usize,
    suffix_rows: usize,
    eps: f32,
}

/// The kernels a step launches, loaded before any capture.
struct Functions {
    embed: CudaFunction,
    add_norm: CudaFunction,
    split: CudaFunction,
    split_step: CudaFunction,
    gelu: CudaFunction,
    attention: CudaFunction,
    sample: CudaFunction,
}

/// Fixed buffers of a step for up to `rows` rows: one allocation of activations, the
/// inputs, the draws and the sampled rows.
struct Arena {
    rows: usize,
    bytes: CudaSlice<u8>,
    /// Where the logits start in `bytes`.
    logits_offset: usize,
    inputs: CudaSlice<u32>,
    draws: CudaSlice<f64>,
    out: CudaSlice<u32>,
    /// Addresses: token and position embeddings (R, E); two residual buffers (2, R, E)
    /// each (the sum, then its norm); q/k/v (R, 3E); q and the attention's output (R,
    /// E); a product's output (R, E); the MLP's (R, I) twice; the logits (R, V'); E
    /// zeros.
    tok: u64,
    pos: u64,
    residual: [u64; 2],
    qkv: u64,
    q: u64,
    att: u64,
    y: u64,
    fc: u64,
    act: u64,
    logits: u64,
    zero: u64,
    inputs_at: u64,
    draws_at: u64,
    out_at: u64,
}

/// The stream the graphs of one GPU are captured and launched on, and the cuBLAS handle
/// and workspace of their products: made by the first captured step on the GPU and kept
/// for the process ([`GraphStream::of`]), every rebuild's graphs using the same.
struct GraphStream {
    /// Their own stream, so that no other thread's work on the device's stream (a weight
    /// version being built) is recorded into a capture. Each step waits for the device's
    /// stream first.
    stream: Arc<CudaStream>,
    /// A cuBLAS handle on that stream, with a workspace of its own (so that no product
    /// allocates while a graph is captured).
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
    /// Held for the whole of a step (or a read of its logits): two caches' steps on one
    /// GPU take turns on the stream, and one capture never records another's launches.
    busy: Mutex<()>,
}

impl GraphStream {
    /// The graph stream of `device`'s GPU (its context's ordinal), made on first use.
    fn of(device: &CudaDevice) -> Result<Arc<GraphStream>> {
        static MADE: PerDevice<usize, GraphStream> = PerDevice::new();
        let context = device.cuda_stream().context().clone();
        MADE.get_or_try_make(context.ordinal(), || Self::new(&context))
    }

    fn new(context: &Arc<CudaContext>) -> Result<Self> {
        let stream = context.new_stream().w()?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| fail(format!("cuBLAS: {e:?}")))?;
        let workspace = stream.alloc_zeros::<u8>(WORKSPACE_BYTES).w()?;
        let at = workspace.device_ptr(&stream).0;
        // SAFETY: the workspace is WORKSPACE_BYTES of device memory on the handle's device,
        // kept as long as the handle (both fields of this struct).
        let status = unsafe {
            blas_sys::cublasSetWorkspace_v2(*blas.handle(), at as *mut c_void, WORKSPACE_BYTES)
        };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(fail(format!("cublasSetWorkspace: {status:?}")));
        }
        Ok(Self {
            stream,
            blas,
            _workspace: workspace,
            busy: Mutex::new(()),
        })
    }

    /// The stream to itself for a step.
    fn take_turn(&self) -> std::sync::MutexGuard<'_, ()> {
        self.busy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The captured decode steps over one cache's buffers and one model's weights.
pub struct DecodeGraphs {
    device: CudaDevice,
    /// The GPU's graph stream, handle and workspace (shared, kept for the process).
    shared: Arc<GraphStream>,
    dtype: DType,
    /// The cache's [`GroupedCache::rebuilds`] these were made for.
    rebuilds: u64,
    dims: Dims,
    layers: Vec<LayerAt>,
    wte: u64,
    wpe: u64,
    ln_f: (u64, u64),
    head: u64,
    functions: Functions,
    arena: Option<Arena>,
    graphs: HashMap<usize, Graph>,
    /// Tensors whose memory the graphs read (kept alive with them).
    _held: Vec<Tensor>,
}

impl std::fmt::Debug for DecodeGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraphs")
            .field("rebuilds", &self.rebuilds)
            .field("buckets", &self.graphs.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Drop for DecodeGraphs {
    /// The arena is freed on the graph stream (where it was made) and the graphs with it,
    /// in its turn: a free enqueued while another cache's step captures there would be
    /// recorded into that graph.
    fn drop(&mut self) {
        let shared = self.shared.clone();
        let _turn = shared.take_turn();
        self.graphs.clear();
        self.arena = None;
    }
}

fn fail(what: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("decode graph: {what}"))
}

/// The device address of a contiguous CUDA tensor's first element.
fn address(t: &Tensor, device: &CudaDevice) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err(fail("a buffer is not on the GPU"));
    };
    let Some((start, _)) = layout.contiguous_offsets() else {
        return Err(fail("a buffer is not contiguous"));
    };
    let stream = device.cuda_stream();
    let base = match t.dtype() {
        DType::F32 => cuda.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::BF16 => cuda.as_cuda_slice::<bf16>()?.device_ptr(&stream).0,
        other => return Err(fail(format!("a buffer in {other:?}"))),
    };
    Ok(base + (start * t.dtype().size_in_bytes()) as u64)
}

fn pair(p: (&Tensor, &Tensor), device: &CudaDevice) -> Result<(u64, u64)> {
    Ok((address(p.0, device)?, address(p.1, device)?))
}

fn int(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| fail(format!("{v} does not fit a kernel's int")))
}

impl DecodeGraphs {
    /// Whether a captured step applies to a model in `dtype` with `heads` heads of
    /// `head_dim`: f32 or BF16, and the head dim's 16-byte pieces a power of two up to a
    /// warp (what `row_attention` holds).
    pub(crate) fn applies(dtype: DType, head_dim: usize) -> bool {
        matches!(dtype, DType::F32 | DType::BF16)
            && crate::launch::vectorised_heads(dtype.size_in_bytes(), head_dim)
    }

    /// The graphs of `cache` as it is now and of `weights` (none captured yet): the
    /// addresses of every buffer they read.
    fn new(weights: &StepWeights, cache: &GroupedCache) -> Result<Self> {
        let Device::Cuda(device) = weights.wte.device() else {
            return Err(fail("the model is not on a CUDA device"));
        };
        let device = device.clone();
        let dtype = weights.wte.dtype();
        let buffers = cache
            .buffers()
            .ok_or_else(|| fail("the cache has no buffers yet"))?;
        if buffers.len() != weights.layers.len() {
            return Err(fail("the cache and the model differ in layers"));
        }
        let mut held: Vec<Tensor> = vec![weights.wte.clone(), weights.wpe.clone()];
        let mut layers = Vec::with_capacity(buffers.len());
        for (w, [pk, pv, sk, sv]) in weights.layers.iter().zip(&buffers) {
            for t in [w.ln_1, w.c_attn, w.attn_proj, w.ln_2, w.c_fc, w.mlp_proj] {
                held.extend([t.0.clone(), t.1.clone()]);
            }
            held.extend([(*pk).clone(), (*pv).clone(), (*sk).clone(), (*sv).clone()]);
            layers.push(LayerAt {
                ln_1: pair(w.ln_1, &device)?,
                c_attn: pair(w.c_attn, &device)?,
                attn_proj: pair(w.attn_proj, &device)?,
                ln_2: pair(w.ln_2, &device)?,
                c_fc: pair(w.c_fc, &device)?,
                mlp_proj: pair(w.mlp_proj, &device)?,
                pk: address(pk, &device)?,
                pv: address(pv, &device)?,
                sk: address(sk, &device)?,
                sv: address(sv, &device)?,
            });
        }
        held.extend([
            weights.ln_f.0.clone(),
            weights.ln_f.1.clone(),
            weights.head.clone(),
        ]);
        let [pk, _, sk, _] = buffers[0];
        let (groups, _, pool_len, _) = pk.dims4()?;
        let (suffix_rows, _, suffix_cols, _) = sk.dims4()?;
        // row_attention's 16-byte loads start on every row of D elements of the cache.
        for l in &layers {
            if [l.pk, l.pv, l.sk, l.sv].iter().any(|a| a % 16 != 0) {
                return Err(fail("a cache buffer is not 16-byte aligned"));
            }
        }
        let (padded, e) = weights.head.dims2()?;
        let inner = weights.layers[0].c_fc.0.dim(1)?;
        if held.iter().any(|t| t.dtype() != dtype) {
            return Err(fail("the weights and the cache differ in dtype"));
        }
        let load = |base: &str, module: &str, ptx: &'static str| -> Result<CudaFunction> {
            Ok(device
                .get_or_load_custom_func(&kernel(base, dtype)?, module, ptx)?
                .into_cuda_function())
        };
        let functions = Functions {
            embed: load("embed_rows", "rookworld_decode_ops", DECODE_OPS_PTX)?,
            add_norm: load("add_layer_norm", "rookworld_decode_ops", DECODE_OPS_PTX)?,
            split: load("qkv_split", "rookworld_decode_ops", DECODE_OPS_PTX)?,
            split_step: load("qkv_split_step", "rookworld_decode_ops", DECODE_OPS_PTX)?,
            gelu: load("bias_gelu", "rookworld_decode_ops", DECODE_OPS_PTX)?,
            attention: load(
                "row_attention",
                "rookworld_grouped_attention",
                ATTENTION_PTX,
            )?,
            sample: load("sample_rows", "rookworld_sample", SAMPLE_PTX)?,
        };
        Ok(Self {
            shared: GraphStream::of(&device)?,
            wte: address(weights.wte, &device)?,
            wpe: address(weights.wpe, &device)?,
            ln_f: pair(weights.ln_f, &device)?,
            head: address(weights.head, &device)?,
            device,
            dtype,
            rebuilds: cache.rebuilds(),
            dims: Dims {
                e,
                heads: weights.heads,
                inner,
                vocab: weights.vocab,
                padded,
                pool_len,
                suffix_cols,
                groups,
                suffix_rows,
                eps: weights.eps,
            },
            layers,
            functions,
            arena: None,
            graphs: HashMap::new(),
            _held: held,
        })
    }

    /// The arena for `rows` rows, made (and every graph dropped) when the one held is
    /// smaller.
    fn arena_for(&mut self, rows: usize) -> Result<&Arena> {
        if self.arena.as_ref().is_none_or(|a| a.rows < rows) {
            self.graphs.clear();
            self.arena = None;
            self.arena = Some(self.make_arena(rows)?);
        }
        Ok(self.arena.as_ref().expect("made above"))
    }

    /// The arena for `rows` rows, allocated and zeroed on the graph stream: ordered after
    /// the step's wait for the device's stream and before the step's copies and launches,
    /// and freed there too when replaced.
    fn make_arena(&self, rows: usize) -> Result<Arena> {
        let Dims {
            e, inner, padded, ..
        } = self.dims;
        let size = self.dtype.size_in_bytes();
        // Element counts of tok, pos, residual ×2, qkv, q, att, y, fc, act, logits, zero.
        let counts = [
            rows * e,
            rows * e,
            2 * rows * e,
            2 * rows * e,
            3 * rows * e,
            rows * e,
            rows * e,
            rows * e,
            rows * inner,
            rows * inner,
            rows * padded,
            e,
        ];
        let mut offsets = Vec::with_capacity(counts.len());
        let mut total = 0;
        for n in counts {
            offsets.push(total);
            total += (n * size).next_multiple_of(ALIGN);
        }
        let stream = &self.shared.stream;
        let bytes = stream.alloc_zeros::<u8>(total).w()?;
        let layout = GraphLayout { bucket: rows };
        let inputs = stream
            .alloc_zeros::<u32>(layout.len(self.dims.groups))
            .w()?;
        let draws = stream.alloc_zeros::<f64>(4 * rows).w()?;
        let out = stream.alloc_zeros::<u32>(3 * rows).w()?;
        let base = bytes.device_ptr(stream).0;
        let inputs_at = inputs.device_ptr(stream).0;
        let draws_at = draws.device_ptr(stream).0;
        let out_at = out.device_ptr(stream).0;
        let at = |i: usize| base + offsets[i] as u64;
        Ok(Arena {
            rows,
            tok: at(0),
            pos: at(1),
            residual: [at(2), at(3)],
            qkv: at(4),
            q: at(5),
            att: at(6),
            y: at(7),
            fc: at(8),
            act: at(9),
            logits: at(10),
            zero: at(11),
            inputs_at,
            draws_at,
            out_at,
            logits_offset: offsets[10],
            bytes,
            inputs,
            draws,
            out,
        })
    }

    /// Runs one step of the live rows of `cache` feeding `ids`, row r drawing with
    /// `draws[r]`, and counts it: the sampler's output for the step's bucket of B rows
    /// (3·B: tokens, log-probability bits, status; [`super::sample::sampled`] reads it).
    /// The graphs are made again when the cache has been rebuilt since, a bucket's graph
    /// on its first step (after one run of the same launches uncaptured).
    pub(crate) fn step(
        slot: &mut Option<DecodeGraphs>,
        weights: &StepWeights,
        cache: &mut GroupedCache,
        ids: &[u32],
        draws: &[RowDraw],
    ) -> Result<Vec<u32>> {
        if draws.len() != ids.len() {
            return Err(Error::InvalidArgument(format!(
                "{} draws for {} ids",
                draws.len(),
                ids.len()
            )));
        }
        let (layout, inputs) = cache.graph_step_inputs(ids)?;
        if slot.as_ref().is_none_or(|g| g.rebuilds != cache.rebuilds()) {
            // The old graphs and arena go (in their turn on the graph stream, before this
            // step takes its own); the stream, handle and workspace stay.
            *slot = None;
            *slot = Some(Self::new(weights, cache)?);
        }
        let graphs = slot.as_mut().expect("made above");
        let bucket = layout.bucket;
        if bucket > graphs.dims.suffix_rows {
            // The split writes every row of the bucket into the cache.
            return Err(fail(format!(
                "a bucket of {bucket} rows over a cache of {} rows",
                graphs.dims.suffix_rows
            )));
        }
        let mut packed = Vec::with_capacity(4 * bucket);
        for d in draws {
            packed.extend([
                f64::from(d.temperature),
                f64::from(d.top_k),
                f64::from(d.top_p),
                d.uniform,
            ]);
        }
        // Padding rows draw greedily (their tokens are not read).
        while packed.len() < 4 * bucket {
            packed.extend([0.0, 0.0, 1.0, 0.5]);
        }
        let shared = graphs.shared.clone();
        let _turn = shared.take_turn();
        let stream = &shared.stream;
        // After everything the device's stream holds (the prefill, the cache's moves);
        // from here on every piece of the step is on the graph stream, in order.
        stream.join(&graphs.device.cuda_stream()).w()?;
        graphs.arena_for(bucket)?;
        let arena = graphs.arena.as_mut().expect("made above");
        stream
            .memcpy_htod(&inputs, &mut arena.inputs.slice_mut(..inputs.len()))
            .w()?;
        stream.memcpy_htod(&packed, &mut arena.draws).w()?;
        if !graphs.graphs.contains_key(&bucket) {
            // Run once uncaptured (a launch error shows here, and first uses stay out of
            // the graph); the graph then computes the same again.
            graphs.enqueue(layout)?;
            let graph = graphs.capture(layout)?;
            graphs.graphs.insert(bucket, graph);
        }
        graphs.graphs[&bucket].0.launch().w()?;
        let arena = graphs.arena.as_ref().expect("made above");
        let mut out = vec![0u32; 3 * bucket];
        stream
            .memcpy_dtoh(&arena.out.slice(..3 * bucket), &mut out)
            .w()?;
        stream.synchronize().w()?;
        cache.finish_step();
        Ok(out)
    }

    /// The logits (the first V of each row) of the first `rows` rows of the last step, in
    /// f32: what the start-up check compares.
    pub(crate) fn logits(&self, rows: usize) -> Result<Vec<Vec<f32>>> {
        let arena = self.arena.as_ref().ok_or_else(|| fail("no step has run"))?;
        let (padded, vocab) = (self.dims.padded, self.dims.vocab);
        let size = self.dtype.size_in_bytes();
        let start = arena.logits_offset;
        let _turn = self.shared.take_turn();
        let bytes = self
            .shared
            .stream
            .clone_dtoh(&arena.bytes.slice(start..start + rows * padded * size))
            .w()?;
        let values: Vec<f32> = match self.dtype {
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        };
        Ok(values
            .chunks(padded)
            .map(|row| row[..vocab].to_vec())
            .collect())
    }

    /// Captures the step of one bucket's rows on the graph stream.
    fn capture(&self, layout: GraphLayout) -> Result<Graph> {
        let stream = &self.shared.stream;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let enqueued = self.enqueue(layout);
        // The capture ends whatever the launches did, so the stream is usable again.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).w();
        enqueued?;
        let graph = graph?.ok_or_else(|| fail("the capture recorded nothing"))?;
        graph.upload().w()?;
        Ok(Graph(graph))
    }

    /// Launches one step of `layout.bucket` rows (what a capture records).
    fn enqueue(&self, layout: GraphLayout) -> Result<()> {
        let arena = self.arena.as_ref().expect("made before a capture");
        let Dims {
            e,
            heads,
            inner,
            vocab,
            padded,
            pool_len,
            suffix_cols,
            ..
        } = self.dims;
        let rows = layout.bucket;
        let size = self.dtype.size_in_bytes() as u64;
        let input = |at: usize| arena.inputs_at + 4 * at as u64;
        let step = input(0);
        let (r, e_, h, d) = (int(rows)?, int(e)?, int(heads)?, int(e / heads)?);
        // The residual buffers' halves: the sum, then its norm.
        let sum = |buf: u64| buf;
        let norm = |buf: u64| buf + (rows * e) as u64 * size;

        // x = wte[ids] + wpe[positions]; h = ln_1(x) of the first layer.
        let mut b = self.shared.stream.launch_builder(&self.functions.embed);
        let (ids, positions) = (input(layout.ids()), input(layout.positions()));
        b.arg(&self.wte).arg(&self.wpe).arg(&ids).arg(&positions);
        b.arg(&arena.tok).arg(&arena.pos).arg(&r).arg(&e_);
        // SAFETY: (wte, wpe, ids, positions, tok, pos, B, E): every id below V and position
        // below P (the engine's checks), B·E elements of tok and pos.
        unsafe { b.launch(elementwise(rows * e)) }.w()?;
        let mut cur = 0;
        let first = self
            .layers
            .first()
            .ok_or_else(|| fail("a model with no layer"))?;
        self.add_norm(
            (arena.tok, arena.pos, arena.zero),
            first.ln_1,
            arena.residual[cur],
            rows,
        )?;

        for (i, l) in self.layers.iter().enumerate() {
            let x = arena.residual[cur];
            self.linear(norm(x), rows, e, l.c_attn.0, 3 * e, arena.qkv)?;
            // q into its own (B, H, 1, D); k and v into the cache at the cursor.
            let (zero_col, one_col) = (0i32, 1i32);
            let mut b = self.shared.stream.launch_builder(&self.functions.split);
            let part = 0i32;
            b.arg(&arena.qkv).arg(&l.c_attn.1).arg(&arena.q).arg(&part);
            b.arg(&r).arg(&h).arg(&d).arg(&one_col).arg(&zero_col);
            // SAFETY: (qkv, bias, dst, part, B, H, D, C, col): B·E elements of dst.
            unsafe { b.launch(elementwise(rows * e)) }.w()?;
            let c = int(suffix_cols)?;
            for (part, dst) in [(1i32, l.sk), (2i32, l.sv)] {
                let mut b = self
                    .shared
                    .stream
                    .launch_builder(&self.functions.split_step);
                b.arg(&arena.qkv).arg(&l.c_attn.1).arg(&dst).arg(&part);
                b.arg(&r).arg(&h).arg(&d).arg(&c).arg(&step);
                // SAFETY: (qkv, bias, dst, part, B, H, D, C, step): rows < B of the cache's
                // column step[1] < C; the cache holds at least B rows (its capacity is a
                // power of two at least the live rows, as the bucket is).
                unsafe { b.launch(elementwise(rows * e)) }.w()?;
            }
            let (groups, starts, pads) = (
                input(layout.row_group()),
                input(layout.row_start()),
                input(layout.group_pad()),
            );
            let (l_, scale) = (int(pool_len)?, 1.0 / ((e / heads) as f32).sqrt());
            let mut b = self.shared.stream.launch_builder(&self.functions.attention);
            b.arg(&arena.q).arg(&l.pk).arg(&l.pv).arg(&l.sk).arg(&l.sv);
            b.arg(&step)
                .arg(&groups)
                .arg(&starts)
                .arg(&pads)
                .arg(&arena.att);
            b.arg(&h).arg(&d).arg(&l_).arg(&c).arg(&scale);
            let grid = crate::launch::row_attention_grid(rows, heads);
            let cfg = LaunchConfig {
                grid_dim: grid.grid,
                block_dim: grid.block,
                shared_mem_bytes: grid.shared_bytes,
            };
            // SAFETY: (q, pk, pv, sk, sv, step, row_group, row_start, group_pad, out, H, D,
            // L, C, scale): a block per (row, head); rows past step[0] leave; the others
            // read their group's pool row and their suffix row up to the cursor, 16-byte
            // loads on 256-byte aligned buffers with rows of D elements.
            unsafe { b.launch(cfg) }.w()?;
            self.linear(arena.att, rows, e, l.attn_proj.0, e, arena.y)?;
            self.add_norm(
                (sum(x), arena.y, l.attn_proj.1),
                l.ln_2,
                arena.residual[1 - cur],
                rows,
            )?;
            cur = 1 - cur;
            let x = arena.residual[cur];
            self.linear(norm(x), rows, e, l.c_fc.0, inner, arena.fc)?;
            let (m, n) = (r, int(inner)?);
            let mut b = self.shared.stream.launch_builder(&self.functions.gelu);
            b.arg(&arena.fc)
                .arg(&l.c_fc.1)
                .arg(&arena.act)
                .arg(&m)
                .arg(&n);
            // SAFETY: (x, bias, out, M, N) over M·N elements.
            unsafe { b.launch(elementwise(rows * inner)) }.w()?;
            self.linear(arena.act, rows, inner, l.mlp_proj.0, e, arena.y)?;
            let next = self.layers.get(i + 1).map_or(self.ln_f, |n| n.ln_1);
            self.add_norm(
                (sum(x), arena.y, l.mlp_proj.1),
                next,
                arena.residual[1 - cur],
                rows,
            )?;
            cur = 1 - cur;
        }

        // logits (B, V') = h · headᵀ; then each row's draw.
        let hidden = norm(arena.residual[cur]);
        self.gemm(
            (padded, rows, e),
            (self.head, e, true),
            (hidden, e),
            (arena.logits, padded),
        )?;
        let (v, ld) = (int(vocab)?, padded as i64);
        let mut b = self.shared.stream.launch_builder(&self.functions.sample);
        b.arg(&arena.logits)
            .arg(&v)
            .arg(&ld)
            .arg(&arena.draws_at)
            .arg(&arena.out_at);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (logits, V, ld, draws, out): block r reads row r's V logits, ld apart,
        // and its 4 draws, and writes element r of each third of out (3·B).
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// `out` (2, B, E) = (s, layer_norm(s)) for s = x + (y + c), `(x, y, c)`, with the
    /// norm's `(weight, bias)`.
    fn add_norm(
        &self,
        (x, y, c): (u64, u64, u64),
        (w, b): (u64, u64),
        out: u64,
        rows: usize,
    ) -> Result<()> {
        let (m, e) = (int(rows)?, int(self.dims.e)?);
        let eps = self.dims.eps;
        let mut builder = self.shared.stream.launch_builder(&self.functions.add_norm);
        builder.arg(&x).arg(&y).arg(&c).arg(&w).arg(&b).arg(&out);
        builder.arg(&m).arg(&e).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: ((self.dims.e + 32) * 4) as u32,
        };
        // SAFETY: (x, y, c, w, b, out, M, E, eps): block r reads row r of x and y and
        // writes row r of both halves of out, which is neither; shared memory E + 32
        // floats.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }

    /// Row-major `out (B, N) = x (B, K) · w (K, N)`.
    fn linear(&self, x: u64, rows: usize, k: usize, w: u64, n: usize, out: u64) -> Result<()> {
        self.gemm((n, rows, k), (w, n, false), (x, k), (out, n))
    }

    /// cuBLAS's column-major `C (m × n) = op(A) (m × k) · B (k × n)`, A and B, C in the
    /// weights' dtype, f32 accumulation; `(A, lda, transposed)`, `(B, ldb)`, `(C, ldc)`.
    fn gemm(
        &self,
        (m, n, k): (usize, usize, usize),
        (a, lda, trans): (u64, usize, bool),
        (b, ldb): (u64, usize),
        (c, ldc): (u64, usize),
    ) -> Result<()> {
        let data = match self.dtype {
            DType::BF16 => blas_sys::cudaDataType::CUDA_R_16BF,
            _ => blas_sys::cudaDataType::CUDA_R_32F,
        };
        let op = if trans {
            blas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas_sys::cublasOperation_t::CUBLAS_OP_N
        };
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: every operand is an arena buffer or a weight of the sizes above; the
        // handle runs on the graphs' stream (the one captured); α and β are read when the
        // call is enqueued (host pointer mode).
        unsafe {
            blas::gemm_ex(
                *self.shared.blas.handle(),
                op,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                int(m)?,
                int(n)?,
                int(k)?,
                (&alpha as *const f32).cast::<c_void>(),
                a as *const c_void,
                data,
                int(lda)?,
                b as *const c_void,
                data,
                int(ldb)?,
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                data,
                int(ldc)?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| fail(format!("cuBLAS: {e:?}")))
    }
}
