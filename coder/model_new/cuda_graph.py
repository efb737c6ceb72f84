def _arg_key(v):
    if isinstance(v, torch.Tensor):
        return (v.data_ptr(), tuple(v.shape), v.stride(), v.dtype, v.device)
    return repr(v)


# Counts every parameter, buffer and submodule registered on any module
# (assigned, registered or loaded with assign=True), so that the graph's
# key can read a list of the model's tensors made once instead of walking
# its modules on every call. One count per process, kept on torch's module
# module: its hooks are registered by the first program loaded, not again
# by each (a hook holds its program's namespace).
_REGISTRATIONS = getattr(torch.nn.modules.module, "_mtmc_registrations", None)
if _REGISTRATIONS is None:
    _REGISTRATIONS = torch.nn.modules.module._mtmc_registrations = [0]

    def _registered(*_, count=_REGISTRATIONS):
        count[0] += 1

    torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
    torch.nn.modules.module.register_module_buffer_registration_hook(_registered)
    torch.nn.modules.module.register_module_module_registration_hook(_registered)


def _graph_key(model, args, kwargs):
    if model._graph_tensors is None or model._graph_tensors[0] != _REGISTRATIONS[0]:
        model._graph_tensors = (
            _REGISTRATIONS[0],
            list(model.parameters()) + list(model.buffers()),
        )
    return (
        tuple(_arg_key(v) for v in args),
        tuple(sorted((k, _arg_key(v)) for k, v in kwargs.items())),
        model._graph_tensors[0],
        tuple((t.data_ptr(), t._version) for t in model._graph_tensors[1]),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.enabled,
        torch.backends.cudnn.deterministic,
        torch.get_float32_matmul_precision(),
    )


def _copy_out(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_copy_out(x) for x in v)
    return v


def _replay(model, args, kwargs):
    on_gpu = [v.is_cuda for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)]
    if not on_gpu or not all(on_gpu):
        return model._forward(*args, **kwargs)
    with torch.no_grad():
        if model._graph_key != _graph_key(model, args, kwargs):
            model._graph = model._graph_out = model._graph_key = None
            kept = [b.clone() for b in model.buffers()]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model._forward(*args, **kwargs)
            torch.cuda.current_stream().wait_stream(side)
            for b, k in zip(model.buffers(), kept):
                b.copy_(k)
            del kept
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model._forward(*args, **kwargs)
            model._graph, model._graph_out = graph, out
            model._graph_key = _graph_key(model, args, kwargs)
        model._graph.replay()
        return _copy_out(model._graph_out)
