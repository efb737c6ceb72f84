//! The policy network (burn): a two-layer MLP over the observation with a
//! policy head (one logit per move, illegal moves masked) and a value head;
//! checkpoints with burn's recorders.

use std::path::{Path, PathBuf};

use burn::module::{AutodiffModule, Module, Param};
use burn::nn::Linear;
use burn::prelude::*;
use burn::record::{DefaultRecorder, Recorder};
use burn::tensor::activation::{log_softmax, relu};
use serde::{Deserialize, Serialize};

use crate::features::OBS;
use crate::rng::Rng;
use crate::space::ACTIONS;

/// The CPU backend (the default).
pub type Cpu = burn::backend::NdArray<f32>;
/// The CPU backend with autodiff, for training.
pub type CpuTrain = burn::backend::Autodiff<Cpu>;
/// The CUDA backend with autodiff, for training on the GPU machine (the
/// crate's `cuda` feature).
#[cfg(feature = "cuda")]
pub type CudaTrain = burn::backend::Autodiff<burn::backend::Cuda>;

/// Where training runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// burn's `ndarray` backend (the default).
    Cpu,
    /// burn's CUDA backend on GPU `0` (built with the `cuda` feature).
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => Err(format!("`{other}` is not a training device: cpu or cuda")),
        }
    }
}

impl Device {
    /// Whether this build can train there.
    pub fn available(self) -> bool {
        match self {
            Device::Cpu => true,
            Device::Cuda => cfg!(feature = "cuda"),
        }
    }

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// Policy and value heads over a shared trunk.
#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    l1: Linear<B>,
    l2: Linear<B>,
    pi: Linear<B>,
    v: Linear<B>,
}

/// A linear layer `[inputs, outputs]` drawn from `U(-k, k)`, `k =
/// scale / sqrt(inputs)`, from `rng` (so a seed fixes the weights without
/// touching the backend's global generator).
pub(crate) fn linear<B: Backend>(
    inputs: usize,
    outputs: usize,
    scale: f32,
    rng: &mut Rng,
    device: &B::Device,
) -> Linear<B> {
    let k = scale / (inputs as f32).sqrt();
    let mut draw = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| (rng.unit() as f32 * 2.0 - 1.0) * k)
            .collect()
    };
    let w = Tensor::<B, 2>::from_data(
        TensorData::new(draw(inputs * outputs), [inputs, outputs]),
        device,
    );
    let b = Tensor::<B, 1>::from_data(TensorData::new(vec![0.0f32; outputs], [outputs]), device);
    Linear {
        weight: Param::from_tensor(w),
        bias: Some(Param::from_tensor(b)),
    }
}

impl<B: Backend> Net<B> {
    /// A network with `hidden` units per layer, weights from `seed`.
    pub fn new(hidden: usize, seed: u64, device: &B::Device) -> Net<B> {
        let mut rng = Rng::new(seed);
        Net {
            l1: linear(OBS, hidden, 1.0, &mut rng, device),
            l2: linear(hidden, hidden, 1.0, &mut rng, device),
            // Small policy weights: the first policy is close to uniform.
            pi: linear(hidden, ACTIONS, 0.01, &mut rng, device),
            v: linear(hidden, 1, 1.0, &mut rng, device),
        }
    }

    /// Logits `[n, ACTIONS]` and values `[n, 1]` of observations `[n, OBS]`.
    pub fn forward(&self, obs: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let h = relu(self.l1.forward(obs));
        let h = relu(self.l2.forward(h));
        (self.pi.forward(h.clone()), self.v.forward(h))
    }

    /// Log-probabilities `[n, ACTIONS]` with illegal moves at -1e9
    /// (`legal`: true where a move is legal).
    pub fn log_probs(
        &self,
        obs: Tensor<B, 2>,
        legal: Tensor<B, 2, Bool>,
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let (logits, value) = self.forward(obs);
        let logits = logits.mask_fill(legal.bool_not(), -1e9);
        (log_softmax(logits, 1), value)
    }

    /// The move probabilities and value of one observation (masked), as
    /// plain numbers.
    pub fn act(&self, obs: &[f32], mask: &[bool; ACTIONS], device: &B::Device) -> (Vec<f32>, f32) {
        let x = Tensor::<B, 2>::from_data(TensorData::new(obs.to_vec(), [1, OBS]), device);
        let (logits, value) = self.forward(x);
        let logits: Vec<f32> = logits.into_data().to_vec().unwrap_or_default();
        let value: Vec<f32> = value.into_data().to_vec().unwrap_or_default();
        (
            masked_softmax(&logits, mask),
            value.first().copied().unwrap_or(0.0),
        )
    }
}

