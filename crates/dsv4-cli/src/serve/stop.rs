//! Stop strings matched across token boundaries: text is released only once no stop string can
//! still start inside it, and nothing from a stop string on is ever released.

/// Text held back until it cannot be the start of a stop string.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    /// Adds generated text; returns the text now safe to release and whether a stop string
    /// was reached (the text before it is released, it and the rest are dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest tail that begins some stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n) && self.pending.ends_with(&s[..n]))
                    .max()
            })
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// The held-back text at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, stopped) = m.push(p);
            out.push_str(&text);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stops_match_across_pieces_and_are_not_returned() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".into(), true)
        );
        assert_eq!(run(&["xy", "bc"], &["a", "bcxy"]), ("a".into(), true));
        // A partial match that does not complete is released.
        assert_eq!(run(&["END"], &["abc EN", "x"]), ("abc ENx".into(), false));
        // Held back to the end, then released.
        assert_eq!(run(&["END"], &["abc EN"]), ("abc EN".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        // Multi-byte characters are never split.
        assert_eq!(run(&["éé"], &["aé", "b"]), ("aéb".into(), false));
        assert_eq!(run(&["éé"], &["aé", "é"]), ("a".into(), true));
    }

    #[test]
    fn text_is_released_as_soon_as_no_stop_can_begin_in_it() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("hello S"), ("hello ".into(), false));
        assert_eq!(m.push("T"), (String::new(), false));
        assert_eq!(m.push("x"), ("STx".into(), false));
    }
}
