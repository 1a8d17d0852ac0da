"""A stage's device and the copies between it and the host, where the wire is.

Every tensor a peer computes with lives on its stage's device (a CUDA GPU or the CPU). The wire is
on the host: protocol/ decodes received bytes into CPU tensors and encodes CPU tensors, on the event
loop, which must never touch a GPU tensor (a CUDA call can block it for as long as the GPU is
busy). So every tensor crosses between the two exactly here, on the stage's compute thread:

- in (`to_device`): a received host tensor is copied into page-locked (pinned) memory and sent
  to the GPU with `non_blocking=True`; the copy is queued on the current stream, so the kernels
  queued after it read the arrived values, and the compute thread does not wait for it;
- out (`to_host`): device tensors are copied into pinned host buffers with `non_blocking=True`,
  all of them first, then one synchronization of the stream: one host sync per batch of tensors,
  not one per tensor, and a DMA instead of the pageable path's staging copy;
- `synchronize` before a clock is read: CUDA kernels run asynchronously, so a timing taken
  without it measures how fast kernels are launched, not how fast they run.

On the CPU every one of these is a no-op or a plain copy: host and device are the same memory.
torch's caching host allocator recycles pinned blocks, so pinning per microbatch does not call
cudaHostAlloc per microbatch. Pinned memory needs an accelerator: a CPU-only torch refuses it,
which is why nothing here pins unless the device is CUDA.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["DeviceTransfers", "canonical_device", "device_problem", "peak_rss", "resolve_device"]


def canonical_device(device: torch.device | str) -> torch.device:
    """`device` with its index: `cuda` is the current CUDA device, e.g. `cuda:0`. A tensor's device
    always carries its index and `torch.device("cuda") != torch.device("cuda:0")`, so a stage's
    device is kept in this form for any comparison with where a tensor is."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_device(requested: str) -> torch.device:
    """`auto`: the first CUDA GPU when torch sees one, else the CPU; anything else as torch parses
    it; either way with its index (`canonical_device`)."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return canonical_device(requested)


def device_problem(requested: str) -> str | None:
    """Why a stage cannot compute on `requested` here (None: it can), in one line a command prints
    before it builds anything: torch's own refusal comes later, as a traceback from deep inside."""
    try:
        device = torch.device(requested)
    except RuntimeError:
        return f"--device {requested}: not a device (cpu, cuda or cuda:N)"
    if device.type == "cpu":
        return None
    if device.type != "cuda":  # DeviceTransfers copies between the host and CUDA, nothing else
        return f"--device {requested}: a stage computes on cpu or cuda, not {device.type}"
    if not torch.cuda.is_available():
        return f"--device {requested}: torch {torch.__version__} sees no CUDA device"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"--device {requested}: torch sees {torch.cuda.device_count()} CUDA device(s)"
    return None


class DeviceTransfers:
    """Copies between the host (the wire) and one stage's device. Call every method on the stage's
    compute thread (StageWorker.compute): they touch the device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = canonical_device(device)
        self.is_cuda = self.device.type == "cuda"

    # ---- host -> device ------------------------------------------------------------------------

    def to_device(self, tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """`tensor` (detached) on this device, cast to `dtype` when given. A host tensor headed for
        a GPU goes through pinned memory and a non-blocking copy."""
        tensor = tensor.detach()
        if tensor.device.type != "cpu":  # already on a device (this one, or another GPU)
            return tensor.to(self.device, dtype=dtype, non_blocking=self.is_cuda)
        if dtype is not None:
            tensor = tensor.to(dtype)  # cast on the host: the copy moves the final bytes once
        if not self.is_cuda:
            return tensor
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def to_device_all(self, tensors: Iterable[Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
        return [self.to_device(t, dtype) for t in tensors]

    def state_to_device(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A state dict's tensors on this device (names kept, dtypes kept)."""
        return dict(zip(state, self.to_device_all(state.values())))

    # ---- device -> host ------------------------------------------------------------------------

    def host_empty(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> Tensor:
        """An uninitialised host buffer to receive a wire tensor that will go to this device:
        pinned when the device is a GPU, so the later `to_device` needs no staging copy."""
        return torch.empty(tuple(shape), dtype=dtype, device="cpu", pin_memory=self.is_cuda)

    def to_host(self, tensors: Sequence[Tensor], copy: bool = False) -> list[Tensor]:
        """Detached host copies of `tensors` (one synchronization for all of them on a GPU). On the
        CPU the tensors themselves (detached) are returned unless `copy` asks for copies, which a
        caller needs when the originals keep changing (weights while training goes on)."""
        host: list[Tensor] = []
        for t in tensors:
            t = t.detach()
            if t.device.type == "cpu":
                host.append(t.clone() if copy else t)
                continue
            buffer = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            buffer.copy_(t, non_blocking=True)
            host.append(buffer)
        if self.is_cuda and any(t.device.type != "cpu" for t in tensors):
            self.synchronize()  # the non-blocking copies must have landed before the host reads them
        return host

    def state_to_host(self, state: Mapping[str, Tensor], copy: bool = True) -> dict[str, Tensor]:
        """A state dict's tensors on the host (copies by default: weights change while they wait)."""
        return dict(zip(state, self.to_host(list(state.values()), copy=copy)))

    # ---- clocks and memory ----------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every kernel queued on this device (nothing to wait for on the CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def peak_allocated(self) -> int | None:
        """Bytes: the most torch's allocator has held on this GPU since the process started (None
        on the CPU, where the process's peak RSS, `peak_rss`, is the measure)."""
        return int(torch.cuda.max_memory_allocated(self.device)) if self.is_cuda else None


def peak_rss() -> int:
    """Bytes: this process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
