//! dsv4-ops

pub mod codecs;
