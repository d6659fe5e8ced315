"""What a layer carries from one call to the next: the recurrent state and the short-conv cache.

A layer's `forward(x, state)` returns a new `LayerState`; passing it back continues the sequence.
The state remembers which layer and batch size made it, so a state handed to the wrong layer (or
to a batch of another size) fails by name instead of silently mixing two sequences.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..packing import check_cu_seqlens
from ..validate import Dims, InputError

_ids = itertools.count()


def new_owner() -> int:
    """A token that identifies one layer instance (ids of Python objects can be reused)."""
    return next(_ids)


@dataclass
class LayerState:
    memory: torch.Tensor          # recurrent state [B, H, K, V]; for softmax attention: keys [B, H, L, K]
    conv: torch.Tensor | None     # the last (width − 1) inputs of the short convolution [B, w−1, C]
    owner: int                    # which layer made it
    seen: int                     # tokens consumed so far (packed: by the whole row)
    values: torch.Tensor | None = None  # softmax attention only: the value cache [B, H, L, V]

    @property
    def batch(self) -> int:
        return self.memory.shape[0]

    def nbytes(self) -> int:
        """Memory this state holds: constant for linear layers, growing with `seen` for softmax."""
        return sum(t.numel() * t.element_size() for t in (self.memory, self.conv, self.values)
                   if t is not None)


def check_x(x, d_model: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"x must be a tensor [B, T, d_model], got {shape}")
    if x.shape[-1] != d_model:
        raise InputError(f"x must have d_model = {d_model} features in its last dimension, "
                         f"got shape {tuple(x.shape)}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise InputError(f"x must hold at least one sequence and one token, got shape {tuple(x.shape)}")


def check_packed(cu_seqlens, x, hkv) -> None:
    """Refuse a bad cu_seqlens before any work, with linattn.packing's check (x [1, T, d] packed).
    Under torch.compile the check is the operation's, when the graph runs: reading the boundaries
    to the host here would break the graph."""
    if cu_seqlens is None or torch.compiler.is_compiling():
        return
    dims = Dims(x.shape[0], x.shape[1], *hkv, scale=1.0, acc=torch.float32)
    check_cu_seqlens(cu_seqlens, dims, x.device)


def check_state(state, owner: int, batch: int, packed: bool = False) -> None:
    if state is None:
        return
    if not isinstance(state, LayerState):
        raise InputError(f"state must be a LayerState returned by this layer, got {type(state).__name__}")
    if state.owner != owner:
        raise InputError("state was made by another layer; pass each layer the state it returned")
    if state.batch != batch:
        where = f"cu_seqlens holds {batch}" if packed else f"x has {batch}"
        raise InputError(f"state holds a batch of {state.batch} sequences but {where}")
