//! The padded LM head ([`Gpt2::prepare_for_inference`] pads it on CUDA), run on the CPU:
//! the plain head's logits, and the view the device sampler reads.

use candle_core::{DType, Device, Tensor};

use super::{Gpt2, HEAD_ROWS_ALIGN};
use crate::model_io::init_random;
use crate::{Config, LeftPadding};

fn logits(m: &Gpt2, ids: &[u32]) -> Vec<f32> {
    let ids = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap(); // (1, T)
    m.forward(&ids, &LeftPadding::none(1), &mut m.new_cache())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn a_padded_head_gives_the_plain_heads_logits() {
    let cfg = Config::tiny();
    let plain = init_random(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
    let mut padded = plain.clone();
    padded.pad_head().unwrap();
    let (rows, e) = padded.head_padded.as_ref().unwrap().dims2().unwrap();
    assert_eq!(rows, cfg.vocab_size.next_multiple_of(HEAD_ROWS_ALIGN));
    assert_eq!((rows % HEAD_ROWS_ALIGN, e), (0, cfg.n_embd));

    let ids = [5u32, 17, 300, 2, 50_256];
    let (want, got) = (logits(&plain, &ids), logits(&padded, &ids));
    assert_eq!(got.len(), ids.len() * cfg.vocab_size);
    let d = want
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-5, "max |Δ| = {d}");

    // The head's raw product: the first V columns of rows V' apart, the same values.
    let hidden = Tensor::randn(0f32, 1.0, (3, cfg.n_embd), &Device::Cpu).unwrap();
    let view = padded.head_product(&hidden).unwrap();
    assert_eq!(view.dims2().unwrap(), (3, cfg.vocab_size));
    assert_eq!(view.stride(), &[rows, 1]);
    let plain_product = plain.head_product(&hidden).unwrap();
    let d = (view - plain_product)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(d < 1e-5, "max |Δ| = {d}");
}
