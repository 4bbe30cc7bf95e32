use std::path::Path;

use dsv4_ops::codecs::{e8m0, fp8_block, mxfp4, nvfp4};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use super::layout::{self, TensorKind};
use super::*;
use crate::synth::{small_config, write_synthetic, SynthFormat};

/// Every stored tensor of a checkpoint: (name, dtype, shape, bytes).
type Raw = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn synth(format: SynthFormat) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_synthetic(&small_config(), format, dir.path(), 11, &mut |_, _| {}).unwrap();
    dir
}

fn shard_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    v.sort();
    v
}

fn read_raw(dir: &Path) -> Raw {
    let mut raw = Raw::new();
    for f in shard_files(dir) {
        let bytes = std::fs::read(&f).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            raw.push((
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            ));
        }
    }
    raw.sort_by(|a, b| a.0.cmp(&b.0));
    raw
}

/// Replaces a checkpoint's shards and index with one `model.safetensors` holding `raw`.
fn write_single(dir: &Path, raw: &Raw) {
    for f in shard_files(dir) {
        std::fs::remove_file(f).unwrap();
    }
    let _ = std::fs::remove_file(dir.join(INDEX_FILE));
    let views: Vec<(String, TensorView<'_>)> = raw
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join(SINGLE_FILE)).unwrap();
}

/// A copy of `src` (config and tokenizer) with `raw` as its single weight file.
fn with_raw(src: &Path, raw: &Raw) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    write_single(dir.path(), raw);
    dir
}

fn edit(format: SynthFormat, f: impl FnOnce(&mut Raw)) -> tempfile::TempDir {
    let src = synth(format);
    let mut raw = read_raw(src.path());
    f(&mut raw);
    with_raw(src.path(), &raw)
}

fn entry<'a>(raw: &'a mut Raw, name: &str) -> &'a mut (String, Dtype, Vec<usize>, Vec<u8>) {
    raw.iter_mut()
        .find(|t| t.0 == name)
        .unwrap_or_else(|| panic!("no {name}"))
}

fn open_err(dir: &Path) -> LoadError {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("{} opened without error", dir.display()),
        Err(e) => e,
    }
}

/// Asserts that two checkpoints serve the same values for every tensor of the layout.
fn assert_same_values(a: &Checkpoint, b: &Checkpoint) {
    for spec in layout::layout(a.config()) {
        match spec.kind {
            TensorKind::Linear { rows, cols, .. } => {
                let (la, lb) = (
                    a.linear(&spec.name, rows, cols).unwrap(),
                    b.linear(&spec.name, rows, cols).unwrap(),
                );
                assert_eq!(la.format_name(), lb.format_name(), "{}", spec.name);
                assert_eq!(la.to_f32(), lb.to_f32(), "{}", spec.name);
            }
            TensorKind::Vector { shape, .. } => {
                assert_eq!(
                    a.vector_f32(&spec.name, &shape).unwrap(),
                    b.vector_f32(&spec.name, &shape).unwrap(),
                    "{}",
                    spec.name
                );
            }
            TensorKind::Index { rows, cols } => {
                assert_eq!(
                    a.index_table(&spec.name, rows, cols).unwrap(),
                    b.index_table(&spec.name, rows, cols).unwrap()
                );
            }
        }
    }
}

#[test]
fn stacked_transformers_and_native_namings_load_identically() {
    let cfg = small_config();
    let hf = synth(SynthFormat::Bf16);
    // Unstack the experts and rename everything to DeepSeek-native keys.
    let (e, i, d) = (
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
        cfg.hidden_size,
    );
    let mut native = Raw::new();
    for (name, dtype, shape, bytes) in read_raw(hf.path()) {
        if let Some(l) = name
            .strip_suffix(".mlp.experts.gate_up_proj")
            .and_then(|p| p.strip_prefix("model.layers."))
        {
            for x in 0..e {
                let per = 2 * i * d * 2;
                let half = i * d * 2;
                native.push((
                    format!("layers.{l}.ffn.experts.{x}.w1.weight"),
                    dtype,
                    vec![i, d],
                    bytes[x * per..x * per + half].to_vec(),
                ));
                native.push((
                    format!("layers.{l}.ffn.experts.{x}.w3.weight"),
                    dtype,
                    vec![i, d],
                    bytes[x * per + half..(x + 1) * per].to_vec(),
                ));
            }
        } else if let Some(l) = name
            .strip_suffix(".mlp.experts.down_proj")
            .and_then(|p| p.strip_prefix("model.layers."))
        {
            for x in 0..e {
                let per = d * i * 2;
                native.push((
                    format!("layers.{l}.ffn.experts.{x}.w2.weight"),
                    dtype,
                    vec![d, i],
                    bytes[x * per..(x + 1) * per].to_vec(),
                ));
            }
        } else {
            let Some(layout::Translated::Native(n)) = layout::translate(&name) else {
                panic!("{name}")
            };
            native.push((n, dtype, shape, bytes));
        }
    }
    let nat = with_raw(hf.path(), &native);
    let a = Checkpoint::open(hf.path()).unwrap();
    let b = Checkpoint::open(nat.path()).unwrap();
    assert_eq!(a.summary().naming, Naming::Transformers);
    assert_eq!(b.summary().naming, Naming::DeepSeek);
    assert_eq!(b.summary().shards, 1);
    assert_same_values(&a, &b);
    assert_eq!(a.summary().params, b.summary().params);
}

