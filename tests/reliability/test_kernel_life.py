"""Life inside a real Jupyter kernel (jupyter_client + ipykernel, the venv's python).

- Re-executing the cell that creates an Engine: the old engine, no longer referenced,
  is freed and its threads stop; while something (a handle) still references it,
  it keeps working.
- Process memory returns after shutdown.
- A kernel interrupt during sync iteration of a handle ends the request as
  FINISHED_ABORTED with the core's confirmation; the next cell can reuse the id. In an
  async cell (``await h``, ``async for``) the cell's task is cancelled, and the request is
  confirmed aborted before the cancellation reaches the cell's code.
- An engine left running when the kernel shuts down exits cleanly (no kill, no hang).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from nbengine.testing import make_tiny_model

from .sizes import ENGINE_KW, TINY

pytestmark = pytest.mark.slow
CELL_TIMEOUT = 120.0


class Kernel:
    """A started kernel and a client; ``run`` executes one cell and returns its output."""

    def __init__(self) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.shutdown_wait_time = 60.0  # a clean exit is never cut short by a kill
        self.km.start_kernel(env=_kernel_env())
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = CELL_TIMEOUT, allow_error: bool = False) -> str:
        out: list[str] = []
        errors: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            kind = msg["msg_type"]
            content = msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "execute_result":
                out.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                errors.append(f"{content['ename']}: {content['evalue']}")

        # stop_on_error=False for a cell that may fail: ipykernel sends the error reply
        # first and only then starts aborting its queue, so a next cell sent at once can
        # land in that window and come back "aborted" (seen on a loaded machine).
        reply = self.kc.execute_interactive(
            code, timeout=timeout, output_hook=hook, stop_on_error=not allow_error
        )
        if errors and not allow_error:
            raise AssertionError(f"cell failed: {errors}\n{code}")
        if allow_error:
            return "".join(out) + "".join(f"\nERROR {e}" for e in errors)
        assert reply["content"]["status"] == "ok"
        return "".join(out)

    def interrupt_once_streaming(self, msg_id: str, settle_s: float = 0.0) -> dict[str, Any]:
        """Wait until the cell ``msg_id`` prints 'streaming', then ``settle_s`` more,
        interrupt the kernel (SIGINT) and return that cell's reply."""
        deadline = time.monotonic() + CELL_TIMEOUT
        seen = False
        while not seen and time.monotonic() < deadline:
            msg = self.kc.get_iopub_msg(timeout=CELL_TIMEOUT)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                seen = "streaming" in msg["content"]["text"]
        assert seen
        time.sleep(settle_s)
        self.km.interrupt_kernel()
        reply: dict[str, Any] = self.kc.get_shell_msg(timeout=CELL_TIMEOUT)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=CELL_TIMEOUT)
        return reply

    def json(self, expr: str) -> Any:
        return json.loads(self.run(f"import json as _j; print(_j.dumps({expr}))").strip())

    def shutdown(self, timeout: float = 60.0) -> tuple[float, int | None]:
        """Ask the kernel to exit; return (seconds it took, its exit code)."""
        proc = self.km.provisioner.process  # type: ignore[union-attr]
        self.kc.stop_channels()
        t0 = time.monotonic()
        self.km.shutdown_kernel(now=False)
        code = proc.wait(timeout=timeout) if proc is not None else None
        return time.monotonic() - t0, code


def _kernel_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


