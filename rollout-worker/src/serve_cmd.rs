//! `rollout-worker serve`: the gRPC service on a port, metrics on another.

use std::net::SocketAddr;
use std::time::Duration;

use rookworld_lm::cli::ModelArgs;

use crate::engine::EngineArgs;
use crate::service::ServiceConfig;
use crate::worker::{Worker, WorkerConfig};
use crate::worker_loop::LoopConfig;

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
    #[command(flatten)]
    pub token: rookworld_service::auth::TokenArgs,
    #[command(flatten)]
    pub tls: rookworld_service::tls::ServerTlsArgs,
    /// TLS towards the learner, the reward server and the workers this one relays weight
    /// pushes to (their `https://` URLs).
    #[command(flatten)]
    pub client_tls: rookworld_service::tls::ClientTlsArgs,
    /// Version number of the weights loaded at start.
    #[arg(long, default_value_t = 0)]
    pub initial_version: u64,
    /// Samples queued across calls beyond which Generate is refused.
    #[arg(long, default_value_t = 1 << 16)]
    pub max_queued_samples: usize,
    /// Learner queue to pull work from (e.g. http://learner:50051); with --reward, the
    /// worker leases, generates, scores and submits in a loop.
    #[arg(long, env = "ROLLOUT_LEARNER", requires = "reward")]
    pub learner: Option<String>,
    /// Reward server that scores the completions (e.g. http://reward:50052).
    #[arg(long, env = "ROLLOUT_REWARD", requires = "learner")]
    pub reward: Option<String>,
    /// This worker's id at the learner (default: host name and listen port); with
    /// --learner.
    #[arg(long, env = "ROLLOUT_WORKER_ID")]
    pub worker_id: Option<String>,
    /// URL at which the learner reaches this worker's service for weight pushes (default:
    /// the listen address — loopback stays loopback — or, for a wildcard bind such as
    /// 0.0.0.0, the OS host name: http://HOST:PORT, https:// with --tls-cert).
    #[arg(long, env = "ROLLOUT_ADVERTISE")]
    pub advertise: Option<String>,
    /// Groups in flight in the loop (default with --learner: 4).
    #[arg(
        long,
        default_value_if("learner", clap::builder::ArgPredicate::IsPresent, "4")
    )]
    pub max_in_flight: Option<usize>,
    /// Directory a learner on this host shares payloads through (the same-host weight
    /// path: the learner's `--shared-dir`, seen from here); without it, pushes stream.
    #[arg(long, env = "ROLLOUT_SHARED_DIR")]
    pub shared_dir: Option<std::path::PathBuf>,
}

/// A configuration problem, reported as one line.
pub use rookworld_service::validate::ConfigError;

impl ServeArgs {
    /// URLs with their scheme, counts in range: one line at start, not retries forever.
    fn validate(&self) -> Result<(), ConfigError> {
        use rookworld_service::validate::{at_least, url};
        // The worker loop's options, refused without it (each has a default only with it).
        if self.learner.is_none() {
            let given = [
                ("--worker-id", self.worker_id.is_some()),
                ("--advertise", self.advertise.is_some()),
                ("--max-in-flight", self.max_in_flight.is_some()),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, set)| *set) {
                return Err(ConfigError::Conflict(format!(
                    "{flag} is an option of the worker loop, which runs with --learner and --reward; without them this worker only serves Generate"
                )));
            }
        }
        let mut checks = vec![at_least(
            "--max-queued-samples",
            self.max_queued_samples as u64,
            1,
        )];
        if let Some(n) = self.max_in_flight {
            checks.push(at_least("--max-in-flight", n as u64, 1));
        }
        for (flag, value) in [
            ("--learner", &self.learner),
            ("--reward", &self.reward),
            ("--advertise", &self.advertise),
        ] {
            if let Some(v) = value {
                checks.push(url(flag, v));
            }
        }
        checks.into_iter().collect::<Result<(), _>>()
    }

    fn token(&self) -> Result<Option<String>, ConfigError> {
        self.token.resolve().map_err(ConfigError::Unusable)
    }

    /// The advertised push URL must match how the port serves.
    fn check_advertise(&self) -> Result<(), ConfigError> {
        match &self.advertise {
            Some(a) if self.tls.enabled() && !a.starts_with("https://") => {
                Err(ConfigError::Conflict(format!(
                    "--advertise {a}: the port serves TLS (--tls-cert), so use https://"
                )))
            }
            Some(a) if !self.tls.enabled() && a.starts_with("https://") => {
                Err(ConfigError::Conflict(format!(
                    "--advertise {a}: the port serves plaintext; set --tls-cert or use http://"
                )))
            }
            _ => Ok(()),
        }
    }
}