#[test]
fn quantized_native_checkpoint_renamed_to_transformers_loads_identically() {
    for format in [SynthFormat::Official, SynthFormat::Nvfp4] {
        let src = synth(format);
        let renamed: Raw = read_raw(src.path())
            .into_iter()
            .map(|(n, d, s, b)| (layout::to_transformers(&n).unwrap(), d, s, b))
            .collect();
        assert!(renamed
            .iter()
            .any(|t| t.0.ends_with(".q_a_proj.weight_scale_inv")));
        let dst = with_raw(src.path(), &renamed);
        let a = Checkpoint::open(src.path()).unwrap();
        let b = Checkpoint::open(dst.path()).unwrap();
        assert_eq!(b.summary().naming, Naming::Transformers);
        assert_same_values(&a, &b);
        assert_eq!(a.summary().formats, b.summary().formats);
    }
}

#[test]
fn older_indexer_name_is_accepted_and_duplicates_are_rejected() {
    let scorer = "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight";
    let older = "model.layers.1.self_attn.compressor.indexer.weights_proj.weight";
    let dir = edit(SynthFormat::Bf16, |raw| entry(raw, scorer).0 = older.into());
    Checkpoint::open(dir.path()).unwrap();
    let dir = edit(SynthFormat::Bf16, |raw| {
        let mut copy = entry(raw, scorer).clone();
        copy.0 = older.into();
        raw.push(copy);
    });
    match open_err(dir.path()) {
        LoadError::Duplicate { tensor, .. } => assert!(
            tensor.contains("layers.1.attn.indexer.weights_proj.weight"),
            "{tensor}"
        ),
        e => panic!("{e}"),
    }
}

#[test]
fn mtp_tensors_are_skipped() {
    let dir = edit(SynthFormat::Official, |raw| {
        raw.push((
            "mtp.0.e_proj.weight".into(),
            Dtype::F8_E4M3,
            vec![2, 2],
            vec![0; 4],
        ));
        raw.push((
            "mtp.0.enorm.weight".into(),
            Dtype::BF16,
            vec![2],
            vec![0; 4],
        ));
    });
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.summary().skipped_mtp, 2);
    assert!(!ck.contains("mtp.0.e_proj.weight"));
}

#[test]
fn missing_tensor_is_named_with_the_directory() {
    let dir = edit(SynthFormat::Official, |raw| {
        raw.retain(|t| t.0 != "layers.1.attn.wq_b.scale")
    });
    let err = open_err(dir.path());
    assert!(
        matches!(&err, LoadError::Missing { tensor, .. } if tensor == "layers.1.attn.wq_b.scale"),
        "{err}"
    );
    assert!(err.to_string().contains(&dir.path().display().to_string()));

    let dir = edit(SynthFormat::Official, |raw| {
        raw.retain(|t| t.0 != "layers.3.attn.indexer.compressor.ape")
    });
    assert!(open_err(dir.path())
        .to_string()
        .contains("`layers.3.attn.indexer.compressor.ape`"));

    let dir = edit(SynthFormat::Nvfp4, |raw| {
        raw.retain(|t| t.0 != "layers.0.ffn.experts.2.w2.weight_scale_2")
    });
    assert!(open_err(dir.path())
        .to_string()
        .contains("`layers.0.ffn.experts.2.w2.weight_scale_2`"));
}

