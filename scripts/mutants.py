"""A small, reproducible mutation audit of the test suite: does each listed bug make its tests fail?

Each mutation below is one exact edit of one file (`old` must occur exactly once; it becomes `new`) and the tests
that must catch it. For each, the repository is copied to a temporary directory (the files
`git ls-files -co --exclude-standard` names: tracked, and untracked but not ignored; the working tree as it is, no
commit or stash involved), the edit is made in the copy (never in this checkout), and the tests run there with the
project's virtual environment:

    .venv/bin/python -m pytest -p no:xdist -x -q TESTS      (cwd and PYTHONPATH: the copy)

so that the copy's code is what every process imports, the servers the tests start (`python -m dgemma_cli serve`)
included; a probe checks that before anything else (a copy whose `__version__` is changed must print the changed
version through `python -m dgemma_cli --version` and `.venv/bin/dgemma --version`). The result is

    killed    the tests failed (the first failing test is named)
    survived  the tests passed with the bug in: the suite misses it
    error     the mutation could not be applied (its `old` text is not there exactly once, the edit does not
              compile) or pytest itself failed (no tests collected, a collection error)
    timeout   the tests ran past --timeout (reported, counted as killed: they did not pass)

Before the mutations, a baseline: the unmutated copy runs the same tests (all in one pytest run, without -x), and
each mutation's tests must pass there, so that a kill means the bug was caught, not that the setup was broken.
All the mutations apply to one snapshot taken at the start, so a run is not disturbed by edits made meanwhile.

Run (from the repository root; stdlib only, any Python 3.10+ works, the tests run with .venv's):

    .venv/bin/python scripts/mutants.py                  # every mutation, one at a time
    .venv/bin/python scripts/mutants.py --list           # what is listed
    .venv/bin/python scripts/mutants.py --only guard/host-v1-completions --only tune/   # some (a name, or a group/)
    .venv/bin/python scripts/mutants.py -j 2             # two at a time (a machine with cores to spare)

It exits 0 only when the baseline passed and every mutation was killed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = REPO / ".venv" / "bin" / "python"  # not resolved: the venv's python is a link out of the venv
PYTEST = ["-m", "pytest", "-p", "no:xdist", "-q", "-o", "junit_family=xunit1"]


@dataclass(frozen=True)
class Mutation:
    """name: group/what; tests: pytest selections, each a node id (`tests/f.py::test_x`, `...::test_x[param]`) or
    a file with options (`tests/f.py -k "a and not b"`), split as a shell splits them."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


def mutation(name: str, file: str, old: str, new: str, *tests: str) -> Mutation:
    return Mutation(name, file, old, new, tests)


GUARD, GUARD_T = "dgemma_cli/server/guard.py", "tests/test_guard.py"
FAULTS_T = "tests/test_serve_faults.py"
OLLAMA, OLLAMA_T = "dgemma_cli/server/ollama_api.py", "tests/test_ollama.py"
CACHE_T = "tests/test_prefix_cache.py"
ANSWER_T = "tests/test_answer_text.py"
TOOLS_T = "tests/test_tools.py"
TUNE, TUNE_T = "dgemma_cli/tuner/tune.py", "tests/test_tune.py"
STRUCT_T = "tests/test_structured.py"
STREAMING, PLACEMENT_T = "dgemma_cli/placement/streaming.py", "tests/test_placement.py"

