//! `dsv4 serve` on the CPU backend with a tiny synthetic checkpoint, driven over HTTP (and by
//! the official `openai` Python client when it is installed: `.ci/run` installs it and sets
//! DSV4_REQUIRE_OPENAI=1). The `gpu_` test runs the same batch on the GPU backend
//! (`#[ignore]`d: it needs a CUDA GPU and the `dsv4` binary this test was built beside).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dsv4_model::config::Config;
use dsv4_model::synth::{write_synthetic, SynthFormat};
use serde_json::{json, Value};

const MODEL: &str = "tiny";

/// One tiny checkpoint for every test of this file.
fn checkpoint() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        write_synthetic(
            &Config::tiny(),
            SynthFormat::Official,
            dir.path(),
            3,
            &mut |_, _| {},
        )
        .unwrap();
        dir
    })
    .path()
}

/// The HTTP side of a running server.
#[derive(Clone)]
struct Api {
    url: String,
}

struct Server {
    child: Child,
    api: Api,
}

impl std::ops::Deref for Server {
    type Target = Api;

    fn deref(&self) -> &Api {
        &self.api
    }
}

impl Server {
    /// On the CPU backend.
    fn start(extra: &[&str]) -> Server {
        Server::start_on("cpu", extra)
    }

    fn start_on(backend: &str, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dsv4"))
            .args([
                "serve",
                "--backend",
                backend,
                "--port",
                "0",
                "--served-model-name",
                MODEL,
            ])
            .arg("--model")
            .arg(checkpoint())
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let url = loop {
            let line = lines
                .next()
                .expect("the server printed its address")
                .unwrap();
            if let Some(rest) = line.split(" on http://").nth(1) {
                break format!("http://{}", rest.split(' ').next().unwrap());
            }
        };
        // Keep draining the server's log so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines.by_ref() {});
        Server {
            child,
            api: Api { url },
        }
    }
}

