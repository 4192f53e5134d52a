"""The native opt levels on torch.amp (the contract is in :mod:`kd.precision`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from kd.errors import KDError
from kd.nest import map_tensors

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SCALER_ARGS: Dict[str, Any] = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)


def amp_dtype(cfg, device: torch.device) -> torch.dtype:
    """float16 on CUDA (as apex), bfloat16 on the CPU, unless ``--amp-dtype`` says otherwise."""
    name = cfg.amp_dtype or ("float16" if device.type == "cuda" else "bfloat16")
    if device.type == "cpu" and name == "float16" and cfg.opt != "O0":
        raise KDError("--amp-dtype float16 needs CUDA; on the CPU use --amp-dtype bfloat16")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def make_scaler(device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaling for float16, on the schedule apex users know."""
    return torch.amp.GradScaler(device.type, **SCALER_ARGS)


# ----------------------------------------------------------------------------- casting helpers
def cast_module(module: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Cast floating parameters and buffers in place (the Parameter objects stay the same).

    BatchNorm layers stay float32 with ``keep_batchnorm_fp32``: torch's batch norm takes
    reduced-precision inputs with float32 weights and statistics (cudnn on CUDA, native on the
    CPU) and returns the input's dtype. KD loss modules are skipped: they stay float32.
    """
    if keeps_float32(module) or (keep_batchnorm_fp32 and isinstance(module, _BatchNorm)):
        return
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            setattr(module, name, buf.to(dtype))
    for child in module.children():
        cast_module(child, dtype, keep_batchnorm_fp32)


def keeps_float32(module: nn.Module) -> bool:
    """Whether ``module`` computes in float32 at every opt level: it says so with a class attribute
    ``float32_only = True`` (every KD loss, :class:`kd.losses.base.DistillLoss`), so that the
    precisions need not know the losses."""
    return bool(getattr(module, "float32_only", False))


def to_float32(obj):
    """``obj`` with every floating tensor in it (also in dicts, lists and dataclasses) as float32."""
    return map_tensors(lambda t: t.float() if t.is_floating_point() else t, obj)


def _float32_inputs(_module, args, kwargs):
    return to_float32(args), to_float32(kwargs)


def keep_losses_float32(model: nn.Module) -> List[nn.Module]:
    """The KD loss modules inside ``model``, each given a pre-hook that casts its inputs to float32."""
    losses: List[nn.Module] = [m for m in model.modules() if keeps_float32(m)]
    for loss in losses:
        loss.register_forward_pre_hook(_float32_inputs, with_kwargs=True)
    return losses


def float32_state(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def nonfinite_gradients(params: Iterable[torch.Tensor], found: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    """``found`` (0-dim float32, on the device) set to 1 where a gradient of ``params`` holds inf
    or NaN, else 0; no host sync (the loss scaler's own check, at scale 1)."""
    found.zero_()
    return check_and_unscale([p.grad for p in params], found, one)


def check_and_unscale(grads: Iterable[Optional[torch.Tensor]], found: torch.Tensor, inv_scale: torch.Tensor):
    """``grads`` (None skipped) multiplied by ``inv_scale`` in place, and ``found`` set to 1 where one
    holds inf or NaN (left as it was otherwise); returns ``found``. No host sync."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for g in grads:
        if g is not None:
            groups.setdefault((g.device, g.dtype), []).append(g)
    for tensors in groups.values():
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale.to(found.device))
    return found


def step_unless(optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
    """``optimizer.step()`` unless ``found``: on the device for optimizers that take the scaler's
    inf flag (fused SGD), else after one host read of the flag."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        # the attributes torch's GradScaler hands such optimizers (not in the Optimizer stubs)
        optimizer.grad_scale, optimizer.found_inf = None, found  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
    elif not found.item():
        optimizer.step()


# ----------------------------------------------------------------------------- O0
class Precision:
    """O0 and the base class: float32, no scaler. Subclasses override what their level changes.

    The engine calls ``convert(model, optimizer)`` once the optimizer is built and before the
    backend wraps the model; per batch ``input_cast(images)``, the student's forward inside
    ``autocast()``, then the pieces of an update (``backward``, ``unscale``, ``optimizer_step``,
    ``update``, ``finish``) through :func:`kd.run.step.apply_gradients`. The teacher's forward
    runs inside ``other_model_context()``.
    """

    opt = "O0"
    impl = "native"
    fused_optimizer_ok = True  # False where the precision patches the optimizer itself
    splits_gradients = True  # gives a part of the loss its gradients apart (gradients_apart), for DOT
    one_per_process = False  # True where it patches torch for the whole process (one student per run)

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32, note: Optional[str] = None):
        self.device = device
        self.dtype = dtype
        self.scaler: Optional[torch.amp.GradScaler] = None
        self.note = note  # why this implementation (say, why not apex), shown by describe()
        self._found = torch.zeros((), device=device)
        self._one = torch.ones((), device=device)

    def details(self) -> List[str]:
        return [dtype_name(self.dtype)]

    def describe(self) -> str:
        parts = [self.impl, *self.details(), "dynamic loss scaling" if self.scaler else "no loss scaling"]
        if self.note:
            parts.append(self.note)
        return f"precision {self.opt} ({', '.join(parts)})"

    def autocast(self):
        """Context for the forward passes of teacher and student."""
        return contextlib.nullcontext()

    def other_model_context(self):
        """Context for the forward of a model this precision does not own (the frozen teacher)."""
        return contextlib.nullcontext()

    def convert(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Tuple[nn.Module, torch.optim.Optimizer]:
        """``model`` and ``optimizer`` in this precision (weights cast, master weights in the
        optimizer, where the level has them); called once, after the optimizer is built and before
        the backend wraps the model."""
        return model, optimizer

    def input_cast(self, images: torch.Tensor) -> torch.Tensor:
        return images

    # The pieces of an update. kd.run.step.apply_gradients calls them in this order and owns the
    # policy: whether a step is skipped (the non-finite flag unscale returns) and whether the loss
    # scale may back off (keep_scale). A precision only carries them out.
    def backward(self, loss: torch.Tensor, sync: Callable[[], None]) -> None:
        """Back-propagate ``loss`` (scaled where the level scales it), then ``sync`` reduces the
        gradients across processes."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        sync()

    def gradients_apart(self, loss: torch.Tensor, params: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """The gradients of ``loss`` (scaled as :meth:`backward` scales it) for ``params``, in the
        optimizer's dtype, kept apart from ``.grad`` (None where ``loss`` does not reach one): DOT's
        distillation part, back-propagated before the rest with the graph kept. torch.autograd.grad
        runs no gradient hooks (DistributedDataParallel's reducer), so the caller averages them across
        processes; :meth:`unscale` unscales and checks them with the rest."""
        scaled = self.scaler.scale(loss) if self.scaler else loss
        grads = torch.autograd.grad(scaled, list(params), retain_graph=True, allow_unused=True)
        return [None if g is None else g.to(q.dtype) for g, q in zip(grads, self._optimizer_tensors(params))]

    def unscale(
        self,
        optimizer: torch.optim.Optimizer,
        params: Iterable[torch.Tensor],
        apart: Optional[List[Optional[torch.Tensor]]] = None,
    ):
        """The gradients made the optimizer's (float32 masters where the level keeps them) and
        unscaled; returns the tensors to clip and a 0-dim float on the device, non-zero where any
        of those gradients holds inf or NaN (no host sync). ``params``: the model's trainable ones;
        ``apart``: their gradients from :meth:`gradients_apart`, unscaled in place and checked too (a
        non-finite one skips the step and backs the loss scale off as any other)."""
        params = self._gradients_to_optimizer(params)
        scaler = self.scaler
        if scaler is None:  # no scaler to check the gradients: the same check here, at scale 1
            found = nonfinite_gradients(params, self._found, self._one)
            return params, check_and_unscale(apart or [], found, self._one)
        scaler.unscale_(optimizer)
        # what unscale_ found, per device (GradScaler keeps it for its step() and update())
        per_device = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if apart:
            inv_scale = cast(torch.Tensor, scaler._scale).double().reciprocal().float()  # as unscale_ has it
            found_apart = check_and_unscale(apart, torch.zeros_like(self._found), inv_scale)
            key = next(iter(per_device), self._found.device)
            per_device[key] = per_device.get(key, torch.zeros_like(self._found)) + found_apart.to(key)
        return params, torch.stack([f.to(self._found.device) for f in per_device.values()]).sum()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
        """``optimizer.step()`` unless ``found``."""
        step_unless(optimizer, found)

    def update(self, found: torch.Tensor, keep_scale: Optional[torch.Tensor] = None) -> None:
        """The loss scale's back-off (after ``found``) or growth; ``keep_scale`` (0-dim bool on the
        device): the step was refused for a cause the scale did not make (a non-finite loss), so
        the scale and its growth counter stay as they were."""
        scaler = self.scaler
        if scaler is None:
            return
        # _scale and _growth_tracker (Optional in the stubs) are set by scaler.scale(loss), before any update
        scale, tracker = cast(torch.Tensor, scaler._scale), cast(torch.Tensor, scaler._growth_tracker)
        scale_before, tracker_before = scale.clone(), tracker.clone()
        scaler.update()
        if keep_scale is not None:
            scale.copy_(torch.where(keep_scale, scale_before, scale))
            tracker.copy_(torch.where(keep_scale, tracker_before, tracker))

    def finish(self, optimizer: torch.optim.Optimizer) -> None:
        """After the update: the model's weights from the masters (where kept), gradients cleared."""
        self._after_step()
        optimizer.zero_grad(set_to_none=True)

    def _gradients_to_optimizer(self, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
        """Make the gradients visible to the optimizer; returns the tensors to clip."""
        return list(params)

    def _optimizer_tensors(self, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
        """The tensors the optimizer steps for ``params`` (their float32 masters where kept)."""
        return list(params)

    def _after_step(self) -> None:
        pass

    def loss_scale(self) -> torch.Tensor:
        """The current loss scale (1 for levels without scaling), a tensor: read without a sync."""
        if self.scaler is None:
            return self._one
        scale = self.scaler._scale
        return scale if scale is not None else torch.tensor(self.scaler.get_scale())

    def model_state(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The float32 weights to checkpoint (master weights where the level keeps them)."""
        return float32_state(model.state_dict())

    def masters(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The float32 master weights of ``model``'s parameters by name, the tensors themselves (none
        where the level keeps none: the optimizer steps the parameters)."""
        return {}

    def for_float32_copy(self) -> Precision:
        """The precision a float32 copy of the model is evaluated in (an average of its weights):
        this one where the model keeps float32 weights, else autocast to this level's dtype."""
        return self

    def load_model_state(self, model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
        model.load_state_dict(state)  # copy_ casts float32 values to the model's dtypes

    def state_dict(self) -> dict:
        state: Dict[str, Any] = {"opt": self.opt, "impl": self.impl, "dtype": dtype_name(self.dtype)}
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """The scaler's scale and growth tracker; a checkpoint of another level loads too."""
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


# ----------------------------------------------------------------------------- O1
class AutocastPrecision(Precision):
    """O1: float32 weights, ops in reduced precision where torch.autocast deems it safe."""

    opt = "O1"

    def __init__(self, device: torch.device, dtype: torch.dtype, note: Optional[str] = None):
        super().__init__(device, dtype, note)
        if dtype == torch.float16:
            self.scaler = make_scaler(device)

    def details(self) -> List[str]:
        return [f"float32 weights, autocast to {dtype_name(self.dtype)}"]

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype)


# ----------------------------------------------------------------------------- O3
class CastPrecision(Precision):
    """O3: model and inputs in the reduced dtype; the optimizer steps those weights.

    No master weights, no loss scaling (apex's O3 too): the fastest a model can train, and
    the least accurate; float16 weights lose small updates to rounding.
    """

    opt = "O3"
    keep_batchnorm_fp32 = False

    def details(self) -> List[str]:
        bn = ", BatchNorm float32" if self.keep_batchnorm_fp32 else ""
        return [f"{dtype_name(self.dtype)} weights{bn}"]

    def convert(self, model, optimizer):
        keep_losses_float32(model)
        cast_module(model, self.dtype, self.keep_batchnorm_fp32)
        return model, optimizer

    def input_cast(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(self.dtype)

    def for_float32_copy(self) -> Precision:
        return AutocastPrecision(self.device, self.dtype)


# ----------------------------------------------------------------------------- O2
class MasterStateMixin:
    """Checkpoint state for precisions whose optimizer holds float32 master weights.

    Subclasses provide ``_named_masters(model)``: parameter name -> its float32 master.
    """

    def masters(self, model):
        return self._named_masters(model)

    def model_state(self, model):
        state = model.state_dict()
        state.update({k: v.detach() for k, v in self._named_masters(model).items()})
        return float32_state(state)

    @torch.no_grad()
    def load_model_state(self, model, state):
        model.load_state_dict(state)
        for name, master in self._named_masters(model).items():
            master.copy_(state[name])


class MasterWeightPrecision(MasterStateMixin, CastPrecision):
    """O2: reduced-precision model weights (BatchNorm float32) with float32 master weights.

    ``convert`` makes a float32 copy of every parameter it casts and puts the copies in the
    optimizer's param groups in place of the model's parameters, so the optimizer (and its
    momentum buffers) works in float32. Each step copies the model's gradients into the
    masters' ``.grad`` as float32, unscales and checks them (float16), clips the masters,
    steps, and copies the masters back into the model weights. A skipped step leaves masters,
    model weights and optimizer state as they were.
    """

    opt = "O2"
    keep_batchnorm_fp32 = True

    def __init__(self, device: torch.device, dtype: torch.dtype, note: Optional[str] = None):
        super().__init__(device, dtype, note)
        if dtype == torch.float16:
            self.scaler = make_scaler(device)
        self._model_params: List[torch.Tensor] = []  # reduced-precision parameters ...
        self._masters: List[torch.Tensor] = []  # ... and their float32 masters, pairwise
        self._master_of: Dict[int, torch.Tensor] = {}

    def details(self) -> List[str]:
        return super().details() + ["float32 master weights"]

    def convert(self, model, optimizer):
        keep_losses_float32(model)
        float_before = {id(p) for p in model.parameters() if p.dtype == torch.float32}
        masters = {id(p): p.detach().clone() for p in model.parameters() if id(p) in float_before}
        cast_module(model, self.dtype, self.keep_batchnorm_fp32)
        for p in model.parameters():
            if id(p) in masters and p.dtype != torch.float32:
                master = masters[id(p)].requires_grad_(p.requires_grad)
                self._model_params.append(p)
                self._masters.append(master)
                self._master_of[id(p)] = master
        for group in optimizer.param_groups:
            group["params"] = [self._master_of.get(id(p), p) for p in group["params"]]
        for p in list(optimizer.state):  # a fresh optimizer has none; re-key any there is
            if id(p) in self._master_of:
                optimizer.state[self._master_of[id(p)]] = optimizer.state.pop(p)
        return model, optimizer

    def _gradients_to_optimizer(self, params):
        for p, master in zip(self._model_params, self._masters):
            if p.grad is not None:
                master.grad = p.grad.to(torch.float32)
                p.grad = None
        return self._optimizer_tensors(params)

    def _optimizer_tensors(self, params):
        return [self._master_of.get(id(p), p) for p in params]

    @torch.no_grad()
    def _after_step(self) -> None:
        # Unconditional, so no host sync: after a skipped step the masters are unchanged and
        # copying them back rewrites the same rounded values.
        if self._masters:
            torch._foreach_copy_(self._model_params, self._masters)

    def _named_masters(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        return {
            name: self._master_of[id(p)]
            for name, p in model.named_parameters(remove_duplicate=False)
            if id(p) in self._master_of
        }


# ----------------------------------------------------------------------------- the entry point
NATIVE = {"O0": Precision, "O1": AutocastPrecision, "O2": MasterWeightPrecision, "O3": CastPrecision}
