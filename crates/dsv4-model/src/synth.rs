//! Random-weight checkpoints laid out exactly as the real releases ship them, for tests,
//! demos and benchmarks without the real weights.
//!
//! - [`SynthFormat::Official`]: DeepSeek-native names, FP8 e4m3 128x128 linears with e8m0
//!   `.scale`, MXFP4 routed experts, BF16/F32 elsewhere (spec §12).
//! - [`SynthFormat::Nvfp4`]: the same with NVFP4 routed experts (ModelOpt export layout).
//! - [`SynthFormat::Bf16`]: transformers names, stacked experts, everything BF16 except the
//!   parameters transformers keeps in F32.
//!
//! Values are uniform with a standard deviation of `1/sqrt(fan_in)` for projections and near 1
//! for norm weights, so activations stay O(1) through any depth. Every row is generated from
//! its own seeded RNG, so the output does not depend on the thread count.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use dsv4_ops::codecs::fp8_block::{self, ScaleFormat};
use dsv4_ops::codecs::{e2m1, e4m3, half_float, mxfp4, nvfp4};
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rayon::prelude::*;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use crate::checkpoint::layout::{
    self, ExpertMatrix, LinearRole, TensorKind, TensorSpec, VectorRole,
};
use crate::checkpoint::INDEX_FILE;
use crate::config::{Config, ExpertFormat};

const TOKENIZER_JSON: &[u8] = include_bytes!("../assets/tokenizer.json");
const TOKENIZER_CONFIG_JSON: &[u8] = include_bytes!("../assets/tokenizer_config.json");

/// Activation amax assumed for the NVFP4 `input_scale` (unused by W4A16 paths).
const NVFP4_INPUT_AMAX: f32 = 10.0;

/// f32 elements generated per write batch (bounds memory for any tensor size).
const BATCH_ELEMENTS: usize = 1 << 22;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthFormat {
    /// transformers naming, stacked experts, BF16 weights.
    Bf16,
    /// DeepSeek's release: FP8 block linears and MXFP4 routed experts.
    Official,
    /// NVIDIA's ModelOpt export: as official, with NVFP4 routed experts.
    Nvfp4,
}

impl std::str::FromStr for SynthFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bf16" => Ok(SynthFormat::Bf16),
            "official" => Ok(SynthFormat::Official),
            "nvfp4" => Ok(SynthFormat::Nvfp4),
            _ => Err(format!(
                "unknown synthetic format `{s}` (expected bf16, official or nvfp4)"
            )),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot build the safetensors header: {reason}")]
    Header { path: PathBuf, reason: String },
}

/// Where one logical matrix's values come from: a uniform distribution with this mean and
/// standard deviation, seeded per row by the run seed and `key`.
#[derive(Clone, Copy, Debug)]
struct Values {
    key: u64,
    mean: f32,
    std: f32,
}

impl Values {
    fn new(name: &str, mean: f32, std: f32) -> Values {
        Values {
            key: fnv1a(name),
            mean,
            std,
        }
    }

    /// Largest magnitude the generator can produce.
    fn bound(&self) -> f32 {
        self.mean.abs() + self.std * 3f32.sqrt()
    }

