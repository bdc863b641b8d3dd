//! The rollout queue over gRPC (`rookworld.queue.v1.RolloutQueue`): worker calls behind the
//! shared token, read-only inspection for people with grpcurl; health and reflection on
//! the same port. [`admission`] says what a submission must be before it is queued.

pub mod admission;
mod error;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rookworld_proto::queue::v1 as pb;
use rookworld_proto::queue::v1::rollout_queue_server::{RolloutQueue, RolloutQueueServer};
use rookworld_proto::reward::v1::Task;
use rookworld_proto::v1::SamplingParams;
use rookworld_service::auth::{Guard, TokenError};
use rookworld_service::tls::ServerTls;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use crate::metrics::names;
use crate::prompts::TaskKind;
use crate::queue::problems::{Cause, Problem};
use crate::queue::{
    Backpressure, DuplicateWorker, QueueHandle, ScoredCompletion, ScoredGroup, WorkerStats,
};
pub use admission::GroupCheck;
pub use error::QueueError;

/// How long the queue waits for the holder of a worker id to answer when another worker
/// claims the id ([`QueueServer::claim`]).
const HOLDER_PROBE: Duration = Duration::from_secs(2);
/// Most groups one PeekGroups returns.
const MAX_PEEK: usize = 64;
/// Most prompts one Lease hands out.
const MAX_LEASE: usize = 64;
/// Largest message the queue takes or sends: a group is a few hundred kilobytes at most
/// (G completions of up to the context length, bounded text).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// What the queue tells workers to do with each prompt.
#[derive(Debug, Clone)]
pub struct GroupSpec {
    /// Completions per prompt (G).
    pub num_completions: u32,
    /// Sampling parameters (the seed comes per prompt).
    pub sampling: SamplingParams,
    /// What a submitted group must fit.
    pub check: GroupCheck,
}

/// The queue service, shared with the learner that fills and drains the queue.
#[derive(Debug, Clone)]
pub struct QueueServer {
    queue: QueueHandle,
    spec: GroupSpec,
    guard: Guard,
    tls: Option<Arc<ServerTls>>,
    learner_version: Arc<AtomicU64>,
    started: Instant,
    /// Refused duplicate worker ids (id, refused address), when last named.
    duplicates_said: Arc<std::sync::Mutex<BTreeMap<(String, String), Instant>>>,
    /// TLS towards workers' push addresses (to ask whether a worker is still there).
    push_tls: rookworld_service::tls::ClientTlsArgs,
}

impl QueueServer {
    pub fn new(
        queue: QueueHandle,
        spec: GroupSpec,
        token: Option<String>,
        learner_version: Arc<AtomicU64>,
    ) -> Self {
        Self {
            queue,
            spec,
            guard: Guard::new(token, None),
            tls: None,
            learner_version,
            started: Instant::now(),
            duplicates_said: Arc::default(),
            push_tls: Default::default(),
        }
    }

    /// Inspection calls need `token` (or the shared token); without, they are open.
    pub fn with_inspect_token(mut self, token: Option<String>) -> Self {
        self.guard = Guard::new(self.guard.token().map(str::to_owned), token);
        self
    }

    /// Serves TLS with `tls`.
    pub fn with_tls(mut self, tls: Option<Arc<ServerTls>>) -> Self {
        self.tls = tls;
        self
    }

    /// Calls workers' push addresses with `tls` (the weight pushes' client TLS).
    pub fn with_push_tls(mut self, tls: rookworld_service::tls::ClientTlsArgs) -> Self {
        self.push_tls = tls;
        self
    }

    /// Whether the worker at `address` may lease under the id `worker`: not while a worker
    /// at another address holds the id and still answers there
    /// ([`crate::queue::Queue::claim`],
    /// [`crate::push::worker_answers`]); one that is gone (restarted elsewhere) leaves the
    /// id to the newcomer.
    async fn claim(&self, worker: &str, address: &str, now: Instant) -> Result<(), QueueError> {
        let (w, a) = (worker.to_owned(), address.to_owned());
        let Err(dup) = self.queue.run(move |q| q.claim(&w, &a, now)).await else {
            return Ok(());
        };
        let token = self.guard.token().unwrap_or_default();
        if crate::push::worker_answers(&dup.holder, token, &self.push_tls, HOLDER_PROBE).await {
            self.said_duplicate(&dup);
            return Err(dup.into());
        }
        tracing::info!(worker = %worker.escape_debug(), from = %dup.holder, to = %address, "worker id moves to a new address: nothing answers at the old one");
        Ok(())
    }

