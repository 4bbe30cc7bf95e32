//! Rotary frequencies (spec §2): plain "main" rope for sliding-only layers, YaRN-interpolated
//! "compress" rope for everything inside CSA/HCA layers, both interleaved on the LAST
//! `rope_dim` channels of a vector.

use dsv4_ops::gpu::rows::reference::rope_rotate;
use dsv4_ops::gpu::rows::RopeDirection;

use crate::config::{Config, RopeConfig};

/// Inverse frequencies `ω_i`, one per rotated pair.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(cfg: &RopeConfig, rope_dim: usize) -> Rope {
        let dim = rope_dim as f64;
        let half = rope_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| cfg.theta.powf(-(2.0 * i as f64) / dim))
            .collect();
        let inv_freq = match &cfg.yarn {
            None => base.iter().map(|&w| w as f32).collect(),
            Some(y) => {
                // Correction range in pair units, truncated as transformers does (`truncate=True`).
                let corr = |rot: f64| {
                    dim * (y.original_max_position / (rot * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * cfg.theta.ln())
                };
                let lo = corr(y.beta_fast).floor().max(0.0);
                let mut hi = corr(y.beta_slow).ceil().min(dim - 1.0);
                if lo == hi {
                    hi += 0.001;
                }
                base.iter()
                    .enumerate()
                    .map(|(i, &w)| {
                        let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                        (w * (ramp / y.factor + (1.0 - ramp))) as f32
                    })
                    .collect()
            }
        };
        Rope { inv_freq }
    }

    /// The table a layer uses: "main" for sliding-only layers, "compress" otherwise.
    pub fn for_layer(config: &Config, compressed: bool) -> Rope {
        let cfg = if compressed {
            &config.rope_compress
        } else {
            &config.rope_main
        };
        Rope::new(cfg, config.rope_dim)
    }

    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    pub fn rope_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// Rotates the last `rope_dim` channels of `x` to position `pos`; `inverse` rotates by `-φ`.
    pub fn apply(&self, x: &mut [f32], pos: usize, inverse: bool) {
        let direction = if inverse {
            RopeDirection::Inverse
        } else {
            RopeDirection::Forward
        };
        rope_rotate(x, &self.inv_freq, pos, direction);
    }

    /// Applies [`Rope::apply`] to every `width`-sized vector of `x`.
    pub fn apply_each(&self, x: &mut [f32], width: usize, pos: usize, inverse: bool) {
        for v in x.chunks_exact_mut(width) {
            self.apply(v, pos, inverse);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn flash_compress_yarn_keeps_fast_pairs_and_divides_slow_ones() {
        let cfg = Config::flash();
        let main = Rope::for_layer(&cfg, false);
        let comp = Rope::for_layer(&cfg, true);
        // Spec §2: lo = 15, hi = 25 for Flash; pairs below lo keep θ^(-2i/64), pairs ≥ hi are /16.
        for i in 0..32 {
            let w0 = 160000f64.powf(-(2.0 * i as f64) / 64.0);
            let got = comp.inv_freq()[i] as f64;
            if i <= 15 {
                assert!((got / w0 - 1.0).abs() < 1e-6, "pair {i}");
            }
            if i >= 25 {
                assert!((got * 16.0 / w0 - 1.0).abs() < 1e-6, "pair {i}");
            }
        }
        assert!((main.inv_freq()[1] as f64 - 10000f64.powf(-2.0 / 64.0)).abs() < 1e-7);
    }

    #[test]
    fn inverse_undoes_rotation_and_leaves_nope_channels() {
        let rope = Rope::for_layer(&Config::flash(), true);
        let orig: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let mut x = orig.clone();
        rope.apply(&mut x, 12345, false);
        assert_eq!(&x[..448], &orig[..448]);
        assert!(x[448..].iter().zip(&orig[448..]).any(|(a, b)| a != b));
        rope.apply(&mut x, 12345, true);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}