/// Runs until Ctrl-C or SIGTERM.
pub async fn serve(args: &ServeArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    args.validate()?;
    args.check_advertise()?;
    let token = args.token()?;
    let inspect_token = args
        .token
        .resolve_inspect()
        .map_err(ConfigError::Unusable)?;
    if token.is_none() {
        tracing::warn!("no --token / ROOKWORLD_TOKEN: Generate and weight updates will be refused");
    }
    let tls = args.tls.load().map_err(ConfigError::Unusable)?;
    args.client_tls.check().map_err(ConfigError::Unusable)?;
    let model_args = args.model.clone();
    let loaded = tokio::task::spawn_blocking(move || model_args.load()).await??;
    let metrics = crate::metrics::install_exporter(args.metrics)
        .map_err(|e| ConfigError::Unusable(format!("metrics on {}: {e}", args.metrics)))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| ConfigError::Unusable(format!("cannot listen on {}: {e}", args.listen)))?;
    let local = listener.local_addr()?;
    let pull = match (&args.learner, &args.reward) {
        (Some(learner), Some(reward)) => Some(LoopConfig {
            learner: learner.clone(),
            reward: reward.clone(),
            token: token.clone().ok_or_else(|| {
                ConfigError::Conflict(
                    "--learner needs the shared token (--token or --token-file)".into(),
                )
            })?,
            worker_id: args
                .worker_id
                .clone()
                .unwrap_or_else(|| default_worker_id(local)),
            push_address: args
                .advertise
                .clone()
                .unwrap_or_else(|| default_advertise(local, tls.is_some())),
            max_in_flight: args.max_in_flight.unwrap_or(4),
            call_timeout: Duration::from_secs(30),
            max_backoff: Duration::from_secs(10),
            tls: args.client_tls.clone(),
        }),
        _ => None,
    };
    tracing::info!(
        listen = %local,
        %metrics,
        source = %loaded.source,
        device = ?loaded.device,
        dtype = ?loaded.model.dtype(),
        panels = ?loaded.model.panel_dtype(),
        "rollout worker ready"
    );
    let config = WorkerConfig {
        tokenizer: loaded.tokenizer,
        weights: (None, args.initial_version),
        engine: args.engine.config(),
        service: ServiceConfig {
            guard: rookworld_service::auth::Guard::new(token, inspect_token),
            tls,
            max_queued_samples: args.max_queued_samples,
            shared_dir: args.shared_dir.clone(),
            relay: crate::service::RelayConfig {
                tls: args.client_tls.clone(),
                ..Default::default()
            },
            ..ServiceConfig::default()
        },
        pull,
        model_source: loaded.source,
        model_owned: true,
        ..WorkerConfig::new(loaded.model)
    };
    let worker = Worker::start(
        config,
        listener,
        rookworld_service::serve::shutdown_signal(),
    )
    .await?;
    worker.wait().await
}

/// `HOST:PORT`, HOST the OS host name.
fn default_worker_id(local: SocketAddr) -> String {
    format!("{}:{}", os_host_name(), local.port())
}

/// Where the learner pushes weights unless `--advertise` says: the address the service
/// listens on, unless that is a wildcard (0.0.0.0, ::), where the OS host name stands in;
/// `https://` when the port serves TLS.
pub fn default_advertise(local: SocketAddr, tls: bool) -> String {
    let ip = local.ip();
    let host = if ip.is_unspecified() {
        os_host_name()
    } else if ip.is_ipv6() {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{host}:{}", local.port())
}

/// The host name from the OS (`gethostname`), `localhost` if it has none.
fn os_host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_push_address_follows_the_listen_address() {
        let at = |s: &str| default_advertise(s.parse().unwrap(), false);
        assert_eq!(at("127.0.0.1:50053"), "http://127.0.0.1:50053");
        assert_eq!(at("[::1]:7"), "http://[::1]:7");
        assert_eq!(at("10.1.2.3:50053"), "http://10.1.2.3:50053");
        let host = os_host_name();
        assert!(!host.is_empty());
        assert_eq!(at("0.0.0.0:50053"), format!("http://{host}:50053"));
        assert_eq!(at("[::]:50053"), format!("http://{host}:50053"));
        let tls = default_advertise("10.1.2.3:50053".parse().unwrap(), true);
        assert_eq!(tls, "https://10.1.2.3:50053");
    }
}