impl Api {
    fn agent() -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into()
    }

    /// POSTs `body` (raw) with `content_type`: (status, body as JSON or text).
    fn post_raw(&self, path: &str, content_type: &str, body: &str) -> (u16, String) {
        let mut r = Self::agent()
            .post(&format!("{}{path}", self.url))
            .header("Content-Type", content_type)
            .send(body)
            .unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.post_raw(path, "application/json", &body.to_string());
        (
            status,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
        )
    }

    fn get(&self, path: &str) -> (u16, String) {
        let mut r = Self::agent()
            .get(&format!("{}{path}", self.url))
            .call()
            .unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    /// A streaming request's `data:` payloads, in order, up to and including `[DONE]`.
    fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let r = Self::agent()
            .post(&format!("{}{path}", self.url))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let ct = r
            .headers()
            .get("content-type")
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        let mut out = Vec::new();
        for line in BufReader::new(r.into_body().into_reader()).lines() {
            let line = line.unwrap();
            if let Some(data) = line.strip_prefix("data: ") {
                out.push(data.to_string());
                if data == "[DONE]" {
                    break;
                }
            } else {
                assert!(line.is_empty(), "unexpected SSE line {line:?}");
            }
        }
        out
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("{name} not in {text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chat(content: &str, extra: Value) -> Value {
    let mut v = json!({"model": MODEL, "messages": [{"role": "user", "content": content}]});
    v.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    v
}

fn completion(prompt: &str, extra: Value) -> Value {
    let mut v = json!({"model": MODEL, "prompt": prompt});
    v.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    v
}

/// The streamed chunks' text (`delta.content` or `text`), the finish reason and the usage.
fn collect(chunks: &[String]) -> (String, String, Option<Value>) {
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
    let (mut text, mut finish, mut usage) = (String::new(), String::new(), None);
    for c in &chunks[..chunks.len() - 1] {
        let v: Value = serde_json::from_str(c).unwrap();
        assert!(
            v["id"].is_string() && v["created"].is_u64() && v["model"] == MODEL,
            "{v}"
        );
        if let Some(u) = v.get("usage") {
            usage = Some(u.clone());
            assert_eq!(v["choices"], json!([]));
            continue;
        }
        let choice = &v["choices"][0];
        let piece = choice["delta"]["content"]
            .as_str()
            .or(choice["text"].as_str());
        text.push_str(piece.unwrap_or(""));
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish, usage)
}

#[test]
fn serves_chat_and_completions_streaming_or_whole() {
    let s = Server::start(&[]);
    assert_eq!(s.get("/health").0, 200);
    let (status, models) = s.get("/v1/models");
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!((status, &models["data"][0]["id"]), (200, &json!(MODEL)));

    // Greedy: the whole answer and the streamed one are the same text.
    let greedy = json!({"max_tokens": 12, "temperature": 0});
    let (status, whole) = s.post("/v1/chat/completions", &chat("Hello there", greedy.clone()));
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    let msg = &whole["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant");
    let text = msg["content"].as_str().unwrap().to_string();
    assert_eq!(whole["usage"]["completion_tokens"], 12);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    let mut streamed = chat("Hello there", greedy.clone());
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = s.stream("/v1/chat/completions", &streamed);
    let first: Value = serde_json::from_str(&chunks[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (stext, finish, usage) = collect(&chunks);
    assert_eq!((stext.as_str(), finish.as_str()), (text.as_str(), "length"));
    assert_eq!(usage.unwrap(), whole["usage"]);

    // Completions, whole and streamed.
    let (status, c) = s.post("/v1/completions", &completion("Once upon", greedy.clone()));
    assert_eq!(
        (status, c["object"].as_str()),
        (200, Some("text_completion"))
    );
    let ctext = c["choices"][0]["text"].as_str().unwrap().to_string();
    let mut cs = completion("Once upon", greedy.clone());
    cs["stream"] = json!(true);
    let (stext, finish, usage) = collect(&s.stream("/v1/completions", &cs));
    assert_eq!(
        (stext, finish.as_str(), usage),
        (ctext.clone(), "length", None)
    );

    // A stop string taken from the greedy text: the text before it, finish "stop".
    let chars: Vec<char> = ctext.chars().collect();
    assert!(chars.len() >= 6, "greedy text {ctext:?}");
    let stop: String = chars[3..5].iter().collect();
    let at = ctext.find(&stop).unwrap();
    let (_, c) = s.post(
        "/v1/completions",
        &completion(
            "Once upon",
            json!({"max_tokens": 12, "temperature": 0, "stop": [stop]}),
        ),
    );
    assert_eq!(c["choices"][0]["text"].as_str().unwrap(), &ctext[..at]);
    assert_eq!(c["choices"][0]["finish_reason"], "stop");
    // Streamed alike, the usage counting the tokens up to the stop string.
    let body = json!({"max_tokens": 12, "temperature": 0, "stop": [stop], "stream": true,
                      "stream_options": {"include_usage": true}});
    let (stext, finish, usage) =
        collect(&s.stream("/v1/completions", &completion("Once upon", body)));
    assert_eq!((stext.as_str(), finish.as_str()), (&ctext[..at], "stop"));
    let used = usage.expect("usage")["completion_tokens"].as_u64().unwrap();
    assert!((1..12).contains(&used), "{used} completion tokens");

    // The same seed gives the same sample; thinking mode answers with reasoning_content.
    let sampled = json!({"max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 42});
    let a = s
        .post("/v1/completions", &completion("Seeded", sampled.clone()))
        .1;
    let b = s.post("/v1/completions", &completion("Seeded", sampled)).1;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let think = chat(
        "Think",
        json!({"max_tokens": 6, "temperature": 0, "chat_template_kwargs": {"thinking": true}}),
    );
    let (status, t) = s.post("/v1/chat/completions", &think);
    assert_eq!(status, 200);
    let m = &t["choices"][0]["message"];
    assert!(
        m["reasoning_content"].is_string() && m["content"].is_string(),
        "{t}"
    );

    assert!(
        s.metric("dsv4_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}") >= 3.0
    );
    assert!(s.metric("dsv4_generation_tokens_total") >= 60.0);
    assert!(s.metric("dsv4_time_to_first_token_seconds_count") >= 8.0);
    // Every decode step's host time is observed, each launch of a next step's gap too.
    let steps = s.metric("dsv4_decode_step_host_seconds_count");
    let host = s.metric("dsv4_decode_step_host_seconds_sum") / steps;
    assert!(
        steps >= 10.0 && host > 0.0 && host < 1.0,
        "{steps} steps, {host} s each"
    );
    let gaps = s.metric("dsv4_decode_launch_gap_seconds_count");
    assert!(
        gaps >= 1.0 && gaps <= steps,
        "{gaps} launch gaps for {steps} steps"
    );
    // The request a stop string ended finished; no client left.
    assert_eq!(s.metric("dsv4_requests_cancelled_total"), 0.0);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let s = Server::start(&["--max-body", "4096", "--max-context", "64"]);
    let good = completion("Hi", json!({"max_tokens": 2}));
    let limit = 64;
    let cases: Vec<(&str, String, &str, u16, &str)> = vec![
        (
            "/v1/completions",
            "{not json".into(),
            "application/json",
            400,
            "not valid JSON",
        ),
        (
            "/v1/completions",
            good.to_string(),
            "text/plain",
            400,
            "application/json",
        ),
        (
            "/v1/completions",
            completion("Hi", json!({"model": "gpt-4"})).to_string(),
            "application/json",
            400,
            "unknown model",
        ),
        (
            "/v1/completions",
            completion("Hi", json!({"max_tokens": -3})).to_string(),
            "application/json",
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            completion("Hi", json!({"temperature": "hot"})).to_string(),
            "application/json",
            400,
            "temperature",
        ),
        (
            "/v1/completions",
            completion("Hi", json!({"temperature": 9})).to_string(),
            "application/json",
            400,
            "temperature",
        ),
        (
            "/v1/completions",
            completion("Hi", json!({"temperature": "NaN"})).to_string(),
            "application/json",
            400,
            "temperature",
        ),
        (
            "/v1/completions",
            r#"{"model": "tiny", "prompt": "Hi", "temperature": NaN}"#.into(),
            "application/json",
            400,
            "not valid JSON",
        ),
        (
            "/v1/chat/completions",
            chat("Hi", json!({"n": 2})).to_string(),
            "application/json",
            400,
            "`n`",
        ),
        (
            "/v1/chat/completions",
            chat("Hi", json!({"temprature": 0.5})).to_string(),
            "application/json",
            400,
            "unknown field `temprature`",
        ),
        (
            "/v1/chat/completions",
            chat("Hi", json!({"prompt": "Hi"})).to_string(),
            "application/json",
            400,
            "unknown field `prompt`",
        ),
        (
            "/v1/completions",
            completion("Hi", json!({"frequency_penalty": 0.5})).to_string(),
            "application/json",
            400,
            "`frequency_penalty` = 0.5 is not supported",
        ),
        (
            "/v1/chat/completions",
            chat("Hi", json!({"logprobs": true})).to_string(),
            "application/json",
            400,
            "`logprobs` = true is not supported",
        ),
        (
            "/v1/completions",
            completion("Hi", json!({"top_k": 5})).to_string(),
            "application/json",
            400,
            "`top_k` = 5 is not supported",
        ),
        (
            "/v1/completions",
            completion("Hi", json!({"max_tokens": limit})).to_string(),
            "application/json",
            400,
            "context limit",
        ),
        (
            "/v1/completions",
            completion(&"word ".repeat(80), json!({"max_tokens": 1})).to_string(),
            "application/json",
            400,
            "exceed the context limit of 64 tokens",
        ),
        (
            "/v1/chat/completions",
            chat(&"word ".repeat(80), json!({})).to_string(),
            "application/json",
            400,
            "exceed the context limit of 64 tokens",
        ),
        (
            "/v1/completions",
            completion(&"x".repeat(5000), json!({})).to_string(),
            "application/json",
            413,
            "over 4096 bytes",
        ),
        (
            "/v1/embeddings",
            "{}".to_string(),
            "application/json",
            404,
            "no route /v1/embeddings",
        ),
        (
            "/v1/models",
            "{}".to_string(),
            "application/json",
            405,
            "POST is not served at /v1/models",
        ),
    ];
    for (path, body, ct, want, says) in cases {
        let (status, text) = s.post_raw(path, ct, &body);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(status, want, "{body:.80}: {text}");
        assert!(msg.contains(says), "{body:.80}: {msg}");
        assert!(v["error"]["type"].is_string());
        let (status, ok) = s.post("/v1/completions", &good);
        assert_eq!(status, 200, "after {body:.80}: {ok}");
    }
    // OpenAI's fields at values that ask for nothing else are accepted.
    let neutral = json!({
        "max_tokens": 2, "user": "u1", "frequency_penalty": 0, "presence_penalty": 0.0,
        "logprobs": false, "tools": [], "tool_choice": "none", "logit_bias": {},
        "response_format": {"type": "text"}, "metadata": {"k": "v"},
    });
    let (status, ok) = s.post("/v1/chat/completions", &chat("Hi", neutral));
    assert_eq!(status, 200, "{ok}");
    // And what `vllm bench serve` sends besides the fields this server reads.
    let vllm = json!({
        "max_tokens": 2, "repetition_penalty": 1.0, "logprobs": null, "ignore_eos": false,
        "best_of": 1, "top_k": -1, "min_p": 0.0,
    });
    let (status, ok) = s.post("/v1/completions", &completion("Hi", vllm));
    assert_eq!(status, 200, "{ok}");
}

#[test]
fn a_full_queue_answers_429_and_a_client_that_leaves_frees_its_slot() {
    // No waiting room: a request is taken only while the engine is idle.
    let s = Server::start(&["--max-queue", "0"]);
    let body = completion(
        "Long",
        json!({"max_tokens": 100000, "stream": true, "temperature": 0}),
    );
    // The engine takes it once it waits for work, a moment after the server answers.
    let t = Instant::now();
    let mut reader = loop {
        let r = Api::agent()
            .post(&format!("{}/v1/completions", s.url))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap();
        if r.status() != 429 {
            break BufReader::new(r.into_body().into_reader());
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the idle engine did not take the request"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("data: "), "{line}");
    let (status, busy) = s.post(
        "/v1/completions",
        &completion("Hi", json!({"max_tokens": 2})),
    );
    assert_eq!(status, 429, "{busy}");
    assert_eq!(busy["error"]["type"], "rate_limit_exceeded");
    // The client goes away mid-stream: its sequence is cancelled and the engine is free.
    drop(reader);
    let t = Instant::now();
    while s.metric("dsv4_requests_running") > 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the stream was not cancelled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.metric("dsv4_requests_cancelled_total"), 1.0);
    // The engine takes the next request once it is back waiting (a moment after `running` falls).
    let t = Instant::now();
    loop {
        let (status, r) = s.post(
            "/v1/completions",
            &completion("Hi", json!({"max_tokens": 2})),
        );
        if status == 200 {
            break;
        }
        assert!(
            status == 429 && t.elapsed() < Duration::from_secs(10),
            "{status}: {r}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.get("/health").0, 200);
}

#[test]
fn a_batch_runs_sequences_together_each_with_the_tokens_it_gives_alone() {
    batch_gives_what_each_gives_alone(&Server::start(&["--max-batch", "4"]), 4.0);
}

#[test]
#[ignore = "needs a CUDA GPU and the release dsv4 binary"]
fn gpu_a_batch_runs_sequences_together_each_with_the_tokens_it_gives_alone() {
    let s = Server::start_on("cuda", &["--max-batch", "8", "--max-context", "256"]);
    batch_gives_what_each_gives_alone(&s, 8.0);
}

/// Eight greedy streams at once give the texts each gives alone, at least two and at most
/// `slots` running together.
fn batch_gives_what_each_gives_alone(s: &Server, slots: f64) {
    let body = |i: usize| {
        completion(
            &format!("Prompt number {i}"),
            json!({"max_tokens": 16, "temperature": 0}),
        )
    };
    let alone: Vec<String> = (0..8)
        .map(|i| {
            s.post("/v1/completions", &body(i)).1["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let clients: Vec<_> = (0..8)
        .map(|i| {
            let api = s.api.clone();
            let mut b = body(i);
            b["stream"] = json!(true);
            std::thread::spawn(move || collect(&api.stream("/v1/completions", &b)).0)
        })
        .collect();
    let mut most = 0.0f64;
    while !clients.iter().all(|c| c.is_finished()) {
        most = most.max(s.metric("dsv4_requests_running"));
        std::thread::sleep(Duration::from_millis(5));
    }
    for (i, c) in clients.into_iter().enumerate() {
        assert_eq!(c.join().unwrap(), alone[i], "prompt {i}");
    }
    assert!(
        (2.0..=slots).contains(&most),
        "at most {most} sequences ran at once"
    );
}

#[test]
fn a_running_stream_keeps_flowing_while_a_long_prompt_is_read() {
    let s = Server::start(&["--max-batch", "2"]);
    // Stream A runs; then B's long prompt is read a part per step, A's tokens in between.
    let r = Api::agent()
        .post(&format!("{}/v1/completions", s.url))
        .header("Content-Type", "application/json")
        .send(completion("A", json!({"max_tokens": 100000, "stream": true})).to_string())
        .unwrap();
    let mut a = BufReader::new(r.into_body().into_reader()).lines();
    a.next().unwrap().unwrap();
    let long = "word ".repeat(600);
    let b = {
        let api = s.api.clone();
        std::thread::spawn(move || {
            let body = completion(&long, json!({"max_tokens": 1, "stream": true}));
            let chunks = api.stream("/v1/completions", &body);
            (Instant::now(), collect(&chunks))
        })
    };
    let t = Instant::now();
    let mut during = 0;
    while !b.is_finished() {
        let line = a.next().unwrap().unwrap();
        if line.starts_with("data: ") {
            during += 1;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "B never finished");
    }
    let (_, (_, finish, _)) = b.join().unwrap();
    assert_eq!(finish, "length");
    // B's prompt takes ~20 parts of 64 tokens; A advanced a token after each.
    assert!(
        during >= 10,
        "A streamed {during} tokens while B's prompt was read"
    );
}

#[test]
fn sixty_four_concurrent_streams_complete_and_sigterm_stops_the_server() {
    // Eight at a time in the batch, the rest waiting their turn.
    let mut s = Server::start(&["--max-batch", "8"]);
    let clients: Vec<_> = (0..64)
        .map(|i| {
            let server = s.api.clone();
            std::thread::spawn(move || {
                let body = completion(&format!("Client {i}"), json!({"max_tokens": 6, "stream": true, "stream_options": {"include_usage": true}}));
                let chunks = server.stream("/v1/completions", &body);
                collect(&chunks)
            })
        })
        .collect();
    for c in clients {
        let (_, finish, usage) = c.join().unwrap();
        assert!(finish == "length" || finish == "stop");
        let usage = usage.unwrap();
        let done = usage["completion_tokens"].as_u64().unwrap();
        assert!(
            done <= 6 && (finish == "stop" || done == 6),
            "{finish}: {usage}"
        );
        assert!(usage["prompt_tokens"].as_u64().unwrap() > 0, "{usage}");
    }
    assert_eq!(s.metric("dsv4_queue_length"), 0.0);
    // SIGTERM while a long stream runs: the stream ends early but whole, then the server exits.
    let long = {
        let api = s.api.clone();
        std::thread::spawn(move || {
            let body = completion("Long", json!({"max_tokens": 100000, "stream": true}));
            collect(&api.stream("/v1/completions", &body))
        })
    };
    let t = Instant::now();
    while s.metric("dsv4_requests_running") < 1.0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the long stream did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let t = Instant::now();
    loop {
        if let Some(code) = s.child.try_wait().unwrap() {
            assert!(code.success(), "exit {code}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, finish, _) = long.join().unwrap();
    assert_eq!(finish, "length");
}

#[test]
fn the_openai_python_client_talks_to_the_server() {
    let python = std::env::var("DSV4_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_client = Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_client {
        assert!(
            std::env::var("DSV4_REQUIRE_OPENAI").is_err(),
            "DSV4_REQUIRE_OPENAI is set but `{python}` cannot import openai"
        );
        println!("the openai Python package is not installed: this test did not run");
        return;
    }
    let s = Server::start(&[]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/serve_openai.py");
    let out = Command::new(&python)
        .arg(script)
        .args([&format!("{}/v1", s.url), MODEL])
        .output()
        .unwrap();
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    out.stderr.as_slice().read_to_string(&mut text).unwrap();
    assert!(out.status.success(), "{text}");
    assert!(text.contains("all openai client checks passed"), "{text}");
}

#[test]
fn settings_the_backend_cannot_run_are_refused_before_loading() {
    for (backend, batch) in [("cpu", "0"), ("cuda", "17")] {
        let out = Command::new(env!("CARGO_BIN_EXE_dsv4"))
            .args([
                "serve",
                "--backend",
                backend,
                "--max-batch",
                batch,
                "--model",
            ])
            .arg(checkpoint())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{backend} --max-batch {batch} was accepted"
        );
        assert!(err.contains(&format!("--max-batch {batch}")), "{err}");
    }
    let past = (Config::tiny().max_position_embeddings + 1).to_string();
    for (flag, value, says) in [
        ("--max-context", "0", "--max-context 0: at least 1"),
        ("--max-context", past.as_str(), "at most the model's"),
        ("--gpus", "2", "--gpus applies to --backend cuda"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_dsv4"))
            .args(["serve", "--backend", "cpu", flag, value, "--model"])
            .arg(checkpoint())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{flag} {value}: {err}"
        );
    }
}

#[test]
fn bench_serve_reports_a_row_per_concurrency_against_a_running_server() {
    let s = Server::start(&["--max-batch", "2"]);
    let out = Command::new(env!("CARGO_BIN_EXE_dsv4"))
        .args(["bench-serve", "--url", &s.url, "--concurrency", "1,2"])
        .args([
            "--requests",
            "3",
            "--prompt-words",
            "8",
            "--max-tokens",
            "4",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&format!("model `{MODEL}`")), "{text}");
    for c in [1, 2] {
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("| {c} |")))
            .unwrap_or_else(|| panic!("no row for concurrency {c}: {text}"));
        // Concurrency, then output tok/s, requests/s, TTFT and TPOT: real, positive timings.
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let first = |cell: &str| cell.split(' ').next().unwrap().parse::<f64>().unwrap();
        for (i, what) in [(2, "tok/s"), (3, "requests/s"), (4, "TTFT p50")] {
            assert!(first(cells[i]) > 0.0, "{what} in {row}");
        }
        assert!(first(cells[8]) <= 4.0, "tokens per request in {row}");
    }
    // Every request of both runs reached the server: 3 + 3 completions.
    let done = r#"dsv4_requests_total{endpoint="/v1/completions",status="200"}"#;
    assert_eq!(s.metric(done), 6.0);
}

#[test]
fn a_request_that_takes_a_cancelled_streams_slot_gives_what_it_gives_alone() {
    // One slot: B waits while A streams; A's client leaves, and B takes the slot between A's
    // last step being launched and its tokens being read.
    let s = Server::start(&["--max-batch", "1"]);
    let b = completion("Another prompt", json!({"max_tokens": 8, "temperature": 0}));
    let (status, alone) = s.post("/v1/completions", &b);
    assert_eq!(status, 200, "{alone}");
    let a = completion(
        "Long",
        json!({"max_tokens": 100000, "stream": true, "temperature": 0}),
    );
    let r = Api::agent()
        .post(&format!("{}/v1/completions", s.url))
        .header("Content-Type", "application/json")
        .send(a.to_string())
        .unwrap();
    let mut reader = BufReader::new(r.into_body().into_reader());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("data: "), "{line}");
    let waiting = {
        let api = s.api.clone();
        std::thread::spawn(move || api.post("/v1/completions", &b))
    };
    let t = Instant::now();
    while s.metric("dsv4_queue_length") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(10), "B did not queue");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(reader);
    let (status, after) = waiting.join().unwrap();
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], alone["choices"][0]["text"]);
    assert_eq!(s.metric("dsv4_requests_cancelled_total"), 1.0);
}
