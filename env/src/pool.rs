//! Candidates dispatched to whichever judge is free: one worker per
//! visible GPU of this machine, or the workers of a Dask cluster
//! ([`crate::cluster`]).
//!
//! Each local worker sees only its own GPU (`CUDA_VISIBLE_DEVICES`), so a
//! fault costs that GPU's worker, never another's. Results come back in
//! the candidates' order.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::cluster::{Cluster, Judged};
use crate::evaluator::{
    Candidate, EvalError, Evaluator, ProblemSource, WorkerEvaluator, WorkerSettings,
};
use crate::outcome::Outcome;
use crate::worker::WorkerSlot;

/// Judges over several GPUs, of this machine or of a cluster.
pub struct WorkerPool {
    evaluators: Vec<WorkerEvaluator>,
    cluster: Option<(Arc<Mutex<Cluster>>, WorkerSettings)>,
    each: Option<Box<dyn FnMut(usize)>>,
}

/// One candidate's result and the GPU slot that judged it.
pub struct Dispatched {
    /// The outcome, or why there is none.
    pub result: Result<Outcome, EvalError>,
    /// Index of the slot (and GPU) that ran it: a local worker's, or a
    /// cluster worker's in [`Cluster::workers`] (`usize::MAX` where the
    /// candidate was lost).
    pub slot: usize,
}

impl WorkerPool {
    /// A worker slot per GPU ordinal in `gpus` (none: one slot that sees
    /// every GPU, or the CPU).
    pub fn new(gpus: &[u32], settings: &WorkerSettings) -> WorkerPool {
        let slots: Vec<WorkerSlot> = if gpus.is_empty() {
            vec![WorkerSlot::new(None)]
        } else {
            gpus.iter().map(|&g| WorkerSlot::new(Some(g))).collect()
        };
        WorkerPool::from_slots(slots, settings)
    }

    /// A pool over given slots (tests choose the interpreter).
    pub fn from_slots(slots: Vec<WorkerSlot>, settings: &WorkerSettings) -> WorkerPool {
        WorkerPool {
            evaluators: slots
                .into_iter()
                .map(|s| WorkerEvaluator::new(s, settings.clone()))
                .collect(),
            cluster: None,
            each: None,
        }
    }

    /// A pool over a cluster's workers. Where they have no GPU, candidates
    /// are judged on their CPUs (timed by the host clock). Pools may share
    /// one connection.
    pub fn on_cluster(cluster: Arc<Mutex<Cluster>>, settings: &WorkerSettings) -> WorkerPool {
        let on_cpu = cluster.lock().expect("cluster lock").on_cpu();
        let settings = WorkerSettings {
            cpu: settings.cpu || on_cpu,
            // The cache is a folder of this machine, not of the workers':
            // each worker times the baselines of a problem it prepares.
            baseline_cache: None,
            ..settings.clone()
        };
        WorkerPool {
            evaluators: Vec::new(),
            cluster: Some((cluster, settings)),
            each: None,
        }
    }

    /// The local evaluators, one per slot (none on a cluster).
    pub fn evaluators(&self) -> &[WorkerEvaluator] {
        &self.evaluators
    }

