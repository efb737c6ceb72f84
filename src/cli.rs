//! The command line: the flags of every subcommand, and the checks that
//! read their values (each refusal names the flag and what to give).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use crate::cmd;
use mtmc_search::source;

/// Writes fast GPU kernels for KernelBench problems and intent descriptions.
#[derive(Parser)]
#[command(name = "mtmc", version, about, long_about = None)]
pub(crate) struct Cli {
    /// KernelBench problems: a problems.jsonl or a KernelBench checkout.
    /// Without it, the 200 shared problems whose traces are built in.
    #[arg(long, global = true, env = source::KERNELBENCH_ENV, value_name = "PATH")]
    pub(crate) kernelbench: Option<PathBuf>,

    /// Judge on the workers of this Dask cluster (its scheduler's address,
    /// `tcp://HOST:8786`) instead of this machine's GPUs: explore, bench,
    /// rejudge, compare --live, optimize and eval. Each worker needs the
    /// resource `judge` and one GPU (docs/cluster.md).
    #[arg(long, global = true, env = mtmc_env::cluster::CLUSTER_ENV, value_name = "ADDRESS")]
    pub(crate) cluster: Option<String>,

    #[command(subcommand)]
    pub(crate) command: Command,
}

/// `--gpu NAME` of the commands that read a trajectory store.
#[derive(clap::Args)]
pub(crate) struct StoreGpu {
    /// The GPU whose outcomes the store holds (`H100`, `H200`; default:
    /// the store's own): a store of another GPU's outcomes, or of several
    /// GPUs', is refused.
    #[arg(long = "gpu", value_name = "NAME")]
    pub(crate) name: Option<String>,
}

/// A KernelBench problem by name, or an intent program.
#[derive(clap::Args)]
pub(crate) struct SubjectArgs {
    /// A problem: `L2/1`, `L2/1_Conv2D_ReLU_BiasAdd` or a file name.
    #[arg(required_unless_present_any = ["intent", "intent_file", "intent_text"], conflicts_with_all = ["intent", "intent_file", "intent_text"])]
    pub(crate) problem: Option<String>,
    /// An intent program, e.g. "y = gelu(x @ w + b)"; `;` separates statements.
    #[arg(long, conflicts_with_all = ["intent_file", "intent_text"])]
    pub(crate) intent: Option<String>,
    /// A description in words ("batched matmul 32x512x512 then softmax over
    /// the last dim"), turned into an intent program by the configured LLM
    /// (`mtmc optimize` only).
    #[arg(long, conflicts_with = "intent_file", value_name = "TEXT")]
    pub(crate) intent_text: Option<String>,
    /// Where to save the intent program written from --intent-text.
    // Named conflicts too: clap lets `requires` pass where the required
    // argument conflicts with one given (a problem, --intent).
    #[arg(
        long,
        value_name = "FILE",
        requires = "intent_text",
        conflicts_with_all = ["problem", "intent", "intent_file"]
    )]
    pub(crate) save_intent: Option<PathBuf>,
    /// A file holding an intent program.
    #[arg(long, value_name = "FILE")]
    pub(crate) intent_file: Option<PathBuf>,
    /// Shapes of undeclared intent inputs: x=4096x4096,w=4096x4096,b=4096.
    #[arg(long, value_name = "NAME=DIMS,...")]
    pub(crate) shape: Option<String>,
    /// Element type of undeclared intent inputs (f16, bf16, f32, f64).
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
}

/// Who writes the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum CoderKind {
    /// Rules, no network.
    Template,
    /// A model behind an OpenAI-compatible or Anthropic endpoint.
    Llm,
}

