"""What an exercise is: a function the reader writes, the library function that solves it, and a
generator of fresh random cases to grade it on.

Catalog modules (linattn/grade/catalog/chNN.py) each define EXERCISES = [Exercise(...), ...].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class Case:
    """One graded call: fn(*args, **kwargs). `dtype` picks the tolerance (default: first float arg)."""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    note: str = ""                      # shown in verdicts, e.g. "T=100 (not a multiple of C), bf16"
    dtype: Optional[torch.dtype] = None


@dataclass
class Exercise:
    name: str                           # "ch01.recurrent": chapter prefix + short name
    chapter: int
    title: str
    signature: str                      # what the reader's function must look like
    reference: Callable                 # the library's solution (what a solved workbook uses)
    cases: Callable[[int], list]        # seed -> list[Case]; a new seed for every check
    truth: Optional[Callable] = None    # float64 ground truth to compare with; default: reference
    tol: Optional[float] = None         # relative-error bound; default: testing.tolerance(dtype)
    unlocks: Optional[tuple] = None     # (op, level) the reader's passed version may stand in for
    hint: str = ""                      # one line shown when the answer is wrong
    outputs: tuple = ()                 # names of the returned values, e.g. ("o", "final_state")
    # Known mistakes, written out: (what the mistake is, function making it). A wrong answer whose
    # outputs all match one of them is told which, e.g. "reads S before adding k_tᵀ v_t". An
    # optional third entry is the relative error within which the outputs count as a match
    # (default: the case's tolerance).
    diagnoses: tuple = ()
    # For kernel exercises: the PyTorch code the kernel must match, shown by grade.spec(name).
    spec: Optional[Callable] = None
    # Kernel exercises: the reader's function and the reference get the case's tensors on the GPU
    # when there is one (a compiled kernel cannot read CPU memory); truths stay on the CPU.
    on_gpu: bool = False

    @property
    def ground_truth(self) -> Callable:
        return self.truth or self.reference
