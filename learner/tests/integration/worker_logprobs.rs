//! The rollout worker's behaviour log-probs and the learner's log-probs of the same
//! weights agree: completions sampled by the worker's engine (packed CPU kernel, shared
//! prompt cache, continuous batching, temperature 0.8) are scored again by the learner's
//! fused training pass (itself checked against the autograd path in `fused_parity.rs`).
//! At equal weights the ratio is 1 up to float rounding, as GRPO assumes.

use std::sync::Arc;

use candle_core::{DType, Device};
use rookworld_generation::{EngineConfig, Request, Scheduler, prepare_model};
use rookworld_lm::Config;
use rookworld_lm::model_io::init_random;
use rookworld_lm::sampling::SamplingParams;
use rookworld_train::fused::{self, Activations, GroupInput, Packed, Params};

#[test]
fn worker_logprobs_equal_the_learners_at_equal_weights() {
    let cfg = Config::preset("tiny").unwrap();
    let weights = init_random(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
    let engine_model = prepare_model(weights.clone()).unwrap();
    let mut scheduler = Scheduler::new(Arc::new(engine_model), 1, EngineConfig::default());
    let prompts: Vec<Vec<u32>> = vec![
        vec![50256, 47, 25, 374],
        (0..17).map(|i| 100 + 31 * i).collect(),
    ];
    let temperature = 0.8f32;
    scheduler
        .submit(Request {
            prompts: prompts.clone(),
            n: 4,
            max_new_tokens: 20,
            sampling: SamplingParams {
                temperature,
                top_k: 0,
                top_p: 1.0,
            },
            seed: 5,
            ignore_eos: true,
        })
        .unwrap();
    let (mut samples, _) = scheduler.run_to_completion().unwrap();
    samples.sort_by_key(|s| (s.prompt_index, s.sample_index));
    let mut groups: Vec<Vec<Vec<u32>>> = vec![Vec::new(); prompts.len()];
    let mut worker: Vec<f32> = Vec::new();
    for s in &samples {
        groups[s.prompt_index as usize].push(s.completion.ids.clone());
        worker.extend(&s.completion.logprobs);
    }

    let tensors: Vec<_> = weights
        .named_tensors()
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let params = Params::new(&tensors, &cfg).unwrap();
    let inputs: Vec<GroupInput> = prompts
        .iter()
        .zip(&groups)
        .map(|(p, c)| GroupInput {
            prompt: p,
            completions: c,
        })
        .collect();
    let packed = Packed::new(&inputs);
    let mut acts = Activations::default();
    let learner =
        fused::forward(&params, &packed, f64::from(temperature), &mut acts, false).unwrap();
    assert_eq!(learner.len(), worker.len());
    let worst = learner
        .iter()
        .zip(&worker)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!(
        "{} tokens, largest |worker − learner| log-prob difference {worst:.2e}",
        worker.len()
    );
    assert!(
        worst < 1e-4,
        "worker and learner log-probs differ by {worst}"
    );
}
