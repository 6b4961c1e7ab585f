"""A state tree on the wire without pickle (healing must not unpickle a peer's bytes): a JSON
header and the tensors' bytes as ``uint8`` views, which alias the caller's contiguous CPU tensors
(valid for one send only). ``decode_tree`` refuses anything else with ``ValueError``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_NAMES = "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 bool"
_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in _NAMES.split()}


def encode_tree(tree: Any) -> tuple[bytes, list[Tensor]]:
    """The JSON header of ``tree`` and its tensors as contiguous CPU ``uint8`` tensors."""
    tensors: list[Tensor] = []
    node = _encode(tree, tensors)
    return json.dumps(node, separators=(",", ":")).encode(), tensors


def _encode(value: Any, tensors: list[Tensor]) -> Any:
    if isinstance(value, Tensor):
        name = str(value.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {value.dtype} during healing")
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        tensors.append(flat.view(torch.uint8))
        return {"T": [name, list(value.shape)]}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise TypeError(f"healing state keys must be str or int, got {key!r}")
            items.append([key, _encode(item, tensors)])
        return {"D": items}
    if isinstance(value, list | tuple):
        return {"L" if isinstance(value, list) else "U": [_encode(v, tensors) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return {"V": value}
    raise TypeError(
        f"healing state holds a {type(value).__name__}; only tensors, numbers, strings, None "
        "and dicts/lists/tuples of them travel between islands"
    )


def tensor_specs(header: bytes) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every tensor the header names, in wire order."""
    specs: list[tuple[torch.dtype, tuple[int, ...]]] = []
    _decode(_load(header), lambda body: specs.append(_spec(body)))
    return specs


def _load(header: bytes) -> Any:
    try:
        return json.loads(header.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"a healing header is not valid JSON ({err})") from err


def _spec(body: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    dtype_name, shape = body
    if dtype_name not in _DTYPES or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"a healing header names an unknown tensor {body!r}")
    return _DTYPES[dtype_name], tuple(shape)


def byte_size(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def receive_buffers(header: bytes) -> list[Tensor]:
    """An empty ``uint8`` tensor for each tensor the header names, in wire order."""
    return [torch.empty(byte_size(d, s), dtype=torch.uint8) for d, s in tensor_specs(header)]


def decode_tree(header: bytes, payload: list[Tensor]) -> Any:
    """Rebuild the tree from its header and the received ``uint8`` tensors (adopted, not copied)."""
    specs = tensor_specs(header)
    if len(specs) != len(payload):
        raise ValueError(f"a healing header names {len(specs)} tensors, {len(payload)} arrived")
    tensors = []
    for (dtype, shape), raw in zip(specs, payload, strict=True):
        if raw.numel() != byte_size(dtype, shape):
            raise ValueError(f"a healing tensor of {shape} {dtype} arrived with {raw.numel()} B")
        tensors.append(raw.view(dtype).reshape(shape))
    received = iter(tensors)
    return _decode(_load(header), lambda _body: next(received))


def _decode(node: Any, tensor: Callable[[Any], Any]) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"a healing header holds a malformed node {node!r:.80}")
    ((kind, body),) = node.items()
    if kind not in ("T", "D", "L", "U", "V"):
        raise ValueError(f"a healing header holds an unknown node kind {kind!r}")
    if kind == "T":
        return tensor(body)
    if kind == "D":
        return {key: _decode(item, tensor) for key, item in body}
    if kind == "L":
        return [_decode(item, tensor) for item in body]
    if kind == "U":
        return tuple(_decode(item, tensor) for item in body)
    if body is not None and not isinstance(body, bool | int | float | str):
        raise ValueError(f"a healing header holds a non-scalar value {body!r:.80}")
    return body
