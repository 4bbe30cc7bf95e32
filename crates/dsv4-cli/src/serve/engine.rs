//! The thread that owns the model: it takes requests from a bounded queue into the model's
//! sequence slots, advances every running sequence a token a step, and sends each token id as
//! it comes to its request's channel (the request's task makes the text: `text`). A request
//! whose channel is closed (its client went away) is cancelled at its next token and frees its
//! slot; one whose text stage found a stop string ends there.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use tokio::sync::mpsc::UnboundedSender;

use dsv4_graph::DecodeGraph;
use dsv4_model::cpu::{CpuModel, Logits, SequenceState};
use dsv4_model::gpu::{GpuModel, PromptPart};
use dsv4_model::sampling::Sampler;
use dsv4_ops::gpu::sample::Sampling;

use super::metrics::Metrics;

/// One generation request, validated.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub events: UnboundedSender<Event>,
    /// Set by the request's task when its text ends it.
    pub text_end: Arc<TextEnd>,
}

/// How a request's text ended it, set by the request's task (`text`) and read by the engine,
/// which then ends the sequence: after a stop string, with the tokens the request took; or
/// because the text could not be made.
#[derive(Default)]
pub struct TextEnd(AtomicUsize);

impl TextEnd {
    const FAILED: usize = usize::MAX;

    /// A stop string ended the request at its `tokens`-th token.
    pub fn stop(&self, tokens: usize) {
        self.0
            .store(tokens.clamp(1, Self::FAILED - 1), Ordering::Relaxed);
    }

    pub fn fail(&self) {
        self.0.store(Self::FAILED, Ordering::Relaxed);
    }

    /// None while the text goes on; the tokens taken after a stop string; Err after a failure.
    pub fn get(&self) -> Option<Result<usize>> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            Self::FAILED => Some(Err(anyhow::anyhow!("making the request's text failed"))),
            n => Some(Ok(n)),
        }
    }
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
    /// The next generated token (not an end-of-sequence one).
    Token(u32),
    Done {
        finish: Finish,
        completion_tokens: usize,
    },
    Failed(String),
}

/// The next part of slot `slot`'s prompt: `first` starts a fresh sequence, `last` ends the
/// prompt.
pub struct Part<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
    pub sampling: &'a Sampling,
    pub first: bool,
    pub last: bool,
}

/// A model with `slots()` sequence slots, each holding one sequence's state.
pub trait Backend {
    /// Positions a sequence may take (prompt and generated tokens).
    fn capacity(&self) -> usize;
    /// Sequences it holds at once.
    fn slots(&self) -> usize;
    /// Prompt tokens the sequences read per engine step, other sequences' tokens in between.
    fn prefill_chunk(&self) -> usize;
    /// Reads the prompt parts (distinct slots, at most `prefill_chunk()` tokens in all) and
    /// returns, for each that ends its prompt, the first generated token.
    fn prefill(&mut self, parts: &[Part]) -> Result<Vec<Option<u32>>>;
    /// Starts the next token of every slot in `slots` (each started); [`Backend::collect`]
    /// returns them, in that order. The device may run it while the host handles the tokens
    /// of the step before; a [`Backend::prefill`] issued before the collect runs after it (so
    /// a slot freed meanwhile may take a new sequence).
    fn launch(&mut self, slots: &[usize]) -> Result<()>;
    /// The tokens of the last launch.
    fn collect(&mut self) -> Result<Vec<u32>>;
}

/// Prompt tokens a CPU sequence reads per engine step.
const CPU_PREFILL_CHUNK: usize = 64;

/// The f32 CPU reference: one state per slot, a step runs each slot's token in turn. A launch
/// only records its slots and `collect` runs them, so the engine's host work between steps is
/// measured apart from the model's, as on the GPU; a `prefill` in between runs them first, as
/// the GPU's stream would (a freed slot's step must not run on the sequence read into it).
pub struct Cpu {
    model: CpuModel,
    capacity: usize,
    runs: Vec<Option<(SequenceState, Sampler, u32)>>,
    /// The last launch's slots, not run yet.
    launched: Vec<usize>,
    /// The last launch's tokens, once run.
    tokens: Vec<u32>,
}

