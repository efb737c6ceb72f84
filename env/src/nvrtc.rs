//! Compiling CUDA C++ with NVRTC, on machines with or without a GPU.
//!
//! A compile that fails is an outcome, not an error: the report carries the
//! log and the diagnostics the critique needs. Only a missing or unusable
//! NVRTC library is an error.

use std::ffi::CString;
use std::time::Instant;

/// A translation unit: one or more kernels in one source text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileUnit {
    /// Name shown in the compiler's messages (e.g. `relu.cu`).
    pub name: String,
    /// CUDA C++ source. Kernels to launch are `extern "C" __global__`.
    pub source: String,
}

/// A GPU architecture to compile for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    /// Compute capability major.
    pub major: u32,
    /// Compute capability minor.
    pub minor: u32,
}

impl Arch {
    /// Hopper (H100, H200).
    pub const SM90: Arch = Arch { major: 9, minor: 0 };

    /// `sm_90`-style name.
    pub fn sm(&self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }

    /// The target NVRTC compiles for: Hopper's arch-specific `sm_90a`
    /// (it has `wgmma`; its code runs on compute capability 9.0 only,
    /// which is what this arch names), otherwise `sm()`. Kernels that use
    /// arch-specific instructions guard them with
    /// `__CUDA_ARCH_FEAT_SM90_ALL`.
    pub fn target(&self) -> String {
        if (self.major, self.minor) == (9, 0) {
            "sm_90a".to_string()
        } else {
            self.sm()
        }
    }
}

/// Resources one kernel uses, as ptxas reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's (entry function's) name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory per block, bytes.
    pub shared_bytes: u32,
    /// Stack frame per thread, bytes (local memory).
    pub stack_bytes: u32,
    /// Bytes stored to local memory because registers ran out.
    pub spill_store_bytes: u32,
    /// Bytes loaded back from spills.
    pub spill_load_bytes: u32,
    /// Named barriers used.
    pub barriers: u32,
}

impl KernelResources {
    /// Whether the kernel spills registers to local memory.
    pub fn spills(&self) -> bool {
        self.spill_store_bytes > 0 || self.spill_load_bytes > 0
    }
}

/// One compiler error or warning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// Line in the unit, when the compiler gave one.
    pub line: Option<u32>,
    /// `error` or `warning`.
    pub severity: String,
    /// The message.
    pub message: String,
}

/// What compiling one unit produced.
#[derive(Clone, Debug)]
pub struct CompileReport {
    /// The unit compiled.
    pub ok: bool,
    /// The full compiler log.
    pub log: String,
    /// Errors and warnings parsed from the log.
    pub diagnostics: Vec<Diagnostic>,
    /// Per-kernel resources (when it compiled).
    pub kernels: Vec<KernelResources>,
    /// PTX text (when it compiled).
    pub ptx: Option<String>,
    /// Device code for the target architecture (when it compiled).
    pub cubin: Option<Vec<u8>>,
    /// Wall time of the compile.
    pub seconds: f64,
    /// Architecture compiled for.
    pub arch: Arch,
}

/// NVRTC could not be used at all.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// The library is not on the library path.
    #[error("NVRTC is not available ({0}); run `mtmc doctor` for the fix")]
    Unavailable(String),
    /// The source holds a NUL byte.
    #[error("the source of `{0}` contains a NUL byte")]
    NulInSource(String),
    /// An NVRTC call failed for another reason than the source.
    #[error("NVRTC failed while {doing}: {status}")]
    Call {
        /// What was being done.
        doing: &'static str,
        /// NVRTC's status.
        status: String,
    },
}

#[allow(unsafe_code)]
mod ffi {
    use std::ffi::{CStr, c_char};

    use cudarc::nvrtc::{result, sys};

    use super::NvrtcError;

    fn call(doing: &'static str, e: impl std::fmt::Debug) -> NvrtcError {
        NvrtcError::Call {
            doing,
            status: format!("{e:?}"),
        }
    }

