//! The f64 CPU reference: the value of any chosen element of a graph's
//! output, computed in double precision from the inputs, independently of
//! any kernel.
//!
//! Elements are computed on demand, so checking 4096 elements of a large
//! GEMM costs 4096 dot products, not the whole product. Intermediate
//! elements are memoized; row statistics (softmax, norms) and scan lines
//! are computed once per row.
//!
//! Architecture invariant: pure computation, no I/O; an op it cannot
//! compute is an error naming the op, never a guess.

use std::collections::HashMap;

use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{
    BinaryOp, Fill, Layout, MatMul, Norm, NormKind, Op, Reduce, ReduceOp, Scan, UnaryOp,
};

/// Why a reference value cannot be computed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ReferenceError {
    /// The op has no f64 implementation here.
    #[error(
        "the f64 reference cannot compute `{op}` (node `{node}`); judge this problem with the worker (its PyTorch model is the reference)"
    )]
    Unsupported {
        /// The op, as the graph shows it.
        op: String,
        /// The node's name.
        node: String,
    },
    /// An input was given no values.
    #[error("input `{0}` was given no values")]
    MissingInput(String),
    /// An input was given the wrong number of values.
    #[error("input `{name}` has {got} values; its type needs {want}")]
    InputSize {
        /// The input.
        name: String,
        /// Values given.
        got: usize,
        /// Values its type holds.
        want: usize,
    },
}

/// An input's values, borrowed: f64, or f32 as the GPU saw them.
#[derive(Clone, Copy, Debug)]
pub enum Values<'a> {
    /// Double precision.
    F64(&'a [f64]),
    /// Single precision, widened when read.
    F32(&'a [f32]),
}

impl Values<'_> {
    fn len(&self) -> usize {
        match self {
            Values::F64(v) => v.len(),
            Values::F32(v) => v.len(),
        }
    }

    fn get(&self, i: usize) -> f64 {
        match self {
            Values::F64(v) => v[i],
            Values::F32(v) => f64::from(v[i]),
        }
    }
}

/// Evaluates elements of a graph in f64.
pub struct Reference<'g> {
    g: &'g OpGraph,
    values: HashMap<NodeId, Values<'g>>,
    memo: HashMap<(TensorRef, usize), f64>,
    rows: HashMap<(TensorRef, usize), (f64, f64)>,
    lines: HashMap<(TensorRef, usize), Vec<f64>>,
    /// Each node's inputs and whether every one has the node's own shape.
    operands: HashMap<NodeId, (Vec<TensorRef>, bool)>,
}

fn shape_of(g: &OpGraph, t: TensorRef) -> Vec<usize> {
    g.tensor(t).shape.iter().map(|&d| d as usize).collect()
}

/// The multi-index of `flat` in a row-major tensor of `shape`.
pub fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (k, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            idx[k] = flat % d;
            flat /= d;
        }
    }
    idx
}

/// The flat offset of `idx` in a row-major tensor of `shape`.
pub fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// The index into an input of `in_shape` that numpy broadcasting reads for
/// output index `out`.
fn broadcast(out: &[usize], in_shape: &[usize]) -> usize {
    let offset = out.len() - in_shape.len();
    in_shape.iter().enumerate().fold(0, |acc, (k, &d)| {
        acc * d + if d == 1 { 0 } else { out[offset + k] }
    })
}

