"""Shared fixtures: a temporary data dir and the real embedded model, loaded once per run."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# without a GPU, Triton's kernels (engine/kernels/triton_attention.py) run in its interpreter;
# set before anything imports triton (transformers does, where it is installed), which decorates
# its own library functions once
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import Engine, EngineConfig  # noqa: E402
from engine.chat_format import ChatFormatter
from engine.kernels import cpu_kernels
from engine.model.loader import LoadedModel, load_model, local_tokenizer
from tests.rig import ask, close_sessions, make_engine, make_sessions

__all__ = ["ask", "close_sessions", "make_engine", "make_sessions"]  # where tests import them

if TYPE_CHECKING:  # the upstream rig imports tests.web, which imports this file
    from playwright.sync_api import Browser

    from engine.upstream.backend import UpstreamBackend
    from sessions import SessionManager
    from tests.api_rig import LiveServer
    from tests.fake_upstream import FakeReplica
    from tests.offload_rig import Rig

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir shared by the session's model fixtures (the GGUF is converted once)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def nf4_model(model_dir: Path) -> LoadedModel:
    """The embedded model in the default mode: nf4 weights, float32 compute on crowdchat's
    4-bit kernel (where the kernels could not be built: bf16 where the CPU has it natively)."""
    return load_model(EngineConfig(data_dir=model_dir))


@pytest.fixture(scope="session")
def fp32_model(model_dir: Path) -> LoadedModel:
    """The embedded model unquantized in float32, where batching changes nothing but near ties."""
    return load_model(EngineConfig(data_dir=model_dir, quant="none", dtype="float32"))


@pytest.fixture(scope="session")
def formatter(nf4_model: LoadedModel) -> ChatFormatter:
    return ChatFormatter(nf4_model.tokenizer)


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.Kernel:
    """crowdchat's CPU decode attention kernel; loading it registers every torch.ops.crowdchat
    op the kernel tests call."""
    k = cpu_kernels.decode_attention()
    assert k is not None, "make builds it: python engine/kernels/cpu_kernels.py"
    return k


@pytest.fixture
def nf4_engine(nf4_model: LoadedModel, tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(nf4_model, tmp_path)
    yield engine
    engine.check_integrity()
    engine.shutdown()


@pytest.fixture
def nf4_sessions(nf4_model: LoadedModel, tmp_path: Path) -> Iterator[tuple[Engine, SessionManager]]:
    """An engine and a session manager (make_sessions' defaults) on the test's own data dir."""
    engine, manager = make_sessions(nf4_model, tmp_path)
    yield engine, manager
    close_sessions(engine, manager)


@pytest.fixture(scope="module")
def live(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The API and /metrics on a free port over the embedded model (tests/api_rig.py)."""
    from tests.api_rig import LiveServer

    engine, sessions = make_sessions(nf4_model, tmp_path_factory.mktemp("api"))
    server = LiveServer(engine, sessions)
    yield server
    server.close()
    close_sessions(engine, sessions)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """A KV offloader over a fake engine, a real store and real snapshot files
    (tests/offload_rig.py)."""
    from tests.offload_rig import Rig

    r = Rig(tmp_path)
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """The whole app (tests/web.py's running_server) over the embedded model: (base url,
    engine, session manager)."""
    from tests.web import running_server

    with running_server(nf4_model, tmp_path_factory.mktemp("server")) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's chromium driven by Playwright (tests/browser_rig.py)."""
    from playwright.sync_api import sync_playwright

    from tests.browser_rig import CHROMIUM, FLAGS

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


# -- crowdchat over fake vLLM replicas (tests/upstream_rig.py) --------------------------------


@pytest.fixture(scope="session")
def local(model_dir: Path) -> tuple:
    """The embedded model's tokenizer and facts, read without loading any weights."""
    return local_tokenizer(EngineConfig(data_dir=model_dir))


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[FakeReplica]]:
    from tests.fake_upstream import FakeReplica

    reps = [FakeReplica("r0").start(), FakeReplica("r1").start()]
    yield reps
    for r in reps:
        r.stop()


@pytest.fixture(scope="module")
def served(
    replicas: list[FakeReplica], local: tuple, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, UpstreamBackend, SessionManager, object]]:
    from tests.upstream_rig import upstream_server

    with upstream_server(replicas, tmp_path_factory.mktemp("upstream"), local) as s:
        yield s


@pytest.fixture
def up(served, replicas):  # noqa: ANN001, ANN201
    """The shared server with both replicas alive, healthy, faultless and forgotten."""
    from tests.upstream_rig import wait_for

    url, backend, sm, monitor = served
    for r in replicas:
        if r.server is None:
            r.start()
        r.fault, r.delay, r.words = None, 0.0, 4
        r.requests.clear()
        r.ports.clear()
        r.aborted = r.completed = 0
    for r in backend.router.replicas:
        backend.drain(r.url, draining=False)
    wait_for(lambda: all(r.healthy for r in backend.router.replicas))
    return served
