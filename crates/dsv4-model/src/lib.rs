//! DeepSeek-V4 model: configuration, checkpoint loading, the CPU reference forward pass,
//! tokenizer and sampling.

pub mod config;
pub mod tokenizer;
pub mod chat;
pub mod sampling;
pub mod checkpoint;
pub mod linear;
pub mod synth;
pub mod rope;
pub mod weights;
pub mod cpu;
