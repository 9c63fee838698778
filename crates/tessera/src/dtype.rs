use crate::{Error, Result};

/// Element type of a tensor. Names follow safetensors (`BF16`, `F8_E4M3`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// 64-bit float.
    F64,
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// fp8 e4m3fn.
    F8E4M3,
    /// fp8 e5m2.
    F8E5M2,
    /// signed 64-bit.
    I64,
    /// signed 32-bit.
    I32,
    /// signed 16-bit.
    I16,
    /// signed 8-bit.
    I8,
    /// unsigned 8-bit.
    U8,
    /// unsigned 16-bit.
    U16,
    /// unsigned 32-bit.
    U32,
    /// unsigned 64-bit.
    U64,
    /// boolean, one byte.
    Bool,
}

/// Every dtype, in the order of their on-disk codes.
pub const ALL_DTYPES: [DType; 15] = [
    DType::F64,
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::F8E4M3,
    DType::F8E5M2,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::I8,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::Bool,
];

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The safetensors name (`"BF16"`).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::U16 => "U16",
            DType::U32 => "U32",
            DType::U64 => "U64",
            DType::Bool => "BOOL",
        }
    }

    /// The short lowercase name used by the CLI and JSON (`"bf16"`, `"f8_e4m3fn"`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3 => "f8_e4m3fn",
            DType::F8E5M2 => "f8_e5m2",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
        }
    }

    /// Parses either naming ([`DType::name`] or [`DType::safetensors_name`]).
    pub fn parse(s: &str) -> Result<DType> {
        ALL_DTYPES
            .iter()
            .copied()
            .find(|d| d.name().eq_ignore_ascii_case(s) || d.safetensors_name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::invalid(format!("unknown dtype {s:?}")))
    }

    pub(crate) fn code(self) -> u8 {
        ALL_DTYPES.iter().position(|d| *d == self).unwrap() as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        ALL_DTYPES.get(code as usize).copied()
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
