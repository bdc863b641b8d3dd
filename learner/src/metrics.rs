//! Every metric the learner exports, described in one place, and the exporter. The
//! training loop's per-step values are recorded in `train::report`.

use std::net::SocketAddr;

use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use rookworld_service::metrics_http::MetricsError;

use crate::queue::Queue;

/// Every metric name of this crate, once: the describe calls and the recording sites use
/// these.
pub mod names;

/// Buckets (seconds) for weight pushes.
const PUSH_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Buckets (seconds) for the phases of a training step.
const STEP_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Serves `/metrics` on `addr` (read-only) and describes every metric.
pub fn install_exporter(addr: SocketAddr) -> Result<SocketAddr, MetricsError> {
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(names::WEIGHT_PUSH_SECONDS.into()),
            PUSH_BUCKETS,
        )?
        .set_buckets_for_metric(Matcher::Full(names::STEP_SECONDS.into()), STEP_BUCKETS)?
        // `--local`'s worker and reward server record into this endpoint: their histograms
        // with their own buckets (not summaries).
        .set_buckets_for_metric(
            Matcher::Prefix("rollout_".into()),
            rookworld_generation::metrics::SECONDS_BUCKETS,
        )?;
    // … and the reward server's request latencies, with every service's latency buckets.
    let builder = rookworld_service::metrics_http::request_latency_buckets(builder)?;
    let builder = rollout_worker::metrics::steps_buckets(builder)?;
    let bound = rookworld_service::metrics_http::install(builder, addr)?;
    describe();
    Ok(bound)
}

/// The CUDA kernel families a device's verdict turned off (named: see
/// [`rookworld_lm::kernels::Switches::disabled`]), once the device is open.
pub fn record_kernel_fallbacks(disabled: impl IntoIterator<Item = &'static str>) {
    for kernel in disabled {
        gauge!(names::CUDA_KERNEL_FALLBACK, "kernel" => kernel).set(1.0);
    }
}

