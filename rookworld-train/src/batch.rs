//! A GRPO batch: P prompts with G completions each, their rewards and the behaviour
//! log-probs the worker reported, and its layout as token tensors for one forward.

use candle_core::{Device, Result as CandleResult, Tensor};
use serde::{Deserialize, Serialize};

use crate::grpo::{Scale, group_advantages};

/// What `learner loss --batch FILE` reads (and what the rollout queue hands the learner).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrpoBatch {
    /// `prompts[p]`: token ids of prompt p, fed as given.
    pub prompts: Vec<Vec<u32>>,
    /// `completions[p][g]`: sampled ids of completion g of prompt p.
    pub completions: Vec<Vec<Vec<u32>>>,
    /// `rewards[p][g]`.
    pub rewards: Vec<Vec<f32>>,
    /// `old_logprobs[p][g][t]`: the behaviour log-prob of token t; absent = ratio 1
    /// (the policy's own detached log-probs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_logprobs: Option<Vec<Vec<Vec<f32>>>>,
    /// `proximal_logprobs[p][g][t]`: the learner's own log-prob of token t at the start of
    /// the step (the decoupled objective's proximal policy, see
    /// [`crate::offpolicy`]); absent = the policy's own detached log-probs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proximal_logprobs: Option<Vec<Vec<Vec<f32>>>>,
    /// `stale_prefix[p][g]`: the leading tokens of completion g left out of the loss,
    /// sampled by weights past the learner's staleness limit (an update reached the
    /// worker mid-completion, and the versions along a completion never fall); absent =
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_prefix: Option<Vec<Vec<usize>>>,
}

impl GrpoBatch {
    /// The leading tokens of completion `g` of prompt `p` left out of the loss.
    pub fn stale(&self, p: usize, g: usize) -> usize {
        self.stale_prefix.as_ref().map_or(0, |s| s[p][g])
    }
}

/// Why a batch cannot be trained on.
#[derive(Debug, thiserror::Error)]
#[error("invalid batch: {0}")]
pub struct BatchError(pub String);

impl GrpoBatch {
    /// Checks shapes and ids (`vocab`, `context`) so the forward cannot fail on input.
    pub fn validate(&self, vocab: usize, context: usize) -> Result<(), BatchError> {
        let bad = |m: String| Err(BatchError(m));
        let p = self.prompts.len();
        if p == 0 {
            return bad("no prompts".into());
        }
        if self.completions.len() != p || self.rewards.len() != p {
            return bad(format!(
                "{p} prompts but {} completion groups and {} reward groups",
                self.completions.len(),
                self.rewards.len()
            ));
        }
        if let Some(old) = &self.old_logprobs
            && old.len() != p
        {
            return bad(format!("{p} prompts but {} old_logprobs groups", old.len()));
        }
        if let Some(prox) = &self.proximal_logprobs {
            let fits = prox.len() == p
                && self.completions.iter().zip(prox).all(|(group, lps)| {
                    group.len() == lps.len()
                        && group.iter().zip(lps).all(|(c, l)| c.len() == l.len())
                });
            if !fits {
                return bad("proximal log-probs do not match the completions".into());
            }
        }
        if let Some(stale) = &self.stale_prefix {
            let fits = stale.len() == p
                && self.completions.iter().zip(stale).all(|(group, s)| {
                    group.len() == s.len() && group.iter().zip(s).all(|(c, &n)| n <= c.len())
                });
            if !fits {
                return bad(
                    "stale_prefix does not match the completions (one per completion, at most its length)"
                        .into(),
                );
            }
        }
        for i in 0..p {
            let (prompt, group) = (&self.prompts[i], &self.completions[i]);
            if prompt.is_empty() {
                return bad(format!("prompt {i} is empty"));
            }
            if group.is_empty() || self.rewards[i].len() != group.len() {
                return bad(format!(
                    "prompt {i}: {} completions and {} rewards",
                    group.len(),
                    self.rewards[i].len()
                ));
            }
            if let Some(r) = self.rewards[i].iter().find(|r| !r.is_finite()) {
                return bad(format!("prompt {i}: reward {r} is not finite"));
            }
            for (g, c) in group.iter().enumerate() {
                if c.is_empty() {
                    return bad(format!("prompt {i}, completion {g} is empty"));
                }
                if prompt.len() + c.len() > context + 1 {
                    return bad(format!(
                        "prompt {i}, completion {g}: {} + {} tokens exceed the context of {context}",
                        prompt.len(),
                        c.len()
                    ));
                }
                if let Some(old) = &self.old_logprobs {
                    let lp = old[i].get(g).map(Vec::len);
                    if lp != Some(c.len()) {
                        return bad(format!(
                            "prompt {i}, completion {g}: {} ids but {lp:?} old log-probs",
                            c.len()
                        ));
                    }
                }
            }
            if let Some(id) = prompt
                .iter()
                .chain(group.iter().flatten())
                .find(|&&id| id as usize >= vocab)
            {
                return bad(format!(
                    "prompt {i}: token id {id} is outside the vocabulary of {vocab}"
                ));
            }
        }
        Ok(())
    }
}

/// One completion with what the loss needs of it.
struct Row<'a> {
    prompt: &'a [u32],
    completion: &'a [u32],
    /// Leading tokens left out of the loss as stale.
    stale: usize,
    old: Option<&'a [f32]>,
    proximal: Option<&'a [f32]>,
    advantage: f32,
}