    /// A worker call (`call`): the shared token. A refused call is counted by cause and
    /// caller ([`crate::queue::problems`]): such a worker never reaches the queue otherwise.
    async fn authorize<T>(&self, call: &'static str, request: &Request<T>) -> Result<(), Status> {
        let Err(e) = self.guard.work(request.metadata()) else {
            return Ok(());
        };
        let cause = match e {
            TokenError::Missing => "no token",
            TokenError::Wrong => "wrong token",
            TokenError::NotConfigured => "no token configured at the learner",
        };
        let caller = request
            .remote_addr()
            .map_or_else(|| "an unknown address".to_owned(), |a| a.to_string());
        self.queue
            .run(move |q| q.refused_call(call, cause, &caller, Instant::now()))
            .await;
        Err(QueueError::from(e).into())
    }

    /// Names two workers under one id: one ERROR line per refused address a minute (a
    /// refused worker stops, so a line means one start of it).
    fn said_duplicate(&self, e: &DuplicateWorker) {
        let mut said = self
            .duplicates_said
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (e.id.clone(), e.claimant.clone());
        if said
            .get(&key)
            .is_some_and(|t| t.elapsed() < Duration::from_secs(60))
        {
            return;
        }
        if said.len() >= 64 {
            said.clear();
        }
        said.insert(key, Instant::now());
        tracing::error!(
            worker = %e.id.escape_debug(),
            holder = %e.holder,
            refused = %e.claimant,
            "two workers use the worker id `{}`: the one at {} holds it, the one at {} is refused (ALREADY_EXISTS; it stops); give each worker its own --worker-id (ROLLOUT_WORKER_ID)",
            e.id.escape_debug(),
            e.holder,
            e.claimant
        );
    }

    /// An inspection call: open, or the inspection token.
    fn inspect<T>(&self, request: &Request<T>) -> Result<(), Status> {
        Ok(self
            .guard
            .inspect(request.metadata())
            .map_err(QueueError::from)?)
    }
}

/// A worker as `ListWorkers` shows it at `now` (never seen: since `started`).
fn worker_to_pb(id: &str, w: &WorkerStats, now: Instant, started: Instant) -> pb::WorkerInfo {
    pb::WorkerInfo {
        worker_id: id.to_owned(),
        leased: w.leased,
        submitted: w.submitted,
        expired: w.expired,
        refused: w.refused,
        outstanding: w.outstanding as u32,
        weight_version: w.weight_version,
        last_seen_seconds_ago: w
            .last_seen
            .map_or(now.duration_since(started), |t| now.duration_since(t))
            .as_secs_f64(),
        push_address: w.push_address.clone(),
        weight_run_id: w.reported_run.clone(),
        last_error: w.problem.as_ref().map(|p| p.describe()).unwrap_or_default(),
        last_error_seconds_ago: w
            .problem
            .as_ref()
            .and_then(|p| p.at)
            .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64()),
        weight_parent: String::new(),
    }
}

fn completion_to_pb(c: &ScoredCompletion) -> pb::ScoredCompletion {
    pb::ScoredCompletion {
        ids: c.ids.clone(),
        text: c.text.clone(),
        logprobs: c.logprobs.clone(),
        reward: c.reward,
        components: c.components.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        token_versions: c.token_versions.clone(),
    }
}

/// A checked completion (see [`admission::group`]).
fn completion_from_pb(c: pb::ScoredCompletion) -> ScoredCompletion {
    ScoredCompletion {
        ids: c.ids,
        text: c.text,
        logprobs: c.logprobs,
        reward: c.reward,
        components: c.components.into_iter().collect(),
        token_versions: c.token_versions,
        stale_prefix: 0,
    }
}

