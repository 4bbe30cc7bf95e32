//! Weight matrices `[rows, cols]` (PyTorch `[out, in]`) in their checkpoint encoding,
//! dequantized row by row on the fly.

use std::ops::Range;

use dsv4_ops::codecs::fp8_block::{self, ScaleFormat};
use dsv4_ops::codecs::{half_float, mxfp4, nvfp4, CodecError};
use dsv4_ops::gpu::router::reference::dot16;
use rayon::prelude::*;

use crate::checkpoint::Blob;

/// How a [`Linear`]'s bytes encode its values.
#[derive(Clone, Debug)]
pub enum LinearData {
    F32(Blob),
    Bf16(Blob),
    F16(Blob),
    /// e4m3fn weight `[rows, cols]` + scale `[ceil(rows/block_rows), ceil(cols/block_cols)]`.
    Fp8Block {
        weight: Blob,
        scale: Blob,
        scale_format: ScaleFormat,
        block_rows: usize,
        block_cols: usize,
    },
    /// Packed e2m1 `[rows, ceil(cols/2)]` + e8m0 scale per 32 `[rows, ceil(cols/32)]`.
    Mxfp4 {
        weight: Blob,
        scale: Blob,
    },
    /// Packed e2m1 `[rows, ceil(cols/2)]` + e4m3 scale per 16 `[rows, ceil(cols/16)]` +
    /// global `weight_scale_2`; `input_scale` is only meaningful for FP4 activations.
    Nvfp4 {
        weight: Blob,
        weight_scale: Blob,
        weight_scale_2: f32,
        input_scale: Option<f32>,
    },
}

/// A weight matrix whose byte sizes have been checked against its shape.
#[derive(Clone, Debug)]
pub struct Linear {
    rows: usize,
    cols: usize,
    data: LinearData,
}

/// How a format's scales tile its weight: one scale per `rows` × `cols` values, `bytes` each.
#[derive(Clone, Copy)]
struct ScaleTiling {
    rows: usize,
    cols: usize,
    bytes: usize,
}

/// Output rows per parallel task: each task dequantizes this many rows once and reuses them
/// for every input row while they are hot in cache.
const ROW_TILE: usize = 16;

impl Linear {
    /// Checks every buffer's length against `[rows, cols]`.
    pub fn new(rows: usize, cols: usize, data: LinearData) -> Result<Linear, CodecError> {
        let len = |what, expected: usize, blob: &Blob| {
            if blob.len() == expected {
                Ok(())
            } else {
                Err(CodecError::Length {
                    what,
                    expected,
                    found: blob.len(),
                })
            }
        };
        match &data {
            LinearData::F32(b) => len("f32 weight", rows * cols * 4, b)?,
            LinearData::Bf16(b) => len("bf16 weight", rows * cols * 2, b)?,
            LinearData::F16(b) => len("f16 weight", rows * cols * 2, b)?,
            LinearData::Fp8Block {
                weight,
                scale,
                scale_format,
                block_rows,
                block_cols,
            } => {
                if *block_rows == 0 || *block_cols == 0 {
                    return Err(CodecError::Invalid {
                        what: "fp8 block size",
                        detail: format!("{block_rows}x{block_cols}"),
                    });
                }
                len("fp8 weight", rows * cols, weight)?;
                let n = rows.div_ceil(*block_rows) * cols.div_ceil(*block_cols);
                len("fp8 scale", n * scale_format.bytes(), scale)?;
            }
            LinearData::Mxfp4 { weight, scale } => {
                len("mxfp4 weight", rows * cols.div_ceil(2), weight)?;
                len("mxfp4 scale", rows * cols.div_ceil(mxfp4::BLOCK), scale)?;
            }
            LinearData::Nvfp4 {
                weight,
                weight_scale,
                weight_scale_2,
                ..
            } => {
                len("nvfp4 weight", rows * cols.div_ceil(2), weight)?;
                len(
                    "nvfp4 weight_scale",
                    rows * cols.div_ceil(nvfp4::BLOCK),
                    weight_scale,
                )?;
                if !weight_scale_2.is_finite() {
                    return Err(CodecError::Invalid {
                        what: "nvfp4 weight_scale_2",
                        detail: format!("{weight_scale_2} is not finite"),
                    });
                }
            }
        }
        Ok(Linear { rows, cols, data })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn data(&self) -> &LinearData {
        &self.data
    }

    /// Short encoding name for `dsv4 info`.
    pub fn format_name(&self) -> &'static str {
        match &self.data {
            LinearData::F32(_) => "f32",
            LinearData::Bf16(_) => "bf16",
            LinearData::F16(_) => "f16",
            LinearData::Fp8Block {
                scale_format: ScaleFormat::E8m0,
                ..
            } => "fp8 (e8m0 block scales)",
            LinearData::Fp8Block {
                scale_format: ScaleFormat::F32,
                ..
            } => "fp8 (f32 block scales)",
            LinearData::Mxfp4 { .. } => "mxfp4",
            LinearData::Nvfp4 { .. } => "nvfp4",
        }
    }

