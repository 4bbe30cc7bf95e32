//! Tests of the attention kernels and their CPU references.
//!
//! CPU tests: the device-layout references, fed in random chunks, agree bit for bit with a
//! token-by-token transcription of the model's CPU forward (`Window`, `attend`,
//! `CompressorState::push`/`emit`, `index_scores`, `top_k`), plus hand-checked cases.
//!
//! GPU tests (`#[ignore]`d: `cargo xtask gpu-test`), launcher against reference on fresh random
//! inputs and shapes, state carried over consecutive chunks:
//! - compressor state rows and prev halves bit-exact (copies and one addition); entries within
//!   1e-5 of the entries' largest magnitude (expf, the norm's block sum and sincospi differ by
//!   ulps from the CPU);
//! - indexer scores of the visible entries bit-exact (the kernel keeps the CPU's operation
//!   order), so `selected` is exactly equal, ties included;
//! - attention outputs within 1e-5 of the output's largest magnitude (online softmax in another
//!   order);
//! - the window ring bit-exact.

use rand::rngs::StdRng;
use rand::Rng;

use super::reference::{self as cpu, CompressorHost, HostCompressed};
use super::*;
use crate::gpu::router::reference::top_k;
use crate::gpu::rows::reference::{dot, rms_norm, rope_rotate};
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

// ---- a transcription of the model's CPU forward (crates/dsv4-model/src/cpu) ----

struct ModelWindow {
    size: usize,
    width: usize,
    data: Vec<f32>,
}

impl ModelWindow {
    fn push(&mut self, pos: usize, kv: &[f32]) {
        let slot = pos % self.size;
        self.data[slot * self.width..(slot + 1) * self.width].copy_from_slice(kv);
    }
    fn visible(&self, pos: usize) -> Vec<&[f32]> {
        let first = (pos + 1).saturating_sub(self.size);
        (first..=pos)
            .map(|p| {
                let slot = p % self.size;
                &self.data[slot * self.width..(slot + 1) * self.width]
            })
            .collect()
    }
}

fn model_attend(q: &[f32], keys: &[&[f32]], sink: &[f32], out: &mut [f32]) {
    let d = keys.first().map_or(out.len() / sink.len(), |k| k.len());
    let scale = 1.0 / (d as f32).sqrt();
    for ((o, qh), &s) in out.chunks_mut(d).zip(q.chunks(d)).zip(sink) {
        let scores: Vec<f32> = keys.iter().map(|k| dot(qh, k) * scale).collect();
        let mx = scores.iter().copied().fold(s, f32::max);
        let probs: Vec<f32> = scores.iter().map(|x| (x - mx).exp()).collect();
        let denom = probs.iter().sum::<f32>() + (s - mx).exp();
        o.fill(0.0);
        for (p, k) in probs.iter().zip(keys) {
            let p = p / denom;
            o.iter_mut().zip(k.iter()).for_each(|(o, v)| *o += p * v);
        }
    }
}

fn model_index_scores(q: &[f32], weights: &[f32], keys: &[f32], c: usize) -> Vec<f32> {
    let scale = 1.0 / (c as f32).sqrt();
    keys.chunks(c)
        .map(|k| {
            q.chunks_exact(c)
                .zip(weights)
                .map(|(qh, w)| dot(qh, k).max(0.0) * scale * w)
                .sum()
        })
        .collect()
}

struct ModelCompressor {
    ratio: usize,
    width: usize,
    overlap: bool,
    ape: Vec<f32>,
    norm: Vec<f32>,
    inv_freq: Vec<f32>,
    kv: Vec<f32>,
    gate: Vec<f32>,
    prev: Option<(Vec<f32>, Vec<f32>)>,
    entries: Vec<f32>,
}

impl ModelCompressor {
    fn new(rng: &mut StdRng, ratio: usize, width: usize, overlap: bool, half: usize) -> Self {
        let k = if overlap { 2 } else { 1 };
        ModelCompressor {
            ratio,
            width,
            overlap,
            ape: uniform(rng, ratio * k * width, -1.0, 1.0),
            norm: uniform(rng, width, 0.5, 1.5),
            inv_freq: inv_freq(half),
            kv: vec![0.0; ratio * k * width],
            gate: vec![0.0; ratio * k * width],
            prev: None,
            entries: Vec::new(),
        }
    }