impl Cpu {
    /// `slots` sequences of at most `capacity` positions each.
    pub fn new(model: CpuModel, capacity: usize, slots: usize) -> Cpu {
        Cpu {
            model,
            capacity,
            runs: (0..slots).map(|_| None).collect(),
            launched: Vec::new(),
            tokens: Vec::new(),
        }
    }

    /// Runs the launched step, if it has not run.
    fn run_launched(&mut self) -> Result<()> {
        for slot in std::mem::take(&mut self.launched) {
            let (state, sampler, last) = self.runs[slot].as_mut().expect("a started slot");
            let logits = self.model.forward(state, &[*last], Logits::Last)?;
            *last = sampler.sample(&logits);
            self.tokens.push(*last);
        }
        Ok(())
    }
}

impl Backend for Cpu {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn slots(&self) -> usize {
        self.runs.len()
    }

    fn prefill_chunk(&self) -> usize {
        CPU_PREFILL_CHUNK
    }

    fn prefill(&mut self, parts: &[Part]) -> Result<Vec<Option<u32>>> {
        self.run_launched()?;
        parts
            .iter()
            .map(|p| {
                if p.first {
                    let s = p.sampling;
                    let sampler = Sampler::new(s.temperature, s.top_p, s.seed)?;
                    self.runs[p.slot] = Some((self.model.new_state(), sampler, 0));
                }
                let (state, sampler, next) = self.runs[p.slot].as_mut().expect("a started slot");
                let logits = self.model.forward(state, p.tokens, Logits::Last)?;
                Ok(p.last.then(|| {
                    *next = sampler.sample(&logits);
                    *next
                }))
            })
            .collect()
    }

    fn launch(&mut self, slots: &[usize]) -> Result<()> {
        self.tokens.clear();
        self.launched = slots.to_vec();
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<u32>> {
        self.run_launched()?;
        Ok(std::mem::take(&mut self.tokens))
    }
}

/// The GPU model: a slot per sequence in the device state; a step decodes the first `n`
/// slots as one graph replay, `n` the smallest bucket (1, 2, 4, ...) that covers the highest
/// running slot (rows of idle slots below it are computed and dropped). Each bucket's graph is
/// captured after its first step, which runs eagerly. The prompts waiting are read together,
/// a chunk of their tokens a pass.
pub struct Gpu {
    pub model: GpuModel,
    /// By rows.
    pub graphs: BTreeMap<usize, DecodeGraph>,
    /// The last launch: its rows and slots, or its tokens when it was read already.
    launched: Launched,
}

enum Launched {
    Running { rows: usize, slots: Vec<usize> },
    Read(Vec<u32>),
}

impl Gpu {
    pub fn new(model: GpuModel) -> Gpu {
        Gpu {
            model,
            graphs: BTreeMap::new(),
            launched: Launched::Read(Vec::new()),
        }
    }
}

/// The rows a step of `slots` decodes: a power of two past the highest slot, at most `most`.
fn bucket(slots: &[usize], most: usize) -> usize {
    let high = slots.iter().max().map_or(1, |s| s + 1);
    high.next_power_of_two().min(most)
}

impl Backend for Gpu {
    fn capacity(&self) -> usize {
        self.model.capacity()
    }

    fn slots(&self) -> usize {
        self.model.sequences()
    }

    fn prefill_chunk(&self) -> usize {
        self.model.chunk()
    }

    fn prefill(&mut self, parts: &[Part]) -> Result<Vec<Option<u32>>> {
        for p in parts.iter().filter(|p| p.first) {
            self.model.reset_slot(p.slot)?;
        }
        let model_parts: Vec<PromptPart> = parts
            .iter()
            .map(|p| PromptPart {
                slot: p.slot,
                tokens: p.tokens,
                sampling: p.last.then_some(p.sampling),
            })
            .collect();
        self.model.prefill_parts(&model_parts)?;
        let Some(high) = parts.iter().filter(|p| p.last).map(|p| p.slot).max() else {
            return Ok(vec![None; parts.len()]);
        };
        let next = self.model.read_tokens(high + 1)?;
        Ok(parts.iter().map(|p| p.last.then(|| next[p.slot])).collect())
    }

