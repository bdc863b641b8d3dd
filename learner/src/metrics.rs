//! Every metric the learner exports, described in one place, and the exporter. The
//! training loop's per-step values are recorded in `train::report`.

use std::net::SocketAddr;

use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use rookworld_proto::metrics_http::MetricsError;

use crate::queue::Queue;

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
            Matcher::Full("learner_weight_push_seconds".into()),
            PUSH_BUCKETS,
        )?
        .set_buckets_for_metric(Matcher::Full("learner_step_seconds".into()), STEP_BUCKETS)?
        // `--local`'s worker and reward server record into this endpoint: their histograms
        // with their own buckets (not summaries).
        .set_buckets_for_metric(
            Matcher::Prefix("rollout_".into()),
            rollout_worker::metrics::SECONDS_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full("reward_request_duration_seconds".into()),
            reward_server::metrics::LATENCY_BUCKETS,
        )?;
    let bound = rookworld_proto::metrics_http::install(builder, addr)?;
    describe();
    Ok(bound)
}

/// Descriptions of the metrics of `--local`'s worker and reward server, which record into
/// the learner's endpoint.
pub fn describe_local() {
    rollout_worker::metrics::describe();
    reward_server::metrics::describe();
}

/// Descriptions of every metric (labels come from bounded sets: workers, results, lags).
pub fn describe() {
    rookworld_proto::tls::describe_metrics();
    let features = if cfg!(feature = "cuda") { "cuda" } else { "" };
    rookworld_proto::metrics_http::build_info(
        "learner_build_info",
        env!("CARGO_PKG_VERSION"),
        features,
    );
    describe_gauge!(
        "learner_queue_pending",
        Unit::Count,
        "Prompts waiting to be leased."
    );
    describe_gauge!("learner_queue_leased", Unit::Count, "Leases outstanding.");
    describe_gauge!(
        "learner_queue_scored",
        Unit::Count,
        "Scored groups waiting for the learner."
    );
    describe_gauge!(
        "learner_queue_scored_bytes",
        Unit::Bytes,
        "Bytes the scored groups waiting for the learner hold."
    );
    describe_counter!(
        "learner_queue_prompts_added_total",
        Unit::Count,
        "Prompts added to the queue."
    );
    describe_counter!(
        "learner_queue_leases_issued_total",
        Unit::Count,
        "Leases issued (re-issues included)."
    );
    describe_counter!(
        "learner_queue_leases_expired_total",
        Unit::Count,
        "Leases that passed their deadline."
    );
    describe_counter!(
        "learner_queue_leases_released_total",
        Unit::Count,
        "Leases returned by workers that went away."
    );
    describe_counter!(
        "learner_queue_groups_submitted_total",
        Unit::Count,
        "Scored groups accepted."
    );
    describe_counter!(
        "learner_queue_submissions_refused_total",
        Unit::Count,
        "Submissions refused (expired, duplicate or foreign lease)."
    );
    describe_counter!(
        "learner_queue_groups_consumed_total",
        Unit::Count,
        "Groups the learner trained on."
    );
    describe_counter!(
        "learner_queue_groups_dropped_stale_total",
        Unit::Count,
        "Groups dropped as too stale."
    );
    describe_counter!(
        "learner_queue_groups_consumed_by_lag_total",
        Unit::Count,
        "Groups the learner trained on, by weight-version lag (`lag`: 0…6, 7+)."
    );
    describe_histogram!(
        "learner_weight_push_seconds",
        Unit::Seconds,
        "One weight push to one worker, by `path` (shared: the same-host file; stream)."
    );
    describe_counter!(
        "learner_weight_push_bytes_total",
        Unit::Bytes,
        "Weight bytes pushed, by `path` (a shared-file push counts the bytes the worker reads)."
    );
    describe_counter!(
        "learner_weight_pushes_total",
        "Weight pushes by `result` (ok, failed) and `path` (shared, stream)."
    );
    describe_counter!(
        "learner_queue_submissions_invalid_total",
        "Submissions refused before the queue: not a group the learner could train on."
    );
    describe_counter!(
        "learner_worker_problems_total",
        Unit::Count,
        "Problems workers reported keep them from delivering groups, by `cause`: scoring_refused, reward_unreachable, submit_refused, generation_failed."
    );
    describe_counter!(
        "learner_queue_refused_calls_total",
        Unit::Count,
        "Worker calls refused before they reached the queue, by `call` and `cause` (no token, wrong token)."
    );
    // Counters that move only on faults exist from the start (at 0), for dashboards.
    counter!("learner_queue_submissions_invalid_total").increment(0);
    for cause in [
        crate::queue::problems::Cause::ScoringRefused,
        crate::queue::problems::Cause::RewardUnreachable,
        crate::queue::problems::Cause::SubmitRefused,
        crate::queue::problems::Cause::GenerationFailed,
    ] {
        counter!("learner_worker_problems_total", "cause" => cause.label()).increment(0);
    }
    describe_gauge!(
        "learner_workers",
        Unit::Count,
        "Workers by weight-sync `state`: current, stale, pushing, failing."
    );
    describe_gauge!(
        "learner_workers_oldest_weight_version",
        "Oldest weight version a registered worker is known to run (-1: none registered, or one whose version is unknown)."
    );
    describe_counter!("learner_steps_total", Unit::Count, "GRPO steps done.");
    describe_gauge!(
        "learner_step_idle_seconds",
        Unit::Seconds,
        "Seconds since the last step ended (the stall watchdog's clock)."
    );
    describe_gauge!(
        "learner_weight_version",
        "Weight version after the latest step."
    );
    describe_gauge!(
        "learner_reward_mean",
        "Mean reward of the latest step's completions."
    );
    describe_gauge!(
        "learner_reward_std",
        "Reward std of the latest step's completions."
    );
    describe_gauge!(
        "learner_reward_component",
        "Mean of each reward component (`component`) in the latest step."
    );
    describe_gauge!("learner_loss", "Loss of the latest step (policy + β·KL).");
    describe_gauge!(
        "learner_policy_loss",
        "Clipped-surrogate part of the latest loss."
    );
    describe_gauge!(
        "learner_kl",
        "k3 KL to the reference in the latest step (unscaled)."
    );
    describe_gauge!(
        "learner_grad_norm",
        "Gradient norm before clipping, latest step."
    );
    describe_gauge!("learner_lr", "Learning rate of the latest step.");
    describe_gauge!(
        "learner_policy_entropy",
        "Mean entropy (nats) of the policy over the latest step's completion tokens."
    );
    describe_gauge!(
        "learner_sampler_logp_diff_mean",
        "Mean |log π_learner − log π_sampler| over the latest step's tokens (off-policy correction on)."
    );
    describe_gauge!(
        "learner_sampler_logp_diff_max",
        "Largest |log π_learner − log π_sampler| over the latest step's tokens."
    );
    describe_gauge!(
        "learner_sampler_kl",
        "k3 estimate of KL(sampler ‖ learner) over the latest step's tokens."
    );
    describe_gauge!(
        "learner_is_weight_min",
        "Smallest importance weight π_prox/π_behaviour before its bound, latest step."
    );
    describe_gauge!(
        "learner_is_weight_mean",
        "Mean importance weight π_prox/π_behaviour before its bound, latest step."
    );
    describe_gauge!(
        "learner_is_weight_max",
        "Largest importance weight π_prox/π_behaviour before its bound, latest step."
    );
    describe_gauge!(
        "learner_is_bounded_ratio",
        Unit::Count,
        "Share of the latest step's importance weights cut at --is-cap (or masked)."
    );
    describe_gauge!(
        "learner_is_ess_ratio",
        Unit::Count,
        "Effective sample size of the latest step's importance weights over their count."
    );
    describe_gauge!(
        "learner_eval",
        "--eval-every: each metric of the latest evaluation, by `suite` and `metric`."
    );
    describe_gauge!(
        "learner_eval_step",
        "The step whose weights were evaluated last."
    );
    describe_histogram!(
        "learner_eval_seconds",
        Unit::Seconds,
        "Seconds one evaluation took (beside training)."
    );
    describe_counter!(
        "learner_evals_skipped_total",
        Unit::Count,
        "Evaluations skipped because the previous one was still running."
    );
    describe_gauge!(
        "learner_clipped_low_ratio",
        Unit::Count,
        "Share of the latest step's tokens whose ratio was clipped below (1 - ε)."
    );
    describe_gauge!(
        "learner_clipped_high_ratio",
        Unit::Count,
        "Share of the latest step's tokens whose ratio was clipped above (1 + ε_high)."
    );
    describe_counter!(
        "learner_completions_masked_truncated_total",
        Unit::Count,
        "Completions cut off at --max-new-tokens left out of the loss (--mask-truncated)."
    );
    describe_gauge!(
        "learner_clipped_tokens_ratio",
        "Share of completion tokens whose ratio was clipped, latest step."
    );
    describe_gauge!(
        "learner_staleness_mean_versions",
        "Mean weight-version lag of the latest step's groups."
    );
    describe_gauge!(
        "learner_mfu_ratio",
        "Model FLOPs utilisation of the latest step's update."
    );
    describe_counter!(
        "learner_tokens_total",
        Unit::Count,
        "Completion tokens trained on."
    );
    describe_counter!(
        "learner_groups_skipped_total",
        Unit::Count,
        "Groups without signal (all rewards equal)."
    );
    describe_histogram!(
        "learner_step_seconds",
        Unit::Seconds,
        "Step time by `phase`: wait, forward_backward, optimizer, push, total."
    );
}

