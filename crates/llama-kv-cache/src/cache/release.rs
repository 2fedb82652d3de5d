//! Handing the tensor memory of freed cells back to the OS: after `seq_rm`, `seq_keep` and a
//! defrag, the pages of host tensors that only free cells use are released (`MADV_DONTNEED`),
//! so an app that dropped a long chat no longer pays for it, and `resident_bytes` counts what
//! is left. `clear` releases whole tensors ([`SeedCache::clear`]).
//!
//! Releasing costs a system call per run of free cells and tensor (per V channel for a
//! transposed V), and faulting the pages back in costs again when cells are reused, so an
//! operation releases only when it freed at least [`RELEASE_MIN`] bytes of tensors, and a
//! transposed V only runs of at least [`V_TRANS_RUN_MIN`] bytes per channel.
//!
//! By default the release decays, as allocators purge (jemalloc's `dirty_decay_ms`, mimalloc's
//! `purge_delay`): a decode loop removes and refills cells all the time (rollbacks, context
//! shifts, parallel slots), and releasing inside each operation made it pay a system call and
//! a refault per page. The spans an operation freed are remembered and handed back once they
//! stayed free for [`Release::Decay`]'s delay ([`SeedCache::release_due`], called by whoever
//! keeps the clock: the binding's timer); a cell reused before then keeps its pages, at no
//! cost. Freed bytes awaiting release above the watermark are handed back at once, and
//! `clear` always hands back at once.

use std::ops::Range;
use std::time::Instant;

use crate::cache::release_policy::{Pending, Release, Span};
use crate::cache::SeedCache;
use crate::error::Result;

/// Tensor bytes an operation must free (over all layers) before it releases pages.
pub const RELEASE_MIN: usize = 1 << 20;

/// The smallest page an OS uses: a run of free cells shorter than this in every tensor has no
/// whole page to give back.
const PAGE_MIN: usize = 4096;

/// Bytes per channel a run of free cells must span in a transposed V to be released there:
/// each channel is a system call.
const V_TRANS_RUN_MIN: usize = 64 << 10;

/// Spans awaiting release a cache remembers before it folds them into one.
const PENDING_MAX: usize = 64;

impl SeedCache {
    /// How the cache hands freed memory back ([`Release`]).
    pub fn release(&self) -> Release {
        self.release
    }

    /// Sets how the cache hands freed memory back; a switch away from decay settles what
    /// awaits release: handed back now, or kept with [`Release::Off`].
    pub fn set_release(&mut self, release: Release) -> Result<()> {
        self.release = release;
        match release {
            Release::Now => self.release_pending(),
            Release::Off => {
                self.pending = Pending::default();
                Ok(())
            }
            Release::Decay { .. } => Ok(()),
        }
    }

    /// When the next span awaiting release is due, if any.
    pub fn next_release(&self) -> Option<Instant> {
        let Release::Decay { delay, .. } = self.release else {
            return None;
        };
        self.pending.spans.iter().map(|s| s.at + delay).min()
    }

    /// Hands back the pages of the spans that have stayed free for the delay by `now` (cells
    /// reused since keep theirs); when the next is due.
    pub fn release_due(&mut self, now: Instant) -> Result<Option<Instant>> {
        let Release::Decay { delay, .. } = self.release else {
            return Ok(None);
        };
        let (due, later): (Vec<Span>, Vec<Span>) = std::mem::take(&mut self.pending.spans)
            .into_iter()
            .partition(|s| s.at + delay <= now);
        self.pending.bytes = later.iter().map(|s| s.bytes).sum();
        self.pending.spans = later;
        for span in due {
            self.release_runs(span.cells)?;
        }
        Ok(self.next_release())
    }

    /// Hands back now the pages of every free cell, whatever awaits release.
    pub fn release_unused(&mut self) -> Result<()> {
        self.pending = Pending::default();
        if self.release == Release::Off || self.params.recurrent {
            return Ok(());
        }
        self.release_runs(0..self.params.size as usize)
    }

    /// Hands back every span awaiting release.
    fn release_pending(&mut self) -> Result<()> {
        let Pending { spans, .. } = std::mem::take(&mut self.pending);
        spans
            .into_iter()
            .try_for_each(|s| self.release_runs(s.cells))
    }

