"""Engine lifecycle: validation, failure, shutdown, threads, and the LLM API."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import nbengine as nb
from nbengine import RequestOutputKind as Kind
from nbengine.config import EngineConfig
from nbengine.model.runner import ModelRunner

from support.models import ENGINE_KW, TINY
from support.requests import long_params
from support.threads import engine_threads


def test_validation_errors_leave_no_state(engine: nb.Engine) -> None:
    p = nb.SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", p)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], p)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([1, 2, 10**6], p)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([-1], p)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([5] * 9000, p)
    with pytest.raises(TypeError, match="request_id"):
        engine.generate("hi", p, request_id=7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sampling_params"):
        engine.generate("hi", {"max_tokens": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        nb.SamplingParams(max_tokens=0)
    assert engine.num_unfinished_requests() == 0
    r = engine.generate([5, 6, 7], p, request_id="ok").result()  # token-id prompts work
    assert r.prompt is None and r.prompt_token_ids == [5, 6, 7] and r.request_id == "ok"


def test_engine_threads_are_named(engine: nb.Engine) -> None:
    assert {"nbengine-loop", "nbengine-core"} <= {t.name for t in engine_threads()}
    assert engine.config.scheduler.max_num_seqs == ENGINE_KW["max_num_seqs"]


class FailingRunner:
    """A real ModelRunner whose execute() raises on the k-th call (test-only hook)."""

    def __init__(self, runner: ModelRunner, fail_at: int) -> None:
        self._runner = runner
        self._calls = 0
        self._fail_at = fail_at
        for name in ("num_kv_blocks", "block_size", "max_model_len", "vocab_size", "eos_token_ids"):
            setattr(self, name, getattr(runner, name))

    def execute(self, batch):  # type: ignore[no-untyped-def]
        self._calls += 1
        if self._calls == self._fail_at:
            raise RuntimeError("boom: injected failure")
        return self._runner.execute(batch)

    def shutdown(self) -> None:
        self._runner.shutdown()


def test_injected_failure_fails_live_requests(tiny_model: Path) -> None:
    config = EngineConfig.from_kwargs(str(tiny_model), **ENGINE_KW)
    runner = FailingRunner(ModelRunner(config), fail_at=10)
    eng = nb.Engine(str(tiny_model), _runner=runner, **ENGINE_KW)
    try:
        handles = [eng.generate("Once", long_params(output_kind=Kind.DELTA)) for _ in range(3)]
        handles.append(eng.generate("Once", long_params(n=2)))
        with pytest.raises(nb.EngineDeadError, match="boom"):
            for _ in handles[0]:
                pass
        for h in handles[1:]:
            with pytest.raises(nb.EngineDeadError, match="boom"):
                h.result(timeout=60)
            assert h.done() and h.status is nb.RequestStatus.FINISHED_ERROR
            assert h.final_output is not None
            assert {c.finish_reason for c in h.final_output.outputs} == {"error"}
        assert eng.num_unfinished_requests() == 0 and not eng.is_alive
        with pytest.raises(nb.EngineDeadError, match="boom"):
            eng.generate("Once", nb.SamplingParams(max_tokens=2))
        assert eng.abort("anything") is None
    finally:
        eng.shutdown()


def test_shutdown_fails_live_requests_and_a_new_engine_works(tiny_model: Path) -> None:
    eng = nb.Engine(str(tiny_model), **ENGINE_KW)
    h = eng.generate("Once", long_params())
    eng.shutdown()
    eng.shutdown()  # idempotent
    with pytest.raises(nb.EngineDeadError):
        h.result(timeout=10)
    with pytest.raises(nb.EngineDeadError):
        eng.generate("Once")
    assert h.status.name.startswith("FINISHED")
    assert not eng.loop_running and not eng._core_thread.is_alive()
    with nb.Engine(str(tiny_model), **ENGINE_KW) as eng2:
        r = eng2.generate("Once", nb.SamplingParams(max_tokens=4, ignore_eos=True)).result()
        assert len(r.outputs[0].token_ids) == 4
        threads = [eng2._bridge.thread, eng2._core_thread]
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def test_llm_generate_order_and_params_list(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with nb.LLM(str(tiny_model), **ENGINE_KW) as llm:
        prompts = ["Once upon", "The cat", [5, 6, 7], "Hi"]
        params = [nb.SamplingParams(max_tokens=k, ignore_eos=True, seed=k) for k in (7, 3, 5, 1)]
        outs = llm.generate(prompts, params, use_tqdm=True)
        assert [len(o.outputs[0].token_ids) for o in outs] == [7, 3, 5, 1]
        assert [o.prompt for o in outs] == ["Once upon", "The cat", None, "Hi"]
        assert all(o.finished for o in outs)
        assert "toks/s" in capsys.readouterr().err
        # Same seed, same prompt -> same output as through the Engine (order is kept).
        single = llm.generate("The cat", params[1], use_tqdm=False)
        assert len(single) == 1 and single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
        assert capsys.readouterr().err == ""
        with pytest.raises(ValueError, match="2 sampling params for 4 prompts"):
            llm.generate(prompts, params[:2])
        n3 = llm.generate(
            ["Hi"] * 3, nb.SamplingParams(n=3, max_tokens=2, ignore_eos=True), use_tqdm=False
        )
        assert [len(o.outputs) for o in n3] == [3, 3, 3]
        assert llm.engine.num_unfinished_requests() == 0


SCRIPT = """
import sys
import nbengine as nb
engine = nb.Engine(sys.argv[1], num_kv_blocks=64)
h = engine.generate("Once", nb.SamplingParams(max_tokens=100000, ignore_eos=True))
r = engine.generate("Once", nb.SamplingParams(max_tokens=3, ignore_eos=True)).result()
print("tokens", len(r.outputs[0].token_ids), flush=True)
# exits with a live request and without shutdown(): the atexit hook must stop the engine
"""


def test_plain_script_exits_without_shutdown(tiny_model: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_model)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "tokens 3" in proc.stdout


DROPPED_SCRIPT = """
import sys
import nbengine as nb
def main():
    llm = nb.LLM(sys.argv[1], num_kv_blocks=64)
    out = llm.generate(["Once"], nb.SamplingParams(max_tokens=3, ignore_eos=True))
    print("tokens", len(out[0].outputs[0].token_ids), flush=True)
