//! A request's text from its generated tokens, worked out on the request's own task rather than
//! the engine's thread (which only sends ids, so a step of many sequences costs the engine
//! little): incremental decoding, the reasoning / answer split of thinking mode, stop strings.
//! A stop string found here ends the request at once and tells the engine to end its sequence.

use std::sync::Arc;

use anyhow::Result;

use dsv4_model::tokenizer::{TextStream, Tokenizer};

use super::engine::{Event, Finish, TextEnd};
use super::stop::StopMatcher;

/// What a request answers with, in order.
pub enum Output {
    /// New text of the answer and of the reasoning (either may be empty, not both).
    Text {
        content: String,
        reasoning: String,
    },
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed(String),
}

/// One request's text state.
pub struct TextStage {
    tokenizer: Arc<Tokenizer>,
    /// The end-of-thinking token, when the vocabulary has it as one token.
    think_end: Option<u32>,
    answer: TextStream,
    reasoning: TextStream,
    stop: StopMatcher,
    in_reasoning: bool,
    prompt_tokens: usize,
    /// Tokens taken so far.
    tokens: usize,
    /// Set when the text ends the request (a stop string, a failure): the engine then ends
    /// its sequence.
    end: Arc<TextEnd>,
    ended: bool,
}

impl TextStage {
    /// `thinking`: the output starts inside the reasoning (until `think_end`).
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        think_end: Option<u32>,
        stops: Vec<String>,
        thinking: bool,
        prompt_tokens: usize,
        end: Arc<TextEnd>,
    ) -> TextStage {
        TextStage {
            answer: TextStream::new(tokenizer.clone()),
            reasoning: TextStream::new(tokenizer.clone()),
            tokenizer,
            think_end,
            stop: StopMatcher::new(stops),
            in_reasoning: thinking,
            prompt_tokens,
            tokens: 0,
            end,
            ended: false,
        }
    }

    /// The outputs of one engine event; none once the request has ended (a stop string, the
    /// engine's end, a failure).
    pub fn take(&mut self, ev: Event) -> Vec<Output> {
        if self.ended {
            return Vec::new();
        }
        let out = match ev {
            Event::Token(t) => self.token(t),
            Event::Done {
                finish,
                completion_tokens,
            } => {
                self.ended = true;
                self.finish(finish, completion_tokens)
            }
            Event::Failed(e) => {
                self.ended = true;
                return vec![Output::Failed(e)];
            }
        };
        out.unwrap_or_else(|e| {
            self.ended = true;
            self.end.fail();
            vec![Output::Failed(format!("{e:#}"))]
        })
    }

    fn token(&mut self, token: u32) -> Result<Vec<Output>> {
        self.tokens += 1;
        let (mut content, mut thought, mut hit) = (String::new(), String::new(), false);
        if self.in_reasoning && Some(token) == self.think_end {
            self.in_reasoning = false;
            thought = self.fresh_reasoning().finish()?.unwrap_or_default();
        } else if self.in_reasoning {
            thought = self.reasoning.push(token)?.unwrap_or_default();
        } else if let Some(t) = self.answer.push(token)? {
            (content, hit) = self.stop.push(&t);
        }
        let mut out = text(content, thought);
        if hit {
            // Nothing after a stop string is released.
            self.end.stop(self.tokens);
            self.ended = true;
            out.push(self.done(Finish::Stop, self.tokens));
        }
        Ok(out)
    }

    /// Releases what the text streams and the stop matcher hold, then the end.
    fn finish(&mut self, mut finish: Finish, completion_tokens: usize) -> Result<Vec<Output>> {
        let (mut content, mut hit) = (String::new(), false);
        let answer = std::mem::replace(&mut self.answer, TextStream::new(self.tokenizer.clone()));
        if let Some(t) = answer.finish()? {
            (content, hit) = self.stop.push(&t);
        }
        if hit {
            finish = Finish::Stop;
        } else {
            content.push_str(&self.stop.finish());
        }
        let thought = if self.in_reasoning {
            self.fresh_reasoning().finish()?.unwrap_or_default()
        } else {
            String::new()
        };
        let mut out = text(content, thought);
        out.push(self.done(finish, completion_tokens));
        Ok(out)
    }

    /// The reasoning stream so far, a fresh one in its place.
    fn fresh_reasoning(&mut self) -> TextStream {
        std::mem::replace(&mut self.reasoning, TextStream::new(self.tokenizer.clone()))
    }

    fn done(&self, finish: Finish, completion_tokens: usize) -> Output {
        Output::Done {
            finish,
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
        }
    }
}

