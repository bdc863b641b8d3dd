//! Every metric the rollout worker exports, described in one place, and the exporter.

use std::net::SocketAddr;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use rookworld_lm::generate::FinishReason;
use rookworld_proto::metrics_http::MetricsError;

use crate::engine::{EngineStatus, StepStats};

/// Every metric name of this crate, once: the describe calls and the recording sites use
/// these.
pub mod names {
    pub const BATCH_OCCUPANCY_RATIO: &str = "rollout_batch_occupancy_ratio";
    pub const BATCH_ROW_LIMIT: &str = "rollout_batch_row_limit";
    pub const BATCH_ROWS: &str = "rollout_batch_rows";
    pub const BUILD_INFO: &str = "rollout_build_info";
    pub const CALL_RETRIES_TOTAL: &str = "rollout_call_retries_total";
    pub const CUDA_KERNEL_FALLBACK: &str = "rollout_cuda_kernel_fallback";
    pub const COMPLETIONS_TOTAL: &str = "rollout_completions_total";
    pub const DECODE_STEP_SECONDS: &str = "rollout_decode_step_seconds";
    pub const GPU_MEMORY_BUSY_RATIO: &str = "rollout_gpu_memory_busy_ratio";
    pub const GPU_MEMORY_TOTAL_BYTES: &str = "rollout_gpu_memory_total_bytes";
    pub const GPU_MEMORY_USED_BYTES: &str = "rollout_gpu_memory_used_bytes";
    pub const GPU_POWER_WATTS: &str = "rollout_gpu_power_watts";
    pub const GPU_UTILIZATION_RATIO: &str = "rollout_gpu_utilization_ratio";
    pub const KV_TOKENS_RESERVED: &str = "rollout_kv_tokens_reserved";
    pub const PEER_REACHABLE: &str = "rollout_peer_reachable";
    pub const PENDING_REQUESTS: &str = "rollout_pending_requests";
    pub const PENDING_SAMPLES: &str = "rollout_pending_samples";
    pub const PREFILL_SECONDS: &str = "rollout_prefill_seconds";
    pub const PREFILL_TOKENS_TOTAL: &str = "rollout_prefill_tokens_total";
    pub const TOKENS_GENERATED_TOTAL: &str = "rollout_tokens_generated_total";
    pub const WEIGHT_UPDATE_BYTES_TOTAL: &str = "rollout_weight_update_bytes_total";
    pub const WEIGHT_UPDATE_SECONDS: &str = "rollout_weight_update_seconds";
    pub const WEIGHT_UPDATES_TOTAL: &str = "rollout_weight_updates_total";
    pub const WEIGHT_VERSION: &str = "rollout_weight_version";
}

/// Buckets (seconds) for decode steps, prefills and weight updates.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Serves `/metrics` on `addr` (read-only) and describes every metric.
pub fn install_exporter(addr: SocketAddr) -> Result<SocketAddr, MetricsError> {
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?;
    let bound = rookworld_proto::metrics_http::install(builder, addr)?;
    describe();
    Ok(bound)
}

/// The CUDA kernels the start-up check turned off so far (once a device is open).
pub fn record_kernel_fallbacks() {
    for kernel in rookworld_lm::kernels::SWITCHES.disabled() {
        gauge!(names::CUDA_KERNEL_FALLBACK, "kernel" => kernel.name()).set(1.0);
    }
}

