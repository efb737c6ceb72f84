//! Why an evaluator gave no outcome at all.

use crate::nvrtc::NvrtcError;
use crate::worker::WorkerError;

/// Why an evaluator gave no outcome at all (a candidate's own failures are
/// outcomes, not errors).
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The worker could not be used.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// NVRTC could not be used.
    #[error(transparent)]
    Nvrtc(#[from] NvrtcError),
    /// This evaluator cannot judge this kind of candidate or problem.
    #[error("{0}")]
    Unsupported(String),
}
