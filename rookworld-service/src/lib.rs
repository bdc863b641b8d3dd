//! What every RookWorld service shares around its protocol (`rookworld-proto`): the
//! plumbing of the three binaries, each a module of one concept.
//!
//! - [`auth`]: the shared-token check of guarded calls, and setting it on a client.
//! - [`validate`]: range checks of command-line values and [`validate::ConfigError`], the one
//!   type of a refused configuration.
//! - [`env`]: empty settings variables count as unset.
//! - [`http2`]: the HTTP/2 windows and frame size of every server and client, and client
//!   endpoints with them.
//! - [`logging`]: the log every service binary writes.
//! - [`metrics_http`]: the read-only Prometheus endpoint every service serves.
//! - [`probe`]: health, reflection listing and metrics scrapes of a running service.
//! - [`run_file`]: `--config FILE` (TOML) under the environment and the flags.
//! - [`serve`]: serving a service (health, reflection, TLS) and the shutdown signal.
//! - [`status`]: gRPC statuses with a bounded message.
//! - [`tls`]: TLS and mutual TLS of servers and clients, certificates reloaded while serving.

pub mod auth;
pub mod env;
pub mod files;
pub mod http2;
pub mod logging;
pub mod metrics_http;
pub mod probe;
pub mod run_file;
pub mod serve;
pub mod status;
pub mod tls;
pub mod validate;
