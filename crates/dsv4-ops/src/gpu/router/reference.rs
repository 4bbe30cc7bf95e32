//! CPU reference of the router kernel, used by the model's CPU forward too (spec §8):
//! sqrt-softplus scores, hash or learned (bias-for-selection) top-k, normalized weights.

use crate::gpu::rows::reference::softplus;

/// How a layer picks its experts.
#[derive(Clone, Copy, Debug)]
pub enum RouteBy<'a> {
    /// Experts fixed per token id: `tid2eid [vocab, k]`, in table order.
    Hash { tid2eid: &'a [u32] },
    /// The top k of score + bias (the bias selects only; ties to the lowest expert).
    Learned { bias: &'a [f32] },
}

/// `logits [t, e]` = `x [t, d]` · `wᵀ` with the gate weight `w [e, d]` (BF16 weights converted
/// to f32 first): each logit one [`dot16`], as the model's CPU gate (`Linear::matmul`).
pub fn gate_logits(x: &[f32], w: &[f32], t: usize, e: usize, d: usize) -> Vec<f32> {
    assert_eq!(x.len(), t * d, "gate input length");
    assert_eq!(w.len(), e * d, "gate weight length");
    (0..t)
        .flat_map(|i| {
            let xt = &x[i * d..(i + 1) * d];
            (0..e).map(move |r| dot16(&w[r * d..(r + 1) * d], xt))
        })
        .collect()
}

/// The dot product of the model's `Linear::matmul` (its one implementation): 16 independent f32
/// accumulators (lane `k` sums the products at indices `≡ k mod 16` in order) combined in a
/// fixed tree order: fast, and the same result for the same inputs on every call.
#[inline]
pub fn dot16(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        let x: &[f32; 16] = x.try_into().expect("chunks of 16");
        let y: &[f32; 16] = y.try_into().expect("chunks of 16");
        for k in 0..16 {
            acc[k] += x[k] * y[k];
        }
    }
    for (k, (x, y)) in ta.iter().zip(tb).enumerate() {
        acc[k] += x * y;
    }
    let mut width = 8;
    while width > 0 {
        for k in 0..width {
            acc[k] += acc[k + width];
        }
        width /= 2;
    }
    acc[0]
}

/// Indices of the `k` largest scores; ties go to the lowest index (spec §15).
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    let order = |a: &usize, b: &usize| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, order);
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// Selected experts and their combine weights for one token with router `logits [E]`.
pub fn route(logits: &[f32], by: RouteBy, token: u32, k: usize, scaling: f32) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = logits.iter().map(|&z| softplus(z).sqrt()).collect();
    let chosen: Vec<usize> = match by {
        RouteBy::Hash { tid2eid } => {
            let t = token as usize;
            tid2eid[t * k..(t + 1) * k]
                .iter()
                .map(|&e| e as usize)
                .collect()
        }
        RouteBy::Learned { bias } => {
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn gate_logits_are_token_major_dots_of_each_row() {
        // T = 2, E = 3, D = 20 (a remainder past the 16 lanes); small integers, so exact.
        let (t, e, d) = (2, 3, 20);
        let x: Vec<f32> = (0..t * d).map(|i| (i % 7) as f32 - 3.0).collect();
        let w: Vec<f32> = (0..e * d).map(|i| (i % 5) as f32 - 2.0).collect();
        let got = gate_logits(&x, &w, t, e, d);
        for i in 0..t {
            for r in 0..e {
                let want: f32 = (0..d).map(|c| x[i * d + c] * w[r * d + c]).sum();
                assert_eq!(got[i * e + r], want, "[{i}, {r}]");
            }
        }
    }

    #[test]
    fn dot16_is_close_to_the_exact_dot() {
        let n = 7168 + 5;
        let a: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
            .collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.61).sin()).collect();
        let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        let mag: f64 = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| (x as f64 * y as f64).abs())
            .sum();
        assert!(((dot16(&a, &b) as f64) - exact).abs() <= 1e-6 * mag);
        assert_eq!(dot16(&[], &[]), 0.0);
    }

    proptest! {
        #[test]
        fn dot16_is_close_to_f64(v in prop::collection::vec(-10f32..10.0, 0..100)) {
            let w: Vec<f32> = v.iter().rev().copied().collect();
            let exact: f64 = v.iter().zip(&w).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = v.iter().zip(&w).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            prop_assert!((dot16(&v, &w) as f64 - exact).abs() <= 1e-6 * mag + 1e-30);
        }
    }

    #[test]
    fn top_k_breaks_ties_by_lowest_index() {
        let s = [0.0, 3.0, 0.0, 3.0, 0.0, 1.0];
        assert_eq!(top_k(&s, 2), vec![1, 3]);
        assert_eq!(top_k(&s, 4), vec![0, 1, 3, 5]);
        assert_eq!(top_k(&s, 10), vec![0, 1, 2, 3, 4, 5]);
    }
    #[test]
    fn learned_routing_selects_with_bias_but_weights_without() {
        let bias = [0.0, 10.0, 0.0, 0.0];
        let logits = [3.0, -2.0, 1.0, 0.5];
        let got = route(&logits, RouteBy::Learned { bias: &bias }, 0, 2, 1.5);
        // The bias lifts expert 1 into the top 2; its weight still uses the unbiased score.
        let s: Vec<f32> = logits.iter().map(|&z| softplus(z).sqrt()).collect();
        assert_eq!(got.iter().map(|e| e.0).collect::<Vec<_>>(), vec![0, 1]);
        let total = s[0] + s[1];
        assert!((got[0].1 - s[0] / total * 1.5).abs() < 1e-6);
        assert!((got[1].1 - s[1] / total * 1.5).abs() < 1e-6);
    }

    #[test]
    fn hash_routing_uses_the_token_row() {
        let tid2eid = [0, 1, 3, 2];
        let got = route(
            &[0.0, 0.0, 1.0, 2.0],
            RouteBy::Hash { tid2eid: &tid2eid },
            1,
            2,
            1.0,
        );
        assert_eq!(got.iter().map(|e| e.0).collect::<Vec<_>>(), vec![3, 2]);
        let sum: f32 = got.iter().map(|e| e.1).sum();
        assert!((sum - 1.0).abs() < 1e-6);
    }
}
