//! A timeline of launches as they ran, from a timeline build's log ([`Device::with_timeline`];
//! `DSV4_TIMELINE` in dsv4_common.cuh): each warp of each launch left its entry, its first
//! dependency wait's return and its exit on the GPU's global clock. This groups the warps back
//! into launches and lays them out in order of their ends: how long after the previous launch
//! ended each one ended (its place on the path) and how long after it its first warp got past
//! its wait (the hand-over).
//!
//! [`Device::with_timeline`]: super::Device::with_timeline

use std::collections::HashMap;
use std::fmt::Write as _;

pub use dsv4_kernels::timeline::names as kernel_names;

/// SMs the log has room for (`TIMELINE_SMS`), u64 words a record (`TIMELINE_WORDS`).
const SMS: usize = 256;
const WORDS: usize = 5;
/// The log's per-SM record counts, in front of the records.
pub(crate) const COUNT_BYTES: usize = 4 * SMS;

/// Bytes of a log of `per_sm` records an SM.
pub(crate) fn log_bytes(per_sm: u32) -> usize {
    COUNT_BYTES + SMS * per_sm as usize * WORDS * 8
}

/// One warp of one launch, times in ns of the GPU's global clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WarpRecord {
    /// The kernel's tag (`dsv4_kernels::timeline::tag` of its name).
    pub tag: u32,
    pub sm: u16,
    pub warp: u16,
    pub block: u32,
    /// Blocks in the launch.
    pub grid: u32,
    pub entry: u64,
    /// When its first `griddepcontrol.wait` returned, if it waited.
    pub wait: Option<u64>,
    pub exit: u64,
}

/// The records of a log read back, and how many did not fit.
pub(crate) fn parse(log: &[u8], per_sm: u32) -> (Vec<WarpRecord>, usize) {
    let word = |i: usize| u64::from_ne_bytes(log[COUNT_BYTES + 8 * i..][..8].try_into().unwrap());
    let (mut records, mut dropped) = (Vec::new(), 0);
    for sm in 0..SMS {
        let count = u32::from_ne_bytes(log[4 * sm..][..4].try_into().unwrap());
        dropped += count.saturating_sub(per_sm) as usize;
        for i in 0..count.min(per_sm) as usize {
            let r = (sm * per_sm as usize + i) * WORDS;
            let (id, place) = (word(r), word(r + 1));
            records.push(WarpRecord {
                tag: (id >> 32) as u32,
                sm: (id >> 16) as u16,
                warp: id as u16,
                block: (place >> 32) as u32,
                grid: place as u32,
                entry: word(r + 2),
                wait: Some(word(r + 3)).filter(|&w| w != 0),
                exit: word(r + 4),
            });
        }
    }
    (records, dropped)
}

/// One launch: its warps' earliest entry, first wait return and latest exit.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchSpan {
    pub tag: u32,
    pub blocks: u32,
    pub warps: usize,
    /// SMs its blocks ran on, and the most blocks one of them ran.
    pub sms: usize,
    pub most_per_sm: usize,
    pub start: u64,
    pub wait: Option<u64>,
    pub end: u64,
}

