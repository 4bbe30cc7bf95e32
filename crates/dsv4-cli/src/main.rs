//! `dsv4`: run DeepSeek-V4 checkpoints.

mod serve;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use dsv4_graph::{eager_launch, eager_step, time_all_reduce, DecodeGraph};
use dsv4_model::chat::{encode_chat, ChatMode, Message};
use dsv4_model::checkpoint::Checkpoint;
use dsv4_model::config::{Config, LayerKind};
use dsv4_model::cpu::{CpuModel, Logits};
use dsv4_model::gpu::{plan_memory, plan_random_memory, GpuModel, GpuOptions};
use dsv4_model::sampling::{self, Sampler};
use dsv4_model::synth::{write_synthetic, SynthFormat};
use dsv4_model::tokenizer::{TextStream, Tokenizer};
use dsv4_model::weights::ModelWeights;
use dsv4_ops::gpu::sample::Sampling;
use dsv4_ops::gpu::Device;

#[derive(Parser)]
#[command(name = "dsv4", version, about = "DeepSeek-V4 (Flash / Pro) inference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming tokens as they are produced.
    Generate(GenerateArgs),
    /// Write the logits of every position of a token-id sequence (for parity checks).
    Logits(LogitsArgs),
    /// Time prefill and decode on the GPU (with and without the decode graph) against the
    /// copy-bandwidth roofline, on a checkpoint or a synthetic model of a preset's widths.
    Bench(BenchArgs),
    /// Describe a checkpoint: layer schedule, tensor formats, parameters, bytes per token.
    Info {
        /// Checkpoint directory (config.json, safetensors, tokenizer.json).
        #[arg(long)]
        model: PathBuf,
    },
    /// Write a random-weight checkpoint laid out like the real releases.
    Synth(SynthArgs),
    /// Serve the model over HTTP with the OpenAI API (chat completions, completions,
    /// streaming, metrics).
    Serve(serve::ServeArgs),
    /// Load an OpenAI-compatible server with streaming requests at several concurrencies:
    /// throughput, time to first token, time per output token.
    BenchServe(serve::LoadArgs),
    /// Manage the CUDA kernel cache ($DSV4_KERNEL_CACHE or the user cache dir).
    Kernels {
        /// Compile every kernel into the cache now (needs NVRTC, no GPU) and report the
        /// cold-compile and warm-load time of each family.
        #[arg(long, required = true)]
        precompile: bool,
        /// Target architectures (sm_90a, sm_100a, compute_XY).
        #[arg(long = "arch", default_values = ["sm_90a", "sm_100a"])]
        archs: Vec<String>,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the DeepSeek-V4 chat template.
    #[arg(long)]
    chat: bool,
    /// With --chat: let the model think before answering.
    #[arg(long, requires = "chat")]
    thinking: bool,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// 0 = greedy; finite and at least 0.
    #[arg(long, default_value_t = 0.0, value_parser = parse_temperature)]
    temperature: f32,
    /// Nucleus sampling mass, in (0, 1].
    #[arg(long, default_value_t = 1.0, value_parser = parse_top_p)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    gpu: GpuArgs,
    /// Issue the decode step's launches one by one instead of replaying its CUDA graph
    /// (--backend cuda).
    #[arg(long)]
    no_graph: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    Cuda,
    Cpu,
}

#[derive(clap::Args, Clone, Copy)]
struct GpuArgs {
    /// Where the model runs; default: cuda when a GPU is present, else cpu.
    #[arg(long, value_enum)]
    backend: Option<Backend>,
    /// Positions a sequence may take, prompt and new tokens (per slot): what the GPU sequence
    /// state holds (--backend cuda), or for `serve` on the CPU the limit alone, at most the
    /// model's; default: the prompt plus the new tokens (generate), the input (logits),
    /// 65,536 or the model's limit shared by the slots (serve, cuda), the model's limit
    /// (serve, cpu).
    #[arg(long)]
    max_context: Option<usize>,
    /// GPUs to split the model over (tensor parallelism): a number or `all`; default: the
    /// fewest visible GPUs that hold the model with the context (--backend cuda).
    #[arg(long, value_parser = parse_gpus)]
    gpus: Option<Gpus>,
}

/// `--gpus`: a count, or every visible GPU.
#[derive(Clone, Copy, Debug)]
enum Gpus {
    Count(usize),
    All,
}

fn parse_gpus(s: &str) -> std::result::Result<Gpus, String> {
    match s {
        "all" => Ok(Gpus::All),
        _ => match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Gpus::Count(n)),
            _ => Err(format!(
                "`{s}` is neither a positive number of GPUs nor `all`"
            )),
        },
    }
}

/// How many GPUs `gpus` names: a count, or every visible one; more than are visible is an
/// error naming both counts.
fn gpu_count(gpus: Gpus, visible: usize) -> Result<usize> {
    let n = match gpus {
        Gpus::All => visible,
        Gpus::Count(n) => n,
    };
    if n == 0 || n > visible {
        bail!("--gpus {n}: {visible} CUDA device(s) are visible");
    }
    Ok(n)
}

/// GPUs 0..n opened, `first` (GPU 0, when open already) among them.
/// GPU 0.
fn first_device() -> Result<Arc<Device>> {
    Ok(Arc::new(Device::new(0).context("opening CUDA device 0")?))
}

