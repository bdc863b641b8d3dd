//! The generation engine's core, single-threaded and synchronous: continuous batching of
//! samples over prompts whose caches are shared by their samples.
//!
//! Work arrives as requests of P prompts × G samples. A prompt is prefilled once, when
//! its first sample is admitted; its cache then stays in the [`GroupedCache`] until its
//! last sample finishes, and every sample of it starts from the prefill's last logits.
//! Each [`Scheduler::step`] first fills free rows — samples of prompts already held, then
//! new prompts (prefilled together, at most `max_prefill_tokens` a step) — then runs one
//! decode step for every live row. A row that finishes frees its slot for the next step.
//!
//! Sample j of prompt i draws from stream `(i << 32) | j` of the request's seed, so its
//! tokens do not depend on what else is batched with it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use rookworld_lm::generate::{Completion, FinishReason};
use rookworld_lm::sampling::Sampler;
use rookworld_lm::{Gpt2, GroupedCache, LeftPadding};

use super::{EngineConfig, EngineError, Event, FinishedSample, Request, RequestId, StepStats};

/// A prompt whose samples are not all admitted yet.
#[derive(Debug, Clone)]
struct PromptWork {
    request: RequestId,
    prompt_index: u32,
    ids: Arc<[u32]>,
    /// Sample indices still to start, in order.
    pending: VecDeque<u32>,
}

/// A prompt held in the cache (group g of [`GroupedCache`]).
#[derive(Debug)]
struct Group {
    work: PromptWork,
    /// Next-token logits after the prompt: every sample's first draw.
    first_logits: Vec<f32>,
    /// The version whose weights prefilled the prompt (made `first_logits`).
    prefilled_by: u64,
    live: usize,
}

/// A sample being decoded (row r of [`GroupedCache`]).
#[derive(Debug)]
struct Row {
    request: RequestId,
    prompt_index: u32,
    sample: u32,
    sampler: Sampler,
    completion: Completion,
    /// `versions[i]`: the weight version that sampled `completion.ids[i]`.
    versions: Vec<u64>,
    budget: usize,
}

#[derive(Debug)]
struct RequestState {
    request: Arc<Request>,
    /// Samples not yet finished.
    remaining: usize,
}

/// Continuous-batching generation over one model version.
#[derive(Debug)]
pub struct Scheduler {
    model: Arc<Gpt2>,
    version: u64,
    cfg: EngineConfig,
    /// Row limit in force: `max_seqs`, halved on each out-of-memory error.
    row_limit: usize,
    /// Prefill tokens per step in force: `max_prefill_tokens`, halved on out-of-memory.
    prefill_limit: usize,
    queue: VecDeque<PromptWork>,
    groups: Vec<Group>,
    rows: Vec<Row>,
    cache: GroupedCache,
    requests: HashMap<RequestId, RequestState>,
    /// KV tokens reserved: each held prompt's length plus each live row's budget.
    reserved: usize,
    next_id: RequestId,
    /// Test hook: a decode step with more rows than this fails as out of memory.
    #[cfg(test)]
    fail_above_rows: Option<usize>,
    /// Test hook: sampling more rows than this fails as out of memory, after the draws.
    #[cfg(test)]
    fail_sampling_above_rows: Option<usize>,
}

impl Scheduler {
    pub fn new(model: Arc<Gpt2>, version: u64, cfg: EngineConfig) -> Self {
        let cache = GroupedCache::new(model.config().n_layer);
        Self {
            model,
            version,
            row_limit: cfg.max_seqs.max(1),
            prefill_limit: cfg.max_prefill_tokens.max(1),
            cfg,
            queue: VecDeque::new(),
            groups: Vec::new(),
            rows: Vec::new(),
            cache,
            requests: HashMap::new(),
            reserved: 0,
            next_id: 0,
            #[cfg(test)]
            fail_above_rows: None,
            #[cfg(test)]
            fail_sampling_above_rows: None,
        }
    }

