//! Small f32 primitives shared by the CPU reference layers.

pub use dsv4_ops::gpu::rows::reference::{rms_norm, rms_norm_rows, sigmoid};

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
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
    fn gather_columns_picks_blocks() {
        let x: Vec<f32> = (0..12).map(|v| v as f32).collect();
        assert_eq!(
            gather_columns(&x, 4, 1, 2),
            vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]
        );
    }
}