impl<'g> Reference<'g> {
    /// A reference for `g` with the values of its inputs and parameters,
    /// by node name, row-major.
    pub fn new(
        g: &'g OpGraph,
        inputs: &'g HashMap<String, Vec<f64>>,
    ) -> Result<Reference<'g>, ReferenceError> {
        let borrowed: HashMap<String, Values<'g>> = inputs
            .iter()
            .map(|(k, v)| (k.clone(), Values::F64(v)))
            .collect();
        Reference::with_values(g, &borrowed)
    }

    /// A reference over borrowed values, f64 or f32.
    pub fn with_values(
        g: &'g OpGraph,
        inputs: &HashMap<String, Values<'g>>,
    ) -> Result<Reference<'g>, ReferenceError> {
        let mut values = HashMap::new();
        for (id, node) in g.nodes() {
            let name = match &node.op {
                Op::Input { name } | Op::Param { name, .. } => name,
                _ => continue,
            };
            let v = inputs
                .get(name)
                .or_else(|| inputs.get(&node.name))
                .ok_or_else(|| ReferenceError::MissingInput(name.clone()))?;
            let want = node.outputs[0].numel() as usize;
            if v.len() != want {
                return Err(ReferenceError::InputSize {
                    name: name.clone(),
                    got: v.len(),
                    want,
                });
            }
            values.insert(id, *v);
        }
        let operands = g
            .nodes()
            .map(|(id, node)| {
                let ins = g.inputs(id);
                let same = node
                    .outputs
                    .first()
                    .is_some_and(|out| ins.iter().all(|&t| g.tensor(t).shape == out.shape));
                (id, (ins, same))
            })
            .collect();
        Ok(Reference {
            g,
            values,
            memo: HashMap::new(),
            rows: HashMap::new(),
            lines: HashMap::new(),
            operands,
        })
    }

    /// Element `flat` (row-major) of tensor `t`.
    pub fn element(&mut self, t: TensorRef, flat: usize) -> Result<f64, ReferenceError> {
        if let Some(v) = self.values.get(&t.node) {
            return Ok(v.get(flat));
        }
        // Elementwise steps on operands of their own shape are recomputed
        // on demand, not memoized: each is a few flops, and a reduction
        // over a computed input reads every element once.
        let g = self.g;
        let (ins, same) = &self.operands[&t.node];
        if *same {
            let first = ins.first().copied();
            match (&g.node(t.node).op, first) {
                (Op::Unary(u), Some(a)) => return Ok(unary(u, self.element(a, flat)?)),
                (
                    Op::Scalar {
                        op,
                        value,
                        scalar_first,
                    },
                    Some(a),
                ) => {
                    let x = self.element(a, flat)?;
                    return Ok(if *scalar_first {
                        binary(*op, *value, x)
                    } else {
                        binary(*op, x, *value)
                    });
                }
                (Op::Binary(b), Some(a)) => {
                    let c = ins[1];
                    let x = self.element(a, flat)?;
                    return Ok(binary(*b, x, self.element(c, flat)?));
                }
                (
                    Op::Layout(Layout::Reshape | Layout::Copy) | Op::Dropout { active: false, .. },
                    Some(a),
                ) if g.tensor(a).numel() == g.tensor(t).numel() => {
                    return self.element(a, flat);
                }
                _ => {}
            }
        }
        if let Some(&v) = self.memo.get(&(t, flat)) {
            return Ok(v);
        }
        let v = self.compute(t, flat)?;
        self.memo.insert((t, flat), v);
        Ok(v)
    }

    fn unsupported(&self, t: TensorRef) -> ReferenceError {
        let node = self.g.node(t.node);
        ReferenceError::Unsupported {
            op: format!("{:?}", node.op).chars().take(80).collect(),
            node: node.name.clone(),
        }
    }

    fn compute(&mut self, t: TensorRef, flat: usize) -> Result<f64, ReferenceError> {
        let g = self.g;
        let op = g.node(t.node).op.clone();
        let ins = g.inputs(t.node);
        let out_shape = shape_of(g, t);
        match op {
            Op::Constant {
                fill: Fill::Full(v),
            } => Ok(v),
            Op::Unary(u) => Ok(unary(&u, self.element(ins[0], flat)?)),
            Op::Binary(b) => {
                let idx = unravel(flat, &out_shape);
                let a = self.element(ins[0], broadcast(&idx, &shape_of(g, ins[0])))?;
                let c = self.element(ins[1], broadcast(&idx, &shape_of(g, ins[1])))?;
                Ok(binary(b, a, c))
            }
            Op::Scalar {
                op,
                value,
                scalar_first,
            } => {
                let x = self.element(ins[0], flat)?;
                Ok(if scalar_first {
                    binary(op, value, x)
                } else {
                    binary(op, x, value)
                })
            }
            Op::Dropout { active: false, .. } => self.element(ins[0], flat),
            Op::Layout(Layout::Reshape | Layout::Copy) => self.element(ins[0], flat),
            Op::Layout(Layout::Cast { to }) => {
                let x = self.element(ins[0], flat)?;
                Ok(if to.is_float() { x } else { x.trunc() })
            }
            Op::Layout(Layout::Expand) => {
                let idx = unravel(flat, &out_shape);
                self.element(ins[0], broadcast(&idx, &shape_of(g, ins[0])))
            }
            Op::Layout(Layout::Permute { perm }) => {
                let idx = unravel(flat, &out_shape);
                let in_shape = shape_of(g, ins[0]);
                let mut in_idx = vec![0; idx.len()];
                for (d, &p) in perm.iter().enumerate() {
                    in_idx[p] = idx[d];
                }
                self.element(ins[0], ravel(&in_idx, &in_shape))
            }
            Op::Triangular { upper, diagonal } => {
                let idx = unravel(flat, &out_shape);
                let (i, j) = (idx[idx.len() - 2] as i64, idx[idx.len() - 1] as i64);
                let keep = if upper {
                    j - i >= diagonal
                } else {
                    j - i <= diagonal
                };
                if keep {
                    self.element(ins[0], flat)
                } else {
                    Ok(0.0)
                }
            }
            Op::MatMul(m) => self.matmul(&m, &ins, &out_shape, flat, t),
            Op::Reduce(r) => self.reduce(&r, ins[0], &out_shape, flat, t),
            Op::Softmax { dim, log } => self.softmax(ins[0], dim, log, &out_shape, flat, t),
            Op::Norm(n) => self.norm(&n, &ins, &out_shape, flat, t),
            Op::Scan(s) => self.scan(&s, ins[0], &out_shape, flat, t),
            _ => Err(self.unsupported(t)),
        }
    }

    fn matmul(
        &mut self,
        m: &MatMul,
        ins: &[TensorRef],
        out_shape: &[usize],
        flat: usize,
        t: TensorRef,
    ) -> Result<f64, ReferenceError> {
        let (sa, sb) = (shape_of(self.g, ins[0]), shape_of(self.g, ins[1]));
        if sa.len() < 2 || sb.len() < 2 {
            return Err(self.unsupported(t));
        }
        let idx = unravel(flat, out_shape);
        let r = idx.len();
        let (i, j) = (idx[r - 2], idx[r - 1]);
        let k_len = if m.trans_a {
            sa[sa.len() - 2]
        } else {
            sa[sa.len() - 1]
        };
        let mut a_idx: Vec<usize> = idx[r - sa.len()..].to_vec();
        let mut b_idx: Vec<usize> = idx[r - sb.len()..].to_vec();
        // Broadcast batch dims of size one.
        for (k, d) in sa[..sa.len() - 2].iter().enumerate() {
            if *d == 1 {
                a_idx[k] = 0;
            }
        }
        for (k, d) in sb[..sb.len() - 2].iter().enumerate() {
            if *d == 1 {
                b_idx[k] = 0;
            }
        }
        let (la, lb) = (a_idx.len(), b_idx.len());
        // Offsets of A(i, 0) and B(0, j), and the step along k of each.
        if m.trans_a {
            a_idx[la - 2] = 0;
            a_idx[la - 1] = i;
        } else {
            a_idx[la - 2] = i;
            a_idx[la - 1] = 0;
        }
        if m.trans_b {
            b_idx[lb - 2] = j;
            b_idx[lb - 1] = 0;
        } else {
            b_idx[lb - 2] = 0;
            b_idx[lb - 1] = j;
        }
        let (a0, b0) = (ravel(&a_idx, &sa), ravel(&b_idx, &sb));
        let a_step = if m.trans_a { sa[sa.len() - 1] } else { 1 };
        let b_step = if m.trans_b { 1 } else { sb[sb.len() - 1] };
        let mut sum = 0.0;
        // Inputs are read straight from their values; computed operands
        // through `element` (memoized).
        let (va, vb) = (
            self.values.get(&ins[0].node).copied(),
            self.values.get(&ins[1].node).copied(),
        );
        for k in 0..k_len {
            let a = match va {
                Some(v) => v.get(a0 + k * a_step),
                None => self.element(ins[0], a0 + k * a_step)?,
            };
            let b = match vb {
                Some(v) => v.get(b0 + k * b_step),
                None => self.element(ins[1], b0 + k * b_step)?,
            };
            sum += a * b;
        }
        if m.bias {
            let sbias = shape_of(self.g, ins[2]);
            sum += self.element(ins[2], broadcast(&idx, &sbias))?;
        }
        Ok(sum)
    }

    /// The input elements a reduction over `dims` reads for output `flat`.
    fn reduced_elements(
        &mut self,
        input: TensorRef,
        dims: &[usize],
        keepdim: bool,
        out_shape: &[usize],
        flat: usize,
    ) -> Result<Vec<f64>, ReferenceError> {
        let in_shape = shape_of(self.g, input);
        let out_idx = unravel(flat, out_shape);
        let mut base = vec![0; in_shape.len()];
        let mut o = 0;
        for (d, slot) in base.iter_mut().enumerate() {
            if dims.contains(&d) {
                if keepdim {
                    o += 1;
                }
            } else {
                *slot = out_idx[o];
                o += 1;
            }
        }
        let extents: Vec<usize> = dims.iter().map(|&d| in_shape[d]).collect();
        let count: usize = extents.iter().product();
        let mut values = Vec::with_capacity(count);
        for n in 0..count {
            let sub = unravel(n, &extents);
            for (k, &d) in dims.iter().enumerate() {
                base[d] = sub[k];
            }
            values.push(self.element(input, ravel(&base, &in_shape))?);
        }
        Ok(values)
    }

    fn reduce(
        &mut self,
        r: &Reduce,
        input: TensorRef,
        out_shape: &[usize],
        flat: usize,
        t: TensorRef,
    ) -> Result<f64, ReferenceError> {
        let mut dims = r.dims.clone();
        if dims.is_empty() {
            dims = (0..shape_of(self.g, input).len()).collect();
        }
        dims.sort_unstable();
        let v = self.reduced_elements(input, &dims, r.keepdim, out_shape, flat)?;
        let n = v.len() as f64;
        let argext = |better: fn(f64, f64) -> bool| {
            let mut best = 0;
            for (k, &x) in v.iter().enumerate() {
                if x.is_nan() {
                    return k as f64;
                }
                if better(x, v[best]) {
                    best = k;
                }
            }
            best as f64
        };
        Ok(match r.op {
            ReduceOp::Sum => v.iter().sum(),
            ReduceOp::Mean => v.iter().sum::<f64>() / n,
            ReduceOp::Max { .. } | ReduceOp::Min { .. } if t.output == 1 => {
                if matches!(r.op, ReduceOp::Max { .. }) {
                    argext(|a, b| a > b)
                } else {
                    argext(|a, b| a < b)
                }
            }
            ReduceOp::Max { .. } => v.iter().copied().fold(f64::NEG_INFINITY, nan_max),
            ReduceOp::Min { .. } => v.iter().copied().fold(f64::INFINITY, nan_min),
            ReduceOp::Prod => v.iter().product(),
            ReduceOp::ArgMax => argext(|a, b| a > b),
            ReduceOp::ArgMin => argext(|a, b| a < b),
            ReduceOp::LogSumExp => {
                let m = v.iter().copied().fold(f64::NEG_INFINITY, nan_max);
                if m.is_infinite() {
                    m
                } else {
                    m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
                }
            }
            ReduceOp::Norm { p } => {
                if p == 2.0 {
                    v.iter().map(|x| x * x).sum::<f64>().sqrt()
                } else if p.is_infinite() {
                    v.iter().map(|x| x.abs()).fold(0.0, nan_max)
                } else {
                    v.iter().map(|x| x.abs().powf(p)).sum::<f64>().powf(1.0 / p)
                }
            }
            ReduceOp::Var { correction } | ReduceOp::Std { correction } => {
                let mean = v.iter().sum::<f64>() / n;
                let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - correction);
                if matches!(r.op, ReduceOp::Std { .. }) {
                    var.sqrt()
                } else {
                    var
                }
            }
        })
    }

    /// The line of `input` along `dim` through element `flat`.
    fn line(
        &mut self,
        input: TensorRef,
        dim: usize,
        shape: &[usize],
        flat: usize,
    ) -> Result<Vec<f64>, ReferenceError> {
        let mut idx = unravel(flat, shape);
        let mut values = Vec::with_capacity(shape[dim]);
        for k in 0..shape[dim] {
            idx[dim] = k;
            values.push(self.element(input, ravel(&idx, shape))?);
        }
        Ok(values)
    }

    fn softmax(
        &mut self,
        input: TensorRef,
        dim: usize,
        log: bool,
        shape: &[usize],
        flat: usize,
        t: TensorRef,
    ) -> Result<f64, ReferenceError> {
        let key = (t, line_key(flat, shape, dim));
        let (m, s) = match self.rows.get(&key) {
            Some(&stats) => stats,
            None => {
                let v = self.line(input, dim, shape, flat)?;
                let m = v.iter().copied().fold(f64::NEG_INFINITY, nan_max);
                let s: f64 = v.iter().map(|x| (x - m).exp()).sum();
                self.rows.insert(key, (m, s));
                (m, s)
            }
        };
        let x = self.element(input, flat)?;
        Ok(if log {
            x - m - s.ln()
        } else {
            (x - m).exp() / s
        })
    }

    fn norm(
        &mut self,
        n: &Norm,
        ins: &[TensorRef],
        shape: &[usize],
        flat: usize,
        t: TensorRef,
    ) -> Result<f64, ReferenceError> {
        let (dims, rms) = match n.kind {
            NormKind::Layer { dims } => (dims, false),
            NormKind::Rms { dims } => (dims, true),
            NormKind::Lp { p, dim } => {
                let key = (t, line_key(flat, shape, dim));
                let inv = match self.rows.get(&key) {
                    Some(&(_, inv)) => inv,
                    None => {
                        let v = self.line(ins[0], dim, shape, flat)?;
                        let length = v.iter().map(|x| x.abs().powf(p)).sum::<f64>();
                        let inv = 1.0 / length.powf(1.0 / p).max(n.eps);
                        self.rows.insert(key, (0.0, inv));
                        inv
                    }
                };
                return Ok(self.element(ins[0], flat)? * inv);
            }
            NormKind::RmsAt { dim } => {
                let key = (t, line_key(flat, shape, dim));
                let inv = match self.rows.get(&key) {
                    Some(&(_, inv)) => inv,
                    None => {
                        let v = self.line(ins[0], dim, shape, flat)?;
                        let ms = v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64;
                        let inv = 1.0 / (ms + n.eps).sqrt();
                        self.rows.insert(key, (0.0, inv));
                        inv
                    }
                };
                return Ok(self.element(ins[0], flat)? * inv);
            }
            _ => return Err(self.unsupported(t)),
        };
        let inner: usize = shape[shape.len() - dims..].iter().product();
        let row = flat / inner;
        let key = (t, row);
        let (center, inv) = match self.rows.get(&key) {
            Some(&stats) => stats,
            None => {
                let mut v = Vec::with_capacity(inner);
                for k in 0..inner {
                    v.push(self.element(ins[0], row * inner + k)?);
                }
                let count = inner as f64;
                let stats = if rms {
                    let ms = v.iter().map(|x| x * x).sum::<f64>() / count;
                    (0.0, 1.0 / (ms + n.eps).sqrt())
                } else {
                    let mean = v.iter().sum::<f64>() / count;
                    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / count;
                    (mean, 1.0 / (var + n.eps).sqrt())
                };
                self.rows.insert(key, stats);
                stats
            }
        };
        let mut y = (self.element(ins[0], flat)? - center) * inv;
        let j = flat % inner;
        if n.affine {
            y *= self.element(ins[1], j)?;
        }
        if n.bias && ins.len() > 2 {
            y += self.element(ins[2], j)?;
        }
        Ok(y)
    }

    fn scan(
        &mut self,
        s: &Scan,
        input: TensorRef,
        shape: &[usize],
        flat: usize,
        t: TensorRef,
    ) -> Result<f64, ReferenceError> {
        let key = (t, line_key(flat, shape, s.dim));
        if !self.lines.contains_key(&key) {
            let mut v = self.line(input, s.dim, shape, flat)?;
            if s.reverse {
                v.reverse();
            }
            let mut acc = if s.prod { 1.0 } else { 0.0 };
            let mut out = Vec::with_capacity(v.len());
            for x in v {
                if s.exclusive {
                    out.push(acc);
                }
                acc = if s.prod { acc * x } else { acc + x };
                if !s.exclusive {
                    out.push(acc);
                }
            }
            if s.reverse {
                out.reverse();
            }
            self.lines.insert(key, out);
        }
        Ok(self.lines[&key][unravel(flat, shape)[s.dim]])
    }
}