/// Publishes the queue's depths and counters.
pub fn record_queue(queue: &Queue) {
    let d = queue.depths();
    gauge!("learner_queue_pending").set(d.pending as f64);
    gauge!("learner_queue_leased").set(d.leased as f64);
    gauge!("learner_queue_scored").set(d.scored as f64);
    gauge!("learner_queue_scored_bytes").set(d.scored_bytes as f64);
    let c = d.counters;
    counter!("learner_queue_prompts_added_total").absolute(c.prompts_added);
    counter!("learner_queue_leases_issued_total").absolute(c.leases_issued);
    counter!("learner_queue_leases_expired_total").absolute(c.leases_expired);
    counter!("learner_queue_leases_released_total").absolute(c.leases_released);
    counter!("learner_queue_groups_submitted_total").absolute(c.groups_submitted);
    counter!("learner_queue_submissions_refused_total").absolute(c.submissions_refused);
    counter!("learner_queue_groups_consumed_total").absolute(c.groups_consumed);
    counter!("learner_queue_groups_dropped_stale_total").absolute(c.groups_dropped_stale);
    const LAGS: [&str; 8] = ["0", "1", "2", "3", "4", "5", "6", "7+"];
    for (lag, n) in LAGS.iter().zip(queue.staleness()) {
        counter!("learner_queue_groups_consumed_by_lag_total", "lag" => *lag).absolute(*n);
    }
}
