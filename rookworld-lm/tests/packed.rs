//! The CPU inference kernels (packed weights with fused GELU, in-place decode attention)
//! compute what the plain tensor path computes.

use candle_core::{DType, Device, Tensor};
use rookworld_lm::checkpoint::init_random;
use rookworld_lm::{Config, GroupedCache, LeftPadding};

mod common;
use common::max_diff;

#[test]
fn packed_weights_give_the_logits_of_the_plain_model() {
    let cfg = Config {
        n_embd: 96,
        n_head: 3,
        ..Config::tiny()
    };
    let plain = init_random(&cfg, 4, DType::F32, &Device::Cpu).unwrap();
    let mut packed = plain.clone();
    if !packed.pack_for_cpu().unwrap() {
        // CI sets ROOKWORLD_REQUIRE_AVX2 on its AVX2 machines: there a skip is a failure.
        assert!(
            std::env::var_os("ROOKWORLD_REQUIRE_AVX2").is_none(),
            "AVX2/FMA is required (ROOKWORLD_REQUIRE_AVX2 is set) and this CPU lacks it"
        );
        std::fs::write(
            "/dev/stderr",
            "SKIPPED: this CPU lacks AVX2/FMA, nothing is packed\n",
        )
        .ok();
        return;
    }
    // A left-padded prefill batch.
    let ids = Tensor::new(&[[5u32, 6, 7, 8, 9], [0, 0, 11, 12, 13]], &Device::Cpu).unwrap();
    let padding = LeftPadding::new(vec![0, 2]);
    let (mut kv_a, mut kv_b) = (plain.new_cache(), packed.new_cache());
    let a = plain.forward(&ids, &padding, &mut kv_a).unwrap();
    let b = packed.forward(&ids, &padding, &mut kv_b).unwrap();
    let d = max_diff(&a, &b);
    assert!(d < 1e-4, "prefill max |Δ| = {d}");
    // Decode steps through the grouped cache (the CPU attention kernel in both).
    let (mut ga, mut gb) = (
        GroupedCache::new(cfg.n_layer),
        GroupedCache::new(cfg.n_layer),
    );
    ga.add_groups(&kv_a, &padding).unwrap();
    gb.add_groups(&kv_b, &padding).unwrap();
    for g in [0, 0, 1] {
        ga.add_row(g);
        gb.add_row(g);
    }
    for step in 0..20u32 {
        let feed = [step, step + 100, step + 200];
        let a = plain.decode_grouped(&feed, &mut ga).unwrap();
        let b = packed.decode_grouped(&feed, &mut gb).unwrap();
        let d = max_diff(&a, &b);
        assert!(d < 1e-4, "step {step}: max |Δ| = {d}");
    }
}
