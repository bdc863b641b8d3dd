//! [`Worker::start`]: the one way to run a rollout worker. The binary's `serve`, the
//! learner's `--local`, its `bench-push` and every test start a worker through it, so a
//! worker is always assembled the same way: the model readied for generation, the engine
//! thread over it, the gRPC service on the caller's listener, the GPU monitor, and — with
//! a learner and a reward server to pull from — the worker loop, all ended by one
//! shutdown future.
//!
//! What the service builds pushed models in (their dtype, CPU panels and device) is read
//! from the model it is given, never configured beside it: a worker loaded in BF16 or INT8
//! builds every pushed version the same way.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rookworld_lm::{Gpt2, Tokenizer};
use rookworld_service::serve::{fan_out, stopped as until};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::engine::{Engine, EngineConfig, EngineError, prepare_model};
use crate::service::{self, RolloutServer, ServiceConfig};
use crate::worker_loop::{self, LoopConfig};

/// Everything a worker runs with.
#[derive(Debug)]
pub struct WorkerConfig {
    /// The policy, as loaded: [`Worker::start`] readies it for generation
    /// ([`prepare_model`]); its dtype, panels and device are the worker's.
    pub model: Gpt2,
    pub tokenizer: Tokenizer,
    /// The run and version of the weights it starts with (`None`: no run yet).
    pub weights: (Option<String>, u64),
    pub engine: EngineConfig,
    pub service: ServiceConfig,
    /// The learner and reward server to lease, score and submit against; `None` serves
    /// Generate and weight pushes only.
    pub pull: Option<LoopConfig>,
    /// Period of the GPU monitor's readings (NVML; nothing on the CPU).
    pub gpu_period: Duration,
    /// Where the model came from, as `Status` names it (e.g. `preset tiny (random
    /// weights, seed 0)`; empty: not known).
    pub model_source: String,
    /// Nothing but the worker holds `model`'s tensors (it was loaded for the worker, not
    /// cloned from a model its caller keeps), so its memory may take a later version.
    pub model_owned: bool,
}

impl WorkerConfig {
    /// A worker of `model` with the defaults: the GPT-2 tokenizer, version 0 of no run,
    /// the engine's and the service's default limits, no loop.
    pub fn new(model: Gpt2) -> Self {
        Self {
            model,
            tokenizer: Tokenizer::gpt2(),
            weights: (None, 0),
            engine: EngineConfig::default(),
            service: ServiceConfig::default(),
            pull: None,
            gpu_period: Duration::from_secs(5),
            model_source: String::new(),
            model_owned: false,
        }
    }
}

/// Why a worker did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The model could not be readied for generation.
    #[error("readying the model for generation: {0}")]
    Model(#[from] EngineError),
    /// The listener has no local address.
    #[error("the worker's listener: {0}")]
    Listener(#[from] std::io::Error),
}

/// A running worker; [`Worker::wait`] returns once its shutdown future has fired (or its
/// loop failed) and every part has stopped.
#[derive(Debug)]
pub struct Worker {
    engine: Arc<Engine>,
    local: SocketAddr,
    serving: JoinHandle<Result<(), Box<dyn std::error::Error + Send + Sync>>>,
    pulling: Option<JoinHandle<Result<(), String>>>,
    monitor: JoinHandle<()>,
}

impl Worker {
    /// Starts a worker serving on `listener` until `shutdown` completes.
    pub async fn start(
        config: WorkerConfig,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<Self, StartError> {
        let local = listener.local_addr()?;
        // Into whatever recorder the process has (the binary's exporter, or the learner's
        // under `--local`).
        crate::metrics::describe();
        {
            use rookworld_lm::kernels::Family;
            let disabled = config.model.kernels().disabled();
            crate::metrics::record_kernel_fallbacks(disabled.into_iter().map(|k| k.name()));
        }
        let model = prepare_model(config.model)?;
        let device = model.device().clone();
        let server_model = service::ServedModel::of(&model, &config.model_source);
        let (run, version) = config.weights;
        let mut engine = Engine::start(model, version, config.engine);
        if let Some(run) = run {
            engine = engine.with_run(&run);
        }
        let engine = Arc::new(engine);

        // The worker stops on `shutdown`, or when its loop ends with an error (the learner
        // refused it for good).
        let loop_failed = Arc::new(tokio::sync::Notify::new());
        let stopped = fan_out({
            let failed = loop_failed.clone();
            async move {
                tokio::select! {
                    () = shutdown => {}
                    () = failed.notified() => {}
                }
            }
        });

        let bos = server_model.config.bos_token_id;
        let mut server = RolloutServer::new(
            engine.clone(),
            config.tokenizer.clone(),
            server_model,
            config.service,
        );
        if config.model_owned {
            server = server.owning_its_first_model();
        }
        let serving = tokio::spawn(service::run(server, listener, until(stopped.clone())));
        let pulling = config.pull.map(|cfg| {
            tracing::info!(learner = %cfg.learner, reward = %cfg.reward, worker = %cfg.worker_id, push_address = %cfg.push_address, "pulling work");
            let pulled = worker_loop::run(
                engine.clone(),
                config.tokenizer,
                bos,
                cfg,
                until(stopped.clone()),
            );
            let failed = loop_failed.clone();
            tokio::spawn(async move {
                let result = pulled.await;
                if result.is_err() {
                    failed.notify_one();
                }
                result
            })
        });
        let monitor = tokio::spawn(crate::gpu::monitor(
            device,
            config.gpu_period,
            until(stopped),
        ));
        Ok(Self {
            engine,
            local,
            serving,
            pulling,
            monitor,
        })
    }

    /// The address the service listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Waits for the service, the loop and the monitor to end (after the shutdown future
    /// fired, or the loop failed), then stops the engine thread. The service's error, if
    /// it failed, else the loop's.
    pub async fn wait(self) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let served = match self.serving.await {
            Ok(result) => result,
            Err(e) => Err(format!("the rollout service panicked: {e}").into()),
        };
        let pulled = match self.pulling {
            Some(pulling) => match pulling.await {
                Ok(result) => result,
                Err(e) => Err(format!("the worker loop panicked: {e}")),
            },
            None => Ok(()),
        };
        let _ = self.monitor.await;
        self.engine.shutdown();
        served?;
        Ok(pulled?)
    }
}
