"""One run() through the C fast path's runner (:mod:`tessera._fast`), shared by the wrappers and
the Hugging Face backend (:mod:`tessera.integrations.transformers`)."""

from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

import numpy as np

from .._capi import check
from .._dlpack import empty
from ._args import _RUN_NAMES, ArrayLike

NOT_SERVED = object()  # fast_run: the ctypes path must run the call


def fast_run(runner: Any, inputs: tuple, out: Optional[ArrayLike] = None,
             lse: Optional[ArrayLike] = None, return_lse: bool = False) -> Any:
    """One run() through a C fast-path runner (tessera._fast.runner): its result, or NOT_SERVED
    when the runner hands the call back (an argument it does not describe exactly; the ctypes
    path decides). `inputs` are the run's inputs in the C order, q first. Errors of the C run
    raise here."""
    q = inputs[0]
    if out is None and lse is None and not return_lse and _is_torch(q):
        # The extension allocates out itself (torch, through DLPack's exchange API) and
        # returns it; no allocator comes back as -1 (then allocated below).
        result = runner(*inputs, None, None)
        if type(result) is not int:
            return result
        if result > 0:
            check(result, _RUN_NAMES)
    if out is not None and lse is None and not return_lse:
        o, o_lse = out, None
    else:
        o, o_lse = _fast_outputs(q, out, lse, return_lse)
    if o is None:
        return NOT_SERVED
    status = runner(*inputs, o, o_lse)
    if not status:
        return (o, o_lse) if return_lse else o
    if status > 0:
        check(status, _RUN_NAMES)
    return NOT_SERVED  # -1


def _is_torch(obj: Any) -> bool:
    """A torch.Tensor or nn.Parameter (exact types: what the C fast path describes)."""
    torch = sys.modules.get("torch")
    return torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter)


def _fast_outputs(q: ArrayLike, out: Optional[ArrayLike], lse: Optional[ArrayLike],
                  return_lse: bool) -> Tuple[Optional[ArrayLike], Optional[ArrayLike]]:
    """run()'s outputs for the fast path, allocated as the ctypes path allocates them (out like
    q, lse float32 [rows, heads]), or (None, None) when q is not a numpy array / torch tensor."""
    if type(q) is np.ndarray:
        kind = "numpy"
    elif _is_torch(q):
        kind = "torch"
    else:
        return None, None
    if out is None:
        if kind == "numpy":
            out = np.empty(q.shape, q.dtype)
        else:
            # empty_like: about 4 us cheaper per call than torch.empty(shape, dtype=, device=);
            # contiguous, as the ctypes path's output.
            torch = sys.modules["torch"]
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None and return_lse:
        lse = empty(q, None, tuple(q.shape)[:2], "float32", "lse")  # type: ignore[arg-type]
    return out, lse
