//! End-to-end checks of the `dsv4` binary.

use std::path::Path;
use std::process::{Command, Output};

use dsv4_tests::{fixtures, load_oracle, max_abs_diff};
use safetensors::SafeTensors;

fn dsv4(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dsv4"))
        .args(args)
        .output()
        .expect("dsv4 runs")
}

/// `dsv4 logits --model M --input-ids IDS --out OUT [extra...]`.
fn logits(model: &Path, ids: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--input-ids",
        ids.to_str().unwrap(),
    ];
    args.extend(["--out", out.to_str().unwrap()]);
    args.extend(extra);
    dsv4(&args)
}

fn write_ids(path: &Path, ids: &[u32]) {
    let text: Vec<String> = ids.iter().map(u32::to_string).collect();
    std::fs::write(path, text.join(", ")).unwrap();
}

#[test]
fn logits_command_reproduces_every_oracle_fixture() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = fixtures();
    assert!(dirs.len() >= 3);
    for dir in dirs {
        let oracle = load_oracle(&dir);
        let ids_file = tmp.path().join("ids.txt");
        write_ids(&ids_file, &oracle.input_ids);
        for chunks in [None, Some("19,18")] {
            let out_file = tmp.path().join("logits.safetensors");
            let extra = chunks.map(|c| vec!["--chunks", c]).unwrap_or_default();
            let out = logits(&dir, &ids_file, &out_file, &extra);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let bytes = std::fs::read(&out_file).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let t = st.tensor("logits").unwrap();
            assert_eq!(t.shape(), &[oracle.input_ids.len(), oracle.vocab]);
            let got: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let (diff, scale) = max_abs_diff(&got, &oracle.logits);
            assert!(
                diff <= 1e-3 * scale,
                "{}: chunks {chunks:?}: max|Δ| {diff} vs max|logit| {scale}",
                dir.display()
            );
        }
    }
}

#[test]
fn prompt_past_the_context_limit_is_an_error_naming_the_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let src = &fixtures()[0];
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, model.join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = model.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = 16.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let ids_file = tmp.path().join("ids.txt");
    write_ids(&ids_file, &(0..20).collect::<Vec<u32>>());
    let out_file = tmp.path().join("out.safetensors");
    let out = logits(&model, &ids_file, &out_file, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("context limit of 16"), "{err}");
    assert!(!out_file.exists());
}

#[test]
fn bad_inputs_give_errors_not_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nothing-here");
    let out = dsv4(&["info", "--model", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not exist") && !err.contains("panicked"),
        "{err}"
    );

    let ids_file = tmp.path().join("ids.txt");
    std::fs::write(&ids_file, "1 2 x3").unwrap();
    let fixture = fixtures()[0].clone();
    let out = logits(&fixture, &ids_file, &tmp.path().join("o"), &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("`x3` is not a token id"),
        "{err}"
    );

    write_ids(&ids_file, &[1, 2, 100000]);
    let out = logits(&fixture, &ids_file, &tmp.path().join("o"), &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("token id 100000"),
        "{err}"
    );

    write_ids(&ids_file, &[1, 2]);
    let cpu_only = ["--backend", "cpu", "--max-context", "8"];
    let out = logits(&fixture, &ids_file, &tmp.path().join("o"), &cpu_only);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--max-context and --gpus apply to --backend cuda"),
        "{err}"
    );
    for (gpus, says) in [
        ("2", "--max-context and --gpus apply to --backend cuda"),
        ("0", "neither a positive number of GPUs nor `all`"),
        ("two", "neither a positive number of GPUs nor `all`"),
    ] {
        let args = ["--backend", "cpu", "--gpus", gpus];
        let out = logits(&fixture, &ids_file, &tmp.path().join("o"), &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "--gpus {gpus}: {err}"
        );
    }
}

/// Overwrites every element of tensor `name` (BF16 or F32, in whichever shard holds it) with NaN.
fn poison(dir: &Path, name: &str) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let mut bytes = std::fs::read(&path).unwrap();
        let (header, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let Some(info) = meta.info(name) else {
            continue;
        };
        let nan: &[u8] = match info.dtype {
            safetensors::Dtype::BF16 => &[0xc0, 0x7f],
            safetensors::Dtype::F32 => &[0, 0, 0xc0, 0x7f],
            d => panic!("{name} is {d:?}"),
        };
        let (s, e) = info.data_offsets;
        for chunk in bytes[8 + header + s..8 + header + e].chunks_exact_mut(nan.len()) {
            chunk.copy_from_slice(nan);
        }
        std::fs::write(&path, bytes).unwrap();
        return;
    }
    panic!("no tensor {name} in {}", dir.display());
}

