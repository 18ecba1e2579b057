"""Sampling defaults have one home: :class:`rapiddiff.models.sampling.SamplingDefaults`.

Every other place reads it (or a model folder's own ``rapiddiff.json``). This scan fails when a
literal default for steps, guidance or the scheduler appears elsewhere: as a parameter default, a
dataclass field, an ``argparse`` default, a ``SamplingDefaults(...)`` keyword, a ``sampling`` dict
entry in code, or a key in a shipped YAML.
"""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
HOME = ("rapiddiff/models/sampling.py", "SamplingDefaults")
NAMES = {"num_inference_steps", "steps", "guidance_scale", "guidance", "scheduler", "sampler"}
# Not copies of a default but a domain's measured choice, differing from it on purpose: a model
# trained from scratch has no start model whose rapiddiff.json it could inherit.
DOMAIN_CHOICES = {"configs/unet/kshapes.yaml: model.sampling.guidance_scale: 3.0"}


def _literal(node: ast.AST | None) -> bool:
    """A number or a string (None and computed values are not literal defaults)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float | str)
        and not isinstance(node.value, bool)
    )


def _option_name(call: ast.Call) -> str | None:
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
            return arg.value[2:].replace("-", "_")
    return None


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path, self.found, self.classes = path, [], []

    def _hit(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.path}:{node.lineno}: {what}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        if (self.path, node.name) != HOME:
            for item in node.body:
                target = item.target if isinstance(item, ast.AnnAssign) else None
                if isinstance(target, ast.Name) and target.id in NAMES and _literal(item.value):
                    self._hit(item, f"field {node.name}.{target.id} = {ast.unparse(item.value)}")
        self.generic_visit(node)
        self.classes.pop()

    def _arguments(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
        for arg, default in pairs:
            if arg.arg in NAMES and _literal(default):
                self._hit(default, f"parameter {arg.arg}={ast.unparse(default)}")

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._arguments(node)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "add_argument" and _option_name(node) in NAMES:
            for kw in node.keywords:
                if kw.arg == "default" and _literal(kw.value):
                    self._hit(node, f"--{_option_name(node)} default={ast.unparse(kw.value)}")
        # A preset is a measured choice with one home too: the PRESETS table beside SamplingDefaults.
        preset_home = name == "SamplingPreset" and self.path == HOME[0]
        if name in ("SamplingDefaults", "SamplingConfig", "SamplingPreset") and not preset_home:
            for kw in node.keywords:
                if kw.arg in NAMES and _contains_literal(kw.value):
                    self._hit(node, f"{name}({kw.arg}={ast.unparse(kw.value)})")
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == "sampling" and isinstance(value, ast.Dict):
                for k, v in zip(value.keys, value.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value in NAMES and _literal(v):
                        self._hit(v, f'"sampling": {{"{k.value}": {ast.unparse(v)}}}')
        self.generic_visit(node)


def _contains_literal(node: ast.AST) -> bool:
    """``x or "pndm"``, ``a if c else 25``: a fallback literal is a default too."""
    if _literal(node):
        return True
    if isinstance(node, ast.BoolOp):
        return any(_literal(v) for v in node.values)
    if isinstance(node, ast.IfExp):
        return _literal(node.body) or _literal(node.orelse)
    return False


def python_literals(root: Path = REPO) -> list[str]:
    found: list[str] = []
    for path in sorted((root / "rapiddiff").rglob("*.py")):
        scan = _Scan(path.relative_to(root).as_posix())
        scan.visit(ast.parse(path.read_text(encoding="utf-8")))
        found += scan.found
    return found


def _yaml_keys(data: object, where: str) -> list[str]:
    found = []
    if isinstance(data, dict):
        for key, value in data.items():
            here = f"{where}.{key}" if where else str(key)
            if key in NAMES and isinstance(value, int | float | str) and not isinstance(value, bool):
                found.append(f"{here}: {value}")
            found += _yaml_keys(value, here)
    elif isinstance(data, list):
        for i, item in enumerate(data):
            found += _yaml_keys(item, f"{where}[{i}]")
    return found


def yaml_literals(root: Path = REPO) -> list[str]:
    found = []
    for path in sorted((root / "configs").rglob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        found += [f"{path.relative_to(root).as_posix()}: {hit}" for hit in _yaml_keys(data, "")]
    return found


def test_no_sampling_default_outside_its_home() -> None:
    found = python_literals() + [hit for hit in yaml_literals() if hit not in DOMAIN_CHOICES]
    assert not found, "literal sampling defaults outside SamplingDefaults:\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_literal(tmp_path: Path) -> None:
    source = tmp_path / "rapiddiff" / "m.py"
    source.parent.mkdir()
    source.write_text(
        "from dataclasses import dataclass\n"
        "def f(prompt, num_inference_steps=30, *, guidance_scale=5.0, seed=50): ...\n"
        "@dataclass\nclass C:\n    scheduler: str = 'ddim'\n    size: int = 50\n"
        "def g(p):\n    p.add_argument('--steps', type=int, default=20)\n    p.add_argument('--seed', default=7)\n"
        "    SamplingDefaults(scheduler=kind or 'pndm')\n"
        "    SamplingPreset(num_inference_steps=12, scheduler='ddim', deep_cache=1, summary='')\n"
        "    return {'sampling': {'guidance_scale': 9}}\n"
        "def ok(steps=None, guidance_scale=DEFAULTS.guidance_scale): ...\n",
        encoding="utf-8",
    )
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text(
        "model:\n  sampling:\n    num_inference_steps: 30\n    prompts: [x]\n  lr: 50\n", encoding="utf-8"
    )
    hits = python_literals(tmp_path)
    assert [h.split(": ", 1)[1] for h in hits] == [
        "parameter num_inference_steps=30",
        "parameter guidance_scale=5.0",
        "field C.scheduler = 'ddim'",
        "--steps default=20",
        "SamplingDefaults(scheduler=kind or 'pndm')",
        "SamplingPreset(num_inference_steps=12)",
        "SamplingPreset(scheduler='ddim')",
        '"sampling": {"guidance_scale": 9}',
    ]
    assert yaml_literals(tmp_path) == ["configs/a.yaml: model.sampling.num_inference_steps: 30"]
