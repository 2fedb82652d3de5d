//! TEMPORARY: replaced by the full quantizer module.
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use half::slice::HalfFloatSliceExt;

pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    match ty {
        GgmlType::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            Ok(())
        }
        GgmlType::F16 => {
            let h: Vec<half::f16> = src
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                .collect();
            h.convert_to_f32_slice(dst);
            Ok(())
        }
        _ => Err(KvError::Unsupported("tmp".into())),
    }
}
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    match ty {
        GgmlType::F32 => {
            for (s, c) in src.iter().zip(dst.chunks_exact_mut(4)) {
                c.copy_from_slice(&s.to_le_bytes());
            }
            Ok(())
        }
        GgmlType::F16 => {
            for (s, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
                c.copy_from_slice(&half::f16::from_f32(*s).to_le_bytes());
            }
            Ok(())
        }
        _ => Err(KvError::Unsupported("tmp".into())),
    }
}
