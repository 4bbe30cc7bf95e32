//! Helpers shared by the GPU integration tests.
#![allow(dead_code)] // each test binary uses its own subset

use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

/// Relative error bound of GEMV / MoE results against the f64 references.
pub const TOL: f64 = 5e-3;

/// Roughly normal values (sum of four uniforms) with standard deviation `scale`.
pub fn gaussian(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 0.866 * scale)
        .collect()
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}
