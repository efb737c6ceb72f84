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
    /// The cluster's judges could not be reached or were lost.
    #[error("{0}")]
    Cluster(String),
    /// This evaluator cannot judge this kind of candidate or problem.
    #[error("{0}")]
    Unsupported(String),
}
