//! The candidates `mtmc bench-env` times: for each benchmark problem, the
//! same kernel on the fast path (NVRTC through cupy, or Triton) and on the
//! slow path (torch's load_inline, as KernelBench builds `ModelNew` files).
//! The files live in `env/bench/`.

/// How a benchmark candidate's kernels are built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// NVRTC through cupy: the inner loop's path.
    Nvrtc,
    /// Triton's JIT.
    Triton,
    /// torch.utils.cpp_extension.load_inline (nvcc + a C++ extension).
    LoadInline,
}

impl Path {
    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Path::Nvrtc => "nvrtc (cupy)",
            Path::Triton => "triton",
            Path::LoadInline => "load_inline",
        }
    }
}

/// One benchmark candidate.
#[derive(Clone, Copy, Debug)]
pub struct BenchCandidate {
    /// The problem it solves (`L1/19`).
    pub problem: &'static str,
    /// How its kernels are built.
    pub path: Path,
    /// File name under `env/bench/`.
    pub file: &'static str,
    /// Its source; `MTMC_NONCE` marks the comment that makes copies differ.
    pub code: &'static str,
}

/// Every benchmark candidate.
pub const CANDIDATES: &[BenchCandidate] = &[
    BenchCandidate {
        problem: "L1/19",
        path: Path::Nvrtc,
        file: "l1_19_relu_cupy.py",
        code: include_str!("../bench/l1_19_relu_cupy.py"),
    },
    BenchCandidate {
        problem: "L1/19",
        path: Path::Triton,
        file: "l1_19_relu_triton.py",
        code: include_str!("../bench/l1_19_relu_triton.py"),
    },
    BenchCandidate {
        problem: "L1/19",
        path: Path::LoadInline,
        file: "l1_19_relu_load_inline.py",
        code: include_str!("../bench/l1_19_relu_load_inline.py"),
    },
    BenchCandidate {
        problem: "L2/12",
        path: Path::Nvrtc,
        file: "l2_12_gemm_epilogue_cupy.py",
        code: include_str!("../bench/l2_12_gemm_epilogue_cupy.py"),
    },
    BenchCandidate {
        problem: "L2/12",
        path: Path::LoadInline,
        file: "l2_12_gemm_epilogue_load_inline.py",
        code: include_str!("../bench/l2_12_gemm_epilogue_load_inline.py"),
    },
];

/// The candidate's source with its nonce comment set to `tag`, so that no
/// compile cache (cupy's, Triton's, torch's extensions) can serve it.
pub fn with_nonce(c: &BenchCandidate, tag: &str) -> String {
    c.code.replace("MTMC_NONCE", tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_candidate_has_exactly_one_nonce() {
        for c in CANDIDATES {
            assert_eq!(c.code.matches("MTMC_NONCE").count(), 1, "{}", c.file);
            let a = with_nonce(c, "run 1 copy 1");
            assert!(a.contains("run 1 copy 1") && a != with_nonce(c, "run 1 copy 2"));
        }
    }
}
