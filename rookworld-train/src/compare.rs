//! The debug mode: one micro-batch through two backends, every buffer compared in the
//! order the pass writes it, so that a wrong kernel is named by the first buffer that
//! differs beyond its tolerance — the forward's activations block by block, the
//! log-probs, then the backward's parameter gradients from the last block down to the
//! embedding.
//!
//! A buffer of `left` matches `right` when `max_i |l_i − r_i| ≤ atol + rtol · max_i |r_i|`
//! (normwise: a kernel error shows at the scale of its output, whatever its layout).
//! Buffers the two backends lay out differently (an attention state of another shape)
//! are skipped, and said so.

use crate::backend::{Backend, Epilogue, Result, composed_epilogue};
use crate::packed::Packed;
use crate::pass::{self, Activations};
use crate::weights::{self, Weights};

/// How far two backends' buffers may differ.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub atol: f32,
    pub rtol: f32,
}

impl Tolerance {
    /// Two f32 paths: the same maths in another order of summation.
    pub const F32: Tolerance = Tolerance {
        atol: 1e-5,
        rtol: 1e-4,
    };
    /// Both sides' products with BF16 operands and f32 sums, summed in other orders (and
    /// the rest of the maths in f32): an operand may round to the other side of a BF16
    /// step where the sums before it differed.
    pub const SAME_PRODUCTS: Tolerance = Tolerance {
        atol: 1e-4,
        rtol: 2e-2,
    };
    /// One side's products with BF16 operands (8 bits of mantissa, f32 sums).
    pub const BF16: Tolerance = Tolerance {
        atol: 1e-3,
        rtol: 5e-2,
    };
}

/// One buffer's comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    pub name: String,
    /// `max |l − r|`, and `max |r|`: the scale it is measured against.
    pub max_diff: f32,
    pub scale: f32,
    /// The element where the difference is largest, and both values there.
    pub at: usize,
    pub left: f32,
    pub right: f32,
    pub within: bool,
}

/// Every buffer compared, in the pass's order, and those skipped.
#[derive(Debug, Clone, Default)]
pub struct Comparison {
    pub checked: Vec<Checked>,
    pub skipped: Vec<String>,
}

impl Comparison {
    /// The first buffer beyond its tolerance: the kernel that wrote it, or one it read,
    /// is wrong.
    pub fn first_divergence(&self) -> Option<&Checked> {
        self.checked.iter().find(|c| !c.within)
    }

    /// One line: the first divergence named, or how many buffers matched.
    pub fn summary(&self) -> String {
        match self.first_divergence() {
            Some(c) => format!(
                "first difference beyond tolerance: {} (max |Δ| {:.3e} against a scale of {:.3e}, \
                 at element {}: {} vs {})",
                c.name, c.max_diff, c.scale, c.at, c.left, c.right
            ),
            None => format!(
                "{} buffers match{}",
                self.checked.len(),
                if self.skipped.is_empty() {
                    String::new()
                } else {
                    format!(" ({} laid out differently, skipped)", self.skipped.len())
                }
            ),
        }
    }
}

/// Compares two host copies of buffer `name`; `None` when their lengths differ.
pub fn check(name: &str, left: &[f32], right: &[f32], tol: Tolerance) -> Option<Checked> {
    if left.len() != right.len() {
        return None;
    }
    let scale = right.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (mut at, mut max_diff) = (0, 0f32);
    let mut finite = true;
    for (i, (l, r)) in left.iter().zip(right).enumerate() {
        let d = (l - r).abs();
        if !d.is_finite() {
            finite &= l.to_bits() == r.to_bits();
            if !finite {
                (at, max_diff) = (i, f32::INFINITY);
                break;
            }
        } else if d > max_diff {
            (at, max_diff) = (i, d);
        }
    }
    Some(Checked {
        name: name.to_owned(),
        max_diff,
        scale,
        at,
        left: left.get(at).copied().unwrap_or(0.0),
        right: right.get(at).copied().unwrap_or(0.0),
        within: finite && max_diff <= tol.atol + tol.rtol * scale,
    })
}

/// `host`'s buffers on backend `b` (the model's parameters, say).
pub fn upload<B: Backend>(b: &B, host: &[Vec<f32>]) -> Result<Vec<B::Owned>> {
    host.iter()
        .map(|h| {
            let mut buf = B::Owned::default();
            b.fit(&mut buf, h.len())?;
            b.write(&mut buf, h)?;
            Ok(buf)
        })
        .collect()
}