    fn fill_row(&self, seed: u64, row: usize, out: &mut [f32]) {
        let mut rng = row_rng(seed, self.key, row);
        let a = self.std * 3f32.sqrt();
        const INV24: f32 = 1.0 / (1u32 << 24) as f32;
        for pair in out.chunks_mut(2) {
            let r = rng.next_u64();
            let u = [
                (r >> 40) as f32 * INV24,
                ((r >> 8) & 0xff_ffff) as f32 * INV24,
            ];
            for (o, u) in pair.iter_mut().zip(u) {
                *o = self.mean + a * (2.0 * u - 1.0);
            }
        }
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn row_rng(seed: u64, key: u64, row: usize) -> Xoshiro256PlusPlus {
    // seed_from_u64 runs SplitMix64, which decorrelates neighbouring inputs.
    Xoshiro256PlusPlus::seed_from_u64(
        seed ^ key.rotate_left(17) ^ (row as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    )
}

/// How a matrix's rows are encoded into the stored tensors.
#[derive(Clone, Copy, Debug)]
enum Encoding {
    F32,
    Bf16,
    /// FP8 e4m3 weight + e8m0 128x128 block scales.
    Fp8,
    Mxfp4,
    Nvfp4 {
        global: f32,
        input_scale: f32,
    },
}

impl Encoding {
    /// Rows encoded together (FP8 scales span 128 rows).
    fn row_align(self) -> usize {
        match self {
            Encoding::Fp8 => fp8_block::BLOCK,
            _ => 16,
        }
    }
}

/// Stored tensors produced together from one logical value source.
enum Body {
    /// Row-major `[rows, cols]` values, concatenated from segments of `seg_rows` rows each
    /// (one segment per expert matrix for stacked tensors).
    Matrix {
        rows: usize,
        cols: usize,
        segments: Vec<Values>,
        seg_rows: usize,
        enc: Encoding,
    },
    /// `tid2eid [rows, k]` I64: `k` distinct experts out of `experts` per row.
    Tid2eid {
        rows: usize,
        k: usize,
        experts: usize,
        key: u64,
    },
}

struct Group {
    /// Name, dtype, shape of each stored tensor, in file order.
    stored: Vec<(String, Dtype, Vec<usize>)>,
    body: Body,
}

fn nbytes(dtype: Dtype, shape: &[usize]) -> usize {
    shape.iter().product::<usize>() * dtype.bitsize() / 8
}

/// Everything written to one shard.
struct Shard {
    file: String,
    groups: Vec<Group>,
}

fn matrix_group(
    names: Vec<(String, Dtype, Vec<usize>)>,
    rows: usize,
    cols: usize,
    v: Values,
    enc: Encoding,
) -> Group {
    Group {
        stored: names,
        body: Body::Matrix {
            rows,
            cols,
            segments: vec![v],
            seg_rows: rows.max(1),
            enc,
        },
    }
}

/// The groups for one linear (`base` is the canonical name without `.weight`).
fn linear_group(base: &str, rows: usize, cols: usize, v: Values, enc: Encoding, hf: bool) -> Group {
    let name = |s: &str| {
        let native = format!("{base}.{s}");
        if hf {
            layout::to_transformers(&native).expect("layout names have transformers forms")
        } else {
            native
        }
    };
    let names = match enc {
        Encoding::F32 => vec![(name("weight"), Dtype::F32, vec![rows, cols])],
        Encoding::Bf16 => vec![(name("weight"), Dtype::BF16, vec![rows, cols])],
        Encoding::Fp8 => vec![
            (name("weight"), Dtype::F8_E4M3, vec![rows, cols]),
            (
                name("scale"),
                Dtype::F8_E8M0,
                vec![
                    rows.div_ceil(fp8_block::BLOCK),
                    cols.div_ceil(fp8_block::BLOCK),
                ],
            ),
        ],
        Encoding::Mxfp4 => vec![
            (name("weight"), Dtype::I8, vec![rows, cols.div_ceil(2)]),
            (
                name("scale"),
                Dtype::F8_E8M0,
                vec![rows, cols.div_ceil(mxfp4::BLOCK)],
            ),
        ],
        Encoding::Nvfp4 { .. } => vec![
            (name("weight"), Dtype::U8, vec![rows, cols.div_ceil(2)]),
            (
                name("weight_scale"),
                Dtype::F8_E4M3,
                vec![rows, cols.div_ceil(nvfp4::BLOCK)],
            ),
            (name("weight_scale_2"), Dtype::F32, vec![]),
            (name("input_scale"), Dtype::F32, vec![]),
        ],
    };
    matrix_group(names, rows, cols, v, enc)
}

fn linear_values(spec_name: &str, role: LinearRole, cols: usize) -> Values {
    let fan_in = (cols as f32).max(1.0).sqrt();
    let std = match role {
        // Embedding rows feed RMSNorms; unit scale keeps them well inside bf16 range.
        LinearRole::Embedding if spec_name == "embed" => 1.0,
        // A small router keeps expert scores close so the selection bias matters too.
        LinearRole::Dense if spec_name.ends_with("ffn.gate") => 0.5 / fan_in,
        _ => 1.0 / fan_in,
    };
    Values::new(spec_name, 0.0, std)
}

fn vector_values(name: &str, role: VectorRole, shape: &[usize]) -> Values {
    let (mean, std) = match role {
        VectorRole::Norm => (1.0, 0.05),
        // fn rows dot the unit-RMS flattened state: unit-variance logits.
        VectorRole::Hc if name.ends_with("_fn") => {
            (0.0, 1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt())
        }
        VectorRole::Hc if name.ends_with("_scale") => (1.0, 0.2),
        VectorRole::Hc => (0.0, 0.5),
        VectorRole::Sink => (0.0, 0.5),
        VectorRole::Ape => (0.0, 0.3),
        VectorRole::GateBias => (0.0, 0.05),
    };
    Values::new(name, mean, std)
}

/// The values the synthetic checkpoint draws for a vector or a matrix (`[rows, cols]`
/// row-major, before rounding to its stored dtype); `None` for an index table.
pub(crate) fn spec_values(spec: &TensorSpec, seed: u64) -> Option<Vec<f32>> {
    let (rows, cols, v) = match &spec.kind {
        TensorKind::Linear { rows, cols, role } => {
            (*rows, *cols, linear_values(&spec.name, *role, *cols))
        }
        TensorKind::Vector { shape, role } => {
            let cols = *shape.last().unwrap_or(&1);
            let rows = shape.iter().product::<usize>() / cols.max(1);
            (rows, cols, vector_values(&spec.name, *role, shape))
        }
        TensorKind::Index { .. } => return None,
    };
    let mut out = vec![0f32; rows * cols];
    for (r, row) in out.chunks_exact_mut(cols.max(1)).enumerate() {
        v.fill_row(seed, r, row);
    }
    Some(out)
}

/// The expert ids the synthetic checkpoint draws for an index table (`tid2eid`), row-major
/// `[rows, cols]`; `None` for other tensors.
pub(crate) fn spec_expert_ids(spec: &TensorSpec, experts: usize, seed: u64) -> Option<Vec<u32>> {
    let TensorKind::Index { rows, cols } = spec.kind else {
        return None;
    };
    let bytes = tid2eid_rows(seed, fnv1a(&spec.name), 0, rows, cols, experts);
    Some(
        bytes
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect(),
    )
}

/// A stable 64-bit key of a tensor name (seeds per tensor).
pub(crate) fn name_key(name: &str) -> u64 {
    fnv1a(name)
}

/// Plans every shard: top-level tensors first, then one shard per layer.
fn plan(config: &Config, format: SynthFormat) -> Vec<Shard> {
    let hf = format == SynthFormat::Bf16;
    let specs = layout::layout(config);
    let n_shards = 1 + config.num_layers;
    let file = |i: usize| format!("model-{:05}-of-{:05}.safetensors", i + 1, n_shards);
    let mut shards: Vec<Shard> = (0..n_shards)
        .map(|i| Shard {
            file: file(i),
            groups: Vec::new(),
        })
        .collect();
    let shard_of = |name: &str| -> usize {
        name.strip_prefix("layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok())
            .map_or(0, |l| l + 1)
    };
    let vec_name = |n: &str| {
        if hf {
            layout::to_transformers(n).expect("layout names have transformers forms")
        } else {
            n.to_string()
        }
    };
    // transformers stacks each layer's experts: w1/w3 rows interleaved per expert, w2 per expert.
    let mut stacked: BTreeMap<usize, (Vec<Values>, Vec<Values>)> = BTreeMap::new();

    for TensorSpec { name, kind } in specs {
        let s = shard_of(&name);
        let group = match kind {
            TensorKind::Linear { rows, cols, role } => {
                let v = linear_values(&name, role, cols);
                let enc = match (format, role) {
                    (SynthFormat::Bf16, LinearRole::RoutedExpert { layer, which, .. }) => {
                        let (gate_up, down) = stacked.entry(layer).or_default();
                        match which {
                            ExpertMatrix::W1 | ExpertMatrix::W3 => gate_up.push(v),
                            ExpertMatrix::W2 => down.push(v),
                        }
                        continue;
                    }
                    (SynthFormat::Bf16, _) | (_, LinearRole::Embedding | LinearRole::Dense) => {
                        Encoding::Bf16
                    }
                    (_, LinearRole::Fp8) => Encoding::Fp8,
                    (SynthFormat::Official, LinearRole::RoutedExpert { .. }) => Encoding::Mxfp4,
                    (SynthFormat::Nvfp4, LinearRole::RoutedExpert { .. }) => {
                        // w1 and w3 share one global scale; both have fan-in D and the same
                        // distribution, so the generator bound (standing in for the measured
                        // amax) is the same for both.
                        Encoding::Nvfp4 {
                            global: nvfp4::global_scale(v.bound()),
                            input_scale: NVFP4_INPUT_AMAX / (e2m1::MAX * e4m3::MAX),
                        }
                    }
                };
                linear_group(&name, rows, cols, v, enc, hf)
            }
            TensorKind::Vector { shape, role } => {
                let dtype = if role == VectorRole::Norm {
                    Dtype::BF16
                } else {
                    Dtype::F32
                };
                let enc = if dtype == Dtype::BF16 {
                    Encoding::Bf16
                } else {
                    Encoding::F32
                };
                let cols = *shape.last().unwrap_or(&1);
                let rows = shape.iter().product::<usize>() / cols.max(1);
                let v = vector_values(&name, role, &shape);
                matrix_group(vec![(vec_name(&name), dtype, shape)], rows, cols, v, enc)
            }
            TensorKind::Index { rows, cols } => Group {
                stored: vec![(vec_name(&name), Dtype::I64, vec![rows, cols])],
                body: Body::Tid2eid {
                    rows,
                    k: cols,
                    experts: config.n_routed_experts,
                    key: fnv1a(&name),
                },
            },
        };
        shards[s].groups.push(group);
    }

    let (e, i, d) = (
        config.n_routed_experts,
        config.moe_intermediate_size,
        config.hidden_size,
    );
    for (layer, (gate_up, down)) in stacked {
        let p = format!("model.layers.{layer}.mlp.experts");
        shards[layer + 1].groups.push(Group {
            stored: vec![(format!("{p}.gate_up_proj"), Dtype::BF16, vec![e, 2 * i, d])],
            body: Body::Matrix {
                rows: e * 2 * i,
                cols: d,
                segments: gate_up,
                seg_rows: i,
                enc: Encoding::Bf16,
            },
        });
        shards[layer + 1].groups.push(Group {
            stored: vec![(format!("{p}.down_proj"), Dtype::BF16, vec![e, d, i])],
            body: Body::Matrix {
                rows: e * d,
                cols: i,
                segments: down,
                seg_rows: d,
                enc: Encoding::Bf16,
            },
        });
    }
    shards
}

/// Encoded bytes of rows `r0..r0 + n`: (main tensor bytes, side bytes such as scales).
fn encode_rows(
    seed: u64,
    segments: &[Values],
    seg_rows: usize,
    cols: usize,
    enc: Encoding,
    r0: usize,
    n: usize,
) -> (Vec<u8>, Vec<u8>) {
    let mut x = vec![0f32; n * cols];
    if cols > 0 {
        for (k, row) in x.chunks_exact_mut(cols).enumerate() {
            let r = r0 + k;
            segments[r / seg_rows].fill_row(seed, r % seg_rows, row);
        }
    }
    let quant_err = "synthetic buffers have consistent sizes";
    match enc {
        Encoding::F32 => (x.iter().flat_map(|v| v.to_le_bytes()).collect(), Vec::new()),
        Encoding::Bf16 => {
            let mut out = Vec::with_capacity(2 * x.len());
            half_float::f32_to_bf16_bytes(&x, &mut out);
            (out, Vec::new())
        }
        Encoding::Fp8 => {
            let q = fp8_block::quantize(&x, n, cols, ScaleFormat::E8m0, fp8_block::BLOCK)
                .expect(quant_err);
            (q.weight, q.scale)
        }
        Encoding::Mxfp4 => {
            let q = mxfp4::quantize(&x, n, cols).expect(quant_err);
            (q.weight, q.scale)
        }
        Encoding::Nvfp4 { global, .. } => {
            let q = nvfp4::quantize_with_global(&x, n, cols, global).expect(quant_err);
            (q.weight, q.weight_scale)
        }
    }
}

fn tid2eid_rows(seed: u64, key: u64, r0: usize, n: usize, k: usize, experts: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * k * 8);
    let mut row = Vec::with_capacity(k);
    for r in r0..r0 + n {
        let mut rng = row_rng(seed, key, r);
        row.clear();
        while row.len() < k {
            let e = (rng.next_u64() % experts as u64) as i64;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        for e in &row {
            out.extend_from_slice(&e.to_le_bytes());
        }
    }
    out
}

/// Counts data bytes for the progress callback.
struct Progress<'a> {
    done: u64,
    total: u64,
    report: &'a mut dyn FnMut(u64, u64),
}

/// A shard file being written.
struct ShardFile {
    out: BufWriter<File>,
    path: PathBuf,
}

impl ShardFile {
    fn write(&mut self, bytes: &[u8]) -> Result<(), SynthError> {
        self.out.write_all(bytes).map_err(|source| SynthError::Io {
            path: self.path.clone(),
            source,
        })
    }

    fn data(&mut self, bytes: &[u8], p: &mut Progress<'_>) -> Result<(), SynthError> {
        self.write(bytes)?;
        p.done += bytes.len() as u64;
        Ok(())
    }
}

fn write_group(
    f: &mut ShardFile,
    p: &mut Progress<'_>,
    seed: u64,
    g: &Group,
) -> Result<(), SynthError> {
    match &g.body {
        Body::Matrix {
            rows,
            cols,
            segments,
            seg_rows,
            enc,
        } => {
            let (rows, cols) = (*rows, *cols);
            let align = enc.row_align();
            let batch = (BATCH_ELEMENTS / cols.max(1)).max(1).div_ceil(align) * align;
            let mut side = Vec::new();
            for b0 in (0..rows).step_by(batch) {
                let b1 = (b0 + batch).min(rows);
                let starts: Vec<usize> = (b0..b1).step_by(align).collect();
                let chunks: Vec<(Vec<u8>, Vec<u8>)> = starts
                    .into_par_iter()
                    .map(|r0| {
                        encode_rows(
                            seed,
                            segments,
                            *seg_rows,
                            cols,
                            *enc,
                            r0,
                            align.min(b1 - r0),
                        )
                    })
                    .collect();
                for (main, s) in chunks {
                    f.data(&main, p)?;
                    side.extend_from_slice(&s);
                }
                (p.report)(p.done, p.total);
            }
            f.data(&side, p)?;
            if let Encoding::Nvfp4 {
                global,
                input_scale,
            } = enc
            {
                f.data(&global.to_le_bytes(), p)?;
                f.data(&input_scale.to_le_bytes(), p)?;
            }
            (p.report)(p.done, p.total);
        }
        Body::Tid2eid {
            rows,
            k,
            experts,
            key,
        } => {
            let chunk = 4096;
            let starts: Vec<usize> = (0..*rows).step_by(chunk).collect();
            let parts: Vec<Vec<u8>> = starts
                .into_par_iter()
                .map(|r0| tid2eid_rows(seed, *key, r0, chunk.min(rows - r0), *k, *experts))
                .collect();
            for part in parts {
                f.data(&part, p)?;
            }
            (p.report)(p.done, p.total);
        }
    }
    Ok(())
}

/// Writes one shard; returns its tensor names.
fn write_shard(
    dir: &Path,
    shard: &Shard,
    seed: u64,
    p: &mut Progress<'_>,
) -> Result<Vec<String>, SynthError> {
    let path = dir.join(&shard.file);
    let mut infos = Vec::new();
    let mut offset = 0;
    for g in &shard.groups {
        for (name, dtype, shape) in &g.stored {
            let n = nbytes(*dtype, shape);
            infos.push((
                name.clone(),
                TensorInfo {
                    dtype: *dtype,
                    shape: shape.clone(),
                    data_offsets: (offset, offset + n),
                },
            ));
            offset += n;
        }
    }
    let names = infos.iter().map(|(n, _)| n.clone()).collect();
    let header_err = |reason: String| SynthError::Header {
        path: path.clone(),
        reason,
    };
    let meta = Metadata::new(None, infos).map_err(|e| header_err(e.to_string()))?;
    let mut header = serde_json::to_vec(&meta).map_err(|e| header_err(e.to_string()))?;
    // Pad so the data starts 8-byte aligned, as the safetensors writer does.
    header.resize(header.len().div_ceil(8) * 8, b' ');

    let file = File::create(&path).map_err(|source| SynthError::Io {
        path: path.clone(),
        source,
    })?;
    let mut f = ShardFile {
        out: BufWriter::with_capacity(8 << 20, file),
        path,
    };
    f.write(&(header.len() as u64).to_le_bytes())?;
    f.write(&header)?;
    for g in &shard.groups {
        write_group(&mut f, p, seed, g)?;
    }
    f.out.flush().map_err(|source| SynthError::Io {
        path: f.path.clone(),
        source,
    })?;
    Ok(names)
}

fn write_file(path: PathBuf, bytes: &[u8]) -> Result<(), SynthError> {
    std::fs::write(&path, bytes).map_err(|source| SynthError::Io { path, source })
}

/// Writes a random-weight checkpoint for `config` in `format` into `dir` (created if needed):
/// `config.json`, sharded safetensors with `model.safetensors.index.json`, and the tokenizer.
/// `progress(bytes_written, bytes_total)` is called as tensor data is written. Returns the
/// number of tensor-data bytes written.
pub fn write_synthetic(
    config: &Config,
    format: SynthFormat,
    dir: &Path,
    seed: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64, SynthError> {
    std::fs::create_dir_all(dir).map_err(|source| SynthError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let config_json = match format {
        SynthFormat::Bf16 => config.to_transformers_json(),
        SynthFormat::Official => Config {
            expert_format: ExpertFormat::Mxfp4,
            ..config.clone()
        }
        .to_official_json(),
        SynthFormat::Nvfp4 => Config {
            expert_format: ExpertFormat::Nvfp4,
            ..config.clone()
        }
        .to_official_json(),
    };
    let text = serde_json::to_string_pretty(&config_json).expect("a JSON value serializes");
    write_file(dir.join("config.json"), text.as_bytes())?;
    write_file(dir.join("tokenizer.json"), TOKENIZER_JSON)?;
    write_file(dir.join("tokenizer_config.json"), TOKENIZER_CONFIG_JSON)?;

    let shards = plan(config, format);
    let total: u64 = shards
        .iter()
        .flat_map(|s| &s.groups)
        .flat_map(|g| &g.stored)
        .map(|(_, dtype, shape)| nbytes(*dtype, shape) as u64)
        .sum();
    let mut p = Progress {
        done: 0,
        total,
        report: progress,
    };
    let mut weight_map = BTreeMap::new();
    for shard in &shards {
        for name in write_shard(dir, shard, seed, &mut p)? {
            weight_map.insert(name, shard.file.clone());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let text = serde_json::to_string_pretty(&index).expect("a JSON value serializes");
    write_file(dir.join(INDEX_FILE), text.as_bytes())?;
    Ok(p.done)
}

/// A small configuration with every layer kind and dimensions that are not multiples of the
/// quantization blocks.
#[cfg(test)]
pub(crate) fn small_config() -> Config {
    Config {
        vocab_size: 200,
        hidden_size: 80,
        num_heads: 2,
        head_dim: 64,
        rope_dim: 16,
        q_lora_rank: 40,
        o_groups: 2,
        o_lora_rank: 24,
        n_routed_experts: 5,
        experts_per_token: 3,
        moe_intermediate_size: 48,
        num_hash_layers: 1,
        index_n_heads: 2,
        index_head_dim: 32,
        index_topk: 4,
        sliding_window: 8,
        ..Config::tiny()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{Checkpoint, Naming};

    fn write(format: SynthFormat, seed: u64) -> (tempfile::TempDir, u64) {
        let dir = tempfile::tempdir().unwrap();
        let n = write_synthetic(&small_config(), format, dir.path(), seed, &mut |_, _| {}).unwrap();
        (dir, n)
    }

    /// Reads every tensor of the layout through the accessors and checks the values are sane.
    fn check_all_accessors(ck: &Checkpoint) {
        let cfg = ck.config().clone();
        for spec in layout::layout(&cfg) {
            match spec.kind {
                TensorKind::Linear { rows, cols, .. } => {
                    let w = ck.linear(&spec.name, rows, cols).unwrap().to_f32();
                    assert!(w.iter().all(|v| v.is_finite()), "{}", spec.name);
                    assert!(w.iter().any(|&v| v != 0.0), "{}", spec.name);
                }
                TensorKind::Vector { shape, .. } => {
                    let v = ck.vector_f32(&spec.name, &shape).unwrap();
                    assert!(v.iter().all(|v| v.is_finite()), "{}", spec.name);
                }
                TensorKind::Index { rows, cols } => {
                    let t = ck.index_table(&spec.name, rows, cols).unwrap();
                    for row in t.chunks(cols) {
                        assert!(row.iter().all(|&e| (e as usize) < cfg.n_routed_experts));
                        let mut sorted = row.to_vec();
                        sorted.sort();
                        sorted.dedup();
                        assert_eq!(
                            sorted.len(),
                            cols,
                            "experts of a tid2eid row must be distinct"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_format_loads_back_with_all_accessors() {
        let cfg = small_config();
        let routed = cfg.num_layers * cfg.n_routed_experts * 3;
        for (format, naming, expert_fmt, expert_format) in [
            (
                SynthFormat::Official,
                Naming::DeepSeek,
                "mxfp4",
                ExpertFormat::Mxfp4,
            ),
            (
                SynthFormat::Nvfp4,
                Naming::DeepSeek,
                "nvfp4",
                ExpertFormat::Nvfp4,
            ),
            (
                SynthFormat::Bf16,
                Naming::Transformers,
                "bf16",
                ExpertFormat::Bf16,
            ),
        ] {
            let (dir, _) = write(format, 1);
            let ck = Checkpoint::open(dir.path()).unwrap();
            assert_eq!(
                ck.config(),
                &Config {
                    expert_format,
                    ..cfg.clone()
                },
                "{format:?}"
            );
            let s = ck.summary();
            assert_eq!(s.naming, naming);
            assert_eq!(s.shards, 1 + cfg.num_layers);
            assert!(
                s.formats[expert_fmt].tensors >= routed,
                "{format:?}: {:?}",
                s.formats
            );
            if format == SynthFormat::Bf16 {
                assert!(
                    s.formats
                        .keys()
                        .all(|k| ["bf16", "f32", "i64"].contains(&k.as_str())),
                    "{:?}",
                    s.formats
                );
            } else {
                assert_eq!(s.formats[expert_fmt].tensors, routed);
                // Per layer: wq_a, wq_b, wkv, wo_a, wo_b, 3 shared experts, + indexer wq_b on CSA.
                let csa = cfg
                    .layers
                    .iter()
                    .filter(|k| matches!(k, crate::config::LayerKind::Csa { .. }))
                    .count();
                assert_eq!(
                    s.formats["fp8 (e8m0 block scales)"].tensors,
                    8 * cfg.num_layers + csa
                );
            }
            // parameter_count() leaves out the tid2eid tables and the selection biases (buffers).
            let learned = cfg.num_layers - cfg.num_hash_layers;
            let buffers = cfg.num_hash_layers * cfg.vocab_size * cfg.experts_per_token
                + learned * cfg.n_routed_experts;
            assert_eq!(s.params, (cfg.parameter_count().total() + buffers) as u64);
            check_all_accessors(&ck);
            for f in ["tokenizer.json", "tokenizer_config.json"] {
                assert_eq!(
                    std::fs::read(dir.path().join(f)).unwrap().len(),
                    match f {
                        "tokenizer.json" => TOKENIZER_JSON.len(),
                        _ => TOKENIZER_CONFIG_JSON.len(),
                    }
                );
            }
        }
    }

    #[test]
    fn output_depends_only_on_seed() {
        let (a, na) = write(SynthFormat::Official, 7);
        let (b, nb) = write(SynthFormat::Official, 7);
        let (c, _) = write(SynthFormat::Official, 8);
        assert_eq!(na, nb);
        let shard = "model-00002-of-00005.safetensors";
        let read = |d: &tempfile::TempDir| std::fs::read(d.path().join(shard)).unwrap();
        assert_eq!(read(&a), read(&b));
        assert_ne!(read(&a), read(&c));
        // A single worker thread writes the same bytes.
        let d = tempfile::tempdir().unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        pool.install(|| {
            write_synthetic(
                &small_config(),
                SynthFormat::Official,
                d.path(),
                7,
                &mut |_, _| {},
            )
        })
        .unwrap();
        assert_eq!(read(&a), std::fs::read(d.path().join(shard)).unwrap());
    }

    #[test]
    fn progress_reaches_the_index_total() {
        let dir = tempfile::tempdir().unwrap();
        let mut last = (0, 1);
        let n = write_synthetic(
            &small_config(),
            SynthFormat::Nvfp4,
            dir.path(),
            3,
            &mut |d, t| {
                assert!(d <= t);
                last = (d, t);
            },
        )
        .unwrap();
        assert_eq!(last.0, n);
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(INDEX_FILE)).unwrap())
                .unwrap();
        assert_eq!(index["metadata"]["total_size"].as_u64(), Some(n));
        assert_eq!(last.1, n);
    }

    #[test]
    fn weights_have_intended_magnitudes_and_nvfp4_sharing() {
        let cfg = small_config();
        let (dir, _) = write(SynthFormat::Nvfp4, 5);
        let ck = Checkpoint::open(dir.path()).unwrap();
        let d = cfg.hidden_size;
        let wq_a = ck
            .linear("layers.1.attn.wq_a", cfg.q_lora_rank, d)
            .unwrap()
            .to_f32();
        let std = (wq_a.iter().map(|v| v * v).sum::<f32>() / wq_a.len() as f32).sqrt();
        let want = 1.0 / (d as f32).sqrt();
        assert!((std / want - 1.0).abs() < 0.15, "std {std} want {want}");
        let norm = ck.vector_f32("layers.1.attn_norm.weight", &[d]).unwrap();
        assert!(norm.iter().all(|v| (0.9..=1.1).contains(v)));
        let inter = cfg.moe_intermediate_size;
        let scales = |w: &str, rows, cols| match ck
            .linear(&format!("layers.2.ffn.experts.3.{w}"), rows, cols)
            .unwrap()
            .data()
        {
            crate::linear::LinearData::Nvfp4 {
                weight_scale_2,
                input_scale,
                ..
            } => (*weight_scale_2, *input_scale),
            other => panic!("expected NVFP4, found {other:?}"),
        };
        let (w1, w3, w2) = (
            scales("w1", inter, d),
            scales("w3", inter, d),
            scales("w2", d, inter),
        );
        assert_eq!(w1, w3);
        assert_ne!(w1.0, w2.0);
        assert!(w1.1.is_some());
    }

    #[test]
    fn format_names_parse() {
        assert_eq!("nvfp4".parse::<SynthFormat>(), Ok(SynthFormat::Nvfp4));
        assert_eq!("official".parse::<SynthFormat>(), Ok(SynthFormat::Official));
        assert_eq!("bf16".parse::<SynthFormat>(), Ok(SynthFormat::Bf16));
        assert!("fp8".parse::<SynthFormat>().unwrap_err().contains("fp8"));
    }
}
