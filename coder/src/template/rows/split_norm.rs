//! Norms over long or few groups: a team of blocks per group in one
//! launch, or a statistics launch and a normalizing one.

use std::fmt::Write as _;

use crate::action::Action;
use crate::program::{Fragment, Launch};
use crate::template::one_node;

use super::block_reduce;
use super::stat::Stat;

/// Elements each thread of a split norm's block holds in registers: a
/// block's chunk of a group is `SPLIT_PER_THREAD * block` elements.
const SPLIT_PER_THREAD: u64 = 16;

/// Blocks per group when a norm's groups are better cut into chunks, one
/// block each, where no team takes them ([`team_splits`]): few long
/// groups (too few to fill the GPU), or long groups, whose three passes a
/// block per group would read from memory; `None` when a block per group
/// does.
pub(super) fn norm_splits(groups: u64, count: u64, block: u32) -> Option<u64> {
    let chunk = SPLIT_PER_THREAD * u64::from(block);
    let long = count >= 8 * chunk;
    let few = groups < 2 * 132 && count >= 2 * chunk;
    (long || few).then(|| count.div_ceil(chunk))
}

/// A norm over long groups in two launches of `splits` blocks per group,
/// each block one chunk of `SPLIT_PER_THREAD * blockDim.x` elements held
/// in registers. The statistics launch reads the chunk once: its mean,
/// then the sum of squared deviations from it, go to module memory, and
/// the last block of the group to finish (an atomic count after a fence)
/// combines the group's partials by Chan's formula (the total of the
/// squared deviations is the chunks' own plus each chunk's count times its
/// mean's squared distance from the group's) into the group's mean and
/// 1/std. The normalizing launch reads the chunk again and writes it: three
/// passes over memory in all. Blocks go chunk by chunk across the groups,
/// the normalizing launch in reverse (see [`SplitNorm::fragment`]). [`SplitNorm::team_source`] does the same in one
/// launch, one read and one write, when the team of blocks is small enough.
pub(super) struct SplitNorm {
    /// What it computes, for the comment.
    pub(super) what: String,
    /// Groups, each normalized on its own.
    pub(super) groups: u64,
    /// Elements per group.
    pub(super) count: u64,
    /// Blocks per group.
    pub(super) splits: u64,
    /// Where element `k` of group `r` is (a C expression).
    pub(super) address: String,
    /// The length of the contiguous runs a group's elements lie in (the
    /// group's count when it is contiguous): runs of a multiple of 4 let
    /// a team move them 16 bytes at a time.
    pub(super) run: u64,
    /// One launch by a team of blocks per group ([`SplitNorm::team_source`]).
    pub(super) team: bool,
    /// The scale's and shift's index for element `k` of group `r`.
    pub(super) channel: String,
    /// What each group is divided by (RMS norm and length: no centering).
    pub(super) stat: Stat,
    /// ε, as a float literal.
    pub(super) eps: String,
    pub(super) affine: bool,
    pub(super) bias: bool,
}

/// The output and sizes of a split or team norm's kernels, after the
/// inputs.
const SPLIT_SIZES: [&str; 4] = [
    "float* __restrict__ y",
    "long long groups",
    "long long count",
    "long long splits",
];

impl SplitNorm {
    /// The scale and shift terms of element `k` of group `r`.
    fn affine_terms(&self) -> (String, String) {
        let channel = &self.channel;
        let scale = if self.affine {
            format!(" * w[{channel}]")
        } else {
            String::new()
        };
        let shift = if self.bias {
            format!(" + b[{channel}]")
        } else {
            String::new()
        };
        (scale, shift)
    }