fn open_devices(n: usize, first: Option<Arc<Device>>) -> Result<Vec<Arc<Device>>> {
    let mut devs: Vec<Arc<Device>> = first.into_iter().collect();
    for i in devs.len()..n {
        let dev = Device::new(i).with_context(|| format!("opening CUDA device {i}"))?;
        devs.push(Arc::new(dev));
    }
    Ok(devs)
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Checkpoint directory; without it, a synthetic model (--synth).
    #[arg(long, conflicts_with = "synth")]
    model: Option<PathBuf>,
    /// Preset whose widths the synthetic model has.
    #[arg(long, value_enum, default_value = "flash")]
    synth: Preset,
    /// Layers of the synthetic model (the preset's first ones).
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// The synthetic model's layer kinds instead (e.g. hca,hca,hca,csa), with the preset's
    /// compression ratios.
    #[arg(long, value_enum, value_delimiter = ',', conflicts_with = "layers")]
    schedule: Option<Vec<LayerChoice>>,
    /// Format of the synthetic model.
    #[arg(long, value_enum, default_value = "nvfp4")]
    format: Format,
    /// Positions of stand-in context before the prompt: every layer's sequence state filled
    /// with random values instead of prefilled, so that decoding after a long context (1M
    /// positions) is measured in seconds.
    #[arg(long, default_value_t = 0)]
    context: usize,
    #[arg(long, default_value_t = 1024)]
    prompt: usize,
    #[arg(long, default_value_t = 32)]
    decode: usize,
    /// Positions the GPU sequence state holds; default: context + prompt + 3 · decode + 1 (the
    /// eager decode, the graph and the graph without programmatic launch run one after the
    /// other), and with --batch one more decode run (and a step) per batch size.
    #[arg(long)]
    max_context: Option<usize>,
    /// Also decode batches of 2, 4, ... up to this many sequences (each a prompt of its own
    /// in its own slot), one graph replay a step: the step's time and the tokens per second.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// GPUs to split the model over: a number or `all` (default 1).
    #[arg(long, value_parser = parse_gpus)]
    gpus: Option<Gpus>,
    /// Longest prompt chunk (rounded down to a power of two); default 8192, shorter where
    /// memory is short.
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// The phase a profiler started with `--profile-from-start off` sees.
    #[arg(long, value_enum, default_value = "decode")]
    profile: Phase,
    /// Write a timeline of one decode graph replay here: each launch's start, first
    /// dependency wait, end and place on the path, from stamps every warp leaves on the GPU's
    /// clock (GPU 0). The stamps cost time, so the run's other figures are not comparable.
    #[arg(long)]
    timeline: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Phase {
    /// The prompt's prefill.
    Prefill,
    /// The decode graph's replays.
    Decode,
    /// The largest batch's decode graph replays (`--batch`).
    Batch,
}

#[derive(clap::Args)]
struct LogitsArgs {
    #[arg(long)]
    model: PathBuf,
    /// Text file of token ids separated by spaces, commas or newlines.
    #[arg(long)]
    input_ids: PathBuf,
    /// Output safetensors file with tensor `logits`, f32 [T, vocab].
    #[arg(long)]
    out: PathBuf,
    /// Prefill chunk lengths (e.g. 19,18); the remaining tokens are decoded one at a time.
    /// Without it: one full prefill.
    #[arg(long, value_delimiter = ',')]
    chunks: Option<Vec<usize>>,
    #[command(flatten)]
    gpu: GpuArgs,
}

#[derive(Clone, Copy, ValueEnum)]
enum Preset {
    Tiny,
    Flash,
    Pro,
}

impl Preset {
    fn config(self) -> Config {
        match self {
            Preset::Tiny => Config::tiny(),
            Preset::Flash => Config::flash(),
            Preset::Pro => Config::pro(),
        }
    }
}

/// The preset's first `n` layers.
fn first_layers(config: Config, n: usize) -> Result<Config> {
    if n == 0 || n > config.num_layers {
        bail!("--layers {n} must be in 1..={}", config.num_layers);
    }
    Ok(config.truncated(n))
}

#[derive(Clone, Copy, ValueEnum)]
enum LayerChoice {
    Sliding,
    Csa,
    Hca,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    /// transformers key names, BF16 everywhere.
    Bf16,
    /// DeepSeek release: FP8 128×128 linears, MXFP4 routed experts.
    Official,
    /// NVIDIA release: as official, routed experts NVFP4.
    Nvfp4,
}

#[derive(clap::Args)]
struct SynthArgs {
    #[arg(long, value_enum, default_value = "tiny")]
    preset: Preset,
    /// Keep only the first N layers.
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long, value_enum, default_value = "official")]
    format: Format,
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl From<Format> for SynthFormat {
    fn from(f: Format) -> SynthFormat {
        match f {
            Format::Bf16 => SynthFormat::Bf16,
            Format::Official => SynthFormat::Official,
            Format::Nvfp4 => SynthFormat::Nvfp4,
        }
    }
}

fn parse_temperature(s: &str) -> Result<f32, String> {
    let t: f32 = s.parse().map_err(|e| format!("{e}"))?;
    sampling::check_temperature(t).map_err(|e| e.to_string())
}

