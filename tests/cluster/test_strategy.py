"""What the Accelerate glue adds: a loader sharded over processes without importing Hugging Face datasets."""

from __future__ import annotations

import sys

from accelerate import PartialState
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from visiontune.cluster.strategies.base import no_datasets_import


def test_a_loader_is_sharded_over_processes_without_importing_datasets(monkeypatch):
    for name in [m for m in sys.modules if m == "datasets" or m.startswith("datasets.")]:
        monkeypatch.delitem(sys.modules, name)
    PartialState(cpu=True)
    loader = DataLoader(list(range(12)), batch_size=2)
    with no_datasets_import():
        shards = [prepare_data_loader(loader, num_processes=2, process_index=i) for i in (0, 1)]
    assert "datasets" not in sys.modules
    # Consecutive batches go to consecutive ranks, as without the guard.
    assert [[b.tolist() for b in s] for s in shards] == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]


def test_with_datasets_imported_accelerate_asks_as_it_always_does(monkeypatch):
    import datasets  # noqa: F401  (hf: data imports it before the loaders are made)
    from accelerate import data_loader

    real = data_loader.is_datasets_available
    with no_datasets_import():
        assert data_loader.is_datasets_available is real and real()
    assert data_loader.is_datasets_available is real
