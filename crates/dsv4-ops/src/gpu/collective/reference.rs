//! CPU references of the collectives.

/// The sum of every rank's part, added in rank order as every rank's kernel adds.
pub fn all_reduce(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut sum = parts[0].clone();
    for p in &parts[1..] {
        for (s, v) in sum.iter_mut().zip(p) {
            *s += v;
        }
    }
    sum
}

/// Rows of `[rows, width]` parts laid side by side, rank 0's first: `[rows, ranks * width]`.
pub fn all_gather_cols(parts: &[Vec<f32>], width: usize) -> Vec<f32> {
    let rows = parts[0].len() / width;
    let mut out = Vec::with_capacity(rows * width * parts.len());
    for r in 0..rows {
        for p in parts {
            out.extend_from_slice(&p[r * width..(r + 1) * width]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_in_rank_order_and_gathers_side_by_side() {
        // 1e8 + 1 - 1e8 is 0 in f32 left to right, 1 in other orders.
        let parts = vec![vec![1e8, 2.0], vec![1.0, 3.0], vec![-1e8, 4.0]];
        assert_eq!(all_reduce(&parts), vec![0.0, 9.0]);
        let parts = vec![vec![1.0, 2.0, 3.0, 4.0], vec![5.0, 6.0, 7.0, 8.0]];
        assert_eq!(
            all_gather_cols(&parts, 2),
            vec![1.0, 2.0, 5.0, 6.0, 3.0, 4.0, 7.0, 8.0]
        );
    }
}