/// Zeroed buffers of `lengths` elements on backend `b` (gradients, say).
pub fn zeros<B: Backend>(b: &B, lengths: &[usize]) -> Result<Vec<B::Owned>> {
    lengths
        .iter()
        .map(|&len| {
            let mut buf = B::Owned::default();
            b.fit(&mut buf, len)?;
            b.fill(&mut buf, 0.0)?;
            Ok(buf)
        })
        .collect()
}

/// One side of a comparison: a backend, the model's weights there, and its buffers.
pub struct Side<'a, B: Backend> {
    pub backend: &'a B,
    pub weights: &'a Weights<'a, B>,
    pub acts: &'a mut Activations<B>,
    /// Zeroed gradient buffers, one per parameter (indexed as [`Weights`]).
    pub grads: &'a mut [B::Owned],
}

/// Runs the forward with activations kept, then the backward of `dlogp` (N, on the host;
/// `None`: `−1/N` at every token, the gradient of the mean negative log-likelihood) on
/// both sides and compares every buffer; `right` is the reference.
pub fn step<L: Backend, R: Backend>(
    left: Side<'_, L>,
    right: Side<'_, R>,
    packed: &Packed,
    temperature: f64,
    dlogp: Option<&[f32]>,
    tol: Tolerance,
) -> Result<Comparison> {
    let cfg = right.weights.cfg;
    let mut out = Comparison::default();
    pass::forward(
        left.backend,
        left.weights,
        packed,
        temperature,
        left.acts,
        true,
    )?;
    pass::forward(
        right.backend,
        right.weights,
        packed,
        temperature,
        right.acts,
        true,
    )?;
    let (l_named, r_named) = (left.acts.named(), right.acts.named());
    for ((name, l), (_, r)) in l_named.into_iter().zip(r_named) {
        let (l, r) = (left.backend.read(l)?, right.backend.read(r)?);
        match check(&name, &l, &r, tol) {
            Some(c) => out.checked.push(c),
            None => out.skipped.push(name),
        }
    }
    let n = packed.targets.len();
    let uniform = vec![-1.0 / n.max(1) as f32; n];
    let dlogp = dlogp.unwrap_or(&uniform);
    pass::backward(
        left.backend,
        left.weights,
        packed,
        left.acts,
        dlogp,
        temperature,
        left.grads,
    )?;
    pass::backward(
        right.backend,
        right.weights,
        packed,
        right.acts,
        dlogp,
        temperature,
        right.grads,
    )?;
    // Gradients in the order the backward finishes them: the head and ln_f, the blocks
    // from the last down, the embedding.
    // A tied head is wte, last.
    let head = weights::head_index(cfg);
    let mut order: Vec<usize> = (head != 0).then_some(head).into_iter().collect();
    order.extend([weights::ln_f(cfg), weights::ln_f(cfg) + 1]);
    for l in (0..cfg.n_layer).rev() {
        order.extend((0..weights::PER_LAYER).rev().map(|j| weights::layer(l, j)));
    }
    order.extend([1, 0]);
    let l_res = left.backend.read(left.acts.embedding_gradient())?;
    let r_res = right.backend.read(right.acts.embedding_gradient())?;
    for i in order {
        if i == 1 {
            let name = "∂ embedding output";
            if let Some(c) = check(name, &l_res, &r_res, tol) {
                out.checked.push(c);
            }
        }
        let name = format!("∂ {}", weights::name(cfg, i));
        let (l, r) = (
            left.backend.read(&left.grads[i])?,
            right.backend.read(&right.grads[i])?,
        );
        match check(&name, &l, &r, tol) {
            Some(c) => out.checked.push(c),
            None => out.skipped.push(name),
        }
    }
    Ok(out)
}

/// `left` (its weights, activations and zeroed gradients) against the CPU backend
/// multiplying as `matmuls` on the same host weights `params`: [`step`] with a reference
/// side made here.
pub fn against_cpu<B: Backend>(
    left: Side<'_, B>,
    params: &[Vec<f32>],
    matmuls: crate::cpu::ops::Matmuls,
    (packed, temperature): (&Packed, f64),
    tol: Tolerance,
) -> Result<Comparison> {
    let cfg = left.weights.cfg;
    let reference = crate::cpu::Cpu::new(matmuls);
    let rw = Weights::<crate::cpu::Cpu>::new(cfg, params.iter().map(|p| p.as_slice()).collect())?;
    let mut acts = Activations::default();
    let mut grads = zeros(&reference, &weights::lengths(cfg))?;
    let right = Side {
        backend: &reference,
        weights: &rw,
        acts: &mut acts,
        grads: &mut grads,
    };
    step(left, right, packed, temperature, None, tol)
}

