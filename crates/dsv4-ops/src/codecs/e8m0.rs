//! E8M0 (ue8m0) scale bytes: value = 2^(byte - 127); 0xff is NaN. No sign, no zero.

pub const NAN_CODE: u8 = 0xff;

/// Byte -> value for all 256 bytes (byte 0 is 2^-127, an f32 subnormal).
pub const LUT: [f32; 256] = {
    let mut t = [0.0f32; 256];
    t[0] = f32::from_bits(1 << 22);
    let mut b = 1;
    while b < 255 {
        t[b] = f32::from_bits((b as u32) << 23);
        b += 1;
    }
    t[255] = f32::NAN;
    t
};

#[inline]
pub fn decode(byte: u8) -> f32 {
    LUT[byte as usize]
}

/// The byte of an exact power of two in [2^-127, 2^127]; `None` for anything else.
pub fn encode_pow2(x: f32) -> Option<u8> {
    if x == f32::from_bits(1 << 22) {
        return Some(0);
    }
    let bits = x.to_bits();
    let exp = bits >> 23;
    if bits & 0x007f_ffff == 0 && (1..255).contains(&exp) {
        Some(exp as u8)
    } else {
        None
    }
}

/// The smallest power of two `s` with `amax / s <= max_code`, as an e8m0 byte: the scale that
/// lets a block with absolute maximum `amax` fit a grid whose largest value is `max_code`.
///
/// A zero or non-finite `amax` gives 1.0 (byte 127); the result is clamped to [2^-127, 2^127].
pub fn scale_for_amax(amax: f32, max_code: f32) -> u8 {
    if !(amax.is_finite() && amax > 0.0) {
        return 127;
    }
    let ratio = amax / max_code;
    let mut e = ratio.log2().ceil() as i32;
    // log2 is approximate near powers of two; settle the exponent exactly.
    while e > -127 && amax / pow2(e - 1) <= max_code {
        e -= 1;
    }
    while e < 127 && amax / pow2(e) > max_code {
        e += 1;
    }
    (e.clamp(-127, 127) + 127) as u8
}

fn pow2(e: i32) -> f32 {
    LUT[(e.clamp(-127, 127) + 127) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decode_range() {
        assert_eq!(decode(127), 1.0);
        assert_eq!(decode(128), 2.0);
        assert_eq!(decode(0), 2f32.powi(-127));
        assert_eq!(decode(254), 2f32.powi(127));
        assert!(decode(255).is_nan());
    }

    #[test]
    fn pow2_round_trip() {
        for b in 0..255u8 {
            assert_eq!(encode_pow2(decode(b)), Some(b));
        }
        assert_eq!(encode_pow2(3.0), None);
        assert_eq!(encode_pow2(0.0), None);
        assert_eq!(encode_pow2(-1.0), None);
        assert_eq!(encode_pow2(f32::INFINITY), None);
        assert_eq!(encode_pow2(f32::NAN), None);
        assert_eq!(encode_pow2(2f32.powi(-130)), None);
    }

    #[test]
    fn scale_choice_edges() {
        assert_eq!(decode(scale_for_amax(448.0, 448.0)), 1.0);
        assert_eq!(decode(scale_for_amax(448.5, 448.0)), 2.0);
        assert_eq!(decode(scale_for_amax(224.0, 448.0)), 0.5);
        assert_eq!(decode(scale_for_amax(6.0, 6.0)), 1.0);
        assert_eq!(decode(scale_for_amax(0.0, 6.0)), 1.0);
        assert_eq!(decode(scale_for_amax(f32::NAN, 6.0)), 1.0);
    }

    proptest! {
        #[test]
        fn scale_is_smallest_fitting_pow2(amax in 1e-30f32..1e30, max_code in prop::sample::select(vec![6.0f32, 448.0])) {
            let s = decode(scale_for_amax(amax, max_code));
            prop_assert!(amax / s <= max_code);
            prop_assert!(amax / (s / 2.0) > max_code);
        }
    }
}
