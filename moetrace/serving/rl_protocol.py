"""The bodies of the routes an RL trainer calls between steps, with the engines' names and defaults.

One class per route body, named after the engine's own (SGLang's
``managers/io_struct.py``, vLLM's RLHF router, prime-rl's server), so the
wire protocol reads in one place.  Fields the engines accept that change
nothing here (``torch_empty_cache``, ``token_step``) are accepted; fields
whose meaning moetrace does not implement are refused at any value but
their default, naming the field; unknown fields are refused, as on the
generation routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from moetrace.engine.memory_release import TAGS
from moetrace.serving.protocol import FieldProblem, Strict, refuse_unsupported

SGLANG_GROUP = "weight_update_group"


def _port_from_text(value: Any) -> Any:
    """SGLang parses its bodies loosely, and AReaL sends ``master_port`` as a string."""
    if isinstance(value, str) and value.strip().isdecimal():
        return int(value)
    return value


Port = Annotated[int, BeforeValidator(_port_from_text), Field(ge=1, le=65535)]


def _load_format(value: str | None, where: str = "load_format") -> None:
    if value not in (None, "auto", "safetensors"):
        raise FieldProblem(where, f"moetrace reads safetensors checkpoints, got {value!r}")


# ------------------------------------------------------------------ SGLang (io_struct.py)


class UpdateWeightFromDiskReqInput(Strict):
    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True  # the prefix cache is dropped after every update regardless
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False  # graphs are re-captured when an update needs it
    token_step: int = 0

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, {"is_async": False, "keep_pause": False, "manifest": None})

    @model_validator(mode="after")
    def _checks(self) -> UpdateWeightFromDiskReqInput:
        _load_format(self.load_format)
        return self


class InitWeightsUpdateGroupReqInput(Strict):
    master_address: str = Field(min_length=1)
    master_port: Port
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = SGLANG_GROUP
    backend: Literal["nccl", "gloo"] = "nccl"

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, {"pp_rank": 0})  # AReaL's, with pipeline parallelism


class DestroyWeightsUpdateGroupReqInput(Strict):
    group_name: str = SGLANG_GROUP


class UpdateWeightsFromDistributedReqInput(Strict):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = SGLANG_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False

    @model_validator(mode="after")
    def _checks(self) -> UpdateWeightsFromDistributedReqInput:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise FieldProblem(
                "dtypes",
                f"{len(self.names)} names, {len(self.dtypes)} dtypes and {len(self.shapes)} "
                "shapes: one of each per tensor",
            )
        if self.load_format not in (None, "direct"):
            raise FieldProblem("load_format", f"only direct broadcasts, got {self.load_format!r}")
        return self


class UpdateWeightsFromTensorReqInput(Strict):
    serialized_named_tensors: list[str] = Field(min_length=1)  # base64, one per rank
    load_format: str | None = None  # None/direct or flattened_bucket
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False


class PauseGenerationReqInput(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(Strict):
    torch_empty_cache: bool = True


class MemoryOccupationReqInput(Strict):
    """``release_memory_occupation`` and ``resume_memory_occupation``: None means both."""

    tags: list[str] | None = None

    @model_validator(mode="after")
    def _checks(self) -> MemoryOccupationReqInput:
        for tag in self.tags or []:
            if tag not in TAGS:
                raise FieldProblem("tags", f"unknown tag {tag!r}; choose among {list(TAGS)}")
        return self

    @property
    def chosen(self) -> tuple[str, ...]:
        return tuple(self.tags) if self.tags else TAGS


class UpdateWeightVersionReqInput(Strict):
    """SGLang's (vLLM's takes ``new_version`` alone): requests are not aborted unless asked,
    SGLang's default until it became True, and vLLM's behaviour."""

    new_version: str = Field(min_length=1)
    abort_all_requests: bool = False


class AbortReq(Strict):
    rid: str = ""
    abort_all: bool = False


# ------------------------------------------------------------------ vLLM's RLHF routes


class TransferInitInfo(Strict):
    """``init_info`` of ``/init_weight_transfer_engine`` (vLLM's NCCL engine), plus
    moetrace's ``backend`` (``gloo`` for CPU servers; vLLM has no such field)."""

    master_address: str = Field(min_length=1)
    master_port: Port
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    backend: Literal["nccl", "gloo"] = "nccl"


class InitWeightTransferRequest(Strict):
    init_info: TransferInitInfo


class TransferUpdateInfo(Strict):
    """``update_info`` of ``/update_weights`` (vLLM's NCCL engine)."""

    names: list[str] = Field(min_length=1)
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int = Field(1 << 30, ge=1)  # vLLM's default, 1 GiB
    packed_num_buffers: int = Field(2, ge=1)  # the sender's double buffering; one stream here

    @model_validator(mode="after")
    def _checks(self) -> TransferUpdateInfo:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise FieldProblem(
                "update_info.dtype_names",
                f"{len(self.names)} names, {len(self.dtype_names)} dtype_names and "
                f"{len(self.shapes)} shapes: one of each per tensor",
            )
        return self


class UpdateWeightsRequest(Strict):
    """``/update_weights``: vLLM's ``update_info``, or prime-rl's ``weight_dir``."""

    update_info: TransferUpdateInfo | None = None
    weight_dir: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> UpdateWeightsRequest:
        if (self.update_info is None) == (self.weight_dir is None):
            raise FieldProblem(
                "update_info",
                "give update_info (vLLM's weight transfer) or weight_dir (a checkpoint "
                "directory, prime-rl's)",
            )
        return self


class StartWeightUpdateRequest(Strict):
    is_checkpoint_format: bool = True

    @model_validator(mode="after")
    def _checks(self) -> StartWeightUpdateRequest:
        if not self.is_checkpoint_format:
            raise FieldProblem(
                "is_checkpoint_format", "moetrace takes checkpoint-named tensors only"
            )
        return self


class FinishWeightUpdateRequest(Strict):
    weight_version: str | None = None


class ResetPrefixCacheRequest(Strict):
    reset_running_requests: bool = False
    reset_external: bool = False


class AbortRequestsRequest(Strict):
    request_ids: list[str] | None = None
