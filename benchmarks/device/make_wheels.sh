#!/usr/bin/env bash
# Wheels the GPU machine lacks (its image has torch, transformers, lightning, peft, timm,
# torchmetrics... but not these), for Python 3.12 x86-64, into .whl/ (git-ignored; carried).
# On the device:  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
#                 export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
PIP=${PIP:-python3 -m pip}
plat="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"
binary=(diffusers importlib_metadata pykeen class_resolver docdata more_click more_itertools pystow
        torch_max_mem torch-ppr dataclasses-json click_default_group optuna alembic colorlog
        sqlalchemy Mako "marshmallow<4" spandrel datasets dill multiprocess jsonargparse docstring-parser typeshed-client
        cn-clip lmdb torch-fidelity opencc-python-reimplemented marisa-trie
        resvg-py)  # resvg-py: emoji-zh's hr/ copies (SVG → 512² PNG)
$PIP download -q --no-deps --only-binary=:all: $plat -d .whl "${binary[@]}"
# rapiddiff serve (and benchmarks/serve_load.py): with their dependencies, as this venv pins them
$PIP download -q --only-binary=:all: $plat -d .whl fastapi==0.165.0 uvicorn==0.54.0 httpx
# jieba ships only as an sdist: build its pure-Python wheel here.
$PIP wheel -q --no-deps -w .whl jieba
ls -la .whl | awk '{s+=$5} END {print "total bytes:", s}'