    /// The cluster it judges on, if any.
    pub fn cluster(&self) -> Option<MutexGuard<'_, Cluster>> {
        self.cluster
            .as_ref()
            .map(|c| c.0.lock().expect("cluster lock"))
    }

    /// How many candidates it judges at once.
    pub fn slots(&self) -> usize {
        match &self.cluster {
            Some((c, _)) => c.lock().expect("cluster lock").workers.len().max(1),
            None => self.evaluators.len(),
        }
    }

    /// Calls `each` with a candidate's index as soon as its outcome is in
    /// (a progress bar's tick).
    pub fn on_each(&mut self, each: Box<dyn FnMut(usize)>) {
        self.each = Some(each);
    }

    /// Screens the next candidates with `calls` timed calls (none: the
    /// full protocol), on every slot.
    pub fn set_screen(&mut self, calls: Option<u32>) {
        for ev in &mut self.evaluators {
            ev.settings.screen = calls;
        }
        if let Some((_, s)) = &mut self.cluster {
            s.screen = calls;
        }
    }

    /// Evaluates every candidate, each slot taking the next one as soon as
    /// it is free. Must run inside a tokio `LocalSet`-capable runtime
    /// (`current_thread` is enough): the slots run concurrently on one
    /// thread while their processes work in parallel. On a cluster it
    /// blocks the thread until the last outcome is in.
    pub async fn evaluate_all(
        &mut self,
        problem: &ProblemSource,
        candidates: Vec<Candidate>,
    ) -> Vec<Dispatched> {
        if self.cluster.is_some() {
            return self.evaluate_on_cluster(problem, candidates);
        }
        let total = candidates.len();
        let queue: Rc<RefCell<VecDeque<(usize, Candidate)>>> =
            Rc::new(RefCell::new(candidates.into_iter().enumerate().collect()));
        let results: Rc<RefCell<Vec<Option<Dispatched>>>> =
            Rc::new(RefCell::new((0..total).map(|_| None).collect()));
        let each = Rc::new(RefCell::new(self.each.take()));
        let local = tokio::task::LocalSet::new();
        let evaluators = std::mem::take(&mut self.evaluators);
        let mut handles = Vec::new();
        for (slot, mut ev) in evaluators.into_iter().enumerate() {
            let queue = Rc::clone(&queue);
            let results = Rc::clone(&results);
            let each = Rc::clone(&each);
            let problem = problem.clone();
            handles.push(local.spawn_local(async move {
                loop {
                    let next = queue.borrow_mut().pop_front();
                    let Some((index, candidate)) = next else {
                        break;
                    };
                    let result = ev.evaluate(&problem, &candidate).await;
                    results.borrow_mut()[index] = Some(Dispatched { result, slot });
                    if let Some(f) = each.borrow_mut().as_mut() {
                        f(index);
                    }
                }
                ev
            }));
        }
        let evaluators = local
            .run_until(async move {
                let mut back = Vec::new();
                for h in handles {
                    back.push(h.await.expect("an evaluation task does not panic"));
                }
                back
            })
            .await;
        self.evaluators = evaluators;
        self.each = Rc::try_unwrap(each)
            .ok()
            .expect("every task has finished")
            .into_inner();
        Rc::try_unwrap(results)
            .ok()
            .expect("every task has finished")
            .into_inner()
            .into_iter()
            .map(|r| r.expect("every candidate was taken"))
            .collect()
    }

    fn evaluate_on_cluster(
        &mut self,
        problem: &ProblemSource,
        candidates: Vec<Candidate>,
    ) -> Vec<Dispatched> {
        let (cluster, settings) = self.cluster.as_mut().expect("called on a cluster");
        let mut cluster = cluster.lock().expect("cluster lock");
        // A candidate lost, or judged by no worker the pool knows.
        let lost = usize::MAX;
        let mut results: Vec<Option<Dispatched>> = (0..candidates.len()).map(|_| None).collect();
        // What the worker judges: Python candidates of a problem with code;
        // the others fail here as a local worker fails them.
        let mut sent = Vec::new();
        let mut requests = Vec::new();
        for (i, c) in candidates.iter().enumerate() {
            match c {
                Candidate::Python { name, code } if !problem.code.is_empty() => {
                    let mut r = crate::evaluator::request(settings, "eval", problem);
                    r["candidate"] = serde_json::json!({"name": name, "code": code});
                    requests.push(r);
                    sent.push(i);
                }
                _ => {
                    results[i] = Some(Dispatched {
                        result: Err(EvalError::Unsupported(format!(
                            "a cluster's workers judge Python candidates of problems with PyTorch code; {} is not one",
                            c.name()
                        ))),
                        slot: lost,
                    })
                }
            }
        }
        if !requests.is_empty() {
            let prepare = crate::evaluator::request(settings, "prepare", problem);
            let slot_of = |j: &Judged, workers: &[crate::cluster::ClusterWorker]| {
                workers
                    .iter()
                    .position(|w| w.address == j.worker)
                    .unwrap_or(lost)
            };
            let mut each = self.each.take();
            let judged = cluster.evaluate(
                prepare,
                requests,
                settings.prepare_limit,
                settings.limit,
                &mut |k, _| {
                    if let Some(f) = each.as_mut() {
                        f(sent[k]);
                    }
                },
            );
            self.each = each;
            match judged {
                Ok(judged) => {
                    // The workers as the batch left them (with those that
                    // joined during it).
                    for (k, j) in judged.into_iter().enumerate() {
                        let slot = slot_of(&j, &cluster.workers);
                        results[sent[k]] = Some(Dispatched {
                            result: j.result,
                            slot,
                        });
                    }
                }
                Err(e) => {
                    let why = e.to_string();
                    for &i in &sent {
                        results[i] = Some(Dispatched {
                            result: Err(EvalError::Cluster(why.clone())),
                            slot: lost,
                        });
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every candidate has a result"))
            .collect()
    }
}
