//! The debug mode on two real backends: the CPU backend against itself (every buffer
//! equal), with BF16 products against f32 (within the mixed-precision tolerance, and
//! beyond the f32 one), and against a backend with one wrong kernel (named by the first
//! buffer it writes).

use rookworld_lm::config::Config;
use rookworld_train::backend::{Backend, Epilogue, HeadBackward, HeadForward, Heads, Result};
use rookworld_train::compare::{self, Side, Tolerance};
use rookworld_train::cpu::Cpu;
use rookworld_train::cpu::ops::Matmuls;
use rookworld_train::gemm::Gemm;
use rookworld_train::{Activations, Packed, Weights, weights};

fn config(tied: bool) -> Config {
    Config {
        vocab_size: 97,
        tie_word_embeddings: tied,
        ..Config::tiny()
    }
}

/// Deterministic values in [−scale, scale].
fn values(len: usize, salt: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|i| scale * (((i * 7919 + salt * 104729) as f32 * 0.618).sin()))
        .collect()
}

/// Two groups: prompts of 5 and 3 tokens, completions of several lengths.
fn batch() -> (Vec<Vec<u32>>, Vec<Vec<Vec<u32>>>) {
    let prompts = vec![vec![3, 14, 15, 92, 65], vec![35, 89, 79]];
    let completions = vec![
        vec![vec![32, 38, 46], vec![26, 43], vec![38, 32, 79, 50]],
        vec![vec![2, 88], vec![41, 97 - 1, 69, 39, 93]],
    ];
    (prompts, completions)
}

/// Runs the comparison of `left` against the f32 CPU backend.
fn compare_with<L: Backend<Buf = [f32]>>(
    left: &L,
    tied: bool,
    tol: Tolerance,
) -> compare::Comparison {
    let cfg = config(tied);
    let params = weights::synthetic(&cfg, 7);
    let (prompts, completions) = batch();
    let packed = Packed::of(&prompts, &completions);
    let right = Cpu::new(Matmuls::F32);
    let lw = Weights::<L>::new(&cfg, params.iter().map(|p| p.as_slice()).collect()).unwrap();
    let rw = Weights::<Cpu>::new(&cfg, params.iter().map(|p| p.as_slice()).collect()).unwrap();
    let (mut la, mut ra) = (Activations::<L>::default(), Activations::<Cpu>::default());
    let lengths = weights::lengths(&cfg);
    let mut lg = compare::zeros(left, &lengths).unwrap();
    let mut rg = compare::zeros(&right, &lengths).unwrap();
    let dlogp: Vec<f32> = values(packed.targets.len(), 99, 0.5);
    compare::step(
        Side {
            backend: left,
            weights: &lw,
            acts: &mut la,
            grads: &mut lg,
        },
        Side {
            backend: &right,
            weights: &rw,
            acts: &mut ra,
            grads: &mut rg,
        },
        &packed,
        0.9,
        Some(&dlogp),
        tol,
    )
    .unwrap()
}

#[test]
fn two_f32_cpu_backends_agree_on_every_buffer() {
    for tied in [true, false] {
        let cmp = compare_with(
            &Cpu::new(Matmuls::F32),
            tied,
            Tolerance {
                atol: 0.0,
                rtol: 0.0,
            },
        );
        let cfg = config(tied);
        // 10 buffers a block, 7 after the blocks, every parameter's gradient and ∂ of the
        // embedding's output.
        let want = 10 * cfg.n_layer + 7 + weights::count(&cfg) + 1;
        assert_eq!(cmp.checked.len(), want, "{:?}", cmp.skipped);
        assert!(cmp.skipped.is_empty());
        assert_eq!(cmp.first_divergence(), None, "{}", cmp.summary());
        assert!(
            cmp.summary().ends_with("buffers match"),
            "{}",
            cmp.summary()
        );
        // The comparison saw real values, not zeros.
        let grad = cmp
            .checked
            .iter()
            .find(|c| c.name == "∂ transformer.wpe.weight")
            .unwrap();
        assert!(grad.scale > 0.0);
    }
}

#[test]
fn bf16_products_stay_within_the_mixed_precision_tolerance_and_not_the_f32_one() {
    let cmp = compare_with(&Cpu::new(Matmuls::Bf16), false, Tolerance::BF16);
    assert_eq!(cmp.first_divergence(), None, "{}", cmp.summary());
    let strict = compare_with(&Cpu::new(Matmuls::Bf16), false, Tolerance::F32);
    let first = strict
        .first_divergence()
        .expect("BF16 operands differ from f32");
    // The embedding and the first layer norm have no products: the first difference is
    // the first product's output.
    assert_eq!(
        first.name,
        "block 0: c_attn output (q, k, v)",
        "{}",
        strict.summary()
    );
}

