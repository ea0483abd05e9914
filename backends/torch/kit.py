"""The torch backends as the conformance kit sees them: ``torch`` (eager) and ``triton``.

The kit speaks the canonical layout (B, H, T, D) and NumPy; these adapters transpose to and
from the torch layout [B, T, H, D] and convert at the boundary only. Gradients come from torch
autograd through the public ops (their registered backward passes). Complex S4D parameters
arrive as (re, im) pairs and are joined with ``torch.complex``, so their gradients come back as
dL/dRe and dL/dIm.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from attnspec.conformance.protocol import OPS as OP_TABLE
from attnspec.conformance.protocol import call_op, op_claims
from attnspec.reference.ops import session_contract

from . import dispatch, ops
from .decode import FPADecodeCache
from .modules import FirstPassageAttention, InterdomainAttention
from .paged import Attention, PagedFPASession, paged_attention_eager
from .state_sessions import interdomain_layer_session, legs_session, s4d_session

TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _time_second(x: Tensor) -> Tensor:
    """Canonical (B, H, T, ...) -> torch [B, T, H, ...] (a view)."""
    return x.transpose(1, 2)


_heads_second = _time_second  # the same swap back: [B, T, H, ...] -> (B, H, T, ...)


class TorchBackend:
    """The PyTorch backend: every op on its eager kernels (``impl="eager"``)."""

    name = "torch"
    dtypes: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
    # every op of the protocol, with the VJPs and features the op table defines
    OPS: tuple[str, ...] = tuple(OP_TABLE)

    def __init__(self, device: str = "cpu"):
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: not a torch device: {device!r} ({exc})") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} asked for, but torch sees no CUDA device")

    # ops whose decode sessions (F8, F9, I15) open_session opens: capability "<op>.session"
    SESSIONS: tuple[str, ...] = (
        "fpa_decode",
        "fpa_layer",
        "interdomain_s4d",
        "interdomain_legs",
        "interdomain_layer",
    )

    def capabilities(self) -> set[str]:
        return op_claims(self.OPS) | {f"{op}.session" for op in self.SESSIONS}

    def _impl(self, op: str) -> str:
        return "eager"

    def _decode_attention(self) -> Attention:
        """The attention over pages of the FPA session: the eager twin."""
        return paged_attention_eager

    def asarray(self, x: np.ndarray, dtype: str) -> torch.Tensor:
        """``x`` on the device in ``dtype`` (a float dtype, or "bool": a session's mask)."""
        wanted = torch.bool if dtype == "bool" else TORCH_DTYPES[dtype]
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device, wanted)

    def asarray_strided(self, x: np.ndarray, dtype: str, layout: str) -> torch.Tensor:
        """``x`` (B, H, T, D) as a non-contiguous tensor view with the same values: ``"slice"``
        the middle third of a (B, H, T, 3 D) tensor (q of a fused qkv projection),
        ``"transpose"`` a (B, H, T, D) view of a (B, T, H, D) tensor."""
        if layout == "slice":
            D = x.shape[-1]
            wide = torch.zeros(
                (*x.shape[:-1], 3 * D), dtype=TORCH_DTYPES[dtype], device=self.device
            )
            wide[..., D : 2 * D] = self.asarray(x, dtype)
            return wide[..., D : 2 * D]
        if layout == "transpose":
            return self.asarray(np.swapaxes(x, 1, 2), dtype).transpose(1, 2)
        raise NotImplementedError(f"layout: unknown {layout!r}")

    def to_numpy(self, x: object) -> np.ndarray:
        if not isinstance(x, Tensor):
            return np.asarray(x)
        x = x.detach()
        if x.dtype == torch.bfloat16:  # NumPy has no bfloat16: widened, exactly
            x = x.to(torch.float32)
        return x.cpu().numpy()

    def dtype_name(self, x: Tensor) -> str:
        return str(x.dtype).removeprefix("torch.")

    def versions(self) -> dict[str, str]:
        versions = {"torch": torch.__version__, "device": str(self.device)}
        if self.device.type == "cuda":
            versions["gpu"] = torch.cuda.get_device_name(self.device)
        return versions

    def _offsets(self, cu_seqlens: tuple[int, ...] | None) -> Tensor | None:
        if cu_seqlens is None:
            return None
        return torch.tensor(cu_seqlens, dtype=torch.int32, device=self.device)

    # ops

    def fpa_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        field: Tensor,
        level: Tensor,
        *,
        scale: float | None = None,
        cu_seqlens: tuple[int, ...] | None = None,
        window: int | None = None,
        return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        o, lse = ops.fpa_attention(
            _time_second(q),
            _time_second(k),
            _time_second(v),
            _time_second(field),
            _time_second(level),
            scale=scale,
            window=window,
            cu_seqlens=self._offsets(cu_seqlens),
            return_lse=True,
            impl=self._impl("fpa_attention"),
        )
        return (_heads_second(o), _heads_second(lse)) if return_lse else _heads_second(o)

    def fox_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        log_f: Tensor,
        *,
        scale: float | None = None,
        cu_seqlens: tuple[int, ...] | None = None,
        window: int | None = None,
    ) -> Tensor:
        o = ops.fox_attention(
            _time_second(q),
            _time_second(k),
            _time_second(v),
            _time_second(log_f),
            scale=scale,
            window=window,
            cu_seqlens=self._offsets(cu_seqlens),
            impl=self._impl("fox_attention"),
        )
        return _heads_second(o)

    def fpa_decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        field: Tensor,
        level: Tensor,
        *,
        theta: float,
        scale: float | None = None,
    ) -> tuple[Tensor, float]:
        cache = FPADecodeCache(theta=theta, scale=scale)
        outputs = [
            cache.step(q[:, :, t], k[:, :, t], v[:, :, t], field[:, :, t], level[:, :, t])
            for t in range(q.shape[2])
        ]
        return torch.stack(outputs, dim=2), cache.kept_fraction

    def interdomain_legs(self, fq: Tensor, fk: Tensor, v: Tensor, *, M: int) -> Tensor:
        o = ops.interdomain_legs(
            _time_second(fq),
            _time_second(fk),
            _time_second(v),
            M,
            impl=self._impl("interdomain_legs"),
        )
        return _heads_second(o)

    def interdomain_s4d(
        self,
        fq: Tensor,
        kt: Tensor,
        vt: Tensor,
        lam_re: Tensor,
        lam_im: Tensor,
        b_re: Tensor,
        b_im: Tensor,
        c_re: Tensor,
        c_im: Tensor,
        *,
        readout: str,
        cu_seqlens: tuple[int, ...] | None = None,
    ) -> Tensor:
        o = ops.interdomain_s4d(
            _time_second(fq),
            _time_second(kt),
            _time_second(vt),
            torch.complex(lam_re, lam_im),
            torch.complex(b_re, b_im),
            torch.complex(c_re, c_im),
            readout=readout,
            cu_seqlens=self._offsets(cu_seqlens),
            impl=self._impl("interdomain_s4d"),
        )
        return _heads_second(o)

    def fpa_layer(
        self,
        x: Tensor,
        params: dict[str, Tensor],
        *,
        cu_seqlens: tuple[int, ...] | None = None,
        **options: Any,
    ) -> Tensor:
        layer = FirstPassageAttention.from_reference_params(params, **options)
        with torch.no_grad():
            y: Tensor = layer(x, cu_seqlens=self._offsets(cu_seqlens))
        return y

    def interdomain_layer(
        self,
        x: Tensor,
        params: dict[str, Tensor],
        *,
        readout: str = "linear",
        cu_seqlens: tuple[int, ...] | None = None,
        **options: Any,
    ) -> Tensor:
        """The module from the reference's parameter dict; the flags ``gate`` and
        ``output_norm`` choose the optional parameters (wg, norm_o_g) it is given."""
        accepted = inspect.signature(InterdomainAttention.from_reference_params).parameters
        flags = {"gate": "wg", "output_norm": "norm_o_g"}
        dropped = {flags[f] for f, on in options.items() if f in flags and not on}
        params = {n: p for n, p in params.items() if n not in dropped}
        kwargs = {n: v for n, v in options.items() if n in accepted}
        layer = InterdomainAttention.from_reference_params(params, readout=readout, **kwargs)
        with torch.no_grad():
            y: Tensor = layer(x, cu_seqlens=self._offsets(cu_seqlens))
        return y

    # sessions

    def open_session(self, op: str, *, rows: int, dtype: str, config: dict[str, Any]) -> Any:
        """A decode session of ``op`` (spec/fpa.md F8, F9; spec/interdomain.md I15) with
        ``rows`` rows in ``dtype``; config as the session contract of docs/conformance.md."""
        if f"{op}.session" not in self.capabilities():
            raise NotImplementedError(f"op: no decode session for {op!r} in {self.name}")
        if dtype not in self.dtypes:
            raise ValueError(f"dtype: expected one of {self.dtypes}, got {dtype!r}")
        if op == "fpa_decode":
            return self._fpa_decode_session(rows, dtype, config)
        if op == "fpa_layer":
            return self._fpa_layer_session(rows, dtype, config)
        if op in ("interdomain_s4d", "interdomain_legs", "interdomain_layer"):
            return self._state_session(op, rows, TORCH_DTYPES[dtype], config)
        raise NotImplementedError(f"op: no decode session for {op!r} in {self.name}")

    def _fpa_decode_session(self, rows: int, dtype: str, config: dict[str, Any]) -> Any:
        """The paged FPA session (:mod:`.paged`); config as the session contract states."""
        contract = session_contract("fpa_decode")
        unknown = set(config) - contract.keys - {"page_size", "max_pages"}
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}")
        missing = set(contract.required) - set(config)
        if missing:
            raise ValueError(f"config: missing {sorted(missing)}")
        return PagedFPASession(
            rows=rows,
            dtype=TORCH_DTYPES[dtype],
            device=self.device,
            attention=self._decode_attention(),
            **config,
        )

    def _fpa_layer_session(self, rows: int, dtype: str, config: dict[str, Any]) -> Any:
        """FirstPassageAttention's session over the paged cache; config: params, the layer's
        options (increments), theta, window, max_rollback."""
        options = dict(config)
        if "params" not in options:
            raise ValueError("config: missing ['params']")
        params = options.pop("params")
        session = {n: options.pop(n) for n in ("theta", "window", "max_rollback") if n in options}
        layer = FirstPassageAttention.from_reference_params(
            params, **options, device=self.device, dtype=TORCH_DTYPES[dtype]
        )
        return layer.open_session(rows, **session, attention=self._decode_attention())

    def _state_session(self, op: str, rows: int, dtype: torch.dtype, config: dict[str, Any]) -> Any:
        """The Interdomain state sessions (:mod:`.state_sessions`, eager)."""
        if op == "interdomain_s4d":
            return s4d_session(rows, dtype, config)
        if op == "interdomain_legs":
            return legs_session(rows, dtype, self.device, config)
        return interdomain_layer_session(rows, dtype, self.device, config)

    # gradients

    def vjp(
        self,
        op: str,
        inputs: dict[str, Tensor],
        params: dict[str, Any],
        cotangents: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        """Input cotangents of ``op`` by torch autograd through the public op."""
        if f"{op}.vjp" not in self.capabilities():
            raise NotImplementedError(f"op: no VJP for {op!r} in the {self.name} backend")
        names = OP_TABLE[op].differentiable
        leaves = {n: x.detach().requires_grad_() if n in names else x for n, x in inputs.items()}
        outputs = call_op(self, op, leaves, params)
        pairs = [(outputs[n], cot) for n, cot in cotangents.items()]
        grads = torch.autograd.grad(
            [out for out, _ in pairs],
            [leaves[n] for n in names],
            [cot.to(out.dtype) for out, cot in pairs],
        )
        return dict(zip(names, grads, strict=True))


class TritonBackend(TorchBackend):
    """The torch backend with the Triton kernels: ``impl="triton"`` for the ops whose kernels
    are registered in :mod:`.dispatch` (eager for a backward that has none), nothing else
    claimed. Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set
    here if triton is not imported yet), where float64 is also offered."""

    name = "triton"
    KERNELS: ClassVar[dict[str, tuple[str, ...]]] = {
        op: spec.torch_kernels for op, spec in OP_TABLE.items() if spec.torch_kernels
    }
    # the FPA sessions attend with the Triton decode kernel; the Interdomain ones are eager
    SESSIONS: tuple[str, ...] = ("fpa_decode", "fpa_layer")

    def __init__(self, device: str = "cpu"):
        if not torch.cuda.is_available() and "triton" not in sys.modules:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        super().__init__(device)
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "device: Triton kernels run on CPU only under the interpreter; set "
                "TRITON_INTERPRET=1 before triton is imported (a first call of a torch op "
                "imports it)"
            )
        ops.load_triton_kernels()
        narrow = ("float32", "float16", "bfloat16")
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        self.dtypes = ("float64", *narrow) if interpreted else narrow

    def _registered(self, kernel: str) -> bool:
        return "triton" in dispatch.implementations(kernel)

    def environment(self) -> dict[str, str]:
        """What a repro line sets: the interpreter switch when the kernels run under it."""
        return {"TRITON_INTERPRET": "1"} if os.environ.get("TRITON_INTERPRET") == "1" else {}

    def capabilities(self) -> set[str]:
        claimed = {op for op, (fwd, _) in self.KERNELS.items() if self._registered(fwd)}
        vjps = {op for op in claimed if self._registered(self.KERNELS[op][1])}
        return op_claims(claimed, vjps=vjps) | {f"{op}.session" for op in self.SESSIONS}

    def _decode_attention(self) -> Attention:
        """The attention over pages of the FPA session: the Triton decode kernel."""
        from .triton_decode import paged_attention_triton

        return paged_attention_triton

    def _impl(self, op: str) -> str:
        kernels = self.KERNELS.get(op)
        return "triton" if kernels and self._registered(kernels[0]) else "eager"

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        try:
            import triton

            versions["triton"] = triton.__version__
        except ImportError:
            versions["triton"] = "not installed"
        versions["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "")
        return versions