    /// The norm in one launch: a team of `splits` blocks per group, each
    /// holding one chunk of the group in registers. A block takes a ticket
    /// as it starts (an atomic count), which names its group and chunk, so
    /// that the blocks of a team start in order and the team with the
    /// lowest tickets is always wholly resident: the kernel cannot wait on
    /// a block that has not started while holding the SM it needs (given a
    /// team no larger than the GPU holds at once, [`team_splits`]). Each
    /// block sums its chunk, then the squared deviations from the chunk's
    /// mean, from registers, and publishes both; its first thread counts
    /// the block in and waits until the whole team has; every block then
    /// combines the team's statistics by Chan's formula and writes its
    /// chunk from registers, normalized. The last block out of the group
    /// resets its counts, and the last block of the launch the tickets, so
    /// that the next launch starts from zero. One read, one write. With
    /// contiguous groups of a multiple of 4, 16 bytes a load and a store
    /// (element by element when a chain is fused in front, `LOAD_X`, or
    /// after, `STORE_Y`).
    fn team_source(&self, name: &str, block: u32, params: &str) -> (String, Launch) {
        let SplitNorm {
            groups,
            count,
            splits,
            ..
        } = *self;
        let vec4 = self.run.is_multiple_of(4);
        let per = team_per(block, vec4);
        let address = &self.address;
        let (scale, shift) = self.affine_terms();
        let mut src = String::new();
        let _ = writeln!(
            src,
            "// {name}: {} over {groups} group(s) of {count}, a team of {splits} blocks per group, {per} elements a thread in registers",
            self.what
        );
        let _ = writeln!(src, "__device__ float2 {name}_part[{}];", groups * splits);
        let _ = writeln!(src, "__device__ unsigned int {name}_in[{groups}];");
        let _ = writeln!(src, "__device__ unsigned int {name}_out[{groups}];");
        let _ = writeln!(src, "__device__ unsigned int {name}_ticket[2];");
        // More blocks an SM when no chain is fused in to need registers.
        let _ = writeln!(
            src,
            "#if defined(MTMC_PROLOGUE) || defined(MTMC_EPILOGUE)\n#define {name}_MIN {}\n#else\n#define {name}_MIN {}\n#endif",
            team_blocks_per_sm(block, 64),
            team_blocks_per_sm(block, 20)
        );
        let _ = writeln!(
            src,
            "extern \"C\" __global__ void __launch_bounds__({block}, {name}_MIN) {name}({params}) {{"
        );
        src.push_str("    __shared__ float shared[32];\n    __shared__ unsigned int ticket_;\n");
        let _ = writeln!(
            src,
            "    if (threadIdx.x == 0) ticket_ = atomicAdd(&{name}_ticket[0], 1u);"
        );
        src.push_str("    __syncthreads();\n");
        let _ = writeln!(
            src,
            "    const long long r = ticket_ / splits, part = ticket_ % splits;\n    const long long chunk = {per}LL * {block}LL;\n    const long long lo = part * chunk, hi = min(count, lo + chunk);"
        );
        // Element `k` of the group, value `val`, normalized.
        let _ = writeln!(
            src,
            "    float mean = 0.0f, rstd = 0.0f;\n    auto norm_ = [&](long long k, float val) {{ return (val - mean) * rstd{scale}{shift}; }};"
        );
        let (each, held) = if vec4 {
            let quads = per / 4;
            let _ = writeln!(src, "    float4 v_[{quads}];");
            (
                format!(
                    "    #pragma unroll\n    for (int i = 0; i < {quads}; ++i) {{ const long long k = lo + 4 * ((long long)i * {block} + threadIdx.x);"
                ),
                [".x", ".y", ".z", ".w"].as_slice(),
            )
        } else {
            let _ = writeln!(src, "    float v_[{per}];");
            (
                format!(
                    "    #pragma unroll\n    for (int i = 0; i < {per}; ++i) {{ const long long k = lo + (long long)i * {block} + threadIdx.x;"
                ),
                [""].as_slice(),
            )
        };
        // Read the chunk, and sum it (RMS norm: no centering, no sum).
        if vec4 {
            let _ = writeln!(
                src,
                "{each}\n        if (k < hi) {{\n            const long long at = {address};\n#ifdef MTMC_PROLOGUE\n            v_[i] = make_float4(LOAD_X(at), LOAD_X(at + 1), LOAD_X(at + 2), LOAD_X(at + 3));\n#else\n            v_[i] = __ldcs(reinterpret_cast<const float4*>(x + at));\n#endif\n        }} else v_[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);\n    }}"
            );
        } else {
            let _ = writeln!(src, "{each} v_[i] = k < hi ? LOAD_X({address}) : 0.0f; }}");
        }
        let terms = |f: &dyn Fn(&str) -> String| -> String {
            held.iter()
                .map(|c| f(&format!("v_[i]{c}")))
                .collect::<Vec<_>>()
                .join(" + ")
        };
        src.push_str("    const float n_ = (float)(hi - lo);\n    {\n");
        if !self.stat.centred() {
            src.push_str("        const float mine = 0.0f;\n");
        } else {
            src.push_str("        float total = 0.0f;\n");
            let _ = writeln!(src, "    {each} total += {}; }}", terms(&|v| v.to_string()));
            block_reduce(&mut src, "total", "a + b", "0.0f");
            src.push_str("        const float mine = total / n_;\n");
        }
        src.push_str("        float squares = 0.0f;\n");
        let _ = writeln!(
            src,
            "    {each} if (k < hi) squares += {}; }}",
            terms(&|v| format!("({v} - mine) * ({v} - mine)"))
        );
        block_reduce(&mut src, "squares", "a + b", "0.0f");
        // Publish, count in, wait for the team.
        let _ = writeln!(
            src,
            "        if (threadIdx.x == 0) {{\n            {name}_part[ticket_] = make_float2(mine, squares);\n            __threadfence();\n            atomicAdd(&{name}_in[r], 1u);\n            while (((volatile unsigned int*){name}_in)[r] < (unsigned int)splits) __nanosleep(64);\n            __threadfence();\n        }}\n        __syncthreads();\n    }}"
        );
        // The team's statistics, by every block.
        let _ = writeln!(
            src,
            "    {{\n        const volatile float2* stats = {name}_part + r * splits;"
        );
        chan_combine(
            &mut src,
            !self.stat.centred(),
            "",
            ("stats[p].x", "stats[p].y"),
        );
        let _ = writeln!(
            src,
            "        rstd = {};\n    }}",
            self.stat.rstd("m2", "count", &self.eps)
        );
        // Write the chunk from registers.
        if vec4 {
            let _ = writeln!(
                src,
                "{each}\n        if (k < hi) {{\n            const long long at = {address};\n            __stcs(reinterpret_cast<float4*>(y + at), make_float4(EPI_Y(at, norm_(k, v_[i].x), v_[i].x), EPI_Y(at + 1, norm_(k + 1, v_[i].y), v_[i].y), EPI_Y(at + 2, norm_(k + 2, v_[i].z), v_[i].z), EPI_Y(at + 3, norm_(k + 3, v_[i].w), v_[i].w)));\n        }}\n    }}"
            );
        } else {
            let _ = writeln!(
                src,
                "{each} if (k < hi) STORE_YX({address}, norm_(k, v_[i]), v_[i]); }}"
            );
        }
        // Out: the last of the group resets its counts, the last of the
        // launch the tickets.
        let _ = writeln!(
            src,
            "    if (threadIdx.x == 0) {{\n        if (atomicAdd(&{name}_out[r], 1u) == (unsigned int)(splits - 1)) {{ {name}_in[r] = 0u; {name}_out[r] = 0u; }}\n        if (atomicAdd(&{name}_ticket[1], 1u) == gridDim.x - 1) {{ {name}_ticket[0] = 0u; {name}_ticket[1] = 0u; }}\n    }}\n}}"
        );
        let launch = Launch {
            shared: 0,
            grid: (groups * splits) as u32,
            block,
            sizes: vec![groups as i64, count as i64, splits as i64],
        };
        (src, launch)
    }