fn parse_top_p(s: &str) -> Result<f32, String> {
    let p: f32 = s.parse().map_err(|e| format!("{e}"))?;
    sampling::check_top_p(p).map_err(|e| e.to_string())
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Generate(a) => generate(a),
        Command::Logits(a) => logits(a),
        Command::Bench(a) => bench(a),
        Command::Info { model } => info(&model),
        Command::Synth(a) => synth(a),
        Command::Serve(a) => serve::serve(a),
        Command::BenchServe(a) => serve::bench_serve(a),
        Command::Kernels {
            precompile: _,
            archs,
        } => precompile_kernels(&archs),
    }
}

/// Runs `load` with a progress bar of layers done, labelled `verb`.
fn with_layer_bar<T>(
    verb: &str,
    load: impl FnOnce(&mut dyn FnMut(usize, usize)) -> Result<T>,
) -> Result<T> {
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(&format!(
            "{verb} {{bar:30}} {{pos}}/{{len}} layers {{elapsed}}"
        ))
        .unwrap(),
    );
    let out = load(&mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    out
}

fn load_model(dir: &Path) -> Result<CpuModel> {
    with_layer_bar("loading", |progress| {
        CpuModel::load(dir, progress).with_context(|| format!("loading {}", dir.display()))
    })
}

/// The backend asked for, or cuda when a GPU is present; says which when it chose.
fn backend(asked: Option<Backend>) -> Result<Backend> {
    if let Some(b) = asked {
        return Ok(b);
    }
    let gpus = Device::count().unwrap_or(0);
    let b = if gpus > 0 {
        Backend::Cuda
    } else {
        Backend::Cpu
    };
    eprintln!(
        "backend: {} ({gpus} CUDA device(s) found; --backend chooses)",
        match b {
            Backend::Cuda => "cuda",
            Backend::Cpu => "cpu",
        }
    );
    Ok(b)
}

/// Loads a checkpoint onto `gpus` GPUs, or onto the fewest visible ones that hold it with
/// `opts`' sequences and positions; the memory plan is printed first, and a model that does
/// not fit is refused before anything is uploaded. `first` is GPU 0 when the caller has
/// opened it.
fn load_gpu_model(
    dir: &Path,
    opts: GpuOptions,
    gpus: Option<Gpus>,
    first: Option<Arc<Device>>,
) -> Result<GpuModel> {
    let start = Instant::now();
    let ck = Checkpoint::open(dir)?;
    let config = ck.config().clone();
    let weights = ModelWeights::load(&ck, |_, _| {})?;
    eprintln!(
        "opened {} in {:.2} s",
        dir.display(),
        start.elapsed().as_secs_f64()
    );
    let visible = Device::count().context("counting CUDA devices")?;
    let first = match first {
        Some(d) => d,
        None => first_device()?,
    };
    let (free, _) = first.memory_info()?;
    let world = match gpus {
        Some(g) => gpu_count(g, visible)?,
        // The fewest that hold it; past the visible count, the plan's error says how many.
        None => (1..=visible)
            .find(|&n| plan_memory(&config, &weights, n, free, opts).is_ok())
            .unwrap_or(visible.max(1)),
    };
    let plan = plan_memory(&config, &weights, world, free, opts)?;
    eprintln!("memory plan: {plan}");
    let devs = open_devices(world, Some(first))?;
    let opts = GpuOptions {
        max_context: Some(plan.capacity),
        ..opts
    };
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "uploading {bar:30} {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} {elapsed}",
        )
        .unwrap(),
    );
    let upload = Instant::now();
    let model = GpuModel::new(config, &weights, &devs, opts, |done, total| {
        bar.set_length(total.max(done));
        bar.set_position(done);
    })
    .with_context(|| format!("loading {} onto the GPU", dir.display()))?;
    let secs = upload.elapsed().as_secs_f64();
    let bytes = bar.position() as f64;
    bar.finish_and_clear();
    eprintln!(
        "uploaded {:.2} GB to {world} GPU(s) in {secs:.2} s ({:.2} GB/s); ready {:.2} s after \
         opening",
        bytes / 1e9,
        bytes / 1e9 / secs,
        start.elapsed().as_secs_f64()
    );
    report_gpu_model(&model);
    Ok(model)
}

/// A model of `config`'s widths with random weights drawn on the GPUs in `format`'s layout.
fn random_gpu_model(
    config: Config,
    format: SynthFormat,
    opts: GpuOptions,
    gpus: Gpus,
    first: Arc<Device>,
) -> Result<GpuModel> {
    let visible = Device::count().context("counting CUDA devices")?;
    let world = gpu_count(gpus, visible)?;
    let plan = plan_random_memory(&config, format, world, first.memory_info()?.0, opts)?;
    eprintln!("memory plan: {plan}");
    let devs = open_devices(world, Some(first))?;
    let t = Instant::now();
    let model = with_layer_bar("drawing", |progress| {
        GpuModel::random(config, format, 0, &devs, opts, progress)
            .context("drawing a random model on the GPU")
    })?;
    eprintln!(
        "random {format:?} weights drawn on {} GPU(s) in {:.1} s",
        devs.len(),
        t.elapsed().as_secs_f64()
    );
    report_gpu_model(&model);
    Ok(model)
}

