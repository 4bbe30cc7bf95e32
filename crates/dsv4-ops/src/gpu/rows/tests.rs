//! GPU tests of the row kernels against their CPU references, on fresh random inputs of
//! random shapes with outputs poisoned before every launch. The gather is bit-exact; RMSNorm
//! sums in another order (bound: 1e-5 relative per element) and RoPE's sin/cos may differ by
//! an ulp (bound: 1e-6 of the pair's magnitude). All `#[ignore]`d: `cargo xtask gpu-test`.

use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

use super::reference as cpu;
use super::*;
use crate::gpu::testing::{assert_bits_eq, device, random_bf16, rng, POISON};

/// Normal-ish values of one random magnitude (2^-20 .. 2^20) per call.
fn random_f32(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let scale = 2f32.powi(rng.random_range(-20..20));
    (0..n)
        .map(|_| (rng.random::<f32>() + rng.random::<f32>() - 1.0) * scale)
        .collect()
}

fn poisoned_f32(dev: &Device, shape: &[usize]) -> DeviceTensor<f32> {
    let mut t = dev.alloc(DType::F32, shape).unwrap();
    dev.fill_bytes(&mut t, POISON).unwrap();
    t
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_embed_hc_gather_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_embed_hc_gather_matches_reference");
    for iter in 0..8 {
        let vocab = rng.random_range(1..3000);
        let d = [64, 4096, 7168, rng.random_range(1..300)][iter % 4];
        let n = rng.random_range(1..20);
        let hc = rng.random_range(1..5);
        let table = random_bf16(&mut rng, vocab * d, true);
        // Mostly valid ids, some past the vocabulary (NaN rows).
        let tokens: Vec<u32> = (0..n)
            .map(|_| rng.random_range(0..vocab as u32 + vocab as u32 / 8 + 1))
            .collect();
        let want = cpu::embed_hc_gather(&table, d, &tokens, hc);
        let t = dev.upload(DType::BF16, &[vocab, d], &table).unwrap();
        let ids = dev.upload(DType::U32, &[n], &tokens).unwrap();
        let mut out = poisoned_f32(&dev, &[n, hc * d]);
        embed_hc_gather(&dev, &t, &ids, hc, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_bits_eq(
            &format!("iter {iter}: vocab {vocab}, d {d}, n {n}, hc {hc}"),
            &bits(&got),
            &bits(&want),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_rms_norm_rows_matches_reference() {
    let dev = device();
    let mut rng = rng("gpu_rms_norm_rows_matches_reference");
    for iter in 0..12 {
        let rows = rng.random_range(1..40);
        let width = [
            512,
            1024,
            1536,
            4096,
            7168,
            16384,
            rng.random_range(1..3000),
        ][iter % 7];
        let eps = [1e-6f32, 1e-5, 0.0][iter % 3];
        let mut x = random_f32(&mut rng, rows * width);
        if iter == 5 {
            x[width / 2] = f32::NAN; // row 0 must come out all NaN
        }
        let weight = (iter % 2 == 0).then(|| random_f32(&mut rng, width));
        let mut want = x.clone();
        cpu::rms_norm_rows(&mut want, width, weight.as_deref(), eps);

        let xd = dev.upload(DType::F32, &[rows, width], &x).unwrap();
        let wd = weight
            .as_ref()
            .map(|w| dev.upload(DType::F32, &[width], w).unwrap());
        let mut out = poisoned_f32(&dev, &[rows, width]);
        let mut out_b = dev.alloc(DType::BF16, &[rows, width]).unwrap();
        dev.fill_bytes(&mut out_b, POISON).unwrap();
        let twin = iter % 3 != 1;
        rms_norm_rows(
            &dev,
            &xd,
            wd.as_ref(),
            eps,
            &mut out,
            twin.then_some(&mut out_b),
        )
        .unwrap();
        let got = dev.download(&out).unwrap();
        if twin {
            let rounded: Vec<bf16> = got.iter().map(|&v| bf16::from_f32(v)).collect();
            let what = format!("iter {iter} [{rows}, {width}]: BF16 copy");
            assert_bits_eq(&what, &dev.download(&out_b).unwrap(), &rounded);
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let ok = if w.is_nan() {
                g.is_nan()
            } else {
                (g - w).abs() <= 1e-5 * w.abs()
            };
            assert!(
                ok,
                "iter {iter} [{rows}, {width}] eps {eps}: element {i}: got {g}, want {w}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_rope_rows_matches_reference_at_device_positions() {
    let dev = device();
    let mut rng = rng("gpu_rope_rows_matches_reference_at_device_positions");
    // (width, rope dim): Flash/Pro attention heads and KV, indexer heads, small fixtures.
    let shapes = [(512, 64), (128, 64), (32, 16), (64, 64), (96, 2)];
    for iter in 0..10 {
        let (width, rope_dim) = shapes[iter % shapes.len()];
        let tokens = rng.random_range(1..17);
        let heads = rng.random_range(1..65);
        // Positions up to 2^20 (a million-token context); f32 holds them exactly.
        let pos0 = rng.random_range(0..1usize << 20);
        let inv_freq: Vec<f32> = (0..rope_dim / 2)
            .map(|i| {
                10000f32.powf(-(2.0 * i as f32) / rope_dim as f32) * rng.random_range(0.05..1.0)
            })
            .collect();
        let direction = if iter % 2 == 0 {
            RopeDirection::Forward
        } else {
            RopeDirection::Inverse
        };
        let x = random_f32(&mut rng, tokens * heads * width);
        let mut want = x.clone();
        cpu::rope_rows(&mut want, heads, width, &inv_freq, pos0, direction);

        let mut xd = dev
            .upload(DType::F32, &[tokens, heads * width], &x)
            .unwrap();
        let fd = dev.upload(DType::F32, &[rope_dim / 2], &inv_freq).unwrap();
        let pd = dev.upload(DType::U32, &[1], &[pos0 as u32]).unwrap();
        rope_rows(&dev, &mut xd, width, &fd, &pd, direction).unwrap();
        let got = dev.download(&xd).unwrap();
        let what = format!("iter {iter}: [{tokens}, {heads}, {width}] rope {rope_dim} at {pos0}");
        for (v, ((g, w), orig)) in got
            .chunks_exact(width)
            .zip(want.chunks_exact(width))
            .zip(x.chunks_exact(width))
            .enumerate()
        {
            let nope = width - rope_dim;
            assert_eq!(
                &g[..nope],
                &orig[..nope],
                "{what}: vector {v} NoPE channels"
            );
            for k in (nope..width).step_by(2) {
                let mag = orig[k].abs() + orig[k + 1].abs();
                for j in [k, k + 1] {
                    assert!(
                        (g[j] - w[j]).abs() <= 1e-6 * mag,
                        "{what}: vector {v} channel {j}: got {}, want {}",
                        g[j],
                        w[j]
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_rms_norm_rope_is_the_norm_then_the_rope() {
    let dev = device();
    let mut rng = rng("gpu_rms_norm_rope_is_the_norm_then_the_rope");
    // (tokens, heads, width, rotated): the queries' heads, the shared key, a small odd case,
    // and rotated channels over two of a thread's held columns (32 threads of four).
    for (tokens, heads, width, rot) in [
        (1, 64, 512, 64),
        (3, 1, 512, 64),
        (5, 3, 96, 32),
        (2, 3, 128, 64),
    ] {
        let rows = tokens * heads;
        let x = random_f32(&mut rng, rows * width);
        let weight = random_f32(&mut rng, width);
        let freq: Vec<f32> = (0..rot / 2).map(|i| 0.9f32.powi(i as i32)).collect();
        let position: u32 = rng.random_range(0..100_000);
        let xd = dev.upload(DType::F32, &[rows, width], &x).unwrap();
        let wd = dev.upload(DType::F32, &[width], &weight).unwrap();
        let fd = dev.upload(DType::F32, &[rot / 2], &freq).unwrap();
        let pd = dev.upload(DType::U32, &[1], &[position]).unwrap();
        let mut two = poisoned_f32(&dev, &[rows, width]);
        rms_norm_rows(&dev, &xd, Some(&wd), 1e-6, &mut two, None).unwrap();
        let mut two = two.reshape(&[tokens, heads * width]).unwrap();
        rope_rows(&dev, &mut two, width, &fd, &pd, RopeDirection::Forward).unwrap();
        let mut one = poisoned_f32(&dev, &[rows, width]);
        let rope = RowRope {
            inv_freq: &fd,
            pos: &pd,
            rows_per_token: heads,
        };
        rms_norm_rope_rows(&dev, &xd, Some(&wd), 1e-6, &rope, &mut one).unwrap();
        assert_bits_eq(
            &format!("[{tokens} x {heads}, {width}] rotating {rot}"),
            &dev.download(&one).unwrap(),
            &dev.download(&two).unwrap(),
        );
    }
    // Rows [rows, width] rotating 4 channels, `rows_per_token` a token: the launcher's error.
    let fd = dev.alloc::<f32>(DType::F32, &[2]).unwrap();
    let pd = dev.alloc::<u32>(DType::U32, &[1]).unwrap();
    let refused = |rows: usize, width: usize, rows_per_token: usize| {
        let x = dev.alloc::<f32>(DType::F32, &[rows, width]).unwrap();
        let mut out = dev.alloc::<f32>(DType::F32, &[rows, width]).unwrap();
        let rope = RowRope {
            inv_freq: &fd,
            pos: &pd,
            rows_per_token,
        };
        let err = rms_norm_rope_rows(&dev, &x, None, 1e-6, &rope, &mut out).unwrap_err();
        err.to_string()
    };
    let err = refused(3, 8, 2);
    assert!(err.contains("2 rows a token"), "{err}");
    // Rotated channels from an odd one: a pair would straddle two threads' columns.
    let err = refused(2, 9, 1);
    assert!(err.contains("start at an even one"), "{err}");
    // Rows wider than the held columns hold.
    let wide = super::ROPE_HELD_WIDTH;
    let err = refused(1, wide + 2, 1);
    assert!(err.contains(&format!("at most {wide}")), "{err}");
}

/// The warp-a-row kernel gives the bits of the block-a-row kernel at every width it takes: the
/// queries' heads with their shared key (rotated, at one position or a batch's; one set
/// unscaled, one scaled and a column range), a BF16 copy, random widths and row counts, a NaN;
/// and the launcher takes it only for many rows of those widths.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_rms_norm_by_warps_is_the_block_kernel() {
    let dev = device();
    let mut rng = rng("gpu_rms_norm_by_warps_is_the_block_kernel");
    for iter in 0..16 {
        let width = match iter {
            0..=5 => 512,
            _ => 2 * rng.random_range(194..=256),
        };
        let (tokens, heads) = (rng.random_range(1..40), [64, 1, 3][iter % 3]);
        // Rotated channels within the last 128 (V4's heads rotate 64).
        let rot = (iter % 4 != 3).then(|| 2 * rng.random_range(1..=(width - 384) / 2));
        let rows = tokens * heads;
        let mut q = random_f32(&mut rng, rows * width);
        if iter == 7 {
            q[3] = f32::NAN; // its row comes out all NaN
        }
        // The key: the last `width` columns of rows of width + 8.
        let kv = random_f32(&mut rng, tokens * (width + 8));
        let weight = random_f32(&mut rng, width);
        let qd = dev.upload(DType::F32, &[rows, width], &q).unwrap();
        let kvd = dev.upload(DType::F32, &[tokens, width + 8], &kv).unwrap();
        let wd = dev.upload(DType::F32, &[width], &weight).unwrap();
        let freq: Vec<f32> = (0..rot.unwrap_or(2) / 2)
            .map(|i| 0.9f32.powi(i as i32))
            .collect();
        let fd = dev.upload(DType::F32, &[freq.len()], &freq).unwrap();
        // Every third iteration a batch: each token at a position of its own (`pos [T]`).
        let positions: Vec<u32> = (0..if iter % 3 == 2 { tokens } else { 1 })
            .map(|_| rng.random_range(0..1_000_000u32))
            .collect();
        let pd = dev
            .upload(DType::U32, &[positions.len()], &positions)
            .unwrap();
        let rope = RowRope {
            inv_freq: &fd,
            pos: &pd,
            rows_per_token: heads,
        };
        let run = |form: Form| {
            let (mut qo, mut ko) = (
                poisoned_f32(&dev, &[rows, width]),
                poisoned_f32(&dev, &[tokens, width]),
            );
            let mut qb = dev.alloc(DType::BF16, &[rows, width]).unwrap();
            dev.fill_bytes(&mut qb, POISON).unwrap();
            let a = NormRows {
                x: (&qd).into(),
                weight: (iter % 2 == 1).then_some(&wd),
                rows_per_token: heads,
                out: &mut qo,
            };
            let b = NormRows {
                x: ColRange {
                    x: &kvd,
                    first: 8,
                    width,
                },
                weight: Some(&wd),
                rows_per_token: 1,
                out: &mut ko,
            };
            match rot {
                Some(_) => norm_rows(&dev, a, Some(b), 1e-6, None, Some(&rope), form),
                None => norm_rows(&dev, a, Some(b), 1e-6, Some(&mut qb), None, form),
            }
            .unwrap();
            let mut out = dev.download(&qo).unwrap();
            out.extend(dev.download(&ko).unwrap());
            let copy: Vec<bf16> = dev.download(&qb).unwrap();
            (out, copy)
        };
        let (warps, warps_b) = run(Form::Warps);
        let (block, block_b) = run(Form::Block);
        let what = format!("iter {iter}: {tokens} x {heads} rows of {width}, rotating {rot:?}");
        assert_bits_eq(&what, &warps, &block);
        if rot.is_none() {
            assert_bits_eq(&format!("{what}: BF16 copy"), &warps_b, &block_b);
        }
    }
    let many = NORM_WARP_ROWS;
    assert!(norm_by_warps(many, 512, 32) && norm_by_warps(many, 388, 0));
    // A decode step's rows, other widths, an odd first rotated channel.
    assert!(!norm_by_warps(many - 1, 512, 32));
    assert!(!norm_by_warps(many, 386, 0) && !norm_by_warps(many, 514, 0));
    assert!(!norm_by_warps(many, 1024, 0) && !norm_by_warps(many, 389, 1));
    assert!(!norm_by_warps(many, 512, 65) && norm_by_warps(many, 512, 64));
}

/// A batch's tokens (each at its own position, `pos [T]`) through the pair come out as each
/// token launched alone at its position.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_rms_norm_rope_pair_of_a_batch_is_each_token_alone() {
    let dev = device();
    let mut rng = rng("gpu_rms_norm_rope_pair_of_a_batch_is_each_token_alone");
    let (tokens, heads, width) = (5, 4, 96);
    let q = random_f32(&mut rng, tokens * heads * width);
    let kv = random_f32(&mut rng, tokens * width);
    let freq: Vec<f32> = (0..16).map(|i| 0.8f32.powi(i)).collect();
    let fd = dev.upload(DType::F32, &[16], &freq).unwrap();
    let positions: Vec<u32> = (0..tokens)
        .map(|_| rng.random_range(0..100_000u32))
        .collect();
    let run = |q: &[f32], kv: &[f32], pos: &[u32]| {
        let n = kv.len() / width;
        let qd = dev.upload(DType::F32, &[n * heads, width], q).unwrap();
        let kvd = dev.upload(DType::F32, &[n, width], kv).unwrap();
        let pd = dev.upload(DType::U32, &[pos.len()], pos).unwrap();
        let (mut qo, mut ko) = (
            poisoned_f32(&dev, &[n * heads, width]),
            poisoned_f32(&dev, &[n, width]),
        );
        let a = NormRows {
            x: (&qd).into(),
            weight: None,
            rows_per_token: heads,
            out: &mut qo,
        };
        let b = NormRows {
            x: (&kvd).into(),
            weight: None,
            rows_per_token: 1,
            out: &mut ko,
        };
        let rope = RowRope {
            inv_freq: &fd,
            pos: &pd,
            rows_per_token: heads,
        };
        rms_norm_rope_pair(&dev, a, b, 1e-6, &rope).unwrap();
        let mut out = dev.download(&qo).unwrap();
        out.extend(dev.download(&ko).unwrap());
        out
    };
    let batch = run(&q, &kv, &positions);
    let (qn, kn) = batch.split_at(tokens * heads * width);
    for t in 0..tokens {
        let hw = heads * width;
        let alone = run(
            &q[t * hw..(t + 1) * hw],
            &kv[t * width..(t + 1) * width],
            &positions[t..t + 1],
        );
        assert_bits_eq(
            &format!("token {t}: heads"),
            &qn[t * hw..(t + 1) * hw],
            &alone[..hw],
        );
        assert_bits_eq(
            &format!("token {t}: key"),
            &kn[t * width..(t + 1) * width],
            &alone[hw..],
        );
    }
}

/// Two row sets in one launch (a token's query heads, unscaled, and its shared key, a column
/// range with a weight) give the bits of the two launches apart; sets of other widths are
/// refused.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_rms_norm_rope_pair_is_the_two_launches() {
    let dev = device();
    let mut rng = rng("gpu_rms_norm_rope_pair_is_the_two_launches");
    for (tokens, heads, width, lead) in [(1, 64, 512, 1024), (3, 4, 96, 40)] {
        let q = random_f32(&mut rng, tokens * heads * width);
        let kv = random_f32(&mut rng, tokens * (lead + width));
        let weight = random_f32(&mut rng, width);
        let freq: Vec<f32> = (0..16).map(|i| 0.8f32.powi(i)).collect();
        let qd = dev
            .upload(DType::F32, &[tokens * heads, width], &q)
            .unwrap();
        let kvd = dev
            .upload(DType::F32, &[tokens, lead + width], &kv)
            .unwrap();
        let wd = dev.upload(DType::F32, &[width], &weight).unwrap();
        let fd = dev.upload(DType::F32, &[16], &freq).unwrap();
        let pd = dev
            .upload(DType::U32, &[1], &[rng.random_range(0..100_000u32)])
            .unwrap();
        let rope = |rows_per_token| RowRope {
            inv_freq: &fd,
            pos: &pd,
            rows_per_token,
        };
        let kv_cols = ColRange {
            x: &kvd,
            first: lead,
            width,
        };
        let (mut q1, mut k1) = (
            poisoned_f32(&dev, &[tokens * heads, width]),
            poisoned_f32(&dev, &[tokens, width]),
        );
        rms_norm_rope_rows(&dev, &qd, None, 1e-6, &rope(heads), &mut q1).unwrap();
        rms_norm_rope_rows(&dev, kv_cols, Some(&wd), 1e-6, &rope(1), &mut k1).unwrap();
        let (mut q2, mut k2) = (
            poisoned_f32(&dev, &[tokens * heads, width]),
            poisoned_f32(&dev, &[tokens, width]),
        );
        let a = NormRows {
            x: (&qd).into(),
            weight: None,
            rows_per_token: heads,
            out: &mut q2,
        };
        let b = NormRows {
            x: kv_cols,
            weight: Some(&wd),
            rows_per_token: 1,
            out: &mut k2,
        };
        rms_norm_rope_pair(&dev, a, b, 1e-6, &rope(heads)).unwrap();
        let what = format!("{tokens} tokens x {heads} heads of {width}");
        let down = |t: &DeviceTensor<f32>| dev.download(t).unwrap();
        assert_bits_eq(&format!("{what}: heads"), &down(&q2), &down(&q1));
        assert_bits_eq(&format!("{what}: key"), &down(&k2), &down(&k1));
    }
    let x = dev.alloc::<f32>(DType::F32, &[2, 64]).unwrap();
    let y = dev.alloc::<f32>(DType::F32, &[2, 32]).unwrap();
    let fd = dev.alloc::<f32>(DType::F32, &[4]).unwrap();
    let pd = dev.alloc::<u32>(DType::U32, &[1]).unwrap();
    let (mut ox, mut oy) = (
        dev.alloc::<f32>(DType::F32, &[2, 64]).unwrap(),
        dev.alloc::<f32>(DType::F32, &[2, 32]).unwrap(),
    );
    let rope = RowRope {
        inv_freq: &fd,
        pos: &pd,
        rows_per_token: 1,
    };
    let set = |x, out| NormRows {
        x,
        weight: None,
        rows_per_token: 1,
        out,
    };
    let err = rms_norm_rope_pair(
        &dev,
        set((&x).into(), &mut ox),
        set((&y).into(), &mut oy),
        1e-6,
        &rope,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("rows of 64 wanted"), "{err}");
    // A batch's sets must be the same tokens', with one position a token.
    let pos2 = dev.alloc::<u32>(DType::U32, &[2]).unwrap();
    let x4 = dev.alloc::<f32>(DType::F32, &[4, 64]).unwrap();
    let mut o4 = dev.alloc::<f32>(DType::F32, &[4, 64]).unwrap();
    let x2 = dev.alloc::<f32>(DType::F32, &[2, 64]).unwrap();
    let mut o2 = dev.alloc::<f32>(DType::F32, &[2, 64]).unwrap();
    let batch_rope = RowRope {
        inv_freq: &fd,
        pos: &pos2,
        rows_per_token: 1,
    };
    let err = rms_norm_rope_pair(
        &dev,
        set((&x2).into(), &mut o2),
        set((&x4).into(), &mut o4),
        1e-6,
        &batch_rope,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("same batch's tokens"), "{err}");
    let err = rms_norm_rope_rows(&dev, &x4, None, 1e-6, &batch_rope, &mut o4)
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 positions for 4 tokens"), "{err}");
}

/// A norm over a column range of a wider tensor (a stacked GEMV's output) gives the bits of the
/// same norm over those columns copied out densely; a range past the row is refused.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_rms_norm_of_a_column_range_is_the_norm_of_those_columns() {
    let dev = device();
    let mut rng = rng("gpu_rms_norm_of_a_column_range_is_the_norm_of_those_columns");
    // (rows, first part's width, second part's width, rotated channels of the second)
    for (rows, wa, wb, rot) in [(1, 1024, 512, 64), (7, 1536, 512, 64), (3, 40, 24, 8)] {
        let stride = wa + wb;
        let x = random_f32(&mut rng, rows * stride);
        let xd = dev.upload(DType::F32, &[rows, stride], &x).unwrap();
        let part = |first: usize, width: usize| -> Vec<f32> {
            x.chunks(stride)
                .flat_map(|r| r[first..first + width].to_vec())
                .collect()
        };
        let (wta, wtb) = (random_f32(&mut rng, wa), random_f32(&mut rng, wb));
        let (wad, wbd) = (
            dev.upload(DType::F32, &[wa], &wta).unwrap(),
            dev.upload(DType::F32, &[wb], &wtb).unwrap(),
        );
        let what = format!("[{rows}, {wa} + {wb}]");
        // The first columns, with the BF16 copy.
        let dense = dev.upload(DType::F32, &[rows, wa], &part(0, wa)).unwrap();
        let (mut want, mut want_b) = (
            poisoned_f32(&dev, &[rows, wa]),
            dev.alloc::<bf16>(DType::BF16, &[rows, wa]).unwrap(),
        );
        rms_norm_rows(&dev, &dense, Some(&wad), 1e-6, &mut want, Some(&mut want_b)).unwrap();
        let (mut got, mut got_b) = (
            poisoned_f32(&dev, &[rows, wa]),
            dev.alloc::<bf16>(DType::BF16, &[rows, wa]).unwrap(),
        );
        let cols = ColRange {
            x: &xd,
            first: 0,
            width: wa,
        };
        rms_norm_rows(&dev, cols, Some(&wad), 1e-6, &mut got, Some(&mut got_b)).unwrap();
        assert_bits_eq(
            &what,
            &dev.download(&got).unwrap(),
            &dev.download(&want).unwrap(),
        );
        let bits = |t: &DeviceTensor<bf16>| -> Vec<u16> {
            dev.download(t)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_bits_eq(&format!("{what} bf16"), &bits(&got_b), &bits(&want_b));
        // The last columns, with the rope.
        let freq: Vec<f32> = (0..rot / 2).map(|i| 0.8f32.powi(i as i32)).collect();
        let fd = dev.upload(DType::F32, &[rot / 2], &freq).unwrap();
        let pd = dev
            .upload(DType::U32, &[1], &[rng.random_range(0..5000u32)])
            .unwrap();
        let rope = RowRope {
            inv_freq: &fd,
            pos: &pd,
            rows_per_token: 1,
        };
        let dense = dev.upload(DType::F32, &[rows, wb], &part(wa, wb)).unwrap();
        let mut want = poisoned_f32(&dev, &[rows, wb]);
        rms_norm_rope_rows(&dev, &dense, Some(&wbd), 1e-6, &rope, &mut want).unwrap();
        let mut got = poisoned_f32(&dev, &[rows, wb]);
        let cols = ColRange {
            x: &xd,
            first: wa,
            width: wb,
        };
        rms_norm_rope_rows(&dev, cols, Some(&wbd), 1e-6, &rope, &mut got).unwrap();
        assert_bits_eq(
            &format!("{what} roped"),
            &dev.download(&got).unwrap(),
            &dev.download(&want).unwrap(),
        );
        let past = ColRange {
            x: &xd,
            first: wa + 1,
            width: wb,
        };
        let err = rms_norm_rope_rows(&dev, past, Some(&wbd), 1e-6, &rope, &mut got).unwrap_err();
        assert!(err.to_string().contains("columns"), "{err}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
fn gpu_row_launchers_reject_bad_shapes_and_positions_advance() {
    let dev = device();
    let table = dev.upload(DType::BF16, &[4, 8], &[bf16::ONE; 32]).unwrap();
    let ids = dev.upload(DType::U32, &[2], &[0u32, 1]).unwrap();
    let mut out = dev.alloc(DType::F32, &[2, 15]).unwrap();
    assert!(embed_hc_gather(&dev, &table, &ids, 2, &mut out).is_err());
    let x = dev.alloc::<f32>(DType::F32, &[2, 8]).unwrap();
    let w = dev.alloc::<f32>(DType::F32, &[7]).unwrap();
    let mut y = dev.alloc(DType::F32, &[2, 8]).unwrap();
    assert!(rms_norm_rows(&dev, &x, Some(&w), 1e-6, &mut y, None).is_err());
    let mut yb = dev.alloc(DType::BF16, &[2, 7]).unwrap();
    assert!(rms_norm_rows(&dev, &x, None, 1e-6, &mut y, Some(&mut yb)).is_err());
    let mut v = dev.alloc(DType::F32, &[1, 16]).unwrap();
    let freq = dev.alloc::<f32>(DType::F32, &[5]).unwrap();
    let mut pos = dev.alloc::<u32>(DType::U32, &[1]).unwrap();
    assert!(rope_rows(&dev, &mut v, 8, &freq, &pos, RopeDirection::Forward).is_err());
    assert!(rope_rows(&dev, &mut v, 6, &freq, &pos, RopeDirection::Forward).is_err());
    let freq = dev.alloc::<f32>(DType::F32, &[4]).unwrap();
    rope_rows(&dev, &mut v, 8, &freq, &pos, RopeDirection::Forward).unwrap();
    advance_position(&dev, &mut pos, 5).unwrap();
    advance_position(&dev, &mut pos, 2).unwrap();
    assert_eq!(dev.download(&pos).unwrap(), vec![7]);
    let mut subs = dev.alloc::<u32>(DType::U32, &[300]).unwrap();
    chunk_positions(&dev, &pos, &mut subs, 16).unwrap();
    let want: Vec<u32> = (0..300).map(|j| 7 + 16 * j).collect();
    assert_eq!(dev.download(&subs).unwrap(), want);
}

#[test]
fn norm_args_layout_matches_the_cuda_struct() {
    // NormSet: 3 pointers and 3 u32 in rows.cu's order, padded to 40 bytes; NormArgs: two
    // sets, then width, eps, out_b, inv_freq, rope_half, pos and batch (padded to 8 bytes).
    assert_eq!(std::mem::size_of::<NormSet>(), 40);
    assert_eq!(std::mem::offset_of!(NormSet, weight), 16);
    assert_eq!(std::mem::offset_of!(NormSet, rows_per_token), 32);
    assert_eq!(std::mem::size_of::<NormArgs>(), 128);
    assert_eq!(std::mem::offset_of!(NormArgs, b), 40);
    assert_eq!(std::mem::offset_of!(NormArgs, out_b), 88);
    assert_eq!(std::mem::offset_of!(NormArgs, pos), 112);
    assert_eq!(std::mem::offset_of!(NormArgs, batch), 120);
}
