//! `rollout-worker serve`: the gRPC service on a port, metrics on another.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use rookworld_lm::cli::ModelArgs;

use crate::engine::{Engine, EngineArgs};
use crate::service::{self, RolloutServer, ServiceConfig};

/// Options of `rollout-worker serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address of the gRPC service (port 0 picks a free port).
    #[arg(long, env = "ROLLOUT_LISTEN", default_value = "127.0.0.1:50053")]
    pub listen: SocketAddr,
    /// Address of the Prometheus `/metrics` endpoint.
    #[arg(long, env = "ROLLOUT_METRICS", default_value = "127.0.0.1:9093")]
    pub metrics: SocketAddr,
    /// Shared token that control calls (UpdateWeights) must carry.
    #[arg(
        long,
        env = "ROOKWORLD_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    pub token: Option<String>,
    /// File holding the shared token (e.g. a Docker or Kubernetes secret).
    #[arg(long, env = "ROOKWORLD_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Version number of the weights loaded at start.
    #[arg(long, default_value_t = 0)]
    pub initial_version: u64,
    /// Samples queued across calls beyond which Generate is refused.
    #[arg(long, default_value_t = 1 << 16)]
    pub max_queued_samples: usize,
}

/// A configuration problem, reported as one line.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);

impl ServeArgs {
    fn token(&self) -> Result<Option<String>, ConfigError> {
        match (&self.token, &self.token_file) {
            (Some(t), _) if t.trim().is_empty() => Err(ConfigError("--token is empty".into())),
            (Some(t), _) => Ok(Some(t.trim().to_owned())),
            (None, Some(path)) => {
                let t = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError(format!("--token-file {}: {e}", path.display())))?;
                let t = t.trim();
                if t.is_empty() {
                    return Err(ConfigError(format!(
                        "--token-file {} is empty",
                        path.display()
                    )));
                }
                Ok(Some(t.to_owned()))
            }
            (None, None) => Ok(None),
        }
    }
}

/// Runs until Ctrl-C or SIGTERM.
pub async fn serve(args: &ServeArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let token = args.token()?;
    if token.is_none() {
        tracing::warn!("no --token / ROOKWORLD_TOKEN: weight updates will be refused");
    }
    let model_args = args.model.clone();
    let loaded = tokio::task::spawn_blocking(move || model_args.load()).await??;
    let (cfg, dtype, device) = (
        loaded.model.config().clone(),
        loaded.model.dtype(),
        loaded.device.clone(),
    );
    crate::metrics::install_exporter(args.metrics)
        .map_err(|e| ConfigError(format!("metrics on {}: {e}", args.metrics)))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| ConfigError(format!("cannot listen on {}: {e}", args.listen)))?;
    let model = crate::engine::prepare_model(loaded.model)?;
    let engine = Arc::new(Engine::start(
        model,
        args.initial_version,
        args.engine.config(),
    ));
    tracing::info!(
        listen = %listener.local_addr()?,
        metrics = %args.metrics,
        source = %loaded.source,
        device = ?device,
        dtype = ?dtype,
        "rollout worker ready"
    );
    let server = RolloutServer::new(
        engine.clone(),
        loaded.tokenizer,
        cfg,
        dtype,
        device,
        ServiceConfig {
            token,
            max_queued_samples: args.max_queued_samples,
            ..ServiceConfig::default()
        },
    );
    let result = service::run(server, listener, rookworld_proto::serve::shutdown_signal()).await;
    engine.shutdown();
    result
}
