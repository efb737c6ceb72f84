//! PPO on a small synthetic trajectory tree: two problems whose best
//! programs need different moves, so the policy must read the observation.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use mtmc_env::outcome::Status;
use mtmc_planner::critique::{Diagnosis, Limit};
use mtmc_planner::features::{GRAPH, Problem};
use mtmc_planner::policy::{Checkpoint, Cpu, CpuTrain, Device, Meta};
use mtmc_planner::ppo::{Ppo, PpoConfig, rollout};
use mtmc_planner::rng::Rng;
use mtmc_planner::space::{ACTIONS, Config, Move, Shape};
use mtmc_planner::train::Run;
use mtmc_planner::tree::{TreeEnv, TreeProblem};

fn diag(speedup: Option<f64>) -> Diagnosis {
    let mut d = Diagnosis::failed_to_build("", true);
    match speedup {
        Some(s) => {
            d.status = Status::Correct;
            d.compile_kind = None;
            d.speedup_eager = Some(s);
            d.limit = Limit::Memory;
        }
        None => {
            d.status = Status::Incorrect;
            d.compile_kind = None;
        }
    }
    d
}

/// Every program reachable in `depth` moves, with the speedup `f` gives it
/// (`None`: wrong).
fn tree(name: &str, flag: f32, depth: usize, f: impl Fn(&Config) -> Option<f64>) -> TreeProblem {
    let shape = Shape::plain(2, false);
    let mut evals = BTreeMap::new();
    let mut seen = BTreeSet::new();
    let mut queue = VecDeque::from([(Config::library(shape), 0)]);
    while let Some((c, d)) = queue.pop_front() {
        if !seen.insert(c.key()) {
            continue;
        }
        evals.insert(c.key(), diag(f(&c)));
        if d < depth {
            for m in Move::all() {
                if let Some(n) = c.apply(m, shape) {
                    queue.push_back((n, d + 1));
                }
            }
        }
    }
    let mut features = vec![0.0; GRAPH];
    features[0] = flag;
    TreeProblem {
        problem: Problem {
            name: name.into(),
            pattern: "pointwise*2".into(),
            features,
            shape,
            memory_bound: true,
        },
        evals,
        prior: [0.0; ACTIONS],
    }
}

/// Problem A rewards vectorizing, problem B retiling to 512 threads (its
/// vectorized programs are wrong).
fn problems() -> Arc<Vec<TreeProblem>> {
    let base = |c: &Config| {
        let k = c.kernels.iter().filter(|&&k| k).count() as f64;
        1.0 + 0.2 * k - if c.fuse { 0.0 } else { 0.1 }
    };
    let a = tree("A", 0.0, 4, move |c| {
        Some(
            base(c)
                * if c.vector == 4 { 1.6 } else { 1.0 }
                * if c.block == 128 { 0.9 } else { 1.0 },
        )
    });
    let b = tree("B", 1.0, 4, move |c| {
        if c.vector != 1 && c.kernels.iter().any(|&k| k) {
            return None;
        }
        Some(base(c) * if c.block == 512 { 1.5 } else { 1.0 })
    });
    Arc::new(vec![a, b])
}

fn greedy_best(
    net: &mtmc_planner::policy::Net<Cpu>,
    problems: &Arc<Vec<TreeProblem>>,
    steps: usize,
) -> Vec<f64> {
    let mut env = TreeEnv::new(problems.clone(), steps, 0);
    (0..problems.len())
        .map(|k| {
            env.start(k);
            let mut rng = Rng::new(0);
            loop {
                let obs = burn::rl::Environment::state(&env);
                let (p, _) = net.act(&obs.features, &obs.mask, &Default::default());
                let a = p
                    .iter()
                    .enumerate()
                    .max_by(|x, y| x.1.total_cmp(y.1))
                    .map(|(i, _)| i)
                    .unwrap();
                let _ = rng.unit();
                if burn::rl::Environment::step(&mut env, a).done {
                    break;
                }
            }
            env.episode().best_speedup()
        })
        .collect()
}

