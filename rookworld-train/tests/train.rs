//! The pass with its objective between the head's forward and backward
//! ([`rookworld_train::train`]) against the forward, then the backward of the same
//! upstream gradients: the same log-probs, entropies and gradients, however the head's
//! rows are chunked; chunks are runs of whole completions within the backend's bound.

use std::ops::Range;

use rookworld_lm::config::Config;
use rookworld_train::compare::{self, Tolerance};
use rookworld_train::cpu::Cpu;
use rookworld_train::cpu::ops::Matmuls;
use rookworld_train::{Activations, Error, Packed, Weights, weights};

fn config(tied: bool) -> Config {
    Config {
        vocab_size: 97,
        tie_word_embeddings: tied,
        ..Config::tiny()
    }
}

/// Three groups with completions of several lengths (one of a single token).
fn packed() -> Packed {
    let prompts = vec![vec![3, 14, 15, 92, 65], vec![35, 89, 79], vec![7, 1]];
    let completions = vec![
        vec![vec![32, 38, 46], vec![26, 43], vec![38, 32, 79, 50]],
        vec![vec![2, 88], vec![41, 96, 69, 39, 93]],
        vec![vec![5], vec![11, 12, 13, 14, 15, 16, 17], vec![60, 61]],
    ];
    Packed::of(&prompts, &completions)
}

/// Upstream gradients of every predicted token.
fn upstream(n: usize) -> Vec<f32> {
    (0..n).map(|i| 0.5 * ((i as f32 * 0.77).sin())).collect()
}

struct Run {
    logp: Vec<f32>,
    entropy: Vec<f32>,
    grads: Vec<Vec<f32>>,
    spans: Vec<Range<usize>>,
}

fn forward_then_backward(cpu: &Cpu, cfg: &Config, params: &[Vec<f32>], packed: &Packed) -> Run {
    let w = Weights::<Cpu>::new(cfg, params.iter().map(|p| p.as_slice()).collect()).unwrap();
    let mut acts = Activations::<Cpu>::default();
    let mut grads = compare::zeros(cpu, &weights::lengths(cfg)).unwrap();
    let logp = rookworld_train::forward(cpu, &w, packed, 0.9, &mut acts, true).unwrap();
    let dlogp = upstream(packed.targets.len());
    rookworld_train::backward(cpu, &w, packed, &mut acts, &dlogp, 0.9, &mut grads).unwrap();
    Run {
        logp,
        entropy: acts.entropy().to_vec(),
        grads,
        spans: Vec::new(),
    }
}

fn trained(cpu: &Cpu, cfg: &Config, params: &[Vec<f32>], packed: &Packed) -> Run {
    let w = Weights::<Cpu>::new(cfg, params.iter().map(|p| p.as_slice()).collect()).unwrap();
    let mut acts = Activations::<Cpu>::default();
    let mut grads = compare::zeros(cpu, &weights::lengths(cfg)).unwrap();
    let dlogp = upstream(packed.targets.len());
    let mut spans = Vec::new();
    let out = rookworld_train::train(cpu, &w, packed, 0.9, (&mut acts, &mut grads), |span, lp| {
        assert_eq!(lp.len(), span.len());
        spans.push(span.clone());
        Ok(dlogp[span].to_vec())
    })
    .unwrap();
    Run {
        logp: out.logp,
        entropy: acts.entropy().to_vec(),
        grads,
        spans,
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: Tolerance) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = tol.atol + tol.rtol * scale;
        assert!((g - w).abs() <= bound, "{what}[{i}]: {g} against {w}");
    }
}

#[test]
fn chunked_training_equals_the_forward_then_the_backward() {
    let tol = Tolerance {
        atol: 1e-7,
        rtol: 1e-5,
    };
    for tied in [true, false] {
        let cfg = config(tied);
        let params = weights::synthetic(&cfg, 3);
        let packed = packed();
        let n = packed.targets.len();
        let want = forward_then_backward(&Cpu::new(Matmuls::F32), &cfg, &params, &packed);
        // One chunk of every row, chunks of a few completions, one completion a chunk
        // (the 7-token one beyond the bound of 6 rows).
        for rows in [None, Some(9), Some(6), Some(1)] {
            let cpu = match rows {
                Some(r) => Cpu::new(Matmuls::F32).with_head_keep_rows(r),
                None => Cpu::new(Matmuls::F32),
            };
            let got = trained(&cpu, &cfg, &params, &packed);
            let label = format!("tied {tied}, rows {rows:?}");
            assert_close(&format!("{label}: logp"), &got.logp, &want.logp, tol);
            assert_close(
                &format!("{label}: entropy"),
                &got.entropy,
                &want.entropy,
                tol,
            );
            for (i, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
                let name = weights::name(&cfg, i);
                assert_close(&format!("{label}: ∂ {name}"), g, w, tol);
            }
            // The spans tile the tokens, each a run of whole completions within the bound
            // unless it is one completion.
            assert_eq!(got.spans.first().map(|s| s.start), Some(0), "{label}");
            assert_eq!(got.spans.last().map(|s| s.end), Some(n), "{label}");
            assert!(got.spans.windows(2).all(|w| w[0].end == w[1].start));
            for s in &got.spans {
                let whole = packed
                    .tokens
                    .iter()
                    .filter(|t| t.start >= s.start && t.end <= s.end);
                assert_eq!(
                    whole.map(|t| t.len()).sum::<usize>(),
                    s.len(),
                    "{label}: {s:?}"
                );
                let single = packed.tokens.contains(s);
                assert!(
                    rows.is_none_or(|r| s.len() <= r) || single,
                    "{label}: {s:?}"
                );
            }
            let chunks = got.spans.len();
            match rows {
                None => assert_eq!(chunks, 1),
                Some(1) => assert_eq!(chunks, packed.tokens.len()),
                Some(_) => assert!(chunks > 1 && chunks < packed.tokens.len(), "{label}"),
            }
        }
    }
}

#[test]
fn an_objective_that_fails_or_miscounts_is_an_error_not_a_panic() {
    let cfg = config(false);
    let params = weights::synthetic(&cfg, 3);
    let packed = packed();
    let cpu = Cpu::new(Matmuls::F32);
    let w = Weights::<Cpu>::new(&cfg, params.iter().map(|p| p.as_slice()).collect()).unwrap();
    let mut acts = Activations::<Cpu>::default();
    let mut grads = compare::zeros(&cpu, &weights::lengths(&cfg)).unwrap();
    let failed = rookworld_train::train(&cpu, &w, &packed, 1.0, (&mut acts, &mut grads), |_, _| {
        Err(Error::Objective("no advantages".into()))
    })
    .unwrap_err();
    assert_eq!(failed.to_string(), "the objective: no advantages");
    let short = rookworld_train::train(&cpu, &w, &packed, 1.0, (&mut acts, &mut grads), |_, _| {
        Ok(vec![0.0])
    })
    .unwrap_err();
    assert!(
        short
            .to_string()
            .starts_with("the objective gave 1 gradients for "),
        "{short}"
    );
}
