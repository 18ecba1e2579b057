"""The fast path's AOTInductor parts: each package's key from the switches as applied, and the loaded
packages in place of the compiled U-Net and decoder (:mod:`rapiddiff.infer.fast_aoti` stores them)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from rapiddiff.infer import fast_aoti, fast_background
from rapiddiff.infer.fast_attention import BackendTable, cross_attention_kv
from rapiddiff.infer.fast_plan import ClippedDDIMPlan, LinearPlan
from rapiddiff.infer.fast_report import FastPathReport, SwitchStatus, fallback

Plan = LinearPlan | ClippedDDIMPlan


def shipped_model_dir() -> Path:
    """The model inside the installed package (not $RAPIDDIFF_MODEL: a folder of the user's own)."""
    import rapiddiff

    return Path(rapiddiff.__file__).parent / "assets" / "model"


def default_package_dir(model_path: str | Path) -> Path:
    """Where a model folder's packages live: ``MODEL/accelerated`` where it can be written, else (a
    read-only install, or the model shipped inside the package) the user cache, beside the other
    caches rapiddiff keeps (``$RAPIDDIFF_CACHE_DIR``, else ``~/.cache/rapiddiff``), one folder per model."""
    from rapiddiff.kg.cache import cache_dir

    model = Path(model_path).resolve()
    inside = model / fast_aoti.PACKAGE_DIR
    shipped = shipped_model_dir().resolve()
    writable = os.access(inside if inside.is_dir() else model, os.W_OK)
    if writable and model != shipped:
        return inside
    digest = hashlib.sha256(str(model).encode()).hexdigest()[:12]
    return cache_dir() / fast_aoti.PACKAGE_DIR / f"{model.name}-{digest}"


def package_store(pipe: Any, mode: str, folder: str | None, loop_kind: str, report: FastPathReport) -> Any:
    """The package store for ``mode`` ("off", "load", "build", "auto"), or None with the reason reported."""
    if mode == "off":
        report.set("aoti", SwitchStatus("off"))
        return None
    model_path = getattr(pipe, "model_path", None)
    folder = folder or (str(default_package_dir(model_path)) if model_path else None)
    if folder is None:
        report.set(
            "aoti", fallback("no model folder to keep packages beside; pass aoti_dir", "torch.compile")
        )
        return None
    if loop_kind == "eager":
        report.set("aoti", fallback("packages serve the GPU loop; loop=eager", "torch.compile"))
        return None
    device = next(pipe.unet.parameters()).device
    if mode == "auto" and device.type not in fast_background.BACKGROUND_DEVICES:
        mode = "load"  # no background builds here (see BACKGROUND_DEVICES): use what exists
    if mode == "auto" and not model_path:
        mode = "load"  # a builder process loads the model from its folder
    report.set("aoti", SwitchStatus("on", mode, f"{folder}; per shape at first use"))
    return fast_aoti.PackageStore(Path(folder), Path(model_path) if model_path else None, mode)


def export_switches(config: Any) -> tuple[str, ...]:
    """The AccelerateConfig fields that differ from their defaults, as ``accelerate export
    --switches`` takes them, so a background build compiles the graph this process runs."""
    default = type(config)()
    skip = {"aoti", "aoti_dir", "compile_cache"}
    out = []
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name not in skip and value != getattr(default, f.name):
            word = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            out.append(f"{f.name}={word}")
    return tuple(out)


class PackageParts:
    """Resolves the U-Net and decoder packages of one fast path, once per key in a process."""

    def __init__(
        self,
        store: fast_aoti.PackageStore,
        unet: torch.nn.Module,
        vae: torch.nn.Module,
        config: Any,
        backends: BackendTable,
        report: FastPathReport,
    ) -> None:
        self.store, self.unet, self.vae, self.report = store, unet, vae, report
        self.config, self.attention, self.backends = config, config.attention, backends
        self.device = next(unet.parameters()).device
        self.calls: dict[str, Any] = {}  # part + key fields → loaded package (or None: fall back)
        self.builds = (
            fast_background.BackgroundBuilds(store.folder, sum(p.numel() for p in unet.parameters()))
            if store.mode == "auto"
            else None
        )

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
        self,
        plan: Plan,
        noise_shape: tuple,
        context_shape: tuple,
        unet_fn: Any,
        decode_fn: Any,
        kv: bool,
        sampler: str | None = None,
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
        self._request_missing(noise_shape, context_shape, sampler)
        if loaded["unet"] is not None:
            unet_call = loaded["unet"]

            def unet_fn(x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, kv: Any) -> torch.Tensor:
                # t is timesteps[i], a view at an 8-byte offset: a fresh copy keeps the 16-byte
                # alignment the compiled kernels may assume (torch.compile would guard on it).
                return unet_call(x, t.clone(), ctx, kv if kv is not None else {})

        if loaded["decoder"] is not None:
            decode_fn = loaded["decoder"]
        return unet_fn, decode_fn

    def _request_missing(self, noise_shape: tuple, context_shape: tuple, sampler: str | None) -> None:
        """With aoti="auto": the parts that had no package get a background build (said in the report)."""
        if self.builds is None or not self.store.missing:
            return
        missing, self.store.missing = dict(self.store.missing), {}
        scale = 2 ** (len(self.vae.config.block_out_channels) - 1)  # sampling.vae_scale_factor
        request = fast_background.BuildRequest(
            model=str(self.store.weights_root),
            folder=str(self.store.folder),
            device=str(self.device),
            height=int(noise_shape[2]) * scale,
            width=int(noise_shape[3]) * scale,
            guidance=context_shape[0] == 2 * noise_shape[0],
            sampler=sampler,
            switches=export_switches(self.config),
            batch=int(noise_shape[0]),
            keys=fast_background.keys_digest([key for key, _ in missing.values()]),
        )
        status = self.builds.request(request)
        for part, (_, reason) in missing.items():
            self.report.set(f"aoti_{part}", fallback(f"{reason}; {status.reason}", status.value))

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
