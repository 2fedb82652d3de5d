//! The ggml tensor types a KV cache can hold, with ggml's block geometry and row-size rule.

use crate::error::{KvError, Result};
use std::fmt;
use std::str::FromStr;

/// A ggml tensor type allowed for K or V.
///
/// The discriminant is ggml's own type id, as written in llama.cpp state files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Iq4Nl = 20,
    Bf16 = 30,
}

impl GgmlType {
    /// Every KV type, in ggml id order.
    pub const ALL: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Iq4Nl,
        GgmlType::Bf16,
    ];

    /// ggml's type id.
    pub fn id(self) -> i32 {
        self as i32
    }

    /// The type with ggml id `id`, if it is a KV type.
    pub fn from_id(id: i32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// ggml's name (`"f16"`, `"q8_0"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Iq4Nl => "iq4_nl",
            GgmlType::Bf16 => "bf16",
        }
    }

    /// Elements per block (1 for the float types, 32 for the quantized ones).
    pub fn block_size(self) -> usize {
        if self.is_quantized() {
            32
        } else {
            1
        }
    }

    /// Bytes per block (`ggml_type_size`).
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 | GgmlType::Iq4Nl => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
        }
    }

    /// Whether the type stores blocks of quantized values rather than one float per element.
    pub fn is_quantized(self) -> bool {
        !matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16)
    }

    /// `ggml_row_size`: bytes for `n` elements. `n` must be a multiple of the block size.
    pub fn row_size(self, n: usize) -> Result<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return Err(KvError::InvalidArg(format!(
                "width {n} is not a multiple of {}'s block size {}",
                self.name(),
                self.block_size()
            )));
        }
        // widths come from files: one near usize::MAX must be refused, not overflow
        self.type_size()
            .checked_mul(n / self.block_size())
            .ok_or_else(|| {
                KvError::InvalidArg(format!("width {n} of {} overflows a row", self.name()))
            })
    }

    /// The width in elements of a row of `row_bytes` bytes (the inverse of [`row_size`]), or
    /// `None` when `row_bytes` is not a whole number of this type's blocks.
    ///
    /// [`row_size`]: GgmlType::row_size
    pub fn row_width(self, row_bytes: u64) -> Option<u32> {
        let w = row_bytes as usize / self.type_size() * self.block_size();
        (self.type_size() * (w / self.block_size()) == row_bytes as usize).then_some(w as u32)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GgmlType {
    type Err = KvError;

    fn from_str(s: &str) -> Result<GgmlType> {
        let lower = s.to_ascii_lowercase();
        GgmlType::ALL
            .into_iter()
            .find(|t| t.name() == lower)
            .ok_or_else(|| {
                KvError::InvalidArg(format!(
                    "unknown KV type {s:?} (expected one of f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl)"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regression_a_row_width_from_a_dsv4_state_near_usize_max_overflowed_row_size() {
        // found by the state_reader fuzz target: a dsv4 tensor block declaring ne0 2^63
        let e = GgmlType::F32.row_size(1 << 63).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        assert_eq!(GgmlType::Q8_0.row_size(64).unwrap(), 68);
    }

    #[test]
    fn row_width_inverts_row_size_and_refuses_partial_blocks() {
        assert_eq!(GgmlType::Q8_0.row_width(34 * 4), Some(128));
        assert_eq!(GgmlType::F16.row_width(2 * 64), Some(64));
        assert_eq!(GgmlType::Q8_0.row_width(34 * 4 + 2), None);
        assert_eq!(GgmlType::F32.row_width(6), None);
        assert_eq!(GgmlType::Q4_0.row_width(0), Some(0));
    }

    #[test]
    fn ids_match_ggml() {
        assert_eq!(GgmlType::from_id(8), Some(GgmlType::Q8_0));
        assert_eq!(GgmlType::from_id(30), Some(GgmlType::Bf16));
        assert_eq!(GgmlType::from_id(4), None);
    }

    #[test]
    fn row_size_follows_block_geometry() {
        assert_eq!(GgmlType::F16.row_size(64).unwrap(), 128);
        assert_eq!(GgmlType::Q8_0.row_size(64).unwrap(), 68);
        assert_eq!(GgmlType::Q4_1.row_size(32).unwrap(), 20);
        assert!(GgmlType::Q4_0.row_size(48).is_err());
    }

    #[test]
    fn names_parse_back() {
        for t in GgmlType::ALL {
            assert_eq!(t.name().parse::<GgmlType>().unwrap(), t);
        }
        assert!("q3_k".parse::<GgmlType>().is_err());
    }
}
