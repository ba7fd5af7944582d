"""Counting what a decode round asks of the device: compute operations and host→device copies.

On a GPU every compute operation is at least one kernel launch (a few microseconds), and every copy from
host memory blocks the stream, so the CPU can no longer run ahead of the GPU. Both counts are
deterministic, so they gate changes where timings on a shared CPU are noise.

- `count_operations(work)`: the aten operations `work` dispatches, views and host scalar reads excluded
  (a view launches nothing; a scalar read is the round's one device→host transfer, counted apart).
- `count_host_copies(work)`: operations that take a tensor in host memory and give one on another device.
  Run the model on the `meta` device and no GPU is needed: every such operation would be a copy there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}
# Reads of a device value into Python (`.item()`, `.tolist()`, `bool(t)`): device→host, counted apart.
_SCALAR_READS = {"_local_scalar_dense"}
# Operations that only describe a tensor or alias its storage; they launch no kernel.
_COPIES = {"_to_copy", "copy_", "copy"}
_METADATA = {"_unsafe_view", "detach", "lift_fresh", "_to_copy_meta_noop", "set_", "resize_", "empty_like_meta"}


def _name(func: Any) -> str:
    return func._schema.name.split("::")[-1]


def _is_view(func: Any) -> bool:
    return torch.Tag.view_copy not in func.tags and any(
        a.alias_info is not None and not a.alias_info.is_write for a in func._schema.returns
    )


@dataclass
class OperationCount:
    compute: int = 0
    scalar_reads: int = 0
    host_copies: int = 0
    by_name: Counter = field(default_factory=Counter)

    def top(self, k: int = 12) -> list[tuple[str, int]]:
        return self.by_name.most_common(k)


class _Constructors(TorchFunctionMode):
    """`torch.tensor(data, device=...)` from Python data copies host memory to the device without dispatching
    an operation the dispatch mode could see; it is caught here."""

    def __init__(self, count: OperationCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CONSTRUCTORS and args and not isinstance(args[0], torch.Tensor):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                self.count.host_copies += 1
                self.count.compute += 1
                self.count.by_name["tensor(host data)"] += 1
        return func(*args, **kwargs)


class _Counting(TorchDispatchMode):
    def __init__(self, count: OperationCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        if name in _SCALAR_READS:
            self.count.scalar_reads += 1
            return out
        if _is_view(func) or name in _METADATA:
            return out
        self.count.compute += 1
        self.count.by_name[name] += 1
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        # A 0-dim host tensor beside device tensors is passed as a kernel argument, not copied, unless the
        # operation is the copy itself.
        from_host = any(t.device.type == "cpu" and (t.dim() > 0 or name in _COPIES) for t in inputs)
        if from_host and any(t.device.type != "cpu" for t in outputs):
            self.count.host_copies += 1
        return out


def count_operations(work: Callable[[], Any]) -> OperationCount:
    """Run `work` once, counting its compute operations (and host→device copies, if it runs off the host)."""
    count = OperationCount()
    with torch.no_grad(), _Constructors(count), _Counting(count):
        work()
    return count
