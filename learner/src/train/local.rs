//! `learner train --local`: a reward server and one rollout worker in this process, each
//! on its own loopback port and spoken to over real gRPC by the same code that runs them
//! as separate services.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use rollout_worker::{LoopConfig, ServiceConfig, Worker, WorkerConfig};
use rookworld_chess::score::RewardConfig;
use rookworld_chess::scorer::Scorer;
use rookworld_lm::device::WeightDtype;
use rookworld_lm::{Gpt2, checkpoint};
use rookworld_service::tls::{ClientTlsArgs, ServerTls};
use rookworld_weights::set::WeightSet;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::until;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The in-process services; [`LocalServices::stop`] ends them.
pub struct LocalServices {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl LocalServices {
    /// Starts the reward server and a worker that runs `weights` (the BF16 set the
    /// learner would push, so worker and learner agree from the first step) on `device`
    /// (the learner's: f32 on the CPU, bfloat16 on a GPU they share) in `weight_dtype`
    /// (`--rollout-weight-dtype`) and pulls from the queue at `queue`. With `tls` (the learner's: its certificate must name
    /// 127.0.0.1), every local port serves TLS and the worker calls out with `client`.
    pub async fn start(
        queue: SocketAddr,
        weights: &WeightSet,
        config: &rookworld_lm::Config,
        (device, weight_dtype): (&Device, WeightDtype),
        token: &str,
        shared_dir: Option<std::path::PathBuf>,
        (tls, client): (Option<Arc<ServerTls>>, ClientTlsArgs),
    ) -> Result<Self, BoxError> {
        let (stop, stopped) = watch::channel(false);
        let mut tasks = Vec::new();
        let scheme = if tls.is_some() { "https" } else { "http" };

        let reward_listener = TcpListener::bind("127.0.0.1:0").await?;
        let reward = format!("{scheme}://{}", reward_listener.local_addr()?);
        let scorer = Scorer::new(RewardConfig::default(), None);
        let reward_cfg = reward_server::service::ServiceConfig {
            guard: rookworld_service::auth::Guard::shared(token),
            tls: tls.clone(),
            ..Default::default()
        };
        let rx = stopped.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) =
                reward_server::service::run(scorer, reward_cfg, reward_listener, until(rx)).await
            {
                tracing::error!(error = %e, "local reward server");
            }
        }));

        // `auto`: BF16 on CUDA, BF16 panels on the CPU (the pushes are BF16 values: the
        // same products as f32 panels, half the bytes).
        let (dtype, panels) = weight_dtype.resolve(device)?;
        let mut model: Gpt2 = checkpoint::from_bytes(&weights.bytes, config, dtype, device)?;
        model.set_panel_dtype(panels);
        let worker_listener = TcpListener::bind("127.0.0.1:0").await?;
        let worker = format!("{scheme}://{}", worker_listener.local_addr()?);
        let pull = LoopConfig {
            learner: format!("{scheme}://{queue}"),
            reward: reward.clone(),
            token: token.to_owned(),
            worker_id: "local-worker".into(),
            push_address: worker.clone(),
            max_in_flight: 4,
            call_timeout: Duration::from_secs(30),
            max_backoff: Duration::from_secs(2),
            tls: client,
        };
        let started = Worker::start(
            WorkerConfig {
                weights: (Some(weights.run_id.clone()), weights.version),
                service: ServiceConfig {
                    guard: rookworld_service::auth::Guard::shared(token),
                    tls,
                    shared_dir,
                    ..ServiceConfig::default()
                },
                pull: Some(pull),
                ..WorkerConfig::new(model)
            },
            worker_listener,
            until(stopped.clone()),
        )
        .await?;
        tasks.push(tokio::spawn(async move {
            if let Err(e) = started.wait().await {
                tracing::error!(error = %e, "local rollout worker");
            }
        }));
        tracing::info!(%reward, %worker, "local reward server and rollout worker started");
        Ok(Self { stop, tasks })
    }

    /// Stops the worker loop and both servers and waits for them.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}