// Parsed once per run: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub(crate) enum Command {
    /// List problems: level, name, op classes, FLOPs and minimum bytes.
    Problems {
        /// Only this level (1, 2, 3 or 4).
        #[arg(long)]
        level: Option<u32>,
    },
    /// Show a problem's (or an intent's) op graph, per-node FLOPs and bytes,
    /// and its roofline time on H100 and H200.
    Show {
        #[command(flatten)]
        subject: SubjectArgs,
        /// Only this device (H100 or H200).
        #[arg(long)]
        device: Option<String>,
    },
    /// Compile a CUDA file with NVRTC for sm_90 and report each kernel's
    /// registers, shared memory, spills and occupancy (no GPU needed).
    Compile {
        /// A .cu file; kernels to launch are `extern "C" __global__`.
        file: PathBuf,
        /// Threads per block for the occupancy figure.
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1024))]
        block: u32,
    },
    /// Evaluate candidate `ModelNew` files on a problem. With a GPU: the
    /// KernelBench protocol (5 correctness trials on fresh random inputs,
    /// then 100 timed trials) against eager and torch.compile baselines.
    /// Without one: compile the candidates' CUDA with NVRTC, run nothing.
    Eval {
        #[command(flatten)]
        subject: SubjectArgs,
        /// A candidate: a Python file defining `ModelNew`, or a CUDA program
        /// (`.json`: source or source_file, buffers, launches); repeat to
        /// evaluate several in order.
        #[arg(long = "candidate", value_name = "FILE", required = true)]
        candidates: Vec<PathBuf>,
        /// Which evaluator.
        #[arg(long, value_enum, default_value = "auto")]
        evaluator: cmd::eval::Choice,
        /// Timed trials.
        #[arg(long, default_value_t = 100, value_parser = parse_count::<u32>)]
        trials: u32,
        /// Seconds before a candidate's evaluation is stopped (and counted as a timeout).
        #[arg(long, default_value_t = 120, value_parser = parse_count::<u64>)]
        timeout: u64,
        /// Baselines to time, comma-separated (eager, compile), or `none`.
        #[arg(long, default_value = "eager,compile", value_delimiter = ',')]
        baselines: Vec<String>,
        /// Time the baselines again instead of reading them from the cache.
        #[arg(long)]
        fresh_baselines: bool,
        /// Draw inputs on the CPU and copy them over, as KernelBench does
        /// (its exact values; slow for large problems).
        #[arg(long)]
        host_inputs: bool,
        /// Run the worker on the CPU: the checks, with host-clock timings
        /// (for machines without a GPU; not a speed measurement).
        #[arg(long)]
        cpu: bool,
        /// Fail candidates that compute with torch ops.
        #[arg(long)]
        strict: bool,
        /// Take eager's time alone, measured once per problem before any
        /// candidate ran, instead of timing eager trial by trial beside
        /// each candidate (steadier speedups; the default)
        #[arg(long)]
        eager_alone: bool,
        /// Screen the candidates instead of judging them: KernelBench's
        /// first correctness trial, then N timed calls (a few compared), no
        /// eager beside. A screen ranks candidates (exploration gives the
        /// full protocol to the fast ones); its figures are not the
        /// protocol's.
        #[arg(long, value_name = "N", value_parser = parse_count::<u32>)]
        screen: Option<u32>,
        /// Also write the outcomes as JSON to this file.
        #[arg(long, value_name = "FILE", value_parser = parse_json_out)]
        json: Option<PathBuf>,
    },
    /// Write kernels for a problem or an intent: the template coder with a
    /// small built-in search, or with a planned search (--planner random,
    /// greedy, exhaustive or a trained checkpoint, within --budget
    /// evaluations), or an LLM coder (--coder llm). The template coder
    /// writes pointwise chains fused into kernels; reductions, softmax,
    /// norms and pooling as kernels of their own; matmuls and convolutions
    /// as library calls or fp32 GEMM / implicit-GEMM kernels with their
    /// epilogue fused; attention as a library call. Candidates are judged
    /// on the GPU (an intent natively, a KernelBench problem as an exported
    /// ModelNew by the worker), or compiled only without a GPU.
    Optimize {
        #[command(flatten)]
        subject: SubjectArgs,
        /// Where the generated program and the report go.
        #[arg(long, value_name = "DIR", default_value = "mtmc-out", value_parser = parse_out_dir)]
        out: PathBuf,
        /// Seconds before a candidate's evaluation is stopped.
        #[arg(long, default_value_t = 60, value_parser = parse_count::<u64>)]
        timeout: u64,
        /// The code to write: CUDA, or Triton (KernelBench problems only;
        /// what the Triton coder has no template for stays torch calls).
        #[arg(long, value_enum, default_value = "cuda")]
        target: mtmc_search::optimize::Target,
        /// Who writes the kernels: the template coder, or an LLM (configure
        /// it with --llm-config or the flags below; see docs/llm.md).
        #[arg(long, value_enum, default_value = "template")]
        coder: CoderKind,
        /// Who writes the critique of each outcome for the LLM coder.
        #[arg(long, value_enum, default_value = "rules")]
        critic: mtmc_search::optimize::Critic,
        /// Repair steps per region for the LLM coder (fix compile, fix
        /// correctness) [default: 2].
        #[arg(long)]
        repairs: Option<u32>,
        /// Print the critique of every step (with a trained planner, also
        /// the moves it weighed before each step, with their odds).
        #[arg(short, long)]
        verbose: bool,
        /// Strict mode: every op in a custom kernel (no torch, cuBLAS or
        /// cuDNN call; the worker fails a forward that computes with
        /// torch). Without it, library calls are allowed and listed in the
        /// report.
        #[arg(long)]
        strict: bool,
        /// Search with a planner instead of the built-in variants: random,
        /// greedy, exhaustive, or a checkpoint folder from `mtmc train`.
        #[arg(long, value_name = "PLANNER")]
        planner: Option<mtmc_search::plan::Choice>,
        /// Evaluations the planner may spend.
        #[arg(long, default_value_t = 8, value_parser = parse_budget, requires = "planner")]
        budget: usize,
        /// Record the planner's steps in this trajectory store (SQLite).
        #[arg(long, value_name = "FILE", requires = "planner")]
        trajectories: Option<PathBuf>,
        /// Seed of the random planner.
        #[arg(long, default_value_t = 0, requires = "planner")]
        seed: u64,
        /// Let a trained planner's STOP end the search before the budget
        /// is spent. Without it the search ends at the budget, near the
        /// roofline, or when no legal move is left.
        #[arg(long, requires = "planner")]
        policy_stops: bool,
        #[command(flatten)]
        llm: cmd::llm::LlmArgs,
    },
    /// Run planner episodes on KernelBench problems and record every step
    /// in the trajectory store (the training data). Problems that already
    /// have enough episodes of this planner are skipped: run again to
    /// resume.
    Explore {
        /// Problems by name.
        problems: Vec<String>,
        /// Every problem of this level (repeatable).
        #[arg(long = "level", value_name = "N")]
        levels: Vec<u32>,
        /// Which problems of the fixed train/test split.
        #[arg(long, value_enum, default_value = "train")]
        split: mtmc_search::plan::Split,
        /// The exploring planner: random, greedy, exhaustive or a checkpoint.
        #[arg(long, default_value = "random")]
        planner: mtmc_search::plan::Choice,
        /// Episodes per problem.
        #[arg(long, default_value_t = 2)]
        episodes: usize,
        /// Evaluations per episode.
        #[arg(long, default_value_t = 8, value_parser = parse_budget)]
        budget: usize,
        /// The trajectory store.
        #[arg(long, value_name = "FILE", default_value = "mtmc-trajectories.sqlite")]
        trajectories: PathBuf,
        /// Seconds before a candidate's evaluation is stopped.
        #[arg(long, default_value_t = 60, value_parser = parse_count::<u64>)]
        timeout: u64,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// With --planner exhaustive: evaluate, up to --budget per episode,
        /// the programs one move of this kind makes from a recorded correct
        /// program and that are not recorded yet, the fastest parents
        /// first (repeatable: call_library, custom_kernel, fuse, split,
        /// retile, vectorize, rewrite, cuda_graph).
        #[arg(long, value_name = "KIND")]
        beyond: Vec<String>,
        /// With --beyond: the parents fewest moves from the library
        /// program first (the fastest first among those), instead of the
        /// fastest first, so that the programs every planner's first steps
        /// reach get their children judged before deep ones.
        #[arg(long)]
        shallow_first: bool,
        /// Build every recorded program an episode reaches, and judge it
        /// again where this build writes other code than the one judged
        /// (a coder change since it was recorded), instead of taking its
        /// recorded outcome: refreshes the tree after a coder change, at a
        /// compile per recorded program (with --planner exhaustive and one
        /// more --episodes than recorded, every program it enumerates).
        #[arg(long)]
        rejudge_changed: bool,
        /// On a GPU, screen each program first with N timed calls (and
        /// KernelBench's first correctness trial); only those within 10 %
        /// of their problem's fastest screen get the full protocol, the
        /// rest are recorded as `screened`. 0: the full protocol for all.
        #[arg(long, value_name = "N", default_value_t = mtmc_search::screen::Screening::DEFAULT.calls)]
        screen: u32,
    },
    /// Judge again, on each chosen problem, every recorded program whose
    /// code this build writes otherwise than the code judged (a coder
    /// change since it was recorded), and keep the new outcomes in the
    /// store: the tree then holds this build's outcomes. Each problem's
    /// recorded programs are walked from the library program by the moves
    /// between them and built once; no episode is recorded. Run again to
    /// resume: a program judged again holds this build's code's hash.
    Rejudge {
        /// Problems by name.
        problems: Vec<String>,
        /// Every problem of this level (repeatable).
        #[arg(long = "level", value_name = "N")]
        levels: Vec<u32>,
        /// Which problems of the fixed train/test split.
        #[arg(long, value_enum, default_value = "all")]
        split: mtmc_search::plan::Split,
        /// The trajectory store (not a gzipped one: it is written; a
        /// gzipped one with --dry-run).
        #[arg(long, value_name = "FILE", default_value = "mtmc-trajectories.sqlite")]
        trajectories: PathBuf,
        /// Seconds before a candidate's evaluation is stopped.
        #[arg(long, default_value_t = 60, value_parser = parse_count::<u64>)]
        timeout: u64,
        /// Count, per problem, the recorded programs a rejudge would judge
        /// again (their code changed, or no GPU timed them), and name the
        /// first five whose code changed, without judging or writing
        /// anything: what the GPU time would go to.
        #[arg(long)]
        dry_run: bool,
        /// Also judge again the recorded programs whose judging failed
        /// while they ran (a runtime error, a timeout, a crashed worker)
        /// though this build writes the same code: a failure the evaluator
        /// handles now (a candidate out of memory beside the kept
        /// reference outputs), or a passing one.
        #[arg(long)]
        failed: bool,
        #[command(flatten)]
        gpu: StoreGpu,
    },
    /// Train the planner with PPO on the recorded trajectory tree (no GPU
    /// needed), then the reward-to-go model; write the checkpoint, curves
    /// (CSV and SVG) and train.json to --out.
    Train {
        /// The trajectory store.
        #[arg(long, value_name = "FILE", default_value = "mtmc-trajectories.sqlite")]
        trajectories: PathBuf,
        /// The checkpoint folder.
        #[arg(long, value_name = "DIR", default_value = "mtmc-planner", value_parser = parse_out_dir)]
        out: PathBuf,
        /// PPO iterations in all.
        #[arg(long, default_value_t = 200, value_parser = parse_count::<usize>)]
        iterations: usize,
        /// Episodes per iteration.
        #[arg(long, default_value_t = 64, value_parser = parse_count::<usize>)]
        episodes: usize,
        /// Evaluations per episode.
        #[arg(long, default_value_t = 8, value_parser = parse_budget)]
        budget: usize,
        /// Hidden units of the policy.
        #[arg(long, default_value_t = 128, value_parser = parse_count::<usize>)]
        hidden: usize,
        /// Adam's learning rate.
        #[arg(long, default_value_t = 1e-3, value_parser = parse_lr)]
        lr: f64,
        /// What each evaluation costs in the reward. 0: the budget alone
        /// limits the search; a cost teaches the policy to stop early
        /// (ARCHITECTURE.md, Reward).
        #[arg(long, default_value_t = 0.0)]
        step_cost: f64,
        /// PPO's discount per evaluation, in (0, 1]. Below 1 a gain found
        /// earlier is worth more, which orders the moves most likely to
        /// pay first.
        #[arg(long, default_value_t = 0.6, value_parser = parse_gamma)]
        gamma: f64,
        /// Policies in the committee: each trained alike with the next
        /// seed (seed, seed + 1, …); the planner acts on the mean of their
        /// move probabilities. The first is the checkpoint folder itself,
        /// the others `member-2`, … inside it.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=64))]
        members: u32,
        /// Seed (a seeded run is reproducible).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Continue the checkpoint in --out.
        #[arg(long)]
        resume: bool,
        /// Where PPO runs: cpu, or cuda (burn's CUDA backend, in a build
        /// with `--features cuda`).
        #[arg(long, default_value = "cpu")]
        device: mtmc_planner::policy::Device,
        /// Leave the validation problems (`compare --split validation`)
        /// out of training too, to choose settings on them.
        #[arg(long)]
        validation: bool,
        #[command(flatten)]
        gpu: StoreGpu,
    },
    /// Compare the planners (trained, random, greedy, exhaustive) on the
    /// recorded outcomes of the held-out problems: geomean speedup, fast_1,
    /// evaluations used.
    Compare {
        /// The trajectory store.
        #[arg(long, value_name = "FILE", default_value = "mtmc-trajectories.sqlite")]
        trajectories: PathBuf,
        /// A checkpoint folder from `mtmc train`.
        #[arg(long, value_name = "DIR")]
        checkpoint: Option<PathBuf>,
        /// Evaluations per problem.
        #[arg(long, default_value_t = 8, value_parser = parse_budget)]
        budget: usize,
        /// Which problems of the split.
        #[arg(long, value_enum, default_value = "test")]
        split: mtmc_search::plan::Split,
        /// Only the split's problems of this level (repeatable; every
        /// level when none is given).
        #[arg(long = "level", value_name = "N")]
        levels: Vec<u32>,
        /// Also write the table as JSON to this file.
        #[arg(long, value_name = "FILE", value_parser = parse_json_out)]
        json: Option<PathBuf>,
        /// Replay on the trees that this planner's episodes built (its
        /// name in the store: exhaustive, greedy, random, trained) instead
        /// of on every recorded program. A tree that holds a planner's own
        /// episodes favours that planner.
        #[arg(long, value_name = "PLANNER")]
        recorded_by: Option<String>,
        /// Leave moves of this action kind out of every planner's search,
        /// exhaustive's too: its row is the best of the recorded programs
        /// the other moves reach (repeatable: call_library, custom_kernel,
        /// fuse, split, retile, vectorize, rewrite, cuda_graph). Which
        /// actions matter, in replay.
        #[arg(long, value_name = "KIND")]
        without: Vec<String>,
        /// Run each planner's search on this machine's GPU instead of
        /// replaying recorded outcomes: every program built and judged now
        /// (exhaustive stays the recorded tree's best). Resumable; results,
        /// logs and steps go to --out.
        #[arg(long)]
        live: bool,
        /// The live comparison's folder.
        #[arg(
            long,
            value_name = "DIR",
            default_value = "mtmc-compare-live",
            requires = "live"
        )]
        out: PathBuf,
        /// Live: seconds before a candidate's evaluation is stopped.
        #[arg(long, default_value_t = 60, requires = "live", value_parser = parse_count::<u64>)]
        timeout: u64,
        /// Live: seed (the random planner's episode on the k-th problem
        /// uses seed + k).
        #[arg(long, default_value_t = 0, requires = "live")]
        seed: u64,
        /// Let the trained planner's STOP end an episode before the budget
        /// is spent (its evaluations saved, its best perhaps lower).
        #[arg(long, requires = "checkpoint")]
        policy_stops: bool,
        /// Live: the folder of an earlier pass of the same comparison
        /// (same settings; repeatable): the table pools its finished
        /// episodes with --out's, one entry per problem and pass, since one
        /// pass's timings move by a few percent. A pass on other --level
        /// problems, with the same checkpoint, tree and settings, adds its
        /// problems to the table.
        #[arg(long, value_name = "DIR", requires = "live")]
        pool: Vec<PathBuf>,
        /// Live: print the table of the episodes --out (and each --pool)
        /// already holds and run none: what a pass that was stopped has
        /// found so far, on the problems every planner finished.
        #[arg(long, requires = "live")]
        table_only: bool,
        /// Live: take the random and greedy planners' finished episodes
        /// from an earlier pass's folder (a pass of another checkpoint)
        /// where they ran on this build, on the same tree and with the
        /// same settings: those planners never read the checkpoint, so
        /// only the trained planner's episodes are run again.
        #[arg(
            long,
            value_name = "DIR",
            requires = "live",
            conflicts_with = "table_only"
        )]
        reuse_baselines: Option<PathBuf>,
        /// Live: once every planner has finished a problem, judge their
        /// best programs again side by side in this many rounds (each in
        /// another order), and let the table read each program's median
        /// over the rounds: a program judged minutes after another meets
        /// another state of the host, whose launch rate drifts. Also adds
        /// the rounds to a pass run without them (its episodes' best
        /// programs are built again from its steps). 0: each best program
        /// judged once more right after its own search.
        #[arg(
            long,
            value_name = "ROUNDS",
            default_value_t = 0,
            requires = "live",
            conflicts_with = "table_only"
        )]
        side_by_side: usize,
        #[command(flatten)]
        gpu: StoreGpu,
    },
    /// Merge trajectory stores (say, recorded on several machines) into
    /// one: every problem, episode, step and judged program. The stores
    /// merged from are left unchanged; a program judged in two takes the
    /// outcome of the one named last.
    Merge {
        /// The store written (created if missing; not a gzipped one).
        #[arg(long, value_name = "FILE")]
        into: PathBuf,
        /// The stores to merge into it, plain or gzipped.
        #[arg(required = true, value_name = "FROM")]
        from: Vec<PathBuf>,
    },
    /// Send one tiny request to the configured LLM endpoint and say what
    /// works: reachable, model listed, reply in the expected JSON, latency.
    LlmCheck {
        #[command(flatten)]
        llm: cmd::llm::LlmArgs,
    },
    /// Serve one reply (a file's text) to every completion request on
    /// 127.0.0.1, as an OpenAI-compatible or Anthropic endpoint: a stand-in
    /// for end-to-end runs without a model.
    LlmReplay {
        /// The reply text.
        #[arg(long, value_name = "FILE")]
        reply: PathBuf,
        /// Port (0: any free one; the URL is printed).
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Wire format: openai or anthropic.
        #[arg(long, default_value = "openai")]
        provider: String,
        /// The model it lists.
        #[arg(long, default_value = "replay")]
        model: String,
    },
    /// Optimize a set of KernelBench problems and print KernelBench's
    /// metrics: correctness, fast_0/1/2, geomean speedup over eager and
    /// torch.compile (timed in the same run), mean roofline fraction. Every
    /// problem's result is kept as it finishes; run again with the same
    /// --out to resume.
    Bench {
        /// Problems by name (`L1/19`, `L2/12_Gemm_Multiply_LeakyReLU`).
        problems: Vec<String>,
        /// Every problem of this level (repeatable).
        #[arg(long = "level", value_name = "N")]
        levels: Vec<u32>,
        /// Every problem.
        #[arg(long)]
        all: bool,
        /// Where the results, the generated code and the reports go.
        #[arg(long, value_name = "DIR", default_value = "mtmc-bench", value_parser = parse_out_dir)]
        out: PathBuf,
        /// The code to write.
        #[arg(long, value_enum, default_value = "cuda")]
        target: mtmc_search::optimize::Target,
        /// Seconds before a candidate's evaluation is stopped.
        #[arg(long, default_value_t = 60, value_parser = parse_count::<u64>)]
        timeout: u64,
        /// Forget the results already in --out and start over.
        #[arg(long)]
        fresh: bool,
        /// Strict mode: every op in a custom kernel; a problem with an op
        /// no family computes is not covered (see `optimize --strict`).
        #[arg(long)]
        strict: bool,
    },
    /// Benchmark the evaluation environment on the GPU: wall seconds per
    /// candidate (compile + 5 correctness trials + 100 timed trials) on the
    /// fast path (NVRTC, Triton) and the load_inline path, candidates per
    /// minute, and the ratio, for an L1 and an L2 problem.
    BenchEnv {
        /// Fast-path (NVRTC) candidates per problem.
        #[arg(long, default_value_t = 20)]
        copies: u32,
        /// Triton candidates per problem that has one.
        #[arg(long, default_value_t = 3)]
        triton_copies: u32,
        /// Skip the load_inline path (about a minute per problem).
        #[arg(long)]
        no_slow: bool,
        /// Also screen the fast-path copies with N timed calls (the first
        /// correctness trial, no eager beside), as exploration screens.
        #[arg(long, value_name = "N", value_parser = parse_count::<u32>)]
        screen: Option<u32>,
        /// Seconds before a candidate's evaluation is stopped.
        #[arg(long, default_value_t = 300, value_parser = parse_count::<u64>)]
        timeout: u64,
        /// Also write every outcome as JSON to this file.
        #[arg(long, value_name = "FILE", value_parser = parse_json_out)]
        json: Option<PathBuf>,
    },
    /// Check the GPU and driver, NVRTC, and Python with torch, triton and cupy.
    Doctor,
    /// The native evaluator's child process (JSON lines on stdin/stdout);
    /// started by `mtmc eval`, not by hand.
    #[command(hide = true, name = "native-worker")]
    NativeWorker,
}

