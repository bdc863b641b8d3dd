//! The gRPC service: streaming generation and chunked weight updates (both behind the
//! shared token), status (open, or behind the inspection token), health and server
//! reflection (v1 and v1alpha).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use rookworld_lm::{Config, Tokenizer};
use rookworld_proto::rollout::v1 as pb;
use rookworld_proto::rollout::v1::rollout_service_server::{RolloutService, RolloutServiceServer};
use rookworld_proto::v1 as common;
use rookworld_service::auth::Guard;
use rookworld_service::tls::ServerTls;
use tokio::net::TcpListener;
use tokio::sync::{Mutex, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::engine::{Engine, Event, Request as EngineRequest, SwapTicket};
use crate::error::ServiceError;
use crate::metrics;

mod relay;
mod update;

pub use relay::RelayConfig;

/// The version an update staged and answered for before it went into use
/// ([`update`](self::update)).
#[derive(Debug)]
struct Pending {
    version: u64,
    ticket: SwapTicket,
}

/// Settings of the service around the engine.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The shared token Generate and UpdateWeights must carry (none: they are refused),
    /// and the inspection token Status must carry (none: it is open).
    pub guard: Guard,
    /// TLS of the port; `None` serves plaintext.
    pub tls: Option<Arc<ServerTls>>,
    /// Samples queued (not started) across all calls beyond which Generate is refused
    /// with RESOURCE_EXHAUSTED.
    pub max_queued_samples: usize,
    /// Largest gRPC message, bytes (weight chunks are 1 MiB).
    pub max_message_bytes: usize,
    /// Where a learner on this host leaves payloads for the same-host path; `None`
    /// refuses that path (the learner then streams).
    pub shared_dir: Option<std::path::PathBuf>,
    /// How weight pushes are relayed to the workers a push names ([`RelayConfig`]).
    pub relay: RelayConfig,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            guard: Guard::default(),
            tls: None,
            max_queued_samples: 1 << 16,
            max_message_bytes: 16 * 1024 * 1024,
            shared_dir: None,
            relay: RelayConfig::default(),
        }
    }
}

/// `n` completions of each of `prompts` as the wire's sampling parameters ask (`top_p` 0
/// means off; the seed is theirs).
pub(crate) fn request_from_wire(
    prompts: Vec<Vec<u32>>,
    n: usize,
    p: &common::SamplingParams,
) -> EngineRequest {
    EngineRequest {
        prompts,
        n,
        max_new_tokens: p.max_new_tokens as usize,
        sampling: rookworld_lm::sampling::SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
        },
        seed: p.seed,
        ignore_eos: false,
    }
}

/// What the service knows of the model it serves, read from the model itself
/// ([`ServedModel::of`]): each pushed version is built into the same
/// ([`update`](self::update)).
#[derive(Debug, Clone)]
pub(crate) struct ServedModel {
    pub config: Config,
    pub dtype: candle_core::DType,
    /// What a new model's CPU panels hold.
    pub panels: rookworld_lm::cpu_gemm::PanelDtype,
    pub device: candle_core::Device,
    /// The device's kernels (its open's verdict), for each new model.
    pub kernels: rookworld_lm::kernels::Kernels,
    /// Where the model the worker started with came from (`Status`; empty: not known).
    pub source: String,
}

impl ServedModel {
    /// `model`'s, loaded from `source`.
    pub fn of(model: &rookworld_lm::Gpt2, source: &str) -> Self {
        Self {
            config: model.config().clone(),
            dtype: model.dtype(),
            panels: model.panel_dtype(),
            device: model.device().clone(),
            kernels: model.kernels().clone(),
            source: source.to_owned(),
        }
    }
}

/// The buffer the last streamed payload arrived in, and which payload it holds.
#[derive(Debug, Default)]
struct Held {
    bytes: Vec<u8>,
    /// The run and version whose verified payload `bytes` is, while it is the one in use
    /// (a delta's base); `None` once it is only memory.
    of: Option<(String, u64)>,
    /// Its BLAKE3 hash, while `of` is set.
    blake3: [u8; 32],
}

impl Held {
    /// Whether this is the payload of version `version` of `run`, `len` bytes long.
    fn is(&self, run: &str, version: u64, len: u64) -> bool {
        self.bytes.len() as u64 == len
            && self
                .of
                .as_ref()
                .is_some_and(|(r, v)| r == run && *v == version)
    }
}

