//! The rollout worker's tests, in one binary: the real gRPC service on `127.0.0.1:0` and the
//! real binary.
//!
//! - `grpc`: generation, weight updates, tokens and status codes over gRPC;
//! - `generate_cli`, `serve_cli`: the command line.

mod generate_cli;
mod grpc;
mod serve_cli;
