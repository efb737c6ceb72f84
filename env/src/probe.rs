//! Probes for `mtmc doctor`: each finds one component or says how to get it.

use std::process::Command;

use serde_json::Value;

use crate::python;

/// One line of the doctor's report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// What was checked (`GPU`, `NVRTC`, `python3`, `torch`, …).
    pub component: String,
    /// What was found, or why not.
    pub detail: String,
    /// How to get it, when missing.
    pub fix: Option<String>,
    /// Whether it was found and works.
    pub ok: bool,
}

impl Check {
    fn found(component: &str, detail: impl Into<String>) -> Check {
        Check {
            component: component.into(),
            detail: detail.into(),
            fix: None,
            ok: true,
        }
    }

    fn missing(component: &str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            component: component.into(),
            detail: detail.into(),
            fix: Some(fix.into()),
            ok: false,
        }
    }
}

/// A GPU seen through the CUDA driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// Device name as the driver reports it.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub memory_bytes: u64,
}

/// The driver's view of the machine's GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Driver {
    /// CUDA version the driver supports, e.g. (13, 0).
    pub cuda_version: (i32, i32),
    /// The GPUs, in ordinal order.
    pub gpus: Vec<Gpu>,
}

#[allow(unsafe_code)]
mod ffi {
    use cudarc::driver::{result, sys};

    use super::{Driver, Gpu};

    /// Loads libcuda and lists the GPUs, without panicking when the
    /// library is missing (cudarc panics on first use in that case).
    pub fn driver() -> Result<Driver, String> {
        // SAFETY: only tries to dlopen the library by its known names.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda (the NVIDIA driver library) is not found".into());
        }
        result::init().map_err(|e| format!("the CUDA driver did not initialize: {e}"))?;
        let mut version = 0;
        // SAFETY: the library is loaded and initialized; the pointer is valid.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| format!("cuDriverGetVersion failed: {e}"))?;
        let count = result::device::get_count().map_err(|e| format!("no device count: {e}"))?;
        let mut gpus = Vec::new();
        for ordinal in 0..count {
            let dev = result::device::get(ordinal).map_err(|e| e.to_string())?;
            let name = result::device::get_name(dev).map_err(|e| e.to_string())?;
            let attr = |a| {
                // SAFETY: `dev` is a valid device handle from the driver.
                unsafe { result::device::get_attribute(dev, a) }.map_err(|e| e.to_string())
            };
            let major =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            // SAFETY: `dev` is a valid device handle from the driver.
            let memory = unsafe { result::device::total_mem(dev) }.map_err(|e| e.to_string())?;
            gpus.push(Gpu {
                name,
                compute_capability: (major, minor),
                memory_bytes: memory as u64,
            });
        }
        Ok(Driver {
            cuda_version: (version / 1000, (version % 1000) / 10),
            gpus,
        })
    }

    /// Loads libnvrtc and reads its version, without panicking when missing.
    pub fn nvrtc_version() -> Result<(i32, i32), String> {
        use cudarc::nvrtc::sys as nvrtc;
        // SAFETY: only tries to dlopen the library by its known names.
        if !unsafe { nvrtc::is_culib_present() } {
            return Err("libnvrtc is not found on the library path".into());
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the library is present; both pointers are valid.
        let status = unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
        if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("nvrtcVersion failed: {status:?}"));
        }
        Ok((major, minor))
    }
}

/// The CUDA driver and GPUs, or why they cannot be used.
pub fn driver() -> Result<Driver, String> {
    ffi::driver()
}

/// NVRTC's version, or why it cannot be loaded.
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    ffi::nvrtc_version()
}

/// What Python reports about itself and the packages mtmc uses.
const PYTHON_PROBE: &str = r#"
import json, sys, importlib, os
out = {"python": sys.version.split()[0], "executable": sys.executable}
for name in ("torch", "triton", "cupy", "distributed"):
    try:
        m = importlib.import_module(name)
        out[name] = getattr(m, "__version__", "?")
    except Exception as e:
        out[name] = None
        out[name + "_error"] = f"{type(e).__name__}: {e}"[:200]
if out.get("torch"):
    import torch
    out["torch_cuda"] = torch.cuda.is_available()
try:
    import nvidia
    for base in nvidia.__path__:
        for sub in ("cu13/lib", "cuda_nvrtc/lib"):
            d = os.path.join(base, sub)
            if any(f.startswith("libnvrtc.so") for f in (os.listdir(d) if os.path.isdir(d) else [])):
                out["nvrtc_wheel_lib"] = d
except Exception:
    pass
print(json.dumps(out))
"#;

/// Runs the interpreter's self-report, or says why it could not run.
pub fn python_report() -> Result<Value, String> {
    let py = python::interpreter();
    let out = Command::new(&py)
        .args(["-c", PYTHON_PROBE])
        .output()
        .map_err(|e| format!("{} could not be started: {e}", py.to_string_lossy()))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            py.to_string_lossy(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("unreadable report: {e}"))
}

