//! Fallible allocation for every buffer whose size comes from input (cache geometry, row
//! counts, state payloads, files). Rust's `vec![..]` and `Vec::with_capacity` abort the process
//! when memory runs out; inside Node that kills the whole application, so these return
//! [`KvError::Backend`] instead.
//!
//! Zeroed buffers come from `alloc_zeroed` (calloc): the OS hands out zero pages lazily, so a
//! big cache costs no page faults until its cells are written.

use std::alloc::{alloc_zeroed, Layout};
use std::ops::{Deref, DerefMut};

use memmap2::MmapMut;

use crate::error::{KvError, Result};

/// Types whose all-zero bit pattern is a valid value.
///
/// # Safety
/// Implement only for types where every byte being 0 is a valid, initialized value.
pub unsafe trait Zeroable: Copy {}

// SAFETY: plain integers and floats: all-zero is 0 / 0.0
unsafe impl Zeroable for u8 {}
// SAFETY: as above
unsafe impl Zeroable for i32 {}
// SAFETY: as above
unsafe impl Zeroable for u32 {}
// SAFETY: as above
unsafe impl Zeroable for u64 {}
// SAFETY: as above
unsafe impl Zeroable for f32 {}

fn too_big(n: usize, size: usize, what: &str) -> KvError {
    KvError::Backend(format!(
        "cannot allocate {} bytes for {what}",
        (n as u128) * (size as u128)
    ))
}

/// `n` zeroed values, allocated lazily by the OS where it can.
pub fn zeroed<T: Zeroable>(n: usize, what: &str) -> Result<Vec<T>> {
    if n == 0 || std::mem::size_of::<T>() == 0 {
        return Ok(Vec::new());
    }
    let layout = Layout::array::<T>(n).map_err(|_| too_big(n, std::mem::size_of::<T>(), what))?;
    // SAFETY: the layout has a non-zero size (n > 0 and T is not zero-sized)
    let ptr = unsafe { alloc_zeroed(layout) } as *mut T;
    if ptr.is_null() {
        return Err(too_big(n, std::mem::size_of::<T>(), what));
    }
    // SAFETY: `ptr` comes from the global allocator with exactly the layout `Vec<T>` uses for a
    // capacity of `n` (Layout::array::<T>(n)), and all `n` values are initialized: zero bytes
    // are a valid T (Zeroable)
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// `n` copies of `value`.
pub fn filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = with_capacity(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// An empty vector with room for `n` values.
pub fn with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| too_big(n, std::mem::size_of::<T>(), what))?;
    Ok(v)
}

/// A copy of `data`.
pub fn copy<T: Clone>(data: &[T], what: &str) -> Result<Vec<T>> {
    let mut v = with_capacity(data.len(), what)?;
    v.extend_from_slice(data);
    Ok(v)
}

/// Mappings at least this large are advised for transparent huge pages where the OS has them
/// (fewer page faults and TLB misses on multi-MiB buffers).
const HUGE_PAGE_MIN: usize = 4 << 20;

/// `len` zero bytes in an anonymous mapping of their own (`mmap` / `VirtualAlloc`): no page is
/// committed until written, and dropping the mapping returns every page whatever the heap
/// allocator would have kept. A refused mapping (no memory, `ulimit -v`) is an error.
pub fn map_zeroed(len: usize, what: &str) -> Result<MmapMut> {
    let map = MmapMut::map_anon(len)
        .map_err(|e| KvError::Backend(format!("cannot allocate {len} bytes for {what}: {e}")))?;
    #[cfg(target_os = "linux")]
    if len >= HUGE_PAGE_MIN {
        // advice only: a kernel without THP refuses it, and nothing is lost
        let _ = map.advise(memmap2::Advice::HugePage);
    }
    Ok(map)
}

/// Faults in the pages of `offset..offset + len` with one call (`MADV_POPULATE_WRITE`, Linux
/// 5.14+) before they are written in bulk, instead of one page fault per 4 KiB as a copy
/// reaches them. Advice only: an older kernel refuses it and the copy faults as before.
pub fn populate(map: &MmapMut, offset: usize, len: usize) {
    #[cfg(target_os = "linux")]
    let _ = map.advise_range(memmap2::Advice::PopulateWrite, offset, len);
    #[cfg(not(target_os = "linux"))]
    let _ = (map, offset, len);
}