SETUP = """
import gc, threading, os
import psutil
import nbengine as nb
# The widget modules an engine preloads in a kernel (once per process, on a short-lived
# "nbengine-preload" thread) are imported up front, so memory figures measure engines.
import ipywidgets, pandas, plotly.graph_objects as go
go.FigureWidget
MODEL = {model!r}
KW = {kw!r}
def engine_threads():  # threads owned by engines; the one-shot preload thread is no engine's
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("nbengine") and t.name != "nbengine-preload")
def rss_mb():
    return psutil.Process(os.getpid()).memory_info().rss / 2**20
def settle():
    import time
    for _ in range(100):
        gc.collect()
        if not any(t.name in ("nbengine-reaper", "nbengine-preload")
                   for t in threading.enumerate()):
            break
        time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def kernel(tiny_model: Path) -> Iterator[Kernel]:
    k = Kernel()
    try:
        k.run(SETUP.format(model=str(tiny_model), kw=ENGINE_KW))
        yield k
    finally:
        try:
            k.shutdown()
        except Exception:
            k.km.shutdown_kernel(now=True)


def test_reexecuting_the_engine_cell(kernel: Kernel) -> None:
    cell = "engine = nb.Engine(MODEL, **KW)\n"
    kernel.run(cell)
    assert kernel.json("engine_threads()") == ["nbengine-core", "nbengine-loop"]
    # A handle of the first engine keeps it alive and working across the re-execution.
    kernel.run(
        "h_old = engine.generate('Once upon', "
        "nb.SamplingParams(max_tokens=100000, ignore_eos=True))"
    )
    kernel.run(cell)
    assert kernel.json("len(engine_threads())") == 4  # both engines run
    kernel.run("n0 = len(h_old.token_ids); import time; time.sleep(0.3)")
    assert kernel.json("len(h_old.token_ids) > n0 and not h_old.done()")
    assert (
        kernel.json(
            "engine.generate('Hi', nb.SamplingParams(max_tokens=3, ignore_eos=True))"
            ".result(60).outputs[0].finish_reason"
        )
        == "length"
    )
    # Once nothing references the old engine, it is shut down and its threads end.
    assert kernel.json("h_old.cancel(60).outputs[0].finish_reason") == "abort"
    kernel.run("del h_old; settle()")
    assert kernel.json("engine_threads()") == ["nbengine-core", "nbengine-loop"]
    # Re-executing with no handle around frees the old engine at once.
    kernel.run(cell)
    kernel.run("settle()")
    assert kernel.json("engine_threads()") == ["nbengine-core", "nbengine-loop"]
    kernel.run("engine.shutdown(); settle()")
    assert kernel.json("engine_threads()") == []


def test_displayed_handles_do_not_keep_a_reexecuted_engine_alive(kernel: Kernel) -> None:
    """The README's flow: display a handle (its widget then lives in the ipywidgets
    registry, the handle in Out[n]), let it finish, re-execute the engine cell. The old
    engine is freed: a finished handle holds its engine only weakly."""
    kernel.run("engine = nb.Engine(MODEL, **KW)")
    shown = kernel.run(
        "h = engine.generate('Once upon', nb.SamplingParams(max_tokens=6, "
        "ignore_eos=True), request_id='shown')\nh"
    )
    assert "RequestHandle(request_id='shown')" in shown
    assert kernel.json("type(h.widget()).__name__") == "HandleWidget"
    assert kernel.json("len(h.result(60).outputs[0].token_ids)") == 6
    kernel.run("engine = nb.Engine(MODEL, **KW)")
    kernel.run("settle()")
    assert kernel.json("engine_threads()") == ["nbengine-core", "nbengine-loop"]
    # The old handle still shows its final state (its widget needs no engine).
    assert kernel.json("[h.text == h.final_output.outputs[0].text, h.status.name]") == [
        True,
        "FINISHED_LENGTH_CAPPED",
    ]
    kernel.run("engine.shutdown(); settle()")
    assert kernel.json("engine_threads()") == []


def test_memory_returns_after_shutdown(kernel: Kernel) -> None:
    # A KV cache big enough to see: 40000 blocks x 16 tokens x 2 layers x K,V x 2 heads x 8
    # floats = 312 MiB allocated (zero pages are committed lazily: RSS grows ~180 MiB).
    kernel.run("settle(); before = rss_mb()")
    kernel.run(
        "big = nb.Engine(MODEL, num_kv_blocks=40000, block_size=16)\n"
        "big.generate('Once upon', nb.SamplingParams(max_tokens=4)).result(60)\n"
        "during = rss_mb()\n"
        "big.shutdown(); del big; settle(); after = rss_mb()"
    )
    before, during, after = kernel.json("[before, during, after]")
    assert during - before > 100, (before, during, after)  # the cache was really there
    assert after - before < 40, f"RSS {before:.0f} -> {during:.0f} -> {after:.0f} MiB"
    assert kernel.json("engine_threads()") == []


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 64k-token context: a request that cannot finish by length
    before an interrupt lands, however slowly a loaded machine delivers it (the engine
    keeps generating while the cell sleeps)."""
    cfg = {**TINY, "max_position_embeddings": 1 << 16}
    return make_tiny_model(tmp_path_factory.mktemp("long") / "llama", arch="llama", **cfg)


