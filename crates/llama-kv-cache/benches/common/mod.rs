//! Timing helpers shared by the benches.

use std::time::Duration;

/// Nanoseconds of a duration.
pub fn ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

/// The median of the samples.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A time for the tables.
pub fn fmt(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.1} ns")
    } else if ns < 1e6 {
        format!("{:.1} us", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}
