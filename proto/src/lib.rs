//! Generated protocol buffer types for the RookWorld GRPO services.
//!
//! - [`v1`]: messages shared by every service (`rookworld.v1`).
//! - [`reward::v1`]: the reward server (`rookworld.reward.v1`).
//! - [`rollout::v1`]: the rollout worker (`rookworld.rollout.v1`).
//! - [`queue::v1`]: the learner's rollout queue (`rookworld.queue.v1`).
//! - [`auth`]: the shared-token check of guarded calls, and setting it on a client.
//! - [`env`]: empty settings variables count as unset.
//! - [`logging`]: the log every service binary writes.
//! - [`metrics_http`]: the read-only Prometheus endpoint every service serves.
//! - [`status`]: gRPC statuses with a bounded message.
//! - [`run_file`]: `--config FILE` (TOML) under the environment and the flags.
//! - [`probe`]: reflection listing and metrics scrapes of a running service.
//! - [`serve`]: reflection services and the shutdown signal every server uses.
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptors that gRPC server reflection serves.

pub mod auth;
pub mod check;
pub mod env;
pub mod logging;
pub mod metrics_http;
pub mod probe;
pub mod run_file;
pub mod serve;
pub mod status;
pub mod tls;

/// `rookworld.v1`: sampling parameters and completions.
pub mod v1 {
    tonic::include_proto!("rookworld.v1");
}

/// `rookworld.queue.v1`: the learner's rollout queue.
pub mod queue {
    pub mod v1 {
        tonic::include_proto!("rookworld.queue.v1");
    }
}

/// `rookworld.rollout.v1`: the rollout worker.
pub mod rollout {
    pub mod v1 {
        tonic::include_proto!("rookworld.rollout.v1");
    }
}

/// `rookworld.reward.v1`: the reward server.
pub mod reward {
    pub mod v1 {
        tonic::include_proto!("rookworld.reward.v1");
    }
}

/// Encoded `FileDescriptorSet` of every `.proto` in this crate, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("rookworld_descriptor");
