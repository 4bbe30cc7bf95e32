//! DeepSeek-V4 model: configuration, checkpoint loading, the CPU reference forward pass,
//! tokenizer and sampling.

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod gpu;
pub mod linear;
pub mod rope;
pub mod sampling;
pub mod shard;
pub mod synth;
pub mod tokenizer;
pub mod weights;