fn report_gpu_model(model: &GpuModel) {
    eprintln!(
        "{} × {}: context capacity {} tokens, {:.3} GB of weights read per decode step on each",
        model.world(),
        model.device().name(),
        model.capacity(),
        model.step_weight_bytes() as f64 / 1e9
    );
}

/// Streams the tokens `next` yields until EOS or `max` tokens; returns how many it took.
fn stream_tokens(
    tokenizer: &Arc<Tokenizer>,
    eos: &[u32],
    max: usize,
    mut next: impl FnMut(usize) -> Result<u32>,
) -> Result<usize> {
    let mut stream = TextStream::new(tokenizer.clone());
    let mut out = std::io::stdout().lock();
    let mut generated = 0;
    while generated < max {
        let token = next(generated)?;
        generated += 1;
        if eos.contains(&token) {
            break;
        }
        if let Some(text) = stream.push(token)? {
            out.write_all(text.as_bytes())?;
            out.flush()?;
        }
    }
    if let Some(text) = stream.finish()? {
        out.write_all(text.as_bytes())?;
    }
    writeln!(out)?;
    Ok(generated)
}

/// Prompt tokens between progress reports.
const PROMPT_PART: usize = 1024;

/// A progress bar over a prompt's tokens, hidden for prompts of a few parts.
fn prompt_bar(tokens: usize) -> ProgressBar {
    if tokens < 4 * PROMPT_PART {
        return ProgressBar::hidden();
    }
    ProgressBar::new(tokens as u64).with_style(
        ProgressStyle::with_template("prompt {bar:30} {pos}/{len} tokens {per_sec} {elapsed}")
            .unwrap(),
    )
}

fn generate(a: GenerateArgs) -> Result<()> {
    // The config first: a missing directory or a bad config.json is reported as such.
    let cfg = Config::from_dir(&a.model)?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&a.model)?);
    let prompt_ids = if a.chat {
        let mode = if a.thinking {
            ChatMode::Thinking
        } else {
            ChatMode::Chat
        };
        // The template starts with BOS itself.
        tokenizer.encode(&encode_chat(&[Message::user(&a.prompt)], mode), false)?
    } else {
        tokenizer.encode(&a.prompt, true)?
    };
    let needed = prompt_ids.len() + a.max_new_tokens;
    if needed > cfg.max_position_embeddings {
        bail!(
            "prompt ({} tokens) + --max-new-tokens ({}) exceeds the context limit of {} tokens (max_position_embeddings)",
            prompt_ids.len(),
            a.max_new_tokens,
            cfg.max_position_embeddings
        );
    }
    let backend = backend(a.gpu.backend)?;
    if backend == Backend::Cpu
        && (a.no_graph || a.gpu.max_context.is_some() || a.gpu.gpus.is_some())
    {
        bail!("--no-graph, --max-context and --gpus apply to --backend cuda");
    }
    // Checked before anything is loaded.
    if let Some(c) = a.gpu.max_context.filter(|&c| c < needed) {
        bail!(
            "prompt ({} tokens) + --max-new-tokens ({}) exceeds --max-context {c}",
            prompt_ids.len(),
            a.max_new_tokens
        );
    }
    let (prefill_s, t1, generated) = match backend {
        Backend::Cpu => {
            let mut sampler = Sampler::new(a.temperature, a.top_p, a.seed)?;
            let model = load_model(&a.model)?;
            let t0 = Instant::now();
            let mut state = model.new_state();
            // In parts, the same logits as at once, so that a long prompt shows progress.
            let bar = prompt_bar(prompt_ids.len());
            let mut logits = Vec::new();
            for part in prompt_ids.chunks(PROMPT_PART) {
                logits = model.forward(&mut state, part, Logits::Last)?;
                bar.inc(part.len() as u64);
            }
            bar.finish_and_clear();
            let prefill_s = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let mut last = None;
            let generated =
                stream_tokens(&tokenizer, &cfg.eos_token_ids, a.max_new_tokens, |_| {
                    if let Some(t) = last {
                        logits = model.forward(&mut state, &[t], Logits::Last)?;
                    }
                    let t = sampler.sample(&logits);
                    last = Some(t);
                    Ok(t)
                })?;
            (prefill_s, t1, generated)
        }
        Backend::Cuda => {
            let opts = GpuOptions {
                max_context: a.gpu.max_context.or(Some(needed)),
                sequences: 1,
                max_chunk: None,
            };
            let mut model = load_gpu_model(&a.model, opts, a.gpu.gpus, None)?;
            let s = Sampling {
                temperature: a.temperature,
                top_p: a.top_p,
                seed: a.seed,
            };
            let t0 = Instant::now();
            let bar = prompt_bar(prompt_ids.len());
            model.prefill_reporting(0, &prompt_ids, Some(&s), PROMPT_PART, &mut |done| {
                bar.set_position(done as u64)
            })?;
            let first = model.read_token()?;
            bar.finish_and_clear();
            let prefill_s = t0.elapsed().as_secs_f64();
            let graph = if a.no_graph {
                None
            } else {
                Some(DecodeGraph::capture(&mut model, 1)?)
            };
            let t1 = Instant::now();
            let generated = stream_tokens(&tokenizer, &cfg.eos_token_ids, a.max_new_tokens, |i| {
                Ok(match (i, &graph) {
                    (0, _) => first,
                    (_, Some(g)) => g.step(&mut model)?,
                    (_, None) => eager_step(&mut model)?,
                })
            })?;
            (prefill_s, t1, generated)
        }
    };
    let decode_s = t1.elapsed().as_secs_f64();
    eprintln!(
        "prompt {} tokens, time to first token {:.2} s ({:.1} tok/s); generated {} tokens in {:.2} s ({:.2} tok/s)",
        prompt_ids.len(),
        prefill_s,
        prompt_ids.len() as f64 / prefill_s,
        generated,
        decode_s,
        generated as f64 / decode_s
    );
    Ok(())
}

