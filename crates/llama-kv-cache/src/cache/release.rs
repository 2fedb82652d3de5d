//! Handing the tensor memory of freed cells back to the OS: after `seq_rm`, `seq_keep` and a
//! defrag, the pages of host tensors that only free cells use are released (`MADV_DONTNEED`),
//! so an app that dropped a long chat no longer pays for it, and `resident_bytes` counts what
//! is left. `clear` releases whole tensors ([`SeedCache::clear`]); the same switch,
//! [`SeedCache::set_release_memory`], turns both off.
//!
//! Releasing costs a system call per run of free cells and tensor (per V channel for a
//! transposed V), and faulting the pages back in costs again when cells are reused, so an
//! operation releases only when it freed at least [`RELEASE_MIN`] bytes of tensors, and a
//! transposed V only runs of at least [`V_TRANS_RUN_MIN`] bytes per channel.

use std::ops::Range;

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

impl SeedCache {
    /// After an operation freed `freed` cells within `span`: releases the pages of every run of
    /// free cells that meets `span`, if that is worth it.
    pub(crate) fn release_freed(&mut self, span: Range<usize>, freed: usize) -> Result<()> {
        if !self.release_memory
            || self.params.recurrent
            || span.is_empty()
            || freed.saturating_mul(self.bytes_per_cell()) < RELEASE_MIN
        {
            return Ok(());
        }
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
    /// written with its layer and tensor's byte.
    fn two_sequences(flash_attn: bool, size: u32) -> SeedCache {
        let mut p = CacheParams::new(size, 2, 256, 256);
        p.flash_attn = flash_attn;
        p.n_seq_max = 2;
        let mut c = SeedCache::new(p).unwrap();
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
    fn with_release_memory_off_freed_cells_keep_their_pages() {
        let mut c = two_sequences(true, SIZE);
        c.set_release_memory(false);
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
}
