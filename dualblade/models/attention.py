"""Attention of the OPT engine, and why a decode step on CUDA does not call SDPA.

A decode step attends one new row per sequence to every cached row, and the cache grows by one
row each step: every step is a new shape. On the H200 machine (torch 2.13, cuDNN 9) PyTorch's
``scaled_dot_product_attention`` picks cuDNN's attention for these shapes, and cuDNN builds an
execution plan for each shape it has not seen: 70-80 ms of CPU in the first layer of every
step (torch's profiler: ``aten::_cudnn_attention_forward``), the later layers reusing the plan.
With the whole OPT-6.7B cache in the page cache a step reads its KV in about 0.3 s, and the
store's reads stood still while that plan was built, because every read buffer was full
(docs/bench.md). Two matrix products and a softmax need no plan, and with a single query row
they cost about as much as SDPA's kernels.

Only one-row queries on CUDA take that form: on the host SDPA's kernel reads the cache's strided
rows in place, where the products would first copy them; the prefill (a fixed shape, planned
once per prompt length) keeps SDPA as well.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Scaled dot-product attention of ``q`` ``[batch, heads, rows, head_dim]`` over ``k`` and
    ``v`` ``[batch, heads, cached, head_dim]`` (``causal``: row ``i`` sees keys ``<= i``)."""
    if not causal and q.shape[-2] == 1 and q.is_cuda:
        return one_row_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def one_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of a single query row over every key, without SDPA's backends (see the
    module): softmax over the scores in float32, products in the inputs' dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q * scale, k.transpose(-1, -2)).float()
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(weights, v)
