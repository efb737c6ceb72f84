//! A program as a CUDA program with its launch plan (the native
//! evaluator's candidate): one buffer per graph input and output, scratch
//! for tensors passed between fragments, one launch per fragment.

use std::collections::HashMap;

use mtmc_actions::graph::{OpGraph, TensorRef};
use mtmc_actions::op::Op;
use mtmc_env::native::{Arg, Buffer, CudaProgram, Launch};

use crate::program::{Program, storage};

/// The CUDA program, or why the program cannot be one yet.
pub fn to_cuda_program(g: &OpGraph, p: &Program) -> Result<CudaProgram, String> {
    let missing = p.missing(g);
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().map(|&n| g.node(n).name.as_str()).collect();
        return Err(format!("no fragment computes {}", names.join(", ")));
    }
    let mut buffers = Vec::new();
    let mut buffer_of: HashMap<TensorRef, String> = HashMap::new();
    for (id, node) in g.nodes() {
        if let Op::Input { name } | Op::Param { name, .. } = &node.op {
            buffers.push(Buffer {
                name: name.clone(),
                input: Some(name.clone()),
                output: None,
                bytes: None,
            });
            buffer_of.insert(TensorRef::first(id), name.clone());
        }
    }
    for (k, t) in g.outputs().iter().enumerate() {
        // An output that views a computed tensor is written where that
        // tensor is.
        let t = &storage(g, *t);
        if buffer_of.contains_key(t) {
            return Err(format!(
                "output {k} is an input passed through; there is nothing to compute"
            ));
        }
        let name = format!("out{k}");
        buffers.push(Buffer {
            name: name.clone(),
            input: None,
            output: Some(k),
            bytes: None,
        });
        buffer_of.insert(*t, name);
    }
    for f in &p.fragments {
        for t in &f.outputs {
            if !buffer_of.contains_key(t) {
                let name = format!("t{}", t.node.index());
                buffers.push(Buffer {
                    name: name.clone(),
                    input: None,
                    output: None,
                    bytes: Some(g.tensor(*t).bytes()),
                });
                buffer_of.insert(*t, name);
            }
        }
    }
    let mut launches = Vec::new();
    let mut source = String::new();
    for f in &p.fragments {
        source.push_str(&f.source);
        source.push('\n');
        let mut args = Vec::new();
        for t in f.inputs.iter().chain(&f.outputs) {
            let b = buffer_of.get(&storage(g, *t)).ok_or_else(|| {
                format!(
                    "{} reads `{}`, which nothing before it writes",
                    f.name,
                    g.node(t.node).name
                )
            })?;
            args.push(Arg::Buffer(b.clone()));
        }
        for (kernel, launch) in f.launches() {
            let mut args = args.clone();
            args.extend(launch.sizes.iter().map(|&n| Arg::I64(n)));
            launches.push(Launch {
                kernel: kernel.to_string(),
                grid: [launch.grid, 1, 1],
                block: [launch.block, 1, 1],
                shared_bytes: launch.shared,
                args,
            });
        }
    }
    Ok(CudaProgram {
        source,
        buffers,
        launches,
    })
}
