//! Options of `learner train`: the ones that only say where and how a run runs, beside
//! the settings that define it ([`TrainSettings`], in `settings.rs`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use rookworld_lm::cli::ModelArgs;

use super::settings::TrainSettings;

/// Options of `learner train`.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// Starting weights: a Hugging Face checkpoint directory, or a Hub repository id
    /// (`jrahn/RookWorld-LM-124M[@revision]`, through the Hugging Face cache) (default:
    /// --preset).
    #[arg(long, env = "ROOKWORLD_MODEL", conflicts_with = "preset")]
    pub model: Option<PathBuf>,
    /// Seeded random weights of a preset: tiny, gpt2-124m.
    #[arg(long, env = "ROOKWORLD_PRESET", default_value = "tiny")]
    pub preset: String,
    /// Seed of the preset's random weights.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "ROOKWORLD_INIT_SEED",
        default_value_t = 0
    )]
    pub init_seed: u64,
    /// Where the learner trains: cpu, cuda, cuda:N, auto.
    #[arg(long, env = "ROOKWORLD_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Run directory: checkpoints in RUN/checkpoints, the frozen reference in RUN/reference.
    #[arg(long, env = "LEARNER_RUN_DIR", default_value = "runs/local")]
    pub run_dir: PathBuf,
    #[command(flatten)]
    pub start: crate::run_dir::RunDirArgs,
    /// Start a reward server and one rollout worker in this process, on loopback (real
    /// gRPC), so that one command trains.
    #[arg(long)]
    pub local: bool,
    /// The precision of the learner's products: auto (BF16 inputs on CUDA and on a CPU
    /// whose AVX512-BF16 dot products outrun its f32 FMAs, else f32), f32 or bf16 (on the
    /// CPU the fused pass's BF16 products); weights, moments and statistics stay f32.
    #[arg(long, env = "ROOKWORLD_MATMUL_PRECISION", default_value = "auto")]
    pub matmul_precision: rookworld_train::policy::MatmulPrecision,
    /// Which pass computes the gradients: auto (the fused pass on the CPU; candle's
    /// autograd on CUDA), fused (on CUDA the CUDA backend, BF16 products: off by default
    /// until a GPU run has passed `learner compare-backends`) or autograd (every device).
    #[arg(long, value_parser = crate::settings::choice::<rookworld_train::policy::StepPath>(), env = "LEARNER_STEP_PATH", default_value = "auto")]
    pub step_path: rookworld_train::policy::StepPath,
    /// With --local: the local rollout worker's --weight-dtype (auto, f32, bf16, f16, or
    /// int8 on the CPU: see `rollout-worker serve --weight-dtype`); a separate worker
    /// takes its own `--weight-dtype`.
    /// (Default with --local: auto.)
    #[arg(
        long,
        env = "LEARNER_ROLLOUT_WEIGHT_DTYPE",
        default_value_if("local", "true", "auto")
    )]
    pub rollout_weight_dtype: Option<String>,
    /// With --local: what the local rollout worker does with the sequences in flight when
    /// new weights arrive (see `rollout-worker serve --swap-policy`); a separate worker
    /// takes its own `--swap-policy`. (Default with --local: drain.)
    #[arg(
        long,
        value_enum,
        env = "LEARNER_ROLLOUT_SWAP_POLICY",
        default_value_if("local", "true", "drain")
    )]
    pub rollout_swap_policy: Option<rookworld_generation::SwapPolicy>,
    /// The old names of --matmul-precision and --rollout-weight-dtype, refused with a line
    /// naming the new ones.
    #[command(flatten)]
    pub legacy_precision: rookworld_lm::cli::LegacyPrecision,
    #[arg(
        long = "rollout-precision",
        env = "LEARNER_ROLLOUT_PRECISION",
        hide = true
    )]
    pub legacy_rollout_precision: Option<String>,
    /// Reward server the workers use; when given, the learner waits for it to answer at
    /// start (up to --reward-wait seconds) and fails with one line otherwise (not with
    /// --local, which starts its own).
    #[arg(long, env = "LEARNER_REWARD", conflicts_with = "local")]
    pub reward: Option<String>,
    /// Seconds to wait for --reward to answer at start (default with --reward: 30).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_REWARD_WAIT",
        default_value_if("reward", clap::builder::ArgPredicate::IsPresent, "30"),
        conflicts_with = "local"
    )]
    pub reward_wait: Option<f64>,
    /// Address of the rollout queue (workers lease from it; inspection calls too). Default
    /// 127.0.0.1:50051; with --local a free port (both logged at start).
    #[arg(long, env = "LEARNER_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Prometheus `/metrics` endpoint ("off" for none). Default 127.0.0.1:9091; with
    /// --local a free port.
    #[arg(long, env = "LEARNER_METRICS")]
    pub metrics: Option<String>,
    #[command(flatten)]
    pub token: rookworld_service::auth::TokenArgs,
    /// TLS of the queue port (with --local, of the local services' ports too).
    #[command(flatten)]
    pub tls: rookworld_service::tls::ServerTlsArgs,
    /// TLS towards `https://` workers (pushes) and the reward server.
    #[command(flatten)]
    pub client_tls: rookworld_service::tls::ClientTlsArgs,
    /// Check every worker's certificate against this name instead of the host of its push
    /// address: for workers that advertise IP addresses or container names and share one
    /// certificate (compose replicas, Kubernetes pods).
    #[arg(long, env = "LEARNER_PUSH_TLS_NAME")]
    pub push_tls_name: Option<String>,
    #[command(flatten)]
    pub settings: TrainSettings,
    #[command(flatten)]
    pub eval: crate::eval::periodic::PeriodicArgs,
    /// Training prompts from RookWorld text lines or JSONL (default: generated).
    #[arg(long, env = "LEARNER_PROMPTS")]
    pub prompts: Option<PathBuf>,
    /// Push weights to the workers every this many steps.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_PUSH_EVERY",
        default_value_t = 1
    )]
    pub push_every: u64,
    /// The same-host weight path: each published payload is also written here once, and
    /// workers on this host that share the directory (`rollout-worker serve --shared-dir`)
    /// read it instead of receiving the stream; others are streamed. With --local the
    /// default is a directory under /dev/shm.
    #[arg(long, env = "LEARNER_SHARED_DIR")]
    pub shared_dir: Option<PathBuf>,
    /// No same-host weight path: every worker is streamed its weights, `--local`'s too
    /// (as a worker on another host would be: the network path, deltas included, on one
    /// machine).
    #[arg(long, env = "LEARNER_NO_SHARED_DIR", conflicts_with = "shared_dir")]
    pub no_shared_dir: bool,
    /// When a weight push sends only what changed since the worker's version: `auto`
    /// where that arrives sooner than the whole payload over the worker's link as its
    /// pushes measured it, `always` to every worker that holds the version before,
    /// `never`.
    #[arg(long, value_enum, env = "LEARNER_PUSH_DELTAS", default_value = "auto")]
    pub push_deltas: crate::push::DeltaPolicy,
    /// Streamed workers relay weight pushes: the learner streams each version to this
    /// many of them, and each forwards the chunks to as many others while it receives
    /// them, so the learner's egress per version does not grow with the workers. 0: the
    /// learner streams to every worker itself.
    #[arg(long, env = "LEARNER_PUSH_FANOUT", default_value_t = 2)]
    pub push_fanout: u32,
    /// Deadline of one weight push to one worker, in seconds.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_PUSH_TIMEOUT",
        default_value_t = 60.0
    )]
    pub push_timeout: f64,
    /// Checkpoint every this many steps (and at the end or on shutdown).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_CHECKPOINT_EVERY",
        default_value_t = 25
    )]
    pub checkpoint_every: u64,
    /// On Ctrl-C/SIGTERM, wait this long (seconds) for leased groups to come in (prompts
    /// still out are kept in the checkpoint and leased again on resume).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_DRAIN_TIMEOUT",
        default_value_t = 5.0
    )]
    pub drain_timeout: f64,
    /// Append one JSON object per step to this file.
    #[arg(long, env = "LEARNER_LOG_JSONL")]
    pub log_jsonl: Option<PathBuf>,
    /// Write TensorBoard event files (`train/…` per step, `eval/<suite>/<metric>` per
    /// evaluation) to this directory, for `tensorboard --logdir DIR`; "off" for none.
    /// Default: RUN/tensorboard with --local, none otherwise.
    #[arg(long, env = "LEARNER_TENSORBOARD")]
    pub tensorboard: Option<PathBuf>,
    /// Append every consumed scored group (JSONL) to this file, for replay.
    #[arg(long, env = "LEARNER_ROLLOUT_DUMP")]
    pub rollout_dump: Option<PathBuf>,
    /// Peak of the training device in TFLOP/s, for MFU (default: an estimate).
    #[arg(long, allow_negative_numbers = true, env = "LEARNER_PEAK_TFLOPS")]
    pub peak_tflops: Option<f64>,
    /// UCI engine for the supervised warm-up's policy lines (default: stockfish if installed).
    #[arg(long, env = "LEARNER_ENGINE")]
    pub engine: Option<PathBuf>,
    /// Seconds without a step (waiting for groups) before the run stops with an error
    /// that says why (0: never); from half of it on, one ERROR line a minute explains.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_STALL_TIMEOUT",
        default_value_t = 300.0
    )]
    pub stall_timeout: f64,
    /// Plain log lines even on a terminal (no progress bar).
    #[arg(long, env = "LEARNER_NO_PROGRESS")]
    pub no_progress: bool,
    /// Every option's resolved value (flags, environment, run file, defaults), recorded in
    /// `RUN/config.toml`; set by the command line, `None` for callers of the library.
    #[arg(skip)]
    pub record: Option<toml::Table>,
    /// Which CUDA kernels the devices run: the binary's kernel flags, parsed once.
    #[arg(skip)]
    pub kernels: rookworld_lm::kernels::KernelChoice,
}

