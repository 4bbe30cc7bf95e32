//! Shared helpers for the workspace's integration tests: oracle fixtures written by
//! `fixtures/generate.py` (transformers' no-cache forward logits).

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

/// Logits of transformers' `DeepseekV4ForCausalLM` for one fixture.
pub struct Oracle {
    pub input_ids: Vec<u32>,
    /// `[T, vocab]`, row-major.
    pub logits: Vec<f32>,
    pub vocab: usize,
}

/// `$DSV4_FIXTURES` when set (test binaries run on another machine than the one that built
/// them), else `tests/fixtures` of the source tree.
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("DSV4_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures"),
    }
}

pub use dsv4_ops::gpu::testing::sanitizer_length;

/// Every fixture folder (one holding `oracle.safetensors`), sorted by name.
pub fn fixtures() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures exists")
        .map(|e| e.expect("readable fixtures dir").path())
        .filter(|p| p.join("oracle.safetensors").is_file())
        .collect();
    dirs.sort();
    dirs
}

pub fn load_oracle(dir: &Path) -> Oracle {
    let bytes = std::fs::read(dir.join("oracle.safetensors")).expect("oracle.safetensors readable");
    let st = SafeTensors::deserialize(&bytes).expect("oracle.safetensors valid");
    let ids = st.tensor("input_ids").expect("input_ids present");
    assert_eq!(ids.dtype(), Dtype::I64);
    let input_ids = ids
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let logits = st.tensor("logits").expect("logits present");
    assert_eq!(logits.dtype(), Dtype::F32);
    let vocab = logits.shape()[1];
    let logits = logits
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Oracle {
        input_ids,
        logits,
        vocab,
    }
}

/// `(max |a − b|, max |b|)`.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "logit count differs");
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0f32, f32::max);
    (diff, scale)
}

/// Copies the checkpoint in `dir` to `out` with every F32 tensor rounded to BF16 (the oracle
/// file left out), so that the GPU (which runs F32 linears as BF16) and the CPU reference
/// read the same weights; returns how many tensors were rounded.
pub fn bf16_copy(dir: &Path, out: &Path) -> usize {
    let mut rounded = 0;
    std::fs::create_dir_all(out).expect("output directory");
    for entry in std::fs::read_dir(dir).expect("checkpoint directory") {
        let path = entry.expect("readable entry").path();
        let name = path.file_name().expect("a file name").to_owned();
        if name == "oracle.safetensors" {
            continue;
        }
        if path.extension().is_none_or(|e| e != "safetensors") {
            std::fs::copy(&path, out.join(&name)).expect("copy");
            continue;
        }
        let bytes = std::fs::read(&path).expect("readable shard");
        let st = SafeTensors::deserialize(&bytes).expect("valid shard");
        let tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(key, t)| {
                let (dtype, data) = if t.dtype() == Dtype::F32 {
                    rounded += 1;
                    let v: Vec<u8> = t
                        .data()
                        .chunks_exact(4)
                        .flat_map(|b| {
                            let x = f32::from_le_bytes(b.try_into().unwrap());
                            half::bf16::from_f32(x).to_le_bytes()
                        })
                        .collect();
                    (Dtype::BF16, v)
                } else {
                    (t.dtype(), t.data().to_vec())
                };
                (key, dtype, t.shape().to_vec(), data)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(k, d, s, b)| {
                let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view");
                (k.clone(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &out.join(&name)).expect("write shard");
    }
    rounded
}
