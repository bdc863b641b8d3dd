//! The supervised loss of a micro-batch of documents — mean next-token cross-entropy over
//! each document's predicted tokens — on the fused pass ([`fused_gradients`]) and through
//! candle's autograd ([`cross_entropy`]), which it is checked against.

use std::ops::DerefMut;

use crate::{Activations, Backend, Weights};
use candle_core::{Device, Tensor};
use rookworld_lm::Gpt2;

use crate::fused::micro_batch::nll_micro;
use crate::fused::{GroupInput, Params};
use crate::optim::Gradients;
use crate::policy::{Pass, Trainable, slot_logprobs};

/// A training document: `[bos] + tokens(text) + [bos]` and the first position whose token
/// is predicted (1, or the first completion token when only completions are trained).
#[derive(Debug, Clone)]
pub struct Document {
    pub ids: Vec<u32>,
    pub first: usize,
}

/// Mean next-token cross-entropy of a micro-batch of documents over their predicted
/// tokens, and their count. Only the predicting positions go through the LM head.
pub fn cross_entropy(
    model: &Gpt2,
    docs: &[Document],
    pad: u32,
    device: &Device,
) -> candle_core::Result<(Tensor, usize)> {
    let t = docs.iter().map(|d| d.ids.len()).max().unwrap_or(2);
    let c = docs.len();
    let mut ids = vec![pad; c * t];
    let (mut slots, mut targets) = (Vec::new(), Vec::new());
    for (r, d) in docs.iter().enumerate() {
        ids[r * t..r * t + d.ids.len()].copy_from_slice(&d.ids);
        for j in d.first.max(1)..d.ids.len() {
            slots.push((r * (t - 1) + j - 1) as u32);
            targets.push(d.ids[j]);
        }
    }
    let tokens = slots.len();
    let ids = Tensor::from_vec(ids, (c, t), device)?;
    let slots = Tensor::new(slots, device)?;
    let targets = Tensor::new(targets, device)?;
    let logp = slot_logprobs(model, &ids, &slots, &targets, 1.0)?; // (N)
    let loss = (logp.sum_all()?.neg()? / tokens.max(1) as f64)?;
    Ok((loss, tokens))
}

/// A micro-batch as the fused pass takes it: each document a one-completion group (its
/// tokens before the first predicted one, then the rest), and the micro-batch's weight
/// (its share of the predicted tokens).
type FusedMicro = (Vec<(Vec<u32>, [Vec<u32>; 1])>, f64);

/// The micro-batches of `batch`, `micro_size` documents each.
fn fused_micro_batches(
    batch: &[Document],
    micro_size: usize,
    total_tokens: usize,
) -> Vec<FusedMicro> {
    batch
        .chunks(micro_size.max(1))
        .map(|micro| {
            let split: Vec<(Vec<u32>, [Vec<u32>; 1])> = micro
                .iter()
                .map(|d| {
                    let first = d.first.max(1);
                    (d.ids[..first].to_vec(), [d.ids[first..].to_vec()])
                })
                .collect();
            let tokens: usize = split.iter().map(|(_, [c])| c.len()).sum();
            (split, tokens as f64 / total_tokens.max(1) as f64)
        })
        .collect()
}

/// The supervised loss of every micro-batch on backend `b`, its gradients added to
/// `grads`.
fn fused_loss<B: Backend, G: DerefMut<Target = B::Buf>>(
    b: &B,
    (weights, acts): (&Weights<B>, &mut Activations<B>),
    micros: &[FusedMicro],
    grads: &mut [G],
) -> candle_core::Result<f64> {
    let mut loss = 0.0;
    for (split, w) in micros {
        let groups: Vec<GroupInput> = split
            .iter()
            .map(|(p, c)| GroupInput {
                prompt: p,
                completions: c,
            })
            .collect();
        loss += w * nll_micro(b, weights, &groups, *w, grads, acts)?;
    }
    Ok(loss)
}

/// The supervised gradients of `batch` on the fused pass on the CPU, and the loss.
pub fn fused_gradients(
    policy: &Trainable,
    batch: &[Document],
    micro_size: usize,
    total_tokens: usize,
) -> candle_core::Result<(Gradients, f64)> {
    let tensors = policy.tensors();
    let params = Params::new(&tensors, policy.model.config())?.with_matmuls(policy.fused_matmuls());
    let mut work = policy.workspace.lock().expect("workspace lock");
    let mut buffers = work.zeroed_grads(&params);
    let micros = fused_micro_batches(batch, micro_size, total_tokens);
    let b = policy.fused_backend();
    let loss = fused_loss(
        &b,
        (&params.weights(), &mut work.policy),
        &micros,
        &mut buffers,
    )?;
    Ok((policy.host_gradients(buffers), loss))
}

