//! Decode kernels at M = 1 on DeepSeek-V4 Flash and Pro shapes: every attention projection
//! (FP8 block), the indexer wq_b, routed-expert gate+up (fused) and down (NVFP4, MXFP4), the
//! shared expert (FP8), lm_head (BF16) and the six-expert grouped MoE of a Flash layer; next to
//! cuBLAS BF16 GEMV on a matrix of the same byte size. Also the format kernels: the NVFP4
//! activation quantizer at M = 1 and 16 on the hidden and expert-intermediate widths, and the
//! load-time NVFP4 / MXFP4 / FP8 dequantize of one Flash expert matrix. And the per-token
//! kernels of the decode step (`step` cases): an mHC site's hc_pre and hc_post_mix, RoPE on the
//! queries, routing, sampling.
//!
//! Method: each measurement is a CUDA graph of back-to-back launches, replayed and timed with
//! CUDA events; the time per launch is the replay time over the launch count. Launches rotate
//! over enough weight copies that one round touches at least 3x the L2 size, so weights come
//! from HBM (matrices larger than that use one copy). The MoE rotates over random routings of
//! a 256-expert layer; the format kernels rotate over copies of their inputs and outputs.
//! Bytes counted: weights and scales, plus activations read and written.
//! The ceiling is a 1 GiB device-to-device copy timed with events (read + write bytes).
//!
//! GEMVs and the MoE's down kernel launch with programmatic dependent launch (each launch
//! streams its first weights while the previous one finishes), as in the engine's decode graph;
//! the table also gives each case without it (the format kernels always launch plainly, so they
//! are timed once). A second table times a few cases at other grid sizes (warps per SM).
//!
//! `cargo bench -p dsv4-ops --bench decode_kernels` (criterion); the tables are printed at the
//! end and written to `$DSV4_BENCH_TABLE` when set. `DSV4_BENCH_ONLY=Pro/attn` keeps the cases
//! whose `model/kernel` contains the text, or one of several separated by `|` (`quantize`
//! keeps the format kernels). `DSV4_BENCH_STAGING=off` runs every GEMV and the MoE's gate_up
//! with its activations read from global memory instead of staged in shared memory;
//! `DSV4_BENCH_CLUSTER_SUM=off` and `DSV4_BENCH_WHOLE_TILE=off` turn off the GEMV's two
//! alternatives to summing a tile's blocks through the workspace (a thread-block cluster, one
//! whole-tile block); `DSV4_BENCH_PRESCALED=off` keeps FP8 GEMVs at M = 1 off the kernels
//! with prescaled activations.

use std::time::Duration;

use criterion::Criterion;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::sys::{
    CUdevice_attribute, CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudarc::driver::CudaGraph;
use dsv4_ops::codecs::fp8_block::ScaleFormat;
use dsv4_ops::codecs::mxfp4::Mxfp4Quantized;
use dsv4_ops::codecs::nvfp4::Nvfp4Quantized;
use dsv4_ops::gpu::bandwidth::measure_copy_bandwidth;
use dsv4_ops::gpu::formats::{self, Fp8Scales, Nvfp4Act};
use dsv4_ops::gpu::gemv::{self, tuning, GemvWeight, GemvWorkspace, HostWeight};
use dsv4_ops::gpu::moe::{self, MoeExperts, MoeFormat, MoeOut};
use dsv4_ops::gpu::{mhc, router, rows, sample};
use dsv4_ops::gpu::{DType, Device, DeviceTensor};
use half::bf16;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// splitmix64: fast, good-enough bytes for weights.
struct Bits(u64);
impl Bits {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
    fn in_range(&mut self, n: usize, lo: u8, hi: u8) -> Vec<u8> {
        self.bytes(n)
            .into_iter()
            .map(|b| lo + b % (hi - lo + 1))
            .collect()
    }
    /// Uniform in [-1, 1).
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }

    fn bf16s(&mut self, n: usize) -> Vec<bf16> {
        // |v| in [2^-8, 2^-4): sign, exponent 119..122, random mantissa.
        (0..n)
            .map(|_| {
                let r = self.next();
                let bits = ((r & 1) << 15) | ((119 + (r >> 1) % 4) << 7) | ((r >> 8) & 0x7f);
                bf16::from_bits(bits as u16)
            })
            .collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fmt {
    F32,
    Bf16,
    Fp8,
    Nvfp4,
    Mxfp4,
}

impl Fmt {
    fn label(self) -> &'static str {
        match self {
            Fmt::F32 => "F32",
            Fmt::Bf16 => "BF16",
            Fmt::Fp8 => "FP8 128x128 e8m0",
            Fmt::Nvfp4 => "NVFP4",
            Fmt::Mxfp4 => "MXFP4",
        }
    }
}

/// Host data of one random weight in a format.
enum Owned {
    Bf16(Vec<bf16>),
    Fp8 { weight: Vec<u8>, scale: Vec<u8> },
    Nvfp4(Nvfp4Quantized),
    Mxfp4(Mxfp4Quantized),
}

impl Owned {
    fn random(bits: &mut Bits, fmt: Fmt, n: usize, k: usize) -> Owned {
        match fmt {
            Fmt::F32 => unreachable!("no F32 weights are benched"),
            Fmt::Bf16 => Owned::Bf16(bits.bf16s(n * k)),
            Fmt::Fp8 => {
                // No NaN codes (0x7f / 0xff).
                let weight = bits
                    .bytes(n * k)
                    .into_iter()
                    .map(|b| if b & 0x7f == 0x7f { b ^ 1 } else { b })
                    .collect();
                let scale = bits.in_range(n.div_ceil(128) * k.div_ceil(128), 115, 125);
                Owned::Fp8 { weight, scale }
            }
            Fmt::Nvfp4 => Owned::Nvfp4(Nvfp4Quantized {
                weight: bits.bytes(n * k / 2),
                weight_scale: bits.in_range(n * k / 16, 0x20, 0x58),
                weight_scale_2: 1.0 / 2688.0,
            }),
            Fmt::Mxfp4 => Owned::Mxfp4(Mxfp4Quantized {
                weight: bits.bytes(n * k / 2),
                scale: bits.in_range(n * k / 32, 112, 126),
            }),
        }
    }

    fn host(&self) -> HostWeight<'_> {
        match self {
            Owned::Bf16(v) => HostWeight::Bf16(v),
            Owned::Fp8 { weight, scale } => HostWeight::Fp8 {
                weight,
                scale,
                format: ScaleFormat::E8m0,
                block: (128, 128),
            },
            Owned::Nvfp4(q) => HostWeight::from(q),
            Owned::Mxfp4(q) => HostWeight::from(q),
        }
    }
}

