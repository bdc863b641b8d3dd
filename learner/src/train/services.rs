//! What a run serves beside training, started before the first step and stopped after the
//! last checkpoint: the queue's gRPC service, `--local`'s worker and reward server, the
//! weight sync to the workers, the exporter and the evaluator.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rookworld_service::tls::ServerTls;
use rookworld_weights::export::{Exporter, Latest};
use rookworld_weights::set::WeightSet;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::support::{check_reward, publish};
use super::{ConfigError, Run, TrainArgs, TrainError, local, support, until};
use crate::eval::periodic::Evaluator;
use crate::eval::{Item, Suite};
use crate::push::{self, Fleet, SyncConfig};
use crate::queue_service::{self, GroupCheck, GroupSpec, QueueServer};

/// What a run checks before it touches its directory: settings, output files, the
/// tokens, TLS, the evaluation data and (without `--local`) a reachable reward server.
pub(super) struct Checked {
    token: String,
    inspect_token: Option<String>,
    tls: Option<Arc<ServerTls>>,
    eval_suites: Vec<(Suite, Vec<Item>)>,
}

/// Checks `args` so that a bad setting is one clear line before any work.
pub(super) async fn check(args: &TrainArgs) -> Result<Checked, TrainError> {
    args.validate()?;
    for (flag, path) in [
        ("--log-jsonl", &args.log_jsonl),
        ("--rollout-dump", &args.rollout_dump),
    ] {
        if let Some(path) = path {
            super::report::writable(path, flag)?;
        }
    }
    let eval_suites = args.eval.suites()?;
    let token = match (args.token()?, args.local) {
        (Some(t), _) => t,
        // One process on loopback: a fresh random token guards it.
        (None, true) => format!("local-{:016x}", rand::random::<u64>()),
        (None, false) => {
            return Err(ConfigError::Conflict(
                "the learner needs the shared token (--token, --token-file or ROOKWORLD_TOKEN)"
                    .into(),
            )
            .into());
        }
    };
    let inspect_token = args
        .token
        .resolve_inspect()
        .map_err(ConfigError::Unusable)?;
    let tls = args.tls.load().map_err(ConfigError::Unusable)?;
    args.client_tls.check().map_err(ConfigError::Unusable)?;
    if let Some(reward) = args.reward.as_ref().filter(|_| !args.local) {
        let wait = Duration::from_secs_f64(args.reward_wait.unwrap_or(30.0).max(0.0));
        check_reward(reward, &token, &args.client_tls, wait).await?;
    }
    Ok(Checked {
        token,
        inspect_token,
        tls,
        eval_suites,
    })
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
    pub async fn start(
        args: &TrainArgs,
        run: &Run,
        checked: Checked,
        listener: TcpListener,
    ) -> Result<Self, TrainError> {
        let s = &args.settings;
        let Checked {
            token,
            inspect_token,
            tls,
            eval_suites,
        } = checked;
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
        .with_inspect_token(inspect_token)
        .with_tls(tls.clone())
        .with_push_tls(push_tls(args));
        let (server_stop, server_stopped) = watch::channel(false);
        let queue_task = tokio::spawn(queue_service::run(server, listener, until(server_stopped)));
        tracing::info!(queue = %queue_addr, step = run.step, version = run.version.load(Ordering::SeqCst), "learner ready");

        let shared_dir = support::shared_dir(args)?;
        let local = if args.local {
            let version = run.version.load(Ordering::SeqCst);
            let weights = WeightSet::from_model(&run.policy.model, &run.run_id, version)?;
            Some(
                local::LocalServices::start(
                    queue_addr,
                    &weights,
                    run.policy.model.config(),
                    // The learner's device: the worker opens one of its own beside it
                    // (on CUDA the same GPU, its own stream and cuBLAS handle).
                    (run.policy.model.device(), args.rollout_weight_dtype()?),
                    &token,
                    shared_dir.clone(),
                    (tls, args.client_tls.clone()),
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
        let fleet = Arc::new(Mutex::new(Fleet::new(Duration::from_secs(30))));
        let (sync_stop, sync_stopped) = watch::channel(false);
        let sync_task = tokio::spawn(push::run(
            run.queue.clone(),
            fleet.clone(),
            latest_rx,
            token,
            SyncConfig {
                deadline: args.push_timeout(),
                forget_after: Duration::from_secs_f64((2.0 * s.lease_timeout).max(60.0)),
                tick: Duration::from_millis(250),
                tls: push_tls(args),
                model: push::LearnerModel {
                    shape: run.policy.model.config().shape(),
                    flag: match &args.model {
                        Some(dir) => format!("--model {}", dir.display()),
                        None => format!("--preset {}", args.preset),
                    },
                },
            },
            until(sync_stopped),
        ));
        tokio::task::block_in_place(|| publish(args, run, &latest))?;
        // Later versions: written by the optimizer, hashed and published off this thread.
        let exporter = Exporter::new(&run.policy.vars, latest.clone(), shared_dir.clone());
        // Evaluations of published weights on a thread of their own (the first: the start's).
        let evaluator = (!eval_suites.is_empty()).then(|| {
            let ev = Evaluator::start(
                eval_suites,
                run.policy.model.config().clone(),
                run.policy.model.device().clone(),
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
    pub async fn stop(self, args: &TrainArgs) {
        let _ = self.sync_stop.send(true);
        let _ = self.sync_task.await;
        self.latest.send_replace(None);
        drop(self.exporter);
        if args.local
            && args.shared_dir.is_none()
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

/// The client TLS of calls to workers' push addresses: the learner's, with
/// `--push-tls-name` as the name their certificates are checked against.
fn push_tls(args: &TrainArgs) -> rookworld_service::tls::ClientTlsArgs {
    rookworld_service::tls::ClientTlsArgs {
        server_name: args.push_tls_name.clone(),
        ..args.client_tls.clone()
    }
}
