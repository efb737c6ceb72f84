_LAYOUT = []


def _channels_last(x):
    memory_format = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    if not x.is_cuda or x.dtype != torch.float32 or x.shape[0] > 65535 or not x.is_contiguous():
        return x.contiguous(memory_format=memory_format)
    import cupy
    if not _LAYOUT:
        _LAYOUT.append(cupy.RawModule(code=_LAYOUT_SOURCE, options=("--std=c++17",)).get_function("mtmc_to_channels_last"))
    n, c = x.shape[0], x.shape[1]
    s = x[0, 0].numel()
    y = torch.empty_like(x, memory_format=memory_format)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        _LAYOUT[0](((s + 31) // 32, (c + 31) // 32, n), (32, 8, 1), (cupy.uint64(x.data_ptr()), cupy.uint64(y.data_ptr()), cupy.int64(c), cupy.int64(s)))
    return y
