//! CPU reference of the random fills, bit for bit.

use super::{Bytes, Uniform};
use half::{bf16, f16};

/// SplitMix64's output function (also the sampler's draw).
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn element_bits(seed: u64, i: u64) -> u64 {
    splitmix64(seed ^ splitmix64(i))
}

/// Byte `i` of a fill.
pub fn byte(seed: u64, i: u64, d: Bytes) -> u8 {
    let h = element_bits(seed, i);
    let mut b = d.lo as u32 + (((h >> 32) * d.span as u64) >> 32) as u32;
    if d.signed && h & 1 != 0 {
        b |= 0x80;
    }
    b as u8
}

/// Value `i` of an F32 fill (f32 arithmetic rounded at each step, as the kernel).
pub fn f32_value(seed: u64, i: u64, d: Uniform) -> f32 {
    let u = (element_bits(seed, i) >> 40) as f32 * (1.0 / 16_777_216.0);
    d.mean + d.half_range * (2.0 * u - 1.0)
}

/// Value `i` of a BF16 fill: [`f32_value`] rounded.
pub fn bf16_value(seed: u64, i: u64, d: Uniform) -> bf16 {
    bf16::from_f32(f32_value(seed, i, d))
}

/// Value `i` of an F16 fill: [`f32_value`] rounded.
pub fn f16_value(seed: u64, i: u64, d: Uniform) -> f16 {
    f16::from_f32(f32_value(seed, i, d))
}