pub use crate::settings::ConfigError;

impl TrainArgs {
    /// The starting weights as the shared model options.
    pub fn model_args(&self) -> ModelArgs {
        ModelArgs {
            model: self.model.clone(),
            preset: self.model.is_none().then(|| self.preset.clone()),
            init_seed: self.init_seed,
            device: self.device.clone(),
            weight_dtype: "f32".into(),
            legacy_precision: Default::default(),
            kernels: self.kernels.clone(),
        }
    }

    /// `--rollout-weight-dtype`, parsed; the old `--precision` and `--rollout-precision`
    /// refused with the keys that replace them.
    pub fn rollout_weight_dtype(&self) -> Result<rookworld_lm::device::WeightDtype, ConfigError> {
        let refused = |e: rookworld_lm::Error| ConfigError::Value(e.to_string());
        self.legacy_precision.refuse().map_err(refused)?;
        if let Some(old) = &self.legacy_rollout_precision {
            let e = rookworld_lm::cli::legacy_precision("--rollout-precision", old);
            return Err(refused(e));
        }
        self.rollout_weight_dtype
            .as_deref()
            .unwrap_or("auto")
            .parse()
            .map_err(|e: rookworld_lm::Error| {
                ConfigError::Value(format!("--rollout-weight-dtype: {e}"))
            })
    }

