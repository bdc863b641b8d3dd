//! The products whose epilogues run inside them ([`crate::backend::Epilogue`], the trial
//! family `step_epilogues`): one `cublasLtMatmul` each, with cuBLAS's maths of
//! [`Backend::gemm`](crate::Backend::gemm) (f32 matrices, BF16 products, f32 sums:
//! `CUBLAS_COMPUTE_32F_FAST_16BF`) and the epilogue named by [`EpilogueKind`]:
//!
//! | kind | cuBLASLt | its vector | its auxiliary matrix |
//! |---|---|---|---|
//! | `Bias` | `BIAS` | the bias, read (m) | — |
//! | `BiasGelu` | `GELU_AUX_BIAS` | the bias, read (m) | `pre`, written, C's layout |
//! | `Dgelu` | `DGELU` | — | `pre`, read, C's layout |
//! | `BiasGrad` | `BGRADA` | the gradient, written (m), then added into `db` | — |
//!
//! cuBLASLt's GELU is the tanh form (`gelu_new`). A call's descriptor and layouts are made,
//! and its algorithm asked of cuBLASLt's heuristic, once per shape, transposes, epilogue
//! and the operands' alignment, and kept ([`Plan`]: a call then only sets its vector's and
//! auxiliary matrix's pointers, where making them took some ten host calls); where it has none (any error of the heuristic's, or
//! `NOT_SUPPORTED`, `INVALID_VALUE` or `ARCH_MISMATCH` from the call itself, which it says
//! before enqueuing anything), the call runs composed ([`crate::backend::composed_epilogue`]) and the first such
//! refusal of each kind is logged.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::CudaDevice;
use candle_core::cuda::cudarc::cublaslt::result::{self as lt, CublasError};
use candle_core::cuda::cudarc::cublaslt::sys;
use candle_core::cuda::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr};
use rookworld_lm::device::PerDevice;

use crate::backend::{Error, Result};
use crate::gemm::{EpilogueKind, Gemm};

/// A cuBLASLt failure, named as the backend's others are.
fn fail(op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Kernel {
        backend: "cuda",
        op,
        message: e.to_string(),
    }
}

/// cuBLASLt's workspace (what NVIDIA advises for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// The device pointers of one call: cuBLAS's A, B and C (C is also D), the epilogue's
/// vector (the bias, or where the bias gradient goes) and its auxiliary matrix (`pre`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Pointers {
    pub a: CUdeviceptr,
    pub b: CUdeviceptr,
    pub c: CUdeviceptr,
    pub vector: Option<CUdeviceptr>,
    pub aux: Option<CUdeviceptr>,
}

/// How a call went.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Enqueued on the stream.
    Ran,
    /// cuBLASLt has no algorithm for it (why); nothing was enqueued.
    Refused(String),
}

/// What the heuristic's answer depends on: the call's shape and transposes, whether it
/// adds into C, its epilogue and its operands' alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    dims: [usize; 6],
    trans: (bool, bool),
    accumulate: bool,
    kind: EpilogueKind,
    /// A, B, C, the vector and the auxiliary matrix (cuBLASLt reads the alignment of the
    /// last two from their pointers when it chooses).
    align: [u32; 5],
}

/// cuBLASLt's handle and workspace for one stream, and the [`Plan`] of each [`Key`] its
/// calls have had. Made once per stream ([`Lt::of`]) and kept for the process.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<Key, Plan>>,
    /// The kinds whose refusal has been logged.
    logged: Mutex<Vec<EpilogueKind>>,
}

// SAFETY: a cuBLASLt handle may be used from any thread (NVIDIA: it is not bound to a
// thread or stream); every call on it here is enqueued on the one stream it was made for,
// whose order makes the workspace's uses take turns. The plans (descriptors and layouts,
// which cuBLASLt reads only while a call is enqueued) are behind a mutex held across it.
unsafe impl Send for Lt {}
// SAFETY: as for `Send`: shared use enqueues on the one stream, and the maps lock.
unsafe impl Sync for Lt {}

