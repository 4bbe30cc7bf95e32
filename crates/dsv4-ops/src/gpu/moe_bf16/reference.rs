//! CPU reference of the BF16 routed experts: f32 arithmetic on the bf16 weights, exactly that of
//! the model's CPU MoE (`dsv4_model::cpu::moe`) on BF16 `Linear`s: every projection output is one
//! `Linear::matmul` dot ([`dot16`]), the SwiGLU is `expert`'s
//! (`silu(min(g, L)) · clamp(u, −L, L)`, `silu(v) = v · sigmoid(v)`), and each token's output is
//! `out += w · y` over its experts in ascending id order (`moe`'s order; repeated ids of one
//! token in slot order).

use half::bf16;
use rayon::prelude::*;

use crate::gpu::moe::reference::expert_index;
use crate::gpu::router::reference::dot16;
use crate::gpu::rows::reference::sigmoid;

/// One expert's weights: `w1`, `w3` `[I, D]`, `w2` `[D, I]`, row-major.
#[derive(Clone, Copy, Debug)]
pub struct HostExpert<'a> {
    pub w1: &'a [bf16],
    pub w3: &'a [bf16],
    pub w2: &'a [bf16],
}

/// `silu(min(g, L)) · clamp(u, −L, L)`, as the model's CPU `expert`.
pub fn swiglu(g: f32, u: f32, limit: f32) -> f32 {
    let g = g.min(limit);
    g * sigmoid(g) * u.clamp(-limit, limit)
}

/// `y [rows]` = `W [rows, cols]` · `x [cols]`, each output one [`dot16`] on the row in f32.
pub fn matvec(w: &[bf16], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols, "weight length");
    assert_eq!(x.len(), cols, "input length");
    (0..rows)
        .into_par_iter()
        .map(|r| {
            let row: Vec<f32> = w[r * cols..(r + 1) * cols]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            dot16(&row, x)
        })
        .collect()
}

/// `h [I]` = `swiglu(W1 x, W3 x)` for one token `x [D]`.
pub fn gate_up(ex: &HostExpert<'_>, d: usize, inter: usize, x: &[f32], limit: f32) -> Vec<f32> {
    let g = matvec(ex.w1, inter, d, x);
    let u = matvec(ex.w3, inter, d, x);
    g.iter()
        .zip(&u)
        .map(|(&g, &u)| swiglu(g, u, limit))
        .collect()
}

/// The valid slots of one token's `ids` in the order the outputs are summed: ascending expert
/// id, then slot.
pub fn sum_order(ids: &[i32], experts: usize) -> Vec<usize> {
    let mut slots: Vec<usize> = (0..ids.len())
        .filter(|&j| expert_index(ids[j], experts).is_some())
        .collect();
    slots.sort_by_key(|&j| (ids[j], j));
    slots
}

