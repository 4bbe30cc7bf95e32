//! The model split over several GPUs of one host (tensor parallelism) against the same model
//! on one GPU: every oracle fixture whose shapes split and a Flash-width synthetic model, per
//! position cosine ≥ 0.9999 and identical greedy tokens; graph replays on every GPU
//! bit-identical to eager launches; shapes that do not split refused by name. All `#[ignore]`d:
//! they need at least two CUDA GPUs (`cargo xtask gpu-test`).

use std::path::Path;
use std::sync::Arc;

use dsv4_model::checkpoint::Checkpoint;
use dsv4_model::config::{Config, LayerKind};
use dsv4_model::cpu::Logits;
use dsv4_model::gpu::{GpuModel, GpuModelError, GpuOptions};
use dsv4_model::shard::local_config;
use dsv4_model::synth::{write_synthetic, SynthFormat};
use dsv4_ops::gpu::testing::devices;
use dsv4_ops::gpu::Device;
use dsv4_tests::{fixtures, load_oracle, sanitizer_length};

mod common;
use common::{cosine, decode};

/// The world sizes to test: 2, 4 and 8, as far as the GPUs go.
fn worlds(devs: &[Arc<Device>]) -> Vec<usize> {
    [2, 4, 8].into_iter().filter(|&n| n <= devs.len()).collect()
}

fn load(dir: &Path, devs: &[Arc<Device>], context: usize) -> GpuModel {
    let opts = GpuOptions {
        max_context: Some(context),
        sequences: 1,
        max_chunk: None,
    };
    GpuModel::load(dir, devs, opts, |_, _| {})
        .unwrap_or_else(|e| panic!("loading {} onto {} GPU(s): {e}", dir.display(), devs.len()))
}

/// Per-position cosines of `got` against `want` (`[T, vocab]`).
fn cosines(got: &[f32], want: &[f32], vocab: usize) -> Vec<f64> {
    assert_eq!(got.len(), want.len(), "logit count");
    got.chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| cosine(g, w))
        .collect()
}

fn worst_cosine(got: &[f32], want: &[f32], vocab: usize) -> f64 {
    cosines(got, want, vocab).into_iter().fold(1.0, f64::min)
}

/// The indexer keeps every entry here: its top-k over entries whose scores lie closer than
/// the two sides' summation orders could otherwise pick other entries on each side.
#[test]
#[ignore = "needs several CUDA GPUs: cargo xtask gpu-test"]
fn multi_gpu_model_matches_one_gpu_on_every_fixture_that_splits() {
    let devs = devices();
    let mut ran = 0;
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let mut ids = load_oracle(&dir).input_ids;
        ids.truncate(sanitizer_length(ids.len(), 40));
        let ck = Checkpoint::open(&dir).unwrap();
        let mut config = ck.config().clone();
        config.index_topk = ids.len();
        let weights = dsv4_model::weights::ModelWeights::load(&ck, |_, _| {}).unwrap();
        let opts = GpuOptions {
            max_context: Some(ids.len()),
            sequences: 1,
            max_chunk: None,
        };
        let vocab = config.vocab_size;
        let mut one = GpuModel::new(config.clone(), &weights, &devs[..1], opts, |_, _| {}).unwrap();
        let want = one.forward(&ids, Logits::All).unwrap();
        drop(one);
        for world in worlds(&devs) {
            // Widths that do not split, or whose slices the kernels cannot take, are refused
            // by name before anything is uploaded.
            let mut split =
                match GpuModel::new(config.clone(), &weights, &devs[..world], opts, |_, _| {}) {
                    Ok(m) => m,
                    Err(e @ (GpuModelError::Shard(_) | GpuModelError::Unsupported { .. })) => {
                        println!("{name}: not split over {world} GPUs: {e}");
                        continue;
                    }
                    Err(e) => panic!("{name} over {world} GPUs: {e}"),
                };
            let got = split.forward(&ids, Logits::All).unwrap();
            let cos = cosines(&got, &want, vocab);
            let under: Vec<usize> = (0..cos.len()).filter(|&t| cos[t] < 0.9999).collect();
            let worst = cos.iter().cloned().fold(1.0, f64::min);
            println!(
                "{name} over {world} GPUs: worst cosine against one GPU {worst:.7}, {} of {} \
                 positions under 0.9999 {under:?}",
                under.len(),
                cos.len()
            );
            assert!(
                under.is_empty(),
                "{name} over {world} GPUs: {} positions under 0.9999",
                under.len()
            );
            ran += 1;
        }
    }
    assert!(ran > 0, "no fixture splits over the GPUs");
}

/// Flash widths (hidden 4096, 64 heads of 512, 8 output groups, expert intermediate 2048,
/// the Flash vocabulary) with 16 routed experts instead of 256, so that its synthetic NVFP4
/// checkpoint stays small: sliding, CSA and HCA layers. Every layer routes by token id and the
/// indexer keeps every entry, so no discrete choice can tip between the two sides' summation
/// orders.
fn flash_width() -> Config {
    let mut c = Config::flash();
    c.n_routed_experts = 16;
    c.num_hash_layers = 4;
    c.index_topk = 1024;
    c.layers = vec![
        LayerKind::Sliding,
        LayerKind::Csa { ratio: 4 },
        LayerKind::Hca { ratio: 128 },
        LayerKind::Csa { ratio: 4 },
    ];
    c.num_layers = c.layers.len();
    c
}

