//! CPU references of the row kernels. The model's CPU forward uses these same functions, so
//! the GPU kernels are checked against the arithmetic that matches transformers.

use half::bf16;

use super::RopeDirection;

/// `hc` copies of each token's embedding row: `[tokens.len(), hc · D]`; NaN rows for ids
/// outside the vocabulary.
pub fn embed_hc_gather(table: &[bf16], d: usize, tokens: &[u32], hc: usize) -> Vec<f32> {
    let vocab = table.len() / d.max(1);
    tokens
        .iter()
        .flat_map(|&id| {
            let row: Vec<f32> = match table.get(id as usize * d..(id as usize + 1) * d) {
                Some(r) if (id as usize) < vocab => r.iter().map(|v| v.to_f32()).collect(),
                _ => vec![f32::NAN; d],
            };
            std::iter::repeat_n(row, hc).flatten()
        })
        .collect()
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1 + eˣ)` without overflow.
pub fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// `x · rsqrt(mean(x²) + eps)`, times `weight` when given (spec §2).
pub fn rms_norm(x: &mut [f32], weight: Option<&[f32]>, eps: f32) {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (mean_sq + eps).sqrt();
    match weight {
        Some(w) => x.iter_mut().zip(w).for_each(|(v, w)| *v = w * (*v * r)),
        None => x.iter_mut().for_each(|v| *v *= r),
    }
}

/// Applies [`rms_norm`] to every `width`-sized row.
pub fn rms_norm_rows(x: &mut [f32], width: usize, weight: Option<&[f32]>, eps: f32) {
    x.chunks_exact_mut(width)
        .for_each(|row| rms_norm(row, weight, eps));
}

/// Rotates the last `2 · inv_freq.len()` channels of `x` to position `pos`: pair `(2i, 2i+1)`
/// by `pos · inv_freq[i]` (by minus that for [`RopeDirection::Inverse`]).
pub fn rope_rotate(x: &mut [f32], inv_freq: &[f32], pos: usize, direction: RopeDirection) {
    let start = x.len() - 2 * inv_freq.len();
    let p = pos as f32;
    for (i, &w) in inv_freq.iter().enumerate() {
        let (s, c) = (p * w).sin_cos();
        let s = match direction {
            RopeDirection::Forward => s,
            RopeDirection::Inverse => -s,
        };
        let (a, b) = (x[start + 2 * i], x[start + 2 * i + 1]);
        x[start + 2 * i] = a * c - b * s;
        x[start + 2 * i + 1] = b * c + a * s;
    }
}

/// [`rope_rotate`] over `x [tokens, heads, width]`, token `t` at position `pos0 + t`.
pub fn rope_rows(
    x: &mut [f32],
    heads: usize,
    width: usize,
    inv_freq: &[f32],
    pos0: usize,
    direction: RopeDirection,
) {
    for (t, token) in x.chunks_exact_mut(heads * width).enumerate() {
        for v in token.chunks_exact_mut(width) {
            rope_rotate(v, inv_freq, pos0 + t, direction);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rms() {
        let mut x = vec![3.0, -4.0, 0.0, 5.0];
        rms_norm(&mut x, None, 0.0);
        let ms = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
        let mut y = vec![1.0, 1.0];
        rms_norm(&mut y, Some(&[2.0, 0.5]), 0.0);
        assert_eq!(y, vec![2.0, 0.5]);
    }

    #[test]
    fn softplus_is_stable_and_exact() {
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(200.0), 200.0);
        assert!(softplus(-200.0) >= 0.0 && softplus(-200.0) < 1e-30);
        assert!((softplus(1.5) - (1.0f32 + 1.5f32.exp()).ln()).abs() < 1e-6);
    }

    #[test]
    fn gather_copies_rows_and_marks_unknown_ids() {
        let table: Vec<bf16> = (0..6).map(|v| bf16::from_f32(v as f32)).collect();
        let out = embed_hc_gather(&table, 2, &[2, 0, 3], 2);
        assert_eq!(&out[..8], &[4.0, 5.0, 4.0, 5.0, 0.0, 1.0, 0.0, 1.0]);
        assert!(out[8..].iter().all(|v| v.is_nan()));
    }

    #[test]
    fn rope_rotates_pairs_and_inverse_undoes_it() {
        let inv_freq = [1.0, 0.25];
        let mut x = vec![7.0, 1.0, 0.0, 1.0, 0.0];
        rope_rotate(&mut x, &inv_freq, 2, RopeDirection::Forward);
        assert_eq!(x[0], 7.0);
        assert!((x[1] - 2f32.cos()).abs() < 1e-6 && (x[2] - 2f32.sin()).abs() < 1e-6);
        assert!((x[3] - 0.5f32.cos()).abs() < 1e-6 && (x[4] - 0.5f32.sin()).abs() < 1e-6);
        let mut rows = x.repeat(2);
        rope_rows(&mut rows, 1, 5, &inv_freq, 2, RopeDirection::Inverse);
        assert!((rows[1] - 1.0).abs() < 1e-6 && rows[2].abs() < 1e-6);
        // The second token sits one position further, so it is left turned back by one step.
        assert!((rows[6] - 1f32.cos()).abs() < 1e-6);
    }
}
