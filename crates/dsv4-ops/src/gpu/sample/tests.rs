//! GPU tests of the device sampler: the weights within 4 ulps of the reference's (expf's 2-ulp
//! bound plus the host's), and
//! given the device's own weights, the same token as the reference bit for bit, on random
//! logits of real and small vocabularies, one row at a time and several rows of different
//! settings and positions in one launch. All `#[ignore]`d: `cargo xtask gpu-test`.

use rand::Rng;

use super::reference as cpu;
use super::*;
use crate::gpu::testing::{device, rng};

/// `settings` as a launch's parameter rows.
fn settings_on(dev: &Device, settings: &[Sampling]) -> DeviceTensor<u32> {
    let words: Vec<u32> = settings
        .iter()
        .flat_map(|s| s.device_words().unwrap())
        .collect();
    dev.upload(DType::U32, &[settings.len(), 4], &words)
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_sampler_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_sampler_matches_reference");
    let mut distinct = std::collections::HashSet::new();
    for iter in 0..40 {
        let vocab = [129_280, 512, 1000, 7, 2048][iter % 5];
        let settings = Sampling {
            temperature: [0.0, 0.7, 1.0, 1.5][iter % 4],
            top_p: [1.0, 0.9, 0.5, 1e-6, 0.95][iter % 5],
            seed: rng.random(),
        };
        let spread = rng.random_range(1.0..12.0);
        let mut z: Vec<f32> = (0..vocab)
            .map(|_| rng.random_range(-spread..spread))
            .collect();
        if iter % 7 == 3 {
            z[vocab / 2] = f32::NAN;
        }
        let position: u32 = rng.random_range(0..1 << 20);
        let zd = dev.upload(DType::F32, &[1, vocab], &z).unwrap();
        let mut pd = dev.upload(DType::U32, &[1], &[position]).unwrap();
        let mut wd = dev.alloc::<f32>(DType::F32, &[1, vocab]).unwrap();
        let mut td = dev.upload(DType::U32, &[1], &[u32::MAX]).unwrap();
        let advance = (iter % 3) as u32;
        let params = settings_on(&dev, &[settings]);
        sample(&dev, &zd, &params, &mut pd, advance, &mut wd, &mut td).unwrap();
        let got = dev.download(&td).unwrap()[0];
        let what = format!("iter {iter}: vocab {vocab}, {settings:?}, position {position}");
        // The draw keyed by the position before the advance.
        let moved = dev.download(&pd).unwrap()[0];
        assert_eq!(moved, position + advance, "{what}: position advanced");
        let greedy = settings.temperature == 0.0;
        let w = if greedy {
            vec![0.0; vocab]
        } else {
            let w = dev.download(&wd).unwrap();
            let want = cpu::sample_weights(&z, 1.0 / settings.temperature);
            for (i, (g, r)) in w.iter().zip(&want).enumerate() {
                assert!(
                    (g - r).abs() <= 4.8e-7 * r.abs() + 1e-38,
                    "{what}: weight {i}: {g} vs {r}"
                );
            }
            w
        };
        let want = cpu::sample_pick(&z, &w, greedy, settings.top_p, settings.seed, position);
        assert_eq!(got, want, "{what}");
        assert!(z[got as usize].is_finite(), "{what}: picked a NaN logit");
        distinct.insert(got);
    }
    assert!(distinct.len() > 10, "the draws should differ: {distinct:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_greedy_ties_go_to_the_lowest_id_across_spans() {
    let dev = device();
    let greedy = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
    };
    let vocab = 129_280;
    let params = settings_on(&dev, &[greedy]);
    let pick = |z: &[f32]| {
        let zd = dev.upload(DType::F32, &[1, vocab], z).unwrap();
        let mut pd = dev.upload(DType::U32, &[1], &[0u32]).unwrap();
        let mut wd = dev.alloc::<f32>(DType::F32, &[1, vocab]).unwrap();
        let mut td = dev.upload(DType::U32, &[1], &[u32::MAX]).unwrap();
        sample(&dev, &zd, &params, &mut pd, 1, &mut wd, &mut td).unwrap();
        assert_eq!(
            dev.download(&pd).unwrap(),
            [1],
            "greedy advances the position too"
        );
        dev.download(&td).unwrap()[0]
    };
    // The maximum in three spans (ids 4096 apart at least), a NaN in a fourth.
    let mut z = vec![0.0f32; vocab];
    for i in [90_001, 50_000, 9_999] {
        z[i] = 3.0;
    }
    z[120_000] = f32::NAN;
    assert_eq!(pick(&z), 9_999);
    assert_eq!(pick(&z), cpu::sample_pick(&z, &[], true, 1.0, 0, 0));
    // Nothing above -inf: id 0, as the reference.
    let z = vec![f32::NEG_INFINITY; vocab];
    assert_eq!(pick(&z), cpu::sample_pick(&z, &[], true, 1.0, 0, 0));
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_rows_of_a_batch_sample_as_each_alone() {
    let dev = device();
    let mut rng = rng("gpu_rows_of_a_batch_sample_as_each_alone");
    for (iter, rows) in [2usize, 5, 16].into_iter().enumerate() {
        let vocab = [129_280, 1000, 4099][iter];
        let settings: Vec<Sampling> = (0..rows)
            .map(|r| Sampling {
                temperature: [0.0, 0.8, 1.3][r % 3],
                top_p: [1.0, 0.9, 0.6][(r / 3) % 3],
                seed: rng.random(),
            })
            .collect();
        let z: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.random_range(-6.0..6.0))
            .collect();
        let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..1 << 20)).collect();
        let zd = dev.upload(DType::F32, &[rows, vocab], &z).unwrap();
        let mut pd = dev.upload(DType::U32, &[rows], &positions).unwrap();
        let mut wd = dev.alloc::<f32>(DType::F32, &[rows, vocab]).unwrap();
        let mut td = dev.alloc::<u32>(DType::U32, &[rows]).unwrap();
        let params = settings_on(&dev, &settings);
        sample(&dev, &zd, &params, &mut pd, 1, &mut wd, &mut td).unwrap();
        let got = dev.download(&td).unwrap();
        let moved = dev.download(&pd).unwrap();
        for r in 0..rows {
            let what = format!("{rows} rows, row {r}: {:?}", settings[r]);
            assert_eq!(moved[r], positions[r] + 1, "{what}: position advanced");
            let row = &z[r * vocab..(r + 1) * vocab];
            let zr = dev.upload(DType::F32, &[1, vocab], row).unwrap();
            let mut pr = dev.upload(DType::U32, &[1], &[positions[r]]).unwrap();
            let mut wr = dev.alloc::<f32>(DType::F32, &[1, vocab]).unwrap();
            let mut tr = dev.alloc::<u32>(DType::U32, &[1]).unwrap();
            let one = settings_on(&dev, &settings[r..r + 1]);
            sample(&dev, &zr, &one, &mut pr, 1, &mut wr, &mut tr).unwrap();
            assert_eq!(got[r], dev.download(&tr).unwrap()[0], "{what}: alone");
            let greedy = settings[r].temperature == 0.0;
            let w = if greedy {
                Vec::new()
            } else {
                dev.download(&wr).unwrap()
            };
            let s = &settings[r];
            let want = cpu::sample_pick(row, &w, greedy, s.top_p, s.seed, positions[r]);
            assert_eq!(got[r], want, "{what}: reference");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_sampler_rejects_bad_settings() {
    let dev = device();
    for (temperature, top_p) in [(f32::NAN, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, 1.5)] {
        let s = Sampling {
            temperature,
            top_p,
            seed: 0,
        };
        assert!(s.device_words().is_err(), "{s:?}");
    }
    let z = dev.alloc::<f32>(DType::F32, &[2, 8]).unwrap();
    let s = Sampling {
        temperature: 1.0,
        top_p: 1.0,
        seed: 0,
    };
    let params = settings_on(&dev, &[s, s]);
    let mut w = dev.alloc::<f32>(DType::F32, &[2, 8]).unwrap();
    let mut t = dev.alloc::<u32>(DType::U32, &[2]).unwrap();
    let mut short = dev.alloc::<f32>(DType::F32, &[2, 7]).unwrap();
    let mut pos = dev.alloc::<u32>(DType::U32, &[2]).unwrap();
    assert!(sample(&dev, &z, &params, &mut pos, 1, &mut short, &mut t).is_err());
    // Two rows at one position would draw alike and both advance it.
    let mut one = dev.alloc::<u32>(DType::U32, &[1]).unwrap();
    assert!(sample(&dev, &z, &params, &mut one, 1, &mut w, &mut t).is_err());
    assert!(sample(&dev, &z, &params, &mut pos, 1, &mut w, &mut t).is_ok());
}
