//! A strict reader of a GGUF file's header and tensor-info table, and a writer for the same.
//!
//! The reader never touches tensor data: it reads the key/value metadata and the tensor-info
//! table through a small buffer and stops. Every count and length that comes from the file is
//! checked against the bytes the file still has before anything is allocated, so a truncated or
//! hostile file gives a [`KvError::InvalidModel`] naming the field and its byte offset, never a
//! huge allocation or a panic. Rules follow ggml's `gguf_init_from_file` (version 2 or 3, unique
//! keys and tensor names, at most 4 dimensions, known tensor types, rows of whole blocks,
//! offsets that are the running sum of aligned tensor sizes) plus one of llama.cpp's loader:
//! the tensor data must lie inside the file.
//!
//! Long arrays (the tokenizer's vocabulary) are skipped, not stored: only their type and length
//! are kept.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use crate::error::{KvError, Result};

/// Arrays up to this many elements keep their values; longer ones keep only type and length.
pub const MAX_KEPT_ARRAY: u64 = 4096;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;
/// Data alignment when `general.alignment` is absent (`GGUF_DEFAULT_ALIGNMENT`).
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// GGUF value type ids (`enum gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    Str = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufType {
    fn from_id(id: u32) -> Option<GgufType> {
        use GgufType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => Str,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes of one value of a fixed-size type; strings take at least their 8-byte length.
    fn min_size(self) -> u64 {
        use GgufType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | Str => 8,
            Array => 12,
        }
    }

    /// The type's name in the GGUF specification.
    pub fn name(self) -> &'static str {
        use GgufType::*;
        match self {
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            U32 => "uint32",
            I32 => "int32",
            F32 => "float32",
            Bool => "bool",
            Str => "string",
            Array => "array",
            U64 => "uint64",
            I64 => "int64",
            F64 => "float64",
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    /// An array: its element type, its length and, up to [`MAX_KEPT_ARRAY`] elements, its values.
    Array {
        elem: GgufType,
        len: u64,
        values: Option<Vec<GgufValue>>,
    },
}

impl GgufValue {
    /// The value's GGUF type.
    pub fn ty(&self) -> GgufType {
        match self {
            GgufValue::U8(_) => GgufType::U8,
            GgufValue::I8(_) => GgufType::I8,
            GgufValue::U16(_) => GgufType::U16,
            GgufValue::I16(_) => GgufType::I16,
            GgufValue::U32(_) => GgufType::U32,
            GgufValue::I32(_) => GgufType::I32,
            GgufValue::F32(_) => GgufType::F32,
            GgufValue::Bool(_) => GgufType::Bool,
            GgufValue::Str(_) => GgufType::Str,
            GgufValue::U64(_) => GgufType::U64,
            GgufValue::I64(_) => GgufType::I64,
            GgufValue::F64(_) => GgufType::F64,
            GgufValue::Array { .. } => GgufType::Array,
        }
    }

    /// An integer value of any integer type, as i128 (no integer type loses precision).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// A float value (float32 or float64).
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            GgufValue::U8(v) => out.push(*v),
            GgufValue::I8(v) => out.extend(v.to_le_bytes()),
            GgufValue::U16(v) => out.extend(v.to_le_bytes()),
            GgufValue::I16(v) => out.extend(v.to_le_bytes()),
            GgufValue::U32(v) => out.extend(v.to_le_bytes()),
            GgufValue::I32(v) => out.extend(v.to_le_bytes()),
            GgufValue::F32(v) => out.extend(v.to_le_bytes()),
            GgufValue::Bool(v) => out.push(*v as u8),
            GgufValue::Str(s) => write_str(out, s),
            GgufValue::U64(v) => out.extend(v.to_le_bytes()),
            GgufValue::I64(v) => out.extend(v.to_le_bytes()),
            GgufValue::F64(v) => out.extend(v.to_le_bytes()),
            GgufValue::Array { elem, len, values } => {
                out.extend((*elem as u32).to_le_bytes());
                out.extend(len.to_le_bytes());
                for v in values.iter().flatten() {
                    v.write(out);
                }
            }
        }
    }
}