/// The CPU backend with one kernel wrong: its output off by 1% of the largest value.
struct Faulty {
    cpu: Cpu,
    broken: &'static str,
}

impl Faulty {
    fn spoil(&self, op: &str, out: &mut [f32]) {
        if op == self.broken {
            let scale = out.iter().fold(0f32, |m, v| m.max(v.abs()));
            if let Some(x) = out.get_mut(out.len() / 2) {
                *x += 0.01 * scale.max(1.0);
            }
        }
    }
}

impl Backend for Faulty {
    type Buf = [f32];
    type Owned = Vec<f32>;
    type Rows<'a> = &'a Packed;

    fn name(&self) -> &'static str {
        "faulty"
    }
    fn fit(&self, buf: &mut Vec<f32>, len: usize) -> Result<()> {
        self.cpu.fit(buf, len)
    }
    fn len(&self, buf: &[f32]) -> usize {
        buf.len()
    }
    fn read(&self, buf: &[f32]) -> Result<Vec<f32>> {
        self.cpu.read(buf)
    }
    fn write(&self, buf: &mut [f32], host: &[f32]) -> Result<()> {
        self.cpu.write(buf, host)
    }
    fn fill(&self, buf: &mut [f32], value: f32) -> Result<()> {
        self.cpu.fill(buf, value)
    }
    fn synchronize(&self) -> Result<()> {
        self.cpu.synchronize()
    }
    fn rows<'a>(&self, packed: &'a Packed) -> Result<&'a Packed> {
        Ok(packed)
    }
    fn head_keep_rows(&self, vocab: usize) -> Option<usize> {
        self.cpu.head_keep_rows(vocab)
    }
    fn attention_state_len(&self, packed: &Packed, heads: Heads) -> usize {
        self.cpu.attention_state_len(packed, heads)
    }
    fn gemm(&self, c: &mut [f32], g: &Gemm, a: &[f32], b: &[f32]) -> Result<()> {
        self.cpu.gemm(c, g, a, b)
    }
    fn gemm_epilogue(
        &self,
        c: &mut [f32],
        g: &Gemm,
        (a, b): (&[f32], &[f32]),
        epilogue: Epilogue<'_, Self>,
    ) -> Result<()> {
        // One epilogue wrong, as a device's could be: the rest composed, as the CPU's.
        let kind = epilogue.kind();
        rookworld_train::backend::composed_epilogue(self, c, g, (a, b), epilogue)?;
        self.spoil(&format!("epilogue {}", kind.name()), c);
        Ok(())
    }
    fn broadcast_rows(&self, out: &mut [f32], bias: &[f32]) -> Result<()> {
        self.cpu.broadcast_rows(out, bias)
    }
    fn column_sums(&self, acc: &mut [f32], m: &[f32]) -> Result<()> {
        self.cpu.column_sums(acc, m)
    }
    fn add(&self, out: &mut [f32], a: &[f32], b: &[f32]) -> Result<()> {
        self.cpu.add(out, a, b)
    }
    fn embedding_forward(
        &self,
        out: &mut [f32],
        rows: &&Packed,
        wte: &[f32],
        wpe: &[f32],
    ) -> Result<()> {
        self.cpu.embedding_forward(out, rows, wte, wpe)
    }
    fn embedding_backward(
        &self,
        dwte: &mut [f32],
        dwpe: &mut [f32],
        dout: &[f32],
        rows: &&Packed,
    ) -> Result<()> {
        self.cpu.embedding_backward(dwte, dwpe, dout, rows)
    }
    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
    ) -> Result<()> {
        self.cpu.layernorm_forward(out, mean, rstd, x, w, b, eps)
    }
    fn layernorm_backward(
        &self,
        dx: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
        dout: &[f32],
        x: &[f32],
        mean: &[f32],
        rstd: &[f32],
        w: &[f32],
    ) -> Result<()> {
        self.cpu
            .layernorm_backward(dx, dw, db, dout, x, mean, rstd, w)
    }
    fn gelu_forward(&self, out: &mut [f32], x: &[f32]) -> Result<()> {
        self.cpu.gelu_forward(out, x)
    }
    fn gelu_backward(&self, d: &mut [f32], x: &[f32]) -> Result<()> {
        self.cpu.gelu_backward(d, x)?;
        self.spoil("gelu_backward", d);
        Ok(())
    }
    fn attention_forward(
        &self,
        out: &mut [f32],
        state: &mut [f32],
        qkv: &[f32],
        rows: &&Packed,
        heads: Heads,
    ) -> Result<()> {
        self.cpu.attention_forward(out, state, qkv, rows, heads)?;
        self.spoil("attention_forward", out);
        Ok(())
    }
    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dout: &[f32],
        out: &[f32],
        qkv: &[f32],
        state: &[f32],
        rows: &&Packed,
        heads: Heads,
    ) -> Result<()> {
        self.cpu
            .attention_backward(dqkv, dout, out, qkv, state, rows, heads)
    }
    fn gather_rows(&self, out: &mut [f32], x: &[f32], rows: &&Packed) -> Result<()> {
        self.cpu.gather_rows(out, x, rows)
    }
    fn scatter_add_rows(&self, dst: &mut [f32], src: &[f32], rows: &&Packed) -> Result<()> {
        self.cpu.scatter_add_rows(dst, src, rows)
    }
    fn head_forward(&self, f: HeadForward<'_, Self>, rows: &&Packed) -> Result<()> {
        let f = HeadForward {
            logp: f.logp,
            entropy: f.entropy,
            scratch: f.scratch,
            hidden: f.hidden,
            head: f.head,
            span: f.span,
            e: f.e,
            temperature: f.temperature,
            keep: f.keep,
        };
        self.cpu.head_forward(f, rows)
    }
    fn head_backward(&self, b: HeadBackward<'_, Self>, rows: &&Packed) -> Result<()> {
        let b = HeadBackward {
            dhidden: b.dhidden,
            dhead: b.dhead,
            hidden: b.hidden,
            head: b.head,
            dlogp: b.dlogp,
            span: b.span,
            e: b.e,
            temperature: b.temperature,
            probs: b.probs,
        };
        self.cpu.head_backward(b, rows)
    }
}

