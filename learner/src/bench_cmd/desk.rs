//! `learner bench --desk`: what the step asks of a GPU, estimated at the desk
//! ([`rookworld_train::desk`]) instead of measured.

use rookworld_lm::config::Config;
use rookworld_train::desk::{self, H100, H200, StepShape, Tally};

/// The desk estimate of a step of `shape` on a model of `cfg` on a GPU
/// ([`rookworld_train::desk`]) in two configurations — today's CUDA backend (f32 operands,
/// the head's logits recomputed in its backward) and BF16 operands with the head kept and
/// the products' epilogues inside them —
/// and of a decode step of P × G rows at the completions' middle position: the table for
/// stderr and the JSON line.
pub fn report(
    cfg: &Config,
    shape: StepShape,
    preset: &str,
) -> Result<(String, serde_json::Value), rookworld_train::backend::Error> {
    let today = desk::step(cfg, shape, &Tally::new(4, None))?;
    let planned = desk::step(
        cfg,
        shape,
        &Tally::new(2, Some(rookworld_train::launch::keep_rows(cfg.vocab_size)))
            .with_epilogues(true),
    )?;
    let rows = shape.prompts * shape.group;
    let decode = desk::decode_step(cfg, rows, shape.prompt + shape.completion / 2);
    let mut table = String::new();
    let mut json = serde_json::Map::new();
    for (name, work) in [("today", &today), ("planned", &planned)] {
        table.push_str(&format!(
            "step, {name}: operation, calls, GFLOP, GB, µs on {}, µs on {}\n",
            H100.name, H200.name
        ));
        let mut ops = serde_json::Map::new();
        let mut total = desk::Work::default();
        for (op, w) in work {
            table.push_str(&format!(
                "  {op:<20} {:>6} {:>9.1} {:>8.2} {:>9.0} {:>9.0}\n",
                w.calls,
                w.flops / 1e9,
                w.bytes / 1e9,
                w.seconds(&H100) * 1e6,
                w.seconds(&H200) * 1e6
            ));
            ops.insert((*op).into(), desk_json(w));
            total.calls += w.calls;
            total.flops += w.flops;
            total.bytes += w.bytes;
        }
        let bound = |d: &desk::Roofline| work.values().map(|w| w.seconds(d)).sum::<f64>();
        table.push_str(&format!(
            "  {:<20} {:>6} {:>9.1} {:>8.2} {:>9.0} {:>9.0}\n",
            "step",
            total.calls,
            total.flops / 1e9,
            total.bytes / 1e9,
            bound(&H100) * 1e6,
            bound(&H200) * 1e6
        ));
        json.insert(
            name.into(),
            serde_json::json!({
                "operations": ops,
                "total": desk_json(&total),
                "seconds_h100": bound(&H100),
                "seconds_h200": bound(&H200),
            }),
        );
    }
    table.push_str(&format!(
        "decode step, {rows} rows at {} positions: {:.1} GFLOP, {:.2} GB, {:.0} µs on {}, {:.0} µs on {}\n",
        shape.prompt + shape.completion / 2,
        decode.flops / 1e9,
        decode.bytes / 1e9,
        decode.seconds(&H100) * 1e6,
        H100.name,
        decode.seconds(&H200) * 1e6,
        H200.name
    ));
    json.insert(
        "shape".into(),
        serde_json::json!({
            "preset": preset,
            "prompts": shape.prompts,
            "group": shape.group,
            "prompt_tokens": shape.prompt,
            "completion_tokens": shape.completion,
            "micro_batch_groups": shape.micro_batch_groups,
            "reference": shape.reference,
        }),
    );
    json.insert(
        "decode".into(),
        serde_json::json!({
            "rows": rows,
            "positions": shape.prompt + shape.completion / 2,
            "work": desk_json(&decode),
            "seconds_h100": decode.seconds(&H100),
            "seconds_h200": decode.seconds(&H200),
        }),
    );
    Ok((table, serde_json::Value::Object(json)))
}

fn desk_json(w: &rookworld_train::desk::Work) -> serde_json::Value {
    serde_json::json!({ "calls": w.calls, "flops": w.flops, "bytes": w.bytes })
}
