"""Gradient statistics for the noise scale from the backward pass training already runs.

Per step (design §3): the "small" gradients g_j, j = 1..J, each the mean gradient over
`small_batch` samples, and the big gradient ḡ (mean over the global batch B):

    s̄ = (1/J) Σ_j ‖g_j‖²        q = ‖ḡ‖²         (McCandlish et al. 2018, App. A)

Small gradients, chosen by `mode`:
- "microbatch" (COPUS): one per micro-batch per dp rank, J = dp·num_microbatches,
  small_batch = micro_batch_size. Method: a tensor hook on every parameter the forward uses
  (FSDP2's *unsharded* parameter, registered lazily by a forward pre-hook on each module that
  owns parameters) sees that micro-batch's local gradient before it is accumulated and takes its
  squared norm (one fused reduction, kept on the device; weighted and summed once per step).
  FSDP2 keeps its unsharded gradients unreduced until the last micro-batch
  (`set_requires_gradient_sync`), so nothing is synchronised per micro-batch and no gradient
  copy is kept; cost ≈ one fused norm per parameter per micro-batch. Under
  pipeline parallelism the same hooks fire inside each micro-batch's stage backward
  (Schedule1F1B / ScheduleGPipe run one full backward per micro-batch), so the method is the same.
- "rank": one per dp rank, J = dp, small_batch = micro_batch_size·num_microbatches. Method: a
  post-accumulate-grad hook on the unsharded parameter reads the accumulated local gradient at
  its num_microbatches-th call, i.e. FSDP2's reduce-scatter input (cpu-notes b1/b2/b5). Under a
  mixed-precision policy whose reduce dtype differs from the parameter dtype (bf16 compute,
  fp32 reduce), FSDP2 moves the earlier micro-batches' gradients into its own fp32 accumulator
  (`FSDPParam.unsharded_accumulated_grad`) after each no-sync backward and sets `p.grad = None`,
  so at the K-th call `p.grad` holds the last micro-batch only; the hook then adds that
  accumulator (fp32, one parameter at a time) before taking the norm. The accumulator is a
  private attribute of torch 2.13's FSDP2 (`_fsdp_accumulator`); when it is absent the hook reads
  `p.grad` alone, which is exact whenever FSDP2 accumulates in `p.grad` (fp32). Needs dp ≥ 2
  (the engine falls back to "microbatch" at dp = 1).

Sharding (design §3): each rank sums squared norms of its *local* shards; one all-reduce over the
world then sums over tp and pp shards and dp ranks. A tensor's local data is counted with weight
1/(number of ranks holding the same data): 1/tp for tensors replicated over tp (RMSNorm weights,
plain tensors in a TP model), and 1/size for every mesh dim on which a DTensor is `Replicate`.

Precision: under bf16 (FSDP2's MixedPrecisionPolicy) the hooks see bf16 unsharded gradients;
every squared norm is accumulated in fp32 (`_sqnorm`: `vector_norm(dtype=float32)`; `local_sqnorm`
casts to fp32) and the per-step sums travel as fp64 in the engine's one all-reduce.

Inner-product extras (opt-in, `keep_grads=True`): ip_sq_mean = (1/J) Σ_j (g_jᵀḡ)² needs every
g_j until ḡ is known. Memory: "microbatch" keeps num_microbatches copies of this rank's local
(tp/pp-sharded, dp-unsharded) gradient, "rank" keeps one; computing g_jᵀḡ all-gathers ḡ over
dp once per parameter (the size of one FSDP parameter all-gather).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

MODES = ("microbatch", "rank")


def replication_weight(t: torch.Tensor, tp: int) -> float:
    """1 / (number of ranks whose local data of `t` is identical), see module docstring."""
    if not isinstance(t, DTensor):
        return 1.0 / tp
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or ()
    w = 1.0 if "tp" in names else 1.0 / tp
    for i, pl in enumerate(t.placements):
        if pl.is_partial():
            raise AssertionError(f"unexpected Partial gradient placement {t.placements}")
        if pl.is_replicate():
            w /= mesh.size(i)
    return w


def local_sqnorm(t: torch.Tensor) -> torch.Tensor:
    """Σ x² over this rank's local data of `t` (fp32)."""
    x = t.to_local() if isinstance(t, DTensor) else t
    return x.detach().float().pow(2).sum()


