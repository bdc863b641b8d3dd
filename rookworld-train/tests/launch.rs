//! The CUDA backend's launch decisions ([`rookworld_train::launch`]) over every shape the
//! product, its presets and its checks use: each has a kernel, each grid keeps the
//! device's limits and covers its work, or — the `tiny` preset's heads of 16 — the shape is
//! refused before anything runs, naming its width. A shape without a kernel fails here,
//! not on a GPU.

use rookworld_lm::config::Config;
use rookworld_train::compare::{SELF_CHECK_BATCHES, self_check_config};
use rookworld_train::gemm::EpilogueKind;
use rookworld_train::launch::{
    self, ATTENTION_WIDTHS, AttentionForm, MMA_WIDTHS, Part, TILE, TILE_WIDTHS,
};
use rookworld_train::packed::synthetic;
use rookworld_train::pass::linear_products;
use rookworld_train::{Heads, Packed};

fn heads(cfg: &Config) -> Heads {
    Heads {
        e: cfg.n_embd,
        h: cfg.n_head,
    }
}

/// A micro-batch of `groups` groups of `g` completions, `prompt` + `completion` tokens.
fn batch(
    cfg: &Config,
    (groups, g): (usize, usize),
    (prompt, completion): (usize, usize),
) -> Packed {
    let (prompts, completions) = synthetic((groups, g), (prompt, completion), cfg.vocab_size, 1);
    Packed::of(&prompts, &completions)
}

