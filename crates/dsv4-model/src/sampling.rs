//! Next-token selection from logits: greedy, or temperature + nucleus (top-p) sampling.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use dsv4_ops::gpu::sample::{check_temperature, check_top_p, SamplingError};

pub struct Sampler {
    temperature: f32,
    top_p: f32,
    rng: StdRng,
}

impl Sampler {
    /// `temperature` 0 means greedy (as does one so small that its inverse overflows); `top_p`
    /// keeps the smallest set of most likely tokens whose probabilities add up to at least
    /// `top_p` (1 keeps all). Same seed, same draws.
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Result<Self, SamplingError> {
        Ok(Self {
            temperature: check_temperature(temperature)?,
            top_p: check_top_p(top_p)?,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    pub fn greedy() -> Self {
        Self::new(0.0, 1.0, 0).expect("greedy settings are valid")
    }

    /// Picks a token id. NaN logits are never picked.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty(), "no logits to sample from");
        let inv_t = 1.0 / self.temperature;
        if !inv_t.is_finite() {
            return argmax(logits);
        }
        let max = logits
            .iter()
            .copied()
            .filter(|x| !x.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        // All masked, or an infinite logit that takes all the mass: the first maximum.
        if max.is_infinite() {
            return argmax(logits);
        }
        // softmax numerators, shifted by the max so the largest is exp(0) = 1
        let weights: Vec<f32> = logits
            .iter()
            .map(|&x| {
                if x.is_nan() {
                    0.0
                } else {
                    ((x - max) * inv_t).exp()
                }
            })
            .collect();

        let mut candidates: Vec<u32> = (0..logits.len() as u32).collect();
        if self.top_p < 1.0 {
            // most likely first; equal weights keep the lower id first
            candidates.sort_by(|&a, &b| weights[b as usize].total_cmp(&weights[a as usize]));
            let total: f32 = weights.iter().sum();
            let mut kept = 0.0f32;
            let mut keep = 0;
            for &id in &candidates {
                kept += weights[id as usize];
                keep += 1;
                if kept >= self.top_p * total {
                    break;
                }
            }
            candidates.truncate(keep);
        }

        let total: f32 = candidates.iter().map(|&id| weights[id as usize]).sum();
        let mut target = self.rng.random::<f32>() * total;
        for &id in &candidates {
            let w = weights[id as usize];
            if target < w {
                return id;
            }
            target -= w;
        }
        // rounding left `target` just past the last weight: take the last token with weight
        *candidates
            .iter()
            .rev()
            .find(|&&id| weights[id as usize] > 0.0)
            .expect("the max logit has weight 1")
    }
}

/// Index of the largest logit (the lowest index among equals); NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        if x > best_value {
            best = i;
            best_value = x;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROBS: [f32; 4] = [0.1, 0.2, 0.3, 0.4];

    fn logits_of(probs: &[f32]) -> Vec<f32> {
        // an arbitrary offset: softmax must not depend on it
        probs.iter().map(|p| p.ln() + 37.0).collect()
    }

    fn frequencies(sampler: &mut Sampler, logits: &[f32], draws: usize) -> Vec<f64> {
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..draws {
            counts[sampler.sample(logits) as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    #[test]
    fn greedy_picks_argmax() {
        let logits = [0.5, -1.0, 3.25, 3.0, f32::NAN, 2.0];
        assert_eq!(Sampler::greedy().sample(&logits), 2);
        assert_eq!(Sampler::new(0.0, 0.9, 7).unwrap().sample(&logits), 2);
        assert_eq!(
            argmax(&[1.0, 4.0, 4.0, -2.0]),
            1,
            "ties go to the lowest id"
        );
        assert_eq!(argmax(&[f32::NAN, -5.0]), 1);
    }

    #[test]
    fn bad_settings_are_errors() {
        for t in [f32::NAN, f32::INFINITY, -1.0, -0.0001] {
            assert!(matches!(
                Sampler::new(t, 1.0, 0),
                Err(SamplingError::Temperature(_))
            ));
        }
        for p in [0.0, -0.5, 1.5, f32::NAN] {
            assert!(matches!(
                Sampler::new(1.0, p, 0),
                Err(SamplingError::TopP(_))
            ));
        }
        // A temperature whose inverse overflows samples greedily.
        let logits = [0.5, 3.0, 2.0];
        assert_eq!(Sampler::new(1e-45, 1.0, 0).unwrap().sample(&logits), 1);
    }

    #[test]
    fn tiny_top_p_is_argmax() {
        let logits = logits_of(&[0.3, 0.25, 0.45]);
        for seed in 0..50 {
            assert_eq!(Sampler::new(1.5, 1e-6, seed).unwrap().sample(&logits), 2);
        }
    }

    #[test]
    fn same_seed_same_sequence() {
        let logits = logits_of(&PROBS);
        let draw = |seed| {
            let mut s = Sampler::new(1.0, 0.95, seed).unwrap();
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }

    #[test]
    fn frequencies_follow_softmax() {
        let logits = logits_of(&PROBS);
        let freq = frequencies(&mut Sampler::new(1.0, 1.0, 1).unwrap(), &logits, 40_000);
        for (f, p) in freq.iter().zip(PROBS) {
            assert!((f - p as f64).abs() < 0.01, "{freq:?}");
        }
    }

    #[test]
    fn temperature_sharpens() {
        // T = 0.5 squares the probabilities before renormalizing
        let logits = logits_of(&PROBS);
        let freq = frequencies(&mut Sampler::new(0.5, 1.0, 2).unwrap(), &logits, 40_000);
        let norm: f32 = PROBS.iter().map(|p| p * p).sum();
        for (f, p) in freq.iter().zip(PROBS) {
            assert!((f - (p * p / norm) as f64).abs() < 0.01, "{freq:?}");
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // sorted: 0.4, 0.3 (cumulative 0.7 >= 0.5) — tokens 0 and 1 are cut
        let logits = logits_of(&PROBS);
        let freq = frequencies(&mut Sampler::new(1.0, 0.5, 3).unwrap(), &logits, 40_000);
        assert_eq!(freq[0], 0.0);
        assert_eq!(freq[1], 0.0);
        assert!((freq[2] - 3.0 / 7.0).abs() < 0.01, "{freq:?}");
        assert!((freq[3] - 4.0 / 7.0).abs() < 0.01, "{freq:?}");
    }

    #[test]
    fn masked_and_nan_logits_are_never_sampled() {
        let logits = [f32::NEG_INFINITY, 0.0, f32::NAN, 0.0];
        let freq = frequencies(&mut Sampler::new(1.0, 1.0, 4).unwrap(), &logits, 2_000);
        assert_eq!((freq[0], freq[2]), (0.0, 0.0));
        assert!(freq[1] > 0.4 && freq[3] > 0.4, "{freq:?}");
        let mut s = Sampler::new(1.0, 0.9, 4).unwrap();
        assert_eq!(s.sample(&[1.0, f32::INFINITY, f32::NAN]), 1);
        assert_eq!(s.sample(&[f32::NAN, f32::NEG_INFINITY]), 0);
    }
}
