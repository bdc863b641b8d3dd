//! Optimisation: gradient accumulation, the global gradient norm and clipping, AdamW with
//! decoupled weight decay (not on biases and layer norms), and the learning-rate schedule.

use std::collections::{BTreeMap, HashMap};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result as CandleResult, Shape, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::export::Payload;
use crate::fused::HostF32;

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
    pub fn global_norm(&self) -> CandleResult<f64> {
        let mut total = 0f64;
        for g in self.by_name.values() {
            total += match g {
                Grad::Host(v, _) => sum_squares(v),
                Grad::Tensor(g) => match HostF32::new(g) {
                    Some(values) => sum_squares(values.as_slice()),
                    None => g
                        .to_dtype(DType::F64)?
                        .sqr()?
                        .sum_all()?
                        .to_scalar::<f64>()?,
                },
            };
        }
        Ok(total.sqrt() * self.scale)
    }

    /// Scales every gradient so the global norm is at most `max_norm`:
    /// `g ← g · min(1, max_norm / (‖g‖ + 1e-6))`. Returns the norm before clipping.
    pub fn clip(&mut self, max_norm: f64) -> CandleResult<f64> {
        let norm = self.global_norm()?;
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

/// AdamW (Loshchilov & Hutter), as `torch.optim.AdamW`: with t the step count and
/// g the (clip-scaled) gradient, `p ← p − lr·wd·p` (decaying parameters only),
/// `m ← β1 m + (1−β1) g`, `v ← β2 v + (1−β2) g²`,
/// `p ← p − lr · (m / (1−β1ᵗ)) / (sqrt(v / (1−β2ᵗ)) + eps)`.
///
/// On the CPU each parameter is updated in one pass over p, g, m and v ([`AdamWPass`]);
/// elsewhere with tensor ops (the moments then cross to the host and back).
#[derive(Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    /// Steps taken (t).
    pub steps: u64,
    /// First and second moments by parameter name, f32 in the parameter's element order.
    pub moments: HashMap<String, (Vec<f32>, Vec<f32>)>,
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
        self.step_exporting(vars, grads, lr, None)
    }

    /// [`AdamW::step`], writing each updated parameter as bfloat16 into its slot of
    /// `export` in the same pass (while its values are still in cache): the weight push's
    /// payload costs the training thread a store per parameter instead of a pass of its own.
    pub fn step_exporting(
        &mut self,
        vars: &[(String, Var)],
        grads: &Gradients,
        lr: f64,
        mut export: Option<&mut Payload>,
    ) -> CandleResult<()> {
        self.steps += 1;
        let c = self.cfg;
        let t = self.steps as i32;
        for (i, (name, var)) in vars.iter().enumerate() {
            let Some(g) = grads.by_name.get(name) else {
                continue;
            };
            let numel = var.elem_count();
            let out = export.as_deref_mut().map(|e| e.slot(i, name));
            let (m, v) = self
                .moments
                .entry(name.clone())
                .or_insert_with(|| (vec![0f32; numel], vec![0f32; numel]));
            if m.len() != numel || v.len() != numel {
                candle_core::bail!("optimizer moments of `{name}` have the wrong size");
            }
            // The gradient in place where it can be read so (a host buffer, or a CPU
            // tensor's storage), else a host copy.
            let (view, copy);
            let grad: &[f32] = match g {
                Grad::Host(g, _) => g,
                Grad::Tensor(t) => match HostF32::new(t) {
                    Some(v) => {
                        view = v;
                        view.as_slice()
                    }
                    None => {
                        copy = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                        &copy
                    }
                },
            };
            let pass = AdamWPass {
                lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                decay: if decays(name) { c.weight_decay } else { 0.0 },
                bias1: 1.0 - c.beta1.powi(t),
                bias2: 1.0 - c.beta2.powi(t),
                grad_scale: grads.scale(),
                grad,
                state: std::sync::Mutex::new((m.as_mut_slice(), v.as_mut_slice(), out)),
            };
            if var.device().is_cpu() && var.dtype() == DType::F32 && var.is_contiguous() {
                var.as_tensor().inplace_op1(&pass)?;
            } else {
                // Off the CPU: the same update on a host copy of the parameter.
                let mut p = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
                pass.apply(&mut p);
                var.set(&Tensor::from_vec(p, var.shape(), var.device())?)?;
            }
        }
        Ok(())
    }
}

