//! What a store reports to Prometheus ([`crate::PromptStore::metrics`]): per tier, the values
//! found and missed and the bytes read and written ([`Metered`], a backend that counts the calls
//! it passes on), and each tier's evictions; per store, the blocks rejected or found corrupt and
//! latency histograms of `lookup`, `put` and `restore` ([`Latency`]). Rendered in the text
//! exposition format (version 0.0.4) by [`render`]: a dozen families, written here rather than
//! pulled in with a metrics crate and its registry. Every series carries the store's
//! `namespace`, so the series of several stores (tenants of one process, or a fleet scraped
//! into one Prometheus) stay apart.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::backend::{pass_on, Backend, TierHealth, TierMetrics, Usage};
use crate::error::StoreResult;
use crate::events::{EventHub, TierEvents};
use crate::key::Key;

/// What one tier served, counted by [`Metered`].
#[derive(Default)]
pub struct TierCounts {
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

/// A backend that counts what passes through it and otherwise is `inner`.
pub struct Metered {
    inner: Arc<dyn Backend>,
    counts: TierCounts,
    /// The tier's event reporter, once someone observes the store: the wrapper sees what each
    /// put stored, so it reports the stores (and then the evictions they caused).
    events: OnceLock<Arc<TierEvents>>,
}

impl Metered {
    /// Counts the calls to `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Metered {
        Metered {
            inner,
            counts: TierCounts::default(),
            events: OnceLock::new(),
        }
    }

    fn found(&self, value: Option<&[u8]>) {
        let c = &self.counts;
        match value {
            Some(v) => {
                c.hits.fetch_add(1, Ordering::Relaxed);
                c.bytes_read.fetch_add(v.len() as u64, Ordering::Relaxed);
            }
            None => {
                c.misses.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn stored(&self, value: &[u8], stored: bool) {
        if stored {
            let bytes = value.len() as u64;
            self.counts
                .bytes_written
                .fetch_add(bytes, Ordering::Relaxed);
        }
    }
}

impl Backend for Metered {
    pass_on!(name, presence, put_if_absent, remove, usage, health);

    fn get_many(&self, keys: &[Key]) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let values = self.inner.get_many(keys)?;
        values.iter().for_each(|v| self.found(v.as_deref()));
        Ok(values)
    }

    fn visit_many(
        &self,
        keys: &[Key],
        visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
    ) -> StoreResult<()> {
        self.inner.visit_many(keys, &mut |i, value| {
            self.found(value);
            visit(i, value)
        })
    }

    fn put_many(&self, entries: &[(Key, &[u8])]) -> StoreResult<Vec<bool>> {
        let events = self.events.get();
        if let Some(events) = events {
            events.putting(entries.iter().map(|(k, _)| k));
        }
        let stored = self.inner.put_many(entries);
        let kept = stored.as_deref().unwrap_or(&[]);
        for ((_, v), &s) in entries.iter().zip(kept) {
            self.stored(v, s);
        }
        if let Some(events) = events {
            // on an error, what the call evicted before it failed is still reported
            let values = entries.iter().zip(kept).filter(|(_, &s)| s);
            events.report(values.map(|((_, v), _)| *v));
            events.put_done(entries.iter().map(|(k, _)| k));
        }
        stored
    }

    fn observe(&self, hub: &Arc<EventHub>) {
        let _ = self.events.set(hub.tier(self.inner.name()));
        self.inner.observe(hub);
    }

    fn gc(&self) -> StoreResult<Usage> {
        let usage = self.inner.gc();
        if let Some(events) = self.events.get() {
            events.report(std::iter::empty());
        }
        usage
    }

    fn tier_metrics(&self) -> Vec<TierMetrics> {
        let c = &self.counts;
        vec![TierMetrics {
            name: self.inner.name(),
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            // asked by whoever knows whether the tier is up (a usage call is a round trip)
            evictions: None,
        }]
    }
}

/// Upper bounds of the latency buckets, in seconds (`+Inf` is implied).
const BUCKETS: [f64; 10] = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0];

/// A latency histogram: cumulative counts per bucket, their sum and count.
#[derive(Default)]
pub struct Latency {
    /// Observations at most `BUCKETS[i]` (not cumulative; summed when rendered).
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl Latency {
    /// Records one call of `elapsed`.
    pub fn observe(&self, elapsed: Duration) {
        let s = elapsed.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

impl Latency {
    /// A timer that records the time until it is dropped: one line at the top of a call times
    /// every way out of it.
    pub fn start(&self) -> Timer<'_> {
        Timer {
            latency: self,
            since: std::time::Instant::now(),
        }
    }
}

/// See [`Latency::start`].
pub struct Timer<'a> {
    latency: &'a Latency,
    since: std::time::Instant,
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        self.latency.observe(self.since.elapsed());
    }
}

/// The latencies a store keeps.
#[derive(Default)]
pub struct Latencies {
    /// `lookup`.
    pub lookup: Latency,
    /// `put` and `put_file`.
    pub put: Latency,
    /// `restore` and `write_file` (`file_bytes`).
    pub restore: Latency,
}

/// The figures [`render`] writes.
pub struct Snapshot<'a> {
    /// The store's namespace (`""` when it names none): a label of every series.
    pub namespace: &'a str,
    /// Per tier, nearest first.
    pub tiers: Vec<TierMetrics>,
    /// Values that failed verification: damaged, and written without this store's secret.
    pub corrupt: u64,
    pub rejected: u64,
    /// Latency of each operation, by name.
    pub latencies: [(&'static str, &'a Latency); 3],
}

