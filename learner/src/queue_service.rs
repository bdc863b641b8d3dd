//! The rollout queue over gRPC (`rookworld.queue.v1.RolloutQueue`): worker calls behind the
//! shared token, read-only inspection for people with grpcurl; health and reflection on
//! the same port.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rookworld_proto::auth::check_token;
use rookworld_proto::queue::v1 as pb;
use rookworld_proto::queue::v1::rollout_queue_server::{RolloutQueue, RolloutQueueServer};
use rookworld_proto::v1::SamplingParams;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use crate::prompts::TaskKind;
use crate::queue::{Backpressure, Queue, ScoredCompletion, ScoredGroup, SubmitError};

/// Most groups one PeekGroups returns.
const MAX_PEEK: usize = 64;
/// Most prompts one Lease hands out.
const MAX_LEASE: usize = 64;

/// What the queue tells workers to do with each prompt.
#[derive(Debug, Clone)]
pub struct GroupSpec {
    /// Completions per prompt (G).
    pub num_completions: u32,
    /// Sampling parameters (the seed comes per prompt).
    pub sampling: SamplingParams,
}

/// The queue service, shared with the learner that fills and drains the queue.
#[derive(Debug, Clone)]
pub struct QueueServer {
    queue: Arc<Mutex<Queue>>,
    spec: GroupSpec,
    token: Option<String>,
    learner_version: Arc<AtomicU64>,
    started: Instant,
}

impl QueueServer {
    pub fn new(
        queue: Arc<Mutex<Queue>>,
        spec: GroupSpec,
        token: Option<String>,
        learner_version: Arc<AtomicU64>,
    ) -> Self {
        Self {
            queue,
            spec,
            token,
            learner_version,
            started: Instant::now(),
        }
    }

    fn authorize<T>(&self, request: &Request<T>) -> Result<(), Status> {
        Ok(check_token(request.metadata(), self.token.as_deref())?)
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn completion_to_pb(c: &ScoredCompletion) -> pb::ScoredCompletion {
    pb::ScoredCompletion {
        ids: c.ids.clone(),
        text: c.text.clone(),
        logprobs: c.logprobs.clone(),
        reward: c.reward,
        components: c.components.iter().map(|(k, v)| (k.clone(), *v)).collect(),
    }
}

fn completion_from_pb(c: pb::ScoredCompletion) -> Result<ScoredCompletion, Status> {
    if c.logprobs.len() != c.ids.len() {
        return Err(Status::invalid_argument(format!(
            "a completion has {} ids but {} log-probs",
            c.ids.len(),
            c.logprobs.len()
        )));
    }
    if !c.reward.is_finite() || c.logprobs.iter().any(|l| !l.is_finite()) {
        return Err(Status::invalid_argument(
            "rewards and log-probs must be finite",
        ));
    }
    Ok(ScoredCompletion {
        ids: c.ids,
        text: c.text,
        logprobs: c.logprobs,
        reward: c.reward,
        components: c.components.into_iter().collect(),
    })
}

#[tonic::async_trait]
impl RolloutQueue for QueueServer {
    async fn lease(
        &self,
        request: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        self.authorize(&request)?;
        let r = request.into_inner();
        if r.worker_id.is_empty() {
            return Err(Status::invalid_argument("worker_id is empty"));
        }
        let now = Instant::now();
        let max = (r.max_prompts as usize).clamp(1, MAX_LEASE);
        let result = {
            let mut q = self.queue();
            q.set_push_address(&r.worker_id, &r.push_address);
            let result = q.lease(&r.worker_id, max, now);
            crate::metrics::record_queue(&q);
            result
        };
        let mut response = pb::LeaseResponse {
            prompts: Vec::new(),
            num_completions: self.spec.num_completions,
            sampling: Some(self.spec.sampling),
            learner_version: self.learner_version.load(Ordering::SeqCst),
            backpressure: String::new(),
            retry_after_seconds: 0.0,
        };
        match result {
            Ok(grants) => {
                response.prompts = grants
                    .into_iter()
                    .map(|g| pb::LeasedPrompt {
                        lease_id: g.lease,
                        prompt_id: g.prompt.id,
                        task: match g.prompt.prompt.kind {
                            TaskKind::Policy => "P",
                            TaskKind::Environment => "A",
                        }
                        .into(),
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
                }
                .into();
                response.retry_after_seconds = 0.2;
            }
        }
        Ok(Response::new(response))
    }

    async fn submit(
        &self,
        request: Request<pb::SubmitRequest>,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        self.authorize(&request)?;
        let r = request.into_inner();
        if r.completions.is_empty() {
            return Err(Status::invalid_argument(
                "a group needs at least one completion",
            ));
        }
        let group = ScoredGroup {
            prompt_id: r.prompt_id,
            prompt: String::new(),
            prompt_ids: r.prompt_ids,
            completions: r
                .completions
                .into_iter()
                .map(completion_from_pb)
                .collect::<Result<_, _>>()?,
            worker: String::new(),
            weight_version: r.weight_version,
            seed: 0,
            generate_seconds: r.generate_seconds,
            score_seconds: r.score_seconds,
            lease_seconds: 0.0,
        };
        {
            let mut q = self.queue();
            let result = q.submit(&r.worker_id, r.lease_id, group, Instant::now());
            crate::metrics::record_queue(&q);
            result.map_err(|e: SubmitError| Status::failed_precondition(e.to_string()))?;
        }
        Ok(Response::new(pb::SubmitResponse {
            learner_version: self.learner_version.load(Ordering::SeqCst),
        }))
    }

    async fn get_depths(
        &self,
        _: Request<pb::GetDepthsRequest>,
    ) -> Result<Response<pb::GetDepthsResponse>, Status> {
        let d = self.queue().depths();
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
        }))
    }

    async fn list_workers(
        &self,
        _: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        let now = Instant::now();
        let workers = self
            .queue()
            .workers()
            .iter()
            .map(|(id, w)| pb::WorkerInfo {
                worker_id: id.clone(),
                leased: w.leased,
                submitted: w.submitted,
                expired: w.expired,
                refused: w.refused,
                outstanding: w.outstanding as u32,
                weight_version: w.weight_version,
                last_seen_seconds_ago: w
                    .last_seen
                    .map_or(now.duration_since(self.started), |t| now.duration_since(t))
                    .as_secs_f64(),
                push_address: w.push_address.clone(),
            })
            .collect();
        Ok(Response::new(pb::ListWorkersResponse { workers }))
    }

    async fn get_staleness(
        &self,
        _: Request<pb::GetStalenessRequest>,
    ) -> Result<Response<pb::GetStalenessResponse>, Status> {
        let q = self.queue();
        Ok(Response::new(pb::GetStalenessResponse {
            buckets: q.staleness().to_vec(),
            dropped_stale: q.depths().counters.groups_dropped_stale,
            max_version_lag: q.config().max_version_lag,
        }))
    }

    async fn peek_groups(
        &self,
        request: Request<pb::PeekGroupsRequest>,
    ) -> Result<Response<pb::PeekGroupsResponse>, Status> {
        let r = request.into_inner();
        let n = (r.count as usize).clamp(1, MAX_PEEK);
        let groups = self
            .queue()
            .peek(n, r.newest)
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
    let service = RolloutQueueServer::new(server)
        .max_decoding_message_size(16 * 1024 * 1024)
        .max_encoding_message_size(16 * 1024 * 1024);
    rookworld_proto::serve::serve(service, listener, shutdown).await
}
