"""Where one KV-cache block lives in the worker's KV tensors, as bytes.

A chunk's payload is the block's bytes of every layer (sorted by layer
name), each layer's block in its tensor's own element order. On a CPU KV
cache those bytes are a few contiguous runs per layer (one for a
``[num_blocks * per, ...]`` layout, one per K and V for ``[2, num_blocks *
per, ...]``), so a load reads the payload straight into them and a save
writes straight from them: ``segments`` hands out writable byte views of the
KV cache itself, in payload order. A KV cache on an accelerator moves in
batches of blocks through host memory instead (``device_transfer.py``, over
``block_major``); ``staged`` and ``unstage`` copy one block, the reference
those batches are tested against.
"""

from __future__ import annotations

import hashlib
import json

import torch

# Same-size integer types: gathers and scatters move a layer's elements as
# bits, for every KV dtype (fp8 included) on every device.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def contiguous_runs(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s elements in order, as contiguous tensors."""
    if t.is_contiguous():
        return [t]
    return [run for i in range(t.shape[0]) for run in contiguous_runs(t[i])]


def bytes_view(t: torch.Tensor) -> memoryview:
    """A writable view of the bytes of the contiguous CPU tensor ``t``."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


class BlockLayout:
    """The layers of one worker's KV cache, and the bytes of a block in them.

    Args:
        kv_caches: vLLM's KV tensors by layer name (``register_kv_caches``).
        num_blocks: the number of KV-cache blocks each tensor holds.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self._layers: list[tuple[torch.Tensor, int, int]] = []  # tensor, dim, per
        for name in sorted(kv_caches):
            kv = kv_caches[name]
            if kv.dim() >= 2 and kv.shape[0] == 2 and kv.shape[1] % num_blocks == 0:
                dim = 1
            elif kv.shape[0] % num_blocks == 0:
                dim = 0
            else:
                raise ValueError(
                    f"StoreConnector: cannot find the block dimension of layer "
                    f"{name!r} (shape {tuple(kv.shape)}, {num_blocks} blocks)"
                )
            self._layers.append((kv, dim, kv.shape[dim] // num_blocks))
        self.on_host = all(kv.device.type == "cpu" for kv, _, _ in self._layers)
        # Per layer: its bytes, and per block the (start, length) runs of
        # block 0 (a block's runs are block 0's shifted by ``step`` bytes
        # per block). Slicing these is what ``segments`` costs per block.
        self._runs: list[tuple[memoryview, int, list[tuple[int, int]]]] = []
        if self.on_host and all(kv.is_contiguous() for kv, _, _ in self._layers):
            for kv, dim, per in self._layers:
                size = kv.element_size()
                row = kv.stride(dim) * size
                outer = [i * kv.stride(0) * size for i in range(kv.shape[0])]
                starts = outer if dim == 1 else [0]
                self._runs.append(
                    (bytes_view(kv), per * row, [(o, per * row) for o in starts])
                )
        self.block_bytes = (
            sum(v.numel() * v.element_size() for v in self._views(0))
            if self._layers
            else 0
        )
        # What the payload's byte order follows: per layer, a block's shape
        # in the tensor's element order and its dtype. The attention backend
        # picks both (its kernel block size splits a block's tokens, and
        # some put heads before tokens), so servers with the same model and
        # cache spec may differ here; the KV cache's size does not count.
        described = [
            [name, list(view.shape), str(view.dtype)]
            for name, view in zip(sorted(kv_caches), self._views(0), strict=True)
        ]
        self.digest = hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]

    @property
    def device(self) -> torch.device:
        return self._layers[0][0].device

    def block_major(self) -> list[torch.Tensor]:
        """Per layer, a view of its tensor with the blocks on dim 0, as
        same-size integers: row ``b`` holds block ``b``'s elements in the
        payload's order (``kv.narrow(dim, b * per, per)``'s), so gathering
        rows yields the blocks' payload bytes, layer by layer."""
        views = []
        for kv, dim, per in self._layers:
            # Splitting one dimension is a view of any strides.
            split = (*kv.shape[:dim], kv.shape[dim] // per, per, *kv.shape[dim + 1 :])
            views.append(kv.view(_BITS[kv.element_size()]).view(split).movedim(dim, 0))
        return views

    def _views(self, block_id: int) -> list[torch.Tensor]:
        return [kv.narrow(dim, block_id * per, per) for kv, dim, per in self._layers]

    def segments(self, block_id: int) -> list[memoryview]:
        """Writable byte views of block ``block_id`` in the KV cache, in
        payload order. Host KV caches only (``on_host``)."""
        assert self.on_host
        if self._runs:
            return [
                base[start + block_id * step : start + block_id * step + length]
                for base, step, runs in self._runs
                for start, length in runs
            ]
        return [
            bytes_view(run)
            for view in self._views(block_id)
            for run in contiguous_runs(view)
        ]

    def staged(self, block_id: int) -> torch.Tensor:
        """Block ``block_id``'s payload copied to a host buffer."""
        parts = [
            v.contiguous().view(torch.uint8).reshape(-1) for v in self._views(block_id)
        ]
        return torch.cat(parts).cpu()

    def unstage(self, block_id: int, staging: torch.Tensor) -> None:
        """Copy a payload read into the host buffer ``staging`` into block
        ``block_id`` (a KV cache off the host)."""
        offset = 0
        for view in self._views(block_id):
            size = view.numel() * view.element_size()
            src = staging[offset : offset + size].view(view.dtype).view(view.shape)
            view.copy_(src)
            offset += size
