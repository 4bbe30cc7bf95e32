//! Number formats of DeepSeek-V4 checkpoints: element codecs (e2m1, e4m3fn, e8m0, bf16/f16)
//! and the block formats built from them (FP8 128x128 blocks, MXFP4, NVFP4).
//!
//! Row-level functions (`dequant_row`) are the hot path of the CPU backend and take slices
//! whose lengths the caller has validated; they panic only on a caller bug. Whole-matrix
//! functions check their inputs and return [`CodecError`].

pub mod e2m1;
pub mod e4m3;
pub mod e8m0;
pub mod fp8_block;
pub mod half_float;
pub mod mxfp4;
pub mod nvfp4;

/// A buffer handed to a whole-matrix codec function has the wrong size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("{what}: expected length {expected}, found {found}")]
    Length {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("{what}: {detail}")]
    Invalid { what: &'static str, detail: String },
}

pub(crate) fn check_len(
    what: &'static str,
    expected: usize,
    found: usize,
) -> Result<(), CodecError> {
    if expected == found {
        Ok(())
    } else {
        Err(CodecError::Length {
            what,
            expected,
            found,
        })
    }
}

pub(crate) fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Half the distance between neighbouring e2m1 grid points around magnitude `y` (test helper
/// for the FP4 quantizers' error bounds).
#[cfg(test)]
pub(crate) fn e2m1_half_step(y: f32) -> f32 {
    if y < 2.0 {
        0.25
    } else if y < 4.0 {
        0.5
    } else {
        1.0
    }
}