    fn text(bytes: Vec<c_char>) -> String {
        let bytes: Vec<u8> = bytes
            .into_iter()
            .map(|c| c as u8)
            .take_while(|&b| b != 0)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Raw products of one compile.
    pub struct Raw {
        pub ok: bool,
        pub log: String,
        pub ptx: Option<String>,
        pub cubin: Option<Vec<u8>>,
    }

    pub fn compile(source: &CStr, name: &CStr, options: &[String]) -> Result<Raw, NvrtcError> {
        // SAFETY: only tries to dlopen the library by its known names; cudarc
        // would panic on first use if it were missing.
        if !unsafe { sys::is_culib_present() } {
            return Err(NvrtcError::Unavailable(
                "libnvrtc is not found on the library path".into(),
            ));
        }
        let prog = result::create_program(source, Some(name))
            .map_err(|e| call("creating the program", e))?;
        // SAFETY: `prog` is a live program; it is destroyed exactly once below.
        let compiled = unsafe { result::compile_program(prog, options) };
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog) }.map(text);
        let products = match (&compiled, &log) {
            (Ok(()), Ok(_)) => {
                // SAFETY: the program compiled, so PTX and CUBIN exist.
                let ptx = unsafe { result::get_ptx(prog) }.map(text).ok();
                let cubin = unsafe { cubin(prog) };
                Ok((ptx, cubin))
            }
            _ => Ok((None, None)),
        };
        // SAFETY: `prog` is live and not used after this.
        let destroyed = unsafe { result::destroy_program(prog) };
        let log = log.map_err(|e| call("reading the log", e))?;
        destroyed.map_err(|e| call("destroying the program", e))?;
        let (ptx, cubin) = products?;
        let ok = match compiled {
            Ok(()) => true,
            Err(e) if e.0 == sys::nvrtcResult::NVRTC_ERROR_COMPILATION => false,
            Err(e) => return Err(call("compiling", e)),
        };
        Ok(Raw {
            ok,
            log,
            ptx,
            cubin,
        })
    }

    /// SAFETY: `prog` must be a live, successfully compiled program.
    unsafe fn cubin(prog: sys::nvrtcProgram) -> Option<Vec<u8>> {
        let mut size = 0usize;
        // SAFETY: `prog` is live (caller), `size` is a valid out-pointer.
        let status = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
        if status != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return None;
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` holds `size` bytes, as NVRTC asked for.
        let status = unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast::<c_char>()) };
        (status == sys::nvrtcResult::NVRTC_SUCCESS).then_some(buf)
    }
}

/// The options every compile uses: device code for `arch` (`Arch::target`), ptxas resource
/// report, line info for diagnostics, and IEEE-exact math (no fast-math, so
/// fp32 results can meet KernelBench's 1e-4 tolerance).
pub fn options(arch: Arch) -> Vec<String> {
    vec![
        format!("-arch={}", arch.target()),
        "--ptxas-options=-v".into(),
        "-lineinfo".into(),
        "--std=c++17".into(),
        "--fmad=true".into(),
    ]
}

/// Compiles one unit for `arch`.
pub fn compile(unit: &CompileUnit, arch: Arch) -> Result<CompileReport, NvrtcError> {
    let source = CString::new(unit.source.as_str())
        .map_err(|_| NvrtcError::NulInSource(unit.name.clone()))?;
    let name = CString::new(unit.name.replace('\0', "")).expect("NUL bytes were removed");
    let start = Instant::now();
    let raw = ffi::compile(&source, &name, &options(arch))?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(CompileReport {
        ok: raw.ok,
        diagnostics: parse_diagnostics(&raw.log),
        kernels: if raw.ok {
            parse_resources(&raw.log)
        } else {
            Vec::new()
        },
        log: raw.log,
        ptx: raw.ptx,
        cubin: raw.cubin,
        seconds,
        arch,
    })
}

/// Reads NVRTC's `name(LINE): error: message` lines.
pub fn parse_diagnostics(log: &str) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    for line in log.lines() {
        for severity in ["error", "warning"] {
            let marker = format!(": {severity}: ");
            let Some(at) = line.find(&marker) else {
                continue;
            };
            let head = &line[..at];
            let number = head
                .rfind('(')
                .and_then(|open| head[open + 1..].strip_suffix(')'))
                .and_then(|n| n.parse().ok());
            out.push(Diagnostic {
                line: number,
                severity: severity.to_string(),
                message: line[at + marker.len()..].trim().to_string(),
            });
        }
    }
    out
}

fn number_before(text: &str, unit: &str) -> Option<u32> {
    let at = text.find(unit)?;
    text[..at].split_whitespace().last()?.parse().ok()
}

/// Reads the per-kernel blocks of `ptxas -v` output.
pub fn parse_resources(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(KernelResources {
                name,
                ..KernelResources::default()
            });
            continue;
        }
        let Some(k) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            k.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            k.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
            k.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains(" registers") {
            k.registers = number_before(line, "registers").unwrap_or(0);
            k.barriers = number_before(line, "barriers").unwrap_or(0);
            k.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

/// Per-SM limits that bound occupancy.
#[derive(Clone, Copy, Debug)]
pub struct SmLimits {
    /// 32-bit registers per SM.
    pub registers: u32,
    /// Register allocation granularity per warp.
    pub register_granule: u32,
    /// Resident threads per SM.
    pub threads: u32,
    /// Resident blocks per SM.
    pub blocks: u32,
    /// Shared memory per SM usable by blocks, bytes.
    pub shared_bytes: u32,
    /// Shared memory the system reserves per block, bytes.
    pub shared_reserved_per_block: u32,
}

impl SmLimits {
    /// Hopper (compute capability 9.0).
    pub const SM90: SmLimits = SmLimits {
        registers: 65_536,
        register_granule: 256,
        threads: 2048,
        blocks: 32,
        shared_bytes: 233_472,
        shared_reserved_per_block: 1024,
    };
}

/// Theoretical occupancy: resident warps per SM over the maximum, for a
/// kernel launched with `block_threads` threads and `dynamic_shared` bytes.
pub fn occupancy(
    k: &KernelResources,
    block_threads: u32,
    dynamic_shared: u32,
    sm: SmLimits,
) -> f64 {
    if block_threads == 0 || block_threads > 1024 {
        return 0.0;
    }
    let warps = block_threads.div_ceil(32);
    let by_threads = sm.threads / (warps * 32);
    let by_regs = if k.registers == 0 {
        sm.blocks
    } else {
        let per_warp = (k.registers * 32).div_ceil(sm.register_granule) * sm.register_granule;
        (sm.registers / per_warp) / warps
    };
    let smem = k.shared_bytes + dynamic_shared + sm.shared_reserved_per_block;
    let by_smem = sm.shared_bytes / smem;
    let blocks = by_threads.min(by_regs).min(by_smem).min(sm.blocks);
    f64::from(blocks * warps) / f64::from(sm.threads / 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'spill' for 'sm_90'
ptxas info    : Function properties for spill
ptxas         .     1040 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem
ptxas info    : Compiling entry function 'relu' for 'sm_90'
ptxas info    : Function properties for relu
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
";

    #[test]
    fn ptxas_reports_become_per_kernel_resources() {
        let k = parse_resources(LOG);
        assert_eq!(
            k,
            [
                KernelResources {
                    name: "spill".into(),
                    registers: 255,
                    shared_bytes: 4096,
                    stack_bytes: 1040,
                    spill_store_bytes: 24,
                    spill_load_bytes: 16,
                    barriers: 1,
                },
                KernelResources {
                    name: "relu".into(),
                    registers: 10,
                    ..KernelResources::default()
                },
            ]
        );
        assert!(k[0].spills() && !k[1].spills());
    }

    #[test]
    fn compiler_errors_keep_their_line() {
        let d = parse_diagnostics(
            "relu.cu(4): error: identifier \"yy\" is undefined\n\n1 error detected in the compilation of \"relu.cu\".\nrelu.cu(2): warning: variable \"z\" was declared but never referenced",
        );
        assert_eq!(
            d,
            [
                Diagnostic {
                    line: Some(4),
                    severity: "error".into(),
                    message: "identifier \"yy\" is undefined".into()
                },
                Diagnostic {
                    line: Some(2),
                    severity: "warning".into(),
                    message: "variable \"z\" was declared but never referenced".into()
                },
            ]
        );
    }

    #[test]
    fn occupancy_follows_the_tightest_limit() {
        let k = |registers, shared_bytes| KernelResources {
            registers,
            shared_bytes,
            ..KernelResources::default()
        };
        // 32 registers, 256 threads: 8 blocks fill 2048 threads.
        assert_eq!(occupancy(&k(32, 0), 256, 0, SmLimits::SM90), 1.0);
        // 64 registers: 65536 / (64·32) = 32 warps, half the SM.
        assert_eq!(occupancy(&k(64, 0), 256, 0, SmLimits::SM90), 0.5);
        // 255 registers (→ 256 per thread): 8 warps, one 256-thread block.
        assert_eq!(occupancy(&k(255, 0), 256, 0, SmLimits::SM90), 0.125);
        // 100 KB of shared memory per block: 2 blocks of 4 warps = 8 of 64.
        assert_eq!(occupancy(&k(32, 100 * 1024), 128, 0, SmLimits::SM90), 0.125);
        assert_eq!(occupancy(&k(32, 0), 2048, 0, SmLimits::SM90), 0.0);
    }
}
