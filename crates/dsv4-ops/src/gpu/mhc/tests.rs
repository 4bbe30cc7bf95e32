//! GPU tests of the mHC kernels against their CPU references on fresh random inputs. The
//! mix logits are summed in another order and expf may differ by an ulp, so hc_pre (with
//! hc_comb) and hc_head are held to bounds (post and comb within 1e-5, the normalized input
//! within 2e-5 of its largest magnitude, its BF16 copy its rounding); the expansion, given the
//! same mix, is bit-exact. All `#[ignore]`d:
//! `cargo xtask gpu-test`.

use rand::rngs::StdRng;
use rand::Rng;

use super::reference as cpu;
use super::*;
use crate::gpu::testing::{assert_bits_eq, device, rng, POISON};
use half::bf16;

fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// A site's parameters as the fixtures draw them: fn ~ 1/sqrt(fan-in), base in ±1, scale ~ 1.
fn random_site(rng: &mut StdRng, mix: usize, scales: usize, d: usize) -> [Vec<f32>; 3] {
    let w = HC * d;
    let a = (3.0 / w as f32).sqrt();
    [
        uniform(rng, mix * w, -a, a),
        uniform(rng, mix, -1.0, 1.0),
        uniform(rng, scales, 0.5, 1.5),
    ]
}

fn poisoned(dev: &Device, shape: &[usize]) -> DeviceTensor<f32> {
    let mut t = dev.alloc(DType::F32, shape).unwrap();
    dev.fill_bytes(&mut t, POISON).unwrap();
    t
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: got {g}, want {w} (tolerance {tol})"
        );
    }
}

