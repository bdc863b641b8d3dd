//! The KV cache, kept outside the model's weights.
//!
//! One [`KvCache`] holds the keys and values of B sequences (rows) for every layer, each
//! (B, H, S, D) with S the tokens seen so far (letters as in `model.rs`).
//!
//! Inference writes each step's keys and values in place into a preallocated buffer
//! (B, H, capacity, D) whose capacity doubles when full, so a decode step copies only
//! its own new entries. In-place writes cannot be differentiated, so when the keys carry
//! gradients (a training forward) the cache concatenates instead.

use candle_core::{Result, Tensor};

/// Smallest buffer allocated, in tokens.
const MIN_CAPACITY: usize = 64;

/// Keys and values of one layer, valid up to `len` along dimension 2.
#[derive(Debug)]
struct Kv {
    k: Tensor, // (B, H, capacity, D)
    v: Tensor, // (B, H, capacity, D)
    len: usize,
}

/// One layer's cache: `None` until the first forward.
#[derive(Debug, Default)]
pub struct LayerCache {
    kv: Option<Kv>,
}

impl LayerCache {
    /// Appends this step's keys and values (B, H, T, D) and returns all of them
    /// (B, H, S, D), S = past + T.
    pub(crate) fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        if k.track_op() || v.track_op() {
            return self.append_differentiable(k, v);
        }
        let (t, len) = (k.dim(2)?, self.kv.as_ref().map_or(0, |kv| kv.len));
        let needed = len + t;
        let capacity = self.kv.as_ref().map_or(0, |kv| kv.k.dim(2).unwrap_or(0));
        if needed > capacity {
            let (b, h, _, d) = k.dims4()?;
            let capacity = needed.next_power_of_two().max(MIN_CAPACITY);
            let grown_k = Tensor::zeros((b, h, capacity, d), k.dtype(), k.device())?;
            let grown_v = Tensor::zeros((b, h, capacity, d), v.dtype(), v.device())?;
            if let Some(old) = &self.kv {
                grown_k.slice_set(&old.k.narrow(2, 0, old.len)?.contiguous()?, 2, 0)?;
                grown_v.slice_set(&old.v.narrow(2, 0, old.len)?.contiguous()?, 2, 0)?;
            }
            self.kv = Some(Kv {
                k: grown_k,
                v: grown_v,
                len,
            });
        }
        let kv = self.kv.as_mut().expect("allocated above");
        kv.k.slice_set(&k.contiguous()?, 2, len)?;
        kv.v.slice_set(&v.contiguous()?, 2, len)?;
        kv.len = needed;
        Ok((kv.k.narrow(2, 0, needed)?, kv.v.narrow(2, 0, needed)?))
    }

    fn append_differentiable(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = match self.kv.take() {
            None => (k.clone(), v.clone()),
            Some(old) => (
                Tensor::cat(&[&old.k.narrow(2, 0, old.len)?, k], 2)?,
                Tensor::cat(&[&old.v.narrow(2, 0, old.len)?, v], 2)?,
            ),
        };
        let len = k.dim(2)?;
        self.kv = Some(Kv {
            k: k.clone(),
            v: v.clone(),
            len,
        });
        Ok((k, v))
    }

    /// A new cache with `f` applied to the row dimension of both buffers (copies).
    fn map_rows(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let kv = match &self.kv {
            None => None,
            Some(kv) => Some(Kv {
                k: f(&kv.k)?.contiguous()?,
                v: f(&kv.v)?.contiguous()?,
                len: kv.len,
            }),
        };
        Ok(Self { kv })
    }
}

/// Per-layer KV caches of a batch of sequences. Not `Clone`: its buffers are written in
/// place, so a copy must be explicit ([`KvCache::repeat_rows`], [`KvCache::select_rows`]).
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache for a model of `n_layer` layers.
    pub fn new(n_layer: usize) -> Self {
        Self {
            layers: (0..n_layer).map(|_| LayerCache::default()).collect(),
        }
    }

    /// Tokens cached per row (S); 0 when empty.
    pub fn seq_len(&self) -> usize {
        self.first().map_or(0, |kv| kv.len)
    }

    /// Rows cached (B); 0 when empty.
    pub fn batch_size(&self) -> usize {
        self.first().map_or(0, |kv| kv.k.dims()[0])
    }

    fn first(&self) -> Option<&Kv> {
        self.layers.first().and_then(|l| l.kv.as_ref())
    }

    /// Layer `i`'s keys and values (B, H, S, D); `None` before the first forward.
    pub(crate) fn layer_kv(&self, i: usize) -> Option<(Tensor, Tensor)> {
        let kv = self.layers.get(i)?.kv.as_ref()?;
        Some((
            kv.k.narrow(2, 0, kv.len).ok()?,
            kv.v.narrow(2, 0, kv.len).ok()?,
        ))
    }

    pub(crate) fn layers_mut(&mut self) -> impl Iterator<Item = &mut LayerCache> {
        self.layers.iter_mut()
    }

    /// Repeats every row `n` times in place (rows `b0 b0 … b1 b1 …`, not the whole batch
    /// tiled): prompts prefilled once become the shared starting point of their `n`
    /// samples, sample j of row b landing at row `b·n + j`.
    pub fn repeat_rows(&self, n: usize) -> Result<Self> {
        let Some(first) = self.first() else {
            return Ok(Self::new(self.layers.len()));
        };
        let rows: Vec<u32> = (0..first.k.dim(0)? as u32)
            .flat_map(|b| std::iter::repeat_n(b, n))
            .collect();
        self.select_rows(&Tensor::new(rows.as_slice(), first.k.device())?)
    }

    /// Keeps only the given rows, in the given order (drops finished sequences).
    pub fn select_rows(&self, rows: &Tensor) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| l.map_rows(|t| t.index_select(rows, 0)))
            .collect::<Result<_>>()?;
        Ok(Self { layers })
    }
}