/// Times `steps` decode steps enqueued back to back by `launch`: (device ms per step, host µs
/// per step spent enqueuing).
fn time_decode(
    model: &mut GpuModel,
    steps: usize,
    mut launch: impl FnMut(&mut GpuModel) -> Result<()>,
) -> Result<(f64, f64)> {
    let sync = |m: &GpuModel| -> Result<()> {
        for d in m.devices() {
            d.synchronize()?;
        }
        Ok(())
    };
    sync(model)?;
    let t = Instant::now();
    for _ in 0..steps {
        launch(model)?;
    }
    let host = t.elapsed().as_secs_f64();
    sync(model)?;
    let total = t.elapsed().as_secs_f64();
    Ok((total * 1e3 / steps as f64, host * 1e6 / steps as f64))
}

/// Warp records a timeline keeps for each SM: a 24-layer Flash decode step leaves about 4,000.
const TIMELINE_RECORDS_PER_SM: u32 = 16384;

/// One replay of `graph` on a timeline device, laid out by `dsv4_ops::gpu::timeline` into `path`.
fn write_timeline(model: &mut GpuModel, graph: &DecodeGraph, path: &Path) -> Result<()> {
    use dsv4_ops::gpu::timeline::{between_ends, kernel_names, launches, report};
    let dev = model.device().clone();
    dev.synchronize()?;
    dev.timeline_clear()?;
    graph.replay(model)?;
    let (records, dropped) = dev.timeline_records()?;
    let spans = launches(&records);
    let first = spans.iter().map(|s| s.start).min().unwrap_or(0);
    let last = spans.iter().map(|s| s.end).max().unwrap_or(0);
    let names = kernel_names();
    let gaps = between_ends(&spans, &names, "hc_post_mix");
    let sub_layers = sub_layer_summary(&gaps, &model.config().layers);
    std::fs::write(path, format!("{}\n{sub_layers}", report(&spans, &names)))
        .with_context(|| format!("writing the timeline to {}", path.display()))?;
    print!("{sub_layers}");
    println!(
        "timeline of one decode graph replay: {} launches over {:.1} µs ({} warp records{}) in {}",
        spans.len(),
        (last - first) as f64 / 1e3,
        records.len(),
        if dropped > 0 {
            format!(", {dropped} more dropped: the log was full")
        } else {
            String::new()
        },
        path.display()
    );
    Ok(())
}

/// A layer's path by sub-layer, from `gaps`: the µs between consecutive ends of a step's
/// `hc_post_mix` launches, two a layer (its attention's, then its FFN's). The attention of
/// layer l >= 1 is gap 2l - 1 (layer 0's starts with the step's embedding), its FFN gap 2l:
/// the mean, least and most of each attention kind's and of the FFNs.
fn sub_layer_summary(gaps: &[f64], kinds: &[LayerKind]) -> String {
    if gaps.len() + 1 != 2 * kinds.len() {
        return format!(
            "sub-layers: {} spans between hc_post_mix ends for {} layers ({} expected: two \
             launches a layer)\n",
            gaps.len(),
            kinds.len(),
            (2 * kinds.len()).saturating_sub(1)
        );
    }
    let mut groups: Vec<(String, Vec<f64>)> = Vec::new();
    let mut add = |name: String, v: f64| match groups.iter_mut().find(|(n, _)| *n == name) {
        Some((_, g)) => g.push(v),
        None => groups.push((name, vec![v])),
    };
    for (l, kind) in kinds.iter().enumerate() {
        if l > 0 {
            add(format!("{} attention", kind.name()), gaps[2 * l - 1]);
        }
        add("FFN".into(), gaps[2 * l]);
    }
    let mut out =
        String::from("sub-layers, µs between hc_post_mix ends (mean, least-most, count):\n");
    for (name, g) in groups {
        let (lo, hi) = g
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        out.push_str(&format!(
            "  {name:18} {mean:7.1} ({lo:.1}-{hi:.1}, {})\n",
            g.len()
        ));
    }
    out
}

/// Decode runs of a bench: eager, graph, graph without programmatic launch.
const DECODE_RUNS: usize = 3;

