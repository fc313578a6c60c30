"""The choice keys' vocabularies: one ``Choice`` enum per key that takes one of a fixed set of names.

A choice member is a ``str`` whose value is the name a YAML file or an override writes
(``parallel.recompute=full`` gives ``Recompute.FULL``, equal to ``"full"``), so JSON,
W&B and messages see the plain name. The schema types its fields with these enums;
``CHOICES``, ``llmforge keys`` and the plan's choice check read them from there. Code
compares members (``layout.recompute == Recompute.FULL``), never the names, outside
this module (``tests/test_vocabulary.py`` holds that).

``class X(str, Enum)`` rather than ``enum.StrEnum``: the project supports Python 3.10.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum, EnumMeta
from typing import Any, TypeVar

from llmforge.errors import Problem, nearest

_E = TypeVar("_E")


class _ByValue(EnumMeta):
    """``Kind["value"]`` finds a member by its value, the name a config writes (never by its
    Python name): OmegaConf reads a YAML or command-line string into an Enum field with
    ``Kind[string]``, so ``recompute: FULL`` is refused as ``parallel.recompute=FULL`` is."""

    def __getitem__(cls: type[_E], name: str) -> _E:
        member: _E | None = cls._value2member_map_.get(name)  # type: ignore[attr-defined]
        if member is None:
            raise KeyError(name)
        return member


class Choice(str, Enum, metaclass=_ByValue):
    """One of a key's names; reads, prints and serialises as that name."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The names a config may write, in declaration order."""
        return tuple(str(m.value) for m in cls)


class Norm(Choice):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class Activation(Choice):
    GELU = "gelu"
    SWIGLU = "swiglu"


class Position(Choice):
    LEARNED = "learned"
    ROPE = "rope"


class AttentionMask(Choice):
    CAUSAL = "causal"
    DOCUMENT = "document"


class MoeBalance(Choice):
    AUX = "aux"
    BIAS = "bias"
    NONE = "none"


class Schedule(Choice):
    """Pipeline schedules (``parallel.pp_schedule``), as torch.distributed.pipelining runs them."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    LOOPED_BFS = "looped_bfs"
    ZB_INTERLEAVED = "zb_interleaved"
    ZBV = "zbv"


class Recompute(Choice):
    """Activation recomputation modes (``parallel.recompute``)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Offload(Choice):
    """``parallel.offload``: what lives in host memory."""

    NONE = "none"
    STATES = "states"


class Dtype(Choice):
    """Precision names (``precision.param_dtype``, ``precision.reduce_dtype``)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Fp8Recipe(Choice):
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"


class Fp8Linears(Choice):
    """``precision.fp8_linears``: which of a block's linear layers float8 converts
    (``llmforge.blockspec.fp8``): ``auto`` those whose shape is large enough for float8 to pay
    (torchao's size rule for the recipe), ``all`` every one whose dimensions are multiples of 16."""

    AUTO = "auto"
    ALL = "all"


class Qat(Choice):
    """``precision.qat``: none, or the torchao scheme llmforge.parallel.qat applies."""

    NONE = "none"
    INT8_INT4 = "int8-int4"
    INT4 = "int4"


class DataSource(Choice):
    BUILTIN = "builtin"
    FILES = "files"


class Optimizer(Choice):
    """``optim.name``: the optimizers a run can use."""

    ADAMW = "adamw"
    MUON = "muon"


class NsDtype(Choice):
    """``optim.muon_ns_dtype``: the dtype of Muon's Newton-Schulz iterations."""

    FP32 = "fp32"
    BF16 = "bf16"


class LrSchedule(Choice):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"
    WSD = "wsd"


class DecayShape(Choice):
    LINEAR = "linear"
    COSINE = "cosine"
    SQRT = "sqrt"


class MemorySnapshot(Choice):
    OFF = "off"
    OOM = "oom"
    PROFILE = "profile"


class AnomalyAction(Choice):
    """What a step with a non-finite loss or gradient norm makes the run do (``train.anomaly``)."""

    STOP = "stop"
    SKIP = "skip"
    ROLLBACK = "rollback"


class Rehearse(Choice):
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class Launcher(Choice):
    """``cluster.launcher``: where and how a run starts."""

    LOCAL = "local"
    TORCHRUN = "torchrun"
    SLURM = "slurm"
    KUBERNETES = "kubernetes"
    SKYPILOT = "skypilot"


class KubernetesKind(Choice):
    """``cluster.kubernetes.kind``: the Kubernetes resource a launch writes."""

    TRAINJOB = "trainjob"
    JOBSET = "jobset"


class WandbMode(Choice):
    AUTO = "auto"
    ONLINE = "online"
    OFFLINE = "offline"
    DISABLED = "disabled"


def choice_type(annotation: Any) -> type[Choice] | None:
    """The Choice enum of a field's resolved annotation (``X`` or ``X | None``), or None."""
    candidates = getattr(annotation, "__args__", None) or (annotation,)
    for kind in candidates:
        if isinstance(kind, type) and issubclass(kind, Choice):
            return kind
    return None


def choice_problem(key: str, value: object, allowed: Iterable[str]) -> Problem:
    """The message for a value that is none of a choice key's names."""
    names = list(allowed)
    return Problem(key, value, f"not a valid choice{nearest(str(value), names)}", f"use one of: {', '.join(names)}")


def plain(value: Any) -> Any:
    """``value`` with every Choice member (in dicts, lists and tuples) replaced by its plain string."""
    if isinstance(value, Choice):
        return str(value.value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value
