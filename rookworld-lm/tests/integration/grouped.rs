//! The grouped decode cache: rows that share their prompt's cache, join late, leave in any
//! order and outlive buffer moves compute what each sequence computes alone.

use candle_core::{DType, Device, Tensor};
use rookworld_lm::model_io::init_random;
use rookworld_lm::{Config, Gpt2, GroupedCache, LeftPadding};

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7919 + seed * 104_729) % 50257)
        .collect()
}

/// Next-token logits after `seq`, from one plain forward of the whole sequence.
fn alone(m: &Gpt2, seq: &[u32]) -> Vec<f32> {
    let input = Tensor::new(seq, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    m.forward_last(&input, &LeftPadding::none(1), &mut m.new_cache())
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Prefills `prompts` together (left-padded) into new groups of `cache`.
fn prefill(m: &Gpt2, cache: &mut GroupedCache, prompts: &[Vec<u32>]) -> usize {
    let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let padding = LeftPadding::for_lengths(&lengths);
    let longest = *lengths.iter().max().unwrap();
    let mut flat = Vec::new();
    for p in prompts {
        flat.extend(std::iter::repeat_n(0u32, longest - p.len()));
        flat.extend(p);
    }
    let ids = Tensor::from_vec(flat, (prompts.len(), longest), &Device::Cpu).unwrap();
    let mut kv = m.new_cache();
    m.forward_last(&ids, &padding, &mut kv).unwrap();
    cache.add_groups(&kv, &padding).unwrap()
}

struct Live {
    seq: Vec<u32>,
    fed: usize,
    budget: usize,
}

/// Which decode path a check runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    /// The in-place CPU attention kernel.
    CpuKernel,
    /// The tensor path (batched matmuls over the prefix pool).
    Tensors,
    /// The fused decode ops CUDA runs (q/k/v split into the cache, bias + GELU, residual +
    /// layer norm), on the CPU.
    DecodeOps,
}

/// Every decode path: the in-place CPU kernel, the tensor path, and the fused ops.
#[test]
fn rows_sharing_prompts_joining_and_leaving_match_each_sequence_alone() {
    for path in [Path::CpuKernel, Path::Tensors, Path::DecodeOps] {
        check_against_alone(path);
    }
}

fn check_against_alone(path: Path) {
    // The fused ops want a head dim that is a multiple of 32, as the CUDA kernel does.
    let cfg = Config {
        n_head: 2,
        ..Config::tiny()
    };
    let m = init_random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let mut cache = GroupedCache::new(m.config().n_layer);
    cache = match path {
        Path::CpuKernel => cache,
        Path::Tensors => cache.without_cpu_kernel(),
        Path::DecodeOps => cache.with_decode_ops(),
    };
    let mut prompts: Vec<Vec<u32>> = vec![tokens(1, 9), tokens(2, 4), tokens(3, 13)];
    prefill(&m, &mut cache, &prompts);
    // (group, tokens it will feed): lengths differ so rows leave at different steps.
    let plan = [
        (0, 5),
        (0, 70),
        (1, 3),
        (2, 90),
        (0, 12),
        (1, 40),
        (2, 30),
        (2, 31),
        (0, 33),
        (2, 8),
    ];
    let mut live: Vec<Live> = Vec::new();
    let mut checked = 0;
    for step in 0..100 {
        // Rows join at different steps; one new prompt arrives (longer than the pool).
        if step < plan.len() {
            let (g, budget) = plan[step];
            cache.add_row(g);
            live.push(Live {
                seq: prompts[g].clone(),
                fed: 0,
                budget,
            });
        }
        if step == 12 {
            let g = prefill(&m, &mut cache, &[tokens(4, 20)]);
            assert_eq!(g, 3);
            prompts.push(tokens(4, 20));
            cache.add_row(3);
            live.push(Live {
                seq: prompts[3].clone(),
                fed: 0,
                budget: 60,
            });
        }
        if live.is_empty() {
            break;
        }
        let ids: Vec<u32> = live
            .iter()
            .map(|l| tokens(100 + l.seq.len() as u32, 1)[0])
            .collect();
        for (l, &id) in live.iter_mut().zip(&ids) {
            l.seq.push(id);
            l.fed += 1;
        }
        let logits = m
            .decode_grouped(&ids, &mut cache)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (l, row) in live.iter().zip(&logits) {
            let want = alone(&m, &l.seq);
            let d = want
                .iter()
                .zip(row)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-4, "{path:?}, step {step}: max |Δ| = {d}");
            checked += 1;
        }
        // Finished rows leave (swap-remove, as the engine does).
        let mut r = 0;
        while r < live.len() {
            if live[r].fed == live[r].budget {
                cache.swap_remove_row(r).unwrap();
                live.swap_remove(r);
            } else {
                r += 1;
            }
        }
        // Groups with no live row are dropped (group 1 after its two rows finish).
        let mut keep = vec![false; cache.groups()];
        for r in 0..cache.rows() {
            keep[cache.row_group(r)] = true;
        }
        if step > plan.len() && keep.iter().any(|k| !k) {
            let remap = cache.retain_groups(&keep).unwrap();
            prompts = prompts
                .iter()
                .enumerate()
                .filter(|(g, _)| remap[*g].is_some())
                .map(|(_, p)| p.clone())
                .collect();
        }
    }
    assert!(live.is_empty());
    assert_eq!(checked, 5 + 70 + 3 + 90 + 12 + 40 + 30 + 31 + 33 + 8 + 60);
}

