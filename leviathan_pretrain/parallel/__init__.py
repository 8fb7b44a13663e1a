"""Processes and their groups.

- :mod:`.groups`  rank discovery (torchrun, SLURM, MPI), torch.distributed + megatron-core's TP x PP x DP groups
                  and their timeouts, the device, seeding, ``ParallelDims``, DeepSpeed's ``mpu``
- :mod:`.ports`   a free local TCP port for a local run's rendezvous (torch-free: the local launcher uses it)
"""
