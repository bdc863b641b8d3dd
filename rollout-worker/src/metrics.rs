//! Every metric the rollout worker exports, described in one place, and the exporter.

use std::net::SocketAddr;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use rookworld_service::metrics_http::MetricsError;

pub use rookworld_generation::metrics::gpu_memory;

/// Every metric name of this crate, once: the describe calls and the recording sites use
/// these.
pub mod names {
    /// The generation engine's, recorded by `rookworld-generation`.
    pub use rookworld_generation::metrics::names::*;

    pub const BUILD_INFO: &str = "rollout_build_info";
    pub const CALL_RETRIES_TOTAL: &str = "rollout_call_retries_total";
    pub const CUDA_KERNEL_FALLBACK: &str = "rollout_cuda_kernel_fallback";
    pub const GPU_MEMORY_BUSY_RATIO: &str = "rollout_gpu_memory_busy_ratio";
    pub const GPU_POWER_WATTS: &str = "rollout_gpu_power_watts";
    pub const GPU_UTILIZATION_RATIO: &str = "rollout_gpu_utilization_ratio";
    pub const PEER_REACHABLE: &str = "rollout_peer_reachable";
    pub const WEIGHT_UPDATE_BYTES_TOTAL: &str = "rollout_weight_update_bytes_total";
    pub const WEIGHT_UPDATE_SECONDS: &str = "rollout_weight_update_seconds";
    pub const WEIGHT_UPDATES_TOTAL: &str = "rollout_weight_updates_total";
}

/// Buckets (seconds) for decode steps, prefills and weight updates.
pub use rookworld_generation::metrics::SECONDS_BUCKETS;

/// Serves `/metrics` on `addr` (read-only). The metrics are described where a worker
/// starts ([`crate::Worker::start`]), into whatever recorder the process has.
pub fn install_exporter(addr: SocketAddr) -> Result<SocketAddr, MetricsError> {
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?;
    rookworld_service::metrics_http::install(steps_buckets(builder)?, addr)
}

/// `builder` with the engine's histograms counted in decode steps in their buckets
/// (`rookworld_generation::metrics::STEPS_BUCKETS`; a full name beats the prefix or
/// suffix of a process's other buckets).
pub fn steps_buckets(
    builder: PrometheusBuilder,
) -> Result<PrometheusBuilder, metrics_exporter_prometheus::BuildError> {
    use rookworld_generation::metrics::{STEPS_BUCKETS, STEPS_HISTOGRAMS};
    STEPS_HISTOGRAMS.iter().try_fold(builder, |b, name| {
        b.set_buckets_for_metric(Matcher::Full((*name).into()), STEPS_BUCKETS)
    })
}

/// The CUDA kernel families a device's verdict turned off (named: see
/// [`rookworld_lm::kernels::Switches::disabled`]), once the device is open.
pub fn record_kernel_fallbacks(disabled: impl IntoIterator<Item = &'static str>) {
    for kernel in disabled {
        gauge!(names::CUDA_KERNEL_FALLBACK, "kernel" => kernel).set(1.0);
    }
}

/// Descriptions of every metric (labels come from bounded sets).
pub fn describe() {
    rookworld_generation::metrics::describe();
    rookworld_service::tls::describe_metrics();
    describe_gauge!(
        names::CUDA_KERNEL_FALLBACK,
        Unit::Count,
        "1 for each of this project's CUDA kernels (label kernel) that failed its start-up check against its reference: that op runs candle's ops instead (--strict-kernels exits instead)."
    );
    let features = if cfg!(feature = "cuda") { "cuda" } else { "" };
    rookworld_service::metrics_http::build_info(
        names::BUILD_INFO,
        env!("CARGO_PKG_VERSION"),
        features,
    );
    describe_histogram!(
        names::WEIGHT_UPDATE_SECONDS,
        Unit::Seconds,
        "Duration of an UpdateWeights call, first chunk to the answer (the new weights in use, or staged when the header asks)."
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

/// One reading of a GPU ([`crate::gpu::GpuMonitor::sample`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSample {
    /// Fraction of the driver's last sample period in which a kernel ran (0–1).
    pub utilization: f64,
    /// Fraction of that period in which device memory was read or written (0–1).
    pub memory_busy: f64,
    /// Board power draw; `None` where the GPU does not report it.
    pub power_watts: Option<f64>,
}

/// Publishes one NVML reading of the worker's GPU.
pub fn set_gpu(sample: &GpuSample) {
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
