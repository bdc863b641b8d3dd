//! The gRPC service: batch scoring, info, health and server reflection (v1 and v1alpha).

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use rookworld_proto::reward::v1 as pb;
use rookworld_proto::reward::v1::reward_service_server::{RewardService, RewardServiceServer};
use rookworld_service::auth::Guard;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};

use crate::error::{RequestError, ServiceError};
use crate::metrics::names;
use crate::metrics::record_score;
use rookworld_chess::score::{Score, Verdict};
use rookworld_chess::scorer::{Item, Scorer};
use rookworld_chess::task::Task;

/// Limits and guards of the service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The shared token Score must carry (none: every Score call is refused), and the
    /// inspection token Info must carry (none: it is open).
    pub guard: Guard,
    /// TLS of the port; `None` serves plaintext.
    pub tls: Option<Arc<rookworld_service::tls::ServerTls>>,
    /// Items being scored at once across all calls; more is `RESOURCE_EXHAUSTED`.
    pub max_items_in_flight: usize,
    /// Items in one call; more is `INVALID_ARGUMENT`.
    pub max_items_per_call: usize,
    /// Largest request or response message, bytes: a full call (16,384 items of a
    /// RookWorld prompt and completion, ~1 KiB each) fits; a bigger message is refused
    /// before it is decoded.
    pub max_message_bytes: usize,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            guard: Guard::default(),
            tls: None,
            max_items_in_flight: 65_536,
            max_items_per_call: 16_384,
            max_message_bytes: 16 * 1024 * 1024,
        }
    }
}

/// The `RewardService` implementation.
#[derive(Debug)]
pub struct RewardServer {
    scorer: Scorer,
    cfg: ServiceConfig,
    guard: Guard,
    slots: Arc<Semaphore>,
}

impl RewardServer {
    pub fn new(scorer: Scorer, cfg: ServiceConfig) -> Self {
        Self {
            guard: cfg.guard.clone(),
            slots: Arc::new(Semaphore::new(cfg.max_items_in_flight)),
            scorer,
            cfg,
        }
    }

    async fn score_batch(
        &self,
        items: Vec<pb::ScoreItem>,
    ) -> Result<Vec<pb::ScoreResult>, ServiceError> {
        let n = items.len();
        if n > self.cfg.max_items_per_call {
            return Err(ServiceError::TooLarge {
                requested: n,
                limit: self.cfg.max_items_per_call,
            });
        }
        let _permit = self
            .slots
            .clone()
            .try_acquire_many_owned(n as u32)
            .map_err(|_| ServiceError::Overloaded {
                requested: n,
                available: self.slots.available_permits(),
                limit: self.cfg.max_items_in_flight,
            })?;
        let items = items
            .into_iter()
            .enumerate()
            .map(|(index, it)| {
                let task = match pb::Task::try_from(it.task) {
                    Ok(pb::Task::Policy) => Task::Policy,
                    Ok(pb::Task::Environment) => Task::Environment,
                    _ => {
                        return Err(ServiceError::BadItem {
                            index,
                            source: RequestError::UnknownTask(format!("enum value {}", it.task)),
                        });
                    }
                };
                Ok(Item {
                    task,
                    prompt: it.prompt,
                    completion: it.completion,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let scores = self.scorer.score_each(&items).await;
        let mut results = Vec::with_capacity(n);
        for (index, (item, score)) in items.iter().zip(scores).enumerate() {
            let score = score.map_err(|source| ServiceError::BadItem { index, source })?;
            results.push((item.task, score));
        }
        Ok(results
            .into_iter()
            .map(|(task, score)| {
                record_score(task.label(), &score);
                to_proto(score)
            })
            .collect())
    }
}

fn to_proto(score: Score) -> pb::ScoreResult {
    pb::ScoreResult {
        reward: score.reward,
        verdict: match score.verdict {
            Verdict::Exact => pb::Verdict::Exact,
            Verdict::Partial => pb::Verdict::Partial,
            Verdict::Malformed => pb::Verdict::Malformed,
        } as i32,
        components: score
            .components
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect(),
        reason: score.malformed.map(|m| m.detail).unwrap_or_default(),
        engine_graded: score.engine_graded,
    }
}

#[tonic::async_trait]
impl RewardService for RewardServer {
    #[tracing::instrument(name = "score", skip_all, fields(items = request.get_ref().items.len()))]
    async fn score(
        &self,
        request: Request<pb::ScoreRequest>,
    ) -> Result<Response<pb::ScoreResponse>, Status> {
        let started = Instant::now();
        let result = match self.guard.work(request.metadata()) {
            Ok(()) => self.score_batch(request.into_inner().items).await,
            Err(e) => Err(e.into()),
        };
        let status = match &result {
            Ok(_) => "ok",
            Err(e) => e.label(),
        };
        metrics::counter!(names::REQUESTS_TOTAL, "status" => status).increment(1);
        metrics::histogram!(names::REQUEST_DURATION_SECONDS)
            .record(started.elapsed().as_secs_f64());
        let results = result.map_err(Status::from)?;
        Ok(Response::new(pb::ScoreResponse { results }))
    }

    async fn info(
        &self,
        request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        self.guard
            .inspect(request.metadata())
            .map_err(ServiceError::from)?;
        let cfg = self.scorer.config();
        let weights = cfg
            .environment
            .table()
            .into_iter()
            .map(|(k, w)| (format!("A.{k}"), w))
            .chain(
                cfg.policy
                    .table(true)
                    .into_iter()
                    .map(|(k, w)| (format!("P.{k}"), w)),
            )
            .collect();
        Ok(Response::new(pb::InfoResponse {
            engine_configured: self.scorer.engine().is_some(),
            engine_processes: self
                .scorer
                .engine()
                .map_or(0, |e| e.config().processes as u32),
            max_items_in_flight: self.cfg.max_items_in_flight as u32,
            weights,
        }))
    }
}

/// Serves the reward service, health and reflection on `listener` until `shutdown`
/// completes; in-flight calls finish first.
pub async fn run(
    scorer: Scorer,
    cfg: ServiceConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // Into whatever recorder the process has (the binary's exporter, or the learner's
    // under `--local`).
    crate::metrics::describe();
    let (max, tls) = (cfg.max_message_bytes, cfg.tls.clone());
    let service = RewardServiceServer::new(RewardServer::new(scorer, cfg))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    rookworld_service::serve::serve(service, listener, tls, shutdown).await
}
