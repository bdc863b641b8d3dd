//! Cross-crate tests, in one binary: the services together, as separate processes (the
//! launchers in `tests/src/bin` run their own command lines) or in-process on loopback.
//!
//! - `cluster`: a training cluster of real processes that a test can kill, stop and probe.
//! - `faults`: faults survived with nothing lost; `wiring`: wiring mistakes named;
//!   `hostile`: hostile input to the learner's queue and the worker; `tls`: TLS and
//!   mutual TLS; `grpcurl`: the book's grpcurl commands; `logs`: what the logs say;
//!   `stops`: every command ended by a signal; `fleet`: weight pushes to worker processes
//!   behind shaped links, in network namespaces.
//! - `parity`, `hf_roundtrip`, `checkpoints`, `hub`, `tokenizer_data`: the model against
//!   Hugging Face's stored numbers, checkpoints and the tokenizer's data; `export`:
//!   `learner export` against what transformers writes and loaded.
//! - `run_file`, `validation`, `worker_loop`: run files, the command lines' checks, the
//!   worker's loop against a real learner and reward server; `tensorboard`: the learner's
//!   event files read back by TensorBoard.
//! - `deploy`: the compose file, the Kubernetes manifests and Grafana against the services;
//!   `docs`: the book's generated pages and links; `layout`: the book's layout page against
//!   the workspace's members; `separate_processes`: the guide to the services as separate
//!   processes, run as written; `cargo_features`, `gpu_check`: the `cuda` feature's
//!   declarations and the GPU check's script; `kernel_names`: one definition per CUDA
//!   kernel name across the repository's kernel sources.

mod cargo_features;
mod checkpoints;
mod cluster;
mod deploy;
mod docs;
mod export;
mod faults;
mod fleet;
mod gpu_check;
mod grpcurl;
mod hf_roundtrip;
mod hostile;
mod hub;
mod import_loops;
mod kernel_names;
mod layout;
mod logs;
mod parity;
mod run_file;
mod separate_processes;
mod stops;
mod tensorboard;
mod tls;
mod tokenizer_data;
mod validation;
mod wiring;
mod worker_loop;
