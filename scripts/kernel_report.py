"""Static report on dgemma's Triton kernels for six NVIDIA targets, on a machine without a GPU.

    make kernel-report [ARGS=--update-benchmarks]
    python scripts/kernel_report.py [--out kernel-report] [-j N] [--targets 80,86,89,90,100,120]
                                    [--update-benchmarks]
    python scripts/kernel_report.py --gguf-steps [--out DIR] [--update-benchmarks]   (the GGUF step table alone)

For each target, every launch the kernel entry points make at the real 26B-A4B shapes (batch 1 and 4, bf16 and
fp16), with the launch settings the wrappers choose for that GPU, is compiled ahead of time with Triton's bundled
ptxas (quant/kernels/aot.py), and each kernel family's cost per denoise step is bounded three ways on the GPU
(quant/kernels/roofline.py): DRAM-bound, tensor-bound, issue-bound. Writes OUT/report.md, OUT/results.json and
OUT/kernels/<kernel>__<config>__sm<cc>/ (ttgir, ptx, cubin, sass, ptxas.log); --update-benchmarks also rewrites
BENCHMARKS.md between its kernel-report markers. Exits 1 if a kernel fails to compile or its loops no longer match
its declaration in roofline.KERNELS.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # the compiled kernels, not the interpreter: before triton is imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what a launch compiles with today (Triton 3.9 warns)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quant.kernels import aot, roofline  # noqa: E402
from quant.kernels.roofline import CARD_GPUS, GPUS  # noqa: E402

BEGIN, END = "<!-- kernel-report:begin -->", "<!-- kernel-report:end -->"
MB, GFLOP = 1e6, 1e9


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ analysis


def compile_work(work: dict[int, list[aot.Work]], workers: int, root: Path):
    """-> jobs {key: Job}, results {key: result}, job_of {id(launch): key}."""
    jobs, job_of = {}, {}
    for cc, items in work.items():
        for launch in (launch for w in items for launch in w.launches):
            job = aot.specialise(launch, cc)
            if job.key not in jobs:
                tags = {j.tag for j in jobs.values()}
                job.tag = next(t for t in (job.tag, *(f"{job.tag}-{i}" for i in range(2, 99))) if t not in tags)
                jobs[job.key] = job
            job_of[id(launch)] = job.key
    log(f"{len(job_of)} launches -> {len(jobs)} compilations, {workers} workers")
    return jobs, aot.compile_all(jobs, workers, root, progress=log), job_of


def launch_rows(work: dict[int, list[aot.Work]], jobs, results, job_of, errors: list[str]) -> list[dict]:
    """One row per launch and target: its estimated traffic and the warp-instructions its loops issue."""
    rows = []
    for cc, items in work.items():
        for call, w in enumerate(items):
            for launch in w.launches:
                job = jobs[job_of[id(launch)]]
                res = results[job.key]
                fp4 = res["ok"] and any(op.split(".")[0] in roofline.FP4_OPS for op in res["tc_ops"])
                row = dict(cc=cc, call=call, family=w.family, label=w.label, batch=w.batch, dtype=w.dtype,
                           count=w.count, kernel=launch.kernel, config=job.config, tag=job.tag,
                           grid=list(launch.grid), fp4=fp4, torch_bytes=launch.torch_bytes, traffic=None,
                           warp_instr=None, per_elem=None)
                rows.append(row)
                try:
                    decl = roofline.declaration(launch.kernel)
                    args = launch.named()
                    row["traffic"] = roofline.traffic(decl, args) + launch.torch_bytes
                    if res["ok"]:
                        row["warp_instr"], row["per_elem"] = roofline.warp_instructions(
                            launch.kernel, decl, args, launch.grid, res["num_warps"], res["loops"], res["straight"])
                except roofline.LoopMismatch as e:
                    if f"{e} (sm_{cc})" not in errors:
                        errors.append(f"{e} (sm_{cc})")
    return rows


def step_rows(work: dict[int, list[aot.Work]], launches: list[dict]) -> list[dict]:
    """Per target, batch, family and dtype: floor bytes, FLOPs and estimated traffic per denoise step, and the
    three bounds in ms. A launch without an estimate makes its family's sums unknown (None), never low."""
    steps: dict[tuple, dict] = {}
    fp4_calls = {(r["cc"], r["call"]) for r in launches if r["fp4"]}  # calls multiplying on the FP4 tensor cores
    for cc, items in work.items():
        for call, w in enumerate(items):
            s = steps.setdefault((cc, w.batch, w.family, w.dtype), dict(
                gpu=GPUS[cc].name, cc=cc, batch=w.batch, family=w.family, dtype=w.dtype, floor_bytes=0, flops=0,
                fp4_flops=0, traffic=0, warp_instr=0))
            s["floor_bytes"] += w.floor_bytes * w.count
            s["fp4_flops" if (cc, call) in fp4_calls else "flops"] += w.flops * w.count
    for r in launches:
        s = steps[r["cc"], r["batch"], r["family"], r["dtype"]]
        for key in ("traffic", "warp_instr"):
            s[key] = None if r[key] is None or s[key] is None else s[key] + r[key] * r["count"]
    for s in steps.values():
        gpu = GPUS[s["cc"]]
        s["dram_ms"] = roofline.dram_us(gpu, s["floor_bytes"]) / 1e3
        fp4 = roofline.tensor_us(gpu, s["fp4_flops"], fp4=True) if s["fp4_flops"] else 0.0
        s["tensor_ms"] = (roofline.tensor_us(gpu, s["flops"]) + fp4) / 1e3
        s["issue_ms"] = None if s["warp_instr"] is None else roofline.issue_us(gpu, s["warp_instr"]) / 1e3
        s["ratio"] = None if s["issue_ms"] is None else roofline.ratio(s["issue_ms"], s["dram_ms"], s["tensor_ms"])
    return sorted(steps.values(), key=lambda s: (s["dtype"] == "float16", s["cc"], s["batch"], s["family"]))


