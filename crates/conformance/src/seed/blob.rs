//! The seed's side of the comparison: the fields of an [`Obs`], and a small independent parser
//! of the seed-layout KV state for comparing state blobs down to their K and V rows.

use crate::compare::{Diff, Observation};
use crate::seed::trace::Obs;

/// How the lines of a seed comparison name llama.cpp.
pub const PEER: &str = "llama.cpp 0.1.103";

/// A KV state blob (seed layout) split into its parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    /// Cells: position and seq ids.
    pub cells: Vec<(i32, Vec<i32>)>,
    /// `v_trans`, `n_layer` and per layer the K and V headers (type, sizes); `None` when the
    /// blob ends after the cells.
    pub header: Option<Vec<u64>>,
    /// Per layer, per cell: K row.
    pub k: Vec<Vec<Vec<u8>>>,
    /// Per layer, per cell: V row (transposed V gathered back into rows).
    pub v: Vec<Vec<Vec<u8>>>,
    /// Bytes after the parsed blob.
    pub trailing: usize,
}

struct Rd<'a> {
    b: &'a [u8],
    o: usize,
}

impl Rd<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.o.checked_add(n).filter(|&e| e <= self.b.len());
        let end =
            end.ok_or_else(|| format!("blob truncated at byte {} ({n} more needed)", self.o))?;
        let s = &self.b[self.o..end];
        self.o = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, String> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
}

/// Parses a seed-layout KV state.
pub fn parse_blob(b: &[u8]) -> Result<Blob, String> {
    let mut r = Rd { b, o: 0 };
    let n = r.u32()? as usize;
    if n > b.len() / 8 {
        return Err(format!("cell_count {n} does not fit in {} bytes", b.len()));
    }
    let mut cells = Vec::with_capacity(n);
    for _ in 0..n {
        let pos = r.u32()? as i32;
        let k = r.u32()? as usize;
        let ids = (0..k)
            .map(|_| r.u32().map(|x| x as i32))
            .collect::<Result<_, _>>()?;
        cells.push((pos, ids));
    }
    if r.o == b.len() {
        return Ok(Blob {
            cells,
            header: None,
            k: Vec::new(),
            v: Vec::new(),
            trailing: 0,
        });
    }
    let v_trans = r.u32()?;
    let n_layer = r.u32()? as usize;
    if n_layer > 4096 {
        return Err(format!("n_layer {n_layer}"));
    }
    let mut header = vec![v_trans as u64, n_layer as u64];
    let mut k = Vec::with_capacity(n_layer);
    for _ in 0..n_layer {
        header.push(r.u32()? as u64);
        let row = r.u64()? as usize;
        header.push(row as u64);
        let rows = (0..n)
            .map(|_| r.take(row).map(<[u8]>::to_vec))
            .collect::<Result<_, _>>()?;
        k.push(rows);
    }
    let mut v = Vec::with_capacity(n_layer);
    for _ in 0..n_layer {
        header.push(r.u32()? as u64);
        if v_trans == 1 {
            let el = r.u32()? as usize;
            let n_embd = r.u32()? as usize;
            header.push(el as u64);
            header.push(n_embd as u64);
            let mut rows = vec![Vec::with_capacity(el * n_embd); n];
            for _ in 0..n_embd {
                for row in rows.iter_mut() {
                    row.extend_from_slice(r.take(el)?);
                }
            }
            v.push(rows);
        } else {
            let row = r.u64()? as usize;
            header.push(row as u64);
            let rows = (0..n)
                .map(|_| r.take(row).map(<[u8]>::to_vec))
                .collect::<Result<_, _>>()?;
            v.push(rows);
        }
    }
    Ok(Blob {
        cells,
        header: Some(header),
        k,
        v,
        trailing: b.len() - r.o,
    })
}

/// Cells a state read of `seq` (-1: whole cache) lists, from a view.
pub fn blob_cells(obs: &Obs, seq: i32) -> Vec<usize> {
    (0..obs.seqs.len())
        .filter(|&i| {
            if seq < 0 {
                !obs.seqs[i].is_empty()
            } else {
                obs.seqs[i].contains(&seq)
            }
        })
        .collect()
}

