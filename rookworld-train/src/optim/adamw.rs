//! AdamW: one fused pass over each parameter on the CPU, two in-place kernels with the
//! moments kept on the device elsewhere.

use std::borrow::Cow;
use std::collections::HashMap;
use std::collections::hash_map::Entry;

use candle_core::{DType, Result as CandleResult, Tensor, Var};
use rookworld_lm::kernels::Kernels;
use rookworld_lm::train_ops::adamw::{
    AdamWStep, ManyItem, adamw_step, adamw_step_many, write_bf16_bits,
};

use super::{AdamWConfig, Grad, Gradients, decays};
use crate::fused::HostF32;
use rookworld_weights::export::Payload;

/// AdamW (Loshchilov & Hutter), as `torch.optim.AdamW`: with t the step count and
/// g the (clip-scaled) gradient, `p ← p − lr·wd·p` (decaying parameters only),
/// `m ← β1 m + (1−β1) g`, `v ← β2 v + (1−β2) g²`,
/// `p ← p − lr · (m / (1−β1ᵗ)) / (sqrt(v / (1−β2ᵗ)) + eps)`.
///
/// On the CPU each parameter is updated in one pass over p, g, m and v ([`AdamWPass`]).
/// On a GPU the moments live on the device, one (2, n) tensor per parameter, and a step is
/// two in-place kernels ([`adamw_step`]): nothing crosses to the host but the weight
/// push's bfloat16 copy when one is asked for.
#[derive(Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    /// Steps taken (t).
    pub steps: u64,
    /// First and second moments by parameter name, f32 in the parameter's element order:
    /// the CPU's, and a loaded checkpoint's until a device step moves them.
    pub moments: HashMap<String, (Vec<f32>, Vec<f32>)>,
    /// The moments of parameters off the CPU, (2, n) on their device.
    device_moments: HashMap<String, Tensor>,
    /// Tests: take the device path on the CPU too.
    device_path_everywhere: bool,
}

/// A parameter's name and its first and second moments on the host.
pub type HostMoments<'a> = (&'a str, Cow<'a, [f32]>, Cow<'a, [f32]>);

impl AdamW {
    pub fn new(cfg: AdamWConfig) -> Self {
        Self {
            cfg,
            steps: 0,
            moments: HashMap::new(),
            device_moments: HashMap::new(),
            device_path_everywhere: false,
        }
    }

    /// Tests: takes the device path (moments kept as tensors, two in-place passes) for
    /// parameters on the CPU too, as it runs on a GPU.
    #[cfg(test)]
    pub(crate) fn use_device_path_everywhere(&mut self) {
        self.device_path_everywhere = true;
    }

