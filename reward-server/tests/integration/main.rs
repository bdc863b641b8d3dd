//! The reward server's tests, in one binary: the real gRPC service on `127.0.0.1:0` and the
//! real binary.
//!
//! - `grpc`: scoring, tokens, limits and status codes over gRPC;
//! - `metrics`: the Prometheus endpoint after real calls;
//! - `hostile`: fuzzed completions and malformed requests against the real binary;
//! - `cli`, `health_cli`, `help_cli`: the command line (`score`, `health`, `--help`).

mod cli;
mod grpc;
mod health_cli;
mod help_cli;
mod hostile;
mod metrics;
