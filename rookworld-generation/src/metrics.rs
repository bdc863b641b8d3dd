//! The generation engine's Prometheus metrics, described in one place: its names (the
//! rollout worker's, which serves it), their descriptions, and the recording calls the
//! engine thread makes. Labels come from bounded sets.

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use rookworld_lm::generate::FinishReason;

use crate::{EngineStatus, StepStats, SwapTiming};

/// Every metric name the engine records, once.
pub mod names {
    pub const BATCH_OCCUPANCY_RATIO: &str = "rollout_batch_occupancy_ratio";
    pub const BATCH_ROW_LIMIT: &str = "rollout_batch_row_limit";
    pub const BATCH_ROWS: &str = "rollout_batch_rows";
    pub const COMPLETIONS_TOTAL: &str = "rollout_completions_total";
    pub const DECODE_STEP_SECONDS: &str = "rollout_decode_step_seconds";
    pub const GPU_MEMORY_TOTAL_BYTES: &str = "rollout_gpu_memory_total_bytes";
    pub const GPU_MEMORY_USED_BYTES: &str = "rollout_gpu_memory_used_bytes";
    pub const KV_TOKENS_RESERVED: &str = "rollout_kv_tokens_reserved";
    pub const PENDING_REQUESTS: &str = "rollout_pending_requests";
    pub const PENDING_SAMPLES: &str = "rollout_pending_samples";
    pub const PREFILL_SECONDS: &str = "rollout_prefill_seconds";
    pub const PREFILL_TOKENS_TOTAL: &str = "rollout_prefill_tokens_total";
    pub const TOKENS_GENERATED_TOTAL: &str = "rollout_tokens_generated_total";
    pub const WEIGHT_SWAP_HELD_STEPS: &str = "rollout_weight_swap_held_steps";
    pub const WEIGHT_SWAP_PAUSE_SECONDS: &str = "rollout_weight_swap_pause_seconds";
    pub const WEIGHT_SWAP_PAUSE_STEPS: &str = "rollout_weight_swap_pause_steps";
    pub const WEIGHT_SWAP_WAIT_SECONDS: &str = "rollout_weight_swap_wait_seconds";
    pub const WEIGHT_VERSION: &str = "rollout_weight_version";
}

/// Buckets (seconds) for decode steps and prefills (the rollout worker's weight updates
/// use them too).
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Buckets (decode steps) for what a weight swap held or paused, and the histograms
/// counted in them.
pub const STEPS_BUCKETS: &[f64] = &[
    0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0,
];
pub const STEPS_HISTOGRAMS: [&str; 2] = [
    names::WEIGHT_SWAP_HELD_STEPS,
    names::WEIGHT_SWAP_PAUSE_STEPS,
];