fn bench(a: BenchArgs) -> Result<()> {
    if a.prompt == 0 || a.decode == 0 {
        bail!("--prompt and --decode must be positive");
    }
    let batches: Vec<usize> = (1..)
        .map(|i| 1usize << i)
        .take_while(|&n| n <= a.batch.max(1))
        .collect();
    let needed = a
        .decode
        .checked_mul(DECODE_RUNS)
        .and_then(|d| d.checked_add(batches.len() * (a.decode + 1)))
        .and_then(|d| d.checked_add(a.prompt))
        .and_then(|d| d.checked_add(a.context))
        .and_then(|d| d.checked_add(usize::from(a.timeline.is_some())))
        .context("--context + --prompt + 3 · --decode overflows")?;
    let context = a.max_context.unwrap_or(needed + 1);
    if needed > context {
        bail!(
            "--context {}, --prompt {} and three runs of --decode {} need {needed} positions; --max-context is {context}",
            a.context,
            a.prompt,
            a.decode
        );
    }
    let first = match a.timeline {
        Some(_) => Arc::new(
            Device::with_timeline(0, TIMELINE_RECORDS_PER_SM)
                .context("opening CUDA device 0 with a timeline")?,
        ),
        None => first_device()?,
    };
    // Before the model takes the memory its 2 GiB of buffers need.
    let bw = dsv4_ops::gpu::bandwidth::measure_copy_bandwidth(&first, 1 << 30, 20)?;
    // The buffers' stream-ordered frees return their memory at a synchronization.
    first.synchronize()?;
    let gpus = a.gpus.unwrap_or(Gpus::Count(1));
    let opts = GpuOptions {
        max_context: Some(context),
        sequences: a.batch.max(1),
        max_chunk: a.prefill_chunk,
    };
    let mut model = match &a.model {
        Some(dir) => load_gpu_model(dir, opts, Some(gpus), Some(first))?,
        None => {
            let mut config = a.synth.config();
            match &a.schedule {
                Some(kinds) => {
                    let ratio = |csa: bool| {
                        config
                            .layers
                            .iter()
                            .find(|k| matches!(k, LayerKind::Csa { .. }) == csa && k.ratio() > 0)
                            .map_or(if csa { 4 } else { 128 }, |k| k.ratio())
                    };
                    let (csa, hca) = (ratio(true), ratio(false));
                    config.layers = kinds
                        .iter()
                        .map(|k| match k {
                            LayerChoice::Sliding => LayerKind::Sliding,
                            LayerChoice::Csa => LayerKind::Csa { ratio: csa },
                            LayerChoice::Hca => LayerKind::Hca { ratio: hca },
                        })
                        .collect();
                    config.num_layers = kinds.len();
                }
                None => config = first_layers(config, a.layers)?,
            }
            // Learned routing in every layer (hash layers read one fixed table).
            config.num_hash_layers = 0;
            random_gpu_model(config, a.format.into(), opts, gpus, first)?
        }
    };
    let cfg = model.config().clone();
    let schedule: Vec<&str> = cfg.layers.iter().map(|k| k.name()).collect();
    let dev = model.device().clone();
    let bytes = model.step_weight_bytes() as f64;
    let roofline_ms = bytes / bw.bytes_per_second * 1e3;
    let source = match &a.model {
        Some(dir) => dir.display().to_string(),
        None => format!(
            "random {} weights ({} widths) drawn on the GPU",
            a.format
                .to_possible_value()
                .map_or_else(String::new, |v| v.get_name().to_string()),
            a.synth
                .to_possible_value()
                .map_or_else(String::new, |v| v.get_name().to_string())
        ),
    };
    println!("device: {}", dev.name());
    println!(
        "model: {} · {} layers [{}] · hidden {} · experts {} top-{}",
        source,
        cfg.num_layers,
        schedule.join(", "),
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.experts_per_token
    );
    println!(
        "copy bandwidth {:.0} GB/s; a decode step reads {:.3} GB of weights: roofline {:.3} ms",
        bw.bytes_per_second / 1e9,
        bytes / 1e9,
        roofline_ms
    );
    // Slot k's prompt: its own tokens, so that a batch's sequences route as different ones do.
    let prompt_of = |k: u64| -> Vec<u32> {
        (0..a.prompt as u64)
            .map(|i| ((i * 7919 + 13 + k * 104_729) % cfg.vocab_size as u64) as u32)
            .collect()
    };
    let prompt = prompt_of(0);
    let s = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
    };
    if a.context > 0 {
        let t = Instant::now();
        model.fill_context(a.context, 1)?;
        model.device().synchronize()?;
        println!(
            "context: {} positions of random sequence state (filled, not prefilled) in {:.2} s",
            a.context,
            t.elapsed().as_secs_f64()
        );
    }
    let t = Instant::now();
    model.device().profile(a.profile == Phase::Prefill)?;
    model.prefill(&prompt, &s)?;
    model.read_token()?;
    model.device().profile(false)?;
    let prefill_s = t.elapsed().as_secs_f64();
    println!(
        "prefill: {} tokens in {:.3} s, {:.1} tok/s (chunks of {})",
        a.prompt,
        prefill_s,
        a.prompt as f64 / prefill_s,
        model.chunk()
    );
    let (eager_ms, eager_host) = time_decode(&mut model, a.decode, |m| Ok(eager_launch(m, 1)?))?;
    let t = Instant::now();
    let graph = DecodeGraph::capture(&mut model, 1)?;
    let capture_ms = t.elapsed().as_secs_f64() * 1e3;
    model.device().profile(a.profile == Phase::Decode)?;
    let (graph_ms, graph_host) = time_decode(&mut model, a.decode, |m| Ok(graph.replay(m)?))?;
    model.device().profile(false)?;
    if let Some(path) = &a.timeline {
        write_timeline(&mut model, &graph, path)?;
    }
    let pdl = &dsv4_ops::gpu::gemv::tuning::PROGRAMMATIC_LAUNCH;
    pdl.set(false);
    let plain = DecodeGraph::capture(&mut model, 1);
    pdl.set(true);
    let plain = plain?;
    let (plain_ms, _) = time_decode(&mut model, a.decode, |m| Ok(plain.replay(m)?))?;
    let pct = |ms: f64| roofline_ms / ms * 100.0;
    println!(
        "decode eager: {eager_ms:.3} ms/token ({:.1}% of roofline), host {eager_host:.1} µs/step",
        pct(eager_ms)
    );
    println!(
        "decode graph: {graph_ms:.3} ms/token ({:.1}% of roofline), host {graph_host:.1} µs/step, \
         {} nodes per step, captured and instantiated in {capture_ms:.1} ms",
        pct(graph_ms),
        graph.nodes()
    );
    println!(
        "decode graph without programmatic launch: {plain_ms:.3} ms/token ({:.1}% of roofline)",
        pct(plain_ms)
    );
    // Batches: every slot past 0 reads a prompt of its own; each size's first step runs
    // eagerly.
    for &n in &batches {
        for slot in n / 2..n {
            model.reset_slot(slot)?;
            model.prefill_slot(slot, &prompt_of(slot as u64), Some(&s))?;
        }
        eager_launch(&mut model, n)?;
        let g = DecodeGraph::capture(&mut model, n)?;
        let profiled = a.profile == Phase::Batch && Some(&n) == batches.last();
        model.device().profile(profiled)?;
        let (ms, host) = time_decode(&mut model, a.decode, |m| Ok(g.replay(m)?))?;
        model.device().profile(false)?;
        println!(
            "decode graph, {n} sequences: {ms:.3} ms/step, {:.1} tok/s ({:.2}× one sequence's), \
             host {host:.1} µs/step, {} nodes per step",
            n as f64 * 1e3 / ms,
            n as f64 * graph_ms / ms,
            g.nodes()
        );
    }
    if let Some(us) = time_all_reduce(&mut model, 100)? {
        println!(
            "all-reduce of one token's hidden row ({} KB) over {} GPUs in a graph: {us:.2} µs; \
             two a layer: {:.1} µs a layer, {:.3} ms a step",
            cfg.hidden_size * 4 / 1024,
            model.world(),
            2.0 * us,
            2.0 * us * cfg.num_layers as f64 / 1e3
        );
    }
    Ok(())
}

