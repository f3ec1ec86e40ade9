"""Load a model and generate: the Python API the CLI, chat and infill are built on.

    engine = load("path/to/checkpoint")                 # device/dtype "auto"
    result = engine.generate("Why is the sky blue?", seed=0)
    print(result.texts[0])
    for event in engine.events(["a", "b"], seed=0): ... # Step / CanvasDone / Done, see sampler.py

The engine joins the pieces (weights, network, tokenizer, sampler) and owns nothing of their insides.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from .checkpoint.stored import is_gguf
from .config import GenerationSettings, ModelConfig
from .structured.constrain import Structure
from .structured.worker import DEFAULT_MEMORY, DEFAULT_SECONDS, DEFAULT_WORKERS
from .device import SMALL_STEP, fit_cpu_threads, parse_devices, resolve_device, resolve_devices, resolve_dtype
from .errors import ModelError, UsageError
from .model import DiffusionGemma, KVCache
from .checkpoint.names import DEMO_MODEL, resolve_model  # noqa: F401 (engine.DEMO_MODEL is part of the API)
from .sampler import Done, Event, SamplerBuffers, generate_events
from .tokenizer import Control, Tokenizer
from .checkpoint.weights import load_model

def check_kernels(device: torch.device) -> None:
    """DGEMMA_KERNELS (and DGEMMA_SAMPLER) must name an implementation that can run on `device` (one line if not)."""
    from quant.kernels import use_triton

    from .sampler import use_fused_head

    try:
        use_triton(device)
        use_fused_head(torch.device("cpu"), torch.bfloat16)  # validates DGEMMA_SAMPLER without probing a kernel
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None


def denoise_into(model: DiffusionGemma, canvas: torch.Tensor, cache, ctx, buf: SamplerBuffers, self_conditioned: bool,
                 sc_rows: list[int] | None = None, experts_per_row: bool = False) -> torch.Tensor | None:
    """One forward pass whose results land in the sampler's buffers (`Denoiser.denoise`): the torch path's logits,
    or the fused head's draws. cache, ctx, sc_rows, experts_per_row as `DiffusionGemma.denoise` takes them. Returns
    the final-normed hidden states [B, C, H] with the fused head (a caller may need some rows' logits after all:
    the server's structured answers), None on the torch path."""
    if buf.fused is None:
        model.denoise(canvas, cache, ctx, sc_probs=buf.probs if self_conditioned else None, out=buf.logits,
                      sc_rows=sc_rows, experts_per_row=experts_per_row)
        return None
    hidden = model.denoise(canvas, cache, ctx, sc_soft=buf.fused.soft if self_conditioned else None,
                           return_hidden=True, sc_rows=sc_rows, experts_per_row=experts_per_row)
    model.fused_head(hidden, buf.temperature, buf.uniforms, buf.fused)
    return hidden


class ModelDenoiser:
    """The sampler's view of the network: one batch, one static KV cache.

    `captures` / `replays` count CUDA graphs captured and denoise steps served by replaying one (always 0 here; the
    graphed denoiser counts them), and `fallback` says why a graphed denoiser went eager (None when it did not):
    `stats()` hands them to the Done event (`Done.stats`), so a test or `dgemma bench` can tell a replayed step from a
    silent eager one.
    """

    captures = 0
    replays = 0
    fallback: str | None = None

    def __init__(self, model: DiffusionGemma, batch: int, capacity: int):
        self.model = model
        self.batch = batch
        self.cache: KVCache = model.new_cache(batch, capacity)
        self.vocab_size = model.cfg.text.vocab_size
        self.canvas_length = model.cfg.canvas_length
        self.hidden_size = model.cfg.text.hidden_size
        self.dtype = model.dtype
        self.head_family = model.head_family  # the fused head's kernels: GGUF blocks have their own
        self.plain_head = not model.token_rows  # the fused head reads the embedding as it is, without adapter rows
        self.ctx = None
        # Soft tokens [N, H] of the images in the next encoded chunk (the prompt): used once, then dropped.
        self.image_features: torch.Tensor | None = None

    def encode(self, ids: torch.Tensor, valid: torch.Tensor | None) -> None:
        features, self.image_features = self.image_features, None
        self.model.encode(ids, self.cache, valid, image_features=features)

    def start_canvas(self) -> None:
        self.ctx = self.model.denoise_context(self.cache, self.batch)

    def denoise(self, canvas: torch.Tensor, buf: SamplerBuffers, self_conditioned: bool) -> None:
        denoise_into(self.model, canvas, self.cache, self.ctx, buf, self_conditioned)

    def run_step(self, step: Callable[[], None], graphable: bool) -> None:
        """One whole step of the sampler (`sampler.whole_step`): here, as it is."""
        step()

    def stats(self) -> dict:
        return {"graph_captures": self.captures, "graph_replays": self.replays, "graph_fallback": self.fallback}


class GraphedDenoiser(ModelDenoiser):
    """CUDA: the steps of a canvas after the first are captured as one CUDA graph and replayed, each a whole step
    (`sampler.whole_step`: the rows that sit it out counted, its temperature and random draws, the forward pass, the
    sampler's acceptance, renoising, convergence test and the step's record), so the host launches one graph a step
    and reads nothing back but the stop test's verdict.

    Within a canvas every tensor a step touches has a fixed shape and address: the canvas and what the sampler
    carries between steps live in its `CanvasState`, the self-conditioning input and the step's results in the
    sampler's buffers, the cache's scratch slots and the `DenoiseContext` do not move, and the step finds its index
    (its temperature, its record's slot) on the device. Random draws inside the graph come from torch's generator,
    whose offset every replay advances as an eager step would, so the draws are the eager steps' own. The first step
    (no self-conditioning) runs eagerly; the second runs eagerly too (its result is the step's) and is captured right
    after; later steps replay. The context and the state change when a canvas starts, so a canvas gets its own graph,
    in one memory pool shared by all of them. If a capture fails (a path with a host round trip), this denoiser
    stays eager. A step the host takes part in (constrained rows, whose search reads each step: `run_step` with
    graphable False) and a caller of `denoise` alone get the forward pass captured alone, the same way.
    """

    def __init__(self, model: DiffusionGemma, batch: int, capacity: int):
        super().__init__(model, batch, capacity)
        self.pool = torch.cuda.graph_pool_handle()
        self.eager = False
        self.inside = False  # in run_step: its forward pass runs as it is (the step's graph holds it)
        self.captures = self.replays = 0

    def start_canvas(self) -> None:
        super().start_canvas()
        self.graph: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None
        self.step_graph: torch.cuda.CUDAGraph | None = None

    def _capture(self, run: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        """`run` captured as a graph (recorded, not run), or None after a failed capture, which leaves this denoiser
        eager from then on."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                run()
        except RuntimeError as e:  # something on this path talks to the host: no graph for this model
            self.eager = True
            self.fallback = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            torch.cuda.synchronize()
            for hook in self.model.pass_hooks:  # streamed experts: the failed capture's copies never ran
                hook.reset()
            return None
        self.captures += 1
        return graph

    def run_step(self, step: Callable[[], None], graphable: bool) -> None:
        if not graphable or self.eager:  # a step the host takes part in (constraints): its forward alone is graphed
            return step()
        self.inside = True
        try:
            if self.step_graph is not None:
                self.step_graph.replay()
                self.replays += 1
                return
            step()  # this step's result, and the warm-up for the capture
            self.step_graph = self._capture(step)  # recorded without running: the state holds this step
        finally:
            self.inside = False

    def denoise(self, canvas: torch.Tensor, buf: SamplerBuffers, self_conditioned: bool) -> None:
        if self.inside or not self_conditioned or self.eager:
            return super().denoise(canvas, buf, self_conditioned)
        if self.graph is not None:
            graph, static = self.graph
            static.copy_(canvas)
            graph.replay()
            self.replays += 1
            return
        static = canvas.clone()
        super().denoise(static, buf, True)  # this step's result, and the warm-up for the capture
        graph = self._capture(lambda: ModelDenoiser.denoise(self, static, buf, True))
        if graph is not None:
            self.graph = (graph, static)  # the capture recorded work without running it: `buf` holds this step


def graph_safe(model: DiffusionGemma) -> bool:
    """Whether the forward can be captured: bfloat16 weights with torch's grouped matmul (its fallback syncs)."""
    return (model.dtype == torch.bfloat16 and hasattr(torch.nn.functional, "grouped_mm")
            and torch.cuda.get_device_capability(model.device) >= (8, 0)
            and model.split() is None)  # one graph, one device: a split over cards runs eagerly


def make_denoiser(model: DiffusionGemma, batch: int, capacity: int) -> ModelDenoiser:
    """The graphed denoiser on CUDA where the forward can be captured (unless DGEMMA_EAGER=1), else the plain one."""
    if model.device.type == "cuda" and os.environ.get("DGEMMA_EAGER", "") != "1" and graph_safe(model):
        return GraphedDenoiser(model, batch, capacity)
    return ModelDenoiser(model, batch, capacity)


@dataclass
class Result:
    texts: list[str]  # the answers (thought channel removed)
    thoughts: list[str]  # thought-channel text, "" when the model did not think
    token_ids: list[list[int]]  # generated ids, ending before the first end-of-sequence id
    prompt_token_ids: list[list[int]]
    steps_per_canvas: list[list[int]]
    tokens_per_forward: list[float]
    seconds: float
    satisfied: list[bool] | None = None  # with a structure: per answer, whether it completed it (Done.satisfied)


class Engine:
    def __init__(self, model: DiffusionGemma, tokenizer: Tokenizer | None, settings: GenerationSettings,
                 path: Path | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings  # the checkpoint's defaults; per-call overrides never mutate them
        self.path = path
        self._vision = None  # the vision tower, read from the checkpoint at the first image
        self._vision_lock = threading.Lock()  # the server's request threads may ask for it at once: read it once
        self._compiler = None  # structured.worker.StructureCompiler, started at the first structure
        self._compiler_lock = threading.Lock()
        self._compiler_stopped = False  # close_compiler: a server shutting down
        self.compile_budget = (DEFAULT_SECONDS, DEFAULT_MEMORY)  # structure compiles: set_compile_budget
        self.compile_workers = DEFAULT_WORKERS

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def view_hints(self) -> dict:
        """How a live view may draw this model's canvas: the checkpoint's `dgemma_view.json` (e.g.
        `{"board": {"rows": 4, "cols": 4, "box": [2, 2], "row_stride": 5}}`), {} when there is none or it is not a
        JSON object. A file of its own: the reference refuses unknown keys in generation_config.json. A hint only
        lays the canvas out; it never changes generation."""
        import json

        try:
            hints = json.loads((Path(self.path) / "dgemma_view.json").read_text())
        except (OSError, TypeError, ValueError):
            return {}
        return hints if isinstance(hints, dict) else {}

    # ------------------------------------------------------------------ prompts

    def prompt_ids(self, prompt: str | Sequence[int], raw: bool = False, system: str | None = None,
                   enable_thinking: bool = False, images: Sequence = ()) -> list[int]:
        """Text -> ids: through the chat template, or (raw) exactly as given with no special tokens added.

        With `images` (`image.Patches`), the chat message starts with one image placeholder per image; raw text
        and token ids must hold the placeholders themselves. Each placeholder becomes begin-of-image, N image
        tokens, end-of-image (`with_images`)."""
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
        else:
            if not prompt.strip():
                raise UsageError("empty prompt")
            if self.tokenizer is None:
                raise ModelError(f"{self.path}: no tokenizer.json, so text prompts cannot be encoded")
            if raw:
                ids = self.tokenizer.encode(prompt)
            else:
                content = [Control(self.image_placeholder())] * len(images) + [prompt] if images else prompt
                messages = ([{"role": "system", "content": system}] if system else [])
                messages.append({"role": "user", "content": content})
                ids = self.tokenizer.encode_chat(messages, enable_thinking=enable_thinking)
        if not ids:
            raise UsageError("empty prompt")
        if images:
            ids = self.with_images(ids, images)
        V = self.config.text.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            raise UsageError(f"prompt has a token id outside the vocabulary of {V}")
        return ids

    def check_context(self, prompt_len: int, settings: GenerationSettings, held: int = 0) -> int:
        """Raise if prompt + whole canvases exceed the model's context; return the KV cache capacity needed
        (the last canvas is never encoded: the cache's scratch tail holds it)."""
        C = self.config.canvas_length
        canvases = settings.canvases_for(C - held)
        need = prompt_len + canvases * C
        ctx = self.config.text.max_position_embeddings
        if need > ctx:
            raise UsageError(f"prompt is {prompt_len} tokens; with {settings.max_new_tokens} new tokens it needs "
                             f"{need} positions but the model's context is {ctx}")
        return need - C

    # ------------------------------------------------------------------ images

    def image_patches(self, images: Sequence | None, image_tokens: int | None = None) -> list:
        """Image files (paths or bytes), `PIL.Image`s or ready `image.Patches` -> `image.Patches`, all at one budget
        of soft tokens (default: the checkpoint's, 280)."""
        if not images:
            return []
        vision = self.config.vision
        if vision is None and is_gguf(self.path):
            raise ModelError(f"{self.path.name}: a GGUF holds no vision tower, so it cannot read images (the vision "
                             "weights are the base repository's: `dgemma pull google/diffusiongemma-26B-A4B-it`)")
        if vision is None:
            raise ModelError(f"{self.path}: this model has no vision tower, so it cannot read images")
        from .image import Patches, load_patches, patchify

        budget = image_tokens or vision.default_soft_tokens
        geometry = (budget, vision.patch_size, vision.pooling_kernel_size)
        out = []
        for im in images:
            if isinstance(im, Patches):
                out.append(im)
            elif isinstance(im, (str, Path, bytes, bytearray)):
                out.append(load_patches(im, *geometry))
            else:
                out.append(patchify(im, *geometry))
        if len({tuple(p.pixel_values.shape) for p in out}) > 1:
            raise UsageError("the images of one prompt must share one --image-tokens budget")
        return out

    def image_placeholder(self) -> str:
        """The text the chat template carries for one image (Gemma 4: `<|image|>`), from the tokenizer."""
        token_id = self.config.vision.image_token_id
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if not text or self.tokenizer.encode(text) != [token_id]:
            raise ModelError(f"{self.path}: the tokenizer has no image token (id {token_id})")
        return text

    def with_images(self, ids: list[int], images: Sequence) -> list[int]:
        """ids with each image placeholder (a lone image token) expanded to begin-of-image, N image tokens,
        end-of-image, N the image's soft tokens. Ids already expanded for these images are returned as they are."""
        v = self.config.vision
        runs = []  # (start, length) of each run of image tokens
        for i, t in enumerate(ids):
            if t == v.image_token_id:
                if runs and runs[-1][0] + runs[-1][1] == i:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                else:
                    runs.append((i, 1))
        wanted = [p.soft_tokens for p in images]
        if [n for _, n in runs] == wanted and all(s > 0 and ids[s - 1] == v.boi_token_id for s, _ in runs):
            return list(ids)  # already expanded
        at = [i for i, t in enumerate(ids) if t == v.image_token_id]  # each one a placeholder
        if len(at) != len(images):
            raise UsageError(f"the prompt has {len(at)} image placeholders for {len(images)} images")
        out, last = [], 0
        for start, n in zip(at, wanted):
            out += ids[last:start] + [v.boi_token_id] + [v.image_token_id] * n + [v.eoi_token_id]
            last = start + 1
        return out + ids[last:]

    def vision_tower(self):
        """The vision tower, read on first use in the text model's device and dtype."""
        with self._vision_lock:
            if self._vision is None:
                from .vision import load_vision

                self._vision = load_vision(self.path, self.config.vision, self.config.text.hidden_size,
                                           device=self.model.device, dtype=self.model.dtype)
        return self._vision

    def image_features(self, images: Sequence) -> torch.Tensor:
        """`image.Patches` -> their soft tokens [sum of soft_tokens, H], image after image."""
        from .vision import encode_images

        return encode_images(self.vision_tower(), list(images))

    # ------------------------------------------------------------------ generation

    def events(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], *, raw: bool = False,
               system: str | None = None, seed: int | None = None, enable_thinking: bool = False,
               settings: GenerationSettings | None = None, images: Sequence | None = None,
               image_tokens: int | None = None, structure: Structure | None = None,
               **overrides) -> Iterator[Event]:
        """Yield sampler events for one prompt or a batch (strings, or lists of token ids).

        Overrides are GenerationSettings fields (max_new_tokens, max_denoising_steps, ...). With `seed`, torch's
        global generator is seeded first, as `torch.manual_seed(seed)` before the reference's generate.
        `images` (files, PIL images or `image.Patches`) go with a single prompt, at `image_tokens` soft tokens each.
        `structure` (constrain.Structure): every row's answer held to it (docs/design.md, Constrained canvases); the
        Done event's `satisfied` says per row whether the answer completed it within max_new_tokens.
        """
        patches = self.image_patches(images, image_tokens)
        ids = self.batch_ids(prompts, raw=raw, system=system, enable_thinking=enable_thinking, images=patches)
        settings = (settings or self.settings).override(**overrides)
        T = max(len(x) for x in ids)
        capacity = self.check_context(T, settings)
        dev = self.model.device
        pad = settings.pad_token_id
        # Left padding: every row's canvas starts at the same position; padding keys are masked.
        batch = torch.tensor([[pad] * (T - len(x)) + x for x in ids], dtype=torch.long, device=dev)
        valid = None
        if any(len(x) != T for x in ids):
            valid = torch.tensor([[False] * (T - len(x)) + [True] * len(x) for x in ids], device=dev)
        if seed is not None:
            torch.manual_seed(seed)
        constraints = None
        if structure is not None:
            auto = self.automaton(structure)
            constraints = [auto.row(settings.max_new_tokens, settings.eos_token_ids, pad) for _ in ids]
        denoiser = make_denoiser(self.model, len(ids), capacity)
        if patches:
            denoiser.image_features = self.image_features(patches)
        yield from _in_inference_mode(generate_events(denoiser, batch, settings, valid, constraints=constraints),
                                      denoiser)

    def automaton(self, structure: Structure, cancelled=None, max_tokens: int | None = None):
        """`structure` compiled over this model's vocabulary (constrain.TokenAutomaton or LarkGrammar), in a
        compile worker within its budget (structured/worker.py; cached by the structure's text). cancelled: a
        callable the wait polls (True: stop, structured.worker.Cancelled). max_tokens: the answer's, which the
        structure's shortest answer must fit (refused before compiling when it cannot)."""
        if self.tokenizer is None:
            raise ModelError(f"{self.path}: no tokenizer.json, so an answer's structure cannot be compiled")
        compiler = self._structure_compiler()
        if max_tokens is None:
            return compiler.compile(structure, cancelled)
        return compiler.compile(structure, cancelled, max_tokens=max_tokens)

    def _structure_compiler(self):
        with self._compiler_lock:
            if self._compiler_stopped:
                from .structured.worker import Stopped

                raise Stopped("the structure's compile was stopped: shutting down")
            if self._compiler is None:
                from .structured.worker import StructureCompiler

                self._compiler = StructureCompiler(self.tokenizer, self.config.text.vocab_size, *self.compile_budget,
                                                   workers=self.compile_workers)
            return self._compiler

    def start_compiler(self) -> None:
        """Start the structure compile's first worker now, in the background (StructureCompiler.start): a server's
        first structured request then finds the vocabulary read and walked. Nothing without a tokenizer, or for a
        vocabulary under EARLY_COMPILER_TOKENS, whose reading costs a first structure nothing worth a process."""
        from .structured.worker import EARLY_COMPILER_TOKENS

        if self.tokenizer is not None and not self._compiler_stopped and \
                self.config.text.vocab_size >= EARLY_COMPILER_TOKENS:
            self._structure_compiler().start()

    def set_compile_budget(self, seconds: float | None = None, memory: int | None = None,
                           workers: int | None = None) -> None:
        """The structure compile's time (seconds), each compile worker's memory (bytes) budget, and how many
        workers (set before the first compile); None: the default (structured.worker.DEFAULT_SECONDS,
        DEFAULT_MEMORY, DEFAULT_WORKERS)."""
        self.compile_budget = (DEFAULT_SECONDS if seconds is None else seconds,
                               DEFAULT_MEMORY if memory is None else memory)
        if workers is not None:
            self.compile_workers = workers
        if self._compiler is not None:
            self._compiler.seconds, self._compiler.memory = self.compile_budget

    def close_compiler(self) -> None:
        """Stop the compile worker for good (a server shutting down): a compile in progress fails at once, and so
        does every later one."""
        self._compiler_stopped = True  # no lock: a signal handler calls this, and must never wait
        compiler = self._compiler
        if compiler is not None:
            compiler.close()

    def infill_events(self, prefix: str, suffix: str, *, held_tokens: int = 8, seed: int | None = None,
                      settings: GenerationSettings | None = None, **overrides) -> Iterator[Event]:
        """Fill the hole between `prefix` and `suffix` (raw text, no chat template).

        The prefix (after `<bos>`) goes through the encoder; the suffix's first `held_tokens` tokens are held
        fixed at the end of every canvas and the middle is denoised in front of them, ending at `<pad>` or an
        end-of-sequence token (or continuing over more canvases). The Done event's token_ids are the middle.
        """
        if self.tokenizer is None:
            raise ModelError(f"{self.path}: no tokenizer.json, so text cannot be encoded")
        tok = self.tokenizer
        prefix_ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode_text(prefix)
        held = tok.encode_text(suffix)[:held_tokens]
        settings = (settings or self.settings).override(**overrides)
        if len(held) >= self.config.canvas_length:
            raise UsageError(f"--held-tokens must leave room in a canvas of {self.config.canvas_length}")
        capacity = self.check_context(len(prefix_ids), settings, held=len(held))
        dev = self.model.device
        if seed is not None:
            torch.manual_seed(seed)
        denoiser = make_denoiser(self.model, 1, capacity)
        batch = torch.tensor([prefix_ids], dtype=torch.long, device=dev)
        held_t = torch.tensor([held], dtype=torch.long, device=dev) if held else None
        yield from _in_inference_mode(generate_events(denoiser, batch, settings, None, held=held_t), denoiser)

    def infill(self, prefix: str, suffix: str, **kwargs) -> str:
        """The middle text for a hole between prefix and suffix; kwargs as for `infill_events`."""
        done = None
        for ev in self.infill_events(prefix, suffix, **kwargs):
            if isinstance(ev, Done):
                done = ev
        return self.tokenizer.decode(done.token_ids[0])

    def batch_ids(self, prompts, raw: bool = False, system: str | None = None,
                  enable_thinking: bool = False, images: Sequence = ()) -> list[list[int]]:
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not len(prompts):
            raise UsageError("no prompts")
        if images and len(prompts) > 1:
            raise UsageError("images go with a single prompt, not a batch")
        return [self.prompt_ids(p, raw=raw, system=system, enable_thinking=enable_thinking, images=images)
                for p in prompts]

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], *, raw: bool = False,
                 system: str | None = None, enable_thinking: bool = False,
                 on_event: Callable[[Event], None] | None = None, **kwargs) -> Result:
        """Run to completion and decode; `on_event` sees every event. Other kwargs as for `events`."""
        patches = self.image_patches(kwargs.pop("images", None), kwargs.pop("image_tokens", None))
        ids = self.batch_ids(prompts, raw=raw, system=system, enable_thinking=enable_thinking, images=patches)
        done = None
        for ev in self.events(ids, images=patches, **kwargs):
            if on_event is not None:
                on_event(ev)
            if isinstance(ev, Done):
                done = ev
        assert done is not None
        texts, thoughts = [], []
        for out in done.token_ids:
            thought, answer = "", ""
            if self.tokenizer is not None and (raw or kwargs.get("structure") is not None):
                answer = self.tokenizer.decode(out)  # a structured answer is its bytes: nothing stripped
            elif self.tokenizer is not None:
                thought, answer = self.tokenizer.decode_answer(out)
            thoughts.append(thought)
            texts.append(answer)
        return Result(texts, thoughts, done.token_ids, ids, done.steps_per_canvas, done.tokens_per_forward,
                      done.seconds, done.satisfied)


