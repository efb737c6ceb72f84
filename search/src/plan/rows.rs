//! The rows of a comparison of planners: each problem, its recorded best,
//! and what each planner reached on it.

/// One problem of the comparison: its recorded tree's best and what each
/// planner reached on it (the random planner: the geometric mean over its
/// seeds, and the mean evaluations). Speedups below 1 count as 1, as in
/// the table: eager PyTorch is always there to fall back on.
#[derive(serde::Serialize)]
pub(crate) struct ProblemRow {
    pub(crate) problem: String,
    /// The live pass (its folder) this row comes from, when passes are
    /// pooled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) pass: Option<String>,
    pub(crate) programs: usize,
    pub(crate) exhaustive: f64,
    /// Replay with moves left out (`--without`): the best of the recorded
    /// programs the other moves reach.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) exhaustive_without: Option<f64>,
    pub(crate) planners: std::collections::BTreeMap<String, PlannerResult>,
}

#[derive(serde::Serialize)]
pub(crate) struct PlannerResult {
    pub(crate) best: f64,
    pub(crate) evaluations: f64,
    /// Replay: the steps of the planner's first episode (random: seed 0),
    /// each `move -> program: outcome`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) path: Vec<String>,
    /// Replay, the trained planner: for each step of `path`, what it
    /// weighed ([`super::choice::Considered::text`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) considered: Vec<String>,
}