/// Advises the 2 MiB-aligned interior of `buf` for transparent huge pages, before it is
/// written in bulk: where the memory is fresh (a large `malloc` maps it anew), the kernel then
/// faults it in 2 MiB at a time (a copy of 16.8 MiB into fresh `malloc` memory: 9.1 ms, 4.3 ms
/// advised); where it is warm, nothing changes. Advice only, whoever allocated `buf`: the
/// contents stay as they are, and a kernel without THP refuses it.
pub fn advise_huge_pages(buf: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (buf.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (buf.as_ptr() as usize + buf.len()) / HUGE * HUGE;
        if end > start {
            // SAFETY: the range lies inside `buf`, which this call borrows mutably; the advice
            // changes no byte of it
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

/// Buffers of at least this many bytes get a mapping of their own ([`OwnedBytes`]); smaller
/// ones stay on the heap, where a mapping each (two system calls and a page per KiB) would
/// cost more than it saves.
pub const MAP_MIN: usize = 1 << 20;

/// Bytes in memory of their own: on the heap below [`MAP_MIN`], else an anonymous mapping
/// (see [`zeroed_bytes`], [`copy_bytes`]).
pub enum OwnedBytes {
    /// A small buffer, on the heap.
    Heap(Vec<u8>),
    /// A large buffer, in a mapping of its own.
    Map(MmapMut),
}

impl OwnedBytes {
    /// The mapping, for a large buffer.
    pub fn map(&self) -> Option<&MmapMut> {
        match self {
            OwnedBytes::Map(m) => Some(m),
            OwnedBytes::Heap(_) => None,
        }
    }

    /// The mapping, for a large buffer, to advise.
    pub fn map_mut(&mut self) -> Option<&mut MmapMut> {
        match self {
            OwnedBytes::Map(m) => Some(m),
            OwnedBytes::Heap(_) => None,
        }
    }
}

impl Deref for OwnedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            OwnedBytes::Heap(v) => v,
            OwnedBytes::Map(m) => m,
        }
    }
}

impl DerefMut for OwnedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            OwnedBytes::Heap(v) => v,
            OwnedBytes::Map(m) => m,
        }
    }
}

impl AsRef<[u8]> for OwnedBytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// `len` zero bytes, lazily committed by the OS either way (calloc on the heap, or a mapping).
pub fn zeroed_bytes(len: usize, what: &str) -> Result<OwnedBytes> {
    Ok(if len < MAP_MIN {
        OwnedBytes::Heap(zeroed(len, what)?)
    } else {
        OwnedBytes::Map(map_zeroed(len, what)?)
    })
}

/// A copy of `data` (a payload that must outlive memory its owner may free). A large copy goes
/// to a mapping whose pages are faulted in with one call first: copied into fresh heap memory,
/// a 1 GiB payload spent most of its second in page faults.
pub fn copy_bytes(data: &[u8], what: &str) -> Result<OwnedBytes> {
    if data.len() < MAP_MIN {
        return copy(data, what).map(OwnedBytes::Heap);
    }
    let mut map = map_zeroed(data.len(), what)?;
    populate(&map, 0, data.len());
    map.copy_from_slice(data);
    Ok(OwnedBytes::Map(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_buffers_are_zero_and_sized() {
        let v: Vec<f32> = zeroed(1000, "test").unwrap();
        assert_eq!(v.len(), 1000);
        assert!(v.iter().all(|&x| x == 0.0));
        assert!(zeroed::<u8>(0, "test").unwrap().is_empty());
    }

    #[test]
    fn impossible_sizes_are_backend_errors_not_aborts() {
        let e = zeroed::<u64>(usize::MAX / 4, "huge").unwrap_err();
        assert!(
            matches!(e, KvError::Backend(ref m) if m.contains("huge")),
            "{e}"
        );
        assert!(matches!(
            with_capacity::<u32>(usize::MAX / 2, "x"),
            Err(KvError::Backend(_))
        ));
        assert!(matches!(
            filled(usize::MAX / 8, 1i32, "x"),
            Err(KvError::Backend(_))
        ));
    }

    #[test]
    fn huge_page_advice_leaves_the_bytes_of_any_buffer() {
        let mut big: Vec<u8> = (0..9 << 20).map(|i| (i * 13) as u8).collect();
        let copy = big.clone();
        // an aligned interior of several huge pages, one of none, and an empty slice
        advise_huge_pages(&mut big);
        advise_huge_pages(&mut big[1..3 << 20]);
        advise_huge_pages(&mut big[5..5]);
        assert_eq!(big, copy);
    }

    #[test]
    fn copies_and_fills() {
        assert_eq!(copy(&[1, 2, 3], "x").unwrap(), vec![1, 2, 3]);
        let big: Vec<u8> = (0..3 << 20).map(|i| (i * 7) as u8).collect();
        for data in [&big[..10], &big[..]] {
            let owned = copy_bytes(data, "x").unwrap();
            assert_eq!(&owned[..], data);
        }
        assert!(matches!(copy_bytes(&big, "x").unwrap(), OwnedBytes::Map(_)));
        assert_eq!(filled(3, -1i32, "x").unwrap(), vec![-1, -1, -1]);
    }
}