impl Observation for Obs {
    fn compare(&self, ours: &Obs, d: &mut Diff) {
        d.field("ret", &self.ret, &ours.ret);
        d.field("n_tokens", &self.n_tokens, &ours.n_tokens);
        d.field("used_cells", &self.used, &ours.used);
        d.field("view.used_cells", &self.view_used, &ours.view_used);
        d.field("view.token_count", &self.token_count, &ours.token_count);
        d.field("view.max_contiguous", &self.max_contig, &ours.max_contig);
        d.field(
            "view.max_contiguous_idx",
            &self.max_contig_idx,
            &ours.max_contig_idx,
        );
        d.field("seq_pos_max", &self.pos_max, &ours.pos_max);
        let cells = |o: &Obs| -> Vec<(i32, Vec<i32>)> {
            (0..o.pos.len())
                .map(|i| (o.pos[i], o.seqs.get(i).cloned().unwrap_or_default()))
                .collect()
        };
        d.items(
            |i| format!("cell {i} (pos, seqs)"),
            "cells",
            &cells(self),
            &cells(ours),
        );
        match (&self.blob, &ours.blob) {
            (None, None) => {}
            (Some(a), Some(b)) => match (parse_blob(a), parse_blob(b)) {
                (Ok(x), Ok(y)) => {
                    if x.cells != y.cells {
                        d.line(format!(
                            "state cells: {} {} {:?}, ours {} {:?}",
                            d.peer(),
                            x.cells.len(),
                            &x.cells[..x.cells.len().min(6)],
                            y.cells.len(),
                            &y.cells[..y.cells.len().min(6)]
                        ));
                    }
                    d.field(
                        "state data header (v_trans, n_layer, per layer types and sizes)",
                        &x.header.as_ref().map(|h| &h[..h.len().min(8)]),
                        &y.header.as_ref().map(|h| &h[..h.len().min(8)]),
                    );
                    d.field("state size in bytes", &a.len(), &b.len());
                }
                (x, y) => d.field("state parse", &x.err(), &y.err()),
            },
            (a, b) => d.field(
                "state bytes",
                &a.as_ref().map_or(0, Vec::len),
                &b.as_ref().map_or(0, Vec::len),
            ),
        }
    }
}

/// The cells a state blob lists and, per cell, whether our K and V rows are known to equal
/// llama.cpp's (cells written by the same ops from the same data).
pub type KnownRows<'a> = (&'a [usize], &'a [bool], &'a [bool]);

/// Differences between llama.cpp's observation and ours, one line each (empty: equal), with
/// the known K and V rows of their state blobs (`kv`) compared too; returns the lines and the
/// number of rows compared.
pub fn compare_obs(theirs: &Obs, ours: &Obs, kv: Option<KnownRows<'_>>) -> (Vec<String>, u64) {
    let mut d = Diff::new(PEER);
    theirs.compare(ours, &mut d);
    let rows = match (kv, &theirs.blob, &ours.blob) {
        (Some(kv), Some(a), Some(b)) => match (parse_blob(a), parse_blob(b)) {
            (Ok(x), Ok(y)) => compare_rows(&x, &y, kv, &mut d),
            _ => 0,
        },
        _ => 0,
    };
    (d.lines(), rows)
}

/// The known K and V rows of two blobs that list the same cells with the same headers.
fn compare_rows(x: &Blob, y: &Blob, (cells, vk, vv): KnownRows<'_>, d: &mut Diff) -> u64 {
    let mut rows = 0;
    if x.cells != y.cells || x.header != y.header || cells.len() != x.cells.len() {
        return rows;
    }
    for (what, known, theirs, ours) in [("K", vk, &x.k, &y.k), ("V", vv, &x.v, &y.v)] {
        for (il, (rx, ry)) in theirs.iter().zip(ours).enumerate() {
            for (j, &c) in cells.iter().enumerate() {
                if known[c] {
                    rows += 1;
                    if rx[j] != ry[j] {
                        d.line(format!("{what} row of cell {c} layer {il} differs"));
                    }
                }
            }
        }
    }
    rows
}
