use std::time::Duration;

use super::*;

const BOUNDS: &[f64] = &[0.001, 0.01, 0.1];

fn bucket_lines(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("t_seconds_bucket{")?;
            let (labels, value) = rest.split_once("} ")?;
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_sample_on_a_bound_counts_under_it_and_one_above_all_only_in_inf() {
    let h = DurationHistogram::new(BOUNDS);
    h.record(Duration::from_millis(1));
    h.record(Duration::from_micros(1_001));
    h.record(Duration::from_secs(5));
    let (cumulative, count, sum) = h.snapshot();
    assert_eq!(cumulative, vec![1, 2, 2]);
    assert_eq!(count, 3);
    assert!((sum - 5.002_001).abs() < 1e-9, "sum {sum}");
}

#[test]
fn counts_from_many_threads_all_add_up() {
    let h = std::sync::Arc::new(DurationHistogram::new(BOUNDS));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let h = h.clone();
            std::thread::spawn(move || {
                for _ in 0..10_000 {
                    h.record(Duration::from_micros(500 * (t % 3)));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (cumulative, count, _) = h.snapshot();
    assert_eq!(count, 80_000);
    assert_eq!(cumulative[0], 80_000, "every sample is at most 1 ms");
}

#[test]
fn cells_wider_than_a_line_keep_each_counter_apart() {
    let cells = Cells::new(SLOTS * 2 + 3);
    for i in 0..SLOTS * 2 + 3 {
        cells.add(i, i as u64 + 1);
    }
    for i in 0..SLOTS * 2 + 3 {
        assert_eq!(cells.total(i), i as u64 + 1);
    }
}

#[test]
fn a_rendered_family_is_cumulative_ends_in_inf_and_escapes_labels() {
    let h = DurationHistogram::new(BOUNDS);
    h.record(Duration::from_micros(20));
    h.record(Duration::from_millis(50));
    let mut out = String::new();
    let labels: &[(&str, &str)] = &[("backend", "a\"b")];
    render_family(&mut out, "t_seconds", "Test.", [(labels, &h)]);
    assert!(out.starts_with("# HELP t_seconds Test.\n# TYPE t_seconds histogram\n"));
    let buckets = bucket_lines(&out);
    let values: Vec<u64> = buckets.iter().map(|(_, v)| *v).collect();
    assert_eq!(values, vec![1, 1, 2, 2]);
    assert_eq!(buckets[0].0, "backend=\"a\\\"b\",le=\"0.001\"");
    assert_eq!(buckets[3].0, "backend=\"a\\\"b\",le=\"+Inf\"");
    assert!(
        out.contains("t_seconds_count{backend=\"a\\\"b\"} 2\n"),
        "{out}"
    );
    assert!(
        out.contains("t_seconds_sum{backend=\"a\\\"b\"} 0.05002\n"),
        "{out}"
    );
}

#[test]
fn a_sum_past_what_u64_nanoseconds_hold_is_still_right() {
    let h = DurationHistogram::new(BOUNDS);
    for _ in 0..20 {
        h.record(Duration::from_secs(1_000_000_000));
    }
    let (_, count, sum) = h.snapshot();
    assert_eq!(count, 20);
    assert!((sum - 2e10).abs() < 1.0, "sum {sum}");
}
