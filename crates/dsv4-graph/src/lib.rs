//! CUDA graphs of whole steps: the launches of a step are captured once on the device's
//! stream and replayed per token, with nothing patched between replays. Everything a step
//! reads that changes from token to token (token id, position, lengths) lives in device
//! buffers that the step itself or a plain copy before the replay updates.

use cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, DriverError};
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
    /// Captures every launch `step` issues on `dev`'s stream. Run the step eagerly once
    /// before, so that kernels are loaded and lazily sized state exists. Host-side work inside
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
