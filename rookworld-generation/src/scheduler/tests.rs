use std::sync::Arc;

use candle_core::{DType, Device};
use rookworld_lm::generate::{GenerationConfig, generate_batch};
use rookworld_lm::model_io::init_random;
use rookworld_lm::sampling::SamplingParams;
use rookworld_lm::{Config, Gpt2};

use super::*;
use crate::{EngineConfig, FinishedSample, Request};

fn model(seed: u64) -> Arc<Gpt2> {
    Arc::new(init_random(&Config::tiny(), seed, DType::F32, &Device::Cpu).unwrap())
}

fn prompt(k: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7919 + k * 104_729) % 50257)
        .collect()
}

fn sampling() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
    }
}

fn request(prompts: Vec<Vec<u32>>, n: usize, max_new_tokens: usize, seed: u64) -> Request {
    Request {
        prompts,
        n,
        max_new_tokens,
        sampling: sampling(),
        seed,
        ignore_eos: false,
    }
}

/// Steps until every request is done; samples sorted by (request, prompt, sample).
fn run_all(s: &mut Scheduler) -> Vec<FinishedSample> {
    let mut out = Vec::new();
    while s.has_work() {
        let (events, _) = s.step(true);
        for e in events {
            match e {
                Event::Sample(x) => out.push(x),
                Event::Done(_) => {}
                Event::Failed(id, why) => panic!("request {id} failed: {why}"),
            }
        }
    }
    out.sort_by_key(|x| (x.request, x.prompt_index, x.sample_index));
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The reference: each prompt alone with the plain KV cache, its cache copied per sample.
fn reference(
    m: &Gpt2,
    prompts: &[Vec<u32>],
    n: usize,
    max_new: usize,
    seed: u64,
    sp: SamplingParams,
) -> Vec<Completion> {
    let cfg = GenerationConfig {
        n,
        max_new_tokens: max_new,
        sampling: sp,
        seed,
        ignore_eos: false,
    };
    prompts
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            generate_batch(m, std::slice::from_ref(p), &cfg, i as u32)
                .unwrap()
                .groups
                .remove(0)
        })
        .collect()
}

#[test]
fn shared_prompt_caches_give_each_sample_what_its_prompt_alone_gives() {
    let m = model(1);
    let prompts = vec![prompt(1, 30), prompt(2, 7), prompt(3, 19)];
    let mut s = Scheduler::new(m.clone(), 1, EngineConfig::default());
    s.submit(request(prompts.clone(), 8, 20, 5)).unwrap();
    let got = run_all(&mut s);
    let want = reference(&m, &prompts, 8, 20, 5, sampling());
    assert_eq!(got.len(), 24);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.completion.ids, w.ids);
        assert_eq!(g.completion.finish_reason, w.finish_reason);
        let d = max_diff(&g.completion.logprobs, &w.logprobs);
        assert!(d < 1e-5, "max |Δ logprob| = {d}");
        assert_eq!(g.weight_version, 1);
    }
    // Sample 0 of a group of 8 is the sample of the prompt with G = 1.
    let mut alone = Scheduler::new(m.clone(), 1, EngineConfig::default());
    alone
        .submit(request(vec![prompts[0].clone()], 1, 20, 5))
        .unwrap();
    let one = run_all(&mut alone);
    assert_eq!(one[0].completion.ids, got[0].completion.ids);
    assert!(max_diff(&one[0].completion.logprobs, &got[0].completion.logprobs) < 1e-5);
}

#[test]
fn greedy_output_is_identical_batched_and_alone() {
    let m = model(2);
    let prompts: Vec<Vec<u32>> = (0..5).map(|k| prompt(k, 5 + 6 * k as usize)).collect();
    let greedy = |ps: Vec<Vec<u32>>, n| Request {
        sampling: SamplingParams::greedy(),
        ..request(ps, n, 16, 0)
    };
    let mut batched = Scheduler::new(m.clone(), 1, EngineConfig::default());
    batched.submit(greedy(prompts.clone(), 3)).unwrap();
    let batched = run_all(&mut batched);
    for (i, p) in prompts.iter().enumerate() {
        let mut alone = Scheduler::new(m.clone(), 1, EngineConfig::default());
        alone.submit(greedy(vec![p.clone()], 1)).unwrap();
        let alone = run_all(&mut alone);
        for j in 0..3 {
            assert_eq!(batched[i * 3 + j].completion.ids, alone[0].completion.ids);
        }
    }
}

