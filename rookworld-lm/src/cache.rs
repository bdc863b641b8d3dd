//! The KV cache, kept outside the model's weights.
//!
//! One [`KvCache`] holds the keys and values of B sequences (rows) for every layer, each
//! (B, H, S, D) with S the tokens seen so far (letters as in `model.rs`).

use candle_core::{Result, Tensor};

/// Keys and values of one layer: `None` until the first forward.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    kv: Option<(Tensor, Tensor)>, // (B, H, S, D) each
}

impl LayerCache {
    /// Appends this step's keys and values (B, H, T, D) and returns all of them
    /// (B, H, S, D), S = past + T.
    pub(crate) fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = match self.kv.take() {
            None => (k.clone(), v.clone()),
            Some((pk, pv)) => (Tensor::cat(&[&pk, k], 2)?, Tensor::cat(&[&pv, v], 2)?),
        };
        self.kv = Some((k.clone(), v.clone()));
        Ok((k, v))
    }

    fn map(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let kv = match &self.kv {
            None => None,
            Some((k, v)) => Some((f(k)?, f(v)?)),
        };
        Ok(Self { kv })
    }
}

/// Per-layer KV caches of a batch of sequences.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache for a model of `n_layer` layers.
    pub fn new(n_layer: usize) -> Self {
        Self {
            layers: vec![LayerCache::default(); n_layer],
        }
    }

    /// Tokens cached per row (S); 0 when empty.
    pub fn seq_len(&self) -> usize {
        self.dim(2)
    }

    /// Rows cached (B); 0 when empty.
    pub fn batch_size(&self) -> usize {
        self.dim(0)
    }

    fn dim(&self, d: usize) -> usize {
        self.layers
            .first()
            .and_then(|l| l.kv.as_ref())
            .map_or(0, |(k, _)| k.dims()[d])
    }

    pub(crate) fn layers_mut(&mut self) -> impl Iterator<Item = &mut LayerCache> {
        self.layers.iter_mut()
    }

    /// Repeats every row `n` times, row-major: a prompt prefilled once (B = 1) becomes
    /// the shared starting point of its `n` samples (B = n).
    pub fn repeat_rows(&self, n: usize) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| l.map(|t| t.repeat((n, 1, 1, 1))))
            .collect::<Result<_>>()?;
        Ok(Self { layers })
    }

    /// Keeps only the given rows, in the given order (drops finished sequences).
    pub fn select_rows(&self, rows: &Tensor) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| l.map(|t| t.index_select(rows, 0)))
            .collect::<Result<_>>()?;
        Ok(Self { layers })
    }
}
