//! GPU tests of the BF16 routed experts against the CPU reference, on fresh random weights,
//! inputs and routings of random shapes (and the real Flash and Pro widths), with `h` and `out`
//! poisoned before every launch.
//!
//! Bound: both sides sum in f32 in different orders, so each value is compared with a bound
//! built in f64 from the magnitudes it is made of. For intermediate `c` of a (token, expert)
//! pair, with `G = Σ|W1[c]·x|`, `U = Σ|W3[c]·x|` and the exact `g`, `u`, `h`:
//! `sens_c = |h_c| + 1.1·min(|u_c|, L)·G + |silu(min(g_c, L))|·U` (1.1 bounds |silu'|), and
//! `|h_gpu − h_cpu| ≤ 1e-5 · sens_c`; each output
//! `|out_gpu − out_cpu| ≤ 1e-5 · Σⱼ |wⱼ| · Σ_c |W2[r, c]| · sens_c` (zero, so exact, for a token
//! without a valid expert), each bound plus an absolute floor of a few f32 subnormal steps. Rounding errors of f32 sums of up to 7168 terms stay far below
//! 1e-5 of their absolute sums in practice (~1e-6). Also checked: the output is bit-identical
//! across two launches and, for token 0, to a launch with token 0 alone.
//! All `#[ignore]`d: `cargo xtask gpu-test`.

use half::bf16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

use super::reference::{self as cpu, HostExpert};
use super::*;
use crate::gpu::testing::{assert_bits_eq, device, random_bf16, rng, POISON};

const TOL: f64 = 1e-5;
/// An absolute floor of 4 f32 subnormal steps (2^-147) on every bound: wide-range values can
/// give subnormal intermediates, whose rounding is absolute.
const ABS: f64 = 5.605193857299268e-45;

struct Case {
    e: usize,
    d: usize,
    inter: usize,
    m: usize,
    k: usize,
    w1: Vec<Vec<bf16>>,
    w3: Vec<Vec<bf16>>,
    w2: Vec<Vec<bf16>>,
    x: Vec<bf16>,
    ids: Vec<i32>,
    wts: Vec<f32>,
    limit: f32,
}

impl Case {
    fn host(&self) -> Vec<HostExpert<'_>> {
        (0..self.e)
            .map(|i| HostExpert {
                w1: &self.w1[i],
                w3: &self.w3[i],
                w2: &self.w2[i],
            })
            .collect()
    }

    fn describe(&self) -> String {
        format!(
            "E {} D {} I {} M {} k {} limit {}",
            self.e, self.d, self.inter, self.m, self.k, self.limit
        )
    }
}

/// Uniform in ±scale, rounded to bf16.
fn uniform_bf16(rng: &mut StdRng, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0) * scale))
        .collect()
}

/// How a case picks its expert ids.
#[derive(Clone, Copy, Debug)]
enum Routing {
    /// Distinct ids per token from all experts and a few invalid ids.
    Spread,
    /// Distinct ids per token from at most 3 experts and the invalid ids: many tokens share an
    /// expert (one weight pass serving up to 16 tokens).
    Crowded,
    /// Ids drawn with repetition (outside the router's contract, defined by the reference):
    /// an expert may be chosen by more than 16 pairs.
    Repeated,
}

/// Expert ids `[m, k]` (k may shrink to the number of candidates) and routing weights.
fn routing(rng: &mut StdRng, e: usize, m: usize, k: usize, how: Routing) -> (usize, Vec<i32>) {
    let invalid = [-1, e as i32, e as i32 + 7, i32::MIN, i32::MAX];
    let valid: Vec<i32> = match how {
        Routing::Spread => (0..e as i32).collect(),
        Routing::Crowded | Routing::Repeated => (0..e.min(3) as i32).collect(),
    };
    let mut cands: Vec<i32> = valid.iter().copied().chain(invalid).collect();
    let k = match how {
        Routing::Repeated => k,
        _ => k.min(cands.len()),
    };
    let ids = (0..m)
        .flat_map(|_| match how {
            Routing::Repeated => (0..k)
                .map(|_| {
                    if rng.random_range(0..4) == 0 {
                        invalid[rng.random_range(0..invalid.len())]
                    } else {
                        valid[rng.random_range(0..valid.len())]
                    }
                })
                .collect::<Vec<i32>>(),
            _ => {
                cands.shuffle(rng);
                cands[..k].to_vec()
            }
        })
        .collect();
    (k, ids)
}