main()
# the LLM is unreferenced now (a reference cycle holds it until the GC runs): at exit it
# is reaped, and the process must still exit cleanly
"""


def test_script_exits_cleanly_after_dropping_an_llm(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """An ``LLM`` made inside a function that returned is freed by its finalizer's reaper
    thread; interpreter exit waits for that thread. (Before, a reaper still freeing the
    model when the interpreter finalized was ended mid-free, and the process aborted:
    exit status 134, "terminate called without an active exception". bfloat16 weights:
    the model's tensors are then views of the mapped checkpoint, whose deleters take the
    GIL.)"""
    import subprocess
    import sys

    tiny_model = tiny_model_factory("llama", **TINY, weights_dtype="bfloat16")
    script = tmp_path / "script.py"
    script.write_text(DROPPED_SCRIPT)
    for _ in range(2):  # the abort came from a race; it lost it nearly every time
        proc = subprocess.run(
            [sys.executable, str(script), str(tiny_model)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "tokens 3" in proc.stdout and "terminate called" not in proc.stderr


def test_output_handler_failure_fails_requests_and_later_adds(tiny_model: Path) -> None:
    with nb.Engine(str(tiny_model), **ENGINE_KW) as eng:
        h = eng.generate("Once", long_params(output_kind=Kind.DELTA))
        it = iter(h)
        next(it)
        real = eng._processor.process

        def broken(batch):  # type: ignore[no-untyped-def]
            raise RuntimeError("handler exploded")

        eng._processor.process = broken  # type: ignore[method-assign]
        with pytest.raises(nb.EngineDeadError, match="handler exploded"):
            for _ in it:
                pass
        eng._processor.process = real  # type: ignore[method-assign]
        with pytest.raises(nb.EngineDeadError, match="handler exploded"):
            eng.generate("Once")
        assert eng.num_unfinished_requests() == 0
