//! FP4 e2m1: 1 sign bit, 2 exponent bits, 1 mantissa bit; no Inf, no NaN.
//!
//! Packing: two codes per byte, element `2k` in the low nibble, `2k+1` in the high nibble.

/// Code -> value. Codes 8..15 are the negated magnitudes of 0..7 (code 8 is -0).
pub const LUT: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Largest representable magnitude.
pub const MAX: f32 = 6.0;

/// Byte -> (value of low nibble, value of high nibble); decodes two elements per lookup.
pub const PAIR_LUT: [[f32; 2]; 256] = {
    let mut t = [[0.0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [LUT[b & 0xf], LUT[b >> 4]];
        b += 1;
    }
    t
};

#[inline]
pub fn decode(code: u8) -> f32 {
    LUT[(code & 0xf) as usize]
}

/// Round-to-nearest-even onto the e2m1 grid, saturating to ±6.
///
/// Ties at 0.75, 1.75 and 3.5 round up (to the even mantissa) and ties at 0.25, 1.25,
/// 2.5 and 5 round down, as ModelOpt does. ±Inf saturates to ±6. NaN has no e2m1
/// encoding and maps to +0 (code 0); quantizers never produce it from finite input.
/// Branch-free, so loops over it vectorize.
#[inline]
pub fn encode(x: f32) -> u8 {
    let a = x.abs();
    let mag = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    // Every comparison with NaN is false, so NaN gets magnitude 0; drop its sign too.
    let negative = x.is_sign_negative() & !x.is_nan();
    mag | ((negative as u8) << 3)
}

/// Packs codes two per byte (low nibble first). An odd trailing code gets a zero high nibble.
/// `out.len()` must be `codes.len().div_ceil(2)`.
pub fn pack(codes: &[u8], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        codes.len().div_ceil(2),
        "e2m1::pack output length"
    );
    for (o, pair) in out.iter_mut().zip(codes.chunks(2)) {
        let hi = pair.get(1).copied().unwrap_or(0);
        *o = (pair[0] & 0xf) | ((hi & 0xf) << 4);
    }
}

/// Unpacks `out.len()` codes from `packed` (which must hold `out.len().div_ceil(2)` bytes).
pub fn unpack(packed: &[u8], out: &mut [u8]) {
    assert_eq!(
        packed.len(),
        out.len().div_ceil(2),
        "e2m1::unpack input length"
    );
    for (i, o) in out.iter_mut().enumerate() {
        let b = packed[i / 2];
        *o = if i % 2 == 0 { b & 0xf } else { b >> 4 };
    }
}

/// Decodes packed codes times one scale into `out` (`packed.len() == out.len().div_ceil(2)`).
#[inline]
pub fn decode_packed_scaled(packed: &[u8], scale: f32, out: &mut [f32]) {
    debug_assert_eq!(packed.len(), out.len().div_ceil(2));
    let mut pairs = out.chunks_exact_mut(2);
    for (o, &b) in (&mut pairs).zip(packed) {
        let v = PAIR_LUT[b as usize];
        o[0] = v[0] * scale;
        o[1] = v[1] * scale;
    }
    if let [last] = pairs.into_remainder() {
        *last = LUT[(packed[packed.len() - 1] & 0xf) as usize] * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_code_round_trips() {
        for c in 0u8..16 {
            assert_eq!(encode(decode(c)), c, "code {c}");
        }
    }

    #[test]
    fn ties_follow_round_half_even() {
        let cases = [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
        ];
        for (x, want) in cases {
            assert_eq!(decode(encode(x)), want, "{x}");
            assert_eq!(decode(encode(-x)), -want, "-{x}");
        }
        // Just past a tie goes to the far side.
        assert_eq!(decode(encode(0.2500001)), 0.5);
        assert_eq!(decode(encode(5.000001)), 6.0);
    }

    #[test]
    fn saturates_and_handles_specials() {
        assert_eq!(decode(encode(7.0)), 6.0);
        assert_eq!(decode(encode(-1e30)), -6.0);
        assert_eq!(decode(encode(f32::INFINITY)), 6.0);
        assert_eq!(decode(encode(f32::NEG_INFINITY)), -6.0);
        assert_eq!(encode(f32::NAN), 0);
        assert_eq!(encode(-0.0), 8);
        assert_eq!(encode(-0.1), 8);
        assert_eq!(encode(1e-30), 0);
    }

    #[test]
    fn packing_puts_even_element_in_low_nibble() {
        let mut packed = [0u8; 2];
        pack(&[0x1, 0xf, 0x7], &mut packed);
        assert_eq!(packed, [0xf1, 0x07]);
        let mut codes = [0u8; 3];
        unpack(&packed, &mut codes);
        assert_eq!(codes, [0x1, 0xf, 0x7]);
        let mut vals = [0f32; 3];
        decode_packed_scaled(&packed, 2.0, &mut vals);
        assert_eq!(vals, [1.0, -12.0, 12.0]);
    }

    proptest! {
        #[test]
        fn encode_picks_a_nearest_grid_point(x in -8.0f32..8.0) {
            let q = decode(encode(x));
            let best = LUT.iter().map(|&v| (v - x.clamp(-6.0, 6.0)).abs()).fold(f32::INFINITY, f32::min);
            prop_assert!(((q - x.clamp(-6.0, 6.0)).abs() - best).abs() <= 1e-6, "x={x} q={q}");
        }
    }
}
