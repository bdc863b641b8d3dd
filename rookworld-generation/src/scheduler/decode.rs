//! The decode step: every live row's next token (forward over the grouped cache, then
//! sampling on the logits' device or the host), and the back-off after an out-of-memory
//! error.

use std::time::Instant;

use candle_core::Tensor;
use rayon::prelude::*;
use rookworld_lm::device_sampling;
use rookworld_lm::sampling::Sampled;

use super::Scheduler;
use crate::{EngineError, Event, StepStats};

impl Scheduler {
    /// One decode step for every live row; rows that finish leave.
    pub(super) fn decode(
        &mut self,
        events: &mut Vec<Event>,
        stats: &mut StepStats,
    ) -> Result<(), EngineError> {
        let started = Instant::now();
        let ids: Vec<u32> = self
            .rows
            .iter()
            .map(|r| *r.completion.ids.last().expect("a live row has a token"))
            .collect();
        let Some(sampled) = self.step_rows(&ids, stats)? else {
            return Ok(()); // rows were shed; they restart later
        };
        for (row, s) in self.rows.iter_mut().zip(sampled) {
            row.completion.ids.push(s.token);
            row.completion.logprobs.push(s.logprob);
            row.versions.push(self.version);
        }
        stats.decode_seconds += started.elapsed().as_secs_f64();
        stats.decode_rows = ids.len();
        for r in (0..self.rows.len()).rev() {
            let request = self.requests[&self.rows[r].request].request.clone();
            if let Some(reason) = self.finished(&self.rows[r], &request) {
                let row = self.remove_row(r)?;
                let mut row = row;
                row.completion.finish_reason = reason;
                self.emit(row, events);
            }
        }
        self.drop_idle_groups()
    }

    /// Every live row's next token: one captured step where the model runs them
    /// ([`rookworld_lm::Gpt2::decode_sampled`]), else the forward, then sampling. `None`
    /// when an out-of-memory error shed rows instead.
    fn step_rows(
        &mut self,
        ids: &[u32],
        stats: &mut StepStats,
    ) -> Result<Option<Vec<Sampled>>, EngineError> {
        let forward = Instant::now();
        if self.model.decode_graph_applies(&self.cache) {
            let marks: Vec<u128> = self.rows.iter().map(|r| r.sampler.position()).collect();
            let draws: Vec<_> = self.rows.iter_mut().map(|r| r.sampler.draw()).collect();
            let outcome = self.model.decode_sampled(ids, &draws, &mut self.cache);
            if !matches!(outcome, Ok(Some(_))) {
                // Not run (or failed): the draws are taken back, as if never made.
                for (row, mark) in self.rows.iter_mut().zip(&marks) {
                    row.sampler.rewind(*mark);
                }
            }
            match outcome.map_err(EngineError::Model) {
                Ok(Some(sampled)) => {
                    // The graph samples inside the step: its time is the forward's.
                    stats.decode_forward_seconds += forward.elapsed().as_secs_f64();
                    return Ok(Some(sampled));
                }
                Ok(None) => {}
                Err(e) if is_out_of_memory(&e) && self.rows.len() > 1 => {
                    self.shed_rows(self.rows.len() / 2)?;
                    return Ok(None);
                }
                Err(e) => return Err(e),
            }
        }
        let logits = match self.forward_rows(ids) {
            Ok(logits) => logits,
            Err(e) if is_out_of_memory(&e) && self.rows.len() > 1 => {
                self.shed_rows(self.rows.len() / 2)?;
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        // The draws are taken back with the step if sampling runs out of memory (its
        // buffers are allocated after the draws): the shed rows' streams and the kept
        // rows' cache stand as before the step, so the output is unchanged.
        let marks: Vec<u128> = self.rows.iter().map(|r| r.sampler.position()).collect();
        let sampling = Instant::now();
        stats.decode_forward_seconds += (sampling - forward).as_secs_f64();
        let sampled = match self.sample_rows(&logits) {
            Ok(sampled) => sampled,
            Err(e) if is_out_of_memory(&e) && self.rows.len() > 1 => {
                for (row, mark) in self.rows.iter_mut().zip(marks) {
                    row.sampler.rewind(mark);
                }
                self.cache.undo_step();
                self.shed_rows(self.rows.len() / 2)?;
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        stats.decode_sample_seconds += sampling.elapsed().as_secs_f64();
        Ok(Some(sampled))
    }

    /// Next-token logits (B, V) of every live row, on the model's device.
    fn forward_rows(&mut self, ids: &[u32]) -> Result<Tensor, EngineError> {
        #[cfg(test)]
        if self.fail_above_rows.is_some_and(|n| ids.len() > n) {
            return Err(EngineError::Model(rookworld_lm::Error::Candle(
                candle_core::Error::Msg(
                    "CUDA_ERROR_OUT_OF_MEMORY: out of memory (injected)".into(),
                ),
            )));
        }
        Ok(self.model.decode_grouped(ids, &mut self.cache)?)
    }

    /// Draws every live row's next token from its logits (B, V). On CUDA one kernel
    /// draws them all and only tokens and log-probabilities cross to the host; elsewhere
    /// rows sample on the host in parallel. Either way each row draws from its own
    /// seeded stream, so the result depends neither on the thread nor on the batch.
    fn sample_rows(&mut self, logits: &Tensor) -> Result<Vec<Sampled>, EngineError> {
        let sampled = self.sample_rows_now(logits);
        #[cfg(test)]
        if self
            .fail_sampling_above_rows
            .is_some_and(|n| self.rows.len() > n)
        {
            // After the draws, as the device path's buffers are allocated.
            return Err(EngineError::Model(rookworld_lm::Error::Candle(
                candle_core::Error::Msg(
                    "CUDA_ERROR_OUT_OF_MEMORY: out of memory (injected)".into(),
                ),
            )));
        }
        sampled
    }

    fn sample_rows_now(&mut self, logits: &Tensor) -> Result<Vec<Sampled>, EngineError> {
        if device_sampling::supported(logits.device(), self.model.kernels()) {
            let draws: Vec<_> = self.rows.iter_mut().map(|r| r.sampler.draw()).collect();
            return Ok(device_sampling::sample_rows(logits, &draws)?);
        }
        let logits = logits.flatten_all()?.to_vec1::<f32>()?;
        let vocab = logits.len() / self.rows.len();
        Ok(self
            .rows
            .par_iter_mut()
            .zip(logits.par_chunks(vocab))
            .map(|(row, logits)| row.sampler.sample(logits))
            .collect::<Result<_, _>>()?)
    }

    /// After an out-of-memory error: keeps the first `keep` rows; the others restart later
    /// from their prompt (their streams replay the same tokens) and the row limit drops.
    fn shed_rows(&mut self, keep: usize) -> Result<(), EngineError> {
        tracing::warn!(
            rows = self.rows.len(),
            keep,
            "out of memory in decode; halving the batch"
        );
        self.row_limit = keep.max(1);
        while self.rows.len() > keep {
            let r = self.rows.len() - 1;
            let row = self.remove_row(r)?;
            let g = self
                .groups
                .iter()
                .position(|g| {
                    g.work.request == row.request && g.work.prompt_index == row.prompt_index
                })
                .expect("a live row's group is held");
            self.groups[g].work.pending.push_front(row.sample);
        }
        Ok(())
    }
}

/// Whether `e` is a device out-of-memory error (CUDA reports `CUDA_ERROR_OUT_OF_MEMORY`).
pub fn is_out_of_memory(e: &EngineError) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    text.contains("out of memory") || text.contains("out_of_memory")
}
