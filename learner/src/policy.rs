//! The trainable policy (every weight a candle `Var`) and the frozen reference, and the
//! per-token log-probs the objective needs.

use std::path::Path;

use candle_core::{D, DType, Device, Result as CandleResult, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rookworld_lm::{Gpt2, LeftPadding, checkpoint};

use crate::batch::Layout;

/// A model whose weights are `Var`s, named as in a Hugging Face checkpoint.
#[derive(Debug)]
pub struct Trainable {
    pub model: Gpt2,
    /// Every parameter once (the tied LM head is `transformer.wte.weight`), by name.
    pub vars: Vec<(String, Var)>,
}

impl Trainable {
    /// Loads a checkpoint directory in f32 on `device` as trainable weights.
    pub fn load(dir: &Path, device: &Device) -> rookworld_lm::Result<Self> {
        Self::from_model(&checkpoint::load(dir, DType::F32, device)?)
    }

    /// Trainable copies of `model`'s weights.
    pub fn from_model(model: &Gpt2) -> rookworld_lm::Result<Self> {
        let varmap = VarMap::new();
        let mut vars = Vec::new();
        {
            let mut data = varmap.data().lock().expect("var map lock");
            for (name, t) in model.named_tensors() {
                let var = Var::from_tensor(&t.to_dtype(DType::F32)?)?;
                data.insert(name.clone(), var.clone());
                vars.push((name, var));
            }
        }
        let root = VarBuilder::from_varmap(&varmap, DType::F32, model.device());
        let cfg = model.config().clone();
        let model = Gpt2::load(root.pp("transformer"), root, &cfg)?;
        Ok(Self { model, vars })
    }
}

/// `log softmax(logits / temperature)` of each slot's target: (C, T−1). No dropout exists
/// anywhere, so this is the same forward that sampling ran.
pub fn token_logprobs(model: &Gpt2, layout: &Layout, temperature: f64) -> CandleResult<Tensor> {
    target_logprobs(model, &layout.ids, &layout.targets, temperature)
}

/// Log-probs under `softmax(logits / temperature)` of `targets` (C, T−1, 1), slot t being
/// the token after position t of `ids` (C, T): (C, T−1).
pub fn target_logprobs(
    model: &Gpt2,
    ids: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> CandleResult<Tensor> {
    let (c, t) = ids.dims2()?;
    let logits = model.forward(ids, &LeftPadding::none(c), &mut model.new_cache())?; // (C, T, V)
    let logits = if temperature == 1.0 {
        logits
    } else {
        (logits / temperature)?
    };
    // The last position predicts nothing: give it a dummy target so gather and
    // log-sum-exp run on the whole contiguous tensor, then drop it.
    let dummy = Tensor::zeros((c, 1, 1), targets.dtype(), targets.device())?;
    let targets = Tensor::cat(&[targets, &dummy], 1)?; // (C, T, 1)
    let picked = logits.gather(&targets, D::Minus1)?.squeeze(D::Minus1)?; // (C, T)
    (picked - logits.log_sum_exp(D::Minus1)?)?.narrow(1, 0, t - 1) // (C, T−1)
}
