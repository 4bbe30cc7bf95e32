//! GPU tests of the router against its CPU reference on fresh random logits: the same experts
//! in the same order (tokens whose k-th and (k+1)-th biased scores lie within 1e-5 of each
//! other are skipped: expf/log1pf may move a score by an ulp), weights within 1e-6 relative.
//! The gate projection: within 1e-5 of Σ|x·w| per logit, bit-identical across launches and
//! batch sizes.
//! All `#[ignore]`d: `cargo xtask gpu-test`.

use half::bf16;
use rand::seq::SliceRandom;
use rand::Rng;

use super::reference::{self as cpu, RouteBy};
use super::*;
use crate::gpu::rows::reference::softplus;
use crate::gpu::testing::{assert_bits_eq, device, rng, POISON};

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_route_topk_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_route_topk_matches_reference");
    // (experts, k): Flash, Pro, the fixtures, the most the kernel holds, a partial last slot.
    let shapes = [
        (256, 6),
        (384, 6),
        (8, 2),
        (16, 3),
        (4, 4),
        (512, 8),
        (33, 5),
    ];
    let (mut checked, mut skipped) = (0, 0);
    for iter in 0..28 {
        let (e, k) = shapes[iter % shapes.len()];
        let hash = iter % 2 == 1;
        let n = rng.random_range(1..33);
        let vocab = 50;
        let logits: Vec<f32> = (0..n * e).map(|_| rng.random_range(-4.0..4.0)).collect();
        let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
        let bias: Vec<f32> = (0..e).map(|_| rng.random_range(-0.5..0.5)).collect();
        let tid2eid: Vec<u32> = (0..vocab)
            .flat_map(|_| {
                let mut all: Vec<u32> = (0..e as u32).collect();
                all.shuffle(&mut rng);
                all.truncate(k);
                all
            })
            .collect();
        let scale = rng.random_range(1.0..3.0);

        let ld = dev.upload(DType::F32, &[n, e], &logits).unwrap();
        let td = dev.upload(DType::U32, &[n], &tokens).unwrap();
        let bd = dev.upload(DType::F32, &[e], &bias).unwrap();
        let hd = dev.upload(DType::U32, &[vocab, k], &tid2eid).unwrap();
        let mut ids = dev.alloc::<i32>(DType::I32, &[n, k]).unwrap();
        let mut wts = dev.alloc::<f32>(DType::F32, &[n, k]).unwrap();
        dev.fill_bytes(&mut ids, POISON).unwrap();
        dev.fill_bytes(&mut wts, POISON).unwrap();
        let by = if hash {
            DeviceRouteBy::Hash { tid2eid: &hd }
        } else {
            DeviceRouteBy::Learned { bias: &bd }
        };
        route_topk(&dev, &ld, &td, by, scale, &mut ids, &mut wts).unwrap();
        let (ids, wts) = (dev.download(&ids).unwrap(), dev.download(&wts).unwrap());
        for t in 0..n {
            let z = &logits[t * e..(t + 1) * e];
            let by = if hash {
                RouteBy::Hash { tid2eid: &tid2eid }
            } else {
                RouteBy::Learned { bias: &bias }
            };
            if !hash && k < e {
                let mut biased: Vec<f32> = z
                    .iter()
                    .zip(&bias)
                    .map(|(&v, b)| softplus(v).sqrt() + b)
                    .collect();
                biased.sort_by(|a, b| b.total_cmp(a));
                if biased[k - 1] - biased[k] < 1e-5 {
                    skipped += 1;
                    continue;
                }
            }
            let want = cpu::route(z, by, tokens[t], k, scale);
            let what = format!("iter {iter} ({e} experts, top-{k}, hash {hash}) token {t}");
            let got_ids: Vec<usize> = ids[t * k..(t + 1) * k]
                .iter()
                .map(|&i| i as usize)
                .collect();
            let want_ids: Vec<usize> = want.iter().map(|w| w.0).collect();
            assert_eq!(got_ids, want_ids, "{what}");
            for (j, (g, w)) in wts[t * k..(t + 1) * k].iter().zip(&want).enumerate() {
                assert!(
                    (g - w.1).abs() <= 1e-6 * w.1.abs().max(1e-3),
                    "{what} slot {j}: {g} vs {}",
                    w.1
                );
            }
            checked += 1;
        }
    }
    println!("{checked} tokens checked, {skipped} near-ties skipped");
    assert!(
        skipped * 20 < checked,
        "too many near-ties: the test says little"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_route_topk_breaks_ties_to_the_lowest_expert() {
    let dev = device();
    let (e, k) = (256, 6);
    // Token 0: every expert equal. Token 1: experts 250.. and 7 lead, tied with each other.
    let mut logits = vec![0.25f32; 2 * e];
    for x in [e + 7, e + 250, e + 251, e + 252, e + 253, e + 254, e + 255] {
        logits[x] = 2.0;
    }
    let bias = vec![0.0f32; e];
    let ld = dev.upload(DType::F32, &[2, e], &logits).unwrap();
    let td = dev.upload(DType::U32, &[2], &[0u32, 0]).unwrap();
    let bd = dev.upload(DType::F32, &[e], &bias).unwrap();
    let mut ids = dev.alloc::<i32>(DType::I32, &[2, k]).unwrap();
    let mut wts = dev.alloc::<f32>(DType::F32, &[2, k]).unwrap();
    let by = DeviceRouteBy::Learned { bias: &bd };
    route_topk(&dev, &ld, &td, by, 1.0, &mut ids, &mut wts).unwrap();
    let ids = dev.download(&ids).unwrap();
    assert_eq!(ids[..k], [0, 1, 2, 3, 4, 5]);
    assert_eq!(ids[k..], [7, 250, 251, 252, 253, 254]);
    for t in 0..2 {
        let z = &logits[t * e..(t + 1) * e];
        let want = cpu::route(z, RouteBy::Learned { bias: &bias }, 0, k, 1.0);
        let got: Vec<usize> = ids[t * k..(t + 1) * k]
            .iter()
            .map(|&i| i as usize)
            .collect();
        assert_eq!(
            got,
            want.iter().map(|w| w.0).collect::<Vec<_>>(),
            "token {t}"
        );
    }
    let wts = dev.download(&wts).unwrap();
    assert!(
        wts[..k].iter().all(|&w| (w - 1.0 / 6.0).abs() < 1e-6),
        "{wts:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_route_topk_rejects_bad_shapes() {
    let dev = device();
    let logits = dev.alloc::<f32>(DType::F32, &[2, 8]).unwrap();
    let tokens = dev.alloc::<u32>(DType::U32, &[2]).unwrap();
    let bias = dev.alloc::<f32>(DType::F32, &[8]).unwrap();
    let by = DeviceRouteBy::Learned { bias: &bias };
    let mut w = dev.alloc::<f32>(DType::F32, &[2, 9]).unwrap();
    let mut ids = dev.alloc::<i32>(DType::I32, &[2, 9]).unwrap();
    assert!(
        route_topk(&dev, &logits, &tokens, by, 1.0, &mut ids, &mut w).is_err(),
        "k > E"
    );
    let mut w = dev.alloc::<f32>(DType::F32, &[2, 2]).unwrap();
    let mut ids = dev.alloc::<i32>(DType::I32, &[2, 2]).unwrap();
    route_topk(&dev, &logits, &tokens, by, 1.0, &mut ids, &mut w).unwrap();
    let many = dev.alloc::<f32>(DType::F32, &[2, MAX_EXPERTS + 1]).unwrap();
    let many_bias = dev.alloc::<f32>(DType::F32, &[MAX_EXPERTS + 1]).unwrap();
    let by_many = DeviceRouteBy::Learned { bias: &many_bias };
    assert!(
        route_topk(&dev, &many, &tokens, by_many, 1.0, &mut ids, &mut w).is_err(),
        "more experts than the kernel holds"
    );
    let table = dev.alloc::<u32>(DType::U32, &[5, 3]).unwrap();
    let hash = DeviceRouteBy::Hash { tid2eid: &table };
    assert!(
        route_topk(&dev, &logits, &tokens, hash, 1.0, &mut ids, &mut w).is_err(),
        "tid2eid width"
    );
}

/// Normal-ish f32 values of one random magnitude (2^-8 .. 2^8) per call.
fn random_f32(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
    let scale = 2f32.powi(rng.random_range(-8..8));
    (0..n)
        .map(|_| (rng.random::<f32>() + rng.random::<f32>() - 1.0) * scale)
        .collect()
}

/// Runs gate_logits on the first `t` tokens of `x` into poisoned logits.
fn run_gate(dev: &Device, x: &[f32], t: usize, d: usize, w: GateWeight<'_>, e: usize) -> Vec<f32> {
    let xd = dev.upload(DType::F32, &[t, d], &x[..t * d]).unwrap();
    let mut logits = dev.alloc::<f32>(DType::F32, &[t, e]).unwrap();
    dev.fill_bytes(&mut logits, POISON).unwrap();
    gate_logits(dev, &xd, w, &mut logits).unwrap();
    dev.download(&logits).unwrap()
}

/// The gate projection against its reference: `|got − want| ≤ 1e-5 · Σ_d |x_d · w_d|` per logit
/// (both are f32 sums of D products in different orders), bit-identical across launches and
/// for token 0 alone (a one-token launch takes the one-row blocks).
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gate_logits_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_gate_logits_matches_reference");
    let mut worst = 0f64;
    for iter in 0..16 {
        // (experts, D): Flash, Pro, the fixtures, random.
        let (e, d) = match iter % 5 {
            0 => (256, 4096),
            1 => (384, 7168),
            2 => (8, 64),
            3 => (16, 80),
            _ => (rng.random_range(1..40), 8 * rng.random_range(1..200)),
        };
        // Past 8 tokens the launch takes 8 expert rows a block (any E included).
        let t = if iter % 4 == 3 || iter % 5 == 4 {
            rng.random_range(17..200)
        } else {
            rng.random_range(1..=16)
        };
        let bf16_weight = iter % 2 == 0;
        let x = random_f32(&mut rng, t * d);
        let (wb, wf): (Vec<bf16>, Vec<f32>) = if bf16_weight {
            let wb: Vec<bf16> = random_f32(&mut rng, e * d)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let wf = wb.iter().map(|v| v.to_f32()).collect();
            (wb, wf)
        } else {
            (Vec::new(), random_f32(&mut rng, e * d))
        };
        let (wbd, wfd);
        let w = if bf16_weight {
            wbd = dev.upload(DType::BF16, &[e, d], &wb).unwrap();
            GateWeight::Bf16(&wbd)
        } else {
            wfd = dev.upload(DType::F32, &[e, d], &wf).unwrap();
            GateWeight::F32(&wfd)
        };
        let what = format!("iter {iter}: T {t}, E {e}, D {d}, bf16 weight {bf16_weight}");
        let got = run_gate(&dev, &x, t, d, w, e);
        let want = cpu::gate_logits(&x, &wf, t, e, d);
        for i in 0..t {
            for r in 0..e {
                let mag: f64 = (0..d)
                    .map(|c| (x[i * d + c] as f64 * wf[r * d + c] as f64).abs())
                    .sum();
                let (g, w) = (got[i * e + r], want[i * e + r]);
                let err = (g as f64 - w as f64).abs();
                assert!(
                    err <= 1e-5 * mag,
                    "{what}: logit [{i}, {r}] = {g} vs {w} (bound {})",
                    1e-5 * mag
                );
                if mag > 0.0 {
                    worst = worst.max(err / mag);
                }
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let again = run_gate(&dev, &x, t, d, w, e);
        assert_bits_eq(
            &format!("{what}: second launch"),
            &bits(&again),
            &bits(&got),
        );
        let alone = run_gate(&dev, &x, 1, d, w, e);
        assert_bits_eq(
            &format!("{what}: token 0 alone"),
            &bits(&alone),
            &bits(&got[..e]),
        );
    }
    println!("largest error / Σ|x·w|: {worst:.3e} (bound 1e-5)");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gate_logits_rejects_bad_shapes() {
    let dev = device();
    let x = dev.alloc::<f32>(DType::F32, &[2, 16]).unwrap();
    let w = dev.alloc::<bf16>(DType::BF16, &[4, 16]).unwrap();
    let w24 = dev.alloc::<f32>(DType::F32, &[4, 24]).unwrap();
    let mut logits = dev.alloc::<f32>(DType::F32, &[2, 4]).unwrap();
    gate_logits(&dev, &x, GateWeight::Bf16(&w), &mut logits).unwrap();
    assert!(
        gate_logits(&dev, &x, GateWeight::F32(&w24), &mut logits).is_err(),
        "weight width"
    );
    let mut l5 = dev.alloc::<f32>(DType::F32, &[2, 5]).unwrap();
    assert!(
        gate_logits(&dev, &x, GateWeight::Bf16(&w), &mut l5).is_err(),
        "logits shape"
    );
    let x12 = dev.alloc::<f32>(DType::F32, &[2, 12]).unwrap();
    let w12 = dev.alloc::<bf16>(DType::BF16, &[4, 12]).unwrap();
    assert!(
        gate_logits(&dev, &x12, GateWeight::Bf16(&w12), &mut logits).is_err(),
        "D not a multiple of 8"
    );
    let x0 = dev.alloc::<f32>(DType::F32, &[0, 16]).unwrap();
    let mut l0 = dev.alloc::<f32>(DType::F32, &[0, 4]).unwrap();
    gate_logits(&dev, &x0, GateWeight::Bf16(&w), &mut l0).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gate_route_is_gate_logits_then_route_topk() {
    // One launch against the two: the same logits, ids and weights bit for bit, over several
    // launches on one counter (the last block leaves it at zero), learned and hash routing,
    // BF16 and F32 gates, token counts from one to past one gate block's 64.
    let dev = device();
    let mut rng = rng("gpu_gate_route_is_gate_logits_then_route_topk");
    let mut counter = dev.alloc::<u32>(DType::U32, &[1]).unwrap();
    dev.fill_bytes(&mut counter, 0).unwrap();
    for iter in 0..24 {
        let (e, k) = [(256, 6), (384, 6), (16, 3)][iter % 3];
        let n = [1, 5, 70, 3, 16, 2][iter / 2 % 6];
        let d = 8 * rng.random_range(1..96);
        let vocab = 40;
        let x = random_f32(&mut rng, n * d);
        let w = random_f32(&mut rng, e * d);
        let xd = dev.upload(DType::F32, &[n, d], &x).unwrap();
        let w32 = dev.upload(DType::F32, &[e, d], &w).unwrap();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let w16 = dev.upload(DType::BF16, &[e, d], &wb).unwrap();
        let gate = if iter % 4 < 2 {
            GateWeight::Bf16(&w16)
        } else {
            GateWeight::F32(&w32)
        };
        let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
        let td = dev.upload(DType::U32, &[n], &tokens).unwrap();
        let bias = dev
            .upload(DType::F32, &[e], &random_f32(&mut rng, e))
            .unwrap();
        let table: Vec<u32> = (0..vocab * k).map(|i| (i as u32 * 7) % e as u32).collect();
        let hd = dev.upload(DType::U32, &[vocab, k], &table).unwrap();
        let by = if iter % 2 == 0 {
            DeviceRouteBy::Learned { bias: &bias }
        } else {
            DeviceRouteBy::Hash { tid2eid: &hd }
        };
        let outputs = || {
            let mut l = dev.alloc::<f32>(DType::F32, &[n, e]).unwrap();
            let mut i = dev.alloc::<i32>(DType::I32, &[n, k]).unwrap();
            let mut w = dev.alloc::<f32>(DType::F32, &[n, k]).unwrap();
            dev.fill_bytes(&mut l, POISON).unwrap();
            dev.fill_bytes(&mut i, POISON).unwrap();
            dev.fill_bytes(&mut w, POISON).unwrap();
            (l, i, w)
        };
        let (mut l1, mut i1, mut w1) = outputs();
        gate_logits(&dev, &xd, gate, &mut l1).unwrap();
        route_topk(&dev, &l1, &td, by, 2.5, &mut i1, &mut w1).unwrap();
        let (mut l2, mut i2, mut w2) = outputs();
        gate_route(
            &dev,
            &xd,
            gate,
            &td,
            by,
            2.5,
            &mut counter,
            &mut l2,
            &mut i2,
            &mut w2,
        )
        .unwrap();
        let what = format!("iter {iter}: {n} tokens, {e} experts, top-{k}, D {d}");
        assert_bits_eq(
            &format!("{what}: logits"),
            &dev.download(&l2).unwrap(),
            &dev.download(&l1).unwrap(),
        );
        assert_bits_eq(
            &format!("{what}: ids"),
            &dev.download(&i2).unwrap(),
            &dev.download(&i1).unwrap(),
        );
        assert_bits_eq(
            &format!("{what}: weights"),
            &dev.download(&w2).unwrap(),
            &dev.download(&w1).unwrap(),
        );
        assert_eq!(
            dev.download(&counter).unwrap(),
            [0],
            "{what}: counter reset"
        );
    }
    let x = dev.alloc::<f32>(DType::F32, &[1, 8]).unwrap();
    let w = dev.alloc::<f32>(DType::F32, &[4, 8]).unwrap();
    let t = dev.alloc::<u32>(DType::U32, &[1]).unwrap();
    let b = dev.alloc::<f32>(DType::F32, &[4]).unwrap();
    let (mut l, mut i, mut wt) = (
        dev.alloc::<f32>(DType::F32, &[1, 4]).unwrap(),
        dev.alloc::<i32>(DType::I32, &[1, 2]).unwrap(),
        dev.alloc::<f32>(DType::F32, &[1, 2]).unwrap(),
    );
    let mut two = dev.alloc::<u32>(DType::U32, &[2]).unwrap();
    let by = DeviceRouteBy::Learned { bias: &b };
    let err = gate_route(
        &dev,
        &x,
        GateWeight::F32(&w),
        &t,
        by,
        1.0,
        &mut two,
        &mut l,
        &mut i,
        &mut wt,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("router ticket counter"), "{err}");
}