/// The line along `dim` that element `flat` of `shape` lies on, as one
/// number: the flat index with that dim set to zero. Caches key a line by
/// it and by the op's own result, so ops reading one input keep their
/// statistics apart.
fn line_key(flat: usize, shape: &[usize], dim: usize) -> usize {
    let mut idx = unravel(flat, shape);
    idx[dim] = 0;
    ravel(&idx, shape)
}

fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

fn softplus(x: f64, beta: f64, threshold: f64) -> f64 {
    if beta * x > threshold {
        x
    } else {
        (beta * x).exp().ln_1p() / beta
    }
}

/// torch's definition of each elementwise function, in f64.
pub fn unary(u: &UnaryOp, x: f64) -> f64 {
    const SELU_ALPHA: f64 = 1.673_263_242_354_377_3;
    const SELU_SCALE: f64 = 1.050_700_987_355_480_5;
    let clamp = |x: f64, lo: f64, hi: f64| if x.is_nan() { x } else { x.max(lo).min(hi) };
    match u {
        UnaryOp::Relu => clamp(x, 0.0, f64::INFINITY),
        UnaryOp::Relu6 => clamp(x, 0.0, 6.0),
        UnaryOp::LeakyRelu { slope } => {
            if x > 0.0 {
                x
            } else {
                x * slope
            }
        }
        UnaryOp::Gelu { tanh: false } => 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
        UnaryOp::Gelu { tanh: true } => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Silu => x / (1.0 + (-x).exp()),
        UnaryOp::Mish => x * softplus(x, 1.0, 20.0).tanh(),
        UnaryOp::Hardswish => x * clamp(x + 3.0, 0.0, 6.0) / 6.0,
        UnaryOp::Hardsigmoid => clamp(x + 3.0, 0.0, 6.0) / 6.0,
        UnaryOp::Hardtanh { min, max } => clamp(x, *min, *max),
        UnaryOp::Softplus { beta, threshold } => softplus(x, *beta, *threshold),
        UnaryOp::Softsign => x / (1.0 + x.abs()),
        UnaryOp::Elu { alpha } => {
            if x > 0.0 {
                x
            } else {
                alpha * x.exp_m1()
            }
        }
        UnaryOp::Selu => SELU_SCALE * if x > 0.0 { x } else { SELU_ALPHA * x.exp_m1() },
        UnaryOp::Clamp { min, max } => clamp(
            x,
            min.unwrap_or(f64::NEG_INFINITY),
            max.unwrap_or(f64::INFINITY),
        ),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Neg => -x,
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Reciprocal => 1.0 / x,
        UnaryOp::Erf => libm::erf(x),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Sign => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                x
            }
        }
        UnaryOp::Not => f64::from(u8::from(x == 0.0)),
    }
}