/// The Prometheus text exposition of `s`.
pub fn render(s: &Snapshot<'_>) -> String {
    type Field = fn(&TierMetrics) -> Option<u64>;
    let per_tier: [(&str, &str, Field); 5] = [
        (
            "llama_kv_store_hits_total",
            "Values found, per tier.",
            |t| Some(t.hits),
        ),
        (
            "llama_kv_store_misses_total",
            "Values asked for and absent, per tier.",
            |t| Some(t.misses),
        ),
        (
            "llama_kv_store_read_bytes_total",
            "Bytes of values read, per tier.",
            |t| Some(t.bytes_read),
        ),
        (
            "llama_kv_store_written_bytes_total",
            "Bytes of values this process stored, per tier.",
            |t| Some(t.bytes_written),
        ),
        (
            "llama_kv_store_evictions_total",
            "Values the tier evicted (its own count).",
            |t| t.evictions,
        ),
    ];
    let ns = ("namespace", s.namespace);
    let mut out = String::new();
    for (name, help, field) in per_tier {
        header(&mut out, name, "counter", help);
        for t in &s.tiers {
            if let Some(v) = field(t) {
                let _ = writeln!(out, "{name}{} {v}", labels(&[ns, ("tier", t.name)]));
            }
        }
    }
    for (name, help, v) in [
        (
            "llama_kv_store_corrupt_blocks_total",
            "Values that failed their checksum or header check: counted misses.",
            s.corrupt,
        ),
        (
            "llama_kv_store_rejected_blocks_total",
            "Values not written with this store's secret: counted misses, replaced by the next put.",
            s.rejected,
        ),
    ] {
        header(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name}{} {v}", labels(&[ns]));
    }
    let name = "llama_kv_store_call_duration_seconds";
    header(
        &mut out,
        name,
        "histogram",
        "Duration of lookup, put and restore calls (put and restore include putFile and writeFile).",
    );
    for (op, l) in s.latencies {
        let mut cumulative = 0;
        let bounds = BUCKETS
            .iter()
            .map(|b| b.to_string())
            .chain(["+Inf".to_string()]);
        for (i, bound) in bounds.enumerate() {
            cumulative += l.counts[i].load(Ordering::Relaxed);
            let le = labels(&[ns, ("op", op), ("le", &bound)]);
            let _ = writeln!(out, "{name}_bucket{le} {cumulative}");
        }
        let sum = l.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let op = labels(&[ns, ("op", op)]);
        let _ = writeln!(out, "{name}_sum{op} {sum}");
        let _ = writeln!(out, "{name}_count{op} {cumulative}");
    }
    out
}

/// `{a="x",b="y"}`, each value escaped as the text format wants (a namespace is the app's
/// string: a tenant id may hold anything).
fn labels(pairs: &[(&str, &str)]) -> String {
    let mut out = String::from("{");
    for (i, (name, value)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{name}=\"");
        for c in value.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push('}');
    out
}

