//! What a worker's submission must be before the queue takes it: the group the learner
//! asked for, in its model's vocabulary and context, with the prompt tokenised as the
//! learner tokenises it, and bounded in size. A bad group is refused with
//! INVALID_ARGUMENT (its lease stays, so a corrected submission can still come); nothing
//! malformed reaches training.

use std::sync::Arc;

use rookworld_lm::{Config, Tokenizer};
use rookworld_proto::queue::v1 as pb;

use super::error::QueueError;

/// Longest worker id and push address accepted.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest completion text accepted (the learner trains on the ids; the text is for people).
const MAX_TEXT_BYTES: usize = 64 * 1024;
/// Most reward components per completion, and the longest name.
const MAX_COMPONENTS: usize = 32;
const MAX_COMPONENT_NAME: usize = 64;

/// The learner's model, as submissions must fit it.
#[derive(Clone)]
pub struct GroupCheck {
    /// Shared: a check is cloned into every service that takes submissions.
    pub tokenizer: Arc<Tokenizer>,
    /// Token every prompt starts with.
    pub bos: u32,
    pub vocab_size: u32,
    /// Context length: prompt and completion together.
    pub n_positions: usize,
}

impl std::fmt::Debug for GroupCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCheck")
            .field("bos", &self.bos)
            .field("vocab_size", &self.vocab_size)
            .field("n_positions", &self.n_positions)
            .finish_non_exhaustive()
    }
}

impl GroupCheck {
    /// Checks for a model of `cfg`'s shape with the GPT-2 tokenizer.
    pub fn for_model(cfg: &Config) -> Self {
        Self {
            tokenizer: Arc::new(Tokenizer::gpt2()),
            bos: cfg.bos_token_id,
            vocab_size: cfg.vocab_size as u32,
            n_positions: cfg.n_positions,
        }
    }

    /// The most bytes ([`crate::queue::ScoredGroup::size_bytes`]) a group that passes
    /// [`group`] can hold, for prompts of at most `prompt_bytes` bytes: with the queue's
    /// bounds this bounds its memory — leases stop while `max_scored` groups wait, and
    /// each of the `max_leased` outstanding leases may still submit one.
    pub fn max_group_bytes(&self, want: u32, max_new_tokens: u32, prompt_bytes: usize) -> usize {
        let completion = 8 * max_new_tokens as usize
            + MAX_TEXT_BYTES
            + MAX_COMPONENTS * (MAX_COMPONENT_NAME + 4);
        4 * self.n_positions + prompt_bytes + MAX_NAME_BYTES + want as usize * completion
    }

    /// The prompt's ids as the learner makes them: BOS, then the text's tokens.
    pub fn prompt_ids(&self, prompt: &str) -> Result<Vec<u32>, QueueError> {
        let mut ids = vec![self.bos];
        ids.extend(
            self.tokenizer
                .encode(prompt)
                .map_err(|e| QueueError::Internal(format!("tokenizing the leased prompt: {e}")))?,
        );
        Ok(ids)
    }
}

fn invalid(what: String) -> QueueError {
    QueueError::Invalid(what)
}

/// A worker id: not empty, not too long, printable.
pub fn worker_id(id: &str) -> Result<(), QueueError> {
    if id.is_empty() || id.len() > MAX_NAME_BYTES || id.chars().any(char::is_control) {
        return Err(invalid(format!(
            "worker_id must be 1 to {MAX_NAME_BYTES} printable bytes"
        )));
    }
    Ok(())
}

/// A push address: empty (no pushes) or an http(s) URL of bounded length.
pub fn push_address(address: &str) -> Result<(), QueueError> {
    let ok = address.is_empty()
        || (address.len() <= MAX_NAME_BYTES
            && (address.starts_with("http://") || address.starts_with("https://"))
            && !address.chars().any(|c| c.is_control() || c.is_whitespace()));
    if !ok {
        return Err(invalid(format!(
            "push_address must be empty or an http(s) URL of at most {MAX_NAME_BYTES} bytes"
        )));
    }
    Ok(())
}

/// The group's shape: `want` completions, each with a log-prob per id, every id in the
/// vocabulary, at most `max_new_tokens` ids, prompt and completion within the context,
/// finite numbers, bounded text and components.
pub fn group(
    r: &pb::SubmitRequest,
    want: u32,
    max_new_tokens: u32,
    check: &GroupCheck,
) -> Result<(), QueueError> {
    if r.completions.len() != want as usize {
        return Err(invalid(format!(
            "the group has {} completions; the queue asked for {want}",
            r.completions.len()
        )));
    }
    let in_vocab = |ids: &[u32]| ids.iter().all(|&t| t < check.vocab_size);
    if r.prompt_ids.is_empty() || !in_vocab(&r.prompt_ids) {
        return Err(invalid(format!(
            "prompt_ids must be non-empty token ids below {}",
            check.vocab_size
        )));
    }
    for (i, c) in r.completions.iter().enumerate() {
        if c.ids.len() > max_new_tokens as usize {
            return Err(invalid(format!(
                "completion {i} has {} tokens; at most {max_new_tokens} were asked for",
                c.ids.len()
            )));
        }
        if r.prompt_ids.len() + c.ids.len() > check.n_positions {
            return Err(invalid(format!(
                "completion {i}: prompt and completion exceed the context of {} tokens",
                check.n_positions
            )));
        }
        if !in_vocab(&c.ids) {
            return Err(invalid(format!(
                "completion {i} has a token id outside the vocabulary ({})",
                check.vocab_size
            )));
        }
        if c.logprobs.len() != c.ids.len() {
            return Err(invalid(format!(
                "completion {i} has {} ids but {} log-probs",
                c.ids.len(),
                c.logprobs.len()
            )));
        }
        let versions_fit = c.token_versions.is_empty()
            || (c.token_versions.len() == c.ids.len()
                && c.token_versions.iter().all(|&v| v >= r.weight_version));
        if !versions_fit {
            return Err(invalid(format!(
                "completion {i}: token_versions must be empty or one per id, none below the group's weight_version {}",
                r.weight_version
            )));
        }
        let finite = c.reward.is_finite()
            && c.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0)
            && c.components.values().all(|v| v.is_finite());
        if !finite {
            return Err(invalid(format!(
                "completion {i}: rewards and log-probs must be finite (log-probs at most 0)"
            )));
        }
        if c.text.len() > MAX_TEXT_BYTES {
            return Err(invalid(format!(
                "completion {i}: text over {MAX_TEXT_BYTES} bytes"
            )));
        }
        if c.components.len() > MAX_COMPONENTS
            || c.components.keys().any(|k| k.len() > MAX_COMPONENT_NAME)
        {
            return Err(invalid(format!(
                "completion {i}: at most {MAX_COMPONENTS} reward components, names of at most {MAX_COMPONENT_NAME} bytes"
            )));
        }
    }
    Ok(())
}
