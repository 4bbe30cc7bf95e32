//! A step captured once and replayed: embedding gather of the device token, RMSNorm, RoPE at
//! the device position, position advance. Replays must be bit-identical to eager launches,
//! follow the token and position buffers (not the values seen at capture), walk the position
//! forward by themselves, and a captured step must not be able to do host-side work.

use dsv4_graph::{GraphError, StepGraph};
use dsv4_ops::gpu::rows::{self, reference, RopeDirection};
use dsv4_ops::gpu::testing::{assert_bits_eq, device, random_bf16, rng};
use dsv4_ops::gpu::{DType, Device, DeviceTensor, GpuError, Side};
use half::bf16;
use rand::Rng;

const VOCAB: usize = 1000;
const D: usize = 512;
const HC: usize = 4;
const ROPE: usize = 64;
const EPS: f32 = 1e-6;

struct Step {
    table: DeviceTensor<bf16>,
    weight: DeviceTensor<f32>,
    inv_freq: DeviceTensor<f32>,
    token: DeviceTensor<u32>,
    pos: DeviceTensor<u32>,
    streams: DeviceTensor<f32>,
    normed: DeviceTensor<f32>,
}

fn run(dev: &Device, s: &mut Step) -> Result<(), GpuError> {
    rows::embed_hc_gather(dev, &s.table, &s.token, HC, &mut s.streams)?;
    rows::rms_norm_rows(dev, &s.streams, Some(&s.weight), EPS, &mut s.normed, None)?;
    rows::rope_rows(
        dev,
        &mut s.normed,
        D,
        &s.inv_freq,
        &s.pos,
        RopeDirection::Forward,
    )?;
    rows::advance_position(dev, &mut s.pos, 1)
}