/// The `RolloutService` implementation.
#[derive(Debug)]
pub(crate) struct RolloutServer {
    engine: Arc<Engine>,
    tokenizer: Tokenizer,
    /// The served model's shape, dtype, CPU panels and device: what each push is built
    /// into.
    model: ServedModel,
    cfg: ServiceConfig,
    guard: Guard,
    /// One weight update at a time, and the version the last one staged while it waits
    /// to go into use (an update answered once staged: `answer_when_staged`).
    updating: Mutex<Option<Pending>>,
    /// The model the last update retired: the memory of the next version
    /// ([`update`](self::update)).
    spare: std::sync::Mutex<Option<rookworld_lm::Gpt2>>,
    /// The buffer the last streamed payload arrived in (the next one's), and the base of
    /// the next delta while it holds the payload in use.
    received: std::sync::Mutex<Held>,
    /// The run and version the worker started with, while that model may share its
    /// tensors with the worker's caller (its memory is then never written over); `None`:
    /// the worker owns it.
    initial: Option<(String, u64)>,
}

impl RolloutServer {
    pub fn new(
        engine: Arc<Engine>,
        tokenizer: Tokenizer,
        model: ServedModel,
        cfg: ServiceConfig,
    ) -> Self {
        Self {
            tokenizer,
            model,
            guard: cfg.guard.clone(),
            cfg,
            updating: Mutex::new(None),
            spare: std::sync::Mutex::new(None),
            received: std::sync::Mutex::new(Held::default()),
            initial: {
                let status = engine.status();
                Some((status.weight_run, status.weight_version))
            },
            engine,
        }
    }

    /// The model the worker started with is its own (nothing else holds its tensors): the
    /// first version that retires it is built into its memory like any other.
    pub fn owning_its_first_model(mut self) -> Self {
        self.initial = None;
        self
    }

    /// The request's prompts as token ids.
    fn prompt_ids(&self, prompts: Vec<pb::Prompt>) -> Result<Vec<Vec<u32>>, ServiceError> {
        prompts
            .into_iter()
            .enumerate()
            .map(|(i, p)| match (p.text.is_empty(), p.ids.is_empty()) {
                (false, true) => self
                    .tokenizer
                    .encode_prompt(self.model.config.bos_token_id, &p.text)
                    .map_err(|e| ServiceError::InvalidArgument(format!("prompt {i}: {e}"))),
                (true, false) => Ok(p.ids),
                _ => Err(ServiceError::InvalidArgument(format!(
                    "prompt {i}: set exactly one of `text` and `ids`"
                ))),
            })
            .collect()
    }

    fn engine_request(&self, r: pb::GenerateRequest) -> Result<EngineRequest, ServiceError> {
        let sampling = r.sampling.unwrap_or_default();
        let n = r.num_completions as usize;
        let queued = self.engine.status().pending_samples;
        let asked = r.prompts.len().saturating_mul(n);
        if queued + asked > self.cfg.max_queued_samples {
            return Err(ServiceError::Overloaded(format!(
                "{queued} samples queued; {asked} more would exceed the limit of {}",
                self.cfg.max_queued_samples
            )));
        }
        Ok(request_from_wire(self.prompt_ids(r.prompts)?, n, &sampling))
    }

