//! Multi-GPU tests of the one-shot collectives: on every world size the machine allows, every
//! rank ends with the rank-order CPU sum bit for bit (so all ranks agree), within float
//! rounding of NCCL's all-reduce, over many calls of changing sizes, and over 300 graph
//! replays with fresh inputs. All `#[ignore]`d: `cargo xtask gpu-test`.

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::nccl::safe::{Comm, ReduceOp};
use rand::rngs::StdRng;
use rand::Rng;

use super::reference as cpu;
use super::*;
use crate::gpu::testing::{assert_bits_eq, devices, rng};

const CAP: usize = 16 * 4096;

/// A group of the first `world` devices, each with its own buffers.
fn group(devs: &[Arc<Device>], world: usize) -> Vec<Collective> {
    let devs = &devs[..world];
    enable_peer_access(devs).unwrap();
    let bufs: Vec<RankBuffers> = devs.iter().map(|d| pooled(d, world, CAP)).collect();
    Collective::link(&bufs).unwrap()
}

/// A rank's buffers from a pool of their own (as a model's come from its pool).
fn pooled(dev: &Device, world: usize, cap: usize) -> RankBuffers {
    let mut pool = crate::gpu::BufferPool::new();
    let [(rn, _, r), (fln, _, f), (sn, _, s)] = buffer_shapes(world, cap);
    let (r, f, s) = (
        pool.reserve::<f32>(rn, DType::F32, &r).unwrap(),
        pool.reserve::<u32>(fln, DType::U32, &f).unwrap(),
        pool.reserve::<u32>(sn, DType::U32, &s).unwrap(),
    );
    pool.seal(dev).unwrap();
    RankBuffers {
        recv: pool.take(r).unwrap(),
        flags: pool.take(f).unwrap(),
        state: pool.take(s).unwrap(),
    }
}

/// An F32 tensor of `shape` from a pool of its own.
fn pooled_f32(dev: &Device, shape: &[usize]) -> DeviceTensor<f32> {
    let mut pool = crate::gpu::BufferPool::new();
    let r = pool.reserve::<f32>("t", DType::F32, shape).unwrap();
    pool.seal(dev).unwrap();
    pool.take(r).unwrap()
}

/// Rank r's part `parts[r]` on its device, as a tensor of `shape`.
fn upload_parts(
    devs: &[Arc<Device>],
    parts: &[Vec<f32>],
    shape: &[usize],
) -> Vec<DeviceTensor<f32>> {
    devs.iter()
        .zip(parts)
        .map(|(d, p)| d.upload(DType::F32, shape, p).unwrap())
        .collect()
}

fn random_parts(rng: &mut StdRng, world: usize, len: usize) -> Vec<Vec<f32>> {
    let scale = rng.random_range(1e-3f32..1e3);
    (0..world)
        .map(|_| (0..len).map(|_| rng.random_range(-scale..scale)).collect())
        .collect()
}