#[test]
fn ppo_learns_the_best_programs_of_a_synthetic_tree() {
    let problems = problems();
    let optimum: Vec<f64> = problems.iter().map(TreeProblem::best).collect();
    // Budget 3: kernels, then the one move that pays on each problem.
    let steps = 3;
    let config = PpoConfig {
        episodes: 32,
        hidden: 64,
        max_steps: steps,
        lr: 3e-3,
        entropy_coef: 0.01,
        seed: 7,
        ..PpoConfig::default()
    };
    let device = Default::default();
    let mut ppo = Ppo::<CpuTrain>::new(config.clone(), &device);
    let mut env = TreeEnv::new(problems.clone(), steps, 1);
    let mut rng = Rng::new(3);
    let (_, before) = rollout(&ppo.acting(), &mut env, 64, false, &mut rng, &device);
    let mean = |s: &[mtmc_planner::ppo::EpisodeSummary]| {
        s.iter().map(|e| e.ret).sum::<f64>() / s.len() as f64
    };
    let before_ret = mean(&before);
    for _ in 0..40 {
        let (t, _) = rollout(
            &ppo.acting(),
            &mut env,
            config.episodes,
            false,
            &mut rng,
            &device,
        );
        ppo.update(&t, &mut rng);
    }
    let (_, after) = rollout(&ppo.acting(), &mut env, 64, false, &mut rng, &device);
    let after_ret = mean(&after);
    let best = greedy_best(&ppo.acting(), &problems, steps);
    eprintln!(
        "optimum {optimum:?}, greedy after training {best:?}, mean return {before_ret:.3} -> {after_ret:.3}"
    );
    assert!(
        after_ret > before_ret + 0.2,
        "return {before_ret:.3} -> {after_ret:.3}"
    );
    for (b, o) in best.iter().zip(&optimum) {
        assert!(
            *b >= 0.95 * o,
            "greedy policy found {b:.3} of {o:.3}: {best:?}"
        );
    }

    // The checkpoint round trip keeps every weight: the same probabilities.
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoint::at(dir.path());
    let meta = Meta {
        format: 1,
        obs: mtmc_planner::features::OBS,
        actions: ACTIONS,
        hidden: config.hidden,
        iteration: 40,
        seed: config.seed,
        version: "test".into(),
        members: Vec::new(),
        ppo: Some(config.clone()),
        problems: None,
    };
    ck.save(&ppo.acting(), None::<()>, &meta).unwrap();
    let (loaded, back) = ck.load::<Cpu>(&device).unwrap();
    assert_eq!(back, meta);
    env.start(1);
    let obs = burn::rl::Environment::state(&env);
    let (p0, v0) = ppo.acting().act(&obs.features, &obs.mask, &device);
    let (p1, v1) = loaded.act(&obs.features, &obs.mask, &device);
    assert_eq!((p0.clone(), v0), (p1, v1));

    // A committee: the trained policy and an untrained one in `member-2`
    // act on the mean of their probabilities; a missing member is named.
    let other = mtmc_planner::policy::Net::<Cpu>::new(config.hidden, 99, &device);
    Checkpoint::at(&dir.path().join("member-2"))
        .save(&other, None::<()>, &meta)
        .unwrap();
    ck.write_meta(&Meta {
        members: vec!["member-2".into()],
        ..meta.clone()
    })
    .unwrap();
    let (committee, back) = ck.load_committee::<Cpu>(&device).unwrap();
    assert_eq!((committee.len(), back.members.len()), (2, 1));
    let (q, _) = other.act(&obs.features, &obs.mask, &device);
    let mean = committee.act(&obs.features, &obs.mask, &device);
    assert!(q.iter().zip(&p0).any(|(a, b)| (a - b).abs() > 1e-3));
    for ((m, a), b) in mean.iter().zip(&p0).zip(&q) {
        assert!((m - (a + b) / 2.0).abs() < 1e-6, "{m} against {a} and {b}");
    }
    // A member trained for fewer iterations than the folder (a committee
    // cut short) is refused.
    Checkpoint::at(&dir.path().join("member-2"))
        .write_meta(&Meta {
            iteration: 7,
            ..meta.clone()
        })
        .unwrap();
    let err = ck.load_committee::<Cpu>(&device).err().unwrap().to_string();
    assert!(
        err.contains("`member-2` has trained 7 of 40 iterations") && err.contains("--resume"),
        "{err}"
    );
    let files = ck.policy_files().unwrap();
    assert_eq!(files[1], dir.path().join("member-2").join("policy.mpk"));
    std::fs::remove_dir_all(dir.path().join("member-2")).unwrap();
    let err = ck.load_committee::<Cpu>(&device).err().unwrap().to_string();
    assert!(err.contains("member `member-2` is missing"), "{err}");
}

