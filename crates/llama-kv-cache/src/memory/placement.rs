//! Where llama.cpp 0.1.161's attention cache puts a ubatch: the window that frees cells of a
//! sliding-window cache, 0.1.161's cell-by-cell search from a stream's head, and the writing
//! of the tokens into the cells found (with the purge of a sequence's older positions).

use std::borrow::Cow;

use crate::cache::SeedCache;
use crate::cells::ubatch::UBatch;
use crate::cells::Cells;
use crate::memory::SwaType;

/// The window of a sliding-window cache: `n_swa` tokens under `swa_type` (0 and
/// [`SwaType::None`] for a cache of full-attention layers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// Window size in tokens.
    pub n_swa: u32,
    /// The masking rule.
    pub swa_type: SwaType,
}

impl Window {
    /// No window.
    pub const FULL: Window = Window {
        n_swa: 0,
        swa_type: SwaType::None,
    };

    /// Whether a token at `query` cannot see a cell at `cell`.
    pub fn masks(self, cell: i32, query: i32) -> bool {
        self.swa_type.is_masked(self.n_swa, cell, query)
    }
}

/// Where a ubatch went in one stream: the cells of its tokens, in ubatch order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamSlot {
    /// The stream.
    pub stream: u32,
    /// One cell per token.
    pub cells: Vec<u32>,
    /// The ubatch tokens the cells are for (all of them in a unified cache; a sequence's in a
    /// cache of one stream per sequence).
    pub(crate) tokens: Vec<usize>,
}

impl StreamSlot {
    /// The ubatch tokens the cells are for, in the same order.
    pub fn tokens(&self) -> &[usize] {
        &self.tokens
    }
}

/// Whether cell `i` can take a token: free, or held by one sequence whose next token's
/// window no longer sees it; a cell of `gone` counts without it (a sequence read frees the
/// sequence's cells before it places its own).
pub(crate) fn usable(cells: &Cells, i: usize, window: Window, gone: Option<usize>) -> bool {
    let pos = cells.pos(i);
    if pos < 0 || gone.is_some_and(|g| cells.holds_only(i, g)) {
        return true;
    }
    let mut seqs = cells.seqs(i);
    if let Some(g) = gone {
        seqs.remove(g);
        if seqs.is_empty() {
            return true;
        }
    }
    if window.swa_type == SwaType::None {
        return false;
    }
    match seqs.only() {
        Some(seq) => {
            let next = cells.seq_pos_max(seq).map_or(0, |m| m + 1);
            window.masks(pos, next)
        }
        None => false,
    }
}

/// The stream's head once `seq_rm(gone)` has run: the first cell it frees, when before the
/// head.
pub(crate) fn head_after_rm(cache: &SeedCache, gone: usize) -> u32 {
    let cells = &cache.cells;
    let first = cells.cells_of(gone).find(|&i| cells.holds_only(i, gone));
    first.map_or(cache.head, |f| cache.head.min(f as u32))
}

/// 0.1.161's search for `n` cells of one stream, one cell at a time from its head (which
/// starts over at 0 when enough cells before it are free), as if the cells of `gone` were
/// removed first.
pub(crate) fn find_cells(
    cells: &Cells,
    head: u32,
    n: usize,
    window: Window,
    gone: Option<usize>,
) -> Option<Vec<u32>> {
    let size = cells.len();
    if n > size {
        return None;
    }
    // 0.1.161 starts over at 0 when the head is past the used cells by more than 2n; the
    // cells `gone` frees are counted only when the answer depends on them (a read's head is
    // usually the removed sequence's first cell, well before that)
    let occupied = cells.occupied_count() as usize;
    let mut head = head as usize;
    let at_most_freed = gone.map_or(0, |g| cells.seq_cell_count(g) as usize);
    if head > occupied.saturating_sub(at_most_freed) + 2 * n {
        let freed = gone.map_or(0, |g| cells.count_held_only(g));
        if head > occupied.saturating_sub(freed) + 2 * n {
            head = 0;
        }
    }
    // without a window an occupied cell is never usable: runs of them are skipped a word at
    // a time, counted as tested one by one
    let skip_occupied = window.swa_type == SwaType::None && gone.is_none();
    let mut out = Vec::with_capacity(n);
    let mut tested = 0usize;
    loop {
        if head >= size {
            head = 0;
        }
        if skip_occupied {
            let free = cells.next_free_before(head, size);
            let skipped = (free - head).min(size - tested);
            tested += skipped;
            head += skipped;
            if tested >= size {
                return None;
            }
            if head >= size {
                continue;
            }
        }
        // a whole word of cells free or only the removed sequence's (as a read finds them),
        // where all of it is wanted and may be tested: taken at once
        let step = if head.is_multiple_of(64)
            && head + 64 <= size
            && size - tested >= 64
            && n - out.len() >= 64
            && cells.free_or_only_word(head / 64, gone) == u64::MAX
        {
            out.extend(head as u32..head as u32 + 64);
            64
        } else {
            if usable(cells, head, window, gone) {
                out.push(head as u32);
            }
            1
        };
        head += step;
        tested += step;
        if out.len() == n {
            return Some(out);
        }
        if tested >= size {
            return None;
        }
    }
}

