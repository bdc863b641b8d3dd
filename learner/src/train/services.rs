//! What a run serves beside training, started before the first step and stopped after the
//! last checkpoint: the queue's gRPC service, `--local`'s worker and reward server, the
//! weight sync to the workers, the exporter and the evaluator.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rookworld_service::serve::stopped as until;
use rookworld_weights::export::{Exporter, Latest};
use rookworld_weights::set::WeightSet;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::config::ConfigError;
use super::error::TrainError;
use super::local;
use super::plan::{Plan, ServicesPlan};
use super::state::Run;
use crate::eval::periodic::Evaluator;
use crate::push::{self, Fleet, SyncConfig};
use crate::queue_service::{self, GroupCheck, GroupSpec, QueueServer};

/// Checks, before the run touches its directory, that the reward server the plan names
/// answers and takes the token (not with `--local`, which starts its own).
pub(super) async fn check(plan: &Plan) -> Result<(), TrainError> {
    let services = &plan.services;
    if let Some((url, wait)) = &services.reward {
        check_reward(url, &services.token, &services.client_tls, *wait).await?;
    }
    Ok(())
}

/// The running services of a run.
pub(super) struct Services {
    pub fleet: Arc<Mutex<Fleet>>,
    pub exporter: Exporter,
    pub evaluator: Option<Evaluator>,
    latest: Latest,
    shared_dir: Option<std::path::PathBuf>,
    local: Option<local::LocalServices>,
    server_stop: watch::Sender<bool>,
    queue_task: JoinHandle<Result<(), Box<dyn std::error::Error + Send + Sync>>>,
    sync_stop: watch::Sender<bool>,
    sync_task: JoinHandle<()>,
}

impl Services {
    /// Serves the queue on `listener`, starts `--local`'s services, the weight sync (the
    /// run's current weights published first), the exporter and the evaluator.
    pub async fn start(plan: &Plan, run: &Run, listener: TcpListener) -> Result<Self, TrainError> {
        let (s, services) = (&plan.settings, &plan.services);
        let token = services.token.clone();
        let queue_addr = listener.local_addr().map_err(TrainError::Listener)?;
        let spec = GroupSpec {
            num_completions: s.batch.group_size,
            sampling: s.sampling(),
            check: GroupCheck::for_model(run.policy.model.config()),
        };
        let server = QueueServer::new(
            run.queue.clone(),
            spec,
            Some(token.clone()),
            run.version.clone(),
        )
        .with_inspect_token(services.inspect_token.clone())
        .with_tls(services.tls.clone())
        .with_push_tls(services.push_tls.clone());
        let (server_stop, server_stopped) = watch::channel(false);
        let queue_task = tokio::spawn(queue_service::run(
            server,
            listener,
            until(server_stopped.clone()),
        ));
        tracing::info!(queue = %queue_addr, step = run.step, version = run.version.load(Ordering::SeqCst), "learner ready");
        if !services.local {
            let scheme = if services.tls.is_some() {
                "https"
            } else {
                "http"
            };
            let advice = format!(
                "no rollout worker has called the queue yet: a worker finds it with `rollout-worker serve --learner {scheme}://{queue_addr}` (an address it can reach) and the same token"
            );
            tokio::spawn(say_while_no_worker(
                run.queue.clone(),
                advice,
                until(server_stopped),
            ));
        }

        let shared_dir = shared_dir(services)?;
        let local = if services.local {
            let version = run.version.load(Ordering::SeqCst);
            let weights = WeightSet::from_model(&run.policy.model, &run.run_id, version)?;
            Some(
                local::LocalServices::start(
                    queue_addr,
                    &weights,
                    run.policy.model.config(),
                    // The learner's device: the worker opens one of its own beside it
                    // (on CUDA the same GPU, its own stream and cuBLAS handle).
                    (
                        run.policy.model.device(),
                        run.policy.model.kernels(),
                        services.rollout_weight_dtype,
                        services.rollout_swap_policy,
                    ),
                    &token,
                    shared_dir.clone(),
                    (services.tls.clone(), services.client_tls.clone()),
                )
                .await
                .map_err(TrainError::LocalServices)?,
            )
        } else {
            None
        };
        // The weight sync: every registered worker gets the newest published weights.
        let (latest, latest_rx) = watch::channel(None);
        let latest = Arc::new(latest);
        let fleet = Fleet::new(Duration::from_secs(30))
            .with_deltas(services.push_deltas)
            .with_fanout(services.push_fanout)
            // A push ends with the version delivered; the engine's wait for its step
            // boundary (or its drain) is the worker's swap clock's.
            .answering_when_staged();
        let fleet = Arc::new(Mutex::new(fleet));
        let (sync_stop, sync_stopped) = watch::channel(false);
        let sync_task = tokio::spawn(push::run(
            run.queue.clone(),
            fleet.clone(),
            latest_rx,
            token,
            SyncConfig {
                deadline: services.push_timeout,
                forget_after: Duration::from_secs_f64((2.0 * s.lease_timeout).max(60.0)),
                tick: Duration::from_millis(250),
                tls: services.push_tls.clone(),
                model: push::LearnerModel {
                    shape: run.policy.model.config().shape(),
                    flag: plan.model.flag(),
                },
            },
            until(sync_stopped),
        ));
        tokio::task::block_in_place(|| {
            push::publish(
                &plan.outputs.run_dir,
                &run.policy.model,
                &run.run_id,
                run.version.load(Ordering::SeqCst),
                &latest,
            )
        })?;
        // Later versions: written by the optimizer, hashed and published off this thread.
        let exporter = Exporter::new(&run.policy.vars, latest.clone(), shared_dir.clone());
        // Evaluations of published weights on a thread of their own (the first: the start's).
        let evaluator = (!plan.data.eval_suites.is_empty()).then(|| {
            let ev = Evaluator::start(
                plan.data.eval_suites.clone(),
                run.policy.model.config().clone(),
                (
                    run.policy.model.device().clone(),
                    run.policy.model.kernels().clone(),
                ),
                latest.subscribe(),
            );
            if run.step == 0 {
                ev.request(0, run.version.load(Ordering::SeqCst));
            }
            ev
        });
        Ok(Self {
            fleet,
            exporter,
            evaluator,
            latest,
            shared_dir,
            local,
            server_stop,
            queue_task,
            sync_stop,
            sync_task,
        })
    }