/// One copy of the buffers a format kernel reads and writes.
trait FormatLaunch {
    /// Bytes one launch reads and writes.
    fn bytes(&self) -> usize;
    /// The shape the table gives.
    fn shape(&self) -> &[usize];
    fn launch(&mut self, dev: &Device) -> Res<()>;
}

/// NVFP4 quantize of bf16 activations: device-side amax, e4m3 block scales, e2m1 codes.
struct ActQuantize {
    x: DeviceTensor<bf16>,
    out: Nvfp4Act,
}

impl ActQuantize {
    fn random(dev: &Device, bits: &mut Bits, rows: usize, cols: usize) -> Res<ActQuantize> {
        Ok(ActQuantize {
            x: dev.upload(DType::BF16, &[rows, cols], &bits.bf16s(rows * cols))?,
            out: Nvfp4Act::alloc(dev, rows, cols)?,
        })
    }
}

impl FormatLaunch for ActQuantize {
    /// x counted once (the quantize pass reads it again after the amax pass, from L2), codes
    /// and scales written.
    fn bytes(&self) -> usize {
        self.x.num_bytes() + self.out.packed.num_bytes() + self.out.scales.num_bytes()
    }

    fn shape(&self) -> &[usize] {
        self.x.shape()
    }

    fn launch(&mut self, dev: &Device) -> Res<()> {
        formats::nvfp4_quantize_act(dev, &self.x, &mut self.out)?;
        Ok(())
    }
}

/// The per-token kernels of a decode step at M = 1, each on its own inputs and outputs.
enum StepOp {
    /// One mHC site: the mix projection of the 4 streams, collapse and norm (Sinkhorn is
    /// `hc_comb`'s, off the path).
    HcPre {
        streams: DeviceTensor<f32>,
        site: mhc::DeviceHcSite,
        partials: DeviceTensor<f32>,
        norm: DeviceTensor<f32>,
        xn: DeviceTensor<f32>,
        xb: DeviceTensor<half::bf16>,
        mix: mhc::DeviceHcMix,
    },
    /// The expansion back into 4 streams with the next site's mix projection.
    HcPostMix {
        streams: DeviceTensor<f32>,
        y: DeviceTensor<f32>,
        mix: mhc::DeviceHcMix,
        out: DeviceTensor<f32>,
        next: mhc::DeviceHcSite,
        partials: DeviceTensor<f32>,
    },
    /// RoPE on the 64 rotary channels of every attention head's query.
    Rope {
        q: DeviceTensor<f32>,
        inv_freq: DeviceTensor<f32>,
        pos: DeviceTensor<u32>,
    },
    /// Learned top-6 routing over the layer's experts.
    Route {
        logits: DeviceTensor<f32>,
        token: DeviceTensor<u32>,
        bias: DeviceTensor<f32>,
        ids: DeviceTensor<i32>,
        weights: DeviceTensor<f32>,
    },
    /// Temperature 0.7 + top-p 0.9 over the vocabulary.
    Sample {
        logits: DeviceTensor<f32>,
        params: DeviceTensor<u32>,
        pos: DeviceTensor<u32>,
        weights: DeviceTensor<f32>,
        token: DeviceTensor<u32>,
    },
}

const STEP_PARAMS: mhc::reference::HcParams = mhc::reference::HcParams {
    n: mhc::HC,
    sinkhorn_iters: 20,
    hc_eps: 1e-6,
    norm_eps: 1e-6,
};

impl StepOp {
    fn f32s(dev: &Device, bits: &mut Bits, shape: &[usize]) -> Res<DeviceTensor<f32>> {
        Ok(dev.upload(DType::F32, shape, &bits.f32s(shape.iter().product()))?)
    }

