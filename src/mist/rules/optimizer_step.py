"""The device memory an optimizer step works in: the fp32 gradient pieces it reads.

A unit's optimizer range (`flat_units.optimizer_len`: L elements) has its first d on the device
(`offload_split.device_elements` of the optimizer fraction) and its gradient buffer its first
g_dev elements. The runtime's step (`runtime.optimizer.ShardedAdamW`) walks both in pieces of at
most `STEP_CHUNK` elements, unit after unit, and drops each piece before it reads the next:

- the device AdamW over [0, d) reads each piece of the gradient as fp32: in place where the buffer
  is fp32 and the piece lies in its device head (`SplitBuffer.read` returns a view), else into a
  new fp32 tensor on the device (a 16-bit gradient is converted; a piece reaching into the host
  tail is gathered);
- on a GPU, the gradient's device head beyond d, [d, min(g_dev, L)), is on its way to the host
  AdamW: each piece is converted to fp32 on the device and copied out (on a CPU the conversion
  happens in host memory, which `simulate.states.unit_host_states` counts).

So a step holds the states plus 4 bytes times the largest of those pieces over the stage's units,
and the pieces bound it whatever the unit's size: whole, a 7B model's block at TP 1 would add
two fp32 copies of 0.8 GB each (the next unit's was read before the last one's was dropped).
"""

from __future__ import annotations

from mist.rules.values import maximum, minimum, where

# elements of a piece: 128 MiB of fp32, enough that each kernel of the step streams for tens of
# microseconds on an HBM GPU (a launch costs a few), small next to any device's memory
STEP_CHUNK = 1 << 25
GRAD_COPY_BYTES = 4  # the pieces are fp32


def chunks(lo: int, hi: int, size: int | None = None) -> list[tuple[int, int]]:
    """[lo, hi) in consecutive pieces of `size` (default `STEP_CHUNK`) elements from lo, the last
    one shorter."""
    size = size or STEP_CHUNK
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


def update_read_elements(d, g_dev, grad_fp32, size: int | None = None):
    """Elements of the largest fp32 piece the device AdamW of a unit allocates to read its
    gradient (0 where every piece is read in place): the pieces of [0, d) that are copies are all
    of them for a 16-bit gradient, else those reaching beyond the buffer's device head g_dev; of
    the latter, the first starts at the piece boundary at or below g_dev."""
    size = size or STEP_CHUNK
    first_copied = (g_dev // size) * size
    largest_beyond = where(g_dev >= d, 0, minimum(size, d - minimum(first_copied, d)))
    return where(grad_fp32, largest_beyond, minimum(size, d))


def host_bound_elements(d, g_dev, L, size: int | None = None):
    """Elements of the largest fp32 piece a GPU converts on the device for the host AdamW: the
    gradient's device head beyond the device optimizer range, [d, min(g_dev, L))."""
    size = size or STEP_CHUNK
    return minimum(size, maximum(minimum(g_dev, L) - d, 0))
