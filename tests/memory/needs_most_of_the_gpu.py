# Not a cheat: a ReLU that holds 35 % of the GPU's memory as scratch from
# its first call on, beside the judge and the reference runner (eager's
# input and output). With the seven sets of reference outputs the judge
# keeps (0.39 of the GPU) there is no room for it; with the references
# recomputed for each check (one set at a time) there is, with about a
# tenth of the GPU to spare (on an H200: judge 34 GiB, eager 16, this
# process 65, and the judge's next 7.8 GiB input). The scratch is one
# allocation, kept: freed and asked for again each call, the output carved
# from its freed block would leave no block large enough for the next
# call's (the candidate's own fragmentation, not the judge's memory).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.scratch = None

    def forward(self, x):
        if self.scratch is None:
            total = torch.cuda.get_device_properties(x.device).total_memory
            self.scratch = torch.empty(int(total * 0.35) // 4, dtype=torch.float32, device=x.device)
        return torch.relu(x)