/// The `# HELP` and `# TYPE` lines of a family.
fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryBackend, TieredBackend};

    fn key(b: u8) -> Key {
        Key([b; 32])
    }

    #[test]
    fn a_metered_backend_counts_hits_misses_and_bytes_both_ways() {
        let m = Metered::new(Arc::new(MemoryBackend::new(None)));
        assert_eq!(
            m.put_many(&[(key(1), b"abc"), (key(2), b"de")]).unwrap(),
            [true, true]
        );
        assert!(
            !m.put_if_absent(&key(1), b"xyz").unwrap(),
            "present: nothing written"
        );
        m.get_many(&[key(1), key(3)]).unwrap();
        m.visit_many(&[key(2)], &mut |_, _| true).unwrap();
        let t = &m.tier_metrics()[0];
        assert_eq!((t.name, t.hits, t.misses), ("memory", 2, 1));
        assert_eq!((t.bytes_read, t.bytes_written), (5, 5));
    }

    #[test]
    fn tiers_are_counted_each_and_their_evictions_asked() {
        let tiered = TieredBackend::new(vec![
            Arc::new(MemoryBackend::new(None)),
            Arc::new(MemoryBackend::new(None)),
        ])
        .unwrap();
        tiered.put_many(&[(key(1), b"abcd")]).unwrap();
        tiered.get_many(&[key(1), key(9)]).unwrap();
        let m = tiered.tier_metrics();
        assert_eq!(m.len(), 2);
        // the near tier answers key 1; the far one is asked only for key 9
        assert_eq!(
            (m[0].hits, m[0].misses, m[1].hits, m[1].misses),
            (1, 1, 0, 1)
        );
        assert_eq!((m[0].bytes_written, m[1].bytes_written), (4, 4));
        assert!(m.iter().all(|t| t.evictions == Some(0)));
    }

    #[test]
    fn the_exposition_has_a_help_and_type_per_family_and_cumulative_buckets() {
        let (lookup, put, restore) = (Latency::default(), Latency::default(), Latency::default());
        lookup.observe(Duration::from_micros(300));
        lookup.observe(Duration::from_millis(20));
        drop(put.start());
        let text = render(&Snapshot {
            namespace: "",
            tiers: vec![TierMetrics {
                name: "redis",
                hits: 3,
                misses: 1,
                bytes_read: 10,
                bytes_written: 20,
                evictions: None,
            }],
            corrupt: 2,
            rejected: 1,
            latencies: [("lookup", &lookup), ("put", &put), ("restore", &restore)],
        });
        for line in [
            "# TYPE llama_kv_store_hits_total counter",
            "llama_kv_store_hits_total{namespace=\"\",tier=\"redis\"} 3",
            "llama_kv_store_written_bytes_total{namespace=\"\",tier=\"redis\"} 20",
            "llama_kv_store_corrupt_blocks_total{namespace=\"\"} 2",
            "llama_kv_store_rejected_blocks_total{namespace=\"\"} 1",
            "# TYPE llama_kv_store_call_duration_seconds histogram",
            "llama_kv_store_call_duration_seconds_bucket{namespace=\"\",op=\"lookup\",le=\"0.0005\"} 1",
            "llama_kv_store_call_duration_seconds_bucket{namespace=\"\",op=\"lookup\",le=\"0.01\"} 1",
            "llama_kv_store_call_duration_seconds_bucket{namespace=\"\",op=\"lookup\",le=\"0.05\"} 2",
            "llama_kv_store_call_duration_seconds_bucket{namespace=\"\",op=\"lookup\",le=\"+Inf\"} 2",
            "llama_kv_store_call_duration_seconds_count{namespace=\"\",op=\"lookup\"} 2",
            "llama_kv_store_call_duration_seconds_count{namespace=\"\",op=\"put\"} 1",
            "llama_kv_store_call_duration_seconds_count{namespace=\"\",op=\"restore\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(
            !text.contains("evictions_total{"),
            "an unknown count is left out"
        );
        let families = text.lines().filter(|l| l.starts_with("# TYPE")).count();
        assert_eq!(
            families,
            text.lines().filter(|l| l.starts_with("# HELP")).count()
        );
        assert_eq!(families, 8);
    }

    #[test]
    fn every_series_carries_the_namespace_escaped() {
        let latency = Latency::default();
        let text = render(&Snapshot {
            namespace: "a\"b\\c\nd",
            tiers: vec![TierMetrics {
                name: "memory",
                hits: 1,
                misses: 0,
                bytes_read: 0,
                bytes_written: 0,
                evictions: Some(0),
            }],
            corrupt: 0,
            rejected: 0,
            latencies: [
                ("lookup", &latency),
                ("put", &latency),
                ("restore", &latency),
            ],
        });
        let series: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(series.len(), 5 + 2 + 3 * (BUCKETS.len() + 3));
        for line in series {
            assert!(
                line.contains("{namespace=\"a\\\"b\\\\c\\nd\""),
                "{line:?} lacks the escaped namespace"
            );
        }
        assert!(text
            .lines()
            .any(|l| l
                == "llama_kv_store_hits_total{namespace=\"a\\\"b\\\\c\\nd\",tier=\"memory\"} 1"));
    }
}
