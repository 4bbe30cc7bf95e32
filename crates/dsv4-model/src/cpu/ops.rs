//! Small f32 primitives shared by the CPU reference layers.

pub use dsv4_ops::gpu::rows::reference::{dot, rms_norm, rms_norm_rows, sigmoid};

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `ln(1 + eˣ)` without overflow.
pub fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Copies column block `[start, start + width)` of every row of a `[rows, stride]` matrix.
pub fn gather_columns(x: &[f32], stride: usize, start: usize, width: usize) -> Vec<f32> {
    x.chunks_exact(stride)
        .flat_map(|row| &row[start..start + width])
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softplus_is_stable_and_exact() {
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(200.0), 200.0);
        assert!(softplus(-200.0) >= 0.0 && softplus(-200.0) < 1e-30);
        assert!((softplus(1.5) - (1.0f32 + 1.5f32.exp()).ln()).abs() < 1e-6);
    }

    #[test]
    fn gather_columns_picks_blocks() {
        let x: Vec<f32> = (0..12).map(|v| v as f32).collect();
        assert_eq!(
            gather_columns(&x, 4, 1, 2),
            vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]
        );
    }
}
