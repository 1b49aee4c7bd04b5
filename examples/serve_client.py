"""``moetrace serve`` from a trainer's side: start or reach it, call its routes, push weights.

What an RL trainer does with its rollout server besides generating (the
call sequences slime and AReaL make, docs/serving.md): new weights go in by
``torch.distributed`` broadcasts over a group the trainer hosts as rank 0,
or through a checkpoint directory the server loads.  Used by
``examples/r3_loop.py``.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
)
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

GROUP = "weight_update_group"  # SGLang's default group name
BUCKET_BYTES = 256 << 20  # one update call per bucket of tensors, as slime sends them
HTTP_TIMEOUT_S = 600.0


class ServerError(Exception):
    """The server refused a call, could not be reached, or did not start: one line."""


def call(url: str, path: str, body: dict | None = None) -> dict:
    """POST ``body`` (GET without one) and the JSON answer; a refusal is a ServerError."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
            text = answer.read().decode()
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{path}: {exc.code} {exc.read().decode()[:300]}") from None
    except urllib.error.URLError as exc:
        raise ServerError(f"{path}: cannot reach {url}: {exc.reason}") from None
    return json.loads(text) if text.strip().startswith(("{", "[")) else {"text": text}


class Server:
    """``moetrace serve`` with weight updates, started here, or one already running at ``url``."""

    def __init__(
        self, url: str | None, model: str, serve_options: list[str], trace_out: Path | None
    ) -> None:
        self.proc: subprocess.Popen | None = None
        self.url = url or ""
        self.lines: list[str] = []
        if self.url:
            return
        command = [sys.executable, "-m", "moetrace", "serve", model, "--port", "0"]
        command += ["--enable-return-routed-experts", "--enable-weight-updates", *serve_options]
        if trace_out:
            command += ["--trace-out", str(trace_out), "--overwrite"]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        if not ready.wait(300) or not self.url:
            self.stop()
            said = [line.strip() for line in self.lines if line.strip()] or ["nothing"]
            raise ServerError(f"moetrace serve did not start; it said: {said[-1]}")

    def _read(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            found = re.search(r"serving .* at (http://\S+)", line)
            if found:
                self.url = found.group(1)
                ready.set()
        ready.set()  # it ended before it served

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def checkpoint_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under the checkpoint's names and layout (per-expert weights,
    tied copies left out): what ``save_pretrained`` writes and the server loads."""
    state = remove_tied_weights_from_state_dict(dict(model.state_dict()), model)
    state = revert_weight_conversion(model, state)
    return [(name, t.detach().contiguous()) for name, t in sorted(state.items())]


class WeightSync:
    """New weights into the server: a broadcast group the trainer hosts, or a checkpoint."""

    def __init__(
        self,
        url: str,
        model,
        *,
        master_address: str = "127.0.0.1",
        backend: str = "gloo",
        disk_dir: Path | None = None,
    ) -> None:
        self.url = url
        self.model = model  # a transformers PreTrainedModel
        self.master_address = master_address
        self.backend = backend
        self.group: dist.ProcessGroup | None = None
        self.disk_dir = Path(disk_dir or tempfile.mkdtemp(prefix="moetrace-weights-"))

    def push(self, version: str, transport: str) -> None:
        """Pause, flush, load, continue: slime's sequence around an update."""
        call(self.url, "/pause_generation", {})
        call(self.url, "/flush_cache")
        if transport == "distributed":
            self._broadcast(version)
        else:
            self.model.save_pretrained(self.disk_dir)
            body = {"model_path": str(self.disk_dir), "weight_version": version}
            call(self.url, "/update_weights_from_disk", body)
        call(self.url, "/continue_generation", {})

    def _join(self) -> dist.ProcessGroup:
        """Host the group as rank 0 and have the server join it (``init_weights_update_group``).

        Built as SGLang's ``init_custom_process_group`` (and slime's copy of it) builds
        it: the store under a prefix named after the group, then torch's process
        group helper, so both sides look for the same keys; it is not this process's
        default group, which a real trainer already has.  Every rank of the server
        joins (``tp_size`` of ``/get_server_info``), so the group has 1 + tp_size ranks.
        The trainer's side waits in a daemon thread: a server that refuses the call is
        reported at once, not after the group's timeout."""
        ranks = 1 + int(call(self.url, "/get_server_info").get("tp_size", 1))
        port = free_port()
        timeout = timedelta(seconds=HTTP_TIMEOUT_S)
        store = dist.TCPStore(
            self.master_address, port, ranks, is_master=True, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip
        body = {
            "master_address": self.master_address,
            "master_port": port,
            "rank_offset": 1,  # the server's ranks follow the trainer's 0
            "world_size": ranks,
            "group_name": GROUP,
            "backend": self.backend,
        }
        made: dict = {}

        def make_group() -> None:
            try:
                made["pg"], _ = _new_process_group_helper(
                    ranks, 0, [], Backend(self.backend), PrefixStore(GROUP, store),
                    group_name=GROUP, timeout=timeout,
                )  # fmt: skip
            except Exception as exc:  # reported below, in the caller's thread
                made["error"] = exc

        maker = threading.Thread(target=make_group, name="weight-group", daemon=True)
        maker.start()
        joined = call(self.url, "/init_weights_update_group", body)  # a refusal raises here
        if not joined.get("success"):
            raise ServerError(f"init_weights_update_group: {joined}")
        maker.join(HTTP_TIMEOUT_S)
        if "pg" not in made:
            raise ServerError(f"the weight update group was not made: {made.get('error')}")
        _world.pg_group_ranks[made["pg"]] = {i: i for i in range(ranks)}
        return made["pg"]

    def _broadcast(self, version: str) -> None:
        """Per bucket one ``update_weights_from_distributed`` call beside one broadcast per
        tensor, in the order the call names them."""
        if self.group is None:
            self.group = self._join()
        for bucket in buckets(checkpoint_tensors(self.model), BUCKET_BYTES):
            body = {
                "names": [name for name, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": GROUP,
                "weight_version": version,
                "flush_cache": False,
            }
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(call, self.url, "/update_weights_from_distributed", body)
                for _, tensor in bucket:
                    dist.broadcast(tensor, 0, group=self.group)
                if not answer.result().get("success"):
                    raise ServerError(f"update_weights_from_distributed: {answer.result()}")

    def close(self) -> None:
        if self.group is None:
            return
        dist.destroy_process_group(self.group)
        self.group = None
        with contextlib.suppress(ServerError):  # a server already gone has no group left
            call(self.url, "/destroy_weights_update_group", {"group_name": GROUP})


def buckets(named: list[tuple[str, torch.Tensor]], limit: int):
    bucket, size = [], 0
    for name, tensor in named:
        if bucket and size + tensor.nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.nbytes
    if bucket:
        yield bucket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