impl SubjectArgs {
    /// The problem by name, or the intent from the flags or its file.
    pub(crate) fn resolve<'a>(
        &'a self,
        kb: Option<&'a std::path::Path>,
    ) -> Result<mtmc_search::subject::Subject<'a>> {
        if let Some(name) = self.problem.as_deref() {
            return Ok(mtmc_search::subject::Subject::Problem {
                kernelbench: kb,
                name,
            });
        }
        if self.intent_text.is_some() {
            anyhow::bail!(
                "--intent-text is turned into an intent by the LLM in `mtmc optimize` only; here, write the intent with --intent"
            );
        }
        self.resolve_text(None)
    }

    /// The subject with its intent text given (`Some`: one written from
    /// --intent-text) or from the flags.
    pub(crate) fn resolve_text(
        &self,
        written: Option<String>,
    ) -> Result<mtmc_search::subject::Subject<'_>> {
        let (text, origin) = match (written, &self.intent, &self.intent_file) {
            (Some(t), _, _) => (t, "--intent-text".to_string()),
            (None, Some(t), _) => (t.clone(), "--intent".to_string()),
            (None, None, Some(f)) => (
                std::fs::read_to_string(f)
                    .with_context(|| format!("cannot read intent file `{}`", f.display()))?,
                format!("{}", f.display()),
            ),
            (None, None, None) => unreachable!("clap requires a problem or an intent"),
        };
        let shapes = match &self.shape {
            Some(s) => mtmc_actions::intent::parse_shapes(s)?,
            None => Default::default(),
        };
        let dtype = &self.dtype;
        let dtype = mtmc_actions::DType::parse(dtype).with_context(|| {
            format!("--dtype `{dtype}` is not a type (use f16, bf16, f32 or f64)")
        })?;
        Ok(mtmc_search::subject::Subject::Intent {
            text,
            origin,
            bindings: mtmc_actions::intent::Bindings {
                shapes,
                dtype: Some(dtype),
            },
        })
    }
}

