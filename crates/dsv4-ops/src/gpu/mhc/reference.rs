//! CPU reference of the mHC kernels, used by the model's CPU forward too: manifold-constrained
//! hyper-connections (spec §4) collapse the `n` residual streams into a sub-layer input, then
//! expand the sub-layer output back with a Sinkhorn-projected mixer.

use crate::gpu::rows::reference::{dot, rms_norm, sigmoid};

/// One site's parameters: `fn_ [mix, n·D]`, `base [mix]`, `scale [3]` (`[1]` for the head).
#[derive(Clone, Copy, Debug)]
pub struct HcSite<'a> {
    pub fn_: &'a [f32],
    pub base: &'a [f32],
    pub scale: &'a [f32],
}

/// Mixing weights of one site for one token.
pub struct HcMix {
    /// `post_j`: weight of the sub-layer output in stream j.
    pub post: Vec<f32>,
    /// `C [n, n]` row-major; stream j gathers stream i with weight `C[i, j]`.
    pub comb: Vec<f32>,
}

pub struct HcParams {
    pub n: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub norm_eps: f32,
}

/// Mixing logits `fn · x̂` for the flattened, RMS-normalized state.
fn mix_logits(fn_: &[f32], streams: &[f32], norm_eps: f32) -> Vec<f32> {
    let mut flat = streams.to_vec();
    rms_norm(&mut flat, None, norm_eps);
    fn_.chunks_exact(flat.len())
        .map(|row| dot(row, &flat))
        .collect()
}

fn collapse(streams: &[f32], pre: &[f32]) -> Vec<f32> {
    let d = streams.len() / pre.len();
    let mut out = vec![0.0f32; d];
    for (p, s) in pre.iter().zip(streams.chunks_exact(d)) {
        out.iter_mut().zip(s).for_each(|(o, v)| *o += p * v);
    }
    out
}

/// Doubly-stochastic projection: row softmax + eps, column normalize, then `iters − 1`
/// (row, column) rounds, every division guarded by `eps`.
pub fn sinkhorn(logits: &mut [f32], n: usize, iters: usize, eps: f32) {
    for row in logits.chunks_exact_mut(n) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        row.iter_mut().for_each(|v| *v = (*v - m).exp());
        let s: f32 = row.iter().sum();
        row.iter_mut().for_each(|v| *v = *v / s + eps);
    }
    let normalize_cols = |c: &mut [f32]| {
        for j in 0..n {
            let s: f32 = (0..n).map(|i| c[i * n + j]).sum();
            (0..n).for_each(|i| c[i * n + j] /= s + eps);
        }
    };
    normalize_cols(logits);
    for _ in 1..iters {
        for row in logits.chunks_exact_mut(n) {
            let s: f32 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= s + eps);
        }
        normalize_cols(logits);
    }
}

/// Computes the site's mix for one token (`streams` = `[n, D]`) and the collapsed input.
pub fn hc_pre(w: &HcSite, streams: &[f32], p: &HcParams) -> (HcMix, Vec<f32>) {
    let n = p.n;
    let mu = mix_logits(w.fn_, streams, p.norm_eps);
    let pre: Vec<f32> = (0..n)
        .map(|i| sigmoid(w.scale[0] * mu[i] + w.base[i]) + p.hc_eps)
        .collect();
    let post: Vec<f32> = (n..2 * n)
        .map(|i| 2.0 * sigmoid(w.scale[1] * mu[i] + w.base[i]))
        .collect();
    let mut comb: Vec<f32> = (2 * n..(2 + n) * n)
        .map(|i| w.scale[2] * mu[i] + w.base[i])
        .collect();
    sinkhorn(&mut comb, n, p.sinkhorn_iters, p.hc_eps);
    (HcMix { post, comb }, collapse(streams, &pre))
}

/// `X'_j = post_j · y + Σ_i C[i, j] · X_i`, in place.
pub fn hc_post(streams: &mut [f32], y: &[f32], mix: &HcMix) {
    let n = mix.post.len();
    let d = y.len();
    let old = streams.to_vec();
    for (j, out) in streams.chunks_exact_mut(d).enumerate() {
        for (c, o) in out.iter_mut().enumerate() {
            let mut acc = mix.post[j] * y[c];
            for i in 0..n {
                acc += mix.comb[i * n + j] * old[i * d + c];
            }
            *o = acc;
        }
    }
}

/// Final collapse before the output norm (pre weights only).
pub fn hc_head(w: &HcSite, streams: &[f32], p: &HcParams) -> Vec<f32> {
    let mu = mix_logits(w.fn_, streams, p.norm_eps);
    let pre: Vec<f32> = (0..p.n)
        .map(|i| sigmoid(w.scale[0] * mu[i] + w.base[i]) + p.hc_eps)
        .collect();
    collapse(streams, &pre)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_is_nearly_doubly_stochastic_and_not_symmetric() {
        let mut c: Vec<f32> = (0..16).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.7).collect();
        sinkhorn(&mut c, 4, 20, 1e-6);
        for i in 0..4 {
            let row: f32 = c[i * 4..i * 4 + 4].iter().sum();
            let col: f32 = (0..4).map(|r| c[r * 4 + i]).sum();
            assert!(
                (row - 1.0).abs() < 1e-3 && (col - 1.0).abs() < 1e-5,
                "row {row} col {col}"
            );
        }
        assert!((c[1] - c[4]).abs() > 1e-3);
    }

    #[test]
    fn post_uses_transposed_comb() {
        // Two streams of width 1, X = [1, 10], y = 0, asymmetric C = [[0.25, 0.75], [0.5, 0.5]].
        let mix = HcMix {
            post: vec![0.0, 0.0],
            comb: vec![0.25, 0.75, 0.5, 0.5],
        };
        let mut x = vec![1.0, 10.0];
        hc_post(&mut x, &[0.0], &mix);
        // X'_0 = C00·X0 + C10·X1 = 0.25 + 5 ; X'_1 = C01·X0 + C11·X1 = 0.75 + 5
        assert_eq!(x, vec![5.25, 5.75]);
    }
}
