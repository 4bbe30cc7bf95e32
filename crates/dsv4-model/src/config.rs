//! Model configuration: parses both the official DeepSeek-V4 `config.json` keys and the
//! transformers-style ones, validates them, and writes either style back out.

use std::path::Path;

use serde_json::{json, Map, Value};

/// A configuration problem, always naming the offending file or field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("model directory {0} does not exist")]
    NoDirectory(String),
    #[error("{0} is not a directory (a model directory holds config.json and the weights)")]
    NotADirectory(String),
    #[error("cannot read config {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("config {path} is not valid JSON: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("config {path}: field `{field}`: {reason}")]
    Field {
        path: String,
        field: String,
        reason: String,
    },
}

/// Where a config parsed from a string says it came from, until [`Config::from_dir`] names the file.
const FROM_STRING: &str = "<string>";

/// Most Sinkhorn iterations a config may ask for (the releases use 20).
pub const MAX_SINKHORN_ITERS: usize = 1000;

/// `v` must be a finite, positive number (an epsilon, limit, scale, base or YaRN beta).
fn check_positive_real(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(field_err(
            field,
            format!("must be finite and positive, found {v}"),
        ))
    }
}

fn field_err(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        path: FROM_STRING.into(),
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// Attention flavour of one layer (spec §1.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Sliding window only.
    Sliding,
    /// Compressed sparse attention: overlapping compressor + Lightning Indexer.
    Csa { ratio: usize },
    /// Heavily compressed attention: non-overlapping compressor, every entry visible.
    Hca { ratio: usize },
}

impl LayerKind {
    /// Compression ratio, 0 for sliding-only layers.
    pub fn ratio(self) -> usize {
        match self {
            LayerKind::Sliding => 0,
            LayerKind::Csa { ratio } | LayerKind::Hca { ratio } => ratio,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Sliding => "sliding",
            LayerKind::Csa { .. } => "csa",
            LayerKind::Hca { .. } => "hca",
        }
    }

    fn transformers_name(self) -> &'static str {
        match self {
            LayerKind::Sliding => "sliding_attention",
            LayerKind::Csa { .. } => "compressed_sparse_attention",
            LayerKind::Hca { .. } => "heavily_compressed_attention",
        }
    }
}

/// Rotary parameters of one rope table ("main" or "compress").
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub yarn: Option<Yarn>,
}

/// YaRN frequency interpolation (no magnitude scaling: V4 forces `attention_factor = 1`).
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// Storage format of the routed experts announced by the config (the loader still infers the
/// real encoding of every tensor from its dtype and siblings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    Bf16,
    Fp8,
    Mxfp4,
    Nvfp4,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub n_routed_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate_size: usize,
    pub routed_scaling_factor: f32,
    pub swiglu_limit: f32,
    pub num_hash_layers: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub sliding_window: usize,
    pub layers: Vec<LayerKind>,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rms_norm_eps: f32,
    pub rope_main: RopeConfig,
    pub rope_compress: RopeConfig,
    pub max_position_embeddings: usize,
    pub bos_token_id: u32,
    pub eos_token_ids: Vec<u32>,
    pub expert_format: ExpertFormat,
}

/// Reads typed values out of the JSON object, naming the field on every error.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, names: &[&str]) -> Option<(&'a str, &'a Value)> {
        names.iter().find_map(|n| {
            self.0
                .get_key_value(*n)
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.as_str(), v))
        })
    }

    fn usize_opt(&self, names: &[&str]) -> Result<Option<usize>, ConfigError> {
        match self.get(names) {
            None => Ok(None),
            Some((k, v)) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| field_err(k, format!("expected a non-negative integer, found {v}"))),
        }
    }

    fn usize(&self, names: &[&str], default: Option<usize>) -> Result<usize, ConfigError> {
        self.usize_opt(names)?
            .or(default)
            .ok_or_else(|| field_err(names[0], "missing"))
    }

    fn f64_opt(&self, names: &[&str]) -> Result<Option<f64>, ConfigError> {
        match self.get(names) {
            None => Ok(None),
            Some((k, v)) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| field_err(k, format!("expected a number, found {v}"))),
        }
    }

    fn f64(&self, names: &[&str], default: f64) -> Result<f64, ConfigError> {
        Ok(self.f64_opt(names)?.unwrap_or(default))
    }

    fn str_opt(&self, names: &[&str]) -> Result<Option<&'a str>, ConfigError> {
        match self.get(names) {
            None => Ok(None),
            Some((k, v)) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| field_err(k, format!("expected a string, found {v}"))),
        }
    }
}

