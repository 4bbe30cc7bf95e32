//! DeepSeek-V4 chat prompt encoding.
//!
//! Follows `encode_messages` of `encoding/encoding_dsv4.py` shipped in the official
//! deepseek-ai/DeepSeek-V4-Flash and -Pro repos (default `drop_thinking=True`, default reasoning
//! effort, which adds no prefix), for plain system / user / assistant conversations: no tools,
//! tool results, developer or latest-reminder messages, or quick-instruction tasks.
//!
//! Shape of a rendered conversation:
//! `BOS system <｜User｜>user<｜Assistant｜>[reasoning</think>]answer<｜end▁of▁sentence｜>...`
//! and, when the last message is from the user, the generation prompt `<｜Assistant｜>` followed by
//! `<think>` (thinking mode) or `</think>` (chat mode: the model answers directly).

use crate::tokenizer::{self, Tokenizer};

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatMode {
    /// The model answers directly.
    Chat,
    /// The model reasons inside `<think>…</think>` before answering.
    Thinking,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// The assistant's reasoning (thinking mode); rendered only for turns after the last user
    /// message, as the official encoder drops earlier reasoning.
    pub reasoning: Option<String>,
}

impl Message {
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: Role::System,
            content: content.into(),
            reasoning: None,
        }
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: Role::User,
            content: content.into(),
            reasoning: None,
        }
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            role: Role::Assistant,
            content: content.into(),
            reasoning: None,
        }
    }

    pub fn with_reasoning(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning = Some(reasoning.into());
        self
    }
}

/// Renders `messages` as the prompt text, starting with BOS.
pub fn encode_chat(messages: &[Message], mode: ChatMode) -> String {
    let messages = merge_consecutive_users(messages);
    let last_user = messages.iter().rposition(|m| m.role == Role::User);
    let mut prompt = String::from(BOS);
    for (index, msg) in messages.iter().enumerate() {
        match msg.role {
            Role::System => prompt.push_str(&msg.content),
            Role::User => {
                prompt.push_str(USER);
                prompt.push_str(&msg.content);
            }
            Role::Assistant => {
                let after_last_user = last_user.is_none_or(|u| index > u);
                if mode == ChatMode::Thinking && after_last_user {
                    prompt.push_str(msg.reasoning.as_deref().unwrap_or(""));
                    prompt.push_str(THINK_END);
                }
                prompt.push_str(&msg.content);
                prompt.push_str(EOS);
            }
        }
        // A user turn hands over to the assistant unless another non-assistant message follows.
        let next_is_assistant = messages
            .get(index + 1)
            .is_none_or(|m| m.role == Role::Assistant);
        if msg.role == Role::User && next_is_assistant {
            prompt.push_str(ASSISTANT);
            let open_thinking = mode == ChatMode::Thinking && last_user.is_some_and(|u| index >= u);
            prompt.push_str(if open_thinking {
                THINK_START
            } else {
                THINK_END
            });
        }
    }
    prompt
}

/// Token ids of [`encode_chat`]'s prompt (BOS included).
pub fn encode_chat_ids(
    tokenizer: &Tokenizer,
    messages: &[Message],
    mode: ChatMode,
) -> tokenizer::Result<Vec<u32>> {
    tokenizer.encode(&encode_chat(messages, mode), false)
}

/// The official encoder turns each user message into a text block and appends a user message
/// that directly follows another to it; the blocks are joined with a blank line.
fn merge_consecutive_users(messages: &[Message]) -> Vec<Message> {
    let mut merged: Vec<Message> = Vec::with_capacity(messages.len());
    for msg in messages {
        match merged.last_mut() {
            Some(prev) if prev.role == Role::User && msg.role == Role::User => {
                prev.content.push_str("\n\n");
                prev.content.push_str(&msg.content);
            }
            _ => merged.push(msg.clone()),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    // deepseek-ai/DeepSeek-V4-Flash, encoding/tests/test_input_2.json, rendered in thinking mode
    // by encoding/encoding_dsv4.py to encoding/tests/test_output_2.txt (below).
    fn official_case_2() -> Vec<Message> {
        vec![
            Message::system("You are a helpful assistant."),
            Message::user("Hello"),
            Message::assistant("Hi there! How can I help you?")
                .with_reasoning("The user said hello, I should greet back."),
            Message::user("What is the capital of France?"),
            Message::assistant("The capital of France is Paris.")
                .with_reasoning("The user asks about the capital of France. It is Paris."),
        ]
    }

    const OFFICIAL_OUTPUT_2: &str = "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about the capital of France. It is Paris.</think>The capital of France is Paris.<｜end▁of▁sentence｜>";

    #[test]
    fn official_multi_turn_thinking() {
        let prompt = encode_chat(&official_case_2(), ChatMode::Thinking);
        assert_eq!(prompt, OFFICIAL_OUTPUT_2);
        assert!(
            !prompt.contains("The user said hello"),
            "earlier reasoning is dropped"
        );
    }

    #[test]
    fn multi_turn_chat_mode_has_no_reasoning() {
        let prompt = encode_chat(&official_case_2(), ChatMode::Chat);
        assert_eq!(
            prompt,
            "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜></think>The capital of France is Paris.<｜end▁of▁sentence｜>"
        );
    }

    #[test]
    fn single_turn_generation_prompt() {
        let messages = [Message::user("1+1=?")];
        assert_eq!(
            encode_chat(&messages, ChatMode::Chat),
            "<｜begin▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜></think>"
        );
        assert_eq!(
            encode_chat(&messages, ChatMode::Thinking),
            "<｜begin▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜><think>"
        );
    }

    #[test]
    fn next_turn_prompt_drops_old_reasoning() {
        let mut messages = official_case_2();
        messages.push(Message::user("And of Italy?"));
        let prompt = encode_chat(&messages, ChatMode::Thinking);
        assert!(prompt.ends_with(
            "<｜Assistant｜></think>The capital of France is Paris.<｜end▁of▁sentence｜><｜User｜>And of Italy?<｜Assistant｜><think>"
        ));
        assert!(!prompt.contains("It is Paris."));
    }

    #[test]
    fn consecutive_user_messages_merge() {
        let messages = [Message::system("S"), Message::user("a"), Message::user("b")];
        assert_eq!(
            encode_chat(&messages, ChatMode::Chat),
            "<｜begin▁of▁sentence｜>S<｜User｜>a\n\nb<｜Assistant｜></think>"
        );
    }

    #[test]
    fn prompt_ids_use_single_special_tokens() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets");
        let tok = Tokenizer::from_dir(dir).unwrap();
        let ids = encode_chat_ids(&tok, &[Message::user("Hello")], ChatMode::Thinking).unwrap();
        // BOS, <｜User｜>, "Hello", <｜Assistant｜>, <think>
        assert_eq!(ids, [0, 128803, 19923, 128804, 128821]);
    }
}
