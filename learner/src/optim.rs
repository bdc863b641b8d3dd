//! Optimisation: gradient accumulation, the global gradient norm and clipping, AdamW with
//! decoupled weight decay (not on biases and layer norms), and the learning-rate schedule.

use std::collections::{BTreeMap, HashMap};

use candle_core::backprop::GradStore;
use candle_core::{DType, Result as CandleResult, Tensor, Var};
use serde::{Deserialize, Serialize};

/// Gradients summed over micro-batches, by parameter name (ordered, so every sum over
/// parameters runs in the same order in every process: resumed runs stay bit-identical).
#[derive(Debug, Default)]
pub struct Gradients {
    by_name: BTreeMap<String, Tensor>,
}

impl Gradients {
    /// Adds the gradients of `vars` found in `store`. Each is detached: candle computes
    /// gradients with ops on the weights, so a gradient otherwise carries the forward
    /// graph along — and through the optimizer's moments, every step's graph, forever.
    pub fn accumulate(&mut self, store: &GradStore, vars: &[(String, Var)]) -> CandleResult<()> {
        for (name, var) in vars {
            if let Some(g) = store.get(var.as_tensor()) {
                let g = &g.detach();
                let sum = match self.by_name.remove(name) {
                    Some(acc) => (acc + g)?,
                    None => g.clone(),
                };
                self.by_name.insert(name.clone(), sum);
            }
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.by_name.get(name)
    }

    /// Global L2 norm `sqrt(Σ_p ‖g_p‖²)`, each parameter once (the tied embedding/LM head
    /// is one parameter).
    pub fn global_norm(&self) -> CandleResult<f64> {
        let mut total = 0f64;
        for g in self.by_name.values() {
            total += g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        Ok(total.sqrt())
    }

    /// Scales every gradient so the global norm is at most `max_norm`:
    /// `g ← g · min(1, max_norm / (‖g‖ + 1e-6))`. Returns the norm before clipping.
    pub fn clip(&mut self, max_norm: f64) -> CandleResult<f64> {
        let norm = self.global_norm()?;
        let scale = (max_norm / (norm + 1e-6)).min(1.0);
        if scale < 1.0 {
            for g in self.by_name.values_mut() {
                *g = (&*g * scale)?;
            }
        }
        Ok(norm)
    }
}

/// Global L2 norm of the gradients of `vars` in one backward's store.
pub fn global_grad_norm(grads: &GradStore, vars: &[(String, Var)]) -> CandleResult<f64> {
    let mut g = Gradients::default();
    g.accumulate(grads, vars)?;
    g.global_norm()
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

/// AdamW (Loshchilov & Hutter), as `torch.optim.AdamW`: with t the step count,
/// `p ← p − lr·wd·p` (decaying parameters only), `m ← β1 m + (1−β1) g`,
/// `v ← β2 v + (1−β2) g²`, `p ← p − lr · (m / (1−β1ᵗ)) / (sqrt(v / (1−β2ᵗ)) + eps)`.
#[derive(Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    /// Steps taken (t).
    pub steps: u64,
    /// First and second moments by parameter name.
    pub moments: HashMap<String, (Tensor, Tensor)>,
}

impl AdamW {
    pub fn new(cfg: AdamWConfig) -> Self {
        Self {
            cfg,
            steps: 0,
            moments: HashMap::new(),
        }
    }

    /// One update of `vars` with `grads` at learning rate `lr`.
    pub fn step(&mut self, vars: &[(String, Var)], grads: &Gradients, lr: f64) -> CandleResult<()> {
        self.steps += 1;
        let c = self.cfg;
        let t = self.steps as i32;
        let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
        for (name, var) in vars {
            let Some(g) = grads.get(name) else {
                continue;
            };
            let (m, v) = match self.moments.remove(name) {
                Some(mv) => mv,
                None => (g.zeros_like()?, g.zeros_like()?),
            };
            let m = ((m * c.beta1)? + (g * (1.0 - c.beta1))?)?;
            let v = ((v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let mut p = var.as_tensor().detach();
            if decays(name) && c.weight_decay > 0.0 {
                p = (&p * (1.0 - lr * c.weight_decay))?;
            }
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + c.eps)?)?;
            var.set(&(p - (update * lr)?)?)?;
            self.moments.insert(name.clone(), (m, v));
        }
        Ok(())
    }
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
mod tests {
    use candle_core::Device;

    use super::*;

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
        let mut opt = AdamW::new(AdamWConfig::default());
        opt.step(&vars, &grads, 1e-3).unwrap();
        let (m, v) = &opt.moments["h.0.mlp.c_fc.weight"];
        assert!(!m.track_op() && !v.track_op());
    }

    #[test]
    fn adamw_matches_the_closed_form_on_a_scalar() {
        let var = Var::from_tensor(&Tensor::new(&[1.0f32], &Device::Cpu).unwrap()).unwrap();
        let vars = vec![("h.0.mlp.c_fc.weight".to_owned(), var.clone())];
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(cfg);
        let (mut p, mut m, mut v) = (1.0f64, 0.0f64, 0.0f64);
        for (t, g) in [(1, 0.5f64), (2, -0.25)] {
            let mut grads = Gradients::default();
            grads.by_name.insert(
                vars[0].0.clone(),
                Tensor::new(&[g as f32], &Device::Cpu).unwrap(),
            );
            opt.step(&vars, &grads, 0.1).unwrap();
            p *= 1.0 - 0.1 * 0.1;
            m = 0.9 * m + 0.1 * g;
            v = 0.99 * v + 0.01 * g * g;
            p -= 0.1 * (m / (1.0 - 0.9f64.powi(t))) / ((v / (1.0 - 0.99f64.powi(t))).sqrt() + 1e-8);
            let got = var.as_tensor().to_vec1::<f32>().unwrap()[0] as f64;
            assert!((got - p).abs() < 1e-6, "step {t}: {got} vs {p}");
        }
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
        g.by_name
            .insert("a".into(), Tensor::new(&[3.0f32], &Device::Cpu).unwrap());
        g.by_name
            .insert("b".into(), Tensor::new(&[4.0f32], &Device::Cpu).unwrap());
        assert!((g.clip(1.0).unwrap() - 5.0).abs() < 1e-9);
        assert!((g.global_norm().unwrap() - 1.0).abs() < 1e-5);
    }
}