    pub fn model(&self) -> &Arc<Gpt2> {
        &self.model
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Live rows (sequences being decoded).
    pub fn live_rows(&self) -> usize {
        self.rows.len()
    }

    /// The row limit in force (lower than configured after an out-of-memory error).
    pub fn row_limit(&self) -> usize {
        self.row_limit
    }

    /// Requests not finished.
    pub fn pending_requests(&self) -> usize {
        self.requests.len()
    }

    /// Samples not started yet.
    pub fn pending_samples(&self) -> usize {
        self.queue.iter().map(|w| w.pending.len()).sum::<usize>()
            + self
                .groups
                .iter()
                .map(|g| g.work.pending.len())
                .sum::<usize>()
    }

    /// KV tokens reserved for the work admitted (see [`EngineConfig::max_kv_tokens`]).
    pub fn reserved_kv_tokens(&self) -> usize {
        self.reserved
    }

    pub fn has_work(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Checks a request against the model and the limits, then queues it. Nothing is
    /// queued when it is refused.
    pub fn submit(&mut self, request: Request) -> Result<RequestId, EngineError> {
        request.validate(&self.model, &self.cfg)?;
        let id = self.next_id;
        self.next_id += 1;
        let request = Arc::new(request);
        for (i, p) in request.prompts.iter().enumerate() {
            self.queue.push_back(PromptWork {
                request: id,
                prompt_index: i as u32,
                ids: p.as_slice().into(),
                pending: (0..request.n as u32).collect(),
            });
        }
        let remaining = request.prompts.len() * request.n;
        self.requests
            .insert(id, RequestState { request, remaining });
        Ok(id)
    }

    /// Drops a request's queued and live work; it emits nothing more.
    pub fn cancel(&mut self, id: RequestId) -> Result<(), EngineError> {
        if self.requests.remove(&id).is_none() {
            return Ok(());
        }
        self.queue.retain(|w| w.request != id);
        for g in &mut self.groups {
            if g.work.request == id {
                g.work.pending.clear();
            }
        }
        for r in (0..self.rows.len()).rev() {
            if self.rows[r].request == id {
                self.remove_row(r)?;
            }
        }
        self.drop_idle_groups()
    }

    /// Replaces the model for the steps to come and leaves the work in flight as it is:
    /// live rows go on from their cached keys and values, prompts prefilled by the old
    /// weights keep their first logits, and each token sampled from now on is tagged
    /// with `version` ([`SwapPolicy::Continue`](crate::SwapPolicy::Continue)). Returns the
    /// model replaced.
    pub fn continue_with(&mut self, model: Arc<Gpt2>, version: u64) -> Arc<Gpt2> {
        self.version = version;
        std::mem::replace(&mut self.model, model)
    }

    /// Replaces the model. Work not finished restarts from its prompt under the new
    /// weights (its completions so far are discarded, never mixed); finished completions
    /// keep the version they were made with. Returns the model replaced.
    pub fn set_model(&mut self, model: Arc<Gpt2>, version: u64) -> Arc<Gpt2> {
        let mut requeue: Vec<PromptWork> = Vec::new();
        for g in self.groups.drain(..) {
            let mut work = g.work;
            let mut restarted: Vec<u32> = self
                .rows
                .iter()
                .filter(|r| r.request == work.request && r.prompt_index == work.prompt_index)
                .map(|r| r.sample)
                .collect();
            restarted.extend(work.pending.drain(..));
            restarted.sort_unstable();
            work.pending = restarted.into();
            requeue.push(work);
        }
        for work in requeue.into_iter().rev() {
            self.queue.push_front(work);
        }
        self.rows.clear();
        self.cache.clear();
        self.reserved = 0;
        self.version = version;
        std::mem::replace(&mut self.model, model)
    }

    /// Steps until every request is done; returns the samples by (request, prompt,
    /// sample) and the summed step statistics. A failed request is an error.
    pub fn run_to_completion(&mut self) -> Result<(Vec<FinishedSample>, StepStats), EngineError> {
        self.run_reporting(|| false, |_| {})
    }

    /// [`Self::run_to_completion`], checking `stop` before every step — once it says
    /// stop, the run returns the samples finished so far and leaves the rest of the work
    /// where it is ([`Self::has_work`] tells the two endings apart) — and telling
    /// `progress` how many samples have finished after every step that finished one.
    pub fn run_reporting(
        &mut self,
        stop: impl Fn() -> bool,
        mut progress: impl FnMut(usize),
    ) -> Result<(Vec<FinishedSample>, StepStats), EngineError> {
        let (mut samples, mut total) = (Vec::new(), StepStats::default());
        while self.has_work() {
            if stop() {
                break;
            }
            let (events, stats) = self.step(true);
            total.prefill_tokens += stats.prefill_tokens;
            total.prefill_seconds += stats.prefill_seconds;
            total.first_tokens += stats.first_tokens;
            total.decode_rows += stats.decode_rows;
            total.decode_seconds += stats.decode_seconds;
            total.decode_forward_seconds += stats.decode_forward_seconds;
            total.decode_sample_seconds += stats.decode_sample_seconds;
            let before = samples.len();
            for event in events {
                match event {
                    Event::Sample(s) => samples.push(s),
                    Event::Done(_) => {}
                    Event::Failed(_, why) => return Err(EngineError::Failed(why)),
                }
            }
            if samples.len() > before {
                progress(samples.len());
            }
        }
        samples.sort_by_key(|s| (s.request, s.prompt_index, s.sample_index));
        Ok((samples, total))
    }

    /// One scheduling round: admits work into free rows (when `admit`), then decodes one
    /// token for every live row. Returns what finished.
    pub fn step(&mut self, admit: bool) -> (Vec<Event>, StepStats) {
        let mut events = Vec::new();
        let mut stats = StepStats::default();
        if admit && let Err(e) = self.admit(&mut events, &mut stats) {
            self.fail_everything(&e, &mut events);
            return (events, stats);
        }
        if !self.rows.is_empty()
            && let Err(e) = self.decode(&mut events, &mut stats)
        {
            self.fail_everything(&e, &mut events);
        }
        (events, stats)
    }

    /// Fills free rows: first samples of prompts already held, then new prompts.
    fn admit(&mut self, events: &mut Vec<Event>, stats: &mut StepStats) -> Result<(), EngineError> {
        for g in 0..self.groups.len() {
            if self.fill_rows(g, events, stats)? {
                return Ok(());
            }
        }
        // New prompts, prefilled together.
        let mut batch: Vec<PromptWork> = Vec::new();
        let (mut tokens, mut reserve) = (0, self.reserved);
        while let Some(work) = self.queue.front() {
            let need = work.ids.len() + self.budget(work);
            let rows_free = self.row_limit.saturating_sub(self.rows.len());
            if batch.len() >= rows_free
                || reserve + need > self.cfg.max_kv_tokens
                || (!batch.is_empty() && tokens + work.ids.len() > self.prefill_limit)
            {
                break;
            }
            tokens += work.ids.len();
            reserve += need;
            batch.push(self.queue.pop_front().expect("front"));
        }
        if batch.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let first = match self.prefill(&mut batch) {
            Ok(first) => first,
            Err(e) if is_out_of_memory(&e) && batch.len() > 1 => {
                self.prefill_limit = (tokens / 2).max(1);
                tracing::warn!(
                    prompts = batch.len(),
                    limit = self.prefill_limit,
                    "out of memory in prefill; halving"
                );
                for work in batch.into_iter().rev() {
                    self.queue.push_front(work);
                }
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        stats.prefill_seconds += started.elapsed().as_secs_f64();
        stats.prefill_tokens += tokens;
        for (work, first_logits) in batch.into_iter().zip(first) {
            self.reserved += work.ids.len();
            self.groups.push(Group {
                work,
                first_logits,
                prefilled_by: self.version,
                live: 0,
            });
            self.fill_rows(self.groups.len() - 1, events, stats)?;
        }
        self.drop_idle_groups()?;
        Ok(())
    }

    /// Starts group g's pending samples while rows are free and their token budgets fit;
    /// returns true when it stopped at the KV-token bound.
    fn fill_rows(
        &mut self,
        g: usize,
        events: &mut Vec<Event>,
        stats: &mut StepStats,
    ) -> Result<bool, EngineError> {
        while self.rows.len() < self.row_limit && !self.groups[g].work.pending.is_empty() {
            let budget = self.budget(&self.groups[g].work);
            if self.reserved + budget > self.cfg.max_kv_tokens {
                return Ok(true);
            }
            self.start_sample(g, events, stats)?;
        }
        Ok(false)
    }

    /// Prefills `batch` into new cache groups; returns each prompt's next-token logits.
    /// Prompts run in batches of equal length, with no padding, so a prompt's cache and
    /// logits are what it gets prefilled alone, bit for bit, whatever else is admitted
    /// with it. `batch` is reordered (stably, by length) into cache order.
    fn prefill(&mut self, batch: &mut [PromptWork]) -> Result<Vec<Vec<f32>>, EngineError> {
        batch.sort_by_key(|w| w.ids.len());
        let device = self.model.device();
        let mut prefilled = Vec::new();
        for same in batch.chunk_by(|a, b| a.ids.len() == b.ids.len()) {
            let flat: Vec<u32> = same.iter().flat_map(|w| w.ids.iter().copied()).collect();
            let ids = Tensor::from_vec(flat, (same.len(), same[0].ids.len()), device)?; // (P, L)
            let padding = LeftPadding::none(same.len());
            let mut kv = self.model.new_cache();
            let logits = self
                .model
                .forward_last(&ids, &padding, &mut kv)?
                .to_vec2::<f32>()?; // (P, V)
            prefilled.push((kv, padding, logits));
        }
        // Only now, with every forward done, does the cache change.
        let mut logits = Vec::with_capacity(batch.len());
        for (kv, padding, l) in prefilled {
            self.cache.add_groups(&kv, &padding)?;
            logits.extend(l);
        }
        Ok(logits)
    }

    /// Most tokens a sample of `work` may produce.
    fn budget(&self, work: &PromptWork) -> usize {
        let request = &self.requests[&work.request].request;
        let context = self.model.config().n_positions;
        request.max_new_tokens.min(context + 1 - work.ids.len())
    }

    /// Draws the first token of group g's next pending sample; the sample either ends
    /// there or takes a row.
    fn start_sample(
        &mut self,
        g: usize,
        events: &mut Vec<Event>,
        stats: &mut StepStats,
    ) -> Result<(), EngineError> {
        stats.first_tokens += 1;
        let budget = self.budget(&self.groups[g].work);
        let group = &mut self.groups[g];
        let sample = group.work.pending.pop_front().expect("a pending sample");
        let request = self.requests[&group.work.request].request.clone();
        let stream = (u64::from(group.work.prompt_index) << 32) | u64::from(sample);
        let mut sampler = Sampler::new(request.sampling, request.seed, stream);
        let first = sampler.sample(&group.first_logits)?;
        let mut row = Row {
            request: group.work.request,
            prompt_index: group.work.prompt_index,
            sample,
            sampler,
            completion: Completion {
                ids: vec![first.token],
                logprobs: vec![first.logprob],
                finish_reason: FinishReason::Length,
            },
            versions: vec![group.prefilled_by],
            budget,
        };
        if let Some(reason) = self.finished(&row, &request) {
            row.completion.finish_reason = reason;
            self.emit(row, events);
            return Ok(());
        }
        self.groups[g].live += 1;
        self.reserved += budget;
        self.cache.add_row(g);
        self.rows.push(row);
        Ok(())
    }

    fn finished(&self, row: &Row, request: &Request) -> Option<FinishReason> {
        let eos = self.model.config().eos_token_id;
        if !request.ignore_eos && row.completion.ids.last() == Some(&eos) {
            Some(FinishReason::Eos)
        } else if row.completion.ids.len() >= row.budget {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Takes row r out of the batch (the last row moves into its place).
    fn remove_row(&mut self, r: usize) -> Result<Row, EngineError> {
        let g = self.cache.row_group(r);
        self.cache.swap_remove_row(r)?;
        self.groups[g].live -= 1;
        let row = self.rows.swap_remove(r);
        self.reserved -= row.budget;
        Ok(row)
    }

    /// Releases the prompts with no live row and no pending sample.
    fn drop_idle_groups(&mut self) -> Result<(), EngineError> {
        let keep: Vec<bool> = self
            .groups
            .iter()
            .map(|g| {
                g.live > 0
                    || (!g.work.pending.is_empty() && self.requests.contains_key(&g.work.request))
            })
            .collect();
        if keep.iter().all(|&k| k) {
            return Ok(());
        }
        self.cache.retain_groups(&keep)?;
        let mut k = keep.iter();
        let reserved = &mut self.reserved;
        self.groups.retain(|g| {
            let kept = *k.next().expect("one flag per group");
            if !kept {
                *reserved -= g.work.ids.len();
            }
            kept
        });
        Ok(())
    }

    fn emit(&mut self, row: Row, events: &mut Vec<Event>) {
        let Some(state) = self.requests.get_mut(&row.request) else {
            return;
        };
        state.remaining -= 1;
        let done = state.remaining == 0;
        events.push(Event::Sample(FinishedSample {
            request: row.request,
            prompt_index: row.prompt_index,
            sample_index: row.sample,
            weight_version: row.versions[0],
            token_versions: if row.versions.iter().all(|&v| v == row.versions[0]) {
                Vec::new()
            } else {
                row.versions
            },
            completion: row.completion,
        }));
        if done {
            self.requests.remove(&row.request);
            events.push(Event::Done(row.request));
        }
    }

    /// An error no retry can fix (e.g. out of memory with a single row): every request
    /// fails with it and the engine starts empty.
    fn fail_everything(&mut self, e: &EngineError, events: &mut Vec<Event>) {
        tracing::error!(error = %e, "generation failed; failing all requests");
        let mut ids: Vec<RequestId> = self.requests.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            events.push(Event::Failed(id, e.to_string()));
        }
        self.requests.clear();
        self.queue.clear();
        self.groups.clear();
        self.rows.clear();
        self.cache.clear();
        self.reserved = 0;
    }
}

mod decode;
#[cfg(test)]
mod tests;

pub use decode::is_out_of_memory;
