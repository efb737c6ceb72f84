//! Real NVRTC compiles (no GPU needed). `scripts/test` installs NVRTC 13
//! from pip and puts it on the library path.

use mtmc_env::nvrtc::{Arch, CompileUnit, SmLimits, compile, occupancy};

fn unit(name: &str, source: &str) -> CompileUnit {
    CompileUnit {
        name: name.into(),
        source: source.into(),
    }
}

#[track_caller]
fn compiled(u: &CompileUnit) -> mtmc_env::nvrtc::CompileReport {
    compile(u, Arch::SM90).unwrap_or_else(|e| {
        panic!("{e}\nthese tests need NVRTC 13 on the library path: run scripts/test, which installs it")
    })
}

const RELU: &str = r#"
extern "C" __global__ void relu(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaxf(x[i], 0.0f);
}
"#;

#[test]
fn a_kernel_compiles_to_ptx_and_cubin_with_its_resources() {
    let r = compiled(&unit("relu.cu", RELU));
    assert!(r.ok, "{}", r.log);
    assert!(r.diagnostics.is_empty(), "{:?}", r.diagnostics);
    let ptx = r.ptx.as_deref().unwrap();
    assert!(ptx.contains(".entry relu"), "{ptx}");
    let cubin = r.cubin.as_deref().unwrap();
    assert_eq!(&cubin[..4], b"\x7fELF");
    assert_eq!(r.kernels.len(), 1);
    let k = &r.kernels[0];
    assert_eq!(k.name, "relu");
    assert!((4..=32).contains(&k.registers), "{k:?}");
    assert!(!k.spills());
    assert_eq!(occupancy(k, 256, 0, SmLimits::SM90), 1.0);
}

#[test]
fn a_compile_error_is_an_outcome_with_the_line() {
    let src = "extern \"C\" __global__ void k(float* y) {\n    y[0] = undefined_thing;\n}\n";
    let r = compiled(&unit("broken.cu", src));
    assert!(!r.ok);
    assert!(r.ptx.is_none() && r.cubin.is_none() && r.kernels.is_empty());
    assert_eq!(r.diagnostics.len(), 1, "{}", r.log);
    assert_eq!(r.diagnostics[0].line, Some(2));
    assert_eq!(r.diagnostics[0].severity, "error");
    assert!(
        r.diagnostics[0].message.contains("undefined_thing"),
        "{:?}",
        r.diagnostics
    );
    assert!(r.log.contains("broken.cu(2)"), "{}", r.log);
}

#[test]
fn local_arrays_and_shared_memory_show_in_the_resources() {
    let src = r#"
extern "C" __global__ void heavy(float* y, int j) {
    __shared__ float tile[2048];
    float a[512];
    for (int i = 0; i < 512; ++i) a[i] = y[i] * i;
    tile[threadIdx.x] = a[j & 511];
    __syncthreads();
    y[threadIdx.x] = tile[(threadIdx.x + 1) & 2047];
}
"#;
    let r = compiled(&unit("heavy.cu", src));
    assert!(r.ok, "{}", r.log);
    let k = &r.kernels[0];
    assert_eq!(k.shared_bytes, 8192);
    assert!(k.stack_bytes >= 2048, "{k:?}");
    assert_eq!(k.barriers, 1);
}

#[test]
fn several_kernels_in_one_unit_are_reported_each() {
    let src = format!(
        "{RELU}\nextern \"C\" __global__ void neg(float* y) {{ y[threadIdx.x] = -y[threadIdx.x]; }}\n"
    );
    let r = compiled(&unit("two.cu", &src));
    let mut names: Vec<&str> = r.kernels.iter().map(|k| k.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["neg", "relu"]);
}

#[test]
fn a_nul_byte_in_the_source_is_refused() {
    let e = compile(&unit("nul.cu", "int a;\0"), Arch::SM90).unwrap_err();
    assert_eq!(e.to_string(), "the source of `nul.cu` contains a NUL byte");
}

