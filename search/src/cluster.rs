//! The Dask cluster a run judges on (`--cluster ADDRESS`, `MTMC_CLUSTER`):
//! connected once, before the command starts, and shared by every judge
//! the command makes ([`crate::optimize::judge::ProblemJudge`]). Without
//! one, judges run on this machine's GPUs as before.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::Result;
use mtmc_env::cluster::Cluster;

static CLUSTER: OnceLock<Arc<Mutex<Cluster>>> = OnceLock::new();

/// How long to wait for a worker with the resource `judge`, at the start
/// and whenever none is left in the middle of a batch.
const WAIT: Duration = Duration::from_secs(120);

/// Connects to the scheduler at `address`; the command's judges then
/// judge on its workers. Says on `out` where candidates go.
pub fn connect(out: &mut dyn std::io::Write, address: &str) -> Result<()> {
    let cluster = Cluster::connect(address, mtmc_env::python::interpreter(), None, WAIT)?;
    writeln!(
        out,
        "cluster {}: {} worker(s) with the {} judge the candidates{}",
        cluster.address,
        cluster.workers.len(),
        cluster.gpu,
        if cluster.refused.is_empty() {
            String::new()
        } else {
            format!(
                "; refused, another GPU: {}",
                cluster
                    .refused
                    .iter()
                    .map(|w| format!("{} ({})", w.address, w.gpu))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    )?;
    if CLUSTER.set(Arc::new(Mutex::new(cluster))).is_err() {
        anyhow::bail!("a cluster is already connected");
    }
    Ok(())
}

/// The connected cluster, if any.
pub fn shared() -> Option<Arc<Mutex<Cluster>>> {
    CLUSTER.get().cloned()
}

/// The run's GPU on the cluster, as its workers' driver names it (`cpu`
/// where they have none).
pub fn gpu() -> Option<String> {
    CLUSTER
        .get()
        .map(|c| c.lock().expect("cluster lock").gpu.clone())
}

/// The driver's answer for one GPU known by its name alone (a cluster's
/// workers' GPU, as their driver names it).
pub(crate) fn driver_named(name: &str) -> mtmc_env::probe::Driver {
    mtmc_env::probe::Driver {
        cuda_version: (0, 0),
        gpus: vec![mtmc_env::probe::Gpu {
            name: name.to_string(),
            compute_capability: (0, 0),
            memory_bytes: 0,
        }],
    }
}

/// Where a run's candidates are judged, for its first line: on the
/// cluster's workers (naming their GPU) or on this machine's GPU.
pub(crate) fn judged_on() -> String {
    match gpu() {
        Some(g) => format!("judged on the cluster's workers with the {g}"),
        None => "judged on the GPU".into(),
    }
}