/// The records grouped into launches, in order of their ends. A launch is told from the
/// kernel's other launches of the same grid by order: the k-th stamp of a (block, warp) in
/// entry order belongs to its k-th launch. That holds for launches of one kernel and grid one
/// after the other on a stream with the same block size; such launches on two streams at
/// once, or with different block sizes, can be mixed up.
pub fn launches(records: &[WarpRecord]) -> Vec<LaunchSpan> {
    let mut order: Vec<&WarpRecord> = records.iter().collect();
    order.sort_by_key(|r| (r.entry, r.exit));
    let mut seen: HashMap<(u32, u32, u32, u16), usize> = HashMap::new();
    // Per (tag, grid, k): the span and its warps' (SM, block) places.
    type Places = Vec<(u16, u32)>;
    let mut spans: HashMap<(u32, u32, usize), (LaunchSpan, Places)> = HashMap::new();
    for r in order {
        let k = seen.entry((r.tag, r.grid, r.block, r.warp)).or_insert(0);
        let (span, places) = spans.entry((r.tag, r.grid, *k)).or_insert_with(|| {
            (
                LaunchSpan {
                    tag: r.tag,
                    blocks: r.grid,
                    warps: 0,
                    sms: 0,
                    most_per_sm: 0,
                    start: r.entry,
                    wait: None,
                    end: r.exit,
                },
                Vec::new(),
            )
        });
        *k += 1;
        span.warps += 1;
        span.start = span.start.min(r.entry);
        span.end = span.end.max(r.exit);
        span.wait = match (span.wait, r.wait) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        places.push((r.sm, r.block));
    }
    let mut out: Vec<LaunchSpan> = spans
        .into_values()
        .map(|(mut span, mut places)| {
            places.sort_unstable();
            places.dedup();
            // Runs of one SM's distinct blocks.
            for run in places.chunk_by(|a, b| a.0 == b.0) {
                span.sms += 1;
                span.most_per_sm = span.most_per_sm.max(run.len());
            }
            span
        })
        .collect();
    out.sort_by_key(|s| (s.end, s.start));
    out
}

/// A table of `spans` (from [`launches`]), µs from the first launch's start: each launch's
/// start, first wait return and end, its place on the path (its end minus the previous end),
/// its hand-over (its first wait return minus the latest end before it), blocks, SMs, the
/// most blocks on one SM and kernel name (`names`: by tag). Then the split of the whole span
/// by kernel: each kernel's launches and their places on the path summed (together the span
/// from the first start to the last end), largest first.
pub fn report(spans: &[LaunchSpan], names: &HashMap<u32, &str>) -> String {
    let t0 = spans.iter().map(|s| s.start).min().unwrap_or(0);
    let us = |t: u64| (t as f64 - t0 as f64) / 1e3;
    let mut out =
        String::from("   start     wait      end  on path  hand-over  blocks  SMs  most  kernel\n");
    let mut prev = t0;
    for (i, s) in spans.iter().enumerate() {
        let hand_over = s.wait.and_then(|w| {
            spans[..i]
                .iter()
                .map(|p| p.end)
                .filter(|&e| e <= w)
                .max()
                .map(|e| (w - e) as f64 / 1e3)
        });
        let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
        let _ = writeln!(
            out,
            "{:8.2} {:>8} {:8.2} {:8.2} {:>10} {:7} {:4} {:5}  {}",
            us(s.start),
            opt(s.wait.map(us)),
            us(s.end),
            (s.end as f64 - prev as f64) / 1e3,
            opt(hand_over),
            s.blocks,
            s.sms,
            s.most_per_sm,
            names.get(&s.tag).copied().unwrap_or("?"),
        );
        prev = s.end;
    }
    let mut by_kernel: HashMap<&str, (usize, u64)> = HashMap::new();
    let mut prev = t0;
    for s in spans {
        let k = by_kernel
            .entry(names.get(&s.tag).copied().unwrap_or("?"))
            .or_default();
        k.0 += 1;
        k.1 += s.end - prev;
        prev = s.end;
    }
    let total = (prev - t0).max(1) as f64;
    let mut split: Vec<_> = by_kernel.into_iter().collect();
    split.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(b.0)));
    out.push_str("\nlaunches  on path (µs)  share  kernel\n");
    for (name, (n, t)) in split {
        let _ = writeln!(
            out,
            "{n:8} {:14.2} {:5.1}%  {name}",
            t as f64 / 1e3,
            100.0 * t as f64 / total
        );
    }
    out
}

