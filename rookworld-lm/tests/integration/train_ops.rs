//! The training ops (`rookworld_lm::train_ops`) against candle's composed ops: the same
//! values and the same gradients through autograd, on the CPU — the reference their CUDA
//! kernels are checked against on a GPU (`cuda::self_check`). Then the whole model: a
//! forward and backward with the ops on equal to the composed model's.

use candle_core::{D, DType, Device, Tensor, Var};
use rookworld_lm::config::Config;
use rookworld_lm::{Gpt2, LeftPadding, model_io, train_ops};

fn random(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// max |a − b| over max |b|.
fn rel(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&(a - b).unwrap()) / max_abs(b).max(1e-12)
}

/// The value of `f` and the gradients of Σ f(inputs) ⊙ r with respect to each input.
fn value_and_grads(
    inputs: &[Tensor],
    f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let args: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&args).unwrap();
    let r = random(y.dims(), 99);
    let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = vars.iter().map(|v| grads.get(v).unwrap().clone()).collect();
    (y, g)
}

fn assert_same(
    inputs: &[Tensor],
    fused: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    composed: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    tol: f32,
) {
    let (y1, g1) = value_and_grads(inputs, fused);
    let (y2, g2) = value_and_grads(inputs, composed);
    assert_eq!(y1.dims(), y2.dims());
    assert!(rel(&y1, &y2) < tol, "values differ by {}", rel(&y1, &y2));
    for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
        assert_eq!(a.dims(), b.dims(), "gradient {i}");
        assert!(rel(a, b) < tol, "gradient {i} differs by {}", rel(a, b));
    }
}

fn composed_layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let c = x.broadcast_sub(&mean)?;
    let var = c.sqr()?.mean_keepdim(D::Minus1)?;
    c.broadcast_div(&(var + 1e-5)?.sqrt()?)?
        .broadcast_mul(w)?
        .broadcast_add(b)
}

#[test]
fn layer_norm_values_and_gradients_equal_the_composed_ops() {
    // 70 rows: the parameters' partial sums span three 32-row chunks, the last partial.
    let inputs = [random(&[2, 35, 96], 1), random(&[96], 2), random(&[96], 3)];
    assert_same(
        &inputs,
        |a| train_ops::layer_norm(&a[0], &a[1], &a[2], 1e-5),
        |a| composed_layer_norm(&a[0], &a[1], &a[2]),
        1e-5,
    );
}

#[test]
fn bias_gelu_values_and_gradients_equal_the_composed_ops() {
    let inputs = [(random(&[3, 7, 64], 4) * 4.0).unwrap(), random(&[64], 5)];
    assert_same(
        &inputs,
        |a| train_ops::bias_gelu(&a[0], &a[1]),
        |a| a[0].broadcast_add(&a[1])?.gelu(),
        1e-5,
    );
}