/// The completions that carry signal, laid out for one forward.
///
/// Sequence c is `prompt ++ completion`, right-padded to T tokens. Slot t of the (C, T−1)
/// tensors holds the prediction of token t+1 from logits at t, so completion token j of a
/// prompt of length L sits at slot L − 1 + j.
#[derive(Debug)]
pub struct Layout {
    /// (C, T) u32 input ids.
    pub ids: Tensor,
    /// (C, T−1, 1) u32: the token each slot predicts.
    pub targets: Tensor,
    /// (C, T−1) f32: 1 on completion tokens.
    pub mask: Tensor,
    /// (N) u32: the flat (C·(T−1)) indices of the completion slots, in order.
    pub slots: Tensor,
    /// (C, T−1) f32 behaviour log-probs on completion tokens (0 elsewhere); `None` when the
    /// batch has none (ratio 1: the policy's detached log-probs are used).
    pub behaviour: Option<Tensor>,
    /// (C, T−1) f32 proximal log-probs on completion tokens, when the batch has them.
    pub proximal: Option<Tensor>,
    /// (C, 1) f32 advantage of each completion.
    pub advantages: Tensor,
    /// Advantages per kept group, in batch order (for reporting).
    pub group_advantages: Vec<Vec<f32>>,
    /// Prompts whose rewards were all equal: skipped.
    pub skipped_groups: usize,
    /// Completion tokens counted.
    pub tokens: usize,
    /// Completions left out of the loss as cut off (`mask_truncated`).
    pub masked_truncated: usize,
    /// Completions with a token counted in the loss.
    pub sequences: usize,
}

impl Layout {
    /// Lays out every group with signal; `None` when no group has any.
    pub fn new(
        batch: &GrpoBatch,
        scale: Scale,
        pad: u32,
        mask_truncated: bool,
        device: &Device,
    ) -> CandleResult<Option<Self>> {
        let mut rows: Vec<Row> = Vec::new();
        let mut kept_advantages = Vec::new();
        let mut skipped = 0;
        for (p, prompt) in batch.prompts.iter().enumerate() {
            let Some(adv) = group_advantages(&batch.rewards[p], scale) else {
                skipped += 1;
                continue;
            };
            for (g, c) in batch.completions[p].iter().enumerate() {
                let old = batch.old_logprobs.as_ref().map(|o| o[p][g].as_slice());
                let proximal = batch.proximal_logprobs.as_ref().map(|o| o[p][g].as_slice());
                rows.push(Row {
                    prompt,
                    completion: c,
                    stale: batch.stale(p, g),
                    old,
                    proximal,
                    advantage: adv[g],
                });
            }
            kept_advantages.push(adv);
        }
        if rows.is_empty() {
            return Ok(None);
        }
        let t = rows
            .iter()
            .map(|r| r.prompt.len() + r.completion.len())
            .max()
            .unwrap_or(0);
        let n = rows.len();
        let (mut ids, mut targets) = (vec![pad; n * t], vec![pad; n * (t - 1)]);
        let (mut mask, mut behaviour) = (vec![0f32; n * (t - 1)], vec![0f32; n * (t - 1)]);
        let mut proximal_lp = vec![0f32; n * (t - 1)];
        let (mut tokens, mut truncated, mut sequences) = (0, 0, 0);
        let mut slots = Vec::new();
        for (
            r,
            Row {
                prompt,
                completion,
                stale,
                old,
                proximal,
                ..
            },
        ) in rows.iter().enumerate()
        {
            let seq: Vec<u32> = prompt.iter().chain(completion.iter()).copied().collect();
            ids[r * t..r * t + seq.len()].copy_from_slice(&seq);
            targets[r * (t - 1)..r * (t - 1) + seq.len() - 1].copy_from_slice(&seq[1..]);
            let first = prompt.len() - 1;
            // `pad` is end-of-text: a completion without it at the end was cut off.
            let counted = !(mask_truncated && completion.last() != Some(&pad));
            if !counted {
                truncated += 1;
            }
            for j in 0..completion.len() {
                mask[r * (t - 1) + first + j] = f32::from(u8::from(counted && j >= *stale));
                slots.push((r * (t - 1) + first + j) as u32);
                if let Some(old) = old {
                    behaviour[r * (t - 1) + first + j] = old[j];
                }
                if let Some(prox) = proximal {
                    proximal_lp[r * (t - 1) + first + j] = prox[j];
                }
            }
            if counted && completion.len() > *stale {
                tokens += completion.len() - stale;
                sequences += 1;
            }
        }
        let advantages: Vec<f32> = rows.iter().map(|row| row.advantage).collect();
        Ok(Some(Self {
            ids: Tensor::from_vec(ids, (n, t), device)?,
            targets: Tensor::from_vec(targets, (n, t - 1, 1), device)?,
            mask: Tensor::from_vec(mask, (n, t - 1), device)?,
            slots: Tensor::new(slots, device)?,
            behaviour: match batch.old_logprobs {
                Some(_) => Some(Tensor::from_vec(behaviour, (n, t - 1), device)?),
                None => None,
            },
            proximal: match batch.proximal_logprobs {
                Some(_) => Some(Tensor::from_vec(proximal_lp, (n, t - 1), device)?),
                None => None,
            },
            advantages: Tensor::from_vec(advantages, (n, 1), device)?,
            group_advantages: kept_advantages,
            skipped_groups: skipped,
            tokens,
            masked_truncated: truncated,
            sequences,
        }))
    }
}