    /// Every parameter's (name, first, second) moments on the host, for a checkpoint:
    /// the host ones borrowed, the device ones downloaded.
    pub fn host_moments(&self) -> CandleResult<Vec<HostMoments<'_>>> {
        let mut out: Vec<_> = self
            .moments
            .iter()
            .map(|(name, (m, v))| {
                (
                    name.as_str(),
                    Cow::from(m.as_slice()),
                    Cow::from(v.as_slice()),
                )
            })
            .collect();
        for (name, mv) in &self.device_moments {
            let n = mv.dim(1)?;
            let mut m = mv.flatten_all()?.to_vec1::<f32>()?; // (2n): m, then v
            let v = m.split_off(n);
            out.push((name.as_str(), Cow::from(m), Cow::from(v)));
        }
        Ok(out)
    }

    /// One update of `vars` with `grads` at learning rate `lr`.
    /// On CUDA the kernels run where the device's `train_ops` are on (`kernels`, the
    /// policy's [`rookworld_lm::Gpt2::kernels`]).
    pub fn step(
        &mut self,
        vars: &[(String, Var)],
        grads: &Gradients,
        lr: f64,
        kernels: &Kernels,
    ) -> CandleResult<()> {
        self.step_exporting(vars, grads, lr, None, kernels)
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
        kernels: &Kernels,
    ) -> CandleResult<()> {
        self.steps += 1;
        // Every parameter on the device path with a gradient there: one multi-tensor step.
        let all_on_device = vars.iter().all(|(name, var)| {
            matches!(grads.by_name.get(name), Some(Grad::Tensor(_)))
                && (!var.device().is_cpu() || self.device_path_everywhere)
        });
        if all_on_device && !vars.is_empty() {
            return self.step_many(vars, grads, lr, export, kernels);
        }
        for (i, (name, var)) in vars.iter().enumerate() {
            let Some(g) = grads.by_name.get(name) else {
                continue;
            };
            let numel = var.elem_count();
            let out = export.as_deref_mut().map(|e| e.slot(i, name));
            let step = self.constants(lr, decays(name), grads.scale());
            if let Grad::Tensor(g) = g
                && (!var.device().is_cpu() || self.device_path_everywhere)
            {
                self.step_on_device(name, var, g, (&step, kernels), out)?;
                continue;
            }
            let (m, v) = self
                .moments
                .entry(name.clone())
                .or_insert_with(|| (zeros_written(numel), zeros_written(numel)));
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
                step,
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

/// `n` zeros, written: `vec![0.0; n]` maps the kernel's shared zero page until a value is
/// written, so the first step's read-then-write of every moment faulted twice a page, the
/// second time with a TLB shootdown on every core (about a second of a 2-core machine for
/// gpt2-124m's two moments); written at once, each page faults once.
fn zeros_written(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    v.resize(n, 0.0);
    v
}

impl AdamW {
    /// The step's constants for a parameter that decays (`decay`) or not.
    fn constants(&self, lr: f64, decay: bool, grad_scale: f64) -> AdamWStep {
        let c = self.cfg;
        let t = self.steps as i32;
        AdamWStep {
            lr: lr as f32,
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            eps: c.eps as f32,
            shrink: (1.0 - lr * if decay { c.weight_decay } else { 0.0 }) as f32,
            s1: (1.0 / (1.0 - c.beta1.powi(t))) as f32,
            s2: (1.0 / (1.0 - c.beta2.powi(t))) as f32,
            grad_scale: grad_scale as f32,
        }
    }

    /// The moments of parameter `name` (n elements) on `device`, (2, n): moved from the
    /// host map on first use (a resumed checkpoint's), or zeros.
    fn device_moments_of(
        &mut self,
        name: &str,
        n: usize,
        device: &candle_core::Device,
    ) -> CandleResult<&Tensor> {
        Ok(match self.device_moments.entry(name.to_owned()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let init = match self.moments.remove(name) {
                    Some((m, v)) if m.len() == n && v.len() == n => {
                        Tensor::from_vec([m, v].concat(), (2, n), device)?
                    }
                    Some(_) => {
                        candle_core::bail!("optimizer moments of `{name}` have the wrong size")
                    }
                    None => Tensor::zeros((2, n), DType::F32, device)?,
                };
                e.insert(init)
            }
        })
    }

    /// Every parameter's step on its device at once (each has a gradient there):
    /// [`adamw_step_many`] — on a GPU one launch for all of them, and the push payload's
    /// bfloat16 copy written by the same pass and copied out in one transfer.
    fn step_many(
        &mut self,
        vars: &[(String, Var)],
        grads: &Gradients,
        lr: f64,
        export: Option<&mut Payload>,
        kernels: &Kernels,
    ) -> CandleResult<()> {
        let mut held = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            let Some(Grad::Tensor(g)) = grads.by_name.get(name) else {
                candle_core::bail!("adamw: no gradient of `{name}` on the device");
            };
            let moments = self
                .device_moments_of(name, var.elem_count(), var.device())?
                .clone();
            let grad = g.to_dtype(DType::F32)?.flatten_all()?.contiguous()?;
            let shrink = self.constants(lr, decays(name), 1.0).shrink;
            held.push((var.as_tensor().clone(), grad, moments, shrink));
        }
        let names = vars.iter().map(|(name, _)| name.as_str());
        let (bits, slots) = match export {
            Some(e) => e.data_section(names),
            None => (&mut [][..], Vec::new()),
        };
        let mut slots = slots.into_iter();
        let items: Vec<ManyItem> = held
            .iter()
            .map(|(param, grad, moments, shrink)| ManyItem {
                param,
                grad,
                moments,
                shrink: *shrink,
                out: slots.next(),
            })
            .collect();
        adamw_step_many(
            &items,
            &self.constants(lr, true, grads.scale()),
            bits,
            kernels,
        )
    }

    /// One parameter's step on its device: its moments there ((2, n), moved from the host
    /// map on first use: a resumed checkpoint's, or zeros), two kernels, and the
    /// parameter's bfloat16 copy downloaded into `out` when a push wants it.
    fn step_on_device(
        &mut self,
        name: &str,
        var: &Var,
        grad: &Tensor,
        (step, kernels): (&AdamWStep, &Kernels),
        out: Option<&mut [u8]>,
    ) -> CandleResult<()> {
        let moments = self
            .device_moments_of(name, var.elem_count(), var.device())?
            .clone();
        let grad = grad.to_dtype(DType::F32)?.flatten_all()?;
        adamw_step(var.as_tensor(), &grad, &moments, step, kernels)?;
        match out {
            Some(out) => write_bf16_bits(var.as_tensor(), out),
            None => Ok(()),
        }
    }
}