    /// After an operation freed `freed` cells within `span`: releases the pages of every run of
    /// free cells that meets `span` now or once the delay has passed, if that is worth it.
    pub(crate) fn release_freed(&mut self, span: Range<usize>, freed: usize) -> Result<()> {
        let bytes = freed.saturating_mul(self.bytes_per_cell());
        if self.params.recurrent || span.is_empty() || bytes < RELEASE_MIN {
            return Ok(());
        }
        match self.release {
            Release::Off => Ok(()),
            Release::Now => self.release_runs(span),
            Release::Decay { watermark, .. } => {
                self.defer(span, bytes, Instant::now());
                // the spans' bytes count cells reused since: above the watermark, count what
                // is really still free before handing anything back
                if self.pending.bytes > watermark {
                    self.pending.bytes = self.pending_free_bytes();
                }
                if self.pending.bytes > watermark {
                    return self.release_pending();
                }
                Ok(())
            }
        }
    }

    /// Remembers `span`, freed at `at`, for release once the delay has passed; past
    /// [`PENDING_MAX`] spans, all fold into one that covers them, freed at `at`.
    fn defer(&mut self, cells: Range<usize>, bytes: usize, at: Instant) {
        let p = &mut self.pending;
        p.bytes = p.bytes.saturating_add(bytes);
        p.spans.push(Span { cells, at, bytes });
        if p.spans.len() > PENDING_MAX {
            let start = p.spans.iter().map(|s| s.cells.start).min().unwrap_or(0);
            let end = p.spans.iter().map(|s| s.cells.end).max().unwrap_or(0);
            let bytes = p.bytes;
            p.spans = vec![Span {
                cells: start..end,
                at,
                bytes,
            }];
        }
    }

    /// Tensor bytes of the cells still free within the spans awaiting release, each cell once.
    fn pending_free_bytes(&self) -> usize {
        let mut spans: Vec<Range<usize>> =
            self.pending.spans.iter().map(|s| s.cells.clone()).collect();
        spans.sort_by_key(|s| s.start);
        let mut union: Vec<Range<usize>> = Vec::new();
        for s in spans {
            match union.last_mut() {
                Some(last) if s.start <= last.end => last.end = last.end.max(s.end),
                _ => union.push(s),
            }
        }
        // a run meets its span and may reach past it: only the cells inside count
        let free: usize = (union.into_iter())
            .flat_map(|span| {
                let runs = self.cells.free_runs(span.clone(), 1);
                runs.into_iter()
                    .map(move |(start, end)| end.min(span.end) - start.max(span.start))
            })
            .sum();
        free.saturating_mul(self.bytes_per_cell())
    }