MUTATIONS: list[Mutation] = [
    # ------------------------------------------------------------------ who may talk to the server (guard.py)
    mutation(
        "guard/host-v1-completions", GUARD,
        "if self.hosts is not None and host is not None and host_name(host) not in self.hosts:",
        "if self.hosts is not None and host is not None and host_name(host) not in self.hosts and "
        "path != \"/v1/completions\":",
        f"{GUARD_T}::test_every_route_refuses_a_foreign_host_and_answers_its_own"),
    mutation(
        "guard/host-api-generate", GUARD,
        "if self.hosts is not None and host is not None and host_name(host) not in self.hosts:",
        "if self.hosts is not None and host is not None and host_name(host) not in self.hosts and "
        "path != \"/api/generate\":",
        f"{GUARD_T}::test_every_route_refuses_a_foreign_host_and_answers_its_own"),
    mutation(
        "guard/allow-host-ignored", "dgemma_cli/server/app.py",
        "app = build_app(server, allowed_hosts(host, allow_hosts), allow_origins)",
        "app = build_app(server, allowed_hosts(host), allow_origins)",
        f"{GUARD_T}::test_every_route_refuses_a_foreign_host_and_answers_its_own"),
    mutation(
        "guard/wildcard-refuses-every-host", GUARD,
        '    if "*" in extra or is_wildcard(bound):\n        return None\n',
        '    if "*" in extra:\n        return None\n    if is_wildcard(bound):\n        return set()\n',
        f"{GUARD_T}::test_a_server_on_every_interface_answers_its_lan_names"),
    mutation(
        "guard/origin-skipped-on-api", GUARD,
        "        if origin is not None:\n            if not self.origin_allowed(origin):",
        "        if origin is not None and not is_ollama(path):\n            if not self.origin_allowed(origin):",
        f"{GUARD_T}::test_a_web_page_cannot_post_to_ollamas_routes"),
    mutation(
        "guard/content-type-on-api", GUARD,
        'if method == "POST" and not is_ollama(path):',
        'if method == "POST":',
        f"{GUARD_T}::test_ollama_routes_take_a_body_sent_without_jsons_type"),
    # ------------------------------------------------------------------ request bodies (body.py, protocol.read_json)
    mutation(
        "body/depth-checked-4-late", "dgemma_cli/server/body.py",
        "            if depth > MAX_DEPTH:",
        "            if depth > MAX_DEPTH + 4:",
        f"{FAULTS_T}::test_nesting_is_refused_past_exactly_the_documented_depth"),
    mutation(
        "body/max-depth-raised-by-4", "dgemma_cli/server/body.py",
        "MAX_DEPTH = 64 ",
        "MAX_DEPTH = 68 ",
        f"{FAULTS_T}::test_nesting_is_refused_past_exactly_the_documented_depth"),
    mutation(
        "body/limit-not-checked-while-reading", "dgemma_cli/server/protocol.py",
        "            total += len(chunk)\n            if total > MAX_BODY:\n",
        "            total += len(chunk)\n            if False:\n",
        f"{FAULTS_T}::test_a_chunked_body_over_the_limit_is_refused_while_it_is_read"),
    mutation(
        "body/parsed-in-the-server-process", "dgemma_cli/server/body.py",
        "        return self.commas > MAX_COMMAS_HERE or self.brackets > MAX_BRACKETS_HERE\n",
        "        return False\n",
        f"{FAULTS_T}::test_a_body_of_many_objects_is_parsed_in_the_helper_not_the_server"),
    mutation(  # a flat array of millions of numbers is no container: only its value count stops it
        "body/values-not-counted", "dgemma_cli/server/body.py",
        "    if bare.count(b\",\") + 2 * containers + 1 > MAX_VALUES:\n",
        "    if False:\n",
        f"{FAULTS_T}::test_a_flood_of_flat_arrays_is_refused_unparsed_and_stalls_nobody"),
    # ------------------------------------------------------------------ Ollama's API (ollama_api.py)
    mutation(
        "ollama/system-ignored", OLLAMA,
        'if isinstance(body.get("system"), str) and body["system"]:',
        'if False and isinstance(body.get("system"), str) and body["system"]:',
        f"{OLLAMA_T}::test_system_reaches_the_template"),
    mutation(
        "ollama/think-ignored-chat", OLLAMA,
        'return {"model": name, "messages": out, "thinking": bool(body.get("think")),',
        'return {"model": name, "messages": out, "thinking": False,',
        f"{OLLAMA_T}::test_think_reaches_the_template"),
    mutation(
        "ollama/think-ignored-generate", OLLAMA,
        'return {**common, "messages": messages, "thinking": bool(body.get("think"))}, "chat"',
        'return {**common, "messages": messages, "thinking": False}, "chat"',
        f"{OLLAMA_T}::test_think_reaches_the_template"),
    mutation(
        "ollama/images-dropped", OLLAMA,
        '    return [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i}"}} for i in images]',
        "    return []",
        f"{OLLAMA_T}::test_images_reach_a_vision_model"),
    mutation(
        "ollama/negative-num-predict-passed", OLLAMA,
        '        if n > 0:\n            out["max_tokens"] = n\n',
        '        out["max_tokens"] = n\n',
        f"{OLLAMA_T}::test_negative_num_predict_runs_to_the_end"),
    mutation(
        "ollama/tool-calls-dropped", OLLAMA,
        "    if calls:  # Ollama's shape: the arguments as an object",
        "    if False:  # Ollama's shape: the arguments as an object",
        f"{OLLAMA_T}::test_thinking_and_tool_calls_come_back_in_ollamas_shape"),
    mutation(
        "ollama/body-limit-in-openai-shape", OLLAMA,
        "        except (protocol.ApiError, OllamaError) as e:\n            return _error(e.status, e.message)\n",
        "        except (protocol.ApiError, OllamaError) as e:\n            if e.status == 413:\n"
        "                return e.response()\n            return _error(e.status, e.message)\n",
        f"{FAULTS_T}::test_a_body_over_the_limit_on_ollamas_routes_is_refused_in_ollamas_shape"),
    # ------------------------------------------------------------------ the prompt cache (prefix_cache.py, batching.py)
    mutation(
        "cache/pictures-stored", "dgemma_cli/server/batching.py",
        "shareable = prefixes is not None and job.image_features is None",
        "shareable = prefixes is not None",
        f"{CACHE_T}::test_prompts_with_pictures_are_neither_stored_nor_served"),
    mutation(
        "cache/fifo-not-lru", "dgemma_cli/server/prefix_cache.py",
        "        if best is not None:\n            self.entries.move_to_end((space, best.ids))\n",
        "        if best is not None:\n            pass\n",
        f"{CACHE_T}::test_the_least_recently_used_entry_goes_first"),
    mutation(
        "cache/exact-resend-missed", "dgemma_cli/server/prefix_cache.py",
        "if sp == space and len(ids) <= len(prompt)",
        "if sp == space and len(ids) < len(prompt)",
        f"{CACHE_T}::test_an_exact_resend_reuses_the_whole_prompt"),
    # ------------------------------------------------------------------ streamed text (answer.py)
    mutation(
        "stream/half-character-sent", "dgemma_cli/answer.py",
        '            answer = answer.rstrip("\\ufffd")\n',
        "            answer = answer\n",
        f"{ANSWER_T}::test_a_character_split_across_canvases_waits_whole"),
    mutation(
        "stream/stop-prefix-sent", "dgemma_cli/answer.py",
        "            for s in self.stops:  # the longest end of the text that could begin a stop string",
        "            for s in ():  # the longest end of the text that could begin a stop string",
        f"{ANSWER_T}::test_a_possible_stop_string_waits_until_it_is_known"),
    # ------------------------------------------------------------------ tool calls (tokenizer.py, answer.py, tools.py)
    mutation(
        "tools/sent-back-calls-unprotected", "dgemma_cli/tokenizer.py",
        'else v if k == "role" else protect(v)) for k, v in m.items()}',
        'else v if k in ("role", "tool_calls") else protect(v)) for k, v in m.items()}',
        f"{TOOLS_T}::test_control_token_text_sent_back_is_text"),
    mutation(
        "tools/call-text-in-content", "dgemma_cli/answer.py",
        "            answer = answer if cut < 0 else answer[:cut]\n",
        "            answer = answer\n",
        f"{TOOLS_T}::test_a_parsed_call_leaves_no_text_in_the_content"),
    mutation(
        "tools/keys-plainly-sorted", "dgemma_cli/tools.py",
        "    return sorted(keys, key=lambda k: k.lower() if isinstance(k, str) else k)",
        "    return sorted(keys)",
        f"{TOOLS_T}::test_key_order_is_the_chat_templates_and_the_written_order_is_kept"),
    # ------------------------------------------------------------------ dgemma tune (tune.py)
    mutation(
        "tune/loss-against-noisy-canvas", TUNE,
        "F.cross_entropy(logits.reshape(-1, V).float(), canvas.to(dev).reshape(-1), reduction=\"none\")",
        "F.cross_entropy(logits.reshape(-1, V).float(), noisy.reshape(-1), reduction=\"none\")",
        f"{TUNE_T}::test_the_loss_is_scored_against_the_clean_canvas"),
    mutation(
        "tune/held-positions-noised", TUNE,
        "    noise = (torch.rand(B, C, generator=gen) < t) & ~held\n",
        "    noise = torch.rand(B, C, generator=gen) < t\n",
        f"{TUNE_T}::test_held_positions_are_never_noised"),
    mutation(
        "tune/no-cosine-decay", TUNE,
        "    return base * min(1.0, step / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))",
        "    return base * min(1.0, step / max(1, warmup))",
        f"{TUNE_T}::test_the_learning_rate_warms_up_then_decays_by_cosine_to_zero"),
    mutation(
        "tune/held-out-trained-on", TUNE,
        "    return [examples[i] for i in order[n:]], [examples[i] for i in order[:n]]",
        "    return [examples[i] for i in order], [examples[i] for i in order[:n]]",
        f"{TUNE_T}::test_held_out_examples_are_never_trained_on"),
    mutation(
        "tune/out-written-over", "dgemma_cli/cli/tune.py",
        "        there = [] if restart else others_in(out_dir)\n",
        "        there = []\n",
        f"{TUNE_T}::test_an_out_holding_another_adapter_is_refused_unless_restart"),
    mutation(
        "tune/exact-rate-hard-coded", TUNE,
        "            exact = sum(t.strip() == ex.text.strip() for t, ex in zip(res.texts, shown)) / len(shown)",
        "            exact = 1.0",
        f"{TUNE_T}::test_the_exact_answer_rate_counts_the_answers_generated"),
    # ------------------------------------------------------------------ the fused head's uniforms (sampler.py)
    mutation(
        "fused-head/uniforms-equal-global-generator", "dgemma_cli/sampler.py",
        "        buf.uniforms.uniform_()\n        return\n",
        "        buf.uniforms[:, 0].uniform_()\n        buf.uniforms[:, 1] = buf.uniforms[:, 0]\n        return\n",
        "tests/test_fused_head.py::test_the_prepared_steps_draws_follow_the_distribution[False]"),
    mutation(
        "fused-head/uniforms-equal-own-generators", "dgemma_cli/sampler.py",
        "        buf.uniforms[b * R : (b + 1) * R].uniform_(generator=g)\n",
        "        buf.uniforms[b * R : (b + 1) * R, 0].uniform_(generator=g)\n"
        "        buf.uniforms[b * R : (b + 1) * R, 1] = buf.uniforms[b * R : (b + 1) * R, 0]\n",
        "tests/test_fused_head.py::test_the_prepared_steps_draws_follow_the_distribution[True]"),
    # ------------------------------------------------------------------ held answers (constrain.py, structure.py)
    mutation(
        "constrain/search-past-max-new-tokens", "dgemma_cli/structured/constrain.py",
        "        room = _room(self.limit, self.produced, C)\n",
        "        room = _room(self.limit + 1, self.produced, C)\n",
        f"{STRUCT_T}::test_the_search_puts_nothing_past_max_new_tokens"),
    mutation(
        "constrain/repeat-over-max-accepted", "dgemma_cli/structured/structure.py",
        "    count = repeat_product(regex)\n    if count > MAX_REPEAT:\n",
        "    count = repeat_product(regex)\n    if count > MAX_REPEAT + 1:\n",
        f"{STRUCT_T}::test_repetitions_up_to_max_repeat_are_taken_and_one_more_is_refused"),
    mutation(
        "constrain/satisfied-always-false", "dgemma_cli/structured/constrain.py",
        "        return ok and (self.ended or bool(self.auto.final[self.state]))",
        "        return False",
        f"{STRUCT_T}::test_the_search_puts_nothing_past_max_new_tokens"),
    mutation(
        "compile/one-worker-for-everyone", "dgemma_cli/structured/worker.py",
        "        self._workers = [_Worker() for _ in range(max(1, workers))]\n",
        "        self._workers = [_Worker()]\n",
        "tests/test_structure_bounds.py::test_a_slow_compile_holds_one_worker_not_every_clients_structure"),
    mutation(
        "compile/too-long-compiled-anyway", "dgemma_cli/structured/worker.py",
        "        if max_tokens is not None and not fits(shortest, max_tokens, self.token_chars):\n",
        "        if False:\n",
        "tests/test_structure_bounds.py::test_what_cannot_fit_max_tokens_is_refused_before_it_compiles"),
    mutation(
        "answer/structure-read-for-tool-calls", "dgemma_cli/server/answering.py",
        "                         tools=prep.tools and not prep.structured)",
        "                         tools=prep.tools)",
        f"{TOOLS_T} -k its_word_whether_or_not_tools"),
    mutation(
        "constrain/date-time-left-to-outlines", "dgemma_cli/structured/structure.py",
        '        if node.get("format") in _RFC3339 and kind in (None, "string"):\n',
        '        if False:\n',
        f"{STRUCT_T}::test_dates_and_times_are_held_as_rfc_3339_so_pydantic_parses_every_answer"),
    mutation(
        "constrain/one-of-held-as-any-of", "dgemma_cli/structured/structure.py",
        "            if not _apart(a, branches[j]):\n",
        "            if False:\n",
        "tests/test_structure_bounds.py -k one_of_whose_branches_overlap"),
    mutation(
        "constrain/pattern-put-between-quotes", "dgemma_cli/structured/structure.py",
        '        if isinstance(node.get("pattern"), str) and kind in (None, "string"):  # held inside the JSON string\n',
        '        if False:\n',
        "tests/test_structure_bounds.py -k pattern_is_held_inside_the_json_string"),
    mutation(  # a byte-fallback token left in a call's vocabulary could spell the call token's character
        "calls/plane-16-text-kept", "dgemma_cli/structured/structure.py",
        "        if b and i < vocab_size and not (specials and _PLANE_16 in b):\n",
        "        if b and i < vocab_size:\n",
        f"{TOOLS_T} -k special_tokens_of_a_call"),
    mutation(  # the sampler's draw taken for the biggest class where it is not in it
        "search/hint-taken-outside-its-class", "dgemma_cli/structured/host_search.py",
        "            if hint is not None and h.class_of[hint[p]] == c:\n",
        "            if hint is not None:\n",
        "tests/test_host_search.py -k law_of_what_the_structure_allows"),
    mutation(  # the biggest class's log-mass always from what the others leave: lost where they hold nearly all
        "search/big-mass-cancelled", "dgemma_cli/structured/host_search.py",
        "            close = np.flatnonzero(outside > -1e-4)",
        "            close = np.flatnonzero(outside > 1e9)",
        "tests/test_host_search.py -k each_class_value"),
    mutation(  # the biggest class's best left unread where a set holding it lacks the position's best token
        "search/big-best-not-read", "dgemma_cli/structured/host_search.py",
        "        need = np.flatnonzero(~inside & h.unsure[hint_cls])\n",
        "        need = np.flatnonzero(~inside & ~h.unsure[hint_cls])\n",
        "tests/test_host_search.py -k each_class_value"),
    mutation(  # the draw's second level without the chunks before it taken off
        "search/chunk-offset-dropped", "dgemma_cli/structured/host_search.py",
        "    k = torch.searchsorted(inner, (want - before)[:, None], right=True)",
        "    k = torch.searchsorted(inner, want[:, None], right=True)",
        "tests/test_host_search.py -k two_level"),
    mutation(  # groups of the same tokens searched once: each group must read its own set's best
        "search/small-sets-mixed-up", "dgemma_cli/structured/constrain.py",
        "                set_of[g] = sets[key]\n",
        "                set_of[g] = sets[key] // 2\n",
        f"{STRUCT_T} -k the_search_finds_the_most_probable_valid_canvas"),
    mutation(  # a required call walked as the grammar again (strings bounded to fit max_tokens)
        "calls/walked-not-searched", "dgemma_cli/server/constraints.py",
        "        if states * BODY_STATES <= MAX_STATES and len(source) <= MAX_SOURCE and \\\n",
        "        if False and \\\n",
        f"{TOOLS_T} -k one_expression_and_takes"),
    mutation(  # a bounded string's characters not counted: a token moves k by one whatever it adds
        "classes/bound-not-counted", "dgemma_cli/structured/classes.py",
        "                reach = k + bt.class_chars\n",
        "                reach = k + np.minimum(bt.class_chars, 1)\n",
        "tests/test_token_classes.py"),
    mutation(  # a body left at a character's middle (an escape begun, a UTF-8 lead byte) as at its end
        "classes/left-mid-character", "dgemma_cli/structured/classes.py",
        "            kind[s] = np.where(state[s] == 0, 2, 0)\n",
        "            kind[s] = 2\n",
        "tests/test_token_classes.py"),
    mutation(  # a held row's search run between every row's steps again: the free rows wait for it
        "serve/held-search-inline", "dgemma_cli/server/batching.py",
        "        aside = len(self.rows) > 1  # others to hold up: a held row's search goes to a helper thread\n",
        "        aside = False\n",
        "tests/test_held_rows.py"),
    mutation(  # a searching row's softmax left behind when the rows before it leave
        "serve/searching-row-softmax-dropped", "dgemma_cli/server/batching.py",
        "            if a != j and (moved.sc or moved.searching is not None):  # a > j: it moves forward, over a freed slot\n",
        "            if a != j and moved.sc:\n",
        "tests/test_held_rows.py"),
    mutation(  # the device search's dynamic programme forgets a target's run begun in the previous chunk of lanes
        "device/run-carry-dropped", "quant/kernels/automaton_dp.py",
        "            k = tl.where(d == c_seg, tl.maximum(k, c_key), k)\n",
        "",
        "tests/test_device_search.py::test_the_programme_is_its_torch_path"),
    mutation(  # the same for a set's run of classes
        "device/set-carry-dropped", "quant/kernels/automaton_dp.py",
        "            k = tl.where(seg == c_seg, tl.maximum(k, c_key), k)\n",
        "",
        "tests/test_device_search.py::test_the_programme_is_its_torch_path"),
    mutation(  # the class pass's drawn keys without their noise: the drawn path would be the argmax path
        "device/noise-dropped", "quant/kernels/class_pass.py",
        "        g = -tl.log(-tl.log(tl.maximum(u, 1e-20)))\n",
        "        g = 0.0 * u\n",
        "tests/test_device_search.py::test_the_class_pass_is_its_torch_path"),
    mutation(  # the head's held keys left for the next step: its atomic max meets the last step's keys
        "device/head-keys-not-reset", "quant/kernels/automaton_dp.py",
        "    if RESET:  # the keys back to KEY_MIN",
        "    if RESET and False:  # the keys back to KEY_MIN",
        "tests/test_device_search.py -m slow -k heads_class_keys"),
    mutation(  # the head's noise in natural units beside base-2 scores: the draws from a sharper distribution
        "device/head-noise-in-nats", "quant/kernels/head.py",
        "        g = -tl.log(-tl.log(tl.maximum(r, 1e-20))) * LOG2E\n",
        "        g = -tl.log(-tl.log(tl.maximum(r, 1e-20)))\n",
        "tests/test_fused_head.py -k class_pass_of_held_rows"),
    mutation(  # a path past the length limit taken as one within it
        "device/cut-short-taken-as-ok", "quant/kernels/automaton_dp.py",
        "    ok = unpack_value(best_ok) > NEG\n",
        "    ok = unpack_value(best_any) > NEG\n",
        "tests/test_device_search.py -m slow -k cut_short"),
    # ------------------------------------------------------------------ dgemma doctor (dgemma_cli/doctor, verdicts)
    mutation(  # a kernel wrong on this "card" (the interpreter): the doctor must catch it and turn it off
        "doctor/norm-kernel-off-by-one-column", "quant/kernels/rmsnorm.py",
        "        a = _round(a + a2, dt, EMULATE)\n    rstd = 1.0 / tl.sqrt(tl.sum(a * a, axis=1) / D + eps)\n",
        "        a = _round(a + a2, dt, EMULATE)\n    rstd = 1.0 / tl.sqrt(tl.sum(a * a, axis=1) / (D + 1) + eps)\n",
        "tests/test_doctor.py::test_the_doctor_reports_every_family_and_says_what_it_did_not_run"),
    mutation(
        "doctor/kept-verdict-ignored", "quant/kernels/probe.py",
        "    kept = kept_verdicts(device).get(verdict_name(family, dtype))\n",
        "    kept = None\n",
        "tests/test_doctor.py::test_a_wrong_kernel_is_caught_turned_off_kept_and_the_run_after_gives_the_torch_tokens"),
    mutation(
        "doctor/verdict-at-sizes-not-kept", "dgemma_cli/doctor/sizes.py",
        "    if decided:\n        probe.keep(device, decided)\n",
        "    if False:\n        probe.keep(device, decided)\n",
        "tests/test_doctor.py::test_a_kernel_wrong_only_at_a_models_sizes_is_caught_there_and_turned_off"),
    mutation(
        "doctor/bound-without-the-tensor-peak", "dgemma_cli/doctor/sizes.py",
        "        bound = max(dram, tensor)\n",
        "        bound = dram\n",
        "tests/test_doctor.py::test_each_kernel_call_at_a_models_sizes_is_timed_against_its_bound"),
    # ------------------------------------------------------------------ GGUF files
    mutation(
        "gguf/q-and-k-norms-swapped", "dgemma_cli/checkpoint/gguf_names.py",
        '    "self_attn.q_norm.weight": "attn_q_norm.weight",\n    "self_attn.k_norm.weight": "attn_k_norm.weight",\n',
        '    "self_attn.q_norm.weight": "attn_k_norm.weight",\n    "self_attn.k_norm.weight": "attn_q_norm.weight",\n',
        "tests/test_gguf_model.py::test_a_gguf_gives_the_references_tokens_on_its_twin"),
    mutation(
        "gguf/k-quant-sub-blocks-read-in-the-wrong-half", "quant/kernels/ggml_decode.py",
        "        q = (_u8(b + qs + (sb // 2) * 32 + pos) >> (4 * (sb % 2))) & 15\n",
        "        q = (_u8(b + qs + (sb % 2) * 32 + pos) >> (4 * (sb // 2 % 2))) & 15\n",
        "tests/test_gguf.py::test_the_one_pass_decode_kernel_equals_the_torch_decode"),
    mutation(
        "gguf/q4k-tile-order-word-and-byte-transposed", "quant/kernels/ggml_tile.py",
        "    return 64 * c + 32 * half + 4 * w + byte\n",
        "    return 64 * c + 32 * half + w + 8 * byte\n",
        "tests/test_gguf.py::test_the_matmul_tile_reads_each_block_type_exactly_in_its_own_order",
        "tests/test_gguf.py::test_gguf_linears_multiply_by_their_blocks_where_triton_runs"),
    mutation(
        "gguf/q6k-tile-scale-of-the-wrong-sub-block", "quant/kernels/ggml_tile.py",
        "        sc = tl.load(b6 + 192 + 8 * h + 2 * quarter + w // 4)",
        "        sc = tl.load(b6 + 192 + 8 * h + 2 * quarter + w // 8)",
        "tests/test_gguf.py::test_the_matmul_tile_reads_each_block_type_exactly_in_its_own_order",
        "tests/test_gguf.py::test_gguf_experts_read_their_blocks_in_the_kernels_where_triton_runs"),
    mutation(
        "gguf/iq4-grid-words-in-the-wrong-order", "quant/kernels/ggml_tile.py",
        "tl.where(q < 4, -1079142271, -152379953)",
        "tl.where(q < 4, -152379953, -1079142271)",
        "tests/test_gguf.py::test_the_matmul_tile_reads_each_block_type_exactly_in_its_own_order"),
    mutation(
        "gguf/stream-buffer-sized-by-one-layer", STREAMING,
        "                sizes[name] = max(sizes.get(name, 0), src.numel())\n",
        "                sizes[name] = sizes.get(name, src.numel())\n",
        "tests/test_gguf_model.py::test_streamed_gguf_experts_give_the_resident_runs_tokens"),
    # ------------------------------------------------------------------ placement: streamed experts, split layers
    mutation(
        "placement/experts-run-before-their-copy-lands", STREAMING,
        "        if self.holds[b] != layer:  # not copied ahead (the first pass, or a pass that ran out of order)\n"
        "            self._copy_ahead(layer)\n        self._wait(b)\n",
        "        if self.holds[b] != layer:  # not copied ahead (the first pass, or a pass that ran out of order)\n"
        "            self._copy_ahead(layer)\n",
        f"{PLACEMENT_T}::test_copies_ahead_of_their_layer_give_the_resident_runs_tokens[late]"),
    mutation(
        "placement/pass-ends-with-copies-in-flight", STREAMING,
        "        if self.overlapping():\n            self.start_pass()\n        for b in (0, 1):\n"
        "            self._wait(b)\n",
        "        if self.overlapping():\n            self.start_pass()\n",
        f"{PLACEMENT_T}::test_copies_ahead_of_their_layer_give_the_resident_runs_tokens[early]"),
    mutation(
        "placement/copies-aimed-at-the-other-buffer", "dgemma_cli/placement/plan.py",
        "    after = {i: next(j for j in layers[k + 1 :] + layers[: k + 1] if buffer_of[j] == buffer_of[i])",
        "    after = {i: next(j for j in layers[k + 1 :] + layers[: k + 1] if buffer_of[j] != buffer_of[i])",
        f"{PLACEMENT_T}::test_copies_ahead_of_their_layer_give_the_resident_runs_tokens[early]"),
    mutation(
        "placement/streamed-copies-at-the-buffers-start", STREAMING,
        '        return src.data_ptr() % ALIGN if self.device.type == "cpu" else 0\n',
        "        return 0\n",
        f"{PLACEMENT_T}::test_streamed_layers_compute_on_weights_aligned_as_the_resident_ones",
        f"{PLACEMENT_T}::test_tuning_the_default_targets_with_every_layer_streamed_makes_the_resident_runs_adapter"),
    mutation(
        "placement/host-copies-at-offsets-of-their-own", "dgemma_cli/checkpoint/weights.py",
        "            t = empty_at(meta.shape, want, files.offset(parts[0][0]) if viewed else 0, pin_memory=pin)\n",
        "            t = torch.empty(meta.shape, dtype=want, pin_memory=pin)\n",
        f"{PLACEMENT_T}::test_streamed_layers_compute_on_weights_aligned_as_the_resident_ones",
        f"{PLACEMENT_T}::test_tuning_the_default_targets_with_every_layer_streamed_makes_the_resident_runs_adapter"),
    mutation(
        "placement/hidden-state-left-on-the-first-card", "dgemma_cli/model.py",
        "            if split is not None:  # onto the layer's device\n                x = split.enter(i, x)\n"
        "                cos, sin, scalar",
        "            if split is not None:  # onto the layer's device\n                split.enter(i, x)\n"
        "                cos, sin, scalar",
        f"{PLACEMENT_T}::test_a_split_pass_moves_everything_a_layer_reads_onto_its_card"),
    # ------------------------------------------------------------------ the step: fused launches, no wait
    mutation(
        "step/late-stop-leaves-the-generator-moved", "dgemma_cli/sampler.py",
        "                set_rng_state(dev, before)\n",
        "                pass\n",
        "tests/test_exactness.py::test_stop_test_read_a_step_late_changes_nothing"),
    mutation(
        "step/gated-w4a4-without-gelu", "quant/kernels/nvfp4_w4a4.py",
        "        out = to_compute(gelu_tanh(gate), dtype, EMULATE).to(tl.float32) * up\n",
        "        out = gate * up\n",
        "tests/test_shared_quantization.py::test_w4a4_gated_mlp_in_one_launch"),
    mutation(
        "step/shared-scale-is-the-first", "quant/modules.py",
        '        kept["_shared_scale"] = torch.stack([s.float().reshape(()) for s in scales]).amax()\n',
        '        kept["_shared_scale"] = scales[0].float().reshape(())\n',
        "tests/test_shared_quantization.py::test_w4a4_calibrated_scales_are_shared_as_their_largest"),
    mutation(
        "step/norm-quantizes-with-another-global-scale", "quant/kernels/rmsnorm.py",
        "            g = tl.maximum(tl.max(tl.abs(n), axis=1) / 2688.0, 1.1754943508222875e-38)\n",
        "            g = tl.maximum(tl.max(tl.abs(n), axis=1) / 2687.0, 1.1754943508222875e-38)\n",
        "tests/test_shared_quantization.py::test_a_norm_quantizes_its_output_as_the_linears_would"),
    mutation(
        "step/pre-feed-forward-norms-of-the-input", "quant/kernels/rmsnorm.py",
        "        n0 = n * (1.0 / tl.sqrt(tl.sum(n * n, axis=1) / D + eps))[:, None]\n",
        "        n0 = a * (1.0 / tl.sqrt(tl.sum(a * a, axis=1) / D + eps))[:, None]\n",
        "tests/test_norm_kernel.py::test_residual_update_then_its_two_norms_in_one_kernel"),
    mutation(
        "step/v-norm-weighted-like-k", "quant/kernels/rmsnorm.py",
        "            w_mask = tl.where(third, cols < 0, w_mask)\n",
        "            w_mask = w_mask\n",
        "tests/test_norm_kernel.py::test_q_and_k_norms_in_one_launch"),
    mutation(
        "step/soft-tile-factor-dropped", "quant/kernels/head.py",
        "            acc += part * f[:, None]\n",
        "            acc += part\n",
        "tests/test_fused_head.py::test_fused_head_with_the_factor_after_the_product_equals_its_reference"),
    mutation(
        "step/split-router-counter-not-reset", "quant/kernels/router.py",
        "            tl.store(count_ptr + pid_t, 0)\n",
        "            pass\n",
        "tests/test_routing_kernels.py::test_router_split_over_programs_routes_the_same"),
    mutation(
        "step/split-router-parts-overlap", "quant/kernels/router.py",
        "    for k0 in range(part * KS, k_hi, BLOCK_K):\n",
        "    for k0 in range(0, k_hi, BLOCK_K):\n",
        "tests/test_routing_kernels.py::test_router_split_over_programs_routes_the_same"),
    mutation(
        "step/late-row-stop-leaves-the-generator-moved", "dgemma_cli/server/batching.py",
        "                self.gen.set_state(self.before_step)\n",
        "                pass\n",
        "tests/test_serve.py::test_stop_tests_read_a_step_late_answer_as_at_once"),
    mutation(
        "step/temperature-copied-from-the-host", "dgemma_cli/sampler.py",
        "    return _temperature_left(torch.full((), n, dtype=torch.int32, device=device), settings)\n",
        "    return _temperature_left(torch.tensor(n, dtype=torch.int32, device=device), settings)\n",
        "tests/test_model_units.py::test_a_steps_inputs_are_made_on_the_device_without_a_host_copy"),
]


