//! Tests of the attention kernels and their CPU references (the model's CPU forward runs the
//! references, so they are checked here against hand-computed cases and the oracle fixtures
//! check them end to end).
//!
//! CPU tests: hand-checked attention, pooling (one window; the CSA overlap of the previous
//! A-half with the current B-half), indexer and window cases; a layer's reference chain gives
//! the same outputs and entries bit for bit whatever the chunking (token by token, random
//! chunks, one chunk); the capacity clips entries but not the state.
//!
//! GPU tests (`#[ignore]`d: `cargo xtask gpu-test`), launcher against reference on fresh random
//! inputs and shapes, state carried over consecutive chunks:
//! - compressor state rows and prev halves bit-exact (copies and one addition); entries (f16)
//!   within 1e-5 of the entries' largest magnitude and one f16 step of the CPU's value (expf,
//!   the norm's block sum and sincospi differ by ulps from the CPU);
//! - indexer scores of the visible entries bit-exact given the same f16 keys (the kernel keeps
//!   the CPU's operation order), so `selected` is exactly equal, ties included;
//! - attention outputs within 1e-5 of the output's largest magnitude (online softmax in another
//!   order);
//! - the window ring bit-exact.

use half::f16;
use rand::rngs::StdRng;
use rand::Rng;

use super::reference::{self as cpu, CompressorHost, HostCompressed};
use super::*;
use crate::gpu::rows::reference::{rms_norm, rope_rotate, rope_rows};
use crate::gpu::rows::RopeDirection;

fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

fn inv_freq(half: usize) -> Vec<f32> {
    (0..half)
        .map(|i| 10000f32.powf(-(2.0 * i as f32) / (2 * half) as f32))
        .collect()
}

/// Chunk lengths in 1..=16 covering `total` tokens.
fn chunks(rng: &mut StdRng, total: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = total;
    while left > 0 {
        let t = rng.random_range(1..=16usize).min(left);
        out.push(t);
        left -= t;
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Sliding,
    Hca,
    Csa,
}

/// A compressor's weights: `ape [ratio, κ·c]`, `norm [c]`.
struct CompressorParams {
    ratio: usize,
    c: usize,
    overlap: bool,
    ape: Vec<f32>,
    norm: Vec<f32>,
}

impl CompressorParams {
    fn random(rng: &mut StdRng, ratio: usize, c: usize, overlap: bool) -> CompressorParams {
        let kc = if overlap { 2 * c } else { c };
        CompressorParams {
            ratio,
            c,
            overlap,
            ape: uniform(rng, ratio * kc, -1.0, 1.0),
            norm: uniform(rng, c, 0.5, 1.5),
        }
    }

    fn kc(&self) -> usize {
        if self.overlap {
            2 * self.c
        } else {
            self.c
        }
    }

    /// Tokens `range` of `kv`, `gate` `[T, κ·c]` through [`cpu::compressor_update`].
    fn update(
        &self,
        kv: &[f32],
        gate: &[f32],
        range: std::ops::Range<usize>,
        st: &mut CompressorHost,
    ) {
        let (kc, eps) = (self.kc(), 1e-6);
        let rows = range.start * kc..range.end * kc;
        let (f, ov) = (inv_freq(4), self.overlap);
        let (kv, gate) = (&kv[rows.clone()], &gate[rows]);
        cpu::compressor_update(
            kv,
            gate,
            &self.ape,
            &self.norm,
            &f,
            eps,
            ov,
            range.start,
            st,
        );
    }
}

/// One layer's inputs over `total` tokens: queries `[T, H·d]`, keys `[T, d]`, the compressor's
/// and the indexer's projections (`[T, κ·c]`), indexer queries `[T, nh·ic]` and head weights.
struct Layer {
    kind: Kind,
    total: usize,
    q: Vec<f32>,
    kv: Vec<f32>,
    sink: Vec<f32>,
    comp: CompressorParams,
    ckv: Vec<f32>,
    cgate: Vec<f32>,
    icomp: CompressorParams,
    iq: Vec<f32>,
    iw: Vec<f32>,
    ikv: Vec<f32>,
    igate: Vec<f32>,
}

/// The layer's heads, head width, window, indexer heads, indexer head width and top-k.
const SIZES: (usize, usize, usize, usize, usize, usize) = (4, 32, 16, 4, 16, 8);

impl Layer {
    fn random(rng: &mut StdRng, kind: Kind) -> Layer {
        let (h, d, _, nh, ic, _) = SIZES;
        let ratio = match kind {
            Kind::Hca => rng.random_range(2..9),
            _ => 4,
        };
        let total = rng.random_range(1..120);
        let comp = CompressorParams::random(rng, ratio, d, kind == Kind::Csa);
        let icomp = CompressorParams::random(rng, 4, ic, true);
        let (kc, ikc) = (comp.kc(), icomp.kc());
        Layer {
            kind,
            total,
            q: uniform(rng, total * h * d, -2.0, 2.0),
            kv: uniform(rng, total * d, -1.0, 1.0),
            sink: uniform(rng, h, -1.0, 1.0),
            ckv: uniform(rng, total * kc, -1.0, 1.0),
            cgate: uniform(rng, total * kc, -2.0, 2.0),
            iq: uniform(rng, total * nh * ic, -1.0, 1.0),
            iw: uniform(rng, total * nh, -1.0, 1.0),
            ikv: uniform(rng, total * ikc, -1.0, 1.0),
            igate: uniform(rng, total * ikc, -2.0, 2.0),
            comp,
            icomp,
        }
    }

    /// The reference chain fed in chunks of `lens`, as the model runs it: the compressors, the
    /// indexer's top-k, the attention over the ring and the chunk, the ring write. Returns the
    /// outputs and both compressors' entries.
    fn run(&self, lens: &[usize]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (h, d, w, nh, ic, k) = SIZES;
        let (hd, ratio) = (h * d, self.comp.ratio);
        let mut st = CompressorHost::new(ratio, d, self.comp.overlap, self.total / ratio + 2);
        let mut ist = CompressorHost::new(4, ic, true, self.total / 4 + 2);
        let mut ring = vec![f32::NAN; w * d]; // never read before it is written
        let mut out = Vec::with_capacity(self.total * hd);
        let mut pos0 = 0;
        for &t in lens {
            let r = pos0..pos0 + t;
            let selected;
            let compressed = match self.kind {
                Kind::Sliding => HostCompressed::None,
                Kind::Hca => {
                    self.comp.update(&self.ckv, &self.cgate, r.clone(), &mut st);
                    HostCompressed::All {
                        entries: &st.entries,
                        ratio,
                    }
                }
                Kind::Csa => {
                    self.comp.update(&self.ckv, &self.cgate, r.clone(), &mut st);
                    self.icomp
                        .update(&self.ikv, &self.igate, r.clone(), &mut ist);
                    let (iq, iw) = (
                        &self.iq[r.start * nh * ic..r.end * nh * ic],
                        &self.iw[r.start * nh..r.end * nh],
                    );
                    selected = cpu::index_topk(iq, iw, &ist.entries, nh, ic, 4, pos0, k);
                    HostCompressed::Selected {
                        entries: &st.entries,
                        selected: &selected,
                        k,
                    }
                }
            };
            let kv = &self.kv[r.start * d..r.end * d];
            let q = &self.q[r.start * hd..r.end * hd];
            out.extend(cpu::attention(
                q, kv, &ring, d, compressed, &self.sink, pos0,
            ));
            cpu::window_write(kv, d, pos0, &mut ring);
            pos0 += t;
        }
        (out, st.entries, ist.entries)
    }
}

#[test]
fn attention_references_do_not_depend_on_the_chunking() {
    let mut rng = crate::gpu::testing::rng("attention_references_do_not_depend_on_the_chunking");
    for _ in 0..6 {
        for kind in [Kind::Sliding, Kind::Hca, Kind::Csa] {
            let layer = Layer::random(&mut rng, kind);
            let want = layer.run(&vec![1; layer.total]);
            let what = format!(
                "{kind:?} ratio {}, {} tokens",
                layer.comp.ratio, layer.total
            );
            assert!(want.0.iter().all(|v| v.is_finite()), "{what}");
            assert_eq!(layer.run(&chunks(&mut rng, layer.total)), want, "{what}");
            assert_eq!(layer.run(&[layer.total]), want, "{what}");
            // Entries past the closed windows stay as the pool left them.
            let n = layer.total / layer.comp.ratio * SIZES.1;
            assert!(want.1[n..].iter().all(|&v| v == 0.0), "{what}");
        }
    }
}

#[test]
fn rust_sums_start_from_negative_zero() {
    // The kernels start their sums at -0.0, as f32's Sum does, so an all-(-0.0) indexer score
    // keeps its sign and ranks as the CPU ranks it (total_cmp puts -0.0 below +0.0).
    let s: f32 = [-0.0f32, -0.0].iter().sum();
    assert!(s.is_sign_negative());
    assert!(0.0f32.max(-1.0).is_sign_positive());
}

#[test]
fn hand_checked_cases() {
    // One key with score 0 and a sink of logit 0: weight 1/2. Keys [1, 0] and [0, 2] against
    // q = [0, 0]: equal weights e^0 / (2 + e^0) = 1/3 each.
    let (k1, k2) = ([1.0f32, 0.0], [0.0f32, 2.0]);
    let mut o = [0.0f32; 2];
    cpu::attend(&[0.0, 0.0], &[&k1], &[0.0], &mut o);
    assert!((o[0] - 0.5).abs() < 1e-7 && o[1] == 0.0);
    cpu::attend(&[0.0, 0.0], &[&k1, &k2], &[0.0], &mut o);
    assert!((o[0] - 1.0 / 3.0).abs() < 1e-7 && (o[1] - 2.0 / 3.0).abs() < 1e-7);

    // Pooling: ratio 2, c 2, no overlap, unit norm weight, no rope. Channel 0 has logits
    // (0, ln 3) → weights (1/4, 3/4) on values (4, 8) → 7; channel 1 equal logits on (1, 3) → 2.
    // RMS of (7, 2) = sqrt(26.5).
    let kv = [4.0f32, 1.0, 8.0, 3.0];
    let gate = [0.0f32, 5.0, 3f32.ln(), 5.0];
    let e = cpu::pool_entry(None, &kv, &gate, 2, 0, 2, &[1.0, 1.0], 0.0, &[], 0);
    let r = 26.5f32.sqrt();
    assert!(
        (e[0] - 7.0 / r).abs() < 1e-5 && (e[1] - 2.0 / r).abs() < 1e-5,
        "{e:?}"
    );

    // Indexer: one head (weight 1 → scale 1), c = 1: score of entry w = max(q·K_w, 0).
    // Entries 3, -1, 3, 5 with q = 1: top-2 = {3 (id 3), 3 (id 0, the lower of the tie)}.
    let entries = [3.0f32, -1.0, 3.0, 5.0];
    let sel = cpu::index_topk(&[1.0], &[1.0], &entries, 1, 1, 1, 3, 2);
    assert_eq!(sel, vec![0, 3]);
    // Position 1 with ratio 1 sees 2 entries: fewer than k = 3, then -1.
    let sel = cpu::index_topk(&[1.0], &[1.0], &entries, 1, 1, 1, 1, 3);
    assert_eq!(sel, vec![0, 1, -1]);
    // Position 0 with ratio 4 sees none.
    let sel = cpu::index_topk(&[1.0], &[1.0], &entries, 1, 1, 4, 0, 2);
    assert_eq!(sel, vec![-1, -1]);

    // Window: W = 3; a chunk of 2 at position 3. Token 0 (p 3) sees positions 1, 2 from the
    // ring and 3 from kv; token 1 (p 4) sees 2 from the ring, 3 and 4 from kv. Slot 0 (position
    // 0, about to be overwritten by 3) is never read.
    let ring = [30.0f32, 40.0, 20.0];
    let out = cpu::attention(
        &[0.0, 0.0],
        &[3.0, 4.0],
        &ring,
        1,
        HostCompressed::None,
        &[-1e4],
        3,
    );
    assert!((out[0] - (40.0 + 20.0 + 3.0) / 3.0).abs() < 1e-5, "{out:?}");
    assert!((out[1] - (20.0 + 3.0 + 4.0) / 3.0).abs() < 1e-5, "{out:?}");
}

#[test]
fn compressor_capacity_clips_entries_but_keeps_the_state() {
    let mut rng = crate::gpu::testing::rng("compressor_capacity_clips_entries_but_keeps_the_state");
    let (ratio, c) = (2, 4);
    let ape = uniform(&mut rng, ratio * 2 * c, -1.0, 1.0);
    let norm = vec![1.0; c];
    let kv = uniform(&mut rng, 10 * 2 * c, -1.0, 1.0);
    let gate = uniform(&mut rng, 10 * 2 * c, -1.0, 1.0);
    let mut full = CompressorHost::new(ratio, c, true, 5);
    let mut clipped = CompressorHost::new(ratio, c, true, 3);
    let f = inv_freq(1);
    cpu::compressor_update(&kv, &gate, &ape, &norm, &f, 1e-6, true, 0, &mut full);
    cpu::compressor_update(&kv, &gate, &ape, &norm, &f, 1e-6, true, 0, &mut clipped);
    assert_eq!(&full.entries[..3 * c], &clipped.entries[..]);
    assert_eq!(
        (&full.kv, &full.prev_kv, &full.prev_gate),
        (&clipped.kv, &clipped.prev_kv, &clipped.prev_gate)
    );
}

/// Softmax of `logits` weighting `values`, in f64.
fn pool(logits: &[f32], values: &[f32]) -> f32 {
    let w: Vec<f64> = logits.iter().map(|&z| (z as f64).exp()).collect();
    let s: f64 = w.iter().sum();
    (w.iter()
        .zip(values)
        .map(|(w, &v)| w * v as f64)
        .sum::<f64>()
        / s) as f32
}

/// Deterministic per-token projections: `(kv, gate)` rows of width `row`.
fn token(pos: usize, row: usize) -> (Vec<f32>, Vec<f32>) {
    let kv = (0..row)
        .map(|j| ((pos * 7 + j * 3) % 11) as f32 - 5.0)
        .collect();
    let gate = (0..row).map(|j| ((pos * 5 + j) % 7) as f32 * 0.3).collect();
    (kv, gate)
}

/// Pools `(logit, value)` columns per channel, then the unit-weight RMSNorm and the forward
/// RoPE (one pair) at `first_pos`; `columns(j)` lists channel j's pairs.
fn hand_entry(c: usize, first_pos: usize, columns: impl Fn(usize) -> Vec<(f32, f32)>) -> Vec<f32> {
    let mut want: Vec<f32> = (0..c)
        .map(|j| {
            let (logits, values): (Vec<f32>, Vec<f32>) = columns(j).into_iter().unzip();
            pool(&logits, &values)
        })
        .collect();
    rms_norm(&mut want, None, 1e-6);
    rope_rotate(&mut want, &inv_freq(1), first_pos, RopeDirection::Forward);
    want
}

fn assert_near(what: &str, got: &[f32], want: &[f32]) {
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-5, "{what}: {got:?} vs {want:?}");
    }
}

