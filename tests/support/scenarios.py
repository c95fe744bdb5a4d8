"""Scenarios more than one suite runs against its own engine (docs/lifecycle.md)."""

from __future__ import annotations

import threading
import time

import nbengine as nb

from support.requests import WAIT_S, long_params, wait_first_token


def abort_and_readd_race(engine: nb.Engine, request_id: str, rounds: int) -> None:
    """Re-add ``request_id`` as fast as possible while another thread aborts it.

    A re-add is accepted only once the old incarnation is confirmed gone (the old handle
    is done, with finish reason "abort"), and the new one always runs in full: exactly
    its 3 tokens, never a token of the old one.
    """
    for _ in range(rounds):
        h = engine.generate("Once", long_params(), request_id=request_id)
        wait_first_token(h)
        t = threading.Thread(target=engine.abort, args=(request_id,))
        t.start()
        while True:
            try:
                new = engine.generate(
                    "Once", nb.SamplingParams(max_tokens=3, ignore_eos=True), request_id=request_id
                )
            except nb.RequestIdInUseError:
                time.sleep(0.0002)
                continue
            assert h.done()  # accepted only once the old incarnation was final
            break
        t.join(WAIT_S)
        r = new.result(timeout=WAIT_S)
        assert len(r.outputs[0].token_ids) == 3 and r.outputs[0].finish_reason == "length"
        assert h.final_output is not None
        assert h.final_output.outputs[0].finish_reason == "abort"