/// Every launch the CUDA backend makes for one micro-batch of `cfg`, checked: a kernel for
/// each part of the attention (tiled and not), grids within the device's limits that cover
/// their rows, the head's blocks and kept chunks within the kernels' `int`.
fn every_launch(cfg: &Config, packed: &Packed) {
    let (r, n) = (packed.rows(), packed.targets.len());
    let (e, v, i) = (cfg.n_embd, cfg.vocab_size, cfg.inner_dim());
    let h = heads(cfg);
    let what = format!("{} with {r} rows", cfg.shape());
    for part in Part::ALL {
        let (name, grid) = launch::attention(h, part, r).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(name.ends_with(&format!("_d{}", h.d())), "{what}: {name}");
        assert!(
            grid.threads() >= (r * h.h * 32) as u64,
            "{what}: {name}'s grid {grid:?} misses warps"
        );
        let tiles = packed.row_tiles(TILE);
        match launch::tiled_attention(h, part, tiles.len()) {
            Some((name, grid)) => {
                assert!(TILE_WIDTHS.contains(&h.d()), "{what}: {name}");
                assert_eq!(grid.grid.0 as usize, tiles.len(), "{what}: {name}");
                assert_eq!(grid.grid.1 as usize, h.h, "{what}: {name}");
            }
            None => assert!(!TILE_WIDTHS.contains(&h.d()), "{what}: no tiled kernel"),
        }
        match launch::mma_attention(h, part, tiles.len()) {
            Some((name, grid)) => {
                assert!(MMA_WIDTHS.contains(&h.d()), "{what}: {name}");
                assert!(name.ends_with(&format!("_d{}", h.d())), "{what}: {name}");
                assert_eq!(grid.grid.0 as usize, tiles.len(), "{what}: {name}");
                assert_eq!(grid.grid.1 as usize, h.h, "{what}: {name}");
                assert_eq!(grid.block.0, launch::MMA_THREADS, "{what}: {name}");
            }
            None => assert!(
                !MMA_WIDTHS.contains(&h.d()),
                "{what}: no tensor-core kernel"
            ),
        }
        // Each form asked for runs where it has the width, else the next one down.
        for form in [
            AttentionForm::Warp,
            AttentionForm::Tiles,
            AttentionForm::Mma,
        ] {
            let (name, _, got) = launch::attention_kernel(h, part, r, tiles.len(), form)
                .unwrap_or_else(|e| panic!("{what}, {form:?}: {e}"));
            let want = if form == AttentionForm::Mma && MMA_WIDTHS.contains(&h.d()) {
                AttentionForm::Mma
            } else if form != AttentionForm::Warp && TILE_WIDTHS.contains(&h.d()) {
                AttentionForm::Tiles
            } else {
                AttentionForm::Warp
            };
            assert_eq!(got, want, "{what}: {form:?} ran {name}");
        }
    }
    // The element-wise kernels over every activation the pass writes.
    for len in [r * e, r * 3 * e, r * i, n * e, e, 3 * e, i] {
        let grid = launch::elementwise("test", len).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(grid.block.0 as usize * grid.grid.0 as usize >= len.min(256 << 16));
    }
    launch::warps("layer_norm", r).unwrap_or_else(|e| panic!("{what}: {e}"));
    let (grid, k) = launch::layer_norm_partials(r).unwrap();
    assert!(
        k * launch::LN_CHUNK >= r && grid.grid.0 as usize == k.max(1),
        "{what}"
    );
    for cols in [e, 3 * e, i] {
        let (grid, k) = launch::column_partials(r, cols).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(k * launch::SUM_ROWS >= r, "{what}");
        assert!(
            grid.grid.0 as usize * grid.block.0 as usize >= cols,
            "{what}"
        );
    }
    // The linear layers' products with the epilogues the pass gives them: each passes its
    // checks against buffers of the pass's sizes, and cuBLASLt's leading-dimension rule
    // holds, so that `step_epilogues` runs every one inside its product. Every forward
    // adds its bias and every weight's gradient sums its bias's; the MLP's up-projection
    // (e → i) applies GELU, and the gradient into its output (from the down-projection,
    // i → e) GELU's derivative.
    for (k, n) in [(e, 3 * e), (e, e), (e, i), (i, e)] {
        let [fwd, dgrad, wgrad] = linear_products((r, k, n));
        let mut checks = vec![
            (fwd, EpilogueKind::Bias, (k * n, r * n), (n, 0)),
            (wgrad, EpilogueKind::BiasGrad, (r * n, k * n), (n, 0)),
        ];
        if (k, n) == (e, i) {
            checks.push((fwd, EpilogueKind::BiasGelu, (k * n, r * n), (n, r * n)));
        }
        if (k, n) == (i, e) {
            checks.push((dgrad, EpilogueKind::Dgelu, (k * n, r * k), (0, r * k)));
        }
        for (g, kind, (a, c), extra) in checks {
            let at = format!("{what}: the {k}×{n} linear's {}", kind.name());
            g.check_epilogue(kind, (a, c), extra)
                .unwrap_or_else(|e| panic!("{at}: {e}"));
            assert!(g.lt_serves(kind), "{at}: cuBLASLt cannot serve it");
        }
    }
    // The head: blocks of recomputed logits and kept chunks, each within an int.
    for rows in [launch::head_block(v, n), launch::keep_rows(v).min(n.max(1))] {
        assert!((1..=n.max(1)).contains(&rows), "{what}: {rows} head rows");
        launch::int("head", rows * launch::head_ld(v)).unwrap_or_else(|e| panic!("{what}: {e}"));
        launch::per_row(rows).unwrap_or_else(|e| panic!("{what}: {e}"));
        launch::elementwise("head", rows * v).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

#[test]
fn the_start_up_check_runs_a_shape_every_kernel_serves() {
    for d in ATTENTION_WIDTHS {
        let cfg = self_check_config(d);
        assert_eq!(cfg.head_dim(), d);
        launch::serves(heads(&cfg)).unwrap();
        // The check's micro-batches.
        for (groups, lens) in SELF_CHECK_BATCHES {
            every_launch(&cfg, &batch(&cfg, groups, lens));
        }
    }
}

#[test]
fn the_gpt2_shape_has_every_kernel_at_the_benches_and_the_checks_sizes() {
    let cfg = Config::preset("gpt2-124m").unwrap();
    launch::serves(heads(&cfg)).unwrap();
    // The learner's bench (4 × 8 × (46 + 64)), the GPU check's step (32 × 8 × (46 + 64)),
    // one micro-batch of eight groups, and a group at the full context.
    for (groups, lens) in [
        ((4, 8), (46, 64)),
        ((32, 8), (46, 64)),
        ((8, 8), (46, 64)),
        ((1, 16), (512, 512)),
    ] {
        every_launch(&cfg, &batch(&cfg, groups, lens));
    }
}

#[test]
fn heads_without_a_kernel_are_refused_naming_their_width() {
    // The `tiny` preset: 4 heads of 16.
    let tiny = Config::preset("tiny").unwrap();
    let err = launch::serves(heads(&tiny)).unwrap_err().to_string();
    assert!(
        err.contains("width 16") && err.contains("[32, 64, 128]"),
        "{err}"
    );
    assert!(launch::attention(heads(&tiny), Part::Fwd, 10).is_err());
    assert!(launch::tiled_attention(heads(&tiny), Part::Fwd, 1).is_none());
    // The tensor cores' kernels have heads of 16; the tiles asked for fall to the warp
    // kernels, which refuse them.
    for part in Part::ALL {
        let (name, _, form) =
            launch::attention_kernel(heads(&tiny), part, 10, 1, AttentionForm::Mma).unwrap();
        assert_eq!(form, AttentionForm::Mma, "{name}");
        assert!(name.ends_with("_d16"), "{name}");
    }
    assert!(
        launch::attention_kernel(heads(&tiny), Part::Fwd, 10, 1, AttentionForm::Tiles).is_err()
    );
    // Heads that do not divide the width, and widths between the kernels'.
    for (e, h) in [(64, 3), (64, 0), (96, 1), (256, 1)] {
        let err = launch::serves(Heads { e, h }).unwrap_err().to_string();
        assert!(err.contains("attention"), "{err}");
    }
    // Heads of 128: the warp kernels, no tiled one and none on tensor cores.
    let wide = Heads { e: 256, h: 2 };
    assert!(launch::attention(wide, Part::Dkv, 10).is_ok());
    assert!(launch::tiled_attention(wide, Part::Dkv, 1).is_none());
    assert!(launch::mma_attention(wide, Part::Dkv, 1).is_none());
    let (_, _, form) =
        launch::attention_kernel(wide, Part::Dkv, 10, 1, AttentionForm::Mma).unwrap();
    assert_eq!(form, AttentionForm::Warp);
    assert!(launch::mma_attention(Heads { e: 64, h: 3 }, Part::Fwd, 1).is_none());
}

#[test]
fn grids_past_the_devices_limits_are_errors_not_truncations() {
    // A warp per (row, head) whose thread index passes an int.
    let err = launch::warps("attention", 1 << 26).unwrap_err().to_string();
    assert!(err.contains("int"), "{err}");
    // Partial sums of more than 65,535 blocks of rows along the grid's y axis.
    assert!(launch::column_partials(70_000 * launch::SUM_ROWS, 1).is_err());
    // The grid-stride launch caps its blocks instead of failing.
    let g = launch::elementwise("add", 1 << 30).unwrap();
    assert_eq!(g.grid.0, 1 << 16);
    // An empty launch still has one block (the backends return before launching it).
    assert_eq!(launch::per_row(0).unwrap().grid.0, 1);
}

/// The launch constants are the `#define`s of `kernels/pass.cu` that fix a launch's shape.
#[test]
fn the_launch_constants_are_the_kernels_defines() {
    let source = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/pass.cu"),
    )
    .unwrap();
    let define = |name: &str| -> usize {
        let line = source
            .lines()
            .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
            .unwrap_or_else(|| panic!("kernels/pass.cu defines no {name}"));
        line.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    assert_eq!(define("ROWS_PER_BLOCK"), launch::ROWS_PER_BLOCK as usize);
    assert_eq!(define("SUM_ROWS"), launch::SUM_ROWS);
    assert_eq!(define("LN_CHUNK"), launch::LN_CHUNK);
    assert_eq!(define("HEAD_THREADS"), launch::HEAD_THREADS as usize);
    assert_eq!(define("TILE"), TILE);
    assert_eq!(define("TILE_THREADS"), launch::TILE_THREADS as usize);
    assert_eq!(define("MMA_THREADS"), launch::MMA_THREADS as usize);
    for d in MMA_WIDTHS {
        assert!(
            source.contains(&format!("MMA_KERNELS({d})")),
            "no kernels of width {d}"
        );
    }
    for d in TILE_WIDTHS {
        assert!(
            source.contains(&format!("TILE_KERNELS({d})")),
            "no kernels of width {d}"
        );
    }
}

/// The head's rows on the device are padded to whole lines: every row of f32 starts
/// 256-byte aligned, and the padding is what the vocabulary lacks of the next multiple.
#[test]
fn the_heads_rows_are_padded_to_aligned_rows() {
    assert_eq!(launch::head_ld(50_257), 50_304);
    for v in [1, 63, 64, 65, 1000, 50_257, 50_304] {
        let ld = launch::head_ld(v);
        assert!(ld >= v && ld - v < launch::HEAD_ROW_ALIGN, "{v} -> {ld}");
        assert_eq!((ld * 4) % 256, 0, "{v} -> {ld}");
    }
    // A kept chunk is fitted to, and recognised by, its padded rows.
    assert_eq!(launch::head_rows_len(3, 50_257), 3 * 50_304);
    // The blocks and kept chunks count padded rows against their budgets.
    let v = 50_257;
    assert_eq!(launch::keep_rows(v), launch::HEAD_KEEP_ELEMENTS / 50_304);
    assert!(launch::head_block(v, 1 << 20) * launch::head_ld(v) <= launch::HEAD_BLOCK_ELEMENTS);
}
