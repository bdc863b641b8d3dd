//! The model crate's tests, in one binary: every path against its reference.
//!
//! - `generation`: sampling and generation, reproducible from a seed;
//! - `cache`, `grouped`: the KV cache, and the prompt shared by its group, against the
//!   plain forward;
//! - `packed`: the CPU's packed panels (f32, BF16, INT8) against the dense model;
//! - `train_ops`: each training op's values and gradients against candle's composed ops;
//! - `emulated`: the CUDA kernels (`kernels/*.cu`) run on the CPU (rookworld-cuda-emu)
//!   against their CPU references;
//! - `common`: the small models and inputs they share.

mod cache;
mod common;
mod emulated;
mod generation;
mod grouped;
mod packed;
mod train_ops;