/// Softmax of `logits` over the legal moves (0 elsewhere).
pub fn masked_softmax(logits: &[f32], mask: &[bool; ACTIONS]) -> Vec<f32> {
    let max = logits
        .iter()
        .zip(mask)
        .filter(|&(_, &m)| m)
        .map(|(&l, _)| l)
        .fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits
        .iter()
        .zip(mask)
        .map(|(&l, &m)| if m { (l - max).exp() } else { 0.0 })
        .collect();
    let sum: f32 = p.iter().sum();
    if sum > 0.0 {
        p.iter_mut().for_each(|x| *x /= sum);
    }
    p
}

/// What a checkpoint directory says of itself (`meta.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Format version of the checkpoint.
    pub format: u32,
    /// Observation length it was trained with.
    pub obs: usize,
    /// Number of moves it was trained with.
    pub actions: usize,
    /// Hidden units.
    pub hidden: usize,
    /// Training iterations done.
    pub iteration: usize,
    /// The training seed.
    pub seed: u64,
    /// The planner's version (crate version and iteration).
    pub version: String,
    /// The other members of a committee (`mtmc train --members`):
    /// checkpoint folders inside this one, trained with other seeds. The
    /// committee acts on the mean of its members' probabilities.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<String>,
    /// PPO's settings it was trained with, so that a resumed run goes on
    /// with them (absent in checkpoints of earlier builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ppo: Option<crate::settings::PpoConfig>,
    /// The problems it was trained on: their count and a digest of their
    /// names ([`crate::train::problems_digest`]), so that a resumed run
    /// trains on the same ones (absent in checkpoints of earlier builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problems: Option<String>,
}

/// The trained planner's policy: one network, or a committee of networks
/// trained alike with different seeds, acting on the mean of their
/// move probabilities (which evens out what one seed's training happened
/// to prefer).
pub struct Committee<B: Backend> {
    nets: Vec<Net<B>>,
}

impl<B: Backend> Committee<B> {
    /// A committee of `nets` (not empty).
    pub fn new(nets: Vec<Net<B>>) -> Committee<B> {
        assert!(!nets.is_empty(), "a committee has a member");
        Committee { nets }
    }

    /// How many networks it has.
    pub fn len(&self) -> usize {
        self.nets.len()
    }

    /// Never: a committee has a member.
    pub fn is_empty(&self) -> bool {
        self.nets.is_empty()
    }

    /// The mean of the members' move probabilities over the legal moves.
    pub fn act(&self, obs: &[f32], mask: &[bool; ACTIONS], device: &B::Device) -> Vec<f32> {
        let mut mean = vec![0.0f32; ACTIONS];
        for net in &self.nets {
            let (p, _) = net.act(obs, mask, device);
            mean.iter_mut().zip(p).for_each(|(m, x)| *m += x);
        }
        let n = self.nets.len() as f32;
        mean.iter_mut().for_each(|m| *m /= n);
        mean
    }
}

/// Checkpoint files in a directory: `meta.json`, `policy.mpk`, and
/// `optimizer.mpk` while training.
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
}

/// A checkpoint error, naming the directory and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing failed.
    #[error("checkpoint `{dir}`: {what}")]
    Io {
        /// The directory.
        dir: PathBuf,
        /// What failed.
        what: String,
    },
    /// Trained for another observation or action space.
    #[error(
        "checkpoint `{dir}` was trained for {obs} features and {actions} moves; this mtmc has {OBS} and {ACTIONS}: train a new one with `mtmc train`"
    )]
    Mismatch {
        /// The directory.
        dir: PathBuf,
        /// Its observation length.
        obs: usize,
        /// Its action count.
        actions: usize,
    },
}

impl Checkpoint {
    /// The checkpoint in `dir`.
    pub fn at(dir: &Path) -> Checkpoint {
        Checkpoint {
            dir: dir.to_path_buf(),
        }
    }

    fn io(&self, what: impl std::fmt::Display) -> CheckpointError {
        CheckpointError::Io {
            dir: self.dir.clone(),
            what: what.to_string(),
        }
    }

    /// Whether a checkpoint is there.
    pub fn exists(&self) -> bool {
        self.dir.join("meta.json").is_file()
    }

    /// Reads `meta.json` and checks it fits this build.
    pub fn meta(&self) -> Result<Meta, CheckpointError> {
        let text = std::fs::read_to_string(self.dir.join("meta.json")).map_err(|e| {
            self.io(format!(
                "cannot read meta.json: {e} (is this a checkpoint written by `mtmc train`?)"
            ))
        })?;
        let meta: Meta =
            serde_json::from_str(&text).map_err(|e| self.io(format!("meta.json: {e}")))?;
        if meta.obs != OBS || meta.actions != ACTIONS {
            return Err(CheckpointError::Mismatch {
                dir: self.dir.clone(),
                obs: meta.obs,
                actions: meta.actions,
            });
        }
        Ok(meta)
    }