    fn launch(&mut self, slots: &[usize]) -> Result<()> {
        let rows = bucket(slots, self.model.sequences());
        if let Some(graph) = self.graphs.get(&rows) {
            graph.replay_slots(&mut self.model, slots)?;
            self.launched = Launched::Running {
                rows,
                slots: slots.to_vec(),
            };
            return Ok(());
        }
        // The bucket's first step runs eagerly (loading its kernels), then is captured.
        self.model.check_slots(rows, slots, 1)?;
        self.model.launch_decode_step(rows)?;
        self.model.note_decoded(slots, 1);
        let all = self.model.read_tokens(rows)?;
        self.launched = Launched::Read(slots.iter().map(|&s| all[s]).collect());
        let graph = DecodeGraph::capture(&mut self.model, rows)?;
        self.graphs.insert(rows, graph);
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<u32>> {
        match std::mem::replace(&mut self.launched, Launched::Read(Vec::new())) {
            Launched::Running { rows, slots } => {
                let all = self.model.read_tokens(rows)?;
                Ok(slots.iter().map(|&s| all[s]).collect())
            }
            Launched::Read(tokens) => Ok(tokens),
        }
    }
}

/// A running sequence: its job, its slot, and the tokens it has generated.
struct Running {
    job: Job,
    slot: usize,
    /// Tells this sequence from a later one in the same slot.
    id: u64,
    generated: usize,
    first_at: Instant,
}

/// How a token left a sequence.
enum After {
    Continue,
    Finished,
    /// The client went away.
    Gone,
}

impl Running {
    fn new(job: Job, slot: usize, id: u64) -> Running {
        Running {
            job,
            slot,
            id,
            generated: 0,
            first_at: Instant::now(),
        }
    }

    /// Takes the sequence's next token: sends it, and says whether the sequence goes on. A
    /// request whose text has ended (a stop string) does not read it.
    fn take(&mut self, token: u32, eos: &[u32], stopping: bool) -> Result<After> {
        if let Some(end) = self.job.text_end.get() {
            return self.text_ended(end);
        }
        match self.accept(token, eos, stopping) {
            // The request's task may have ended it and closed the channel since.
            After::Gone => match self.job.text_end.get() {
                Some(end) => self.text_ended(end),
                None => Ok(After::Gone),
            },
            after => Ok(after),
        }
    }

    fn accept(&mut self, token: u32, eos: &[u32], stopping: bool) -> After {
        self.generated += 1;
        if eos.contains(&token) {
            return self.done(Finish::Stop);
        }
        if self.job.events.send(Event::Token(token)).is_err() {
            return After::Gone;
        }
        if self.generated >= self.job.max_tokens || stopping {
            return self.done(Finish::Length);
        }
        if self.job.events.is_closed() {
            After::Gone
        } else {
            After::Continue
        }
    }

    /// The request's text ended it: finished at the tokens it took (the ones generated past
    /// them were not read), or failed.
    fn text_ended(&mut self, end: Result<usize>) -> Result<After> {
        self.generated = end?;
        Ok(After::Finished)
    }

