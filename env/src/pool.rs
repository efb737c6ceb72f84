//! One worker per visible GPU, with candidates dispatched to whichever is
//! free.
//!
//! Each worker sees only its own GPU (`CUDA_VISIBLE_DEVICES`), so a fault
//! costs that GPU's worker, never another's. Results come back in the
//! candidates' order.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use crate::evaluator::{
    Candidate, EvalError, Evaluator, ProblemSource, WorkerEvaluator, WorkerSettings,
};
use crate::outcome::Outcome;
use crate::worker::WorkerSlot;

/// Workers over several GPUs.
pub struct WorkerPool {
    evaluators: Vec<WorkerEvaluator>,
}

/// One candidate's result and the GPU slot that judged it.
pub struct Dispatched {
    /// The outcome, or why there is none.
    pub result: Result<Outcome, EvalError>,
    /// Index of the slot (and GPU) that ran it.
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
        }
    }

    /// The evaluators, one per slot.
    pub fn evaluators(&self) -> &[WorkerEvaluator] {
        &self.evaluators
    }

    /// Screens the next candidates with `calls` timed calls (none: the
    /// full protocol), on every slot.
    pub fn set_screen(&mut self, calls: Option<u32>) {
        for ev in &mut self.evaluators {
            ev.settings.screen = calls;
        }
    }

    /// Evaluates every candidate, each slot taking the next one as soon as
    /// it is free. Must run inside a tokio `LocalSet`-capable runtime
    /// (`current_thread` is enough): the slots run concurrently on one
    /// thread while their processes work in parallel.
    pub async fn evaluate_all(
        &mut self,
        problem: &ProblemSource,
        candidates: Vec<Candidate>,
    ) -> Vec<Dispatched> {
        let total = candidates.len();
        let queue: Rc<RefCell<VecDeque<(usize, Candidate)>>> =
            Rc::new(RefCell::new(candidates.into_iter().enumerate().collect()));
        let results: Rc<RefCell<Vec<Option<Dispatched>>>> =
            Rc::new(RefCell::new((0..total).map(|_| None).collect()));
        let local = tokio::task::LocalSet::new();
        let evaluators = std::mem::take(&mut self.evaluators);
        let mut handles = Vec::new();
        for (slot, mut ev) in evaluators.into_iter().enumerate() {
            let queue = Rc::clone(&queue);
            let results = Rc::clone(&results);
            let problem = problem.clone();
            handles.push(local.spawn_local(async move {
                loop {
                    let next = queue.borrow_mut().pop_front();
                    let Some((index, candidate)) = next else {
                        break;
                    };
                    let result = ev.evaluate(&problem, &candidate).await;
                    results.borrow_mut()[index] = Some(Dispatched { result, slot });
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
        Rc::try_unwrap(results)
            .ok()
            .expect("every task has finished")
            .into_inner()
            .into_iter()
            .map(|r| r.expect("every candidate was taken"))
            .collect()
    }
}
