//! Cell extensions: what llama.cpp 0.1.161 keeps per cell beyond its position and sequences
//! (`llama_kv_cell_ext`), for M-RoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5: the 2D
//! position of image patches) and PLE models (the token, for the n-gram hash). A base type:
//! the parameters say which extension a cache keeps, the cell table stores it, the state
//! codec reads and writes it.

/// Which cell extension the cells of a payload carry after their `n_seq_id`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CellExt {
    /// None: every model without M-RoPE or PLE, and every file before llama.cpp added it.
    #[default]
    None,
    /// The 2D position `x, y` (8 bytes): M-RoPE files of the first llama.cpp versions that
    /// saved it.
    Pos2,
    /// `x, y, tok` (12 bytes): llama.cpp 0.1.161's `llama_kv_cell_ext`.
    Pos2Tok,
}

impl CellExt {
    /// Bytes of the extension in each cell.
    pub fn bytes(self) -> usize {
        match self {
            CellExt::None => 0,
            CellExt::Pos2 => 8,
            CellExt::Pos2Tok => 12,
        }
    }

    /// Whether cells carry no extension.
    pub fn is_none(self) -> bool {
        self == CellExt::None
    }

    /// The extension named `none`, `pos2` or `pos2-tok` ([`CellExt::name`]).
    pub fn from_name(name: &str) -> Option<CellExt> {
        [CellExt::None, CellExt::Pos2, CellExt::Pos2Tok]
            .into_iter()
            .find(|e| e.name() == name)
    }

    /// Name used in messages and inspection: `none`, `pos2` or `pos2-tok`.
    pub fn name(self) -> &'static str {
        match self {
            CellExt::None => "none",
            CellExt::Pos2 => "pos2",
            CellExt::Pos2Tok => "pos2-tok",
        }
    }
}

/// One cell's extension: its 2D position and token (`tok` is -1, llama.cpp's
/// `LLAMA_TOKEN_NULL`, for embedding input and in [`CellExt::Pos2`] payloads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellExtValue {
    /// Horizontal position.
    pub x: i32,
    /// Vertical position.
    pub y: i32,
    /// The token the cell holds.
    pub tok: i32,
}

impl Default for CellExtValue {
    fn default() -> Self {
        CellExtValue {
            x: 0,
            y: 0,
            tok: -1,
        }
    }
}
