//! Every metric the reward server exports, described in one place, and the exporter.

use std::net::SocketAddr;

use metrics_exporter_prometheus::PrometheusBuilder;
use rookworld_service::metrics_http::MetricsError;

/// Every metric name of this crate, once: the describe calls and the recording sites use
/// these.
pub mod names {
    pub const BUILD_INFO: &str = "reward_build_info";
    pub const ITEMS_TOTAL: &str = "reward_items_total";
    pub const REQUEST_DURATION_SECONDS: &str = "reward_request_duration_seconds";
    pub const REQUESTS_TOTAL: &str = "reward_requests_total";
    pub const VERDICTS_TOTAL: &str = "reward_verdicts_total";
}

/// Serves `/metrics` on `addr`; the metrics are described where the service starts
/// ([`crate::service::run`]), into whatever recorder the process has. The scoring calls' latency
/// histogram ([`names::REQUEST_DURATION_SECONDS`]) has the request-latency buckets every
/// service shares ([`rookworld_service::metrics_http::REQUEST_LATENCY_BUCKETS`]).
pub fn install_exporter(addr: SocketAddr) -> Result<SocketAddr, MetricsError> {
    let builder =
        rookworld_service::metrics_http::request_latency_buckets(PrometheusBuilder::new())?;
    rookworld_service::metrics_http::install(builder, addr)
}

/// Descriptions of every metric (labels come from bounded sets).
pub fn describe() {
    rookworld_service::tls::describe_metrics();
    use metrics::{Unit, describe_counter, describe_histogram};
    rookworld_service::metrics_http::build_info(names::BUILD_INFO, env!("CARGO_PKG_VERSION"), "");
    describe_counter!(
        names::REQUESTS_TOTAL,
        "Score calls, by gRPC status code (`status`)."
    );
    describe_counter!(
        names::ITEMS_TOTAL,
        Unit::Count,
        "Items scored, by task (`task`: P, A)."
    );
    describe_counter!(
        names::VERDICTS_TOTAL,
        "Scored items by task, verdict and reason (`exact`, `partial`, or the malformed kind)."
    );
    describe_histogram!(
        names::REQUEST_DURATION_SECONDS,
        Unit::Seconds,
        "Duration of one Score call."
    );
    describe_counter!(
        rookworld_chess::metrics::names::ENGINE_CACHE_HITS_TOTAL,
        "Engine analyses served from the cache."
    );
    describe_counter!(
        rookworld_chess::metrics::names::ENGINE_CACHE_MISSES_TOTAL,
        "Engine analyses that needed an engine search."
    );
    describe_counter!(
        rookworld_chess::metrics::names::ENGINE_RESTARTS_TOTAL,
        "Engines killed and replaced after a crash or timeout."
    );
    describe_counter!(
        rookworld_chess::metrics::names::ENGINE_FAILURES_TOTAL,
        "Policy items scored on rules alone because every engine attempt failed."
    );
    // The engine counters exist from the start (at 0), so that dashboards and alerts see
    // a series even before the first policy item, or with no engine at all.
    use rookworld_chess::metrics::names as engine;
    for name in [
        engine::ENGINE_CACHE_HITS_TOTAL,
        engine::ENGINE_CACHE_MISSES_TOTAL,
        engine::ENGINE_RESTARTS_TOTAL,
        engine::ENGINE_FAILURES_TOTAL,
    ] {
        metrics::counter!(name).increment(0);
    }
}

/// Counts one scored item.
pub fn record_score(task: &'static str, score: &rookworld_chess::score::Score) {
    metrics::counter!(names::ITEMS_TOTAL, "task" => task).increment(1);
    metrics::counter!(
        names::VERDICTS_TOTAL,
        "task" => task,
        "verdict" => score.verdict.label(),
        "reason" => score.reason_label()
    )
    .increment(1);
}
