//! GPU tests of the grouped decode MoE against the f64 CPU reference, on fresh random experts,
//! routings and shapes; outputs poisoned before every launch. `#[ignore]`d like every GPU test.

mod common;

use common::{gaussian, TOL};
use dsv4_ops::gpu::testing::{assert_bits_eq, device, rng, POISON};

use dsv4_ops::codecs::{mxfp4, nvfp4};
use dsv4_ops::gpu::gemv::reference::relative_error;
use dsv4_ops::gpu::gemv::tuning;
use dsv4_ops::gpu::moe::{self, reference, HostExperts, MoeExperts, MoeFormat, MoeOut};
use dsv4_ops::gpu::{DType, Device, DeviceTensor};
use half::bf16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

/// Random experts quantized with the codecs, and their exact dequantized values.
struct Experts {
    gpu: MoeExperts,
    deq: Vec<[Vec<f32>; 3]>,
}

impl Experts {
    /// The dequantized experts as the CPU reference takes them.
    fn reference(&self) -> Vec<reference::ExpertF32<'_>> {
        self.deq
            .iter()
            .map(|w| reference::ExpertF32 {
                w1: &w[0],
                w3: &w[1],
                w2: &w[2],
            })
            .collect()
    }
}

fn make_experts(
    dev: &Device,
    rng: &mut StdRng,
    format: MoeFormat,
    e: usize,
    d: usize,
    inter: usize,
) -> Experts {
    let mats: Vec<[Vec<f32>; 3]> = (0..e)
        .map(|_| {
            [
                gaussian(rng, inter * d, 0.04),
                gaussian(rng, inter * d, 0.04),
                gaussian(rng, d * inter, 0.04),
            ]
        })
        .collect();
    match format {
        MoeFormat::Nvfp4 => {
            let mut q = [Vec::new(), Vec::new(), Vec::new()];
            for m in &mats {
                // w1 and w3 share one global scale (ModelOpt), w2 has its own.
                let amax = m[0].iter().chain(&m[1]).fold(0f32, |a, v| a.max(v.abs()));
                let g13 = nvfp4::global_scale(amax);
                q[0].push(nvfp4::quantize_with_global(&m[0], inter, d, g13).unwrap());
                q[1].push(nvfp4::quantize_with_global(&m[1], inter, d, g13).unwrap());
                q[2].push(nvfp4::quantize(&m[2], d, inter).unwrap());
            }
            let deq = (0..e)
                .map(|i| {
                    let dq = |x: &nvfp4::Nvfp4Quantized, r, c| {
                        nvfp4::dequantize(&x.weight, &x.weight_scale, x.weight_scale_2, r, c)
                            .unwrap()
                    };
                    [
                        dq(&q[0][i], inter, d),
                        dq(&q[1][i], inter, d),
                        dq(&q[2][i], d, inter),
                    ]
                })
                .collect();
            let host = HostExperts::Nvfp4 {
                w1: &q[0],
                w3: &q[1],
                w2: &q[2],
            };
            Experts {
                gpu: MoeExperts::upload(dev, host, d, inter).unwrap(),
                deq,
            }
        }
        MoeFormat::Mxfp4 => {
            let mut q = [Vec::new(), Vec::new(), Vec::new()];
            for m in &mats {
                q[0].push(mxfp4::quantize(&m[0], inter, d).unwrap());
                q[1].push(mxfp4::quantize(&m[1], inter, d).unwrap());
                q[2].push(mxfp4::quantize(&m[2], d, inter).unwrap());
            }
            let deq = (0..e)
                .map(|i| {
                    let dq = |x: &mxfp4::Mxfp4Quantized, r, c| {
                        mxfp4::dequantize(&x.weight, &x.scale, r, c).unwrap()
                    };
                    [
                        dq(&q[0][i], inter, d),
                        dq(&q[1][i], inter, d),
                        dq(&q[2][i], d, inter),
                    ]
                })
                .collect();
            let host = HostExperts::Mxfp4 {
                w1: &q[0],
                w3: &q[1],
                w2: &q[2],
            };
            Experts {
                gpu: MoeExperts::upload(dev, host, d, inter).unwrap(),
                deq,
            }
        }
    }
}

