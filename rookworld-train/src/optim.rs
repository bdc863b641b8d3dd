//! Optimisation: gradient accumulation, the global gradient norm and clipping, AdamW with
//! decoupled weight decay (not on biases and layer norms), and the learning-rate schedule.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result as CandleResult, Shape, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::fused::HostF32;
use rookworld_lm::kernels::Kernels;

mod adamw;
pub use adamw::AdamW;

/// Gradients summed over micro-batches, by parameter name (ordered, so every sum over
/// parameters runs in the same order in every process: resumed runs stay bit-identical).
#[derive(Debug)]
pub struct Gradients {
    by_name: BTreeMap<String, Grad>,
    /// Factor every gradient is taken with (set by [`Gradients::clip`], applied inside the
    /// optimizer's pass instead of rewriting every gradient first).
    scale: f64,
}

/// One parameter's gradient: a tensor (autograd), or a host buffer of the fused pass in
/// the parameter's element order (handed back for the next step by [`Gradients::recycle`]).
#[derive(Debug)]
enum Grad {
    Tensor(Tensor),
    Host(Vec<f32>, Shape),
}

impl Default for Gradients {
    fn default() -> Self {
        Self {
            by_name: BTreeMap::new(),
            scale: 1.0,
        }
    }
}

impl Gradients {
    /// Adds the gradients of `vars` found in `store`. Each is detached: candle computes
    /// gradients with ops on the weights, so a gradient otherwise carries the forward
    /// graph along — and through the optimizer's moments, every step's graph, forever.
    pub fn accumulate(&mut self, store: &GradStore, vars: &[(String, Var)]) -> CandleResult<()> {
        for (name, var) in vars {
            if let Some(g) = store.get(var.as_tensor()) {
                let g = &g.detach();
                let sum = match self.get(name) {
                    Some(acc) => (acc + g)?,
                    None => g.clone(),
                };
                self.by_name.insert(name.clone(), Grad::Tensor(sum));
            }
        }
        Ok(())
    }

    /// Sets the gradient of `name` to tensor `g` (replacing any).
    pub fn insert_tensor(&mut self, name: String, g: Tensor) {
        self.by_name.insert(name, Grad::Tensor(g));
    }

    /// Sets the gradient of `name` to a host buffer of `shape` (replacing any).
    pub fn insert_host(&mut self, name: String, g: Vec<f32>, shape: Shape) {
        self.by_name.insert(name, Grad::Host(g, shape));
    }

    /// The stored gradient of `name`, before [`Gradients::scale`] (a host buffer is
    /// copied into a tensor).
    pub fn get(&self, name: &str) -> Option<Tensor> {
        match self.by_name.get(name)? {
            Grad::Tensor(t) => Some(t.clone()),
            Grad::Host(v, shape) => Tensor::from_slice(v, shape.clone(), &Device::Cpu).ok(),
        }
    }

