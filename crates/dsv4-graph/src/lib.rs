//! dsv4-graph
