//! Mixture of experts (spec §8): sqrt-softplus scores, hash or learned (bias-for-selection)
//! routing, clamped SwiGLU experts, weighted sum plus the shared expert.

use super::attention::top_k;
use super::ops::{silu, softplus};
use crate::weights::{ExpertWeights, MoeWeights, Routing};

/// Selected experts and their combine weights for one token.
pub fn route(
    w: &MoeWeights,
    logits: &[f32],
    token: u32,
    k: usize,
    scaling: f32,
) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = logits.iter().map(|&z| softplus(z).sqrt()).collect();
    let chosen: Vec<usize> = match &w.routing {
        Routing::Hash { tid2eid } => {
            let t = token as usize;
            tid2eid[t * k..(t + 1) * k]
                .iter()
                .map(|&e| e as usize)
                .collect()
        }
        Routing::Learned { bias } => {
            let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            top_k(&biased, k)
        }
    };
    let total: f32 = chosen.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
    chosen
        .into_iter()
        .map(|e| (e, scores[e] / total * scaling))
        .collect()
}

/// Runs one expert on `n` rows of `x`: `W2 (silu(min(W1 x, L)) ⊙ clamp(W3 x, −L, L))`.
pub fn expert(w: &ExpertWeights, x: &[f32], n: usize, limit: f32) -> Vec<f32> {
    let inter = w.w1.rows();
    let mut g = vec![0.0f32; n * inter];
    let mut u = vec![0.0f32; n * inter];
    w.w1.matmul(x, n, &mut g);
    w.w3.matmul(x, n, &mut u);
    for (g, u) in g.iter_mut().zip(&u) {
        *g = silu(g.min(limit)) * u.clamp(-limit, limit);
    }
    let mut y = vec![0.0f32; n * w.w2.rows()];
    w.w2.matmul(&g, n, &mut y);
    y
}

/// MoE output for `n` tokens (`h` = `[n, D]`). Each token sums its experts in ascending expert
/// order, so the result does not depend on which other tokens share the call.
pub fn moe(
    w: &MoeWeights,
    h: &[f32],
    tokens: &[u32],
    k: usize,
    scaling: f32,
    limit: f32,
) -> Vec<f32> {
    let n = tokens.len();
    let d = h.len() / n;
    let e = w.gate.rows();
    let mut logits = vec![0.0f32; n * e];
    w.gate.matmul(h, n, &mut logits);
    let routes: Vec<Vec<(usize, f32)>> = tokens
        .iter()
        .zip(logits.chunks_exact(e))
        .map(|(&t, l)| route(w, l, t, k, scaling))
        .collect();

    let mut out = vec![0.0f32; n * d];
    for (ex, weights) in w.experts.iter().enumerate() {
        let users: Vec<(usize, f32)> = routes
            .iter()
            .enumerate()
            .flat_map(|(i, r)| {
                r.iter()
                    .filter(move |(x, _)| *x == ex)
                    .map(move |&(_, wt)| (i, wt))
            })
            .collect();
        if users.is_empty() {
            continue;
        }
        let x: Vec<f32> = users
            .iter()
            .flat_map(|&(i, _)| &h[i * d..(i + 1) * d])
            .copied()
            .collect();
        let y = expert(weights, &x, users.len(), limit);
        for (&(i, wt), yr) in users.iter().zip(y.chunks_exact(d)) {
            out[i * d..(i + 1) * d]
                .iter_mut()
                .zip(yr)
                .for_each(|(o, v)| *o += wt * v);
        }
    }
    let shared = expert(&w.shared, h, n, limit);
    out.iter_mut().zip(&shared).for_each(|(o, s)| *o += s);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Blob;
    use crate::linear::{Linear, LinearData};

    fn moe_weights(routing: Routing) -> MoeWeights {
        let lin = |r: usize, c: usize| {
            Linear::new(r, c, LinearData::F32(Blob::from_vec(vec![0; r * c * 4]))).unwrap()
        };
        let expert = || ExpertWeights {
            w1: lin(1, 1),
            w2: lin(1, 1),
            w3: lin(1, 1),
        };
        MoeWeights {
            gate: lin(4, 1),
            routing,
            experts: (0..4).map(|_| expert()).collect(),
            shared: expert(),
        }
    }

    #[test]
    fn learned_routing_selects_with_bias_but_weights_without() {
        let w = moe_weights(Routing::Learned {
            bias: vec![0.0, 10.0, 0.0, 0.0],
        });
        let logits = [3.0, -2.0, 1.0, 0.5];
        let got = route(&w, &logits, 0, 2, 1.5);
        // The bias lifts expert 1 into the top 2; its weight still uses the unbiased score.
        let s: Vec<f32> = logits.iter().map(|&z| softplus(z).sqrt()).collect();
        assert_eq!(got.iter().map(|e| e.0).collect::<Vec<_>>(), vec![0, 1]);
        let total = s[0] + s[1];
        assert!((got[0].1 - s[0] / total * 1.5).abs() < 1e-6);
        assert!((got[1].1 - s[1] / total * 1.5).abs() < 1e-6);
    }

    #[test]
    fn hash_routing_uses_the_token_row() {
        let w = moe_weights(Routing::Hash {
            tid2eid: vec![0, 1, 3, 2],
        });
        let got = route(&w, &[0.0, 0.0, 1.0, 2.0], 1, 2, 1.0);
        assert_eq!(got.iter().map(|e| e.0).collect::<Vec<_>>(), vec![3, 2]);
        let sum: f32 = got.iter().map(|e| e.1).sum();
        assert!((sum - 1.0).abs() < 1e-6);
    }
}