/// Elements per block and bytes per block of a ggml tensor type id (`ggml_blck_size`,
/// `ggml_type_size`); `None` for ids ggml does not know or removed from GGUF files.
pub fn ggml_block(type_id: u32) -> Option<(u64, u64)> {
    Some(match type_id {
        0 => (1, 4),       // f32
        1 => (1, 2),       // f16
        2 => (32, 18),     // q4_0
        3 => (32, 20),     // q4_1
        6 => (32, 22),     // q5_0
        7 => (32, 24),     // q5_1
        8 => (32, 34),     // q8_0
        9 => (32, 36),     // q8_1
        10 => (256, 84),   // q2_K
        11 => (256, 110),  // q3_K
        12 => (256, 144),  // q4_K
        13 => (256, 176),  // q5_K
        14 => (256, 210),  // q6_K
        15 => (256, 292),  // q8_K
        16 => (256, 66),   // iq2_xxs
        17 => (256, 74),   // iq2_xs
        18 => (256, 98),   // iq3_xxs
        19 => (256, 50),   // iq1_s
        20 => (32, 18),    // iq4_nl
        21 => (256, 110),  // iq3_s
        22 => (256, 82),   // iq2_s
        23 => (256, 136),  // iq4_xs
        24 => (1, 1),      // i8
        25 => (1, 2),      // i16
        26 => (1, 4),      // i32
        27 | 28 => (1, 8), // i64, f64
        29 => (256, 56),   // iq1_m
        30 => (1, 2),      // bf16
        34 => (256, 54),   // tq1_0
        35 => (256, 66),   // tq2_0
        39 => (32, 17),    // mxfp4 (ggml since 2025-08)
        _ => return None,
    })
}

/// One entry of the tensor-info table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name.
    pub name: String,
    /// Elements per dimension, ggml order (`ne[0]` is the row length).
    pub ne: Vec<u64>,
    /// ggml type id.
    pub type_id: u32,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data (`ggml_nbytes`).
    pub size: u64,
}

/// A parsed GGUF header: metadata in file order, tensor infos, and where the data lies.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub kv: Vec<(String, GgufValue)>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Data alignment (`general.alignment`, default 32).
    pub alignment: u64,
    /// Bytes of header and tensor-info table (what the fingerprint hashes).
    pub header_len: u64,
    /// Offset of the data section (the header length rounded up to the alignment).
    pub data_offset: u64,
    /// Bytes the tensors' data takes, padding between tensors included.
    pub data_size: u64,
    /// Size of the file (or buffer) the header was read from.
    pub file_size: u64,
}

