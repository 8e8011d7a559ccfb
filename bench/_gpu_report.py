"""The tables of `bench/gpu.py`'s results (results.md and the end of its log): one function a table, each a list of
lines over every model of the results."""

from __future__ import annotations

from typing import Callable, Iterator


def busiest(profile, n: int = 5) -> str:
    """The kernels of a `bench.gpu.device_profile` that take the most time."""
    if not isinstance(profile, dict) or not profile.get("top"):
        return "—"
    return "; ".join(f"{t['name'][:48]} {t['us_per_call']:.0f} ({t['per_call']:g})" for t in profile["top"][:n])


def cell(entry, key: str, fmt: str = "{:.2f}") -> str:
    if not isinstance(entry, dict):
        return "—"
    if "skipped" in entry:
        return "skipped"
    if "error" in entry:
        return "error"
    return fmt.format(entry[key]) if key in entry else "—"


def field(entry, key: str) -> str:
    return str(entry.get(key, "—")) if isinstance(entry, dict) else "—"


def header(*columns: str) -> list[str]:
    return ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def table(results: dict) -> str:
    env, models = results.get("env", {}), results.get("models", {})
    lines = [f"{env.get('date', '')}, {env.get('card', '')}, torch {env.get('torch', '')}, transformers "
             f"{env.get('transformers', '')}, {env.get('dtype', '')}, greedy, random weights, inductor "
             f"{env.get('inductor', 'defaults')}"]
    for section in SECTIONS:
        lines += section(models)
    return "\n".join(lines) + "\n"


def _paths(models: dict) -> list[str]:
    lines = header("model", "transformers eager ms/token", "transformers static ms/token (compile s)",
                   "our eager loop ms/token", "graph step ms/token (compile s)",
                   "graph step's first greedy tokens = eager generate's", "bound ms/token", "graph / bound",
                   "graph / tf static", "TTFT ms: tf eager / tf static / graph")[1:]
    ratio = lambda a, b: f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "—"  # noqa: E731
    for name, m in models.items():
        g, s, e = m.get("graph step", {}), m.get("transformers static generate", {}), m.get(
            "transformers eager generate")
        bound = m.get("bound_ms_per_token")
        gms, sms = (x.get("ms_per_token") if isinstance(x, dict) else None for x in (g, s))
        lines.append(
            f"| {name} ({m.get('weights_gb', 0):.2f} GB) | {cell(e, 'ms_per_token')} | "
            f"{cell(s, 'ms_per_token')} ({cell(s, 'compile_and_first_calls_s', '{:.0f}')}) | "
            f"{cell(m.get('our eager loop'), 'ms_per_token')} | {cell(g, 'ms_per_token')} "
            f"({cell(g, 'compile_s', '{:.0f}')}) | {field(g, 'agrees_with_eager')} | "
            f"{f'{bound:.3f}' if bound else '—'} | "
            f"{ratio(bound, gms)} | {ratio(gms, sms)} | {cell(e, 'ttft_ms', '{:.1f}')} / "
            f"{cell(s, 'ttft_ms', '{:.1f}')} / {cell(g, 'ttft_ms', '{:.1f}')} |")
    return lines


def _chat(models: dict) -> list[str]:
    lines = header("model", "graph step ms/token", "the chat's answer on it ms/token (events, detokenizer, criteria)",
                   "same tokens", "sampled with every page processor ms/token (/ the step, in the graph)")
    for name, m in models.items():
        c, p = m.get("chat on the graph step", {}), m.get("graph step, every page processor", {})
        lines.append(f"| {name} | {cell(m.get('graph step'), 'ms_per_token')} | {cell(c, 'ms_per_token')} | "
                     f"{field(c, 'same_tokens_as_the_step')} | {cell(p, 'ms_per_token')} ({cell(p, 'vs_the_step')}, "
                     f"{field(p, 'in_graph')}) |")
    return lines


def _variant(measure: str, label: str, key: str) -> Callable[[dict], list[str]]:
    """The table of a variant of the step (frozen, fused) beside the plain one."""
    def lines_of(models: dict) -> list[str]:
        if not any(measure in m for m in models.values()):
            return []
        lines = header("model", "graph step ms/token (memory GB)",
                       f"{label} (`model.{key}`) ms/token (memory GB, compile s)", f"{label} / plain",
                       f"{label}'s first greedy tokens = eager generate's", "same tokens as the plain step")
        for name, m in models.items():
            g, f = m.get("graph step", {}), m.get(measure, {})
            lines.append(f"| {name} | {cell(g, 'ms_per_token')} ({cell(g, 'memory_gb')}) | {cell(f, 'ms_per_token')} "
                         f"({cell(f, 'memory_gb')}, {cell(f, 'compile_s', '{:.0f}')}) | {cell(f, 'vs_the_step')} | "
                         f"{field(f, 'agrees_with_eager')} | {field(f, 'same_tokens_as_the_step')} |")
        return lines
    return lines_of


