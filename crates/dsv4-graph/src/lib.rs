//! CUDA graphs of whole steps: the launches of a step are captured once on the device's
//! stream and replayed per token, with nothing patched between replays. Everything a step
//! reads that changes from token to token (token id, position, lengths) lives in device
//! buffers that the step itself or a plain copy before the replay updates.

use cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, DriverError};
use dsv4_model::gpu::{GpuModel, GpuModelError};
use dsv4_ops::gpu::{Device, GpuError};

#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("the step failed while it was captured: {0}")]
    Step(#[source] GpuError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("CUDA driver error while {what}: {source}")]
    Driver {
        what: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("the captured step issued no work")]
    Empty,
    #[error("the device's stream is already being captured")]
    Nested,
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> GraphError {
    move |source| GraphError::Driver { what, source }
}

/// One captured step, ready to replay.
pub struct StepGraph {
    graph: CudaGraph,
    nodes: usize,
}

impl StepGraph {
    /// Captures every launch `step` issues on `dev`'s stream, and on its side streams (each
    /// joins the capture at a fork and must be joined back before the step ends). Run the step
    /// eagerly once before, so that kernels are loaded and lazily sized state exists. Host-side work inside
    /// the step (allocation, host copies, waiting) is refused by the device with an error, and
    /// the capture is abandoned rather than left open.
    pub fn capture(
        dev: &Device,
        step: impl FnOnce() -> Result<(), GpuError>,
    ) -> Result<StepGraph, GraphError> {
        if dev.is_capturing()? {
            return Err(GraphError::Nested);
        }
        let stream = dev.stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("beginning the capture"))?;
        let ran = step();
        // The capture ends whatever the step did, so the stream is usable again.
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        ran.map_err(GraphError::Step)?;
        let graph = ended
            .map_err(driver("ending the capture"))?
            .ok_or(GraphError::Empty)?;
        let mut nodes = 0usize;
        // SAFETY: a null node array asks only for the count of the graph's nodes.
        let status =
            unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes) };
        status
            .result()
            .map_err(driver("counting the graph's nodes"))?;
        if nodes == 0 {
            return Err(GraphError::Empty);
        }
        graph.upload().map_err(driver("uploading the graph"))?;
        Ok(StepGraph { graph, nodes })
    }

    /// Enqueues one replay on the device's stream; the host does not wait for it.
    pub fn replay(&self) -> Result<(), GraphError> {
        self.graph.launch().map_err(driver("launching the graph"))
    }

    /// Kernel launches and copies per replay.
    pub fn nodes(&self) -> usize {
        self.nodes
    }
}

/// A [`GpuModel`]'s decode step of its first `rows` slots captured once, one graph per GPU of
/// the model: each [`DecodeGraph::step`] replays them (each slot's token in each rank's device
/// buffer through every layer, the head and the sampler, which writes the slot's next token
/// where the following replay reads it, with the slot's settings on the device) and reads the
/// sampled tokens back. One graph serves every batch of `rows` sequences: which sequences
/// fill the slots, and their settings, change between replays without a new capture.
pub struct DecodeGraph {
    /// By rank.
    graphs: Vec<StepGraph>,
    /// The captured model's state, by the address of its token buffer.
    model: u64,
    rows: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Model(#[from] GpuModelError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("the decode graph replays the model it was captured from, not this one")]
    OtherModel,
}

impl DecodeGraph {
    /// Captures `model`'s decode step of its first `rows` slots, each rank's on its own
    /// device. Run the same step eagerly first ([`eager_launch`]), so every kernel of it is
    /// loaded.
    pub fn capture(model: &mut GpuModel, rows: usize) -> Result<DecodeGraph, GraphError> {
        let graphs = model
            .devices()
            .iter()
            .enumerate()
            .map(|(rank, dev)| {
                StepGraph::capture(dev, || model.launch_rank_decode_step(rank, rows))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DecodeGraph {
            graphs,
            model: model.state_address(),
            rows,
        })
    }

    /// Slots the step decodes (the first `rows`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// One replay on every GPU, enqueued without waiting: decodes each slot's token in the
    /// device buffer and leaves the sampled next one there (replays back to back stream
    /// several tokens).
    pub fn replay(&self, model: &mut GpuModel) -> Result<(), DecodeError> {
        self.replay_slots(model, &(0..self.rows).collect::<Vec<_>>())
    }

    /// [`Self::replay`] where only `slots` (each below [`Self::rows`]) hold running sequences:
    /// the other rows are computed and not used.
    pub fn replay_slots(&self, model: &mut GpuModel, slots: &[usize]) -> Result<(), DecodeError> {
        if model.state_address() != self.model {
            return Err(DecodeError::OtherModel);
        }
        model.check_slots(self.rows, slots, 1)?;
        for g in &self.graphs {
            g.replay()?;
        }
        model.note_decoded(slots, 1);
        Ok(())
    }

    /// One replay, then slot 0's sampled token read back.
    pub fn step(&self, model: &mut GpuModel) -> Result<u32, DecodeError> {
        Ok(self.step_slots(model, &[0])?[0])
    }

    /// One replay ([`Self::replay_slots`]), then the sampled tokens of `slots` read back, in
    /// that order.
    pub fn step_slots(
        &self,
        model: &mut GpuModel,
        slots: &[usize],
    ) -> Result<Vec<u32>, DecodeError> {
        self.replay_slots(model, slots)?;
        let all = model.read_tokens(self.rows)?;
        Ok(slots.iter().map(|&s| all[s]).collect())
    }

    /// Kernel launches (and other nodes) per step, on each GPU.
    pub fn nodes(&self) -> usize {
        self.graphs[0].nodes()
    }
}

/// The time one all-reduce of a decode step's size takes inside a graph, in µs: `reps` of
/// them captured back to back on every GPU, replayed together; `None` on one GPU.
pub fn time_all_reduce(model: &mut GpuModel, reps: usize) -> Result<Option<f64>, DecodeError> {
    if model.world() == 1 || reps == 0 {
        return Ok(None);
    }
    let devs = model.devices();
    let mut graphs = Vec::with_capacity(devs.len());
    for (rank, dev) in devs.iter().enumerate() {
        graphs.push(StepGraph::capture(dev, || {
            for _ in 0..reps {
                if let Some(launched) = model.launch_all_reduce_probe(rank) {
                    launched?;
                }
            }
            Ok(())
        })?);
    }
    let run = |times: usize| -> Result<f64, DecodeError> {
        for d in &devs {
            d.synchronize()?;
        }
        let t = std::time::Instant::now();
        for _ in 0..times {
            for g in &graphs {
                g.replay()?;
            }
        }
        for d in &devs {
            d.synchronize()?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    run(1)?;
    let times = 10;
    Ok(Some(run(times)? * 1e6 / (times * reps) as f64))
}

/// The same step of the first `rows` slots without a graph: the launches issued one by one
/// (comparison, debugging), enqueued without waiting.
pub fn eager_launch(model: &mut GpuModel, rows: usize) -> Result<(), DecodeError> {
    model.check_decode(rows, 1)?;
    model.launch_decode_step(rows)?;
    model.note_decoded(&(0..rows).collect::<Vec<_>>(), 1);
    Ok(())
}

/// [`eager_launch`] of slot 0, then its sampled token read back.
pub fn eager_step(model: &mut GpuModel) -> Result<u32, DecodeError> {
    eager_launch(model, 1)?;
    Ok(model.read_token()?)
}
