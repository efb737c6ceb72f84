//! The micro coder: turns one macro action on one region of the op graph
//! into a small fragment of CUDA or Triton, compiled alone and rolled back on
//! failure.
//!
//! Empty for now: the `MicroCoder` interface, the template coder and the
//! ModelNew export land with the template-coder issue; the LLM coder after
//! it. The crate exists so that the workspace has its final shape and the
//! dependency direction (coder → actions, env) is fixed from the start.
