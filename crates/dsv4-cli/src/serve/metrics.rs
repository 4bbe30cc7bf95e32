//! The server's counters, in the Prometheus text format (`GET /metrics`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (c, &b) in self.counts.iter_mut().zip(&BUCKETS) {
            if v <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Default)]
pub struct Metrics {
    /// Requests by endpoint and HTTP status.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Requests waiting for the engine, and being generated.
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    /// Requests whose client went away before they finished.
    pub cancelled: AtomicU64,
    /// The engine thread is serving (false once it has ended or panicked).
    pub alive: AtomicBool,
    /// The server is shutting down: the engine finishes the running request early.
    pub stopping: AtomicBool,
    ttft: Mutex<Histogram>,
    tpot: Mutex<Histogram>,
}

impl Metrics {
    pub fn count_request(&self, endpoint: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(seconds);
    }

    pub fn observe_tpot(&self, seconds: f64) {
        self.tpot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(seconds);
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP dsv4_requests_total Requests by endpoint and status.\n# TYPE dsv4_requests_total counter"
        );
        for ((endpoint, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "dsv4_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        let gauges: [(&str, &str, &str, u64); 5] = [
            (
                "dsv4_prompt_tokens_total",
                "counter",
                "Prompt tokens read.",
                self.prompt_tokens.load(Ordering::Relaxed),
            ),
            (
                "dsv4_generation_tokens_total",
                "counter",
                "Tokens generated.",
                self.generated_tokens.load(Ordering::Relaxed),
            ),
            (
                "dsv4_requests_cancelled_total",
                "counter",
                "Requests whose client went away first.",
                self.cancelled.load(Ordering::Relaxed),
            ),
            (
                "dsv4_queue_length",
                "gauge",
                "Requests waiting for the engine.",
                self.queued.load(Ordering::Relaxed) as u64,
            ),
            (
                "dsv4_requests_running",
                "gauge",
                "Requests being generated.",
                self.running.load(Ordering::Relaxed) as u64,
            ),
        ];
        for (name, kind, help, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        self.ttft.lock().unwrap_or_else(|e| e.into_inner()).render(
            &mut out,
            "dsv4_time_to_first_token_seconds",
            "From the start of generation to the first token.",
        );
        self.tpot.lock().unwrap_or_else(|e| e.into_inner()).render(
            &mut out,
            "dsv4_time_per_output_token_seconds",
            "Mean time per token after the first, per request.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_and_counters_render_cumulatively() {
        let m = Metrics::default();
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 200);
        m.observe_ttft(0.003);
        m.observe_ttft(20.0);
        m.queued.store(3, Ordering::Relaxed);
        let text = m.render();
        assert!(text.contains("dsv4_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2"));
        assert!(text.contains("dsv4_time_to_first_token_seconds_bucket{le=\"0.0025\"} 0"));
        assert!(text.contains("dsv4_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("dsv4_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("dsv4_time_to_first_token_seconds_count 2"));
        assert!(text.contains("dsv4_queue_length 3"));
    }
}