    /// `which` in hc_pre, hc_post_mix, rope, route, sample; `d` the hidden size, `heads` the
    /// attention heads, `experts` the routed experts.
    fn random(
        dev: &Device,
        bits: &mut Bits,
        which: &str,
        d: usize,
        heads: usize,
        experts: usize,
    ) -> Res<StepOp> {
        let hc = mhc::HC;
        let mut f = |shape: &[usize]| Self::f32s(dev, bits, shape);
        let pre_out =
            |f: &mut dyn FnMut(&[usize]) -> Res<DeviceTensor<f32>>| -> Res<mhc::DeviceHcMix> {
                Ok(mhc::DeviceHcMix {
                    post: f(&[1, hc])?,
                    comb: f(&[1, hc * hc])?,
                })
            };
        Ok(match which {
            "hc_pre" => {
                let streams = f(&[1, hc * d])?;
                let site = mhc::DeviceHcSite {
                    fn_: f(&[mhc::MIX, hc * d])?,
                    base: f(&[mhc::MIX])?,
                    scale: f(&[3])?,
                };
                StepOp::HcPre {
                    streams,
                    site,
                    partials: f(&mhc::mix_partials_shape(1, d))?,
                    norm: f(&[d])?,
                    xn: f(&[1, d])?,
                    xb: dev.alloc(DType::BF16, &[1, d])?,
                    mix: pre_out(&mut f)?,
                }
            }
            "hc_post_mix" => StepOp::HcPostMix {
                streams: f(&[1, hc * d])?,
                y: f(&[1, d])?,
                mix: pre_out(&mut f)?,
                out: f(&[1, hc * d])?,
                next: mhc::DeviceHcSite {
                    fn_: f(&[mhc::MIX, hc * d])?,
                    base: f(&[mhc::MIX])?,
                    scale: f(&[3])?,
                },
                partials: f(&mhc::mix_partials_shape(1, d))?,
            },
            "rope" => StepOp::Rope {
                q: f(&[1, heads * 512])?,
                inv_freq: f(&[32])?,
                pos: dev.upload(DType::U32, &[1], &[123_456u32])?,
            },
            "route" => StepOp::Route {
                logits: f(&[1, experts])?,
                token: dev.upload(DType::U32, &[1], &[7u32])?,
                bias: f(&[experts])?,
                ids: dev.alloc(DType::I32, &[1, 6])?,
                weights: f(&[1, 6])?,
            },
            _ => StepOp::Sample {
                logits: dev.upload(
                    DType::F32,
                    &[1, 129_280],
                    &bits
                        .f32s(129_280)
                        .iter()
                        .map(|v| 8.0 * v)
                        .collect::<Vec<_>>(),
                )?,
                params: dev.upload(
                    DType::U32,
                    &[1, 4],
                    &sample::Sampling {
                        temperature: 0.7,
                        top_p: 0.9,
                        seed: 1,
                    }
                    .device_words()
                    .expect("valid settings"),
                )?,
                pos: dev.upload(DType::U32, &[1], &[99u32])?,
                weights: dev.alloc(DType::F32, &[1, 129_280])?,
                token: dev.alloc(DType::U32, &[1])?,
            },
        })
    }
}

impl FormatLaunch for StepOp {
    /// Inputs read once and outputs written once (the sampler's bisection re-reads its
    /// weights from L2; they count once).
    fn bytes(&self) -> usize {
        match self {
            StepOp::HcPre {
                streams,
                site,
                norm,
                xn,
                xb,
                mix,
                ..
            } => {
                streams.num_bytes()
                    + site.fn_.num_bytes()
                    + norm.num_bytes()
                    + xn.num_bytes()
                    + xb.num_bytes()
                    + mix.comb.num_bytes()
            }
            StepOp::HcPostMix {
                streams,
                y,
                out,
                next,
                partials,
                ..
            } => {
                streams.num_bytes()
                    + y.num_bytes()
                    + out.num_bytes()
                    + next.fn_.num_bytes()
                    + partials.num_bytes()
            }
            StepOp::Rope { q, .. } => 2 * q.num_bytes() / 8,
            StepOp::Route { logits, bias, .. } => logits.num_bytes() + bias.num_bytes(),
            StepOp::Sample {
                logits, weights, ..
            } => logits.num_bytes() + 2 * weights.num_bytes(),
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            StepOp::HcPre { streams, .. } | StepOp::HcPostMix { streams, .. } => streams.shape(),
            StepOp::Rope { q, .. } => q.shape(),
            StepOp::Route { logits, .. } | StepOp::Sample { logits, .. } => logits.shape(),
        }
    }

    fn launch(&mut self, dev: &Device) -> Res<()> {
        match self {
            StepOp::HcPre {
                streams,
                site,
                partials,
                norm,
                xn,
                xb,
                mix,
            } => {
                mhc::hc_mix(dev, streams, site, &STEP_PARAMS, partials)?;
                let input = mhc::NormedInput {
                    weight: norm,
                    eps: 1e-6,
                    xn,
                    xb,
                };
                mhc::hc_pre(dev, streams, site, &STEP_PARAMS, partials, input, mix)?
            }
            StepOp::HcPostMix {
                streams,
                y,
                mix,
                out,
                next,
                partials,
            } => mhc::hc_post_mix(
                dev,
                streams,
                y,
                None,
                mix,
                out,
                next,
                &STEP_PARAMS,
                partials,
            )?,
            StepOp::Rope { q, inv_freq, pos } => {
                rows::rope_rows(dev, q, 512, inv_freq, pos, rows::RopeDirection::Forward)?
            }
            StepOp::Route {
                logits,
                token,
                bias,
                ids,
                weights,
            } => router::route_topk(
                dev,
                logits,
                token,
                router::DeviceRouteBy::Learned { bias },
                2.5,
                ids,
                weights,
            )?,
            StepOp::Sample {
                logits,
                params,
                pos,
                weights,
                token,
            } => sample::sample(dev, logits, params, pos, 0, weights, token)?,
        }
        Ok(())
    }
}

