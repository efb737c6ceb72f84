//! Lowering of intent statements to an op graph, with shape checking.

use std::collections::{BTreeMap, HashMap};

use super::syntax::{Arg, DimSpec, Expr, Stmt};
use super::{ErrorKind, IntentError, Pos};
use crate::dtype::{DType, TensorType};
use crate::graph::{OpGraph, TensorRef};
use crate::op::{BinaryOp, Layout, MatMul, Norm, NormKind, Op, Reduce, ReduceOp, Scan, UnaryOp};

/// A tensor value with an optional name per dim.
#[derive(Clone, Debug)]
struct Value {
    t: TensorRef,
    dims: Vec<Option<String>>,
}

enum Operand {
    Tensor(Value),
    Scalar(f64),
}

pub(super) struct Lowerer<'a> {
    graph: OpGraph,
    scope: HashMap<String, Value>,
    assigned: Vec<(String, Pos)>,
    used: HashMap<String, usize>,
    dim_sizes: HashMap<String, u64>,
    shapes: &'a BTreeMap<String, Vec<u64>>,
    dtype: DType,
    counter: usize,
}

fn err(pos: Pos, kind: ErrorKind, msg: impl Into<String>) -> IntentError {
    IntentError::new(pos, kind, msg)
}

impl<'a> Lowerer<'a> {
    pub fn new(shapes: &'a BTreeMap<String, Vec<u64>>, dtype: DType) -> Lowerer<'a> {
        Lowerer {
            graph: OpGraph::new(),
            scope: HashMap::new(),
            assigned: Vec::new(),
            used: HashMap::new(),
            dim_sizes: HashMap::new(),
            shapes,
            dtype,
            counter: 0,
        }
    }

    pub fn finish(mut self, stmts: &[Stmt]) -> Result<OpGraph, IntentError> {
        for s in stmts {
            self.statement(s)?;
        }
        let end = Pos { line: 1, column: 1 };
        for name in self.shapes.keys() {
            if !self.scope.contains_key(name) {
                return Err(err(
                    end,
                    ErrorKind::UnknownName,
                    format!("--shape gives `{name}`, which the program never uses"),
                ));
            }
        }
        let outputs: Vec<TensorRef> = self
            .assigned
            .iter()
            .filter(|(n, _)| !self.used.contains_key(n))
            .map(|(n, _)| self.scope[n].t)
            .collect();
        if outputs.is_empty() {
            return Err(err(
                end,
                ErrorKind::Syntax,
                "the program computes nothing: write at least one `name = expression`",
            ));
        }
        self.graph.set_outputs(outputs);
        crate::normalize::normalize(&mut self.graph);
        Ok(self.graph)
    }

    fn statement(&mut self, s: &Stmt) -> Result<(), IntentError> {
        match s {
            Stmt::Decl {
                name,
                dtype,
                dims,
                pos,
            } => {
                self.check_fresh(name, *pos)?;
                let dtype = match dtype {
                    None => self.dtype,
                    Some((d, p)) => DType::parse(d).ok_or_else(|| {
                        err(
                            *p,
                            ErrorKind::BadArgument,
                            format!(
                                "unknown dtype `{d}` (use f16, bf16, f32, f64, i32, i64 or bool)"
                            ),
                        )
                    })?,
                };
                let (shape, names) = self.dims(dims)?;
                if let Some(flag) = self.shapes.get(name)
                    && *flag != shape
                {
                    return Err(err(
                        *pos,
                        ErrorKind::ShapeMismatch,
                        format!(
                            "`{name}` is declared {} here but --shape gives {}",
                            fmt_shape(&shape),
                            fmt_shape(flag)
                        ),
                    ));
                }
                self.input(name, TensorType::new(shape, dtype), names);
                Ok(())
            }
            Stmt::Assign { name, expr, pos } => {
                self.check_fresh(name, *pos)?;
                let v = match self.expr(expr)? {
                    Operand::Tensor(v) => v,
                    Operand::Scalar(_) => {
                        return Err(err(
                            expr.pos(),
                            ErrorKind::BadArgument,
                            format!(
                                "`{name}` would be a plain number; the program computes tensors"
                            ),
                        ));
                    }
                };
                self.rename(v.t, name);
                self.scope.insert(name.clone(), v);
                self.assigned.push((name.clone(), *pos));
                Ok(())
            }
        }
    }

    /// Names the node that computed an assigned value after the variable,
    /// unless the value is an existing input or variable.
    fn rename(&mut self, t: TensorRef, name: &str) {
        let taken = self.scope.values().any(|v| v.t.node == t.node);
        if !taken {
            self.graph.set_name(t.node, name);
        }
    }

    fn check_fresh(&self, name: &str, pos: Pos) -> Result<(), IntentError> {
        if self.scope.contains_key(name) {
            return Err(err(
                pos,
                ErrorKind::Redefined,
                format!("`{name}` is already defined; give the new value another name"),
            ));
        }
        Ok(())
    }

    fn dims(&mut self, dims: &[DimSpec]) -> Result<(Vec<u64>, Vec<Option<String>>), IntentError> {
        let mut shape = Vec::new();
        let mut names = Vec::new();
        for d in dims {
            let size = match (&d.name, d.size) {
                (_, Some(0)) => {
                    return Err(err(
                        d.pos,
                        ErrorKind::BadArgument,
                        "a dim must be at least 1",
                    ));
                }
                (Some(n), Some(s)) => match self.dim_sizes.get(n) {
                    Some(&old) if old != s => {
                        return Err(err(
                            d.pos,
                            ErrorKind::ShapeMismatch,
                            format!("dim `{n}` is {old} elsewhere but {s} here"),
                        ));
                    }
                    _ => {
                        self.dim_sizes.insert(n.clone(), s);
                        s
                    }
                },
                (Some(n), None) => *self.dim_sizes.get(n).ok_or_else(|| {
                    err(
                        d.pos,
                        ErrorKind::UnknownDim,
                        format!(
                            "dim `{n}` has no size yet: write `{n}=SIZE` where it first appears"
                        ),
                    )
                })?,
                (None, Some(s)) => s,
                (None, None) => unreachable!("the parser gives a dim a name or a size"),
            };
            shape.push(size);
            names.push(d.name.clone());
        }
        Ok((shape, names))
    }

    fn input(&mut self, name: &str, ty: TensorType, dims: Vec<Option<String>>) -> Value {
        let id = self
            .graph
            .add(name, Op::Input { name: name.into() }, &[], vec![ty])
            .expect("inputs have no inputs");
        let v = Value {
            t: TensorRef::first(id),
            dims,
        };
        self.scope.insert(name.to_string(), v.clone());
        v
    }

    fn ty(&self, v: &Value) -> &TensorType {
        self.graph.tensor(v.t)
    }

    fn add(
        &mut self,
        op: Op,
        inputs: &[TensorRef],
        out: TensorType,
        dims: Vec<Option<String>>,
    ) -> Value {
        self.counter += 1;
        let name = format!("{}{}", op.class().name(), self.counter);
        let id = self
            .graph
            .add(name, op, inputs, vec![out])
            .expect("inputs come from this graph");
        Value {
            t: TensorRef::first(id),
            dims,
        }
    }

    fn var(&mut self, name: &str, pos: Pos) -> Result<Value, IntentError> {
        *self.used.entry(name.to_string()).or_default() += 1;
        if let Some(v) = self.scope.get(name) {
            return Ok(v.clone());
        }
        match self.shapes.get(name) {
            Some(shape) => Ok(self.input(
                name,
                TensorType::new(shape.clone(), self.dtype),
                vec![None; shape.len()],
            )),
            None => Err(err(
                pos,
                ErrorKind::MissingShape,
                format!(
                    "`{name}` has no shape: declare it (`{name}: [4096, 1024]`) or pass --shape {name}=4096x1024"
                ),
            )),
        }
    }

    fn expr(&mut self, e: &Expr) -> Result<Operand, IntentError> {
        match e {
            Expr::Num(n, _) => Ok(Operand::Scalar(*n)),
            Expr::Var(name, pos) => Ok(Operand::Tensor(self.var(name, *pos)?)),
            Expr::List(_, pos) => Err(err(
                *pos,
                ErrorKind::BadArgument,
                "a list is only allowed as a function argument (e.g. `dim=[m, n]`)",
            )),
            Expr::Neg(inner, _) => match self.expr(inner)? {
                Operand::Scalar(s) => Ok(Operand::Scalar(-s)),
                Operand::Tensor(v) => {
                    let out = self.ty(&v).clone();
                    let dims = v.dims.clone();
                    Ok(Operand::Tensor(self.add(
                        Op::Unary(UnaryOp::Neg),
                        &[v.t],
                        out,
                        dims,
                    )))
                }
            },
            Expr::Transpose(inner, pos) => {
                let v = self.tensor(inner)?;
                let rank = self.ty(&v).rank();
                if rank < 2 {
                    return Err(err(
                        *pos,
                        ErrorKind::ShapeMismatch,
                        format!(
                            "`.T` needs at least 2 dims, but the operand is {}",
                            self.ty(&v)
                        ),
                    ));
                }
                Ok(Operand::Tensor(self.swap(v, rank - 2, rank - 1)))
            }
            Expr::Bin(op, l, r, pos) => {
                let a = self.expr(l)?;
                let b = self.expr(r)?;
                if *op == "@" {
                    let (Operand::Tensor(a), Operand::Tensor(b)) = (a, b) else {
                        return Err(err(*pos, ErrorKind::BadArgument, "`@` needs two tensors"));
                    };
                    return Ok(Operand::Tensor(self.matmul(a, b, false, None, *pos)?));
                }
                let bop = match *op {
                    "+" => BinaryOp::Add,
                    "-" => BinaryOp::Sub,
                    "*" => BinaryOp::Mul,
                    "/" => BinaryOp::Div,
                    _ => BinaryOp::Pow,
                };
                self.binary(bop, a, b, *pos)
            }
            Expr::Call(name, args, pos) => self.call(name, args, *pos),
        }
    }

    fn tensor(&mut self, e: &Expr) -> Result<Value, IntentError> {
        match self.expr(e)? {
            Operand::Tensor(v) => Ok(v),
            Operand::Scalar(_) => Err(err(
                e.pos(),
                ErrorKind::BadArgument,
                "expected a tensor, found a number",
            )),
        }
    }

    fn swap(&mut self, v: Value, a: usize, b: usize) -> Value {
        let ty = self.ty(&v).clone();
        let mut perm: Vec<usize> = (0..ty.rank()).collect();
        perm.swap(a, b);
        let shape = perm.iter().map(|&p| ty.shape[p]).collect();
        let dims = perm.iter().map(|&p| v.dims[p].clone()).collect();
        self.add(
            Op::Layout(Layout::Permute { perm }),
            &[v.t],
            TensorType::new(shape, ty.dtype),
            dims,
        )
    }

    fn binary(
        &mut self,
        op: BinaryOp,
        a: Operand,
        b: Operand,
        pos: Pos,
    ) -> Result<Operand, IntentError> {
        match (a, b) {
            (Operand::Scalar(x), Operand::Scalar(y)) => Ok(Operand::Scalar(match op {
                BinaryOp::Add => x + y,
                BinaryOp::Sub => x - y,
                BinaryOp::Mul => x * y,
                BinaryOp::Div => x / y,
                _ => x.powf(y),
            })),
            (Operand::Tensor(x), Operand::Tensor(y)) => {
                let (shape, dims) = self.broadcast(&x, &y, op.symbol(), pos)?;
                let dtype = self.ty(&x).dtype;
                Ok(Operand::Tensor(self.add(
                    Op::Binary(op),
                    &[x.t, y.t],
                    TensorType::new(shape, dtype),
                    dims,
                )))
            }
            (a, b) => {
                let (v, s, scalar_first) = match (a, b) {
                    (Operand::Tensor(v), Operand::Scalar(s)) => (v, s, false),
                    (Operand::Scalar(s), Operand::Tensor(v)) => (v, s, true),
                    _ => unreachable!("the other pairs are matched above"),
                };
                let out = self.ty(&v).clone();
                let dims = v.dims.clone();
                Ok(Operand::Tensor(self.add(
                    Op::Scalar {
                        op,
                        value: s,
                        scalar_first,
                    },
                    &[v.t],
                    out,
                    dims,
                )))
            }
        }
    }

    fn broadcast(
        &self,
        x: &Value,
        y: &Value,
        what: &str,
        pos: Pos,
    ) -> Result<(Vec<u64>, Vec<Option<String>>), IntentError> {
        let (tx, ty) = (self.ty(x), self.ty(y));
        if tx.dtype != ty.dtype {
            return Err(err(
                pos,
                ErrorKind::ShapeMismatch,
                format!("`{what}` mixes {tx} and {ty}: cast one side first"),
            ));
        }
        let rank = tx.rank().max(ty.rank());
        let mut shape = vec![0; rank];
        let mut dims = vec![None; rank];
        for i in 0..rank {
            let get = |t: &TensorType, v: &Value| {
                let off = rank - t.rank();
                (i >= off).then(|| (t.shape[i - off], v.dims[i - off].clone()))
            };
            let (a, b) = (get(tx, x), get(ty, y));
            let (size, name) = match (a, b) {
                (Some((s, n)), None) | (None, Some((s, n))) => (s, n),
                (Some((sa, na)), Some((sb, nb))) => {
                    if sa != sb && sa != 1 && sb != 1 {
                        return Err(err(
                            pos,
                            ErrorKind::ShapeMismatch,
                            format!(
                                "`{what}` cannot broadcast {tx} with {ty}: dim {} is {sa} on the left and {sb} on the right",
                                i as i64 - rank as i64
                            ),
                        ));
                    }
                    (sa.max(sb), if sa >= sb { na.or(nb) } else { nb.or(na) })
                }
                (None, None) => unreachable!("i < rank of one side"),
            };
            shape[i] = size;
            dims[i] = name;
        }
        Ok((shape, dims))
    }

    fn matmul(
        &mut self,
        a: Value,
        b: Value,
        trans_b: bool,
        bias: Option<Value>,
        pos: Pos,
    ) -> Result<Value, IntentError> {
        let (ta, tb) = (self.ty(&a).clone(), self.ty(&b).clone());
        if ta.rank() < 2 || tb.rank() < 2 {
            return Err(err(
                pos,
                ErrorKind::ShapeMismatch,
                format!("`@` needs operands with at least 2 dims, got {ta} and {tb}"),
            ));
        }
        if ta.dtype != tb.dtype {
            return Err(err(
                pos,
                ErrorKind::ShapeMismatch,
                format!("`@` mixes {ta} and {tb}"),
            ));
        }
        let (ra, rb) = (ta.rank(), tb.rank());
        let (m, k) = (ta.shape[ra - 2], ta.shape[ra - 1]);
        let (kb, n) = if trans_b {
            (tb.shape[rb - 1], tb.shape[rb - 2])
        } else {
            (tb.shape[rb - 2], tb.shape[rb - 1])
        };
        if k != kb {
            return Err(err(
                pos,
                ErrorKind::ShapeMismatch,
                format!(
                    "`@` needs matching inner dims, but {ta} has {k} columns and {tb} has {kb} rows"
                ),
            ));
        }
        let batch_a = Value {
            t: a.t,
            dims: a.dims[..ra - 2].to_vec(),
        };
        let batch_b = Value {
            t: b.t,
            dims: b.dims[..rb - 2].to_vec(),
        };
        let (mut shape, mut dims) = self.broadcast_batch(&ta, &tb, &batch_a, &batch_b, pos)?;
        let n_name = if trans_b {
            b.dims[rb - 2].clone()
        } else {
            b.dims[rb - 1].clone()
        };
        shape.extend([m, n]);
        dims.extend([a.dims[ra - 2].clone(), n_name]);
        let mut inputs = vec![a.t, b.t];
        if let Some(bias) = &bias {
            let tbias = self.ty(bias);
            if tbias.shape.last() != Some(&n) || tbias.rank() > 1 {
                return Err(err(
                    pos,
                    ErrorKind::ShapeMismatch,
                    format!("the bias of `linear` must be [{n}], got {tbias}"),
                ));
            }
            inputs.push(bias.t);
        }
        Ok(self.add(
            Op::MatMul(MatMul {
                trans_a: false,
                trans_b,
                bias: bias.is_some(),
            }),
            &inputs,
            TensorType::new(shape, ta.dtype),
            dims,
        ))
    }

    fn broadcast_batch(
        &self,
        ta: &TensorType,
        tb: &TensorType,
        a: &Value,
        b: &Value,
        pos: Pos,
    ) -> Result<(Vec<u64>, Vec<Option<String>>), IntentError> {
        let sa = &ta.shape[..ta.rank() - 2];
        let sb = &tb.shape[..tb.rank() - 2];
        let rank = sa.len().max(sb.len());
        let mut shape = Vec::new();
        let mut dims = Vec::new();
        for i in 0..rank {
            let x = (i + sa.len())
                .checked_sub(rank)
                .map(|j| (sa[j], a.dims[j].clone()));
            let y = (i + sb.len())
                .checked_sub(rank)
                .map(|j| (sb[j], b.dims[j].clone()));
            let (s, n) = match (x, y) {
                (Some(p), None) | (None, Some(p)) => p,
                (Some((p, np)), Some((q, nq))) if p == q || p == 1 || q == 1 => {
                    (p.max(q), np.or(nq))
                }
                _ => {
                    return Err(err(
                        pos,
                        ErrorKind::ShapeMismatch,
                        format!("`@` cannot broadcast the batch dims of {ta} and {tb}"),
                    ));
                }
            };
            shape.push(s);
            dims.push(n);
        }
        Ok((shape, dims))
    }

    /// Resolves `dim=` arguments: a dim name, an index (negative from the
    /// end), or a list of them.
    fn dim_list(&self, v: &Value, e: &Expr) -> Result<Vec<usize>, IntentError> {
        let rank = self.ty(v).rank();
        let one = |e: &Expr| -> Result<usize, IntentError> {
            let idx = match e {
                Expr::Var(name, pos) => {
                    return v
                        .dims
                        .iter()
                        .position(|d| d.as_deref() == Some(name))
                        .ok_or_else(|| {
                            let known: Vec<&str> = v.dims.iter().flatten().map(String::as_str).collect();
                            err(
                                *pos,
                                ErrorKind::UnknownDim,
                                if known.is_empty() {
                                    format!("`{name}` is not a dim of this operand (its dims have no names: use an index)")
                                } else {
                                    format!("`{name}` is not a dim of this operand (its dims: {})", known.join(", "))
                                },
                            )
                        });
                }
                Expr::Num(n, _) if n.fract() == 0.0 => *n as i64,
                Expr::Neg(inner, _) => match inner.as_ref() {
                    Expr::Num(n, _) if n.fract() == 0.0 => -(*n as i64),
                    _ => {
                        return Err(err(
                            e.pos(),
                            ErrorKind::BadArgument,
                            "a dim is a name or an integer",
                        ));
                    }
                },
                _ => {
                    return Err(err(
                        e.pos(),
                        ErrorKind::BadArgument,
                        "a dim is a name or an integer",
                    ));
                }
            };
            let r = rank as i64;
            let n = if idx < 0 { idx + r } else { idx };
            if (0..r).contains(&n) {
                Ok(n as usize)
            } else {
                Err(err(
                    e.pos(),
                    ErrorKind::UnknownDim,
                    format!("dim {idx} is out of range for {}", self.ty(v)),
                ))
            }
        };
        let mut dims = match e {
            Expr::List(items, _) => items.iter().map(one).collect::<Result<Vec<_>, _>>()?,
            other => vec![one(other)?],
        };
        dims.sort_unstable();
        dims.dedup();
        Ok(dims)
    }

    fn call(&mut self, name: &str, args: &[Arg], pos: Pos) -> Result<Operand, IntentError> {
        let sig = signature(name).ok_or_else(|| {
            err(
                pos,
                ErrorKind::UnknownFunction,
                format!("unknown function `{name}`; known: {}", FUNCTIONS.join(", ")),
            )
        })?;
        let mut positional = Vec::new();
        let mut named: BTreeMap<&str, &Arg> = BTreeMap::new();
        for a in args {
            match &a.name {
                None if !named.is_empty() => {
                    return Err(err(
                        a.pos,
                        ErrorKind::Syntax,
                        "positional arguments must come before named ones",
                    ));
                }
                None => positional.push(&a.value),
                Some(n) => {
                    if !sig.params.contains(&n.as_str()) {
                        return Err(err(
                            a.pos,
                            ErrorKind::BadArgument,
                            format!(
                                "`{name}` takes no argument `{n}`{}",
                                if sig.params.is_empty() {
                                    String::new()
                                } else {
                                    format!(" (it takes: {})", sig.params.join(", "))
                                }
                            ),
                        ));
                    }
                    named.insert(n.as_str(), a);
                }
            }
        }
        if positional.len() < sig.min_tensors || positional.len() > sig.max_tensors {
            let want = if sig.min_tensors == sig.max_tensors {
                sig.min_tensors.to_string()
            } else {
                format!("{} to {}", sig.min_tensors, sig.max_tensors)
            };
            return Err(err(
                pos,
                ErrorKind::BadArgument,
                format!(
                    "`{name}` takes {want} tensor argument(s), got {}",
                    positional.len()
                ),
            ));
        }
        let mut tensors = Vec::new();
        for p in &positional {
            tensors.push(self.tensor(p)?);
        }
        let number = |key: &str, default: Option<f64>| -> Result<Option<f64>, IntentError> {
            match named.get(key) {
                None => Ok(default),
                Some(a) => match &a.value {
                    Expr::Num(n, _) => Ok(Some(*n)),
                    Expr::Neg(inner, _) => match inner.as_ref() {
                        Expr::Num(n, _) => Ok(Some(-n)),
                        _ => Err(err(
                            a.pos,
                            ErrorKind::BadArgument,
                            format!("`{key}` must be a number"),
                        )),
                    },
                    _ => Err(err(
                        a.pos,
                        ErrorKind::BadArgument,
                        format!("`{key}` must be a number"),
                    )),
                },
            }
        };
        let flag = |key: &str| -> Result<bool, IntentError> {
            match named.get(key).map(|a| &a.value) {
                None => Ok(false),
                Some(Expr::Var(v, _)) if v == "true" || v == "True" => Ok(true),
                Some(Expr::Var(v, _)) if v == "false" || v == "False" => Ok(false),
                Some(other) => Err(err(
                    other.pos(),
                    ErrorKind::BadArgument,
                    format!("`{key}` must be true or false"),
                )),
            }
        };
        let x = tensors[0].clone();
        let ty = self.ty(&x).clone();
        let same = |s: &mut Self, op: Op, x: &Value| {
            let t = s.ty(x).clone();
            Operand::Tensor(s.add(op, &[x.t], t, x.dims.clone()))
        };
        let dims_arg =
            |s: &Self, x: &Value, required: bool| -> Result<Option<Vec<usize>>, IntentError> {
                match named.get("dim") {
                    Some(a) => Ok(Some(s.dim_list(x, &a.value)?)),
                    None if required => Err(err(
                        pos,
                        ErrorKind::BadArgument,
                        format!("`{name}` needs `dim=`"),
                    )),
                    None => Ok(None),
                }
            };
        let single_dim = |s: &Self, x: &Value| -> Result<usize, IntentError> {
            let d = dims_arg(s, x, true)?.unwrap_or_default();
            match d.as_slice() {
                [one] => Ok(*one),
                _ => Err(err(
                    pos,
                    ErrorKind::BadArgument,
                    format!("`{name}` takes one dim"),
                )),
            }
        };
        let op = match sig.kind {
            Kind::Unary(u) => {
                let u = match u {
                    UnaryOp::LeakyRelu { .. } => UnaryOp::LeakyRelu {
                        slope: number("slope", Some(0.01))?.unwrap_or(0.01),
                    },
                    UnaryOp::Gelu { .. } => UnaryOp::Gelu {
                        tanh: name == "gelu_tanh" || flag("tanh")?,
                    },
                    UnaryOp::Hardtanh { .. } => UnaryOp::Hardtanh {
                        min: number("min", Some(-1.0))?.unwrap_or(-1.0),
                        max: number("max", Some(1.0))?.unwrap_or(1.0),
                    },
                    UnaryOp::Softplus { .. } => UnaryOp::Softplus {
                        beta: number("beta", Some(1.0))?.unwrap_or(1.0),
                        threshold: number("threshold", Some(20.0))?.unwrap_or(20.0),
                    },
                    UnaryOp::Elu { .. } => UnaryOp::Elu {
                        alpha: number("alpha", Some(1.0))?.unwrap_or(1.0),
                    },
                    UnaryOp::Clamp { .. } => {
                        let (min, max) = (number("min", None)?, number("max", None)?);
                        if min.is_none() && max.is_none() {
                            return Err(err(
                                pos,
                                ErrorKind::BadArgument,
                                "`clamp` needs `min=` or `max=`",
                            ));
                        }
                        UnaryOp::Clamp { min, max }
                    }
                    other => other,
                };
                return Ok(same(self, Op::Unary(u), &x));
            }
            Kind::Binary(b) => {
                return self.binary(
                    b,
                    Operand::Tensor(x),
                    Operand::Tensor(tensors[1].clone()),
                    pos,
                );
            }
            Kind::MatMul => {
                return Ok(Operand::Tensor(self.matmul(
                    x,
                    tensors[1].clone(),
                    false,
                    None,
                    pos,
                )?));
            }
            Kind::Linear => {
                let bias = tensors.get(2).cloned();
                return Ok(Operand::Tensor(self.matmul(
                    x,
                    tensors[1].clone(),
                    true,
                    bias,
                    pos,
                )?));
            }
            Kind::Reduce(r) => {
                let dims = dims_arg(self, &x, false)?.unwrap_or_else(|| (0..ty.rank()).collect());
                let keepdim = flag("keepdim")?;
                let r = match r {
                    ReduceOp::Norm { .. } => ReduceOp::Norm {
                        p: number("p", Some(2.0))?.unwrap_or(2.0),
                    },
                    other => other,
                };
                let dtype = if matches!(r, ReduceOp::ArgMax | ReduceOp::ArgMin) {
                    DType::I64
                } else {
                    ty.dtype
                };
                let mut shape = Vec::new();
                let mut names = Vec::new();
                for (i, (&s, n)) in ty.shape.iter().zip(&x.dims).enumerate() {
                    if !dims.contains(&i) {
                        shape.push(s);
                        names.push(n.clone());
                    } else if keepdim {
                        shape.push(1);
                        names.push(None);
                    }
                }
                let op = Op::Reduce(Reduce {
                    op: r,
                    dims,
                    keepdim,
                });
                return Ok(Operand::Tensor(self.add(
                    op,
                    &[x.t],
                    TensorType::new(shape, dtype),
                    names,
                )));
            }
            Kind::Softmax { log } => Op::Softmax {
                dim: single_dim(self, &x)?,
                log,
            },
            Kind::Scan { prod } => Op::Scan(Scan {
                prod,
                dim: single_dim(self, &x)?,
                reverse: flag("reverse")?,
                exclusive: flag("exclusive")?,
            }),
            // `F.normalize`: x / max(‖x‖_p, ε) along one dim.
            Kind::Normalize => Op::Norm(Norm {
                kind: NormKind::Lp {
                    p: number("p", Some(2.0))?.unwrap_or(2.0),
                    dim: single_dim(self, &x)?,
                },
                eps: number("eps", Some(1e-12))?.unwrap_or(1e-12),
                affine: false,
                bias: false,
                batch_stats: true,
            }),
            Kind::Norm { rms } => {
                let dims = dims_arg(self, &x, false)?.unwrap_or_else(|| vec![ty.rank() - 1]);
                let trailing = dims
                    .iter()
                    .enumerate()
                    .all(|(i, &d)| d == ty.rank() - dims.len() + i);
                if !trailing {
                    return Err(err(
                        pos,
                        ErrorKind::BadArgument,
                        format!("`{name}` normalizes trailing dims; permute the operand first"),
                    ));
                }
                let n = dims.len();
                let kind = if rms {
                    NormKind::Rms { dims: n }
                } else {
                    NormKind::Layer { dims: n }
                };
                let norm = Op::Norm(Norm {
                    kind,
                    eps: number("eps", Some(1e-5))?.unwrap_or(1e-5),
                    affine: tensors.len() > 1,
                    bias: tensors.len() > 2,
                    batch_stats: true,
                });
                let want: Vec<u64> = ty.shape[ty.rank() - n..].to_vec();
                for p in &tensors[1..] {
                    if self.ty(p).shape != want {
                        return Err(err(
                            pos,
                            ErrorKind::ShapeMismatch,
                            format!(
                                "the scale and shift of `{name}` must be {}, got {}",
                                fmt_shape(&want),
                                self.ty(p)
                            ),
                        ));
                    }
                }
                let inputs: Vec<TensorRef> = tensors.iter().map(|t| t.t).collect();
                return Ok(Operand::Tensor(self.add(norm, &inputs, ty, x.dims.clone())));
            }
            Kind::Transpose => {
                let (Some(a), Some(b)) = (named.get("dim0"), named.get("dim1")) else {
                    return Err(err(
                        pos,
                        ErrorKind::BadArgument,
                        "`transpose` needs `dim0=` and `dim1=`",
                    ));
                };
                let d0 = self.dim_list(&x, &a.value)?;
                let d1 = self.dim_list(&x, &b.value)?;
                return Ok(Operand::Tensor(self.swap(x, d0[0], d1[0])));
            }
        };
        Ok(same(self, op, &x))
    }
}

fn fmt_shape(s: &[u64]) -> String {
    format!(
        "[{}]",
        s.iter().map(u64::to_string).collect::<Vec<_>>().join("x")
    )
}

#[derive(Clone)]
enum Kind {
    Unary(UnaryOp),
    Binary(BinaryOp),
    MatMul,
    Linear,
    Reduce(ReduceOp),
    Softmax { log: bool },
    Scan { prod: bool },
    Norm { rms: bool },
    Normalize,
    Transpose,
}

struct Signature {
    kind: Kind,
    min_tensors: usize,
    max_tensors: usize,
    params: &'static [&'static str],
}