#[test]
fn misshaped_tensors_name_tensor_file_and_shapes() {
    let dir = edit(SynthFormat::Official, |raw| {
        let t = entry(raw, "layers.2.ffn_norm.weight");
        t.2 = vec![40];
        t.3.truncate(80);
    });
    let err = open_err(dir.path());
    match &err {
        LoadError::Shape {
            tensor,
            file,
            expected,
            found,
        } => {
            assert_eq!(tensor, "layers.2.ffn_norm.weight");
            assert!(file.ends_with(SINGLE_FILE));
            assert_eq!(
                (expected.as_slice(), found.as_slice()),
                (&[80][..], &[40][..])
            );
        }
        e => panic!("{e}"),
    }
    assert!(err.to_string().contains("model.safetensors"));

    // A block-scale grid that matches no block size.
    let dir = edit(SynthFormat::Official, |raw| {
        let t = entry(raw, "layers.1.attn.wq_b.scale");
        t.2 = vec![3, 1];
        t.3 = vec![127; 3];
    });
    assert!(
        matches!(open_err(dir.path()), LoadError::Shape { tensor, .. } if tensor == "layers.1.attn.wq_b.scale")
    );

    // MXFP4 scales per 32 along the row: [rows, ceil(cols/32)].
    let dir = edit(SynthFormat::Official, |raw| {
        let t = entry(raw, "layers.1.ffn.experts.0.w2.scale");
        let rows = t.2[0];
        t.2 = vec![rows, 1];
        t.3.truncate(rows);
    });
    assert!(
        matches!(open_err(dir.path()), LoadError::Shape { tensor, .. } if tensor == "layers.1.ffn.experts.0.w2.scale")
    );

    // Stacked experts must match the config.
    let dir = edit(SynthFormat::Bf16, |raw| {
        let t = entry(raw, "model.layers.1.mlp.experts.down_proj");
        let (e, d, i) = (t.2[0], t.2[1], t.2[2]);
        t.2 = vec![e - 1, d, i];
        t.3.truncate((e - 1) * d * i * 2);
    });
    assert!(
        matches!(open_err(dir.path()), LoadError::Shape { tensor, .. } if tensor == "model.layers.1.mlp.experts.down_proj")
    );
}

#[test]
fn bad_dtypes_name_tensor_file_and_dtype() {
    let dir = edit(SynthFormat::Official, |raw| {
        entry(raw, "layers.1.attn.attn_sink").1 = Dtype::I32
    });
    let err = open_err(dir.path());
    assert!(
        matches!(&err, LoadError::Dtype { tensor, found, .. } if tensor == "layers.1.attn.attn_sink" && found == "I32"),
        "{err}"
    );
    assert!(err.to_string().contains("model.safetensors"));

    let dir = edit(SynthFormat::Official, |raw| {
        entry(raw, "layers.1.attn.wq_a.weight").1 = Dtype::F8_E5M2
    });
    assert!(matches!(open_err(dir.path()), LoadError::Dtype { found, .. } if found == "F8_E5M2"));

    let dir = edit(SynthFormat::Official, |raw| {
        entry(raw, "layers.1.ffn.experts.0.w1.scale").1 = Dtype::U8
    });
    assert!(
        matches!(open_err(dir.path()), LoadError::Dtype { tensor, .. } if tensor == "layers.1.ffn.experts.0.w1.scale")
    );

    let dir = edit(SynthFormat::Official, |raw| {
        let t = entry(raw, "layers.0.ffn.gate.tid2eid");
        t.1 = Dtype::F64;
    });
    assert!(
        matches!(open_err(dir.path()), LoadError::Dtype { tensor, .. } if tensor == "layers.0.ffn.gate.tid2eid")
    );
}

