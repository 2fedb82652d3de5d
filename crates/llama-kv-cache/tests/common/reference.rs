//! A deliberately simple model of the seed's cell semantics: one `BTreeSet` of sequence ids per
//! cell (the seed's `std::set`), every operation a literal loop over all cells. The property
//! tests compare the real cache with it, and the benchmarks use it as the baseline.
#![allow(dead_code, clippy::needless_range_loop)]

use std::collections::BTreeSet;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefCell {
    pub pos: i32,
    pub delta: i32,
    pub src: i32,
    pub tail: i32,
    pub seq: BTreeSet<i32>,
}

impl Default for RefCell {
    fn default() -> Self {
        RefCell {
            pos: -1,
            delta: 0,
            src: -1,
            tail: -1,
            seq: BTreeSet::new(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct RefCache {
    pub cells: Vec<RefCell>,
    pub head: u32,
    pub used: u32,
    pub n: u32,
    pub size: u32,
    pub recurrent: bool,
    pub has_shift: bool,
}

/// The seed's `llama_kv_slot_restorer`, literally.
#[derive(Clone, Debug, Default)]
pub struct RefRestorer {
    pub head: u32,
    pub n: u32,
    pub slot_boundaries: Vec<(u32, u32)>,
    pub do_restore: bool,
}

impl RefRestorer {
    /// `save(slot_info)`: a found slot arms the restore; non-empty boundaries are kept.
    /// `boundaries` is `(head, head + n_tokens)` for a transformer slot, `(0, 0)` for a
    /// recurrent one, as the seed's `find_slot` returns them.
    pub fn save(&mut self, found: bool, boundaries: (u32, u32)) {
        if found {
            self.do_restore = true;
            if boundaries.0 != boundaries.1 {
                self.slot_boundaries.push(boundaries);
            }
        }
    }
}

fn norm(p0: i32, p1: i32) -> (i32, i32) {
    (p0.max(0), if p1 < 0 { i32::MAX } else { p1 })
}

impl RefCache {
    pub fn new(size: u32, recurrent: bool) -> RefCache {
        RefCache {
            cells: vec![RefCell::default(); size as usize],
            head: 0,
            used: 0,
            n: size,
            size,
            recurrent,
            has_shift: false,
        }
    }

    pub fn restorer(&self) -> RefRestorer {
        RefRestorer {
            head: self.head,
            n: self.n,
            ..RefRestorer::default()
        }
    }

    /// `llama_kv_slot_restorer::restore`: head and n back, then `seq_rm(-1, c0, c1)` per slot
    /// (cell indices as positions), or the whole cache for recurrent models.
    pub fn restore(&mut self, r: &RefRestorer) {
        if r.do_restore {
            self.head = r.head;
            self.n = r.n;
            if self.recurrent {
                self.seq_rm(-1, -1, -1);
            } else {
                for &(c0, c1) in &r.slot_boundaries {
                    self.seq_rm(-1, c0 as i32, c1 as i32);
                }
            }
        }
    }

    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> bool {
        let (p0, p1) = norm(p0, p1);
        if self.recurrent {
            if seq >= 0 {
                let tail = self.cells[seq as usize].tail;
                if tail >= 0 {
                    let pos = self.cells[tail as usize].pos;
                    if (0 < p0 && p0 <= pos) || (0 < p1 && p1 <= pos) {
                        return false;
                    }
                    if p0 <= pos && pos < p1 {
                        self.cells[seq as usize].tail = -1;
                    }
                }
            } else if p0 != p1 && (p0 != 0 || p1 != i32::MAX) {
                return false;
            }
        }
        let mut new_head = self.size;
        for i in 0..self.size as usize {
            let c = &mut self.cells[i];
            if c.pos >= p0 && c.pos < p1 {
                if seq < 0 {
                    c.seq.clear();
                } else if c.seq.contains(&seq) {
                    c.seq.remove(&seq);
                } else {
                    continue;
                }
                if c.seq.is_empty() {
                    if c.pos >= 0 {
                        self.used = self.used.wrapping_sub(1);
                    }
                    c.pos = -1;
                    c.src = -1;
                    if new_head == self.size {
                        new_head = i as u32;
                    }
                }
            }
        }
        if new_head != self.size && new_head < self.head {
            self.head = new_head;
        }
        true
    }

    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) {
        if src == dst {
            return;
        }
        let (p0, p1) = norm(p0, p1);
        if self.recurrent {
            let dst_tail = self.cells[dst as usize].tail;
            if dst_tail >= 0 {
                let c = &mut self.cells[dst_tail as usize];
                c.seq.remove(&dst);
                if c.seq.is_empty() {
                    c.pos = -1;
                    c.delta = -1;
                    c.src = -1;
                    self.used = self.used.wrapping_sub(1);
                }
                self.cells[dst as usize].tail = -1;
            }
            let src_tail = self.cells[src as usize].tail;
            if src_tail >= 0 {
                self.cells[src_tail as usize].seq.insert(dst);
                self.cells[dst as usize].tail = src_tail;
            }
            return;
        }
        self.head = 0;
        for c in &mut self.cells {
            if c.seq.contains(&src) && c.pos >= p0 && c.pos < p1 {
                c.seq.insert(dst);
            }
        }
    }

    pub fn seq_keep(&mut self, seq: i32) {
        let mut new_head = self.size;
        for i in 0..self.size as usize {
            if self.recurrent && i as i32 != seq {
                self.cells[i].tail = -1;
            }
            let c = &mut self.cells[i];
            if !c.seq.contains(&seq) {
                if c.pos >= 0 {
                    self.used = self.used.wrapping_sub(1);
                }
                c.pos = -1;
                c.src = -1;
                c.seq.clear();
                if new_head == self.size {
                    new_head = i as u32;
                }
            } else {
                c.seq.clear();
                c.seq.insert(seq);
            }
        }
        if new_head != self.size && new_head < self.head {
            self.head = new_head;
        }
    }

    pub fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) {
        if delta == 0 {
            return;
        }
        let (p0, p1) = norm(p0, p1);
        if p0 == p1 {
            return;
        }
        if self.recurrent {
            if seq < 0 {
                return;
            }
            let tail = self.cells[seq as usize].tail;
            if tail >= 0 {
                let c = &mut self.cells[tail as usize];
                if c.seq.contains(&seq) && p0 <= c.pos && c.pos < p1 {
                    c.pos += delta;
                }
            }
            return;
        }
        let mut new_head = self.size;
        for i in 0..self.size as usize {
            let c = &mut self.cells[i];
            if c.seq.contains(&seq) && c.pos >= p0 && c.pos < p1 {
                self.has_shift = true;
                c.pos += delta;
                c.delta += delta;
                if c.pos < 0 {
                    if !c.seq.is_empty() {
                        self.used = self.used.wrapping_sub(1);
                    }
                    c.pos = -1;
                    c.seq.clear();
                    if new_head == self.size {
                        new_head = i as u32;
                    }
                }
            }
        }
        self.head = if new_head != self.size { new_head } else { 0 };
    }

    pub fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) {
        if d == 1 {
            return;
        }
        let (p0, p1) = norm(p0, p1);
        if p0 == p1 {
            return;
        }
        if self.recurrent {
            if seq < 0 {
                return;
            }
            let tail = self.cells[seq as usize].tail;
            if tail >= 0 {
                let c = &mut self.cells[tail as usize];
                if c.seq.contains(&seq) && p0 <= c.pos && c.pos < p1 {
                    c.pos /= d;
                }
            }
            return;
        }
        for c in &mut self.cells {
            if c.seq.contains(&seq) && c.pos >= p0 && c.pos < p1 {
                self.has_shift = true;
                let old = c.pos;
                c.pos /= d;
                c.delta += c.pos - old;
            }
        }
    }

    pub fn seq_pos_max(&self, seq: i32) -> i32 {
        let mut r = 0;
        for c in &self.cells {
            if c.seq.contains(&seq) {
                r = r.max(c.pos);
            }
        }
        r
    }

    pub fn n_tokens(&self) -> u64 {
        self.cells.iter().map(|c| c.seq.len() as u64).sum()
    }

    pub fn cell_max(&self) -> u32 {
        for i in (0..self.size as usize).rev() {
            if self.cells[i].pos >= 0 && !self.cells[i].seq.is_empty() {
                return i as u32 + 1;
            }
        }
        0
    }

    pub fn clear(&mut self) {
        for c in &mut self.cells {
            c.pos = -1;
            c.seq.clear();
            c.src = -1;
            c.tail = -1;
        }
        self.head = 0;
        self.used = 0;
    }

    /// `find_slot` for per-token groups (`pos[k]` with `seqs[k]`, n_seq_tokens = 1) or, for
    /// recurrent caches, groups of `n_seq_tokens` tokens. Returns the slot head.
    pub fn find_slot(
        &mut self,
        pos: &[i32],
        seqs: &[Vec<i32>],
        n_seq_tokens: usize,
    ) -> Option<u32> {
        if self.recurrent {
            return self.find_slot_recurrent(pos, seqs, n_seq_tokens);
        }
        let n_tokens = pos.len() as u32;
        if n_tokens > self.size {
            return None;
        }
        let mut n_tested = 0;
        loop {
            if self.head + n_tokens > self.size {
                n_tested += self.size - self.head;
                self.head = 0;
                continue;
            }
            let mut found = true;
            for i in 0..n_tokens {
                if self.cells[(self.head + i) as usize].pos >= 0 {
                    found = false;
                    self.head += i + 1;
                    n_tested += i + 1;
                    break;
                }
            }
            if found {
                break;
            }
            if n_tested >= self.size {
                return None;
            }
        }
        for (g, ids) in seqs.iter().enumerate() {
            for t in 0..n_seq_tokens {
                let k = g * n_seq_tokens + t;
                let c = &mut self.cells[self.head as usize + k];
                c.pos = pos[k];
                for &s in ids {
                    c.seq.insert(s);
                }
            }
        }
        self.used += n_tokens;
        Some(self.head)
    }

    fn find_slot_recurrent(&mut self, pos: &[i32], seqs: &[Vec<i32>], nst: usize) -> Option<u32> {
        let snapshot = (self.cells.clone(), self.head, self.n, self.used);
        let size = self.size as usize;
        let n_seqs = seqs.len();
        for ids in seqs {
            for &id in &ids[1..] {
                let tail = self.cells[id as usize].tail;
                if tail >= 0 {
                    let c = &mut self.cells[tail as usize];
                    c.seq.remove(&id);
                    if c.seq.is_empty() {
                        c.pos = -1;
                        c.src = -1;
                        self.used = self.used.wrapping_sub(1);
                    }
                    self.cells[id as usize].tail = -1;
                }
            }
        }
        let next_empty = |cells: &[RefCell], mut from: usize| {
            for _ in 0..size {
                if from >= size {
                    from -= size;
                }
                if cells[from].seq.is_empty() {
                    break;
                }
                from += 1;
            }
            from
        };
        let mut next = next_empty(&self.cells, self.head as usize);
        let mut min = size as i32 - 1;
        let mut max = 0;
        for s in 0..n_seqs {
            let seq = seqs[s][0];
            let tail = self.cells[seq as usize].tail;
            let mut has_cell = false;
            if tail >= 0 {
                if !self.cells[tail as usize].seq.contains(&seq) {
                    (self.cells, self.head, self.n, self.used) = snapshot;
                    return None;
                }
                has_cell = self.cells[tail as usize].seq.len() == 1;
            }
            if !has_cell {
                if next >= size || !self.cells[next].seq.is_empty() {
                    (self.cells, self.head, self.n, self.used) = snapshot;
                    return None;
                }
                if tail >= 0 {
                    let (p, sr) = (self.cells[tail as usize].pos, self.cells[tail as usize].src);
                    self.cells[next].pos = p;
                    self.cells[next].src = sr;
                    self.cells[tail as usize].seq.remove(&seq);
                    self.cells[next].seq.insert(seq);
                }
                self.cells[seq as usize].tail = next as i32;
                if s + 1 < n_seqs {
                    next = next_empty(&self.cells, next + 1);
                }
            }
            let t = self.cells[seq as usize].tail;
            min = min.min(t);
            max = max.max(t);
        }
        if min < 0 || min as usize + n_seqs > size {
            (self.cells, self.head, self.n, self.used) = snapshot;
            return None;
        }
        for s in 0..n_seqs {
            let dst = s + min as usize;
            let src = self.cells[seqs[s][0] as usize].tail as usize;
            if dst != src {
                let (a, b) = (self.cells[dst].clone(), self.cells[src].clone());
                self.cells[dst].pos = b.pos;
                self.cells[src].pos = a.pos;
                self.cells[dst].src = b.src;
                self.cells[src].src = a.src;
                self.cells[dst].seq = b.seq.clone();
                self.cells[src].seq = a.seq.clone();
                for &q in &a.seq {
                    self.cells[q as usize].tail = src as i32;
                }
                for &q in &b.seq {
                    self.cells[q as usize].tail = dst as i32;
                }
            }
        }
        for s in 0..n_seqs {
            let cell = s + min as usize;
            self.cells[cell].pos = pos[nst * s + nst - 1];
            self.cells[cell].seq.clear();
            for &id in &seqs[s] {
                self.cells[cell].seq.insert(id);
                self.cells[id as usize].tail = cell as i32;
            }
        }
        self.head = min as u32;
        self.n = (max - min + 1) as u32;
        self.used = self.cells.iter().filter(|c| !c.seq.is_empty()).count() as u32;
        (self.n as usize >= n_seqs).then_some(self.head)
    }
}