/// Distinct top-k ids per token (as a router gives), sometimes with an invalid slot.
fn routing(
    rng: &mut StdRng,
    m: usize,
    topk: usize,
    e: usize,
    invalid: bool,
) -> (Vec<i32>, Vec<f32>) {
    let mut ids = Vec::with_capacity(m * topk);
    for _ in 0..m {
        let mut all: Vec<i32> = (0..e as i32).collect();
        all.shuffle(rng);
        ids.extend_from_slice(&all[..topk]);
    }
    if invalid {
        let i = rng.random_range(0..ids.len());
        ids[i] = if rng.random() { -1 } else { e as i32 + 3 };
    }
    let weights = (0..m * topk)
        .map(|_| rng.random_range(0.05f32..1.5))
        .collect();
    (ids, weights)
}

#[allow(clippy::too_many_arguments)]
fn run(
    dev: &Device,
    ex: &Experts,
    x: &[bf16],
    m: usize,
    ids: &[i32],
    wts: &[f32],
    topk: usize,
    limit: f32,
    f32_out: bool,
) -> Vec<f64> {
    let (d, inter) = (ex.gpu.d(), ex.gpu.inter());
    let xd = dev.upload(DType::BF16, &[m, d], x).unwrap();
    let idd = dev.upload(DType::I32, &[m, topk], ids).unwrap();
    let wd = dev.upload(DType::F32, &[m, topk], wts).unwrap();
    let mut h: DeviceTensor<bf16> = dev.alloc(DType::BF16, &[m, topk, inter]).unwrap();
    dev.fill_bytes(&mut h, POISON).unwrap();
    if f32_out {
        let mut out: DeviceTensor<f32> = dev.alloc(DType::F32, &[m, d]).unwrap();
        dev.fill_bytes(&mut out, POISON).unwrap();
        moe::moe_decode(
            dev,
            &xd,
            &idd,
            &wd,
            &ex.gpu,
            limit,
            &mut h,
            MoeOut::F32(&mut out),
            || Ok(()),
        )
        .unwrap();
        let got = dev.download(&out).unwrap();
        // Added onto other values: one f32 add of the same sum each.
        let base: Vec<f32> = (0..m * d).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut onto = dev.upload(DType::F32, &[m, d], &base).unwrap();
        let o = MoeOut::F32Add(&mut onto);
        moe::moe_decode(dev, &xd, &idd, &wd, &ex.gpu, limit, &mut h, o, || Ok(())).unwrap();
        let want: Vec<f32> = base.iter().zip(&got).map(|(b, v)| b + v).collect();
        assert_bits_eq("added onto", &dev.download(&onto).unwrap(), &want);
        got.iter().map(|&v| v as f64).collect()
    } else {
        let mut out: DeviceTensor<bf16> = dev.alloc(DType::BF16, &[m, d]).unwrap();
        dev.fill_bytes(&mut out, POISON).unwrap();
        moe::moe_decode(
            dev,
            &xd,
            &idd,
            &wd,
            &ex.gpu,
            limit,
            &mut h,
            MoeOut::Bf16(&mut out),
            || Ok(()),
        )
        .unwrap();
        dev.download(&out)
            .unwrap()
            .iter()
            .map(|v| v.to_f64())
            .collect()
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_moe_matches_reference_on_random_routings() {
    let dev = device();
    let mut rng = rng("gpu_moe_matches_reference_on_random_routings");
    for format in [MoeFormat::Nvfp4, MoeFormat::Mxfp4] {
        for case in 0..4 {
            let e = rng.random_range(6..=24);
            let d = 32 * rng.random_range(2..=24);
            let inter = 32 * rng.random_range(1..=20);
            let ex = make_experts(&dev, &mut rng, format, e, d, inter);
            for _ in 0..3 {
                let m = rng.random_range(1..=16);
                let topk = rng.random_range(1..=6.min(e));
                let (ids, wts) = routing(&mut rng, m, topk, e, case % 2 == 1);
                let x: Vec<bf16> = gaussian(&mut rng, m * d, 1.0)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect();
                let limit = rng.random_range(0.3f32..3.0);
                let f32_out = rng.random();
                let got = run(&dev, &ex, &x, m, &ids, &wts, topk, limit, f32_out);
                let deq = ex.reference();
                let want = reference::moe(&x, m, d, inter, &ids, &wts, topk, &deq, limit as f64);
                let err = relative_error(&got, &want);
                println!(
                    "  {format:?} E={e:2} D={d:4} I={inter:4} M={m:2} k={topk} f32={f32_out:5}: rel err {err:.2e}"
                );
                assert!(
                    err <= TOL,
                    "{format:?} E={e} D={d} I={inter} M={m} k={topk}: relative error {err:e}"
                );
                // Again, then with activations read from global memory instead of staged.
                for staging in [true, false] {
                    tuning::STAGING.set(staging);
                    let again = run(&dev, &ex, &x, m, &ids, &wts, topk, limit, f32_out);
                    tuning::STAGING.set(true);
                    assert_bits_eq(&format!("launches (staging {staging})"), &again, &got);
                }
            }
        }
    }
}

/// Each of `tokens` run alone (f32 output, SwiGLU limit 2) gives the bits it got in the batch
/// `got` of [`run`] over `x`, `ids` and `wts`.
#[allow(clippy::too_many_arguments)]
fn assert_alone_as_in_batch(
    dev: &Device,
    ex: &Experts,
    x: &[bf16],
    ids: &[i32],
    wts: &[f32],
    topk: usize,
    got: &[f64],
    tokens: &[usize],
    what: &str,
) {
    let d = ex.gpu.d();
    for &t in tokens {
        let alone = run(
            dev,
            ex,
            &x[t * d..(t + 1) * d],
            1,
            &ids[t * topk..(t + 1) * topk],
            &wts[t * topk..(t + 1) * topk],
            topk,
            2.0,
            true,
        );
        assert_bits_eq(
            &format!("{what}: token {t} alone against in the batch"),
            &got[t * d..(t + 1) * d],
            &alone,
        );
    }
}

/// Routings at the decode kernels' edges, against the reference: more experts than one word of
/// the down kernel's expert bitmap holds (300), a token choosing one expert in two slots, a
/// zero routing weight, an invalid id, the most pairs a launch takes (16 tokens x 16 and one
/// token x 256), and high-id experts shared by all sixteen tokens (two units of eight). The
/// tokens with the duplicate and the zero weight give the same bits alone.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_moe_edge_routings_match_reference() {
    let dev = device();
    let mut rng = rng("gpu_moe_edge_routings_match_reference");
    let (e, d, inter) = (300, 64, 32);
    let ex = make_experts(&dev, &mut rng, MoeFormat::Nvfp4, e, d, inter);
    let deq = ex.reference();
    let check =
        |rng: &mut StdRng, name: &str, topk: usize, ids: &[i32], wts: &[f32], alone: &[usize]| {
            let m = ids.len() / topk;
            let x: Vec<bf16> = gaussian(rng, m * d, 1.0)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let got = run(&dev, &ex, &x, m, ids, wts, topk, 2.0, true);
            let want = reference::moe(&x, m, d, inter, ids, wts, topk, &deq, 2.0);
            let err = relative_error(&got, &want);
            println!("  {name}: M={m} k={topk}: rel err {err:.2e}");
            assert!(err <= TOL, "{name}: relative error {err:e}");
            assert_alone_as_in_batch(&dev, &ex, &x, ids, wts, topk, &got, alone, name);
        };
    let (mut ids, mut wts) = routing(&mut rng, 16, 16, e, false);
    ids[3 * 16 + 5] = ids[3 * 16 + 2];
    wts[7 * 16] = 0.0;
    ids[9 * 16 + 4] = -1;
    check(&mut rng, "16 x 16", 16, &ids, &wts, &[3, 7, 9]);
    let (ids, wts) = routing(&mut rng, 1, 256, e, false);
    check(&mut rng, "1 x 256", 256, &ids, &wts, &[]);
    let ids: Vec<i32> = (0..16 * 6).map(|i| 290 + (i % 6 + i / 6) % 10).collect();
    let wts: Vec<f32> = (0..16 * 6)
        .map(|_| rng.random_range(0.05f32..1.5))
        .collect();
    check(&mut rng, "shared high ids", 6, &ids, &wts, &[0, 15]);
}

/// The tensor-core expert kernels switched off until dropped (also when a test panics, so the
/// tests after it in the same binary run with the default).
struct WithoutTensorLists;

impl WithoutTensorLists {
    fn new() -> WithoutTensorLists {
        tuning::FP4_TENSOR_GEMM.set(false);
        WithoutTensorLists
    }
}

impl Drop for WithoutTensorLists {
    fn drop(&mut self) {
        tuning::FP4_TENSOR_GEMM.set(true);
    }
}

/// [`moe::moe_chunk`] for `x [m, d]` added onto `base`: the sums it added (f64) and the raw
/// output.
#[allow(clippy::too_many_arguments)]
fn run_chunk(
    dev: &Device,
    ex: &Experts,
    x: &[bf16],
    m: usize,
    ids: &[i32],
    wts: &[f32],
    topk: usize,
    limit: f32,
    base: &[f32],
) -> (Vec<f64>, Vec<f32>) {
    let (d, inter, e) = (ex.gpu.d(), ex.gpu.inter(), ex.gpu.experts());
    let xd = dev.upload(DType::BF16, &[m, d], x).unwrap();
    let idd = dev.upload(DType::I32, &[m, topk], ids).unwrap();
    let wd = dev.upload(DType::F32, &[m, topk], wts).unwrap();
    let mut scratch = moe::MoeChunkScratch {
        lists: dev.alloc(DType::U32, &[e, m * topk]).unwrap(),
        counts: dev.alloc(DType::U32, &[e]).unwrap(),
        h: dev.alloc(DType::BF16, &[m, topk, inter]).unwrap(),
        rows: dev.alloc(DType::F32, &[m * topk, d]).unwrap(),
        xp: dev.alloc(DType::BF16, &[m, d]).unwrap(),
    };
    dev.fill_bytes(&mut scratch.lists, POISON).unwrap();
    dev.fill_bytes(&mut scratch.counts, POISON).unwrap();
    dev.fill_bytes(&mut scratch.h, POISON).unwrap();
    dev.fill_bytes(&mut scratch.rows, POISON).unwrap();
    dev.fill_bytes(&mut scratch.xp, POISON).unwrap();
    let mut out = dev.upload(DType::F32, &[m, d], base).unwrap();
    moe::moe_chunk(
        dev,
        &xd,
        &idd,
        &wd,
        &ex.gpu,
        limit,
        &mut scratch,
        &mut out,
        || Ok(()),
    )
    .unwrap();
    let got: Vec<f32> = dev.download(&out).unwrap();
    let sums = got
        .iter()
        .zip(base)
        .map(|(&g, &b)| g as f64 - b as f64)
        .collect();
    (sums, got)
}

/// A chunk's inputs for [`moe::moe_chunk`]: unit-variance activations, a routing, the SwiGLU
/// limit and a base its output is added onto.
struct Chunk {
    x: Vec<bf16>,
    ids: Vec<i32>,
    wts: Vec<f32>,
    d: usize,
    topk: usize,
    limit: f32,
    base: Vec<f32>,
}

impl Chunk {
    fn random(rng: &mut StdRng, d: usize, topk: usize, ids: Vec<i32>, wts: Vec<f32>) -> Chunk {
        let m = ids.len() / topk;
        let x = gaussian(rng, m * d, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let limit = rng.random_range(0.3f32..3.0);
        let base = (0..m * d).map(|i| (i % 7) as f32 - 3.0).collect();
        Chunk {
            x,
            ids,
            wts,
            d,
            topk,
            limit,
            base,
        }
    }

    /// [`run_chunk`] over the first `m` tokens.
    fn run(&self, dev: &Device, ex: &Experts, m: usize) -> (Vec<f64>, Vec<f32>) {
        let (d, k) = (self.d, self.topk);
        run_chunk(
            dev,
            ex,
            &self.x[..m * d],
            m,
            &self.ids[..m * k],
            &self.wts[..m * k],
            k,
            self.limit,
            &self.base[..m * d],
        )
    }

    /// Checks the sums `got` of all the tokens against the f64 reference.
    fn check_reference(&self, ex: &Experts, got: &[f64], what: &str) {
        let (d, inter) = (self.d, ex.gpu.inter());
        let m = self.ids.len() / self.topk;
        let deq = ex.reference();
        let want = reference::moe(
            &self.x,
            m,
            d,
            inter,
            &self.ids,
            &self.wts,
            self.topk,
            &deq,
            self.limit as f64,
        );
        let err = relative_error(got, &want);
        println!("  {what}: rel err {err:.2e}");
        assert!(err <= TOL, "{what}: relative error {err:e}");
    }

    /// The first `part` tokens alone give the bits `raw` has for them.
    fn assert_prefix_alone(
        &self,
        dev: &Device,
        ex: &Experts,
        raw: &[f32],
        part: usize,
        what: &str,
    ) {
        let (_, alone) = self.run(dev, ex, part);
        assert_bits_eq(
            &format!("{what}: the first {part} tokens alone"),
            &alone,
            &raw[..part * self.d],
        );
    }
}

/// Every token's first slot on expert 0 (all of them in one list).
fn crowd_expert_zero(ids: &mut [i32], topk: usize) {
    for t in ids.chunks_mut(topk) {
        match t.iter().position(|&i| i == 0) {
            Some(j) => t.swap(0, j),
            None => t[0] = 0,
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_moe_chunk_matches_reference_and_rows_stay_independent() {
    // Chunks of 17 to 300 tokens over a dozen to 48 experts (some with no tokens; one with
    // every token), invalid slots included; then the chunk's first 40 tokens alone give the
    // same bits. The first chunk averages at most 8 rows an expert (16-row blocks), the
    // second 11 to 60 (32-row blocks).
    // The mma.sync kernels (sm_90a takes long lists onto the tensor-core kernels, tested below).
    let _mma = WithoutTensorLists::new();
    let dev = device();
    let mut rng = rng("gpu_moe_chunk_matches_reference_and_rows_stay_independent");
    for format in [MoeFormat::Nvfp4, MoeFormat::Mxfp4] {
        for case in 0..3 {
            let e = match case {
                0 => rng.random_range(13..=48),
                1 => rng.random_range(12..=15),
                _ => rng.random_range(12..=48),
            };
            let d = 32 * rng.random_range(2..=16);
            let inter = 32 * rng.random_range(1..=12);
            let ex = make_experts(&dev, &mut rng, format, e, d, inter);
            let m = [17, rng.random_range(40..=120), 300][case];
            let topk = match case {
                1 => rng.random_range(4..=6),
                _ => rng.random_range(1..=6),
            };
            let (mut ids, wts) = routing(&mut rng, m, topk, e, case == 0);
            if case == 2 {
                // 300 rows on expert 0: several row blocks of one launch block in turn.
                crowd_expert_zero(&mut ids, topk);
            }
            let chunk = Chunk::random(&mut rng, d, topk, ids, wts);
            let what = format!("chunk {format:?} E={e:2} D={d:4} I={inter:4} M={m:3} k={topk}");
            let (got, raw) = chunk.run(&dev, &ex, m);
            chunk.check_reference(&ex, &got, &what);
            chunk.assert_prefix_alone(&dev, &ex, &raw, 40.min(m - 1), &what);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_moe_chunk_on_tensor_cores_matches_reference() {
    // Lists of more than 64 rows an expert on average, D and I multiples of 128: on sm_90a the
    // tensor-core kernels (x permuted, h kept permuted between them). Partial 128-row blocks,
    // an empty expert (case 1), one expert with every token (case 2: a launch block walks
    // several row blocks); against the f64 reference and the 64-row kernels, and the first
    // half of the tokens alone (still long lists) give the same bits.
    let dev = device();
    let mut rng = rng("gpu_moe_chunk_on_tensor_cores_matches_reference");
    for format in [MoeFormat::Nvfp4, MoeFormat::Mxfp4] {
        for case in 0..3 {
            let e = rng.random_range(4..=6);
            let d = 128 * rng.random_range(1..=4);
            let inter = 128 * rng.random_range(1..=3);
            let ex = make_experts(&dev, &mut rng, format, e, d, inter);
            let m = [
                rng.random_range(300..=500),
                rng.random_range(600..=900),
                700,
            ][case];
            let topk = rng.random_range(3..=4);
            let (mut ids, wts) = routing(&mut rng, m, topk, e + (case == 1) as usize, case == 0);
            if case == 2 {
                crowd_expert_zero(&mut ids, topk);
            }
            if case == 1 {
                // Expert e - 1 gets no rows: its slots go to the slot past the experts (dropped).
                for i in ids.iter_mut().filter(|i| **i == e as i32 - 1) {
                    *i = e as i32;
                }
            }
            let chunk = Chunk::random(&mut rng, d, topk, ids, wts);
            let what = format!("tensor chunk {format:?} E={e} D={d} I={inter} M={m} k={topk}");
            let part = m / 2;
            let sm90a = dev.arch() == dsv4_ops::gpu::Arch::Sm90a;
            for n in [m, part] {
                let on = moe::chunk_on_tensor_cores(&dev, n, topk, &ex.gpu);
                assert_eq!(on, sm90a, "{what}: {n} tokens");
            }
            let (got, raw) = chunk.run(&dev, &ex, m);
            chunk.check_reference(&ex, &got, &what);
            let off = WithoutTensorLists::new();
            let (rows64, raw64) = chunk.run(&dev, &ex, m);
            drop(off);
            let apart = relative_error(&got, &rows64);
            let same = raw
                .iter()
                .zip(&raw64)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            println!(
                "  {what}: against the 64-row kernels {apart:.2e}, {same} of {} bits equal",
                raw.len()
            );
            assert!(apart <= TOL, "{what}: {apart:e} from the 64-row kernels");
            chunk.assert_prefix_alone(&dev, &ex, &raw, part, &what);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_moe_token_output_does_not_depend_on_the_other_tokens() {
    let dev = device();
    let mut rng = rng("gpu_moe_token_output_does_not_depend_on_the_other_tokens");
    let (e, d, inter, topk) = (12, 256, 128, 4);
    let ex = make_experts(&dev, &mut rng, MoeFormat::Nvfp4, e, d, inter);
    // Sixteen tokens, all of which choose expert 5 (two groups of eight columns in both
    // kernels) beside experts chosen by a few or one of them.
    let m = 16;
    let (mut ids, wts) = routing(&mut rng, m, topk, e, false);
    for t in 0..m {
        let row = &mut ids[t * topk..(t + 1) * topk];
        if !row.contains(&5) {
            row[rng.random_range(0..topk)] = 5;
        }
    }
    let x: Vec<bf16> = gaussian(&mut rng, m * d, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let batch = run(&dev, &ex, &x, m, &ids, &wts, topk, 2.0, true);
    // Every token alone gives bit-identical output: per-token sums run in ascending expert
    // order, and an MMA column's sum does not depend on the other columns.
    let all: Vec<usize> = (0..m).collect();
    assert_alone_as_in_batch(&dev, &ex, &x, &ids, &wts, topk, &batch, &all, "16 tokens");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_random_experts_give_finite_unit_order_outputs() {
    // Experts generated on the device for synthetic benchmarks: every format's grouped MoE
    // turns a unit-variance token into finite outputs of unit order, the same for the same seed.
    use dsv4_ops::gpu::moe_bf16::{self, Bf16Experts};
    let dev = device();
    let mut rng = rng("gpu_random_experts_give_finite_unit_order_outputs");
    let (e, d, inter, topk) = (16, 1024, 512, 4);
    let x = dev
        .upload(
            DType::BF16,
            &[1, d],
            &common::to_bf16(&gaussian(&mut rng, d, 1.0)),
        )
        .unwrap();
    let ids = dev
        .upload(DType::I32, &[1, topk], &[3i32, 7, 8, 15])
        .unwrap();
    let w = dev.upload(DType::F32, &[1, topk], &[0.25f32; 4]).unwrap();
    let check = |what: &str, out: &[f32], again: &[f32]| {
        assert!(out.iter().all(|v| v.is_finite()), "{what}: {out:?}");
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / d as f32).sqrt();
        println!("  {what}: output RMS {rms:.3}");
        assert!((0.02..5.0).contains(&rms), "{what}: output RMS {rms}");
        assert_bits_eq(&format!("{what}, same seed"), again, out);
    };
    for format in [MoeFormat::Nvfp4, MoeFormat::Mxfp4] {
        let seed: u64 = rng.random();
        let run = || {
            let ex = MoeExperts::random(&dev, format, e, d, inter, seed).unwrap();
            let mut h = dev.alloc(DType::BF16, &[1, topk, inter]).unwrap();
            let mut out = dev.alloc(DType::F32, &[1, d]).unwrap();
            dev.fill_bytes(&mut out, POISON).unwrap();
            let o = MoeOut::F32(&mut out);
            moe::moe_decode(&dev, &x, &ids, &w, &ex, 10.0, &mut h, o, || Ok(())).unwrap();
            dev.download(&out).unwrap()
        };
        check(&format!("{format:?}"), &run(), &run());
    }
    let seed: u64 = rng.random();
    let run = || {
        let ex = Bf16Experts::random(&dev, e, d, inter, seed).unwrap();
        let mut h = dev.alloc(DType::F32, &[1, topk, inter]).unwrap();
        let mut out = dev.alloc(DType::F32, &[1, d]).unwrap();
        dev.fill_bytes(&mut out, POISON).unwrap();
        moe_bf16::moe_bf16(
            &dev,
            &x,
            &ids,
            &w,
            &ex,
            10.0,
            &mut h,
            &mut out,
            false,
            || Ok(()),
        )
        .unwrap();
        dev.download(&out).unwrap()
    };
    check("bf16", &run(), &run());
    let err = MoeExperts::random(&dev, MoeFormat::Nvfp4, 4, 1024, 48, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("I = 48") && err.contains("multiples of 32"),
        "{err}"
    );
}

/// The loader stacks experts on the device exactly as the host reference packs them, expert
/// by expert, whatever the staging buffers' size.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_loaded_experts_hold_the_host_reference_bytes() {
    use dsv4_ops::gpu::gemv::HostWeight;
    let dev = device();
    let mut rng = rng("gpu_loaded_experts_hold_the_host_reference_bytes");
    for (i, format) in [MoeFormat::Nvfp4, MoeFormat::Mxfp4]
        .iter()
        .cycle()
        .take(6)
        .enumerate()
    {
        let (e, d, inter) = (
            rng.random_range(1..9),
            32 * rng.random_range(1..9),
            32 * rng.random_range(1..9),
        );
        let shapes = [(inter, d), (inter, d), (d, inter)];
        let nv: Vec<[nvfp4::Nvfp4Quantized; 3]> = (0..e)
            .map(|_| {
                shapes
                    .map(|(r, c)| nvfp4::quantize(&gaussian(&mut rng, r * c, 0.04), r, c).unwrap())
            })
            .collect();
        let mx: Vec<[mxfp4::Mxfp4Quantized; 3]> = (0..e)
            .map(|_| {
                shapes
                    .map(|(r, c)| mxfp4::quantize(&gaussian(&mut rng, r * c, 0.04), r, c).unwrap())
            })
            .collect();
        let host: Vec<[HostWeight<'_>; 3]> = match format {
            MoeFormat::Nvfp4 => nv
                .iter()
                .map(|m| [0, 1, 2].map(|j| HostWeight::from(&m[j])))
                .collect(),
            MoeFormat::Mxfp4 => mx
                .iter()
                .map(|m| [0, 1, 2].map(|j| HostWeight::from(&m[j])))
                .collect(),
        };
        let slot = [1 << 13, 1 << 26][i % 2];
        let mut st = dsv4_ops::gpu::Stager::new(&dev, slot).unwrap();
        let got = MoeExperts::load(&mut st, &host, d, inter).unwrap();
        let want = reference::packed(&host, *format, d, inter).unwrap();
        let got = got.download(&dev).unwrap();
        for (j, name) in ["w13", "s13", "w2", "s2"].iter().enumerate() {
            assert!(
                got[j] == want[j],
                "{format:?} {e} experts D {d} I {inter}: {name}"
            );
        }
        // One expert of the other format, and one cut short, are refused by name.
        let mut mixed = host.clone();
        mixed.push([0, 1, 2].map(|j| match format {
            MoeFormat::Nvfp4 => HostWeight::from(&mx[0][j]),
            MoeFormat::Mxfp4 => HostWeight::from(&nv[0][j]),
        }));
        let err = MoeExperts::load(&mut st, &mixed, d, inter)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains(&format!("expert {e} w1")) && err.contains("format"),
            "{err}"
        );
        let mut short = host.clone();
        short[0][2] = match short[0][2] {
            HostWeight::Nvfp4 {
                weight,
                weight_scale,
                weight_scale_2,
            } => HostWeight::Nvfp4 {
                weight: &weight[1..],
                weight_scale,
                weight_scale_2,
            },
            HostWeight::Mxfp4 { weight, scale } => HostWeight::Mxfp4 {
                weight: &weight[1..],
                scale,
            },
            other => other,
        };
        let err = MoeExperts::load(&mut st, &short, d, inter)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("expert 0 w2") && err.contains("code and"),
            "{err}"
        );
    }
}