/// The shape of the start-up check with heads `d` wide: a small synthetic model (2
/// layers, 2 heads, the real vocabulary and its odd row length) whose heads have a kernel
/// of the CUDA backend ([`crate::launch::ATTENTION_WIDTHS`]).
pub fn self_check_config(d: usize) -> rookworld_lm::config::Config {
    rookworld_lm::config::Config {
        n_embd: 2 * d,
        n_head: 2,
        n_layer: 2,
        n_positions: 64,
        ..rookworld_lm::config::Config::tiny()
    }
}

/// The micro-batches of the start-up check, (groups, completions per group) and (prompt,
/// completion) tokens: a small one, and one whose 40-token prompt fills a tile of 32 rows
/// and part of another and whose rows see up to 64 keys — two chunks of 32, so the tiled
/// and tensor-core attentions run a second chunk (the forward's rescale by a later
/// chunk's larger max) and a second block of 16 rows.
pub const SELF_CHECK_BATCHES: [((usize, usize), (usize, usize)); 2] =
    [((2, 4), (9, 8)), ((1, 2), (40, 24))];

/// The start-up check of a backend: each of [`SELF_CHECK_BATCHES`] (seeded weights) of
/// each [`self_check_config`], one per head width the CUDA kernels serve, through `b` and
/// through the CPU backend with the same BF16 products ([`Tolerance::SAME_PRODUCTS`]),
/// every buffer compared; each buffer is named with its width and batch (`heads of 64, 2 ×
/// 4 × (9 + 8): block 0: attention output`). What a process runs before it trains on `b`:
/// the first buffer beyond tolerance names the kernel that is wrong, and the process takes
/// another path instead of wrong numbers.
pub fn self_check<B: Backend>(b: &B) -> Result<Comparison> {
    let mut all = Comparison::default();
    for d in crate::launch::ATTENTION_WIDTHS {
        let cfg = self_check_config(d);
        let params = weights::synthetic(&cfg, 0);
        let held = upload(b, &params)?;
        let w = Weights::<B>::new(&cfg, held.iter().map(|h| &**h).collect())?;
        for ((groups, g), (prompt, completion)) in SELF_CHECK_BATCHES {
            let (prompts, completions) =
                crate::packed::synthetic((groups, g), (prompt, completion), cfg.vocab_size, 0);
            let packed = Packed::of(&prompts, &completions);
            let mut acts = Activations::<B>::default();
            let mut grads = zeros(b, &weights::lengths(&cfg))?;
            let left = Side {
                backend: b,
                weights: &w,
                acts: &mut acts,
                grads: &mut grads,
            };
            let matmuls = crate::cpu::ops::Matmuls::Bf16;
            let c = against_cpu(
                left,
                &params,
                matmuls,
                (&packed, 1.0),
                Tolerance::SAME_PRODUCTS,
            )?;
            let named = |name: String| {
                format!("heads of {d}, {groups} × {g} × ({prompt} + {completion}): {name}")
            };
            all.checked.extend(c.checked.into_iter().map(|mut c| {
                c.name = named(c.name);
                c
            }));
            all.skipped.extend(c.skipped.into_iter().map(named));
        }
    }
    Ok(all)
}

/// The epilogues of `b` ([`Backend::gemm_epilogue`]) against the same maths as separate
/// kernels on `b` itself ([`composed_epilogue`]), on one linear layer of 40 rows, 24 in and
/// 64 out ([`pass::linear_products`]): the bias and GELU forms with operands exact in BF16
/// (so that only the epilogue can differ), the bias gradient with an output gradient that
/// is not (so that its error says whether the device rounds it to BF16 before summing).
/// Each result is named `epilogue <kind>: <buffer>`, and again with `, a second call`
/// (fresh buffers, other values: a device's reuse of the first call's set-up). Tolerances: [`Tolerance::F32`] for
/// the bias and the kept pre-activation; [`EPILOGUE_GELU`] for GELU and its gradient;
/// [`Tolerance::SAME_PRODUCTS`] for the bias gradient. Where the backend runs them
/// composed (the CPU; a device without the trial), every buffer is equal.
pub fn epilogue_check<B: Backend>(b: &B) -> Result<Comparison> {
    let mut all = Comparison::default();
    // Twice, into buffers of their own with other values: a device's second call of a
    // shape reuses what its first one set up, with the new call's pointers.
    for (round, sign) in [("", 1.0), (", a second call", -1.0)] {
        let one = epilogue_round(b, sign)?;
        all.checked.extend(one.checked.into_iter().map(|mut c| {
            c.name = format!("{}{round}", c.name);
            c
        }));
    }
    Ok(all)
}

