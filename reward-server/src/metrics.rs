//! Every metric the reward server exports, described in one place, and the exporter.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use rookworld_proto::metrics_http::MetricsError;

/// Latency buckets (seconds) for scoring calls.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Serves `/metrics` on `addr` and describes every metric.
pub fn install_exporter(addr: SocketAddr) -> Result<SocketAddr, MetricsError> {
    let builder = PrometheusBuilder::new().set_buckets_for_metric(
        Matcher::Full("reward_request_duration_seconds".into()),
        LATENCY_BUCKETS,
    )?;
    let bound = rookworld_proto::metrics_http::install(builder, addr)?;
    describe();
    Ok(bound)
}

/// Descriptions of every metric (labels come from bounded sets).
pub fn describe() {
    rookworld_proto::tls::describe_metrics();
    use metrics::{Unit, describe_counter, describe_histogram};
    rookworld_proto::metrics_http::build_info("reward_build_info", env!("CARGO_PKG_VERSION"), "");
    describe_counter!(
        "reward_requests_total",
        "Score calls, by gRPC status code (`status`)."
    );
    describe_counter!(
        "reward_items_total",
        Unit::Count,
        "Items scored, by task (`task`: P, A)."
    );
    describe_counter!(
        "reward_verdicts_total",
        "Scored items by task, verdict and reason (`exact`, `partial`, or the malformed kind)."
    );
    describe_histogram!(
        "reward_request_duration_seconds",
        Unit::Seconds,
        "Duration of one Score call."
    );
    describe_counter!(
        "reward_engine_cache_hits_total",
        "Engine analyses served from the cache."
    );
    describe_counter!(
        "reward_engine_cache_misses_total",
        "Engine analyses that needed an engine search."
    );
    describe_counter!(
        "reward_engine_restarts_total",
        "Engines killed and replaced after a crash or timeout."
    );
    describe_counter!(
        "reward_engine_failures_total",
        "Policy items scored on rules alone because every engine attempt failed."
    );
    // The engine counters exist from the start (at 0), so that dashboards and alerts see
    // a series even before the first policy item, or with no engine at all.
    for name in [
        "reward_engine_cache_hits_total",
        "reward_engine_cache_misses_total",
        "reward_engine_restarts_total",
        "reward_engine_failures_total",
    ] {
        metrics::counter!(name).increment(0);
    }
}

/// Counts one scored item.
pub fn record_score(task: &'static str, score: &rookworld_chess::score::Score) {
    metrics::counter!("reward_items_total", "task" => task).increment(1);
    metrics::counter!(
        "reward_verdicts_total",
        "task" => task,
        "verdict" => score.verdict.label(),
        "reason" => score.reason_label()
    )
    .increment(1);
}
