//! `dsv4 serve`: an OpenAI-compatible HTTP server (chat completions, completions, models,
//! health, Prometheus metrics; Server-Sent Events when streaming). Requests wait in a bounded
//! queue for the one engine thread that owns the model, which generates up to `--max-batch`
//! sequences at once.

mod api;
mod engine;
mod load;
mod metrics;
mod stop;
mod text;

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use axum::body::{to_bytes, Body};
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc::unbounded_channel;
use tokio_stream::wrappers::UnboundedReceiverStream;

use dsv4_model::chat::{encode_chat, THINK_END, THINK_START};
use dsv4_model::config::Config;
use dsv4_model::gpu::{GpuOptions, MAX_CHUNK};
use dsv4_model::tokenizer::Tokenizer;
use dsv4_ops::gpu::sample::Sampling;

use api::{ApiError, Prompt};
use engine::{Event, Job, TextEnd};
pub use load::{bench_serve, LoadArgs};
use metrics::Metrics;
use text::{Output, TextStage};

use crate::{backend, load_gpu_model, load_model, Backend, GpuArgs};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 takes a free port (the address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[command(flatten)]
    gpu: GpuArgs,
    /// Sequences generated at once, each advancing a token a step (on the GPU, at most 16:
    /// one step decodes them all in one graph replay).
    #[arg(long, default_value_t = 1)]
    max_batch: usize,
    /// Requests that may wait for the engine; past that the server answers 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// The model name requests must give (default: the checkpoint directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Largest request body, in bytes (413 past it).
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// Longest prompt chunk an engine step reads on the GPU (rounded down to a power of two):
    /// a longer one reads a long prompt in fewer steps, but each such step delays the running
    /// streams' next tokens longer.
    #[arg(long, default_value_t = 2048)]
    prefill_chunk: usize,
}

struct AppState {
    jobs: SyncSender<Job>,
    tokenizer: Arc<Tokenizer>,
    /// The end-of-thinking token, when the vocabulary has it as one token.
    think_end: Option<u32>,
    name: String,
    capacity: usize,
    max_body: usize,
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let cfg = Config::from_dir(&a.model)?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&a.model)?);
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        a.model
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "dsv4".to_string())
    });
    let chosen = backend(a.gpu.backend)?;
    if a.max_batch == 0 || (chosen == Backend::Cuda && a.max_batch > MAX_CHUNK) {
        bail!(
            "--max-batch {}: at least 1, and at most {MAX_CHUNK} sequences at once on the GPU",
            a.max_batch
        );
    }
    if chosen == Backend::Cpu && a.gpu.gpus.is_some() {
        bail!("--gpus applies to --backend cuda");
    }
    if let Some(c) = a.gpu.max_context {
        if c == 0 || c > cfg.max_position_embeddings {
            bail!(
                "--max-context {c}: at least 1 and at most the model's {} positions",
                cfg.max_position_embeddings
            );
        }
    }
    let think_end = match tokenizer.encode(THINK_END, false)?.as_slice() {
        [id] => Some(*id),
        _ => None,
    };
    let metrics = Arc::new(Metrics::default());
    // Requests reach the engine between its steps: besides the waiting room, room for those that
    // a step boundary admits into the batch's other slots.
    let (jobs, queue) = sync_channel::<Job>(a.max_queue + a.max_batch - 1);
    let (ready_tx, ready) = std::sync::mpsc::channel::<Result<usize>>();
    // The model lives on the engine thread (GPU state stays on the thread that made it).
    let engine = {
        let (metrics, dir, gpu) = (metrics.clone(), a.model.clone(), a.gpu);
        let eos = cfg.eos_token_ids.clone();
        let max_positions = cfg.max_position_embeddings;
        let max_batch = a.max_batch;
        let prefill_chunk = a.prefill_chunk;
        std::thread::spawn(move || {
            let loaded: Result<Box<dyn engine::Backend>> = match chosen {
                Backend::Cpu => load_model(&dir).map(|model| {
                    let capacity = gpu.max_context.unwrap_or(max_positions);
                    Box::new(engine::Cpu::new(model, capacity, max_batch))
                        as Box<dyn engine::Backend>
                }),
                Backend::Cuda => {
                    // By default 64k positions in all, shared by the slots.
                    let shared = max_positions.min(1 << 16) / max_batch;
                    let opts = GpuOptions {
                        max_context: gpu.max_context.or(Some(shared)),
                        sequences: max_batch,
                        max_chunk: Some(prefill_chunk),
                    };
                    load_gpu_model(&dir, opts, gpu.gpus, None)
                        .map(|model| Box::new(engine::Gpu::new(model)) as Box<dyn engine::Backend>)
                }
            };
            match loaded {
                Ok(b) => {
                    // Up before the server answers /health.
                    metrics.alive.store(true, Ordering::Relaxed);
                    let _ = ready_tx.send(Ok(b.capacity()));
                    engine::run(b, &eos, queue, metrics);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
    };
    let capacity = ready
        .recv()
        .context("the engine thread ended while loading")??;
    let state = Arc::new(AppState {
        jobs,
        tokenizer,
        think_end,
        name,
        capacity,
        max_body: a.max_body,
        metrics,
        next_id: AtomicU64::new(1),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(state.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("binding {}:{}", a.host, a.port))?;
        eprintln!(
            "dsv4 serve: `{}` on http://{} ({} positions a sequence)",
            state.name,
            listener.local_addr()?,
            capacity
        );
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown(state.metrics.clone()))
            .await
            .context("serving")
    })?;
    // Every handler is gone: the queue closes and the engine ends after its current request.
    drop(state);
    engine
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    eprintln!("dsv4 serve: stopped");
    Ok(())
}

/// SIGTERM or Ctrl-C: the engine cuts the running request short and refuses the waiting ones,
/// so open streams end and the server exits; a second signal exits at once.
async fn shutdown(metrics: Arc<Metrics>) {
    let signal = || async {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
    };
    signal().await;
    eprintln!("dsv4 serve: shutting down");
    metrics.stopping.store(true, Ordering::Relaxed);
    tokio::spawn(async move {
        signal().await;
        eprintln!("dsv4 serve: stopped at a second signal");
        std::process::exit(130);
    });
}

/// A path the server does not serve, answered in the API's error shape.
async fn no_route(uri: Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no route {}", uri.path()))
}

/// A served path asked with another method, answered in the API's error shape.
async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    let message = format!("{method} is not served at {}", uri.path());
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, message)
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    if s.metrics.alive.load(Ordering::Relaxed) {
        "ok".into_response()
    } else {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped").into_response()
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    s.metrics.count_request("/v1/models", 200);
    Json(json!({"object": "list", "data": [{
        "id": s.name, "object": "model", "created": now(), "owned_by": "dsv4",
        "max_model_len": s.capacity,
    }]}))
}

async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn chat(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    respond(s, "/v1/chat/completions", headers, body, true).await
}

async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    respond(s, "/v1/completions", headers, body, false).await
}