/// One round of [`epilogue_check`], its bias, pre-activation and output gradient times
/// `sign`.
fn epilogue_round<B: Backend>(b: &B, sign: f32) -> Result<Comparison> {
    let (r, k, n) = (40, 24, 64);
    let [fwd, dgrad, wgrad] = pass::linear_products((r, k, n));
    let values = |len: usize, f: &dyn Fn(usize) -> f32| (0..len).map(f).collect::<Vec<f32>>();
    // Multiples of 1/8 and 1/16 below 1: exact in BF16, and so are their products' sums.
    let x = values(r * k, &|i| ((i * 7 % 9) as f32 - 4.0) / 8.0);
    let w = values(k * n, &|i| ((i * 5 % 7) as f32 - 3.0) / 16.0);
    let g = values(r * n, &|i| ((i * 3 % 11) as f32 - 5.0) / 16.0);
    let bias = values(n, &|i| sign * (i as f32 - 32.0) / 8.0);
    let pre = values(r * k, &|i| sign * (i as f32 * 0.21).cos() * 3.0);
    // Not exact in BF16.
    let dout = values(r * n, &|i| sign * (i as f32 * 0.37).sin());
    let held = upload(b, &[x, w, g, bias, pre, dout])?;
    let [x, w, g, bias, pre, dout] = [0, 1, 2, 3, 4, 5].map(|i| &*held[i]);
    let zero = |len: usize| -> Result<B::Owned> {
        let mut buf = B::Owned::default();
        b.fit(&mut buf, len)?;
        b.fill(&mut buf, 0.0)?;
        Ok(buf)
    };
    let mut all = Comparison::default();
    let mut compare = |name: &str, fused: &B::Buf, composed: &B::Buf, tol| -> Result<()> {
        let (l, r) = (b.read(fused)?, b.read(composed)?);
        all.checked
            .extend(check(&format!("epilogue {name}"), &l, &r, tol));
        Ok(())
    };

    let (mut c1, mut c2) = (zero(r * n)?, zero(r * n)?);
    b.gemm_epilogue(&mut c1, &fwd, (w, x), Epilogue::Bias { bias })?;
    composed_epilogue(b, &mut c2, &fwd, (w, x), Epilogue::Bias { bias })?;
    compare("bias: output", &c1, &c2, Tolerance::F32)?;

    let (mut p1, mut p2) = (zero(r * n)?, zero(r * n)?);
    let gelu = |pre| Epilogue::BiasGelu { bias, pre };
    b.gemm_epilogue(&mut c1, &fwd, (w, x), gelu(&mut *p1))?;
    composed_epilogue(b, &mut c2, &fwd, (w, x), gelu(&mut *p2))?;
    compare("bias+gelu: pre-activation", &p1, &p2, Tolerance::F32)?;
    compare("bias+gelu: output", &c1, &c2, EPILOGUE_GELU)?;

    let (mut d1, mut d2) = (zero(r * k)?, zero(r * k)?);
    b.gemm_epilogue(&mut d1, &dgrad, (w, g), Epilogue::Dgelu { pre })?;
    composed_epilogue(b, &mut d2, &dgrad, (w, g), Epilogue::Dgelu { pre })?;
    compare("dgelu: input gradient", &d1, &d2, EPILOGUE_GELU)?;

    let (mut dw1, mut dw2) = (zero(k * n)?, zero(k * n)?);
    let (mut db1, mut db2) = (zero(n)?, zero(n)?);
    let grad = |db| Epilogue::BiasGrad { db };
    b.gemm_epilogue(&mut dw1, &wgrad, (dout, x), grad(&mut *db1))?;
    composed_epilogue(b, &mut dw2, &wgrad, (dout, x), grad(&mut *db2))?;
    let tol = Tolerance::SAME_PRODUCTS;
    compare("bias grad: weight gradient", &dw1, &dw2, tol)?;
    compare("bias grad: bias gradient", &db1, &db2, tol)?;
    Ok(all)
}

/// GELU's value or its gradient from another implementation of the same tanh form, as
/// [`epilogue_check`] holds cuBLASLt's: another f32 tanh is about 1e-6 of the scale off;
/// the erf form, or a hardware `tanh.approx`, some 1e-4 — within this, and reported.
pub const EPILOGUE_GELU: Tolerance = Tolerance {
    atol: 1e-5,
    rtol: 1e-3,
};
