//! FP8 e4m3fn: exponent bias 7, 3 mantissa bits, max ±448, no infinities,
//! NaN = 0x7f / 0xff, subnormals down to 2^-9.

pub const MAX: f32 = 448.0;
/// Smallest positive (subnormal) value.
pub const MIN_SUBNORMAL: f32 = 1.0 / 512.0;
/// Canonical NaN code produced by [`encode`].
pub const NAN_CODE: u8 = 0x7f;

const fn decode_const(b: u8) -> f32 {
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as u32;
    let mag = if e == 15 && m == 7 {
        f32::NAN
    } else if e == 0 {
        m as f32 * MIN_SUBNORMAL
    } else {
        f32::from_bits((((e - 7 + 127) as u32) << 23) | (m << 20))
    };
    if b & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// Code -> value for all 256 codes.
pub const LUT: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_const(i as u8);
        i += 1;
    }
    t
};

#[inline]
pub fn decode(code: u8) -> f32 {
    LUT[code as usize]
}

/// Round-to-nearest-even onto the e4m3fn grid.
///
/// Finite values beyond ±448 and ±Inf saturate to ±448 (the format has no infinity);
/// NaN maps to [`NAN_CODE`]. Values below half the smallest subnormal become ±0.
#[inline]
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return NAN_CODE;
    }
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    let mag = if a < 1.0 / 64.0 {
        // Subnormal range: uniform step 2^-9; a result of 8 is exactly the smallest normal.
        (a * 512.0).round_ties_even() as u8
    } else {
        // Round the f32 mantissa to 3 bits (ties to even), letting a carry bump the exponent.
        let bits = a.to_bits();
        let rounded = (bits + 0x7ffff + ((bits >> 20) & 1)) >> 20;
        (rounded.saturating_sub(120 << 3)).min(0x7e) as u8
    };
    sign | mag
}

/// Decodes `codes` times `scale` into `out` (equal lengths).
#[inline]
pub fn decode_scaled(codes: &[u8], scale: f32, out: &mut [f32]) {
    debug_assert_eq!(codes.len(), out.len());
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = LUT[c as usize] * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decode_known_codes() {
        assert_eq!(decode(0x00), 0.0);
        assert!(decode(0x80).is_sign_negative() && decode(0x80) == 0.0);
        assert_eq!(decode(0x01), 1.0 / 512.0);
        assert_eq!(decode(0x07), 7.0 / 512.0);
        assert_eq!(decode(0x08), 1.0 / 64.0);
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x7e), 448.0);
        assert_eq!(decode(0xfe), -448.0);
        assert!(decode(0x7f).is_nan() && decode(0xff).is_nan());
        let nans = (0..=255u8).filter(|&c| decode(c).is_nan()).count();
        assert_eq!(nans, 2);
    }

    #[test]
    fn every_finite_code_round_trips() {
        for c in 0..=255u8 {
            let v = decode(c);
            if v.is_nan() {
                continue;
            }
            assert_eq!(encode(v), c, "code {c:#x} value {v}");
        }
    }

    #[test]
    fn saturation_and_specials() {
        assert_eq!(encode(449.0), 0x7e);
        assert_eq!(encode(1e9), 0x7e);
        assert_eq!(encode(-1e9), 0xfe);
        assert_eq!(encode(f32::INFINITY), 0x7e);
        assert_eq!(encode(f32::NEG_INFINITY), 0xfe);
        assert_eq!(encode(f32::NAN), NAN_CODE);
        assert_eq!(encode(1e-30), 0x00);
        assert_eq!(encode(-1e-30), 0x80);
    }

    #[test]
    fn ties_round_to_even() {
        // Between 1.0 (m=0) and 1.125 (m=1): tie goes to 1.0.
        assert_eq!(decode(encode(1.0625)), 1.0);
        // Between 1.125 (m=1) and 1.25 (m=2): tie goes to 1.25.
        assert_eq!(decode(encode(1.1875)), 1.25);
        // Subnormal tie between 1/512 and 2/512 goes to 2/512.
        assert_eq!(decode(encode(1.5 / 512.0)), 2.0 / 512.0);
        // Half the smallest subnormal ties to zero.
        assert_eq!(decode(encode(0.5 / 512.0)), 0.0);
        // Carry out of the mantissa: 1.9375 lies between 1.875 and 2.0, ties to 2.0.
        assert_eq!(decode(encode(1.9375)), 2.0);
        // Largest subnormal rounds up into the normal range.
        assert_eq!(encode(7.6 / 512.0), 0x08);
    }

    proptest! {
        #[test]
        fn encode_is_nearest(x in -500.0f32..500.0) {
            let q = decode(encode(x));
            let target = x.clamp(-MAX, MAX);
            let best = LUT.iter().filter(|v| !v.is_nan())
                .map(|&v| (v - target).abs()).fold(f32::INFINITY, f32::min);
            prop_assert_eq!((q - target).abs(), best, "x={} q={}", x, q);
        }

        #[test]
        fn small_values_are_nearest(x in -0.05f32..0.05) {
            let q = decode(encode(x));
            let best = LUT.iter().filter(|v| !v.is_nan())
                .map(|&v| (v - x).abs()).fold(f32::INFINITY, f32::min);
            prop_assert_eq!((q - x).abs(), best, "x={} q={}", x, q);
        }
    }
}
