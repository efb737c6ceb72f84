//! mtmc: a macro-thinking / micro-coding engine that writes fast GPU kernels.
//!
//! This binary is thin: it parses flags, wires the library crates together
//! and prints results. See ARCHITECTURE.md for the map.

mod cli;
mod cmd;

use mtmc_search::interrupt;

use std::io::Write as _;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser as _, ValueEnum as _};

use cli::{Cli, CoderKind, Command};

fn run(cli: Cli, out: &mut dyn std::io::Write) -> Result<()> {
    let kb = cli.kernelbench.as_deref();
    if let Some(address) = &cli.cluster {
        let judges = match &cli.command {
            Command::Explore { .. }
            | Command::Bench { .. }
            | Command::Rejudge { .. }
            | Command::Optimize { .. }
            | Command::Eval { .. } => true,
            Command::Compare { live, .. } => *live,
            _ => false,
        };
        if !judges {
            anyhow::bail!(
                "--cluster (or MTMC_CLUSTER): this command judges nothing; explore, bench, rejudge, compare --live, optimize and eval judge on a cluster"
            );
        }
        mtmc_search::cluster::connect(out, address)
            .with_context(|| format!("--cluster {address}"))?;
    }
    match cli.command {
        Command::Problems { level } => cmd::problems::run(out, kb, level),
        Command::Show { subject, device } => {
            let subject = subject.resolve(kb)?;
            cmd::show::run(out, subject, device.as_deref())
        }
        Command::Compile { file, block } => cmd::compile::run(out, &file, block),
        Command::Eval {
            subject,
            candidates,
            evaluator,
            trials,
            timeout,
            baselines,
            fresh_baselines,
            host_inputs,
            cpu,
            strict,
            eager_alone,
            screen,
            json,
        } => {
            let baselines: Vec<String> = baselines.into_iter().filter(|b| b != "none").collect();
            if let Some(bad) = baselines
                .iter()
                .find(|b| !matches!(b.as_str(), "eager" | "compile"))
            {
                anyhow::bail!(
                    "--baselines: `{bad}` is not a baseline (use eager, compile or none)"
                );
            }
            cmd::eval::run(
                out,
                cmd::eval::Request {
                    subject: subject.resolve(kb)?,
                    candidates: &candidates,
                    evaluator,
                    trials,
                    timeout: std::time::Duration::from_secs(timeout),
                    baselines,
                    baseline_cache: !fresh_baselines,
                    host_inputs,
                    cpu,
                    strict,
                    paired_eager: !eager_alone,
                    screen,
                    json: json.as_deref(),
                },
            )
        }
        Command::Optimize {
            subject,
            out: out_dir,
            timeout,
            target,
            coder,
            critic,
            repairs,
            verbose,
            strict,
            planner,
            budget,
            trajectories,
            seed,
            policy_stops,
            llm,
        } => {
            // Flags the template coder has no use for are refused, not
            // dropped: the run would not be the one asked for.
            let needs_llm = coder == CoderKind::Llm || subject.intent_text.is_some();
            let mut unused = if needs_llm { vec![] } else { llm.given() };
            if repairs.is_some() && coder != CoderKind::Llm {
                unused.push("--repairs");
            }
            if !unused.is_empty() {
                let (verb, them) = if unused.len() == 1 {
                    ("configures", "it")
                } else {
                    ("configure", "them")
                };
                let fix = if planner.is_some() {
                    format!("--planner drives the template coder: drop {them}")
                } else {
                    format!("add --coder llm, or drop {them}")
                };
                anyhow::bail!(
                    "{} {verb} the LLM coder, and the template coder writes this run: {fix}",
                    unused.join(", ")
                );
            }
            if let Some(planner) = planner {
                if strict {
                    anyhow::bail!(
                        "--strict works with the built-in search: drop --planner (the planner's moves include calling the library, and its report lists the library calls)"
                    );
                }
                if coder != CoderKind::Template || target != mtmc_search::optimize::Target::Cuda {
                    anyhow::bail!(
                        "--planner drives the template coder's CUDA kernels: drop --coder llm and --target triton"
                    );
                }
                let Some(name) = subject.problem.as_deref() else {
                    anyhow::bail!(
                        "--planner searches KernelBench problems; for an intent, drop --planner"
                    );
                };
                return mtmc_search::plan::optimize(
                    out,
                    mtmc_search::plan::OptimizeRequest {
                        stop: catch_signals()?,
                        kernelbench: kb,
                        name,
                        planner,
                        settings: mtmc_search::plan::PlanSettings {
                            budget,
                            near_roofline: 0.9,
                            verbose,
                            reuse: false,
                            rejudge_changed: false,
                            // On a GPU the best program is timed once
                            // more: the best of the search's timings is
                            // the luckiest one.
                            rejudge: true,
                            // The knowledge base the planner trained
                            // with: the training problems'.
                            knowledge: mtmc_search::plan::Split::Train,
                        },
                        store: trajectories.as_deref(),
                        out_dir: &out_dir,
                        timeout: std::time::Duration::from_secs(timeout),
                        seed,
                        policy_stops,
                    },
                );
            }
            if coder == CoderKind::Template && critic != mtmc_search::optimize::Critic::Rules {
                anyhow::bail!(
                    "--critic {} steers the LLM coder: add --coder llm (the template coder takes no critique)",
                    critic
                        .to_possible_value()
                        .map_or_else(String::new, |v| v.get_name().to_string())
                );
            }
            let client =
                if needs_llm {
                    Some(llm.client(&cmd::llm::run_id()).context(
                        "--coder llm, --critic llm and --intent-text need an LLM endpoint",
                    )?)
                } else {
                    None
                };
            let subject = match (&subject.intent_text, &client) {
                (Some(words), Some(c)) => {
                    let program = cmd::llm::intent_from_text(c, words)?;
                    writeln!(out, "intent written from the text:\n{program}")?;
                    if let Some(path) = &subject.save_intent {
                        std::fs::write(path, &program)
                            .with_context(|| format!("cannot write `{}`", path.display()))?;
                        writeln!(out, "saved to {}", path.display())?;
                    }
                    subject.resolve_text(Some(program))?
                }
                _ => subject.resolve(kb)?,
            };
            let coder = match (coder, client) {
                (CoderKind::Llm, Some(client)) => {
                    mtmc_search::optimize::Coder::Llm(mtmc_search::optimize::LlmRun {
                        client,
                        critic,
                        repairs: repairs.unwrap_or(2),
                        verbose,
                    })
                }
                _ => mtmc_search::optimize::Coder::Template,
            };
            mtmc_search::optimize::run(
                out,
                mtmc_search::optimize::Request {
                    stop: catch_signals()?,
                    subject,
                    out_dir: &out_dir,
                    timeout: std::time::Duration::from_secs(timeout),
                    target,
                    coder,
                    strict,
                },
            )
        }
        Command::Explore {
            problems,
            levels,
            split,
            planner,
            episodes,
            budget,
            trajectories,
            timeout,
            seed,
            beyond,
            shallow_first,
            rejudge_changed,
            screen,
        } => mtmc_search::plan::explore(
            out,
            mtmc_search::plan::ExploreRequest {
                stop: catch_signals()?,
                kernelbench: kb,
                names: &problems,
                levels: &levels,
                split,
                planner,
                episodes,
                budget,
                store: &trajectories,
                timeout: std::time::Duration::from_secs(timeout),
                seed,
                beyond: mtmc_search::plan::Beyond {
                    kinds: &beyond,
                    shallow_first,
                },
                rejudge_changed,
                screening: (screen > 0).then_some(mtmc_search::screen::Screening {
                    calls: screen,
                    ..mtmc_search::screen::Screening::DEFAULT
                }),
            },
        ),
        Command::Rejudge {
            problems,
            levels,
            split,
            trajectories,
            timeout,
            dry_run,
            failed,
            gpu,
        } => mtmc_search::plan::rejudge(
            out,
            mtmc_search::plan::RejudgeRequest {
                stop: catch_signals()?,
                kernelbench: kb,
                names: &problems,
                levels: &levels,
                split,
                store: &trajectories,
                timeout: std::time::Duration::from_secs(timeout),
                dry_run,
                failed,
                gpu: gpu.name.as_deref(),
            },
        ),
        Command::Train {
            trajectories,
            out: out_dir,
            iterations,
            episodes,
            budget,
            hidden,
            lr,
            step_cost,
            gamma,
            members,
            seed,
            resume,
            device,
            validation,
            gpu,
        } => mtmc_search::plan::train(
            out,
            mtmc_search::plan::TrainRequest {
                stop: catch_signals()?,
                store: &trajectories,
                out_dir: &out_dir,
                device,
                iterations,
                ppo: mtmc_planner::ppo::PpoConfig {
                    episodes,
                    max_steps: budget,
                    step_cost,
                    gamma,
                    hidden,
                    lr,
                    seed,
                    ..Default::default()
                },
                resume,
                validation,
                members: members as usize,
                gpu: gpu.name.as_deref(),
            },
        ),
        Command::Compare {
            trajectories,
            checkpoint,
            budget,
            split,
            levels,
            json,
            recorded_by,
            without,
            live,
            out: out_dir,
            timeout,
            seed,
            policy_stops,
            pool,
            table_only,
            reuse_baselines,
            side_by_side,
            gpu,
        } => {
            if !live {
                return mtmc_search::plan::compare(
                    out,
                    mtmc_search::plan::CompareRequest {
                        store: &trajectories,
                        checkpoint: checkpoint.as_deref(),
                        budget,
                        split,
                        levels: &levels,
                        recorded_by: recorded_by.as_deref(),
                        json: json.as_deref(),
                        policy_stops,
                        without: &without,
                        gpu: gpu.name.as_deref(),
                    },
                );
            }
            if gpu.name.is_some() {
                anyhow::bail!(
                    "--gpu chooses whose recorded outcomes a replay reads; a live comparison judges on the GPU here and refuses a store of another's: drop --gpu"
                );
            }
            if !without.is_empty() {
                anyhow::bail!(
                    "--without leaves action kinds out of a replay; a live comparison runs the full action space: drop one of --live and --without"
                );
            }
            if recorded_by.is_some() {
                anyhow::bail!(
                    "--recorded-by chooses which recorded outcomes a replay reads; a live comparison judges every program now: drop one of --live and --recorded-by"
                );
            }
            mtmc_search::live::compare_live(
                out,
                mtmc_search::live::LiveRequest {
                    stop: if table_only {
                        interrupt::Interrupt::new()
                    } else {
                        catch_signals()?
                    },
                    kernelbench: kb,
                    store: &trajectories,
                    checkpoint: checkpoint.as_deref(),
                    budget,
                    split,
                    levels: &levels,
                    out_dir: &out_dir,
                    json: json.as_deref(),
                    timeout: std::time::Duration::from_secs(timeout),
                    seed,
                    policy_stops,
                    pool: &pool,
                    table_only,
                    reuse_baselines: reuse_baselines.as_deref(),
                    side_by_side,
                },
            )
        }
        Command::Merge { into, from } => mtmc_search::plan::merge(out, &into, &from),
        Command::LlmCheck { llm } => cmd::llm::check(out, &llm),
        Command::LlmReplay {
            reply,
            port,
            provider,
            model,
        } => cmd::llm::replay(out, port, &reply, &provider, &model),
        Command::Bench {
            problems,
            levels,
            all,
            out: out_dir,
            target,
            timeout,
            fresh,
            strict,
        } => mtmc_search::bench::run(
            out,
            mtmc_search::bench::Request {
                stop: catch_signals()?,
                kernelbench: kb,
                names: &problems,
                levels: &levels,
                all,
                out_dir: &out_dir,
                target,
                timeout: std::time::Duration::from_secs(timeout),
                fresh,
                strict,
            },
        ),
        Command::BenchEnv {
            copies,
            triton_copies,
            no_slow,
            timeout,
            screen,
            json,
        } => mtmc_search::bench_env::run(
            out,
            mtmc_search::bench_env::Request {
                kernelbench: kb,
                copies,
                triton_copies,
                slow: !no_slow,
                timeout: std::time::Duration::from_secs(timeout),
                screen,
                json: json.as_deref(),
            },
        ),
        Command::Doctor => cmd::doctor::run(out),
        Command::NativeWorker => Ok(mtmc_env::native::serve()?),
    }
}