@pytest.mark.parametrize("where", ["in the handle's wait", "in the loop body"])
def test_interrupt_during_sync_iteration_aborts_with_confirmation(
    kernel: Kernel, long_model: Path, where: str
) -> None:
    # In the loop body, the interrupt hits user code while the handle's iterator is
    # merely suspended; the kernel hook must still cancel the request.
    body_sleep = "        time.sleep(30)\n" if where == "in the loop body" else ""
    kernel.run(f"eng = nb.Engine({str(long_model)!r}, num_kv_blocks=8192, block_size=8)")
    msg_id = kernel.kc.execute(  # stop_on_error=False: see Kernel.run
        "import time\n"
        "h = eng.generate('Once upon', nb.SamplingParams(max_tokens=100000, ignore_eos=True),"
        " request_id='intr')\n"
        "for i, out in enumerate(h):\n"
        "    if i == 2:\n"
        "        print('streaming', flush=True)\n" + body_sleep,
        stop_on_error=False,
    )
    # Wait until the loop is really iterating, then interrupt the kernel (SIGINT).
    reply = kernel.interrupt_once_streaming(msg_id)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    # The next cell sees the confirmed abort ...
    state = kernel.json(
        "[h.status.name, h.done(), h.final_output.outputs[0].finish_reason,"
        " eng.num_unfinished_requests()]"
    )
    assert state == ["FINISHED_ABORTED", True, "abort", 0]
    # ... and can reuse the id at once.
    out = kernel.json(
        "eng.generate('Again', nb.SamplingParams(max_tokens=3, ignore_eos=True),"
        " request_id='intr').result(60).outputs[0].finish_reason"
    )
    assert out == "length"
    kernel.run("eng.shutdown(); settle()")
    assert kernel.json("engine_threads()") == []


@pytest.mark.parametrize("way", ["await h", "async for"])
def test_interrupt_in_an_async_cell_aborts_before_it_propagates(
    kernel: Kernel, long_model: Path, way: str
) -> None:
    """Top-level await: ipykernel turns the interrupt into a cancellation of the cell's
    task. The cell's own ``except`` already sees the request confirmed aborted."""
    wait = "    await h\n" if way == "await h" else "    async for out in h:\n        pass\n"
    kernel.run(f"eng = nb.Engine({str(long_model)!r}, num_kv_blocks=8192, block_size=8)")
    msg_id = kernel.kc.execute(  # stop_on_error=False: see Kernel.run
        "import asyncio\n"
        "h = eng.generate('Once upon', nb.SamplingParams(max_tokens=100000, ignore_eos=True,"
        " output_kind=nb.RequestOutputKind.DELTA), request_id='aintr')\n"
        "caught = None\n"
        "while not h.token_ids:\n"
        "    await asyncio.sleep(0.01)\n"
        "print('streaming', flush=True)\n"
        "try:\n" + wait + "except BaseException as exc:\n"
        "    caught = [type(exc).__name__, h.status.name]\n"
        "    raise\n",
        stop_on_error=False,
    )
    # settle_s: the cell is in its wait on the handle by then.
    reply = kernel.interrupt_once_streaming(msg_id, settle_s=0.2)
    assert reply["content"]["status"] == "error"
    assert kernel.json("caught") == ["CancelledError", "FINISHED_ABORTED"]
    out = kernel.json(
        "eng.generate('Again', nb.SamplingParams(max_tokens=3, ignore_eos=True),"
        " request_id='aintr').result(60).outputs[0].finish_reason"
    )
    assert out == "length"
    kernel.run("eng.shutdown(); settle()")
    assert kernel.json("engine_threads()") == []


def test_kernel_shutdown_with_a_running_engine_exits_cleanly(tiny_model: Path) -> None:
    k = Kernel()
    try:
        k.run(SETUP.format(model=str(tiny_model), kw=ENGINE_KW))
        k.run(
            "engine = nb.Engine(MODEL, **KW)\n"
            "hs = [engine.generate(f'req {i}', nb.SamplingParams(max_tokens=100000, "
            "ignore_eos=True)) for i in range(3)]"
        )
        assert k.json("[h.status.name for h in hs if h.done()]") == []
        took, code = k.shutdown()
    except BaseException:
        k.km.shutdown_kernel(now=True)
        raise
    assert code == 0, f"the kernel did not exit cleanly (exit code {code})"
    assert took < 30, f"kernel shutdown took {took:.1f} s"
    assert not k.km.is_alive()
