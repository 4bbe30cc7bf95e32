//! CPU references of the attention kernels, on host slices in exactly the device layouts of
//! [`super`] (the window ring, the compressor state, entries, `selected` with −1). They are the
//! model's CPU forward (spec §5–§7): `dsv4_model::cpu` runs a chunk through
//! [`compressor_push`] (its entries grow without a capacity), [`index_topk`], [`attention`] and
//! [`window_write`]. Every token's value is computed the same way whatever the chunking.

use rayon::prelude::*;

use crate::gpu::router::reference::top_k;
use crate::gpu::rows::reference::{dot, rms_norm, rope_rotate};
use crate::gpu::rows::RopeDirection;

/// One head's sink attention: `o = Σ_j softmax_j(q·k_j·scale ∪ sink) k_j` (K = V).
pub fn attend_head(qh: &[f32], keys: &[&[f32]], sink: f32, scale: f32, o: &mut [f32]) {
    let scores: Vec<f32> = keys.iter().map(|k| dot(qh, k) * scale).collect();
    let mx = scores.iter().copied().fold(sink, f32::max);
    let probs: Vec<f32> = scores.iter().map(|x| (x - mx).exp()).collect();
    let denom = probs.iter().sum::<f32>() + (sink - mx).exp();
    o.fill(0.0);
    for (p, k) in probs.iter().zip(keys) {
        let p = p / denom;
        o.iter_mut().zip(k.iter()).for_each(|(o, v)| *o += p * v);
    }
}

/// [`attend_head`] for every head: `q` and `out` `[H, d]`, `sink [H]`, scale `1/sqrt(d)`.
pub fn attend(q: &[f32], keys: &[&[f32]], sink: &[f32], out: &mut [f32]) {
    let d = out.len() / sink.len();
    let scale = 1.0 / (d as f32).sqrt();
    out.par_chunks_mut(d)
        .zip(q.par_chunks(d))
        .zip(sink.par_iter())
        .for_each(|((o, qh), &s)| attend_head(qh, keys, s, scale, o));
}

/// Indexer score of one entry `key [c]`: `Σ_h max(q_h·key, 0) · (1/sqrt(c)) · w_h`, with
/// `q [nh·c]` and `weights [nh]` already scaled by `1/sqrt(nh)`.
pub fn index_score(q: &[f32], weights: &[f32], key: &[f32], c: usize) -> f32 {
    let scale = 1.0 / (c as f32).sqrt();
    q.chunks_exact(c)
        .zip(weights)
        .map(|(qh, w)| dot(qh, key).max(0.0) * scale * w)
        .sum()
}

/// [`index_score`] of every entry of `keys [n, c]`.
pub fn index_scores(q: &[f32], weights: &[f32], keys: &[f32], c: usize) -> Vec<f32> {
    keys.par_chunks_exact(c)
        .map(|k| index_score(q, weights, k, c))
        .collect()
}

/// One compressor entry (spec §6): per channel `j < c`, the softmax over the gate logits of the
/// window's rows weighting their values — `prev` (`(kv, gate)`, `[ratio, c]`, the previous
/// window's A-halves) first when given, then channel `b_off + j` of the current window's rows
/// `kv`, `gate` `[ratio, row_w]` — then the weighted RMSNorm and the forward RoPE at
/// `first_pos` on the last `2·inv_freq.len()` channels.
#[allow(clippy::too_many_arguments)]
pub fn pool_entry(
    prev: Option<(&[f32], &[f32])>,
    kv: &[f32],
    gate: &[f32],
    row_w: usize,
    b_off: usize,
    c: usize,
    norm: &[f32],
    eps: f32,
    inv_freq: &[f32],
    first_pos: usize,
) -> Vec<f32> {
    let m = kv.len() / row_w;
    let mut entry = vec![0.0f32; c];
    let mut logits = Vec::with_capacity(2 * m);
    let mut values = Vec::with_capacity(2 * m);
    for (j, out) in entry.iter_mut().enumerate() {
        logits.clear();
        values.clear();
        if let Some((pkv, pgate)) = prev {
            for r in 0..m {
                logits.push(pgate[r * c + j]);
                values.push(pkv[r * c + j]);
            }
        }
        for r in 0..m {
            logits.push(gate[r * row_w + b_off + j]);
            values.push(kv[r * row_w + b_off + j]);
        }
        let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = logits.iter().map(|z| (z - mx).exp()).sum();
        *out = logits
            .iter()
            .zip(&values)
            .map(|(z, v)| v * ((z - mx).exp() / sum))
            .sum();
    }
    rms_norm(&mut entry, Some(norm), eps);
    rope_rotate(&mut entry, inv_freq, first_pos, RopeDirection::Forward);
    entry
}