/// A text output, where there is any.
fn text(content: String, reasoning: String) -> Vec<Output> {
    if content.is_empty() && reasoning.is_empty() {
        Vec::new()
    } else {
        vec![Output::Text { content, reasoning }]
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use dsv4_model::chat::THINK_END;

    use super::*;

    fn tokenizer() -> Arc<Tokenizer> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dsv4-model/assets");
        Arc::new(Tokenizer::from_dir(dir).expect("committed tokenizer loads"))
    }

    /// The stage's outputs for `events`: the answer, the reasoning, and the end.
    fn run(
        stage: &mut TextStage,
        events: Vec<Event>,
    ) -> (String, String, Vec<(Finish, usize, usize)>) {
        let (mut content, mut reasoning, mut ends) = (String::new(), String::new(), Vec::new());
        for ev in events {
            for out in stage.take(ev) {
                match out {
                    Output::Text {
                        content: c,
                        reasoning: r,
                    } => {
                        assert!(!c.is_empty() || !r.is_empty(), "an empty text output");
                        content.push_str(&c);
                        reasoning.push_str(&r);
                    }
                    Output::Done {
                        finish,
                        prompt_tokens,
                        completion_tokens,
                    } => ends.push((finish, prompt_tokens, completion_tokens)),
                    Output::Failed(e) => panic!("failed: {e}"),
                }
            }
        }
        (content, reasoning, ends)
    }

    #[test]
    fn a_stop_string_ends_the_request_and_tells_the_engine() {
        let tok = tokenizer();
        let ids = tok.encode("Hello world, and more words", false).unwrap();
        let end = Arc::new(TextEnd::default());
        let stops = vec![" world".to_string()];
        let mut stage = TextStage::new(tok, None, stops, false, 7, end.clone());
        let mut events: Vec<Event> = ids.iter().map(|&t| Event::Token(t)).collect();
        // The engine's own end, sent before it saw the flag, changes nothing.
        events.push(Event::Done {
            finish: Finish::Length,
            completion_tokens: ids.len(),
        });
        let (content, reasoning, ends) = run(&mut stage, events);
        assert_eq!((content.as_str(), reasoning.as_str()), ("Hello", ""));
        assert_eq!(ends.len(), 1, "one end");
        let (finish, prompt, completion) = ends[0];
        assert_eq!((finish, prompt), (Finish::Stop, 7));
        // The tokens up to the one that completed the stop string, which the engine is told.
        assert!(
            completion >= 2 && completion < ids.len(),
            "{completion} of {}",
            ids.len()
        );
        assert_eq!(end.get().unwrap().unwrap(), completion);
    }

    #[test]
    fn thinking_splits_at_the_end_of_thinking_and_the_end_flushes() {
        let tok = tokenizer();
        let think_end = match tok.encode(THINK_END, false).unwrap().as_slice() {
            [id] => *id,
            other => panic!("{THINK_END} is {other:?}"),
        };
        let mut ids = tok.encode("a plan", false).unwrap();
        ids.push(think_end);
        ids.extend(tok.encode("the answer", false).unwrap());
        let end = Arc::new(TextEnd::default());
        let mut stage = TextStage::new(tok, Some(think_end), Vec::new(), true, 3, end.clone());
        let mut events: Vec<Event> = ids.iter().map(|&t| Event::Token(t)).collect();
        events.push(Event::Done {
            finish: Finish::Length,
            completion_tokens: ids.len(),
        });
        let (content, reasoning, ends) = run(&mut stage, events);
        assert_eq!(
            (content.as_str(), reasoning.as_str()),
            ("the answer", "a plan")
        );
        assert_eq!(ends, vec![(Finish::Length, 3, ids.len())]);
        assert!(end.get().is_none(), "the engine's own end needs no flag");
        // A failure after the end is not reported.
        assert!(stage.take(Event::Failed("late".into())).is_empty());
    }
}
