//! The Walsh-Hadamard rotation llama.cpp 0.1.161 applies to quantized K/V (`attn_rot`): each
//! row is cut into blocks of `n` values (`n_rot_k` / `n_rot_v`, a power of two) and every block
//! is multiplied by the orthonormal Hadamard matrix `H / sqrt(n)`, which is its own inverse. The
//! arithmetic is ggml's CPU `fwht` (scale first, then butterflies of width 1, 2, 4, ...), so the
//! results are the same floats.

/// Applies the rotation to every block of `n` values of `values` in place. `values.len()` must
/// be a multiple of `n` and `n` a power of two (checked by the cache parameters).
pub fn rotate_blocks(values: &mut [f32], n: usize) {
    debug_assert!(n.is_power_of_two() && values.len().is_multiple_of(n));
    let scale = 1.0f32 / (n as f32).sqrt();
    for block in values.chunks_exact_mut(n) {
        for v in block.iter_mut() {
            *v *= scale;
        }
        let mut len = 1;
        while len < n {
            for i in (0..n).step_by(2 * len) {
                for j in i..i + len {
                    let (u, v) = (block[j], block[j + len]);
                    block[j] = u + v;
                    block[j + len] = u - v;
                }
            }
            len <<= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rotation_is_its_own_inverse_within_rounding() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let mut y = x.clone();
        rotate_blocks(&mut y, 64);
        assert!(
            y.iter().zip(&x).any(|(a, b)| (a - b).abs() > 0.1),
            "a rotation changes the values"
        );
        rotate_blocks(&mut y, 64);
        for (a, b) in y.iter().zip(&x) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn a_block_is_multiplied_by_the_normalised_sylvester_matrix() {
        // H_4 / 2 applied to a unit vector gives that column of the matrix
        let mut e2 = [0.0, 0.0, 1.0, 0.0];
        rotate_blocks(&mut e2, 4);
        assert_eq!(e2, [0.5, 0.5, -0.5, -0.5]);
        let mut e1 = [0.0, 1.0, 0.0, 0.0];
        rotate_blocks(&mut e1, 4);
        assert_eq!(e1, [0.5, -0.5, 0.5, -0.5]);
    }
}