    /// Sends the end of the job.
    fn done(&self, finish: Finish) -> After {
        let sent = self.job.events.send(Event::Done {
            finish,
            completion_tokens: self.generated,
        });
        if sent.is_ok() {
            After::Finished
        } else {
            After::Gone
        }
    }
}

/// Serves jobs until the queue's senders are gone, up to `backend.slots()` at once: waiting
/// requests are admitted between steps, each step reads a chunk of the admitted prompts'
/// tokens in one pass (the oldest first, several short ones together) and advances every
/// running sequence one token (so running streams keep flowing while a long prompt is read),
/// and a sequence that ends or whose client left frees its slot at once. Once
/// `metrics.stopping` is set (the server is shutting down) running sequences end at their next
/// token and waiting ones are refused.
pub fn run(mut backend: Box<dyn Backend>, eos: &[u32], jobs: Receiver<Job>, metrics: Arc<Metrics>) {
    // `alive` falls when this returns or unwinds: /health then reports the engine gone.
    struct Alive<'a>(&'a Metrics);
    impl Drop for Alive<'_> {
        fn drop(&mut self) {
            self.0.alive.store(false, Ordering::Relaxed);
        }
    }
    let _alive = Alive(&metrics);
    let mut prefilling: Vec<Prefilling> = Vec::new();
    let mut running: Vec<Running> = Vec::new();
    let mut free: Vec<usize> = (0..backend.slots()).rev().collect();
    // The step in flight: the ids of the sequences it decodes, in its order.
    let mut inflight: Vec<u64> = Vec::new();
    let mut next_id = 0u64;
    let chunk = backend.prefill_chunk().max(1);
    loop {
        // Admit waiting requests into free slots, the lowest first (the GPU's steps cover the
        // slots up to the highest running one); wait for one only when nothing runs.
        free.sort_unstable_by(|a, b| b.cmp(a));
        while let Some(&slot) = free.last() {
            let idle = running.is_empty() && prefilling.is_empty();
            let job = if idle {
                match jobs.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                }
            } else {
                match jobs.try_recv() {
                    Ok(job) => job,
                    Err(_) => break,
                }
            };
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
            free.pop();
            metrics.running.fetch_add(1, Ordering::Relaxed);
            prefilling.push(Prefilling {
                job,
                slot,
                done: 0,
                start: Instant::now(),
            });
        }
        // A chunk of the waiting prompts' tokens (the oldest first), then a token for every
        // running sequence. A prompt whose client left frees its slot.
        for p in std::mem::take(&mut prefilling) {
            if p.job.events.is_closed() {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                metrics.running.fetch_sub(1, Ordering::Relaxed);
                free.push(p.slot);
            } else {
                prefilling.push(p);
            }
        }
        if !prefilling.is_empty() {
            let mut budget = chunk;
            let mut parts = Vec::new();
            for p in &prefilling {
                if budget == 0 {
                    break;
                }
                let len = p.job.prompt.len();
                let end = len.min(p.done + budget);
                budget -= end - p.done;
                parts.push(Part {
                    slot: p.slot,
                    tokens: &p.job.prompt[p.done..end],
                    sampling: &p.job.sampling,
                    first: p.done == 0,
                    last: end == len,
                });
            }
            let read: Vec<usize> = parts.iter().map(|p| p.tokens.len()).collect();
            let pass = backend.prefill(&parts);
            for (i, mut p) in std::mem::take(&mut prefilling).into_iter().enumerate() {
                // Not in the pass: it waits for the next.
                let Some(&n) = read.get(i) else {
                    prefilling.push(p);
                    continue;
                };
                let first = match &pass {
                    Ok(firsts) => firsts.get(i).copied().flatten(),
                    // A failed pass fails every prompt in it.
                    Err(e) => {
                        let _ = p.job.events.send(Event::Failed(format!("{e:#}")));
                        metrics.running.fetch_sub(1, Ordering::Relaxed);
                        free.push(p.slot);
                        continue;
                    }
                };
                p.done += n;
                // A prompt's earlier part: it reads on.
                let Some(t) = first else {
                    prefilling.push(p);
                    continue;
                };
                metrics.observe_ttft(p.start.elapsed().as_secs_f64());
                next_id += 1;
                let mut seq = Running::new(p.job, p.slot, next_id);
                let after = seq.take(t, eos, metrics.stopping.load(Ordering::Relaxed));
                if let Some(seq) = settle(seq, after, &metrics, &mut free) {
                    running.push(seq);
                }
            }
        }
        if running.is_empty() && inflight.is_empty() {
            continue;
        }
        // The step in flight (launched before the last tokens were handled), or one now.
        if inflight.is_empty() {
            if let Err(e) = launch(&mut *backend, &running, &mut inflight, |_| true) {
                let all: Vec<u64> = running.iter().map(|r| r.id).collect();
                fail(&mut running, &all, &e, &metrics, &mut free);
                continue;
            }
        }
        let stopping = metrics.stopping.load(Ordering::Relaxed);
        let decoded: Vec<(u64, u32)> = match backend.collect() {
            Ok(t) => std::mem::take(&mut inflight).into_iter().zip(t).collect(),
            Err(e) => {
                // A failed step fails every sequence in it.
                let failed: Vec<u64> = std::mem::take(&mut inflight);
                fail(&mut running, &failed, &e, &metrics, &mut free);
                continue;
            }
        };
        let read_at = Instant::now();
        let token_of = |id: u64| decoded.iter().find(|d| d.0 == id).map(|d| d.1);
        // The next step starts now, while these tokens are handled: every running sequence
        // that this step's token does not end by length (one that ends otherwise has its
        // extra token dropped).
        if !stopping {
            let goes_on = |r: &Running| {
                r.job.text_end.get().is_none()
                    && r.generated + usize::from(token_of(r.id).is_some()) < r.job.max_tokens
            };
            match launch(&mut *backend, &running, &mut inflight, goes_on) {
                Ok(true) => metrics.observe_launch_gap(read_at.elapsed().as_secs_f64()),
                Ok(false) => {}
                Err(e) => {
                    let all: Vec<u64> = running.iter().map(|r| r.id).collect();
                    fail(&mut running, &all, &e, &metrics, &mut free);
                    continue;
                }
            }
        }
        let now = std::mem::take(&mut running);
        for mut seq in now {
            let after = if let Some(t) = token_of(seq.id) {
                seq.take(t, eos, stopping)
            } else if let Some(end) = seq.job.text_end.get() {
                // Left out of the step: its text has ended.
                seq.text_ended(end)
            } else {
                // It joined after the step was launched: it waits for the next.
                running.push(seq);
                continue;
            };
            if let Some(seq) = settle(seq, after, &metrics, &mut free) {
                running.push(seq);
            }
        }
        metrics.observe_step_host(read_at.elapsed().as_secs_f64());
    }
}