    /// The fragment: a team's one launch ([`SplitNorm::team_source`]), or
    /// the statistics launch and the normalizing one.
    pub(super) fn fragment(
        &self,
        name: &str,
        action: &Action,
        mut params: Vec<String>,
        inputs: Vec<mtmc_actions::graph::TensorRef>,
        node: mtmc_actions::graph::NodeId,
    ) -> Fragment {
        params.extend(SPLIT_SIZES.map(String::from));
        let params = params.join(", ");
        if self.team {
            let (src, launch) = self.team_source(name, action.params.block, &params);
            return one_node(name, action, src, inputs, node, launch);
        }
        let SplitNorm {
            groups,
            count,
            splits,
            ..
        } = *self;
        let stats = format!("{name}_stats");
        let address = &self.address;
        let per = SPLIT_PER_THREAD;
        let mut src = String::new();
        let _ = writeln!(
            src,
            "// {name}: {} over {groups} group(s) of {count}, each cut into {splits} chunks of {per} elements a thread",
            self.what
        );
        let _ = writeln!(
            src,
            "__device__ float {name}_part[{}];",
            2 * groups * splits
        );
        let _ = writeln!(src, "__device__ float {name}_stat[{}];", 2 * groups);
        let _ = writeln!(src, "__device__ unsigned int {name}_done[{groups}];");
        let _ = writeln!(src, "#define {name}_PER {per}");
        // Chunk-major order: the blocks of one chunk index of every group
        // run together, so a scale and shift shared by the groups (a layer
        // norm's) are read from memory once; the normalizing launch goes in
        // the reverse order, so that it starts on the chunks the statistics
        // launch read last, still in L2.
        let chunk = |order: &str| {
            format!(
                "    const long long b_ = {order};\n    const long long r = b_ % groups, part = b_ / groups;\n    const long long chunk = {name}_PER * (long long)blockDim.x;\n    const long long lo = part * chunk, hi = min(count, lo + chunk);\n"
            )
        };
        let each = format!(
            "        #pragma unroll\n        for (int i = 0; i < {name}_PER; ++i) {{ const long long k = lo + (long long)i * blockDim.x + threadIdx.x;"
        );
        // The statistics launch.
        let _ = writeln!(src, "extern \"C\" __global__ void {stats}({params}) {{");
        src.push_str("    __shared__ float shared[32];\n    __shared__ bool last;\n");
        src.push_str(&chunk("blockIdx.x"));
        src.push_str("    {\n");
        let _ = writeln!(src, "        float v_[{name}_PER];");
        // RMS norm: no centering, so no sum.
        let add = if !self.stat.centred() {
            ""
        } else {
            src.push_str("        float total = 0.0f;\n");
            " total += v_[i];"
        };
        let _ = writeln!(
            src,
            "{each} v_[i] = k < hi ? LOAD_X({address}) : 0.0f;{add} }}"
        );
        if !self.stat.centred() {
            src.push_str("        const float mean = 0.0f;\n");
        } else {
            block_reduce(&mut src, "total", "a + b", "0.0f");
            src.push_str("        const float mean = total / (float)(hi - lo);\n");
        }
        src.push_str("        float squares = 0.0f;\n");
        let _ = writeln!(
            src,
            "{each} if (k < hi) {{ const float d = v_[i] - mean; squares += d * d; }} }}"
        );
        block_reduce(&mut src, "squares", "a + b", "0.0f");
        let _ = writeln!(
            src,
            "        if (threadIdx.x == 0) {{\n            {name}_part[2 * (r * splits + part)] = mean; {name}_part[2 * (r * splits + part) + 1] = squares;\n            __threadfence();\n            last = atomicAdd(&{name}_done[r], 1u) == (unsigned int)(splits - 1);\n        }}\n        __syncthreads();\n    }}"
        );
        // The last block of the group combines the chunks' statistics.
        src.push_str("    if (!last) return;\n    __threadfence();\n    {\n");
        let _ = writeln!(
            src,
            "        const volatile float* stats = {name}_part + 2 * r * splits;"
        );
        if !self.stat.centred() {
            src.push_str("        const float mean = 0.0f;\n");
        }
        chan_combine(
            &mut src,
            !self.stat.centred(),
            "const float ",
            ("stats[2 * p]", "stats[2 * p + 1]"),
        );
        let _ = writeln!(
            src,
            "        if (threadIdx.x == 0) {{ {name}_stat[2 * r] = mean; {name}_stat[2 * r + 1] = {}; {name}_done[r] = 0u; }}\n    }}\n}}",
            self.stat.rstd("m2", "count", &self.eps)
        );
        // The normalizing launch.
        let _ = writeln!(src, "extern \"C\" __global__ void {name}({params}) {{");
        src.push_str(&chunk("(long long)gridDim.x - 1 - blockIdx.x"));
        let _ = writeln!(
            src,
            "    const float mean = {name}_stat[2 * r], rstd = {name}_stat[2 * r + 1];"
        );
        let (scale, shift) = self.affine_terms();
        src.push_str("    {\n");
        let _ = writeln!(
            src,
            "{each} if (k < hi) {{ const long long at = {address}; STORE_Y(at, (LOAD_X(at) - mean) * rstd{scale}{shift}); }} }}\n    }}\n}}"
        );
        let launch = Launch {
            shared: 0,
            grid: (groups * splits) as u32,
            block: action.params.block,
            sizes: vec![groups as i64, count as i64, splits as i64],
        };
        let mut f = one_node(name, action, src, inputs, node, launch.clone());
        f.before.push(crate::program::Pass {
            kernel: stats,
            launch,
        });
        f
    }
}