    /// Refuses a work or control call whose `authorization` is not `Bearer <token>`.
    fn authorize<T>(&self, request: &Request<T>) -> Result<(), ServiceError> {
        self.guard
            .work(request.metadata())
            .map_err(ServiceError::Token)
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RolloutService for RolloutServer {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<GenerateStream>, Status> {
        self.authorize(&request)?;
        let request = self.engine_request(request.into_inner())?;
        let mut prompt_ids: Vec<Option<Vec<u32>>> =
            request.prompts.iter().cloned().map(Some).collect();
        let mut events = self
            .engine
            .submit(request)
            .await
            .map_err(ServiceError::from)?;
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            // Ends when the request is done or failed, or when the caller goes away (the
            // send fails): dropping `events` then cancels the rest of its work.
            while let Some(event) = events.next().await {
                let item = match event {
                    Event::Sample(s) => Ok(pb::GenerateResponse {
                        prompt_index: s.prompt_index,
                        sample_index: s.sample_index,
                        prompt_ids: prompt_ids
                            .get_mut(s.prompt_index as usize)
                            .and_then(Option::take)
                            .unwrap_or_default(),
                        completion: Some(common::Completion {
                            text: String::new(),
                            finish_reason: match s.completion.finish_reason {
                                rookworld_lm::generate::FinishReason::Eos => {
                                    common::FinishReason::Eos
                                }
                                rookworld_lm::generate::FinishReason::Length => {
                                    common::FinishReason::Length
                                }
                            } as i32,
                            ids: s.completion.ids,
                            logprobs: s.completion.logprobs,
                            weight_version: s.weight_version,
                            token_versions: s.token_versions,
                        }),
                    }),
                    Event::Done(_) => break,
                    Event::Failed(_, why) => Err(Status::internal(why)),
                };
                let last = item.is_err();
                if tx.send(item).await.is_err() || last {
                    break;
                }
            }
        });
        let tokenizer = self.tokenizer.clone();
        let stream = ReceiverStream::new(rx).map(move |item| {
            item.map(|mut r| {
                if let Some(c) = r.completion.as_mut() {
                    c.text = decode_text(&tokenizer, &c.ids);
                }
                r
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn update_weights(
        &self,
        request: Request<Streaming<pb::WeightChunk>>,
    ) -> Result<Response<pb::UpdateWeightsResponse>, Status> {
        let started = Instant::now();
        let result = match self.authorize(&request) {
            Ok(()) => self.receive_weights(request.into_inner()).await,
            Err(e) => Err(e),
        };
        let (label, bytes) = match &result {
            Ok(r) => ("ok", r.bytes as usize),
            Err(e) => (e.label(), 0),
        };
        metrics::record_weight_update(label, bytes, started.elapsed().as_secs_f64());
        match &result {
            // A delta without its base here: ordinary (a worker that just started, or
            // took the last version from the shared file); the payload follows.
            Err(e) if e.label() == "delta_base" => {
                tracing::info!(error = %e, "weight delta not applied; the old weights stay and the sender streams the payload")
            }
            Err(e) => tracing::warn!(error = %e, "weight update refused; the old weights stay"),
            Ok(_) => {}
        }
        Ok(Response::new(result?))
    }

    async fn send_weights(
        &self,
        request: Request<pb::SendWeightsRequest>,
    ) -> Result<Response<pb::UpdateWeightsResponse>, Status> {
        self.authorize(&request)?;
        let result = self.send_held(request.into_inner()).await;
        if let Err(e) = &result {
            tracing::info!(error = %e, "weights not sent to joining workers; the sender serves them another way");
        }
        Ok(Response::new(result?))
    }

    async fn status(
        &self,
        request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        self.guard
            .inspect(request.metadata())
            .map_err(ServiceError::Token)?;
        let s = self.engine.status();
        let c = &self.model.config;
        let (used, total) = metrics::gpu_memory(&self.model.device)
            .map_or((0, 0), |(free, total)| (total - free, total));
        Ok(Response::new(pb::StatusResponse {
            weight_version: s.weight_version,
            device: s.device,
            dtype: s.dtype,
            live_sequences: s.live_rows as u32,
            max_sequences: s.max_seqs as u32,
            row_limit: s.row_limit as u32,
            pending_requests: s.pending_requests as u32,
            pending_samples: s.pending_samples as u64,
            kv_tokens_reserved: s.reserved_kv_tokens as u64,
            max_kv_tokens: s.max_kv_tokens as u64,
            tokens_generated: s.tokens_generated,
            tokens_per_second: s.tokens_per_second,
            swap_pending: s.swap_pending,
            model: c.shape(),
            model_source: self.model.source.clone(),
            gpu_memory_used_bytes: used as u64,
            gpu_memory_total_bytes: total as u64,
            weight_run_id: s.weight_run,
        }))
    }
}

/// Completion text without end-of-text; undecodable ids give an empty text, never an error.
fn decode_text(tokenizer: &Tokenizer, ids: &[u32]) -> String {
    tokenizer.decode(ids).unwrap_or_default()
}

/// Serves the rollout service, health and reflection on `listener` until `shutdown`
/// completes; calls in flight finish first.
pub(crate) async fn run(
    server: RolloutServer,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let (max, tls) = (server.cfg.max_message_bytes, server.cfg.tls.clone());
    let service = RolloutServiceServer::new(server)
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    rookworld_service::serve::serve(service, listener, tls, shutdown).await
}
