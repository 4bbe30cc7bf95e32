//! Pieces shared by the model GPU tests.

use dsv4_graph::{eager_step, DecodeGraph};
use dsv4_model::gpu::GpuModel;
use dsv4_ops::gpu::sample::Sampling;

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb).max(f64::MIN_POSITIVE)
}

pub fn greedy() -> Sampling {
    Sampling {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
    }
}

/// Greedy decode of `steps` tokens after `prompt`, by graph replays or eager launches: the
/// sampled tokens and the logits each was sampled from (the prompt's last row first).
pub fn decode(
    model: &mut GpuModel,
    prompt: &[u32],
    steps: usize,
    graph: bool,
) -> (Vec<u32>, Vec<f32>) {
    let s = greedy();
    model.reset().unwrap();
    model.prefill(prompt, &s).unwrap();
    let mut tokens = vec![model.read_token().unwrap()];
    // The prefill's head runs the last prompt token alone, into row 0.
    let mut logits = model.read_logits(0).unwrap();
    let g = graph.then(|| DecodeGraph::capture(model, 1).unwrap());
    for _ in 0..steps {
        let t = match &g {
            Some(g) => g.step(model).unwrap(),
            None => eager_step(model).unwrap(),
        };
        tokens.push(t);
        logits.extend(model.read_logits(0).unwrap());
    }
    (tokens, logits)
}
