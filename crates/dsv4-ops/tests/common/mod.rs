//! Helpers shared by the GPU integration tests.
#![allow(dead_code)] // each test binary uses its own subset

use dsv4_ops::gpu::Device;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Relative error bound of GEMV / MoE results against the f64 references.
pub const TOL: f64 = 5e-3;
/// Byte used to poison outputs before a launch, so unwritten elements show up.
pub const POISON: u8 = 0xa5;

/// The first GPU. These tests are `#[ignore]`d, so this only runs when they were asked for;
/// without a GPU that request fails loudly rather than passing.
pub fn device() -> Device {
    let count = Device::count().unwrap_or(0);
    assert!(
        count > 0,
        "this GPU test was requested (--ignored) but the machine has no CUDA device"
    );
    Device::new(0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"))
}

/// A fresh generator per test; the seed is printed (and `DSV4_TEST_SEED` replays one).
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("DSV4_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// Roughly normal values (sum of four uniforms) with standard deviation `scale`.
pub fn gaussian(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 0.866 * scale)
        .collect()
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}