async fn respond(
    s: Arc<AppState>,
    endpoint: &str,
    headers: HeaderMap,
    body: Body,
    chat: bool,
) -> Response {
    let r = match start(&s, &headers, body, chat).await {
        Ok(r) => r,
        Err(e) => {
            s.metrics.count_request(endpoint, e.status.as_u16());
            return e.into_response();
        }
    };
    s.metrics.count_request(endpoint, 200);
    r
}

/// Validates the request, queues its job and answers with its stream or its whole text.
async fn start(
    s: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    chat: bool,
) -> Result<Response, ApiError> {
    let json_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        });
    if !json_type {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "the body must be JSON: Content-Type: application/json",
        ));
    }
    let bytes = to_bytes(body, s.max_body).await.map_err(|e| {
        if e.to_string().contains("length limit") {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is over {} bytes", s.max_body),
            )
        } else {
            ApiError::new(StatusCode::BAD_REQUEST, format!("reading the body: {e}"))
        }
    })?;
    let req = api::parse(&bytes, &s.name, chat)?;
    let (prompt, thinking) = match &req.prompt {
        Prompt::Chat { messages, mode } => {
            let text = encode_chat(messages, *mode);
            // The output starts inside the reasoning when the template opened it.
            (
                s.tokenizer.encode(&text, false),
                text.ends_with(THINK_START),
            )
        }
        Prompt::Text(t) => (s.tokenizer.encode(t, true), false),
    };
    let prompt = prompt.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("tokenizing the prompt: {e}"),
        )
    })?;
    let p = &req.params;
    let room = s.capacity.saturating_sub(prompt.len());
    let max_tokens = p.max_tokens.unwrap_or(room);
    if room == 0 || max_tokens > room {
        let param = if chat { "messages" } else { "prompt" };
        return Err(ApiError::bad(
            param,
            format!(
                "the prompt ({} tokens) and max_tokens ({max_tokens}) exceed the context limit of {} tokens",
                prompt.len(),
                s.capacity
            ),
        ));
    }
    let (tx, rx) = unbounded_channel();
    let prompt_len = prompt.len();
    let text_end = Arc::new(TextEnd::default());
    let stage = TextStage::new(
        s.tokenizer.clone(),
        s.think_end,
        p.stops.clone(),
        thinking,
        prompt_len,
        text_end.clone(),
    );
    let job = Job {
        prompt,
        max_tokens,
        sampling: Sampling {
            temperature: p.temperature,
            top_p: p.top_p,
            seed: p.seed,
        },
        events: tx,
        text_end,
    };
    s.metrics.queued.fetch_add(1, Ordering::Relaxed);
    match s.jobs.try_send(job) {
        Ok(()) => {}
        Err(e) => {
            s.metrics.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(match e {
                TrySendError::Full(_) => ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "the request queue is full; retry later",
                ),
                TrySendError::Disconnected(_) => {
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")
                }
            });
        }
    }
    let id = format!(
        "{}-{}",
        if chat { "chatcmpl" } else { "cmpl" },
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let shape = Shape {
        id,
        model: s.name.clone(),
        created: now(),
        chat,
        thinking,
    };
    if p.stream {
        Ok(stream(shape, rx, stage, p.include_usage).into_response())
    } else {
        whole(shape, rx, stage, prompt_len).await
    }
}

