"""Serialized tensors from a trainer: only torch's tensor rebuilders may be named.

The payloads that work are sent by a real sender process in
test_weights_api.py; here, what must be refused and how it is said.
"""

from __future__ import annotations

import base64
import io
import os
import pickle

import pytest
import torch

from moetrace.engine.tensor_ipc import TensorPayloadError, named_tensors


def encoded(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def test_a_pickle_naming_any_other_callable_is_refused_by_name():
    with pytest.raises(TensorPayloadError, match="may not name posix.system"):
        named_tensors([encoded(os.system)])


def shared(obj, strategy: str) -> str:
    """``obj`` serialized as SGLang's MultiprocessingSerializer does, tensors shared so."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
    finally:
        mp.set_sharing_strategy(before)
    return base64.b64encode(buf.getvalue()).decode()


def test_file_descriptor_sharing_is_refused_with_the_fix():
    payload = shared([("w", torch.ones(3))], "file_descriptor")
    with pytest.raises(TensorPayloadError, match="set_sharing_strategy\\('file_system'\\)"):
        named_tensors([payload])


def test_payloads_must_hold_named_tensors():
    with pytest.raises(TensorPayloadError, match="cannot read it"):
        named_tensors(["not base64 !"])
    with pytest.raises(TensorPayloadError, match=r"\(name, tensor\) pairs"):
        named_tensors([encoded([("w", 3)])])
    with pytest.raises(TensorPayloadError, match="flattened_tensor and metadata"):
        named_tensors([encoded({"x": 1})], "flattened_bucket")
    with pytest.raises(TensorPayloadError, match="load_format 'npz'"):
        named_tensors([encoded([])], "npz")
    with pytest.raises(TensorPayloadError, match="is empty"):
        named_tensors([])


def test_tensors_shared_through_files_read_back():
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    ((name, got),) = named_tensors([shared([("w", tensor)], "file_system")])
    assert name == "w" and torch.equal(got, tensor)
    with pytest.raises(TensorPayloadError, match="torch._utils._rebuild_tensor_v2"):
        named_tensors([encoded([("w", tensor)])])  # torch.save's kind of pickle: not IPC