    fn push(&mut self, kv: &[f32], gate: &[f32], pos: usize, eps: f32) {
        let row_w = kv.len();
        let r = pos % self.ratio;
        self.kv[r * row_w..(r + 1) * row_w].copy_from_slice(kv);
        let ape = &self.ape[r * row_w..(r + 1) * row_w];
        for ((dst, g), a) in self.gate[r * row_w..(r + 1) * row_w]
            .iter_mut()
            .zip(gate)
            .zip(ape)
        {
            *dst = g + a;
        }
        if r + 1 == self.ratio {
            self.emit(pos + 1 - self.ratio, eps);
        }
    }

    fn emit(&mut self, first_pos: usize, eps: f32) {
        let (m, c) = (self.ratio, self.width);
        let row_w = if self.overlap { 2 * c } else { c };
        let b_off = if self.overlap { c } else { 0 };
        let mut entry = vec![0.0f32; c];
        let mut logits = Vec::with_capacity(2 * m);
        let mut values = Vec::with_capacity(2 * m);
        for (j, out) in entry.iter_mut().enumerate() {
            logits.clear();
            values.clear();
            if let Some((pkv, pgate)) = &self.prev {
                for r in 0..m {
                    logits.push(pgate[r * c + j]);
                    values.push(pkv[r * c + j]);
                }
            }
            for r in 0..m {
                logits.push(self.gate[r * row_w + b_off + j]);
                values.push(self.kv[r * row_w + b_off + j]);
            }
            let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = logits.iter().map(|z| (z - mx).exp()).sum();
            *out = logits
                .iter()
                .zip(&values)
                .map(|(z, v)| v * ((z - mx).exp() / sum))
                .sum();
        }
        rms_norm(&mut entry, Some(&self.norm), eps);
        rope_rotate(
            &mut entry,
            &self.inv_freq,
            first_pos,
            RopeDirection::Forward,
        );
        self.entries.extend_from_slice(&entry);
        if self.overlap {
            let a_half = |buf: &[f32]| {
                buf.chunks_exact(row_w)
                    .flat_map(|row| &row[..c])
                    .copied()
                    .collect::<Vec<_>>()
            };
            self.prev = Some((a_half(&self.kv), a_half(&self.gate)));
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Sliding,
    Hca,
    Csa,
}

/// A layer's attention over `total` tokens, token by token as the model runs it, and through
/// the device-layout references in random chunks; the outputs and entries must be identical.
fn layer_agrees(rng: &mut StdRng, kind: Kind) {
    let (h, d, w, eps) = (4, 32, 16, 1e-6f32);
    let (ic, nh, k) = (16, 4, 8);
    let ratio = match kind {
        Kind::Hca => rng.random_range(2..9),
        _ => 4,
    };
    let half = 4;
    let total = rng.random_range(1..120);
    let hd = h * d;
    let q = uniform(rng, total * hd, -2.0, 2.0);
    let kv = uniform(rng, total * d, -1.0, 1.0);
    let sink = uniform(rng, h, -1.0, 1.0);
    let overlap = kind == Kind::Csa;
    let kc = if overlap { 2 * d } else { d };
    let ckv = uniform(rng, total * kc, -1.0, 1.0);
    let cgate = uniform(rng, total * kc, -2.0, 2.0);
    let iq = uniform(rng, total * nh * ic, -1.0, 1.0);
    let iw = uniform(rng, total * nh, -1.0, 1.0);
    let ikv = uniform(rng, total * 2 * ic, -1.0, 1.0);
    let igate = uniform(rng, total * 2 * ic, -2.0, 2.0);
    let mut comp = ModelCompressor::new(rng, ratio, d, overlap, half);
    let mut icomp = ModelCompressor::new(rng, 4, ic, true, half);

    // The model, token by token.
    let mut window = ModelWindow {
        size: w,
        width: d,
        data: vec![0.0; w * d],
    };
    let mut want = vec![0.0f32; total * hd];
    let iscale = 1.0 / (nh as f32).sqrt();
    for pos in 0..total {
        window.push(pos, &kv[pos * d..(pos + 1) * d]);
        if kind != Kind::Sliding {
            comp.push(
                &ckv[pos * kc..(pos + 1) * kc],
                &cgate[pos * kc..(pos + 1) * kc],
                pos,
                eps,
            );
        }
        let mut keys = window.visible(pos);
        let entries: Vec<&[f32]> = comp.entries.chunks_exact(d).collect();
        match kind {
            Kind::Csa => {
                icomp.push(
                    &ikv[pos * 2 * ic..(pos + 1) * 2 * ic],
                    &igate[pos * 2 * ic..(pos + 1) * 2 * ic],
                    pos,
                    eps,
                );
                let wts: Vec<f32> = iw[pos * nh..(pos + 1) * nh]
                    .iter()
                    .map(|v| v * iscale)
                    .collect();
                let scores = model_index_scores(
                    &iq[pos * nh * ic..(pos + 1) * nh * ic],
                    &wts,
                    &icomp.entries,
                    ic,
                );
                keys.extend(top_k(&scores, k).into_iter().map(|e| entries[e]));
            }
            Kind::Hca => keys.extend(entries),
            Kind::Sliding => {}
        }
        model_attend(
            &q[pos * hd..(pos + 1) * hd],
            &keys,
            &sink,
            &mut want[pos * hd..(pos + 1) * hd],
        );
    }

    // The references, chunk by chunk, in the device layouts.
    let cap = total / ratio + 2;
    let mut st = CompressorHost::new(ratio, d, overlap, cap);
    let mut ist = CompressorHost::new(4, ic, true, total / 4 + 2);
    let mut ring = uniform(rng, w * d, -9.0, 9.0); // never read before it is written
    let mut got = vec![0.0f32; total * hd];
    let mut pos0 = 0;
    for t in chunks(rng, total) {
        let r = pos0..pos0 + t;
        let selected;
        let compressed = match kind {
            Kind::Sliding => HostCompressed::None,
            _ => {
                cpu::compressor_update(
                    &ckv[r.start * kc..r.end * kc],
                    &cgate[r.start * kc..r.end * kc],
                    &comp.ape,
                    &comp.norm,
                    &comp.inv_freq,
                    eps,
                    overlap,
                    pos0,
                    &mut st,
                );
                if kind == Kind::Hca {
                    HostCompressed::All {
                        entries: &st.entries,
                        ratio,
                    }
                } else {
                    cpu::compressor_update(
                        &ikv[r.start * 2 * ic..r.end * 2 * ic],
                        &igate[r.start * 2 * ic..r.end * 2 * ic],
                        &icomp.ape,
                        &icomp.norm,
                        &icomp.inv_freq,
                        eps,
                        true,
                        pos0,
                        &mut ist,
                    );
                    selected = cpu::index_topk(
                        &iq[r.start * nh * ic..r.end * nh * ic],
                        &iw[r.start * nh..r.end * nh],
                        &ist.entries,
                        nh,
                        ic,
                        4,
                        pos0,
                        k,
                    );
                    HostCompressed::Selected {
                        entries: &st.entries,
                        selected: &selected,
                        k,
                    }
                }
            }
        };
        let out = cpu::attention(
            &q[r.start * hd..r.end * hd],
            &kv[r.start * d..r.end * d],
            &ring,
            d,
            compressed,
            &sink,
            pos0,
        );
        got[r.start * hd..r.end * hd].copy_from_slice(&out);
        cpu::window_write(&kv[r.start * d..r.end * d], d, pos0, &mut ring);
        pos0 += t;
    }
    assert_eq!(got, want, "{kind:?} ratio {ratio}, {total} tokens");
    let n = comp.entries.len();
    assert_eq!(&st.entries[..n], &comp.entries[..], "{kind:?} entries");
    assert!(st.entries[n..].iter().all(|&v| v == 0.0));
    assert_eq!(&ist.entries[..icomp.entries.len()], &icomp.entries[..]);
}

#[test]
fn attention_references_match_the_model_token_by_token() {
    let mut rng = crate::gpu::testing::rng("attention_references_match_the_model_token_by_token");
    for _ in 0..6 {
        for kind in [Kind::Sliding, Kind::Hca, Kind::Csa] {
            layer_agrees(&mut rng, kind);
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

// ---- GPU ----

mod gpu {
    use super::*;
    use crate::gpu::testing::{assert_bits_eq, device, rng, POISON};

    fn poisoned<T: crate::gpu::DeviceElem>(
        dev: &Device,
        dtype: DType,
        shape: &[usize],
    ) -> DeviceTensor<T> {
        let mut t = dev.alloc(dtype, shape).unwrap();
        dev.fill_bytes(&mut t, POISON).unwrap();
        t
    }

    fn position(dev: &Device, p: usize) -> DeviceTensor<u32> {
        dev.upload(DType::U32, &[1], &[p as u32]).unwrap()
    }

    /// |got − want| ≤ rel · max |want| (and no NaN).
    fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= rel * scale,
                "{what}: element {i}: got {g}, want {w} (bound {rel} × {scale})"
            );
        }
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
            let mut st = CompressorBuffers {
                kv: dev.alloc(DType::F32, &[ratio, kc]).unwrap(),
                gate: dev.alloc(DType::F32, &[ratio, kc]).unwrap(),
                prev_kv: dev.alloc(DType::F32, &[ratio, c]).unwrap(),
                prev_gate: dev.alloc(DType::F32, &[ratio, c]).unwrap(),
                entries: dev.alloc(DType::F32, &[cap, c]).unwrap(),
            };
            let mut host = CompressorHost::new(ratio, c, overlap, cap);
            let mut pos0 = 0;
            for t in chunks(&mut rng, total) {
                let kv = uniform(&mut rng, t * kc, -1.0, 1.0);
                let gate = uniform(&mut rng, t * kc, -3.0, 3.0);
                let kv_d = dev.upload(DType::F32, &[t, kc], &kv).unwrap();
                let gate_d = dev.upload(DType::F32, &[t, kc], &gate).unwrap();
                let pos = position(&dev, pos0);
                compressor_update(
                    &dev, &kv_d, &gate_d, &ape_d, &norm_d, &f_d, eps, overlap, &pos, &mut st,
                )
                .unwrap();
                cpu::compressor_update(&kv, &gate, &ape, &norm, &f, eps, overlap, pos0, &mut host);
                let what = format!("ratio {ratio} c {c} overlap {overlap} chunk {pos0}+{t}");
                assert_bits_eq(
                    &format!("{what} kv"),
                    &dev.download(&st.kv).unwrap(),
                    &host.kv,
                );
                assert_bits_eq(
                    &format!("{what} gate"),
                    &dev.download(&st.gate).unwrap(),
                    &host.gate,
                );
                if overlap {
                    assert_bits_eq(
                        &format!("{what} prev kv"),
                        &dev.download(&st.prev_kv).unwrap(),
                        &host.prev_kv,
                    );
                    assert_bits_eq(
                        &format!("{what} prev gate"),
                        &dev.download(&st.prev_gate).unwrap(),
                        &host.prev_gate,
                    );
                }
                assert_close(
                    &format!("{what} entries"),
                    &dev.download(&st.entries).unwrap(),
                    &host.entries,
                    1e-5,
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
            (33, 20, 5, 50, 3, 100),
            (1, 4, 3, 10, 2, 30),
        ];
        for (iter, (nh, c, k, cap, ratio, max_pos)) in configs.into_iter().enumerate() {
            for round in 0..3 {
                let t = rng.random_range(1..=16usize);
                // Position 0, a position with fewer visible entries than k, and any.
                let pos0 = match round {
                    0 => 0,
                    1 => rng.random_range(0..(k * ratio).min(max_pos) + 1),
                    _ => rng.random_range(0..max_pos + 1),
                };
                let q = uniform(&mut rng, t * nh * c, -1.0, 1.0);
                let w = uniform(&mut rng, t * nh, -1.0, 1.0);
                let entries = uniform(&mut rng, cap * c, -1.0, 1.0);
                let qd = dev.upload(DType::F32, &[t, nh * c], &q).unwrap();
                let wd = dev.upload(DType::F32, &[t, nh], &w).unwrap();
                let ed = dev.upload(DType::F32, &[cap, c], &entries).unwrap();
                let pos = position(&dev, pos0);
                let mut scores = poisoned::<f32>(&dev, DType::F32, &[t, cap]);
                let mut sel = poisoned::<i32>(&dev, DType::I32, &[t, k]);
                index_topk(&dev, &qd, &wd, &ed, ratio, &pos, &mut scores, &mut sel).unwrap();
                let want = cpu::index_topk(&q, &w, &entries, nh, c, ratio, pos0, k);
                let what = format!("config {iter} round {round}: T {t} at {pos0}");
                // The scores of the visible entries are the CPU's, bit for bit.
                let got_scores = dev.download(&scores).unwrap();
                let wscale = 1.0 / (nh as f32).sqrt();
                for tt in 0..t {
                    let n = cpu::visible_entries(pos0 + tt, ratio, cap);
                    let ws: Vec<f32> = w[tt * nh..(tt + 1) * nh]
                        .iter()
                        .map(|v| v * wscale)
                        .collect();
                    let s = cpu::index_scores(
                        &q[tt * nh * c..(tt + 1) * nh * c],
                        &ws,
                        &entries[..n * c],
                        c,
                    );
                    assert_bits_eq(
                        &format!("{what} token {tt} scores"),
                        &got_scores[tt * cap..tt * cap + n],
                        &s,
                    );
                }
                assert_eq!(dev.download(&sel).unwrap(), want, "{what}");
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_index_topk_breaks_ties_to_the_lowest_index() {
        let dev = device();
        // Entries that repeat: many exact ties, and all-negative dots (score -0.0 or +0.0).
        let (nh, c, k, cap, t) = (4, 8, 7, 64, 3);
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
        for pos0 in [0, 5, 20, 63, 100] {
            let qd = dev.upload(DType::F32, &[t, nh * c], &q).unwrap();
            let wd = dev.upload(DType::F32, &[t, nh], &w).unwrap();
            let ed = dev.upload(DType::F32, &[cap, c], &entries).unwrap();
            let pos = position(&dev, pos0);
            let mut scores = poisoned::<f32>(&dev, DType::F32, &[t, cap]);
            let mut sel = poisoned::<i32>(&dev, DType::I32, &[t, k]);
            index_topk(&dev, &qd, &wd, &ed, 1, &pos, &mut scores, &mut sel).unwrap();
            let want = cpu::index_topk(&q, &w, &entries, nh, c, 1, pos0, k);
            assert_eq!(dev.download(&sel).unwrap(), want, "position {pos0}");
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
        for iter in 0..30 {
            let (h, d, w) = shapes[iter % shapes.len()];
            let mode = iter % 3; // none, all, selected
            let t = rng.random_range(1..=16usize);
            let pos0 = match iter % 4 {
                0 => 0,
                1 => rng.random_range(0..w + 1),
                2 => rng.random_range(w..3 * w + 20),
                _ => rng.random_range(0..5000),
            };
            let hd = h * d;
            let qscale = rng.random_range(0.5..4.0);
            let q = uniform(&mut rng, t * hd, -qscale, qscale);
            let kv = uniform(&mut rng, t * d, -1.0, 1.0);
            let ring = uniform(&mut rng, w * d, -1.0, 1.0);
            let sink = uniform(&mut rng, h, -2.0, 4.0);
            let ratio = [4, 128, 1, 3][rng.random_range(0..4)];
            let full = (pos0 + t) / ratio;
            // Capacity clipping now and then; zero visible entries at small positions.
            let cap = if rng.random_bool(0.3) {
                (full / 2).max(1)
            } else {
                full + 3
            };
            let entries = uniform(&mut rng, cap * d, -1.0, 1.0);
            let k = [8, 512, 3][rng.random_range(0..3)];
            let selected: Vec<i32> = (0..t)
                .flat_map(|tt| {
                    let n = cpu::visible_entries(pos0 + tt, ratio, cap);
                    let mut ids: Vec<i32> = (0..n as i32).collect();
                    // A random subset, in ascending order, -1 after it.
                    ids.retain(|_| rng.random_bool(0.6));
                    ids.truncate(k);
                    ids.resize(k, -1);
                    ids
                })
                .collect();
            let qd = dev.upload(DType::F32, &[t, hd], &q).unwrap();
            let kvd = dev.upload(DType::F32, &[t, d], &kv).unwrap();
            let rd = dev.upload(DType::F32, &[w, d], &ring).unwrap();
            let sd = dev.upload(DType::F32, &[h], &sink).unwrap();
            let ed = dev.upload(DType::F32, &[cap, d], &entries).unwrap();
            let seld = dev.upload(DType::I32, &[t, k], &selected).unwrap();
            let pos = position(&dev, pos0);
            let (dc, hc) = match mode {
                0 => (Compressed::None, HostCompressed::None),
                1 => (
                    Compressed::All {
                        entries: &ed,
                        ratio,
                    },
                    HostCompressed::All {
                        entries: &entries,
                        ratio,
                    },
                ),
                _ => (
                    Compressed::Selected {
                        entries: &ed,
                        selected: &seld,
                    },
                    HostCompressed::Selected {
                        entries: &entries,
                        selected: &selected,
                        k,
                    },
                ),
            };
            let mut out = poisoned::<f32>(&dev, DType::F32, &[t, hd]);
            attention(&dev, &qd, &kvd, &rd, dc, &sd, &pos, &mut out).unwrap();
            let want = cpu::attention(&q, &kv, &ring, d, hc, &sink, pos0);
            let got = dev.download(&out).unwrap();
            let what = format!("iter {iter}: H {h} d {d} W {w} mode {mode} T {t} at {pos0}");
            for tt in 0..t {
                assert_close(
                    &format!("{what} token {tt}"),
                    &got[tt * hd..(tt + 1) * hd],
                    &want[tt * hd..(tt + 1) * hd],
                    1e-5,
                );
            }
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
        let bufs = |c: usize, cap: usize| CompressorBuffers {
            kv: dev.alloc(DType::F32, &[ratio, 2 * c]).unwrap(),
            gate: dev.alloc(DType::F32, &[ratio, 2 * c]).unwrap(),
            prev_kv: dev.alloc(DType::F32, &[ratio, c]).unwrap(),
            prev_gate: dev.alloc(DType::F32, &[ratio, c]).unwrap(),
            entries: dev.alloc(DType::F32, &[cap, c]).unwrap(),
        };
        let (mut st, mut ist) = (bufs(d, cap), bufs(ic, icap));
        let mut ring_d = dev.alloc::<f32>(DType::F32, &[w, d]).unwrap();
        let mut host = CompressorHost::new(ratio, d, true, cap);
        let mut ihost = CompressorHost::new(ratio, ic, true, icap);
        let mut ring = vec![0.0f32; w * d];
        let mut pos0 = 0;
        let mut compared = 0;
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
            compressor_update(
                &dev,
                &up(&ckv, &[t, 2 * d]),
                &up(&cg, &[t, 2 * d]),
                &aped,
                &normd,
                &fd,
                eps,
                true,
                &pos,
                &mut st,
            )
            .unwrap();
            compressor_update(
                &dev,
                &up(&ikv, &[t, 2 * ic]),
                &up(&ig, &[t, 2 * ic]),
                &iaped,
                &inormd,
                &fd,
                eps,
                true,
                &pos,
                &mut ist,
            )
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
                &mut scores,
                &mut sel,
            )
            .unwrap();
            let kvd = up(&kv, &[t, d]);
            let mut out = poisoned::<f32>(&dev, DType::F32, &[t, hd]);
            let comp = Compressed::Selected {
                entries: &st.entries,
                selected: &sel,
            };
            attention(
                &dev,
                &up(&q, &[t, hd]),
                &kvd,
                &ring_d,
                comp,
                &sd,
                &pos,
                &mut out,
            )
            .unwrap();
            window_write(&dev, &kvd, &pos, &mut ring_d).unwrap();

            cpu::compressor_update(&ckv, &cg, &ape, &norm, &f, eps, true, pos0, &mut host);
            cpu::compressor_update(&ikv, &ig, &iape, &inorm, &f, eps, true, pos0, &mut ihost);
            let want_sel = cpu::index_topk(&iq, &iw, &ihost.entries, nh, ic, ratio, pos0, k);
            let got_sel = dev.download(&sel).unwrap();
            // The entries differ from the CPU's by ulps, so a near-tie at the cut may pick
            // differently; such chunks are checked with the device's own selection.
            let what = format!("chunk {pos0}+{t}");
            if got_sel != want_sel {
                println!("{what}: selection differs from the CPU's (near-tie), using the device's");
            } else {
                compared += 1;
            }
            let want = cpu::attention(
                &q,
                &kv,
                &ring,
                d,
                HostCompressed::Selected {
                    entries: &host.entries,
                    selected: &got_sel,
                    k,
                },
                &sink,
                pos0,
            );
            assert_close(&what, &dev.download(&out).unwrap(), &want, 1e-5);
            cpu::window_write(&kv, d, pos0, &mut ring);
            assert_bits_eq(
                &format!("{what} ring"),
                &dev.download(&ring_d).unwrap(),
                &ring,
            );
            pos0 += t;
        }
        assert!(compared > 0, "every chunk's selection differed");
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_attention_launchers_reject_bad_shapes() {
        let dev = device();
        let pos = position(&dev, 0);
        let f32s = |s: &[usize]| dev.alloc::<f32>(DType::F32, s).unwrap();
        let (q, kv, ring, sink) = (
            f32s(&[2, 4 * 32]),
            f32s(&[2, 32]),
            f32s(&[16, 32]),
            f32s(&[4]),
        );
        let mut out = f32s(&[2, 4 * 32]);
        attention(
            &dev,
            &q,
            &kv,
            &ring,
            Compressed::None,
            &sink,
            &pos,
            &mut out,
        )
        .unwrap();
        let bad_d = f32s(&[2, 48]);
        assert!(attention(
            &dev,
            &f32s(&[2, 96]),
            &bad_d,
            &ring,
            Compressed::None,
            &sink,
            &pos,
            &mut out
        )
        .is_err());
        let bad_sink = f32s(&[3]);
        assert!(attention(
            &dev,
            &q,
            &kv,
            &ring,
            Compressed::None,
            &bad_sink,
            &pos,
            &mut out
        )
        .is_err());
        let sel = dev.alloc::<i32>(DType::I32, &[3, 8]).unwrap();
        let entries = f32s(&[10, 32]);
        let comp = Compressed::Selected {
            entries: &entries,
            selected: &sel,
        };
        assert!(attention(&dev, &q, &kv, &ring, comp, &sink, &pos, &mut out).is_err());

        let (iq, iw, ie) = (f32s(&[2, 4 * 16]), f32s(&[2, 4]), f32s(&[10, 16]));
        let mut scores = f32s(&[2, 10]);
        let mut sel = dev.alloc::<i32>(DType::I32, &[2, 3]).unwrap();
        index_topk(&dev, &iq, &iw, &ie, 4, &pos, &mut scores, &mut sel).unwrap();
        let mut bad_scores = f32s(&[2, 9]);
        assert!(index_topk(&dev, &iq, &iw, &ie, 4, &pos, &mut bad_scores, &mut sel).is_err());
        assert!(index_topk(&dev, &iq, &iw, &ie, 0, &pos, &mut scores, &mut sel).is_err());

        let mut st = CompressorBuffers {
            kv: f32s(&[4, 32]),
            gate: f32s(&[4, 32]),
            prev_kv: f32s(&[4, 16]),
            prev_gate: f32s(&[4, 16]),
            entries: f32s(&[8, 16]),
        };
        let (ckv, ape, norm, fr) = (f32s(&[3, 32]), f32s(&[4, 32]), f32s(&[16]), f32s(&[4]));
        compressor_update(
            &dev, &ckv, &ckv, &ape, &norm, &fr, 1e-6, true, &pos, &mut st,
        )
        .unwrap();
        assert!(
            compressor_update(&dev, &ckv, &ckv, &ape, &norm, &fr, 1e-6, false, &pos, &mut st)
                .is_err(),
            "κ·c without overlap"
        );
        let big_rope = f32s(&[9]);
        assert!(compressor_update(
            &dev, &ckv, &ckv, &ape, &norm, &big_rope, 1e-6, true, &pos, &mut st
        )
        .is_err());
        dev.synchronize().unwrap();
    }
}
