//! Field-by-field comparison of what llama.cpp and our cache show after an op, and a small
//! independent parser of the seed-layout KV state for comparing state blobs.

use crate::trace::Obs;

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

/// Differences between llama.cpp's observation and ours, one line each (empty: equal).
/// `kv` gives, for blob comparisons, the cells the blob lists and which of them hold K and V
/// rows known to equal llama.cpp's; returns the number of rows compared.
pub fn diff(
    theirs: &Obs,
    ours: &Obs,
    kv: Option<(&[usize], &[bool], &[bool])>,
) -> (Vec<String>, u64) {
    let mut d = Vec::new();
    let mut rows = 0;
    let mut field = |name: &str, a: i64, b: i64| {
        if a != b {
            d.push(format!("{name}: llama.cpp {a}, ours {b}"));
        }
    };
    field("ret", theirs.ret, ours.ret);
    field("n_tokens", theirs.n_tokens, ours.n_tokens);
    field("used_cells", theirs.used, ours.used);
    field("view.used_cells", theirs.view_used, ours.view_used);
    field("view.token_count", theirs.token_count, ours.token_count);
    field("view.max_contiguous", theirs.max_contig, ours.max_contig);
    field(
        "view.max_contiguous_idx",
        theirs.max_contig_idx,
        ours.max_contig_idx,
    );
    if theirs.pos_max != ours.pos_max {
        d.push(format!(
            "seq_pos_max: llama.cpp {:?}, ours {:?}",
            theirs.pos_max, ours.pos_max
        ));
    }
    if theirs.pos.len() != ours.pos.len() {
        d.push(format!(
            "cells: llama.cpp {}, ours {}",
            theirs.pos.len(),
            ours.pos.len()
        ));
    } else {
        let bad: Vec<usize> = (0..theirs.pos.len())
            .filter(|&i| theirs.pos[i] != ours.pos[i] || theirs.seqs.get(i) != ours.seqs.get(i))
            .collect();
        for &i in bad.iter().take(12) {
            d.push(format!(
                "cell {i}: llama.cpp pos {} seqs {:?}, ours pos {} seqs {:?}",
                theirs.pos[i],
                theirs.seqs.get(i).cloned().unwrap_or_default(),
                ours.pos[i],
                ours.seqs.get(i).cloned().unwrap_or_default()
            ));
        }
        if bad.len() > 12 {
            d.push(format!("... {} cells differ in all", bad.len()));
        }
    }
    match (&theirs.blob, &ours.blob) {
        (None, None) => {}
        (Some(a), Some(b)) => match (parse_blob(a), parse_blob(b)) {
            (Ok(x), Ok(y)) => {
                if x.cells != y.cells {
                    d.push(format!(
                        "state cells: llama.cpp {} {:?}, ours {} {:?}",
                        x.cells.len(),
                        &x.cells[..x.cells.len().min(6)],
                        y.cells.len(),
                        &y.cells[..y.cells.len().min(6)]
                    ));
                }
                if x.header != y.header {
                    d.push(format!(
                        "state data header (v_trans, n_layer, per layer types and sizes): llama.cpp {:?}, ours {:?}",
                        x.header.as_ref().map(|h| &h[..h.len().min(8)]),
                        y.header.as_ref().map(|h| &h[..h.len().min(8)])
                    ));
                }
                if a.len() != b.len() {
                    d.push(format!(
                        "state size: llama.cpp {} bytes, ours {}",
                        a.len(),
                        b.len()
                    ));
                }
                if let Some((cells, vk, vv)) = kv {
                    if x.cells == y.cells && x.header == y.header && cells.len() == x.cells.len() {
                        for (il, (kx, ky)) in x.k.iter().zip(&y.k).enumerate() {
                            for (j, &c) in cells.iter().enumerate() {
                                if vk[c] {
                                    rows += 1;
                                    if kx[j] != ky[j] {
                                        d.push(format!("K row of cell {c} layer {il} differs"));
                                    }
                                }
                            }
                        }
                        for (il, (vx, vy)) in x.v.iter().zip(&y.v).enumerate() {
                            for (j, &c) in cells.iter().enumerate() {
                                if vv[c] {
                                    rows += 1;
                                    if vx[j] != vy[j] {
                                        d.push(format!("V row of cell {c} layer {il} differs"));
                                    }
                                }
                            }
                        }
                    }
                }
            }
            (x, y) => d.push(format!(
                "state parse: llama.cpp {:?}, ours {:?}",
                x.err(),
                y.err()
            )),
        },
        (a, b) => d.push(format!(
            "state: llama.cpp {} bytes, ours {} bytes",
            a.as_ref().map_or(0, Vec::len),
            b.as_ref().map_or(0, Vec::len)
        )),
    }
    d.truncate(40);
    (d, rows)
}
