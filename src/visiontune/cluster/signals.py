"""Stopping cleanly on SIGTERM, SIGINT and SIGUSR1 (``RunStopped``).

A handler only records the signal; the training loop asks ``StopSignals.agreed``
after every optimizer step, finishes nothing more, writes a checkpoint and exits
with 128 + the signal number (143 SIGTERM, 130 SIGINT, 138 SIGUSR1, which Slurm
sends ahead of a time limit with ``--signal=USR1@SECONDS``). Under the launcher
the processes must stop at the same step or the ones that go on would wait
forever in the next gradient all-reduce, so ``agreed`` all-reduces the signal
number (MAX) across processes every step. It does so on a gloo group over CPU
tensors, so on GPUs it costs a few microseconds of host networking and never
synchronises the device; a single process only reads the flag.
"""

from __future__ import annotations

import signal

# torch is imported where used: the CLI imports RunStopped from here before any command runs.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class RunStopped(Exception):
    """The run stopped on purpose (a signal, a non-finite loss): one line, then ``exit_code``."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    """Records SIGTERM/SIGINT/SIGUSR1 while installed (a context manager)."""

    def __init__(self, accelerator):
        self.accelerator, self.received, self._old = accelerator, 0, {}
        self._group = None
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            # Every process creates the group at the same point: it is itself a collective.
            self._group = dist.new_group(backend="gloo")

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum  # the first signal decides the exit code

    def __enter__(self) -> StopSignals:
        for s in SIGNALS:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)

    def agreed(self) -> int:
        """The signal every process stops for now, or 0; a collective under the launcher."""
        if self._group is None:
            return self.received
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())


def stopped(signum: int, where: str) -> RunStopped:
    name = signal.Signals(signum).name
    return RunStopped(f"stopped by {name}: {where}", 128 + signum)
