//! The re-layout kernels against their CPU references, bit for bit, on fresh random shapes and
//! bytes (the GPU tests are `#[ignore]`d: `cargo xtask gpu-test`), and the references.

use rand::Rng;

use super::reference as cpu;
use super::*;
use crate::gpu::testing::{assert_bits_eq, device, random_bytes, rng};

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_pack_tiles_matches_reference_through_small_buffers() {
    let dev = device();
    let mut rng = rng("gpu_pack_tiles_matches_reference_through_small_buffers");
    for iter in 0..24 {
        let gate_up = iter % 3 == 0;
        let unit = [16, 16, 2, 1][iter % 4];
        let order = if unit == 16 && iter % 2 == 0 {
            CodeOrder::Fp4
        } else {
            CodeOrder::Plain
        };
        // Ragged rows and chunks (partial tiles and K steps), one row, one chunk.
        let rows = [1, 8, 16, rng.random_range(1..700)][iter % 4];
        let chunks = [1, 16, 17, rng.random_range(1..90)][(iter / 4) % 4];
        let layout = Layout {
            rows,
            chunks,
            gate_up,
        };
        let n = rows * chunks * unit;
        let w = random_bytes(&mut rng, n);
        let w3 = if gate_up {
            random_bytes(&mut rng, n)
        } else {
            vec![]
        };
        let want = cpu::pack_tiles(&layout, unit, order, &w, &w3).unwrap();
        // A destination with room on both sides, packed at an offset; buffers of a few tiles, so
        // most matrices go up in several chunks.
        let at = 16 * rng.random_range(0..4);
        let mut dst = dev.alloc::<u8>(DType::U8, &[at + want.len() + 32]).unwrap();
        dev.fill_bytes(&mut dst, 0xa5).unwrap();
        let slot = rng.random_range(1..6) * 16 * chunks * unit * if gate_up { 1 } else { 2 };
        let mut st = Stager::new(&dev, slot).unwrap();
        // The source in uneven pieces.
        let cut = rng.random_range(0..=n);
        let w3_pieces: Vec<&[u8]> = if gate_up { vec![&w3] } else { vec![] };
        pack_from_host(
            &mut st,
            &mut dst,
            at,
            &layout,
            unit,
            order,
            &[&w[..cut], &w[cut..]],
            &w3_pieces,
        )
        .unwrap();
        let got = dev.download(&dst).unwrap();
        let what = format!("{layout:?} unit {unit} {order:?}");
        assert_bits_eq(&what, &got[at..at + want.len()], &want);
        assert!(
            got[..at]
                .iter()
                .chain(&got[at + want.len()..])
                .all(|&b| b == 0xa5),
            "{what}: bytes outside the tiles written"
        );
        let mats = if gate_up { 2 } else { 1 };
        assert_eq!(st.moved(), (mats * n) as u64, "{what}: bytes staged");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_fp8_scale_rows_match_reference() {
    let dev = device();
    let mut rng = rng("gpu_fp8_scale_rows_match_reference");
    for iter in 0..16 {
        let sf = if iter % 2 == 0 {
            ScaleFormat::E8m0
        } else {
            ScaleFormat::F32
        };
        let block = [(128, 128), (16, 64), (128, 256), (32, 128)][iter % 4];
        let (n, k): (usize, usize) = (rng.random_range(1..900), 16 * rng.random_range(1..200));
        let count = n.div_ceil(block.0) * k.div_ceil(block.1);
        let raw: Vec<u8> = match sf {
            // e8m0 of every magnitude (not 255, NaN: its bits after the division are the
            // hardware's); f32 of mixed sizes, some zero rows.
            ScaleFormat::E8m0 => (0..count).map(|_| rng.random_range(0..255)).collect(),
            ScaleFormat::F32 => (0..count)
                .flat_map(|_| {
                    let v = if rng.random_range(0..8) == 0 {
                        0.0
                    } else {
                        rng.random_range(1e-6f32..1e6)
                    };
                    v.to_le_bytes()
                })
                .collect(),
        };
        let want = cpu::fp8_scale_rows(&raw, sf, n, k, block);
        let mut st = Stager::for_bytes(&dev, raw.len()).unwrap();
        let got = fp8_scales_from_host(&mut st, &[&raw], sf, n, k, block).unwrap();
        assert_bits_eq(
            &format!("[{n}, {k}] {block:?} {sf:?}"),
            &dev.download(&got).unwrap(),
            &want,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_relayouts_refuse_bad_arguments() {
    let dev = device();
    let layout = Layout {
        rows: 16,
        chunks: 16,
        gate_up: false,
    };
    let src = dev.alloc::<u8>(DType::U8, &[16 * 16 * 16]).unwrap();
    let mut dst = dev.alloc::<u8>(DType::U8, &[16 * 16 * 16]).unwrap();
    let err = |r: Result<(), GpuError>| r.unwrap_err().to_string();
    let mut bad = |dst_at: usize, w3_at: Option<usize>, unit: usize, order: CodeOrder| {
        err(pack_tiles(
            &dev, &mut dst, dst_at, &src, 0, w3_at, &layout, unit, order,
        ))
    };
    let e = bad(16, None, 16, CodeOrder::Plain);
    assert!(e.contains("bytes at 16"), "{e}");
    let e = bad(0, None, 4, CodeOrder::Plain);
    assert!(e.contains("unit 4"), "{e}");
    let e = bad(0, None, 2, CodeOrder::Fp4);
    assert!(e.contains("unit 2"), "{e}");
    let e = bad(0, Some(0), 16, CodeOrder::Plain);
    assert!(e.contains("gate+up"), "{e}");
    let mut wide = dev.alloc::<u8>(DType::U8, &[2 * 16 * 16 * 16]).unwrap();
    let e = err(pack_tiles(
        &dev,
        &mut wide,
        8,
        &src,
        0,
        None,
        &layout,
        16,
        CodeOrder::Plain,
    ));
    assert!(e.contains("aligned"), "{e}");
    // Sources of the wrong length; a tile bigger than the buffers.
    let mut st = Stager::new(&dev, 64).unwrap();
    let w = vec![0u8; 16 * 16 * 16];
    for (source, want) in [(&w[..10], "10 and 0 bytes"), (&w[..], "more than the 64")] {
        let e = err(pack_from_host(
            &mut st,
            &mut dst,
            0,
            &layout,
            16,
            CodeOrder::Plain,
            &[source],
            &[],
        ));
        assert!(e.contains(want), "{e}");
    }
    let mut out = dev.alloc::<f32>(DType::F32, &[1, 3]).unwrap();
    for (k, block, want) in [
        (128, (128, 100), "multiple of 64"),
        (256, (128, 128), "shape"),
    ] {
        let e = err(fp8_scale_rows(
            &dev,
            &mut out,
            &src,
            0,
            ScaleFormat::E8m0,
            128,
            k,
            block,
        ));
        assert!(e.contains(want), "{e}");
    }
}

#[test]
fn pow2_at_or_above_is_exact_at_every_magnitude() {
    for e in -149i32..=127 {
        let p = if e >= -126 {
            f32::from_bits(((e + 127) as u32) << 23)
        } else {
            f32::from_bits(1 << (e + 149))
        };
        assert_eq!(cpu::pow2_at_or_above(p), p, "2^{e}");
        if (-120..127).contains(&e) {
            assert_eq!(cpu::pow2_at_or_above(p * 1.25), p * 2.0, "1.25 * 2^{e}");
        }
    }
    assert_eq!(cpu::pow2_at_or_above(0.0), 1.0);
    assert_eq!(cpu::pow2_at_or_above(f32::NAN), 1.0);
    assert_eq!(cpu::pow2_at_or_above(f32::INFINITY), f32::INFINITY);
}

/// Each row of kernel scales is the row's scales over its factor, then the factor: a power
/// of two at or above the row's largest scale, so the divided scales are at most 1 and
/// multiply back exactly (e8m0 and f32 scales of any magnitude, all-zero rows).
#[test]
fn fp8_scale_rows_divide_by_a_power_of_two_factor() {
    // e8m0: a [256, 320] weight in 128 x 128 blocks (2 x 3 scales); rows 2^-100.. and 2^90...
    let e8 = [27u8, 30, 29, 217, 210, 200];
    let v = cpu::fp8_scale_rows(&e8, ScaleFormat::E8m0, 256, 320, (128, 128));
    let groups = 5;
    assert_eq!(v.len(), 2 * (groups + 1));
    for (r, want_factor) in [(0, 2f32.powi(-97)), (1, 2f32.powi(90))] {
        let row = &v[r * (groups + 1)..(r + 1) * (groups + 1)];
        assert_eq!(row[groups], want_factor);
        for g in 0..groups {
            let raw = ScaleFormat::E8m0.get(&e8, r * 3 + g * 64 / 128);
            assert!(
                row[g] <= 1.0 && row[g] * row[groups] == raw,
                "row {r} group {g}"
            );
        }
    }
    // f32: a factor above a largest scale that is not a power of two; an all-zero row.
    let f: Vec<u8> = [3.0f32, 0.75, 0.0, 0.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let v = cpu::fp8_scale_rows(&f, ScaleFormat::F32, 2, 256, (1, 128));
    assert_eq!(
        v,
        vec![0.75, 0.75, 0.1875, 0.1875, 4.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    );
}