    /// Storage bytes, scales included.
    pub fn bytes(&self) -> usize {
        match &self.data {
            LinearData::F32(b) | LinearData::Bf16(b) | LinearData::F16(b) => b.len(),
            LinearData::Fp8Block { weight, scale, .. } | LinearData::Mxfp4 { weight, scale } => {
                weight.len() + scale.len()
            }
            LinearData::Nvfp4 {
                weight,
                weight_scale,
                ..
            } => weight.len() + weight_scale.len() + 8,
        }
    }

    /// The encoded bytes of rows `rows`: the weight's, and the scales that cover them (for FP8
    /// blocks, the whole scale-block rows they touch; none for F32, BF16 and F16).
    ///
    /// # Panics
    /// If `rows` goes past the matrix.
    pub fn encoded_rows(&self, rows: Range<usize>) -> (&[u8], &[u8]) {
        let (weight, scale) = self.blobs();
        let (w, s) = self.row_bytes(&rows);
        (&weight.bytes()[w], scale.map_or(&[][..], |b| &b.bytes()[s]))
    }

    /// Rows `rows` as a linear of their own (the bytes shared, not copied). FP8 blocks must
    /// be cut on whole scale blocks.
    pub fn slice_rows(&self, rows: Range<usize>) -> Result<Linear, CodecError> {
        self.check_range(
            "rows",
            &rows,
            self.rows,
            self.scales().map_or(1, |s| s.rows),
        )?;
        let (weight, scale) = self.blobs();
        let (w, s) = self.row_bytes(&rows);
        let cut = |b: &Blob, r| b.slice(r).expect("rows inside the matrix");
        let data = self.with_blobs(cut(weight, w), scale.map(|b| cut(b, s)));
        Linear::new(rows.len(), self.cols, data)
    }

    /// Columns `cols` as a linear of their own (copied row by row). Quantized formats must be
    /// cut on whole scale blocks (128 for FP8 blocks, 32 for MXFP4, 16 for NVFP4).
    pub fn slice_cols(&self, cols: Range<usize>) -> Result<Linear, CodecError> {
        let scales = self.scales();
        self.check_range("columns", &cols, self.cols, scales.map_or(1, |s| s.cols))?;
        // `n_rows` rows `per_row` bytes wide, each cut at `lo..hi`.
        let cut = |b: &Blob, n_rows: usize, per_row: usize, lo: usize, hi: usize| {
            let bytes = b.bytes();
            let mut out = Vec::with_capacity(n_rows * (hi - lo));
            for r in 0..n_rows {
                out.extend_from_slice(&bytes[r * per_row + lo..r * per_row + hi]);
            }
            Blob::from_vec(out)
        };
        let (weight, scale) = self.blobs();
        let (num, den) = self.weight_bytes_per_value();
        let c = self.cols;
        let w = cut(
            weight,
            self.rows,
            (c * num).div_ceil(den),
            cols.start * num / den,
            (cols.end * num).div_ceil(den),
        );
        let s = scale.zip(scales).map(|(b, s)| {
            cut(
                b,
                self.rows.div_ceil(s.rows),
                c.div_ceil(s.cols) * s.bytes,
                cols.start / s.cols * s.bytes,
                cols.end.div_ceil(s.cols) * s.bytes,
            )
        });
        Linear::new(self.rows, cols.len(), self.with_blobs(w, s))
    }

