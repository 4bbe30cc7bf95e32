//! bf16 / f16 <-> f32 on little-endian byte buffers, via the `half` crate.
//!
//! Byte slices from a memory map are not guaranteed to be 2-byte aligned, so each function
//! takes the fast slice conversion when the buffer is aligned and falls back to per-element
//! decoding otherwise.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

/// Decodes little-endian bf16 bytes into `out` (`bytes.len() == 2 * out.len()`).
pub fn bf16_to_f32(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), 2 * out.len(), "bf16_to_f32 length");
    match bytemuck::try_cast_slice::<u8, u16>(bytes) {
        Ok(h) if cfg!(target_endian = "little") => {
            h.reinterpret_cast::<bf16>().convert_to_f32_slice(out)
        }
        _ => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

/// Decodes little-endian f16 bytes into `out` (`bytes.len() == 2 * out.len()`).
pub fn f16_to_f32(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), 2 * out.len(), "f16_to_f32 length");
    match bytemuck::try_cast_slice::<u8, u16>(bytes) {
        Ok(h) if cfg!(target_endian = "little") => {
            h.reinterpret_cast::<f16>().convert_to_f32_slice(out)
        }
        _ => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

/// Decodes little-endian f32 bytes into `out` (`bytes.len() == 4 * out.len()`).
pub fn f32_from_le(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), 4 * out.len(), "f32_from_le length");
    match bytemuck::try_cast_slice::<u8, f32>(bytes) {
        Ok(v) if cfg!(target_endian = "little") => out.copy_from_slice(v),
        _ => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

/// Encodes f32 values as little-endian bf16 (round to nearest even), appending to `out`.
pub fn f32_to_bf16_bytes(x: &[f32], out: &mut Vec<u8>) {
    let mut h = vec![bf16::ZERO; x.len()];
    h.convert_from_f32_slice(x);
    extend_le(h.reinterpret_cast(), out);
}

/// Encodes f32 values as little-endian f16 (round to nearest even), appending to `out`.
pub fn f32_to_f16_bytes(x: &[f32], out: &mut Vec<u8>) {
    let mut h = vec![f16::ZERO; x.len()];
    h.convert_from_f32_slice(x);
    extend_le(h.reinterpret_cast(), out);
}

fn extend_le(bits: &[u16], out: &mut Vec<u8>) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(bits));
    } else {
        out.extend(bits.iter().flat_map(|b| b.to_le_bytes()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn unaligned_buffers_decode_like_aligned_ones() {
        let vals = [1.0f32, -2.5, 3.140625, 65504.0];
        let mut bytes = vec![0u8];
        f32_to_f16_bytes(&vals, &mut bytes);
        let mut out = [0f32; 4];
        f16_to_f32(&bytes[1..], &mut out);
        assert_eq!(out, vals);

        let mut bytes = vec![0u8];
        f32_to_bf16_bytes(&vals[..3], &mut bytes);
        let mut out = [0f32; 3];
        bf16_to_f32(&bytes[1..], &mut out);
        assert_eq!(out, [1.0, -2.5, 3.140625]);

        let mut bytes = vec![0u8];
        for v in vals {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        let mut out = [0f32; 4];
        f32_from_le(&bytes[1..], &mut out);
        assert_eq!(out, vals);
    }

    proptest! {
        #[test]
        fn bf16_round_trip_error_is_within_half_ulp(x in -1e30f32..1e30) {
            let mut bytes = Vec::new();
            f32_to_bf16_bytes(&[x], &mut bytes);
            let mut out = [0f32];
            bf16_to_f32(&bytes, &mut out);
            // bf16 keeps 8 significant bits: half an ulp is at most 2^-8 relative.
            prop_assert!((out[0] - x).abs() <= x.abs() * 2f32.powi(-8));
            // Re-encoding a decoded value is exact.
            let mut again = Vec::new();
            f32_to_bf16_bytes(&out, &mut again);
            prop_assert_eq!(again, bytes);
        }
    }
}
