//! Gradients: the global norm and clipping (AdamW and the schedule arrive with training).

use candle_core::backprop::GradStore;
use candle_core::{Result as CandleResult, Var};

/// Global L2 norm of the gradients of `vars`, `sqrt(Σ_p ‖∂L/∂p‖²)`, each parameter counted
/// once (the tied embedding/LM head is one `Var`). Parameters without a gradient count 0.
pub fn global_grad_norm(grads: &GradStore, vars: &[(String, Var)]) -> CandleResult<f64> {
    let mut total = 0f64;
    for (_, var) in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            total += g
                .sqr()?
                .sum_all()?
                .to_dtype(candle_core::DType::F64)?
                .to_scalar::<f64>()?;
        }
    }
    Ok(total.sqrt())
}