/// The times (µs) between consecutive ends of `kernel`'s launches among `spans` (from
/// [`launches`], in order of their ends; `names` by tag): the spans of the parts of a step
/// that each end with one launch of it.
pub fn between_ends(spans: &[LaunchSpan], names: &HashMap<u32, &str>, kernel: &str) -> Vec<f64> {
    let ends: Vec<u64> = spans
        .iter()
        .filter(|s| names.get(&s.tag).copied() == Some(kernel))
        .map(|s| s.end)
        .collect();
    ends.windows(2)
        .map(|w| (w[1] - w[0]) as f64 / 1e3)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(
        tag: u32,
        block: u32,
        warp: u16,
        grid: u32,
        entry: u64,
        wait: Option<u64>,
        exit: u64,
    ) -> WarpRecord {
        WarpRecord {
            tag,
            sm: (block % 3) as u16,
            warp,
            block,
            grid,
            entry,
            wait,
            exit,
        }
    }

    #[test]
    fn the_log_layout_is_the_kernels() {
        let common = dsv4_kernels::HEADERS
            .iter()
            .find(|h| h.name == "dsv4_common.cuh")
            .unwrap();
        let want = format!("TIMELINE_SMS = {SMS}, TIMELINE_WORDS = {WORDS};");
        assert!(
            common.contents.contains(&want),
            "dsv4_common.cuh lacks `{want}`"
        );
    }

    #[test]
    fn warps_group_into_launches_in_order_of_their_ends() {
        // Kernel 7 twice (2 blocks of 2 warps), kernel 9 once between them, its warps
        // starting early and waiting; records in no particular order.
        let mut records = Vec::new();
        for (launch, t) in [(0u64, 1_000u64), (1, 9_000)] {
            for b in 0..2 {
                for w in 0..2 {
                    let e = t + 100 * (2 * b + w as u64);
                    records.push(rec(7, b as u32, w, 2, e, None, e + 2_000 + launch * 10));
                }
            }
        }
        records.push(rec(9, 0, 0, 1, 2_500, Some(3_500), 5_000));
        records.push(rec(9, 0, 1, 1, 2_600, Some(3_600), 5_500));
        records.reverse();
        let spans = launches(&records);
        let got: Vec<(u32, u64, Option<u64>, u64, usize)> = spans
            .iter()
            .map(|s| (s.tag, s.start, s.wait, s.end, s.warps))
            .collect();
        assert_eq!(
            got,
            [
                (7, 1_000, None, 3_300, 4),
                (9, 2_500, Some(3_500), 5_500, 2),
                (7, 9_000, None, 11_310, 4)
            ]
        );
        let names = HashMap::from([(7, "seven"), (9, "nine")]);
        let table = report(&spans, &names);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4 + 1 + 3, "{table}");
        // nine: ends 2.2 us after seven, and its first wait returned 0.2 us after seven ended.
        assert!(lines[2].ends_with("nine"), "{table}");
        assert!(
            lines[2].contains(" 2.20 ") && lines[2].contains(" 0.20 "),
            "{table}"
        );
        // The split: seven's two launches 2.30 + 5.81 us of the 10.31 from first start to
        // last end, nine's 2.20.
        assert!(
            lines[6].trim_start().starts_with("2 ")
                && lines[6].contains(" 8.11 ")
                && lines[6].ends_with("seven"),
            "{table}"
        );
        assert!(
            lines[7].contains(" 2.20 ") && lines[7].contains("21.3%") && lines[7].ends_with("nine"),
            "{table}"
        );
    }

    #[test]
    fn between_ends_spans_consecutive_launches_of_one_kernel() {
        let span = |tag, end| LaunchSpan {
            tag,
            blocks: 1,
            warps: 1,
            sms: 1,
            most_per_sm: 1,
            start: 0,
            wait: None,
            end,
        };
        let spans = [span(1, 1000), span(2, 2500), span(1, 4000), span(1, 9000)];
        let names = HashMap::from([(1, "mix"), (2, "other")]);
        assert_eq!(between_ends(&spans, &names, "mix"), vec![3.0, 5.0]);
        assert!(between_ends(&spans, &names, "other").is_empty());
        assert!(between_ends(&spans, &names, "absent").is_empty());
    }

    #[test]
    fn a_launch_counts_its_sms_and_the_most_blocks_on_one() {
        // Five blocks of two warps on SMs block % 3: SMs 0 and 1 ran two blocks each, SM 2 one.
        let records: Vec<WarpRecord> = (0..5u32)
            .flat_map(|b| (0..2u16).map(move |w| rec(4, b, w, 5, 10 * b as u64, None, 100)))
            .collect();
        let spans = launches(&records);
        assert_eq!(spans.len(), 1);
        assert_eq!(
            (spans[0].sms, spans[0].most_per_sm, spans[0].warps),
            (3, 2, 10)
        );
        let table = report(&spans, &HashMap::from([(4, "four")]));
        let row = table.lines().nth(1).unwrap();
        assert!(row.ends_with("      5    3     2  four"), "{table}");
    }

    #[test]
    fn a_log_reads_back_its_records_and_counts_what_did_not_fit() {
        let per_sm = 2u32;
        let mut log = vec![0u8; log_bytes(per_sm)];
        let mut put = |sm: usize, i: usize, words: [u64; 5]| {
            for (k, w) in words.iter().enumerate() {
                let at = COUNT_BYTES + 8 * ((sm * per_sm as usize + i) * WORDS + k);
                log[at..at + 8].copy_from_slice(&w.to_ne_bytes());
            }
        };
        put(
            3,
            0,
            [(5u64 << 32) | (3 << 16) | 1, (4u64 << 32) | 8, 100, 0, 200],
        );
        put(
            3,
            1,
            [
                (6u64 << 32) | (3 << 16) | 2,
                (1u64 << 32) | 2,
                150,
                170,
                300,
            ],
        );
        log[4 * 3..4 * 3 + 4].copy_from_slice(&5u32.to_ne_bytes());
        let (records, dropped) = parse(&log, per_sm);
        assert_eq!(dropped, 3);
        assert_eq!(
            records,
            [
                WarpRecord {
                    tag: 5,
                    sm: 3,
                    warp: 1,
                    block: 4,
                    grid: 8,
                    entry: 100,
                    wait: None,
                    exit: 200
                },
                WarpRecord {
                    tag: 6,
                    sm: 3,
                    warp: 2,
                    block: 1,
                    grid: 2,
                    entry: 150,
                    wait: Some(170),
                    exit: 300
                },
            ]
        );
    }

    /// Three dependent launches on a timeline device: each is one launch of its kernel in the
    /// log, each waits past the end of the one before it, and the stamping kernels still
    /// compute what the CPU does.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_a_timeline_holds_each_launch_after_the_one_it_waits_for() {
        use crate::gpu::rows::{reference, rms_norm_rows};
        use crate::gpu::{DType, Device};
        let dev = Device::with_timeline(0, 1024).unwrap();
        let (rows, width) = (96, 512);
        let x: Vec<f32> = (0..rows * width)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let xd = dev.upload(DType::F32, &[rows, width], &x).unwrap();
        let mut bufs: Vec<_> = (0..3)
            .map(|_| dev.alloc::<f32>(DType::F32, &[rows, width]).unwrap())
            .collect();
        dev.synchronize().unwrap();
        dev.timeline_clear().unwrap();
        rms_norm_rows(&dev, &xd, None, 1e-6, &mut bufs[0], None).unwrap();
        for i in 1..3 {
            let (done, next) = bufs.split_at_mut(i);
            rms_norm_rows(&dev, &done[i - 1], None, 1e-6, &mut next[0], None).unwrap();
        }
        let (records, dropped) = dev.timeline_records().unwrap();
        assert_eq!(dropped, 0);
        let spans = launches(&records);
        let names = kernel_names();
        assert_eq!(spans.len(), 3, "{}", report(&spans, &names));
        for (i, s) in spans.iter().enumerate() {
            assert_eq!(names[&s.tag], "rms_norm_rows");
            assert!(s.start <= s.end && s.warps >= s.blocks as usize, "{s:?}");
            if i > 0 {
                let wait = s.wait.expect("a programmatic launch waits");
                assert!(
                    wait >= spans[i - 1].end,
                    "launch {i} got past its wait before its input was written: {spans:?}"
                );
            }
        }
        let mut want = x;
        for _ in 0..3 {
            reference::rms_norm_rows(&mut want, width, None, 1e-6);
        }
        let got = dev.download(&bufs[2]).unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
        }
    }
}