/// What every response object of a request repeats.
struct Shape {
    id: String,
    model: String,
    created: u64,
    chat: bool,
    thinking: bool,
}

impl Shape {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    fn wrap(&self, chunk: bool, choices: Value, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id, "object": self.object(chunk), "created": self.created,
            "model": self.model, "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    /// One streamed choice: a delta of text (and reasoning), or the finish.
    fn chunk_choice(
        &self,
        content: &str,
        reasoning: &str,
        first: bool,
        finish: Option<&str>,
    ) -> Value {
        if self.chat {
            let mut delta = json!({});
            if first {
                delta["role"] = json!("assistant");
            }
            if !content.is_empty() || (first && !self.thinking) {
                delta["content"] = json!(content);
            }
            if !reasoning.is_empty() {
                delta["reasoning_content"] = json!(reasoning);
            }
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}])
        } else {
            json!([{"index": 0, "text": content, "logprobs": null, "finish_reason": finish}])
        }
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Collects the whole text, then answers once.
async fn whole(
    shape: Shape,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    mut stage: TextStage,
    prompt_len: usize,
) -> Result<Response, ApiError> {
    let (mut content, mut reasoning) = (String::new(), String::new());
    while let Some(ev) = rx.recv().await {
        for out in stage.take(ev) {
            match out {
                Output::Text {
                    content: c,
                    reasoning: r,
                } => {
                    content.push_str(&c);
                    reasoning.push_str(&r);
                }
                Output::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                } => {
                    let choice = if shape.chat {
                        let mut message = json!({"role": "assistant", "content": content});
                        if shape.thinking {
                            message["reasoning_content"] = json!(reasoning);
                        }
                        json!([{"index": 0, "message": message, "logprobs": null, "finish_reason": finish.as_str()}])
                    } else {
                        json!([{"index": 0, "text": content, "logprobs": null, "finish_reason": finish.as_str()}])
                    };
                    let body =
                        shape.wrap(false, choice, Some(usage(prompt_tokens, completion_tokens)));
                    return Ok(Json(body).into_response());
                }
                Output::Failed(e) => {
                    return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e))
                }
            }
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("the engine dropped the request (prompt of {prompt_len} tokens)"),
    ))
}

/// Server-Sent Events in OpenAI's chunk format, `data: [DONE]` last. The text is made by a task
/// of its own as the tokens come, however fast the client reads, so a stop string ends the
/// sequence at once. Dropping the stream (the client went away) ends that task, which closes
/// the job's channel and so cancels it.
fn stream(
    shape: Shape,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    mut stage: TextStage,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let (out_tx, out_rx) = unbounded_channel();
    tokio::spawn(async move {
        loop {
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                () = out_tx.closed() => None,
            };
            let Some(ev) = ev else { return };
            for out in stage.take(ev) {
                if out_tx.send(out).is_err() {
                    return;
                }
            }
        }
    });
    let mut first = true;
    let events = UnboundedReceiverStream::new(out_rx).flat_map(move |out| {
        let data: Vec<String> = match out {
            Output::Text { content, reasoning } => {
                let v = shape.wrap(true, shape.chunk_choice(&content, &reasoning, first, None), None);
                first = false;
                vec![v.to_string()]
            }
            Output::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                let mut out = vec![shape
                    .wrap(true, shape.chunk_choice("", "", first, Some(finish.as_str())), None)
                    .to_string()];
                if include_usage {
                    out.push(
                        shape
                            .wrap(true, json!([]), Some(usage(prompt_tokens, completion_tokens)))
                            .to_string(),
                    );
                }
                out.push("[DONE]".to_string());
                out
            }
            Output::Failed(e) => vec![
                json!({"error": {"message": e, "type": "server_error", "param": null, "code": null}}).to_string(),
                "[DONE]".to_string(),
            ],
        };
        stream::iter(data.into_iter().map(|d| Ok(SseEvent::default().data(d))))
    });
    Sse::new(events)
}