    /// The settings' ranges and the process's own options (intervals, timeouts, URLs).
    pub fn validate(&self) -> Result<(), ConfigError> {
        use rookworld_service::validate::{at_least, non_negative, positive, url};
        self.settings.validate()?;
        self.rollout_weight_dtype()?;
        // Options the mode ignores are refused (each has a default only in its mode).
        if !self.local && self.rollout_weight_dtype.is_some() {
            return Err(ConfigError::Conflict(
                "--rollout-weight-dtype is the weight dtype of --local's worker; a separate worker takes its own (`rollout-worker serve --weight-dtype`)".into(),
            ));
        }
        if !self.local && self.rollout_swap_policy.is_some() {
            return Err(ConfigError::Conflict(
                "--rollout-swap-policy is what --local's worker does on a swap; a separate worker takes its own (`rollout-worker serve --swap-policy`)".into(),
            ));
        }
        if self.reward.is_none() && self.reward_wait.is_some() {
            return Err(ConfigError::Conflict(
                "--reward-wait is how long to wait for --reward at start; without --reward there is nothing to wait for".into(),
            ));
        }
        let mut checks = vec![
            at_least("--push-every", self.push_every, 1),
            at_least("--checkpoint-every", self.checkpoint_every, 1),
            positive("--push-timeout", self.push_timeout),
            non_negative("--drain-timeout", self.drain_timeout),
            non_negative("--stall-timeout", self.stall_timeout),
        ];
        if let Some(wait) = self.reward_wait {
            checks.push(non_negative("--reward-wait", wait));
        }
        if let Some(reward) = &self.reward {
            checks.push(url("--reward", reward));
        }
        if let Some(peak) = self.peak_tflops {
            checks.push(positive("--peak-tflops", peak));
        }
        checks.into_iter().collect::<Result<(), _>>()
    }

    pub fn token(&self) -> Result<Option<String>, ConfigError> {
        self.token.resolve().map_err(ConfigError::Unusable)
    }

    /// The queue's address: `--listen`, else the fixed default, or with `--local` a free
    /// port (a second local run on one machine must not collide with the first).
    pub fn listen_addr(&self) -> SocketAddr {
        let default = if self.local {
            "127.0.0.1:0"
        } else {
            "127.0.0.1:50051"
        };
        self.listen
            .unwrap_or_else(|| default.parse().expect("a socket address"))
    }

    /// The directory of the TensorBoard event files: `--tensorboard`, `None` for "off";
    /// by default `RUN/tensorboard` with `--local` and none otherwise.
    pub fn tensorboard_dir(&self) -> Option<PathBuf> {
        match (&self.tensorboard, self.local) {
            (Some(dir), _) if dir.as_os_str() == "off" || dir.as_os_str().is_empty() => None,
            (Some(dir), _) => Some(dir.clone()),
            (None, true) => Some(self.run_dir.join("tensorboard")),
            (None, false) => None,
        }
    }

    /// The metrics address, or `None` for "off" (default as for [`Self::listen_addr`]).
    pub fn metrics_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        let default = if self.local {
            "127.0.0.1:0"
        } else {
            "127.0.0.1:9091"
        };
        match self.metrics.as_deref().unwrap_or(default) {
            "off" | "" => Ok(None),
            a => a
                .parse()
                .map(Some)
                .map_err(|e| ConfigError::Value(format!("--metrics {a}: {e}"))),
        }
    }

    pub fn push_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.push_timeout.max(0.1))
    }

    pub fn stall_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.stall_timeout.max(0.0))
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.drain_timeout.max(0.0))
    }
}
