//! A run of `learner train` planned once ([`Plan::of`]): the command line's options become
//! typed sections — the model, the data, the schedule, the settings that define the maths
//! (the objective among them), the services and the outputs — with every default
//! resolved, every value checked, the tokens read and the certificates loaded, before
//! anything starts. The run reads the plan; the arguments stop here.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use rookworld_lm::cli::ModelArgs;
use rookworld_lm::device::WeightDtype;
use rookworld_service::tls::{ClientTlsArgs, ServerTls};
use rookworld_train::policy::{MatmulPrecision, StepPath};

use super::config::{ConfigError, TrainArgs};
use super::error::TrainError;
use super::report;
use super::settings::TrainSettings;
use crate::eval::{Item, Suite};
use crate::run_dir::RunDirArgs;
use crate::run_record::Origin;

/// A run of `learner train`, as its command line asked for it.
pub struct Plan {
    pub model: ModelPlan,
    pub data: DataPlan,
    pub schedule: SchedulePlan,
    /// The settings that define the run's maths — the objective, the batch, the sampling,
    /// the optimizer, the steps — kept in every checkpoint and checked on resume.
    pub settings: TrainSettings,
    pub services: ServicesPlan,
    pub outputs: OutputsPlan,
}

/// The starting weights and how the learner computes with them.
#[derive(Debug)]
pub struct ModelPlan {
    /// A checkpoint directory or a seeded preset, and the device.
    pub start: ModelArgs,
    pub matmul_precision: MatmulPrecision,
    pub step_path: StepPath,
}

/// What the run trains and is evaluated on.
#[derive(Debug)]
pub struct DataPlan {
    /// `--prompts`; `None`: prompts generated from the settings' seed.
    pub prompts: Option<PathBuf>,
    /// The supervised warm-up's UCI engine (`--engine`; `None`: stockfish if installed).
    pub engine: Option<PathBuf>,
    /// The evaluation suites with their items (empty without `--eval-every`).
    pub eval_suites: Vec<(Suite, Vec<Item>)>,
}

/// When the run does what it does besides stepping, and how long it waits.
#[derive(Debug, Clone, Copy)]
pub struct SchedulePlan {
    pub checkpoint_every: u64,
    pub push_every: u64,
    /// 0: never.
    pub eval_every: u64,
    /// How long the groups in flight are waited for on shutdown.
    pub drain: Duration,
    /// How long without a step before the run stops (zero: never).
    pub stall: Duration,
}

impl SchedulePlan {
    /// Whether the weights after `step` are evaluated (`last`: the run's final step).
    pub fn eval_due(&self, step: u64, last: bool) -> bool {
        self.eval_every > 0 && (last || step.is_multiple_of(self.eval_every))
    }
}

/// What the run serves and calls, and with which credentials.
pub struct ServicesPlan {
    /// A reward server and a rollout worker in this process (`--local`).
    pub local: bool,
    /// The token every call carries; with `--local` and none configured, a fresh random
    /// one.
    pub token: String,
    /// The token of the inspection calls, when it differs.
    pub inspect_token: Option<String>,
    /// The queue port's TLS (with `--local`, the local services' too).
    pub tls: Option<Arc<ServerTls>>,
    /// TLS towards the reward server and `--local`'s services.
    pub client_tls: ClientTlsArgs,
    /// TLS of the pushes: the client TLS, checked against `--push-tls-name` when given.
    pub push_tls: ClientTlsArgs,
    /// The deadline of one push to one worker.
    pub push_timeout: Duration,
    /// When a push sends a delta.
    pub push_deltas: crate::push::DeltaPolicy,
    /// Children per sender of a relayed push (0: none relay).
    pub push_fanout: u32,
    /// The reward server the learner waits for at start, and how long (not with
    /// `--local`, which starts its own).
    pub reward: Option<(String, Duration)>,
    /// `--shared-dir`, as given (with `--local` a directory of the process by default).
    pub shared_dir: Option<PathBuf>,
    /// `--no-shared-dir`: every push streams, `--local`'s worker's too.
    pub no_shared_dir: bool,
    /// `--local`'s worker's weight dtype.
    pub rollout_weight_dtype: WeightDtype,
    /// `--local`'s worker's swap policy.
    pub rollout_swap_policy: rookworld_generation::SwapPolicy,
}