    /// The weight's bytes and the scales' (none for F32, BF16 and F16).
    fn blobs(&self) -> (&Blob, Option<&Blob>) {
        match &self.data {
            LinearData::F32(b) | LinearData::Bf16(b) | LinearData::F16(b) => (b, None),
            LinearData::Fp8Block { weight, scale, .. } | LinearData::Mxfp4 { weight, scale } => {
                (weight, Some(scale))
            }
            LinearData::Nvfp4 {
                weight,
                weight_scale,
                ..
            } => (weight, Some(weight_scale)),
        }
    }

    /// The same encoding over other bytes (`scale` is ignored for F32, BF16 and F16).
    fn with_blobs(&self, weight: Blob, scale: Option<Blob>) -> LinearData {
        let scale = || scale.clone().expect("a scaled format has scale bytes");
        match &self.data {
            LinearData::F32(_) => LinearData::F32(weight),
            LinearData::Bf16(_) => LinearData::Bf16(weight),
            LinearData::F16(_) => LinearData::F16(weight),
            LinearData::Fp8Block {
                scale_format,
                block_rows,
                block_cols,
                ..
            } => LinearData::Fp8Block {
                weight,
                scale: scale(),
                scale_format: *scale_format,
                block_rows: *block_rows,
                block_cols: *block_cols,
            },
            LinearData::Mxfp4 { .. } => LinearData::Mxfp4 {
                weight,
                scale: scale(),
            },
            LinearData::Nvfp4 {
                weight_scale_2,
                input_scale,
                ..
            } => LinearData::Nvfp4 {
                weight,
                weight_scale: scale(),
                weight_scale_2: *weight_scale_2,
                input_scale: *input_scale,
            },
        }
    }

    /// Weight bytes per value as `(num, den)`: 4/1 (F32), 2/1 (BF16, F16), 1/1 (FP8), 1/2 (FP4).
    fn weight_bytes_per_value(&self) -> (usize, usize) {
        match &self.data {
            LinearData::F32(_) => (4, 1),
            LinearData::Bf16(_) | LinearData::F16(_) => (2, 1),
            LinearData::Fp8Block { .. } => (1, 1),
            LinearData::Mxfp4 { .. } | LinearData::Nvfp4 { .. } => (1, 2),
        }
    }

    /// How the scales tile the matrix; none for F32, BF16 and F16.
    fn scales(&self) -> Option<ScaleTiling> {
        match &self.data {
            LinearData::F32(_) | LinearData::Bf16(_) | LinearData::F16(_) => None,
            LinearData::Fp8Block {
                scale_format,
                block_rows,
                block_cols,
                ..
            } => Some(ScaleTiling {
                rows: *block_rows,
                cols: *block_cols,
                bytes: scale_format.bytes(),
            }),
            LinearData::Mxfp4 { .. } => Some(ScaleTiling {
                rows: 1,
                cols: mxfp4::BLOCK,
                bytes: 1,
            }),
            LinearData::Nvfp4 { .. } => Some(ScaleTiling {
                rows: 1,
                cols: nvfp4::BLOCK,
                bytes: 1,
            }),
        }
    }

    /// The byte ranges of rows `rows` in the weight and in the scales (the whole scale rows
    /// they touch; empty without scales).
    fn row_bytes(&self, rows: &Range<usize>) -> (Range<usize>, Range<usize>) {
        let (num, den) = self.weight_bytes_per_value();
        let per_row = (self.cols * num).div_ceil(den);
        let weight = rows.start * per_row..rows.end * per_row;
        let scale = self.scales().map_or(0..0, |s| {
            let per_row = self.cols.div_ceil(s.cols) * s.bytes;
            rows.start / s.rows * per_row..rows.end.div_ceil(s.rows) * per_row
        });
        (weight, scale)
    }