/// The host image of [`super::CompressorBuffers`]: `kv`, `gate` `[ratio, κ·c]`, `prev_kv`,
/// `prev_gate` `[ratio, c]`, `entries [capacity, c]`, zero-initialized like the pool.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressorHost {
    pub kv: Vec<f32>,
    pub gate: Vec<f32>,
    pub prev_kv: Vec<f32>,
    pub prev_gate: Vec<f32>,
    pub entries: Vec<f32>,
}

impl CompressorHost {
    pub fn new(ratio: usize, c: usize, overlap: bool, capacity: usize) -> CompressorHost {
        let kc = if overlap { 2 * c } else { c };
        CompressorHost {
            kv: vec![0.0; ratio * kc],
            gate: vec![0.0; ratio * kc],
            prev_kv: vec![0.0; ratio * c],
            prev_gate: vec![0.0; ratio * c],
            entries: vec![0.0; capacity * c],
        }
    }
}

/// One token's projections `kv`, `gate` `[κ·c]` at position `p` into the open window of `st`
/// (its `entries` untouched), as [`super::compressor_update`] stores them: gate + ape at row
/// `p % ratio` (ratio = `ape.len() / (κ·c)`, c = `norm.len()`). When `p` closes the window,
/// returns entry `(p + 1) / ratio − 1` ([`pool_entry`], with the previous window's A-halves
/// from the second entry on under overlap), then the current A-halves become the previous ones.
#[allow(clippy::too_many_arguments)]
pub fn compressor_push(
    kv: &[f32],
    gate: &[f32],
    ape: &[f32],
    norm: &[f32],
    inv_freq: &[f32],
    eps: f32,
    overlap: bool,
    p: usize,
    st: &mut CompressorHost,
) -> Option<Vec<f32>> {
    let c = norm.len();
    let kc = if overlap { 2 * c } else { c };
    let ratio = ape.len() / kc;
    let r = p % ratio;
    st.kv[r * kc..(r + 1) * kc].copy_from_slice(kv);
    for ((dst, g), a) in st.gate[r * kc..(r + 1) * kc]
        .iter_mut()
        .zip(gate)
        .zip(&ape[r * kc..(r + 1) * kc])
    {
        *dst = g + a;
    }
    if r + 1 < ratio {
        return None;
    }
    let e = (p + 1) / ratio - 1;
    let prev = (overlap && e > 0).then_some((&st.prev_kv[..], &st.prev_gate[..]));
    let b_off = if overlap { c } else { 0 };
    let entry = pool_entry(
        prev,
        &st.kv,
        &st.gate,
        kc,
        b_off,
        c,
        norm,
        eps,
        inv_freq,
        p + 1 - ratio,
    );
    if overlap {
        for r in 0..ratio {
            st.prev_kv[r * c..(r + 1) * c].copy_from_slice(&st.kv[r * kc..r * kc + c]);
            st.prev_gate[r * c..(r + 1) * c].copy_from_slice(&st.gate[r * kc..r * kc + c]);
        }
    }
    Some(entry)
}

/// [`super::compressor_update`]: tokens `kv_proj`, `gate_proj` `[T, κ·c]` at positions
/// `pos0..`, one by one through [`compressor_push`]; entries past the capacity are not written.
#[allow(clippy::too_many_arguments)]
pub fn compressor_update(
    kv_proj: &[f32],
    gate_proj: &[f32],
    ape: &[f32],
    norm: &[f32],
    inv_freq: &[f32],
    eps: f32,
    overlap: bool,
    pos0: usize,
    st: &mut CompressorHost,
) {
    let c = norm.len();
    let kc = if overlap { 2 * c } else { c };
    let ratio = ape.len() / kc;
    let cap = st.entries.len() / c;
    for (t, (kv, gate)) in kv_proj
        .chunks_exact(kc)
        .zip(gate_proj.chunks_exact(kc))
        .enumerate()
    {
        let p = pos0 + t;
        if let Some(entry) = compressor_push(kv, gate, ape, norm, inv_freq, eps, overlap, p, st) {
            let e = (p + 1) / ratio - 1;
            if e < cap {
                st.entries[e * c..(e + 1) * c].copy_from_slice(&entry);
            }
        }
    }
}

/// Entries visible to the query at position `p`: `min((p + 1) / ratio, capacity)`.
pub fn visible_entries(p: usize, ratio: usize, capacity: usize) -> usize {
    ((p + 1) / ratio).min(capacity)
}

