//! What a checkpoint keeps of the queue: the unfinished prompts, the counters and the
//! retired weight versions.

use serde::{Deserialize, Serialize};

use super::{Counters, PromptId, Queue, QueuedPrompt};

/// The queue as a checkpoint keeps it: prompts not yet consumed, the next prompt id, the
/// counters so far and the retired weight versions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub unfinished: Vec<QueuedPrompt>,
    pub next_prompt_id: PromptId,
    /// `None` in checkpoints written before the counters were kept.
    #[serde(default)]
    pub counters: Option<Counters>,
    /// Inclusive version ranges whose groups are dropped.
    #[serde(default)]
    pub retired: Vec<(u64, u64)>,
}

impl Queue {
    /// What a checkpoint keeps of the queue.
    pub fn snapshot(&self) -> QueueSnapshot {
        QueueSnapshot {
            unfinished: self.unfinished(),
            next_prompt_id: self.next_prompt,
            counters: Some(self.counters),
            retired: self.retired.clone(),
        }
    }

    /// Re-queues a checkpoint's unfinished prompts ahead of new ones (ids, seeds and
    /// attempts kept); new ids continue after the snapshot's; the counters and the retired
    /// versions continue from the snapshot's.
    pub fn restore(&mut self, snapshot: QueueSnapshot) {
        self.next_prompt = self.next_prompt.max(snapshot.next_prompt_id);
        let added = snapshot.unfinished.len() as u64;
        for p in snapshot.unfinished.into_iter().rev() {
            self.next_prompt = self.next_prompt.max(p.id + 1);
            self.pending.push_front(p);
        }
        match snapshot.counters {
            Some(c) => self.counters = c,
            None => self.counters.prompts_added += added,
        }
        for (from, to) in snapshot.retired {
            self.retire(from, to);
        }
    }

    /// Drops, from now on, every group sampled with a version in `from..=to`.
    pub fn retire(&mut self, from: u64, to: u64) {
        if from <= to && !self.retired.contains(&(from, to)) {
            self.retired.push((from, to));
        }
    }

    /// Every prompt not yet consumed or dropped — leased, scored but not taken, pending —
    /// oldest first: what a checkpoint keeps so that a resumed run loses none of them.
    pub fn unfinished(&self) -> Vec<QueuedPrompt> {
        let mut out: Vec<QueuedPrompt> = self
            .leases
            .values()
            .map(|l| l.prompt.clone())
            .chain(self.scored.iter().map(|(p, _)| p.clone()))
            .chain(self.pending.iter().cloned())
            .collect();
        out.sort_by_key(|p| p.id);
        out
    }
}