def _in_inference_mode(events: Iterator[Event], denoiser: ModelDenoiser | None = None) -> Iterator[Event]:
    """Run each step of a generator under inference mode, without leaving the mode on in the caller while the
    generator is paused (a `with` around `yield from` would). With `denoiser`, its CUDA-graph counts go into the
    Done event's `stats`."""
    while True:
        with torch.inference_mode():
            try:
                event = next(events)
            except StopIteration:
                return
        if denoiser is not None and isinstance(event, Done):
            event.stats.update(denoiser.stats())
        yield event


def plan_placement(path: Path, dev, gpu_memory: int | None, batch: int = 1, devices: list | None = None,
                   batch_flag: str | None = None, stored: tuple | None = None):
    """The placement plan for a load (dgemma_cli/placement/plan.py), or None: everything resident as loaded. With
    --gpu-memory, cards of that size (on the CPU too, which then runs the same streamed path); on CUDA devices
    without it, each device's free memory, planned on one device only when the weights alone would not fit there.
    devices: the cards the layers may be split over, in order (--devices; default [dev]). ModelError (one line) when
    the plan cannot hold, naming what would help: batch_flag is the flag that sets `batch` (--max-batch). stored:
    (ModelConfig, format, policy, footprint) where they are not read from a directory (a GGUF file: its footprint)."""
    from .checkpoint.footprint import weight_bytes
    from .checkpoint.weights import stored_format
    from .placement.plan import planned_context

    devices = list(devices or [dev])
    if gpu_memory is None and dev.type != "cuda":
        if len(devices) > 1:
            raise UsageError("--devices on the CPU runs the split of cards of --gpu-memory SIZE: give it")
        return None  # the CPU without --gpu-memory: everything resident, as ever
    footprint = None
    if stored is not None:
        cfg, fmt, policy, footprint = stored
    else:
        cfg = ModelConfig.from_dir(path)
        fmt, policy = stored_format(path, cfg.raw)
    sizes = [gpu_memory] * len(devices)
    if gpu_memory is None:
        sizes = [torch.cuda.mem_get_info(d)[0] for d in devices]
        weights = footprint["totals"] if footprint else weight_bytes(cfg, fmt, policy)
        if len(devices) == 1 and sum(weights.values()) <= sizes[0]:
            return None
    # what the command can change: its batch, the memory planned for, the model's format (no context: the plan's is
    # the model's own, up to 8k, whatever the command)
    remedies = [f"a smaller {batch_flag or 'batch'}"] if batch > 1 else []
    remedies.append("a larger --gpu-memory" if gpu_memory is not None else "more free memory on the card")
    if footprint is None and (fmt != "nvfp4" or policy == "experts"):
        remedies.append("a --model quantized smaller with `dgemma quantize`")
    p = plan_on(cfg, fmt, policy, devices, sizes, planned_context(cfg), batch, remedies, footprint)
    if not p.fits:
        raise ModelError(p.refusal)
    return p