impl GgufHeader {
    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.kv.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The tensor named `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// How the header was read: bytes pulled from the file (for the "reads under 1 MiB" claim).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Bytes read from the file, buffering included.
    pub bytes_read: u64,
}

fn bad(msg: String) -> KvError {
    KvError::InvalidModel(msg)
}

/// Counts the bytes read from the file below the buffer.
struct Counting<R> {
    inner: R,
    count: u64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count += n as u64;
        Ok(n)
    }
}

/// A cursor over the header that knows how many bytes the file still has, and feeds every byte
/// it consumes to the fingerprint hasher (staged in 64 KiB chunks: one hasher update per field
/// would cost more than the parsing).
struct Reader<'a, R> {
    inner: R,
    pos: u64,
    len: u64,
    hasher: Option<&'a mut blake3::Hasher>,
    staged: Vec<u8>,
}

const HASH_CHUNK: usize = 64 * 1024;

impl<R: Read> Reader<'_, R> {
    fn flush_hash(&mut self) {
        if let Some(h) = self.hasher.as_deref_mut() {
            h.update(&self.staged);
        }
        self.staged.clear();
    }

    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn bytes_into(&mut self, buf: &mut [u8], what: &dyn Fn() -> String) -> Result<()> {
        if (buf.len() as u64) > self.remaining() {
            return Err(bad(format!(
                "GGUF truncated: {} needs {} bytes at byte {}, the file has {} left",
                what(),
                buf.len(),
                self.pos,
                self.remaining()
            )));
        }
        self.inner.read_exact(buf).map_err(|e| {
            bad(format!(
                "GGUF: cannot read {} at byte {}: {e}",
                what(),
                self.pos
            ))
        })?;
        if self.hasher.is_some() {
            self.staged.extend_from_slice(buf);
            if self.staged.len() >= HASH_CHUNK {
                self.flush_hash();
            }
        }
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.bytes_into(&mut b, what)?;
        Ok(b)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length-prefixed string; the length is checked against the file before allocating.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let at = self.pos;
        let n = self.u64(what)?;
        if n > self.remaining() {
            return Err(bad(format!(
                "GGUF: {} at byte {at} has length {n}, past the end of the file ({} bytes left)",
                what(),
                self.remaining()
            )));
        }
        let mut buf = Vec::new();
        buf.try_reserve_exact(n as usize)
            .map_err(|_| bad(format!("GGUF: {} of {n} bytes cannot be allocated", what())))?;
        buf.resize(n as usize, 0);
        self.bytes_into(&mut buf, what)?;
        // ggml does not require UTF-8; names and values are shown with replacement characters
        Ok(String::from_utf8(buf).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into()))
    }

    fn scalar(&mut self, ty: GgufType, what: &dyn Fn() -> String) -> Result<GgufValue> {
        Ok(match ty {
            GgufType::U8 => GgufValue::U8(self.array::<1>(what)?[0]),
            GgufType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            GgufType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            GgufType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            GgufType::U32 => GgufValue::U32(self.u32(what)?),
            GgufType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            GgufType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            GgufType::Bool => GgufValue::Bool(self.array::<1>(what)?[0] != 0),
            GgufType::Str => GgufValue::Str(self.string(what)?),
            GgufType::U64 => GgufValue::U64(self.u64(what)?),
            GgufType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            GgufType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            GgufType::Array => unreachable!("arrays are read by value()"),
        })
    }

    fn type_id(&mut self, what: &dyn Fn() -> String) -> Result<GgufType> {
        let at = self.pos;
        let id = self.u32(what)?;
        GgufType::from_id(id).ok_or_else(|| {
            bad(format!(
                "GGUF: {} at byte {at} has unknown value type {id}",
                what()
            ))
        })
    }

    fn value(&mut self, ty: GgufType, what: &dyn Fn() -> String) -> Result<GgufValue> {
        if ty != GgufType::Array {
            return self.scalar(ty, what);
        }
        let elem = self.type_id(&|| format!("{} element type", what()))?;
        if elem == GgufType::Array {
            return Err(bad(format!(
                "GGUF: {} is an array of arrays, which ggml does not support",
                what()
            )));
        }
        let at = self.pos;
        let len = self.u64(&|| format!("{} length", what()))?;
        if len > self.remaining() / elem.min_size() {
            return Err(bad(format!(
                "GGUF: {} at byte {at} has {len} {} elements, more than the {} bytes left can hold",
                what(),
                elem.name(),
                self.remaining()
            )));
        }
        let keep = len <= MAX_KEPT_ARRAY;
        let mut values = Vec::with_capacity(if keep { len as usize } else { 0 });
        if keep {
            for i in 0..len {
                values.push(self.scalar(elem, &|| format!("{}[{i}]", what()))?);
            }
        } else if elem == GgufType::Str {
            // the vocabulary: each length must be read to find the next string, nothing kept
            for i in 0..len {
                let at = self.pos;
                let n = self.u64(&|| format!("{}[{i}] length", what()))?;
                if n > self.remaining() {
                    return Err(bad(format!(
                        "GGUF: {}[{i}] at byte {at} has length {n}, past the end of the file ({} bytes left)",
                        what(),
                        self.remaining()
                    )));
                }
                self.skip(n, what)?;
            }
        } else {
            self.skip(len * elem.min_size(), what)?;
        }
        Ok(GgufValue::Array {
            elem,
            len,
            values: keep.then_some(values),
        })
    }

    fn skip(&mut self, mut n: u64, what: &dyn Fn() -> String) -> Result<()> {
        let mut buf = [0u8; 256];
        while n > 0 {
            let k = n.min(buf.len() as u64) as usize;
            self.bytes_into(&mut buf[..k], what)?;
            n -= k as u64;
        }
        Ok(())
    }
}

/// Reads the header and tensor-info table from `r`, a stream of `len` bytes, feeding the bytes
/// to `hasher` when given.
fn parse<R: Read>(r: R, len: u64, hasher: Option<&mut blake3::Hasher>) -> Result<GgufHeader> {
    let mut rd = Reader {
        inner: r,
        pos: 0,
        len,
        hasher,
        staged: Vec::new(),
    };
    let magic: [u8; 4] = rd.array(&|| "the magic".into())?;
    if &magic != b"GGUF" {
        return Err(bad(format!(
            "not a GGUF file: magic {magic:02x?}, expected \"GGUF\""
        )));
    }
    let version = rd.u32(&|| "the version".into())?;
    match version {
        2 | 3 => {}
        1 => return Err(bad("GGUF version 1 is no longer supported by ggml".into())),
        v if v & 0xffff == 0 => {
            return Err(bad(format!(
                "GGUF version {v:#x} looks big-endian; only little-endian files are supported"
            )))
        }
        v => return Err(bad(format!("unknown GGUF version {v}, expected 2 or 3"))),
    }
    let n_tensors = rd.u64(&|| "the tensor count".into())?;
    let n_kv = rd.u64(&|| "the metadata count".into())?;
    // a key/value pair takes at least 8 (key length) + 4 (type) + 1 bytes, a tensor info
    // 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset): refuse counts the file cannot hold
    if n_kv > rd.remaining() / 13 {
        return Err(bad(format!(
            "GGUF metadata count {n_kv} is more than the file's {} remaining bytes can hold",
            rd.remaining()
        )));
    }
    if n_tensors > rd.remaining() / 24 {
        return Err(bad(format!(
            "GGUF tensor count {n_tensors} is more than the file's {} remaining bytes can hold",
            rd.remaining()
        )));
    }
    let mut kv: Vec<(String, GgufValue)> = Vec::with_capacity(n_kv as usize);
    let mut keys = HashSet::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = rd.string(&|| format!("key {i}"))?;
        let ty = rd.type_id(&|| format!("key {key:?}"))?;
        let value = rd.value(ty, &|| format!("value of {key:?}"))?;
        if !keys.insert(key.clone()) {
            return Err(bad(format!("GGUF: duplicate key {key:?}")));
        }
        kv.push((key, value));
    }
    let alignment = match kv.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, GgufValue::U32(a))) if a.is_power_of_two() => *a as u64,
        Some((_, v)) => {
            return Err(bad(format!(
                "GGUF: general.alignment must be a power-of-two uint32, got {v:?}"
            )))
        }
    };
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors as usize);
    let mut names = HashSet::with_capacity(n_tensors as usize);
    let mut expected_offset = 0u64;
    for i in 0..n_tensors {
        let name = rd.string(&|| format!("tensor {i} name"))?;
        let n_dims = rd.u32(&|| format!("tensor {name:?} n_dims"))?;
        if n_dims > MAX_DIMS {
            return Err(bad(format!(
                "GGUF: tensor {name:?} has {n_dims} dimensions, at most {MAX_DIMS} are allowed"
            )));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let n = rd.u64(&|| format!("tensor {name:?} ne[{d}]"))?;
            if n > i64::MAX as u64 {
                return Err(bad(format!(
                    "GGUF: tensor {name:?} ne[{d}] = {} is negative",
                    n as i64
                )));
            }
            ne.push(n);
        }
        let type_id = rd.u32(&|| format!("tensor {name:?} type"))?;
        let offset = rd.u64(&|| format!("tensor {name:?} offset"))?;
        let (block, type_size) = ggml_block(type_id).ok_or_else(|| {
            bad(format!(
                "GGUF: tensor {name:?} has unknown ggml type {type_id}"
            ))
        })?;
        let row = ne.first().copied().unwrap_or(1);
        if row % block != 0 {
            return Err(bad(format!(
                "GGUF: tensor {name:?} row length {row} is not a multiple of its type's block size {block}"
            )));
        }
        let elements = ne
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| {
                bad(format!(
                    "GGUF: tensor {name:?} has too many elements ({ne:?})"
                ))
            })?;
        let size = (elements / block)
            .checked_mul(type_size)
            .ok_or_else(|| bad(format!("GGUF: tensor {name:?} size overflows")))?;
        if offset != expected_offset {
            return Err(bad(format!(
                "GGUF: tensor {name:?} has offset {offset}, expected {expected_offset} (tensors must be packed in order at alignment {alignment})"
            )));
        }
        expected_offset = size
            .checked_next_multiple_of(alignment)
            .and_then(|s| s.checked_add(offset))
            .ok_or_else(|| bad(format!("GGUF: tensor {name:?} data end overflows")))?;
        if !names.insert(name.clone()) {
            return Err(bad(format!("GGUF: duplicate tensor name {name:?}")));
        }
        tensors.push(TensorInfo {
            name,
            ne,
            type_id,
            offset,
            size,
        });
    }
    rd.flush_hash();
    let header_len = rd.pos;
    let data_offset = header_len.next_multiple_of(alignment);
    let data_size = expected_offset;
    let end = data_offset.saturating_add(data_size);
    // llama.cpp refuses tensors whose data lies past the end of the file (a truncated model)
    if !tensors.is_empty() && end > len {
        return Err(bad(format!(
            "GGUF tensor data ends at byte {end}, past the end of the file ({len} bytes): the file is truncated"
        )));
    }
    Ok(GgufHeader {
        version,
        kv,
        tensors,
        alignment,
        header_len,
        data_offset,
        data_size,
        file_size: len,
    })
}

/// Parses the header of an in-memory GGUF image (a whole file, or at least its header when
/// the file has no tensors).
pub fn parse_bytes(bytes: &[u8]) -> Result<GgufHeader> {
    parse(bytes, bytes.len() as u64, None)
}

/// The result of [`read_file`]: the header, its fingerprint and what reading it cost.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadHeader {
    /// The header.
    pub header: GgufHeader,
    /// `"blake3:<hex>"` of the header bytes and the data size; see [`read_file`].
    pub fingerprint: String,
    /// Bytes read from the file.
    pub stats: ReadStats,
}

fn io_err(path: &Path, e: std::io::Error) -> KvError {
    KvError::Io(format!("cannot read {}: {e}", path.display()))
}

/// Reads the header of the GGUF file at `path` without reading tensor data.
///
/// The fingerprint is BLAKE3 over the header and tensor-info table followed by the data
/// size as 8 little-endian bytes: two files with the same metadata, tensor layout and data
/// length get the same fingerprint even when their weights differ. `hash_file` hashes every
/// byte of the file instead (then the whole file is read): `"blake3-file:<hex>"`.
pub fn read_file(path: &Path, hash_file: bool) -> Result<ReadHeader> {
    let file = File::open(path).map_err(|e| io_err(path, e))?;
    let len = file.metadata().map_err(|e| io_err(path, e))?.len();
    let mut counting = Counting {
        inner: file,
        count: 0,
    };
    let mut hasher = blake3::Hasher::new();
    let header = {
        let buf = BufReader::with_capacity(64 * 1024, &mut counting);
        parse(buf, len, (!hash_file).then_some(&mut hasher)).map_err(|e| match e {
            KvError::InvalidModel(m) => KvError::InvalidModel(format!("{}: {m}", path.display())),
            other => other,
        })?
    };
    let fingerprint = if hash_file {
        counting.count = len;
        crate::model::fingerprint::hash_file(path)?
    } else {
        hasher.update(&header.data_size.to_le_bytes());
        format!("blake3:{}", hasher.finalize().to_hex())
    };
    Ok(ReadHeader {
        header,
        fingerprint,
        stats: ReadStats {
            bytes_read: counting.count,
        },
    })
}

/// Reads the data of one small f32 tensor (e.g. `rope_freqs.weight`, a few hundred bytes).
pub fn read_f32_tensor(path: &Path, header: &GgufHeader, name: &str) -> Result<Vec<f32>> {
    use std::io::{Seek, SeekFrom};
    let t = header
        .tensor(name)
        .ok_or_else(|| bad(format!("GGUF: no tensor {name:?}")))?;
    if t.type_id != 0 || t.size > 1 << 20 {
        return Err(bad(format!(
            "GGUF: tensor {name:?} is not a small f32 tensor (type {}, {} bytes)",
            t.type_id, t.size
        )));
    }
    let mut f = File::open(path).map_err(|e| io_err(path, e))?;
    f.seek(SeekFrom::Start(header.data_offset + t.offset))
        .map_err(|e| io_err(path, e))?;
    let mut buf = vec![0u8; t.size as usize];
    f.read_exact(&mut buf).map_err(|e| io_err(path, e))?;
    Ok(buf
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Writes GGUF files: metadata and tensor infos, with the data section laid out by the caller.
///
/// Used by the tests (tiny models, malformed variants) and the differential crate.
#[derive(Clone, Debug, Default)]
pub struct GgufBuilder {
    kv: Vec<(String, GgufValue)>,
    tensors: Vec<TensorInfo>,
}

impl GgufBuilder {
    /// An empty GGUF (version 3, alignment 32).
    pub fn new() -> GgufBuilder {
        GgufBuilder::default()
    }

    /// Adds a key/value pair.
    pub fn kv(&mut self, key: &str, value: GgufValue) -> &mut Self {
        self.kv.push((key.to_string(), value));
        self
    }

    /// Adds an array of values of one type.
    pub fn array(&mut self, key: &str, elem: GgufType, values: Vec<GgufValue>) -> &mut Self {
        let len = values.len() as u64;
        self.kv(
            key,
            GgufValue::Array {
                elem,
                len,
                values: Some(values),
            },
        )
    }

    /// Adds a tensor of ggml type `type_id` with dimensions `ne` (ggml order); returns its size
    /// in bytes. Panics for an unknown type (a test bug).
    pub fn tensor(&mut self, name: &str, ne: &[u64], type_id: u32) -> u64 {
        let (block, ts) = ggml_block(type_id).expect("known ggml type");
        let size = ne.iter().product::<u64>() / block * ts;
        let offset = self.data_size();
        self.tensors.push(TensorInfo {
            name: name.into(),
            ne: ne.to_vec(),
            type_id,
            offset,
            size,
        });
        size
    }

    /// Bytes of the data section (each tensor padded to the alignment).
    pub fn data_size(&self) -> u64 {
        self.tensors
            .last()
            .map_or(0, |t| t.offset + t.size.next_multiple_of(DEFAULT_ALIGNMENT))
    }

    /// The tensors added so far, with their offsets.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Header, metadata and tensor infos, padded to the alignment: the data section starts
    /// right after.
    pub fn header(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            write_str(&mut b, k);
            b.extend((v.ty() as u32).to_le_bytes());
            v.write(&mut b);
        }
        for t in &self.tensors {
            write_str(&mut b, &t.name);
            b.extend((t.ne.len() as u32).to_le_bytes());
            for n in &t.ne {
                b.extend(n.to_le_bytes());
            }
            b.extend(t.type_id.to_le_bytes());
            b.extend(t.offset.to_le_bytes());
        }
        b.resize(
            (b.len() as u64).next_multiple_of(DEFAULT_ALIGNMENT) as usize,
            0,
        );
        b
    }

    /// The whole file with zeroed tensor data.
    pub fn bytes_zero_data(&self) -> Vec<u8> {
        let mut b = self.header();
        b.resize(b.len() + self.data_size() as usize, 0);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> GgufBuilder {
        let mut g = GgufBuilder::new();
        g.kv("general.architecture", GgufValue::Str("llama".into()))
            .kv("llama.block_count", GgufValue::U32(2))
            .array(
                "tokenizer.ggml.tokens",
                GgufType::Str,
                vec![GgufValue::Str("a".into()), GgufValue::Str("bc".into())],
            );
        g.tensor("token_embd.weight", &[64, 3], 0);
        g.tensor("blk.0.attn_k.weight", &[64, 32], 8);
        g
    }

    #[test]
    fn round_trips_metadata_and_tensor_infos() {
        let g = tiny();
        let bytes = g.bytes_zero_data();
        let h = parse_bytes(&bytes).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.get("llama.block_count"), Some(&GgufValue::U32(2)));
        assert_eq!(h.tensors, g.tensors());
        assert_eq!(h.tensor("blk.0.attn_k.weight").unwrap().size, 2 * 34 * 32);
        assert_eq!(h.data_offset, g.header().len() as u64);
        assert_eq!(h.data_offset + h.data_size, bytes.len() as u64);
    }

    #[test]
    fn long_arrays_keep_only_type_and_length() {
        let mut g = GgufBuilder::new();
        let n = MAX_KEPT_ARRAY as usize + 1;
        g.array("scores", GgufType::F32, vec![GgufValue::F32(0.5); n]);
        g.array("toks", GgufType::Str, vec![GgufValue::Str("x".into()); n]);
        let h = parse_bytes(&g.bytes_zero_data()).unwrap();
        for key in ["scores", "toks"] {
            match h.get(key).unwrap() {
                GgufValue::Array { len, values, .. } => {
                    assert_eq!((*len, values.is_none()), (n as u64, true))
                }
                v => panic!("{v:?}"),
            }
        }
    }

    #[test]
    fn huge_counts_and_lengths_are_refused_before_allocating() {
        let good = tiny().bytes_zero_data();
        // tensor count, metadata count
        for at in [8usize, 16] {
            let mut b = good.clone();
            b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
            let e = parse_bytes(&b).unwrap_err().to_string();
            assert!(e.contains("count 18446744073709551615"), "{e}");
        }
        // the first key's length
        let mut b = good.clone();
        b[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
        let e = parse_bytes(&b).unwrap_err().to_string();
        assert!(e.contains("past the end"), "{e}");
    }

    #[test]
    fn every_truncation_is_a_typed_error() {
        let good = tiny().bytes_zero_data();
        for n in 0..good.len() {
            match parse_bytes(&good[..n]) {
                Err(KvError::InvalidModel(_)) => {}
                other => panic!("truncated at {n}: {other:?}"),
            }
        }
    }

    #[test]
    fn refuses_wrong_magic_version_and_duplicates() {
        let good = tiny().bytes_zero_data();
        let mut b = good.clone();
        b[0] = b'X';
        assert!(parse_bytes(&b).unwrap_err().to_string().contains("magic"));
        let mut b = good.clone();
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(parse_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("big-endian"));
        let mut g = tiny();
        g.kv("llama.block_count", GgufValue::U32(3));
        assert!(parse_bytes(&g.bytes_zero_data())
            .unwrap_err()
            .to_string()
            .contains("duplicate key"));
    }

    #[test]
    fn refuses_bad_tensor_infos() {
        // unknown type, rows of partial blocks, misplaced offsets
        let mut g = GgufBuilder::new();
        g.tensor("t", &[32], 0);
        let mut b = g.bytes_zero_data();
        let type_at = 24 + 8 + 1 + 4 + 8;
        b[type_at..type_at + 4].copy_from_slice(&4u32.to_le_bytes());
        assert!(parse_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("unknown ggml type 4"));
        b[type_at..type_at + 4].copy_from_slice(&10u32.to_le_bytes());
        assert!(parse_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("block size 256"));
        b[type_at..type_at + 4].copy_from_slice(&0u32.to_le_bytes());
        b[type_at + 4..type_at + 12].copy_from_slice(&32u64.to_le_bytes());
        assert!(parse_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("offset 32"));
    }
}