#[test]
fn truncated_shard_names_file_and_tensor() {
    let dir = synth(SynthFormat::Official);
    let shard = dir.path().join("model-00003-of-00005.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    let cut = len as usize - 10;
    // The first tensor, in file order, that no longer fits.
    let first_cut = {
        let bytes = std::fs::read(&shard).unwrap();
        let (n, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        meta.offset_keys()
            .into_iter()
            .find(|k| 8 + n + meta.info(k).unwrap().data_offsets.1 > cut)
            .unwrap()
    };
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    f.set_len(cut as u64).unwrap();
    let err = open_err(dir.path());
    match &err {
        LoadError::Truncated { tensor, file, .. } => {
            assert_eq!(file, &shard);
            assert_eq!(tensor, &first_cut);
        }
        e => panic!("{e}"),
    }
    assert!(err.to_string().contains("model-00003-of-00005.safetensors"));
}

#[test]
fn corrupt_headers_name_the_file() {
    let dir = synth(SynthFormat::Official);
    let shard = dir.path().join("model-00002-of-00005.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[8..16].copy_from_slice(b"not json");
    std::fs::write(&shard, &bytes).unwrap();
    assert!(matches!(open_err(dir.path()), LoadError::Header { file, .. } if file == shard));

    // A header length beyond the end of the file.
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&shard, &bytes).unwrap();
    assert!(matches!(open_err(dir.path()), LoadError::Header { file, .. } if file == shard));

    // Shorter than the length prefix.
    std::fs::write(&shard, [1, 2, 3]).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(&err, LoadError::Header { file, .. } if *file == shard),
        "{err}"
    );
    assert!(err.to_string().contains("model-00002-of-00005.safetensors"));

    // A tensor whose dtype no longer fits its offsets (F8_E4M3 read as F32) is named.
    let dir = synth(SynthFormat::Official);
    let shard = dir.path().join("model-00002-of-00005.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let name = header
        .iter()
        .find(|(_, v)| v["dtype"] == "F8_E4M3")
        .map(|(k, _)| k.clone())
        .unwrap();
    header[&name]["dtype"] = "F32".into();
    let mut text = serde_json::to_vec(&header).unwrap();
    assert!(text.len() <= n);
    text.resize(n, b' ');
    bytes[8..8 + n].copy_from_slice(&text);
    std::fs::write(&shard, &bytes).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(&err, LoadError::Header { file, .. } if *file == shard)
            && err.to_string().contains(&format!("tensor `{name}`")),
        "{err}"
    );
}

#[test]
fn unknown_keys_are_rejected_with_a_reason() {
    let cases = [
        ("layers.4.attn.wq_a.weight", "num_hidden_layers"),
        ("layers.1.ffn.experts.5.w1.weight", "n_routed_experts"),
        ("layers.0.attn.compressor.ape", "sliding"),
        ("layers.0.ffn.gate.bias", "hash-routed"),
        ("layers.1.attn.wq_a.bias", "layer 1"),
        ("rotary.inv_freq", "not a DeepSeek-V4"),
    ];
    for (name, reason) in cases {
        let dir = edit(SynthFormat::Official, |raw| {
            raw.push((name.into(), Dtype::F32, vec![1], vec![0; 4]))
        });
        let err = open_err(dir.path());
        match &err {
            LoadError::UnknownTensor { tensor, file, .. } => {
                assert_eq!(tensor, name);
                assert!(file.ends_with(SINGLE_FILE));
            }
            e => panic!("{name}: {e}"),
        }
        assert!(err.to_string().contains(reason), "{name}: {err}");
    }
}

#[test]
fn mixed_namings_name_two_conflicting_keys() {
    let cases = [
        (
            SynthFormat::Official,
            "model.layers.1.self_attn.rotary_emb.inv_freq",
            "embed.weight",
        ),
        (SynthFormat::Official, "lm_head.weight", "embed.weight"),
        (
            SynthFormat::Bf16,
            "model.layers.1.attn.wq_a.weight",
            "lm_head.weight",
        ),
    ];
    for (format, extra, earlier) in cases {
        let dir = edit(format, |raw| {
            raw.push((extra.into(), Dtype::F32, vec![1], vec![0; 4]))
        });
        let err = open_err(dir.path());
        match &err {
            LoadError::MixedNaming(c) => {
                let mut pair = [c.first.as_str(), c.second.as_str()];
                pair.sort();
                let mut want = [earlier, extra];
                want.sort();
                assert_eq!(pair, want, "{err}");
            }
            e => panic!("{extra}: {e}"),
        }
        assert!(err.to_string().contains(SINGLE_FILE), "{err}");
    }
}

#[test]
fn save_pretrained_naming_loads_like_native() {
    let src = synth(SynthFormat::Official);
    let saved: Raw = read_raw(src.path())
        .into_iter()
        .map(|(n, d, s, b)| (layout::to_transformers_saved(&n), d, s, b))
        .collect();
    assert!(saved
        .iter()
        .any(|t| t.0 == "model.layers.1.attn.norm.weight"));
    let dst = with_raw(src.path(), &saved);
    let a = Checkpoint::open(src.path()).unwrap();
    let b = Checkpoint::open(dst.path()).unwrap();
    assert_eq!(b.summary().naming, Naming::TransformersSaved);
    assert_same_values(&a, &b);
    assert_eq!(a.summary().formats, b.summary().formats);
}

#[test]
fn index_errors_name_the_shard() {
    let dir = synth(SynthFormat::Official);
    let shard = dir.path().join("model-00004-of-00005.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(&err, LoadError::MissingShard { shard: s, .. } if *s == shard),
        "{err}"
    );
    assert!(err.to_string().contains("model-00004-of-00005.safetensors"));

    // The index claims a tensor lives in a shard that does not contain it.
    let dir = synth(SynthFormat::Official);
    let path = dir.path().join(INDEX_FILE);
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    index["weight_map"]["layers.1.attn.wq_a.weight"] = "model-00001-of-00005.safetensors".into();
    std::fs::write(&path, index.to_string()).unwrap();
    let err = open_err(dir.path());
    assert!(
        matches!(&err, LoadError::Index { .. })
            && err.to_string().contains("layers.1.attn.wq_a.weight"),
        "{err}"
    );

    std::fs::write(&path, "{\"weight_map\": 3}").unwrap();
    assert!(matches!(open_err(dir.path()), LoadError::Index { .. }));
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(open_err(dir.path()), LoadError::NoWeights { .. }));

    // A tensor stored in a second shard as well, the index naming its first: the duplicate
    // is named, not the index.
    let dup = synth(SynthFormat::Official);
    let (from, to) = (
        dup.path().join("model-00002-of-00005.safetensors"),
        dup.path().join("model-00003-of-00005.safetensors"),
    );
    let (a, b) = (std::fs::read(&from).unwrap(), std::fs::read(&to).unwrap());
    let (a, b) = (
        SafeTensors::deserialize(&a).unwrap(),
        SafeTensors::deserialize(&b).unwrap(),
    );
    let (name, copy) = a.tensors().into_iter().next().unwrap();
    let mut views = b.tensors();
    views.push((name.clone(), copy));
    safetensors::serialize_to_file(views, None, &to).unwrap();
    match open_err(dup.path()) {
        LoadError::Duplicate {
            tensor,
            first,
            second,
        } => assert!(tensor == name && first == from && second == to, "{tensor}"),
        e => panic!("{e}"),
    }
}