/// `out [m, d]` = Σⱼ weights[t, j] · W2 (swiglu(W1 x_t, W3 x_t)) over each token's valid experts
/// (`ids [m, topk]`; ids outside `[0, experts.len())` select nothing), summed as the model's
/// CPU MoE does.
#[allow(clippy::too_many_arguments)]
pub fn moe_bf16(
    x: &[bf16],
    m: usize,
    d: usize,
    inter: usize,
    ids: &[i32],
    weights: &[f32],
    topk: usize,
    experts: &[HostExpert<'_>],
    limit: f32,
) -> Vec<f32> {
    assert_eq!(x.len(), m * d, "input length");
    assert_eq!(ids.len(), m * topk, "ids length");
    assert_eq!(weights.len(), m * topk, "weights length");
    let mut out = vec![0f32; m * d];
    for t in 0..m {
        let xt: Vec<f32> = x[t * d..(t + 1) * d].iter().map(|v| v.to_f32()).collect();
        let row_ids = &ids[t * topk..(t + 1) * topk];
        for j in sum_order(row_ids, experts.len()) {
            let ex = &experts[row_ids[j] as usize];
            let h = gate_up(ex, d, inter, &xt, limit);
            let y = matvec(ex.w2, d, inter, &h);
            let w = weights[t * topk + j];
            out[t * d..(t + 1) * d]
                .iter_mut()
                .zip(&y)
                .for_each(|(o, v)| *o += w * v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|&x| bf16::from_f32(x)).collect()
    }

    #[test]
    fn swiglu_clamps_the_gate_above_and_the_up_both_ways() {
        let s = |g: f32| g / (1.0 + (-g).exp());
        assert!((swiglu(1.0, 2.0, 10.0) - s(1.0) * 2.0).abs() < 1e-6);
        assert!((swiglu(50.0, 1.0, 10.0) - s(10.0)).abs() < 1e-5);
        assert!((swiglu(-50.0, 1.0, 10.0) - s(-50.0)).abs() < 1e-6);
        assert!((swiglu(1.0, 50.0, 10.0) - s(1.0) * 10.0).abs() < 1e-5);
        assert!((swiglu(1.0, -50.0, 10.0) + s(1.0) * 10.0).abs() < 1e-5);
        // As f32::min and f32::clamp: a NaN gate is clamped away, a NaN up stays.
        assert!((swiglu(f32::NAN, 1.0, 3.0) - s(3.0)).abs() < 1e-6);
        assert!(swiglu(1.0, f32::NAN, 3.0).is_nan());
    }

    #[test]
    fn sum_order_sorts_by_expert_then_slot_and_drops_invalid_ids() {
        assert_eq!(sum_order(&[5, -1, 2, 9, 2, 0], 6), vec![5, 2, 4, 0]);
        assert_eq!(sum_order(&[i32::MIN, i32::MAX, 6], 6), Vec::<usize>::new());
    }

    #[test]
    fn moe_weights_each_valid_expert_and_skips_invalid_ones() {
        // D = 2, I = 1. Expert 0: w1 = w3 = [1, 0], w2 = [[1], [2]]. Expert 1: w1 = w3 = [0, 1],
        // w2 = [[-1], [0.5]]. x = [2, 1].
        let (a1, a2) = (b(&[1.0, 0.0]), b(&[1.0, 2.0]));
        let (c1, c2) = (b(&[0.0, 1.0]), b(&[-1.0, 0.5]));
        let ex = [
            HostExpert {
                w1: &a1,
                w3: &a1,
                w2: &a2,
            },
            HostExpert {
                w1: &c1,
                w3: &c1,
                w2: &c2,
            },
        ];
        let x = b(&[2.0, 1.0]);
        let ids = [1, -1, 0, 2];
        let wts = [0.25, 9.0, 0.5, 9.0];
        let out = moe_bf16(&x, 1, 2, 1, &ids, &wts, 4, &ex, 10.0);
        let (h0, h1) = (swiglu(2.0, 2.0, 10.0), swiglu(1.0, 1.0, 10.0));
        let want = [0.5 * h0 + 0.25 * -h1, 0.5 * 2.0 * h0 + 0.25 * 0.5 * h1];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-6, "{out:?} vs {want:?}");
        }
        // Expert 0 is added first (ascending ids), whatever the slot order.
        let swapped = moe_bf16(&x, 1, 2, 1, &[0, 1], &[0.5, 0.25], 2, &ex, 10.0);
        assert_eq!(out, swapped);
        // A token without a valid expert gets zeros; the limit clamps.
        let none = moe_bf16(&x, 1, 2, 1, &[-3, 2], &[1.0, 1.0], 2, &ex, 10.0);
        assert_eq!(none, vec![0.0, 0.0]);
        let clamped = moe_bf16(&x, 1, 2, 1, &[0], &[1.0], 1, &ex, 1.5);
        assert!((clamped[0] - swiglu(1.5, 1.5, 1.5)).abs() < 1e-6);
    }

    #[test]
    fn matvec_matches_a_plain_dot_closely() {
        let (rows, cols) = (5, 37);
        let w: Vec<bf16> = (0..rows * cols)
            .map(|i| bf16::from_f32(((i * 7919 % 113) as f32 - 56.0) / 64.0))
            .collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let y = matvec(&w, rows, cols, &x);
        for (r, &yr) in y.iter().enumerate() {
            let exact: f64 = (0..cols)
                .map(|c| w[r * cols + c].to_f64() * x[c] as f64)
                .sum();
            assert!((yr as f64 - exact).abs() < 1e-5, "row {r}: {yr} vs {exact}");
        }
    }
}