/// Descriptions of the engine's metrics.
pub fn describe() {
    describe_gauge!(
        names::BATCH_OCCUPANCY_RATIO,
        "Live sequences divided by the configured maximum (max_seqs)."
    );
    describe_gauge!(
        names::BATCH_ROW_LIMIT,
        Unit::Count,
        "Row limit in force (halved after an out-of-memory error)."
    );
    describe_gauge!(names::BATCH_ROWS, Unit::Count, "Sequences being decoded.");
    describe_counter!(
        names::COMPLETIONS_TOTAL,
        "Completions finished, by `finish_reason` (eos, length)."
    );
    describe_histogram!(
        names::DECODE_STEP_SECONDS,
        Unit::Seconds,
        "Duration of one decode step; `_sum` is the total decode time."
    );
    describe_gauge!(
        names::GPU_MEMORY_TOTAL_BYTES,
        Unit::Bytes,
        "GPU memory in total (CUDA only)."
    );
    describe_gauge!(
        names::GPU_MEMORY_USED_BYTES,
        Unit::Bytes,
        "GPU memory in use (CUDA only)."
    );
    describe_gauge!(
        names::KV_TOKENS_RESERVED,
        Unit::Count,
        "KV-cache tokens reserved by admitted work."
    );
    describe_gauge!(
        names::PENDING_REQUESTS,
        Unit::Count,
        "Generate requests not finished."
    );
    describe_gauge!(
        names::PENDING_SAMPLES,
        Unit::Count,
        "Samples not started yet."
    );
    describe_histogram!(
        names::PREFILL_SECONDS,
        Unit::Seconds,
        "Duration of one prefill (the prompts admitted in a step); `_sum` is the total."
    );
    describe_counter!(
        names::PREFILL_TOKENS_TOTAL,
        Unit::Count,
        "Prompt tokens prefilled."
    );
    describe_counter!(
        names::TOKENS_GENERATED_TOTAL,
        Unit::Count,
        "New tokens sampled."
    );
    describe_histogram!(
        names::WEIGHT_SWAP_HELD_STEPS,
        Unit::Count,
        "Decode steps run on the old weights with no work admitted while a weight swap waited (drain policy)."
    );
    describe_histogram!(
        names::WEIGHT_SWAP_PAUSE_SECONDS,
        Unit::Seconds,
        "Decoding stood still around a weight swap: from the last step on the old weights to the first on the new."
    );
    describe_histogram!(
        names::WEIGHT_SWAP_PAUSE_STEPS,
        Unit::Count,
        "A weight swap's pause in decode steps (the pause over the last step's duration)."
    );
    describe_histogram!(
        names::WEIGHT_SWAP_WAIT_SECONDS,
        Unit::Seconds,
        "From a weight swap being staged to the new weights in use."
    );
    describe_gauge!(names::WEIGHT_VERSION, "Version of the weights in use.");
}

pub fn set_weight_version(version: u64) {
    gauge!(names::WEIGHT_VERSION).set(version as f64);
}

pub fn record_swap(t: &SwapTiming) {
    histogram!(names::WEIGHT_SWAP_HELD_STEPS).record(f64::from(t.held_steps));
    histogram!(names::WEIGHT_SWAP_PAUSE_SECONDS).record(t.pause_seconds);
    histogram!(names::WEIGHT_SWAP_PAUSE_STEPS).record(t.pause_steps());
    histogram!(names::WEIGHT_SWAP_WAIT_SECONDS).record(t.wait_seconds);
}

pub fn record_completion(reason: FinishReason) {
    counter!(names::COMPLETIONS_TOTAL, "finish_reason" => reason.as_str()).increment(1);
}

pub fn record_step(new_tokens: usize, stats: &StepStats) {
    counter!(names::TOKENS_GENERATED_TOTAL).increment(new_tokens as u64);
    counter!(names::PREFILL_TOKENS_TOTAL).increment(stats.prefill_tokens as u64);
    if stats.prefill_tokens > 0 {
        histogram!(names::PREFILL_SECONDS).record(stats.prefill_seconds);
    }
    if stats.decode_rows > 0 {
        histogram!(names::DECODE_STEP_SECONDS).record(stats.decode_seconds);
    }
}

/// Publishes the engine's load (and the GPU's memory on CUDA).
pub fn set_load(status: &EngineStatus, device: &candle_core::Device) {
    gauge!(names::BATCH_ROWS).set(status.live_rows as f64);
    gauge!(names::BATCH_ROW_LIMIT).set(status.row_limit as f64);
    gauge!(names::BATCH_OCCUPANCY_RATIO)
        .set(status.live_rows as f64 / status.max_seqs.max(1) as f64);
    gauge!(names::PENDING_REQUESTS).set(status.pending_requests as f64);
    gauge!(names::PENDING_SAMPLES).set(status.pending_samples as f64);
    gauge!(names::KV_TOKENS_RESERVED).set(status.reserved_kv_tokens as f64);
    if let Some((free, total)) = gpu_memory(device) {
        gauge!(names::GPU_MEMORY_USED_BYTES).set((total - free) as f64);
        gauge!(names::GPU_MEMORY_TOTAL_BYTES).set(total as f64);
    }
}

/// (free, total) bytes of the device's memory; `None` off CUDA.
pub fn gpu_memory(device: &candle_core::Device) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return d.cuda_stream().context().mem_get_info().ok();
    }
    let _ = device;
    None
}