    /// The factor the stored gradients are to be taken with.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Global L2 norm `sqrt(Σ_p ‖g_p‖²)`, each parameter once (the tied embedding/LM head
    /// is one parameter).
    /// On CUDA with the device's `train_ops` kernels on (`kernels`), the squares of
    /// every gradient there in one launch.
    pub fn global_norm(&self, kernels: &Kernels) -> CandleResult<f64> {
        let mut total = 0f64;
        // On a device each tensor's sum stays there and one read brings their total back
        // (one synchronisation, not one per parameter).
        let mut on_device = Vec::new();
        // On CUDA with the training ops' kernels: every gradient's squares in one launch
        // (f32 sums over fixed chunks, added in f64; `square_sum_many`).
        let many = kernels.enabled(rookworld_lm::kernels::Kernel::TrainOps);
        let mut on_cuda = Vec::new();
        for g in self.by_name.values() {
            match g {
                Grad::Host(v, _) => total += sum_squares(v),
                Grad::Tensor(g) => match HostF32::new(g) {
                    Some(values) => total += sum_squares(values.as_slice()),
                    None if many
                        && g.device().is_cuda()
                        && g.dtype() == DType::F32
                        && g.is_contiguous() =>
                    {
                        on_cuda.push(g)
                    }
                    None => on_device.push(square_sum(g)?),
                },
            }
        }
        if !on_device.is_empty() {
            total += Tensor::stack(&on_device, 0)?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        if !on_cuda.is_empty() {
            total += rookworld_lm::train_ops::adamw::square_sum_many(&on_cuda, kernels)?;
        }
        Ok(total.sqrt() * self.scale)
    }

    /// Scales every gradient so the global norm is at most `max_norm`:
    /// `g ← g · min(1, max_norm / (‖g‖ + 1e-6))`. Returns the norm before clipping.
    pub fn clip(&mut self, max_norm: f64, kernels: &Kernels) -> CandleResult<f64> {
        let norm = self.global_norm(kernels)?;
        self.scale *= (max_norm / (norm + 1e-6)).min(1.0);
        Ok(norm)
    }

    /// The host buffers, in the order of `vars` (empty unless every parameter has one),
    /// for the next step to fill instead of allocating (and faulting in) new ones.
    pub fn recycle(mut self, vars: &[(String, Var)]) -> Vec<Vec<f32>> {
        let mut out = Vec::with_capacity(vars.len());
        for (name, _) in vars {
            match self.by_name.remove(name) {
                Some(Grad::Host(v, _)) => out.push(v),
                _ => return Vec::new(),
            }
        }
        out
    }
}

/// Whether weight decay applies to a parameter: not to biases, not to layer norms.
pub fn decays(name: &str) -> bool {
    !(name.ends_with(".bias") || name.contains(".ln_"))
}

/// Hyper-parameters of AdamW.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// `Σ g²` in f64 where `g` lives, as a scalar tensor: rows of [`SQUARE_SUM_ROW`]
/// elements summed side by side, then the rows' sums and the tail. (Candle's `sum_all`
/// reduces a whole tensor in one block of threads: on an H200 the squares of 124M
/// parameters' gradients took 81 ms that way, a fifth of a learner step.)
fn square_sum(g: &Tensor) -> CandleResult<Tensor> {
    let g = g.flatten_all()?.to_dtype(DType::F64)?; // (n)
    let n = g.elem_count();
    let rows = n / SQUARE_SUM_ROW;
    let body = rows * SQUARE_SUM_ROW;
    let mut total = Tensor::zeros((), DType::F64, g.device())?;
    if rows > 0 {
        let squares = g
            .narrow(0, 0, body)?
            .reshape((rows, SQUARE_SUM_ROW))?
            .sqr()?;
        total = (total + squares.sum(1)?.sum_all()?)?; // (rows, ROW) -> (rows) -> ()
    }
    if n > body {
        total = (total + g.narrow(0, body, n - body)?.sqr()?.sum_all()?)?;
    }
    Ok(total)
}

/// Elements per row of [`square_sum`]'s first reduction.
const SQUARE_SUM_ROW: usize = 4096;

/// `Σ x²` in f64, in parallel chunks.
fn sum_squares(x: &[f32]) -> f64 {
    use rayon::prelude::*;
    x.par_chunks(1 << 14)
        .map(rookworld_lm::simd::sum_squares_f64)
        .sum()
}

/// Linear warm-up to `lr`, then cosine decay to `min_lr` at `total_steps`, flat after.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl Schedule {
    /// Learning rate of step `step` (0-based):
    /// `lr·(step+1)/warmup` during warm-up, then
    /// `min_lr + ½(lr − min_lr)(1 + cos(π·progress))`, progress = (step − warmup)/(total − warmup).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        self.min_lr
            + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod export_tests;

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn the_device_square_sum_is_the_host_one() {
        // Whole rows and a tail, a tail alone, nothing.
        for n in [3 * SQUARE_SUM_ROW + 5, 17, 2 * SQUARE_SUM_ROW, 0] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let t = Tensor::from_slice(&x, n, &Device::Cpu).unwrap();
            let got = square_sum(&t).unwrap().to_scalar::<f64>().unwrap();
            let want = sum_squares(&x);
            assert!(
                (got - want).abs() <= 1e-12 * want.max(1.0),
                "n {n}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn accumulated_gradients_and_moments_hold_no_graph() {
        // y = (w·x)²: the gradient 2(w·x)·x is computed with ops on w, so candle tracks it.
        let w = Var::from_tensor(&Tensor::new(&[0.5f32, -1.0], &Device::Cpu).unwrap()).unwrap();
        let x = Tensor::new(&[2.0f32, 3.0], &Device::Cpu).unwrap();
        let y = (w.as_tensor() * &x)
            .unwrap()
            .sum_all()
            .unwrap()
            .sqr()
            .unwrap();
        let store = y.backward().unwrap();
        let vars = vec![("h.0.mlp.c_fc.weight".to_owned(), w.clone())];
        let mut grads = Gradients::default();
        grads.accumulate(&store, &vars).unwrap();
        grads.accumulate(&store, &vars).unwrap();
        let g = grads.get("h.0.mlp.c_fc.weight").unwrap();
        assert!(
            !g.track_op(),
            "an accumulated gradient keeps the forward graph alive"
        );
    }

    #[test]
    fn no_decay_on_biases_and_layer_norms() {
        assert!(decays("transformer.h.0.attn.c_attn.weight"));
        assert!(decays("transformer.wte.weight"));
        assert!(!decays("transformer.h.0.attn.c_attn.bias"));
        assert!(!decays("transformer.h.3.ln_1.weight"));
        assert!(!decays("transformer.ln_f.weight"));
    }

    #[test]
    fn schedule_warms_up_linearly_then_decays_to_the_floor() {
        let s = Schedule {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!((s.lr_at(0) - 1e-4).abs() < 1e-12);
        assert!((s.lr_at(9) - 1e-3).abs() < 1e-12);
        assert!((s.lr_at(10) - 1e-3).abs() < 1e-12);
        assert!((s.lr_at(60) - 5.5e-4).abs() < 1e-12);
        assert!((s.lr_at(110) - 1e-4).abs() < 1e-12);
        assert!((s.lr_at(500) - 1e-4).abs() < 1e-12);
    }

    #[test]
    fn clipping_scales_to_the_bound_and_reports_the_norm_before() {
        let mut g = Gradients::default();
        g.insert_host("a".into(), vec![3.0], Shape::from(1));
        g.by_name.insert(
            "b".into(),
            Grad::Tensor(Tensor::new(&[4.0f32], &Device::Cpu).unwrap()),
        );
        assert!((g.clip(1.0, &Kernels::cpu()).unwrap() - 5.0).abs() < 1e-9);
        assert!((g.global_norm(&Kernels::cpu()).unwrap() - 1.0).abs() < 1e-5);
    }
}