    /// Stops everything: pushes still in flight get their deadline, the shared payload
    /// files go with the last hold on them, then `--local`'s services and the queue.
    pub async fn stop(self, plan: &Plan) {
        let _ = self.sync_stop.send(true);
        let _ = self.sync_task.await;
        self.latest.send_replace(None);
        drop(self.exporter);
        if plan.services.local
            && plan.services.shared_dir.is_none()
            && let Some(dir) = &self.shared_dir
        {
            let _ = std::fs::remove_dir(dir);
        }
        if let Some(local) = self.local {
            local.stop().await;
        }
        let _ = self.server_stop.send(true);
        if let Ok(Ok(Err(e))) = tokio::time::timeout(Duration::from_secs(5), self.queue_task).await
        {
            tracing::warn!(error = %e, "queue server");
        }
    }
}

/// The directory of the same-host weight path: `--shared-dir` (created if missing), or for
/// `--local` a directory of this process under /dev/shm (the system's temporary directory
/// where there is none); `None` when pushes only stream (`--no-shared-dir`, or neither).
fn shared_dir(services: &ServicesPlan) -> Result<Option<std::path::PathBuf>, TrainError> {
    if services.no_shared_dir {
        return Ok(None);
    }
    let dir = match (&services.shared_dir, services.local) {
        (Some(dir), _) => dir.clone(),
        (None, true) => rookworld_weights::export::process_dir("rookworld-weights"),
        (None, false) => return Ok(None),
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| ConfigError::Unusable(format!("--shared-dir {}: {e}", dir.display())))?;
    Ok(Some(dir))
}

/// How often a wait on a peer says it is still waiting.
const WAIT_NOTE: Duration = Duration::from_secs(10);

/// Logs `advice` at once and every [`WAIT_NOTE`] until a worker has called the queue, or
/// `stop`.
async fn say_while_no_worker(
    queue: crate::queue::QueueHandle,
    advice: String,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    loop {
        if !queue.run(|q| q.workers().is_empty()).await {
            return;
        }
        tracing::warn!("{advice}");
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(WAIT_NOTE) => {}
        }
    }
}

/// Fails with one line naming `url` and the problem when nothing answers there within
/// `wait`, when what answers is not a reward server (another service's port), or when it
/// refuses `token` (none configured there, or another one): its `Info` and a trial `Score`.
/// While nothing answers, a WARN line says so at once and every [`WAIT_NOTE`].
async fn check_reward(
    url: &str,
    token: &str,
    tls: &rookworld_service::tls::ClientTlsArgs,
    wait: Duration,
) -> Result<(), TrainError> {
    let endpoint = tls
        .endpoint(url)
        .map_err(|e| ConfigError::Unusable(format!("--reward {url}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10));
    use rookworld_service::tls::TlsProblem;
    // TLS on one side only does not cure itself: named at once.
    let tls_problem = |why: &str| {
        TlsProblem::classify(url, why).map(|p| {
            TrainError::from(ConfigError::Unusable(format!(
                "reward server: {}",
                p.at(url)
            )))
        })
    };
    let started = Instant::now();
    let mut said: Option<Instant> = None;
    let channel = loop {
        match endpoint.connect().await {
            Ok(channel) => break channel,
            Err(e) => {
                let why = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                if let Some(e) = tls_problem(&rookworld_service::probe::error_chain(&e)) {
                    return Err(e);
                }
                let waited = started.elapsed();
                if waited >= wait {
                    return Err(ConfigError::Unusable(format!(
                        "reward server {url} unreachable for {:.0} s: {why}",
                        wait.as_secs_f64()
                    ))
                    .into());
                }
                // No silent wait: said at once, then every WAIT_NOTE.
                if said.is_none_or(|t| t.elapsed() >= WAIT_NOTE) {
                    tracing::warn!(
                        reward = url,
                        %why,
                        "waiting for the reward server (--reward) to answer; the run stops in {:.0} s (--reward-wait)",
                        (wait - waited).as_secs_f64()
                    );
                    said = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    match rookworld_service::probe::reward_server(channel, token).await {
        Ok(what) => {
            tracing::info!(reward = url, %what, "reward server answers and takes the token");
            Ok(())
        }
        Err(problem) => Err(tls_problem(&problem.to_string()).unwrap_or_else(|| {
            ConfigError::Unusable(format!("reward server {url} {problem}")).into()
        })),
    }
}
