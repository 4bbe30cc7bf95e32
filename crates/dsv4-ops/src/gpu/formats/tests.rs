//! GPU tests of the format kernels against their CPU references: bit-exact, on fresh random
//! inputs of random shapes, with outputs poisoned before every launch. All `#[ignore]`d: run
//! with `--ignored gpu` on a GPU machine (`cargo xtask gpu-test`).

use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

use super::reference as cpu;
use super::*;
use crate::gpu::testing::{
    assert_bf16_eq, assert_bits_eq, device, random_bf16, random_bytes, rng, zero_some_blocks,
    POISON,
};
use crate::gpu::{BufferPool, PoolError};

/// Output element types and their bit-exact comparison.
trait Exact: DeviceElem {
    fn assert_exact(what: &str, got: &[Self], want: &[Self]);
}

impl Exact for bf16 {
    fn assert_exact(what: &str, got: &[bf16], want: &[bf16]) {
        assert_bf16_eq(what, got, want);
    }
}

impl Exact for u8 {
    fn assert_exact(what: &str, got: &[u8], want: &[u8]) {
        assert_bits_eq(what, got, want);
    }
}

/// Runs `launch` into a poisoned `dtype` output of `shape`, checks the output bit for bit
/// against `want`, and returns it (the input of a round trip).
fn check_launch<T: Exact>(
    dev: &Device,
    what: &str,
    dtype: DType,
    shape: &[usize],
    want: &[T],
    launch: impl FnOnce(&mut DeviceTensor<T>) -> Result<(), GpuError>,
) -> DeviceTensor<T> {
    let mut out = dev.alloc(dtype, shape).unwrap();
    dev.fill_bytes(&mut out, POISON).unwrap();
    launch(&mut out).unwrap();
    T::assert_exact(what, &dev.download(&out).unwrap(), want);
    out
}

