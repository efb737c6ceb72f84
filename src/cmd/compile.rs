//! `mtmc compile`: compile a CUDA file with NVRTC and report each kernel's
//! resources. Needs NVRTC, not a GPU.

use std::path::Path;

use anyhow::{Context, Result, bail};
use mtmc_env::nvrtc::{Arch, CompileUnit, SmLimits, compile, occupancy};

use mtmc_search::fmt::{si, table};

/// Compiles `file` for sm_90 and prints diagnostics and per-kernel resources,
/// with the theoretical occupancy at `block` threads per block.
pub fn run(out: &mut dyn std::io::Write, file: &Path, block: u32) -> Result<()> {
    let source = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read CUDA file `{}`", file.display()))?;
    let name = file.file_name().map_or_else(
        || "kernel.cu".to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let report = compile(
        &CompileUnit {
            name: name.clone(),
            source,
        },
        Arch::SM90,
    )?;
    for d in &report.diagnostics {
        match d.line {
            Some(line) => writeln!(out, "{name}:{line}: {}: {}", d.severity, d.message)?,
            None => writeln!(out, "{name}: {}: {}", d.severity, d.message)?,
        }
    }
    if !report.ok {
        let errors = report
            .diagnostics
            .iter()
            .filter(|d| d.severity == "error")
            .count();
        bail!(
            "`{}` does not compile ({errors} error(s) above)",
            file.display()
        );
    }
    writeln!(
        out,
        "{name} compiled for {} in {:.2} s; {} of device code\n",
        report.arch.target(),
        report.seconds,
        si(report.cubin.as_ref().map_or(0, Vec::len) as f64, "B"),
    )?;
    let rows: Vec<Vec<String>> = report
        .kernels
        .iter()
        .map(|k| {
            vec![
                k.name.clone(),
                k.registers.to_string(),
                si(f64::from(k.shared_bytes), "B"),
                si(f64::from(k.stack_bytes), "B"),
                if k.spills() {
                    format!("{} B out, {} B in", k.spill_store_bytes, k.spill_load_bytes)
                } else {
                    "none".into()
                },
                format!("{:.0}%", 100.0 * occupancy(k, block, 0, SmLimits::SM90)),
            ]
        })
        .collect();
    let occ = format!("OCCUPANCY@{block}");
    write!(
        out,
        "{}",
        table(
            &["KERNEL", "REGISTERS", "SHARED", "STACK", "SPILLS", &occ],
            &rows,
            &[1, 2, 3, 5]
        )
    )?;
    Ok(())
}
