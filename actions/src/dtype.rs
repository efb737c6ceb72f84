//! Element types and tensor types.

use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer (torch's default index type).
    I64,
    /// Boolean, one byte per element.
    Bool,
}

impl DType {
    /// Bytes one element occupies in memory.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// Parses the names torch uses (`float32`, `torch.float16`, `long`, …) and
    /// the short names of the intent language (`f32`, `bf16`, `i64`, …).
    pub fn parse(name: &str) -> Option<DType> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        Some(match name {
            "float16" | "half" | "f16" | "fp16" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "float32" | "float" | "f32" | "fp32" => DType::F32,
            "float64" | "double" | "f64" | "fp64" => DType::F64,
            "int8" | "i8" => DType::I8,
            "uint8" | "u8" => DType::U8,
            "int16" | "short" | "i16" => DType::I16,
            "int32" | "int" | "i32" => DType::I32,
            "int64" | "long" | "i64" => DType::I64,
            "bool" => DType::Bool,
            _ => return None,
        })
    }

    /// The short name used in reports and the intent language.
    pub fn short_name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

/// A tensor's shape and element type (dense, row-major).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TensorType {
    /// Extent of each dimension; empty for a scalar.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: DType,
}

impl TensorType {
    /// A tensor type from its shape and element type.
    pub fn new(shape: Vec<u64>, dtype: DType) -> TensorType {
        TensorType { shape, dtype }
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes of the dense tensor.
    pub fn bytes(&self) -> u64 {
        self.numel() * self.dtype.size_bytes()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str("x")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_and_short_names_parse_to_the_same_type() {
        assert_eq!(DType::parse("torch.float32"), Some(DType::F32));
        assert_eq!(DType::parse("f32"), Some(DType::F32));
        assert_eq!(DType::parse("long"), Some(DType::I64));
        assert_eq!(DType::parse("bf16"), Some(DType::BF16));
        assert_eq!(DType::parse("complex64"), None);
    }

    #[test]
    fn bytes_count_every_element() {
        let t = TensorType::new(vec![4, 3, 2], DType::F16);
        assert_eq!(t.numel(), 24);
        assert_eq!(t.bytes(), 48);
        assert_eq!(t.to_string(), "f16[4x3x2]");
        assert_eq!(TensorType::new(vec![], DType::F32).bytes(), 4);
    }
}
