//! GPU tests of the decode GEMV kernels against the f64 CPU references, on fresh random inputs
//! of random shapes (N and K off the tile sizes), with outputs poisoned before every launch.
//! `#[ignore]`d like every GPU test: `cargo xtask gpu-test`, then run with `--ignored gpu`.

mod common;

use common::{gaussian, to_bf16, TOL};
use dsv4_ops::gpu::testing::{assert_bits_eq, device, rng, POISON};

use dsv4_ops::codecs::fp8_block::{self, ScaleFormat};
use dsv4_ops::codecs::{mxfp4, nvfp4};
use dsv4_ops::gpu::gemv::{self, reference, GemvWeight, GemvWorkspace, HostWeight};
use dsv4_ops::gpu::{DType, Device, DeviceTensor};
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

/// Owned host weight data in each format, made by quantizing random f32 weights with the codecs.
enum Owned {
    Bf16(Vec<bf16>),
    Fp8 {
        weight: Vec<u8>,
        scale: Vec<u8>,
        format: ScaleFormat,
    },
    Nvfp4(nvfp4::Nvfp4Quantized),
    Mxfp4(mxfp4::Mxfp4Quantized),
}

impl Owned {
    fn host(&self) -> HostWeight<'_> {
        match self {
            Owned::Bf16(v) => HostWeight::Bf16(v),
            Owned::Fp8 {
                weight,
                scale,
                format,
            } => HostWeight::Fp8 {
                weight,
                scale,
                format: *format,
                block: (128, 128),
            },
            Owned::Nvfp4(q) => HostWeight::from(q),
            Owned::Mxfp4(q) => HostWeight::from(q),
        }
    }
}

const FORMATS: [&str; 5] = ["bf16", "fp8-e8m0", "fp8-f32", "nvfp4", "mxfp4"];

fn chunk(format: &str) -> usize {
    match format {
        "bf16" => 8,
        "fp8-e8m0" | "fp8-f32" => 16,
        _ => 32,
    }
}

fn make_weight(rng: &mut StdRng, format: &str, n: usize, k: usize, global: Option<f32>) -> Owned {
    // Per-row magnitudes spread over a few octaves, as in real checkpoints.
    let mut w = gaussian(rng, n * k, 0.05);
    for r in 0..n {
        let f = 2f32.powi(rng.random_range(-3..3));
        w[r * k..(r + 1) * k].iter_mut().for_each(|v| *v *= f);
    }
    match format {
        "bf16" => Owned::Bf16(to_bf16(&w)),
        "fp8-e8m0" | "fp8-f32" => {
            let f = if format == "fp8-f32" {
                ScaleFormat::F32
            } else {
                ScaleFormat::E8m0
            };
            let q = fp8_block::quantize(&w, n, k, f, 128).unwrap();
            Owned::Fp8 {
                weight: q.weight,
                scale: q.scale,
                format: f,
            }
        }
        "nvfp4" => Owned::Nvfp4(match global {
            Some(g) => nvfp4::quantize_with_global(&w, n, k, g).unwrap(),
            None => nvfp4::quantize(&w, n, k).unwrap(),
        }),
        "mxfp4" => Owned::Mxfp4(mxfp4::quantize(&w, n, k).unwrap()),
        _ => unreachable!(),
    }
}

fn poisoned(dev: &Device, m: usize, n: usize) -> DeviceTensor<bf16> {
    let mut t = dev.alloc(DType::BF16, &[m, n]).unwrap();
    dev.fill_bytes(&mut t, POISON).unwrap();
    t
}