def compiled_rows(jobs, results, launches) -> list[dict]:
    """One row per compilation (by kernel, target, config): the compile result and the thread-instructions per
    weight element of the first launch that compiled to it."""
    per_elem = {}
    for r in launches:
        per_elem.setdefault(r["tag"], r["per_elem"])
    return [dict(tag=j.tag, kernel=j.kernel, config=j.config, cc=j.cc, smem_limit=GPUS[j.cc].smem_per_block,
                 per_elem=per_elem.get(j.tag), **results[key])
            for key, j in sorted(jobs.items(), key=lambda kv: (kv[1].kernel, kv[1].cc, kv[1].config))]


# ------------------------------------------------------------------------------------------------ whole step

STEP_TARGETS = (89, 90, 120)  # RTX 4090, H200, RTX 5090: the GPUs the whole-step table is for
# B200 (sm_100: W4A4 on tcgen05, another code path than the RTX 5090's): its NVFP4 step at batch 1, with and without
# the adapter, so that every kernel an adapter adds is compiled for it too
LORA_ONLY_TARGETS = (100,)
STEP_FORMATS = ("nvfp4", "w8a8-fp8")
STEP_PROMPT = 256  # cached prompt tokens before the canvas
# a LoRA adapter on the step (dgemma_cli/tuner/lora.py), traced beside the plain one: its terms fused (attention and
# dense MLP: quant/kernels/lora.py; the routed experts: in the MoE kernels' epilogues, quant/kernels/moe_gate_up.py)
STEP_ADAPTER = dict(rank=16, alpha=32, targets=("attention", "mlp"), expert_rank=16)
STEP_ADAPTER_LABEL = "nvfp4 + LoRA r16 (attention, dense MLP, experts)"


def whole_step_traces(targets) -> dict[int, list]:
    """{cc: [Work]}: one Work per (format, batch) holding its trace (dgemma_cli.step_trace) and its launches."""
    from dgemma_cli.step_trace import trace_step

    out = {}
    for cc in targets:
        runs = [(fmt, batch, None) for fmt in STEP_FORMATS for batch in aot.BATCHES] + [("nvfp4", 1, STEP_ADAPTER)]
        if cc in LORA_ONLY_TARGETS:
            runs = [("nvfp4", 1, None), ("nvfp4", 1, STEP_ADAPTER)]
        for fmt, batch, adapter in runs:
            trace = trace_step(batch=batch, prompt=STEP_PROMPT, target=cc, fmt=fmt, adapter=adapter)
            label = fmt if adapter is None else STEP_ADAPTER_LABEL
            w = aot.Work(family="whole step", label=label, batch=batch, dtype="bfloat16", count=1, floor_bytes=0,
                         flops=0, launches=trace.launches)
            w.trace = trace
            out.setdefault(cc, []).append(w)
    return out


# The placement tables (dgemma_cli/placement/step_tables.json, written with --update-tables): cards of 8 to 32 GB and
# the formats they are planned in, at an 8k context, batch 1 and 4.
# "nvfp4-experts": NVIDIA's published NVFP4 release as it is (experts only), what `dgemma pull` takes by default.
CARD_RUNS = {"RTX 3060 12GB": ("nvfp4", "nvfp4-experts"), "RTX 4060": ("nvfp4", "nvfp4-experts"),
             "RTX 4060 Ti 16GB": ("nvfp4", "nvfp4-experts"), "RTX 4080": ("nvfp4", "nvfp4-experts"),
             "RTX 5080": ("nvfp4", "nvfp4-experts"), "RTX 3090": ("nvfp4", "w8a8-int8"),
             "RTX 4090": ("nvfp4", "nvfp4-experts"), "RTX 5090": ("nvfp4", "nvfp4-experts")}
CARD_BATCHES = (1, 4)
CARD_CONTEXT = 8192
TABLES = ROOT / "dgemma_cli" / "placement" / "step_tables.json"


def card_traces() -> dict[int, list]:
    """{cc: [Work]}: one Work per (format, batch) a card of that compute capability is tabled for, at CARD_CONTEXT."""
    from dgemma_cli.step_trace import trace_step

    wanted = sorted({(CARD_GPUS[name][0], fmt, batch) for name, fmts in CARD_RUNS.items() for fmt in fmts
                     for batch in CARD_BATCHES})
    out: dict[int, list] = {}
    for cc, fmt, batch in wanted:
        trace = trace_step(batch=batch, prompt=CARD_CONTEXT - aot.CANVAS, target=cc, fmt=fmt)
        w = aot.Work(family="card step", label=fmt, batch=batch, dtype="bfloat16", count=1, floor_bytes=0, flops=0,
                     launches=trace.launches)
        w.trace = trace
        out.setdefault(cc, []).append(w)
    return out


