//! dsv4-kernels
