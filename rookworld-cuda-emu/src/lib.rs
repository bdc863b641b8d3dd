//! CUDA kernels run on the CPU, so that CI without a GPU runs the project's `.cu` files
//! and compares them with their CPU references.
//!
//! [`Module::build`] compiles one kernel source (a CUDA module: one `.cu` file) unchanged as
//! C++ against a small runtime (`include/cuda_emu.h`, `include/cuda_bf16.h`,
//! `include/mma.h`: the CUDA that the kernels use, warp matrix products included) into a shared library and loads it; [`Module::launch`] runs one kernel
//! on a grid, its arguments given as `cuLaunchKernel` takes them.
//!
//! How a launch runs: block after block; a block's threads are cooperative fibers that
//! switch only at a barrier (`__syncthreads` for the block, a shuffle or `__syncwarp` for
//! the warp), so every interleaving a barrier allows is one the GPU may pick, and shared
//! memory needs no locks. What the GPU leaves undefined is an [`Error::Kernel`] naming the
//! kernel, block and thread:
//!
//! - a barrier in divergent code (a thread returned, or waits at another barrier, while
//!   others wait at `__syncthreads` or a shuffle);
//! - a shuffle whose mask leaves out a lane of the warp;
//! - an argument whose size is not its parameter's, or a pointer not aligned to its type;
//! - a read or write past the end of a [`Guarded`] buffer, or of the dynamic shared memory
//!   the launch asked for (it faults on the guard page after it).
//!
//! Numbers: the host's `expf`, `logf` and `tanhf` stand for the GPU's, so results match a
//! GPU's to a few ulps, not bit for bit; sums run in the kernel's order.

mod buffer;
mod compare;

pub use buffer::{Element, Guarded};
pub use compare::{Values, assert_close};

use std::ffi::{c_char, c_void};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::process::Command;

/// dlopen's flag that keeps a library mapped after dlclose (glibc's value).
const RTLD_NODELETE: i32 = libc::RTLD_NODELETE;

