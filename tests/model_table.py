"""The README's model table, generated from the engine's registry (engine.models.FAMILIES) and from what the
tests run: each family's token-exact checkpoints (tests/engine/conftest.py ARCH_CONFIGS) with their sizes,
whether tensor parallelism and quantized weights are tested on it, and the benchmarks' shapes.

    python -m tests.model_table           # print it
    python -m tests.model_table --write   # rewrite it in README.md, between its markers
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import transformers

from engine.models import FAMILIES, ModelFamily
from engine.quantization import LOAD_SCHEMES
from loadtest.bench_offline import MODELS
from tests.engine.conftest import ARCH_CONFIGS
from tests.engine.test_quantization import QUANTIZED_ARCHS
from tests.engine.test_tensor_parallel import TP_ARCHS
from loadtest.vl_checkpoint import VL_CONFIGS

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- model-table:begin -->", "<!-- model-table:end -->"
SCHEMES = tuple(LOAD_SCHEMES)
HEADER = ("| family | `architectures` | sliding window | MoE | vision | tested token-exact vs transformers (fp32) "
          "| tensor parallel | quantized weights | benchmarked shapes |\n|---|---|---|---|---|---|---|---|---|")
# Every token-exact checkpoint: the text-only ones and the vision-language ones (tests/engine/test_qwen2_5_vl.py).
TESTED_CONFIGS = ARCH_CONFIGS | VL_CONFIGS


def architecture(model_type: str) -> str:
    names = transformers.models.auto.modeling_auto
    if model_type in names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return names.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]


def parameters(config: transformers.PretrainedConfig) -> str:
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "vision_config") else \
        transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    return f"{count / 1e6:.1f}M" if count >= 1e5 else f"{count / 1e3:.0f}K"


def row(family: ModelFamily, tested: dict[str, list[str]], benchmarked: dict[str, list[str]]) -> str:
    names = [name for arch in family.classes for name in tested.get(arch, [])]
    shown = ", ".join(f"`{name}` ({parameters(TESTED_CONFIGS[name]())})" for name in names) or "no"
    tp = "tp=2, tested" if set(names) & set(TP_ARCHS) else "yes, untested" if family.tensor_parallel else "no"
    quantized = quantization(names) + (f"; {family.unquantized}: unquantized" if family.unquantized else "")
    shapes = ", ".join(name for arch in family.classes for name in benchmarked.get(arch, [])) or "-"
    archs = ", ".join(f"`{arch}`" for arch in family.classes)
    return (f"| {family.name} | {archs} | {family.sliding_window or '-'} | {family.moe or '-'} "
            f"| {family.vision or '-'} | {shown} | {tp} "
            f"| {quantized} | {shapes} |")


def quantization(names: list[str]) -> str:
    """The schemes ``--quantization`` takes, split by whether a test runs them on one of ``names``."""
    tested = {scheme for name in names for scheme in QUANTIZED_ARCHS.get(name, ())}
    untested = [scheme for scheme in SCHEMES if scheme not in tested]
    parts = [f"{', '.join(s for s in SCHEMES if s in tested)}: tested"] if tested else []
    return "; ".join(parts + ([f"{', '.join(untested)}: same layers, untested"] if untested else []))


def render() -> str:
    tested: dict[str, list[str]] = {}
    for name, make in TESTED_CONFIGS.items():
        tested.setdefault(architecture(make().model_type), []).append(name)
    benchmarked: dict[str, list[str]] = {}
    for name, spec in MODELS.items():
        benchmarked.setdefault(architecture(spec["arch"]), []).append(name)
    return "\n".join([HEADER, *(row(family, tested, benchmarked) for family in FAMILIES)])


def in_readme(text: str) -> str:
    """The table between the README's markers."""
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n?" + re.escape(END), text, re.S)
    if match is None:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    return match.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args()
    table = render()
    if not args.write:
        print(table)
        return
    text = README.read_text()
    in_readme(text)  # the markers are there
    block = re.compile(re.escape(BEGIN) + r"\n.*?\n?" + re.escape(END), re.S)
    README.write_text(block.sub(lambda _: f"{BEGIN}\n{table}\n{END}", text, count=1))


if __name__ == "__main__":
    main()
