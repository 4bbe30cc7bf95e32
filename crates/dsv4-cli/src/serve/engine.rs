//! The thread that owns the model: it takes one request at a time from a bounded queue,
//! generates, and sends the text as it comes (split into reasoning and answer in thinking
//! mode, stop strings cut) to the request's channel. A request whose channel is closed (its
//! client went away) is cancelled at the next token.

use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use tokio::sync::mpsc::UnboundedSender;

use dsv4_graph::DecodeGraph;
use dsv4_model::cpu::{CpuModel, Logits, SequenceState};
use dsv4_model::gpu::GpuModel;
use dsv4_model::sampling::Sampler;
use dsv4_model::tokenizer::Tokenizer;
use dsv4_ops::gpu::sample::Sampling;

use super::metrics::Metrics;
use super::stop::StopMatcher;

/// One generation request, validated.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub stops: Vec<String>,
    /// The output starts inside the reasoning (thinking mode) until the end-of-thinking token.
    pub thinking: bool,
    pub events: UnboundedSender<Event>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

pub enum Event {
    /// New text of the answer and of the reasoning (either may be empty).
    Text {
        content: String,
        reasoning: String,
    },
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed(String),
}

/// A model that generates one sequence at a time.
pub trait Backend {
    /// Positions a sequence may take (prompt and generated tokens).
    fn capacity(&self) -> usize;
    /// Reads `prompt` into a fresh sequence and returns the first generated token.
    fn start(&mut self, prompt: &[u32], s: &Sampling) -> Result<u32>;
    /// The next token.
    fn next(&mut self) -> Result<u32>;
}

/// The f32 CPU reference.
pub struct Cpu {
    pub model: CpuModel,
    pub capacity: usize,
    pub run: Option<(SequenceState, Sampler, u32)>,
}

impl Backend for Cpu {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn start(&mut self, prompt: &[u32], s: &Sampling) -> Result<u32> {
        let mut sampler = Sampler::new(s.temperature, s.top_p, s.seed)?;
        let mut state = self.model.new_state();
        let logits = self.model.forward(&mut state, prompt, Logits::Last)?;
        let t = sampler.sample(&logits);
        self.run = Some((state, sampler, t));
        Ok(t)
    }

    fn next(&mut self) -> Result<u32> {
        let (state, sampler, last) = self.run.as_mut().expect("a sequence was started");
        let logits = self.model.forward(state, &[*last], Logits::Last)?;
        *last = sampler.sample(&logits);
        Ok(*last)
    }
}

/// The GPU model, each decode step one graph replay (captured per request, with its sampling).
pub struct Gpu {
    pub model: GpuModel,
    pub graph: Option<DecodeGraph>,
}

impl Backend for Gpu {
    fn capacity(&self) -> usize {
        self.model.capacity()
    }

    fn start(&mut self, prompt: &[u32], s: &Sampling) -> Result<u32> {
        self.graph = None;
        self.model.reset()?;
        self.model.prefill(prompt, s)?;
        let first = self.model.read_token()?;
        self.graph = Some(DecodeGraph::capture(&mut self.model, s)?);
        Ok(first)
    }

    fn next(&mut self) -> Result<u32> {
        let graph = self.graph.as_ref().expect("a sequence was started");
        Ok(graph.step(&mut self.model)?)
    }
}

/// What the engine needs besides the model.
pub struct Text {
    pub tokenizer: Arc<Tokenizer>,
    pub eos: Vec<u32>,
    /// The end-of-thinking token, when the vocabulary has it as one token.
    pub think_end: Option<u32>,
}