impl QueueServer {
    /// What [`admission`] asks of a submission, and that its prompt ids are the leased
    /// prompt's, as the learner tokenises it (the behaviour log-probs were computed on
    /// them; an unknown lease is refused later, by the queue).
    async fn check_submission(&self, r: &pb::SubmitRequest) -> Result<(), Status> {
        admission::worker_id(&r.worker_id)?;
        admission::group(
            r,
            self.spec.num_completions,
            self.spec.sampling.max_new_tokens,
            &self.spec.check,
        )?;
        let lease = r.lease_id;
        let leased = self.queue.run(move |q| q.leased_prompt(lease)).await;
        if let Some(prompt) = leased
            && self.spec.check.prompt_ids(&prompt)? != r.prompt_ids
        {
            return Err(QueueError::Invalid(
                "prompt_ids are not the leased prompt's tokens (BOS, then the prompt text)".into(),
            )
            .into());
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl RolloutQueue for QueueServer {
    #[tracing::instrument(name = "lease", skip_all, fields(worker = tracing::field::Empty))]
    async fn lease(
        &self,
        request: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        self.authorize("Lease", &request).await?;
        let r = request.into_inner();
        tracing::Span::current().record("worker", r.worker_id.as_str());
        admission::worker_id(&r.worker_id)?;
        admission::push_address(&r.push_address)?;
        let now = Instant::now();
        let max = (r.max_prompts as usize).clamp(1, MAX_LEASE);
        let (worker, address) = (r.worker_id.clone(), r.push_address.clone());
        let (reported_run, reported_version) = (r.weight_run_id.clone(), r.weight_version);
        // A second worker under a held id is refused before it counts as that one.
        self.claim(&worker, &address, now).await?;
        let (result, run_id) = self
            .queue
            .run(move |q| {
                let reported = (reported_run.as_str(), reported_version);
                // Before the lease too: a known worker's new push address counts at once.
                q.describe_worker(&worker, &address, reported, now);
                let result = q.lease(&worker, max, now);
                q.describe_worker(&worker, &address, reported, now);
                crate::metrics::record_queue(q);
                (result, q.run_id().to_owned())
            })
            .await;
        if let Err(Backpressure::PushUnreachable(problem)) = &result {
            return Err(QueueError::PushUnreachable(problem.clone()).into());
        }
        let mut response = pb::LeaseResponse {
            prompts: Vec::new(),
            num_completions: self.spec.num_completions,
            sampling: Some(self.spec.sampling),
            learner_version: self.learner_version.load(Ordering::SeqCst),
            backpressure: String::new(),
            retry_after_seconds: 0.0,
            run_id,
        };
        match result {
            Ok(grants) => {
                response.prompts = grants
                    .into_iter()
                    .map(|g| pb::LeasedPrompt {
                        lease_id: g.lease,
                        prompt_id: g.prompt.id,
                        task: match g.prompt.prompt.kind {
                            TaskKind::Policy => Task::Policy,
                            TaskKind::Environment => Task::Environment,
                        } as i32,
                        prompt: g.prompt.prompt.prompt,
                        seed: g.prompt.seed,
                        attempt: g.prompt.attempts,
                        deadline_seconds: g.deadline.saturating_duration_since(now).as_secs_f64(),
                    })
                    .collect();
            }
            Err(b) => {
                response.backpressure = match b {
                    Backpressure::LearnerBehind { .. } => "learner_behind",
                    Backpressure::TooManyLeases { .. } => "too_many_leases",
                    Backpressure::Empty => "empty",
                    Backpressure::Closed => "closed",
                    Backpressure::TooManyWorkers { .. } => "too_many_workers",
                    Backpressure::PushUnreachable(_) => unreachable!("answered above"),
                }
                .into();
                response.retry_after_seconds = match b {
                    Backpressure::TooManyWorkers { .. } => 5.0,
                    _ => 0.2,
                };
            }
        }
        Ok(Response::new(response))
    }

    #[tracing::instrument(
        name = "submit",
        skip_all,
        fields(worker = tracing::field::Empty, lease = tracing::field::Empty)
    )]
    async fn submit(
        &self,
        request: Request<pb::SubmitRequest>,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        self.authorize("Submit", &request).await?;
        let r = request.into_inner();
        let span = tracing::Span::current();
        span.record("worker", r.worker_id.as_str());
        span.record("lease", r.lease_id);
        self.check_submission(&r).await.inspect_err(|e| {
            metrics::counter!(names::QUEUE_SUBMISSIONS_INVALID_TOTAL).increment(1);
            tracing::warn!(worker = %r.worker_id.escape_debug(), lease = r.lease_id, error = %e.message(), "submission refused as invalid; its lease stays");
        })?;
        let group = ScoredGroup {
            prompt_id: r.prompt_id,
            prompt: String::new(),
            prompt_ids: r.prompt_ids,
            completions: r.completions.into_iter().map(completion_from_pb).collect(),
            worker: String::new(),
            run_id: r.run_id,
            weight_version: r.weight_version,
            seed: 0,
            generate_seconds: r.generate_seconds,
            score_seconds: r.score_seconds,
            lease_seconds: 0.0,
        };
        let (worker, lease) = (r.worker_id, r.lease_id);
        self.queue
            .run(move |q| {
                let result = q.submit(&worker, lease, group, Instant::now());
                crate::metrics::record_queue(q);
                result
            })
            .await
            .map_err(QueueError::from)?;
        Ok(Response::new(pb::SubmitResponse {
            learner_version: self.learner_version.load(Ordering::SeqCst),
        }))
    }

    async fn get_depths(
        &self,
        request: Request<pb::GetDepthsRequest>,
    ) -> Result<Response<pb::GetDepthsResponse>, Status> {
        self.inspect(&request)?;
        let now = Instant::now();
        let (d, run_id, refused_calls) = self
            .queue
            .run(move |q| {
                let refused = q
                    .refused_calls()
                    .iter()
                    .map(|((call, cause, peer), r)| pb::RefusedCalls {
                        call: call.clone(),
                        cause: cause.clone(),
                        peer: peer.clone(),
                        count: r.count,
                        last_seconds_ago: now.saturating_duration_since(r.last).as_secs_f64(),
                    })
                    .collect();
                (q.depths(), q.run_id().to_owned(), refused)
            })
            .await;
        let c = d.counters;
        Ok(Response::new(pb::GetDepthsResponse {
            pending: d.pending as u64,
            leased: d.leased as u64,
            scored: d.scored as u64,
            prompts_added: c.prompts_added,
            leases_issued: c.leases_issued,
            leases_expired: c.leases_expired,
            leases_released: c.leases_released,
            groups_submitted: c.groups_submitted,
            submissions_refused: c.submissions_refused,
            groups_consumed: c.groups_consumed,
            groups_dropped_stale: c.groups_dropped_stale,
            learner_version: self.learner_version.load(Ordering::SeqCst),
            scored_bytes: d.scored_bytes as u64,
            run_id,
            refused_calls,
        }))
    }

    async fn list_workers(
        &self,
        request: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        self.inspect(&request)?;
        let now = Instant::now();
        let started = self.started;
        let workers = self
            .queue
            .run(move |q| {
                q.workers()
                    .iter()
                    .map(|(id, w)| {
                        let parent = q.weight_parent(&w.push_address);
                        pb::WorkerInfo {
                            weight_parent: parent.unwrap_or_default().to_owned(),
                            ..worker_to_pb(id, w, now, started)
                        }
                    })
                    .collect()
            })
            .await;
        Ok(Response::new(pb::ListWorkersResponse { workers }))
    }

    async fn get_staleness(
        &self,
        request: Request<pb::GetStalenessRequest>,
    ) -> Result<Response<pb::GetStalenessResponse>, Status> {
        self.inspect(&request)?;
        let response = self
            .queue
            .run(|q| pb::GetStalenessResponse {
                buckets: q.staleness().to_vec(),
                dropped_stale: q.depths().counters.groups_dropped_stale,
                max_version_lag: q.config().max_version_lag,
            })
            .await;
        Ok(Response::new(response))
    }

    async fn report(
        &self,
        request: Request<pb::ReportRequest>,
    ) -> Result<Response<pb::ReportResponse>, Status> {
        self.authorize("Report", &request).await?;
        let r = request.into_inner();
        admission::worker_id(&r.worker_id)?;
        let now = Instant::now();
        let bounded = |s: &str, n: usize| s.chars().take(n).collect::<String>();
        let cause = match pb::ProblemCause::try_from(r.cause) {
            Ok(pb::ProblemCause::Unspecified) => None,
            Ok(pb::ProblemCause::ScoringRefused) => Some(Cause::ScoringRefused),
            Ok(pb::ProblemCause::RewardUnreachable) => Some(Cause::RewardUnreachable),
            Ok(pb::ProblemCause::SubmitRefused) => Some(Cause::SubmitRefused),
            Ok(pb::ProblemCause::GenerationFailed) => Some(Cause::GenerationFailed),
            Err(_) => {
                return Err(QueueError::Invalid(format!(
                    "cause {} is not a ProblemCause",
                    r.cause
                ))
                .into());
            }
        };
        let problem = cause.map(|cause| Problem {
            cause,
            peer: bounded(&r.peer, 256),
            code: bounded(&r.code, 64),
            message: bounded(&r.message, 512),
            at: Some(now),
        });
        if let Some(p) = &problem {
            tracing::debug!(worker = %r.worker_id.escape_debug(), problem = %p.describe().escape_debug(), "worker reports a problem");
        }
        let worker = r.worker_id;
        self.queue
            .run(move |q| q.report(&worker, problem, now))
            .await
            .map_err(QueueError::Full)?;
        Ok(Response::new(pb::ReportResponse {}))
    }

    async fn peek_groups(
        &self,
        request: Request<pb::PeekGroupsRequest>,
    ) -> Result<Response<pb::PeekGroupsResponse>, Status> {
        self.inspect(&request)?;
        let r = request.into_inner();
        let n = (r.count as usize).clamp(1, MAX_PEEK);
        let newest = r.newest;
        let groups = self
            .queue
            .run(move |q| q.peek(n, newest))
            .await
            .into_iter()
            .map(|g| pb::Group {
                prompt_id: g.prompt_id,
                prompt: g.prompt,
                worker_id: g.worker,
                weight_version: g.weight_version,
                seed: g.seed,
                completions: g.completions.iter().map(completion_to_pb).collect(),
                generate_seconds: g.generate_seconds,
                score_seconds: g.score_seconds,
                lease_seconds: g.lease_seconds,
            })
            .collect();
        Ok(Response::new(pb::PeekGroupsResponse { groups }))
    }
}

/// Serves the queue with health and reflection on `listener` until `shutdown`.
pub async fn run(
    server: QueueServer,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let tls = server.tls.clone();
    let service = RolloutQueueServer::new(server)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    rookworld_service::serve::serve(service, listener, tls, shutdown).await
}
