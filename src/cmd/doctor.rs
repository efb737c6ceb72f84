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
    writeln!(out, "\nevaluators:")?;
    for (kind, state) in mtmc_env::evaluator::available(&checks) {
        match state {
            Ok(what) => writeln!(out, "  {:<13} yes  {what}", kind.name())?,
            Err(why) => writeln!(out, "  {:<13} no   {why}", kind.name())?,
        }
    }
    match mtmc_env::worker::network_isolation() {
        mtmc_env::worker::Isolation::Unshare(flags) => writeln!(
            out,
            "  workers run without a network (unshare {})",
            flags.join(" ")
        )?,
        mtmc_env::worker::Isolation::None(why) => {
            writeln!(out, "  workers are not cut off from the network: {why}")?
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
