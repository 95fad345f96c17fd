//! Checked conversions between the wire `Tensor` (bytes + shape + dtype) and plain vectors.

use crate::v1::{Dtype, Tensor};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    #[error("tensor dtype is unspecified or unknown ({0})")]
    UnknownDType(i32),
    #[error("tensor shape {shape:?} has too many elements")]
    ShapeOverflow { shape: Vec<u64> },
    #[error("tensor of shape {shape:?} and dtype {dtype} needs {expected} bytes, got {actual}")]
    LengthMismatch {
        shape: Vec<u64>,
        dtype: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("tensor dtype {0} cannot be read as f32 here")]
    Unsupported(&'static str),
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> Option<usize> {
        match self {
            Dtype::Unspecified => None,
            Dtype::U8 => Some(1),
            Dtype::F16 | Dtype::Bf16 => Some(2),
            Dtype::F32 | Dtype::U32 => Some(4),
            Dtype::F64 | Dtype::I64 => Some(8),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Unspecified => "unspecified",
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F64 => "f64",
            Dtype::I64 => "i64",
            Dtype::U32 => "u32",
            Dtype::U8 => "u8",
        }
    }
}

impl Tensor {
    /// A little-endian f32 tensor of `shape`.
    pub fn from_f32(values: &[f32], shape: Vec<u64>) -> Self {
        let mut data = Vec::with_capacity(values.len() * 4);
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        Tensor {
            data,
            shape,
            dtype: Dtype::F32 as i32,
        }
    }

    /// Element count from the shape, refusing shapes whose product overflows.
    pub fn element_count(&self) -> Result<usize, TensorError> {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| {
                usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
            })
            .ok_or_else(|| TensorError::ShapeOverflow {
                shape: self.shape.clone(),
            })
    }

    /// Checks the dtype is known and the byte length matches shape × element size.
    pub fn checked_dtype(&self) -> Result<Dtype, TensorError> {
        let dtype = Dtype::try_from(self.dtype)
            .ok()
            .filter(|d| *d != Dtype::Unspecified)
            .ok_or(TensorError::UnknownDType(self.dtype))?;
        let size = dtype.size().ok_or(TensorError::UnknownDType(self.dtype))?;
        let expected =
            self.element_count()?
                .checked_mul(size)
                .ok_or_else(|| TensorError::ShapeOverflow {
                    shape: self.shape.clone(),
                })?;
        if expected != self.data.len() {
            return Err(TensorError::LengthMismatch {
                shape: self.shape.clone(),
                dtype: dtype.name(),
                expected,
                actual: self.data.len(),
            });
        }
        Ok(dtype)
    }

    /// The elements as f32 (exact for f32, u8, u32 within range; rounded for f64 and i64).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, TensorError> {
        let dtype = self.checked_dtype()?;
        let d = &self.data;
        Ok(match dtype {
            Dtype::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F64 => d
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                .collect(),
            Dtype::I64 => d
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                .collect(),
            Dtype::U32 => d
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
                .collect(),
            Dtype::U8 => d.iter().map(|&b| f32::from(b)).collect(),
            other => return Err(TensorError::Unsupported(other.name())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_round_trips() {
        let t = Tensor::from_f32(&[1.5, -2.0, 3.25], vec![3]);
        assert_eq!(t.to_f32_vec().unwrap(), vec![1.5, -2.0, 3.25]);
    }

    #[test]
    fn length_mismatch_names_shape_dtype_and_sizes() {
        let mut t = Tensor::from_f32(&[1.0, 2.0], vec![3]);
        t.data.pop();
        let msg = t.to_f32_vec().unwrap_err().to_string();
        assert!(
            msg.contains("[3]") && msg.contains("f32") && msg.contains("12") && msg.contains('7'),
            "{msg}"
        );
    }

    #[test]
    fn overflowing_shape_and_unknown_dtype_are_errors_not_panics() {
        let t = Tensor {
            data: vec![],
            shape: vec![u64::MAX, 4],
            dtype: Dtype::F32 as i32,
        };
        assert!(matches!(
            t.to_f32_vec(),
            Err(TensorError::ShapeOverflow { .. })
        ));
        let t = Tensor {
            data: vec![0; 4],
            shape: vec![1],
            dtype: 99,
        };
        assert_eq!(t.to_f32_vec(), Err(TensorError::UnknownDType(99)));
        let t = Tensor {
            data: vec![0; 4],
            shape: vec![1],
            dtype: 0,
        };
        assert_eq!(t.to_f32_vec(), Err(TensorError::UnknownDType(0)));
    }

    #[test]
    fn integer_dtypes_convert() {
        let t = Tensor {
            data: vec![1, 255],
            shape: vec![2],
            dtype: Dtype::U8 as i32,
        };
        assert_eq!(t.to_f32_vec().unwrap(), vec![1.0, 255.0]);
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Whatever a peer sends as a tensor decodes or is refused with a reason; a decoded
            /// tensor has exactly the shape's element count.
            #[test]
            fn any_tensor_decodes_or_is_refused(
                dtype in -2i32..8,
                shape in prop::collection::vec(prop_oneof![0u64..6, any::<u64>()], 0..4),
                data in prop::collection::vec(any::<u8>(), 0..256),
            ) {
                let t = Tensor { data, shape, dtype };
                match t.to_f32_vec() {
                    Ok(values) => prop_assert_eq!(values.len(), t.element_count().unwrap()),
                    Err(e) => prop_assert!(!e.to_string().is_empty()),
                }
            }
        }
    }
}