/// A compressor of ratio `m` and width `c` (unit norm, one rope pair, ape `(i mod 5) / 10`) fed
/// `token(p, κ·c)` for p in 0..n one at a time, `after(p, entries)` after each. Returns its
/// state and `col(p, ch)`: channel ch of token p as (gate + ape, kv).
fn feed(
    m: usize,
    c: usize,
    overlap: bool,
    n: usize,
    mut after: impl FnMut(usize, &[f32]),
) -> (CompressorHost, impl Fn(usize, usize) -> (f32, f32)) {
    let kc = if overlap { 2 * c } else { c };
    let ape: Vec<f32> = (0..m * kc).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut st = CompressorHost::new(m, c, overlap, n / m);
    for p in 0..n {
        let (kv, gate) = token(p, kc);
        let (f, norm) = (inv_freq(1), vec![1.0; c]);
        cpu::compressor_update(&kv, &gate, &ape, &norm, &f, 1e-6, overlap, p, &mut st);
        after(p, &st.entries);
    }
    let col = move |p: usize, ch: usize| {
        let (kv, gate) = token(p, kc);
        (gate[ch] + ape[(p % m) * kc + ch], kv[ch])
    };
    (st, col)
}

#[test]
fn hca_pools_each_window_once_when_it_closes() {
    let (m, c) = (3, 2);
    let (st, col) = feed(m, c, false, 7, |p, entries| {
        let written = entries
            .chunks_exact(c)
            .filter(|e| e.iter().any(|&v| v != 0.0));
        assert_eq!(written.count(), (p + 1) / m, "entries after token {p}");
    });
    // Entry 1 pools tokens 3..6 (rope at position 3 rotates the only pair).
    let want = hand_entry(c, 3, |j| (3..6).map(|p| col(p, j)).collect());
    assert_near("entry 1", &st.entries[c..2 * c], &want);
}

#[test]
fn csa_entry_pools_previous_a_half_and_current_b_half() {
    let (m, c) = (2, 2);
    let (st, col) = feed(m, c, true, 4, |_, _| {});
    // Entry 0: only window 0's B-half (no previous window).
    let want = hand_entry(c, 0, |j| (0..m).map(|p| col(p, c + j)).collect());
    assert_near("entry 0", &st.entries[..c], &want);
    // Entry 1: window 0's A-half, then window 1's B-half.
    let want = hand_entry(c, m, |j| {
        (0..m)
            .map(|p| col(p, j))
            .chain((m..2 * m).map(|p| col(p, c + j)))
            .collect()
    });
    assert_near("entry 1", &st.entries[c..2 * c], &want);
}

#[test]
fn attention_splits_fill_one_wave_within_the_keys() {
    // Flash decode: 16 head groups on 132 SMs, a CSA token's 128 + 512 keys.
    assert_eq!(choose_splits(132, 16, 640), 8);
    // An HCA token early in the context: 128 + 8 keys, 8 splits of 17; a short window alone.
    assert_eq!(choose_splits(132, 16, 136), 8);
    assert_eq!(choose_splits(132, 16, 40), 2);
    // A prefill chunk already fills the GPU; few keys.
    assert_eq!(choose_splits(132, 256, 640), 1);
    assert_eq!(choose_splits(132, 1, 20), 1);
    // Never past a cluster's 16 blocks.
    assert_eq!(choose_splits(1000, 1, 1 << 20), ATT_MAX_SPLITS);
}

// ---- GPU ----

mod gpu {
    use super::*;
    use crate::gpu::gemv::tuning::{attention_mma_keys, set_attention_mma_keys};
    use crate::gpu::testing::{assert_bits_eq, device, rng, sanitizer_length, POISON};

    fn poisoned<T: crate::gpu::DeviceElem>(
        dev: &Device,
        dtype: DType,
        shape: &[usize],
    ) -> DeviceTensor<T> {
        let mut t = dev.alloc(dtype, shape).unwrap();
        dev.fill_bytes(&mut t, POISON).unwrap();
        t
    }

    /// A compressor's zeroed state: `ratio` rows of its κ·c-wide projections (κ = 2 with
    /// overlap) and room for `cap` entries of `c`.
    fn comp_buffers(
        dev: &Device,
        ratio: usize,
        c: usize,
        overlap: bool,
        cap: usize,
    ) -> CompressorBuffers {
        let kc = if overlap { 2 * c } else { c };
        CompressorBuffers {
            kv: dev.alloc(DType::F32, &[ratio, kc]).unwrap(),
            gate: dev.alloc(DType::F32, &[ratio, kc]).unwrap(),
            prev_kv: dev.alloc(DType::F32, &[ratio, c]).unwrap(),
            prev_gate: dev.alloc(DType::F32, &[ratio, c]).unwrap(),
            entries: dev.alloc(DType::F16, &[cap, c]).unwrap(),
        }
    }

