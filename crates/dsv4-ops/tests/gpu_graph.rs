//! A decode slice captured as one CUDA graph on a sealed pool: NVFP4 activation quantize →
//! FP8 GEMV → BF16 GEMV → grouped NVFP4 MoE, plus a long-K BF16 GEMV that splits K across
//! blocks (workspace counters must be reset between replays). Replays with fresh inputs copied
//! into the fixed input buffers must be bit-identical to eager launches on the same inputs.

mod common;

use common::gaussian;
use dsv4_ops::gpu::testing::device;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use dsv4_ops::codecs::fp8_block::{self, ScaleFormat};
use dsv4_ops::codecs::nvfp4;
use dsv4_ops::gpu::formats::{nvfp4_quantize_act, Nvfp4Act};
use dsv4_ops::gpu::gemv::{self, GemvWeight, GemvWorkspace, HostWeight};
use dsv4_ops::gpu::moe::{self, HostExperts, MoeExperts, MoeOut};
use dsv4_ops::gpu::{BufferPool, DType, Device, DeviceTensor, GpuError};
use half::bf16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const M: usize = 3;
const D: usize = 1024;
const INTER: usize = 256;
const EXPERTS: usize = 16;
const TOPK: usize = 6;
const ROUTER: usize = 64;
const WIDE_K: usize = 16384;
const WIDE_N: usize = 32;
const LIMIT: f32 = 1.5;

struct Bufs {
    x: DeviceTensor<bf16>,
    xw: DeviceTensor<bf16>,
    wide: DeviceTensor<bf16>,
    ids: DeviceTensor<i32>,
    weights: DeviceTensor<f32>,
    act: Nvfp4Act,
    ws: GemvWorkspace,
    y: DeviceTensor<bf16>,
    logits: DeviceTensor<bf16>,
    h: DeviceTensor<bf16>,
    out: DeviceTensor<f32>,
}

struct Model {
    wide: GemvWeight,
    proj: GemvWeight,
    router: GemvWeight,
    experts: MoeExperts,
}

fn step(dev: &Device, m: &Model, b: &mut Bufs) -> Result<(), GpuError> {
    nvfp4_quantize_act(dev, &b.x, &mut b.act)?;
    gemv::gemv(dev, &b.x, &m.proj, &mut b.y, &mut b.ws)?;
    gemv::gemv(dev, &b.y, &m.router, &mut b.logits, &mut b.ws)?;
    gemv::gemv(dev, &b.xw, &m.wide, &mut b.wide, &mut b.ws)?;
    moe::moe_decode(
        dev,
        &b.y,
        &b.ids,
        &b.weights,
        &m.experts,
        LIMIT,
        &mut b.h,
        MoeOut::F32(&mut b.out),
        || Ok(()),
    )
}

