//! The random fills against their CPU reference, bit for bit, on fresh seeds and lengths (the
//! GPU tests are `#[ignore]`d: `cargo xtask gpu-test`), and the reference's distribution.

use rand::Rng;

use super::reference as cpu;
use super::*;
use crate::gpu::testing::{assert_bits_eq, device, rng};
use crate::gpu::DType;

/// [`fill_uniform`] of `n` values of `T` against the reference `value`, bit for bit.
fn check_uniform<T: UniformElem + std::fmt::Debug>(
    dev: &Device,
    n: usize,
    seed: u64,
    u: Uniform,
    value: impl Fn(u64, u64, Uniform) -> T,
) {
    let mut t = dev.alloc::<T>(T::DTYPES[0], &[n]).unwrap();
    fill_uniform(dev, &mut t, seed, u).unwrap();
    let want: Vec<T> = (0..n as u64).map(|i| value(seed, i, u)).collect();
    let what = format!("{} {u:?}, n {n}", std::any::type_name::<T>());
    assert_bits_eq(&what, &dev.download(&t).unwrap(), &want);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_random_fills_match_reference() {
    let dev = device();
    let mut rng = rng("gpu_random_fills_match_reference");
    let dists = [
        Bytes::ANY,
        Bytes::constant(0x38),
        Bytes {
            lo: 0,
            span: 0x38,
            signed: true,
        },
        Bytes {
            lo: 0x20,
            span: 0x39,
            signed: false,
        },
    ];
    for iter in 0..12 {
        let n = [1, 255, 4096, rng.random_range(1..3_000_000)][iter % 4];
        let seed: u64 = rng.random();
        let dist = dists[iter % dists.len()];
        let mut t = dev.alloc::<u8>(DType::U8, &[n]).unwrap();
        fill_bytes(&dev, &mut t, seed, dist).unwrap();
        let want: Vec<u8> = (0..n as u64).map(|i| cpu::byte(seed, i, dist)).collect();
        assert_bits_eq(
            &format!("bytes {dist:?}, n {n}"),
            &dev.download(&t).unwrap(),
            &want,
        );

        let u = Uniform {
            mean: rng.random_range(-2.0..2.0),
            half_range: rng.random_range(0.0..3.0),
        };
        check_uniform(&dev, n, seed, u, cpu::bf16_value);
        check_uniform(&dev, n, seed, u, cpu::f16_value);
        check_uniform(&dev, n, seed, u, cpu::f32_value);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_random_fills_refuse_bad_distributions() {
    let dev = device();
    let mut t = dev.alloc::<u8>(DType::U8, &[16]).unwrap();
    let bad = Bytes {
        lo: 200,
        span: 57,
        signed: false,
    };
    let err = fill_bytes(&dev, &mut t, 1, bad).unwrap_err().to_string();
    assert!(err.contains("span 57"), "{err}");
    let mut t = dev.alloc::<bf16>(DType::BF16, &[16]).unwrap();
    let bad = Uniform {
        mean: f32::NAN,
        half_range: 1.0,
    };
    let err = fill_uniform(&dev, &mut t, 1, bad).unwrap_err().to_string();
    assert!(err.contains("finite"), "{err}");
    let mut t = dev.alloc::<f32>(DType::F32, &[16]).unwrap();
    let bad = Uniform {
        mean: 0.0,
        half_range: f32::INFINITY,
    };
    let err = fill_uniform(&dev, &mut t, 1, bad).unwrap_err().to_string();
    assert!(err.contains("finite"), "{err}");
}

#[test]
fn reference_bytes_cover_their_range_evenly() {
    let d = Bytes {
        lo: 0x10,
        span: 0x28,
        signed: true,
    };
    let mut counts = [0usize; 256];
    let n = 400_000u64;
    for i in 0..n {
        counts[cpu::byte(7, i, d) as usize] += 1;
    }
    let expected = n as f64 / (2.0 * 0x28 as f64);
    for (b, &c) in counts.iter().enumerate() {
        let inside = (0x10..0x38).contains(&(b & 0x7f));
        if inside {
            assert!(
                (c as f64 - expected).abs() < 0.1 * expected,
                "byte {b:#x}: {c} draws, expected about {expected}"
            );
        } else {
            assert_eq!(c, 0, "byte {b:#x} is outside the distribution");
        }
    }
    assert!((0..n).all(|i| cpu::byte(3, i, Bytes::constant(0x7e)) == 0x7e));
}

#[test]
fn reference_bf16_values_have_the_asked_mean_and_range() {
    let u = Uniform {
        mean: 0.5,
        half_range: 0.25,
    };
    let v: Vec<f32> = (0..100_000)
        .map(|i| cpu::bf16_value(11, i, u).to_f32())
        .collect();
    assert!(v.iter().all(|&x| (0.25..=0.75).contains(&x)));
    let mean = v.iter().sum::<f32>() / v.len() as f32;
    assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
    // Uniform on [m - a, m + a): variance a² / 3.
    assert!(
        (var / (0.25f32 * 0.25 / 3.0) - 1.0).abs() < 0.03,
        "variance {var}"
    );
}