/// torch's definition of each binary op, in f64; comparisons give 1 or 0.
pub fn binary(b: BinaryOp, x: f64, y: f64) -> f64 {
    let truth = |c: bool| f64::from(u8::from(c));
    match b {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
        BinaryOp::FloorDiv => (x / y).floor(),
        BinaryOp::Pow => x.powf(y),
        BinaryOp::Maximum => nan_max(x, y),
        BinaryOp::Minimum => nan_min(x, y),
        BinaryOp::Eq => truth(x == y),
        BinaryOp::Ne => truth(x != y),
        BinaryOp::Lt => truth(x < y),
        BinaryOp::Le => truth(x <= y),
        BinaryOp::Gt => truth(x > y),
        BinaryOp::Ge => truth(x >= y),
    }
}

/// A seeded generator: `rand`'s ChaCha8 (`rand_chacha::ChaCha8Rng`, whose
/// stream for a seed is the same on every platform and release of the
/// crate), for the native evaluator's inputs and the sample of elements it
/// checks, and, through `mtmc_planner::rng`, every seeded draw of the
/// planner.
#[derive(Clone, Debug)]
pub struct Rng(rand_chacha::ChaCha8Rng);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        use rand::SeedableRng;
        Rng(rand_chacha::ChaCha8Rng::seed_from_u64(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        rand::RngCore::next_u64(&mut self.0)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        rand::Rng::random::<f64>(&mut self.0)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        rand::Rng::sample(&mut self.0, rand_distr::StandardNormal)
    }

    /// Uniform in [0, n) (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        rand::Rng::random_range(&mut self.0, 0..n)
    }

    /// Shuffles `v` in place.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        rand::seq::SliceRandom::shuffle(v, &mut self.0);
    }
}