/// Elements each thread of a team's block holds in registers: 64 for
/// blocks of up to 256 threads, so that a block of 256 holds 16384; larger
/// blocks hold 16384 between them. Half as many when they are read one by
/// one (`vec4` false), each with an address of its own to keep.
fn team_per(block: u32, vec4: bool) -> u64 {
    64.min(16384 / u64::from(block)) / if vec4 { 1 } else { 2 }
}

/// Blocks of `block` threads that an SM is sure to hold at once for a
/// team kernel: its `__launch_bounds__` minimum when a chain is fused in
/// (`spare` registers a thread besides its elements: 64, as a chain in
/// front computes while the elements are held), or when none is (20).
fn team_blocks_per_sm(block: u32, spare: u64) -> u64 {
    (65536 / (u64::from(block) * (team_per(block, true) + spare))).clamp(1, 2048 / u64::from(block))
}

/// Blocks per group when a norm over groups of `count` elements is better
/// done by a team ([`SplitNorm::team_source`]): groups longer than a block holds
/// in registers, or few groups (too few to fill the GPU) of at least two
/// chunks. `None` when a team would be larger than two thirds of what the
/// H100's 132 SMs are sure to hold at once: its blocks wait for each
/// other, so all of a team must be resident together.
pub(super) fn team_splits(groups: u64, count: u64, block: u32, vec4: bool) -> Option<u64> {
    let chunk = team_per(block, vec4) * u64::from(block);
    let splits = count.div_ceil(chunk);
    let wanted = count > 16384 || (groups < 2 * 132 && splits >= 2);
    (wanted && splits >= 2 && 3 * splits <= 2 * 132 * team_blocks_per_sm(block, 64))
        .then_some(splits)
}