/// Serves jobs until the queue's senders are gone. Once `metrics.stopping` is set (the server
/// is shutting down) the running job ends at its next token and waiting ones are refused.
pub fn run(mut backend: Box<dyn Backend>, text: Text, jobs: Receiver<Job>, metrics: Arc<Metrics>) {
    // `alive` falls when this returns or unwinds: /health then reports the engine gone.
    struct Alive<'a>(&'a Metrics);
    impl Drop for Alive<'_> {
        fn drop(&mut self) {
            self.0.alive.store(false, Ordering::Relaxed);
        }
    }
    let _alive = Alive(&metrics);
    while let Ok(job) = jobs.recv() {
        metrics.queued.fetch_sub(1, Ordering::Relaxed);
        if metrics.stopping.load(Ordering::Relaxed) {
            let _ = job
                .events
                .send(Event::Failed("the server is shutting down".into()));
            continue;
        }
        // A client that left while its request waited costs nothing.
        if job.events.is_closed() {
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        metrics.running.fetch_add(1, Ordering::Relaxed);
        let events = job.events.clone();
        match serve(backend.as_mut(), &text, job, &metrics) {
            Ok(true) => {}
            Ok(false) => {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                let _ = events.send(Event::Failed(format!("{e:#}")));
            }
        }
        metrics.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Generates one job's text; false when its client went away first.
fn serve(backend: &mut dyn Backend, text: &Text, job: Job, metrics: &Metrics) -> Result<bool> {
    let start = Instant::now();
    let send = |e: Event| job.events.send(e).is_ok();
    let mut token = backend.start(&job.prompt, &job.sampling)?;
    let first_at = Instant::now();
    metrics.observe_ttft(start.elapsed().as_secs_f64());
    let (mut answer, mut reasoning) = (text.tokenizer.stream(), text.tokenizer.stream());
    let mut stop = StopMatcher::new(job.stops.clone());
    let mut in_reasoning = job.thinking;
    let mut generated = 0;
    let mut hit_stop = false;
    let mut finish = loop {
        generated += 1;
        if text.eos.contains(&token) {
            break Finish::Stop;
        }
        let (mut content, mut thought) = (String::new(), String::new());
        if in_reasoning && Some(token) == text.think_end {
            in_reasoning = false;
            let done = std::mem::replace(&mut reasoning, text.tokenizer.stream());
            thought = done.finish()?.unwrap_or_default();
        } else if in_reasoning {
            thought = reasoning.push(token)?.unwrap_or_default();
        } else if let Some(t) = answer.push(token)? {
            (content, hit_stop) = stop.push(&t);
        }
        if (!content.is_empty() || !thought.is_empty())
            && !send(Event::Text {
                content,
                reasoning: thought,
            })
        {
            return Ok(false);
        }
        if hit_stop {
            break Finish::Stop;
        }
        if generated >= job.max_tokens || metrics.stopping.load(Ordering::Relaxed) {
            break Finish::Length;
        }
        if job.events.is_closed() {
            return Ok(false);
        }
        token = backend.next()?;
    };
    // What the text streams and the stop matcher still hold (nothing after a stop string).
    let (mut content, mut thought) = (String::new(), String::new());
    if !hit_stop {
        if let Some(t) = answer.finish()? {
            (content, hit_stop) = stop.push(&t);
        }
        if hit_stop {
            finish = Finish::Stop;
        } else {
            content.push_str(&stop.finish());
        }
        if in_reasoning {
            thought = reasoning.finish()?.unwrap_or_default();
        }
    }
    finish_with(&job, finish, generated, content, thought, metrics, first_at)
}

/// Sends the last text and the end of the job, and records its figures.
fn finish_with(
    job: &Job,
    finish: Finish,
    generated: usize,
    content: String,
    reasoning: String,
    metrics: &Metrics,
    first_at: Instant,
) -> Result<bool> {
    if (!content.is_empty() || !reasoning.is_empty())
        && job.events.send(Event::Text { content, reasoning }).is_err()
    {
        return Ok(false);
    }
    if generated > 1 {
        metrics.observe_tpot(first_at.elapsed().as_secs_f64() / (generated - 1) as f64);
    }
    metrics
        .prompt_tokens
        .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
    metrics
        .generated_tokens
        .fetch_add(generated as u64, Ordering::Relaxed);
    Ok(job
        .events
        .send(Event::Done {
            finish,
            prompt_tokens: job.prompt.len(),
            completion_tokens: generated,
        })
        .is_ok())
}
