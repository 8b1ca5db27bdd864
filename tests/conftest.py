"""Shared fixtures: tiny data sets made in tmp folders, and the CLI in-process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from visiontune.data.sample import make_sample_data

ROOT = Path(__file__).resolve().parents[1]

# Test tiers. The rule: a test is `distributed` when it starts several processes (torch.distributed.run,
# gloo), and `slow` when it trains a model or runs a subprocess, i.e. takes more than about 2 s on 2
# cores. The hook below marks every test named here, and every test that uses a fixture named here
# (directly or through another fixture); whatever is left is the fast tier, `make test-fast`.
DISTRIBUTED = {
    "test_ddp_job_whose_scan_outlasts_the_timeout_completes_and_lists_once",
    "jobs",
    "bench_dir",  # fixtures
    "test_two_ddp_processes_share_one_cache_built_once",
    "test_two_processes_write_the_same_bytes",
    "test_two_processes_give_exactly_the_same_numbers",
    "test_signal_to_the_launcher_stops_every_worker_at_the_same_step",
    "test_a_killed_worker_ends_the_job_without_restarts_and_is_restarted_with_them_to_the_uninterrupted_tensors",
    "cluster_reference",  # test_cluster.py: two "nodes" on localhost, Slurm/Kubernetes/c10d
    "test_elastic_job_that_loses_a_node_goes_on_with_a_smaller_world_and_the_same_global_batch",
    "test_a_run_folder_that_is_not_shared_stops_before_training",
    "test_ddp_with_the_new_options_matches_one_process",
    "uninterrupted",  # the fault-injection matrix's reference runs (single and ddp)
    "test_kill_9_at_a_random_step_then_resume_gives_the_uninterrupted_tensors",
    "test_timm_under_ddp_saves_a_self_describing_model_counts_val_once_and_equals_one_process",
    "test_ddp_on_hf_data_with_its_own_odd_validation_split_killed_mid_epoch_resumes_to_the_folder_run",
    "test_ddp_x2_equals_one_process_and_counts_every_val_image_once",  # test_multilabel.py
    "test_ddp_on_shards_killed_mid_epoch_resumes_to_the_folder_runs_tensors_every_sample_once",
    "test_a_full_disk_under_ddp_stops_the_job_in_one_line_per_process_without_a_traceback",
    "ddp_reference",  # test_formats_train.py: the ddp folder run that the shards and hf: jobs must end as
}
SLOW = {
    "test_train_with_group_by_records_the_grouped_split_and_resumes_only_with_it",
    "test_check_train_and_evaluate_use_the_nested_rule_and_report_counts",
    "test_single_process_job_lists_the_data_once",
    "test_first_cached_run_decodes_each_file_exactly_once",
    "default_runs",  # test_default_cache.py: the default cache built, reused, off, over the cap; a resume
    "trained_run",
    "baseline_run",
    "logged",
    "_finished",  # fixtures that train
    "test_run_skips_exactly_the_bad_files_and_trains_on_odd_modes",
    "test_kill_while_writing_a_checkpoint_leaves_a_resumable_run",
    "test_signal_finishes_the_step_checkpoints_it_and_exits",
    "test_signals_in_every_phase_stop_resumably_and_the_run_ends_with_the_uninterrupted_tensors",  # and a subprocess
    "test_kill_9_after_the_unfreeze_with_trivial_augment_mixing_and_accumulation_resumes_exactly",
    "test_a_ddp_checkpoint_resumed_on_one_process_goes_on_from_the_same_sample",
    "test_nan_loss_stops_with_code_3_and_keeps_the_last_good_checkpoint",
    "test_nan_loss_skip_skips_the_step_and_counts_it",
    "test_dp_on_a_cpu_says_so_and_saves_the_plain_model",
    "test_cosine_schedule_steps_per_optimizer_step_with_accumulation",
    "test_gpu_script_says_there_is_no_gpu_and_exits_0",
    "test_gpu_benchmark_code_runs_tiny_on_a_cpu",
    "test_resume_from_a_mid_epoch_checkpoint_in_a_new_folder_is_exact",
    "test_ema_best_pick_early_stop_and_the_recorded_recipe",
    "test_lr_find_sweeps_writes_the_curve_and_suggests_a_tenth_of_the_minimum",
    "test_lr_auto_uses_lr_finds_suggestion_records_it_and_a_resume_reuses_it",
    "test_too_little_free_space_stops_before_writing",
    "test_a_disk_that_fills_up_while_writing_leaves_the_previous_checkpoint",
    "test_a_real_full_disk_while_writing",
    "test_the_lock_of_a_killed_holder_is_free_at_once",
    "test_the_lock_is_released_when_a_run_fails",
    "test_a_closed_pipe_ends_quietly",
    "test_every_model_gets_a_new_head_of_the_right_shape",  # ~80 models built and run on the meta device
    "test_the_resize_flags_reach_the_cache_the_loaders_and_the_record",
    "test_predict_decodes_as_the_file_says_unless_told",  # two predict commands in-process
    "test_the_run_records_its_threads_and_what_chose_them",
    "test_a_run_with_onecycle_records_the_cycle",
    "test_a_kill_while_the_epoch_files_are_written_resumes_to_the_same_files",
    "test_a_hub_id_offline_names_the_datasets_cache",  # a subprocess that imports datasets
    "formats",  # test_formats_train.py: trains on a folder, its shards and an hf: copy
    "shaken_run",  # test_hostile_inputs.py
    "test_a_default_cache_folder_that_cannot_be_written_gives_way_to_a_temporary_one",
    "test_a_full_disk_while_writing_best_safetensors_keeps_the_previous_best",
    "test_a_thousand_one_image_classes_with_hostile_names_train_and_write_only_in_the_run",
    "test_models_imports_neither_torch_nor_timm",  # two subprocesses, the first imports timm
    "test_the_launching_process_imports_no_model_code",  # a subprocess that imports torch
    "server",  # test_serve.py: the real server in a subprocess
    "ml_run",  # test_multilabel.py: the shared multi-label run
    "test_a_multi_label_run_resumed_mid_epoch_ends_with_the_uninterrupted_weights",
    "imbalanced_runs",  # test_imbalance_train.py: three runs on a 95/5 set
    "test_timm_family_trains_predicts_from_its_file_alone_and_exports",  # a timm model trained and exported
    "test_text_tables_and_the_figure_stay_readable_with_100_long_class_names",  # a figure of 100 x 100 cells
    "device_runs",  # test_devicedecode.py: a run with --decode exact and one with --decode device
    "test_a_balanced_weighted_run_resumed_mid_epoch_ends_with_the_uninterrupted_tensors",
}


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker gets its own share of the cores, as a machine of that size.

    visiontune gives a run as many threads as it has cores; two workers that each thought they had
    all of them would run twice as many OpenMP threads as cores, and OpenMP threads that wait for a
    descheduled peer spin: the tests would take several times their CPU time. Subprocesses (DDP
    workers) inherit the share.
    """
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    cores = sorted(os.sched_getaffinity(0))
    if worker and count and int(count) > 1:
        index, n = int(worker.removeprefix("gw")), int(count)
        # More workers than cores: each core is the share of every len(cores)-th worker.
        share = (
            cores[index * len(cores) // n : (index + 1) * len(cores) // n]
            if n <= len(cores)
            else [cores[index % len(cores)]]
        )
        os.sched_setaffinity(0, share)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        names = {item.originalname, *item.fixturenames}
        for marker, listed in (("distributed", DISTRIBUTED), ("slow", SLOW)):
            if names & listed:
                item.add_marker(marker)
    # Longest modules first (a rough cost from the tiers), each module's tests together and in order:
    # under pytest-xdist, no worker is then left with a long module at the end while the others idle.
    cost: dict[str, float] = {}
    for item in items:
        weight = 20 if item.get_closest_marker("distributed") else 4 if item.get_closest_marker("slow") else 0.2
        cost[item.module.__name__] = cost.get(item.module.__name__, 0) + weight
    items.sort(key=lambda it: -cost[it.module.__name__])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N`: a module's tests run in one worker, so its module fixtures are made once.

    The fault matrix is the exception: each (augmentation, strategy) pair has its own reference run,
    so its four pairs (the ``[aug-strategy...]`` of a test's id) are spread over the workers.
    """
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module, _, test = nodeid.partition("::")
            pair = "-".join(test.partition("[")[2].rstrip("]").split("-")[:2])
            return module + pair if module.endswith("test_fault_matrix.py") else module

    config.option.loadscopereorder = False  # keep the longest-first order above, not most-tests-first
    return ByModule(config, log)


# Small runs: every test trains at this size so the suite stays fast on 2 cores.
FAST = ["--model", "resnet18", "--weights", "none", "--image-size", "32", "--no-progress"]


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> Path:
    """A synthetic Kaggle-layout set: 60 cats, 60 dogs, 30 test images (read-only for tests)."""
    out = tmp_path_factory.mktemp("sample") / "data"
    make_sample_data(out, per_class=60, test_count=30, seed=0)
    return out


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def worker_env() -> dict[str, str]:
    """Environment for subprocesses: the package importable, one thread each."""
    return _worker_env()


@pytest.fixture(scope="module")
def worker_env_module():
    """The same for this process, for tests whose code starts subprocesses itself."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _worker_env().items():
            mp.setenv(k, v)
        yield


@pytest.fixture
def no_scan(monkeypatch):
    """Fail the test if training gets as far as screening the files (the bad-file scan, or the image cache
    that replaces it): the problem must be found before it."""
    from visiontune.loading import jobdata

    def scan(*a, **kw):
        raise AssertionError("the files were screened (scan or image cache): the problem was found too late")

    monkeypatch.setattr(jobdata, "scan", scan)
    monkeypatch.setattr(jobdata, "choose", scan)


PYTHON = sys.executable


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """40 synthetic images (32 train / 8 val): 8 steps per epoch at batch 4, for kill-and-resume runs."""
    out = tmp_path_factory.mktemp("small") / "data"
    make_sample_data(out, per_class=20, test_count=0, seed=1)
    return out


@pytest.fixture(scope="session")
def baseline_run(tmp_path_factory, small_data) -> Path:
    """An uninterrupted single-process run on ``small_data`` (the reference for resumed runs)."""
    import subprocess

    from trainrun import env_for, train_argv

    tmp = tmp_path_factory.mktemp("baseline")
    env = env_for(
        {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        },
        tmp,
    )
    out = tmp / "run"
    done = subprocess.run(
        train_argv(small_data, out, "--save-every-steps", "3"), env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, sample_data) -> Path:
    """Two epochs of resnet18 at 32 px on ``sample_data`` (``trained.train_run``), shared by the train,
    predict, evaluate, export and pipeline tests: read it, never write into it (copy it first)."""
    from trained import train_run

    return train_run(tmp_path_factory.mktemp("trained") / "run", sample_data)


@pytest.fixture(scope="session", autouse=True)
def _scan_cache_in_tmp(tmp_path_factory):
    """Keep the bad-file scan's cache and the default image cache (``--cache fit``) out of the user's home
    during tests: one folder for the session, so runs on the same data share one image cache. The model
    names are listed in it as on any machine that ran visiontune before (a DDP job's launching process
    reads them)."""
    from visiontune.models.names import all_names

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path_factory.mktemp("scan-cache")))
        all_names("torchvision", os.environ["VISIONTUNE_CACHE_DIR"])
        yield
