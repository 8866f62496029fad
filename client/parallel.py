"""Parallelism applied to an unchanged model, one function per strategy (after torchtitan).

``apply_ddp`` and ``apply_fsdp`` wrap a plain `DefectCNN`; ``full_state_dict`` gathers the plain,
unsharded, unwrapped weights (no ``module.``/``_module.`` prefixes) that leave the agent.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from common.models import ConvBlock

PARALLELISMS = ("none", "ddp", "fsdp")


def apply_ddp(model: nn.Module, dp: bool = False) -> nn.Module:
    """DDP; with DP-SGD Opacus' DPDDP, which all-reduces the *noised* per-sample-clipped gradients."""
    if dp:
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

        return DPDDP(model)
    device_ids = [torch.cuda.current_device()] if dist.get_backend() == "nccl" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def apply_fsdp(model: nn.Module, mixed_precision: bool = False) -> nn.Module:
    """FSDP2 (``fully_shard``): each conv block is a unit, then the root (the head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mixed_precision else {}
    for module in model.modules():
        if isinstance(module, ConvBlock):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each conv block's activations in backward (less memory, more compute); keys unchanged."""
    from torch.utils.checkpoint import checkpoint

    for module in model.modules():
        if isinstance(module, ConvBlock) and not getattr(module, "_checkpointed", False):
            plain_forward = module.forward
            module.forward = lambda x, f=plain_forward: checkpoint(f, x, use_reentrant=False)  # type: ignore[method-assign]
            module._checkpointed = True
    return model


def unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") or hasattr(model, "_module"):
        model = getattr(model, "module", None) or model._module
    return model


def full_state_dict(model: nn.Module) -> OrderedDict[str, np.ndarray]:
    """Plain, unsharded weights as numpy (a collective under FSDP: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    plain = unwrap(model)
    if any(type(p).__name__ == "DTensor" for p in plain.parameters()):
        state = get_model_state_dict(plain, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = plain.state_dict()
    return OrderedDict((k, (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy().copy()) for k, v in state.items())