/// Descriptions of every metric (labels come from bounded sets).
pub fn describe() {
    rookworld_proto::tls::describe_metrics();
    describe_gauge!(
        names::CUDA_KERNEL_FALLBACK,
        Unit::Count,
        "1 for each of this project's CUDA kernels (label kernel) that failed its start-up check against its reference: that op runs candle's ops instead (--strict-kernels exits instead)."
    );
    record_kernel_fallbacks();
    let features = if cfg!(feature = "cuda") { "cuda" } else { "" };
    rookworld_proto::metrics_http::build_info(
        names::BUILD_INFO,
        env!("CARGO_PKG_VERSION"),
        features,
    );
    describe_counter!(
        names::TOKENS_GENERATED_TOTAL,
        Unit::Count,
        "New tokens sampled."
    );
    describe_gauge!(
        names::BATCH_OCCUPANCY_RATIO,
        "Live sequences divided by the configured maximum (max_seqs)."
    );
    describe_gauge!(names::BATCH_ROWS, Unit::Count, "Sequences being decoded.");
    describe_gauge!(
        names::BATCH_ROW_LIMIT,
        Unit::Count,
        "Row limit in force (halved after an out-of-memory error)."
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
    describe_gauge!(
        names::KV_TOKENS_RESERVED,
        Unit::Count,
        "KV-cache tokens reserved by admitted work."
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
    describe_histogram!(
        names::DECODE_STEP_SECONDS,
        Unit::Seconds,
        "Duration of one decode step; `_sum` is the total decode time."
    );
    describe_counter!(
        names::COMPLETIONS_TOTAL,
        "Completions finished, by `finish_reason` (eos, length)."
    );
    describe_gauge!(names::WEIGHT_VERSION, "Version of the weights in use.");
    describe_histogram!(
        names::WEIGHT_UPDATE_SECONDS,
        Unit::Seconds,
        "Duration of an UpdateWeights call, first chunk to swap."
    );
    describe_counter!(
        names::WEIGHT_UPDATE_BYTES_TOTAL,
        Unit::Bytes,
        "Weight bytes received by UpdateWeights."
    );
    describe_counter!(
        names::WEIGHT_UPDATES_TOTAL,
        "UpdateWeights calls by `result` (ok, unauthenticated, permission_denied, invalid, interrupted, checksum, stale, failed)."
    );
    describe_gauge!(
        names::PEER_REACHABLE,
        "1 while the worker loop reaches its `peer` (learner, reward), 0 while it retries."
    );
    describe_counter!(
        names::CALL_RETRIES_TOTAL,
        "Worker-loop calls retried because the peer was unreachable, by `call`."
    );
    // Counters that move only on faults exist from the start (at 0), for dashboards.
    for call in ["lease", "score", "submit"] {
        counter!(names::CALL_RETRIES_TOTAL, "call" => call).increment(0);
    }
    describe_gauge!(
        names::GPU_MEMORY_USED_BYTES,
        Unit::Bytes,
        "GPU memory in use (CUDA only)."
    );
    describe_gauge!(
        names::GPU_MEMORY_TOTAL_BYTES,
        Unit::Bytes,
        "GPU memory in total (CUDA only)."
    );
    describe_gauge!(
        names::GPU_UTILIZATION_RATIO,
        "Fraction of time a kernel ran on the worker's GPU (CUDA with NVML only)."
    );
    describe_gauge!(
        names::GPU_MEMORY_BUSY_RATIO,
        "Fraction of time the GPU's memory was read or written (CUDA with NVML only)."
    );
    describe_gauge!(
        names::GPU_POWER_WATTS,
        "Power draw of the worker's GPU (CUDA with NVML only)."
    );
}

pub fn set_weight_version(version: u64) {
    gauge!(names::WEIGHT_VERSION).set(version as f64);
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

/// Publishes one NVML reading of the worker's GPU.
pub fn set_gpu(sample: &crate::gpu::GpuSample) {
    gauge!(names::GPU_UTILIZATION_RATIO).set(sample.utilization);
    gauge!(names::GPU_MEMORY_BUSY_RATIO).set(sample.memory_busy);
    if let Some(watts) = sample.power_watts {
        gauge!(names::GPU_POWER_WATTS).set(watts);
    }
}

/// Records one UpdateWeights call.
pub fn record_weight_update(result: &'static str, bytes: usize, seconds: f64) {
    counter!(names::WEIGHT_UPDATES_TOTAL, "result" => result).increment(1);
    counter!(names::WEIGHT_UPDATE_BYTES_TOTAL).increment(bytes as u64);
    if result == "ok" {
        histogram!(names::WEIGHT_UPDATE_SECONDS).record(seconds);
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