/// One fused AdamW update of a parameter (see [`AdamW`]), in place.
struct AdamWPass<'a> {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    decay: f64,
    /// 1 − β1ᵗ and 1 − β2ᵗ.
    bias1: f64,
    bias2: f64,
    grad_scale: f64,
    grad: &'a [f32],
    /// The moments, and where the updated values go as bfloat16 (if anywhere).
    state: std::sync::Mutex<PassState<'a>>,
}

/// The first and second moments of one parameter, and its bfloat16 payload slot.
type PassState<'a> = (&'a mut [f32], &'a mut [f32], Option<&'a mut [u8]>);

impl AdamWPass<'_> {
    /// The update over `p`, in chunks across threads.
    fn apply(&self, p: &mut [f32]) {
        use rayon::prelude::*;
        let g = self.grad;
        let mut state = self.state.lock().expect("optimizer state lock");
        let (m, v, out) = &mut *state;
        let shrink = (1.0 - self.lr * self.decay) as f32;
        let (b1, b2) = (self.beta1 as f32, self.beta2 as f32);
        let (s1, s2) = ((1.0 / self.bias1) as f32, (1.0 / self.bias2) as f32);
        let (lr, eps, gs) = (self.lr as f32, self.eps as f32, self.grad_scale as f32);
        let update = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| {
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let g = g * gs;
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                let update = (*m * s1) / ((*v * s2).sqrt() + eps);
                *p = *p * shrink - lr * update;
            }
        };
        const CHUNK: usize = 1 << 14;
        let chunks = p
            .par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)));
        match out {
            Some(out) => {
                chunks
                    .zip(out.par_chunks_mut(CHUNK * 2))
                    .for_each(|(((p, g), (m, v)), out)| {
                        update(p, g, m, v);
                        rookworld_lm::bf16_payload::write_bf16(p, out);
                    })
            }
            None => chunks.for_each(|((p, g), (m, v))| update(p, g, m, v)),
        }
    }
}

impl candle_core::InplaceOp1 for AdamWPass<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(
        &self,
        s: &mut candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> CandleResult<()> {
        match (s, l.contiguous_offsets()) {
            (candle_core::CpuStorage::F32(p), Some((a, b))) if b - a == self.grad.len() => {
                self.apply(&mut p[a..b]);
                Ok(())
            }
            _ => candle_core::bail!(
                "adamw: parameter and gradient must be contiguous f32 of one size"
            ),
        }
    }
}

/// `Σ x²` in f64, in parallel chunks.
fn sum_squares(x: &[f32]) -> f64 {
    use rayon::prelude::*;
    x.par_chunks(1 << 14)
        .map(|c| c.iter().map(|&a| f64::from(a) * f64::from(a)).sum::<f64>())
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
            // Step 1 through a host buffer (fused pass), step 2 through a tensor.
            if t == 1 {
                grads.insert_host(vars[0].0.clone(), vec![g as f32], Shape::from(1));
            } else {
                let g = Tensor::new(&[g as f32], &Device::Cpu).unwrap();
                grads.by_name.insert(vars[0].0.clone(), Grad::Tensor(g));
            }
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
        g.insert_host("a".into(), vec![3.0], Shape::from(1));
        g.by_name.insert(
            "b".into(),
            Grad::Tensor(Tensor::new(&[4.0f32], &Device::Cpu).unwrap()),
        );
        assert!((g.clip(1.0).unwrap() - 5.0).abs() < 1e-9);
        assert!((g.global_norm().unwrap() - 1.0).abs() < 1e-5);
    }
}
