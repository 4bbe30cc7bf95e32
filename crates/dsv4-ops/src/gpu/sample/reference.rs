//! CPU reference of the device sampler, reproducing its fixed summation orders exactly, so
//! that given the same weights it picks the same token.

use crate::gpu::random::reference::splitmix64;

/// Threads of the sampling block: the id ranges and the reduction tree follow from it.
pub const THREADS: usize = 1024;

/// `w = exp((z − max) / T)` (`inv_t` = 1/T), NaN logits weigh 0 (expf on the device may differ
/// from this by an ulp).
pub fn sample_weights(z: &[f32], inv_t: f32) -> Vec<f32> {
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    z.iter()
        .map(|&v| {
            if v.is_nan() {
                0.0
            } else {
                ((v - m) * inv_t).exp()
            }
        })
        .collect()
}

/// The draw in [0, 1) for `(seed, position)`: 24 random bits.
pub fn draw(seed: u64, position: u32) -> f32 {
    let r = splitmix64(seed ^ splitmix64(position as u64));
    (r >> 40) as f32 * (1.0 / 16_777_216.0)
}

/// Per-thread sums of the kept weights (`w >= tau`) over each thread's id range.
fn thread_sums(w: &[f32], tau: f32) -> Vec<f32> {
    let chunk = w.len().div_ceil(THREADS);
    (0..THREADS)
        .map(|t| {
            let lo = (t * chunk).min(w.len());
            let hi = (lo + chunk).min(w.len());
            w[lo..hi]
                .iter()
                .filter(|&&v| v >= tau)
                .fold(0.0f32, |s, &v| s + v)
        })
        .collect()
}

/// The kept mass as the device sums it: per-thread sums, then a pairwise tree.
fn kept_mass(w: &[f32], tau: f32) -> f32 {
    let mut part = thread_sums(w, tau);
    let mut stride = THREADS / 2;
    while stride > 0 {
        for i in 0..stride {
            part[i] += part[i + stride];
        }
        stride /= 2;
    }
    part[0]
}

/// The token the device picks: argmax of `z` when `greedy` (or when the weights sum to zero
/// or overflow), else the top-p threshold by bisection over float bits and a walk of the kept
/// weights in id order to `draw(seed, position) · kept`.
pub fn sample_pick(
    z: &[f32],
    w: &[f32],
    greedy: bool,
    top_p: f32,
    seed: u64,
    position: u32,
) -> u32 {
    let argmax = || {
        let mut best = (0usize, f32::NEG_INFINITY);
        for (i, &v) in z.iter().enumerate() {
            if v > best.1 {
                best = (i, v);
            }
        }
        best.0 as u32
    };
    if greedy {
        return argmax();
    }
    let total = kept_mass(w, 0.0);
    if !(total > 0.0 && total.is_finite()) {
        return argmax();
    }
    let mut tau_bits = 0u32;
    if top_p < 1.0 {
        let need = top_p * total;
        let (mut a, mut b) = (0u32, 0x3f80_0001u32);
        while b - a > 1 {
            let mid = a + (b - a) / 2;
            if kept_mass(w, f32::from_bits(mid)) >= need {
                a = mid;
            } else {
                b = mid;
            }
        }
        tau_bits = a;
    }
    let tau = f32::from_bits(tau_bits);
    let part = thread_sums(w, tau);
    let kept = part.iter().fold(0.0f32, |s, &v| s + v);
    let target = draw(seed, position) * kept;
    let chunk = w.len().div_ceil(THREADS);
    let kept_at = |i: usize| w[i] >= tau && w[i] > 0.0;
    let mut acc = 0.0f32;
    for (t, &p) in part.iter().enumerate() {
        let next = acc + p;
        if target >= next {
            acc = next;
            continue;
        }
        let lo = (t * chunk).min(w.len());
        let hi = (lo + chunk).min(w.len());
        for i in (lo..hi).filter(|&i| kept_at(i)) {
            acc += w[i];
            if target < acc {
                return i as u32;
            }
        }
    }
    // Rounding left the target just past the last kept weight: take that token.
    (0..w.len()).rev().find(|&i| kept_at(i)).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_degenerate_rows_take_the_argmax() {
        let z = [0.5, 3.0, f32::NAN, 3.0];
        let w = sample_weights(&z, 1.0);
        assert_eq!(sample_pick(&z, &w, true, 1.0, 1, 0), 1);
        let zero = [0.0; 4];
        assert_eq!(sample_pick(&z, &zero, false, 0.9, 1, 0), 1);
        assert_eq!(
            sample_pick(&[f32::NAN, f32::NEG_INFINITY], &[0.0, 0.0], true, 1.0, 0, 0),
            0
        );
    }

    #[test]
    fn draws_follow_the_distribution_and_top_p_cuts_the_tail() {
        // Weights of probabilities 0.1, 0.2, 0.3, 0.4 (max weight 1).
        let w = [0.25, 0.5, 0.75, 1.0];
        let z = [0.0; 4];
        let freq = |top_p: f32| {
            let mut counts = [0usize; 4];
            for pos in 0..40_000u32 {
                counts[sample_pick(&z, &w, false, top_p, 7, pos) as usize] += 1;
            }
            counts.map(|c| c as f64 / 40_000.0)
        };
        let all = freq(1.0);
        for (f, p) in all.iter().zip([0.1, 0.2, 0.3, 0.4]) {
            assert!((f - p).abs() < 0.01, "{all:?}");
        }
        // top-p 0.5: tokens 3 and 2 (0.4 + 0.3 >= 0.5) are kept, renormalized to 4/7 and 3/7.
        let cut = freq(0.5);
        assert_eq!((cut[0], cut[1]), (0.0, 0.0), "{cut:?}");
        assert!(
            (cut[2] - 3.0 / 7.0).abs() < 0.01 && (cut[3] - 4.0 / 7.0).abs() < 0.01,
            "{cut:?}"
        );
        // A tiny top-p keeps only the most likely token.
        assert!((0..100).all(|pos| sample_pick(&z, &w, false, 1e-6, 3, pos) == 3));
    }

    #[test]
    fn same_seed_and_position_same_draw() {
        assert_eq!(draw(42, 9), draw(42, 9));
        assert_ne!(draw(42, 9), draw(42, 10));
        assert_ne!(draw(42, 9), draw(43, 9));
        assert!((0..1000).all(|p| (0.0..1.0).contains(&draw(5, p))));
    }
}
