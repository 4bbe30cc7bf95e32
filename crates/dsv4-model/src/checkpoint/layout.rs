//! Which tensors a configuration needs (DeepSeek-native names, spec §12), and the mapping from
//! transformers' names onto them.

use crate::config::{Config, LayerKind};

/// Suffixes a quantized or plain linear `<base>` may carry (`<base>.<suffix>`).
pub const LINEAR_SUFFIXES: [&str; 5] = [
    "weight",
    "scale",
    "weight_scale",
    "weight_scale_2",
    "input_scale",
];

/// How the official release stores a linear (the synthetic writer follows it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearRole {
    /// Embedding and output head (BF16).
    Embedding,
    /// FP8 128x128 block-quantized in the official releases.
    Fp8,
    /// Kept BF16 in the official releases (compressor projections, indexer weights_proj, router).
    Dense,
    /// A routed expert matrix (MXFP4 official, NVFP4 in the ModelOpt exports).
    RoutedExpert {
        layer: usize,
        expert: usize,
        which: ExpertMatrix,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertMatrix {
    W1,
    W2,
    W3,
}

/// Role of a non-linear parameter; decides its stored dtype (norms BF16, the rest F32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VectorRole {
    Norm,
    Hc,
    Sink,
    Ape,
    GateBias,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// A matrix `[rows, cols]`; the entry's name is the base, without `.weight`.
    Linear {
        rows: usize,
        cols: usize,
        role: LinearRole,
    },
    /// A float parameter of this exact shape.
    Vector { shape: Vec<usize>, role: VectorRole },
    /// An integer table `[rows, cols]` (`tid2eid`).
    Index { rows: usize, cols: usize },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub kind: TensorKind,
}

impl TensorSpec {
    fn linear(name: String, rows: usize, cols: usize, role: LinearRole) -> TensorSpec {
        TensorSpec {
            name,
            kind: TensorKind::Linear { rows, cols, role },
        }
    }

    fn vector(name: String, shape: &[usize], role: VectorRole) -> TensorSpec {
        TensorSpec {
            name,
            kind: TensorKind::Vector {
                shape: shape.to_vec(),
                role,
            },
        }
    }
}

/// Every tensor the main model (MTP excluded) needs under `cfg`, in checkpoint order:
/// top-level tensors, then layer by layer.
pub fn layout(cfg: &Config) -> Vec<TensorSpec> {
    let d = cfg.hidden_size;
    let mut v = vec![
        TensorSpec::linear("embed".into(), cfg.vocab_size, d, LinearRole::Embedding),
        TensorSpec::linear("head".into(), cfg.vocab_size, d, LinearRole::Embedding),
        TensorSpec::vector("norm.weight".into(), &[d], VectorRole::Norm),
        TensorSpec::vector(
            "hc_head_fn".into(),
            &[cfg.hc_mult, cfg.hc_dim()],
            VectorRole::Hc,
        ),
        TensorSpec::vector("hc_head_base".into(), &[cfg.hc_mult], VectorRole::Hc),
        TensorSpec::vector("hc_head_scale".into(), &[1], VectorRole::Hc),
    ];
    for l in 0..cfg.num_layers {
        v.extend(layer_layout(cfg, l));
    }
    v
}