/// Runs `dsv4 ARGS`, which must fail without a panic and say `expected` on stderr.
fn fails_saying(args: &[&str], expected: &str) {
    let out = dsv4(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(expected) && !err.contains("panicked"),
        "{args:?}: exit {:?}, stderr: {err}",
        out.status.code()
    );
}

/// A 2-layer tiny synthetic checkpoint in `dir`.
fn synth_tiny(dir: &Path) {
    let d = dir.to_str().unwrap();
    let out = dsv4(&["synth", "--preset", "tiny", "--layers", "2", "--out", d]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `dsv4 generate` on `model` with `extra` flags must fail saying `expected`.
fn generate_fails(model: &Path, extra: &[&str], expected: &str) {
    let m = model.to_str().unwrap();
    let mut args = vec![
        "generate",
        "--model",
        m,
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "2",
    ];
    args.extend(extra);
    fails_saying(&args, expected);
}

#[test]
fn bad_settings_configs_and_weights_are_named_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let m = model.to_str().unwrap();
    synth_tiny(&model);
    let gen = |extra: &[&str], expected: &str| generate_fails(&model, extra, expected);

    for t in ["NaN", "inf", "-1"] {
        gen(
            &[&format!("--temperature={t}")],
            "must be finite and at least 0",
        );
    }
    for p in ["0", "1.5", "NaN"] {
        gen(&[&format!("--top-p={p}")], "must be in (0, 1]");
    }
    // Checked before anything is loaded.
    gen(
        &["--max-context", "2", "--backend", "cuda"],
        "+ --max-new-tokens (2) exceeds --max-context 2",
    );
    gen(
        &["--no-graph", "--backend", "cpu"],
        "apply to --backend cuda",
    );
    // The bench's context is checked before a random model is drawn.
    fails_saying(
        &[
            "bench",
            "--prompt",
            "10",
            "--decode",
            "10",
            "--max-context",
            "5",
        ],
        "need 40 positions; --max-context is 5",
    );
    fails_saying(
        &[
            "bench",
            "--context",
            "1000",
            "--prompt",
            "10",
            "--decode",
            "10",
            "--max-context",
            "1039",
        ],
        "--context 1000, --prompt 10 and three runs of --decode 10 need 1040 positions",
    );

    let missing = tmp.path().join("nothing-here");
    generate_fails(
        &missing,
        &[],
        &format!("model directory {} does not exist", missing.display()),
    );

    let ids = tmp.path().join("ids.txt");
    write_ids(&ids, &[1, 2, 3, 4, 5]);
    let out_file = tmp.path().join("logits.safetensors");
    let config = model.join("config.json");
    let good_config = std::fs::read_to_string(&config).unwrap();
    for bad in ["{\"hidden_size\": 64,", "{\"hidden_size\": NaN}"] {
        std::fs::write(&config, bad).unwrap();
        let expected = format!("{} is not valid JSON", config.display());
        gen(&[], &expected);
        fails_saying(&["info", "--model", m], &expected);
    }
    std::fs::write(&config, good_config).unwrap();

    let run_logits = |model: &Path| logits(model, &ids, &out_file, &["--chunks", "2"]);
    let poisoned = |tensor: &str| {
        let dir = tmp.path().join(tensor);
        synth_tiny(&dir);
        poison(&dir, tensor);
        dir
    };
    for (tensor, expected) in [
        (
            "layers.1.ffn_norm.weight",
            "the output of layer 1 is the first that is non-finite",
        ),
        (
            "head.weight",
            "every layer's output is finite there: the head made them",
        ),
    ] {
        let dir = poisoned(tensor);
        generate_fails(&dir, &[], expected);
        let out = run_logits(&dir);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains("non-finite logits at position 0")
                && err.contains(expected),
            "{tensor}: {err}"
        );
        assert!(!out_file.exists());
    }
}

#[test]
fn synth_then_generate_streams_text_and_info_describes_it() {
    let tmp = tempfile::tempdir().unwrap();
    for format in ["official", "nvfp4", "bf16"] {
        let model = tmp.path().join(format);
        let m = model.to_str().unwrap();
        let out = dsv4(&[
            "synth", "--preset", "tiny", "--layers", "2", "--format", format, "--out", m,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = dsv4(&[
            "generate",
            "--model",
            m,
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.9",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());
        assert!(String::from_utf8_lossy(&out.stderr).contains("tok/s"));
        let out = dsv4(&[
            "generate",
            "--model",
            m,
            "--prompt",
            "Hi",
            "--chat",
            "--max-new-tokens",
            "4",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = dsv4(&["info", "--model", m]);
        let info = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            info.contains("layer schedule") && info.contains("csa m=4"),
            "{info}"
        );
        let expert_format = match format {
            "official" => "mxfp4",
            "nvfp4" => "nvfp4",
            _ => "bf16",
        };
        assert!(
            info.to_lowercase().contains(expert_format),
            "{format}: {info}"
        );
    }
}
