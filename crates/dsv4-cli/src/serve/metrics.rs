//! The server's counters, in the Prometheus text format (`GET /metrics`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Upper bounds (seconds) of the buckets of the requests' latency histograms, and of the
/// decode steps' host times.
const REQUEST_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];
const STEP_BUCKETS: [f64; 12] = [
    5e-6, 1e-5, 1.5e-5, 2e-5, 3e-5, 4e-5, 5e-5, 7.5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2,
];

struct Histogram {
    bounds: &'static [f64; 12],
    counts: [u64; 12],
    count: u64,
    sum: f64,
}

impl Histogram {
    const fn new(bounds: &'static [f64; 12]) -> Histogram {
        Histogram {
            bounds,
            counts: [0; 12],
            count: 0,
            sum: 0.0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (c, &b) in self.counts.iter_mut().zip(self.bounds) {
            if v <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(self.bounds) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

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
    /// Per decode step: from its tokens read back to the next step launched, and to the end
    /// of the host's work on them.
    launch_gap: Mutex<Histogram>,
    step_host: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::default(),
            generated_tokens: AtomicU64::default(),
            queued: AtomicUsize::default(),
            running: AtomicUsize::default(),
            cancelled: AtomicU64::default(),
            alive: AtomicBool::default(),
            stopping: AtomicBool::default(),
            ttft: Mutex::new(Histogram::new(&REQUEST_BUCKETS)),
            tpot: Mutex::new(Histogram::new(&REQUEST_BUCKETS)),
            launch_gap: Mutex::new(Histogram::new(&STEP_BUCKETS)),
            step_host: Mutex::new(Histogram::new(&STEP_BUCKETS)),
        }
    }
}

fn observe(h: &Mutex<Histogram>, seconds: f64) {
    h.lock().unwrap_or_else(|e| e.into_inner()).observe(seconds);
}

impl Metrics {
    pub fn count_request(&self, endpoint: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    pub fn observe_ttft(&self, seconds: f64) {
        observe(&self.ttft, seconds);
    }

    pub fn observe_tpot(&self, seconds: f64) {
        observe(&self.tpot, seconds);
    }

    pub fn observe_launch_gap(&self, seconds: f64) {
        observe(&self.launch_gap, seconds);
    }

    pub fn observe_step_host(&self, seconds: f64) {
        observe(&self.step_host, seconds);
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
        let histograms = [
            (
                &self.ttft,
                "dsv4_time_to_first_token_seconds",
                "From the start of generation to the first token.",
            ),
            (
                &self.tpot,
                "dsv4_time_per_output_token_seconds",
                "Mean time per token after the first, per request.",
            ),
            (
                &self.launch_gap,
                "dsv4_decode_launch_gap_seconds",
                "Per decode step: from its tokens read back to the next step launched (the \
                 device waits on the host for it).",
            ),
            (
                &self.step_host,
                "dsv4_decode_step_host_seconds",
                "Per decode step: the host's work once its tokens are read back (launching the \
                 next step, then handling and streaming the tokens while it runs).",
            ),
        ];
        for (h, name, help) in histograms {
            h.lock()
                .unwrap_or_else(|e| e.into_inner())
                .render(&mut out, name, help);
        }
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
        m.observe_step_host(7e-6);
        let text = m.render();
        assert!(text.contains("dsv4_decode_step_host_seconds_bucket{le=\"0.000005\"} 0"));
        assert!(text.contains("dsv4_decode_step_host_seconds_bucket{le=\"0.00001\"} 1"));
        assert!(text.contains("dsv4_decode_launch_gap_seconds_count 0"));
        assert!(text.contains("dsv4_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2"));
        assert!(text.contains("dsv4_time_to_first_token_seconds_bucket{le=\"0.0025\"} 0"));
        assert!(text.contains("dsv4_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("dsv4_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("dsv4_time_to_first_token_seconds_count 2"));
        assert!(text.contains("dsv4_queue_length 3"));
    }
}