#[test]
fn the_same_seed_reproduces_and_another_differs() {
    let m = model(3);
    let run = |seed| {
        let mut s = Scheduler::new(m.clone(), 1, EngineConfig::default());
        s.submit(request(vec![prompt(1, 10), prompt(2, 12)], 4, 12, seed))
            .unwrap();
        run_all(&mut s)
    };
    let (a, b, c) = (run(7), run(7), run(8));
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn a_finished_row_is_refilled_at_the_next_step_and_limits_hold() {
    let m = model(4);
    let cfg = EngineConfig {
        max_seqs: 4,
        max_kv_tokens: 10_000,
        ..EngineConfig::default()
    };
    let mut s = Scheduler::new(m.clone(), 1, cfg);
    // Different budgets: rows finish at different steps.
    s.submit(request(vec![prompt(1, 10)], 3, 5, 1)).unwrap();
    s.submit(request(vec![prompt(2, 14)], 3, 9, 2)).unwrap();
    s.submit(request(vec![prompt(3, 6)], 3, 13, 3)).unwrap();
    let mut steps = 0;
    while s.has_work() {
        let (_, stats) = s.step(true);
        steps += 1;
        assert!(s.live_rows() <= 4);
        if s.pending_samples() > 0 {
            // Work was still waiting after admission, so every row decoded.
            assert_eq!(
                stats.decode_rows, 4,
                "a free row idled while work was pending (step {steps})"
            );
        }
    }
    // 3·5 + 3·9 + 3·13 = 81 tokens over 4 rows: ~21 steps when no row idles.
    assert!(steps <= 24, "{steps} steps");

    // A KV-token bound that admits one sample at a time.
    let tight = EngineConfig {
        max_seqs: 8,
        max_kv_tokens: 10 + 6 + 6,
        ..EngineConfig::default()
    };
    let mut s = Scheduler::new(m.clone(), 1, tight);
    s.submit(request(vec![prompt(1, 10)], 4, 6, 1)).unwrap();
    while s.has_work() {
        s.step(true);
        assert!(s.reserved_kv_tokens() <= 22 && s.live_rows() <= 2);
    }
    // More than the bound can ever hold is refused up front.
    let err = s.submit(request(vec![prompt(1, 30)], 1, 6, 1)).unwrap_err();
    assert!(err.to_string().contains("KV tokens"), "{err}");
}

/// A run where `inject` makes steps of more than 5 rows fail as out of memory gives the
/// same samples as a clean run, with the row limit lowered.
fn recovers_from_injected_oom(inject: impl FnOnce(&mut Scheduler)) {
    let m = model(5);
    let prompts = vec![prompt(1, 9), prompt(2, 11)];
    let mut clean = Scheduler::new(m.clone(), 1, EngineConfig::default());
    clean.submit(request(prompts.clone(), 6, 10, 3)).unwrap();
    let want = run_all(&mut clean);

    let mut s = Scheduler::new(m.clone(), 1, EngineConfig::default());
    inject(&mut s);
    s.submit(request(prompts, 6, 10, 3)).unwrap();
    let got = run_all(&mut s);
    assert!(s.row_limit() <= 5, "row limit {}", s.row_limit());
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.completion.ids, w.completion.ids);
        assert!(max_diff(&g.completion.logprobs, &w.completion.logprobs) < 1e-5);
    }
}

#[test]
fn out_of_memory_halves_the_batch_and_the_output_is_unchanged() {
    recovers_from_injected_oom(|s| s.fail_above_rows = Some(5));
}