/// The tensors of layer `l`.
pub fn layer_layout(cfg: &Config, l: usize) -> Vec<TensorSpec> {
    use LinearRole::{Dense, Fp8};
    let p = format!("layers.{l}");
    let d = cfg.hidden_size;
    let hd = cfg.num_heads * cfg.head_dim;
    let (mix, hc) = (cfg.hc_mix(), cfg.hc_dim());
    let lin = |s: &str, rows, cols, role| TensorSpec::linear(format!("{p}.{s}"), rows, cols, role);
    let vec_ = |s: &str, shape: &[usize], role| TensorSpec::vector(format!("{p}.{s}"), shape, role);
    let mut v = vec![
        vec_("attn_norm.weight", &[d], VectorRole::Norm),
        vec_("ffn_norm.weight", &[d], VectorRole::Norm),
        vec_("hc_attn_fn", &[mix, hc], VectorRole::Hc),
        vec_("hc_attn_base", &[mix], VectorRole::Hc),
        vec_("hc_attn_scale", &[3], VectorRole::Hc),
        vec_("hc_ffn_fn", &[mix, hc], VectorRole::Hc),
        vec_("hc_ffn_base", &[mix], VectorRole::Hc),
        vec_("hc_ffn_scale", &[3], VectorRole::Hc),
        vec_("attn.attn_sink", &[cfg.num_heads], VectorRole::Sink),
        lin("attn.wq_a", cfg.q_lora_rank, d, Fp8),
        vec_("attn.q_norm.weight", &[cfg.q_lora_rank], VectorRole::Norm),
        lin("attn.wq_b", hd, cfg.q_lora_rank, Fp8),
        lin("attn.wkv", cfg.head_dim, d, Fp8),
        vec_("attn.kv_norm.weight", &[cfg.head_dim], VectorRole::Norm),
        lin(
            "attn.wo_a",
            cfg.o_groups * cfg.o_lora_rank,
            hd / cfg.o_groups,
            Fp8,
        ),
        lin("attn.wo_b", d, cfg.o_groups * cfg.o_lora_rank, Fp8),
    ];
    let kind = cfg.layer_kind(l);
    let mut compressor = |prefix: &str, width: usize, ratio: usize, overlap: bool| {
        let out = if overlap { 2 * width } else { width };
        v.push(lin(&format!("{prefix}.wkv"), out, d, Dense));
        v.push(lin(&format!("{prefix}.wgate"), out, d, Dense));
        v.push(vec_(
            &format!("{prefix}.ape"),
            &[ratio, out],
            VectorRole::Ape,
        ));
        v.push(vec_(
            &format!("{prefix}.norm.weight"),
            &[width],
            VectorRole::Norm,
        ));
    };
    match kind {
        LayerKind::Sliding => {}
        LayerKind::Hca { ratio } => compressor("attn.compressor", cfg.head_dim, ratio, false),
        LayerKind::Csa { ratio } => {
            compressor("attn.compressor", cfg.head_dim, ratio, true);
            compressor("attn.indexer.compressor", cfg.index_head_dim, ratio, true);
            v.push(lin(
                "attn.indexer.wq_b",
                cfg.index_n_heads * cfg.index_head_dim,
                cfg.q_lora_rank,
                Fp8,
            ));
            v.push(lin(
                "attn.indexer.weights_proj",
                cfg.index_n_heads,
                d,
                Dense,
            ));
        }
    }
    let e = cfg.n_routed_experts;
    let inter = cfg.moe_intermediate_size;
    v.push(lin("ffn.gate", e, d, Dense));
    if cfg.is_hash_layer(l) {
        v.push(TensorSpec {
            name: format!("{p}.ffn.gate.tid2eid"),
            kind: TensorKind::Index {
                rows: cfg.vocab_size,
                cols: cfg.experts_per_token,
            },
        });
    } else {
        v.push(vec_("ffn.gate.bias", &[e], VectorRole::GateBias));
    }
    for x in 0..e {
        for (which, rows, cols) in [
            (ExpertMatrix::W1, inter, d),
            (ExpertMatrix::W2, d, inter),
            (ExpertMatrix::W3, inter, d),
        ] {
            let w = match which {
                ExpertMatrix::W1 => "w1",
                ExpertMatrix::W2 => "w2",
                ExpertMatrix::W3 => "w3",
            };
            v.push(lin(
                &format!("ffn.experts.{x}.{w}"),
                rows,
                cols,
                LinearRole::RoutedExpert {
                    layer: l,
                    expert: x,
                    which,
                },
            ));
        }
    }
    v.push(lin("ffn.shared_experts.w1", inter, d, Fp8));
    v.push(lin("ffn.shared_experts.w2", d, inter, Fp8));
    v.push(lin("ffn.shared_experts.w3", inter, d, Fp8));
    v
}

/// A transformers key, translated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Translated {
    /// The DeepSeek-native name.
    Native(String),
    /// `model.layers.N.mlp.experts.gate_up_proj` `[E, 2I, D]` (rows `0..I` = w1, `I..2I` = w3).
    StackedGateUp { layer: usize },
    /// `model.layers.N.mlp.experts.down_proj` `[E, D, I]`.
    StackedDown { layer: usize },
}

/// Per-layer transformers names that map one-to-one.
const EXACT: [(&str, &str); 17] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    (
        "self_attn.compressor.kv_norm.weight",
        "attn.compressor.norm.weight",
    ),
    (
        "self_attn.compressor.indexer.position_bias",
        "attn.indexer.compressor.ape",
    ),
    (
        "self_attn.compressor.indexer.kv_norm.weight",
        "attn.indexer.compressor.norm.weight",
    ),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
];

