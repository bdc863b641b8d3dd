//! Weight push: the learner's new version, converted to BF16 once, sent to every registered
//! worker in parallel, each with its own deadline, so a slow or dead worker never blocks the
//! others or the learner. A worker that fails is marked stale and re-synced at the next push.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rollout_worker::weights::{self, CHUNK_BYTES, WeightSet};
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use tonic::transport::Endpoint;

/// What happened to one worker in one push.
#[derive(Debug, Clone, PartialEq)]
pub struct PushOutcome {
    pub worker: String,
    pub version: u64,
    pub seconds: f64,
    pub bytes: u64,
    /// `None` when the worker now runs `version`.
    pub error: Option<String>,
}

/// Workers the learner pushes to, and the version each is known to run.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Worker address (e.g. `http://10.0.0.3:50053`) → version known to be in use there
    /// (`None`: unknown or stale, re-synced at the next push).
    workers: BTreeMap<String, Option<u64>>,
}

impl Fleet {
    /// Adds a worker (idempotent); it is stale until a push reaches it.
    pub fn register(&mut self, address: &str) {
        self.workers.entry(address.to_owned()).or_insert(None);
    }

    /// Records that `address` runs `version` (e.g. it started with those weights).
    pub fn mark(&mut self, address: &str, version: u64) {
        self.workers.insert(address.to_owned(), Some(version));
    }

    /// Workers not known to run `version`.
    pub fn stale(&self, version: u64) -> Vec<String> {
        self.workers
            .iter()
            .filter(|(_, v)| **v != Some(version))
            .map(|(a, _)| a.clone())
            .collect()
    }

    /// Pushes `set` to every worker not yet on its version, all at once, each call bounded
    /// by `deadline`; records who succeeded. Returns one outcome per worker tried.
    pub async fn push(
        &mut self,
        set: &WeightSet,
        token: &str,
        deadline: Duration,
    ) -> Vec<PushOutcome> {
        let targets = self.stale(set.version);
        let calls = targets.into_iter().map(|address| {
            let set = set.clone();
            let token = token.to_owned();
            async move {
                let started = Instant::now();
                let result =
                    tokio::time::timeout(deadline, push_one(&address, &set, &token, deadline))
                        .await;
                let error = match result {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e),
                    Err(_) => Some(format!("no answer within {deadline:?}")),
                };
                PushOutcome {
                    worker: address,
                    version: set.version,
                    seconds: started.elapsed().as_secs_f64(),
                    bytes: if error.is_none() {
                        set.bytes.len() as u64
                    } else {
                        0
                    },
                    error,
                }
            }
        });
        let outcomes = futures_join_all(calls).await;
        for o in &outcomes {
            let known = self.workers.entry(o.worker.clone()).or_insert(None);
            *known = if o.error.is_none() {
                Some(o.version)
            } else {
                None
            };
            metrics::histogram!("learner_weight_push_seconds", "worker" => o.worker.clone())
                .record(o.seconds);
            metrics::counter!("learner_weight_push_bytes_total", "worker" => o.worker.clone())
                .increment(o.bytes);
            let result = if o.error.is_none() { "ok" } else { "failed" };
            metrics::counter!("learner_weight_pushes_total", "worker" => o.worker.clone(), "result" => result).increment(1);
            match &o.error {
                None => {
                    tracing::info!(worker = %o.worker, version = o.version, seconds = o.seconds, "weights pushed")
                }
                Some(e) => {
                    tracing::warn!(worker = %o.worker, version = o.version, error = %e, "weight push failed; worker marked stale")
                }
            }
        }
        outcomes
    }
}

async fn push_one(
    address: &str,
    set: &WeightSet,
    token: &str,
    deadline: Duration,
) -> Result<(), String> {
    let channel = Endpoint::from_shared(address.to_owned())
        .map_err(|e| format!("bad address {address}: {e}"))?
        .connect_timeout(deadline)
        .timeout(deadline)
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut client = RolloutServiceClient::new(channel);
    let answer = weights::push(&mut client, set, token, CHUNK_BYTES)
        .await
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?;
    if answer.version != set.version {
        return Err(format!(
            "worker reports version {} after the push",
            answer.version
        ));
    }
    Ok(())
}

/// Runs every future concurrently and collects their outputs in order.
async fn futures_join_all<F>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.expect("push task panicked"));
    }
    out
}