/// A quantized weight as its dequantize launcher takes it.
enum QuantWeight {
    Nvfp4 {
        codes: DeviceTensor<u8>,
        scales: DeviceTensor<u8>,
        global: DeviceTensor<f32>,
    },
    Mxfp4 {
        codes: DeviceTensor<u8>,
        scales: DeviceTensor<u8>,
    },
    Fp8 {
        codes: DeviceTensor<u8>,
        scales: DeviceTensor<u8>,
    },
}

/// Load-time dequantize of a random `[n, k]` weight to bf16.
struct WeightDequant {
    weight: QuantWeight,
    out: DeviceTensor<bf16>,
}

impl WeightDequant {
    fn random(dev: &Device, bits: &mut Bits, fmt: Fmt, n: usize, k: usize) -> Res<WeightDequant> {
        let weight = match Owned::random(bits, fmt, n, k) {
            Owned::Nvfp4(q) => QuantWeight::Nvfp4 {
                codes: dev.upload(DType::E2M1x2, &[n, k / 2], &q.weight)?,
                scales: dev.upload(DType::E4M3, &[n, k / 16], &q.weight_scale)?,
                global: dev.upload(DType::F32, &[1], &[q.weight_scale_2])?,
            },
            Owned::Mxfp4(q) => QuantWeight::Mxfp4 {
                codes: dev.upload(DType::E2M1x2, &[n, k / 2], &q.weight)?,
                scales: dev.upload(DType::E8M0, &[n, k / 32], &q.scale)?,
            },
            Owned::Fp8 { weight, scale } => QuantWeight::Fp8 {
                codes: dev.upload(DType::E4M3, &[n, k], &weight)?,
                scales: dev.upload(DType::E8M0, &[n.div_ceil(128), k.div_ceil(128)], &scale)?,
            },
            Owned::Bf16(_) => return Err("BF16 weights have nothing to dequantize".into()),
        };
        Ok(WeightDequant {
            weight,
            out: dev.alloc(DType::BF16, &[n, k])?,
        })
    }
}

impl FormatLaunch for WeightDequant {
    /// Codes and scales read, bf16 written.
    fn bytes(&self) -> usize {
        let (QuantWeight::Nvfp4 { codes, scales, .. }
        | QuantWeight::Mxfp4 { codes, scales }
        | QuantWeight::Fp8 { codes, scales }) = &self.weight;
        codes.num_bytes() + scales.num_bytes() + self.out.num_bytes()
    }

    fn shape(&self) -> &[usize] {
        self.out.shape()
    }

    fn launch(&mut self, dev: &Device) -> Res<()> {
        let out = &mut self.out;
        match &self.weight {
            QuantWeight::Nvfp4 {
                codes,
                scales,
                global,
            } => formats::nvfp4_dequant(dev, codes, scales, global, out)?,
            QuantWeight::Mxfp4 { codes, scales } => {
                formats::mxfp4_dequant(dev, codes, scales, out)?
            }
            QuantWeight::Fp8 { codes, scales } => {
                formats::fp8_block_dequant(dev, codes, Fp8Scales::E8m0(scales), (128, 128), out)?
            }
        }
        Ok(())
    }
}

/// Per-launch seconds of each replay of a graph of `batch` launches from `enqueue(i)`.
struct Timer {
    graph: CudaGraph,
    batch: usize,
}

impl Timer {
    fn capture(
        dev: &Device,
        batch: usize,
        mut enqueue: impl FnMut(usize) -> Res<()>,
    ) -> Res<Timer> {
        // Eager pass first: module loads and lazy allocations stay out of the capture.
        for i in 0..batch {
            enqueue(i)?;
        }
        dev.synchronize()?;
        let stream = dev.stream().clone();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let mut result = Ok(());
        for i in 0..batch {
            result = enqueue(i);
            if result.is_err() {
                break;
            }
        }
        let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
        result?;
        let graph = graph.ok_or("empty capture")?;
        graph.upload()?;
        Ok(Timer { graph, batch })
    }

