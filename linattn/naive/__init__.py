"""Level 1, naive: token-by-token recurrences and quadratic parallel forms — the ground truth.

Run them on float64 inputs to get the reference every other level is checked against.
Plain PyTorch, differentiated by autograd: to any order (create_graph=True) and by torch.func.grad /
jacrev. Not by torch.func.vmap (outputs are written in place): batch along B instead.
"""
from .linear import linear_attn, linear_attn_parallel

__all__ = ["linear_attn", "linear_attn_parallel"]
from .delta import delta_rule, kda; __all__ += ["delta_rule", "kda"]  # noqa: E402,E702
from .gated import gla, gla_parallel; __all__ += ["gla", "gla_parallel"]  # noqa: E402,E702
from .step import delta_rule_step, gla_step, kda_step, linear_attn_step; __all__ += ["linear_attn_step", "gla_step", "delta_rule_step", "kda_step"]  # noqa: E402,E702,E501
from . import backward; __all__ += ["backward"]  # noqa: E402,E702