impl Lt {
    /// The one of `device`'s stream (made on first use, kept for the process: destroying
    /// a handle synchronises the device).
    pub(super) fn of(device: &CudaDevice) -> Result<Arc<Lt>> {
        static MADE: PerDevice<(usize, usize), Lt> = PerDevice::new();
        let stream = device.cuda_stream();
        let key = (stream.context().ordinal(), stream.cu_stream() as usize);
        MADE.get_or_try_make(key, || {
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| fail("cublaslt", e))?;
            let handle = lt::create_handle().map_err(|e| fail("cublaslt", e))?;
            let workspace = stream
                .alloc_zeros::<u8>(WORKSPACE_BYTES)
                .map_err(|e| fail("cublaslt", e))?;
            Ok(Lt {
                handle,
                workspace,
                plans: Mutex::default(),
                logged: Mutex::default(),
            })
        })
    }

    /// Whether this is the first refusal of `kind` (to be logged).
    pub(super) fn first_refusal(&self, kind: EpilogueKind) -> bool {
        let mut logged = self.logged.lock().unwrap_or_else(PoisonError::into_inner);
        let first = !logged.contains(&kind);
        if first {
            logged.push(kind);
        }
        first
    }

    /// Enqueues `g` with epilogue `kind` on `device`'s stream (its context current), or
    /// says that cuBLASLt has no algorithm for it.
    ///
    /// # Safety
    /// `g` passed [`Gemm::check`] and [`Gemm::check_epilogue`] against the buffers the
    /// pointers start, which stay alive until the call has run on the stream; the vector
    /// and auxiliary matrix are given exactly where `kind` has them.
    pub(super) unsafe fn matmul(
        &self,
        device: &CudaDevice,
        g: &Gemm,
        kind: EpilogueKind,
        p: Pointers,
    ) -> Result<Outcome> {
        // Each kind's vector and auxiliary matrix, exactly (a plan's descriptor keeps the
        // pointers of the last call of its key, which every call of the key sets again).
        let aux = matches!(kind, EpilogueKind::BiasGelu | EpilogueKind::Dgelu);
        if p.vector.is_some() != (kind != EpilogueKind::Dgelu) || p.aux.is_some() != aux {
            return Err(fail(
                "cublaslt",
                format!("epilogue {} given the wrong pointers: {p:?}", kind.name()),
            ));
        }
        let align = [p.a, p.b, p.c, p.vector.unwrap_or(0), p.aux.unwrap_or(0)].map(alignment);
        let key = Key {
            dims: [g.m, g.n, g.k, g.a.ld, g.b.ld, g.ldc],
            trans: (g.a.trans, g.b.trans),
            accumulate: g.accumulate,
            kind,
            align,
        };
        let refused = |status: sys::cublasStatus_t| {
            Outcome::Refused(format!(
                "cuBLASLt refuses a {}×{}×{} product with epilogue {} (f32, \
                 CUBLAS_COMPUTE_32F_FAST_16BF): {status:?}",
                g.m,
                g.n,
                g.k,
                kind.name()
            ))
        };
        // Held until the call is enqueued: its plan's descriptor takes this call's
        // pointers.
        let mut plans = self.plans.lock().unwrap_or_else(PoisonError::into_inner);
        let plan = match plans.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(self.plan(g, kind, p, align)?),
        };
        let algo = match plan.algo {
            Ok(algo) => algo,
            Err(status) => return Ok(refused(status)),
        };
        plan.point(p)?;
        let stream = device.cuda_stream();
        let (alpha, beta) = (1f32, if g.accumulate { 1f32 } else { 0f32 });
        let (workspace, _record) = self.workspace.device_ptr(&stream);
        let at = |ptr: CUdeviceptr| ptr as *const c_void;
        // SAFETY: the caller's contract covers the buffers; the handles, α, β and the
        // algorithm outlive the call (host pointer mode: α and β are read as it is
        // enqueued, as is the descriptor); the workspace is this stream's own.
        let status = unsafe {
            lt::matmul(
                self.handle,
                plan.desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                at(p.a),
                plan.a.0,
                at(p.b),
                plan.b.0,
                at(p.c),
                plan.c.0,
                p.c as *mut c_void,
                plan.c.0,
                &algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| e.0);
        match status {
            Ok(()) => Ok(Outcome::Ran),
            // What cublasLtMatmul says of a configuration it cannot run, before it
            // enqueues anything: the composed form runs it, now and for this key after.
            Err(
                status @ (sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
                | sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE
                | sys::cublasStatus_t::CUBLAS_STATUS_ARCH_MISMATCH),
            ) => {
                plan.algo = Err(status);
                Ok(refused(status))
            }
            Err(status) => Err(fail("cublaslt", CublasError(status))),
        }
    }

    /// The descriptor, layouts and algorithm of the calls of `g` with `kind`, made for
    /// their first (whose pointers the heuristic reads the alignment of).
    fn plan(&self, g: &Gemm, kind: EpilogueKind, p: Pointers, align: [u32; 5]) -> Result<Plan> {
        let desc = Desc::new()?;
        use sys::cublasLtMatmulDescAttributes_t as D;
        let trans = |t: bool| -> i32 { t.into() }; // CUBLAS_OP_T = 1, CUBLAS_OP_N = 0
        desc.set(D::CUBLASLT_MATMUL_DESC_TRANSA, &trans(g.a.trans))?;
        desc.set(D::CUBLASLT_MATMUL_DESC_TRANSB, &trans(g.b.trans))?;
        let epilogue = match kind {
            EpilogueKind::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            EpilogueKind::BiasGelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            EpilogueKind::Dgelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU,
            EpilogueKind::BiasGrad => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADA,
        };
        desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        if matches!(kind, EpilogueKind::BiasGelu | EpilogueKind::Dgelu) {
            // The auxiliary matrix has C's layout ([`Gemm::check_epilogue`]).
            let ld = g.ldc as i64;
            desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld)?;
        }
        // Column-major stored matrices: op(A) is (m × k), op(B) (k × n), C (m × n).
        let stored = |trans: bool, rows: usize, cols: usize| {
            if trans { (cols, rows) } else { (rows, cols) }
        };
        let mut plan = Plan {
            desc,
            a: Layout::new(stored(g.a.trans, g.m, g.k), g.a.ld)?,
            b: Layout::new(stored(g.b.trans, g.k, g.n), g.b.ld)?,
            c: Layout::new((g.m, g.n), g.ldc)?,
            algo: Err(sys::cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED),
        };
        plan.point(p)?;
        let pref = Pref::new([align[0], align[1], align[2]])?;
        // SAFETY: every handle is live (owned by `plan`, `pref` or `self`).
        let found = unsafe {
            lt::get_matmul_algo_heuristic(
                self.handle,
                plan.desc.0,
                plan.a.0,
                plan.b.0,
                plan.c.0,
                plan.c.0,
                pref.0,
            )
        };
        // Any refusal of the heuristic's — NOT_SUPPORTED or no algorithm, but also
        // INVALID_VALUE for a configuration it will not take — is the composed form's to
        // run, not the step's to fail.
        plan.algo = found.map(|h| h.algo).map_err(|e| e.0);
        Ok(plan)
    }
}

