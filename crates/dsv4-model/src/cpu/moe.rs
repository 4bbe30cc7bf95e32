//! Mixture of experts (spec §8): sqrt-softplus scores, hash or learned (bias-for-selection)
//! routing, clamped SwiGLU experts, weighted sum plus the shared expert.

use dsv4_ops::gpu::router::reference::{self, RouteBy};

use super::ops::silu;
use crate::weights::{ExpertWeights, MoeWeights, Routing};

/// Selected experts and their combine weights for one token.
pub fn route(
    w: &MoeWeights,
    logits: &[f32],
    token: u32,
    k: usize,
    scaling: f32,
) -> Vec<(usize, f32)> {
    let by = match &w.routing {
        Routing::Hash { tid2eid } => RouteBy::Hash { tid2eid },
        Routing::Learned { bias } => RouteBy::Learned { bias },
    };
    reference::route(logits, by, token, k, scaling)
}

/// Runs one expert on `n` rows of `x`: `W2 (silu(min(W1 x, L)) ⊙ clamp(W3 x, −L, L))`;
/// `round` is applied to the intermediate (the GPU's BF16 shared-expert activations; identity
/// otherwise).
pub fn expert(
    w: &ExpertWeights,
    x: &[f32],
    n: usize,
    limit: f32,
    round: fn(&mut [f32]),
) -> Vec<f32> {
    let inter = w.w1.rows();
    let mut g = vec![0.0f32; n * inter];
    let mut u = vec![0.0f32; n * inter];
    w.w1.matmul(x, n, &mut g);
    w.w3.matmul(x, n, &mut u);
    for (g, u) in g.iter_mut().zip(&u) {
        *g = silu(g.min(limit)) * u.clamp(-limit, limit);
    }
    round(&mut g);
    let mut y = vec![0.0f32; n * w.w2.rows()];
    w.w2.matmul(&g, n, &mut y);
    y
}

/// MoE output for `n` tokens (`h` = `[n, D]`). Each token sums its experts in ascending expert
/// order, so the result does not depend on which other tokens share the call. `round` models
/// the GPU's BF16 activations: the experts' input and the shared expert's intermediate
/// (identity for the F32 reference).
pub fn moe(
    w: &MoeWeights,
    h: &[f32],
    tokens: &[u32],
    k: usize,
    scaling: f32,
    limit: f32,
    round: fn(&mut [f32]),
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

    let mut hr = h.to_vec();
    round(&mut hr);
    let h = &hr[..];
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
        let y = expert(weights, &x, users.len(), limit, |_| {});
        for (&(i, wt), yr) in users.iter().zip(y.chunks_exact(d)) {
            out[i * d..(i + 1) * d]
                .iter_mut()
                .zip(yr)
                .for_each(|(o, v)| *o += wt * v);
        }
    }
    let shared = expert(&w.shared, h, n, limit, round);
    out.iter_mut().zip(&shared).for_each(|(o, s)| *o += s);
    out
}