    fn replay_seconds(&self, dev: &Device, replays: usize) -> Res<Vec<f64>> {
        let ctx = dev.context();
        let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        self.graph.launch()?;
        let mut out = Vec::with_capacity(replays);
        for _ in 0..replays {
            start.record(dev.stream())?;
            self.graph.launch()?;
            end.record(dev.stream())?;
            out.push(start.elapsed_ms(&end)? as f64 * 1e-3 / self.batch as f64);
        }
        Ok(out)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Row {
    model: &'static str,
    name: String,
    shape: String,
    format: &'static str,
    bytes: usize,
    seconds: f64,
    /// The same launches without programmatic dependent launch, for kernels that use it.
    seconds_no_pdl: Option<f64>,
    copies: usize,
    cublas: Option<(String, f64)>,
}

impl Row {
    /// A row with one timing and no cuBLAS comparison; the GEMVs and the MoE add theirs.
    fn new(
        model: &'static str,
        name: &str,
        shape: String,
        fmt: Fmt,
        bytes: usize,
        seconds: f64,
        copies: usize,
    ) -> Row {
        Row {
            model,
            name: name.to_string(),
            shape,
            format: fmt.label(),
            bytes,
            seconds,
            seconds_no_pdl: None,
            copies,
            cublas: None,
        }
    }
}

/// Grid sizes (GEMV warps per SM) timed for the sweep table; the default fills the GPU once.
const SWEEP_WARPS: [usize; 6] = [8, 10, 12, 16, 20, 32];
/// Cases of the sweep table.
const SWEEP_CASES: [&str; 7] = [
    "Flash/attn wq_a",
    "Flash/attn wq_b",
    "Flash/shared expert w1+w3",
    "Pro/shared expert w2",
    "Flash/expert w1+w3 (fused SwiGLU) 2 x [2048, 4096] NVFP4",
    "Pro/attn wo_b",
    "Pro/expert w1+w3 (fused SwiGLU) 2 x [3072, 7168] NVFP4",
];

struct Bench {
    dev: Device,
    blas: Option<CudaBlas>,
    l2: usize,
    copy_bps: f64,
    bits: Bits,
    rows: Vec<Row>,
    /// (case, warps per SM, seconds).
    sweep: Vec<(String, usize, f64)>,
    criterion: Criterion,
    /// Only cases whose `model/kernel` contains this (`DSV4_BENCH_ONLY`).
    only: Option<String>,
}

/// Launches per graph and weight copies for `bytes`-sized weights.
fn rotation(bytes: usize, l2: usize) -> (usize, usize) {
    let copies = (3 * l2).div_ceil(bytes).clamp(1, 256);
    let batch = copies.max(20).div_ceil(copies) * copies;
    (copies, batch)
}

impl Bench {
    fn skip(&self, model: &str, name: &str) -> bool {
        self.only.as_deref().is_some_and(|f| {
            let case = format!("{model}/{name}");
            !f.split('|').any(|part| case.contains(part))
        })
    }

    /// Median per-launch time of `timer` (15 replays), also reported to criterion as `id`.
    fn record(dev: &Device, criterion: &mut Criterion, id: &str, timer: &Timer) -> Res<f64> {
        let secs = median(timer.replay_seconds(dev, 15)?);
        criterion.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let replays = (iters as usize).div_ceil(timer.batch).max(1);
                let s: f64 = timer
                    .replay_seconds(dev, replays)
                    .expect("graph replay")
                    .iter()
                    .sum();
                Duration::from_secs_f64(
                    s * timer.batch as f64 * iters as f64 / (replays * timer.batch) as f64,
                )
            })
        });
        Ok(secs)
    }

    fn timer_samples(&self, timer: &Timer, n: usize) -> Res<Vec<f64>> {
        timer.replay_seconds(&self.dev, n)
    }

    /// Median per-launch time of a fresh capture, under the current tuning.
    fn quick(&self, batch: usize, enqueue: impl FnMut(usize) -> Res<()>) -> Res<f64> {
        let timer = Timer::capture(&self.dev, batch, enqueue)?;
        Ok(median(self.timer_samples(&timer, 15)?))
    }

    /// [`Bench::quick`] with programmatic dependent launch off.
    fn quick_without_pdl(&self, batch: usize, enqueue: impl FnMut(usize) -> Res<()>) -> Res<f64> {
        tuning::PROGRAMMATIC_LAUNCH.set(false);
        let seconds = self.quick(batch, enqueue);
        tuning::PROGRAMMATIC_LAUNCH.set(true);
        seconds
    }

    /// cuBLAS BF16 GEMV (GemmEx, M = 1) on `[n', k]` with n' chosen for the same byte size.
    fn cublas_same_bytes(&mut self, bytes: usize, k: usize) -> Res<Option<(String, f64)>> {
        if self.blas.is_none() {
            return Ok(None);
        }
        let n = bytes.div_ceil(2 * k);
        let (copies, batch) = rotation(2 * n * k, self.l2);
        let mut ws: Vec<DeviceTensor<bf16>> = Vec::new();
        let host = self.bits.bf16s(n * k);
        for _ in 0..copies {
            ws.push(self.dev.upload(DType::BF16, &[n, k], &host)?);
        }
        let x = self.dev.upload(DType::BF16, &[1, k], &self.bits.bf16s(k))?;
        let mut y: DeviceTensor<bf16> = self.dev.alloc(DType::BF16, &[1, n])?;
        let blas = self.blas.as_ref().expect("checked above");
        // Row-major W [n, k] is column-major [k, n]: y (n x 1) = Wᵀᵀ · x, i.e. op(A) = Aᵀ.
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: 1,
            k: k as i32,
            alpha: bf16::ONE,
            lda: k as i32,
            ldb: k as i32,
            beta: bf16::ZERO,
            ldc: n as i32,
        };
        let timer = Timer::capture(&self.dev, batch, |i| {
            let mut yv = y.view_mut();
            // SAFETY: W holds n * k, x k and y n elements, as the config says.
            unsafe { blas.gemm(cfg, ws[i % copies].slice(), x.slice(), &mut yv) }?;
            Ok(())
        });
        let timer = match timer {
            Ok(t) => t,
            Err(e) => {
                println!("cuBLAS graph capture failed ({e}); cuBLAS column left empty");
                return Ok(None);
            }
        };
        let secs = median(self.timer_samples(&timer, 15)?);
        Ok(Some((format!("[{n}, {k}]"), secs)))
    }

    fn gemv_case(
        &mut self,
        model: &'static str,
        name: &str,
        fmt: Fmt,
        n: usize,
        k: usize,
        swiglu: bool,
    ) -> Res<()> {
        if self.skip(model, name) {
            return Ok(());
        }
        let mats = if swiglu { 2 } else { 1 };
        let owned: Vec<Owned> = (0..mats)
            .map(|_| Owned::random(&mut self.bits, fmt, n, k))
            .collect();
        let upload = |dev: &Device| {
            if swiglu {
                GemvWeight::upload_gate_up(dev, owned[0].host(), owned[1].host(), n, k)
            } else {
                GemvWeight::upload(dev, owned[0].host(), n, k)
            }
        };
        let probe = upload(&self.dev)?;
        let wbytes = probe.bytes();
        let out_n = n;
        let bytes = wbytes + 2 * k + 2 * out_n;
        let (copies, batch) = rotation(wbytes, self.l2);
        let mut weights = vec![probe];
        for _ in 1..copies {
            weights.push(upload(&self.dev)?);
        }
        let x = self.dev.upload(DType::BF16, &[1, k], &self.bits.bf16s(k))?;
        let y = std::cell::RefCell::new(self.dev.alloc::<bf16>(DType::BF16, &[1, out_n])?);
        let ws = std::cell::RefCell::new(GemvWorkspace::alloc(&self.dev)?);
        let dev = &self.dev;
        let enqueue = |i: usize| -> Res<()> {
            let w = &weights[i % copies];
            let (mut y, mut ws) = (y.borrow_mut(), ws.borrow_mut());
            if swiglu {
                gemv::gemv_swiglu(dev, &x, w, 10.0, &mut y, &mut ws)?;
            } else {
                gemv::gemv(dev, &x, w, &mut y, &mut ws)?;
            }
            Ok(())
        };
        let timer = Timer::capture(dev, batch, enqueue)?;
        let shape = if swiglu {
            format!("2 x [{n}, {k}]")
        } else {
            format!("[{n}, {k}]")
        };
        let id = format!("{model}/{name} {shape} {}", fmt.label());
        let seconds = Self::record(dev, &mut self.criterion, &id, &timer)?;
        drop(timer);
        let seconds_no_pdl = self.quick_without_pdl(batch, enqueue)?;
        if SWEEP_CASES.iter().any(|c| id.starts_with(c)) {
            for wps in SWEEP_WARPS {
                tuning::set_warps_per_sm(wps);
                let t = self.quick(batch, enqueue);
                tuning::set_warps_per_sm(0);
                self.sweep.push((id.clone(), wps, t?));
            }
        }
        drop(weights);
        let cublas = self.cublas_same_bytes(wbytes, k)?;
        self.rows.push(Row {
            seconds_no_pdl: Some(seconds_no_pdl),
            cublas,
            ..Row::new(model, name, shape, fmt, bytes, seconds, copies)
        });
        Ok(())
    }

    /// The routed experts of one layer (Flash: 256 x NVFP4 [2048, 4096] w1/w3 and [4096, 2048]
    /// w2; Pro: 384 x [3072, 7168] and [7168, 3072]) for `rows` tokens, each choosing `topk`
    /// experts at random for every launch (a batched decode step of that many sequences).
    fn moe_case(
        &mut self,
        model: &'static str,
        experts: usize,
        d: usize,
        inter: usize,
        topk: usize,
        rows: usize,
    ) -> Res<()> {
        let mut name = format!("grouped MoE, {topk} of {experts} experts");
        if rows > 1 {
            name += &format!(", {rows} tokens");
        }
        if self.skip(model, &name) {
            return Ok(());
        }
        let upload_random = |dev: &Device,
                             bits: &mut Bits,
                             shape: &[usize],
                             lo: u8,
                             hi: u8|
         -> Res<DeviceTensor<u8>> {
            let mut t: DeviceTensor<u8> = dev.alloc(DType::U8, shape)?;
            let total = t.len();
            let chunk = 32 << 20;
            let host = if lo == 0 && hi == 255 {
                bits.bytes(chunk.min(total))
            } else {
                bits.in_range(chunk.min(total), lo, hi)
            };
            let mut off = 0;
            while off < total {
                let len = chunk.min(total - off);
                let mut view = t.view_mut();
                let mut part = view.slice_mut(off..off + len);
                dev.stream().memcpy_htod(&host[..len], &mut part)?;
                off += len;
            }
            Ok(t)
        };
        let dev = &self.dev;
        let b = &mut self.bits;
        // Random codes and valid scales, already in the packed layout.
        let (up, down) = moe::layouts(d, inter);
        let w13 = upload_random(dev, b, &[experts, up.slots() * 16], 0, 255)?;
        let s13 = upload_random(dev, b, &[experts, up.slots() * 2], 0x20, 0x58)?;
        let w2 = upload_random(dev, b, &[experts, down.slots() * 16], 0, 255)?;
        let s2 = upload_random(dev, b, &[experts, down.slots() * 2], 0x20, 0x58)?;
        let g = vec![1.0f32 / 2688.0; experts];
        let globals = [
            dev.upload(DType::F32, &[experts], &g)?,
            dev.upload(DType::F32, &[experts], &g)?,
            dev.upload(DType::F32, &[experts], &g)?,
        ];
        let ex =
            MoeExperts::from_parts(MoeFormat::Nvfp4, d, inter, w13, s13, w2, s2, Some(globals))?;
        let batch = 32;
        let mut routes = Vec::new();
        // Distinct experts over all launches: the bytes a launch must read on average.
        let mut distinct = 0;
        for _ in 0..batch {
            let mut ids: Vec<i32> = Vec::new();
            for _ in 0..rows {
                let mut row: Vec<i32> = Vec::new();
                while row.len() < topk {
                    let e = (self.bits.next() % experts as u64) as i32;
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                ids.extend(row);
            }
            let mut seen = ids.clone();
            seen.sort_unstable();
            seen.dedup();
            distinct += seen.len();
            let w: Vec<f32> = (0..rows * topk)
                .map(|i| 0.1 + 0.05 * (i % topk) as f32)
                .collect();
            routes.push((
                self.dev.upload(DType::I32, &[rows, topk], &ids)?,
                self.dev.upload(DType::F32, &[rows, topk], &w)?,
            ));
        }
        let x = self
            .dev
            .upload(DType::BF16, &[rows, d], &self.bits.bf16s(rows * d))?;
        let h = std::cell::RefCell::new(self.dev.alloc::<bf16>(DType::BF16, &[rows, topk, inter])?);
        let out = std::cell::RefCell::new(self.dev.alloc::<bf16>(DType::BF16, &[rows, d])?);
        let dev = &self.dev;
        let enqueue = |i: usize| -> Res<()> {
            let (ids, w) = &routes[i];
            let (mut h, mut out) = (h.borrow_mut(), out.borrow_mut());
            moe::moe_decode(
                dev,
                &x,
                ids,
                w,
                &ex,
                10.0,
                &mut h,
                MoeOut::Bf16(&mut out),
                || Ok(()),
            )?;
            Ok(())
        };
        let timer = Timer::capture(dev, batch, enqueue)?;
        // The distinct experts' weights and scales (mean over the routings), x, h written and
        // read, the output.
        let bytes = distinct * ex.expert_bytes() / batch + rows * (4 * d + 4 * topk * inter);
        if rows > 1 {
            name += &format!(" ({:.1} experts)", distinct as f64 / batch as f64);
        }
        let shape = format!("{topk} x (2 x [{inter}, {d}] + [{d}, {inter}])");
        let id = format!("{model}/{name}");
        let seconds = Self::record(dev, &mut self.criterion, &id, &timer)?;
        drop(timer);
        let seconds_no_pdl = self.quick_without_pdl(batch, enqueue)?;
        self.rows.push(Row {
            seconds_no_pdl: Some(seconds_no_pdl),
            ..Row::new(model, &name, shape, Fmt::Nvfp4, bytes, seconds, batch)
        });
        Ok(())
    }

    /// A format kernel, launched on copies of its buffers from `random`, rotated like weights of
    /// the same size. These kernels launch without PDL, so there is no second timing.
    fn format_case<L: FormatLaunch>(
        &mut self,
        model: &'static str,
        name: &str,
        fmt: Fmt,
        mut random: impl FnMut(&Device, &mut Bits) -> Res<L>,
    ) -> Res<()> {
        if self.skip(model, name) {
            return Ok(());
        }
        let probe = random(&self.dev, &mut self.bits)?;
        let bytes = probe.bytes();
        let shape = format!("{:?}", probe.shape());
        let (copies, batch) = rotation(bytes, self.l2);
        let mut bufs = vec![probe];
        for _ in 1..copies {
            bufs.push(random(&self.dev, &mut self.bits)?);
        }
        let dev = &self.dev;
        let timer = Timer::capture(dev, batch, |i| bufs[i % copies].launch(dev))?;
        let id = format!("{model}/{name} {shape} {}", fmt.label());
        let seconds = Self::record(dev, &mut self.criterion, &id, &timer)?;
        self.rows
            .push(Row::new(model, name, shape, fmt, bytes, seconds, copies));
        Ok(())
    }

    fn table(&self, name: &str) -> String {
        let bw = self.copy_bps;
        let mut s = String::new();
        s.push_str(&format!(
            "GPU: {name}; copy bandwidth {:.0} GB/s (1 GiB D2D memcpy, read + write bytes); L2 {} MB\n\n",
            bw / 1e9,
            self.l2 >> 20
        ));
        s.push_str("| model | kernel | shape | format | MB moved | copies | µs | GB/s | % of copy BW | µs without PDL | % without PDL | cuBLAS BF16 same bytes | cuBLAS µs | cuBLAS GB/s | ours / cuBLAS time |\n");
        s.push_str("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|\n");
        for r in &self.rows {
            let gbps = r.bytes as f64 / r.seconds;
            let (nu, np) = match r.seconds_no_pdl {
                Some(secs) => (
                    format!("{:.1}", secs * 1e6),
                    format!("{:.0}%", 100.0 * r.bytes as f64 / secs / bw),
                ),
                None => ("-".into(), "-".into()),
            };
            let (cs, cu, cg, ratio) = match &r.cublas {
                Some((shape, secs)) => (
                    shape.clone(),
                    format!("{:.1}", secs * 1e6),
                    format!("{:.0}", r.bytes as f64 / secs / 1e9),
                    format!("{:.2}", r.seconds / secs),
                ),
                None => ("-".into(), "-".into(), "-".into(), "-".into()),
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {:.1} | {} | {:.1} | {:.0} | {:.0}% | {} | {} | {} | {} | {} | {} |\n",
                r.model,
                r.name,
                r.shape,
                r.format,
                r.bytes as f64 / 1e6,
                r.copies,
                r.seconds * 1e6,
                gbps / 1e9,
                100.0 * gbps / bw,
                nu,
                np,
                cs,
                cu,
                cg,
                ratio
            ));
        }
        if !self.sweep.is_empty() {
            s.push_str(
                "\nGrid size sweep (GEMV warps per SM; the default is a full wave: 32 warps for the BF16 m8 kernels, 16 for FP8 and FP4), with PDL:\n\n| case | warps/SM | µs |\n|---|---:|---:|\n",
            );
            for (case, wps, secs) in &self.sweep {
                s.push_str(&format!("| {case} | {wps} | {:.1} |\n", secs * 1e6));
            }
        }
        s
    }
}