mod compile_only {
    use mtmc_env::evaluator::{Candidate, CompileOnly, Evaluator, ProblemSource, cuda_sources};
    use mtmc_env::nvrtc::Arch;
    use mtmc_env::outcome::{EvaluatorKind, Status};

    const CANDIDATE: &str = r#"
import cupy as cp
NOT_CUDA = "a short string with \"quotes\" and '''"
_SRC = r"""
extern "C" __global__ void twice(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
"""
DOC = '''just text, no kernel'''
_BAD = '''
extern "C" __global__ void broken(float* y) { y[0] = undefined_name; }
'''
"#;

    fn judge(code: &str) -> mtmc_env::outcome::Outcome {
        let mut ev = CompileOnly {
            arch: Arch::SM90,
            reason: "no GPU on this machine".into(),
        };
        let problem = ProblemSource {
            name: "p.py".into(),
            code: String::new(),
            graph: None,
        };
        let c = Candidate::Python {
            name: "c.py".into(),
            code: code.into(),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(ev.evaluate(&problem, &c)).unwrap_or_else(|e| {
            panic!("{e}\nthese tests need NVRTC 13 on the library path: run scripts/test")
        })
    }

    /// A kernel in a one-line string with escapes, as mtmc's own
    /// `ModelNew` writes it.
    const ONE_LINE: &str = r#"
import cupy as cp
_SOURCE = "extern \"C\" __global__ void k0(const float* __restrict__ in0, float* __restrict__ out0, long long n) {\n    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n    if (i < n) out0[i] = fmaxf(in0[i], 0.0f);  // a \\ stays\n}\n"
_OTHER = 'a\tshort string'
_RAW = r"__global__ \n kept"
"#;

    #[test]
    fn a_one_line_kernel_string_is_found_with_its_escapes_decoded_and_compiles() {
        let found = cuda_sources(ONE_LINE);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0].starts_with("extern \"C\" __global__ void k0("),
            "{}",
            found[0]
        );
        assert_eq!(found[0].lines().count(), 4, "{}", found[0]);
        assert!(found[0].contains("// a \\ stays\n}"), "{}", found[0]);
        assert_eq!(found[1], "__global__ \\n kept");
        let without_raw: Vec<&str> = ONE_LINE
            .lines()
            .filter(|l| !l.starts_with("_RAW"))
            .collect();
        let o = judge(&without_raw.join("\n"));
        assert_eq!(o.status, Status::CompiledOnly, "{o:?}");
        assert_eq!(o.kernels.len(), 1, "{o:?}");
        assert_eq!(o.kernels[0].name, "k0");
    }

    #[test]
    fn the_cuda_strings_of_a_python_candidate_are_found() {
        let found = cuda_sources(CANDIDATE);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].contains("void twice"));
        assert!(found[1].contains("void broken"));
    }

    #[test]
    fn a_candidate_that_compiles_says_nothing_was_run() {
        let code = CANDIDATE.split("_BAD").next().unwrap();
        let o = judge(code);
        assert_eq!(o.evaluator, EvaluatorKind::CompileOnly);
        assert_eq!(o.status, Status::CompiledOnly);
        assert!(!o.status.ran());
        assert!(
            o.why.as_deref().unwrap().contains("nothing was run"),
            "{:?}",
            o.why
        );
        assert_eq!(o.kernels.len(), 1);
        let k = &o.kernels[0];
        assert_eq!((k.name.as_str(), k.source.as_str()), ("twice", "nvrtc"));
        assert!(k.registers.unwrap() > 0);
        assert_eq!(k.occupancy, Some(1.0));
        assert!(o.runtime.is_none() && o.correctness.is_none());
    }

    #[test]
    fn a_candidate_that_does_not_compile_is_a_compile_error_with_the_line() {
        let o = judge(CANDIDATE);
        assert_eq!(o.status, Status::CompileError);
        assert_eq!(
            o.error.as_deref(),
            Some("c.py#cuda2:2: identifier \"undefined_name\" is undefined")
        );
        assert!(o.compile_log.unwrap().contains("undefined_name"));
    }
}