/// Lines that combine a group's `splits` chunks' statistics (C
/// expressions of the chunk `p`: its mean and the sum of its squared
/// deviations from it) by Chan's formula into `mean` (declared as
/// `{declare}mean`; left alone for an RMS norm, whose mean is 0) and
/// `m2`, the sum of the group's squared deviations from its mean: the
/// chunks' own, plus each chunk's count times its mean's squared distance
/// from the group's. Every thread holds both.
fn chan_combine(src: &mut String, rms: bool, declare: &str, (mean_of, squares_of): (&str, &str)) {
    let weight = "(float)(min(count, (p + 1) * chunk) - min(count, p * chunk))";
    if !rms {
        src.push_str("        float weighted = 0.0f;\n");
        let _ = writeln!(
            src,
            "        for (long long p = threadIdx.x; p < splits; p += blockDim.x) weighted += {weight} * {mean_of};"
        );
        block_reduce(src, "weighted", "a + b", "0.0f");
        let _ = writeln!(src, "        {declare}mean = weighted / (float)count;");
    }
    src.push_str("        float m2 = 0.0f;\n");
    let _ = writeln!(
        src,
        "        for (long long p = threadIdx.x; p < splits; p += blockDim.x) {{ const float d = {mean_of} - mean; m2 += {squares_of} + {weight} * d * d; }}"
    );
    block_reduce(src, "m2", "a + b", "0.0f");
}
