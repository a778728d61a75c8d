"""Flat 1-D state split between the device (a head) and host memory (a tail).

Fractional offloading keeps the first ``(1 − r)`` of a flat buffer on the device and the last ``r``
in CPU memory (pinned when CUDA is present), as in Mist: there is no per-tensor selection, a flat
buffer simply has a device-resident head and a host-resident tail (`mist.rules.offload_split`).
On CPU-only runs the "device" is the CPU as well; the head and tail are still separate tensors and every move is still a copy,
so that the tests exercise the same code path as a GPU run.
"""

from __future__ import annotations

import torch

from mist.rules.offload_split import device_elements


def host_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer; pinned (page-locked) when CUDA is available so that copies can be async."""
    return torch.empty(n, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())


def split_point(length: int, ratio: float) -> int:
    """Elements of a flat buffer of `length` that stay on the device when `ratio` is offloaded
    (`mist.rules.offload_split`)."""
    return int(device_elements(length, float(ratio)))


class SplitBuffer:
    """A logical flat tensor of `length` elements: [0, dev_len) on `device`, the rest on the host."""

    def __init__(self, length: int, ratio: float, dtype: torch.dtype, device: torch.device, zero: bool = True):
        self.length, self.dtype, self.device = length, dtype, torch.device(device)
        self.dev_len = split_point(length, ratio)
        alloc = torch.zeros if zero else torch.empty
        self.dev = alloc(self.dev_len, dtype=dtype, device=self.device)
        self.host = host_empty(length - self.dev_len, dtype)
        if zero:
            self.host.zero_()

    # ------------------------------------------------------------ views
    @property
    def device_bytes(self) -> int:
        return self.dev.numel() * self.dev.element_size()

    @property
    def host_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def pieces(self, lo: int, hi: int):
        """(part, part_lo, part_hi, out_lo) for the parts of [lo, hi): part is 'dev' or 'host'."""
        out = []
        a, b = max(lo, 0), min(hi, self.dev_len)
        if a < b:
            out.append(("dev", a, b, a - lo))
        a, b = max(lo, self.dev_len), min(hi, self.length)
        if a < b:
            out.append(("host", a - self.dev_len, b - self.dev_len, a - lo))
        return out

    def read(self, lo: int, hi: int, where: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Elements [lo, hi) as one tensor on `where` (a view when they already lie there)."""
        where = torch.device(where)
        dtype = dtype or self.dtype
        parts = self.pieces(lo, hi)
        if len(parts) == 1:
            name, a, b, _ = parts[0]
            src = getattr(self, name)[a:b]
            if src.device == where and src.dtype == dtype:
                return src
            return src.to(where, dtype)
        out = torch.empty(hi - lo, dtype=dtype, device=where)
        for name, a, b, o in parts:
            out[o : o + b - a].copy_(getattr(self, name)[a:b])
        return out

    def write(self, lo: int, src: torch.Tensor) -> None:
        """Copy the 1-D tensor `src` (any device/dtype) into elements [lo, lo + len(src))."""
        for name, a, b, o in self.pieces(lo, lo + src.numel()):
            getattr(self, name)[a:b].copy_(src[o : o + b - a])

    def add_(self, src: torch.Tensor) -> None:
        """Accumulate a full-length device tensor: head on the device, tail on the host."""
        if self.dev_len:
            self.dev.add_(src[: self.dev_len])
        if self.host.numel():
            self.host.add_(src[self.dev_len :].to("cpu"))

    def copy_(self, src: torch.Tensor) -> None:
        self.write(0, src)
