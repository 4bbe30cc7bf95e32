//! Attention pieces (spec §5, §7): the sliding-window ring, sink softmax over window ∪
//! compressed keys (K = V), and the Lightning Indexer's top-k.

pub use dsv4_ops::gpu::router::reference::top_k;
use rayon::prelude::*;

use super::ops::dot;

/// Ring of the last `size` window keys; slot of position t is `t mod size`.
pub struct Window {
    size: usize,
    width: usize,
    data: Vec<f32>,
}

impl Window {
    pub fn new(size: usize, width: usize) -> Window {
        Window {
            size,
            width,
            data: vec![0.0; size * width],
        }
    }

    pub fn push(&mut self, pos: usize, kv: &[f32]) {
        let slot = pos % self.size;
        self.data[slot * self.width..(slot + 1) * self.width].copy_from_slice(kv);
    }

    /// Keys visible to the query at `pos`: positions `max(0, pos − size + 1) ..= pos`.
    pub fn visible(&self, pos: usize) -> impl Iterator<Item = &[f32]> {
        let first = (pos + 1).saturating_sub(self.size);
        (first..=pos).map(move |p| {
            let slot = p % self.size;
            &self.data[slot * self.width..(slot + 1) * self.width]
        })
    }
}

/// `o_h = Σ_j softmax_j(q_h·k_j·scale ∪ sink_h) k_j` for every head; `q` and `out` are `[H, d]`.
pub fn attend(q: &[f32], keys: &[&[f32]], sink: &[f32], out: &mut [f32]) {
    let d = keys.first().map_or(out.len() / sink.len(), |k| k.len());
    let scale = 1.0 / (d as f32).sqrt();
    out.par_chunks_mut(d)
        .zip(q.par_chunks(d))
        .zip(sink.par_iter())
        .for_each(|((o, qh), &s)| {
            let scores: Vec<f32> = keys.iter().map(|k| dot(qh, k) * scale).collect();
            let mx = scores.iter().copied().fold(s, f32::max);
            let probs: Vec<f32> = scores.iter().map(|x| (x - mx).exp()).collect();
            let denom = probs.iter().sum::<f32>() + (s - mx).exp();
            o.fill(0.0);
            for (p, k) in probs.iter().zip(keys) {
                let p = p / denom;
                o.iter_mut().zip(k.iter()).for_each(|(o, v)| *o += p * v);
            }
        });
}

/// Indexer scores `I_w = Σ_h ω_h · ReLU(q_h · K_w) / sqrt(c)` over all `keys` (`[n, c]`).
pub fn index_scores(q: &[f32], weights: &[f32], keys: &[f32], c: usize) -> Vec<f32> {
    let scale = 1.0 / (c as f32).sqrt();
    keys.par_chunks(c)
        .map(|k| {
            q.chunks_exact(c)
                .zip(weights)
                .map(|(qh, w)| dot(qh, k).max(0.0) * scale * w)
                .sum()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_keeps_last_size_positions() {
        let mut w = Window::new(3, 1);
        for p in 0..5 {
            w.push(p, &[p as f32]);
        }
        let seen: Vec<f32> = w.visible(4).map(|k| k[0]).collect();
        assert_eq!(seen, vec![2.0, 3.0, 4.0]);
        let mut w = Window::new(3, 1);
        w.push(0, &[7.0]);
        assert_eq!(w.visible(0).count(), 1);
    }

    #[test]
    fn sink_only_shrinks_weights() {
        let k1 = [1.0f32, 0.0];
        let keys: Vec<&[f32]> = vec![&k1];
        let mut out = [0.0f32; 2];
        attend(&[0.0, 0.0], &keys, &[0.0], &mut out);
        // one key with score 0 and a sink with logit 0: weight 1/2.
        assert!((out[0] - 0.5).abs() < 1e-6 && out[1] == 0.0);
        attend(&[0.0, 0.0], &keys, &[-1e4], &mut out);
        assert!((out[0] - 1.0).abs() < 1e-6);
    }
}