fn params() -> HcParams {
    HcParams {
        n: HC,
        sinkhorn_iters: 20,
        hc_eps: 1e-6,
        norm_eps: 1e-6,
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_hc_pre_and_head_match_reference() {
    let dev = device();
    let mut rng = rng("gpu_hc_pre_and_head_match_reference");
    let p = params();
    for iter in 0..8 {
        let d = [64, 4096, 7168, rng.random_range(1..700)][iter % 4];
        let n = rng.random_range(1..9);
        let scale = [1.0, 30.0, 0.01][iter % 3];
        let streams = uniform(&mut rng, n * HC * d, -scale, scale);
        let [fn_, base, sc] = random_site(&mut rng, MIX, 3, d);
        let site = HcSite {
            fn_: &fn_,
            base: &base,
            scale: &sc,
        };
        let [hfn, hbase, hsc] = random_site(&mut rng, HC, 1, d);
        let head = HcSite {
            fn_: &hfn,
            base: &hbase,
            scale: &hsc,
        };

        let norm = uniform(&mut rng, d, 0.5, 1.5);
        let eps = [1e-6f32, 1e-5][iter % 2];
        let sd = dev.upload(DType::F32, &[n, HC * d], &streams).unwrap();
        let site_d = DeviceHcSite::upload(&dev, &site, d).unwrap();
        let head_d = DeviceHcSite::upload(&dev, &head, d).unwrap();
        let norm_d = dev.upload(DType::F32, &[d], &norm).unwrap();
        let mut mix = DeviceHcMix {
            post: poisoned(&dev, &[n, HC]),
            comb: poisoned(&dev, &[n, HC * HC]),
        };
        let mut xb = dev.alloc(DType::BF16, &[n, d]).unwrap();
        let (mut xn, mut hxn) = (poisoned(&dev, &[n, d]), poisoned(&dev, &[n, d]));
        let mut part = poisoned(&dev, &mix_partials_shape(n, d));
        hc_mix(&dev, &sd, &site_d, &p, &mut part).unwrap();
        let input = NormedInput {
            weight: &norm_d,
            eps,
            xn: &mut xn,
            xb: &mut xb,
        };
        hc_pre(&dev, &sd, &site_d, &p, &part, input, &mut mix).unwrap();
        hc_comb(&dev, &p, &mut mix.comb).unwrap();
        let (x, post, comb) = (
            dev.download(&xn).unwrap(),
            dev.download(&mix.post).unwrap(),
            dev.download(&mix.comb).unwrap(),
        );
        // The BF16 copy is the F32 output rounded.
        let rounded: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let what = format!("iter {iter}: n {n}, d {d}: BF16 copy");
        assert_bits_eq(&what, &dev.download(&xb).unwrap(), &rounded);
        hc_mix(&dev, &sd, &head_d, &p, &mut part).unwrap();
        let input = NormedInput {
            weight: &norm_d,
            eps,
            xn: &mut hxn,
            xb: &mut xb,
        };
        hc_head(&dev, &sd, &head_d, &p, &part, input).unwrap();
        let hx = dev.download(&hxn).unwrap();
        let rounded: Vec<bf16> = hx.iter().map(|&v| bf16::from_f32(v)).collect();
        let what = format!("iter {iter}: n {n}, d {d}: head BF16 copy");
        assert_bits_eq(&what, &dev.download(&xb).unwrap(), &rounded);
        let normed = |mut v: Vec<f32>| {
            crate::gpu::rows::reference::rms_norm(&mut v, Some(&norm), eps);
            v
        };
        for t in 0..n {
            let s = &streams[t * HC * d..(t + 1) * HC * d];
            let (want_mix, want_x) = cpu::hc_pre(&site, s, &p);
            let what = format!("iter {iter} token {t} of {n}, d {d}");
            assert_close(
                &format!("{what} post"),
                &post[t * HC..(t + 1) * HC],
                &want_mix.post,
                1e-5,
            );
            let c = &comb[t * HC * HC..(t + 1) * HC * HC];
            assert_close(&format!("{what} comb"), c, &want_mix.comb, 1e-5);
            let want_x = normed(want_x);
            let max = want_x.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_close(
                &format!("{what} normed input"),
                &x[t * d..(t + 1) * d],
                &want_x,
                2e-5 * max,
            );
            let want_h = normed(cpu::hc_head(&head, s, &p));
            let max = want_h.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_close(
                &format!("{what} head"),
                &hx[t * d..(t + 1) * d],
                &want_h,
                2e-5 * max,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_hc_comb_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_hc_comb_matches_reference");
    // A warp a token, eight a block: one token, a block's worth and some past it, many blocks.
    for (iter, n) in [1, 8, 9, 70, 1000].into_iter().enumerate() {
        let p = HcParams {
            sinkhorn_iters: [20, 0, 1, 3, 20][iter],
            ..params()
        };
        let logits = uniform(&mut rng, n * HC * HC, -8.0, 8.0);
        let mut comb = dev.upload(DType::F32, &[n, HC * HC], &logits).unwrap();
        hc_comb(&dev, &p, &mut comb).unwrap();
        let got = dev.download(&comb).unwrap();
        for t in 0..n {
            let mut want = logits[t * HC * HC..(t + 1) * HC * HC].to_vec();
            cpu::sinkhorn(&mut want, HC, p.sinkhorn_iters, p.hc_eps);
            let what = format!("n {n}, {} iterations, token {t}", p.sinkhorn_iters);
            assert_close(&what, &got[t * HC * HC..(t + 1) * HC * HC], &want, 1e-5);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_hc_post_mix_matches_reference_bit_for_bit() {
    let dev = device();
    let mut rng = rng("gpu_hc_post_mix_matches_reference_bit_for_bit");
    for iter in 0..8 {
        let d = [64, 4096, 7168, rng.random_range(1..700)][iter % 4];
        // Odd iterations: more than 16 tokens, sixteen a block (a prompt chunk's kernel).
        let n = if iter % 2 == 0 {
            rng.random_range(1..17)
        } else {
            rng.random_range(17..90)
        };
        let streams = uniform(&mut rng, n * HC * d, -3.0, 3.0);
        // y in two parts too (the MoE's routed and shared experts): y_plus is added first.
        let y_part = uniform(&mut rng, n * d, -3.0, 3.0);
        let y_plus = uniform(&mut rng, n * d, -3.0, 3.0);
        let y: Vec<f32> = y_part.iter().zip(&y_plus).map(|(a, b)| a + b).collect();
        let post = uniform(&mut rng, n * HC, 0.0, 2.0);
        let comb = uniform(&mut rng, n * HC * HC, 0.0, 1.0);
        let mut want = streams.clone();
        for t in 0..n {
            let mix = cpu::HcMix {
                post: post[t * HC..(t + 1) * HC].to_vec(),
                comb: comb[t * HC * HC..(t + 1) * HC * HC].to_vec(),
            };
            cpu::hc_post(
                &mut want[t * HC * d..(t + 1) * HC * d],
                &y[t * d..(t + 1) * d],
                &mix,
            );
        }
        let mix = DeviceHcMix {
            post: dev.upload(DType::F32, &[n, HC], &post).unwrap(),
            comb: dev.upload(DType::F32, &[n, HC * HC], &comb).unwrap(),
        };
        let sd = dev.upload(DType::F32, &[n, HC * d], &streams).unwrap();
        let yd = dev.upload(DType::F32, &[n, d], &y).unwrap();
        let y_part = dev.upload(DType::F32, &[n, d], &y_part).unwrap();
        let y_plus = dev.upload(DType::F32, &[n, d], &y_plus).unwrap();
        let want_d = dev.upload(DType::F32, &[n, HC * d], &want).unwrap();
        // Into a layer site's mix projection, then the head's: the new streams are the
        // reference's bits, and the partials those hc_mix gives on the reference's streams.
        let p = params();
        for rows in [MIX, HC] {
            let [fn_, base, sc] = random_site(&mut rng, rows, if rows == MIX { 3 } else { 1 }, d);
            let next = HcSite {
                fn_: &fn_,
                base: &base,
                scale: &sc,
            };
            let next = DeviceHcSite::upload(&dev, &next, d).unwrap();
            let mut want_part = poisoned(&dev, &mix_partials_shape(n, d));
            hc_mix(&dev, &want_d, &next, &p, &mut want_part).unwrap();
            let mut fused = poisoned(&dev, &[n, HC * d]);
            let mut part = poisoned(&dev, &mix_partials_shape(n, d));
            hc_post_mix(&dev, &sd, &yd, None, &mix, &mut fused, &next, &p, &mut part).unwrap();
            let what = format!("iter {iter}: n {n}, d {d}, into a {rows}-row mix");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert_bits_eq(&what, &bits(&dev.download(&fused).unwrap()), &bits(&want));
            let mut summed = poisoned(&dev, &[n, HC * d]);
            let mut summed_part = poisoned(&dev, &mix_partials_shape(n, d));
            let parts = Some(&y_plus);
            hc_post_mix(
                &dev,
                &sd,
                &y_part,
                parts,
                &mix,
                &mut summed,
                &next,
                &p,
                &mut summed_part,
            )
            .unwrap();
            let what_sum = format!("{what}, y in two parts");
            assert_bits_eq(
                &what_sum,
                &bits(&dev.download(&summed).unwrap()),
                &bits(&want),
            );
            assert_bits_eq(
                &what_sum,
                &bits(&dev.download(&summed_part).unwrap()),
                &bits(&dev.download(&part).unwrap()),
            );
            // Only the first `rows` + 1 entries of each partial are written.
            let (got_p, want_p) = (
                dev.download(&part).unwrap(),
                dev.download(&want_part).unwrap(),
            );
            for (g, w) in got_p.chunks(MIX + 1).zip(want_p.chunks(MIX + 1)) {
                assert_bits_eq(&what, &g[..=rows], &w[..=rows]);
            }
            // Past sixteen tokens both launches take sixteen a block: each token's partials are
            // those of the one-token kernels, the decode step's, bit for bit.
            let per_token = want_p.len() / n;
            for t in (0..n).filter(|_| n > 16) {
                let one = dev
                    .upload(
                        DType::F32,
                        &[1, HC * d],
                        &want[t * HC * d..(t + 1) * HC * d],
                    )
                    .unwrap();
                let mut alone = poisoned(&dev, &mix_partials_shape(1, d));
                hc_mix(&dev, &one, &next, &p, &mut alone).unwrap();
                let alone = dev.download(&alone).unwrap();
                let batch = &got_p[t * per_token..(t + 1) * per_token];
                for (g, w) in batch.chunks(MIX + 1).zip(alone.chunks(MIX + 1)) {
                    assert_bits_eq(
                        &format!("{what}, token {t} alone"),
                        &g[..=rows],
                        &w[..=rows],
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_mhc_launchers_reject_other_stream_counts_and_shapes() {
    let dev = device();
    let d = 8;
    let sd = dev.alloc::<f32>(DType::F32, &[2, HC * d]).unwrap();
    let [fn_, base, sc] = random_site(&mut rng("mhc shapes"), MIX, 3, d);
    let site = DeviceHcSite::upload(
        &dev,
        &HcSite {
            fn_: &fn_,
            base: &base,
            scale: &sc,
        },
        d,
    )
    .unwrap();
    let mut mix = DeviceHcMix {
        post: dev.alloc(DType::F32, &[2, HC]).unwrap(),
        comb: dev.alloc(DType::F32, &[2, HC * HC]).unwrap(),
    };
    let norm = dev.upload(DType::F32, &[d], &[1.0f32; 8]).unwrap();
    let mut xn = dev.alloc(DType::F32, &[2, d]).unwrap();
    let mut xb = dev.alloc(DType::BF16, &[2, d]).unwrap();
    macro_rules! input {
        () => {
            NormedInput {
                weight: &norm,
                eps: 1e-6,
                xn: &mut xn,
                xb: &mut xb,
            }
        };
    }
    let mut part = dev.alloc(DType::F32, &mix_partials_shape(2, d)).unwrap();
    hc_mix(&dev, &sd, &site, &params(), &mut part).unwrap();
    hc_pre(&dev, &sd, &site, &params(), &part, input!(), &mut mix).unwrap();
    let three = HcParams { n: 3, ..params() };
    assert!(hc_pre(&dev, &sd, &site, &three, &part, input!(), &mut mix).is_err());
    let mut small = dev.alloc(DType::F32, &mix_partials_shape(1, d)).unwrap();
    assert!(
        hc_pre(&dev, &sd, &site, &params(), &small, input!(), &mut mix).is_err(),
        "partials for one token"
    );
    assert!(
        hc_mix(&dev, &sd, &site, &params(), &mut small).is_err(),
        "partials for one token"
    );
    assert!(
        hc_head(&dev, &sd, &site, &params(), &part, input!()).is_err(),
        "a layer site is not a head"
    );
    let wide = dev.upload(DType::F32, &[d + 1], &[1.0f32; 9]).unwrap();
    let err = hc_pre(
        &dev,
        &sd,
        &site,
        &params(),
        &part,
        NormedInput {
            weight: &wide,
            ..input!()
        },
        &mut mix,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("mHC norm weight"), "{err}");
    let y = dev.alloc(DType::F32, &[2, d]).unwrap();
    let mut wrong = dev.alloc(DType::F32, &[2, HC * d + 1]).unwrap();
    let r = hc_post_mix(
        &dev,
        &sd,
        &y,
        None,
        &mix,
        &mut wrong,
        &site,
        &params(),
        &mut part,
    );
    assert!(r.is_err(), "new streams of the wrong width");
    let mut fine = dev.alloc(DType::F32, &[2, HC * d]).unwrap();
    let short = dev.alloc(DType::F32, &[1, d]).unwrap();
    let err = hc_post_mix(
        &dev,
        &sd,
        &y,
        Some(&short),
        &mix,
        &mut fine,
        &site,
        &params(),
        &mut part,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("mHC second sub-layer output"), "{err}");
    let mut comb = dev.alloc(DType::F32, &[2, HC * HC - 1]).unwrap();
    let err = hc_comb(&dev, &params(), &mut comb).unwrap_err().to_string();
    assert!(err.contains("mHC comb"), "{err}");
    let mut comb = dev.alloc(DType::F32, &[2, HC * HC]).unwrap();
    let err = hc_comb(&dev, &HcParams { n: 3, ..params() }, &mut comb)
        .unwrap_err()
        .to_string();
    assert!(err.contains("built for 4 streams"), "{err}");
    // The kernels copy fn 16 bytes at a time: an fn one float off a 16-byte boundary is refused.
    let mut pool = crate::gpu::BufferPool::new();
    let room = pool
        .reserve::<f32>("fn", DType::F32, &[MIX * HC * d + 1])
        .unwrap();
    pool.seal(&dev).unwrap();
    let backing = pool.take(room).unwrap();
    let shifted = DeviceHcSite {
        fn_: backing.view(1, &[MIX, HC * d]).unwrap(),
        base: dev.upload(DType::F32, &[MIX], &base).unwrap(),
        scale: dev.upload(DType::F32, &[3], &sc).unwrap(),
    };
    let err = hc_mix(&dev, &sd, &shifted, &params(), &mut part)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not on a 16-byte boundary"), "{err}");
}