/// Feeds one token to every live row of `cache` (`live[r]` row r's sequence) and checks
/// each row's logits against its sequence computed alone.
fn step_and_check(m: &Gpt2, cache: &mut GroupedCache, live: &mut [Vec<u32>]) {
    let ids: Vec<u32> = live
        .iter()
        .map(|seq| tokens(100 + seq.len() as u32, 1)[0])
        .collect();
    for (seq, &id) in live.iter_mut().zip(&ids) {
        seq.push(id);
    }
    let logits = m
        .decode_grouped(&ids, cache)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for (seq, row) in live.iter().zip(&logits) {
        let d = alone(m, seq)
            .iter()
            .zip(row)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d < 1e-4, "max |Δ| = {d}");
    }
}

/// While the groups, the prompts, the rows and the window fit the buffers, groups and
/// rows joining and leaving move none of them (what a captured decode step relies on);
/// outgrowing one rebuilds it, and every row still computes what it computes alone.
#[test]
fn buffers_stay_put_while_the_work_fits_them() {
    let cfg = Config {
        n_head: 2,
        ..Config::tiny()
    };
    let m = init_random(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
    let mut cache = GroupedCache::new(cfg.n_layer).with_decode_ops();
    let mut prompts = vec![tokens(1, 9), tokens(2, 4)];
    prefill(&m, &mut cache, &prompts); // the pool: 4 groups of 32 columns
    assert_eq!(cache.rebuilds(), 1);
    let mut live = vec![prompts[0].clone(), prompts[1].clone()];
    cache.add_row(0);
    cache.add_row(1);
    step_and_check(&m, &mut cache, &mut live); // the suffix: 8 rows of 64 columns
    let made = cache.rebuilds();
    assert_eq!(made, 2);

    // Two more groups (one prompt of the pool's full 32 columns) and rows up to 8, rows
    // leaving, a group dropped and the later ones moving down: nothing moves.
    for p in [tokens(3, 32), tokens(4, 5)] {
        let g = prefill(&m, &mut cache, std::slice::from_ref(&p));
        prompts.push(p);
        cache.add_row(g);
        live.push(prompts[g].clone());
    }
    for g in [0, 2, 3, 3] {
        cache.add_row(g);
        live.push(prompts[g].clone());
    }
    assert_eq!(cache.rows(), 8);
    for _ in 0..5 {
        step_and_check(&m, &mut cache, &mut live);
    }
    // Group 1's only row (row 1) leaves, then the group.
    cache.swap_remove_row(1).unwrap();
    live.swap_remove(1);
    let remap = cache.retain_groups(&[true, false, true, true]).unwrap();
    assert_eq!(remap, [Some(0), None, Some(1), Some(2)]);
    prompts.remove(1);
    for _ in 0..5 {
        step_and_check(&m, &mut cache, &mut live);
    }
    assert_eq!(cache.rebuilds(), made, "nothing outgrew the buffers");

    // Two new groups outgrow the pool's 4 slots; a ninth row the suffix's 8 rows.
    let g = prefill(&m, &mut cache, &[tokens(5, 7), tokens(6, 11)]);
    assert_eq!(g, 3);
    assert_eq!(cache.rebuilds(), made + 1);
    prompts.extend([tokens(5, 7), tokens(6, 11)]);
    for g in [3, 4] {
        cache.add_row(g);
        live.push(prompts[g].clone());
    }
    step_and_check(&m, &mut cache, &mut live);
    assert_eq!(cache.rebuilds(), made + 2);
    // The window outgrows the suffix's 64 columns: rebuilt once more, then steady.
    for _ in 0..60 {
        step_and_check(&m, &mut cache, &mut live);
    }
    assert_eq!(cache.rebuilds(), made + 3);
}
