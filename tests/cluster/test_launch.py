"""visiontune's hand-over to torch.distributed.run: what the elastic agent and the workers are given."""

from __future__ import annotations

import pytest
from torch.distributed.run import get_args_parser

from trainrun import flags
from visiontune.cluster.launch import launcher_argv, needs_launcher, without_flags
from visiontune.settings.config import TrainConfig

ARGV = [
    "--data",
    "d",
    "--nproc",
    "1",
    "--batch-size",
    "5",
    "--nnodes=2",
    "--node-rank",
    "1",
    "--master-addr",
    "10.0.0.1",
    "--master-port=29999",
    "--max-restarts",
    "0",
    "--strategy",
    "ddp",
]


def test_without_flags_drops_both_spellings_and_their_values():
    flags = ("--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--max-restarts")
    assert without_flags(ARGV, flags) == ["--data", "d", "--batch-size", "5", "--strategy", "ddp"]


def test_torchrun_reads_a_two_machine_command_as_meant():
    cfg = TrainConfig(
        data="d", strategy="ddp", nproc=1, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29999
    )
    args = get_args_parser().parse_args(launcher_argv(cfg, ARGV))
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        "1",
        "2",
        1,
        "10.0.0.1",
        29999,
    )
    assert not args.standalone and args.module and args.training_script == "visiontune"
    # The workers get the flags as typed: torchrun alone would reject `--nproc` as an ambiguous
    # abbreviation of its `--nproc-per-node`.
    assert args.training_script_args == ["train", *ARGV]


def test_one_machine_rendezvous_on_a_free_port():
    args = get_args_parser().parse_args(launcher_argv(TrainConfig(data="d", strategy="ddp", nproc=3), []))
    assert args.standalone and args.nproc_per_node == "3" and args.nnodes == "1"


@pytest.mark.parametrize(
    "changes,env,expected",
    [
        ({"strategy": "ddp", "nproc": 2}, {}, True),
        ({"strategy": "ddp", "nproc": 1, "nnodes": 2}, {}, True),
        ({"strategy": "ddp", "nproc": 1}, {}, False),
        ({"strategy": "single"}, {}, False),
        ({"strategy": "ddp", "nproc": 2}, {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, False),  # already launched
        ({"strategy": "ddp"}, {"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, False),  # `torchrun --nproc-per-node 1`
    ],
)
def test_needs_launcher(monkeypatch, changes, env, expected):
    for k in ("LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert needs_launcher(TrainConfig(data="d", **changes)) is expected


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--resume", "RESUMED"], "RESUMED"),  # a resumed ddp run goes on writing the folder it resumes
        (["--output-dir", "CHOSEN"], "CHOSEN"),
        ([], None),  # a new timestamped folder, the same for every worker
    ],
)
def test_the_launcher_hands_every_worker_one_run_folder(sample_data, tmp_path, monkeypatch, extra, expected):
    from visiontune import cli
    from visiontune.cluster import launch

    seen = {}
    monkeypatch.setattr(launch, "relaunch", lambda cfg, argv, command="train": seen.update(cfg=cfg, argv=argv) or 0)
    monkeypatch.chdir(tmp_path)
    extra = [str(tmp_path / e) if e.isupper() else e for e in extra]
    assert (
        cli.main(["train", *flags(data=sample_data, model="resnet18", weights="none", strategy="ddp", nproc=2), *extra])
        == 0
    )
    folder = seen["argv"][seen["argv"].index("--output-dir") + 1]
    assert folder == seen["cfg"].output_dir
    if expected:
        assert folder == str(tmp_path / expected)
    else:
        assert folder.startswith("runs/") and len(folder) > len("runs/")