fn read_ids(path: &Path) -> Result<Vec<u32>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .with_context(|| format!("{}: `{s}` is not a token id", path.display()))
        })
        .collect()
}

fn logits(a: LogitsArgs) -> Result<()> {
    let ids = read_ids(&a.input_ids)?;
    if ids.is_empty() {
        bail!("{}: no token ids", a.input_ids.display());
    }
    let chunks = a.chunks.unwrap_or_else(|| vec![ids.len()]);
    let prefill: usize = chunks.iter().sum();
    if prefill > ids.len() || chunks.contains(&0) {
        bail!(
            "--chunks {chunks:?} must be positive and sum to at most the {} input tokens",
            ids.len()
        );
    }
    let lengths: Vec<usize> = chunks
        .into_iter()
        .chain(std::iter::repeat_n(1, ids.len() - prefill))
        .collect();
    let backend = backend(a.gpu.backend)?;
    if backend == Backend::Cpu && (a.gpu.max_context.is_some() || a.gpu.gpus.is_some()) {
        bail!("--max-context and --gpus apply to --backend cuda");
    }
    let (all, vocab) = match backend {
        Backend::Cpu => {
            let model = load_model(&a.model)?;
            let mut state = model.new_state();
            let mut all = Vec::with_capacity(ids.len() * model.config().vocab_size);
            let mut start = 0;
            for len in lengths {
                all.extend(model.forward(&mut state, &ids[start..start + len], Logits::All)?);
                start += len;
            }
            (all, model.config().vocab_size)
        }
        Backend::Cuda => {
            let opts = GpuOptions {
                max_context: a.gpu.max_context.or(Some(ids.len())),
                sequences: 1,
                max_chunk: None,
            };
            let mut model = load_gpu_model(&a.model, opts, a.gpu.gpus, None)?;
            let mut all = Vec::with_capacity(ids.len() * model.config().vocab_size);
            let mut start = 0;
            for len in lengths {
                all.extend(model.forward(&ids[start..start + len], Logits::All)?);
                start += len;
            }
            (all, model.config().vocab_size)
        }
    };
    let shape = vec![ids.len(), vocab];
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::F32,
        shape,
        bytemuck::cast_slice(&all),
    )?;
    safetensors::serialize_to_file([("logits", view)], None, &a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "wrote logits [{}, {vocab}] to {}",
        ids.len(),
        a.out.display()
    );
    Ok(())
}