    /// F16 values as f32.
    fn widen(v: &[f16]) -> Vec<f32> {
        v.iter().map(|h| h.to_f32()).collect()
    }

    /// `got` (f16 entries) is `want` (the CPU's f32 entries) rounded: within `rel` of the
    /// largest |want| and one f16 step of each value (the rounding boundary may fall between
    /// the two computations).
    fn assert_f16_close(what: &str, got: &[f16], want: &[f32], rel: f32) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let top = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (g, &w)) in got.iter().zip(want).enumerate() {
            let r = f16::from_f32(w.abs());
            let step = f16::from_bits(r.to_bits() + 1).to_f32() - r.to_f32();
            let err = (g.to_f32() - w).abs();
            assert!(
                err <= rel * top + step,
                "{what}: entry value {i} is {g} against {w} (off by {err}, bound {})",
                rel * top + step
            );
        }
    }

    fn position(dev: &Device, p: usize) -> DeviceTensor<u32> {
        dev.upload(DType::U32, &[1], &[p as u32]).unwrap()
    }

    /// Uniform values in [lo, hi) rounded to f16, as the indexer's keys are stored.
    fn f16_uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        let v = uniform(rng, n, lo, hi);
        v.into_iter().map(|x| f16::from_f32(x).to_f32()).collect()
    }

    /// `v` (f16 values) uploaded as an F16 tensor of `shape`.
    fn upload_f16(dev: &Device, shape: &[usize], v: &[f32]) -> DeviceTensor<f16> {
        let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        assert!(
            h.iter().zip(v).all(|(h, x)| h.to_f32() == *x),
            "the test's keys must be f16 values"
        );
        dev.upload(DType::F16, shape, &h).unwrap()
    }

    /// [`index_topk`] over host `q [T, nh·c]`, raw `w [T, nh]` and `entries [cap, c]` (f16
    /// values, uploaded as F16; scores and selection poisoned first), with
    /// `[nh, c, ratio, pos0, k]` as [`cpu::index_topk`] takes them: the downloaded scores
    /// `[T, cap]` and selection `[T, k]`.
    fn device_index_topk(
        dev: &Device,
        (q, w, entries): (&[f32], &[f32], &[f32]),
        [nh, c, ratio, pos0, k]: [usize; 5],
        scoring: IndexScoring,
    ) -> (Vec<f32>, Vec<i32>) {
        let (t, cap) = (w.len() / nh, entries.len() / c);
        let qd = dev.upload(DType::F32, &[t, nh * c], q).unwrap();
        let wd = dev.upload(DType::F32, &[t, nh], w).unwrap();
        let ed = upload_f16(dev, &[cap, c], entries);
        let pos = position(dev, pos0);
        let mut scores = poisoned::<f32>(dev, DType::F32, &[t, cap]);
        let mut sel = poisoned::<i32>(dev, DType::I32, &[t, k]);
        index_topk(
            dev,
            &qd,
            &wd,
            &ed,
            ratio,
            &pos,
            scoring,
            &mut scores,
            &mut sel,
        )
        .unwrap();
        (dev.download(&scores).unwrap(), dev.download(&sel).unwrap())
    }

    /// Rows of `kv` and `gate` (each `width` wide) side by side, as the stacked compressor
    /// projection writes them.
    fn stacked(kv: &[f32], gate: &[f32], width: usize) -> Vec<f32> {
        kv.chunks(width)
            .zip(gate.chunks(width))
            .flat_map(|(k, g)| k.iter().chain(g).copied())
            .collect()
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_compressor_update_matches_reference() {
        let dev = device();
        let mut rng = rng("gpu_compressor_update_matches_reference");
        // (ratio, c, overlap, rope pairs, tokens fed): CSA main and indexer, HCA, small ratios.
        let configs = [
            (4, 512, true, 32, 70),
            (4, 128, true, 32, 90),
            (128, 512, false, 32, 300),
            (2, 32, true, 4, 60),
            (3, 16, false, 2, 50),
            (1, 8, true, 1, 40),
            (5, 24, false, 0, 45),
        ];
        for (ratio, c, overlap, half, total) in configs {
            let kc = if overlap { 2 * c } else { c };
            // Capacity clipping in every other config.
            let full = total / ratio;
            let cap = if rng.random_bool(0.5) {
                full + 1
            } else {
                (full / 2).max(1)
            };
            let ape = uniform(&mut rng, ratio * kc, -1.0, 1.0);
            let norm = uniform(&mut rng, c, 0.5, 1.5);
            let f = inv_freq(half);
            let eps = 1e-6;
            let ape_d = dev.upload(DType::F32, &[ratio, kc], &ape).unwrap();
            let norm_d = dev.upload(DType::F32, &[c], &norm).unwrap();
            let f_d = dev.upload(DType::F32, &[half], &f).unwrap();
            let mut st = comp_buffers(&dev, ratio, c, overlap, cap);
            st.entries = poisoned(&dev, DType::F16, &[cap, c]);
            let mut host = CompressorHost::new(ratio, c, overlap, cap);
            let mut pos0 = 0;
            for t in chunks(&mut rng, total) {
                let kv = uniform(&mut rng, t * kc, -1.0, 1.0);
                let gate = uniform(&mut rng, t * kc, -3.0, 3.0);
                let proj = dev
                    .upload(DType::F32, &[t, 2 * kc], &stacked(&kv, &gate, kc))
                    .unwrap();
                let pos = position(&dev, pos0);
                compressor_update(
                    &dev, &proj, &ape_d, &norm_d, &f_d, eps, overlap, &pos, &mut st,
                )
                .unwrap();
                cpu::compressor_update(&kv, &gate, &ape, &norm, &f, eps, overlap, pos0, &mut host);
                let what = format!("ratio {ratio} c {c} overlap {overlap} chunk {pos0}+{t}");
                let mut state = vec![("kv", &st.kv, &host.kv), ("gate", &st.gate, &host.gate)];
                if overlap {
                    state.push(("prev kv", &st.prev_kv, &host.prev_kv));
                    state.push(("prev gate", &st.prev_gate, &host.prev_gate));
                }
                for (name, got, want) in state {
                    let got = dev.download(got).unwrap();
                    assert_bits_eq(&format!("{what} {name}"), &got, want);
                }
                let entries = dev.download(&st.entries).unwrap();
                // Each entry is written once it exists (the f16 rounding of the CPU's), the rest
                // left as they were.
                let written = ((pos0 + t) / ratio).min(cap) * c;
                assert_f16_close(
                    &format!("{what} entries"),
                    &entries[..written],
                    &host.entries[..written],
                    1e-5,
                );
                let poison = u16::from_ne_bytes([POISON; 2]);
                assert!(
                    entries[written..].iter().all(|h| h.to_bits() == poison),
                    "{what}: entries written past the closed windows"
                );
                pos0 += t;
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_index_topk_matches_reference() {
        let dev = device();
        let mut rng = rng("gpu_index_topk_matches_reference");
        // (nh, c, k, capacity, ratio, largest first position)
        let configs = [
            (64, 128, 512, 3000, 4, 14_000),
            (64, 128, 512, 600, 4, 1_000),
            (4, 16, 8, 40, 4, 200),
            (8, 32, 8, 300, 1, 400),
            (2, 8, 512, 100_000, 1, 120_000),
            // Slices of a few thousand entries: a cluster of 5 when all are visible.
            (16, 32, 64, 20_000, 4, 90_000),
            // Past one block's shared memory: a cluster of up to 16 slices (sm_90), each held
            // in shared memory, then slices past it read from the scores.
            (1, 4, 64, 45_000, 1, 46_000),
            (1, 4, 512, 400_000, 1, 420_000),
            (1, 4, 512, 520_000, 1, 540_000),
            (1, 4, 512, 1_000_000, 1, 1_000_000),
            (33, 20, 5, 50, 3, 100),
            (1, 4, 3, 10, 2, 30),
        ];
        // Fewer tokens under a sanitizer, which runs the long slices' passes slowly.
        let most_tokens = sanitizer_length(16, 2);
        for (iter, (nh, c, k, cap, ratio, max_pos)) in configs.into_iter().enumerate() {
            for round in 0..3 {
                let t = rng.random_range(1..=most_tokens);
                // Position 0, a position with fewer visible entries than k, and any.
                let pos0 = match round {
                    0 => 0,
                    1 => rng.random_range(0..(k * ratio).min(max_pos) + 1),
                    _ => rng.random_range(0..max_pos + 1),
                };
                let q = uniform(&mut rng, t * nh * c, -1.0, 1.0);
                let w = uniform(&mut rng, t * nh, -1.0, 1.0);
                let entries = f16_uniform(&mut rng, cap * c, -1.0, 1.0);
                let (got_scores, got_sel) = device_index_topk(
                    &dev,
                    (&q, &w, &entries),
                    [nh, c, ratio, pos0, k],
                    IndexScoring::Exact,
                );
                let want = cpu::index_topk(&q, &w, &entries, nh, c, ratio, pos0, k);
                let what = format!("config {iter} round {round}: T {t} at {pos0}");
                // The scores of the visible entries are the CPU's, bit for bit.
                for tt in 0..t {
                    let s = cpu::token_index_scores(&q, &w, &entries, [nh, c, ratio, pos0], tt);
                    assert_bits_eq(
                        &format!("{what} token {tt} scores"),
                        &got_scores[tt * cap..tt * cap + s.len()],
                        &s,
                    );
                }
                assert_eq!(got_sel, want, "{what}");
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_index_topk_breaks_ties_to_the_lowest_index() {
        let dev = device();
        // Entries that repeat: many exact ties, and all-negative dots (score -0.0 or +0.0); in
        // one block, and over a cluster of slices (the ties then span the slices).
        for (k, cap, positions) in [
            (7, 64, vec![0, 5, 20, 63, 100]),
            (700, 300_000, vec![299_999]),
        ] {
            index_ties(&dev, k, cap, &positions);
        }
    }

    fn index_ties(dev: &Device, k: usize, cap: usize, positions: &[usize]) {
        let (nh, c, t) = (4, 8, 3);
        let base: Vec<f32> = (0..4 * c)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let entries: Vec<f32> = (0..cap)
            .flat_map(|e| base[(e % 4) * c..(e % 4 + 1) * c].to_vec())
            .collect();
        let q: Vec<f32> = (0..t * nh * c)
            .map(|i| ((i * 5 % 13) as f32 - 6.0) / 6.0)
            .collect();
        let w: Vec<f32> = (0..t * nh)
            .map(|i| if i % 3 == 0 { -0.5 } else { 0.25 })
            .collect();
        for &pos0 in positions {
            let (_, got) = device_index_topk(
                dev,
                (&q, &w, &entries),
                [nh, c, 1, pos0, k],
                IndexScoring::Exact,
            );
            let want = cpu::index_topk(&q, &w, &entries, nh, c, 1, pos0, k);
            assert_eq!(got, want, "{cap} entries, position {pos0}");
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_index_scores_on_tensor_cores_match_reference() {
        let dev = device();
        let mut rng = rng("gpu_index_scores_on_tensor_cores_match_reference");
        // (nh, c, k, capacity, ratio, largest first position, query amplitude): the Flash
        // shape at 128k and past a block's grid, heads not a multiple of 8, the fixtures'
        // widths, queries past f16's range and far below 1.
        let configs = [
            (64, 128, 512, 32_768, 4, 131_000, 4.0),
            (64, 128, 512, 3000, 4, 14_000, 1.0),
            (12, 16, 8, 300, 4, 1_300, 1.0),
            (8, 32, 8, 200, 1, 400, 1.0),
            (33, 48, 5, 50, 3, 100, 1.0),
            (64, 128, 64, 2000, 4, 8_000, 3.0e5),
            (64, 128, 64, 2000, 4, 8_000, 1.0e-6),
        ];
        for (iter, (nh, c, k, cap, ratio, max_pos, amp)) in configs.into_iter().enumerate() {
            for round in 0..2 {
                let t = rng.random_range(1..=20usize);
                let pos0 = match round {
                    0 => rng.random_range(0..(k * ratio).min(max_pos) + 1),
                    _ => rng.random_range(0..max_pos + 1),
                };
                let q = uniform(&mut rng, t * nh * c, -amp, amp);
                let w = uniform(&mut rng, t * nh, -1.0, 1.0);
                let entries = f16_uniform(&mut rng, cap * c, -1.0, 1.0);
                let dims = [nh, c, ratio, pos0, k];
                let tc = IndexScoring::TensorCores;
                let (got, sel) = device_index_topk(&dev, (&q, &w, &entries), dims, tc);
                let what = format!("config {iter} round {round}: T {t} at {pos0}");
                // The terms' weights: raw weights / sqrt(nh) / sqrt(c).
                let wscale = 1.0 / ((nh * c) as f64).sqrt();
                for tt in 0..t {
                    let qt = &q[tt * nh * c..(tt + 1) * nh * c];
                    let wt = &w[tt * nh..(tt + 1) * nh];
                    let want = cpu::token_index_scores(&q, &w, &entries, [nh, c, ratio, pos0], tt);
                    let n = want.len();
                    let row = &got[tt * cap..(tt + 1) * cap];
                    // Every entry of short rows, about 2000 spread over long ones.
                    for e in (0..n).step_by((n / 2000).max(1)) {
                        let (g, s) = (row[e], want[e]);
                        // Within 2e-5 of the size of the entry's terms, Σ_h |w_h| Σ |q k| / √c
                        // (an operand rounded once to f16 is off by up to 2^-11, about 5e-4,
                        // of itself; the keys are f16 values already).
                        let key = &entries[e * c..(e + 1) * c];
                        let size: f64 = qt
                            .chunks_exact(c)
                            .zip(wt)
                            .map(|(qh, wh)| {
                                let d: f64 =
                                    qh.iter().zip(key).map(|(a, b)| (a * b).abs() as f64).sum();
                                d * wscale * wh.abs() as f64
                            })
                            .sum();
                        let err = (g as f64 - s as f64).abs();
                        assert!(
                            err <= 2e-5 * size,
                            "{what} token {tt} entry {e}: {g} against {s} (terms' size {size})"
                        );
                    }
                    // Past the visible entries nothing is written.
                    assert!(
                        row[n..]
                            .iter()
                            .all(|v| v.to_bits() == u32::from_ne_bytes([POISON; 4])),
                        "{what} token {tt}: a score past its {n} visible entries"
                    );
                    // The selection is the top-k of these scores.
                    assert_eq!(
                        &sel[tt * k..(tt + 1) * k],
                        &cpu::selection_row(&row[..n], k)[..],
                        "{what} token {tt} selection"
                    );
                    // Alone, at its own position, the first and last tokens score the same
                    // bits.
                    if tt != 0 && tt + 1 != t {
                        continue;
                    }
                    let alone = (qt, &w[tt * nh..(tt + 1) * nh], &entries[..]);
                    let (one, _) = device_index_topk(&dev, alone, [nh, c, ratio, pos0 + tt, k], tc);
                    assert_bits_eq(&format!("{what} token {tt} alone"), &one[..n], &row[..n]);
                }
            }
        }
    }

    /// The sizes of one attention test launch; queries uniform in ±q_amp, keys in ±amp.
    #[derive(Clone, Copy)]
    struct CaseShape {
        h: usize,
        d: usize,
        w: usize,
        t: usize,
        pos0: usize,
        mode: usize,
        ratio: usize,
        cap: usize,
        k: usize,
        half: usize,
        q_amp: f32,
        amp: f32,
    }

    /// One attention launch's random inputs, on the host and the device, and the CPU result
    /// (rotated back as the kernels write it). `mode`: 0 no compressed keys, 1 all visible
    /// entries, 2 a random selection of them (ascending, -1 after).
    struct AttentionCase {
        s: CaseShape,
        what: String,
        selected: Vec<i32>,
        q: DeviceTensor<f32>,
        kv: DeviceTensor<f32>,
        ring: DeviceTensor<f32>,
        sink: DeviceTensor<f32>,
        entries_d: DeviceTensor<f16>,
        selected_d: DeviceTensor<i32>,
        pos: DeviceTensor<u32>,
        freq: DeviceTensor<f32>,
        want: Vec<f32>,
    }

    impl AttentionCase {
        fn new(dev: &Device, rng: &mut StdRng, iter: usize, s: CaseShape) -> AttentionCase {
            let (h, d, w, t, hd) = (s.h, s.d, s.w, s.t, s.h * s.d);
            let q = uniform(rng, t * hd, -s.q_amp, s.q_amp);
            let kv = uniform(rng, t * d, -s.amp, s.amp);
            let ring = uniform(rng, w * d, -s.amp, s.amp);
            let sink = uniform(rng, h, -2.0, 4.0);
            let entries = f16_uniform(rng, s.cap * d, -s.amp, s.amp);
            let selected: Vec<i32> = (0..t)
                .flat_map(|tt| {
                    let n = cpu::visible_entries(s.pos0 + tt, s.ratio, s.cap);
                    let mut ids: Vec<i32> = (0..n as i32).collect();
                    ids.retain(|_| rng.random_bool(0.6));
                    ids.truncate(s.k);
                    ids.resize(s.k, -1);
                    ids
                })
                .collect();
            let f = inv_freq(s.half);
            let hc = match s.mode {
                0 => HostCompressed::None,
                1 => HostCompressed::All {
                    entries: &entries,
                    ratio: s.ratio,
                },
                _ => HostCompressed::Selected {
                    entries: &entries,
                    selected: &selected,
                    k: s.k,
                },
            };
            let mut want = cpu::attention(&q, &kv, &ring, d, hc, &sink, s.pos0);
            for (tt, row) in want.chunks_mut(hd).enumerate() {
                rope_rows(row, h, d, &f, s.pos0 + tt, RopeDirection::Inverse);
            }
            let what = format!(
                "iter {iter}: H {h} d {d} W {w} mode {} T {t} at {}",
                s.mode, s.pos0
            );
            AttentionCase {
                what,
                q: dev.upload(DType::F32, &[t, hd], &q).unwrap(),
                kv: dev.upload(DType::F32, &[t, d], &kv).unwrap(),
                ring: dev.upload(DType::F32, &[w, d], &ring).unwrap(),
                sink: dev.upload(DType::F32, &[h], &sink).unwrap(),
                entries_d: upload_f16(dev, &[s.cap, d], &entries),
                selected_d: dev.upload(DType::I32, &[t, s.k], &selected).unwrap(),
                pos: position(dev, s.pos0),
                freq: dev.upload(DType::F32, &[s.half], &f).unwrap(),
                selected,
                want,
                s,
            }
        }

        /// The keys token `tt` sees: its window positions and its compressed entries.
        fn keys(&self, tt: usize) -> usize {
            let p = self.s.pos0 + tt;
            let visible = cpu::visible_entries(p, self.s.ratio, self.s.cap);
            (p + 1).min(self.s.w)
                + match self.s.mode {
                    0 => 0,
                    1 => visible,
                    _ => visible.min(self.s.k),
                }
        }

        /// The launch on `splits` into a poisoned output, with `selected` in place of the
        /// case's selection when given; the output widened to f32.
        fn run(
            &self,
            dev: &Device,
            splits: &mut AttentionSplits,
            selected: Option<&DeviceTensor<i32>>,
        ) -> Vec<f32> {
            let ratio = self.s.ratio;
            let entries = &self.entries_d;
            let compressed = match self.s.mode {
                0 => Compressed::None,
                1 => Compressed::All { entries, ratio },
                _ => Compressed::Selected {
                    entries,
                    selected: selected.unwrap_or(&self.selected_d),
                    ratio,
                },
            };
            let shape = [self.s.t, self.s.h * self.s.d];
            let mut out = poisoned::<bf16>(dev, DType::BF16, &shape);
            attention(
                dev, &self.q, &self.kv, &self.ring, compressed, &self.sink, &self.pos, &self.freq,
                splits, &mut out,
            )
            .unwrap();
            download_f32(dev, &out)
        }

        /// Every token of `got` within `rel` of the CPU result (and half a BF16 step).
        fn check(&self, label: &str, got: &[f32], rel: f32) {
            let hd = self.s.h * self.s.d;
            for tt in 0..self.s.t {
                assert_close_bf16(
                    &format!("{} {label} token {tt}", self.what),
                    &got[tt * hd..(tt + 1) * hd],
                    &self.want[tt * hd..(tt + 1) * hd],
                    rel,
                );
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_attention_matches_reference() {
        let dev = device();
        let mut rng = rng("gpu_attention_matches_reference");
        // (heads, d, window): tiny, Flash, Pro, odd.
        let shapes = [
            (4, 32, 16),
            (64, 512, 128),
            (128, 512, 128),
            (6, 64, 5),
            (3, 96, 1),
        ];
        for iter in 0..sanitizer_length(30, 10) {
            let (h, d, w) = shapes[iter % shapes.len()];
            let t = rng.random_range(1..=16usize);
            let pos0 = match iter % 4 {
                0 => 0,
                1 => rng.random_range(0..w + 1),
                2 => rng.random_range(w..3 * w + 20),
                _ => rng.random_range(0..5000),
            };
            let q_amp = rng.random_range(0.5..4.0);
            let ratio = [4, 128, 1, 3][rng.random_range(0..4)];
            let full = (pos0 + t) / ratio;
            // Capacity clipping now and then; zero visible entries at small positions.
            let cap = if rng.random_bool(0.3) {
                (full / 2).max(1)
            } else {
                full + 3
            };
            let k = [8, 512, 3][rng.random_range(0..3)];
            let half = [0, 1, d / 4, d / 2][rng.random_range(0..4)];
            let shape = CaseShape {
                h,
                d,
                w,
                t,
                pos0,
                mode: iter % 3,
                ratio,
                cap,
                k,
                half,
                q_amp,
                amp: 1.0,
            };
            let case = AttentionCase::new(&dev, &mut rng, iter, shape);
            // Every token on tensor cores (f16 pairs), every token on CUDA cores (exact f32
            // products), and the tokens divided between the two at the middle token's keys.
            let mid = case.keys(t / 2);
            for mma_keys in [0, usize::MAX, mid] {
                check_attention_kernels(&dev, &case, mma_keys);
            }
        }
    }

    /// [`gpu_attention_matches_reference`]'s checks of one case, tokens of `mma_keys` keys or
    /// more on tensor cores.
    fn check_attention_kernels(dev: &Device, case: &AttentionCase, mma_keys: usize) {
        let before = attention_mma_keys();
        set_attention_mma_keys(mma_keys);
        let exact = mma_keys == usize::MAX;
        let rel = if exact { 1e-5 } else { 1e-4 };
        let what = format!("{}, tensor cores from {mma_keys} keys", case.what);
        let what = &what;
        let CaseShape {
            t,
            pos0,
            ratio,
            cap,
            k,
            d,
            ..
        } = case.s;
        {
            // Unsplit (no scratch, no cluster), split as the device chooses, and split again
            // (tensor-core tokens over the states the previous launch left: the same bits).
            let mut splits = scratch(dev, 0, d);
            let mut big = scratch(dev, SPLIT_ROWS, d);
            let cluster = &crate::gpu::gemv::tuning::ATTENTION_SPLITS;
            cluster.set(false);
            let unsplit = case.run(dev, &mut splits, None);
            cluster.set(true);
            case.check("unsplit", &unsplit, rel);
            let split = case.run(dev, &mut big, None);
            case.check("split", &split, rel);
            let again = case.run(dev, &mut big, None);
            assert_bits_eq(&format!("{what} relaunch"), &again, &split);
            if exact {
                // One key buffer a warp (where two do not fit): the same bits.
                let single = &crate::gpu::gemv::tuning::ATTENTION_DOUBLE_BUFFER;
                single.set(false);
                let one = case.run(dev, &mut big, None);
                single.set(true);
                assert_bits_eq(&format!("{what} one buffer"), &one, &split);
            }
            if case.s.mode == 2 {
                // The slots past min(k, visible) are not read: ids there change nothing.
                let dirty: Vec<i32> = case
                    .selected
                    .chunks(k)
                    .enumerate()
                    .flat_map(|(tt, ids)| {
                        let n = cpu::visible_entries(pos0 + tt, ratio, cap).min(k);
                        ids.iter()
                            .enumerate()
                            .map(move |(i, &id)| if i < n { id } else { 0 })
                    })
                    .collect();
                let dd = dev.upload(DType::I32, &[t, k], &dirty).unwrap();
                let got = case.run(dev, &mut big, Some(&dd));
                assert_bits_eq(&format!("{what} ids past the visible slots"), &got, &split);
            }
        }
        set_attention_mma_keys(before);
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_attention_of_long_chunks_matches_reference() {
        // 17 tokens or more: the tensor-core kernel (f16 pairs for f32 operands), a
        // head group past the 64 a block takes (Pro), windows crossing the chunk's start,
        // every compression mode, selections with empty slots; then relaunched, the same bits.
        let dev = device();
        let mut rng = rng("gpu_attention_of_long_chunks_matches_reference");
        let shapes = [(64, 512, 128), (128, 512, 128), (4, 32, 16), (6, 64, 5)];
        for iter in 0..12 {
            let (h, d, w) = shapes[iter % shapes.len()];
            let t = rng.random_range(17..=90usize);
            let pos0 = [0, rng.random_range(1..w + 1), rng.random_range(w..4000)][iter % 3];
            let ratio = [4, 128, 3][iter % 3];
            // RMS-normalised queries and keys, as the model's.
            let shape = CaseShape {
                h,
                d,
                w,
                t,
                pos0,
                mode: iter % 3,
                ratio,
                cap: (pos0 + t) / ratio + 2,
                k: 8,
                half: d / 4,
                q_amp: 1.7,
                amp: 1.7,
            };
            let case = AttentionCase::new(&dev, &mut rng, iter, shape);
            let mut sp = scratch(&dev, 0, d);
            let first = case.run(&dev, &mut sp, None);
            case.check("first", &first, 1e-4);
            let again = case.run(&dev, &mut sp, None);
            assert_bits_eq(&format!("{} relaunch", case.what), &again, &first);
        }
    }

    /// Room for the attention's split states in the tests: Pro's 128 heads × 16 tokens × 4.
    const SPLIT_ROWS: usize = 8192;

    fn scratch(dev: &Device, rows: usize, d: usize) -> AttentionSplits {
        let [acc, stats] = AttentionSplits::shapes(rows, d);
        AttentionSplits {
            acc: dev.alloc(DType::F32, &acc).unwrap(),
            stats: dev.alloc(DType::F32, &stats).unwrap(),
        }
    }

    /// The attention's BF16 output, widened.
    fn download_f32(dev: &Device, out: &DeviceTensor<bf16>) -> Vec<f32> {
        dev.download(out)
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect()
    }

    /// As [`assert_close`], for a BF16 result of `want`: also half a BF16 step of |want| off.
    fn assert_close_bf16(what: &str, got: &[f32], want: &[f32], rel: f32) {
        assert_within_bf16_steps(what, got, want, rel, 0.5);
    }

    /// Two BF16 roundings of sums that agree within `rel` of the largest |want|: within that
    /// and one BF16 step of |want| (a rounding boundary may fall between them).
    fn assert_bf16_results_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
        assert_within_bf16_steps(what, got, want, rel, 1.0);
    }

    /// Every element of `got` within `rel` of the largest |want| and `steps` BF16 steps of
    /// |want| (a step: |want| / 128) of `want`.
    fn assert_within_bf16_steps(what: &str, got: &[f32], want: &[f32], rel: f32, steps: f32) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let bound = rel * scale + w.abs() * steps / 128.0;
            assert!(
                (g - w).abs() <= bound,
                "{what}: element {i}: got {g}, want {w} (bound {bound})"
            );
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_window_write_matches_reference() {
        let dev = device();
        let mut rng = rng("gpu_window_write_matches_reference");
        for _ in 0..20 {
            let d = [32, 512, 7][rng.random_range(0..3)];
            let w = [16, 128, 5, 1][rng.random_range(0..4)];
            let t = rng.random_range(1..=16usize);
            let pos0 = rng.random_range(0..1000);
            let kv = uniform(&mut rng, t * d, -1.0, 1.0);
            let mut ring = uniform(&mut rng, w * d, -1.0, 1.0);
            let kvd = dev.upload(DType::F32, &[t, d], &kv).unwrap();
            let mut rd = dev.upload(DType::F32, &[w, d], &ring).unwrap();
            window_write(&dev, &kvd, &position(&dev, pos0), &mut rd).unwrap();
            cpu::window_write(&kv, d, pos0, &mut ring);
            assert_bits_eq("window", &dev.download(&rd).unwrap(), &ring);
        }
    }

    /// A CSA layer's device pieces chained over consecutive chunks (main and indexer
    /// compressors, index top-k, attention over the selection, the window write), state kept on
    /// the device, against the reference chain; tiny-model sizes.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_csa_layer_chunks_match_reference() {
        let dev = device();
        let mut rng = rng("gpu_csa_layer_chunks_match_reference");
        let (h, d, w, ratio, ic, nh, k, half, eps) = (4, 32, 16, 4, 16, 4, 8, 4, 1e-6f32);
        let total = 150;
        let (cap, icap) = (total / ratio, total / ratio);
        let hd = h * d;
        let f = inv_freq(half);
        let fd = dev.upload(DType::F32, &[half], &f).unwrap();
        let sink = uniform(&mut rng, h, -1.0, 1.0);
        let sd = dev.upload(DType::F32, &[h], &sink).unwrap();
        let mk = |rng: &mut StdRng, c: usize| {
            let ape = uniform(rng, ratio * 2 * c, -1.0, 1.0);
            let norm = uniform(rng, c, 0.5, 1.5);
            (ape, norm)
        };
        let (ape, norm) = mk(&mut rng, d);
        let (iape, inorm) = mk(&mut rng, ic);
        let up = |v: &[f32], s: &[usize]| dev.upload(DType::F32, s, v).unwrap();
        let (aped, normd) = (up(&ape, &[ratio, 2 * d]), up(&norm, &[d]));
        let (iaped, inormd) = (up(&iape, &[ratio, 2 * ic]), up(&inorm, &[ic]));
        let mut st = comp_buffers(&dev, ratio, d, true, cap);
        let mut ist = comp_buffers(&dev, ratio, ic, true, icap);
        let mut ring_d = dev.alloc::<f32>(DType::F32, &[w, d]).unwrap();
        let mut splits = scratch(&dev, SPLIT_ROWS, d);
        let mut host = CompressorHost::new(ratio, d, true, cap);
        let mut ihost = CompressorHost::new(ratio, ic, true, icap);
        let mut ring = vec![0.0f32; w * d];
        let mut pos0 = 0;
        for t in chunks(&mut rng, total) {
            let q = uniform(&mut rng, t * hd, -2.0, 2.0);
            let kv = uniform(&mut rng, t * d, -1.0, 1.0);
            let ckv = uniform(&mut rng, t * 2 * d, -1.0, 1.0);
            let cg = uniform(&mut rng, t * 2 * d, -2.0, 2.0);
            let iq = uniform(&mut rng, t * nh * ic, -1.0, 1.0);
            let iw = uniform(&mut rng, t * nh, -1.0, 1.0);
            let ikv = uniform(&mut rng, t * 2 * ic, -1.0, 1.0);
            let ig = uniform(&mut rng, t * 2 * ic, -2.0, 2.0);
            let pos = position(&dev, pos0);
            // The main compressor, then the indexer's.
            let proj = up(&stacked(&ckv, &cg, 2 * d), &[t, 4 * d]);
            compressor_update(&dev, &proj, &aped, &normd, &fd, eps, true, &pos, &mut st).unwrap();
            let proj = up(&stacked(&ikv, &ig, 2 * ic), &[t, 4 * ic]);
            compressor_update(&dev, &proj, &iaped, &inormd, &fd, eps, true, &pos, &mut ist)
                .unwrap();
            let mut scores = poisoned::<f32>(&dev, DType::F32, &[t, icap]);
            let mut sel = poisoned::<i32>(&dev, DType::I32, &[t, k]);
            index_topk(
                &dev,
                &up(&iq, &[t, nh * ic]),
                &up(&iw, &[t, nh]),
                &ist.entries,
                ratio,
                &pos,
                IndexScoring::Exact,
                &mut scores,
                &mut sel,
            )
            .unwrap();
            let kvd = up(&kv, &[t, d]);
            let mut out = poisoned::<bf16>(&dev, DType::BF16, &[t, hd]);
            let comp = Compressed::Selected {
                entries: &st.entries,
                selected: &sel,
                ratio,
            };
            attention(
                &dev,
                &up(&q, &[t, hd]),
                &kvd,
                &ring_d,
                comp,
                &sd,
                &pos,
                &fd,
                &mut splits,
                &mut out,
            )
            .unwrap();
            window_write(&dev, &kvd, &pos, &mut ring_d).unwrap();

            cpu::compressor_update(&ckv, &cg, &ape, &norm, &f, eps, true, pos0, &mut host);
            cpu::compressor_update(&ikv, &ig, &iape, &inorm, &f, eps, true, pos0, &mut ihost);
            // The entries as the device keeps them (f16), so that the CPU's selection and
            // attention read the device's keys; the compressors against the CPU's here and in
            // their own test.
            let (keys, ikeys) = (
                dev.download(&st.entries).unwrap(),
                dev.download(&ist.entries).unwrap(),
            );
            assert_f16_close("entries", &keys, &host.entries, 1e-5);
            assert_f16_close("indexer entries", &ikeys, &ihost.entries, 1e-5);
            let (keys, ikeys) = (widen(&keys), widen(&ikeys));
            let want_sel = cpu::index_topk(&iq, &iw, &ikeys, nh, ic, ratio, pos0, k);
            let got_sel = dev.download(&sel).unwrap();
            let what = format!("chunk {pos0}+{t}");
            // Exact scores of the same keys: the same selection.
            assert_eq!(got_sel, want_sel, "{what} selection");
            let mut want = cpu::attention(
                &q,
                &kv,
                &ring,
                d,
                HostCompressed::Selected {
                    entries: &keys,
                    selected: &got_sel,
                    k,
                },
                &sink,
                pos0,
            );
            for (tt, row) in want.chunks_mut(hd).enumerate() {
                rope_rows(row, h, d, &f, pos0 + tt, RopeDirection::Inverse);
            }
            let got = download_f32(&dev, &out);
            assert_close_bf16(&what, &got, &want, 1e-5);
            cpu::window_write(&kv, d, pos0, &mut ring);
            assert_bits_eq(
                &format!("{what} ring"),
                &dev.download(&ring_d).unwrap(),
                &ring,
            );
            pos0 += t;
        }
    }

    /// One sequence's state of a CSA layer (main compressor, indexer compressor, window
    /// ring), `n` sequences' worth: each buffer `[n, ...]`, in a pool (so that each
    /// sequence's slice can be viewed alone).
    struct SeqStates {
        comp: CompressorBuffers,
        icomp: CompressorBuffers,
        ring: DeviceTensor<f32>,
        _pool: crate::gpu::BufferPool,
    }

    impl SeqStates {
        /// Every buffer filled from `host` (one vector a buffer, in field order; the entries,
        /// buffers [`ENTRIES`], rounded to f16).
        fn upload(dev: &Device, shapes: &[Vec<usize>; 11], host: &[Vec<f32>]) -> SeqStates {
            let mut pool = crate::gpu::BufferPool::new();
            let mut f32s = Vec::new();
            let mut f16s = Vec::new();
            for (i, shape) in shapes.iter().enumerate() {
                let name = format!("state.{i}");
                if ENTRIES.contains(&i) {
                    let r = pool.reserve::<f16>(&name, DType::F16, shape).unwrap();
                    let rounded: Vec<f16> = host[i].iter().map(|&v| f16::from_f32(v)).collect();
                    f16s.push((r, rounded));
                } else {
                    f32s.push((
                        pool.reserve::<f32>(&name, DType::F32, shape).unwrap(),
                        &host[i],
                    ));
                }
            }
            pool.seal(dev).unwrap();
            let f32s: Vec<_> = f32s
                .into_iter()
                .map(|(r, h)| {
                    let mut t = pool.take(r).unwrap();
                    dev.write(&mut t, h).unwrap();
                    t
                })
                .collect();
            let f16s: Vec<_> = f16s
                .into_iter()
                .map(|(r, h)| {
                    let mut t = pool.take(r).unwrap();
                    dev.write(&mut t, &h).unwrap();
                    t
                })
                .collect();
            let (mut f32s, mut f16s) = (f32s.into_iter(), f16s.into_iter());
            let mut comp = || CompressorBuffers {
                kv: f32s.next().unwrap(),
                gate: f32s.next().unwrap(),
                prev_kv: f32s.next().unwrap(),
                prev_gate: f32s.next().unwrap(),
                entries: f16s.next().unwrap(),
            };
            let (comp, icomp) = (comp(), comp());
            let ring = f32s.next().unwrap();
            drop(f32s);
            SeqStates {
                comp,
                icomp,
                ring,
                _pool: pool,
            }
        }

        /// Every buffer, downloaded in field order (the entries widened).
        fn download(&self, dev: &Device) -> Vec<Vec<f32>> {
            let c = |b: &CompressorBuffers| {
                let mut v: Vec<Vec<f32>> = [&b.kv, &b.gate, &b.prev_kv, &b.prev_gate]
                    .map(|t| dev.download(t).unwrap())
                    .into();
                v.push(widen(&dev.download(&b.entries).unwrap()));
                v
            };
            let mut out = c(&self.comp);
            out.extend(c(&self.icomp));
            out.push(dev.download(&self.ring).unwrap());
            out
        }
    }

    /// Which of [`SeqStates`]' buffers hold compressed entries.
    const ENTRIES: [usize; 2] = [4, 9];

    /// Slice `i` of a `[n, ...]` buffer, as one sequence's `[...]`.
    fn slot<T: crate::gpu::DeviceElem>(t: &DeviceTensor<T>, i: usize) -> DeviceTensor<T> {
        let one = &t.shape()[1..];
        t.view(i * one.iter().product::<usize>(), one).unwrap()
    }

    fn slot_bufs(b: &CompressorBuffers, i: usize) -> CompressorBuffers {
        CompressorBuffers {
            kv: slot(&b.kv, i),
            gate: slot(&b.gate, i),
            prev_kv: slot(&b.prev_kv, i),
            prev_gate: slot(&b.prev_gate, i),
            entries: slot(&b.entries, i),
        }
    }

    /// A batch of sequences (one token each, at its own position, over its own state) through
    /// the compressors, the rotation of the indexer's queries, the indexer (both scorings),
    /// the attention (on CUDA cores and on tensor cores) and the window write gives what each
    /// sequence's token gives launched alone: bit for bit, except the attention (its key splits
    /// depend on the launch's size), within the bounds of the reference tests.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_batch_of_sequences_runs_each_as_alone() {
        let dev = device();
        let mut rng = rng("gpu_batch_of_sequences_runs_each_as_alone");
        let (h, d, w, ratio, ic, nh, k, half, eps) = (8, 64, 16, 4, 32, 4, 8, 4, 1e-6f32);
        let cap = 64;
        let hd = h * d;
        let f = inv_freq(half);
        let up = |v: &[f32], s: &[usize]| dev.upload(DType::F32, s, v).unwrap();
        let fd = up(&f, &[half]);
        let sd = up(&uniform(&mut rng, h, -1.0, 1.0), &[h]);
        let (aped, normd) = (
            up(
                &uniform(&mut rng, ratio * 2 * d, -1.0, 1.0),
                &[ratio, 2 * d],
            ),
            up(&uniform(&mut rng, d, 0.5, 1.5), &[d]),
        );
        let (iaped, inormd) = (
            up(
                &uniform(&mut rng, ratio * 2 * ic, -1.0, 1.0),
                &[ratio, 2 * ic],
            ),
            up(&uniform(&mut rng, ic, 0.5, 1.5), &[ic]),
        );
        for n in [2usize, 5, 16] {
            // Positions around window and compression boundaries and past the capacity.
            let positions: Vec<u32> = (0..n)
                .map(|i| match i % 4 {
                    0 => rng.random_range(0..8),
                    1 => 4 * rng.random_range(1..40) - 1,
                    2 => rng.random_range(0..4 * cap as u32),
                    _ => rng.random_range(4 * cap as u32..8 * cap as u32),
                })
                .collect();
            let comp_shapes = |c: usize| {
                [
                    vec![n, ratio, 2 * c],
                    vec![n, ratio, 2 * c],
                    vec![n, ratio, c],
                    vec![n, ratio, c],
                    vec![n, cap, c],
                ]
            };
            let mut shapes: Vec<Vec<usize>> = comp_shapes(d).into();
            shapes.extend(comp_shapes(ic));
            shapes.push(vec![n, w, d]);
            let shapes: [Vec<usize>; 11] = shapes.try_into().unwrap();
            let host: Vec<Vec<f32>> = shapes
                .iter()
                .map(|s| uniform(&mut rng, s.iter().product(), -1.0, 1.0))
                .collect();
            let mut batch = SeqStates::upload(&dev, &shapes, &host);
            let alone = SeqStates::upload(&dev, &shapes, &host);
            let proj = up(&uniform(&mut rng, n * 4 * d, -1.5, 1.5), &[n, 4 * d]);
            let iproj = up(&uniform(&mut rng, n * 4 * ic, -1.5, 1.5), &[n, 4 * ic]);
            let q = up(&uniform(&mut rng, n * hd, -2.0, 2.0), &[n, hd]);
            let kv = up(&uniform(&mut rng, n * d, -1.0, 1.0), &[n, d]);
            let iq_host = uniform(&mut rng, n * nh * ic, -1.0, 1.0);
            let iw = up(&uniform(&mut rng, n * nh, -1.0, 1.0), &[n, nh]);
            let pos = dev.upload(DType::U32, &[n], &positions).unwrap();

            // The batch: one launch of each.
            let mut iq = up(&iq_host, &[n, nh * ic]);
            crate::gpu::rows::rope_rows(&dev, &mut iq, ic, &fd, &pos, RopeDirection::Forward)
                .unwrap();
            compressor_update(
                &dev,
                &proj,
                &aped,
                &normd,
                &fd,
                eps,
                true,
                &pos,
                &mut batch.comp,
            )
            .unwrap();
            let st = &mut batch.icomp;
            compressor_update(&dev, &iproj, &iaped, &inormd, &fd, eps, true, &pos, st).unwrap();
            let mut sels = Vec::new();
            let mut scores_all = Vec::new();
            for scoring in [IndexScoring::Exact, IndexScoring::TensorCores] {
                let mut scores = poisoned::<f32>(&dev, DType::F32, &[n, cap]);
                let mut sel = poisoned::<i32>(&dev, DType::I32, &[n, k]);
                let e = &batch.icomp.entries;
                index_topk(
                    &dev,
                    &iq,
                    &iw,
                    e,
                    ratio,
                    &pos,
                    scoring,
                    &mut scores,
                    &mut sel,
                )
                .unwrap();
                scores_all.push(dev.download(&scores).unwrap());
                sels.push(sel);
            }
            let mut splits = scratch(&dev, SPLIT_ROWS, d);
            // The attention on CUDA cores (these few keys' default) and on tensor cores.
            let mut attend = |q: &DeviceTensor<f32>,
                              kv: &DeviceTensor<f32>,
                              ring: &DeviceTensor<f32>,
                              entries: &DeviceTensor<f16>,
                              selected: &DeviceTensor<i32>,
                              pos: &DeviceTensor<u32>,
                              mma_keys: usize| {
                let mut out = poisoned::<bf16>(&dev, DType::BF16, &[q.shape()[0], hd]);
                let comp = Compressed::Selected {
                    entries,
                    selected,
                    ratio,
                };
                let before = attention_mma_keys();
                set_attention_mma_keys(mma_keys);
                let r = attention(
                    &dev,
                    q,
                    kv,
                    ring,
                    comp,
                    &sd,
                    pos,
                    &fd,
                    &mut splits,
                    &mut out,
                );
                set_attention_mma_keys(before);
                r.unwrap();
                download_f32(&dev, &out)
            };
            let (ring, entries) = (&batch.ring, &batch.comp.entries);
            let got_out = attend(&q, &kv, ring, entries, &sels[1], &pos, usize::MAX);
            let got_mma = attend(&q, &kv, ring, entries, &sels[1], &pos, 0);
            window_write(&dev, &kv, &pos, &mut batch.ring).unwrap();
            let got_iq = dev.download(&iq).unwrap();
            let got_sel: Vec<Vec<i32>> = sels.iter().map(|s| dev.download(s).unwrap()).collect();

            // Each token alone, over its slice of the same states.
            for i in 0..n {
                let what = format!("{n} sequences, sequence {i} at {}", positions[i]);
                let p1 = position(&dev, positions[i] as usize);
                // Row i of a batch input, as a one-token input of its own.
                let row = |t: &DeviceTensor<f32>| {
                    let width = t.shape()[1];
                    let all = dev.download(t).unwrap();
                    up(&all[i * width..(i + 1) * width], &[1, width])
                };
                let mut iq1 = up(&iq_host[i * nh * ic..(i + 1) * nh * ic], &[1, nh * ic]);
                crate::gpu::rows::rope_rows(&dev, &mut iq1, ic, &fd, &p1, RopeDirection::Forward)
                    .unwrap();
                assert_bits_eq(
                    &format!("{what}: rotated indexer queries"),
                    &got_iq[i * nh * ic..(i + 1) * nh * ic],
                    &dev.download(&iq1).unwrap(),
                );
                let mut st = slot_bufs(&alone.comp, i);
                compressor_update(
                    &dev,
                    &row(&proj),
                    &aped,
                    &normd,
                    &fd,
                    eps,
                    true,
                    &p1,
                    &mut st,
                )
                .unwrap();
                let mut ist = slot_bufs(&alone.icomp, i);
                let ip = row(&iproj);
                compressor_update(&dev, &ip, &iaped, &inormd, &fd, eps, true, &p1, &mut ist)
                    .unwrap();
                let mut sel1 = poisoned::<i32>(&dev, DType::I32, &[1, k]);
                for (j, scoring) in [IndexScoring::Exact, IndexScoring::TensorCores]
                    .into_iter()
                    .enumerate()
                {
                    let mut scores = poisoned::<f32>(&dev, DType::F32, &[1, cap]);
                    let (e, iw1) = (&ist.entries, row(&iw));
                    index_topk(
                        &dev,
                        &iq1,
                        &iw1,
                        e,
                        ratio,
                        &p1,
                        scoring,
                        &mut scores,
                        &mut sel1,
                    )
                    .unwrap();
                    let vis = ((positions[i] as usize + 1) / ratio).min(cap);
                    assert_bits_eq(
                        &format!("{what}: {scoring:?} scores"),
                        &scores_all[j][i * cap..i * cap + vis],
                        &dev.download(&scores).unwrap()[..vis],
                    );
                    assert_eq!(
                        got_sel[j][i * k..(i + 1) * k],
                        dev.download(&sel1).unwrap(),
                        "{what}: {scoring:?} selection"
                    );
                }
                let mut ring = slot(&alone.ring, i);
                let (q1, kv1) = (row(&q), row(&kv));
                let e = &st.entries;
                let out1 = attend(&q1, &kv1, &ring, e, &sel1, &p1, usize::MAX);
                let mma1 = attend(&q1, &kv1, &ring, e, &sel1, &p1, 0);
                window_write(&dev, &kv1, &p1, &mut ring).unwrap();
                assert_close_bf16(
                    &format!("{what}: attention"),
                    &got_out[i * hd..(i + 1) * hd],
                    &out1,
                    1e-5,
                );
                // On tensor cores alone the token's keys split over more blocks: other
                // roundings of 22-bit products.
                assert_bf16_results_close(
                    &format!("{what}: attention on tensor cores"),
                    &got_mma[i * hd..(i + 1) * hd],
                    &mma1,
                    1e-4,
                );
                assert_bf16_results_close(
                    &format!("{what}: attention on tensor cores against CUDA cores"),
                    &mma1,
                    &out1,
                    1e-4,
                );
            }
            for (j, (b, a)) in batch
                .download(&dev)
                .iter()
                .zip(alone.download(&dev))
                .enumerate()
            {
                assert_bits_eq(&format!("{n} sequences: state buffer {j}"), b, &a);
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_attention_launchers_reject_bad_shapes() {
        let dev = device();
        let pos = position(&dev, 0);
        let f32s = |s: &[usize]| dev.alloc::<f32>(DType::F32, s).unwrap();
        let f16s = |s: &[usize]| dev.alloc::<f16>(DType::F16, s).unwrap();
        let (q, kv, ring, sink) = (
            f32s(&[2, 4 * 32]),
            f32s(&[2, 32]),
            f32s(&[16, 32]),
            f32s(&[4]),
        );
        let fr = f32s(&[4]);
        let mut sp = scratch(&dev, 64, 32);
        let mut out = dev.alloc::<bf16>(DType::BF16, &[2, 4 * 32]).unwrap();
        // The inputs of a good call; each check below changes one of them.
        #[derive(Clone, Copy)]
        struct Call<'a> {
            q: &'a DeviceTensor<f32>,
            kv: &'a DeviceTensor<f32>,
            comp: Compressed<'a>,
            sink: &'a DeviceTensor<f32>,
            rope: &'a DeviceTensor<f32>,
        }
        let good = Call {
            q: &q,
            kv: &kv,
            comp: Compressed::None,
            sink: &sink,
            rope: &fr,
        };
        let run = |c: Call, sp: &mut AttentionSplits, out: &mut DeviceTensor<bf16>| {
            attention(
                &dev, c.q, c.kv, &ring, c.comp, c.sink, &pos, c.rope, sp, out,
            )
        };
        // The good call at other positions.
        let run_pos =
            |p: &DeviceTensor<u32>, sp: &mut AttentionSplits, out: &mut DeviceTensor<bf16>| {
                attention(
                    &dev,
                    &q,
                    &kv,
                    &ring,
                    Compressed::None,
                    &sink,
                    p,
                    &fr,
                    sp,
                    out,
                )
            };
        run(good, &mut sp, &mut out).unwrap();
        let (bad_q, bad_d) = (f32s(&[2, 96]), f32s(&[2, 48]));
        let heads_48 = Call {
            q: &bad_q,
            kv: &bad_d,
            ..good
        };
        assert!(run(heads_48, &mut sp, &mut out).is_err(), "heads of 48");
        let bad_sink = f32s(&[3]);
        let sinks_3 = Call {
            sink: &bad_sink,
            ..good
        };
        assert!(
            run(sinks_3, &mut sp, &mut out).is_err(),
            "3 sinks for 4 heads"
        );
        let big_rope = f32s(&[17]);
        let rope_34 = Call {
            rope: &big_rope,
            ..good
        };
        assert!(
            run(rope_34, &mut sp, &mut out).is_err(),
            "34 rotated channels of 32"
        );
        let mut bad_out = dev.alloc::<bf16>(DType::BF16, &[2, 3 * 32]).unwrap();
        assert!(
            run(good, &mut sp, &mut bad_out).is_err(),
            "output of the wrong shape"
        );
        // Split sums a float past a 16-byte boundary (the merge reads them as vectors).
        let [acc, stats] = AttentionSplits::shapes(64, 32);
        let mut pool = crate::gpu::BufferPool::new();
        let wide = pool
            .reserve::<f32>("wide", DType::F32, &[acc[0] + 1, acc[1]])
            .unwrap();
        let wide_out = pool
            .reserve::<bf16>("wide output", DType::BF16, &[2 * 4 * 32 + 1])
            .unwrap();
        let wide_keys = pool
            .reserve::<f16>("wide keys", DType::F16, &[10 * 32 + 8])
            .unwrap();
        pool.seal(&dev).unwrap();
        let wide = pool.take(wide).unwrap();
        let wide_out = pool.take(wide_out).unwrap();
        let wide_keys = pool.take(wide_keys).unwrap();
        // The output a BF16 past a 4-byte boundary (it is written a channel pair at a time).
        let mut skewed_out = wide_out.view(1, &[2, 4 * 32]).unwrap();
        let err = run(good, &mut sp, &mut skewed_out).unwrap_err().to_string();
        assert!(err.contains("output not on a 4-byte"), "{err}");
        let mut skewed = AttentionSplits {
            acc: wide.view(1, &acc).unwrap(),
            stats: f32s(&stats),
        };
        let err = run(good, &mut skewed, &mut out).unwrap_err().to_string();
        assert!(
            err.contains("split sums not on a 16-byte boundary"),
            "{err}"
        );
        // Queries a float past a 16-byte boundary (they are copied in 16-byte pieces).
        let skewed_q = wide.view(1, &[2, 4 * 32]).unwrap();
        let skewed_call = Call {
            q: &skewed_q,
            ..good
        };
        let err = run(skewed_call, &mut sp, &mut out).unwrap_err().to_string();
        assert!(err.contains("queries not on a 16-byte"), "{err}");
        // Keys and compressed entries likewise.
        let skewed_kv = wide.view(1, &[2, 32]).unwrap();
        let skewed_call = Call {
            kv: &skewed_kv,
            ..good
        };
        let err = run(skewed_call, &mut sp, &mut out).unwrap_err().to_string();
        assert!(err.contains("keys not on a 16-byte"), "{err}");
        let skewed_entries = wide_keys.view(1, &[10, 32]).unwrap();
        let skewed_call = Call {
            comp: Compressed::All {
                entries: &skewed_entries,
                ratio: 4,
            },
            ..good
        };
        let err = run(skewed_call, &mut sp, &mut out).unwrap_err().to_string();
        assert!(err.contains("compressed entries not on a 16-byte"), "{err}");
        let sel = dev.alloc::<i32>(DType::I32, &[3, 8]).unwrap();
        let entries = f16s(&[10, 32]);
        let sel_3 = Call {
            comp: Compressed::Selected {
                entries: &entries,
                selected: &sel,
                ratio: 4,
            },
            ..good
        };
        assert!(
            run(sel_3, &mut sp, &mut out).is_err(),
            "a selection for 3 tokens"
        );
        let sel_2 = dev.alloc::<i32>(DType::I32, &[2, 8]).unwrap();
        let ratio_0 = Call {
            comp: Compressed::Selected {
                entries: &entries,
                selected: &sel_2,
                ratio: 0,
            },
            ..good
        };
        let err = run(ratio_0, &mut sp, &mut out).unwrap_err().to_string();
        assert!(err.contains("compression ratio 0"), "{err}");

        let (iq, iw, ie) = (f32s(&[2, 4 * 16]), f32s(&[2, 4]), f16s(&[10, 16]));
        let mut scores = f32s(&[2, 10]);
        let mut sel = dev.alloc::<i32>(DType::I32, &[2, 3]).unwrap();
        let ex = IndexScoring::Exact;
        index_topk(&dev, &iq, &iw, &ie, 4, &pos, ex, &mut scores, &mut sel).unwrap();
        let mut bad_scores = f32s(&[2, 9]);
        assert!(index_topk(&dev, &iq, &iw, &ie, 4, &pos, ex, &mut bad_scores, &mut sel).is_err());
        assert!(index_topk(&dev, &iq, &iw, &ie, 0, &pos, ex, &mut scores, &mut sel).is_err());
        let (iq6, ie6) = (f32s(&[2, 4 * 6]), f16s(&[10, 6]));
        let err =
            index_topk(&dev, &iq6, &iw, &ie6, 4, &pos, ex, &mut scores, &mut sel).unwrap_err();
        assert!(err.to_string().contains("multiple of 4"), "{err}");
        // The tensor-core kernel reads the entries 16 bytes at a time.
        let skewed_ie = wide_keys.view(4, &[10, 16]).unwrap();
        let tc = IndexScoring::TensorCores;
        let err = index_topk(
            &dev,
            &iq,
            &iw,
            &skewed_ie,
            4,
            &pos,
            tc,
            &mut scores,
            &mut sel,
        );
        assert!(
            err.unwrap_err()
                .to_string()
                .contains("entries not on a 16-byte"),
            "skewed indexer entries"
        );
        let skewed_iq = wide.view(1, &[2, 4 * 16]).unwrap();
        let err = index_topk(
            &dev,
            &skewed_iq,
            &iw,
            &ie,
            4,
            &pos,
            ex,
            &mut scores,
            &mut sel,
        );
        assert!(
            err.unwrap_err()
                .to_string()
                .contains("queries not on a 16-byte"),
            "skewed indexer queries"
        );

        let mut st = CompressorBuffers {
            kv: f32s(&[4, 32]),
            gate: f32s(&[4, 32]),
            prev_kv: f32s(&[4, 16]),
            prev_gate: f32s(&[4, 16]),
            entries: f16s(&[8, 16]),
        };
        let (proj, ape, norm) = (f32s(&[3, 64]), f32s(&[4, 32]), f32s(&[16]));
        compressor_update(&dev, &proj, &ape, &norm, &fr, 1e-6, true, &pos, &mut st).unwrap();
        assert!(
            compressor_update(&dev, &proj, &ape, &norm, &fr, 1e-6, false, &pos, &mut st).is_err(),
            "2·κ·c without overlap"
        );
        let half_proj = f32s(&[3, 32]);
        assert!(
            compressor_update(&dev, &half_proj, &ape, &norm, &fr, 1e-6, true, &pos, &mut st)
                .is_err(),
            "values without gate logits"
        );
        let big_rope = f32s(&[9]);
        assert!(
            compressor_update(&dev, &proj, &ape, &norm, &big_rope, 1e-6, true, &pos, &mut st)
                .is_err()
        );

        // Batches: one position a token, each state buffer [T, ...], at most 16 sequences.
        let pos3 = dev.alloc::<u32>(DType::U32, &[3]).unwrap();
        let err = run_pos(&pos3, &mut sp, &mut out).unwrap_err().to_string();
        assert!(err.contains("3 positions for 2 tokens"), "{err}");
        let pos2 = dev.alloc::<u32>(DType::U32, &[2]).unwrap();
        let err = run_pos(&pos2, &mut sp, &mut out).unwrap_err().to_string();
        assert!(
            err.contains("a batch of 2 sequences needs [2, rows, cols]"),
            "{err}"
        );
        let err = compressor_update(&dev, &proj, &ape, &norm, &fr, 1e-6, true, &pos3, &mut st)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("compressor state kv: shape [4, 32] where [3, 4, 32] is needed"),
            "{err}"
        );
        let (q17, kv17, pos17) = (
            f32s(&[17, 4 * 32]),
            f32s(&[17, 32]),
            dev.alloc::<u32>(DType::U32, &[17]).unwrap(),
        );
        let rings = f32s(&[17, 16, 32]);
        let mut out17 = dev.alloc::<bf16>(DType::BF16, &[17, 4 * 32]).unwrap();
        let comp = Compressed::None;
        let err = attention(
            &dev, &q17, &kv17, &rings, comp, &sink, &pos17, &fr, &mut sp, &mut out17,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("a batch of 17 sequences (at most 16)"),
            "{err}"
        );
        dev.synchronize().unwrap();
    }
}