const RUNTIME: &str = include_str!("../include/cuda_emu.h");
const BF16: &str = include_str!("../include/cuda_bf16.h");
const MMA: &str = include_str!("../include/mma.h");

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading kernel source {path}: {source}")]
    Source {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing the emulated module to {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no C++ compiler to build the emulated kernels ({compiler}: {source}); install g++ or set CXX"
    )]
    NoCompiler {
        compiler: String,
        source: std::io::Error,
    },
    #[error("{compiler} could not compile the emulated kernels of {file}:\n{stderr}")]
    Compile {
        compiler: String,
        file: String,
        stderr: String,
    },
    #[error("loading the emulated module {path}: {source}")]
    Load {
        path: PathBuf,
        source: libloading::Error,
    },
    #[error("kernel {0} is not one the module was built with")]
    Unknown(String),
    #[error("{0}")]
    Kernel(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Kernels compiled for the host and loaded.
pub struct Module {
    // Kept mapped after its file (in `_dir`) is removed: see `build`.
    library: libloading::os::unix::Library,
    kernels: Vec<String>,
    _dir: tempfile::TempDir,
}

/// Signature of `emu_launch_K` (see `EMU_KERNEL` in `include/cuda_emu.h`).
type LaunchFn = unsafe extern "C" fn(
    dims: *const u32,
    args: *const *mut c_void,
    sizes: *const usize,
    nargs: usize,
    err: *mut c_char,
    errlen: usize,
) -> i32;

impl Module {
    /// Compiles `source` (a CUDA C++ file) with the C++ compiler `$CXX` (else `c++`) and
    /// loads the kernels named in `kernels` (each an `extern "C" __global__` function of
    /// it). The library stays loaded for the life of the process (its fault handler is
    /// installed once and chained).
    pub fn build(source: &Path, kernels: &[&str]) -> Result<Module> {
        let dir = tempfile::Builder::new()
            .prefix("rookworld-cuda-emu-")
            .tempdir()
            .map_err(|source| Error::Write {
                path: std::env::temp_dir(),
                source,
            })?;
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).map_err(|source| Error::Write { path, source })
        };
        write("cuda_emu.h", RUNTIME)?;
        write("cuda_bf16.h", BF16)?;
        write("mma.h", MMA)?;
        let text = std::fs::read_to_string(source).map_err(|e| Error::Source {
            path: source.to_path_buf(),
            source: e,
        })?;
        write("source.cu", &static_shared(&dynamic_shared(&text)))?;
        let mut unit = format!("// {}\n#include \"source.cu\"\n", source.display());
        for k in kernels {
            unit.push_str(&format!("EMU_KERNEL({k})\n"));
        }
        write("module.cpp", &unit)?;
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let lib = dir.path().join("module.so");
        let out = Command::new(&compiler)
            .current_dir(dir.path())
            .args([
                "-std=c++17",
                "-O2",
                "-g",
                "-fPIC",
                "-shared",
                "-fvisibility=hidden",
                "-w",
            ])
            .args(["-I", ".", "-include", "cuda_emu.h", "module.cpp", "-o"])
            .arg(&lib)
            .arg("-lpthread")
            .output()
            .map_err(|source| Error::NoCompiler {
                compiler: compiler.clone(),
                source,
            })?;
        if !out.status.success() {
            return Err(Error::Compile {
                compiler,
                file: source.display().to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        // Never unloaded: the fault handler it installs stays in the process's chain.
        let flags =
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL | RTLD_NODELETE;
        // SAFETY: the library is the one just built from the runtime and the source; its
        // initialisers are the C++ runtime's and the kernels' statics (no side effects).
        let library = unsafe { libloading::os::unix::Library::open(Some(&lib), flags) }
            .map_err(|source| Error::Load { path: lib, source })?;
        Ok(Module {
            library,
            kernels: kernels.iter().map(|k| k.to_string()).collect(),
            _dir: dir,
        })
    }

    /// Runs kernel `kernel` on `grid` blocks of `block` threads with `args`, its
    /// parameters in order, and no dynamic shared memory ([`launch_shared`]
    /// (Self::launch_shared) gives some). Their number, sizes and pointers' alignment are
    /// checked; a kernel fault (see the crate's doc) is [`Error::Kernel`].
    ///
    /// # Safety
    /// Every pointer argument points at a buffer that holds what the kernel reads and
    /// writes given the other arguments (an overrun past the end of a [`Guarded`] buffer is
    /// caught; other bad accesses are not).
    pub unsafe fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &[Arg<'_>],
    ) -> Result<()> {
        // SAFETY: the caller's promise, as ours.
        unsafe { self.launch_shared(kernel, grid, block, 0, args) }
    }

    /// [`launch`](Self::launch) with `shared` bytes of dynamic shared memory a block
    /// (`extern __shared__`): they end at a guard page, so a kernel that uses more faults,
    /// and start each block as 0xff bytes (NaN), so a read of what no thread wrote shows.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_shared(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        args: &[Arg<'_>],
    ) -> Result<()> {
        if !self.kernels.iter().any(|k| k == kernel) {
            return Err(Error::Unknown(kernel.into()));
        }
        let symbol = format!("emu_launch_{kernel}");
        // SAFETY: every kernel the module was built with has an `emu_launch_K` of this
        // signature (EMU_KERNEL).
        let launch: libloading::os::unix::Symbol<LaunchFn> =
            unsafe { self.library.get(symbol.as_bytes()) }
                .map_err(|_| Error::Unknown(kernel.into()))?;
        let dims = [
            grid[0], grid[1], grid[2], block[0], block[1], block[2], shared,
        ];
        let mut values: Vec<[u8; 8]> = args.iter().map(|a| a.bytes).collect();
        let pointers: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        let sizes: Vec<usize> = args.iter().map(|a| a.size).collect();
        let mut err = vec![0u8; 1024];
        // SAFETY: `dims` holds 7 values; `pointers` and `sizes` hold `args.len()` entries,
        // each pointer at 8 bytes that outlive the call; `err` is writable for its length.
        // The buffers behind the arguments are the caller's promise.
        let failed = unsafe {
            launch(
                dims.as_ptr(),
                pointers.as_ptr(),
                sizes.as_ptr(),
                args.len(),
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        if failed == 0 {
            return Ok(());
        }
        let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
        Err(Error::Kernel(
            String::from_utf8_lossy(&err[..end]).into_owned(),
        ))
    }
}

/// [`Module::build`] for a test: `None`, with `SKIPPED:` on stderr, where no C++ compiler
/// is installed — unless `ROOKWORLD_REQUIRE_CXX` is set (CI sets it), which makes that a
/// failure. Every other error panics with its message.
pub fn build_for_test(source: &Path, kernels: &[&str]) -> Option<Module> {
    match Module::build(source, kernels) {
        Ok(module) => Some(module),
        Err(e @ Error::NoCompiler { .. }) => {
            assert!(
                std::env::var_os("ROOKWORLD_REQUIRE_CXX").is_none(),
                "{e} (ROOKWORLD_REQUIRE_CXX is set)"
            );
            eprintln!("SKIPPED: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// One kernel argument: a value as the kernel's parameter holds it (a device pointer, an
/// `int`, a `float`), borrowing the buffer it points at for as long as it lives.
#[derive(Clone, Copy)]
pub struct Arg<'a> {
    bytes: [u8; 8],
    size: usize,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> Arg<'a> {
    fn of(bytes: &[u8]) -> Self {
        let mut b = [0u8; 8];
        b[..bytes.len()].copy_from_slice(bytes);
        Arg {
            bytes: b,
            size: bytes.len(),
            _borrow: PhantomData,
        }
    }

    /// A pointer to `buffer`, read by the kernel.
    pub fn buf<T: Element>(buffer: &'a Guarded<T>) -> Self {
        Self::of(&(buffer.as_ptr() as usize).to_ne_bytes())
    }

    /// A pointer to `buffer`, written by the kernel.
    pub fn buf_mut<T: Element>(buffer: &'a mut Guarded<T>) -> Self {
        Self::of(&(buffer.as_mut_ptr() as usize).to_ne_bytes())
    }

    /// A null pointer.
    pub fn null() -> Self {
        Self::of(&0usize.to_ne_bytes())
    }

    pub fn i32(v: i32) -> Self {
        Self::of(&v.to_ne_bytes())
    }

    pub fn u32(v: u32) -> Self {
        Self::of(&v.to_ne_bytes())
    }

    pub fn f32(v: f32) -> Self {
        Self::of(&v.to_ne_bytes())
    }

    pub fn u64(v: u64) -> Self {
        Self::of(&v.to_ne_bytes())
    }
}

/// `text` with each `extern __shared__ T name[];` (dynamic shared memory, which a
/// `static` cannot stand for) declared as a pointer to the launch's dynamic shared memory.
fn dynamic_shared(text: &str) -> String {
    const KEY: &str = "extern __shared__";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(KEY) {
        out.push_str(&rest[..at]);
        let decl = &rest[at + KEY.len()..];
        let Some(end) = decl.find(';') else {
            out.push_str(&rest[at..]);
            return out;
        };
        let body = decl[..end].trim();
        match body.rsplit_once(char::is_whitespace) {
            Some((ty, name)) if name.ends_with("[]") => {
                let (ty, name) = (ty.trim(), name.trim_end_matches("[]"));
                out.push_str(&format!("{ty} *{name} = EMU_DYNAMIC_SHARED({ty});"));
            }
            _ => out.push_str(&rest[at..at + KEY.len() + end + 1]),
        }
        rest = &decl[end + 1..];
    }
    out.push_str(rest);
    out
}

/// `text` with each `__shared__` declaration that starts a line (inside a kernel) followed
/// by `::emu::enter_shared` for each variable it declares: shared memory that starts each
/// block as 0xff bytes.
fn static_shared(text: &str) -> String {
    const KEY: &str = "__shared__";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(KEY) {
        let line_start = rest[..at].rfind('\n').map_or(0, |i| i + 1);
        let declaration = rest[line_start..at].trim().is_empty();
        let decl = &rest[at + KEY.len()..];
        let end = decl.find(';');
        let (Some(end), true) = (end, declaration) else {
            out.push_str(&rest[..at + KEY.len()]);
            rest = decl;
            continue;
        };
        out.push_str(&rest[..at + KEY.len() + end + 1]);
        for name in declared_names(&decl[..end]) {
            out.push_str(&format!(" ::emu::enter_shared(&{name}, sizeof {name});"));
        }
        rest = &decl[end + 1..];
    }
    out.push_str(rest);
    out
}

/// The variables of a declaration without its storage class (`float a[N], b[M]`, `int x`):
/// each top-level declarator's identifier.
fn declared_names(decl: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in decl.char_indices() {
        match c {
            '[' | '(' => depth += 1,
            ']' | ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&decl[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&decl[start..]);
    parts
        .into_iter()
        .filter_map(|p| {
            let head = p.split('[').next().unwrap_or(p).trim_end();
            let name: String = head
                .chars()
                .rev()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{dynamic_shared, static_shared};

    #[test]
    fn shared_declarations_are_followed_by_their_fill() {
        assert_eq!(
            static_shared(
                "    __shared__ float sq[T * D], sk[C * (D + 1)];\n    __shared__ int n;\n"
            ),
            "    __shared__ float sq[T * D], sk[C * (D + 1)]; ::emu::enter_shared(&sq, sizeof sq); \
             ::emu::enter_shared(&sk, sizeof sk);\n    __shared__ int n; \
             ::emu::enter_shared(&n, sizeof n);\n"
        );
        // Not a declaration: in a comment or mid-line.
        let text = "// through __shared__ memory; see\nint x; // __shared__ a;\n";
        assert_eq!(static_shared(text), text);
    }

    #[test]
    fn dynamic_shared_memory_becomes_a_pointer() {
        assert_eq!(
            dynamic_shared("{\n    extern __shared__ float s_row[];  // E\n}"),
            "{\n    float *s_row = EMU_DYNAMIC_SHARED(float);  // E\n}"
        );
        assert_eq!(dynamic_shared("int x;"), "int x;");
    }
}