/// Every output of a step, as raw bits.
fn snapshot(dev: &Device, b: &Bufs) -> Vec<Vec<u32>> {
    vec![
        dev.download(&b.act.packed)
            .unwrap()
            .iter()
            .map(|&v| v as u32)
            .collect(),
        dev.download(&b.act.scales)
            .unwrap()
            .iter()
            .map(|&v| v as u32)
            .collect(),
        dev.download(&b.act.global)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        dev.download(&b.y)
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        dev.download(&b.logits)
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        dev.download(&b.out)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_graph_replays_quantize_gemv_moe_bit_identically() {
    let dev = device();
    let seed = rand::random::<u64>();
    println!("gpu_graph_replays_quantize_gemv_moe_bit_identically: seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);

    let pw = gaussian(&mut rng, D * D, 0.03);
    let pq = fp8_block::quantize(&pw, D, D, ScaleFormat::E8m0, 128).unwrap();
    let proj = GemvWeight::upload(
        &dev,
        HostWeight::Fp8 {
            weight: &pq.weight,
            scale: &pq.scale,
            format: ScaleFormat::E8m0,
            block: (128, 128),
        },
        D,
        D,
    )
    .unwrap();
    let rw: Vec<bf16> = gaussian(&mut rng, ROUTER * D, 0.03)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let router = GemvWeight::upload(&dev, HostWeight::Bf16(&rw), ROUTER, D).unwrap();
    let q = |rng: &mut StdRng, r, c| nvfp4::quantize(&gaussian(rng, r * c, 0.04), r, c).unwrap();
    let w1: Vec<_> = (0..EXPERTS).map(|_| q(&mut rng, INTER, D)).collect();
    let w3: Vec<_> = (0..EXPERTS).map(|_| q(&mut rng, INTER, D)).collect();
    let w2: Vec<_> = (0..EXPERTS).map(|_| q(&mut rng, D, INTER)).collect();
    let experts = MoeExperts::upload(
        &dev,
        HostExperts::Nvfp4 {
            w1: &w1,
            w3: &w3,
            w2: &w2,
        },
        D,
        INTER,
    )
    .unwrap();
    let ww: Vec<bf16> = gaussian(&mut rng, WIDE_N * WIDE_K, 0.01)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let wide = GemvWeight::upload(&dev, HostWeight::Bf16(&ww), WIDE_N, WIDE_K).unwrap();
    let model = Model {
        wide,
        proj,
        router,
        experts,
    };

    let mut pool = BufferPool::new();
    let rx = pool.reserve::<bf16>("x", DType::BF16, &[M, D]).unwrap();
    let rxw = pool
        .reserve::<bf16>("xw", DType::BF16, &[M, WIDE_K])
        .unwrap();
    let rwide = pool
        .reserve::<bf16>("wide", DType::BF16, &[M, WIDE_N])
        .unwrap();
    let rids = pool.reserve::<i32>("ids", DType::I32, &[M, TOPK]).unwrap();
    let rwts = pool
        .reserve::<f32>("weights", DType::F32, &[M, TOPK])
        .unwrap();
    let [p, s, g, a] = Nvfp4Act::shapes(M, D);
    let rp = pool.reserve::<u8>("act.packed", p.0, &p.1).unwrap();
    let rs = pool.reserve::<u8>("act.scales", s.0, &s.1).unwrap();
    let rg = pool.reserve::<f32>("act.global", g.0, &g.1).unwrap();
    let ra = pool.reserve::<u32>("act.amax", a.0, &a.1).unwrap();
    let rws = GemvWorkspace::reserve(&mut pool, "gemv").unwrap();
    let ry = pool.reserve::<bf16>("y", DType::BF16, &[M, D]).unwrap();
    let rl = pool
        .reserve::<bf16>("logits", DType::BF16, &[M, ROUTER])
        .unwrap();
    let rh = pool
        .reserve::<bf16>("h", DType::BF16, &[M, TOPK, INTER])
        .unwrap();
    let ro = pool.reserve::<f32>("out", DType::F32, &[M, D]).unwrap();
    pool.seal(&dev).unwrap();
    let mut b = Bufs {
        x: pool.take(rx).unwrap(),
        xw: pool.take(rxw).unwrap(),
        wide: pool.take(rwide).unwrap(),
        ids: pool.take(rids).unwrap(),
        weights: pool.take(rwts).unwrap(),
        act: Nvfp4Act {
            packed: pool.take(rp).unwrap(),
            scales: pool.take(rs).unwrap(),
            global: pool.take(rg).unwrap(),
            amax: pool.take(ra).unwrap(),
        },
        ws: rws.take(&mut pool).unwrap(),
        y: pool.take(ry).unwrap(),
        logits: pool.take(rl).unwrap(),
        h: pool.take(rh).unwrap(),
        out: pool.take(ro).unwrap(),
    };

    let fresh_inputs = |rng: &mut StdRng, b: &mut Bufs| {
        let x: Vec<bf16> = gaussian(rng, M * D, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let mut ids = Vec::new();
        for _ in 0..M {
            let mut all: Vec<i32> = (0..EXPERTS as i32).collect();
            all.shuffle(rng);
            ids.extend_from_slice(&all[..TOPK]);
        }
        let wts: Vec<f32> = (0..M * TOPK)
            .map(|_| rng.random_range(0.05f32..1.0))
            .collect();
        dev.write(&mut b.x, &x).unwrap();
        let xw: Vec<bf16> = gaussian(rng, M * WIDE_K, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        dev.write(&mut b.xw, &xw).unwrap();
        dev.write(&mut b.ids, &ids).unwrap();
        dev.write(&mut b.weights, &wts).unwrap();
    };

    // One eager step first: modules loaded, nothing lazily allocated inside the capture.
    fresh_inputs(&mut rng, &mut b);
    step(&dev, &model, &mut b).unwrap();
    dev.synchronize().unwrap();

    let stream = dev.stream().clone();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let captured = step(&dev, &model, &mut b);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    captured.unwrap();
    let graph = graph.expect("the capture recorded work");

    for round in 0..4 {
        fresh_inputs(&mut rng, &mut b);
        graph.launch().unwrap();
        let replayed = snapshot(&dev, &b);
        step(&dev, &model, &mut b).unwrap();
        let eager = snapshot(&dev, &b);
        let names = [
            "act.packed",
            "act.scales",
            "act.global",
            "y",
            "logits",
            "moe out",
        ];
        for ((name, r), e) in names.iter().zip(&replayed).zip(&eager) {
            assert_eq!(r.len(), e.len());
            let diff = r.iter().zip(e).filter(|(a, b)| a != b).count();
            assert_eq!(
                diff,
                0,
                "round {round}: {name}: {diff} of {} values differ between replay and eager",
                r.len()
            );
        }
        // The replay computed this round's inputs, not the capture's.
        assert!(
            replayed[5].iter().any(|&v| f32::from_bits(v) != 0.0),
            "round {round}: empty MoE output"
        );
        println!("round {round}: replay and eager bit-identical");
    }
}
