"""The decode steps a loaded model compiles in the background at start (`model.graph_step`, `model.graph_rows`,
`model.compile`): answers decode in the loop, eagerly, until each step is ready, and the status line says so."""

from __future__ import annotations

import threading

from chat.config import Config
from decoding import compiled, graph, graph_rows
from models import LoadedModel
from models.spec import COMPILE


class WarmUp:
    """One server's background compile. Thread-safe: `stop` (at shutdown) ends it after the graph it is compiling,
    and none starts after it (a model that was still loading when the server closed)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.running: tuple[threading.Thread, list] | None = None  # the thread, and the steps it warms up
        self._lock = threading.Lock()
        self._closing = False

    def start(self, lm: LoadedModel) -> None:
        """For a model on transformers: with `model.graph_step`, warm up the graph step (`decoding.graph`: compiled
        and captured on CUDA, eager elsewhere) and its rows (`model.graph_rows`), then with `model.compile` compile
        the loop's decode step (text models)."""
        if not lm.spec.can(COMPILE):
            return
        steps: list = []  # (what warms up, how)
        model_cfg = self.cfg.model
        if lm.device.type == "cuda" if model_cfg.graph_step == "auto" else bool(model_cfg.graph_step):
            model = lm.merged()
            shape = dict(max_slots=self.cfg.memory.max_slots, max_len=model_cfg.graph_max_len,
                         compile=lm.device.type == "cuda", freeze=model_cfg.graph_freeze, fuse=model_cfg.graph_fuse,
                         matvec=model_cfg.graph_matvec, gqa=model_cfg.graph_gqa, autotune=model_cfg.graph_autotune)
            graphs = [graph.enable(model, **shape)]
            if model_cfg.graph_rows and not lm.is_vision:  # (the rows take text answers)
                graphs.append(graph_rows.enable_rows(model, rows=model_cfg.graph_rows, **shape))
            configured = dict(settings=(self.cfg.generation,), eos=list(lm.spec.eos_token_ids or []))
            steps += [(g, lambda g=g: g.warm_up(**configured)) for g in graphs]
        if model_cfg.compile and not lm.is_vision:
            step = compiled.enable(lm.merged())
            steps.append((step, step.warm_up))
        if steps:
            thread = threading.Thread(target=lambda: [warm() for _, warm in steps], name="recall-chat-compile",
                                      daemon=True)
            with self._lock:
                if self._closing:
                    return
                thread.start()
                self.running = (thread, [step for step, _ in steps])

    def stop(self) -> None:
        with self._lock:
            self._closing = True
            running, self.running = self.running, None
        if running is not None:
            thread, steps = running
            for step in steps:
                step.stop()
            thread.join()

    @staticmethod
    def state(lm: LoadedModel | None) -> str:
        """"compiling the decode step…" while one compiles, "" otherwise (also when compiling failed or is off)."""
        if lm is None:
            return ""
        rows = graph_rows.attached_rows(lm.model)
        for step in (graph.attached(lm.model), rows, compiled.attached(lm.model)):
            if step is not None and not step.ready.is_set() and not step.error:
                return "compiling the decode step…"
        return ""
