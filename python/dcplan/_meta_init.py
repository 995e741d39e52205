"""dcplan.shard() of a model built on the meta device: each module's own parameters and buffers
are made on the target device and initialised one module at a time, and only this rank's shard
is kept, so no rank ever holds the whole model.

Every rank initialises every module from the same random state, in the order of
``model.named_modules()``: with ``reset_parameters()`` (torch's layers) that is the order and the
draws of the model's own construction, so the shards equal a model built on one rank from the
same seed. What differs: a parameter tied to one made earlier is not drawn again (a plain model
draws it in its own module and then replaces it), and an init done outside ``reset_parameters``
(after construction, in the model's ``__init__``) is not repeated unless ``init`` does it.
"""
from __future__ import annotations

from typing import Callable, Container, Dict, Optional

import torch
from torch import nn

Init = Optional[Callable[[nn.Module], None]]


def _meta_tensors(module: nn.Module):
    """module's own (not its children's) parameters and buffers on the meta device, by name."""
    own = list(module._parameters.items()) + list(module._buffers.items())
    return [(name, t) for name, t in own if t is not None and t.is_meta]


def check(model: nn.Module, device, init: Init) -> Optional[torch.device]:
    """The device a meta-device model is made on (None for a model that is not on the meta
    device); a ValueError names what cannot be made, before anything is changed."""
    params = [p.is_meta for p in model.parameters()]
    if not any(params):
        for name, value in (("init", init), ("device", device)):
            if value is not None:
                raise ValueError(f"dcplan.shard: {name}= is for a model built on the meta device; this model's "
                                 f"parameters are already made (leave {name} out)")
        return None
    if not all(params):
        raise ValueError("dcplan.shard: some parameters are on the meta device and others are not; build the "
                         "whole model on the meta device, or materialize all of it")
    if init is not None and not callable(init):
        raise ValueError(f"dcplan.shard: init should be a function of a module, got {type(init).__name__}")
    for name, module in model.named_modules():
        meta = _meta_tensors(module)
        if not meta or init is not None:
            continue
        where = f"module '{name}' ({type(module).__name__})" if name else f"the root module ({type(module).__name__})"
        if any(n in module._buffers for n, _ in meta):
            buffer = next(n for n, _ in meta if n in module._buffers)
            raise ValueError(f"dcplan.shard: buffer '{buffer}' of {where} is on the meta device and "
                             "reset_parameters() does not make buffers; pass init=fn, where fn(module) "
                             "initialises a module's own parameters and buffers")
        if not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(f"dcplan.shard: {where} has parameters on the meta device "
                             f"({', '.join(n for n, _ in meta)}) and no reset_parameters(); pass init=fn, where "
                             "fn(module) initialises a module's own parameters and buffers")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def materialize(module: nn.Module, device: torch.device, init: Init, made: Container[int]) -> Dict[str, nn.Parameter]:
    """module's own meta-device parameters and buffers, made on device and initialised; a
    parameter in made (by id: tied to one of an earlier module) stays as it is, for the caller to
    tie to that one's shard. Returns the meta parameters replaced, by attribute."""
    replaced: Dict[str, nn.Parameter] = {}
    for name, p in list(module._parameters.items()):
        if p is not None and p.is_meta and id(p) not in made:
            module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            replaced[name] = p
    buffers = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
    for name in buffers:
        module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
    if replaced or buffers:
        with torch.no_grad():
            if init is not None:
                init(module)
            else:
                module.reset_parameters()
    return replaced
