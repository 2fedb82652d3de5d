//! Copies of whole runs of rows into host tensors with streaming (non-temporal) stores.
//!
//! A load writes each layer's rows as its own run (a few MiB: the payload and the tensors are
//! laid out layer by layer). Copied with ordinary stores, every destination line is first read
//! into the cache (read-for-ownership) and the copy moves three bytes per byte written: one
//! sequence's state set ran at 0.58x a single `memcpy` of the same bytes at an 8B-like geometry,
//! the memcpy being one call large enough for glibc to stream it. Streaming stores skip that
//! read. Rows written this way are not left in the cache, which costs nothing here: a run this
//! large does not fit in the caches a decode would read them from anyway.
//!
//! Short copies (under [`STREAM_MIN`]) keep `copy_from_slice`. The instructions are AVX's,
//! detected at run time (std caches the answer); without them, and on other architectures,
//! every copy is `copy_from_slice`.

/// Bytes from which a copy streams: below it, the read-for-ownership of the destination is
/// cheap next to the call, and the rows may be read again soon.
pub const STREAM_MIN: usize = 1 << 20;

/// Copies `src` into `dst` (of the same length), streaming the stores when the copy is large
/// and the CPU can.
pub fn copy_rows(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_rows needs slices of one length");
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAM_MIN && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present (checked above); the slices are valid and of one length.
        unsafe { stream_copy(dst, src) };
        return;
    }
    dst.copy_from_slice(src);
}

/// The streaming copy: the head up to 32-byte alignment of `dst` and the tail are copied
/// normally, the body 128 bytes (four 256-bit stores) at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn stream_copy(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    const STEP: usize = 128;
    let n = src.len();
    let head = dst.as_ptr().align_offset(32).min(n);
    dst[..head].copy_from_slice(&src[..head]);
    let body = head + (n - head) / STEP * STEP;
    let mut i = head;
    while i < body {
        // SAFETY: `i + STEP <= body <= n` for both slices; `dst + i` is 32-byte aligned
        // (`head` aligned it and `STEP` keeps it), as the stream stores require; the loads are
        // unaligned ones.
        unsafe {
            let s = src.as_ptr().add(i).cast::<__m256i>();
            let d = dst.as_mut_ptr().add(i).cast::<__m256i>();
            let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
            let (c, e) = (_mm256_loadu_si256(s.add(2)), _mm256_loadu_si256(s.add(3)));
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
            _mm256_stream_si256(d.add(2), c);
            _mm256_stream_si256(d.add(3), e);
        }
        i += STEP;
    }
    dst[body..].copy_from_slice(&src[body..]);
    // the streamed lines are ordered before any later store (and any reader after a fence)
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every offset and length around the alignment, the step and the threshold copies exactly.
    #[test]
    fn copies_are_exact_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..STREAM_MIN + 1024)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        for len in [0, 1, 127, 128, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 129] {
            for (d_off, s_off) in [(0, 0), (1, 0), (0, 3), (17, 5), (31, 31)] {
                let mut dst = vec![0u8; len + 64];
                copy_rows(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                assert!(
                    dst[d_off..d_off + len] == src[s_off..s_off + len],
                    "{len} {d_off} {s_off}"
                );
                assert!(dst[..d_off].iter().all(|&b| b == 0));
                assert!(dst[d_off + len..].iter().all(|&b| b == 0));
            }
        }
    }
}