/// What the mixed products do to an operand: round it to BF16.
fn bf16_rounded(t: &Tensor) -> Tensor {
    t.to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

#[test]
fn mixed_products_round_their_operands_to_bf16_and_sum_in_f32() {
    let r = bf16_rounded;
    let mm = |a: &Tensor, b: &Tensor| a.matmul(b).unwrap();
    let (x, w, b) = (
        random(&[37, 48], 11),
        random(&[48, 80], 12),
        random(&[80], 13),
    );
    let (y, g) = value_and_grads(&[x.clone(), w.clone(), b.clone()], |a| {
        train_ops::mixed_linear(&a[0], &a[1], &a[2])
    });
    let dy = random(&[37, 80], 99); // value_and_grads's weights: ∂L/∂y
    // The oracle: candle's f32 matmul of the rounded operands (their products are exact
    // in f32, so only the order of the f32 sums differs).
    let want = mm(&r(&x), &r(&w)).broadcast_add(&b).unwrap();
    assert!(rel(&y, &want) < 1e-5, "values differ by {}", rel(&y, &want));
    let unrounded = mm(&x, &w).broadcast_add(&b).unwrap();
    assert!(rel(&y, &unrounded) > 1e-4, "the operands were not rounded");
    let wt = r(&w).t().unwrap();
    let grads = [
        mm(&r(&dy), &wt),                 // ∂L/∂x = r(g) · r(W)ᵀ
        mm(&r(&x).t().unwrap(), &r(&dy)), // ∂L/∂W = r(x)ᵀ · r(g)
        dy.sum(0).unwrap(),               // ∂L/∂b = Σ_rows g
    ];
    for (i, (got, want)) in g.iter().zip(&grads).enumerate() {
        assert_eq!(got.dims(), want.dims(), "gradient {i}");
        assert!(
            rel(got, want) < 1e-5,
            "gradient {i} differs by {}",
            rel(got, want)
        );
    }

    // The tied head's product: W = wteᵀ, a transposed view; wte's gradient is r(g)ᵀ · r(x).
    let wte = random(&[80, 48], 14);
    let (y, g) = value_and_grads(&[x.clone(), wte.clone()], |a| {
        train_ops::mixed_matmul(&a[0], &a[1].t()?)
    });
    let want = mm(&r(&x), &r(&wte).t().unwrap());
    assert!(
        rel(&y, &want) < 1e-5,
        "head values differ by {}",
        rel(&y, &want)
    );
    let dwte = mm(&r(&dy).t().unwrap(), &r(&x));
    assert_eq!(g[1].dims(), &[80, 48]);
    assert!(
        rel(&g[1], &dwte) < 1e-5,
        "wte's gradient differs by {}",
        rel(&g[1], &dwte)
    );
    assert!(rel(&g[0], &mm(&r(&dy), &r(&wte))) < 1e-5);

    // Shapes that do not chain are errors, not panics.
    assert!(train_ops::mixed_linear(&x, &w.t().unwrap(), &b).is_err());
    assert!(train_ops::mixed_linear(&x, &w, &random(&[79], 15)).is_err());
    assert!(train_ops::mixed_matmul(&random(&[2, 3, 48], 16), &w).is_err());
}

/// Causal, with left padding in the second batch row (a key-padding mask per row).
fn causal_bias(t: usize, pads: &[usize]) -> Tensor {
    LeftPadding::new(pads.to_vec())
        .attention_bias(0, t, &Device::Cpu)
        .unwrap()
        .unwrap()
}

#[test]
fn masked_softmax_values_and_gradients_equal_the_composed_ops() {
    let (t, scale) = (11, 0.125);
    for bias in [causal_bias(t, &[0]), causal_bias(t, &[0, 4])] {
        let inputs = [(random(&[2, 3, t, t], 6) * 8.0).unwrap()];
        assert_same(
            &inputs,
            |a| train_ops::masked_softmax(&a[0], &bias, scale),
            |a| candle_nn::ops::softmax(&(&a[0] * scale)?.broadcast_add(&bias)?, D::Minus1),
            1e-5,
        );
    }
}

#[test]
fn a_fully_masked_softmax_row_is_zeros_not_nan() {
    let bias = Tensor::full(f32::NEG_INFINITY, (1, 1, 2, 3), &Device::Cpu).unwrap();
    let bias = bias
        .slice_assign(
            &[0..1, 0..1, 0..1, 0..3],
            &Tensor::zeros((1, 1, 1, 3), DType::F32, &Device::Cpu).unwrap(),
        )
        .unwrap();
    let p = train_ops::masked_softmax(&random(&[1, 1, 2, 3], 7), &bias, 1.0).unwrap();
    let rows = p
        .squeeze(0)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert!((rows[0].iter().sum::<f32>() - 1.0).abs() < 1e-6);
    assert_eq!(rows[1], vec![0.0; 3]);
}

#[test]
fn target_logprobs_values_and_gradients_equal_the_composed_ops() {
    let (n, v) = (9, 1000);
    let targets = Tensor::from_vec(
        (0..n as u32).map(|i| i * 97 % v as u32).collect(),
        n,
        &Device::Cpu,
    )
    .unwrap();
    for temperature in [1.0, 0.7] {
        let inputs = [(random(&[n, v], 8) * 6.0).unwrap()];
        assert_same(
            &inputs,
            |a| train_ops::target_logprobs(&a[0], &targets, temperature),
            |a| {
                let z = (&a[0] / temperature)?;
                let picked = z
                    .gather(&targets.unsqueeze(1)?, D::Minus1)?
                    .squeeze(D::Minus1)?;
                picked - z.log_sum_exp(D::Minus1)?
            },
            1e-5,
        );
    }
}

#[test]
fn bad_shapes_and_targets_are_errors() {
    let logits = random(&[2, 10], 9);
    let outside = Tensor::new(&[3u32, 10], &Device::Cpu).unwrap();
    let err = train_ops::target_logprobs(&logits, &outside, 1.0).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let bias = causal_bias(4, &[0]);
    let err = train_ops::masked_softmax(&random(&[1, 2, 5, 5], 1), &bias, 1.0).unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
    let err = train_ops::layer_norm(
        &random(&[3, 8], 1),
        &random(&[6], 2),
        &random(&[6], 3),
        1e-5,
    )
    .unwrap_err();
    assert!(err.to_string().contains("width"), "{err}");
}

/// Every parameter's gradient of Σ logits ⊙ r through the whole model, with the ops on
/// and off, on a left-padded batch.
#[test]
fn the_model_trains_the_same_with_the_ops_on() {
    let cfg = Config {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        vocab_size: 97,
        n_positions: 32,
        ..Config::tiny()
    };
    let base = model_io::init_random(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(
        &[[5u32, 9, 13, 2, 7, 1], [0, 0, 4, 8, 15, 16]],
        &Device::Cpu,
    )
    .unwrap();
    let padding = LeftPadding::new(vec![0, 2]);
    let mut results = Vec::new();
    for on in [false, true] {
        let varmap = candle_nn::VarMap::new();
        for (name, t) in base.named_tensors() {
            let var = Var::from_tensor(&t).unwrap();
            varmap.data().lock().unwrap().insert(name, var);
        }
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let mut model = Gpt2::load(vb.pp("transformer"), vb.clone(), &cfg).unwrap();
        model.set_train_ops(on);
        let logits = model
            .forward(&ids, &padding, &mut model.new_cache())
            .unwrap();
        let r = random(logits.dims(), 12);
        let grads = (&logits * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut named: Vec<(String, Tensor)> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(name, var)| (name.clone(), grads.get(var).unwrap().clone()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        results.push((logits, named));
    }
    assert!(rel(&results[1].0, &results[0].0) < 1e-5);
    assert_eq!(results[0].1.len(), results[1].1.len());
    let mut worst = 0f32;
    for ((name, a), (_, b)) in results[1].1.iter().zip(&results[0].1) {
        assert!(rel(a, b) < 1e-4, "{name}: {}", rel(a, b));
        worst = worst.max(rel(a, b));
    }
    // The ops round differently from the composed graph (f64 statistics): a gradient
    // identical to the last bit everywhere would mean they never ran.
    assert!(
        worst > 0.0,
        "the training ops changed nothing: did they run?"
    );
}

/// Zero rows: every op returns empty results and empty gradients, and AdamW on nothing
/// does nothing (the GPU self-check runs the same function on the device).
#[test]
fn every_op_takes_zero_rows() {
    rookworld_lm::train_ops::check_empty_rows(&candle_core::Device::Cpu).unwrap();
}