/// Whether the NVRTC mtmc is built for (CUDA 13) loads, and how to get it
/// when not; `wheel_lib`: the lib directory of a pip-installed NVRTC wheel,
/// where the Python worker found one.
pub fn nvrtc(wheel_lib: Option<String>) -> Check {
    match nvrtc_version() {
        Ok((major, minor)) if major == 13 => Check::found("NVRTC", format!("{major}.{minor}")),
        Ok((major, minor)) => Check::missing(
            "NVRTC",
            format!("{major}.{minor} found, but mtmc is built for CUDA 13"),
            "put NVRTC 13 first on LD_LIBRARY_PATH (pip install 'nvidia-cuda-nvrtc==13.0.*')",
        ),
        Err(why) => Check::missing(
            "NVRTC",
            why,
            match wheel_lib {
                Some(dir) => format!("export LD_LIBRARY_PATH={dir}:$LD_LIBRARY_PATH"),
                None => "pip install 'nvidia-cuda-nvrtc==13.0.*', then add its nvidia/cu13/lib \
                         directory to LD_LIBRARY_PATH (mtmc doctor prints the exact line once it is installed)"
                    .to_string(),
            },
        ),
    }
}

/// The `.deps/` folder `scripts/test` fills in a checkout (the NVRTC
/// wheel in `python/`, a venv with torch and triton in `torch/`), looked
/// for from the working directory up, then from the binary's place up
/// (`target/release/mtmc` of a checkout).
fn checkout_deps() -> Option<std::path::PathBuf> {
    let starts = [std::env::current_dir().ok(), std::env::current_exe().ok()];
    starts
        .iter()
        .flatten()
        .flat_map(|start| start.ancestors())
        .map(|dir| dir.join(".deps"))
        .find(|deps| deps.is_dir())
}

/// Every check `mtmc doctor` prints, in order.
pub fn doctor() -> Vec<Check> {
    let mut checks = Vec::new();
    let py = python_report();
    match driver() {
        Ok(d) if d.gpus.is_empty() => checks.push(Check::missing(
            "GPU",
            format!("driver for CUDA {}.{} loaded, but it sees no GPU", d.cuda_version.0, d.cuda_version.1),
            "check CUDA_VISIBLE_DEVICES and that the GPU is visible to this machine (nvidia-smi)",
        )),
        Ok(d) => {
            for (i, g) in d.gpus.iter().enumerate() {
                checks.push(Check::found(
                    "GPU",
                    format!(
                        "#{i} {} (sm_{}{}, {:.1} GiB), driver supports CUDA {}.{}",
                        g.name,
                        g.compute_capability.0,
                        g.compute_capability.1,
                        g.memory_bytes as f64 / (1u64 << 30) as f64,
                        d.cuda_version.0,
                        d.cuda_version.1
                    ),
                ));
            }
        }
        Err(why) => checks.push(Check::missing(
            "GPU",
            why,
            "install the NVIDIA driver, or add the directory holding libcuda.so to LD_LIBRARY_PATH; \
             without a GPU mtmc can still show problems and compile kernels",
        )),
    }
    let deps = checkout_deps();
    let wheel_lib = py
        .as_ref()
        .ok()
        .and_then(|r| r.get("nvrtc_wheel_lib"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| {
            let lib = deps.as_ref()?.join("python/nvidia/cu13/lib");
            lib.join("libnvrtc.so.13")
                .is_file()
                .then(|| lib.display().to_string())
        });
    checks.push(nvrtc(wheel_lib));
    let name = python::interpreter().to_string_lossy().into_owned();
    match py {
        Err(why) => checks.push(Check::missing(
            "python",
            why,
            format!(
                "install Python 3, or point {} at an interpreter that has torch",
                python::PYTHON_ENV
            ),
        )),
        Ok(r) => {
            let s = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
            checks.push(Check::found(
                "python",
                format!("{} ({name} = {})", s("python"), s("executable")),
            ));
            for (pkg, pip_name, why_needed) in [
                (
                    "torch",
                    "torch",
                    "traces KernelBench problems and runs their reference models",
                ),
                ("triton", "triton", "compiles Triton kernels"),
                (
                    "cupy",
                    "cupy-cuda13x",
                    "launches NVRTC-compiled kernels from Python",
                ),
                (
                    "distributed",
                    "'distributed==2026.8.*'",
                    "judges on a Dask cluster's workers, with --cluster",
                ),
            ] {
                match r.get(pkg).and_then(Value::as_str) {
                    Some(v) => {
                        let cuda = if pkg == "torch" {
                            match r.get("torch_cuda").and_then(Value::as_bool) {
                                Some(true) => ", sees a GPU",
                                _ => ", sees no GPU",
                            }
                        } else {
                            ""
                        };
                        checks.push(Check::found(pkg, format!("{v}{cuda}")));
                    }
                    None => checks.push(Check::missing(
                        pkg,
                        format!("not importable by {name} ({})", s(&format!("{pkg}_error"))),
                        match deps
                            .as_ref()
                            .map(|d| d.join("torch/bin/python"))
                            .filter(|venv| pkg != "cupy" && venv.is_file())
                        {
                            // scripts/test installed torch and triton in
                            // a venv of the checkout.
                            Some(venv) => format!(
                                "export {}={}   (the Python scripts/test installed {pkg} in)",
                                python::PYTHON_ENV,
                                venv.display()
                            ),
                            None => format!(
                                "{name} -m pip install {pip_name}   (needed: it {why_needed})"
                            ),
                        },
                    )),
                }
            }
        }
    }
    checks
}
