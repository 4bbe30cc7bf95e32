//! Token compressors (spec §6) of one sequence: every `ratio` tokens become one pooled,
//! normalized, rotated entry. The window state and the pooling are the GPU kernels' CPU
//! reference ([`compressor_push`]); this keeps the entries, which grow with the sequence.

use dsv4_ops::gpu::attention::reference::{compressor_push, CompressorHost};

use crate::rope::Rope;
use crate::weights::CompressorWeights;

/// Open-window buffers and emitted entries of one compressor for one sequence.
pub struct CompressorState {
    /// The open window and the previous window's A-halves (its `entries` hold none).
    open: CompressorHost,
    /// All entries, `[len, c]`.
    entries: Vec<f32>,
}

impl CompressorState {
    pub fn new(w: &CompressorWeights) -> CompressorState {
        CompressorState {
            open: CompressorHost::new(w.ratio, w.width, w.overlap, 0),
            entries: Vec::new(),
        }
    }

    /// All entries, `[len, c]`.
    pub fn entries(&self) -> &[f32] {
        &self.entries
    }

    /// Adds the projections `kv`, `gate` `[T, κ·c]` of tokens at positions `pos0..`, one by
    /// one; a token that closes a window emits its entry (visible to that token's own
    /// attention, spec §6.5).
    pub fn push(
        &mut self,
        w: &CompressorWeights,
        kv: &[f32],
        gate: &[f32],
        pos0: usize,
        rope: &Rope,
        eps: f32,
    ) {
        let row_w = if w.overlap { 2 * w.width } else { w.width };
        for (t, (kv, gate)) in kv
            .chunks_exact(row_w)
            .zip(gate.chunks_exact(row_w))
            .enumerate()
        {
            let entry = compressor_push(
                kv,
                gate,
                &w.ape,
                &w.norm,
                rope.inv_freq(),
                eps,
                w.overlap,
                pos0 + t,
                &mut self.open,
            );
            if let Some(entry) = entry {
                self.entries.extend_from_slice(&entry);
            }
        }
    }
}