/// Sampling fails after the draws (as the device path's buffers are allocated): the step
/// is taken back, streams and cache, before the batch is halved.
#[test]
fn out_of_memory_while_sampling_takes_the_step_back_and_the_output_is_unchanged() {
    recovers_from_injected_oom(|s| s.fail_sampling_above_rows = Some(5));
}

/// What [`generate_through_a_swap`] ran and got.
struct ThroughASwap {
    old: Arc<Gpt2>,
    new: Arc<Gpt2>,
    prompts: Vec<Vec<u32>>,
    /// The samples in the order they finished.
    got: Vec<FinishedSample>,
    /// How many finished before the swap.
    finished_before: usize,
}

/// Generation of 4 samples of two prompts on `old` (version 1), `swap` called at step 14
/// with `new` (version 2) and giving back the model it retired (`old`).
fn generate_through_a_swap(
    swap: impl FnOnce(&mut Scheduler, Arc<Gpt2>) -> Arc<Gpt2>,
) -> ThroughASwap {
    let (old, new) = (model(6), model(7));
    let prompts = vec![prompt(1, 8), prompt(2, 12)];
    let mut s = Scheduler::new(
        old.clone(),
        1,
        EngineConfig {
            max_seqs: 5,
            ..EngineConfig::default()
        },
    );
    s.submit(request(prompts.clone(), 4, 12, 9)).unwrap();
    let (mut got, mut swap) = (Vec::new(), Some(swap));
    let mut swapped_after = None;
    for step in 0.. {
        if step == 14 {
            let retired = (swap.take().expect("one swap"))(&mut s, new.clone());
            assert!(Arc::ptr_eq(&retired, &old));
            swapped_after = Some(got.len());
        }
        let (events, _) = s.step(true);
        got.extend(events.into_iter().filter_map(|e| match e {
            Event::Sample(x) => Some(x),
            _ => None,
        }));
        if !s.has_work() {
            break;
        }
    }
    ThroughASwap {
        old,
        new,
        prompts,
        got,
        finished_before: swapped_after.expect("the swap came before the end"),
    }
}

#[test]
fn a_swap_mid_generation_restarts_work_on_the_new_weights_without_mixing() {
    let ThroughASwap {
        old,
        new,
        prompts,
        mut got,
        ..
    } = generate_through_a_swap(|s, new| s.set_model(new, 2));
    got.sort_by_key(|x| (x.prompt_index, x.sample_index));
    assert_eq!(got.len(), 8);
    let versions: std::collections::BTreeSet<u64> = got.iter().map(|x| x.weight_version).collect();
    assert_eq!(
        versions.len(),
        2,
        "some samples finished before the swap, some after"
    );
    let by_version = |m: &Gpt2| reference(m, &prompts, 4, 12, 9, sampling());
    let (want_old, want_new) = (by_version(&old), by_version(&new));
    for (k, x) in got.iter().enumerate() {
        let want = if x.weight_version == 1 {
            &want_old[k]
        } else {
            &want_new[k]
        };
        assert_eq!(
            &x.completion.ids, &want.ids,
            "sample {k} (version {})",
            x.weight_version
        );
        assert!(max_diff(&x.completion.logprobs, &want.logprobs) < 1e-5);
    }
}

