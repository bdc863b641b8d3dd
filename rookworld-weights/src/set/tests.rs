use candle_core::{DType, Device};
use rookworld_lm::kernels::Kernels;
use rookworld_lm::model_io::init_random;

use super::*;

fn set() -> WeightSet {
    let m = init_random(&Config::tiny(), 1, DType::F32, &Device::Cpu).unwrap();
    WeightSet::from_model(&m, "run-a", 3).unwrap()
}

fn receive(chunks: impl IntoIterator<Item = pb::WeightChunk>) -> Result<Received, WeightError> {
    let mut a = Assembler::new(1 << 30);
    for c in chunks {
        a.push(c)?;
    }
    a.finish()
}

fn assemble(chunks: Vec<pb::WeightChunk>) -> Result<WeightSet, WeightError> {
    match receive(chunks)? {
        Received::Payload(set) => Ok(set),
        Received::Delta { .. } => panic!("a delta where a payload was sent"),
    }
}

/// Version 4 of `base`'s run: every 50th value of the tensors moved in its last bit.
fn next(base: &WeightSet) -> WeightSet {
    let mut bytes = base.bytes.to_vec();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for w in bytes[header..].chunks_exact_mut(2).step_by(50) {
        w[0] ^= 1;
    }
    WeightSet::from_bytes(&base.run_id, base.version + 1, bytes)
}

/// A delta travels in chunks like a payload, is put back together unhashed, and applied
/// to the base it was made against gives the new payload, its hash checked; applied to
/// another base it is refused as `DeltaBase`, the memory handed back.
#[test]
fn a_delta_rebuilds_the_payload_from_its_base_and_only_from_it() {
    let (base, new) = (set(), next(&set()));
    let delta = crate::delta::encode(&base.bytes, &new.bytes).unwrap();
    assert!(delta.len() < new.bytes.len() / 4, "{} bytes", delta.len());
    let chunks = new.delta_chunks(base.version, delta.clone().into(), 1000);
    let Received::Delta { header, delta: got } = receive(chunks).unwrap() else {
        panic!("a delta was sent")
    };
    assert_eq!(got, delta);
    assert_eq!(
        (header.base_version, header.delta_bytes, header.total_bytes),
        (3, delta.len() as u64, new.bytes.len() as u64)
    );
    let made = apply_delta(base.bytes.to_vec(), header.clone(), &got).unwrap();
    assert_eq!((made.version, made.blake3), (4, new.blake3));
    assert_eq!(made.bytes, new.bytes);

    // Another base of the same size: the result's hash is not the header's.
    let mut other = base.bytes.to_vec();
    let last = other.len() - 2;
    other[last] ^= 1;
    let (err, memory) = apply_delta(other, header.clone(), &got).unwrap_err();
    assert!(matches!(err, WeightError::DeltaBase(_)), "{err}");
    assert!(
        err.to_string().contains("differs from the sender's"),
        "{err}"
    );
    assert_eq!(memory.len(), base.bytes.len());
    // A base of another size, and a delta cut short.
    let (err, _) = apply_delta(vec![0; 10], header.clone(), &got).unwrap_err();
    assert!(err.to_string().starts_with("delta base unusable"), "{err}");
    let (err, _) = apply_delta(base.bytes.to_vec(), header, &got[..got.len() - 1]).unwrap_err();
    assert!(matches!(err, WeightError::Delta(_)), "{err}");
}

/// A delta streamed while it is made announces no size: its pieces, cut into chunks as
/// they come, are taken up to the most a delta of the payload can take, and its end is
/// its own blocks' (one cut short is refused when applied, naming it).
#[test]
fn a_streamed_delta_is_taken_without_its_size_and_bounded() {
    let (base, new) = (set(), next(&set()));
    let mut chunker = Chunker::new(new.streamed_delta_header(base.version), 700);
    let mut chunks = Vec::new();
    crate::delta::encode_streamed(&base.bytes, &new.bytes, |piece| {
        chunks.extend(chunker.cut(piece.into()));
    })
    .unwrap();
    assert!(chunks.len() > 2);
    let Received::Delta { header, delta } = receive(chunks.clone()).unwrap() else {
        panic!("a delta was sent")
    };
    assert_eq!(header.delta_bytes, 0);
    let made = apply_delta(base.bytes.to_vec(), header.clone(), &delta).unwrap();
    assert_eq!((made.version, made.blake3), (4, new.blake3));

    let cut = receive(chunks[..chunks.len() - 1].to_vec()).unwrap();
    let Received::Delta { delta: short, .. } = cut else {
        panic!("a delta was sent")
    };
    let (err, _) = apply_delta(base.bytes.to_vec(), header.clone(), &short).unwrap_err();
    assert!(err.to_string().contains("cut short"), "{err}");

    let bound = crate::delta::bound(new.bytes.len());
    let mut a = Assembler::new(1 << 30);
    let first = pb::WeightChunk {
        header: Some(header),
        offset: 0,
        data: vec![0; bound].into(),
    };
    a.push(first).unwrap();
    let over = pb::WeightChunk {
        header: None,
        offset: bound as u64,
        data: vec![0; 1].into(),
    };
    let err = a.push(over).unwrap_err();
    assert!(err.to_string().contains("the most a delta of the"), "{err}");
}

/// A delta header must name the one format, an older base, no shared file, and a size
/// within the limit.
#[test]
fn a_delta_header_is_checked_before_its_body() {
    let new = next(&set());
    let first = |h: pb::WeightSetHeader| pb::WeightChunk {
        header: Some(h),
        offset: 0,
        data: Bytes::new(),
    };
    let ok = new.delta_header(3, &[0; 100]);
    for (h, says) in [
        (
            pb::WeightSetHeader {
                delta_format: "gzip".into(),
                ..ok.clone()
            },
            "delta format `gzip`",
        ),
        (
            pb::WeightSetHeader {
                base_version: 4,
                ..ok.clone()
            },
            "its base must be older",
        ),
        (
            pb::WeightSetHeader {
                shared_file: "weights.safetensors".into(),
                ..ok.clone()
            },
            "a shared payload is whole",
        ),
        (
            pb::WeightSetHeader {
                delta_bytes: 1 << 31,
                ..ok.clone()
            },
            "delta of 2147483648 bytes exceeds",
        ),
    ] {
        let err = Assembler::new(1 << 30).push(first(h)).unwrap_err();
        assert!(err.to_string().contains(says), "{err}");
    }
    let mut a = Assembler::new(1 << 30);
    a.push(first(ok)).unwrap();
    let err = a
        .push(pb::WeightChunk {
            header: None,
            offset: 0,
            data: vec![0; 101].into(),
        })
        .unwrap_err();
    assert!(
        err.to_string().contains("exceed the announced 100 bytes"),
        "{err}"
    );
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
