//! The OpenAI request bodies, validated field by field, and the errors in OpenAI's shape.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use dsv4_model::chat::{ChatMode, Message, Role};

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": Value::Null,
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

/// Longest stop string (the engine holds back a possible start of one at every token).
const MAX_STOP_BYTES: usize = 256;

/// What a chat or completion request asks for.
#[derive(Debug)]
pub struct Params {
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

pub enum Prompt {
    Chat {
        messages: Vec<Message>,
        mode: ChatMode,
    },
    Text(String),
}

pub struct Request {
    pub prompt: Prompt,
    pub params: Params,
}

fn field<'a>(body: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    body.get(name).filter(|v| !v.is_null())
}

fn number(
    body: &Map<String, Value>,
    name: &str,
    lo: f64,
    hi: f64,
    default: f64,
) -> Result<f64, ApiError> {
    match field(body, name) {
        None => Ok(default),
        Some(v) => {
            let x = v.as_f64().ok_or_else(|| {
                ApiError::bad(name, format!("`{name}` must be a number, not {v}"))
            })?;
            if !(lo..=hi).contains(&x) {
                return Err(ApiError::bad(
                    name,
                    format!("`{name}` = {x} is outside [{lo}, {hi}]"),
                ));
            }
            Ok(x)
        }
    }
}

fn boolean(body: &Map<String, Value>, name: &str) -> Result<bool, ApiError> {
    match field(body, name) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::bad(
            name,
            format!("`{name}` must be a boolean, not {v}"),
        )),
    }
}

/// The fields [`parse`] reads: both endpoints', then chat's and completions' own.
const FIELDS: &[&str] = &[
    "model",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
];
const CHAT_FIELDS: &[&str] = &["messages", "chat_template_kwargs", "thinking"];
const COMPLETION_FIELDS: &[&str] = &["prompt"];

/// Every other field of a body. OpenAI's and vLLM's fields that only keep records are
/// accepted, and so are those whose value asks for what this server does anyway (a zero
/// penalty, no log probabilities, no tools, plain text, vLLM's sampling extras at their
/// defaults, as `vllm bench serve` sends them); any other value of theirs, and any field of
/// another name, is refused by name rather than ignored. The keys inside
/// `chat_template_kwargs` and `stream_options` other than those read are not checked.
fn check_other_fields(body: &Map<String, Value>, chat: bool) -> Result<(), ApiError> {
    let own = if chat { CHAT_FIELDS } else { COMPLETION_FIELDS };
    for (name, v) in body {
        let name = name.as_str();
        if FIELDS.contains(&name) || own.contains(&name) {
            continue;
        }
        let empty = |v: &Value| match v {
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
            Value::String(s) => s.is_empty(),
            _ => false,
        };
        let neutral = match name {
            "user" | "metadata" | "store" | "service_tier" | "parallel_tool_calls" => true,
            "frequency_penalty" | "presence_penalty" | "top_logprobs" | "min_p" | "min_tokens" => {
                v.as_f64() == Some(0.0)
            }
            "repetition_penalty" | "length_penalty" | "best_of" => v.as_f64() == Some(1.0),
            "top_k" => v.as_i64() == Some(0) || v.as_i64() == Some(-1),
            "logprobs"
            | "echo"
            | "ignore_eos"
            | "include_stop_str_in_output"
            | "use_beam_search" => v == &Value::Bool(false),
            "skip_special_tokens" | "spaces_between_special_tokens" => v == &Value::Bool(true),
            "prompt_logprobs" => false,
            "logit_bias" | "tools" | "functions" | "suffix" | "stop_token_ids" => empty(v),
            "tool_choice" | "function_call" => v == "none",
            "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
            _ => return Err(ApiError::bad(name, format!("unknown field `{name}`"))),
        };
        // Null is every such field's default.
        if !(v.is_null() || neutral) {
            return Err(ApiError::bad(
                name,
                format!("`{name}` = {v} is not supported by this server"),
            ));
        }
    }
    Ok(())
}