/// The step on the CPU: what the output must be within the kernels' stated bounds.
fn reference_step(
    table: &[bf16],
    weight: &[f32],
    inv_freq: &[f32],
    token: u32,
    pos: usize,
) -> Vec<f32> {
    let mut x = reference::embed_hc_gather(table, D, &[token], HC);
    reference::rms_norm_rows(&mut x, HC * D, Some(weight), EPS);
    reference::rope_rows(&mut x, HC, D, inv_freq, pos, RopeDirection::Forward);
    x
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_step_graph_replays_bit_identically_and_walks_positions() {
    let dev = device();
    let mut rng = rng("gpu_step_graph_replays_bit_identically_and_walks_positions");
    let table = random_bf16(&mut rng, VOCAB * D, false);
    let weight: Vec<f32> = (0..HC * D).map(|_| rng.random_range(0.5..1.5)).collect();
    let inv_freq: Vec<f32> = (0..ROPE / 2)
        .map(|i| 10000f32.powf(-(2.0 * i as f32) / ROPE as f32))
        .collect();
    let mut s = Step {
        table: dev.upload(DType::BF16, &[VOCAB, D], &table).unwrap(),
        weight: dev.upload(DType::F32, &[HC * D], &weight).unwrap(),
        inv_freq: dev.upload(DType::F32, &[ROPE / 2], &inv_freq).unwrap(),
        token: dev.upload(DType::U32, &[1], &[3]).unwrap(),
        pos: dev.upload(DType::U32, &[1], &[0]).unwrap(),
        streams: dev.alloc(DType::F32, &[1, HC * D]).unwrap(),
        normed: dev.alloc(DType::F32, &[1, HC * D]).unwrap(),
    };
    run(&dev, &mut s).unwrap();
    dev.synchronize().unwrap();
    let graph = StepGraph::capture(&dev, || run(&dev, &mut s)).unwrap();
    assert_eq!(graph.nodes(), 4, "one node per launch");

    let close = |what: &str, got: &[f32], want: &[f32]| {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        assert!(diff <= 1e-5 * scale, "{what}: max|Δ| {diff} vs max {scale}");
    };

    // Replay against eager launches on the same token and position.
    for round in 0..6 {
        let token = rng.random_range(0..VOCAB as u32);
        let pos = rng.random_range(0..1u32 << 20);
        dev.write(&mut s.token, &[token]).unwrap();
        dev.write(&mut s.pos, &[pos]).unwrap();
        graph.replay().unwrap();
        let replayed = dev.download(&s.normed).unwrap();
        assert_eq!(
            dev.download(&s.pos).unwrap(),
            vec![pos + 1],
            "round {round}"
        );
        dev.write(&mut s.pos, &[pos]).unwrap();
        run(&dev, &mut s).unwrap();
        let eager = dev.download(&s.normed).unwrap();
        assert_bits_eq(&format!("round {round}"), &bits(&replayed), &bits(&eager));
        let want = reference_step(&table, &weight, &inv_freq, token, pos as usize);
        close(&format!("round {round} vs CPU"), &replayed, &want);
    }

    // Back-to-back replays walk the position with no host write between them.
    let (token, start) = (17u32, 1000u32);
    dev.write(&mut s.token, &[token]).unwrap();
    dev.write(&mut s.pos, &[start]).unwrap();
    for k in 0..50u32 {
        graph.replay().unwrap();
        if k % 10 == 9 {
            let got = dev.download(&s.normed).unwrap();
            let want = reference_step(&table, &weight, &inv_freq, token, (start + k) as usize);
            close(&format!("replay {k}"), &got, &want);
        }
    }
    assert_eq!(dev.download(&s.pos).unwrap(), vec![start + 50]);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_captured_step_cannot_do_host_work() {
    let dev = device();
    let mut t = dev.alloc::<f32>(DType::F32, &[4]).unwrap();
    let refused = |r: Result<StepGraph, GraphError>| match r {
        Err(GraphError::Step(GpuError::InCapture { what })) => what,
        Err(e) => panic!("expected an in-capture refusal, got {e}"),
        Ok(_) => panic!("a step doing host work was captured"),
    };
    assert_eq!(
        refused(StepGraph::capture(&dev, || dev
            .alloc::<f32>(DType::F32, &[4])
            .map(drop))),
        "allocating"
    );
    assert_eq!(
        refused(StepGraph::capture(&dev, || dev.download(&t).map(drop))),
        "copying to the host"
    );
    assert_eq!(
        refused(StepGraph::capture(&dev, || dev.synchronize())),
        "waiting for the stream"
    );
    assert_eq!(
        refused(StepGraph::capture(&dev, || dev.write(&mut t, &[1.0; 4]))),
        "copying host data to the device"
    );
    // Each abandoned capture was ended: the stream works as before.
    assert!(!dev.is_capturing().unwrap());
    dev.write(&mut t, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    assert_eq!(dev.download(&t).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert!(matches!(
        StepGraph::capture(&dev, || Ok(())),
        Err(GraphError::Empty)
    ));
    // A capture inside a captured step is refused; the outer capture goes on.
    let mut pos = dev.upload(DType::U32, &[1], &[0u32]).unwrap();
    let mut inner = None;
    let outer = StepGraph::capture(&dev, || {
        inner = Some(StepGraph::capture(&dev, || Ok(())));
        rows::advance_position(&dev, &mut pos, 1)
    })
    .unwrap();
    assert!(matches!(inner, Some(Err(GraphError::Nested))));
    outer.replay().unwrap();
    assert_eq!(dev.download(&pos).unwrap(), vec![1]);
}

/// Norms `a` on the second side stream and `b` on the stream; the first side stream norms the
/// second's output after it; joins, then norms the first's output.
fn side_step(
    dev: &Device,
    (a, b): (&DeviceTensor<f32>, &DeviceTensor<f32>),
    a_n: &mut DeviceTensor<f32>,
    b_n: &mut DeviceTensor<f32>,
    c_n: &mut DeviceTensor<f32>,
    out: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    dev.fork_to(Side::Second)?;
    dev.on(Side::Second, || {
        rows::rms_norm_rows(dev, a, None, EPS, a_n, None)
    })?;
    rows::rms_norm_rows(dev, b, None, EPS, b_n, None)?;
    dev.fork()?;
    dev.side_waits(Side::First)?;
    dev.on_side(|| rows::rms_norm_rows(dev, &*a_n, None, EPS, c_n, None))?;
    dev.join()?;
    rows::rms_norm_rows(dev, &*c_n, None, EPS, out, None)
}

/// Work forked to both side streams joins the capture, the first waiting for the second:
/// [`side_step`] replays to the bits of the same launches issued eagerly, on fresh inputs
/// copied in before each replay, and after `on` launches go to the stream again.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_side_stream_work_joins_the_capture() {
    let dev = device();
    let mut rng = rng("gpu_side_stream_work_joins_the_capture");
    let alloc = || dev.alloc::<f32>(DType::F32, &[4, D]).unwrap();
    let (mut a, mut b) = (alloc(), alloc());
    let (mut a_n, mut b_n, mut c_n, mut out) = (alloc(), alloc(), alloc(), alloc());
    let main = dev.stream().cu_stream();
    let mut fresh = |a: &mut DeviceTensor<f32>, b: &mut DeviceTensor<f32>| {
        for t in [a, b] {
            let v: Vec<f32> = (0..4 * D).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            dev.write(t, &v).unwrap();
        }
    };
    fresh(&mut a, &mut b);
    let step = |a: &DeviceTensor<f32>, b: &DeviceTensor<f32>, bufs: [&mut DeviceTensor<f32>; 4]| {
        let [a_n, b_n, c_n, out] = bufs;
        side_step(&dev, (a, b), a_n, b_n, c_n, out)
    };
    step(&a, &b, [&mut a_n, &mut b_n, &mut c_n, &mut out]).unwrap();
    assert_eq!(
        dev.stream().cu_stream(),
        main,
        "launches go to the stream again"
    );
    let graph = StepGraph::capture(&dev, || {
        step(&a, &b, [&mut a_n, &mut b_n, &mut c_n, &mut out])
    })
    .unwrap();
    for round in 0..3 {
        fresh(&mut a, &mut b);
        graph.replay().unwrap();
        let (got_b, got) = (dev.download(&b_n).unwrap(), dev.download(&out).unwrap());
        step(&a, &b, [&mut a_n, &mut b_n, &mut c_n, &mut out]).unwrap();
        let what = format!("replay {round}");
        assert_bits_eq(
            &format!("{what}: the stream's norm"),
            &got_b,
            &dev.download(&b_n).unwrap(),
        );
        assert_bits_eq(
            &format!("{what}: after the join"),
            &got,
            &dev.download(&out).unwrap(),
        );
    }
}

/// A side stream waits for the other only when both were forked since their last join (else a
/// capture would wait on a stream outside it, or end with a side it does not take back).
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_side_waits_refuses_sides_not_forked() {
    let dev = device();
    let refused = |dev: &Device| {
        let err = dev.side_waits(Side::First).unwrap_err().to_string();
        assert!(err.contains("both side streams must be forked"), "{err}");
    };
    refused(&dev);
    dev.fork().unwrap();
    refused(&dev);
    dev.fork_to(Side::Second).unwrap();
    dev.side_waits(Side::First).unwrap();
    dev.join().unwrap();
    refused(&dev);
}