/// Which elements of an output of `shape` to check: all of them up to
/// `all_up_to`; else the edges (first and last rows and columns of the
/// first and last matrices, the first and last 256 elements) and `sampled`
/// more at random. Sorted, without repeats.
pub fn elements_to_check(
    shape: &[usize],
    all_up_to: usize,
    sampled: usize,
    rng: &mut Rng,
) -> Vec<usize> {
    let numel: usize = shape.iter().product();
    if numel <= all_up_to {
        return (0..numel).collect();
    }
    let mut picked: Vec<usize> = (0..256.min(numel))
        .chain(numel.saturating_sub(256)..numel)
        .collect();
    if shape.len() >= 2 {
        let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
        let matrices = numel / (rows * cols).max(1);
        for m in [0, matrices.saturating_sub(1)] {
            let base = m * rows * cols;
            let step_c = cols.div_ceil(1024).max(1);
            let step_r = rows.div_ceil(1024).max(1);
            for c in (0..cols).step_by(step_c) {
                picked.push(base + c);
                picked.push(base + (rows - 1) * cols + c);
            }
            for r in (0..rows).step_by(step_r) {
                picked.push(base + r * cols);
                picked.push(base + r * cols + cols - 1);
            }
        }
    }
    for _ in 0..sampled {
        picked.push(rng.below(numel));
    }
    picked.sort_unstable();
    picked.dedup();
    picked
}