/// One fused AdamW update of a parameter (see [`AdamW`]), in place.
struct AdamWPass<'a> {
    /// The step's constants, the device kernels' own.
    step: AdamWStep,
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
        let c = self.step;
        let (shrink, b1, b2, s1, s2) = (c.shrink, c.beta1, c.beta2, c.s1, c.s2);
        let (lr, eps, gs) = (c.lr, c.eps, c.grad_scale);
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

#[cfg(test)]
mod tests {
    use candle_core::{Device, Shape};

    use super::*;

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
            opt.step(&vars, &grads, 0.1, &Kernels::cpu()).unwrap();
            p *= 1.0 - 0.1 * 0.1;
            m = 0.9 * m + 0.1 * g;
            v = 0.99 * v + 0.01 * g * g;
            p -= 0.1 * (m / (1.0 - 0.9f64.powi(t))) / ((v / (1.0 - 0.99f64.powi(t))).sqrt() + 1e-8);
            let got = var.as_tensor().to_vec1::<f32>().unwrap()[0] as f64;
            assert!((got - p).abs() < 1e-6, "step {t}: {got} vs {p}");
        }
    }

    /// The device path (two kernels, moments on the device), run here on the CPU: the
    /// same parameters and moments as the host pass, bit for bit, over steps with decay
    /// and clipping; the moments reach a checkpoint.
    #[test]
    fn the_device_path_equals_the_host_pass() {
        let values: Vec<f32> = (0..1000)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let make = || {
            let var =
                Var::from_tensor(&Tensor::from_slice(&values, (10, 100), &Device::Cpu).unwrap())
                    .unwrap();
            vec![("transformer.h.0.mlp.c_fc.weight".to_owned(), var)]
        };
        let (host_vars, device_vars) = (make(), make());
        let (mut host, mut device) = (
            AdamW::new(AdamWConfig::default()),
            AdamW::new(AdamWConfig::default()),
        );
        device.device_path_everywhere = true;
        for step in 0..3 {
            let g: Vec<f32> = values
                .iter()
                .map(|v| v * (step as f32 + 0.5) - 0.1)
                .collect();
            let grads = || {
                let mut grads = Gradients::default();
                let t = Tensor::from_slice(&g, (10, 100), &Device::Cpu).unwrap();
                grads
                    .by_name
                    .insert(host_vars[0].0.clone(), Grad::Tensor(t));
                grads.scale = 0.75;
                grads
            };
            host.step(&host_vars, &grads(), 1e-2, &Kernels::cpu())
                .unwrap();
            device
                .step(&device_vars, &grads(), 1e-2, &Kernels::cpu())
                .unwrap();
            let (a, b) = (
                host_vars[0]
                    .1
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
                device_vars[0]
                    .1
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
            assert_eq!(a, b, "step {step}");
        }
        assert!(device.moments.is_empty(), "the moments live on the device");
        let (h, d) = (host.host_moments().unwrap(), device.host_moments().unwrap());
        assert_eq!(h.len(), 1);
        assert_eq!((h[0].0, &h[0].1, &h[0].2), (d[0].0, &d[0].1, &d[0].2));
    }
}
