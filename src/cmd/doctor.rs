//! `mtmc doctor`: what this machine has, and how to get what is missing.

use anyhow::Result;

/// Prints each check and its fix.
pub fn run(out: &mut dyn std::io::Write) -> Result<()> {
    let checks = mtmc_env::probe::doctor();
    let width = checks.iter().map(|c| c.component.len()).max().unwrap_or(0);
    for c in &checks {
        let mark = if c.ok { "ok     " } else { "missing" };
        writeln!(out, "{mark}  {:width$}  {}", c.component, c.detail)?;
        if let Some(fix) = &c.fix {
            writeln!(out, "         {:width$}  fix: {fix}", "")?;
        }
    }
    let missing = checks.iter().filter(|c| !c.ok).count();
    if missing == 0 {
        writeln!(out, "\neverything mtmc uses is here")?;
    } else {
        writeln!(
            out,
            "\n{missing} missing; without a GPU, mtmc still lists problems and shows their graphs"
        )?;
    }
    Ok(())
}
