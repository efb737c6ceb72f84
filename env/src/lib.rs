//! The machine side of mtmc: what is installed, and compiling, running,
//! checking and timing candidates.
//!
//! - [`python`]: finding the Python interpreter that has torch;
//! - [`evaluator`]: the `Evaluator` interface and the worker and
//!   compile-only evaluators; [`error`]: why one gave no outcome;
//!   [`outcome`]: what an evaluation found;
//! - [`mod@bench`]: the candidates `mtmc bench-env` times;
//! - [`pool`]: one worker per GPU, candidates dispatched concurrently;
//! - [`cluster`]: judging on the workers of a Dask cluster instead;
//! - [`native`]: CUDA programs with a launch plan, run through cudarc in a
//!   child process and checked against the f64 reference;
//! - [`mod@reference`]: the f64 CPU reference of any output element;
//! - [`nvrtc`]: compiling CUDA C++ with NVRTC (no GPU needed): logs,
//!   diagnostics, per-kernel resources, occupancy;
//! - [`probe`]: what `mtmc doctor` reports (GPU and driver, NVRTC, Python
//!   packages), each with the fix when it is missing;
//! - [`worker`]: the persistent Python evaluation worker and its supervision;
//! - [`tracer`]: running the graph tracer (`python/trace_graph.py`, shipped
//!   inside the binary) on KernelBench problems.
//!
//! Architecture invariant: nothing here panics when a library, a GPU or an
//! interpreter is missing; every probe returns what it found or why not.

pub mod bench;
pub mod cluster;
pub mod error;
pub mod evaluator;
pub mod native;
pub mod nvrtc;
pub mod outcome;
pub mod pool;
pub mod probe;
pub mod python;
pub mod reference;
pub mod tracer;
pub mod triton;
pub mod worker;
