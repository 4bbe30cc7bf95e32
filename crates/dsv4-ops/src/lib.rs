//! dsv4-ops