fn main() -> Res<()> {
    if Device::count()? == 0 {
        println!("decode_kernels: no CUDA device on this machine; nothing measured");
        return Ok(());
    }
    let criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(50))
        .measurement_time(Duration::from_millis(200))
        .configure_from_args();
    let dev = Device::new(0)?;
    let l2 = dev
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize;
    let copy = measure_copy_bandwidth(&dev, 1 << 30, 10)?;
    let name = dev.name().to_string();
    println!(
        "{name}: copy bandwidth {:.0} GB/s, L2 {} MB",
        copy.bytes_per_second / 1e9,
        l2 >> 20
    );
    // cuBLAS is loaded dynamically; without it the comparison column stays empty.
    // SAFETY: only probes for the library.
    let blas = if unsafe { cudarc::cublas::sys::is_culib_present() } {
        Some(CudaBlas::new(dev.stream().clone())?)
    } else {
        println!("libcublas not found: no cuBLAS comparison");
        None
    };
    let mut b = Bench {
        dev,
        blas,
        l2,
        copy_bps: copy.bytes_per_second,
        bits: Bits(0x5eed),
        rows: Vec::new(),
        sweep: Vec::new(),
        criterion,
        only: std::env::var("DSV4_BENCH_ONLY").ok(),
    };
    for (var, switch) in [
        ("DSV4_BENCH_STAGING", &tuning::STAGING),
        ("DSV4_BENCH_CLUSTER_SUM", &tuning::CLUSTER_SUM),
        ("DSV4_BENCH_WHOLE_TILE", &tuning::WHOLE_TILE_BLOCKS),
        ("DSV4_BENCH_PRESCALED", &tuning::PRESCALED),
    ] {
        if std::env::var(var).is_ok_and(|v| v == "off") {
            switch.set(false);
        }
    }

    for (model, d, q_rank, heads, groups, inter, idx_heads) in [
        ("Flash", 4096, 1024, 64, 8, 2048, 64),
        ("Pro", 7168, 1536, 128, 16, 3072, 64),
    ] {
        let hd = 512;
        b.gemv_case(model, "attn wq_a", Fmt::Fp8, q_rank, d, false)?;
        b.gemv_case(model, "attn wq_b", Fmt::Fp8, heads * hd, q_rank, false)?;
        b.gemv_case(model, "attn wkv", Fmt::Fp8, hd, d, false)?;
        b.gemv_case(
            model,
            "attn wo_a (one of the groups)",
            Fmt::Fp8,
            1024,
            heads * hd / groups,
            false,
        )?;
        b.gemv_case(model, "attn wo_b", Fmt::Fp8, d, groups * 1024, false)?;
        b.gemv_case(
            model,
            "indexer wq_b",
            Fmt::Fp8,
            idx_heads * 128,
            q_rank,
            false,
        )?;
        for fmt in [Fmt::Nvfp4, Fmt::Mxfp4] {
            b.gemv_case(model, "expert w1+w3 (fused SwiGLU)", fmt, inter, d, true)?;
            b.gemv_case(model, "expert w2", fmt, d, inter, false)?;
        }
        b.gemv_case(
            model,
            "shared expert w1+w3 (fused SwiGLU)",
            Fmt::Fp8,
            inter,
            d,
            true,
        )?;
        b.gemv_case(model, "shared expert w2", Fmt::Fp8, d, inter, false)?;
        b.gemv_case(model, "lm_head", Fmt::Bf16, 129280, d, false)?;
        for rows in [1, 4, 8, 16] {
            b.moe_case(
                model,
                if model == "Flash" { 256 } else { 384 },
                d,
                inter,
                6,
                rows,
            )?;
        }
        // Tensor parallelism at one token, per GPU: every expert's intermediate split over n
        // GPUs (each reads its slice of the six experts), against experts spread over them
        // (the busiest GPU runs m whole experts of its 256/n; m depends on the routing).
        if model == "Flash" {
            for n in [2, 4] {
                b.moe_case(model, 256, d, inter / n, 6, 1)?;
                for m in 6usize.div_ceil(n)..=6 {
                    b.moe_case(model, 256 / n, d, inter, m, 1)?;
                }
            }
        }
        // NVFP4 activations of a decode step and of a small batch, as wide as the hidden state
        // (the expert w1/w3 input) and the expert intermediate (the w2 input).
        for rows in [1, 16] {
            for cols in [d, inter] {
                b.format_case(model, "activation quantize", Fmt::Nvfp4, |dev, bits| {
                    ActQuantize::random(dev, bits, rows, cols)
                })?;
            }
        }
        // The per-token kernels of the step (RoPE on the 64 rotary channels of each head's
        // query; the route over the layer's experts; sampling over the vocabulary).
        let experts = if model == "Flash" { 256 } else { 384 };
        for which in ["hc_pre", "hc_post_mix", "rope", "route", "sample"] {
            b.format_case(model, &format!("step {which}"), Fmt::F32, |dev, bits| {
                StepOp::random(dev, bits, which, d, heads, experts)
            })?;
        }
        // Dequantize runs at load time, once per matrix: one Flash expert per format will do.
        if model == "Flash" {
            for fmt in [Fmt::Nvfp4, Fmt::Mxfp4, Fmt::Fp8] {
                b.format_case(model, "weight dequantize", fmt, |dev, bits| {
                    WeightDequant::random(dev, bits, fmt, inter, d)
                })?;
            }
        }
    }
    b.criterion.final_summary();
    let table = b.table(&name);
    println!("\n{table}");
    if let Ok(path) = std::env::var("DSV4_BENCH_TABLE") {
        std::fs::write(&path, &table)?;
    }
    Ok(())
}