/// What the calls of one [`Key`] share: their descriptor (whose vector and auxiliary
/// pointers each call sets), their matrices' layouts, and the heuristic's algorithm (an
/// error status: it had none, or cuBLASLt refused the call).
struct Plan {
    desc: Desc,
    a: Layout,
    b: Layout,
    c: Layout,
    algo: std::result::Result<sys::cublasLtMatmulAlgo_t, sys::cublasStatus_t>,
}

impl Plan {
    /// Points the descriptor at this call's vector and auxiliary matrix.
    fn point(&self, p: Pointers) -> Result<()> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        if let Some(vector) = p.vector {
            self.desc
                .set(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vector)?;
        }
        if let Some(aux) = p.aux {
            self.desc
                .set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux)?;
        }
        Ok(())
    }
}

/// The largest power of two, at most 256, that divides a device address: the alignment
/// the heuristic is told an operand has (its default assumes 256 bytes).
fn alignment(ptr: CUdeviceptr) -> u32 {
    if ptr == 0 {
        256
    } else {
        1u32 << ptr.trailing_zeros().min(8)
    }
}

/// A matmul descriptor (f32 scale, BF16 products with f32 sums), destroyed on drop.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Desc {
    fn new() -> Result<Self> {
        lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map(Self)
        .map_err(|e| fail("cublaslt", e))
    }

    /// Sets attribute `attr` to `value` (the type cuBLASLt documents for it).
    fn set<T>(&self, attr: sys::cublasLtMatmulDescAttributes_t, value: &T) -> Result<()> {
        // SAFETY: the descriptor is live; cuBLASLt copies `size_of::<T>()` bytes from
        // `value`, which the caller types as the attribute's documented type.
        unsafe {
            lt::set_matmul_desc_attribute(
                self.0,
                attr,
                (value as *const T).cast(),
                std::mem::size_of::<T>(),
            )
        }
        .map_err(|e| fail("cublaslt", e))
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: made by `new`, destroyed once; a failure leaks a descriptor.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

/// A column-major f32 matrix layout, destroyed on drop.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    fn new((rows, cols): (usize, usize), ld: usize) -> Result<Self> {
        lt::create_matrix_layout(
            sys::cudaDataType_t::CUDA_R_32F,
            rows as u64,
            cols as u64,
            ld.max(1) as i64,
        )
        .map(Self)
        .map_err(|e| fail("cublaslt", e))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: made by `new`, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

/// The heuristic's preferences: the workspace it may use and the alignment of A, B and
/// C (= D), destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Pref {
    fn new([a, b, c]: [u32; 3]) -> Result<Self> {
        let pref = Self(lt::create_matmul_pref().map_err(|e| fail("cublaslt", e))?);
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let workspace = WORKSPACE_BYTES as u64;
        pref.set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace)?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a)?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b)?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c)?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &c)?;
        Ok(pref)
    }

    fn set<T>(&self, attr: sys::cublasLtMatmulPreferenceAttributes_t, value: &T) -> Result<()> {
        // SAFETY: as `Desc::set`.
        unsafe {
            lt::set_matmul_pref_attribute(
                self.0,
                attr,
                (value as *const T).cast(),
                std::mem::size_of::<T>(),
            )
        }
        .map_err(|e| fail("cublaslt", e))
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: made by `new`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}