/// Descriptions of every metric (labels come from bounded sets: workers, results, lags).
pub fn describe() {
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
    describe_gauge!(
        names::QUEUE_PENDING,
        Unit::Count,
        "Prompts waiting to be leased."
    );
    describe_gauge!(names::QUEUE_LEASED, Unit::Count, "Leases outstanding.");
    describe_gauge!(
        names::QUEUE_SCORED,
        Unit::Count,
        "Scored groups waiting for the learner."
    );
    describe_gauge!(
        names::QUEUE_SCORED_BYTES,
        Unit::Bytes,
        "Bytes the scored groups waiting for the learner hold."
    );
    describe_counter!(
        names::QUEUE_PROMPTS_ADDED_TOTAL,
        Unit::Count,
        "Prompts added to the queue."
    );
    describe_counter!(
        names::QUEUE_LEASES_ISSUED_TOTAL,
        Unit::Count,
        "Leases issued (re-issues included)."
    );
    describe_counter!(
        names::QUEUE_LEASES_EXPIRED_TOTAL,
        Unit::Count,
        "Leases that passed their deadline."
    );
    describe_counter!(
        names::QUEUE_LEASES_RELEASED_TOTAL,
        Unit::Count,
        "Leases returned by workers that went away."
    );
    describe_counter!(
        names::QUEUE_GROUPS_SUBMITTED_TOTAL,
        Unit::Count,
        "Scored groups accepted."
    );
    describe_counter!(
        names::QUEUE_SUBMISSIONS_REFUSED_TOTAL,
        Unit::Count,
        "Submissions refused (expired, duplicate or foreign lease)."
    );
    describe_counter!(
        names::QUEUE_GROUPS_CONSUMED_TOTAL,
        Unit::Count,
        "Groups the learner trained on."
    );
    describe_counter!(
        names::QUEUE_GROUPS_DROPPED_STALE_TOTAL,
        Unit::Count,
        "Groups dropped as too stale."
    );
    describe_counter!(
        names::QUEUE_GROUPS_CONSUMED_BY_LAG_TOTAL,
        Unit::Count,
        "Groups the learner trained on, by weight-version lag (`lag`: 0…6, 7+)."
    );
    describe_histogram!(
        names::WEIGHT_PUSH_SECONDS,
        Unit::Seconds,
        "One weight push to one worker, by `path` (shared: the same-host file; delta: what changed since the worker's version; stream: the payload)."
    );
    describe_counter!(
        names::WEIGHT_PUSH_BYTES_TOTAL,
        Unit::Bytes,
        "Weight bytes pushed, by `path` (shared, delta, stream; a shared-file push counts the bytes the worker reads; relayed: what relays forwarded to the workers below them, not the learner's egress)."
    );
    describe_counter!(
        names::WEIGHT_PUSHES_TOTAL,
        "Weight pushes by `result` (ok, failed) and `path` (shared, delta, stream; relayed: a push a relay made, as its answer reported it)."
    );
    describe_counter!(
        names::QUEUE_SUBMISSIONS_INVALID_TOTAL,
        "Submissions refused before the queue: not a group the learner could train on."
    );
    describe_counter!(
        names::WORKER_PROBLEMS_TOTAL,
        Unit::Count,
        "Problems workers reported keep them from delivering groups, by `cause`: scoring_refused, reward_unreachable, submit_refused, generation_failed."
    );
    describe_counter!(
        names::QUEUE_REFUSED_CALLS_TOTAL,
        Unit::Count,
        "Worker calls refused before they reached the queue, by `call` and `cause` (no token, wrong token)."
    );
    // Counters that move only on faults exist from the start (at 0), for dashboards.
    counter!(names::QUEUE_SUBMISSIONS_INVALID_TOTAL).increment(0);
    for cause in [
        crate::queue::problems::Cause::ScoringRefused,
        crate::queue::problems::Cause::RewardUnreachable,
        crate::queue::problems::Cause::SubmitRefused,
        crate::queue::problems::Cause::GenerationFailed,
    ] {
        counter!(names::WORKER_PROBLEMS_TOTAL, "cause" => cause.label()).increment(0);
    }
    describe_gauge!(
        names::WORKERS,
        Unit::Count,
        "Workers by weight-sync `state`: current, stale, pushing, failing."
    );
    describe_gauge!(
        names::WORKERS_OLDEST_WEIGHT_VERSION,
        "Oldest weight version a registered worker is known to run (-1: none registered, or one whose version is unknown)."
    );
    describe_counter!(names::STEPS_TOTAL, Unit::Count, "GRPO steps done.");
    describe_gauge!(
        names::STEP_IDLE_SECONDS,
        Unit::Seconds,
        "Seconds since the last step ended (the stall watchdog's clock)."
    );
    describe_gauge!(
        names::WEIGHT_VERSION,
        "Weight version after the latest step."
    );
    describe_gauge!(
        names::REWARD_MEAN,
        "Mean reward of the latest step's completions."
    );
    describe_gauge!(
        names::REWARD_STD,
        "Reward std of the latest step's completions."
    );
    describe_gauge!(
        names::REWARD_COMPONENT,
        "Mean of each reward component (`component`) in the latest step."
    );
    describe_gauge!(names::LOSS, "Loss of the latest step (policy + β·KL).");
    describe_gauge!(
        names::POLICY_LOSS,
        "Clipped-surrogate part of the latest loss."
    );
    describe_gauge!(
        names::KL,
        "k3 KL to the reference in the latest step (unscaled)."
    );
    describe_gauge!(
        names::GRAD_NORM,
        "Gradient norm before clipping, latest step."
    );
    describe_gauge!(names::LR, "Learning rate of the latest step.");
    describe_gauge!(
        names::POLICY_ENTROPY,
        "Mean entropy (nats) of the policy over the latest step's completion tokens."
    );
    describe_gauge!(
        names::SAMPLER_LOGP_DIFF_MEAN,
        "Mean |log π_learner − log π_sampler| over the latest step's tokens (off-policy correction on)."
    );
    describe_gauge!(
        names::SAMPLER_LOGP_DIFF_MAX,
        "Largest |log π_learner − log π_sampler| over the latest step's tokens."
    );
    describe_gauge!(
        names::SAMPLER_KL,
        "k3 estimate of KL(sampler ‖ learner) over the latest step's tokens."
    );
    describe_gauge!(
        names::IS_WEIGHT_MIN,
        "Smallest importance weight π_prox/π_behaviour before its bound, latest step."
    );
    describe_gauge!(
        names::IS_WEIGHT_MEAN,
        "Mean importance weight π_prox/π_behaviour before its bound, latest step."
    );
    describe_gauge!(
        names::IS_WEIGHT_MAX,
        "Largest importance weight π_prox/π_behaviour before its bound, latest step."
    );
    describe_gauge!(
        names::IS_BOUNDED_RATIO,
        Unit::Count,
        "Share of the latest step's importance weights cut at --is-cap (or masked)."
    );
    describe_gauge!(
        names::IS_ESS_RATIO,
        Unit::Count,
        "Effective sample size of the latest step's importance weights over their count."
    );
    describe_gauge!(
        names::EVAL,
        "--eval-every: each metric of the latest evaluation, by `suite` and `metric`."
    );
    describe_gauge!(
        names::EVAL_STEP,
        "The step whose weights were evaluated last."
    );
    describe_histogram!(
        names::EVAL_SECONDS,
        Unit::Seconds,
        "Seconds one evaluation took (beside training)."
    );
    describe_counter!(
        names::EVALS_SKIPPED_TOTAL,
        Unit::Count,
        "Evaluations skipped because the previous one was still running."
    );
    describe_gauge!(
        names::CLIPPED_LOW_RATIO,
        Unit::Count,
        "Share of the latest step's tokens whose ratio was clipped below (1 - ε)."
    );
    describe_gauge!(
        names::CLIPPED_HIGH_RATIO,
        Unit::Count,
        "Share of the latest step's tokens whose ratio was clipped above (1 + ε_high)."
    );
    describe_counter!(
        names::COMPLETIONS_MASKED_TRUNCATED_TOTAL,
        Unit::Count,
        "Completions cut off at --max-new-tokens left out of the loss (--mask-truncated)."
    );
    describe_counter!(
        names::TOKENS_MASKED_STALE_TOTAL,
        Unit::Count,
        "Completion tokens left out of the loss as sampled by weights past --max-version-lag (an update mid-completion)."
    );
    describe_gauge!(
        names::CLIPPED_TOKENS_RATIO,
        "Share of completion tokens whose ratio was clipped, latest step."
    );
    describe_gauge!(
        names::STALENESS_MEAN_VERSIONS,
        "Mean weight-version lag of the latest step's groups."
    );
    describe_gauge!(
        names::MFU_RATIO,
        "Model FLOPs utilisation of the latest step's update."
    );
    describe_counter!(
        names::TOKENS_TOTAL,
        Unit::Count,
        "Completion tokens trained on."
    );
    describe_counter!(
        names::GROUPS_SKIPPED_TOTAL,
        Unit::Count,
        "Groups without signal (all rewards equal)."
    );
    describe_histogram!(
        names::STEP_SECONDS,
        Unit::Seconds,
        "Step time by `phase`: wait, forward_backward, optimizer, push, total."
    );
}

