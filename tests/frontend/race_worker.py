"""One copy of the abort/re-add race, run in its own process by test_race_processes.py.

``run_race(model_dir)`` starts "abort-a" with max_tokens=100000, waits for its first
delta, aborts it, re-adds "abort-a" with max_tokens=3 and returns the tokens it got.
"""

from __future__ import annotations

import os
import sys


def _warm_imports() -> None:
    """Run once in the forkserver: torch's lazy imports (meta-device decompositions used
    while building a model) would otherwise cost every child seconds."""
    import torch

    from nbengine.ops.rotary import rope_inv_freq

    with torch.device("meta"):
        rope_inv_freq(8, 10000.0)


_warm_imports()


def run_race(
    model_dir: str, speculative_config: dict[str, object] | None = None
) -> tuple[int, int, str | None, str | None]:
    import torch

    torch.set_num_threads(1)  # test process on a 2-core machine; not library code
    import nbengine as nb

    kw = dict(
        num_kv_blocks=64, block_size=16, max_num_seqs=8, speculative_config=speculative_config
    )
    with nb.Engine(model_dir, **kw) as engine:
        h = engine.generate(
            "Once upon a time",
            nb.SamplingParams(
                max_tokens=100_000, ignore_eos=True, output_kind=nb.RequestOutputKind.DELTA
            ),
            request_id="abort-a",
        )
        it = iter(h)
        first = next(it)
        assert first.outputs[0].token_ids, "the first delta has a token"
        final = engine.abort("abort-a")
        h2 = engine.generate(
            "Once upon a time",
            nb.SamplingParams(
                max_tokens=3, ignore_eos=True, output_kind=nb.RequestOutputKind.DELTA
            ),
            request_id="abort-a",
        )
        n = sum(len(o.outputs[0].token_ids) for o in h2)
        return (
            os.getpid(),
            n,
            final.outputs[0].finish_reason if final is not None else None,
            h2.result().outputs[0].finish_reason,
        )


if __name__ == "__main__":
    print(run_race(sys.argv[1]))