/// An in-flight update (`continue_with`): nothing restarts. Samples finished before it
/// are the old weights' throughout; samples in flight keep their tokens so far (the old
/// weights' stream, token for token) and go on under the new ones, each token tagged with
/// the version that sampled it; a sample started later from a prompt the old weights
/// prefilled has its first token tagged old.
#[test]
fn an_in_flight_update_continues_every_sample_and_tags_each_token_with_its_version() {
    let ThroughASwap {
        old,
        prompts,
        got,
        finished_before,
        ..
    } = generate_through_a_swap(|s, new| s.continue_with(new, 2));
    assert!(finished_before > 0, "some samples finished before the swap");
    assert_eq!(got.len(), 8, "nothing restarted, nothing lost");
    let want_old = reference(&old, &prompts, 4, 12, 9, sampling());
    let mut mixed = 0;
    for (i, x) in got.iter().enumerate() {
        let k = (x.prompt_index * 4 + x.sample_index) as usize;
        let versions = if x.token_versions.is_empty() {
            vec![x.weight_version; x.completion.ids.len()]
        } else {
            x.token_versions.clone()
        };
        assert_eq!(versions.len(), x.completion.ids.len(), "{x:?}");
        assert!(versions.windows(2).all(|w| w[0] <= w[1]), "{x:?}");
        assert_eq!(x.weight_version, versions[0]);
        if i < finished_before {
            assert_eq!(versions, vec![1; versions.len()], "{x:?}");
            assert_eq!(x.completion.ids, want_old[k].ids, "sample {k}");
        }
        // The old weights' tokens are the old stream's, up to the swap.
        let old_part = versions.iter().filter(|&&v| v == 1).count();
        assert_eq!(
            x.completion.ids[..old_part],
            want_old[k].ids[..old_part],
            "sample {k}"
        );
        if versions.contains(&1) && versions.contains(&2) {
            mixed += 1;
            assert!(!x.token_versions.is_empty());
        }
    }
    assert!(
        mixed > 0,
        "some samples were in flight at the swap: {got:?}"
    );
}

#[test]
fn cancel_frees_everything_and_bad_requests_are_refused() {
    let m = model(8);
    let mut s = Scheduler::new(m.clone(), 1, EngineConfig::default());
    let id = s
        .submit(request(vec![prompt(1, 10), prompt(2, 20)], 4, 50, 1))
        .unwrap();
    s.step(true);
    s.step(true);
    assert!(s.live_rows() > 0);
    s.cancel(id).unwrap();
    assert!(!s.has_work());
    assert_eq!(
        (s.live_rows(), s.reserved_kv_tokens(), s.pending_samples()),
        (0, 0, 0)
    );

    let mut refused = |r: Request| s.submit(r).unwrap_err().to_string();
    assert!(refused(request(vec![], 1, 5, 0)).contains("no prompts"));
    assert!(refused(request(vec![vec![]], 1, 5, 0)).contains("empty prompt"));
    assert!(refused(request(vec![vec![60_000]], 1, 5, 0)).contains("vocabulary"));
    assert!(refused(request(vec![prompt(1, 300)], 1, 5, 0)).contains("context"));
    assert!(refused(request(vec![prompt(1, 3)], 0, 5, 0)).contains("at least 1"));
    let mut bad = request(vec![prompt(1, 3)], 1, 5, 0);
    bad.sampling.top_p = 0.0;
    assert!(refused(bad).contains("top-p"));
    assert!(!s.has_work());
}

#[test]
fn with_packed_weights_a_completion_is_bit_identical_shared_or_alone() {
    use rookworld_lm::cpu_gemm::TestFeature;
    let mut packed = (*model(9)).clone();
    if !packed.pack_for_cpu().unwrap() {
        // Nothing is packed without AVX2/FMA (a failure where ROOKWORLD_REQUIRE_AVX2 is set).
        assert!(!TestFeature::Avx2.test_runs("the packed scheduler"));
        return;
    }
    let m = Arc::new(packed);
    let prompts = vec![prompt(1, 21), prompt(2, 9), prompt(3, 33)];
    let mut shared = Scheduler::new(m.clone(), 1, EngineConfig::default());
    shared.submit(request(prompts.clone(), 8, 24, 2)).unwrap();
    let shared = run_all(&mut shared);
    for (i, p) in prompts.iter().enumerate() {
        // The prompt with G = 1 and no other prompt of its length: its sample 0. (It sits
        // at index i, behind short placeholders, so that it draws from the same stream.)
        let mut alone = Scheduler::new(m.clone(), 1, EngineConfig::default());
        let mut ps = vec![prompt(99, 3); i];
        ps.push(p.clone());
        alone.submit(request(ps, 1, 24, 2)).unwrap();
        let alone = run_all(&mut alone);
        let a = &alone[i].completion;
        let s = &shared[i * 8].completion;
        assert_eq!(a.ids, s.ids, "prompt {i}");
        assert_eq!(
            a.logprobs, s.logprobs,
            "prompt {i}: log-probs differ in the last bits"
        );
    }
}