/// Parses a request body: `chat` selects `messages` (chat completions) over `prompt`.
pub fn parse(bytes: &[u8], served: &str, chat: bool) -> Result<Request, ApiError> {
    let body: Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(body) = body else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object",
        ));
    };
    match field(&body, "model") {
        Some(Value::String(m)) if m == served => {}
        Some(Value::String(m)) => {
            return Err(ApiError::bad(
                "model",
                format!("unknown model `{m}`: this server serves `{served}`"),
            ))
        }
        Some(v) => {
            return Err(ApiError::bad(
                "model",
                format!("`model` must be a string, not {v}"),
            ))
        }
        None => return Err(ApiError::bad("model", "`model` is required")),
    }
    check_other_fields(&body, chat)?;
    if let Some(n) = field(&body, "n") {
        if n.as_u64() != Some(1) {
            return Err(ApiError::bad(
                "n",
                format!("`n` = {n}: only one choice per request (n = 1)"),
            ));
        }
    }
    let max_tokens =
        match field(&body, "max_completion_tokens").or_else(|| field(&body, "max_tokens")) {
            None => None,
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => Some(n as usize),
                _ => {
                    let name = if field(&body, "max_completion_tokens").is_some() {
                        "max_completion_tokens"
                    } else {
                        "max_tokens"
                    };
                    return Err(ApiError::bad(
                        name,
                        format!("`{name}` must be a positive integer, not {v}"),
                    ));
                }
            },
        };
    let seed = match field(&body, "seed") {
        None => 0,
        Some(v) => v
            .as_u64()
            .or_else(|| v.as_i64().map(|x| x as u64))
            .ok_or_else(|| ApiError::bad("seed", format!("`seed` must be an integer, not {v}")))?,
    };
    let stops = match field(&body, "stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(Value::is_string) => a
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect(),
        Some(v) => {
            return Err(ApiError::bad(
                "stop",
                format!("`stop` must be a string or up to 4 strings, not {v}"),
            ))
        }
    };
    if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(
            "stop",
            format!(
                "a stop string of {} bytes: at most {MAX_STOP_BYTES}",
                long.len()
            ),
        ));
    }
    let include_usage = match field(&body, "stream_options") {
        None => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")
            .map_err(|e| ApiError::bad("stream_options.include_usage", e.message))?,
        Some(v) => {
            return Err(ApiError::bad(
                "stream_options",
                format!("`stream_options` must be an object, not {v}"),
            ))
        }
    };
    let params = Params {
        max_tokens,
        temperature: number(&body, "temperature", 0.0, 2.0, 1.0)? as f32,
        top_p: {
            // Checked as the f32 the sampler gets: a tiny value rounds to 0.
            let p = number(&body, "top_p", 0.0, 1.0, 1.0)? as f32;
            if p <= 0.0 {
                return Err(ApiError::bad("top_p", "`top_p` must be above 0"));
            }
            p
        },
        seed,
        stops,
        stream: boolean(&body, "stream")?,
        include_usage,
    };
    let prompt = if chat {
        chat_prompt(&body)?
    } else {
        text_prompt(&body)?
    };
    Ok(Request { prompt, params })
}

/// Thinking mode: `chat_template_kwargs.thinking` (vLLM, SGLang) or `thinking` as a boolean or
/// `{"type": "enabled"}` (DeepSeek's API).
fn chat_mode(body: &Map<String, Value>) -> Result<ChatMode, ApiError> {
    let kwargs = field(body, "chat_template_kwargs").and_then(|k| k.get("thinking"));
    let on = match kwargs.or_else(|| field(body, "thinking")) {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str).is_some() => {
            o.get("type").and_then(Value::as_str) == Some("enabled")
        }
        Some(v) => {
            return Err(ApiError::bad(
                "thinking",
                format!("`thinking` must be a boolean, not {v}"),
            ))
        }
    };
    Ok(if on {
        ChatMode::Thinking
    } else {
        ChatMode::Chat
    })
}