/// Launches a step of the running sequences that `pick` takes (none: no launch, false),
/// recording them, by id, as the step in flight.
fn launch(
    backend: &mut dyn Backend,
    running: &[Running],
    inflight: &mut Vec<u64>,
    pick: impl Fn(&Running) -> bool,
) -> Result<bool> {
    let picked: Vec<&Running> = running.iter().filter(|r| pick(r)).collect();
    if picked.is_empty() {
        return Ok(false);
    }
    let slots: Vec<usize> = picked.iter().map(|r| r.slot).collect();
    backend.launch(&slots)?;
    *inflight = picked.iter().map(|r| r.id).collect();
    Ok(true)
}

/// Fails the running sequences among `ids` with `e`.
fn fail(
    running: &mut Vec<Running>,
    ids: &[u64],
    e: &anyhow::Error,
    metrics: &Metrics,
    free: &mut Vec<usize>,
) {
    for seq in std::mem::take(running) {
        if ids.contains(&seq.id) {
            settle(seq, Err(anyhow::anyhow!("{e:#}")), metrics, free);
        } else {
            running.push(seq);
        }
    }
}

/// A sequence reading its prompt, a part each engine step.
struct Prefilling {
    job: Job,
    slot: usize,
    /// Prompt tokens read so far.
    done: usize,
    start: Instant,
}

