//! One step at a time: each fragment is compiled on its own before it joins
//! the program; a fragment that does not compile, or a program the
//! evaluator finds wrong, is rolled back to the last good program, and the
//! failure is kept for the critique and the trajectory.

use mtmc_actions::graph::OpGraph;
use mtmc_env::nvrtc::{self, Arch, CompileUnit};
use mtmc_env::triton::{self, TritonUnit};

use crate::MicroCoder;
use crate::action::Action;
use crate::program::{Fragment, Lang, Program};
pub use crate::{Failure, Stage};

/// A coder working on one graph, with the last good program.
pub struct Session<'g, C> {
    g: &'g OpGraph,
    coder: C,
    arch: Arch,
    /// The Python that compiles Triton fragments.
    python: std::ffi::OsString,
    good: Program,
    /// Every rolled-back step, in order.
    pub failures: Vec<Failure>,
}

impl<'g, C: MicroCoder> Session<'g, C> {
    /// A session from the empty program.
    pub fn new(g: &'g OpGraph, coder: C, arch: Arch) -> Session<'g, C> {
        Session {
            g,
            coder,
            arch,
            python: mtmc_env::python::interpreter(),
            good: Program::default(),
            failures: Vec::new(),
        }
    }

    /// Triton fragments compiled by `python` instead of the default
    /// interpreter (`$MTMC_PYTHON`, else `python3`).
    pub fn with_python(mut self, python: impl Into<std::ffi::OsString>) -> Self {
        self.python = python.into();
        self
    }

    /// The coder.
    pub fn coder(&self) -> &C {
        &self.coder
    }

    /// The last good program.
    pub fn good(&self) -> &Program {
        &self.good
    }

    /// Writes and compiles the fragment for `action`. On success, the
    /// program with it (to be judged, then accepted or rejected); on
    /// failure, the recorded failure, with the good program unchanged.
    pub fn propose(&mut self, action: &Action) -> Result<Program, Failure> {
        let fragment = match self.coder.realize(&self.good, self.g, action) {
            Ok(f) => f,
            Err(r) => return Err(self.fail(action, Stage::Refused, None, r.0)),
        };
        let compiled = match fragment.lang {
            Lang::Cuda => {
                let unit = CompileUnit {
                    name: format!("{}.cu", fragment.name),
                    source: fragment.source.clone(),
                };
                nvrtc::compile(&unit, self.arch).map_err(|e| e.to_string())
            }
            Lang::Triton => {
                triton::compile_with(&self.python, &triton_unit(self.g, &fragment), self.arch)
                    .map_err(|e| e.to_string())
            }
        };
        match compiled {
            Ok(report) if report.ok => Ok(self.good.with(fragment)),
            Ok(report) => Err(self.fail(action, Stage::Compile, Some(fragment.source), report.log)),
            Err(e) => Err(self.fail(action, Stage::Compile, Some(fragment.source), e)),
        }
    }

    /// Makes `program` the last good one (it was judged correct).
    pub fn accept(&mut self, program: Program) {
        self.good = program;
    }

    /// Rolls back a proposed program the evaluator found wrong.
    pub fn reject(&mut self, action: &Action, program: &Program, why: impl Into<String>) {
        let fragment = program
            .fragments
            .iter()
            .find(|f| f.action == *action)
            .map(|f| f.source.clone());
        self.fail(action, Stage::Outcome, fragment, why.into());
    }

    fn fail(
        &mut self,
        action: &Action,
        stage: Stage,
        fragment: Option<String>,
        log: String,
    ) -> Failure {
        let f = Failure {
            action: action.clone(),
            stage,
            fragment,
            log,
        };
        self.failures.push(f.clone());
        self.coder.observe(&crate::Note::Failed(&f));
        f
    }
}

/// The Triton type of a pointer to elements of `dtype`.
pub fn triton_pointer(dtype: mtmc_actions::DType) -> &'static str {
    use mtmc_actions::DType;
    match dtype {
        DType::F32 => "*fp32",
        DType::F16 => "*fp16",
        DType::BF16 => "*bf16",
        DType::F64 => "*fp64",
        DType::I64 => "*i64",
        DType::I32 => "*i32",
        DType::I16 => "*i16",
        DType::I8 => "*i8",
        DType::U8 => "*u8",
        DType::Bool => "*i1",
    }
}

/// A Triton fragment as a unit to compile alone: its pointers typed by the
/// tensors they point to, its sizes as Triton types them at launch (`i32`
/// when the value fits).
pub fn triton_unit(g: &OpGraph, f: &Fragment) -> TritonUnit {
    let mut signature: Vec<String> = f
        .inputs
        .iter()
        .chain(&f.outputs)
        .map(|&t| triton_pointer(g.tensor(t).dtype).to_string())
        .collect();
    signature.extend(f.launch.sizes.iter().map(|&n| {
        if i32::try_from(n).is_ok() {
            "i32".to_string()
        } else {
            "i64".to_string()
        }
    }));
    TritonUnit {
        kernel: f.name.clone(),
        source: f.source.clone(),
        signature,
        num_warps: f.launch.warps(),
    }
}