    /// Releases the pages of every run of free cells that meets `span`.
    fn release_runs(&mut self, span: Range<usize>) -> Result<()> {
        let size = self.params.size as usize;
        let (v_trans, v_el) = (self.v_trans(), self.params.type_v.type_size());
        // a run whose rows fill no whole page of any tensor cannot give one back: skip it
        // without a call per tensor (keeping one sequence of eight interleaved ones leaves
        // thousands of such runs)
        let widest = self
            .layers
            .iter()
            .map(|l| l.k_row.max(l.v_row))
            .max()
            .unwrap_or(0);
        let min_run = PAGE_MIN.div_ceil(widest.max(1));
        for (start, end) in self.cells.free_runs(span, min_run) {
            let n = end - start;
            for l in &mut self.layers {
                l.k.release_range(start * l.k_row, n * l.k_row)?;
                if !v_trans {
                    l.v.release_range(start * l.v_row, n * l.v_row)?;
                } else if n * v_el >= V_TRANS_RUN_MIN {
                    for c in 0..l.n_embd_v {
                        l.v.release_range((c * size + start) * v_el, n * v_el)?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::cache::release_policy::Release;
    use crate::cache::SeedCache;
    use crate::cells::ubatch::UBatch;
    use crate::params::CacheParams;
    use crate::tensors::storage::Tensor;
    use crate::ReadOptions;
    use crate::WriteOptions;

    /// 4,096 cells of 256-wide f16 rows, 2 layers: 2 MiB tensors, so each is a mapping.
    const SIZE: u32 = 4096;
    const ROW: usize = 512;

    /// A cache whose cells hold sequence 0 at `0..half` and sequence 1 after it, every row
    /// written with its layer and tensor's byte, releasing freed memory inside each operation.
    fn two_sequences(flash_attn: bool, size: u32) -> SeedCache {
        releasing(Release::Now, flash_attn, size)
    }

    /// [`two_sequences`] under `release`.
    fn releasing(release: Release, flash_attn: bool, size: u32) -> SeedCache {
        let mut p = CacheParams::new(size, 2, 256, 256);
        p.flash_attn = flash_attn;
        p.n_seq_max = 2;
        let mut c = SeedCache::new(p).unwrap();
        c.set_release(release).unwrap();
        let half = size / 2;
        c.find_slot(&UBatch::sequence(0, 0, half)).unwrap().unwrap();
        c.find_slot(&UBatch::sequence(1, 0, half)).unwrap().unwrap();
        for il in 0..2 {
            for (which, byte) in [(Tensor::K, 1 + il as u8), (Tensor::V, 3 + il as u8)] {
                c.write_rows(il, which, 0, &vec![byte; size as usize * ROW])
                    .unwrap();
            }
        }
        c
    }

    /// Rows of cells `cells` of every tensor hold their byte.
    fn rows_hold(c: &SeedCache, first: u32, n: u32, want: impl Fn(u32, Tensor) -> u8) -> bool {
        (0..2).all(|il| {
            [Tensor::K, Tensor::V].into_iter().all(|which| {
                let b = want(il, which);
                c.read_rows(il, which, first, n)
                    .unwrap()
                    .iter()
                    .all(|&x| x == b)
            })
        })
    }

    fn written(il: u32, which: Tensor) -> u8 {
        match which {
            Tensor::K => 1 + il as u8,
            Tensor::V => 3 + il as u8,
        }
    }

    #[test]
    fn seq_rm_hands_back_the_pages_of_the_cells_it_frees() {
        let mut c = two_sequences(true, SIZE);
        let total = c.total_size();
        assert_eq!(c.host_resident_bytes(), total);
        assert!(c.seq_rm(0, -1, -1).unwrap());
        assert_eq!(c.host_resident_bytes(), total / 2, "sequence 0's half");
        assert!(
            rows_hold(&c, SIZE / 2, SIZE / 2, written),
            "sequence 1 untouched"
        );
        assert!(
            rows_hold(&c, 0, SIZE / 2, |_, _| 0),
            "freed rows read zeros"
        );
        // a small removal (under RELEASE_MIN) keeps its pages
        assert!(c.seq_rm(1, 0, 16).unwrap());
        assert_eq!(c.host_resident_bytes(), total / 2);
    }

    #[test]
    fn seq_keep_and_defrag_hand_back_what_they_free_and_move_the_rest_intact() {
        let mut c = two_sequences(true, SIZE);
        let total = c.total_size();
        c.seq_keep(1).unwrap();
        assert_eq!(c.host_resident_bytes(), total / 2);
        c.defrag_now(crate::DEFAULT_MAX_NODES).unwrap();
        // sequence 1 moved to the front; its old cells are free and handed back
        assert_eq!(c.cells.pos(0), 0);
        assert!(rows_hold(&c, 0, SIZE / 2, written));
        assert!(rows_hold(&c, SIZE / 2, SIZE / 2, |_, _| 0));
        assert_eq!(c.host_resident_bytes(), total / 2);
    }

    #[test]
    fn a_transposed_v_is_handed_back_channel_by_channel_for_long_runs() {
        // 65,536 cells: half a channel (64 KiB of f16) clears the per-channel minimum
        let size = 65_536;
        let mut c = two_sequences(false, size);
        let total = c.total_size();
        assert!(c.seq_rm(0, -1, -1).unwrap());
        assert_eq!(c.host_resident_bytes(), total / 2);
        assert!(rows_hold(&c, size / 2, size / 2, written));
    }

    #[test]
    fn with_release_off_freed_cells_keep_their_pages() {
        let mut c = releasing(Release::Off, true, SIZE);
        assert!(c.seq_rm(0, -1, -1).unwrap());
        assert_eq!(c.host_resident_bytes(), c.total_size());
        assert!(rows_hold(&c, 0, SIZE / 2, written));
    }

    /// A sequence load replaces the sequence's cells; when it fails they come back, and so
    /// must their rows: the removal inside a load hands back no page.
    #[test]
    fn regression_a_failed_sequence_load_keeps_the_rows_of_the_sequence_it_replaced() {
        let mut c = two_sequences(true, SIZE);
        let file = c
            .sequence_file_bytes(1, &[7; 2048], WriteOptions::default(), None)
            .unwrap();
        let truncated = &file[..file.len() - 100];
        assert!(c
            .load_sequence_bytes(truncated, 0, ReadOptions::default(), None)
            .is_err());
        assert_eq!(c.seq_cell_count(0).unwrap(), SIZE / 2);
        assert!(rows_hold(&c, 0, SIZE, written));
        assert_eq!(c.host_resident_bytes(), c.total_size());
    }

    const DELAY: Duration = Duration::from_millis(1000);

    fn decaying(watermark: usize) -> SeedCache {
        let release = Release::Decay {
            delay: DELAY,
            watermark,
        };
        releasing(release, true, SIZE)
    }

    #[test]
    fn decay_hands_back_freed_pages_once_they_stayed_free_for_the_delay() {
        let mut c = decaying(usize::MAX);
        let total = c.total_size();
        let before = Instant::now();
        assert!(c.seq_rm(0, -1, -1).unwrap());
        assert_eq!(
            c.host_resident_bytes(),
            total,
            "kept until the delay passes"
        );
        let due = c.next_release().expect("a span awaits release");
        assert!(due >= before + DELAY && due <= Instant::now() + DELAY);
        assert_eq!(
            c.release_due(due - Duration::from_millis(1)).unwrap(),
            Some(due)
        );
        assert_eq!(c.host_resident_bytes(), total, "not due yet");
        assert_eq!(c.release_due(due).unwrap(), None);
        assert_eq!(c.host_resident_bytes(), total / 2, "sequence 0's half");
        assert!(rows_hold(&c, SIZE / 2, SIZE / 2, written));
    }

    #[test]
    fn decay_keeps_the_pages_of_cells_reused_before_the_delay() {
        let mut c = decaying(usize::MAX);
        let total = c.total_size();
        assert!(c.seq_rm(0, -1, -1).unwrap());
        // a rollback refills the same cells before the delay ends
        let slot = c
            .find_slot(&UBatch::sequence(0, 0, SIZE / 2))
            .unwrap()
            .unwrap();
        assert_eq!(slot.head, 0);
        let due = c.next_release().unwrap();
        assert_eq!(c.release_due(due).unwrap(), None);
        assert_eq!(
            c.host_resident_bytes(),
            total,
            "no page of a reused cell handed back"
        );
        assert!(rows_hold(&c, 0, SIZE, written), "and no row lost");
    }

    #[test]
    fn decay_hands_back_at_once_above_the_watermark_and_on_clear_and_release_unused() {
        // 4 MiB freed against a 1 MiB watermark
        let mut c = decaying(1 << 20);
        let total = c.total_size();
        assert!(c.seq_rm(0, -1, -1).unwrap());
        assert_eq!(c.host_resident_bytes(), total / 2);
        assert_eq!(c.next_release(), None);

        let mut c = decaying(usize::MAX);
        assert!(c.seq_rm(0, -1, -1).unwrap());
        c.release_unused().unwrap();
        assert_eq!(c.host_resident_bytes(), total / 2);
        assert_eq!(c.next_release(), None);

        let mut c = decaying(usize::MAX);
        assert!(c.seq_rm(0, -1, -1).unwrap());
        c.clear().unwrap();
        assert_eq!((c.host_resident_bytes(), c.next_release()), (0, None));
    }

    #[test]
    fn leaving_decay_settles_what_awaits_release() {
        let mut c = decaying(usize::MAX);
        let total = c.total_size();
        assert!(c.seq_rm(0, -1, -1).unwrap());
        c.set_release(Release::Now).unwrap();
        assert_eq!(
            (c.host_resident_bytes(), c.next_release()),
            (total / 2, None)
        );

        let mut c = decaying(usize::MAX);
        assert!(c.seq_rm(0, -1, -1).unwrap());
        c.set_release(Release::Off).unwrap();
        assert_eq!((c.host_resident_bytes(), c.next_release()), (total, None));
    }

    #[test]
    fn decay_counts_only_cells_still_free_against_the_watermark() {
        // each removal frees 4 MiB against a 6 MiB watermark; the refill in between reuses
        // the first removal's cells, so the second does not pass the watermark
        let mut c = decaying(6 << 20);
        let total = c.total_size();
        for _ in 0..2 {
            assert!(c.seq_rm(0, -1, -1).unwrap());
            c.find_slot(&UBatch::sequence(0, 0, SIZE / 2))
                .unwrap()
                .unwrap();
        }
        assert!(c.seq_rm(0, -1, -1).unwrap());
        assert_eq!(
            c.host_resident_bytes(),
            total,
            "a refilled span is not free"
        );
        assert!(c.next_release().is_some());
    }
}
