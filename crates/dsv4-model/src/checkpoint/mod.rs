//! Checkpoint loading: memory-maps safetensors shards, maps transformers names onto the
//! DeepSeek-native ones, validates every tensor the config needs, and serves them as
//! [`Linear`]s (still in their stored encoding) or small f32 / index vectors.

mod blob;
pub mod layout;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsv4_ops::codecs::fp8_block::{self, ScaleFormat};
use dsv4_ops::codecs::{half_float, mxfp4, nvfp4};
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

pub use blob::Blob;
pub use layout::Naming;
use layout::{TensorKind, Translated};

use crate::config::{Config, ConfigError};
use crate::linear::{Linear, LinearData};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no {INDEX_FILE} or {SINGLE_FILE} in {dir}")]
    NoWeights { dir: PathBuf },
    #[error("{file}: invalid shard index: {reason}")]
    Index { file: PathBuf, reason: String },
    #[error("shard {shard} named by {index} cannot be opened: {source}")]
    MissingShard {
        shard: PathBuf,
        index: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: corrupt safetensors header: {reason}")]
    Header { file: PathBuf, reason: String },
    #[error("tensor `{tensor}` in {file}: data ends at byte {end} but the file has {len} bytes (truncated file)")]
    Truncated {
        tensor: String,
        file: PathBuf,
        end: usize,
        len: usize,
    },
    #[error("tensor `{tensor}` in {file}: unknown tensor ({reason})")]
    UnknownTensor {
        tensor: String,
        file: PathBuf,
        reason: String,
    },
    #[error("tensor `{tensor}` appears twice: in {first} and in {second}")]
    Duplicate {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("tensor `{tensor}` is required by the config but missing from {dir}")]
    Missing { tensor: String, dir: PathBuf },
    #[error("tensor `{tensor}` in {file}: expected shape {expected:?}, found {found:?}")]
    Shape {
        tensor: String,
        file: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{tensor}` in {file}: unexpected dtype {found} (expected {expected})")]
    Dtype {
        tensor: String,
        file: PathBuf,
        expected: String,
        found: String,
    },
    #[error("tensor `{tensor}`: {reason}")]
    BadValue { tensor: String, reason: String },
    #[error("the checkpoint mixes key namings: {0}")]
    MixedNaming(Box<NamingConflict>),
}

/// Two keys of one checkpoint that no single naming explains.
#[derive(Debug, thiserror::Error)]
#[error("`{first}` in {} is {first_naming} naming, `{second}` in {} is {second_naming} naming", first_file.display(), second_file.display())]
pub struct NamingConflict {
    pub first: String,
    pub first_file: PathBuf,
    pub first_naming: String,
    pub second: String,
    pub second_file: PathBuf,
    pub second_naming: String,
}

/// One stored tensor under its canonical name.
#[derive(Clone, Debug)]
struct Entry {
    /// The name as stored (with an expert/row range for views of stacked tensors).
    source: String,
    file: Arc<Path>,
    dtype: Dtype,
    shape: Vec<usize>,
    blob: Blob,
}

/// Counts for one storage encoding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FormatStats {
    pub tensors: usize,
    pub params: u64,
    pub bytes: u64,
}

/// What `dsv4 info` shows about a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    pub naming: Naming,
    pub shards: usize,
    /// Per encoding: linears by [`Linear::format_name`], other parameters by dtype.
    pub formats: BTreeMap<String, FormatStats>,
    pub params: u64,
    pub bytes: u64,
    /// `mtp.*` tensors present in the files and not loaded.
    pub skipped_mtp: usize,
}

pub struct Checkpoint {
    dir: PathBuf,
    config: Config,
    tensors: HashMap<String, Entry>,
    summary: Summary,
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

fn shape_matches(found: &[usize], expected: &[usize]) -> bool {
    // A scalar may be stored as shape [] or [1].
    found == expected
        || (found.iter().product::<usize>() == 1
            && expected.iter().product::<usize>() == 1
            && found.len() <= 1
            && expected.len() <= 1)
}

/// Memory-maps one shard and returns its tensors, every byte range checked against the file.
fn read_shard(path: &Path) -> Result<Vec<(String, Entry)>, LoadError> {
    let io = |source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len() as usize;
    let header = |reason: String| LoadError::Header {
        file: path.to_path_buf(),
        reason,
    };
    if len < 8 {
        return Err(header(format!(
            "file has {len} bytes, shorter than the 8-byte header length"
        )));
    }
    // SAFETY: the map is read-only; a checkpoint modified while mapped is outside our control,
    // as with every mmap-based loader.
    let map = unsafe { Mmap::map(&file) }.map_err(io)?;
    let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
    let data_start = n
        .checked_add(8)
        .filter(|&e| e <= len)
        .ok_or_else(|| header(format!("header length {n} exceeds the file size {len}")))?;
    let meta: Metadata = serde_json::from_slice(&map[8..data_start])
        .map_err(|e| header(misfit_tensor(&map[8..data_start]).unwrap_or(e.to_string())))?;
    let blob = Blob::from_mmap(map);
    let file: Arc<Path> = Arc::from(path);
    let mut out = Vec::new();
    // In offset order, so a truncated file reports the first tensor it cuts.
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("offset_keys lists known tensors");
        let (s, e) = info.data_offsets;
        let end = data_start.saturating_add(e);
        let Some(tensor_blob) = blob.slice(data_start.saturating_add(s)..end) else {
            return Err(LoadError::Truncated {
                tensor: name,
                file: path.to_path_buf(),
                end,
                len,
            });
        };
        out.push((
            name.clone(),
            Entry {
                source: name,
                file: file.clone(),
                dtype: info.dtype,
                shape: info.shape.clone(),
                blob: tensor_blob,
            },
        ));
    }
    Ok(out)
}

/// The first tensor of a header whose shape and dtype need another byte count than its
/// offsets hold, described (safetensors refuses such a header without naming the tensor).
fn misfit_tensor(header: &[u8]) -> Option<String> {
    let entries: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    entries.into_iter().find_map(|(name, v)| {
        let info: TensorInfo = serde_json::from_value(v).ok()?;
        let (s, e) = info.data_offsets;
        let bits = (info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)))
            .and_then(|n| n.checked_mul(info.dtype.bitsize()));
        let held = e.checked_sub(s).map(|b| b * 8);
        (bits != held).then(|| {
            format!(
                "tensor `{name}`: shape {:?} of {:?} does not fit its offsets {s}..{e}",
                info.shape, info.dtype
            )
        })
    })
}

/// A `model.safetensors.index.json` and the tensor -> file map it declares.
struct ShardIndex {
    path: PathBuf,
    weight_map: HashMap<String, String>,
}

/// Shard files of a checkpoint directory, and the index that lists them (if sharded).
fn shard_list(dir: &Path) -> Result<(Vec<PathBuf>, Option<ShardIndex>), LoadError> {
    let index_path = dir.join(INDEX_FILE);
    if index_path.exists() {
        let text = std::fs::read_to_string(&index_path).map_err(|source| LoadError::Io {
            path: index_path.clone(),
            source,
        })?;
        let bad = |reason: String| LoadError::Index {
            file: index_path.clone(),
            reason,
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("no `weight_map` object".into()))?;
        let mut weight_map = HashMap::new();
        let mut files: Vec<String> = Vec::new();
        for (k, f) in map {
            let f = f
                .as_str()
                .ok_or_else(|| bad(format!("`{k}` maps to {f}, not a file name")))?;
            if !files.iter().any(|x| x == f) {
                files.push(f.to_string());
            }
            weight_map.insert(k.clone(), f.to_string());
        }
        files.sort();
        Ok((
            files.iter().map(|f| dir.join(f)).collect(),
            Some(ShardIndex {
                path: index_path,
                weight_map,
            }),
        ))
    } else if dir.join(SINGLE_FILE).exists() {
        Ok((vec![dir.join(SINGLE_FILE)], None))
    } else {
        Err(LoadError::NoWeights {
            dir: dir.to_path_buf(),
        })
    }
}

impl Checkpoint {
    /// Opens a checkpoint directory: `config.json` plus `model.safetensors.index.json` and its
    /// shards, or a single `model.safetensors`. Every tensor the config needs is checked for
    /// presence, dtype and shape; unknown tensors are errors, `mtp.*` tensors are skipped.
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint, LoadError> {
        let dir = dir.as_ref().to_path_buf();
        let config = Config::from_dir(&dir)?;
        let (shards, index) = shard_list(&dir)?;

        let mut raw: Vec<(String, Entry)> = Vec::new();
        for shard in &shards {
            if let Some(index) = &index {
                if let Err(source) = File::open(shard) {
                    return Err(LoadError::MissingShard {
                        shard: shard.clone(),
                        index: index.path.clone(),
                        source,
                    });
                }
            }
            raw.extend(read_shard(shard)?);
        }
        // A name stored twice is named as such, before the index (one file a name) is checked.
        let mut found: HashMap<&str, &Path> = HashMap::with_capacity(raw.len());
        for (n, e) in &raw {
            if let Some(first) = found.insert(n.as_str(), &e.file) {
                return Err(LoadError::Duplicate {
                    tensor: n.clone(),
                    first: first.to_path_buf(),
                    second: e.file.to_path_buf(),
                });
            }
        }
        if let Some(index) = &index {
            let mut listed: Vec<_> = index.weight_map.iter().collect();
            listed.sort();
            for (name, f) in listed {
                if found.get(name.as_str()) != Some(&dir.join(f).as_path()) {
                    return Err(LoadError::Index {
                        file: index.path.clone(),
                        reason: format!("lists tensor `{name}` in {f}, which does not contain it"),
                    });
                }
            }
        }
        raw.sort_by(|a, b| a.0.cmp(&b.0));

        let skipped_mtp = raw.iter().filter(|(n, _)| layout::is_mtp_key(n)).count();
        raw.retain(|(n, _)| !layout::is_mtp_key(n));
        let naming = layout::naming_of_keys(raw.iter().map(|(n, _)| n.as_str())).map_err(
            |(first, first_set, second, second_set)| {
                let file = |key: &str| {
                    let (_, e) = raw.iter().find(|(n, _)| n == key).expect("a listed key");
                    e.file.to_path_buf()
                };
                LoadError::MixedNaming(Box::new(NamingConflict {
                    first: first.to_string(),
                    first_file: file(first),
                    first_naming: layout::describe_namings(first_set),
                    second: second.to_string(),
                    second_file: file(second),
                    second_naming: layout::describe_namings(second_set),
                }))
            },
        )?;

        let mut tensors: HashMap<String, Entry> = HashMap::with_capacity(raw.len());
        let mut insert = |name: String, entry: Entry| -> Result<(), LoadError> {
            if let Some(prev) = tensors.get(&name) {
                return Err(LoadError::Duplicate {
                    tensor: format!("{name} (as `{}` and `{}`)", prev.source, entry.source),
                    first: prev.file.to_path_buf(),
                    second: entry.file.to_path_buf(),
                });
            }
            tensors.insert(name, entry);
            Ok(())
        };
        for (name, entry) in raw {
            let translated = match naming {
                Naming::DeepSeek => Some(Translated::Native(name.clone())),
                Naming::TransformersSaved => layout::translate_saved(&name).map(Translated::Native),
                Naming::Transformers => layout::translate(&name),
            };
            match translated {
                Some(Translated::Native(native)) => insert(native, entry)?,
                Some(Translated::StackedGateUp { layer }) => {
                    for (e, w1, w3) in split_stacked(&config, &entry, true)? {
                        insert(format!("layers.{layer}.ffn.experts.{e}.w1.weight"), w1)?;
                        insert(
                            format!("layers.{layer}.ffn.experts.{e}.w3.weight"),
                            w3.expect("gate_up has w3"),
                        )?;
                    }
                }
                Some(Translated::StackedDown { layer }) => {
                    for (e, w2, _) in split_stacked(&config, &entry, false)? {
                        insert(format!("layers.{layer}.ffn.experts.{e}.w2.weight"), w2)?;
                    }
                }
                None => {
                    return Err(LoadError::UnknownTensor {
                        tensor: name,
                        file: entry.file.to_path_buf(),
                        reason: format!("not a DeepSeek-V4 {} tensor name", naming.describe()),
                    })
                }
            }
        }

        let mut ck = Checkpoint {
            dir,
            config,
            tensors,
            summary: Summary {
                naming,
                shards: shards.len(),
                formats: BTreeMap::new(),
                params: 0,
                bytes: 0,
                skipped_mtp,
            },
        };
        ck.validate()?;
        Ok(ck)
    }

    /// Checks every tensor against the layout, and every layout entry against its tensors;
    /// fills in the summary.
    fn validate(&mut self) -> Result<(), LoadError> {
        let specs = layout::layout(&self.config);
        let mut known: HashMap<&str, bool> = HashMap::with_capacity(specs.len());
        for s in &specs {
            known.insert(&s.name, matches!(s.kind, TensorKind::Linear { .. }));
        }
        let mut names: Vec<&String> = self.tensors.keys().collect();
        names.sort();
        for name in names {
            let ok = known.get(name.as_str()) == Some(&false)
                || name.rsplit_once('.').is_some_and(|(base, suffix)| {
                    known.get(base) == Some(&true) && layout::LINEAR_SUFFIXES.contains(&suffix)
                });
            if !ok {
                let e = &self.tensors[name];
                return Err(LoadError::UnknownTensor {
                    tensor: e.source.clone(),
                    file: e.file.to_path_buf(),
                    reason: layout::unknown_reason(&self.config, name),
                });
            }
        }

        let mut formats: BTreeMap<String, FormatStats> = BTreeMap::new();
        for s in &specs {
            let (fmt, params, bytes) = match &s.kind {
                TensorKind::Linear { rows, cols, .. } => {
                    let lin = self.linear(&s.name, *rows, *cols)?;
                    (lin.format_name().to_string(), rows * cols, lin.bytes())
                }
                TensorKind::Vector { shape, .. } => {
                    let e = self.entry(&s.name)?;
                    self.check_float(e, shape)?;
                    (
                        dtype_name(e.dtype).to_lowercase(),
                        shape.iter().product(),
                        e.blob.len(),
                    )
                }
                TensorKind::Index { rows, cols } => {
                    let e = self.entry(&s.name)?;
                    self.check_index(e, *rows, *cols)?;
                    (
                        dtype_name(e.dtype).to_lowercase(),
                        rows * cols,
                        e.blob.len(),
                    )
                }
            };
            let f = formats.entry(fmt).or_default();
            f.tensors += 1;
            f.params += params as u64;
            f.bytes += bytes as u64;
        }
        self.summary.params = formats.values().map(|f| f.params).sum();
        self.summary.bytes = formats.values().map(|f| f.bytes).sum();
        self.summary.formats = formats;
        Ok(())
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn summary(&self) -> &Summary {
        &self.summary
    }

    /// Whether a tensor (canonical name, e.g. `layers.0.attn.wq_a.weight`) is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn entry(&self, name: &str) -> Result<&Entry, LoadError> {
        self.tensors.get(name).ok_or_else(|| LoadError::Missing {
            tensor: name.to_string(),
            dir: self.dir.clone(),
        })
    }

    fn shape_err(e: &Entry, expected: &[usize]) -> LoadError {
        LoadError::Shape {
            tensor: e.source.clone(),
            file: e.file.to_path_buf(),
            expected: expected.to_vec(),
            found: e.shape.clone(),
        }
    }

    fn dtype_err(e: &Entry, expected: &str) -> LoadError {
        LoadError::Dtype {
            tensor: e.source.clone(),
            file: e.file.to_path_buf(),
            expected: expected.to_string(),
            found: dtype_name(e.dtype),
        }
    }

    fn check_shape(e: &Entry, expected: &[usize]) -> Result<(), LoadError> {
        if shape_matches(&e.shape, expected) {
            Ok(())
        } else {
            Err(Self::shape_err(e, expected))
        }
    }

    fn check_float(&self, e: &Entry, shape: &[usize]) -> Result<(), LoadError> {
        if !matches!(e.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(Self::dtype_err(e, "F32, BF16 or F16"));
        }
        Self::check_shape(e, shape)
    }

    fn check_index(&self, e: &Entry, rows: usize, cols: usize) -> Result<(), LoadError> {
        if !matches!(e.dtype, Dtype::I64 | Dtype::I32) {
            return Err(Self::dtype_err(e, "I64 or I32"));
        }
        Self::check_shape(e, &[rows, cols])
    }

    /// A scalar F32 sibling (`weight_scale_2`, `input_scale`).
    fn scalar_f32(&self, name: &str) -> Result<Option<f32>, LoadError> {
        let Some(e) = self.tensors.get(name) else {
            return Ok(None);
        };
        if e.dtype != Dtype::F32 {
            return Err(Self::dtype_err(e, "F32"));
        }
        Self::check_shape(e, &[])?;
        let b = e.blob.bytes();
        let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if !v.is_finite() {
            return Err(LoadError::BadValue {
                tensor: e.source.clone(),
                reason: format!("scale {v} in {} is not finite", e.file.display()),
            });
        }
        Ok(Some(v))
    }

    /// The matrix `<name>.weight` of shape `[rows, cols]` in its stored encoding, inferred from
    /// its dtype and siblings: F32/BF16/F16; F8_E4M3 + `.scale` (F8_E8M0 or F32 blocks) = FP8;
    /// I8/U8 + `.scale` (F8_E8M0 per 32) = MXFP4; U8 + `.weight_scale` (F8_E4M3 per 16) +
    /// `.weight_scale_2` (+ optional `.input_scale`) = NVFP4.
    pub fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        let w = self.entry(&format!("{name}.weight"))?;
        let sibling = |s: &str| self.tensors.get(&format!("{name}.{s}"));
        let need = |s: &str| self.entry(&format!("{name}.{s}"));
        let data = match w.dtype {
            Dtype::F32 | Dtype::BF16 | Dtype::F16 => {
                Self::check_shape(w, &[rows, cols])?;
                match w.dtype {
                    Dtype::F32 => LinearData::F32(w.blob.clone()),
                    Dtype::BF16 => LinearData::Bf16(w.blob.clone()),
                    _ => LinearData::F16(w.blob.clone()),
                }
            }
            Dtype::F8_E4M3 => {
                Self::check_shape(w, &[rows, cols])?;
                let s = need("scale")?;
                let scale_format = match s.dtype {
                    Dtype::F8_E8M0 => ScaleFormat::E8m0,
                    Dtype::F32 => ScaleFormat::F32,
                    _ => return Err(Self::dtype_err(s, "F8_E8M0 or F32")),
                };
                let default = [
                    rows.div_ceil(fp8_block::BLOCK),
                    cols.div_ceil(fp8_block::BLOCK),
                ];
                let blocks = match s.shape.as_slice() {
                    &[sr, sc] => {
                        fp8_block::infer_block(rows, sr).zip(fp8_block::infer_block(cols, sc))
                    }
                    _ => None,
                };
                let (block_rows, block_cols) =
                    blocks.ok_or_else(|| Self::shape_err(s, &default))?;
                LinearData::Fp8Block {
                    weight: w.blob.clone(),
                    scale: s.blob.clone(),
                    scale_format,
                    block_rows,
                    block_cols,
                }
            }
            Dtype::U8 | Dtype::I8 => {
                Self::check_shape(w, &[rows, cols.div_ceil(2)])?;
                if let Some(ws) = sibling("weight_scale") {
                    if ws.dtype != Dtype::F8_E4M3 {
                        return Err(Self::dtype_err(ws, "F8_E4M3"));
                    }
                    Self::check_shape(ws, &[rows, cols.div_ceil(nvfp4::BLOCK)])?;
                    let global = self
                        .scalar_f32(&format!("{name}.weight_scale_2"))?
                        .ok_or_else(|| LoadError::Missing {
                            tensor: format!("{name}.weight_scale_2"),
                            dir: self.dir.clone(),
                        })?;
                    LinearData::Nvfp4 {
                        weight: w.blob.clone(),
                        weight_scale: ws.blob.clone(),
                        weight_scale_2: global,
                        input_scale: self.scalar_f32(&format!("{name}.input_scale"))?,
                    }
                } else {
                    let s = need("scale")?;
                    if s.dtype != Dtype::F8_E8M0 {
                        return Err(Self::dtype_err(s, "F8_E8M0"));
                    }
                    Self::check_shape(s, &[rows, cols.div_ceil(mxfp4::BLOCK)])?;
                    LinearData::Mxfp4 {
                        weight: w.blob.clone(),
                        scale: s.blob.clone(),
                    }
                }
            }
            _ => return Err(Self::dtype_err(w, "F32, BF16, F16, F8_E4M3, I8 or U8")),
        };
        Linear::new(rows, cols, data).map_err(|e| LoadError::BadValue {
            tensor: w.source.clone(),
            reason: format!("in {}: {e}", w.file.display()),
        })
    }

    /// A float parameter (norm, bias, sink, ape, mHC) of exactly `shape`, as f32.
    pub fn vector_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let e = self.entry(name)?;
        self.check_float(e, shape)?;
        let mut out = vec![0f32; shape.iter().product()];
        match e.dtype {
            Dtype::F32 => half_float::f32_from_le(e.blob.bytes(), &mut out),
            Dtype::BF16 => half_float::bf16_to_f32(e.blob.bytes(), &mut out),
            _ => half_float::f16_to_f32(e.blob.bytes(), &mut out),
        }
        Ok(out)
    }

    /// An integer table `[rows, cols]` (I64 or I32) whose values must fit u32.
    pub fn index_table(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<u32>, LoadError> {
        let e = self.entry(name)?;
        self.check_index(e, rows, cols)?;
        let bytes = e.blob.bytes();
        let values: Vec<i64> = match e.dtype {
            Dtype::I64 => bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64)
                .collect(),
        };
        values
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                u32::try_from(v).map_err(|_| LoadError::BadValue {
                    tensor: e.source.clone(),
                    reason: format!(
                        "entry [{}, {}] = {v} in {} does not fit u32",
                        i / cols.max(1),
                        i % cols.max(1),
                        e.file.display()
                    ),
                })
            })
            .collect()
    }
}

/// Per-expert views of a transformers stacked expert tensor: `gate_up_proj [E, 2I, D]` gives
/// (w1 = rows 0..I, w3 = rows I..2I) per expert; `down_proj [E, D, I]` gives w2.
fn split_stacked(
    config: &Config,
    entry: &Entry,
    gate_up: bool,
) -> Result<Vec<(usize, Entry, Option<Entry>)>, LoadError> {
    let (e, i, d) = (
        config.n_routed_experts,
        config.moe_intermediate_size,
        config.hidden_size,
    );
    let expected = if gate_up {
        vec![e, 2 * i, d]
    } else {
        vec![e, d, i]
    };
    if entry.shape != expected {
        return Err(Checkpoint::shape_err(entry, &expected));
    }
    let esize = match entry.dtype {
        Dtype::F32 => 4,
        Dtype::BF16 | Dtype::F16 => 2,
        _ => {
            return Err(Checkpoint::dtype_err(
                entry,
                "F32, BF16 or F16 (stacked experts)",
            ))
        }
    };
    let view =
        |x: usize, first_row: usize, rows: usize, cols: usize, per_expert: usize, label: &str| {
            Entry {
                source: format!("{}[{x}, {label}]", entry.source),
                file: entry.file.clone(),
                dtype: entry.dtype,
                shape: vec![rows, cols],
                blob: entry
                    .blob
                    .slice(
                        (x * per_expert + first_row * cols) * esize
                            ..(x * per_expert + (first_row + rows) * cols) * esize,
                    )
                    .expect("stacked shape was checked against the byte length"),
            }
        };
    Ok((0..e)
        .map(|x| {
            if gate_up {
                let per = 2 * i * d;
                (
                    x,
                    view(x, 0, i, d, per, &format!("0:{i}")),
                    Some(view(x, i, i, d, per, &format!("{i}:{}", 2 * i))),
                )
            } else {
                (x, view(x, 0, d, i, d * i, ":"), None)
            }
        })
        .collect())
}

#[cfg(test)]
mod tests;
