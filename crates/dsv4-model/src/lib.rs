//! dsv4-model
