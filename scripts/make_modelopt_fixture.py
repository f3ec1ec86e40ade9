"""Write the ModelOpt NVFP4 test fixture (tests/fixtures/modelopt_nvfp4) with the real producer, nvidia-modelopt.

A tiny random DiffusionGemma is built by transformers' own `save_pretrained` (the published layout, fused experts
`experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`, a vision tower beside the text stack), in
bfloat16 as the published checkpoint is, then quantized on the CPU by ModelOpt with its DiffusionGemma recipe
`huggingface/diffusion_gemma/ptq/nvfp4_experts_only` (NVFP4 W4A4 on the routed experts only, FP8 KV-cache cast,
self-conditioning left alone), calibrated by running `generate` on a few prompts (as ModelOpt's own calibration loop
does for this model), and written by `modelopt.torch.export.export_hf_checkpoint`: experts split per expert
(`experts.E.{gate,up,down}_proj.{weight, weight_scale, weight_scale_2, input_scale}`), everything else bfloat16,
config.json's `quantization_config` and hf_quant_config.json. Beside it, `producer_dequantized.safetensors` holds
ModelOpt's own dequantization (`NVFP4QTensor.dequantize`, float32) of every quantized weight, so the tests can compare
dgemma's reading with the producer's without importing it.

The producer does not run in the project's environment, so run it from a throwaway one. The fixture in the repository
was written with the versions recorded in its PRODUCER.json:

    python3 -m venv /tmp/movenv
    /tmp/movenv/bin/pip install torch==2.13.0
    /tmp/movenv/bin/pip install nvidia-modelopt==0.47.0 transformers==5.24.0 requests tokenizers jinja2
    /tmp/movenv/bin/python scripts/make_modelopt_fixture.py [--out tests/fixtures]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import checkpoints  # noqa: E402
from make_ct_fixtures import SPEC, VISION  # noqa: E402  (the same tiny shapes: every input dim a multiple of 16)

NAME = "modelopt_nvfp4"
RECIPE = "huggingface/diffusion_gemma/ptq/nvfp4_experts_only"
SEED = 13
# Calibration prompts (token ids of the tiny vocabulary, after <bos>): enough tokens that every expert is routed to.
CALIBRATION = [[2] + list(range(110 + 7 * i, 130 + 7 * i)) for i in range(8)]
KEEP = ("config.json", "generation_config.json", "hf_quant_config.json", "model.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def to_bfloat16(model) -> None:
    model.to(dtype=__import__("torch").bfloat16)


def save_producer_dequantized(dest: Path) -> None:
    """ModelOpt's own dequantizer applied to each exported NVFP4 weight: [N, K] float32 per `...weight` name."""
    import torch
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from safetensors.torch import load_file, save_file

    tensors = load_file(dest / "model.safetensors")
    out = {}
    for name, scale in tensors.items():
        if not name.endswith(".weight_scale"):
            continue
        base = name[: -len(".weight_scale")]
        packed = tensors[base + ".weight"]
        shape = torch.Size((packed.shape[0], packed.shape[1] * 2))
        q = NVFP4QTensor(shape, torch.float32, packed)
        out[base + ".weight"] = q.dequantize(dtype=torch.float32, scale=scale,
                                             double_scale=tensors[base + ".weight_scale_2"], block_sizes={-1: 16})
    save_file(out, dest / "producer_dequantized.safetensors")


def make(out: Path, work: Path) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    import transformers
    from modelopt.recipe import load_recipe
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import DiffusionGemmaForBlockDiffusion

    checkpoints.TINY_VISION = VISION
    src = checkpoints.build_checkpoint(work / "src", SPEC, seed=SEED, tweak=to_bfloat16)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(src, dtype=torch.bfloat16).eval()
    recipe = load_recipe(RECIPE)

    def forward_loop(m) -> None:
        torch.manual_seed(0)
        with torch.no_grad():
            for ids in CALIBRATION:
                m.generate(torch.tensor([ids]), max_new_tokens=2 * SPEC["canvas_length"])

    mtq.quantize(model, recipe.quantize, forward_loop)
    tmp = work / NAME
    export_hf_checkpoint(model, export_dir=tmp)
    dest = out / NAME
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in sorted(tmp.iterdir()):
        if f.name in KEEP or (f.suffix == ".safetensors" and f.name.startswith("model-")):
            shutil.copyfile(f, dest / f.name)
    save_producer_dequantized(dest)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if not (dest / f).exists() and (src / f).exists():
            shutil.copyfile(src / f, dest / f)
    (dest / "PRODUCER.json").write_text(json.dumps({
        "script": "scripts/make_modelopt_fixture.py", "recipe": RECIPE, "seed": SEED, "calibration": CALIBRATION,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "nvidia-modelopt": modelopt.__version__},
    }, indent=2) + "\n")
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1024:.0f} KB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        make(args.out, Path(work))


if __name__ == "__main__":
    main()