def card_tables(card_work, jobs, results, job_of, errors: list[str]) -> dict:
    """Per card, format and batch: the step's bound in ms before the first layer, per layer, and after the last, each
    op bounded with the card's figures (its compute capability's compiled kernels) as the whole-step table does."""
    cards: dict = {}
    for name, fmts in CARD_RUNS.items():
        cc, gpu = CARD_GPUS[name]
        for w in card_work.get(cc, []):
            if w.label not in fmts:
                continue
            trace = w.trace
            L = 1 + max(i for i in trace.op_layers if i is not None)
            layer_ms, pre, post, seen_layer = [0.0] * L, 0.0, 0.0, False
            for op, layer in zip(trace.ops, trace.op_layers):
                if isinstance(op, aot.Launch):
                    res = results[jobs[job_of[id(op)]].key]
                    if not res["ok"]:
                        errors.append(f"card step ({name}, {w.label}, batch {w.batch}): {op.kernel} did not compile")
                        continue
                    named = aot.routed(op.named(), w.batch * aot.CANVAS, w.batch)
                    try:
                        us = roofline.launch_bound(gpu, op.kernel, named, op.grid, res)["bound"]
                    except roofline.LoopMismatch as e:
                        errors.append(f"card step ({name}, {w.label}, batch {w.batch}): {e}")
                        continue
                else:
                    us = torch_op_us(gpu, op)
                if layer is not None:
                    layer_ms[layer] += us / 1e3
                    seen_layer = True
                elif seen_layer:
                    post += us / 1e3
                else:
                    pre += us / 1e3
            cards.setdefault(name, {}).setdefault(w.label, {})[str(w.batch)] = dict(
                pre_ms=round(pre, 4), layer_ms=[round(x, 4) for x in layer_ms], post_ms=round(post, 4),
                kernels=trace.kernels, cc=cc)
    return cards


