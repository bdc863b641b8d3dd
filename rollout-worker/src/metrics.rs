//! Every metric the rollout worker exports, described in one place, and the exporter.

use std::net::SocketAddr;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use rookworld_lm::generate::FinishReason;
use rookworld_proto::metrics_http::MetricsError;

use crate::engine::{EngineStatus, StepStats};

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

/// Descriptions of every metric (labels come from bounded sets).
pub fn describe() {
    rookworld_proto::tls::describe_metrics();
    let features = if cfg!(feature = "cuda") { "cuda" } else { "" };
    rookworld_proto::metrics_http::build_info(
        "rollout_build_info",
        env!("CARGO_PKG_VERSION"),
        features,
    );
    describe_counter!(
        "rollout_tokens_generated_total",
        Unit::Count,
        "New tokens sampled."
    );
    describe_gauge!(
        "rollout_batch_occupancy_ratio",
        "Live sequences divided by the configured maximum (max_seqs)."
    );
    describe_gauge!(
        "rollout_batch_rows",
        Unit::Count,
        "Sequences being decoded."
    );
    describe_gauge!(
        "rollout_batch_row_limit",
        Unit::Count,
        "Row limit in force (halved after an out-of-memory error)."
    );
    describe_gauge!(
        "rollout_pending_requests",
        Unit::Count,
        "Generate requests not finished."
    );
    describe_gauge!(
        "rollout_pending_samples",
        Unit::Count,
        "Samples not started yet."
    );
    describe_gauge!(
        "rollout_kv_tokens_reserved",
        Unit::Count,
        "KV-cache tokens reserved by admitted work."
    );
    describe_histogram!(
        "rollout_prefill_seconds",
        Unit::Seconds,
        "Duration of one prefill (the prompts admitted in a step); `_sum` is the total."
    );
    describe_counter!(
        "rollout_prefill_tokens_total",
        Unit::Count,
        "Prompt tokens prefilled."
    );
    describe_histogram!(
        "rollout_decode_step_seconds",
        Unit::Seconds,
        "Duration of one decode step; `_sum` is the total decode time."
    );
    describe_counter!(
        "rollout_completions_total",
        "Completions finished, by `finish_reason` (eos, length)."
    );
    describe_gauge!("rollout_weight_version", "Version of the weights in use.");
    describe_histogram!(
        "rollout_weight_update_seconds",
        Unit::Seconds,
        "Duration of an UpdateWeights call, first chunk to swap."
    );
    describe_counter!(
        "rollout_weight_update_bytes_total",
        Unit::Bytes,
        "Weight bytes received by UpdateWeights."
    );
    describe_counter!(
        "rollout_weight_updates_total",
        "UpdateWeights calls by `result` (ok, unauthenticated, permission_denied, invalid, interrupted, checksum, stale, failed)."
    );
    describe_gauge!(
        "rollout_peer_reachable",
        "1 while the worker loop reaches its `peer` (learner, reward), 0 while it retries."
    );
    describe_counter!(
        "rollout_call_retries_total",
        "Worker-loop calls retried because the peer was unreachable, by `call`."
    );
    // Counters that move only on faults exist from the start (at 0), for dashboards.
    for call in ["lease", "score", "submit"] {
        counter!("rollout_call_retries_total", "call" => call).increment(0);
    }
    describe_gauge!(
        "rollout_gpu_memory_used_bytes",
        Unit::Bytes,
        "GPU memory in use (CUDA only)."
    );
    describe_gauge!(
        "rollout_gpu_memory_total_bytes",
        Unit::Bytes,
        "GPU memory in total (CUDA only)."
    );
    describe_gauge!(
        "rollout_gpu_utilization_ratio",
        "Fraction of time a kernel ran on the worker's GPU (CUDA with NVML only)."
    );
    describe_gauge!(
        "rollout_gpu_memory_busy_ratio",
        "Fraction of time the GPU's memory was read or written (CUDA with NVML only)."
    );
    describe_gauge!(
        "rollout_gpu_power_watts",
        "Power draw of the worker's GPU (CUDA with NVML only)."
    );
}

pub fn set_weight_version(version: u64) {
    gauge!("rollout_weight_version").set(version as f64);
}

pub fn record_completion(reason: FinishReason) {
    counter!("rollout_completions_total", "finish_reason" => reason.as_str()).increment(1);
}

pub fn record_step(new_tokens: usize, stats: &StepStats) {
    counter!("rollout_tokens_generated_total").increment(new_tokens as u64);
    counter!("rollout_prefill_tokens_total").increment(stats.prefill_tokens as u64);
    if stats.prefill_tokens > 0 {
        histogram!("rollout_prefill_seconds").record(stats.prefill_seconds);
    }
    if stats.decode_rows > 0 {
        histogram!("rollout_decode_step_seconds").record(stats.decode_seconds);
    }
}

/// Publishes the engine's load (and the GPU's memory on CUDA).
pub fn set_load(status: &EngineStatus, device: &candle_core::Device) {
    gauge!("rollout_batch_rows").set(status.live_rows as f64);
    gauge!("rollout_batch_row_limit").set(status.row_limit as f64);
    gauge!("rollout_batch_occupancy_ratio")
        .set(status.live_rows as f64 / status.max_seqs.max(1) as f64);
    gauge!("rollout_pending_requests").set(status.pending_requests as f64);
    gauge!("rollout_pending_samples").set(status.pending_samples as f64);
    gauge!("rollout_kv_tokens_reserved").set(status.reserved_kv_tokens as f64);
    if let Some((free, total)) = gpu_memory(device) {
        gauge!("rollout_gpu_memory_used_bytes").set((total - free) as f64);
        gauge!("rollout_gpu_memory_total_bytes").set(total as f64);
    }
}

/// Publishes one NVML reading of the worker's GPU.
pub fn set_gpu(sample: &crate::gpu::GpuSample) {
    gauge!("rollout_gpu_utilization_ratio").set(sample.utilization);
    gauge!("rollout_gpu_memory_busy_ratio").set(sample.memory_busy);
    if let Some(watts) = sample.power_watts {
        gauge!("rollout_gpu_power_watts").set(watts);
    }
}

/// Records one UpdateWeights call.
pub fn record_weight_update(result: &'static str, bytes: usize, seconds: f64) {
    counter!("rollout_weight_updates_total", "result" => result).increment(1);
    counter!("rollout_weight_update_bytes_total").increment(bytes as u64);
    if result == "ok" {
        histogram!("rollout_weight_update_seconds").record(seconds);
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
