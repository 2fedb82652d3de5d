//! K/V rows as a payload carries them, into the cells a load placed them in: row-wise blocks
//! (K, and V without flash attention's transposition) and transposed V (one run of elements
//! per channel). The whole-payload read and the streamed one both write through these, a
//! whole block at once or any byte range of it as it arrives.

use crate::error::Result;
use crate::tensors::storage::KvBuffer;

/// Writes bytes `off..off + data.len()` of a block of `cells.len()` rows of `row` bytes, row
/// `k` going to cell `cells[k]`.
pub(crate) fn write_rows(
    buf: &mut dyn KvBuffer,
    row: usize,
    cells: &[usize],
    contiguous: bool,
    mut off: usize,
    mut data: &[u8],
) -> Result<()> {
    if data.is_empty() {
        // a payload without cells still has its layer headers, and their zero-length blocks
        return Ok(());
    }
    if contiguous {
        return buf.write(cells[0] * row + off, data);
    }
    while !data.is_empty() {
        let (k, r) = (off / row, off % row);
        let n = (row - r).min(data.len());
        buf.write(cells[k] * row + r, &data[..n])?;
        off += n;
        data = &data[n..];
    }
    Ok(())
}

/// Writes bytes `off..off + data.len()` of a transposed V block: per channel `j`, one element
/// of `el` bytes per cell, element `k` going to `(cells[k] + j * size) * el`.
pub(crate) fn write_columns(
    buf: &mut dyn KvBuffer,
    (el, size): (usize, usize),
    cells: &[usize],
    contiguous: bool,
    mut off: usize,
    mut data: &[u8],
) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let column = cells.len() * el;
    if contiguous && off.is_multiple_of(column) && data.len().is_multiple_of(column) {
        // whole channels of a contiguous cell range: exactly the strided layout of the tensor
        // (one 2D copy on a device)
        let first = (cells[0] + off / column * size) * el;
        return buf.write_2d(first, column, size * el, data);
    }
    while !data.is_empty() {
        let (j, r) = (off / column, off % column);
        let (at, n) = if contiguous {
            ((cells[0] + j * size) * el + r, (column - r).min(data.len()))
        } else {
            let (k, b) = (r / el, r % el);
            ((cells[k] + j * size) * el + b, (el - b).min(data.len()))
        };
        buf.write(at, &data[..n])?;
        off += n;
        data = &data[n..];
    }
    Ok(())
}
