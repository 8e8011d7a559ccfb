"""The tables of `bench/gpu.py`'s results (results.md and the end of its log)."""

from __future__ import annotations


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


def table(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"{env.get('date', '')}, {env.get('card', '')}, torch {env.get('torch', '')}, transformers "
             f"{env.get('transformers', '')}, {env.get('dtype', '')}, greedy, random weights, inductor "
             f"{env.get('inductor', 'defaults')}", "",
             "| model | transformers eager ms/token | transformers static ms/token (compile s) | our eager loop "
             "ms/token | graph step ms/token (compile s) | graph step's first greedy tokens = eager generate's | "
             "bound ms/token | graph / bound | graph / tf static | TTFT ms: tf eager / tf static / graph |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        g, s = m.get("graph step", {}), m.get("transformers static generate", {})
        bound = m.get("bound_ms_per_token")
        ratio = lambda a, b: f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "—"  # noqa: E731
        gms, sms = g.get("ms_per_token") if isinstance(g, dict) else None, s.get("ms_per_token") if isinstance(s, dict) else None
        lines.append(
            f"| {name} ({m.get('weights_gb', 0):.2f} GB) | {cell(m.get('transformers eager generate'), 'ms_per_token')} | "
            f"{cell(s, 'ms_per_token')} ({cell(s, 'compile_and_first_calls_s', '{:.0f}')}) | "
            f"{cell(m.get('our eager loop'), 'ms_per_token')} | {cell(g, 'ms_per_token')} "
            f"({cell(g, 'compile_s', '{:.0f}')}) | {g.get('agrees_with_eager', '—') if isinstance(g, dict) else '—'} | "
            f"{f'{bound:.3f}' if bound else '—'} | "
            f"{ratio(bound, gms)} | {ratio(gms, sms)} | {cell(m.get('transformers eager generate'), 'ttft_ms', '{:.1f}')} / "
            f"{cell(s, 'ttft_ms', '{:.1f}')} / {cell(g, 'ttft_ms', '{:.1f}')} |")
    lines += ["", "| model | graph step ms/token | the chat's answer on it ms/token (events, detokenizer, criteria) | "
              "same tokens | sampled with every page processor ms/token (/ the step, in the graph) |",
              "|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        c, p = m.get("chat on the graph step", {}), m.get("graph step, every page processor", {})
        lines.append(f"| {name} | {cell(m.get('graph step'), 'ms_per_token')} | {cell(c, 'ms_per_token')} | "
                     f"{c.get('same_tokens_as_the_step', '—') if isinstance(c, dict) else '—'} | "
                     f"{cell(p, 'ms_per_token')} ({cell(p, 'vs_the_step')}, "
                     f"{p.get('in_graph', '—') if isinstance(p, dict) else '—'}) |")
    lines += ["", "| model | graph step ms/token (memory GB) | frozen (`model.graph_freeze`) ms/token (memory GB, "
              "compile s) | frozen / plain | frozen's first greedy tokens = eager generate's | same tokens as the plain "
              "step |", "|---|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        g, f = m.get("graph step", {}), m.get("graph step, frozen", {})
        lines.append(f"| {name} | {cell(g, 'ms_per_token')} ({cell(g, 'memory_gb')}) | {cell(f, 'ms_per_token')} "
                     f"({cell(f, 'memory_gb')}, {cell(f, 'compile_s', '{:.0f}')}) | {cell(f, 'vs_the_step')} | "
                     f"{f.get('agrees_with_eager', '—') if isinstance(f, dict) else '—'} | "
                     f"{f.get('same_tokens_as_the_step', '—') if isinstance(f, dict) else '—'} |")
    lines += ["", "| model | graph step ms/token | kernels a token | their time ms/token (of the step) | the most time, "
              "µs a token (count) |", "|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        g, k = m.get("graph step", {}), m.get("graph step, kernels", {})
        lines.append(f"| {name} | {cell(g, 'ms_per_token')} | {cell(k, 'per_call', '{:.0f}')} | "
                     f"{cell(k, 'busy_ms_per_call')} ({cell(k, 'busy_of_the_step')}) | {busiest(k)} |")
    lines += ["", "| model | recall at memories | part | kernels | their time ms | the most time, µs (count) |",
              "|---|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        for size, r in (m.get("recall") or {}).items():
            for part in ("head", "span"):
                if isinstance(r, dict) and isinstance(k := r.get(f"{part}_kernels"), dict):
                    lines.append(f"| {name} | {int(size):,} | {part} | {cell(k, 'per_call', '{:.0f}')} | "
                                 f"{cell(k, 'busy_ms_per_call', '{:.3f}')} | {busiest(k)} |")
    lines += ["", "| model | graph step ms/token (memory GB) | fused (`model.graph_fuse`) ms/token (memory GB, "
              "compile s) | fused / plain | fused's first greedy tokens = eager generate's | same tokens as the plain "
              "step |",
              "|---|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        g, f = m.get("graph step", {}), m.get("graph step, fused", {})
        lines.append(f"| {name} | {cell(g, 'ms_per_token')} ({cell(g, 'memory_gb')}) | {cell(f, 'ms_per_token')} "
                     f"({cell(f, 'memory_gb')}, {cell(f, 'compile_s', '{:.0f}')}) | {cell(f, 'vs_the_step')} | "
                     f"{f.get('agrees_with_eager', '—') if isinstance(f, dict) else '—'} | "
                     f"{f.get('same_tokens_as_the_step', '—') if isinstance(f, dict) else '—'} |")
    lines += ["", "| model | graph step ms/token | on a long cache: positions | ms/token | / the step |", "|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        g, long = m.get("graph step", {}), m.get("graph step, long cache", {})
        lines.append(f"| {name} | {cell(g, 'ms_per_token')} | {cell(long, 'positions', '{:,}')} | "
                     f"{cell(long, 'ms_per_token')} | {cell(long, 'vs_the_step')} |")
    lines += ["", "| model | recall: memories | head ms | 16-slot span ms | in decode steps | in decode steps of the "
              "frozen step |", "|---|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        r = m.get("recall", {})
        if isinstance(r, dict) and not ({"skipped", "error"} & set(r)):
            for size, v in r.items():
                lines.append(f"| {name} | {int(size):,} | {v['head_ms']:.3f} | {v['span_ms']:.3f} | "
                             f"{v['decode_steps']:.2f} | {cell(v, 'decode_steps_of_the_frozen_step')} |")
        else:
            lines.append(f"| {name} | — | {cell(r, 'x')} | | | |")
    lines += ["", "| model | path, rows | ms/step | aggregate tokens/s | rows / 1 row, aggregate tokens/s |",
              "|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        for k, v in m.items():
            if "rows" in k:
                lines.append(f"| {name} | {k} | {cell(v, 'ms_per_token')} | {cell(v, 'tokens_per_s', '{:.0f}')} | "
                             f"{cell(v, 'vs_1_row', '{:.1f}x')} |")
    lines += ["", "| model | chat sessions at once (the service) | aggregate tokens/s | / 1 session | TTFT ms median / max |",
              "|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        ses = m.get("sessions", {})
        if not isinstance(ses, dict) or {"skipped", "error"} & set(ses):
            lines.append(f"| {name} | — | {cell(ses, 'x')} | | |")
            continue
        for policy, runs in (("", ses), (", rows only", ses.get("rows only", {}))):
            for n, v in runs.items():
                if isinstance(v, dict) and "tokens_per_s" in v:
                    lines.append(f"| {name} | {n}{policy} | {v['tokens_per_s']:.0f} | "
                                 f"{cell(v, 'vs_1_session', '{:.1f}x')} | {v['ttft_ms']:.1f} / {v['ttft_max_ms']:.1f} |")
    return "\n".join(lines) + "\n"