fn f64s(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// Runs `f` with the given launch choices (activations staged, tile sums inside a cluster or
/// one whole-tile block where possible), then restores the defaults (all on).
fn with_sums<R>(staging: bool, cluster: bool, whole: bool, f: impl FnOnce() -> R) -> R {
    gemv::tuning::STAGING.set(staging);
    gemv::tuning::CLUSTER_SUM.set(cluster);
    gemv::tuning::WHOLE_TILE_BLOCKS.set(whole);
    let r = f();
    gemv::tuning::STAGING.set(true);
    gemv::tuning::CLUSTER_SUM.set(true);
    gemv::tuning::WHOLE_TILE_BLOCKS.set(true);
    r
}

/// Runs `f` with FP8 launches at M = 1 kept off the prescaled kernels, then restores the
/// default.
fn without_prescaling<R>(f: impl FnOnce() -> R) -> R {
    gemv::tuning::PRESCALED.set(false);
    let r = f();
    gemv::tuning::PRESCALED.set(true);
    r
}

/// Relative error of `got` against the reference `want`, printed and checked against the bound.
fn check_error(what: &str, got: &[f64], want: &[f64]) {
    let err = reference::relative_error(got, want);
    println!("  {what}: rel err {err:.2e}");
    assert!(err <= TOL, "{what}: relative error {err:e} > {TOL:e}");
}

/// check_error on a device tensor.
fn check_device_error(dev: &Device, what: &str, y: &DeviceTensor<bf16>, want: &[f64]) {
    check_error(what, &f64s(&dev.download(y).unwrap()), want);
}

/// FP8 at M = 1 with staged activations runs the prescaled kernel, other launches of the same
/// GEMV another one (other rounding).
fn prescaled(format: &str, m: usize) -> bool {
    format.starts_with("fp8") && m == 1
}

/// Runs one GEMV on the GPU five times (again, with activations read from global memory
/// instead of staged, with the tile sums of a cluster in one whole-tile block instead, and
/// through the workspace: all bit-identical, but for FP8 at M = 1 without staging, checked
/// against the reference instead), and once more without the prescaled FP8 kernel.
fn check_gemv(
    dev: &Device,
    ws: &mut GemvWorkspace,
    rng: &mut StdRng,
    format: &str,
    m: usize,
    n: usize,
    k: usize,
) {
    let owned = make_weight(rng, format, n, k, None);
    let w = GemvWeight::upload(dev, owned.host(), n, k).unwrap();
    let xh = to_bf16(&gaussian(rng, m * k, 1.0));
    let x = dev.upload(DType::BF16, &[m, k], &xh).unwrap();
    let mut y = poisoned(dev, m, n);
    gemv::gemv(dev, &x, &w, &mut y, ws).unwrap();
    let got = dev.download(&y).unwrap();
    let wd = reference::dequantize(owned.host(), n, k).unwrap();
    let want = reference::gemv(&xh, m, &wd, n, k);
    check_error(&format!("{format} m={m} n={n} k={k}"), &f64s(&got), &want);
    // F32 output: the same sums, not rounded.
    let mut y32 = dev.alloc(DType::F32, &[m, n]).unwrap();
    dev.fill_bytes(&mut y32, POISON).unwrap();
    gemv::gemv(dev, &x, &w, &mut y32, ws).unwrap();
    let y32: Vec<f32> = dev.download(&y32).unwrap();
    let rounded: Vec<bf16> = y32.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_bits_eq(
        &format!("{format} m={m} n={n} k={k}: F32 output, rounded"),
        &rounded,
        &got,
    );
    // Added to an F32 y: one f32 add per element of what y held and the F32 output.
    let base = gaussian(rng, m * n, 1.0);
    let mut acc = dev.upload(DType::F32, &[m, n], &base).unwrap();
    gemv::gemv_add(dev, &x, &w, &mut acc, ws).unwrap();
    let want_sum: Vec<f32> = base.iter().zip(&y32).map(|(b, v)| b + v).collect();
    let what = format!("{format} m={m} n={n} k={k}: added to y");
    assert_bits_eq(&what, &dev.download(&acc).unwrap(), &want_sum);
    for (staging, cluster, whole) in [
        (true, true, true),
        (false, true, true),
        (true, false, true),
        (true, false, false),
    ] {
        let again = with_sums(staging, cluster, whole, || {
            let mut again = poisoned(dev, m, n);
            gemv::gemv(dev, &x, &w, &mut again, ws).unwrap();
            again
        });
        if !staging && prescaled(format, m) {
            let what = format!("{format} m={m} n={n} k={k} not staged");
            check_device_error(dev, &what, &again, &want);
            continue;
        }
        assert_bits_eq(
            &format!(
                "{format} m={m} n={n} k={k}: launches (staging {staging}, cluster sums {cluster}, \
                 whole-tile blocks {whole})"
            ),
            &dev.download(&again).unwrap(),
            &got,
        );
    }
    let plain = without_prescaling(|| {
        let mut plain = poisoned(dev, m, n);
        gemv::gemv(dev, &x, &w, &mut plain, ws).unwrap();
        plain
    });
    let what = format!("{format} m={m} n={n} k={k} without prescaling");
    check_device_error(dev, &what, &plain, &want);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gemv_matches_reference_on_random_shapes() {
    let dev = device();
    let mut rng = rng("gpu_gemv_matches_reference_on_random_shapes");
    let mut ws = GemvWorkspace::alloc(&dev).unwrap();
    for format in FORMATS {
        let ce = chunk(format);
        for _ in 0..6 {
            let m = rng.random_range(1..=16);
            let n = rng.random_range(1..=700);
            let k = ce * rng.random_range(1..=96);
            check_gemv(&dev, &mut ws, &mut rng, format, m, n, k);
        }
        // Few rows and long K: split across blocks (workspace reduction path).
        let n = rng.random_range(1..=48);
        let k = ce * 16 * rng.random_range(64..=96);
        let m = rng.random_range(1..=3);
        check_gemv(&dev, &mut ws, &mut rng, format, m, n, k);
        // One tile whose 16-step K ranges fill blocks of 16 warps (where the kernel takes them):
        // 5 blocks (summed inside a cluster on sm_90 and later) and 12 (through the workspace).
        for blocks in [5, 12] {
            let m = rng.random_range(1..=2);
            let n = rng.random_range(1..=16);
            check_gemv(&dev, &mut ws, &mut rng, format, m, n, ce * 16 * 16 * blocks);
        }
        // 100 tiles of 7 steps: 7 one-range blocks a tile (a cluster, or one 7-warp block).
        let m = rng.random_range(1..=4);
        check_gemv(&dev, &mut ws, &mut rng, format, m, 1600, ce * 16 * 7);
        // Many rows: one block per tile.
        let n = 8192 + rng.random_range(1..16);
        check_gemv(&dev, &mut ws, &mut rng, format, 1, n, 4 * 128);
        // All of a tile's K ranges in one block: 32 tiles of 16 steps (16 ranges, a 16-warp
        // block where the kernel takes one) and 64 tiles of 8 steps (8 ranges, 8 warps).
        let m = rng.random_range(1..=8);
        check_gemv(&dev, &mut ws, &mut rng, format, m, 512, ce * 16 * 16);
        check_gemv(&dev, &mut ws, &mut rng, format, m, 1024, ce * 16 * 8);
    }
}

/// One launch of more than 16 rows (the prefill GEMM) against the reference in BF16, F32 and
/// added-to-F32 output; then rows `[lo, hi)` alone (more than 16 of them, another row count and
/// row offset inside the kernel's 64-row blocks) must give the same bits as in the whole launch.
fn check_gemm(
    dev: &Device,
    ws: &mut GemvWorkspace,
    rng: &mut StdRng,
    format: &str,
    m: usize,
    n: usize,
    k: usize,
) {
    let what = format!("gemm {format} m={m} n={n} k={k}");
    let owned = make_weight(rng, format, n, k, None);
    let w = GemvWeight::upload(dev, owned.host(), n, k).unwrap();
    let xh = to_bf16(&gaussian(rng, m * k, 1.0));
    let x = dev.upload(DType::BF16, &[m, k], &xh).unwrap();
    let mut y = poisoned(dev, m, n);
    gemv::gemv(dev, &x, &w, &mut y, ws).unwrap();
    let got = dev.download(&y).unwrap();
    let wd = reference::dequantize(owned.host(), n, k).unwrap();
    let want = reference::gemv(&xh, m, &wd, n, k);
    check_error(&what, &f64s(&got), &want);
    if format.starts_with("fp8") {
        // The f16-MMA kernel, which FP8 takes off sm_90a.
        gemv::tuning::FP8_TENSOR_GEMM.set(false);
        let mut y16 = poisoned(dev, m, n);
        let r = gemv::gemv(dev, &x, &w, &mut y16, ws);
        gemv::tuning::FP8_TENSOR_GEMM.set(true);
        r.unwrap();
        check_device_error(dev, &format!("{what} on f16 MMAs"), &y16, &want);
    }
    let mut y32 = dev.alloc(DType::F32, &[m, n]).unwrap();
    dev.fill_bytes(&mut y32, POISON).unwrap();
    gemv::gemv(dev, &x, &w, &mut y32, ws).unwrap();
    let y32: Vec<f32> = dev.download(&y32).unwrap();
    let rounded: Vec<bf16> = y32.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_bits_eq(&format!("{what}: F32 output, rounded"), &rounded, &got);
    let base = gaussian(rng, m * n, 1.0);
    let mut acc = dev.upload(DType::F32, &[m, n], &base).unwrap();
    gemv::gemv_add(dev, &x, &w, &mut acc, ws).unwrap();
    let want_sum: Vec<f32> = base.iter().zip(&y32).map(|(b, v)| b + v).collect();
    assert_bits_eq(
        &format!("{what}: added to y"),
        &dev.download(&acc).unwrap(),
        &want_sum,
    );
    let lo = rng.random_range(1..m - 16);
    let hi = rng.random_range(lo + 17..=m);
    let part = dev
        .upload(DType::BF16, &[hi - lo, k], &xh[lo * k..hi * k])
        .unwrap();
    let mut yp = poisoned(dev, hi - lo, n);
    gemv::gemv(dev, &part, &w, &mut yp, ws).unwrap();
    assert_bits_eq(
        &format!("{what}: rows {lo}..{hi} alone"),
        &dev.download(&yp).unwrap(),
        &got[lo * n..hi * n],
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gemm_matches_reference_and_rows_stay_independent() {
    let dev = device();
    let mut rng = rng("gpu_gemm_matches_reference_and_rows_stay_independent");
    let mut ws = GemvWorkspace::alloc(&dev).unwrap();
    for format in FORMATS {
        let ce = chunk(format);
        for _ in 0..4 {
            let m = rng.random_range(18..=150);
            let n = rng.random_range(1..=400);
            let k = ce * rng.random_range(1..=48);
            check_gemm(&dev, &mut ws, &mut rng, format, m, n, k);
        }
        // Whole 64-row blocks and 128-row tile blocks, K a whole number of 256-column slabs.
        check_gemm(&dev, &mut ws, &mut rng, format, 128, 256, 1024);
    }
}

/// A grouped launch against the reference of each group on its own columns of x, in F32 and
/// BF16 output (the BF16 output the F32 one rounded).
fn check_grouped(
    dev: &Device,
    ws: &mut GemvWorkspace,
    rng: &mut StdRng,
    format: &str,
    (m, groups, rows, k): (usize, usize, usize, usize),
) {
    let n = groups * rows;
    let owned = make_weight(rng, format, n, k, None);
    let w = GemvWeight::upload(dev, owned.host(), n, k).unwrap();
    let xh = to_bf16(&gaussian(rng, m * groups * k, 1.0));
    let x = dev.upload(DType::BF16, &[m, groups * k], &xh).unwrap();
    let mut y32 = dev.alloc(DType::F32, &[m, n]).unwrap();
    dev.fill_bytes(&mut y32, POISON).unwrap();
    gemv::gemv_grouped(dev, &x, &w, groups, &mut y32, ws).unwrap();
    let got: Vec<f32> = dev.download(&y32).unwrap();
    let wd = reference::dequantize(owned.host(), n, k).unwrap();
    let mut want = vec![0f64; m * n];
    for g in 0..groups {
        let xg: Vec<bf16> = (0..m)
            .flat_map(|r| xh[r * groups * k + g * k..][..k].to_vec())
            .collect();
        let yg = reference::gemv(&xg, m, &wd[g * rows * k..(g + 1) * rows * k], rows, k);
        for r in 0..m {
            want[r * n + g * rows..][..rows].copy_from_slice(&yg[r * rows..(r + 1) * rows]);
        }
    }
    let what = format!("{format} grouped m={m} groups={groups} rows={rows} k={k}");
    let got64: Vec<f64> = got.iter().map(|&v| v as f64).collect();
    check_error(&what, &got64, &want);
    let mut yb = poisoned(dev, m, n);
    gemv::gemv_grouped(dev, &x, &w, groups, &mut yb, ws).unwrap();
    let rounded: Vec<bf16> = got.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_bits_eq(
        &format!("{what}: BF16 output"),
        &dev.download(&yb).unwrap(),
        &rounded,
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gemv_grouped_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_gemv_grouped_matches_reference");
    let mut ws = GemvWorkspace::alloc(&dev).unwrap();
    for format in FORMATS {
        let ce = chunk(format);
        // V4-Flash wo_a at M = 1 and 3, then groups of 16 and 48 rows (blocks whose tiles
        // span several groups read their activations unstaged) and long K (split sums).
        for shape in [
            (1, 8, 1024, 4096),
            (3, 8, 1024, 4096),
            (1, 4, 16, ce * 24),
            (5, 3, 48, ce * 40),
            (16, 2, 32, ce * 16 * 80),
            (70, 8, 128, ce * 8),
            (33, 3, 48, ce * 40),
            (150, 3, 144, ce * 44),
        ] {
            check_grouped(&dev, &mut ws, &mut rng, format, shape);
        }
    }
    let owned = make_weight(&mut rng, "bf16", 40, 64, None);
    let w = GemvWeight::upload(&dev, owned.host(), 40, 64).unwrap();
    let x = dev.alloc(DType::BF16, &[1, 128]).unwrap();
    let mut y = dev.alloc::<f32>(DType::F32, &[1, 40]).unwrap();
    let err = gemv::gemv_grouped(&dev, &x, &w, 2, &mut y, &mut ws).unwrap_err();
    assert!(
        err.to_string().contains("40 rows are not 2 groups"),
        "{err}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gemv_swiglu_matches_reference_and_clamps() {
    let dev = device();
    let mut rng = rng("gpu_gemv_swiglu_matches_reference_and_clamps");
    let mut ws = GemvWorkspace::alloc(&dev).unwrap();
    for format in FORMATS {
        let ce = chunk(format);
        for case in 0..11 {
            // Cases 9 and 10: more than 16 rows (the prefill GEMM).
            let m = match case {
                8 => 1,
                9 | 10 => rng.random_range(17..=200),
                _ => rng.random_range(1..=16),
            };
            // Case 4: few tiles, long K (sums across blocks); case 5: 128 tiles of 16 steps
            // (8 or 16 ranges a tile, all in one block); case 6: one tile whose 16-step ranges
            // fill 5 blocks of 16 warps (a cluster sum on sm_90 and later, where the kernel takes
            // such blocks); case 7: 100 tiles of 7 one-range blocks (a cluster, or one 7-warp
            // block); case 8: the V4-Flash shared expert's 256 tiles of 16 steps at M = 1.
            let (m, n, k) = match case {
                4 => (m, rng.random_range(1..=24), ce * 400),
                5 => (m.min(8), 1024, ce * 16 * 16),
                6 => (m.min(2), rng.random_range(1..=8), ce * 16 * 16 * 5),
                7 => (m.min(4), 800, ce * 16 * 7),
                8 => (m, 2048, ce * 16 * 16),
                _ => (m, rng.random_range(1..=600), ce * rng.random_range(1..=80)),
            };
            // w1 and w3 share the NVFP4 global scale, as in ModelOpt exports.
            let g = Some(0.3 / 2688.0);
            let o1 = make_weight(&mut rng, format, n, k, g);
            let o3 = make_weight(&mut rng, format, n, k, g);
            let w13 = GemvWeight::upload_gate_up(&dev, o1.host(), o3.host(), n, k).unwrap();
            let xh = to_bf16(&gaussian(&mut rng, m * k, 1.0));
            let x = dev.upload(DType::BF16, &[m, k], &xh).unwrap();
            let w1d = reference::dequantize(o1.host(), n, k).unwrap();
            let w3d = reference::dequantize(o3.host(), n, k).unwrap();
            // A limit near the typical projection size, so both clamps take effect.
            let g_ref = reference::gemv(&xh, m, &w1d, n, k);
            let rms = (g_ref.iter().map(|v| v * v).sum::<f64>() / g_ref.len() as f64).sqrt();
            let limit = (rms * 0.8).max(1e-3) as f32;
            let want = reference::gemv_swiglu(&xh, m, &w1d, &w3d, n, k, limit as f64);
            let mut h = poisoned(&dev, m, n);
            gemv::gemv_swiglu(&dev, &x, &w13, limit, &mut h, &mut ws).unwrap();
            let got = dev.download(&h).unwrap();
            let what = format!("swiglu {format} m={m} n={n} k={k} limit={limit:.3}");
            check_error(&what, &f64s(&got), &want);
            // The GEMM (more than 16 rows) has no split sums to vary.
            for whole in [true, false].into_iter().filter(|_| m <= 16) {
                let again = with_sums(true, false, whole, || {
                    let mut again = poisoned(&dev, m, n);
                    gemv::gemv_swiglu(&dev, &x, &w13, limit, &mut again, &mut ws).unwrap();
                    again
                });
                assert_bits_eq(
                    &format!(
                        "swiglu {format} m={m} n={n} k={k}: no cluster sums (whole-tile blocks {whole})"
                    ),
                    &dev.download(&again).unwrap(),
                    &got,
                );
            }
            let plain = without_prescaling(|| {
                let mut plain = poisoned(&dev, m, n);
                gemv::gemv_swiglu(&dev, &x, &w13, limit, &mut plain, &mut ws).unwrap();
                plain
            });
            let what = format!("swiglu {format} m={m} n={n} k={k} without prescaling");
            check_device_error(&dev, &what, &plain, &want);
        }
    }
}

/// FP8 rows of scale blocks whose scales are far apart (2^-30 and 2^20 times the usual) are
/// each right on their own, plain and gate+up, at M = 1 (prescaled, where the activations are
/// multiplied by the scales in f16), at M = 3, and at M = 40 on the prefill GEMM (where each
/// sub-step's sums are multiplied by their rows' block scales).
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gemv_fp8_is_right_for_scales_of_any_magnitude() {
    let dev = device();
    let mut rng = rng("gpu_gemv_fp8_is_right_for_scales_of_any_magnitude");
    let mut ws = GemvWorkspace::alloc(&dev).unwrap();
    let (n, k) = (384, 2048);
    // Row blocks 0 and 2 of 128 rows move by 2^-30 and 2^20 (e8m0 bytes shifted): without a
    // factor per row, activations times 2^-30 scales would leave f16's range.
    let shifted = |rng: &mut StdRng| {
        let Owned::Fp8 {
            weight,
            mut scale,
            format,
        } = make_weight(rng, "fp8-e8m0", n, k, None)
        else {
            unreachable!()
        };
        let cols = k / 128;
        scale[..cols].iter_mut().for_each(|e| *e -= 30);
        scale[2 * cols..3 * cols].iter_mut().for_each(|e| *e += 20);
        Owned::Fp8 {
            weight,
            scale,
            format,
        }
    };
    let by_row_block = |what: &str, got: &[bf16], want: &[f64], m: usize| {
        for b in 0..n / 128 {
            let rows = |v: &[f64]| -> Vec<f64> {
                (0..m)
                    .flat_map(|t| v[t * n + 128 * b..t * n + 128 * (b + 1)].to_vec())
                    .collect()
            };
            let label = format!("{what} m={m} row block {b}");
            check_error(&label, &rows(&f64s(got)), &rows(want));
        }
    };
    for m in [1, 3, 40] {
        let o = shifted(&mut rng);
        let w = GemvWeight::upload(&dev, o.host(), n, k).unwrap();
        let xh = to_bf16(&gaussian(&mut rng, m * k, 1.0));
        let x = dev.upload(DType::BF16, &[m, k], &xh).unwrap();
        let mut y = poisoned(&dev, m, n);
        gemv::gemv(&dev, &x, &w, &mut y, &mut ws).unwrap();
        let wd = reference::dequantize(o.host(), n, k).unwrap();
        let want = reference::gemv(&xh, m, &wd, n, k);
        by_row_block("fp8", &dev.download(&y).unwrap(), &want, m);

        let (o1, o3) = (shifted(&mut rng), shifted(&mut rng));
        let w13 = GemvWeight::upload_gate_up(&dev, o1.host(), o3.host(), n, k).unwrap();
        let w1d = reference::dequantize(o1.host(), n, k).unwrap();
        let w3d = reference::dequantize(o3.host(), n, k).unwrap();
        // No clamp: the rows' outputs are 2^100 apart (2^-60 and 2^40 times the usual).
        let want = reference::gemv_swiglu(&xh, m, &w1d, &w3d, n, k, f64::MAX);
        let mut h = poisoned(&dev, m, n);
        gemv::gemv_swiglu(&dev, &x, &w13, f32::MAX, &mut h, &mut ws).unwrap();
        by_row_block("swiglu fp8", &dev.download(&h).unwrap(), &want, m);
    }
}

/// The FP8 prefill GEMM's activations (split into two e4m3 codes under one power-of-two scale a
/// row on sm_90a) keep each row's products whatever its magnitude: rows 2^-54 to 2^57 of the
/// usual, a zero row, and a row whose elements spread over 2^24, each within 1e-3 of the
/// reference on its own in F32 output (FP8 codes of the activations alone would be about 1e-2
/// off). Then a launch longer than the workspace's split rows (two passes): [`check_gemm`].
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gemm_fp8_keeps_activation_rows_of_any_magnitude() {
    let dev = device();
    let mut rng = rng("gpu_gemm_fp8_keeps_activation_rows_of_any_magnitude");
    let mut ws = GemvWorkspace::alloc(&dev).unwrap();
    let (m, n, k) = (40, 200, 1216);
    let o = make_weight(&mut rng, "fp8-e8m0", n, k, None);
    let w = GemvWeight::upload(&dev, o.host(), n, k).unwrap();
    let wd = reference::dequantize(o.host(), n, k).unwrap();
    let mut xf = gaussian(&mut rng, m * k, 1.0);
    for r in 0..m {
        for c in 0..k {
            let v = &mut xf[r * k + c];
            *v = match r {
                0 => 0.0,
                1 => *v * (-((c % 25) as f32)).exp2(),
                _ => *v * ((3 * r) as f32 - 60.0).exp2(),
            };
        }
    }
    let xh = to_bf16(&xf);
    let x = dev.upload(DType::BF16, &[m, k], &xh).unwrap();
    let mut y = dev.alloc(DType::F32, &[m, n]).unwrap();
    dev.fill_bytes(&mut y, POISON).unwrap();
    gemv::gemv(&dev, &x, &w, &mut y, &mut ws).unwrap();
    let got: Vec<f32> = dev.download(&y).unwrap();
    let want = reference::gemv(&xh, m, &wd, n, k);
    assert!(
        got[..n].iter().all(|&v| v == 0.0),
        "zero row: {:?}",
        &got[..8]
    );
    for r in 1..m {
        let g: Vec<f64> = got[r * n..(r + 1) * n].iter().map(|&v| v as f64).collect();
        let err = reference::relative_error(&g, &want[r * n..(r + 1) * n]);
        assert!(err <= 1e-3, "row {r}: relative error {err:e}");
    }

    // Two passes on sm_90a (and rows alone the bits of the same rows in them).
    let (m, n, k) = (2100, 40, 8192);
    assert!(m * 2 * k > GemvWorkspace::ACT_CODE_BYTES);
    check_gemm(&dev, &mut ws, &mut rng, "fp8-f32", m, n, k);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gemv_rejects_bad_shapes() {
    let dev = device();
    let mut rng = rng("gpu_gemv_rejects_bad_shapes");
    let mut ws = GemvWorkspace::alloc(&dev).unwrap();
    let owned = make_weight(&mut rng, "nvfp4", 64, 128, None);
    // K not a multiple of 32 for FP4.
    let bad = nvfp4::quantize(&gaussian(&mut rng, 64 * 48, 1.0), 64, 48).unwrap();
    assert!(GemvWeight::upload(&dev, HostWeight::from(&bad), 64, 48).is_err());
    // MXFP4 scale above 2^17.
    let mut mx = mxfp4::quantize(&gaussian(&mut rng, 8 * 64, 1.0), 8, 64).unwrap();
    mx.scale[3] = 200;
    assert!(GemvWeight::upload(&dev, HostWeight::from(&mx), 8, 64).is_err());
    let w = GemvWeight::upload(&dev, owned.host(), 64, 128).unwrap();
    let w13 = GemvWeight::upload_gate_up(&dev, owned.host(), owned.host(), 64, 128).unwrap();
    let mut h = poisoned(&dev, 1, 64);
    let x1 = dev
        .upload(DType::BF16, &[1, 128], &vec![bf16::ONE; 128])
        .unwrap();
    assert!(
        gemv::gemv(&dev, &x1, &w13, &mut h, &mut ws).is_err(),
        "gate+up weights need gemv_swiglu"
    );
    assert!(
        gemv::gemv_swiglu(&dev, &x1, &w, 1.0, &mut h, &mut ws).is_err(),
        "plain weights need gemv"
    );
    assert!(
        gemv::gemv_swiglu(&dev, &x1, &w13, 0.0, &mut h, &mut ws).is_err(),
        "the limit must be positive"
    );
    let x = dev
        .upload(DType::BF16, &[2, 96], &vec![bf16::ONE; 2 * 96])
        .unwrap();
    let mut y = poisoned(&dev, 2, 64);
    assert!(
        gemv::gemv(&dev, &x, &w, &mut y, &mut ws).is_err(),
        "K mismatch is refused"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_gemv_chain_waits_for_each_input() {
    // y1 = W1 x, y2 = W2 y1, y3 = W3 y2 enqueued back to back: each launch may start while the
    // previous one runs (programmatic dependent launch) and must read its input only once it is
    // complete. Each output must equal, bit for bit, the same GEMV run alone on the
    // downloaded input. Outputs start as NaN, so an early read cannot pass.
    let dev = device();
    let mut rng = rng("gpu_gemv_chain_waits_for_each_input");
    let mut ws = GemvWorkspace::alloc(&dev).unwrap();
    for format in ["fp8-e8m0", "nvfp4", "mxfp4"] {
        let m = rng.random_range(1..=4);
        // Large first and third stages (many blocks, several splits), a small middle one.
        let dims = [4096, 2048, 1024, 6144];
        let ws_: Vec<(Owned, GemvWeight)> = (0..3)
            .map(|i| {
                let (n, k) = (dims[i + 1], dims[i]);
                let o = make_weight(&mut rng, format, n, k, None);
                let w = GemvWeight::upload(&dev, o.host(), n, k).unwrap();
                (o, w)
            })
            .collect();
        let x = dev
            .upload(
                DType::BF16,
                &[m, dims[0]],
                &to_bf16(&gaussian(&mut rng, m * dims[0], 1.0)),
            )
            .unwrap();
        let mut ys: Vec<DeviceTensor<bf16>> = (1..4)
            .map(|i| {
                let mut t = dev.alloc(DType::BF16, &[m, dims[i]]).unwrap();
                dev.fill_bytes(&mut t, 0xff).unwrap();
                t
            })
            .collect();
        for rep in 0..3 {
            {
                let (y1, rest) = ys.split_at_mut(1);
                let (y2, y3) = rest.split_at_mut(1);
                gemv::gemv(&dev, &x, &ws_[0].1, &mut y1[0], &mut ws).unwrap();
                gemv::gemv(&dev, &y1[0], &ws_[1].1, &mut y2[0], &mut ws).unwrap();
                gemv::gemv(&dev, &y2[0], &ws_[2].1, &mut y3[0], &mut ws).unwrap();
            }
            let mut input = dev.download(&x).unwrap();
            for (i, y) in ys.iter().enumerate() {
                let got = dev.download(y).unwrap();
                let xi = dev.upload(DType::BF16, &[m, dims[i]], &input).unwrap();
                let mut alone = poisoned(&dev, m, dims[i + 1]);
                gemv::gemv(&dev, &xi, &ws_[i].1, &mut alone, &mut ws).unwrap();
                let alone = dev.download(&alone).unwrap();
                assert_bits_eq(
                    &format!("{format} m={m} stage {i} (round {rep}) against the GEMV run alone"),
                    &got,
                    &alone,
                );
                if rep == 0 {
                    let wd = reference::dequantize(ws_[i].0.host(), dims[i + 1], dims[i]).unwrap();
                    let want = reference::gemv(&input, m, &wd, dims[i + 1], dims[i]);
                    let what = format!("chain {format} m={m} stage {i}");
                    check_error(&what, &f64s(&got), &want);
                }
                input = got;
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_random_weights_give_unit_outputs() {
    // Random weights generated on the device (synthetic benchmarks): rows of RMS 1/sqrt(K), so
    // a unit-variance input gives outputs of about unit variance (within the factor 2 that
    // power-of-two scales allow), reproducible from the seed.
    use dsv4_ops::gpu::gemv::GemvFormat;
    let dev = device();
    let mut rng = rng("gpu_random_weights_give_unit_outputs");
    let mut ws = GemvWorkspace::alloc(&dev).unwrap();
    let fp8 = |scale| GemvFormat::Fp8 {
        scale,
        block: (128, 128),
    };
    let formats = [
        GemvFormat::Bf16,
        fp8(ScaleFormat::E8m0),
        fp8(ScaleFormat::F32),
        GemvFormat::Nvfp4,
        GemvFormat::Mxfp4,
    ];
    let (n, k) = (512, 2048);
    let xh = to_bf16(&gaussian(&mut rng, k, 1.0));
    let x = dev.upload(DType::BF16, &[1, k], &xh).unwrap();
    let run = |w: &GemvWeight, ws: &mut GemvWorkspace| -> Vec<f32> {
        let mut y = dev.alloc(DType::F32, &[1, n]).unwrap();
        dev.fill_bytes(&mut y, POISON).unwrap();
        gemv::gemv(&dev, &x, w, &mut y, ws).unwrap();
        dev.download(&y).unwrap()
    };
    for format in formats {
        let seed: u64 = rng.random();
        let w = GemvWeight::random(&dev, format, n, k, false, seed).unwrap();
        let y = run(&w, &mut ws);
        assert!(y.iter().all(|v| v.is_finite()), "{format:?}: {y:?}");
        let var = y.iter().map(|v| (v * v) as f64).sum::<f64>() / n as f64;
        println!("  {format:?}: output variance {var:.3}");
        assert!(
            (0.4..2.5).contains(&var),
            "{format:?}: output variance {var}"
        );
        let again = GemvWeight::random(&dev, format, n, k, false, seed).unwrap();
        assert_bits_eq(&format!("{format:?}, same seed"), &run(&again, &mut ws), &y);
        let other = GemvWeight::random(&dev, format, n, k, false, seed ^ 1).unwrap();
        assert_ne!(run(&other, &mut ws), y, "{format:?}: another seed");
        let w13 = GemvWeight::random(&dev, format, n, k, true, seed).unwrap();
        assert!(w13.is_gate_up() && w13.bytes() == 2 * w.bytes());
        let mut h = poisoned(&dev, 1, n);
        gemv::gemv_swiglu(&dev, &x, &w13, 10.0, &mut h, &mut ws).unwrap();
        let h = dev.download(&h).unwrap();
        assert!(h.iter().all(|v| v.is_finite()), "{format:?} gate+up");
        assert!(h.iter().any(|v| v.to_f32() != 0.0), "{format:?} gate+up");
    }
    // Off the tile sizes: the padding is never weighed, every output row is written.
    let (n, k) = (100, 96);
    let xh = to_bf16(&gaussian(&mut rng, k, 1.0));
    let x = dev.upload(DType::BF16, &[1, k], &xh).unwrap();
    for format in formats {
        let w = GemvWeight::random(&dev, format, n, k, false, 5).unwrap();
        let mut y = dev.alloc(DType::F32, &[1, n]).unwrap();
        dev.fill_bytes(&mut y, POISON).unwrap();
        gemv::gemv(&dev, &x, &w, &mut y, &mut ws).unwrap();
        let y: Vec<f32> = dev.download(&y).unwrap();
        assert!(
            y.iter().all(|v| v.is_finite()),
            "{format:?} [{n}, {k}]: {y:?}"
        );
    }
    let err = GemvWeight::random(&dev, GemvFormat::Nvfp4, 64, 48, false, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("[64, 48]") && err.contains("multiple of 32"),
        "{err}"
    );
}

/// The bytes of a host weight, for stacking parts on the host: `(codes, scales)`.
fn owned_bytes(w: &Owned) -> (Vec<u8>, Vec<u8>) {
    match w {
        Owned::Bf16(v) => (bytemuck::cast_slice(v).to_vec(), vec![]),
        Owned::Fp8 { weight, scale, .. } => (weight.clone(), scale.clone()),
        Owned::Nvfp4(q) => (q.weight.clone(), q.weight_scale.clone()),
        Owned::Mxfp4(q) => (q.weight.clone(), q.scale.clone()),
    }
}

/// The loader (host bytes copied up as stored, repacked on the device, through buffers small
/// enough that most weights go up in several pieces) puts on the device exactly the bytes the
/// host reference packs: plain, gate+up, and parts stacked on whole tiles and scale blocks.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_loaded_weights_hold_the_host_reference_bytes() {
    let dev = device();
    let mut rng = rng("gpu_loaded_weights_hold_the_host_reference_bytes");
    for (i, format) in FORMATS.iter().cycle().take(20).enumerate() {
        let c = chunk(format);
        let k = c * rng.random_range(1..40);
        let n = rng.random_range(1..300);
        let slot = [1 << 14, 1 << 16, 1 << 26][i % 3];
        let mut st = dsv4_ops::gpu::Stager::new(&dev, slot).unwrap();
        let what = format!("{format} [{n}, {k}] through {slot}-byte buffers");

        let w = make_weight(&mut rng, format, n, k, Some(0.01));
        let got = GemvWeight::load(&mut st, &[(w.host(), n)], k).unwrap();
        let want = reference::packed(w.host(), None, n, k).unwrap();
        assert!(got.download(&dev).unwrap() == want, "{what}: plain");

        let w3 = make_weight(&mut rng, format, n, k, None);
        let got = GemvWeight::load_gate_up(&mut st, w.host(), w3.host(), n, k).unwrap();
        let want = reference::packed(w.host(), Some(w3.host()), n, k).unwrap();
        assert!(got.download(&dev).unwrap() == want, "{what}: gate+up");

        // Parts of 128 and 256 rows (whole FP8 blocks), then a ragged one, one global scale.
        let rows = [128, 256, n];
        let parts: Vec<Owned> = rows
            .iter()
            .map(|&r| make_weight(&mut rng, format, r, k, Some(0.01)))
            .collect();
        let hosts: Vec<(HostWeight<'_>, usize)> =
            parts.iter().zip(rows).map(|(p, r)| (p.host(), r)).collect();
        let got = GemvWeight::load(&mut st, &hosts, k).unwrap();
        let (codes, scales): (Vec<Vec<u8>>, Vec<Vec<u8>>) = parts.iter().map(owned_bytes).unzip();
        let (codes, scales) = (codes.concat(), scales.concat());
        let whole = match &parts[0] {
            Owned::Bf16(_) => Owned::Bf16(bytemuck::cast_slice(&codes).to_vec()),
            Owned::Fp8 { format, .. } => Owned::Fp8 {
                weight: codes,
                scale: scales,
                format: *format,
            },
            Owned::Nvfp4(q) => Owned::Nvfp4(nvfp4::Nvfp4Quantized {
                weight: codes,
                weight_scale: scales,
                weight_scale_2: q.weight_scale_2,
            }),
            Owned::Mxfp4(_) => Owned::Mxfp4(mxfp4::Mxfp4Quantized {
                weight: codes,
                scale: scales,
            }),
        };
        let want = reference::packed(whole.host(), None, 384 + n, k).unwrap();
        assert!(got.download(&dev).unwrap() == want, "{what}: stacked");
    }
}

/// Parts that cannot stack in their format are refused by name.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_stacked_parts_must_share_a_format_and_join_on_tiles() {
    let dev = device();
    let mut rng = rng("gpu_stacked_parts_must_share_a_format_and_join_on_tiles");
    let mut st = dsv4_ops::gpu::Stager::new(&dev, 1 << 16).unwrap();
    let (a, b) = (
        make_weight(&mut rng, "bf16", 24, 64, None),
        make_weight(&mut rng, "bf16", 16, 64, None),
    );
    let err = GemvWeight::load(&mut st, &[(a.host(), 24), (b.host(), 16)], 64)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("multiple of 16"), "{err}");
    let c = make_weight(&mut rng, "fp8-e8m0", 16, 64, None);
    let err = GemvWeight::load(&mut st, &[(b.host(), 16), (c.host(), 16)], 64)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("parts in"), "{err}");
    assert!(GemvWeight::load(&mut st, &[], 64).is_err());
}