    /// Writes the network (and the optimizer's record, when given) with
    /// its meta. Files are written under temporary names and renamed, so
    /// an interrupted save leaves the previous checkpoint whole.
    pub fn save<B: Backend, R: burn::record::Record<B>>(
        &self,
        net: &Net<B>,
        optimizer: Option<R>,
        meta: &Meta,
    ) -> Result<(), CheckpointError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| self.io(format!("cannot create it: {e}")))?;
        let recorder = DefaultRecorder::new();
        net.clone()
            .save_file(self.dir.join("policy.tmp"), &recorder)
            .map_err(|e| self.io(format!("cannot write the policy: {e}")))?;
        if let Some(o) = optimizer {
            recorder
                .record(o, self.dir.join("optimizer.tmp"))
                .map_err(|e| self.io(format!("cannot write the optimizer: {e}")))?;
        }
        for (from, to) in [
            ("policy.tmp.mpk", "policy.mpk"),
            ("optimizer.tmp.mpk", "optimizer.mpk"),
        ] {
            let from = self.dir.join(from);
            if from.exists() {
                std::fs::rename(&from, self.dir.join(to)).map_err(|e| self.io(e))?;
            }
        }
        // The meta last: it says the weights beside it are whole.
        self.write_meta(meta)
    }

    /// Loads the network (for acting: any backend).
    pub fn load<B: Backend>(&self, device: &B::Device) -> Result<(Net<B>, Meta), CheckpointError> {
        let meta = self.meta()?;
        let net = Net::<B>::new(meta.hidden, 0, device)
            .load_file(self.dir.join("policy"), &DefaultRecorder::new(), device)
            .map_err(|e| self.io(format!("cannot read policy.mpk: {e}")))?;
        Ok((net, meta))
    }

    /// Loads the policy with the committee's other members, if it has
    /// any (for acting: any backend).
    pub fn load_committee<B: Backend>(
        &self,
        device: &B::Device,
    ) -> Result<(Committee<B>, Meta), CheckpointError> {
        let (net, meta) = self.load::<B>(device)?;
        let mut nets = vec![net];
        for m in &meta.members {
            let member = Checkpoint::at(&self.dir.join(m));
            if !member.exists() {
                return Err(self.io(format!(
                    "its member `{m}` is missing: copy the whole folder, or train it again with `mtmc train --resume`"
                )));
            }
            let (net, m_meta) = member.load::<B>(device)?;
            if m_meta.iteration != meta.iteration {
                return Err(self.io(format!(
                    "its member `{m}` has trained {} of {} iterations: finish it with `mtmc train --resume`",
                    m_meta.iteration, meta.iteration
                )));
            }
            nets.push(net);
        }
        Ok((Committee::new(nets), meta))
    }

    /// The weight files of the policy and its committee's members, in
    /// order (what a digest of the checkpoint reads).
    pub fn policy_files(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        let meta = self.meta()?;
        Ok(std::iter::once(self.dir.clone())
            .chain(meta.members.iter().map(|m| self.dir.join(m)))
            .map(|d| d.join("policy.mpk"))
            .collect())
    }

    /// Rewrites `meta.json` alone (under a temporary name, then renamed).
    pub fn write_meta(&self, meta: &Meta) -> Result<(), CheckpointError> {
        let text = serde_json::to_string_pretty(meta).map_err(|e| self.io(e))? + "\n";
        let tmp = self.dir.join("meta.tmp");
        std::fs::write(&tmp, text).map_err(|e| self.io(e))?;
        std::fs::rename(&tmp, self.dir.join("meta.json")).map_err(|e| self.io(e))
    }

    /// Loads the optimizer's record, if one was saved.
    pub fn load_optimizer<B: Backend, R: burn::record::Record<B>>(
        &self,
        device: &B::Device,
    ) -> Result<Option<R>, CheckpointError> {
        if !self.dir.join("optimizer.mpk").is_file() {
            return Ok(None);
        }
        DefaultRecorder::new()
            .load(self.dir.join("optimizer"), device)
            .map(Some)
            .map_err(|e| self.io(format!("cannot read optimizer.mpk: {e}")))
    }
}

/// The network without autodiff, for acting.
pub fn for_acting<B: burn::tensor::backend::AutodiffBackend>(net: &Net<B>) -> Net<B::InnerBackend> {
    net.valid()
}
