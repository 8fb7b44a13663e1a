"""Worker: init the TP x PP x DP groups from the launcher's variables and check them with collectives."""

import json
import os
import sys

import torch
import torch.distributed as dist

from leviathan_pretrain.config import ParallelConfig
from leviathan_pretrain.parallel.groups import DeepSpeedMPU, destroy_distributed, init_distributed

tp, pp = int(sys.argv[1]), int(sys.argv[2])
env = init_distributed(
    ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, timeout_minutes=3, init_timeout_minutes=45)
)


def timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


mpu = DeepSpeedMPU()
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t, group=mpu.get_model_parallel_group())
out = {
    "rank": env.rank,
    "world": env.world_size,
    "backend": env.backend,
    "device": str(env.device),
    "tp_size": mpu.get_model_parallel_world_size(),
    "tp_rank": mpu.get_model_parallel_rank(),
    "dp_size": mpu.get_data_parallel_world_size(),
    "pp_size": mpu.get_pipeline_model_parallel_world_size(),
    "tp_sum": t.item(),
    "world_timeout_s": timeout_s(dist.group.WORLD),
    "tp_timeout_s": timeout_s(mpu.get_model_parallel_group()),
    "dp_timeout_s": timeout_s(mpu.get_data_parallel_group()),
}
# one write(2) per rank: under mpirun the ranks' lines must not interleave
os.write(1, ("RESULT " + json.dumps(out) + "\n").encode())
destroy_distributed()
