//! `learner train --local`: a reward server and one rollout worker in this process, each
//! on its own loopback port and spoken to over real gRPC by the same code that runs them
//! as separate services.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, DeviceLocation};
use rollout_worker::{LoopConfig, ServiceConfig, Worker, WorkerConfig};
use rookworld_chess::score::RewardConfig;
use rookworld_chess::scorer::Scorer;
use rookworld_generation::{EngineConfig, SwapPolicy};
use rookworld_lm::device::{DeviceChoice, WeightDtype};
use rookworld_lm::kernels::Kernels;
use rookworld_lm::{Gpt2, model_io};
use rookworld_service::tls::{ClientTlsArgs, ServerTls};
use rookworld_weights::set::WeightSet;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use rookworld_service::serve::stopped as until;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The in-process services; [`LocalServices::stop`] ends them.
pub struct LocalServices {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl LocalServices {
    /// Starts the reward server and a worker that runs `weights` (the BF16 set the
    /// learner would push, so worker and learner agree from the first step) on a device of
    /// its own beside `learner_device` ([`worker_device`]) in `weight_dtype`
    /// (`--rollout-weight-dtype`), swapping new weights in as `swap_policy` says
    /// (`--rollout-swap-policy`), and pulls from the queue at `queue`. With `tls` (the
    /// learner's: its certificate must name 127.0.0.1), every local port serves TLS and the
    /// worker calls out with `client`.
    pub async fn start(
        queue: SocketAddr,
        weights: &WeightSet,
        config: &rookworld_lm::Config,
        (learner_device, learner_kernels, weight_dtype, swap_policy): (
            &Device,
            &Kernels,
            WeightDtype,
            SwapPolicy,
        ),
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

        let (device, kernels) = worker_device(learner_device, learner_kernels)?;
        // `auto`: BF16 on CUDA, BF16 panels on the CPU (the pushes are BF16 values: the
        // same products as f32 panels, half the bytes).
        let (dtype, panels) = weight_dtype.resolve(&device)?;
        let mut model: Gpt2 = model_io::from_bytes(&weights.bytes, config, dtype, &device)?;
        model.set_panel_dtype(panels);
        model.set_kernels(kernels);
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
                // Built from the payload above for this worker alone.
                model_owned: true,
                engine: EngineConfig {
                    swap_policy,
                    ..EngineConfig::default()
                },
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

/// The in-process worker's device beside the learner's: the CPU beside the CPU; beside a
/// CUDA device, the same GPU opened again, as `--device cuda:N` opens it (a stream and a
/// cuBLAS handle of its own), so that the worker's decoding overlaps the learner's step
/// instead of queueing behind it on one stream. The two share the GPU's memory pool and
/// the verdict on its kernels (`learner_kernels`: the start-up check runs once per GPU).
pub fn worker_device(
    learner: &Device,
    learner_kernels: &Kernels,
) -> rookworld_lm::Result<(Device, Kernels)> {
    match learner {
        Device::Cpu => Ok((Device::Cpu, learner_kernels.clone())),
        other => worker_device_choice(other.location())?.open_beside(learner_kernels),
    }
}

/// How [`worker_device`] opens the worker's device for the learner's at `learner`.
fn worker_device_choice(learner: DeviceLocation) -> rookworld_lm::Result<DeviceChoice> {
    match learner {
        DeviceLocation::Cpu => Ok(DeviceChoice::Cpu),
        DeviceLocation::Cuda { gpu_id } => Ok(DeviceChoice::Cuda(gpu_id)),
        DeviceLocation::Metal { .. } => Err(rookworld_lm::Error::InvalidArgument(
            "train --local: the rollout worker runs on the CPU or CUDA, not Metal".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worker_opens_a_device_of_its_own_beside_the_learners() {
        let kernels = Kernels::cpu();
        assert!(worker_device(&Device::Cpu, &kernels).unwrap().0.is_cpu());
        assert_eq!(
            worker_device_choice(DeviceLocation::Cpu).unwrap(),
            DeviceChoice::Cpu
        );
        // The same GPU, opened again: not the learner's `Device` (its stream) shared.
        assert_eq!(
            worker_device_choice(DeviceLocation::Cuda { gpu_id: 1 }).unwrap(),
            DeviceChoice::Cuda(1)
        );
        assert!(worker_device_choice(DeviceLocation::Metal { gpu_id: 0 }).is_err());
    }
}
