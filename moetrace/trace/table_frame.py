"""A trace's request table as a ``pandas.DataFrame`` (``Trace.to_pandas``).

The columns come from the schema (``trace/records.py``), so a field declared
there later reaches the frame without an edit here; pandas is imported only
when asked for (the ``pandas`` extra).
"""

from __future__ import annotations

import json

import numpy as np

from moetrace.errors import MoetraceError, install_extra
from moetrace.trace.integrity import plain_value
from moetrace.trace.records import COLUMNS, PLACED


def to_pandas(table: np.ndarray, sample_indices: np.ndarray, reason_names: dict[int, str]):
    """One row per record of ``table`` (file order), indexed by record number."""
    try:
        import pandas as pd
    except ImportError:
        raise MoetraceError(f"Trace.to_pandas needs pandas: {install_extra('pandas')}") from None
    t = table
    columns = {
        "id": t["id"].tolist(),
        "sample_index": sample_indices,
        "index": t["index"],
        "prompt_len": t["prompt_len"],
        "output_len": t["output_len"],
        "num_rows": t["num_rows"],
        "finish_reason": [reason_names[int(c)] for c in t["finish_reason"]],
        "num_cached_tokens": t["num_cached_tokens"],
        "num_preemptions": t["num_preemptions"],
        "extra": [json.loads(x) if x else {} for x in t["extra"]],
        "row_start": t["row_start"],
        "token_start": t["token_start"],
    }
    held = t.dtype.names or ()
    for column in COLUMNS:  # a field declared later comes along without an edit here
        if column.name in columns or column.kind == PLACED:
            continue
        columns[column.name] = (
            [column.from_table(plain_value(v)) for v in t[column.name].tolist()]
            if column.name in held
            else [column.default_value for _ in range(len(t))]
        )
    return pd.DataFrame(columns, index=pd.RangeIndex(len(t), name="record"))
