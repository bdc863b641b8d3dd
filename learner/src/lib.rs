//! The GRPO learner.
//!
//! - [`init_cmd`]: `learner init`, writes a starting checkpoint (random preset or a
//!   converted checkpoint) in Hugging Face layout.
//!
//! The GRPO objective, the rollout queue and `learner train` arrive with their issues.

pub mod init_cmd;