#[test]
#[ignore = "needs several CUDA GPUs: cargo xtask gpu-test"]
fn multi_gpu_all_reduce_matches_cpu_sum_and_nccl() {
    let devs = devices();
    let mut rng = rng("multi_gpu_all_reduce_matches_cpu_sum_and_nccl");
    for world in 2..=devs.len().min(MAX_RANKS) {
        let coll = group(&devs, world);
        // NVLink multicast stays off (it can take a shared host's GPUs out of service).
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
        let streams = devs[..world].iter().map(|d| d.stream().clone()).collect();
        let comms = Comm::from_devices(streams).expect("NCCL communicators");
        // Sizes change from call to call (different grids, both halves of the receive
        // buffer, many sequence numbers).
        for call in 0..60 {
            let len = match call % 4 {
                0 => 4096,
                1 => CAP,
                2 => 4,
                _ => 4 * rng.random_range(1..CAP / 4),
            };
            let parts = random_parts(&mut rng, world, len);
            let mut xs = upload_parts(&devs[..world], &parts, &[len]);
            // Every rank's launch is enqueued before any rank is waited for.
            for ((c, d), x) in coll.iter().zip(&devs).zip(&mut xs) {
                c.all_reduce(d, x).unwrap();
            }
            let want = cpu::all_reduce(&parts);
            for (r, (d, x)) in devs.iter().zip(&xs).enumerate() {
                let got = d.download(x).unwrap();
                assert_bits_eq(
                    &format!("world {world}, call {call}, rank {r}"),
                    &got,
                    &want,
                );
            }
            if call % 4 == 3 {
                let mut ys = upload_parts(&devs[..world], &parts, &[len]);
                cudarc::nccl::result::group_start().unwrap();
                for (comm, y) in comms.iter().zip(&mut ys) {
                    comm.all_reduce_in_place(&mut y.view_mut(), &ReduceOp::Sum)
                        .unwrap();
                }
                cudarc::nccl::result::group_end().unwrap();
                let nccl = devs[0].download(&ys[0]).unwrap();
                let worst = nccl
                    .iter()
                    .zip(&want)
                    .enumerate()
                    .map(|(i, (a, b))| {
                        let mag: f32 = parts.iter().map(|p| p[i].abs()).sum();
                        (a - b).abs() / mag.max(f32::MIN_POSITIVE)
                    })
                    .fold(0f32, f32::max);
                assert!(
                    worst <= 4.0 * world as f32 * f32::EPSILON,
                    "world {world}: NCCL differs by {worst} of the magnitude"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs several CUDA GPUs: cargo xtask gpu-test"]
fn multi_gpu_all_gather_cols_matches_cpu() {
    let devs = devices();
    let mut rng = rng("multi_gpu_all_gather_cols_matches_cpu");
    for world in 2..=devs.len().min(MAX_RANKS) {
        let coll = group(&devs, world);
        for call in 0..20 {
            let rows = [1, 16, rng.random_range(1..17)][call % 3];
            let width = [64_640, 7, rng.random_range(1..5000)][call % 3];
            let parts = random_parts(&mut rng, world, rows * width);
            let srcs = upload_parts(&devs[..world], &parts, &[rows, width]);
            let mut dsts: Vec<DeviceTensor<f32>> = devs[..world]
                .iter()
                .map(|d| pooled_f32(d, &[rows, world * width]))
                .collect();
            for (d, t) in devs.iter().zip(&mut dsts) {
                d.fill_bytes(t, crate::gpu::testing::POISON).unwrap();
            }
            let peer = PeerTensors::new(&dsts.iter().collect::<Vec<_>>()).unwrap();
            for ((c, d), s) in coll.iter().zip(&devs).zip(&srcs) {
                c.all_gather_cols(d, s, &peer).unwrap();
            }
            let want = cpu::all_gather_cols(&parts, width);
            for (r, (d, t)) in devs.iter().zip(&dsts).enumerate() {
                let got = d.download(t).unwrap();
                assert_bits_eq(
                    &format!("world {world}, call {call}, rank {r}"),
                    &got,
                    &want,
                );
            }
        }
    }
}

#[test]
#[ignore = "needs several CUDA GPUs: cargo xtask gpu-test"]
fn multi_gpu_collectives_replay_in_graphs() {
    let devs = devices();
    let mut rng = rng("multi_gpu_collectives_replay_in_graphs");
    let world = devs.len().min(MAX_RANKS);
    let coll = group(&devs, world);
    let (len, width) = (4096, 1000);
    let mut xs: Vec<DeviceTensor<f32>> = devs[..world]
        .iter()
        .map(|d| d.alloc(DType::F32, &[len]).unwrap())
        .collect();
    let mut parts_g: Vec<DeviceTensor<f32>> = devs[..world]
        .iter()
        .map(|d| d.alloc(DType::F32, &[1, width]).unwrap())
        .collect();
    let dsts: Vec<DeviceTensor<f32>> = devs[..world]
        .iter()
        .map(|d| pooled_f32(d, &[1, world * width]))
        .collect();
    let peer = PeerTensors::new(&dsts.iter().collect::<Vec<_>>()).unwrap();
    // Each rank's step: two all-reduces and an all-gather, captured once.
    let graphs: Vec<_> = (0..world)
        .map(|r| {
            let (d, c) = (&devs[r], &coll[r]);
            let stream = d.stream();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
            c.all_reduce(d, &mut xs[r]).unwrap();
            c.all_gather_cols(d, &parts_g[r], &peer).unwrap();
            c.all_reduce(d, &mut xs[r]).unwrap();
            stream
                .end_capture(CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("a captured graph")
        })
        .collect();
    for replay in 0..300 {
        let parts = random_parts(&mut rng, world, len);
        let gparts = random_parts(&mut rng, world, width);
        for r in 0..world {
            devs[r].write(&mut xs[r], &parts[r]).unwrap();
            devs[r].write(&mut parts_g[r], &gparts[r]).unwrap();
        }
        for g in &graphs {
            g.launch().unwrap();
        }
        let once = cpu::all_reduce(&parts);
        let want = cpu::all_reduce(&vec![once; world]);
        let want_g = cpu::all_gather_cols(&gparts, width);
        for r in 0..world {
            let what = format!("replay {replay}, rank {r}");
            assert_bits_eq(&what, &devs[r].download(&xs[r]).unwrap(), &want);
            assert_bits_eq(&what, &devs[r].download(&dsts[r]).unwrap(), &want_g);
        }
    }
}

#[test]
#[ignore = "needs several CUDA GPUs: cargo xtask gpu-test"]
fn multi_gpu_collective_misuse_is_refused() {
    let devs = devices();
    let coll = group(&devs, 2);
    let d = &devs[0];
    for len in [6, CAP + 4] {
        let mut x = d.alloc::<f32>(DType::F32, &[len]).unwrap();
        let err = coll[0].all_reduce(d, &mut x).unwrap_err().to_string();
        assert!(err.contains("multiple of 4"), "{len}: {err}");
    }
    let part = d.alloc::<f32>(DType::F32, &[2, 8]).unwrap();
    let wrong: Vec<DeviceTensor<f32>> = devs[..2].iter().map(|d| pooled_f32(d, &[2, 15])).collect();
    let peer = PeerTensors::new(&wrong.iter().collect::<Vec<_>>()).unwrap();
    let err = coll[0]
        .all_gather_cols(d, &part, &peer)
        .unwrap_err()
        .to_string();
    assert!(err.contains("over 2 ranks"), "{err}");
    // Off a 16-byte boundary (one float into a pool buffer).
    let whole = pooled_f32(d, &[12]);
    let mut off = whole.view(1, &[8]).unwrap();
    let err = coll[0].all_reduce(d, &mut off).unwrap_err().to_string();
    assert!(err.contains("16-byte boundary"), "{err}");
    // An empty part.
    let right: Vec<DeviceTensor<f32>> = devs[..2].iter().map(|d| pooled_f32(d, &[2, 16])).collect();
    let peer = PeerTensors::new(&right.iter().collect::<Vec<_>>()).unwrap();
    let empty = whole.view(0, &[0, 8]).unwrap();
    let err = coll[0]
        .all_gather_cols(d, &empty, &peer)
        .unwrap_err()
        .to_string();
    assert!(err.contains("an empty part"), "{err}");
    let err = PeerTensors::new(&[]).err().unwrap().to_string();
    assert!(err.contains("no ranks"), "{err}");
    let one = pooled(d, 2, 8);
    let err = Collective::link(&[one]).err().unwrap().to_string();
    assert!(err.contains("[2, 1, cap]"), "{err}");
    let nine: Vec<RankBuffers> = (0..9).map(|_| pooled(d, 9, 8)).collect();
    let err = Collective::link(&nine).err().unwrap().to_string();
    assert!(err.contains("9 ranks: 1 to 8"), "{err}");
}