/// Token `t`'s [`index_scores`] over its visible entries, for inputs laid out as
/// [`index_topk`] takes them (`weights` raw: scaled by 1/sqrt(nh) here, as the device does).
pub fn token_index_scores(
    q: &[f32],
    weights: &[f32],
    entries: &[f32],
    [nh, c, ratio, pos0]: [usize; 4],
    t: usize,
) -> Vec<f32> {
    let wscale = 1.0 / (nh as f32).sqrt();
    let n = visible_entries(pos0 + t, ratio, entries.len() / c);
    let w: Vec<f32> = weights[t * nh..(t + 1) * nh]
        .iter()
        .map(|v| v * wscale)
        .collect();
    index_scores(&q[t * nh * c..(t + 1) * nh * c], &w, &entries[..n * c], c)
}

/// One row of `selected`: the top-k of `scores` in ascending index order, −1 past them.
pub fn selection_row(scores: &[f32], k: usize) -> Vec<i32> {
    let mut row: Vec<i32> = top_k(scores, k).into_iter().map(|i| i as i32).collect();
    row.resize(k, -1);
    row
}

/// [`super::index_topk`]: `q [T, nh·c]`, raw `weights [T, nh]`, `entries [capacity, c]` →
/// `selected [T, k]` (ascending ids, −1 past the visible count).
#[allow(clippy::too_many_arguments)]
pub fn index_topk(
    q: &[f32],
    weights: &[f32],
    entries: &[f32],
    nh: usize,
    c: usize,
    ratio: usize,
    pos0: usize,
    k: usize,
) -> Vec<i32> {
    (0..weights.len() / nh)
        .into_par_iter()
        .flat_map_iter(|t| {
            let scores = token_index_scores(q, weights, entries, [nh, c, ratio, pos0], t);
            selection_row(&scores, k)
        })
        .collect()
}

/// The compressed keys of [`attention`], on the host.
#[derive(Clone, Copy, Debug)]
pub enum HostCompressed<'a> {
    None,
    /// `entries [capacity, d]`: every visible one.
    All {
        entries: &'a [f32],
        ratio: usize,
    },
    /// `entries [capacity, d]`, `selected [T, k]` (−1 = none; every slot is read, so a
    /// selection as the indexer's top-k leaves it, −1 past the visible count, matches the
    /// device's reading of only the first min(k, visible) slots).
    Selected {
        entries: &'a [f32],
        selected: &'a [i32],
        k: usize,
    },
}

/// [`super::attention`]: `q [T, H·d]`, `kv [T, d]`, ring `window [W, d]`, `sink [H]`.
pub fn attention(
    q: &[f32],
    kv: &[f32],
    window: &[f32],
    d: usize,
    compressed: HostCompressed<'_>,
    sink: &[f32],
    pos0: usize,
) -> Vec<f32> {
    let hd = sink.len() * d;
    let t_count = kv.len() / d;
    let w = window.len() / d;
    let mut out = vec![0.0f32; t_count * hd];
    out.par_chunks_mut(hd).enumerate().for_each(|(t, o)| {
        let p = pos0 + t;
        let first = (p + 1).saturating_sub(w);
        let mut keys: Vec<&[f32]> = (first..=p)
            .map(|kp| {
                if kp >= pos0 {
                    &kv[(kp - pos0) * d..(kp - pos0 + 1) * d]
                } else {
                    let s = kp % w;
                    &window[s * d..(s + 1) * d]
                }
            })
            .collect();
        match compressed {
            HostCompressed::None => {}
            HostCompressed::All { entries, ratio } => {
                let n = visible_entries(p, ratio, entries.len() / d);
                keys.extend(entries[..n * d].chunks_exact(d));
            }
            HostCompressed::Selected {
                entries,
                selected,
                k,
            } => {
                let cap = entries.len() / d;
                keys.extend(
                    selected[t * k..(t + 1) * k]
                        .iter()
                        .filter(|&&id| id >= 0 && (id as usize) < cap)
                        .map(|&id| &entries[id as usize * d..(id as usize + 1) * d]),
                );
            }
        }
        attend(&q[t * hd..(t + 1) * hd], &keys, sink, o);
    });
    out
}

/// [`super::window_write`]: ring slot `(pos0 + t) % W` takes `kv[t]` (the last rows win).
pub fn window_write(kv: &[f32], d: usize, pos0: usize, window: &mut [f32]) {
    let w = window.len() / d;
    for (t, row) in kv.chunks_exact(d).enumerate() {
        let s = (pos0 + t) % w;
        window[s * d..(s + 1) * d].copy_from_slice(row);
    }
}
