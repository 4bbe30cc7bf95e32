//! Token compressors (spec §6): every `ratio` tokens become one pooled, normalized, rotated
//! entry. CSA compressors (overlap) pool the previous window's A-half with the current
//! window's B-half; HCA compressors pool one window.

use super::ops::rms_norm;
use crate::rope::Rope;
use crate::weights::CompressorWeights;

/// Open-window buffers and emitted entries of one compressor for one sequence.
pub struct CompressorState {
    ratio: usize,
    width: usize,
    overlap: bool,
    /// Projections (gate logits already include `ape`) of the open window, `[ratio, κ·c]`.
    kv: Vec<f32>,
    gate: Vec<f32>,
    /// A-halves of the last closed window, `[ratio, c]`; absent before the first entry.
    prev: Option<(Vec<f32>, Vec<f32>)>,
    entries: Vec<f32>,
}

impl CompressorState {
    pub fn new(w: &CompressorWeights) -> CompressorState {
        let k = if w.overlap { 2 } else { 1 };
        CompressorState {
            ratio: w.ratio,
            width: w.width,
            overlap: w.overlap,
            kv: vec![0.0; w.ratio * k * w.width],
            gate: vec![0.0; w.ratio * k * w.width],
            prev: None,
            entries: Vec::new(),
        }
    }

    /// All entries, `[len, c]`.
    pub fn entries(&self) -> &[f32] {
        &self.entries
    }

    /// Adds token `pos`'s projections; closes the window (emitting an entry) when `pos` is its
    /// last token, so the entry is visible to that token's own attention (spec §6.5).
    pub fn push(
        &mut self,
        w: &CompressorWeights,
        kv: &[f32],
        gate: &[f32],
        pos: usize,
        rope: &Rope,
        eps: f32,
    ) {
        let row_w = kv.len();
        let r = pos % self.ratio;
        self.kv[r * row_w..(r + 1) * row_w].copy_from_slice(kv);
        let ape = &w.ape[r * row_w..(r + 1) * row_w];
        for ((dst, g), a) in self.gate[r * row_w..(r + 1) * row_w]
            .iter_mut()
            .zip(gate)
            .zip(ape)
        {
            *dst = g + a;
        }
        if r + 1 == self.ratio {
            self.emit(w, pos + 1 - self.ratio, rope, eps);
        }
    }

    fn emit(&mut self, w: &CompressorWeights, first_pos: usize, rope: &Rope, eps: f32) {
        let (m, c) = (self.ratio, self.width);
        let row_w = if self.overlap { 2 * c } else { c };
        // B-half (or the whole row without overlap) of the current window.
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
        rms_norm(&mut entry, Some(&w.norm), eps);
        rope.apply(&mut entry, first_pos, false);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Blob;
    use crate::config::RopeConfig;
    use crate::linear::{Linear, LinearData};

    fn weights(ratio: usize, width: usize, overlap: bool) -> CompressorWeights {
        let out = if overlap { 2 * width } else { width };
        // The projections are not used by `push`; the state only sees their outputs.
        let zero =
            || Linear::new(out, 1, LinearData::F32(Blob::from_vec(vec![0; out * 4]))).unwrap();
        CompressorWeights {
            wkv: zero(),
            wgate: zero(),
            ape: (0..ratio * out).map(|i| (i % 5) as f32 * 0.1).collect(),
            norm: vec![1.0; width],
            ratio,
            width,
            overlap,
        }
    }

    /// Pooled value of one channel: softmax of `logits` weighting `values`.
    fn pool(logits: &[f32], values: &[f32]) -> f32 {
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = logits.iter().map(|z| (z - m).exp()).sum();
        logits
            .iter()
            .zip(values)
            .map(|(z, v)| v * (z - m).exp() / s)
            .sum()
    }

    fn normalized(mut v: Vec<f32>) -> Vec<f32> {
        rms_norm(&mut v, None, 1e-6);
        v
    }

    /// Deterministic per-token projections: `[kv | gate]` rows of width `row`.
    fn token(pos: usize, row: usize) -> (Vec<f32>, Vec<f32>) {
        let kv = (0..row)
            .map(|j| ((pos * 7 + j * 3) % 11) as f32 - 5.0)
            .collect();
        let gate = (0..row).map(|j| ((pos * 5 + j) % 7) as f32 * 0.3).collect();
        (kv, gate)
    }

    #[test]
    fn hca_pools_each_window_once_when_it_closes() {
        let (m, c) = (3, 2);
        let w = weights(m, c, false);
        let rope = Rope::new(
            &RopeConfig {
                theta: 10000.0,
                yarn: None,
            },
            2,
        );
        let mut st = CompressorState::new(&w);
        for pos in 0..7 {
            let (kv, gate) = token(pos, c);
            st.push(&w, &kv, &gate, pos, &rope, 1e-6);
            assert_eq!(
                st.entries().len() / c,
                (pos + 1) / m,
                "entries after token {pos}"
            );
        }
        // Entry 1 pools tokens 3..6 (rope at position 3 rotates the only pair).
        let mut want = Vec::new();
        for j in 0..c {
            let logits: Vec<f32> = (3..6)
                .map(|p| token(p, c).1[j] + w.ape[(p % m) * c + j])
                .collect();
            let values: Vec<f32> = (3..6).map(|p| token(p, c).0[j]).collect();
            want.push(pool(&logits, &values));
        }
        let mut want = normalized(want);
        rope.apply(&mut want, 3, false);
        for (g, w) in st.entries()[c..2 * c].iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
    }

    #[test]
    fn csa_entry_pools_previous_a_half_and_current_b_half() {
        let (m, c) = (2, 2);
        let w2 = weights(m, c, true);
        let rope = Rope::new(
            &RopeConfig {
                theta: 10000.0,
                yarn: None,
            },
            2,
        );
        let mut st = CompressorState::new(&w2);
        for pos in 0..4 {
            let (kv, gate) = token(pos, 2 * c);
            st.push(&w2, &kv, &gate, pos, &rope, 1e-6);
        }
        let ape = |p: usize, j: usize| w2.ape[(p % m) * 2 * c + j];
        // Entry 0: only window 0's B-half (no previous window).
        // Entry 1: window 0's A-half and window 1's B-half.
        for (e, prev) in [(0usize, None), (1, Some(0usize))] {
            let mut want = Vec::new();
            for j in 0..c {
                let mut logits = vec![];
                let mut values = vec![];
                if let Some(pw) = prev {
                    for p in pw * m..(pw + 1) * m {
                        logits.push(token(p, 2 * c).1[j] + ape(p, j));
                        values.push(token(p, 2 * c).0[j]);
                    }
                }
                for p in e * m..(e + 1) * m {
                    logits.push(token(p, 2 * c).1[c + j] + ape(p, c + j));
                    values.push(token(p, 2 * c).0[c + j]);
                }
                want.push(pool(&logits, &values));
            }
            let mut want = normalized(want);
            rope.apply(&mut want, e * m, false);
            for (g, w) in st.entries()[e * c..(e + 1) * c].iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "entry {e}: {g} vs {w}");
            }
        }
    }
}