def _sqnorm(x: torch.Tensor) -> torch.Tensor:
    """Σ x² of a plain tensor in one fused reduction: a BLAS dot for fp32 (no squared copy;
    2× faster than a norm kernel on CPU), else a norm accumulated in fp32, squared."""
    if x.dtype == torch.float32 and x.is_contiguous():
        flat = x.view(-1)
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(x, dtype=torch.float32).square()


def weighted_sqnorm(tensors: list[torch.Tensor], tp: int) -> torch.Tensor:
    """This rank's share of ‖·‖² over `tensors`: summed over all ranks it gives the full norm².

    Σ_t w_t·‖local(t)‖² with w_t = `replication_weight`: the tensors are grouped by (device,
    dtype, weight) and each group's norms come from ONE `torch._foreach_norm` (a fused
    multi-tensor kernel; a Python loop of per-tensor reductions costs ~25 ms for 291 tensors on
    CPU); the sum stays on the tensors' device (no host sync, no host-to-device copy). An empty
    list gives a CPU zero."""
    groups: dict[tuple[torch.device, torch.dtype, float], list[torch.Tensor]] = {}
    for t in tensors:
        x = (t.to_local() if isinstance(t, DTensor) else t).detach()
        groups.setdefault((x.device, x.dtype, replication_weight(t, tp)), []).append(x)
    out: torch.Tensor | None = None
    for (_device, _dtype, w), xs in groups.items():
        norms = torch._foreach_norm(xs, 2.0, dtype=torch.float32)  # fp32 accumulation
        part = torch.stack(norms).square().sum() * w
        out = part if out is None else out + part.to(out.device)
    return out if out is not None else torch.zeros((), dtype=torch.float32)