fn parse_yarn(field: &str, obj: &Map<String, Value>) -> Result<Option<Yarn>, ConfigError> {
    let f = Fields(obj);
    let kind = f.str_opt(&["rope_type", "type"])?.unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "yarn" => {
            let factor = f
                .f64_opt(&["factor"])?
                .ok_or_else(|| field_err(&format!("{field}.factor"), "missing"))?;
            let original = f
                .f64_opt(&["original_max_position_embeddings", "original_seq_len"])?
                .ok_or_else(|| {
                    field_err(
                        &format!("{field}.original_max_position_embeddings"),
                        "missing",
                    )
                })?;
            if let Some(af) = f.f64_opt(&["attention_factor"])? {
                if af != 1.0 {
                    return Err(field_err(
                        &format!("{field}.attention_factor"),
                        format!(
                            "DeepSeek-V4 uses no YaRN magnitude scaling; expected 1.0, found {af}"
                        ),
                    ));
                }
            }
            let yarn = Yarn {
                factor,
                original_max_position: original,
                beta_fast: f.f64(&["beta_fast"], 32.0)?,
                beta_slow: f.f64(&["beta_slow"], 1.0)?,
            };
            if !(yarn.factor > 0.0 && yarn.original_max_position > 0.0) {
                return Err(field_err(
                    field,
                    "YaRN factor and original_max_position_embeddings must be positive",
                ));
            }
            for (name, v) in [("beta_fast", yarn.beta_fast), ("beta_slow", yarn.beta_slow)] {
                check_positive_real(&format!("{field}.{name}"), v)?;
            }
            Ok(Some(yarn))
        }
        other => Err(field_err(
            &format!("{field}.rope_type"),
            format!("unsupported rope type `{other}`"),
        )),
    }
}