/// An error's context chain on one line, outermost first. A cause its
/// message already ends with (`cannot write `x`: File exists` over `File
/// exists`) is not said twice.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for link in e.chain().map(ToString::to_string) {
        if line.ends_with(&link) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&link);
    }
    line
}

/// Ctrl-C and SIGTERM as a stop the command reads between items of work
/// (a second signal exits at once).
fn catch_signals() -> Result<interrupt::Interrupt> {
    interrupt::Interrupt::catch().context("catching Ctrl-C")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut out = std::io::stdout().lock();
    let result = run(cli, &mut out).and_then(|()| Ok(out.flush()?));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`mtmc show … | head`): not an error.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        // Stopped by Ctrl-C after saying what it finished: 128 + SIGINT.
        Err(e) if e.is::<interrupt::Interrupted>() => {
            eprintln!("{e}");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::from(2)
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use std::io::{Error, ErrorKind};

    use mtmc_planner::train::TrainError;

    #[test]
    fn a_cause_its_message_already_ends_with_is_said_once() {
        let io = TrainError::Io {
            path: "ck".into(),
            source: Error::from(ErrorKind::AlreadyExists),
        };
        let said = Error::from(ErrorKind::AlreadyExists).to_string();
        let e = anyhow::Error::from(io).context("training");
        assert_eq!(
            super::one_line(&e),
            format!("training: cannot write `ck`: {said}")
        );
        // A cause the message does not quote is joined to it.
        let e =
            anyhow::Error::from(Error::from(ErrorKind::AlreadyExists)).context("cannot write `ck`");
        assert_eq!(super::one_line(&e), format!("cannot write `ck`: {said}"));
    }
}
