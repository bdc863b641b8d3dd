//! The worker's loop against a learner and a reward server: lease prompts, generate G
//! completions each on the engine, score them, submit the scored group. Several groups are
//! in flight at once, so the engine keeps generating while earlier groups are being scored
//! and submitted. Every call has a deadline. When the learner or the reward server is away,
//! calls are retried with exponential back-off, never dropped; the peer's state shows in
//! `rollout_peer_reachable{peer}` and in one log line when it goes away and one when it is
//! back. A group whose lease ran out meanwhile is abandoned (the learner has re-issued its
//! prompt), not scored and submitted for nothing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rookworld_lm::Tokenizer;
use rookworld_proto::queue::v1 as queue;
use rookworld_proto::queue::v1::rollout_queue_client::RolloutQueueClient;
use rookworld_proto::reward::v1 as reward;
use rookworld_proto::reward::v1::reward_service_client::RewardServiceClient;
use tokio::sync::Semaphore;
use tonic::transport::Channel;

use crate::engine::{Engine, Event, Request};

mod config;
mod peers;
pub use config::LoopConfig;
use peers::{Clients, Peer, Peers, Reporter, authed, check_peers, with_backoff};
use queue::ProblemCause as Cause;

/// Why a group could not be finished (it is left to its lease's expiry).
#[derive(Debug, thiserror::Error)]
enum GroupError {
    #[error("generation: {0}")]
    Generate(String),
    #[error("scoring: {0}")]
    Score(tonic::Status),
    #[error("submit refused: {0}")]
    Refused(tonic::Status),
    #[error("its lease ran out before it was {0}")]
    Expired(&'static str),
}

impl GroupError {
    /// Tells the learner what this failure means for delivering groups (an expired lease
    /// is no problem of the worker's: it is slow, and the learner sees that itself).
    fn report(&self, reporter: &Reporter, cfg: &LoopConfig) {
        match self {
            GroupError::Generate(why) => reporter.problem(Cause::GenerationFailed, "", "", why),
            GroupError::Score(s) => reporter.problem(
                Cause::ScoringRefused,
                &cfg.reward,
                &format!("{:?}", s.code()),
                s.message(),
            ),
            GroupError::Refused(s) => reporter.problem(
                Cause::SubmitRefused,
                &cfg.learner,
                &format!("{:?}", s.code()),
                s.message(),
            ),
            GroupError::Expired(_) => {}
        }
    }
}

/// How long a stopping loop waits for its groups in flight before it abandons them (their
/// leases expire at the learner, which re-issues the prompts): a stop never waits on a peer.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// Runs until `shutdown` resolves; groups in flight then have [`SHUTDOWN_GRACE`] to finish
/// and are abandoned after it. Returns an error, ending the loop, when the learner refuses
/// this worker for good (ALREADY_EXISTS: another worker holds its id).
pub async fn run(
    engine: Arc<Engine>,
    tokenizer: Tokenizer,
    bos: u32,
    cfg: LoopConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    let mut clients = Clients::connect(&cfg)?;
    let slots = Arc::new(Semaphore::new(cfg.max_in_flight.max(1)));
    let cfg = Arc::new(cfg);
    let reporter = Arc::new(Reporter::new(clients.learner.clone(), &cfg));
    let peers = Arc::new(Peers {
        learner: Peer::new("learner", &cfg.learner, None),
        reward: Peer::new("reward", &cfg.reward, Some(reporter.clone())),
        reporter,
    });
    let checked = tokio::spawn(check_peers(cfg.clone(), peers.clone()));
    let mut groups = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    // The first lease after the start-up check (a few seconds at most: its calls have
    // deadlines): a peer it found to be an HTTP/1 port is then named as one, not guessed
    // at from a failed call's error.
    tokio::select! {
        _ = &mut shutdown => return Ok(()),
        _ = checked => {}
    }
    // Whether the learner's last answer said its run is ending (said once).
    let mut said_closed = false;
    'lease: loop {
        // Reap finished groups (their results were logged by the groups themselves).
        while groups.try_join_next().is_some() {}
        let free = tokio::select! {
            _ = &mut shutdown => break,
            permit = slots.clone().acquire_many_owned(1) => permit.expect("semaphore open"),
        };
        drop(free);
        clients.refresh(&cfg);
        let learner = clients.learner.clone();
        let want = slots.available_permits().max(1) as u32;
        let status = engine.status();
        // The version it holds: a staged one (pushed, not yet swapped in) counts.
        let (weight_version, run) = status.held();
        let request = queue::LeaseRequest {
            worker_id: cfg.worker_id.clone(),
            max_prompts: want,
            weight_version,
            push_address: cfg.push_address.clone(),
            weight_run_id: run.to_owned(),
        };
        let leased = tokio::select! {
            _ = &mut shutdown => break,
            r = with_backoff(&peers.learner, "lease", cfg.max_backoff, || {
                let mut c = learner.clone();
                let r = authed(request.clone(), &cfg.token);
                async move { c.lease(r).await }
            }) => r,
        };
        let leased = match leased {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                // Another worker holds this id: waiting does not cure it.
                stop_groups(groups, SHUTDOWN_GRACE).await;
                return Err(format!(
                    "the learner {} refuses this worker (id `{}`, push address {}): {}",
                    cfg.learner,
                    cfg.worker_id,
                    cfg.push_address,
                    s.message()
                ));
            }
            Err(s) => {
                tracing::error!(learner = %cfg.learner, error = %s.message(), code = ?s.code(), "lease refused");
                tokio::select! {
                    _ = &mut shutdown => break,
                    _ = tokio::time::sleep(cfg.max_backoff) => continue,
                }
            }
        };
        if leased.prompts.is_empty() {
            tracing::debug!(reason = %leased.backpressure, "no prompts leased");
            let closed = leased.backpressure == "closed";
            if closed && !said_closed {
                tracing::info!(
                    learner = %cfg.learner,
                    "the learner is ending its run: no more leases (groups in flight are still taken); this worker asks again until a next run leases (Ctrl-C stops it)"
                );
            }
            said_closed = closed;
            let wait = Duration::from_secs_f64(leased.retry_after_seconds.clamp(0.05, 5.0));
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tokio::time::sleep(wait) => continue,
            }
        }
        said_closed = false;
        for prompt in leased.prompts {
            let permit = tokio::select! {
                _ = &mut shutdown => break 'lease,
                permit = slots.clone().acquire_owned() => permit.expect("semaphore open"),
            };
            let (engine, tokenizer, cfg) = (engine.clone(), tokenizer.clone(), cfg.clone());
            let peers = peers.clone();
            let (learner, scorer) = (clients.learner.clone(), clients.scorer.clone());
            let spec = (leased.num_completions, leased.sampling.unwrap_or_default());
            groups.spawn(async move {
                let id = prompt.prompt_id;
                match group(
                    engine, tokenizer, bos, &cfg, &peers, learner, scorer, prompt, spec,
                )
                .await
                {
                    Ok(()) => peers.reporter.resolved(),
                    Err(e) => {
                        e.report(&peers.reporter, &cfg);
                        tracing::warn!(prompt = id, error = %e, "group abandoned; its lease will expire");
                    }
                }
                drop(permit);
            });
        }
    }
    stop_groups(groups, SHUTDOWN_GRACE).await;
    Ok(())
}