impl Config {
    /// Reads and validates `<dir>/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Config, ConfigError> {
        if !dir.exists() {
            return Err(ConfigError::NoDirectory(dir.display().to_string()));
        }
        if !dir.is_dir() {
            return Err(ConfigError::NotADirectory(dir.display().to_string()));
        }
        let path = dir.join("config.json");
        let named = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io {
            path: named.clone(),
            source,
        })?;
        Config::from_json_str(&text).map_err(|e| match e {
            ConfigError::Json { source, .. } => ConfigError::Json {
                path: named,
                source,
            },
            ConfigError::Field { field, reason, .. } => ConfigError::Field {
                path: named,
                field,
                reason,
            },
            other => other,
        })
    }

    pub fn from_json_str(text: &str) -> Result<Config, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|source| ConfigError::Json {
            path: FROM_STRING.into(),
            source,
        })?;
        let obj = value
            .as_object()
            .ok_or_else(|| field_err("<root>", "expected a JSON object"))?;
        Config::from_json(obj)
    }

    fn from_json(obj: &Map<String, Value>) -> Result<Config, ConfigError> {
        let f = Fields(obj);
        let num_layers = f.usize(&["num_hidden_layers", "n_layers"], None)?;
        let head_dim = f.usize(&["head_dim"], Some(512))?;
        let num_heads = f.usize(&["num_attention_heads", "n_heads"], None)?;

        if let Some(kv_heads) = f.usize_opt(&["num_key_value_heads"])? {
            if kv_heads != 1 {
                return Err(field_err(
                    "num_key_value_heads",
                    format!("DeepSeek-V4 shares one K=V head; found {kv_heads}"),
                ));
            }
        }
        if let Some(scoring) = f.str_opt(&["scoring_func", "score_func"])? {
            if scoring != "sqrtsoftplus" {
                return Err(field_err(
                    "scoring_func",
                    format!("only `sqrtsoftplus` is supported, found `{scoring}`"),
                ));
            }
        }
        if let Some(shared) = f.usize_opt(&["n_shared_experts"])? {
            if shared != 1 {
                return Err(field_err(
                    "n_shared_experts",
                    format!("expected 1 shared expert, found {shared}"),
                ));
            }
        }

        let rope_params = obj.get("rope_parameters").and_then(Value::as_object);
        let nested = rope_params.filter(|p| p.get("main").is_some_and(Value::is_object));
        let prf = match nested
            .and_then(|p| p["main"].get("partial_rotary_factor"))
            .or(obj.get("partial_rotary_factor"))
        {
            Some(v) if !v.is_null() => Some(
                v.as_f64()
                    .ok_or_else(|| field_err("partial_rotary_factor", "expected a number"))?,
            ),
            _ => None,
        };
        let rope_dim = match (f.usize_opt(&["qk_rope_head_dim", "rope_head_dim"])?, prf) {
            (Some(r), _) => r,
            (None, Some(p)) => (head_dim as f64 * p).round() as usize,
            (None, None) => 64,
        };

        let (rope_main, rope_compress) = match nested {
            Some(p) => {
                let main = p["main"].as_object().unwrap();
                let compress = p
                    .get("compress")
                    .and_then(Value::as_object)
                    .ok_or_else(|| field_err("rope_parameters.compress", "missing"))?;
                let theta = |o: &Map<String, Value>, name: &str| {
                    Fields(o)
                        .f64_opt(&["rope_theta"])?
                        .ok_or_else(|| field_err(&format!("{name}.rope_theta"), "missing"))
                };
                (
                    RopeConfig {
                        theta: theta(main, "rope_parameters.main")?,
                        yarn: parse_yarn("rope_parameters.main", main)?,
                    },
                    RopeConfig {
                        theta: theta(compress, "rope_parameters.compress")?,
                        yarn: parse_yarn("rope_parameters.compress", compress)?,
                    },
                )
            }
            None => {
                let scaling = obj
                    .get("rope_scaling")
                    .filter(|v| !v.is_null())
                    .or(rope_params.map(|_| &obj["rope_parameters"]));
                let yarn = match scaling {
                    Some(v) => parse_yarn(
                        "rope_scaling",
                        v.as_object()
                            .ok_or_else(|| field_err("rope_scaling", "expected an object"))?,
                    )?,
                    None => None,
                };
                (
                    RopeConfig {
                        theta: f.f64(&["rope_theta"], 10000.0)?,
                        yarn: None,
                    },
                    RopeConfig {
                        theta: f.f64(&["compress_rope_theta"], 160000.0)?,
                        yarn,
                    },
                )
            }
        };

        let layers = Self::parse_layers(obj, num_layers)?;
        let num_hash_layers = match obj.get("mlp_layer_types").filter(|v| !v.is_null()) {
            Some(v) => {
                let types = v
                    .as_array()
                    .ok_or_else(|| field_err("mlp_layer_types", "expected a list"))?;
                if types.len() < num_layers {
                    return Err(field_err(
                        "mlp_layer_types",
                        format!(
                            "has {} entries, num_hidden_layers is {num_layers}",
                            types.len()
                        ),
                    ));
                }
                let mut n_hash = 0;
                for (i, t) in types.iter().take(num_layers).enumerate() {
                    match t.as_str() {
                        Some("hash_moe") if i == n_hash => n_hash += 1,
                        Some("moe") => {}
                        Some("hash_moe") => {
                            return Err(field_err(
                                "mlp_layer_types",
                                "hash_moe layers must come first",
                            ));
                        }
                        _ => {
                            return Err(field_err("mlp_layer_types", format!("unknown entry {t}")))
                        }
                    }
                }
                n_hash
            }
            None => f
                .usize(&["num_hash_layers", "n_hash_layers"], Some(3))?
                .min(num_layers),
        };

        let eos_token_ids = match obj.get("eos_token_id") {
            None | Some(Value::Null) => vec![1],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|x| x as u32)
                        .ok_or_else(|| field_err("eos_token_id", "expected integers"))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => vec![v
                .as_u64()
                .ok_or_else(|| field_err("eos_token_id", "expected an integer"))?
                as u32],
        };

        let quant = obj.get("quantization_config").and_then(Value::as_object);
        let moe_quant = quant
            .and_then(|q| q.get("moe_quant_algo"))
            .and_then(Value::as_str)
            .or(f.str_opt(&["moe_quant_algo"])?);
        let expert_format = match (moe_quant, f.str_opt(&["expert_dtype"])?, quant.is_some()) {
            (Some("NVFP4"), _, _) => ExpertFormat::Nvfp4,
            (Some(other), _, _) => {
                return Err(field_err(
                    "moe_quant_algo",
                    format!("unsupported `{other}`"),
                ))
            }
            (None, Some("fp4"), _) => ExpertFormat::Mxfp4,
            (None, Some("fp8"), _) => ExpertFormat::Fp8,
            (None, Some(other), _) => {
                return Err(field_err("expert_dtype", format!("unsupported `{other}`")))
            }
            // Official releases without the field ship MXFP4 experts (vLLM's default as well).
            (None, None, true) => ExpertFormat::Mxfp4,
            (None, None, false) => ExpertFormat::Bf16,
        };

        let cfg = Config {
            vocab_size: f.usize(&["vocab_size"], None)?,
            hidden_size: f.usize(&["hidden_size", "dim"], None)?,
            num_layers,
            num_heads,
            head_dim,
            rope_dim,
            q_lora_rank: f.usize(&["q_lora_rank"], None)?,
            o_groups: f.usize(&["o_groups"], None)?,
            o_lora_rank: f.usize(&["o_lora_rank"], None)?,
            n_routed_experts: f.usize(&["n_routed_experts", "num_local_experts"], None)?,
            experts_per_token: f.usize(&["num_experts_per_tok", "n_activated_experts"], None)?,
            moe_intermediate_size: f.usize(&["moe_intermediate_size", "moe_inter_dim"], None)?,
            routed_scaling_factor: f.f64(&["routed_scaling_factor", "route_scale"], 1.0)? as f32,
            swiglu_limit: f.f64(&["swiglu_limit"], 10.0)? as f32,
            num_hash_layers,
            index_n_heads: f.usize(&["index_n_heads"], Some(64))?,
            index_head_dim: f.usize(&["index_head_dim"], Some(128))?,
            index_topk: f.usize(&["index_topk"], Some(512))?,
            sliding_window: f.usize(&["sliding_window", "window_size"], Some(128))?,
            layers,
            hc_mult: f.usize(&["hc_mult"], Some(4))?,
            hc_sinkhorn_iters: f.usize(&["hc_sinkhorn_iters"], Some(20))?,
            hc_eps: f.f64(&["hc_eps"], 1e-6)? as f32,
            rms_norm_eps: f.f64(&["rms_norm_eps", "norm_eps"], 1e-6)? as f32,
            rope_main,
            rope_compress,
            max_position_embeddings: f.usize(&["max_position_embeddings"], Some(1 << 20))?,
            bos_token_id: f.usize(&["bos_token_id"], Some(0))? as u32,
            eos_token_ids,
            expert_format,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn parse_layers(
        obj: &Map<String, Value>,
        num_layers: usize,
    ) -> Result<Vec<LayerKind>, ConfigError> {
        let f = Fields(obj);
        let rates = obj.get("compress_rates").filter(|v| !v.is_null());
        let rate = |name: &str, default: usize| -> Result<usize, ConfigError> {
            match rates {
                None => Ok(default),
                Some(r) => match r.get(name) {
                    None => Ok(default),
                    Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                        field_err(&format!("compress_rates.{name}"), "expected an integer")
                    }),
                },
            }
        };
        let csa_rate = rate(
            "compressed_sparse_attention",
            f.usize(&["compress_rate_csa"], Some(4))?,
        )?;
        let hca_rate = rate(
            "heavily_compressed_attention",
            f.usize(&["compress_rate_hca"], Some(128))?,
        )?;

        let layers: Vec<LayerKind> = if let Some(types) =
            obj.get("layer_types").filter(|v| !v.is_null())
        {
            let types = types
                .as_array()
                .ok_or_else(|| field_err("layer_types", "expected a list"))?;
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    Some("compressed_sparse_attention") => Ok(LayerKind::Csa { ratio: csa_rate }),
                    Some("heavily_compressed_attention") => Ok(LayerKind::Hca { ratio: hca_rate }),
                    _ => Err(field_err("layer_types", format!("unknown layer type {t}"))),
                })
                .collect::<Result<_, _>>()?
        } else if let Some(ratios) = obj.get("compress_ratios").filter(|v| !v.is_null()) {
            let ratios = ratios
                .as_array()
                .ok_or_else(|| field_err("compress_ratios", "expected a list"))?;
            ratios
                .iter()
                .map(|r| match r.as_u64() {
                    Some(0) => Ok(LayerKind::Sliding),
                    // DeepSeek's reference: the overlapping (CSA) compressor is the ratio-4 one. As in
                    // transformers, an explicit `compress_rates` overrides the rate of each type.
                    Some(4) => Ok(LayerKind::Csa {
                        ratio: if rates.is_some() { csa_rate } else { 4 },
                    }),
                    Some(r) => Ok(LayerKind::Hca {
                        ratio: if rates.is_some() {
                            hca_rate
                        } else {
                            r as usize
                        },
                    }),
                    None => Err(field_err(
                        "compress_ratios",
                        format!("expected integers, found {r}"),
                    )),
                })
                .collect::<Result<_, _>>()?
        } else {
            return Err(field_err(
                "compress_ratios",
                "missing (neither `compress_ratios` nor `layer_types` given)",
            ));
        };
        let field = if obj.get("layer_types").is_some_and(|v| !v.is_null()) {
            "layer_types"
        } else {
            "compress_ratios"
        };
        if layers.len() < num_layers {
            return Err(field_err(
                field,
                format!(
                    "has {} entries, num_hidden_layers is {num_layers}",
                    layers.len()
                ),
            ));
        }
        Ok(layers[..num_layers].to_vec())
    }

    /// Checks the relations between fields that the math relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("head_dim", self.head_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("o_groups", self.o_groups),
            ("o_lora_rank", self.o_lora_rank),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.experts_per_token),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("index_n_heads", self.index_n_heads),
            ("index_head_dim", self.index_head_dim),
            ("index_topk", self.index_topk),
            ("sliding_window", self.sliding_window),
            ("hc_mult", self.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(field_err(name, "must be positive"));
            }
        }
        let positive_real = [
            ("rms_norm_eps", f64::from(self.rms_norm_eps)),
            ("hc_eps", f64::from(self.hc_eps)),
            ("swiglu_limit", f64::from(self.swiglu_limit)),
            ("route_scale", f64::from(self.routed_scaling_factor)),
            ("rope_theta", self.rope_main.theta),
            ("compress_rope_theta", self.rope_compress.theta),
        ];
        for (name, v) in positive_real {
            check_positive_real(name, v)?;
        }
        // Each buffer of these lengths is allocated per layer; past the context they could
        // never fill.
        let within_context = [
            ("window_size", self.sliding_window),
            ("index_topk", self.index_topk),
        ];
        for (name, v) in within_context {
            if v > self.max_position_embeddings {
                return Err(field_err(
                    name,
                    format!(
                        "{v} exceeds max_position_embeddings {}",
                        self.max_position_embeddings
                    ),
                ));
            }
        }
        // A Sinkhorn this long only stalls every step.
        if self.hc_sinkhorn_iters > MAX_SINKHORN_ITERS {
            return Err(field_err(
                "hc_sinkhorn_iters",
                format!(
                    "{} is more than {MAX_SINKHORN_ITERS}",
                    self.hc_sinkhorn_iters
                ),
            ));
        }
        if self.rope_dim == 0 || !self.rope_dim.is_multiple_of(2) || self.rope_dim > self.head_dim {
            return Err(field_err(
                "qk_rope_head_dim",
                format!(
                    "must be even and in 2..={} (head_dim), found {}",
                    self.head_dim, self.rope_dim
                ),
            ));
        }
        if self.rope_dim > self.index_head_dim {
            return Err(field_err(
                "index_head_dim",
                format!("must be at least the rope dim {}", self.rope_dim),
            ));
        }
        if !self.num_heads.is_multiple_of(self.o_groups) {
            return Err(field_err(
                "o_groups",
                format!(
                    "must divide num_attention_heads ({}), found {}",
                    self.num_heads, self.o_groups
                ),
            ));
        }
        if self.experts_per_token > self.n_routed_experts {
            return Err(field_err(
                "num_experts_per_tok",
                format!(
                    "{} exceeds n_routed_experts {}",
                    self.experts_per_token, self.n_routed_experts
                ),
            ));
        }
        for (l, kind) in self.layers.iter().enumerate() {
            if let LayerKind::Csa { ratio } | LayerKind::Hca { ratio } = kind {
                if *ratio < 2 {
                    return Err(field_err(
                        "compress_ratios",
                        format!("layer {l}: ratio {ratio} must be at least 2"),
                    ));
                }
            }
        }
        if self.bos_token_id as usize >= self.vocab_size {
            return Err(field_err(
                "bos_token_id",
                format!(
                    "{} is not below vocab_size {}",
                    self.bos_token_id, self.vocab_size
                ),
            ));
        }
        if let Some(t) = self
            .eos_token_ids
            .iter()
            .find(|&&t| t as usize >= self.vocab_size)
        {
            return Err(field_err(
                "eos_token_id",
                format!("{t} is not below vocab_size {}", self.vocab_size),
            ));
        }
        Ok(())
    }

    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        self.layers[layer]
    }

    pub fn is_hash_layer(&self, layer: usize) -> bool {
        layer < self.num_hash_layers
    }

    /// Width of the mHC state: `hc_mult` copies of the hidden vector.
    pub fn hc_dim(&self) -> usize {
        self.hc_mult * self.hidden_size
    }

    /// Number of mHC mixing logits per site: pre (n) + post (n) + comb (n²).
    pub fn hc_mix(&self) -> usize {
        (2 + self.hc_mult) * self.hc_mult
    }

    /// Keeps the first `n` layers (for small synthetic checkpoints of a real width).
    pub fn truncated(&self, n: usize) -> Config {
        let mut c = self.clone();
        c.num_layers = n;
        c.layers.truncate(n);
        c.num_hash_layers = c.num_hash_layers.min(n);
        c
    }

    /// DeepSeek-V4-Flash (official config values, spec §1.1).
    pub fn flash() -> Config {
        let mut ratios = vec![0, 0];
        for _ in 0..20 {
            ratios.extend([4, 128]);
        }
        ratios.push(4);
        Config {
            vocab_size: 129280,
            hidden_size: 4096,
            num_layers: 43,
            num_heads: 64,
            head_dim: 512,
            rope_dim: 64,
            q_lora_rank: 1024,
            o_groups: 8,
            o_lora_rank: 1024,
            n_routed_experts: 256,
            experts_per_token: 6,
            moe_intermediate_size: 2048,
            routed_scaling_factor: 1.5,
            swiglu_limit: 10.0,
            num_hash_layers: 3,
            index_n_heads: 64,
            index_head_dim: 128,
            index_topk: 512,
            sliding_window: 128,
            layers: ratios_to_kinds(&ratios),
            hc_mult: 4,
            hc_sinkhorn_iters: 20,
            hc_eps: 1e-6,
            rms_norm_eps: 1e-6,
            rope_main: RopeConfig {
                theta: 10000.0,
                yarn: None,
            },
            rope_compress: RopeConfig {
                theta: 160000.0,
                yarn: Some(Yarn {
                    factor: 16.0,
                    original_max_position: 65536.0,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                }),
            },
            max_position_embeddings: 1 << 20,
            bos_token_id: 0,
            eos_token_ids: vec![1],
            expert_format: ExpertFormat::Mxfp4,
        }
    }

    /// DeepSeek-V4-Pro.
    pub fn pro() -> Config {
        let mut ratios = vec![128, 128];
        for _ in 0..29 {
            ratios.extend([4, 128]);
        }
        ratios.push(4);
        Config {
            hidden_size: 7168,
            num_layers: 61,
            num_heads: 128,
            q_lora_rank: 1536,
            o_groups: 16,
            n_routed_experts: 384,
            moe_intermediate_size: 3072,
            routed_scaling_factor: 2.5,
            index_topk: 1024,
            layers: ratios_to_kinds(&ratios),
            ..Config::flash()
        }
    }

    /// A small model with the real vocabulary and every layer type, for demos and tests.
    pub fn tiny() -> Config {
        Config {
            hidden_size: 256,
            num_layers: 4,
            num_heads: 4,
            head_dim: 128,
            rope_dim: 64,
            q_lora_rank: 128,
            o_groups: 2,
            o_lora_rank: 128,
            n_routed_experts: 16,
            experts_per_token: 6,
            moe_intermediate_size: 256,
            num_hash_layers: 1,
            index_n_heads: 8,
            index_head_dim: 128,
            index_topk: 8,
            sliding_window: 32,
            layers: ratios_to_kinds(&[0, 4, 16, 4]),
            ..Config::flash()
        }
    }

    fn common_json(&self) -> Map<String, Value> {
        let v = json!({
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": 1,
            "num_experts_per_tok": self.experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size,
            "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": true,
            "swiglu_limit": self.swiglu_limit,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0],
            "tie_word_embeddings": false,
            "hidden_act": "silu",
        });
        match v {
            Value::Object(m) => m,
            _ => unreachable!("json! object literal"),
        }
    }

    fn yarn_json(yarn: &Yarn) -> Value {
        json!({
            "type": "yarn",
            "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
        })
    }

    /// `config.json` with the official DeepSeek release keys (what the FP8 / NVFP4 repos ship).
    pub fn to_official_json(&self) -> Value {
        let mut m = self.common_json();
        let mut ratios: Vec<usize> = self.layers.iter().map(|k| k.ratio()).collect();
        ratios.push(0); // the MTP block's entry
        m.insert("compress_ratios".into(), json!(ratios));
        m.insert("num_hash_layers".into(), json!(self.num_hash_layers));
        m.insert("qk_rope_head_dim".into(), json!(self.rope_dim));
        m.insert("window_size".into(), json!(self.sliding_window));
        m.insert("route_scale".into(), json!(self.routed_scaling_factor));
        m.insert("rope_theta".into(), json!(self.rope_main.theta));
        m.insert(
            "compress_rope_theta".into(),
            json!(self.rope_compress.theta),
        );
        m.insert("num_nextn_predict_layers".into(), json!(1));
        if let Some(y) = &self.rope_compress.yarn {
            m.insert("rope_scaling".into(), Self::yarn_json(y));
        }
        let expert_dtype = match self.expert_format {
            ExpertFormat::Fp8 => "fp8",
            _ => "fp4",
        };
        m.insert("expert_dtype".into(), json!(expert_dtype));
        let mut quant = json!({
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        });
        if self.expert_format == ExpertFormat::Nvfp4 {
            quant["moe_quant_algo"] = json!("NVFP4");
        }
        m.insert("quantization_config".into(), quant);
        Value::Object(m)
    }

    /// `config.json` with transformers' keys (`layer_types`, `rope_parameters`, ...).
    pub fn to_transformers_json(&self) -> Value {
        let mut m = self.common_json();
        let types: Vec<&str> = self.layers.iter().map(|k| k.transformers_name()).collect();
        let mlp: Vec<&str> = (0..self.num_layers)
            .map(|l| {
                if self.is_hash_layer(l) {
                    "hash_moe"
                } else {
                    "moe"
                }
            })
            .collect();
        let rate_of = |want: fn(&LayerKind) -> bool, default: usize| {
            self.layers
                .iter()
                .find(|k| want(k))
                .map(|k| k.ratio())
                .unwrap_or(default)
        };
        m.insert("layer_types".into(), json!(types));
        m.insert("mlp_layer_types".into(), json!(mlp));
        m.insert(
            "compress_rates".into(),
            json!({
                "compressed_sparse_attention": rate_of(|k| matches!(k, LayerKind::Csa { .. }), 4),
                "heavily_compressed_attention": rate_of(|k| matches!(k, LayerKind::Hca { .. }), 128),
            }),
        );
        let prf = self.rope_dim as f64 / self.head_dim as f64;
        m.insert("partial_rotary_factor".into(), json!(prf));
        m.insert("sliding_window".into(), json!(self.sliding_window));
        m.insert(
            "routed_scaling_factor".into(),
            json!(self.routed_scaling_factor),
        );
        let rope = |r: &RopeConfig| {
            let mut v = match &r.yarn {
                Some(y) => {
                    let mut v = Self::yarn_json(y);
                    v.as_object_mut().unwrap().remove("type");
                    v["rope_type"] = json!("yarn");
                    v["attention_factor"] = json!(1.0);
                    v
                }
                None => json!({"rope_type": "default"}),
            };
            v["rope_theta"] = json!(r.theta);
            v["partial_rotary_factor"] = json!(prf);
            v
        };
        m.insert(
            "rope_parameters".into(),
            json!({"main": rope(&self.rope_main), "compress": rope(&self.rope_compress)}),
        );
        Value::Object(m)
    }

    /// Trainable parameters of the main model (MTP excluded), counting every routed expert.
    /// The routing tables `tid2eid` and the selection-only router biases are buffers, not
    /// parameters, and are left out (as in the published totals).
    pub fn parameter_count(&self) -> ParameterCount {
        let d = self.hidden_size;
        let hd = self.num_heads * self.head_dim;
        let i = self.moe_intermediate_size;
        let expert = 3 * d * i;
        let mut attention = 0;
        let mut other =
            2 * self.vocab_size * d + d + self.hc_mult * self.hc_dim() + self.hc_mult + 1;
        for l in 0..self.num_layers {
            attention += d * self.q_lora_rank
                + self.q_lora_rank
                + self.q_lora_rank * hd
                + self.head_dim * d
                + self.head_dim
                + hd / self.o_groups * self.o_groups * self.o_lora_rank
                + self.o_groups * self.o_lora_rank * d
                + self.num_heads;
            let c = self.head_dim;
            attention += match self.layer_kind(l) {
                LayerKind::Sliding => 0,
                LayerKind::Hca { ratio } => 2 * c * d + ratio * c + c,
                LayerKind::Csa { ratio } => {
                    let ic = self.index_head_dim;
                    2 * 2 * c * d
                        + ratio * 2 * c
                        + c
                        + self.index_n_heads * ic * self.q_lora_rank
                        + self.index_n_heads * d
                        + 2 * 2 * ic * d
                        + ratio * 2 * ic
                        + ic
                }
            };
            other += 2 * d
                + 2 * (self.hc_mix() * self.hc_dim() + self.hc_mix() + 3)
                + self.n_routed_experts * d;
        }
        ParameterCount {
            attention,
            routed_experts: self.num_layers * self.n_routed_experts * expert,
            active_routed_experts: self.num_layers * self.experts_per_token * expert,
            shared_experts: self.num_layers * expert,
            other,
        }
    }
}

