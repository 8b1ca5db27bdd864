"""A stopped audit's kept fold probabilities (``oof.npz``) read back as untrusted: checked, or one line."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from visiontune.audit.folds import read_oof
from visiontune.errors import UserError


def _saved(path, **arrays) -> str:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.write_bytes(buf.getvalue())
    return str(path)


def test_a_fold_file_reads_back(tmp_path):
    probs = np.array([[0.25, 0.75], [1.0, 0.0]])
    idx, rows = read_oof(_saved(tmp_path / "oof.npz", index=np.array([3, 0]), probs=probs), 4, 2)
    assert idx.tolist() == [3, 0] and np.array_equal(rows, probs)


@pytest.mark.parametrize(
    "arrays",
    [
        {"index": np.array([4]), "probs": np.array([[0.5, 0.5]])},  # an image the listing does not have
        {"index": np.array([1, 1]), "probs": np.full((2, 2), 0.5)},  # one image twice
        {"index": np.array([1]), "probs": np.array([[0.5, 0.5, 0.0]])},  # another class count
        {"index": np.array([1]), "probs": np.array([[np.nan, 0.5]])},
        {"index": np.array([1]), "probs": np.array([[2.0, -1.0]])},  # not probabilities
        {"index": np.array([0.5]), "probs": np.array([[0.5, 0.5]])},
        {"probs": np.array([[0.5, 0.5]])},
        {"index": np.array([1], dtype=object), "probs": np.array([[0.5, 0.5]])},  # a pickle inside
    ],
)
def test_a_damaged_fold_file_is_one_line(tmp_path, arrays):
    with pytest.raises(UserError, match=r"oof.npz: not (a fold's|this data's fold) probabilities.*delete it"):
        read_oof(_saved(tmp_path / "oof.npz", **arrays), 4, 2)


def _valid() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, index=np.array([3, 0]), probs=np.array([[0.25, 0.75], [1.0, 0.0]]))
    return buf.getvalue()


VALID = _valid()


@fuzz_settings(300)
@given(
    st.one_of(
        st.binary(max_size=600),
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255), st.integers(1, len(VALID))).map(
            lambda t: (VALID[: t[0]] + bytes([t[1]]) + VALID[t[0] + 1 :])[: t[2]]  # a byte changed, then cut
        ),
    )
)
def test_fuzz_any_bytes_as_a_fold_file_read_back_checked_or_one_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("oof") / "oof.npz"
    path.write_bytes(data)
    try:
        idx, rows = read_oof(str(path), 4, 2)
    except UserError as e:
        assert "\n" not in str(e)
        return
    assert rows.shape == (len(idx), 2) and ((rows >= 0) & (rows <= 1)).all()