def placement_markdown(tables: dict) -> list[str]:
    """The placement table: the published 26B-A4B on each card at an 8k context, as dgemma plans it."""
    from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B, ModelConfig
    from dgemma_cli.placement.bounds import STEPS_PER_CANVAS, step_bounds
    from dgemma_cli.placement.cards import card
    from dgemma_cli.placement.plan import plan

    cfg = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
    small = ("RTX 3060 12GB", "RTX 4060", "RTX 4060 Ti 16GB", "RTX 4080", "RTX 5080")
    runs = [([n], "nvfp4", policy) for policy in ("all", "experts") for n in small]
    runs += [(["RTX 3090", "RTX 3090"], fmt, "all") for fmt in ("nvfp4", "int8")]
    out = ["| cards (layers on each) | format | batch | experts streamed (layers) | host link | step bound, as planned "
           "(ms) | copies waiting (ms) | if the card held all (ms) | planned / max(held all, copies) | canvas tok/s at "
           f"{STEPS_PER_CANVAS} steps |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for names, fmt, policy in runs:
        shown = f"{fmt} ({policy})"
        for batch in CARD_BATCHES:
            p = plan(cfg, fmt, [card(n) for n in names], context=CARD_CONTEXT, batch=batch, policy=policy)
            b = step_bounds(p, tables)
            copies = p.streamed_bytes_per_step / (min(c.card.copy_gb_per_s for c in p.cards) * 1e9) * 1e3
            ratio = None if b["step_bound_ms"] is None else b["step_bound_ms"] / max(b["resident_step_bound_ms"],
                                                                                      copies)
            used = " + ".join(f"{c.card.name} ({c.layers[0]}-{c.layers[-1]})" if c.layers else c.card.name
                              for c in p.cards)
            out.append(f"| {used} | {shown} | {batch} | {len(p.streamed)} | "
                       f"{p.link_gb_per_s:.1f} GB/s | {_f(b['step_bound_ms'])} | "
                       f"{_f(b['serial_copy_step_bound_ms'])} | {_f(b['resident_step_bound_ms'])} | {_f(ratio)} | "
                       f"{_f(b['canvas_tokens_per_s'], 0)} |"
                       if p.fits else f"| {' + '.join(names)} | {shown} | {batch} | does not fit: {p.refusal} |")
    return out


def torch_op_us(gpu, op) -> float:
    """A torch op at max(every byte it reads and writes at peak DRAM bandwidth, its FLOPs at the bf16 tensor peak,
    twice that for the FP8 / INT8 matmuls)."""
    rate = gpu.tensor_tflops * (2 if op.name in ("aten::_scaled_mm", "aten::_int_mm") else 1)
    return max(roofline.dram_us(gpu, op.bytes), op.flops / (rate * 1e6))


def fastest_rate(gpu, fmt: str) -> float:
    """The fastest dense TFLOPS a format's quantized matmuls allow on `gpu` (the physical floor's): FP4 x FP4 for
    NVFP4 where the card has it; 8-bit x 8-bit for FP8 W8A8 and for GGUF (its blocks' integers fit int8, as
    llama.cpp's integer kernels multiply them with 8-bit activations; dgemma's GGUF kernels multiply in bf16)."""
    if fmt.startswith("nvfp4"):
        return gpu.fp4_tflops or gpu.tensor_tflops
    return 2 * gpu.tensor_tflops


def whole_step_rows(step_work, jobs, results, job_of, errors: list[str], gpus=None) -> list[dict]:
    """Per target, format and batch: the step's bound (every op at its own bound, summed), its kernels, its
    transient memory per request and its physical floor. A launch that did not compile, or whose loops the
    declarations cannot count, is an error and leaves the step's bound unknown (None). gpus: {cc: [GPU]} to bound
    each target's step on (default: the target's GPU and roofline.STEP_ALSO's)."""
    from dgemma_cli.step_trace import floor_of

    rows = []
    for cc, items in step_work.items():
        on = gpus[cc] if gpus else (GPUS[cc], *roofline.STEP_ALSO.get(cc, ()))
        for gpu, w in [(gpu, w) for gpu in on for w in items]:
            trace, groups, unknown, tags = w.trace, {}, [], set()
            for op in trace.ops:
                if isinstance(op, aot.Launch):
                    res = results[jobs[job_of[id(op)]].key]
                    tags.add(jobs[job_of[id(op)]].tag)
                    key = "triton:" + op.kernel
                    try:
                        if not res["ok"]:
                            raise roofline.LoopMismatch(f"{op.kernel} did not compile: {res['error'][:200]}")
                        named = aot.routed(op.named(), w.batch * aot.CANVAS, w.batch)
                        b = roofline.launch_bound(gpu, op.kernel, named, op.grid, res)
                    except roofline.LoopMismatch as e:
                        unknown.append(f"whole step ({w.label}, batch {w.batch}, sm_{cc}): {e}")
                        continue
                    us, least, nbytes, flops = b["bound"], b["least"], \
                        roofline.traffic(roofline.declaration(op.kernel), named), b["mma_flops"]
                else:
                    key, nbytes, flops = op.name, op.bytes, op.flops
                    us = least = torch_op_us(gpu, op)
                g = groups.setdefault(key, dict(op=key, n=0, ms=0.0, least_ms=0.0, bytes=0, flops=0))
                g["n"] += 1
                g["ms"] += us / 1e3
                g["least_ms"] += least / 1e3
                g["bytes"] += nbytes
                g["flops"] += flops
            if trace.eager_kernels:  # launched one by one, outside the graph: each pays a launch
                ms = trace.eager_kernels * roofline.LAUNCH_US / 1e3
                groups["launches outside the graph"] = dict(op="launches outside the graph", n=trace.eager_kernels,
                                                            ms=ms, least_ms=ms, bytes=0, flops=0)
            for e in unknown:
                if e not in errors:
                    errors.append(e)
            f = floor_of(trace)
            fast = fastest_rate(gpu, trace.fmt)
            floor_mem = roofline.dram_us(gpu, f.weight_bytes) / 1e3
            floor_tc = (2 * f.quantized_params * f.rows / (fast * 1e6)
                        + 2 * f.dense_params * f.rows / (gpu.tensor_tflops * 1e6)) / 1e3
            floor = max(floor_mem, floor_tc)
            bound = None if unknown else sum(g["ms"] for g in groups.values())
            serial = None if unknown else sum(g["least_ms"] for g in groups.values())
            rows.append(dict(cc=cc, gpu=gpu.name, fmt=w.label, batch=w.batch, prompt=trace.prompt,
                             kernels=trace.kernels, torch_ops=len(trace.torch_ops), launches=len(trace.launches),
                             eager=trace.eager_kernels,
                             bound_ms=bound, floor_ms=floor, floor_mem_ms=floor_mem, floor_tc_ms=floor_tc,
                             ratio=None if bound is None else bound / floor, serial_ms=serial,
                             serial_ratio=None if serial is None else serial / floor,
                             transient_mb=trace.transient_bytes / MB, weight_gb=f.weight_bytes / 1e9,
                             vocab_f32=[list(shape) for shape in trace.vocab_f32], tags=sorted(tags),
                             groups=sorted(groups.values(), key=lambda g: -g["ms"])))
    return rows


def whole_step_markdown(rows) -> list[str]:
    out = [f"Every kernel of one denoise step (a canvas of 256 after {STEP_PROMPT} cached prompt tokens, "
           "self-conditioning on), traced on the meta device through the code a CUDA device runs "
           "(`dgemma_cli.step_trace.trace_step`): torch ops at max(bytes / peak DRAM bandwidth, FLOPs / tensor "
           "peak), every byte from DRAM; Triton launches at max(DRAM, MMA work as executed, every instruction "
           "issued, the busiest SM) from their compiled code (`roofline.launch_bound`). Physical floor: every "
           "weight byte the step reads once at peak bandwidth, or 2 x (active parameters + the soft embedding's "
           "vocab x hidden) x rows FLOPs at the fastest dense rate the format allows, whichever is larger. "
           "Serial floor: every op of the step at its own least time (its bytes at peak bandwidth or its useful "
           "FLOPs, real rows only, at the rate of the tensor-core instructions it uses, whichever is larger), "
           "summed: what these kernels run one after another cannot beat however well each is written, since a "
           "memory-bound op (the experts) cannot lend its idle tensor cores to a math-bound one (the dense "
           "linears, the head). Both count each kernel launched outside the step's CUDA graph (the sampler's "
           f"acceptance and stop test, the step's inputs) at {roofline.LAUNCH_US:g} us a launch "
           "(`roofline.LAUNCH_US`, an assumption, not measured). Transient: per request, the sampler's buffers and "
           "the step's largest live activations (KV cache and weights apart).", "",
           "| GPU | format | batch | kernels (torch + Triton; outside the graph) | step bound ms | "
           "physical floor ms (memory / math) | bound / floor | serial floor ms (/ floor) | bound / serial | "
           "transient MB per request | "
           "canvas x vocab float32 tensors |",
           "|---|---|---:|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        per_serial = None if r["bound_ms"] is None or not r["serial_ms"] else r["bound_ms"] / r["serial_ms"]
        out.append(f"| {r['gpu']} | {r['fmt']} | {r['batch']} | {r['kernels']:,} ({r['torch_ops']:,} + "
                   f"{r['launches']}; {r['eager']}) | {_f(r['bound_ms'])} | {r['floor_ms']:.2f} "
                   f"({r['floor_mem_ms']:.2f} / "
                   f"{r['floor_tc_ms']:.2f}) | {_f(r['ratio'])} | {_f(r['serial_ms'])} ({_f(r['serial_ratio'])}) | "
                   f"{_f(per_serial)} | {r['transient_mb']:,.0f} | "
                   f"{', '.join('x'.join(map(str, v)) for v in r['vocab_f32']) or 'none'} |")
    return out


def whole_step_detail(rows, top: int = 12) -> list[str]:
    out = []
    for r in rows:
        out += ["", f"{r['gpu']}, {r['fmt']}, batch {r['batch']}: the {top} largest parts of the bound", "",
                "| op | kernels | ms | its own floor ms | GB | GFLOP |", "|---|---:|---:|---:|---:|---:|"]
        for g in r["groups"][:top]:
            out.append(f"| {g['op']} | {g['n']} | {g['ms']:.3f} | {g['least_ms']:.3f} | {g['bytes'] / 1e9:.3f} | "
                       f"{g['flops'] / GFLOP:,.1f} |")
    return out


# ------------------------------------------------------------------------------------------------ GGUF steps

# The GGUF files people hold (dgemma_cli/checkpoint/gguf_mixes.py: Q4_K_M, Q8_0) on the consumer cards they run on,
# beside the NVFP4 step on the same card (`--gguf-steps`): the step's bound, its floors, and the instructions each
# quantized matmul kernel issues per weight, from its compiled code.
GGUF_STEP_GPUS = {86: ("RTX 3090",), 89: ("RTX 4090", "RTX 4080"), 120: ("RTX 5090",)}
GGUF_STEP_FORMATS = ("nvfp4", "gguf-q4_k_m", "gguf-q8_0")
GGUF_BEGIN, GGUF_END = "<!-- gguf-steps:begin -->", "<!-- gguf-steps:end -->"
MATMULS = {"moe_gate_up_kernel": "experts gate-up", "moe_down_kernel": "experts down", "ggml_linear_kernel": "linear",
           "nvfp4_linear_kernel": "linear", "nvfp4_w4a4_kernel": "linear (W4A4)",
           "moe_gate_up_w4a4_kernel": "experts gate-up (W4A4)", "moe_down_w4a4_kernel": "experts down (W4A4)",
           "head_logits_kernel": "head logits", "head_soft_kernel": "head soft embedding"}


def named_gpu(name: str):
    return next(g for g in [*GPUS.values(), *(g for _, g in CARD_GPUS.values())] if g.name == name)


def gguf_step_traces() -> dict[int, list]:
    """{cc: [Work]}: the step of each GGUF_STEP_FORMATS format at batch 1 and 4, as a GPU of that compute capability
    runs it."""
    from dgemma_cli.step_trace import trace_step

    out: dict[int, list] = {}
    for cc in GGUF_STEP_GPUS:
        for fmt in GGUF_STEP_FORMATS:
            for batch in aot.BATCHES:
                trace = trace_step(batch=batch, prompt=STEP_PROMPT, target=cc, fmt=fmt)
                w = aot.Work(family="gguf step", label=fmt, batch=batch, dtype="bfloat16", count=1, floor_bytes=0,
                             flops=0, launches=trace.launches)
                w.trace = trace
                out.setdefault(cc, []).append(w)
    return out


def matmul_instructions(w, jobs, results, job_of) -> dict[str, float]:
    """Thread-instructions per weight of each quantized matmul kernel the step launches (its loop, from its SASS),
    by kernel and weight type; a kernel launched with several settings: the most."""
    from quant.kernels.ggml_decode import KINDS

    per: dict[str, float] = {}
    for op in w.trace.launches:
        res = results[jobs[job_of[id(op)]].key]
        if op.kernel not in MATMULS or not res["ok"]:
            continue
        named = aot.routed(op.named(), w.batch * aot.CANVAS, w.batch)
        _, pe = roofline.warp_instructions(op.kernel, roofline.declaration(op.kernel), named, op.grid,
                                           res["num_warps"], res["loops"], res["straight"])
        if op.kernel.startswith("head_"):  # the tied embedding: 16-bit, or GGUF blocks (KIND >= 0)
            kind = KINDS[named["KIND"]] if named.get("KIND", -1) >= 0 else "bf16"
        else:
            kind = KINDS[named["KIND"]] if named.get("FORMAT", 2) == 2 and "KIND" in named else "NVFP4"
        label = f"{MATMULS[op.kernel]} {kind}"
        per[label] = max(pe, per.get(label, 0.0))
    return per


def gguf_steps_markdown(rows, per_weight) -> list[str]:
    nvfp4 = {(r["gpu"], r["batch"]): r["bound_ms"] for r in rows if r["fmt"] == "nvfp4"}
    out = ["| GPU | format | batch | weights GB | step bound ms | bound / NVFP4's | physical floor ms (memory / math) "
           "| bound / floor | serial floor ms | thread-instructions per weight (kernel, type) |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["gpu"], r["batch"], r["fmt"])):
        base = nvfp4.get((r["gpu"], r["batch"]))
        vs = None if r["bound_ms"] is None or not base else r["bound_ms"] / base
        instr = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_weight[r["cc"], r["fmt"], r["batch"]].items()))
        out.append(f"| {r['gpu']} | {r['fmt']} | {r['batch']} | {r['weight_gb']:.2f} | {_f(r['bound_ms'])} | "
                   f"{_f(vs)} | {r['floor_ms']:.2f} ({r['floor_mem_ms']:.2f} / {r['floor_tc_ms']:.2f}) | "
                   f"{_f(r['ratio'])} | {_f(r['serial_ms'])} | {instr} |")
    return out


def gguf_steps(args, argv) -> int:
    """--gguf-steps: trace, compile and bound the GGUF_STEP_FORMATS steps alone; write OUT/gguf_steps.md and
    OUT/gguf_steps.json (and BENCHMARKS.md's gguf-steps section with --update-benchmarks)."""
    t0 = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
        shutil.rmtree(args.out, ignore_errors=True)
        (args.out / "kernels").mkdir(parents=True)
        work = gguf_step_traces()
        jobs, results, job_of = compile_work(work, args.j, args.out / "kernels")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    errors = [f"{j.tag}: {results[k]['error']}" for k, j in jobs.items() if not results[k]["ok"]]
    gpus = {cc: [named_gpu(n) for n in names] for cc, names in GGUF_STEP_GPUS.items()}
    rows = whole_step_rows(work, jobs, results, job_of, errors, gpus)
    per_weight = {(cc, w.label, w.batch): matmul_instructions(w, jobs, results, job_of)
                  for cc, items in work.items() for w in items}
    prov = provenance(argv)
    head = (f"{prov['date']} · triton {prov['triton']} · torch {prov['torch']} · commit {prov['commit']} · "
            f"`{prov['command']}` · no GPU: compiled for sm_{', sm_'.join(map(str, GGUF_STEP_GPUS))} with Triton's "
            f"bundled ptxas; {len(jobs)} compilations, {time.perf_counter() - t0:.0f} s"
            + (f"; **{len(errors)} errors**" if errors else ""))
    table = gguf_steps_markdown(rows, per_weight)
    (args.out / "gguf_steps.md").write_text("\n".join([head, "", *table, *whole_step_detail(rows, top=8),
                                                       "", *[f"- error: {e}" for e in errors]]) + "\n")
    (args.out / "gguf_steps.json").write_text(json.dumps(dict(
        **prov, errors=errors, rows=[{k: v for k, v in r.items() if k != "groups"} for r in rows],
        per_weight=[dict(cc=cc, fmt=fmt, batch=b, kernels=v) for (cc, fmt, b), v in per_weight.items()]), indent=1))
    if args.update_benchmarks:
        update_benchmarks(ROOT / "BENCHMARKS.md", [head + ".", "", *table], GGUF_BEGIN, GGUF_END)
    print("\n".join(table))
    for e in errors:
        log(f"kernel report: {e}")
    return 1 if errors else 0


# ------------------------------------------------------------------------------------------------ markdown


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _ratio(r) -> str:
    return "-" if r is None else f"**{r:.1f}** !" if r > roofline.OVER else f"{r:.2f}"


def summary_markdown(steps, targets, dtypes=("bfloat16", "float32")) -> list[str]:
    """issue / max(DRAM, tensor) per family (rows) and GPU (columns)."""
    names = [GPUS[cc].name for cc in targets]
    cells: dict[tuple, dict] = {}
    for s in steps:
        if s["dtype"] in dtypes:
            cells.setdefault((s["batch"], s["family"]), {})[s["gpu"]] = s["ratio"]
    out = ["| B | family | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    for (batch, family), row in sorted(cells.items()):
        out.append(f"| {batch} | {family} | " + " | ".join(_ratio(row.get(n)) for n in names) + " |")
    return out


def gpu_markdown(steps, cc, dtypes=("bfloat16", "float32")) -> list[str]:
    out = ["| B | family | floor MB | est. traffic MB | GFLOP | DRAM ms | tensor ms | issue ms | issue / max |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in steps:
        if s["cc"] == cc and s["dtype"] in dtypes:
            traffic = "-" if s["traffic"] is None else f"{s['traffic'] / MB:,.0f}"
            flops = f"{(s['flops'] + s['fp4_flops']) / GFLOP:,.0f}" + (" (FP4)" if s["fp4_flops"] else "")
            out.append(f"| {s['batch']} | {s['family']} | {s['floor_bytes'] / MB:,.0f} | {traffic} | {flops} | "
                       f"{_f(s['dram_ms'])} | {_f(s['tensor_ms'])} | "
                       f"{_f(s['issue_ms'])} | {_ratio(s['ratio'])} |")
    return out


def compiled_markdown(rows, dtypes=None) -> list[str]:
    out = ["| kernel | sm | config | regs | spill st/ld B | smem KB / limit | tensor-core ops | loop instr/iter "
           "(warp) | thread-instr per element | loop mix tc/gmem/smem/sfu/conv/other/fp/int |",
           "|---|---|---|---:|---|---|---|---|---:|---|"]
    for r in rows:
        if dtypes and not any(f" {d} " in f" {r['config']} " for d in dtypes):
            continue
        head = f"| {r['kernel']} | {r['cc']} | {r['config']} |"
        if not r["ok"]:
            out.append(f"{head} **compile failed**: {r['error'][:160].replace('|', '/')} | | | | | | |")
            continue
        spill = f"{r['spill_stores']}/{r['spill_loads']}"
        spill = f"**{spill}**" if r["spill_stores"] or r["spill_loads"] else spill
        smem = f"{r['smem'] / 1024:.1f} / {r['smem_limit'] // 1024}"
        smem += " **over**" if r["smem"] > r["smem_limit"] else ""
        loops = " + ".join(str(lp["instrs"]) for lp in r["loops"]) or f"{r['straight']}, no loop"
        mixes = ", ".join("/".join(str(v) for v in lp["mix"].values()) for lp in r["loops"]) or "-"
        out.append(f"{head} {r['regs']} | {spill} | {smem} | {', '.join(r['tc_ops']) or 'none'} | {loops} | "
                   f"{_f(r['per_elem'], 1)} | {mixes} |")
    return out


LEGEND = ("Per denoise step (30 layers; every linear a quantized checkpoint may hold), with the launch settings the "
          "wrappers choose on each GPU. DRAM-bound: the minimal bytes (floor MB: weights and scales once, "
          "activations read once, outputs written once) at peak bandwidth; tensor-bound: the useful FLOPs over the "
          "real routed rows at the dense bf16 peak (the FP4 peak for FP4 x FP4 kernels); issue-bound: the SASS "
          "loops' warp-instructions x trips x warps x CTAs (a loop-free kernel: its straight-line code once) at 4 "
          f"per clock per SM. issue / max(DRAM, tensor) above {roofline.OVER} is bold and marked !: the kernel's own "
          "instructions, not memory or math, set its floor. Est. traffic: what the kernels and the torch ops between "
          "them move (every tensor argument once, the sampler's logits three times, W4A4 activations twice). Compiled "
          "kernels: thread-instructions per element are the loops' per weight element (GEMMs), per logit (sampler) "
          "or per activation element (quantizer).")


def provenance(argv: list[str]) -> dict:
    import torch
    import triton

    def git(*a):
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=all", "--", "quant"):
        commit += " + uncommitted changes in quant/"
    return dict(date=datetime.date.today().isoformat(), triton=triton.__version__, torch=torch.__version__,
                commit=commit, command=" ".join(["python scripts/kernel_report.py", *argv]))


def step_tables(steps, targets) -> list[str]:
    out = [LEGEND, "", "issue / max(DRAM, tensor), bf16 compute:", "", *summary_markdown(steps, targets), ""]
    for cc in targets:
        out += [f"{GPUS[cc].name} (sm_{cc}):", "", *gpu_markdown(steps, cc), ""]
    return out


def resource_warnings(compiled: list[dict]) -> list[str]:
    """Compiled kernels that spill registers or ask for more shared memory than a block of their target may have
    (facts about the kernels, not failures of the report)."""
    out = [f"{r['tag']}: {r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads" for r in compiled
           if r["ok"] and (r["spill_stores"] or r["spill_loads"])]
    return out + [f"{r['tag']}: {r['smem']} B shared memory, over the {r['smem_limit']} B a block may have"
                  for r in compiled if r["ok"] and r["smem"] > r["smem_limit"]]


def report_markdown(head, timing, errors, warnings, steps, compiled, targets, whole) -> list[str]:
    out = ["# dgemma's Triton kernels compiled without a GPU", "", head, "", timing, ""]
    if errors or warnings:
        out += ["## Errors (compile failures, loop declarations) and warnings (spills, shared memory)", "",
                *[f"- error: {e}" for e in errors], *[f"- warning: {w}" for w in warnings], ""]
    if whole:
        out += ["## The whole denoise step", "", *whole_step_markdown(whole), *whole_step_detail(whole), ""]
    return out + ["## Per denoise step, by kernel family", "", *step_tables(steps, targets),
                  "float16 compute, issue / max(DRAM, tensor):", "",
                  *summary_markdown(steps, targets, dtypes=("float16",)), "",
                  "## Compiled kernels", "", *compiled_markdown(compiled), ""]


def update_benchmarks(path: Path, section: list[str], begin: str = BEGIN, end: str = END) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    path.write_text(head + begin + "\n" + "\n".join(section) + "\n" + end + rest.split(end, 1)[1])


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "kernel-report")
    ap.add_argument("-j", type=int, default=min(8, len(os.sched_getaffinity(0))), help="compiler processes")
    ap.add_argument("--targets", default=",".join(map(str, GPUS)), help="compute capabilities")
    ap.add_argument("--update-benchmarks", action="store_true", help="rewrite BENCHMARKS.md's kernel-report section")
    ap.add_argument("--update-tables", action="store_true", help="also bound the step on the placement's cards and "
                    "write dgemma_cli/placement/step_tables.json (what `dgemma plan` reads)")
    ap.add_argument("--fp16-targets", default=None,
                    help="compile the float16 builds for these targets only (default: every target; the tests take "
                         "two, for time)")
    ap.add_argument("--gguf-steps", action="store_true",
                    help="only the GGUF steps (Q4_K_M, Q8_0) beside NVFP4's on the RTX 3090, 4090, 4080 and 5090: "
                         "OUT/gguf_steps.md, and BENCHMARKS.md's gguf-steps section with --update-benchmarks")
    args = ap.parse_args(argv)
    if args.gguf_steps:
        if reason := aot.missing_tools():
            log(f"kernel report: {reason}")
            return 2
        return gguf_steps(args, argv)
    targets = [int(t) for t in args.targets.split(",")]
    fp16 = set(targets) if args.fp16_targets is None else {int(t) for t in args.fp16_targets.split(",")}
    if args.update_benchmarks and fp16 != set(targets):
        ap.error("--update-benchmarks writes every build's figures: leave out --fp16-targets")
    unknown = [t for t in targets if t not in GPUS]
    if unknown:
        ap.error(f"no GPU figures for sm_{unknown[0]} (known: {', '.join(map(str, GPUS))})")
    if reason := aot.missing_tools():
        log(f"kernel report: {reason}")
        return 2
    t0 = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="triton-cache-")  # a fresh cache: every kernel really compiles, ptxas logs
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
        shutil.rmtree(args.out, ignore_errors=True)
        (args.out / "kernels").mkdir(parents=True)
        work = {cc: aot.real_shape_work(cc, aot.DTYPES if cc in fp16 else aot.DTYPES[:1]) for cc in targets}
        step_work = whole_step_traces([cc for cc in STEP_TARGETS + LORA_ONLY_TARGETS if cc in targets])
        card_work = card_traces() if args.update_tables else {}
        missing = sorted(set(card_work) - set(targets))
        if missing:
            ap.error(f"--update-tables needs sm_{missing[0]} among --targets (the cards' compute capabilities)")
        t_capture = time.perf_counter() - t0
        both = {cc: work.get(cc, []) + step_work.get(cc, []) + card_work.get(cc, []) for cc in targets}
        jobs, results, job_of = compile_work(both, args.j, args.out / "kernels")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    t_compile = time.perf_counter() - t0 - t_capture

    compile_errors = [f"{j.tag}: {results[k]['error']}" for k, j in jobs.items() if not results[k]["ok"]]
    loop_errors: list[str] = []
    launches = launch_rows(work, jobs, results, job_of, loop_errors)
    steps = step_rows(work, launches)
    whole = whole_step_rows(step_work, jobs, results, job_of, loop_errors)
    tables = None
    if args.update_tables:
        tables = dict(**provenance(argv), context=CARD_CONTEXT, canvas=aot.CANVAS, hidden=2816,
                      note="bounds in ms per denoise step, grouped before the first layer, per layer and after the "
                           "last; written by scripts/kernel_report.py --update-tables",
                      cards=card_tables(card_work, jobs, results, job_of, loop_errors))
        TABLES.write_text(json.dumps(tables, indent=1) + "\n")
    compiled = compiled_rows(jobs, results, launches)
    errors, warnings = compile_errors + loop_errors, resource_warnings(compiled)
    prov = provenance(argv)
    wall = time.perf_counter() - t0
    problems = ", ".join(f"**{n} {what}**" for n, what in ((len(errors), "errors"), (len(warnings), "warnings")) if n)
    head = (f"{prov['date']} · triton {prov['triton']} · torch {prov['torch']} · commit {prov['commit']} · "
            f"`{prov['command']}` · no GPU: compiled for sm_{', sm_'.join(map(str, targets))} with Triton's bundled "
            f"ptxas" + (f"; {problems} (listed in kernel-report/report.md)" if problems else ""))

    timing = (f"{len(job_of)} launches -> {len(jobs)} compilations; capture {t_capture:.0f} s, compile "
              f"{t_compile:.0f} s, total {wall:.0f} s.")
    placement = placement_markdown(tables) if tables is not None else []
    (args.out / "report.md").write_text("\n".join(report_markdown(head, timing, errors, warnings, steps, compiled,
                                                                   targets, whole)
                                                 + (["", "Cards smaller than the model (dgemma plan):", "", *placement]
                                                    if placement else [])))
    (args.out / "results.json").write_text(json.dumps(dict(
        **prov, targets=targets, gpus={cc: vars(GPUS[cc]) for cc in targets}, compile_errors=compile_errors,
        loop_errors=loop_errors, warnings=warnings, steps=steps, compiled=compiled, launches=launches,
        whole_step=whole), indent=1))
    if args.update_benchmarks:
        update_benchmarks(ROOT / "BENCHMARKS.md", [
            head + ".", "", "The whole denoise step:", "", *whole_step_markdown(whole), "",
            "Per kernel family:", "", *step_tables(steps, targets),
            "Compiled kernels (the bf16 and float32 builds; the fp16 ones are in kernel-report/report.md):", "",
            *compiled_markdown(compiled, ("bf16", "fp32")),
            *(["", "Cards smaller than the model: the 26B-A4B as `dgemma plan` places it at an 8k context (NVFP4 "
               "(all) and INT8 W8A8 with attention and the dense MLP quantized too, `--policy all`; NVFP4 (experts): "
               "NVIDIA's published release as it is, attention and the dense MLP 16-bit; the "
               "streamed experts' copies over PCIe at 80% of the link's coded rate, an assumption, scheduled as "
               "dgemma_cli/placement/streaming.py runs them on a GPU: each layer's copy queued when its buffer is "
               "free, the next step's first two landing before the step ends; bounds, not measurements):", "",
               *placement]
              if placement else [])])
    print("\n".join(summary_markdown(steps, targets)))
    print("\n".join(whole_step_markdown(whole)))
    if placement:
        print("\n".join(placement))
    log(f"wrote {args.out}/report.md and results.json ({wall:.0f} s)")
    for e in errors + warnings:
        log(f"kernel report: {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