#[test]
fn config_errors_are_wrapped() {
    let dir = synth(SynthFormat::Official);
    std::fs::write(dir.path().join("config.json"), "{}").unwrap();
    assert!(matches!(open_err(dir.path()), LoadError::Config(_)));
}

#[test]
fn accessors_check_requested_shapes() {
    let cfg = small_config();
    let dir = synth(SynthFormat::Official);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let err = ck
        .linear("layers.1.attn.wq_a", cfg.q_lora_rank + 1, cfg.hidden_size)
        .unwrap_err();
    assert!(
        matches!(err, LoadError::Shape { ref tensor, .. } if tensor == "layers.1.attn.wq_a.weight"),
        "{err}"
    );
    assert!(matches!(
        ck.vector_f32("norm.weight", &[3]),
        Err(LoadError::Shape { .. })
    ));
    assert!(matches!(
        ck.vector_f32("layers.1.attn.nope", &[3]),
        Err(LoadError::Missing { .. })
    ));
    assert!(matches!(
        ck.index_table("layers.0.ffn.gate.tid2eid", 2, 2),
        Err(LoadError::Shape { .. })
    ));
}

#[test]
fn tid2eid_accepts_i32_and_rejects_negative_ids() {
    let name = "layers.0.ffn.gate.tid2eid";
    let src = synth(SynthFormat::Official);
    let want = Checkpoint::open(src.path())
        .unwrap()
        .index_table(name, 200, 3)
        .unwrap();
    let mut raw = read_raw(src.path());
    let t = entry(&mut raw, name);
    t.1 = Dtype::I32;
    t.3 = want
        .iter()
        .flat_map(|&v| (v as i32).to_le_bytes())
        .collect();
    let i32_dir = with_raw(src.path(), &raw);
    assert_eq!(
        Checkpoint::open(i32_dir.path())
            .unwrap()
            .index_table(name, 200, 3)
            .unwrap(),
        want
    );

    let t = entry(&mut raw, name);
    t.3[4..8].copy_from_slice(&(-1i32).to_le_bytes());
    let bad = with_raw(src.path(), &raw);
    let err = Checkpoint::open(bad.path())
        .unwrap()
        .index_table(name, 200, 3)
        .unwrap_err();
    assert!(
        matches!(&err, LoadError::BadValue { tensor, reason } if tensor == name && reason.contains("[0, 1] = -1")),
        "{err}"
    );
}

