"""The fast path's AOTInductor parts: each package's key from the switches as applied, and the loaded
packages in place of the compiled U-Net and decoder (:mod:`rapiddiff.infer.fast_aoti` stores them)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rapiddiff.infer import fast_aoti
from rapiddiff.infer.fast_attention import BackendTable, cross_attention_kv
from rapiddiff.infer.fast_plan import ClippedDDIMPlan, LinearPlan
from rapiddiff.infer.fast_report import FastPathReport, SwitchStatus, fallback

Plan = LinearPlan | ClippedDDIMPlan


def package_store(pipe: Any, mode: str, folder: str | None, loop_kind: str, report: FastPathReport) -> Any:
    """The package store for ``mode`` ("off", "load", "build"), or None with the reason reported."""
    if mode == "off":
        report.set("aoti", SwitchStatus("off"))
        return None
    model_path = getattr(pipe, "model_path", None)
    folder = folder or (str(Path(model_path) / fast_aoti.PACKAGE_DIR) if model_path else None)
    if folder is None:
        report.set(
            "aoti", fallback("no model folder to keep packages beside; pass aoti_dir", "torch.compile")
        )
        return None
    if loop_kind == "eager":
        report.set("aoti", fallback("packages serve the GPU loop; loop=eager", "torch.compile"))
        return None
    report.set("aoti", SwitchStatus("on", mode, f"{folder}; per shape at first use"))
    return fast_aoti.PackageStore(Path(folder), Path(model_path) if model_path else None, mode)


class PackageParts:
    """Resolves the U-Net and decoder packages of one fast path, once per key in a process."""

    def __init__(
        self,
        store: fast_aoti.PackageStore,
        unet: torch.nn.Module,
        vae: torch.nn.Module,
        attention: str,
        backends: BackendTable,
        report: FastPathReport,
    ) -> None:
        self.store, self.unet, self.vae, self.report = store, unet, vae, report
        self.attention, self.backends = attention, backends
        self.device = next(unet.parameters()).device
        self.calls: dict[str, Any] = {}  # part + key fields → loaded package (or None: fall back)

    def fields(self, plan: Plan, noise_shape: tuple, context_shape: tuple) -> dict[str, dict[str, Any]]:
        """The shapes and switches part of each package's key (see fast_aoti.package_key)."""
        on = self.report.is_on
        attention = "default" if self.report.status("attention").state == "fallback" else self.attention
        unet_switches: dict[str, Any] = {
            "channels_last": on("channels_last"),
            "fuse_qkv": on("fuse_qkv"),
            "attention": attention,
            "cross_kv_cache": on("cross_kv_cache"),
        }
        if on("batch_time_proj"):  # only when on: a package built unpacked keeps its key
            unet_switches["batch_time_proj"] = True
        t_dtype = str(plan.timesteps.dtype).removeprefix("torch.")
        x_shape = [context_shape[0], *noise_shape[1:]]
        return {
            "unet": {
                "shapes": {"x": x_shape, "context": list(context_shape), "t": t_dtype},
                "switches": unet_switches,
            },
            "decoder": {
                "shapes": {"latents": list(noise_shape)},
                "switches": {"channels_last": on("channels_last")},
            },
        }

    def adopt_backends(self, plan: Plan, noise_shape: tuple, context_shape: tuple) -> None:
        """With attention="auto", take the backends the U-Net package was traced with instead of
        re-timing them (a noisy re-pick would make the package look stale)."""
        if not self.backends.auto:
            return
        fields = self.fields(plan, noise_shape, context_shape)["unet"]
        probe = fast_aoti.package_key("unet", device=self.device, dtype=self.unet.dtype, weights="", **fields)
        try:
            manifest = fast_aoti.read_manifest(fast_aoti.package_path(self.store.folder, probe))
        except fast_aoti.PackageError:
            return
        for row in manifest.get("backends", []):
            self.backends.table.setdefault((int(row[0]), int(row[1]), int(row[2])), str(row[3]))

    def swap_in(
        self, plan: Plan, noise_shape: tuple, context_shape: tuple, unet_fn: Any, decode_fn: Any, kv: bool
    ) -> tuple[Any, Any]:
        """The loaded (or built) packages in place of the compiled U-Net and decoder, part by part."""
        fields = self.fields(plan, noise_shape, context_shape)
        dtype, device = self.unet.dtype, self.device
        context = torch.zeros(context_shape, dtype=dtype, device=device)
        # Example inputs made as the loop makes them (same strides: the kernels assume them).
        unet_args = (
            torch.zeros(fields["unet"]["shapes"]["x"], dtype=dtype, device=device),
            plan.timesteps.to(device)[0],
            context,
            cross_attention_kv(self.unet, context) if kv else {},
        )
        latents = torch.zeros(noise_shape, dtype=torch.float32, device=device)
        parts = {
            "unet": (fast_aoti.UNetCall(self.unet), unet_args),
            "decoder": (fast_aoti.DecodeCall(self.vae), (latents,)),
        }
        loaded = {}
        with self._eager_modules(), torch.no_grad():
            for part, (module, args) in parts.items():
                memo = part + json.dumps(fields[part], sort_keys=True)
                if memo not in self.calls:  # once per process: a new loop of the same shape reuses it
                    table = sorted(self.backends.table.items())
                    extra = {"backends": [[*k, b] for k, b in table] if part == "unet" else []}
                    call, status, _ = self.store.resolve(
                        part, module, args, fields[part], device, dtype, extra
                    )
                    self.report.set(f"aoti_{part}", status)
                    self.calls[memo] = call
                loaded[part] = self.calls[memo]
        if loaded["unet"] is not None:
            unet_call = loaded["unet"]

            def unet_fn(x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, kv: Any) -> torch.Tensor:
                # t is timesteps[i], a view at an 8-byte offset: a fresh copy keeps the 16-byte
                # alignment the compiled kernels may assume (torch.compile would guard on it).
                return unet_call(x, t.clone(), ctx, kv if kv is not None else {})

        if loaded["decoder"] is not None:
            decode_fn = loaded["decoder"]
        return unet_fn, decode_fn

    @contextlib.contextmanager
    def _eager_modules(self) -> Iterator[None]:
        """The U-Net and decoder without their torch.compile wrappers (torch.export traces the modules)."""
        compiled = [
            (m, m._compiled_call_impl) for m in self.unet.modules() if m._compiled_call_impl is not None
        ]
        compiled_decode = self.vae.__dict__.pop("decode", None)
        for module, _ in compiled:
            module._compiled_call_impl = None
        try:
            yield
        finally:
            for module, call in compiled:
                module._compiled_call_impl = call
            if compiled_decode is not None:
                self.vae.decode = compiled_decode