fn info(dir: &Path) -> Result<()> {
    let ck = Checkpoint::open(dir)?;
    let c = ck.config().clone();
    let weights = ModelWeights::load(&ck, |_, _| {})?;
    println!("model: {}", dir.display());
    println!(
        "hidden {} · layers {} · heads {}×{} (rope {}) · experts {} (top-{}, inter {}) · vocab {}",
        c.hidden_size,
        c.num_layers,
        c.num_heads,
        c.head_dim,
        c.rope_dim,
        c.n_routed_experts,
        c.experts_per_token,
        c.moe_intermediate_size,
        c.vocab_size
    );
    println!("layer schedule:");
    for (l, kind) in c.layers.iter().enumerate() {
        let routing = if c.is_hash_layer(l) {
            "hash"
        } else {
            "learned"
        };
        let ratio = if kind.ratio() > 0 {
            format!(" m={}", kind.ratio())
        } else {
            String::new()
        };
        println!("  {l:>3}: {}{ratio}, {routing} routing", kind.name());
    }
    println!("tensor formats:");
    let summary = ck.summary();
    println!(
        "  {} key names, {} shard(s), {} MTP tensors skipped",
        summary.naming.describe(),
        summary.shards,
        summary.skipped_mtp
    );
    for (format, s) in &summary.formats {
        println!(
            "  {format:<26} {:>7} tensors {:>16} params {:>10.3} GB",
            s.tensors,
            s.params,
            s.bytes as f64 / 1e9
        );
    }
    let p = c.parameter_count();
    println!(
        "parameters: {:.3} B total ({:.3} B attention, {:.3} B routed experts, {:.3} B shared experts, {:.3} B other); {:.3} B active per token",
        p.total() as f64 / 1e9,
        p.attention as f64 / 1e9,
        p.routed_experts as f64 / 1e9,
        p.shared_experts as f64 / 1e9,
        p.other as f64 / 1e9,
        (p.attention + p.active_routed_experts + p.shared_experts + p.other - c.vocab_size * c.hidden_size) as f64 / 1e9
    );
    let per_token = weights.decode_bytes_per_token(&c);
    println!(
        "weight bytes read per decoded token: {:.3} GB",
        per_token as f64 / 1e9
    );
    Ok(())
}

fn synth(a: SynthArgs) -> Result<()> {
    let mut config = a.preset.config();
    if let Some(n) = a.layers {
        config = first_layers(config, n)?;
    }
    let format = a.format.into();
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("writing {bar:30} {bytes}/{total_bytes} {elapsed}").unwrap(),
    );
    let written = write_synthetic(&config, format, &a.out, a.seed, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    eprintln!(
        "wrote a {:.3} GB synthetic checkpoint to {}",
        written as f64 / 1e9,
        a.out.display()
    );
    Ok(())
}

fn precompile_kernels(archs: &[String]) -> Result<()> {
    let cache = dsv4_kernels::KernelCache::from_env()?;
    for name in archs {
        let arch = dsv4_kernels::Arch::parse(name)?;
        let report = dsv4_kernels::precompile(arch, &cache)?;
        let (major, minor) = report.nvrtc_version;
        println!(
            "{arch}: NVRTC {major}.{minor}, cache {}",
            report.cache_dir.display()
        );
        let (mut cold, mut warm) = (0.0, 0.0);
        for f in &report.families {
            println!(
                "  {:<16} cold {:>9.2} ms  warm {:>7.3} ms  {:>8} bytes",
                f.family,
                f.cold.as_secs_f64() * 1e3,
                f.warm.as_secs_f64() * 1e3,
                f.image_bytes
            );
            cold += f.cold.as_secs_f64();
            warm += f.warm.as_secs_f64();
        }
        println!(
            "  all families     cold {:>9.2} ms  warm {:>7.3} ms",
            cold * 1e3,
            warm * 1e3
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_layers_group_by_attention_kind_and_ffn() {
        let kinds = [
            LayerKind::Sliding,
            LayerKind::Csa { ratio: 4 },
            LayerKind::Hca { ratio: 128 },
        ];
        // Layer 0's FFN 50, layer 1's attention 80 and FFN 52, layer 2's attention 60 and FFN 54.
        let out = sub_layer_summary(&[50.0, 80.0, 52.0, 60.0, 54.0], &kinds);
        assert!(
            out.contains("FFN                   52.0 (50.0-54.0, 3)"),
            "{out}"
        );
        assert!(
            out.contains("csa attention         80.0 (80.0-80.0, 1)"),
            "{out}"
        );
        assert!(
            out.contains("hca attention         60.0 (60.0-60.0, 1)"),
            "{out}"
        );
        assert!(!out.contains("sliding"), "{out}");
        let out = sub_layer_summary(&[50.0, 80.0], &kinds);
        assert!(
            out.contains("2 spans between hc_post_mix ends for 3 layers (5 expected"),
            "{out}"
        );
        let out = sub_layer_summary(&[], &kinds);
        assert!(
            out.contains("0 spans between hc_post_mix ends for 3 layers"),
            "{out}"
        );
    }

    #[test]
    fn gpu_counts_past_the_visible_ones_are_refused_naming_both() {
        assert_eq!(gpu_count(Gpus::Count(2), 4).unwrap(), 2);
        assert_eq!(gpu_count(Gpus::All, 4).unwrap(), 4);
        let err = gpu_count(Gpus::Count(3), 2).unwrap_err().to_string();
        assert!(
            err.contains("--gpus 3: 2 CUDA device(s) are visible"),
            "{err}"
        );
        let err = gpu_count(Gpus::All, 0).unwrap_err().to_string();
        assert!(err.contains("0 CUDA device(s) are visible"), "{err}");
    }
}
