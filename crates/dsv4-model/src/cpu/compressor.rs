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
    pub fn push(&mut self, w: &CompressorWeights, kv: &[f32], gate: &[f32], pos: usize, rope: &Rope, eps: f32) {
        let row_w = kv.len();
        let r = pos % self.ratio;
        self.kv[r * row_w..(r + 1) * row_w].copy_from_slice(kv);
        let ape = &w.ape[r * row_w..(r + 1) * row_w];
        for ((dst, g), a) in self.gate[r * row_w..(r + 1) * row_w].iter_mut().zip(gate).zip(ape) {
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
            *out = logits.iter().zip(&values).map(|(z, v)| v * ((z - mx).exp() / sum)).sum();
        }
        rms_norm(&mut entry, Some(&w.norm), eps);
        rope.apply(&mut entry, first_pos, false);
        self.entries.extend_from_slice(&entry);
        if self.overlap {
            let a_half = |buf: &[f32]| buf.chunks_exact(row_w).flat_map(|row| &row[..c]).copied().collect::<Vec<_>>();
            self.prev = Some((a_half(&self.kv), a_half(&self.gate)));
        }
    }
}