/// Random FP4 codes and scales of a `[rows, cols]` weight with one `scale` byte per `block`
/// values of a row, on the host and uploaded. Every byte value occurs, so every scale code.
fn random_fp4(
    dev: &Device,
    rng: &mut StdRng,
    rows: usize,
    cols: usize,
    scale: DType,
    block: usize,
) -> ([Vec<u8>; 2], [DeviceTensor<u8>; 2]) {
    let packed = random_bytes(rng, rows * cols.div_ceil(2));
    let scales = random_bytes(rng, rows * cols.div_ceil(block));
    let p = dev
        .upload(DType::E2M1x2, &[rows, cols.div_ceil(2)], &packed)
        .unwrap();
    let s = dev
        .upload(scale, &[rows, cols.div_ceil(block)], &scales)
        .unwrap();
    ([packed, scales], [p, s])
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_device_and_kernels_load() {
    let dev = device();
    println!("{} ({}), arch {}", dev.name(), dev.ordinal(), dev.arch());
    for load in dev.kernels().loads() {
        println!(
            "  {}: {:?}, lookup {:?}, compile {:?}, module load {:?}, {} bytes",
            load.family, load.source, load.lookup, load.compile, load.module_load, load.image_bytes
        );
        assert!(load.log.is_empty(), "NVRTC warnings: {}", load.log);
        assert!(load.cache_error.is_none(), "{:?}", load.cache_error);
    }
    assert!(
        !dev.context().is_event_tracking(),
        "event tracking must be off"
    );
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();
    let t = dev.upload(DType::F32, &[10, 100], &data).unwrap();
    assert_eq!(dev.download(&t).unwrap(), data);
    assert!(dev.upload(DType::F32, &[10, 99], &data).is_err());
    assert!(dev.upload::<f32>(DType::BF16, &[10, 100], &data).is_err());
    // Cached occupancy answers are the driver's, per block size.
    let kernel = "nvfp4_dequant";
    for threads in [128u32, 256, 128] {
        let direct = dev
            .function(kernel)
            .unwrap()
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .unwrap();
        assert_eq!(dev.resident_blocks(kernel, threads, 0).unwrap(), direct);
    }
    assert!(dev.resident_blocks("no_such_kernel", 128, 0).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_pool_hands_out_fixed_disjoint_buffers_and_refuses_late_reservations() {
    let dev = device();
    let mut pool = BufferPool::new();
    let a = pool
        .reserve::<bf16>("hidden", DType::BF16, &[3, 4096])
        .unwrap();
    let b = pool
        .reserve::<u8>("packed", DType::E2M1x2, &[3, 2048])
        .unwrap();
    let c = pool.reserve::<f32>("global", DType::F32, &[1]).unwrap();
    pool.seal(&dev).unwrap();
    assert!(matches!(
        pool.reserve::<u8>("late", DType::U8, &[100]),
        Err(GpuError::Pool(PoolError::Sealed { ref name, bytes: 100 })) if name == "late"
    ));
    let mut ta = pool.take(a).unwrap();
    let mut tb = pool.take(b).unwrap();
    let mut tc = pool.take(c).unwrap();
    let base = ta.device_address();
    assert_eq!(base % BufferPool::ALIGN as u64, 0);
    for (t_addr, info) in [
        ta.device_address(),
        tb.device_address(),
        tc.device_address(),
    ]
    .into_iter()
    .zip(pool.buffers())
    {
        assert_eq!(t_addr, base + info.offset as u64, "{}", info.name);
    }
    assert_eq!(tb.shape(), &[3, 2048]);
    assert_eq!(tb.dtype(), DType::E2M1x2);
    // Freshly sealed pools are zeroed, and writes to one buffer do not touch the others.
    assert!(dev.download(&tb).unwrap().iter().all(|&x| x == 0));
    let va: Vec<bf16> = (0..3 * 4096).map(|i| bf16::from_f32(i as f32)).collect();
    let vb: Vec<u8> = (0..3 * 2048).map(|i| (i * 7 % 256) as u8).collect();
    dev.write(&mut ta, &va).unwrap();
    dev.write(&mut tb, &vb).unwrap();
    dev.write(&mut tc, &[1.5]).unwrap();
    assert_eq!(dev.download(&ta).unwrap(), va);
    assert_eq!(dev.download(&tb).unwrap(), vb);
    assert_eq!(dev.download(&tc).unwrap(), vec![1.5]);
    // The addresses stay put while tensors are dropped and the pool lives on.
    let addr_c = tc.device_address();
    drop(ta);
    drop(tb);
    assert_eq!(tc.device_address(), addr_c);
    dev.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_nvfp4_act_quantize_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_nvfp4_act_quantize_matches_reference");
    for iter in 0..12 {
        let rows: usize = rng.random_range(1..260);
        // Mostly whole 16-blocks (the vector path), sometimes a ragged tail.
        let cols: usize = if iter % 3 == 2 {
            rng.random_range(1..1100)
        } else {
            16 * rng.random_range(1..80)
        };
        let mut x = random_bf16(&mut rng, rows * cols, iter % 4 == 1);
        zero_some_blocks(&mut rng, &mut x, 16);
        if iter == 0 {
            x.fill(bf16::ZERO);
        }
        let want = cpu::nvfp4_quantize_act(&x, rows, cols).unwrap();

        let xd = dev.upload(DType::BF16, &[rows, cols], &x).unwrap();
        let mut out = Nvfp4Act::alloc(&dev, rows, cols).unwrap();
        dev.fill_bytes(&mut out.packed, POISON).unwrap();
        dev.fill_bytes(&mut out.scales, POISON).unwrap();
        dev.fill_bytes(&mut out.global, POISON).unwrap();
        dev.fill_bytes(&mut out.amax, POISON).unwrap();
        nvfp4_quantize_act(&dev, &xd, &mut out).unwrap();
        let what = format!("iter {iter}: [{rows}, {cols}]");
        let global = dev.download(&out.global).unwrap()[0];
        assert_eq!(
            global.to_bits(),
            want.weight_scale_2.to_bits(),
            "{what}: global scale"
        );
        assert_bits_eq(
            &format!("{what} scales"),
            &dev.download(&out.scales).unwrap(),
            &want.weight_scale,
        );
        assert_bits_eq(
            &format!("{what} packed"),
            &dev.download(&out.packed).unwrap(),
            &want.weight,
        );

        // And back: the GPU dequantizer on the GPU output equals the CPU dequantizer.
        let want_back =
            cpu::nvfp4_dequant(&want.weight, &want.weight_scale, global, rows, cols).unwrap();
        check_launch(
            &dev,
            &format!("{what} round trip"),
            DType::BF16,
            &[rows, cols],
            &want_back,
            |back| nvfp4_dequant(&dev, &out.packed, &out.scales, &out.global, back),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_nvfp4_act_quantize_replays_in_a_cuda_graph() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let dev = device();
    let mut rng = rng("gpu_nvfp4_act_quantize_replays_in_a_cuda_graph");
    let (rows, cols) = (4, 4096);
    let mut pool = BufferPool::new();
    let rx = pool
        .reserve::<bf16>("x", DType::BF16, &[rows, cols])
        .unwrap();
    let [p, s, g, a] = Nvfp4Act::shapes(rows, cols);
    let rp = pool.reserve::<u8>("packed", p.0, &p.1).unwrap();
    let rs = pool.reserve::<u8>("scales", s.0, &s.1).unwrap();
    let rg = pool.reserve::<f32>("global", g.0, &g.1).unwrap();
    let ra = pool.reserve::<u32>("amax", a.0, &a.1).unwrap();
    pool.seal(&dev).unwrap();
    let mut x = pool.take(rx).unwrap();
    let mut out = Nvfp4Act {
        packed: pool.take(rp).unwrap(),
        scales: pool.take(rs).unwrap(),
        global: pool.take(rg).unwrap(),
        amax: pool.take(ra).unwrap(),
    };
    let stream = dev.stream().clone();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let captured = nvfp4_quantize_act(&dev, &x, &mut out);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    captured.unwrap();
    let graph = graph.expect("the capture recorded work");
    // Each replay reads whatever x holds now: new inputs, same addresses.
    for replay in 0..3 {
        let v = random_bf16(&mut rng, rows * cols, false);
        dev.write(&mut x, &v).unwrap();
        graph.launch().unwrap();
        let want = cpu::nvfp4_quantize_act(&v, rows, cols).unwrap();
        assert_eq!(
            dev.download(&out.global).unwrap()[0],
            want.weight_scale_2,
            "replay {replay}"
        );
        assert_bits_eq(
            "graph scales",
            &dev.download(&out.scales).unwrap(),
            &want.weight_scale,
        );
        assert_bits_eq(
            "graph packed",
            &dev.download(&out.packed).unwrap(),
            &want.weight,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_nvfp4_dequant_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_nvfp4_dequant_matches_reference");
    for iter in 0..10 {
        let rows: usize = rng.random_range(1..300);
        let cols: usize = rng.random_range(1..1200);
        // Every e4m3 code, NaN included.
        let ([packed, scales], [p, s]) = random_fp4(&dev, &mut rng, rows, cols, DType::E4M3, 16);
        let global = rng.random_range(1e-3f32..10.0) * 2f32.powi(rng.random_range(-20..4));
        let want = cpu::nvfp4_dequant(&packed, &scales, global, rows, cols).unwrap();
        let g = dev.upload(DType::F32, &[1], &[global]).unwrap();
        check_launch(
            &dev,
            &format!("iter {iter}: [{rows}, {cols}]"),
            DType::BF16,
            &[rows, cols],
            &want,
            |out| nvfp4_dequant(&dev, &p, &s, &g, out),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_mxfp4_dequant_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_mxfp4_dequant_matches_reference");
    for iter in 0..10 {
        let rows: usize = rng.random_range(1..300);
        let cols: usize = if iter % 2 == 0 {
            32 * rng.random_range(1..64)
        } else {
            rng.random_range(1..1500)
        };
        // Every e8m0 byte: 2^-127 (subnormal products), 2^127 (overflow to inf) and NaN.
        let ([packed, scales], [p, s]) = random_fp4(&dev, &mut rng, rows, cols, DType::E8M0, 32);
        let want = cpu::mxfp4_dequant(&packed, &scales, rows, cols).unwrap();
        check_launch(
            &dev,
            &format!("iter {iter}: [{rows}, {cols}]"),
            DType::BF16,
            &[rows, cols],
            &want,
            |out| mxfp4_dequant(&dev, &p, &s, out),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_fp8_block_dequant_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_fp8_block_dequant_matches_reference");
    for iter in 0..12 {
        let rows: usize = rng.random_range(1..700);
        let cols: usize = rng.random_range(1..700);
        let block = if iter % 3 == 0 {
            (1 << rng.random_range(0..8), 1 << rng.random_range(0..8))
        } else {
            (128, 128)
        };
        let sshape = [rows.div_ceil(block.0), cols.div_ceil(block.1)];
        let w = random_bytes(&mut rng, rows * cols);
        let wd = dev.upload(DType::E4M3, &[rows, cols], &w).unwrap();
        let what = format!("iter {iter}: [{rows}, {cols}] block {block:?}");
        let check = |kind: &str, want: &[bf16], scales: Fp8Scales<'_>| {
            check_launch(
                &dev,
                &format!("{what} {kind}"),
                DType::BF16,
                &[rows, cols],
                want,
                |out| fp8_block_dequant(&dev, &wd, scales, block, out),
            );
        };
        if iter % 2 == 0 {
            let scales = random_bytes(&mut rng, sshape[0] * sshape[1]);
            let want =
                cpu::fp8_block_dequant(&w, &scales, ScaleFormat::E8m0, rows, cols, block).unwrap();
            let sd = dev.upload(DType::E8M0, &sshape, &scales).unwrap();
            check("e8m0", &want, Fp8Scales::E8m0(&sd));
        } else {
            let scales: Vec<f32> = (0..sshape[0] * sshape[1])
                .map(|_| rng.random_range(0.5f32..2.0) * 2f32.powi(rng.random_range(-30..20)))
                .collect();
            let raw: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
            let want =
                cpu::fp8_block_dequant(&w, &raw, ScaleFormat::F32, rows, cols, block).unwrap();
            let sd = dev.upload(DType::F32, &sshape, &scales).unwrap();
            check("f32", &want, Fp8Scales::F32(&sd));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_scale_swizzle_matches_reference_and_inverts() {
    let dev = device();
    let mut rng = rng("gpu_scale_swizzle_matches_reference_and_inverts");
    for iter in 0..10 {
        let rows: usize = rng.random_range(1..700);
        let cols: usize = rng.random_range(1..90);
        let dtype = if iter % 2 == 0 {
            DType::E4M3
        } else {
            DType::E8M0
        };
        let scales = random_bytes(&mut rng, rows * cols);
        let want = cpu::scale_swizzle_32_4_4(&scales, rows, cols).unwrap();
        let sd = dev.upload(dtype, &[rows, cols], &scales).unwrap();
        let what = format!("iter {iter}: [{rows}, {cols}]");
        let sw = check_launch(
            &dev,
            &format!("{what} swizzle"),
            dtype,
            &swizzled_dims(rows, cols),
            &want,
            |sw| scale_swizzle_32_4_4(&dev, &sd, sw),
        );
        check_launch(
            &dev,
            &format!("{what} unswizzle"),
            dtype,
            &[rows, cols],
            &scales,
            |back| scale_unswizzle_32_4_4(&dev, &sw, back),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_kv_fp8_records_match_reference() {
    let dev = device();
    let mut rng = rng("gpu_kv_fp8_records_match_reference");
    for iter in 0..8 {
        let tokens: usize = if iter == 0 {
            1
        } else {
            rng.random_range(1..5000)
        };
        let mut kv = random_bf16(&mut rng, tokens * KV_DIM, iter % 3 == 1);
        zero_some_blocks(&mut rng, &mut kv, 64);
        let want = cpu::kv_fp8_quantize(&kv).unwrap();
        let kd = dev.upload(DType::BF16, &[tokens, KV_DIM], &kv).unwrap();
        let what = format!("iter {iter}: {tokens} tokens");
        let rec = check_launch(
            &dev,
            &format!("{what} records"),
            DType::U8,
            &[tokens, KV_RECORD],
            &want,
            |rec| kv_fp8_quantize(&dev, &kd, rec),
        );
        let want_back = cpu::kv_fp8_dequant(&want).unwrap();
        check_launch(
            &dev,
            &format!("{what} dequant"),
            DType::BF16,
            &[tokens, KV_DIM],
            &want_back,
            |back| kv_fp8_dequant(&dev, &rec, back),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_launchers_reject_mismatched_tensors() {
    let dev = device();
    let x = dev.alloc::<bf16>(DType::BF16, &[4, 64]).unwrap();
    let mut out = Nvfp4Act::alloc(&dev, 4, 48).unwrap();
    assert!(matches!(
        nvfp4_quantize_act(&dev, &x, &mut out),
        Err(GpuError::Shape { .. })
    ));
    let w = dev.alloc::<u8>(DType::U8, &[4, 64]).unwrap();
    let s = dev.alloc::<u8>(DType::E8M0, &[1, 1]).unwrap();
    let mut o = dev.alloc::<bf16>(DType::BF16, &[4, 64]).unwrap();
    assert!(matches!(
        fp8_block_dequant(&dev, &w, Fp8Scales::E8m0(&s), (128, 128), &mut o),
        Err(GpuError::DType { .. })
    ));
    let kv = dev.alloc::<bf16>(DType::BF16, &[2, 511]).unwrap();
    let mut rec = dev.alloc::<u8>(DType::U8, &[2, KV_RECORD]).unwrap();
    assert!(kv_fp8_quantize(&dev, &kv, &mut rec).is_err());
    let sc = dev.alloc::<u8>(DType::E4M3, &[130, 7]).unwrap();
    let mut bad = dev.alloc::<u8>(DType::E4M3, &[130, 8]).unwrap();
    assert!(scale_swizzle_32_4_4(&dev, &sc, &mut bad).is_err());
}
