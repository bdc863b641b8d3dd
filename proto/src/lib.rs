//! The protocol of the RookWorld GRPO services: the types, clients and servers generated
//! from the `.proto` files under `rookworld/`, and nothing else (what the services share
//! around it, from tokens to run files, is the `rookworld-service` crate).
//!
//! - [`v1`]: messages shared by every service (`rookworld.v1`).
//! - [`reward::v1`]: the reward server (`rookworld.reward.v1`).
//! - [`rollout::v1`]: the rollout worker (`rookworld.rollout.v1`).
//! - [`queue::v1`]: the learner's rollout queue (`rookworld.queue.v1`).
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptors that gRPC server reflection serves.

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
