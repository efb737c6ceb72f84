//! Norms over rows short enough to be read once into registers.

use std::fmt::Write as _;

use crate::program::Launch;
use crate::template::WAVES;

use super::stat::Stat;
use super::{block_reduce, lanes_reduce};

/// The threads per row and the elements each holds in registers when a
/// norm's rows of `k` are short enough to be read once and kept: at most
/// 256 elements take 8 each (a warp or part of one per row: every lane's
/// 8 loads fill 32-byte sectors with its neighbours'), at most 16384 take
/// up to 16 each (a block of 64 to 1024 threads per row); `None` for
/// longer rows.
pub(super) fn register_row(k: u64) -> Option<(u64, u64)> {
    let threads = match k {
        0 => return None,
        1..=256 => k.div_ceil(8).next_power_of_two(),
        257..=16384 => k.div_ceil(16).next_power_of_two().max(32),
        _ => return None,
    };
    Some((threads, k.div_ceil(threads)))
}

/// A norm whose rows are read once into registers ([`register_row`]):
/// `threads` neighbouring threads per row (lanes of a warp, combining by
/// shuffles, or a whole block, through shared memory), thread `t` holding
/// elements `t + j * threads`. The mean, then the sum of squared
/// deviations from it, come from the registers; then the row is written.
/// One pass over memory to read, one to write.
pub(super) struct RegisterNorm {
    pub(super) rows: u64,
    pub(super) k: u64,
    pub(super) threads: u64,
    pub(super) per: u64,
    pub(super) stat: Stat,
    /// ε, as a float literal.
    pub(super) eps: String,
}

impl RegisterNorm {
    /// The kernel (blocks of `block` threads when a row takes a warp or
    /// less, else a block per row) and its launch.
    pub(super) fn source(
        &self,
        name: &str,
        what: &str,
        params: &[String],
        block: u32,
        scale: &str,
        shift: &str,
    ) -> (String, Launch) {
        let RegisterNorm {
            rows,
            k,
            threads,
            per,
            ..
        } = *self;
        let block = if threads > 32 { threads as u32 } else { block };
        // Rows a block and a warp take at a time.
        let per_block = u64::from(block) / threads;
        let per_warp = if threads > 32 { 0 } else { 32 / threads };
        let mut src = String::new();
        let _ = writeln!(
            src,
            "// {name}: {what}, {threads} thread(s) per row holding {per} elements each in registers"
        );
        let _ = writeln!(
            src,
            "extern \"C\" __global__ void __launch_bounds__({block}) {name}({}) {{",
            params.join(", ")
        );
        if threads > 32 {
            src.push_str("    __shared__ float shared[32];\n");
        }
        // A warp's rows go round the loop together, so that every lane
        // reaches each shuffle; a row past the end reads and writes
        // nothing.
        let _ = writeln!(
            src,
            "    const int t = threadIdx.x % {threads};\n    const long long mine = threadIdx.x / {threads};\n    const long long warp_first = (threadIdx.x / 32) * {per_warp}LL;"
        );
        let _ = writeln!(
            src,
            "    for (long long first = blockIdx.x * {per_block}LL; first < rows; first += (long long)gridDim.x * {per_block}LL) {{"
        );
        src.push_str("        if (first + warp_first >= rows) break;\n");
        src.push_str("        const long long r = first + mine;\n        const bool live = r < rows;\n        const long long xr = live ? r * K : 0;\n");
        let _ = writeln!(src, "        float v_[{per}];");
        let each = format!(
            "        #pragma unroll\n        for (int j = 0; j < {per}; ++j) {{ const long long k = t + (long long)j * {threads};"
        );
        let reduce = |src: &mut String, var: &str| {
            if threads > 32 {
                block_reduce(src, var, "a + b", "0.0f");
            } else if threads > 1 {
                lanes_reduce(src, var, "a + b", threads);
            }
        };
        if !self.stat.centred() {
            let _ = writeln!(
                src,
                "{each} v_[j] = live && k < K ? LOAD_X(xr + k) : 0.0f; }}"
            );
            src.push_str("        const float mean = 0.0f;\n");
        } else {
            src.push_str("        float total = 0.0f;\n");
            let _ = writeln!(
                src,
                "{each} v_[j] = live && k < K ? LOAD_X(xr + k) : 0.0f; total += v_[j]; }}"
            );
            reduce(&mut src, "total");
            src.push_str("        const float mean = total / (float)K;\n");
        }
        src.push_str("        float squares = 0.0f;\n");
        let _ = writeln!(
            src,
            "{each} if (k < K) {{ const float d = v_[j] - mean; squares += d * d; }} }}"
        );
        reduce(&mut src, "squares");
        let _ = writeln!(
            src,
            "        const float rstd = {};",
            self.stat.rstd("squares", "K", &self.eps)
        );
        let _ = writeln!(
            src,
            "{each} if (live && k < K) STORE_YX(xr + k, (v_[j] - mean) * rstd{scale}{shift}, v_[j]); }}\n    }}\n}}"
        );
        let launch = Launch {
            shared: 0,
            grid: rows.div_ceil(per_block).clamp(1, WAVES * 2) as u32,
            block,
            sizes: vec![rows as i64, k as i64],
        };
        (src, launch)
    }
}
