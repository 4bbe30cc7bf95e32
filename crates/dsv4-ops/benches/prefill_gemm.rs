//! The prefill GEMM (`gemv` launches of more than 16 rows) on DeepSeek-V4 Flash shapes, at
//! chunks of 256 to 8192 rows: time per launch (median of 5 runs of 20 back-to-back launches,
//! timed on the host after a synchronize) and TFLOP/s, beside the decode GEMV's 16-row launches
//! over the same rows, and for FP8 on sm_90a beside the f16-MMA kernel that `gemm_fp8_tc`
//! replaced there. Weights are drawn on the GPU (`GemvWeight::random`).
//!
//! `cargo bench -p dsv4-ops --bench prefill_gemm`; `DSV4_BENCH_ROWS=2048,8192` sets the chunks.

use std::time::Instant;

use dsv4_ops::codecs::fp8_block::ScaleFormat;
use dsv4_ops::gpu::gemv::{self, GemvFormat, GemvWeight, GemvWorkspace};
use dsv4_ops::gpu::{Arch, DType, Device, DeviceTensor};
use half::bf16;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const LAUNCHES: usize = 20;

/// Median seconds per launch of `f`.
fn time(dev: &Device, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    f()?;
    dev.synchronize()?;
    let mut runs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..LAUNCHES {
            f()?;
        }
        dev.synchronize()?;
        runs.push(t.elapsed().as_secs_f64() / LAUNCHES as f64);
    }
    runs.sort_by(f64::total_cmp);
    Ok(runs[2])
}

fn label(f: GemvFormat) -> &'static str {
    match f {
        GemvFormat::Bf16 => "BF16",
        GemvFormat::Fp8 { .. } => "FP8",
        GemvFormat::Nvfp4 => "NVFP4",
        GemvFormat::Mxfp4 => "MXFP4",
    }
}

fn main() -> Res<()> {
    let dev = Device::new(0)?;
    let rows: Vec<usize> = match std::env::var("DSV4_BENCH_ROWS") {
        Ok(v) => v
            .split(',')
            .map(|s| s.trim().parse())
            .collect::<Result<_, _>>()?,
        Err(_) => vec![256, 2048, 8192],
    };
    let fp8 = GemvFormat::Fp8 {
        scale: ScaleFormat::E8m0,
        block: (128, 128),
    };
    // (name, format, n, k, gate+up, groups: n rows in groups, group g reading x's columns
    // [g·k, (g+1)·k))
    let cases = [
        ("attn wq_a+wkv", fp8, 1536, 4096, false, 1),
        ("attn wq_b", fp8, 32768, 1024, false, 1),
        ("attn wo_a, 8 groups", fp8, 8192, 4096, false, 8),
        ("attn wo_b", fp8, 4096, 8192, false, 1),
        ("shared w1+w3", fp8, 2048, 4096, true, 1),
        ("shared w2", fp8, 4096, 2048, false, 1),
        ("expert w1+w3", GemvFormat::Nvfp4, 2048, 4096, true, 1),
        ("expert w2", GemvFormat::Nvfp4, 4096, 2048, false, 1),
        ("compressor", GemvFormat::Bf16, 1024, 4096, false, 1),
    ];
    println!("{}", dev.name());
    println!(
        "| case | format | [n, k] | rows | GEMM | TFLOP/s | FP8 on f16 MMAs | TFLOP/s | 16-row GEMVs | TFLOP/s |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut ws = GemvWorkspace::alloc(&dev)?;
    for (name, format, n, k, gate_up, groups) in cases {
        let w = GemvWeight::random(&dev, format, n, k, gate_up, 7)?;
        let flop_row = 2.0 * (n * k) as f64 * if gate_up { 2.0 } else { 1.0 };
        for &m in &rows {
            let x: DeviceTensor<bf16> = dev.alloc(DType::BF16, &[m, groups * k])?;
            let mut y: DeviceTensor<bf16> = dev.alloc(DType::BF16, &[m, n])?;
            let run = |x: &DeviceTensor<bf16>,
                       y: &mut DeviceTensor<bf16>,
                       ws: &mut GemvWorkspace|
             -> Res<()> {
                if gate_up {
                    gemv::gemv_swiglu(&dev, x, &w, 10.0, y, ws)?;
                } else if groups > 1 {
                    gemv::gemv_grouped(&dev, x, &w, groups, y, ws)?;
                } else {
                    gemv::gemv(&dev, x, &w, y, ws)?;
                }
                Ok(())
            };
            let t = time(&dev, || run(&x, &mut y, &mut ws))?;
            // FP8 on sm_90a: the same launch on the f16-MMA kernel (`gemm_fp8`).
            let fp8_tc = matches!(format, GemvFormat::Fp8 { .. }) && dev.arch() == Arch::Sm90a;
            let t_f16 = if fp8_tc {
                gemv::tuning::FP8_TENSOR_GEMM.set(false);
                let t = time(&dev, || run(&x, &mut y, &mut ws));
                gemv::tuning::FP8_TENSOR_GEMM.set(true);
                Some(t?)
            } else {
                None
            };
            // The same number of rows through the decode GEMV, 16 at a time.
            let x16: DeviceTensor<bf16> = dev.alloc(DType::BF16, &[16, groups * k])?;
            let mut y16: DeviceTensor<bf16> = dev.alloc(DType::BF16, &[16, n])?;
            let t16 = time(&dev, || {
                for _ in 0..m / 16 {
                    run(&x16, &mut y16, &mut ws)?;
                }
                Ok(())
            })?;
            let flop = flop_row * m as f64;
            let f16 = t_f16.map_or("| |".to_string(), |t| {
                format!("{:.1} µs | {:.0}", t * 1e6, flop / t / 1e12)
            });
            println!(
                "| {name} | {} | [{n}, {k}] | {m} | {:.1} µs | {:.0} | {f16} | {:.1} µs | {:.0} |",
                label(format),
                t * 1e6,
                flop / t / 1e12,
                t16 * 1e6,
                flop / t16 / 1e12
            );
        }
    }
    Ok(())
}