/// Where the run writes.
#[derive(Debug)]
pub struct OutputsPlan {
    pub run_dir: PathBuf,
    /// What the run does with the checkpoints already there.
    pub start: RunDirArgs,
    pub log_jsonl: Option<PathBuf>,
    pub rollout_dump: Option<PathBuf>,
    pub tensorboard: Option<PathBuf>,
    /// A progress bar on a terminal (else plain lines).
    pub progress: bool,
    /// Every option's resolved value, for `RUN/config.toml` (`None`: not from a command
    /// line).
    pub record: Option<toml::Table>,
    /// `--peak-tflops` in FLOP/s, for MFU (`None`: the device's estimate).
    pub peak_flops: Option<f64>,
}

impl Plan {
    /// Plans the run `args` ask for: one clear line on the first bad value, before any
    /// work (the reward server's reachability, which takes a wait, is checked at start).
    pub fn of(args: &TrainArgs) -> Result<Self, TrainError> {
        args.validate()?;
        for (flag, path) in [
            ("--log-jsonl", &args.log_jsonl),
            ("--rollout-dump", &args.rollout_dump),
        ] {
            if let Some(path) = path {
                report::writable(path, flag)?;
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
        let reward = args.reward.clone().filter(|_| !args.local).map(|url| {
            let wait = Duration::from_secs_f64(args.reward_wait.unwrap_or(30.0).max(0.0));
            (url, wait)
        });
        Ok(Self {
            model: ModelPlan {
                start: args.model_args(),
                matmul_precision: args.matmul_precision,
                step_path: args.step_path,
            },
            data: DataPlan {
                prompts: args.prompts.clone(),
                engine: args.engine.clone(),
                eval_suites,
            },
            schedule: SchedulePlan {
                checkpoint_every: args.checkpoint_every.max(1),
                push_every: args.push_every.max(1),
                eval_every: args.eval.eval_every,
                drain: args.drain_timeout(),
                stall: args.stall_timeout(),
            },
            settings: args.settings.clone(),
            services: ServicesPlan {
                local: args.local,
                token,
                inspect_token,
                tls,
                client_tls: args.client_tls.clone(),
                push_tls: ClientTlsArgs {
                    server_name: args.push_tls_name.clone(),
                    ..args.client_tls.clone()
                },
                push_timeout: args.push_timeout(),
                push_deltas: args.push_deltas,
                push_fanout: args.push_fanout,
                reward,
                shared_dir: args.shared_dir.clone(),
                no_shared_dir: args.no_shared_dir,
                rollout_weight_dtype: args.rollout_weight_dtype()?,
                rollout_swap_policy: args
                    .rollout_swap_policy
                    .unwrap_or(rookworld_generation::SwapPolicy::Drain),
            },
            outputs: OutputsPlan {
                run_dir: args.run_dir.clone(),
                start: args.start.clone(),
                log_jsonl: args.log_jsonl.clone(),
                rollout_dump: args.rollout_dump.clone(),
                tensorboard: args.tensorboard_dir(),
                progress: !args.no_progress,
                record: args.record.clone(),
                peak_flops: args.peak_tflops.map(|t| t * 1e12),
            },
        })
    }
}

impl ModelPlan {
    /// How a worker is started to hold the same model: `--model DIR` or `--preset NAME`.
    pub fn flag(&self) -> String {
        match (&self.start.model, &self.start.preset) {
            (Some(dir), _) => format!("--model {}", dir.display()),
            (None, preset) => format!("--preset {}", preset.as_deref().unwrap_or("tiny")),
        }
    }

    /// Where the run's weights came from, for its record, opened on `device`.
    pub fn origin(&self, device: &Device) -> Origin {
        let device = format!("{} ({device:?})", self.start.device);
        Origin::of(
            self.start.model.as_deref(),
            self.start.preset.as_deref().unwrap_or("tiny"),
            self.start.init_seed,
            &device,
        )
    }
}
