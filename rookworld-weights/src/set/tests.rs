use candle_core::{DType, Device};
use rookworld_lm::kernels::Kernels;
use rookworld_lm::model_io::init_random;

use super::*;

fn set() -> WeightSet {
    let m = init_random(&Config::tiny(), 1, DType::F32, &Device::Cpu).unwrap();
    WeightSet::from_model(&m, "run-a", 3).unwrap()
}

fn assemble(chunks: Vec<pb::WeightChunk>) -> Result<WeightSet, WeightError> {
    let mut a = Assembler::new(1 << 30);
    for c in chunks {
        a.push(c)?;
    }
    a.finish()
}

#[test]
fn chunks_reassemble_into_the_same_model() {
    let s = set();
    let chunks = s.chunks(10_000).collect::<Vec<_>>();
    assert!(chunks.len() > 10);
    let back = assemble(chunks).unwrap();
    assert_eq!(
        (back.version, back.blake3, back.bytes.len()),
        (3, s.blake3, s.bytes.len())
    );
    assert_eq!(back.run_id, "run-a");
    back.supersedes("run-a", 2).unwrap();
    let m = build_model(
        &back.bytes,
        &Config::tiny(),
        (DType::F32, Default::default()),
        (&Device::Cpu, &Kernels::cpu()),
        None,
    )
    .unwrap();
    assert_eq!(m.named_tensors().len(), Config::tiny().n_layer * 12 + 4);
}

#[test]
fn corruption_gaps_and_stale_versions_are_refused() {
    let s = set();
    let mut chunks = s.chunks(10_000).collect::<Vec<_>>();
    let mut flipped = chunks[3].data.to_vec();
    flipped[17] ^= 0x40;
    chunks[3].data = flipped.into();
    assert!(matches!(
        assemble(chunks).unwrap_err(),
        WeightError::Checksum { .. }
    ));

    let mut chunks = s.chunks(10_000).collect::<Vec<_>>();
    chunks.remove(2);
    assert!(assemble(chunks).unwrap_err().to_string().contains("offset"));

    let mut chunks = s.chunks(10_000).collect::<Vec<_>>();
    chunks.pop();
    assert!(
        assemble(chunks)
            .unwrap_err()
            .to_string()
            .contains("ended after")
    );

    let mut chunks = s.chunks(10_000).collect::<Vec<_>>();
    chunks[0].header = None;
    assert!(
        assemble(chunks)
            .unwrap_err()
            .to_string()
            .contains("no header")
    );

    let mut a = Assembler::new(1000);
    assert!(
        a.push(s.chunks(10_000).collect::<Vec<_>>().remove(0))
            .unwrap_err()
            .to_string()
            .contains("limit")
    );

    // Within a run a version must rise; another run's weights are taken at any version.
    let err = set().supersedes("run-a", 3).unwrap_err();
    assert!(matches!(
        err,
        WeightError::Stale {
            offered: 3,
            current: 3,
            ..
        }
    ));
    set().supersedes("run-b", 50).unwrap();
    set().supersedes("", 0).unwrap();

    let other = Config {
        n_layer: 3,
        ..Config::tiny()
    };
    let err = build_model(
        &set().bytes,
        &other,
        (DType::F32, Default::default()),
        (&Device::Cpu, &Kernels::cpu()),
        None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("h.2"), "{err}");
}