#[test]
fn a_wrong_kernel_is_named_by_the_first_buffer_it_writes() {
    for (broken, first) in [
        ("attention_forward", "block 0: attention output"),
        // The backward reaches block 1's MLP first; c_proj's gradients come before GELU's.
        ("gelu_backward", "∂ transformer.h.1.mlp.c_fc.bias"),
    ] {
        let faulty = Faulty {
            cpu: Cpu::new(Matmuls::F32),
            broken,
        };
        let cmp = compare_with(&faulty, true, Tolerance::F32);
        let got = cmp.first_divergence().expect("the wrong kernel is found");
        assert_eq!(got.name, first, "{}", cmp.summary());
        assert!(
            cmp.summary()
                .starts_with(&format!("first difference beyond tolerance: {first} (")),
            "{}",
            cmp.summary()
        );
    }
}

/// The start-up check passes a right backend and names the buffer a wrong one spoils.
#[test]
fn the_self_check_passes_a_right_backend_and_names_a_wrong_kernel() {
    let right = compare::self_check(&Cpu::new(Matmuls::Bf16)).unwrap();
    assert!(right.first_divergence().is_none(), "{}", right.summary());
    assert!(right.checked.len() > 20, "{}", right.summary());
    let faulty = Faulty {
        cpu: Cpu::new(Matmuls::Bf16),
        broken: "attention_forward",
    };
    let wrong = compare::self_check(&faulty).unwrap();
    let first = wrong.first_divergence().expect("the wrong kernel is found");
    assert_eq!(
        first.name,
        "heads of 32, 2 × 4 × (9 + 8): block 0: attention output",
        "{}",
        wrong.summary()
    );
}

#[test]
fn the_epilogue_check_holds_each_epilogue_to_its_composed_form() {
    // The CPU runs every epilogue composed: each buffer equal, to the bit.
    let right = compare::epilogue_check(&Cpu::new(Matmuls::Bf16)).unwrap();
    assert_eq!(right.checked.len(), 12, "{}", right.summary());
    assert!(right.checked[11].name.ends_with(", a second call"));
    for c in &right.checked {
        assert!(
            c.name.starts_with("epilogue ") && c.max_diff == 0.0,
            "{c:?}"
        );
    }
    // One epilogue off by 1% of its scale is named by its first buffer, as is GELU's
    // output where a device's differs by more than the form's tolerance.
    for (broken, first) in [
        ("epilogue bias", "epilogue bias: output"),
        ("epilogue bias+gelu", "epilogue bias+gelu: output"),
        ("epilogue dgelu", "epilogue dgelu: input gradient"),
        ("epilogue bias grad", "epilogue bias grad: weight gradient"),
    ] {
        let faulty = Faulty {
            cpu: Cpu::new(Matmuls::Bf16),
            broken,
        };
        let wrong = compare::epilogue_check(&faulty).unwrap();
        let found = wrong
            .first_divergence()
            .expect("the wrong epilogue is found");
        assert_eq!(found.name, first, "{}", wrong.summary());
    }
}