/// The supervised gradients of `batch` on the fused pass on CUDA (gradients as device
/// tensors), and the loss.
#[cfg(feature = "cuda")]
fn fused_gradients_cuda(
    policy: &Trainable,
    batch: &[Document],
    micro_size: usize,
    total_tokens: usize,
) -> candle_core::Result<(Gradients, f64)> {
    let tensors = policy.tensors();
    let micros = fused_micro_batches(batch, micro_size, total_tokens);
    let mut work = policy.workspace.lock().expect("workspace lock");
    let workspace = work.cuda.get_or_insert_with(Default::default);
    let (loss, grads) = crate::fused::cuda::with_pass(
        workspace,
        (policy.model.device(), policy.step_kernels()),
        policy.model.config(),
        (&tensors, None),
        |b, side, _, grads| fused_loss(b, side, &micros, grads),
    )?;
    drop(work);
    Ok((policy.device_gradients(grads), loss))
}

/// The supervised gradients of `batch` through candle's autograd (every device and
/// dtype; the fused pass is checked against it), and the loss.
pub fn autograd_gradients(
    policy: &Trainable,
    batch: &[Document],
    micro_size: usize,
    total_tokens: usize,
) -> candle_core::Result<(Gradients, f64)> {
    let pad = policy.model.config().eos_token_id;
    let device = policy.model.device();
    let mut grads = Gradients::default();
    let mut loss = 0.0;
    for micro in batch.chunks(micro_size.max(1)) {
        let (l, tokens) = cross_entropy(&policy.model, micro, pad, device)?;
        let w = tokens as f64 / total_tokens.max(1) as f64;
        grads.accumulate(&(&l * w)?.backward()?, &policy.vars)?;
        loss += w * l.to_scalar::<f32>()? as f64;
    }
    Ok((grads, loss))
}

/// The supervised gradients and loss of `batch` in micro-batches of `micro_size`
/// documents: on the policy's pass ([`Trainable::pass`]).
pub fn gradients(
    policy: &Trainable,
    batch: &[Document],
    micro_size: usize,
) -> candle_core::Result<(Gradients, f64)> {
    let total_tokens: usize = batch.iter().map(|d| d.ids.len() - d.first.max(1)).sum();
    match policy.pass() {
        Pass::FusedCpu => fused_gradients(policy, batch, micro_size, total_tokens),
        #[cfg(feature = "cuda")]
        Pass::FusedCuda => fused_gradients_cuda(policy, batch, micro_size, total_tokens),
        _ => autograd_gradients(policy, batch, micro_size, total_tokens),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use rookworld_lm::Config;

    #[test]
    fn fused_supervised_gradients_equal_autograd() {
        let cfg = Config {
            n_positions: 32,
            n_embd: 16,
            n_layer: 2,
            n_head: 2,
            vocab_size: 97,
            eos_token_id: 96, // the padding id of the autograd path's batch
            ..Config::tiny()
        };
        let model = rookworld_lm::model_io::init_random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
        let policy = Trainable::from_model(&model).unwrap();
        let docs: Vec<Document> = [(12, 1), (9, 4), (20, 19), (5, 2)]
            .iter()
            .map(|&(len, first)| Document {
                ids: (0..len as u32)
                    .map(|i| (i * 37 + len as u32) % 97)
                    .collect(),
                first,
            })
            .collect();
        let total: usize = docs.iter().map(|d| d.ids.len() - d.first.max(1)).sum();
        let (fused, fused_loss) = fused_gradients(&policy, &docs, 3, total).unwrap();
        let (plain, plain_loss) = autograd_gradients(&policy, &docs, 3, total).unwrap();
        assert!(
            (fused_loss - plain_loss).abs() < 1e-5 * plain_loss,
            "{fused_loss} vs {plain_loss}"
        );
        for (name, _) in &policy.vars {
            let (a, b) = (fused.get(name).unwrap(), plain.get(name).unwrap());
            let max_abs = |t: &Tensor| {
                t.abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            };
            let (diff, scale) = (max_abs(&(&a - &b).unwrap()), max_abs(&b));
            assert!(diff <= 1e-4 * scale.max(1e-6), "{name}: {diff} of {scale}");
        }
    }
}