# ---------------------------------------------------------------------------------------------- copies of the tree


def snapshot(dest: Path) -> None:
    """The working tree's files (tracked, and untracked but not ignored) copied to dest."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if not (src.is_file() or src.is_symlink()):  # deleted in the working tree, or a submodule
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name, follow_symlinks=False)


def clone(snap: Path, dest: Path) -> Path:
    shutil.copytree(snap, dest, symlinks=True)
    return dest


def apply(copy: Path, m: Mutation) -> str | None:
    """Make the edit in the copy; None, or why it cannot be made."""
    path = copy / m.file
    if not path.is_file():
        return f"{m.file}: no such file"
    text = path.read_text(encoding="utf-8")
    n = text.count(m.old)
    if n != 1:
        return f"{m.file}: the old text occurs {n} times (must be once)"
    text = text.replace(m.old, m.new)
    if path.suffix == ".py":
        try:
            compile(text, str(path), "exec")
        except SyntaxError as e:
            return f"{m.file}: the edit does not compile: {e.msg} (line {e.lineno})"
    path.write_text(text, encoding="utf-8")
    return None


def environment(copy: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PYTEST_ADDOPTS", None)
    return env


# ---------------------------------------------------------------------------------------------- running pytest


@dataclass
class Run:
    rc: int | None  # None: timed out
    seconds: float
    cases: dict[str, str] = field(default_factory=dict)  # node id -> passed / failed / error / skipped
    log: Path | None = None

    def failed(self) -> list[str]:
        return [k for k, v in self.cases.items() if v in ("failed", "error")]

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace") if self.log and self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def run(cmd: list[str], cwd: Path, env: dict, timeout: float, log: Path) -> tuple[int | None, float]:
    """Run cmd in its own process group (the servers tests start are in it too); on timeout the group is ended."""
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout), time.monotonic() - t0
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return None, time.monotonic() - t0


def pytest(copy: Path, args: list[str], *, exitfirst: bool, timeout: float, work: Path, tag: str) -> Run:
    xml = work / f"{tag}.xml"
    cmd = [str(PYTHON), *PYTEST, *(["-x"] if exitfirst else []), f"--basetemp={work / (tag + '-tmp')}",
           f"--junitxml={xml}", *args]
    rc, seconds = run(cmd, copy, environment(copy), timeout, work / f"{tag}.log")
    return Run(rc, seconds, read_junit(xml), work / f"{tag}.log")


def read_junit(xml: Path) -> dict[str, str]:
    """pytest's JUnit XML (xunit1: with each test's file) -> {node id: outcome}; a test that failed in any phase
    (its teardown too) counts as failed."""
    if not xml.exists():
        return {}
    rank = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}
    cases: dict[str, str] = {}
    for case in ET.parse(xml).iter("testcase"):
        file, classname, name = case.get("file") or "", case.get("classname") or "", case.get("name") or ""
        module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
        cls = classname[len(module) + 1 :] if module and classname.startswith(module + ".") else ""
        node = f"{file}::{cls.replace('.', '::') + '::' if cls else ''}{name}" if file else f"{classname}::{name}"
        outcome = next((kind for kind in ("failure", "error", "skipped") if case.find(kind) is not None), "passed")
        outcome = {"failure": "failed"}.get(outcome, outcome)
        if rank[outcome] >= rank[cases.get(node, "passed")]:
            cases[node] = outcome
    return cases


def selects(selection: str, node: str) -> bool:
    """Whether a plain selection (a node id or a file) takes this node id."""
    return node == selection or node.startswith((selection + "[", selection + "::"))


# ---------------------------------------------------------------------------------------------- the audit


@dataclass
class Result:
    mutation: Mutation
    status: str  # killed / survived / error / timeout
    detail: str = ""
    seconds: float = 0.0
    baseline: str = ""  # passed / failed ... for the same tests on the unmutated copy


def probe(snap: Path, work: Path) -> str | None:
    """Check that a copy's code is what runs: a copy whose version is changed prints it, through `python -m` and
    the console script, from outside the copy too. None, or what went wrong."""
    copy = clone(snap, work / "probe")
    marker = "0.0.0+mutants-probe"
    problem = apply(copy, Mutation("probe", "dgemma_cli/__init__.py", '__version__ = "0.1.0"',
                                   f'__version__ = "{marker}"', ()))
    if problem:
        return problem
    script = PYTHON.parent / "dgemma"
    commands = [[str(PYTHON), "-m", "dgemma_cli", "--version"]] + ([[str(script), "--version"]] if script.exists()
                                                                   else [])
    for cwd in (copy, work):
        for cmd in commands:
            out = subprocess.run(cmd, cwd=cwd, env=environment(copy), capture_output=True, text=True, timeout=120,
                                 check=False)
            if out.stdout.strip() != f"dgemma {marker}":
                return f"`{' '.join(cmd)}` in {cwd} printed {out.stdout.strip()!r} {out.stderr.strip()[-300:]!r}"
    shutil.rmtree(copy, ignore_errors=True)
    return None


def baseline(snap: Path, mutations: list[Mutation], timeout: float, work: Path) -> dict[str, str]:
    """Each selection's outcome on the unmutated copy: plain node ids in one pytest run, selections with options
    each in their own. passed: every test it takes passed (and at least one ran)."""
    copy = clone(snap, work / "baseline")
    selections = list(dict.fromkeys(s for m in mutations for s in m.tests))
    plain = [s for s in selections if len(shlex.split(s)) == 1]
    outcome: dict[str, str] = {}
    if plain:
        r = pytest(copy, plain, exitfirst=False, timeout=timeout * len(plain), work=work, tag="baseline")
        for s in plain:
            got = [v for k, v in r.cases.items() if selects(s, k)]
            outcome[s] = ("timeout" if r.rc is None else "not collected") if not got else \
                "failed" if any(v in ("failed", "error") for v in got) else \
                "skipped" if all(v == "skipped" for v in got) else "passed"
        if r.rc not in (0, 1):
            print(f"baseline pytest exited {r.rc}; its log's end:\n{r.tail()}", file=sys.stderr)
    for i, s in enumerate(x for x in selections if x not in plain):
        r = pytest(copy, shlex.split(s), exitfirst=False, timeout=timeout, work=work, tag=f"baseline-{i}")
        outcome[s] = "timeout" if r.rc is None else "failed" if r.failed() or r.rc != 0 else \
            "skipped" if all(v == "skipped" for v in r.cases.values()) else "passed"
    shutil.rmtree(copy, ignore_errors=True)
    return outcome


def audit(snap: Path, m: Mutation, timeout: float, work: Path, keep: bool) -> Result:
    tag = m.name.replace("/", "__")
    copy = clone(snap, work / tag)
    try:
        problem = apply(copy, m)
        if problem:
            return Result(m, "error", problem)
        r = pytest(copy, [a for s in m.tests for a in shlex.split(s)], exitfirst=True, timeout=timeout, work=work,
                   tag=tag)
        if r.rc is None:
            return Result(m, "timeout", f"over {timeout:.0f} s", r.seconds)
        if r.rc == 1 and r.failed():
            return Result(m, "killed", r.failed()[0], r.seconds)
        if r.rc == 0:
            skipped = r.cases and all(v == "skipped" for v in r.cases.values())
            return Result(m, "survived", "every test skipped" if skipped else "the tests passed", r.seconds)
        return Result(m, "error", f"pytest exited {r.rc}:\n{r.tail()}", r.seconds)
    finally:
        if not keep:
            shutil.rmtree(copy, ignore_errors=True)


def chosen(only: list[str] | None) -> list[Mutation]:
    if not only:
        return MUTATIONS
    picked = [m for m in MUTATIONS if any(m.name == o or (o.endswith("/") and m.name.startswith(o)) for o in only)]
    unknown = [o for o in only if not any(m.name == o or (o.endswith("/") and m.name.startswith(o))
                                          for m in MUTATIONS)]
    if unknown:
        raise SystemExit(f"no mutation named {', '.join(unknown)} (--list names them)")
    return picked


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run this mutation (repeatable; a group ending in '/' takes all of it)")
    ap.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    ap.add_argument("-j", type=int, default=1, metavar="N", help="mutations run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=1200, metavar="S", help="seconds per pytest run (default 1200)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the baseline (a kill is then not checked)")
    ap.add_argument("--keep", action="store_true", help="keep the copies and logs (the path is printed)")
    args = ap.parse_args(argv)
    mutations = chosen(args.only)
    if args.list:
        for m in mutations:
            print(f"{m.name}\n    {m.file}\n    " + "\n    ".join(m.tests))
        return 0
    if not PYTHON.exists():
        raise SystemExit(f"{PYTHON}: no such interpreter (make the virtual environment first)")
    work = Path(tempfile.mkdtemp(prefix="dgemma-mutants-"))
    t0 = time.monotonic()
    try:
        snap = work / "snapshot"
        snapshot(snap)
        problem = probe(snap, work)
        if problem:
            print(f"the copy's code is not what runs: {problem}", file=sys.stderr)
            return 2
        print(f"copy checked: a copy's own code runs (python -m dgemma_cli, the dgemma script); {len(mutations)} "
              f"mutations", flush=True)
        base: dict[str, str] = {}
        if not args.no_baseline:
            base = baseline(snap, mutations, args.timeout, work)
            bad = {s: v for s, v in base.items() if v != "passed"}
            print(f"baseline (unmutated copy): {len(base) - len(bad)}/{len(base)} test selections passed"
                  + "".join(f"\n    {v}: {s}" for s, v in bad.items()), flush=True)

        def one(m: Mutation) -> Result:
            r = audit(snap, m, args.timeout, work, args.keep)
            r.baseline = "/".join(sorted({base.get(s, "not run") for s in m.tests}))
            print(f"{r.status:8}  {m.name}  ({r.seconds:.0f} s)  {r.detail.splitlines()[0] if r.detail else ''}",
                  flush=True)
            if r.status == "error" and "\n" in r.detail:
                print(r.detail, flush=True)
            return r

        with ThreadPoolExecutor(max(1, args.j)) as pool:
            results = list(pool.map(one, mutations))
    finally:
        if args.keep:
            print(f"copies and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = [["mutation", "killing test", "result", "baseline", "seconds"]]
    for r in results:
        test = r.detail if r.status == "killed" else " ".join(r.mutation.tests)
        rows.append([r.mutation.name, test, r.status, r.baseline or "-", f"{r.seconds:.0f}"])
    print("\n" + table(rows))
    counts = {s: sum(r.status == s for r in results) for s in ("killed", "survived", "timeout", "error")}
    print(f"\n{counts['killed']} killed, {counts['survived']} survived, {counts['timeout']} timed out, "
          f"{counts['error']} errors, of {len(results)}; {time.monotonic() - t0:.0f} s")
    base_ok = args.no_baseline or all(v == "passed" for v in base.values())
    return 0 if base_ok and counts["survived"] == counts["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
