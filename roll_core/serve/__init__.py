"""`roll serve`: the Tinker training API (PyPI ``tinker``, tinker-cookbook) on this machine.

``service.py`` holds the state and one method per route, ``server.py`` the HTTP side,
``trainer.py`` a training client's LoRA model, ``sampler.py`` a sampling session's engine,
``futures.py`` the futures protocol, ``wire.py`` the protobuf messages. See docs/serve.md.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from roll_core.config.serve import ServeConfig


def serve_plan(cfg: ServeConfig) -> list[tuple[str, str]]:
    """What `roll serve --dry-run` prints: one (what, how) row per part."""
    rows = [
        (f"model {m.name}", f"{m.path} (max context {m.max_context_length})") for m in cfg.models
    ]
    rows += [
        (
            "training",
            f"{cfg.train.backend} backend, LoRA rank <= {cfg.lora.max_rank}, "
            f"alpha {cfg.lora.alpha}, device {cfg.train.device}, {cfg.train.precision}",
        ),
        ("sampling", _sampling_plan(cfg)),
        ("executor", cfg.executor),
        ("listen", f"http://{cfg.host}:{cfg.port} (TINKER_BASE_URL)"),
        ("checkpoints", cfg.checkpoints_dir),
    ]
    return rows


def _sampling_plan(cfg: ServeConfig) -> str:
    s = cfg.sample
    if s.engine == "vllm":
        engines = len({m.path for m in cfg.models})
        return (
            f"vllm: {engines} engine(s), one per model directory, started with the server; "
            f"each sampling session a LoRA adapter loaded per request (up to {s.max_samplers} "
            f"sessions, rank <= {cfg.lora.max_rank}); {s.max_num_seqs} sequences at a time; "
            f"KV cache {s.cpu_kv_cache_gb or 1.0} GiB on the CPU build"
        )
    return (
        f"hf: one engine per sampling session (up to {s.max_samplers}), holding its merged "
        f"weights; {s.max_num_seqs} sequences at a time"
    )


def serve(
    cfg: ServeConfig,
    *,
    on_ready: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve until `stop` is set, or SIGINT / SIGTERM (then Interrupted); `on_ready` gets the
    base URL."""
    from roll_core.errors import ConfigError, Interrupted
    from roll_core.models import load_tokenizer
    from roll_core.models.loading import resolve_model_path
    from roll_core.serve.server import TinkerServer
    from roll_core.serve.service import TinkerService

    for m in cfg.models:  # a missing model or tokenizer fails now, not at a client's request
        resolve_model_path(m.path)
        load_tokenizer(m.tokenizer or m.path)
    service = TinkerService(cfg)
    try:
        server = TinkerServer(service, cfg.host, cfg.port)
    except OSError as err:
        service.close()
        raise ConfigError(
            f"cannot listen on {cfg.host}:{cfg.port}: {err.strerror or err}.",
            hint="Pick another `port` in the recipe (or port=0 for any free one).",
        ) from None
    stopping = stop or threading.Event()
    got: list[str] = []

    def on_signal(num: int, _frame: object) -> None:
        got.append(signal.Signals(num).name)
        stopping.set()
        # the stop waits for the running training request; a second signal stops at once
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    if threading.current_thread() is threading.main_thread():  # Ctrl-C and SIGTERM stop it
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
    server.start()
    if on_ready is not None:
        on_ready(f"http://{cfg.host}:{server.port}")
    try:
        while not stopping.wait(1.0):
            pass
    finally:
        server.close()
    if got:
        raise Interrupted(
            f"roll serve stopped ({got[0]}); checkpoints saved under {cfg.checkpoints_dir} "
            "are loaded again by the next `roll serve` on the same directory."
        )
