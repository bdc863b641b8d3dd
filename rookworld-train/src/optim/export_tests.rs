//! The optimizer writing the weight push's payload ([`rookworld_weights::export`]):
//! payloads equal the model's export, buffers reused, files by version.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rookworld_lm::config::Config;
use rookworld_lm::model_io::{self, init_random};
use rookworld_weights::WeightSet;
use rookworld_weights::export::{Exporter, POOL};
use rookworld_weights::set::shared_file_name;
use tokio::sync::watch;

use crate::optim::{AdamW, AdamWConfig};
use crate::policy::Trainable;

fn gradients(policy: &Trainable, seed: u32) -> crate::optim::Gradients {
    let buffers = policy
        .vars
        .iter()
        .map(|(_, v)| {
            (0..v.elem_count())
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / 4e9 - 0.5)
                .collect()
        })
        .collect();
    policy.host_gradients(buffers)
}

/// A tiny policy (weights from `seed`), its exporter (writing into `dir` when given), the
/// receiving end of what it publishes, and a fresh optimizer.
struct Fixture {
    policy: Trainable,
    exporter: Exporter,
    rx: watch::Receiver<Option<Arc<WeightSet>>>,
    opt: AdamW,
}

fn fixture(seed: u64, dir: Option<PathBuf>) -> Fixture {
    let model = init_random(&Config::tiny(), seed, DType::F32, &Device::Cpu).unwrap();
    let policy = Trainable::from_model(&model).unwrap();
    let (tx, rx) = watch::channel(None);
    let exporter = Exporter::new(&policy.vars, Arc::new(tx), dir);
    Fixture {
        policy,
        exporter,
        rx,
        opt: AdamW::new(AdamWConfig::default()),
    }
}

/// An optimizer step writing its payload, published as `version`: the set.
fn step(f: &mut Fixture, version: u64) -> Arc<WeightSet> {
    let grads = gradients(&f.policy, version as u32);
    step_with(f, &grads, version)
}

/// [`step`] with the given gradients.
fn step_with(f: &mut Fixture, grads: &crate::optim::Gradients, version: u64) -> Arc<WeightSet> {
    let mut payload = f.exporter.payload();
    f.opt
        .step_exporting(
            &f.policy.vars,
            grads,
            1e-3,
            Some(&mut payload),
            f.policy.model.kernels(),
        )
        .unwrap();
    payload.fill_rest(&f.policy.vars).unwrap();
    f.exporter.publish("run", version, payload).unwrap();
    f.exporter.flush().unwrap();
    f.rx.borrow_and_update().clone().expect("published")
}

#[test]
fn the_optimizer_s_payload_equals_the_model_s_export_and_buffers_are_reused() {
    let mut f = fixture(5, None);
    for version in 1..=3u64 {
        let set = step(&mut f, version);
        assert_eq!(set.version, version);
        // Bit for bit what converting the updated model gives, hash included.
        let want = WeightSet::from_model(&f.policy.model, "run", version).unwrap();
        assert_eq!(set.blake3, want.blake3, "version {version}");
        assert_eq!(set.bytes, want.bytes);
        let back = model_io::from_bytes(&set.bytes, &Config::tiny(), DType::F32, &Device::Cpu);
        assert!(back.is_ok());
    }
    // Every set but the newest was let go of: their buffers are back in the pool.
    assert!(f.exporter.spare_buffers() > 0);
    // An incomplete payload is refused, never published.
    let err = f
        .exporter
        .publish("run", 4, f.exporter.payload())
        .unwrap_err();
    assert_eq!(err, rookworld_weights::export::ExportError::Incomplete(4));
    assert_eq!(f.rx.borrow().as_ref().unwrap().version, 3);
}

/// The GPU's optimizer path (moments on the device, autograd's tensor gradients, the
/// bfloat16 copy of every parameter written into the payload's data section at once), run
/// on the CPU: its payload too is bit for bit the updated model's export.
#[test]
fn the_device_path_s_payload_equals_the_model_s_export() {
    let mut f = fixture(5, None);
    f.opt.use_device_path_everywhere();
    for version in 1..=2u64 {
        // Tensor gradients, as autograd leaves them: of Σ_p Σ p ⊙ g_p.
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for (i, (_, var)) in f.policy.vars.iter().enumerate() {
            let g = Tensor::rand(-1f32, 1f32, var.shape(), &Device::Cpu).unwrap();
            let g = (g * (i + version as usize) as f64).unwrap();
            let term = (var.as_tensor() * g).unwrap();
            loss = (loss + term.sum_all().unwrap()).unwrap();
        }
        let mut grads = crate::optim::Gradients::default();
        grads
            .accumulate(&loss.backward().unwrap(), &f.policy.vars)
            .unwrap();
        let set = step_with(&mut f, &grads, version);
        let want = WeightSet::from_model(&f.policy.model, "run", version).unwrap();
        assert_eq!(set.blake3, want.blake3, "version {version}");
    }
    assert!(
        f.opt.moments.is_empty(),
        "the moments stayed on the (test's) device"
    );
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn with_a_shared_directory_each_payload_is_its_version_s_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut f = fixture(7, Some(dir.path().to_owned()));
    let mut reader = None;
    for version in 1..=6u64 {
        let set = step(&mut f, version);
        let name = set.shared_file.clone().expect("a file was published");
        assert_eq!(name, shared_file_name("run", version));
        let path = dir.path().join(&name);
        // The file is the set's bytes: what the optimizer wrote, no copy made.
        assert_eq!(std::fs::read(&path).unwrap(), set.bytes);
        let want = WeightSet::from_model(&f.policy.model, "run", version).unwrap();
        assert_eq!((set.blake3, &set.bytes), (want.blake3, &want.bytes));
        if version == 2 {
            // A worker still reading version 2: its file is never written over.
            let file = std::fs::File::open(&path).unwrap();
            file.lock_shared().unwrap();
            reader = Some((file, set.bytes.to_vec()));
        }
        // The published file and the pool's (plus version 2's while it is held).
        let files = names(dir.path());
        assert!(files.len() <= POOL + 2, "{files:?}");
    }
    let (file, bytes) = reader.unwrap();
    let mut held = Vec::new();
    std::io::Read::read_to_end(&mut &file, &mut held).unwrap();
    assert_eq!(held, bytes, "the reader's file kept version 2's bytes");
    drop(file);
    // Files go with the last hold on them (the exporter's pool, the published set).
    drop(f);
    assert_eq!(names(dir.path()), Vec::<String>::new());
}

#[test]
fn a_step_without_gradients_still_exports_every_parameter() {
    let f = fixture(6, None);
    let mut payload = f.exporter.payload();
    payload.fill_rest(&f.policy.vars).unwrap();
    f.exporter.publish("run", 1, payload).unwrap();
    f.exporter.flush().unwrap();
    let set = f.rx.borrow().clone().unwrap();
    let want = WeightSet::from_model(&f.policy.model, "run", 1).unwrap();
    assert_eq!(set.blake3, want.blake3);
}