/// Every function the language knows, for error messages.
pub const FUNCTIONS: &[&str] = &[
    "relu",
    "relu6",
    "leaky_relu",
    "gelu",
    "gelu_tanh",
    "sigmoid",
    "tanh",
    "silu",
    "swish",
    "mish",
    "hardswish",
    "hardsigmoid",
    "hardtanh",
    "softplus",
    "softsign",
    "elu",
    "selu",
    "clamp",
    "exp",
    "log",
    "abs",
    "neg",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "erf",
    "sin",
    "cos",
    "maximum",
    "minimum",
    "matmul",
    "linear",
    "sum",
    "mean",
    "max",
    "min",
    "prod",
    "argmax",
    "argmin",
    "logsumexp",
    "norm",
    "softmax",
    "log_softmax",
    "cumsum",
    "cumprod",
    "layer_norm",
    "rms_norm",
    "normalize",
    "transpose",
];

fn signature(name: &str) -> Option<Signature> {
    use UnaryOp as U;
    let unary = |u: UnaryOp, params: &'static [&'static str]| Signature {
        kind: Kind::Unary(u),
        min_tensors: 1,
        max_tensors: 1,
        params,
    };
    let reduce = |r: ReduceOp, params: &'static [&'static str]| Signature {
        kind: Kind::Reduce(r),
        min_tensors: 1,
        max_tensors: 1,
        params,
    };
    Some(match name {
        "relu" => unary(U::Relu, &[]),
        "relu6" => unary(U::Relu6, &[]),
        "leaky_relu" => unary(U::LeakyRelu { slope: 0.01 }, &["slope"]),
        "gelu" => unary(U::Gelu { tanh: false }, &["tanh"]),
        "gelu_tanh" => unary(U::Gelu { tanh: true }, &[]),
        "sigmoid" => unary(U::Sigmoid, &[]),
        "tanh" => unary(U::Tanh, &[]),
        "silu" | "swish" => unary(U::Silu, &[]),
        "mish" => unary(U::Mish, &[]),
        "hardswish" => unary(U::Hardswish, &[]),
        "hardsigmoid" => unary(U::Hardsigmoid, &[]),
        "hardtanh" => unary(
            U::Hardtanh {
                min: -1.0,
                max: 1.0,
            },
            &["min", "max"],
        ),
        "softplus" => unary(
            U::Softplus {
                beta: 1.0,
                threshold: 20.0,
            },
            &["beta", "threshold"],
        ),
        "softsign" => unary(U::Softsign, &[]),
        "elu" => unary(U::Elu { alpha: 1.0 }, &["alpha"]),
        "selu" => unary(U::Selu, &[]),
        "clamp" => unary(
            U::Clamp {
                min: None,
                max: None,
            },
            &["min", "max"],
        ),
        "exp" => unary(U::Exp, &[]),
        "log" => unary(U::Log, &[]),
        "abs" => unary(U::Abs, &[]),
        "neg" => unary(U::Neg, &[]),
        "sqrt" => unary(U::Sqrt, &[]),
        "rsqrt" => unary(U::Rsqrt, &[]),
        "reciprocal" => unary(U::Reciprocal, &[]),
        "erf" => unary(U::Erf, &[]),
        "sin" => unary(U::Sin, &[]),
        "cos" => unary(U::Cos, &[]),
        "maximum" | "minimum" => Signature {
            kind: Kind::Binary(if name == "maximum" {
                BinaryOp::Maximum
            } else {
                BinaryOp::Minimum
            }),
            min_tensors: 2,
            max_tensors: 2,
            params: &[],
        },
        "matmul" => Signature {
            kind: Kind::MatMul,
            min_tensors: 2,
            max_tensors: 2,
            params: &[],
        },
        "linear" => Signature {
            kind: Kind::Linear,
            min_tensors: 2,
            max_tensors: 3,
            params: &[],
        },
        "sum" => reduce(ReduceOp::Sum, &["dim", "keepdim"]),
        "mean" => reduce(ReduceOp::Mean, &["dim", "keepdim"]),
        "max" => reduce(ReduceOp::Max { indices: false }, &["dim", "keepdim"]),
        "min" => reduce(ReduceOp::Min { indices: false }, &["dim", "keepdim"]),
        "prod" => reduce(ReduceOp::Prod, &["dim", "keepdim"]),
        "argmax" => reduce(ReduceOp::ArgMax, &["dim", "keepdim"]),
        "argmin" => reduce(ReduceOp::ArgMin, &["dim", "keepdim"]),
        "logsumexp" => reduce(ReduceOp::LogSumExp, &["dim", "keepdim"]),
        "norm" => reduce(ReduceOp::Norm { p: 2.0 }, &["dim", "keepdim", "p"]),
        "softmax" | "log_softmax" => Signature {
            kind: Kind::Softmax {
                log: name == "log_softmax",
            },
            min_tensors: 1,
            max_tensors: 1,
            params: &["dim"],
        },
        "cumsum" | "cumprod" => Signature {
            kind: Kind::Scan {
                prod: name == "cumprod",
            },
            min_tensors: 1,
            max_tensors: 1,
            params: &["dim", "reverse", "exclusive"],
        },
        "layer_norm" | "rms_norm" => Signature {
            kind: Kind::Norm {
                rms: name == "rms_norm",
            },
            min_tensors: 1,
            max_tensors: if name == "rms_norm" { 2 } else { 3 },
            params: &["dim", "eps"],
        },
        "normalize" => Signature {
            kind: Kind::Normalize,
            min_tensors: 1,
            max_tensors: 1,
            params: &["dim", "p", "eps"],
        },
        "transpose" => Signature {
            kind: Kind::Transpose,
            min_tensors: 1,
            max_tensors: 1,
            params: &["dim0", "dim1"],
        },
        _ => return None,
    })
}