/// The cells placing tokens in `at` changes, ascending: those, and every cell of a sequence
/// whose cell there is overwritten up to the overwritten position (the purge). Marked in a
/// bitmap of the stream and read back in order: sorting and merging the lists cost more than
/// the placement.
pub(crate) fn touched_by(cells: &Cells, at: &[u32]) -> Vec<usize> {
    let mut marks = vec![0u64; cells.len().div_ceil(64)];
    // the words marked, so that reading them back does not walk the whole stream (a one-token
    // placement into a cache of 65,536 cells read 1,024 words)
    let mut span = (usize::MAX, 0);
    let mut widen = |(a, b): (usize, usize)| span = (span.0.min(a), span.1.max(b));
    let mut purged: Vec<(usize, i32)> = Vec::new();
    for &c in at {
        let i = c as usize;
        marks[i / 64] |= 1 << (i % 64);
        widen((i / 64, i / 64));
        let pos = cells.pos(i);
        if let (true, Some(seq)) = (pos >= 0, cells.only_seq(i)) {
            match purged.iter_mut().find(|(s, _)| *s == seq) {
                Some((_, max)) => *max = (*max).max(pos),
                None => purged.push((seq, pos)),
            }
        }
    }
    // the purge's cells, found by position: walking every cell of the sequence was most of a
    // one-token placement that reuses a window's cell
    for (seq, max) in purged {
        if let Some(words) = cells.mark_cells_in(seq, i32::MIN, max.saturating_add(1), &mut marks) {
            widen(words);
        }
    }
    let mut out = Vec::with_capacity(at.len());
    let words = marks.iter().enumerate();
    for (w, &word) in words.take(span.1 + 1).skip(span.0) {
        let mut bits = word;
        while bits != 0 {
            out.push(w * 64 + bits.trailing_zeros() as usize);
            bits &= bits - 1;
        }
    }
    out
}

/// How many of `cells` from the first are consecutive and free: up to 64 at a time, the free
/// ones found on the occupied bitmap first and only those compared, so that a run costs a
/// compare per cell and an occupied first cell (a window's reused one) one bitmap lookup.
pub(crate) fn free_run(table: &Cells, cells: &[u32]) -> usize {
    let first = cells[0] as usize;
    let mut end = 0;
    loop {
        let limit = (end + 64).min(cells.len());
        let free_to = table.next_occupied_before(first + end, first + limit) - first;
        while end < free_to && cells[end] as usize == first + end {
            end += 1;
        }
        if end < limit || end == cells.len() {
            return end;
        }
    }
}

/// Writes the tokens of `slot` into its cells (freeing what they held) and returns, per
/// sequence whose cell was overwritten, the largest position overwritten.
pub(crate) fn put_tokens(
    cache: &mut SeedCache,
    slot: &StreamSlot,
    ub: &UBatch,
) -> Vec<(usize, i32)> {
    let per_group = ub.n_seq_tokens as usize;
    let keeps_ext = cache.cells.keeps_ext();
    let (cells, tokens) = (&slot.cells, &slot.tokens);
    let mut overwritten: Vec<(usize, i32)> = Vec::new();
    let mut j = 0;
    while j < cells.len() {
        // a run of consecutive free cells, the common case, fills a word of cells at a time
        let first = cells[j] as usize;
        let end = j + free_run(&cache.cells, &cells[j..]);
        if end > j {
            let run = &tokens[j..end];
            // consecutive tokens (every token of a sequence read) are the ubatch's own slice;
            // a slot's tokens ascend, so its ends tell
            let pos: Cow<[i32]> = match run[run.len() - 1] - run[0] == run.len() - 1 {
                true => Cow::Borrowed(&ub.pos[run[0]..run[0] + run.len()]),
                false => Cow::Owned(run.iter().map(|&k| ub.pos[k]).collect()),
            };
            // one group (a sequence read's cells) needs no token's group worked out
            match ub.seq_ids.as_slice() {
                [ids] => cache.cells.fill_free_all(first, &pos, ids),
                groups => cache
                    .cells
                    .fill_free(first, &pos, |x| &groups[run[x] / per_group]),
            }
            cache.cells.zero_deltas(first..first + run.len());
            if keeps_ext {
                for (x, &k) in run.iter().enumerate() {
                    let ext = cache.ubatch_ext(ub, k);
                    cache.cells.set_ext(first + x, ext);
                }
            }
            cache.cells.used += run.len() as u32;
            j = end;
            continue;
        }
        // a cell the window no longer sees: freed first, its sequence noted for the purge
        let (i, k) = (cells[j] as usize, tokens[j]);
        let old = cache.cells.pos(i);
        if let Some(seq) = cache.cells.seqs(i).only() {
            match overwritten.iter_mut().find(|(s, _)| *s == seq) {
                Some((_, max)) => *max = (*max).max(old),
                None => overwritten.push((seq, old)),
            }
        }
        cache.cells.clear_seqs(i);
        cache.cells.set_pos(i, -1);
        cache.cells.set_pos(i, ub.pos[k]);
        cache.cells.set_delta(i, 0);
        if keeps_ext {
            let ext = cache.ubatch_ext(ub, k);
            cache.cells.set_ext(i, ext);
        }
        for &s in &ub.seq_ids[k / per_group] {
            cache.cells.insert_seq(i, s as usize);
        }
        j += 1;
    }
    cache.cells.settle();
    // sequences in ascending order, as 0.1.161's purge loop visits them
    overwritten.sort_unstable();
    overwritten
}