#[test]
#[ignore = "needs several CUDA GPUs: cargo xtask gpu-test"]
fn multi_gpu_flash_width_model_matches_one_gpu() {
    let devs = devices();
    let config = flash_width();
    let dir = tempfile::tempdir().unwrap();
    write_synthetic(&config, SynthFormat::Nvfp4, dir.path(), 11, &mut |_, _| {}).unwrap();
    // Past the window, the CSA compressor's emissions and (over 256 steps) the HCA one's.
    let prompt: Vec<u32> = (0..sanitizer_length(600, 140) as u32)
        .map(|i| (i * 7919 + 13) % config.vocab_size as u32)
        .collect();
    let steps = sanitizer_length(256, 16);
    let context = prompt.len() + steps + 1;
    let mut one = load(dir.path(), &devs[..1], context);
    let want_prefill = one.forward(&prompt, Logits::All).unwrap();
    let (want_tokens, want_logits) = decode(&mut one, &prompt, steps, true);
    drop(one);
    let vocab = config.vocab_size;
    for world in worlds(&devs) {
        let mut split = load(dir.path(), &devs[..world], context);
        let got = split.forward(&prompt, Logits::All).unwrap();
        let cos = worst_cosine(&got, &want_prefill, vocab);
        println!("Flash width over {world} GPUs: worst prefill cosine against one GPU {cos:.7}");
        assert!(cos >= 0.9999, "over {world} GPUs: cosine {cos}");
        let (tokens, _) = decode(&mut split, &prompt, steps, true);
        // Greedy tokens agree until a step whose one-GPU logits hold a near-tie (the split's
        // pick within BF16 rounding, 2^-8, of the maximum logit's magnitude): a random model's
        // flat logits meet one within a few hundred steps, and from there the sequences differ.
        let same = tokens
            .iter()
            .zip(&want_tokens)
            .take_while(|(a, b)| a == b)
            .count();
        println!(
            "Flash width over {world} GPUs: greedy tokens identical for {same} of {}",
            tokens.len()
        );
        if same < tokens.len() {
            let step = &want_logits[same * vocab..(same + 1) * vocab];
            let max = step.iter().cloned().fold(f32::MIN, f32::max);
            let gap = max - step[tokens[same] as usize];
            println!(
                "step {same}: one GPU picks {} ({max}), {world} GPUs pick {} ({} below)",
                want_tokens[same], tokens[same], gap
            );
            assert!(
                gap <= max.abs() / 256.0,
                "over {world} GPUs: step {same} differs by {gap}, no near-tie"
            );
        }
    }
}

#[test]
#[ignore = "needs several CUDA GPUs: cargo xtask gpu-test"]
fn multi_gpu_graph_replay_is_bit_identical_to_eager_launches() {
    let devs = devices();
    let steps = sanitizer_length(300, 48);
    // The long fixture (its widths split over 2 GPUs) and a Flash-width model (over 2, 4, 8).
    let long = dsv4_tests::fixtures_dir().join("long");
    let flash = tempfile::tempdir().unwrap();
    write_synthetic(
        &flash_width(),
        SynthFormat::Nvfp4,
        flash.path(),
        5,
        &mut |_, _| {},
    )
    .unwrap();
    let mut ran = 0;
    for dir in [long.as_path(), flash.path()] {
        let config = Checkpoint::open(dir).unwrap().config().clone();
        let prompt: Vec<u32> = (0..5u32)
            .map(|i| (i * 7919 + 13) % config.vocab_size as u32)
            .collect();
        for world in worlds(&devs) {
            if local_config(&config, world).is_err() {
                continue;
            }
            let mut model = load(dir, &devs[..world], 320);
            let (eager_tokens, eager_logits) = decode(&mut model, &prompt, steps, false);
            let (graph_tokens, graph_logits) = decode(&mut model, &prompt, steps, true);
            let what = format!("{} over {world} GPUs", dir.display());
            assert_eq!(graph_tokens, eager_tokens, "{what}: sampled tokens");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&graph_logits) == bits(&eager_logits),
                "{what}: graph logits differ from eager ones"
            );
            println!("{what}: {steps} graph replays bit-identical to eager launches");
            ran += 1;
        }
    }
    assert!(ran >= 2, "the models split over too few of the GPU counts");
}

#[test]
#[ignore = "needs several CUDA GPUs: cargo xtask gpu-test"]
fn multi_gpu_shapes_that_do_not_split_are_refused() {
    let devs = devices();
    let dir = dsv4_tests::fixtures_dir().join("mixed");
    let ck = Checkpoint::open(&dir).unwrap();
    let mut config = ck.config().clone();
    config.vocab_size += 1;
    let weights = dsv4_model::weights::ModelWeights::load(&ck, |_, _| {}).unwrap();
    let opts = GpuOptions {
        max_context: Some(16),
        sequences: 1,
        max_chunk: None,
    };
    let err = GpuModel::new(config, &weights, &devs[..2], opts, |_, _| {})
        .err()
        .expect("an odd vocabulary over 2 GPUs")
        .to_string();
    assert!(
        err.contains("vocab_size") && err.contains("over 2 GPUs"),
        "{err}"
    );
    let twice = [devs[0].clone(), devs[0].clone()];
    let err = GpuModel::load(&dir, &twice, opts, |_, _| {})
        .err()
        .expect("one GPU named twice")
        .to_string();
    assert!(err.contains("named twice"), "{err}");
}