/// Per-layer transformers linear modules (followed by a linear suffix).
const LINEARS: [(&str, &str); 15] = [
    ("self_attn.q_a_proj", "attn.wq_a"),
    ("self_attn.q_b_proj", "attn.wq_b"),
    ("self_attn.kv_proj", "attn.wkv"),
    ("self_attn.o_a_proj", "attn.wo_a"),
    ("self_attn.o_b_proj", "attn.wo_b"),
    ("self_attn.compressor.kv_proj", "attn.compressor.wkv"),
    ("self_attn.compressor.gate_proj", "attn.compressor.wgate"),
    ("self_attn.compressor.indexer.q_b_proj", "attn.indexer.wq_b"),
    (
        "self_attn.compressor.indexer.scorer.weights_proj",
        "attn.indexer.weights_proj",
    ),
    // Older transformers revisions.
    (
        "self_attn.compressor.indexer.weights_proj",
        "attn.indexer.weights_proj",
    ),
    (
        "self_attn.compressor.indexer.kv_proj",
        "attn.indexer.compressor.wkv",
    ),
    (
        "self_attn.compressor.indexer.gate_proj",
        "attn.indexer.compressor.wgate",
    ),
    ("mlp.gate", "ffn.gate"),
    ("mlp.shared_experts.gate_proj", "ffn.shared_experts.w1"),
    ("mlp.shared_experts.up_proj", "ffn.shared_experts.w3"),
];

/// Top-level linear modules (transformers, native).
const TOP_LINEARS: [(&str, &str); 2] = [("model.embed_tokens", "embed"), ("lm_head", "head")];

const SHARED_DOWN: (&str, &str) = ("mlp.shared_experts.down_proj", "ffn.shared_experts.w2");

fn linear_suffix(s: &str) -> Option<&'static str> {
    match s {
        // transformers' FP8 loader names the block scale `weight_scale_inv`.
        "weight_scale_inv" | "scale" => Some("scale"),
        _ => LINEAR_SUFFIXES.iter().find(|&&x| x == s).copied(),
    }
}

/// Which key naming a checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// DeepSeek's own names (official and NVFP4 releases).
    DeepSeek,
    /// transformers' in-memory names (`model.layers.N.self_attn...`, stacked experts).
    Transformers,
    /// What transformers' `save_pretrained` writes: its conversion mapping reversed, i.e. the
    /// native names under `model.` except `embed_tokens`, `hc_head.hc_*`, `attn.norm` (the KV
    /// norm) and an unprefixed `head`.
    TransformersSaved,
}

impl Naming {
    const ALL: [Naming; 3] = [
        Naming::DeepSeek,
        Naming::Transformers,
        Naming::TransformersSaved,
    ];