def model_device(model: nn.Module) -> torch.device:
    """The device of `model`'s first parameter (a DTensor's local device), CPU without any."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


class GradStats:
    """Hooks that accumulate this rank's share of Σ_j ‖g_j‖² (and keep g_j for the extras).

    Call `begin(num_microbatches, grad_scale)` before each step's backward passes; `grad_scale`
    converts what the hooks see into the mean-loss gradient of one small batch (the engine's
    manual accumulation backpropagates loss/K, a pipeline schedule backpropagates each
    micro-batch's mean loss and divides by K afterwards).
    """

    def __init__(self, model: nn.Module, tp: int, mode: str, keep_grads: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"gns_small={mode!r} is invalid; allowed: {', '.join(MODES)}")
        self.tp, self.mode, self.keep_grads = tp, mode, keep_grads
        self.device = model_device(model)  # where every statistics tensor lives
        self._fqn: dict[int, str] = {}  # id(unsharded param) -> parameter name
        self._calls: dict[int, int] = {}
        self.kept: dict[str, list[torch.Tensor]] = {}
        self._handles = []
        self._param_handles = []
        self._small: torch.Tensor | None = None  # created on the gradients' device
        self._norms: list[torch.Tensor] = []  # per-hook Σ x²
        self._weights: list[float] = []
        self._partial: list[torch.Tensor] = []
        self._partial_group = None
        self._k, self._scale = 1, 1.0
        # "rank" mode under mixed precision: FSDP2's parameter records, to find the fp32
        # accumulator that holds the earlier micro-batches' gradients (module docstring)
        self._fsdp_params = _fsdp_params(model) if mode == "rank" else []
        self._fsdp_of: dict[int, object] = {}
        # one pre-hook per transformer block (all its parameters; it runs outside a compiled
        # block forward, after FSDP2's unshard, so torch.compile sees no hook registration)
        # and one per other module that owns parameters (embeddings, final norm, head)
        layers = getattr(model, "layers", None)
        blocks = {f"layers.{k}" for k, _ in layers.named_children()} if isinstance(layers, nn.Module) else set()
        for mod_name, mod in model.named_modules():
            in_block = any(mod_name.startswith(b + ".") for b in blocks)
            if mod_name in blocks or (not in_block and any(p is not None for p in mod._parameters.values())):
                self._handles.append(
                    mod.register_forward_pre_hook(self._make_pre_hook(mod_name, recurse=mod_name in blocks))
                )

    def _make_pre_hook(self, mod_name: str, recurse: bool = False):
        def pre_hook(module: nn.Module, args) -> None:
            named = module.named_parameters(remove_duplicate=False) if recurse else module._parameters.items()
            for pname, p in named:
                if p is None or not p.requires_grad or id(p) in self._fqn:
                    continue
                self._fqn[id(p)] = f"{mod_name}.{pname}" if mod_name else pname
                if self.mode == "microbatch":
                    h = p.register_hook(self._make_grad_hook(id(p)))
                else:
                    h = p.register_post_accumulate_grad_hook(self._make_acc_hook(id(p)))
                self._param_handles.append(h)

        return pre_hook

    def _record(self, pid: int, g: torch.Tensor) -> None:
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            # sequence parallel: norm-weight gradients are partial sums over tp; reduce them in
            # one batched all-reduce in `small_sqnorm_sum` (a few × dim floats per micro-batch)
            dim = next(i for i, pl in enumerate(g.placements) if pl.is_partial())
            self._partial.append(g.to_local().detach().float().flatten() * self._scale)
            self._partial_group = g.device_mesh.get_group(dim)
            if self.keep_grads:
                self.kept.setdefault(self._fqn[pid], []).append(g.detach().float() * self._scale)
            return
        # weight from the gradient, not the parameter: DTensor may return a gradient with other
        # placements (a vocab-sharded embedding gets a Replicate gradient)
        local = (g.to_local() if isinstance(g, DTensor) else g).detach()
        # one fused reduction per hook (fp32 accumulation, no squared copy); the weighting and
        # the sum over parameters happen once per step in `small_sqnorm_sum` (no sync per hook)
        self._norms.append(_sqnorm(local))
        self._weights.append(replication_weight(g, self.tp))
        if self.keep_grads:
            self.kept.setdefault(self._fqn[pid], []).append(g.detach().float() * self._scale)

    def _make_grad_hook(self, pid: int):
        def hook(grad: torch.Tensor) -> None:
            self._record(pid, grad)

        return hook

    def _make_acc_hook(self, pid: int):
        def hook(p: torch.Tensor) -> None:
            self._calls[pid] = self._calls.get(pid, 0) + 1
            if self._calls[pid] == self._k:
                self._record(pid, self._accumulated(p))

        return hook

    def _accumulated(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's gradient of `p` summed over the step's micro-batches so far: `p.grad`
        plus FSDP2's reduce-dtype accumulator when it holds the earlier ones (module docstring)."""
        acc = _fsdp_accumulator(self._fsdp_record(p))
        return p.grad if acc is None else acc + p.grad.to(acc.dtype)

    def _fsdp_record(self, p: torch.Tensor):
        """FSDP2's record of the unsharded parameter `p` (None outside FSDP2)."""
        key = id(p)
        if key not in self._fsdp_of:
            self._fsdp_of[key] = next(
                (fp for fp in self._fsdp_params if getattr(fp, "_unsharded_param", None) is p), None
            )
        return self._fsdp_of[key]

    def begin(self, num_microbatches: int, grad_scale: float) -> None:
        self._k, self._scale = num_microbatches, grad_scale
        self._small = None
        self._norms.clear()
        self._weights.clear()
        self._partial.clear()
        self._calls.clear()
        self.kept.clear()

    def small_sqnorm_sum(self) -> torch.Tensor:
        """This rank's share of Σ_j ‖g_j‖² (sum over all ranks = the full sum over j).

        Collective over tp when sequence parallel produced partial gradients (all tp ranks of a
        stage call it at the same point of the step)."""
        if self._norms:
            # the weights are Python floats: grouped by weight, each group summed on the
            # device and scaled by a host scalar (no host-to-device copy of a weight vector,
            # which from pageable memory would synchronise a CUDA stream)
            by_weight: dict[float, list[torch.Tensor]] = {}
            for n, w in zip(self._norms, self._weights):
                by_weight.setdefault(w, []).append(n)
            total = sum(torch.stack(ns).sum() * w for w, ns in by_weight.items())
            total = total * self._scale**2
            self._small = total if self._small is None else self._small + total
            self._norms.clear()
            self._weights.clear()
        if self._partial:
            vec = torch.cat(self._partial)
            dist.all_reduce(vec, group=self._partial_group)
            self._partial.clear()
            part = vec.pow(2).sum() / self.tp
            self._small = part if self._small is None else self._small + part
        if self._small is None:  # no parameter of this rank saw a gradient
            self._small = torch.zeros((), device=self.device)
        return self._small

    def dots(self, model: nn.Module, index: int, length: int) -> torch.Tensor:
        """This rank's share of g_jᵀḡ for its small gradients, placed at `index`, `index+1`, ...
        of a zero vector of `length` (sum over all ranks gives every g_jᵀḡ). ḡ = the current
        (reduced, sharded) `.grad` of `model`'s parameters, all-gathered over "dp" here."""
        out = torch.zeros(length, dtype=torch.float64, device=self.device)
        params = dict(model.named_parameters())
        for name, kept in self.kept.items():
            full, tp_placement = _gather_dp(params[name].grad)
            w = 1.0 if tp_placement is not None and tp_placement.is_shard() else 1.0 / self.tp
            for k, gk in enumerate(kept):
                if isinstance(gk, DTensor):
                    if tp_placement is not None and gk.placements != (tp_placement,):
                        gk = gk.redistribute(gk.device_mesh, [tp_placement])
                    gk = gk.to_local()
                out[index + k] += w * (gk * full.float()).sum().to(out.device, torch.float64)
        return out

    def close(self) -> None:
        """Remove every hook and drop every reference to the model's tensors and FSDP2's
        records (no cycle through this object keeps them alive after the engine closes)."""
        for h in self._handles + self._param_handles:
            h.remove()
        self._handles, self._param_handles = [], []
        self.kept.clear()
        self._fsdp_params, self._fsdp_of = [], {}
        self._fqn.clear()
        self._calls.clear()
        self._norms.clear()
        self._partial.clear()
        self._small = self._partial_group = None


def _fsdp_params(model: nn.Module) -> list:
    """FSDP2's per-parameter records (`FSDPParam`) of every `fully_shard` unit in `model`."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            out.extend(group.fsdp_params if group is not None else [])
    return out


def _fsdp_accumulator(record) -> torch.Tensor | None:
    """FSDP2's fp32 accumulator of earlier no-sync micro-batches (torch 2.13's private
    `FSDPParam.unsharded_accumulated_grad`), None when there is none."""
    return getattr(record, "unsharded_accumulated_grad", None) if record is not None else None


def _gather_dp(g: torch.Tensor):
    """(dp-unsharded tp-local data of a sharded gradient, its placement on "tp" or None).
    A mesh without dim names (a user's own `fully_shard` mesh) is all data parallel."""
    if not isinstance(g, DTensor):
        return g, None
    names = g.device_mesh.mesh_dim_names or ("dp",) * g.device_mesh.ndim
    placements = [Replicate() if n == "dp" else p for n, p in zip(names, g.placements)]
    tp_placement = placements[names.index("tp")] if "tp" in names else None
    return g.redistribute(g.device_mesh, placements).to_local(), tp_placement
