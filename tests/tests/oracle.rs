//! The CPU reference against transformers' no-cache forward (tolerance: 1e-3 · max|logit|),
//! for a full prefill, uneven prefill chunks, and token-by-token decode.

use dsv4_model::cpu::{CpuModel, Logits};
use dsv4_tests::{fixtures, load_oracle, max_abs_diff, Oracle};

const REL_TOL: f32 = 1e-3;

/// Runs `chunks` (lengths summing to T) through one sequence and returns all logits.
fn run_chunks(model: &CpuModel, ids: &[u32], chunks: &[usize]) -> Vec<f32> {
    let mut state = model.new_state();
    let mut out = Vec::new();
    let mut start = 0;
    for &len in chunks {
        out.extend(
            model
                .forward(&mut state, &ids[start..start + len], Logits::All)
                .unwrap(),
        );
        start += len;
    }
    assert_eq!(start, ids.len());
    assert_eq!(state.len(), ids.len());
    out
}

fn check(name: &str, what: &str, got: &[f32], oracle: &Oracle) -> f32 {
    let (diff, scale) = max_abs_diff(got, &oracle.logits);
    println!(
        "{name} {what}: max|Δ| = {diff:.3e}, max|logit| = {scale:.3}, ratio {:.3e}",
        diff / scale
    );
    assert!(
        diff <= REL_TOL * scale,
        "{name} {what}: max|Δ| {diff} > {REL_TOL} · {scale}"
    );
    diff
}

fn for_each_fixture(mut f: impl FnMut(&str, &CpuModel, &Oracle)) {
    let dirs = fixtures();
    assert!(
        dirs.len() >= 3,
        "expected the generated oracle fixtures, found {}",
        dirs.len()
    );
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let model = CpuModel::load(&dir, |_, _| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
        let oracle = load_oracle(&dir);
        assert_eq!(oracle.vocab, model.config().vocab_size);
        f(&name, &model, &oracle);
    }
}

#[test]
fn full_prefill_matches_transformers() {
    for_each_fixture(|name, model, oracle| {
        let got = run_chunks(model, &oracle.input_ids, &[oracle.input_ids.len()]);
        check(name, "full prefill", &got, oracle);
    });
}

#[test]
fn uneven_prefill_chunks_match_transformers() {
    for_each_fixture(|name, model, oracle| {
        let t = oracle.input_ids.len();
        // Chunk borders land inside compressor windows and around the sliding window.
        let mut chunks = vec![];
        let mut left = t;
        for len in [5, 1, 11, 3, 9, 2].into_iter().cycle() {
            let len = len.min(left);
            chunks.push(len);
            left -= len;
            if left == 0 {
                break;
            }
        }
        let got = run_chunks(model, &oracle.input_ids, &chunks);
        check(name, &format!("chunks {chunks:?}"), &got, oracle);
        let full = run_chunks(model, &oracle.input_ids, &[t]);
        assert_eq!(
            got, full,
            "{name}: chunked prefill is not bit-identical to one full prefill"
        );
    });
}

#[test]
fn token_by_token_decode_matches_transformers() {
    for_each_fixture(|name, model, oracle| {
        let t = oracle.input_ids.len();
        let got = run_chunks(model, &oracle.input_ids, &vec![1; t]);
        check(name, "1-token decode", &got, oracle);
    });
}

#[test]
fn prefill_then_decode_matches_transformers() {
    for_each_fixture(|name, model, oracle| {
        let t = oracle.input_ids.len();
        let prefill = 13.min(t - 1);
        let mut state = model.new_state();
        model
            .forward(&mut state, &oracle.input_ids[..prefill], Logits::Last)
            .unwrap();
        let v = oracle.vocab;
        for (i, &id) in oracle.input_ids.iter().enumerate().skip(prefill) {
            let got = model.forward(&mut state, &[id], Logits::Last).unwrap();
            let want = &oracle.logits[i * v..(i + 1) * v];
            let (diff, scale) = max_abs_diff(&got, want);
            assert!(
                diff <= REL_TOL * scale,
                "{name} position {i}: max|Δ| {diff} > {REL_TOL} · {scale}"
            );
        }
    });
}
