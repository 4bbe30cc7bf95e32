//! `dsv4 bench-serve`: a load generator for an OpenAI-compatible server (like `vllm bench
//! serve`): streaming completions of random prompts at each concurrency, reporting output
//! throughput, time to first token and time per output token, and the server's host time per
//! decode step where its `/metrics` has it.

use std::io::{BufRead, BufReader};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct LoadArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The served model name (default: the first the server lists).
    #[arg(long)]
    model: Option<String>,
    /// Concurrent clients, one run each.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4, 16, 64])]
    concurrency: Vec<usize>,
    /// Requests per run (at least the concurrency).
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Words in each random prompt.
    #[arg(long, default_value_t = 128)]
    prompt_words: usize,
    /// Tokens each request generates (`max_tokens`, `ignore_eos` is not sent: a request may
    /// stop early at EOS).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// One request's timings.
struct Sample {
    ttft: f64,
    tpot: Option<f64>,
    tokens: u64,
}

/// A prompt of `words` random lowercase words (xorshift from `seed`).
fn prompt(words: usize, mut seed: u64) -> String {
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    (0..words)
        .map(|_| {
            let len = 2 + next() % 7;
            (0..len)
                .map(|_| (b'a' + (next() % 26) as u8) as char)
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn one(url: &str, model: &str, text: &str, max_tokens: usize) -> Result<Sample> {
    let body = json!({
        "model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    // A full queue (429) is retried: the load is what the server admits.
    let r = loop {
        match ureq::post(&format!("{url}/v1/completions"))
            .header("Content-Type", "application/json")
            .send(body.to_string())
        {
            Err(ureq::Error::StatusCode(429)) => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            r => break r.context("sending a request")?,
        }
    };
    let (mut first, mut last, mut tokens) = (None, start, 0);
    for line in BufReader::new(r.into_body().into_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data)?;
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        } else if v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            last = Instant::now();
            first.get_or_insert(last);
        }
    }
    let first = first.unwrap_or(last);
    let ttft = (first - start).as_secs_f64();
    let tpot = (tokens > 1).then(|| (last - first).as_secs_f64() / (tokens - 1) as f64);
    Ok(Sample { ttft, tpot, tokens })
}

/// One decode-step histogram of the server's `/metrics` (host work per step, launch gap):
/// cumulative counts by bucket bound (seconds, `+Inf` last), all empty where it has none.
type Buckets = Vec<(f64, f64)>;

fn step_times(url: &str) -> [Buckets; 2] {
    let text = ureq::get(&format!("{url}/metrics"))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok())
        .unwrap_or_default();
    [
        "dsv4_decode_step_host_seconds",
        "dsv4_decode_launch_gap_seconds",
    ]
    .map(|h| {
        let prefix = format!("{h}_bucket{{le=\"");
        text.lines()
            .filter_map(|l| {
                let (le, v) = l.strip_prefix(&prefix)?.split_once("\"} ")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, v.trim().parse().ok()?))
            })
            .collect()
    })
}

/// The median between two `step_times` readings, as the bound of the bucket that holds it
/// ("≤ 20 µs"; "-" without observations).
fn median_us(before: &[(f64, f64)], after: &[(f64, f64)]) -> String {
    let counts: Vec<(f64, f64)> = after
        .iter()
        .map(|&(le, n)| {
            let was = before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, n - was)
        })
        .collect();
    let total = counts.last().map_or(0.0, |c| c.1);
    match counts.iter().find(|c| total > 0.0 && c.1 >= total / 2.0) {
        Some(&(le, _)) if le.is_finite() => format!("≤ {:.0}", le * 1e6),
        Some(_) => "> 10000".into(),
        None => "-".into(),
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn bench_serve(a: LoadArgs) -> Result<()> {
    let url = a.url.trim_end_matches('/').to_string();
    let model = match a.model {
        Some(m) => m,
        None => {
            let mut r = ureq::get(&format!("{url}/v1/models"))
                .call()
                .with_context(|| format!("listing the models of {url}"))?;
            let v: Value = serde_json::from_str(&r.body_mut().read_to_string()?)?;
            v["data"][0]["id"]
                .as_str()
                .context("the server lists no model")?
                .to_string()
        }
    };
    println!(
        "{url}, model `{model}`: {} requests a run, prompts of {} words, max_tokens {}",
        a.requests, a.prompt_words, a.max_tokens
    );
    println!("| concurrency | output tok/s | requests/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | tokens per request | host µs per step (median) | launch gap µs (median) |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &c in &a.concurrency {
        if c == 0 {
            bail!("--concurrency 0");
        }
        let total = a.requests.max(c);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let steps_before = step_times(&url);
        let start = Instant::now();
        let samples: Vec<Sample> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..c)
                .map(|_| {
                    s.spawn(|| -> Result<Vec<Sample>> {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if i >= total {
                                return Ok(out);
                            }
                            let text =
                                prompt(a.prompt_words, a.seed ^ ((i as u64 + 1) * 0x9e37_79b9));
                            out.push(one(&url, &model, &text, a.max_tokens)?);
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("a client thread panicked"))
                .collect::<Result<Vec<_>>>()
                .map(|v| v.into_iter().flatten().collect())
        })?;
        let wall = start.elapsed().as_secs_f64();
        let steps = step_times(&url);
        let tokens: u64 = samples.iter().map(|s| s.tokens).sum();
        let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft * 1e3).collect();
        let mut tpot: Vec<f64> = samples
            .iter()
            .filter_map(|s| s.tpot.map(|t| t * 1e3))
            .collect();
        println!(
            "| {c} | {:.1} | {:.2} | {:.1} ms | {:.1} ms | {:.2} ms | {:.2} ms | {:.1} | {} | {} |",
            tokens as f64 / wall,
            samples.len() as f64 / wall,
            percentile(&mut ttft, 0.5),
            percentile(&mut ttft, 0.99),
            percentile(&mut tpot, 0.5),
            percentile(&mut tpot, 0.99),
            tokens as f64 / samples.len() as f64,
            median_us(&steps_before[0], &steps[0]),
            median_us(&steps_before[1], &steps[1])
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_step_time_is_the_bound_of_its_bucket() {
        let before = vec![(1e-5, 2.0), (2e-5, 2.0), (f64::INFINITY, 3.0)];
        let after = vec![(1e-5, 3.0), (2e-5, 6.0), (f64::INFINITY, 8.0)];
        // Deltas 1, 4 (cumulative), 5: the third of five falls in the 20 µs bucket.
        assert_eq!(median_us(&before, &after), "≤ 20");
        assert_eq!(median_us(&after, &after), "-");
        let slow = vec![(1e-5, 0.0), (f64::INFINITY, 2.0)];
        assert_eq!(median_us(&[], &slow), "> 10000");
    }

    #[test]
    fn prompts_are_random_words_fixed_by_the_seed() {
        let a = prompt(50, 7);
        assert_eq!(a, prompt(50, 7));
        assert_ne!(a, prompt(50, 8));
        assert_eq!(a.split(' ').count(), 50);
        assert!(a.chars().all(|c| c == ' ' || c.is_ascii_lowercase()));
        let mut v = vec![3.0, 1.0, 2.0];
        assert_eq!(
            (percentile(&mut v, 0.5), percentile(&mut v, 1.0)),
            (2.0, 3.0)
        );
    }
}