def _variants(models: dict) -> list[str]:
    """The step's variants (`bench.gpu.ModelBench.variant`) beside the step: their step, and their recall's span."""
    options = lambda e: ", ".join(field(e, k) for k in ("fuse", "matvec", "gqa", "autotune"))  # noqa: E731
    lines = header("model", "graph step (fuse, matvec, gqa, autotune) ms/token (memory GB, compile s)",
                   "variant (fuse, matvec, gqa, autotune)", "ms/token (memory GB, compile s)", "variant / the step",
                   "first greedy tokens = eager generate's", "same tokens as the step",
                   "16-slot span ms (its replay alone)", "a recall in its decode steps")
    for name, m in models.items():
        g = m.get("graph step", {})
        step = f"{cell(g, 'ms_per_token')} ({cell(g, 'memory_gb')}, {cell(g, 'compile_s', '{:.0f}')})"
        for key, v in m.items():
            if key.startswith("graph step, variant: "):
                lines.append(f"| {name} | ({options(g)}) {step} | {key.split(': ', 1)[1]} ({options(v)}) | "
                             f"{cell(v, 'ms_per_token')} ({cell(v, 'memory_gb')}, {cell(v, 'compile_s', '{:.0f}')}) | "
                             f"{cell(v, 'vs_the_step')} | {field(v, 'agrees_with_eager')} | "
                             f"{field(v, 'same_tokens_as_the_step')} | {cell(v, 'span_ms', '{:.3f}')} "
                             f"({cell(v, 'span_replay_ms', '{:.3f}')}) | {cell(v, 'recall_decode_steps')} |")
    return lines


def _kernels(models: dict) -> list[str]:
    lines = header("model", "graph step ms/token", "kernels a token", "their time ms/token (of the step)",
                   "the most time, µs a token (count)")
    for name, m in models.items():
        g, k = m.get("graph step", {}), m.get("graph step, kernels", {})
        lines.append(f"| {name} | {cell(g, 'ms_per_token')} | {cell(k, 'per_call', '{:.0f}')} | "
                     f"{cell(k, 'busy_ms_per_call')} ({cell(k, 'busy_of_the_step')}) | {busiest(k)} |")
    lines += header("model", "recall at memories", "part", "kernels", "their time ms", "the most time, µs (count)")
    for name, size, r in _recalls(models):
        for part in ("head", "span"):
            if isinstance(k := r.get(f"{part}_kernels"), dict):
                lines.append(f"| {name} | {int(size):,} | {part} | {cell(k, 'per_call', '{:.0f}')} | "
                             f"{cell(k, 'busy_ms_per_call', '{:.3f}')} | {busiest(k)} |")
    return lines


def _long(models: dict) -> list[str]:
    lines = header("model", "graph step ms/token", "on a long cache: positions", "ms/token", "/ the step")
    for name, m in models.items():
        g, long = m.get("graph step", {}), m.get("graph step, long cache", {})
        lines.append(f"| {name} | {cell(g, 'ms_per_token')} | {cell(long, 'positions', '{:,}')} | "
                     f"{cell(long, 'ms_per_token')} | {cell(long, 'vs_the_step')} |")
    return lines


def _recalls(models: dict) -> Iterator[tuple[str, str, dict]]:
    for name, m in models.items():
        r = m.get("recall", {})
        if isinstance(r, dict) and not ({"skipped", "error"} & set(r)):
            yield from ((name, size, v) for size, v in r.items() if isinstance(v, dict))


def _recall(models: dict) -> list[str]:
    lines = header("model", "recall: memories", "head ms", "lookup ms", "16-slot span ms (its replay alone)",
                   "in decode steps", "in decode steps of the frozen step", "in the decoder's loop: ms (steps)")
    shown = set()
    for name, size, v in _recalls(models):
        shown.add(name)
        lines.append(f"| {name} | {int(size):,} | {v['head_ms']:.3f} | {cell(v, 'lookup_ms', '{:.3f}')} | "
                     f"{v['span_ms']:.3f} "
                     f"({cell(v, 'span_replay_ms', '{:.3f}')}) | {v['decode_steps']:.2f} | "
                     f"{cell(v, 'decode_steps_of_the_frozen_step')} | {cell(v, 'decoder_recall_ms', '{:.3f}')} "
                     f"({cell(v, 'decoder_recall_steps')}) |")
    lines += [f"| {name} | — | {cell(m.get('recall', {}), 'x')} | | | | | |" for name, m in models.items()
              if name not in shown]
    return lines


def _rows(models: dict) -> list[str]:
    lines = header("model", "path, rows", "ms/step", "aggregate tokens/s", "rows / 1 row, aggregate tokens/s")
    for name, m in models.items():
        lines += [f"| {name} | {k} | {cell(v, 'ms_per_token')} | {cell(v, 'tokens_per_s', '{:.0f}')} | "
                  f"{cell(v, 'vs_1_row', '{:.1f}x')} |" for k, v in m.items() if "rows" in k]
    return lines


def _sessions(models: dict) -> list[str]:
    lines = header("model", "chat sessions at once (the service)", "aggregate tokens/s", "/ 1 session",
                   "TTFT ms median / max", "answers on the single-row step")
    for name, m in models.items():
        ses = m.get("sessions", {})
        if not isinstance(ses, dict) or {"skipped", "error"} & set(ses):
            lines.append(f"| {name} | — | {cell(ses, 'x')} | | | |")
            continue
        for policy, runs in (("", ses), (", rows only", ses.get("rows only", {}))):
            lines += [f"| {name} | {n}{policy} | {v['tokens_per_s']:.0f} | {cell(v, 'vs_1_session', '{:.1f}x')} | "
                      f"{v['ttft_ms']:.1f} / {v['ttft_max_ms']:.1f} | {v.get('on_the_single_step', '—')} |"
                      for n, v in runs.items() if isinstance(v, dict) and "tokens_per_s" in v]
    return lines


SECTIONS = (_paths, _chat, _variants, _variant("graph step, fused", "fused", "graph_fuse"),
            _variant("graph step, frozen", "frozen", "graph_freeze"), _kernels, _long, _recall, _rows, _sessions)