#[allow(clippy::too_many_arguments)]
fn make_case(
    rng: &mut StdRng,
    e: usize,
    d: usize,
    inter: usize,
    m: usize,
    k: usize,
    how: Routing,
    wide: bool,
) -> Case {
    let (k, ids) = routing(rng, e, m, k, how);
    // No infinite limit with wide-range values: h could overflow.
    let limit = [10.0, 10.0, rng.random_range(0.25f32..8.0), f32::INFINITY]
        [rng.random_range(0..if wide { 3 } else { 4 })];
    let (w_scale, x_scale) = (2.0 / (d as f32).sqrt(), 2f32.powi(rng.random_range(-2..=3)));
    let mat = |rng: &mut StdRng, n: usize| {
        if wide {
            random_bf16(rng, n, false)
        } else {
            uniform_bf16(rng, n, w_scale)
        }
    };
    let w1 = (0..e).map(|_| mat(rng, inter * d)).collect();
    let w3 = (0..e).map(|_| mat(rng, inter * d)).collect();
    let w2 = (0..e)
        .map(|_| {
            if wide {
                random_bf16(rng, d * inter, false)
            } else {
                uniform_bf16(rng, d * inter, 2.0 / (inter as f32).sqrt())
            }
        })
        .collect();
    let x = if wide {
        random_bf16(rng, m * d, false)
    } else {
        uniform_bf16(rng, m * d, x_scale)
    };
    let wts = (0..m * k)
        .map(|_| {
            if rng.random_range(0..10) == 0 {
                0.0
            } else {
                rng.random_range(0.0f32..2.0)
            }
        })
        .collect();
    Case {
        e,
        d,
        inter,
        m,
        k,
        w1,
        w3,
        w2,
        x,
        ids,
        wts,
        limit,
    }
}

/// Per (token, slot): for a valid expert, the f64 sensitivity `sens_c` of each intermediate
/// (see the module doc); `None` for an invalid id.
fn sensitivities(c: &Case) -> Vec<Option<Vec<f64>>> {
    let l = c.limit as f64;
    (0..c.m * c.k)
        .map(|p| {
            let id = c.ids[p];
            if id < 0 || id as usize >= c.e {
                return None;
            }
            let t = p / c.k;
            let x: Vec<f64> = c.x[t * c.d..(t + 1) * c.d]
                .iter()
                .map(|v| v.to_f64())
                .collect();
            let (w1, w3) = (&c.w1[id as usize], &c.w3[id as usize]);
            let sens = (0..c.inter)
                .map(|r| {
                    let (mut g, mut gm, mut u, mut um) = (0f64, 0f64, 0f64, 0f64);
                    for (i, &xv) in x.iter().enumerate() {
                        let a = w1[r * c.d + i].to_f64() * xv;
                        let b = w3[r * c.d + i].to_f64() * xv;
                        g += a;
                        gm += a.abs();
                        u += b;
                        um += b.abs();
                    }
                    let gc = g.min(l);
                    let s = gc / (1.0 + (-gc).exp());
                    let h = s * u.clamp(-l, l);
                    h.abs() + 1.1 * u.abs().min(l) * gm + s.abs() * um
                })
                .collect();
            Some(sens)
        })
        .collect()
}

