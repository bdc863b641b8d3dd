//! Generation: reproducibility, batch independence, log-prob correctness, limits.

use candle_core::{D, DType, Device, Tensor};
use rookworld_lm::generate::{FinishReason, GenerationConfig, generate_group};
use rookworld_lm::model_io::init_random;
use rookworld_lm::sampling::SamplingParams;
use rookworld_lm::{Config, EOT_TOKEN, Error, Gpt2, LeftPadding, Tokenizer};

const START: &str = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:";

fn model() -> Gpt2 {
    init_random(&Config::tiny(), 11, DType::F32, &Device::Cpu).unwrap()
}

fn prompt() -> Vec<u32> {
    let mut ids = vec![EOT_TOKEN];
    ids.extend(Tokenizer::gpt2().encode(START).unwrap());
    ids
}

fn sampled(n: usize, seed: u64) -> GenerationConfig {
    GenerationConfig {
        n,
        max_new_tokens: 12,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        },
        seed,
        ignore_eos: false,
    }
}

#[test]
fn the_same_seed_reproduces_and_another_seed_differs() {
    let (m, p) = (model(), prompt());
    let a = generate_group(&m, &p, &sampled(4, 5), 0)
        .unwrap()
        .completions;
    let b = generate_group(&m, &p, &sampled(4, 5), 0)
        .unwrap()
        .completions;
    let c = generate_group(&m, &p, &sampled(4, 6), 0)
        .unwrap()
        .completions;
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_ne!(
        a[0].ids, a[1].ids,
        "the samples of a group use different streams"
    );
}

#[test]
fn a_sample_is_the_same_in_a_group_as_alone() {
    let (m, p) = (model(), prompt());
    let group = generate_group(&m, &p, &sampled(4, 9), 0)
        .unwrap()
        .completions;
    let alone = generate_group(&m, &p, &sampled(1, 9), 0)
        .unwrap()
        .completions;
    assert_eq!(group[0].ids, alone[0].ids);
    let d = group[0]
        .logprobs
        .iter()
        .zip(&alone[0].logprobs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(d < 1e-5, "log-probs differ by {d}");
}

#[test]
fn greedy_rows_are_identical_batched_and_alone() {
    let (m, p) = (model(), prompt());
    let greedy = |n| GenerationConfig {
        n,
        max_new_tokens: 10,
        sampling: SamplingParams::greedy(),
        seed: 0,
        ignore_eos: false,
    };
    let alone = generate_group(&m, &p, &greedy(1), 0)
        .unwrap()
        .completions
        .remove(0);
    for c in generate_group(&m, &p, &greedy(3), 0).unwrap().completions {
        assert_eq!(c.ids, alone.ids);
    }
}

/// The reported log-probs equal a teacher-forced forward over prompt + completion:
/// log softmax(logits / T)[id] — what the learner will recompute.
#[test]
fn reported_logprobs_equal_a_teacher_forced_forward() {
    let (m, p) = (model(), prompt());
    let temperature = 0.7;
    let cfg = GenerationConfig {
        sampling: SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
        },
        ..sampled(3, 21)
    };
    for c in generate_group(&m, &p, &cfg, 2).unwrap().completions {
        let mut all = p.clone();
        all.extend(&c.ids);
        let input = Tensor::new(all.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = m
            .forward(&input, &LeftPadding::none(1), &mut m.new_cache())
            .unwrap()
            .squeeze(0)
            .unwrap();
        let logp = candle_nn::ops::log_softmax(&(logits / temperature as f64).unwrap(), D::Minus1)
            .unwrap();
        for (k, (&id, &reported)) in c.ids.iter().zip(&c.logprobs).enumerate() {
            let row = p.len() - 1 + k;
            let want = logp
                .get(row)
                .unwrap()
                .get(id as usize)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                (want - reported).abs() < 1e-4,
                "token {k}: {reported} vs {want}"
            );
        }
    }
}

#[test]
fn lengths_and_finish_reasons() {
    let (m, p) = (model(), prompt());
    for c in generate_group(&m, &p, &sampled(3, 1), 0)
        .unwrap()
        .completions
    {
        assert_eq!(c.ids.len(), c.logprobs.len());
        match c.finish_reason {
            FinishReason::Length => assert_eq!(c.ids.len(), 12),
            FinishReason::Eos => assert_eq!(c.ids.last(), Some(&EOT_TOKEN)),
        }
    }
    // The context (256 for `tiny`) bounds the completion.
    let long: Vec<u32> = std::iter::repeat_n(400, 250).collect();
    let out = generate_group(
        &m,
        &long,
        &GenerationConfig {
            max_new_tokens: 50,
            ..sampled(1, 1)
        },
        0,
    )
    .unwrap();
    assert_eq!(out.completions[0].ids.len(), 7);
}

#[test]
fn bad_prompts_are_errors_not_panics() {
    let m = model();
    let too_long: Vec<u32> = std::iter::repeat_n(400, 257).collect();
    assert!(matches!(
        generate_group(&m, &too_long, &sampled(1, 0), 0),
        Err(Error::PromptTooLong {
            prompt_tokens: 257,
            context: 256
        })
    ));
    assert!(generate_group(&m, &[], &sampled(1, 0), 0).is_err());
    let err = generate_group(&m, &[50257], &sampled(1, 0), 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("50257"), "{err}");
    let bad_t = GenerationConfig {
        sampling: SamplingParams {
            temperature: -1.0,
            top_k: 0,
            top_p: 1.0,
        },
        ..sampled(1, 0)
    };
    assert!(generate_group(&m, &prompt(), &bad_t, 0).is_err());
}

/// Prompts of different lengths batched together give the completions each prompt
/// gets alone (same streams; padding never leaks into a row). Checked on the parity
/// fixture model, whose logits are peaked like a trained model's: on near-flat logits
/// (random `tiny`) float noise of different matmul shapes can move a sampled token.
#[test]
fn a_batch_of_prompts_equals_each_prompt_alone() {
    use rookworld_lm::generate::generate_batch;
    use rookworld_lm::model_io;
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/parity/tiny-gpt2");
    let m = model_io::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let prompts: Vec<Vec<u32>> = [17usize, 3, 9]
        .iter()
        .map(|&len| {
            (0..len as u32)
                .map(|i| (i * 37 + len as u32) % 500)
                .collect()
        })
        .collect();
    for cfg in [
        sampled(3, 17),
        GenerationConfig {
            sampling: SamplingParams::greedy(),
            ..sampled(2, 0)
        },
    ] {
        let batch = generate_batch(&m, &prompts, &cfg, 5).unwrap();
        assert_eq!(batch.groups.len(), 3);
        assert_eq!(batch.new_tokens(), 3 * cfg.n * 12);
        for (i, p) in prompts.iter().enumerate() {
            let alone = generate_group(&m, p, &cfg, 5 + i as u32)
                .unwrap()
                .completions;
            for (b, a) in batch.groups[i].iter().zip(&alone) {
                assert_eq!(b.ids, a.ids, "prompt {i}");
                assert_eq!(b.finish_reason, a.finish_reason);
                let d = b
                    .logprobs
                    .iter()
                    .zip(&a.logprobs)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max);
                assert!(d < 1e-4, "prompt {i}: log-probs differ by {d}");
            }
        }
    }
}