/// Lets the groups in flight finish for up to `grace`, then abandons the rest (one line
/// saying how many): whatever the peers do, a stop takes at most `grace`.
async fn stop_groups(mut groups: tokio::task::JoinSet<()>, grace: Duration) {
    let in_flight = groups.len();
    let finished =
        tokio::time::timeout(grace, async { while groups.join_next().await.is_some() {} }).await;
    if finished.is_err() {
        let left = groups.len();
        groups.abort_all();
        while groups.join_next().await.is_some() {}
        tracing::warn!(
            abandoned = left,
            in_flight,
            grace_seconds = grace.as_secs_f64(),
            "stopping: groups still in flight abandoned; their leases will expire at the learner"
        );
    } else if in_flight > 0 {
        tracing::info!(in_flight, "stopping: groups in flight finished");
    }
}

/// One leased prompt: generate, score, submit. Its log lines carry the prompt, the lease
/// and the attempt.
#[allow(clippy::too_many_arguments)]
#[tracing::instrument(
    name = "group",
    skip_all,
    fields(prompt = prompt.prompt_id, lease = prompt.lease_id, attempt = prompt.attempt)
)]
async fn group(
    engine: Arc<Engine>,
    tokenizer: Tokenizer,
    bos: u32,
    cfg: &LoopConfig,
    peers: &Peers,
    learner: RolloutQueueClient<Channel>,
    scorer: RewardServiceClient<Channel>,
    prompt: queue::LeasedPrompt,
    (n, sampling): (u32, rookworld_proto::v1::SamplingParams),
) -> Result<(), GroupError> {
    let started = Instant::now();
    let expires = started + Duration::from_secs_f64(prompt.deadline_seconds.clamp(0.0, 1e7));
    let ids = tokenizer
        .encode_prompt(bos, &prompt.prompt)
        .map_err(|e| GroupError::Generate(e.to_string()))?;
    let request = Request {
        seed: prompt.seed,
        ..crate::service::request_from_wire(vec![ids.clone()], n as usize, &sampling)
    };
    let run = engine.status().weight_run;
    let mut stream = engine
        .submit(request)
        .await
        .map_err(|e| GroupError::Generate(e.to_string()))?;
    let mut samples = Vec::new();
    while let Some(event) = stream.next().await {
        match event {
            Event::Sample(s) => samples.push(s),
            Event::Done(_) => break,
            Event::Failed(_, why) => return Err(GroupError::Generate(why)),
        }
    }
    samples.sort_by_key(|s| s.sample_index);
    let generate_seconds = started.elapsed().as_secs_f64();
    // Weights of another run arrived mid-group: its samples' versions count in different
    // runs, so it is submitted as of no run (the learner drops it and frees the lease).
    let run = if engine.status().weight_run == run {
        run
    } else {
        tracing::debug!(
            prompt = prompt.prompt_id,
            "weights of another run arrived mid-group"
        );
        String::new()
    };
    if Instant::now() >= expires {
        return Err(GroupError::Expired("scored"));
    }

    let started = Instant::now();
    let eos = bos;
    let texts: Vec<String> = samples
        .iter()
        .map(|s| {
            let body: Vec<u32> = s
                .completion
                .ids
                .iter()
                .copied()
                .filter(|&t| t != eos)
                .collect();
            tokenizer.decode(&body).unwrap_or_default()
        })
        .collect();
    let task = prompt.task();
    let items: Vec<reward::ScoreItem> = texts
        .iter()
        .map(|t| reward::ScoreItem {
            task: task as i32,
            prompt: prompt.prompt.clone(),
            completion: t.clone(),
        })
        .collect();
    let scores = with_backoff(&peers.reward, "score", cfg.max_backoff, || {
        let mut c = scorer.clone();
        let r = authed(
            reward::ScoreRequest {
                items: items.clone(),
            },
            &cfg.token,
        );
        async move { c.score(r).await }
    })
    .await
    .map_err(GroupError::Score)?
    .into_inner()
    .results;
    let score_seconds = started.elapsed().as_secs_f64();

    // The oldest version of the group (a swap may land between two of its samples).
    let version = if run.is_empty() {
        0
    } else {
        samples.iter().map(|s| s.weight_version).min().unwrap_or(0)
    };
    let completions = samples
        .into_iter()
        .zip(texts)
        .zip(scores)
        .map(|((s, text), r)| queue::ScoredCompletion {
            // Each id's version wherever one is not the group's.
            token_versions: if s.token_versions.is_empty() && s.weight_version != version {
                vec![s.weight_version; s.completion.ids.len()]
            } else {
                s.token_versions
            },
            ids: s.completion.ids,
            text,
            logprobs: s.completion.logprobs,
            reward: r.reward as f32,
            components: r
                .components
                .into_iter()
                .map(|(k, v)| (k, v as f32))
                .collect::<BTreeMap<_, _>>()
                .into_iter()
                .collect(),
        })
        .collect();
    let submit = queue::SubmitRequest {
        worker_id: cfg.worker_id.clone(),
        lease_id: prompt.lease_id,
        prompt_id: prompt.prompt_id,
        prompt_ids: ids,
        completions,
        weight_version: version,
        generate_seconds,
        score_seconds,
        run_id: run,
    };
    if Instant::now() >= expires {
        return Err(GroupError::Expired("submitted"));
    }
    with_backoff(&peers.learner, "submit", cfg.max_backoff, || {
        let r = authed(submit.clone(), &cfg.token);
        async { learner.clone().submit(r).await }
    })
    .await
    .map_err(GroupError::Refused)?;
    Ok(())
}
