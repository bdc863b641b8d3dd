//! With the `cuda` feature: compiles the CUDA backend's kernels (`kernels/*.cu`) to PTX
//! with nvcc, for `CUDA_COMPUTE_CAP` (as candle's kernels and rookworld-lm's), into
//! `OUT_DIR`; the crate embeds the PTX and the driver loads it on first use. Without the
//! feature: nothing.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 1] = ["pass"];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|home| PathBuf::from(home).join("bin").join("nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    for name in KERNELS {
        let src = format!("kernels/{name}.cu");
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args([
                "--ptx",
                "-O3",
                "-std=c++17",
                &format!("-arch=compute_{cap}"),
                "-o",
            ])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {} for {src}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {src}");
    }
}