def plan_on(cfg: ModelConfig, fmt: str, policy: str | None, devices: list, sizes: list[int], context: int,
            batch: int, remedies=(), footprint: dict | None = None):
    """The placement plan (placement/plan.py) of `cfg` in `fmt` on `devices`, each with the memory in `sizes`, with
    this machine's available host memory and the first device's MoE path (fused kernels read packed experts on
    CUDA). Not checked: `fits` and `refusal` say whether it holds (naming `remedies` when a card is too small)."""
    from .checkpoint.footprint import system_free
    from .placement.cards import card_for
    from .placement.plan import plan

    return plan(cfg, fmt, [card_for(d, size) for d, size in zip(devices, sizes)], context=context, batch=batch,
                policy=policy, host_free=system_free() or None, fused_experts=devices[0].type == "cuda",
                remedies=remedies, footprint=footprint)


def load(model: str | Path, device: str = "auto", dtype: str = "auto", adapters=(), adapter_slots=None,
         gpu_memory: int | None = None, batch: int = 1, devices: list[str] | str | None = None,
         batch_flag: str | None = None) -> Engine:
    """Load a checkpoint directory (Hugging Face layout), or 'demo', with its tokenizer and generation defaults.
    adapters: (directory, scale) pairs of PEFT LoRA adapters, attached unmerged (dgemma_cli/tuner/lora.py); each is
    read and checked before the model's weights are. adapter_slots: each adapter's slot when rows choose theirs (the
    server); None: all apply together. gpu_memory: the card memory to plan for, bytes (--gpu-memory; on the CPU the
    same plan runs as on a card of that size); experts that do not fit stream from host memory (dgemma_cli/placement).
    batch: the rows the plan leaves room for (batch_flag: the flag that set it, named when the plan cannot hold).
    devices: the cards the layers may be split over (--devices: "auto" or names, device.parse_devices); the first
    replaces `device`; the plan splits only when one card cannot hold the model."""
    from .tuner.lora import attach, read_adapter

    read = [(read_adapter(d), float(s)) for d, s in adapters]
    path = resolve_model(model)
    gguf = is_gguf(path)
    if not path.exists():
        raise ModelError(f"{path}: no such {'file' if gguf else 'model directory'}")
    if not path.is_dir() and not gguf:
        raise ModelError(f"{path}: not a directory (a model is a directory, or a .gguf file)")
    stored = gfile = None
    if gguf:  # refused here, in one line, before a weight is read: another architecture, a cut file, a type
        from .checkpoint.gguf_file import read_gguf

        gfile, gcfg = read_gguf(path)
        stored = (gcfg, "gguf", None, gfile.footprint(gcfg.text.num_hidden_layers))  # its tensors' own bytes
    if isinstance(devices, str):
        devices = parse_devices(devices)
    devs = resolve_devices(devices) if devices is not None else None
    if devs and device != "auto" and resolve_device(device) != devs[0]:
        raise UsageError(f"--device {device} and --devices {','.join(map(str, devs))}: give one (--devices names the "
                         "first card too)")
    dev = devs[0] if devs else resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    for d in devs or [dev]:
        check_kernels(d)
    # refused here, in one line, before anything loads
    placement = plan_placement(path, dev, gpu_memory, batch, devs, batch_flag, stored)
    streamed = placement.streamed if placement is not None else []
    layer_devices = None
    if placement is not None and len(placement.cards) > 1:
        if read:
            raise UsageError(f"adapters on a model split over {len(placement.cards)} cards are not supported yet "
                             "(a larger --gpu-memory, or one card streaming what does not fit: no --devices)")
        layer_devices = [devs[k] for k, c in enumerate(placement.cards) for _ in c.layers]
    if gguf:
        from .checkpoint.gguf_load import load_gguf_model

        net, cfg = load_gguf_model(gfile, device=dev, dtype=dt, host_layers=frozenset(streamed),
                                   layer_devices=layer_devices)
    else:
        net, cfg = load_model(path, device=dev, dtype=dt, host_layers=frozenset(streamed),
                              layer_devices=layer_devices)
    net.expert_streams = []
    if streamed:
        from .placement.streaming import ExpertStream

        for k, c in enumerate(placement.cards):  # each card streams its own layers into its own two buffers
            if c.streamed:
                stream = ExpertStream(net, c.streamed, (devs or [dev])[k])
                stream.check(net)  # overlapped copies against copies that wait; waits from now on if they differ
                net.expert_streams.append(stream)
    net.placement = placement
    attach(net, read, adapter_slots)
    from .doctor.first_use import first_use

    notes = [first_use(d, path, dt, adapters=bool(read)) for d in dict.fromkeys(devs or [dev])]
    net.kernel_note = "; ".join(n for n in notes if n) or None  # said by the command that loaded it
    if dev.type == "cpu":  # no more threads than usable cores, one for a demo-size model (see device.py)
        fit_cpu_threads(small=cfg.canvas_length * cfg.text.vocab_size < SMALL_STEP)
    beside = path.parent if gguf else path  # a GGUF's tokenizer and sampler defaults: the files beside it
    tokenizer = Tokenizer.from_dir(beside) if (beside / "tokenizer.json").is_file() else None
    net.tokenizer_note = None  # said by the command that loaded it
    if tokenizer is None and gguf:  # no tokenizer.json beside the file: its own (checkpoint/gguf_tokenizer.py)
        from .checkpoint.gguf_tokenizer import tokenizer_from_metadata

        tokenizer = tokenizer_from_metadata(gfile.metadata, path.name)
        net.tokenizer_note = (f"the tokenizer and chat template from {path.name}'s own metadata (no tokenizer.json "
                              "beside it)" if tokenizer is not None else None)
    settings = GenerationSettings.from_checkpoint(beside, cfg.text)
    if gguf:
        from .checkpoint.gguf_file import sampler_defaults

        settings = dataclasses.replace(settings, **sampler_defaults(gfile))
    return Engine(net, tokenizer, settings, path)