/// `--gamma`: a discount in (0, 1].
fn parse_gamma(s: &str) -> std::result::Result<f64, String> {
    let g: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number: give a discount such as 0.9"))?;
    if g > 0.0 && g <= 1.0 {
        Ok(g)
    } else {
        Err(format!(
            "{g} is outside (0, 1]: a discount is above 0 and at most 1"
        ))
    }
}

/// An --out folder: a path that is not a file (it is made when missing).
fn parse_out_dir(s: &str) -> std::result::Result<PathBuf, String> {
    let path = PathBuf::from(s);
    match mtmc_search::files::out_dir_refused(&path) {
        Some(why) => Err(why),
        None => Ok(path),
    }
}

/// A whole number of one or more (iterations, episodes, hidden units,
/// trials, seconds).
fn parse_count<T: std::str::FromStr + From<u8> + PartialEq>(
    s: &str,
) -> std::result::Result<T, String> {
    match s.parse::<T>() {
        Ok(n) if n == T::from(0) => Err("0 is too few: give 1 or more".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

/// A --json file to write at the end: checked before the work, so that
/// a long run does not end unable to write it.
fn parse_json_out(s: &str) -> std::result::Result<PathBuf, String> {
    let path = PathBuf::from(s);
    if path.is_dir() {
        return Err(format!("`{s}` is a folder: --json names the file to write"));
    }
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => Err(format!(
            "the folder `{}` does not exist: make it first, or name a file in a folder that does",
            dir.display()
        )),
        _ => Ok(path),
    }
}

fn parse_lr(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(lr) if lr > 0.0 && lr.is_finite() => Ok(lr),
        Ok(lr) => Err(format!(
            "{lr} is not a learning rate: give one above 0, such as 0.001"
        )),
        Err(_) => Err(format!(
            "`{s}` is not a number: give a learning rate such as 0.001"
        )),
    }
}

fn parse_budget(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("a budget of 0 evaluations judges nothing: give 1 or more".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "`{s}` is not a count of evaluations: give a whole number such as 8"
        )),
    }
}
