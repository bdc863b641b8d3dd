//! Compiles every `.proto` under `rookworld/` with the vendored `protoc`, so a fresh
//! machine needs nothing from apt, and writes the file descriptor set that server
//! reflection serves.

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment here.
    unsafe { std::env::set_var("PROTOC", protoc) };

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut protos = Vec::new();
    collect_protos(&root.join("rookworld"), &mut protos)?;
    protos.sort();
    // Watching the directory (cargo scans it recursively) also catches new files.
    println!(
        "cargo:rerun-if-changed={}",
        root.join("rookworld").display()
    );

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("rookworld_descriptor.bin"))
        // Weight chunks are slices of one shared payload: no copy per chunk or per worker.
        .bytes(".rookworld.rollout.v1.WeightChunk.data")
        .compile_protos(&protos, &[root.to_path_buf()])?;
    Ok(())
}

fn collect_protos(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_protos(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}