#[test]
fn quantized_linears_match_the_codec_reference() {
    let cfg = small_config();
    let (d, q, i) = (cfg.hidden_size, cfg.q_lora_rank, cfg.moe_intermediate_size);
    let get = |raw: &Raw, n: &str| raw.iter().find(|t| t.0 == n).unwrap().3.clone();

    let dir = synth(SynthFormat::Official);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let raw = read_raw(dir.path());
    let fp8 = fp8_block::dequantize(
        &get(&raw, "layers.1.attn.wq_a.weight"),
        &get(&raw, "layers.1.attn.wq_a.scale"),
        fp8_block::ScaleFormat::E8m0,
        q,
        d,
        128,
        128,
    )
    .unwrap();
    assert_eq!(ck.linear("layers.1.attn.wq_a", q, d).unwrap().to_f32(), fp8);
    let mx = mxfp4::dequantize(
        &get(&raw, "layers.2.ffn.experts.4.w2.weight"),
        &get(&raw, "layers.2.ffn.experts.4.w2.scale"),
        d,
        i,
    )
    .unwrap();
    assert_eq!(
        ck.linear("layers.2.ffn.experts.4.w2", d, i)
            .unwrap()
            .to_f32(),
        mx
    );

    // Base releases store f32 block scales: same values, other encoding.
    let mut base = raw.clone();
    let t = entry(&mut base, "layers.1.attn.wq_a.scale");
    t.1 = Dtype::F32;
    t.3 =
        t.3.iter()
            .flat_map(|&b| e8m0::decode(b).to_le_bytes())
            .collect();
    let base_dir = with_raw(dir.path(), &base);
    let lin = Checkpoint::open(base_dir.path())
        .unwrap()
        .linear("layers.1.attn.wq_a", q, d)
        .unwrap();
    assert_eq!(lin.format_name(), "fp8 (f32 block scales)");
    assert_eq!(lin.to_f32(), fp8);

    let dir = synth(SynthFormat::Nvfp4);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let raw = read_raw(dir.path());
    let n = "layers.3.ffn.experts.1.w1";
    let s2 = f32::from_le_bytes(
        get(&raw, &format!("{n}.weight_scale_2"))[..4]
            .try_into()
            .unwrap(),
    );
    let nv = nvfp4::dequantize(
        &get(&raw, &format!("{n}.weight")),
        &get(&raw, &format!("{n}.weight_scale")),
        s2,
        i,
        d,
    )
    .unwrap();
    assert_eq!(ck.linear(n, i, d).unwrap().to_f32(), nv);
}

#[test]
fn loaded_matmul_is_accurate_and_batch_invariant() {
    let cfg = small_config();
    let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    for format in [SynthFormat::Official, SynthFormat::Nvfp4, SynthFormat::Bf16] {
        let dir = synth(format);
        let ck = Checkpoint::open(dir.path()).unwrap();
        for (name, rows, cols) in [
            ("layers.1.ffn.experts.2.w2", d, i),
            ("layers.1.attn.wq_a", cfg.q_lora_rank, d),
        ] {
            let lin = ck.linear(name, rows, cols).unwrap();
            let w = lin.to_f32();
            let x: Vec<f32> = (0..7 * cols)
                .map(|k| ((k * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let mut y7 = vec![0f32; 7 * rows];
            lin.matmul(&x, 7, &mut y7);
            for s in 0..7 {
                let mut y1 = vec![0f32; rows];
                lin.matmul(&x[s * cols..(s + 1) * cols], 1, &mut y1);
                assert_eq!(
                    y1.as_slice(),
                    &y7[s * rows..(s + 1) * rows],
                    "{format:?} {name}"
                );
                for r in 0..rows {
                    let terms = (0..cols).map(|c| w[r * cols + c] as f64 * x[s * cols + c] as f64);
                    let exact: f64 = terms.clone().sum();
                    let mag: f64 = terms.map(f64::abs).sum();
                    assert!(
                        (y7[s * rows + r] as f64 - exact).abs() <= 1e-5 * mag,
                        "{format:?} {name} r={r}"
                    );
                }
            }
        }
    }
}
