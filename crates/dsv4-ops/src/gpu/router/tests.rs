//! GPU tests of the router against its CPU reference on fresh random logits: the same experts
//! in the same order (tokens whose k-th and (k+1)-th biased scores lie within 1e-5 of each
//! other are skipped: expf/log1pf may move a score by an ulp), weights within 1e-6 relative.
//! All `#[ignore]`d: `cargo xtask gpu-test`.

use rand::seq::SliceRandom;
use rand::Rng;

use super::reference::{self as cpu, RouteBy};
use super::*;
use crate::gpu::rows::reference::softplus;
use crate::gpu::testing::{device, rng, POISON};

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_route_topk_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_route_topk_matches_reference");
    // (experts, k): Flash, Pro, the fixtures.
    let shapes = [(256, 6), (384, 6), (8, 2), (16, 3), (4, 4)];
    let (mut checked, mut skipped) = (0, 0);
    for iter in 0..20 {
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
    let table = dev.alloc::<u32>(DType::U32, &[5, 3]).unwrap();
    let hash = DeviceRouteBy::Hash { tid2eid: &table };
    assert!(
        route_topk(&dev, &logits, &tokens, hash, 1.0, &mut ids, &mut w).is_err(),
        "tid2eid width"
    );
}