/// Publishes the queue's depths and counters.
pub fn record_queue(queue: &Queue) {
    let d = queue.depths();
    gauge!(names::QUEUE_PENDING).set(d.pending as f64);
    gauge!(names::QUEUE_LEASED).set(d.leased as f64);
    gauge!(names::QUEUE_SCORED).set(d.scored as f64);
    gauge!(names::QUEUE_SCORED_BYTES).set(d.scored_bytes as f64);
    let c = d.counters;
    counter!(names::QUEUE_PROMPTS_ADDED_TOTAL).absolute(c.prompts_added);
    counter!(names::QUEUE_LEASES_ISSUED_TOTAL).absolute(c.leases_issued);
    counter!(names::QUEUE_LEASES_EXPIRED_TOTAL).absolute(c.leases_expired);
    counter!(names::QUEUE_LEASES_RELEASED_TOTAL).absolute(c.leases_released);
    counter!(names::QUEUE_GROUPS_SUBMITTED_TOTAL).absolute(c.groups_submitted);
    counter!(names::QUEUE_SUBMISSIONS_REFUSED_TOTAL).absolute(c.submissions_refused);
    counter!(names::QUEUE_GROUPS_CONSUMED_TOTAL).absolute(c.groups_consumed);
    counter!(names::QUEUE_GROUPS_DROPPED_STALE_TOTAL).absolute(c.groups_dropped_stale);
    const LAGS: [&str; 8] = ["0", "1", "2", "3", "4", "5", "6", "7+"];
    for (lag, n) in LAGS.iter().zip(queue.staleness()) {
        counter!(names::QUEUE_GROUPS_CONSUMED_BY_LAG_TOTAL, "lag" => *lag).absolute(*n);
    }
}
