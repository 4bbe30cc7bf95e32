//! Shared pieces of the GPU tests (unit tests, and the integration tests and benches through
//! the `test-support` feature).

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::Device;

/// The first GPU. GPU tests are `#[ignore]`d, so this only runs when they were asked for
/// explicitly; without a GPU that request fails loudly rather than passing.
pub fn device() -> Device {
    let count = Device::count().unwrap_or(0);
    assert!(
        count > 0,
        "this GPU test was requested (--ignored) but the machine has no CUDA device"
    );
    Device::new(0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"))
}

/// Every GPU of the machine, at least two. Multi-GPU tests are `#[ignore]`d and named
/// `multi_gpu_*`; on a machine with fewer GPUs this request fails loudly rather than passing.
pub fn devices() -> Vec<std::sync::Arc<Device>> {
    let count = Device::count().unwrap_or(0);
    assert!(
        count >= 2,
        "this multi-GPU test was requested (--ignored) but the machine has {count} CUDA device(s)"
    );
    (0..count)
        .map(|i| {
            std::sync::Arc::new(Device::new(i).unwrap_or_else(|e| panic!("opening GPU {i}: {e}")))
        })
        .collect()
}

/// A fresh generator per test; the seed is printed (and `DSV4_TEST_SEED` replays one).
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("DSV4_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// Byte used to poison outputs before a launch, so unwritten elements show up.
pub const POISON: u8 = 0xa5;

/// `full`, or `short` when the tests run under compute-sanitizer (`DSV4_SANITIZER_RUN` set and
/// not `0`, as the staged GPU test script sets it), where every launch is instrumented and the
/// longest tests could not finish: a step count, prefix length or number of random cases for
/// those tests, whose short value still crosses the boundaries the test names.
pub fn sanitizer_length(full: usize, short: usize) -> usize {
    if std::env::var("DSV4_SANITIZER_RUN").is_ok_and(|v| v != "0") {
        short.min(full)
    } else {
        full
    }
}

/// Random bf16 values over a wide dynamic range, with exact zeros and (if `specials`)
/// NaN, infinities and subnormals mixed in.
pub fn random_bf16(rng: &mut StdRng, n: usize, specials: bool) -> Vec<bf16> {
    let range_exp: i32 = rng.random_range(-30..30);
    (0..n)
        .map(|_| {
            let pick: u32 = rng.random_range(0..1000);
            if specials && pick < 3 {
                [bf16::NAN, bf16::INFINITY, bf16::NEG_INFINITY][pick as usize]
            } else if specials && pick < 10 {
                bf16::from_bits(rng.random_range(1..0x80) | (rng.random::<u16>() & 0x8000))
            } else if pick < 20 {
                bf16::ZERO
            } else {
                let m: f32 = rng.random_range(-2.0..2.0);
                bf16::from_f32(m * 2f32.powi(range_exp + rng.random_range(-8..8)))
            }
        })
        .collect()
}

/// Blocks of `block` consecutive values, some of them all zero.
pub fn zero_some_blocks(rng: &mut StdRng, v: &mut [bf16], block: usize) {
    for chunk in v.chunks_mut(block) {
        if rng.random_range(0..16) == 0 {
            chunk.fill(bf16::ZERO);
        }
    }
}

/// `n` uniformly random bytes.
pub fn random_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.random()).collect()
}

/// Bit-exact comparison, except that any NaN matches any NaN (GPU arithmetic returns the
/// canonical NaN where the CPU propagates the operand's payload).
pub fn assert_bf16_eq(what: &str, got: &[bf16], want: &[bf16]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| {
            got[i].to_bits() != want[i].to_bits() && !(got[i].is_nan() && want[i].is_nan())
        })
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} elements differ; first at {i}: got {:#06x} ({}), want {:#06x} ({})",
            bad.len(),
            got.len(),
            got[i].to_bits(),
            got[i],
            want[i].to_bits(),
            want[i]
        );
    }
}

/// Bit-exact comparison of plain-data buffers (codes, scales, or two launches' outputs, where
/// even NaN payloads must agree).
pub fn assert_bits_eq<T: bytemuck::Pod + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    fn bits<T: bytemuck::Pod>(v: &T) -> &[u8] {
        bytemuck::bytes_of(v)
    }
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| bits(&got[i]) != bits(&want[i]))
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} elements differ; first at {i}: got {:?} (bytes {:02x?}), want {:?} (bytes {:02x?})",
            bad.len(),
            got.len(),
            got[i],
            bits(&got[i]),
            want[i],
            bits(&want[i])
        );
    }
}