/// Keeps a sequence that goes on; records and frees one that ended, was cancelled or failed.
fn settle(
    seq: Running,
    after: Result<After>,
    metrics: &Metrics,
    free: &mut Vec<usize>,
) -> Option<Running> {
    match after {
        Ok(After::Continue) => return Some(seq),
        Ok(After::Finished) => {
            if seq.generated > 1 {
                let per = seq.first_at.elapsed().as_secs_f64() / (seq.generated - 1) as f64;
                metrics.observe_tpot(per);
            }
            metrics
                .prompt_tokens
                .fetch_add(seq.job.prompt.len() as u64, Ordering::Relaxed);
            metrics
                .generated_tokens
                .fetch_add(seq.generated as u64, Ordering::Relaxed);
        }
        Ok(After::Gone) => {
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            let _ = seq.job.events.send(Event::Failed(format!("{e:#}")));
        }
    }
    metrics.running.fetch_sub(1, Ordering::Relaxed);
    free.push(seq.slot);
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A greedy request for `prompt`, and the stream its events go to.
    fn job(
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt,
            max_tokens,
            sampling: Sampling {
                temperature: 0.0,
                top_p: 1.0,
                seed: 0,
            },
            events,
            text_end: Arc::new(TextEnd::default()),
        };
        (job, rx)
    }

    fn running(max_tokens: usize) -> (Running, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (job, rx) = job(vec![1, 2], max_tokens);
        (Running::new(job, 0, 1), rx)
    }

    #[test]
    fn a_text_end_ends_the_sequence_with_the_tokens_it_took_or_fails_it() {
        // Tokens go to the request while its text goes on.
        let (mut seq, mut rx) = running(8);
        assert!(matches!(seq.take(5, &[0], false), Ok(After::Continue)));
        assert!(matches!(rx.try_recv(), Ok(Event::Token(5))));
        // A stop string at the request's second token: the third is not read, the sequence
        // finishes counting two.
        seq.take(6, &[0], false).unwrap();
        seq.job.text_end.stop(2);
        assert!(matches!(seq.take(7, &[0], false), Ok(After::Finished)));
        assert_eq!(seq.generated, 2);
        // Also once the request's task has closed the channel.
        let (mut seq, rx) = running(8);
        seq.job.text_end.stop(1);
        drop(rx);
        assert!(matches!(seq.take(5, &[0], false), Ok(After::Finished)));
        // A text that could not be made fails the sequence.
        let (mut seq, _rx) = running(8);
        seq.job.text_end.fail();
        let err = seq.take(5, &[0], false).err().expect("a failure");
        assert!(err.to_string().contains("text failed"), "{err}");
        // Without a text end, a closed channel is a client that left.
        let (mut seq, rx) = running(8);
        drop(rx);
        assert!(matches!(seq.take(5, &[0], false), Ok(After::Gone)));
    }

    /// A pass's parts as (slot, tokens, first, last).
    type Pass = Vec<(usize, usize, bool, bool)>;

    /// Four slots, passes of 8 prompt tokens; records each pass. Every sampled token is 7.
    struct Passes {
        seen: Arc<std::sync::Mutex<Vec<Pass>>>,
        launched: Vec<u32>,
    }

    impl Backend for Passes {
        fn capacity(&self) -> usize {
            1000
        }
        fn slots(&self) -> usize {
            4
        }
        fn prefill_chunk(&self) -> usize {
            8
        }
        fn prefill(&mut self, parts: &[Part]) -> Result<Vec<Option<u32>>> {
            let pass = parts
                .iter()
                .map(|p| (p.slot, p.tokens.len(), p.first, p.last));
            self.seen.lock().unwrap().push(pass.collect());
            Ok(parts.iter().map(|p| p.last.then_some(7)).collect())
        }
        fn launch(&mut self, slots: &[usize]) -> Result<()> {
            self.launched = vec![7; slots.len()];
            Ok(())
        }
        fn collect(&mut self) -> Result<Vec<u32>> {
            Ok(std::mem::take(&mut self.launched))
        }
    }

    #[test]
    fn waiting_prompts_are_read_together_a_chunk_of_tokens_a_pass_oldest_first() {
        let (jobs, rx) = std::sync::mpsc::channel();
        let metrics = Arc::new(Metrics::default());
        let mut streams = Vec::new();
        for len in [5, 7, 3] {
            let (job, stream) = job(vec![1; len], 2);
            metrics.queued.fetch_add(1, Ordering::Relaxed);
            jobs.send(job).unwrap();
            streams.push(stream);
        }
        drop(jobs);
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let backend = Passes {
            seen: seen.clone(),
            launched: Vec::new(),
        };
        run(Box::new(backend), &[0], rx, metrics.clone());
        // The first pass ends the 5-token prompt and reads 3 of the 7; the second ends both
        // the 7-token prompt and the 3-token one.
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                vec![(0, 5, true, true), (1, 3, true, false)],
                vec![(1, 4, false, true), (2, 3, true, true)],
            ]
        );
        for (i, stream) in streams.iter_mut().enumerate() {
            let mut got = Vec::new();
            while let Ok(e) = stream.try_recv() {
                got.push(match e {
                    Event::Token(t) => format!("token {t}"),
                    Event::Done {
                        finish,
                        completion_tokens,
                    } => format!("{} after {completion_tokens}", finish.as_str()),
                    Event::Failed(e) => format!("failed: {e}"),
                });
            }
            assert_eq!(got, ["token 7", "token 7", "length after 2"], "request {i}");
        }
        assert_eq!(metrics.running.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_step_covers_the_highest_running_slot_in_a_power_of_two_of_rows() {
        assert_eq!(bucket(&[0], 16), 1);
        assert_eq!(bucket(&[1, 0], 16), 2);
        assert_eq!(bucket(&[2], 16), 4);
        assert_eq!(bucket(&[0, 4, 1], 16), 8);
        assert_eq!(bucket(&[9], 16), 16);
        // Never past the slots the model has.
        assert_eq!(bucket(&[4], 6), 6);
        assert_eq!(bucket(&[2], 6), 4);
    }
}