/// Parameter totals by role; `other` holds embeddings, head, norms, mHC and routers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParameterCount {
    pub attention: usize,
    pub routed_experts: usize,
    pub active_routed_experts: usize,
    pub shared_experts: usize,
    pub other: usize,
}

impl ParameterCount {
    pub fn total(&self) -> usize {
        self.attention + self.routed_experts + self.shared_experts + self.other
    }
}

fn ratios_to_kinds(ratios: &[usize]) -> Vec<LayerKind> {
    ratios
        .iter()
        .map(|&r| match r {
            0 => LayerKind::Sliding,
            4 => LayerKind::Csa { ratio: 4 },
            r => LayerKind::Hca { ratio: r },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_schedule_matches_spec() {
        let c = Config::flash();
        assert_eq!(c.layers.len(), 43);
        assert_eq!(c.layer_kind(0), LayerKind::Sliding);
        assert_eq!(c.layer_kind(1), LayerKind::Sliding);
        assert_eq!(c.layer_kind(2), LayerKind::Csa { ratio: 4 });
        assert_eq!(c.layer_kind(3), LayerKind::Hca { ratio: 128 });
        assert_eq!(c.layer_kind(42), LayerKind::Csa { ratio: 4 });
        let csa = c
            .layers
            .iter()
            .filter(|k| matches!(k, LayerKind::Csa { .. }))
            .count();
        assert_eq!(csa, 21);
    }

    #[test]
    fn pro_schedule_matches_spec() {
        let c = Config::pro();
        assert_eq!(c.layers.len(), 61);
        assert_eq!(c.layer_kind(0), LayerKind::Hca { ratio: 128 });
        assert_eq!(c.layer_kind(2), LayerKind::Csa { ratio: 4 });
        assert_eq!(
            c.layers
                .iter()
                .filter(|k| matches!(k, LayerKind::Hca { .. }))
                .count(),
            31
        );
    }

    #[test]
    fn parameter_counts_match_published_totals() {
        // Spec §1.3: Flash 284.33B without MTP, Pro 1573.0B.
        let flash = Config::flash().parameter_count().total() as f64 / 1e9;
        assert!((flash - 284.33).abs() < 0.05, "flash {flash}");
        let pro = Config::pro().parameter_count().total() as f64 / 1e9;
        assert!((pro - 1573.0).abs() < 0.5, "pro {pro}");
    }

    #[test]
    fn official_and_transformers_json_round_trip() {
        for c in [Config::flash(), Config::pro(), Config::tiny()] {
            let official = Config::from_json_str(&c.to_official_json().to_string()).unwrap();
            assert_eq!(official, c);
            let mut hf = Config::from_json_str(&c.to_transformers_json().to_string()).unwrap();
            // transformers' schema has no expert-format field.
            hf.expert_format = c.expert_format;
            assert_eq!(hf, c);
        }
    }

    #[test]
    fn official_flash_keys_parse() {
        let text = r#"{
            "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
            "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
            "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
            "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
            "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus", "route_scale": 1.5,
            "swiglu_limit": 10.0, "num_hash_layers": 3, "index_n_heads": 64, "index_head_dim": 128,
            "index_topk": 512, "window_size": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
            "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1},
            "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
                                4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
                                4, 128, 4, 0],
            "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1,
            "expert_dtype": "fp4",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                                    "moe_quant_algo": "NVFP4"}
        }"#;
        let c = Config::from_json_str(text).unwrap();
        assert_eq!(
            c,
            Config {
                expert_format: ExpertFormat::Nvfp4,
                ..Config::flash()
            }
        );
    }

    #[test]
    fn errors_name_the_field() {
        let base = Config::tiny().to_official_json();
        let cases: Vec<(&str, Value, &str)> = vec![
            ("hidden_size", Value::Null, "hidden_size"),
            ("o_groups", json!(3), "o_groups"),
            ("compress_ratios", json!([0, 4]), "compress_ratios"),
            ("num_key_value_heads", json!(8), "num_key_value_heads"),
            ("scoring_func", json!("softmax"), "scoring_func"),
            ("qk_rope_head_dim", json!(7), "qk_rope_head_dim"),
            ("num_experts_per_tok", json!(99), "num_experts_per_tok"),
            ("vocab_size", json!("big"), "vocab_size"),
            (
                "rope_scaling",
                json!({"type": "longrope"}),
                "rope_scaling.rope_type",
            ),
            (
                "rope_scaling",
                json!({"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                       "beta_fast": -32, "beta_slow": 1}),
                "rope_scaling.beta_fast",
            ),
            ("swiglu_limit", json!(-1.0), "swiglu_limit"),
            ("rms_norm_eps", json!(-1.0), "rms_norm_eps"),
            ("hc_eps", json!(0.0), "hc_eps"),
            ("route_scale", json!(-1.5), "route_scale"),
            ("rope_theta", json!(0.0), "rope_theta"),
            ("compress_rope_theta", json!(-5.0), "compress_rope_theta"),
            ("window_size", json!(1_000_000_000_000u64), "window_size"),
            ("index_topk", json!(1_000_000_000_000u64), "index_topk"),
            (
                "hc_sinkhorn_iters",
                json!(1_000_000_000u64),
                "hc_sinkhorn_iters",
            ),
            ("bos_token_id", json!(1_000_000_000u64), "bos_token_id"),
            ("eos_token_id", json!(1_000_000_000u64), "eos_token_id"),
        ];
        for (key, value, field) in cases {
            let mut v = base.clone();
            if value.is_null() {
                v.as_object_mut().unwrap().remove(key);
            } else {
                v[key] = value;
            }
            let err = Config::from_json_str(&v.to_string()).unwrap_err();
            assert!(
                err.to_string().contains(&format!("`{field}`")),
                "{key}: {err}"
            );
        }
        assert!(matches!(
            Config::from_json_str("{"),
            Err(ConfigError::Json { .. })
        ));
    }

    #[test]
    fn errors_from_a_directory_name_the_file_or_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let mut bad_field = Config::tiny().to_official_json();
        bad_field["o_groups"] = json!(3);
        let cases = [
            ("{\"hidden_size\": ", "is not valid JSON"),
            ("{\"hidden_size\": NaN}", "is not valid JSON"),
            (&*bad_field.to_string(), "field `o_groups`"),
        ];
        for (text, what) in cases {
            std::fs::write(&path, text).unwrap();
            let err = Config::from_dir(dir.path()).unwrap_err().to_string();
            assert!(
                err.contains(&path.display().to_string()) && err.contains(what),
                "{err}"
            );
        }
        let missing = dir.path().join("nothing-here");
        let err = Config::from_dir(&missing).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("model directory {} does not exist", missing.display())
        );
        let err = Config::from_dir(&path).unwrap_err().to_string();
        assert!(err.contains("is not a directory"), "{err}");
    }

    #[test]
    fn missing_config_file_names_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = Config::from_dir(dir.path()).unwrap_err().to_string();
        let path = dir.path().join("config.json");
        assert!(
            err.contains(&format!("cannot read config {}", path.display())),
            "{err}"
        );
    }
}
