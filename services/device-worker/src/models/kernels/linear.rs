//! Linear weights of the decoder: quantized matrices (the worker's own kernels where this CPU
//! has them, candle's elsewhere), their optional f32 copies for prompt rows, and weights over
//! the same input stacked into one matrix.

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Module, Result, Tensor};

use nomad_q8::QuantMatrix;

/// A quantized weight: Q8_0 or Q4_1 on an x86 CPU with AVX2 (or AVX-512 VNNI) through
/// `nomad_q8`, anything else through candle.
pub enum Quantized {
    Ours(QuantMatrix),
    Candle(QMatMul),
}

impl Quantized {
    pub fn new(q: QTensor) -> Result<Self> {
        Ok(match QuantMatrix::from_qtensor(&q)? {
            Some(m) => Self::Ours(m),
            None => Self::Candle(QMatMul::from_qtensor(q)?),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Ours(m) => m.forward(x),
            Self::Candle(m) => m.forward(x),
        }
    }

    /// Whether a row's result is independent of the rows beside it: a quantized dot product
    /// per row (not a dequantized weight through a shape-dependent matmul).
    pub fn row_exact(&self) -> bool {
        matches!(self, Self::Ours(_) | Self::Candle(QMatMul::QTensor(_)))
    }
}

/// A linear weight: quantized, and with dense prefill also f32 (`[in, out]`).
pub struct Linear {
    pub quantized: Quantized,
    pub dense: Option<Tensor>,
}

/// Which rows of a step take the dense path.
pub enum Rows {
    Quantized,
    Dense,
    /// Decode rows, prompt rows, and the order that puts `[decode; prompt]` back.
    Mixed {
        decode: Tensor,
        prompt: Tensor,
        back: Tensor,
    },
}

impl Linear {
    pub fn new(weight: QTensor, dense: bool) -> Result<Self> {
        let dense = if dense {
            let w = weight.dequantize(&weight.device())?;
            Some(w.t()?.contiguous()?)
        } else {
            None
        };
        Ok(Self {
            quantized: Quantized::new(weight)?,
            dense,
        })
    }

    pub fn forward(&self, x: &Tensor, rows: &Rows) -> Result<Tensor> {
        match (&self.dense, rows) {
            (Some(w), Rows::Dense) => x.matmul(w),
            (
                Some(w),
                Rows::Mixed {
                    decode,
                    prompt,
                    back,
                },
            ) => {
                let a = self.quantized.forward(&x.index_select(decode, 0)?)?;
                let b = x.index_select(prompt, 0)?.matmul(w)?;
                Tensor::cat(&[a, b], 0)?.index_select(back, 0)
            }
            _ => self.quantized.forward(x),
        }
    }

    pub fn dense_bytes(&self) -> u64 {
        self.dense
            .as_ref()
            .map_or(0, |t| (t.elem_count() * 4) as u64)
    }
}

/// Linear weights over one input, stacked into one matrix where their types agree: the input
/// is quantized once and the thread pool runs once for all of them. A quantized matrix's
/// output rows never depend on the rows beside them, so stacking changes no result.
pub struct Stacked {
    /// Each linear and the output widths of the weights it holds, in order.
    groups: Vec<(Linear, Vec<usize>)>,
}

impl Stacked {
    pub fn new(weights: Vec<QTensor>, dense: bool) -> Result<Self> {
        let mut runs: Vec<Vec<QTensor>> = Vec::new();
        for w in weights {
            match runs.last_mut() {
                Some(run)
                    if run[0].dtype() == w.dtype()
                        && run[0].shape().dims2()?.1 == w.shape().dims2()?.1 =>
                {
                    run.push(w)
                }
                _ => runs.push(vec![w]),
            }
        }
        let groups = runs
            .into_iter()
            .map(|run| {
                let widths = run
                    .iter()
                    .map(|w| w.shape().dims2().map(|(rows, _)| rows))
                    .collect::<Result<Vec<_>>>()?;
                Ok((Linear::new(stack(run)?, dense)?, widths))
            })
            .collect::<Result<_>>()?;
        Ok(Self { groups })
    }

    /// Every weight's output side by side, in order.
    pub fn forward(&self, x: &Tensor, rows: &Rows) -> Result<Tensor> {
        let outputs = self
            .groups
            .iter()
            .map(|(linear, _)| linear.forward(x, rows))
            .collect::<Result<Vec<_>>>()?;
        match <[Tensor; 1]>::try_from(outputs) {
            Ok([y]) => Ok(y),
            Err(outputs) => Tensor::cat(&outputs, 1),
        }
    }

    /// The outputs of `forward` one weight at a time: `N` of them.
    pub fn split<const N: usize>(&self, y: &Tensor) -> Result<[Tensor; N]> {
        let mut outputs = Vec::with_capacity(N);
        let mut at = 0;
        for &width in self.groups.iter().flat_map(|(_, widths)| widths) {
            outputs.push(y.narrow(1, at, width)?);
            at += width;
        }
        <[Tensor; N]>::try_from(outputs)
            .map_err(|o| candle_core::Error::Msg(format!("{} stacked outputs, not {N}", o.len())))
    }

    pub fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.groups.iter().map(|(linear, _)| linear)
    }
}

/// Weights of one type over the same inputs as one: their rows one after another (each row is
/// whole blocks, so the bytes simply follow each other).
fn stack(mut run: Vec<QTensor>) -> Result<QTensor> {
    if run.len() == 1 {
        return Ok(run.remove(0));
    }
    let (dtype, device, inputs) = (run[0].dtype(), run[0].device(), run[0].shape().dims2()?.1);
    let mut rows = 0;
    let mut bytes = Vec::new();
    for w in &run {
        rows += w.shape().dims2()?.0;
        bytes.extend_from_slice(&w.data()?);
    }
    candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &bytes, vec![rows, inputs], &device)
}