#[test]
fn a_seeded_run_is_reproducible_and_a_resumed_run_continues_it_exactly() {
    let problems = problems();
    let config = PpoConfig {
        episodes: 8,
        hidden: 32,
        max_steps: 3,
        seed: 11,
        ..PpoConfig::default()
    };
    let strip = |rows: Vec<mtmc_planner::train::CurveRow>| -> Vec<String> {
        rows.into_iter()
            .map(|r| {
                format!(
                    "{} {} {} {} {} {}",
                    r.iteration,
                    r.mean_return,
                    r.best_speedup,
                    r.entropy,
                    r.value_loss,
                    r.policy_loss
                )
            })
            .collect()
    };
    // A run of `iterations` that a stop asked for ends after iteration
    // `stop` (0: none).
    let run = |dir: &std::path::Path, iterations: usize, resume: bool, stop: usize| {
        strip(
            mtmc_planner::train::train(
                Device::Cpu,
                Run {
                    problems: problems.clone(),
                    config: &config,
                    iterations,
                    dir,
                    resume,
                    members: Vec::new(),
                },
                |r| match r.iteration == stop {
                    true => std::ops::ControlFlow::Break(()),
                    false => std::ops::ControlFlow::Continue(()),
                },
            )
            .unwrap(),
        )
    };
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let whole = run(a.path(), 4, false, 0);
    assert_eq!(whole, run(b.path(), 4, false, 0), "same seed, same curves");
    // Stopped after 2 of 4 iterations, then resumed.
    let stopped = run(c.path(), 4, false, 2);
    assert_eq!(stopped, whole[..2]);
    let csv = std::fs::read_to_string(c.path().join("curves.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    let resumed = run(c.path(), 4, true, 0);
    assert_eq!(whole, resumed);
    let csv = std::fs::read_to_string(c.path().join("curves.csv")).unwrap();
    assert_eq!(csv.lines().count(), 5, "{csv}");
    // Resumed with other settings, on other problems or to fewer
    // iterations than it holds, it is refused and left as it was (other
    // hidden units loaded the checkpoint's network under a meta that
    // named the new size).
    let resume_err = |config: &PpoConfig, problems: Arc<Vec<TreeProblem>>, iterations: usize| {
        mtmc_planner::train::train(
            Device::Cpu,
            Run {
                problems,
                config,
                iterations,
                dir: c.path(),
                resume: true,
                members: Vec::new(),
            },
            |_| std::ops::ControlFlow::Continue(()),
        )
        .expect_err("refused")
        .to_string()
    };
    let wider = PpoConfig {
        hidden: 64,
        gamma: 0.9,
        ..config.clone()
    };
    let err = resume_err(&wider, problems.clone(), 6);
    assert!(
        err.contains("other settings (--gamma 0.9 here, 0.99 there, --hidden 64 here, 32 there)"),
        "{err}"
    );
    let fewer = Arc::new(problems[..1].to_vec());
    let err = resume_err(&config, fewer, 6);
    assert!(
        err.contains("was trained on 2 problems (names ")
            && err.contains("this run has 1 problems"),
        "{err}"
    );
    let err = resume_err(&config, problems.clone(), 3);
    assert!(
        err.contains("holds 4 iterations, more than --iterations 3"),
        "{err}"
    );
    let meta = Checkpoint::at(c.path()).meta().unwrap();
    assert_eq!((meta.iteration, meta.ppo.as_ref()), (4, Some(&config)));
    // A checkpoint of an earlier build (no settings kept) is checked on
    // the hidden units and the seed it names.
    Checkpoint::at(c.path())
        .write_meta(&Meta {
            ppo: None,
            problems: None,
            ..meta
        })
        .unwrap();
    let err = resume_err(&wider, problems.clone(), 6);
    assert!(err.contains("(--hidden 64 here, 32 there)"), "{err}");
}

#[test]
fn the_tree_charges_the_step_cost_it_is_given() {
    use burn::rl::Environment;
    use mtmc_planner::episode::Reward;
    let m = Move::CallLibrary(mtmc_planner::space::Slot::All).index();
    let first = |reward: Option<Reward>| {
        let mut env = TreeEnv::new(problems(), 4, 0);
        if let Some(r) = reward {
            env = env.with_reward(r);
        }
        env.start(0);
        assert!(env.state().mask[m]);
        env.step(m).reward
    };
    let free = first(None);
    let costly = first(Some(Reward {
        step: -0.25,
        ..Reward::default()
    }));
    // The library program is the first correct one (0.9x: no gain).
    assert!((free - 0.1).abs() < 1e-12, "{free}");
    assert!((costly - (free - 0.25)).abs() < 1e-12, "{costly}");
}

/// An ablation (`compare --without`): without vectorize, problem A's best
/// (vector width 4, 1.6x the rest) is out of reach, and no episode of the
/// environment is offered a vectorize move; leaving out a kind its best
/// does not need keeps the best.
#[test]
fn leaving_a_move_kind_out_hides_the_programs_only_it_reaches() {
    let problems = problems();
    let a = &problems[0];
    let none = [false; ACTIONS];
    let (all, reached) = a.best_without(&none);
    assert!((all - a.best()).abs() < 1e-12, "{all} against {}", a.best());
    assert!(reached > 1 && reached <= a.evals.len(), "{reached}");

    let no_vector = mtmc_planner::space::of_kinds(&["vectorize"]);
    assert!(!no_vector[Move::Stop.index()]);
    assert!(no_vector[Move::Vectorize(4).index()] && !no_vector[Move::Retile(512).index()]);
    let (without, fewer) = a.best_without(&no_vector);
    assert!(without < all / 1.5, "{without} against {all}");
    assert!(fewer < reached, "{fewer} of {reached}");
    let (same, _) = a.best_without(&mtmc_planner::space::of_kinds(&["split"]));
    assert!((same - all).abs() < 1e-12, "{same} against {all}");

    let mut env = TreeEnv::new(problems.clone(), 8, 0).without(no_vector);
    env.start(0);
    let mut rng = Rng::new(3);
    loop {
        let obs = burn::rl::Environment::state(&env);
        assert!(
            Move::all().all(|m| !(obs.mask[m.index()] && m.kind() == "vectorize")),
            "a vectorize move was legal"
        );
        let legal: Vec<usize> = (0..ACTIONS).filter(|&i| obs.mask[i]).collect();
        let a = legal[rng.below(legal.len())];
        if burn::rl::Environment::step(&mut env, a).done {
            break;
        }
    }
    assert!(env.episode().best_speedup() <= without + 1e-12);
}