/// A message's text: a string, or an array of `{"type": "text", "text"}` parts.
fn content(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| {
                p.get("text")
                    .and_then(Value::as_str)
                    .filter(|_| p.get("type").and_then(Value::as_str) == Some("text"))
                    .ok_or_else(|| {
                        ApiError::bad(at, format!("`{at}`: only text parts are taken, not {p}"))
                    })
            })
            .collect(),
        Some(v) => Err(ApiError::bad(
            at,
            format!("`{at}` must be a string or text parts, not {v}"),
        )),
    }
}

fn chat_prompt(body: &Map<String, Value>) -> Result<Prompt, ApiError> {
    let Some(Value::Array(list)) = field(body, "messages") else {
        return Err(ApiError::bad(
            "messages",
            "`messages` must be a non-empty array",
        ));
    };
    if list.is_empty() {
        return Err(ApiError::bad(
            "messages",
            "`messages` must be a non-empty array",
        ));
    }
    let messages = list
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let at = format!("messages[{i}]");
            let role = match m.get("role").and_then(Value::as_str) {
                Some("system") | Some("developer") => Role::System,
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                _ => {
                    let found = m.get("role").map_or("none".to_string(), Value::to_string);
                    return Err(ApiError::bad(
                        &format!("{at}.role"),
                        format!("`{at}.role` must be system, user or assistant, found {found}"),
                    ));
                }
            };
            // Only an assistant's turn may come without text (OpenAI's rule).
            let missing = matches!(m.get("content"), None | Some(Value::Null));
            if missing && role != Role::Assistant {
                return Err(ApiError::bad(
                    &format!("{at}.content"),
                    format!("`{at}.content` is required"),
                ));
            }
            let text = content(m.get("content"), &format!("{at}.content"))?;
            let reasoning = m
                .get("reasoning_content")
                .and_then(Value::as_str)
                .map(str::to_string);
            Ok(Message {
                role,
                content: text,
                reasoning,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Prompt::Chat {
        messages,
        mode: chat_mode(body)?,
    })
}

fn text_prompt(body: &Map<String, Value>) -> Result<Prompt, ApiError> {
    match field(body, "prompt") {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(Prompt::Text(a[0].as_str().unwrap_or_default().to_string()))
        }
        Some(v) => Err(ApiError::bad(
            "prompt",
            format!("`prompt` must be a string, not {v}"),
        )),
        None => Err(ApiError::bad("prompt", "`prompt` is required")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str, chat: bool) -> ApiError {
        parse(body.as_bytes(), "m", chat).err().expect("refused")
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (
                r#"{"model":"m","prompt":"x","max_tokens":-1}"#,
                "max_tokens",
            ),
            (
                r#"{"model":"m","prompt":"x","max_completion_tokens":0}"#,
                "max_completion_tokens",
            ),
            (
                r#"{"model":"m","prompt":"x","temperature":"hot"}"#,
                "temperature",
            ),
            (
                r#"{"model":"m","prompt":"x","temperature":2.5}"#,
                "temperature",
            ),
            (r#"{"model":"m","prompt":"x","top_p":0}"#, "top_p"),
            (r#"{"model":"m","prompt":"x","top_p":1e-50}"#, "top_p"),
            (
                r#"{"model":"m","prompt":"x","max_completion_tokens":null,"max_tokens":0}"#,
                "max_tokens",
            ),
            (r#"{"model":"m","prompt":"x","n":2}"#, "n"),
            (r#"{"model":"m","prompt":"x","stop":[1]}"#, "stop"),
            (r#"{"model":"other","prompt":"x"}"#, "model"),
            (r#"{"prompt":"x"}"#, "model"),
            (r#"{"model":"m"}"#, "prompt"),
            (r#"{"model":"m","prompt":"x","stream":"yes"}"#, "stream"),
        ];
        for (body, param) in cases {
            let e = err(body, false);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let long = format!(
            r#"{{"model":"m","prompt":"x","stop":"{}"}}"#,
            "s".repeat(300)
        );
        assert_eq!(err(&long, false).param.as_deref(), Some("stop"));
        let e = err(
            r#"{"model":"m","messages":[{"role":"tool","content":"x"}]}"#,
            true,
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        assert!(e.message.ends_with("found \"tool\""), "{}", e.message);
        let e = err(r#"{"model":"m","messages":[{"content":"x"}]}"#, true);
        assert!(e.message.ends_with("found none"), "{}", e.message);
        let e = err(r#"{"model":"m","messages":[{"role":"user"}]}"#, true);
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = err(
            r#"{"model":"m","messages":[{"role":"system","content":null}]}"#,
            true,
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = err(r#"{"model":"m","messages":[]}"#, true);
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(err("{not json", false).message.contains("not valid JSON"));
        assert!(err("[1]", false).message.contains("JSON object"));
    }

    #[test]
    fn good_requests_parse_with_defaults() {
        let r = parse(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
                "stream":true,"stream_options":{"include_usage":true},"stop":"x","seed":3,
                "chat_template_kwargs":{"thinking":true}}"#,
            "m",
            true,
        )
        .unwrap();
        let Prompt::Chat { messages, mode } = r.prompt else {
            panic!("chat")
        };
        assert_eq!(
            (messages[0].content.as_str(), mode),
            ("hi", ChatMode::Thinking)
        );
        let p = r.params;
        assert!(p.stream && p.include_usage);
        assert_eq!(
            (p.stops, p.seed, p.temperature, p.max_tokens),
            (vec!["x".to_string()], 3, 1.0, None)
        );
    }

    #[test]
    fn other_fields_pass_at_neutral_values_and_are_named_otherwise() {
        let body = |chat: bool, name: &str, v: &str| {
            let prompt = if chat {
                r#""messages":[{"role":"user","content":"hi"}]"#
            } else {
                r#""prompt":"x""#
            };
            format!(r#"{{"model":"m",{prompt},"{name}":{v}}}"#)
        };
        let neutral = [
            ("user", r#""u""#),
            ("store", "true"),
            ("service_tier", r#""auto""#),
            ("frequency_penalty", "0"),
            ("top_logprobs", "0"),
            ("min_tokens", "0"),
            ("repetition_penalty", "1.0"),
            ("best_of", "1"),
            ("top_k", "-1"),
            ("echo", "false"),
            ("ignore_eos", "false"),
            ("use_beam_search", "false"),
            ("skip_special_tokens", "true"),
            ("prompt_logprobs", "null"),
            ("suffix", r#""""#),
            ("stop_token_ids", "[]"),
            ("function_call", r#""none""#),
            ("response_format", r#"{"type":"text"}"#),
        ];
        for chat in [false, true] {
            for (name, v) in neutral {
                let b = body(chat, name, v);
                assert!(parse(b.as_bytes(), "m", chat).is_ok(), "{b}");
            }
        }
        let refused = [
            ("repetition_penalty", "1.2", true, "not supported"),
            ("best_of", "2", false, "not supported"),
            ("echo", "true", false, "not supported"),
            ("ignore_eos", "true", false, "not supported"),
            ("suffix", r#""tail""#, false, "not supported"),
            ("stop_token_ids", "[5]", true, "not supported"),
            (
                "response_format",
                r#"{"type":"json_object"}"#,
                true,
                "not supported",
            ),
            ("messages", "[]", false, "unknown field"),
            ("prompt", r#""x""#, true, "unknown field"),
            ("temprature", "1", true, "unknown field"),
        ];
        for (name, v, chat, says) in refused {
            let e = err(&body(chat, name, v), chat);
            assert_eq!(e.param.as_deref(), Some(name), "{name} = {v}");
            assert!(e.message.contains(says), "{name} = {v}: {}", e.message);
        }
    }
}