/// Uploads the case's first `m` tokens, runs the launcher on poisoned `h` and `out`, returns
/// both.
fn run(dev: &Device, ex: &Bf16Experts, c: &Case, m: usize) -> (Vec<f32>, Vec<f32>) {
    let (d, k) = (c.d, c.k);
    let x = dev.upload(DType::BF16, &[m, d], &c.x[..m * d]).unwrap();
    let ids = dev.upload(DType::I32, &[m, k], &c.ids[..m * k]).unwrap();
    let wts = dev.upload(DType::F32, &[m, k], &c.wts[..m * k]).unwrap();
    let mut h = dev.alloc::<f32>(DType::F32, &[m, k, c.inter]).unwrap();
    let mut out = dev.alloc::<f32>(DType::F32, &[m, d]).unwrap();
    dev.fill_bytes(&mut h, POISON).unwrap();
    dev.fill_bytes(&mut out, POISON).unwrap();
    moe_bf16(
        dev,
        &x,
        &ids,
        &wts,
        ex,
        c.limit,
        &mut h,
        &mut out,
        false,
        || Ok(()),
    )
    .unwrap();
    let got = dev.download(&out).unwrap();
    // Accumulated onto other values: one f32 add of the same sum each.
    let base: Vec<f32> = (0..m * d).map(|i| (i % 7) as f32 - 3.0).collect();
    let mut onto = dev.upload(DType::F32, &[m, d], &base).unwrap();
    moe_bf16(
        dev,
        &x,
        &ids,
        &wts,
        ex,
        c.limit,
        &mut h,
        &mut onto,
        true,
        || Ok(()),
    )
    .unwrap();
    let want: Vec<f32> = base.iter().zip(&got).map(|(b, v)| b + v).collect();
    assert_eq!(
        bits(&dev.download(&onto).unwrap()),
        bits(&want),
        "accumulated"
    );
    (got, dev.download(&h).unwrap())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_moe_bf16_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_moe_bf16_matches_reference");
    let mut worst = 0f64;
    for iter in 0..18 {
        let how = [Routing::Spread, Routing::Crowded, Routing::Repeated][iter % 3];
        let c = match iter {
            // Flash and Pro widths (E kept small: the weights are 50 / 132 MB an expert).
            0 | 7 => {
                let m = rng.random_range(1..=3);
                make_case(&mut rng, 8, 4096, 2048, m, 6, how, false)
            }
            4 => {
                let m = rng.random_range(1..=2);
                make_case(&mut rng, 4, 7168, 3072, m, 6, how, false)
            }
            _ => {
                let e = rng.random_range(1..=24);
                let d = 8 * rng.random_range(1..=96);
                let inter = 8 * rng.random_range(1..=64);
                let m = if iter % 2 == 0 {
                    16
                } else {
                    rng.random_range(1..=16)
                };
                let k = rng.random_range(1..=8);
                make_case(&mut rng, e, d, inter, m, k, how, iter % 5 == 3)
            }
        };
        let what = format!("iter {iter} ({:?}: {})", how, c.describe());
        let host = c.host();
        let w1: Vec<&[bf16]> = c.w1.iter().map(Vec::as_slice).collect();
        let w3: Vec<&[bf16]> = c.w3.iter().map(Vec::as_slice).collect();
        let w2: Vec<&[bf16]> = c.w2.iter().map(Vec::as_slice).collect();
        let ex = Bf16Experts::upload(&dev, &w1, &w3, &w2, c.d, c.inter).unwrap();
        assert_eq!(
            (ex.experts(), ex.d(), ex.inter(), ex.expert_bytes()),
            (c.e, c.d, c.inter, 6 * c.d * c.inter)
        );

        let (out, h) = run(&dev, &ex, &c, c.m);
        let want = cpu::moe_bf16(&c.x, c.m, c.d, c.inter, &c.ids, &c.wts, c.k, &host, c.limit);
        let sens = sensitivities(&c);

        // h of every valid pair.
        for (p, s) in sens.iter().enumerate() {
            let Some(s) = s else { continue };
            let t = p / c.k;
            let xt: Vec<f32> = c.x[t * c.d..(t + 1) * c.d]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let hw = cpu::gate_up(&host[c.ids[p] as usize], c.d, c.inter, &xt, c.limit);
            for (i, (&got, &w)) in h[p * c.inter..(p + 1) * c.inter]
                .iter()
                .zip(&hw)
                .enumerate()
            {
                let err = (got as f64 - w as f64).abs();
                let b = TOL * s[i] + ABS;
                assert!(
                    err <= b,
                    "{what}: h of pair {p} (expert {}) at {i}: {got} vs {w} (bound {b})",
                    c.ids[p],
                );
            }
        }
        // Every output.
        for t in 0..c.m {
            // Σⱼ |wⱼ| Σ_c |W2[r, c]| · sens_c, and the same without sens (for the floor).
            let mut bound = vec![0f64; c.d];
            let mut floor = vec![0f64; c.d];
            for j in 0..c.k {
                let Some(s) = &sens[t * c.k + j] else {
                    continue;
                };
                let w2 = &c.w2[c.ids[t * c.k + j] as usize];
                let wt = (c.wts[t * c.k + j] as f64).abs();
                for (r, (b, f)) in bound.iter_mut().zip(&mut floor).enumerate() {
                    let row = &w2[r * c.inter..(r + 1) * c.inter];
                    *b += wt
                        * row
                            .iter()
                            .zip(s)
                            .map(|(w, s)| w.to_f64().abs() * s)
                            .sum::<f64>();
                    *f += wt * row.iter().map(|w| w.to_f64().abs()).sum::<f64>();
                }
            }
            for r in 0..c.d {
                let (got, w) = (out[t * c.d + r], want[t * c.d + r]);
                let err = (got as f64 - w as f64).abs();
                let b = TOL * bound[r] + ABS * (1.0 + floor[r]);
                assert!(
                    err <= b,
                    "{what}: out[{t}, {r}] = {got} vs {w} (bound {b}; ids {:?})",
                    &c.ids[t * c.k..(t + 1) * c.k]
                );
                if bound[r] > 0.0 {
                    worst = worst.max(err / bound[r]);
                }
            }
        }

        // Bit-identical across launches, and token 0 alone gives its row of the batch.
        let (again, _) = run(&dev, &ex, &c, c.m);
        assert_bits_eq(
            &format!("{what}: second launch"),
            &bits(&again),
            &bits(&out),
        );
        let (alone, _) = run(&dev, &ex, &c, 1);
        assert_bits_eq(
            &format!("{what}: token 0 alone"),
            &bits(&alone),
            &bits(&out[..c.d]),
        );
    }
    println!("largest error / (its bound / TOL): {worst:.3e} (TOL {TOL:e})");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_moe_bf16_rejects_bad_shapes() {
    let dev = device();
    let (e, d, inter) = (3, 16, 8);
    let z = vec![bf16::ZERO; d * inter];
    let mats: Vec<&[bf16]> = vec![&z; e];
    let short = vec![bf16::ZERO; d * inter - 1];
    let mut bad = mats.clone();
    bad[1] = &short;
    assert!(
        Bf16Experts::upload(&dev, &bad, &mats, &mats, d, inter).is_err(),
        "w1 length"
    );
    assert!(
        Bf16Experts::upload(&dev, &mats, &mats[..2], &mats, d, inter).is_err(),
        "expert counts"
    );
    let z12 = vec![bf16::ZERO; 12 * inter];
    let m12: Vec<&[bf16]> = vec![&z12; e];
    assert!(
        Bf16Experts::upload(&dev, &m12, &m12, &m12, 12, inter).is_err(),
        "D not a multiple of 8"
    );
    assert!(
        Bf16Experts::upload(&dev, &[], &[], &[], d, inter).is_err(),
        "no experts"
    );
    let ex = Bf16Experts::upload(&dev, &mats, &mats, &mats, d, inter).unwrap();

    let call = |m: usize, k: usize, xd: usize, hs: [usize; 3], od: [usize; 2], limit: f32| {
        let x = dev.alloc::<bf16>(DType::BF16, &[m, xd]).unwrap();
        let ids = dev.alloc::<i32>(DType::I32, &[m, k]).unwrap();
        let w = dev.alloc::<f32>(DType::F32, &[m, k]).unwrap();
        let mut h = dev.alloc::<f32>(DType::F32, &hs).unwrap();
        let mut out = dev.alloc::<f32>(DType::F32, &od).unwrap();
        moe_bf16(
            &dev,
            &x,
            &ids,
            &w,
            &ex,
            limit,
            &mut h,
            &mut out,
            false,
            || Ok(()),
        )
    };
    call(2, 3, d, [2, 3, inter], [2, d], 10.0).unwrap();
    for (what, m, k, xd, hs, od, limit) in [
        ("x width", 2, 3, d + 8, [2, 3, inter], [2, d + 8], 10.0),
        ("M > 16", 17, 1, d, [17, 1, inter], [17, d], 10.0),
        ("M * k > 256", 16, 17, d, [16, 17, inter], [16, d], 10.0),
        ("h shape", 2, 3, d, [2, 3, inter + 8], [2, d], 10.0),
        ("out shape", 2, 3, d, [2, 3, inter], [3, d], 10.0),
        ("limit 0", 2, 3, d, [2, 3, inter], [2, d], 0.0),
        ("limit NaN", 2, 3, d, [2, 3, inter], [2, d], f32::NAN),
    ] {
        assert!(call(m, k, xd, hs, od, limit).is_err(), "{what}");
    }
    // Weights of another shape than the ids.
    let x = dev.alloc::<bf16>(DType::BF16, &[2, d]).unwrap();
    let ids = dev.alloc::<i32>(DType::I32, &[2, 3]).unwrap();
    let w = dev.alloc::<f32>(DType::F32, &[2, 2]).unwrap();
    let mut h = dev.alloc::<f32>(DType::F32, &[2, 3, inter]).unwrap();
    let mut out = dev.alloc::<f32>(DType::F32, &[2, d]).unwrap();
    assert!(moe_bf16(
        &dev,
        &x,
        &ids,
        &w,
        &ex,
        10.0,
        &mut h,
        &mut out,
        false,
        || Ok(())
    )
    .is_err());
}

#[test]
fn args_layout_matches_the_cuda_struct() {
    // 8 pointers, 5 u32, one f32 and the u32 flag, padded to the pointers' 8 bytes.
    assert_eq!(std::mem::size_of::<MoeBf16Args>(), 96);
    assert_eq!(std::mem::offset_of!(MoeBf16Args, accumulate), 88);
}
