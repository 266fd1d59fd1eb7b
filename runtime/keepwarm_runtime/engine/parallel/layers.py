"""The collectives that make a sharded model compute what the whole one does, as forward hooks.

``weights.tensor_parallel_plan.shard_plan`` says how each tensor is split; the loader gives each meta
parameter its rank's shape (``shard_parameters``) before filling it, and after filling calls
``install`` to add, per module style:

- ``rowwise``: one all-reduce of the layer's output (each rank's partial sum over its input slice;
  the bias only on rank 0, so it is added once);
- ``embedding_rowwise``: ids outside this rank's vocabulary rows look up row 0 and come out zero;
  one all-reduce assembles the embeddings;
- ``colwise_gather_output``: each rank's vocabulary slice of the logits is gathered (padded to equal
  widths for the all-gather, trimmed after); what follows the LM head (Gemma's final soft-capping)
  sees the whole vocabulary;
- fused experts: with expert parallel the router's choices are dispatched to the rank holding each
  expert (a rank runs only the (token, expert) pairs it holds: others are ``ROUTED_ELSEWHERE`` on the
  torch backend, weighted zero on a kernel), and one all-reduce of the experts' output combines them;
  without, each rank runs its slice of every expert and the same all-reduce sums them.

Attention needs nothing: the query, key and value projections split on head boundaries, transformers'
attention reshapes by ``-1`` heads, and the KV cache probe sizes each rank's cache by the heads it holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from keepwarm_runtime.engine.moe.experts import RUNNER_ATTR, ExpertsChoice, Runner
from keepwarm_runtime.engine.moe.reference import ROUTED_ELSEWHERE
from keepwarm_runtime.weights import tensor_parallel_plan as tp
from keepwarm_runtime.weights.tensor_parallel import Split, chunks, local_shape
from keepwarm_runtime.weights.tensor_parallel_plan import ShardPlan

WHOLE_ATTR = "_keepwarm_whole_shape"  # a split module's whole weight shape (its attributes say its own)


def shard_parameters(model: nn.Module, plan: ShardPlan) -> None:
    """Give every split meta parameter the shape this rank holds; tied parameters stay one."""
    replaced: dict[int, tuple[nn.Parameter, tuple[int, ...]]] = {}  # id -> (its shard, whole shape)
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module.named_parameters(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            split = plan.splits.get(full)
            if id(param) in replaced:  # tied to one already split (an LM head tied to the embedding)
                new, whole = replaced[id(param)]
            elif split is not None:
                whole = tuple(param.shape)
                shape = local_shape(whole, split, plan.sharding)
                new = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=False)
                replaced[id(param)] = new, whole
            else:
                continue
            module._parameters[name] = new
            if name == "weight":
                _held_features(module, whole, tuple(new.shape))


def _held_features(module: nn.Module, whole: tuple[int, ...], held: tuple[int, ...]) -> None:
    """A split Linear or Embedding describes the weight it holds (code such as engine/cpu_linear.py
    reads ``out_features``); the whole shape stays on it for the collectives."""
    setattr(module, WHOLE_ATTR, whole)
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = held
    elif isinstance(module, nn.Embedding):
        module.num_embeddings = held[0]


def install(model: nn.Module, plan: ShardPlan, experts: list[ExpertsChoice]) -> None:
    """Add each split module's collective (after the weights are filled and the experts prepared)."""
    backends = {choice.module: choice.backend for choice in experts}
    for name, style in plan.styles.items():
        module = model.get_submodule(name)
        if style == tp.ROWWISE:
            module.register_forward_hook(_sum_over_ranks)
        elif style == tp.VOCAB_EMBEDDING:
            _vocabulary_parallel(module, plan)
        elif style == tp.VOCAB_HEAD:
            _gathered_logits(module, plan)
        elif style == tp.EXPERTS:
            if plan.sharding.expert:
                _dispatch_to_held_experts(module, plan, backends.get(name))
            module.register_forward_hook(_sum_over_ranks)


def output_vocab_size(model: nn.Module) -> int:
    """The vocabulary the model's logits cover (a vocabulary-parallel head's whole vocabulary)."""
    head = model.get_output_embeddings()
    return getattr(head, WHOLE_ATTR, head.weight.shape)[0]


def _sum_over_ranks(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)
    return output


def _vocab_rows(whole: int, plan: ShardPlan) -> tuple[int, int, int]:
    """(first row, stop row, rows per rank) of this rank's vocabulary slice of ``whole`` rows."""
    split = Split(0, uneven=True)
    (start, stop, _), *_ = chunks(whole, split, plan.sharding)
    return start, stop, -(-whole // plan.sharding.size)


def _vocabulary_parallel(module: nn.Module, plan: ShardPlan) -> None:
    whole = getattr(module, WHOLE_ATTR)[0]
    start, stop, _ = _vocab_rows(whole, plan)
    state: dict[str, torch.Tensor] = {}

    def before(module: nn.Module, args):
        ids, *rest = args
        outside = (ids < start) | (ids >= stop)
        state["outside"] = outside
        return (torch.where(outside, 0, ids - start), *rest)

    def after(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        output = output.masked_fill(state.pop("outside").unsqueeze(-1), 0)
        dist.all_reduce(output)
        return output

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def _gathered_logits(module: nn.Module, plan: ShardPlan) -> None:
    whole = getattr(module, WHOLE_ATTR)[0]
    _, _, each = _vocab_rows(whole, plan)

    def after(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        held = output.shape[-1]
        padded = torch.nn.functional.pad(output, (0, each - held)) if held < each else output.contiguous()
        parts = [torch.empty_like(padded) for _ in range(plan.sharding.size)]
        dist.all_gather(parts, padded)
        return torch.cat(parts, dim=-1)[..., :whole]

    module.register_forward_hook(after)


def _dispatch_to_held_experts(module: nn.Module, plan: ShardPlan, backend: str | None) -> None:
    """Wrap the experts' runner so it sees only the (token, expert) pairs this rank holds."""
    first, count = tp.experts_held(module.num_experts, plan.sharding)
    inner: Runner = getattr(module, RUNNER_ATTR)
    skip = backend == "torch"  # the reference skips ROUTED_ELSEWHERE pairs; a kernel gets weight 0

    def run(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        held = (top_k_index >= first) & (top_k_index < first + count)
        index = torch.where(held, top_k_index - first, ROUTED_ELSEWHERE if skip else 0)
        weights = torch.where(held, top_k_weights, torch.zeros_like(top_k_weights))
        return inner(hidden, index, weights)

    setattr(module, RUNNER_ATTR, run)
