//! dsv4-ops

pub mod codecs;
pub mod gpu;