    /// `range` lies in `0..len` and starts and ends on `block` boundaries (or at `len`).
    fn check_range(
        &self,
        what: &'static str,
        range: &Range<usize>,
        len: usize,
        block: usize,
    ) -> Result<(), CodecError> {
        let on_block = |i: usize| i.is_multiple_of(block) || i == len;
        if range.start >= range.end
            || range.end > len
            || !on_block(range.start)
            || !on_block(range.end)
        {
            return Err(CodecError::Invalid {
                what: "weight slice",
                detail: format!(
                    "{what} {range:?} of {len} in {}: a non-empty range on {block}-wide scale blocks is needed",
                    self.format_name()
                ),
            });
        }
        Ok(())
    }

    /// Writes row `r` as f32 into `out` (`out.len() == cols`).
    ///
    /// # Panics
    /// If `r >= rows` or `out.len() != cols`.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} out of range for {} rows", self.rows);
        assert_eq!(out.len(), self.cols, "dequant_row output length");
        let (w, s) = self.encoded_rows(r..r + 1);
        match &self.data {
            LinearData::F32(_) => half_float::f32_from_le(w, out),
            LinearData::Bf16(_) => half_float::bf16_to_f32(w, out),
            LinearData::F16(_) => half_float::f16_to_f32(w, out),
            LinearData::Fp8Block {
                scale_format,
                block_cols,
                ..
            } => fp8_block::dequant_row(w, s, *scale_format, *block_cols, out),
            LinearData::Mxfp4 { .. } => mxfp4::dequant_row(w, s, out),
            LinearData::Nvfp4 { weight_scale_2, .. } => {
                nvfp4::dequant_row(w, s, *weight_scale_2, out)
            }
        }
    }

    /// The whole matrix as f32 `[rows, cols]` (tests and small tensors only).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols > 0 {
            for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
                self.dequant_row(r, row);
            }
        }
        out
    }

    /// `y[i, r] = Σ_c W[r, c] · x[i, c]` for `n` input rows: `x` is `[n, cols]`, `y` is
    /// `[n, rows]`. Each output is one dot product in a fixed order, so a row's result does
    /// not depend on `n` or on the thread count.
    ///
    /// # Panics
    /// If `x.len() != n * cols` or `y.len() != n * rows`.
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul_rows(0, self.rows, x, n, y);
    }

    /// [`Linear::matmul`] restricted to output rows `first..first + count`: `y` is `[n, count]`.
    ///
    /// # Panics
    /// If the rows are out of range or the buffer lengths do not match.
    pub fn matmul_rows(&self, first: usize, count: usize, x: &[f32], n: usize, y: &mut [f32]) {
        assert!(
            first + count <= self.rows,
            "rows {first}..{} out of range for {}",
            first + count,
            self.rows
        );
        assert_eq!(x.len(), n * self.cols, "matmul input length");
        assert_eq!(y.len(), n * count, "matmul output length");
        let c = self.cols;
        if c == 0 {
            y.fill(0.0);
            return;
        }
        if n == 0 || count == 0 {
            return;
        }
        // Each tile returns its outputs as [n, tile] so the scatter into y is sequential.
        let tiles: Vec<Vec<f32>> = (0..count.div_ceil(ROW_TILE))
            .into_par_iter()
            .map(|t| {
                let r0 = first + t * ROW_TILE;
                let nr = ROW_TILE.min(first + count - r0);
                let mut w = vec![0f32; nr * c];
                for (k, row) in w.chunks_exact_mut(c).enumerate() {
                    self.dequant_row(r0 + k, row);
                }
                let mut out = vec![0f32; n * nr];
                for (xi, oi) in x.chunks_exact(c).zip(out.chunks_exact_mut(nr)) {
                    for (k, o) in oi.iter_mut().enumerate() {
                        *o = dot16(&w[k * c..(k + 1) * c], xi);
                    }
                }
                out
            })
            .collect();
        for (t, out) in tiles.iter().enumerate() {
            let c0 = t * ROW_TILE;
            let nr = out.len() / n;
            for (yi, oi) in y.chunks_exact_mut(count).zip(out.chunks_exact(nr)) {
                yi[c0..c0 + nr].copy_from_slice(oi);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_ops::codecs::fp8_block::ScaleFormat;
    use dsv4_ops::codecs::{fp8_block, half_float, mxfp4, nvfp4};

    fn weights(rows: usize, cols: usize, seed: u32) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| {
                let h = (i as u32 ^ seed)
                    .wrapping_mul(2654435761)
                    .rotate_left(13)
                    .wrapping_mul(40503);
                (h as f32 / u32::MAX as f32 - 0.5) * 3.0
            })
            .collect()
    }

    /// One Linear per encoding, all built from the same f32 matrix.
    fn all_formats(rows: usize, cols: usize) -> Vec<Linear> {
        let w = weights(rows, cols, 7);
        let mut f32b = Vec::new();
        for v in &w {
            f32b.extend_from_slice(&v.to_le_bytes());
        }
        let mut bf = Vec::new();
        half_float::f32_to_bf16_bytes(&w, &mut bf);
        let mut hf = Vec::new();
        half_float::f32_to_f16_bytes(&w, &mut hf);
        let q8 = fp8_block::quantize(&w, rows, cols, ScaleFormat::E8m0, 128).unwrap();
        let q8f = fp8_block::quantize(&w, rows, cols, ScaleFormat::F32, 128).unwrap();
        let mx = mxfp4::quantize(&w, rows, cols).unwrap();
        let nv = nvfp4::quantize(&w, rows, cols).unwrap();
        let fp8 = |q: fp8_block::Fp8Quantized, f| LinearData::Fp8Block {
            weight: Blob::from_vec(q.weight),
            scale: Blob::from_vec(q.scale),
            scale_format: f,
            block_rows: 128,
            block_cols: 128,
        };
        vec![
            LinearData::F32(Blob::from_vec(f32b)),
            LinearData::Bf16(Blob::from_vec(bf)),
            LinearData::F16(Blob::from_vec(hf)),
            fp8(q8, ScaleFormat::E8m0),
            fp8(q8f, ScaleFormat::F32),
            LinearData::Mxfp4 {
                weight: Blob::from_vec(mx.weight),
                scale: Blob::from_vec(mx.scale),
            },
            LinearData::Nvfp4 {
                weight: Blob::from_vec(nv.weight),
                weight_scale: Blob::from_vec(nv.weight_scale),
                weight_scale_2: nv.weight_scale_2,
                input_scale: None,
            },
        ]
        .into_iter()
        .map(|d| Linear::new(rows, cols, d).unwrap())
        .collect()
    }

    #[test]
    fn dequant_matches_codec_reference() {
        let (rows, cols) = (130, 200);
        let w = weights(rows, cols, 7);
        let lins = all_formats(rows, cols);
        let q8 = fp8_block::quantize(&w, rows, cols, ScaleFormat::E8m0, 128).unwrap();
        let mx = mxfp4::quantize(&w, rows, cols).unwrap();
        let nv = nvfp4::quantize(&w, rows, cols).unwrap();
        let refs = [
            (
                3,
                fp8_block::dequantize(
                    &q8.weight,
                    &q8.scale,
                    ScaleFormat::E8m0,
                    rows,
                    cols,
                    128,
                    128,
                )
                .unwrap(),
            ),
            (
                5,
                mxfp4::dequantize(&mx.weight, &mx.scale, rows, cols).unwrap(),
            ),
            (
                6,
                nvfp4::dequantize(&nv.weight, &nv.weight_scale, nv.weight_scale_2, rows, cols)
                    .unwrap(),
            ),
        ];
        for (i, want) in refs {
            assert_eq!(lins[i].to_f32(), want, "{}", lins[i].format_name());
        }
        assert_eq!(lins[0].to_f32(), w);
    }

    #[test]
    fn slices_hold_the_values_of_their_rows_and_columns() {
        let (rows, cols) = (256, 384);
        for lin in all_formats(rows, cols) {
            let full = lin.to_f32();
            let what = lin.format_name();
            for r in [0..128, 128..256, 0..256] {
                let part = lin.slice_rows(r.clone()).unwrap();
                assert_eq!(
                    part.to_f32(),
                    full[r.start * cols..r.end * cols],
                    "{what} rows {r:?}"
                );
            }
            for c in [0..128, 128..384, 256..384] {
                let part = lin.slice_cols(c.clone()).unwrap().to_f32();
                let want: Vec<f32> = (0..rows)
                    .flat_map(|r| full[r * cols + c.start..r * cols + c.end].to_vec())
                    .collect();
                assert_eq!(part, want, "{what} columns {c:?}");
            }
            let block = lin.scales().map_or(1, |s| s.cols);
            if block > 1 {
                let err = lin.slice_cols(0..block / 2).unwrap_err().to_string();
                assert!(err.contains("scale blocks"), "{what}: {err}");
            }
            if lin.scales().is_some_and(|s| s.rows > 1) {
                let err = lin.slice_rows(64..256).unwrap_err().to_string();
                assert!(err.contains("rows 64..256"), "{what}: {err}");
            }
            assert!(lin.slice_rows(0..0).is_err() && lin.slice_cols(0..cols + 1).is_err());
        }
    }

    #[test]
    fn new_rejects_wrong_sizes() {
        let err = Linear::new(2, 3, LinearData::Bf16(Blob::from_vec(vec![0; 10]))).unwrap_err();
        assert_eq!(
            err,
            CodecError::Length {
                what: "bf16 weight",
                expected: 12,
                found: 10
            }
        );
        let err = Linear::new(
            4,
            64,
            LinearData::Mxfp4 {
                weight: Blob::from_vec(vec![0; 128]),
                scale: Blob::from_vec(vec![127; 4]),
            },
        )
        .unwrap_err();
        assert!(matches!(
            err,
            CodecError::Length {
                what: "mxfp4 scale",
                expected: 8,
                ..
            }
        ));
        let err = Linear::new(
            1,
            16,
            LinearData::Nvfp4 {
                weight: Blob::from_vec(vec![0; 8]),
                weight_scale: Blob::from_vec(vec![0x38]),
                weight_scale_2: f32::NAN,
                input_scale: None,
            },
        )
        .unwrap_err();
        assert!(matches!(err, CodecError::Invalid { .. }));
    }

    #[test]
    fn matmul_matches_f64_reference_for_every_format() {
        let (rows, cols, n) = (70, 300, 5);
        let x = weights(n, cols, 99);
        for lin in all_formats(rows, cols) {
            let w = lin.to_f32();
            let mut y = vec![0f32; n * rows];
            lin.matmul(&x, n, &mut y);
            for i in 0..n {
                for r in 0..rows {
                    let exact: f64 = (0..cols)
                        .map(|c| w[r * cols + c] as f64 * x[i * cols + c] as f64)
                        .sum();
                    let scale: f64 = (0..cols)
                        .map(|c| (w[r * cols + c] as f64 * x[i * cols + c] as f64).abs())
                        .sum();
                    let got = y[i * rows + r] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-5 * scale.max(1e-30),
                        "{} i={i} r={r}: {got} vs {exact}",
                        lin.format_name()
                    );
                }
            }
        }
    }

    #[test]
    fn matmul_row_is_independent_of_batch_and_threads() {
        let (rows, cols) = (37, 257);
        let x = weights(7, cols, 3);
        for lin in all_formats(rows, cols) {
            let mut y7 = vec![0f32; 7 * rows];
            lin.matmul(&x, 7, &mut y7);
            for i in 0..7 {
                let mut y1 = vec![0f32; rows];
                lin.matmul(&x[i * cols..(i + 1) * cols], 1, &mut y1);
                assert_eq!(
                    y1.as_slice(),
                    &y7[i * rows..(i + 1) * rows],
                    "{} row {i}",
                    lin.format_name()
                );
            }
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let mut y_single = vec![0f32; 7 * rows];
            pool.install(|| lin.matmul(&x, 7, &mut y_single));
            assert_eq!(y_single, y7);
        }
    }

    #[test]
    fn matmul_rows_selects_a_row_range() {
        let lin = &all_formats(40, 33)[1];
        let x = weights(3, 33, 5);
        let mut full = vec![0f32; 3 * 40];
        lin.matmul(&x, 3, &mut full);
        let mut part = vec![0f32; 3 * 20];
        lin.matmul_rows(17, 20, &x, 3, &mut part);
        for i in 0..3 {
            assert_eq!(&part[i * 20..(i + 1) * 20], &full[i * 40 + 17..i * 40 + 37]);
        }
    }
}
