"""cluster: where the processes run -- launch, the job plan, Slurm, the Accelerator, signals, the host.

Owns: deciding whether to relaunch under ``torch.distributed.run``, reading launcher and cluster
environments, building the Accelerator, the thread budget, stop signals, the batch-script
writer and reading a sharded checkpoint's files (``dcpfiles``). May import settings and the foundation only.
"""