    pub fn describe(self) -> &'static str {
        match self {
            Naming::DeepSeek => "DeepSeek-native",
            Naming::Transformers => "transformers in-memory",
            Naming::TransformersSaved => "transformers save_pretrained",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// The namings a key can belong to, as a set of [`Naming::bit`]s. Keys every transformers
/// naming shares (`model.embed_tokens`, `model.norm`, `model.hc_head`) and `head.*` (native and
/// saved alike) fit more than one.
pub fn namings_of(key: &str) -> u8 {
    let (ds, tf, saved) = (
        Naming::DeepSeek.bit(),
        Naming::Transformers.bit(),
        Naming::TransformersSaved.bit(),
    );
    if key.starts_with("lm_head.") {
        return tf;
    }
    if key.starts_with("head.") {
        return ds | saved;
    }
    let Some(rest) = key.strip_prefix("model.") else {
        return ds;
    };
    let Some(module) = rest
        .strip_prefix("layers.")
        .and_then(|r| r.split_once('.'))
        .map(|(_, tail)| tail.split('.').next().unwrap_or(tail))
    else {
        return tf | saved;
    };
    match module {
        "self_attn"
        | "mlp"
        | "input_layernorm"
        | "post_attention_layernorm"
        | "attn_hc"
        | "ffn_hc" => tf,
        "attn" | "ffn" | "attn_norm" | "ffn_norm" => saved,
        m if m.starts_with("hc_") => saved,
        _ => tf | saved,
    }
}

/// The namings in a set from [`namings_of`], for messages ("DeepSeek-native or ...").
pub fn describe_namings(set: u8) -> String {
    let names: Vec<&str> = Naming::ALL
        .into_iter()
        .filter(|n| set & n.bit() != 0)
        .map(Naming::describe)
        .collect();
    names.join(" or ")
}

/// The one naming that fits every key, or two keys that cannot share one, each with the set
/// of namings it fits: `(earlier key, its set, later key, its set)`.
pub fn naming_of_keys<'a>(
    keys: impl IntoIterator<Item = &'a str>,
) -> Result<Naming, (&'a str, u8, &'a str, u8)> {
    let mut fits = Naming::ALL.iter().fold(0, |acc, n| acc | n.bit());
    // The first key of each distinct set seen, to name the one a later key conflicts with.
    let mut seen: Vec<(u8, &str)> = Vec::new();
    for key in keys {
        let own = namings_of(key);
        if own & fits == 0 {
            let (set, earlier) = seen
                .iter()
                .find(|(set, _)| set & own == 0)
                .or(seen.last())
                .copied()
                .expect("the full set meets every key's set");
            return Err((earlier, set, key, own));
        }
        fits &= own;
        if !seen.iter().any(|(set, _)| *set == own) {
            seen.push((own, key));
        }
    }
    Ok(Naming::ALL
        .into_iter()
        .find(|n| fits & n.bit() != 0)
        .expect("a non-empty set"))
}

/// Translates a key written by transformers' `save_pretrained` to its native name.
pub fn translate_saved(key: &str) -> Option<String> {
    if key.starts_with("head.") {
        return Some(key.to_string());
    }
    let rest = key.strip_prefix("model.")?;
    if let Some(s) = rest.strip_prefix("embed_tokens.") {
        return Some(format!("embed.{}", linear_suffix(s)?));
    }
    if let Some(leaf) = rest.strip_prefix("hc_head.hc_") {
        return Some(format!("hc_head_{leaf}"));
    }
    let Some(layer_rest) = rest.strip_prefix("layers.") else {
        return Some(rest.to_string());
    };
    let (n, tail) = layer_rest.split_once('.')?;
    let tail = match tail.strip_prefix("attn.norm.") {
        Some(s) => format!("attn.kv_norm.{s}"),
        None => tail.to_string(),
    };
    // A quantized save names the FP8 block scale as transformers' FP8 loader does.
    let tail = match tail.strip_suffix(".weight_scale_inv") {
        Some(base) => format!("{base}.scale"),
        None => tail,
    };
    Some(format!("layers.{n}.{tail}"))
}

/// The save_pretrained name of a native key (inverse of [`translate_saved`]).
pub fn to_transformers_saved(native: &str) -> String {
    if native.starts_with("head.") {
        return native.to_string();
    }
    if let Some(s) = native.strip_prefix("embed.") {
        return format!("model.embed_tokens.{s}");
    }
    if let Some(leaf) = native.strip_prefix("hc_head_") {
        return format!("model.hc_head.hc_{leaf}");
    }
    let renamed = match native.split_once(".attn.kv_norm.") {
        Some((layer, s)) => format!("{layer}.attn.norm.{s}"),
        None => native.to_string(),
    };
    format!("model.{renamed}")
}

/// Whether a key belongs to the MTP block, which inference skips.
pub fn is_mtp_key(key: &str) -> bool {
    key.starts_with("mtp.") || key.starts_with("model.mtp.")
}

/// Translates a transformers key; `None` when it is not a known DeepSeek-V4 key.
pub fn translate(key: &str) -> Option<Translated> {
    let native = |s: &str| Some(Translated::Native(s.to_string()));
    for (from, to) in TOP_LINEARS {
        if let Some(s) = key.strip_prefix(from).and_then(|s| s.strip_prefix('.')) {
            return Some(Translated::Native(format!("{to}.{}", linear_suffix(s)?)));
        }
    }
    match key {
        "model.norm.weight" => return native("norm.weight"),
        "model.hc_head.hc_fn" => return native("hc_head_fn"),
        "model.hc_head.hc_base" => return native("hc_head_base"),
        "model.hc_head.hc_scale" => return native("hc_head_scale"),
        _ => {}
    }
    let rest = key.strip_prefix("model.layers.")?;
    let (n, tail) = rest.split_once('.')?;
    let layer: usize = n.parse().ok()?;
    let p = format!("layers.{layer}");
    if let Some(&(_, to)) = EXACT.iter().find(|(from, _)| *from == tail) {
        return Some(Translated::Native(format!("{p}.{to}")));
    }
    match tail {
        "mlp.experts.gate_up_proj" => return Some(Translated::StackedGateUp { layer }),
        "mlp.experts.down_proj" => return Some(Translated::StackedDown { layer }),
        _ => {}
    }
    for (from, to) in LINEARS.iter().chain([&SHARED_DOWN]) {
        if let Some(s) = tail.strip_prefix(from).and_then(|s| s.strip_prefix('.')) {
            if let Some(suffix) = linear_suffix(s) {
                return Some(Translated::Native(format!("{p}.{to}.{suffix}")));
            }
        }
    }
    // Per-expert modules (exports that do not stack experts).
    let experts = tail.strip_prefix("mlp.experts.")?;
    let (e, rest) = experts.split_once('.')?;
    let expert: usize = e.parse().ok()?;
    let (module, s) = rest.split_once('.')?;
    let w = match module {
        "gate_proj" => "w1",
        "down_proj" => "w2",
        "up_proj" => "w3",
        _ => return None,
    };
    Some(Translated::Native(format!(
        "{p}.ffn.experts.{expert}.{w}.{}",
        linear_suffix(s)?
    )))
}

/// The transformers name of a DeepSeek-native key (inverse of [`translate`]; routed experts
/// get the per-expert `mlp.experts.E.{gate,up,down}_proj` form). `None` for unknown keys.
pub fn to_transformers(native: &str) -> Option<String> {
    let hf_suffix = |s: &str| {
        if s == "scale" {
            "weight_scale_inv".to_string()
        } else {
            s.to_string()
        }
    };
    for (from, to) in TOP_LINEARS {
        if let Some(s) = native.strip_prefix(to).and_then(|s| s.strip_prefix('.')) {
            return LINEAR_SUFFIXES
                .contains(&s)
                .then(|| format!("{from}.{}", hf_suffix(s)));
        }
    }
    let top = match native {
        "norm.weight" => Some("model.norm.weight"),
        "hc_head_fn" => Some("model.hc_head.hc_fn"),
        "hc_head_base" => Some("model.hc_head.hc_base"),
        "hc_head_scale" => Some("model.hc_head.hc_scale"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = native.strip_prefix("layers.")?;
    let (n, tail) = rest.split_once('.')?;
    let layer: usize = n.parse().ok()?;
    let p = format!("model.layers.{layer}");
    if let Some(&(from, _)) = EXACT.iter().find(|(_, to)| *to == tail) {
        return Some(format!("{p}.{from}"));
    }
    for (from, to) in LINEARS.iter().chain([&SHARED_DOWN]) {
        if let Some(s) = tail.strip_prefix(to).and_then(|s| s.strip_prefix('.')) {
            if LINEAR_SUFFIXES.contains(&s) {
                return Some(format!("{p}.{from}.{}", hf_suffix(s)));
            }
        }
    }
    let experts = tail.strip_prefix("ffn.experts.")?;
    let (e, rest) = experts.split_once('.')?;
    let expert: usize = e.parse().ok()?;
    let (w, s) = rest.split_once('.')?;
    let module = match w {
        "w1" => "gate_proj",
        "w2" => "down_proj",
        "w3" => "up_proj",
        _ => return None,
    };
    LINEAR_SUFFIXES
        .contains(&s)
        .then(|| format!("{p}.mlp.experts.{expert}.{module}.{}", hf_suffix(s)))
}

/// Why a native key is not part of `cfg`'s layout (for error messages).
pub fn unknown_reason(cfg: &Config, key: &str) -> String {
    if let Some(rest) = key.strip_prefix("layers.") {
        if let Some(l) = rest.split('.').next().and_then(|n| n.parse::<usize>().ok()) {
            if l >= cfg.num_layers {
                return format!(
                    "layer {l} is not below num_hidden_layers {}",
                    cfg.num_layers
                );
            }
            if let Some(e) = rest
                .split_once(".ffn.experts.")
                .and_then(|(_, r)| r.split('.').next())
                .and_then(|e| e.parse::<usize>().ok())
            {
                if e >= cfg.n_routed_experts {
                    return format!(
                        "expert {e} is not below n_routed_experts {}",
                        cfg.n_routed_experts
                    );
                }
            }
            let hash = if cfg.is_hash_layer(l) {
                "hash-routed"
            } else {
                "learned-routed"
            };
            return format!(
                "not a tensor of layer {l} ({} attention, {hash} MoE)",
                cfg.layer_kind(l).name()
            );
        }
    }
    "not a DeepSeek-V4 tensor name".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn native(s: &str) -> Option<Translated> {
        Some(Translated::Native(s.into()))
    }

    #[test]
    fn transformers_names_translate() {
        let cases = [
            ("model.embed_tokens.weight", "embed.weight"),
            ("lm_head.weight", "head.weight"),
            ("model.hc_head.hc_scale", "hc_head_scale"),
            (
                "model.layers.3.input_layernorm.weight",
                "layers.3.attn_norm.weight",
            ),
            ("model.layers.3.attn_hc.fn", "layers.3.hc_attn_fn"),
            ("model.layers.3.self_attn.sinks", "layers.3.attn.attn_sink"),
            (
                "model.layers.3.self_attn.q_a_proj.weight",
                "layers.3.attn.wq_a.weight",
            ),
            (
                "model.layers.3.self_attn.q_a_proj.weight_scale_inv",
                "layers.3.attn.wq_a.scale",
            ),
            (
                "model.layers.3.self_attn.compressor.position_bias",
                "layers.3.attn.compressor.ape",
            ),
            (
                "model.layers.3.self_attn.compressor.kv_norm.weight",
                "layers.3.attn.compressor.norm.weight",
            ),
            (
                "model.layers.3.self_attn.compressor.indexer.kv_proj.weight",
                "layers.3.attn.indexer.compressor.wkv.weight",
            ),
            (
                "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
                "layers.3.attn.indexer.weights_proj.weight",
            ),
            (
                "model.layers.3.self_attn.compressor.indexer.weights_proj.weight",
                "layers.3.attn.indexer.weights_proj.weight",
            ),
            ("model.layers.3.mlp.gate.weight", "layers.3.ffn.gate.weight"),
            (
                "model.layers.3.mlp.gate.e_score_correction_bias",
                "layers.3.ffn.gate.bias",
            ),
            (
                "model.layers.0.mlp.gate.tid2eid",
                "layers.0.ffn.gate.tid2eid",
            ),
            (
                "model.layers.3.mlp.shared_experts.down_proj.weight",
                "layers.3.ffn.shared_experts.w2.weight",
            ),
            (
                "model.layers.3.mlp.experts.7.up_proj.weight_scale_2",
                "layers.3.ffn.experts.7.w3.weight_scale_2",
            ),
        ];
        for (hf, ds) in cases {
            assert_eq!(translate(hf), native(ds), "{hf}");
        }
        assert_eq!(
            translate("model.layers.5.mlp.experts.gate_up_proj"),
            Some(Translated::StackedGateUp { layer: 5 })
        );
        assert_eq!(
            translate("model.layers.5.mlp.experts.down_proj"),
            Some(Translated::StackedDown { layer: 5 })
        );
        assert_eq!(translate("model.layers.3.self_attn.q_a_proj.bias"), None);
        assert_eq!(translate("model.layers.x.input_layernorm.weight"), None);
        assert_eq!(translate("model.rotary_emb.inv_freq"), None);
    }

    #[test]
    fn native_names_round_trip_through_transformers() {
        let cfg = Config::tiny();
        for spec in layout(&cfg) {
            let names = match spec.kind {
                TensorKind::Linear { .. } => LINEAR_SUFFIXES
                    .iter()
                    .map(|s| format!("{}.{s}", spec.name))
                    .collect::<Vec<_>>(),
                _ => vec![spec.name.clone()],
            };
            for n in names {
                let hf = to_transformers(&n).unwrap_or_else(|| panic!("{n}"));
                assert_eq!(
                    namings_of(&hf) & Naming::Transformers.bit(),
                    Naming::Transformers.bit(),
                    "{hf}"
                );
                assert_eq!(translate(&hf), native(&n), "{n} -> {hf}");
                let saved = to_transformers_saved(&n);
                assert_ne!(
                    namings_of(&saved) & Naming::TransformersSaved.bit(),
                    0,
                    "{saved}"
                );
                assert_eq!(
                    translate_saved(&saved).as_deref(),
                    Some(n.as_str()),
                    "{n} -> {saved}"
                );
            }
        }
        assert_eq!(
            to_transformers("layers.1.attn.wq_a.scale").unwrap(),
            "model.layers.1.self_attn.q_a_proj.weight_scale_inv"
        );
        assert_eq!(to_transformers("layers.1.bogus"), None);
    }

    #[test]
    fn save_pretrained_names_translate() {
        // As transformers 5.17.0's save_pretrained writes them (tests/fixtures/saved_bf16).
        let cases = [
            ("head.weight", "head.weight"),
            ("model.embed_tokens.weight", "embed.weight"),
            ("model.norm.weight", "norm.weight"),
            ("model.hc_head.hc_fn", "hc_head_fn"),
            (
                "model.layers.2.attn.norm.weight",
                "layers.2.attn.kv_norm.weight",
            ),
            (
                "model.layers.2.attn.compressor.norm.weight",
                "layers.2.attn.compressor.norm.weight",
            ),
            (
                "model.layers.2.attn.wq_a.weight",
                "layers.2.attn.wq_a.weight",
            ),
            (
                "model.layers.2.attn.wq_a.weight_scale_inv",
                "layers.2.attn.wq_a.scale",
            ),
            ("model.layers.2.hc_attn_fn", "layers.2.hc_attn_fn"),
            (
                "model.layers.2.ffn.experts.3.w2.weight",
                "layers.2.ffn.experts.3.w2.weight",
            ),
        ];
        for (saved, ds) in cases {
            assert_eq!(translate_saved(saved).as_deref(), Some(ds), "{saved}");
        }
    }

    #[test]
    fn a_checkpoint_naming_is_decided_by_its_keys() {
        use Naming::*;
        let decide = |keys: &[&'static str]| naming_of_keys(keys.iter().copied());
        assert_eq!(decide(&["embed.weight", "head.weight"]), Ok(DeepSeek));
        assert_eq!(decide(&["head.weight"]), Ok(DeepSeek));
        assert_eq!(
            decide(&["lm_head.weight", "model.layers.0.self_attn.sinks"]),
            Ok(Transformers)
        );
        assert_eq!(
            decide(&[
                "head.weight",
                "model.embed_tokens.weight",
                "model.layers.0.attn.attn_sink"
            ]),
            Ok(TransformersSaved)
        );
        let (ds, tf, saved) = (DeepSeek.bit(), Transformers.bit(), TransformersSaved.bit());
        assert_eq!(
            decide(&[
                "head.weight",
                "model.norm.weight",
                "model.layers.0.self_attn.sinks"
            ]),
            Err((
                "head.weight",
                ds | saved,
                "model.layers.0.self_attn.sinks",
                tf
            ))
        );
        assert_eq!(
            decide(&["embed.weight", "lm_head.weight"]),
            Err(("embed.weight", ds, "lm_head.weight", tf))
        );
        assert_eq!(
            describe_namings(ds | saved),
            "DeepSeek-native or transformers save_pretrained"
        );
    }

    #[test]
    fn layout_covers_layer_kinds() {
        let cfg = Config::tiny();
        let names: Vec<String> = layout(&cfg).into_iter().map(|t| t.name).collect();
        let has = |n: &str| names.iter().any(|x| x == n);
        assert!(has("layers.0.ffn.gate.tid2eid") && !has("layers.0.ffn.gate.bias"));
        assert!(has("layers.1.ffn.gate.bias"));
        assert!(!has("layers.0.attn.compressor.wkv"));
        assert!(has("layers.1.attn.indexer.compressor.ape"));
        assert!(has("layers.2.attn.compressor.ape") && !has("layers.2.attn.indexer.wq_b"));
        let experts = names.iter().filter(|n| n.contains(".ffn.experts.")).count();
        assert_eq!(experts, cfg.num_layers * cfg.n_routed_experts * 3);
    }

    #[test]
    fn unknown_reasons_are_specific() {
        let cfg = Config::tiny();
        assert!(unknown_reason(&cfg, "layers.9.attn.wq_a.weight").contains("num_hidden_layers"));
        assert!(
            unknown_reason(&cfg, "layers.1.ffn.experts.99.w1.weight").contains("n_routed_experts")
        );
        assert!(unknown_reason(&cfg, "layers.0.attn.compressor.ape").contains("sliding"));
        assert!(unknown_reason(&cfg, "foo").contains("not a DeepSeek-V4"));
    }
}
